//! Host-side weight storage: the element types strix reads from checkpoints and a
//! byte store that is either a window of a memory-mapped file or an owned buffer.
//!
//! Weights stay in their checkpoint dtype (bf16 stays bf16); kernels widen to f32
//! in registers. Nothing here copies a mapped tensor unless its bytes are misaligned.

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant::{self, QuantType};

/// Element type of a stored tensor: a plain float, or one of the GGML block formats strix
/// computes with (rows of whole blocks, see [`crate::quant`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_K,
    Q6_K,
}

impl DType {
    /// The GGML type with the same storage.
    pub fn quant_type(self) -> QuantType {
        match self {
            DType::F32 => QuantType::F32,
            DType::F16 => QuantType::F16,
            DType::BF16 => QuantType::BF16,
            DType::Q8_0 => QuantType::Q8_0,
            DType::Q4_0 => QuantType::Q4_0,
            DType::Q4_K => QuantType::Q4_K,
            DType::Q6_K => QuantType::Q6_K,
        }
    }

    /// The dtype storing a GGML type, for the types strix computes with.
    pub fn from_quant_type(ty: QuantType) -> Option<DType> {
        Some(match ty {
            QuantType::F32 => DType::F32,
            QuantType::F16 => DType::F16,
            QuantType::BF16 => DType::BF16,
            QuantType::Q8_0 => DType::Q8_0,
            QuantType::Q4_0 => DType::Q4_0,
            QuantType::Q4_K => DType::Q4_K,
            QuantType::Q6_K => DType::Q6_K,
            _ => return None,
        })
    }

    /// Whether elements are packed in blocks (anything but the plain floats).
    pub fn is_quantized(self) -> bool {
        !matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes of a row of `cols` elements; `None` when `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        self.quant_type().row_size(cols).ok()
    }

    /// The alignment the kernels need to read the bytes in place (the element size for
    /// floats; blocks are read bytewise).
    pub fn align(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            _ => 1,
        }
    }

    pub fn name(self) -> &'static str {
        self.quant_type().name()
    }
}

/// Bytes of one tensor, kept alive by the mapping they point into or owned outright.
#[derive(Clone)]
pub enum Bytes {
    Mapped {
        map: Arc<Mmap>,
        range: Range<usize>,
    },
    /// Owned data in `u32` words so that any 2- or 4-byte view of it is aligned.
    Owned {
        words: Arc<Vec<u32>>,
        len: usize,
    },
}

impl Bytes {
    pub fn owned(bytes: &[u8]) -> Bytes {
        let mut words = vec![0u32; bytes.len().div_ceil(4)];
        bytemuck_copy(bytes, &mut words);
        Bytes::Owned { words: Arc::new(words), len: bytes.len() }
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, range } => &map[range.clone()],
            Bytes::Owned { words, len } => {
                // SAFETY: a u32 slice is always viewable as bytes; len <= 4 * words.len().
                let all = unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 4) };
                &all[..*len]
            }
        }
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lets go of the resident pages of a mapped view (whole pages inside it) after a copy
    /// has been made: they stay in the page cache, and a later read of the view faults them
    /// back in from the file. Owned bytes, and systems other than Linux: nothing.
    pub fn release_resident(&self) {
        #[cfg(target_os = "linux")]
        if let Bytes::Mapped { map, range } = self {
            const PAGE: usize = 4096;
            let base = map.as_ptr() as usize;
            let (start, end) =
                ((base + range.start).next_multiple_of(PAGE), (base + range.end) & !(PAGE - 1));
            if end > start {
                // SAFETY: a whole-page range inside a read-only file mapping, which
                // MADV_DONTNEED only unmaps from this process (its contents come back from the
                // file on the next read); failure is harmless.
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
            }
        }
    }

    /// The bytes moved into an owned, 4-byte aligned buffer when the view is
    /// not aligned for `align`; otherwise a cheap clone of the same view.
    pub fn aligned(&self, align: usize) -> Bytes {
        let s = self.as_slice();
        if (s.as_ptr() as usize).is_multiple_of(align) {
            self.clone()
        } else {
            Bytes::owned(s)
        }
    }
}

fn bytemuck_copy(bytes: &[u8], words: &mut [u32]) {
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        words[i] = u32::from_ne_bytes(w);
    }
}

/// A tensor as read from a checkpoint: name, dtype, shape and its bytes.
#[derive(Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl HostTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks that the tensor holds a `[rows, cols]` matrix (its bytes whole rows of its dtype).
    pub fn check_matrix(&self, rows: usize, cols: usize) -> crate::error::Result<()> {
        let want = self.dtype.row_bytes(cols).and_then(|r| r.checked_mul(rows));
        if self.numel() != rows * cols || want != Some(self.bytes.len()) {
            return Err(crate::error::Error::Input(format!(
                "tensor `{}` of shape {:?} ({} bytes) is not a {rows}x{cols} {} matrix",
                self.name,
                self.shape,
                self.bytes.len(),
                self.dtype.name()
            )));
        }
        Ok(())
    }

    /// The matrix with its packed blocks decoded to f32 (plain float tensors are returned as
    /// they are), for backends without kernels for a block format.
    pub fn dequantized(&self) -> HostTensor {
        if !self.dtype.is_quantized() {
            return self.clone();
        }
        let v = self.to_f32_vec();
        // f32 bits are the u32 words `Bytes::Owned` stores: no byte-wise copy in between.
        let len = v.len() * 4;
        let bytes = Bytes::Owned { words: Arc::new(v.into_iter().map(f32::to_bits).collect()), len };
        HostTensor { name: self.name.clone(), dtype: DType::F32, shape: self.shape.clone(), bytes }
    }

    /// All elements widened (or dequantized) to f32 (for small tensors: norms, biases, A_log).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let b = self.bytes.as_slice();
        match self.dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q6_K => {
                let mut out = vec![0.0; self.numel()];
                // The tensor's constructor checked that the bytes are whole blocks of numel().
                quant::dequantize_row(self.dtype.quant_type(), b, &mut out)
                    .unwrap_or_else(|e| panic!("tensor `{}`: {e}", self.name));
                out
            }
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_bytes_read_the_same_after_their_pages_are_released() {
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, &data).unwrap();
        // SAFETY: a private temporary file nobody else writes.
        let map = Arc::new(unsafe { Mmap::map(&file) }.unwrap());
        let bytes = Bytes::Mapped { map, range: 50..data.len() - 20 };
        assert_eq!(bytes.as_slice(), &data[50..data.len() - 20]);
        bytes.release_resident();
        assert_eq!(bytes.as_slice(), &data[50..data.len() - 20]);
        Bytes::owned(&data).release_resident();
    }
}
