# Sourced by serve_compare.sh, moe_compare.sh and structured_bench.sh after they set `tok` (a tokenizer.json,
# or .gz), `logs` (the log folder) and `work` (scratch): the CUDA libraries and kernel cache
# in the environment, `note` (a timestamped line in LOGDIR/summary.txt), the prebuilt strix
# copied to WORK/bin (`strix`: so a run survives its checkout being replaced), the tokenizer
# in WORK/tokenizer, the machine in LOGDIR/machine.txt, and build_llama / wait_llama (llama.cpp
# from the sources in `src`).
mkdir -p "$logs" "$work/bin" "$work/tokenizer"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export STRIX_KERNEL_CACHE=${STRIX_KERNEL_CACHE:-$work/kernels}
summary=$logs/summary.txt
start=$(date +%s)
note() { echo "[$(($(date +%s) - start))s] $*" | tee -a "$summary"; }

cp "${GPU_DIR:-.gpu}/strix" "$work/bin/" || { note "no strix binary in ${GPU_DIR:-.gpu}"; exit 1; }
strix=$work/bin/strix
case $tok in
*.gz) gunzip -c "$tok" > "$work/tokenizer/tokenizer.json" ;;
*) cp "$tok" "$work/tokenizer/tokenizer.json" ;;
esac
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  lscpu | grep 'Model name'
} > "$logs/machine.txt" 2>&1

# Builds llama.cpp's TARGETS from the tarball $src into $work/llama/build in the background,
# with the same configuration every script uses; `wait_llama` waits for it and sets $llama
# (its bin folder), or notes the failure and exits.
build_llama() { # TARGETS...
  (
    mkdir -p "$work/llama" && tar xf "$src" -C "$work/llama" --strip-components=1 &&
      cmake -S "$work/llama" -B "$work/llama/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_APP=OFF > "$logs/llama-cmake.log" 2>&1 &&
      cmake --build "$work/llama/build" -j "${JOBS:-12}" --target "$@" > "$logs/llama-build.log" 2>&1
    echo $? > "$work/llama.rc"
  ) &
  llama_pid=$!
}
wait_llama() {
  wait "$llama_pid"
  if [ "$(cat "$work/llama.rc")" != 0 ]; then
    note "llama.cpp build failed (llama-build.log)"
    exit 1
  fi
  llama=$work/llama/build/bin
}
