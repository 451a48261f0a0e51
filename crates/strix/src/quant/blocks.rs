//! The GGML block formats Q8_0, Q4_0, Q4_K and Q6_K, byte for byte, with scalar
//! reference (de)quantizers.
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

/// GGML's `make_qkx2_quants`: fits `x ≈ scale·L − min` with `L` in `0..=nmax` by weighted
/// least squares over `nstep + 1` candidate inverse scales, keeping the best. Returns
/// `(scale, min)` with `min >= 0` subtracted; `l` receives the levels.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let w = weights[i];
            let lf = q as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K reference quantizer (`quantize_row_q4_K_ref`): each sub-block of 32 is fitted with
/// [`make_qkx2_quants`] (weights `rms + |x|`), the 8 scales and 8 mins are quantized to 6
/// bits against the largest of each, and the nibbles are then recomputed against the
/// rounded scales.
pub fn quantize_row_q4_k(x: &[f32], out: &mut [u8]) {
    check(x.len(), QK_K, out.len(), Q4_K_BYTES, "Q4_K");
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut mins = [0f32; QK_K / 32];
    let mut scales = [0f32; QK_K / 32];
    for (x, y) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q4_K_BYTES)) {
        let mut max_scale = 0f32;
        let mut max_min = 0f32;
        for j in 0..QK_K / 32 {
            let xs = &x[32 * j..32 * j + 32];
            let mut sum_x2 = 0f32;
            for &v in xs {
                sum_x2 += v * v;
            }
            let av_x = (sum_x2 / 32.0).sqrt();
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = av_x + v.abs();
            }
            let (scale, min) =
                make_qkx2_quants(15, xs, &weights, &mut l[32 * j..32 * j + 32], &mut laux, -1.0, 0.1, 20);
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
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

/// GGML's `make_qx_quants` with `rmse_type = 1` and no importance weights (the only form
/// the Q6_K reference uses): symmetric levels `l` in `−nmax..nmax`, weights `x²`, the
/// scale refined over 18 nearby inverse scales. Writes `l + nmax` and returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let mut iscale = -nmaxf / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = x[i] * x[i];
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let lf = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
                l_out[i] = (nmax + l) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K reference quantizer (`quantize_row_q6_K_ref`): each sub-block of 16 is fitted with
/// [`make_qx_quants`], the 16 scales are quantized to i8 against the one of largest
/// magnitude (mapped to −128), and the levels recomputed against the rounded scales.
pub fn quantize_row_q6_k(x: &[f32], out: &mut [u8]) {
    check(x.len(), QK_K, out.len(), Q6_K_BYTES, "Q6_K");
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    for (x, y) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q6_K_BYTES)) {
        let mut max_scale = 0f32;
        let mut max_abs_scale = 0f32;
        for ib in 0..QK_K / 16 {
            let scale = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
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

    #[test]
    #[should_panic(expected = "whole number")]
    fn partial_block_panics() {
        dequantize_row_q8_0(&[0; 34], &mut [0f32; 31]);
    }
}
