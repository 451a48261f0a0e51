//! Batch-1 decode speed of the CUDA backend on synthetic bf16 weights in the published shapes:
//! measures the device's copy bandwidth, then per preset a 128-token prefill and single-token
//! decode steps (`Model::forward(.., Logits::Last)`, so each step includes copying the logits
//! to the host), and prints tok/s and % of roofline
//! (= weight bytes per token × tok/s / measured bandwidth).
//!
//! `cargo run --release --example cuda_decode_bench -- [PRESET ...] [--steps N]`
//! (default presets: qwen3.5-0.8b qwen3.5-9b). With `STRIX_PROFILE_STEPS=n`, n more decode
//! steps run inside a profiler range, for `ncu --profile-from-start off`: one sequence's, or
//! with `--profile-batch B` decode steps of B sessions at once (`Model::decode_batch_greedy`,
//! the server's kernels); `--profile-prefill N` adds one N-token prefill of a fresh session
//! (`Model::prefill`, as the server feeds a prompt before its last piece) to the range.
//! `--quant SCHEME` (q8_0, q4_0, q4_k) quantizes the weights on load, as `strix --quant` does.
//! A path to a model file (GGUF) in place of a preset loads that file's weights as they are
//! (for example one `strix quantize --preset` wrote, without quantizing again).
//! `--batches 1,16,64` measures only decode batches of those sizes (`Model::decode_batch_greedy`
//! on sessions at context 128, as `strix bench` does), with packed weights once per tensor-core
//! arithmetic the device has (`PackedMma`; `--kinds int8,bf16` picks), and prints
//! aggregate tok/s.
//!
//! Then a breakdown: every op of a decode step at the preset's shapes, each launched many
//! times back to back, its time per call (the larger of the GPU's time and the host's time to
//! queue it, as in a real step) times its calls per step; the sum against the measured step
//! says how much of the step is host overhead and which kernels to work on (dense models
//! only: a MoE block's kernels are not modelled).

#[path = "common/bench.rs"]
mod bench;
#[path = "common/gpu.rs"]
mod gpu;

use std::time::Instant;

use bench::median;
use strix::backend::cuda::CudaBackend;
use strix::backend::{
    AttentionInput, AttentionLayer, Backend, DeltaRuleInput, DeltaRuleMode, KvCache, RmsNorm,
};
use strix::config::{LayerKind, ModelConfig};
use strix::model::{attention_shape, deltanet_shape, rope_inv_freq, Logits, Model};
use strix::quant::QuantType;
use strix::sampling::argmax;
use strix::synthetic::{preset, SyntheticWeights};
use strix::tensor::DType;

const PROMPT: usize = 128;
const WARMUP: usize = 5;

struct Row {
    preset: String,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    step_ms: f64,
    weight_gb: f64,
    roofline: f64,
}

fn main() -> strix::Result<()> {
    let mut presets = Vec::new();
    let mut steps = 64usize;
    let (mut profile_batch, mut profile_prefill) = (1usize, 0usize);
    let mut quant: Option<strix::quant::on_load::QuantScheme> = None;
    let mut batches: Vec<usize> = Vec::new();
    let mut kinds: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--steps" {
            steps = args.next().and_then(|s| s.parse().ok()).expect("--steps N");
        } else if a == "--profile-batch" {
            profile_batch = args.next().and_then(|s| s.parse().ok()).expect("--profile-batch B");
        } else if a == "--profile-prefill" {
            profile_prefill = args.next().and_then(|s| s.parse().ok()).expect("--profile-prefill N");
        } else if a == "--batches" {
            let list = args.next().expect("--batches B,..");
            batches = list.split(',').map(|b| b.parse().expect("--batches: numbers")).collect();
        } else if a == "--kinds" {
            kinds = Some(args.next().expect("--kinds int8,bf16"));
        } else if a == "--quant" {
            quant = Some(args.next().expect("--quant SCHEME").parse()?);
        } else {
            presets.push(a);
        }
    }
    if presets.is_empty() {
        presets = vec!["qwen3.5-0.8b".into(), "qwen3.5-9b".into()];
    }

    let probe = gpu::backend()?;
    println!(
        "device: {} (sm_{}{})",
        probe.device_name(),
        probe.compute_capability().0,
        probe.compute_capability().1
    );
    println!("kernel modules: {}", probe.path_counts());
    let bandwidth = probe.measure_copy_bandwidth(2 << 30, 20)?;
    println!("device-to-device copy bandwidth (read + write): {:.0} GB/s", bandwidth / 1e9);
    drop(probe);

    let mut rows = Vec::new();
    for name in &presets {
        let t0 = Instant::now();
        // Whether the weights are packed: quantized on load, or stored so in a model file.
        let mut packed = quant.is_some();
        let model = if std::path::Path::new(name).is_file() {
            // A model file (GGUF) as it is: its own weight types, no quantizing on load.
            let files = strix::model::ModelFiles::open(std::path::Path::new(name))?;
            let float = |ty| matches!(ty, QuantType::F32 | QuantType::F16 | QuantType::BF16);
            packed = files.gguf().is_some_and(|g| g.file().tensors().iter().any(|t| !float(t.ty)));
            Model::load_files(files, gpu::backend()?, None)?
        } else {
            let cfg = preset(name)?;
            let weights = SyntheticWeights::new(cfg.clone(), 1);
            match quant {
                None => Model::from_source(cfg.clone(), &weights, gpu::backend()?, None)?,
                Some(scheme) => {
                    let src = strix::quant::on_load::QuantizingSource::new(&weights, &cfg, scheme);
                    Model::from_source(cfg.clone(), &src, gpu::backend()?, None)?
                }
            }
        };
        let cfg = model.config.clone();
        let bytes = model.weight_bytes_per_token();
        println!(
            "{name}: weights on the device in {:.1} s; {:.2} GB of weights read per token",
            t0.elapsed().as_secs_f64(),
            bytes as f64 / 1e9
        );

        if !batches.is_empty() {
            batch_sweep(name, &model, &batches, packed, kinds.as_deref())?;
            continue;
        }
        let mut session = model.new_session(PROMPT + WARMUP + steps + 8);
        let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7919 + 13) % cfg.vocab_size as u32).collect();
        // One untimed prefill in a throwaway session warms cuBLAS's heuristics and the pool.
        model.forward(&mut model.new_session(PROMPT + 1), &prompt, Logits::Last)?;
        let t = Instant::now();
        let logits = model.forward(&mut session, &prompt, Logits::Last)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut next = argmax(&logits);

        model.backend().reset_path_counts();
        let mut times = Vec::with_capacity(steps);
        for i in 0..WARMUP + steps {
            let t = Instant::now();
            let logits = model.forward(&mut session, &[next], Logits::Last)?;
            if i >= WARMUP {
                times.push(t.elapsed().as_secs_f64());
            }
            next = argmax(&logits);
        }
        let step = median(&times);
        let profile_steps: usize =
            std::env::var("STRIX_PROFILE_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        if profile_steps > 0 && profile_batch > 1 {
            // B sessions with the prompt, two unprofiled steps (the second records the graph).
            let mut batch: Vec<_> =
                (0..profile_batch).map(|_| model.new_session(PROMPT + profile_steps + 4)).collect();
            for s in &mut batch {
                model.prefill(s, &prompt)?;
            }
            let mut tokens = vec![next; profile_batch];
            for _ in 0..2 {
                tokens = model.decode_batch_greedy(&mut batch.iter_mut().collect::<Vec<_>>(), &tokens)?;
            }
            model.backend().profiler_range(true)?;
            for _ in 0..profile_steps {
                tokens = model.decode_batch_greedy(&mut batch.iter_mut().collect::<Vec<_>>(), &tokens)?;
            }
            model.backend().profiler_range(false)?;
        } else if profile_steps > 0 {
            model.backend().profiler_range(true)?;
            for _ in 0..profile_steps {
                next = argmax(&model.forward(&mut session, &[next], Logits::Last)?);
            }
            model.backend().profiler_range(false)?;
        }
        if profile_prefill > 0 {
            let ids: Vec<u32> =
                (0..profile_prefill as u32).map(|i| (i * 104_729 + 7) % cfg.vocab_size as u32).collect();
            let mut warm = model.new_session(profile_prefill + 1);
            model.prefill(&mut warm, &ids)?;
            let mut fresh = model.new_session(profile_prefill + 1);
            model.backend().profiler_range(true)?;
            model.prefill(&mut fresh, &ids)?;
            model.backend().profiler_range(false)?;
        }
        // The host copy of the logits is part of every step (on-device sampling will remove it).
        let logits_buf = model.backend().zeros(cfg.vocab_size);
        let copies: Vec<f64> = (0..20)
            .map(|_| {
                let t = Instant::now();
                let _ = model.backend().download(&logits_buf, 0, cfg.vocab_size);
                t.elapsed().as_secs_f64()
            })
            .collect();
        println!(
            "{name}: copying the {} logits to the host takes {:.0} us",
            cfg.vocab_size,
            median(&copies) * 1e6
        );
        let tok_s = 1.0 / step;
        let roofline = bytes as f64 * tok_s / bandwidth;
        println!("{name}: decode paths over {} steps: {}", WARMUP + steps, model.backend().path_counts());
        println!(
            "{name}: prefill {PROMPT} tokens {:.1} ms ({:.0} tok/s); decode median {:.3} ms/token = {:.1} tok/s = {:.1} % of roofline",
            prefill_s * 1e3,
            PROMPT as f64 / prefill_s,
            step * 1e3,
            tok_s,
            roofline * 100.0
        );
        // The breakdown times a dense layer's ops; a MoE block's kernels are not among them
        // (profile its steps with STRIX_PROFILE_STEPS and ncu instead).
        if cfg.moe.is_some() {
            println!("{name}: no breakdown (it models dense MLPs, not MoE blocks)");
        } else {
            print_breakdown(name, &breakdown(&cfg, model.backend(), PROMPT + WARMUP + steps)?, step);
        }
        rows.push(Row {
            preset: name.clone(),
            prefill_tok_s: PROMPT as f64 / prefill_s,
            decode_tok_s: tok_s,
            step_ms: step * 1e3,
            weight_gb: bytes as f64 / 1e9,
            roofline,
        });
    }

    println!();
    println!("bandwidth {:.0} GB/s (d2d copy, read + write)", bandwidth / 1e9);
    println!("| preset | weights/token GB | prefill {PROMPT} tok/s | decode ms/token | decode tok/s | % roofline |");
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.0} | {:.3} | {:.1} | {:.1} |",
            r.preset,
            r.weight_gb,
            r.prefill_tok_s,
            r.step_ms,
            r.decode_tok_s,
            r.roofline * 100.0
        );
    }
    Ok(())
}

struct Op {
    name: &'static str,
    shape: String,
    calls: usize,
    secs: f64,
    /// Weight bytes read per call (matmuls), for GB/s.
    bytes: usize,
}

/// Seconds per call of `f`, launched `reps` times back to back after a warm-up.
fn per_call(b: &CudaBackend, reps: usize, mut f: impl FnMut()) -> strix::Result<f64> {
    f();
    b.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    b.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

/// The breakdown's table, and its sum against the measured step.
fn print_breakdown(name: &str, ops: &[Op], step: f64) {
    println!("{name}: breakdown of a decode step (each op timed alone, back to back):");
    println!("| op | shape | calls/step | us/call | us/step | GB/s |");
    println!("|---|---|---|---|---|---|");
    let mut total = 0.0;
    for op in ops {
        let gbs =
            if op.bytes > 0 { format!("{:.0}", op.bytes as f64 / op.secs / 1e9) } else { String::new() };
        println!(
            "| {} | {} | {} | {:.2} | {:.1} | {gbs} |",
            op.name,
            op.shape,
            op.calls,
            op.secs * 1e6,
            op.secs * 1e6 * op.calls as f64
        );
        total += op.secs * op.calls as f64;
    }
    println!("{name}: ops sum to {:.3} ms per step against {:.3} ms measured", total * 1e3, step * 1e3);
}

/// Every op of one decode step at the shapes of `c`, timed alone; `context` is the attention
/// length.
fn breakdown(c: &ModelConfig, b: &CudaBackend, context: usize) -> strix::Result<Vec<Op>> {
    const REPS: usize = 200;
    let (h, inter, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let dn = deltanet_shape(c);
    let at = attention_shape(c);
    let n_gdn = c.layer_kinds.iter().filter(|k| **k == LayerKind::DeltaNet).count();
    let n_att = c.num_layers - n_gdn;
    let q_dim = at.num_heads * at.head_dim;
    let mut ops = Vec::new();

    // Matmuls, one weight per distinct shape.
    let mats: Vec<(&'static str, usize, usize, usize)> = vec![
        ("matmul gdn qkv", dn.conv_dim(), h, n_gdn),
        ("matmul gdn z", dn.value_dim(), h, n_gdn),
        ("matmul gdn a, b", dn.num_v_heads, h, 2 * n_gdn),
        ("matmul gdn out", h, dn.value_dim(), n_gdn),
        ("matmul attn q+gate", 2 * q_dim, h, n_att),
        ("matmul attn k, v", at.kv_dim(), h, 2 * n_att),
        ("matmul attn o", h, q_dim, n_att),
        ("matmul mlp gate, up", inter, h, 2 * c.num_layers),
        ("matmul mlp down", h, inter, c.num_layers),
        ("matmul lm_head", vocab, h, 1),
    ];
    for (i, &(name, rows, cols, calls)) in mats.iter().enumerate() {
        let w = gpu::random_weight(b, DType::BF16, rows, cols, i as u64 + 1)?;
        let x = b.upload(&vec![0.5; cols]);
        let mut out = b.zeros(rows);
        let secs = per_call(b, REPS, || b.matmul(&x, 1, &w, &mut out))?;
        ops.push(Op { name, shape: format!("{rows}x{cols}"), calls, secs, bytes: rows * cols * 2 });
    }

    let ones = |n: usize| b.upload(&vec![0.25; n]);
    let (mut res, x, w) = (ones(h), ones(h), ones(h));
    let mut out = b.zeros(h);
    let secs = per_call(b, REPS, || {
        b.add_rms_norm(&mut res, &x, RmsNorm { weight: &w, dim: h, eps: 1e-6 }, &mut out)
    })?;
    ops.push(Op { name: "add_rms_norm", shape: format!("{h}"), calls: 2 * c.num_layers, secs, bytes: 0 });
    let (g, u) = (ones(inter), ones(inter));
    let mut act = b.zeros(inter);
    let secs = per_call(b, REPS, || b.swiglu(&g, &u, inter, &mut act))?;
    ops.push(Op { name: "swiglu", shape: format!("{inter}"), calls: c.num_layers, secs, bytes: 0 });

    if n_gdn > 0 {
        let mut qkv = ones(dn.conv_dim());
        let conv_w = ones(dn.conv_dim() * dn.conv_kernel);
        let mut conv_state = b.zeros(dn.conv_state_len());
        let secs = per_call(b, REPS, || b.causal_conv1d_silu(&dn, &mut qkv, 1, &conv_w, &mut conv_state))?;
        ops.push(Op {
            name: "conv1d+silu",
            shape: format!("{}", dn.conv_dim()),
            calls: n_gdn,
            secs,
            bytes: 0,
        });
        let (a, bb, a_log, dt) =
            (ones(dn.num_v_heads), ones(dn.num_v_heads), ones(dn.num_v_heads), ones(dn.num_v_heads));
        let mut state = b.zeros(dn.state_len());
        let mut core = b.zeros(dn.value_dim());
        let secs = per_call(b, REPS, || {
            b.gated_delta_rule(
                &dn,
                DeltaRuleMode::Recurrent,
                DeltaRuleInput { qkv: &qkv, a: &a, b: &bb, a_log: &a_log, dt_bias: &dt },
                1,
                &mut state,
                &mut core,
            )
        })?;
        let shape = format!("{}x{}x{}", dn.num_v_heads, dn.k_head_dim, dn.v_head_dim);
        ops.push(Op { name: "gated delta rule", shape, calls: n_gdn, secs, bytes: 0 });
        let (z, nw) = (ones(dn.value_dim()), ones(dn.v_head_dim));
        let secs = per_call(b, REPS, || {
            b.gated_rms_norm(
                &mut core,
                &z,
                RmsNorm { weight: &nw, dim: dn.v_head_dim, eps: 1e-6 },
                dn.num_v_heads,
            )
        })?;
        let shape = format!("{}x{}", dn.num_v_heads, dn.v_head_dim);
        ops.push(Op { name: "gated_rms_norm", shape, calls: n_gdn, secs, bytes: 0 });
    }
    if n_att > 0 {
        let qg = ones(2 * q_dim);
        let (mut k, v) = (ones(at.kv_dim()), ones(at.kv_dim()));
        let (qn, kn) = (ones(at.head_dim), ones(at.head_dim));
        let inv_freq = b.upload(&rope_inv_freq(c));
        let (mut q, mut gate) = (b.zeros(q_dim), b.zeros(q_dim));
        let positions = [context];
        let secs = per_call(b, REPS, || {
            b.attention_prologue(
                AttentionLayer { shape: at, q_norm: &qn, k_norm: &kn, inv_freq: &inv_freq },
                &qg,
                &mut k,
                &positions,
                &mut q,
                &mut gate,
            )
        })?;
        ops.push(Op { name: "attention prologue", shape: String::new(), calls: n_att, secs, bytes: 0 });
        // Caches in the backend's default type (bf16).
        let cache = |n: usize| b.cache_upload(&vec![1.0; n]);
        let (mut kc, mut vc) = (cache((context + 1) * at.kv_dim()), cache((context + 1) * at.kv_dim()));
        let mut o = b.zeros(q_dim);
        let input = AttentionInput { q: &q, k: &k, v: &v, gate: &gate };
        let secs = per_call(b, REPS, || {
            b.attention(&at, input, KvCache { k: &mut kc, v: &mut vc }, context, 1, &mut o)
        })?;
        let shape = format!("ctx {}", context + 1);
        ops.push(Op { name: "attention", shape, calls: n_att, secs, bytes: 0 });
        // For reference (not part of this step): the same at a 4096-token context.
        let long = 4096;
        let (mut kc, mut vc) = (cache((long + 1) * at.kv_dim()), cache((long + 1) * at.kv_dim()));
        let secs = per_call(b, REPS, || {
            b.attention(&at, input, KvCache { k: &mut kc, v: &mut vc }, long, 1, &mut o)
        })?;
        ops.push(Op {
            name: "attention (reference only)",
            shape: format!("ctx {}", long + 1),
            calls: 0,
            secs,
            bytes: 0,
        });
    }

    // The scratch the model allocates per step (`zeros`: a pool allocation and a memset).
    // forward_pass: h, x, y and three MLP buffers; per DeltaNet layer qkv, z, a, b, core; per
    // attention layer q+gate, k, v, q, gate, out; the last row and the logits.
    let scratch_per_step = 6 + 5 * n_gdn + 6 * n_att + 2;
    let secs = per_call(b, REPS, || drop(b.zeros(h)))?;
    ops.push(Op {
        name: "zeros (alloc+memset+free)",
        shape: format!("{h}"),
        calls: scratch_per_step,
        secs,
        bytes: 0,
    });
    let logits = b.zeros(vocab);
    let secs = per_call(b, 20, || drop(b.download(&logits, 0, vocab)))?;
    ops.push(Op { name: "download logits", shape: format!("{vocab}"), calls: 1, secs, bytes: 0 });
    let embed = gpu::random_weight(b, DType::BF16, 1024, h, 99)?;
    let mut e = b.zeros(h);
    let secs = per_call(b, REPS, || b.embed(&embed, &[7], h, &mut e))?;
    ops.push(Op { name: "embed", shape: format!("{h}"), calls: 1, secs, bytes: 0 });
    Ok(ops)
}

/// `--batches`: aggregate decode tok/s at each batch size, per packed arithmetic.
fn batch_sweep(
    name: &str,
    model: &Model<strix::backend::cuda::CudaBackend>,
    batches: &[usize],
    packed: bool,
    only: Option<&str>,
) -> strix::Result<()> {
    use strix::backend::cuda::PackedMma;
    const STEPS: usize = 32;
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let kinds: Vec<PackedMma> = if packed {
        [PackedMma::Int8, PackedMma::Bf16]
            .into_iter()
            .filter(|&m| model.backend().set_packed_mma(m))
            .filter(|m| {
                let name = match m {
                    PackedMma::Int8 => "int8",
                    PackedMma::Bf16 => "bf16",
                };
                only.is_none_or(|o| o.split(',').any(|k| k == name))
            })
            .collect()
    } else {
        vec![PackedMma::Int8]
    };
    for kind in kinds {
        assert!(model.backend().set_packed_mma(kind));
        for &b in batches {
            let mut sessions: Vec<_> = (0..b).map(|_| model.new_session(PROMPT + STEPS + 8)).collect();
            for s in &mut sessions {
                model.prefill(s, &prompt)?;
            }
            let mut tokens = vec![prompt[0]; b];
            // Two unmeasured steps: the second records the decode graph.
            for _ in 0..2 {
                tokens = model.decode_batch_greedy(&mut sessions.iter_mut().collect::<Vec<_>>(), &tokens)?;
            }
            let t = Instant::now();
            for _ in 0..STEPS {
                tokens = model.decode_batch_greedy(&mut sessions.iter_mut().collect::<Vec<_>>(), &tokens)?;
            }
            let secs = t.elapsed().as_secs_f64();
            println!(
                "{name} {kind:?} batch {b}: {:.2} ms/step, {:.1} tok/s",
                secs / STEPS as f64 * 1e3,
                (b * STEPS) as f64 / secs
            );
        }
    }
    Ok(())
}
