//! `strix bench`: prefill and decode throughput on the chosen device, set against the memory
//! bandwidth measured in the same run. Decoding one token reads every weight once, so
//! bytes-per-token × tokens/s over the bandwidth says how close decode is to its roofline.
//!
//! A run makes a headline measurement (prefill `--prompt-len` tokens into a fresh session,
//! then decode `--gen` tokens: the top-level JSON fields) and three sweeps, each optional:
//! prefill speed per prompt length, batch-1 decode speed per context length, and aggregate
//! decode speed per batch size. The sweeps default to the issue's set on CUDA (prefill 512
//! and 4096, decode at 128 and 4096, batches 1, 16, 64) and to none on the CPU, where they
//! would take minutes.
//!
//! Every timed region ends with logits copied to the host (`Model::forward` and
//! `Model::decode_batch` return them), which waits for the device, so host clocks are honest.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use serde_json::{json, Map, Value};
use strix::checkpoint::Checkpoint;
use strix::config::ModelConfig;
use strix::model::{Logits, Model};
use strix::sampling::{argmax, Sampler, SamplingParams};
use strix::session::Session;
use strix::synthetic::{preset, SyntheticWeights, PRESETS};

use crate::common;
use crate::device::{
    self, path_count_delta, path_counts_line, with_backend, DeviceArgs, DeviceInfo, OpTable,
};
use crate::limits;

/// Seed of the synthetic weights and of the prompt ids, so runs compare like with like.
const SEED: u64 = strix::synthetic::PRESET_SEED;

/// Untimed decode steps before each decode measurement: the first steps of a shape allocate
/// scratch and (on CUDA) pick kernels.
const WARM_STEPS: usize = 2;

/// The sweeps' defaults on CUDA: the figures the CUDA issue asks for.
const CUDA_PROMPT_LENS: &[usize] = &[512, 4096];
const CUDA_CONTEXTS: &[usize] = &[128, 4096];
const CUDA_BATCHES: &[usize] = &[1, 16, 64];

/// A comma-separated list of positive sizes; `none` (or nothing) is the empty list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeList(Vec<usize>);

impl SizeList {
    /// Parses the list, each entry through `entry` (which holds its bounds).
    fn parse(s: &str, entry: fn(&str) -> Result<usize, String>) -> Result<SizeList, String> {
        if s.trim().is_empty() || s.trim().eq_ignore_ascii_case("none") {
            return Ok(SizeList(Vec::new()));
        }
        s.split(',')
            .map(|part| entry(part).map_err(|why| format!("`{}`: {why} (give N,N,... or none)", part.trim())))
            .collect::<Result<Vec<_>, _>>()
            .map(SizeList)
    }
}

/// `--prompt-lens`, `--contexts`: token counts.
fn token_list(s: &str) -> Result<SizeList, String> {
    SizeList::parse(s, limits::tokens)
}

/// `--batches`: batch sizes.
fn batch_list(s: &str) -> Result<SizeList, String> {
    SizeList::parse(s, limits::batch)
}

#[derive(Args, Debug)]
#[command(after_help = "stdout gets one JSON object; stderr a table of the same figures.
Headline: each repeat prefills --prompt-len pseudo-random ids into a fresh session, then decodes
--gen tokens greedily past any end-of-sequence token (one short warm-up pass first).
Sweeps: --prompt-lens times a prefill per length (after one untimed prefill of that length);
--contexts prefills each context once, then times --repeats runs of --gen decode steps;
--batches prefills B sequences with --batch-context tokens each, then times --repeats runs of
--gen decode steps of all B at once (aggregate tok/s = B x steps / time). Speeds are medians of
the repeats. % of roofline = weight bytes read per step x steps/s / measured bandwidth.
The sweeps default to 512,4096 / 128,4096 / 1,16,64 on CUDA (less any longer than the model's
context) and to none on the CPU; `none` turns one off.")]
pub struct BenchArgs {
    /// Model directory, GGUF file, or a Hugging Face repo id
    #[arg(short, long, value_name = "PATH", required_unless_present = "preset", conflicts_with = "preset")]
    pub model: Option<String>,

    /// Benchmark a published shape with random bf16 weights, synthesised in memory:
    /// qwen3.5-0.8b, qwen3.5-2b, qwen3.5-9b or qwen3.5-27b
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub quant: crate::quant_flag::QuantArgs,

    /// Prompt tokens to prefill (headline measurement)
    #[arg(short = 'p', long, value_name = "N", default_value_t = 512, value_parser = limits::tokens)]
    pub prompt_len: usize,

    /// Tokens to decode after the prompt, and decode steps per timed run of the sweeps
    #[arg(short = 'n', long, value_name = "N", default_value_t = 64, value_parser = limits::tokens)]
    pub gen: usize,

    /// Timed repetitions (the median is reported)
    #[arg(short, long, value_name = "N", default_value_t = 3, value_parser = limits::repeats)]
    pub repeats: usize,

    /// Prefill speed at each of these prompt lengths [default: 512,4096 on CUDA, none on the CPU]
    #[arg(long, value_name = "N,..", value_parser = token_list)]
    pub prompt_lens: Option<SizeList>,

    /// Batch-1 decode speed at each of these context lengths [default: 128,4096 on CUDA, none
    /// on the CPU]
    #[arg(long, value_name = "N,..", value_parser = token_list)]
    pub contexts: Option<SizeList>,

    /// Aggregate decode speed at each of these batch sizes [default: 1,16,64 on CUDA, none on
    /// the CPU]
    #[arg(long, value_name = "N,..", value_parser = batch_list)]
    pub batches: Option<SizeList>,

    /// Also time decode with sampling: batch 1 at each --contexts length as Qwen3.5's
    /// generation config samples (temperature 0.6, top-k 20, top-p 0.95), the draw finished
    /// next to the logits (only ids come back) and with the logits copied to the host; and
    /// with temperature 0.7 alone over the whole vocabulary (what OpenAI clients send), at
    /// each context and each --batches size
    #[arg(long)]
    pub sampled: bool,

    /// Prompt tokens each sequence of a --batches measurement is prefilled with
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = limits::tokens)]
    pub batch_context: usize,

    /// Worker threads, at most 4 per logical CPU [default: one per logical CPU]
    #[arg(short, long, value_name = "N", value_parser = limits::threads)]
    pub threads: Option<usize>,

    /// Size of the buffer used to measure memory bandwidth; it should dwarf the caches
    /// (0 skips the measurement and the roofline) [default: 1024 on the CPU, 2048 on CUDA]
    #[arg(long, value_name = "MIB", value_parser = limits::bandwidth_mib)]
    pub bandwidth_mib: Option<usize>,

    /// Print the device, each measurement as it completes, and the kernel-path counters
    /// (CUDA) on stderr
    #[arg(short, long)]
    pub verbose: bool,
}

/// Which sweeps run, once the device (and so the defaults) is known.
struct Plan {
    prompt_lens: Vec<usize>,
    contexts: Vec<usize>,
    batches: Vec<usize>,
}

impl Plan {
    /// The sweeps asked for, else the device's defaults less those longer than the model's
    /// context (`max_context`): a small model on a GPU still gets the rest of the set, while
    /// a length given explicitly is checked, not dropped (see [`Plan::longest_context`]).
    fn new(args: &BenchArgs, cuda: bool, max_context: usize) -> Plan {
        let decode_tail = WARM_STEPS + args.repeats * args.gen;
        let pick = |given: &Option<SizeList>, cuda_default: &[usize], extra: usize| match given {
            Some(list) => list.0.clone(),
            None if cuda => cuda_default.iter().copied().filter(|&n| n + extra <= max_context).collect(),
            None => Vec::new(),
        };
        Plan {
            prompt_lens: pick(&args.prompt_lens, CUDA_PROMPT_LENS, 0),
            contexts: pick(&args.contexts, CUDA_CONTEXTS, decode_tail),
            batches: pick(&args.batches, CUDA_BATCHES, 0),
        }
    }

    /// The longest session any measurement needs.
    fn longest_context(&self, args: &BenchArgs) -> usize {
        let decode_tail = WARM_STEPS + args.repeats * args.gen;
        let mut longest = args.prompt_len + args.gen;
        longest = longest.max(self.prompt_lens.iter().copied().max().unwrap_or(0));
        longest = longest.max(self.contexts.iter().map(|c| c + decode_tail).max().unwrap_or(0));
        if !self.batches.is_empty() {
            longest = longest.max(args.batch_context + decode_tail);
        }
        longest
    }

    /// The measurement whose sessions hold the most memory at once, given the bytes of one
    /// session of a context: those bytes, and the flag that asked for it.
    fn largest_sessions(&self, args: &BenchArgs, session_bytes: impl Fn(usize) -> usize) -> (usize, String) {
        let decode_tail = WARM_STEPS + args.repeats * args.gen;
        let mut largest = (session_bytes(args.prompt_len + args.gen), "--prompt-len and --gen".to_string());
        let mut consider = |bytes: usize, what: String| {
            if bytes > largest.0 {
                largest = (bytes, what);
            }
        };
        for &len in &self.prompt_lens {
            consider(session_bytes(len), format!("--prompt-lens {len}"));
        }
        for &ctx in &self.contexts {
            consider(session_bytes(ctx + decode_tail), format!("--contexts {ctx}"));
        }
        for &batch in &self.batches {
            let each = session_bytes(args.batch_context + decode_tail);
            consider(
                batch.saturating_mul(each),
                format!(
                    "--batches {batch} ({batch} sessions of {} tokens)",
                    args.batch_context + decode_tail
                ),
            );
        }
        largest
    }
}

pub fn bench(args: BenchArgs) -> Result<()> {
    common::init_threads(args.threads)?;
    common::on_pool(|| bench_on_pool(args))
}

fn bench_on_pool(args: BenchArgs) -> Result<()> {
    if args.prompt_len == 0 || args.gen == 0 || args.repeats == 0 || args.batch_context == 0 {
        bail!("--prompt-len, --gen, --repeats and --batch-context must each be at least 1");
    }
    // Checked before the device is opened and the bandwidth measured, so a typo fails fast.
    let (config, source) = match (&args.preset, &args.model) {
        (Some(name), _) => (preset(name)?, Source::Preset(name.clone())),
        (None, Some(m)) => {
            let files = common::resolve_model(Some(m))?;
            (files.config()?, Source::Files(files))
        }
        (None, None) => bail!("give --model PATH or --preset NAME ({})", PRESETS.join(", ")),
    };
    let opened = device::open(&args.device, args.verbose)?;
    with_backend!(opened, backend => bench_with(backend, &args, config, source))
}

/// Refuses a preset whose weights cannot fit in the memory the backend has left (the
/// 397B-A17B takes ~790 GB in bf16), before any is made: the synthesis would otherwise grow
/// until an allocation failed or the OOM killer stopped it. With `--quant` the bound is the
/// smallest format's 4.5 bits a weight (Q4_0), so a model that might fit is always tried.
fn check_preset_fits(
    name: &str,
    weights: &SyntheticWeights,
    quantized: bool,
    backend: &impl DeviceInfo,
) -> Result<()> {
    let bf16 = weights.total_bytes() as u64;
    let least = if quantized { bf16 / 32 * 9 } else { bf16 };
    match backend.available_memory() {
        Some(available) if least > available => bail!(
            "the {name} preset's weights take {} GiB in bf16{} and {} has {} GiB free: \
             it does not fit ({})",
            bf16 >> 30,
            if quantized { format!(" and at least {} GiB quantized", least >> 30) } else { String::new() },
            backend.kind(),
            available >> 30,
            if quantized { "a smaller preset" } else { "--quant, or a smaller preset" }
        ),
        _ => Ok(()),
    }
}

/// Where the weights come from.
enum Source {
    Preset(String),
    Files(strix::model::ModelFiles),
}

/// Memory in use, the largest of the samples taken while sessions were alive.
#[derive(Default)]
struct PeakMemory(Option<u64>);

impl PeakMemory {
    fn sample(&mut self, backend: &impl DeviceInfo) {
        if let Some(used) = backend.memory_used() {
            self.0 = Some(self.0.map_or(used, |peak| peak.max(used)));
        }
    }
}

/// One measurement of a sweep: its speeds per repeat and the kernel paths its timed region
/// took.
struct Measured {
    runs: Vec<f64>,
    paths: Option<Map<String, Value>>,
}

impl Measured {
    fn median(&self) -> f64 {
        median(&self.runs)
    }
}

/// The path counters at the start of a timed region, to tell what the region ran (untimed
/// prefills and warm-ups are left out, so the counts show the path being measured).
struct PathWindow(Option<Map<String, Value>>);

impl PathWindow {
    fn open(backend: &impl DeviceInfo) -> PathWindow {
        PathWindow(backend.path_counts())
    }

    fn close(self, backend: &impl DeviceInfo) -> Option<Map<String, Value>> {
        Some(path_count_delta(&self.0?, &backend.path_counts()?))
    }
}

fn bench_with<B: DeviceInfo>(
    mut backend: B,
    args: &BenchArgs,
    config: ModelConfig,
    source: Source,
) -> Result<()> {
    // --verbose on the CPU: every op's wall time, read around one extra prefill and decode.
    if args.verbose {
        backend.keep_op_times();
    }
    let plan = Plan::new(args, backend.kind() == "cuda", config.max_position_embeddings);
    let longest = plan.longest_context(args);
    if longest > config.max_position_embeddings {
        bail!(
            "the measurements need a {longest}-token context, more than the model's max_position_embeddings ({}): \
             shorten --prompt-len, --contexts, --batch-context or --gen x --repeats",
            config.max_position_embeddings
        );
    }
    let verbose = args.verbose;
    let note = |what: String| {
        if verbose {
            eprintln!("strix bench: {what}");
        }
    };

    // Measured before the model is in memory, so the two never compete for it.
    let bandwidth_mib = args.bandwidth_mib.unwrap_or_else(|| backend.default_bandwidth_mib());
    if let Some(available) = backend.available_memory() {
        if (bandwidth_mib as u64) << 20 > available {
            bail!(
                "--bandwidth-mib {bandwidth_mib}: only {} MiB of {} memory is available for the probe",
                available >> 20,
                backend.kind()
            );
        }
    }
    let bandwidth =
        if bandwidth_mib > 0 { Some(backend.measure_bandwidth(bandwidth_mib << 20)?) } else { None };
    if let Some(bw) = bandwidth {
        note(format!("memory bandwidth {bw:.1} GB/s ({})", backend.bandwidth_method()));
    }

    let device_name = backend.name();
    let kind = backend.kind();
    let started = Instant::now();
    let (mut model, name, source_kind, dtype) = match source {
        Source::Preset(name) => {
            let weights = SyntheticWeights::new(config.clone(), SEED);
            check_preset_fits(&name, &weights, args.quant.quant.is_some(), &backend)?;
            let model = match args.quant.quant {
                None => common::with_progress("synthesising", "layers", |p| {
                    Model::from_source(config, &weights, backend, Some(p))
                })?,
                Some(scheme) => common::with_progress("synthesising", "layers", |p| {
                    let src = strix::quant::on_load::QuantizingSource::new(&weights, &config, scheme);
                    Model::from_source(config.clone(), &src, backend, Some(p))
                })?,
            };
            let dtype = args.quant.quant.map_or("bf16".to_string(), |q| q.name().to_string());
            (model, name.clone(), "synthetic", dtype)
        }
        Source::Files(files) => {
            let dtype = match args.quant.quant {
                Some(q) => q.name().to_string(),
                None => checkpoint_dtype(&files, &config),
            };
            let name = files.path().display().to_string();
            let model = crate::quant_flag::load_model(files, backend, args.quant.quant)?;
            (model, name, "checkpoint", dtype)
        }
    };
    args.device.configure(&mut model)?;
    note(format!("{name} loaded on {device_name} in {:.1} s", started.elapsed().as_secs_f64()));
    // Checked before any session is made: the sessions of the largest measurement must fit in
    // what is left, or the run would grow until an allocation or the OOM killer stopped it.
    if let Some(available) = model.backend().available_memory() {
        let (need, what) = plan.largest_sessions(args, |ctx| model.session_bytes(ctx));
        if need as u64 > available {
            let gib = |b: f64| b / (1u64 << 30) as f64;
            bail!(
                "{what} needs {:.2} GiB of KV cache and DeltaNet state, more than the {:.2} GiB of {} \
                 memory available",
                gib(need as f64),
                gib(available as f64),
                model.backend().kind()
            );
        }
    }
    let memory_after_load = model.backend().memory_used();
    let mut peak = PeakMemory::default();
    peak.sample(model.backend());

    let c = &model.config;
    let context = args.prompt_len + args.gen;
    let prompt = pseudo_random_ids(args.prompt_len, c.vocab_size, SEED);

    // Single-stream figures (the headline, decode by context) as `strix run` decodes, batch
    // figures as `strix serve` does: each with the kernels tuned for it.
    let single_kernels = model.backend().tune_for_single_stream(true);
    // The headline. The warm-up faults in every weight page (CPU), starts the thread pool and
    // loads the kernels (CUDA).
    run_once(&model, &prompt[..prompt.len().min(16)], 2, &mut peak)?;
    let mut prefill = Vec::with_capacity(args.repeats);
    let mut decode = Vec::with_capacity(args.repeats);
    let window = PathWindow::open(model.backend());
    for _ in 0..args.repeats {
        let (p, d) = run_once(&model, &prompt, args.gen, &mut peak)?;
        prefill.push(p);
        decode.push(d);
    }
    let headline = Measured { runs: Vec::new(), paths: window.close(model.backend()) };
    let prefill_tok_s = median(&prefill);
    let decode_tok_s = median(&decode);
    note(format!("headline: prefill {prefill_tok_s:.1} tok/s, decode {decode_tok_s:.2} tok/s"));

    let profile = if verbose { op_profile(&model, &prompt, args.gen)? } else { None };

    let bytes_per_token = model.weight_bytes_per_token();
    // Weights are read once per step whatever the batch, so the roofline is per step.
    let roofline_pct =
        |steps_per_s: f64| bandwidth.map(|bw| 100.0 * bytes_per_token as f64 * steps_per_s / (bw * 1e9));

    let mut prefill_sweep = Vec::new();
    for &len in &plan.prompt_lens {
        let m = prefill_runs(&model, len, args.repeats, &mut peak)?;
        note(format!("prefill {len}: {:.1} tok/s", m.median()));
        prefill_sweep.push((len, m));
    }
    let mut decode_sweep = Vec::new();
    for &ctx in &plan.contexts {
        let m = decode_runs(&model, 1, ctx, args.gen, args.repeats, Draw::Greedy, &mut peak)?;
        note(format!("decode at context {ctx}: {:.2} tok/s", m.median()));
        decode_sweep.push((ctx, m));
    }
    let mut sampled_sweep = Vec::new();
    for &ctx in plan.contexts.iter().filter(|_| args.sampled) {
        for draw in [Draw::Prepared, Draw::Temperature, Draw::Host] {
            let m = decode_runs(&model, 1, ctx, args.gen, args.repeats, draw, &mut peak)?;
            note(format!("sampled decode ({draw:?}) at context {ctx}: {:.2} tok/s", m.median()));
            sampled_sweep.push((ctx, draw, m));
        }
    }
    let batch_kernels = model.backend().tune_for_single_stream(false);
    let mut batch_sweep = Vec::new();
    for &batch in &plan.batches {
        let m =
            decode_runs(&model, batch, args.batch_context, args.gen, args.repeats, Draw::Greedy, &mut peak)?;
        note(format!("batch {batch} at context {}: {:.1} tok/s", args.batch_context, m.median()));
        batch_sweep.push((batch, m));
    }
    let mut sampled_batch_sweep = Vec::new();
    for &batch in plan.batches.iter().filter(|_| args.sampled) {
        let m = decode_runs(
            &model,
            batch,
            args.batch_context,
            args.gen,
            args.repeats,
            Draw::Temperature,
            &mut peak,
        )?;
        note(format!("batch {batch}, temperature alone: {:.1} tok/s", m.median()));
        sampled_batch_sweep.push((batch, m));
    }
    peak.sample(model.backend());

    let threads = rayon::current_num_threads();
    let cpu = cpu_name();
    let paths_json = |m: &Measured| m.paths.clone().map(Value::Object);
    let report = json!({
        "machine": {
            "cpu": cpu,
            "threads": threads,
            "logical_cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        },
        "device": {
            "kind": kind,
            "name": device_name,
            "memory_used_bytes": peak.0,
            "memory_after_load_bytes": memory_after_load,
            "memory_total_bytes": model.backend().memory_total(),
        },
        "model": {
            "name": name,
            "source": source_kind,
            "hidden": c.hidden_size,
            "layers": c.num_layers,
            "vocab": c.vocab_size,
            "intermediate": c.intermediate_size,
            "experts": c.moe.map(|m| json!({
                "count": m.num_experts,
                "per_token": m.num_experts_per_tok,
                "intermediate": m.moe_intermediate_size,
                "shared_intermediate": m.shared_expert_intermediate_size,
            })),
            "dtype": dtype,
        },
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "context": context,
        "batch": 1,
        "single_stream_kernels": single_kernels,
        "batch_kernels": batch_kernels,
        "kv_cache": model.backend().kv_cache_type().name(),
        "pass_tokens": model.pass_tokens(),
        "repeats": args.repeats,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
        "prefill_tok_s_runs": prefill,
        "decode_tok_s_runs": decode,
        "weight_bytes_per_token": bytes_per_token,
        "memory_bandwidth_gb_s": bandwidth,
        "bandwidth_method": bandwidth.map(|_| model.backend().bandwidth_method()),
        "decode_roofline_tok_s": bandwidth.map(|bw| bw * 1e9 / bytes_per_token as f64),
        "roofline_pct": roofline_pct(decode_tok_s),
        "prefill": prefill_sweep.iter().map(|(len, m)| json!({
            "prompt_len": len,
            "tok_s": m.median(),
            "runs": m.runs,
            "paths": paths_json(m),
        })).collect::<Vec<_>>(),
        "decode": decode_sweep.iter().map(|(ctx, m)| json!({
            "context": ctx,
            "batch": 1,
            "tok_s": m.median(),
            "ms_per_token": 1e3 / m.median(),
            "roofline_pct": roofline_pct(m.median()),
            "runs": m.runs,
            "paths": paths_json(m),
        })).collect::<Vec<_>>(),
        "sampled": sampled_sweep.iter().map(|(ctx, draw, m)| json!({
            "context": ctx,
            "draw": if *draw == Draw::Host { "host" } else { "device" },
            "sampling": draw.sampling(),
            "tok_s": m.median(),
            "ms_per_token": 1e3 / m.median(),
            "runs": m.runs,
            "paths": paths_json(m),
        })).collect::<Vec<_>>(),
        "batched": batch_sweep.iter().map(|(batch, m)| json!({
            "batch": batch,
            "context": args.batch_context,
            "tok_s": m.median(),
            "ms_per_step": 1e3 * *batch as f64 / m.median(),
            "roofline_pct": roofline_pct(m.median() / *batch as f64),
            "runs": m.runs,
            "paths": paths_json(m),
        })).collect::<Vec<_>>(),
        "batched_sampled": sampled_batch_sweep.iter().map(|(batch, m)| json!({
            "batch": batch,
            "context": args.batch_context,
            "sampling": Draw::Temperature.sampling(),
            "tok_s": m.median(),
            "ms_per_step": 1e3 * *batch as f64 / m.median(),
            "runs": m.runs,
            "paths": paths_json(m),
        })).collect::<Vec<_>>(),
        "headline_paths": paths_json(&headline),
        "op_times": profile.as_ref().map(|p| json!({
            "prefill": op_table_json(&p.prefill, p.prefill_seconds, 1),
            "decode": op_table_json(&p.decode, p.decode_seconds, args.gen),
        })),
        "path_counts": model.backend().path_counts(),
    });
    println!("{report}");

    let row = |k: &str, v: String| eprintln!("  {k:<26} {v}");
    let paths_row = |m: &Measured| {
        if let (true, Some(paths)) = (verbose, &m.paths) {
            row("  kernel paths", path_counts_line(paths));
        }
    };
    eprintln!("strix bench");
    row("device", device_name.clone());
    row("cpu", format!("{cpu} ({threads} thread{})", if threads == 1 { "" } else { "s" }));
    row(
        "model",
        format!(
            "{name} ({source_kind}, {dtype}): hidden {}, {} layers, vocab {}",
            c.hidden_size, c.num_layers, c.vocab_size
        ),
    );
    row("prompt / gen / context", format!("{} / {} / {context}, batch 1", args.prompt_len, args.gen));
    row("KV cache", model.backend().kv_cache_type().name().to_string());
    row("prefill pass", format!("at most {} tokens (--ubatch)", model.pass_tokens()));
    row("prefill", format!("{prefill_tok_s:.1} tok/s (median of {})", args.repeats));
    row("decode", format!("{decode_tok_s:.2} tok/s (median of {})", args.repeats));
    paths_row(&headline);
    if single_kernels != batch_kernels {
        row("kernels", format!("{single_kernels} for one sequence, {batch_kernels} for --batches"));
    }
    row("weights read per token", human_bytes(bytes_per_token as f64));
    match (bandwidth, roofline_pct(decode_tok_s)) {
        (Some(bw), Some(pct)) => {
            row("memory bandwidth", format!("{bw:.1} GB/s ({})", model.backend().bandwidth_method()));
            row("decode roofline", format!("{:.2} tok/s", bw * 1e9 / bytes_per_token as f64));
            row("% of roofline", format!("{pct:.1}%"));
        }
        _ => row("memory bandwidth", "not measured (--bandwidth-mib 0)".to_string()),
    }
    let pct = |p: Option<f64>| p.map_or(String::new(), |p| format!(", {p:.1}% of roofline"));
    for (len, m) in &prefill_sweep {
        row(&format!("prefill {len}"), format!("{:.1} tok/s", m.median()));
        paths_row(m);
    }
    for (ctx, m) in &decode_sweep {
        let t = m.median();
        row(
            &format!("decode at context {ctx}"),
            format!("{t:.2} tok/s, {:.3} ms/token{}", 1e3 / t, pct(roofline_pct(t))),
        );
        paths_row(m);
    }
    for (ctx, draw, m) in &sampled_sweep {
        let t = m.median();
        let place = match draw {
            Draw::Host => "Qwen's sampling, logits copied to the sampler",
            Draw::Temperature => "temperature alone, draw finished by the backend",
            _ => "Qwen's sampling, draw finished by the backend",
        };
        row(&format!("sampled at context {ctx}"), format!("{t:.2} tok/s, {:.3} ms/token ({place})", 1e3 / t));
        paths_row(m);
    }
    for (batch, m) in &batch_sweep {
        let t = m.median();
        let b = *batch as f64;
        row(
            &format!("batch {batch} (context {})", args.batch_context),
            format!("{t:.1} tok/s aggregate, {:.3} ms/step{}", 1e3 * b / t, pct(roofline_pct(t / b))),
        );
        paths_row(m);
    }
    for (batch, m) in &sampled_batch_sweep {
        let t = m.median();
        row(
            &format!("batch {batch}, temperature alone (context {})", args.batch_context),
            format!("{t:.1} tok/s"),
        );
        paths_row(m);
    }
    let memory = match (peak.0, model.backend().memory_total()) {
        (Some(used), Some(total)) => {
            format!("{} of {} (device, total - free)", human_bytes(used as f64), human_bytes(total as f64))
        }
        (Some(used), None) => format!("{} (resident set)", human_bytes(used as f64)),
        _ => "unknown".to_string(),
    };
    row("memory used", memory);
    if let (true, Some(counts)) = (verbose, model.backend().path_counts()) {
        row("kernel paths (all)", path_counts_line(&counts));
    }
    if let Some(p) = &profile {
        print_op_table(&format!("prefill of {} tokens", prompt.len()), &p.prefill, p.prefill_seconds, 1);
        print_op_table(
            &format!("decode, per token (mean of {})", args.gen),
            &p.decode,
            p.decode_seconds,
            args.gen,
        );
    }
    Ok(())
}

/// Per-op wall times of one prefill and the decode steps after it.
struct OpProfile {
    prefill: OpTable,
    prefill_seconds: f64,
    decode: OpTable,
    decode_seconds: f64,
}

/// One more prefill of `prompt` into a fresh session and `gen` greedy decode steps, with the
/// backend's op times read around each phase; `None` where the backend keeps none.
fn op_profile<B: DeviceInfo>(model: &Model<B>, prompt: &[u32], gen: usize) -> Result<Option<OpProfile>> {
    let Some(t0) = model.backend().op_times() else { return Ok(None) };
    let mut session = model.new_session(prompt.len() + gen);
    let start = Instant::now();
    let logits = model.forward(&mut session, prompt, Logits::Last)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let t1 = model.backend().op_times().unwrap_or_default();
    let start = Instant::now();
    let mut next = argmax(&logits);
    for _ in 0..gen {
        next = model.decode_batch_greedy(&mut [&mut session], &[next])?[0];
    }
    let decode_seconds = start.elapsed().as_secs_f64();
    let t2 = model.backend().op_times().unwrap_or_default();
    Ok(Some(OpProfile {
        prefill: strix::backend::cpu::optimes::OpTimes::delta(&t0, &t1),
        prefill_seconds,
        decode: strix::backend::cpu::optimes::OpTimes::delta(&t1, &t2),
        decode_seconds,
    }))
}

/// A table's rows, the most time first.
fn op_rows(table: &OpTable) -> Vec<(String, u64, f64)> {
    let mut rows: Vec<(String, u64, f64)> = table
        .iter()
        .map(|(k, t)| {
            let name = if k.dtype.is_empty() {
                k.op.to_string()
            } else {
                format!("{} {} {}x{}", k.op, k.dtype, k.shape.0, k.shape.1)
            };
            (name, t.calls, t.time.as_secs_f64())
        })
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    rows
}

/// `per` divides the times (decode: per token).
fn op_table_json(table: &OpTable, seconds: f64, per: usize) -> Value {
    let per = per.max(1) as f64;
    json!({
        "wall_ms": 1e3 * seconds / per,
        "ops": op_rows(table).iter().map(|(name, calls, s)| json!({
            "op": name,
            "calls": *calls as f64 / per,
            "ms": 1e3 * s / per,
        })).collect::<Vec<_>>(),
    })
}

fn print_op_table(title: &str, table: &OpTable, seconds: f64, per: usize) {
    let per = per.max(1) as f64;
    let wall = 1e3 * seconds / per;
    eprintln!("  op times, {title}: {wall:.2} ms");
    let mut in_ops = 0.0;
    for (name, calls, s) in op_rows(table) {
        let ms = 1e3 * s / per;
        in_ops += ms;
        eprintln!(
            "    {name:<40} {:>8.1} calls {ms:>10.3} ms {:>6.1}%",
            calls as f64 / per,
            100.0 * ms / wall
        );
    }
    let rest = wall - in_ops;
    eprintln!("    {:<40} {:>14} {rest:>10.3} ms {:>6.1}%", "(outside the ops)", "", 100.0 * rest / wall);
}

/// `1.52 GB`, `345.2 kB`: decimal units, as bandwidth is quoted.
fn human_bytes(n: f64) -> String {
    let units = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB")];
    units
        .iter()
        .find(|(scale, _)| n >= *scale)
        .map_or(format!("{n} B"), |(scale, unit)| format!("{:.2} {unit}", n / scale))
}

/// One prefill of `prompt` into a fresh session and `gen` greedy decode steps; returns the
/// (prefill, decode) speeds in tokens per second.
fn run_once<B: DeviceInfo>(
    model: &Model<B>,
    prompt: &[u32],
    gen: usize,
    peak: &mut PeakMemory,
) -> Result<(f64, f64)> {
    let mut session = model.new_session(prompt.len() + gen);
    let start = Instant::now();
    let logits = model.forward(&mut session, prompt, Logits::Last)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let start = Instant::now();
    // Greedy steps as `strix run --temperature 0` takes them: the token is picked on the
    // device and only its id comes back.
    let mut next = argmax(&logits);
    for _ in 0..gen {
        next = model.decode_batch_greedy(&mut [&mut session], &[next])?[0];
    }
    let decode_seconds = start.elapsed().as_secs_f64();
    peak.sample(model.backend());
    Ok((common::rate(prompt.len(), prefill_seconds), common::rate(gen, decode_seconds)))
}

/// Prefill speeds at `len` tokens, one fresh session per repeat, after an untimed prefill of
/// the same length (the first pass of a shape allocates scratch and picks GEMM algorithms).
fn prefill_runs<B: DeviceInfo>(
    model: &Model<B>,
    len: usize,
    repeats: usize,
    peak: &mut PeakMemory,
) -> Result<Measured> {
    let prompt = pseudo_random_ids(len, model.config.vocab_size, SEED ^ len as u64);
    model.forward(&mut model.new_session(len), &prompt, Logits::Last)?;
    let window = PathWindow::open(model.backend());
    let mut runs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let mut session = model.new_session(len);
        let start = Instant::now();
        model.forward(&mut session, &prompt, Logits::Last)?;
        runs.push(common::rate(len, start.elapsed().as_secs_f64()));
        peak.sample(model.backend());
    }
    Ok(Measured { runs, paths: window.close(model.backend()) })
}

/// Aggregate decode speeds of `batch` sequences, each prefilled (untimed) with `context`
/// pseudo-random tokens of its own, then stepped greedily together: `repeats` timed runs of
/// `gen` steps after [`WARM_STEPS`] untimed ones, through `Model::decode_batch_greedy`.
/// How a decode measurement picks its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Draw {
    /// Greedy, on the device (`strix run --temperature 0`).
    Greedy,
    /// Qwen's sampling, the draw finished next to the logits (`Model::decode_batch_prepared`).
    Prepared,
    /// Temperature alone over the whole vocabulary, finished next to the logits.
    Temperature,
    /// Qwen's sampling, the logits copied to the host and drawn there (`Model::decode_batch`).
    Host,
}

impl Draw {
    /// The sampling of a sampled measurement, seeded: Qwen3.5's `generation_config.json`, or
    /// temperature 0.7 alone. Greedy has none.
    fn sampling(self) -> SamplingParams {
        match self {
            Draw::Temperature => {
                SamplingParams { temperature: 0.7, seed: Some(SEED), ..SamplingParams::default() }
            }
            _ => SamplingParams {
                temperature: 0.6,
                top_k: 20,
                top_p: 0.95,
                seed: Some(SEED),
                ..SamplingParams::default()
            },
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn decode_runs<B: DeviceInfo>(
    model: &Model<B>,
    batch: usize,
    context: usize,
    gen: usize,
    repeats: usize,
    draw: Draw,
    peak: &mut PeakMemory,
) -> Result<Measured> {
    let vocab = model.config.vocab_size;
    let capacity = context + WARM_STEPS + repeats * gen;
    let mut sessions: Vec<Session<B>> = (0..batch).map(|_| model.new_session(capacity)).collect();
    let mut next = Vec::with_capacity(batch);
    for (i, session) in sessions.iter_mut().enumerate() {
        let prompt = pseudo_random_ids(context, vocab, SEED ^ ((i as u64 + 1) << 32) ^ context as u64);
        next.push(argmax(&model.forward(session, &prompt, Logits::Last)?));
    }
    let mut refs: Vec<&mut Session<B>> = sessions.iter_mut().collect();
    let mut samplers: Vec<Sampler> =
        (0..batch).map(|_| Sampler::new(draw.sampling())).collect::<strix::Result<_>>()?;
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut step = |tokens: &[u32]| -> Result<Vec<u32>> {
        let ids = match draw {
            Draw::Greedy => model.decode_batch_greedy(&mut refs, tokens)?,
            Draw::Prepared | Draw::Temperature => {
                let rows: Vec<_> =
                    samplers.iter_mut().zip(&generated).map(|(s, g)| s.prepare(&[], g, None)).collect();
                let draws = model.decode_batch_prepared(&mut refs, tokens, rows)?;
                draws.into_iter().map(|d| d.map(|d| d.token)).collect::<Result<_, _>>()?
            }
            Draw::Host => {
                let mut logits = model.decode_batch(&mut refs, tokens)?;
                samplers
                    .iter_mut()
                    .zip(logits.chunks_mut(vocab))
                    .zip(&generated)
                    .map(|((s, row), g)| s.sample(row, &[], g))
                    .collect()
            }
        };
        for (g, &id) in generated.iter_mut().zip(&ids) {
            g.push(id);
        }
        Ok(ids)
    };
    for _ in 0..WARM_STEPS {
        next = step(&next)?;
    }
    let window = PathWindow::open(model.backend());
    let mut runs = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        for _ in 0..gen {
            next = step(&next)?;
        }
        runs.push(common::rate(batch * gen, start.elapsed().as_secs_f64()));
    }
    let paths = window.close(model.backend());
    peak.sample(model.backend());
    Ok(Measured { runs, paths })
}

fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
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
fn pseudo_random_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// The CPU's name from /proc/cpuinfo (x86's `model name`, else ARM's `Hardware`/`Model`).
pub(crate) fn cpu_name() -> String {
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
/// A GGUF file's main type: that of layer 0's `ffn_gate` (Q4_K_M promotes some `ffn_down`
/// matrices to Q6_K, never `ffn_gate`).
fn gguf_dtype(file: &strix::gguf::GgufFile) -> Result<String> {
    let info = ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight"]
        .into_iter()
        .find_map(|n| file.tensor_info(n).ok())
        .ok_or_else(|| anyhow!("no layer 0 MLP weight"))?;
    Ok(info.ty.name().to_ascii_lowercase())
}

fn checkpoint_dtype(files: &strix::model::ModelFiles, c: &ModelConfig) -> String {
    let dir = match files {
        strix::model::ModelFiles::Gguf(g) => {
            return gguf_dtype(g.file()).unwrap_or_else(|_| "unknown".to_string())
        }
        strix::model::ModelFiles::Directory(dir) => dir,
    };
    let dtype = || -> Result<String> {
        let ckpt = Checkpoint::open_dir(dir)?;
        // The dense MLP's down_proj, or a MoE model's shared expert's.
        let (mlp, width) = match c.moe {
            None => ("mlp.down_proj.weight", c.intermediate_size),
            Some(m) => ("mlp.shared_expert.down_proj.weight", m.shared_expert_intermediate_size),
        };
        let name = ["model.language_model.layers.0.", "model.layers.0."]
            .into_iter()
            .map(|p| format!("{p}{mlp}"))
            .find(|n| ckpt.contains(n))
            .ok_or_else(|| anyhow!("no layer 0 MLP weight"))?;
        Ok(ckpt.tensor(&name, &[c.hidden_size, width])?.dtype.name().to_ascii_lowercase())
    };
    dtype().unwrap_or_else(|_| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn prompt_ids_stay_in_the_vocabulary() {
        let ids = pseudo_random_ids(1000, 384, SEED);
        assert!(ids.iter().all(|&id| id < 384));
        assert!(ids.iter().collect::<std::collections::HashSet<_>>().len() > 200);
        assert_ne!(ids, pseudo_random_ids(1000, 384, SEED ^ 1));
    }

    fn parse(args: &[&str]) -> BenchArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let argv = ["bench", "--preset", "qwen3.5-0.8b"].iter().chain(args);
        <Cli as clap::Parser>::parse_from(argv).bench
    }

    #[test]
    fn sweeps_default_to_the_issue_set_on_cuda_within_the_model_context() {
        let args = parse(&[]);
        let plan = Plan::new(&args, true, 262_144);
        assert_eq!(
            (plan.prompt_lens, plan.contexts, plan.batches),
            (vec![512, 4096], vec![128, 4096], vec![1, 16, 64])
        );
        // A 1024-position model drops the defaults it cannot hold.
        let plan = Plan::new(&args, true, 1024);
        assert_eq!((plan.prompt_lens, plan.contexts), (vec![512], vec![128]));
        let plan = Plan::new(&args, false, 262_144);
        assert!(plan.prompt_lens.is_empty() && plan.contexts.is_empty() && plan.batches.is_empty());
        // Given lists are kept as given, on any device; `none` turns a sweep off.
        let args = parse(&["--prompt-lens", "2000", "--contexts", "none", "--batches", "2"]);
        let plan = Plan::new(&args, true, 1024);
        assert_eq!(
            (plan.prompt_lens.clone(), plan.contexts.clone(), plan.batches.clone()),
            (vec![2000], vec![], vec![2])
        );
        assert_eq!(plan.longest_context(&args), 2000);
    }

    #[test]
    fn the_largest_measurement_is_found_for_the_memory_check() {
        let args = parse(&["--prompt-len", "8", "--gen", "2", "--repeats", "1", "--batch-context", "10"]);
        let per_token = |ctx: usize| 100 * ctx;
        let plan = Plan { prompt_lens: vec![50], contexts: vec![], batches: vec![] };
        assert_eq!(plan.largest_sessions(&args, per_token), (5000, "--prompt-lens 50".to_string()));
        // A batch multiplies its sessions: 64 x (10 + 2 warm + 2) tokens.
        let plan = Plan { prompt_lens: vec![50], contexts: vec![20], batches: vec![1, 64] };
        let (bytes, what) = plan.largest_sessions(&args, per_token);
        assert_eq!(bytes, 64 * 100 * 14);
        assert!(what.starts_with("--batches 64"), "{what}");
    }

    #[test]
    fn size_lists_parse_within_their_bounds() {
        assert_eq!(token_list("512, 4096").unwrap(), SizeList(vec![512, 4096]));
        assert_eq!(token_list("none").unwrap(), SizeList(vec![]));
        assert_eq!(token_list("").unwrap(), SizeList(vec![]));
        assert!(token_list("1,0").unwrap_err().contains("`0`: must be at least 1"));
        assert!(token_list("1,x").is_err());
        assert!(token_list("-5").unwrap_err().contains("at least 1"));
        assert!(token_list("18446744073709551615").unwrap_err().contains("at most"));
        assert_eq!(batch_list("1,16,64").unwrap(), SizeList(vec![1, 16, 64]));
        assert!(batch_list("100000").unwrap_err().contains("at most 1024"));
    }
}
