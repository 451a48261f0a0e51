//! Gated full attention on the CPU: per-head q/k RMSNorm, partial rotate-half RoPE, and causal
//! GQA softmax attention over the KV cache with the sigmoid output gate.

use rayon::prelude::*;

use super::deltanet::mm;
use super::simd::{axpy, dot, scale};
use super::{rms_scale, sigmoid};
use crate::backend::{AttentionLayer, AttentionShape};

/// The queries of a run and their output gates, `[tokens, heads * head_dim]` each.
#[derive(Clone, Copy)]
pub struct Query<'a> {
    pub q: &'a [f32],
    pub gate: &'a [f32],
}

/// A sequence's cached keys and values, `[rows, kv_dim]` each.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// `x ← x / rms(x) * (1 + w)` over one head.
fn head_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let s = rms_scale(x, eps);
    for (x, &w) in x.iter_mut().zip(w) {
        *x = *x * s * (1.0 + w);
    }
}

/// Rotate-half RoPE on the first `2 * cos.len()` dims of one head.
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (x1, x2) = (x[i], x[i + half]);
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/// The angles of one position, computed as the reference does: `pos * inv_freq` in f32.
fn rope_table(pos: usize, inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let p = pos as f32;
    inv_freq.iter().map(|&f| ((p * f).cos(), (p * f).sin())).unzip()
}

pub fn prologue(
    layer: AttentionLayer<'_, Vec<f32>>,
    q_and_gate: &[f32],
    k: &mut [f32],
    positions: &[usize],
    q: &mut [f32],
    gate: &mut [f32],
) {
    let AttentionLayer { ref shape, q_norm, k_norm, inv_freq } = layer;
    let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let tokens = positions.len();
    assert_eq!(inv_freq.len(), shape.rotary_dim / 2);
    q[..tokens * nh * hd]
        .par_chunks_mut(nh * hd)
        .zip(gate[..tokens * nh * hd].par_chunks_mut(nh * hd))
        .zip(k[..tokens * nkv * hd].par_chunks_mut(nkv * hd))
        .enumerate()
        .for_each(|(t, ((q, gate), k))| {
            let (cos, sin) = rope_table(positions[t], inv_freq);
            let src = &q_and_gate[t * nh * 2 * hd..(t + 1) * nh * 2 * hd];
            for h in 0..nh {
                let qh = &mut q[h * hd..(h + 1) * hd];
                qh.copy_from_slice(&src[h * 2 * hd..h * 2 * hd + hd]);
                gate[h * hd..(h + 1) * hd].copy_from_slice(&src[h * 2 * hd + hd..(h + 1) * 2 * hd]);
                head_norm(qh, q_norm, shape.eps);
                rope(qh, &cos, &sin);
            }
            for kh in k.chunks_mut(hd) {
                head_norm(kh, k_norm, shape.eps);
                rope(kh, &cos, &sin);
            }
        });
}

/// Softmax's numerators in place, `exp(s − max s)`, returning their sum (summed in order).
fn exp_shifted(scores: &mut [f32]) -> f32 {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// A head's output divided by its softmax sum, then gated: `o · (1/sum) · sigmoid(gate)`.
fn normalise_and_gate(o: &mut [f32], sum: f32, gate: &[f32]) {
    scale(o, 1.0 / sum);
    for (o, &g) in o.iter_mut().zip(gate) {
        *o *= sigmoid(g);
    }
}

/// Query rows per work item of the prompt path: the items are row ranges of the output, so
/// enough of them to keep every core busy, and each one's score block stays small.
const QUERY_TILE: usize = 32;

/// Causal attention of `tokens` queries at positions `pos0..` over cache rows `..pos0 + tokens`.
pub fn causal(
    shape: &AttentionShape,
    query: Query,
    cache: Rows,
    pos0: usize,
    tokens: usize,
    out: &mut [f32],
) {
    if tokens == 1 {
        one_query(shape, query, cache, pos0, out);
    } else {
        prompt(shape, query, cache, pos0, tokens, out);
    }
}

/// One query (decode): the query heads of a kv head are one work item, so each cached key and
/// value row is read from memory once for all of them, then dotted (or added) into each head
/// from L1. Per head the operations and their order are those of a head alone: a decode
/// batch's rows (`attention_rows`) are bitwise this.
fn one_query(shape: &AttentionShape, query: Query, cache: Rows, pos: usize, out: &mut [f32]) {
    let (Query { q, gate }, Rows { k: k_cache, v: v_cache }) = (query, cache);
    let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let kv = nkv * hd;
    let group = nh / nkv;
    let scaling = 1.0 / (hd as f32).sqrt();
    let visible = pos + 1;
    out[..nh * hd].par_chunks_mut(group * hd).enumerate().for_each(|(kh, o)| {
        let mut scores = vec![0.0f32; group * visible];
        for j in 0..visible {
            let k = &k_cache[j * kv + kh * hd..j * kv + (kh + 1) * hd];
            for g in 0..group {
                let h = kh * group + g;
                scores[g * visible + j] = dot(&q[h * hd..(h + 1) * hd], k) * scaling;
            }
        }
        let mut sums = vec![0.0f32; group];
        for (s, sum) in scores.chunks_mut(visible).zip(&mut sums) {
            *sum = exp_shifted(s);
        }
        o.fill(0.0);
        for j in 0..visible {
            let v = &v_cache[j * kv + kh * hd..j * kv + (kh + 1) * hd];
            for (g, o) in o.chunks_mut(hd).enumerate() {
                axpy(o, scores[g * visible + j], v);
            }
        }
        for (g, (o, &sum)) in o.chunks_mut(hd).zip(&sums).enumerate() {
            let h = kh * group + g;
            normalise_and_gate(o, sum, &gate[h * hd..(h + 1) * hd]);
        }
    });
}

/// A prompt pass: per tile of [`QUERY_TILE`] queries and per head, the scores of every key
/// the tile's last query sees as one matrix product (`Q Kᵀ`), the softmax of each row over
/// its visible keys (the rest weighted zero), and the output as a second product (`P V`),
/// through the `gemm` crate. The sums run in gemm's order rather than one key at a time.
fn prompt(shape: &AttentionShape, query: Query, cache: Rows, pos0: usize, tokens: usize, out: &mut [f32]) {
    let (Query { q, gate }, Rows { k: k_cache, v: v_cache }) = (query, cache);
    let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let kv = nkv * hd;
    let group = nh / nkv;
    let qd = nh * hd;
    let scaling = 1.0 / (hd as f32).sqrt();
    out[..tokens * qd].par_chunks_mut(QUERY_TILE * qd).enumerate().for_each(|(tile, o)| {
        let t0 = tile * QUERY_TILE;
        let m = o.len() / qd;
        // Keys visible to the tile's last query; earlier queries see a prefix of them.
        let n = pos0 + t0 + m;
        let mut p = vec![0.0f32; m * n];
        let mut sums = vec![0.0f32; m];
        for h in 0..nh {
            let kh = h / group;
            let qh = &q[t0 * qd + h * hd..];
            mm((m, n, hd), &mut p, n, (false, 0.0), (qh, qd, 1), (&k_cache[kh * hd..], 1, kv), scaling);
            for (i, (row, sum)) in p.chunks_mut(n).zip(&mut sums).enumerate() {
                let visible = pos0 + t0 + i + 1;
                let (seen, masked) = row.split_at_mut(visible);
                *sum = exp_shifted(seen);
                masked.fill(0.0);
            }
            mm((m, hd, n), &mut o[h * hd..], qd, (false, 0.0), (&p, n, 1), (&v_cache[kh * hd..], kv, 1), 1.0);
            for (i, &sum) in sums.iter().enumerate() {
                let o = &mut o[i * qd + h * hd..i * qd + (h + 1) * hd];
                normalise_and_gate(o, sum, &gate[(t0 + i) * qd + h * hd..(t0 + i) * qd + (h + 1) * hd]);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention as first written, one (query, head) at a time with a dot product per key:
    /// the reference for both paths.
    fn reference(
        shape: &AttentionShape,
        query: Query,
        cache: Rows,
        pos0: usize,
        tokens: usize,
        out: &mut [f32],
    ) {
        let (Query { q, gate }, Rows { k: k_cache, v: v_cache }) = (query, cache);
        let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let kv = nkv * hd;
        let group = nh / nkv;
        let scaling = 1.0 / (hd as f32).sqrt();
        for (i, o) in out[..tokens * nh * hd].chunks_mut(hd).enumerate() {
            let (t, h) = (i / nh, i % nh);
            let kh = h / group;
            let qh = &q[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
            let visible = pos0 + t + 1;
            let mut scores: Vec<f32> = (0..visible)
                .map(|j| dot(qh, &k_cache[j * kv + kh * hd..j * kv + (kh + 1) * hd]) * scaling)
                .collect();
            let sum = exp_shifted(&mut scores);
            o.fill(0.0);
            for (j, &p) in scores.iter().enumerate() {
                axpy(o, p, &v_cache[j * kv + kh * hd..j * kv + (kh + 1) * hd]);
            }
            normalise_and_gate(o, sum, &gate[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd]);
        }
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    /// One query is bitwise the reference; prompts (tiles of queries, gemm products) match it
    /// to max |Δ| / max |ref| <= 1e-5 (f32 sums in another order), over tile boundaries, with
    /// and without earlier cache rows, GQA groups of 1, 2 and 4.
    #[test]
    fn matches_reference() {
        for (nh, nkv, hd) in [(1, 1, 8), (4, 2, 16), (8, 2, 64), (4, 1, 32)] {
            let shape =
                AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: hd, rotary_dim: 0, eps: 1e-6 };
            for (pos0, tokens) in [(0, 1), (5, 1), (0, 2), (0, 31), (0, 33), (3, 70), (40, 64), (100, 1)] {
                let seed = (nh * 1000 + hd * 10 + pos0 * 7 + tokens) as u64;
                let total = pos0 + tokens;
                let q = random(tokens * nh * hd, seed);
                let gate = random(tokens * nh * hd, seed + 1);
                let k = random(total * nkv * hd, seed + 2);
                let v = random(total * nkv * hd, seed + 3);
                let mut want = vec![f32::NAN; tokens * nh * hd];
                let (query, cache) = (Query { q: &q, gate: &gate }, Rows { k: &k, v: &v });
                reference(&shape, query, cache, pos0, tokens, &mut want);
                let mut got = vec![f32::NAN; tokens * nh * hd];
                causal(&shape, query, cache, pos0, tokens, &mut got);
                let what = format!("heads {nh}/{nkv} dim {hd} pos0 {pos0} tokens {tokens}");
                if tokens == 1 {
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}");
                } else {
                    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let max_err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(max_err <= 1e-5 * max_ref, "{what}: {max_err:e} vs {max_ref:e}");
                }
            }
        }
    }
}
