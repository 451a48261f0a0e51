//! Bandwidth of the CUDA matmuls on packed weights (Q8_0, Q4_0, Q4_K, Q6_K, and bf16 for
//! comparison) at the Qwen3.5-9B shapes: measures the device's copy bandwidth (read + write),
//! then per format and shape times the decode GEMV (batch 1, `matmul`) and the decode batch
//! (batch 16, `matmul_rows`) as the model calls them (activation quantization included), and
//! prints GB/s of weight bytes read and the % of the measured bandwidth; then the prefill path
//! (dequantize + cuBLAS) at 512 tokens in TFLOP/s.
//!
//! `cargo run --release --example cuda_quant_bench -- [--quick]`
//!
//! The weights are random blocks (any byte pattern is a valid block; scales are set to small
//! finite values), in enough copies to rotate through several times the L2 cache, so every
//! call streams its weights from device memory.

use std::time::Instant;

use rayon::prelude::*;
use strix::backend::cuda::{CudaBackend, CudaWeight};
use strix::backend::Backend;
use strix::tensor::{Bytes, DType, HostTensor};

const SHAPES: [(usize, usize, &str); 4] = [
    (12288, 4096, "gate/up 12288x4096"),
    (4096, 12288, "down 4096x12288"),
    (4096, 4096, "4096x4096"),
    (248320, 4096, "lm_head 248320x4096"),
];

/// Bytes of weights the timed loop rotates through (several times the H200's 50 MB L2).
const ROTATE_BYTES: usize = 512 << 20;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random `[rows, cols]` weight of `dtype`: random bytes, with every f16 scale field set to a
/// finite value in [2^-10, 2^-6) and bf16 elements to finite values.
fn random_weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> HostTensor {
    let row_bytes = dtype.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * row_bytes];
    bytes.par_chunks_mut(row_bytes).enumerate().for_each(|(r, row)| {
        let mut s = splitmix(seed ^ (r as u64) << 20);
        for chunk in row.chunks_mut(8) {
            s = splitmix(s);
            let b = s.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
        // f16 scale in [2^-10, 2^-6): exponent 5..8, random mantissa.
        let scale = |b: &mut [u8], k: usize| {
            let e = 5 + (b[k + 1] & 3) as u16;
            let h = (e << 10) | (u16::from_le_bytes([b[k], b[k + 1]]) & 0x3ff);
            b[k..k + 2].copy_from_slice(&h.to_le_bytes());
        };
        match dtype {
            DType::Q8_0 => row.chunks_exact_mut(34).for_each(|b| scale(b, 0)),
            DType::Q4_0 => row.chunks_exact_mut(18).for_each(|b| scale(b, 0)),
            DType::Q4_K => row.chunks_exact_mut(144).for_each(|b| {
                scale(b, 0);
                scale(b, 2)
            }),
            DType::Q6_K => row.chunks_exact_mut(210).for_each(|b| scale(b, 208)),
            DType::BF16 => row.chunks_exact_mut(2).for_each(|b| b[1] = (b[1] & 0x80) | 0x3c | (b[1] & 1)),
            _ => unreachable!(),
        }
    });
    HostTensor { name: "w".into(), dtype, shape: vec![rows, cols], bytes: Bytes::owned(&bytes) }
}

/// Seconds per call of `f` over the weights, rotating through them: the median of 5 timed
/// rounds of `calls` calls each, after a warm-up round.
fn time_calls(g: &CudaBackend, weights: &[CudaWeight], calls: usize, mut f: impl FnMut(&CudaWeight)) -> f64 {
    let round = |f: &mut dyn FnMut(&CudaWeight)| {
        let t = Instant::now();
        for i in 0..calls {
            f(&weights[i % weights.len()]);
        }
        g.synchronize().unwrap();
        t.elapsed().as_secs_f64() / calls as f64
    };
    round(&mut f);
    let mut v: Vec<f64> = (0..5).map(|_| round(&mut f)).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[2]
}

fn main() -> strix::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let g = CudaBackend::new(0)?;
    println!("device: {} (sm_{}{})", g.device_name(), g.compute_capability().0, g.compute_capability().1);
    let bw = g.measure_copy_bandwidth(2 << 30, 20)?;
    println!("device-to-device copy bandwidth (read + write): {:.0} GB/s", bw / 1e9);
    println!();
    println!(
        "{:<6} {:<22} {:>9} {:>10} {:>8} {:>6} {:>10} {:>8} {:>6}",
        "format", "shape", "MB", "b1 us", "b1 GB/s", "b1 %", "b16 us", "b16 GB/s", "b16 %"
    );
    let mut summary = Vec::new();
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K, DType::BF16] {
        for &(rows, cols, name) in &SHAPES {
            if quick && rows > 100_000 {
                continue;
            }
            let bytes = rows * dtype.row_bytes(cols).unwrap();
            let copies = ROTATE_BYTES.div_ceil(bytes).clamp(1, 64);
            let weights: Vec<CudaWeight> = (0..copies)
                .map(|c| g.weight(&random_weight(dtype, rows, cols, c as u64 + 1), rows, cols))
                .collect::<strix::Result<_>>()?;
            let x: Vec<f32> = (0..16 * cols)
                .map(|i| ((splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32) - 0.5)
                .collect();
            let x = g.upload(&x);
            let mut out = g.zeros(16 * rows);
            let calls = (2 * copies).max((2e9 / bytes as f64) as usize).clamp(4, 400);
            let t1 = time_calls(&g, &weights, calls, |w| g.matmul(&x, 1, w, &mut out));
            let t16 = time_calls(&g, &weights, calls, |w| g.matmul_rows(&x, 16, w, &mut out));
            let (gb1, gb16) = (bytes as f64 / t1 / 1e9, bytes as f64 / t16 / 1e9);
            println!(
                "{:<6} {:<22} {:>9.1} {:>10.1} {:>8.0} {:>5.1}% {:>10.1} {:>8.0} {:>5.1}%",
                dtype.name(),
                name,
                bytes as f64 / 1e6,
                t1 * 1e6,
                gb1,
                100.0 * gb1 * 1e9 / bw,
                t16 * 1e6,
                gb16,
                100.0 * gb16 * 1e9 / bw
            );
            summary.push((dtype, name, bytes, t1, t16));
            // Prefill: 512 tokens through the dequantizing GEMM (bf16: cuBLAS directly).
            if rows < 100_000 {
                let tokens = 512;
                let xp = g.upload(&vec![0.25f32; tokens * cols]);
                let mut outp = g.zeros(tokens * rows);
                let tp = time_calls(&g, &weights, 10, |w| g.matmul(&xp, tokens, w, &mut outp));
                println!(
                    "{:<6} {:<22} prefill 512 tokens: {:.1} us = {:.0} TFLOP/s",
                    dtype.name(),
                    name,
                    tp * 1e6,
                    2.0 * (tokens * rows * cols) as f64 / tp / 1e12
                );
            }
        }
    }
    // Totals over the shapes: bytes of all four matrices over the time of one call of each.
    println!();
    println!("path counts: {}", g.path_counts());
    for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K, DType::BF16] {
        let rows: Vec<_> = summary.iter().filter(|r| r.0 == dtype).collect();
        let bytes: usize = rows.iter().map(|r| r.2).sum();
        let t1: f64 = rows.iter().map(|r| r.3).sum();
        let t16: f64 = rows.iter().map(|r| r.4).sum();
        println!(
            "{:<6} all shapes: batch 1 {:.0} GB/s ({:.1}%), batch 16 {:.0} GB/s ({:.1}%)",
            dtype.name(),
            bytes as f64 / t1 / 1e9,
            100.0 * bytes as f64 / t1 / bw,
            bytes as f64 / t16 / 1e9,
            100.0 * bytes as f64 / t16 / bw
        );
    }
    Ok(())
}
