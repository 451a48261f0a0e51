#!/usr/bin/env bash
# The whole GPU suite from prebuilt binaries (scripts/gpu/build.sh), on a CUDA 13 machine:
# the CUDA tests (every kernel against the CPU backend, the transformers fixtures), then the
# decode benchmark. Usage: scripts/gpu/run.sh LOGDIR  — full logs go to LOGDIR, a summary to
# stdout. SANITIZE=SECONDS also runs compute-sanitizer memcheck over the op tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
logs=${1:?usage: scripts/gpu/run.sh LOGDIR}
mkdir -p "$logs"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$logs/env.txt" 2>&1
status=0
echo "== tests"
./.gpu/cuda-tests --test-threads=1 --nocapture > "$logs/tests.log" 2>&1 || status=1
grep -E "^test |test result|panicked|skipped" "$logs/tests.log"
echo "== decode benchmark"
timeout 300 ./.gpu/cuda_decode_bench ${BENCH_ARGS:-} > "$logs/bench.log" 2>&1 || status=1
tail -25 "$logs/bench.log"
if [ -n "${SANITIZE:-}" ]; then
  echo "== memcheck"
  timeout "$SANITIZE" compute-sanitizer --tool memcheck --print-limit 20 ./.gpu/cuda-tests --test-threads=1 \
    embed norms conv resize attention batch_rows matmul > "$logs/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|test result" "$logs/memcheck.log"
fi
exit $status
