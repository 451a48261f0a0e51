//! Launchers for `moe.cu`: a sparse MoE block's routed experts on the device, for a decode
//! batch or a prompt — the router's softmax and top-k, each pick's gate/up rows with the
//! SwiGLU, and each token's down rows summed over its picks (for a prompt, or packed experts,
//! each picked expert runs once over all its picks) — plus
//! the shared expert's sigmoid gate. The shared expert itself may run as one more pick of every
//! token ([`SharedExpert`]: weight sigmoid(gate logit), added last), which saves its own
//! launches where a step is made of launches (decode tuned for one sequence). Nothing comes
//! back to the host, so a MoE
//! decode step can be recorded as a CUDA graph. Experts all bf16 (`moe.cu`'s dot products)
//! or all packed (`quant.cu`'s `qmoe_*` on activations quantized per 32, as the packed GEMVs
//! take them), up to [`MAX_EXPERTS`], top-k up to [`MAX_TOP_K`]; anything else keeps the
//! host-routed default (`backend::moe_experts_on_host`). A prompt's experts run on the tensor
//! cores (`moe_mma_*`; packed ones dequantized to bf16 first, as the dense packed prompt GEMMs
//! take them), a decode batch's on the CUDA cores.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};

use super::device::{cuda_error, kernel_args, CudaBuf, CudaWeight, Device};
use super::quant;
use crate::error::Result;
use crate::tensor::DType;

pub(super) const SOURCE: &str =
    concat!(include_str!("mma.cuh"), "\n#line 1 \"moe.cu\"\n", include_str!("moe.cu"));

/// `MOE_MAX_EXPERTS` (prelude.cu), `MOE_WARPS` and `MOE_ROUTE_WARPS` of the kernels; top-k at
/// most 32 in `moe_route` (a pick a lane), 16 here.
pub const MAX_EXPERTS: usize = 512;
pub const MAX_TOP_K: usize = 16;
const WARPS: usize = 8;

/// A decode batch is at most this many tokens: its bf16 experts run each pick in its own
/// blocks, its packed experts the grouped CUDA-core kernels (`quant.cu`'s `qmoe_*`). More
/// tokens are a prompt: the picks are listed by expert and each picked expert runs once over
/// all of its picks on the tensor cores (packed experts dequantized to bf16 first). Measured
/// on an H200 (35B-A3B shape, BENCHMARKS-LOG sessions 15 and 16): grouped kernels made bf16
/// decode batches of 16 and 64 slower (CUDA cores: 657 and 1,131 tok/s against 1,218 and
/// 1,492; tensor cores: 885 and 1,625 against 1,242 and 1,490, slower at 1 and 16).
pub const PER_PICK_MAX_TOKENS: usize = 64;
const ROUTE_WARPS: usize = 4;

/// `MoeTable` of `prelude.cu`: one weight pointer per expert, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeTable {
    w: [u64; MAX_EXPERTS],
}

/// `MoeListing` of `prelude.cu`: `moe_bucket`'s listing of the picks by expert.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeListing {
    active_count: u64,
    active: u64,
    start: u64,
    members: u64,
}

/// `MoePair` of `prelude.cu`: the gate and up pointers per expert.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoePair {
    a: [u64; MAX_EXPERTS],
    b: [u64; MAX_EXPERTS],
}

/// The weight pointers of `ws`, then of `last` (the shared expert's slot) where given.
fn table(ws: &[CudaWeight], last: Option<&CudaWeight>) -> [u64; MAX_EXPERTS] {
    let mut t = [0u64; MAX_EXPERTS];
    for (slot, w) in t.iter_mut().zip(ws.iter().chain(last)) {
        *slot = w.ptr();
    }
    t
}

/// A layer's routed experts as the kernels take them (the backend's `MoeExperts`, borrowed).
pub(super) struct Experts<'a> {
    pub gate: &'a [CudaWeight],
    pub up: &'a [CudaWeight],
    pub down: &'a [CudaWeight],
    pub top_k: usize,
}

/// The shared expert run as one more pick of every token: its weights take the slot after the
/// routed experts in the kernels' tables, and `moe_route` gives that pick the weight
/// sigmoid(`gate_logits[t]`) and puts it last, so the kernels' sum in pick order is the
/// reference's `expert_output + sigmoid(gate) * shared_expert_output`.
pub(super) struct SharedExpert<'a> {
    pub gate: &'a CudaWeight,
    pub up: &'a CudaWeight,
    pub down: &'a CudaWeight,
    /// `[tokens]`: `x · shared_expert_gateᵀ`.
    pub gate_logits: &'a CudaBuf,
}

pub(super) struct Kernels {
    route: CudaFunction,
    gate_up: CudaFunction,
    down_sum: CudaFunction,
    bucket: CudaFunction,
    /// `moe_mma_*`: [rows of a multiple of 8 columns, any rows].
    mma_gate_up: [CudaFunction; 2],
    mma_down: [CudaFunction; 2],
    combine: CudaFunction,
    sigmoid_gated: CudaFunction,
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        Ok(Kernels {
            route: f("moe_route")?,
            gate_up: f("moe_gate_up")?,
            down_sum: f("moe_down_sum")?,
            bucket: f("moe_bucket")?,
            mma_gate_up: [f("moe_mma_gate_up_al")?, f("moe_mma_gate_up_any")?],
            mma_down: [f("moe_mma_down_al")?, f("moe_mma_down_any")?],
            combine: f("moe_combine")?,
            sigmoid_gated: f("add_sigmoid_gated")?,
        })
    }

    /// Whether [`Kernels::experts`] takes these experts: at most [`MAX_EXPERTS`] of one shape,
    /// `top_k` in 1..=[`MAX_TOP_K`] and no more than the experts, and either all bf16 or all
    /// packed (gate and up of one format, down of any).
    pub fn supports(experts: &Experts<'_>) -> bool {
        let (n, top_k) = (experts.gate.len(), experts.top_k);
        let Some(first) = experts.gate.first() else { return false };
        let (inter, hidden) = (first.rows(), first.cols());
        let Some(down) = experts.down.first() else { return false };
        let kinds_fit = match (first.dtype(), down.dtype()) {
            (DType::BF16, DType::BF16) => true,
            (g, d) => {
                quant::has_kernels(g)
                    && quant::has_kernels(d)
                    && hidden.is_multiple_of(32)
                    && inter.is_multiple_of(32)
            }
        };
        let shaped = |ws: &[CudaWeight], dtype: DType, rows: usize, cols: usize| {
            ws.len() == n && ws.iter().all(|w| w.dtype() == dtype && w.rows() == rows && w.cols() == cols)
        };
        (1..=MAX_EXPERTS).contains(&n)
            && (1..=MAX_TOP_K.min(n)).contains(&top_k)
            && inter > 0
            && hidden > 0
            && inter <= i32::MAX as usize
            && hidden <= i32::MAX as usize
            && kinds_fit
            && shaped(experts.gate, first.dtype(), inter, hidden)
            && shaped(experts.up, first.dtype(), inter, hidden)
            && shaped(experts.down, down.dtype(), hidden, inter)
    }

    /// Device bytes a prompt (more than [`PER_PICK_MAX_TOKENS`] tokens) of these experts
    /// allocates besides its activations: packed experts are dequantized to bf16 for the
    /// tensor-core kernels, every expert of the layer into one scratch (1.5 GiB for the
    /// 35B-A3B shape, 4.5 GiB for the 122B-A10B); bf16 experts need none.
    pub fn prompt_scratch_bytes(experts: &Experts<'_>) -> usize {
        match (experts.gate.first(), experts.down.first()) {
            (Some(g), Some(d)) if Self::supports(experts) && g.dtype() != DType::BF16 => {
                experts.gate.len() * 2 * (2 * g.rows() * g.cols() + d.rows() * d.cols())
            }
            _ => 0,
        }
    }

    /// Whether [`Kernels::experts`] can run this shared expert among `experts` (which it
    /// [`Kernels::supports`]): a free slot in the tables, and the routed experts' formats and
    /// shapes (its width the routed experts' width, as in the published MoE shapes).
    pub fn supports_shared(
        experts: &Experts<'_>,
        gate: &CudaWeight,
        up: &CudaWeight,
        down: &CudaWeight,
    ) -> bool {
        let (g, d) = (&experts.gate[0], &experts.down[0]);
        let like = |w: &CudaWeight, model: &CudaWeight| {
            w.dtype() == model.dtype() && w.rows() == model.rows() && w.cols() == model.cols()
        };
        experts.gate.len() < MAX_EXPERTS && like(gate, g) && like(up, g) && like(down, d)
    }

    /// `out[t] = Σ weight · expert(x[t])` over the `experts.top_k` experts `router_logits[t]` picks, for
    /// `tokens` rows (`x`, `out`: `[tokens, hidden]`), then `+ sigmoid(gate logit) ·
    /// shared(x[t])` with a `shared` expert; `q` runs packed experts. The caller checked
    /// [`Kernels::supports`] (and [`Kernels::supports_shared`]); a shared expert runs only in
    /// decode-sized calls (at most [`PER_PICK_MAX_TOKENS`] tokens).
    #[allow(clippy::too_many_arguments)]
    pub fn experts(
        &self,
        dev: &Device,
        q: &quant::Kernels,
        x: &CudaBuf,
        tokens: usize,
        router_logits: &CudaBuf,
        experts: &Experts<'_>,
        shared: Option<SharedExpert<'_>>,
        out: &mut CudaBuf,
    ) {
        let top_k = experts.top_k;
        // The caller checked (`CudaBackend::moe_experts`): not walked again for every call.
        debug_assert!(Self::supports(experts), "moe: unsupported experts or top_k {top_k}");
        debug_assert!(shared.as_ref().is_none_or(|s| Self::supports_shared(experts, s.gate, s.up, s.down)));
        let n = experts.gate.len();
        let (inter, hidden) = (experts.gate[0].rows(), experts.gate[0].cols());
        // The shared expert is pick `top_k` of each token and expert `n` of the tables.
        let (slots, per_token) = if shared.is_some() { (n + 1, top_k + 1) } else { (n, top_k) };
        let picks = tokens * per_token;
        assert!(x.len() >= tokens * hidden, "moe: x holds {} floats, not [{tokens}, {hidden}]", x.len());
        assert!(
            router_logits.len() >= tokens * n,
            "moe: the router logits hold {} floats",
            router_logits.len()
        );
        assert!(
            out.len() >= tokens * hidden,
            "moe: out holds {} floats, not [{tokens}, {hidden}]",
            out.len()
        );
        if let Some(s) = &shared {
            assert!(
                tokens <= PER_PICK_MAX_TOKENS,
                "moe: a shared expert as a pick in a call of {tokens} tokens"
            );
            assert!(
                s.gate_logits.len() >= tokens,
                "moe: {} shared gate logits for {tokens} tokens",
                s.gate_logits.len()
            );
        }
        if tokens == 0 {
            return;
        }
        let alloc = |floats: usize| dev.alloc(floats).unwrap_or_else(|e| panic!("{e}"));
        // Ids are i32 in an f32 buffer of as many elements.
        let (ids, weights, act) = (alloc(picks), alloc(picks), alloc(picks * inter));
        let (t32, n32, i32_, h32) = (tokens as i32, n as i32, inter as i32, hidden as i32);
        // The kernels after the router take `k` as the picks per token.
        let k32 = per_token as i32;
        let shared_logits = shared.as_ref().map_or(0, |s| s.gate_logits.ptr());
        dev.launch(
            "moe_route",
            &self.route,
            (tokens.div_ceil(ROUTE_WARPS) as u32, 1, 1),
            ((ROUTE_WARPS * 32) as u32, 1, 1),
            0,
            kernel_args![
                router_logits.ptr(),
                t32,
                n32,
                top_k as i32,
                shared_logits,
                ids.ptr(),
                weights.ptr()
            ],
        );
        let gate_up = MoePair {
            a: table(experts.gate, shared.as_ref().map(|s| s.gate)),
            b: table(experts.up, shared.as_ref().map(|s| s.up)),
        };
        let down = MoeTable { w: table(experts.down, shared.as_ref().map(|s| s.down)) };
        let (gate_dtype, down_dtype) = (experts.gate[0].dtype(), experts.down[0].dtype());
        if tokens <= PER_PICK_MAX_TOKENS && gate_dtype == DType::BF16 {
            // A decode batch's picks, each its own blocks: no listing by expert needed.
            dev.launch(
                "moe_gate_up",
                &self.gate_up,
                (inter.div_ceil(WARPS) as u32, picks as u32, 1),
                ((WARPS * 32) as u32, 1, 1),
                0,
                kernel_args![gate_up, x.ptr(), ids.ptr(), k32, i32_, h32, act.ptr()],
            );
            dev.launch(
                "moe_down_sum",
                &self.down_sum,
                (hidden.div_ceil(WARPS) as u32, tokens as u32, 1),
                ((WARPS * 32) as u32, 1, 1),
                0,
                kernel_args![down, act.ptr(), ids.ptr(), weights.ptr(), k32, i32_, h32, out.ptr()],
            );
            return;
        }
        // Each picked expert once over all its picks, its weights read once per 64 picks (bf16,
        // tensor cores) or once per call (packed).
        let (count, active, start, members) = (alloc(1), alloc(slots), alloc(slots + 1), alloc(picks));
        let y = alloc(picks * hidden);
        dev.launch(
            "moe_bucket",
            &self.bucket,
            (1, 1, 1),
            (1024, 1, 1),
            0,
            kernel_args![
                ids.ptr(),
                picks as i32,
                slots as i32,
                count.ptr(),
                active.ptr(),
                start.ptr(),
                members.ptr()
            ],
        );
        let most = picks.min(slots) as u32;
        let block = ((WARPS * 32) as u32, 1, 1);
        let listing = MoeListing {
            active_count: count.ptr(),
            active: active.ptr(),
            start: start.ptr(),
            members: members.ptr(),
        };
        // A warp per 16 rows, the picks of an expert 64 at a time on the tensor cores.
        let tensor_cores = |gate_up: MoePair, down: MoeTable| {
            let rows_per_block = 16 * WARPS;
            let variant = |cols: usize| if cols.is_multiple_of(8) { 0 } else { 1 };
            dev.launch(
                "moe_mma_gate_up",
                &self.mma_gate_up[variant(hidden)],
                (inter.div_ceil(rows_per_block) as u32, most, 1),
                block,
                0,
                kernel_args![gate_up, x.ptr(), k32, i32_, h32, listing, act.ptr()],
            );
            dev.launch(
                "moe_mma_down",
                &self.mma_down[variant(inter)],
                (hidden.div_ceil(rows_per_block) as u32, most, 1),
                block,
                0,
                kernel_args![down, act.ptr(), i32_, h32, listing, y.ptr()],
            );
        };
        if gate_dtype == DType::BF16 {
            tensor_cores(gate_up, down);
        } else if tokens > PER_PICK_MAX_TOKENS {
            // A prompt's packed experts: the picked ones dequantized to bf16 (the CPU's values,
            // rounded to nearest even, as the dense packed prompt GEMMs take them), then the
            // tensor-core kernels. Expert e of a projection at e * rows * cols in its scratch.
            let dequantized = |ws: &[CudaWeight], rows: usize, cols: usize| -> CudaWeight {
                let dense = CudaWeight::scratch_bf16(dev, n * rows, cols).unwrap_or_else(|e| panic!("{e}"));
                let src = MoeTable { w: table(ws, None) };
                let blocks_per_expert = (rows * cols).div_ceil(1 << 16) as u32;
                dev.launch(
                    "dequant_moe_bf16",
                    q.moe_dequant_kernel(ws[0].dtype()),
                    (blocks_per_expert, most, 1),
                    (256, 1, 1),
                    0,
                    kernel_args![src, listing, dense.ptr(), rows as i32, cols as i32],
                );
                dense
            };
            let (g, u, d) = (
                dequantized(experts.gate, inter, hidden),
                dequantized(experts.up, inter, hidden),
                dequantized(experts.down, hidden, inter),
            );
            let at = |w: &CudaWeight, rows: usize, cols: usize| -> [u64; MAX_EXPERTS] {
                std::array::from_fn(|e| if e < n { w.ptr() + (e * rows * cols * 2) as u64 } else { 0 })
            };
            tensor_cores(
                MoePair { a: at(&g, inter, hidden), b: at(&u, inter, hidden) },
                MoeTable { w: at(&d, hidden, inter) },
            );
        } else {
            // A decode batch's packed experts: activations quantized per 32 as the packed GEMVs
            // take them; a warp per row.
            let (gate_grid, down_grid) =
                ((inter.div_ceil(WARPS) as u32, most, 1), (hidden.div_ceil(WARPS) as u32, most, 1));
            let xq = q.quantize(dev, x, tokens, hidden);
            dev.launch(
                "qmoe_gate_up",
                q.moe_kernel(gate_dtype, 0),
                gate_grid,
                block,
                0,
                kernel_args![gate_up, xq.q, xq.d, xq.s, k32, i32_, h32, listing, act.ptr()],
            );
            let aq = q.quantize(dev, &act, picks, inter);
            dev.launch(
                "qmoe_down",
                q.moe_kernel(down_dtype, 1),
                down_grid,
                block,
                0,
                kernel_args![down, aq.q, aq.d, aq.s, i32_, h32, listing, y.ptr()],
            );
        }
        dev.launch(
            "moe_combine",
            &self.combine,
            (dev.grid_for(tokens * hidden, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![y.ptr(), weights.ptr(), k32, t32, h32, out.ptr()],
        );
    }

    /// `out[r] += sigmoid(gate[r]) * x[r]` for `rows` rows of `dim`.
    pub fn add_sigmoid_gated(
        &self,
        dev: &Device,
        out: &mut CudaBuf,
        x: &CudaBuf,
        gate: &CudaBuf,
        rows: usize,
        dim: usize,
    ) {
        let n = rows * dim;
        assert!(out.len() >= n && x.len() >= n, "add_sigmoid_gated: buffers smaller than [{rows}, {dim}]");
        assert!(gate.len() >= rows, "add_sigmoid_gated: {} gate logits for {rows} rows", gate.len());
        assert!(rows <= i32::MAX as usize && dim <= i32::MAX as usize);
        if n == 0 {
            return;
        }
        dev.launch(
            "add_sigmoid_gated",
            &self.sigmoid_gated,
            (dev.grid_for(n, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![out.ptr(), x.ptr(), gate.ptr(), rows as i32, dim as i32],
        );
    }
}
