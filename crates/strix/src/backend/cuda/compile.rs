//! Kernel compilation: each `.cu` source (with the shared `prelude.cu` in front) is compiled by
//! NVRTC to a cubin for the device's own architecture (`sm_90` on an H200) the first time a
//! backend needs it, then cached: in memory for the process, and on disk in the folder
//! [`super::CudaOptions::kernel_cache`] names, if any.
//! The cache key hashes the source, the architecture, the driver and NVRTC versions and the
//! compiler options, so any change to one of them compiles afresh; a cache hit loads the cubin
//! without touching NVRTC.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaModule;
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use super::device::{cuda_error, no_panic, Device};
use crate::error::Result;

const PRELUDE: &str = include_str!("prelude.cu");

/// Bumped when the way sources are put together changes, to orphan old cache entries.
const CACHE_FORMAT: &str = "strix-kernels-1";

/// How a module was obtained, for the path counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    Compiled,
    Cached,
}

/// Cubins compiled or read in this process, by cache key.
fn memo() -> &'static Mutex<HashMap<u64, Arc<Vec<u8>>>> {
    static MEMO: OnceLock<Mutex<HashMap<u64, Arc<Vec<u8>>>>> = OnceLock::new();
    MEMO.get_or_init(|| Mutex::new(HashMap::new()))
}

/// 64-bit FNV-1a over the parts, each followed by a separator byte so that ("ab", "c") and
/// ("a", "bc") differ. Stable across Rust releases, unlike `DefaultHasher`.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc by its known names.
    unsafe { nvrtc_sys::is_culib_present() }
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0 as c_int, 0 as c_int);
    // SAFETY: writes two ints.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| cuda_error(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Loads the module `name` built from `source` on `dev`, from `cache_dir` when a compiled copy
/// is kept there (and keeping one there when it compiles).
pub(super) fn load_module(
    dev: &Device,
    cache_dir: Option<&Path>,
    name: &str,
    source: &str,
) -> Result<(Arc<CudaModule>, Origin)> {
    if !nvrtc_present() {
        return Err(cuda_error(
            "NVRTC (libnvrtc.so.13) was not found; it compiles the kernels at first use. \
             Install the CUDA 13 toolkit or put its lib64 directory on LD_LIBRARY_PATH",
        ));
    }
    no_panic("compiling kernels", || {
        let arch = device_arch(dev.cc);
        let (nv_major, nv_minor) = nvrtc_version()?;
        let options = options(&arch);
        let full = full_source(name, source);
        let versions = format!("driver {} nvrtc {nv_major}.{nv_minor}", dev.driver_version);
        let key = fnv1a(&[
            CACHE_FORMAT.as_bytes(),
            full.as_bytes(),
            arch.as_bytes(),
            versions.as_bytes(),
            options.join(" ").as_bytes(),
        ]);
        let file = cache_dir.map(|d| d.join(format!("{name}-{arch}-{key:016x}.cubin")));

        let cached = memo().lock().map_err(|_| cuda_error("kernel cache lock poisoned"))?.get(&key).cloned();
        let cached = cached.or_else(|| {
            let bytes = std::fs::read(file.as_ref()?).ok()?;
            Some(Arc::new(bytes))
        });
        if let Some(cubin) = cached {
            if let Ok(module) = dev.ctx.load_module(Ptx::from_binary(cubin.to_vec())) {
                memo().lock().map_err(|_| cuda_error("kernel cache lock poisoned"))?.insert(key, cubin);
                return Ok((module, Origin::Cached));
            }
            // A truncated or foreign file: fall through and compile afresh, overwriting it.
        }

        let cubin = Arc::new(compile(name, &full, &options)?);
        if let Some(file) = &file {
            // The cache is an optimisation: a read-only home directory must not stop the GPU.
            let _ = write_atomically(file, &cubin);
        }
        let module = dev
            .ctx
            .load_module(Ptx::from_binary(cubin.to_vec()))
            .map_err(|e| cuda_error(format!("loading the {name} kernels ({arch}): {e}")))?;
        memo().lock().map_err(|_| cuda_error("kernel cache lock poisoned"))?.insert(key, cubin);
        Ok((module, Origin::Compiled))
    })
}

/// The architecture a device's cubins are built for: its own, with Hopper's arch-specific
/// features (`sm_90a`: the warpgroup MMA) on compute capability 9.0.
pub(super) fn device_arch(cc: (i32, i32)) -> String {
    let suffix = if cc == (9, 0) { "a" } else { "" };
    format!("sm_{}{}{suffix}", cc.0, cc.1)
}

/// NVRTC options: a cubin for the device's own architecture; line info for the profilers.
fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-lineinfo".to_string()]
}

/// The prelude, then the module's source with its own line numbers for compiler messages.
fn full_source(name: &str, source: &str) -> String {
    format!("{PRELUDE}\n#line 1 \"{name}.cu\"\n{source}")
}

/// Writes through a temporary file and a rename, so a concurrent reader never sees half a
/// cubin.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("cubin"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// NVRTC: source to cubin for the real architecture named in `options`.
fn compile(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(source).map_err(|_| cuda_error(format!("{name}.cu contains a NUL byte")))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| cuda_error("bad kernel name"))?;
    let prog = nvrtc::create_program(&src, Some(&cname))
        .map_err(|e| cuda_error(format!("nvrtcCreateProgram: {e:?}")))?;
    // SAFETY: `prog` is live until the destroy below; the source and name C strings outlive it.
    let out = unsafe {
        match nvrtc::compile_program(prog, options) {
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size).result().and_then(|()| {
                    let mut cubin = vec![0u8; size];
                    nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result().map(|()| cubin)
                })
            }
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                let _ = nvrtc::destroy_program(prog);
                return Err(cuda_error(format!("NVRTC could not compile {name}.cu ({e:?}):\n{log}")));
            }
        }
    };
    // SAFETY: created above and not yet destroyed on this path.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out.map_err(|e| cuda_error(format!("reading the cubin of {name}.cu: {e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel source compiles for Hopper, with and without its arch-specific features.
    /// Needs only NVRTC, no GPU: skipped without it.
    #[test]
    fn kernel_sources_compile() {
        if !nvrtc_present() {
            println!("skipped: NVRTC is not installed");
            return;
        }
        use crate::backend::cuda::{
            attention, deltanet, deltanet_chunked, elementwise, flash_attention, matmul, moe, quant, sample,
        };
        for (name, src) in [
            ("elementwise", elementwise::SOURCE),
            ("sample", sample::SOURCE),
            ("matmul", matmul::SOURCE),
            ("deltanet", deltanet::SOURCE),
            ("attention", attention::SOURCE),
            ("quant", quant::SOURCE),
            ("flash_attention", flash_attention::SOURCE),
            ("deltanet_chunked", deltanet_chunked::SOURCE),
            ("moe", moe::SOURCE),
        ] {
            for arch in ["sm_90", "sm_90a"] {
                let cubin = compile(name, &full_source(name, src), &options(arch)).unwrap();
                assert!(cubin.starts_with(b"\x7fELF"), "{name} ({arch}): not an ELF cubin");
            }
        }
    }

    #[test]
    fn cache_key_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
