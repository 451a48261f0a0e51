//! Bandwidth of the CUDA decode GEMVs on packed weights (Q8_0, Q4_0, Q4_K, Q6_K, and bf16 for
//! comparison) at the Qwen3.5-9B and 0.8B shapes: measures the device's copy bandwidth (read +
//! write), then per format and matrix (or fused projection set, one launch as the model makes
//! it) times a decode GEMV (`matmul_rows` / `matmul_many`, as a decode step calls it,
//! activation quantization included) at batch 1, 16 and 64 on the dp4a GEMVs, then on the
//! tensor-core GEMV (`tc`, the server's), and prints µs per call, GB/s of weight bytes read,
//! the % of the measured bandwidth and the multiply-add rate (Tops = 2 · rows · cols · tokens).
//!
//! `cargo run --release --example cuda_quant_bench -- [--quick] [--bf16] [--variants] [--eager] [--prefill]`
//! `cargo run --release --example cuda_quant_bench -- --decode q4_0[,q8_0,q4_k,...] [--preset qwen3.5-9b]`
//!
//! `--decode SCHEMES`: instead, whole decode steps (batch 1, recorded graphs, greedy on the
//! device, as `strix bench` decodes at context 128) of the preset's random weights quantized on
//! load by each scheme, with the packed GEMVs reading activations quantized by their producer
//! (the norms, the gate/up GEMV with the SwiGLU, the delta rule), the same without the delta
//! rule's, and with the separate `quantize_x` before every GEMV, alternating the three on one
//! loaded model (synthesised once) so the comparison shares machine and
//! weights; prints tok/s of each round and the medians. The scheme `bf16` keeps the weights
//! unquantized (the two modes then run the same kernels). `STRIX_PROFILE_STEPS=n` then runs n
//! more steps inside a profiler range (`ncu --profile-from-start off`). `--wait FILE`: after loading, wait
//! until FILE exists before timing (so a run can synthesise its weights while other GPU work
//! finishes, and time alone).
//!
//! Calls are recorded into a CUDA graph (as a decode step is: launches chained by programmatic
//! dependent launch) and the graph is replayed, so the figures are what a decode step sees,
//! without the host's launch overhead; `--eager` adds the calls timed back to back on the host.
//! `--variants` times the one-token GEMV also with 1, 2 and 4 rows a warp forced (by default the
//! launcher picks per shape). `--quick`: the 9B shapes only. `--bf16` adds bf16 weights (the
//! bf16 GEMVs) for comparison. `--prefill` adds the prefill path (dequantize + cuBLAS) at 512
//! tokens, in TFLOP/s.
//!
//! The weights are random blocks (any byte pattern is a valid block; scales are set to small
//! finite values), in enough copies to rotate through several times the L2 cache, so every
//! call streams its weights from device memory.

#[path = "common/bench.rs"]
mod bench;
#[path = "common/gpu.rs"]
mod gpu;

use std::time::Instant;

use bench::{fixed_values, median, median_of_rounds, splitmix};
use strix::backend::cuda::{set_qgemv_rows, CudaBackend, CudaBuf, CudaWeight};
use strix::backend::Backend;
use strix::tensor::DType;

/// A GEMV launch of the model: the rows of each matrix that reads the same x, and the width.
const CASES: [(&str, &[usize], usize); 12] = [
    ("9B gate/up fused 2x12288x4096", &[12288, 12288], 4096),
    ("9B gdn in_proj fused 4096->8192+4096+32+32", &[8192, 4096, 32, 32], 4096),
    ("9B down 4096x12288", &[4096], 12288),
    ("9B out 4096x4096", &[4096], 4096),
    ("9B gate 12288x4096", &[12288], 4096),
    ("9B lm_head 248320x4096", &[248320], 4096),
    ("0.8B gate/up fused 2x3584x1024", &[3584, 3584], 1024),
    ("0.8B gdn in_proj fused 1024->6144+2048+16+16", &[6144, 2048, 16, 16], 1024),
    ("0.8B down 1024x3584", &[1024], 3584),
    ("0.8B out 1024x2048", &[1024], 2048),
    ("0.8B lm_head 248320x1024", &[248320], 1024),
    // The fixed cost of a call: activation quantization, the launches, one memory round trip.
    ("probe 32x4096", &[32], 4096),
];

/// Bytes of weights the timed loop rotates through (several times the H200's 50 MB L2).
const ROTATE_BYTES: usize = 512 << 20;

/// One weight set (the matrices of one launch) per copy.
type Sets = Vec<Vec<CudaWeight>>;

/// Issues the launch of `set` for `tokens` tokens as a decode step does: one matrix through
/// `matmul_rows`, several through `matmul_many`.
fn call(g: &CudaBackend, x: &CudaBuf, tokens: usize, set: &[CudaWeight], outs: &mut [CudaBuf]) {
    if set.len() == 1 {
        g.matmul_rows(x, tokens, &set[0], &mut outs[0]);
    } else {
        let ws: Vec<&CudaWeight> = set.iter().collect();
        let mut os: Vec<&mut CudaBuf> = outs.iter_mut().collect();
        g.matmul_many(x, tokens, &ws, &mut os, true);
    }
}

/// Seconds per call: every copy's launch recorded into one graph (a decode step of its own,
/// under `key`), replayed `reps` times a round.
fn time_graph(
    g: &CudaBackend,
    key: u64,
    sets: &Sets,
    x: &CudaBuf,
    tokens: usize,
    outs: &mut [CudaBuf],
    reps: usize,
) -> f64 {
    let mut step = || {
        for set in sets {
            call(g, x, tokens, set, outs);
        }
        g.scratch(1)
    };
    let mut run = || g.decode_step(key, &[0], &[0], &mut step, &mut |_| {});
    // First sight runs eagerly, the second records.
    run();
    run();
    g.synchronize().unwrap();
    median_of_rounds(|| {
        let t = Instant::now();
        for _ in 0..reps {
            run();
        }
        g.synchronize().unwrap();
        t.elapsed().as_secs_f64() / (reps * sets.len()) as f64
    })
}

/// Seconds per call, the calls issued back to back on the host.
fn time_eager(
    g: &CudaBackend,
    sets: &Sets,
    x: &CudaBuf,
    tokens: usize,
    outs: &mut [CudaBuf],
    calls: usize,
) -> f64 {
    median_of_rounds(|| {
        let t = Instant::now();
        for i in 0..calls {
            call(g, x, tokens, &sets[i % sets.len()], outs);
        }
        g.synchronize().unwrap();
        t.elapsed().as_secs_f64() / calls as f64
    })
}

/// The value after `--name`, if given.
fn value(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// `--decode`: batch-1 decode steps with producer quantization on and off (module docs).
fn decode_ab(schemes: &str, preset: &str, wait: Option<&str>) -> strix::Result<()> {
    use strix::model::{Logits, Model};
    use strix::quant::on_load::{QuantScheme, QuantizingSource};
    const CONTEXT: usize = 128;
    const STEPS: usize = 64;
    const ROUNDS: usize = 4;
    for scheme in schemes.split(',') {
        let config = strix::synthetic::preset(preset)?;
        let weights = strix::synthetic::SyntheticWeights::new(config.clone(), 0x5eed);
        let started = Instant::now();
        let model = if scheme == "bf16" {
            Model::from_source(config.clone(), &weights, gpu::backend()?, None)?
        } else {
            let scheme: QuantScheme = scheme.parse()?;
            let src = QuantizingSource::new(&weights, &config, scheme);
            Model::from_source(config.clone(), &src, gpu::backend()?, None)?
        };
        println!("{preset} {scheme} loaded in {:.1} s", started.elapsed().as_secs_f64());
        // As `strix bench` decodes a single stream (its bf16 matrices on the CUDA-core GEMVs).
        model.backend().set_tensor_core_gemv(false);
        if let Some(file) = wait {
            let waited = Instant::now();
            while !std::path::Path::new(file).exists() {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            println!("waited {:.1} s for {file}", waited.elapsed().as_secs_f64());
        }
        let vocab = config.vocab_size;
        let prompt: Vec<u32> = (0..CONTEXT).map(|i| (splitmix(i as u64) % vocab as u64) as u32).collect();
        // Producer quantization on, on without the delta rule's, off.
        let modes = [(true, true, "on "), (true, false, "on, not the delta rule"), (false, true, "off")];
        let mut runs: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        for round in 0..ROUNDS {
            for (k, &(on, deltanet, label)) in modes.iter().enumerate() {
                let g = model.backend();
                g.set_producer_quant(on);
                g.set_deltanet_producer_quant(deltanet);
                let mut s = model.new_session(CONTEXT + STEPS + 8);
                let logits = model.forward(&mut s, &prompt, Logits::Last)?;
                let mut next =
                    (0..vocab).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap_or(0) as u32;
                // Warm-up: the first sight of the step runs op by op, the second records it.
                for _ in 0..3 {
                    next = model.decode_batch_greedy(&mut [&mut s], &[next])?[0];
                }
                let before = g.path_counts();
                let t = Instant::now();
                for _ in 0..STEPS {
                    next = model.decode_batch_greedy(&mut [&mut s], &[next])?[0];
                }
                let tok_s = STEPS as f64 / t.elapsed().as_secs_f64();
                let after = g.path_counts();
                runs[k].push(tok_s);
                println!(
                    "{scheme} round {round} producer quantization {}: {tok_s:.1} tok/s (graph replays {}, prequantized GEMVs recorded so far {})",
                    label,
                    after.graph_replays - before.graph_replays,
                    after.gemv_quant_prequantized
                );
            }
        }
        // STRIX_PROFILE_STEPS=n: n more steps (producer quantization on) inside a profiler
        // range, for `ncu --profile-from-start off`.
        let profile: usize =
            std::env::var("STRIX_PROFILE_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        if profile > 0 {
            let g = model.backend();
            g.set_producer_quant(true);
            let mut s = model.new_session(CONTEXT + profile + 8);
            model.forward(&mut s, &prompt, Logits::Last)?;
            for _ in 0..3 {
                model.decode_batch_greedy(&mut [&mut s], &[1])?;
            }
            g.profiler_range(true)?;
            for _ in 0..profile {
                model.decode_batch_greedy(&mut [&mut s], &[1])?;
            }
            g.profiler_range(false)?;
        }
        let (a, d, b) = (median(&runs[0]), median(&runs[1]), median(&runs[2]));
        println!(
            "{preset} {scheme} decode at context {CONTEXT}, batch 1: producer quantization {a:.1} tok/s ({:.3} ms a step), \
             without the delta rule's {d:.1} tok/s ({:.3} ms), quantize_x {b:.1} tok/s ({:.3} ms); {:+.1} %",
            1e3 / a,
            1e3 / d,
            1e3 / b,
            100.0 * (a / b - 1.0)
        );
    }
    Ok(())
}

fn main() -> strix::Result<()> {
    let arg = |a: &str| std::env::args().any(|x| x == a);
    if let Some(schemes) = value("--decode") {
        let preset = value("--preset").unwrap_or_else(|| "qwen3.5-9b".into());
        return decode_ab(&schemes, &preset, value("--wait").as_deref());
    }
    let (quick, variants, eager, prefill) =
        (arg("--quick"), arg("--variants"), arg("--eager"), arg("--prefill"));
    let bf16 = arg("--bf16");
    let g = gpu::backend()?;
    println!("device: {} (sm_{}{})", g.device_name(), g.compute_capability().0, g.compute_capability().1);
    let bw = g.measure_copy_bandwidth(2 << 30, 20)?;
    println!("device-to-device copy bandwidth (read + write): {:.0} GB/s", bw / 1e9);
    println!("(µs per call, GB/s of weights, % of the copy bandwidth; graph-replayed unless marked eager)");
    println!();
    // (label, rows a warp for `set_qgemv_rows`, tokens, tensor-core GEMVs): the dp4a GEMVs
    // (`strix run`'s choice), then the tensor-core ones (the server's) at batch 1, 16 and 64.
    let mut modes: Vec<(&str, Option<usize>, usize, bool)> = vec![("b1", None, 1, false)];
    if variants {
        modes.extend([
            ("b1 r1", Some(1), 1, false),
            ("b1 r2", Some(2), 1, false),
            ("b1 r4", Some(4), 1, false),
        ]);
    }
    modes.extend([("b16", None, 16, false), ("b64", None, 64, false)]);
    modes.extend([("tc b1", None, 1, true), ("tc b16", None, 16, true), ("tc b64", None, 64, true)]);
    let formats: &[DType] = if bf16 {
        &[DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K, DType::BF16]
    } else {
        &[DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K]
    };
    let mut key = 1u64 << 40;
    // (format, mode, bytes, seconds) of the 9B launches, for the totals.
    let mut totals: Vec<(DType, &str, usize, f64)> = Vec::new();
    for &dtype in formats {
        for &(name, rows, cols) in &CASES {
            if quick && name.starts_with("0.8B") || dtype == DType::BF16 && name.starts_with("probe") {
                continue;
            }
            let bytes: usize = rows.iter().map(|&r| r * dtype.row_bytes(cols).unwrap()).sum();
            let copies = ROTATE_BYTES.div_ceil(bytes).clamp(1, 64);
            let sets: Sets = gpu::weight_sets(&g, dtype, rows, cols, copies)?;
            let x = fixed_values(64 * cols);
            let x = g.upload(&x);
            let mut outs: Vec<CudaBuf> = rows.iter().map(|&r| g.zeros(64 * r)).collect();
            let reps = (2e9 / (bytes * copies) as f64).ceil().clamp(2.0, 50.0) as usize;
            let mut line = format!("{:<6} {:<44} {:>8.1} MB |", dtype.name(), name, bytes as f64 / 1e6);
            for &(label, rpw, tokens, tensor_cores) in &modes {
                if dtype == DType::BF16 && rpw.is_some() {
                    continue;
                }
                assert!(set_qgemv_rows(rpw), "rows a warp {rpw:?} not compiled");
                g.set_tensor_core_gemv(tensor_cores);
                key += 1;
                let t = time_graph(&g, key, &sets, &x, tokens, &mut outs, reps);
                let gbs = bytes as f64 / t / 1e9;
                line += &format!(
                    " {label} {:.1} us {:.0} GB/s {:.1}% {:.1} Tops |",
                    t * 1e6,
                    gbs,
                    100.0 * gbs * 1e9 / bw,
                    2.0 * (rows.iter().sum::<usize>() * cols * tokens) as f64 / t / 1e12
                );
                if name.starts_with("9B") && name != "9B gate 12288x4096" {
                    totals.push((dtype, label, bytes, t));
                }
            }
            set_qgemv_rows(None);
            if eager {
                let calls = (2 * copies).max((2e9 / bytes as f64) as usize).clamp(4, 400);
                let t = time_eager(&g, &sets, &x, 1, &mut outs, calls);
                let gbs = bytes as f64 / t / 1e9;
                line +=
                    &format!(" b1 eager {:.1} us {:.0} GB/s {:.1}% |", t * 1e6, gbs, 100.0 * gbs * 1e9 / bw);
            }
            println!("{line}");
            // Prefill: 512 tokens through the dequantizing GEMM (bf16: cuBLAS directly).
            if prefill && rows.len() == 1 && rows[0] < 100_000 {
                let tokens = 512;
                let xp = g.upload(&vec![0.25f32; tokens * cols]);
                let mut outp = g.zeros(tokens * rows[0]);
                let tp = median_of_rounds(|| {
                    let t = Instant::now();
                    for set in sets.iter().cycle().take(10) {
                        g.matmul(&xp, tokens, &set[0], &mut outp);
                    }
                    g.synchronize().unwrap();
                    t.elapsed().as_secs_f64() / 10.0
                });
                println!(
                    "{:<6} {:<44} prefill 512 tokens: {:.1} us = {:.0} TFLOP/s",
                    dtype.name(),
                    name,
                    tp * 1e6,
                    2.0 * (tokens * rows[0] * cols) as f64 / tp / 1e12
                );
            }
        }
    }
    println!();
    println!("path counts: {}", g.path_counts());
    // The 9B step's launches (fused gate/up, fused in_proj, down, out, lm_head): bytes of all of
    // them over the time of one call of each.
    for &dtype in formats {
        for &(label, _, _, _) in &modes {
            let rows: Vec<_> = totals.iter().filter(|r| r.0 == dtype && r.1 == label).collect();
            if rows.is_empty() {
                continue;
            }
            let bytes: usize = rows.iter().map(|r| r.2).sum();
            let t: f64 = rows.iter().map(|r| r.3).sum();
            println!(
                "{:<6} {:<10} 9B launches together: {:.1} us, {:.0} GB/s ({:.1}%)",
                dtype.name(),
                label,
                t * 1e6,
                bytes as f64 / t / 1e9,
                100.0 * bytes as f64 / t / bw
            );
        }
    }
    Ok(())
}
