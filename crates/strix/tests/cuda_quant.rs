//! The CUDA kernels on packed GGML weights (Q8_0, Q4_0, Q4_K, Q6_K) against f64 references
//! built from the CPU's dequantization, and whole models with quantized matrices on CUDA
//! against the CPU. On a machine without a CUDA device every test prints `skipped: <reason>`
//! and passes.
//!
//! Weights are random values with a random scale per 32 (so blocks and sub-blocks have
//! scales spread over e^±3), quantized by `quantize_row`; the reference dequantizes them with
//! `dequantize_row` and takes f64 dot products. Tolerances, as max |cuda − ref| / max |ref|:
//! - `EXACT_TOL = 1e-4`: the decode GEMV against the reference whose activations are quantized
//!   to int8 per 32 by the GEMV's own rule (the GEMV's integer sums are exact, only f32
//!   rounding of the block scaling and the row sum remain), and the fallback GEMM against the
//!   reference on bf16-rounded weights;
//! - the decode GEMV against the plain f32-activation reference: within the bound that int8
//!   activations allow, `Σ_j |w_j| · d_j / 2` per output (`d_j` the activation scale of column
//!   j's block), plus `EXACT_TOL`; the relative error is printed (measured on an H200: up to
//!   ~1e-2 on long rows, 2.6e-2 on a single 32-column row, whose one dot product can be small);
//! - `BF16_TOL = 1e-2`: the dequantize + cuBLAS prefill (weights and activations in bf16);
//! - whole models: `MODEL_TOL`, see there.
//!
//! Every output is poisoned with NaN first, so an element never written fails. The decode
//! batch (`matmul_rows`) must equal the one-token matmul bitwise, and the embedding gather
//! must equal `dequantize_row` bitwise. Path counters prove the packed paths ran.

mod common;

use common::{argmax, fixtures, gpu, rel_err, small_real_heads, Dequantized, Rng};
use rayon::prelude::*;
use strix::backend::cpu::CpuBackend;
use strix::backend::cuda::{
    CudaBackend, CudaWeight, GemmPath, PackedMma, PathCounts, MOE_DECODE_MAX_TOKENS, QUANT_GEMV_MAX_TOKENS,
};
use strix::backend::{Backend, KvCacheType, MlpActivations, MlpWeights, MoeScratch, RmsNorm, SparseMoe};
use strix::checkpoint::Checkpoint;
use strix::config::{LayerKind, ModelConfig};
use strix::model::{Logits, Model, TensorSource};
use strix::quant::{dequantize_row, quantize_row};
use strix::tensor::{Bytes, DType, HostTensor};

const EXACT_TOL: f32 = 1e-4;
const BF16_TOL: f32 = 1e-2;
/// Whole models, CUDA (int8 activations in decode GEMVs, bf16 weights in the prefill GEMM)
/// against the CPU in f32 on the same packed weights. Random-weight models amplify per-element
/// rounding (the bf16 suite sees up to 4.5e-2 on the tiny fixtures from bf16 activations
/// alone), so this bound is looser than the kernels' own.
const MODEL_TOL: f32 = 5e-2;

const FORMATS: [DType; 4] = [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K];

fn block(dtype: DType) -> usize {
    dtype.quant_type().block_size()
}

/// A random `[rows, cols]` matrix quantized to `dtype`, and its dequantized values.
fn packed(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> (HostTensor, Vec<f32>) {
    let vals = rng.blocky(rows * cols);
    let mut bytes = vec![0u8; rows * dtype.row_bytes(cols).unwrap()];
    quantize_row(dtype.quant_type(), &vals, &mut bytes).unwrap();
    let mut deq = vec![0.0f32; rows * cols];
    dequantize_row(dtype.quant_type(), &bytes, &mut deq).unwrap();
    let t = HostTensor { name: "w".into(), dtype, shape: vec![rows, cols], bytes: Bytes::owned(&bytes) };
    (t, deq)
}

/// `x · Wᵀ` in f64, `x: [tokens, cols]`, `w: [rows, cols]`.
fn reference(x: &[f32], tokens: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; tokens * rows];
    out.par_chunks_mut(rows).enumerate().for_each(|(t, o)| {
        let xr = &x[t * cols..(t + 1) * cols];
        for (r, o) in o.iter_mut().enumerate() {
            let wr = &w[r * cols..(r + 1) * cols];
            *o = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
        }
    });
    out
}

/// The activations as the GEMV sees them: per 32 values `d = amax / 127`, `q = round(x / d)`
/// (`x · (1/d)`, ties away from zero), then `q · d`.
fn int8_activations(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for chunk in x.chunks(32) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(chunk.iter().map(|&v| ((v * id).round() as f64 * d as f64) as f32));
    }
    out
}

/// The GEMV's output `ours` for activations `x`: within `EXACT_TOL` of the reference on the
/// int8-quantized activations, and within the int8 bound of the f32 reference (module docs).
/// Returns the relative error against the f32 reference.
fn check_int8(
    what: &str,
    ours: &[f32],
    x: &[f32],
    tokens: usize,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> f32 {
    let r8 = reference(&int8_activations(x), tokens, w, rows, cols);
    check(&format!("{what} vs int8-x ref"), ours, &r8, EXACT_TOL);
    let exact = reference(x, tokens, w, rows, cols);
    let max = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
    for t in 0..tokens {
        let xr = &x[t * cols..(t + 1) * cols];
        let half_steps: Vec<f64> =
            xr.chunks(32).map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0 / 2.0).collect();
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let bound: f64 = wr.iter().enumerate().map(|(j, &v)| v.abs() as f64 * half_steps[j / 32]).sum();
            let (o, e) = (ours[t * rows + r], exact[t * rows + r]);
            let d = (o - e).abs() as f64;
            assert!(
                d <= bound * 1.0001 + (EXACT_TOL * max) as f64,
                "{what}: token {t} row {r}: {o} vs {e}, past the int8 bound {bound:e}"
            );
        }
    }
    let e = rel_err(ours, &exact);
    println!("{what} vs f32-x ref: rel err {e:.2e} (within the int8 bound)");
    e
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
}

fn check(what: &str, ours: &[f32], reference: &[f32], tol: f32) -> f32 {
    let e = rel_err(ours, reference);
    println!("{what}: rel err {e:.2e}");
    assert!(e <= tol, "{what}: rel err {e:.2e} > {tol:e}");
    e
}

fn poison(g: &CudaBackend, n: usize) -> <CudaBackend as Backend>::Buf {
    g.upload(&vec![f32::NAN; n])
}

fn down(g: &CudaBackend, b: &<CudaBackend as Backend>::Buf) -> Vec<f32> {
    g.download(b, 0, b.len())
}

/// Shapes with rows of 1, odd, not a multiple of any tile; columns of one block, a few, and
/// long rows (several GEMV iterations per lane; 8 warps a row for few rows).
fn shapes(dtype: DType) -> Vec<(usize, usize)> {
    let b = block(dtype);
    let long = if b == 32 { 16384 } else { 32768 };
    vec![(1, b), (7, 3 * b), (33, 4096), (300, 5 * b), (5, long), (4500, 256)]
}

/// Each of the `n` tokens of `x` alone through `matmul_rows` gives bitwise its rows of the
/// batch's output `batched`.
fn assert_each_token_alone(
    g: &CudaBackend,
    w: &CudaWeight,
    x: &[f32],
    n: usize,
    batched: &[f32],
    what: &str,
) {
    let (rows, cols) = (g.weight_shape(w).0, x.len() / n);
    for i in 0..n {
        let mut one = poison(g, rows);
        g.matmul_rows(&g.upload(&x[i * cols..(i + 1) * cols]), 1, w, &mut one);
        let one = down(g, &one);
        assert!(
            one.iter().zip(&batched[i * rows..(i + 1) * rows]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: batch {n} token {i} differs from the token alone"
        );
    }
}

fn counts_delta(before: PathCounts, after: PathCounts) -> (u64, u64, u64) {
    (
        after.gemv_quant - before.gemv_quant,
        after.gemv_quant_rows - before.gemv_quant_rows,
        after.gemm_dequant - before.gemm_dequant,
    )
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn packed_weights_keep_their_size_on_the_device() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(1);
    for dtype in FORMATS {
        let (t, _) = packed(&mut rng, dtype, 3, 2 * 256);
        let w = g.weight(&t, 3, 512).unwrap();
        assert_eq!(w.dtype(), dtype);
        assert_eq!(g.weight_bytes(&w), t.bytes.len(), "{dtype:?}");
    }
}

/// The one-token GEMV and the decode batch at B = 1, 3, 17, 64, every row bitwise the
/// one-token result.
/// A MoE block's packed experts on the device (`moe.rs`) against an f64 reference on the
/// dequantized weights. A decode batch (1, 5, 64 tokens: `quant.cu`'s `qmoe_*`) quantizes the
/// activations as the kernels do (x per token, the SwiGLU's output per pick, int8 per 32):
/// within 1e-2 (a SwiGLU output a rounding away from a half step can quantize one step apart),
/// every token bitwise what it gives alone. A prompt (100, 300 tokens: the picked experts
/// dequantized to bf16 for `moe.cu`'s tensor-core kernels) against the bf16-rounded weights and
/// unquantized activations: within 1e-3, every token bitwise what it gives in a shorter prompt.
/// Gate/up and down in the same or different formats.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn packed_moe_experts_match_reference_and_are_batch_invariant() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(41);
    let cases = [
        (DType::Q8_0, DType::Q8_0, 96usize, 64usize, 6usize, 2usize),
        (DType::Q4_0, DType::Q4_0, 64, 96, 5, 3),
        (DType::Q4_K, DType::Q6_K, 256, 512, 6, 2),
        (DType::Q6_K, DType::Q4_K, 512, 256, 4, 1),
    ];
    for (gate_dtype, down_dtype, hidden, inter, n, k) in cases {
        let mut deq = Vec::new();
        let mut experts =
            strix::backend::MoeExperts::<CudaBackend> { gate: vec![], up: vec![], down: vec![], top_k: k };
        for _ in 0..n {
            let (gt, gd) = packed(&mut rng, gate_dtype, inter, hidden);
            let (ut, ud) = packed(&mut rng, gate_dtype, inter, hidden);
            let (dt, dd) = packed(&mut rng, down_dtype, hidden, inter);
            experts.gate.push(g.weight(&gt, inter, hidden).unwrap());
            experts.up.push(g.weight(&ut, inter, hidden).unwrap());
            experts.down.push(g.weight(&dt, hidden, inter).unwrap());
            deq.push((gd, ud, dd));
        }
        assert!(g.moe_on_device(&experts), "{gate_dtype:?}/{down_dtype:?} experts not on the device");
        // A prompt widens every expert of the layer to bf16: the model keeps that much free.
        assert_eq!(g.moe_prompt_scratch_bytes(&experts), n * 2 * 3 * inter * hidden);
        let what = format!(
            "packed moe {}/{} hidden {hidden} inter {inter} {n} experts top {k}",
            gate_dtype.name(),
            down_dtype.name()
        );
        for tokens in [1usize, 5, 64, 100, 300] {
            let prompt = tokens > MOE_DECODE_MAX_TOKENS;
            let x = rng.vec(tokens * hidden, 1.0);
            let logits = rng.vec(tokens * n, 2.0);
            let routing = strix::backend::Routing::new(&logits, tokens, n, k);
            let as_bf16 =
                |m: &[f32]| -> Vec<f32> { m.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect() };
            let weights: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = deq
                .iter()
                .map(|(gd, ud, dd)| match prompt {
                    true => (as_bf16(gd), as_bf16(ud), as_bf16(dd)),
                    false => (gd.clone(), ud.clone(), dd.clone()),
                })
                .collect();
            let activations = |v: &[f32]| if prompt { v.to_vec() } else { int8_activations(v) };
            let mut expected = vec![0f32; tokens * hidden];
            for t in 0..tokens {
                let xq = activations(&x[t * hidden..(t + 1) * hidden]);
                let mut sum = vec![0f64; hidden];
                for r in 0..k {
                    let (e, w) = (routing.experts[t * k + r] as usize, routing.weights[t * k + r] as f64);
                    let (gd, ud, dd) = &weights[e];
                    let act: Vec<f32> = (0..inter)
                        .map(|i| {
                            let dot = |m: &[f32]| {
                                (0..hidden).map(|c| m[i * hidden + c] as f64 * xq[c] as f64).sum::<f64>()
                            };
                            let (gv, uv) = (dot(gd) as f32, dot(ud) as f32);
                            gv / (1.0 + (-gv).exp()) * uv
                        })
                        .collect();
                    let aq = activations(&act);
                    for (c, o) in sum.iter_mut().enumerate() {
                        let y: f64 = (0..inter).map(|i| dd[c * inter + i] as f64 * aq[i] as f64).sum();
                        *o += w * y;
                    }
                }
                for (o, v) in expected[t * hidden..(t + 1) * hidden].iter_mut().zip(&sum) {
                    *o = *v as f32;
                }
            }
            let mut out = poison(&g, tokens * hidden);
            let before = g.path_counts().moe_device;
            g.moe_experts(&g.upload(&x), tokens, &g.upload(&logits), &experts, &mut out, true);
            assert_eq!(g.path_counts().moe_device, before + 1, "{}", g.path_counts());
            let got = down(&g, &out);
            check(&format!("{what} T={tokens}"), &got, &expected, if prompt { 1e-3 } else { 1e-2 });
            if prompt {
                let fewer = tokens - 30;
                let mut part = poison(&g, fewer * hidden);
                let (xp, lp) = (g.upload(&x[..fewer * hidden]), g.upload(&logits[..fewer * n]));
                g.moe_experts(&xp, fewer, &lp, &experts, &mut part, true);
                assert!(
                    down(&g, &part) == got[..fewer * hidden],
                    "{what} T={tokens}: the first {fewer} tokens differ from them as a prompt of their own"
                );
                continue;
            }
            for t in 0..tokens {
                let mut alone = poison(&g, hidden);
                let (xt, lt) =
                    (g.upload(&x[t * hidden..(t + 1) * hidden]), g.upload(&logits[t * n..(t + 1) * n]));
                g.moe_experts(&xt, 1, &lt, &experts, &mut alone, true);
                assert!(
                    down(&g, &alone) == got[t * hidden..(t + 1) * hidden],
                    "{what} T={tokens}: token {t} differs alone"
                );
            }
        }
    }
}

/// A MoE block (`Backend::sparse_moe`) in decode batches tuned for one sequence (the CUDA-core
/// GEMVs) runs its shared expert as one more pick of the routed experts' kernels: against the
/// same block op by op on the device (`sparse_moe_each`: the shared expert's own MLP, the
/// router and gate GEMVs, `add_sigmoid_gated`) on the same weights, bf16 and packed (gate/up
/// and down in the same or different formats), widths that are and are not multiples of 8.
/// Both route the same logits (the same GEMV computes them), so only the shared expert's
/// rounding differs: within 1e-4 for bf16 (f32 sums in other orders), 1e-2 packed (the
/// activations quantized per 32 by other kernels, as `packed_moe_experts_*` explains). Every
/// token of a fused batch of 5 is bitwise what it gives alone. Tuned for batches (the
/// tensor-core GEMVs), and in a prompt, the block runs op by op: bitwise `sparse_moe_each`.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn moe_block_runs_the_shared_expert_as_a_pick_when_tuned_for_one_sequence() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(43);
    let cases = [
        (DType::BF16, DType::BF16, 72usize, 40usize, 6usize, 2usize, EXACT_TOL),
        (DType::BF16, DType::BF16, 256, 512, 9, 4, EXACT_TOL),
        (DType::Q8_0, DType::Q8_0, 96, 64, 6, 2, 1e-2),
        (DType::Q4_K, DType::Q6_K, 256, 512, 6, 3, 1e-2),
        (DType::Q4_K, DType::Q4_K, 512, 256, 5, 1, 1e-2),
    ];
    for (gate_dtype, down_dtype, hidden, inter, n, k, tol) in cases {
        let mut weight = |dtype: DType, rows: usize, cols: usize| {
            g.weight(&packed(&mut rng, dtype, rows, cols).0, rows, cols).unwrap()
        };
        let mut experts =
            strix::backend::MoeExperts::<CudaBackend> { gate: vec![], up: vec![], down: vec![], top_k: k };
        for _ in 0..n {
            experts.gate.push(weight(gate_dtype, inter, hidden));
            experts.up.push(weight(gate_dtype, inter, hidden));
            experts.down.push(weight(down_dtype, hidden, inter));
        }
        let (shared_gate, shared_up, shared_down) = (
            weight(gate_dtype, inter, hidden),
            weight(gate_dtype, inter, hidden),
            weight(down_dtype, hidden, inter),
        );
        let (router, gate_row) = (weight(DType::BF16, n, hidden), weight(DType::BF16, 1, hidden));
        let moe = || SparseMoe {
            router: &router,
            experts: &experts,
            shared_expert: MlpWeights { gate: &shared_gate, up: &shared_up, down: &shared_down },
            shared_expert_gate: &gate_row,
        };
        let what = format!(
            "moe block {}/{} hidden {hidden} inter {inter} {n} experts top {k}",
            gate_dtype.name(),
            down_dtype.name()
        );
        let tokens = 5;
        let xs = rng.vec(tokens * hidden, 1.0);
        // The block on tokens `t0..t1` of `xs`, by the backend's `sparse_moe` (`own_op`) or op by
        // op, in fresh scratch (a fused run leaves the shared expert's unwritten); `fused`: whether
        // the shared expert must run as a pick.
        let run = |own_op: bool, decode_batch: bool, t0: usize, t1: usize, fused: bool| -> Vec<f32> {
            let t = t1 - t0;
            let mut bufs: Vec<_> =
                [n, 1, hidden, inter, inter, inter].iter().map(|&w| poison(&g, t * w)).collect();
            let [logits, gate, shared_out, a, b, c] = &mut bufs[..] else { unreachable!() };
            let scratch = MoeScratch {
                router_logits: logits,
                shared_gate: gate,
                shared_out,
                shared_acts: MlpActivations { gate: a, up: b, act: c },
            };
            let x = g.upload(&xs[t0 * hidden..t1 * hidden]);
            let mut out = poison(&g, t * hidden);
            let before = g.path_counts().moe_shared_fused;
            match own_op {
                true => g.sparse_moe(&x, t, moe(), scratch, &mut out, decode_batch),
                false => strix::backend::sparse_moe_each(&g, &x, t, moe(), scratch, &mut out, decode_batch),
            }
            assert_eq!(
                g.path_counts().moe_shared_fused,
                before + u64::from(fused),
                "{what}: {}",
                g.path_counts()
            );
            down(&g, &out)
        };
        g.set_tensor_core_gemv(false);
        check(
            &format!("{what}: shared expert as a pick"),
            &run(true, true, 0, 1, true),
            &run(false, true, 0, 1, false),
            tol,
        );
        let batch = run(true, true, 0, tokens, true);
        for t in 0..tokens {
            assert!(
                run(true, true, t, t + 1, true) == batch[t * hidden..(t + 1) * hidden],
                "{what}: token {t} of a fused batch differs alone"
            );
        }
        assert!(
            run(true, false, 0, 3, false) == run(false, false, 0, 3, false),
            "{what}: a prompt differs from the ops"
        );
        g.set_tensor_core_gemv(true);
        assert!(
            run(true, true, 0, tokens, false) == run(false, true, 0, tokens, false),
            "{what}: tuned for batches, the block differs from the ops one by one"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn gemv_and_decode_batch_match_reference() {
    let Some(g) = gpu() else { return };
    // The dp4a GEMVs (the tensor-core one has its own test below).
    g.set_tensor_core_gemv(false);
    let mut rng = Rng(2);
    for dtype in FORMATS {
        let (mut worst_exact, mut worst_int8) = (0f32, 0f32);
        for (rows, cols) in shapes(dtype) {
            let (t, deq) = packed(&mut rng, dtype, rows, cols);
            let w = g.weight(&t, rows, cols).unwrap();
            let what = format!("{dtype:?} {rows}x{cols}");

            let x = rng.blocky(cols);
            let mut out = poison(&g, rows);
            let before = g.path_counts();
            g.matmul(&g.upload(&x), 1, &w, &mut out);
            assert_eq!(counts_delta(before, g.path_counts()), (1, 0, 0), "{what}: the packed GEMV ran");
            let one = down(&g, &out);
            worst_exact =
                worst_exact.max(rel_err(&one, &reference(&int8_activations(&x), 1, &deq, rows, cols)));
            worst_int8 = worst_int8.max(check_int8(&format!("{what} gemv"), &one, &x, 1, &deq, rows, cols));

            for n in [1usize, 3, 17, 64] {
                let x = rng.blocky(n * cols);
                let mut out = poison(&g, n * rows);
                let before = g.path_counts();
                g.matmul_rows(&g.upload(&x), n, &w, &mut out);
                // A batch of one takes the one-token kernel (the same arithmetic per token).
                let want = if n == 1 { (1, 0, 0) } else { (0, 1, 0) };
                assert_eq!(counts_delta(before, g.path_counts()), want, "{what}: the packed batch GEMV ran");
                let batched = down(&g, &out);
                if n == 17 {
                    check_int8(&format!("{what} batch {n}"), &batched, &x, n, &deq, rows, cols);
                }
                for i in 0..n {
                    let mut one = poison(&g, rows);
                    g.matmul(&g.upload(&x[i * cols..(i + 1) * cols]), 1, &w, &mut one);
                    let one = down(&g, &one);
                    let same = one
                        .iter()
                        .zip(&batched[i * rows..(i + 1) * rows])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: batch {n} row {i} differs from the one-token GEMV");
                }
            }
        }
        println!(
            "{dtype:?}: worst gemv error vs int8-x ref {worst_exact:.2e}, vs f32-x ref {worst_int8:.2e}"
        );
    }
}

/// The packed tensor-core GEMV (`qmma_*`, int8 mma on the activations `quantize_x` makes) at
/// decode batches of 1 to 130 (each n-tile configuration, a batch past one launch's 64 tokens),
/// rows not a multiple of its 128-row blocks or of an m16 tile, widths of one stage up to long
/// rows split over K: within `EXACT_TOL` of the int8-activation reference, and every token's
/// rows bitwise what the same kernel gives the token alone. A width it does not take (not whole
/// 256-column stages) runs on the dp4a GEMVs at every batch size.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn tensor_core_gemv_matches_reference_and_is_batch_invariant() {
    let Some(g) = gpu() else { return };
    g.set_tensor_core_gemv(true);
    // These tests hold the int8 arithmetic to its own bounds (the warpgroup one has its test).
    g.set_packed_mma(PackedMma::Int8);
    let mut rng = Rng(41);
    let mma_runs = |g: &CudaBackend| g.path_counts().gemv_quant_mma;
    for dtype in FORMATS {
        let mut worst = 0f32;
        for (rows, cols) in
            [(1usize, 256usize), (7, 768), (33, 4096), (129, 256 * 23), (300, 1280), (5, 32768), (4500, 256)]
        {
            let (t, deq) = packed(&mut rng, dtype, rows, cols);
            let w = g.weight(&t, rows, cols).unwrap();
            let what = format!("{dtype:?} {rows}x{cols}");
            for n in [1usize, 2, 3, 9, 17, 33, 64, 130] {
                let x = rng.blocky(n * cols);
                let mut out = poison(&g, n * rows);
                let before = mma_runs(&g);
                g.matmul_rows(&g.upload(&x), n, &w, &mut out);
                assert_eq!(mma_runs(&g) - before, 1, "{what} batch {n}: the tensor-core GEMV ran");
                let batched = down(&g, &out);
                let r8 = reference(&int8_activations(&x), n, &deq, rows, cols);
                worst =
                    worst.max(check(&format!("{what} batch {n} vs int8-x ref"), &batched, &r8, EXACT_TOL));
                if n == 17 {
                    check_int8(&format!("{what} batch {n}"), &batched, &x, n, &deq, rows, cols);
                }
                if n == 1 || (rows * cols > 1 << 20 && n > 17) {
                    continue;
                }
                assert_each_token_alone(&g, &w, &x, n, &batched, &what);
            }
        }
        println!("{dtype:?}: worst tensor-core GEMV error vs int8-x ref {worst:.2e}");
        // A width of whole 32-blocks but not whole stages (k-quant widths always are): the dp4a
        // GEMVs, at every batch size.
        if block(dtype) == 32 {
            let cols = 96 + 256;
            let (t, _) = packed(&mut rng, dtype, 40, cols);
            let w = g.weight(&t, 40, cols).unwrap();
            for n in [1usize, 5] {
                let before = g.path_counts();
                g.matmul_rows(&g.upload(&rng.blocky(n * cols)), n, &w, &mut poison(&g, n * 40));
                let after = g.path_counts();
                assert_eq!(
                    after.gemv_quant_mma, before.gemv_quant_mma,
                    "{dtype:?} width {cols}: not the tensor cores"
                );
                assert_eq!(counts_delta(before, after), if n == 1 { (1, 0, 0) } else { (0, 1, 0) });
            }
        }
    }
}

/// The dequantizing warpgroup GEMV (`PackedMma::Bf16`; Hopper only): against the f64 reference
/// on the weights and the activations rounded to bf16, within
/// `EXACT_TOL` (only f32 accumulation remains); every batch bitwise the token alone, fused
/// projections of mixed formats included, and the path counted.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn warpgroup_packed_gemv_matches_bf16_reference_and_is_batch_invariant() {
    let Some(g) = gpu() else { return };
    g.set_tensor_core_gemv(true);
    if !g.set_packed_mma(PackedMma::Bf16) {
        println!("skipped: no warpgroup packed GEMVs on this device (compute capability 9.0 only)");
        return;
    }
    let mut rng = Rng(43);
    let mma_runs = |g: &CudaBackend| g.path_counts().gemv_quant_mma;
    for mma in [PackedMma::Bf16] {
        assert!(g.set_packed_mma(mma));
        for dtype in FORMATS {
            let mut worst = 0f32;
            for (rows, cols) in
                [(1usize, 256usize), (7, 768), (33, 4096), (129, 256 * 23), (300, 1280), (5, 32768)]
            {
                let (t, deq) = packed(&mut rng, dtype, rows, cols);
                let w = g.weight(&t, rows, cols).unwrap();
                let deq16 = bf16_round(&deq);
                let what = format!("{mma:?} {dtype:?} {rows}x{cols}");
                for n in [1usize, 2, 9, 17, 64, 130] {
                    let x = rng.blocky(n * cols);
                    let mut out = poison(&g, n * rows);
                    let before = mma_runs(&g);
                    g.matmul_rows(&g.upload(&x), n, &w, &mut out);
                    assert_eq!(mma_runs(&g) - before, 1, "{what} batch {n}: the tensor-core GEMV ran");
                    let batched = down(&g, &out);
                    let r = reference(&bf16_round(&x), n, &deq16, rows, cols);
                    worst = worst.max(check(&format!("{what} batch {n}"), &batched, &r, EXACT_TOL));
                    if n == 1 || (rows * cols > 1 << 20 && n > 17) {
                        continue;
                    }
                    assert_each_token_alone(&g, &w, &x, n, &batched, &what);
                }
            }
            println!("{mma:?} {dtype:?}: worst error vs the bf16-weight reference {worst:.2e}");
        }
        // Fused projections of mixed formats (a Q4_K_M layer's): each row of each segment the
        // same as the token alone.
        let cols = 1024;
        let mats: Vec<(DType, usize)> = vec![(DType::Q4_K, 300), (DType::Q6_K, 77), (DType::Q4_K, 130)];
        let ws: Vec<_> = mats
            .iter()
            .map(|&(d, r)| (g.weight(&packed(&mut rng, d, r, cols).0, r, cols).unwrap(), r))
            .collect();
        let wrefs: Vec<_> = ws.iter().map(|(w, _)| w).collect();
        for n in [1usize, 5, 64] {
            let x = rng.blocky(n * cols);
            let mut outs: Vec<_> = ws.iter().map(|(_, r)| poison(&g, n * r)).collect();
            g.matmul_many(&g.upload(&x), n, &wrefs, &mut outs.iter_mut().collect::<Vec<_>>(), true);
            let got: Vec<Vec<f32>> = outs.iter().map(|o| down(&g, o)).collect();
            for (j, (w, _)) in ws.iter().enumerate() {
                assert_each_token_alone(&g, w, &x, n, &got[j], &format!("{mma:?} fused segment {j}"));
            }
        }
    }
    assert!(g.set_packed_mma(PackedMma::Int8));
}

/// A layer's projections of one input in one decode step (`matmul_many`): packed weights of
/// mixed formats and a bf16 one beside them, as a Q4_K_M file has. Every output within the
/// int8 bound of the f32 reference, each sequence's rows bitwise the same in any batch, and
/// the fused packed path counted.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn fused_packed_projections_match_reference_and_are_batch_invariant() {
    for tensor_cores in [false, true] {
        fused_packed_projections_on(tensor_cores);
    }
}

fn fused_packed_projections_on(tensor_cores: bool) {
    let Some(g) = gpu() else { return };
    g.set_tensor_core_gemv(tensor_cores);
    // These tests hold the int8 arithmetic to its own bounds (the warpgroup one has its test).
    g.set_packed_mma(PackedMma::Int8);
    println!("tensor-core GEMVs: {tensor_cores}");
    let mut rng = Rng(11);
    let cols = 512;
    let specs = [
        (DType::Q4_K, 300),
        (DType::Q6_K, 17),
        (DType::Q4_K, 1),
        (DType::BF16, 9),
        (DType::Q8_0, 64),
        (DType::Q4_0, 33),
    ];
    let mats: Vec<(HostTensor, Vec<f32>)> = specs
        .iter()
        .map(|&(dtype, rows)| {
            if dtype == DType::BF16 {
                let vals = bf16_round(&rng.blocky(rows * cols));
                let bytes: Vec<u8> =
                    vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
                let t = HostTensor {
                    name: "w".into(),
                    dtype,
                    shape: vec![rows, cols],
                    bytes: Bytes::owned(&bytes),
                };
                (t, vals)
            } else {
                packed(&mut rng, dtype, rows, cols)
            }
        })
        .collect();
    let ws: Vec<_> =
        mats.iter().zip(&specs).map(|((t, _), &(_, rows))| g.weight(t, rows, cols).unwrap()).collect();
    let w_refs: Vec<_> = ws.iter().collect();
    let run = |x: &[f32], n: usize| -> Vec<Vec<f32>> {
        let mut outs: Vec<_> = specs.iter().map(|&(_, rows)| poison(&g, n * rows)).collect();
        g.matmul_many(&g.upload(x), n, &w_refs, &mut outs.iter_mut().collect::<Vec<_>>(), true);
        outs.iter().map(|o| down(&g, o)).collect()
    };
    for n in [1usize, 3, 9] {
        let x = rng.blocky(n * cols);
        let before = g.path_counts();
        let outs = run(&x, n);
        let after = g.path_counts();
        assert!(after.gemv_quant_fused > before.gemv_quant_fused, "the fused packed GEMV ran: {after}");
        assert_eq!(
            after.gemv_quant_mma > before.gemv_quant_mma,
            tensor_cores,
            "the packed tensor-core GEMV ran: {after}"
        );
        for (j, ((_, deq), &(dtype, rows))) in mats.iter().zip(&specs).enumerate() {
            let what = format!("fused {dtype:?} {rows}x{cols} (segment {j}) batch {n}");
            if dtype == DType::BF16 {
                check(&what, &outs[j], &reference(&x, n, deq, rows, cols), EXACT_TOL);
            } else {
                check_int8(&what, &outs[j], &x, n, deq, rows, cols);
            }
        }
        for i in 0..n {
            let alone = run(&x[i * cols..(i + 1) * cols], 1);
            for (j, &(dtype, rows)) in specs.iter().enumerate() {
                let same = alone[j]
                    .iter()
                    .zip(&outs[j][i * rows..(i + 1) * rows])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "fused {dtype:?} segment {j}: batch {n} row {i} differs from the row alone");
            }
        }
    }
}

/// `matmul` at prompt lengths 1, 5, 63, 64, 65, 300: the GEMV up to `QUANT_GEMV_MAX_TOKENS`,
/// then dequantized bands into cuBLAS; and the fallback GEMM on dequantized weights.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn prefill_matmul_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(3);
    for dtype in FORMATS {
        for (rows, cols) in shapes(dtype) {
            if rows * cols > 4 << 20 {
                continue;
            }
            let (t, deq) = packed(&mut rng, dtype, rows, cols);
            let w = g.weight(&t, rows, cols).unwrap();
            let deq_bf16 = bf16_round(&deq);
            for tokens in [1usize, 5, 63, 64, 65, 300] {
                let what = format!("{dtype:?} {rows}x{cols} tokens {tokens}");
                let x = rng.blocky(tokens * cols);
                let xg = g.upload(&x);
                g.set_gemm_path(GemmPath::Auto);
                let mut out = poison(&g, tokens * rows);
                let before = g.path_counts();
                g.matmul(&xg, tokens, &w, &mut out);
                let delta = counts_delta(before, g.path_counts());
                let ours = down(&g, &out);
                if tokens <= QUANT_GEMV_MAX_TOKENS {
                    assert_eq!(delta, if tokens == 1 { (1, 0, 0) } else { (0, 1, 0) }, "{what}");
                    check_int8(&format!("{what} auto"), &ours, &x, tokens, &deq, rows, cols);
                } else {
                    assert_eq!(delta, (0, 0, 1), "{what}");
                    let tol = if g.has_cublas() { BF16_TOL } else { EXACT_TOL };
                    check(&format!("{what} auto"), &ours, &reference(&x, tokens, &deq, rows, cols), tol);
                }
                if tokens > 1 && (tokens == 5 || tokens == 65) {
                    g.set_gemm_path(GemmPath::Fallback);
                    let mut out = poison(&g, tokens * rows);
                    let before = g.path_counts();
                    g.matmul(&xg, tokens, &w, &mut out);
                    assert_eq!(counts_delta(before, g.path_counts()), (0, 0, 1), "{what} fallback");
                    let r = reference(&x, tokens, &deq_bf16, rows, cols);
                    check(&format!("{what} fallback"), &down(&g, &out), &r, EXACT_TOL);
                    g.set_gemm_path(GemmPath::Auto);
                }
            }
        }
    }
}

/// The embedding gather from a packed table is `dequantize_row`, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn packed_embedding_equals_dequantize_row() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(4);
    for dtype in FORMATS {
        for (rows, cols) in [(1usize, block(dtype)), (37, 3 * block(dtype)), (500, 4096)] {
            let (t, deq) = packed(&mut rng, dtype, rows, cols);
            let w = g.weight(&t, rows, cols).unwrap();
            let ids: Vec<u32> = (0..9).map(|_| rng.below(rows) as u32).collect();
            let mut out = poison(&g, ids.len() * cols);
            let before = g.path_counts().embed_quant;
            g.embed(&w, &ids, cols, &mut out);
            assert_eq!(g.path_counts().embed_quant, before + 1);
            let got = down(&g, &out);
            for (k, &id) in ids.iter().enumerate() {
                let want = &deq[id as usize * cols..(id as usize + 1) * cols];
                let same =
                    want.iter().zip(&got[k * cols..(k + 1) * cols]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} {rows}x{cols}: embedding of id {id} differs from dequantize_row");
            }
        }
    }
}

// --- whole models -----------------------------------------------------------------------------

/// A tensor source whose 2-D weights (whose rows are whole blocks) are quantized to `dtype`.
struct Quantized<'a> {
    inner: &'a dyn TensorSource,
    dtype: DType,
}

impl TensorSource for Quantized<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn tensor(&self, name: &str, shape: &[usize]) -> strix::Result<HostTensor> {
        let t = self.inner.tensor(name, shape)?;
        if shape.len() != 2 || !shape[1].is_multiple_of(block(self.dtype)) {
            return Ok(t);
        }
        let vals = t.to_f32_vec();
        let mut bytes = vec![0u8; shape[0] * self.dtype.row_bytes(shape[1]).unwrap()];
        quantize_row(self.dtype.quant_type(), &vals, &mut bytes)?;
        Ok(HostTensor { name: t.name, dtype: self.dtype, shape: t.shape, bytes: Bytes::owned(&bytes) })
    }
}

/// Prompt logits (`prompt` tokens, `Logits::All`, GEMMs by `path`) then 6 greedy decode steps,
/// CUDA against the CPU on the same (dequantized) weights. Returns the worst error.
fn compare_model(
    what: &str,
    config: &ModelConfig,
    src: &dyn TensorSource,
    prompt: &[u32],
    path: GemmPath,
) -> f32 {
    let cpu =
        Model::from_source(config.clone(), &Dequantized { inner: src }, CpuBackend::new(), None).unwrap();
    // The CPU's cache is f32: so is this one, so that the comparison holds the packed weights'
    // path alone (the bf16 cache has tests of its own in tests/cuda.rs).
    let gpu =
        Model::from_source(config.clone(), src, common::gpu_backend_kv(KvCacheType::F32), None).unwrap();
    let path = if gpu.backend().has_cublas() { path } else { GemmPath::Auto };
    gpu.backend().set_gemm_path(path);
    let vocab = config.vocab_size;
    let (mut sc, mut sg) = (cpu.new_session(256), gpu.new_session(256));
    let lc = cpu.forward(&mut sc, prompt, Logits::All).unwrap();
    let lg = gpu.forward(&mut sg, prompt, Logits::All).unwrap();
    let mut worst = check(&format!("{what} prompt logits"), &lg, &lc, MODEL_TOL);
    let mut next = argmax(&lc[(prompt.len() - 1) * vocab..]);
    for step in 0..6 {
        let lc = cpu.forward(&mut sc, &[next], Logits::Last).unwrap();
        let lg = gpu.forward(&mut sg, &[next], Logits::Last).unwrap();
        worst = worst.max(check(&format!("{what} decode step {step}"), &lg, &lc, MODEL_TOL));
        let (top, second) = top2(&lc);
        let max = lc.iter().fold(0f32, |m, v| m.max(v.abs()));
        if top.1 - second.1 > 2.0 * MODEL_TOL * max {
            assert_eq!(argmax(&lg), top.0, "{what} decode step {step}: greedy token differs");
        }
        next = top.0;
    }
    let counts = gpu.backend().path_counts();
    println!("{what}: {counts}");
    assert!(
        counts.gemv_quant + counts.gemv_quant_mma > 0 && counts.embed_quant > 0,
        "{what}: the packed paths did not run"
    );
    if prompt.len() > QUANT_GEMV_MAX_TOKENS || path != GemmPath::Auto {
        assert!(counts.gemm_dequant > 0, "{what}: the dequantizing GEMM did not run");
    } else {
        assert!(counts.gemv_quant_rows > 0, "{what}: the batched GEMV did not run");
    }
    worst
}

fn top2(v: &[f32]) -> ((u32, f32), (u32, f32)) {
    let a = argmax(v);
    let b =
        v.iter().enumerate().filter(|(i, _)| *i as u32 != a).fold((0u32, f32::NEG_INFINITY), |m, (i, &x)| {
            if x > m.1 {
                (i as u32, x)
            } else {
                m
            }
        });
    ((a, v[a as usize]), b)
}

/// The committed bf16 fixture with its matrices (rows of whole 32-blocks) in Q8_0 / Q4_0,
/// prompts through the batched GEMV (5 tokens) and the dequantizing GEMM (40 tokens, with
/// split bf16 activations: the bf16 suite shows these tiny random models amplify activation
/// rounding to several 1e-2, which would hide the weights' own error).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn fixture_model_with_quantized_matrices_matches_cpu() {
    if gpu().is_none() {
        return;
    }
    let dir =
        fixtures().into_iter().find(|d| d.ends_with("causal-bf16-gdn3x")).expect("fixture causal-bf16-gdn3x");
    let config = ModelConfig::from_model_dir(&dir).unwrap();
    let ckpt = Checkpoint::open_dir(&dir).unwrap();
    let mut rng = Rng(5);
    for dtype in [DType::Q8_0, DType::Q4_0] {
        let src = Quantized { inner: &ckpt, dtype };
        for (len, path) in [(5usize, GemmPath::Auto), (40, GemmPath::CublasSplit)] {
            let prompt: Vec<u32> = (0..len).map(|_| rng.below(config.vocab_size) as u32).collect();
            let what = format!("causal-bf16-gdn3x {dtype:?} prompt {len}");
            compare_model(&what, &config, &src, &prompt, path);
        }
    }
}

/// Synthetic weights in the published head shapes (hidden 256, so every matrix is whole
/// 256-blocks and the K-quants apply), tied embedding: the packed table serves the gather and
/// the lm_head GEMV.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn synthetic_model_in_every_format_matches_cpu() {
    if gpu().is_none() {
        return;
    }
    let c = small_real_heads(512);
    assert!(c.tie_word_embeddings);
    let weights = strix::synthetic::SyntheticWeights::new(c.clone(), 12);
    let mut rng = Rng(6);
    let prompt: Vec<u32> = (0..70).map(|_| rng.below(c.vocab_size) as u32).collect();
    for dtype in FORMATS {
        let src = Quantized { inner: &weights, dtype };
        compare_model(&format!("synthetic {dtype:?}"), &c, &src, &prompt, GemmPath::CublasSplit);
    }
}

/// Long rows with many units per lane (where the accumulation order inside a lane matters),
/// rows not a multiple of any tile, in each split of a row over warps: the one-token GEMV is
/// bitwise the same with 1, 2 and 4 rows a warp, every token of a decode batch bitwise the
/// one-token result, and all within `EXACT_TOL` of the int8-activation reference; likewise
/// for the fused launch of two matrices.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn gemv_rows_per_warp_and_long_rows_are_bitwise_batch_invariant() {
    let Some(g) = gpu() else { return };
    // The dp4a GEMVs (the tensor-core one has its own test below).
    g.set_tensor_core_gemv(false);
    let mut rng = Rng(21);
    let cols = 256 * 23;
    let bitwise = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    for dtype in FORMATS {
        // 4500 rows: one warp a row (lanes take up to 12 units); 301 and 37: split over warps.
        for rows in [4500usize, 301, 37] {
            let (t, deq) = packed(&mut rng, dtype, rows, cols);
            let w = g.weight(&t, rows, cols).unwrap();
            let what = format!("{dtype:?} {rows}x{cols}");
            let n = 5;
            let x = rng.blocky(n * cols);
            let xg = g.upload(&x);
            let mut batched = poison(&g, n * rows);
            g.matmul_rows(&xg, n, &w, &mut batched);
            let batched = down(&g, &batched);
            let r8 = reference(&int8_activations(&x), n, &deq, rows, cols);
            check(&format!("{what} batch {n} vs int8-x ref"), &batched, &r8, EXACT_TOL);
            for i in 0..n {
                let xi = g.upload(&x[i * cols..(i + 1) * cols]);
                let mut first: Option<Vec<f32>> = None;
                for rpw in [1usize, 2, 4] {
                    assert!(strix::backend::cuda::set_qgemv_rows(Some(rpw)));
                    let mut one = poison(&g, rows);
                    g.matmul(&xi, 1, &w, &mut one);
                    let one = down(&g, &one);
                    assert!(
                        bitwise(&one, &batched[i * rows..(i + 1) * rows]),
                        "{what}: {rpw} rows a warp: token {i} of the batch differs from the one-token GEMV"
                    );
                    if let Some(f) = &first {
                        assert!(bitwise(f, &one), "{what}: {rpw} rows a warp differs from 1");
                    }
                    first = Some(one);
                }
                strix::backend::cuda::set_qgemv_rows(None);
            }
            // The same matrix twice in one fused launch: each half as the fused batch gives it.
            let ws = [&w, &w];
            let mut outs = [poison(&g, n * rows), poison(&g, n * rows)];
            g.matmul_many(&xg, n, &ws, &mut outs.iter_mut().collect::<Vec<_>>(), true);
            let fused: Vec<Vec<f32>> = outs.iter().map(|o| down(&g, o)).collect();
            for half in &fused {
                check(&format!("{what} fused batch {n} vs int8-x ref"), half, &r8, EXACT_TOL);
            }
            for i in 0..n {
                let xi = g.upload(&x[i * cols..(i + 1) * cols]);
                for rpw in [1usize, 2, 4] {
                    assert!(strix::backend::cuda::set_qgemv_rows(Some(rpw)));
                    let mut alone = [poison(&g, rows), poison(&g, rows)];
                    g.matmul_many(&xi, 1, &ws, &mut alone.iter_mut().collect::<Vec<_>>(), true);
                    for (half, a) in fused.iter().zip(&alone) {
                        assert!(
                            bitwise(&down(&g, a), &half[i * rows..(i + 1) * rows]),
                            "{what}: fused, {rpw} rows a warp: token {i} differs from the batch"
                        );
                    }
                }
                strix::backend::cuda::set_qgemv_rows(None);
            }
        }
    }
}

/// The row norms and the one-token SwiGLU write their output quantized for the packed GEMV
/// that reads it next (`quant.rs`, "activations quantized by their producer"). With that on,
/// every output (the norm's f32 row, the residual, the GEMV, the fused projections, the MLP) is
/// bitwise what the separate `quantize_x` path gives, and the counter shows the GEMVs did read
/// the producer's quantization. Then the record must never be used stale: the norm's output
/// rewritten in place, its buffer freed and its memory handed to a new upload, a GEMV of
/// another buffer, an unrelated op in between — each GEMV must give the result of the
/// buffer's current contents (through `quantize_x`), which a stale side buffer (the norm's
/// values) would not.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn producer_quantized_activations_are_bitwise_and_never_stale() {
    for tensor_cores in [false, true] {
        producer_quantized_activations_on(tensor_cores);
    }
}

fn producer_quantized_activations_on(tensor_cores: bool) {
    let Some(g) = gpu() else { return };
    g.set_tensor_core_gemv(tensor_cores);
    // These tests hold the int8 arithmetic to its own bounds (the warpgroup one has its test).
    g.set_packed_mma(PackedMma::Int8);
    println!("tensor-core GEMVs: {tensor_cores}");
    let mut rng = Rng(31);
    let eps = 1e-6f32;
    let bitwise =
        |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let used = |g: &CudaBackend| g.path_counts().gemv_quant_prequantized;
    for dtype in FORMATS {
        // One warp's worth of float4s (96), one float4 a thread (4096), and a second float4
        // for some of the 1024 threads (5120).
        let dims = if block(dtype) == 32 { [96usize, 4096, 5120] } else { [256, 4096, 5120] };
        for dim in dims {
            let what = format!("{dtype:?} dim {dim}");
            let rows = 300;
            let inter = 2 * dim;
            let (t, deq) = packed(&mut rng, dtype, rows, dim);
            let w = g.weight(&t, rows, dim).unwrap();
            let w2 = g.weight(&packed(&mut rng, dtype, 77, dim).0, 77, dim).unwrap();
            let gate = g.weight(&packed(&mut rng, dtype, inter, dim).0, inter, dim).unwrap();
            let up = g.weight(&packed(&mut rng, dtype, inter, dim).0, inter, dim).unwrap();
            let dn = g.weight(&packed(&mut rng, dtype, dim, inter).0, dim, inter).unwrap();
            let (h, y, nw) = (rng.blocky(dim), rng.blocky(dim), rng.vec(dim, 0.5));

            let run = |on: bool| -> (Vec<Vec<f32>>, u64) {
                g.set_producer_quant(on);
                let before = used(&g);
                // Every buffer is made first: an upload between a producer and its GEMV is work
                // on the device, after which the GEMV must not read the producer's record.
                let (mut hg, yg, nwg) = (g.upload(&h), g.upload(&y), g.upload(&nw));
                let (mut x, mut x2, mut x3) = (poison(&g, dim), poison(&g, dim), poison(&g, dim));
                let (mut o1, mut o3) = (poison(&g, rows), poison(&g, rows));
                let mut fused = [poison(&g, rows), poison(&g, 77)];
                g.add_rms_norm(&mut hg, &yg, RmsNorm { weight: &nwg, dim, eps }, &mut x);
                g.matmul_rows(&x, 1, &w, &mut o1);
                g.rms_norm(&hg, RmsNorm { weight: &nwg, dim, eps }, &mut x2);
                g.matmul_many(&x2, 1, &[&w, &w2], &mut fused.iter_mut().collect::<Vec<_>>(), true);
                g.rms_norm(&yg, RmsNorm { weight: &nwg, dim, eps }, &mut x3);
                g.matmul(&x3, 1, &w, &mut o3);
                // The MLP of one token, as a decode batch and as a prompt's last token runs it.
                let mut outs = Vec::new();
                for decode_batch in [true, false] {
                    let mut x4 = poison(&g, dim);
                    let (mut go, mut uo, mut act) = (poison(&g, inter), poison(&g, inter), poison(&g, inter));
                    let mut o4 = poison(&g, dim);
                    g.rms_norm(&hg, RmsNorm { weight: &nwg, dim, eps }, &mut x4);
                    let weights = MlpWeights { gate: &gate, up: &up, down: &dn };
                    let acts = MlpActivations { gate: &mut go, up: &mut uo, act: &mut act };
                    g.mlp(&x4, 1, weights, acts, &mut o4, decode_batch);
                    outs.extend([down(&g, &act), down(&g, &o4)]);
                }
                let mut all = vec![down(&g, &x), down(&g, &hg), down(&g, &o1), down(&g, &x2)];
                all.extend(fused.iter().map(|o| down(&g, o)));
                all.extend([down(&g, &x3), down(&g, &o3)]);
                all.extend(outs);
                (all, used(&g) - before)
            };
            let (off, used_off) = run(false);
            let glu_before = g.path_counts().gemv_glu;
            let (on, used_on) = run(true);
            let glu_ran = g.path_counts().gemv_glu - glu_before;
            assert_eq!(used_off, 0, "{what}: producer quantization read while switched off");
            // Norm -> GEMV, norm -> fused pair, norm -> one-token matmul, and in both MLPs (as a
            // decode batch and as a prompt's last token) norm -> the gate/up GEMV with the
            // SwiGLU (every shape here fuses: `qgemv_glu`) and that GEMV -> down; on the tensor
            // cores the decode batch's MLP instead runs norm -> the fused gate/up GEMV, then
            // the SwiGLU -> down (a batch's gate/up sums, so a token's must be those too).
            assert_eq!(used_on, 7, "{what}: GEMVs that read the producer's quantization");
            let glu_wanted = if tensor_cores && dim % 256 == 0 { 1 } else { 2 };
            assert_eq!(glu_ran, glu_wanted, "{what}: one-token MLPs on the fused gate/up GEMV");
            for (k, (a, b)) in on.iter().zip(&off).enumerate() {
                assert!(bitwise(a, b), "{what}: output {k} differs from the quantize_x path");
            }
            check_int8(&format!("{what} norm -> gemv"), &on[2], &on[0], 1, &deq, rows, dim);

            // Staleness: `expect` is the GEMV of what the buffer holds now, by quantize_x.
            let gemv_off = |v: &[f32]| -> Vec<f32> {
                g.set_producer_quant(false);
                let mut o = poison(&g, rows);
                g.matmul_rows(&g.upload(v), 1, &w, &mut o);
                g.set_producer_quant(true);
                down(&g, &o)
            };
            let z = rng.blocky(dim);
            let (hg, nwg, zg) = (g.upload(&h), g.upload(&nw), g.upload(&z));
            let normed = {
                let mut x = poison(&g, dim);
                g.rms_norm(&hg, RmsNorm { weight: &nwg, dim, eps }, &mut x);
                down(&g, &x)
            };
            let mut plus = normed.clone();
            plus.iter_mut().zip(&z).for_each(|(a, b)| *a += b);
            let cases: [(&str, Vec<f32>); 5] = [
                ("rewritten in place", plus),
                ("freed, memory reused by an upload", z.clone()),
                ("another buffer", z.clone()),
                ("an unrelated op in between", normed.clone()),
                ("control: the next op", normed.clone()),
            ];
            for (case, (name, now)) in cases.iter().enumerate() {
                let before = used(&g);
                // Every buffer made before the norm: an upload is work on the device too.
                let (mut x, mut o) = (poison(&g, dim), poison(&g, rows));
                g.rms_norm(&hg, RmsNorm { weight: &nwg, dim, eps }, &mut x);
                match case {
                    0 => {
                        // x += z (the residual add of add_rms_norm; its norm goes elsewhere).
                        let mut normed_again = poison(&g, dim);
                        g.add_rms_norm(&mut x, &zg, RmsNorm { weight: &nwg, dim, eps }, &mut normed_again);
                        g.matmul_rows(&x, 1, &w, &mut o);
                    }
                    1 => {
                        drop(x);
                        let reused = g.upload(&z);
                        g.matmul_rows(&reused, 1, &w, &mut o);
                    }
                    2 => g.matmul_rows(&zg, 1, &w, &mut o),
                    3 => {
                        let (mut other, mut other_normed) = (g.upload(&z), poison(&g, dim));
                        g.add_rms_norm(
                            &mut other,
                            &zg,
                            RmsNorm { weight: &nwg, dim, eps },
                            &mut other_normed,
                        );
                        g.matmul_rows(&x, 1, &w, &mut o);
                    }
                    _ => g.matmul_rows(&x, 1, &w, &mut o),
                }
                let o = down(&g, &o);
                let expect = gemv_off(now);
                assert!(bitwise(&o, &expect), "{what}: {name}: the GEMV did not read the buffer's contents");
                let read = used(&g) - before;
                assert_eq!(read, u64::from(case == 4), "{what}: {name}: producer quantization reads");
            }
        }
    }
}

/// Whole decode steps with producer quantization on and off, on a synthetic model (hidden 256,
/// so the K-quants apply) with the 0.8B's linear-attention heads and with the 9B's (twice the
/// value heads, whose batch-1 delta rule also quantizes its output for out_proj): batch-1 steps
/// (eager, recorded and replayed graphs) give bitwise the same logits either way, and a
/// sequence in a batch of two (where every packed GEMV quantizes its own input) bitwise its
/// batch-1 logits. The packed GEMVs of a batch-1 step that read their producer's quantization:
/// every layer's input projections (the norm), its gate/up (the norm) and down (the gate/up
/// GEMV with the SwiGLU), each attention layer's o_proj (the attention merge), the lm_head (the
/// final norm), and with the 9B's heads each DeltaNet layer's out_proj.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn decode_steps_are_bitwise_the_same_with_producer_quantization() {
    if gpu().is_none() {
        return;
    }
    let c = small_real_heads(768);
    let mut rng = Rng(8);
    let prompt: Vec<u32> = (0..9).map(|_| rng.below(c.vocab_size) as u32).collect();
    let other: Vec<u32> = (0..4).map(|_| rng.below(c.vocab_size) as u32).collect();
    let vocab = c.vocab_size;
    let bitwise =
        |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let linear_layers = c.layer_kinds.iter().filter(|k| matches!(k, LayerKind::DeltaNet)).count();
    let mut nine_b = c.clone();
    nine_b.linear_num_v_heads = 2 * nine_b.linear_num_k_heads;
    for (heads, c) in [("0.8B heads", c), ("9B heads", nine_b)] {
        let weights = strix::synthetic::SyntheticWeights::new(c.clone(), 13);
        let out_proj_reads = if heads == "9B heads" { linear_layers } else { 0 };
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K] {
            let src = Quantized { inner: &weights, dtype };
            for tensor_cores in [false, true] {
                let run = |on: bool| -> (Vec<Vec<f32>>, Vec<Vec<f32>>, PathCounts) {
                    let gpu = Model::from_source(c.clone(), &src, common::gpu_backend(), None).unwrap();
                    gpu.backend().set_tensor_core_gemv(tensor_cores);
                    gpu.backend().set_packed_mma(PackedMma::Int8);
                    gpu.backend().set_producer_quant(on);
                    let (mut a, mut a2, mut b) =
                        (gpu.new_session(64), gpu.new_session(64), gpu.new_session(64));
                    gpu.forward(&mut a, &prompt, Logits::Last).unwrap();
                    gpu.forward(&mut a2, &prompt, Logits::Last).unwrap();
                    gpu.forward(&mut b, &other, Logits::Last).unwrap();
                    let (mut single, mut pair) = (Vec::new(), Vec::new());
                    let mut next = prompt[0];
                    for _ in 0..6 {
                        let l1 = gpu.decode_batch(&mut [&mut a], &[next]).unwrap();
                        let l2 = gpu.decode_batch(&mut [&mut a2, &mut b], &[next, next]).unwrap();
                        pair.push(l2[..vocab].to_vec());
                        next = argmax(&l1);
                        single.push(l1);
                    }
                    (single, pair, gpu.backend().path_counts())
                };
                let (off, off_pair, off_counts) = run(false);
                let (on, on_pair, on_counts) = run(true);
                let what = format!("{heads}, {dtype:?}, tensor-core GEMVs {tensor_cores}");
                println!("{what}, producer quantization on: {on_counts}");
                assert_eq!(on_counts.gemv_quant_mma > 0, tensor_cores, "{what}: the packed tensor-core GEMV");
                assert_eq!(off_counts.gemv_quant_prequantized, 0, "{what}: read while off");
                assert!(on_counts.graph_replays > 0 && on_counts.graph_captures > 0, "{what}: no graphs ran");
                // Host ops run for the batch-1 step's eager sight and its recording, not its replays.
                let per_step = 3 * c.num_layers + (c.num_layers - linear_layers) + 1 + out_proj_reads;
                assert_eq!(
                    on_counts.gemv_quant_prequantized,
                    2 * per_step as u64,
                    "{what}: GEMVs reading a producer's quantization"
                );
                for step in 0..on.len() {
                    assert!(
                        bitwise(&on[step], &off[step]),
                        "{what} step {step}: batch 1 differs with producer quantization"
                    );
                    assert!(
                        bitwise(&on_pair[step], &on[step]),
                        "{what} step {step}: batch 2 differs from batch 1"
                    );
                    assert!(
                        bitwise(&off_pair[step], &off[step]),
                        "{what} step {step}: batch 2 differs (off)"
                    );
                }
            }
        }
    }
}
