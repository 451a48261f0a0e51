#!/usr/bin/env bash
# Builds, here (where Rust is), the stripped x86-64 binaries the GPU suite runs on a CUDA
# machine that has no Rust toolchain: the CUDA test binaries (bf16 and packed weights), the
# decode, bf16 GEMV, packed-GEMV, prefill and GDN-decode benchmarks, `strix` and the CLI's test
# binary (whose `device_*` tests run the prebuilt `strix` on the GPU).
# They land in .gpu/ (git-ignored), or in the folder given as the first argument; copy that
# folder and scripts/gpu/run.sh to the GPU host. Honours CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.gpu}
mkdir -p "$out"
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
# The path of test binary $2 of package $1, built in release mode.
test_binary() {
  cargo test -p "$1" --test "$2" --release --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$2"
}
tests=$(test_binary strix cuda)
quant_tests=$(test_binary strix cuda_quant)
cli_tests=$(test_binary strix-cli cli)
cargo build --release -p strix --example cuda_decode_bench --example cuda_quant_bench --example cuda_gemv_bench \
  --example cuda_prefill_bench --example cuda_gdn_bench
cargo build --release -p strix-cli
cp "$tests" "$out/cuda-tests"
cp "$quant_tests" "$out/cuda-quant-tests"
cp "$cli_tests" "$out/cli-tests"
for example in cuda_decode_bench cuda_quant_bench cuda_gemv_bench cuda_prefill_bench cuda_gdn_bench; do
  cp "$target/release/examples/$example" "$out/"
done
cp "$target"/release/strix "$out/"
(cd "$out" && strip cuda-tests cuda-quant-tests cli-tests cuda_*_bench strix)
du -sh "$out"
