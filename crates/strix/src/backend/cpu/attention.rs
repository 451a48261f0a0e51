//! Gated full attention on the CPU: per-head q/k RMSNorm, partial rotate-half RoPE, and causal
//! GQA softmax attention over the KV cache with the sigmoid output gate.

use rayon::prelude::*;

use super::simd::{axpy, dot, scale};
use super::{rms_scale, sigmoid};
use crate::backend::AttentionShape;

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

#[allow(clippy::too_many_arguments)]
pub fn prologue(
    shape: &AttentionShape,
    q_and_gate: &[f32],
    k: &mut [f32],
    q_norm: &[f32],
    k_norm: &[f32],
    inv_freq: &[f32],
    positions: &[usize],
    q: &mut [f32],
    gate: &mut [f32],
) {
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

/// Causal attention of `tokens` queries at positions `pos0..` over cache rows `..pos0 + tokens`.
#[allow(clippy::too_many_arguments)]
pub fn causal(
    shape: &AttentionShape,
    q: &[f32],
    gate: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos0: usize,
    tokens: usize,
    out: &mut [f32],
) {
    let (nh, nkv, hd) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let kv = nkv * hd;
    let group = nh / nkv;
    let scaling = 1.0 / (hd as f32).sqrt();
    out[..tokens * nh * hd].par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        let kh = h / group;
        let qh = &q[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
        let visible = pos0 + t + 1;
        let mut scores: Vec<f32> = (0..visible)
            .map(|j| dot(qh, &k_cache[j * kv + kh * hd..j * kv + (kh + 1) * hd]) * scaling)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        o.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            axpy(o, p, &v_cache[j * kv + kh * hd..j * kv + (kh + 1) * hd]);
        }
        scale(o, 1.0 / sum);
        let g = &gate[t * nh * hd + h * hd..t * nh * hd + (h + 1) * hd];
        for (o, &g) in o.iter_mut().zip(g) {
            *o *= sigmoid(g);
        }
    });
}
