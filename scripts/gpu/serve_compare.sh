#!/usr/bin/env bash
# `strix serve` beside llama-server on the same GGUF files, under `strix bench-serve`: the
# served table of BENCHMARKS.md (issue 16). Runs on the CUDA machine, from the prebuilt
# binaries of scripts/gpu/build.sh (GPU_DIR, default .gpu) and llama.cpp sources.
#
# Usage: scripts/gpu/serve_compare.sh LLAMA_SRC_TARBALL TOKENIZER_JSON[.gz] LOGDIR [MODELS]
#   LLAMA_SRC_TARBALL  a .tar.xz/.tar.gz of a llama.cpp tree (llama-cpp-python's sdist
#                      vendors one under vendor/llama.cpp; tar that folder, docs/models/tests
#                      pruned, to keep it small)
#   TOKENIZER_JSON     the Qwen3.5 tokenizer.json the random weights' files carry
#   MODELS             which of 9b and 0.8b, in that order (default "9b 0.8b": the 9B rows
#                      are the ones issue 16's targets name, so they come first)
# Environment: CLIENTS (default "1 16 64"), MIXES (default "greedy temperature"),
# JOBS (build jobs, default 12), WORK (scratch, default /tmp/serve-compare), WAIT_FOR (a file
# whose existence the servers wait for, so that the build and the files can be made while
# something else, such as the GPU tests, has the device).
#
# What it does: builds llama-server, llama-quantize and llama-batched-bench; writes random
# weights of each model's published shape as a bf16 GGUF (`strix quantize --preset`, the
# weights `strix bench --preset` runs; a 9B file in a few minutes, no torch needed) and
# converts it to Q4_K_M with llama-quantize, then for each file starts `strix serve`
# (--max-seqs 64) and llama-server (-np 64, 512 tokens a slot), and runs `strix bench-serve`
# at each client count and request mix: streaming /v1/completions, prompts of 100 random
# ids, --max-tokens 256 (0.8B) or 128 (9B), 2 requests a client (8 for one client) after a
# warm-up round; then `strix bench` (batches 1, 16, 64) and llama-batched-bench on the
# Q4_K_M file.
# Results: LOGDIR/bs-<server>-<model>-<format>-<clients>-<mix>.json (one object each) and
# a summary line per run in LOGDIR/summary.txt.
#
# The binaries are copied to WORK first, so the run survives its checkout being replaced
# (the device tool re-sends the working tree with each call; run this detached with setsid
# and poll LOGDIR/summary.txt). Keep a poll call running the whole time: a lent machine
# goes back ~30 s after a call ends, and with it everything the run wrote. The whole plan
# takes ~25 minutes of device time (llama-server is slow at 16+ clients on 0.8B). Bring the
# results back as one tarball (the device tool returns only a few files per call), and stop
# a run early with `pkill -f "[s]erve_compare"`: a plain pattern also matches, and kills, the
# command line of the call that runs pkill.
set -uo pipefail
cd "$(dirname "$0")/../.."
src=${1:?usage: serve_compare.sh LLAMA_SRC_TARBALL TOKENIZER_JSON LOGDIR [MODELS]}
tok=${2:?tokenizer.json}
logs=${3:?log folder}
models=${4:-9b 0.8b}
clients=${CLIENTS:-1 16 64}
mixes=${MIXES:-greedy temperature}
work=${WORK:-/tmp/serve-compare}
. scripts/gpu/serve_common.sh

# llama.cpp, built in the background while the bf16 files are written.
build_llama llama-server llama-quantize llama-batched-bench

for m in $models; do
  note "bf16 file $m"
  "$strix" quantize --preset "qwen3.5-$m" --tokenizer "$work/tokenizer" --quant bf16 --out "$work/$m-bf16.gguf" \
    > "$logs/gguf-$m.log" 2>&1 || { note "strix quantize --preset $m failed"; exit 1; }
done
wait_llama
for m in $models; do
  "$llama/llama-quantize" "$work/$m-bf16.gguf" "$work/$m-q4km.gguf" Q4_K_M "${JOBS:-12}" > "$logs/q4km-$m.log" 2>&1 ||
    { note "llama-quantize $m failed"; exit 1; }
done
note "files ready: $(cd "$work" && ls -s --block-size=M ./*.gguf | tr '\n' ' ')"
if [ -n "${WAIT_FOR:-}" ]; then
  while [ ! -e "$WAIT_FOR" ]; do sleep 2; done
  note "$WAIT_FOR is there: the servers start"
fi

# One server on one file, every client count and mix.
serve() { # server model format max_tokens
  local server=$1 m=$2 f=$3 mt=$4 port=8090 file=$work/$2-$3.gguf tag=$1-$2-$3
  if [ "$server" = strix ]; then
    "$strix" serve --device cuda --model "$file" --port $port --max-seqs 64 --ctx 4096 > "$logs/serve-$tag.log" 2>&1 &
  else
    "$llama/llama-server" -m "$file" --port $port -np 64 -c 32768 -ngl 99 > "$logs/serve-$tag.log" 2>&1 &
  fi
  local pid=$! up=
  for _ in $(seq 1 600); do
    curl -sf http://127.0.0.1:$port/health > /dev/null && up=1 && break
    kill -0 $pid 2> /dev/null || break
    sleep 0.5
  done
  if [ -z "$up" ]; then
    note "$tag did not come up (serve-$tag.log)"
    kill -9 $pid 2> /dev/null
    return
  fi
  for c in $clients; do
    for mix in $mixes; do
      local n=$((c < 4 ? 8 : 2 * c)) out=$logs/bs-$tag-$c-$mix
      timeout 200 "$strix" bench-serve --url http://127.0.0.1:$port --clients "$c" --requests $n --max-tokens "$mt" \
        --prompt-len 100 --mix "$mix" --seed 1 > "$out.json" 2> "$out.log"
      python3 - "$out.json" "$tag c=$c $mix" >> "$summary" 2>&1 << 'EOF' || tail -2 "$out.log" >> "$summary"
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], f"{d['output_tok_s']:.1f} tok/s; ttft p50 {d['ttft_ms']['p50']:.1f} ms, itl p50 {d['itl_ms']['p50']:.2f} p99 {d['itl_ms']['p99']:.2f} ms; failed {d['failed']}")
EOF
    done
  done
  curl -s http://127.0.0.1:$port/metrics > "$logs/metrics-$tag.txt"
  kill -INT $pid
  for _ in $(seq 1 20); do kill -0 $pid 2> /dev/null || break; sleep 0.5; done
  kill -9 $pid 2> /dev/null
  wait $pid 2> /dev/null
}
for m in $models; do
  mt=$([ "$m" = 9b ] && echo 128 || echo 256)
  for f in bf16 q4km; do
    serve strix "$m" $f "$mt"
    serve llama "$m" $f "$mt"
  done
  # Both engines' decode batches on the Q4_K_M file, for the kernel comparison.
  timeout 200 "$strix" bench --device cuda --model "$work/$m-q4km.gguf" --prompt-lens none --contexts 128 \
    --batches 1,16,64 > "$logs/bench-$m-q4km.json" 2> "$logs/bench-$m-q4km.log"
  grep -E "batch" "$logs/bench-$m-q4km.log" | grep -v '^    ' | sed "s/^/strix bench $m q4km: /" >> "$summary"
  timeout 200 "$llama/llama-batched-bench" -m "$work/$m-q4km.gguf" -c 32768 -npp 128 -ntg 64 -npl 1,16,64 -ngl 99 \
    > "$logs/batched-bench-$m-q4km.log" 2>&1
done
note "done"
