//! Launchers for `elementwise.cu`: the embedding gather, the RMSNorms (plain, fused with the
//! residual add, gated), the residual add, SwiGLU and the f32 → bf16 conversion feeding cuBLAS.

use cudarc::driver::CudaFunction;

use super::device::{kernel_args, CudaBuf, CudaWeight, Device};
use crate::error::Result;

pub(super) const SOURCE: &str = include_str!("elementwise.cu");

pub(super) struct Kernels {
    embed_rows: CudaFunction,
    rms_norm_rows: CudaFunction,
    add_rms_norm_rows: CudaFunction,
    gated_rms_norm_rows: CudaFunction,
    add_inplace: CudaFunction,
    swiglu: CudaFunction,
    f32_to_bf16: CudaFunction,
    f32_to_bf16_split: CudaFunction,
    argmax_rows: CudaFunction,
}

/// Threads of a block that reduces over one row of `dim`: about four elements each, so a
/// single row (decode) is not a long serial loop, up to 1024. A function of `dim` alone, so a
/// row's result does not depend on how many rows there are.
fn row_threads(dim: usize) -> u32 {
    dim.div_ceil(4 * 32).clamp(1, 32) as u32 * 32
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
            gated_rms_norm_rows: f("gated_rms_norm_rows")?,
            add_inplace: f("add_inplace")?,
            swiglu: f("swiglu")?,
            argmax_rows: f("argmax_rows")?,
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

    pub fn rms_norm(&self, dev: &Device, x: &CudaBuf, w: &CudaBuf, dim: usize, eps: f32, out: &mut CudaBuf) {
        assert!(w.len() >= dim, "rms_norm: weight shorter than dim");
        let rows = x.len().min(out.len()) / dim;
        dev.launch(
            "rms_norm_rows",
            &self.rms_norm_rows,
            (rows as u32, 1, 1),
            (row_threads(dim), 1, 1),
            0,
            kernel_args![x.ptr(), w.ptr(), out.ptr(), dim as i32, eps],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        dev: &Device,
        residual: &mut CudaBuf,
        x: &CudaBuf,
        w: &CudaBuf,
        dim: usize,
        eps: f32,
        out: &mut CudaBuf,
    ) {
        assert!(w.len() >= dim, "add_rms_norm: weight shorter than dim");
        let rows = residual.len().min(x.len()).min(out.len()) / dim;
        dev.launch(
            "add_rms_norm_rows",
            &self.add_rms_norm_rows,
            (rows as u32, 1, 1),
            (row_threads(dim), 1, 1),
            0,
            kernel_args![residual.ptr(), x.ptr(), w.ptr(), out.ptr(), dim as i32, eps],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub fn gated_rms_norm(
        &self,
        dev: &Device,
        x: &mut CudaBuf,
        z: &CudaBuf,
        w: &CudaBuf,
        rows: usize,
        dim: usize,
        eps: f32,
    ) {
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

    pub fn add(&self, dev: &Device, residual: &mut CudaBuf, x: &CudaBuf, len: usize) {
        assert!(residual.len() >= len && x.len() >= len, "add: buffers too short");
        dev.launch(
            "add_inplace",
            &self.add_inplace,
            (dev.grid_for(len, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![residual.ptr(), x.ptr(), len as i64],
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

    /// The index of the largest value of each `[cols]` row of `x` (the greedy token), only the
    /// indices crossing to the host.
    pub fn argmax_rows(&self, dev: &Device, x: &CudaBuf, rows: usize, cols: usize) -> Vec<u32> {
        assert!(x.len() >= rows * cols && cols <= i32::MAX as usize, "argmax_rows: x too short");
        if rows == 0 {
            return Vec::new();
        }
        let idx = dev.alloc(rows).unwrap_or_else(|e| panic!("{e}"));
        dev.launch(
            "argmax_rows",
            &self.argmax_rows,
            (rows as u32, 1, 1),
            (1024, 1, 1),
            0,
            kernel_args![x.ptr(), idx.ptr(), cols as i32],
        );
        let mut out = vec![0u32; rows];
        dev.copy_dtoh(&mut out, idx.ptr()).unwrap_or_else(|e| panic!("{e}"));
        out
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
