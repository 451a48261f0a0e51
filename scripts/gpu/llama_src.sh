#!/usr/bin/env bash
# Packs the llama.cpp sources vendored in a llama-cpp-python sdist (or a llama.cpp checkout)
# into the small tarball serve_compare.sh / moe_compare.sh build from on a device machine:
# without models/, docs/, media/, a build/ folder and the backends other than CPU and CUDA
# (76 MB of sdist become ~7 MB of .tar.xz, within what a device call carries).
# Usage: scripts/gpu/llama_src.sh SDIST.tar.gz|LLAMA_DIR OUT.tar.xz
#   pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36
set -euo pipefail
src=${1:?usage: llama_src.sh SDIST.tar.gz|LLAMA_DIR OUT.tar.xz}
out=${2:?usage: llama_src.sh SDIST.tar.gz|LLAMA_DIR OUT.tar.xz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -d "$src" ]; then
  dir=$src
else
  tar xzf "$src" -C "$tmp"
  dir=$(find "$tmp" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -1)
  [ -n "$dir" ] || { echo "llama_src.sh: no vendor/llama.cpp in $src" >&2; exit 1; }
fi
excludes=()
for p in build models docs media .git tools/server/public tools/server/webui; do
  excludes+=(--exclude="llama.cpp/$p")
done
for b in vulkan sycl opencl hexagon metal et webgpu openvino cann virtgpu; do
  excludes+=(--exclude="llama.cpp/ggml/src/ggml-$b")
done
# The folder goes in as llama.cpp/ whatever its name here.
ln -s "$(cd "$dir" && pwd)" "$tmp/llama.cpp"
tar chf - -C "$tmp" "${excludes[@]}" llama.cpp | xz -T0 -6 > "$out"
du -h "$out"
