#!/usr/bin/env python3
"""Generate tiny random-weight Qwen3.5 reference checkpoints + golden outputs.

Run from the repository root:

    python scripts/make_fixtures.py   # in a virtualenv with torch, transformers, safetensors, tokenizers

Reference implementation used to produce the committed fixtures:
    transformers 5.24.0, torch 2.15.0 (CPU), safetensors 0.8.0, tokenizers 0.23.3
(the versions actually used are also printed and written into every goldens.safetensors metadata).

Output: tests/fixtures/models/<fixture>/ with exactly what a Hugging Face model repo holds
(config.json, generation_config.json, weights, tokenizer.json, tokenizer_config.json,
chat_template.jinja if available) plus goldens.safetensors.

goldens.safetensors holds, for every prompt length T of the fixture:
    p{T}.ids            int64   [T]         the prompt (random ids in [0, vocab), seeded)
    p{T}.logits         float32 [T, V]      logits at every prompt position, ONE forward, no cache
    p{T}.greedy         int64   [N]         greedy[0] = argmax(logits[T-1]);
                                            greedy[i+1] = argmax(decode_logits[i])
    p{T}.decode_logits  float32 [N, V]      logits after feeding greedy[i] one token at a time
                                            through the model's cache (single-token recurrent path)
with N = 10, and string metadata: fixture, transformers, torch, prompt_lengths, prompt_seeds,
layer_types, min_greedy_margin, weight_dtype, compute_dtype, decode_steps, rel_err_vs_f64
(per prompt length: max|golden - independent float64 reference| / max|logit|).

All goldens are computed in float32 arithmetic. For bf16 fixtures the weights are rounded to
bf16 (that is what is stored) and the goldens come from the float32 upcast of those weights.
The goldens are computed from the checkpoint as *re-loaded from disk* with from_pretrained,
so they correspond exactly to the committed files.

The script is deterministic: re-running it reproduces byte-identical files.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile

import torch

import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

REF_TRANSFORMERS = "5.24.0"
REF_TORCH = "2.15.0"

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO_ROOT, "tests", "fixtures", "models")
CHAT_TEMPLATE = os.path.join(REPO_ROOT, "scripts", "assets", "qwen3_5_chat_template.jinja")

N_DECODE = 10
# Required: min(top1 - top2) over greedy steps >= MARGIN_FRAC * max|logit| of the case.
MARGIN_FRAC = 1e-3
# Required: |incremental decode logits - full-forward logits| <= XCHECK_TOL * max|logit|.
XCHECK_TOL = 1e-4
# Required: the goldens and an independent naive float32 run must both agree with the independent
# naive float64 reference (NaiveQwen35 below) to COND_TOL * max|logit|. Cases (prompts) where the
# random network is badly conditioned (e.g. a GDN head whose output is nearly cancelled and then
# re-amplified by the per-head gated RMSNorm) are re-seeded, so two correct float32 implementations
# agree to a few 1e-6 relative on every golden.
COND_TOL = 4e-6
# Required: the greedy continuation has at least this many distinct tokens (not a fixed point).
MIN_DISTINCT_GREEDY = 6

L, F = "linear_attention", "full_attention"

# Tokenizer: ids 0..BPE_VOCAB-1 from the trained byte-level BPE, then the added tokens.
BPE_VOCAB = 320
ADDED_TOKENS = [  # (content, special) -- same "special" flags as the real Qwen3.5 tokenizer
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
]
ENDOFTEXT_ID = BPE_VOCAB + 0
IM_END_ID = BPE_VOCAB + 2

COMMON_TEXT = dict(
    vocab_size=384,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    hidden_act="silu",
    attention_bias=False,
    eos_token_id=IM_END_ID,
    pad_token_id=None,
    bos_token_id=None,
)
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
# The vision tower of the conditional-generation fixtures (irrelevant to the text goldens).
VISION = dict(
    depth=1,
    hidden_size=16,
    num_heads=2,
    intermediate_size=32,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    in_channels=3,
    out_hidden_size=64,
    num_position_embeddings=16,
)


def fixture(name, arch, dtype, *, tied, seed, shards, mtp, prompts, layers, gdn, drop_layer_types=None, **text):
    """One row of a fixtures table: the fixture's name, class (`vlm`: conditional generation,
    with the VISION tower; `causal`: the text model alone), weight dtype, tying, seed, number of
    weight files, whether extra `mtp.*` tensors are added, and prompt lengths. Its text config
    (over COMMON_TEXT) sets the layer types `layers`, the GDN shape `gdn` (key heads, value heads,
    key head dim, value head dim) and the fields `text`, with ROPE's rotary parameters (plus the
    published checkpoints' multimodal sections for a vlm: irrelevant for text-only positions).
    `drop_layer_types`: config.json gets full_attention_interval=N instead of layer_types."""
    k_heads, v_heads, k_dim, v_dim = gdn
    rope = dict(ROPE, mrope_section=[2, 1, 1], mrope_interleaved=True) if arch == "vlm" else dict(ROPE)
    fx = dict(name=name, arch=arch, dtype=dtype, tied=tied, seed=seed, shards=shards, inject_mtp=mtp,
              drop_layer_types=drop_layer_types, prompts=prompts)
    fx["text"] = dict(num_hidden_layers=len(layers), layer_types=layers, linear_num_key_heads=k_heads,
                      linear_num_value_heads=v_heads, linear_key_head_dim=k_dim, linear_value_head_dim=v_dim,
                      rope_parameters=rope, **text)
    if arch == "vlm":
        fx["vision"] = dict(VISION)
    return fx


FIXTURES = [
    # ends with a linear-attention layer
    fixture("vlm-f32-gdn2x", "vlm", torch.float32, tied=False, seed=1001, shards=1, mtp=True, prompts=[1, 63, 64, 65, 130],
            layers=[L, F, L, F, L], gdn=(2, 4, 16, 24), intermediate_size=96),
    # layer types == full_attention_interval 3, which config.json gives instead
    fixture("causal-bf16-sharded", "causal", torch.bfloat16, tied=True, seed=2002, shards=3, mtp=True, prompts=[1, 64, 130],
            layers=[L, L, F, L, L, F], gdn=(4, 4, 16, 16), intermediate_size=96, drop_layer_types=3),
    # full attention first
    fixture("causal-f32-tied-gdn2x", "causal", torch.float32, tied=True, seed=3003, shards=1, mtp=False, prompts=[65, 130],
            layers=[F, L, L, F], gdn=(1, 2, 32, 16), intermediate_size=64),
    # extra: value heads = 3x key heads, untied bf16 causal LM (bf16 lm_head), single file
    fixture("causal-bf16-gdn3x", "causal", torch.bfloat16, tied=False, seed=4004, shards=1, mtp=False, prompts=[3, 97],
            layers=[L, F, L, F], gdn=(2, 6, 8, 12), intermediate_size=64),
]

TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still be a useful model when
the goal is to test the machinery around it: loading weights, running the layers in the right
order, and producing the same numbers as the reference implementation, step after step.

Linear attention keeps a fixed-size state per head. Every new token decays the old state a
little, reads what the state predicts for its key, and writes back only the correction. Full
attention, by contrast, keeps every key and value it has seen and looks at all of them again.
A hybrid model mixes both kinds of layers, so its cache holds convolution states, recurrent
states, and a growing list of keys and values.

Once upon a time there was a tokenizer that knew only bytes. It learned, one merge at a time,
that "th" and "he" and "the" appear again and again, that " and" is common, and that numbers
like 2024, 3.14 and 1000000 are made of digits. It did not learn everything, and that is fine:
any text can still be written as bytes, even emoji like \U0001f642 or accented words like cafe\u0301 and
na\u00efve.

<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
<think>
The user asks a simple question.
</think>
The capital of France is Paris.<|im_end|>
"""

MTP_EXTRA = {  # tensor name -> shape function(hidden, intermediate); must be ignored by loaders
    "mtp.fc.weight": lambda h, i: (h, 2 * h),
    "mtp.pre_fc_norm_embedding.weight": lambda h, i: (h,),
    "mtp.layers.0.input_layernorm.weight": lambda h, i: (h,),
    "mtp.layers.0.self_attn.k_norm.weight": lambda h, i: (32,),
}


# ----------------------------------------------------------------------------------------------
# helpers


def log(*a):
    print(*a, flush=True)


def check_pure_torch():
    for pkg in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            sys.exit(f"error: package {pkg!r} is installed; the reference must use the pure-torch paths")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"):
        mod = getattr(getattr(m, fn), "__module__", "")
        if "qwen3_5" not in mod:
            sys.exit(f"error: {fn} resolves to {mod}, not the pure-torch implementation")


def build_config(fx, vlm_config=Qwen3_5Config, text_config_cls=Qwen3_5TextConfig):
    """The fixture's config: COMMON_TEXT with its text fields, flat (causal) or with its vision
    tower under a conditional-generation config (the classes are make_moe_fixtures.py's for MoE)."""
    text = dict(COMMON_TEXT)
    text.update(fx["text"])
    text["tie_word_embeddings"] = fx["tied"]
    if fx["arch"] == "vlm":
        return vlm_config(
            text_config=text,
            vision_config=dict(fx["vision"]),
            tie_word_embeddings=fx["tied"],
        )
    return text_config_cls(**text)


def text_config(cfg):
    return cfg.text_config if hasattr(cfg, "text_config") else cfg


def reinit_(model, seed, tied):
    """Re-initialise every parameter with seeded random values (never constant)."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    for name, p in model.named_parameters():  # deterministic module order; tied params appear once
        shape = tuple(p.shape)
        if name.endswith("embed_tokens.weight"):
            v = normal(shape, 0.3 if tied else 1.0)
        elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain multiplier
            v = uniform(shape, 0.7, 1.3)
        elif name.endswith("A_log"):
            v = torch.log(uniform(shape, 0.3, 2.0))
        elif name.endswith("dt_bias"):
            v = normal(shape, 0.5, -4.0)
        elif name.endswith("conv1d.weight"):  # [C, 1, K] depthwise
            v = normal(shape, 0.6)
        elif "visual" not in name and name.endswith("norm.weight"):
            # Qwen3_5RMSNorm (input/post_attention/final/q_norm/k_norm): zero-centred, y = x*(1+w)
            v = normal(shape, 0.2)
        elif "visual" in name and ("norm" in name) and name.endswith(".weight") and len(shape) == 1:
            v = normal(shape, 0.1, 1.0)  # LayerNorm gamma
        elif name.endswith("lm_head.weight"):
            v = normal(shape, 2.0 / math.sqrt(shape[1]))
        elif len(shape) >= 2:
            fan_in = math.prod(shape[1:])
            v = normal(shape, 1.0 / math.sqrt(fan_in))
        elif name.endswith("bias"):
            v = normal(shape, 0.05)
        else:
            raise RuntimeError(f"no init rule for parameter {name} {shape}")
        with torch.no_grad():
            p.copy_(v.to(p.dtype))
    # buffers that are persistent would also be saved; make sure there are none we forgot
    persistent = [n for n, _ in model.named_buffers() if n in model.state_dict()]
    if persistent:
        raise RuntimeError(f"unexpected persistent buffers: {persistent}")


def save_safetensors_deterministic(tensors, path, metadata):
    """Like safetensors.torch.save_file, but with a byte-stable header.

    (safetensors serialises the __metadata__ map in random order when it has several keys.)
    Tensors are laid out in name order; the header is compact JSON with sorted keys, padded
    with spaces to a multiple of 8 bytes as the format requires."""
    dtypes = {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16"}
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(len(hjson).to_bytes(8, "little"))
        f.write(hjson)
        for raw in blobs:
            f.write(raw)
    # read back with the reference library
    back = load_file(path)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert safetensors_metadata(path) == metadata


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def safetensors_metadata(path):
    with safe_open(path, framework="pt") as f:
        return f.metadata()


def mtp_tensors(cfg, dtype, seed):
    tc = text_config(cfg)
    g = torch.Generator().manual_seed(seed + 777)
    out = {}
    for name, shp in MTP_EXTRA.items():
        shape = shp(tc.hidden_size, tc.intermediate_size)
        out[name] = (torch.randn(shape, generator=g) * 0.1).to(dtype)
    return out


def save_sharded(model, out_dir, n_shards):
    """save_pretrained with a max_shard_size chosen so that exactly n_shards shards come out."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    lo = total // n_shards
    for size in range(lo, total, max(1, total // 200)):
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, max_shard_size=size)
            files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
            if len(files) == n_shards:
                for f in os.listdir(tmp):
                    shutil.copy(os.path.join(tmp, f), os.path.join(out_dir, f))
                return size
    raise RuntimeError(f"could not get {n_shards} shards")


def inject_extra(out_dir, extra, sharded):
    """Add tensors (mtp.*) the text model must ignore; keep everything that was saved."""
    if not sharded:
        path = os.path.join(out_dir, "model.safetensors")
        meta = safetensors_metadata(path)
        assert meta is None or len(meta) <= 1, meta  # (several keys would be written in random order)
        tensors = load_file(path)
        assert not set(tensors) & set(extra)
        tensors.update(extra)
        save_file(tensors, path, metadata=meta)
        return
    idx_path = os.path.join(out_dir, "model.safetensors.index.json")
    with open(idx_path) as f:
        index = json.load(f)
    last = sorted(set(index["weight_map"].values()))[-1]
    path = os.path.join(out_dir, last)
    meta = safetensors_metadata(path)
    assert meta is None or len(meta) <= 1, meta
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata=meta)
    for k, t in extra.items():
        index["weight_map"][k] = last
    md = index.setdefault("metadata", {})
    if "total_size" in md:
        md["total_size"] = int(md["total_size"]) + sum(t.numel() * t.element_size() for t in extra.values())
    if "total_parameters" in md:
        md["total_parameters"] = int(md["total_parameters"]) + sum(t.numel() for t in extra.values())
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    write_json(idx_path, index)


def read_all_weights(out_dir):
    files = sorted(f for f in os.listdir(out_dir) if f.startswith("model") and f.endswith(".safetensors"))
    out = {}
    for f in files:
        out.update(load_file(os.path.join(out_dir, f)))
    return out


# ----------------------------------------------------------------------------------------------
# tokenizer


# The Qwen3.5 pre-tokenizer split pattern (from the published tokenizer.json).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(tok_dir):
    """Tiny byte-level BPE with the same pipeline as the real Qwen3.5 tokenizer.json
    (NFC normalizer, Split(regex, isolated) + ByteLevel(use_regex=false) pre-tokenizer, ByteLevel
    post-processor/decoder, BPE with ignore_merges), trained on TOKENIZER_TEXT."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    corpus = TOKENIZER_TEXT
    for content, _ in ADDED_TOKENS:  # train on plain text only
        corpus = corpus.replace(content, "\n")
    tok.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = True  # as in Qwen3.5
    tok = Tokenizer.from_str(json.dumps(spec))
    for content, special in ADDED_TOKENS:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(content) == BPE_VOCAB + i, (content, tok.token_to_id(content))
    tok.save(os.path.join(tok_dir, "tokenizer.json"), pretty=True)

    added_decoder = {
        str(BPE_VOCAB + i): {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s,
        }
        for i, (c, s) in enumerate(ADDED_TOKENS)
    }
    write_json(
        os.path.join(tok_dir, "tokenizer_config.json"),
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_decoder,
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 1024,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    return tok


def check_tokenizer(fixture_dir):
    """The files must load through transformers' AutoTokenizer identically to `tokenizers`."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(os.path.join(fixture_dir, "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(fixture_dir)
    s = "<|im_start|>user\nHello, the world! 3.14 caf\u00e9 \U0001f642<|im_end|>\n<think>\nok\n</think>"
    a = raw.encode(s).ids
    b = hf(s)["input_ids"]
    assert a == b, (a, b)
    assert hf.decode(b) == s, hf.decode(b)
    assert hf.eos_token_id == IM_END_ID and hf.bos_token is None
    if os.path.exists(os.path.join(fixture_dir, "chat_template.jinja")):
        msgs = [{"role": "user", "content": "Hello there"}]
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = raw.encode(text).ids
        assert ids.count(BPE_VOCAB + 1) >= 2 and IM_END_ID in ids, (text, ids)  # <|im_start|>, <|im_end|>
    return a


# ----------------------------------------------------------------------------------------------
# independent naive reference


class NaiveQwen35:
    """Token-by-token re-implementation of the Qwen3.5 text forward, written from the transformers
    source but sharing no code with it, reading the fixture files directly (index/shards, prefix
    model.language_model. vs model., tied lm_head, layer_types or full_attention_interval).
    Used in float64 as a "truth" to measure the float32 rounding noise of each golden."""

    def __init__(self, fixture_dir, dtype):
        self.dt = dtype
        with open(os.path.join(fixture_dir, "config.json")) as f:
            cfg = json.load(f)
        tc = cfg.get("text_config", cfg)
        idx = os.path.join(fixture_dir, "model.safetensors.index.json")
        if os.path.exists(idx):
            with open(idx) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        prefix = "model.language_model." if "text_config" in cfg else "model."
        self.w = {}
        for fn in files:
            for k, v in load_file(os.path.join(fixture_dir, fn)).items():
                if k.startswith(prefix) or k == "lm_head.weight":
                    self.w[k.removeprefix(prefix)] = v.to(dtype)
        if "lm_head.weight" not in self.w:
            assert cfg.get("tie_word_embeddings", False)
            self.w["lm_head.weight"] = self.w["embed_tokens.weight"]
        n = tc["num_hidden_layers"]
        self.layer_types = tc.get("layer_types") or [
            F if (i + 1) % tc.get("full_attention_interval", 4) == 0 else L for i in range(n)
        ]
        self.eps = tc["rms_norm_eps"]
        self.nh, self.nkv, self.hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
        rp = tc["rope_parameters"]
        self.rd = int(self.hd * rp.get("partial_rotary_factor", 1.0))
        self.inv_freq = 1.0 / (rp["rope_theta"] ** (torch.arange(0, self.rd, 2, dtype=torch.float64) / self.rd))
        self.nk, self.nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        self.dk, self.dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        self.kernel = tc["linear_conv_kernel_dim"]

    def _rms(self, x, w, zero_centred=True):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return y * (1.0 + w) if zero_centred else y * w

    def _rope(self, x, pos):  # x [heads, hd]; rotate_half over the first rd dims only
        ang = (pos * self.inv_freq).to(self.dt)
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        r, half = x[:, : self.rd], self.rd // 2
        rot = torch.cat([-r[:, half:], r[:, :half]], -1)
        return torch.cat([r * cos + rot * sin, x[:, self.rd :]], -1)

    @staticmethod
    def _silu(x):
        return x * torch.sigmoid(x)

    def _mlp(self, m_, h):  # the dense SwiGLU MLP under the prefix m_ (make_moe_fixtures.py overrides it)
        w = self.w
        return w[m_ + "down_proj.weight"] @ (self._silu(w[m_ + "gate_proj.weight"] @ h) * (w[m_ + "up_proj.weight"] @ h))

    def run(self, tokens):
        w, dt = self.w, self.dt
        state, out_rows = {}, []
        for pos, tok in enumerate(tokens.tolist()):
            x = w["embed_tokens.weight"][tok].clone()
            for i, kind in enumerate(self.layer_types):
                p = f"layers.{i}."
                h = self._rms(x, w[p + "input_layernorm.weight"])
                if kind == L:
                    a_ = p + "linear_attn."
                    qkv = w[a_ + "in_proj_qkv.weight"] @ h  # [2*nk*dk + nv*dv]
                    st = state.setdefault(i, {
                        "conv": torch.zeros(qkv.numel(), self.kernel - 1, dtype=dt),
                        "S": torch.zeros(self.nv, self.dk, self.dv, dtype=dt),
                    })
                    win = torch.cat([st["conv"], qkv[:, None]], 1)  # last K inputs, oldest first
                    st["conv"] = win[:, 1:]
                    c = self._silu((win * w[a_ + "conv1d.weight"][:, 0, :]).sum(1))
                    kd = self.nk * self.dk
                    q = c[:kd].view(self.nk, self.dk)
                    k = c[kd : 2 * kd].view(self.nk, self.dk)
                    v = c[2 * kd :].view(self.nv, self.dv)
                    z = (w[a_ + "in_proj_z.weight"] @ h).view(self.nv, self.dv)
                    beta = torch.sigmoid(w[a_ + "in_proj_b.weight"] @ h)
                    g = -w[a_ + "A_log"].exp() * F_softplus(w[a_ + "in_proj_a.weight"] @ h + w[a_ + "dt_bias"])
                    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(self.dk)
                    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
                    rep = self.nv // self.nk  # value head j reads key/query head j // rep
                    o = torch.zeros(self.nv, self.dv, dtype=dt)
                    for j in range(self.nv):
                        kj, qj = k[j // rep], q[j // rep]
                        S = st["S"][j] * g[j].exp()
                        delta = (v[j] - kj @ S) * beta[j]
                        S = S + torch.outer(kj, delta)
                        st["S"][j] = S
                        o[j] = qj @ S
                    o = self._rms(o, w[a_ + "norm.weight"], zero_centred=False) * self._silu(z)
                    y = w[a_ + "out_proj.weight"] @ o.reshape(-1)
                else:
                    a_ = p + "self_attn."
                    qg = (w[a_ + "q_proj.weight"] @ h).view(self.nh, 2 * self.hd)  # per head: [query | gate]
                    q, gate = qg[:, : self.hd], qg[:, self.hd :].reshape(-1)
                    k = (w[a_ + "k_proj.weight"] @ h).view(self.nkv, self.hd)
                    v = (w[a_ + "v_proj.weight"] @ h).view(self.nkv, self.hd)
                    q = self._rope(self._rms(q, w[a_ + "q_norm.weight"]), pos)
                    k = self._rope(self._rms(k, w[a_ + "k_norm.weight"]), pos)
                    st = state.setdefault(i, {"k": [], "v": []})
                    st["k"].append(k)
                    st["v"].append(v)
                    ks, vs = torch.stack(st["k"]), torch.stack(st["v"])  # [t, nkv, hd]
                    rep = self.nh // self.nkv
                    o = torch.zeros(self.nh, self.hd, dtype=dt)
                    for j in range(self.nh):
                        att = torch.softmax(ks[:, j // rep] @ q[j] / math.sqrt(self.hd), 0)
                        o[j] = att @ vs[:, j // rep]
                    y = w[a_ + "o_proj.weight"] @ (o.reshape(-1) * torch.sigmoid(gate))
                x = x + y
                h = self._rms(x, w[p + "post_attention_layernorm.weight"])
                x = x + self._mlp(p + "mlp.", h)
            out_rows.append(w["lm_head.weight"] @ self._rms(x, w["norm.weight"]))
        return torch.stack(out_rows).to(torch.float64)


def F_softplus(x):
    return torch.nn.functional.softplus(x)


# ----------------------------------------------------------------------------------------------
# goldens


def margins(logits_rows):
    top2 = torch.topk(logits_rows, 2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


@torch.no_grad()
def run_case(model, ids):
    """Returns logits [T,V], greedy [N], decode_logits [N,V], cross-check rel error."""
    T = ids.numel()
    inp = ids.view(1, T)
    # 1) one full forward, no cache
    logits = model(input_ids=inp, use_cache=False).logits[0].float()
    # 2) prefill with a cache, then single-token decode with the returned cache object
    out = model(input_ids=inp, use_cache=True)
    cache = out.cache
    assert cache is not None
    prefill_diff = (out.logits[0].float() - logits).abs().max().item()
    # (not bitwise: with a cache and T < conv kernel the conv input is left-padded to the kernel size)
    assert prefill_diff <= 1e-5 * logits.abs().max().item(), f"prefill with cache differs: {prefill_diff}"
    greedy, decode = [], []
    nxt = int(logits[-1].argmax())
    for i in range(N_DECODE):
        greedy.append(nxt)
        assert cache.get_seq_length() == T + i
        step = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), cache=cache, use_cache=True)
        cache = step.cache
        row = step.logits[0, -1].float()
        decode.append(row)
        nxt = int(row.argmax())
    greedy = torch.tensor(greedy, dtype=torch.long)
    decode = torch.stack(decode)
    # 3) cross-check: full forward (chunked GDN path) over prompt + greedy[0..N-1]
    full = model(input_ids=torch.cat([ids, greedy]).view(1, -1), use_cache=False).logits[0].float()
    ref = full[T:]  # position T+i has consumed greedy[i]
    scale = max(logits.abs().max().item(), decode.abs().max().item())
    xerr = (ref - decode).abs().max().item() / scale
    xerr0 = (ref[0] - decode[0]).abs().max().item() / scale
    assert xerr < XCHECK_TOL, f"recurrent vs chunked mismatch: {xerr}"
    assert (full[:T] - logits).abs().max().item() / scale < XCHECK_TOL
    return logits, greedy, decode, xerr, xerr0


# ----------------------------------------------------------------------------------------------
# the steps of making one fixture (make_moe_fixtures.py runs them too)


def fresh_dir(root, name):
    """root/name, emptied."""
    out_dir = os.path.join(root, name)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    return out_dir


def random_model(fx, cls, config_of, reinit):
    """A `cls` model of the fixture's config (`config_of(fx)`) with seeded random weights
    (`reinit(model, seed, tied)`), in the fixture's dtype (bf16 rounding happens here:
    round-to-nearest-even). Returns the config and the model."""
    torch.manual_seed(fx["seed"])
    cfg = config_of(fx)
    model = cls(cfg).eval()
    reinit(model, fx["seed"], fx["tied"])
    return cfg, model.to(fx["dtype"])


def save_weights(model, out_dir, shards):
    """save_pretrained into one file or `shards` shards; returns a copy of the state dict."""
    if shards == 1:
        model.save_pretrained(out_dir)
        assert os.path.exists(os.path.join(out_dir, "model.safetensors"))
    else:
        save_sharded(model, out_dir, shards)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_generation_config(out_dir):
    gen = GenerationConfig(eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID, bos_token_id=None)
    gen.save_pretrained(out_dir)


def rewrite_config_json(out_dir, edit=None):
    """config.json re-written with sorted keys (after `edit(cfg_json)`, if given)."""
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    if edit:
        edit(cfg_json)
    write_json(cfg_path, cfg_json)


def copy_tokenizer(tok_dir, out_dir):
    """The tokenizer files, and the chat template when it exists."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out_dir, f))
    if os.path.exists(CHAT_TEMPLATE):
        shutil.copy(CHAT_TEMPLATE, os.path.join(out_dir, "chat_template.jinja"))


def read_weights_of_dtype(out_dir, dtype):
    """Every weight stored under out_dir, each checked to be of `dtype`."""
    on_disk = read_all_weights(out_dir)
    for k, v in on_disk.items():
        assert v.dtype == dtype, (k, v.dtype)
    return on_disk


def reload_f32(cls, out_dir, fx, expected):
    """Exactly what is on disk, reloaded in float32 with eager attention: nothing missing,
    nothing unexpected but mtp.*, the fixture's layer types, the saved weights. Returns the
    model and its text config."""
    model, info = cls.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    assert not info["missing_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info
    tc = text_config(model.config)
    assert tc.layer_types == fx["text"]["layer_types"], (tc.layer_types, fx["text"]["layer_types"])
    sd = model.state_dict()
    for k, v in expected.items():
        assert torch.equal(sd[k], v.float()), f"reloaded {k} differs"
    return model, tc


def find_case(model, name, seed, T, vocab, naive64, naive32, attempts, reject=None):
    """A golden case of T prompt tokens: the prompt is re-seeded (deterministically) until
    greedy decoding has no near tie and the case is well conditioned, and, when given, until
    `reject()` (called after the model ran the case) returns None rather than a reason.
    Returns (prompt seed, ids, logits, greedy, decode logits, xerr, xerr0, margin, max|logit|,
    golden vs f64, naive f32 vs f64)."""
    for attempt in range(attempts):
        pseed = seed * 100000 + T * 100 + attempt
        gp = torch.Generator().manual_seed(pseed)
        ids = torch.randint(0, vocab, (T,), generator=gp, dtype=torch.long)
        logits, greedy, decode, xerr, xerr0 = run_case(model, ids)
        why = reject() if reject else None
        m = margins(torch.cat([logits[-1:], decode])).min().item()
        maxabs = max(logits.abs().max().item(), decode.abs().max().item())
        if why:
            log(f"  {name} T={T}: {why}; re-seeding prompt")
            continue
        if m < MARGIN_FRAC * maxabs * 3:  # aim for 3x the required margin
            log(f"  {name} T={T}: near tie (margin {m:.3g}, max|logit| {maxabs:.3g}); re-seeding prompt")
            continue
        if len(set(greedy.tolist())) < MIN_DISTINCT_GREEDY:  # tied models like to repeat a token
            log(f"  {name} T={T}: degenerate greedy continuation {greedy.tolist()}; re-seeding prompt")
            continue
        seq = torch.cat([ids, greedy])
        gold = torch.cat([logits, decode]).double()
        r64 = naive64.run(seq)
        r32 = naive32.run(seq)
        err_gold = ((gold - r64).abs().max() / maxabs).item()
        err_n32 = ((r32 - r64).abs().max() / maxabs).item()
        # the naive float64 model must reproduce the greedy path
        assert torch.equal(r64[T - 1 :].argmax(-1)[:N_DECODE], greedy), f"{name} T={T}: naive f64 greedy differs"
        if err_gold > 1e-4:
            raise RuntimeError(f"{name} T={T}: naive reference disagrees with transformers ({err_gold:.2e})")
        if max(err_gold, err_n32) <= COND_TOL:
            break
        log(f"  {name} T={T}: ill-conditioned (golden vs f64 {err_gold:.2e}, naive f32 vs f64 {err_n32:.2e}); "
            "re-seeding prompt")
    else:
        raise RuntimeError(f"{name} T={T}: could not find a suitable prompt")
    assert m >= MARGIN_FRAC * maxabs
    return pseed, ids, logits, greedy, decode, xerr, xerr0, m, maxabs, err_gold, err_n32


def add_golden(goldens, T, ids, logits, greedy, decode):
    goldens[f"p{T}.ids"] = ids.contiguous()
    goldens[f"p{T}.logits"] = logits.contiguous()
    goldens[f"p{T}.greedy"] = greedy.contiguous()
    goldens[f"p{T}.decode_logits"] = decode.contiguous()


def golden_metadata(fx, seeds, min_margin_all, f64errs, **extra):
    """The goldens' string metadata (`extra` adds fields)."""
    return {
        "fixture": fx["name"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_lengths": ",".join(str(t) for t in fx["prompts"]),
        "prompt_seeds": ",".join(str(s) for s in seeds),
        "layer_types": ",".join(fx["text"]["layer_types"]),
        "min_greedy_margin": f"{min_margin_all:.6g}",
        "weight_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[fx["dtype"]],
        "decode_steps": str(N_DECODE),
        "compute_dtype": "float32",
        # per prompt length: max|golden - naive float64 reference| / max|logit|
        "rel_err_vs_f64": ",".join(f"{e:.2e}" for e in f64errs),
        **extra,
    }


def finish_fixture(out_dir, goldens, meta):
    """Writes goldens.safetensors, checks the tokenizer files, makes every file 0644; returns
    the directory's size."""
    save_safetensors_deterministic(goldens, os.path.join(out_dir, "goldens.safetensors"), meta)
    check_tokenizer(out_dir)
    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o644)
    return sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))


def make_fixture(fx, tok_dir, summary):
    name = fx["name"]
    out_dir = fresh_dir(OUT_ROOT, name)
    cls = Qwen3_5ForConditionalGeneration if fx["arch"] == "vlm" else Qwen3_5ForCausalLM
    cfg, model = random_model(fx, cls, build_config, reinit_)

    # ---- save
    expected = save_weights(model, out_dir, fx["shards"])
    del model
    write_generation_config(out_dir)

    def drop_layer_types(cfg_json):
        if fx["drop_layer_types"]:
            assert cfg_json.pop("layer_types") == fx["text"]["layer_types"]
            cfg_json["full_attention_interval"] = fx["drop_layer_types"]

    rewrite_config_json(out_dir, drop_layer_types)

    if fx["inject_mtp"]:
        inject_extra(out_dir, mtp_tensors(cfg, fx["dtype"], fx["seed"]), sharded=fx["shards"] > 1)
    copy_tokenizer(tok_dir, out_dir)

    # ---- verify files on disk
    on_disk = read_weights_of_dtype(out_dir, fx["dtype"])
    text_prefix = "model.language_model." if fx["arch"] == "vlm" else "model."
    assert ("lm_head.weight" in on_disk) == (not fx["tied"]), "lm_head presence must match tying"
    assert all(k.startswith((text_prefix, "model.visual.", "lm_head.", "mtp.")) for k in on_disk), sorted(on_disk)
    for k, v in expected.items():
        if k == "lm_head.weight" and fx["tied"]:
            continue
        assert torch.equal(on_disk[k], v), k
    if fx["shards"] > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
            wm = json.load(f)["weight_map"]
        assert set(wm) == set(on_disk) and len(set(wm.values())) == fx["shards"]

    # ---- reload exactly what is on disk, in float32
    model, tc = reload_f32(cls, out_dir, fx, expected)
    assert tc._attn_implementation == "eager" or model.config._attn_implementation == "eager"
    if fx["tied"]:
        emb = model.get_input_embeddings().weight
        assert model.lm_head.weight.data_ptr() == emb.data_ptr(), "lm_head not tied after reload"
    else:
        assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)

    # ---- goldens
    goldens, rows, seeds, f64errs = {}, [], [], []
    min_margin_all = math.inf
    naive64, naive32 = NaiveQwen35(out_dir, torch.float64), NaiveQwen35(out_dir, torch.float32)
    for T in fx["prompts"]:
        pseed, ids, logits, greedy, decode, xerr, xerr0, m, maxabs, err_gold, err_n32 = find_case(
            model, name, fx["seed"], T, tc.vocab_size, naive64, naive32, attempts=100
        )
        f64errs.append(err_gold)
        seeds.append(pseed)
        add_golden(goldens, T, ids, logits, greedy, decode)
        min_margin_all = min(min_margin_all, m)
        rows.append((T, maxabs, m, xerr0, xerr, logits.std().item(), greedy.tolist(), err_gold, err_n32))

    size = finish_fixture(out_dir, goldens, golden_metadata(fx, seeds, min_margin_all, f64errs))
    wsize = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir) if f.startswith("model"))
    gsize = os.path.getsize(os.path.join(out_dir, "goldens.safetensors"))
    summary.append((name, size, wsize, gsize, rows))
    return sorted(os.listdir(out_dir))


def readme_intro(title, script):
    """The first lines of a fixtures README: its title, the script that made it, the reference."""
    return [
        f"# {title}",
        "",
        f"Generated by `scripts/{script}` (do not edit by hand; see `scripts/README.md`).",
        f"Reference: transformers {transformers.__version__}, torch {torch.__version__}, CPU, eager attention,",
    ]


def readme_section(fx, cls, weights, layers, dims, files, size, rows, middle):
    """One fixture's README section: its class, its weights (dtype, then `weights`, then the
    mtp.* tensors if any), its layer types (then `layers`), `dims`, its files, and a table with
    a row per prompt length (`rows`: make_fixture's summary rows) of T, max |logit|, the
    smallest greedy margin, the columns of `middle` (title -> the cell of a row), and the
    golden's and the naive f32 run's errors against float64."""
    t = fx["text"]
    columns = ["T", "max abs logit", "min greedy margin", *middle, "golden vs f64", "naive f32 vs f64"]
    cells = [[f"{r[0]}", f"{r[1]:.3f}", f"{r[2]:.4f}", *(cell(*r) for cell in middle.values()), f"{r[-2]:.1e}", f"{r[-1]:.1e}"]
             for r in rows]
    return [
        f"## {fx['name']}",
        "",
        f"- class: {cls}",
        f"- weights: {'bfloat16' if fx['dtype'] == torch.bfloat16 else 'float32'}, {weights}"
        + (", plus extra `mtp.*` tensors that must be ignored" if fx["inject_mtp"] else ""),
        f"- layers: {t['num_hidden_layers']}, layer_types: {', '.join('F' if x == F else 'L' for x in t['layer_types'])}"
        + layers,
        f"- {dims}",
        f"- files: {', '.join(files)} ({size / 1024:.1f} KiB)",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ] + ["| " + " | ".join(row) + " |" for row in cells] + [""]


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_readme(summary, files):
    """tests/fixtures/models/README.md: what each fixture is (generated; deterministic)."""
    lines = readme_intro("Model fixtures", "make_fixtures.py") + [
        "pure-torch GDN kernels (chunked prefill, chunk size 64; recurrent single-token decode).",
        "",
        "Common text dims: " + ", ".join(f"{k}={v}" for k, v in COMMON_TEXT.items() if k not in ("eos_token_id", "pad_token_id", "bos_token_id"))
        + f", rope_parameters={json.dumps(ROPE)} (rotary dim = 8 of head_dim 32), eos_token_id={IM_END_ID} (`<|im_end|>`).",
        "",
        "Goldens (`goldens.safetensors`), per prompt length T: `p{T}.ids` i64 [T], `p{T}.logits` f32 [T, vocab] (one",
        f"full forward, no cache), `p{{T}}.greedy` i64 [{N_DECODE}], `p{{T}}.decode_logits` f32 [{N_DECODE}, vocab]"
        " (logits after feeding greedy[i] through the cache). Goldens are float32 arithmetic on the stored weights.",
        "",
    ]
    by_name = {fx["name"]: fx for fx in FIXTURES}
    for name, size, wsize, gsize, rows in summary:
        fx = by_name[name]
        t = fx["text"]
        cls = "Qwen3_5ForConditionalGeneration (model_type qwen3_5, text under text_config, weights under model.language_model.*, plus model.visual.*)" if fx["arch"] == "vlm" else "Qwen3_5ForCausalLM (model_type qwen3_5_text, flat config, weights under model.*)"
        weights = (
            f"{'tied (no lm_head.weight stored)' if fx['tied'] else 'untied (lm_head.weight stored)'}, "
            + ("single model.safetensors" if fx["shards"] == 1 else f"{fx['shards']} shards + model.safetensors.index.json")
        )
        layers = (f" (config.json has NO layer_types, only full_attention_interval={fx['drop_layer_types']})"
                  if fx["drop_layer_types"] else " (explicit layer_types in config.json)")
        dims = (f"intermediate_size {t['intermediate_size']}; GDN: linear_num_key_heads {t['linear_num_key_heads']}, "
                f"linear_num_value_heads {t['linear_num_value_heads']}, linear_key_head_dim {t['linear_key_head_dim']}, "
                f"linear_value_head_dim {t['linear_value_head_dim']}")
        middle = {
            "margin / max": lambda T, maxabs, m, *_: f"{m / maxabs:.2e}",
            "decode vs full-forward": lambda T, maxabs, m, x0, x, *_: f"{x:.1e}",
        }
        lines += readme_section(fx, cls, weights, layers, dims, files[name], size, rows, middle)
    write_lines(os.path.join(OUT_ROOT, "README.md"), lines)


def prepare_reference():
    """Checks the versions and the pure-torch paths; deterministic single-process torch, quiet
    transformers."""
    log(f"transformers {transformers.__version__}, torch {torch.__version__} "
        f"(reference fixtures were made with transformers {REF_TRANSFORMERS}, torch {REF_TORCH})")
    if transformers.__version__ != REF_TRANSFORMERS or not torch.__version__.startswith(REF_TORCH):
        log("WARNING: versions differ from the ones the committed fixtures were made with")
    check_pure_torch()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def remove_stale_fixtures(root, fixtures):
    """The calling script owns `root`: fixture directories it no longer makes are removed."""
    os.makedirs(root, exist_ok=True)
    names = {fx["name"] for fx in fixtures}
    for d in sorted(os.listdir(root)):
        if os.path.isdir(os.path.join(root, d)) and d not in names:
            log(f"removing stale fixture directory {d}")
            shutil.rmtree(os.path.join(root, d))


def main():
    prepare_reference()
    if not os.path.exists(CHAT_TEMPLATE):
        log(f"WARNING: {os.path.relpath(CHAT_TEMPLATE, REPO_ROOT)} not found; fixtures get no chat_template.jinja "
            "(re-run this script once it exists)")
    remove_stale_fixtures(OUT_ROOT, FIXTURES)
    summary, files = [], {}
    with tempfile.TemporaryDirectory() as tok_dir:
        build_tokenizer(tok_dir)
        for fx in FIXTURES:
            log(f"building {fx['name']} ...")
            files[fx["name"]] = make_fixture(fx, tok_dir, summary)
    write_readme(summary, files)

    log("")
    log(f"{'fixture':<24} {'T':>4} {'max|logit|':>10} {'logit std':>9} {'min margin':>10} "
        f"{'margin/max':>10} {'xcheck[0]':>9} {'xcheck all':>10} {'vs f64':>9} {'n32 f64':>9}  greedy")
    for name, size, wsize, gsize, rows in summary:
        for T, maxabs, m, x0, x, std, greedy, eg, e32 in rows:
            log(f"{name:<24} {T:>4} {maxabs:>10.3f} {std:>9.3f} {m:>10.4f} {m / maxabs:>10.2e} "
                f"{x0:>9.1e} {x:>10.1e} {eg:>9.1e} {e32:>9.1e}  {greedy}")
    log("")
    total = 0
    for name, size, wsize, gsize, rows in summary:
        log(f"{name:<24} total {size / 1024:8.1f} KiB  (weights {wsize / 1024:.1f} KiB, goldens {gsize / 1024:.1f} KiB)")
        total += size
    log(f"{'all fixtures':<24} total {total / 1024:8.1f} KiB")
    log("xcheck = max |decode_logits - full-forward logits| / max|logit|  (recurrent vs chunked GDN path)")
    log("vs f64 = max |golden - naive float64 reference| / max|logit|; n32 f64 = same for a naive float32 run")


if __name__ == "__main__":
    main()
