//! `--quant`: the weight matrices of a float (bf16/f16/f32) checkpoint quantized to a GGML
//! block format as they are loaded (`strix::quant::on_load`), for every command that loads a
//! model.

use anyhow::Result;
use clap::Args;
use strix::backend::Backend;
use strix::model::{Model, ModelFiles};
use strix::quant::on_load::{load_quantized, QuantScheme};

use crate::loading;

#[derive(Args, Debug, Default)]
pub struct QuantArgs {
    /// Quantize the weight matrices on load: q8_0, q4_0, or q4_k (Q4_K with llama.cpp's
    /// Q4_K_M promotions to Q6_K); norms and vectors stay as stored
    #[arg(long, value_name = "TYPE")]
    pub quant: Option<QuantScheme>,
}

/// [`loading::load_model`], quantizing on the way when `quant` is given.
pub fn load_model<B: Backend>(files: ModelFiles, backend: B, quant: Option<QuantScheme>) -> Result<Model<B>> {
    match (quant, files) {
        (None, files) => loading::load_model(files, backend),
        (Some(scheme), ModelFiles::Directory(dir)) => Ok(loading::with_progress("loading", "bytes", |p| {
            load_quantized(&dir, backend, scheme, Some(p))
        })?),
        (Some(scheme), files) => anyhow::bail!(
            "--quant {scheme} quantizes a safetensors checkpoint, and {} has no config.json",
            files.path().display()
        ),
    }
}
