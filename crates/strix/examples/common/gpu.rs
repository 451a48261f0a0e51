//! The CUDA backend the benchmarks run on: device 0 with the options the `STRIX_*` variables
//! choose (`CudaOptions::from_vars`), so a benchmark is tuned the way `strix` is.

use strix::backend::cuda::{CudaBackend, CudaOptions};

/// The [`CudaOptions`] of the environment; an error names a variable that does not parse.
pub fn options() -> strix::Result<CudaOptions> {
    CudaOptions::from_vars(|k| std::env::var(k).ok()).map_err(strix::Error::Input)
}

/// CUDA device 0 with [`options`].
#[allow(dead_code)] // cuda_gdn_bench builds its backends with options of its own
pub fn backend() -> strix::Result<CudaBackend> {
    CudaBackend::with_options(0, &options()?)
}
