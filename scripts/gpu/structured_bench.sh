#!/usr/bin/env bash
# Structured output's cost under load (issue 18): `strix serve` on random weights of the
# published 0.8B and 9B shapes, `strix bench-serve` at each client count, every request
# constrained by scripts/assets/bench_schema.json (`--json-schema`) and unconstrained.
# Runs on the CUDA machine from the prebuilt binary of scripts/gpu/build.sh (GPU_DIR,
# default .gpu).
#
# Usage: scripts/gpu/structured_bench.sh TOKENIZER_JSON[.gz] LOGDIR [MODELS]
#   TOKENIZER_JSON  the Qwen3.5 tokenizer.json (tests/fixtures/tokenizer/qwen3_5.tokenizer.json.zst,
#                   decompressed, is one)
#   MODELS          default "0.8b 9b"
# Environment: CLIENTS (default "1 64"), MIX (default temperature), MAX_TOKENS (default 256),
# WORK (scratch, default /tmp/structured-bench).
# Requests: streaming /v1/completions, prompts of 100 random ids, --max-tokens MAX_TOKENS,
# 8 requests for one client and 2 a client beyond, after a warm-up round. A constrained
# request ends when its document is complete (usually well before MAX_TOKENS), so compare
# output tok/s, not durations. Results: LOGDIR/bs-<model>-<clients>-<plain|schema>.json and a
# line each in LOGDIR/summary.txt (tok/s, itl, and the outputs that did not parse).
set -uo pipefail
cd "$(dirname "$0")/../.."
tok=${1:?usage: structured_bench.sh TOKENIZER_JSON LOGDIR [MODELS]}
logs=${2:?log folder}
models=${3:-0.8b 9b}
clients=${CLIENTS:-1 64}
mix=${MIX:-temperature}
mt=${MAX_TOKENS:-256}
work=${WORK:-/tmp/structured-bench}
schema=$PWD/scripts/assets/bench_schema.json
. scripts/gpu/serve_common.sh

for m in $models; do
  file=$work/$m-bf16.gguf
  [ -e "$file" ] || "$strix" quantize --preset "qwen3.5-$m" --tokenizer "$work/tokenizer" --quant bf16 \
    --out "$file" > "$logs/gguf-$m.log" 2>&1 || { note "strix quantize --preset $m failed"; exit 1; }
  port=8091
  "$strix" serve --device cuda --model "$file" --port $port --max-seqs 64 --ctx 4096 > "$logs/serve-$m.log" 2>&1 &
  pid=$! up=
  for _ in $(seq 1 600); do
    curl -sf http://127.0.0.1:$port/health > /dev/null && up=1 && break
    kill -0 $pid 2> /dev/null || break
    sleep 0.5
  done
  [ -n "$up" ] || { note "$m did not come up (serve-$m.log)"; kill -9 $pid 2> /dev/null; continue; }
  for c in $clients; do
    for kind in plain schema; do
      n=$((c < 4 ? 8 : 2 * c)) out=$logs/bs-$m-$c-$kind
      extra=()
      [ $kind = schema ] && extra=(--json-schema "$schema")
      timeout 300 "$strix" bench-serve --url http://127.0.0.1:$port --clients "$c" --requests $n --max-tokens "$mt" \
        --prompt-len 100 --mix "$mix" --seed 1 "${extra[@]}" > "$out.json" 2> "$out.log"
      python3 - "$out.json" "$m c=$c $kind" >> "$summary" 2>&1 << 'PY' || tail -2 "$out.log" >> "$summary"
import json, sys
d = json.load(open(sys.argv[1]))
bad = d.get("unparsable_outputs")
print(sys.argv[2], f"{d['output_tok_s']:.1f} tok/s; itl p50 {d['itl_ms']['p50']:.2f} p99 {d['itl_ms']['p99']:.2f} ms;",
      f"{d['output_tokens']} tokens, finish {d['finish_reasons']}, failed {d['failed']}",
      "" if bad is None else f", unparsable {bad} of {d['completed']}")
PY
    done
  done
  kill $pid; wait $pid 2> /dev/null
done
note done
