#!/usr/bin/env bash
# The whole GPU suite from prebuilt binaries (scripts/gpu/build.sh), on a CUDA 13 machine:
# the CUDA tests (every kernel against the CPU backend, the transformers fixtures), the decode
# benchmark, the bf16 GEMV benchmark (tensor-core vs CUDA-core kernels), the `strix` CLI on
# the GPU (`--device cuda` against the goldens of the bf16 fixtures), and `strix bench --device
# cuda` on the 0.8B and 9B shapes (JSON in LOGDIR/bench-0.8b.json, bench-9b.json; tables in
# the .log beside them).
# Usage: scripts/gpu/run.sh LOGDIR  — full logs go to LOGDIR, a summary to stdout; the
# binaries come from .gpu/, or from GPU_DIR (scripts/gpu/build.sh DIR).
# SANITIZE=SECONDS also runs compute-sanitizer memcheck over the op tests; SKIP_DECODE_BENCH=1
# skips the per-op decode benchmark; QUANTS="q8_0 q4_0 q4_k" adds 9B decode with quantized weights.
set -uo pipefail
cd "$(dirname "$0")/../.."
logs=${1:?usage: scripts/gpu/run.sh LOGDIR}
bin=${GPU_DIR:-./.gpu}
mkdir -p "$logs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$logs/env.txt" 2>&1
status=0
echo "== tests"
$bin/cuda-tests --test-threads=1 --include-ignored --nocapture > "$logs/tests.log" 2>&1 || status=1
STRIX_FIXTURES=tests/fixtures/models $bin/cuda-quant-tests --test-threads=1 --include-ignored --nocapture >> "$logs/tests.log" 2>&1 ||
  status=1
grep -E "^test .*(FAILED|ok)$|test result|panicked|skipped" "$logs/tests.log"
if [ -z "${SKIP_DECODE_BENCH:-}" ]; then
  echo "== decode benchmark"
  timeout 300 $bin/cuda_decode_bench ${BENCH_ARGS:-} > "$logs/bench.log" 2>&1 || status=1
  tail -25 "$logs/bench.log"
fi
echo "== bf16 GEMV benchmark (tensor-core vs CUDA-core, every tiling)"
timeout 120 $bin/cuda_gemv_bench --quick > "$logs/gemv-bench.log" 2>&1 || status=1
grep -E "cuda-core|tensor-core" "$logs/gemv-bench.log"
echo "== packed-weight GEMV benchmark"
timeout 200 $bin/cuda_quant_bench > "$logs/quant-bench.log" 2>&1 || status=1
tail -30 "$logs/quant-bench.log"
echo "== strix --device cuda (CLI device tests against the fixtures' goldens)"
STRIX_BIN=$bin/strix STRIX_FIXTURES=tests/fixtures/models timeout 300 $bin/cli-tests --test-threads=1 \
  --include-ignored --nocapture device_ > "$logs/cli-tests.log" 2>&1 || status=1
grep -E "^test |test result|panicked|skipped|steps agree|diverged|logits max" "$logs/cli-tests.log"
# One greedy run by hand, so the log shows what a user sees (device line, JSON).
timeout 120 $bin/strix run --device cuda --verbose --model tests/fixtures/models/causal-bf16-sharded \
  --prompt-ids 1,2,3,4,5,6,7,8 -n 10 --temperature 0 --ignore-eos --json \
  > "$logs/run-cuda.json" 2> "$logs/run-cuda.log" || status=1
cat "$logs/run-cuda.log" "$logs/run-cuda.json"
for preset in 0.8b 9b; do
  echo "== strix bench --device cuda --preset qwen3.5-$preset"
  # 0.8B takes well under a minute, 9B about one (18 GB of weights synthesised on the host
  # and uploaded first); the limits only stop a hang.
  timeout "$([ "$preset" = 9b ] && echo 240 || echo 150)" $bin/strix bench --device cuda \
    --preset "qwen3.5-$preset" --verbose > "$logs/bench-$preset.json" 2> "$logs/bench-$preset.log" || status=1
  # The table (from its title line on), or the tail of the log when the run failed.
  grep -q '^strix bench$' "$logs/bench-$preset.log" && sed -n '/^strix bench$/,$p' "$logs/bench-$preset.log" ||
    tail -15 "$logs/bench-$preset.log"
done
# QUANTS="q8_0 q4_0 q4_k": 9B batch-1 decode (and batch 16) with the weights quantized on load
# (Q4_K's reference quantizer takes minutes over 9B on the host before the bench starts).
for q in ${QUANTS:-}; do
  echo "== strix bench --device cuda --preset qwen3.5-9b --quant $q"
  timeout 420 $bin/strix bench --device cuda --preset qwen3.5-9b --quant "$q" --prompt-lens none \
    --contexts 128 --batches 16 --verbose > "$logs/bench-9b-$q.json" 2> "$logs/bench-9b-$q.log" || status=1
  grep -q '^strix bench$' "$logs/bench-9b-$q.log" && sed -n '/^strix bench$/,$p' "$logs/bench-9b-$q.log" ||
    tail -15 "$logs/bench-9b-$q.log"
done
if [ -n "${SANITIZE:-}" ]; then
  echo "== memcheck"
  timeout "$SANITIZE" compute-sanitizer --tool memcheck --print-limit 20 $bin/cuda-tests --test-threads=1 --include-ignored \
    embed norms conv resize attention batch_rows matmul > "$logs/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|test result" "$logs/memcheck.log"
fi
exit $status
