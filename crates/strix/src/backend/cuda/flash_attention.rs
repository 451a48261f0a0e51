//! Launchers for `flash_attention.cu`: causal GQA attention of a prompt on the tensor cores
//! (flash attention 2 with `mma.sync` bf16 operands, f32 accumulation and online softmax),
//! with the sigmoid output gate. Prefill only: the one-sequence `attention` op takes it for runs
//! of at least [`MIN_TOKENS`] tokens with a head width it is built for; shorter runs, other
//! widths and every decode step keep the f32 key-split kernels of `attention.rs`.
//!
//! The kernel streams K/V tiles of 32 keys straight from a bf16 cache with 16-byte `cp.async`
//! copies, double-buffered (V's tiles are transposed in the fragment loads, `ldmatrix.trans`);
//! an f32 cache is first rounded into a bf16 copy of its visible rows, as one per-call pass.
//!
//! Long contexts with few query tiles are split over the keys ([`SPLIT_KEYS`] per block, merged
//! by a second kernel), so a short prompt that continues a long cache still fills the GPU; a
//! prompt with enough tiles of its own ([`UNSPLIT_BLOCKS_PER_SM`]) is not split.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};

use super::attention::{self, AttentionRun, CudaCache};
use super::device::{cuda_error, kernel_args, CudaBuf, Device};
use crate::backend::{AttentionInput, AttentionShape, KvCache, KvCacheType};
use crate::error::Result;

pub(super) const SOURCE: &str = concat!(
    include_str!("mma.cuh"),
    "\n#line 1 \"flash_attention.cu\"\n",
    include_str!("flash_attention.cu")
);

/// Runs of fewer tokens keep the key-split kernel (a 16-row tile would be mostly empty).
pub const MIN_TOKENS: usize = 16;
/// `FA_WARPS` and `FA_KT` of the kernels.
const WARPS: usize = 4;
const KEY_TILE: usize = 32;
/// Keys a block of a split run takes.
const SPLIT_KEYS: usize = 512;
/// A run whose (query tile, head block) blocks number at least this many per SM is not split
/// over the keys: the blocks alone fill the GPU (heaviest tiles first), and no partial results
/// are written and merged.
const UNSPLIT_BLOCKS_PER_SM: usize = 4;

pub(super) struct Kernels {
    /// (head_dim, kernel) for each width the kernel is built for.
    by_dim: Vec<(usize, CudaFunction)>,
    combine: CudaFunction,
    /// Rounds an f32 cache's visible rows into a bf16 copy (`kv_rows_to_bf16`).
    to_bf16: CudaFunction,
    smem_limit: usize,
}

/// Shared memory of a block for a head width, bytes (see the layout in the kernel): the query
/// rows, then two buffers of a K and a V tile, each `[KEY_TILE][hd + 8]` bf16.
fn smem_bytes(hd: usize) -> usize {
    2 * (16 * WARPS * (hd + 8) + 4 * KEY_TILE * (hd + 8))
}

/// Heads of one kv group a block covers: the most of 4, 2, 1 that divides the group.
fn heads_per_block(group: usize) -> usize {
    [4, 2, 1].into_iter().find(|h| group.is_multiple_of(*h)).unwrap_or(1)
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>, dev: &Device) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        let limit = dev.max_smem_optin as usize;
        let mut by_dim = Vec::new();
        for hd in [32usize, 64, 128, 256] {
            let name = format!("flash_attention_hd{hd}");
            let func = f(&name)?;
            if smem_bytes(hd) > limit {
                continue;
            }
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_bytes(hd) as i32,
            )
            .map_err(|e| cuda_error(format!("{name} shared memory opt-in: {e}")))?;
            by_dim.push((hd, func));
        }
        Ok(Kernels {
            by_dim,
            combine: f("flash_attention_combine")?,
            to_bf16: f("kv_rows_to_bf16")?,
            smem_limit: limit,
        })
    }

    /// Whether [`Kernels::attention`] takes this shape and run length.
    pub fn supports(&self, shape: &AttentionShape, tokens: usize) -> bool {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        (MIN_TOKENS..=65535).contains(&tokens)
            && nkv > 0
            && nh.is_multiple_of(nkv)
            && smem_bytes(hd) <= self.smem_limit
            && self.by_dim.iter().any(|(d, _)| *d == hd)
    }

    /// The `attention` op of the backend on the tensor cores: writes `k`, `v` into the caches
    /// at `pos0` and attends every token to the cache rows up to its own. Returns the number of
    /// key splits it launched. The caller checked [`Kernels::supports`].
    pub(super) fn attention(
        &self,
        dev: &Device,
        at: &attention::Kernels,
        run: AttentionRun,
        mut cache: KvCache<'_, CudaCache>,
        out: &mut CudaBuf,
    ) -> usize {
        let AttentionRun { shape, input: AttentionInput { q, gate, .. }, pos0, tokens } = run;
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let kv = shape.kv_dim();
        assert!(self.supports(shape, tokens), "flash attention: unsupported shape {shape:?} T={tokens}");
        attention::check_buffers("flash attention", run, &cache, out);
        assert!(!dev.is_capturing(), "flash attention: prefill runs are not recorded");
        let func = &self.by_dim.iter().find(|(d, _)| *d == hd).expect("checked by supports").1;
        at.store(dev, run, &mut cache);
        let (k_cache, v_cache) = (&*cache.k, &*cache.v);
        let rows = pos0 + tokens;
        let alloc = |floats: usize| dev.alloc(floats).unwrap_or_else(|e| panic!("{e}"));
        // An f32 cache's visible rows rounded to bf16 (nearest even, as a bf16 cache holds
        // them), so both cache types meet the kernel with the same values.
        let copies = match k_cache.dtype() {
            KvCacheType::Bf16 => None,
            KvCacheType::F32 => {
                let n = rows * kv;
                let (kb, vb) = (alloc(n.div_ceil(2)), alloc(n.div_ceil(2)));
                dev.launch(
                    "kv_rows_to_bf16",
                    &self.to_bf16,
                    (dev.grid_for(n, 256), 1, 1),
                    (256, 1, 1),
                    0,
                    kernel_args![k_cache.ptr(), v_cache.ptr(), kb.ptr(), vb.ptr(), n as i64],
                );
                Some((kb, vb))
            }
        };
        let (kb, vb) = copies.as_ref().map_or((k_cache.ptr(), v_cache.ptr()), |(k, v)| (k.ptr(), v.ptr()));
        let group = nh / nkv;
        let hb = heads_per_block(group);
        let block_tokens = 16 * (WARPS / hb);
        let blocks = tokens.div_ceil(block_tokens) * (nkv * group / hb);
        let split_keys =
            if blocks >= UNSPLIT_BLOCKS_PER_SM * dev.sm_count as usize { rows } else { SPLIT_KEYS };
        let splits = rows.div_ceil(split_keys);
        let partial = if splits > 1 { Some(alloc(tokens * nh * splits * (hd + 2))) } else { None };
        let partial_ptr = partial.as_ref().map_or(0, |p| p.ptr());
        let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
        dev.launch(
            "flash_attention",
            func,
            (tokens.div_ceil(block_tokens) as u32, (nkv * group / hb) as u32, splits as u32),
            ((WARPS * 32) as u32, 1, 1),
            smem_bytes(hd) as u32,
            kernel_args![
                q.ptr(),
                kb,
                vb,
                gate.ptr(),
                out.ptr(),
                partial_ptr,
                tokens as i32,
                nh as i32,
                nkv as i32,
                pos0 as i32,
                hb as i32,
                split_keys as i32,
                scale_log2
            ],
        );
        if let Some(partial) = partial {
            dev.launch(
                "flash_attention_combine",
                &self.combine,
                (nh as u32, tokens as u32, 1),
                (hd.div_ceil(32) as u32 * 32, 1, 1),
                0,
                kernel_args![partial.ptr(), gate.ptr(), out.ptr(), nh as i32, hd as i32, splits as i32],
            );
        }
        splits
    }
}
