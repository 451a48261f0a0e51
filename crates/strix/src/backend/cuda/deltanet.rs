//! Launchers for `deltanet.cu`: the causal conv1d + SiLU (a sequential kernel for short runs,
//! a parallel one plus a state update for long ones) and the gated delta rule (the recurrent
//! kernel, and the chunked UT-transform kernel for prefill).

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};

use super::device::XQuant;
use super::device::{cuda_error, kernel_args, CudaBuf, Device};
use crate::backend::{
    DeltaNetLayer, DeltaNetProjections, DeltaNetShape, DeltaNetState, DeltaRuleInput, DeltaRuleMode,
};
use crate::error::Result;

pub(super) const SOURCE: &str = include_str!("deltanet.cu");

/// `CONV_MAX_HIST` of the kernels: the longest conv kernel is this plus one.
const CONV_MAX_KERNEL: usize = 8;
/// `CONV_TT` of the kernels: tokens a thread of the parallel conv takes.
const CONV_TT: usize = 16;
/// Runs of up to this many tokens take the sequential conv kernel: one launch, no copy of the
/// inputs. Longer runs parallelise over time as well.
const CONV_SEQ_MAX_TOKENS: usize = 8;
/// `GDN_COLS` and `GDN_PARTS` of the recurrent kernel.
const GDN_COLS: usize = 32;
const GDN_PARTS: usize = 4;
/// Column tilings of the fused decode kernel's fast path (`COLS`: columns of a value head a
/// block owns) and its kernels, in that order.
const DECODE_COLS: [usize; 4] = [16, 32, 64, 128];
/// `GDN_MAX_GROUPS * GDN_WARP_COLS`: the columns a value head's tiles may span.
const DECODE_MAX_COLUMNS: usize = 256;
const DECODE_NAMES: [&str; 4] = [
    "gdn_decode_fused_dk128_k4_c16",
    "gdn_decode_fused_dk128_k4_c32",
    "gdn_decode_fused_dk128_k4_c64",
    "gdn_decode_fused_dk128_k4_c128",
];
/// The 32-column fast path (`DECODE_NAMES[1]`) that also quantizes one token's output.
const DECODE_NAME_C32_Q: &str = "gdn_decode_fused_dk128_k4_c32_q";
/// The recurrent kernels hold k_head_dim / GDN_PARTS state values per thread in registers.
const GDN_RECURRENT_MAX_DK: usize = 256;
/// `CH` and `DVB` of the chunked kernel.
const CHUNK: usize = 64;
const CHUNK_COLS: usize = 32;

/// One sequence's run of the delta rule over `tokens` tokens of the input (the trait's
/// `gated_delta_rule`: the f32 kernels here and the tensor-core ones of `deltanet_chunked.rs`).
#[derive(Clone, Copy)]
pub(super) struct DeltaRuleRun<'a> {
    pub shape: &'a DeltaNetShape,
    pub input: DeltaRuleInput<'a, CudaBuf>,
    pub tokens: usize,
}

/// Which conv and delta-rule kernels ran (for the path counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ConvRan {
    Sequential,
    Parallel,
}

pub(super) struct Kernels {
    conv_seq: CudaFunction,
    conv_par: CudaFunction,
    conv_state: CudaFunction,
    conv_rows: CudaFunction,
    gdn_recurrent_dk128: CudaFunction,
    gdn_recurrent_generic: CudaFunction,
    gdn_recurrent_rows_dk128: CudaFunction,
    gdn_recurrent_rows_generic: CudaFunction,
    gdn_chunked: CudaFunction,
    /// The fused decode kernel's fast path, one per column tiling (`DECODE_COLS`).
    gdn_decode_fused: [CudaFunction; 4],
    gdn_decode_fused_generic: CudaFunction,
    /// The 32-column fast path that also quantizes its one token's output.
    gdn_decode_fused_c32_q: CudaFunction,
    /// `CudaOptions::gdn_decode_cols` (one of `DECODE_COLS`): the fused decode kernel's column
    /// tiling, forced where the shape allows it (benchmarks and tests compare them);
    /// otherwise chosen per launch.
    decode_cols: Option<usize>,
    /// Dynamic shared memory the chunked kernel may use, bytes.
    chunked_smem_limit: usize,
}

/// Shared memory of `gdn_chunked` for a k_head_dim, in floats (see the layout in the kernel).
fn chunked_smem_floats(dk: usize) -> usize {
    2 * CHUNK * (dk + 1) + dk * CHUNK_COLS + CHUNK * CHUNK_COLS + CHUNK * (CHUNK + 1) + 3 * CHUNK
}

impl Kernels {
    /// `decode_cols`: [`super::CudaOptions::gdn_decode_cols`].
    pub fn load(module: &Arc<CudaModule>, dev: &Device, decode_cols: Option<usize>) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        let gdn_chunked = f("gdn_chunked")?;
        // Opt in to all the shared memory a block may have; the launcher checks each shape.
        let limit = dev.max_smem_optin as usize;
        gdn_chunked
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit as i32,
            )
            .map_err(|e| cuda_error(format!("gdn_chunked shared memory opt-in: {e}")))?;
        Ok(Kernels {
            conv_seq: f("conv1d_silu_seq")?,
            conv_par: f("conv1d_silu_par")?,
            conv_state: f("conv1d_state_update")?,
            conv_rows: f("conv1d_silu_rows")?,
            gdn_recurrent_dk128: f("gdn_recurrent_dk128")?,
            gdn_recurrent_generic: f("gdn_recurrent_generic")?,
            gdn_recurrent_rows_dk128: f("gdn_recurrent_rows_dk128")?,
            gdn_recurrent_rows_generic: f("gdn_recurrent_rows_generic")?,
            gdn_chunked,
            gdn_decode_fused: [
                f(DECODE_NAMES[0])?,
                f(DECODE_NAMES[1])?,
                f(DECODE_NAMES[2])?,
                f(DECODE_NAMES[3])?,
            ],
            gdn_decode_fused_generic: f("gdn_decode_fused_generic")?,
            gdn_decode_fused_c32_q: f(DECODE_NAME_C32_Q)?,
            decode_cols,
            chunked_smem_limit: limit,
        })
    }

    pub fn causal_conv1d_silu(
        &self,
        dev: &Device,
        shape: &DeltaNetShape,
        qkv: &mut CudaBuf,
        tokens: usize,
        weight: &CudaBuf,
        state: &mut CudaBuf,
    ) -> ConvRan {
        let c = shape.conv_dim();
        let k = shape.conv_kernel;
        assert!((1..=CONV_MAX_KERNEL).contains(&k), "conv1d: kernel size {k} outside 1..={CONV_MAX_KERNEL}");
        assert!(qkv.len() >= tokens * c, "conv1d: qkv too short");
        assert!(weight.len() >= c * k, "conv1d: weight too short");
        assert!(state.len() >= shape.conv_state_len(), "conv1d: state too short");
        let args = |t: usize| (t as i32, c as i32, k as i32);
        if tokens <= CONV_SEQ_MAX_TOKENS {
            let (t, c32, k32) = args(tokens);
            dev.launch(
                "conv1d_silu_seq",
                &self.conv_seq,
                (c.div_ceil(128) as u32, 1, 1),
                (128, 1, 1),
                0,
                kernel_args![qkv.ptr(), weight.ptr(), state.ptr(), t, c32, k32],
            );
            return ConvRan::Sequential;
        }
        assert!(tokens <= 65535, "conv1d: {tokens} tokens exceed one launch's grid");
        // The parallel kernel writes a new buffer (a thread's inputs are other threads'
        // outputs), which then takes qkv's place; the raw inputs, still needed by the state
        // update, are freed (stream-ordered) after both kernels.
        let mut out = dev.alloc(qkv.len()).unwrap_or_else(|e| panic!("{e}"));
        let (t, c32, k32) = args(tokens);
        dev.launch(
            "conv1d_silu_par",
            &self.conv_par,
            (c.div_ceil(256) as u32, tokens.div_ceil(CONV_TT) as u32, 1),
            (256, 1, 1),
            0,
            kernel_args![qkv.ptr(), out.ptr(), weight.ptr(), state.ptr(), t, c32, k32],
        );
        std::mem::swap(qkv, &mut out);
        let raw = out;
        dev.launch(
            "conv1d_state_update",
            &self.conv_state,
            (c.div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            0,
            kernel_args![raw.ptr(), state.ptr(), t, c32, k32],
        );
        ConvRan::Parallel
    }

    /// One token for each of `states.len()` sequences: row `i` of `qkv` with `states[i].conv`.
    pub fn causal_conv1d_silu_rows(
        &self,
        dev: &Device,
        shape: &DeltaNetShape,
        qkv: &mut CudaBuf,
        weight: &CudaBuf,
        states: &mut [DeltaNetState<'_, CudaBuf>],
    ) {
        let (c, k, n) = (shape.conv_dim(), shape.conv_kernel, states.len());
        assert!((1..=CONV_MAX_KERNEL).contains(&k), "conv1d: kernel size {k} outside 1..={CONV_MAX_KERNEL}");
        assert!(qkv.len() >= n * c, "conv1d_rows: qkv too short");
        assert!(weight.len() >= c * k, "conv1d_rows: weight too short");
        assert!(n <= 65535, "conv1d_rows: batch of {n} exceeds one launch's grid");
        if n == 0 {
            return;
        }
        let ptrs = state_pointers(states.iter().map(|s| &*s.conv), shape.conv_state_len(), "conv1d_rows");
        let (_ptrs_dev, ptrs_ptr) = dev.upload_u64(&ptrs).unwrap_or_else(|e| panic!("{e}"));
        dev.launch(
            "conv1d_silu_rows",
            &self.conv_rows,
            (c.div_ceil(128) as u32, n as u32, 1),
            (128, 1, 1),
            0,
            kernel_args![qkv.ptr(), weight.ptr(), ptrs_ptr, c as i32, k as i32],
        );
    }

    /// One recurrent step for each of `states.len()` sequences (see `gated_delta_rule_rows` of
    /// the trait).
    pub fn gated_delta_rule_rows(
        &self,
        dev: &Device,
        shape: &DeltaNetShape,
        input: DeltaRuleInput<'_, CudaBuf>,
        states: &mut [DeltaNetState<'_, CudaBuf>],
        out: &mut CudaBuf,
    ) {
        let DeltaRuleInput { qkv, a, b, a_log, dt_bias } = input;
        let (nk, nv, dk, dv) = (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
        let n = states.len();
        assert!(
            nk > 0 && nv % nk == 0,
            "gated_delta_rule_rows: {nv} value heads do not group onto {nk} key heads"
        );
        assert!(
            dk <= GDN_RECURRENT_MAX_DK,
            "gated_delta_rule_rows: k_head_dim {dk} > {GDN_RECURRENT_MAX_DK}"
        );
        assert!(qkv.len() >= n * shape.conv_dim(), "gated_delta_rule_rows: qkv too short");
        assert!(a.len() >= n * nv && b.len() >= n * nv, "gated_delta_rule_rows: a/b too short");
        assert!(a_log.len() >= nv && dt_bias.len() >= nv, "gated_delta_rule_rows: a_log/dt_bias too short");
        assert!(out.len() >= n * shape.value_dim(), "gated_delta_rule_rows: out too short");
        assert!(n <= 65535, "gated_delta_rule_rows: batch of {n} exceeds one launch's grid");
        if n == 0 {
            return;
        }
        let ptrs =
            state_pointers(states.iter().map(|s| &*s.recurrent), shape.state_len(), "gated_delta_rule_rows");
        let (_ptrs_dev, ptrs_ptr) = dev.upload_u64(&ptrs).unwrap_or_else(|e| panic!("{e}"));
        let q_scale = 1.0 / (dk as f32).sqrt();
        let kh_div = shape.key_head_divisor() as i32;
        let (f, name) = if dk == 128 {
            (&self.gdn_recurrent_rows_dk128, "gdn_recurrent_rows_dk128")
        } else {
            (&self.gdn_recurrent_rows_generic, "gdn_recurrent_rows_generic")
        };
        dev.launch(
            name,
            f,
            (nv as u32, dv.div_ceil(GDN_COLS) as u32, n as u32),
            ((GDN_COLS * GDN_PARTS) as u32, 1, 1),
            0,
            kernel_args![
                qkv.ptr(),
                a.ptr(),
                b.ptr(),
                a_log.ptr(),
                dt_bias.ptr(),
                ptrs_ptr,
                out.ptr(),
                nk as i32,
                nv as i32,
                dk as i32,
                dv as i32,
                q_scale,
                kh_div
            ],
        );
    }

    /// Thread-block cluster size of the fused decode kernel for `shape` at its default tiling
    /// (`GDN_COLS` columns a block): the blocks of one key head (its value heads times their
    /// column tiles), or `None` past the portable 8, where the op runs unfused.
    pub fn decode_cluster(shape: &DeltaNetShape) -> Option<usize> {
        Self::decode_cluster_at(shape, GDN_COLS)
    }

    fn decode_cluster_at(shape: &DeltaNetShape, cols: usize) -> Option<usize> {
        let per_key = shape.num_v_heads / shape.num_k_heads.max(1);
        let size = per_key * shape.v_head_dim.div_ceil(cols);
        // The gated norm's partial sums (one per warp of 8 columns) fit `GDN_MAX_GROUPS`.
        let fits = shape.num_k_heads > 0
            && shape.num_v_heads.is_multiple_of(shape.num_k_heads)
            && shape.v_head_dim.div_ceil(cols) * cols <= DECODE_MAX_COLUMNS
            && shape.k_head_dim <= GDN_RECURRENT_MAX_DK
            && (1..=CONV_MAX_KERNEL).contains(&shape.conv_kernel);
        (fits && (1..=8).contains(&size)).then_some(size)
    }

    /// The fused decode kernel for `shape` and a batch of `n`: (kernel, name, columns a block,
    /// cluster size), for shapes [`Kernels::decode_cluster`] takes. Shapes with dk 128 and a
    /// conv kernel of 4 (every Qwen3.5) take the fast path, which prefetches the conv weights
    /// and state into registers; the generic kernel (32 columns) takes the rest. Batches too
    /// small to give every SM a block of 32 columns take 16-column blocks where the cluster
    /// stays within 8: twice the blocks, each with half the state to stream. The kernel's sums
    /// run in column order, so the tiling never changes a result.
    fn decode_kernel(
        &self,
        shape: &DeltaNetShape,
        n: usize,
        sm_count: usize,
    ) -> (&CudaFunction, &'static str, usize, usize) {
        let cluster32 = Kernels::decode_cluster(shape)
            .unwrap_or_else(|| panic!("deltanet_decode_rows: no fused kernel for {shape:?}"));
        if shape.k_head_dim != 128 || shape.conv_kernel != 4 {
            return (&self.gdn_decode_fused_generic, "gdn_decode_fused_generic", GDN_COLS, cluster32);
        }
        let blocks32 = n * shape.num_v_heads * shape.v_head_dim.div_ceil(GDN_COLS);
        let auto = if blocks32 < sm_count { 16 } else { GDN_COLS };
        // The forced tiling, else the chosen one, else 32 columns (which every shape here takes).
        [self.decode_cols.unwrap_or(auto), auto, GDN_COLS]
            .into_iter()
            .find_map(|cols| {
                let i = DECODE_COLS.iter().position(|&c| c == cols)?;
                let cluster = Kernels::decode_cluster_at(shape, cols)?;
                Some((&self.gdn_decode_fused[i], DECODE_NAMES[i], cols, cluster))
            })
            .expect("32 columns fit every shape decode_cluster takes")
    }

    /// One decode token of each of `states.len()` sequences through conv1d + SiLU, the
    /// recurrent delta rule and the gated RMSNorm in one launch (`gdn_decode_fused_body`), for
    /// shapes [`Kernels::decode_cluster`] takes. `qkv` holds the raw projections (left as
    /// they are), `z` `[n, value_dim]`, `norm` `[v_head_dim]`; `out` gets the normed output.
    /// With `side`, one token on the 32-column fast path (the 9B's batch-1 tiling) also writes
    /// its output quantized there for the packed out_proj (as `quantize_x` would, bitwise):
    /// true when it did.
    pub fn deltanet_decode_rows(
        &self,
        dev: &Device,
        layer: DeltaNetLayer<'_, CudaBuf>,
        projections: DeltaNetProjections<'_, CudaBuf>,
        states: &mut [DeltaNetState<'_, CudaBuf>],
        out: &mut CudaBuf,
        side: Option<&XQuant>,
    ) -> bool {
        let DeltaNetLayer { ref shape, conv1d: conv_weight, a_log, dt_bias, norm } = layer;
        let DeltaNetProjections { qkv, z, a, b } = projections;
        let (nk, nv, dk, dv) = (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
        let (k, n) = (shape.conv_kernel, states.len());
        let (f, name, cols, cluster) = self.decode_kernel(shape, n, dev.sm_count as usize);
        let quantize = side.filter(|_| n == 1 && name == DECODE_NAMES[1] && dv.is_multiple_of(32));
        let (f, name) =
            if quantize.is_some() { (&self.gdn_decode_fused_c32_q, DECODE_NAME_C32_Q) } else { (f, name) };
        let (xq, xd, xs) = quantize.map_or((0, 0, 0), |q| (q.q, q.d, q.s));
        assert!(qkv.len() >= n * shape.conv_dim(), "deltanet_decode_rows: qkv too short");
        assert!(z.len() >= n * shape.value_dim(), "deltanet_decode_rows: z too short");
        assert!(a.len() >= n * nv && b.len() >= n * nv, "deltanet_decode_rows: a/b too short");
        assert!(conv_weight.len() >= shape.conv_dim() * k, "deltanet_decode_rows: conv weight too short");
        assert!(a_log.len() >= nv && dt_bias.len() >= nv, "deltanet_decode_rows: a_log/dt_bias too short");
        assert!(norm.len() >= dv, "deltanet_decode_rows: norm weight too short");
        assert!(out.len() >= n * shape.value_dim(), "deltanet_decode_rows: out too short");
        assert!(n <= 65535, "deltanet_decode_rows: batch of {n} exceeds one launch's grid");
        if n == 0 {
            return false;
        }
        let conv_ptrs =
            state_pointers(states.iter().map(|s| &*s.conv), shape.conv_state_len(), "deltanet_decode_rows");
        let (_conv_dev, conv_ptr) = dev.upload_u64(&conv_ptrs).unwrap_or_else(|e| panic!("{e}"));
        let ptrs =
            state_pointers(states.iter().map(|s| &*s.recurrent), shape.state_len(), "deltanet_decode_rows");
        let (_ptrs_dev, ptrs_ptr) = dev.upload_u64(&ptrs).unwrap_or_else(|e| panic!("{e}"));
        let q_scale = 1.0 / (dk as f32).sqrt();
        dev.launch_clustered(
            name,
            f,
            ((nv * dv.div_ceil(cols)) as u32, n as u32, 1),
            ((cols * GDN_PARTS) as u32, 1, 1),
            0,
            cluster as u32,
            kernel_args![
                qkv.ptr(),
                z.ptr(),
                a.ptr(),
                b.ptr(),
                conv_weight.ptr(),
                a_log.ptr(),
                dt_bias.ptr(),
                norm.ptr(),
                conv_ptr,
                ptrs_ptr,
                out.ptr(),
                nk as i32,
                nv as i32,
                dk as i32,
                dv as i32,
                k as i32,
                q_scale,
                shape.key_head_divisor() as i32,
                shape.eps,
                xq,
                xd,
                xs
            ],
        );
        quantize.is_some()
    }

    pub fn gated_delta_rule(
        &self,
        dev: &Device,
        mode: DeltaRuleMode,
        run: DeltaRuleRun,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
    ) {
        let DeltaRuleRun { shape, input: DeltaRuleInput { qkv, a, b, a_log, dt_bias }, tokens } = run;
        let (nk, nv, dk, dv) = (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
        assert!(
            nk > 0 && nv % nk == 0,
            "gated_delta_rule: {nv} value heads do not group onto {nk} key heads"
        );
        check_delta_rule_buffers("gated_delta_rule", run, state, out);
        if tokens == 0 {
            return;
        }
        // As the CPU computes it, so both backends scale q identically.
        let q_scale = 1.0 / (dk as f32).sqrt();
        let kh_div = shape.key_head_divisor() as i32;
        // Both kernels take the same arguments; the launch shape is the algorithm's.
        let (name, f, grid, block, smem) = match mode {
            DeltaRuleMode::Recurrent => {
                assert!(
                    dk <= GDN_RECURRENT_MAX_DK,
                    "gated_delta_rule: k_head_dim {dk} > {GDN_RECURRENT_MAX_DK} is not supported"
                );
                let (f, name) = if dk == 128 {
                    (&self.gdn_recurrent_dk128, "gdn_recurrent_dk128")
                } else {
                    (&self.gdn_recurrent_generic, "gdn_recurrent_generic")
                };
                let grid = (nv as u32, dv.div_ceil(GDN_COLS) as u32, 1);
                (name, f, grid, ((GDN_COLS * GDN_PARTS) as u32, 1, 1), 0)
            }
            DeltaRuleMode::Chunked => {
                let smem = chunked_smem_floats(dk) * 4;
                assert!(
                    smem <= self.chunked_smem_limit,
                    "gated_delta_rule: k_head_dim {dk} needs {smem} bytes of shared memory, the device allows {}",
                    self.chunked_smem_limit
                );
                (
                    "gdn_chunked",
                    &self.gdn_chunked,
                    (nv as u32, dv.div_ceil(CHUNK_COLS) as u32, 1),
                    (256, 1, 1),
                    smem,
                )
            }
        };
        let (t, nk32, nv32, dk32, dv32) = (tokens as i32, nk as i32, nv as i32, dk as i32, dv as i32);
        dev.launch(
            name,
            f,
            grid,
            block,
            smem as u32,
            kernel_args![
                qkv.ptr(),
                a.ptr(),
                b.ptr(),
                a_log.ptr(),
                dt_bias.ptr(),
                state.ptr(),
                out.ptr(),
                t,
                nk32,
                nv32,
                dk32,
                dv32,
                q_scale,
                kh_div
            ],
        );
    }
}

/// Device addresses of per-sequence state buffers, each checked to hold `len` floats.
fn state_pointers<'a>(states: impl Iterator<Item = &'a CudaBuf>, len: usize, what: &str) -> Vec<u64> {
    states
        .map(|s| {
            assert!(s.len() >= len, "{what}: a state holds {} floats, {len} needed", s.len());
            s.ptr()
        })
        .collect()
}

/// Panics (naming the op, `what`) unless the one-sequence delta rule's buffers hold what
/// `tokens` tokens need: `qkv` `[tokens, conv_dim]`, `a`, `b` `[tokens, v_heads]`, `a_log`,
/// `dt_bias` `[v_heads]`, the state, `out` `[tokens, value_dim]`.
pub(super) fn check_delta_rule_buffers(what: &str, run: DeltaRuleRun, state: &CudaBuf, out: &CudaBuf) {
    let DeltaRuleRun { shape, input: DeltaRuleInput { qkv, a, b, a_log, dt_bias }, tokens } = run;
    let nv = shape.num_v_heads;
    assert!(qkv.len() >= tokens * shape.conv_dim(), "{what}: qkv too short");
    assert!(a.len() >= tokens * nv && b.len() >= tokens * nv, "{what}: a/b too short");
    assert!(a_log.len() >= nv && dt_bias.len() >= nv, "{what}: a_log/dt_bias too short");
    assert!(state.len() >= shape.state_len(), "{what}: state too short");
    assert!(out.len() >= tokens * shape.value_dim(), "{what}: out too short");
}
