//! The model's shape, read from a Hugging Face `config.json` (and `generation_config.json`).
//!
//! Two layouts exist for each kind of model: `model_type: qwen3_5` / `qwen3_5_moe` (the published
//! multimodal checkpoints, text fields under `text_config`) and `qwen3_5_text` /
//! `qwen3_5_moe_text` (flat). The mixture-of-experts models replace every layer's MLP with a
//! sparse MoE block ([`MoeConfig`]). Every field the forward pass
//! depends on is validated here, so the model code can trust the numbers, and a field that
//! asks for something the model does not implement (`hidden_act: gelu`, scaled RoPE, biases)
//! is refused rather than ignored. Files are read through [`crate::files`] (regular files
//! under the JSON cap).

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{printable, Error, Result};
use crate::files;

/// How a Gated DeltaNet's value heads map onto its key heads when there are more of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ValueHeadOrder {
    /// `transformers`' order: value head `h` reads key head `h / (num_v_heads / num_k_heads)`
    /// (each key head's value heads in one consecutive run).
    #[default]
    Grouped,
    /// llama.cpp's GGUF order: value head `h` reads key head `h % num_k_heads` (its converter
    /// permutes the value heads so that `ggml_repeat` of the key heads lines up).
    Tiled,
}

/// Per-layer shapes of a Gated DeltaNet mixer.
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetShape {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
    pub eps: f32,
    pub value_head_order: ValueHeadOrder,
}

impl DeltaNetShape {
    /// The key head value head `h` reads: `(h / key_head_divisor()) % num_k_heads`.
    pub fn key_head(&self, h: usize) -> usize {
        (h / self.key_head_divisor()) % self.num_k_heads
    }
    /// The divisor in [`DeltaNetShape::key_head`]: value heads per key head when grouped, 1 when tiled.
    pub fn key_head_divisor(&self) -> usize {
        match self.value_head_order {
            ValueHeadOrder::Grouped => (self.num_v_heads / self.num_k_heads).max(1),
            ValueHeadOrder::Tiled => 1,
        }
    }
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }
    /// Channels of the causal convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of recurrent state: one `k_head_dim x v_head_dim` matrix per value head.
    pub fn state_len(&self) -> usize {
        self.num_v_heads * self.k_head_dim * self.v_head_dim
    }
    /// Floats of convolution state: the last `conv_kernel - 1` inputs of every channel.
    pub fn conv_state_len(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1)
    }
}

/// Per-layer shapes of a gated attention mixer.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub eps: f32,
}

impl AttentionShape {
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// The Gated DeltaNet mixers' shape in `c`.
pub fn deltanet_shape(c: &ModelConfig) -> DeltaNetShape {
    DeltaNetShape {
        num_k_heads: c.linear_num_k_heads,
        num_v_heads: c.linear_num_v_heads,
        k_head_dim: c.linear_k_head_dim,
        v_head_dim: c.linear_v_head_dim,
        conv_kernel: c.conv_kernel,
        eps: c.rms_norm_eps,
        value_head_order: c.linear_value_head_order,
    }
}

/// The attention mixers' shape in `c`.
pub fn attention_shape(c: &ModelConfig) -> AttentionShape {
    AttentionShape {
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        rotary_dim: c.rotary_dim,
        eps: c.rms_norm_eps,
    }
}

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet: linear attention with a fixed-size recurrent state.
    DeltaNet,
    /// Gated full attention (GQA, partial RoPE, per-head q/k norm, output gate).
    Attention,
}

/// The sparse mixture-of-experts MLP of every layer of a `qwen3_5_moe` model
/// (`Qwen3_5MoeSparseMoeBlock`): a router picks `num_experts_per_tok` of `num_experts` SwiGLU
/// experts per token, and a shared expert scaled by its own sigmoid gate is added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// Width of each routed expert's SwiGLU MLP.
    pub moe_intermediate_size: usize,
    /// Width of the shared expert's SwiGLU MLP.
    pub shared_expert_intermediate_size: usize,
}

/// Shape and hyper-parameters of a Qwen3.5 text decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense MLP; 0 for a mixture-of-experts model, whose MLPs are [`MoeConfig`]'s.
    pub intermediate_size: usize,
    /// `Some` for a mixture-of-experts model (`qwen3_5_moe`): every layer's MLP is a sparse MoE
    /// block instead of a dense one.
    pub moe: Option<MoeConfig>,
    pub num_layers: usize,
    pub layer_kinds: Vec<LayerKind>,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,

    // Gated attention layers.
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    /// Number of leading dimensions of each head that are rotated (`partial_rotary_factor * head_dim`).
    pub rotary_dim: usize,

    // Gated DeltaNet layers.
    pub conv_kernel: usize,
    pub linear_num_k_heads: usize,
    pub linear_num_v_heads: usize,
    pub linear_k_head_dim: usize,
    pub linear_v_head_dim: usize,
    /// How value heads map onto key heads: `Grouped` for Hugging Face checkpoints, `Tiled` for
    /// GGUF files written by llama.cpp's converter.
    pub linear_value_head_order: ValueHeadOrder,

    /// Token ids that end generation (config and generation_config, deduplicated).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `config.json` (and `generation_config.json` when present) from a model directory.
    /// A path that is not a directory, or a directory without `config.json`, is an
    /// [`Error::NotAModel`] naming it.
    pub fn from_model_dir(dir: &Path) -> Result<ModelConfig> {
        check_model_dir(dir)?;
        let path = dir.join("config.json");
        let text = files::read_text(&path, files::JSON_CAP)?;
        let mut config = ModelConfig::from_json_str(&text, &path)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.symlink_metadata().is_ok() {
            let value = files::read_json(&gen_path)?;
            if let Some(eos) = value.get("eos_token_id") {
                for id in token_ids(eos, "eos_token_id", &gen_path)? {
                    if !config.eos_token_ids.contains(&id) {
                        config.eos_token_ids.push(id);
                    }
                }
            }
        }
        Ok(config)
    }

    /// Parses the text of a `config.json`; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<ModelConfig> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| Error::config(path, format!("invalid JSON: {e}")))?;
        let root =
            root.as_object().ok_or_else(|| Error::config(path, "expected a JSON object at the top level"))?;
        let model_type = match root.get("model_type") {
            None | Some(Value::Null) => "",
            Some(Value::String(s)) => s.as_str(),
            Some(v) => {
                return Err(Error::config(
                    path,
                    format!("field `model_type` must be a string, got {}", json_shown(v)),
                ))
            }
        };
        let fields = Fields { path, obj: root, scope: String::new() };
        let (text, moe) = match model_type {
            "qwen3_5" | "qwen3_5_moe" => {
                let obj = root.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                    Error::config(path, format!("model_type `{model_type}` needs a `text_config` object"))
                })?;
                (Fields { path, obj, scope: "text_config.".into() }, model_type == "qwen3_5_moe")
            }
            "qwen3_5_text" => (Fields { path, obj: root, scope: String::new() }, false),
            "qwen3_5_moe_text" => (Fields { path, obj: root, scope: String::new() }, true),
            "" => return Err(Error::config(path, "missing field `model_type`")),
            other => {
                return Err(Error::config(
                    path,
                    format!(
                        "unknown model_type `{}`: strix runs Qwen3.5 (`qwen3_5`, `qwen3_5_text`, \
                         `qwen3_5_moe`, `qwen3_5_moe_text`)",
                        printable(other)
                    ),
                ))
            }
        };
        let c = parse_text_config(&text, &fields, moe)?;
        c.validate(path)?;
        Ok(c)
    }

    /// Key/value channels of one GDN layer's q (or k) projection.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_k_heads * self.linear_k_head_dim
    }

    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_v_heads * self.linear_v_head_dim
    }

    /// Channels that pass through the causal convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    pub(crate) fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, m));
        // A dense model's MLP width, or a MoE model's expert counts and widths.
        let mlp_fields: Vec<(&str, usize)> = match &self.moe {
            None => vec![("intermediate_size", self.intermediate_size)],
            Some(m) => vec![
                ("num_experts", m.num_experts),
                ("num_experts_per_tok", m.num_experts_per_tok),
                ("moe_intermediate_size", m.moe_intermediate_size),
                ("shared_expert_intermediate_size", m.shared_expert_intermediate_size),
            ],
        };
        for (name, v) in mlp_fields.into_iter().chain([
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
            ("linear_num_key_heads", self.linear_num_k_heads),
            ("linear_num_value_heads", self.linear_num_v_heads),
            ("linear_key_head_dim", self.linear_k_head_dim),
            ("linear_value_head_dim", self.linear_v_head_dim),
        ]) {
            if v == 0 {
                return bad(format!("`{name}` must be positive"));
            }
        }
        // Weight shapes are products of these numbers: products that overflow are refused here,
        // so the model code need not check its arithmetic.
        let product = |parts: &[usize]| parts.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        let conv_dim = product(&[2, self.linear_num_k_heads, self.linear_k_head_dim])
            .zip(product(&[self.linear_num_v_heads, self.linear_v_head_dim]))
            .and_then(|(k, v)| k.checked_add(v));
        for (names, size) in [
            ("vocab_size * hidden_size", product(&[self.vocab_size, self.hidden_size])),
            ("intermediate_size * hidden_size", product(&[self.intermediate_size, self.hidden_size])),
            (
                "num_experts * moe_intermediate_size * hidden_size",
                self.moe.map_or(Some(0), |m| {
                    product(&[3, m.num_experts, m.moe_intermediate_size, self.hidden_size])
                }),
            ),
            (
                "shared_expert_intermediate_size * hidden_size",
                self.moe.map_or(Some(0), |m| product(&[m.shared_expert_intermediate_size, self.hidden_size])),
            ),
            (
                "num_attention_heads * head_dim * hidden_size",
                product(&[2, self.num_heads, self.head_dim, self.hidden_size]),
            ),
            (
                "num_key_value_heads * head_dim * hidden_size",
                product(&[self.num_kv_heads, self.head_dim, self.hidden_size]),
            ),
            (
                "linear_num_{key,value}_heads * linear_{key,value}_head_dim * hidden_size",
                conv_dim.and_then(|c| product(&[c, self.hidden_size])),
            ),
            (
                "linear_num_{key,value}_heads * linear_{key,value}_head_dim * linear_conv_kernel_dim",
                conv_dim.and_then(|c| product(&[c, self.conv_kernel])),
            ),
        ] {
            if size.is_none() {
                return bad(format!("sizes too large: {names} overflows"));
            }
        }
        if let Some(m) = &self.moe {
            if m.num_experts_per_tok > m.num_experts {
                return bad(format!(
                    "num_experts_per_tok ({}) is more than num_experts ({})",
                    m.num_experts_per_tok, m.num_experts
                ));
            }
            // Expert ids travel as u32 (and the router's logits as one row per token).
            if m.num_experts > MAX_EXPERTS {
                return bad(format!(
                    "num_experts is {}: more than {MAX_EXPERTS} is not a real model",
                    m.num_experts
                ));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "inconsistent head counts: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.linear_num_v_heads.is_multiple_of(self.linear_num_k_heads) {
            return bad(format!(
                "inconsistent head counts: linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                self.linear_num_v_heads, self.linear_num_k_heads
            ));
        }
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return bad(format!(
                "partial_rotary_factor (rope.dimension_count in GGUF) gives a rotary dimension of {} for \
                 head_dim {}: it must be even, positive and at most head_dim",
                self.rotary_dim, self.head_dim
            ));
        }
        if self.layer_kinds.len() != self.num_layers {
            return bad(format!(
                "`layer_types` has {} entries but num_hidden_layers is {}",
                self.layer_kinds.len(),
                self.num_layers
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad("`rms_norm_eps` must be a positive number".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad("`rope_theta` must be a positive number".into());
        }
        Ok(())
    }
}

/// A JSON object together with the file it came from, for error messages.
struct Fields<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
    /// Where `obj` sits in the file (`text_config.`), so messages name the field as written.
    scope: String,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.obj.get(name).filter(|v| !v.is_null())
    }

    fn usize(&self, name: &str) -> Result<usize> {
        match self.get(name) {
            Some(v) => v.as_u64().map(|v| v as usize).ok_or_else(|| {
                Error::config(
                    self.path,
                    format!(
                        "field `{}{name}` must be a non-negative integer, got {}",
                        self.scope,
                        json_shown(v)
                    ),
                )
            }),
            None => Err(Error::config(self.path, format!("missing field `{}{name}`", self.scope))),
        }
    }

    fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        if self.get(name).is_some() {
            self.usize(name)
        } else {
            Ok(default)
        }
    }

    fn f64_opt(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                Error::config(
                    self.path,
                    format!("field `{}{name}` must be a number, got {}", self.scope, json_shown(v)),
                )
            }),
            None => Ok(None),
        }
    }

    fn bool_opt(&self, name: &str) -> Result<Option<bool>> {
        match self.get(name) {
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                Error::config(
                    self.path,
                    format!("field `{}{name}` must be true or false, got {}", self.scope, json_shown(v)),
                )
            }),
            None => Ok(None),
        }
    }

    fn str_opt(&self, name: &str) -> Result<Option<&str>> {
        match self.get(name) {
            Some(v) => v.as_str().map(Some).ok_or_else(|| {
                Error::config(
                    self.path,
                    format!("field `{}{name}` must be a string, got {}", self.scope, json_shown(v)),
                )
            }),
            None => Ok(None),
        }
    }

    /// An optional object field, as the fields of its own scope.
    fn object_opt(&self, name: &str) -> Result<Option<Fields<'_>>> {
        match self.get(name) {
            Some(Value::Object(obj)) => {
                Ok(Some(Fields { path: self.path, obj, scope: format!("{}{name}.", self.scope) }))
            }
            Some(v) => Err(Error::config(
                self.path,
                format!("field `{}{name}` must be an object, got {}", self.scope, json_shown(v)),
            )),
            None => Ok(None),
        }
    }
}

/// A JSON value from a file as a message quotes it: its JSON text (control characters are
/// escaped by JSON already), capped in length.
fn json_shown(v: &Value) -> String {
    printable(&v.to_string())
}

/// Refuses a path that is not a model directory: not a directory at all, or one without
/// `config.json` (so the user hears that first, not about a missing tokenizer or weights).
pub fn check_model_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
    if !meta.is_dir() {
        // A FIFO or a device is said to be one (and never opened).
        files::regular_file_metadata(dir)?;
        return Err(Error::not_a_model(
            dir,
            "not a model directory (a model is a directory with config.json and *.safetensors \
             weights, or a .gguf file)",
        ));
    }
    let config = dir.join("config.json");
    match config.symlink_metadata() {
        Ok(_) => files::regular_file_metadata(&config).map(|_| ()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::not_a_model(
            dir,
            "not a model directory: it has no config.json (a model directory holds config.json, \
             the *.safetensors weights and tokenizer.json)",
        )),
        Err(e) => Err(Error::io(config, e)),
    }
}

/// The activations `hidden_act` may name: Qwen3.5's MLP is SwiGLU, `silu` (transformers'
/// `swish` is the same function).
const SUPPORTED_ACTIVATIONS: [&str; 2] = ["silu", "swish"];

/// A bound on `num_hidden_layers`, checked before anything is allocated per layer.
const MAX_LAYERS: usize = 1 << 16;

/// A bound on `num_experts`, checked before anything is allocated per expert.
const MAX_EXPERTS: usize = 1 << 16;

/// The MoE block's fields of a `qwen3_5_moe` text config. `Qwen3_5MoeTextConfig` has no
/// `norm_topk_prob`, `decoder_sparse_step` or `mlp_only_layers` (the reference always
/// renormalises the top-k weights and every layer is sparse), so none is read here: a config
/// carrying them runs as the reference runs it, ignoring them.
fn parse_moe(t: &Fields) -> Result<MoeConfig> {
    Ok(MoeConfig {
        num_experts: t.usize("num_experts")?,
        num_experts_per_tok: t.usize("num_experts_per_tok")?,
        moe_intermediate_size: t.usize("moe_intermediate_size")?,
        shared_expert_intermediate_size: t.usize("shared_expert_intermediate_size")?,
    })
}

fn parse_text_config(t: &Fields, root: &Fields, moe: bool) -> Result<ModelConfig> {
    let path = t.path;
    let hidden_size = t.usize("hidden_size")?;
    let num_heads = t.usize("num_attention_heads")?;
    let num_layers = t.usize("num_hidden_layers")?;
    if num_layers > MAX_LAYERS {
        return Err(Error::config(
            path,
            format!("`num_hidden_layers` is {num_layers}: more than {MAX_LAYERS} layers is not a real model"),
        ));
    }
    let head_dim = match t.get("head_dim") {
        Some(_) => t.usize("head_dim")?,
        None if num_heads > 0 => hidden_size / num_heads,
        None => 0,
    };

    // What the forward pass implements, and nothing else: a field asking for another
    // activation, biased projections or scaled RoPE is refused, not ignored.
    if let Some(act) = t.str_opt("hidden_act")? {
        if !SUPPORTED_ACTIVATIONS.contains(&act) {
            return Err(Error::config(
                path,
                format!(
                    "`{}hidden_act` is `{}`: the Qwen3.5 MLP strix implements uses `silu`",
                    t.scope,
                    printable(act)
                ),
            ));
        }
    }
    if t.bool_opt("attention_bias")? == Some(true) {
        return Err(Error::config(
            path,
            format!(
                "`{}attention_bias` is true: attention projections with biases are not implemented",
                t.scope
            ),
        ));
    }
    if t.bool_opt("attn_output_gate")? == Some(false) {
        return Err(Error::config(
            path,
            format!("`{}attn_output_gate` is false: Qwen3.5's attention always has its output gate", t.scope),
        ));
    }
    if let Some(scaling) = t.object_opt("rope_scaling")? {
        let kind = match scaling.str_opt("rope_type")? {
            Some(k) => Some(k),
            None => scaling.str_opt("type")?,
        };
        if kind != Some("default") {
            return Err(Error::config(
                path,
                format!(
                    "`{}rope_scaling` asks for {} RoPE scaling: only unscaled RoPE is supported",
                    t.scope,
                    kind.map_or("unnamed".to_string(), |k| format!("`{}`", printable(k)))
                ),
            ));
        }
    }

    // rope_parameters is the current form; older configs keep rope_theta and
    // partial_rotary_factor at the top level of the text config.
    let rope_fields = t.object_opt("rope_parameters")?;
    let from_rope = |name: &str| -> Result<Option<f64>> {
        match &rope_fields {
            Some(r) => r.f64_opt(name),
            None => Ok(None),
        }
    };
    if let Some(kind) = rope_fields.as_ref().map(|r| r.str_opt("rope_type")).transpose()?.flatten() {
        if kind != "default" {
            return Err(Error::config(
                path,
                format!(
                    "{}rope_parameters.rope_type `{}` is not supported (only `default`)",
                    t.scope,
                    printable(kind)
                ),
            ));
        }
    }
    let rope_theta = match from_rope("rope_theta")? {
        Some(v) => v,
        None => t.f64_opt("rope_theta")?.unwrap_or(10_000.0),
    };
    let partial = match from_rope("partial_rotary_factor")? {
        Some(v) => v,
        None => t.f64_opt("partial_rotary_factor")?.unwrap_or(0.25),
    };
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(Error::config(path, format!("partial_rotary_factor must be in (0, 1], got {partial}")));
    }
    let rotary_dim = (head_dim as f64 * partial) as usize;

    let layer_kinds = match t.get("layer_types") {
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("linear_attention") => Ok(LayerKind::DeltaNet),
                Some("full_attention") => Ok(LayerKind::Attention),
                _ => Err(Error::config(
                    path,
                    format!(
                        "layer_types[{i}] is {}: expected \"linear_attention\" or \"full_attention\"",
                        json_shown(v)
                    ),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(other) => {
            return Err(Error::config(
                path,
                format!("field `layer_types` must be a list, got {}", json_shown(other)),
            ))
        }
        None => {
            let interval = t.usize_or("full_attention_interval", 4)?;
            if interval == 0 {
                return Err(Error::config(path, "`full_attention_interval` must be positive"));
            }
            (0..num_layers)
                .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
                .collect()
        }
    };

    // For the multimodal layout the top-level flag governs the lm_head tie (it belongs to
    // the top-level model class); the text config's copy is the fallback.
    let tie = match root.bool_opt("tie_word_embeddings")? {
        Some(v) => v,
        None => t.bool_opt("tie_word_embeddings")?.unwrap_or(false),
    };

    let mut eos_token_ids = Vec::new();
    for fields in [t, root] {
        if let Some(v) = fields.get("eos_token_id") {
            for id in token_ids(v, "eos_token_id", path)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
    }

    let eps = t.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    let (intermediate_size, moe) =
        if moe { (0, Some(parse_moe(t)?)) } else { (t.usize("intermediate_size")?, None) };
    Ok(ModelConfig {
        vocab_size: t.usize("vocab_size")?,
        hidden_size,
        intermediate_size,
        moe,
        num_layers,
        layer_kinds,
        rms_norm_eps: eps as f32,
        tie_word_embeddings: tie,
        max_position_embeddings: t.usize_or("max_position_embeddings", 32768)?,
        num_heads,
        num_kv_heads: t.usize("num_key_value_heads")?,
        head_dim,
        rope_theta,
        rotary_dim,
        conv_kernel: t.usize_or("linear_conv_kernel_dim", 4)?,
        linear_num_k_heads: t.usize("linear_num_key_heads")?,
        linear_num_v_heads: t.usize("linear_num_value_heads")?,
        linear_k_head_dim: t.usize("linear_key_head_dim")?,
        linear_v_head_dim: t.usize("linear_value_head_dim")?,
        linear_value_head_order: ValueHeadOrder::Grouped,
        eos_token_ids,
    })
}

fn token_ids(v: &Value, field: &str, path: &Path) -> Result<Vec<u32>> {
    let one = |v: &Value| {
        v.as_u64().filter(|&id| id <= u32::MAX as u64).map(|id| id as u32).ok_or_else(|| {
            Error::config(
                path,
                format!("`{field}` must be a token id or a list of them, got {}", json_shown(v)),
            )
        })
    };
    match v {
        Value::Null => Ok(vec![]),
        Value::Array(items) => items.iter().map(one).collect(),
        other => Ok(vec![one(other)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3_5_text",
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 24,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "eos_token_id": 7
        })
    }

    fn parse(v: &serde_json::Value) -> Result<ModelConfig> {
        ModelConfig::from_json_str(&v.to_string(), Path::new("config.json"))
    }

    #[test]
    fn flat_config_with_interval_fallback() {
        let c = parse(&flat()).unwrap();
        assert_eq!(c.rotary_dim, 8);
        assert_eq!(c.rope_theta, 1e7);
        use LayerKind::*;
        assert_eq!(c.layer_kinds, vec![DeltaNet, DeltaNet, DeltaNet, Attention]);
        assert_eq!(c.eos_token_ids, vec![7]);
        assert_eq!(c.conv_dim(), 2 * 32 + 96);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn nested_config_and_top_level_tie() {
        let v =
            serde_json::json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": flat()});
        let c = parse(&v).unwrap();
        assert!(c.tie_word_embeddings);
    }

    #[test]
    fn explicit_layer_types() {
        let mut v = flat();
        v["layer_types"] =
            serde_json::json!(["full_attention", "linear_attention", "full_attention", "linear_attention"]);
        let c = parse(&v).unwrap();
        assert_eq!(c.layer_kinds[0], LayerKind::Attention);
        v["layer_types"] = serde_json::json!(["full_attention"]);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("layer_types") && e.contains("num_hidden_layers"), "{e}");
        v["layer_types"] = serde_json::json!(["full_attention", "mamba", "x", "y"]);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("layer_types[1]"), "{e}");
    }

    fn moe() -> serde_json::Value {
        let mut v = flat();
        let o = v.as_object_mut().unwrap();
        o.remove("intermediate_size");
        o.insert("model_type".into(), "qwen3_5_moe_text".into());
        for (k, n) in [
            ("num_experts", 8),
            ("num_experts_per_tok", 2),
            ("moe_intermediate_size", 16),
            ("shared_expert_intermediate_size", 24),
        ] {
            o.insert(k.into(), n.into());
        }
        v
    }

    #[test]
    fn moe_configs_flat_and_nested() {
        let c = parse(&moe()).unwrap();
        let want = MoeConfig {
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_intermediate_size: 16,
            shared_expert_intermediate_size: 24,
        };
        assert_eq!(c.moe, Some(want));
        assert_eq!(c.intermediate_size, 0, "a MoE model has no dense MLP");
        let mut text = moe();
        text["norm_topk_prob"] = false.into(); // not a field of the reference: ignored as it ignores it
        let v = serde_json::json!({"model_type": "qwen3_5_moe", "tie_word_embeddings": true, "text_config": text});
        let c = parse(&v).unwrap();
        assert_eq!(c.moe, Some(want));
        assert!(c.tie_word_embeddings);
        // The dense layouts stay dense.
        assert_eq!(parse(&flat()).unwrap().moe, None);
    }

    #[test]
    fn moe_errors_name_the_field() {
        for field in
            ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
        {
            let mut v = moe();
            v.as_object_mut().unwrap().remove(field);
            let e = parse(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("missing field `{field}`")), "{e}");
            let mut v = moe();
            v[field] = 0.into();
            let e = parse(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}` must be positive")), "{e}");
        }
        let mut v = moe();
        v["num_experts_per_tok"] = 9.into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok (9) is more than num_experts (8)"), "{e}");
        let mut v = moe();
        v["num_experts"] = (1u64 << 40).into();
        v["num_experts_per_tok"] = 1.into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("num_experts"), "{e}");
        let mut v = moe();
        v["moe_intermediate_size"] = (1u64 << 62).into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
        let v = serde_json::json!({"model_type": "qwen3_5_moe", "text_config": 3});
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("model_type `qwen3_5_moe` needs a `text_config` object"), "{e}");
        let mut v = moe();
        v["num_experts"] = "many".into();
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("field `num_experts` must be a non-negative integer"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = flat();
        v["model_type"] = "llama".into();
        assert!(parse(&v).unwrap_err().to_string().contains("unknown model_type `llama`"));
        let mut v = flat();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(parse(&v).unwrap_err().to_string().contains("missing field `hidden_size`"));
        let mut v = flat();
        v["num_key_value_heads"] = 3.into();
        assert!(parse(&v).unwrap_err().to_string().contains("inconsistent head counts"));
        let mut v = flat();
        v["linear_num_value_heads"] = 3.into();
        assert!(parse(&v).unwrap_err().to_string().contains("linear_num_value_heads"));
        let mut v = flat();
        v["hidden_size"] = "big".into();
        assert!(parse(&v).unwrap_err().to_string().contains("`hidden_size` must be"));
        let e = ModelConfig::from_json_str("{not json", Path::new("x/config.json")).unwrap_err();
        assert!(e.to_string().starts_with("x/config.json: invalid JSON"), "{e}");
        let v = serde_json::json!({"model_type": "qwen3_5"});
        assert!(parse(&v).unwrap_err().to_string().contains("text_config"));
    }
}
