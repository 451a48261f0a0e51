//! [`CudaOptions`]: how the CUDA backend runs, chosen once when it is built
//! ([`super::CudaBackend::with_options`]). The library reads no environment: a program that
//! wants the `STRIX_*` variables to choose (the CLI, the benchmarks, the GPU tests) passes them
//! in through [`CudaOptions::from_vars`], which names the variable at fault when a value does
//! not parse.

use std::path::PathBuf;

use super::matmul::{Kernels as MatmulKernels, TensorCoreKernel};
use super::quant::PackedMma;
use crate::backend::KvCacheType;

/// The CUDA backend's settings. [`Default`] is what a plain build runs: graphs, programmatic
/// dependent launch, tensor-core GEMVs on the best kernel the device has, tilings chosen by
/// shape, producer-side quantization, bf16 KV caches, and no kernel cache on disk. Every
/// choice gives bitwise the same results except `tensor_core_gemv` (the CUDA-core and
/// tensor-core GEMVs sum in different orders; each is batch-invariant on its own) and
/// `kv_cache` (bf16 rounds the cached keys and values).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Record decode steps as CUDA graphs and replay them (`STRIX_CUDA_GRAPHS=0` turns it off,
    /// for profiling and comparison).
    pub graphs: bool,
    /// Programmatic dependent launch inside recorded steps, on compute capability 9.0 and up
    /// (`STRIX_CUDA_PDL=0` turns it off).
    pub pdl: bool,
    /// bf16 GEMVs on the tensor cores; `false` (`STRIX_CUDA_GEMV=simt`) runs them on the
    /// CUDA-core kernels, which stream faster for a single sequence.
    pub tensor_core_gemv: bool,
    /// The tensor-core GEMV kernel (`STRIX_CUDA_MMA_KERNEL=warp|streamed|wgmma`); `None`, or
    /// one the device cannot load, takes the best it can.
    pub tensor_core_kernel: Option<TensorCoreKernel>,
    /// The per-warp tensor-core GEMV's (n-tiles, row tiles, steps in flight) for every batch,
    /// for tuning (`STRIX_CUDA_MMA_TILES=NTxRTxU`, one of
    /// [`super::CudaBackend::gemv_tile_configs`]); `None` chooses by batch size.
    pub gemv_tiles: Option<(usize, usize, usize)>,
    /// Value columns per block of the one-token Gated DeltaNet kernel, for tuning
    /// (`STRIX_GDN_DECODE_COLS`: 16, 32, 64 or 128); `None` chooses by shape and batch.
    pub gdn_decode_cols: Option<usize>,
    /// Whether the kernels whose output a packed GEMV reads next also write it quantized, so
    /// the GEMV skips its own quantization (`STRIX_PRODUCER_QUANT=0` turns it off).
    pub producer_quant: bool,
    /// The tensor-core arithmetic of packed decode batches (`STRIX_CUDA_PACKED_MMA`: `int8`, the
    /// default, or `bf16`, which needs compute capability 9.0): see [`PackedMma`].
    pub packed_mma: PackedMma,
    /// The element type of every KV cache the backend makes: bf16 (half the memory and the
    /// reads) or f32 (exact; the CLI's `--kv-cache f32`). A flag of the commands, not a
    /// `STRIX_*` variable read here.
    pub kv_cache: KvCacheType,
    /// Where compiled kernels are kept between runs (`STRIX_KERNEL_CACHE`, else
    /// `$XDG_CACHE_HOME/strix/kernels`, else `~/.cache/strix/kernels` in
    /// [`CudaOptions::from_vars`]); `None` compiles them at every start.
    pub kernel_cache: Option<PathBuf>,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            graphs: true,
            pdl: true,
            tensor_core_gemv: true,
            tensor_core_kernel: None,
            gemv_tiles: None,
            gdn_decode_cols: None,
            producer_quant: true,
            packed_mma: PackedMma::Int8,
            kv_cache: KvCacheType::Bf16,
            kernel_cache: None,
        }
    }
}

/// The Gated DeltaNet decode kernel's compiled column tilings.
const GDN_DECODE_COLS: [usize; 4] = [16, 32, 64, 128];

impl CudaOptions {
    /// The options the `STRIX_*` variables choose, read through `var` (for example
    /// `|k| std::env::var(k).ok()`); an empty value counts as unset. An error names the
    /// variable and the values it takes when one does not parse.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<CudaOptions, String> {
        let get = |k: &str| var(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let switch = |k: &str, off: &str| -> Result<bool, String> {
            match get(k) {
                None => Ok(true),
                Some(v) if v == off => Ok(false),
                Some(v) if v == "1" => Ok(true),
                Some(v) => Err(format!("{k}={v}: expected {off} (off) or 1 (on, the default)")),
            }
        };
        let tensor_core_kernel = match get("STRIX_CUDA_MMA_KERNEL").as_deref() {
            None => None,
            Some("warp") => Some(TensorCoreKernel::PerWarp),
            Some("streamed") => Some(TensorCoreKernel::Streamed),
            Some("wgmma") => Some(TensorCoreKernel::Warpgroup),
            Some(v) => return Err(format!("STRIX_CUDA_MMA_KERNEL={v}: expected warp, streamed or wgmma")),
        };
        let gemv_tiles = match get("STRIX_CUDA_MMA_TILES") {
            None => None,
            Some(v) => {
                let mut it = v.split('x').map(|n| n.trim().parse::<usize>().ok());
                let tiles = (it.next().flatten(), it.next().flatten(), it.next().flatten(), it.next());
                match tiles {
                    (Some(n), Some(r), Some(u), None)
                        if MatmulKernels::mma_configs().contains(&(n, r, u)) =>
                    {
                        Some((n, r, u))
                    }
                    _ => {
                        let configs: Vec<String> = MatmulKernels::mma_configs()
                            .iter()
                            .map(|(n, r, u)| format!("{n}x{r}x{u}"))
                            .collect();
                        return Err(format!(
                            "STRIX_CUDA_MMA_TILES={v}: expected one of {}",
                            configs.join(", ")
                        ));
                    }
                }
            }
        };
        let gdn_decode_cols = match get("STRIX_GDN_DECODE_COLS") {
            None => None,
            Some(v) => match v.parse::<usize>() {
                Ok(c) if GDN_DECODE_COLS.contains(&c) => Some(c),
                _ => return Err(format!("STRIX_GDN_DECODE_COLS={v}: expected 16, 32, 64 or 128")),
            },
        };
        let tensor_core_gemv = match get("STRIX_CUDA_GEMV").as_deref() {
            None | Some("mma") => true,
            Some("simt") => false,
            Some(v) => return Err(format!("STRIX_CUDA_GEMV={v}: expected simt or mma (the default)")),
        };
        let packed_mma = match get("STRIX_CUDA_PACKED_MMA").as_deref() {
            None | Some("int8") => PackedMma::Int8,
            Some("bf16") => PackedMma::Bf16,
            Some(v) => return Err(format!("STRIX_CUDA_PACKED_MMA={v}: expected int8 (the default) or bf16")),
        };
        let kernel_cache = get("STRIX_KERNEL_CACHE")
            .map(PathBuf::from)
            .or_else(|| get("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("strix/kernels")))
            .or_else(|| get("HOME").map(|d| PathBuf::from(d).join(".cache/strix/kernels")));
        Ok(CudaOptions {
            graphs: switch("STRIX_CUDA_GRAPHS", "0")?,
            pdl: switch("STRIX_CUDA_PDL", "0")?,
            tensor_core_gemv,
            tensor_core_kernel,
            gemv_tiles,
            gdn_decode_cols,
            producer_quant: switch("STRIX_PRODUCER_QUANT", "0")?,
            packed_mma,
            kv_cache: KvCacheType::Bf16,
            kernel_cache,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn no_variables_give_the_defaults_and_the_home_cache() {
        let o = CudaOptions::from_vars(vars(&[("HOME", "/home/u")])).unwrap();
        assert_eq!(
            o,
            CudaOptions {
                kernel_cache: Some(PathBuf::from("/home/u/.cache/strix/kernels")),
                ..Default::default()
            }
        );
        let o = CudaOptions::from_vars(vars(&[])).unwrap();
        assert_eq!(o, CudaOptions::default());
        let o = CudaOptions::from_vars(vars(&[
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("STRIX_KERNEL_CACHE", ""),
        ]))
        .unwrap();
        assert_eq!(o.kernel_cache, Some(PathBuf::from("/x/strix/kernels")));
        let o = CudaOptions::from_vars(vars(&[("HOME", "/h"), ("STRIX_KERNEL_CACHE", "/k")])).unwrap();
        assert_eq!(o.kernel_cache, Some(PathBuf::from("/k")));
    }

    #[test]
    fn every_variable_sets_its_option() {
        let o = CudaOptions::from_vars(vars(&[
            ("STRIX_CUDA_GRAPHS", "0"),
            ("STRIX_CUDA_PDL", "0"),
            ("STRIX_CUDA_GEMV", "simt"),
            ("STRIX_CUDA_MMA_KERNEL", "streamed"),
            ("STRIX_CUDA_MMA_TILES", "8x2x4"),
            ("STRIX_GDN_DECODE_COLS", "64"),
            ("STRIX_PRODUCER_QUANT", "0"),
            ("STRIX_CUDA_PACKED_MMA", "bf16"),
        ]))
        .unwrap();
        assert_eq!(
            o,
            CudaOptions {
                graphs: false,
                pdl: false,
                tensor_core_gemv: false,
                tensor_core_kernel: Some(TensorCoreKernel::Streamed),
                gemv_tiles: Some((8, 2, 4)),
                gdn_decode_cols: Some(64),
                producer_quant: false,
                packed_mma: PackedMma::Bf16,
                kv_cache: KvCacheType::Bf16,
                kernel_cache: None,
            }
        );
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (k, v) in [
            ("STRIX_CUDA_GRAPHS", "no"),
            ("STRIX_CUDA_MMA_KERNEL", "fast"),
            ("STRIX_CUDA_MMA_TILES", "8x2"),
            ("STRIX_CUDA_MMA_TILES", "3x3x3"),
            ("STRIX_CUDA_PACKED_MMA", "fp8"),
            ("STRIX_GDN_DECODE_COLS", "48"),
            ("STRIX_CUDA_GEMV", "cublas"),
            ("STRIX_PRODUCER_QUANT", "off"),
        ] {
            let e = CudaOptions::from_vars(vars(&[(k, v)])).unwrap_err();
            assert!(e.starts_with(&format!("{k}={v}: expected")), "{e}");
        }
    }
}
