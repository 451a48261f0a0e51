"""A random-weight Qwen3.5 text checkpoint with a published shape, for quantization
benchmarks that need the same weights in strix (safetensors) and llama.cpp (GGUF, through
llama.cpp's convert_hf_to_gguf.py).

    python scripts/make_random_checkpoint.py OUT_DIR TOKENIZER_JSON [--preset 0.8b] [--seed 0]

Weights: transformers' own initialisation of Qwen3_5ForCausalLM (seeded), saved in bf16;
config qwen3_5_text with the preset's shape (the published Qwen3.5 dimensions, as in
strix's `synthetic.rs` presets).
TOKENIZER_JSON is the Qwen3.5 tokenizer.json (tests/fixtures/tokenizer/qwen3_5.tokenizer.json.zst,
decompressed). Made with transformers 5.24.0, torch 2.x (CPU).
"""

import argparse
import json
import os
import shutil

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

PRESETS = {
    # hidden, layers, intermediate, q heads, kv heads, GDN v heads, tied
    "0.8b": (1024, 24, 3584, 8, 2, 16, True),
    "2b": (2048, 24, 6144, 8, 2, 16, True),
    "9b": (4096, 32, 12288, 16, 4, 32, False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("tokenizer")
    ap.add_argument("--preset", default="0.8b")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    hidden, layers, inter, heads, kv, v_heads, tied = PRESETS[a.preset]
    config = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        eos_token_id=248046,
        bos_token_id=None,
    )
    torch.manual_seed(a.seed)
    with torch.no_grad():
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, max_shard_size="4GB")
    shutil.copy(a.tokenizer, os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "add_bos_token": False,
                "add_prefix_space": False,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 262144,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
