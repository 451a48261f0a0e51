//! Where the time of a long CUDA prefill goes, and what the tensor-core prefill kernels change.
//!
//! Per preset: every op of a 4096-token prefill (eight passes of 512 tokens, as
//! `Model::forward` runs it) at the preset's shapes, each timed alone (median of repeats after a
//! warm-up, synchronised), times its calls; attention is timed at each pass's cache position.
//! Attention and the chunked delta rule are timed on both prefill paths (`PrefillPath::F32`,
//! the f32 CUDA-core kernels, and `Auto`, the tensor-core ones), and their outputs compared.
//! Then whole prefills of 512 and 4096 tokens through `Model::forward` on both paths.
//!
//! `cargo run --release --example cuda_prefill_bench -- [PRESET ...]`
//! (default presets: qwen3.5-0.8b qwen3.5-9b). `STRIX_PREFILL_BENCH_MODEL=0` skips the whole
//! prefills (no weights are synthesised then). `STRIX_PROFILE_PREFILL=1` instead runs one
//! warm-up prefill of 4096 tokens and one more inside a profiler range (the model's own pass
//! length), for `ncu --profile-from-start off`, and nothing else.

#[path = "common/bench.rs"]
mod bench;
#[path = "common/gpu.rs"]
mod gpu;

use std::time::Instant;

use bench::{median, Random};
use strix::backend::cuda::{CudaBackend, PrefillPath};
use strix::backend::{
    AttentionInput, AttentionLayer, Backend, DeltaRuleInput, DeltaRuleMode, KvCache, RmsNorm,
};
use strix::config::{LayerKind, ModelConfig};
use strix::model::{attention_shape, deltanet_shape, rope_inv_freq, Logits, Model};
use strix::synthetic::{preset, SyntheticWeights};
use strix::tensor::{Bytes, DType, HostTensor};

const PASS: usize = 512;
const PROMPT: usize = 4096;

/// Median seconds per call of `f` over `reps` synchronised calls, after one warm-up call.
fn timed(b: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    b.synchronize().unwrap();
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f();
        b.synchronize().unwrap();
        v.push(t.elapsed().as_secs_f64());
    }
    median(&v)
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let m = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |e, (x, y)| e.max((x - y).abs())) / m
}

fn weight(b: &CudaBackend, rows: usize, cols: usize, rng: &mut Random) -> strix::backend::cuda::CudaWeight {
    let vals = rng.vec(rows * cols, 1.0 / (cols as f32).sqrt());
    let words: Vec<u32> = vals
        .chunks(2)
        .map(|p| {
            let lo = half::bf16::from_f32(p[0]).to_bits() as u32;
            let hi = p.get(1).map_or(0, |&x| half::bf16::from_f32(x).to_bits() as u32);
            lo | (hi << 16)
        })
        .collect();
    let t = HostTensor {
        name: format!("bench{rows}x{cols}"),
        dtype: DType::BF16,
        shape: vec![rows, cols],
        bytes: Bytes::Owned { words: std::sync::Arc::new(words), len: rows * cols * 2 },
    };
    b.weight(&t, rows, cols).unwrap()
}

struct Op {
    name: String,
    calls: usize,
    secs: f64,
}

fn breakdown(c: &ModelConfig, b: &CudaBackend) -> Vec<Op> {
    let mut rng = Random::new(0x1234_5678_9abc_def1);
    let t = PASS;
    let passes = PROMPT / PASS;
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let dn = deltanet_shape(c);
    let at = attention_shape(c);
    let n_gdn = c.layer_kinds.iter().filter(|k| **k == LayerKind::DeltaNet).count();
    let n_att = c.num_layers - n_gdn;
    let q_dim = at.num_heads * at.head_dim;
    let mut ops = Vec::new();
    let mut push = |name: String, calls: usize, secs: f64| ops.push(Op { name, calls, secs });

    let mats: Vec<(&str, usize, usize, usize)> = vec![
        ("matmul gdn qkv", dn.conv_dim(), h, n_gdn),
        ("matmul gdn z", dn.value_dim(), h, n_gdn),
        ("matmul gdn a, b", dn.num_v_heads, h, 2 * n_gdn),
        ("matmul gdn out", h, dn.value_dim(), n_gdn),
        ("matmul attn q+gate", 2 * q_dim, h, n_att),
        ("matmul attn k, v", at.kv_dim(), h, 2 * n_att),
        ("matmul attn o", h, q_dim, n_att),
        ("matmul mlp gate, up", inter, h, 2 * c.num_layers),
        ("matmul mlp down", h, inter, c.num_layers),
    ];
    for &(name, rows, cols, calls) in &mats {
        let w = weight(b, rows, cols, &mut rng);
        let x = b.upload(&rng.vec(t * cols, 1.0));
        let mut out = b.zeros(t * rows);
        let secs = timed(b, 10, || b.matmul(&x, t, &w, &mut out));
        push(format!("{name} {rows}x{cols}"), calls * passes, secs);
    }
    let up = |rng: &mut Random, n: usize, s: f32| b.upload(&rng.vec(n, s));
    let (mut res, x, w) = (up(&mut rng, t * h, 1.0), up(&mut rng, t * h, 1.0), up(&mut rng, h, 0.3));
    let mut out = b.zeros(t * h);
    let secs =
        timed(b, 10, || b.add_rms_norm(&mut res, &x, RmsNorm { weight: &w, dim: h, eps: 1e-6 }, &mut out));
    push("add_rms_norm".into(), 2 * c.num_layers * passes, secs);
    let (g, u) = (up(&mut rng, t * inter, 1.0), up(&mut rng, t * inter, 1.0));
    let mut act = b.zeros(t * inter);
    let secs = timed(b, 10, || b.swiglu(&g, &u, t * inter, &mut act));
    push("swiglu".into(), c.num_layers * passes, secs);

    if n_gdn > 0 {
        let qkv0 = rng.vec(t * dn.conv_dim(), 1.0);
        let mut qkv = b.upload(&qkv0);
        let conv_w = up(&mut rng, dn.conv_dim() * dn.conv_kernel, 0.5);
        let mut conv_state = up(&mut rng, dn.conv_state_len(), 0.5);
        let secs = timed(b, 10, || b.causal_conv1d_silu(&dn, &mut qkv, t, &conv_w, &mut conv_state));
        push("conv1d+silu".into(), n_gdn * passes, secs);
        let qkv = b.upload(&qkv0);
        let (a, bb) = (up(&mut rng, t * dn.num_v_heads, 2.0), up(&mut rng, t * dn.num_v_heads, 2.0));
        let (a_log, dt) = (up(&mut rng, dn.num_v_heads, 1.0), up(&mut rng, dn.num_v_heads, 1.0));
        let init = rng.vec(dn.state_len(), 0.5);
        let mut outs = Vec::new();
        for path in [PrefillPath::F32, PrefillPath::Auto] {
            b.set_prefill_path(path);
            let mut state = b.upload(&init);
            let mut core = b.zeros(t * dn.value_dim());
            let run = |state: &mut _, core: &mut _| {
                let input = DeltaRuleInput { qkv: &qkv, a: &a, b: &bb, a_log: &a_log, dt_bias: &dt };
                b.gated_delta_rule(&dn, DeltaRuleMode::Chunked, input, t, state, core)
            };
            run(&mut state, &mut core);
            outs.push((b.download(&core, 0, t * dn.value_dim()), b.download(&state, 0, dn.state_len())));
            let secs = timed(b, 10, || run(&mut state, &mut core));
            push(format!("gated delta rule chunked [{path:?}]"), n_gdn * passes, secs);
        }
        println!(
            "  delta rule T={t}: tensor cores vs f32: out rel err {:.2e}, state {:.2e}",
            rel_err(&outs[1].0, &outs[0].0),
            rel_err(&outs[1].1, &outs[0].1)
        );
        let z = up(&mut rng, t * dn.value_dim(), 1.0);
        let nw = up(&mut rng, dn.v_head_dim, 0.3);
        let mut core = up(&mut rng, t * dn.value_dim(), 1.0);
        let rows = t * dn.num_v_heads;
        let secs = timed(b, 10, || {
            b.gated_rms_norm(&mut core, &z, RmsNorm { weight: &nw, dim: dn.v_head_dim, eps: 1e-6 }, rows)
        });
        push("gated_rms_norm".into(), n_gdn * passes, secs);
    }
    if n_att > 0 {
        let qg = up(&mut rng, t * 2 * q_dim, 1.0);
        let k0 = rng.vec(t * at.kv_dim(), 1.0);
        let mut k = b.upload(&k0);
        let v = up(&mut rng, t * at.kv_dim(), 1.0);
        let (qn, kn) = (up(&mut rng, at.head_dim, 0.3), up(&mut rng, at.head_dim, 0.3));
        let inv_freq = b.upload(&rope_inv_freq(c));
        let (mut q, mut gate) = (b.zeros(t * q_dim), b.zeros(t * q_dim));
        let positions: Vec<usize> = (0..t).collect();
        let secs = timed(b, 10, || {
            b.attention_prologue(
                AttentionLayer { shape: at, q_norm: &qn, k_norm: &kn, inv_freq: &inv_freq },
                &qg,
                &mut k,
                &positions,
                &mut q,
                &mut gate,
            )
        });
        push("attention prologue".into(), n_att * passes, secs);
        let k = b.upload(&k0);
        let cache = rng.vec(PROMPT * at.kv_dim(), 1.0);
        let (mut kc, mut vc) = (b.cache_upload(&cache), b.cache_upload(&cache));
        let mut o = b.zeros(t * q_dim);
        let input = AttentionInput { q: &q, k: &k, v: &v, gate: &gate };
        for path in [PrefillPath::F32, PrefillPath::Auto] {
            b.set_prefill_path(path);
            let mut total = 0.0;
            for p in 0..passes {
                let pos0 = p * PASS;
                total += timed(b, 5, || {
                    b.attention(&at, input, KvCache { k: &mut kc, v: &mut vc }, pos0, t, &mut o)
                });
            }
            push(format!("attention, 8 passes summed [{path:?}]"), n_att, total);
        }
        let mut outs = Vec::new();
        for path in [PrefillPath::F32, PrefillPath::Auto] {
            b.set_prefill_path(path);
            b.attention(&at, input, KvCache { k: &mut kc, v: &mut vc }, PROMPT - PASS, t, &mut o);
            outs.push(b.download(&o, 0, t * q_dim));
        }
        println!(
            "  attention pos0={} T={t}: tensor cores vs f32: rel err {:.2e}",
            PROMPT - PASS,
            rel_err(&outs[1], &outs[0])
        );
    }
    b.set_prefill_path(PrefillPath::Auto);
    ops
}

fn main() -> strix::Result<()> {
    let mut presets: Vec<String> = std::env::args().skip(1).collect();
    if presets.is_empty() {
        presets = vec!["qwen3.5-0.8b".into(), "qwen3.5-9b".into()];
    }
    let profile = std::env::var("STRIX_PROFILE_PREFILL").is_ok_and(|v| v == "1");
    for name in &presets {
        let cfg = preset(name)?;
        if profile {
            let weights = SyntheticWeights::new(cfg.clone(), 1);
            let model = Model::from_source(cfg.clone(), &weights, gpu::backend()?, None)?;
            let ids: Vec<u32> = (0..PROMPT).map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32).collect();
            model.forward(&mut model.new_session(PROMPT), &ids, Logits::Last)?;
            model.backend().synchronize()?;
            model.backend().profiler_range(true)?;
            let t = Instant::now();
            model.forward(&mut model.new_session(PROMPT), &ids, Logits::Last)?;
            model.backend().synchronize()?;
            model.backend().profiler_range(false)?;
            println!(
                "{name}: profiled prefill of {PROMPT} tokens in {:.1} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
            continue;
        }
        println!("== {name}: ops of a {PROMPT}-token prefill (passes of {PASS})");
        let b = gpu::backend()?;
        let ops = breakdown(&cfg, &b);
        drop(b);
        let mut rows: Vec<&Op> = ops.iter().collect();
        rows.sort_by(|x, y| (y.secs * y.calls as f64).total_cmp(&(x.secs * x.calls as f64)));
        println!("  {:<46} {:>6} {:>10} {:>10}", "op", "calls", "ms/call", "ms total");
        for op in rows {
            println!(
                "  {:<46} {:>6} {:>10.3} {:>10.2}",
                op.name,
                op.calls,
                op.secs * 1e3,
                op.secs * op.calls as f64 * 1e3
            );
        }
        if std::env::var("STRIX_PREFILL_BENCH_MODEL").is_ok_and(|v| v == "0") {
            continue;
        }
        let weights = SyntheticWeights::new(cfg.clone(), 1);
        let model = Model::from_source(cfg.clone(), &weights, gpu::backend()?, None)?;
        for path in [PrefillPath::F32, PrefillPath::Auto] {
            model.backend().set_prefill_path(path);
            for len in [PASS, PROMPT] {
                let ids: Vec<u32> = (0..len).map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32).collect();
                model.forward(&mut model.new_session(len), &ids, Logits::Last)?;
                let mut v = Vec::new();
                for _ in 0..3 {
                    let mut s = model.new_session(len);
                    let t = Instant::now();
                    model.forward(&mut s, &ids, Logits::Last)?;
                    v.push(len as f64 / t.elapsed().as_secs_f64());
                }
                println!("  {name} prefill {len} [{path:?}]: {:.0} tok/s (median of 3)", median(&v));
            }
        }
        println!("  paths: {}", model.backend().path_counts());
    }
    Ok(())
}
