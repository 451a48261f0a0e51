//! Random bf16 weights in the shapes of the published Qwen3.5 models, so benchmarks need no
//! multi-gigabyte download. The values are deterministic (seeded by tensor name) and scaled
//! like a trained model's, so activations stay finite through every layer.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::backend::ValueHeadOrder;
use crate::config::{LayerKind, ModelConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::model::TensorSource;
use crate::tensor::{Bytes, DType, HostTensor};

/// The published text decoders: the dense ones (see the table in the project's conventions)
/// and the mixtures of experts.
pub const PRESETS: &[&str] = &[
    "qwen3.5-0.8b",
    "qwen3.5-2b",
    "qwen3.5-9b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "qwen3.5-122b-a10b",
    "qwen3.5-397b-a17b",
];

/// The config of a preset shape, by name (`qwen3.5-0.8b`, `…-2b`, `…-9b`, `…-27b`,
/// `…-35b-a3b`, `…-122b-a10b`, `…-397b-a17b`).
pub fn preset(name: &str) -> Result<ModelConfig> {
    let name_lower = name.to_ascii_lowercase();
    // The mixtures of experts' published `text_config`s: (hidden, layers, q heads, DeltaNet
    // value heads, experts, experts per token, expert and shared expert width). All have 2 kv
    // heads, untied embeddings.
    let moe = match name_lower.as_str() {
        // transformers' `Qwen3_5MoeTextConfig` defaults.
        "qwen3.5-35b-a3b" | "35b-a3b" => Some((2048, 40, 16, 32, 256, 8, 512)),
        "qwen3.5-122b-a10b" | "122b-a10b" => Some((3072, 48, 32, 64, 256, 8, 1024)),
        "qwen3.5-397b-a17b" | "397b-a17b" => Some((4096, 60, 32, 64, 512, 10, 1024)),
        _ => None,
    };
    if let Some((hidden, layers, heads, v_heads, experts, per_token, width)) = moe {
        let moe = MoeConfig {
            num_experts: experts,
            num_experts_per_tok: per_token,
            moe_intermediate_size: width,
            shared_expert_intermediate_size: width,
        };
        return Ok(ModelConfig { moe: Some(moe), ..qwen35(hidden, layers, 0, heads, 2, v_heads, false) });
    }
    // (hidden, layers, intermediate, q heads, kv heads, GDN v heads, tied)
    let (hidden, layers, inter, heads, kv, v_heads, tied) = match name_lower.as_str() {
        "qwen3.5-0.8b" | "0.8b" => (1024, 24, 3584, 8, 2, 16, true),
        "qwen3.5-2b" | "2b" => (2048, 24, 6144, 8, 2, 16, true),
        "qwen3.5-9b" | "9b" => (4096, 32, 12288, 16, 4, 32, false),
        "qwen3.5-27b" | "27b" => (5120, 64, 17408, 24, 4, 48, false),
        _ => return Err(Error::input(format!("unknown preset `{name}`; known: {}", PRESETS.join(", ")))),
    };
    Ok(qwen35(hidden, layers, inter, heads, kv, v_heads, tied))
}

/// The Qwen3.5 decoder shape every preset shares: `layers` of hidden size `hidden`, every fourth
/// gated attention (`heads` q / `kv` kv heads of 256, rotary on 64 dimensions), the rest Gated
/// DeltaNet (16 key / `v_heads` value heads of 128), a dense MLP of width `inter`.
fn qwen35(
    hidden: usize,
    layers: usize,
    inter: usize,
    heads: usize,
    kv: usize,
    v_heads: usize,
    tied: bool,
) -> ModelConfig {
    ModelConfig {
        vocab_size: 248_320,
        hidden_size: hidden,
        intermediate_size: inter,
        moe: None,
        num_layers: layers,
        layer_kinds: (0..layers)
            .map(|i| if (i + 1) % 4 == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
            .collect(),
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tied,
        max_position_embeddings: 262_144,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: 256,
        rope_theta: 1e7,
        rotary_dim: 64,
        conv_kernel: 4,
        linear_num_k_heads: 16,
        linear_num_v_heads: v_heads,
        linear_k_head_dim: 128,
        linear_v_head_dim: 128,
        linear_value_head_order: ValueHeadOrder::Grouped,
        eos_token_ids: vec![248_046, 248_044],
    }
}

/// The seed of the presets' weights wherever strix makes them (`strix bench --preset`,
/// `strix quantize --preset`), so a file holds the weights the bench of that preset runs.
pub const PRESET_SEED: u64 = 0x5EED;

/// A [`TensorSource`] that makes every tensor a model of `config` asks for, on demand, with
/// the `model.` prefix of a `Qwen3_5ForCausalLM` checkpoint.
pub struct SyntheticWeights {
    config: ModelConfig,
    seed: u64,
    /// Expected shapes by name, to answer `contains` and check requests.
    shapes: HashMap<String, Vec<usize>>,
}

impl SyntheticWeights {
    pub fn new(config: ModelConfig, seed: u64) -> SyntheticWeights {
        let c = &config;
        let mut shapes = HashMap::new();
        let h = c.hidden_size;
        shapes.insert("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h]);
        shapes.insert("model.norm.weight".to_string(), vec![h]);
        if !c.tie_word_embeddings {
            shapes.insert("lm_head.weight".to_string(), vec![c.vocab_size, h]);
        }
        let (kd, vd, nv) = (c.linear_key_dim(), c.linear_value_dim(), c.linear_num_v_heads);
        let qd = c.num_heads * c.head_dim;
        let kvd = c.num_kv_heads * c.head_dim;
        for (l, kind) in c.layer_kinds.iter().enumerate() {
            let p = format!("model.layers.{l}.");
            let mut add = |n: &str, s: Vec<usize>| shapes.insert(format!("{p}{n}"), s);
            add("input_layernorm.weight", vec![h]);
            add("post_attention_layernorm.weight", vec![h]);
            match &c.moe {
                None => {
                    add("mlp.gate_proj.weight", vec![c.intermediate_size, h]);
                    add("mlp.up_proj.weight", vec![c.intermediate_size, h]);
                    add("mlp.down_proj.weight", vec![h, c.intermediate_size]);
                }
                Some(m) => {
                    let (i, s) = (m.moe_intermediate_size, m.shared_expert_intermediate_size);
                    add("mlp.gate.weight", vec![m.num_experts, h]);
                    for e in 0..m.num_experts {
                        add(&format!("mlp.experts.{e}.gate_proj.weight"), vec![i, h]);
                        add(&format!("mlp.experts.{e}.up_proj.weight"), vec![i, h]);
                        add(&format!("mlp.experts.{e}.down_proj.weight"), vec![h, i]);
                    }
                    add("mlp.shared_expert.gate_proj.weight", vec![s, h]);
                    add("mlp.shared_expert.up_proj.weight", vec![s, h]);
                    add("mlp.shared_expert.down_proj.weight", vec![h, s]);
                    add("mlp.shared_expert_gate.weight", vec![1, h]);
                }
            }
            match kind {
                LayerKind::DeltaNet => {
                    add("linear_attn.in_proj_qkv.weight", vec![2 * kd + vd, h]);
                    add("linear_attn.in_proj_z.weight", vec![vd, h]);
                    add("linear_attn.in_proj_b.weight", vec![nv, h]);
                    add("linear_attn.in_proj_a.weight", vec![nv, h]);
                    add("linear_attn.conv1d.weight", vec![2 * kd + vd, 1, c.conv_kernel]);
                    add("linear_attn.A_log", vec![nv]);
                    add("linear_attn.dt_bias", vec![nv]);
                    add("linear_attn.norm.weight", vec![c.linear_v_head_dim]);
                    add("linear_attn.out_proj.weight", vec![h, vd]);
                }
                LayerKind::Attention => {
                    add("self_attn.q_proj.weight", vec![2 * qd, h]);
                    add("self_attn.k_proj.weight", vec![kvd, h]);
                    add("self_attn.v_proj.weight", vec![kvd, h]);
                    add("self_attn.o_proj.weight", vec![h, qd]);
                    add("self_attn.q_norm.weight", vec![c.head_dim]);
                    add("self_attn.k_norm.weight", vec![c.head_dim]);
                }
            }
        }
        SyntheticWeights { config, seed, shapes }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Total bytes of all tensors (bf16).
    pub fn total_bytes(&self) -> usize {
        self.shapes.values().map(|s| s.iter().product::<usize>() * 2).sum()
    }
}

/// SplitMix64: a strong 64-bit mix, used to derive independent streams from (seed, name, block).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

impl TensorSource for SyntheticWeights {
    fn contains(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let expected = self
            .shapes
            .get(name)
            .ok_or_else(|| Error::input(format!("synthetic weights have no tensor `{name}`")))?;
        if expected != shape {
            return Err(Error::input(format!(
                "synthetic tensor `{name}` has shape {expected:?}, asked {shape:?}"
            )));
        }
        let n: usize = shape.iter().product();
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        // Uniform in [lo, hi): matrices ~ 1/sqrt(fan_in) (the embedding ~ 1), norms near their
        // neutral value, A_log = log of a decay rate in [1, 16].
        let (lo, hi) = if name.ends_with("A_log") {
            (0.0, 2.77)
        } else if name.ends_with("dt_bias") {
            (-1.0, 1.0)
        } else if name.ends_with("linear_attn.norm.weight") {
            (0.8, 1.2)
        } else if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            (-0.1, 0.1)
        } else if name.contains("embed_tokens") {
            (-1.0, 1.0)
        } else if name.contains("conv1d") {
            (-0.5, 0.5)
        } else {
            let a = 3f32.sqrt() / fan_in.sqrt();
            (-a, a)
        };
        let stream = mix(self.seed ^ name_hash(name));
        // Two bf16 values per little-endian u32 word, the layout `Bytes::Owned` keeps.
        const BLOCK_WORDS: usize = 1 << 15;
        let mut words = vec![0u32; n.div_ceil(2)];
        words.par_chunks_mut(BLOCK_WORDS).enumerate().for_each(|(b, chunk)| {
            let mut state = mix(stream ^ (b as u64).wrapping_mul(0x9E37_79B9));
            let mut next = || {
                state = mix(state);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                half::bf16::from_f32(lo + (hi - lo) * u).to_bits() as u32
            };
            for w in chunk.iter_mut() {
                *w = next() | (next() << 16);
            }
        });
        let bytes = Bytes::Owned { words: std::sync::Arc::new(words), len: n * 2 };
        Ok(HostTensor { name: name.to_string(), dtype: DType::BF16, shape: shape.to_vec(), bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::{Logits, Model};

    #[test]
    fn presets_have_the_published_shapes() {
        let c = preset("qwen3.5-9b").unwrap();
        assert_eq!((c.hidden_size, c.num_layers, c.linear_num_v_heads), (4096, 32, 32));
        assert_eq!(c.layer_kinds.iter().filter(|k| **k == LayerKind::Attention).count(), 8);
        assert!(preset("qwen3.5-0.8b").unwrap().tie_word_embeddings);
        assert!(preset("gpt-2").unwrap_err().to_string().contains("unknown preset"));
        let c = preset("qwen3.5-35b-a3b").unwrap();
        c.validate(std::path::Path::new("preset")).unwrap();
        let m = c.moe.unwrap();
        assert_eq!((c.hidden_size, c.num_layers, m.num_experts, m.num_experts_per_tok), (2048, 40, 256, 8));
        // Parameters in bf16: ~35B, ~122B, ~397B.
        for (name, billions) in
            [("qwen3.5-35b-a3b", 35.0), ("qwen3.5-122b-a10b", 122.0), ("qwen3.5-397b-a17b", 397.0)]
        {
            let c = preset(name).unwrap();
            c.validate(std::path::Path::new("preset")).unwrap();
            let params = SyntheticWeights::new(c, 0).total_bytes() as f64 / 2e9;
            assert!((params / billions - 1.0).abs() < 0.03, "{name}: {params:.1}B parameters");
        }
    }

    #[test]
    fn a_small_synthetic_moe_model_runs() {
        let mut c = preset("qwen3.5-35b-a3b").unwrap();
        c.vocab_size = 512;
        c.hidden_size = 64;
        c.num_layers = 4;
        c.layer_kinds.truncate(4);
        c.moe = Some(MoeConfig {
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            shared_expert_intermediate_size: 48,
        });
        c.linear_k_head_dim = 16;
        c.linear_v_head_dim = 16;
        c.head_dim = 32;
        c.rotary_dim = 8;
        let w = SyntheticWeights::new(c.clone(), 7);
        let model = Model::from_source(c, &w, CpuBackend::new(), None).unwrap();
        let mut s = model.new_session(32);
        let logits = model.forward(&mut s, &[1, 2, 3, 4, 5], Logits::All).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()) && logits.iter().any(|&v| v != logits[0]));
    }

    #[test]
    fn a_small_synthetic_model_runs_and_is_deterministic() {
        let mut c = preset("qwen3.5-0.8b").unwrap();
        c.vocab_size = 512;
        c.hidden_size = 64;
        c.intermediate_size = 96;
        c.num_layers = 4;
        c.layer_kinds.truncate(4);
        c.linear_k_head_dim = 16;
        c.linear_v_head_dim = 16;
        c.head_dim = 32;
        c.rotary_dim = 8;
        let w = SyntheticWeights::new(c.clone(), 7);
        let a = w.tensor("model.layers.0.mlp.up_proj.weight", &[96, 64]).unwrap();
        let b = w.tensor("model.layers.0.mlp.up_proj.weight", &[96, 64]).unwrap();
        assert_eq!(a.bytes.as_slice(), b.bytes.as_slice());
        let model = Model::from_source(c, &w, CpuBackend::new(), None).unwrap();
        let mut s = model.new_session(64);
        let logits = model.forward(&mut s, &[1, 2, 3], Logits::Last).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
        let spread = logits.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(spread > 0.1, "logits should not be flat: {spread}");
    }
}
