//! Launchers for `elementwise.cu`: the embedding gather, the RMSNorms (plain, fused with the
//! residual add, gated), the residual add, SwiGLU and the f32 → bf16 conversion feeding
//! cuBLAS (picking tokens from logits is `sample.rs`'s). The one-row norms and the one-token
//! SwiGLU can also write their output quantized for the packed GEMV that reads it next
//! (`quant.rs`, "activations quantized by their producer").

use cudarc::driver::CudaFunction;

use super::device::XQuant;
use super::device::{kernel_args, CudaBuf, CudaWeight, Device};
use crate::backend::RmsNorm;
use crate::error::Result;

pub(super) const SOURCE: &str = include_str!("elementwise.cu");

pub(super) struct Kernels {
    embed_rows: CudaFunction,
    rms_norm_rows: CudaFunction,
    add_rms_norm_rows: CudaFunction,
    rms_norm_row_q: CudaFunction,
    add_rms_norm_row_q: CudaFunction,
    gated_rms_norm_rows: CudaFunction,
    swiglu: CudaFunction,
    swiglu_q: CudaFunction,
    swiglu_to_bf16: CudaFunction,
    f32_to_bf16: CudaFunction,
    f32_to_bf16_split: CudaFunction,
}

/// Threads of a block that reduces over one row of `dim`: about four elements each, so a
/// single row (decode) is not a long serial loop, up to 1024. A function of `dim` alone, so a
/// row's result does not depend on how many rows there are.
fn row_threads(dim: usize) -> u32 {
    dim.div_ceil(4 * 32).clamp(1, 32) as u32 * 32
}

/// `NORM_VECS` of elementwise.cu: float4s a thread of the row norms holds.
const NORM_VECS: usize = 4;

/// The row norms' `vec` flag: whole float4s, 16-byte aligned rows, few enough per thread.
fn norm_vec(dim: usize, ptrs: &[u64]) -> i32 {
    let fits = dim.is_multiple_of(4) && dim / 4 <= NORM_VECS * row_threads(dim) as usize;
    (fits && ptrs.iter().all(|p| p % 16 == 0)) as i32
}

impl Kernels {
    pub fn load(module: &std::sync::Arc<cudarc::driver::CudaModule>) -> Result<Kernels> {
        let f = |n: &str| {
            module.load_function(n).map_err(|e| super::device::cuda_error(format!("kernel {n}: {e}")))
        };
        Ok(Kernels {
            embed_rows: f("embed_rows")?,
            rms_norm_rows: f("rms_norm_rows")?,
            add_rms_norm_rows: f("add_rms_norm_rows")?,
            rms_norm_row_q: f("rms_norm_row_q")?,
            add_rms_norm_row_q: f("add_rms_norm_row_q")?,
            gated_rms_norm_rows: f("gated_rms_norm_rows")?,
            swiglu: f("swiglu")?,
            swiglu_q: f("swiglu_q")?,
            swiglu_to_bf16: f("swiglu_to_bf16")?,
            f32_to_bf16: f("f32_to_bf16_copy")?,
            f32_to_bf16_split: f("f32_to_bf16_split")?,
        })
    }

    pub fn embed(&self, dev: &Device, table: &CudaWeight, ids: &[u32], dim: usize, out: &mut CudaBuf) {
        assert_eq!(table.cols(), dim, "embed: table width");
        assert!(out.len() >= ids.len() * dim, "embed: out too short");
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows()) {
            panic!("embed: token id {bad} outside the table ({} rows)", table.rows());
        }
        if ids.is_empty() {
            return;
        }
        let (_ids_dev, ids_ptr) = dev.ids_on_device(ids);
        let threads = 256usize;
        let grid_x = dim.div_ceil(threads).min(64) as u32;
        dev.launch(
            "embed_rows",
            &self.embed_rows,
            (grid_x, ids.len() as u32, 1),
            (threads as u32, 1, 1),
            0,
            kernel_args![table.ptr(), ids_ptr, out.ptr(), dim as i32],
        );
    }

    /// With `xq`, a single row of the vectorised layout also goes into `xq` quantized: true
    /// when it did (the launch is then the last work on the device).
    pub fn rms_norm(
        &self,
        dev: &Device,
        x: &CudaBuf,
        norm: RmsNorm<'_, CudaBuf>,
        out: &mut CudaBuf,
        xq: Option<&XQuant>,
    ) -> bool {
        let RmsNorm { weight: w, dim, eps } = norm;
        assert!(w.len() >= dim, "rms_norm: weight shorter than dim");
        let rows = x.len().min(out.len()) / dim;
        let vec = norm_vec(dim, &[x.ptr(), w.ptr(), out.ptr()]);
        if let Some(xq) = xq.filter(|_| rows == 1 && vec == 1 && dim.is_multiple_of(32)) {
            dev.launch(
                "rms_norm_row_q",
                &self.rms_norm_row_q,
                (1, 1, 1),
                (row_threads(dim), 1, 1),
                0,
                kernel_args![x.ptr(), w.ptr(), out.ptr(), xq.q, xq.d, xq.s, dim as i32, eps],
            );
            return true;
        }
        dev.launch(
            "rms_norm_rows",
            &self.rms_norm_rows,
            (rows as u32, 1, 1),
            (row_threads(dim), 1, 1),
            0,
            kernel_args![x.ptr(), w.ptr(), out.ptr(), dim as i32, eps, vec],
        );
        false
    }

    pub fn add_rms_norm(
        &self,
        dev: &Device,
        residual: &mut CudaBuf,
        x: &CudaBuf,
        norm: RmsNorm<'_, CudaBuf>,
        out: &mut CudaBuf,
        xq: Option<&XQuant>,
    ) -> bool {
        let RmsNorm { weight: w, dim, eps } = norm;
        assert!(w.len() >= dim, "add_rms_norm: weight shorter than dim");
        let rows = residual.len().min(x.len()).min(out.len()) / dim;
        let vec = norm_vec(dim, &[residual.ptr(), x.ptr(), w.ptr(), out.ptr()]);
        if let Some(xq) = xq.filter(|_| rows == 1 && vec == 1 && dim.is_multiple_of(32)) {
            dev.launch(
                "add_rms_norm_row_q",
                &self.add_rms_norm_row_q,
                (1, 1, 1),
                (row_threads(dim), 1, 1),
                0,
                kernel_args![residual.ptr(), x.ptr(), w.ptr(), out.ptr(), xq.q, xq.d, xq.s, dim as i32, eps],
            );
            return true;
        }
        dev.launch(
            "add_rms_norm_rows",
            &self.add_rms_norm_rows,
            (rows as u32, 1, 1),
            (row_threads(dim), 1, 1),
            0,
            kernel_args![residual.ptr(), x.ptr(), w.ptr(), out.ptr(), dim as i32, eps, vec],
        );
        false
    }

    pub fn gated_rms_norm(
        &self,
        dev: &Device,
        x: &mut CudaBuf,
        z: &CudaBuf,
        norm: RmsNorm<'_, CudaBuf>,
        rows: usize,
    ) {
        let RmsNorm { weight: w, dim, eps } = norm;
        assert!(x.len() >= rows * dim && z.len() >= rows * dim, "gated_rms_norm: buffers too short");
        assert!(w.len() >= dim, "gated_rms_norm: weight shorter than dim");
        const WARPS: usize = 8;
        dev.launch(
            "gated_rms_norm_rows",
            &self.gated_rms_norm_rows,
            (rows.div_ceil(WARPS) as u32, 1, 1),
            (WARPS as u32 * 32, 1, 1),
            0,
            kernel_args![x.ptr(), z.ptr(), w.ptr(), rows as i32, dim as i32, eps],
        );
    }

    pub fn swiglu(&self, dev: &Device, gate: &CudaBuf, up: &CudaBuf, len: usize, out: &mut CudaBuf) {
        assert!(gate.len() >= len && up.len() >= len && out.len() >= len, "swiglu: buffers too short");
        dev.launch(
            "swiglu",
            &self.swiglu,
            (dev.grid_for(len, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![gate.ptr(), up.ptr(), out.ptr(), len as i64],
        );
    }

    /// [`Kernels::swiglu`] of one token's `len` values (`len % 32 == 0`), also written
    /// quantized into `xq`.
    pub fn swiglu_q(
        &self,
        dev: &Device,
        gate: &CudaBuf,
        up: &CudaBuf,
        len: usize,
        out: &mut CudaBuf,
        xq: &XQuant,
    ) {
        assert!(gate.len() >= len && up.len() >= len && out.len() >= len, "swiglu: buffers too short");
        assert!(len.is_multiple_of(32) && len <= i32::MAX as usize, "swiglu_q: {len} values");
        let groups = len / 32;
        dev.launch(
            "swiglu_q",
            &self.swiglu_q,
            (groups.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            kernel_args![gate.ptr(), up.ptr(), out.ptr(), xq.q, xq.d, xq.s, groups as i32],
        );
    }

    /// `len` floats at `src` rounded to bf16 at `dst`.
    pub fn f32_to_bf16(&self, dev: &Device, src: u64, dst: u64, len: usize) {
        dev.launch(
            "f32_to_bf16_copy",
            &self.f32_to_bf16,
            (dev.grid_for(len, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![src, dst, len as i64],
        );
    }

    /// `silu(gate) * up` of `len` floats as bf16 at `hi` (and the remainder at `lo` unless 0).
    pub fn swiglu_to_bf16(&self, dev: &Device, gate: &CudaBuf, up: &CudaBuf, hi: u64, lo: u64, len: usize) {
        assert!(gate.len() >= len && up.len() >= len, "swiglu_to_bf16: buffers too short");
        dev.launch(
            "swiglu_to_bf16",
            &self.swiglu_to_bf16,
            (dev.grid_for(len, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![gate.ptr(), up.ptr(), hi, lo, len as i64],
        );
    }

    /// `len` floats at `src` as the bf16 pair `hi + lo` at `hi`, `lo`.
    pub fn f32_to_bf16_split(&self, dev: &Device, src: u64, hi: u64, lo: u64, len: usize) {
        dev.launch(
            "f32_to_bf16_split",
            &self.f32_to_bf16_split,
            (dev.grid_for(len, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![src, hi, lo, len as i64],
        );
    }
}
