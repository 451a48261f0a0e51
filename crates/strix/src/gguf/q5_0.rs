//! GGML's Q5_0 block (32 weights: f16 scale, 32 high bits, 16 bytes of low nibbles = 22
//! bytes), bit-exact with `ggml-quants.c`.
//!
//! strix has no kernels for Q5_0. It is here because llama-quantize writes it into Q4_K_M
//! files for matrices whose rows are not whole 256-weight super-blocks (its fallback for
//! Q4_K), and `strix quantize` falls back the same way: the loader decodes such matrices
//! to f32 ([`crate::gguf::qwen35`]), which is exact.

use crate::quant::QuantType;

pub const QK5_0: usize = 32;
pub const Q5_0_BYTES: usize = 22;

fn lengths_ok(n: usize, bytes: usize) -> bool {
    n.is_multiple_of(QK5_0) && bytes == n / QK5_0 * Q5_0_BYTES
}

/// `x = (q − 16) · d`, `q` the nibble of byte `j` (low for weight `j`, high for `j + 16`)
/// with bit `j` (or `j + 16`) of `qh` as its fifth bit. `out.len()` weights from whole blocks.
pub fn dequantize_row_q5_0(bytes: &[u8], out: &mut [f32]) -> crate::Result<()> {
    if !lengths_ok(out.len(), bytes.len()) {
        return Err(crate::Error::input(format!(
            "{} Q5_0 weights do not take {} bytes",
            out.len(),
            bytes.len()
        )));
    }
    for (b, y) in bytes.chunks_exact(Q5_0_BYTES).zip(out.chunks_exact_mut(QK5_0)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..];
        for j in 0..QK5_0 / 2 {
            let xh0 = ((qh >> j) << 4) & 0x10;
            let xh1 = (qh >> (j + 12)) & 0x10;
            let x0 = ((qs[j] as u32 & 0x0F) | xh0) as i32 - 16;
            let x1 = ((qs[j] as u32 >> 4) | xh1) as i32 - 16;
            y[j] = x0 as f32 * d;
            y[j + QK5_0 / 2] = x1 as f32 * d;
        }
    }
    Ok(())
}

/// GGML's reference quantizer (`quantize_row_q5_0_ref`): `d = max / −16` where `max` is the
/// weight of largest magnitude, `q = min(31, trunc(x / d + 16.5))`.
pub fn quantize_row_q5_0(x: &[f32], out: &mut [u8]) -> crate::Result<()> {
    if !lengths_ok(x.len(), out.len()) {
        return Err(crate::Error::input(format!("{} Q5_0 weights do not take {} bytes", x.len(), out.len())));
    }
    for (x, b) in x.chunks_exact(QK5_0).zip(out.chunks_exact_mut(Q5_0_BYTES)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        let mut qh = 0u32;
        for j in 0..QK5_0 / 2 {
            let x0 = x[j] * id;
            let x1 = x[QK5_0 / 2 + j] * id;
            // C's `(int8_t)(x + 16.5f)` truncates toward zero, then MIN(31, ..).
            let xi0 = ((x0 + 16.5) as i8).min(31) as u8;
            let xi1 = ((x1 + 16.5) as i8).min(31) as u8;
            b[6 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + QK5_0 / 2);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
    Ok(())
}

/// Whether `ty` is a type this module (not [`crate::quant`]) decodes.
pub fn handles(ty: QuantType) -> bool {
    ty == QuantType::Q5_0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_type_table() {
        assert_eq!(QuantType::Q5_0.block_size(), QK5_0);
        assert_eq!(QuantType::Q5_0.type_size(), Q5_0_BYTES);
    }

    #[test]
    fn hand_made_block_decodes() {
        // d = 0.5; weight j gets q = j (so x = (j - 16) / 2), weight j + 16 gets q = 31 - j.
        let mut b = [0u8; Q5_0_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        let mut qh = 0u32;
        for j in 0..16u32 {
            let (q0, q1) = (j, 31 - j);
            b[6 + j as usize] = (q0 as u8 & 0x0F) | ((q1 as u8 & 0x0F) << 4);
            qh |= ((q0 >> 4) & 1) << j;
            qh |= ((q1 >> 4) & 1) << (j + 16);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
        let mut y = [0f32; 32];
        dequantize_row_q5_0(&b, &mut y).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 16.0) * 0.5);
            assert_eq!(y[j + 16], (15.0 - j as f32) * 0.5);
        }
    }

    /// The bytes the `gguf` package (llama.cpp's gguf-py, a numpy port of
    /// `quantize_row_q5_0_ref`) makes of these 96 values, and the round trip within a step (a
    /// half step, except at the clamped end of the range opposite the largest weight).
    #[test]
    fn quantizer_matches_gguf_py_and_round_trips() {
        let mut s = 12345u32;
        let x: Vec<f32> = (0..96)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect();
        let mut q = vec![0u8; 3 * Q5_0_BYTES];
        quantize_row_q5_0(&x, &mut q).unwrap();
        let want = "e6af63a4c5db3f1f3f1c03bd200e7d27afb8d15e6af1c12f2cdf3a6eff79a27f3099e96aff6216c5c4e58e49\
                    b9aee69840923996f515b50c4f5442f7cfcaf4d214f5";
        let hex: String = q.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want.replace(' ', ""));
        let mut y = vec![0f32; 96];
        dequantize_row_q5_0(&q, &mut y).unwrap();
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = amax / 16.0;
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= step * 1.001, "{a} {b} {step}");
            }
        }
        assert!(dequantize_row_q5_0(&q[..21], &mut y[..32]).is_err());
    }
}
