//! Matrix multiplication against weights in the GGML block formats (Q8_0, Q4_0, Q4_K, Q6_K),
//! read in their packed form: `out = x · Wᵀ` with integer dot products, as GGML's CPU backend
//! computes them.
//!
//! The activations are quantized first, per token row, to 8 bits: in 32-weight blocks for
//! Q8_0 and Q4_0 weights, in 256-weight super-blocks (with the sums of every 32 of them, for
//! Q4_K's block minimums) for the k-quants, each block with an f32 scale `amax / 127` and
//! `q = round_half_even(x · 127 / amax)`. Each weight block is then dotted with the
//! activation block in integers (AVX2: `maddubs` / `madd`, like GGML's `vec_dot_*`), and the
//! integer sums are scaled and accumulated in f32. Where the CPU has AVX-512 VNNI, the Q8_0
//! and Q4_0 kernels use `vpdpbusd` on 256-bit registers instead (Q4_0's −8 nibble offset
//! enters as the accumulation's start value, precomputed per activation block); the integers
//! are the same, so are the results.
//!
//! **What is exact.** Every integer partial sum is exact, and each is converted to f32
//! exactly (all stay below 2²⁴, see the kernels). The float part has one fixed order, which
//! the AVX2 and portable kernels both follow: eight accumulators, accumulator `l` taking the
//! integer sum of the weights whose index within their 32-aligned chunk lies in `4l..4l+4`
//! (the i32 lanes of an AVX2 `madd`), scaled by the block's `d_w · d_x` and added with a
//! separate multiply and add (no FMA), block after block; then the eight lanes are summed
//! pairwise (`(l0+l4 + l2+l6) + (l1+l5 + l3+l7)`). So the two kernel families give the same
//! bits, and a (row, token) result never depends on which other rows or tokens share its
//! tile: [`matmul_rows`] is batch-invariant by construction.
//!
//! **Tiling.** Decode (one token) streams each weight row once. With a few tokens (decode
//! batches, short prompts), a block of weight rows (a few tens of KiB, so it stays in L2) is
//! taken against the tokens four at a time: each weight block is unpacked once per four
//! tokens, and those four activation rows stay in L1.
//!
//! **Prefill.** From [`GEMM_MIN_TOKENS`] tokens on, [`matmul`] instead dequantizes blocks of
//! weight rows into an f32 tile and multiplies with the `gemm` crate, like the float path: on
//! the 0.8B shapes this ran 1.3–2.0× faster than the int8 tiles for every format on a loaded
//! machine, and level with them on an idle one (`examples/qmatmul_bench.rs`). Its activations are not quantized, so a prompt's logits
//! differ from a token-by-token decode of it by the activation rounding (as for the float
//! path, where GEMV and gemm differ by summation order). [`matmul_rows`] (decode batches)
//! always takes the int8 path, which is what keeps it batch-invariant.

use rayon::prelude::*;

use super::matmul::for_each_block;
use super::simd::Isa;

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
                // STRIX_NO_VNNI=1 keeps the AVX2 kernels, to measure one against the other.
                let vnni = *VNNI.get_or_init(|| {
                    is_x86_feature_detected!("avx512vnni")
                        && is_x86_feature_detected!("avx512vl")
                        && std::env::var_os("STRIX_NO_VNNI").is_none_or(|v| v.is_empty() || v == "0")
                });
                if vnni {
                    Kern::Vnni
                } else {
                    Kern::Avx2
                }
            }
        }
    }
}
use crate::quant::blocks::{
    q4_k_scale_min, Q4_0_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q8_0_BYTES, QK4_0, QK8_0, QK_K,
};

/// A `[rows, cols]` weight matrix in a block format: each row is `cols / block` whole blocks.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug)]
pub enum QuantRef<'a> {
    Q8_0(&'a [u8]),
    Q4_0(&'a [u8]),
    Q4_K(&'a [u8]),
    Q6_K(&'a [u8]),
}

impl QuantRef<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            QuantRef::Q8_0(b) | QuantRef::Q4_0(b) | QuantRef::Q4_K(b) | QuantRef::Q6_K(b) => b,
        }
    }

    /// (weights per block, bytes per block)
    fn block(&self) -> (usize, usize) {
        match self {
            QuantRef::Q8_0(_) => (QK8_0, Q8_0_BYTES),
            QuantRef::Q4_0(_) => (QK4_0, Q4_0_BYTES),
            QuantRef::Q4_K(_) => (QK_K, Q4_K_BYTES),
            QuantRef::Q6_K(_) => (QK_K, Q6_K_BYTES),
        }
    }

    fn row_bytes(&self, cols: usize) -> usize {
        let (n, b) = self.block();
        cols / n * b
    }

    fn check(&self, rows: usize, cols: usize, what: &str) {
        let (n, _) = self.block();
        assert!(cols.is_multiple_of(n), "{what}: {cols} columns is not a whole number of {n}-weight blocks");
        assert_eq!(self.bytes().len(), rows * self.row_bytes(cols), "{what}: W is not [rows, cols]");
    }
}

/// From this many tokens on, [`matmul`] dequantizes weight tiles into the f32 `gemm` path.
/// Measured on the 0.8B shapes (examples/qmatmul_bench.rs, Zen 4, 2 threads): dequantize +
/// gemm ran prefill at 1.3–2.0× the int8 tiles for every format at 512 tokens while other
/// builds loaded the machine; on the idle machine the two were level (±10 %).
pub const GEMM_MIN_TOKENS: usize = 64;

/// `out[t * rows + r] = Σ_c x[t * cols + c] · w[r, c]`; `out` is overwritten. Up to
/// [`GEMM_MIN_TOKENS`] tokens with `x` quantized to 8 bits per block as the module describes,
/// beyond that with `x` in f32 against dequantized weight tiles.
pub fn matmul(x: &[f32], tokens: usize, w: QuantRef<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    if tokens >= GEMM_MIN_TOKENS {
        gemm_with(x, tokens, w, rows, cols, out)
    } else {
        matmul_with(Kern::detect(), x, tokens, w, rows, cols, out)
    }
}

/// [`matmul`] for a decode batch: always the int8 kernels, where every (row, token) result is
/// computed by the same sequence of operations whatever the batch, so row `t` is bitwise the
/// result of multiplying it alone.
pub fn matmul_rows(x: &[f32], tokens: usize, w: QuantRef<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    matmul_with(Kern::detect(), x, tokens, w, rows, cols, out)
}

/// Weight rows dequantized per gemm call, and the widest column tile (a multiple of every
/// block size), as in the float GEMM path: 128 × 4096 f32 = 2 MiB of scratch per thread.
const GEMM_BLOCK_ROWS: usize = 128;
const GEMM_MIN_BLOCK_ROWS: usize = 32;
const GEMM_MAX_COLS: usize = 4096;

/// Prefill: blocks of weight rows dequantized into a thread-local f32 tile and multiplied by
/// the `gemm` crate; the unquantized activations are used as they are.
pub(crate) fn gemm_with(
    x: &[f32],
    tokens: usize,
    w: QuantRef<'_>,
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    use std::cell::RefCell;
    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    assert_eq!(x.len(), tokens * cols, "qmatmul: x is not [tokens, cols]");
    assert_eq!(out.len(), tokens * rows, "qmatmul: out is not [tokens, rows]");
    w.check(rows, cols, "qmatmul");
    if out.is_empty() {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    let (bw, bb) = w.block();
    let row_bytes = w.row_bytes(cols);
    let bytes = w.bytes();
    // Equal column tiles of whole blocks, at most GEMM_MAX_COLS wide.
    let nblocks = cols / bw;
    let tiles = cols.div_ceil(GEMM_MAX_COLS);
    let kb = nblocks.div_ceil(tiles);
    let per_thread = rows.div_ceil(2 * rayon::current_num_threads());
    let block = per_thread.next_multiple_of(8).clamp(GEMM_MIN_BLOCK_ROWS, GEMM_BLOCK_ROWS);
    let out = OutPtr(out.as_mut_ptr());
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
                    let at = (r0 + j) * row_bytes + b0 * bb;
                    dequantize(w, &bytes[at..at + nb * bb], dst);
                }
                let c0 = b0 * bw;
                // SAFETY: dst is the [tokens, n] window at column r0 of `out` (row stride
                // `rows`), owned by this block alone; lhs is x[:, c0..c0 + k] (row stride
                // `cols`); rhs is tileᵀ, [k, n] with column stride k. The first tile
                // overwrites dst, later ones add.
                unsafe {
                    gemm::gemm(
                        tokens,
                        n,
                        k,
                        out.at(r0),
                        1,
                        rows as isize,
                        b0 > 0,
                        x.as_ptr().add(c0),
                        1,
                        cols as isize,
                        tile.as_ptr(),
                        k as isize,
                        1,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                b0 += nb;
            }
        });
    });
}

fn dequantize(w: QuantRef<'_>, bytes: &[u8], out: &mut [f32]) {
    use crate::quant::blocks as b;
    match w {
        QuantRef::Q8_0(_) => b::dequantize_row_q8_0(bytes, out),
        QuantRef::Q4_0(_) => b::dequantize_row_q4_0(bytes, out),
        QuantRef::Q4_K(_) => b::dequantize_row_q4_k(bytes, out),
        QuantRef::Q6_K(_) => b::dequantize_row_q6_k(bytes, out),
    }
}

/// Row `r` of `W` dequantized into `out` (`out.len() == cols`); the embedding gather.
pub fn row_to_f32(w: QuantRef<'_>, cols: usize, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), cols, "row_to_f32: out length");
    let rb = w.row_bytes(cols);
    assert!((r + 1) * rb <= w.bytes().len(), "row_to_f32: row {r} out of range");
    dequantize(w, &w.bytes()[r * rb..(r + 1) * rb], out);
}

pub(crate) fn matmul_with(
    isa: Kern,
    x: &[f32],
    tokens: usize,
    w: QuantRef<'_>,
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    assert_eq!(x.len(), tokens * cols, "qmatmul: x is not [tokens, cols]");
    assert_eq!(out.len(), tokens * rows, "qmatmul: out is not [tokens, rows]");
    w.check(rows, cols, "qmatmul");
    if out.is_empty() {
        return;
    }
    if cols == 0 {
        out.fill(0.0);
        return;
    }
    match w {
        QuantRef::Q8_0(b) => run::<Q8_0>(isa, x, tokens, b, rows, cols, out),
        QuantRef::Q4_0(b) => run::<Q4_0>(isa, x, tokens, b, rows, cols, out),
        QuantRef::Q4_K(b) => run::<Q4K>(isa, x, tokens, b, rows, cols, out),
        QuantRef::Q6_K(b) => run::<Q6K>(isa, x, tokens, b, rows, cols, out),
    }
}

// ------------------------------------------------------------------------------------
// Activations

/// Activation rows quantized to 8 bits: `tokens` rows of `cols`, blocks of `block` values
/// (32 or 256) with one f32 scale each, and the sum of every 32 quantized values.
pub(crate) struct Acts {
    cols: usize,
    block: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
    /// −8 × the sum of every 4 quantized values (one i32 lane of a 32-block each): Q4_0's
    /// nibble offset, folded in as the start value of a VNNI accumulation.
    neg8: Vec<i32>,
}

/// One token's row of [`Acts`].
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    qs: &'a [i8],
    d: &'a [f32],
    sums: &'a [i16],
    neg8: &'a [i32],
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
            neg8: Vec::new(),
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
                    *q = (v * id).round_ties_even() as i8;
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
        a.neg8 = a.qs.chunks_exact(4).map(|q| -8 * q.iter().map(|&v| v as i32).sum::<i32>()).collect();
        a
    }

    fn row(&self, t: usize) -> ActRow<'_> {
        let nb = self.cols / self.block;
        ActRow {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            d: &self.d[t * nb..(t + 1) * nb],
            sums: &self.sums[t * self.cols / 32..(t + 1) * self.cols / 32],
            neg8: &self.neg8[t * self.cols / 4..(t + 1) * self.cols / 4],
        }
    }
}

// ------------------------------------------------------------------------------------
// The driver

/// `out` as a raw pointer, so that blocks of output columns (interleaved in the row-major
/// `[tokens, rows]` output) can be written from several threads.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every parallel block writes the output columns of its own weight rows only, and
// `matmul_with` holds the `&mut [f32]` while any block runs.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` must be inside the output and owned by the calling block.
    #[inline]
    unsafe fn write(self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }

    /// The output from element `i` on (a method, so closures capture the whole `Sync` value).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Weight bytes per parallel work item for decode (as the float GEMV).
const GEMV_BLOCK_BYTES: usize = 32 << 10;
/// Weight bytes per work item with many tokens: kept in L2 while the tokens stream past.
const TILE_BLOCK_BYTES: usize = 64 << 10;
/// Below this much work (weight bytes × tokens) everything runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 128 << 10;
/// Tokens per tile: each unpacked weight vector is used this many times from registers.
const TILE_TOKENS: usize = 4;

fn run<F: Format>(isa: Kern, x: &[f32], tokens: usize, w: &[u8], rows: usize, cols: usize, out: &mut [f32]) {
    let acts = Acts::quantize(x, tokens, cols, F::ACT_BLOCK);
    let row_bytes = cols / F::BLOCK * F::BYTES;
    let block_bytes = if tokens == 1 { GEMV_BLOCK_BYTES } else { TILE_BLOCK_BYTES };
    // Enough blocks for every thread even on small matrices.
    let per_thread = rows.div_ceil(2 * rayon::current_num_threads()).max(1);
    let block = (block_bytes / row_bytes).clamp(1, per_thread.max(1));
    let parallel = rows * row_bytes * tokens >= PARALLEL_MIN_WORK;
    let out = OutPtr(out.as_mut_ptr());
    let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
    for_each_block(rows, block, parallel, |r0, r1| {
        let mut t = 0;
        while t + TILE_TOKENS <= tokens {
            let xs: [ActRow; TILE_TOKENS] = std::array::from_fn(|i| acts.row(t + i));
            for r in r0..r1 {
                let sums = tile::<F, TILE_TOKENS>(isa, row(r), &xs);
                for (i, s) in sums.into_iter().enumerate() {
                    // SAFETY: (t + i, r) is inside the output, and column r belongs to this block.
                    unsafe { out.write((t + i) * rows + r, s) };
                }
            }
            t += TILE_TOKENS;
        }
        for t in t..tokens {
            let xs = [acts.row(t)];
            for r in r0..r1 {
                let [s] = tile::<F, 1>(isa, row(r), &xs);
                // SAFETY: as above.
                unsafe { out.write(t * rows + r, s) };
            }
        }
    });
}

#[inline]
fn tile<F: Format, const T: usize>(isa: Kern, w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
    match isa {
        // SAFETY: `Kern::Avx2` is only produced after detecting AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Kern::Avx2 => unsafe { F::tile_avx2::<T>(w, xs) },
        // SAFETY: `Kern::Vnni` additionally needs AVX-512 VNNI and VL, detected likewise.
        #[cfg(target_arch = "x86_64")]
        Kern::Vnni => unsafe { F::tile_vnni::<T>(w, xs) },
        Kern::Portable => F::tile_portable::<T>(w, xs),
    }
}

/// A weight block format and its dot product with quantized activations.
trait Format {
    /// Weights per block and bytes per block.
    const BLOCK: usize;
    const BYTES: usize;
    /// Block size of the activation quantization this format pairs with.
    const ACT_BLOCK: usize;

    /// `w` (one row) dotted with each of `xs`.
    fn tile_portable<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T];

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_avx2<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T];

    /// # Safety
    /// AVX2, FMA, F16C, AVX-512 VNNI and VL must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile_vnni<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        Self::tile_avx2::<T>(w, xs)
    }
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The portable form of the final reduction of eight lanes (the AVX2 `hsum` order).
#[inline]
fn hsum(v: &[f32; 8]) -> f32 {
    let q = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// Adds `d · lanes` to `acc`, lane by lane, with a separate multiply and add.
#[inline]
fn accumulate(acc: &mut [f32; 8], d: f32, lanes: &[i32; 8]) {
    for (a, &s) in acc.iter_mut().zip(lanes) {
        *a += d * s as f32;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Shared AVX2 pieces; every function needs AVX2, FMA and F16C.
    use std::arch::x86_64::*;

    /// The f16 at `p` widened and broadcast to all lanes. Through a word broadcast rather
    /// than a scalar insert: LLVM turns the latter into `vpinsrw` merging into whatever
    /// register it picks — in the kernels, the accumulator — which chained every block on
    /// the previous one (measured 3–6× slower).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_splat(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes([*p, *p.add(1)])))
    }

    /// i32 lane l = Σ_{k<4} a[4l+k] · b[4l+k] for signed bytes `a`, `b` (GGML's
    /// `mul_sum_i8_pairs`): the sign moves onto `b` so `maddubs` sees |a| unsigned.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_i8(a: __m256i, b: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(a, a);
        let sb = _mm256_sign_epi8(b, a);
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sb), _mm256_set1_epi16(1))
    }

    /// acc + d · float(lanes), unfused; `d` is broadcast.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn accumulate(acc: __m256, d: __m256, lanes: __m256i) -> __m256 {
        _mm256_add_ps(acc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p.cast())
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load_i8(p: *const i8) -> __m256i {
        _mm256_loadu_si256(p.cast())
    }
}

// ------------------------------------------------------------------------------------
// Q8_0 × Q8 (32)

#[allow(non_camel_case_types)]
struct Q8_0;

impl Format for Q8_0 {
    const BLOCK: usize = QK8_0;
    const BYTES: usize = Q8_0_BYTES;
    const ACT_BLOCK: usize = 32;

    fn tile_portable<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        let mut acc = [[0f32; 8]; T];
        for (b, wb) in w.chunks_exact(Q8_0_BYTES).enumerate() {
            let dw = f16_at(wb, 0);
            let q = &wb[2..];
            for (acc, x) in acc.iter_mut().zip(xs) {
                let y = &x.qs[32 * b..32 * b + 32];
                let mut lanes = [0i32; 8];
                for (i, (&q, &y)) in q.iter().zip(y).enumerate() {
                    lanes[i / 4] += q as i8 as i32 * y as i32;
                }
                accumulate(acc, dw * x.d[b], &lanes);
            }
        }
        acc.map(|a| hsum(&a))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_avx2<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); T];
        let nb = w.len() / Q8_0_BYTES;
        let wp = w.as_ptr();
        for b in 0..nb {
            let p = wp.add(b * Q8_0_BYTES);
            let dw = avx2::f16_splat(p);
            let q = avx2::load(p.add(2));
            for (acc, x) in acc.iter_mut().zip(xs) {
                // |lane| <= 4 · 128 · 127 < 2^24: exact in f32.
                let lanes = avx2::dot_i8(q, avx2::load_i8(x.qs.as_ptr().add(32 * b)));
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(b)));
                *acc = avx2::accumulate(*acc, d, lanes);
            }
        }
        acc.map(|a| super::simd::avx2::hsum(a))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    unsafe fn tile_vnni<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); T];
        let nb = w.len() / Q8_0_BYTES;
        let wp = w.as_ptr();
        for b in 0..nb {
            let p = wp.add(b * Q8_0_BYTES);
            let dw = avx2::f16_splat(p);
            let q = avx2::load(p.add(2));
            let aq = _mm256_sign_epi8(q, q);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let y = _mm256_sign_epi8(avx2::load_i8(x.qs.as_ptr().add(32 * b)), q);
                let lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, y);
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(b)));
                *acc = avx2::accumulate(*acc, d, lanes);
            }
        }
        acc.map(|a| super::simd::avx2::hsum(a))
    }
}

// ------------------------------------------------------------------------------------
// Q4_0 × Q8 (32)

#[allow(non_camel_case_types)]
struct Q4_0;

impl Format for Q4_0 {
    const BLOCK: usize = QK4_0;
    const BYTES: usize = Q4_0_BYTES;
    const ACT_BLOCK: usize = 32;

    fn tile_portable<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        let mut acc = [[0f32; 8]; T];
        let mut q = [0i32; 32];
        for (b, wb) in w.chunks_exact(Q4_0_BYTES).enumerate() {
            let dw = f16_at(wb, 0);
            for (j, &v) in wb[2..].iter().enumerate() {
                q[j] = (v & 0x0f) as i32 - 8;
                q[j + 16] = (v >> 4) as i32 - 8;
            }
            for (acc, x) in acc.iter_mut().zip(xs) {
                let y = &x.qs[32 * b..32 * b + 32];
                let mut lanes = [0i32; 8];
                for (i, (&q, &y)) in q.iter().zip(y).enumerate() {
                    lanes[i / 4] += q * y as i32;
                }
                accumulate(acc, dw * x.d[b], &lanes);
            }
        }
        acc.map(|a| hsum(&a))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_avx2<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); T];
        let nb = w.len() / Q4_0_BYTES;
        let wp = w.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        let eight = _mm256_set1_epi8(8);
        for b in 0..nb {
            let p = wp.add(b * Q4_0_BYTES);
            let dw = avx2::f16_splat(p);
            // Bytes 0..16: low nibbles (weights 0..16); bytes 16..32: high nibbles.
            let packed = _mm_loadu_si128(p.add(2).cast());
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
            let q = _mm256_sub_epi8(_mm256_and_si256(both, low), eight);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let lanes = avx2::dot_i8(q, avx2::load_i8(x.qs.as_ptr().add(32 * b)));
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(b)));
                *acc = avx2::accumulate(*acc, d, lanes);
            }
        }
        acc.map(|a| super::simd::avx2::hsum(a))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    unsafe fn tile_vnni<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); T];
        let nb = w.len() / Q4_0_BYTES;
        let wp = w.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        for b in 0..nb {
            let p = wp.add(b * Q4_0_BYTES);
            let dw = avx2::f16_splat(p);
            let packed = _mm_loadu_si128(p.add(2).cast());
            // The nibbles as unsigned bytes; the −8 offset comes in as the start value.
            let u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed), low);
            for (acc, x) in acc.iter_mut().zip(xs) {
                let start = _mm256_loadu_si256(x.neg8.as_ptr().add(8 * b).cast());
                let lanes = _mm256_dpbusd_epi32(start, u, avx2::load_i8(x.qs.as_ptr().add(32 * b)));
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(b)));
                *acc = avx2::accumulate(*acc, d, lanes);
            }
        }
        acc.map(|a| super::simd::avx2::hsum(a))
    }
}

// ------------------------------------------------------------------------------------
// Q4_K × Q8 (256)

struct Q4K;

/// The 8 scales and 8 mins of a Q4_K super-block.
#[inline]
fn q4k_scales(sc: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut s = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        (s[j], m[j]) = q4_k_scale_min(j, sc);
    }
    (s, m)
}

impl Format for Q4K {
    const BLOCK: usize = QK_K;
    const BYTES: usize = Q4_K_BYTES;
    const ACT_BLOCK: usize = QK_K;

    fn tile_portable<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        let mut acc = [[0f32; 8]; T];
        let mut acc_m = [0f32; T];
        let mut q = [0i32; QK_K];
        for (b, wb) in w.chunks_exact(Q4_K_BYTES).enumerate() {
            let d = f16_at(wb, 0);
            let dmin = f16_at(wb, 2);
            let (sc, mn) = q4k_scales(&wb[4..16]);
            for (g, qs) in wb[16..].chunks_exact(32).enumerate() {
                for (l, &v) in qs.iter().enumerate() {
                    q[64 * g + l] = (v & 0x0f) as i32;
                    q[64 * g + 32 + l] = (v >> 4) as i32;
                }
            }
            for ((acc, acc_m), x) in acc.iter_mut().zip(acc_m.iter_mut()).zip(xs) {
                let y = &x.qs[QK_K * b..QK_K * (b + 1)];
                let mut lanes = [0i32; 8];
                for (c, (q, y)) in q.chunks_exact(32).zip(y.chunks_exact(32)).enumerate() {
                    let mut part = [0i32; 8];
                    for (i, (&q, &y)) in q.iter().zip(y).enumerate() {
                        part[i / 4] += q * y as i32;
                    }
                    for (l, p) in lanes.iter_mut().zip(part) {
                        *l += p * sc[c] as i32;
                    }
                }
                // |lane| <= 32 · 15 · 127 · 63 < 2^22; |summ| <= 8 · 63 · 32 · 127 < 2^21.
                let summ: i32 = (0..8).map(|j| mn[j] as i32 * x.sums[8 * b + j] as i32).sum();
                accumulate(acc, d * x.d[b], &lanes);
                *acc_m += dmin * x.d[b] * summ as f32;
            }
        }
        std::array::from_fn(|t| hsum(&acc[t]) - acc_m[t])
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_avx2<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); T];
        let mut acc_m = [0f32; T];
        let nb = w.len() / Q4_K_BYTES;
        let wp = w.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        for b in 0..nb {
            let p = wp.add(b * Q4_K_BYTES);
            let d = avx2::f16_splat(p);
            let dmin = _mm256_cvtss_f32(avx2::f16_splat(p.add(2)));
            let (sc, mn) = q4k_scales(std::slice::from_raw_parts(p.add(4), 12));
            let mut sumi = [_mm256_setzero_si256(); T];
            for g in 0..4 {
                let q4 = avx2::load(p.add(16 + 32 * g));
                let ql = _mm256_and_si256(q4, low);
                let qh = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), low);
                let sl = _mm256_set1_epi16(sc[2 * g] as i16);
                let sh = _mm256_set1_epi16(sc[2 * g + 1] as i16);
                for (sumi, x) in sumi.iter_mut().zip(xs) {
                    let y = x.qs.as_ptr().add(QK_K * b + 64 * g);
                    let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(ql, avx2::load_i8(y)), sl);
                    let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(qh, avx2::load_i8(y.add(32))), sh);
                    *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(pl, ph));
                }
            }
            for t in 0..T {
                let x = &xs[t];
                let dx = *x.d.get_unchecked(b);
                acc[t] = avx2::accumulate(acc[t], _mm256_mul_ps(d, _mm256_set1_ps(dx)), sumi[t]);
                let s = x.sums.get_unchecked(8 * b..8 * b + 8);
                let mut summ = 0i32;
                for j in 0..8 {
                    summ += mn[j] as i32 * s[j] as i32;
                }
                acc_m[t] += dmin * dx * summ as f32;
            }
        }
        std::array::from_fn(|t| super::simd::avx2::hsum(acc[t]) - acc_m[t])
    }
}

// ------------------------------------------------------------------------------------
// Q6_K × Q8 (256)

struct Q6K;

impl Format for Q6K {
    const BLOCK: usize = QK_K;
    const BYTES: usize = Q6_K_BYTES;
    const ACT_BLOCK: usize = QK_K;

    fn tile_portable<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        let mut acc = [[0f32; 8]; T];
        let mut q = [0i32; QK_K];
        for (b, wb) in w.chunks_exact(Q6_K_BYTES).enumerate() {
            let (ql_all, rest) = wb.split_at(QK_K / 2);
            let (qh_all, rest) = rest.split_at(QK_K / 4);
            let (sc, d) = rest.split_at(QK_K / 16);
            let d = f16_at(d, 0);
            for h in 0..2 {
                let ql = &ql_all[64 * h..64 * h + 64];
                let qh = &qh_all[32 * h..32 * h + 32];
                let q = &mut q[128 * h..128 * h + 128];
                for l in 0..32 {
                    q[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                    q[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                }
            }
            for (acc, x) in acc.iter_mut().zip(xs) {
                let y = &x.qs[QK_K * b..QK_K * (b + 1)];
                let mut lanes = [0i32; 8];
                for (c, (q, y)) in q.chunks_exact(32).zip(y.chunks_exact(32)).enumerate() {
                    for half in 0..2 {
                        let s = sc[2 * c + half] as i8 as i32;
                        for i in 16 * half..16 * half + 16 {
                            lanes[i / 4] += s * (q[i] * y[i] as i32);
                        }
                    }
                }
                // |lane| <= 32 · 32 · 127 · 128 < 2^24: exact in f32.
                accumulate(acc, d * x.d[b], &lanes);
            }
        }
        acc.map(|a| hsum(&a))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_avx2<const T: usize>(w: &[u8], xs: &[ActRow; T]) -> [f32; T] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); T];
        let nb = w.len() / Q6_K_BYTES;
        let wp = w.as_ptr();
        let low = _mm256_set1_epi8(0x0f);
        let three = _mm256_set1_epi8(3);
        let m32 = _mm256_set1_epi8(32);
        for b in 0..nb {
            let p = wp.add(b * Q6_K_BYTES);
            let sc = p.add(QK_K / 2 + QK_K / 4) as *const i8;
            let d = avx2::f16_splat(p.add(QK_K / 2 + QK_K / 4 + QK_K / 16));
            let mut sumi = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                let ql0 = avx2::load(p.add(64 * h));
                let ql1 = avx2::load(p.add(64 * h + 32));
                let qh = avx2::load(p.add(QK_K / 2 + 32 * h));
                // 6-bit values 0..63 of the four 32-weight chunks of this half.
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, low),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(qh, three)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, low),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), three)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), three)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), three)),
                    ),
                ];
                for (k, q) in q.iter().enumerate() {
                    let c = 4 * h + k;
                    // i16 lanes 0..8 (weights 0..16 of the chunk) take scale 2c, 8..16 take 2c+1.
                    let s = _mm256_set_m128i(
                        _mm_set1_epi16(*sc.add(2 * c + 1) as i16),
                        _mm_set1_epi16(*sc.add(2 * c) as i16),
                    );
                    for (sumi, x) in sumi.iter_mut().zip(xs) {
                        let y = avx2::load_i8(x.qs.as_ptr().add(QK_K * b + 32 * c));
                        // (q − 32) · y per pair: |.| <= 2 · 32 · 127, no i16 saturation.
                        let pq = _mm256_sub_epi16(_mm256_maddubs_epi16(*q, y), _mm256_maddubs_epi16(m32, y));
                        *sumi = _mm256_add_epi32(*sumi, _mm256_madd_epi16(pq, s));
                    }
                }
            }
            for t in 0..T {
                let dx = _mm256_set1_ps(*xs[t].d.get_unchecked(b));
                acc[t] = avx2::accumulate(acc[t], _mm256_mul_ps(d, dx), sumi[t]);
            }
        }
        acc.map(|a| super::simd::avx2::hsum(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{self, QuantType};

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        /// Uniform in [-1, 1).
        fn f32(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    const TYPES: [QuantType; 4] = [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_K, QuantType::Q6_K];

    fn qref(ty: QuantType, b: &[u8]) -> QuantRef<'_> {
        match ty {
            QuantType::Q8_0 => QuantRef::Q8_0(b),
            QuantType::Q4_0 => QuantRef::Q4_0(b),
            QuantType::Q4_K => QuantRef::Q4_K(b),
            QuantType::Q6_K => QuantRef::Q6_K(b),
            _ => unreachable!(),
        }
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

    /// The exact product of the dequantized weights with the *quantized* activations, in
    /// f64: the kernels may differ from it only by f32 rounding of the block sums.
    fn reference_quantized_x(
        ty: QuantType,
        w: &[u8],
        x: &[f32],
        tokens: usize,
        rows: usize,
        cols: usize,
    ) -> Vec<f64> {
        let wf = dequantized(ty, w, rows * cols);
        let block = if ty.block_size() == 256 { 256 } else { 32 };
        let acts = Acts::quantize(x, tokens, cols, block);
        let mut out = vec![0f64; tokens * rows];
        for t in 0..tokens {
            let a = acts.row(t);
            let xq: Vec<f64> = (0..cols).map(|c| a.qs[c] as f64 * a.d[c / block] as f64).collect();
            for r in 0..rows {
                out[t * rows + r] = (0..cols).map(|c| wf[r * cols + c] as f64 * xq[c]).sum();
            }
        }
        out
    }

    /// The product of the dequantized weights with the f32 activations, in f64, and the bound
    /// activation quantization puts on the distance to it: Σ_c |w_c| · d_x(c) / 2 (each
    /// activation is rounded to the nearest multiple of its block's scale).
    fn reference_f32_x(
        ty: QuantType,
        w: &[u8],
        x: &[f32],
        tokens: usize,
        rows: usize,
        cols: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let wf = dequantized(ty, w, rows * cols);
        let block = if ty.block_size() == 256 { 256 } else { 32 };
        let acts = Acts::quantize(x, tokens, cols, block);
        let mut out = vec![0f64; tokens * rows];
        let mut bound = vec![0f64; tokens * rows];
        for t in 0..tokens {
            let d = acts.row(t).d;
            for r in 0..rows {
                let w = &wf[r * cols..(r + 1) * cols];
                out[t * rows + r] = (0..cols).map(|c| w[c] as f64 * x[t * cols + c] as f64).sum();
                bound[t * rows + r] = (0..cols).map(|c| w[c].abs() as f64 * d[c / block] as f64 * 0.5).sum();
            }
        }
        (out, bound)
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
                        let exact = reference_quantized_x(ty, &w, &x, tokens, rows, cols);
                        let (loose, bound) = reference_f32_x(ty, &w, &x, tokens, rows, cols);
                        let max_ref = loose.iter().fold(0f64, |m, v| m.max(v.abs()));
                        for isa in isas() {
                            let mut out = vec![f32::NAN; tokens * rows];
                            matmul_with(isa, &x, tokens, qref(ty, &w), rows, cols, &mut out);
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
                    matmul_with(isa, &x, tokens, qref(ty, &w), rows, cols, &mut batched);
                    for t in 0..tokens {
                        let mut one = vec![f32::NAN; rows];
                        matmul_with(isa, &x[t * cols..(t + 1) * cols], 1, qref(ty, &w), rows, cols, &mut one);
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
                matmul(&x, tokens, qref(ty, &w), rows, cols, &mut a);
                let mut b = vec![f32::NAN; tokens * rows];
                matmul_rows(&x, tokens, qref(ty, &w), rows, cols, &mut b);
                let mut c = vec![f32::NAN; tokens * rows];
                matmul_with(Kern::Portable, &x, tokens, qref(ty, &w), rows, cols, &mut c);
                assert!(a.iter().zip(&c).all(|(a, c)| a.to_bits() == c.to_bits()), "{ty}");
                assert!(b.iter().zip(&c).all(|(a, c)| a.to_bits() == c.to_bits()), "{ty}");
            }
        }
    }

    /// The prefill path (dequantized tiles, f32 activations) against the f64 product of the
    /// dequantized weights and the f32 activations: max |Δ| / max |ref| <= 1e-5, on shapes
    /// with several column tiles and row blocks, around the path threshold.
    #[test]
    fn gemm_path_matches_f64() {
        let mut rng = Rng(21);
        for ty in TYPES {
            for (rows, cols) in [(1usize, 256usize), (37, 768), (300, 2 * GEMM_MAX_COLS + 256)] {
                let w = random_weights(&mut rng, ty, rows, cols);
                for tokens in [GEMM_MIN_TOKENS, GEMM_MIN_TOKENS + 7] {
                    let x = random_x(&mut rng, tokens * cols);
                    let (want, _) = reference_f32_x(ty, &w, &x, tokens, rows, cols);
                    let mut got = vec![f32::NAN; tokens * rows];
                    matmul(&x, tokens, qref(ty, &w), rows, cols, &mut got);
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
            let mut w = vec![0u8; Q8_0_BYTES];
            w[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            for (i, b) in w[2..].iter_mut().enumerate() {
                *b = if i % 2 == 0 { 0x80 } else { 127 };
            }
            let x: Vec<f32> = (0..32).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
            let mut out = [f32::NAN];
            matmul_with(isa, &x, 1, QuantRef::Q8_0(&w), 1, 32, &mut out);
            // Σ 16·(−128·1 + 127·(−1)) · 0.5 · (1/127 · 127) = −2040.
            assert_eq!(out[0], -2040.0, "{isa:?}");
            matmul_with(isa, &[0.0; 32], 1, QuantRef::Q8_0(&w), 1, 32, &mut out);
            assert_eq!(out[0], 0.0);
        }
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
                row_to_f32(qref(ty, &w), cols, r, &mut out);
                assert_eq!(out, all[r * cols..(r + 1) * cols]);
            }
        }
    }
}
