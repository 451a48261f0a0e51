//! The GGML block formats Q8_0, Q4_0, Q4_K and Q6_K, byte for byte, with GGML's reference
//! (de)quantizers (the Q4_K and Q6_K scale searches laid out to vectorize, see "The k-quant
//! scale searches" below).
//!
//! Each function works on a run of whole blocks (`x.len()` a multiple of the block size,
//! the byte slice exactly as long as those blocks) and panics otherwise: callers check
//! lengths once (see [`super::dequantize_row`]), and any byte pattern is a valid block, so
//! nothing here can fail on a bad file.
//!
//! Bit-exactness: every float operation is written in the order and precision of GGML's
//! C reference (`ggml-quants.c`), evaluated strictly in IEEE f32 with no fused
//! multiply-adds (Rust never contracts `a * b + c`). The C reference built without FMA
//! contraction gives the same bytes and floats, which the tests check on vectors made by
//! `scripts/make_gguf_fixtures.py`. fp16 conversions round to nearest even, as GGML's
//! `GGML_FP32_TO_FP16` does.

use half::f16;

/// Weights per Q8_0 block.
pub const QK8_0: usize = 32;
/// Weights per Q4_0 block.
pub const QK4_0: usize = 32;
/// Weights per k-quant super-block (Q4_K, Q6_K).
pub const QK_K: usize = 256;

/// Bytes of one Q8_0 block: f16 scale `d`, then 32 × i8.
pub const Q8_0_BYTES: usize = 2 + QK8_0;
/// Bytes of one Q4_0 block: f16 scale `d`, then 16 bytes of nibbles.
pub const Q4_0_BYTES: usize = 2 + QK4_0 / 2;
/// Bytes of one Q4_K super-block: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and
/// mins, 128 bytes of nibbles.
pub const Q4_K_BYTES: usize = 2 + 2 + K_SCALE_SIZE + QK_K / 2;
/// Bytes of one Q6_K super-block: 128 bytes `ql`, 64 bytes `qh`, 16 × i8 scales, f16 `d`.
pub const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

const K_SCALE_SIZE: usize = 12;

/// Below this a group's largest magnitude counts as zero (GGML's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

fn check(n: usize, block: usize, bytes: usize, block_bytes: usize, what: &str) -> usize {
    assert!(n.is_multiple_of(block), "{what}: {n} weights is not a whole number of {block}-weight blocks");
    let nb = n / block;
    assert_eq!(bytes, nb * block_bytes, "{what}: {nb} blocks take {} bytes", nb * block_bytes);
    nb
}

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// GGML's `nearest_int`: round to nearest (ties to even) by adding 1.5·2^23 and reading the
/// low mantissa bits. Reproduced bit for bit instead of using `round()`, whose ties go away
/// from zero, because the k-quant searches compare errors of candidates built with it.
#[inline]
fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

// ------------------------------------------------------------------------------------
// The k-quant scale searches, laid out for SIMD
//
// GGML fits each sub-block's scale (Q4_K: and min) by trying a list of candidate inverse
// scales, one after another, each a pass over the sub-block's values with running float
// sums. Those sums and comparisons decide the levels, so they must be evaluated exactly as
// GGML does: every sum in GGML's order and association, the candidates in GGML's order.
// One sub-block at a time, that leaves nothing to vectorize. Nor can a sub-block's
// candidates be tried side by side: in Q4_K a winning candidate replaces the min that every
// later candidate of its sub-block starts from. The sub-blocks, though, are independent, so
// the searches run those of several super-blocks side by side, as lanes: each step is a loop
// over the lanes of `[value][lane]` arrays, which the compiler vectorizes, while each lane
// goes through GGML's scalar steps unchanged. (The lane count is a run-time number: a short
// constant one gets the loops unrolled instead, and then vectorized poorly.)

/// Super-blocks whose sub-blocks the k-quant searches take side by side.
const SEARCH_BLOCKS: usize = 4;

/// Values a search takes per pass over its lanes: the loop over them is unrolled inside the
/// loop over lanes, so each lane's running sums stay in registers across them (a loop over
/// lanes per value would load and store every sum for every value). More than this stops
/// the compiler from unrolling it.
const SEARCH_UNROLL: usize = 8;

/// `if c { a } else { b }` as a select: the compiler turns `x[s] = if c { a } else { x[s] }`
/// into a conditional store, which keeps a loop over lanes from vectorizing.
#[inline]
fn pick(c: bool, a: f32, b: f32) -> f32 {
    std::hint::select_unpredictable(c, a, b)
}

/// `nearest_int(fval).clamp(lo, hi) as f32` for integers `lo <= hi`, clamped as a float:
/// `nearest_int` returns an integer of magnitude at most 2^22, which converts exactly, so the
/// result is the same, and SSE2 (x86-64's baseline) has float min/max but no 32-bit integer
/// ones. For the hot loops of the k-quant searches.
#[inline]
fn nearest_level(fval: f32, lo: f32, hi: f32) -> f32 {
    let q = nearest_int(fval) as f32;
    let q = if q < lo { lo } else { q };
    if q > hi {
        hi
    } else {
        q
    }
}

// ------------------------------------------------------------------------------------
// Q8_0

/// Q8_0: `x[j] = qs[j] · d`.
pub fn dequantize_row_q8_0(bytes: &[u8], out: &mut [f32]) {
    check(out.len(), QK8_0, bytes.len(), Q8_0_BYTES, "Q8_0");
    for (b, y) in bytes.chunks_exact(Q8_0_BYTES).zip(out.chunks_exact_mut(QK8_0)) {
        let d = f16_at(b, 0);
        for (y, &q) in y.iter_mut().zip(&b[2..]) {
            *y = q as i8 as f32 * d;
        }
    }
}

/// Q8_0 reference quantizer: `d = amax / 127`, `q = round(x / d)` (ties away from zero, as
/// C's `roundf`), the quotient taken as `x · (1/d)` like GGML.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    check(x.len(), QK8_0, out.len(), Q8_0_BYTES, "Q8_0");
    for (x, b) in x.chunks_exact(QK8_0).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&f16_bytes(d));
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

// ------------------------------------------------------------------------------------
// Q4_0

/// Q4_0: byte `j` holds weight `j` in its low nibble and weight `j + 16` in its high
/// nibble; `x = (nibble − 8) · d`.
pub fn dequantize_row_q4_0(bytes: &[u8], out: &mut [f32]) {
    check(out.len(), QK4_0, bytes.len(), Q4_0_BYTES, "Q4_0");
    for (b, y) in bytes.chunks_exact(Q4_0_BYTES).zip(out.chunks_exact_mut(QK4_0)) {
        let d = f16_at(b, 0);
        let (lo, hi) = y.split_at_mut(QK4_0 / 2);
        for (j, &q) in b[2..].iter().enumerate() {
            lo[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
            hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Q4_0 reference quantizer: `d = max / −8` where `max` is the (first) weight of largest
/// magnitude, so that weight maps exactly to nibble 0; `q = min(15, trunc(x/d + 8.5))`.
pub fn quantize_row_q4_0(x: &[f32], out: &mut [u8]) {
    check(x.len(), QK4_0, out.len(), Q4_0_BYTES, "Q4_0");
    for (x, b) in x.chunks_exact(QK4_0).zip(out.chunks_exact_mut(Q4_0_BYTES)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&f16_bytes(d));
        for j in 0..QK4_0 / 2 {
            // The sum lies in [0.5, 16.5] for finite input; truncation toward zero is C's
            // float-to-int conversion.
            let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let q1 = ((x[j + QK4_0 / 2] * id + 8.5) as i8).min(15) as u8;
            b[2 + j] = q0 | (q1 << 4);
        }
    }
}

// ------------------------------------------------------------------------------------
// Q4_K

/// Scale and min (6 bits each) of sub-block `j` (0..8) from Q4_K's 12 packed bytes:
/// bytes 0–3 hold scales 0–3 in their low 6 bits, bytes 4–7 mins 0–3; sub-blocks 4–7 keep
/// their low 4 bits in bytes 8–11 (scale low, min high) and their top 2 bits in the top
/// bits of bytes 0–3 (scales) and 4–7 (mins).
#[inline]
pub fn q4_k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q4_K: 8 sub-blocks of 32; sub-block `j` is `d·scale_j · nibble − dmin·min_j`. The 128
/// nibble bytes come in 4 groups of 32: group `g` holds sub-block `2g` in its low nibbles
/// and `2g + 1` in its high nibbles.
pub fn dequantize_row_q4_k(bytes: &[u8], out: &mut [f32]) {
    check(out.len(), QK_K, bytes.len(), Q4_K_BYTES, "Q4_K");
    for (b, y) in bytes.chunks_exact(Q4_K_BYTES).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let min = f16_at(b, 2);
        let scales = &b[4..4 + K_SCALE_SIZE];
        let qs = &b[4 + K_SCALE_SIZE..];
        for (g, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
            let (sc, m) = q4_k_scale_min(2 * g, scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = q4_k_scale_min(2 * g + 1, scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            let (lo, hi) = y.split_at_mut(32);
            for l in 0..32 {
                lo[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                hi[l] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// Lanes of [`make_qkx2_quants`]: the sub-blocks of 32 of [`SEARCH_BLOCKS`] super-blocks.
const Q4K_LANES: usize = SEARCH_BLOCKS * QK_K / 32;

/// Values of [`make_qkx2_quants`]'s lanes: `[i][s]` is value `i` of sub-block `s`.
type Q4kLanes = [[f32; Q4K_LANES]; 32];

/// GGML's `make_qkx2_quants`, for the first `n` lanes (sub-blocks of 32) of `x`: fits
/// `x ≈ scale·L − min` with `L` in `0..=nmax` by weighted least squares over `nstep + 1`
/// candidate inverse scales, keeping the best. Returns each sub-block's `scale` and `min`
/// (`min >= 0`, subtracted), and writes sub-block `s`'s levels to `l[32·s..32·s + 32]`.
/// See "The k-quant scale searches" above for the layout.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    n: usize,
    x: &Q4kLanes,
    weights: &Q4kLanes,
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> ([f32; Q4K_LANES], [f32; Q4K_LANES]) {
    assert!(n <= Q4K_LANES && l.len() == 32 * n, "make_qkx2_quants: {n} lanes, {} levels", l.len());
    const L: usize = Q4K_LANES;
    let nmaxf = nmax as f32;
    let (mut min, mut max, mut sum_w, mut sum_x) = (x[0], x[0], weights[0], [0f32; L]);
    for s in 0..n {
        sum_x[s] = sum_w[s] * x[0][s];
    }
    for (xi, wi) in x.iter().zip(weights).skip(1) {
        for s in 0..n {
            let v = xi[s];
            min[s] = pick(v < min[s], v, min[s]);
            max[s] = pick(v > max[s], v, max[s]);
            sum_w[s] += wi[s];
            sum_x[s] += wi[s] * v;
        }
    }
    for m in &mut min[..n] {
        *m = pick(*m > 0.0, 0.0, *m);
    }
    // GGML returns at once where `max == min`: levels 0, scale 0, `-min`. Those lanes go
    // through the search too (into numbers never used) and are set at the end.
    let flat_min = min;

    // The levels of the best fit so far are those of inverse scale `best_iscale` applied to
    // `x − best_min`; they are computed once, at the end.
    let (mut scale, mut best_iscale, mut best_min) = ([0f32; L], [0f32; L], min);
    for s in 0..n {
        best_iscale[s] = nmaxf / (max[s] - min[s]);
        scale[s] = 1.0 / best_iscale[s];
    }
    let mut best_error = [0f32; L];
    for (xi, wi) in x.iter().zip(weights) {
        for s in 0..n {
            let lf = nearest_level(best_iscale[s] * (xi[s] - min[s]), 0.0, nmaxf);
            let diff = scale[s] * lf + min[s] - xi[s];
            best_error[s] += wi[s] * (diff * diff);
        }
    }

    let mut levels = [[0f32; L]; 32];
    for is in 0..=nstep {
        let mut iscale = [0f32; L];
        for s in 0..n {
            iscale[s] = (rmin + rdelta * is as f32 + nmaxf) / (max[s] - min[s]);
        }
        // Σw·L, Σw·L², Σw·L·x over the candidate's levels.
        let (mut sum_l, mut sum_l2, mut sum_xl) = ([0f32; L], [0f32; L], [0f32; L]);
        let chunks = x.chunks_exact(SEARCH_UNROLL).zip(weights.chunks_exact(SEARCH_UNROLL));
        for ((xc, wc), lc) in chunks.zip(levels.chunks_exact_mut(SEARCH_UNROLL)) {
            for s in 0..n {
                let (mut sl, mut sl2, mut sxl) = (sum_l[s], sum_l2[s], sum_xl[s]);
                for k in 0..SEARCH_UNROLL {
                    let (v, w) = (xc[k][s], wc[k][s]);
                    let lf = nearest_level(iscale[s] * (v - min[s]), 0.0, nmaxf);
                    lc[k][s] = lf;
                    // GGML's `w*l*l` is `(w*l)*l` and its `w*l*x` is `(w*l)*x`.
                    let wl = w * lf;
                    sl += wl;
                    sl2 += wl * lf;
                    sxl += wl * v;
                }
                (sum_l[s], sum_l2[s], sum_xl[s]) = (sl, sl2, sxl);
            }
        }
        // The candidate's least-squares fit, meaningful only where `det > 0`.
        let (mut det, mut this_scale, mut this_min) = ([0f32; L], [0f32; L], [0f32; L]);
        for s in 0..n {
            det[s] = sum_w[s] * sum_l2[s] - sum_l[s] * sum_l[s];
            let fit_scale = (sum_w[s] * sum_xl[s] - sum_x[s] * sum_l[s]) / det[s];
            let fit_min = (sum_l2[s] * sum_x[s] - sum_l[s] * sum_xl[s]) / det[s];
            // A positive min becomes 0, with the scale fitted again without it.
            this_scale[s] = pick(fit_min > 0.0, sum_xl[s] / sum_l2[s], fit_scale);
            this_min[s] = pick(fit_min > 0.0, 0.0, fit_min);
        }
        let mut error = [0f32; L];
        let chunks = x.chunks_exact(SEARCH_UNROLL).zip(weights.chunks_exact(SEARCH_UNROLL));
        for ((xc, wc), lc) in chunks.zip(levels.chunks_exact(SEARCH_UNROLL)) {
            for s in 0..n {
                let mut e = error[s];
                for k in 0..SEARCH_UNROLL {
                    let diff = this_scale[s] * lc[k][s] + this_min[s] - xc[k][s];
                    e += wc[k][s] * (diff * diff);
                }
                error[s] = e;
            }
        }
        for s in 0..n {
            // Only a strictly smaller error wins: of equal ones the earlier candidate stays.
            let better = (det[s] > 0.0) & (error[s] < best_error[s]);
            best_error[s] = pick(better, error[s], best_error[s]);
            scale[s] = pick(better, this_scale[s], scale[s]);
            best_iscale[s] = pick(better, iscale[s], best_iscale[s]);
            best_min[s] = pick(better, min[s], best_min[s]);
            // The min every later candidate of this sub-block starts from.
            min[s] = pick(better, this_min[s], min[s]);
        }
    }

    let mut min_out = [0f32; L];
    for (s, l) in l.chunks_exact_mut(32).enumerate() {
        if max[s] == flat_min[s] {
            l.fill(0);
            (scale[s], min_out[s]) = (0.0, -flat_min[s]);
            continue;
        }
        for (i, l) in l.iter_mut().enumerate() {
            *l = nearest_int(best_iscale[s] * (x[i][s] - best_min[s])).clamp(0, nmax) as u8;
        }
        min_out[s] = -min[s];
    }
    (scale, min_out)
}

/// Q4_K reference quantizer (`quantize_row_q4_K_ref`): each sub-block of 32 is fitted with
/// [`make_qkx2_quants`] (weights `rms + |x|`), the 8 scales and 8 mins are quantized to 6
/// bits against the largest of each, and the nibbles are then recomputed against the
/// rounded scales.
pub fn quantize_row_q4_k(x: &[f32], out: &mut [u8]) {
    check(x.len(), QK_K, out.len(), Q4_K_BYTES, "Q4_K");
    let mut xt = [[0f32; Q4K_LANES]; 32];
    let mut weights = [[0f32; Q4K_LANES]; 32];
    let mut levels = [0u8; SEARCH_BLOCKS * QK_K];
    for (x, out) in x.chunks(SEARCH_BLOCKS * QK_K).zip(out.chunks_mut(SEARCH_BLOCKS * Q4_K_BYTES)) {
        // Up to SEARCH_BLOCKS super-blocks' sub-blocks, as lanes, with GGML's weights.
        let n = x.len() / 32;
        for (s, xs) in x.chunks_exact(32).enumerate() {
            let mut sum_x2 = 0f32;
            for &v in xs {
                sum_x2 += v * v;
            }
            let av_x = (sum_x2 / 32.0).sqrt();
            for (i, &v) in xs.iter().enumerate() {
                xt[i][s] = v;
                weights[i][s] = av_x + v.abs();
            }
        }
        let all_levels = &mut levels[..32 * n];
        let (all_scales, all_mins) = make_qkx2_quants(15, n, &xt, &weights, all_levels, -1.0, 0.1, 20);

        let blocks = x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q4_K_BYTES));
        for (b, (x, y)) in blocks.enumerate() {
            let scales = &all_scales[8 * b..8 * b + 8];
            let mins = &all_mins[8 * b..8 * b + 8];
            let l = &mut all_levels[QK_K * b..QK_K * b + QK_K];
            let mut max_scale = 0f32;
            let mut max_min = 0f32;
            for j in 0..QK_K / 32 {
                if scales[j] > max_scale {
                    max_scale = scales[j];
                }
                if mins[j] > max_min {
                    max_min = mins[j];
                }
            }

            let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
            let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
            let packed = &mut y[4..4 + K_SCALE_SIZE];
            packed.fill(0);
            for j in 0..QK_K / 32 {
                // GGML stores nearest_int's result in a uint8_t before clamping: wrap, then clamp.
                let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
                let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
                if j < 4 {
                    packed[j] = ls;
                    packed[j + 4] = lm;
                } else {
                    packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
                    packed[j - 4] |= (ls >> 4) << 6;
                    packed[j] |= (lm >> 4) << 6;
                }
            }
            let d_bytes = f16_bytes(max_scale / 63.0);
            let dmin_bytes = f16_bytes(max_min / 63.0);
            y[0..2].copy_from_slice(&d_bytes);
            y[2..4].copy_from_slice(&dmin_bytes);
            let d_all = f16::from_le_bytes(d_bytes).to_f32();
            let dmin_all = f16::from_le_bytes(dmin_bytes).to_f32();

            for j in 0..QK_K / 32 {
                let (sc, m) = q4_k_scale_min(j, &y[4..4 + K_SCALE_SIZE]);
                let d = d_all * sc as f32;
                if d == 0.0 {
                    // GGML keeps the levels from the fit for a zero scale; they dequantize to
                    // −min either way.
                    continue;
                }
                let dm = dmin_all * m as f32;
                for ii in 0..32 {
                    l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, 15) as u8;
                }
            }

            let qs = &mut y[4 + K_SCALE_SIZE..];
            for (g, q) in qs.chunks_exact_mut(32).enumerate() {
                for (i, q) in q.iter_mut().enumerate() {
                    *q = l[64 * g + i] | (l[64 * g + i + 32] << 4);
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------
// Q6_K

/// Q6_K: 16 sub-blocks of 16, `x = d · scale_s · (q − 32)` with 6-bit `q`. Each half
/// (128 weights) uses 64 bytes of `ql` and 32 of `qh`: for `l` in 0..32, weight `l` is
/// `ql[l]` low nibble, `l+32` is `ql[l+32]` low, `l+64` is `ql[l]` high, `l+96` is
/// `ql[l+32]` high, with the top two bits in bits 0–1, 2–3, 4–5, 6–7 of `qh[l]`.
pub fn dequantize_row_q6_k(bytes: &[u8], out: &mut [f32]) {
    check(out.len(), QK_K, bytes.len(), Q6_K_BYTES, "Q6_K");
    for (b, y) in bytes.chunks_exact(Q6_K_BYTES).zip(out.chunks_exact_mut(QK_K)) {
        let (ql_all, rest) = b.split_at(QK_K / 2);
        let (qh_all, rest) = rest.split_at(QK_K / 4);
        let (sc_all, d) = rest.split_at(QK_K / 16);
        let d = f16_at(d, 0);
        for half in 0..2 {
            let ql = &ql_all[64 * half..64 * half + 64];
            let qh = &qh_all[32 * half..32 * half + 32];
            let sc = &sc_all[8 * half..8 * half + 8];
            let y = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as i8 as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
            }
        }
    }
}

/// Lanes of [`make_qx_quants`]: the sub-blocks of 16 of [`SEARCH_BLOCKS`] super-blocks.
const Q6K_LANES: usize = SEARCH_BLOCKS * QK_K / 16;

/// Values of [`make_qx_quants`]'s lanes: `[i][s]` is value `i` of sub-block `s`.
type Q6kLanes = [[f32; Q6K_LANES]; 16];

/// GGML's `make_qx_quants` with `rmse_type = 1` and no importance weights (the only form
/// the Q6_K reference uses), for the first `n` lanes (sub-blocks of 16) of `x`: symmetric
/// levels `l` in `−nmax..nmax`, weights `x²`, the scale refined over 18 nearby inverse
/// scales. Returns each sub-block's scale and writes sub-block `s`'s `l + nmax` to
/// `l_out[16·s..16·s + 16]`. See "The k-quant scale searches" above for the layout.
fn make_qx_quants(nmax: i32, n: usize, x: &Q6kLanes, l_out: &mut [i8]) -> [f32; Q6K_LANES] {
    assert!(n <= Q6K_LANES && l_out.len() == 16 * n, "make_qx_quants: {n} lanes, {} levels", l_out.len());
    const L: usize = Q6K_LANES;
    let (lo, hi) = (-nmax as f32, (nmax - 1) as f32);
    let nmaxf = nmax as f32;
    // GGML's weights `w = x²`, and `w·x`: its `w*x*l` is `(w*x)*l`.
    let (mut w, mut wx) = ([[0f32; L]; 16], [[0f32; L]; 16]);
    let (mut max, mut amax) = ([0f32; L], [0f32; L]);
    for i in 0..16 {
        for s in 0..n {
            let v = x[i][s];
            let bigger = v.abs() > amax[s];
            amax[s] = pick(bigger, v.abs(), amax[s]);
            max[s] = pick(bigger, v, max[s]);
            w[i][s] = v * v;
            wx[i][s] = w[i][s] * v;
        }
    }

    // Σw·x·L and Σw·L² over the levels of inverse scales `iscale`.
    let sums = |iscale: &[f32; L]| {
        let (mut sumlx, mut suml2) = ([0f32; L], [0f32; L]);
        let chunks = x.chunks_exact(SEARCH_UNROLL).zip(w.chunks_exact(SEARCH_UNROLL));
        for ((xc, wc), wxc) in chunks.zip(wx.chunks_exact(SEARCH_UNROLL)) {
            for s in 0..n {
                let (mut slx, mut sl2) = (sumlx[s], suml2[s]);
                for k in 0..SEARCH_UNROLL {
                    let lf = nearest_level(iscale[s] * xc[k][s], lo, hi);
                    slx += wxc[k][s] * lf;
                    sl2 += wc[k][s] * lf * lf;
                }
                (sumlx[s], suml2[s]) = (slx, sl2);
            }
        }
        (sumlx, suml2)
    };

    // The levels of the best fit so far are those of inverse scale `best_iscale`; they are
    // computed once, at the end.
    let mut best_iscale = [0f32; L];
    for s in 0..n {
        best_iscale[s] = -nmaxf / max[s];
    }
    let (sumlx, suml2) = sums(&best_iscale);
    let (mut scale, mut best) = ([0f32; L], [0f32; L]);
    for s in 0..n {
        scale[s] = pick(suml2[s] != 0.0, sumlx[s] / suml2[s], 0.0);
        best[s] = scale[s] * sumlx[s];
    }
    for is in (-9..=9).filter(|&is| is != 0) {
        let mut iscale = [0f32; L];
        for s in 0..n {
            iscale[s] = -(nmaxf + 0.1 * is as f32) / max[s];
        }
        let (sumlx, suml2) = sums(&iscale);
        for s in 0..n {
            // GGML's test: a candidate must beat the best so far, so ties keep the earlier one.
            let better = (suml2[s] > 0.0) & (sumlx[s] * sumlx[s] > best[s] * suml2[s]);
            let this_scale = sumlx[s] / suml2[s];
            scale[s] = pick(better, this_scale, scale[s]);
            best[s] = pick(better, this_scale * sumlx[s], best[s]);
            best_iscale[s] = pick(better, iscale[s], best_iscale[s]);
        }
    }

    for (s, l) in l_out.chunks_exact_mut(16).enumerate() {
        // GGML returns at once for these, with levels 0 and scale 0; they went through the
        // search too (into numbers never used).
        if amax[s] < GROUP_MAX_EPS {
            l.fill(0);
            scale[s] = 0.0;
            continue;
        }
        for (i, l) in l.iter_mut().enumerate() {
            *l = (nmax + nearest_int(best_iscale[s] * x[i][s]).clamp(-nmax, nmax - 1)) as i8;
        }
    }
    scale
}

/// Q6_K reference quantizer (`quantize_row_q6_K_ref`): each sub-block of 16 is fitted with
/// [`make_qx_quants`], the 16 scales are quantized to i8 against the one of largest
/// magnitude (mapped to −128), and the levels recomputed against the rounded scales.
pub fn quantize_row_q6_k(x: &[f32], out: &mut [u8]) {
    check(x.len(), QK_K, out.len(), Q6_K_BYTES, "Q6_K");
    let mut xt = [[0f32; Q6K_LANES]; 16];
    let mut levels = [0i8; SEARCH_BLOCKS * QK_K];
    for (x, out) in x.chunks(SEARCH_BLOCKS * QK_K).zip(out.chunks_mut(SEARCH_BLOCKS * Q6_K_BYTES)) {
        // Up to SEARCH_BLOCKS super-blocks' sub-blocks, as lanes.
        let n = x.len() / 16;
        for (s, xs) in x.chunks_exact(16).enumerate() {
            for (i, &v) in xs.iter().enumerate() {
                xt[i][s] = v;
            }
        }
        let all_levels = &mut levels[..16 * n];
        let all_scales = make_qx_quants(32, n, &xt, all_levels);

        let blocks = x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q6_K_BYTES));
        for (b, (x, y)) in blocks.enumerate() {
            let scales = &all_scales[16 * b..16 * b + 16];
            let l = &mut all_levels[QK_K * b..QK_K * b + QK_K];
            let mut max_scale = 0f32;
            let mut max_abs_scale = 0f32;
            for &scale in scales {
                if scale.abs() > max_abs_scale {
                    max_abs_scale = scale.abs();
                    max_scale = scale;
                }
            }

            if max_abs_scale < GROUP_MAX_EPS {
                y.fill(0);
                continue;
            }

            let (ql_all, rest) = y.split_at_mut(QK_K / 2);
            let (qh_all, rest) = rest.split_at_mut(QK_K / 4);
            let (sc_all, d_out) = rest.split_at_mut(QK_K / 16);

            let iscale = -128.0 / max_scale;
            let d_bytes = f16_bytes(1.0 / iscale);
            d_out.copy_from_slice(&d_bytes);
            let d_all = f16::from_le_bytes(d_bytes).to_f32();
            for ib in 0..QK_K / 16 {
                sc_all[ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
            }

            for j in 0..QK_K / 16 {
                let d = d_all * sc_all[j] as i8 as f32;
                if d == 0.0 {
                    continue;
                }
                for ii in 0..16 {
                    let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                    l[16 * j + ii] = (q + 32) as i8;
                }
            }

            for half in 0..2 {
                let ql = &mut ql_all[64 * half..64 * half + 64];
                let qh = &mut qh_all[32 * half..32 * half + 32];
                let l = &l[128 * half..128 * half + 128];
                for i in 0..32 {
                    let (l1, l2, l3, l4) = (l[i] as u8, l[i + 32] as u8, l[i + 64] as u8, l[i + 96] as u8);
                    ql[i] = (l1 & 0x0f) | ((l3 & 0x0f) << 4);
                    ql[i + 32] = (l2 & 0x0f) | ((l4 & 0x0f) << 4);
                    qh[i] = (l1 >> 4) | ((l2 >> 4) << 2) | ((l3 >> 4) << 4) | ((l4 >> 4) << 6);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-0.5), 0);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-2.7), -3);
        assert_eq!(nearest_int(4_194_303.0), 4_194_303);
    }

    #[test]
    fn layout_constants() {
        assert_eq!((Q8_0_BYTES, Q4_0_BYTES, Q4_K_BYTES, Q6_K_BYTES), (34, 18, 144, 210));
    }

    #[test]
    fn q4_0_nibble_order() {
        // Weight j in the low nibble of byte j, weight j+16 in its high nibble.
        let mut b = [0u8; Q4_0_BYTES];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = 0x9f; // weight 0 → 15, weight 16 → 9
        let mut y = [0f32; 32];
        dequantize_row_q4_0(&b, &mut y);
        assert_eq!(y[0], 3.5);
        assert_eq!(y[16], 0.5);
        assert_eq!(y[1], -4.0);
    }

    #[test]
    fn q4_k_scale_packing_round_trips() {
        let ls = [1u8, 63, 17, 32, 48, 5, 60, 33];
        let lm = [62u8, 0, 40, 9, 16, 31, 47, 63];
        let mut p = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                p[j] = ls[j];
                p[j + 4] = lm[j];
            } else {
                p[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
                p[j - 4] |= (ls[j] >> 4) << 6;
                p[j] |= (lm[j] >> 4) << 6;
            }
        }
        for j in 0..8 {
            assert_eq!(q4_k_scale_min(j, &p), (ls[j], lm[j]));
        }
    }

    /// Quantizing and dequantizing stays within each format's error bound.
    #[test]
    fn round_trip_error_is_bounded() {
        let mut seed = 7;
        let x: Vec<f32> = (0..4 * QK_K).map(|_| lcg(&mut seed)).collect();
        type Quantize = fn(&[f32], &mut [u8]);
        type Dequantize = fn(&[u8], &mut [f32]);
        let cases: [(Quantize, Dequantize, usize, usize, f32); 4] = [
            (quantize_row_q8_0, dequantize_row_q8_0, QK8_0, Q8_0_BYTES, 0.006),
            (quantize_row_q4_0, dequantize_row_q4_0, QK4_0, Q4_0_BYTES, 0.13),
            (quantize_row_q4_k, dequantize_row_q4_k, QK_K, Q4_K_BYTES, 0.1),
            (quantize_row_q6_k, dequantize_row_q6_k, QK_K, Q6_K_BYTES, 0.02),
        ];
        for (q, dq, block, bytes, tol) in cases {
            let mut packed = vec![0u8; x.len() / block * bytes];
            q(&x, &mut packed);
            let mut y = vec![0f32; x.len()];
            dq(&packed, &mut y);
            let err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "block {block}/{bytes}: max error {err}");
        }
    }

    #[test]
    fn zero_blocks_encode_to_zero_scales() {
        let x = [0f32; QK_K];
        let mut y = [1f32; QK_K];
        let mut q = [0xffu8; Q6_K_BYTES];
        quantize_row_q6_k(&x, &mut q);
        assert!(q.iter().all(|&b| b == 0));
        dequantize_row_q6_k(&q, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
        let mut q = [0xffu8; Q4_K_BYTES];
        quantize_row_q4_k(&x, &mut q);
        dequantize_row_q4_k(&q, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
    }

    /// Many generated blocks against GGML's reference quantizers, as checksums of the bytes.
    /// `scripts/ggml_kquant_checksums.c` generates the same blocks (the same LCG, the same
    /// f32 operations in the same order) and prints the checksums GGML's
    /// `quantize_row_q4_K_ref` / `quantize_row_q6_K_ref` give; the fixture vectors in
    /// tests/quant.rs hold only a few blocks, too few to notice a change in the float order
    /// or the tie-breaking of the scale searches (both were tried: only this test failed).
    /// Shapes: uniform, peaked (u³), mostly positive, lopsided, on a grid of eighths (ties
    /// between the searches' candidates, rounding ties), constant; magnitudes 2^-20 to 2^12,
    /// some sub-blocks zero, some weights 16× outliers.
    #[test]
    fn k_quant_checksums_match_ggml() {
        const BLOCKS: usize = 2048;
        let mut state = 0x5eedu64;
        let mut next_u64 = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            state
        };
        // Uniform in [-1, 1) from a draw: 24 random bits, every step exact.
        let uniform = |r: u64| (r >> 40) as f32 / 16777216.0 * 2.0 - 1.0;
        let mut x = vec![0f32; BLOCKS * QK_K];
        for (b, block) in x.chunks_exact_mut(QK_K).enumerate() {
            let e = (next_u64() >> 59) as i32 - 20;
            let mag = (1.5 + 0.5 * uniform(next_u64())) * f32::from_bits(((127 + e) as u32) << 23);
            for sub_block in block.chunks_exact_mut(16) {
                let coin = uniform(next_u64());
                let spread = 1.0 + 0.75 * uniform(next_u64());
                let sub = if coin < -0.875 { 0.0 } else { spread };
                for v_out in sub_block {
                    let u = uniform(next_u64());
                    let mut v = match b % 6 {
                        0 => u,
                        1 => u * u * u,
                        2 => u + 0.75,
                        3 => u * u - 0.25,
                        4 => (next_u64() >> 60) as f32 * 0.125 - 1.0,
                        _ => 0.5,
                    };
                    if next_u64() >> 58 == 0 {
                        v *= 16.0;
                    }
                    *v_out = v * sub * mag;
                }
            }
        }
        let fnv1a = |bytes: &[u8]| {
            bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
        };
        // In rows of 1 to 7 super-blocks, so that the searches also run on part-filled
        // batches of lanes (blocks are independent: the bytes are those of one pass).
        let (mut q4, mut q6) = (vec![0u8; BLOCKS * Q4_K_BYTES], vec![0u8; BLOCKS * Q6_K_BYTES]);
        let (mut at, mut row) = (0, 1);
        while at < BLOCKS {
            let nb = row.min(BLOCKS - at);
            let x = &x[at * QK_K..(at + nb) * QK_K];
            quantize_row_q4_k(x, &mut q4[at * Q4_K_BYTES..(at + nb) * Q4_K_BYTES]);
            quantize_row_q6_k(x, &mut q6[at * Q6_K_BYTES..(at + nb) * Q6_K_BYTES]);
            (at, row) = (at + nb, row % 7 + 1);
        }
        let got = (format!("Q4_K {:#018x}", fnv1a(&q4)), format!("Q6_K {:#018x}", fnv1a(&q6)));
        assert_eq!(got, ("Q4_K 0x8f66fdb26b4b4eb9".into(), "Q6_K 0xebfc66888abfe83f".into()));
    }

    #[test]
    #[should_panic(expected = "whole number")]
    fn partial_block_panics() {
        dequantize_row_q8_0(&[0; 34], &mut [0f32; 31]);
    }
}
