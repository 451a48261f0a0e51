//! What the benchmarks share besides the GPU: seeded random data (weights of any stored type,
//! f32 vectors, bf16 bit patterns) and medians of timings. Data is random, never zeros or
//! constants, because those can run faster than real weights.

#![allow(dead_code)] // each benchmark uses some of it

use rayon::prelude::*;
use strix::tensor::{Bytes, DType, HostTensor};

/// SplitMix64: a well-mixed 64-bit value of `z` (a counter makes a stream).
pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random `[rows, cols]` weight of `dtype`: random bytes, with every f16 scale field set to a
/// finite value in [2^-10, 2^-6) and bf16 elements to finite values in ±[2^-7, 2^-3).
pub fn random_weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> HostTensor {
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
            _ => unreachable!("random_weight: {dtype:?}"),
        }
    });
    HostTensor { name: "w".into(), dtype, shape: vec![rows, cols], bytes: Bytes::owned(&bytes) }
}

/// `n` values uniform in [-0.5, 0.5), the same ones at every call (a SplitMix64 counter).
pub fn fixed_values(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32) - 0.5).collect()
}

/// A seeded xorshift stream of uniform values.
pub struct Random(u64);

impl Random {
    pub fn new(seed: u64) -> Random {
        Random(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// `n` values uniform in ±`scale`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        let mut next = || {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        (0..n).map(|_| next() * scale).collect()
    }

    /// `n` values uniform in ±`scale`, as bf16 bit patterns (each f32 truncated).
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<u16> {
        self.vec(n, scale).iter().map(|v| (v.to_bits() >> 16) as u16).collect()
    }
}

/// The middle of `v` in order (the upper middle for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// The median of 5 timed rounds of `round` (which returns seconds), after a warm-up round.
pub fn median_of_rounds(mut round: impl FnMut() -> f64) -> f64 {
    round();
    let v: Vec<f64> = (0..5).map(|_| round()).collect();
    median(&v)
}
