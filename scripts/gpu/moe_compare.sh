#!/usr/bin/env bash
# The MoE family beside llama.cpp (issue 20): random weights of the Qwen3.5-35B-A3B shape
# written as one GGUF file (`strix quantize --preset qwen3.5-35b-a3b`), then on that same file
# `strix bench` (prefill 512 / 4096, decode one stream, batches 1 / 16 / 64) beside
# `llama-bench` (-p 512,4096 -n 128) and `llama-batched-bench` (-npl 1,16,64), built on the
# machine from the same llama.cpp sources as serve_compare.sh. Runs on the CUDA machine from
# the prebuilt binary of scripts/gpu/build.sh (GPU_DIR, default .gpu).
#
# Usage: scripts/gpu/moe_compare.sh LLAMA_SRC_TARBALL TOKENIZER_JSON[.gz] LOGDIR [QUANTS]
#   QUANTS  the files to write and compare, any of q4_k (llama.cpp's Q4_K_M mixture), q8_0,
#           q4_0, bf16 (default "q4_k"; bf16 is ~70 GB: more disk than one H200 machine has)
# Environment: JOBS (build jobs, default 12), WORK (scratch, default /tmp/moe-compare), GATE
# (a file: the benchmarks wait until it exists, so a caller can keep the GPU to itself while
# the file is written and llama.cpp builds).
# Results: LOGDIR/strix-<quant>.json / .log, llama-bench-<quant>.log,
# batched-bench-<quant>.log, and a line each in LOGDIR/summary.txt. Keep a poll running (the
# machine goes back ~30 s after a call ends) and bring LOGDIR back as one tarball.
set -uo pipefail
cd "$(dirname "$0")/../.."
src=${1:?usage: moe_compare.sh LLAMA_SRC_TARBALL TOKENIZER_JSON LOGDIR [QUANTS]}
tok=${2:?tokenizer.json}
logs=${3:?log folder}
quants=${4:-q4_k}
work=${WORK:-/tmp/moe-compare}
. scripts/gpu/serve_common.sh

build_llama llama-bench llama-batched-bench

for q in $quants; do
  note "writing the 35B-A3B $q file"
  "$strix" quantize --preset qwen3.5-35b-a3b --tokenizer "$work/tokenizer" --quant "$q" \
    --out "$work/35b-a3b-$q.gguf" > "$logs/gguf-$q.log" 2>&1 || { note "strix quantize $q failed"; exit 1; }
done
wait_llama
note "files ready: $(cd "$work" && ls -s --block-size=M ./*.gguf | tr '\n' ' ')"
if [ -n "${GATE:-}" ]; then
  while [ ! -e "$GATE" ]; do sleep 2; done
  note "gate $GATE open"
fi

for q in $quants; do
  file=$work/35b-a3b-$q.gguf
  timeout 400 "$strix" bench --device cuda --model "$file" --prompt-lens 512,4096 --contexts 128 \
    --batches 1,16,64 > "$logs/strix-$q.json" 2> "$logs/strix-$q.log"
  grep -E "prefill|decode|batch" "$logs/strix-$q.log" | grep -v '^    ' | sed "s/^/strix $q: /" >> "$summary"
  timeout 400 "$llama/llama-bench" -m "$file" -p 512,4096 -n 128 -ngl 99 -r 3 > "$logs/llama-bench-$q.log" 2>&1
  grep -E "pp|tg" "$logs/llama-bench-$q.log" | sed "s/^/llama-bench $q: /" >> "$summary"
  timeout 400 "$llama/llama-batched-bench" -m "$file" -c 32768 -npp 128 -ntg 64 -npl 1,16,64 -ngl 99 \
    > "$logs/batched-bench-$q.log" 2>&1
  grep -E "^\|" "$logs/batched-bench-$q.log" | sed "s/^/llama-batched-bench $q: /" >> "$summary"
done
note "done"
