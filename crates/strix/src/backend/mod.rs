//! The ops a backend implements so that the model, written once in [`crate::model`], runs on it.
//!
//! Activations and states are `f32` buffers owned by the backend ([`Backend::Buf`]); weight
//! matrices stay in their checkpoint dtype ([`Backend::Weight`]); the attention layers' KV
//! caches are [`Backend::Cache`]s, in an element type ([`KvCacheType`]) fixed when the backend
//! is made.
//! Shapes are passed explicitly and rows are tokens: a `[tokens, dim]` activation is `tokens * dim` floats, row-major.
//! Each op says what it computes in the terms of `modeling_qwen3_5.py` (and
//! `modeling_qwen3_5_moe.py` for the sparse MoE block); a backend may fuse internally but must
//! compute the same function.

pub mod cpu;
pub mod cuda;

use crate::error::Result;
use crate::sampling::{Draw, NonFiniteLogits, PreparedSample};
use crate::tensor::HostTensor;

/// The pass length a backend prefers unless it says otherwise
/// ([`Backend::preferred_pass_tokens`]).
pub const DEFAULT_PASS_TOKENS: usize = 512;

// The mixers' shapes are part of the model's configuration (config.rs); the ops take them.
pub use crate::config::{AttentionShape, DeltaNetShape, ValueHeadOrder};

/// The element type of a KV cache (llama.cpp's `--cache-type-k/v`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvCacheType {
    /// Exact: the CPU backend's only type, and the f32 reference.
    #[default]
    F32,
    /// Rows rounded to nearest even when they are written: half the memory and the reads of
    /// f32, and the precision the tensor-core prefill attention computes in anyway.
    Bf16,
}

impl KvCacheType {
    /// Bytes per cached element.
    pub fn bytes(self) -> usize {
        match self {
            KvCacheType::F32 => 4,
            KvCacheType::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvCacheType::F32 => "f32",
            KvCacheType::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for KvCacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvCacheType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<KvCacheType, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(KvCacheType::F32),
            "bf16" => Ok(KvCacheType::Bf16),
            _ => Err(format!("`{s}` is not a KV cache type: use bf16 or f32")),
        }
    }
}

/// Which algorithm evaluates the gated delta rule over a run of tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaRuleMode {
    /// One token at a time (decode), exactly `torch_recurrent_gated_delta_rule`.
    Recurrent,
    /// Chunks of 64 tokens with the UT transform (prefill), `torch_chunk_gated_delta_rule`.
    Chunked,
}

/// One Gated DeltaNet layer as its ops read it (`Qwen3_5GatedDeltaNet`): the mixer's shape and
/// the layer's own small parameters, borrowed from the model's weights.
pub struct DeltaNetLayer<'w, Buf> {
    pub shape: DeltaNetShape,
    /// `conv1d.weight`, `[conv_dim, conv_kernel]`: the depthwise causal conv's taps.
    pub conv1d: &'w Buf,
    /// `A_log`, `[num_v_heads]`: the decay's rate, `g = -exp(A_log) * softplus(a + dt_bias)`.
    pub a_log: &'w Buf,
    /// `dt_bias`, `[num_v_heads]`.
    pub dt_bias: &'w Buf,
    /// `norm.weight`, `[v_head_dim]`: the gated RMSNorm's weight (not offset by one).
    pub norm: &'w Buf,
}

impl<'w, Buf> DeltaNetLayer<'w, Buf> {
    /// The gated RMSNorm over each value head's output.
    pub fn gated_norm(&self) -> RmsNorm<'w, Buf> {
        RmsNorm { weight: self.norm, dim: self.shape.v_head_dim, eps: self.shape.eps }
    }
}

/// What the gated delta rule reads for a run of tokens: the convolved `qkv` (`[tokens,
/// conv_dim]`, q, k and v side by side), and what its decay `g = -exp(a_log) * softplus(a +
/// dt_bias)` and write strength `beta = sigmoid(b)` are made of: the raw `a` and `b`
/// projections (`[tokens, num_v_heads]`) and the layer's `a_log` and `dt_bias`
/// (`[num_v_heads]`).
pub struct DeltaRuleInput<'a, Buf> {
    pub qkv: &'a Buf,
    pub a: &'a Buf,
    pub b: &'a Buf,
    pub a_log: &'a Buf,
    pub dt_bias: &'a Buf,
}

/// A decode batch's four Gated DeltaNet projections of the normed input, one row a sequence:
/// `qkv` raw (before the conv, and free to be overwritten by it), `z` (`[batch, value_dim]`,
/// the output gate), `a` and `b` (`[batch, num_v_heads]`).
pub struct DeltaNetProjections<'a, Buf> {
    pub qkv: &'a mut Buf,
    pub z: &'a Buf,
    pub a: &'a Buf,
    pub b: &'a Buf,
}

/// One sequence's state in one Gated DeltaNet layer: the conv's last `kernel - 1` inputs
/// (`[conv_dim, kernel - 1]`) and the delta rule's `[num_v_heads, k_head_dim, v_head_dim]`.
pub struct DeltaNetState<'s, Buf> {
    pub conv: &'s mut Buf,
    pub recurrent: &'s mut Buf,
}

/// One gated attention layer as its prologue reads it (`Qwen3_5Attention`): the shape, the
/// per-head `q_norm` and `k_norm` weights (`[head_dim]`) and the rotary inverse frequencies
/// (`[rotary_dim / 2]`, shared by every layer).
pub struct AttentionLayer<'w, Buf> {
    pub shape: AttentionShape,
    pub q_norm: &'w Buf,
    pub k_norm: &'w Buf,
    pub inv_freq: &'w Buf,
}

/// What attention reads for a run of tokens: the normed, rotated queries `q` and the output
/// `gate` (`[tokens, heads * head_dim]`, the prologue's), the new keys `k` (normed and rotated)
/// and values `v` (`[tokens, kv_dim]`).
pub struct AttentionInput<'a, Buf> {
    pub q: &'a Buf,
    pub k: &'a Buf,
    pub v: &'a Buf,
    pub gate: &'a Buf,
}

/// One sequence's keys and values in one attention layer, `[capacity, kv_dim]` each.
pub struct KvCache<'c, Cache> {
    pub k: &'c mut Cache,
    pub v: &'c mut Cache,
}

/// An RMSNorm as its ops take it (`Qwen3_5RMSNorm`, and the gated `Qwen3_5RMSNormGated`): the
/// weight (`[dim]`), applied to each row of `dim` values, with `eps` under the root.
pub struct RmsNorm<'w, Buf> {
    pub weight: &'w Buf,
    pub dim: usize,
    pub eps: f32,
}

/// A SwiGLU MLP's matrices (`Qwen3_5MLP`): `down · (silu(gate · x) * (up · x))`, `gate` and
/// `up` `[intermediate, hidden]`, `down` `[hidden, intermediate]`.
pub struct MlpWeights<'w, Weight> {
    pub gate: &'w Weight,
    pub up: &'w Weight,
    pub down: &'w Weight,
}

/// A gated MLP's intermediate activations, `[tokens, intermediate]` each: the `gate` and `up`
/// products and `act = silu(gate) * up`.
pub struct MlpActivations<'s, Buf> {
    pub gate: &'s mut Buf,
    pub up: &'s mut Buf,
    pub act: &'s mut Buf,
}

/// The structs of shared borrows are plain values: copied, not moved, into each op.
macro_rules! copy_borrows {
    ($($name:ident),*) => {$(
        impl<T> Clone for $name<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<T> Copy for $name<'_, T> {}
    )*};
}
copy_borrows!(DeltaNetLayer, DeltaRuleInput, AttentionLayer, AttentionInput, RmsNorm, MlpWeights);

/// The routed experts of one sparse MoE layer (`Qwen3_5MoeExperts`): expert `e` is the SwiGLU
/// MLP `down[e] · (silu(gate[e] · x) * (up[e] · x))`, each matrix a [`Backend::Weight`] of its
/// own (`[moe_intermediate, hidden]` for `gate` and `up`, `[hidden, moe_intermediate]` for
/// `down`), however the checkpoint stores them (one by one, or fused into 3-D tensors). Each
/// token runs the `top_k` its router picks (`num_experts_per_tok`).
pub struct MoeExperts<B: Backend + ?Sized> {
    pub gate: Vec<B::Weight>,
    pub up: Vec<B::Weight>,
    pub down: Vec<B::Weight>,
    pub top_k: usize,
}

/// A sparse MoE block's weights (`Qwen3_5MoeSparseMoeBlock`), as [`Backend::sparse_moe`] takes
/// them: the router (`mlp.gate`, `[num_experts, hidden]`), the routed experts, the shared
/// expert (a SwiGLU MLP) and its gate (`[1, hidden]`: one logit per token).
pub struct SparseMoe<'w, B: Backend + ?Sized> {
    pub router: &'w B::Weight,
    pub experts: &'w MoeExperts<B>,
    pub shared_expert: MlpWeights<'w, B::Weight>,
    pub shared_expert_gate: &'w B::Weight,
}

/// [`Backend::sparse_moe`]'s scratch, `[tokens, width]` each: the router's logits, the shared
/// expert's gate logit, its output, and its MLP's activations. A backend that fuses may leave
/// them unwritten.
pub struct MoeScratch<'s, Buf> {
    pub router_logits: &'s mut Buf,
    pub shared_gate: &'s mut Buf,
    pub shared_out: &'s mut Buf,
    pub shared_acts: MlpActivations<'s, Buf>,
}

impl<B: Backend + ?Sized> MoeExperts<B> {
    pub fn len(&self) -> usize {
        self.gate.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gate.is_empty()
    }

    /// Expert `e`'s SwiGLU MLP.
    pub fn expert(&self, e: usize) -> MlpWeights<'_, B::Weight> {
        MlpWeights { gate: &self.gate[e], up: &self.up[e], down: &self.down[e] }
    }
}

/// The router's choice for a run of tokens (`Qwen3_5MoeTopKRouter`): per token, its `top_k`
/// experts and their weights, ordered by expert id (the order in which the reference's
/// `index_add_` sums the experts' outputs).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// `[tokens, top_k]` expert ids.
    pub experts: Vec<u32>,
    /// `[tokens, top_k]` weights: the top-k softmax probabilities renormalised to sum to 1.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Routes each `[num_experts]` row of `logits` as the reference does: `softmax` in f32,
    /// `topk` of the probabilities (ties go to the lower expert id), then the k values divided
    /// by their sum.
    pub fn new(logits: &[f32], tokens: usize, num_experts: usize, top_k: usize) -> Routing {
        let mut experts = Vec::with_capacity(tokens * top_k);
        let mut weights = Vec::with_capacity(tokens * top_k);
        let mut probs = vec![0f32; num_experts];
        let mut order: Vec<u32> = Vec::with_capacity(num_experts);
        for row in logits[..tokens * num_experts].chunks_exact(num_experts) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, &l) in probs.iter_mut().zip(row) {
                *p = (l - max).exp();
                sum += *p;
            }
            probs.iter_mut().for_each(|p| *p /= sum);
            order.clear();
            order.extend(0..num_experts as u32);
            // Largest first, ties to the lower id; NaN (a broken model) sorts last.
            order.sort_by(|&a, &b| {
                let (pa, pb) = (probs[a as usize], probs[b as usize]);
                pb.partial_cmp(&pa).unwrap_or_else(|| pa.is_nan().cmp(&pb.is_nan())).then(a.cmp(&b))
            });
            let chosen = &mut order[..top_k];
            let total: f32 = chosen.iter().map(|&e| probs[e as usize]).sum();
            chosen.sort_unstable();
            for &e in chosen.iter() {
                experts.push(e);
                weights.push(probs[e as usize] / total);
            }
        }
        Routing { top_k, experts, weights }
    }

    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// For each expert, the `(token, weight)` pairs routed to it, tokens in ascending order.
    pub fn by_expert(&self, num_experts: usize) -> Vec<Vec<(usize, f32)>> {
        let mut groups = vec![Vec::new(); num_experts];
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            groups[e as usize].push((i / self.top_k.max(1), w));
        }
        groups
    }
}

/// `1 / (1 + e^-x)` in f32, as torch computes `sigmoid`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The compute ops of the Qwen3.5 forward pass.
pub trait Backend: Send + Sync {
    /// An `f32` buffer on the device.
    type Buf: Send + Sync;
    /// A `[rows, cols]` weight matrix on the device, in its stored dtype.
    type Weight: Send + Sync;
    /// One attention layer's keys or values, `[capacity, kv_dim]` rows in the backend's
    /// [`Backend::kv_cache_type`].
    type Cache: Send + Sync;

    /// A short name for logs and benchmarks ("cpu", "cuda:0").
    fn name(&self) -> String;

    // --- memory -------------------------------------------------------------------------------

    /// Takes a `[rows, cols]` matrix from a checkpoint tensor (no widening to f32 on the host).
    fn weight(&self, t: &HostTensor, rows: usize, cols: usize) -> Result<Self::Weight>;
    fn upload(&self, data: &[f32]) -> Self::Buf;
    fn zeros(&self, len: usize) -> Self::Buf;
    /// A buffer of `len` floats with unspecified contents, for the output of an op that
    /// overwrites it in full (every op here does): saves the memset of [`Backend::zeros`].
    fn scratch(&self, len: usize) -> Self::Buf {
        self.zeros(len)
    }
    /// Grows or shrinks `buf` to `len` floats, keeping the common prefix (new space is zero).
    fn resize(&self, buf: &mut Self::Buf, len: usize);
    /// Copies `len` floats starting at `offset` to the host.
    fn download(&self, buf: &Self::Buf, offset: usize, len: usize) -> Vec<f32>;

    /// The element type of every KV cache this backend makes, fixed when the backend is made
    /// (the CPU's is f32; the CUDA backend's is [`cuda::CudaOptions::kv_cache`]).
    fn kv_cache_type(&self) -> KvCacheType {
        KvCacheType::F32
    }
    /// A KV cache of `len` zero elements in [`Backend::kv_cache_type`].
    fn cache_zeros(&self, len: usize) -> Self::Cache;
    /// Grows or shrinks a cache to `len` elements, keeping the common prefix in its element
    /// type (new space is zero).
    fn cache_resize(&self, cache: &mut Self::Cache, len: usize);
    /// Copies `len` cached elements starting at `offset` to the host, widened to f32.
    fn cache_download(&self, cache: &Self::Cache, offset: usize, len: usize) -> Vec<f32>;
    /// Copies `len` floats of `src` from `src_offset` into `dst` from `dst_offset`, on the
    /// device and bitwise (saving and restoring a session's DeltaNet states).
    fn copy(&self, src: &Self::Buf, src_offset: usize, dst: &mut Self::Buf, dst_offset: usize, len: usize);
    /// Copies `len` elements of `src` from `src_offset` into `dst` from `dst_offset`, on the
    /// device and bitwise, in the caches' element type (saving and restoring a session's KV
    /// rows).
    fn cache_copy(
        &self,
        src: &Self::Cache,
        src_offset: usize,
        dst: &mut Self::Cache,
        dst_offset: usize,
        len: usize,
    );
    /// Free device memory in bytes, for backends whose memory is scarce and separate from the
    /// host's (`None`: the host's memory, sessions grow on demand).
    fn free_memory(&self) -> Option<usize> {
        None
    }
    /// How many prompt tokens a forward pass should take at most ([`crate::model::Model::
    /// pass_tokens`]): a multiple of 64. The CPU's 512 keeps a pass's activations in cache; a
    /// GPU's matrix products want more rows.
    fn preferred_pass_tokens(&self) -> usize {
        DEFAULT_PASS_TOKENS
    }
    /// Bytes read from memory per decoded token for a weight (for roofline figures).
    fn weight_bytes(&self, w: &Self::Weight) -> usize;
    /// A weight's `(rows, cols)`.
    fn weight_shape(&self, w: &Self::Weight) -> (usize, usize);

    // --- decode steps -------------------------------------------------------------------------

    /// Runs one decode step: `step` issues the step's ops for rows fed `ids` at `positions` and
    /// returns the buffer holding the step's output, which `read` then reads back.
    ///
    /// A backend may record the ops `step` issues and, on a later call with the same `key`,
    /// replay the recording instead of calling `step` (CUDA graphs). The caller guarantees
    /// that one key always names the same sequences with the same state buffers, so that a
    /// step differs from a recorded one only in `ids` and `positions`; a recording backend
    /// makes its ops read those two from device memory it refills before each replay, and
    /// must give bitwise the results of running `step`.
    fn decode_step(
        &self,
        key: u64,
        ids: &[u32],
        positions: &[usize],
        step: &mut dyn FnMut() -> Self::Buf,
        read: &mut dyn FnMut(&Self::Buf),
    ) {
        let _ = (key, ids, positions);
        let out = step();
        read(&out);
    }

    /// The greedy token of each `[cols]` row of `x`: the index of its largest value, ties to the
    /// lowest index; `Err` for a row that is not [`crate::sampling::usable`] (NaN, +∞, or
    /// nothing above −∞).
    fn argmax_rows(&self, x: &Self::Buf, rows: usize, cols: usize) -> Vec<Result<u32, NonFiniteLogits>> {
        let v = self.download(x, 0, rows * cols);
        v.chunks(cols.max(1)).take(rows).map(crate::sampling::greedy).collect()
    }

    /// Finishes prepared draws next to the logits (`[_, vocab]`): pick `i` names a row and how
    /// to draw its token, [`crate::sampling::sample_prepared`]'s result; only the ids (and the
    /// log-probabilities asked for) come back. The rows' logits may be modified. The default
    /// downloads each row and draws on the host.
    fn sample_rows(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        picks: &[(usize, &PreparedSample)],
    ) -> Vec<Result<Draw, NonFiniteLogits>> {
        picks
            .iter()
            .map(|&(row, p)| {
                crate::sampling::sample_prepared(&mut self.download(logits, row * vocab, vocab), p)
            })
            .collect()
    }

    fn embed(&self, table: &Self::Weight, ids: &[u32], dim: usize, out: &mut Self::Buf);
    /// `out = x · Wᵀ` for `x: [tokens, cols]`, `W: [rows, cols]`, `out: [tokens, rows]`.
    fn matmul(&self, x: &Self::Buf, tokens: usize, w: &Self::Weight, out: &mut Self::Buf);
    /// [`Backend::matmul`] for a decode batch: row `t` of `out` must be bitwise what `matmul`
    /// gives for row `t` of `x` alone (`tokens = 1`), whatever the batch size, so a sequence's
    /// tokens never depend on what else is in the batch.
    fn matmul_rows(&self, x: &Self::Buf, tokens: usize, w: &Self::Weight, out: &mut Self::Buf);
    /// `outs[j] = x · ws[j]ᵀ` for weights that read the same `x` (the projections of one
    /// normed input), which a backend may run as one pass. `decode_batch` says which contract
    /// each product keeps: [`Backend::matmul_rows`]'s (rows independent of the batch) or
    /// [`Backend::matmul`]'s.
    fn matmul_many(
        &self,
        x: &Self::Buf,
        tokens: usize,
        ws: &[&Self::Weight],
        outs: &mut [&mut Self::Buf],
        decode_batch: bool,
    ) {
        matmul_each(self, x, tokens, ws, outs, decode_batch);
    }
    /// The first half of a gated MLP: `acts.act = silu(x · gateᵀ) * (x · upᵀ)` (`[tokens,
    /// rows]`), which a backend may compute in one pass (the SwiGLU in the GEMV's epilogue). The
    /// default is [`Backend::matmul_many`] into `acts.gate` and `acts.up` (a backend that fuses
    /// may leave them untouched) and [`Backend::swiglu`]; `decode_batch` as for `matmul_many`,
    /// and the result must equal the default's (bitwise where the backend's batch invariance
    /// depends on it).
    fn matmul_glu(
        &self,
        x: &Self::Buf,
        tokens: usize,
        gate: &Self::Weight,
        up: &Self::Weight,
        acts: MlpActivations<'_, Self::Buf>,
        decode_batch: bool,
    ) {
        matmul_glu_each(self, x, tokens, gate, up, acts, decode_batch);
    }
    /// The gated MLP, `out = (silu(x · gateᵀ) * (x · upᵀ)) · downᵀ`: [`Backend::matmul_glu`]
    /// into the scratch `acts`, then the down product (row by row with
    /// [`Backend::matmul_rows`] for a decode batch). A backend may fuse steps, leaving the
    /// scratch unspecified; `out` must equal the default's (bitwise where the backend's batch
    /// invariance depends on it).
    fn mlp(
        &self,
        x: &Self::Buf,
        tokens: usize,
        weights: MlpWeights<'_, Self::Weight>,
        acts: MlpActivations<'_, Self::Buf>,
        out: &mut Self::Buf,
        decode_batch: bool,
    ) {
        mlp_each(self, x, tokens, weights, acts, out, decode_batch);
    }
    /// The routed experts of a sparse MoE block (`Qwen3_5MoeTopKRouter` and
    /// `Qwen3_5MoeExperts`): for each row `t` of `x: [tokens, hidden]`, route its
    /// `router_logits: [tokens, num_experts]` row ([`Routing::new`]: softmax, the experts'
    /// `top_k`, renormalised) and write `out[t] = Σ weight_e · expert_e(x[t])` over its chosen experts,
    /// summed in ascending expert id from zero (`out: [tokens, hidden]`, overwritten; a
    /// backend may replace the buffer with one of exactly that size). `decode_batch` as for
    /// [`Backend::matmul_many`]: each row must then be bitwise what it gives alone.
    ///
    /// The default ([`moe_experts_on_host`]) routes on the host and runs each chosen expert's
    /// tokens through [`Backend::mlp`]: correct on any backend, with two downloads and uploads
    /// per expert. A backend that keeps it on the device says so with
    /// [`Backend::moe_on_device`].
    fn moe_experts(
        &self,
        x: &Self::Buf,
        tokens: usize,
        router_logits: &Self::Buf,
        experts: &MoeExperts<Self>,
        out: &mut Self::Buf,
        decode_batch: bool,
    ) {
        moe_experts_on_host(self, x, tokens, router_logits, experts, out, decode_batch);
    }
    /// The shared expert's gate (`Qwen3_5MoeSparseMoeBlock`): `out[r] += sigmoid(gate[r]) *
    /// x[r]` for `rows` rows of `dim` (`gate: [rows]`, one logit per row). The default
    /// ([`add_sigmoid_gated_on_host`]) computes it on the host.
    fn add_sigmoid_gated(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        gate: &Self::Buf,
        rows: usize,
        dim: usize,
    ) {
        add_sigmoid_gated_on_host(self, out, x, gate, rows, dim);
    }
    /// The sparse MoE block (`Qwen3_5MoeSparseMoeBlock.forward`) on `x: [tokens, hidden]`:
    /// the shared expert, the router, the routed experts' weighted sum, plus the shared
    /// expert's output scaled by the sigmoid of its gate, into `out: [tokens, hidden]`. The
    /// default ([`sparse_moe_each`]) runs it as those ops; a backend may fuse them, where
    /// `decode_batch` is set keeping each row bitwise what it gives alone.
    fn sparse_moe(
        &self,
        x: &Self::Buf,
        tokens: usize,
        moe: SparseMoe<'_, Self>,
        scratch: MoeScratch<'_, Self::Buf>,
        out: &mut Self::Buf,
        decode_batch: bool,
    ) {
        sparse_moe_each(self, x, tokens, moe, scratch, out, decode_batch);
    }
    /// Whether [`Backend::moe_experts`] with these experts (and their `top_k`), and
    /// [`Backend::add_sigmoid_gated`], run a decode batch without reading anything back to the
    /// host, so that a decode step of a MoE model may be recorded ([`Backend::decode_step`]).
    /// The defaults route on the host: a backend that keeps their defaults answers `false`,
    /// and the model then runs MoE decode steps op by op.
    fn moe_on_device(&self, experts: &MoeExperts<Self>) -> bool {
        let _ = experts;
        false
    }
    /// Device bytes a prompt pass holds for a MoE layer's experts whatever its length (a
    /// backend that widens packed experts for its prompt GEMMs allocates them for the pass), on
    /// top of [`crate::model::pass_bytes_per_token`]; the model keeps that much free beside
    /// its sessions. None by default.
    fn moe_prompt_scratch_bytes(&self, experts: &MoeExperts<Self>) -> usize {
        let _ = experts;
        0
    }
    /// `Qwen3_5RMSNorm`: `out = x / rms(x) * (1 + weight)` over rows of `norm.dim`.
    fn rms_norm(&self, x: &Self::Buf, norm: RmsNorm<'_, Self::Buf>, out: &mut Self::Buf);
    /// `residual += x`, then `out = rms_norm(residual)`: the residual add fused with the next norm.
    fn add_rms_norm(
        &self,
        residual: &mut Self::Buf,
        x: &Self::Buf,
        norm: RmsNorm<'_, Self::Buf>,
        out: &mut Self::Buf,
    );
    /// `out = silu(gate) * up` over `len` floats.
    fn swiglu(&self, gate: &Self::Buf, up: &Self::Buf, len: usize, out: &mut Self::Buf);
    /// Copies row `src_row` of a `[_, dim]` buffer into row 0 of `out` (to run the lm_head on
    /// the last position only).
    fn copy_row(&self, src: &Self::Buf, src_row: usize, dim: usize, out: &mut Self::Buf);

    // --- Gated DeltaNet -----------------------------------------------------------------------

    /// Depthwise causal conv1d over time with SiLU, in place on `qkv: [tokens, conv_dim]`.
    /// `weight: [conv_dim, kernel]`; `state: [conv_dim, kernel - 1]` holds the inputs before
    /// this call and is updated to the last `kernel - 1` inputs.
    fn causal_conv1d_silu(
        &self,
        shape: &DeltaNetShape,
        qkv: &mut Self::Buf,
        tokens: usize,
        weight: &Self::Buf,
        state: &mut Self::Buf,
    );

    /// [`Backend::causal_conv1d_silu`] for a decode batch: row `i` of `qkv` is one token of
    /// sequence `i`, whose conv state is `states[i].conv`.
    fn causal_conv1d_silu_rows(
        &self,
        shape: &DeltaNetShape,
        qkv: &mut Self::Buf,
        weight: &Self::Buf,
        states: &mut [DeltaNetState<'_, Self::Buf>],
    );

    /// One recurrent step of the gated delta rule for a decode batch: row `i` of the input's
    /// `qkv`, `a`, `b` and of `out` belongs to sequence `i`, whose state is
    /// `states[i].recurrent`. Row `i` must equal [`Backend::gated_delta_rule`] in `Recurrent`
    /// mode on that row alone.
    fn gated_delta_rule_rows(
        &self,
        shape: &DeltaNetShape,
        input: DeltaRuleInput<'_, Self::Buf>,
        states: &mut [DeltaNetState<'_, Self::Buf>],
        out: &mut Self::Buf,
    );

    /// A decode batch's whole Gated DeltaNet core: [`Backend::causal_conv1d_silu_rows`] on the
    /// raw `qkv` (which it may overwrite), [`Backend::gated_delta_rule_rows`] and
    /// [`Backend::gated_rms_norm`] with `z` and the layer's `norm`, into `out: [batch,
    /// value_dim]`, updating both parts of each sequence's state. Backends fuse it; the
    /// default runs the three ops.
    fn deltanet_decode_rows(
        &self,
        layer: DeltaNetLayer<'_, Self::Buf>,
        projections: DeltaNetProjections<'_, Self::Buf>,
        states: &mut [DeltaNetState<'_, Self::Buf>],
        out: &mut Self::Buf,
    ) {
        deltanet_decode_each(self, layer, projections, states, out);
    }

    /// The gated delta rule over `tokens` tokens of the input: q and k are L2-normalised, q
    /// scaled by `1/sqrt(k_head_dim)`, `beta = sigmoid(b)`, `g = -exp(a_log) * softplus(a +
    /// dt_bias)`, value head `h` reads key head `h / (num_v_heads / num_k_heads)`. Writes
    /// `out: [tokens, value_dim]` and updates `state: [num_v_heads, k_head_dim, v_head_dim]`.
    fn gated_delta_rule(
        &self,
        shape: &DeltaNetShape,
        mode: DeltaRuleMode,
        input: DeltaRuleInput<'_, Self::Buf>,
        tokens: usize,
        state: &mut Self::Buf,
        out: &mut Self::Buf,
    );

    /// `Qwen3_5RMSNormGated` in place on `rows` rows: each `norm.dim`-row of `x` becomes
    /// `weight * x / rms(x) * silu(z)` (weight not offset by one).
    fn gated_rms_norm(&self, x: &mut Self::Buf, z: &Self::Buf, norm: RmsNorm<'_, Self::Buf>, rows: usize);

    // --- gated attention ----------------------------------------------------------------------

    /// Splits `q_proj`'s output `[tokens, heads, 2 * head_dim]` (query then gate, per head) into
    /// `q: [tokens, heads * head_dim]` and `gate` (same shape), RMS-norms q and `k`
    /// (`[tokens, kv_heads * head_dim]`, in place) per head with `(1 + q_norm)` / `(1 + k_norm)`,
    /// and applies rotate-half RoPE with the layer's `inv_freq` to the first `rotary_dim` dims
    /// of every head of q and k, row `t` at position `positions[t]` (`tokens =
    /// positions.len()`).
    fn attention_prologue(
        &self,
        layer: AttentionLayer<'_, Self::Buf>,
        q_and_gate: &Self::Buf,
        k: &mut Self::Buf,
        positions: &[usize],
        q: &mut Self::Buf,
        gate: &mut Self::Buf,
    );

    /// Writes the input's `k`, `v` into the cache (rounded to its element type) at rows
    /// `pos0..`, then causal softmax attention of `q` over cache rows `0..pos0 + tokens`
    /// (query `t` sees rows `..=pos0 + t`), scaled by `1/sqrt(head_dim)`, GQA; the result is
    /// multiplied by `sigmoid(gate)` into `out: [tokens, heads * head_dim]`.
    fn attention(
        &self,
        shape: &AttentionShape,
        input: AttentionInput<'_, Self::Buf>,
        cache: KvCache<'_, Self::Cache>,
        pos0: usize,
        tokens: usize,
        out: &mut Self::Buf,
    );

    /// [`Backend::attention`] for a decode batch: row `i` of the input and of `out` is the
    /// token of sequence `i` at position `positions[i]`, whose cache is `caches[i]`. Row `i`
    /// must equal `attention` on that row alone.
    fn attention_rows(
        &self,
        shape: &AttentionShape,
        input: AttentionInput<'_, Self::Buf>,
        caches: &mut [KvCache<'_, Self::Cache>],
        positions: &[usize],
        out: &mut Self::Buf,
    );
}

/// [`Backend::deltanet_decode_rows`] as its three ops: the default, and a backend's fallback
/// for shapes its fused kernel does not take.
pub fn deltanet_decode_each<B: Backend + ?Sized>(
    be: &B,
    layer: DeltaNetLayer<'_, B::Buf>,
    projections: DeltaNetProjections<'_, B::Buf>,
    states: &mut [DeltaNetState<'_, B::Buf>],
    out: &mut B::Buf,
) {
    let DeltaNetProjections { qkv, z, a, b } = projections;
    let shape = &layer.shape;
    be.causal_conv1d_silu_rows(shape, qkv, layer.conv1d, states);
    let input = DeltaRuleInput { qkv, a, b, a_log: layer.a_log, dt_bias: layer.dt_bias };
    be.gated_delta_rule_rows(shape, input, states, out);
    let rows = states.len() * shape.num_v_heads;
    be.gated_rms_norm(out, z, layer.gated_norm(), rows);
}

/// [`Backend::matmul_glu`] as [`Backend::matmul_many`] into `acts.gate` and `acts.up` and
/// [`Backend::swiglu`]: the default, and a backend's fallback.
pub fn matmul_glu_each<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    tokens: usize,
    gate: &B::Weight,
    up: &B::Weight,
    acts: MlpActivations<'_, B::Buf>,
    decode_batch: bool,
) {
    let MlpActivations { gate: gate_out, up: up_out, act } = acts;
    b.matmul_many(x, tokens, &[gate, up], &mut [&mut *gate_out, &mut *up_out], decode_batch);
    b.swiglu(gate_out, up_out, tokens * b.weight_shape(gate).0, act);
}

/// [`Backend::mlp`] as [`Backend::matmul_glu`] then the down product: the default, and a
/// backend's fallback where it does not fuse.
pub fn mlp_each<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    tokens: usize,
    weights: MlpWeights<'_, B::Weight>,
    acts: MlpActivations<'_, B::Buf>,
    out: &mut B::Buf,
    decode_batch: bool,
) {
    let MlpActivations { gate, up, act } = acts;
    b.matmul_glu(
        x,
        tokens,
        weights.gate,
        weights.up,
        MlpActivations { gate, up, act: &mut *act },
        decode_batch,
    );
    if decode_batch {
        b.matmul_rows(act, tokens, weights.down, out);
    } else {
        b.matmul(act, tokens, weights.down, out);
    }
}

/// [`Backend::moe_experts`] on the host: the router's logits and `x` are downloaded, tokens
/// are grouped by expert, each group's rows are uploaded and run through [`Backend::mlp`] with
/// that expert's weights, and the weighted outputs are summed on the host (in ascending expert
/// id, as the reference's `index_add_`) and uploaded into `out`. The default, and the
/// reference for a backend's own kernels.
pub fn moe_experts_on_host<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    tokens: usize,
    router_logits: &B::Buf,
    experts: &MoeExperts<B>,
    out: &mut B::Buf,
    decode_batch: bool,
) {
    let n = experts.len();
    let (inter, hidden) = b.weight_shape(&experts.gate[0]);
    let routing = Routing::new(&b.download(router_logits, 0, tokens * n), tokens, n, experts.top_k);
    let xs = b.download(x, 0, tokens * hidden);
    let mut acc = vec![0f32; tokens * hidden];
    for (e, members) in routing.by_expert(n).iter().enumerate() {
        if members.is_empty() {
            continue;
        }
        let m = members.len();
        let mut rows = Vec::with_capacity(m * hidden);
        for &(t, _) in members {
            rows.extend_from_slice(&xs[t * hidden..(t + 1) * hidden]);
        }
        let xe = b.upload(&rows);
        let (mut g, mut u, mut a, mut y) =
            (b.scratch(m * inter), b.scratch(m * inter), b.scratch(m * inter), b.scratch(m * hidden));
        let acts = MlpActivations { gate: &mut g, up: &mut u, act: &mut a };
        b.mlp(&xe, m, experts.expert(e), acts, &mut y, decode_batch);
        let ys = b.download(&y, 0, m * hidden);
        for (&(t, w), y) in members.iter().zip(ys.chunks_exact(hidden)) {
            for (o, &v) in acc[t * hidden..(t + 1) * hidden].iter_mut().zip(y) {
                *o += v * w;
            }
        }
    }
    *out = b.upload(&acc);
}

/// [`Backend::sparse_moe`] op by op, as the reference writes it: the default, and a backend's
/// fallback where it does not fuse.
pub fn sparse_moe_each<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    tokens: usize,
    moe: SparseMoe<'_, B>,
    scratch: MoeScratch<'_, B::Buf>,
    out: &mut B::Buf,
    decode_batch: bool,
) {
    let MoeScratch { router_logits, shared_gate, shared_out, shared_acts } = scratch;
    // shared_expert_output = self.shared_expert(hidden_states)
    b.mlp(x, tokens, moe.shared_expert, shared_acts, shared_out, decode_batch);
    // router_logits = self.gate(hidden_states); the shared expert's gate logit beside it.
    b.matmul_many(
        x,
        tokens,
        &[moe.router, moe.shared_expert_gate],
        &mut [&mut *router_logits, &mut *shared_gate],
        decode_batch,
    );
    // expert_output = self.experts(hidden_states, selected_experts, routing_weights)
    b.moe_experts(x, tokens, router_logits, moe.experts, out, decode_batch);
    // expert_output + sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
    let hidden = b.weight_shape(moe.shared_expert.down).0;
    b.add_sigmoid_gated(out, shared_out, shared_gate, tokens, hidden);
}

/// [`Backend::add_sigmoid_gated`] on the host: the default.
pub fn add_sigmoid_gated_on_host<B: Backend + ?Sized>(
    b: &B,
    out: &mut B::Buf,
    x: &B::Buf,
    gate: &B::Buf,
    rows: usize,
    dim: usize,
) {
    let mut o = b.download(out, 0, rows * dim);
    let xs = b.download(x, 0, rows * dim);
    let g = b.download(gate, 0, rows);
    for ((o, x), &g) in o.chunks_exact_mut(dim.max(1)).zip(xs.chunks_exact(dim.max(1))).zip(&g) {
        let s = sigmoid(g);
        for (o, &x) in o.iter_mut().zip(x) {
            *o += s * x;
        }
    }
    *out = b.upload(&o);
}

/// [`Backend::matmul_many`] one product at a time: the default, and a backend's fallback for
/// weights it cannot fuse.
pub fn matmul_each<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    tokens: usize,
    ws: &[&B::Weight],
    outs: &mut [&mut B::Buf],
    decode_batch: bool,
) {
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        if decode_batch {
            b.matmul_rows(x, tokens, w, out);
        } else {
            b.matmul(x, tokens, w, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_types_parse_and_size() {
        assert_eq!("bf16".parse::<KvCacheType>().unwrap(), KvCacheType::Bf16);
        assert_eq!(" F32 ".parse::<KvCacheType>().unwrap(), KvCacheType::F32);
        let e = "f16".parse::<KvCacheType>().unwrap_err();
        assert!(e.contains("f16") && e.contains("bf16 or f32"), "{e}");
        assert_eq!((KvCacheType::Bf16.bytes(), KvCacheType::F32.bytes()), (2, 4));
        assert_eq!(KvCacheType::default(), KvCacheType::F32);
        assert_eq!(KvCacheType::Bf16.to_string(), "bf16");
    }
}
