//! llama.cpp's `qwen35` GGUF layout, mapped to the model both ways: reading a file written by
//! its converter (`convert_hf_to_gguf.py`, classes `Qwen3_5TextModel` →
//! `_LinearAttentionVReorderBase` → `Qwen3NextModel`) and the name/transform table that
//! `strix quantize` writes with.
//!
//! What the converter does to a Hugging Face checkpoint, and how strix undoes it:
//! - names: `model.layers.N.linear_attn.in_proj_qkv.weight` → `blk.N.attn_qkv.weight` and so
//!   on ([`LAYER_TENSORS`], [`GLOBAL_TENSORS`]); the text model only (`mtp.*` and the vision
//!   tower are not in the file, or are ignored);
//! - every `*norm.weight` except the DeltaNet's gated `linear_attn.norm` is stored as `1 + w`
//!   (llama.cpp's RMSNorm multiplies by the weight, Qwen3.5's by `1 + w`), in f32: strix
//!   subtracts 1 again. The model then computes `1 + (x − 1)`, which is `x` exactly (both
//!   steps are exact in f32 for weights near 1), so nothing is lost;
//! - `A_log` is stored as `ssm_a = −exp(A_log)` in f32: strix takes `ln(−ssm_a)`. The model
//!   computes `−exp(A_log)` again; the round trip costs about one f32 ulp (measured in the
//!   tests far below the 1e-4 tolerance);
//! - `conv1d.weight` `[C, 1, K]` is squeezed to `[C, K]`;
//! - when there are more value heads than key heads, the value heads (rows of the V part of
//!   `in_proj_qkv`, of `in_proj_z`, `in_proj_a`, `in_proj_b`, the entries of `A_log` and
//!   `dt_bias`, the V channels of `conv1d` and the columns of `out_proj`) are permuted from
//!   transformers' grouped order to a tiled one. strix does not undo this: it loads the
//!   tensors as they are and sets [`ValueHeadOrder::Tiled`], so the delta rule pairs value
//!   head `h` with key head `h % num_k_heads` (see [`crate::backend::DeltaNetShape`]).
//!   [`retile_rows`] is the permutation itself, for the writer.
//!
//! The mixture-of-experts models are the `qwen35moe` architecture (`Qwen3_5MoeTextModel`, the
//! same transforms): the routed experts merged into 3-D tensors `ffn_{gate,up,down}_exps`
//! (GGUF dims `{hidden, width, experts}`, `{width, hidden, experts}`; or gate and up fused
//! into `ffn_gate_up_exps`, `{hidden, 2 * width, experts}`, which llama.cpp also loads), each
//! expert handed to the model as its 2-D slice (whole rows of blocks, so packed formats slice
//! as well as floats), the router `ffn_gate_inp`, the shared expert `ffn_*_shexp` and its
//! gate `ffn_gate_inp_shexp` (`{hidden, 1}`, or a vector `{hidden}`, read as a `[1, hidden]`
//! matrix). [`write_gguf`] writes them as the converter does: separate `ffn_{gate,up,down}_exps`,
//! routers in F32, the experts' widths in `expert_feed_forward_length` and
//! `expert_shared_feed_forward_length`.
//!
//! Quantized matrices are handed to the model packed, as stored (Q8_0, Q4_0, Q4_K, Q6_K);
//! Q5_0, which llama-quantize writes for rows that are not whole Q4_K super-blocks, is decoded
//! to f32 on load ([`super::q5_0`]).

use std::path::Path;

use crate::backend::ValueHeadOrder;
use crate::config::{LayerKind, ModelConfig, MoeConfig};
use crate::error::{printable, Error, Result};
use crate::model::TensorSource;
use crate::quant::on_load::{QuantScheme, QuantizingSource};
use crate::quant::QuantType;
use crate::tensor::{Bytes, DType, HostTensor};

use super::{q5_0, GgufFile};

/// `general.architecture` of a Qwen3.5 (dense) GGUF.
pub const ARCH: &str = "qwen35";

/// `general.architecture` of a Qwen3.5 mixture-of-experts GGUF.
pub const ARCH_MOE: &str = "qwen35moe";

/// Control tokens that end generation although the file does not name them EOS (Qwen's).
const EOG_TOKENS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// What happens to a tensor between the Hugging Face checkpoint and the GGUF file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transform {
    /// Stored as is (value heads permuted where the model has more value than key heads).
    Plain,
    /// A `(1 + w)` RMSNorm weight, stored as `1 + w` in f32.
    NormPlusOne,
    /// `A_log`, stored as `ssm_a = −exp(A_log)` in f32.
    NegExp,
    /// `conv1d.weight` `[C, 1, K]`, stored as `[C, K]` (GGUF dims `{K, C}`) in f32.
    Squeeze,
}

/// Per-layer tensors: (name under `model.layers.N.`, name under `blk.N.`, transform).
pub const LAYER_TENSORS: [(&str, &str, Transform); 25] = {
    use Transform::*;
    [
        ("input_layernorm.weight", "attn_norm.weight", NormPlusOne),
        ("post_attention_layernorm.weight", "post_attention_norm.weight", NormPlusOne),
        ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", Plain),
        ("linear_attn.in_proj_z.weight", "attn_gate.weight", Plain),
        ("linear_attn.in_proj_b.weight", "ssm_beta.weight", Plain),
        ("linear_attn.in_proj_a.weight", "ssm_alpha.weight", Plain),
        ("linear_attn.conv1d.weight", "ssm_conv1d.weight", Squeeze),
        ("linear_attn.A_log", "ssm_a", NegExp),
        ("linear_attn.dt_bias", "ssm_dt.bias", Plain),
        ("linear_attn.norm.weight", "ssm_norm.weight", Plain),
        ("linear_attn.out_proj.weight", "ssm_out.weight", Plain),
        ("self_attn.q_proj.weight", "attn_q.weight", Plain),
        ("self_attn.k_proj.weight", "attn_k.weight", Plain),
        ("self_attn.v_proj.weight", "attn_v.weight", Plain),
        ("self_attn.o_proj.weight", "attn_output.weight", Plain),
        ("self_attn.q_norm.weight", "attn_q_norm.weight", NormPlusOne),
        ("self_attn.k_norm.weight", "attn_k_norm.weight", NormPlusOne),
        ("mlp.gate_proj.weight", "ffn_gate.weight", Plain),
        ("mlp.up_proj.weight", "ffn_up.weight", Plain),
        ("mlp.down_proj.weight", "ffn_down.weight", Plain),
        ("mlp.gate.weight", "ffn_gate_inp.weight", Plain),
        ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight", Plain),
        ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight", Plain),
        ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight", Plain),
        // `{hidden, 1}` (or a vector `{hidden}`); the model reads a `[1, hidden]` matrix.
        ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", Plain),
    ]
};

/// A routed expert's matrix inside a merged 3-D GGUF tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSlice {
    /// `blk.N.ffn_{gate,up,down}_exps.weight` (or `ffn_gate_up_exps` for gate and up).
    pub tensor: String,
    pub expert: usize,
    /// For `ffn_gate_up_exps`: 0 for the gate's rows of the expert, 1 for up's.
    pub half: Option<usize>,
}

/// Where `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` sits in a `qwen35moe` file:
/// its merged tensor, or (`fused`) the gate/up pair's merged tensor.
pub fn expert_slice(hf: &str, fused: bool) -> Option<ExpertSlice> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once(".mlp.experts.")?;
    let (e, proj) = rest.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(layer) || !digits(e) {
        return None;
    }
    let (name, half) = match (proj, fused) {
        ("gate_proj.weight", false) => ("ffn_gate_exps", None),
        ("up_proj.weight", false) => ("ffn_up_exps", None),
        ("gate_proj.weight", true) => ("ffn_gate_up_exps", Some(0)),
        ("up_proj.weight", true) => ("ffn_gate_up_exps", Some(1)),
        ("down_proj.weight", _) => ("ffn_down_exps", None),
        _ => return None,
    };
    Some(ExpertSlice { tensor: format!("blk.{layer}.{name}.weight"), expert: e.parse().ok()?, half })
}

/// Model-wide tensors: (Hugging Face name of the text model, GGUF name, transform).
pub const GLOBAL_TENSORS: [(&str, &str, Transform); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight", Transform::Plain),
    ("model.norm.weight", "output_norm.weight", Transform::NormPlusOne),
    ("lm_head.weight", "output.weight", Transform::Plain),
];

/// The GGUF name and transform of a text-model tensor named as in a `qwen3_5_text`
/// checkpoint (`model.…`, `lm_head.weight`); `None` for names the layout has no place for.
pub fn gguf_name(hf: &str) -> Option<(String, Transform)> {
    if let Some(&(_, g, t)) = GLOBAL_TENSORS.iter().find(|(h, _, _)| *h == hf) {
        return Some((g.to_string(), t));
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let &(_, g, t) = LAYER_TENSORS.iter().find(|(h, _, _)| *h == suffix)?;
    Some((format!("blk.{layer}.{g}"), t))
}

/// The layer and projection (`gate`, `up`, `down`) of the writer's merged-experts entry
/// `model.layers.N.mlp.experts.{proj}` (see [`write_gguf`]).
fn experts_of(hf: &str) -> Option<(&str, &str)> {
    let (layer, proj) = hf.strip_prefix("model.layers.")?.split_once(".mlp.experts.")?;
    matches!(proj, "gate" | "up" | "down").then_some((layer, proj))
}

/// Permutes `rows` rows of `row_len` values each (a flat row-major slice), grouped as
/// `num_v_heads` heads of `head_rows` rows, from transformers' grouped order (value head
/// `g * per_k + r` belongs to key head `g`) to llama.cpp's tiled one (`r * num_k_heads + g`).
/// This is the converter's `_reorder_v_heads` along the row dimension.
pub fn retile_rows<T: Copy>(
    data: &[T],
    num_k_heads: usize,
    per_k: usize,
    head_rows: usize,
    row_len: usize,
) -> Vec<T> {
    let head = head_rows * row_len;
    assert_eq!(data.len(), num_k_heads * per_k * head, "retile_rows: length does not match the heads");
    let mut out = Vec::with_capacity(data.len());
    for r in 0..per_k {
        for g in 0..num_k_heads {
            let src = (g * per_k + r) * head;
            out.extend_from_slice(&data[src..src + head]);
        }
    }
    out
}

/// Permutes the columns of a `[rows, num_v_heads * head_cols]` matrix the same way (the
/// converter's `_reorder_v_heads` along dim 1, used for `out_proj`).
pub fn retile_cols<T: Copy>(
    data: &[T],
    rows: usize,
    num_k_heads: usize,
    per_k: usize,
    head_cols: usize,
) -> Vec<T> {
    let cols = num_k_heads * per_k * head_cols;
    assert_eq!(data.len(), rows * cols, "retile_cols: length does not match the heads");
    let mut out = Vec::with_capacity(data.len());
    for row in data.chunks_exact(cols) {
        out.extend(retile_rows(row, num_k_heads, per_k, head_cols, 1));
    }
    out
}

fn meta_err(file: &GgufFile, msg: impl Into<String>) -> Error {
    Error::config(file.path(), msg)
}

/// The model's shape from a `qwen35` file's metadata (and the embedding's shape for the
/// vocabulary size, which the metadata does not carry separately).
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let arch = f.get_str("general.architecture")?;
    if arch != ARCH && arch != ARCH_MOE {
        return Err(meta_err(
            f,
            format!(
                "general.architecture is `{}`: strix runs Qwen3.5 GGUF files (`{ARCH}`, `{ARCH_MOE}`)",
                printable(arch)
            ),
        ));
    }
    let arch = arch.to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let opt_usize = |k: &str| -> Result<Option<usize>> {
        let k = key(k);
        if f.metadata(&k).is_some() {
            f.get_usize(&k).map(Some)
        } else {
            Ok(None)
        }
    };
    let block_count = f.get_usize(&key("block_count"))?;
    // MTP blocks are counted in block_count but are not decoder layers.
    let nextn = opt_usize("nextn_predict_layers")?.unwrap_or(0);
    let num_layers = block_count.checked_sub(nextn).filter(|&n| n > 0).ok_or_else(|| {
        meta_err(f, format!("{arch}.block_count ({block_count}) leaves no layers after {nextn} MTP layers"))
    })?;
    if num_layers > 1 << 16 {
        return Err(meta_err(f, format!("{arch}.block_count is {block_count}: not a real model")));
    }
    check_block_count(f, &arch, block_count, num_layers)?;
    let hidden_size = f.get_usize(&key("embedding_length"))?;
    let num_heads = f.get_usize(&key("attention.head_count"))?;
    let head_dim = match opt_usize("attention.key_length")? {
        Some(d) => d,
        None if num_heads > 0 => hidden_size / num_heads,
        None => 0,
    };
    if let Some(v) = opt_usize("attention.value_length")? {
        if v != head_dim {
            return Err(meta_err(
                f,
                format!("{arch}.attention.value_length ({v}) differs from attention.key_length ({head_dim})"),
            ));
        }
    }
    let num_v_heads = f.get_usize(&key("ssm.time_step_rank"))?;
    let inner = f.get_usize(&key("ssm.inner_size"))?;
    if num_v_heads == 0 || !inner.is_multiple_of(num_v_heads) {
        return Err(meta_err(
            f,
            format!(
                "{arch}.ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({num_v_heads})"
            ),
        ));
    }
    let layer_kinds = if f.metadata(&key("attention.recurrent_layers")).is_some() {
        let flags = match f.get_array(&key("attention.recurrent_layers"))? {
            super::GgufArray::Bool(v) => v.clone(),
            other => {
                return Err(meta_err(
                    f,
                    format!(
                        "{arch}.attention.recurrent_layers is an array of {}, expected bool",
                        other.element_type().name()
                    ),
                ))
            }
        };
        if flags.len() < num_layers {
            return Err(meta_err(
                f,
                format!(
                    "{arch}.attention.recurrent_layers has {} entries for {num_layers} layers",
                    flags.len()
                ),
            ));
        }
        flags[..num_layers]
            .iter()
            .map(|&r| if r { LayerKind::DeltaNet } else { LayerKind::Attention })
            .collect()
    } else {
        let interval = opt_usize("full_attention_interval")?.unwrap_or(4);
        if interval == 0 {
            return Err(meta_err(f, format!("{arch}.full_attention_interval must be positive")));
        }
        (0..num_layers)
            .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
            .collect()
    };
    if let Some(v) = f.metadata(&key("rope.scaling.type")) {
        if *v != super::GgufValue::String("none".into()) {
            return Err(meta_err(
                f,
                format!("{arch}.rope.scaling.type is {}: only unscaled RoPE is supported", v.summary()),
            ));
        }
    }
    let embd = f.tensor_info("token_embd.weight")?;
    if embd.dims.len() != 2 || embd.dims[0] as usize != hidden_size {
        return Err(Error::checkpoint(
            f.path(),
            format!(
                "tensor `token_embd.weight` has GGUF dims {:?}, expected {{{hidden_size}, vocab}}",
                embd.dims
            ),
        ));
    }
    let mut eos_token_ids = Vec::new();
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if f.metadata(k).is_some() {
            let id = f.get_u32(k)?;
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    // The converter writes one EOS id; transformers' generation_config lists Qwen's other
    // end-of-generation token too. llama.cpp recovers it the same way: control tokens with
    // these texts end generation (`llama_vocab::impl::load`, its `special_eog_ids`).
    if let (Ok(tokens), Ok(types)) =
        (f.get_str_array("tokenizer.ggml.tokens"), f.get_i32_array("tokenizer.ggml.token_type"))
    {
        for (id, (tok, &ty)) in tokens.iter().zip(types).enumerate() {
            const CONTROL: i32 = 3;
            if ty == CONTROL && EOG_TOKENS.contains(&tok.as_str()) && !eos_token_ids.contains(&(id as u32)) {
                eos_token_ids.push(id as u32);
            }
        }
    }
    let rotary_dim = f.get_usize(&key("rope.dimension_count"))?;
    // The converter writes no feed_forward_length for a MoE model (its config has no
    // intermediate_size); the experts' widths have keys of their own.
    let (intermediate_size, moe) = if arch == ARCH_MOE {
        // llama.cpp's qwen35moe graph scales the renormalised expert weights only when the file
        // asks for it (the converter never does); strix implements the reference's block.
        if f.metadata(&key("expert_weights_scale")).is_some() {
            let scale = f.get_f32(&key("expert_weights_scale"))?;
            if scale != 0.0 && scale != 1.0 {
                return Err(meta_err(
                    f,
                    format!(
                        "{arch}.expert_weights_scale is {scale}: scaled expert weights are not implemented"
                    ),
                ));
            }
        }
        let moe = MoeConfig {
            num_experts: f.get_usize(&key("expert_count"))?,
            num_experts_per_tok: f.get_usize(&key("expert_used_count"))?,
            moe_intermediate_size: f.get_usize(&key("expert_feed_forward_length"))?,
            shared_expert_intermediate_size: f.get_usize(&key("expert_shared_feed_forward_length"))?,
        };
        (0, Some(moe))
    } else {
        (f.get_usize(&key("feed_forward_length"))?, None)
    };
    let config = ModelConfig {
        vocab_size: embd.dims[1] as usize,
        hidden_size,
        intermediate_size,
        moe,
        num_layers,
        layer_kinds,
        rms_norm_eps: f.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        tie_word_embeddings: !f.contains_tensor("output.weight"),
        max_position_embeddings: opt_usize("context_length")?.unwrap_or(32768),
        num_heads,
        num_kv_heads: f.get_usize(&key("attention.head_count_kv"))?,
        head_dim,
        rope_theta: f.get_f64(&key("rope.freq_base"))?,
        rotary_dim,
        conv_kernel: f.get_usize(&key("ssm.conv_kernel"))?,
        linear_num_k_heads: f.get_usize(&key("ssm.group_count"))?,
        linear_num_v_heads: num_v_heads,
        linear_k_head_dim: f.get_usize(&key("ssm.state_size"))?,
        linear_v_head_dim: inner / num_v_heads,
        linear_value_head_order: ValueHeadOrder::Tiled,
        eos_token_ids,
    };
    config.validate(f.path())?;
    Ok(config)
}

/// Checks `block_count` against the layers the tensors belong to (`blk.N.…`), as llama.cpp
/// does when it counts the tensors it loads ("wrong number of tensors"): a tensor of a layer
/// past `block_count` would be silently left out, and a decoder layer without tensors is a
/// file cut short. MTP layers (`nextn_predict_layers`, the last of `block_count`) may be
/// absent: converters drop them.
fn check_block_count(f: &GgufFile, arch: &str, block_count: usize, num_layers: usize) -> Result<()> {
    let mut present = vec![false; num_layers];
    for t in f.tensors() {
        let Some(layer) = t.name.strip_prefix("blk.").and_then(|rest| rest.split_once('.')).map(|(n, _)| n)
        else {
            continue;
        };
        let Some(layer) = layer.parse::<usize>().ok().filter(|_| layer.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if layer >= block_count {
            return Err(meta_err(
                f,
                format!(
                    "tensor `{}` belongs to layer {layer}, but {arch}.block_count is {block_count}: wrong \
                     number of tensors for the layer count (llama.cpp refuses such a file too)",
                    printable(&t.name)
                ),
            ));
        }
        if let Some(p) = present.get_mut(layer) {
            *p = true;
        }
    }
    if let Some(missing) = present.iter().position(|&p| !p) {
        let held = present.iter().filter(|&&p| p).count();
        return Err(meta_err(
            f,
            format!(
                "{arch}.block_count gives {num_layers} decoder layers, but the file has no tensor of layer \
                 {missing} (`blk.{missing}.*`; tensors for {held} of them): wrong number of tensors for the \
                 layer count"
            ),
        ));
    }
    Ok(())
}

/// A `qwen35` GGUF file as a [`TensorSource`] that answers to the Hugging Face names the
/// model asks for.
pub struct Qwen35Gguf {
    file: GgufFile,
    config: ModelConfig,
}

impl Qwen35Gguf {
    /// Opens and validates the file and reads the model's shape from its metadata.
    pub fn open(path: impl AsRef<Path>) -> Result<Qwen35Gguf> {
        let file = GgufFile::open(path)?;
        let config = config_from_gguf(&file)?;
        Ok(Qwen35Gguf { file, config })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    fn err(&self, msg: String) -> Error {
        Error::checkpoint(self.file.path(), msg)
    }

    fn owned_f32(name: &str, shape: &[usize], v: &[f32]) -> HostTensor {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        HostTensor {
            name: name.to_string(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            bytes: Bytes::owned(&bytes),
        }
    }
}

impl Qwen35Gguf {
    /// The merged tensor holding routed expert `name`, as this file stores it.
    fn expert_slice(&self, name: &str) -> Option<ExpertSlice> {
        [false, true]
            .into_iter()
            .filter_map(|fused| expert_slice(name, fused))
            .find(|s| self.file.contains_tensor(&s.tensor))
    }

    /// Routed expert `name`'s `[rows, cols]` matrix: its slice of the merged tensor, packed
    /// blocks as stored (Q5_0 decoded to f32).
    fn expert_tensor(&self, name: &str, slice: &ExpertSlice, shape: &[usize]) -> Result<HostTensor> {
        let gname = &slice.tensor;
        let info = self.file.tensor_info(gname)?;
        let &[rows, cols] = shape else {
            return Err(self.err(format!("`{name}` is a matrix, not shape {shape:?}")));
        };
        let per_expert = if slice.half.is_some() { 2 * rows } else { rows };
        let stored = info.shape();
        if stored.len() != 3 || stored[1] != per_expert || stored[2] != cols || slice.expert >= stored[0] {
            return Err(self.err(format!(
                "tensor `{gname}` has GGUF dims {:?} (shape {stored:?}), expected shape [experts > {}, {per_expert}, \
                 {cols}] for `{name}`",
                info.dims, slice.expert
            )));
        }
        let row_bytes = info.ty.row_size(cols).map_err(|e| self.err(format!("tensor `{gname}`: {e}")))?;
        let first = (slice.expert * per_expert + slice.half.unwrap_or(0) * rows) * row_bytes;
        let bytes = self.file.tensor_data_slice(gname, first, rows * row_bytes)?;
        if let Some(dtype) = DType::from_quant_type(info.ty) {
            let bytes = bytes.aligned(dtype.align());
            return Ok(HostTensor { name: name.to_string(), dtype, shape: shape.to_vec(), bytes });
        }
        if q5_0::handles(info.ty) {
            let mut v = vec![0f32; rows * cols];
            q5_0::dequantize_row_q5_0(bytes.as_slice(), &mut v)
                .map_err(|e| self.err(format!("tensor `{gname}`: {e}")))?;
            return Ok(Self::owned_f32(name, shape, &v));
        }
        Err(self.err(format!(
            "tensor `{gname}` is {}, which strix cannot load (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K and Q5_0 \
             are supported)",
            info.ty
        )))
    }
}

impl TensorSource for Qwen35Gguf {
    fn contains(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|(g, _)| self.file.contains_tensor(&g))
            || self.expert_slice(name).is_some()
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        if let Some(slice) = self.expert_slice(name) {
            return self.expert_tensor(name, &slice, shape);
        }
        let (gname, transform) =
            gguf_name(name).ok_or_else(|| self.err(format!("no qwen35 GGUF tensor holds `{name}`")))?;
        let info = self
            .file
            .tensor_info(&gname)
            .map_err(|_| self.err(format!("missing tensor `{gname}` (the model's `{name}`)")))?;
        let stored: Vec<usize> = match transform {
            Transform::Squeeze if shape.len() == 3 && shape[1] == 1 => vec![shape[0], shape[2]],
            // The shared expert's gate: one row, which llama.cpp's loader also takes as a
            // vector `{hidden}` (the converter writes `{hidden, 1}`).
            _ if gname.ends_with("ffn_gate_inp_shexp.weight")
                && shape.len() == 2
                && shape[0] == 1
                && info.shape() == [shape[1]] =>
            {
                vec![shape[1]]
            }
            _ => shape.to_vec(),
        };
        if info.shape() != stored {
            return Err(self.err(format!(
                "tensor `{gname}` has GGUF dims {:?} (shape {:?}), expected shape {stored:?} for `{name}`",
                info.dims,
                info.shape()
            )));
        }
        let is_float = matches!(info.ty, QuantType::F32 | QuantType::F16 | QuantType::BF16);
        // Vectors (norms, biases, A_log) are floats in every file llama.cpp makes and reads;
        // a block type there is a damaged file, whatever its byte count says.
        if shape.len() == 1 && !is_float {
            return Err(self.err(format!(
                "tensor `{gname}` is {}, but a 1-D tensor (`{name}`) is stored as a float (F32)",
                info.ty
            )));
        }
        let t = match transform {
            Transform::Plain if DType::from_quant_type(info.ty).is_some() => {
                let mut t = self.file.host_tensor(&gname)?;
                t.shape = shape.to_vec();
                t
            }
            Transform::Plain if q5_0::handles(info.ty) => {
                let mut v = vec![0f32; info.n_elements()];
                q5_0::dequantize_row_q5_0(self.file.tensor_bytes(&gname)?, &mut v)
                    .map_err(|e| self.err(format!("tensor `{gname}`: {e}")))?;
                Self::owned_f32(&gname, shape, &v)
            }
            Transform::Plain => {
                return Err(self.err(format!(
                    "tensor `{gname}` is {}, which strix cannot load (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K \
                     and Q5_0 are supported)",
                    info.ty
                )))
            }
            other => {
                if !is_float {
                    return Err(self.err(format!(
                        "tensor `{gname}` is {}; llama.cpp stores it as a float (F32)",
                        info.ty
                    )));
                }
                let mut v = self.file.tensor_f32(&gname)?;
                match other {
                    Transform::NormPlusOne => v.iter_mut().for_each(|x| *x -= 1.0),
                    Transform::NegExp => {
                        for (i, x) in v.iter_mut().enumerate() {
                            if !(x.is_finite() && *x < 0.0) {
                                return Err(self.err(format!(
                                    "tensor `{gname}` holds {x} at {i}: ssm_a = -exp(A_log) must be negative"
                                )));
                            }
                            *x = (-*x).ln();
                        }
                    }
                    _ => {}
                }
                Self::owned_f32(&gname, shape, &v)
            }
        };
        if shape.len() != 2 {
            crate::checkpoint::check_finite(&t).map_err(|m| self.err(m))?;
        }
        Ok(t)
    }
}

// ------------------------------------------------------------------------------------
// Writing

/// Which type each matrix of a GGUF being written is stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufTypes {
    /// Every matrix in one type (`llama-quantize --pure`, or the converter's float outtypes).
    Uniform(QuantType),
    /// llama-quantize's default mixture for a target, as `--quant` applies it on load
    /// ([`QuantizingSource`]): Q8_0, Q4_0 with a Q6_K output, or Q4_K_M.
    Scheme(QuantScheme),
}

impl GgufTypes {
    /// The type matrix `hf` (Hugging Face name, rows of `cols`) is stored as, with
    /// llama-quantize's fallback for rows that are not whole blocks ([`storage_type`]).
    pub fn choose(self, source: &QuantizingSource, hf: &str, cols: usize) -> QuantType {
        let want = match self {
            GgufTypes::Uniform(ty) => ty,
            // Asked with a row of one super-block, the scheme answers its preferred type: the
            // fallback is llama-quantize's (Q4_K → Q5_0), which quantize-on-load cannot take.
            GgufTypes::Scheme(_) => source.type_for(hf, crate::quant::QK_K).unwrap_or(QuantType::F16),
        };
        storage_type(want, cols)
    }

    /// llama.cpp's `llama_ftype` for `general.file_type`.
    fn file_type(self) -> u32 {
        match self {
            GgufTypes::Scheme(QuantScheme::Q8_0) | GgufTypes::Uniform(QuantType::Q8_0) => 7,
            GgufTypes::Scheme(QuantScheme::Q4_0) | GgufTypes::Uniform(QuantType::Q4_0) => 2,
            GgufTypes::Scheme(QuantScheme::Q4_K) => 15, // MOSTLY_Q4_K_M
            GgufTypes::Uniform(QuantType::Q4_K) => 14,  // MOSTLY_Q4_K_S
            GgufTypes::Uniform(QuantType::Q6_K) => 18,
            GgufTypes::Uniform(QuantType::F32) => 0,
            GgufTypes::Uniform(QuantType::F16) => 1,
            GgufTypes::Uniform(_) => 32, // MOSTLY_BF16
        }
    }
}

/// The type a matrix with rows of `row_len` weights is stored as when `target` is asked for:
/// `target` when the rows are whole blocks, else llama-quantize's fallback
/// (`tensor_type_fallback`: Q4_K → Q5_0, Q6_K → Q8_0, then F16 when that does not fit either).
pub fn storage_type(target: QuantType, row_len: usize) -> QuantType {
    if row_len.is_multiple_of(target.block_size()) {
        return target;
    }
    let fallback = match target {
        QuantType::Q4_K => QuantType::Q5_0,
        QuantType::Q6_K => QuantType::Q8_0,
        other => other,
    };
    if row_len.is_multiple_of(fallback.block_size()) {
        fallback
    } else {
        QuantType::F16
    }
}

/// Encodes `x` (a whole number of `ty`'s blocks) as `ty`, the same bytes as one pass over it.
pub fn encode(ty: QuantType, x: &[f32]) -> Result<Vec<u8>> {
    use rayon::prelude::*;
    let mut out = vec![0u8; ty.row_size(x.len())?];
    // Blocks are encoded independently, so pieces of whole blocks can be encoded on every
    // core with the same bytes as one pass (a 35B checkpoint is ~35 G weights).
    let blocks_per_piece = (1 << 16) / ty.block_size().max(1);
    let weights = blocks_per_piece * ty.block_size();
    let bytes = blocks_per_piece * ty.type_size();
    x.par_chunks(weights).zip(out.par_chunks_mut(bytes)).try_for_each(|(x, out)| {
        if q5_0::handles(ty) {
            q5_0::quantize_row_q5_0(x, out)
        } else {
            crate::quant::quantize_row(ty, x, out)
        }
    })?;
    Ok(out)
}

/// What [`write_gguf`] wrote: each tensor's GGUF name and type, in file order.
#[derive(Clone, Debug, Default)]
pub struct WriteReport {
    pub tensors: Vec<(String, QuantType)>,
}

/// Writes a Hugging Face Qwen3.5 checkpoint (`src` with `config`, value heads in transformers'
/// grouped order) as a llama.cpp `qwen35` GGUF at `out`: the converter's transforms (value
/// heads tiled, `ssm_a = −exp(A_log)`, `1 + w` norms, squeezed conv1d, its names) and each
/// matrix encoded as `types` says (with llama-quantize's fallbacks, [`storage_type`]), norms,
/// conv1d and 1-D tensors in f32 as llama.cpp keeps them. `metadata` is added after the model's own keys
/// (the tokenizer and chat template, see [`tokenizer_metadata`]).
pub fn write_gguf(
    config: &ModelConfig,
    src: &dyn TensorSource,
    types: GgufTypes,
    metadata: Vec<(String, super::GgufValue)>,
    name: &str,
    out: &Path,
    progress: Option<&dyn Fn(u64, u64)>,
) -> Result<WriteReport> {
    let c = config;
    if c.linear_value_head_order != ValueHeadOrder::Grouped {
        return Err(Error::input(
            "write_gguf takes a checkpoint in transformers' (grouped) value-head order",
        ));
    }
    let mut w = super::GgufWriter::new();
    let arch = if c.moe.is_some() { ARCH_MOE } else { ARCH };
    let k = |s: &str| format!("{arch}.{s}");
    let u = |v: usize| -> Result<u32> {
        u32::try_from(v).map_err(|_| Error::input(format!("{v} does not fit a GGUF u32 field")))
    };
    w.add_metadata("general.architecture", arch)?;
    w.add_metadata("general.type", "model")?;
    w.add_metadata("general.name", name)?;
    w.add_metadata(&k("block_count"), u(c.num_layers)?)?;
    w.add_metadata(&k("context_length"), u(c.max_position_embeddings)?)?;
    w.add_metadata(&k("embedding_length"), u(c.hidden_size)?)?;
    match &c.moe {
        // As the converter writes a MoE model: the experts' widths, no feed_forward_length.
        Some(moe) => {
            w.add_metadata(&k("expert_count"), u(moe.num_experts)?)?;
            w.add_metadata(&k("expert_used_count"), u(moe.num_experts_per_tok)?)?;
            w.add_metadata(&k("expert_feed_forward_length"), u(moe.moe_intermediate_size)?)?;
            w.add_metadata(&k("expert_shared_feed_forward_length"), u(moe.shared_expert_intermediate_size)?)?;
        }
        None => w.add_metadata(&k("feed_forward_length"), u(c.intermediate_size)?)?,
    }
    w.add_metadata(&k("attention.head_count"), u(c.num_heads)?)?;
    w.add_metadata(&k("attention.head_count_kv"), u(c.num_kv_heads)?)?;
    w.add_metadata(&k("rope.freq_base"), c.rope_theta as f32)?;
    w.add_metadata(&k("attention.layer_norm_rms_epsilon"), c.rms_norm_eps)?;
    w.add_metadata(&k("attention.key_length"), u(c.head_dim)?)?;
    w.add_metadata(&k("attention.value_length"), u(c.head_dim)?)?;
    w.add_metadata("general.file_type", types.file_type())?;
    w.add_metadata(&k("ssm.conv_kernel"), u(c.conv_kernel)?)?;
    w.add_metadata(&k("ssm.state_size"), u(c.linear_k_head_dim)?)?;
    w.add_metadata(&k("ssm.group_count"), u(c.linear_num_k_heads)?)?;
    w.add_metadata(&k("ssm.time_step_rank"), u(c.linear_num_v_heads)?)?;
    w.add_metadata(&k("ssm.inner_size"), u(c.linear_value_dim())?)?;
    let recurrent: Vec<bool> = c.layer_kinds.iter().map(|&l| l == LayerKind::DeltaNet).collect();
    w.add_metadata(&k("attention.recurrent_layers"), recurrent)?;
    let interval = c.layer_kinds.iter().position(|&l| l == LayerKind::Attention).map_or(4, |i| i + 1);
    w.add_metadata(&k("full_attention_interval"), u(interval)?)?;
    w.add_metadata(&k("rope.dimension_count"), u(c.rotary_dim)?)?;
    // Required by llama.cpp's loader; with text positions (all M-RoPE sections at the same
    // position) the sections do not change the rotation. The converter's default.
    w.add_metadata(&k("rope.dimension_sections"), vec![11i32, 11, 10, 0])?;
    w.add_metadata("general.quantization_version", 2u32)?;
    for (key, value) in metadata {
        w.add_metadata(&key, value)?;
    }

    let prefix = if src.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let (h, nk, nv) = (c.hidden_size, c.linear_num_k_heads, c.linear_num_v_heads);
    let per_k = nv / nk;
    let (vd, key_dim) = (c.linear_v_head_dim, c.linear_key_dim());
    let q_dim = c.num_heads * c.head_dim;
    let kv_dim = c.num_kv_heads * c.head_dim;

    // (HF name, shape) in the order the converter writes them; a MoE layer's routed experts
    // are one entry per projection, `mlp.experts.{proj}` of shape [experts, rows, cols], that
    // becomes the merged `ffn_{proj}_exps`.
    let mut wanted: Vec<(String, Vec<usize>)> = Vec::new();
    wanted.push(("model.embed_tokens.weight".into(), vec![c.vocab_size, h]));
    if !c.tie_word_embeddings {
        wanted.push(("lm_head.weight".into(), vec![c.vocab_size, h]));
    }
    for (l, kind) in c.layer_kinds.iter().enumerate() {
        let p = format!("model.layers.{l}.");
        let mut add = |s: &str, shape: Vec<usize>| wanted.push((format!("{p}{s}"), shape));
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        match kind {
            LayerKind::DeltaNet => {
                add("linear_attn.in_proj_qkv.weight", vec![c.conv_dim(), h]);
                add("linear_attn.in_proj_z.weight", vec![c.linear_value_dim(), h]);
                add("linear_attn.in_proj_b.weight", vec![nv, h]);
                add("linear_attn.in_proj_a.weight", vec![nv, h]);
                add("linear_attn.conv1d.weight", vec![c.conv_dim(), 1, c.conv_kernel]);
                add("linear_attn.A_log", vec![nv]);
                add("linear_attn.dt_bias", vec![nv]);
                add("linear_attn.norm.weight", vec![vd]);
                add("linear_attn.out_proj.weight", vec![h, c.linear_value_dim()]);
            }
            LayerKind::Attention => {
                add("self_attn.q_proj.weight", vec![2 * q_dim, h]);
                add("self_attn.k_proj.weight", vec![kv_dim, h]);
                add("self_attn.v_proj.weight", vec![kv_dim, h]);
                add("self_attn.o_proj.weight", vec![h, q_dim]);
                add("self_attn.q_norm.weight", vec![c.head_dim]);
                add("self_attn.k_norm.weight", vec![c.head_dim]);
            }
        }
        match &c.moe {
            None => {
                add("mlp.gate_proj.weight", vec![c.intermediate_size, h]);
                add("mlp.up_proj.weight", vec![c.intermediate_size, h]);
                add("mlp.down_proj.weight", vec![h, c.intermediate_size]);
            }
            Some(moe) => {
                let (e, i, s) =
                    (moe.num_experts, moe.moe_intermediate_size, moe.shared_expert_intermediate_size);
                add("mlp.experts.gate", vec![e, i, h]);
                add("mlp.experts.up", vec![e, i, h]);
                add("mlp.experts.down", vec![e, h, i]);
                add("mlp.gate.weight", vec![e, h]);
                add("mlp.shared_expert.gate_proj.weight", vec![s, h]);
                add("mlp.shared_expert.up_proj.weight", vec![s, h]);
                add("mlp.shared_expert.down_proj.weight", vec![h, s]);
                add("mlp.shared_expert_gate.weight", vec![1, h]);
            }
        }
    }
    wanted.push(("model.norm.weight".into(), vec![h]));

    let scheme = match types {
        GgufTypes::Scheme(s) => s,
        GgufTypes::Uniform(_) => QuantScheme::Q8_0,
    };
    let chooser = QuantizingSource::new(src, c, scheme);
    // Declare every tensor first (the header comes before the data), then stream the data.
    let mut plan = Vec::with_capacity(wanted.len());
    for (hf, shape) in &wanted {
        let (gname, transform) = match experts_of(hf) {
            Some((layer, proj)) => (format!("blk.{layer}.ffn_{proj}_exps.weight"), Transform::Plain),
            None => gguf_name(hf).expect("the table covers every tensor the model reads"),
        };
        let stored: Vec<usize> = match transform {
            Transform::Squeeze => vec![shape[0], shape[2]],
            _ => shape.clone(),
        };
        // A router's few rows decide which experts run: the converter and llama-quantize keep
        // them (and the shared expert's gate) in F32.
        let router = hf.ends_with("mlp.gate.weight") || hf.ends_with("mlp.shared_expert_gate.weight");
        let float_only = stored.len() == 1 || transform != Transform::Plain || router;
        // The merged experts take the type of their first expert's matrix (the schemes choose by
        // layer and projection, so every expert of a layer agrees).
        let chosen_as = match experts_of(hf) {
            Some((layer, proj)) => format!("model.layers.{layer}.mlp.experts.0.{proj}_proj.weight"),
            None => hf.clone(),
        };
        let ty = if float_only {
            QuantType::F32
        } else {
            types.choose(&chooser, &chosen_as, stored[stored.len() - 1])
        };
        let dims: Vec<u64> = stored.iter().rev().map(|&d| d as u64).collect();
        w.add_tensor_info(&gname, &dims, ty)?;
        plan.push((hf.clone(), shape.clone(), gname, transform, ty));
    }
    let total = plan.len() as u64;
    let mut report = WriteReport::default();
    w.write_with(out, |_, i| {
        let (hf, shape, gname, transform, ty) = &plan[i];
        let src_name = match hf.strip_prefix("model.") {
            Some(rest) => format!("{prefix}{rest}"),
            None => hf.clone(),
        };
        if let Some((layer, proj)) = experts_of(hf) {
            // Each expert's rows in expert order: GGML blocks never cross a row, so the
            // encodings of the experts one after another are the merged tensor's.
            let mut bytes = Vec::new();
            for e in 0..shape[0] {
                let name = format!("{prefix}layers.{layer}.mlp.experts.{e}.{proj}_proj.weight");
                let x = src.tensor(&name, &shape[1..])?.to_f32_vec();
                bytes.extend(encode(*ty, &x).map_err(|e| Error::input(format!("tensor `{gname}`: {e}")))?);
            }
            report.tensors.push((gname.clone(), *ty));
            if let Some(p) = progress {
                p(i as u64 + 1, total);
            }
            return Ok(bytes);
        }
        let mut x = src.tensor(&src_name, shape)?.to_f32_vec();
        let is = |s: &str| hf.ends_with(s);
        if per_k > 1 {
            if is("in_proj_qkv.weight") {
                let v = retile_rows(&x[2 * key_dim * h..], nk, per_k, vd, h);
                x.truncate(2 * key_dim * h);
                x.extend(v);
            } else if is("in_proj_z.weight") {
                x = retile_rows(&x, nk, per_k, vd, h);
            } else if is("in_proj_a.weight") || is("in_proj_b.weight") {
                x = retile_rows(&x, nk, per_k, 1, h);
            } else if is("A_log") || is("dt_bias") {
                x = retile_rows(&x, nk, per_k, 1, 1);
            } else if is("conv1d.weight") {
                let at = 2 * key_dim * c.conv_kernel;
                let v = retile_rows(&x[at..], nk, per_k, vd, c.conv_kernel);
                x.truncate(at);
                x.extend(v);
            } else if is("out_proj.weight") {
                x = retile_cols(&x, h, nk, per_k, vd);
            }
        }
        match transform {
            Transform::NormPlusOne => x.iter_mut().for_each(|v| *v += 1.0),
            Transform::NegExp => x.iter_mut().for_each(|v| *v = -v.exp()),
            Transform::Plain | Transform::Squeeze => {}
        }
        report.tensors.push((gname.clone(), *ty));
        if let Some(p) = progress {
            p(i as u64 + 1, total);
        }
        encode(*ty, &x).map_err(|e| Error::input(format!("tensor `{gname}`: {e}")))
    })?;
    Ok(report)
}

/// The `tokenizer.*` metadata llama.cpp's converter writes for a Qwen tokenizer, from a
/// model directory's `tokenizer.json` and `tokenizer_config.json` (the vocabulary padded to
/// the embedding's `vocab_size` with `[PAD{id}]` tokens typed UNUSED, as the converter does)
/// plus the chat template when there is one. Errors name the file.
pub fn tokenizer_metadata(dir: &Path, vocab_size: usize) -> Result<Vec<(String, super::GgufValue)>> {
    use super::{GgufArray, GgufValue};
    use serde_json::Value;
    let path = dir.join("tokenizer.json");
    let text = crate::files::read_text(&path, crate::files::TOKENIZER_CAP)?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    let bad = |m: String| Error::Tokenizer(format!("{}: {m}", path.display()));
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(bad("only BPE tokenizers can be written to a qwen35 GGUF".into()));
    }
    let pattern = json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].as_str().unwrap_or("");
    let pre = crate::tokenizer::gguf_pre_tokenizer_name(pattern)
        .ok_or_else(|| bad("its pre-tokenizer is neither Qwen3.5's nor Qwen2's split".into()))?;
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![5i32; vocab_size];
    let mut place = |id: u64, tok: &str, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            bad(format!("token `{}` has id {id}, past the model's vocab_size {vocab_size}", printable(tok)))
        })?;
        *slot = Some(tok.to_string());
        types[id as usize] = ty;
        Ok(())
    };
    for (tok, id) in model["vocab"].as_object().ok_or_else(|| bad("model.vocab is not an object".into()))? {
        let id = id.as_u64().ok_or_else(|| bad(format!("model.vocab[`{}`] is not an id", printable(tok))))?;
        place(id, tok, 1)?;
    }
    for t in json["added_tokens"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
            return Err(bad(format!("added token {} has no id or content", printable(&t.to_string()))));
        };
        place(id, content, if t["special"] == true { 3 } else { 4 })?;
    }
    let tokens: Vec<String> =
        tokens.into_iter().enumerate().map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]"))).collect();
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| bad("model.merges is not a list".into()))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Ok(s.clone()),
            Value::Array(p) if p.len() == 2 => {
                Ok(format!("{} {}", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")))
            }
            other => {
                Err(bad(format!("merge {} is neither \"a b\" nor [a, b]", printable(&other.to_string()))))
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let id_of = |tok: &str| tokens.iter().position(|t| t == tok).map(|i| i as u32);

    let mut out: Vec<(String, GgufValue)> = vec![
        ("tokenizer.ggml.model".into(), "gpt2".into()),
        ("tokenizer.ggml.pre".into(), pre.into()),
        ("tokenizer.ggml.tokens".into(), GgufValue::Array(GgufArray::String(tokens.clone()))),
        ("tokenizer.ggml.token_type".into(), GgufValue::Array(GgufArray::I32(types))),
        ("tokenizer.ggml.merges".into(), GgufValue::Array(GgufArray::String(merges))),
    ];
    let cfg_path = dir.join("tokenizer_config.json");
    if cfg_path.symlink_metadata().is_ok() {
        let text = crate::files::read_text(&cfg_path, crate::files::JSON_CAP)?;
        let cfg: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", cfg_path.display())))?;
        for (field, key) in [
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        ] {
            let tok = match &cfg[field] {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => o.get("content").and_then(Value::as_str),
                _ => None,
            };
            if let Some(id) = tok.and_then(id_of) {
                out.push((key.into(), id.into()));
            }
        }
        let flag = |f: &str| cfg[f].as_bool().unwrap_or(false);
        out.push(("tokenizer.ggml.add_bos_token".into(), flag("add_bos_token").into()));
        out.push(("tokenizer.ggml.add_eos_token".into(), flag("add_eos_token").into()));
    }
    if let Some(t) = crate::chat::ChatTemplate::from_model_dir(dir)? {
        out.push(("tokenizer.chat_template".into(), t.source().into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_kinds_of_layer_and_the_globals() {
        assert_eq!(
            gguf_name("model.layers.12.linear_attn.in_proj_qkv.weight"),
            Some(("blk.12.attn_qkv.weight".into(), Transform::Plain))
        );
        assert_eq!(
            gguf_name("model.layers.0.linear_attn.A_log"),
            Some(("blk.0.ssm_a".into(), Transform::NegExp))
        );
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_norm.weight"),
            Some(("blk.3.attn_q_norm.weight".into(), Transform::NormPlusOne))
        );
        assert_eq!(
            gguf_name("model.norm.weight"),
            Some(("output_norm.weight".into(), Transform::NormPlusOne))
        );
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(gguf_name("model.layers.1.mlp.experts"), None);
        assert_eq!(gguf_name("model.language_model.embed_tokens.weight"), None);
    }

    #[test]
    fn retiling_is_the_converters_permutation() {
        // 2 key heads, 3 value heads per key head: grouped [g0r0 g0r1 g0r2 g1r0 g1r1 g1r2]
        // becomes tiled [g0r0 g1r0 g0r1 g1r1 g0r2 g1r2].
        let v: Vec<u32> = (0..6).collect();
        assert_eq!(retile_rows(&v, 2, 3, 1, 1), vec![0, 3, 1, 4, 2, 5]);
        // Heads of 2 rows of 1 value.
        let v: Vec<u32> = (0..8).collect();
        assert_eq!(retile_rows(&v, 2, 2, 2, 1), vec![0, 1, 4, 5, 2, 3, 6, 7]);
        // Columns: each row permuted alike.
        let m: Vec<u32> = (0..8).collect();
        assert_eq!(retile_cols(&m, 2, 2, 2, 1), vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }
}
