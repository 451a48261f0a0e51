//! `strix quantize`: a Hugging Face Qwen3.5 checkpoint (or random weights of a published
//! shape, `--preset`) written as a llama.cpp `qwen35` GGUF (`qwen35moe` for the
//! mixture-of-experts models),
//! its matrices encoded with strix's GGML-exact quantizers: what llama.cpp's converter plus
//! `llama-quantize` make of it (`strix::gguf::qwen35::write_gguf`;
//! scripts/check_gguf_with_llama_cpp.py compares the two tensor by tensor).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use strix::checkpoint::Checkpoint;
use strix::config::ModelConfig;
use strix::gguf::qwen35::{tokenizer_metadata, write_gguf, GgufTypes};
use strix::quant::on_load::QuantScheme;
use strix::quant::QuantType;
use strix::synthetic::{preset, SyntheticWeights, PRESETS, PRESET_SEED};

use crate::common;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Model directory (config.json, *.safetensors; tokenizer.json and the chat template go
    /// into the file's metadata when present)
    #[arg(short, long, value_name = "DIR", required_unless_present = "preset", conflicts_with = "preset")]
    pub model: Option<PathBuf>,

    /// Instead of --model: random weights of a published shape (strix bench's presets: the
    /// same weights for the same name), to make benchmark files of the real sizes without a
    /// checkpoint
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,

    /// With --preset: the directory whose tokenizer.json (and tokenizer_config.json, when
    /// present) go into the file's metadata
    #[arg(long, value_name = "DIR", requires = "preset")]
    pub tokenizer: Option<PathBuf>,

    /// q8_0, q4_0 or q4_k (= q4_k_m): llama-quantize's choice of type per matrix for that
    /// target, as --quant on load makes it (Q6_K output for q4_0 and q4_k, Q6_K attn_v /
    /// attn_qkv / ffn_down in some layers for q4_k); q6_k, bf16, f16 or f32: every matrix in
    /// that type. Rows that are not whole blocks fall back as llama-quantize's do (Q4_K →
    /// Q5_0, Q6_K → Q8_0, else F16); norms, conv1d and vectors stay f32
    #[arg(short, long, value_name = "TYPE")]
    pub quant: String,

    /// The GGUF file to write
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,
}

/// The types `--quant` accepts: the schemes of `--quant` on load (llama-quantize's mixtures),
/// or one type for every matrix.
pub fn parse_quant(name: &str) -> Result<GgufTypes> {
    use QuantType::*;
    if let Ok(scheme) = name.parse::<QuantScheme>() {
        return Ok(GgufTypes::Scheme(scheme));
    }
    match QuantType::from_name(name) {
        Some(t @ (Q6_K | BF16 | F16 | F32)) => Ok(GgufTypes::Uniform(t)),
        _ => bail!("--quant {name}: expected q8_0, q4_0, q4_k (q4_k_m), q6_k, bf16, f16 or f32"),
    }
}

pub fn quantize(args: QuantizeArgs) -> Result<()> {
    let ty = parse_quant(&args.quant)?;
    let report = match (&args.model, &args.preset) {
        (Some(dir), None) => from_checkpoint(dir, ty, &args.out)?,
        (None, Some(name)) => from_preset(name, args.tokenizer.as_deref(), ty, &args.out)?,
        _ => bail!("give --model DIR or --preset NAME ({})", PRESETS.join(", ")),
    };
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, t) in &report.tensors {
        *counts.entry(t.name()).or_default() += 1;
    }
    let size = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    let counts: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    eprintln!(
        "strix quantize: wrote {} ({:.2} MiB; tensors: {})",
        args.out.display(),
        size as f64 / (1u64 << 20) as f64,
        counts.join(", ")
    );
    Ok(())
}

fn from_checkpoint(dir: &Path, ty: GgufTypes, out: &Path) -> Result<strix::gguf::qwen35::WriteReport> {
    let shown = dir.display().to_string();
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => common::check_model_dir(dir, &shown)?,
        Ok(_) => bail!("--model {shown} is a file: give the Hugging Face model directory to quantize"),
        Err(e) => bail!("--model {shown}: {e}"),
    }
    let config = ModelConfig::from_model_dir(dir)?;
    let ckpt = Checkpoint::open_dir(dir)?;
    let metadata = tokenizer_of(dir, config.vocab_size)?;
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    common::with_progress("quantizing", "tensors", |p| {
        write_gguf(&config, &ckpt, ty, metadata, &name, out, Some(p))
    })
    .with_context(|| format!("writing {}", out.display()))
}

fn from_preset(
    name: &str,
    tokenizer: Option<&Path>,
    ty: GgufTypes,
    out: &Path,
) -> Result<strix::gguf::qwen35::WriteReport> {
    let config = preset(name)?;
    let metadata = match tokenizer {
        Some(dir) if dir.is_dir() => tokenizer_of(dir, config.vocab_size)?,
        Some(dir) => {
            bail!("--tokenizer {}: not a directory (give the one holding tokenizer.json)", dir.display())
        }
        None => {
            eprintln!("strix: warning: no --tokenizer; the GGUF will carry no tokenizer");
            Vec::new()
        }
    };
    let weights = SyntheticWeights::new(config.clone(), PRESET_SEED);
    common::with_progress("writing", "tensors", |p| {
        write_gguf(&config, &weights, ty, metadata, name, out, Some(p))
    })
    .with_context(|| format!("writing {}", out.display()))
}

/// The tokenizer metadata of `dir`'s tokenizer.json, or none (with a warning) without one.
fn tokenizer_of(dir: &Path, vocab_size: usize) -> Result<Vec<(String, strix::gguf::GgufValue)>> {
    if dir.join("tokenizer.json").is_file() {
        return Ok(tokenizer_metadata(dir, vocab_size)?);
    }
    eprintln!("strix: warning: {} has no tokenizer.json; the GGUF will carry no tokenizer", dir.display());
    Ok(Vec::new())
}
