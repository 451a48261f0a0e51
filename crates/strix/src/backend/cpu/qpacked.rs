//! GGML block weights (Q8_0, Q4_0, Q4_K, Q6_K) repacked at load into groups of eight rows,
//! and the integer matmul kernels that read them: `out = x · Wᵀ` with the activations
//! quantized to 8 bits per block ([`Acts`]).
//!
//! **Layout.** Rows are taken eight at a time (the last group padded with zero blocks).
//! A group stores, block after block, first the eight rows' f16 scales side by side, then the
//! quantized weights as 32-byte vectors holding four consecutive weights of each of the
//! eight rows (i32 lane `r` = row `r`), so that one `vpdpbusd` (or `maddubs` + `madd`)
//! against four activation bytes broadcast to every lane advances all eight rows at once,
//! and the block's result is a vector of eight row sums: no per-row horizontal sum, and the
//! scales apply to eight rows with one vector multiply. Per block of a group (bytes):
//!
//! - Q8_0 (272): `d[8]`, then 8 vectors: vector `j`, lane `r` = weights `4j..4j+4` of row `r`.
//! - Q4_0 (144): `d[8]`, then 4 vectors of nibble pairs: vector `j`, lane `r`, byte `i` holds
//!   weight `4j+i` in its low nibble and `16+4j+i` in its high one (GGML's own byte order
//!   within the row, four bytes at a time).
//! - Q4_K (1184): `d[8]`, `dmin[8]`, the 6-bit scales and mins unpacked to bytes
//!   (`sc[8 sub-blocks][8 rows]`, `mn[8][8]`), then 4 × 8 vectors: group `g`, vector `j`,
//!   lane `r`, byte `i` = weight `64g+4j+i` (low nibble) and `64g+32+4j+i` (high).
//! - Q6_K (1680): `d[8]`, the scales `sc[16 groups of 16][8 rows]` (i8), then for each pair
//!   `p = 2h + s` of 32-weight chunks `A = 4h+s`, `B = 4h+2+s`: 8 vectors of low nibbles
//!   (vector `j`: chunk `A` weight `4j+i` low, chunk `B` weight `4j+i` high: GGML's `ql`
//!   bytes) and 4 vectors of top bits (vector `m`, byte bits 0–1, 2–3, 4–5, 6–7: chunk `A`
//!   weight `4m+i`, `B` `4m+i`, `A` `16+4m+i`, `B` `16+4m+i`).
//!
//! **Arithmetic.** Unsigned weight codes (`q`, or `q + 128` for Q8_0 under VNNI) times the
//! signed activation bytes, summed exactly in i32 per (row, block); each format's offset
//! (−8, −32, −128) enters as the start value `−offset · Σ y` of the block's (or 16-group's)
//! sum, which is the same for all eight rows. Q4_K's and Q6_K's sub-block scales multiply
//! the sub-block sums in i32 (`vpmulld`); Q4_K's mins give a second integer sum `Σ mn · Σy`.
//! The float part, per (row, token), in one order that every kernel follows: `acc = 0`, then
//! for each block `acc = acc + (d_w · d_x) · f32(sumi)` with separate multiplies and add
//! (and for Q4_K `accm = accm + (dmin · d_x) · f32(summ)`, the result `acc − accm`). So the
//! portable, AVX2 and VNNI kernels give the same bits, and a (row, token) result never
//! depends on which other rows or tokens share its tile: batch-invariant by construction.
//!
//! Every i32 sum stays below 2³¹ (Q6_K's largest: 256 · 63 · 127 · 128 < 2²⁹); the
//! conversion to f32 rounds above 2²⁴, the same way in every kernel.

use rayon::prelude::*;

use super::matmul::for_each_block;
use super::qmatmul::{ActRow, Acts, Kern};
use super::simd::{prefetch, prefetch_distance, SharedMut};
use crate::quant::blocks::{
    q4_k_scale_min, Q4_0_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q8_0_BYTES, QK4_0, QK8_0, QK_K,
};

/// Rows per interleaved group.
pub const GROUP: usize = 8;

/// The block formats that have a packed layout.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedKind {
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
}

impl PackedKind {
    /// Weights per block.
    pub fn block(self) -> usize {
        match self {
            PackedKind::Q8_0 => QK8_0,
            PackedKind::Q4_0 => QK4_0,
            PackedKind::Q4_K | PackedKind::Q6_K => QK_K,
        }
    }

    /// Bytes of one block of one row in the GGML layout.
    pub fn row_block_bytes(self) -> usize {
        match self {
            PackedKind::Q8_0 => Q8_0_BYTES,
            PackedKind::Q4_0 => Q4_0_BYTES,
            PackedKind::Q4_K => Q4_K_BYTES,
            PackedKind::Q6_K => Q6_K_BYTES,
        }
    }

    /// Bytes of one block of a group of eight rows: eight GGML blocks, plus Q4_K's unpacked
    /// scales (64 bytes more, less the 12 × 8 packed ones).
    pub fn group_block_bytes(self) -> usize {
        match self {
            PackedKind::Q4_K => 32 + 64 + 64 + 1024,
            k => GROUP * k.row_block_bytes(),
        }
    }

    /// The activation block size this format pairs with (GGML's Q8_0 / Q8_K).
    pub fn act_block(self) -> usize {
        match self {
            PackedKind::Q8_0 | PackedKind::Q4_0 => 32,
            PackedKind::Q4_K | PackedKind::Q6_K => QK_K,
        }
    }
}

/// A `[rows, cols]` matrix in a packed layout (see the module documentation).
pub struct Packed {
    kind: PackedKind,
    rows: usize,
    cols: usize,
    data: super::pages::HugeBuf,
}

impl Packed {
    /// Repacks `bytes`, `rows` rows of `cols` weights in GGML blocks (`cols` a whole number of
    /// blocks; the caller checked the length).
    pub fn pack(kind: PackedKind, bytes: &[u8], rows: usize, cols: usize) -> Packed {
        let nb = cols / kind.block();
        let (rb, gb) = (kind.row_block_bytes(), kind.group_block_bytes());
        assert!(cols.is_multiple_of(kind.block()), "pack: {cols} columns is not a whole number of blocks");
        assert_eq!(bytes.len(), rows * nb * rb, "pack: bytes are not [rows, cols]");
        let groups = rows.div_ceil(GROUP);
        let mut data = super::pages::HugeBuf::zeroed(groups * nb * gb);
        let zero = vec![0u8; rb];
        data.par_chunks_mut((nb * gb).max(1)).enumerate().for_each(|(g, dst)| {
            for (b, dst) in dst.chunks_exact_mut(gb).enumerate() {
                let src: [&[u8]; GROUP] = std::array::from_fn(|i| {
                    let r = g * GROUP + i;
                    if r < rows {
                        &bytes[(r * nb + b) * rb..(r * nb + b + 1) * rb]
                    } else {
                        &zero
                    }
                });
                pack_block(kind, &src, dst);
            }
        });
        Packed { kind, rows, cols, data }
    }

    pub fn kind(&self) -> PackedKind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (padding rows included).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn group(&self, g: usize) -> &[u8] {
        let n = self.cols / self.kind.block() * self.kind.group_block_bytes();
        &self.data[g * n..(g + 1) * n]
    }

    /// Row `r` in its GGML block layout (the bytes [`Packed::pack`] was given).
    pub fn row_bytes(&self, r: usize, out: &mut [u8]) {
        assert!(r < self.rows, "row {r} out of range");
        let (rb, gb) = (self.kind.row_block_bytes(), self.kind.group_block_bytes());
        assert_eq!(out.len(), self.cols / self.kind.block() * rb, "row_bytes: out length");
        let group = self.group(r / GROUP);
        for (src, dst) in group.chunks_exact(gb).zip(out.chunks_exact_mut(rb)) {
            unpack_block(self.kind, src, r % GROUP, dst);
        }
    }

    /// Row `r` from block `b0` on, dequantized into `out` (a whole number of blocks), with
    /// GGML's dequantizers.
    pub fn dequantize(&self, r: usize, b0: usize, out: &mut [f32]) {
        use crate::quant::blocks as q;
        let (bs, rb, gb) = (self.kind.block(), self.kind.row_block_bytes(), self.kind.group_block_bytes());
        assert!(r < self.rows, "row {r} out of range");
        assert!(out.len().is_multiple_of(bs) && b0 * bs + out.len() <= self.cols, "dequantize: range");
        let group = self.group(r / GROUP);
        let mut blk = [0u8; Q6_K_BYTES];
        let blk = &mut blk[..rb];
        for (i, dst) in out.chunks_exact_mut(bs).enumerate() {
            unpack_block(self.kind, &group[(b0 + i) * gb..(b0 + i + 1) * gb], r % GROUP, blk);
            match self.kind {
                PackedKind::Q8_0 => q::dequantize_row_q8_0(blk, dst),
                PackedKind::Q4_0 => q::dequantize_row_q4_0(blk, dst),
                PackedKind::Q4_K => q::dequantize_row_q4_k(blk, dst),
                PackedKind::Q6_K => q::dequantize_row_q6_k(blk, dst),
            }
        }
    }

    /// `out[t * rows + r] = Σ_c x[t * cols + c] · w[r, c]` with `x` quantized per block to
    /// 8 bits; `out` is overwritten.
    pub(crate) fn matmul(&self, isa: Kern, x: &[f32], tokens: usize, out: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        if super::matmul::settled_product("qmatmul", x, tokens, rows, cols, out) {
            return;
        }
        let acts = Acts::quantize(x, tokens, cols, self.kind.act_block());
        match self.kind {
            PackedKind::Q8_0 => self.run::<Q8>(isa, &acts, tokens, out),
            PackedKind::Q4_0 => self.run::<Q4>(isa, &acts, tokens, out),
            PackedKind::Q4_K => self.run::<Q4K>(isa, &acts, tokens, out),
            PackedKind::Q6_K => self.run::<Q6K>(isa, &acts, tokens, out),
        }
    }

    fn run<F: Kernels>(&self, isa: Kern, acts: &Acts, tokens: usize, out: &mut [f32]) {
        let rows = self.rows;
        let nb = self.cols / self.kind.block();
        let group_bytes = nb * self.kind.group_block_bytes();
        let groups = rows.div_ceil(GROUP);
        let block_bytes = if tokens == 1 { GEMV_BLOCK_BYTES } else { TILE_BLOCK_BYTES };
        // Enough blocks for every thread even on small matrices.
        let per_thread = groups.div_ceil(2 * rayon::current_num_threads()).max(1);
        let block = (block_bytes / group_bytes).clamp(1, per_thread);
        let parallel = groups * group_bytes * tokens >= PARALLEL_MIN_WORK;
        // One token streams the weights from memory once: there the kernels prefetch ahead
        // (where the CPU wants it); several tokens reuse each block from cache.
        let pf = if tokens == 1 { prefetch_distance() } else { 0 };
        // Every parallel block writes the output columns of its own row groups only.
        let out = SharedMut::new(out);
        for_each_block(groups, block, parallel, |g0, g1| {
            let write = |g: usize, t: usize, v: &[f32; GROUP]| {
                let r0 = g * GROUP;
                for (i, &v) in v.iter().enumerate().take(rows - r0) {
                    // SAFETY: (t, r0 + i) is inside the output, and rows r0.. belong to this block.
                    unsafe { out.write(t * rows + r0 + i, v) };
                }
            };
            let mut t = 0;
            while t + TILE_TOKENS <= tokens {
                let xs: [ActRow; TILE_TOKENS] = std::array::from_fn(|i| acts.row(t + i));
                for g in g0..g1 {
                    let sums = F::tile::<TILE_TOKENS>(isa, self.group(g), nb, &xs, 0);
                    for (i, s) in sums.iter().enumerate() {
                        write(g, t + i, s);
                    }
                }
                t += TILE_TOKENS;
            }
            for t in t..tokens {
                let xs = [acts.row(t)];
                for g in g0..g1 {
                    let [s] = F::tile::<1>(isa, self.group(g), nb, &xs, pf);
                    write(g, t, &s);
                }
            }
        });
    }
}

/// Weight bytes per parallel work item for decode.
const GEMV_BLOCK_BYTES: usize = 32 << 10;
/// Weight bytes per work item with several tokens: kept in L2 while the tokens stream past.
const TILE_BLOCK_BYTES: usize = 64 << 10;
/// Below this much work (weight bytes × tokens) everything runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 128 << 10;
/// Tokens per tile: each unpacked weight vector is used this many times from registers.
const TILE_TOKENS: usize = 4;

// ------------------------------------------------------------------------------------
// Packing

fn f16_bits(b: &[u8], at: usize) -> [u8; 2] {
    [b[at], b[at + 1]]
}

/// The 16 bytes of eight rows' f16 scales at byte `at` of each row block.
fn scales16(src: &[&[u8]; GROUP], at: usize, dst: &mut [u8]) {
    for (r, s) in src.iter().enumerate() {
        dst[2 * r..2 * r + 2].copy_from_slice(&f16_bits(s, at));
    }
}

/// Vectors of 4 bytes per row: vector `j`, lane `r` = `src[r][at + 4j..at + 4j + 4]`.
fn interleave4(src: &[&[u8]; GROUP], at: usize, vectors: usize, dst: &mut [u8]) {
    for j in 0..vectors {
        for (r, s) in src.iter().enumerate() {
            dst[32 * j + 4 * r..32 * j + 4 * r + 4].copy_from_slice(&s[at + 4 * j..at + 4 * j + 4]);
        }
    }
}

/// The inverse of [`interleave4`] for row `r`.
fn deinterleave4(src: &[u8], r: usize, vectors: usize, dst: &mut [u8]) {
    for j in 0..vectors {
        dst[4 * j..4 * j + 4].copy_from_slice(&src[32 * j + 4 * r..32 * j + 4 * r + 4]);
    }
}

/// Q6_K's 6-bit code of weight `k` (0..256) of a GGML block.
fn q6_code(b: &[u8], k: usize) -> u8 {
    let (h, c, l) = (k / 128, (k % 128) / 32, k % 32);
    let ql = b[64 * h + l + 32 * (c % 2)];
    let lo = if c < 2 { ql & 0x0f } else { ql >> 4 };
    let hi = (b[QK_K / 2 + 32 * h + l] >> (2 * c)) & 3;
    lo | (hi << 4)
}

/// Offsets within a packed Q6_K block.
const Q6_SC: usize = 16;
const Q6_PAIRS: usize = 16 + 128;
const Q6_PAIR_BYTES: usize = 8 * 32 + 4 * 32;
/// Offsets within a packed Q4_K block.
const Q4K_SC: usize = 32;
const Q4K_MN: usize = 96;
const Q4K_QS: usize = 160;

/// The two 32-weight chunks (`A`, `B`) of Q6_K pair `p`.
fn q6_pair(p: usize) -> (usize, usize) {
    let (h, s) = (p / 2, p % 2);
    (4 * h + s, 4 * h + 2 + s)
}

fn pack_block(kind: PackedKind, src: &[&[u8]; GROUP], dst: &mut [u8]) {
    match kind {
        PackedKind::Q8_0 => {
            scales16(src, 0, &mut dst[..16]);
            interleave4(src, 2, 8, &mut dst[16..]);
        }
        PackedKind::Q4_0 => {
            scales16(src, 0, &mut dst[..16]);
            interleave4(src, 2, 4, &mut dst[16..]);
        }
        PackedKind::Q4_K => {
            scales16(src, 0, &mut dst[..16]);
            scales16(src, 2, &mut dst[16..32]);
            for (r, s) in src.iter().enumerate() {
                for c in 0..8 {
                    let (sc, mn) = q4_k_scale_min(c, &s[4..16]);
                    dst[Q4K_SC + 8 * c + r] = sc;
                    dst[Q4K_MN + 8 * c + r] = mn;
                }
            }
            for g in 0..4 {
                interleave4(src, 16 + 32 * g, 8, &mut dst[Q4K_QS + 256 * g..]);
            }
        }
        PackedKind::Q6_K => {
            scales16(src, QK_K / 2 + QK_K / 4 + QK_K / 16, &mut dst[..16]);
            for (r, s) in src.iter().enumerate() {
                for g in 0..16 {
                    dst[Q6_SC + 8 * g + r] = s[QK_K / 2 + QK_K / 4 + g];
                }
            }
            for p in 0..4 {
                let (a, b) = q6_pair(p);
                let base = Q6_PAIRS + p * Q6_PAIR_BYTES;
                // The low nibbles are GGML's ql bytes 64h + 32s.. as they stand.
                interleave4(src, 64 * (p / 2) + 32 * (p % 2), 8, &mut dst[base..]);
                let qh = &mut dst[base + 256..base + Q6_PAIR_BYTES];
                for (r, s) in src.iter().enumerate() {
                    for m in 0..4 {
                        for i in 0..4 {
                            let k = 4 * m + i;
                            let top = |chunk: usize, k: usize| q6_code(s, 32 * chunk + k) >> 4;
                            qh[32 * m + 4 * r + i] =
                                top(a, k) | (top(b, k) << 2) | (top(a, 16 + k) << 4) | (top(b, 16 + k) << 6);
                        }
                    }
                }
            }
        }
    }
}

/// Row `r`'s GGML block from a packed group block: the inverse of [`pack_block`].
fn unpack_block(kind: PackedKind, src: &[u8], r: usize, dst: &mut [u8]) {
    match kind {
        PackedKind::Q8_0 => {
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            deinterleave4(&src[16..], r, 8, &mut dst[2..]);
        }
        PackedKind::Q4_0 => {
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            deinterleave4(&src[16..], r, 4, &mut dst[2..]);
        }
        PackedKind::Q4_K => {
            dst[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            dst[2..4].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
            let s = |c: usize| src[Q4K_SC + 8 * c + r];
            let m = |c: usize| src[Q4K_MN + 8 * c + r];
            // GGML's 12-byte packing of eight 6-bit scales and mins (q4_k_scale_min inverted).
            for i in 0..4 {
                dst[4 + i] = s(i) | ((s(i + 4) >> 4) << 6);
                dst[4 + i + 4] = m(i) | ((m(i + 4) >> 4) << 6);
                dst[4 + i + 8] = (s(i + 4) & 0x0f) | ((m(i + 4) & 0x0f) << 4);
            }
            for g in 0..4 {
                deinterleave4(&src[Q4K_QS + 256 * g..], r, 8, &mut dst[16 + 32 * g..]);
            }
        }
        PackedKind::Q6_K => {
            let at = QK_K / 2 + QK_K / 4;
            dst[at + QK_K / 16..at + QK_K / 16 + 2].copy_from_slice(&src[2 * r..2 * r + 2]);
            for g in 0..16 {
                dst[at + g] = src[Q6_SC + 8 * g + r];
            }
            let mut q = [0u8; QK_K];
            for p in 0..4 {
                let (a, b) = q6_pair(p);
                let base = Q6_PAIRS + p * Q6_PAIR_BYTES;
                for j in 0..8 {
                    for i in 0..4 {
                        let v = src[base + 32 * j + 4 * r + i];
                        let h = src[base + 256 + 32 * (j % 4) + 4 * r + i] >> (4 * (j / 4));
                        q[32 * a + 4 * j + i] = (v & 0x0f) | ((h & 3) << 4);
                        q[32 * b + 4 * j + i] = (v >> 4) | (((h >> 2) & 3) << 4);
                    }
                }
            }
            let (ql, qh) = dst[..at].split_at_mut(QK_K / 2);
            for h in 0..2 {
                for l in 0..32 {
                    let c = |c: usize| q[128 * h + 32 * c + l];
                    ql[64 * h + l] = (c(0) & 0x0f) | ((c(2) & 0x0f) << 4);
                    ql[64 * h + l + 32] = (c(1) & 0x0f) | ((c(3) & 0x0f) << 4);
                    qh[32 * h + l] =
                        (c(0) >> 4) | ((c(1) >> 4) << 2) | ((c(2) >> 4) << 4) | ((c(3) >> 4) << 6);
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------
// Kernels

/// One format's group kernel: a group's `nb` blocks (`w`) against `T` activation rows,
/// giving `[token][row of the group]`.
trait Kernels {
    fn portable<const T: usize>(w: &[u8], nb: usize, xs: &[ActRow; T]) -> [[f32; GROUP]; T];
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn avx2<const T: usize>(w: &[u8], nb: usize, xs: &[ActRow; T], pf: usize) -> [[f32; GROUP]; T];
    /// # Safety
    /// AVX2, FMA, F16C, AVX-512 VNNI and VL must be available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni<const T: usize>(w: &[u8], nb: usize, xs: &[ActRow; T], pf: usize) -> [[f32; GROUP]; T];

    /// `pf`: how far ahead of each block (bytes) the x86 kernels prefetch the weights, 0 for
    /// not at all. A hint only: the results never depend on it.
    #[inline]
    fn tile<const T: usize>(
        isa: Kern,
        w: &[u8],
        nb: usize,
        xs: &[ActRow; T],
        pf: usize,
    ) -> [[f32; GROUP]; T] {
        let _ = pf;
        match isa {
            // SAFETY: `Kern::Avx2` is only produced after detecting AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            Kern::Avx2 => unsafe { Self::avx2::<T>(w, nb, xs, pf) },
            // SAFETY: `Kern::Vnni` additionally needs AVX-512 VNNI and VL, detected likewise.
            #[cfg(target_arch = "x86_64")]
            Kern::Vnni => unsafe { Self::vnni::<T>(w, nb, xs, pf) },
            Kern::Portable => Self::portable::<T>(w, nb, xs),
        }
    }
}

struct Q8;
struct Q4;
struct Q4K;
struct Q6K;

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The portable kernels: for each row of the group, the GGML block recovered and its exact
/// integer sums, then the float steps of the module documentation.
fn portable_generic<const T: usize>(
    kind: PackedKind,
    w: &[u8],
    nb: usize,
    xs: &[ActRow; T],
) -> [[f32; GROUP]; T] {
    let gb = kind.group_block_bytes();
    let mut acc = [[0f32; GROUP]; T];
    let mut accm = [[0f32; GROUP]; T];
    let mut blk = vec![0u8; kind.row_block_bytes()];
    for b in 0..nb {
        let src = &w[b * gb..(b + 1) * gb];
        for r in 0..GROUP {
            unpack_block(kind, src, r, &mut blk);
            for (t, x) in xs.iter().enumerate() {
                let bs = kind.block();
                let y = &x.qs[bs * b..bs * (b + 1)];
                let dx = x.d[b];
                let (d, sumi, dmin, summ): (f32, i32, f32, i32) = match kind {
                    PackedKind::Q8_0 => {
                        let s = blk[2..].iter().zip(y).map(|(&q, &y)| q as i8 as i32 * y as i32).sum();
                        (f16_at(&blk, 0), s, 0.0, 0)
                    }
                    PackedKind::Q4_0 => {
                        let s = (0..32)
                            .map(|k| {
                                let v = blk[2 + k % 16];
                                let q = if k < 16 { v & 0x0f } else { v >> 4 };
                                (q as i32 - 8) * y[k] as i32
                            })
                            .sum();
                        (f16_at(&blk, 0), s, 0.0, 0)
                    }
                    PackedKind::Q4_K => {
                        let mut s = 0i32;
                        let mut m = 0i32;
                        for c in 0..8 {
                            let (sc, mn) = q4_k_scale_min(c, &blk[4..16]);
                            let (g, hi) = (c / 2, c % 2);
                            let dot: i32 = (0..32)
                                .map(|l| {
                                    let v = blk[16 + 32 * g + l];
                                    let q = if hi == 0 { v & 0x0f } else { v >> 4 };
                                    q as i32 * y[32 * c + l] as i32
                                })
                                .sum();
                            s += sc as i32 * dot;
                            m += mn as i32 * x.sums[8 * b + c] as i32;
                        }
                        (f16_at(&blk, 0), s, f16_at(&blk, 2), m)
                    }
                    PackedKind::Q6_K => {
                        let at = QK_K / 2 + QK_K / 4;
                        let mut s = 0i32;
                        for g in 0..16 {
                            let dot: i32 = (0..16)
                                .map(|l| q6_code(&blk, 16 * g + l) as i32 * y[16 * g + l] as i32)
                                .sum();
                            s += blk[at + g] as i8 as i32 * (dot - 32 * x.sums16[16 * b + g] as i32);
                        }
                        (f16_at(&blk, at + QK_K / 16), s, 0.0, 0)
                    }
                };
                acc[t][r] += (d * dx) * sumi as f32;
                if kind == PackedKind::Q4_K {
                    accm[t][r] += (dmin * dx) * summ as f32;
                }
            }
        }
    }
    if kind == PackedKind::Q4_K {
        for (a, m) in acc.iter_mut().zip(&accm) {
            for (a, m) in a.iter_mut().zip(m) {
                *a -= m;
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
macro_rules! dp_vnni {
    ($acc:expr, $u:expr, $y:expr) => {
        _mm256_dpbusd_epi32($acc, $u, $y)
    };
}

/// `vpdpbusd` in AVX2: exact while each pair of u8 × i8 products fits an i16 (weight codes
/// up to 63 here: 2 · 63 · 127 < 2¹⁵).
#[cfg(target_arch = "x86_64")]
macro_rules! dp_avx2 {
    ($acc:expr, $u:expr, $y:expr) => {
        _mm256_add_epi32($acc, _mm256_madd_epi16(_mm256_maddubs_epi16($u, $y), _mm256_set1_epi16(1)))
    };
}

/// The x86 kernels, instantiated once per ISA (`$dp` is the u8 × i8 dot product step).
#[cfg(target_arch = "x86_64")]
macro_rules! x86_kernels {
    ($m:ident, $features:literal, $dp:ident, $vnni:expr) => {
        mod $m {
            use super::*;
            use std::arch::x86_64::*;

            #[inline(always)]
            unsafe fn bcast(p: *const i8) -> __m256i {
                _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
            }

            #[inline(always)]
            unsafe fn load(p: *const u8) -> __m256i {
                _mm256_loadu_si256(p.cast())
            }

            /// Eight f16 at `p` as f32.
            #[inline(always)]
            unsafe fn d8(p: *const u8) -> __m256 {
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
            }

            /// acc + (d · dx) · f32(sumi), unfused.
            #[inline(always)]
            unsafe fn step(acc: __m256, d: __m256, dx: f32, sumi: __m256i) -> __m256 {
                _mm256_add_ps(
                    acc,
                    _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(sumi)),
                )
            }

            #[inline(always)]
            unsafe fn store<const T: usize>(acc: [__m256; T]) -> [[f32; GROUP]; T] {
                let mut out = [[0f32; GROUP]; T];
                for (o, a) in out.iter_mut().zip(acc) {
                    _mm256_storeu_ps(o.as_mut_ptr(), a);
                }
                out
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn q8<const T: usize>(
                w: &[u8],
                nb: usize,
                xs: &[ActRow; T],
                pf: usize,
            ) -> [[f32; GROUP]; T] {
                let gb = PackedKind::Q8_0.group_block_bytes();
                let mut acc = [_mm256_setzero_ps(); T];
                let ones = _mm256_set1_epi16(1);
                let flip = _mm256_set1_epi8(-128);
                for b in 0..nb {
                    let p = w.as_ptr().add(b * gb);
                    if pf > 0 {
                        prefetch(p.wrapping_add(pf), gb);
                    }
                    let mut t = [_mm256_setzero_si256(); T];
                    if $vnni {
                        for (t, x) in t.iter_mut().zip(xs) {
                            *t = _mm256_set1_epi32(-128 * *x.sums.get_unchecked(b) as i32);
                        }
                    }
                    for j in 0..8 {
                        let q = load(p.add(16 + 32 * j));
                        if $vnni {
                            // q + 128 as u8; the −128 · Σy start value takes it back.
                            let u = _mm256_xor_si256(q, flip);
                            for (t, x) in t.iter_mut().zip(xs) {
                                *t = $dp!(*t, u, bcast(x.qs.as_ptr().add(32 * b + 4 * j)));
                            }
                        } else {
                            // |q| unsigned, its sign moved onto y (GGML's mul_sum_i8_pairs).
                            let aq = _mm256_sign_epi8(q, q);
                            for (t, x) in t.iter_mut().zip(xs) {
                                let y = _mm256_sign_epi8(bcast(x.qs.as_ptr().add(32 * b + 4 * j)), q);
                                *t = _mm256_add_epi32(
                                    *t,
                                    _mm256_madd_epi16(_mm256_maddubs_epi16(aq, y), ones),
                                );
                            }
                        }
                    }
                    let d = d8(p);
                    for ((a, t), x) in acc.iter_mut().zip(t).zip(xs) {
                        *a = step(*a, d, *x.d.get_unchecked(b), t);
                    }
                }
                store(acc)
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn q4<const T: usize>(
                w: &[u8],
                nb: usize,
                xs: &[ActRow; T],
                pf: usize,
            ) -> [[f32; GROUP]; T] {
                let gb = PackedKind::Q4_0.group_block_bytes();
                let mut acc = [_mm256_setzero_ps(); T];
                let low = _mm256_set1_epi8(0x0f);
                for b in 0..nb {
                    let p = w.as_ptr().add(b * gb);
                    if pf > 0 {
                        prefetch(p.wrapping_add(pf), gb);
                    }
                    let mut t = [_mm256_setzero_si256(); T];
                    for (t, x) in t.iter_mut().zip(xs) {
                        *t = _mm256_set1_epi32(-8 * *x.sums.get_unchecked(b) as i32);
                    }
                    for j in 0..4 {
                        let q = load(p.add(16 + 32 * j));
                        let lo = _mm256_and_si256(q, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                        for (t, x) in t.iter_mut().zip(xs) {
                            let y = x.qs.as_ptr().add(32 * b + 4 * j);
                            *t = $dp!(*t, lo, bcast(y));
                            *t = $dp!(*t, hi, bcast(y.add(16)));
                        }
                    }
                    let d = d8(p);
                    for ((a, t), x) in acc.iter_mut().zip(t).zip(xs) {
                        *a = step(*a, d, *x.d.get_unchecked(b), t);
                    }
                }
                store(acc)
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn q4k<const T: usize>(
                w: &[u8],
                nb: usize,
                xs: &[ActRow; T],
                pf: usize,
            ) -> [[f32; GROUP]; T] {
                let gb = PackedKind::Q4_K.group_block_bytes();
                let mut acc = [_mm256_setzero_ps(); T];
                let mut accm = [_mm256_setzero_ps(); T];
                let low = _mm256_set1_epi8(0x0f);
                for b in 0..nb {
                    let p = w.as_ptr().add(b * gb);
                    if pf > 0 {
                        prefetch(p.wrapping_add(pf), gb);
                    }
                    let mut sumi = [_mm256_setzero_si256(); T];
                    for g in 0..4 {
                        let mut tl = [_mm256_setzero_si256(); T];
                        let mut th = [_mm256_setzero_si256(); T];
                        for j in 0..8 {
                            let q = load(p.add(Q4K_QS + 256 * g + 32 * j));
                            let lo = _mm256_and_si256(q, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
                            for ((tl, th), x) in tl.iter_mut().zip(th.iter_mut()).zip(xs) {
                                let y = x.qs.as_ptr().add(QK_K * b + 64 * g + 4 * j);
                                *tl = $dp!(*tl, lo, bcast(y));
                                *th = $dp!(*th, hi, bcast(y.add(32)));
                            }
                        }
                        let sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(Q4K_SC + 16 * g).cast()));
                        let sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(Q4K_SC + 16 * g + 8).cast()));
                        for ((s, tl), th) in sumi.iter_mut().zip(tl).zip(th) {
                            *s = _mm256_add_epi32(*s, _mm256_mullo_epi32(tl, sl));
                            *s = _mm256_add_epi32(*s, _mm256_mullo_epi32(th, sh));
                        }
                    }
                    let mut summ = [_mm256_setzero_si256(); T];
                    for c in 0..8 {
                        let mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(Q4K_MN + 8 * c).cast()));
                        for (s, x) in summ.iter_mut().zip(xs) {
                            let ys = _mm256_set1_epi32(*x.sums.get_unchecked(8 * b + c) as i32);
                            *s = _mm256_add_epi32(*s, _mm256_mullo_epi32(mn, ys));
                        }
                    }
                    let d = d8(p);
                    let dmin = d8(p.add(16));
                    for t in 0..T {
                        let dx = *xs[t].d.get_unchecked(b);
                        acc[t] = step(acc[t], d, dx, sumi[t]);
                        accm[t] = step(accm[t], dmin, dx, summ[t]);
                    }
                }
                let mut out = [_mm256_setzero_ps(); T];
                for t in 0..T {
                    out[t] = _mm256_sub_ps(acc[t], accm[t]);
                }
                store(out)
            }

            #[target_feature(enable = $features)]
            pub(super) unsafe fn q6k<const T: usize>(
                w: &[u8],
                nb: usize,
                xs: &[ActRow; T],
                pf: usize,
            ) -> [[f32; GROUP]; T] {
                let gb = PackedKind::Q6_K.group_block_bytes();
                let mut acc = [_mm256_setzero_ps(); T];
                let low = _mm256_set1_epi8(0x0f);
                let top = _mm256_set1_epi8(0x30);
                for b in 0..nb {
                    let p = w.as_ptr().add(b * gb);
                    if pf > 0 {
                        prefetch(p.wrapping_add(pf), gb);
                    }
                    let mut sumi = [_mm256_setzero_si256(); T];
                    for pair in 0..4 {
                        let (ca, cb) = q6_pair(pair);
                        let base = p.add(Q6_PAIRS + pair * Q6_PAIR_BYTES);
                        // 16-groups 2A, 2A+1, 2B, 2B+1, each starting from −32 · Σy.
                        let groups = [2 * ca, 2 * ca + 1, 2 * cb, 2 * cb + 1];
                        let mut acc4 = [[_mm256_setzero_si256(); 4]; T];
                        for (a4, x) in acc4.iter_mut().zip(xs) {
                            for (a, &g) in a4.iter_mut().zip(&groups) {
                                *a = _mm256_set1_epi32(-32 * *x.sums16.get_unchecked(16 * b + g) as i32);
                            }
                        }
                        for m in 0..4 {
                            let qh = load(base.add(256 + 32 * m));
                            let ql0 = load(base.add(32 * m));
                            let ql4 = load(base.add(32 * (m + 4)));
                            let u = [
                                _mm256_or_si256(
                                    _mm256_and_si256(ql0, low),
                                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), top),
                                ),
                                _mm256_or_si256(_mm256_and_si256(ql4, low), _mm256_and_si256(qh, top)),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low),
                                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), top),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql4), low),
                                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), top),
                                ),
                            ];
                            let offs = [
                                32 * ca + 4 * m,
                                32 * ca + 16 + 4 * m,
                                32 * cb + 4 * m,
                                32 * cb + 16 + 4 * m,
                            ];
                            for (a4, x) in acc4.iter_mut().zip(xs) {
                                let y = x.qs.as_ptr().add(QK_K * b);
                                for k in 0..4 {
                                    a4[k] = $dp!(a4[k], u[k], bcast(y.add(offs[k])));
                                }
                            }
                        }
                        for k in 0..4 {
                            let sc =
                                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(Q6_SC + 8 * groups[k]).cast()));
                            for (s, a4) in sumi.iter_mut().zip(&acc4) {
                                *s = _mm256_add_epi32(*s, _mm256_mullo_epi32(a4[k], sc));
                            }
                        }
                    }
                    let d = d8(p);
                    for ((a, s), x) in acc.iter_mut().zip(sumi).zip(xs) {
                        *a = step(*a, d, *x.d.get_unchecked(b), s);
                    }
                }
                store(acc)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
x86_kernels!(k_avx2, "avx2,fma,f16c", dp_avx2, false);
#[cfg(target_arch = "x86_64")]
x86_kernels!(k_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", dp_vnni, true);

macro_rules! impl_kernels {
    ($ty:ident, $kind:expr, $f:ident) => {
        impl Kernels for $ty {
            fn portable<const T: usize>(w: &[u8], nb: usize, xs: &[ActRow; T]) -> [[f32; GROUP]; T] {
                portable_generic::<T>($kind, w, nb, xs)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn avx2<const T: usize>(
                w: &[u8],
                nb: usize,
                xs: &[ActRow; T],
                pf: usize,
            ) -> [[f32; GROUP]; T] {
                k_avx2::$f::<T>(w, nb, xs, pf)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn vnni<const T: usize>(
                w: &[u8],
                nb: usize,
                xs: &[ActRow; T],
                pf: usize,
            ) -> [[f32; GROUP]; T] {
                k_vnni::$f::<T>(w, nb, xs, pf)
            }
        }
    };
}

impl_kernels!(Q8, PackedKind::Q8_0, q8);
impl_kernels!(Q4, PackedKind::Q4_0, q4);
impl_kernels!(Q4K, PackedKind::Q4_K, q4k);
impl_kernels!(Q6K, PackedKind::Q6_K, q6k);

#[cfg(test)]
mod tests {
    use super::*;

    /// Arbitrary bytes are valid blocks for every format (any code, any scale bits), so the
    /// layout is checked on all of them: packing then reading a row back gives its bytes,
    /// for row counts around the group of eight.
    #[test]
    fn pack_round_trips_rows() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for kind in [PackedKind::Q8_0, PackedKind::Q4_0, PackedKind::Q4_K, PackedKind::Q6_K] {
            for rows in [1usize, 7, 8, 9, 23] {
                let nb = 3;
                let rb = kind.row_block_bytes();
                let bytes: Vec<u8> = (0..rows * nb * rb)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        (s >> 24) as u8
                    })
                    .collect();
                let p = Packed::pack(kind, &bytes, rows, nb * kind.block());
                assert_eq!(p.bytes(), rows.div_ceil(GROUP) * nb * kind.group_block_bytes());
                let mut row = vec![0u8; nb * rb];
                for r in 0..rows {
                    p.row_bytes(r, &mut row);
                    assert_eq!(row, bytes[r * nb * rb..(r + 1) * nb * rb], "{kind:?} rows={rows} row {r}");
                }
            }
        }
    }
}
