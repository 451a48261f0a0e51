#!/usr/bin/env bash
# Builds, here (where Rust is), the stripped x86-64 binaries the GPU suite runs on a CUDA
# machine that has no Rust toolchain: the CUDA test binary, the decode benchmark and `strix`.
# They land in .gpu/ (git-ignored); copy that folder and scripts/gpu/run.sh to the GPU host.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu
tests=$(cargo test -p strix --test cuda --release --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')
cargo build --release -p strix --example cuda_decode_bench
cargo build --release -p strix-cli
cp "$tests" .gpu/cuda-tests
cp target/release/examples/cuda_decode_bench target/release/strix .gpu/
strip .gpu/cuda-tests .gpu/cuda_decode_bench .gpu/strix
du -sh .gpu
