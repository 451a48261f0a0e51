#!/usr/bin/env python3
"""Convert committed model fixtures to GGUF with llama.cpp's own tools (tests/fixtures/gguf-models/).

Run from the repository root, with the llama.cpp sources of the llama-cpp-python sdist
unpacked and its CPU tools built (see scripts/README.md, "GGUF model fixtures"):

    PYTHONPATH=$LLAMA/gguf-py python scripts/make_gguf_model_fixtures.py \
        --llama-cpp $LLAMA --llama-quantize BUILD/bin/llama-quantize

where $LLAMA is `vendor/llama.cpp` of the sdist. Needs torch, transformers, safetensors,
numpy (the converter's own requirements).

For each fixture below the script runs llama.cpp's `convert_hf_to_gguf.py` (its code, as
shipped) to a float GGUF (bf16 for a bf16 checkpoint, f32 for an f32 one), then the built
`llama-quantize` to the listed quantized types, and records in `manifest.json` which GGML
type each tensor ended up as (llama-quantize falls back to other types for rows that are
not whole blocks of the requested type, e.g. Q4_K -> Q5_0 on 64-wide rows) and the tool
versions.

One thing the converter cannot do for a tiny fixture: it recognises a BPE pre-tokenizer by
hashing the ids its tokenizer gives a fixed text, and a 384-token vocabulary cannot give
the ids the real Qwen3.5 vocabulary gives. So before converting, the script checks that
the fixture's tokenizer.json has exactly the real Qwen3.5 normalizer, pre-tokenizer,
decoder and post-processor (tests/fixtures/tokenizer/qwen3_5.tokenizer.json.zst) and then
answers the converter's question itself: `tokenizer.ggml.pre = "qwen35"`, which is what
the converter writes for the real checkpoints. Nothing else of the converter is touched.
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

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests/fixtures/models"
OUT = ROOT / "tests/fixtures/gguf-models"

# (fixture, float outtype, llama-quantize types)
FIXTURES = [
    ("causal-bf16-gdn3x", "bf16", ["Q8_0", "Q4_0", "Q4_K_M"]),
    ("causal-f32-tied-gdn2x", "f32", ["Q8_0"]),
]

# Prompt length of the quantized files' goldens (a prefix of the fixture's longest golden prompt).
GOLDEN_TOKENS = 24

TOKENIZER_PARTS = ["normalizer", "pre_tokenizer", "decoder", "post_processor"]


def real_qwen_tokenizer() -> dict:
    raw = subprocess.run(
        ["zstd", "-dc", "--long=27", str(ROOT / "tests/fixtures/tokenizer/qwen3_5.tokenizer.json.zst")],
        check=True,
        capture_output=True,
    ).stdout
    return json.loads(raw)


def check_tokenizer(fixture: Path, real: dict) -> None:
    tok = json.loads((fixture / "tokenizer.json").read_text())
    for part in TOKENIZER_PARTS:
        if tok[part] != real[part]:
            sys.exit(f"{fixture}/tokenizer.json: `{part}` differs from Qwen3.5's; cannot declare it qwen35")
    for key in ["type", "byte_fallback", "ignore_merges", "fuse_unk"]:
        if tok["model"].get(key) != real["model"].get(key):
            sys.exit(f"{fixture}/tokenizer.json: model.{key} differs from Qwen3.5's")


def convert(llama: Path, src: Path, outtype: str, out: Path) -> None:
    """Runs the converter's main() in this process with the pre-tokenizer answer above."""
    sys.path.insert(0, str(llama))
    import conversion.base as base  # noqa: E402  (the converter's package, from the sdist)

    def pre_qwen35(self, tokenizer) -> str:  # noqa: ARG001
        return "qwen35"

    base.TextModel.get_vocab_base_pre = pre_qwen35
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", llama / "convert_hf_to_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--no-mtp", "--outtype", outtype, "--outfile", str(out)]
    try:
        mod.main()
    finally:
        sys.argv = argv


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in r.tensors}


# GGUF name under blk.N. -> name under model.layers.N. (llama.cpp's converter, inverted)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def untile(t, dim: int, nk: int, per_k: int, head: int):
    """Inverse of the converter's _reorder_v_heads: tiled [r, g] back to grouped [g, r]."""
    import torch

    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, nk, head, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def state_dict_from_gguf(path: Path, cfg: dict) -> dict:
    """Every tensor of a qwen35 GGUF dequantized by the gguf package and mapped back to the
    transformers checkpoint it came from: an implementation independent of strix's loader."""
    import gguf
    import numpy as np
    import torch

    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    per_k = nv // nk
    r = gguf.GGUFReader(str(path))
    sd = {}
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        x = torch.from_numpy(np.ascontiguousarray(x.reshape([int(d) for d in reversed(t.shape)])))
        if t.name in GLOBAL_NAMES:
            name = GLOBAL_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{LAYER_NAMES[rest]}"
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x - 1
        if name.endswith("A_log"):
            x = torch.log(-x)
        if name.endswith("conv1d.weight"):
            x = x.unsqueeze(1)
        if per_k > 1:
            if name.endswith("in_proj_qkv.weight"):
                x = torch.cat([x[: 2 * nk * kd], untile(x[2 * nk * kd:], 0, nk, per_k, vd)])
            elif name.endswith("in_proj_z.weight"):
                x = untile(x, 0, nk, per_k, vd)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                x = untile(x, 0, nk, per_k, 1)
            elif name.endswith("conv1d.weight"):
                x = torch.cat([x[: 2 * nk * kd], untile(x[2 * nk * kd:], 0, nk, per_k, vd)])
            elif name.endswith("out_proj.weight"):
                x = untile(x, 1, nk, per_k, vd)
        sd[name] = x
    return sd


def reference_logits(fixture: Path, gguf_path: Path, ids: list[int]):
    """transformers (float32, eager, pure-torch GDN) run on the GGUF's dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fixture, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = json.loads((fixture / "config.json").read_text())
    sd = state_dict_from_gguf(gguf_path, cfg.get("text_config", cfg))
    if cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--llama-quantize", type=Path, required=True)
    args = ap.parse_args()

    real = real_qwen_tokenizer()
    OUT.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"tools": {}, "files": {}}
    manifest["tools"]["convert_hf_to_gguf.py sha256"] = hashlib.sha256(
        (args.llama_cpp / "convert_hf_to_gguf.py").read_bytes()
    ).hexdigest()

    with tempfile.TemporaryDirectory() as tmp:
        for name, outtype, quants in FIXTURES:
            src = MODELS / name
            check_tokenizer(src, real)
            # A copy without the goldens: the converter indexes every *.safetensors it finds.
            work = Path(tmp) / name
            work.mkdir()
            for f in src.iterdir():
                if f.name != "goldens.safetensors":
                    shutil.copy(f, work / f.name)
            float_path = OUT / f"{name}.{outtype}.gguf"
            # Each conversion runs in a child so the converter's module state never leaks across.
            subprocess.run(
                [sys.executable, __file__, "--llama-cpp", str(args.llama_cpp),
                 "--llama-quantize", str(args.llama_quantize),
                 "--convert-one", str(work), outtype, str(float_path)],
                check=True,
            )
            manifest["files"][float_path.name] = {"fixture": name, "types": tensor_types(float_path)}
            for q in quants:
                qpath = OUT / f"{name}.{q.lower()}.gguf"
                run = subprocess.run(
                    [str(args.llama_quantize), str(float_path), str(qpath), q],
                    capture_output=True, text=True,
                )
                if run.returncode != 0:
                    sys.exit(f"llama-quantize {q} failed:\n{run.stdout}\n{run.stderr}")
                log = (run.stdout + run.stderr).splitlines()
                fallbacks = [l.strip() for l in log if "falling back" in l]
                manifest["tools"]["llama-quantize"] = next(
                    (l.strip() for l in log if l.startswith("version:")), "unknown")
                manifest["files"][qpath.name] = {
                    "fixture": name,
                    "source": float_path.name,
                    "llama-quantize": q,
                    "types": tensor_types(qpath),
                    "fallbacks": fallbacks,
                }
    # transformers goldens for every file, on the fixture's longest golden prompt: the logits of
    # the weights exactly as stored (dequantized), so strix's reading of each file is checked
    # to the float tolerance, independently of how far quantization moved the logits.
    import torch
    from safetensors.torch import load_file, save_file

    goldens = {}
    for file, entry in manifest["files"].items():
        fixture = MODELS / entry["fixture"]
        g = load_file(str(fixture / "goldens.safetensors"))
        longest = max((k for k in g if k.endswith(".ids")), key=lambda k: g[k].numel())
        ids = g[longest].tolist()[:GOLDEN_TOKENS]
        logits = reference_logits(fixture, OUT / file, ids)
        if file.endswith((".bf16.gguf", ".f32.gguf")):
            # The float files reproduce the checkpoint's own goldens (the mapping above is
            # right); strix's tests compare them with the checkpoint directly, so no golden.
            want = g[longest.replace(".ids", ".logits")][:GOLDEN_TOKENS]
            err = (logits - want).abs().max() / want.abs().max()
            assert err < 1e-5, (file, float(err))
            print(f"{file}: transformers on its dequantized weights vs the checkpoint's goldens: {err:.2e}")
            continue
        key = file.removesuffix(".gguf")
        goldens[f"{key}.ids"] = torch.tensor(ids, dtype=torch.int64)
        goldens[f"{key}.logits"] = logits.contiguous()
    save_file(goldens, str(OUT / "goldens.safetensors"))

    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {OUT} ({total / 1024:.1f} KiB)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and "--convert-one" in sys.argv:
        i = sys.argv.index("--convert-one")
        llama = Path(sys.argv[sys.argv.index("--llama-cpp") + 1])
        src, outtype, out = sys.argv[i + 1 : i + 4]
        convert(llama, Path(src), outtype, Path(out))
    else:
        main()
