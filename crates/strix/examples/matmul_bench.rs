//! Throughput of the CPU matmul kernels on Qwen3.5-0.8B shapes, next to the machine's plain
//! read bandwidth so that the GEMV numbers can be judged. Prints a table, then one JSON line.
//!
//! `cargo run --release -p strix --example matmul_bench [-- --quick]`
//!
//! "cold" runs rotate through enough copies of the weights to overflow the last-level cache,
//! which is what a decode step sees (the whole model streams through once per token); "hot"
//! repeats one matrix, which may then sit in L3. Rates use the median call; `best` uses the
//! fastest. `cpu` is the share of the rayon threads' wall time they actually ran (from
//! /proc/self/task/*/schedstat): well under 100% means other processes were competing for
//! the cores and the rates understate the kernels.

#[path = "common/bench.rs"]
mod bench;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bench::Random;
use rayon::prelude::*;
use strix::backend::cpu::matmul::{matmul, WeightRef};

/// Bytes of distinct weights a cold run cycles through: many times any L3 we expect.
const COLD_BYTES: usize = 512 << 20;

/// CPU time consumed by this process so far (all threads), where Linux reports it.
fn cpu_seconds() -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 * 1e-9)
}

struct Timing {
    median: f64,
    best: f64,
    /// Fraction of `threads × wall` that the process spent running.
    cpu_share: Option<f64>,
}

/// Times `f(i)` for at least `min_time` and 5 calls, after one warm-up call.
fn time(min_time: Duration, mut f: impl FnMut(usize)) -> Timing {
    f(0);
    let threads = rayon::current_num_threads() as f64;
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut i = 1;
    while samples.len() < 5 || start.elapsed() < min_time {
        let t = Instant::now();
        f(i);
        samples.push(t.elapsed().as_secs_f64());
        i += 1;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu_share = match (cpu0, cpu_seconds()) {
        (Some(a), Some(b)) => Some((b - a) / (wall * threads)),
        _ => None,
    };
    samples.sort_by(f64::total_cmp);
    Timing { median: samples[samples.len() / 2], best: samples[0], cpu_share }
}

struct Row {
    name: String,
    unit: &'static str,
    /// Bytes or flops per call.
    work: f64,
    timing: Timing,
}

impl Row {
    fn rate(&self, seconds: f64) -> f64 {
        self.work / seconds / 1e9
    }
}

/// All-core rate of summing a `bytes`-long buffer: the ceiling for a kernel that streams its
/// operand once.
fn read_bandwidth(min_time: Duration, bytes: usize, cold: bool) -> Row {
    let copies = if cold { (COLD_BYTES / bytes).max(1) } else { 1 };
    let bufs: Vec<Vec<u64>> = (0..copies).map(|c| vec![c as u64 + 1; bytes / 8]).collect();
    let timing = time(min_time, |i| {
        let sum: u64 = bufs[i % copies]
            .par_chunks(16 << 10)
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .sum();
        black_box(sum);
    });
    let temp = if cold { "cold" } else { "hot" };
    Row { name: format!("read {} MiB {temp}", bytes >> 20), unit: "GB/s", work: bytes as f64, timing }
}

fn gemv(min_time: Duration, rng: &mut Random, rows: usize, cols: usize, cold: bool) -> Row {
    let bytes = rows * cols * 2;
    let copies = if cold { (COLD_BYTES / bytes).max(1) } else { 1 };
    let ws: Vec<Vec<u16>> = (0..copies).map(|_| rng.bf16s(rows * cols, 0.5)).collect();
    let x = rng.vec(cols, 0.5);
    let mut out = vec![0.0f32; rows];
    let timing = time(min_time, |i| {
        matmul(&x, 1, WeightRef::Bf16(&ws[i % copies]), rows, cols, &mut out);
        black_box(&out);
    });
    let temp = if cold { "cold" } else { "hot" };
    Row { name: format!("gemv bf16 {rows}x{cols} t=1 {temp}"), unit: "GB/s", work: bytes as f64, timing }
}

fn matmul_case(min_time: Duration, rng: &mut Random, tokens: usize, rows: usize, cols: usize) -> Row {
    let w = rng.bf16s(rows * cols, 0.5);
    let x = rng.vec(tokens * cols, 0.5);
    let mut out = vec![0.0f32; tokens * rows];
    let timing = time(min_time, |_| {
        matmul(&x, tokens, WeightRef::Bf16(&w), rows, cols, &mut out);
        black_box(&out);
    });
    Row {
        name: format!("matmul bf16 {rows}x{cols} t={tokens}"),
        unit: "GFLOP/s",
        work: 2.0 * (tokens * rows * cols) as f64,
        timing,
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let min_time = Duration::from_millis(if quick { 200 } else { 1500 });
    let threads = rayon::current_num_threads();
    let mut rng = Random::new(0x5eed);

    let mut rows = vec![
        read_bandwidth(min_time, 512 << 20, true),
        read_bandwidth(min_time, 7 << 20, true),
        read_bandwidth(min_time, 7 << 20, false),
    ];
    for (r, c) in [(1024, 3584), (3584, 1024)] {
        rows.push(gemv(min_time, &mut rng, r, c, true));
        rows.push(gemv(min_time, &mut rng, r, c, false));
    }
    rows.push(gemv(min_time, &mut rng, 248_320, 1024, true));
    for tokens in [4, 16, 64, 128, 256, 512] {
        rows.push(matmul_case(min_time, &mut rng, tokens, 1024, 3584));
    }
    for tokens in [128, 512] {
        rows.push(matmul_case(min_time, &mut rng, tokens, 3584, 1024));
    }

    println!("rayon threads: {threads}");
    println!("{:<34} {:>9} {:>9} {:>8} {:>10}", "case", "median", "best", "unit", "cpu");
    for r in &rows {
        let share = r.timing.cpu_share.map_or("n/a".to_string(), |s| format!("{:.0}%", s * 100.0));
        println!(
            "{:<34} {:>9.1} {:>9.1} {:>8} {:>10}",
            r.name,
            r.rate(r.timing.median),
            r.rate(r.timing.best),
            r.unit,
            share
        );
    }
    let cases: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"case\":\"{}\",\"unit\":\"{}\",\"median\":{:.2},\"best\":{:.2},\"ms\":{:.4},\"cpu_share\":{}}}",
                r.name,
                r.unit,
                r.rate(r.timing.median),
                r.rate(r.timing.best),
                r.timing.median * 1e3,
                r.timing.cpu_share.map_or("null".to_string(), |s| format!("{s:.3}"))
            )
        })
        .collect();
    println!("{{\"threads\":{threads},\"results\":[{}]}}", cases.join(","));
}
