//! Matrix multiplication against checkpoint weights: `out = x · Wᵀ`, with `W` left in its
//! stored dtype (bf16, f16 or f32) and widened to f32 on the fly. This is the hot path of the
//! CPU backend.
//!
//! Two algorithms, picked by the number of tokens ([`Path::choose`]):
//! - **GEMV** (decode, short prompts): every weight element is loaded and widened once per
//!   group of up to four tokens and multiplied into all of them from registers. With one
//!   token this is memory-bound and streams W at close to the machine's read bandwidth.
//! - **GEMM** (prefill): a block of weight rows is widened into a thread-local f32 scratch and
//!   multiplied by the `gemm` crate, whose packed, cache-blocked kernels win once there are
//!   enough tokens to amortise the widening and packing. The whole matrix is never widened
//!   (the 248320-row embedding would need a gigabyte).
//!
//! Both split the weight rows into blocks that rayon spreads over the cores; a block owns its
//! output columns, so the threads never write the same element.

use std::cell::RefCell;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd::LANES;
use super::simd::{prefetch, prefetch_distance, Isa, SharedMut};

/// A weight matrix stored row-major as `rows` rows of `cols` elements, in its checkpoint dtype.
#[derive(Clone, Copy)]
pub enum WeightRef<'a> {
    /// bf16 bit patterns (little-endian u16), widened to f32 in registers.
    Bf16(&'a [u16]),
    /// IEEE f16 bit patterns (little-endian u16).
    F16(&'a [u16]),
    F32(&'a [f32]),
}

impl WeightRef<'_> {
    fn elems(&self) -> usize {
        match self {
            WeightRef::Bf16(s) | WeightRef::F16(s) => s.len(),
            WeightRef::F32(s) => s.len(),
        }
    }
}

/// `out[t * rows + r] = Σ_c x[t * cols + c] · w[r * cols + c]` for `t < tokens`, `r < rows`,
/// i.e. `out = x · Wᵀ` with `x: [tokens, cols]` f32 and `W: [rows, cols]`.
/// `out` is overwritten. Accumulation is in f32.
pub fn matmul(x: &[f32], tokens: usize, w: WeightRef<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    let isa = Isa::detect();
    matmul_with(isa, Path::choose(isa, tokens), x, tokens, w, rows, cols, out);
}

/// Checks a product's shapes for `what` (`x: [tokens, cols]`, `out: [tokens, rows]`) and
/// settles the ones with nothing to multiply: true when `out` is empty, or `cols == 0` and
/// `out` now holds the empty sums (zeros; gemm would not touch `out` for k = 0).
pub(super) fn settled_product(
    what: &str,
    x: &[f32],
    tokens: usize,
    rows: usize,
    cols: usize,
    out: &mut [f32],
) -> bool {
    assert_eq!(x.len(), tokens * cols, "{what}: x is not [tokens, cols]");
    assert_eq!(out.len(), tokens * rows, "{what}: out is not [tokens, rows]");
    if cols == 0 {
        out.fill(0.0);
    }
    out.is_empty() || cols == 0
}

/// `out[t, r0 + j] (+)= Σ_i x[t, i] · tile[j, i]` for the `tokens` × `n` window at column r0
/// of `out` (row stride `rows`), `x` with row stride `cols` (its first `k` columns used) and
/// `tile` `[n, k]` row-major: the gemm crate on one thread, overwriting when `accumulate` is
/// false. The prompt GEMMs' inner product on a widened or dequantized weight tile.
///
/// # Safety
/// The window must be inside `out` and owned by the caller alone; `x` must hold `tokens` rows
/// of stride `cols` with at least `k` columns from its start, `tile` at least `n * k` values.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_tile(
    out: SharedMut,
    r0: usize,
    rows: usize,
    accumulate: bool,
    x: &[f32],
    cols: usize,
    tokens: usize,
    tile: &[f32],
    n: usize,
    k: usize,
) {
    gemm::gemm(
        tokens,
        n,
        k,
        out.at(r0),
        1,
        rows as isize,
        accumulate,
        x.as_ptr(),
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

/// [`matmul`] for a decode batch: every output element is computed exactly as a one-token
/// `matmul` of its row of `x` computes it (same kernel, same accumulation order), so a
/// sequence's results do not depend on what else is in the batch. Each weight row is still
/// read from memory once and reused from cache for every token.
pub fn matmul_rows(x: &[f32], tokens: usize, w: WeightRef<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(x.len(), tokens * cols, "matmul_rows: x is not [tokens, cols]");
    assert_eq!(w.elems(), rows * cols, "matmul_rows: W is not [rows, cols]");
    assert_eq!(out.len(), tokens * rows, "matmul_rows: out is not [tokens, rows]");
    if tokens == 1 || out.is_empty() || cols == 0 {
        return matmul_with(Isa::detect(), Path::Gemv, x, tokens, w, rows, cols, out);
    }
    let isa = Isa::detect();
    let p = Problem { x, tokens, rows, cols, out: SharedMut::new(out) };
    match w {
        WeightRef::Bf16(s) => p.gemv_invariant::<Bf16>(isa, s),
        WeightRef::F16(s) => p.gemv_invariant::<F16>(isa, s),
        WeightRef::F32(s) => p.gemv_invariant::<F32>(isa, s),
    }
}

/// Copy row `r` of `W` widened to f32 into `out` (`out.len() == cols`); the embedding gather.
pub fn row_to_f32(w: WeightRef<'_>, cols: usize, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), cols, "row_to_f32: out length");
    assert!((r + 1) * cols <= w.elems(), "row_to_f32: row {r} out of range");
    let isa = Isa::detect();
    let span = r * cols..(r + 1) * cols;
    match w {
        WeightRef::Bf16(s) => widen::<Bf16>(isa, &s[span], out),
        WeightRef::F16(s) => widen::<F16>(isa, &s[span], out),
        WeightRef::F32(s) => out.copy_from_slice(&s[span]),
    }
}

/// From this many tokens on, the gemm path is used with AVX2: 64 on Intel CPUs, 192 on
/// others. Measured on a 2-vCPU AMD EPYC (Zen 4, BENCHMARKS-LOG session 18): in
/// `examples/matmul_bench`, GFLOP/s on 1024×3584 at 64 / 128 / 256 / 512 tokens, the
/// register-blocked GEMV 117 / 122 / 125 / 124 against gemm's 77 / 82 / 94 / 169; in `strix
/// bench` (bf16 0.8B shape, prefill tok/s, GEMV against gemm) 105–119 / 83–89 at 128 tokens,
/// 99–116 / 93 at 160, 97–99 / 101–108 at 192, 112–114 / 118–122 at 256. On the Intel Xeon of
/// sessions 12–14, whose cores run gemm's 512-bit FMAs at twice Zen 4's rate, the 64 of earlier
/// measurements stays (not re-measured).
fn gemm_min_tokens() -> usize {
    static FROM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| if super::simd::cpu_vendor_is_intel() { 64 } else { 192 })
}

/// Which algorithm [`matmul_with`] runs; tests force each one on every shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Gemv,
    Gemm,
}

impl Path {
    fn choose(isa: Isa, tokens: usize) -> Path {
        // Without AVX2 our GEMV kernel only wins for one token: gemm carries its own SIMD
        // kernels (NEON, FMA, ...) and was 1.2–2× faster than the portable GEMV from two
        // tokens on.
        let gemm_from = if isa == Isa::Portable { 2 } else { gemm_min_tokens() };
        if tokens >= gemm_from {
            Path::Gemm
        } else {
            Path::Gemv
        }
    }
}

/// [`matmul`] with the kernel family and algorithm chosen by the caller.
#[allow(clippy::too_many_arguments)]
fn matmul_with(
    isa: Isa,
    path: Path,
    x: &[f32],
    tokens: usize,
    w: WeightRef<'_>,
    rows: usize,
    cols: usize,
    out: &mut [f32],
) {
    assert_eq!(w.elems(), rows * cols, "matmul: W is not [rows, cols]");
    if settled_product("matmul", x, tokens, rows, cols, out) {
        return;
    }
    let p = Problem { x, tokens, rows, cols, out: SharedMut::new(out) };
    match w {
        WeightRef::Bf16(s) => p.run::<Bf16>(isa, path, s),
        WeightRef::F16(s) => p.run::<F16>(isa, path, s),
        WeightRef::F32(s) => p.run::<F32>(isa, path, s),
    }
}

/// The shapes and operands of one `matmul`, shared by every parallel block.
struct Problem<'a> {
    x: &'a [f32],
    tokens: usize,
    rows: usize,
    cols: usize,
    /// `[tokens, rows]`: every parallel block writes the output columns of its own weight rows
    /// only (interleaved in memory), and `matmul_with` holds the `&mut [f32]` while any runs.
    out: SharedMut,
}

/// Bytes of weights per GEMV work item: small enough to balance the threads on every shape
/// we have, large enough that the per-item cost (a few tile-loop setups) is noise. Rayon
/// coalesces neighbouring items, so this is not a task size.
const GEMV_BLOCK_BYTES: usize = 32 << 10;

/// Below this much work (weight bytes × tokens) a GEMV runs on the calling thread: waking
/// the pool costs more than it saves.
const GEMV_PARALLEL_MIN_WORK: usize = 256 << 10;

/// Weight rows widened per gemm call. gemm re-packs x for every block, so blocks should not
/// be small: 128–512 measured within noise of each other, 64 was slower on 3584×1024. Many
/// cores get smaller blocks (down to [`GEMM_MIN_BLOCK_ROWS`]) so that all of them have work.
const GEMM_BLOCK_ROWS: usize = 128;
const GEMM_MIN_BLOCK_ROWS: usize = 32;

/// Widest column tile of a gemm block: bounds the scratch at 128 × 4096 f32 = 2 MiB per
/// thread. Tiling costs a few percent, so it only kicks in for very wide matrices.
const GEMM_MAX_COLS: usize = 4096;

impl Problem<'_> {
    fn run<W: Widen>(&self, isa: Isa, path: Path, w: &[W::Raw]) {
        match path {
            Path::Gemv => self.gemv::<W>(isa, w),
            Path::Gemm => self.gemm::<W>(isa, w),
        }
    }

    fn gemv<W: Widen>(&self, isa: Isa, w: &[W::Raw]) {
        let row_bytes = self.cols * std::mem::size_of::<W::Raw>();
        // Even, so that only the last block can hold an unpaired row.
        let block = (GEMV_BLOCK_BYTES / row_bytes).next_multiple_of(2).max(2);
        let parallel = self.rows * row_bytes * self.tokens >= GEMV_PARALLEL_MIN_WORK;
        for_each_block(self.rows, block, parallel, |r0, r1| match isa {
            // SAFETY: `Isa::Avx2` is only produced after detecting the features; the block is
            // within `rows` and owned by this call.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.gemv_rows::<Avx2, W>(w, r0, r1) },
            // SAFETY: as above; the portable kernel has no feature requirement.
            Isa::Portable => unsafe { self.gemv_rows::<Portable, W>(w, r0, r1) },
        });
    }

    /// The one-token GEMV kernel for every (row, token) pair: batch-invariant by construction.
    fn gemv_invariant<W: Widen>(&self, isa: Isa, w: &[W::Raw]) {
        let row_bytes = self.cols * std::mem::size_of::<W::Raw>();
        let block = (GEMV_BLOCK_BYTES / row_bytes).max(1);
        let parallel = self.rows * row_bytes * self.tokens >= GEMV_PARALLEL_MIN_WORK;
        let cols = self.cols;
        for_each_block(self.rows, block, parallel, |r0, r1| {
            for r in r0..r1 {
                let row = &w[r * cols..(r + 1) * cols];
                for t in 0..self.tokens {
                    match isa {
                        // SAFETY: `Isa::Avx2` is only produced after detecting the features;
                        // column `r` of `out` belongs to this block alone.
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => unsafe { self.tile::<Avx2, W, 1, 1, 8>([row], r, t) },
                        // SAFETY: as above; the portable kernel has no feature requirement.
                        Isa::Portable => unsafe { self.tile::<Portable, W, 1, 1, 8>([row], r, t) },
                    }
                }
            }
        });
    }

    /// Output columns `r0..r1` for every token.
    ///
    /// # Safety
    /// `K` must be runnable on this CPU, `r0 <= r1 <= rows`, and no other thread may write
    /// output columns `r0..r1` meanwhile.
    unsafe fn gemv_rows<K: Kernel, W: Widen>(&self, w: &[W::Raw], r0: usize, r1: usize) {
        let cols = self.cols;
        let row = |r: usize| &w[r * cols..(r + 1) * cols];
        if self.tokens == 1 {
            // Memory-bound: one row at a time keeps each thread on a single sequential
            // stream (interleaving rows measured 2× slower from DRAM); eight accumulators
            // along the row cover the FMA latency.
            let pf = prefetch_distance();
            let row_bytes = cols * std::mem::size_of::<W::Raw>();
            for r in r0..r1 {
                if pf > 0 {
                    prefetch((row(r).as_ptr() as *const u8).wrapping_add(pf), row_bytes);
                }
                self.tile::<K, W, 1, 1, 8>([row(r)], r, 0);
            }
            return;
        }
        // Compute-bound: 2 rows × 4 tokens of accumulators reuse every x load twice and
        // every widened weight four times (1.6× the one-row kernel), and still leave
        // registers for the operands. Three rows measured no better.
        let mut r = r0;
        while r + 2 <= r1 {
            self.token_groups::<K, W, 2>([row(r), row(r + 1)], r);
            r += 2;
        }
        if r < r1 {
            self.token_groups::<K, W, 1>([row(r)], r);
        }
    }

    /// Rows `r..r + R` against all tokens, four at a time; the rows stay in L1 meanwhile.
    unsafe fn token_groups<K: Kernel, W: Widen, const R: usize>(&self, ws: [&[W::Raw]; R], r: usize) {
        let mut t = 0;
        while t + 4 <= self.tokens {
            self.tile::<K, W, R, 4, 1>(ws, r, t);
            t += 4;
        }
        match self.tokens - t {
            3 => self.tile::<K, W, R, 3, 1>(ws, r, t),
            2 => self.tile::<K, W, R, 2, 1>(ws, r, t),
            1 => self.tile::<K, W, R, 1, 1>(ws, r, t),
            _ => {}
        }
    }

    /// Rows `r..r + R` against tokens `t..t + T`, written to `out`.
    #[inline]
    unsafe fn tile<K: Kernel, W: Widen, const R: usize, const T: usize, const U: usize>(
        &self,
        ws: [&[W::Raw]; R],
        r: usize,
        t: usize,
    ) {
        let cols = self.cols;
        let xs: [&[f32]; T] = std::array::from_fn(|i| &self.x[(t + i) * cols..(t + i + 1) * cols]);
        let sums = K::tile::<W, R, T, U>(&xs, &ws);
        for (i, sums_r) in sums.iter().enumerate() {
            for (j, &v) in sums_r.iter().enumerate() {
                self.out.write((t + j) * self.rows + r + i, v);
            }
        }
    }

    fn gemm<W: Widen>(&self, isa: Isa, w: &[W::Raw]) {
        thread_local! {
            /// Widened weight tile, kept between calls so prefill does not allocate.
            static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        let cols = self.cols;
        // Equal column tiles of at most GEMM_MAX_COLS (one tile for every shape we have).
        let kc = cols.div_ceil(cols.div_ceil(GEMM_MAX_COLS));
        // Two blocks per thread at least, for balance.
        let per_thread = self.rows.div_ceil(2 * rayon::current_num_threads());
        let block = per_thread.next_multiple_of(8).clamp(GEMM_MIN_BLOCK_ROWS, GEMM_BLOCK_ROWS);
        let parallel = self.rows > block;
        for_each_block(self.rows, block, parallel, |r0, r1| {
            let n = r1 - r0;
            SCRATCH.with(|s| {
                // Nothing in here re-enters rayon, so this borrow is never taken twice.
                let mut s = s.borrow_mut();
                if s.len() < n * kc {
                    s.resize(n * kc, 0.0);
                }
                let mut c0 = 0;
                while c0 < cols {
                    let k = kc.min(cols - c0);
                    let tile = &mut s[..n * k];
                    for (j, dst) in tile.chunks_exact_mut(k).enumerate() {
                        let src = (r0 + j) * cols + c0;
                        widen::<W>(isa, &w[src..src + k], dst);
                    }
                    // SAFETY: the window at column r0 of `out` belongs to this block alone;
                    // x[:, c0..c0 + k] and the tile are in bounds (extents checked in
                    // `matmul_with`).
                    unsafe {
                        gemm_tile(
                            self.out,
                            r0,
                            self.rows,
                            c0 > 0,
                            &self.x[c0..],
                            cols,
                            self.tokens,
                            tile,
                            n,
                            k,
                        );
                    }
                    c0 += k;
                }
            });
        });
    }
}

/// Calls `f(r0, r1)` for consecutive blocks of `block` rows covering `0..rows`, on the rayon
/// pool when `parallel`.
pub(super) fn for_each_block(rows: usize, block: usize, parallel: bool, f: impl Fn(usize, usize) + Sync) {
    let n = rows.div_ceil(block);
    let bounds = |b: usize| (b * block, ((b + 1) * block).min(rows));
    if parallel && n > 1 {
        (0..n).into_par_iter().for_each(|b| {
            let (r0, r1) = bounds(b);
            f(r0, r1)
        });
    } else {
        for b in 0..n {
            let (r0, r1) = bounds(b);
            f(r0, r1);
        }
    }
}

/// Widen `src` into `dst` (same length) with the fastest available code.
fn widen<W: Widen>(isa: Isa, src: &[W::Raw], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    match isa {
        // SAFETY: `Isa::Avx2` is only produced after detecting the features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { widen_avx2::<W>(src, dst) },
        Isa::Portable => W::widen(src, dst),
    }
}

/// # Safety
/// AVX2, FMA and F16C must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_avx2<W: Widen>(src: &[W::Raw], dst: &mut [f32]) {
    use std::arch::x86_64::_mm256_storeu_ps;
    let n = src.len().min(dst.len());
    let main = n - n % LANES;
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i < main {
        _mm256_storeu_ps(pd.add(i), W::load8(ps.add(i)));
        i += LANES;
    }
    W::widen(&src[main..n], &mut dst[main..n]);
}

/// A stored weight dtype and how to widen it (exactly) to f32.
trait Widen {
    type Raw: Copy + Send + Sync;
    fn to_f32(v: Self::Raw) -> f32;
    /// Portable bulk widening of `src` into `dst` (same length).
    fn widen(src: &[Self::Raw], dst: &mut [f32]);
    /// Eight consecutive elements widened into one register.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available and `p` valid for eight reads.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self::Raw) -> std::arch::x86_64::__m256;
}

struct Bf16;
struct F16;
struct F32;

impl Widen for Bf16 {
    type Raw = u16;
    #[inline(always)]
    fn to_f32(v: u16) -> f32 {
        // bf16 is the top half of an f32: widening is a shift.
        f32::from_bits((v as u32) << 16)
    }
    fn widen(src: &[u16], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::to_f32(s);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p.cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

impl Widen for F16 {
    type Raw = u16;
    #[inline]
    fn to_f32(v: u16) -> f32 {
        half::f16::from_bits(v).to_f32()
    }
    fn widen(src: &[u16], dst: &mut [f32]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        // half converts slices several at a time (F16C / NEON when present).
        src.reinterpret_cast::<half::f16>().convert_to_f32_slice(dst);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}

impl Widen for F32 {
    type Raw = f32;
    #[inline(always)]
    fn to_f32(v: f32) -> f32 {
        v
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// A GEMV micro-kernel: `R` weight rows dotted with `T` token rows.
trait Kernel {
    /// Returns `sums[r][t] = Σ_c ws[r][c] · xs[t][c]`, with the columns unrolled `U` vectors
    /// deep so that `U · R · T` accumulators are in flight.
    ///
    /// # Safety
    /// The kernel's instruction set must be available, and every slice must have the length
    /// of `ws[0]`.
    unsafe fn tile<W: Widen, const R: usize, const T: usize, const U: usize>(
        xs: &[&[f32]; T],
        ws: &[&[W::Raw]; R],
    ) -> [[f32; T]; R];
}

struct Portable;

impl Kernel for Portable {
    unsafe fn tile<W: Widen, const R: usize, const T: usize, const U: usize>(
        xs: &[&[f32]; T],
        ws: &[&[W::Raw]; R],
    ) -> [[f32; T]; R] {
        // Widen a stretch of each row into a stack buffer, then multiply-add in groups of
        // four independent lanes (one SSE / NEON register, which LLVM vectorises without
        // reassociating), U groups deep like the AVX2 kernel.
        const PL: usize = 4;
        const CHUNK: usize = 256;
        let cols = ws[0].len();
        let step = U * PL;
        let mut acc = [[[[0.0f32; PL]; T]; R]; U];
        let mut tail = [[0.0f32; T]; R];
        let mut buf = [[0.0f32; CHUNK]; R];
        let mut c0 = 0;
        while c0 < cols {
            let n = CHUNK.min(cols - c0);
            for (b, w) in buf.iter_mut().zip(ws) {
                W::widen(&w[c0..c0 + n], &mut b[..n]);
            }
            let xc: [&[f32]; T] = std::array::from_fn(|t| &xs[t][c0..c0 + n]);
            let main = n - n % step;
            let wv: [&[[f32; PL]]; R] = std::array::from_fn(|r| buf[r][..main].as_chunks().0);
            let xv: [&[[f32; PL]]; T] = std::array::from_fn(|t| xc[t][..main].as_chunks().0);
            let mut i = 0;
            while i < main / PL {
                for (u, acc_u) in acc.iter_mut().enumerate() {
                    for (acc_ur, w) in acc_u.iter_mut().zip(&wv) {
                        let w = &w[i + u];
                        for (acc_urt, x) in acc_ur.iter_mut().zip(&xv) {
                            let x = &x[i + u];
                            for l in 0..PL {
                                acc_urt[l] += x[l] * w[l];
                            }
                        }
                    }
                }
                i += U;
            }
            for (tail_r, b) in tail.iter_mut().zip(&buf) {
                for (tail_rt, x) in tail_r.iter_mut().zip(&xc) {
                    for i in main..n {
                        *tail_rt += x[i] * b[i];
                    }
                }
            }
            c0 += n;
        }
        let mut sums = tail;
        for (r, sums_r) in sums.iter_mut().enumerate() {
            for (t, sum) in sums_r.iter_mut().enumerate() {
                let mut v = [0.0f32; PL];
                for acc_u in &acc {
                    for l in 0..PL {
                        v[l] += acc_u[r][t][l];
                    }
                }
                *sum += (v[0] + v[2]) + (v[1] + v[3]);
            }
        }
        sums
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2 {
    unsafe fn tile<W: Widen, const R: usize, const T: usize, const U: usize>(
        xs: &[&[f32]; T],
        ws: &[&[W::Raw]; R],
    ) -> [[f32; T]; R] {
        tile_avx2::<W, R, T, U>(xs, ws)
    }
}

/// Each step widens `U` vectors of every weight row once and multiplies them into every
/// token; each x vector is loaded once and used for every row.
///
/// # Safety
/// As [`Kernel::tile`], on a CPU with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<W: Widen, const R: usize, const T: usize, const U: usize>(
    xs: &[&[f32]; T],
    ws: &[&[W::Raw]; R],
) -> [[f32; T]; R] {
    use super::simd::avx2::hsum;
    use std::arch::x86_64::*;
    let cols = ws[0].len();
    let xp: [*const f32; T] = xs.map(|s| s.as_ptr());
    let wp: [*const W::Raw; R] = ws.map(|s| s.as_ptr());
    let mut acc = [[[_mm256_setzero_ps(); T]; R]; U];
    let mut wv = [_mm256_setzero_ps(); R];
    let mut c = 0;
    while c + U * LANES <= cols {
        for (u, acc_u) in acc.iter_mut().enumerate() {
            let o = c + u * LANES;
            for r in 0..R {
                wv[r] = W::load8(wp[r].add(o));
            }
            for t in 0..T {
                let xv = _mm256_loadu_ps(xp[t].add(o));
                for r in 0..R {
                    acc_u[r][t] = _mm256_fmadd_ps(xv, wv[r], acc_u[r][t]);
                }
            }
        }
        c += U * LANES;
    }
    // Leftover whole vectors (fewer than U of them) go to the first accumulator set.
    while c + LANES <= cols {
        for r in 0..R {
            wv[r] = W::load8(wp[r].add(c));
        }
        for t in 0..T {
            let xv = _mm256_loadu_ps(xp[t].add(c));
            for r in 0..R {
                acc[0][r][t] = _mm256_fmadd_ps(xv, wv[r], acc[0][r][t]);
            }
        }
        c += LANES;
    }
    let mut sums = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut v = acc[0][r][t];
            for acc_u in &acc[1..] {
                v = _mm256_add_ps(v, acc_u[r][t]);
            }
            let mut s = hsum(v);
            for i in c..cols {
                s += *xp[t].add(i) * W::to_f32(*wp[r].add(i));
            }
            sums[r][t] = s;
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    #[test]
    fn matmul_rows_is_batch_invariant() {
        // Every row of a batched product equals the one-token product of that row, bitwise.
        let (rows, cols) = (37, 300);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let w: Vec<u16> = (0..rows * cols).map(|_| half::bf16::from_f32(next()).to_bits()).collect();
        for tokens in [2usize, 3, 5, 64, 70] {
            let x: Vec<f32> = (0..tokens * cols).map(|_| next()).collect();
            let mut batched = vec![f32::NAN; tokens * rows];
            matmul_rows(&x, tokens, WeightRef::Bf16(&w), rows, cols, &mut batched);
            for t in 0..tokens {
                let mut one = vec![f32::NAN; rows];
                matmul(&x[t * cols..(t + 1) * cols], 1, WeightRef::Bf16(&w), rows, cols, &mut one);
                assert_eq!(&batched[t * rows..(t + 1) * rows], &one[..], "tokens {tokens}, row {t}");
            }
        }
    }

    use super::*;
    use crate::testing::Rng;

    #[derive(Clone, Copy, Debug)]
    enum Dtype {
        Bf16,
        F16,
        F32,
    }

    /// A random weight matrix in `dtype` plus its exact f64 values.
    struct Weights {
        bits: Vec<u16>,
        f32s: Vec<f32>,
        exact: Vec<f64>,
        dtype: Dtype,
    }

    impl Weights {
        fn random(rng: &mut Rng, dtype: Dtype, n: usize) -> Weights {
            let vals: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let (bits, exact): (Vec<u16>, Vec<f64>) = match dtype {
                Dtype::Bf16 => vals
                    .iter()
                    .map(|&v| {
                        let b = half::bf16::from_f32(v);
                        (b.to_bits(), b.to_f64())
                    })
                    .unzip(),
                Dtype::F16 => vals
                    .iter()
                    .map(|&v| {
                        let h = half::f16::from_f32(v);
                        (h.to_bits(), h.to_f64())
                    })
                    .unzip(),
                Dtype::F32 => (Vec::new(), vals.iter().map(|&v| v as f64).collect()),
            };
            Weights { bits, f32s: vals, exact, dtype }
        }

        fn as_ref(&self) -> WeightRef<'_> {
            match self.dtype {
                Dtype::Bf16 => WeightRef::Bf16(&self.bits),
                Dtype::F16 => WeightRef::F16(&self.bits),
                Dtype::F32 => WeightRef::F32(&self.f32s),
            }
        }
    }

    fn isas() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        if Isa::detect() != Isa::Portable {
            v.push(Isa::detect());
        }
        v
    }

    /// max |got − ref| / max |ref| over the whole output, against an f64 reference.
    fn check(isa: Isa, path: Path, rng: &mut Rng, dtype: Dtype, tokens: usize, rows: usize, cols: usize) {
        let w = Weights::random(rng, dtype, rows * cols);
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.f32()).collect();
        let mut out = vec![f32::NAN; tokens * rows];
        matmul_with(isa, path, &x, tokens, w.as_ref(), rows, cols, &mut out);
        let mut max_ref = 0.0f64;
        let mut max_err = 0.0f64;
        for t in 0..tokens {
            for r in 0..rows {
                let want: f64 = (0..cols).map(|c| x[t * cols + c] as f64 * w.exact[r * cols + c]).sum();
                let got = out[t * rows + r] as f64;
                assert!(got.is_finite(), "{isa:?} {path:?} {dtype:?} t={t} r={r}: not written");
                max_ref = max_ref.max(want.abs());
                max_err = max_err.max((got - want).abs());
            }
        }
        assert!(
            max_err <= 1e-5 * max_ref.max(1e-30),
            "{isa:?} {path:?} {dtype:?} tokens={tokens} rows={rows} cols={cols}: \
             max err {max_err:e} vs max |ref| {max_ref:e}"
        );
    }

    const DTYPES: [Dtype; 3] = [Dtype::Bf16, Dtype::F16, Dtype::F32];
    const TOKENS: [usize; 7] = [1, 2, 3, 7, 17, 64, 130];
    const ROWS: [usize; 6] = [1, 3, 17, 64, 257, 1000];
    const COLS: [usize; 7] = [1, 5, 8, 31, 64, 100, 1024];

    /// Every dtype × path × ISA on a pruned token × rows × cols grid: all small and awkward
    /// combinations, and the large ones only where the f64 reference stays cheap.
    #[test]
    fn matches_f64_reference() {
        let mut rng = Rng(0x0123_4567_89ab_cdef);
        let mut cases = 0;
        for &tokens in &TOKENS {
            for &rows in &ROWS {
                for &cols in &COLS {
                    if tokens * rows * cols > 2_000_000 {
                        continue;
                    }
                    for isa in isas() {
                        for path in [Path::Gemv, Path::Gemm] {
                            for dtype in DTYPES {
                                check(isa, path, &mut rng, dtype, tokens, rows, cols);
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(cases > 500, "grid pruned too hard: {cases}");
    }

    /// The public entry point (with its own path choice) around the GEMV/gemm threshold and
    /// on shapes larger than one parallel block.
    #[test]
    fn public_matmul_across_threshold() {
        let mut rng = Rng(7);
        let from = gemm_min_tokens();
        for tokens in [1, from - 1, from, from + 1] {
            for dtype in DTYPES {
                let (rows, cols) = (300, 1100);
                let w = Weights::random(&mut rng, dtype, rows * cols);
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.f32()).collect();
                let mut got = vec![f32::NAN; tokens * rows];
                matmul(&x, tokens, w.as_ref(), rows, cols, &mut got);
                let mut want = vec![f32::NAN; tokens * rows];
                matmul_with(Isa::Portable, Path::Gemv, &x, tokens, w.as_ref(), rows, cols, &mut want);
                let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-5 * max_ref, "{dtype:?} tokens={tokens}");
                }
            }
        }
    }

    /// Rows wider than one gemm column tile are split and accumulated.
    #[test]
    fn gemm_column_tiles() {
        let mut rng = Rng(11);
        for isa in isas() {
            for dtype in DTYPES {
                check(isa, Path::Gemm, &mut rng, dtype, 5, 9, 2 * GEMM_MAX_COLS + 9);
            }
        }
    }

    #[test]
    fn empty_shapes() {
        for isa in isas() {
            for path in [Path::Gemv, Path::Gemm] {
                // cols = 0: every output is an empty sum.
                let mut out = vec![f32::NAN; 6];
                matmul_with(isa, path, &[], 2, WeightRef::F32(&[]), 3, 0, &mut out);
                assert_eq!(out, [0.0; 6]);
                // No tokens or no rows: nothing to write, nothing to read out of bounds.
                matmul_with(isa, path, &[], 0, WeightRef::Bf16(&[0; 12]), 3, 4, &mut []);
                matmul_with(isa, path, &[0.0; 8], 2, WeightRef::F16(&[]), 0, 4, &mut []);
            }
        }
    }

    #[test]
    fn row_to_f32_is_exact() {
        let mut rng = Rng(99);
        for dtype in DTYPES {
            for (rows, cols) in [(1, 1), (5, 7), (3, 8), (4, 1027)] {
                let w = Weights::random(&mut rng, dtype, rows * cols);
                for r in 0..rows {
                    let mut out = vec![f32::NAN; cols];
                    row_to_f32(w.as_ref(), cols, r, &mut out);
                    for (c, (&got, &want)) in out.iter().zip(&w.exact[r * cols..]).enumerate() {
                        assert_eq!(got as f64, want, "{dtype:?} r={r} c={c}");
                    }
                }
            }
        }
    }

    /// Portable and AVX2 widening agree bit for bit, including the sub-vector tail.
    #[test]
    fn widening_paths_agree() {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        for isa in isas() {
            let mut a = vec![0.0f32; bits.len() - 3];
            let mut b = a.clone();
            widen::<Bf16>(isa, &bits[3..], &mut a);
            Bf16::widen(&bits[3..], &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            widen::<F16>(isa, &bits[3..], &mut a);
            for (x, &h) in a.iter().zip(&bits[3..]) {
                let want = half::f16::from_bits(h).to_f32();
                assert!(x.to_bits() == want.to_bits() || (x.is_nan() && want.is_nan()));
            }
        }
    }

    #[test]
    #[should_panic(expected = "out is not [tokens, rows]")]
    fn short_out_panics() {
        matmul(&[0.0; 4], 1, WeightRef::F32(&[0.0; 8]), 2, 4, &mut [0.0; 1]);
    }
}
