#!/usr/bin/env python3
"""Check that llama.cpp loads GGUF files written by `strix quantize`, that they hold exactly
the tensors llama.cpp's own tools write, and that llama.cpp computes what strix computes.

    PYTHONPATH=$LLAMA/gguf-py python scripts/check_gguf_with_llama_cpp.py \
        --strix target/release/strix --llama-bin BUILD/bin --llama-cpp $LLAMA [--ctx 64]

($LLAMA: vendor/llama.cpp of the llama-cpp-python sdist; see scripts/README.md.)

Models: the committed fixture `causal-bf16-sharded` (v heads = k heads), a random-weight
model made here with twice as many value heads as key heads, so that the value-head
re-tiling is exercised (llama.cpp's qwen35 loader needs key and value heads of the same
width, which rules out the other fixtures), and a random-weight MoE model (`qwen35moe`: 16
experts, top-2, a shared expert, every matrix dimension a multiple of 256 so the K-quants
apply; not 8 experts, for which llama-quantize has rules of its own that strix does not
follow). Types: f32, bf16, q8_0, q4_0, q4_k.

For each: `strix quantize` writes the GGUF. The same model also goes through llama.cpp's
converter and `llama-quantize` (F32, BF16, Q8_0, Q4_0, Q4_K_M: its default mixtures), and
every tensor (name, type, dims, bytes) of the two files is compared. `llama-perplexity --kl-divergence-base` runs strix's file and saves its
token ids and log-probabilities (16-bit quantized, as llama.cpp stores them) for the second
half of each `--ctx` window; `strix logits` runs the same ids through the same file. The
script prints both perplexities, the largest log-probability difference (over tokens within
16 nats of the top, where llama.cpp's file holds them) and the top-1 agreement.

It fails unless every tensor is identical and, for f32 files (where llama.cpp's CPU path
computes in f32 like strix; an f32 KV cache is asked for), the log-probabilities agree
within 1e-2 nats and the perplexities within 1e-3. For bf16 and quantized weights
llama.cpp rounds the activations of its matmuls (to bf16, Q8_0, Q8_K) and strix does not:
those figures are printed, not judged.

Needs torch, transformers, numpy, safetensors and the sdist's gguf-py.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests/fixtures/models/causal-bf16-sharded"


def make_gdn2x(out: Path) -> None:
    """causal-bf16-sharded's config with 8 value heads over 4 key heads, random bf16 weights."""
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg["linear_num_value_heads"] = 2 * cfg["linear_num_key_heads"]
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_random(out, FIXTURE, seed=7, matrix_std=0.15, dims=(2,))


def save_random(out: Path, template: Path, seed: int, matrix_std: float, dims: tuple[int, ...]) -> None:
    """Random bf16 weights for the config in `out` (tensors of `dims` dimensions N(0, matrix_std),
    norms N(0, 0.1), dt_bias N(0, 0.5)) and `template`'s tokenizer, template and generation
    config beside them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in dims:
                p.normal_(0.0, matrix_std)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
        shutil.copy(template / f, out / f)


def make_moe(out: Path) -> None:
    """The MoE fixture `moe-causal-f32-top1`'s config grown to K-quant sizes (hidden, expert and
    head widths multiples of 256 or 64), 16 experts, top-2, random bf16 weights."""
    moe_fixture = ROOT / "tests/fixtures/moe-models/moe-causal-f32-top1"
    cfg = json.loads((moe_fixture / "config.json").read_text())
    cfg.update(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=512,
               num_experts=16, num_experts_per_tok=2, num_hidden_layers=4, head_dim=64,
               num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=64,
               linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_random(out, moe_fixture, seed=11, matrix_std=0.05, dims=(2, 3))


def read_kld_base(path: Path):
    """llama-perplexity's --kl-divergence-base file: ids and, per scored position, (scale,
    min_log_prob, uint16 codes) with log p = min_log_prob + scale * code (code 0: ≤ min)."""
    b = path.read_bytes()
    assert b[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<iii", b, 8)
    off = 20
    tokens = np.frombuffer(b, dtype=np.int32, count=n_ctx * n_chunk, offset=off).reshape(n_chunk, n_ctx)
    off += 4 * n_ctx * n_chunk
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    n_tok = n_ctx - 1 - first
    rows = np.frombuffer(b, dtype=np.uint16, count=n_chunk * n_tok * nv, offset=off).reshape(n_chunk, n_tok, nv)
    head = rows[:, :, :4].copy().view(np.float32)  # (scale, min_log_prob)
    return n_ctx, n_vocab, tokens, head[:, :, 0], head[:, :, 1], rows[:, :, 4 : 4 + n_vocab], first


def run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def check(strix: str, llama_bin: Path, model_dir: Path, quant: str, text: Path, ctx: int, tmp: Path) -> dict:
    gguf = tmp / f"{model_dir.name}.{quant}.gguf"
    run([strix, "quantize", "--model", str(model_dir), "--quant", quant, "--out", str(gguf)])
    kld = tmp / f"{gguf.stem}.kld"
    # An f32 KV cache, so that with f32 weights llama.cpp computes in f32 throughout.
    log = run([str(llama_bin / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
               "-b", str(ctx), "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(kld), "-t", "2"])
    printed = [float(x) for x in re.findall(r"Final estimate: PPL = ([0-9.]+)", log)]
    n_ctx, n_vocab, tokens, scale, minlp, codes, first = read_kld_base(kld)
    worst, agree, total, nll, llama_nll = 0.0, 0, 0, [], []
    for c in range(tokens.shape[0]):
        out = tmp / "logits.safetensors"
        ids = ",".join(str(int(t)) for t in tokens[c])
        run([strix, "logits", "--model", str(gguf), "--device", "cpu", "--prompt-ids", ids, "--out", str(out)])
        logits = load_file(str(out))["logits"].astype(np.float64)
        for i in range(n_ctx - 1 - first):
            row = logits[first + i]
            lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            code = codes[c, i].astype(np.float64)
            theirs = minlp[c, i] + scale[c, i] * code
            keep = code > 0
            worst = max(worst, float(np.abs(lp[keep] - theirs[keep]).max()))
            agree += int(np.argmax(lp) == np.argmax(code))
            total += 1
            nxt = int(tokens[c, first + i + 1])
            nll.append(-lp[nxt])
            llama_nll.append(-theirs[nxt])
    strix_ppl = float(np.exp(np.mean(nll)))
    # llama.cpp's perplexity as it prints it, else from its saved (16-bit) log-probabilities.
    llama_ppl = printed[0] if printed else float(np.exp(np.mean(llama_nll)))
    return {"file": gguf.name, "llama_ppl": llama_ppl, "strix_ppl": strix_ppl, "max_dlogp": worst,
            "top1": f"{agree}/{total}", "step": float(scale.max()),
            "same_tensors_as_llama_quantize": same_tensors(gguf, llama_made(model_dir, quant, tmp, llama_bin))}


LLAMA_TYPES = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K_M"}
LLAMA_CPP: Path | None = None


def llama_made(model_dir: Path, quant: str, tmp: Path, llama_bin: Path) -> Path:
    """The same model through llama.cpp's converter (f32) and `llama-quantize` (its default
    mixture for the type: strix quantize's q4_k is Q4_K_M)."""
    f32 = tmp / f"{model_dir.name}.llama-converted.f32.gguf"
    if not f32.exists():
        run([sys.executable, str(ROOT / "scripts/make_gguf_model_fixtures.py"), "--llama-cpp", str(LLAMA_CPP),
             "--llama-quantize", str(llama_bin / "llama-quantize"), "--convert-one", str(model_dir), "f32", str(f32)])
    out = tmp / f"{model_dir.name}.llama.{quant}.gguf"
    run([str(llama_bin / "llama-quantize"), str(f32), str(out), LLAMA_TYPES[quant]])
    return out


def same_tensors(a: Path, b: Path) -> str:
    """How many tensors the two files hold with the same name, type, dims and bytes. Two
    differences are not counted as such: llama-quantize drops trailing dimensions of one (the
    shared expert's gate, [hidden, 1], comes out [hidden]), and `ssm_a = -exp(A_log)` may differ
    in the last bit, where the converter's torch computes exp differently from strix's (seen
    with torch 2.15); both are printed."""
    import gguf

    def dims(t) -> list[int]:
        d = [int(x) for x in t.shape]
        while len(d) > 1 and d[-1] == 1:
            d.pop()
        return d

    ta = {t.name: t for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(str(b)).tensors}
    assert set(ta) == set(tb), set(ta) ^ set(tb)
    same = 0
    for n, t in ta.items():
        u = tb[n]
        alike = t.tensor_type == u.tensor_type and dims(t) == dims(u) and t.data.size == u.data.size
        if alike and list(t.shape) != list(u.shape):
            print(f"  {n}: dims {[int(x) for x in t.shape]} vs llama.cpp {[int(x) for x in u.shape]} (trailing ones)")
        if alike and t.data.tobytes() == u.data.tobytes():
            same += 1
            continue
        if alike and n.endswith("ssm_a") and t.tensor_type == gguf.GGMLQuantizationType.F32:
            ulps = np.abs(t.data.ravel().view(np.int32).astype(np.int64) - u.data.ravel().view(np.int32).astype(np.int64))
            if ulps.max() <= 1:
                print(f"  {n}: {int((ulps > 0).sum())} of {ulps.size} values one ulp apart (exp)", flush=True)
                same += 1
                continue
        print(f"  {n}: strix {t.tensor_type.name} {[int(x) for x in t.shape]} vs llama.cpp {u.tensor_type.name} "
              f"{[int(x) for x in u.shape]}", flush=True)
    return f"{same}/{len(ta)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strix", required=True)
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp of the sdist (converter)")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--quants", default="f32,bf16,q8_0,q4_0,q4_k")
    ap.add_argument("--models", default="fixture,gdn2x,moe", help="which of fixture, gdn2x, moe")
    args = ap.parse_args()
    global LLAMA_CPP
    LLAMA_CPP = args.llama_cpp
    corpus = json.loads((ROOT / "tests/fixtures/tokenizer/corpus.json").read_text())
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        text = tmp / "text.txt"
        text.write_text(("\n".join(i["text"] for i in corpus) + "\n") * 2)
        models = []
        for name in args.models.split(","):
            if name == "fixture":
                models.append(FIXTURE)
            elif name == "gdn2x":
                models.append(tmp / "sharded-gdn2x")
                make_gdn2x(models[-1])
            elif name == "moe":
                models.append(tmp / "moe16")
                make_moe(models[-1])
            else:
                sys.exit(f"--models: unknown model {name!r} (fixture, gdn2x, moe)")
        failed = False
        for model in models:
            for quant in args.quants.split(","):
                r = check(args.strix, args.llama_bin, model, quant, text, args.ctx, tmp)
                # The files must hold exactly the tensors llama.cpp's own tools make. On f32
                # files llama.cpp computes in f32 too (f32 KV cache asked for) and must agree
                # closely; for bf16 and quantized weights its CPU matmuls round the activations
                # (to bf16, Q8_0 or Q8_K), which strix does not, so there only the numbers are
                # reported (its bf16 and f32 runs of the same values differ alike).
                n = int(r["same_tensors_as_llama_quantize"].split("/")[1])
                ok = r["same_tensors_as_llama_quantize"] == f"{n}/{n}"
                if quant == "f32":
                    ok &= r["max_dlogp"] <= 1e-2 and abs(r["llama_ppl"] / r["strix_ppl"] - 1) < 1e-3
                failed |= not ok
                print(json.dumps(r), "ok" if ok else "MISMATCH", flush=True)
        if failed:
            sys.exit("strix and llama.cpp disagree")


if __name__ == "__main__":
    main()
