//! Launchers for `attention.cu`: the attention prologue (q/gate split, q/k RMSNorm, partial
//! RoPE), the KV cache ([`CudaCache`]: f32 or bf16 rows, written here) and causal GQA attention
//! over it with the sigmoid output gate, split over the keys (flash-decoding: up to 32 ranges of
//! at least 64 keys, then a merge), so a decode step's few heads still spread over the GPU. A
//! block takes up to four query heads of one kv group, so the cache is read once per kv head.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};

use super::device::XQuant;
use super::device::{cuda_error, kernel_args, CudaBuf, Device};
use crate::backend::{AttentionInput, AttentionLayer, AttentionShape, KvCache, KvCacheType};
use crate::error::Result;

pub(super) const SOURCE: &str = include_str!("attention.cu");

/// `32 * ATT_EPL` of the attention kernel: the widest head it holds in registers.
const MAX_HEAD_DIM: usize = 256;
/// Warps per attention block (`ATT_MAX_WARPS`).
const ATT_WARPS: usize = 8;
/// `ATT_SPLIT_KEYS` and `ATT_MAX_SPLITS` of the kernels.
const SPLIT_KEYS: usize = 64;
pub(super) const MAX_SPLITS: usize = 32;

/// One sequence's attention over `tokens` tokens at positions `pos0..` (the trait's
/// `attention`, the f32 kernels here and the tensor-core ones of `flash_attention.rs`).
#[derive(Clone, Copy)]
pub(super) struct AttentionRun<'a> {
    pub shape: &'a AttentionShape,
    pub input: AttentionInput<'a, CudaBuf>,
    pub pos0: usize,
    pub tokens: usize,
}

/// Panics (naming the op, `what`) unless the one-sequence attention's buffers hold what
/// `tokens` tokens at `pos0` need: `k`, `v` `[tokens, kv_dim]`, the caches `pos0 + tokens`
/// rows, `q`, `gate` and `out` `[tokens, heads * head_dim]`.
pub(super) fn check_buffers(what: &str, run: AttentionRun, cache: &KvCache<'_, CudaCache>, out: &CudaBuf) {
    let AttentionRun { shape, input: AttentionInput { q, k, v, gate }, pos0, tokens } = run;
    let (k_cache, v_cache) = (&*cache.k, &*cache.v);
    let kv = shape.kv_dim();
    let q_dim = shape.num_heads * shape.head_dim;
    assert!(k.len() >= tokens * kv && v.len() >= tokens * kv, "{what}: k/v too short");
    let end = (pos0 + tokens) * kv;
    assert!(
        k_cache.len() >= end && v_cache.len() >= end,
        "{what}: the KV cache holds {} rows, {} needed",
        k_cache.len() / kv.max(1),
        pos0 + tokens
    );
    assert!(q.len() >= tokens * q_dim && gate.len() >= tokens * q_dim, "{what}: q/gate too short");
    assert!(out.len() >= tokens * q_dim, "{what}: out too short");
}

/// Key ranges of a query row that sees `visible` keys (`att_splits` of the kernels).
pub(super) fn splits(visible: usize) -> usize {
    visible.div_ceil(SPLIT_KEYS).clamp(1, MAX_SPLITS)
}

/// Query heads of one kv group an attention block takes: the most of 4, 2, 1 that divides it.
fn heads_per_block(group: usize) -> usize {
    [4, 2, 1].into_iter().find(|g| group.is_multiple_of(*g)).unwrap_or(1)
}

/// One attention layer's keys or values on the device: `len` elements (`[capacity, kv_dim]`)
/// of `dtype`, f32 as written or bf16 rounded to nearest even when written.
pub struct CudaCache {
    /// The storage, in 4-byte words (a bf16 cache of `len` elements takes `len / 2` of them).
    words: CudaBuf,
    len: usize,
    dtype: KvCacheType,
}

impl CudaCache {
    pub(super) fn zeros(dev: &Device, len: usize, dtype: KvCacheType) -> Result<CudaCache> {
        Ok(CudaCache { words: dev.zeros(Self::words_for(len, dtype))?, len, dtype })
    }

    /// A cache holding `data`, rounded to nearest even on the host for bf16 (as the kernels
    /// round what they write).
    pub(super) fn upload(dev: &Device, data: &[f32], dtype: KvCacheType) -> Result<CudaCache> {
        let cache = CudaCache::zeros(dev, data.len(), dtype)?;
        match dtype {
            KvCacheType::F32 => dev.copy_htod(cache.ptr(), data)?,
            KvCacheType::Bf16 => {
                let bits: Vec<u16> = data.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                dev.copy_htod(cache.ptr(), &bits)?
            }
        }
        Ok(cache)
    }

    fn words_for(len: usize, dtype: KvCacheType) -> usize {
        (len * dtype.bytes()).div_ceil(4)
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> KvCacheType {
        self.dtype
    }

    /// Bytes of device memory the elements take.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.bytes()
    }

    /// Device address of element `i`.
    pub(super) fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.words.ptr() + (i * self.dtype.bytes()) as u64
    }

    pub(super) fn ptr(&self) -> u64 {
        self.words.ptr()
    }

    /// Grows or shrinks to `len` elements, keeping the common prefix; new space is zero.
    pub(super) fn resize(&mut self, dev: &Device, len: usize) -> Result<()> {
        let next = dev.alloc(Self::words_for(len, self.dtype))?;
        let b = self.dtype.bytes();
        let keep = self.len.min(len);
        dev.copy_dtod(next.ptr(), self.ptr(), keep * b);
        dev.memset_zero(next.ptr() + (keep * b) as u64, next.len() * 4 - keep * b);
        self.words = next;
        self.len = len;
        Ok(())
    }

    /// Copies elements `src_offset..src_offset + len` into `dst` from `dst_offset`, as stored
    /// (a device-to-device copy on the backend's stream, so ordered with the kernels).
    pub(super) fn copy_to(
        &self,
        dev: &Device,
        src_offset: usize,
        dst: &mut CudaCache,
        dst_offset: usize,
        len: usize,
    ) {
        assert_eq!(self.dtype, dst.dtype, "cache copy between a {} and a {} cache", self.dtype, dst.dtype);
        assert!(
            src_offset + len <= self.len && dst_offset + len <= dst.len,
            "cache copy: {len} elements from {src_offset} of {} to {dst_offset} of {}",
            self.len,
            dst.len
        );
        dev.copy_dtod(dst.at(dst_offset), self.at(src_offset), len * self.dtype.bytes());
    }

    /// Elements `offset..offset + len`, widened to f32.
    pub(super) fn download(&self, dev: &Device, offset: usize, len: usize) -> Result<Vec<f32>> {
        assert!(offset + len <= self.len, "cache download: {offset}+{len} outside a cache of {}", self.len);
        match self.dtype {
            KvCacheType::F32 => {
                let mut host = vec![0.0f32; len];
                dev.download_f32(&mut host, self.at(offset))?;
                Ok(host)
            }
            KvCacheType::Bf16 => {
                let mut host = vec![0u16; len];
                dev.copy_dtoh(&mut host, self.at(offset))?;
                Ok(host.into_iter().map(|b| f32::from_bits((b as u32) << 16)).collect())
            }
        }
    }
}

/// The partial-attention kernels of one cache type and one number of heads per block.
struct Partial {
    seq: CudaFunction,
    batch: CudaFunction,
}

pub(super) struct Kernels {
    prologue: CudaFunction,
    /// `[f32, bf16][g1, g2, g4]`.
    partial: [[Partial; 3]; 2],
    combine: CudaFunction,
    kv_scatter: CudaFunction,
    kv_scatter_bf16: CudaFunction,
    kv_store_bf16: CudaFunction,
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Kernels> {
        let f = |n: &str| module.load_function(n).map_err(|e| cuda_error(format!("kernel {n}: {e}")));
        let partial = |ty: &str, g: usize| -> Result<Partial> {
            Ok(Partial {
                seq: f(&format!("attention_partial_seq_{ty}_g{g}"))?,
                batch: f(&format!("attention_partial_batch_{ty}_g{g}"))?,
            })
        };
        Ok(Kernels {
            prologue: f("attention_prologue")?,
            partial: [
                [partial("f32", 1)?, partial("f32", 2)?, partial("f32", 4)?],
                [partial("bf16", 1)?, partial("bf16", 2)?, partial("bf16", 4)?],
            ],
            combine: f("attention_combine")?,
            kv_scatter: f("kv_scatter")?,
            kv_scatter_bf16: f("kv_scatter_bf16")?,
            kv_store_bf16: f("kv_store_bf16")?,
        })
    }

    /// The partial kernels for a cache type and shape, with the heads per block and the grid's x.
    fn partial_for(&self, dtype: KvCacheType, shape: &AttentionShape) -> (&Partial, usize) {
        let group = shape.num_heads / shape.num_kv_heads;
        let g = heads_per_block(group);
        let t = match dtype {
            KvCacheType::F32 => 0,
            KvCacheType::Bf16 => 1,
        };
        let i = match g {
            4 => 2,
            2 => 1,
            _ => 0,
        };
        (&self.partial[t][i], shape.num_kv_heads * group / g)
    }

    /// Shared memory of a partial-attention block: each warp's accumulators of its heads.
    fn partial_smem(shape: &AttentionShape) -> u32 {
        let g = heads_per_block(shape.num_heads / shape.num_kv_heads);
        (ATT_WARPS * g * shape.head_dim * 4) as u32
    }

    /// Writes the run's `tokens` rows of `k` and `v` into the cache from row `pos0`, in its type.
    pub(super) fn store(&self, dev: &Device, run: AttentionRun, cache: &mut KvCache<'_, CudaCache>) {
        let AttentionRun { shape, input: AttentionInput { k, v, .. }, pos0, tokens } = run;
        let (k_cache, v_cache, kv) = (&mut *cache.k, &mut *cache.v, shape.kv_dim());
        assert_eq!(k_cache.dtype, v_cache.dtype, "attention: K and V caches of different types");
        let n = tokens * kv;
        match k_cache.dtype {
            KvCacheType::F32 => {
                dev.copy_dtod(k_cache.at(pos0 * kv), k.ptr(), n * 4);
                dev.copy_dtod(v_cache.at(pos0 * kv), v.ptr(), n * 4);
            }
            KvCacheType::Bf16 => dev.launch(
                "kv_store_bf16",
                &self.kv_store_bf16,
                (dev.grid_for(n, 256), 1, 1),
                (256, 1, 1),
                0,
                kernel_args![k.ptr(), v.ptr(), k_cache.at(pos0 * kv), v_cache.at(pos0 * kv), n as i64],
            ),
        }
    }

    // The trait op's arguments and the device.
    #[allow(clippy::too_many_arguments)]
    pub fn prologue(
        &self,
        dev: &Device,
        layer: AttentionLayer<'_, CudaBuf>,
        q_and_gate: &CudaBuf,
        k: &mut CudaBuf,
        positions: &[usize],
        q: &mut CudaBuf,
        gate: &mut CudaBuf,
    ) {
        let AttentionLayer { ref shape, q_norm, k_norm, inv_freq } = layer;
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

    pub(super) fn attention(
        &self,
        dev: &Device,
        run: AttentionRun,
        mut cache: KvCache<'_, CudaCache>,
        out: &mut CudaBuf,
    ) -> usize {
        let AttentionRun { shape, input: AttentionInput { q, gate, .. }, pos0, tokens } = run;
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        assert!(hd <= MAX_HEAD_DIM, "attention: head_dim {hd} > {MAX_HEAD_DIM} is not supported");
        assert!(nkv > 0 && nh % nkv == 0, "attention: {nh} heads do not group onto {nkv} kv heads");
        check_buffers("attention", run, &cache, out);
        assert!(tokens <= 65535, "attention: {tokens} tokens exceed one launch's grid");
        if tokens == 0 {
            return 0;
        }
        // `pos0` becomes launch arguments: only the decode-batch form can be recorded.
        assert!(!dev.is_capturing(), "attention: the one-sequence form cannot be recorded");
        self.store(dev, run, &mut cache);
        let (k_cache, v_cache) = (&*cache.k, &*cache.v);
        let n_splits = splits(pos0 + tokens);
        let partial = dev.alloc(tokens * nh * n_splits * (hd + 2)).unwrap_or_else(|e| panic!("{e}"));
        let scale = 1.0 / (hd as f32).sqrt();
        let (kernels, blocks) = self.partial_for(k_cache.dtype, shape);
        dev.launch(
            "attention_partial_seq",
            &kernels.seq,
            (blocks as u32, tokens as u32, n_splits as u32),
            ((ATT_WARPS * 32) as u32, 1, 1),
            Self::partial_smem(shape),
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
        self.combine(dev, &partial, gate, out, nh, hd, tokens, n_splits, 0, pos0, None);
        n_splits
    }

    /// Merges the key ranges of `rows` query rows and applies the gate. A row's visible keys
    /// come from `positions` (device `u32`s, a decode batch) or, when it is 0, `pos0 + row`.
    // The combine kernel's own arguments, one for one.
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
        positions: u64,
        pos0: usize,
        side: Option<&XQuant>,
    ) {
        let (xq, xd, xs) = side.map_or((0, 0, 0), |q| (q.q, q.d, q.s));
        dev.launch(
            "attention_combine",
            &self.combine,
            (nh as u32, rows as u32, 1),
            (hd.div_ceil(32) as u32 * 32, 1, 1),
            0,
            kernel_args![
                partial.ptr(),
                gate.ptr(),
                out.ptr(),
                positions,
                pos0 as i32,
                nh as i32,
                hd as i32,
                n_splits as i32,
                xq,
                xd,
                xs
            ],
        );
    }

    /// A decode batch: row `i` is the token of sequence `i` at `positions[i]`, written into and
    /// attending over that sequence's caches, by the arithmetic of [`Kernels::attention`].
    /// With `side`, one row whose head_dim is a multiple of 32 also goes out quantized there
    /// for the packed o_proj (as `quantize_x` would, bitwise): true when it did.
    // The trait op's arguments, the device and the producer's quantized side output.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_rows(
        &self,
        dev: &Device,
        shape: &AttentionShape,
        input: AttentionInput<'_, CudaBuf>,
        caches: &mut [KvCache<'_, CudaCache>],
        positions: &[usize],
        out: &mut CudaBuf,
        side: Option<&XQuant>,
    ) -> bool {
        let AttentionInput { q, k, v, gate } = input;
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let (kv, n) = (shape.kv_dim(), positions.len());
        assert!(hd <= MAX_HEAD_DIM, "attention_rows: head_dim {hd} > {MAX_HEAD_DIM} is not supported");
        assert!(nkv > 0 && nh % nkv == 0, "attention_rows: {nh} heads do not group onto {nkv} kv heads");
        assert!(caches.len() == n, "attention_rows: one cache per row");
        assert!(k.len() >= n * kv && v.len() >= n * kv, "attention_rows: k/v too short");
        assert!(q.len() >= n * nh * hd && gate.len() >= n * nh * hd, "attention_rows: q/gate too short");
        assert!(out.len() >= n * nh * hd, "attention_rows: out too short");
        assert!(n <= 65535, "attention_rows: batch of {n} exceeds one launch's grid");
        if n == 0 {
            return false;
        }
        let dtype = caches[0].k.dtype;
        let mut ptrs = Vec::with_capacity(2 * n);
        for (i, (&p, cache)) in positions.iter().zip(caches.iter()).enumerate() {
            let need = (p + 1) * kv;
            assert!(
                cache.k.len() >= need && cache.v.len() >= need,
                "attention_rows: sequence {i}'s cache holds {} rows, {} needed",
                cache.k.len() / kv.max(1),
                p + 1
            );
            // One launch reads one element type: every cache a backend makes for its sessions
            // has the backend's.
            assert!(
                cache.k.dtype == dtype && cache.v.dtype == dtype,
                "attention_rows: sequence {i}'s KV cache is {}, sequence 0's {dtype}: a decode batch takes \
                 caches of one element type",
                cache.k.dtype
            );
            ptrs.push(cache.k.ptr());
        }
        ptrs.extend(caches.iter().map(|c| c.v.ptr()));
        let (_pos_dev, pos_ptr) = dev.positions_on_device(positions);
        let (_ptrs_dev, k_ptrs) = dev.upload_u64(&ptrs).unwrap_or_else(|e| panic!("{e}"));
        let v_ptrs = k_ptrs + (n * 8) as u64;
        let scatter = match dtype {
            KvCacheType::F32 => &self.kv_scatter,
            KvCacheType::Bf16 => &self.kv_scatter_bf16,
        };
        dev.launch(
            "kv_scatter",
            scatter,
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
        let (kernels, blocks) = self.partial_for(dtype, shape);
        dev.launch(
            "attention_partial_batch",
            &kernels.batch,
            (blocks as u32, n as u32, n_splits as u32),
            ((ATT_WARPS * 32) as u32, 1, 1),
            Self::partial_smem(shape),
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
        let side = side.filter(|_| n == 1 && hd.is_multiple_of(32));
        self.combine(dev, &partial, gate, out, nh, hd, n, n_splits, pos_ptr, 0, side);
        side.is_some()
    }
}
