//! The bf16 decode GEMVs at the Qwen3.5-9B shapes, tensor-core against CUDA-core: measures the
//! device's copy bandwidth (read + write), then for each matrix (and each fused projection set
//! the model launches as one GEMV) times the call at batch 1, 16 and 64 on the CUDA-core
//! kernels, at batch 1, 8, 16, 32 and 64 on each tensor-core kernel (warpgroup, streamed,
//! per-warp), and with `--sweep` at batch 1, 16 and 64 on the compiled tilings of the per-warp
//! kernel; prints µs per call, GB/s of weight bytes read and the % of the measured bandwidth.
//!
//! `cargo run --release --example cuda_gemv_bench -- [--quick] [--sweep]` (`--quick`: the
//! model's launches only, not the single matrices; `--sweep`: every tiling of the per-warp
//! tensor-core kernel too)
//!
//! Weights are random bf16 in enough copies to rotate through several times the L2 cache, so
//! every call streams them from device memory. Calls are timed back to back on the host
//! (median of 5 rounds), so launch overhead is in the figures, as in an eager decode step.

#[path = "common/bench.rs"]
mod bench;
#[path = "common/gpu.rs"]
mod gpu;

use std::time::Instant;

use bench::{fixed_values, median_of_rounds};
use strix::backend::cuda::{CudaBackend, CudaWeight, TensorCoreKernel};
use strix::backend::Backend;
use strix::tensor::DType;

/// One GEMV launch of the model (the first six: the launches a 9B decode step makes), or a
/// single matrix for comparison: the rows of each matrix that reads the same x, and the width.
const CASES: [(&str, &[usize], usize); 9] = [
    ("gate/up fused 2x12288x4096", &[12288, 12288], 4096),
    ("down 4096x12288", &[4096], 12288),
    ("gdn in_proj fused 8192+4096+32+32 x4096", &[8192, 4096, 32, 32], 4096),
    ("attn qkv fused 8192+1024+1024 x4096", &[8192, 1024, 1024], 4096),
    ("out/o_proj 4096x4096", &[4096], 4096),
    ("lm_head 248320x4096", &[248320], 4096),
    ("12288x4096", &[12288], 4096),
    ("8192x4096", &[8192], 4096),
    ("1024x4096", &[1024], 4096),
];

/// Bytes of weights the timed loop rotates through (several times the H200's 50 MB L2).
const ROTATE_BYTES: usize = 512 << 20;

/// Seconds per call of `f(copy)`, rotating through `copies`: the median of 5 timed rounds of
/// `calls` calls each, after a warm-up round.
fn time_calls(g: &CudaBackend, copies: usize, calls: usize, mut f: impl FnMut(usize)) -> f64 {
    let round = || {
        let t = Instant::now();
        for i in 0..calls {
            f(i % copies);
        }
        g.synchronize().unwrap();
        t.elapsed().as_secs_f64() / calls as f64
    };
    median_of_rounds(round)
}

/// Tilings not worth timing: n-tiles far beyond the batch (they only add zero columns).
fn sweep_skip(nt: usize, batch: usize) -> bool {
    8 * nt >= 4 * batch.max(8)
}

fn main() -> strix::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let sweep = std::env::args().any(|a| a == "--sweep");
    let g = gpu::backend()?;
    println!("device: {} (sm_{}{})", g.device_name(), g.compute_capability().0, g.compute_capability().1);
    let bw = g.measure_copy_bandwidth(2 << 30, 20)?;
    println!("device-to-device copy bandwidth (read + write): {:.0} GB/s", bw / 1e9);
    println!();
    println!("{:<42} {:<14} {:>5} {:>10} {:>8} {:>7}", "case", "kernel", "batch", "us", "GB/s", "%");
    let max_batch = 64;
    for (name, rows, cols) in CASES.into_iter().take(if quick { 6 } else { CASES.len() }) {
        let total_rows: usize = rows.iter().sum();
        let bytes = total_rows * cols * 2;
        let copies = ROTATE_BYTES.div_ceil(bytes).clamp(1, 64);
        let weights = gpu::weight_sets(&g, DType::BF16, rows, cols, copies)?;
        let x = fixed_values(max_batch * cols);
        let x = g.upload(&x);
        let mut outs: Vec<_> = rows.iter().map(|&r| g.zeros(max_batch * r)).collect();
        let calls = (2 * copies).max((2e9 / bytes as f64) as usize).clamp(4, 400);
        let mut run = |kernel: &str, batch: usize| {
            let t = time_calls(&g, copies, calls, |c| {
                let ws: Vec<&CudaWeight> = weights[c].iter().collect();
                if ws.len() == 1 {
                    g.matmul_rows(&x, batch, ws[0], &mut outs[0]);
                } else {
                    g.matmul_many(&x, batch, &ws, &mut outs.iter_mut().collect::<Vec<_>>(), true);
                }
            });
            let gbs = bytes as f64 / t / 1e9;
            println!(
                "{:<42} {:<14} {:>5} {:>10.1} {:>8.0} {:>6.1}%",
                name,
                kernel,
                batch,
                t * 1e6,
                gbs,
                100.0 * gbs * 1e9 / bw
            );
        };
        g.set_tensor_core_gemv(false);
        for batch in [1, 16, 64] {
            run("cuda-core", batch);
        }
        g.set_tensor_core_gemv(true);
        for (name, kernel) in [
            ("tc wgmma", TensorCoreKernel::Warpgroup),
            ("tc streamed", TensorCoreKernel::Streamed),
            ("tc per-warp", TensorCoreKernel::PerWarp),
        ] {
            if !g.set_tensor_core_kernel(kernel) {
                continue;
            }
            for batch in [1, 8, 16, 32, 64] {
                run(name, batch);
            }
        }
        g.set_tensor_core_kernel(TensorCoreKernel::PerWarp);
        if !sweep {
            continue;
        }
        for batch in [1, 16, 64] {
            for &(nt, rt, u) in CudaBackend::gemv_tile_configs() {
                if sweep_skip(nt, batch) {
                    continue;
                }
                assert!(g.set_gemv_tiles(Some((nt, rt, u))));
                run(&format!("tc n{nt} r{rt} u{u}"), batch);
            }
        }
        g.set_gemv_tiles(None);
    }
    println!();
    println!("path counts: {}", g.path_counts());
    Ok(())
}
