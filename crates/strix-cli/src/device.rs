//! Where a command runs: `--device auto|cpu|cuda|cuda:N` with its KV cache type (`--kv-cache
//! bf16|f32`), opened once at the top of each command, and what the commands need from a backend beyond the [`Backend`] ops (memory use,
//! bandwidth, kernel-path counters), so the command code itself is written once, generic over
//! the backend.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{anyhow, Result};
use clap::Args;
use rayon::prelude::*;
use serde_json::{Map, Value};
use strix::backend::cpu::optimes::{OpKey, OpTimes, OpTotal};
use strix::backend::cpu::{CpuBackend, CpuOptions};
use strix::backend::cuda::{self, CudaBackend, CudaOptions};
use strix::backend::{Backend, KvCacheType};
use strix::model::Model;

/// The `--device` flag's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// CUDA device 0 when one is present and usable, else the CPU.
    Auto,
    Cpu,
    /// A CUDA device by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("`{s}` is not a device: use auto, cpu, cuda or cuda:N")),
        }
    }
}

/// The device flag, flattened into every command that runs the model.
#[derive(Args, Debug)]
pub struct DeviceArgs {
    /// Where to run: auto (the first CUDA GPU when one is usable, else the CPU), cpu, cuda,
    /// or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "auto", env = "STRIX_DEVICE")]
    pub device: Device,

    /// Element type of the attention layers' KV cache: bf16 (the CUDA default: half the memory,
    /// rows rounded to nearest even when written) or f32 (exact; the CPU's only type)
    #[arg(long, value_name = "TYPE", env = "STRIX_KV_CACHE")]
    pub kv_cache: Option<KvCacheType>,

    /// Most prompt tokens pushed through the layers in one pass, a multiple of 64 (longer
    /// prompts are split into passes; llama.cpp's --ubatch-size): larger is faster on a GPU
    /// and needs more scratch memory [default: 4096 on CUDA, 512 on the CPU]
    #[arg(long, value_name = "N", env = "STRIX_UBATCH", value_parser = crate::limits::tokens)]
    pub ubatch: Option<usize>,
}

impl DeviceArgs {
    /// Applies the flags that shape a loaded model (`--ubatch`).
    pub fn configure<B: Backend>(&self, model: &mut Model<B>) -> Result<()> {
        if let Some(n) = self.ubatch {
            model.set_pass_tokens(n).map_err(|e| anyhow!("--ubatch {n}: {e}"))?;
        }
        Ok(())
    }
}

/// The opened backend. Commands match on it once (see [`with_backend!`]) and run their
/// generic code with the backend inside.
// One per process, moved straight into the model (which owns its backend by value), so the
// size difference costs nothing and boxing would need a `Backend` impl for `Box`.
#[allow(clippy::large_enum_variant)]
pub enum Opened {
    Cpu(CpuBackend),
    Cuda(CudaBackend),
}

/// Runs `$body` with `$b` bound to the backend inside an [`Opened`]: the one place where the
/// backends are told apart; the body is compiled once per backend.
macro_rules! with_backend {
    ($opened:expr, $b:ident => $body:expr) => {
        match $opened {
            $crate::device::Opened::Cpu($b) => $body,
            $crate::device::Opened::Cuda($b) => $body,
        }
    };
}
pub(crate) use with_backend;

/// The CUDA error without the library's `cuda: ` prefix, which the caller's message repeats.
fn cuda_reason(e: &strix::Error) -> String {
    let text = e.to_string();
    text.strip_prefix("cuda: ").unwrap_or(&text).to_string()
}

/// Opens the backend `args.device` names, with the KV cache type `args.kv_cache` asks for
/// (bf16 on CUDA and f32 on the CPU when it asks for none; bf16 on the CPU is an error: its
/// cache is the exact f32 reference). `--device cuda` without a usable GPU is an error; `auto`
/// falls back to the CPU (silently when there is no GPU at all, with a warning when there is
/// one that cannot be used, since that is probably not what the user wants). With `verbose`
/// the choice is reported on stderr.
pub fn open(args: &DeviceArgs, verbose: bool) -> Result<Opened> {
    let opened = open_device(args.device, args.kv_cache, verbose)?;
    if let (Opened::Cpu(_), Some(KvCacheType::Bf16)) = (&opened, args.kv_cache) {
        return Err(anyhow!(
            "--kv-cache bf16: the CPU backend keeps its KV cache in f32 (exact); use --kv-cache f32 \
             or --device cuda"
        ));
    }
    if verbose {
        eprintln!("strix: KV cache: {}", with_backend!(&opened, b => b.kv_cache_type()));
    }
    Ok(opened)
}

/// The CPU backend, with its options from the environment: `STRIX_NO_VNNI=1` keeps the packed
/// int8 kernels on AVX2 where the CPU has AVX-512 VNNI (to measure one against the other).
fn cpu_backend() -> CpuBackend {
    let no_vnni = std::env::var_os("STRIX_NO_VNNI").is_some_and(|v| !v.is_empty() && v != "0");
    CpuBackend::with_options(CpuOptions { no_vnni })
}

/// The CUDA backend's options from the environment (`STRIX_CUDA_GRAPHS`, `STRIX_CUDA_PDL`,
/// `STRIX_CUDA_GEMV`, `STRIX_CUDA_MMA_KERNEL`, `STRIX_CUDA_MMA_TILES`, `STRIX_GDN_DECODE_COLS`,
/// `STRIX_PRODUCER_QUANT`, `STRIX_KERNEL_CACHE`: see [`CudaOptions`]); a value that does not
/// parse is an error naming the variable. `kv_cache` is the `--kv-cache` flag's type (bf16
/// when it names none).
fn cuda_options(kv_cache: Option<KvCacheType>) -> Result<CudaOptions> {
    let options = CudaOptions::from_vars(|k| std::env::var(k).ok()).map_err(|e| anyhow!("{e}"))?;
    Ok(CudaOptions { kv_cache: kv_cache.unwrap_or(options.kv_cache), ..options })
}

fn open_device(device: Device, kv_cache: Option<KvCacheType>, verbose: bool) -> Result<Opened> {
    let opened = match device {
        Device::Cpu => {
            if verbose {
                eprintln!("strix: device: cpu (--device cpu)");
            }
            return Ok(Opened::Cpu(cpu_backend()));
        }
        Device::Cuda(n) => {
            let backend = CudaBackend::with_options(n, &cuda_options(kv_cache)?)
                .map_err(|e| anyhow!("--device cuda:{n}: {}", cuda_reason(&e)))?;
            Opened::Cuda(backend)
        }
        Device::Auto => {
            // device_count() answers 0 without a driver, so machines without CUDA never try
            // (and never pay for) loading the kernels.
            if cuda::device_count() == 0 {
                if verbose {
                    eprintln!("strix: device: cpu (no CUDA device found)");
                }
                return Ok(Opened::Cpu(cpu_backend()));
            }
            match CudaBackend::with_options(0, &cuda_options(kv_cache)?) {
                Ok(backend) => Opened::Cuda(backend),
                Err(e) => {
                    eprintln!(
                        "strix: warning: a CUDA device is present but cannot be used ({}); running on the CPU",
                        cuda_reason(&e)
                    );
                    return Ok(Opened::Cpu(cpu_backend()));
                }
            }
        }
    };
    if verbose {
        if let Opened::Cuda(b) = &opened {
            eprintln!("strix: device: {}", b.name());
        }
    }
    Ok(opened)
}

/// What the commands ask of a backend beyond the model's ops.
pub trait DeviceInfo: Backend {
    /// `cpu` or `cuda`.
    fn kind(&self) -> &'static str;

    /// Bytes of memory in use now: the process's resident set on the CPU; on a GPU, total
    /// minus free as the driver reports it (every process's allocations and the context).
    fn memory_used(&self) -> Option<u64>;

    /// Bytes of memory the device has (`None` on the CPU, where it is not ours to report).
    fn memory_total(&self) -> Option<u64>;

    /// Bytes that can still be allocated: the host's `MemAvailable` on the CPU, free device
    /// memory on a GPU (`None` when unknown).
    fn available_memory(&self) -> Option<u64>;

    /// Default size of the bandwidth probe: it must dwarf the caches (the H200's L2 is 60 MB).
    fn default_bandwidth_mib(&self) -> usize;

    /// Measured memory bandwidth in GB/s over a `bytes`-byte buffer.
    fn measure_bandwidth(&self, bytes: usize) -> Result<f64>;

    /// How [`DeviceInfo::measure_bandwidth`] measures, for the report.
    fn bandwidth_method(&self) -> &'static str;

    /// The kernel-path counters since the backend was made, by name (`None` when the backend
    /// keeps none).
    fn path_counts(&self) -> Option<Map<String, Value>>;

    /// Tunes the decode kernels for one sequence at a time (`true`: `strix run`, `chat`) or
    /// for batches (`false`: `strix serve`, the default). On CUDA this picks the CUDA-core
    /// GEMV, which streams faster at batch 1, or the tensor-core one, which reads the weights
    /// once for many sequences. Either is bitwise batch-invariant on its own, so within a
    /// process a sequence's tokens never depend on the batch. Returns what the report calls it.
    fn tune_for_single_stream(&self, single: bool) -> &'static str;

    /// Starts adding the wall time of every op to a table ([`DeviceInfo::op_times`]); `false`
    /// where the backend keeps none (CUDA, whose ops return before they run).
    fn keep_op_times(&mut self) -> bool {
        false
    }

    /// The op times kept so far, by op (and weight dtype and shape).
    fn op_times(&self) -> Option<OpTable> {
        None
    }
}

/// Calls and wall time per op, as [`DeviceInfo::op_times`] reports them.
pub type OpTable = std::collections::BTreeMap<OpKey, OpTotal>;

impl DeviceInfo for CpuBackend {
    fn kind(&self) -> &'static str {
        "cpu"
    }

    fn memory_used(&self) -> Option<u64> {
        resident_set_bytes()
    }

    fn memory_total(&self) -> Option<u64> {
        None
    }

    fn available_memory(&self) -> Option<u64> {
        host_available_bytes()
    }

    fn default_bandwidth_mib(&self) -> usize {
        1024
    }

    fn measure_bandwidth(&self, bytes: usize) -> Result<f64> {
        Ok(host_read_bandwidth(bytes))
    }

    fn bandwidth_method(&self) -> &'static str {
        "parallel read, best of 5"
    }

    fn path_counts(&self) -> Option<Map<String, Value>> {
        None
    }

    fn tune_for_single_stream(&self, _single: bool) -> &'static str {
        "cpu kernels"
    }

    fn keep_op_times(&mut self) -> bool {
        *self = self.clone().with_op_times(std::sync::Arc::new(OpTimes::new()));
        true
    }

    fn op_times(&self) -> Option<OpTable> {
        CpuBackend::op_times(self).map(|t| t.snapshot())
    }
}

impl DeviceInfo for CudaBackend {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn memory_used(&self) -> Option<u64> {
        let (free, total) = self.memory_info().ok()?;
        Some(total.saturating_sub(free) as u64)
    }

    fn memory_total(&self) -> Option<u64> {
        self.memory_info().ok().map(|(_, total)| total as u64)
    }

    fn available_memory(&self) -> Option<u64> {
        self.memory_info().ok().map(|(free, _)| free as u64)
    }

    fn default_bandwidth_mib(&self) -> usize {
        2048
    }

    fn measure_bandwidth(&self, bytes: usize) -> Result<f64> {
        Ok(self.measure_copy_bandwidth(bytes, 20)? / 1e9)
    }

    fn bandwidth_method(&self) -> &'static str {
        "device-to-device copy, read + write, median of 20"
    }

    fn path_counts(&self) -> Option<Map<String, Value>> {
        let fields = CudaBackend::path_counts(self).named();
        Some(fields.into_iter().map(|(k, v)| (k.to_string(), Value::from(v))).collect())
    }

    fn tune_for_single_stream(&self, single: bool) -> &'static str {
        self.set_tensor_core_gemv(!single);
        if single {
            "CUDA-core GEMV (single stream)"
        } else {
            "tensor-core GEMV (batches)"
        }
    }
}

/// `after − before` for every counter: what one measurement ran.
pub fn path_count_delta(before: &Map<String, Value>, after: &Map<String, Value>) -> Map<String, Value> {
    after
        .iter()
        .map(|(k, v)| {
            let a = v.as_u64().unwrap_or(0);
            let b = before.get(k).and_then(Value::as_u64).unwrap_or(0);
            (k.clone(), Value::from(a.saturating_sub(b)))
        })
        .collect()
}

/// `gemv 10 | gemm_cublas 2 | ...`, the counters that are not zero.
pub fn path_counts_line(counts: &Map<String, Value>) -> String {
    let parts: Vec<String> =
        counts.iter().filter(|(_, v)| v.as_u64().unwrap_or(0) > 0).map(|(k, v)| format!("{k} {v}")).collect();
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(" | ")
    }
}

/// The process's resident set (`VmRSS` of /proc/self/status), in bytes.
fn resident_set_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The host memory that can be allocated without swapping (`MemAvailable` of /proc/meminfo).
fn host_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Read bandwidth in GB/s: every thread sums its share of a `bytes`-byte buffer, best of
/// five passes. The buffer is written first, so its pages are real memory rather than the
/// shared zero page.
fn host_read_bandwidth(bytes: usize) -> f64 {
    let words = (bytes / 8).max(1);
    let mut buffer = vec![0u64; words];
    buffer.par_chunks_mut(1 << 16).enumerate().for_each(|(i, chunk)| {
        for (j, w) in chunk.iter_mut().enumerate() {
            *w = (i as u64) ^ (j as u64);
        }
    });
    let chunk = words.div_ceil(rayon::current_num_threads() * 8).max(1 << 12);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let start = Instant::now();
        let sum = buffer
            .par_chunks(chunk)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        black_box(sum);
        let seconds = start.elapsed().as_secs_f64();
        if seconds > 0.0 {
            best = best.max((words * 8) as f64 / seconds / 1e9);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!("auto".parse::<Device>().unwrap(), Device::Auto);
        assert_eq!("CPU".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["cuda:", "cuda:x", "tpu", "cuda:-1"] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_cpu_refuses_a_bf16_kv_cache() {
        let args = |kv| DeviceArgs { device: Device::Cpu, kv_cache: kv, ubatch: None };
        let e = open(&args(Some(KvCacheType::Bf16)), false).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("--kv-cache bf16") && e.contains("f32"), "{e}");
        for kv in [None, Some(KvCacheType::F32)] {
            let opened = open(&args(kv), false).unwrap();
            assert_eq!(with_backend!(&opened, b => b.kv_cache_type()), KvCacheType::F32);
        }
    }

    #[test]
    fn path_count_deltas_subtract_per_counter() {
        let before: Map<String, Value> = [("gemv".to_string(), Value::from(3u64))].into_iter().collect();
        let after: Map<String, Value> =
            [("gemv".to_string(), Value::from(10u64)), ("attention".to_string(), Value::from(0u64))]
                .into_iter()
                .collect();
        let d = path_count_delta(&before, &after);
        assert_eq!(d["gemv"], 7);
        assert_eq!(path_counts_line(&d), "gemv 7");
    }
}
