//! The Qwen3.5 text decoder, written once against the [`Backend`] ops.
//!
//! Each decoder layer is `h += mixer(norm(h)); h += mlp(norm(h))`, where the mixer is a Gated
//! DeltaNet (most layers) or gated full attention (every few layers, per `layer_types`), and
//! the MLP a dense SwiGLU (`qwen3_5`) or a sparse mixture of experts (`qwen3_5_moe`: a router
//! picks a few SwiGLU experts per token, plus a shared expert behind its own sigmoid gate).
//! Norms are the zero-centred `(1 + w)` RMSNorm; residual adds are fused into the next norm.

use std::path::{Path, PathBuf};

use crate::backend::{
    AttentionInput, AttentionLayer, Backend, DeltaNetLayer, DeltaNetProjections, DeltaNetShape,
    DeltaNetState, DeltaRuleInput, DeltaRuleMode, KvCache, MlpActivations, MlpWeights, MoeExperts,
    MoeScratch, RmsNorm, SparseMoe,
};
use crate::checkpoint::Checkpoint;
use crate::config::{LayerKind, ModelConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::gguf::Qwen35Gguf;
use crate::sampling::{Draw, NonFiniteLogits, PreparedSample};
use crate::session::{LayerState, Session, SessionBlock};
use crate::tensor::HostTensor;

/// Where the model's tensors come from: a checkpoint on disk or synthesised weights.
pub trait TensorSource {
    fn contains(&self, name: &str) -> bool;
    /// The tensor `name`, checked to have `shape`.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor>;
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains_expert(self, name)
    }
    // Routed experts by their per-expert names, from whichever layout the files have.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        Checkpoint::expert_tensor(self, name, shape)
    }
}

/// Whether `path` names a GGUF file rather than a model directory: anything but a directory
/// whose name ends in `.gguf` (so that a `.gguf` FIFO or git-lfs pointer reaches the GGUF
/// loader and is refused there with its reason), or a regular file whose first bytes are
/// GGUF's magic. Never blocks: a FIFO is not opened.
pub fn is_gguf_path(path: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(path) else {
        return false;
    };
    if meta.is_dir() {
        return false;
    }
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return true;
    }
    let mut magic = [0u8; 4];
    crate::files::open_regular(path)
        .is_ok_and(|(mut f, _)| std::io::Read::read_exact(&mut f, &mut magic).is_ok())
        && magic == crate::gguf::GGUF_MAGIC
}

/// What a path given as a model is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    /// A Hugging Face model directory (`config.json`, safetensors weights).
    Directory,
    /// A llama.cpp GGUF file.
    Gguf,
}

/// Tells what `path` is as a model before anything is loaded, so the first error a user sees
/// is the right one: a path that does not exist ([`Error::Io`]), a directory without
/// `config.json` or a file that is neither GGUF nor a directory ([`Error::NotAModel`]), a
/// special file or a git-lfs pointer in place of a GGUF file ([`Error::File`]).
pub fn model_format(path: &Path) -> Result<ModelFormat> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        crate::config::check_model_dir(path)?;
        return Ok(ModelFormat::Directory);
    }
    let (file, _) = crate::files::open_regular(path)?;
    let mut head = Vec::with_capacity(1024);
    std::io::Read::read_to_end(&mut std::io::Read::take(file, 1024), &mut head)
        .map_err(|e| Error::io(path, e))?;
    crate::files::check_not_lfs_pointer(path, &head)?;
    if head.starts_with(&crate::gguf::GGUF_MAGIC)
        || path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return Ok(ModelFormat::Gguf);
    }
    Err(Error::not_a_model(
        path,
        "not a model: neither a model directory (config.json and *.safetensors weights) nor a GGUF file",
    ))
}

/// A model's files, told apart and opened once: a Hugging Face model directory, or a
/// llama.cpp `qwen35` GGUF file opened and checked ([`Qwen35Gguf`]), whose metadata (shape,
/// tokenizer, chat template) every later step reads from that one opening. Loading the weights
/// ([`Model::load_files`]) consumes it, so a GGUF file's mapping is gone once they are on the
/// backend.
pub enum ModelFiles {
    Directory(PathBuf),
    Gguf(Box<Qwen35Gguf>),
}

impl ModelFiles {
    /// Opens what `path` holds as a model ([`model_format`] says what it is, and its errors are
    /// the first a user sees).
    pub fn open(path: &Path) -> Result<ModelFiles> {
        Ok(match model_format(path)? {
            ModelFormat::Directory => ModelFiles::Directory(path.to_path_buf()),
            ModelFormat::Gguf => ModelFiles::Gguf(Box::new(Qwen35Gguf::open(path)?)),
        })
    }

    /// The path the model was opened from.
    pub fn path(&self) -> &Path {
        match self {
            ModelFiles::Directory(dir) => dir,
            ModelFiles::Gguf(g) => g.file().path(),
        }
    }

    /// Where the side files (`tokenizer.json`, the chat template, `generation_config.json`) are
    /// looked for: the model directory, or the folder a GGUF file is in.
    pub fn side_dir(&self) -> &Path {
        match self {
            ModelFiles::Directory(dir) => dir,
            ModelFiles::Gguf(g) => g.file().path().parent().unwrap_or(Path::new(".")),
        }
    }

    /// The GGUF file, when the model is one.
    pub fn gguf(&self) -> Option<&Qwen35Gguf> {
        match self {
            ModelFiles::Directory(_) => None,
            ModelFiles::Gguf(g) => Some(g),
        }
    }

    /// The model's shape: `config.json`, or the GGUF file's metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            ModelFiles::Directory(dir) => ModelConfig::from_model_dir(dir),
            ModelFiles::Gguf(g) => Ok(g.config().clone()),
        }
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

impl<B: Backend> DeltaNetWeights<B> {
    /// The layer's small parameters as the DeltaNet ops take them.
    fn layer(&self, shape: DeltaNetShape) -> DeltaNetLayer<'_, B::Buf> {
        DeltaNetLayer {
            shape,
            conv1d: &self.conv1d,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
        }
    }
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

/// `Qwen3_5MLP`: `down_proj(silu(gate_proj(x)) * up_proj(x))`.
pub struct DenseMlpWeights<B: Backend> {
    gate_proj: B::Weight,
    up_proj: B::Weight,
    down_proj: B::Weight,
}

impl<B: Backend> DenseMlpWeights<B> {
    fn weights(&self) -> MlpWeights<'_, B::Weight> {
        MlpWeights { gate: &self.gate_proj, up: &self.up_proj, down: &self.down_proj }
    }
}

/// `Qwen3_5MoeSparseMoeBlock`: the router (`mlp.gate`), the routed experts, the shared expert
/// (a dense SwiGLU MLP) and its gate (`mlp.shared_expert_gate`, one logit per token).
pub struct MoeWeights<B: Backend> {
    router: B::Weight,
    experts: MoeExperts<B>,
    shared_expert: DenseMlpWeights<B>,
    shared_expert_gate: B::Weight,
}

/// A layer's MLP: dense (`qwen3_5`) or a sparse mixture of experts (`qwen3_5_moe`).
pub enum Mlp<B: Backend> {
    Dense(DenseMlpWeights<B>),
    Moe(MoeWeights<B>),
}

pub struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_attention_norm: B::Buf,
    mixer: Mixer<B>,
    mlp: Mlp<B>,
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

/// The delta rule's chunk: a pass length is a multiple of it, so splitting a long prompt into
/// passes leaves the chunk boundaries where one pass would put them.
pub const PASS_TOKENS_ALIGN: usize = 64;

pub use crate::backend::DEFAULT_PASS_TOKENS;
pub use crate::config::{attention_shape, deltanet_shape};

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    backend: B,
    weights: Weights<B>,
    /// RoPE inverse frequencies, `[rotary_dim / 2]`.
    inv_freq: B::Buf,
    /// Longest run of tokens pushed through the layers at once ([`Model::set_pass_tokens`]).
    pass_tokens: usize,
    /// Whether a decode step may be recorded: no layer's experts are routed on the host
    /// ([`Backend::moe_on_device`]). The weights never change, so it is decided at load.
    steps_recordable: bool,
    /// Device bytes a prompt pass holds whatever its length: the largest of the layers'
    /// [`Backend::moe_prompt_scratch_bytes`].
    pass_fixed_bytes: usize,
}

/// Progress of a load: called with (done, total), in the units the loading function names.
pub type Progress<'a> = &'a dyn Fn(u64, u64);

impl<B: Backend> Model<B> {
    /// Loads `config.json` and the safetensors weights of a model directory. `progress` follows
    /// the read of the files (bytes done, bytes in all). A path that is not a model directory
    /// is an [`Error::NotAModel`] (see [`model_format`]).
    pub fn load(dir: &Path, backend: B, progress: Option<Progress>) -> Result<Model<B>> {
        let config = ModelConfig::from_model_dir(dir)?;
        let ckpt = Checkpoint::open_dir(dir)?;
        ckpt.prefetch(progress);
        Model::from_source(config, &ckpt, backend, None)
    }

    /// Loads a model directory ([`Model::load`]) or a llama.cpp `qwen35` GGUF file: what
    /// [`ModelFiles::open`] finds at `path`, through [`Model::load_files`].
    pub fn load_path(path: &Path, backend: B, progress: Option<Progress>) -> Result<Model<B>> {
        Model::load_files(ModelFiles::open(path)?, backend, progress)
    }

    /// Loads the weights of opened model files. `progress` counts bytes read for a directory,
    /// layers for a GGUF file.
    pub fn load_files(files: ModelFiles, backend: B, progress: Option<Progress>) -> Result<Model<B>> {
        match files {
            ModelFiles::Directory(dir) => Model::load(&dir, backend, progress),
            ModelFiles::Gguf(gguf) => Model::from_source(gguf.config().clone(), &*gguf, backend, progress),
        }
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
        let h = c.hidden_size;
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
            // A SwiGLU MLP of width `i` under `{m}`: `{m}gate_proj.weight` and so on.
            let dense = |m: &str, i: usize| -> Result<DenseMlpWeights<B>> {
                Ok(DenseMlpWeights {
                    gate_proj: matrix(&format!("{m}gate_proj.weight"), i, h)?,
                    up_proj: matrix(&format!("{m}up_proj.weight"), i, h)?,
                    down_proj: matrix(&format!("{m}down_proj.weight"), h, i)?,
                })
            };
            let mlp = match &c.moe {
                None => Mlp::Dense(dense(&format!("{p}mlp."), c.intermediate_size)?),
                Some(moe) => {
                    // Experts are asked for one by one; a source whose file fuses them
                    // (`mlp.experts.gate_up_proj`, GGUF's `ffn_*_exps`) hands out each one's slice.
                    let (e, i) = (moe.num_experts, moe.moe_intermediate_size);
                    let expert = |e: usize, proj: &str, rows: usize, cols: usize| {
                        matrix(&format!("{p}mlp.experts.{e}.{proj}.weight"), rows, cols)
                    };
                    Mlp::Moe(MoeWeights {
                        router: matrix(&format!("{p}mlp.gate.weight"), e, h)?,
                        experts: MoeExperts {
                            gate: (0..e).map(|e| expert(e, "gate_proj", i, h)).collect::<Result<_>>()?,
                            up: (0..e).map(|e| expert(e, "up_proj", i, h)).collect::<Result<_>>()?,
                            down: (0..e).map(|e| expert(e, "down_proj", h, i)).collect::<Result<_>>()?,
                            top_k: moe.num_experts_per_tok,
                        },
                        shared_expert: dense(
                            &format!("{p}mlp.shared_expert."),
                            moe.shared_expert_intermediate_size,
                        )?,
                        shared_expert_gate: matrix(&format!("{p}mlp.shared_expert_gate.weight"), 1, h)?,
                    })
                }
            };
            layers.push(Layer {
                input_norm: vector(&format!("{p}input_layernorm.weight"), h)?,
                post_attention_norm: vector(&format!("{p}post_attention_layernorm.weight"), h)?,
                mixer,
                mlp,
            });
            report(l as u64 + 2);
        }
        report(total_layers);

        let inv_freq = backend.upload(&rope_inv_freq(c));
        let pass_fixed_bytes = layers
            .iter()
            .map(|l| match &l.mlp {
                Mlp::Dense(_) => 0,
                Mlp::Moe(m) => backend.moe_prompt_scratch_bytes(&m.experts),
            })
            .max()
            .unwrap_or(0);
        // A device with its own memory gets a pass whose activations (and fixed scratch) take
        // at most a quarter of what the weights left free, so sessions still fit beside it.
        let per_token = pass_bytes_per_token(&config);
        let pass_tokens = match backend.free_memory() {
            Some(free) => capped_pass_tokens(
                backend.preferred_pass_tokens(),
                (free / 4).saturating_sub(pass_fixed_bytes),
                per_token,
            ),
            None => backend.preferred_pass_tokens(),
        };
        let steps_recordable = layers.iter().all(|l| match &l.mlp {
            Mlp::Dense(_) => true,
            Mlp::Moe(m) => backend.moe_on_device(&m.experts),
        });
        Ok(Model {
            config,
            backend,
            weights: Weights { embed_tokens, lm_head, final_norm, layers },
            inv_freq,
            pass_tokens,
            steps_recordable,
            pass_fixed_bytes,
        })
    }

    /// Longest run of prompt tokens one pass pushes through the layers; longer prompts are
    /// split into passes of this many (the backend's [`Backend::preferred_pass_tokens`] unless
    /// set). Logits depend on where the passes split a prompt (last bits only), so whoever
    /// feeds a prompt in pieces ends its pieces on multiples of this to match one call.
    pub fn pass_tokens(&self) -> usize {
        self.pass_tokens
    }

    /// Sets [`Model::pass_tokens`]: larger passes make larger, faster matrix products and need
    /// more device memory ([`pass_bytes_per_token`] a token, which [`Model::try_new_session`]
    /// keeps free beside the session).
    pub fn set_pass_tokens(&mut self, tokens: usize) -> Result<()> {
        if tokens == 0 || !tokens.is_multiple_of(PASS_TOKENS_ALIGN) {
            return Err(Error::input(format!(
                "a pass of {tokens} tokens: the pass length must be a positive multiple of \
                 {PASS_TOKENS_ALIGN} (the delta rule's chunk)"
            )));
        }
        self.pass_tokens = tokens;
        Ok(())
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// A fresh session (empty KV caches, zero GDN states) that accepts up to `max_context`
    /// tokens in all.
    pub fn new_session(&self, max_context: usize) -> Session<B> {
        let b = &self.backend;
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
                    LayerState::Attention { k: b.cache_zeros(0), v: b.cache_zeros(0), capacity: 0 }
                }
            })
            .collect();
        Session::new(layers, max_context)
    }

    /// Copies positions `start..session.position()` out of `session` (their keys and values,
    /// and the DeltaNet states after the last one) into a [`SessionBlock`]: what a prefix
    /// cache keeps so that another session can resume there ([`Model::restore_blocks`]).
    pub fn save_block(&self, session: &Session<B>, start: usize) -> Result<SessionBlock<B>> {
        if start >= session.position() {
            return Err(Error::input(format!(
                "a block from position {start}: the session holds {} tokens",
                session.position()
            )));
        }
        Ok(session.save_block(
            &self.backend,
            start,
            attention_shape(&self.config).kv_dim(),
            self.state_lens(),
        ))
    }

    /// Extends `session` by `blocks` saved from this model's sessions, which must continue
    /// each other from the session's position: afterwards the session is bitwise the one the
    /// last block was saved from (its tokens, KV rows and DeltaNet states), as if it had been
    /// fed the blocks' tokens in the same passes. The blocks are copied, never shared.
    pub fn restore_blocks(&self, session: &mut Session<B>, blocks: &[&SessionBlock<B>]) -> Result<()> {
        session
            .restore_blocks(&self.backend, blocks, attention_shape(&self.config).kv_dim(), self.state_lens())
            .map_err(Error::input)
    }

    /// The lengths of a DeltaNet layer's conv and recurrent states.
    fn state_lens(&self) -> (usize, usize) {
        let dn = deltanet_shape(&self.config);
        (dn.conv_state_len(), dn.state_len())
    }

    /// Device bytes a session of `max_context` tokens holds: the KV caches of the attention
    /// layers at full length, in the backend's cache type (2 bytes an element in bf16, 4 in
    /// f32), and the f32 conv and recurrent states of the DeltaNet layers.
    pub fn session_bytes(&self, max_context: usize) -> usize {
        let dn = deltanet_shape(&self.config);
        let kv = attention_shape(&self.config).kv_dim();
        let cache_bytes = self.backend.kv_cache_type().bytes();
        let per_layer = |kind: &LayerKind| match kind {
            LayerKind::Attention => 2 * max_context * kv * cache_bytes,
            LayerKind::DeltaNet => (dn.conv_state_len() + dn.state_len()) * 4,
        };
        self.config.layer_kinds.iter().map(per_layer).sum::<usize>()
    }

    /// [`Model::new_session`], checked against the device's free memory where the backend has
    /// its own: the KV caches are then allocated for the whole context up front, so a session
    /// that does not fit is an error now rather than a failed allocation mid-generation.
    pub fn try_new_session(&self, max_context: usize) -> Result<Session<B>> {
        let mut session = self.new_session(max_context);
        if let Some(free) = self.backend.free_memory() {
            let need = self.session_bytes(max_context);
            // Leave room for a prefill pass (its activations, and the scratch a MoE layer's
            // packed experts take on the device) and the allocator's slack.
            let pass = self.pass_tokens.min(max_context.max(1)) * pass_bytes_per_token(&self.config)
                + self.pass_fixed_bytes;
            let headroom = (free / 10).max(pass) + (256 << 20);
            if need + headroom > free {
                let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
                return Err(Error::input(format!(
                    "a {max_context}-token session needs {:.2} GiB of device memory but {:.2} GiB is free, \
                     {:.2} GiB of it kept for prefill passes of up to {} tokens and the allocator; ask for \
                     a shorter context or shorter passes",
                    gib(need),
                    gib(free),
                    gib(headroom),
                    self.pass_tokens
                )));
            }
            session.reserve(&self.backend, max_context, attention_shape(&self.config).kv_dim());
        }
        Ok(session)
    }

    /// Bytes of weights read to decode one token: every matrix once, the lm_head, one
    /// embedding row (norm vectors and states are small and left out); of a MoE layer's routed
    /// experts, the `num_experts_per_tok` a token uses (at their average size).
    pub fn weight_bytes_per_token(&self) -> usize {
        let b = &self.backend;
        let w = &self.weights;
        let mut total = b.weight_bytes(w.lm_head.as_ref().unwrap_or(&w.embed_tokens));
        total += b.weight_bytes(&w.embed_tokens) / self.config.vocab_size;
        let dense = |m: &DenseMlpWeights<B>| {
            b.weight_bytes(&m.gate_proj) + b.weight_bytes(&m.up_proj) + b.weight_bytes(&m.down_proj)
        };
        for l in &w.layers {
            total += match &l.mlp {
                Mlp::Dense(m) => dense(m),
                Mlp::Moe(m) => {
                    let x = &m.experts;
                    let all: usize =
                        x.gate.iter().chain(&x.up).chain(&x.down).map(|w| b.weight_bytes(w)).sum();
                    all / x.len() * x.top_k
                        + dense(&m.shared_expert)
                        + b.weight_bytes(&m.router)
                        + b.weight_bytes(&m.shared_expert_gate)
                }
            };
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
        self.check_feed(session, ids)?;
        if ids.len() == 1 && want == Logits::Last {
            // One token: the decode-step path, which a backend may record and replay.
            let mut one = [session];
            return self.decode_batch(&mut one, ids);
        }
        let b = &self.backend;
        let vocab = self.config.vocab_size;
        let mut logits = Vec::with_capacity(match want {
            Logits::Last => vocab,
            Logits::All => ids.len() * vocab,
        });
        let pieces: Vec<&[u32]> = ids.chunks(self.pass_tokens).collect();
        for (n, piece) in pieces.iter().enumerate() {
            let scratch = self.forward_pass(session, piece);
            let t = piece.len();
            match want {
                Logits::All => {
                    let mut out = b.scratch(t * vocab);
                    b.matmul(&scratch.x, t, self.lm_head(), &mut out);
                    logits.extend(b.download(&out, 0, t * vocab));
                }
                Logits::Last if n + 1 == pieces.len() => {
                    let out = self.last_row_logits(&scratch, t);
                    logits.extend(b.download(&out, 0, vocab));
                }
                Logits::Last => {}
            }
        }
        Ok(logits)
    }

    /// Feeds `ids` (a piece of a prompt) to the session and makes no logits.
    pub fn prefill(&self, session: &mut Session<B>, ids: &[u32]) -> Result<()> {
        self.check_feed(session, ids)?;
        self.feed_passes(session, ids);
        Ok(())
    }

    /// Feeds `ids` (a prompt, or its last piece) to the session and finishes `row`'s draw
    /// from the last position's logits next to them, as [`Model::decode_batch_prepared`] does
    /// for a decode step: the result is what `sampling::sample_prepared` makes of
    /// `forward(session, ids, Logits::Last)` with `row`, and only the token (and the
    /// log-probabilities asked for) leaves the backend.
    pub fn prefill_draw(
        &self,
        session: &mut Session<B>,
        ids: &[u32],
        row: &PreparedSample,
    ) -> Result<std::result::Result<Draw, NonFiniteLogits>> {
        self.check_feed(session, ids)?;
        if ids.len() == 1 {
            // One token: the decode-step path, which a backend may record and replay.
            let mut one = [session];
            let mut draws = self.decode_batch_prepared(&mut one, ids, vec![row.clone()])?;
            return Ok(draws.remove(0));
        }
        let (head, last) = ids.split_at((ids.len() - 1) / self.pass_tokens * self.pass_tokens);
        self.feed_passes(session, head);
        let scratch = self.forward_pass(session, last);
        let logits = self.last_row_logits(&scratch, last.len());
        Ok(self.backend.sample_rows(&logits, self.config.vocab_size, &[(0, row)]).remove(0))
    }

    /// `ids` through every layer in passes of [`Model::pass_tokens`], no logits made.
    fn feed_passes(&self, session: &mut Session<B>, ids: &[u32]) {
        for piece in ids.chunks(self.pass_tokens) {
            self.forward_pass(session, piece);
        }
    }

    /// What every feed checks first: tokens to feed, in the vocabulary, room in the session.
    fn check_feed(&self, session: &Session<B>, ids: &[u32]) -> Result<()> {
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
        Ok(())
    }

    /// One decode step for several sequences at once: feeds `tokens[i]` to `sessions[i]` and
    /// returns `[sessions.len(), vocab]` logits. The weights are read once for the whole batch,
    /// and row `i` is bitwise what `forward(sessions[i], &[tokens[i]], Logits::Last)` returns:
    /// a sequence's tokens never depend on what else is in the batch.
    pub fn decode_batch(&self, sessions: &mut [&mut Session<B>], tokens: &[u32]) -> Result<Vec<f32>> {
        let vocab = self.config.vocab_size;
        let mut logits = Vec::new();
        self.decode_step(sessions, tokens, &mut |b, out| logits = b.download(out, 0, tokens.len() * vocab))?;
        Ok(logits)
    }

    /// [`Model::decode_batch`] that returns each row's greedy token (the argmax of its logits,
    /// ties to the lowest id) instead of the logits, so that only token ids leave the device.
    /// A row whose logits are not finite is an [`Error::NonFinite`].
    pub fn decode_batch_greedy(&self, sessions: &mut [&mut Session<B>], tokens: &[u32]) -> Result<Vec<u32>> {
        let vocab = self.config.vocab_size;
        let mut ids = Vec::new();
        self.decode_step(sessions, tokens, &mut |b, out| ids = b.argmax_rows(out, tokens.len(), vocab))?;
        Ok(ids.into_iter().collect::<Result<_, _>>()?)
    }

    /// [`Model::decode_batch`] that finishes each row's prepared draw next to the logits
    /// ([`Backend::sample_rows`]): row `i`'s draw is what `sampling::sample_prepared` makes of
    /// its logits with `rows[i]`, and only the ids (and the log-probabilities asked for) leave
    /// the device. A row whose logits are not finite gets its own `Err`, so a batch can drop
    /// that sequence alone.
    pub fn decode_batch_prepared(
        &self,
        sessions: &mut [&mut Session<B>],
        tokens: &[u32],
        rows: Vec<PreparedSample>,
    ) -> Result<Vec<std::result::Result<Draw, NonFiniteLogits>>> {
        self.decode_batch_masked(sessions, tokens, rows, &mut |_| {})
    }

    /// [`Model::decode_batch_prepared`] for rows whose grammar masks (structured output) are
    /// still to come: `masks` fills them in (`PreparedSample::allowed`) after the step has been
    /// handed to the backend and before the draws, so on a device that runs the step
    /// asynchronously the host computes the masks while the device computes the logits.
    pub fn decode_batch_masked(
        &self,
        sessions: &mut [&mut Session<B>],
        tokens: &[u32],
        mut rows: Vec<PreparedSample>,
        masks: &mut dyn FnMut(&mut [PreparedSample]),
    ) -> Result<Vec<std::result::Result<Draw, NonFiniteLogits>>> {
        if rows.len() != tokens.len() {
            return Err(Error::input(format!(
                "a decode batch of {} tokens needs as many prepared draws, not {}",
                tokens.len(),
                rows.len()
            )));
        }
        let vocab = self.config.vocab_size;
        let mut draws = Vec::new();
        self.decode_step(sessions, tokens, &mut |b, out| {
            masks(&mut rows);
            let picks: Vec<(usize, &PreparedSample)> = rows.iter().enumerate().collect();
            draws = b.sample_rows(out, vocab, &picks);
        })?;
        Ok(draws)
    }

    /// One decode step for a batch; `read` gets the `[batch, vocab]` logits on the device.
    fn decode_step(
        &self,
        sessions: &mut [&mut Session<B>],
        tokens: &[u32],
        read: &mut dyn FnMut(&B, &B::Buf),
    ) -> Result<()> {
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
        let positions: Vec<usize> = sessions.iter().map(|s| s.position()).collect();
        for (s, &p) in sessions.iter_mut().zip(&positions) {
            s.reserve(b, p + 1, attention_shape(c).kv_dim());
        }
        // The sequences and their buffers, in batch order, name the step for a recording.
        let key = sessions
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, s| (h ^ s.buffers_id()).wrapping_mul(0x0000_0100_0000_01b3));
        // A backend that routes experts on the host cannot record a MoE step: run it op by op.
        let recordable = self.steps_recordable;
        let run_step = |step: &mut dyn FnMut() -> B::Buf, read: &mut dyn FnMut(&B::Buf)| {
            if recordable {
                b.decode_step(key, tokens, &positions, step, read)
            } else {
                read(&step())
            }
        };
        run_step(
            &mut || {
                let mut scratch = Scratch::new(b, c, n);
                self.layers(&mut Sequences::Batch(sessions), tokens, &positions, &mut scratch);
                let mut logits = b.scratch(n * c.vocab_size);
                b.matmul_rows(&scratch.x, n, self.lm_head(), &mut logits);
                logits
            },
            &mut |out| read(b, out),
        );
        for (s, &t) in sessions.iter_mut().zip(tokens) {
            s.advance(&[t]);
        }
        Ok(())
    }

    /// One pass of at most [`Model::pass_tokens`] tokens through every layer; returns the
    /// scratch whose `x` holds the final-normed hidden states.
    fn forward_pass(&self, session: &mut Session<B>, ids: &[u32]) -> Scratch<B> {
        let b = &self.backend;
        let c = &self.config;
        let t = ids.len();
        let pos0 = session.position();
        session.reserve(b, pos0 + t, attention_shape(c).kv_dim());
        let positions: Vec<usize> = (pos0..pos0 + t).collect();
        let mut scratch = Scratch::new(b, c, t);
        self.layers(&mut Sequences::One(session), ids, &positions, &mut scratch);
        session.advance(ids);
        scratch
    }

    /// The logits of the last of a pass's `t` positions, `[vocab]`, on the backend.
    fn last_row_logits(&self, scratch: &Scratch<B>, t: usize) -> B::Buf {
        let b = &self.backend;
        let c = &self.config;
        let mut row = b.scratch(c.hidden_size);
        b.copy_row(&scratch.x, t - 1, c.hidden_size, &mut row);
        let mut logits = b.scratch(c.vocab_size);
        b.matmul(&row, 1, self.lm_head(), &mut logits);
        logits
    }

    fn lm_head(&self) -> &B::Weight {
        self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed_tokens)
    }

    /// Embeds `ids` and runs every decoder layer; leaves the final-normed hidden states in
    /// `s.x`. Row `t` is at position `positions[t]` of its sequence.
    fn layers(&self, seqs: &mut Sequences<'_, '_, B>, ids: &[u32], positions: &[usize], s: &mut Scratch<B>) {
        let b = &self.backend;
        let c = &self.config;
        let w = &self.weights;
        let (hidden, eps) = (c.hidden_size, c.rms_norm_eps);
        let t = ids.len();
        b.embed(&w.embed_tokens, ids, hidden, &mut s.h);
        let norm = |weight| RmsNorm { weight, dim: hidden, eps };
        b.rms_norm(&s.h, norm(&w.layers[0].input_norm), &mut s.x);
        for (l, layer) in w.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::DeltaNet(m) => self.delta_net(m, l, seqs, t, s),
                Mixer::Attention(m) => self.attention(m, l, seqs, positions, s),
            }
            b.add_rms_norm(&mut s.h, &s.y, norm(&layer.post_attention_norm), &mut s.x);

            let decode_batch = matches!(seqs, Sequences::Batch(_));
            match &layer.mlp {
                Mlp::Dense(m) => {
                    let acts =
                        MlpActivations { gate: &mut s.mlp_gate, up: &mut s.mlp_up, act: &mut s.mlp_act };
                    b.mlp(&s.x, t, m.weights(), acts, &mut s.y, decode_batch);
                }
                Mlp::Moe(m) => self.sparse_moe(m, seqs, t, s),
            }

            let next_norm = w.layers.get(l + 1).map_or(&w.final_norm, |n| &n.input_norm);
            b.add_rms_norm(&mut s.h, &s.y, norm(next_norm), &mut s.x);
        }
    }

    /// The sparse MoE block (`Qwen3_5MoeSparseMoeBlock.forward`): the shared expert, the router,
    /// the routed experts' weighted sum, plus the shared expert's output scaled by the sigmoid
    /// of its gate ([`crate::backend::sparse_moe_each`] spells it out op by op); reads `s.x`,
    /// writes `s.y`.
    fn sparse_moe(&self, m: &MoeWeights<B>, seqs: &Sequences<'_, '_, B>, t: usize, s: &mut Scratch<B>) {
        let moe = SparseMoe {
            router: &m.router,
            experts: &m.experts,
            shared_expert: m.shared_expert.weights(),
            shared_expert_gate: &m.shared_expert_gate,
        };
        let scratch = MoeScratch {
            router_logits: &mut s.router_logits,
            shared_gate: &mut s.shared_gate,
            shared_out: &mut s.shared_out,
            shared_acts: MlpActivations { gate: &mut s.mlp_gate, up: &mut s.mlp_up, act: &mut s.mlp_act },
        };
        let decode_batch = matches!(seqs, Sequences::Batch(_));
        self.backend.sparse_moe(&s.x, t, moe, scratch, &mut s.y, decode_batch);
    }

    /// Gated DeltaNet mixer of layer `l`: projections, causal conv, delta rule, gated norm,
    /// out_proj; reads `s.x`, writes `s.y`.
    fn delta_net(
        &self,
        m: &DeltaNetWeights<B>,
        l: usize,
        seqs: &mut Sequences<'_, '_, B>,
        t: usize,
        s: &mut Scratch<B>,
    ) {
        let b = &self.backend;
        let d = deltanet_shape(&self.config);
        let layer = m.layer(d);
        seqs.matmul_many(
            b,
            &s.x,
            t,
            &[&m.in_proj_qkv, &m.in_proj_z, &m.in_proj_b, &m.in_proj_a],
            &mut [&mut s.qkv, &mut s.z, &mut s.beta_in, &mut s.decay_in],
        );
        match seqs {
            Sequences::One(session) => {
                let state = session.deltanet_state(l);
                b.causal_conv1d_silu(&d, &mut s.qkv, t, layer.conv1d, state.conv);
                // As in the reference: the single-token step for decode, chunks for anything longer.
                let mode = if t == 1 { DeltaRuleMode::Recurrent } else { DeltaRuleMode::Chunked };
                let input = DeltaRuleInput {
                    qkv: &s.qkv,
                    a: &s.decay_in,
                    b: &s.beta_in,
                    a_log: layer.a_log,
                    dt_bias: layer.dt_bias,
                };
                b.gated_delta_rule(&d, mode, input, t, state.recurrent, &mut s.core);
                b.gated_rms_norm(&mut s.core, &s.z, layer.gated_norm(), t * d.num_v_heads);
            }
            Sequences::Batch(sessions) => {
                let mut states: Vec<DeltaNetState<B::Buf>> =
                    sessions.iter_mut().map(|session| session.deltanet_state(l)).collect();
                let projections =
                    DeltaNetProjections { qkv: &mut s.qkv, z: &s.z, a: &s.decay_in, b: &s.beta_in };
                b.deltanet_decode_rows(layer, projections, &mut states, &mut s.core);
            }
        }
        seqs.matmul(b, &s.core, t, &m.out_proj, &mut s.y);
    }

    /// Gated attention mixer of layer `l`: q/gate, k, v projections, norms + RoPE, causal GQA
    /// over the KV cache, sigmoid gate, o_proj; reads `s.x`, writes `s.y`.
    fn attention(
        &self,
        m: &AttentionWeights<B>,
        l: usize,
        seqs: &mut Sequences<'_, '_, B>,
        positions: &[usize],
        s: &mut Scratch<B>,
    ) {
        let b = &self.backend;
        let a = attention_shape(&self.config);
        let t = positions.len();
        seqs.matmul_many(
            b,
            &s.x,
            t,
            &[&m.q_proj, &m.k_proj, &m.v_proj],
            &mut [&mut s.q_and_gate, &mut s.k, &mut s.v],
        );
        let layer =
            AttentionLayer { shape: a, q_norm: &m.q_norm, k_norm: &m.k_norm, inv_freq: &self.inv_freq };
        b.attention_prologue(layer, &s.q_and_gate, &mut s.k, positions, &mut s.q, &mut s.gate);
        let input = AttentionInput { q: &s.q, k: &s.k, v: &s.v, gate: &s.gate };
        match seqs {
            Sequences::One(session) => {
                b.attention(&a, input, session.kv_cache(l), positions[0], t, &mut s.attn);
            }
            Sequences::Batch(sessions) => {
                let mut caches: Vec<KvCache<B::Cache>> =
                    sessions.iter_mut().map(|session| session.kv_cache(l)).collect();
                b.attention_rows(&a, input, &mut caches, positions, &mut s.attn);
            }
        }
        seqs.matmul(b, &s.attn, t, &m.o_proj, &mut s.y);
    }
}

/// What a pass runs over: consecutive tokens of one sequence (prefill, or one decode token),
/// or one token of each of several sequences (a decode batch).
enum Sequences<'s, 'a, B: Backend> {
    One(&'s mut Session<B>),
    Batch(&'s mut [&'a mut Session<B>]),
}

impl<B: Backend> Sequences<'_, '_, B> {
    /// The projections of one input, which a backend may fuse (row-invariantly for a batch).
    fn matmul_many(&self, b: &B, x: &B::Buf, t: usize, ws: &[&B::Weight], outs: &mut [&mut B::Buf]) {
        b.matmul_many(x, t, ws, outs, matches!(self, Sequences::Batch(_)));
    }

    /// A batch multiplies row by row with the one-token kernel, so each sequence's numbers do
    /// not depend on the batch it is in.
    fn matmul(&self, b: &B, x: &B::Buf, t: usize, w: &B::Weight, out: &mut B::Buf) {
        match self {
            Sequences::One(_) => b.matmul(x, t, w, out),
            Sequences::Batch(_) => b.matmul_rows(x, t, w, out),
        }
    }
}

/// Device bytes a prompt pass holds per token, an estimate on the high side for memory
/// checks: its activations ([`Scratch`]), bf16 copies of two GEMM inputs of the widest kind,
/// the conv's output buffer and the chunked delta rule's per-chunk products (bf16 W, q·e^γ,
/// decayed kᵀ and the q·k block, f32 U, per value head).
pub fn pass_bytes_per_token(c: &ModelConfig) -> usize {
    let d = deltanet_shape(c);
    let activations: usize = scratch_widths(c).iter().sum();
    let widest = c.hidden_size.max(mlp_width(c)).max(d.value_dim()).max(d.conv_dim());
    let chunk_products = d.num_v_heads * (3 * d.k_head_dim * 2 + 64 * 2 + d.v_head_dim * 4);
    // A MoE pass gathers each expert's rows, their activations and outputs: per token,
    // `num_experts_per_tok` of each.
    let experts =
        c.moe.map_or(0, |m| m.num_experts_per_tok * (2 * c.hidden_size + 3 * m.moe_intermediate_size));
    4 * (activations + experts) + 2 * 2 * widest + 4 * d.conv_dim() + chunk_products
}

/// `preferred` cut to the longest pass (a multiple of [`PASS_TOKENS_ALIGN`], at least one
/// chunk) whose [`pass_bytes_per_token`] fit in `budget` bytes.
pub fn capped_pass_tokens(preferred: usize, budget: usize, per_token: usize) -> usize {
    let fits = budget / per_token.max(1) / PASS_TOKENS_ALIGN * PASS_TOKENS_ALIGN;
    preferred.min(fits).max(PASS_TOKENS_ALIGN)
}

/// The activations of one pass of `t` rows, allocated once and reused by every layer.
struct Scratch<B: Backend> {
    h: B::Buf,
    x: B::Buf,
    y: B::Buf,
    mlp_gate: B::Buf,
    mlp_up: B::Buf,
    mlp_act: B::Buf,
    // Sparse MoE layers.
    router_logits: B::Buf,
    shared_gate: B::Buf,
    shared_out: B::Buf,
    // Gated DeltaNet layers.
    qkv: B::Buf,
    z: B::Buf,
    beta_in: B::Buf,
    decay_in: B::Buf,
    core: B::Buf,
    // Gated attention layers.
    q_and_gate: B::Buf,
    q: B::Buf,
    gate: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(b: &B, c: &ModelConfig, t: usize) -> Scratch<B> {
        // Every op overwrites its output in full, so nothing needs zeroing.
        let [h, x, y, mlp_gate, mlp_up, mlp_act, router_logits, shared_gate, shared_out, qkv, z, beta_in, decay_in, core, q_and_gate, q, gate, k, v, attn] =
            scratch_widths(c).map(|width| b.scratch(t * width));
        Scratch {
            h,
            x,
            y,
            mlp_gate,
            mlp_up,
            mlp_act,
            router_logits,
            shared_gate,
            shared_out,
            qkv,
            z,
            beta_in,
            decay_in,
            core,
            q_and_gate,
            q,
            gate,
            k,
            v,
            attn,
        }
    }
}

/// The widest SwiGLU MLP a layer runs through [`Backend::mlp`] with the pass's scratch: the
/// dense MLP, or a MoE model's shared expert (the routed experts keep their own scratch).
fn mlp_width(c: &ModelConfig) -> usize {
    c.moe.map_or(c.intermediate_size, |m| m.shared_expert_intermediate_size)
}

/// Floats per token of each [`Scratch`] buffer, in field order; 0 for the buffers of a layer
/// kind the model lacks.
fn scratch_widths(c: &ModelConfig) -> [usize; 20] {
    let d = deltanet_shape(c);
    let a = attention_shape(c);
    let q_dim = a.num_heads * a.head_dim;
    let has = |kind| usize::from(c.layer_kinds.contains(&kind));
    let (dn, at) = (has(LayerKind::DeltaNet), has(LayerKind::Attention));
    let (hidden, inter) = (c.hidden_size, mlp_width(c));
    let moe = c.moe.unwrap_or(MoeConfig {
        num_experts: 0,
        num_experts_per_tok: 0,
        moe_intermediate_size: 0,
        shared_expert_intermediate_size: 0,
    });
    let is_moe = usize::from(c.moe.is_some());
    [
        hidden,
        hidden,
        hidden,
        inter,
        inter,
        inter,
        moe.num_experts,
        is_moe,
        is_moe * hidden,
        dn * d.conv_dim(),
        dn * d.value_dim(),
        dn * d.num_v_heads,
        dn * d.num_v_heads,
        dn * d.value_dim(),
        at * 2 * q_dim,
        at * q_dim,
        at * q_dim,
        at * a.kv_dim(),
        at * a.kv_dim(),
        at * q_dim,
    ]
}

/// `1 / theta^(2i / rotary_dim)`, in f32 as the reference computes it.
pub fn rope_inv_freq(c: &ModelConfig) -> Vec<f32> {
    let dim = c.rotary_dim as f32;
    let theta = c.rope_theta as f32;
    (0..c.rotary_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / dim)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::preset;

    #[test]
    fn pass_memory_grows_with_the_model_and_caps_the_pass() {
        let small = pass_bytes_per_token(&preset("qwen3.5-0.8b").unwrap());
        let large = pass_bytes_per_token(&preset("qwen3.5-9b").unwrap());
        // The 9B shape's activations alone are ~88k floats a token.
        assert!(large > small && (300_000..1_000_000).contains(&large), "{small} {large}");
        assert_eq!(capped_pass_tokens(4096, usize::MAX, large), 4096, "room for the preferred pass");
        assert_eq!(capped_pass_tokens(4096, 1000 * large, large), 960, "cut to a multiple of 64");
        assert_eq!(capped_pass_tokens(4096, 10, large), 64, "never below one chunk");
        assert_eq!(capped_pass_tokens(512, 100_000 * large, large), 512);
    }
}
