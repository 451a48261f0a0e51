//! Matrix multiplication against weights in the GGML block formats (Q8_0, Q4_0, Q4_K, Q6_K):
//! `out = x · Wᵀ` with integer dot products, as GGML's CPU backend computes them, on weights
//! repacked at load into groups of eight interleaved rows ([`super::qpacked`], which holds
//! the layouts and kernels and says what is exact).
//!
//! The activations are quantized first, per token row, to 8 bits: in 32-weight blocks for
//! Q8_0 and Q4_0 weights, in 256-weight super-blocks (with the sums of every 32 and every 16
//! of them, for Q4_K's block minimums and the offsets of the unsigned weight codes) for the
//! k-quants, each block with an f32 scale `amax / 127` and `q = round_half_even(x · 127 /
//! amax)`. Quantization is scalar code for every ISA, so the quantized values never depend on
//! the kernel family; the kernels (portable, AVX2, AVX-512 VNNI) give the same bits, and a
//! (row, token) result never depends on which other rows or tokens share its tile:
//! [`matmul_rows`] is batch-invariant by construction.
//!
//! **Prefill.** [`matmul`] takes the same int8 kernels for every token count (four tokens
//! per tile, so each unpacked weight vector is used four times from registers), which ran
//! prefill faster than dequantizing weight tiles into the f32 `gemm` path
//! (`examples/qmatmul_bench.rs`); that path is kept as [`gemm_with`] for the comparison.

use rayon::prelude::*;

use super::matmul::for_each_block;
use super::simd::{Isa, SharedMut};

/// Which kernels run: the backend's ISA choice, refined by AVX-512 VNNI where the CPU has it
/// (`vpdpbusd` sums four u8 × i8 products into an i32 lane in one instruction: the same
/// integers as `maddubs` + `madd`, so the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kern {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kern {
    pub(crate) fn detect() -> Kern {
        match Isa::detect() {
            Isa::Portable => Kern::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                let vnni = *VNNI.get_or_init(|| {
                    is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
                });
                if vnni {
                    Kern::Vnni
                } else {
                    Kern::Avx2
                }
            }
        }
    }

    /// The kernels a backend built with `options` runs: the best this CPU has, or AVX2 in
    /// place of AVX-512 VNNI when the options say so.
    pub(crate) fn chosen(options: &super::CpuOptions) -> Kern {
        match Kern::detect() {
            #[cfg(target_arch = "x86_64")]
            Kern::Vnni if options.no_vnni => Kern::Avx2,
            kern => kern,
        }
    }
}

pub use super::qpacked::{Packed, PackedKind};

/// `out[t * rows + r] = Σ_c x[t * cols + c] · w[r, c]`; `out` is overwritten; `x` quantized
/// to 8 bits per block as the module describes. The best kernels this CPU has.
pub fn matmul(x: &[f32], tokens: usize, w: &Packed, out: &mut [f32]) {
    matmul_with(Kern::detect(), x, tokens, w, out)
}

/// [`matmul`] on the kernels `kern` names (the backend's choice). Every (row, token) result is
/// computed by the same sequence of operations whatever the batch, so a decode batch's row `t`
/// is bitwise the result of multiplying it alone.
pub(crate) fn matmul_with(kern: Kern, x: &[f32], tokens: usize, w: &Packed, out: &mut [f32]) {
    w.matmul(kern, x, tokens, out)
}

/// Weight rows dequantized per gemm call, and the widest column tile (a multiple of every
/// block size), as in the float GEMM path: 128 × 4096 f32 = 2 MiB of scratch per thread.
const GEMM_BLOCK_ROWS: usize = 128;
const GEMM_MIN_BLOCK_ROWS: usize = 32;
const GEMM_MAX_COLS: usize = 4096;

/// The alternative for prefill that [`matmul`] was measured against (kept for
/// `examples/qmatmul_bench.rs`): blocks of weight rows dequantized into a thread-local f32
/// tile and multiplied by the `gemm` crate, the activations used unquantized.
pub fn gemm_with(x: &[f32], tokens: usize, w: &Packed, out: &mut [f32]) {
    use std::cell::RefCell;
    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    let (rows, cols) = (w.rows(), w.cols());
    if super::matmul::settled_product("qmatmul", x, tokens, rows, cols, out) {
        return;
    }
    let bw = w.kind().block();
    // Equal column tiles of whole blocks, at most GEMM_MAX_COLS wide.
    let nblocks = cols / bw;
    let tiles = cols.div_ceil(GEMM_MAX_COLS);
    let kb = nblocks.div_ceil(tiles);
    let per_thread = rows.div_ceil(2 * rayon::current_num_threads());
    let block = per_thread.next_multiple_of(8).clamp(GEMM_MIN_BLOCK_ROWS, GEMM_BLOCK_ROWS);
    // Every parallel block writes the output columns of its own weight rows only.
    let out = SharedMut::new(out);
    for_each_block(rows, block, rows > block, |r0, r1| {
        let n = r1 - r0;
        SCRATCH.with(|s| {
            // Nothing in here re-enters rayon, so this borrow is never taken twice.
            let mut s = s.borrow_mut();
            if s.len() < n * kb * bw {
                s.resize(n * kb * bw, 0.0);
            }
            let mut b0 = 0;
            while b0 < nblocks {
                let nb = kb.min(nblocks - b0);
                let k = nb * bw;
                let tile = &mut s[..n * k];
                for (j, dst) in tile.chunks_exact_mut(k).enumerate() {
                    w.dequantize(r0 + j, b0, dst);
                }
                let c0 = b0 * bw;
                // SAFETY: the window at column r0 of `out` belongs to this block alone;
                // x[:, c0..c0 + k] and the tile are in bounds. The first tile overwrites it,
                // later ones add.
                unsafe {
                    super::matmul::gemm_tile(out, r0, rows, b0 > 0, &x[c0..], cols, tokens, tile, n, k);
                }
                b0 += nb;
            }
        });
    });
}

/// Row `r` of `W` dequantized into `out` (`out.len() == cols`); the embedding gather.
pub fn row_to_f32(w: &Packed, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), w.cols(), "row_to_f32: out length");
    assert!(r < w.rows(), "row_to_f32: row {r} out of range");
    w.dequantize(r, 0, out);
}

// ------------------------------------------------------------------------------------
// Activations

/// `v.round_ties_even()` for |v| <= 2²²: adding and subtracting 1.5 · 2²³ leaves `v` rounded
/// to an integer in the current (round-to-nearest-even) mode. Unlike the libm call that
/// `round_ties_even` becomes without SSE4.1, this inlines and vectorizes; NaN stays NaN.
#[inline]
fn round_ties_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// Activation rows quantized to 8 bits: `tokens` rows of `cols`, blocks of `block` values
/// (32 or 256) with one f32 scale each, and the sum of every 32 quantized values.
pub(crate) struct Acts {
    cols: usize,
    block: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
    /// The sum of every 16 quantized values (Q6_K's scale groups).
    sums16: Vec<i16>,
}

/// One token's row of [`Acts`].
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub(super) qs: &'a [i8],
    pub(super) d: &'a [f32],
    pub(super) sums: &'a [i16],
    pub(super) sums16: &'a [i16],
}

impl Acts {
    /// Quantizes `x` (`tokens` rows of `cols`, `cols` a multiple of `block`). Scalar code for
    /// every ISA, so the quantized values never depend on the kernel family.
    pub(crate) fn quantize(x: &[f32], tokens: usize, cols: usize, block: usize) -> Acts {
        let nb = cols / block;
        let mut a = Acts {
            cols,
            block,
            qs: vec![0; tokens * cols],
            d: vec![0.0; tokens * nb],
            sums: vec![0; tokens * cols / 32],
            sums16: Vec::new(),
        };
        type Row<'a> = ((&'a [f32], &'a mut [i8]), (&'a mut [f32], &'a mut [i16]));
        let one_row = |((x, qs), (d, sums)): Row| {
            for (((x, qs), d), sums) in x
                .chunks_exact(block)
                .zip(qs.chunks_exact_mut(block))
                .zip(d.iter_mut())
                .zip(sums.chunks_mut(block / 32))
            {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                *d = amax / 127.0;
                let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                for (q, &v) in qs.iter_mut().zip(x) {
                    // |v · id| <= 127 up to one rounding, so the cast never saturates on
                    // finite input (NaN becomes 0).
                    *q = round_ties_even(v * id) as i8;
                }
                for (s, q) in sums.iter_mut().zip(qs.chunks_exact(32)) {
                    *s = q.iter().map(|&q| q as i16).sum();
                }
            }
        };
        let rows = x.chunks_exact(cols).zip(a.qs.chunks_exact_mut(cols));
        let meta = a.d.chunks_exact_mut(nb).zip(a.sums.chunks_exact_mut(cols / 32));
        if tokens * cols >= 1 << 16 {
            rows.zip(meta).par_bridge().for_each(one_row);
        } else {
            rows.zip(meta).for_each(one_row);
        }
        a.sums16 = a.qs.chunks_exact(16).map(|q| q.iter().map(|&v| v as i16).sum()).collect();
        a
    }

    pub(super) fn row(&self, t: usize) -> ActRow<'_> {
        let nb = self.cols / self.block;
        ActRow {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            d: &self.d[t * nb..(t + 1) * nb],
            sums: &self.sums[t * self.cols / 32..(t + 1) * self.cols / 32],
            sums16: &self.sums16[t * self.cols / 16..(t + 1) * self.cols / 16],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{self, QuantType};
    use crate::testing::Rng;

    const TYPES: [QuantType; 4] = [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_K, QuantType::Q6_K];

    fn kind(ty: QuantType) -> PackedKind {
        match ty {
            QuantType::Q8_0 => PackedKind::Q8_0,
            QuantType::Q4_0 => PackedKind::Q4_0,
            QuantType::Q4_K => PackedKind::Q4_K,
            QuantType::Q6_K => PackedKind::Q6_K,
            _ => unreachable!(),
        }
    }

    fn pack(ty: QuantType, w: &[u8], rows: usize, cols: usize) -> Packed {
        Packed::pack(kind(ty), w, rows, cols)
    }

    /// Random rows whose magnitude varies from block to block (so block scales differ by
    /// orders of magnitude), quantized with the GGML reference quantizer.
    fn random_weights(rng: &mut Rng, ty: QuantType, rows: usize, cols: usize) -> Vec<u8> {
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let scale = 1.0 + 3.0 * ((i / 32) % 7) as f32;
                rng.f32() * scale
            })
            .collect();
        let mut bytes = vec![0u8; rows * ty.row_size(cols).unwrap()];
        quant::quantize_row(ty, &x, &mut bytes).unwrap();
        bytes
    }

    fn random_x(rng: &mut Rng, n: usize) -> Vec<f32> {
        // Block magnitudes varying too, and a few large outliers.
        (0..n).map(|i| rng.f32() * (0.1 + (i % 97) as f32 / 10.0)).collect()
    }

    fn isas() -> Vec<Kern> {
        let mut v = vec![Kern::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if Kern::detect() != Kern::Portable {
                v.push(Kern::Avx2);
            }
            if Kern::detect() == Kern::Vnni {
                v.push(Kern::Vnni);
            }
        }
        v
    }

    /// The products a kernel is checked against, in f64, from the dequantized weights:
    /// `quantized_x`, with the *quantized* activations (the kernels may differ from it only by
    /// f32 rounding of the block sums); `f32_x`, with the f32 activations, and `bound`, the
    /// distance activation quantization allows from it: Σ_c |w_c| · d_x(c) / 2 (each
    /// activation is rounded to the nearest multiple of its block's scale).
    struct References {
        quantized_x: Vec<f64>,
        f32_x: Vec<f64>,
        bound: Vec<f64>,
    }

    fn references(ty: QuantType, w: &[u8], x: &[f32], tokens: usize, rows: usize, cols: usize) -> References {
        let wf = dequantized(ty, w, rows * cols);
        let block = if ty.block_size() == 256 { 256 } else { 32 };
        let acts = Acts::quantize(x, tokens, cols, block);
        let n = tokens * rows;
        let mut r = References { quantized_x: vec![0f64; n], f32_x: vec![0f64; n], bound: vec![0f64; n] };
        for t in 0..tokens {
            let a = acts.row(t);
            let xq: Vec<f64> = (0..cols).map(|c| a.qs[c] as f64 * a.d[c / block] as f64).collect();
            for row in 0..rows {
                let w = &wf[row * cols..(row + 1) * cols];
                let i = t * rows + row;
                r.quantized_x[i] = (0..cols).map(|c| w[c] as f64 * xq[c]).sum();
                r.f32_x[i] = (0..cols).map(|c| w[c] as f64 * x[t * cols + c] as f64).sum();
                r.bound[i] = (0..cols).map(|c| w[c].abs() as f64 * a.d[c / block] as f64 * 0.5).sum();
            }
        }
        r
    }

    fn dequantized(ty: QuantType, w: &[u8], n: usize) -> Vec<f32> {
        let mut wf = vec![0f32; n];
        quant::dequantize_row(ty, w, &mut wf).unwrap();
        wf
    }

    /// max |a − b| / max |b|.
    fn rel_err(a: &[f32], b: &[f64]) -> f64 {
        let max_ref = b.iter().fold(0f64, |m, v| m.max(v.abs()));
        let max_err = a.iter().zip(b).fold(0f64, |m, (&a, &b)| m.max((a as f64 - b).abs()));
        max_err / max_ref.max(1e-30)
    }

    /// Against both references on awkward shapes: 1 row, odd rows, 1..k blocks of columns,
    /// token counts around the tile of four. Tolerances:
    /// - vs the same quantized activations in f64: max |Δ| / max |ref| <= 1e-5 (f32 rounding
    ///   of the block sums);
    /// - vs the f32 activations: |Δ| <= Σ_c |w_c| · d_x / 2 (the activation rounding bound,
    ///   per output) + 1e-5 · max |ref|. The max |Δ| / max |ref| reached is printed.
    #[test]
    fn matches_dequantized_references() {
        let mut rng = Rng(0x5eed_1234_abcd_ef01);
        let mut worst = [[0f64; 2]; 4];
        for (k, ty) in TYPES.into_iter().enumerate() {
            let bs = ty.block_size();
            for &rows in &[1usize, 3, 17, 64] {
                for nblocks in [1usize, 2, 3, 5] {
                    let cols = nblocks * bs;
                    for &tokens in &[1usize, 2, 4, 5, 9] {
                        let w = random_weights(&mut rng, ty, rows, cols);
                        let x = random_x(&mut rng, tokens * cols);
                        let References { quantized_x: exact, f32_x: loose, bound } =
                            references(ty, &w, &x, tokens, rows, cols);
                        let max_ref = loose.iter().fold(0f64, |m, v| m.max(v.abs()));
                        for isa in isas() {
                            let mut out = vec![f32::NAN; tokens * rows];
                            matmul_with(isa, &x, tokens, &pack(ty, &w, rows, cols), &mut out);
                            let what = format!("{ty} {isa:?} rows={rows} cols={cols} tokens={tokens}");
                            let e = rel_err(&out, &exact);
                            assert!(e <= 1e-5, "{what}: {e:e} vs quantized-x reference");
                            for (i, ((&o, &l), &b)) in out.iter().zip(&loose).zip(&bound).enumerate() {
                                let d = (o as f64 - l).abs();
                                assert!(
                                    d <= b + 1e-5 * max_ref,
                                    "{what}: output {i} off by {d:e}, bound {b:e}"
                                );
                            }
                            worst[k] = [worst[k][0].max(e), worst[k][1].max(rel_err(&out, &loose))];
                        }
                    }
                }
            }
        }
        for (ty, [e, l]) in TYPES.iter().zip(worst) {
            eprintln!("{ty}: max rel err {e:.2e} vs quantized-x f64, {l:.2e} vs f32-x f64");
        }
    }

    /// The AVX2 and portable kernels give the same bits, and so does every tiling: each
    /// token alone equals the batched product (batch invariance).
    #[test]
    fn kernels_and_tilings_agree_bitwise() {
        let mut rng = Rng(77);
        for ty in TYPES {
            let (rows, cols) = (37, 3 * ty.block_size().max(256));
            let w = random_weights(&mut rng, ty, rows, cols);
            for tokens in [1usize, 3, 4, 7, 12] {
                let x = random_x(&mut rng, tokens * cols);
                let mut runs = Vec::new();
                for isa in isas() {
                    let mut batched = vec![f32::NAN; tokens * rows];
                    matmul_with(isa, &x, tokens, &pack(ty, &w, rows, cols), &mut batched);
                    for t in 0..tokens {
                        let mut one = vec![f32::NAN; rows];
                        matmul_with(
                            isa,
                            &x[t * cols..(t + 1) * cols],
                            1,
                            &pack(ty, &w, rows, cols),
                            &mut one,
                        );
                        let same =
                            one.iter().zip(&batched[t * rows..]).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{ty} {isa:?} tokens={tokens}: token {t} alone differs from the batch");
                    }
                    runs.push(batched);
                }
                for r in &runs[1..] {
                    let same = r.iter().zip(&runs[0]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{ty} tokens={tokens}: AVX2 and portable differ");
                }
            }
        }
    }

    /// Large enough to run in parallel blocks; the public entry points agree with the
    /// single-threaded portable kernel bitwise.
    #[test]
    fn parallel_blocks_match() {
        let mut rng = Rng(3);
        for ty in TYPES {
            let (rows, cols) = (301, 1024);
            let w = random_weights(&mut rng, ty, rows, cols);
            for tokens in [1usize, 6] {
                let x = random_x(&mut rng, tokens * cols);
                let mut a = vec![f32::NAN; tokens * rows];
                matmul(&x, tokens, &pack(ty, &w, rows, cols), &mut a);
                let mut b = vec![f32::NAN; tokens * rows];
                matmul(&x, tokens, &pack(ty, &w, rows, cols), &mut b);
                let mut c = vec![f32::NAN; tokens * rows];
                matmul_with(Kern::Portable, &x, tokens, &pack(ty, &w, rows, cols), &mut c);
                assert!(a.iter().zip(&c).all(|(a, c)| a.to_bits() == c.to_bits()), "{ty}");
                assert!(b.iter().zip(&c).all(|(a, c)| a.to_bits() == c.to_bits()), "{ty}");
            }
        }
    }

    /// The prefill path (dequantized tiles, f32 activations) against the f64 product of the
    /// dequantized weights and the f32 activations: max |Δ| / max |ref| <= 1e-5, on shapes
    /// with several column tiles and row blocks.
    #[test]
    fn gemm_path_matches_f64() {
        let mut rng = Rng(21);
        for ty in TYPES {
            for (rows, cols) in [(1usize, 256usize), (37, 768), (300, 2 * GEMM_MAX_COLS + 256)] {
                let w = random_weights(&mut rng, ty, rows, cols);
                for tokens in [1, 64, 71] {
                    let x = random_x(&mut rng, tokens * cols);
                    let want = references(ty, &w, &x, tokens, rows, cols).f32_x;
                    let mut got = vec![f32::NAN; tokens * rows];
                    gemm_with(&x, tokens, &pack(ty, &w, rows, cols), &mut got);
                    let e = rel_err(&got, &want);
                    assert!(e <= 1e-5, "{ty} rows={rows} cols={cols} tokens={tokens}: {e:e}");
                }
            }
        }
    }

    /// Extreme blocks: all-zero activations and weights give exact zeros; the most negative
    /// Q8_0 weight (−128, which GGML's quantizer never writes but a file may hold) is exact.
    #[test]
    fn edge_blocks() {
        for isa in isas() {
            let mut w = vec![0u8; crate::quant::blocks::Q8_0_BYTES];
            w[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            for (i, b) in w[2..].iter_mut().enumerate() {
                *b = if i % 2 == 0 { 0x80 } else { 127 };
            }
            let x: Vec<f32> = (0..32).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
            let mut out = [f32::NAN];
            matmul_with(isa, &x, 1, &Packed::pack(PackedKind::Q8_0, &w, 1, 32), &mut out);
            // Σ 16·(−128·1 + 127·(−1)) · 0.5 · (1/127 · 127) = −2040.
            assert_eq!(out[0], -2040.0, "{isa:?}");
            matmul_with(isa, &[0.0; 32], 1, &Packed::pack(PackedKind::Q8_0, &w, 1, 32), &mut out);
            assert_eq!(out[0], 0.0);
        }
    }

    /// The inlined rounding equals `f32::round_ties_even` on the range the quantizer uses,
    /// ties included.
    #[test]
    fn rounding_is_ties_even() {
        let mut rng = Rng(11);
        let ties = (-260..=260).map(|i| i as f32 * 0.5);
        let random = (0..100_000).map(|_| rng.f32() * 130.0);
        for v in ties.chain(random).chain([0.0, -0.0, 127.0, -127.0, 4194304.0, -4194303.5]) {
            assert_eq!(round_ties_even(v), v.round_ties_even(), "{v}");
        }
        assert!(round_ties_even(f32::NAN).is_nan());
    }

    #[test]
    fn row_to_f32_dequantizes() {
        let mut rng = Rng(5);
        for ty in TYPES {
            let (rows, cols) = (3, 2 * ty.block_size());
            let w = random_weights(&mut rng, ty, rows, cols);
            let all = dequantized(ty, &w, rows * cols);
            for r in 0..rows {
                let mut out = vec![f32::NAN; cols];
                row_to_f32(&pack(ty, &w, rows, cols), r, &mut out);
                assert_eq!(out, all[r * cols..(r + 1) * cols]);
            }
        }
    }
}
