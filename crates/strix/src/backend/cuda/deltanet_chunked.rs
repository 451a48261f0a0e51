//! Launchers for `deltanet_chunked.cu`: the chunked gated delta rule of a prompt with its
//! sequential part on the tensor cores. `gdn_tc_prep` computes, for every 64-token chunk and
//! value head at once, what does not depend on the state (normalised q and k, the decays, the
//! UT transform `T = (I + A)^-1`, `W`, `U` and the causal `q.k` block) in f32; `gdn_tc_scan`
//! then walks the chunks per head with four small `mma.sync` products each, the state in f32
//! accumulators and bf16 only as an operand. Shapes it is not built for (k_head_dim not a
//! multiple of 16 or above 128, v_head_dim not a multiple of 32) keep `gdn_chunked`.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};

use super::deltanet::{self, DeltaRuleRun};
use super::device::{cuda_error, kernel_args, CudaBuf, Device};
use crate::backend::{DeltaNetShape, DeltaRuleInput};
use crate::error::Result;

pub(super) const SOURCE: &str = concat!(
    include_str!("mma.cuh"),
    "\n#line 1 \"deltanet_chunked.cu\"\n",
    include_str!("deltanet_chunked.cu")
);

/// `TC_CH`, `TC_DVB` and `TC_SCAN_WARPS` of the kernels.
const CHUNK: usize = 64;
const COLS: usize = 32;
const SCAN_WARPS: usize = 4;
/// Widest k head the scan holds (`16 * TC_SCAN_WARPS * TC_MAX_MT`, and its shared memory).
const MAX_DK: usize = 128;

pub(super) struct Kernels {
    prep: CudaFunction,
    scan: CudaFunction,
    smem_limit: usize,
}

fn prep_smem_bytes(dk: usize) -> usize {
    let ld = dk + 1;
    4 * (CHUNK * ld.max(CHUNK + 1) + CHUNK * ld + CHUNK * (CHUNK + 1) + 3 * CHUNK)
}

fn scan_smem_bytes(dk: usize) -> usize {
    let buf = 2 * (2 * CHUNK * (dk + 8) + dk * (CHUNK + 8) + CHUNK * (CHUNK + 8)) + 4 * CHUNK * COLS;
    2 * buf + 2 * COLS * (dk + 8) + 2 * COLS * (CHUNK + 8)
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>, dev: &Device) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        let limit = dev.max_smem_optin as usize;
        let (prep, scan) = (f("gdn_tc_prep")?, f("gdn_tc_scan")?);
        for (func, name) in [(&prep, "gdn_tc_prep"), (&scan, "gdn_tc_scan")] {
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit as i32,
            )
            .map_err(|e| cuda_error(format!("{name} shared memory opt-in: {e}")))?;
        }
        Ok(Kernels { prep, scan, smem_limit: limit })
    }

    /// Whether [`Kernels::gated_delta_rule`] takes this shape.
    pub fn supports(&self, shape: &DeltaNetShape, tokens: usize) -> bool {
        let (nk, nv, dk, dv) = (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
        tokens > 1
            && nk > 0
            && nv.is_multiple_of(nk)
            && nv <= 65535
            && dk.is_multiple_of(16)
            && (16..=MAX_DK).contains(&dk)
            && dv.is_multiple_of(COLS)
            && prep_smem_bytes(dk) <= self.smem_limit
            && scan_smem_bytes(dk) <= self.smem_limit
    }

    /// The chunked delta rule over `tokens` tokens of one sequence (the trait's
    /// `gated_delta_rule` in `Chunked` mode). The caller checked [`Kernels::supports`].
    pub fn gated_delta_rule(&self, dev: &Device, run: DeltaRuleRun, state: &mut CudaBuf, out: &mut CudaBuf) {
        let DeltaRuleRun { shape, input: DeltaRuleInput { qkv, a, b, a_log, dt_bias }, tokens } = run;
        let (nk, nv, dk, dv) = (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
        assert!(self.supports(shape, tokens), "gdn_tc: unsupported shape {shape:?} T={tokens}");
        deltanet::check_delta_rule_buffers("gdn_tc", run, state, out);
        let chunks = tokens.div_ceil(CHUNK);
        let slots = chunks * nv;
        let alloc = |floats: usize| dev.alloc(floats).unwrap_or_else(|e| panic!("{e}"));
        // bf16 arrays live in f32 buffers of half as many elements.
        let w = alloc(slots * CHUNK * dk / 2);
        let qe = alloc(slots * CHUNK * dk / 2);
        let kdt = alloc(slots * CHUNK * dk / 2);
        let aqk = alloc(slots * CHUNK * CHUNK / 2);
        let u = alloc(slots * CHUNK * dv);
        let el = alloc(slots);
        let q_scale = 1.0 / (dk as f32).sqrt();
        let kh_div = shape.key_head_divisor() as i32;
        let (t, nk32, nv32, dk32, dv32) = (tokens as i32, nk as i32, nv as i32, dk as i32, dv as i32);
        dev.launch(
            "gdn_tc_prep",
            &self.prep,
            (chunks as u32, nv as u32, 1),
            (256, 1, 1),
            prep_smem_bytes(dk) as u32,
            kernel_args![
                qkv.ptr(),
                a.ptr(),
                b.ptr(),
                a_log.ptr(),
                dt_bias.ptr(),
                w.ptr(),
                qe.ptr(),
                kdt.ptr(),
                aqk.ptr(),
                u.ptr(),
                el.ptr(),
                t,
                nk32,
                nv32,
                dk32,
                dv32,
                q_scale,
                kh_div
            ],
        );
        dev.launch(
            "gdn_tc_scan",
            &self.scan,
            (nv as u32, (dv / COLS) as u32, 1),
            ((SCAN_WARPS * 32) as u32, 1, 1),
            scan_smem_bytes(dk) as u32,
            kernel_args![
                w.ptr(),
                qe.ptr(),
                kdt.ptr(),
                aqk.ptr(),
                u.ptr(),
                el.ptr(),
                state.ptr(),
                out.ptr(),
                t,
                nv32,
                dk32,
                dv32
            ],
        );
    }
}
