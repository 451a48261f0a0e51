//! Launchers for `attention.cu`: the attention prologue (q/gate split, q/k RMSNorm, partial
//! RoPE) and causal GQA attention over the KV cache with the sigmoid output gate, split over the
//! keys (flash-decoding: up to 32 ranges of at least 64 keys, one block each, then a merge), so
//! a decode step's few heads still spread over the GPU.
//!
//! The KV cache is the trait's `f32` buffer for now; a bf16 cache needs a cache type of its own
//! in the `Backend` trait.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};

use super::device::{cuda_error, kernel_args, CudaBuf, Device};
use crate::backend::AttentionShape;
use crate::error::Result;

pub(super) const SOURCE: &str = include_str!("attention.cu");

/// `32 * ATT_EPL` of the attention kernel: the widest head it holds in registers.
const MAX_HEAD_DIM: usize = 256;
/// Warps per attention block.
const ATT_WARPS: usize = 8;
/// `ATT_SPLIT_KEYS` and `ATT_MAX_SPLITS` of the kernels.
const SPLIT_KEYS: usize = 64;
const MAX_SPLITS: usize = 32;

/// Key ranges of a query row that sees `visible` keys (`att_splits` of the kernels).
fn splits(visible: usize) -> usize {
    visible.div_ceil(SPLIT_KEYS).clamp(1, MAX_SPLITS)
}

pub(super) struct Kernels {
    prologue: CudaFunction,
    partial_seq: CudaFunction,
    partial_batch: CudaFunction,
    combine: CudaFunction,
    kv_scatter: CudaFunction,
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        Ok(Kernels {
            prologue: f("attention_prologue")?,
            partial_seq: f("attention_partial_seq")?,
            partial_batch: f("attention_partial_batch")?,
            combine: f("attention_combine")?,
            kv_scatter: f("kv_scatter")?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn prologue(
        &self,
        dev: &Device,
        shape: &AttentionShape,
        q_and_gate: &CudaBuf,
        k: &mut CudaBuf,
        q_norm: &CudaBuf,
        k_norm: &CudaBuf,
        inv_freq: &CudaBuf,
        positions: &[usize],
        q: &mut CudaBuf,
        gate: &mut CudaBuf,
    ) {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let tokens = positions.len();
        if tokens == 0 {
            return;
        }
        assert!(tokens <= 65535, "attention_prologue: {tokens} tokens exceed one launch's grid");
        assert!(hd <= 1024, "attention_prologue: head_dim {hd} > 1024");
        assert!(
            shape.rotary_dim <= hd && shape.rotary_dim.is_multiple_of(2),
            "attention_prologue: rotary_dim"
        );
        assert!(inv_freq.len() >= shape.rotary_dim / 2, "attention_prologue: inv_freq too short");
        assert!(q_and_gate.len() >= tokens * nh * 2 * hd, "attention_prologue: q_and_gate too short");
        assert!(k.len() >= tokens * nkv * hd, "attention_prologue: k too short");
        assert!(q.len() >= tokens * nh * hd && gate.len() >= tokens * nh * hd, "attention_prologue: q/gate");
        assert!(q_norm.len() >= hd && k_norm.len() >= hd, "attention_prologue: norm weights");
        let threads = hd.div_ceil(32) * 32;
        let (_pos_dev, pos_ptr) = dev.positions_on_device(positions);
        dev.launch(
            "attention_prologue",
            &self.prologue,
            ((nh + nkv) as u32, tokens as u32, 1),
            (threads as u32, 1, 1),
            (hd * 4) as u32,
            kernel_args![
                q_and_gate.ptr(),
                k.ptr(),
                q_norm.ptr(),
                k_norm.ptr(),
                inv_freq.ptr(),
                q.ptr(),
                gate.ptr(),
                pos_ptr,
                nh as i32,
                nkv as i32,
                hd as i32,
                shape.rotary_dim as i32,
                shape.eps
            ],
        );
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        dev: &Device,
        shape: &AttentionShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        gate: &CudaBuf,
        k_cache: &mut CudaBuf,
        v_cache: &mut CudaBuf,
        pos0: usize,
        tokens: usize,
        out: &mut CudaBuf,
    ) -> usize {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let kv = shape.kv_dim();
        assert!(hd <= MAX_HEAD_DIM, "attention: head_dim {hd} > {MAX_HEAD_DIM} is not supported");
        assert!(nkv > 0 && nh % nkv == 0, "attention: {nh} heads do not group onto {nkv} kv heads");
        assert!(k.len() >= tokens * kv && v.len() >= tokens * kv, "attention: k/v too short");
        let end = (pos0 + tokens) * kv;
        assert!(
            k_cache.len() >= end && v_cache.len() >= end,
            "attention: the KV cache holds {} rows, {} needed",
            k_cache.len() / kv.max(1),
            pos0 + tokens
        );
        assert!(q.len() >= tokens * nh * hd && gate.len() >= tokens * nh * hd, "attention: q/gate too short");
        assert!(out.len() >= tokens * nh * hd, "attention: out too short");
        assert!(tokens <= 65535, "attention: {tokens} tokens exceed one launch's grid");
        if tokens == 0 {
            return 0;
        }
        // `pos0` becomes launch arguments: only the decode-batch form can be recorded.
        assert!(!dev.is_capturing(), "attention: the one-sequence form cannot be recorded");
        dev.copy_dtod(k_cache.at(pos0 * kv), k.ptr(), tokens * kv * 4);
        dev.copy_dtod(v_cache.at(pos0 * kv), v.ptr(), tokens * kv * 4);
        let n_splits = splits(pos0 + tokens);
        let partial = dev.alloc(tokens * nh * n_splits * (hd + 2)).unwrap_or_else(|e| panic!("{e}"));
        let scale = 1.0 / (hd as f32).sqrt();
        dev.launch(
            "attention_partial_seq",
            &self.partial_seq,
            (nh as u32, tokens as u32, n_splits as u32),
            ((ATT_WARPS * 32) as u32, 1, 1),
            (ATT_WARPS * hd * 4) as u32,
            kernel_args![
                q.ptr(),
                k_cache.ptr(),
                v_cache.ptr(),
                partial.ptr(),
                nh as i32,
                nkv as i32,
                hd as i32,
                pos0 as i32,
                scale
            ],
        );
        self.combine(dev, &partial, gate, out, nh, hd, tokens, n_splits);
        n_splits
    }

    /// Merges the key ranges of `rows` query rows and applies the gate.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        dev: &Device,
        partial: &CudaBuf,
        gate: &CudaBuf,
        out: &mut CudaBuf,
        nh: usize,
        hd: usize,
        rows: usize,
        n_splits: usize,
    ) {
        dev.launch(
            "attention_combine",
            &self.combine,
            (nh as u32, rows as u32, 1),
            (hd.div_ceil(32) as u32 * 32, 1, 1),
            0,
            kernel_args![partial.ptr(), gate.ptr(), out.ptr(), nh as i32, hd as i32, n_splits as i32],
        );
    }

    /// A decode batch: row `i` is the token of sequence `i` at `positions[i]`, written into and
    /// attending over that sequence's caches, by the arithmetic of [`Kernels::attention`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_rows(
        &self,
        dev: &Device,
        shape: &AttentionShape,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        gate: &CudaBuf,
        k_caches: &mut [&mut CudaBuf],
        v_caches: &mut [&mut CudaBuf],
        positions: &[usize],
        out: &mut CudaBuf,
    ) {
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let (kv, n) = (shape.kv_dim(), positions.len());
        assert!(hd <= MAX_HEAD_DIM, "attention_rows: head_dim {hd} > {MAX_HEAD_DIM} is not supported");
        assert!(nkv > 0 && nh % nkv == 0, "attention_rows: {nh} heads do not group onto {nkv} kv heads");
        assert!(k_caches.len() == n && v_caches.len() == n, "attention_rows: one cache pair per row");
        assert!(k.len() >= n * kv && v.len() >= n * kv, "attention_rows: k/v too short");
        assert!(q.len() >= n * nh * hd && gate.len() >= n * nh * hd, "attention_rows: q/gate too short");
        assert!(out.len() >= n * nh * hd, "attention_rows: out too short");
        assert!(n <= 65535, "attention_rows: batch of {n} exceeds one launch's grid");
        if n == 0 {
            return;
        }
        let mut ptrs = Vec::with_capacity(2 * n);
        for (i, &p) in positions.iter().enumerate() {
            let need = (p + 1) * kv;
            assert!(
                k_caches[i].len() >= need && v_caches[i].len() >= need,
                "attention_rows: sequence {i}'s cache holds {} rows, {} needed",
                k_caches[i].len() / kv.max(1),
                p + 1
            );
            ptrs.push(k_caches[i].ptr());
        }
        ptrs.extend(v_caches.iter().map(|c| c.ptr()));
        let (_pos_dev, pos_ptr) = dev.positions_on_device(positions);
        let (_ptrs_dev, k_ptrs) = dev.upload_u64(&ptrs).unwrap_or_else(|e| panic!("{e}"));
        let v_ptrs = k_ptrs + (n * 8) as u64;
        dev.launch(
            "kv_scatter",
            &self.kv_scatter,
            (n as u32, 1, 1),
            (256, 1, 1),
            0,
            kernel_args![k.ptr(), v.ptr(), k_ptrs, v_ptrs, pos_ptr, kv as i32],
        );
        // A recorded step is replayed at later positions: it launches every split a row can
        // have (the ranges depend on the row's length only, so the numbers are the same).
        let n_splits = if dev.is_capturing() {
            MAX_SPLITS
        } else {
            positions.iter().map(|&p| splits(p + 1)).max().unwrap_or(1)
        };
        let partial = dev.alloc(n * nh * n_splits * (hd + 2)).unwrap_or_else(|e| panic!("{e}"));
        let scale = 1.0 / (hd as f32).sqrt();
        dev.launch(
            "attention_partial_batch",
            &self.partial_batch,
            (nh as u32, n as u32, n_splits as u32),
            ((ATT_WARPS * 32) as u32, 1, 1),
            (ATT_WARPS * hd * 4) as u32,
            kernel_args![
                q.ptr(),
                k_ptrs,
                v_ptrs,
                pos_ptr,
                partial.ptr(),
                nh as i32,
                nkv as i32,
                hd as i32,
                scale
            ],
        );
        self.combine(dev, &partial, gate, out, nh, hd, n, n_splits);
    }
}
