//! Host-side weight storage: the element types strix reads from checkpoints and a
//! byte store that is either a window of a memory-mapped file or an owned buffer.
//!
//! Weights stay in their checkpoint dtype (bf16 stays bf16); kernels widen to f32
//! in registers. Nothing here copies a mapped tensor unless its bytes are misaligned.

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        }
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

    /// All elements widened to f32 (for small tensors: norms, biases, A_log).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let b = self.bytes.as_slice();
        match self.dtype {
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
