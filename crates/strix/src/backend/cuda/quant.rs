//! Matmuls and the embedding gather on weights kept in GGML block formats (Q8_0, Q4_0, Q4_K,
//! Q6_K) on the device; the kernels are in `quant.cu`, which also describes the device layout
//! that [`repack`] makes on upload (the blocks' own bytes, regrouped so every weight load is
//! an aligned 16-byte load).
//!
//! - **Decode GEMV** (`qgemv_*`): the activations are first quantized to int8 per 32 values
//!   (`quantize_x`, scale kept in f32), then each lane streams 16-byte units of packed weights,
//!   unpacks them in registers and meets them with the activations in `dp4a`s; the integer sum
//!   of a block is exact and its float contribution is added in an order fixed by the shape, so
//!   the batched form (`qgemv_rows_*`, `QG_NT` tokens per block) gives every token bitwise the
//!   one-token result. A warp takes 1, 2 or 4 rows ([`Kernels::rows_index`] picks per launch,
//!   [`set_qgemv_rows`] forces it for tuning), so each lane has several 16-byte weight loads
//!   in flight and each activation unit serves every row. Why int8 activations: a 4-bit weight unpacked to f32 costs a convert
//!   and an FMA per weight per token, which at the H200's bandwidth is about the issue rate of
//!   the SM at batch 1 and far past it at batch 16; `dp4a` does 4 weights in one instruction.
//! - **Tensor-core GEMV** (`qmma_*`, the decode matmuls of every batch size where the GEMVs run
//!   on the tensor cores, as the server's do, on widths of whole 256-column stages): the same
//!   int8 activations meet the packed weights in `mma.sync` (m16n8k32; m16n8k16 for Q6_K), a
//!   block streaming 128 rows and up to 64 tokens through a `cp.async` ring of shared-memory
//!   stages, each 32-column group's exact integer sums scaled into f32 in a shape-fixed order,
//!   K split over blocks by the shape alone ([`qm_nsplit`]) and the ranges added in order as the
//!   bf16 `gemv_gs` does (sharing its workspace). 64 tokens read the weights once instead of
//!   eight times (9B layer launches at batch 64: 3.5–4.8× faster than dp4a, measured on an
//!   H200), but one token streams at 45–60 % of the bandwidth where the dp4a GEMV reaches
//!   73–97 %. For Q4_0 and Q4_K one token takes `qmv1_*` instead, the same arithmetic on the
//!   CUDA cores (integer sums in parallel over lanes, exact in any order; each row's float
//!   chain in group order), bitwise the same and 8–22 % faster there ([`ONE_TOKEN`]). The sums
//!   are not the dp4a kernels', so a backend uses one kind for every batch size of a matrix
//!   ([`Kernels::mma_takes`]).
//! - **Dequantizing warpgroup GEMV** (`qwg_*`, Hopper only, opt-in: [`PackedMma::Bf16`],
//!   `STRIX_CUDA_PACKED_MMA=bf16`): the same launches' products with each stage's packed
//!   weights dequantized to bf16 in shared memory and met with bf16-rounded activations in
//!   `wgmma`, the bf16 GEMV's structure. Measured on an H200, 9B at batch 1 / 16 / 64 (aggregate
//!   tok/s of whole decode steps): Q4_K_M 141 / 2,047 / 5,036 against the int8 kernels' 320 /
//!   2,837 / 3,913, Q4_0 165 / 2,132 / 5,437 against 359 / 3,518 / 4,706, Q8_0 (before the
//!   conversion-free dequantization) 116 / 1,714 / 4,335 against 293 / 3,391 / 4,827: faster at
//!   64 streams for 4-bit weights, slower below. Its dequantization, not its MMAs or its bytes,
//!   bounds it (a step at batch 1 costs 6–7 ms against 3 for the int8 kernels), so it stays
//!   an option for servers that run full batches until it is fed by more warps.
//! - **Activations quantized by their producer**: a packed GEMV of one token usually reads the
//!   output of a row norm, of the MLP's gate/up GEMV with the SwiGLU, of the delta rule or of
//!   the attention merge.
//!   When packed weights are loaded, those kernels' one-token forms also write their output
//!   quantized (the same int8 values, scales and sums `quantize_x` would make of it:
//!   `quantize_group32` in prelude.cu) into a side buffer that the output buffer carries
//!   from then on ([`CudaBuf::attach_quantized`]); the next op, if it is a one-token packed
//!   GEMV of that very buffer, reads the side buffer ([`CudaBuf::quantized`], passed down as
//!   `pre`) and skips `quantize_x` (a kernel and a launch boundary; every packed GEMV of a 9B
//!   step). The one-token MLP runs its gate and up projections and the SwiGLU as one kernel
//!   ([`Kernels::gemv_glu`]), so its down GEMV reads that kernel's quantization. The copy is
//!   current only while [`Device::work_seq`] has not moved since the producer's kernel, i.e.
//!   no op, kernel or copy ran in between (anything that could have rewritten the buffer;
//!   allocating scratch does not count). It is dropped with its buffer, so a recorded decode
//!   step's go into the recording with the step's scratch. `CudaOptions::producer_quant` off
//!   (or [`Kernels::set_producer_quant`]) keeps the separate `quantize_x` everywhere.
//! - **Prefill** (more than [`GEMV_MAX_TOKENS`] tokens): bands of weight rows are dequantized
//!   to bf16 (exactly the CPU's dequantized values, rounded to nearest even) into a scratch
//!   buffer and multiplied on cuBLAS's tensor cores, band by band into the output; with the
//!   fallback policy (or no cuBLAS), the whole matrix is dequantized for the tiled kernel.
//! - **Embedding**: the rows of the packed table dequantized to f32, bit-identical to the CPU's
//!   dequantization (a tied lm_head is the same packed weight through the GEMV).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};

use super::compile;
use super::device::{cuda_error, kernel_args, CudaBuf, CudaWeight, Device, XQuant};
use super::matmul::{self, Bf16Input, GemmPath, Gemms, SplitWorkspace, GS_BM};
use super::packed::planes;
use crate::error::Result;
use crate::tensor::DType;

pub(super) const SOURCE: &str =
    concat!(include_str!("mma.cuh"), "\n#line 1 \"quant.cu\"\n", include_str!("quant.cu"));

/// Matmuls of at most this many tokens run on the batched GEMV (one pass over the packed
/// weights); more go through dequantization and a tensor-core GEMM.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Tokens per block of the batched GEMV (`QG_NT`).
const QG_NT: usize = 8;
/// Warps per GEMV block (`QG_WARPS`).
const QG_WARPS: usize = 8;
/// Elements of weight dequantized to bf16 at a time on the prefill path (64 MB of scratch).
const BAND_ELEMS: usize = 32 << 20;

/// Columns of one stage of the tensor-core GEMV (`QM_BK`, one k-quant super-block): it takes
/// matrices whose width is a whole number of stages.
const QM_BK: usize = 256;
/// Threads of a tensor-core GEMV block (`QM_THREADS`).
const QM_THREADS: u32 = 128;
/// The formats (in [`FORMATS`] order) whose one token runs on `qmv1_*` rather than `qmma_*`
/// (bitwise the same): where it is faster. H200, graph-replayed µs of a 9B layer's launches and
/// the lm_head at batch 1, qmma / qmv1: Q4_0 276 / 255, Q4_K 366 / 284, Q8_0 346 / 372, Q6_K
/// 452 / 665 (the qmv1 forms of those two were dropped).
const ONE_TOKEN: [bool; 4] = [false, true, true, false];
/// Warps of a one-token block (`QV_WARPS`): row groups of four rows × the K ranges.
const QV_WARPS: usize = 8;
/// Tokens one tensor-core GEMV launch takes (a larger batch goes in groups of this many).
const QM_TOKENS: usize = 64;
/// n-tiles of 8 tokens of its compiled configurations (`qmma_*_n{NT}`): a launch of up to 8,
/// 16, 32 and 64 tokens takes the first, second, third and fourth.
const QM_NT: [usize; 4] = [1, 2, 4, 8];
/// Ring depth of each configuration by format (in [`FORMATS`] order), as `QMMA_ALL`
/// instantiates them in quant.cu: the deepest ring that leaves room for two blocks an SM.
const QM_STAGES: [[usize; 4]; 4] = [[3, 2, 2, 2], [5, 4, 4, 3], [5, 4, 3, 2], [3, 3, 3, 2]];

/// Bytes of one ring slot of the tensor-core GEMV (`QmStage<F, NT>::BYTES`): the stage's
/// weight quants and scales of 128 rows, and its activations (int8, scales, Q4_K's sums).
fn qm_stage_bytes(dtype: DType, nt: usize) -> usize {
    let (quant_bytes, sums) = match dtype {
        DType::Q8_0 => (256, false),
        DType::Q4_0 => (128, false),
        DType::Q4_K => (128, true),
        DType::Q6_K => (192, false),
        _ => unreachable!("not a block format"),
    };
    let tokens = nt * 8;
    GS_BM * (quant_bytes + 16) + tokens * (QM_BK + 32 + if sums { 64 } else { 0 })
}

/// Dynamic shared memory of format `fi`'s configuration `cfg`.
fn qm_smem_bytes(fi: usize, cfg: usize) -> usize {
    QM_STAGES[fi][cfg] * qm_stage_bytes(FORMATS[fi].0, QM_NT[cfg])
}

/// Which arithmetic a packed decode batch runs on the tensor cores
/// (`CudaOptions::packed_mma`; the kernels' doc in quant.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedMma {
    /// `qmma_*`: activations quantized to int8 per 32 values meet the packed integers in
    /// `mma.sync`, each group's integer sums scaled into f32 on the CUDA cores.
    Int8,
    /// `qwg_*` (Hopper): each stage's weights dequantized to bf16 in shared memory (the CPU's
    /// values, rounded to nearest even) and multiplied by bf16-rounded activations in `wgmma`.
    Bf16,
}

/// Ring depth of the dequantizing warpgroup GEMV (`QWG_ALL` in quant.cu) at N = 8, 16, 32,
/// 64 tokens: the deepest ring that leaves room for two blocks an SM.
const QWG_STAGES: [usize; 4] = [6, 5, 4, 4];
/// The warpgroup GEMV's N of each configuration (`qwg_*_n{N}`).
const QWG_N: [usize; 4] = [8, 16, 32, 64];

/// Packed bytes of one stage of 128 rows of format `fi` (`qwg_packed_bytes`: quants and scales,
/// rounded up to 1 KB).
fn qwg_packed_bytes(fi: usize) -> usize {
    let per_row = [64 + 4, 32 + 4, 32 + 16, 48 + 8][fi];
    (GS_BM * per_row).next_multiple_of(1024)
}

/// Dynamic shared memory of the warpgroup GEMV of format `fi`, configuration `cfg`: two 16 KB
/// A tiles, the ring of slots (x's tiles and the packed stage) and 1 KB to align them.
fn qwg_smem_bytes(fi: usize, cfg: usize) -> usize {
    2 * GS_BM * 128 + QWG_STAGES[cfg] * (QWG_N[cfg] * 128 + qwg_packed_bytes(fi)) + 1024
}

/// The dequantizing warpgroup GEMVs: `[format]` x-tile kernels and `[format][config]` GEMVs.
struct Qwg {
    split_x: Vec<CudaFunction>,
    gemv: Vec<[CudaFunction; 4]>,
}

/// The tensor-core configuration for a launch of `tokens` (at most [`QM_TOKENS`]).
fn qm_config(tokens: usize) -> usize {
    match tokens {
        0..=8 => 0,
        9..=16 => 1,
        17..=32 => 2,
        _ => 3,
    }
}

/// Contiguous K ranges the tensor-core GEMV splits a `rows` × `cols` matrix into (1, 2, 4 or
/// 8): the fewest that give every SM a block, keeping at least two stages per range. From the
/// shape alone: it fixes each output's order of summation, which must not change with the batch.
fn qm_nsplit(rows: usize, cols: usize, sm_count: usize) -> usize {
    let (blocks, stages) = (rows.div_ceil(GS_BM), cols / QM_BK);
    let mut split = 1;
    while split < 8 && blocks * split < sm_count && stages >= 4 * split {
        split *= 2;
    }
    split
}

/// The compiled rows-a-warp choices of the one-token GEMV (`qgemv_*_r{R}`).
const ROWS_PER_WARP: [usize; 3] = [1, 2, 4];

/// Blocks per SM the one-token kernel with `ROWS_PER_WARP[ri]` rows a warp is compiled to fit
/// at least (its `__launch_bounds__` in quant.cu), where the driver does not say.
fn min_blocks_per_sm(dtype: DType, ri: usize) -> usize {
    match (dtype, ri) {
        (_, 0) => 4,
        (DType::Q6_K, 1) => 2,
        (_, 1) => 3,
        (DType::Q6_K, _) => 1,
        _ => 2,
    }
}

/// Rows a warp of the batched GEMV (`QGEMV_ALL`'s RB in quant.cu).
fn batch_rows_per_warp(dtype: DType) -> usize {
    if dtype == DType::Q8_0 {
        4
    } else {
        2
    }
}

/// The one-token GEMV's rows a warp forced for every launch (`1 + index` into
/// [`ROWS_PER_WARP`]), or 0: chosen per launch by [`Kernels::rows_index`].
static QGEMV_ROWS_FORCED: AtomicUsize = AtomicUsize::new(0);

/// Forces the one-token packed GEMV's rows a warp (1, 2 or 4) for every launch, for tuning;
/// `None` restores the choice by shape. False, and nothing changes, for a value that is not
/// compiled. Results are bitwise the same whatever the rows a warp.
pub fn set_qgemv_rows(rows: Option<usize>) -> bool {
    let v = match rows {
        None => 0,
        Some(r) => match ROWS_PER_WARP.iter().position(|&k| k == r) {
            Some(k) => 1 + k,
            None => return false,
        },
    };
    QGEMV_ROWS_FORCED.store(v, Ordering::Relaxed);
    true
}

/// What a quantized matmul ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum QRan {
    /// One token, `qgemv_*`.
    Gemv,
    /// Several tokens on the batched `qgemv_rows_*`.
    GemvRows,
    /// Any number of tokens on the tensor-core `qmma_*`.
    TensorCores,
    /// Dequantized bands into the bf16 GEMM that ran.
    Dequant(matmul::Ran),
}

/// The formats in the order of the kernel tables.
const FORMATS: [(DType, &str); 4] =
    [(DType::Q8_0, "q8_0"), (DType::Q4_0, "q4_0"), (DType::Q4_K, "q4_k"), (DType::Q6_K, "q6_k")];

/// Whether this module's kernels take weights packed as `dtype`.
pub(super) fn has_kernels(dtype: DType) -> bool {
    FORMATS.iter().any(|f| f.0 == dtype)
}

fn format_index(dtype: DType) -> usize {
    FORMATS
        .iter()
        .position(|f| f.0 == dtype)
        .unwrap_or_else(|| panic!("cuda: no packed kernels for {}", dtype.name()))
}

/// Columns per GEMV unit (one lane's load) of each format.
fn unit_cols(dtype: DType) -> usize {
    match dtype {
        DType::Q8_0 => 16,
        DType::Q4_0 | DType::Q4_K => 32,
        _ => 64,
    }
}

/// Where a packed weight's scale planes start: after every row's quants ([`repack`]).
fn scales_ptr(w: &CudaWeight) -> u64 {
    w.ptr() + (w.rows() * planes(w.dtype(), w.cols()).0) as u64
}

pub(super) struct Kernels {
    quantize_x: CudaFunction,
    /// `[format][rows a warp index]` one-token GEMVs, single and multi-segment.
    gemv: Vec<[CudaFunction; 3]>,
    gemv_multi: Vec<[CudaFunction; 3]>,
    /// Blocks of `gemv` / `gemv_multi` resident on one SM, `[format][rows a warp index]`.
    resident: Vec<[usize; 3]>,
    resident_multi: Vec<[usize; 3]>,
    /// `[format]` batched GEMVs, single and multi-segment.
    gemv_rows: Vec<CudaFunction>,
    gemv_multi_rows: Vec<CudaFunction>,
    /// `[format]` one-token gate/up GEMVs with the SwiGLU and its quantization.
    gemv_glu: Vec<CudaFunction>,
    /// `[format]` a MoE block's grouped expert kernels, gate/up with the SwiGLU and down
    /// (`qmoe_*`, driven by `moe.rs`).
    moe: Vec<[CudaFunction; 2]>,
    /// `dequant_moe_bf16_*`: a MoE layer's picked experts as bf16 (a prompt's, for `moe.rs`).
    moe_dequant: Vec<CudaFunction>,
    dequant: Vec<CudaFunction>,
    embed: Vec<CudaFunction>,
    /// `[format][configuration]` tensor-core GEMVs (`qmma_*`), where the device has the shared
    /// memory they ask for.
    qmma: Option<Vec<[CudaFunction; 4]>>,
    /// `[format]` one-token kernels on `qmma_*`'s arithmetic (`qmv1_*`), loaded with them for
    /// the formats in [`ONE_TOKEN`].
    qmv1: Vec<Option<CudaFunction>>,
    /// The dequantizing warpgroup GEMVs, on Hopper (sm_90a) where their shared memory fits.
    qwg: Option<Qwg>,
    /// [`PackedMma`] as `u8` (0 int8, 1 bf16): which a decode batch runs.
    packed_mma: AtomicU8,
    sm_count: usize,
    /// Producers quantize (`CudaOptions::producer_quant`, default on)...
    producer_quant: AtomicBool,
    /// ...once a packed weight has been uploaded (no cost for bf16 models).
    packed_loaded: AtomicBool,
}

// `QG_MAX_SEGS`: weights one fused GEMV launch takes (as many as the bf16 one).
use matmul::MAX_SEGMENTS;

/// `QSegs` of `quant.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct QSegs {
    wq: [u64; MAX_SEGMENTS],
    ws: [u64; MAX_SEGMENTS],
    out: [u64; MAX_SEGMENTS],
    rows: [i32; MAX_SEGMENTS],
    block_end: [i32; MAX_SEGMENTS],
}

/// `QmSegs` of `quant.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct QmSegs {
    wq: [u64; MAX_SEGMENTS],
    ws: [u64; MAX_SEGMENTS],
    out: [u64; MAX_SEGMENTS],
    rows: [i32; MAX_SEGMENTS],
    unit_end: [i32; MAX_SEGMENTS],
    nsplit: [i32; MAX_SEGMENTS],
    pslot0: [i32; MAX_SEGMENTS],
}

/// Activations as a packed kernel reads them: the producer's quantization, borrowed from the
/// buffer that carries it, or `quantize_x`'s, made for this call.
pub(super) enum Activations<'a> {
    Producer(&'a XQuant),
    Made(XQuant),
}

impl std::ops::Deref for Activations<'_> {
    type Target = XQuant;
    fn deref(&self) -> &XQuant {
        match self {
            Activations::Producer(xq) => xq,
            Activations::Made(xq) => xq,
        }
    }
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>, dev: &Device) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        let by_rows = |prefix: &str| -> Result<[CudaFunction; 3]> {
            Ok([f(&format!("{prefix}1"))?, f(&format!("{prefix}2"))?, f(&format!("{prefix}4"))?])
        };
        let mut k = Kernels {
            quantize_x: f("quantize_x")?,
            gemv: Vec::new(),
            gemv_multi: Vec::new(),
            resident: Vec::new(),
            resident_multi: Vec::new(),
            gemv_rows: Vec::new(),
            gemv_multi_rows: Vec::new(),
            gemv_glu: Vec::new(),
            moe: Vec::new(),
            moe_dequant: Vec::new(),
            dequant: Vec::new(),
            embed: Vec::new(),
            qmma: None,
            qmv1: Vec::new(),
            qwg: None,
            packed_mma: AtomicU8::new(0),
            sm_count: dev.sm_count as usize,
            producer_quant: AtomicBool::new(true),
            packed_loaded: AtomicBool::new(false),
        };
        for (dtype, name) in FORMATS {
            k.gemv.push(by_rows(&format!("qgemv_{name}_r"))?);
            k.gemv_multi.push(by_rows(&format!("qgemv_multi_{name}_r"))?);
            let resident = |fs: &[CudaFunction; 3]| -> [usize; 3] {
                std::array::from_fn(|ri| {
                    fs[ri]
                        .occupancy_max_active_blocks_per_multiprocessor(QG_WARPS as u32 * 32, 0, None)
                        .map_or(0, |b| b as usize)
                        .max(min_blocks_per_sm(dtype, ri))
                })
            };
            k.resident.push(resident(k.gemv.last().expect("pushed")));
            k.resident_multi.push(resident(k.gemv_multi.last().expect("pushed")));
            k.gemv_rows.push(f(&format!("qgemv_rows_{name}"))?);
            k.gemv_multi_rows.push(f(&format!("qgemv_multi_rows_{name}"))?);
            k.gemv_glu.push(f(&format!("qgemv_glu_{name}"))?);
            k.moe.push([f(&format!("qmoe_gate_up_{name}"))?, f(&format!("qmoe_down_{name}"))?]);
            k.moe_dequant.push(f(&format!("dequant_moe_bf16_{name}"))?);
            k.dequant.push(f(&format!("dequant_bf16_{name}"))?);
            k.embed.push(f(&format!("embed_{name}"))?);
        }
        let fits = (0..FORMATS.len())
            .all(|fi| (0..QM_NT.len()).all(|c| qm_smem_bytes(fi, c) <= dev.max_smem_optin as usize));
        if fits {
            // Each format's four configurations, `kernel(name, c)` with `smem(fi, c)` bytes of
            // dynamic shared memory opted in.
            let configs = |kernel: &dyn Fn(&str, usize) -> String,
                           smem: &dyn Fn(usize, usize) -> usize|
             -> Result<Vec<[CudaFunction; 4]>> {
                let mut all = Vec::new();
                for (fi, (_, name)) in FORMATS.iter().enumerate() {
                    let fs: Vec<CudaFunction> = (0..4)
                        .map(|c| -> Result<CudaFunction> {
                            let kernel = kernel(name, c);
                            let func = f(&kernel)?;
                            func.set_attribute(
                                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                smem(fi, c) as i32,
                            )
                            .map_err(|e| cuda_error(format!("{kernel} shared memory opt-in: {e}")))?;
                            Ok(func)
                        })
                        .collect::<Result<_>>()?;
                    all.push(fs.try_into().unwrap_or_else(|_| unreachable!("one kernel a configuration")));
                }
                Ok(all)
            };
            let qmma = configs(&|name, c| format!("qmma_{name}_n{}", QM_NT[c]), &qm_smem_bytes)?;
            k.qmma = Some(qmma);
            k.qmv1 = FORMATS
                .iter()
                .zip(ONE_TOKEN)
                .map(|((_, name), has)| has.then(|| f(&format!("qmv1_{name}"))).transpose())
                .collect::<Result<_>>()?;
            let fits = (0..FORMATS.len())
                .all(|fi| (0..QWG_N.len()).all(|c| qwg_smem_bytes(fi, c) <= dev.max_smem_optin as usize));
            if compile::device_arch(dev.cc).ends_with("90a") && fits {
                let gemv = configs(&|name, c| format!("qwg_{name}_n{}", QWG_N[c]), &qwg_smem_bytes)?;
                let split_x = FORMATS
                    .iter()
                    .map(|(_, name)| f(&format!("qwg_split_x_{name}")))
                    .collect::<Result<_>>()?;
                k.qwg = Some(Qwg { split_x, gemv });
            }
        }
        Ok(k)
    }

    /// Chooses the packed decode batches' tensor-core arithmetic; false (and nothing changes)
    /// for a warpgroup one where its kernels did not load.
    pub fn set_packed_mma(&self, mma: PackedMma) -> bool {
        if mma != PackedMma::Int8 && self.qwg.is_none() {
            return false;
        }
        self.packed_mma.store(mma as u8, Ordering::Relaxed);
        true
    }

    pub fn packed_mma(&self) -> PackedMma {
        match self.packed_mma.load(Ordering::Relaxed) {
            0 => PackedMma::Int8,
            _ => PackedMma::Bf16,
        }
    }

    /// What the tensor-core GEMV reads besides `x`: `x` quantized to int8 for that arithmetic
    /// (`pre`, the producer's quantization, if any), nothing for the warpgroup GEMVs.
    fn mma_input<'a>(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        cols: usize,
        pre: Option<&'a XQuant>,
    ) -> Option<Activations<'a>> {
        self.qwg_chosen().is_none().then(|| self.quantize_x(dev, x, tokens, cols, pre))
    }

    /// The warpgroup GEMVs, when they are the chosen arithmetic.
    fn qwg_chosen(&self) -> Option<&Qwg> {
        match self.packed_mma() {
            PackedMma::Int8 => None,
            PackedMma::Bf16 => self.qwg.as_ref(),
        }
    }

    /// Whether the tensor-core GEMV takes `w`: its kernels loaded, and the width is a whole
    /// number of its 256-column stages (every Qwen3.5 matrix). Other packed matrices run on
    /// the dp4a GEMVs at every batch size.
    pub fn mma_takes(&self, w: &CudaWeight) -> bool {
        self.qmma.is_some() && w.dtype().is_quantized() && w.cols() >= QM_BK && w.cols().is_multiple_of(QM_BK)
    }

    /// `outs[j] = x · ws[j]ᵀ` on the tensor-core GEMV (weights of one format and width that
    /// [`Kernels::mma_takes`]) in the chosen arithmetic ([`PackedMma`]): one launch per group of
    /// [`QM_TOKENS`] tokens and of up to [`MAX_SEGMENTS`] weights whose partial sums fit the
    /// workspace; each weight split over K as it is alone. `xq`: `x` quantized, which the int8
    /// arithmetic reads ([`Kernels::mma_input`]). Returns the launches made.
    #[allow(clippy::too_many_arguments)]
    fn mma(
        &self,
        dev: &Device,
        x: &CudaBuf,
        xq: Option<&XQuant>,
        tokens: usize,
        ws: &[&CudaWeight],
        outs: &[u64],
        split: &SplitWorkspace,
    ) -> usize {
        let (dtype, cols) = (ws[0].dtype(), ws[0].cols());
        let fi = format_index(dtype);
        let qwg = self.qwg_chosen();
        if let (None, Some(xq), 1, true) = (qwg, xq, tokens, ONE_TOKEN[fi]) {
            return self.one_token(dev, xq, ws, outs);
        }
        // Launch groups: consecutive weights while they fit the segments and the slots.
        let nsplit_of = |rows: usize| match qwg {
            Some(_) => matmul::gs_nsplit(rows, cols, self.sm_count),
            None => qm_nsplit(rows, cols, self.sm_count),
        };
        let nsplits: Vec<usize> = ws.iter().map(|w| nsplit_of(w.rows())).collect();
        let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
        let (mut start, mut slots) = (0, 0);
        for (j, (w, &nsplit)) in ws.iter().zip(&nsplits).enumerate() {
            assert!(w.dtype() == dtype && w.cols() == cols && self.mma_takes(w), "qmma: weights do not fuse");
            let need = if nsplit > 1 { w.rows().div_ceil(GS_BM) * nsplit } else { 0 };
            assert!(need <= split.slots, "qmma: {need} partial slots, the workspace has {}", split.slots);
            if j > start && (j - start == MAX_SEGMENTS || slots + need > split.slots) {
                groups.push(start..j);
                (start, slots) = (j, 0);
            }
            slots += need;
        }
        groups.push(start..ws.len());
        // The warpgroup GEMV's x tiles (bf16, one per 64-column stage), sized for the first and
        // largest token group and reused by every group.
        let stages = cols / 64;
        let tiles = qwg.map(|_| {
            let bytes = stages * QWG_N[qm_config(tokens.min(QM_TOKENS))] * 128;
            dev.alloc(bytes / 4).unwrap_or_else(|e| panic!("{e}"))
        });
        let mut launches = 0;
        for g0 in (0..tokens).step_by(QM_TOKENS) {
            let n = QM_TOKENS.min(tokens - g0);
            let cfg = qm_config(n);
            if let (Some(q), Some(tiles)) = (qwg, &tiles) {
                let xp = x.ptr() + (g0 * cols * 4) as u64;
                dev.launch(
                    "qwg_split_x",
                    &q.split_x[fi],
                    (stages as u32, 1, 1),
                    (QM_THREADS, 1, 1),
                    0,
                    kernel_args![xp, n as i32, QWG_N[cfg] as i32, cols as i32, tiles.ptr()],
                );
            }
            for group in &groups {
                let mut segs = QmSegs::default();
                let (mut units, mut slot) = ([0; MAX_SEGMENTS], 0);
                for (k, j) in group.clone().enumerate() {
                    let (w, nsplit) = (ws[j], nsplits[j]);
                    units[k] = w.rows().div_ceil(GS_BM) * nsplit;
                    segs.wq[k] = w.ptr();
                    segs.ws[k] = scales_ptr(w);
                    segs.out[k] = outs[j] + (g0 * w.rows() * 4) as u64;
                    segs.rows[k] = w.rows() as i32;
                    segs.nsplit[k] = nsplit as i32;
                    if nsplit > 1 {
                        segs.pslot0[k] = slot as i32;
                        slot += units[k];
                    }
                }
                let total;
                (segs.unit_end, total) = matmul::segment_ends(units[..group.len()].iter().copied());
                assert!(total <= i32::MAX as usize, "qmma: {total} blocks");
                if let (Some(q), Some(tiles)) = (qwg, &tiles) {
                    dev.launch(
                        "qwg",
                        &q.gemv[fi][cfg],
                        (total as u32, 1, 1),
                        (QM_THREADS, 1, 1),
                        qwg_smem_bytes(fi, cfg) as u32,
                        kernel_args![
                            segs,
                            tiles.ptr(),
                            cols as i32,
                            n as i32,
                            split.partials,
                            split.counters
                        ],
                    );
                } else {
                    let xq = xq.expect("the int8 arithmetic reads x quantized");
                    let (xq_at, xd_at, xs_at) = (
                        xq.q + (g0 * cols) as u64,
                        xq.d + (g0 * cols / 32 * 4) as u64,
                        xq.s + (g0 * cols / 16 * 4) as u64,
                    );
                    dev.launch(
                        "qmma",
                        &self.qmma.as_ref().expect("mma_takes checked that the kernels loaded")[fi][cfg],
                        (total as u32, 1, 1),
                        (QM_THREADS, 1, 1),
                        qm_smem_bytes(fi, cfg) as u32,
                        kernel_args![
                            segs,
                            xq_at,
                            xd_at,
                            xs_at,
                            cols as i32,
                            n as i32,
                            split.partials,
                            split.counters
                        ],
                    );
                }
                launches += 1;
            }
        }
        launches
    }

    /// One token on the tensor-core GEMV's arithmetic, bitwise (`qmv1_*`): a block of
    /// [`QV_WARPS`] warps takes `4 · QV_WARPS / nsplit` rows, a warp four rows over one of the
    /// matrix's K ranges ([`qm_nsplit`], as `qmma_*` splits it). Up to [`MAX_SEGMENTS`]
    /// weights of one format a launch. Returns the launches made.
    fn one_token(&self, dev: &Device, xq: &XQuant, ws: &[&CudaWeight], outs: &[u64]) -> usize {
        let (dtype, cols) = (ws[0].dtype(), ws[0].cols());
        let kernel = self.qmv1[format_index(dtype)].as_ref().expect("a one-token kernel for this format");
        let mut launches = 0;
        for (group, group_outs) in ws.chunks(MAX_SEGMENTS).zip(outs.chunks(MAX_SEGMENTS)) {
            let mut segs = QmSegs::default();
            let mut blocks = [0; MAX_SEGMENTS];
            for (k, (w, &out)) in group.iter().zip(group_outs).enumerate() {
                let nsplit = qm_nsplit(w.rows(), cols, self.sm_count);
                blocks[k] = w.rows().div_ceil(4 * QV_WARPS / nsplit);
                segs.wq[k] = w.ptr();
                segs.ws[k] = scales_ptr(w);
                segs.out[k] = out;
                segs.rows[k] = w.rows() as i32;
                segs.nsplit[k] = nsplit as i32;
            }
            let total;
            (segs.unit_end, total) = matmul::segment_ends(blocks[..group.len()].iter().copied());
            assert!(total <= i32::MAX as usize, "qmv1: {total} blocks");
            dev.launch(
                "qmv1",
                kernel,
                (total as u32, 1, 1),
                (QV_WARPS as u32 * 32, 1, 1),
                0,
                kernel_args![segs, xq.q, xq.d, xq.s, cols as i32],
            );
            launches += 1;
        }
        launches
    }

    /// Warps per weight row, as log2: one, unless the matrix has too few rows to give every SM
    /// about 32 warps; then up to eight, as long as every lane keeps a unit of its own. A
    /// function of the shape alone, so the one-token and batched GEMVs agree bitwise.
    fn split_log2(&self, rows: usize, units: usize) -> usize {
        let target = self.sm_count * 32;
        let mut log2 = 0;
        while log2 < 3 && (rows << log2) < target && units >= 64 << log2 {
            log2 += 1;
        }
        log2
    }

    /// Whether producers write the quantized side output (the module docs); for comparisons.
    pub fn set_producer_quant(&self, on: bool) {
        self.producer_quant.store(on, Ordering::Relaxed);
    }

    /// Whether producers quantize (set_producer_quant).
    pub fn producer_quant(&self) -> bool {
        self.producer_quant.load(Ordering::Relaxed)
    }

    /// Notes that a packed weight is on the device: from now on producers quantize.
    pub fn note_packed_weight(&self) {
        self.packed_loaded.store(true, Ordering::Relaxed);
    }

    /// A side buffer for a producer about to write `n` values of one row into `out`, when
    /// producers quantize: `n % 32 == 0`, `out` one row long (the decode step of one token).
    pub fn producer_side(&self, dev: &Device, out: &CudaBuf, n: usize) -> Option<XQuant> {
        let on = self.producer_quant.load(Ordering::Relaxed) && self.packed_loaded.load(Ordering::Relaxed);
        (on && n > 0 && n.is_multiple_of(32) && out.len() >= n && out.len() < 2 * n)
            .then(|| XQuant::alloc(dev, n))
    }

    /// `pre` (the producer's quantization of `x`, one row) when there is one, else `quantize_x` now.
    fn quantize_x<'a>(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        cols: usize,
        pre: Option<&'a XQuant>,
    ) -> Activations<'a> {
        if let Some(xq) = pre.filter(|_| tokens == 1) {
            return Activations::Producer(xq);
        }
        let n = tokens * cols;
        let groups = n / 32;
        let xq = XQuant::alloc(dev, n);
        dev.launch(
            "quantize_x",
            &self.quantize_x,
            (groups.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            kernel_args![x.ptr(), xq.q, xq.d, xq.s, groups as i32],
        );
        Activations::Made(xq)
    }

    /// `x: [rows, cols]` quantized per 32 for the packed kernels (`cols % 32 == 0`).
    pub(super) fn quantize(&self, dev: &Device, x: &CudaBuf, rows: usize, cols: usize) -> XQuant {
        match self.quantize_x(dev, x, rows, cols, None) {
            Activations::Made(xq) => xq,
            Activations::Producer(_) => unreachable!("no producer's quantization was offered"),
        }
    }

    /// `qmoe_gate_up_*` (`which` 0) or `qmoe_down_*` (1) for packed weights of `dtype`.
    pub(super) fn moe_kernel(&self, dtype: DType, which: usize) -> &CudaFunction {
        &self.moe[format_index(dtype)][which]
    }

    /// `dequant_moe_bf16_*` for packed experts of `dtype`.
    pub(super) fn moe_dequant_kernel(&self, dtype: DType) -> &CudaFunction {
        &self.moe_dequant[format_index(dtype)]
    }

    /// Index into [`ROWS_PER_WARP`] of the one-token GEMV for a launch of `blocks(r)` blocks
    /// at r rows a warp, `resident[ri]` blocks fitting an SM: the fewest rounds of blocks over
    /// the SMs (ceil(blocks / resident blocks)), 2 rows a warp on a tie. A round costs a memory latency and a block start, so
    /// a matrix that fits the GPU in one round at 4 rows a warp (the 9B's 4096-row matrices)
    /// takes 4; long ones stream alike at 2 or 4 (measured on an H200: BENCHMARKS-LOG.md, session 4).
    fn rows_index(&self, resident: &[usize; 3], blocks: impl Fn(usize) -> usize) -> usize {
        let forced = QGEMV_ROWS_FORCED.load(Ordering::Relaxed);
        if forced > 0 {
            return forced - 1;
        }
        let rounds = |ri: usize| blocks(ROWS_PER_WARP[ri]).div_ceil(self.sm_count * resident[ri]);
        [1, 2, 0].into_iter().min_by_key(|&ri| rounds(ri)).unwrap_or(1)
    }

    /// `out = x · Wᵀ` by the GEMV: the one-token kernel for one token, the batched one (the
    /// same arithmetic per token) for more.
    fn gemv(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        w: &CudaWeight,
        out: &mut CudaBuf,
        pre: Option<&XQuant>,
    ) {
        let (rows, cols, dtype) = (w.rows(), w.cols(), w.dtype());
        let fi = format_index(dtype);
        let xq = self.quantize_x(dev, x, tokens, cols, pre);
        let log2 = self.split_log2(rows, cols / unit_cols(dtype));
        let scales = scales_ptr(w);
        let blocks = |r: usize| rows.div_ceil((QG_WARPS >> log2) * r);
        let (f, nt, r) = if tokens > 1 {
            (&self.gemv_rows[fi], QG_NT, batch_rows_per_warp(dtype))
        } else {
            let ri = self.rows_index(&self.resident[fi], blocks);
            (&self.gemv[fi][ri], 1, ROWS_PER_WARP[ri])
        };
        let row_blocks = blocks(r);
        assert!(row_blocks <= 65535, "cuda: a {rows}-row matrix is past the GEMV's grid");
        dev.launch(
            "qgemv",
            f,
            (tokens.div_ceil(nt) as u32, row_blocks as u32, 1),
            (QG_WARPS as u32 * 32, 1, 1),
            0,
            kernel_args![
                w.ptr(),
                scales,
                xq.q,
                xq.d,
                xq.s,
                out.ptr(),
                rows as i32,
                cols as i32,
                tokens as i32,
                log2 as i32
            ],
        );
    }

    /// `outs[j] = x · ws[j]ᵀ` for packed weights of one width (any mix of formats) in a decode
    /// batch: the activations are quantized once, and each format's weights run in one
    /// multi-segment GEMV launch (up to [`MAX_SEGMENTS`] weights each) — the tensor-core one
    /// where `tensor_cores` gives its workspace and it takes the format's weights. Every
    /// token's rows come from one arithmetic whatever the batch, so a sequence's results do not
    /// depend on it. Returns the launches made. `pre`: the producer's quantization that `x`
    /// carries, if any ([`CudaBuf::quantized`]).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_many_rows(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        ws: &[&CudaWeight],
        outs: &mut [&mut CudaBuf],
        pre: Option<&XQuant>,
        tensor_cores: Option<&SplitWorkspace>,
    ) -> usize {
        assert!(Kernels::can_fuse(ws) && ws.len() == outs.len(), "matmul_many_rows: weights do not fuse");
        for (w, out) in ws.iter().zip(outs.iter()) {
            check(x, tokens, w, out);
        }
        if tokens == 0 {
            return 0;
        }
        let cols = ws[0].cols();
        // Every weight of a call has one width, so the tensor cores take all or none.
        let mma = tensor_cores.filter(|_| self.mma_takes(ws[0]));
        if let Some(split) = mma {
            let xq = self.mma_input(dev, x, tokens, cols, pre);
            let mut launches = 0;
            for &(dtype, _) in &FORMATS {
                let members: Vec<usize> = (0..ws.len()).filter(|&j| ws[j].dtype() == dtype).collect();
                if members.is_empty() {
                    continue;
                }
                let weights: Vec<&CudaWeight> = members.iter().map(|&j| ws[j]).collect();
                let out_ptrs: Vec<u64> = members.iter().map(|&j| outs[j].ptr()).collect();
                launches += self.mma(dev, x, xq.as_deref(), tokens, &weights, &out_ptrs, split);
            }
            return launches;
        }
        let xq = self.quantize_x(dev, x, tokens, cols, pre);
        let mut launches = 0;
        for (fi, &(dtype, _)) in FORMATS.iter().enumerate() {
            let members: Vec<usize> = (0..ws.len()).filter(|&j| ws[j].dtype() == dtype).collect();
            for group in members.chunks(MAX_SEGMENTS) {
                let total_rows: usize = group.iter().map(|&j| ws[j].rows()).sum();
                let log2 = self.split_log2(total_rows, cols / unit_cols(dtype));
                let blocks = |r: usize| -> usize {
                    group.iter().map(|&j| ws[j].rows().div_ceil((QG_WARPS >> log2) * r)).sum()
                };
                let (f, nt, r) = if tokens > 1 {
                    (&self.gemv_multi_rows[fi], QG_NT, batch_rows_per_warp(dtype))
                } else {
                    let ri = self.rows_index(&self.resident_multi[fi], blocks);
                    (&self.gemv_multi[fi][ri], 1, ROWS_PER_WARP[ri])
                };
                let rows_per_block = (QG_WARPS >> log2) * r;
                let mut segs = QSegs {
                    wq: [0; MAX_SEGMENTS],
                    ws: [0; MAX_SEGMENTS],
                    out: [0; MAX_SEGMENTS],
                    rows: [0; MAX_SEGMENTS],
                    block_end: [0; MAX_SEGMENTS],
                };
                for (k, &j) in group.iter().enumerate() {
                    let w = ws[j];
                    segs.wq[k] = w.ptr();
                    segs.ws[k] = scales_ptr(w);
                    segs.out[k] = outs[j].ptr();
                    segs.rows[k] = w.rows() as i32;
                }
                let end;
                (segs.block_end, end) =
                    matmul::segment_ends(group.iter().map(|&j| ws[j].rows().div_ceil(rows_per_block)));
                assert!(end <= 65535, "cuda: {total_rows} rows are past the fused GEMV's grid");
                dev.launch(
                    "qgemv_multi",
                    f,
                    (tokens.div_ceil(nt) as u32, end as u32, 1),
                    (QG_WARPS as u32 * 32, 1, 1),
                    0,
                    kernel_args![segs, xq.q, xq.d, xq.s, cols as i32, tokens as i32, log2 as i32],
                );
                launches += 1;
            }
        }
        launches
    }

    /// Whether [`Kernels::gemv_glu`] takes this gate/up pair: one format and width, as many rows
    /// (a multiple of 32: a block's values are one quantization group), and a shape whose
    /// fused gate/up GEMV splits no row over warps (so each row's sum is bitwise that one's).
    pub fn can_glu(&self, gate: &CudaWeight, up: &CudaWeight) -> bool {
        let (n, cols, dtype) = (gate.rows(), gate.cols(), gate.dtype());
        dtype.is_quantized()
            && up.dtype() == dtype
            && up.cols() == cols
            && up.rows() == n
            && n > 0
            && n.is_multiple_of(32)
            && cols > 0
            && self.split_log2(2 * n, cols / unit_cols(dtype)) == 0
    }

    /// One token's `act = silu(x · gateᵀ) * (x · upᵀ)` (`n` values) in one launch, also written
    /// quantized into `side` for the down projection's GEMV: bitwise the fused gate/up GEMV
    /// ([`Kernels::matmul_many_rows`]) then `swiglu_q`. `pre`: the producer's quantization of
    /// `x`, if any. Takes what [`Kernels::can_glu`] accepts.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_glu(
        &self,
        dev: &Device,
        x: &CudaBuf,
        gate: &CudaWeight,
        up: &CudaWeight,
        act: &mut CudaBuf,
        pre: Option<&XQuant>,
        side: &XQuant,
    ) {
        assert!(self.can_glu(gate, up), "gemv_glu: the gate/up pair does not fuse");
        check(x, 1, gate, act);
        let (n, cols, dtype) = (gate.rows(), gate.cols(), gate.dtype());
        let xq = self.quantize_x(dev, x, 1, cols, pre);
        dev.launch(
            "qgemv_glu",
            &self.gemv_glu[format_index(dtype)],
            ((n / 32) as u32, 1, 1),
            (QG_WARPS as u32 * 32, 1, 1),
            0,
            kernel_args![
                gate.ptr(),
                scales_ptr(gate),
                up.ptr(),
                scales_ptr(up),
                xq.q,
                xq.d,
                xq.s,
                act.ptr(),
                side.q,
                side.d,
                side.s,
                n as i32,
                cols as i32
            ],
        );
    }

    /// Whether [`Kernels::matmul_many_rows`] takes these weights: two or more, all packed, all
    /// of one width, none empty.
    pub fn can_fuse(ws: &[&CudaWeight]) -> bool {
        let cols = ws.first().map_or(0, |w| w.cols());
        ws.len() >= 2
            && cols > 0
            && ws.iter().all(|w| w.dtype().is_quantized() && w.cols() == cols && w.rows() > 0)
    }

    /// Rows `[r0, r0 + nrows)` of `w` dequantized into `dst` (`[nrows, cols]` bf16).
    fn dequant(&self, dev: &Device, w: &CudaWeight, r0: usize, nrows: usize, dst: u64) {
        let (rows, cols, dtype) = (w.rows(), w.cols(), w.dtype());
        let scales = scales_ptr(w);
        let units = nrows * (cols / unit_cols(dtype));
        dev.launch(
            "dequant_bf16",
            &self.dequant[format_index(dtype)],
            (dev.grid_for(units, 256), 1, 1),
            (256, 1, 1),
            0,
            kernel_args![w.ptr(), scales, dst, rows as i32, cols as i32, r0 as i32, nrows as i32],
        );
    }

    /// The decode-batch matmul: on the tensor-core GEMV where `tensor_cores` gives its
    /// workspace and it takes `w` (one arithmetic for every batch size), else every row by the
    /// one-token dp4a GEMV's arithmetic (a batch of one takes the one-token kernel itself,
    /// which streams at far higher bandwidth).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_rows(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        w: &CudaWeight,
        out: &mut CudaBuf,
        pre: Option<&XQuant>,
        tensor_cores: Option<&SplitWorkspace>,
    ) -> QRan {
        check(x, tokens, w, out);
        if tokens == 0 || w.rows() == 0 {
            return QRan::Gemv;
        }
        if let Some(split) = tensor_cores.filter(|_| self.mma_takes(w)) {
            let xq = self.mma_input(dev, x, tokens, w.cols(), pre);
            self.mma(dev, x, xq.as_deref(), tokens, &[w], &[out.ptr()], split);
            return QRan::TensorCores;
        }
        self.gemv(dev, x, tokens, w, out, pre);
        if tokens == 1 {
            QRan::Gemv
        } else {
            QRan::GemvRows
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        gemms: Gemms,
        mm: &matmul::Kernels,
        x: &CudaBuf,
        tokens: usize,
        w: &CudaWeight,
        out: &mut CudaBuf,
        pre: Option<&XQuant>,
    ) -> QRan {
        let Gemms { dev, ew, blas, policy } = gemms;
        check(x, tokens, w, out);
        let (rows, cols) = (w.rows(), w.cols());
        if tokens == 0 || rows == 0 {
            return QRan::Gemv;
        }
        if tokens == 1 {
            self.gemv(dev, x, tokens, w, out, pre);
            return QRan::Gemv;
        }
        if tokens <= GEMV_MAX_TOKENS && policy == GemmPath::Auto {
            self.gemv(dev, x, tokens, w, out, None);
            return QRan::GemvRows;
        }
        let split = policy == GemmPath::CublasSplit;
        match (policy, blas) {
            (GemmPath::Fallback, _) | (GemmPath::Auto, None) => {
                let dense = CudaWeight::scratch_bf16(dev, rows, cols).unwrap_or_else(|e| panic!("{e}"));
                self.dequant(dev, w, 0, rows, dense.ptr());
                let fallback = Gemms { blas: None, policy: GemmPath::Fallback, ..gemms };
                QRan::Dequant(mm.matmul(fallback, x, tokens, &dense, out))
            }
            (_, blas) => {
                let blas = blas.expect("matmul: a cuBLAS path was requested but cuBLAS did not load");
                let bands = (rows * cols).div_ceil(BAND_ELEMS).max(1);
                let band = rows.div_ceil(bands).next_multiple_of(64).min(rows);
                let dense = CudaWeight::scratch_bf16(dev, band, cols).unwrap_or_else(|e| panic!("{e}"));
                let mut r0 = 0;
                while r0 < rows {
                    let n = band.min(rows - r0);
                    self.dequant(dev, w, r0, n, dense.ptr());
                    let at = out.ptr() + 4 * r0 as u64;
                    let input = Bf16Input::new(dev, ew, x, tokens * cols, split);
                    input.gemm(blas, tokens, dense.ptr(), n, cols, at, rows);
                    r0 += n;
                }
                QRan::Dequant(if split { matmul::Ran::CublasSplit } else { matmul::Ran::Cublas })
            }
        }
    }

    /// `out[t] = table[ids[t]]`, dequantized to f32.
    pub fn embed(&self, dev: &Device, table: &CudaWeight, ids: &[u32], dim: usize, out: &mut CudaBuf) {
        let (rows, cols, dtype) = (table.rows(), table.cols(), table.dtype());
        assert_eq!(cols, dim, "embed: table width");
        assert!(out.len() >= ids.len() * dim, "embed: out too short");
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
            panic!("embed: token id {bad} outside the table ({rows} rows)");
        }
        if ids.is_empty() {
            return;
        }
        let (_ids_dev, ids_ptr) = dev.ids_on_device(ids);
        let units = cols / unit_cols(dtype);
        let scales = scales_ptr(table);
        dev.launch(
            "embed_packed",
            &self.embed[format_index(dtype)],
            (units.div_ceil(128).min(64) as u32, ids.len() as u32, 1),
            (128, 1, 1),
            0,
            kernel_args![table.ptr(), scales, ids_ptr, out.ptr(), rows as i32, cols as i32],
        );
    }
}

fn check(x: &CudaBuf, tokens: usize, w: &CudaWeight, out: &CudaBuf) {
    let (rows, cols) = (w.rows(), w.cols());
    assert!(x.len() >= tokens * cols, "matmul: x holds {} floats, not [{tokens}, {cols}]", x.len());
    assert!(out.len() >= tokens * rows, "matmul: out holds {} floats, not [{tokens}, {rows}]", out.len());
    assert!(rows <= i32::MAX as usize && tokens * cols <= i32::MAX as usize);
}
