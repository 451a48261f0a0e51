#!/usr/bin/env python3
"""Generate tiny random-weight Qwen3.5 MoE reference checkpoints + golden outputs.

Run from the repository root:

    python scripts/make_moe_fixtures.py   # in a virtualenv with torch, transformers, safetensors, tokenizers

The MoE sibling of make_fixtures.py (whose helpers it imports: the tokenizer, the golden cases,
the deterministic safetensors writer, the float64 reference), writing
tests/fixtures/moe-models/<fixture>/ with exactly what a Hugging Face model repo holds plus
goldens.safetensors, in the same format as tests/fixtures/models/ (see make_fixtures.py's
docstring). The classes are transformers' Qwen3_5MoeForCausalLM (model_type
qwen3_5_moe_text, flat config) and Qwen3_5MoeForConditionalGeneration (qwen3_5_moe, text under
text_config).

Experts are stored as save_pretrained writes them (one tensor per expert and projection,
mlp.experts.{e}.{gate,up,down}_proj.weight), or, for the fixtures marked fused, as
transformers' own parameters (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj
[E, H, I]), which both transformers and llama.cpp's converter read too; the script checks that
transformers reloads either file to the same weights.

Besides the dense script's checks (greedy margins, decode vs full forward, a float64
re-implementation), every router decision of every golden is checked for a near tie: the gap
between the k-th and (k+1)-th largest router logit of every token in every layer (prompt,
decode steps and the cross-check forward) must be at least ROUTE_MARGIN, or the prompt is
re-seeded, so that rounding differences between two correct float32 implementations cannot pick
different experts. The smallest gap is recorded in the goldens' metadata and README.

Deterministic: re-running it reproduces byte-identical files.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter  # noqa: E402

OUT_ROOT = os.path.join(mf.REPO_ROOT, "tests", "fixtures", "moe-models")
L, F = mf.L, mf.F

# Required: every router's k-th minus (k+1)-th largest logit, over every token and layer.
ROUTE_MARGIN = 1e-3


def fixture(*args, fused, experts, **kw):
    """make_fixtures.fixture() with a sparse MoE block for an MLP: `experts` = (experts, experts
    per token, expert intermediate size, shared expert intermediate size); `fused`: stored as
    transformers' fused parameters rather than one tensor per expert."""
    n, top_k, inter, shared = experts
    fx = mf.fixture(*args, **kw, num_experts=n, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                    shared_expert_intermediate_size=shared)
    fx["fused"] = fused
    return fx


FIXTURES = [
    # value heads 2x key heads
    fixture("moe-vlm-f32-fused", "vlm", torch.float32, tied=False, seed=5005, shards=1, mtp=True, prompts=[1, 65, 130],
            layers=[L, F, L], gdn=(2, 4, 16, 16), experts=(8, 2, 16, 24), fused=True),
    # value heads 1x key heads
    fixture("moe-causal-bf16-sharded", "causal", torch.bfloat16, tied=True, seed=6006, shards=2, mtp=True,
            prompts=[3, 64, 97], layers=[L, L, L, F], gdn=(2, 2, 16, 24), experts=(16, 4, 16, 32), fused=False),
    # value heads 2x key heads, one expert per token
    fixture("moe-causal-f32-top1", "causal", torch.float32, tied=True, seed=7007, shards=1, mtp=False, prompts=[2, 70],
            layers=[F, L], gdn=(1, 2, 32, 16), experts=(4, 1, 32, 16), fused=False),
]

MTP_EXTRA = {  # tensor name -> shape(hidden); must be ignored by loaders
    "mtp.fc.weight": lambda h: (h, 2 * h),
    "mtp.pre_fc_norm_embedding.weight": lambda h: (h,),
    "mtp.layers.0.mlp.experts.0.gate_proj.weight": lambda h: (8, h),
    "mtp.layers.0.mlp.gate.weight": lambda h: (4, h),
}


log = mf.log


def build_config(fx):
    return mf.build_config(fx, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig)


def reinit_(model, seed, tied):
    """make_fixtures' initialisation, then the routed experts (3-D parameters, which that rule
    would scale by the wrong fan-in) redrawn with fan-in = their last dimension."""
    mf.reinit_(model, seed, tied)
    g = torch.Generator().manual_seed(seed + 31337)
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            assert p.dim() == 3, name
            with torch.no_grad():
                p.copy_((torch.randn(tuple(p.shape), generator=g) / math.sqrt(p.shape[-1])).to(p.dtype))


def fuse_experts(out_dir):
    """Rewrite model.safetensors with each layer's experts fused as transformers' parameters."""
    path = os.path.join(out_dir, "model.safetensors")
    meta = mf.safetensors_metadata(path)
    tensors = load_file(path)
    out, experts = {}, {}
    for k, v in tensors.items():
        head, sep, rest = k.partition(".mlp.experts.")
        if not sep:
            out[k] = v
            continue
        e, proj = rest.split(".", 1)
        experts.setdefault(head, {})[(int(e), proj)] = v
    for head, ws in experts.items():
        n = 1 + max(e for e, _ in ws)
        gate_up = [torch.cat([ws[(e, "gate_proj.weight")], ws[(e, "up_proj.weight")]], 0) for e in range(n)]
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([ws[(e, "down_proj.weight")] for e in range(n)]).contiguous()
    save_file(out, path, metadata=meta)


class NaiveQwen35Moe(mf.NaiveQwen35):
    """make_fixtures' float64 re-implementation with the sparse MoE block for an MLP, reading
    the experts in either layout."""

    def __init__(self, fixture_dir, dtype):
        super().__init__(fixture_dir, dtype)
        with open(os.path.join(fixture_dir, "config.json")) as f:
            cfg = json.load(f)
        tc = cfg.get("text_config", cfg)
        self.n_exp, self.top_k = tc["num_experts"], tc["num_experts_per_tok"]

    def _expert(self, m_, e):
        w = self.w
        if m_ + "experts.gate_up_proj" in w:
            gu = w[m_ + "experts.gate_up_proj"][e]
            i = gu.shape[0] // 2
            return gu[:i], gu[i:], w[m_ + "experts.down_proj"][e]
        x = m_ + f"experts.{e}."
        return w[x + "gate_proj.weight"], w[x + "up_proj.weight"], w[x + "down_proj.weight"]

    def _mlp(self, m_, h):
        w = self.w
        probs = torch.softmax(w[m_ + "gate.weight"] @ h, 0)
        top, idx = torch.topk(probs, self.top_k)
        top = top / top.sum()
        out = torch.zeros_like(h)
        for p, e in sorted(zip(top.tolist(), idx.tolist()), key=lambda pe: pe[1]):
            g, u, d = self._expert(m_, e)
            out = out + p * (d @ (self._silu(g @ h) * (u @ h)))
        s_ = m_ + "shared_expert."
        shared = w[s_ + "down_proj.weight"] @ (self._silu(w[s_ + "gate_proj.weight"] @ h) * (w[s_ + "up_proj.weight"] @ h))
        return out + torch.sigmoid(w[m_ + "shared_expert_gate.weight"] @ h) * shared


class RouterWatch:
    """Records, for every router call, the smallest gap between the k-th and (k+1)-th largest
    logit over its tokens."""

    def __init__(self, model):
        self.min_gap = math.inf
        self.handles = []
        for mod in model.modules():
            if isinstance(mod, Qwen3_5MoeTopKRouter):
                self.handles.append(mod.register_forward_hook(self.hook))
        assert self.handles

    def hook(self, mod, inputs, output):
        logits = output[0].detach().double()
        k = mod.top_k
        if k < logits.shape[-1]:
            top = torch.topk(logits, k + 1, dim=-1).values
            self.min_gap = min(self.min_gap, (top[:, k - 1] - top[:, k]).min().item())

    def reject(self):
        """After a case ran: why its routing is too near a tie for a golden, or None. Keeps
        the case's gap in `gap` and starts the next case's record."""
        self.gap, self.min_gap = self.min_gap, math.inf
        if self.gap < ROUTE_MARGIN:
            return f"router near tie (gap {self.gap:.2e})"
        return None


def make_fixture(fx, tok_dir, summary):
    name = fx["name"]
    out_dir = mf.fresh_dir(OUT_ROOT, name)
    cls = Qwen3_5MoeForConditionalGeneration if fx["arch"] == "vlm" else Qwen3_5MoeForCausalLM
    _, model = mf.random_model(fx, cls, build_config, reinit_)

    expected = mf.save_weights(model, out_dir, fx["shards"])
    del model
    if fx["fused"]:
        assert fx["shards"] == 1
        fuse_experts(out_dir)
    mf.write_generation_config(out_dir)
    mf.rewrite_config_json(out_dir)

    if fx["inject_mtp"]:
        h = mf.COMMON_TEXT["hidden_size"]
        g = torch.Generator().manual_seed(fx["seed"] + 777)
        extra = {k: (torch.randn(shp(h), generator=g) * 0.1).to(fx["dtype"]) for k, shp in MTP_EXTRA.items()}
        mf.inject_extra(out_dir, extra, sharded=fx["shards"] > 1)
    mf.copy_tokenizer(tok_dir, out_dir)

    on_disk = mf.read_weights_of_dtype(out_dir, fx["dtype"])
    per_expert = any(".mlp.experts.0.gate_proj.weight" in k and not k.startswith("mtp.") for k in on_disk)
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in on_disk)
    assert (per_expert, fused) == (not fx["fused"], fx["fused"]), (per_expert, fused)

    model, tc = mf.reload_f32(cls, out_dir, fx, expected)
    watch = RouterWatch(model)
    goldens, rows, seeds, f64errs, route_gaps = {}, [], [], [], []
    min_margin_all = math.inf
    naive64, naive32 = NaiveQwen35Moe(out_dir, torch.float64), NaiveQwen35Moe(out_dir, torch.float32)
    for T in fx["prompts"]:
        pseed, ids, logits, greedy, decode, xerr, xerr0, m, maxabs, err_gold, err_n32 = mf.find_case(
            model, name, fx["seed"], T, tc.vocab_size, naive64, naive32, attempts=200, reject=watch.reject
        )
        f64errs.append(err_gold)
        seeds.append(pseed)
        route_gaps.append(watch.gap)
        mf.add_golden(goldens, T, ids, logits, greedy, decode)
        min_margin_all = min(min_margin_all, m)
        rows.append((T, maxabs, m, xerr0, xerr, watch.gap, greedy.tolist(), err_gold, err_n32))

    meta = mf.golden_metadata(
        fx,
        seeds,
        min_margin_all,
        f64errs,
        min_router_gap=",".join(f"{g:.3e}" for g in route_gaps),
        experts_layout="fused" if fx["fused"] else "per-expert",
    )
    size = mf.finish_fixture(out_dir, goldens, meta)
    summary.append((name, size, rows))
    return sorted(os.listdir(out_dir))


def write_readme(summary, files):
    lines = mf.readme_intro("MoE model fixtures", "make_moe_fixtures.py") + [
        "pure-torch GDN kernels. Same goldens format and common text dims as `tests/fixtures/models/README.md`.",
        f"Every router decision in every golden has a gap of at least {ROUTE_MARGIN:g} between the k-th and",
        "(k+1)-th largest router logit (column `router gap`: the smallest over all tokens and layers).",
        "",
    ]
    by_name = {fx["name"]: fx for fx in FIXTURES}
    for name, size, rows in summary:
        fx = by_name[name]
        t = fx["text"]
        cls = ("Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe, text under text_config, weights under "
               "model.language_model.*, plus model.visual.*)") if fx["arch"] == "vlm" else \
            "Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text, flat config, weights under model.*)"
        weights = (
            f"{'tied' if fx['tied'] else 'untied'}, "
            + ("single model.safetensors" if fx["shards"] == 1 else f"{fx['shards']} shards + index")
            + (", experts fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)" if fx["fused"] else ", experts one by one")
        )
        dims = (f"experts {t['num_experts']}, top-{t['num_experts_per_tok']}, moe_intermediate_size {t['moe_intermediate_size']}, "
                f"shared_expert_intermediate_size {t['shared_expert_intermediate_size']}; GDN k heads {t['linear_num_key_heads']}, "
                f"v heads {t['linear_num_value_heads']}, k dim {t['linear_key_head_dim']}, v dim {t['linear_value_head_dim']}")
        middle = {
            "decode vs full-forward": lambda T, maxabs, m, x0, x, *_: f"{x:.1e}",
            "router gap": lambda T, maxabs, m, x0, x, gap, *_: f"{gap:.2e}",
        }
        lines += mf.readme_section(fx, cls, weights, "", dims, files[name], size, rows, middle)
    mf.write_lines(os.path.join(OUT_ROOT, "README.md"), lines)


def main():
    mf.prepare_reference()
    mf.remove_stale_fixtures(OUT_ROOT, FIXTURES)
    only = set(sys.argv[1:])
    summary, files = [], {}
    with tempfile.TemporaryDirectory() as tok_dir:
        mf.build_tokenizer(tok_dir)
        for fx in FIXTURES:
            if only and fx["name"] not in only:
                continue
            log(f"building {fx['name']} ...")
            files[fx["name"]] = make_fixture(fx, tok_dir, summary)
    if not only:
        write_readme(summary, files)
    for name, size, rows in summary:
        log(f"{name}: {size / 1024:.1f} KiB")
        for T, maxabs, m, x0, x, gap, greedy, eg, e32 in rows:
            log(f"  T={T} max|logit| {maxabs:.3f} margin {m:.4f} xcheck {x:.1e} router gap {gap:.2e} vs f64 {eg:.1e} n32 {e32:.1e}")


if __name__ == "__main__":
    main()
