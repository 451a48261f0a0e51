//! `strix logits`: one forward pass over a prompt, writing the logits of every position to a
//! safetensors file — for comparing strix against a reference implementation.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use safetensors::tensor::{Dtype, TensorView};
use strix::backend::Backend;
use strix::model::{Logits, Model};

use crate::common;
use crate::device::{self, with_backend, DeviceArgs};

#[derive(Args, Debug)]
#[command(
    after_help = "The file holds `logits` (F32, [prompt tokens, vocab]: row i is the distribution of the
token after prompt position i) and `ids` (I64, [prompt tokens]: the prompt)."
)]
pub struct LogitsArgs {
    /// Model directory, or a Hugging Face repo id
    #[arg(short, long, value_name = "PATH")]
    pub model: String,

    /// The prompt as token ids, e.g. 1,2,3
    #[arg(long, value_name = "IDS", required_unless_present = "prompt", conflicts_with = "prompt")]
    pub prompt_ids: Option<String>,

    /// The prompt as text (needs the model's tokenizer.json; no chat template is applied)
    #[arg(short, long, value_name = "TEXT")]
    pub prompt: Option<String>,

    /// Output safetensors file
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,

    /// Worker threads, at most 4 per logical CPU [default: one per logical CPU]
    #[arg(short, long, value_name = "N", value_parser = crate::limits::threads)]
    pub threads: Option<usize>,

    #[command(flatten)]
    pub device: DeviceArgs,

    /// Print the device on stderr
    #[arg(short, long)]
    pub verbose: bool,
}

pub fn logits(args: LogitsArgs) -> Result<()> {
    common::init_threads(args.threads)?;
    let files = common::resolve_model(Some(&args.model))?;
    let dir = files.path().to_path_buf();
    let ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => common::parse_ids(ids)?,
        (None, Some(text)) => {
            let tokenizer = common::load_tokenizer(&files)?;
            let tokenizer = common::require_tokenizer(tokenizer.as_ref(), &dir, "--prompt")?;
            tokenizer.encode(text, true)?
        }
        (None, None) => bail!("give the prompt with --prompt-ids or --prompt"),
    };
    let opened = device::open(&args.device, args.verbose)?;
    let logits = with_backend!(opened, backend => {
        let mut model = common::load_model(files, backend)?;
        args.device.configure(&mut model)?;
        prompt_logits(&model, &ids)?
    });
    let vocab = logits.len() / ids.len();

    let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let id_bytes: Vec<u8> = ids.iter().flat_map(|&id| i64::from(id).to_le_bytes()).collect();
    let tensors = [
        ("logits", TensorView::new(Dtype::F32, vec![ids.len(), vocab], &logit_bytes)?),
        ("ids", TensorView::new(Dtype::I64, vec![ids.len()], &id_bytes)?),
    ];
    let metadata = HashMap::from([("model".to_string(), dir.display().to_string())]);
    let bytes = safetensors::serialize(tensors, Some(metadata))?;
    std::fs::write(&args.out, bytes).with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("strix: wrote logits [{}, {vocab}] to {}", ids.len(), args.out.display());
    Ok(())
}

/// The logits of every position of `ids`, `[ids.len(), vocab]`, on the model's backend.
fn prompt_logits<B: Backend>(model: &Model<B>, ids: &[u32]) -> Result<Vec<f32>> {
    common::check_ids(ids, model.config.vocab_size)?;
    if ids.len() > model.config.max_position_embeddings {
        bail!(
            "the prompt has {} tokens, more than the model's max_position_embeddings ({})",
            ids.len(),
            model.config.max_position_embeddings
        );
    }
    let mut session = model.try_new_session(ids.len())?;
    Ok(model.forward(&mut session, ids, Logits::All)?)
}
