//! Throughput of the packed-block matmul kernels (`backend::cpu::qmatmul`, weights repacked
//! into interleaved row groups as the CPU backend stores them) on Qwen3.5-0.8B shapes, and
//! the alternative for prefill that the module's choice was measured against: dequantizing
//! blocks of weight rows to f32 and multiplying with the `gemm` crate (`qmatmul::gemm_with`).
//! Prints one line per case.
//!
//! `cargo run --release -p strix --example qmatmul_bench`
//!
//! Decode (1 token) cycles through enough copies of the weights to overflow the caches and
//! reports GB/s of weights read; prefill reports GFLOP/s (2 · rows · cols · tokens). Medians
//! of the timed calls.

#[path = "common/bench.rs"]
mod bench;

use std::time::Instant;

use bench::{median, Random};

use strix::backend::cpu::qmatmul::{gemm_with, matmul, Packed, PackedKind};
use strix::quant::{quantize_row, QuantType};

fn pack(ty: QuantType, b: &[u8], rows: usize, cols: usize) -> Packed {
    let kind = match ty {
        QuantType::Q8_0 => PackedKind::Q8_0,
        QuantType::Q4_0 => PackedKind::Q4_0,
        QuantType::Q4_K => PackedKind::Q4_K,
        _ => PackedKind::Q6_K,
    };
    Packed::pack(kind, b, rows, cols)
}

/// Calibration on the same machine state: the bf16 GEMV (cold) and gemm prefill.
fn bf16_reference() {
    use strix::backend::cpu::matmul::{matmul as fmatmul, WeightRef};
    let (rows, cols) = (3584usize, 1024usize);
    let one: Vec<u16> = Random::new(9).bf16s(rows * cols, 0.5);
    let copies = ((512usize << 20) / (2 * one.len())).max(2);
    let ws: Vec<Vec<u16>> = (0..copies).map(|_| one.clone()).collect();
    let x = Random::new(3).vec(cols, 0.5);
    let mut out = vec![0f32; rows];
    let mut times = Vec::new();
    for i in 0..copies.max(40) {
        let t = Instant::now();
        fmatmul(&x, 1, WeightRef::Bf16(&ws[i % copies]), rows, cols, &mut out);
        times.push(t.elapsed().as_secs_f64());
    }
    let gemv = 2.0 * one.len() as f64 / median(&times) / 1e9;
    // Hot: one small matrix that stays in cache, to show the kernel's compute rate.
    let mut hot = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        fmatmul(&x, 1, WeightRef::Bf16(&one[..256 * cols]), 256, cols, &mut out[..256]);
        hot.push(t.elapsed().as_secs_f64());
    }
    let tokens = 512;
    let x = Random::new(5).vec(tokens * cols, 0.5);
    let mut out = vec![0f32; tokens * rows];
    let mut pre = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        fmatmul(&x, tokens, WeightRef::Bf16(&one), rows, cols, &mut out);
        pre.push(t.elapsed().as_secs_f64());
    }
    println!(
        "BF16 {rows}x{cols}: decode {gemv:.1} GB/s cold, {:.1} GFLOP/s hot; prefill 512: gemm {:.1} GFLOP/s",
        2.0 * (256 * cols) as f64 / median(&hot) / 1e9,
        2.0 * (rows * cols * tokens) as f64 / median(&pre) / 1e9
    );
}

fn main() {
    bf16_reference();
    let shapes = [(3584usize, 1024usize), (1024, 3584), (6144, 1024)];
    for ty in [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_K, QuantType::Q6_K] {
        for &(rows, cols) in &shapes {
            let row_bytes = ty.row_size(cols).unwrap();
            let one = {
                let wf = Random::new(7).vec(rows * cols, 0.5);
                let mut w = vec![0u8; rows * row_bytes];
                quantize_row(ty, &wf, &mut w).unwrap();
                w
            };
            // Decode: cycle through copies totalling ~512 MiB.
            let copies = ((512usize << 20) / one.len()).max(2);
            let ws: Vec<Packed> = (0..copies).map(|_| pack(ty, &one, rows, cols)).collect();
            let x = Random::new(3).vec(cols, 0.5);
            let mut out = vec![0f32; rows];
            let mut times = Vec::new();
            for i in 0..copies.max(40) {
                let t = Instant::now();
                matmul(&x, 1, &ws[i % copies], &mut out);
                times.push(t.elapsed().as_secs_f64());
            }
            let gemv = one.len() as f64 / median(&times) / 1e9;
            drop(ws);
            let hot_rows = 256;
            let hot_w = pack(ty, &one[..hot_rows * row_bytes], hot_rows, cols);
            let one = pack(ty, &one, rows, cols);
            let mut hot = Vec::new();
            for _ in 0..200 {
                let t = Instant::now();
                matmul(&x, 1, &hot_w, &mut out[..hot_rows]);
                hot.push(t.elapsed().as_secs_f64());
            }
            let hot = 2.0 * (hot_rows * cols) as f64 / median(&hot) / 1e9;
            // Prefill: 512 tokens, int8 path and dequant + gemm.
            let tokens = 512;
            let x = Random::new(5).vec(tokens * cols, 0.5);
            let mut out = vec![0f32; tokens * rows];
            let flop = 2.0 * (rows * cols * tokens) as f64;
            let mut int8 = Vec::new();
            let mut deq = Vec::new();
            for _ in 0..3 {
                let t = Instant::now();
                matmul(&x, tokens, &one, &mut out);
                int8.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                gemm_with(&x, tokens, &one, &mut out);
                deq.push(t.elapsed().as_secs_f64());
            }
            println!(
                "{ty} {rows}x{cols}: decode {gemv:.1} GB/s cold, {hot:.1} GFLOP/s hot; prefill 512: int8 {:.1} GFLOP/s, dequant+gemm {:.1} GFLOP/s",
                flop / median(&int8) / 1e9,
                flop / median(&deq) / 1e9
            );
        }
    }
}
