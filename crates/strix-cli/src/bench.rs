//! `strix bench`: prefill and decode throughput at batch 1, set against the memory bandwidth
//! measured in the same run. Decoding one token reads every weight once, so
//! bytes-per-token × tokens/s over the bandwidth says how close decode is to its roofline.

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use rayon::prelude::*;
use serde_json::json;
use strix::backend::cpu::CpuBackend;
use strix::checkpoint::Checkpoint;
use strix::model::{Logits, Model};
use strix::synthetic::{preset, SyntheticWeights, PRESETS};

use crate::common::{self, CpuModel};

/// Seed of the synthetic weights and of the prompt ids, so runs compare like with like.
const SEED: u64 = 0x5EED;

#[derive(Args, Debug)]
#[command(after_help = "stdout gets one JSON object; stderr a table of the same figures.
Each repeat prefills --prompt-len pseudo-random ids into a fresh session, then decodes --gen
tokens greedily past any end-of-sequence token. One short warm-up pass runs first; the
reported speeds are the medians of the repeats.")]
pub struct BenchArgs {
    /// Model directory, or a Hugging Face repo id
    #[arg(short, long, value_name = "PATH", required_unless_present = "preset", conflicts_with = "preset")]
    pub model: Option<String>,

    /// Benchmark a published shape with random bf16 weights, synthesised in memory:
    /// qwen3.5-0.8b, qwen3.5-2b, qwen3.5-9b or qwen3.5-27b
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,

    /// Prompt tokens to prefill
    #[arg(short = 'p', long, value_name = "N", default_value_t = 512)]
    pub prompt_len: usize,

    /// Tokens to decode after the prompt
    #[arg(short = 'n', long, value_name = "N", default_value_t = 64)]
    pub gen: usize,

    /// Timed repetitions (the median is reported)
    #[arg(short, long, value_name = "N", default_value_t = 3)]
    pub repeats: usize,

    /// Worker threads [default: one per logical CPU]
    #[arg(short, long, value_name = "N")]
    pub threads: Option<usize>,

    /// Size of the buffer read to measure memory bandwidth; it should dwarf the caches
    /// (0 skips the measurement and the roofline)
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    pub bandwidth_mib: usize,
}

pub fn bench(args: BenchArgs) -> Result<()> {
    common::init_threads(args.threads)?;
    if args.prompt_len == 0 || args.gen == 0 || args.repeats == 0 {
        bail!("--prompt-len, --gen and --repeats must each be at least 1");
    }
    // Checked before the bandwidth run, so a typo fails fast.
    let shape = match &args.preset {
        Some(name) => Some(preset(name)?),
        None => None,
    };
    let dir = match &args.model {
        Some(m) => Some(common::resolve_model(Some(m))?),
        None => None,
    };
    // Measured before the model is in memory, so the two never compete for RAM.
    let bandwidth = (args.bandwidth_mib > 0).then(|| memory_bandwidth(args.bandwidth_mib << 20));

    let (model, name, source, dtype) = match (shape, &dir) {
        (Some(config), _) => {
            let weights = SyntheticWeights::new(config.clone(), SEED);
            let bar = common::progress_bar("synthesising", "layers");
            let progress = |done: u64, total: u64| {
                bar.set_length(total);
                bar.set_position(done);
            };
            let model = Model::from_source(config, &weights, CpuBackend::new(), Some(&progress));
            bar.finish_and_clear();
            let name = args.preset.clone().unwrap_or_default();
            (model?, name, "synthetic", "bf16".to_string())
        }
        (None, Some(dir)) => {
            let model = common::load_model(dir)?;
            let dtype = checkpoint_dtype(dir, &model);
            (model, dir.display().to_string(), "checkpoint", dtype)
        }
        (None, None) => bail!("give --model PATH or --preset NAME ({})", PRESETS.join(", ")),
    };
    let c = &model.config;
    let context = args.prompt_len + args.gen;
    if context > c.max_position_embeddings {
        bail!(
            "--prompt-len + --gen = {context} exceeds the model's max_position_embeddings ({})",
            c.max_position_embeddings
        );
    }
    let prompt = pseudo_random_ids(args.prompt_len, c.vocab_size);

    // Faults in every weight page and starts the thread pool.
    run_once(&model, &prompt[..prompt.len().min(16)], 2)?;
    let mut prefill = Vec::with_capacity(args.repeats);
    let mut decode = Vec::with_capacity(args.repeats);
    for _ in 0..args.repeats {
        let (p, d) = run_once(&model, &prompt, args.gen)?;
        prefill.push(p);
        decode.push(d);
    }
    let prefill_tok_s = median(&mut prefill);
    let decode_tok_s = median(&mut decode);

    let bytes_per_token = model.weight_bytes_per_token();
    let roofline_pct = bandwidth.map(|bw| 100.0 * bytes_per_token as f64 * decode_tok_s / (bw * 1e9));
    let threads = rayon::current_num_threads();
    let cpu = cpu_name();
    let report = json!({
        "machine": {
            "cpu": cpu,
            "threads": threads,
            "logical_cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        },
        "model": {
            "name": name,
            "source": source,
            "hidden": c.hidden_size,
            "layers": c.num_layers,
            "vocab": c.vocab_size,
            "intermediate": c.intermediate_size,
            "dtype": dtype,
        },
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "context": context,
        "batch": 1,
        "repeats": args.repeats,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
        "prefill_tok_s_runs": prefill,
        "decode_tok_s_runs": decode,
        "weight_bytes_per_token": bytes_per_token,
        "memory_bandwidth_gb_s": bandwidth,
        "decode_roofline_tok_s": bandwidth.map(|bw| bw * 1e9 / bytes_per_token as f64),
        "roofline_pct": roofline_pct,
    });
    println!("{report}");

    let row = |k: &str, v: String| eprintln!("  {k:<26} {v}");
    eprintln!("strix bench");
    row("cpu", format!("{cpu} ({threads} thread{})", if threads == 1 { "" } else { "s" }));
    row(
        "model",
        format!(
            "{name} ({source}, {dtype}): hidden {}, {} layers, vocab {}",
            c.hidden_size, c.num_layers, c.vocab_size
        ),
    );
    row("prompt / gen / context", format!("{} / {} / {context}, batch 1", args.prompt_len, args.gen));
    row("prefill", format!("{prefill_tok_s:.1} tok/s (median of {})", args.repeats));
    row("decode", format!("{decode_tok_s:.2} tok/s (median of {})", args.repeats));
    row("weights read per token", human_bytes(bytes_per_token));
    match (bandwidth, roofline_pct) {
        (Some(bw), Some(pct)) => {
            row("memory bandwidth", format!("{bw:.1} GB/s (parallel read, best of 5)"));
            row("decode roofline", format!("{:.2} tok/s", bw * 1e9 / bytes_per_token as f64));
            row("% of roofline", format!("{pct:.1}%"));
        }
        _ => row("memory bandwidth", "not measured (--bandwidth-mib 0)".to_string()),
    }
    Ok(())
}

/// `1.52 GB`, `345.2 kB`: decimal units, as bandwidth is quoted.
fn human_bytes(n: usize) -> String {
    let units = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB")];
    let n = n as f64;
    units
        .iter()
        .find(|(scale, _)| n >= *scale)
        .map_or(format!("{n} B"), |(scale, unit)| format!("{:.2} {unit}", n / scale))
}

/// One prefill of `prompt` into a fresh session and `gen` greedy decode steps; returns the
/// (prefill, decode) speeds in tokens per second.
fn run_once(model: &CpuModel, prompt: &[u32], gen: usize) -> Result<(f64, f64)> {
    let mut session = model.new_session(prompt.len() + gen);
    let start = Instant::now();
    let mut logits = model.forward(&mut session, prompt, Logits::Last)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..gen {
        let next = argmax(&logits);
        logits = model.forward(&mut session, &[next], Logits::Last)?;
    }
    let decode_seconds = start.elapsed().as_secs_f64();
    Ok((common::rate(prompt.len(), prefill_seconds), common::rate(gen, decode_seconds)))
}

fn argmax(logits: &[f32]) -> u32 {
    let best =
        logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
    best.0 as u32
}

fn median(values: &mut [f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Ids spread over the vocabulary by a fixed LCG: realistic embedding reads, same every run.
fn pseudo_random_ids(n: usize, vocab: usize) -> Vec<u32> {
    let mut state = SEED;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Read bandwidth in GB/s: every thread sums its share of a `bytes`-byte buffer, best of
/// five passes. The buffer is written first, so its pages are real memory rather than the
/// shared zero page.
fn memory_bandwidth(bytes: usize) -> f64 {
    let words = (bytes / 8).max(1);
    let mut buffer = vec![0u64; words];
    buffer.par_chunks_mut(1 << 16).enumerate().for_each(|(i, chunk)| {
        for (j, w) in chunk.iter_mut().enumerate() {
            *w = (i as u64) ^ (j as u64);
        }
    });
    let chunk = words.div_ceil(rayon::current_num_threads() * 8).max(1 << 12);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let start = Instant::now();
        let sum = buffer
            .par_chunks(chunk)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        black_box(sum);
        let seconds = start.elapsed().as_secs_f64();
        if seconds > 0.0 {
            best = best.max((words * 8) as f64 / seconds / 1e9);
        }
    }
    best
}

/// The CPU's name from /proc/cpuinfo (x86's `model name`, else ARM's `Hardware`/`Model`).
fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    ["model name", "Hardware", "Model", "cpu model"]
        .iter()
        .find_map(|key| {
            info.lines().find_map(|line| {
                let (k, v) = line.split_once(':')?;
                (k.trim() == *key && !v.trim().is_empty()).then(|| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// The dtype of a checkpoint's MLP weights (the bulk of the bytes), e.g. `bf16`.
fn checkpoint_dtype(dir: &Path, model: &CpuModel) -> String {
    let c = &model.config;
    let dtype = || -> Result<String> {
        let ckpt = Checkpoint::open_dir(dir)?;
        let name =
            ["model.language_model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"]
                .into_iter()
                .find(|n| ckpt.contains(n))
                .ok_or_else(|| anyhow!("no layer 0 MLP weight"))?;
        Ok(ckpt.tensor(name, &[c.hidden_size, c.intermediate_size])?.dtype.name().to_ascii_lowercase())
    };
    dtype().unwrap_or_else(|_| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn prompt_ids_stay_in_the_vocabulary() {
        let ids = pseudo_random_ids(1000, 384);
        assert!(ids.iter().all(|&id| id < 384));
        assert!(ids.iter().collect::<std::collections::HashSet<_>>().len() > 200);
    }
}
