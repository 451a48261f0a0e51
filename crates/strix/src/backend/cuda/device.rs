//! The device side of the CUDA backend: opening a GPU without ever panicking when there is
//! none, the one stream every op runs on, device buffers ([`CudaBuf`], [`CudaWeight`]) and the
//! raw copies and launches the op launchers are built from.
//!
//! Memory comes from the device's stream-ordered pool (`cuMemAllocAsync`), whose release
//! threshold is raised so freed blocks stay in the pool. On top of that, `f32` buffers that are
//! dropped go to a free list by size ([`BufCache`]) and are handed out again: the model
//! allocates its scratch per op through `zeros`, and with ~18 GB of weights in the pool a
//! `zeros` (alloc + memset + free) took 6.6 µs at the 9B shapes on an H200, 3.6 µs from the free
//! list (the memset remains: the trait promises zeros).
//! Reuse is safe because every op runs on the one stream: a reused buffer's next writer is
//! queued after its last reader. cudarc's per-buffer event tracking is switched off for the same
//! reason (it would cost two event records per launch).
//!
//! Downloads of more than a few pages go through a pinned staging buffer: a pageable
//! device-to-host copy of the 1 MB of logits took ~300 µs, ~100 µs this way.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{
    result, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, PinnedHostSlice,
};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor};

/// The CUDA release whose driver API the bindings were generated for (cudarc's `cuda-13000`).
const MIN_DRIVER_VERSION: i32 = 13000;

/// Every CUDA failure the backend reports as an error (rather than a panic) goes through here,
/// so that moving it to a dedicated error variant is a one-line change.
pub(super) fn cuda_error(message: impl std::fmt::Display) -> Error {
    Error::Cuda(message.to_string())
}

/// Runs `f`, turning a panic inside cudarc (it panics when a shared library or symbol cannot
/// be loaded) into an error.
pub(super) fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(cuda_error(format!("{what}: {}", panic_message(&*payload)))),
    }
}

/// The message of a caught panic.
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic")
}

/// Whether the CUDA driver library can be loaded at all. Never panics.
pub(super) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its known names, then closes it.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, 0 when there is no driver or it fails to initialise. Never panics.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    no_panic("counting devices", || {
        result::init().map_err(cuda_error)?;
        Ok(CudaContext::device_count().map_err(cuda_error)?.max(0) as usize)
    })
    .unwrap_or(0)
}

/// One GPU: its context, the stream all work is queued on, and what the launchers need to know
/// about it.
pub(super) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub sm_count: u32,
    /// Largest dynamic shared memory a block may opt in to, bytes.
    pub max_smem_optin: u32,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    cache: Arc<BufCache>,
    /// Page-locked staging for large downloads, grown on demand.
    staging: Mutex<Option<PinnedHostSlice<f32>>>,
    /// A second stream, for allocations while `stream` is being captured (an allocation on
    /// the capturing stream would become a node of the graph).
    side: Arc<CudaStream>,
    /// Set while `stream` is captured into a graph.
    capturing: AtomicBool,
    /// Kernels of recorded decode steps are launched with programmatic dependent launch
    /// (sm_90 and newer, unless `CudaOptions::pdl` is off)...
    pdl: bool,
    /// ...when the operation before on the stream is a kernel of ours. Outside recorded steps
    /// (copies, cuBLAS) launches keep plain stream order: a kernel launched this way right
    /// after a copy read stale data on an H200 (the prefill's cache writes).
    prev_kernel: AtomicBool,
    /// The current decode step's token ids and positions, where recorded steps read them.
    step: StepInputs,
    /// Bumped by every op's `bind` and by everything queued on the stream (kernels, copies,
    /// memsets, captures): equal values mean nothing ran in between ([`Device::work_seq`]).
    work: AtomicU64,
}

/// Rows a recorded decode step can carry: the step-input buffer holds this many token ids and
/// as many positions.
pub(super) const MAX_STEP_ROWS: usize = 1024;

/// `[ids; MAX_STEP_ROWS]` then `[positions; MAX_STEP_ROWS]` (u32) on the device at a fixed
/// address, refilled from pinned host memory before each step, and the rows of this step.
struct StepInputs {
    _buf: CudaSlice<u32>,
    ptr: u64,
    host: Mutex<PinnedHostSlice<u32>>,
    rows: AtomicUsize,
}

/// The buffers a captured graph's kernels use on every replay; back to the free list on drop.
pub(super) struct Captured {
    buffers: Vec<CudaSlice<f32>>,
    cache: Arc<BufCache>,
}

impl Drop for Captured {
    fn drop(&mut self) {
        for b in self.buffers.drain(..) {
            self.cache.put_free(b);
        }
    }
}

/// Downloads of at least this many floats go through the pinned staging buffer.
const PINNED_MIN_FLOATS: usize = 16 << 10;

/// Dropped `f32` device buffers by allocated length, for reuse (see the module docs).
#[derive(Default)]
pub(super) struct BufCache {
    free: Mutex<HashMap<usize, Vec<CudaSlice<f32>>>>,
    /// While a graph is being captured, the buffers dropped meanwhile: the graph's kernels
    /// keep using their addresses on every replay, so they belong to the recording.
    captured: Mutex<Option<Vec<CudaSlice<f32>>>>,
}

impl BufCache {
    /// Buffers larger than this (KV caches) go back to the pool rather than the free list.
    const MAX_BUF_BYTES: usize = 256 << 20;
    /// The free list stops growing here.
    const MAX_TOTAL_BYTES: usize = 2 << 30;

    fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        self.free.lock().ok()?.get_mut(&len)?.pop()
    }

    fn put(&self, data: CudaSlice<f32>) {
        if let Ok(mut captured) = self.captured.lock() {
            if let Some(kept) = captured.as_mut() {
                kept.push(data);
                return;
            }
        }
        self.put_free(data);
    }

    /// Returns a buffer to the free list (or the pool), bypassing a capture in progress.
    pub(super) fn put_free(&self, data: CudaSlice<f32>) {
        let bytes = data.len() * 4;
        if bytes > Self::MAX_BUF_BYTES {
            return;
        }
        let Ok(mut free) = self.free.lock() else { return };
        let total: usize = free.iter().map(|(len, v)| len * 4 * v.len()).sum();
        if total + bytes <= Self::MAX_TOTAL_BYTES {
            free.entry(data.len()).or_default().push(data);
        }
    }
}

impl Device {
    /// Opens device `ordinal`; `pdl`: [`super::CudaOptions::pdl`].
    pub fn open(ordinal: usize, pdl: bool) -> Result<Device> {
        if !driver_present() {
            return Err(cuda_error(
                "the NVIDIA driver library (libcuda.so) was not found: this machine has no CUDA driver",
            ));
        }
        no_panic("opening the device", || Device::open_inner(ordinal, pdl))
    }

    fn open_inner(ordinal: usize, pdl: bool) -> Result<Device> {
        result::init().map_err(|e| cuda_error(format!("cuInit failed ({e}): no usable GPU")))?;
        let mut driver_version = 0i32;
        // SAFETY: writes one int; the driver is initialised.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| cuda_error(format!("cuDriverGetVersion: {e}")))?;
        if driver_version < MIN_DRIVER_VERSION {
            return Err(cuda_error(format!(
                "the driver supports CUDA {}.{}; strix needs a CUDA {}.{} driver or newer",
                driver_version / 1000,
                driver_version % 1000 / 10,
                MIN_DRIVER_VERSION / 1000,
                MIN_DRIVER_VERSION % 1000 / 10
            )));
        }
        let count = CudaContext::device_count().map_err(cuda_error)?.max(0) as usize;
        if ordinal >= count {
            return Err(cuda_error(format!("there is no CUDA device {ordinal}: {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error(format!("device {ordinal}: {e}")))?;
        // SAFETY: every buffer of this backend is used on `stream` only, so stream order
        // already orders all accesses; nothing was allocated on this context object before.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_error)?;
        let cc = ctx.compute_capability().map_err(cuda_error)?;
        let attr = |a| ctx.attribute(a).map_err(cuda_error);
        let sm_count = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem_optin =
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        if ctx.has_async_alloc() {
            // SAFETY: the device handle comes from the live context; the attribute takes a u64.
            unsafe {
                let pool = result::device::get_default_mem_pool(ctx.cu_device()).map_err(cuda_error)?;
                let mut threshold = u64::MAX;
                result::mem_pool::set_attribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut c_void,
                )
                .map_err(cuda_error)?;
            }
        }
        let name = ctx.name().map_err(cuda_error)?;
        let side = ctx.new_stream().map_err(cuda_error)?;
        // SAFETY: written (step inputs) before any kernel reads them.
        let step_buf = unsafe { stream.alloc::<u32>(2 * MAX_STEP_ROWS) }.map_err(cuda_error)?;
        let step_ptr = step_buf.device_ptr(&stream).0;
        // SAFETY: as above; host-written before each copy.
        let step_host =
            unsafe { ctx.alloc_pinned_with_flags::<u32>(2 * MAX_STEP_ROWS, 0) }.map_err(cuda_error)?;
        Ok(Device {
            ctx,
            stream,
            ordinal,
            name,
            cc,
            sm_count,
            max_smem_optin,
            driver_version,
            cache: Arc::default(),
            staging: Mutex::new(None),
            side,
            capturing: AtomicBool::new(false),
            pdl: cc.0 >= 9 && pdl,
            prev_kernel: AtomicBool::new(false),
            step: StepInputs {
                _buf: step_buf,
                ptr: step_ptr,
                host: Mutex::new(step_host),
                rows: AtomicUsize::new(0),
            },
            work: AtomicU64::new(0),
        })
    }

    /// Makes the context current on the calling thread (the model may be driven from any
    /// thread) as an op starts, which counts as work ([`Device::work_seq`]). Panics on a
    /// sticky error recorded by an earlier asynchronous failure.
    pub fn bind(&self) {
        self.bump_work();
        self.bind_context();
    }

    /// [`Device::bind`] for what writes no buffer (an allocation): not counted as work, so a
    /// producer's quantization stays current across it.
    pub fn bind_context(&self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            panic!("cuda: device {} is in an error state: {e}", self.ordinal);
        }
    }

    /// A number that changes whenever an op starts (`bind`) or work is queued on the stream:
    /// if it reads the same at two points, no kernel, copy or op ran between them. A kernel's
    /// side output (`quant.rs`: activations quantized by the kernel that wrote them) is valid
    /// for the next op only while this still reads what it read right after that kernel.
    pub fn work_seq(&self) -> u64 {
        self.work.load(Ordering::SeqCst)
    }

    fn bump_work(&self) {
        self.work.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits for all queued work; asynchronous kernel faults surface here.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(cuda_error)?;
        self.stream.synchronize().map_err(|e| cuda_error(format!("a queued kernel or copy failed: {e}")))
    }

    /// `len` elements of uninitialised device memory (at least one element is allocated, so
    /// every buffer has a valid pointer).
    fn alloc_raw<T: DeviceRepr>(&self, len: usize) -> Result<(CudaSlice<T>, u64)> {
        let what = |e| cuda_error(format!("allocating {} bytes: {e}", len.max(1) * std::mem::size_of::<T>()));
        let data = if self.is_capturing() {
            // Allocated on the side stream and waited for, then owned by `stream` (which frees
            // it, stream-ordered, when it is dropped).
            // SAFETY: as below; the pointer is leaked from one slice into the other.
            unsafe {
                let side = self.side.alloc::<T>(len.max(1)).map_err(what)?;
                self.side.synchronize().map_err(what)?;
                self.stream.upgrade_device_ptr::<T>(side.leak(), len.max(1))
            }
        } else {
            // SAFETY: the contents are uninitialised; every caller writes before anything reads.
            unsafe { self.stream.alloc::<T>(len.max(1)) }.map_err(what)?
        };
        // With event tracking off the guard returned beside the pointer records nothing.
        let ptr = data.device_ptr(&self.stream).0;
        Ok((data, ptr))
    }

    /// `len` floats of uninitialised device memory, from the free list when it has a buffer
    /// of that size.
    pub fn alloc(&self, len: usize) -> Result<CudaBuf> {
        let data = match self.cache.take(len.max(1)) {
            Some(data) => data,
            None => self.alloc_raw::<f32>(len)?.0,
        };
        let ptr = data.device_ptr(&self.stream).0;
        Ok(CudaBuf { data: Some(data), ptr, len, cache: self.cache.clone(), quantized: None })
    }

    pub fn zeros(&self, len: usize) -> Result<CudaBuf> {
        let buf = self.alloc(len)?;
        self.memset_zero(buf.ptr, len * 4);
        Ok(buf)
    }

    /// Scratch of `len` 16-bit elements (bf16 activations for cuBLAS).
    pub fn alloc_u16(&self, len: usize) -> Result<(CudaSlice<u16>, u64)> {
        self.alloc_raw::<u16>(len)
    }

    pub fn upload_f32(&self, data: &[f32]) -> Result<CudaBuf> {
        let buf = self.alloc(data.len())?;
        self.copy_htod(buf.ptr, data)?;
        Ok(buf)
    }

    pub fn upload_u32(&self, data: &[u32]) -> Result<(CudaBuf, u64)> {
        self.upload_words(data)
    }

    /// Device pointers (or any u64s) for a kernel to read.
    pub fn upload_u64(&self, data: &[u64]) -> Result<(CudaBuf, u64)> {
        self.upload_words(data)
    }

    /// Small constant data for a kernel (ids, positions, pointers), in a buffer of whole
    /// floats. While capturing, the data is copied at once and synchronously rather than
    /// recorded (the stream was drained before the capture began, and the recording keeps the
    /// buffer), so a recorded step holds kernels only.
    pub fn upload_words<T: Copy>(&self, data: &[T]) -> Result<(CudaBuf, u64)> {
        let bytes = std::mem::size_of_val(data);
        self.bump_work();
        let buf = self.alloc(bytes.div_ceil(4))?;
        let ptr = buf.ptr;
        if !self.is_capturing() {
            self.copy_htod(ptr, data)?;
        } else if bytes > 0 {
            // SAFETY: `ptr` is a live allocation of at least `bytes` that no queued work uses.
            unsafe { result::memcpy_htod_sync(ptr, data) }
                .map_err(|e| cuda_error(format!("upload of {bytes} bytes while capturing: {e}")))?;
        }
        Ok((buf, ptr))
    }

    // --- recorded decode steps ----------------------------------------------------------------

    pub fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed)
    }

    /// Device addresses of the step's token ids and positions and its row count, while a
    /// step is being captured: ops read these instead of uploading host values, so a replay
    /// sees the values of the step it replays.
    pub fn step_inputs(&self) -> Option<(u64, u64, usize)> {
        self.is_capturing().then(|| {
            (
                self.step.ptr,
                self.step.ptr + (MAX_STEP_ROWS * 4) as u64,
                self.step.rows.load(Ordering::Relaxed),
            )
        })
    }

    /// The token ids of an embedding gather on the device: a recorded step's (where each
    /// replay's are written), else uploaded (the buffer lives as long as the guard).
    pub fn ids_on_device(&self, ids: &[u32]) -> (Option<CudaBuf>, u64) {
        if let Some((step_ids, _, rows)) = self.step_inputs() {
            assert_eq!(rows, ids.len(), "embed: a recorded step of {rows} rows");
            return (None, step_ids);
        }
        let (buf, ptr) = self.upload_u32(ids).unwrap_or_else(|e| panic!("{e}"));
        (Some(buf), ptr)
    }

    /// The positions of a call's rows on the device, as [`Device::ids_on_device`] gives ids.
    pub fn positions_on_device(&self, positions: &[usize]) -> (Option<CudaBuf>, u64) {
        if let Some((_, step_positions, rows)) = self.step_inputs() {
            assert_eq!(rows, positions.len(), "attention: a recorded step of {rows} rows");
            return (None, step_positions);
        }
        let pos: Vec<u32> =
            positions.iter().map(|&p| u32::try_from(p).expect("position beyond u32")).collect();
        let (buf, ptr) = self.upload_u32(&pos).unwrap_or_else(|e| panic!("{e}"));
        (Some(buf), ptr)
    }

    /// Queues the copy of a step's ids and positions into the step-input buffer.
    pub fn write_step_inputs(&self, ids: &[u32], positions: &[usize]) -> Result<()> {
        let n = ids.len();
        self.bump_work();
        if n > MAX_STEP_ROWS || positions.len() != n {
            return Err(cuda_error(format!("a recorded step carries at most {MAX_STEP_ROWS} rows, not {n}")));
        }
        let mut host = self.step.host.lock().map_err(|_| cuda_error("step input lock poisoned"))?;
        // Waits for nothing: the previous step's download synchronised the stream, so its copy
        // out of this buffer is done.
        let h = host.as_mut_slice().map_err(cuda_error)?;
        h[..n].copy_from_slice(ids);
        for (d, &p) in h[MAX_STEP_ROWS..MAX_STEP_ROWS + n].iter_mut().zip(positions) {
            *d = u32::try_from(p).map_err(|_| cuda_error(format!("position {p} beyond u32")))?;
        }
        let what = |e| cuda_error(format!("step inputs: {e}"));
        // SAFETY: both ranges lie inside the 2 * MAX_STEP_ROWS words of the buffers.
        unsafe {
            let src = host.as_slice().map_err(what)?;
            result::memcpy_htod_async(self.step.ptr, &src[..n], self.stream.cu_stream()).map_err(what)?;
            result::memcpy_htod_async(
                self.step.ptr + (MAX_STEP_ROWS * 4) as u64,
                &src[MAX_STEP_ROWS..MAX_STEP_ROWS + n],
                self.stream.cu_stream(),
            )
            .map_err(what)?;
        }
        self.step.rows.store(n, Ordering::Relaxed);
        Ok(())
    }

    /// Starts capturing the stream into a graph, once the stream has drained (uploads made
    /// while capturing are synchronous copies into buffers the drained stream no longer uses).
    /// Relaxed mode: those copies and the side-stream allocations are not stream work.
    pub fn begin_capture(&self) -> Result<()> {
        self.bump_work();
        self.synchronize()?;
        *self.cache.captured.lock().map_err(|_| cuda_error("capture lock poisoned"))? = Some(Vec::new());
        self.capturing.store(true, Ordering::Relaxed);
        self.prev_kernel.store(false, Ordering::Relaxed);
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| cuda_error(format!("beginning a graph capture: {e}")))
    }

    /// Ends a capture: the instantiated graph (an error when the capture failed) and what it
    /// must keep alive.
    pub fn end_capture(&self) -> (Result<cudarc::driver::CudaGraph>, Captured) {
        self.bump_work();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| cuda_error(format!("ending a graph capture: {e}")))
            .and_then(|g| g.ok_or_else(|| cuda_error("the graph capture recorded nothing")));
        self.capturing.store(false, Ordering::Relaxed);
        let buffers = self.cache.captured.lock().ok().and_then(|mut c| c.take()).unwrap_or_default();
        (graph, Captured { buffers, cache: self.cache.clone() })
    }

    /// A `[rows, cols]` weight: the GGML block formats stay packed (regrouped for the kernels
    /// by [`super::packed::repack`], the same bytes); bf16 tensors are copied as they are, f16
    /// and f32 ones rounded to bf16 (nearest even) on the host (all cores) first.
    pub fn upload_weight(&self, t: &HostTensor, rows: usize, cols: usize) -> Result<CudaWeight> {
        t.check_matrix(rows, cols)?;
        if t.dtype.is_quantized() {
            let packed = super::packed::repack(t.dtype, t.bytes.as_slice(), rows, cols);
            let (data, ptr) = self.alloc_raw::<u16>(packed.len().div_ceil(2))?;
            self.copy_htod(ptr, &packed)?;
            return Ok(CudaWeight { _data: data, ptr, rows, cols, dtype: t.dtype });
        }
        let n = rows * cols;
        let (data, ptr) = self.alloc_raw::<u16>(n)?;
        let bytes = t.bytes.as_slice();
        match t.dtype {
            DType::BF16 => self.copy_htod(ptr, bytes)?,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q6_K => unreachable!("uploaded packed above"),
            DType::F16 | DType::F32 => {
                let mut bf = vec![0u16; n];
                let f16 = t.dtype == DType::F16;
                bf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, chunk)| {
                    let size = if f16 { 2 } else { 4 };
                    let src = &bytes[i * (1 << 16) * size..];
                    for (k, o) in chunk.iter_mut().enumerate() {
                        let b = &src[k * size..(k + 1) * size];
                        let x = if f16 {
                            half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
                        } else {
                            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                        };
                        *o = half::bf16::from_f32(x).to_bits();
                    }
                });
                self.copy_htod(ptr, &bf)?;
            }
        }
        Ok(CudaWeight { _data: data, ptr, rows, cols, dtype: DType::BF16 })
    }

    /// Queues a copy from host memory. The source may be dropped on return: from pageable
    /// memory the driver stages the bytes before `cuMemcpyHtoDAsync` returns.
    pub fn copy_htod<T>(&self, dst: u64, src: &[T]) -> Result<()> {
        self.bump_work();
        self.prev_kernel.store(false, Ordering::Relaxed);
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is a live allocation of at least `size_of_val(src)` bytes (callers
        // allocate it for `src`).
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(|e| {
            cuda_error(format!("host-to-device copy of {} bytes: {e}", std::mem::size_of_val(src)))
        })
    }

    /// Copies `dst.len()` floats to host memory through the pinned staging buffer (pageable
    /// copies are several times slower) and waits for it.
    pub fn download_f32(&self, dst: &mut [f32], src: u64) -> Result<()> {
        if dst.len() < PINNED_MIN_FLOATS {
            return self.copy_dtoh(dst, src);
        }
        let mut staging = self.staging.lock().map_err(|_| cuda_error("staging buffer lock poisoned"))?;
        if staging.as_ref().is_none_or(|s| s.len() < dst.len()) {
            // Cacheable (not write-combined) memory: the host reads it back.
            // SAFETY: the contents are written by the copy below before they are read.
            *staging = Some(
                unsafe { self.ctx.alloc_pinned_with_flags::<f32>(dst.len(), 0) }
                    .map_err(|e| cuda_error(format!("pinned staging of {} bytes: {e}", dst.len() * 4)))?,
            );
        }
        let Some(pinned) = staging.as_mut() else { unreachable!("allocated above") };
        let host = pinned.as_mut_slice().map_err(cuda_error)?;
        self.copy_dtoh(&mut host[..dst.len()], src)?;
        dst.copy_from_slice(&host[..dst.len()]);
        Ok(())
    }

    /// Copies to host memory and waits for it (and for everything queued before it).
    pub fn copy_dtoh<T>(&self, dst: &mut [T], src: u64) -> Result<()> {
        self.bump_work();
        self.prev_kernel.store(false, Ordering::Relaxed);
        if !dst.is_empty() {
            // SAFETY: `src` points at least `size_of_val(dst)` readable device bytes.
            unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| cuda_error(format!("device-to-host copy: {e}")))?;
        }
        self.synchronize()
    }

    pub fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) {
        self.bump_work();
        self.prev_kernel.store(false, Ordering::Relaxed);
        if bytes == 0 {
            return;
        }
        // SAFETY: callers pass ranges inside live allocations.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .unwrap_or_else(|e| panic!("cuda: device-to-device copy of {bytes} bytes: {e}"));
    }

    pub fn memset_zero(&self, dst: u64, bytes: usize) {
        self.bump_work();
        self.prev_kernel.store(false, Ordering::Relaxed);
        if bytes == 0 {
            return;
        }
        // SAFETY: callers pass a range inside a live allocation.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .unwrap_or_else(|e| panic!("cuda: memset of {bytes} bytes: {e}"));
    }

    /// Queues `f` on the stream. `args` point at values of exactly the kernel's parameter
    /// types, in order (u64 for pointers, i32 for int, i64 for long long, f32 for float).
    pub fn launch(
        &self,
        what: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) {
        self.launch_clustered(what, f, grid, block, smem, 1, args)
    }

    /// [`Device::launch`] with the blocks grouped into thread-block clusters of `cluster`
    /// consecutive blocks along x (`grid.0` a multiple of it; at most 8, the portable size).
    // The launch configuration as `cuLaunchKernelEx` takes it, field for field.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_clustered(
        &self,
        what: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        cluster: u32,
        args: &mut [*mut c_void],
    ) {
        self.bump_work();
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        assert!(
            (1..=8).contains(&cluster) && grid.0.is_multiple_of(cluster),
            "cuda: {what}: clusters of {cluster} blocks over a grid of {grid:?}"
        );
        // SAFETY: `f` is a loaded kernel of this context; the launchers pass argument lists
        // that match the kernel signatures beside them and pointers into live allocations
        // sized for the launch (each launcher asserts the lengths first).
        let pdl = self.pdl && self.is_capturing() && self.prev_kernel.load(Ordering::Relaxed);
        self.prev_kernel.store(true, Ordering::Relaxed);
        let r = unsafe {
            if pdl || cluster > 1 {
                let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
                let mut n = 0;
                if pdl {
                    // Every kernel waits for its predecessor (`pdl_enter` in prelude.cu) before
                    // touching activations, so it may be scheduled while that one still runs.
                    attrs[n].id =
                        sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                    attrs[n].value.programmaticStreamSerializationAllowed = 1;
                    n += 1;
                }
                if cluster > 1 {
                    attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                    attrs[n].value.clusterDim.x = cluster;
                    attrs[n].value.clusterDim.y = 1;
                    attrs[n].value.clusterDim.z = 1;
                    n += 1;
                }
                let config = sys::CUlaunchConfig {
                    gridDimX: grid.0,
                    gridDimY: grid.1,
                    gridDimZ: grid.2,
                    blockDimX: block.0,
                    blockDimY: block.1,
                    blockDimZ: block.2,
                    sharedMemBytes: smem,
                    hStream: self.stream.cu_stream(),
                    attrs: attrs.as_mut_ptr(),
                    numAttrs: n as u32,
                };
                sys::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut())
                    .result()
            } else {
                result::launch_kernel(f.cu_function(), grid, block, smem, self.stream.cu_stream(), args)
            }
        };
        r.unwrap_or_else(|e| panic!("cuda: launching {what} (grid {grid:?}, block {block:?}): {e}"));
    }

    /// Blocks for a grid-stride loop over `n` elements with `threads` per block: enough to
    /// fill the device a few times over, no more.
    pub fn grid_for(&self, n: usize, threads: usize) -> u32 {
        n.div_ceil(threads).clamp(1, self.sm_count as usize * 16) as u32
    }
}

/// Pointers to the kernel arguments, for [`Device::launch`]. Every argument must be a place
/// or a temporary that lives to the end of the statement holding the launch.
macro_rules! kernel_args {
    ($($a:expr),* $(,)?) => {
        &mut [$(&$a as *const _ as *mut ::std::ffi::c_void),*]
    };
}
pub(super) use kernel_args;

/// An `f32` buffer in device memory: [`crate::backend::Backend::Buf`] of the CUDA backend.
pub struct CudaBuf {
    /// Owns the allocation; on drop it goes to the free list (or back to the pool).
    data: Option<CudaSlice<f32>>,
    ptr: u64,
    len: usize,
    cache: Arc<BufCache>,
    /// The first row as the packed GEMVs take it, written beside it by the kernel that wrote
    /// the row ([`CudaBuf::attach_quantized`]).
    quantized: Option<Box<QuantizedRow>>,
}

/// A buffer's first `cols` values quantized by their producer, and [`Device::work_seq`] right
/// after that kernel: while it still reads the same, nothing has rewritten them.
struct QuantizedRow {
    xq: XQuant,
    cols: usize,
    seq: u64,
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        if let Some(data) = self.data.take() {
            self.cache.put(data);
        }
    }
}

impl CudaBuf {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of element `i`.
    pub(super) fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * 4) as u64
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Attaches `xq`, the first `cols` values of this buffer quantized by the kernel just
    /// queued (a producer's side output, `quant.rs`). It serves the next op only: once more
    /// work reaches the device ([`Device::work_seq`] moves), it is stale.
    pub(super) fn attach_quantized(&mut self, dev: &Device, xq: XQuant, cols: usize) {
        self.quantized = Some(Box::new(QuantizedRow { xq, cols, seq: dev.work_seq() }));
    }

    /// The quantization a producer attached of this buffer's first `cols` values, if nothing
    /// has run on the device since.
    pub(super) fn quantized(&self, dev: &Device, cols: usize) -> Option<&XQuant> {
        self.quantized.as_deref().filter(|q| q.cols == cols && q.seq == dev.work_seq()).map(|q| &q.xq)
    }
}

/// The activations of a matmul quantized for the packed GEMVs: `[tokens, cols]` i8, then a
/// scale per 32 and a sum per 16 quants (one f32 buffer, carved up), as `quantize_x` or a
/// producer's side output writes them.
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

/// A `[rows, cols]` matrix in device memory: bf16, or packed GGML blocks (`dtype`) in the
/// layout `quant.cu` describes.
pub struct CudaWeight {
    _data: CudaSlice<u16>,
    ptr: u64,
    rows: usize,
    cols: usize,
    dtype: DType,
}

impl CudaWeight {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub(super) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// `DType::BF16`, or the block format the weight is packed in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes on the device (2 per element in bf16; the blocks' bytes when packed).
    pub fn bytes(&self) -> usize {
        self.rows * self.dtype.row_bytes(self.cols).unwrap_or(self.cols * 2)
    }

    /// Uninitialised bf16 scratch of `[rows, cols]` (a dequantized band of a packed weight).
    pub(super) fn scratch_bf16(dev: &Device, rows: usize, cols: usize) -> Result<CudaWeight> {
        let (data, ptr) = dev.alloc_raw::<u16>(rows * cols)?;
        Ok(CudaWeight { _data: data, ptr, rows, cols, dtype: DType::BF16 })
    }
}
