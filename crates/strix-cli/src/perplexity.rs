//! `strix perplexity`: llama.cpp's `llama-perplexity` for strix models (see
//! `strix::perplexity` for the definitions): the perplexity of a text file, optionally saving
//! the base log-probabilities (`--save-logits`), or the KL divergence of this run against a
//! saved base (`--kl-base`). Output follows llama.cpp's lines so the figures read the same.

use std::io::BufWriter;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use strix::backend::Backend;
use strix::model::Model;
use strix::perplexity::{self as ppl, BaseLogProbs, BaseWriter};
use strix::quant::on_load::QuantizingSource;
use strix::synthetic::{preset, SyntheticWeights};
use strix::tokenizer::Tokenizer;

use crate::common::{self, ModelArgs};
use crate::device::{self, with_backend};

#[derive(Args, Debug)]
#[command(after_help = "Perplexity: the text is tokenized whole (no BOS is added: Qwen's vocabulary asks for
none), cut into windows of --ctx tokens, each evaluated from a fresh state; the second half of
each window is scored. Prints llama.cpp's running `[i]ppl,` line and
`Final estimate: PPL = X +/- E`.
KL divergence: run once with the base weights and --save-logits FILE (llama.cpp's
--kl-divergence-base file format), then with other weights (e.g. --quant q4_k) and
--kl-base FILE: the tokens and windows come from the file, and the run reports PPL(Q),
PPL(base), their ratio, the mean KL divergence with its percentiles, RMS Δp and the share of
positions with the same top token.")]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// The text to score (required unless --kl-base gives the tokens)
    #[arg(short, long, value_name = "TEXT_FILE", required_unless_present = "kl_base")]
    pub file: Option<PathBuf>,

    /// Tokens per window
    #[arg(short = 'c', long, value_name = "N", default_value_t = 512, value_parser = crate::limits::tokens)]
    pub ctx: usize,

    /// Tokens per forward pass within a window
    #[arg(short, long, value_name = "N", default_value_t = 512, value_parser = crate::limits::tokens)]
    pub batch: usize,

    /// Score at most N windows [default: all]
    #[arg(long, value_name = "N", value_parser = crate::limits::positive)]
    pub chunks: Option<usize>,

    /// Compare against the base log-probabilities in FILE (written by --save-logits)
    #[arg(long, value_name = "FILE", conflicts_with_all = ["file", "save_logits", "chunks"])]
    pub kl_base: Option<PathBuf>,

    /// Save this run's log-probabilities of the scored positions as a base for --kl-base
    #[arg(long, value_name = "FILE")]
    pub save_logits: Option<PathBuf>,

    /// Score a published shape with random bf16 weights synthesised in memory (as `strix
    /// bench --preset`) instead of --model; needs --tokenizer for --file
    #[arg(long, value_name = "NAME", conflicts_with = "model")]
    pub preset: Option<String>,

    /// tokenizer.json to tokenize --file with [default: the model directory's]
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,

    /// Print one JSON object with the figures on stdout as well
    #[arg(long)]
    pub json: bool,
}

/// Seed of the synthetic weights (the same as `strix bench`'s, so runs compare).
const PRESET_SEED: u64 = 0x5EED;

pub fn perplexity(args: PerplexityArgs) -> Result<()> {
    common::init_threads(args.model.threads)?;
    common::on_pool(|| perplexity_on_pool(args))
}

fn perplexity_on_pool(args: PerplexityArgs) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let dir = match &args.preset {
        Some(_) => None,
        None => Some(common::resolve_model(args.model.model.as_deref())?),
    };
    let base = match &args.kl_base {
        Some(path) => Some(BaseLogProbs::read(path)?),
        None => None,
    };
    let tokens = match (&args.file, &base) {
        (_, Some(b)) => b.tokens.clone(),
        (Some(file), None) => {
            let opened = std::fs::File::open(file).with_context(|| format!("reading {}", file.display()))?;
            let text =
                common::read_text(opened, crate::limits::MAX_TEXT_FILE_BYTES, &file.display().to_string())?;
            let tokenizer = match (&args.tokenizer, &dir) {
                (Some(path), _) => Tokenizer::from_file(path)?,
                (None, Some(files)) => {
                    let t = common::load_tokenizer(files)?;
                    common::require_tokenizer(t.as_ref(), files.path(), "the text file")?.clone()
                }
                (None, None) => bail!("--preset has no tokenizer: give --tokenizer tokenizer.json"),
            };
            tokenizer.encode(&text, false)?
        }
        (None, None) => bail!("give --file TEXT_FILE or --kl-base FILE"),
    };
    let opened = device::open(&args.model.device, false)?;
    let quant = args.model.quant.quant;
    with_backend!(opened, backend => {
        let mut model = match (&args.preset, dir) {
            (Some(name), _) => {
                let config = preset(name)?;
                let weights = SyntheticWeights::new(config.clone(), PRESET_SEED);
                common::with_progress("synthesising", "layers", |p| match quant {
                    None => Model::from_source(config.clone(), &weights, backend, Some(p)),
                    Some(scheme) => {
                        let src = QuantizingSource::new(&weights, &config, scheme);
                        Model::from_source(config.clone(), &src, backend, Some(p))
                    }
                })?
            }
            (None, Some(files)) => crate::quant_flag::load_model(files, backend, quant)?,
            (None, None) => unreachable!("a model directory is resolved unless --preset is given"),
        };
        args.model.device.configure(&mut model)?;
        match &base {
            Some(b) => kl_with(&model, &args, b),
            None => ppl_with(&model, &args, &tokens),
        }
    })
}

fn ppl_with<B: Backend>(model: &Model<B>, args: &PerplexityArgs, tokens: &[u32]) -> Result<()> {
    common::check_ids(tokens, model.config.vocab_size)?;
    let ctx = args.ctx;
    let mut n_chunk = ppl::chunk_count(tokens.len(), ctx)?;
    if let Some(n) = args.chunks {
        n_chunk = n_chunk.min(n);
    }
    let tokens = &tokens[..n_chunk * ctx];
    eprintln!(
        "perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={ctx}, batch_size={}, n_seq=1",
        args.batch
    );
    let vocab = model.config.vocab_size;
    let mut writer = match &args.save_logits {
        Some(path) => {
            let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
            Some(BaseWriter::new(BufWriter::new(f), ctx, vocab, n_chunk, tokens)?)
        }
        None => None,
    };
    let started = Instant::now();
    let stats = ppl::perplexity(model, tokens, ctx, args.batch, writer.as_mut(), |i, s| {
        if i == 0 {
            eprintln!("perplexity: {:.2} seconds per pass", started.elapsed().as_secs_f64());
        }
        eprint!("[{}]{:.4},", i + 1, s.ppl());
    })?;
    eprintln!();
    if let Some(w) = writer {
        w.finish().context("writing the base log-probabilities")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("Final estimate: PPL = {:.4} +/- {:.5}", stats.ppl(), stats.ppl_error());
    if args.json {
        let v = json!({
            "ppl": stats.ppl(), "ppl_error": stats.ppl_error(), "scored": stats.count,
            "chunks": n_chunk, "ctx": ctx, "seconds": seconds,
            "quant": args.model.quant.quant.map(|q| q.name()),
        });
        println!("{v}");
    }
    Ok(())
}

fn kl_with<B: Backend>(model: &Model<B>, args: &PerplexityArgs, base: &BaseLogProbs) -> Result<()> {
    common::check_ids(&base.tokens, model.config.vocab_size)?;
    eprintln!(
        "kl_divergence: {} chunks, n_ctx={}, {} scored positions",
        base.n_chunk,
        base.n_ctx,
        base.n_chunk * ppl::scored_per_chunk(base.n_ctx)
    );
    eprintln!("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p");
    let stats = ppl::kl_divergence(model, base, args.batch, |i, s| {
        let r = s.report();
        eprintln!(
            "{:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
            i + 1,
            r.ppl.0,
            r.ppl.1,
            r.ln_ppl_ratio.0,
            r.ln_ppl_ratio.1,
            r.kld.0,
            r.kld.1,
            100.0 * r.rms_p_diff.0,
            100.0 * r.rms_p_diff.1,
            100.0 * r.same_top.0,
            100.0 * r.same_top.1
        );
    })?;
    let r = stats.report();
    let mut sorted = stats.kld_values.clone();
    sorted.sort_by(f32::total_cmp);
    println!("====== Perplexity statistics ======");
    println!("Mean PPL(Q)                   : {:10.6} ± {:10.6}", r.ppl.0, r.ppl.1);
    println!("Mean PPL(base)                : {:10.6} ± {:10.6}", r.ppl_base.0, r.ppl_base.1);
    println!("Mean ln(PPL(Q)/PPL(base))     : {:10.6} ± {:10.6}", r.ln_ppl_ratio.0, r.ln_ppl_ratio.1);
    println!("Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}", r.ppl_ratio.0, r.ppl_ratio.1);
    println!();
    println!("====== KL divergence statistics ======");
    println!("Mean    KLD: {:10.6} ± {:10.6}", r.kld.0, r.kld.1);
    println!("Maximum KLD: {:10.6}", r.kld_max);
    for (label, f) in [("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9)] {
        println!("{label}   KLD: {:10.6}", ppl::percentile(&sorted, f));
    }
    println!("Median  KLD: {:10.6}", r.kld_median);
    println!();
    println!("====== Token probability statistics ======");
    println!("RMS Δp    : {:6.3} ± {:5.3} %", 100.0 * r.rms_p_diff.0, 100.0 * r.rms_p_diff.1);
    println!("Same top p: {:6.3} ± {:5.3} %", 100.0 * r.same_top.0, 100.0 * r.same_top.1);
    if args.json {
        let v = json!({
            "scored": r.count,
            "ppl": r.ppl.0, "ppl_error": r.ppl.1,
            "ppl_base": r.ppl_base.0, "ppl_base_error": r.ppl_base.1,
            "ppl_ratio": r.ppl_ratio.0, "ppl_ratio_error": r.ppl_ratio.1,
            "kld": r.kld.0, "kld_error": r.kld.1, "kld_max": r.kld_max, "kld_median": r.kld_median,
            "kld_p99": r.kld_p99,
            "rms_p_diff": r.rms_p_diff.0, "same_top": r.same_top.0, "same_top_error": r.same_top.1,
            "quant": args.model.quant.quant.map(|q| q.name()),
        });
        println!("{v}");
    }
    Ok(())
}
