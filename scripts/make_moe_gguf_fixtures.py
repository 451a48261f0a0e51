#!/usr/bin/env python3
"""GGUF files of the MoE fixtures, made by llama.cpp's own converter (`qwen35moe`).

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary llama-cpp-python -d /tmp/sdist
    mkdir -p /tmp/llama-src && tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama-src --strip-components=1
    LLAMA=/tmp/llama-src/vendor/llama.cpp
    # in the virtualenv of make_moe_fixtures.py (torch, transformers, safetensors, numpy)
    PYTHONPATH=$LLAMA/gguf-py python scripts/make_moe_gguf_fixtures.py --llama-cpp $LLAMA

For each entry of FIXTURES, `convert_hf_to_gguf.py --no-mtp --outtype T` runs on a copy of
tests/fixtures/moe-models/<fixture> (without goldens.safetensors), with the pre-tokenizer
answer make_gguf_model_fixtures.py gives it (the fixtures' tokenizer pipeline is checked to be
Qwen3.5's first). The converter merges per-expert tensors into `ffn_{gate,up,down}_exps` and
splits transformers' fused `gate_up_proj` into the same; Q8_0 is its own `--outtype q8_0`
(gguf-py's quantizer), so no llama.cpp build is needed. Output: tests/fixtures/moe-gguf/ with a
manifest.json of every tensor's type and the converter's hash. Checked by
crates/strix/tests/moe_gguf.rs against the source fixtures' transformers goldens. A re-run
reproduces byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_gguf_model_fixtures as g  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests/fixtures/moe-models"
OUT = ROOT / "tests/fixtures/moe-gguf"

# (fixture, converter outtypes)
FIXTURES = [
    ("moe-causal-bf16-sharded", ["bf16"]),
    ("moe-causal-f32-top1", ["f32", "q8_0"]),
    ("moe-vlm-f32-fused", ["f32"]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--convert-one", nargs=3, metavar=("SRC", "OUTTYPE", "OUT"))
    args = ap.parse_args()
    if args.convert_one:
        src, outtype, out = args.convert_one
        g.convert(args.llama_cpp, Path(src), outtype, Path(out))
        return

    real = g.real_qwen_tokenizer()
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    manifest: dict = {"tools": {}, "files": {}}
    manifest["tools"]["convert_hf_to_gguf.py sha256"] = hashlib.sha256(
        (args.llama_cpp / "convert_hf_to_gguf.py").read_bytes()
    ).hexdigest()
    manifest["tools"]["conversion/qwen.py sha256"] = hashlib.sha256(
        (args.llama_cpp / "conversion" / "qwen.py").read_bytes()
    ).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        for name, outtypes in FIXTURES:
            src = MODELS / name
            g.check_tokenizer(src, real)
            work = Path(tmp) / name
            work.mkdir()
            for f in src.iterdir():
                if f.name != "goldens.safetensors":
                    shutil.copy(f, work / f.name)
            for outtype in outtypes:
                path = OUT / f"{name}.{outtype}.gguf"
                # Each conversion in a child, so the converter's module state never leaks across.
                subprocess.run(
                    [sys.executable, __file__, "--llama-cpp", str(args.llama_cpp), "--convert-one", str(work), outtype, str(path)],
                    check=True,
                )
                manifest["files"][path.name] = {"fixture": name, "outtype": outtype, "types": g.tensor_types(path)}
                print(f"{path.name}: {path.stat().st_size / 1024:.1f} KiB", flush=True)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
