//! GGML tensor types and the block formats strix reads and writes.
//!
//! [`QuantType`] names every type a GGUF file can declare (so that a reader can size and
//! bounds-check any tensor, even one it cannot decode), and [`blocks`] holds the bit-exact
//! layouts of the types strix computes with: Q8_0, Q4_0, Q4_K and Q6_K, plus the plain
//! F32/F16/BF16. [`dequantize_row`] and [`quantize_row`] dispatch on the type.

pub mod blocks;
pub mod on_load;

use crate::error::{Error, Result};

pub use blocks::{QK4_0, QK8_0, QK_K};

/// A GGML tensor type, numbered as in `ggml.h` and GGUF files.
///
/// The names keep GGML's spelling (`Q4_K`, `IQ2_XXS`) so that they read the same as in
/// llama.cpp's logs and file listings.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// (type, GGML id, name, weights per block, bytes per block), from `ggml.c`'s type traits.
const TYPES: [(QuantType, u32, &str, usize, usize); 34] = {
    use QuantType::*;
    [
        (F32, 0, "F32", 1, 4),
        (F16, 1, "F16", 1, 2),
        (Q4_0, 2, "Q4_0", 32, 18),
        (Q4_1, 3, "Q4_1", 32, 20),
        (Q5_0, 6, "Q5_0", 32, 22),
        (Q5_1, 7, "Q5_1", 32, 24),
        (Q8_0, 8, "Q8_0", 32, 34),
        (Q8_1, 9, "Q8_1", 32, 40),
        (Q2_K, 10, "Q2_K", 256, 84),
        (Q3_K, 11, "Q3_K", 256, 110),
        (Q4_K, 12, "Q4_K", 256, 144),
        (Q5_K, 13, "Q5_K", 256, 176),
        (Q6_K, 14, "Q6_K", 256, 210),
        (Q8_K, 15, "Q8_K", 256, 292),
        (IQ2_XXS, 16, "IQ2_XXS", 256, 66),
        (IQ2_XS, 17, "IQ2_XS", 256, 74),
        (IQ3_XXS, 18, "IQ3_XXS", 256, 98),
        (IQ1_S, 19, "IQ1_S", 256, 50),
        (IQ4_NL, 20, "IQ4_NL", 32, 18),
        (IQ3_S, 21, "IQ3_S", 256, 110),
        (IQ2_S, 22, "IQ2_S", 256, 82),
        (IQ4_XS, 23, "IQ4_XS", 256, 136),
        (I8, 24, "I8", 1, 1),
        (I16, 25, "I16", 1, 2),
        (I32, 26, "I32", 1, 4),
        (I64, 27, "I64", 1, 8),
        (F64, 28, "F64", 1, 8),
        (IQ1_M, 29, "IQ1_M", 256, 56),
        (BF16, 30, "BF16", 1, 2),
        (TQ1_0, 34, "TQ1_0", 256, 54),
        (TQ2_0, 35, "TQ2_0", 256, 66),
        (MXFP4, 39, "MXFP4", 32, 17),
        (NVFP4, 40, "NVFP4", 64, 36),
        (Q1_0, 41, "Q1_0", 128, 18),
    ]
};

impl QuantType {
    /// Every type, in GGML id order.
    pub fn all() -> impl Iterator<Item = QuantType> {
        TYPES.iter().map(|t| t.0)
    }

    /// The type with this GGML id; `None` for ids GGML never assigned or has retired
    /// (4, 5, 31–33, 36–38).
    pub fn from_id(id: u32) -> Option<QuantType> {
        TYPES.iter().find(|t| t.1 == id).map(|t| t.0)
    }

    /// The type with this GGML name (`"Q4_K"`), ASCII case-insensitive (`"q4_k"`).
    pub fn from_name(name: &str) -> Option<QuantType> {
        TYPES.iter().find(|t| t.2.eq_ignore_ascii_case(name)).map(|t| t.0)
    }

    fn traits(self) -> &'static (QuantType, u32, &'static str, usize, usize) {
        // The table holds every variant, in declaration order.
        &TYPES[self as usize]
    }

    pub fn id(self) -> u32 {
        self.traits().1
    }

    pub fn name(self) -> &'static str {
        self.traits().2
    }

    /// Weights per block (1 for the plain float and integer types).
    pub fn block_size(self) -> usize {
        self.traits().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.traits().4
    }

    /// Whether [`dequantize_row`] can decode this type.
    pub fn can_dequantize(self) -> bool {
        use QuantType::*;
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_K | Q6_K)
    }

    /// Whether [`quantize_row`] can encode this type.
    pub fn can_quantize(self) -> bool {
        self.can_dequantize()
    }

    /// Bytes of a row of `n` weights. Blocks never straddle rows, so `n` must be a
    /// multiple of the block size.
    pub fn row_size(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(Error::input(format!(
                "a row of {n} weights is not a whole number of {} blocks ({} weights each)",
                self.name(),
                self.block_size()
            )));
        }
        (n / self.block_size())
            .checked_mul(self.type_size())
            .ok_or_else(|| Error::input(format!("a {} row of {n} weights overflows usize", self.name())))
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn check_lengths(ty: QuantType, n: usize, bytes: usize) -> Result<()> {
    let want = ty.row_size(n)?;
    if bytes != want {
        return Err(Error::input(format!("{n} {ty} weights take {want} bytes, not {bytes}")));
    }
    Ok(())
}

/// Decodes `bytes` (whole blocks of `ty`) into `out`, one weight per element.
///
/// Works on any number of consecutive rows as long as each row is whole blocks; the
/// lengths must agree (`bytes.len() == ty.row_size(out.len())`).
pub fn dequantize_row(ty: QuantType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_lengths(ty, out.len(), bytes.len())?;
    match ty {
        QuantType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        QuantType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        QuantType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        QuantType::Q8_0 => blocks::dequantize_row_q8_0(bytes, out),
        QuantType::Q4_0 => blocks::dequantize_row_q4_0(bytes, out),
        QuantType::Q4_K => blocks::dequantize_row_q4_k(bytes, out),
        QuantType::Q6_K => blocks::dequantize_row_q6_k(bytes, out),
        _ => return Err(Error::input(format!("dequantizing {ty} is not supported"))),
    }
    Ok(())
}

/// Encodes `x` into `out` as `ty` with GGML's reference (round-to-nearest, no importance
/// matrix) quantizer; the lengths must agree (`out.len() == ty.row_size(x.len())`).
pub fn quantize_row(ty: QuantType, x: &[f32], out: &mut [u8]) -> Result<()> {
    check_lengths(ty, x.len(), out.len())?;
    match ty {
        QuantType::F32 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        QuantType::F16 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        QuantType::BF16 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        QuantType::Q8_0 => blocks::quantize_row_q8_0(x, out),
        QuantType::Q4_0 => blocks::quantize_row_q4_0(x, out),
        QuantType::Q4_K => blocks::quantize_row_q4_k(x, out),
        QuantType::Q6_K => blocks::quantize_row_q6_k(x, out),
        _ => return Err(Error::input(format!("quantizing to {ty} is not supported"))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_declaration_order_and_ids_are_unique() {
        for (i, t) in TYPES.iter().enumerate() {
            assert_eq!(t.0 as usize, i, "{}", t.2);
            assert_eq!(QuantType::from_id(t.1), Some(t.0));
            assert_eq!(QuantType::from_name(t.2), Some(t.0));
        }
        assert_eq!(QuantType::from_id(4), None);
        assert_eq!(QuantType::from_id(31), None);
        assert_eq!(QuantType::from_id(1000), None);
        assert_eq!(QuantType::from_name("q4_k"), Some(QuantType::Q4_K));
    }

    #[test]
    fn block_sizes_match_the_block_layouts() {
        assert_eq!((QuantType::Q8_0.block_size(), QuantType::Q8_0.type_size()), (32, 34));
        assert_eq!((QuantType::Q4_0.block_size(), QuantType::Q4_0.type_size()), (32, 18));
        assert_eq!((QuantType::Q4_K.block_size(), QuantType::Q4_K.type_size()), (256, 144));
        assert_eq!((QuantType::Q6_K.block_size(), QuantType::Q6_K.type_size()), (256, 210));
        assert_eq!(QuantType::Q4_K.type_size(), 2 + 2 + 12 + 128);
        assert_eq!(QuantType::Q6_K.type_size(), 128 + 64 + 16 + 2);
    }

    #[test]
    fn row_size_checks_divisibility() {
        assert_eq!(QuantType::Q4_K.row_size(512).unwrap(), 288);
        assert_eq!(QuantType::BF16.row_size(7).unwrap(), 14);
        assert_eq!(QuantType::Q8_0.row_size(0).unwrap(), 0);
        let err = QuantType::Q4_K.row_size(300).unwrap_err().to_string();
        assert!(err.contains("300") && err.contains("Q4_K"), "{err}");
        assert!(QuantType::Q8_0.row_size(usize::MAX - 31).is_err());
    }

    #[test]
    fn dispatch_rejects_unsupported_types_and_bad_lengths() {
        let mut out = [0f32; 32];
        assert!(dequantize_row(QuantType::Q5_K, &[0; 22], &mut out).is_err());
        assert!(dequantize_row(QuantType::Q8_0, &[0; 33], &mut out).is_err());
        assert!(quantize_row(QuantType::Q8_0, &out, &mut [0; 35]).is_err());
        dequantize_row(QuantType::Q8_0, &[0; 34], &mut out).unwrap();
    }

    #[test]
    fn float_types_round_trip() {
        let x = [1.0f32, -2.5, 3.0e-3, 65504.0];
        for ty in [QuantType::F32, QuantType::F16, QuantType::BF16] {
            let mut bytes = vec![0u8; ty.row_size(4).unwrap()];
            quantize_row(ty, &x, &mut bytes).unwrap();
            let mut back = [0f32; 4];
            dequantize_row(ty, &bytes, &mut back).unwrap();
            for (a, b) in x.iter().zip(back) {
                assert!((a - b).abs() <= a.abs() * 4e-3, "{ty}: {a} vs {b}");
            }
        }
    }
}
