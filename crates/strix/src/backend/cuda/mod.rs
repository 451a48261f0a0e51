//! The CUDA backend: every [`Backend`] op on an NVIDIA GPU, weights in bf16 or packed GGML
//! blocks (Q8_0, Q4_0, Q4_K, Q6_K), activations and states in `f32` device buffers, accumulation in f32, all work queued on one stream.
//!
//! - `device.rs` opens the GPU (a clean error, never a panic, when there is no driver or
//!   device: cudarc loads `libcuda`, NVRTC and cuBLAS at run time, so the crate builds and runs
//!   anywhere), owns the stream and the buffers, and launches kernels;
//! - `compile.rs` turns the `.cu` sources kept beside their launchers into cubins with NVRTC,
//!   for the device's architecture, cached on disk;
//! - `elementwise.rs`, `matmul.rs`, `deltanet.rs` and `attention.rs` launch the kernels of
//!   their `.cu` files; `quant.rs` the matmuls and embedding gather on packed weights;
//! - `flash_attention.rs` and `deltanet_chunked.rs` run prompts (prefill) on the tensor cores:
//!   causal attention and the chunked delta rule with bf16 operands and f32 accumulation
//!   ([`PrefillPath`] picks them or the f32 kernels).
//!
//! The KV caches ([`CudaCache`]) hold bf16 rows by default (rounded to nearest even when
//! written; half the memory and the reads of f32) or f32 rows ([`CudaOptions::kv_cache`],
//! `--kv-cache f32`), one type for the backend's life; every attention kernel reads both.
//!
//! Errors: [`CudaBackend::new`] and `weight` return `Result`. The trait's ops return `()`, so an
//! op whose launch or allocation fails panics with a message that names it: that is a device
//! fault or an exhausted GPU, not bad input. Kernel faults are asynchronous and surface at the
//! next `download` (which synchronises), also as a panic.
//!
//! The decode-batch ops (`*_rows`) run every row by the same arithmetic as the one-token ops
//! (shared device functions, the same block shapes), so a sequence's results are bitwise
//! independent of what else is in the batch.
//!
//! Path counters ([`CudaBackend::path_counts`]) record which kernel path every op took, so a
//! test can prove the fast path ran rather than pass on a fallback.

mod attention;
mod compile;
mod deltanet;
mod deltanet_chunked;
mod device;
mod elementwise;
mod flash_attention;
mod graph;
mod matmul;
mod moe;
mod options;
mod packed;
mod quant;
mod sample;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use crate::backend::{
    AttentionInput, AttentionLayer, AttentionShape, Backend, DeltaNetLayer, DeltaNetProjections,
    DeltaNetShape, DeltaNetState, DeltaRuleInput, DeltaRuleMode, KvCache, KvCacheType, MlpActivations,
    MlpWeights, MoeExperts, MoeScratch, RmsNorm, SparseMoe,
};
use crate::error::Result;
use crate::sampling::{Draw, NonFiniteLogits, PreparedSample};
use crate::tensor::HostTensor;

pub use attention::CudaCache;
pub use device::{device_count, CudaBuf, CudaWeight};
pub use matmul::{GemmPath, TensorCoreKernel};
pub use moe::PER_PICK_MAX_TOKENS as MOE_DECODE_MAX_TOKENS;
pub use options::CudaOptions;
pub use quant::GEMV_MAX_TOKENS as QUANT_GEMV_MAX_TOKENS;
pub use quant::{set_qgemv_rows, PackedMma};

use device::{cuda_error, Device, XQuant};

/// Which kernels run prompts (attention of many tokens, the chunked delta rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillPath {
    /// The tensor-core kernels (bf16 operands, f32 accumulation) wherever they take the shape,
    /// the f32 kernels elsewhere. The default.
    Auto = 0,
    /// Always the f32 kernels.
    F32 = 1,
}

/// Declares the kernel-path counters once, each with its doc: [`PathCounts`] (a snapshot, a
/// `u64` a path, listed in this order by [`PathCounts::named`]) and the backend's atomic
/// `Counters` behind it.
macro_rules! path_counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// How many times each kernel path ran since the backend was made (or last reset).
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct PathCounts {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl PathCounts {
            /// Every counter with its field name, for reports that list them (`strix bench`).
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }

        #[derive(Default)]
        struct Counters {
            $($name: AtomicU64,)*
        }

        impl Counters {
            fn snapshot(&self) -> PathCounts {
                PathCounts { $($name: self.$name.load(Ordering::Relaxed),)* }
            }

            /// Zeroes every counter but those named in `keep`.
            fn reset_all_but(&self, keep: &[&str]) {
                $(if !keep.contains(&stringify!($name)) {
                    self.$name.store(0, Ordering::Relaxed);
                })*
            }
        }
    };
}

path_counters! {
    /// One-token matmuls on a bf16 GEMV kernel (tensor-core or CUDA-core).
    gemv,
    /// bf16 GEMV launches on the tensor cores: one-token matmuls, decode-batch matmuls and
    /// fused projections alike (`CudaOptions::tensor_core_gemv` off sends them to the CUDA-core kernels).
    gemv_mma,
    /// Of those, launches of a streamed kernel (weights through a shared-memory ring: the
    /// warpgroup or the `mma.sync` one, see [`TensorCoreKernel`]) rather than the per-warp one.
    gemv_streamed,
    /// Decode-batch projections of one input fused into one GEMV launch.
    gemv_fused,
    /// Of those, one-token gate/up projections with the MLP's SwiGLU in the same launch
    /// (`Backend::matmul_glu` on the CUDA-core GEMVs).
    gemv_glu,
    /// Multi-token matmuls on cuBLAS (tensor cores), activations rounded to bf16.
    gemm_cublas,
    /// Multi-token matmuls on cuBLAS with split (hi + lo bf16) activations.
    gemm_cublas_split,
    /// Multi-token matmuls on the tiled fallback kernel.
    gemm_fallback,
    /// Causal conv on the sequential (short-run) kernel.
    conv_sequential,
    /// Causal conv on the time-parallel kernel.
    conv_parallel,
    gdn_recurrent,
    /// Chunked delta-rule calls (either kernel).
    gdn_chunked,
    /// Decode-batch DeltaNet cores (conv, delta rule, gated norm) in one fused kernel.
    gdn_decode_fused,
    /// Of those, the calls on the tensor-core kernels (`deltanet_chunked.rs`).
    gdn_chunked_tc,
    /// MoE blocks whose routed experts ran on the device (`moe.rs`: the router, the picked
    /// experts and their sum; no read-back).
    moe_device,
    /// Of those, decode batches tuned for one sequence (`set_tensor_core_gemv(false)`) that ran
    /// the shared expert as one more pick of the routed experts' kernels (`moe.rs`'s
    /// `SharedExpert`) instead of as an MLP of its own.
    moe_shared_fused,
    /// MoE blocks whose routed experts were routed on the host (experts the device kernels
    /// do not take: a mix of bf16 and packed, more than 512, top-k above 16).
    moe_host,
    /// Attention calls (every kernel).
    attention,
    /// Of those, prompt runs on the tensor-core flash kernel (`flash_attention.rs`).
    flash_attention,
    /// Prompt runs (attention of at least 2 tokens, chunked delta rule) on the f32 kernels:
    /// shapes the tensor-core kernels do not take, or [`PrefillPath::F32`].
    prefill_f32,
    /// Attention calls whose longest row was split into more than one key range.
    attention_multi_split,
    /// Decode-batch calls (`*_rows` ops: matmul, conv, delta rule, attention).
    batch_rows,
    /// Decode steps replayed from a recorded CUDA graph.
    graph_replays,
    /// Decode steps recorded into a CUDA graph (then replayed).
    graph_captures,
    /// Decode steps launched op by op (the first sight of a batch, or graphs switched off).
    steps_eager,
    /// Captures that failed (the step then ran op by op).
    graph_failures,
    /// Kernel modules compiled by NVRTC when this backend was made.
    modules_compiled,
    /// Kernel modules loaded from the cache (memory or disk) instead.
    modules_cached,
    /// One-token matmuls on a packed-weight (Q8_0/Q4_0/Q4_K/Q6_K) GEMV.
    gemv_quant,
    /// Several-token matmuls (decode batches, short prompts) on the batched packed GEMV.
    gemv_quant_rows,
    /// Decode-batch matmul launches (any batch size) on the packed tensor-core GEMV (`qmma_*`).
    gemv_quant_mma,
    /// Decode-batch projections of one input on packed weights in fused GEMV launches
    /// (activations quantized once).
    gemv_quant_fused,
    /// Packed GEMV calls (one-token, single or fused) that read the activations as their
    /// producer (a row norm, the SwiGLU) quantized them, with no `quantize_x` (`quant.rs`).
    gemv_quant_prequantized,
    /// Matmuls on packed weights dequantized to bf16 for a GEMM (the GEMM is counted too).
    gemm_dequant,
    /// Embedding gathers from a packed table.
    embed_quant,
    /// Prepared draws (sampling) finished on the device.
    sample_device,
    /// Prepared draws the device kernels leave to the host (a top-p row over few or heavily
    /// tied logits, `sample.rs`).
    sample_host,
    /// Of the device's draws, those with a top-k above the one-block kernel's 1024 and below
    /// the vocabulary, drawn in sorted order by the full pipeline's radix selects.
    sample_sorted,
}

impl std::fmt::Display for PathCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "gemv {} fused {} (with swiglu {}) tensor-core {} (streamed {}) | gemm cublas {} split {} fallback {} | conv sequential {} parallel {} | \
             gdn recurrent {} chunked {} (tensor cores {}) fused decode {} | moe device {} (shared fused {}) host {} | attention {} (multi-split {}, flash {}) | \
             prefill on f32 kernels {} | batch rows {} | \
             decode steps: graph replays {} captures {} eager {} failed captures {} | modules compiled {} cached {} | \
             packed gemv {} rows {} tensor-core {} fused {} prequantized {} dequant-gemm {} embed {} | sampled on device {} (sorted {}) host {}",
            self.gemv,
            self.gemv_fused,
            self.gemv_glu,
            self.gemv_mma,
            self.gemv_streamed,
            self.gemm_cublas,
            self.gemm_cublas_split,
            self.gemm_fallback,
            self.conv_sequential,
            self.conv_parallel,
            self.gdn_recurrent,
            self.gdn_chunked,
            self.gdn_chunked_tc,
            self.gdn_decode_fused,
            self.moe_device,
            self.moe_shared_fused,
            self.moe_host,
            self.attention,
            self.attention_multi_split,
            self.flash_attention,
            self.prefill_f32,
            self.batch_rows,
            self.graph_replays,
            self.graph_captures,
            self.steps_eager,
            self.graph_failures,
            self.modules_compiled,
            self.modules_cached,
            self.gemv_quant,
            self.gemv_quant_rows,
            self.gemv_quant_mma,
            self.gemv_quant_fused,
            self.gemv_quant_prequantized,
            self.gemm_dequant,
            self.embed_quant,
            self.sample_device,
            self.sample_sorted,
            self.sample_host
        )
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Runs every op on one NVIDIA GPU.
pub struct CudaBackend {
    dev: Device,
    ew: elementwise::Kernels,
    sample: sample::Kernels,
    mm: matmul::Kernels,
    q: quant::Kernels,
    dn: deltanet::Kernels,
    at: attention::Kernels,
    fa: flash_attention::Kernels,
    dtc: deltanet_chunked::Kernels,
    moe: moe::Kernels,
    blas: Option<matmul::Blas>,
    gemm_path: AtomicU8,
    prefill_path: AtomicU8,
    /// The element type of every KV cache this backend makes ([`CudaOptions::kv_cache`]).
    kv_cache: KvCacheType,
    counters: Counters,
    graphs: Mutex<graph::Recordings>,
    use_graphs: AtomicBool,
    /// Whether the one-token delta rule also quantizes its output for a packed out_proj
    /// ([`CudaBackend::set_deltanet_producer_quant`]).
    deltanet_quant: AtomicBool,
}

impl CudaBackend {
    /// Opens CUDA device `ordinal` with the default [`CudaOptions`] (no kernel cache on disk).
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        CudaBackend::with_options(ordinal, &CudaOptions::default())
    }

    /// Opens CUDA device `ordinal` and loads the kernels (compiling them with NVRTC unless
    /// `options.kernel_cache` has them), set up as `options` says. An error, never a panic,
    /// when the machine has no driver, no such device, or no NVRTC.
    pub fn with_options(ordinal: usize, options: &CudaOptions) -> Result<CudaBackend> {
        let dev = Device::open(ordinal, options.pdl)?;
        let counters = Counters::default();
        let module = |name: &str, src: &str| {
            let (m, origin) = compile::load_module(&dev, options.kernel_cache.as_deref(), name, src)?;
            bump(match origin {
                compile::Origin::Compiled => &counters.modules_compiled,
                compile::Origin::Cached => &counters.modules_cached,
            });
            Ok::<_, crate::Error>(m)
        };
        let ew = elementwise::Kernels::load(&module("elementwise", elementwise::SOURCE)?)?;
        let sample = sample::Kernels::load(&module("sample", sample::SOURCE)?)?;
        let mm = matmul::Kernels::load(&module("matmul", matmul::SOURCE)?, &dev)?;
        mm.set_mma(options.tensor_core_gemv);
        if let Some(kernel) = options.tensor_core_kernel {
            // One the device cannot load keeps the best it has, as documented.
            mm.set_tc_kernel(kernel);
        }
        if !mm.set_mma_tiles(options.gemv_tiles) {
            return Err(cuda_error(format!(
                "CUDA options: gemv_tiles {:?} is not a compiled tensor-core GEMV tiling",
                options.gemv_tiles
            )));
        }
        let dn =
            deltanet::Kernels::load(&module("deltanet", deltanet::SOURCE)?, &dev, options.gdn_decode_cols)?;
        let at = attention::Kernels::load(&module("attention", attention::SOURCE)?)?;
        let q = quant::Kernels::load(&module("quant", quant::SOURCE)?, &dev)?;
        q.set_producer_quant(options.producer_quant);
        if !q.set_packed_mma(options.packed_mma) {
            return Err(cuda_error(format!(
                "CUDA options: packed_mma {:?} needs the warpgroup kernels (compute capability 9.0)",
                options.packed_mma
            )));
        }
        let fa = flash_attention::Kernels::load(&module("flash_attention", flash_attention::SOURCE)?, &dev)?;
        let dtc =
            deltanet_chunked::Kernels::load(&module("deltanet_chunked", deltanet_chunked::SOURCE)?, &dev)?;
        let moe = moe::Kernels::load(&module("moe", moe::SOURCE)?)?;
        let blas = matmul::Blas::open(&dev)?;
        let use_graphs = options.graphs;
        Ok(CudaBackend {
            dev,
            ew,
            sample,
            mm,
            q,
            dn,
            at,
            fa,
            dtc,
            moe,
            blas,
            gemm_path: AtomicU8::new(0),
            prefill_path: AtomicU8::new(0),
            kv_cache: options.kv_cache,
            counters,
            graphs: Mutex::default(),
            use_graphs: AtomicBool::new(use_graphs),
            deltanet_quant: AtomicBool::new(true),
        })
    }

    /// The GPU's name as the driver reports it ("NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.dev.cc
    }

    /// The device's streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.dev.sm_count as usize
    }

    /// Whether cuBLAS loaded (multi-token matmuls run on tensor cores).
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// Whether decode steps are recorded as CUDA graphs and replayed (the default; tests
    /// compare both ways).
    pub fn set_graphs(&self, on: bool) {
        self.use_graphs.store(on, Ordering::Relaxed);
    }

    /// Why the last failed decode-step capture failed (see [`PathCounts::graph_failures`]).
    pub fn last_graph_failure(&self) -> Option<String> {
        self.graphs.lock().ok().and_then(|g| g.last_failure().map(str::to_string))
    }

    /// Chooses the kernel for matmuls of more than one token (tests force each one).
    pub fn set_gemm_path(&self, path: GemmPath) {
        let v = match path {
            GemmPath::Auto => 0,
            GemmPath::Cublas => 1,
            GemmPath::Fallback => 2,
            GemmPath::CublasSplit => 3,
        };
        self.gemm_path.store(v, Ordering::Relaxed);
    }

    /// Chooses the kernels for prompt runs of attention and the chunked delta rule (tests
    /// force the f32 ones to hold them to f32 tolerances).
    pub fn set_prefill_path(&self, path: PrefillPath) {
        self.prefill_path.store(path as u8, Ordering::Relaxed);
    }

    /// A KV cache of [`Backend::kv_cache_type`] holding `data` (bf16: rounded to nearest even,
    /// as cache writes round), for tests and tools that start from given rows.
    pub fn cache_upload(&self, data: &[f32]) -> CudaCache {
        self.cache_upload_as(self.kv_cache, data)
    }

    /// [`CudaBackend::cache_upload`] into a cache of element type `t`: the attention ops read
    /// either type, so a test can hold both side by side on one backend.
    pub fn cache_upload_as(&self, t: KvCacheType, data: &[f32]) -> CudaCache {
        self.dev.bind();
        or_panic(CudaCache::upload(&self.dev, data, t))
    }

    /// A KV cache of `len` zero elements of type `t` ([`Backend::cache_zeros`] makes the
    /// backend's own type).
    pub fn cache_zeros_as(&self, t: KvCacheType, len: usize) -> CudaCache {
        self.dev.bind();
        or_panic(CudaCache::zeros(&self.dev, len, t))
    }

    /// Counts `n` tensor-core GEMV launches, and which kernel ran them.
    fn count_mma(&self, n: u64) {
        self.counters.gemv_mma.fetch_add(n, Ordering::Relaxed);
        if self.mm.tc_kernel() != TensorCoreKernel::PerWarp {
            self.counters.gemv_streamed.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Counts `n` matrix products that took the path `ran`.
    fn count_matmuls(&self, ran: matmul::Ran, n: u64) {
        let c = &self.counters;
        if ran == matmul::Ran::GemvMma {
            self.count_mma(n);
        }
        let counter = match ran {
            matmul::Ran::Gemv | matmul::Ran::GemvMma => &c.gemv,
            matmul::Ran::Cublas => &c.gemm_cublas,
            matmul::Ran::CublasSplit => &c.gemm_cublas_split,
            matmul::Ran::Fallback => &c.gemm_fallback,
        };
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn tensor_core_prefill(&self) -> bool {
        self.prefill_path.load(Ordering::Relaxed) == PrefillPath::Auto as u8
    }

    /// How this backend's multi-token products run now.
    fn gemms(&self) -> matmul::Gemms<'_> {
        matmul::Gemms { dev: &self.dev, ew: &self.ew, blas: self.blas.as_ref(), policy: self.gemm_path() }
    }

    fn gemm_path(&self) -> GemmPath {
        match self.gemm_path.load(Ordering::Relaxed) {
            1 => GemmPath::Cublas,
            2 => GemmPath::Fallback,
            3 => GemmPath::CublasSplit,
            _ => GemmPath::Auto,
        }
    }

    /// Runs the bf16 GEMVs on the tensor cores (the default: a batch reads the weights once)
    /// or, with `false`, on the CUDA-core kernels (as `CudaOptions::tensor_core_gemv` off does), which
    /// stream faster for a single sequence. Each choice is bitwise batch-invariant; decode
    /// steps recorded under the other one are not replayed.
    pub fn set_tensor_core_gemv(&self, on: bool) {
        self.mm.set_mma(on);
    }

    /// The kernel of the tensor-core GEMVs from the next call on (as
    /// [`CudaOptions::tensor_core_kernel`] picks at start): each is bitwise
    /// batch-invariant on its own; decode steps recorded under another are not replayed. False,
    /// and nothing changes, for a kernel that did not load on this device (the warpgroup one
    /// needs compute capability 9.0, the streamed ones ~100 KB of shared memory per block).
    pub fn set_tensor_core_kernel(&self, kernel: TensorCoreKernel) -> bool {
        self.mm.set_tc_kernel(kernel)
    }

    /// The tensor-core arithmetic of packed decode batches from the next call on (as
    /// [`CudaOptions::packed_mma`] picks at start): each is bitwise batch-invariant on its own;
    /// decode steps recorded under another are not replayed. False, and nothing changes, for a
    /// warpgroup one on a device without its kernels (compute capability 9.0 only).
    pub fn set_packed_mma(&self, mma: PackedMma) -> bool {
        self.q.set_packed_mma(mma)
    }

    /// The tensor-core arithmetic of packed decode batches.
    pub fn packed_mma(&self) -> PackedMma {
        self.q.packed_mma()
    }

    /// The kernel the tensor-core GEMVs run on.
    pub fn tensor_core_kernel(&self) -> TensorCoreKernel {
        self.mm.tc_kernel()
    }

    /// The tensor-core GEMV's (n-tiles of 8 tokens, row tiles of 16 rows, 32-column steps in
    /// flight) per warp for every batch, for tuning (as [`CudaOptions::gemv_tiles`] does); `None`
    /// restores the choice by batch size. A token's outputs do not depend on it. False, and
    /// nothing changes, for a configuration that is not one of [`CudaBackend::gemv_tile_configs`].
    pub fn set_gemv_tiles(&self, tiles: Option<(usize, usize, usize)>) -> bool {
        self.mm.set_mma_tiles(tiles)
    }

    /// The (n-tiles, row tiles, steps in flight) configurations [`CudaBackend::set_gemv_tiles`]
    /// takes.
    pub fn gemv_tile_configs() -> &'static [(usize, usize, usize)] {
        matmul::Kernels::mma_configs()
    }

    pub fn path_counts(&self) -> PathCounts {
        self.counters.snapshot()
    }

    /// Whether the row norms and the SwiGLU of one token also write their output quantized
    /// for the packed GEMV that reads it next (default on; [`CudaOptions::producer_quant`] at start); off,
    /// every packed GEMV quantizes its input itself first. Results are bitwise the same.
    pub fn set_producer_quant(&self, on: bool) {
        self.q.set_producer_quant(on);
    }

    /// Whether the one-token Gated DeltaNet kernel is among the producers that quantize (with
    /// [`CudaBackend::set_producer_quant`] on; default on): off, the packed out_proj quantizes
    /// its input itself, for comparisons. Results are bitwise the same.
    pub fn set_deltanet_producer_quant(&self, on: bool) {
        self.deltanet_quant.store(on, Ordering::Relaxed);
    }

    /// Runs a producer op's launch with a side buffer for its `n` outputs in `out` quantized,
    /// when producers quantize (`wanted`, and [`quant::Kernels::producer_side`]); `launch`
    /// returns whether its kernel wrote them, and then `out` carries them, so the next op may
    /// read them instead of running `quantize_x` (quant.rs).
    fn produce(
        &self,
        out: &mut CudaBuf,
        n: usize,
        wanted: bool,
        launch: impl FnOnce(&mut CudaBuf, Option<&XQuant>) -> bool,
    ) {
        let side = if wanted { self.q.producer_side(&self.dev, out, n) } else { None };
        if launch(out, side.as_ref()) {
            out.attach_quantized(&self.dev, side.expect("quantized into it"), n);
        }
    }

    /// The producer's quantization that `x` carries, for a packed GEMV (`use_it`) of one row of
    /// `cols`, if the last kernel on the device wrote it (quant.rs); called first in an op,
    /// before `bind` moves [`device::Device::work_seq`].
    fn prequantized<'x>(
        &self,
        x: &'x CudaBuf,
        tokens: usize,
        cols: usize,
        use_it: bool,
    ) -> Option<&'x XQuant> {
        let pre = x.quantized(&self.dev, cols).filter(|_| use_it && tokens == 1);
        if pre.is_some() {
            bump(&self.counters.gemv_quant_prequantized);
        }
        pre
    }

    /// The K-split workspace for the packed tensor-core GEMV when the GEMVs run on the tensor
    /// cores ([`CudaBackend::set_tensor_core_gemv`]): then every packed decode matmul it takes
    /// runs on it at every batch size, one token included (quant.rs); `None` keeps the dp4a
    /// GEMVs.
    fn packed_tensor_cores(&self) -> Option<matmul::SplitWorkspace> {
        self.mm.uses_mma().then(|| self.mm.split_workspace()).flatten()
    }

    /// Zeroes the op counters (the module counters describe construction and stay).
    pub fn reset_path_counts(&self) {
        self.counters.reset_all_but(&["modules_compiled", "modules_cached"]);
    }

    /// Waits for all queued work; reports a failed kernel as an error.
    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()
    }

    /// Brackets the region an external profiler records (`ncu --profile-from-start off`).
    pub fn profiler_range(&self, on: bool) -> Result<()> {
        self.dev.ctx.bind_to_thread().map_err(cuda_error)?;
        // SAFETY: plain driver calls on the bound context.
        let r = unsafe {
            if on {
                cudarc::driver::sys::cuProfilerStart()
            } else {
                cudarc::driver::sys::cuProfilerStop()
            }
        };
        r.result().map_err(cuda_error)
    }

    /// Device memory (free, total) in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.dev.ctx.bind_to_thread().map_err(cuda_error)?;
        self.dev.ctx.mem_get_info().map_err(cuda_error)
    }

    /// Device memory bandwidth measured with a device-to-device copy of `bytes` (median of
    /// `repeats` timed copies after a warm-up), counting bytes read plus bytes written, in
    /// bytes per second: the ceiling for roofline figures.
    pub fn measure_copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64> {
        let dev = &self.dev;
        dev.ctx.bind_to_thread().map_err(cuda_error)?;
        let floats = bytes / 4;
        let src = dev.zeros(floats)?;
        let dst = dev.alloc(floats)?;
        let start = dev
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_error)?;
        let end = dev
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_error)?;
        for _ in 0..3 {
            dev.copy_dtod(dst.ptr(), src.ptr(), floats * 4);
        }
        let mut times = Vec::with_capacity(repeats.max(1));
        for _ in 0..repeats.max(1) {
            start.record(&dev.stream).map_err(cuda_error)?;
            dev.copy_dtod(dst.ptr(), src.ptr(), floats * 4);
            end.record(&dev.stream).map_err(cuda_error)?;
            times.push(start.elapsed_ms(&end).map_err(cuda_error)? as f64 / 1e3);
        }
        dev.synchronize()?;
        times.sort_by(|a, b| a.total_cmp(b));
        let median = times[times.len() / 2];
        Ok(2.0 * (floats * 4) as f64 / median)
    }
}

/// `Result` to value inside an op, which cannot return errors (see the module docs).
fn or_panic<T>(r: Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// A layer's experts as `moe.rs`'s kernels take them.
fn kernel_experts(experts: &MoeExperts<CudaBackend>) -> moe::Experts<'_> {
    moe::Experts { gate: &experts.gate, up: &experts.up, down: &experts.down, top_k: experts.top_k }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Cache = CudaCache;

    fn name(&self) -> String {
        format!("cuda:{} ({}, sm_{}{})", self.dev.ordinal, self.dev.name, self.dev.cc.0, self.dev.cc.1)
    }

    fn weight(&self, t: &HostTensor, rows: usize, cols: usize) -> Result<CudaWeight> {
        self.dev.ctx.bind_to_thread().map_err(cuda_error)?;
        if t.dtype.is_quantized() {
            self.q.note_packed_weight();
        }
        self.dev.upload_weight(t, rows, cols)
    }

    fn upload(&self, data: &[f32]) -> CudaBuf {
        self.dev.bind();
        or_panic(self.dev.upload_f32(data))
    }

    fn zeros(&self, len: usize) -> CudaBuf {
        self.dev.bind();
        or_panic(self.dev.zeros(len))
    }

    fn free_memory(&self) -> Option<usize> {
        self.memory_info().ok().map(|(free, _)| free)
    }

    /// 4096: cuBLAS's tiles cover 132 SMs in several full waves (at 512 rows a [512, 12288]
    /// product is 1.5 waves), and a pass's scratch (~1.1 GB at the 9B shape) is small beside
    /// the weights.
    fn preferred_pass_tokens(&self) -> usize {
        4096
    }

    fn scratch(&self, len: usize) -> CudaBuf {
        // Uninitialised memory: nothing runs on the device.
        self.dev.bind_context();
        or_panic(self.dev.alloc(len))
    }

    fn resize(&self, buf: &mut CudaBuf, len: usize) {
        self.dev.bind();
        let next = or_panic(self.dev.alloc(len));
        let keep = buf.len().min(len);
        self.dev.copy_dtod(next.ptr(), buf.ptr(), keep * 4);
        self.dev.memset_zero(next.at(keep), (len - keep) * 4);
        *buf = next;
    }

    fn download(&self, buf: &CudaBuf, offset: usize, len: usize) -> Vec<f32> {
        assert!(offset + len <= buf.len(), "download: {offset}+{len} outside a buffer of {}", buf.len());
        self.dev.bind();
        let mut host = vec![0.0f32; len];
        or_panic(self.dev.download_f32(&mut host, buf.at(offset)));
        host
    }

    fn weight_bytes(&self, w: &CudaWeight) -> usize {
        w.bytes()
    }

    fn weight_shape(&self, w: &CudaWeight) -> (usize, usize) {
        (w.rows(), w.cols())
    }

    fn kv_cache_type(&self) -> KvCacheType {
        self.kv_cache
    }

    fn cache_zeros(&self, len: usize) -> CudaCache {
        self.cache_zeros_as(self.kv_cache, len)
    }

    fn cache_resize(&self, cache: &mut CudaCache, len: usize) {
        self.dev.bind();
        or_panic(cache.resize(&self.dev, len));
    }

    fn cache_download(&self, cache: &CudaCache, offset: usize, len: usize) -> Vec<f32> {
        self.dev.bind();
        or_panic(cache.download(&self.dev, offset, len))
    }

    fn copy(&self, src: &CudaBuf, src_offset: usize, dst: &mut CudaBuf, dst_offset: usize, len: usize) {
        assert!(
            src_offset + len <= src.len() && dst_offset + len <= dst.len(),
            "copy: {len} floats from {src_offset} of {} to {dst_offset} of {}",
            src.len(),
            dst.len()
        );
        self.dev.bind();
        self.dev.copy_dtod(dst.at(dst_offset), src.at(src_offset), len * 4);
    }

    fn cache_copy(
        &self,
        src: &CudaCache,
        src_offset: usize,
        dst: &mut CudaCache,
        dst_offset: usize,
        len: usize,
    ) {
        self.dev.bind();
        src.copy_to(&self.dev, src_offset, dst, dst_offset, len);
    }

    fn decode_step(
        &self,
        key: u64,
        ids: &[u32],
        positions: &[usize],
        step: &mut dyn FnMut() -> CudaBuf,
        read: &mut dyn FnMut(&CudaBuf),
    ) {
        self.dev.bind();
        // A recording holds the GEMV kernels of the mode it was made in (CUDA or tensor
        // cores, which tensor-core kernel), whether producers quantize for the packed GEMVs and
        // which arithmetic packed batches run.
        let key =
            if self.mm.uses_mma() { key ^ ((self.mm.tc_kernel() as u64) << 61) } else { key ^ (1 << 63) };
        let key = if self.q.producer_quant() { key ^ (1 << 60) } else { key };
        let key = if self.deltanet_quant.load(Ordering::Relaxed) { key } else { key ^ (1 << 59) };
        let key = key ^ ((self.q.packed_mma() as u64) << 57);
        let mut eager = |step: &mut dyn FnMut() -> CudaBuf| {
            bump(&self.counters.steps_eager);
            read(&step());
        };
        if !self.use_graphs.load(Ordering::Relaxed) || ids.len() > device::MAX_STEP_ROWS {
            return eager(step);
        }
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        match graphs.plan(key) {
            graph::Plan::Eager => {
                drop(graphs);
                eager(step)
            }
            graph::Plan::Replay => {
                or_panic(self.dev.write_step_inputs(ids, positions));
                let out = or_panic(graphs.replay(key));
                bump(&self.counters.graph_replays);
                read(out)
            }
            graph::Plan::Record => {
                or_panic(self.dev.write_step_inputs(ids, positions));
                // A producer's side buffer lives in the step's scratch buffer that carries it,
                // dropped (into the recording) before the capture ends.
                let captured = graph::Recording::capture(&self.dev, &mut || step());
                match captured {
                    Ok(recording) => {
                        bump(&self.counters.graph_captures);
                        let out = or_panic(graphs.insert_and_replay(key, recording));
                        read(out)
                    }
                    Err(e) => {
                        // Nothing ran: a capture only records. Run the step op by op, and
                        // never try this key again.
                        bump(&self.counters.graph_failures);
                        graphs.mark_failed(key, e.to_string());
                        drop(graphs);
                        eager(step)
                    }
                }
            }
        }
    }

    fn argmax_rows(&self, x: &CudaBuf, rows: usize, cols: usize) -> Vec<Result<u32, NonFiniteLogits>> {
        self.dev.bind();
        self.sample.argmax_rows(&self.dev, x, rows, cols)
    }

    fn sample_rows(
        &self,
        logits: &CudaBuf,
        vocab: usize,
        picks: &[(usize, &PreparedSample)],
    ) -> Vec<Result<Draw, NonFiniteLogits>> {
        self.dev.bind();
        let drawn = self.sample.draw_rows(&self.dev, logits, vocab, picks);
        self.counters.sample_host.fetch_add(drawn.on_host as u64, Ordering::Relaxed);
        self.counters.sample_device.fetch_add((picks.len() - drawn.on_host) as u64, Ordering::Relaxed);
        self.counters.sample_sorted.fetch_add(drawn.sorted as u64, Ordering::Relaxed);
        drawn.draws
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], dim: usize, out: &mut CudaBuf) {
        self.dev.bind();
        if table.dtype().is_quantized() {
            self.q.embed(&self.dev, table, ids, dim, out);
            bump(&self.counters.embed_quant);
            return;
        }
        self.ew.embed(&self.dev, table, ids, dim, out);
    }

    fn matmul(&self, x: &CudaBuf, tokens: usize, w: &CudaWeight, out: &mut CudaBuf) {
        let pre = self.prequantized(x, tokens, w.cols(), w.dtype().is_quantized());
        self.dev.bind();
        let ran = if w.dtype().is_quantized() {
            match self.q.matmul(self.gemms(), &self.mm, x, tokens, w, out, pre) {
                quant::QRan::Gemv => return bump(&self.counters.gemv_quant),
                quant::QRan::GemvRows => return bump(&self.counters.gemv_quant_rows),
                quant::QRan::TensorCores => return bump(&self.counters.gemv_quant_mma),
                quant::QRan::Dequant(ran) => {
                    bump(&self.counters.gemm_dequant);
                    ran
                }
            }
        } else {
            self.mm.matmul(self.gemms(), x, tokens, w, out)
        };
        self.count_matmuls(ran, 1);
    }

    fn rms_norm(&self, x: &CudaBuf, norm: RmsNorm<'_, CudaBuf>, out: &mut CudaBuf) {
        self.dev.bind();
        self.produce(out, norm.dim, true, |out, side| self.ew.rms_norm(&self.dev, x, norm, out, side));
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaBuf,
        x: &CudaBuf,
        norm: RmsNorm<'_, CudaBuf>,
        out: &mut CudaBuf,
    ) {
        self.dev.bind();
        self.produce(out, norm.dim, true, |out, side| {
            self.ew.add_rms_norm(&self.dev, residual, x, norm, out, side)
        });
    }

    fn swiglu(&self, gate: &CudaBuf, up: &CudaBuf, len: usize, out: &mut CudaBuf) {
        self.dev.bind();
        self.ew.swiglu(&self.dev, gate, up, len, out);
    }

    fn copy_row(&self, src: &CudaBuf, src_row: usize, dim: usize, out: &mut CudaBuf) {
        assert!((src_row + 1) * dim <= src.len() && dim <= out.len(), "copy_row: out of range");
        self.dev.bind();
        self.dev.copy_dtod(out.ptr(), src.at(src_row * dim), dim * 4);
    }

    fn causal_conv1d_silu(
        &self,
        shape: &DeltaNetShape,
        qkv: &mut CudaBuf,
        tokens: usize,
        weight: &CudaBuf,
        state: &mut CudaBuf,
    ) {
        self.dev.bind();
        let ran = self.dn.causal_conv1d_silu(&self.dev, shape, qkv, tokens, weight, state);
        bump(match ran {
            deltanet::ConvRan::Sequential => &self.counters.conv_sequential,
            deltanet::ConvRan::Parallel => &self.counters.conv_parallel,
        });
    }

    fn gated_delta_rule(
        &self,
        shape: &DeltaNetShape,
        mode: DeltaRuleMode,
        input: DeltaRuleInput<'_, CudaBuf>,
        tokens: usize,
        state: &mut CudaBuf,
        out: &mut CudaBuf,
    ) {
        self.dev.bind();
        let run = deltanet::DeltaRuleRun { shape, input, tokens };
        if mode == DeltaRuleMode::Chunked {
            bump(&self.counters.gdn_chunked);
            if self.tensor_core_prefill() && self.dtc.supports(shape, tokens) {
                self.dtc.gated_delta_rule(&self.dev, run, state, out);
                return bump(&self.counters.gdn_chunked_tc);
            }
            bump(&self.counters.prefill_f32);
        } else {
            bump(&self.counters.gdn_recurrent);
        }
        self.dn.gated_delta_rule(&self.dev, mode, run, state, out);
    }

    fn gated_rms_norm(&self, x: &mut CudaBuf, z: &CudaBuf, norm: RmsNorm<'_, CudaBuf>, rows: usize) {
        self.dev.bind();
        self.ew.gated_rms_norm(&self.dev, x, z, norm, rows);
    }

    fn attention_prologue(
        &self,
        layer: AttentionLayer<'_, CudaBuf>,
        q_and_gate: &CudaBuf,
        k: &mut CudaBuf,
        positions: &[usize],
        q: &mut CudaBuf,
        gate: &mut CudaBuf,
    ) {
        self.dev.bind();
        self.at.prologue(&self.dev, layer, q_and_gate, k, positions, q, gate);
    }

    fn attention(
        &self,
        shape: &AttentionShape,
        input: AttentionInput<'_, CudaBuf>,
        cache: KvCache<'_, CudaCache>,
        pos0: usize,
        tokens: usize,
        out: &mut CudaBuf,
    ) {
        self.dev.bind();
        bump(&self.counters.attention);
        let run = attention::AttentionRun { shape, input, pos0, tokens };
        if self.tensor_core_prefill() && self.fa.supports(shape, tokens) {
            let splits = self.fa.attention(&self.dev, &self.at, run, cache, out);
            bump(&self.counters.flash_attention);
            if splits > 1 {
                bump(&self.counters.attention_multi_split);
            }
            return;
        }
        if tokens > 1 {
            bump(&self.counters.prefill_f32);
        }
        let splits = self.at.attention(&self.dev, run, cache, out);
        if splits > 1 {
            bump(&self.counters.attention_multi_split);
        }
    }

    fn matmul_many(
        &self,
        x: &CudaBuf,
        tokens: usize,
        ws: &[&CudaWeight],
        outs: &mut [&mut CudaBuf],
        decode_batch: bool,
    ) {
        let cols = ws.first().map_or(0, |w| w.cols());
        if !decode_batch {
            // A prompt's projections: the input rounded to bf16 once for all their GEMMs.
            self.dev.bind();
            if let Some(ran) = self.mm.matmul_many_prompt(self.gemms(), x, tokens, ws, outs) {
                return self.count_matmuls(ran, ws.len() as u64);
            }
            return crate::backend::matmul_each(self, x, tokens, ws, outs, decode_batch);
        }
        // Packed and bf16 weights fuse separately (a GGUF file may keep small matrices in
        // bf16); the split depends on the weights alone, so every batch takes the same kernels.
        let (mut packed_w, mut packed_o, mut dense_w, mut dense_o) = (vec![], vec![], vec![], vec![]);
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            if w.dtype().is_quantized() {
                packed_w.push(*w);
                packed_o.push(&mut **out);
            } else {
                dense_w.push(*w);
                dense_o.push(&mut **out);
            }
        }
        // The fused packed launch is the only taker here; nothing has run on the device since
        // the op began (the partition above is host work), so x's quantization is still current.
        let fused = quant::Kernels::can_fuse(&packed_w);
        let pre = self.prequantized(x, tokens, cols, fused);
        self.dev.bind();
        if fused {
            let tensor_cores = self.packed_tensor_cores();
            self.q.matmul_many_rows(
                &self.dev,
                x,
                tokens,
                &packed_w,
                &mut packed_o,
                pre,
                tensor_cores.as_ref(),
            );
            bump(&self.counters.batch_rows);
            bump(&self.counters.gemv_quant_fused);
            if tensor_cores.is_some() && self.q.mma_takes(packed_w[0]) {
                bump(&self.counters.gemv_quant_mma);
            }
        } else {
            crate::backend::matmul_each(self, x, tokens, &packed_w, &mut packed_o, decode_batch);
        }
        if matmul::Kernels::can_fuse(&dense_w) {
            self.mm.matmul_many_rows(&self.dev, x, tokens, &dense_w, &mut dense_o);
            bump(&self.counters.batch_rows);
            bump(&self.counters.gemv_fused);
            if self.mm.uses_mma() {
                self.count_mma(1);
            }
        } else {
            crate::backend::matmul_each(self, x, tokens, &dense_w, &mut dense_o, decode_batch);
        }
    }

    fn matmul_glu(
        &self,
        x: &CudaBuf,
        tokens: usize,
        gate: &CudaWeight,
        up: &CudaWeight,
        acts: MlpActivations<'_, CudaBuf>,
        decode_batch: bool,
    ) {
        let MlpActivations { gate: gate_out, up: up_out, act } = acts;
        // One token on the CUDA-core GEMVs: gate, up and the SwiGLU in one launch.
        if tokens == 1 && self.mm.can_glu(gate, up) {
            self.dev.bind();
            self.mm.gemv_glu(&self.dev, x, gate, up, act);
            bump(&self.counters.gemv_fused);
            bump(&self.counters.gemv_glu);
            if decode_batch {
                bump(&self.counters.batch_rows);
            }
            return;
        }
        // One token on packed weights: gate, up, the SwiGLU and its quantization for the down
        // projection's GEMV in one launch, where the pair fuses and producers quantize.
        // (Not where the tensor-core GEMV takes the pair: a batch's gate/up sums are that
        // kernel's, so one token's must be too.)
        let n = gate.rows();
        let tensor_cores = decode_batch && self.packed_tensor_cores().is_some() && self.q.mma_takes(gate);
        if tokens == 1 && !tensor_cores && self.q.can_glu(gate, up) {
            if let Some(side) = self.q.producer_side(&self.dev, act, n) {
                // First in the op: allocating the side buffer queues nothing on the device.
                let pre = self.prequantized(x, tokens, gate.cols(), true);
                self.dev.bind();
                self.q.gemv_glu(&self.dev, x, gate, up, act, pre, &side);
                act.attach_quantized(&self.dev, side, n);
                bump(&self.counters.gemv_quant_fused);
                bump(&self.counters.gemv_glu);
                if decode_batch {
                    bump(&self.counters.batch_rows);
                }
                return;
            }
        }
        // Otherwise the SwiGLU after the fused gate/up GEMV also writes its output quantized
        // for the down projection's GEMV (quant.rs).
        if tokens == 1 && gate.dtype().is_quantized() && up.dtype().is_quantized() && up.rows() == n {
            self.matmul_many(x, tokens, &[gate, up], &mut [&mut *gate_out, &mut *up_out], decode_batch);
            self.dev.bind();
            self.produce(act, n, true, |act, side| match side {
                Some(side) => {
                    self.ew.swiglu_q(&self.dev, gate_out, up_out, n, act, side);
                    true
                }
                None => {
                    self.ew.swiglu(&self.dev, gate_out, up_out, n, act);
                    false
                }
            });
            return;
        }
        let acts = MlpActivations { gate: gate_out, up: up_out, act };
        crate::backend::matmul_glu_each(self, x, tokens, gate, up, acts, decode_batch);
    }

    fn moe_experts(
        &self,
        x: &CudaBuf,
        tokens: usize,
        router_logits: &CudaBuf,
        experts: &MoeExperts<CudaBackend>,
        out: &mut CudaBuf,
        decode_batch: bool,
    ) {
        // The experts stay on the device, prompts and decode batches alike (a prompt's picks
        // grouped by expert as a batch's are), bf16 or packed; a mix is routed on the host.
        let kernel_experts = kernel_experts(experts);
        if moe::Kernels::supports(&kernel_experts) {
            self.dev.bind();
            self.moe.experts(&self.dev, &self.q, x, tokens, router_logits, &kernel_experts, None, out);
            return bump(&self.counters.moe_device);
        }
        bump(&self.counters.moe_host);
        crate::backend::moe_experts_on_host(self, x, tokens, router_logits, experts, out, decode_batch);
    }

    fn sparse_moe(
        &self,
        x: &CudaBuf,
        tokens: usize,
        moe: SparseMoe<'_, CudaBackend>,
        scratch: MoeScratch<'_, CudaBuf>,
        out: &mut CudaBuf,
        decode_batch: bool,
    ) {
        // Tuned for one sequence (the CUDA-core GEMVs: `strix run`, `chat`), a decode step is
        // made of launches (~750 a step on the 35B-A3B shape): the shared expert runs as one
        // more pick in the routed experts' kernels, which saves its MLP's launches and the
        // gate's. Every decode batch of that tuning does so, so a row stays bitwise what it
        // gives alone. Tuned for batches (the tensor-core GEMVs read the shared expert once for
        // all rows), and for prompts, the ops run one by one.
        let experts = kernel_experts(moe.experts);
        let shared = moe.shared_expert;
        if decode_batch
            && !self.mm.uses_mma()
            && tokens <= moe::PER_PICK_MAX_TOKENS
            && moe::Kernels::supports(&experts)
            && moe::Kernels::supports_shared(&experts, shared.gate, shared.up, shared.down)
        {
            let MoeScratch { router_logits, shared_gate, .. } = scratch;
            self.matmul_many(
                x,
                tokens,
                &[moe.router, moe.shared_expert_gate],
                &mut [&mut *router_logits, &mut *shared_gate],
                decode_batch,
            );
            let shared = moe::SharedExpert {
                gate: shared.gate,
                up: shared.up,
                down: shared.down,
                gate_logits: shared_gate,
            };
            self.dev.bind();
            self.moe.experts(&self.dev, &self.q, x, tokens, router_logits, &experts, Some(shared), out);
            bump(&self.counters.moe_device);
            return bump(&self.counters.moe_shared_fused);
        }
        crate::backend::sparse_moe_each(self, x, tokens, moe, scratch, out, decode_batch);
    }

    fn add_sigmoid_gated(&self, out: &mut CudaBuf, x: &CudaBuf, gate: &CudaBuf, rows: usize, dim: usize) {
        self.dev.bind();
        self.moe.add_sigmoid_gated(&self.dev, out, x, gate, rows, dim);
    }

    fn moe_on_device(&self, experts: &MoeExperts<CudaBackend>) -> bool {
        moe::Kernels::supports(&kernel_experts(experts))
    }

    fn moe_prompt_scratch_bytes(&self, experts: &MoeExperts<CudaBackend>) -> usize {
        moe::Kernels::prompt_scratch_bytes(&kernel_experts(experts))
    }

    fn mlp(
        &self,
        x: &CudaBuf,
        tokens: usize,
        weights: MlpWeights<'_, CudaWeight>,
        acts: MlpActivations<'_, CudaBuf>,
        out: &mut CudaBuf,
        decode_batch: bool,
    ) {
        let MlpActivations { gate, up, act } = acts;
        if !decode_batch && tokens > 1 {
            // A prompt: the SwiGLU goes straight into the down GEMM's bf16 input.
            self.dev.bind();
            let outs = (&mut *gate, &mut *up);
            if let Some(ran) = self.mm.mlp_prompt(self.gemms(), x, tokens, weights, outs, out) {
                return self.count_matmuls(ran, 3);
            }
        }
        crate::backend::mlp_each(
            self,
            x,
            tokens,
            weights,
            MlpActivations { gate, up, act },
            out,
            decode_batch,
        );
    }

    fn matmul_rows(&self, x: &CudaBuf, tokens: usize, w: &CudaWeight, out: &mut CudaBuf) {
        let pre = self.prequantized(x, tokens, w.cols(), w.dtype().is_quantized());
        self.dev.bind();
        if w.dtype().is_quantized() {
            bump(
                match self.q.matmul_rows(
                    &self.dev,
                    x,
                    tokens,
                    w,
                    out,
                    pre,
                    self.packed_tensor_cores().as_ref(),
                ) {
                    quant::QRan::TensorCores => &self.counters.gemv_quant_mma,
                    _ if tokens == 1 => &self.counters.gemv_quant,
                    _ => &self.counters.gemv_quant_rows,
                },
            );
        } else {
            self.mm.matmul_rows(&self.dev, x, tokens, w, out);
            if self.mm.uses_mma() && tokens > 0 && w.rows() > 0 && w.cols() > 0 {
                self.count_mma(1);
            }
        }
        bump(&self.counters.batch_rows);
    }

    fn causal_conv1d_silu_rows(
        &self,
        shape: &DeltaNetShape,
        qkv: &mut CudaBuf,
        weight: &CudaBuf,
        states: &mut [DeltaNetState<'_, CudaBuf>],
    ) {
        self.dev.bind();
        self.dn.causal_conv1d_silu_rows(&self.dev, shape, qkv, weight, states);
        bump(&self.counters.batch_rows);
    }

    fn gated_delta_rule_rows(
        &self,
        shape: &DeltaNetShape,
        input: DeltaRuleInput<'_, CudaBuf>,
        states: &mut [DeltaNetState<'_, CudaBuf>],
        out: &mut CudaBuf,
    ) {
        self.dev.bind();
        self.dn.gated_delta_rule_rows(&self.dev, shape, input, states, out);
        bump(&self.counters.batch_rows);
    }

    fn deltanet_decode_rows(
        &self,
        layer: DeltaNetLayer<'_, CudaBuf>,
        projections: DeltaNetProjections<'_, CudaBuf>,
        states: &mut [DeltaNetState<'_, CudaBuf>],
        out: &mut CudaBuf,
    ) {
        if deltanet::Kernels::decode_cluster(&layer.shape).is_none() {
            return crate::backend::deltanet_decode_each(self, layer, projections, states, out);
        }
        // One token's output may also go out quantized for the packed out_proj (quant.rs).
        let quantize = states.len() == 1 && self.deltanet_quant.load(Ordering::Relaxed);
        self.dev.bind();
        self.produce(out, layer.shape.value_dim(), quantize, |out, side| {
            self.dn.deltanet_decode_rows(&self.dev, layer, projections, states, out, side)
        });
        bump(&self.counters.batch_rows);
        bump(&self.counters.gdn_decode_fused);
    }

    fn attention_rows(
        &self,
        shape: &AttentionShape,
        input: AttentionInput<'_, CudaBuf>,
        caches: &mut [KvCache<'_, CudaCache>],
        positions: &[usize],
        out: &mut CudaBuf,
    ) {
        // One token's output may also go out quantized for the packed o_proj (quant.rs).
        self.dev.bind();
        self.produce(out, shape.num_heads * shape.head_dim, positions.len() == 1, |out, side| {
            self.at.attention_rows(&self.dev, shape, input, caches, positions, out, side)
        });
        bump(&self.counters.batch_rows);
    }
}
