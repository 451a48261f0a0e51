//! Gated DeltaNet on the CPU: the causal convolution and the gated delta rule, both as a
//! token-by-token recurrence (decode) and in chunks of 64 with the UT transform (prefill).
//!
//! Per value head `h` the state `S` is a `k_head_dim x v_head_dim` matrix and each token does
//! `S ← exp(g)·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq`. The chunked form computes the same
//! thing for `L` tokens at once: with `γᵢ = g₁ + … + gᵢ` inside the chunk and
//! `A = strict_lower((β k) kᵀ ⊙ exp(γᵢ − γⱼ))`, solving `(I + A) U = β v` and
//! `(I + A) W = β k exp(γ)` gives `v' = U − W S`, the outputs
//! `o = (q exp(γ)) S + (q kᵀ ⊙ exp(γᵢ − γⱼ))_{j≤i} v'` and the next state
//! `S exp(γ_L) + (k exp(γ_L − γ))ᵀ v'` — `torch_chunk_gated_delta_rule` step for step.

use rayon::prelude::*;

use super::sigmoid;
use super::simd::{
    axpy, decay_and_read, dot, scale, silu_in_place, update_and_read, FlushSubnormals, Isa, SharedMut,
};
use crate::backend::DeltaNetShape;

/// Tokens per chunk of the chunked form (the reference's `chunk_size`).
pub const CHUNK: usize = 64;

/// Channels per work item of [`causal_conv1d_silu`]: a few cache lines of every token row.
const CONV_BLOCK: usize = 64;

/// Depthwise causal convolution with SiLU, in place on `qkv: [tokens, conv_dim]`.
///
/// Each work item owns a block of [`CONV_BLOCK`] channels and walks the tokens in order,
/// keeping the last `kernel − 1` inputs of its channels in a small ring, so the output can
/// overwrite the input in place and nothing the size of the prompt is allocated (copying the
/// inputs aside, 12 MB for a 512-token 0.8B pass, and faulting its pages in cost more than
/// the arithmetic). Per channel the sum is `0 + w₀x₀ + w₁x₁ + …` in tap order, unfused.
pub fn causal_conv1d_silu(
    shape: &DeltaNetShape,
    qkv: &mut [f32],
    tokens: usize,
    weight: &[f32],
    state: &mut [f32],
) {
    let channels = shape.conv_dim();
    let k = shape.conv_kernel;
    assert_eq!(qkv.len(), tokens * channels);
    assert_eq!(weight.len(), channels * k);
    assert_eq!(state.len(), channels * (k - 1));
    let isa = Isa::detect();
    if tokens == 1 {
        return conv_one_token(isa, k, qkv, weight, state);
    }
    let blocks = channels.div_ceil(CONV_BLOCK);
    let ptr = SharedMut::new(qkv);
    let block = |(b, state): (usize, &mut [f32])| {
        let c0 = b * CONV_BLOCK;
        let n = CONV_BLOCK.min(channels - c0);
        // SAFETY: block `b` reads and writes channels c0..c0 + n of every token row and no
        // other block touches them; `qkv` is borrowed mutably for the whole call.
        let rows = |t: usize| unsafe { std::slice::from_raw_parts_mut(ptr.at(t * channels + c0), n) };
        conv_block(isa, k, n, tokens, &weight[c0 * k..(c0 + n) * k], state, rows);
    };
    let states = block_states(state, k - 1, blocks).into_iter().enumerate();
    // One token is a few microseconds of work: not worth waking the pool.
    if tokens * channels >= 1 << 15 {
        states.par_bridge().for_each(block);
    } else {
        states.for_each(block);
    }
}

/// Each channel block's part of the conv state (`hist` values per channel; empty parts when
/// there is no history to keep).
fn block_states(state: &mut [f32], hist: usize, blocks: usize) -> Vec<&mut [f32]> {
    if hist == 0 {
        return (0..blocks).map(|_| Default::default()).collect();
    }
    state.chunks_mut(CONV_BLOCK * hist).collect()
}

/// [`causal_conv1d_silu`] for one token (decode): straight over the channels in their stored
/// layouts, the same sums as the blocked path (whose per-block set-up would cost more than
/// the arithmetic of one token).
fn conv_one_token(isa: Isa, k: usize, x: &mut [f32], weight: &[f32], state: &mut [f32]) {
    #[inline(always)]
    fn body(isa: Isa, k: usize, x: &mut [f32], weight: &[f32], state: &mut [f32]) {
        let hist = k - 1;
        if hist == 0 {
            for (x, &w) in x.iter_mut().zip(weight) {
                *x = 0.0 + w * *x;
            }
            return silu_in_place(isa, x);
        }
        // Qwen3.5's kernel of 4 as a constant, so the taps unroll with no bounds checks.
        if k == 4 {
            taps::<4, 3>(x, weight, state);
        } else {
            for ((x, w), s) in x.iter_mut().zip(weight.chunks_exact(k)).zip(state.chunks_exact_mut(hist)) {
                *x = tap(w, s, *x);
            }
        }
        silu_in_place(isa, x);
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn fast(isa: Isa, k: usize, x: &mut [f32], weight: &[f32], state: &mut [f32]) {
        body(isa, k, x, weight, state)
    }
    match isa {
        // SAFETY: `Isa::Avx2` is only produced after detecting AVX2 and FMA; no contraction.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fast(isa, k, x, weight, state) },
        Isa::Portable => body(isa, k, x, weight, state),
    }
}

/// One channel of a one-token conv: `0 + w₀s₀ + … + w_{k−1}x` (unfused, in tap order), and
/// the channel's history shifted by one with `x` as its newest input.
#[inline(always)]
fn tap(w: &[f32], s: &mut [f32], x: f32) -> f32 {
    let hist = s.len();
    let mut acc = 0f32;
    for i in 0..hist {
        acc += w[i] * s[i];
    }
    acc += w[hist] * x;
    // Element by element: `copy_within` became a memmove call per channel.
    for i in 1..hist {
        s[i - 1] = s[i];
    }
    s[hist - 1] = x;
    acc
}

/// [`tap`] over every channel with the kernel width `K` (history `H = K − 1`) known.
#[inline(always)]
fn taps<const K: usize, const H: usize>(x: &mut [f32], weight: &[f32], state: &mut [f32]) {
    let (w, _) = weight.as_chunks::<K>();
    let (s, _) = state.as_chunks_mut::<H>();
    for ((x, w), s) in x.iter_mut().zip(w).zip(s) {
        *x = tap(w, s, *x);
    }
}

/// One block of `n` channels over all tokens: `weight: [n, k]`, `state: [n, k − 1]` (oldest
/// input first), `rows(t)` the block's `n` values of token `t`, overwritten with the output.
fn conv_block<'a>(
    isa: Isa,
    k: usize,
    n: usize,
    tokens: usize,
    weight: &[f32],
    state: &mut [f32],
    rows: impl Fn(usize) -> &'a mut [f32],
) {
    #[inline(always)]
    fn body<'a>(
        isa: Isa,
        k: usize,
        n: usize,
        tokens: usize,
        weight: &[f32],
        state: &mut [f32],
        rows: impl Fn(usize) -> &'a mut [f32],
    ) {
        let hist = k - 1;
        // Taps tap-major, and a ring of the last `hist` inputs: `ring[(head + i) % hist]` is
        // the input `hist − i` tokens before the current one. Rows of channels, contiguous.
        let mut taps = [[0f32; CONV_BLOCK]; 8];
        let mut ring = [[0f32; CONV_BLOCK]; 8];
        for c in 0..n {
            for j in 0..k {
                taps[j][c] = weight[c * k + j];
            }
            for i in 0..hist {
                ring[i][c] = state[c * hist + i];
            }
        }
        let mut cur = [0f32; CONV_BLOCK];
        // `head` is the ring slot of the oldest input.
        let mut head = 0;
        for t in 0..tokens {
            let row = rows(t);
            cur[..n].copy_from_slice(row);
            let mut acc = [0f32; CONV_BLOCK];
            for (i, tap) in taps.iter().enumerate().take(hist) {
                // (head + i) % hist without a division: both are below hist.
                let slot = if head + i >= hist { head + i - hist } else { head + i };
                let x = &ring[slot];
                for c in 0..CONV_BLOCK {
                    acc[c] += tap[c] * x[c];
                }
            }
            for c in 0..CONV_BLOCK {
                acc[c] += taps[hist][c] * cur[c];
            }
            row.copy_from_slice(&acc[..n]);
            silu_in_place(isa, row);
            if hist > 0 {
                ring[head] = cur;
                head = if head + 1 == hist { 0 } else { head + 1 };
            }
        }
        // The ring in age order once, so the per-channel loop below does no index arithmetic
        // (a division per element there cost more than the whole convolution of a token).
        let oldest_first: [[f32; CONV_BLOCK]; 8] =
            std::array::from_fn(|i| if i < hist { ring[(head + i) % hist] } else { [0.0; CONV_BLOCK] });
        for c in 0..n {
            for i in 0..hist {
                state[c * hist + i] = oldest_first[i][c];
            }
        }
    }
    assert!((1..=8).contains(&k) && n <= CONV_BLOCK, "conv kernel {k} or block {n} out of range");
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn fast<'a>(
        isa: Isa,
        k: usize,
        n: usize,
        tokens: usize,
        weight: &[f32],
        state: &mut [f32],
        rows: impl Fn(usize) -> &'a mut [f32],
    ) {
        body(isa, k, n, tokens, weight, state, rows)
    }
    match isa {
        // SAFETY: `Isa::Avx2` is only produced after detecting AVX2 and FMA. Rust never fuses
        // the multiply and add, so both paths give the same bits.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { fast(isa, k, n, tokens, weight, state, rows) },
        Isa::Portable => body(isa, k, n, tokens, weight, state, rows),
    }
}

/// The delta rule's inputs as the backend's ops get them, for some tokens: the convolved `qkv`
/// rows (`[tokens, conv_dim]`), the raw `a` and `b` rows (`[tokens, num_v_heads]`) and the
/// layer's `a_log` and `dt_bias` (`[num_v_heads]`).
#[derive(Clone, Copy)]
pub struct RawInputs<'a> {
    pub qkv: &'a [f32],
    pub a: &'a [f32],
    pub b: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// The per-token, per-head quantities of the delta rule, laid out head-major so each head's
/// work reads contiguous memory: q (normalised and scaled), k (normalised), v, β and g.
pub struct DeltaRuleInputs {
    tokens: usize,
    /// `[num_k_heads, tokens, k_head_dim]`
    q: Vec<f32>,
    k: Vec<f32>,
    /// `[num_v_heads, tokens, v_head_dim]`
    v: Vec<f32>,
    /// `[num_v_heads, tokens]`
    beta: Vec<f32>,
    g: Vec<f32>,
}

fn l2_normalize(x: &mut [f32]) {
    // The reference's l2norm: x * rsqrt(sum(x²) + 1e-6).
    let inv = 1.0 / (dot(x, x) + 1e-6).sqrt();
    scale(x, inv);
}

/// The delta rule's q and k of one head and token, as the reference prepares them: both
/// l2-normalised, q scaled by `q_scale` (1/√dk).
fn normalise_query_key(q: &mut [f32], k: &mut [f32], q_scale: f32) {
    l2_normalize(q);
    scale(q, q_scale);
    l2_normalize(k);
}

/// The log of a head's decay for one token: `−exp(A_log) · softplus(a + dt_bias)`.
fn log_decay(a_log: f32, a: f32, dt_bias: f32) -> f32 {
    -a_log.exp() * softplus(a + dt_bias)
}

fn softplus(x: f32) -> f32 {
    // torch.nn.functional.softplus with beta 1 and threshold 20.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

impl DeltaRuleInputs {
    pub fn prepare(shape: &DeltaNetShape, raw: RawInputs, tokens: usize) -> DeltaRuleInputs {
        let RawInputs { qkv, a, b, a_log, dt_bias } = raw;
        let (nk, nv, dk, dv) = (shape.num_k_heads, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
        let conv_dim = shape.conv_dim();
        let key_dim = shape.key_dim();
        let q_scale = 1.0 / (dk as f32).sqrt();
        let mut q = vec![0.0f32; nk * tokens * dk];
        let mut k = vec![0.0f32; nk * tokens * dk];
        let mut v = vec![0.0f32; nv * tokens * dv];
        q.par_chunks_mut(tokens * dk).zip(k.par_chunks_mut(tokens * dk)).enumerate().for_each(
            |(h, (q, k))| {
                for t in 0..tokens {
                    let row = &qkv[t * conv_dim..(t + 1) * conv_dim];
                    let qt = &mut q[t * dk..(t + 1) * dk];
                    qt.copy_from_slice(&row[h * dk..(h + 1) * dk]);
                    let kt = &mut k[t * dk..(t + 1) * dk];
                    kt.copy_from_slice(&row[key_dim + h * dk..key_dim + (h + 1) * dk]);
                    normalise_query_key(qt, kt, q_scale);
                }
            },
        );
        v.par_chunks_mut(tokens * dv).enumerate().for_each(|(h, v)| {
            for t in 0..tokens {
                let src = 2 * key_dim + h * dv;
                v[t * dv..(t + 1) * dv].copy_from_slice(&qkv[t * conv_dim + src..t * conv_dim + src + dv]);
            }
        });
        let mut beta = vec![0.0f32; nv * tokens];
        let mut g = vec![0.0f32; nv * tokens];
        for h in 0..nv {
            for t in 0..tokens {
                beta[h * tokens + t] = sigmoid(b[t * nv + h]);
                g[h * tokens + t] = log_decay(a_log[h], a[t * nv + h], dt_bias[h]);
            }
        }
        DeltaRuleInputs { tokens, q, k, v, beta, g }
    }

    fn head(&self, shape: &DeltaNetShape, h: usize) -> HeadInputs<'_> {
        let t = self.tokens;
        let (dk, dv) = (shape.k_head_dim, shape.v_head_dim);
        let kh = shape.key_head(h);
        HeadInputs {
            q: &self.q[kh * t * dk..(kh + 1) * t * dk],
            k: &self.k[kh * t * dk..(kh + 1) * t * dk],
            v: &self.v[h * t * dv..(h + 1) * t * dv],
            beta: &self.beta[h * t..(h + 1) * t],
            g: &self.g[h * t..(h + 1) * t],
        }
    }
}

struct HeadInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    beta: &'a [f32],
    g: &'a [f32],
}

/// Runs `per_head(h, state_h, out_h)` for every value head in parallel, where `out_h` is a
/// `[tokens, v_head_dim]` scratch, then scatters the heads into `out: [tokens, value_dim]`.
fn for_each_head(
    shape: &DeltaNetShape,
    tokens: usize,
    state: &mut [f32],
    out: &mut [f32],
    per_head: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    let (dk, dv, nv) = (shape.k_head_dim, shape.v_head_dim, shape.num_v_heads);
    assert_eq!(state.len(), nv * dk * dv);
    assert_eq!(out.len(), tokens * nv * dv);
    let mut head_out = vec![0.0f32; nv * tokens * dv];
    state
        .par_chunks_mut(dk * dv)
        .zip(head_out.par_chunks_mut(tokens * dv))
        .enumerate()
        .for_each(|(h, (s, o))| per_head(h, s, o));
    for h in 0..nv {
        for t in 0..tokens {
            out[t * nv * dv + h * dv..t * nv * dv + (h + 1) * dv]
                .copy_from_slice(&head_out[h * tokens * dv + t * dv..h * tokens * dv + (t + 1) * dv]);
        }
    }
}

/// The delta rule one token at a time (`torch_recurrent_gated_delta_rule`).
pub fn recurrent(shape: &DeltaNetShape, inputs: &DeltaRuleInputs, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (shape.k_head_dim, shape.v_head_dim);
    let tokens = inputs.tokens;
    let isa = Isa::detect();
    for_each_head(shape, tokens, state, out, |h, s, o| {
        // As in the chunked form: a decaying state drifts into subnormals.
        let _ftz = FlushSubnormals::new();
        let x = inputs.head(shape, h);
        let mut kv_mem = vec![0.0f32; dv];
        let mut delta = vec![0.0f32; dv];
        for t in 0..tokens {
            let token = TokenInputs {
                q: &x.q[t * dk..(t + 1) * dk],
                k: &x.k[t * dk..(t + 1) * dk],
                v: &x.v[t * dv..(t + 1) * dv],
                beta: x.beta[t],
                g: x.g[t],
            };
            delta_step(isa, s, &token, (&mut kv_mem, &mut delta), &mut o[t * dv..(t + 1) * dv]);
        }
    });
}

/// One token's inputs to one head's delta rule.
struct TokenInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    beta: f32,
    g: f32,
}

/// One token of the delta rule on one head's state `s` (`[dk, dv]`): the state decays and is
/// read (`kv_mem = Sᵀk`), `delta = (v − kv_mem) · β`, then `S += k ⊗ delta` and `out = Sᵀq`,
/// row by row. The recurrent form and the decode rows both take these steps, so they agree
/// bitwise. `scratch`: two `[dv]` buffers.
fn delta_step(isa: Isa, s: &mut [f32], x: &TokenInputs, scratch: (&mut [f32], &mut [f32]), out: &mut [f32]) {
    let (kv_mem, delta) = scratch;
    let dv = out.len();
    let decay = x.g.exp();
    kv_mem.fill(0.0);
    for (i, row) in s.chunks_mut(dv).enumerate() {
        decay_and_read(isa, row, decay, x.k[i], kv_mem);
    }
    for ((d, &v), &m) in delta.iter_mut().zip(x.v).zip(kv_mem.iter()) {
        *d = (v - m) * x.beta;
    }
    out.fill(0.0);
    for (i, row) in s.chunks_mut(dv).enumerate() {
        update_and_read(isa, row, x.k[i], delta, x.q[i], out);
    }
}

/// [`DeltaRuleInputs::prepare`] and [`recurrent`] for one token (a decode row) as one
/// parallel pass over the value heads: each head normalises its own q and k and reads its
/// v, β and g where they lie, and writes its slice of `out` directly. The same operations in
/// the same order as the two calls (bitwise), with one dispatch to the pool instead of three.
pub fn recurrent_one_token(shape: &DeltaNetShape, raw: RawInputs, state: &mut [f32], out: &mut [f32]) {
    let RawInputs { qkv, a, b, a_log, dt_bias } = raw;
    let (nv, dk, dv) = (shape.num_v_heads, shape.k_head_dim, shape.v_head_dim);
    let key_dim = shape.key_dim();
    let q_scale = 1.0 / (dk as f32).sqrt();
    assert_eq!(state.len(), nv * dk * dv);
    assert_eq!(out.len(), nv * dv);
    let isa = Isa::detect();
    state.par_chunks_mut(dk * dv).zip(out.par_chunks_mut(dv)).enumerate().for_each(|(h, (s, o))| {
        let _ftz = FlushSubnormals::new();
        let kh = shape.key_head(h);
        let mut q = qkv[kh * dk..(kh + 1) * dk].to_vec();
        let mut k = qkv[key_dim + kh * dk..key_dim + (kh + 1) * dk].to_vec();
        normalise_query_key(&mut q, &mut k, q_scale);
        let token = TokenInputs {
            q: &q,
            k: &k,
            v: &qkv[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv],
            beta: sigmoid(b[h]),
            g: log_decay(a_log[h], a[h], dt_bias[h]),
        };
        let (mut kv_mem, mut delta) = (vec![0.0f32; dv], vec![0.0f32; dv]);
        delta_step(isa, s, &token, (&mut kv_mem, &mut delta), o);
    });
}

/// `dst = alpha · dst + beta · lhs · rhs` (`dst` not read when `read_dst` is false) for an
/// `m × n` row-major `dst` with row stride `ldd`; `lhs` element `(i, p)` is at
/// `i · lrs + p · lcs`, `rhs` element `(p, j)` at `p · rrs + j · rcs`. Single-threaded: the
/// heads already run in parallel.
pub(super) fn mm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    ldd: usize,
    (read_dst, alpha): (bool, f32),
    (lhs, lrs, lcs): (&[f32], usize, usize),
    (rhs, rrs, rcs): (&[f32], usize, usize),
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(k > 0 && n <= ldd && dst.len() >= (m - 1) * ldd + n, "mm: dst");
    assert!(lhs.len() > (m - 1) * lrs + (k - 1) * lcs, "mm: lhs");
    assert!(rhs.len() > (k - 1) * rrs + (n - 1) * rcs, "mm: rhs");
    // SAFETY: the asserts above keep every element the strides reach inside its slice, and
    // `dst` is borrowed mutably, apart from `lhs` and `rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ldd as isize,
            read_dst,
            lhs.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.as_ptr(),
            rcs as isize,
            rrs as isize,
            alpha,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The delta rule in chunks of [`CHUNK`] tokens (`torch_chunk_gated_delta_rule`), its
/// products of whole chunks as small matrix multiplications.
pub fn chunked(shape: &DeltaNetShape, inputs: &DeltaRuleInputs, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (shape.k_head_dim, shape.v_head_dim);
    let tokens = inputs.tokens;
    for_each_head(shape, tokens, state, out, |h, s, o| {
        // Decays underflow into subnormals here, which cost Intel cores an assist each.
        let _ftz = FlushSubnormals::new();
        let x = inputs.head(shape, h);
        let mut cum = [0.0f32; CHUNK];
        let mut a = vec![0.0f32; CHUNK * CHUNK];
        let mut u = vec![0.0f32; CHUNK * dv];
        let mut w = vec![0.0f32; CHUNK * dk];
        let mut kb = vec![0.0f32; CHUNK * dk];
        for start in (0..tokens).step_by(CHUNK) {
            let len = CHUNK.min(tokens - start);
            let q = &x.q[start * dk..(start + len) * dk];
            let k = &x.k[start * dk..(start + len) * dk];
            let v = &x.v[start * dv..(start + len) * dv];
            let beta = &x.beta[start..start + len];
            let mut acc = 0.0f32;
            for (c, &g) in cum.iter_mut().zip(&x.g[start..start + len]) {
                acc += g;
                *c = acc;
            }
            // A[i][j] = (β_i k_i · k_j) exp(γ_i − γ_j) for j < i.
            for i in 0..len {
                for (kb, &ki) in kb[i * dk..(i + 1) * dk].iter_mut().zip(&k[i * dk..(i + 1) * dk]) {
                    *kb = ki * beta[i];
                }
            }
            mm((len, len, dk), &mut a, CHUNK, (false, 0.0), (&kb, dk, 1), (k, 1, dk), 1.0);
            for i in 0..len {
                for j in 0..i {
                    a[i * CHUNK + j] *= (cum[i] - cum[j]).exp();
                }
            }
            // Forward substitution through the unit lower-triangular (I + A):
            // U_i = β_i v_i − Σ_j A_ij U_j and W_i = β_i k_i exp(γ_i) − Σ_j A_ij W_j.
            for i in 0..len {
                let (done, rest) = u.split_at_mut(i * dv);
                let ui = &mut rest[..dv];
                for (uv, &vv) in ui.iter_mut().zip(&v[i * dv..(i + 1) * dv]) {
                    *uv = vv * beta[i];
                }
                let (wdone, wrest) = w.split_at_mut(i * dk);
                let wi = &mut wrest[..dk];
                let e = cum[i].exp();
                for (wv, &kv) in wi.iter_mut().zip(&k[i * dk..(i + 1) * dk]) {
                    *wv = kv * beta[i] * e;
                }
                for j in 0..i {
                    let aij = a[i * CHUNK + j];
                    axpy(ui, -aij, &done[j * dv..(j + 1) * dv]);
                    axpy(wi, -aij, &wdone[j * dk..(j + 1) * dk]);
                }
            }
            // v' = U − W S, in place in `u`.
            mm((len, dv, dk), &mut u, dv, (true, 1.0), (&w, dk, 1), (s, dv, 1), -1.0);
            // o = (q exp(γ)) S + (q kᵀ ⊙ exp(γ_i − γ_j))_{j≤i} v'; `w` and `a` are free now.
            for i in 0..len {
                let e = cum[i].exp();
                for (qe, &qi) in w[i * dk..(i + 1) * dk].iter_mut().zip(&q[i * dk..(i + 1) * dk]) {
                    *qe = qi * e;
                }
            }
            let oc = &mut o[start * dv..(start + len) * dv];
            mm((len, dv, dk), oc, dv, (false, 0.0), (&w, dk, 1), (s, dv, 1), 1.0);
            mm((len, len, dk), &mut a, CHUNK, (false, 0.0), (q, dk, 1), (k, 1, dk), 1.0);
            for i in 0..len {
                for j in 0..len {
                    let p = &mut a[i * CHUNK + j];
                    *p = if j <= i { *p * (cum[i] - cum[j]).exp() } else { 0.0 };
                }
            }
            mm((len, dv, len), oc, dv, (true, 1.0), (&a, CHUNK, 1), (&u, dv, 1), 1.0);
            // S ← S exp(γ_L) + (k exp(γ_L − γ))ᵀ v'
            let last = cum[len - 1];
            for j in 0..len {
                let e = (last - cum[j]).exp();
                for (kb, &kj) in kb[j * dk..(j + 1) * dk].iter_mut().zip(&k[j * dk..(j + 1) * dk]) {
                    *kb = kj * e;
                }
            }
            mm((dk, dv, len), s, dv, (true, last.exp()), (&kb, 1, dk), (&u, dv, 1), 1.0);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize, s: f32) -> Vec<f32> {
            (0..n).map(|_| self.next() * s).collect()
        }
    }

    fn shape(nk: usize, nv: usize, dk: usize, dv: usize) -> DeltaNetShape {
        DeltaNetShape {
            num_k_heads: nk,
            num_v_heads: nv,
            k_head_dim: dk,
            v_head_dim: dv,
            conv_kernel: 4,
            eps: 1e-6,
            value_head_order: Default::default(),
        }
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f32 {
        let max_ref = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let max_d = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        max_d / max_ref
    }

    #[test]
    fn chunked_matches_recurrent_across_chunk_boundaries() {
        for &(nk, nv, dk, dv) in &[(1, 1, 8, 8), (2, 4, 16, 24), (3, 3, 5, 7)] {
            let sh = shape(nk, nv, dk, dv);
            for &tokens in &[1usize, 2, 63, 64, 65, 130, 200] {
                let mut rng = Rng(tokens as u64 * 31 + nv as u64);
                let qkv = rng.vec(tokens * sh.conv_dim(), 1.0);
                let a = rng.vec(tokens * nv, 2.0);
                let b = rng.vec(tokens * nv, 2.0);
                let a_log = rng.vec(nv, 1.0);
                let dt_bias = rng.vec(nv, 1.0);
                let init = rng.vec(sh.state_len(), 0.5);
                let raw = RawInputs { qkv: &qkv, a: &a, b: &b, a_log: &a_log, dt_bias: &dt_bias };
                let inputs = DeltaRuleInputs::prepare(&sh, raw, tokens);
                let (mut s1, mut s2) = (init.clone(), init.clone());
                let mut o1 = vec![f32::NAN; tokens * sh.value_dim()];
                let mut o2 = vec![f32::NAN; tokens * sh.value_dim()];
                recurrent(&sh, &inputs, &mut s1, &mut o1);
                chunked(&sh, &inputs, &mut s2, &mut o2);
                let (eo, es) = (rel_err(&o2, &o1), rel_err(&s2, &s1));
                // f32 rounding of two summation orders: max|Δ|/max|ref| ≤ 1e-5.
                assert!(
                    eo <= 1e-5 && es <= 1e-5,
                    "heads {nk}/{nv} dims {dk}/{dv} T={tokens}: out {eo}, state {es}"
                );
            }
        }
    }

    /// The convolution as first written (every input copied aside, token-parallel): the
    /// reference the blocked one must match bit for bit.
    fn conv_reference(
        shape: &DeltaNetShape,
        qkv: &mut [f32],
        tokens: usize,
        weight: &[f32],
        state: &mut [f32],
    ) {
        let channels = shape.conv_dim();
        let k = shape.conv_kernel;
        let hist = k - 1;
        assert_eq!(qkv.len(), tokens * channels);
        assert_eq!(weight.len(), channels * k);
        assert_eq!(state.len(), channels * hist);
        // Every input the taps reach, as rows: the `hist` carried ones, then the new ones. Tap `j`
        // of token `t` reads row `t + j`.
        let mut x = vec![0.0f32; (hist + tokens) * channels];
        for c in 0..channels {
            for i in 0..hist {
                x[i * channels + c] = state[c * hist + i];
            }
        }
        x[hist * channels..].copy_from_slice(qkv);
        // The weights tap-major, so that each tap is a contiguous row over the channels.
        let mut taps = vec![0.0f32; k * channels];
        for c in 0..channels {
            for j in 0..k {
                taps[j * channels + c] = weight[c * k + j];
            }
        }
        let isa = Isa::detect();
        qkv.par_chunks_mut(channels).enumerate().for_each(|(t, row)| {
            // The same sum as one accumulator per channel taking the taps in order.
            row.fill(0.0);
            for (j, w) in taps.chunks_exact(channels).enumerate() {
                for ((o, &w), &x) in row.iter_mut().zip(w).zip(&x[(t + j) * channels..(t + j + 1) * channels])
                {
                    *o += w * x;
                }
            }
            silu_in_place(isa, row);
        });
        // The new state is the last `hist` input rows (old state included when the run was short).
        for c in 0..channels {
            for i in 0..hist {
                state[c * hist + i] = x[(tokens + i) * channels + c];
            }
        }
    }

    /// The blocked convolution equals the reference bit for bit, with channel counts that are
    /// not whole blocks, one token and many, several kernel widths, on both ISAs.
    #[test]
    fn conv_matches_reference_bitwise() {
        for (nk, nv, dk, dv) in [(1, 2, 4, 3), (2, 4, 16, 24), (16, 16, 128, 128)] {
            for kernel in [1usize, 2, 4] {
                for tokens in [1usize, 2, 5, 70] {
                    let mut sh = shape(nk, nv, dk, dv);
                    sh.conv_kernel = kernel;
                    let c = sh.conv_dim();
                    let mut rng = Rng(tokens as u64 * 7 + kernel as u64 + c as u64);
                    let w = rng.vec(c * kernel, 1.0);
                    let x = rng.vec(tokens * c, 3.0);
                    let st0 = rng.vec(sh.conv_state_len(), 1.0);
                    let (mut want, mut st_want) = (x.clone(), st0.clone());
                    conv_reference(&sh, &mut want, tokens, &w, &mut st_want);
                    let (mut got, mut st_got) = (x.clone(), st0.clone());
                    causal_conv1d_silu(&sh, &mut got, tokens, &w, &mut st_got);
                    let what = format!("channels {c} kernel {kernel} tokens {tokens}");
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}");
                    assert_eq!(st_got, st_want, "{what}: state");
                    let mut port = x.clone();
                    let mut st_port = st0.clone();
                    let ptr = SharedMut::new(&mut port);
                    for (b, s) in
                        block_states(&mut st_port, kernel - 1, c.div_ceil(CONV_BLOCK)).into_iter().enumerate()
                    {
                        let c0 = b * CONV_BLOCK;
                        let n = CONV_BLOCK.min(c - c0);
                        // SAFETY: `port` outlives the calls and only this loop touches it.
                        let rows =
                            |t: usize| unsafe { std::slice::from_raw_parts_mut(ptr.at(t * c + c0), n) };
                        conv_block(
                            Isa::Portable,
                            kernel,
                            n,
                            tokens,
                            &w[c0 * kernel..(c0 + n) * kernel],
                            s,
                            rows,
                        );
                    }
                    assert_eq!(st_port, st_want, "{what}: portable state");
                    assert!(
                        port.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: portable"
                    );
                }
            }
        }
    }

    /// The fused one-token form is bitwise `prepare` + `recurrent`, grouped and tiled heads.
    #[test]
    fn one_token_form_is_bitwise_the_general_one() {
        for &(nk, nv, dk, dv, tiled) in
            &[(1, 1, 8, 8, false), (2, 4, 16, 24, false), (2, 4, 16, 24, true), (3, 3, 5, 7, false)]
        {
            let mut sh = shape(nk, nv, dk, dv);
            if tiled {
                sh.value_head_order = crate::backend::ValueHeadOrder::Tiled;
            }
            let mut rng = Rng(nv as u64 * 5 + dk as u64);
            let qkv = rng.vec(sh.conv_dim(), 1.0);
            let a = rng.vec(nv, 2.0);
            let b = rng.vec(nv, 2.0);
            let a_log = rng.vec(nv, 1.0);
            let dt_bias = rng.vec(nv, 1.0);
            let init = rng.vec(sh.state_len(), 0.5);
            let raw = RawInputs { qkv: &qkv, a: &a, b: &b, a_log: &a_log, dt_bias: &dt_bias };
            let inputs = DeltaRuleInputs::prepare(&sh, raw, 1);
            let (mut s1, mut s2) = (init.clone(), init.clone());
            let mut o1 = vec![f32::NAN; sh.value_dim()];
            let mut o2 = vec![f32::NAN; sh.value_dim()];
            recurrent(&sh, &inputs, &mut s1, &mut o1);
            recurrent_one_token(&sh, raw, &mut s2, &mut o2);
            assert!(
                o1.iter().zip(&o2).all(|(x, y)| x.to_bits() == y.to_bits()),
                "heads {nk}/{nv} tiled {tiled}"
            );
            assert!(s1.iter().zip(&s2).all(|(x, y)| x.to_bits() == y.to_bits()), "state, heads {nk}/{nv}");
        }
    }

    #[test]
    fn conv_state_carries_across_calls() {
        let sh = shape(1, 2, 4, 3);
        let c = sh.conv_dim();
        let mut rng = Rng(7);
        let w = rng.vec(c * 4, 1.0);
        let x = rng.vec(9 * c, 1.0);
        let mut whole = x.clone();
        let mut st = vec![0.0; sh.conv_state_len()];
        causal_conv1d_silu(&sh, &mut whole, 9, &w, &mut st);
        // The same 9 tokens fed as 1 + 2 + 6.
        let mut st2 = vec![0.0; sh.conv_state_len()];
        let mut parts = Vec::new();
        for (s, e) in [(0, 1), (1, 3), (3, 9)] {
            let mut p = x[s * c..e * c].to_vec();
            causal_conv1d_silu(&sh, &mut p, e - s, &w, &mut st2);
            parts.extend(p);
        }
        assert_eq!(parts, whole);
        assert_eq!(st, st2);
        // Token 0 sees only itself: silu(w[c][3] * x0[c]).
        for ch in 0..c {
            let v = w[ch * 4 + 3] * x[ch];
            let expect = v / (1.0 + (-v).exp());
            assert!((whole[ch] - expect).abs() < 1e-6);
        }
    }
}
