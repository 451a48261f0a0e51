//! The activations of a packed matmul quantized to int8 (`quantize_x`'s output, or a
//! producer's side output): one buffer the quantizing kernels write and the packed GEMVs read.

use super::device::{CudaBuf, Device};

/// The activations of a matmul quantized for the GEMV: `[tokens, cols]` i8, then a scale per
/// 32 and a sum per 16 quants (one f32 buffer, carved up).
pub(super) struct XQuant {
    _buf: CudaBuf,
    pub q: u64,
    pub d: u64,
    pub s: u64,
}

impl XQuant {
    /// Room for `n` activations (`n % 32 == 0`).
    pub(super) fn alloc(dev: &Device, n: usize) -> XQuant {
        let groups = n / 32;
        // i8 quants (n / 4 floats), f32 scales (n / 32), i32 sums (n / 16): all 16-byte aligned.
        let buf = dev.alloc(n / 4 + groups + 2 * groups).unwrap_or_else(|e| panic!("{e}"));
        let q = buf.ptr();
        let d = q + n as u64;
        let s = d + 4 * groups as u64;
        XQuant { _buf: buf, q, d, s }
    }
}
