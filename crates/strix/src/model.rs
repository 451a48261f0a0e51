//! The Qwen3.5 text decoder, written once against the [`Backend`] ops.
//!
//! Each decoder layer is `h += mixer(norm(h)); h += mlp(norm(h))`, where the mixer is a Gated
//! DeltaNet (most layers) or gated full attention (every few layers, per `layer_types`).
//! Norms are the zero-centred `(1 + w)` RMSNorm; residual adds are fused into the next norm.

use std::path::Path;

use crate::backend::{AttentionShape, Backend, DeltaNetShape, DeltaRuleMode};
use crate::checkpoint::Checkpoint;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::session::{LayerState, Session};
use crate::tensor::HostTensor;

/// Where the model's tensors come from: a checkpoint on disk or synthesised weights.
pub trait TensorSource {
    fn contains(&self, name: &str) -> bool;
    /// The tensor `name`, checked to have `shape`.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor>;
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        Checkpoint::tensor(self, name, shape)
    }
}

pub struct DeltaNetWeights<B: Backend> {
    in_proj_qkv: B::Weight,
    in_proj_z: B::Weight,
    in_proj_b: B::Weight,
    in_proj_a: B::Weight,
    conv1d: B::Buf,
    a_log: B::Buf,
    dt_bias: B::Buf,
    norm: B::Buf,
    out_proj: B::Weight,
}

pub struct AttentionWeights<B: Backend> {
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Buf,
    k_norm: B::Buf,
}

pub enum Mixer<B: Backend> {
    DeltaNet(DeltaNetWeights<B>),
    Attention(AttentionWeights<B>),
}

pub struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_attention_norm: B::Buf,
    mixer: Mixer<B>,
    gate_proj: B::Weight,
    up_proj: B::Weight,
    down_proj: B::Weight,
}

pub struct Weights<B: Backend> {
    embed_tokens: B::Weight,
    /// `None` when the lm_head is tied to the embedding.
    lm_head: Option<B::Weight>,
    final_norm: B::Buf,
    layers: Vec<Layer<B>>,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's: `[vocab]`.
    Last,
    /// Every position's: `[tokens, vocab]`.
    All,
}

/// Longest run of tokens pushed through the layers at once. A multiple of the delta rule's
/// chunk, so splitting a long prompt leaves the chunk boundaries where one pass would put them.
pub const MAX_TOKENS_PER_PASS: usize = 512;

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    backend: B,
    weights: Weights<B>,
    /// RoPE inverse frequencies, `[rotary_dim / 2]`.
    inv_freq: B::Buf,
}

/// Progress of a load: called with (done, total), in the units the loading function names.
pub type Progress<'a> = &'a dyn Fn(u64, u64);

impl<B: Backend> Model<B> {
    /// Loads `config.json` and the safetensors weights of a model directory. `progress` follows
    /// the read of the files (bytes done, bytes in all).
    pub fn load(dir: &Path, backend: B, progress: Option<Progress>) -> Result<Model<B>> {
        let config = ModelConfig::from_model_dir(dir)?;
        let ckpt = Checkpoint::open_dir(dir)?;
        ckpt.prefetch(progress);
        Model::from_source(config, &ckpt, backend, None)
    }

    /// Builds the model from any tensor source, uploading each weight through the backend.
    /// `progress` gets (layers done, layers in all).
    pub fn from_source(
        config: ModelConfig,
        src: &dyn TensorSource,
        backend: B,
        progress: Option<Progress>,
    ) -> Result<Model<B>> {
        let c = &config;
        // The published (multimodal) checkpoints nest the text model one level deeper.
        let prefix = if src.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let total_layers = c.num_layers as u64 + 2;
        let report = |done: u64| {
            if let Some(p) = progress {
                p(done, total_layers)
            }
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<B::Weight> {
            let t = src.tensor(name, &[rows, cols])?;
            backend.weight(&t, rows, cols)
        };
        let vector = |name: &str, len: usize| -> Result<B::Buf> {
            Ok(backend.upload(&src.tensor(name, &[len])?.to_f32_vec()))
        };

        let embed_tokens = matrix(&format!("{prefix}embed_tokens.weight"), c.vocab_size, h)?;
        let lm_head =
            if c.tie_word_embeddings { None } else { Some(matrix("lm_head.weight", c.vocab_size, h)?) };
        let final_norm = vector(&format!("{prefix}norm.weight"), h)?;
        report(1);

        let dn = deltanet_shape(c);
        let at = attention_shape(c);
        let mut layers = Vec::with_capacity(c.num_layers);
        for (l, kind) in c.layer_kinds.iter().enumerate() {
            let p = format!("{prefix}layers.{l}.");
            let mixer = match kind {
                LayerKind::DeltaNet => {
                    let la = format!("{p}linear_attn.");
                    let conv =
                        src.tensor(&format!("{la}conv1d.weight"), &[dn.conv_dim(), 1, dn.conv_kernel])?;
                    Mixer::DeltaNet(DeltaNetWeights {
                        in_proj_qkv: matrix(&format!("{la}in_proj_qkv.weight"), dn.conv_dim(), h)?,
                        in_proj_z: matrix(&format!("{la}in_proj_z.weight"), dn.value_dim(), h)?,
                        in_proj_b: matrix(&format!("{la}in_proj_b.weight"), dn.num_v_heads, h)?,
                        in_proj_a: matrix(&format!("{la}in_proj_a.weight"), dn.num_v_heads, h)?,
                        conv1d: backend.upload(&conv.to_f32_vec()),
                        a_log: vector(&format!("{la}A_log"), dn.num_v_heads)?,
                        dt_bias: vector(&format!("{la}dt_bias"), dn.num_v_heads)?,
                        norm: vector(&format!("{la}norm.weight"), dn.v_head_dim)?,
                        out_proj: matrix(&format!("{la}out_proj.weight"), h, dn.value_dim())?,
                    })
                }
                LayerKind::Attention => {
                    let sa = format!("{p}self_attn.");
                    let q_dim = at.num_heads * at.head_dim;
                    Mixer::Attention(AttentionWeights {
                        q_proj: matrix(&format!("{sa}q_proj.weight"), 2 * q_dim, h)?,
                        k_proj: matrix(&format!("{sa}k_proj.weight"), at.kv_dim(), h)?,
                        v_proj: matrix(&format!("{sa}v_proj.weight"), at.kv_dim(), h)?,
                        o_proj: matrix(&format!("{sa}o_proj.weight"), h, q_dim)?,
                        q_norm: vector(&format!("{sa}q_norm.weight"), at.head_dim)?,
                        k_norm: vector(&format!("{sa}k_norm.weight"), at.head_dim)?,
                    })
                }
            };
            layers.push(Layer {
                input_norm: vector(&format!("{p}input_layernorm.weight"), h)?,
                post_attention_norm: vector(&format!("{p}post_attention_layernorm.weight"), h)?,
                mixer,
                gate_proj: matrix(&format!("{p}mlp.gate_proj.weight"), i, h)?,
                up_proj: matrix(&format!("{p}mlp.up_proj.weight"), i, h)?,
                down_proj: matrix(&format!("{p}mlp.down_proj.weight"), h, i)?,
            });
            report(l as u64 + 2);
        }
        report(total_layers);

        let inv_freq = backend.upload(&rope_inv_freq(c));
        Ok(Model {
            config,
            backend,
            weights: Weights { embed_tokens, lm_head, final_norm, layers },
            inv_freq,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// A fresh session (empty KV caches, zero GDN states) that accepts up to `max_context`
    /// tokens in all.
    pub fn new_session(&self, max_context: usize) -> Session<B> {
        let dn = deltanet_shape(&self.config);
        let layers = self
            .config
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                LayerKind::DeltaNet => LayerState::DeltaNet {
                    conv: self.backend.zeros(dn.conv_state_len()),
                    recurrent: self.backend.zeros(dn.state_len()),
                },
                LayerKind::Attention => {
                    LayerState::Attention { k: self.backend.zeros(0), v: self.backend.zeros(0), capacity: 0 }
                }
            })
            .collect();
        Session::new(layers, max_context)
    }

    /// Bytes of weights read to decode one token: every matrix once, the lm_head, one
    /// embedding row (norm vectors and states are small and left out).
    pub fn weight_bytes_per_token(&self) -> usize {
        let b = &self.backend;
        let w = &self.weights;
        let mut total = b.weight_bytes(w.lm_head.as_ref().unwrap_or(&w.embed_tokens));
        total += b.weight_bytes(&w.embed_tokens) / self.config.vocab_size;
        for l in &w.layers {
            total += b.weight_bytes(&l.gate_proj) + b.weight_bytes(&l.up_proj) + b.weight_bytes(&l.down_proj);
            total += match &l.mixer {
                Mixer::DeltaNet(m) => [&m.in_proj_qkv, &m.in_proj_z, &m.in_proj_a, &m.in_proj_b, &m.out_proj]
                    .iter()
                    .map(|w| b.weight_bytes(w))
                    .sum::<usize>(),
                Mixer::Attention(m) => {
                    [&m.q_proj, &m.k_proj, &m.v_proj, &m.o_proj].iter().map(|w| b.weight_bytes(w)).sum()
                }
            };
        }
        total
    }

    /// Feeds `ids` to the session and returns logits (`Logits::Last`: `[vocab]`,
    /// `Logits::All`: `[ids.len(), vocab]`). The session advances by `ids.len()` tokens.
    pub fn forward(&self, session: &mut Session<B>, ids: &[u32], want: Logits) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::input("no tokens to process"));
        }
        let vocab = self.config.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::input(format!("token id {bad} is outside the vocabulary (size {vocab})")));
        }
        let end = session.position() + ids.len();
        if end > session.max_context() {
            return Err(Error::input(format!(
                "{} tokens do not fit: the session holds {} of its {}-token context",
                ids.len(),
                session.position(),
                session.max_context()
            )));
        }
        let mut logits = Vec::with_capacity(match want {
            Logits::Last => vocab,
            Logits::All => ids.len() * vocab,
        });
        let pieces: Vec<&[u32]> = ids.chunks(MAX_TOKENS_PER_PASS).collect();
        for (n, piece) in pieces.iter().enumerate() {
            let last_piece = n + 1 == pieces.len();
            let out = self.forward_pass(session, piece, want, last_piece);
            logits.extend(out);
        }
        Ok(logits)
    }

    /// One decode step for several sequences at once: feeds `tokens[i]` to `sessions[i]` and
    /// returns `[sessions.len(), vocab]` logits. The weights are read once for the whole batch,
    /// and row `i` is bitwise what `forward(sessions[i], &[tokens[i]], Logits::Last)` returns:
    /// a sequence's tokens never depend on what else is in the batch.
    pub fn decode_batch(&self, sessions: &mut [&mut Session<B>], tokens: &[u32]) -> Result<Vec<f32>> {
        let c = &self.config;
        let b = &self.backend;
        if tokens.is_empty() || tokens.len() != sessions.len() {
            return Err(Error::input(format!(
                "a decode batch needs one token per session: {} tokens for {} sessions",
                tokens.len(),
                sessions.len()
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(Error::input(format!(
                "token id {bad} is outside the vocabulary (size {})",
                c.vocab_size
            )));
        }
        if let Some(full) = sessions.iter().position(|s| s.remaining() == 0) {
            return Err(Error::input(format!(
                "sequence {full} of the batch has filled its {}-token context",
                sessions[full].max_context()
            )));
        }
        let n = tokens.len();
        let hidden = c.hidden_size;
        let eps = c.rms_norm_eps;
        let positions: Vec<usize> = sessions.iter().map(|s| s.position()).collect();
        let at = attention_shape(c);
        let dn = deltanet_shape(c);
        for (s, &p) in sessions.iter_mut().zip(&positions) {
            s.reserve(b, p + 1, at.kv_dim());
        }
        let w = &self.weights;
        let mut h = b.zeros(n * hidden);
        let mut x = b.zeros(n * hidden);
        let mut y = b.zeros(n * hidden);
        b.embed(&w.embed_tokens, tokens, hidden, &mut h);
        b.rms_norm(&h, &w.layers[0].input_norm, hidden, eps, &mut x);
        let mut mlp_gate = b.zeros(n * c.intermediate_size);
        let mut mlp_up = b.zeros(n * c.intermediate_size);
        let mut mlp_act = b.zeros(n * c.intermediate_size);
        for (l, layer) in w.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::DeltaNet(m) => {
                    let mut qkv = b.zeros(n * dn.conv_dim());
                    let mut z = b.zeros(n * dn.value_dim());
                    let mut beta_in = b.zeros(n * dn.num_v_heads);
                    let mut decay_in = b.zeros(n * dn.num_v_heads);
                    b.matmul_rows(&x, n, &m.in_proj_qkv, &mut qkv);
                    b.matmul_rows(&x, n, &m.in_proj_z, &mut z);
                    b.matmul_rows(&x, n, &m.in_proj_b, &mut beta_in);
                    b.matmul_rows(&x, n, &m.in_proj_a, &mut decay_in);
                    let (mut convs, mut states) = (Vec::with_capacity(n), Vec::with_capacity(n));
                    for s in sessions.iter_mut() {
                        match s.layer_mut(l) {
                            LayerState::DeltaNet { conv, recurrent } => {
                                convs.push(conv);
                                states.push(recurrent);
                            }
                            LayerState::Attention { .. } => unreachable!("session layers follow layer_types"),
                        }
                    }
                    b.causal_conv1d_silu_rows(&dn, &mut qkv, &m.conv1d, &mut convs);
                    let mut core = b.zeros(n * dn.value_dim());
                    b.gated_delta_rule_rows(
                        &dn,
                        &qkv,
                        &decay_in,
                        &beta_in,
                        &m.a_log,
                        &m.dt_bias,
                        &mut states,
                        &mut core,
                    );
                    b.gated_rms_norm(&mut core, &z, &m.norm, n * dn.num_v_heads, dn.v_head_dim, dn.eps);
                    b.matmul_rows(&core, n, &m.out_proj, &mut y);
                }
                Mixer::Attention(m) => {
                    let q_dim = at.num_heads * at.head_dim;
                    let mut q_and_gate = b.zeros(n * 2 * q_dim);
                    let mut k = b.zeros(n * at.kv_dim());
                    let mut v = b.zeros(n * at.kv_dim());
                    b.matmul_rows(&x, n, &m.q_proj, &mut q_and_gate);
                    b.matmul_rows(&x, n, &m.k_proj, &mut k);
                    b.matmul_rows(&x, n, &m.v_proj, &mut v);
                    let mut q = b.zeros(n * q_dim);
                    let mut gate = b.zeros(n * q_dim);
                    b.attention_prologue(
                        &at,
                        &q_and_gate,
                        &mut k,
                        &m.q_norm,
                        &m.k_norm,
                        &self.inv_freq,
                        &positions,
                        &mut q,
                        &mut gate,
                    );
                    let (mut ks, mut vs) = (Vec::with_capacity(n), Vec::with_capacity(n));
                    for s in sessions.iter_mut() {
                        match s.layer_mut(l) {
                            LayerState::Attention { k, v, .. } => {
                                ks.push(k);
                                vs.push(v);
                            }
                            LayerState::DeltaNet { .. } => unreachable!("session layers follow layer_types"),
                        }
                    }
                    let mut attn = b.zeros(n * q_dim);
                    b.attention_rows(&at, &q, &k, &v, &gate, &mut ks, &mut vs, &positions, &mut attn);
                    b.matmul_rows(&attn, n, &m.o_proj, &mut y);
                }
            }
            b.add_rms_norm(&mut h, &y, &layer.post_attention_norm, hidden, eps, &mut x);
            b.matmul_rows(&x, n, &layer.gate_proj, &mut mlp_gate);
            b.matmul_rows(&x, n, &layer.up_proj, &mut mlp_up);
            b.swiglu(&mlp_gate, &mlp_up, n * c.intermediate_size, &mut mlp_act);
            b.matmul_rows(&mlp_act, n, &layer.down_proj, &mut y);
            let next_norm = w.layers.get(l + 1).map_or(&w.final_norm, |nl| &nl.input_norm);
            b.add_rms_norm(&mut h, &y, next_norm, hidden, eps, &mut x);
        }
        for (s, &t) in sessions.iter_mut().zip(tokens) {
            s.advance(&[t]);
        }
        let lm_head = w.lm_head.as_ref().unwrap_or(&w.embed_tokens);
        let mut logits = b.zeros(n * c.vocab_size);
        b.matmul_rows(&x, n, lm_head, &mut logits);
        Ok(b.download(&logits, 0, n * c.vocab_size))
    }

    /// One pass of at most [`MAX_TOKENS_PER_PASS`] tokens through every layer.
    fn forward_pass(
        &self,
        session: &mut Session<B>,
        ids: &[u32],
        want: Logits,
        last_piece: bool,
    ) -> Vec<f32> {
        let b = &self.backend;
        let c = &self.config;
        let w = &self.weights;
        let t = ids.len();
        let pos0 = session.position();
        let hidden = c.hidden_size;
        session.reserve(b, pos0 + t, attention_shape(c).kv_dim());

        let mut h = b.zeros(t * hidden);
        let mut x = b.zeros(t * hidden);
        let mut y = b.zeros(t * hidden);
        b.embed(&w.embed_tokens, ids, hidden, &mut h);
        b.rms_norm(&h, &w.layers[0].input_norm, hidden, c.rms_norm_eps, &mut x);

        let mut mlp_gate = b.zeros(t * c.intermediate_size);
        let mut mlp_up = b.zeros(t * c.intermediate_size);
        let mut mlp_act = b.zeros(t * c.intermediate_size);
        for (l, layer) in w.layers.iter().enumerate() {
            match (&layer.mixer, session.layer_mut(l)) {
                (Mixer::DeltaNet(m), LayerState::DeltaNet { conv, recurrent }) => {
                    self.delta_net(m, &x, t, conv, recurrent, &mut y)
                }
                (Mixer::Attention(m), LayerState::Attention { k, v, .. }) => {
                    self.attention(m, &x, t, pos0, k, v, &mut y)
                }
                _ => unreachable!("session layers are built from the same layer_types as the model"),
            }
            b.add_rms_norm(&mut h, &y, &layer.post_attention_norm, hidden, c.rms_norm_eps, &mut x);

            // SwiGLU MLP.
            b.matmul(&x, t, &layer.gate_proj, &mut mlp_gate);
            b.matmul(&x, t, &layer.up_proj, &mut mlp_up);
            b.swiglu(&mlp_gate, &mlp_up, t * c.intermediate_size, &mut mlp_act);
            b.matmul(&mlp_act, t, &layer.down_proj, &mut y);

            let next_norm = w.layers.get(l + 1).map_or(&w.final_norm, |n| &n.input_norm);
            b.add_rms_norm(&mut h, &y, next_norm, hidden, c.rms_norm_eps, &mut x);
        }
        session.advance(ids);

        let lm_head = w.lm_head.as_ref().unwrap_or(&w.embed_tokens);
        match want {
            Logits::All => {
                let mut logits = b.zeros(t * c.vocab_size);
                b.matmul(&x, t, lm_head, &mut logits);
                b.download(&logits, 0, t * c.vocab_size)
            }
            Logits::Last if !last_piece => Vec::new(),
            Logits::Last => {
                let mut row = b.zeros(hidden);
                b.copy_row(&x, t - 1, hidden, &mut row);
                let mut logits = b.zeros(c.vocab_size);
                b.matmul(&row, 1, lm_head, &mut logits);
                b.download(&logits, 0, c.vocab_size)
            }
        }
    }

    /// Gated DeltaNet mixer: projections, causal conv, delta rule, gated norm, out_proj.
    fn delta_net(
        &self,
        m: &DeltaNetWeights<B>,
        x: &B::Buf,
        t: usize,
        conv_state: &mut B::Buf,
        state: &mut B::Buf,
        out: &mut B::Buf,
    ) {
        let b = &self.backend;
        let s = deltanet_shape(&self.config);
        let mut qkv = b.zeros(t * s.conv_dim());
        let mut z = b.zeros(t * s.value_dim());
        let mut beta_in = b.zeros(t * s.num_v_heads);
        let mut decay_in = b.zeros(t * s.num_v_heads);
        b.matmul(x, t, &m.in_proj_qkv, &mut qkv);
        b.matmul(x, t, &m.in_proj_z, &mut z);
        b.matmul(x, t, &m.in_proj_b, &mut beta_in);
        b.matmul(x, t, &m.in_proj_a, &mut decay_in);
        b.causal_conv1d_silu(&s, &mut qkv, t, &m.conv1d, conv_state);
        // As in the reference: the single-token step for decode, chunks for anything longer.
        let mode = if t == 1 { DeltaRuleMode::Recurrent } else { DeltaRuleMode::Chunked };
        let mut core = b.zeros(t * s.value_dim());
        b.gated_delta_rule(&s, mode, &qkv, &decay_in, &beta_in, &m.a_log, &m.dt_bias, t, state, &mut core);
        b.gated_rms_norm(&mut core, &z, &m.norm, t * s.num_v_heads, s.v_head_dim, s.eps);
        b.matmul(&core, t, &m.out_proj, out);
    }

    /// Gated attention mixer: q/gate, k, v projections, norms + RoPE, causal GQA, gate, o_proj.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        m: &AttentionWeights<B>,
        x: &B::Buf,
        t: usize,
        pos0: usize,
        k_cache: &mut B::Buf,
        v_cache: &mut B::Buf,
        out: &mut B::Buf,
    ) {
        let b = &self.backend;
        let s = attention_shape(&self.config);
        let q_dim = s.num_heads * s.head_dim;
        let mut q_and_gate = b.zeros(t * 2 * q_dim);
        let mut k = b.zeros(t * s.kv_dim());
        let mut v = b.zeros(t * s.kv_dim());
        b.matmul(x, t, &m.q_proj, &mut q_and_gate);
        b.matmul(x, t, &m.k_proj, &mut k);
        b.matmul(x, t, &m.v_proj, &mut v);
        let mut q = b.zeros(t * q_dim);
        let mut gate = b.zeros(t * q_dim);
        let positions: Vec<usize> = (pos0..pos0 + t).collect();
        b.attention_prologue(
            &s,
            &q_and_gate,
            &mut k,
            &m.q_norm,
            &m.k_norm,
            &self.inv_freq,
            &positions,
            &mut q,
            &mut gate,
        );
        let mut attn = b.zeros(t * q_dim);
        b.attention(&s, &q, &k, &v, &gate, k_cache, v_cache, pos0, t, &mut attn);
        b.matmul(&attn, t, &m.o_proj, out);
    }
}

pub fn deltanet_shape(c: &ModelConfig) -> DeltaNetShape {
    DeltaNetShape {
        num_k_heads: c.linear_num_k_heads,
        num_v_heads: c.linear_num_v_heads,
        k_head_dim: c.linear_k_head_dim,
        v_head_dim: c.linear_v_head_dim,
        conv_kernel: c.conv_kernel,
        eps: c.rms_norm_eps,
    }
}

pub fn attention_shape(c: &ModelConfig) -> AttentionShape {
    AttentionShape {
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        rotary_dim: c.rotary_dim,
        eps: c.rms_norm_eps,
    }
}

/// `1 / theta^(2i / rotary_dim)`, in f32 as the reference computes it.
pub fn rope_inv_freq(c: &ModelConfig) -> Vec<f32> {
    let dim = c.rotary_dim as f32;
    let theta = c.rope_theta as f32;
    (0..c.rotary_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / dim)).collect()
}
