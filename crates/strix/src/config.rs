//! The model's shape, read from a Hugging Face `config.json` (and `generation_config.json`).
//!
//! Two layouts exist: `model_type: qwen3_5` (the published multimodal checkpoints, text fields
//! under `text_config`) and `model_type: qwen3_5_text` (flat). Every field the forward pass
//! depends on is validated here, so the model code can trust the numbers.

use std::path::Path;

use serde_json::{Map, Value};

use crate::backend::ValueHeadOrder;
use crate::error::{Error, Result};

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet: linear attention with a fixed-size recurrent state.
    DeltaNet,
    /// Gated full attention (GQA, partial RoPE, per-head q/k norm, output gate).
    Attention,
}

/// Shape and hyper-parameters of a Qwen3.5 text decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
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
    pub fn from_model_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let mut config = ModelConfig::from_json_str(&text, &path)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|e| Error::io(&gen_path, e))?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| Error::config(&gen_path, format!("invalid JSON: {e}")))?;
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
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        let fields = Fields { path, obj: root, scope: String::new() };
        let text = match model_type {
            "qwen3_5" => {
                let obj = root.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                    Error::config(path, "model_type `qwen3_5` needs a `text_config` object")
                })?;
                Fields { path, obj, scope: "text_config.".into() }
            }
            "qwen3_5_text" => Fields { path, obj: root, scope: String::new() },
            "" => return Err(Error::config(path, "missing field `model_type`")),
            other => {
                return Err(Error::config(
                    path,
                    format!("unknown model_type `{other}`: strix runs Qwen3.5 (`qwen3_5`, `qwen3_5_text`)"),
                ))
            }
        };
        let c = parse_text_config(&text, &fields)?;
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
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
            ("linear_num_key_heads", self.linear_num_k_heads),
            ("linear_num_value_heads", self.linear_num_v_heads),
            ("linear_key_head_dim", self.linear_k_head_dim),
            ("linear_value_head_dim", self.linear_v_head_dim),
        ] {
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
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return bad(format!(
                "partial_rotary_factor gives a rotary dimension of {} for head_dim {}: it must be even and at most head_dim",
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
                    format!("field `{}{name}` must be a non-negative integer, got {v}", self.scope),
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
                Error::config(self.path, format!("field `{}{name}` must be a number, got {v}", self.scope))
            }),
            None => Ok(None),
        }
    }

    fn bool_opt(&self, name: &str) -> Result<Option<bool>> {
        match self.get(name) {
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                Error::config(
                    self.path,
                    format!("field `{}{name}` must be true or false, got {v}", self.scope),
                )
            }),
            None => Ok(None),
        }
    }
}

/// A bound on `num_hidden_layers`, checked before anything is allocated per layer.
const MAX_LAYERS: usize = 1 << 16;

fn parse_text_config(t: &Fields, root: &Fields) -> Result<ModelConfig> {
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

    // rope_parameters is the current form; older configs keep rope_theta and
    // partial_rotary_factor at the top level of the text config.
    let rope = t.get("rope_parameters").and_then(Value::as_object);
    let rope_fields = rope.map(|obj| Fields { path, obj, scope: format!("{}rope_parameters.", t.scope) });
    let from_rope = |name: &str| -> Result<Option<f64>> {
        match &rope_fields {
            Some(r) => r.f64_opt(name),
            None => Ok(None),
        }
    };
    if let Some(kind) = rope.and_then(|r| r.get("rope_type")).and_then(Value::as_str) {
        if kind != "default" {
            return Err(Error::config(
                path,
                format!("rope_parameters.rope_type `{kind}` is not supported (only `default`)"),
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
                    format!("layer_types[{i}] is {v}: expected \"linear_attention\" or \"full_attention\""),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(other) => {
            return Err(Error::config(path, format!("field `layer_types` must be a list, got {other}")))
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
    Ok(ModelConfig {
        vocab_size: t.usize("vocab_size")?,
        hidden_size,
        intermediate_size: t.usize("intermediate_size")?,
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
            Error::config(path, format!("`{field}` must be a token id or a list of them, got {v}"))
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
