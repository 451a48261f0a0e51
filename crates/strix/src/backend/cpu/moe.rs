//! The sparse MoE block's routed experts on the CPU: tokens routed on the host (they are
//! there already), grouped by expert so that each chosen expert's weights are read once per
//! pass whatever the number of its tokens, the experts run side by side on all cores, and
//! each token's weighted outputs summed in ascending expert id (the reference's `index_add_`
//! order).

use rayon::prelude::*;

use super::{CpuBackend, CpuWeight};
use crate::backend::{Backend, MlpActivations, MlpWeights, MoeExperts, Routing};

/// [`Backend::moe_experts`]: `out[t] = Σ weight · expert(x[t])` over the experts the router
/// picked for token `t`. In a decode batch each expert multiplies its rows with the one-token
/// kernels ([`Backend::matmul_rows`]), and a token's sum runs in the same order whatever else
/// is in the batch, so each row is bitwise what it gives alone.
pub fn moe_experts(
    b: &CpuBackend,
    x: &[f32],
    tokens: usize,
    router_logits: &[f32],
    experts: &MoeExperts<CpuBackend>,
    out: &mut [f32],
    decode_batch: bool,
) {
    let n = experts.len();
    let (inter, hidden) = b.weight_shape(&experts.gate[0]);
    let routing = Routing::new(router_logits, tokens, n, experts.top_k);
    let groups: Vec<(usize, Vec<(usize, f32)>)> =
        routing.by_expert(n).into_iter().enumerate().filter(|(_, members)| !members.is_empty()).collect();

    // Each expert's outputs for its own tokens, `[members, hidden]`, in group order.
    let outputs: Vec<Vec<f32>> = groups
        .par_iter()
        .map(|(e, members)| {
            let m = members.len();
            let mut rows = Vec::with_capacity(m * hidden);
            for &(t, _) in members {
                rows.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
            }
            let mut y = vec![0f32; m * hidden];
            expert_mlp(b, &rows, m, inter, experts.expert(*e), &mut y, decode_batch);
            y
        })
        .collect();

    // Where each token's contributions are, in ascending expert id (groups are in that order).
    let mut contributions: Vec<Vec<(f32, usize, usize)>> = vec![Vec::with_capacity(experts.top_k); tokens];
    for (g, (_, members)) in groups.iter().enumerate() {
        for (j, &(t, w)) in members.iter().enumerate() {
            contributions[t].push((w, g, j));
        }
    }
    out[..tokens * hidden].par_chunks_mut(hidden).zip(contributions.par_iter()).for_each(|(o, parts)| {
        o.fill(0.0);
        for &(w, g, j) in parts {
            for (o, &y) in o.iter_mut().zip(&outputs[g][j * hidden..(j + 1) * hidden]) {
                *o += y * w;
            }
        }
    });
}

/// One expert's SwiGLU MLP over its `m` gathered rows.
fn expert_mlp(
    b: &CpuBackend,
    rows: &[f32],
    m: usize,
    inter: usize,
    weights: MlpWeights<'_, CpuWeight>,
    y: &mut [f32],
    decode_batch: bool,
) {
    // The backend's ops take `Vec`s.
    let rows = rows.to_vec();
    let (mut gate, mut up, mut act) = (vec![0f32; m * inter], vec![0f32; m * inter], vec![0f32; m * inter]);
    let mut out = vec![0f32; y.len()];
    let acts = MlpActivations { gate: &mut gate, up: &mut up, act: &mut act };
    b.mlp(&rows, m, weights, acts, &mut out, decode_batch);
    y.copy_from_slice(&out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::moe_experts_on_host;
    use crate::tensor::{Bytes, DType, HostTensor};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// The expert outputs by the simplest route: each token through each of its experts alone,
    /// in f64.
    fn naive(
        x: &[f32],
        tokens: usize,
        logits: &[f32],
        e: usize,
        k: usize,
        w: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        hidden: usize,
    ) -> Vec<f64> {
        let inter = w[0].0.len() / hidden;
        let r = Routing::new(logits, tokens, e, k);
        let mut out = vec![0f64; tokens * hidden];
        for t in 0..tokens {
            let xt = &x[t * hidden..(t + 1) * hidden];
            for j in 0..k {
                let (ex, wt) = (r.experts[t * k + j] as usize, r.weights[t * k + j] as f64);
                let (g, u, d) = &w[ex];
                let act: Vec<f64> = (0..inter)
                    .map(|i| {
                        let dot = |m: &[f32]| {
                            (0..hidden).map(|c| m[i * hidden + c] as f64 * xt[c] as f64).sum::<f64>()
                        };
                        let gv = dot(g);
                        gv / (1.0 + (-gv).exp()) * dot(u)
                    })
                    .collect();
                for o in 0..hidden {
                    let v: f64 = (0..inter).map(|i| d[o * inter + i] as f64 * act[i]).sum();
                    out[t * hidden + o] += wt * v;
                }
            }
        }
        out
    }

    #[test]
    fn routing_is_softmax_top_k_renormalised() {
        // Two tokens, four experts.
        let logits = [0.5f32, 2.0, -1.0, 1.0, 3.0, 3.0, 0.0, -2.0];
        let r = Routing::new(&logits, 2, 4, 2);
        assert_eq!(
            r.experts,
            vec![1, 3, 0, 1],
            "top-2 by probability, listed by expert id; ties to the lower id"
        );
        let (a, b) = (2.0f32.exp(), 1.0f32.exp());
        assert!((r.weights[0] - a / (a + b)).abs() < 1e-6 && (r.weights[1] - b / (a + b)).abs() < 1e-6);
        assert!((r.weights[2] - 0.5).abs() < 1e-7 && (r.weights[3] - 0.5).abs() < 1e-7);
        assert_eq!(r.tokens(), 2);
        let groups = r.by_expert(4);
        assert_eq!(groups[1], vec![(0, r.weights[0]), (1, r.weights[3])]);
        assert!(groups[2].is_empty());
    }

    #[test]
    fn grouped_experts_equal_each_token_alone_and_the_host_default() {
        let b = CpuBackend::new();
        // Awkward sizes: hidden and width not multiples of any tile; 1, 7 and 70 tokens.
        let (e, k, inter, hidden) = (6, 3, 13, 37);
        let raw: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..e as u64)
            .map(|i| {
                (
                    random(inter * hidden, 10 + i),
                    random(inter * hidden, 100 + i),
                    random(hidden * inter, 1000 + i),
                )
            })
            .collect();
        let as_weight = |v: &[f32], rows, cols| {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let t = HostTensor {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![rows, cols],
                bytes: Bytes::owned(&bytes),
            };
            b.weight(&t, rows, cols).unwrap()
        };
        let experts = MoeExperts::<CpuBackend> {
            gate: raw.iter().map(|w| as_weight(&w.0, inter, hidden)).collect(),
            up: raw.iter().map(|w| as_weight(&w.1, inter, hidden)).collect(),
            down: raw.iter().map(|w| as_weight(&w.2, hidden, inter)).collect(),
            top_k: k,
        };
        for tokens in [1, 7, 70] {
            let x = random(tokens * hidden, tokens as u64);
            let logits: Vec<f32> = random(tokens * e, 7 + tokens as u64).iter().map(|v| v * 3.0).collect();
            let want = naive(&x, tokens, &logits, e, k, &raw, hidden);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for decode_batch in [false, true] {
                let mut out = vec![f32::NAN; tokens * hidden];
                moe_experts(&b, &x, tokens, &logits, &experts, &mut out, decode_batch);
                let err = out.iter().zip(&want).fold(0f64, |m, (&a, &w)| m.max((a as f64 - w).abs())) / scale;
                // f32 sums of ~40 products against f64: tolerance 1e-5 of the largest output.
                assert!(err < 1e-5, "tokens {tokens}, batch {decode_batch}: {err:e}");
                let mut host = vec![0f32; tokens * hidden];
                moe_experts_on_host(
                    &b,
                    &x.to_vec(),
                    tokens,
                    &logits.to_vec(),
                    &experts,
                    &mut host,
                    decode_batch,
                );
                assert_eq!(host, out, "the grouped CPU kernel is the host default's arithmetic");
            }
            // A decode batch's rows are each bitwise the token alone.
            let mut batch = vec![0f32; tokens * hidden];
            moe_experts(&b, &x, tokens, &logits, &experts, &mut batch, true);
            for t in [0, tokens - 1] {
                let mut one = vec![0f32; hidden];
                moe_experts(
                    &b,
                    &x[t * hidden..(t + 1) * hidden],
                    1,
                    &logits[t * e..(t + 1) * e],
                    &experts,
                    &mut one,
                    true,
                );
                assert_eq!(one, batch[t * hidden..(t + 1) * hidden], "row {t} of {tokens}");
            }
        }
    }
}
