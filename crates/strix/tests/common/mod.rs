//! What the integration tests share: the committed transformers fixtures
//! (`tests/fixtures/models/*`, made by `scripts/make_fixtures.py`), their goldens, and the
//! error measure every tolerance is stated in.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use strix::backend::cuda::CudaBackend;
use strix::backend::KvCacheType;
use strix::model::TensorSource;
use strix::tensor::HostTensor;

/// The tensors of `inner` with packed blocks decoded to f32: a model built from it computes on
/// exactly the values the blocks hold, with f32 activations. Tests of loading and of the GPU's
/// packed kernels use it as the reference; the CPU's own packed kernels round activations to 8
/// bits, which tiny random-weight models amplify far past an f32 tolerance.
pub struct Dequantized<'a> {
    pub inner: &'a dyn TensorSource,
}

impl TensorSource for Dequantized<'_> {
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn tensor(&self, name: &str, shape: &[usize]) -> strix::Result<HostTensor> {
        Ok(self.inner.tensor(name, shape)?.dequantized())
    }
}

/// max |ours − reference| / max |reference|; infinite when ours holds a NaN.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    if ours.iter().any(|x| !x.is_finite()) {
        return f32::INFINITY;
    }
    let max_ref = reference.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let max_d = ours.iter().zip(reference).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    if max_ref == 0.0 {
        max_d
    } else {
        max_d / max_ref
    }
}

/// The fixtures beside the sources, or (for a prebuilt test binary run on another machine)
/// `$STRIX_FIXTURES` or `tests/fixtures/models` under the working directory.
pub fn fixtures() -> Vec<PathBuf> {
    let candidates = [
        std::env::var_os("STRIX_FIXTURES").map(PathBuf::from),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models")),
        Some(PathBuf::from("tests/fixtures/models")),
    ];
    let root = candidates.into_iter().flatten().find(|p| p.is_dir()).expect("the fixtures directory");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("goldens.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 3, "expected the committed fixtures under {}", root.display());
    dirs
}

pub struct Case {
    pub len: usize,
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
    pub decode_logits: Vec<f32>,
}

pub fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn ids(st: &SafeTensors, name: &str) -> Vec<u32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

pub fn cases(dir: &Path) -> Vec<Case> {
    let bytes = std::fs::read(dir.join("goldens.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut lens: Vec<usize> = st
        .names()
        .iter()
        .filter_map(|n| n.strip_suffix(".ids").and_then(|p| p.strip_prefix('p')).map(|l| l.parse().unwrap()))
        .collect();
    lens.sort();
    lens.into_iter()
        .map(|len| Case {
            len,
            ids: ids(&st, &format!("p{len}.ids")),
            logits: f32s(&st, &format!("p{len}.logits")),
            greedy: ids(&st, &format!("p{len}.greedy")),
            decode_logits: f32s(&st, &format!("p{len}.decode_logits")),
        })
        .collect()
}

/// A small-width synthetic config with the real head shapes (k/v head dim 128, attention head
/// dim 256, rotary 64): hidden 256 (whole 256-blocks, so the K-quants apply), vocabulary 2048,
/// four layers (three DeltaNet, one attention), tied embedding.
pub fn small_real_heads(intermediate: usize) -> strix::config::ModelConfig {
    let mut c = strix::synthetic::preset("qwen3.5-0.8b").unwrap();
    c.vocab_size = 2048;
    c.hidden_size = 256;
    c.intermediate_size = intermediate;
    c.num_layers = 4;
    c.layer_kinds.truncate(4);
    c
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The `Backend` buffer ops (upload, zeros, resize, download) of a test backend that wraps the
/// CPU backend, passed through to `self.$inner`.
#[allow(unused_macros)]
macro_rules! delegate_buffer_ops_to_cpu {
    ($inner:tt) => {
        fn upload(&self, data: &[f32]) -> Vec<f32> {
            self.$inner.upload(data)
        }
        fn zeros(&self, len: usize) -> Vec<f32> {
            self.$inner.zeros(len)
        }
        fn resize(&self, buf: &mut Vec<f32>, len: usize) {
            self.$inner.resize(buf, len)
        }
        fn download(&self, buf: &Vec<f32>, offset: usize, len: usize) -> Vec<f32> {
            self.$inner.download(buf, offset, len)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use delegate_buffer_ops_to_cpu;

/// The `Backend` ops on activations and states of a test backend that wraps the CPU backend
/// (a reference with its own weights and matmuls), passed through to `self.$inner`;
/// `($inner, without_attention)` leaves out `attention` and `attention_rows` (a reference that
/// emulates a cache type writes its own).
#[allow(unused_macros)]
macro_rules! delegate_activation_ops_to_cpu {
    ($inner:tt) => {
        common::delegate_activation_ops_to_cpu!($inner, without_attention);
        fn attention(
            &self,
            s: &strix::backend::AttentionShape,
            input: strix::backend::AttentionInput<'_, Vec<f32>>,
            cache: strix::backend::KvCache<'_, Vec<f32>>,
            pos0: usize,
            tokens: usize,
            out: &mut Vec<f32>,
        ) {
            self.$inner.attention(s, input, cache, pos0, tokens, out)
        }
        fn attention_rows(
            &self,
            s: &strix::backend::AttentionShape,
            input: strix::backend::AttentionInput<'_, Vec<f32>>,
            caches: &mut [strix::backend::KvCache<'_, Vec<f32>>],
            positions: &[usize],
            out: &mut Vec<f32>,
        ) {
            self.$inner.attention_rows(s, input, caches, positions, out)
        }
    };
    ($inner:tt, without_attention) => {
        fn rms_norm(&self, x: &Vec<f32>, norm: strix::backend::RmsNorm<'_, Vec<f32>>, out: &mut Vec<f32>) {
            self.$inner.rms_norm(x, norm, out)
        }
        fn add_rms_norm(
            &self,
            r: &mut Vec<f32>,
            x: &Vec<f32>,
            norm: strix::backend::RmsNorm<'_, Vec<f32>>,
            out: &mut Vec<f32>,
        ) {
            self.$inner.add_rms_norm(r, x, norm, out)
        }
        fn swiglu(&self, g: &Vec<f32>, u: &Vec<f32>, len: usize, out: &mut Vec<f32>) {
            self.$inner.swiglu(g, u, len, out)
        }
        fn copy_row(&self, src: &Vec<f32>, row: usize, dim: usize, out: &mut Vec<f32>) {
            self.$inner.copy_row(src, row, dim, out)
        }
        fn causal_conv1d_silu(
            &self,
            s: &strix::backend::DeltaNetShape,
            qkv: &mut Vec<f32>,
            t: usize,
            w: &Vec<f32>,
            st: &mut Vec<f32>,
        ) {
            self.$inner.causal_conv1d_silu(s, qkv, t, w, st)
        }
        fn causal_conv1d_silu_rows(
            &self,
            s: &strix::backend::DeltaNetShape,
            qkv: &mut Vec<f32>,
            w: &Vec<f32>,
            states: &mut [strix::backend::DeltaNetState<'_, Vec<f32>>],
        ) {
            self.$inner.causal_conv1d_silu_rows(s, qkv, w, states)
        }
        fn gated_delta_rule_rows(
            &self,
            s: &strix::backend::DeltaNetShape,
            input: strix::backend::DeltaRuleInput<'_, Vec<f32>>,
            states: &mut [strix::backend::DeltaNetState<'_, Vec<f32>>],
            out: &mut Vec<f32>,
        ) {
            self.$inner.gated_delta_rule_rows(s, input, states, out)
        }
        fn gated_delta_rule(
            &self,
            s: &strix::backend::DeltaNetShape,
            mode: strix::backend::DeltaRuleMode,
            input: strix::backend::DeltaRuleInput<'_, Vec<f32>>,
            tokens: usize,
            state: &mut Vec<f32>,
            out: &mut Vec<f32>,
        ) {
            self.$inner.gated_delta_rule(s, mode, input, tokens, state, out)
        }
        fn gated_rms_norm(
            &self,
            x: &mut Vec<f32>,
            z: &Vec<f32>,
            norm: strix::backend::RmsNorm<'_, Vec<f32>>,
            rows: usize,
        ) {
            self.$inner.gated_rms_norm(x, z, norm, rows)
        }
        fn attention_prologue(
            &self,
            layer: strix::backend::AttentionLayer<'_, Vec<f32>>,
            qg: &Vec<f32>,
            k: &mut Vec<f32>,
            positions: &[usize],
            q: &mut Vec<f32>,
            gate: &mut Vec<f32>,
        ) {
            self.$inner.attention_prologue(layer, qg, k, positions, q, gate)
        }
        fn cache_zeros(&self, len: usize) -> Vec<f32> {
            self.$inner.cache_zeros(len)
        }
        fn cache_resize(&self, cache: &mut Vec<f32>, len: usize) {
            self.$inner.cache_resize(cache, len)
        }
        fn cache_download(&self, cache: &Vec<f32>, offset: usize, len: usize) -> Vec<f32> {
            self.$inner.cache_download(cache, offset, len)
        }
        fn copy(&self, src: &Vec<f32>, src_offset: usize, dst: &mut Vec<f32>, dst_offset: usize, len: usize) {
            self.$inner.copy(src, src_offset, dst, dst_offset, len)
        }
        fn cache_copy(
            &self,
            src: &Vec<f32>,
            src_offset: usize,
            dst: &mut Vec<f32>,
            dst_offset: usize,
            len: usize,
        ) {
            self.$inner.cache_copy(src, src_offset, dst, dst_offset, len)
        }
    };
}
#[allow(unused_imports)]
pub(crate) use delegate_activation_ops_to_cpu;

/// The CUDA options the `STRIX_*` variables choose (the kernel cache above all, so the suite
/// compiles its kernels once).
pub fn gpu_options() -> strix::backend::cuda::CudaOptions {
    strix::backend::cuda::CudaOptions::from_vars(|k| std::env::var(k).ok()).expect("STRIX_* CUDA variables")
}

/// [`gpu_options`] with KV caches of element type `kv`.
pub fn gpu_options_kv(kv: KvCacheType) -> strix::backend::cuda::CudaOptions {
    strix::backend::cuda::CudaOptions { kv_cache: kv, ..gpu_options() }
}

/// CUDA device 0 with [`gpu_options`], for a test that already knows there is one.
#[allow(dead_code)] // not every test binary builds models on the GPU
pub fn gpu_backend() -> CudaBackend {
    CudaBackend::with_options(0, &gpu_options()).expect("CUDA device 0")
}

/// [`gpu_backend`] whose KV caches are of element type `kv`.
pub fn gpu_backend_kv(kv: KvCacheType) -> CudaBackend {
    CudaBackend::with_options(0, &gpu_options_kv(kv)).expect("CUDA device 0")
}

/// CUDA device 0, or `None` after printing why the test is skipped.
pub fn gpu() -> Option<CudaBackend> {
    gpu_with(&gpu_options())
}

/// [`gpu`] whose KV caches are of element type `kv`.
pub fn gpu_kv(kv: KvCacheType) -> Option<CudaBackend> {
    gpu_with(&gpu_options_kv(kv))
}

fn gpu_with(options: &strix::backend::cuda::CudaOptions) -> Option<CudaBackend> {
    match CudaBackend::with_options(0, options) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

/// A small LCG for test data: values uniform in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    /// Random values with a random scale per 32 (e^-3 .. e^3).
    pub fn blocky(&mut self, n: usize) -> Vec<f32> {
        let mut v = self.vec(n, 1.0);
        for chunk in v.chunks_mut(32) {
            let s = (self.next() * 3.0).exp();
            chunk.iter_mut().for_each(|x| *x *= s);
        }
        v
    }
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next() * 0.5 + 0.5) * n as f32) as usize % n.max(1)
    }
}

/// Sampling settings (with the log-probabilities asked for) that a prompt's first draw is
/// checked under: temperature alone, greedy, and top-p with min-p and penalties.
pub fn first_draw_settings() -> [(strix::sampling::SamplingParams, Option<usize>); 3] {
    use strix::sampling::SamplingParams;
    [
        (SamplingParams { temperature: 0.7, seed: Some(4), ..SamplingParams::default() }, Some(3)),
        (SamplingParams::greedy(), None),
        (
            SamplingParams {
                temperature: 1.1,
                top_p: 0.8,
                min_p: 0.01,
                repetition_penalty: 1.2,
                presence_penalty: 0.4,
                seed: Some(9),
                ..SamplingParams::default()
            },
            Some(0),
        ),
    ]
}
