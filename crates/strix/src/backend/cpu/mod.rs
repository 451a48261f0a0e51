//! The CPU backend: f32 arithmetic on all cores (rayon), SIMD kernels in [`matmul`] (float
//! weights), [`qmatmul`] / [`qpacked`] (GGML block formats, integer dot products) and
//! [`simd`]. Float weights are read in place from the memory-mapped checkpoint in their
//! stored dtype; GGML block weights are repacked at load into groups of eight interleaved
//! rows ([`qpacked::Packed`]). [`optimes`] keeps the wall time of every op when asked to.

pub mod attention;
pub mod deltanet;
pub mod matmul;
pub mod moe;
pub mod optimes;
pub mod pages;
pub mod qmatmul;
pub mod qpacked;
pub mod simd;

use std::sync::Arc;

use rayon::prelude::*;

use crate::backend::{
    AttentionInput, AttentionLayer, AttentionShape, Backend, DeltaNetShape, DeltaNetState, DeltaRuleInput,
    DeltaRuleMode, KvCache, MoeExperts, RmsNorm,
};
use crate::error::Result;
use crate::sampling::NonFiniteLogits;
use crate::tensor::{Bytes, DType, HostTensor};
use matmul::WeightRef;
use optimes::{OpKey, OpTimer, OpTimes};
use qpacked::{Packed, PackedKind};

/// Runs every op on the host CPU.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    /// Where each op's wall time goes, when the caller asked for it.
    times: Option<Arc<OpTimes>>,
    /// The packed int8 kernels, chosen when the backend is built.
    kern: qmatmul::Kern,
}

/// The CPU backend's choices, made once when it is built (the CLI fills them from its flags
/// and environment; the library reads neither).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuOptions {
    /// Keep the packed int8 kernels on 256-bit AVX2 where the CPU has AVX-512 VNNI, to measure
    /// one against the other (the same bits either way).
    pub no_vnni: bool,
}

impl Default for CpuBackend {
    fn default() -> CpuBackend {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The backend with the best kernels this CPU has.
    pub fn new() -> CpuBackend {
        CpuBackend::with_options(CpuOptions::default())
    }

    pub fn with_options(options: CpuOptions) -> CpuBackend {
        CpuBackend { times: None, kern: qmatmul::Kern::chosen(&options) }
    }

    /// This backend, adding the wall time of every op it runs to `times` (`strix bench
    /// --verbose`).
    pub fn with_op_times(self, times: Arc<OpTimes>) -> CpuBackend {
        CpuBackend { times: Some(times), ..self }
    }

    /// The op times this backend records into, if any.
    pub fn op_times(&self) -> Option<&Arc<OpTimes>> {
        self.times.as_ref()
    }

    /// Times the op until the returned guard drops (nothing when no times are kept).
    fn timed(&self, op: &'static str) -> Option<OpTimer<'_>> {
        let key = OpKey { op, dtype: "", shape: (0, 0) };
        self.times.as_deref().map(|t| OpTimer::start(t, key))
    }

    /// [`CpuBackend::timed`] for an op on a weight matrix, filed under its dtype and shape.
    fn timed_weight(&self, op: &'static str, w: &CpuWeight) -> Option<OpTimer<'_>> {
        let key = OpKey { op, dtype: w.dtype.name(), shape: (w.rows, w.cols) };
        self.times.as_deref().map(|t| OpTimer::start(t, key))
    }
}

/// A `[rows, cols]` matrix: float elements kept in their checkpoint dtype (a view into the
/// mapped file), or GGML blocks repacked into interleaved row groups.
pub struct CpuWeight {
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: FloatBytes,
    packed: Option<Packed>,
}

/// A float matrix's bytes: copied into huge pages ([`pages`]) when large enough to be streamed
/// every token, else the checkpoint's own (mapped or owned) bytes.
enum FloatBytes {
    View(Bytes),
    Huge(pages::HugeBuf),
}

impl FloatBytes {
    fn new(bytes: &Bytes, align: usize) -> FloatBytes {
        let src = bytes.as_slice();
        match pages::HugeBuf::zeroed_huge_only(src.len()) {
            Some(mut buf) => {
                buf.copy_from_slice(src);
                bytes.release_resident();
                FloatBytes::Huge(buf)
            }
            None => FloatBytes::View(bytes.aligned(align)),
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            FloatBytes::View(b) => b.as_slice(),
            FloatBytes::Huge(b) => b,
        }
    }
}

impl CpuWeight {
    /// The matrix as the matmul kernels take it.
    pub fn kernel_view(&self) -> KernelRef<'_> {
        if let Some(p) = &self.packed {
            return KernelRef::Quant(p);
        }
        let b = self.bytes.as_slice();
        match self.dtype {
            DType::Q8_0 | DType::Q4_0 | DType::Q4_K | DType::Q6_K => {
                unreachable!("CpuBackend::weight packs every block format")
            }
            // SAFETY: `CpuBackend::weight` checked the length, and `FloatBytes::new` gives the
            // element type's alignment (a huge-page buffer is 64-byte aligned); safetensors data is little-endian, as are the
            // hosts we build for.
            DType::BF16 => KernelRef::Float(WeightRef::Bf16(unsafe {
                std::slice::from_raw_parts(b.as_ptr() as *const u16, b.len() / 2)
            })),
            DType::F16 => KernelRef::Float(WeightRef::F16(unsafe {
                std::slice::from_raw_parts(b.as_ptr() as *const u16, b.len() / 2)
            })),
            DType::F32 => KernelRef::Float(WeightRef::F32(unsafe {
                std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4)
            })),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// A weight matrix for the matmul kernels: float elements or packed blocks.
#[derive(Clone, Copy)]
pub enum KernelRef<'a> {
    Float(WeightRef<'a>),
    Quant(&'a Packed),
}

#[cfg(not(target_endian = "little"))]
compile_error!("strix reads little-endian safetensors data in place and needs a little-endian host");

/// Rows per rayon task for row-wise elementwise ops: enough work to amortise scheduling.
fn rows_per_task(dim: usize) -> usize {
    (16384 / dim.max(1)).max(1)
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss = simd::dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

pub(crate) use crate::backend::sigmoid;

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Cache = Vec<f32>;
    type Weight = CpuWeight;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn weight(&self, t: &HostTensor, rows: usize, cols: usize) -> Result<CpuWeight> {
        t.check_matrix(rows, cols)?;
        let kind = match t.dtype {
            DType::Q8_0 => Some(PackedKind::Q8_0),
            DType::Q4_0 => Some(PackedKind::Q4_0),
            DType::Q4_K => Some(PackedKind::Q4_K),
            DType::Q6_K => Some(PackedKind::Q6_K),
            DType::BF16 | DType::F16 | DType::F32 => None,
        };
        if let Some(kind) = kind {
            let packed = Packed::pack(kind, t.bytes.as_slice(), rows, cols);
            return Ok(CpuWeight {
                dtype: t.dtype,
                rows,
                cols,
                bytes: FloatBytes::View(Bytes::owned(&[])),
                packed: Some(packed),
            });
        }
        Ok(CpuWeight {
            dtype: t.dtype,
            rows,
            cols,
            bytes: FloatBytes::new(&t.bytes, t.dtype.align()),
            packed: None,
        })
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn zeros(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn resize(&self, buf: &mut Vec<f32>, len: usize) {
        buf.resize(len, 0.0);
    }

    // The CPU is the f32 reference: its caches are exact.
    fn cache_zeros(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }

    fn cache_resize(&self, cache: &mut Vec<f32>, len: usize) {
        cache.resize(len, 0.0);
    }

    fn cache_download(&self, cache: &Vec<f32>, offset: usize, len: usize) -> Vec<f32> {
        cache[offset..offset + len].to_vec()
    }

    fn download(&self, buf: &Vec<f32>, offset: usize, len: usize) -> Vec<f32> {
        buf[offset..offset + len].to_vec()
    }

    fn copy(&self, src: &Vec<f32>, src_offset: usize, dst: &mut Vec<f32>, dst_offset: usize, len: usize) {
        dst[dst_offset..dst_offset + len].copy_from_slice(&src[src_offset..src_offset + len]);
    }

    fn cache_copy(
        &self,
        src: &Vec<f32>,
        src_offset: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        len: usize,
    ) {
        self.copy(src, src_offset, dst, dst_offset, len);
    }

    fn weight_bytes(&self, w: &CpuWeight) -> usize {
        w.packed.as_ref().map_or(w.bytes.as_slice().len(), |p| p.bytes())
    }

    fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    // The logits are already host memory: read them in place rather than copy a row of the
    // whole vocabulary (1 MB for Qwen3.5) every decode step.
    fn argmax_rows(&self, x: &Vec<f32>, rows: usize, cols: usize) -> Vec<Result<u32, NonFiniteLogits>> {
        x[..rows * cols].chunks(cols.max(1)).take(rows).map(crate::sampling::greedy).collect()
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], dim: usize, out: &mut Vec<f32>) {
        let _t = self.timed_weight("embed", table);
        assert_eq!(table.cols, dim);
        let view = table.kernel_view();
        out[..ids.len() * dim].par_chunks_mut(dim).zip(ids.par_iter()).for_each(|(row, &id)| match view {
            KernelRef::Float(w) => matmul::row_to_f32(w, dim, id as usize, row),
            KernelRef::Quant(w) => qmatmul::row_to_f32(w, id as usize, row),
        });
    }

    fn matmul(&self, x: &Vec<f32>, tokens: usize, w: &CpuWeight, out: &mut Vec<f32>) {
        let _t = self.timed_weight("matmul", w);
        let (x, out) = (&x[..tokens * w.cols], &mut out[..tokens * w.rows]);
        match w.kernel_view() {
            KernelRef::Float(v) => matmul::matmul(x, tokens, v, w.rows, w.cols, out),
            KernelRef::Quant(v) => qmatmul::matmul_with(self.kern, x, tokens, v, out),
        }
    }

    fn matmul_rows(&self, x: &Vec<f32>, tokens: usize, w: &CpuWeight, out: &mut Vec<f32>) {
        let _t = self.timed_weight("matmul_rows", w);
        let (x, out) = (&x[..tokens * w.cols], &mut out[..tokens * w.rows]);
        match w.kernel_view() {
            KernelRef::Float(v) => matmul::matmul_rows(x, tokens, v, w.rows, w.cols, out),
            KernelRef::Quant(v) => qmatmul::matmul_with(self.kern, x, tokens, v, out),
        }
    }

    fn moe_experts(
        &self,
        x: &Vec<f32>,
        tokens: usize,
        router_logits: &Vec<f32>,
        experts: &MoeExperts<CpuBackend>,
        out: &mut Vec<f32>,
        decode_batch: bool,
    ) {
        let _t = self.timed("moe_experts");
        moe::moe_experts(self, x, tokens, router_logits, experts, out, decode_batch);
    }

    fn add_sigmoid_gated(&self, out: &mut Vec<f32>, x: &Vec<f32>, gate: &Vec<f32>, rows: usize, dim: usize) {
        let _t = self.timed("add_sigmoid_gated");
        out[..rows * dim]
            .par_chunks_mut(dim)
            .zip(x[..rows * dim].par_chunks(dim))
            .zip(&gate[..rows])
            .for_each(|((o, x), &g)| {
                let s = sigmoid(g);
                for (o, &x) in o.iter_mut().zip(x) {
                    *o += s * x;
                }
            });
    }

    // Nothing to record on the CPU: every op runs where the routing is decided.
    fn moe_on_device(&self, _experts: &MoeExperts<CpuBackend>) -> bool {
        true
    }

    fn rms_norm(&self, x: &Vec<f32>, norm: RmsNorm<'_, Vec<f32>>, out: &mut Vec<f32>) {
        let _t = self.timed("rms_norm");
        let RmsNorm { weight, dim, eps } = norm;
        let rows = x.len().min(out.len()) / dim;
        out[..rows * dim]
            .par_chunks_mut(dim * rows_per_task(dim))
            .zip(x[..rows * dim].par_chunks(dim * rows_per_task(dim)))
            .for_each(|(o, x)| {
                for (o, x) in o.chunks_mut(dim).zip(x.chunks(dim)) {
                    let s = rms_scale(x, eps);
                    for ((o, &x), &w) in o.iter_mut().zip(x).zip(weight) {
                        *o = x * s * (1.0 + w);
                    }
                }
            });
    }

    fn add_rms_norm(
        &self,
        residual: &mut Vec<f32>,
        x: &Vec<f32>,
        norm: RmsNorm<'_, Vec<f32>>,
        out: &mut Vec<f32>,
    ) {
        let _t = self.timed("add_rms_norm");
        let RmsNorm { weight, dim, eps } = norm;
        let rows = residual.len().min(x.len()).min(out.len()) / dim;
        let n = dim * rows_per_task(dim);
        residual[..rows * dim]
            .par_chunks_mut(n)
            .zip(x[..rows * dim].par_chunks(n))
            .zip(out[..rows * dim].par_chunks_mut(n))
            .for_each(|((r, x), o)| {
                for ((r, x), o) in r.chunks_mut(dim).zip(x.chunks(dim)).zip(o.chunks_mut(dim)) {
                    for (r, &x) in r.iter_mut().zip(x) {
                        *r += x;
                    }
                    let s = rms_scale(r, eps);
                    for ((o, &r), &w) in o.iter_mut().zip(r.iter()).zip(weight) {
                        *o = r * s * (1.0 + w);
                    }
                }
            });
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
        let _t = self.timed("swiglu");
        out[..len]
            .par_chunks_mut(16384)
            .zip(gate[..len].par_chunks(16384))
            .zip(up[..len].par_chunks(16384))
            .for_each(|((o, g), u)| {
                simd::swiglu(simd::Isa::detect(), g, u, o);
            });
    }

    fn copy_row(&self, src: &Vec<f32>, src_row: usize, dim: usize, out: &mut Vec<f32>) {
        out[..dim].copy_from_slice(&src[src_row * dim..(src_row + 1) * dim]);
    }

    fn causal_conv1d_silu(
        &self,
        shape: &DeltaNetShape,
        qkv: &mut Vec<f32>,
        tokens: usize,
        weight: &Vec<f32>,
        state: &mut Vec<f32>,
    ) {
        let _t = self.timed("causal_conv1d_silu");
        deltanet::causal_conv1d_silu(shape, &mut qkv[..tokens * shape.conv_dim()], tokens, weight, state);
    }

    fn causal_conv1d_silu_rows(
        &self,
        shape: &DeltaNetShape,
        qkv: &mut Vec<f32>,
        weight: &Vec<f32>,
        states: &mut [DeltaNetState<'_, Vec<f32>>],
    ) {
        let _t = self.timed("causal_conv1d_silu_rows");
        let dim = shape.conv_dim();
        qkv[..states.len() * dim].par_chunks_mut(dim).zip(states.par_iter_mut()).for_each(|(row, state)| {
            deltanet::causal_conv1d_silu(shape, row, 1, weight, state.conv);
        });
    }

    fn gated_delta_rule_rows(
        &self,
        shape: &DeltaNetShape,
        input: DeltaRuleInput<'_, Vec<f32>>,
        states: &mut [DeltaNetState<'_, Vec<f32>>],
        out: &mut Vec<f32>,
    ) {
        let _t = self.timed("gated_delta_rule_rows");
        let (cd, vd, nv) = (shape.conv_dim(), shape.value_dim(), shape.num_v_heads);
        out[..states.len() * vd].par_chunks_mut(vd).zip(states.par_iter_mut()).enumerate().for_each(
            |(i, (out, state))| {
                let row = deltanet::RawInputs {
                    qkv: &input.qkv[i * cd..(i + 1) * cd],
                    a: &input.a[i * nv..(i + 1) * nv],
                    b: &input.b[i * nv..(i + 1) * nv],
                    a_log: input.a_log,
                    dt_bias: input.dt_bias,
                };
                deltanet::recurrent_one_token(shape, row, state.recurrent, out);
            },
        );
    }

    fn gated_delta_rule(
        &self,
        shape: &DeltaNetShape,
        mode: DeltaRuleMode,
        input: DeltaRuleInput<'_, Vec<f32>>,
        tokens: usize,
        state: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        let _t = self.timed(match mode {
            DeltaRuleMode::Recurrent => "gated_delta_rule (recurrent)",
            DeltaRuleMode::Chunked => "gated_delta_rule (chunked)",
        });
        let DeltaRuleInput { qkv, a, b, a_log, dt_bias } = input;
        let raw = deltanet::RawInputs { qkv, a, b, a_log, dt_bias };
        let inputs = deltanet::DeltaRuleInputs::prepare(shape, raw, tokens);
        let out = &mut out[..tokens * shape.value_dim()];
        match mode {
            DeltaRuleMode::Recurrent => deltanet::recurrent(shape, &inputs, state, out),
            DeltaRuleMode::Chunked => deltanet::chunked(shape, &inputs, state, out),
        }
    }

    fn gated_rms_norm(&self, x: &mut Vec<f32>, z: &Vec<f32>, norm: RmsNorm<'_, Vec<f32>>, rows: usize) {
        let _t = self.timed("gated_rms_norm");
        let RmsNorm { weight, dim, eps } = norm;
        let n = dim * rows_per_task(dim);
        x[..rows * dim].par_chunks_mut(n).zip(z[..rows * dim].par_chunks(n)).for_each(|(x, z)| {
            for (x, z) in x.chunks_mut(dim).zip(z.chunks(dim)) {
                let s = rms_scale(x, eps);
                simd::gated_scale(simd::Isa::detect(), x, z, weight, s);
            }
        });
    }

    fn attention_prologue(
        &self,
        layer: AttentionLayer<'_, Vec<f32>>,
        q_and_gate: &Vec<f32>,
        k: &mut Vec<f32>,
        positions: &[usize],
        q: &mut Vec<f32>,
        gate: &mut Vec<f32>,
    ) {
        let _t = self.timed("attention_prologue");
        attention::prologue(layer, q_and_gate, k, positions, q, gate);
    }

    fn attention(
        &self,
        shape: &AttentionShape,
        input: AttentionInput<'_, Vec<f32>>,
        cache: KvCache<'_, Vec<f32>>,
        pos0: usize,
        tokens: usize,
        out: &mut Vec<f32>,
    ) {
        let _t = self.timed("attention");
        let kv = shape.kv_dim();
        cache.k[pos0 * kv..(pos0 + tokens) * kv].copy_from_slice(&input.k[..tokens * kv]);
        cache.v[pos0 * kv..(pos0 + tokens) * kv].copy_from_slice(&input.v[..tokens * kv]);
        let query = attention::Query { q: input.q, gate: input.gate };
        attention::causal(shape, query, attention::Rows { k: cache.k, v: cache.v }, pos0, tokens, out);
    }

    fn attention_rows(
        &self,
        shape: &AttentionShape,
        input: AttentionInput<'_, Vec<f32>>,
        caches: &mut [KvCache<'_, Vec<f32>>],
        positions: &[usize],
        out: &mut Vec<f32>,
    ) {
        let _t = self.timed("attention_rows");
        let kv = shape.kv_dim();
        let qd = shape.num_heads * shape.head_dim;
        out[..positions.len() * qd].par_chunks_mut(qd).zip(caches.par_iter_mut()).enumerate().for_each(
            |(i, (out, cache))| {
                let pos = positions[i];
                cache.k[pos * kv..(pos + 1) * kv].copy_from_slice(&input.k[i * kv..(i + 1) * kv]);
                cache.v[pos * kv..(pos + 1) * kv].copy_from_slice(&input.v[i * kv..(i + 1) * kv]);
                let rows = i * qd..(i + 1) * qd;
                let query = attention::Query { q: &input.q[rows.clone()], gate: &input.gate[rows] };
                attention::causal(shape, query, attention::Rows { k: cache.k, v: cache.v }, pos, 1, out);
            },
        );
    }
}
