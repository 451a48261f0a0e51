//! The CUDA backend the benchmarks run on: device 0 with the options the `STRIX_*` variables
//! choose (`CudaOptions::from_vars`), so a benchmark is tuned the way `strix` is, and random
//! weights uploaded to it. A benchmark that includes this file includes `common/bench.rs` as
//! `bench` too.

use strix::backend::cuda::{CudaBackend, CudaOptions, CudaWeight};
use strix::backend::Backend;
use strix::tensor::DType;

/// The [`CudaOptions`] of the environment; an error names a variable that does not parse.
pub fn options() -> strix::Result<CudaOptions> {
    CudaOptions::from_vars(|k| std::env::var(k).ok()).map_err(strix::Error::Input)
}

/// CUDA device 0 with [`options`].
#[allow(dead_code)] // cuda_gdn_bench builds its backends with options of its own
pub fn backend() -> strix::Result<CudaBackend> {
    CudaBackend::with_options(0, &options()?)
}

/// `bench::random_weight` uploaded.
pub fn random_weight(
    g: &CudaBackend,
    dtype: DType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> strix::Result<CudaWeight> {
    g.weight(&crate::bench::random_weight(dtype, rows, cols, seed), rows, cols)
}

/// `copies` copies of the weights one GEMV launch reads (for each of `rows`, a random
/// `[rows, cols]` matrix of `dtype`), each copy different: timed calls rotate through them so
/// that the weights come from device memory, not the L2 cache.
#[allow(dead_code)] // the GEMV benchmarks'
pub fn weight_sets(
    g: &CudaBackend,
    dtype: DType,
    rows: &[usize],
    cols: usize,
    copies: usize,
) -> strix::Result<Vec<Vec<CudaWeight>>> {
    (0..copies)
        .map(|c| {
            rows.iter()
                .enumerate()
                .map(|(j, &r)| random_weight(g, dtype, r, cols, (c * 8 + j) as u64 + 1))
                .collect()
        })
        .collect()
}
