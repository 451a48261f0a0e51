//! `out = x · Wᵀ` on the GPU, weights in bf16, accumulation in f32, by one of these paths:
//!
//! - **Tensor-core GEMV**, one token or a decode batch: the decode path, bound by the bytes of
//!   `W`, which it reads once for up to 64 tokens, by one of three kernels
//!   ([`TensorCoreKernel`]): `gemv_wg_n*` (Hopper `wgmma`, the default on compute capability
//!   9.0) or `gemv_gs_n*` (`mma.sync`), both streaming 128-row weight tiles through a ring of
//!   shared-memory stages, or the per-warp `gemv_mma_*` (`mma.sync` on fragments loaded into
//!   registers) where that shared memory does not fit. x enters as two bf16 halves (hi + lo),
//!   so products keep ~16 mantissa bits. K is walked, and split into ranges ([`gs_nsplit`]), in
//!   an order fixed by the matrix shape, and MMA columns are independent, so a token's outputs
//!   are bitwise the same whatever the batch (one token included) and whether its projections
//!   are fused into one launch or not.
//! - **CUDA-core GEMV** (`gemv_bf16_s*`, `gemv_bf16_rows_s*`, `gemv_multi*`), the same calls
//!   when `CudaOptions::tensor_core_gemv` is off (for comparison): one token's dot products per warp, weights
//!   re-read every 4 tokens of a batch.
//! - **cuBLAS** (`cublasGemmEx`, bf16 × bf16 → f32 on the tensor cores), several tokens: the
//!   activations are rounded to bf16 first (one pass over `x`), as every bf16 engine does.
//! - **cuBLAS split** (opt-in): the activations as a pair of bf16 `hi + lo` and two accumulating
//!   GEMMs: twice the tensor-core work for ~16 mantissa bits instead of 8. Rounding activations
//!   to bf16 moves the logits of the small random-weight test fixtures by up to 4e-2 of their
//!   range; the split path brings that to f32 rounding, so whole-model tests can be tight.
//! - **Fallback** (`gemm_bf16_tiled`), several tokens when cuBLAS is not there (or a test asks
//!   for it): a plain tiled kernel, exact in its f32 activations but slow.
//!
//! Which one ran is counted in the backend's path counters.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};

use super::compile;
use super::device::{cuda_error, kernel_args, no_panic, CudaBuf, CudaWeight, Device};
use super::elementwise;
use crate::backend::MlpWeights;
use crate::error::Result;
use crate::tensor::DType;

pub(super) const SOURCE: &str =
    concat!(include_str!("mma.cuh"), "\n#line 1 \"matmul.cu\"\n", include_str!("matmul.cu"));

/// Which kernel runs a matmul of more than one token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// cuBLAS when it loaded, else the fallback.
    Auto,
    /// cuBLAS on bf16-rounded activations (panics in `matmul` if cuBLAS did not load).
    Cublas,
    /// cuBLAS on activations split into two bf16 halves: precise, twice the work.
    CublasSplit,
    /// The tiled fallback kernel.
    Fallback,
}

/// What [`Kernels::matmul`] ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ran {
    /// One token on the CUDA-core GEMV.
    Gemv,
    /// One token on the tensor-core GEMV.
    GemvMma,
    Cublas,
    CublasSplit,
    Fallback,
}

/// The cuBLAS handle, bound to the backend's stream.
pub(super) struct Blas {
    handle: CudaBlas,
}

impl Blas {
    /// `Ok(None)` when libcublas is not installed: the fallback kernel covers for it.
    pub fn open(dev: &Device) -> Result<Option<Blas>> {
        // SAFETY: only tries to dlopen libcublas by its known names.
        if !unsafe { blas_sys::is_culib_present() } {
            return Ok(None);
        }
        no_panic("opening cuBLAS", || {
            let handle =
                CudaBlas::new(dev.stream.clone()).map_err(|e| cuda_error(format!("cublasCreate: {e}")))?;
            Ok(Some(Blas { handle }))
        })
    }
}

pub(super) struct Kernels {
    /// `gemv_bf16_s{1,2,4,8}`, by log2 of the warps per row.
    gemv: [CudaFunction; 4],
    /// `gemv_bf16_rows_s{1,2,4,8}`.
    gemv_rows: [CudaFunction; 4],
    /// `gemv_multi_s{1,2,4,8}` (one token) and `gemv_multi_rows_s{1,2,4,8}` (a batch).
    gemv_multi: [CudaFunction; 4],
    gemv_multi_rows: [CudaFunction; 4],
    gemm_tiled: CudaFunction,
    /// `gemv_mma_n*_r*_u*` by [`MMA_CONFIGS`] index, `gemv_mma_n*_r1_u8_any` by log2 of the
    /// n-tiles, `gemv_mma_multi_n*_r*_u*` by [`MMA_CONFIGS`] index.
    mma: Vec<CudaFunction>,
    mma_any: [CudaFunction; 4],
    mma_multi: Vec<CudaFunction>,
    /// Whether the GEMVs run on the tensor cores (else the CUDA-core kernels).
    use_mma: AtomicBool,
    /// The [`MMA_CONFIGS`] index forced for every batch (`CudaOptions::gemv_tiles`, or
    /// [`Kernels::set_mma_tiles`]), [`NO_OVERRIDE`] for the choice by batch size.
    mma_forced: AtomicUsize,
    sm_count: usize,
    /// `gemv_glu_s*` by split, as `gemv`.
    gemv_glu: [CudaFunction; 4],
    /// The streamed tensor-core GEMVs and their K-split workspace; `None` where a
    /// configuration's shared memory does not fit.
    gs: Option<Streamed>,
    /// The [`TensorCoreKernel`] the tensor-core path takes, as its discriminant.
    tc_kernel: AtomicU8,
}

/// Which kernel runs the tensor-core GEMVs. Each is bitwise batch-invariant on its own; they
/// differ from each other in the last bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorCoreKernel {
    /// `gemv_mma_*`: each warp loads its weight fragments into registers, then multiplies.
    PerWarp = 0,
    /// `gemv_gs_n*`: `mma.sync` on weights and x streamed through a shared-memory ring.
    Streamed = 1,
    /// `gemv_wg_n*`: Hopper's warpgroup MMA (`wgmma`) on the same ring, N the fewest of 8, 16,
    /// 32, 64 tokens that hold the batch (compute capability 9.0 only).
    Warpgroup = 2,
}

impl TensorCoreKernel {
    fn from_u8(v: u8) -> TensorCoreKernel {
        match v {
            1 => TensorCoreKernel::Streamed,
            2 => TensorCoreKernel::Warpgroup,
            _ => TensorCoreKernel::PerWarp,
        }
    }
}

/// The warpgroup kernels (see [`Streamed::wg`]).
struct Warpgroup {
    aligned: Vec<CudaFunction>,
    any: Vec<CudaFunction>,
    split_x: CudaFunction,
}

/// The streamed tensor-core GEMVs' kernels and the workspace of their K splits.
struct Streamed {
    aligned: Vec<CudaFunction>,
    any: Vec<CudaFunction>,
    /// `gemv_wg_n*` and `gemv_wg_n*_any` by [`WG_CONFIGS`] index, and their x preparation
    /// `wg_split_x`: where the module was built for `sm_90a`.
    wg: Option<Warpgroup>,
    /// [`GS_SLOTS_PER_SM`] × SMs slots of [`GS_SLOT`] partial sums.
    partials: CudaBuf,
    /// One arrival counter per slot (zero between launches; `u32` in the kernel).
    counters: CudaBuf,
    slots: usize,
}

/// The streamed kernel's compiled configurations, (n-tiles of 8 tokens, warps along the rows,
/// ring depth), as `GS_CONFIG` instantiates them in `matmul.cu`: a launch of up to 8, 16, 32
/// and 64 tokens takes the first, second, third and fourth.
const GS_CONFIGS: [(usize, usize, usize); 4] = [(1, 4, 6), (2, 4, 5), (4, 2, 4), (8, 2, 3)];

/// `GS_BM`, `GS_BK`, `GS_THREADS` and `GS_SLOT` of the kernels.
pub(super) const GS_BM: usize = 128;
const GS_BK: usize = 64;
const GS_THREADS: u32 = 128;
const GS_SLOT: usize = GS_BM * 64;
/// The warpgroup kernel's compiled configurations, (N tokens, ring depth), as `WG_CONFIG`
/// instantiates them in `matmul.cu`; picked by [`gs_config`] as the streamed ones.
const WG_CONFIGS: [(usize, usize); 4] = [(8, 5), (16, 5), (32, 4), (64, 3)];

/// Bytes of one K stage's x tiles (hi and lo) of configuration `cfg` (`2 * WG_XTILE(N)`).
fn wg_x_stage_bytes(cfg: usize) -> usize {
    2 * WG_CONFIGS[cfg].0 * GS_BK * 2
}

/// Dynamic shared memory of warpgroup configuration `cfg`: its ring of stages of 128 × 64
/// bf16 weights and x's tiles, and 1 KB to align the swizzled tiles.
fn wg_smem_bytes(cfg: usize) -> usize {
    WG_CONFIGS[cfg].1 * (GS_BM * GS_BK * 2 + wg_x_stage_bytes(cfg)) + 1024
}
/// Tokens one streamed launch takes (a larger batch is launched in groups of this many).
const GS_TOKENS: usize = 64;
/// Partial-sum slots of the workspace per SM: a matrix is split over K only while its row
/// blocks × splits stay under the SM count, so one weight takes fewer than 2 × SMs slots and a
/// fused launch of [`MAX_SEGMENTS`] fewer than this many.
const GS_SLOTS_PER_SM: usize = 2 * MAX_SEGMENTS;

/// Dynamic shared memory of configuration `cfg`: its ring of stages of 128 weight rows and
/// 8 × n-tiles tokens of x, `GS_BK` columns each.
fn gs_smem_bytes(cfg: usize) -> usize {
    let (nt, _, stages) = GS_CONFIGS[cfg];
    stages * (GS_BM * GS_BK * 2 + nt * 8 * GS_BK * 4)
}

/// The streamed configuration for a launch of `tokens` (at most [`GS_TOKENS`]).
fn gs_config(tokens: usize) -> usize {
    match tokens {
        0..=8 => 0,
        9..=16 => 1,
        17..=32 => 2,
        _ => 3,
    }
}

/// Contiguous K ranges the streamed kernel splits a `rows` × `cols` matrix into (1, 2, 4 or 8):
/// the fewest that give every SM a block, keeping at least two stages per range. From the
/// shape alone: it fixes each output's order of summation, which must not change with the batch.
pub(super) fn gs_nsplit(rows: usize, cols: usize, sm_count: usize) -> usize {
    let (blocks, stages) = (rows.div_ceil(GS_BM), cols.div_ceil(GS_BK));
    let mut split = 1;
    while split < 8 && blocks * split < sm_count && stages >= 4 * split {
        split *= 2;
    }
    split
}

impl Streamed {
    /// The kernels with their shared memory opted in, and the workspace; `None` on a device
    /// whose blocks cannot have that much shared memory.
    fn load(module: &Arc<CudaModule>, dev: &Device) -> Result<Option<Streamed>> {
        if (0..GS_CONFIGS.len()).any(|c| gs_smem_bytes(c) > dev.max_smem_optin as usize) {
            return Ok(None);
        }
        // A kernel with `smem` bytes of dynamic shared memory opted in.
        let load = |name: String, smem: usize| -> Result<CudaFunction> {
            let f = module.load_function(&name).map_err(|e| cuda_error(format!("kernel {name}: {e}")))?;
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| cuda_error(format!("{name} shared memory opt-in: {e}")))?;
            Ok(f)
        };
        let streamed = |suffix: &str| -> Result<Vec<CudaFunction>> {
            (0..GS_CONFIGS.len())
                .map(|c| load(format!("gemv_gs_n{}{suffix}", GS_CONFIGS[c].0), gs_smem_bytes(c)))
                .collect()
        };
        let (aligned, any) = (streamed("")?, streamed("_any")?);
        let fits = (0..WG_CONFIGS.len()).all(|c| wg_smem_bytes(c) <= dev.max_smem_optin as usize);
        let wg = if compile::device_arch(dev.cc).ends_with("90a") && fits {
            let by_config = |suffix: &str| -> Result<Vec<CudaFunction>> {
                (0..WG_CONFIGS.len())
                    .map(|c| load(format!("gemv_wg_n{}{suffix}", WG_CONFIGS[c].0), wg_smem_bytes(c)))
                    .collect()
            };
            Some(Warpgroup {
                aligned: by_config("")?,
                any: by_config("_any")?,
                split_x: module
                    .load_function("wg_split_x")
                    .map_err(|e| cuda_error(format!("kernel wg_split_x: {e}")))?,
            })
        } else {
            None
        };
        let slots = GS_SLOTS_PER_SM * dev.sm_count as usize;
        Ok(Some(Streamed {
            aligned,
            any,
            wg,
            partials: dev.alloc(slots * GS_SLOT)?,
            counters: dev.zeros(slots)?,
            slots,
        }))
    }
}

/// The K-split workspace of the streamed GEMVs ([`Kernels::split_workspace`]): `slots`
/// partial-sum slots of [`GS_SLOT`] floats (128 rows × 64 tokens) and one `u32` counter each.
#[derive(Clone, Copy, Debug)]
pub(super) struct SplitWorkspace {
    pub partials: u64,
    pub counters: u64,
    pub slots: usize,
}

/// `GsSegs` of `matmul.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GsSegs {
    w: [u64; MAX_SEGMENTS],
    out: [u64; MAX_SEGMENTS],
    rows: [i32; MAX_SEGMENTS],
    unit_end: [i32; MAX_SEGMENTS],
    nsplit: [i32; MAX_SEGMENTS],
    pslot0: [i32; MAX_SEGMENTS],
}

/// The tensor-core GEMV's compiled configurations, (n-tiles of 8 tokens, row tiles of 16 rows,
/// 32-column steps in flight) per warp, as `MMA_ALIGNED` instantiates them in `matmul.cu`.
const MMA_CONFIGS: [(usize, usize, usize); 14] = [
    (1, 1, 8),
    (2, 1, 8),
    (4, 1, 8),
    (8, 1, 8),
    (1, 2, 4),
    (2, 2, 4),
    (4, 2, 4),
    (8, 2, 4),
    (1, 4, 2),
    (2, 4, 2),
    (4, 4, 2),
    (1, 1, 4),
    (1, 2, 2),
    (1, 4, 1),
];

/// Warps per tensor-core GEMV block (`MMA_WARPS`).
const MMA_WARPS: usize = 8;

/// `MmaSegs` of `matmul.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct MmaSegs {
    w: [u64; MAX_SEGMENTS],
    out: [u64; MAX_SEGMENTS],
    rows: [i32; MAX_SEGMENTS],
    block_end: [i32; MAX_SEGMENTS],
    split_log2: [i32; MAX_SEGMENTS],
}

/// The `block_end` of a fused GEMV's segment table (matmul.cu, quant.cu) for segments of
/// `blocks` row blocks each: where each segment's blocks end along the grid, the unused
/// segments ending where the last one does so that no block looks past it; and the total.
pub(super) fn segment_ends(blocks: impl IntoIterator<Item = usize>) -> ([i32; MAX_SEGMENTS], usize) {
    let mut ends = [0i32; MAX_SEGMENTS];
    let mut end = 0usize;
    let mut used = 0;
    for (j, n) in blocks.into_iter().enumerate() {
        end += n;
        ends[j] = end as i32;
        used = j + 1;
    }
    ends[used..].fill(end as i32);
    (ends, end)
}

/// The weight and output pointers and row counts of a fused bf16 GEMV's segment table, once
/// every output is checked to hold `[tokens, rows]` of its weight.
fn segment_pointers(
    ws: &[&CudaWeight],
    outs: &[&mut CudaBuf],
    tokens: usize,
) -> ([u64; MAX_SEGMENTS], [u64; MAX_SEGMENTS], [i32; MAX_SEGMENTS]) {
    check_segment_outputs(ws, outs, tokens);
    let (mut w, mut out, mut rows) = ([0; MAX_SEGMENTS], [0; MAX_SEGMENTS], [0; MAX_SEGMENTS]);
    for (j, (wj, oj)) in ws.iter().zip(outs).enumerate() {
        (w[j], out[j], rows[j]) = (wj.ptr(), oj.ptr(), wj.rows() as i32);
    }
    (w, out, rows)
}

/// Every output of a fused GEMV holds `[tokens, rows]` of its weight.
pub(super) fn check_segment_outputs(ws: &[&CudaWeight], outs: &[&mut CudaBuf], tokens: usize) {
    for (j, (w, out)) in ws.iter().zip(outs).enumerate() {
        assert!(
            out.len() >= tokens * w.rows(),
            "matmul_many_rows: out {j} holds {} floats, not [{tokens}, {}]",
            out.len(),
            w.rows()
        );
    }
}

/// Warps that share a 16-row tile of the tensor-core GEMV, as log2 (1 to 8 warps, each taking
/// every S-th 32-column step of K): one, unless the matrix has too few row tiles to give every
/// SM 16 warps. It depends on the shape alone: it fixes each output's order of summation, which
/// must not change with the batch.
fn mma_split_log2(rows: usize, sm_count: usize) -> usize {
    let tiles = rows.div_ceil(16);
    let target = sm_count * 16;
    let mut log2 = 0;
    while log2 < 3 && (tiles << log2) < target {
        log2 += 1;
    }
    log2
}

/// The configuration for a batch of `tokens` (unless one is forced): the fewest n-tiles that
/// hold it, up to 8 (64 tokens), and two row tiles per warp, the best or within 5 % of the best
/// of the compiled tilings at batch 1, 16 and 64 on the 9B shapes (BENCHMARKS.md).
fn mma_config(tokens: usize, forced: Option<usize>) -> usize {
    let want = match (tokens, forced) {
        (_, Some(i)) => return i,
        (0..=8, None) => (1, 2, 4),
        (9..=16, None) => (2, 2, 4),
        (17..=32, None) => (4, 2, 4),
        (_, None) => (8, 2, 4),
    };
    MMA_CONFIGS.iter().position(|&c| c == want).expect("a compiled configuration")
}

/// `mma_forced` when the configuration is chosen by batch size.
const NO_OVERRIDE: usize = usize::MAX;

/// `GEMV_MAX_SEGS`: weights one fused GEMV launch takes.
pub(super) const MAX_SEGMENTS: usize = 4;

/// `GemvSegs` of `matmul.cu`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvSegs {
    w: [u64; MAX_SEGMENTS],
    out: [u64; MAX_SEGMENTS],
    rows: [i32; MAX_SEGMENTS],
    block_end: [i32; MAX_SEGMENTS],
}

/// `GEMV_NT` of `gemv_bf16_rows`: tokens per block of the batch-invariant GEMV.
const GEMV_NT: usize = 4;

/// Warps per GEMV block (`GEMV_WARPS` of the kernels).
const GEMV_WARPS: u32 = 8;

/// Warps per weight row, as log2: one, unless the matrix has too few rows to give every SM
/// about 32 warps (then up to eight share a row). Depends on the shape alone, so the one-token
/// and batched GEMVs split a row identically and agree bitwise.
fn gemv_split_log2(rows: usize, sm_count: usize) -> usize {
    let target = sm_count * 32;
    let mut log2 = 0;
    while log2 < 3 && (rows << log2) < target {
        log2 += 1;
    }
    log2
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>, dev: &Device) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        let by_split = |prefix: &str| -> Result<[CudaFunction; 4]> {
            Ok([
                f(&format!("{prefix}1"))?,
                f(&format!("{prefix}2"))?,
                f(&format!("{prefix}4"))?,
                f(&format!("{prefix}8"))?,
            ])
        };
        let kernels = Kernels {
            gemv: by_split("gemv_bf16_s")?,
            gemv_rows: by_split("gemv_bf16_rows_s")?,
            gemv_multi: by_split("gemv_multi_s")?,
            gemv_multi_rows: by_split("gemv_multi_rows_s")?,
            gemm_tiled: f("gemm_bf16_tiled")?,
            mma: MMA_CONFIGS
                .iter()
                .map(|(n, r, u)| f(&format!("gemv_mma_n{n}_r{r}_u{u}")))
                .collect::<Result<_>>()?,
            mma_any: [
                f("gemv_mma_n1_r1_u8_any")?,
                f("gemv_mma_n2_r1_u8_any")?,
                f("gemv_mma_n4_r1_u8_any")?,
                f("gemv_mma_n8_r1_u8_any")?,
            ],
            mma_multi: MMA_CONFIGS
                .iter()
                .map(|(n, r, u)| f(&format!("gemv_mma_multi_n{n}_r{r}_u{u}")))
                .collect::<Result<_>>()?,
            use_mma: AtomicBool::new(true),
            mma_forced: AtomicUsize::new(NO_OVERRIDE),
            sm_count: dev.sm_count as usize,
            gemv_glu: by_split("gemv_glu_s")?,
            gs: Streamed::load(module, dev)?,
            tc_kernel: AtomicU8::new(0),
        };
        let best = [TensorCoreKernel::Warpgroup, TensorCoreKernel::Streamed, TensorCoreKernel::PerWarp]
            .into_iter()
            .find(|&k| kernels.has(k))
            .expect("the per-warp kernel is always there");
        kernels.tc_kernel.store(best as u8, Ordering::Relaxed);
        Ok(kernels)
    }

    /// Whether `kernel` loaded on this device.
    pub fn has(&self, kernel: TensorCoreKernel) -> bool {
        match kernel {
            TensorCoreKernel::PerWarp => true,
            TensorCoreKernel::Streamed => self.gs.is_some(),
            TensorCoreKernel::Warpgroup => self.gs.as_ref().is_some_and(|g| g.wg.is_some()),
        }
    }

    /// The kernel the tensor-core GEMVs run on: by default the warpgroup one where it loaded,
    /// else the streamed one (`CudaOptions::tensor_core_kernel` picks).
    pub fn tc_kernel(&self) -> TensorCoreKernel {
        TensorCoreKernel::from_u8(self.tc_kernel.load(Ordering::Relaxed))
    }

    /// The tensor-core kernel from the next call on; false, and nothing changes, when it did
    /// not load on this device.
    pub fn set_tc_kernel(&self, kernel: TensorCoreKernel) -> bool {
        if !self.has(kernel) {
            return false;
        }
        self.tc_kernel.store(kernel as u8, Ordering::Relaxed);
        true
    }

    /// `outs[j] = x · ws[j]ᵀ` on the streamed kernel, all weights of one width in one launch
    /// per group of [`GS_TOKENS`] tokens; each split over K as it is alone.
    fn gs_gemv(&self, dev: &Device, x: &CudaBuf, tokens: usize, ws: &[&CudaWeight], outs: &[u64]) {
        let gs = self.gs.as_ref().expect("the streamed GEMV loaded");
        let cols = ws[0].cols();
        let mut segs = GsSegs::default();
        let (mut seg_units, mut slots) = ([0; MAX_SEGMENTS], 0);
        for (j, w) in ws.iter().enumerate() {
            let split = gs_nsplit(w.rows(), cols, self.sm_count);
            seg_units[j] = w.rows().div_ceil(GS_BM) * split;
            segs.w[j] = w.ptr();
            segs.rows[j] = w.rows() as i32;
            segs.nsplit[j] = split as i32;
            if split > 1 {
                segs.pslot0[j] = slots as i32;
                slots += seg_units[j];
            }
        }
        let units;
        (segs.unit_end, units) = segment_ends(seg_units[..ws.len()].iter().copied());
        assert!(slots <= gs.slots, "gemv_gs: {slots} partial slots, the workspace has {}", gs.slots);
        assert!(units <= i32::MAX as usize, "gemv_gs: {units} blocks");
        let aligned = cols.is_multiple_of(8);
        let wg = gs.wg.as_ref().filter(|_| self.tc_kernel() == TensorCoreKernel::Warpgroup);
        // The warpgroup kernel's x tiles (hi and lo bf16 per K stage), sized for the first and
        // largest token group and reused by every group.
        let stages = cols.div_ceil(GS_BK);
        let tiles = wg.map(|_| {
            let bytes = stages * wg_x_stage_bytes(gs_config(tokens.min(GS_TOKENS)));
            dev.alloc(bytes / 4).unwrap_or_else(|e| panic!("{e}"))
        });
        for g0 in (0..tokens).step_by(GS_TOKENS) {
            let n = GS_TOKENS.min(tokens - g0);
            let cfg = gs_config(n);
            for (j, w) in ws.iter().enumerate() {
                segs.out[j] = outs[j] + (g0 * w.rows() * 4) as u64;
            }
            let xp = x.ptr() + (g0 * cols * 4) as u64;
            let (cols_i, n_i, partials, counters) =
                (cols as i32, n as i32, gs.partials.ptr(), gs.counters.ptr());
            if let (Some(wg), Some(tiles)) = (wg, &tiles) {
                dev.launch(
                    "wg_split_x",
                    &wg.split_x,
                    (stages as u32, 1, 1),
                    (GS_THREADS, 1, 1),
                    0,
                    kernel_args![xp, n_i, WG_CONFIGS[cfg].0 as i32, cols_i, tiles.ptr()],
                );
                dev.launch(
                    "gemv_wg",
                    if aligned { &wg.aligned[cfg] } else { &wg.any[cfg] },
                    (units as u32, 1, 1),
                    (GS_THREADS, 1, 1),
                    wg_smem_bytes(cfg) as u32,
                    kernel_args![segs, tiles.ptr(), cols_i, n_i, partials, counters],
                );
            } else {
                dev.launch(
                    "gemv_gs",
                    if aligned { &gs.aligned[cfg] } else { &gs.any[cfg] },
                    (units as u32, 1, 1),
                    (GS_THREADS, 1, 1),
                    gs_smem_bytes(cfg) as u32,
                    kernel_args![segs, xp, cols_i, n_i, partials, counters],
                );
            }
        }
    }

    /// The streamed kernels' K-split workspace (partial-sum slots of `GS_SLOT` floats and their
    /// arrival counters), which the packed tensor-core GEMV (`quant.rs`) shares: launches on
    /// the one stream run in order and leave every counter at zero. `None` where the streamed
    /// kernels did not load.
    pub fn split_workspace(&self) -> Option<SplitWorkspace> {
        self.gs.as_ref().map(|gs| SplitWorkspace {
            partials: gs.partials.ptr(),
            counters: gs.counters.ptr(),
            slots: gs.slots,
        })
    }

    /// Whether the GEMVs run on the tensor cores (`CudaOptions::tensor_core_gemv` off turns them off).
    pub fn uses_mma(&self) -> bool {
        self.use_mma.load(Ordering::Relaxed)
    }

    /// Tensor-core (`true`) or CUDA-core GEMVs from the next call on.
    pub fn set_mma(&self, on: bool) {
        self.use_mma.store(on, Ordering::Relaxed);
    }

    /// The tensor-core GEMV's (n-tiles, row tiles, steps in flight) per warp for every batch;
    /// `None` restores the choice by batch size. False for a configuration that is not
    /// compiled (see [`Kernels::mma_configs`]).
    pub fn set_mma_tiles(&self, tiles: Option<(usize, usize, usize)>) -> bool {
        let i = match tiles {
            None => NO_OVERRIDE,
            Some(c) => match MMA_CONFIGS.iter().position(|&k| k == c) {
                Some(i) => i,
                None => return false,
            },
        };
        self.mma_forced.store(i, Ordering::Relaxed);
        true
    }

    /// The compiled (n-tiles, row tiles, steps in flight) configurations of the tensor-core GEMV.
    pub fn mma_configs() -> &'static [(usize, usize, usize)] {
        &MMA_CONFIGS
    }

    fn mma_config(&self, tokens: usize) -> usize {
        let forced = self.mma_forced.load(Ordering::Relaxed);
        mma_config(tokens, (forced != NO_OVERRIDE).then_some(forced))
    }

    /// Row blocks of the tensor-core GEMV for `rows` at `split_log2` and configuration `cfg`.
    fn mma_row_blocks(rows: usize, split_log2: usize, cfg: usize) -> usize {
        let tiles_per_block = (MMA_WARPS >> split_log2) * MMA_CONFIGS[cfg].1;
        rows.div_ceil(16).div_ceil(tiles_per_block)
    }

    /// `out = x · Wᵀ` for `tokens` tokens on the tensor-core GEMV (any shape; `tokens`,
    /// `rows` and `cols` positive).
    fn mma_gemv(&self, dev: &Device, x: &CudaBuf, tokens: usize, w: &CudaWeight, out: &mut CudaBuf) {
        if self.tc_kernel() != TensorCoreKernel::PerWarp {
            return self.gs_gemv(dev, x, tokens, &[w], &[out.ptr()]);
        }
        let (rows, cols) = (w.rows(), w.cols());
        let split = mma_split_log2(rows, self.sm_count);
        let aligned = cols.is_multiple_of(8);
        let mut cfg = self.mma_config(tokens);
        if !aligned && MMA_CONFIGS[cfg].1 != 1 {
            // The unaligned kernels exist with one row tile per warp only.
            cfg = MMA_CONFIGS.iter().position(|&c| c == (MMA_CONFIGS[cfg].0, 1, 8)).expect("compiled");
        }
        let nt = MMA_CONFIGS[cfg].0;
        let f = if aligned { &self.mma[cfg] } else { &self.mma_any[nt.trailing_zeros() as usize] };
        let blocks = Self::mma_row_blocks(rows, split, cfg);
        assert!(blocks <= 65535, "matmul: {rows} rows are more than one tensor-core GEMV launch covers");
        dev.launch(
            "gemv_mma",
            f,
            (tokens.div_ceil(8 * nt) as u32, blocks as u32, 1),
            ((MMA_WARPS * 32) as u32, 1, 1),
            0,
            kernel_args![w.ptr(), x.ptr(), out.ptr(), rows as i32, cols as i32, tokens as i32, split as i32],
        );
    }

    /// The GEMV kernel (one-token or batched) for `rows`, and its blocks along the rows.
    fn gemv_for<'a>(&'a self, table: &'a [CudaFunction; 4], rows: usize) -> (&'a CudaFunction, u32) {
        let log2 = gemv_split_log2(rows, self.sm_count);
        (&table[log2], rows.div_ceil(GEMV_WARPS as usize >> log2) as u32)
    }

    /// The decode-batch matmul: every row computed by the one-token GEMV's arithmetic, so it is
    /// bitwise what `matmul` gives for that row alone, whatever the batch.
    pub fn matmul_rows(&self, dev: &Device, x: &CudaBuf, tokens: usize, w: &CudaWeight, out: &mut CudaBuf) {
        let (rows, cols) = (w.rows(), w.cols());
        assert!(x.len() >= tokens * cols, "matmul_rows: x holds {} floats, not [{tokens}, {cols}]", x.len());
        assert!(
            out.len() >= tokens * rows,
            "matmul_rows: out holds {} floats, not [{tokens}, {rows}]",
            out.len()
        );
        assert!(rows <= i32::MAX as usize && cols <= i32::MAX as usize && tokens <= 65535 * GEMV_NT);
        if tokens == 0 || rows == 0 {
            return;
        }
        if cols == 0 {
            dev.memset_zero(out.ptr(), tokens * rows * 4);
            return;
        }
        if self.uses_mma() {
            return self.mma_gemv(dev, x, tokens, w, out);
        }
        if tokens == 1 {
            // The one-token kernel: a token's arithmetic is the same in both (see matmul.cu).
            let (f, blocks) = self.gemv_for(&self.gemv, rows);
            dev.launch(
                "gemv_bf16",
                f,
                (blocks, 1, 1),
                (GEMV_WARPS * 32, 1, 1),
                0,
                kernel_args![w.ptr(), x.ptr(), out.ptr(), rows as i32, cols as i32],
            );
            return;
        }
        let (f, blocks) = self.gemv_for(&self.gemv_rows, rows);
        dev.launch(
            "gemv_bf16_rows",
            f,
            (blocks, tokens.div_ceil(GEMV_NT) as u32, 1),
            (GEMV_WARPS * 32, 1, 1),
            0,
            kernel_args![w.ptr(), x.ptr(), out.ptr(), rows as i32, cols as i32, tokens as i32],
        );
    }

    /// `outs[j] = x · ws[j]ᵀ` for up to [`MAX_SEGMENTS`] bf16 weights of the same width in one
    /// launch, for a decode batch: every token's rows computed by one arithmetic whatever the
    /// batch. The caller checks the weights fit ([`Kernels::can_fuse`]).
    pub fn matmul_many_rows(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        ws: &[&CudaWeight],
        outs: &mut [&mut CudaBuf],
    ) {
        assert!(Kernels::can_fuse(ws) && ws.len() == outs.len(), "matmul_many_rows: weights do not fuse");
        let cols = ws[0].cols();
        assert!(
            x.len() >= tokens * cols,
            "matmul_many_rows: x holds {} floats, not [{tokens}, {cols}]",
            x.len()
        );
        assert!(tokens <= 65535 * GEMV_NT, "matmul_many_rows: batch of {tokens}");
        if tokens == 0 {
            return;
        }
        if self.uses_mma() {
            return self.mma_many(dev, x, tokens, ws, outs);
        }
        let total_rows: usize = ws.iter().map(|w| w.rows()).sum();
        let log2 = gemv_split_log2(total_rows, self.sm_count);
        let rows_per_block = GEMV_WARPS as usize >> log2;
        let (w, out, rows) = segment_pointers(ws, outs, tokens);
        let mut segs = GemvSegs { w, out, rows, block_end: [0; MAX_SEGMENTS] };
        let end;
        (segs.block_end, end) = segment_ends(ws.iter().map(|w| w.rows().div_ceil(rows_per_block)));
        let (table, nt, name) = if tokens == 1 {
            (&self.gemv_multi, 1, "gemv_multi")
        } else {
            (&self.gemv_multi_rows, GEMV_NT, "gemv_multi_rows")
        };
        dev.launch(
            name,
            &table[log2],
            (end as u32, tokens.div_ceil(nt) as u32, 1),
            (GEMV_WARPS * 32, 1, 1),
            0,
            kernel_args![segs, x.ptr(), cols as i32, tokens as i32],
        );
    }

    /// Whether [`Kernels::gemv_glu`] takes `gate` and `up`: the CUDA-core GEMVs are selected
    /// and the pair would fuse as a projection ([`Kernels::can_fuse`]) with equal row counts.
    pub fn can_glu(&self, gate: &CudaWeight, up: &CudaWeight) -> bool {
        !self.uses_mma() && gate.rows() == up.rows() && Self::can_fuse(&[gate, up])
    }

    /// One token of a gated MLP's first half, `act = silu(x · gateᵀ) * (x · upᵀ)` in one
    /// launch: bitwise [`Kernels::matmul_many_rows`] of the pair followed by `swiglu`. The
    /// caller checks [`Kernels::can_glu`].
    pub fn gemv_glu(&self, dev: &Device, x: &CudaBuf, gate: &CudaWeight, up: &CudaWeight, act: &mut CudaBuf) {
        assert!(self.can_glu(gate, up), "gemv_glu: gate and up do not pair");
        let (rows, cols) = (gate.rows(), gate.cols());
        assert!(x.len() >= cols, "gemv_glu: x holds {} floats, not [1, {cols}]", x.len());
        assert!(act.len() >= rows, "gemv_glu: act holds {} floats, not [1, {rows}]", act.len());
        // The split the pair gets as a fused projection, so each row's sum is bitwise that one.
        let log2 = gemv_split_log2(2 * rows, self.sm_count);
        let blocks = rows.div_ceil(GEMV_WARPS as usize >> log2) as u32;
        dev.launch(
            "gemv_glu",
            &self.gemv_glu[log2],
            (blocks, 1, 1),
            (GEMV_WARPS * 32, 1, 1),
            0,
            kernel_args![gate.ptr(), up.ptr(), x.ptr(), act.ptr(), rows as i32, cols as i32],
        );
    }

    /// [`Kernels::matmul_many_rows`] on the tensor-core GEMV: each segment split as its matrix
    /// is alone (so bitwise what [`Kernels::matmul_rows`] gives it).
    fn mma_many(
        &self,
        dev: &Device,
        x: &CudaBuf,
        tokens: usize,
        ws: &[&CudaWeight],
        outs: &mut [&mut CudaBuf],
    ) {
        let (w, out, rows) = segment_pointers(ws, outs, tokens);
        if self.tc_kernel() != TensorCoreKernel::PerWarp {
            return self.gs_gemv(dev, x, tokens, ws, &out[..ws.len()]);
        }
        let cols = ws[0].cols();
        let cfg = self.mma_config(tokens);
        let mut segs = MmaSegs { w, out, rows, block_end: [0; MAX_SEGMENTS], split_log2: [0; MAX_SEGMENTS] };
        for (j, w) in ws.iter().enumerate() {
            segs.split_log2[j] = mma_split_log2(w.rows(), self.sm_count) as i32;
        }
        let end;
        (segs.block_end, end) = segment_ends(
            ws.iter()
                .zip(segs.split_log2)
                .map(|(w, split)| Self::mma_row_blocks(w.rows(), split as usize, cfg)),
        );
        assert!(end <= 65535, "matmul_many_rows: more rows than one tensor-core GEMV launch covers");
        dev.launch(
            "gemv_mma_multi",
            &self.mma_multi[cfg],
            (tokens.div_ceil(8 * MMA_CONFIGS[cfg].0) as u32, end as u32, 1),
            ((MMA_WARPS * 32) as u32, 1, 1),
            0,
            kernel_args![segs, x.ptr(), cols as i32, tokens as i32],
        );
    }

    /// Whether [`Kernels::matmul_many_rows`] takes these weights: 2 to [`MAX_SEGMENTS`] bf16
    /// ones (packed formats run their own GEMVs), all of one width (a multiple of 8, so rows stream in 16-byte loads), none empty.
    pub fn can_fuse(ws: &[&CudaWeight]) -> bool {
        let cols = ws.first().map_or(0, |w| w.cols());
        (2..=MAX_SEGMENTS).contains(&ws.len())
            && cols > 0
            && cols.is_multiple_of(8)
            && cols <= i32::MAX as usize
            && ws.iter().all(|w| {
                w.dtype() == DType::BF16 && w.cols() == cols && w.rows() > 0 && w.rows() <= i32::MAX as usize
            })
    }

    /// The projections of one prompt input (`tokens` > 1, bf16 weights) on cuBLAS with `x`
    /// converted to bf16 once: `Some` with the path taken, `None` (nothing launched) when the
    /// policy does not take cuBLAS or a weight is not bf16, for the caller's per-weight path.
    pub fn matmul_many_prompt(
        &self,
        gemms: Gemms,
        x: &CudaBuf,
        tokens: usize,
        ws: &[&CudaWeight],
        outs: &mut [&mut CudaBuf],
    ) -> Option<Ran> {
        let Gemms { dev, ew, blas, policy } = gemms;
        let (blas, ran) = cublas_path(policy, blas)?;
        let cols = ws.first()?.cols();
        if tokens < 2 || ws.iter().any(|w| w.dtype() != DType::BF16 || w.cols() != cols || w.rows() == 0) {
            return None;
        }
        assert_eq!(ws.len(), outs.len(), "matmul_many: one output per weight");
        for (w, out) in ws.iter().zip(outs.iter()) {
            assert!(
                out.len() >= tokens * w.rows(),
                "matmul: out holds {} floats, not [{tokens}, {}]",
                out.len(),
                w.rows()
            );
        }
        assert!(tokens <= i32::MAX as usize && cols <= i32::MAX as usize);
        let input = Bf16Input::new(dev, ew, x, tokens * cols, ran == Ran::CublasSplit);
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            input.gemm(blas, tokens, w.ptr(), w.rows(), cols, out.ptr(), w.rows());
        }
        Some(ran)
    }

    /// A prompt's gated MLP on cuBLAS, `out = (silu(x·Gᵀ) ⊙ x·Uᵀ)·Dᵀ`: `x` rounded to bf16 once
    /// for the gate and up GEMMs, their SwiGLU written straight as the down GEMM's bf16 input
    /// (the f32 product is never stored). Bitwise the separate ops. `None` (nothing launched)
    /// where [`Kernels::matmul_many_prompt`] declines.
    pub fn mlp_prompt(
        &self,
        gemms: Gemms,
        x: &CudaBuf,
        tokens: usize,
        weights: MlpWeights<'_, CudaWeight>,
        (gate_out, up_out): (&mut CudaBuf, &mut CudaBuf),
        out: &mut CudaBuf,
    ) -> Option<Ran> {
        let MlpWeights { gate, up, down } = weights;
        let Gemms { dev, ew, blas, .. } = gemms;
        let inter = gate.rows();
        if up.rows() != inter || down.cols() != inter || down.dtype() != DType::BF16 || down.rows() == 0 {
            return None;
        }
        assert!(
            out.len() >= tokens * down.rows(),
            "mlp: out holds {} floats, not [{tokens}, {}]",
            out.len(),
            down.rows()
        );
        let ran = self.matmul_many_prompt(gemms, x, tokens, &[gate, up], &mut [gate_out, up_out])?;
        let blas = blas.expect("matmul_many_prompt ran on cuBLAS");
        let act = Bf16Input::swiglu(dev, ew, gate_out, up_out, tokens * inter, ran == Ran::CublasSplit);
        act.gemm(blas, tokens, down.ptr(), down.rows(), inter, out.ptr(), down.rows());
        Some(ran)
    }

    pub fn matmul(&self, gemms: Gemms, x: &CudaBuf, tokens: usize, w: &CudaWeight, out: &mut CudaBuf) -> Ran {
        let Gemms { dev, ew, blas, policy } = gemms;
        let (rows, cols) = (w.rows(), w.cols());
        assert!(x.len() >= tokens * cols, "matmul: x holds {} floats, not [{tokens}, {cols}]", x.len());
        assert!(out.len() >= tokens * rows, "matmul: out holds {} floats, not [{tokens}, {rows}]", out.len());
        assert!(rows <= i32::MAX as usize && cols <= i32::MAX as usize && tokens <= i32::MAX as usize);
        if tokens == 0 || rows == 0 {
            return Ran::Gemv;
        }
        if cols == 0 {
            dev.memset_zero(out.ptr(), tokens * rows * 4);
            return Ran::Gemv;
        }
        if tokens == 1 && self.uses_mma() {
            // The decode batch's kernel: a sequence decoded alone gets bitwise its batch outputs.
            self.mma_gemv(dev, x, 1, w, out);
            return Ran::GemvMma;
        }
        if tokens == 1 {
            let (f, blocks) = self.gemv_for(&self.gemv, rows);
            dev.launch(
                "gemv_bf16",
                f,
                (blocks, 1, 1),
                (GEMV_WARPS * 32, 1, 1),
                0,
                kernel_args![w.ptr(), x.ptr(), out.ptr(), rows as i32, cols as i32],
            );
            return Ran::Gemv;
        }
        match cublas_path(policy, blas) {
            Some((blas, ran)) => {
                let input = Bf16Input::new(dev, ew, x, tokens * cols, ran == Ran::CublasSplit);
                input.gemm(blas, tokens, w.ptr(), rows, cols, out.ptr(), rows);
                ran
            }
            None => {
                dev.launch(
                    "gemm_bf16_tiled",
                    &self.gemm_tiled,
                    (rows.div_ceil(16) as u32, tokens.div_ceil(16) as u32, 1),
                    (16, 16, 1),
                    0,
                    kernel_args![w.ptr(), x.ptr(), out.ptr(), tokens as i32, rows as i32, cols as i32],
                );
                Ran::Fallback
            }
        }
    }
}

/// How a multi-token product runs: on `dev`, its input rounded to bf16 by `ew`'s kernels for
/// cuBLAS (`blas`, when it loaded) or multiplied by the tiled fallback, as `policy` says.
#[derive(Clone, Copy)]
pub(super) struct Gemms<'a> {
    pub dev: &'a Device,
    pub ew: &'a elementwise::Kernels,
    pub blas: Option<&'a Blas>,
    pub policy: GemmPath,
}

/// The cuBLAS handle a multi-token product takes under `policy`, and which cuBLAS path that is
/// (`Ran::Cublas` or `Ran::CublasSplit`); `None` for the tiled fallback (the policy's choice,
/// or `Auto` without cuBLAS). A cuBLAS path requested when cuBLAS did not load panics.
fn cublas_path(policy: GemmPath, blas: Option<&Blas>) -> Option<(&Blas, Ran)> {
    let need_blas = || blas.expect("matmul: a cuBLAS path was requested but cuBLAS did not load");
    match policy {
        GemmPath::Fallback => None,
        GemmPath::Auto => blas.map(|b| (b, Ran::Cublas)),
        GemmPath::Cublas => Some((need_blas(), Ran::Cublas)),
        GemmPath::CublasSplit => Some((need_blas(), Ran::CublasSplit)),
    }
}

/// The activations of a GEMM rounded to bf16 once (with `split`, the remainder too), for every
/// GEMM of that input: the projections of one input convert it once, not once per weight.
pub(super) struct Bf16Input {
    // Freed (stream-ordered) when dropped, after the GEMMs queued before in stream order.
    _buf: cudarc::driver::CudaSlice<u16>,
    hi: u64,
    lo: Option<u64>,
    len: usize,
}

impl Bf16Input {
    pub(super) fn new(
        dev: &Device,
        ew: &elementwise::Kernels,
        x: &CudaBuf,
        n: usize,
        split: bool,
    ) -> Bf16Input {
        assert!(x.len() >= n, "bf16 input: x holds {} floats, not {n}", x.len());
        let (buf, hi) = dev.alloc_u16(if split { 2 * n } else { n }).unwrap_or_else(|e| panic!("{e}"));
        let lo = split.then_some(hi + 2 * n as u64);
        match lo {
            Some(lo) => ew.f32_to_bf16_split(dev, x.ptr(), hi, lo, n),
            None => ew.f32_to_bf16(dev, x.ptr(), hi, n),
        }
        Bf16Input { _buf: buf, hi, lo, len: n }
    }

    /// The bf16 input `silu(gate) * up` (`n` values), as [`Bf16Input::new`] of swiglu's output.
    pub(super) fn swiglu(
        dev: &Device,
        ew: &elementwise::Kernels,
        gate: &CudaBuf,
        up: &CudaBuf,
        n: usize,
        split: bool,
    ) -> Bf16Input {
        let (buf, hi) = dev.alloc_u16(if split { 2 * n } else { n }).unwrap_or_else(|e| panic!("{e}"));
        let lo = split.then_some(hi + 2 * n as u64);
        ew.swiglu_to_bf16(dev, gate, up, hi, lo.unwrap_or(0), n);
        Bf16Input { _buf: buf, hi, lo, len: n }
    }

    /// `out[t * ldc + r] = x · Wᵀ` for the bf16 `[rows, cols]` matrix at `w`. cuBLAS is
    /// column-major: there the row-major `W [rows, cols]` is a `cols × rows` matrix used
    /// transposed, `x` a `cols × tokens` one, and `out` the `rows × tokens` result with leading
    /// dimension `ldc`. (A cuBLAS call's raw pointers and dimensions, passed as cuBLAS takes
    /// them: a band of a dequantized matrix writes into a wider output.)
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        blas: &Blas,
        tokens: usize,
        w: u64,
        rows: usize,
        cols: usize,
        out: u64,
        ldc: usize,
    ) {
        assert!(ldc >= rows && ldc <= i32::MAX as usize);
        assert!(
            tokens * cols <= self.len,
            "bf16 input: {tokens} x {cols} outside the {} converted",
            self.len
        );
        let halves = [(Some(self.hi), 0.0f32), (self.lo, 1.0)];
        for (xb, beta) in halves.into_iter().filter_map(|(p, b)| p.map(|p| (p, b))) {
            let alpha = 1.0f32;
            // SAFETY: the handle is bound to the backend's stream; the pointers are live device
            // allocations of the sizes asserted by the callers (`xb` holds tokens * cols bf16,
            // `w` rows * cols bf16, `out` (tokens - 1) * ldc + rows floats); alpha and beta are
            // host f32s, as the default pointer mode expects.
            let r = unsafe {
                blas_result::gemm_ex(
                    *blas.handle.handle(),
                    blas_sys::cublasOperation_t::CUBLAS_OP_T,
                    blas_sys::cublasOperation_t::CUBLAS_OP_N,
                    rows as i32,
                    tokens as i32,
                    cols as i32,
                    &alpha as *const f32 as *const c_void,
                    w as *const c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    cols as i32,
                    xb as *const c_void,
                    blas_sys::cudaDataType::CUDA_R_16BF,
                    cols as i32,
                    &beta as *const f32 as *const c_void,
                    out as *mut c_void,
                    blas_sys::cudaDataType::CUDA_R_32F,
                    ldc as i32,
                    blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            };
            if let Err(e) = r {
                panic!("cuda: cublasGemmEx ({tokens}x{cols} · {rows}x{cols}ᵀ): {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_ends_accumulate_and_pad_with_the_total() {
        assert_eq!(segment_ends([3, 5]), ([3, 8, 8, 8], 8));
        assert_eq!(segment_ends([1, 2, 3, 4]), ([1, 3, 6, 10], 10));
    }
}
