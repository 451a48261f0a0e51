//! Quantize on load: a [`TensorSource`] wrapper that hands the model its weight matrices in a
//! GGML block format, quantized (with the reference quantizers of [`super::blocks`], on all
//! cores) from the float checkpoint as the model asks for each one.
//!
//! Only matrices are quantized (tensors requested with a 2-D shape: every projection, the
//! embedding table and `lm_head`); norms, `A_log`, `dt_bias` and the conv1d kernel stay as
//! stored. The types follow `llama-quantize` for the same target, so that strix's
//! `--quant X` and a llama.cpp `X` file hold the same bits per tensor where strix has the
//! formats:
//!
//! | scheme | most matrices | output (`lm_head`, or the embedding when tied) | others |
//! |---|---|---|---|
//! | `q8_0` | Q8_0 | Q8_0 | – |
//! | `q4_0` | Q4_0 | Q6_K | – |
//! | `q4_k` (Q4_K_M-like) | Q4_K | Q6_K | `v_proj` / `in_proj_qkv` (llama.cpp's `attn_v` / `attn_qkv`) and `down_proj` of the layers llama.cpp's `use_more_bits` picks: Q6_K |
//!
//! The untied embedding takes the scheme's main type, as llama.cpp's `token_embd` does (the
//! CPU backend gathers and dequantizes its rows). Checked against `llama-quantize` (the
//! llama.cpp build of 2026-11-29) on a random 0.8B checkpoint: the same type for every
//! tensor, for all three schemes.
//!
//! A MoE model's router (`mlp.gate`, llama.cpp's `ffn_gate_inp`) and its shared expert's gate
//! stay as stored, as llama-quantize leaves them in F32; the routed and shared experts take
//! the scheme's type, their `down_proj` promoted for Q4_K_M by the same layer rule as the dense
//! `down_proj` (llama.cpp's `ffn_down_exps` / `ffn_down_shexp`).
//!
//! Rows that are not a whole number of blocks fall back as llama.cpp's
//! `convert_incompatible_tensor` does, within the formats strix has: Q4_K and Q6_K to Q8_0
//! (llama.cpp takes Q5_0 for Q4_K), and to the stored float type when the row is not a
//! multiple of 32 either.

use std::path::Path;

use rayon::prelude::*;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{Model, Progress, TensorSource};
use crate::quant::{self, QuantType};
use crate::tensor::{Bytes, DType, HostTensor};

/// What `--quant` asks for.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantScheme {
    Q8_0,
    Q4_0,
    /// Q4_K with llama.cpp's Q4_K_M promotions to Q6_K (see the module documentation).
    Q4_K,
}

impl QuantScheme {
    pub const NAMES: [&'static str; 3] = ["q8_0", "q4_0", "q4_k"];

    pub fn name(self) -> &'static str {
        match self {
            QuantScheme::Q8_0 => "q8_0",
            QuantScheme::Q4_0 => "q4_0",
            QuantScheme::Q4_K => "q4_k",
        }
    }
}

impl std::str::FromStr for QuantScheme {
    type Err = Error;

    fn from_str(s: &str) -> Result<QuantScheme> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Ok(QuantScheme::Q8_0),
            "q4_0" => Ok(QuantScheme::Q4_0),
            "q4_k" | "q4_k_m" => Ok(QuantScheme::Q4_K),
            _ => Err(Error::input(format!(
                "unknown quantization `{s}` (expected one of {})",
                QuantScheme::NAMES.join(", ")
            ))),
        }
    }
}

impl std::fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third one
/// in between get the larger type.
fn use_more_bits(i: usize, n: usize) -> bool {
    if i < n / 8 || i >= 7 * n / 8 {
        return true;
    }
    (i - n / 8) % 3 == 2
}

/// Wraps a float checkpoint so that its matrices arrive quantized.
pub struct QuantizingSource<'a> {
    inner: &'a dyn TensorSource,
    scheme: QuantScheme,
    tied: bool,
    num_layers: usize,
}

impl<'a> QuantizingSource<'a> {
    pub fn new(
        inner: &'a dyn TensorSource,
        config: &ModelConfig,
        scheme: QuantScheme,
    ) -> QuantizingSource<'a> {
        QuantizingSource { inner, scheme, tied: config.tie_word_embeddings, num_layers: config.num_layers }
    }

    /// The type for matrix `name` with rows of `cols`, before the fallback for odd rows.
    fn preferred(&self, name: &str) -> QuantType {
        let output = name == "lm_head.weight" || (self.tied && name.ends_with("embed_tokens.weight"));
        match self.scheme {
            QuantScheme::Q8_0 => QuantType::Q8_0,
            QuantScheme::Q4_0 if output => QuantType::Q6_K,
            QuantScheme::Q4_0 => QuantType::Q4_0,
            QuantScheme::Q4_K if output => QuantType::Q6_K,
            QuantScheme::Q4_K => {
                // llama.cpp counts attn_v and attn_qkv tensors together (one per layer here:
                // v_proj in attention layers, the DeltaNet in_proj_qkv in the others), and
                // ffn_down by layer.
                let more = name.ends_with("self_attn.v_proj.weight")
                    || name.ends_with("linear_attn.in_proj_qkv.weight")
                    || (name.ends_with("down_proj.weight") && name.contains(".mlp."));
                match layer_of(name) {
                    Some(l) if more && use_more_bits(l, self.num_layers) => QuantType::Q6_K,
                    _ => QuantType::Q4_K,
                }
            }
        }
    }

    /// The type matrix `name` is stored in; `None` keeps the checkpoint's float type.
    pub fn type_for(&self, name: &str, cols: usize) -> Option<QuantType> {
        // A router's few rows decide which experts run: llama-quantize keeps them in F32.
        if name.ends_with("mlp.gate.weight") || name.ends_with("mlp.shared_expert_gate.weight") {
            return None;
        }
        let want = self.preferred(name);
        if cols.is_multiple_of(want.block_size()) {
            Some(want)
        } else if cols.is_multiple_of(QuantType::Q8_0.block_size()) {
            Some(QuantType::Q8_0)
        } else {
            None
        }
    }
}

/// `l` of a `...layers.{l}....` tensor name.
fn layer_of(name: &str) -> Option<usize> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest[..rest.find('.')?].parse().ok()
}

impl TensorSource for QuantizingSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let t = self.inner.tensor(name, shape)?;
        let &[rows, cols] = shape else { return Ok(t) };
        if t.dtype.is_quantized() {
            return Ok(t);
        }
        match self.type_for(name, cols) {
            Some(ty) => quantize_matrix(&t, rows, cols, ty),
            None => Ok(t),
        }
    }
}

/// [`Model::load`] with the weight matrices quantized to `scheme` as they are read.
/// `progress` follows the read of the files, as for `Model::load`.
pub fn load_quantized<B: Backend>(
    dir: &Path,
    backend: B,
    scheme: QuantScheme,
    progress: Option<Progress>,
) -> Result<Model<B>> {
    let config = ModelConfig::from_model_dir(dir)?;
    let ckpt = Checkpoint::open_dir(dir)?;
    ckpt.prefetch(progress);
    let src = QuantizingSource::new(&ckpt, &config, scheme);
    Model::from_source(config.clone(), &src, backend, None)
}

/// `t` (a float `[rows, cols]` matrix) quantized to `ty`, rows spread over the cores.
pub fn quantize_matrix(t: &HostTensor, rows: usize, cols: usize, ty: QuantType) -> Result<HostTensor> {
    t.check_matrix(rows, cols)?;
    let dtype = DType::from_quant_type(ty)
        .ok_or_else(|| Error::input(format!("tensor `{}`: cannot quantize to {ty}", t.name)))?;
    let out_row = ty.row_size(cols).map_err(|e| Error::input(format!("tensor `{}`: {e}", t.name)))?;
    let in_row = t.dtype.row_bytes(cols).expect("checked by check_matrix");
    let src = t.bytes.as_slice();
    let mut out = vec![0u8; rows * out_row];
    // Chunks of rows big enough to amortise the scratch, small enough to balance.
    let chunk = (4096 / cols.max(1)).max(1);
    out.par_chunks_mut(chunk * out_row).zip(src.par_chunks(chunk * in_row)).try_for_each(
        |(o, s)| -> Result<()> {
            let mut f = vec![0f32; s.len() / in_row * cols];
            quant::dequantize_row(t.dtype.quant_type(), s, &mut f)?;
            quant::quantize_row(ty, &f, o)
        },
    )?;
    Ok(HostTensor { name: t.name.clone(), dtype, shape: t.shape.clone(), bytes: Bytes::owned(&out) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp() {
        // 24 layers: 0..3, 21..24, and 3 + 3k + 2 = 5, 8, 11, 14, 17, 20.
        let picked: Vec<usize> = (0..24).filter(|&i| use_more_bits(i, 24)).collect();
        assert_eq!(picked, [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
        let picked: Vec<usize> = (0..6).filter(|&i| use_more_bits(i, 6)).collect();
        assert_eq!(picked, [2, 5]);
    }

    #[test]
    fn moe_routers_stay_float_and_experts_follow_the_scheme() {
        let mut c = crate::synthetic::preset("qwen3.5-0.8b").unwrap();
        c.num_layers = 8;
        let empty = crate::synthetic::SyntheticWeights::new(c.clone(), 0);
        let q = QuantizingSource::new(&empty, &c, QuantScheme::Q4_K);
        assert_eq!(q.type_for("model.layers.3.mlp.gate.weight", 256), None);
        assert_eq!(q.type_for("model.layers.3.mlp.shared_expert_gate.weight", 256), None);
        assert_eq!(q.type_for("model.layers.3.mlp.experts.7.gate_proj.weight", 256), Some(QuantType::Q4_K));
        // Layer 0 is among use_more_bits' layers (of 8), layer 2 is not.
        assert_eq!(q.type_for("model.layers.0.mlp.experts.7.down_proj.weight", 256), Some(QuantType::Q6_K));
        assert_eq!(
            q.type_for("model.layers.0.mlp.shared_expert.down_proj.weight", 256),
            Some(QuantType::Q6_K)
        );
        assert_eq!(q.type_for("model.layers.2.mlp.experts.7.down_proj.weight", 256), Some(QuantType::Q4_K));
        assert_eq!(q.type_for("model.layers.0.mlp.down_proj.weight", 256), Some(QuantType::Q6_K));
    }

    #[test]
    fn layer_numbers_parse() {
        assert_eq!(layer_of("model.layers.17.mlp.down_proj.weight"), Some(17));
        assert_eq!(layer_of("model.language_model.layers.3.self_attn.v_proj.weight"), Some(3));
        assert_eq!(layer_of("lm_head.weight"), None);
    }

    #[test]
    fn schemes_parse_and_name_themselves() {
        for name in QuantScheme::NAMES {
            assert_eq!(name.parse::<QuantScheme>().unwrap().name(), name);
        }
        assert_eq!("Q4_K_M".parse::<QuantScheme>().unwrap(), QuantScheme::Q4_K);
        let err = "q5_k".parse::<QuantScheme>().unwrap_err().to_string();
        assert!(err.contains("q5_k") && err.contains("q8_0"), "{err}");
    }

    #[test]
    fn quantize_matrix_equals_the_row_quantizer() {
        let (rows, cols) = (5, 512);
        let x: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let bf: Vec<u8> = x.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        let t = HostTensor {
            name: "w".into(),
            dtype: DType::BF16,
            shape: vec![rows, cols],
            bytes: Bytes::owned(&bf),
        };
        for ty in [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_K, QuantType::Q6_K] {
            let q = quantize_matrix(&t, rows, cols, ty).unwrap();
            let mut want = vec![0u8; rows * ty.row_size(cols).unwrap()];
            quant::quantize_row(ty, &t.to_f32_vec(), &mut want).unwrap();
            assert_eq!(q.bytes.as_slice(), &want[..], "{ty}");
            q.check_matrix(rows, cols).unwrap();
        }
    }
}
