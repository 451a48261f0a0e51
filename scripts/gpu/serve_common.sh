# Sourced by serve_compare.sh and structured_bench.sh after they set `tok` (a tokenizer.json,
# or .gz), `logs` (the log folder) and `work` (scratch): the CUDA libraries and kernel cache
# in the environment, `note` (a timestamped line in LOGDIR/summary.txt), the prebuilt strix
# copied to WORK/bin (`strix`: so a run survives its checkout being replaced), the tokenizer
# in WORK/tokenizer, and the machine in LOGDIR/machine.txt.
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
