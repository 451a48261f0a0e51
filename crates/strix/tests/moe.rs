//! Qwen3.5 mixture-of-experts models on the CPU against the committed `transformers` goldens
//! (`tests/fixtures/moe-models/*`, made by `scripts/make_moe_fixtures.py`): both config
//! layouts, experts stored one by one and fused, 4 to 16 experts, top-1 to top-4, the shared
//! expert, prompts of 1 to 130 tokens.
//!
//! Tolerance: max |strix − reference| / max |reference| ≤ 1e-4 (f32 arithmetic on both sides,
//! as for the dense models; the errors reached are printed). The fixtures' routers have no near
//! ties (the script checks every decision), so f32 rounding cannot pick another expert.

mod common;
mod damaged;
mod model_checks;

use std::path::{Path, PathBuf};

use common::{cases, rel_err};
use model_checks::{batch_prompts, check_decode_batches_equal_alone, golden_dirs, logits_in_pieces};
use strix::backend::cpu::{CpuBackend, CpuWeight};
use strix::backend::{Backend, MoeExperts};
use strix::config::ModelConfig;
use strix::model::{Logits, Model};
use strix::tensor::HostTensor;

const TOLERANCE: f32 = 1e-4;

fn moe_fixtures() -> Vec<PathBuf> {
    let root = damaged::fixtures().join("moe-models");
    let dirs = golden_dirs(&root);
    assert_eq!(dirs.len(), 3, "expected the committed MoE fixtures under {}", root.display());
    dirs
}

fn fixture(name: &str) -> PathBuf {
    moe_fixtures().into_iter().find(|d| d.ends_with(name)).unwrap()
}

/// Every prompt position's logits in one forward pass, then ten greedy steps one token at a
/// time (each a decode step: the recurrent delta rule, one token through its experts).
fn check_against_goldens<B: Backend>(dir: &Path, model: &Model<B>, label: &str) {
    let name = format!("{} ({label})", dir.file_name().unwrap().to_string_lossy());
    model_checks::check_against_goldens(model, dir, &name, 512, TOLERANCE);
}

#[test]
fn moe_prompt_and_decode_logits_match_transformers() {
    for dir in moe_fixtures() {
        let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
        let moe = model.config.moe.expect("a MoE fixture loads as MoE");
        assert_eq!(model.config.intermediate_size, 0);
        assert!(moe.num_experts_per_tok <= moe.num_experts);
        check_against_goldens(&dir, &model, "cpu");
    }
}

#[test]
fn config_layouts_and_expert_counts_are_read() {
    let c = ModelConfig::from_model_dir(&fixture("moe-vlm-f32-fused")).unwrap();
    let m = c.moe.unwrap();
    assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size), (8, 2, 16));
    assert_eq!(m.shared_expert_intermediate_size, 24);
    assert_eq!(c.linear_num_v_heads, 2 * c.linear_num_k_heads);
    let c = ModelConfig::from_model_dir(&fixture("moe-causal-bf16-sharded")).unwrap();
    let m = c.moe.unwrap();
    assert_eq!((m.num_experts, m.num_experts_per_tok, m.shared_expert_intermediate_size), (16, 4, 32));
    assert_eq!(c.linear_num_v_heads, c.linear_num_k_heads);
    assert!(c.tie_word_embeddings);
}

/// The CPU backend with the trait's default MoE ops ([`strix::backend::moe_experts_on_host`],
/// [`strix::backend::add_sigmoid_gated_on_host`]): what a backend without MoE kernels (CUDA,
/// for now) runs.
struct HostMoe(CpuBackend);

impl Backend for HostMoe {
    type Buf = Vec<f32>;
    type Cache = Vec<f32>;
    type Weight = CpuWeight;

    fn name(&self) -> String {
        "cpu with the default MoE ops".into()
    }
    fn weight(&self, t: &HostTensor, rows: usize, cols: usize) -> strix::Result<CpuWeight> {
        self.0.weight(t, rows, cols)
    }
    common::delegate_buffer_ops_to_cpu!(0);
    fn weight_bytes(&self, w: &CpuWeight) -> usize {
        self.0.weight_bytes(w)
    }
    fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
        self.0.weight_shape(w)
    }
    fn embed(&self, table: &CpuWeight, ids: &[u32], dim: usize, out: &mut Vec<f32>) {
        self.0.embed(table, ids, dim, out)
    }
    fn matmul(&self, x: &Vec<f32>, tokens: usize, w: &CpuWeight, out: &mut Vec<f32>) {
        self.0.matmul(x, tokens, w, out)
    }
    fn matmul_rows(&self, x: &Vec<f32>, tokens: usize, w: &CpuWeight, out: &mut Vec<f32>) {
        self.0.matmul_rows(x, tokens, w, out)
    }

    common::delegate_activation_ops_to_cpu!(0);
}

#[test]
fn default_moe_ops_match_transformers() {
    for name in ["moe-causal-bf16-sharded", "moe-causal-f32-top1"] {
        let dir = fixture(name);
        let model = Model::load(&dir, HostMoe(CpuBackend::new()), None).unwrap();
        let no_experts =
            MoeExperts::<HostMoe> { gate: Vec::new(), up: Vec::new(), down: Vec::new(), top_k: 1 };
        assert!(!model.backend().moe_on_device(&no_experts));
        check_against_goldens(&dir, &model, "default ops");
    }
}

/// The CPU's grouped experts and the trait's default are the same arithmetic: bitwise the
/// same logits, prompt and decode.
#[test]
fn default_moe_ops_equal_the_cpu_kernels_bitwise() {
    let dir = fixture("moe-vlm-f32-fused");
    let cpu = Model::load(&dir, CpuBackend::new(), None).unwrap();
    let host = Model::load(&dir, HostMoe(CpuBackend::new()), None).unwrap();
    let case = cases(&dir).into_iter().max_by_key(|c| c.len).unwrap();
    let (mut a, mut b) = (cpu.new_session(256), host.new_session(256));
    assert_eq!(
        cpu.forward(&mut a, &case.ids, Logits::All).unwrap(),
        host.forward(&mut b, &case.ids, Logits::All).unwrap()
    );
    for &t in &case.greedy[..3] {
        assert_eq!(
            cpu.forward(&mut a, &[t], Logits::Last).unwrap(),
            host.forward(&mut b, &[t], Logits::Last).unwrap()
        );
    }
}

/// A decode batch of sequences at different positions gives each one bitwise the logits it
/// gets decoding alone, though the batch's tokens share experts.
#[test]
fn moe_decode_batch_rows_equal_decoding_alone() {
    for dir in moe_fixtures() {
        let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
        let prompts = batch_prompts();
        let everyone = |_| (0..prompts.len()).collect();
        check_decode_batches_equal_alone(&model, &prompts, 128, 3, everyone, &dir.display().to_string());
    }
}

/// Prefill in pieces, decode steps among them, gives the logits of one long prefill (the
/// experts' groups change with the pieces; the numbers only in the last bits).
#[test]
fn moe_continuation_equals_one_long_prefill() {
    let dir = fixture("moe-vlm-f32-fused");
    let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
    let case = cases(&dir).into_iter().find(|c| c.len == 130).unwrap();
    let mut ids = case.ids.clone();
    ids.extend(&case.greedy);
    let reference = model.forward(&mut model.new_session(256), &ids, Logits::All).unwrap();
    for split in [&[1usize, 139][..], &[63, 1, 1, 75], &[65, 65, 1, 1, 8]] {
        let got = logits_in_pieces(&model, 256, &ids, split);
        let e = rel_err(&got, &reference);
        println!("split {split:?}: rel err {e:.2e}");
        assert!(e <= 1e-5, "split {split:?}: rel err {e:.2e}");
    }
}

/// `--quant` on a MoE checkpoint: the experts (one by one or sliced from fused tensors) and
/// the shared expert arrive packed, the router stays float, and the CPU's packed kernels run
/// them. Against the same quantized weights read in f32 (activations not rounded) over each
/// prompt's first two positions: reached 1.3e-2 … 1.2e-1, bound 0.2 as for the dense Q8_0
/// files. Whole prompts are not compared: an 8-bit rounding that moves a token to another
/// expert changes every later position by O(1).
#[test]
fn quantized_on_load_moe_runs_packed_experts() {
    use strix::quant::on_load::{QuantScheme, QuantizingSource};
    for name in ["moe-causal-f32-top1", "moe-vlm-f32-fused"] {
        let dir = fixture(name);
        let config = ModelConfig::from_model_dir(&dir).unwrap();
        let ckpt = strix::checkpoint::Checkpoint::open_dir(&dir).unwrap();
        let float = Model::from_source(config.clone(), &ckpt, CpuBackend::new(), None).unwrap();
        let src = QuantizingSource::new(&ckpt, &config, QuantScheme::Q8_0);
        let packed = Model::from_source(config.clone(), &src, CpuBackend::new(), None).unwrap();
        let exact =
            Model::from_source(config.clone(), &common::Dequantized { inner: &src }, CpuBackend::new(), None)
                .unwrap();
        assert!(
            packed.weight_bytes_per_token() < float.weight_bytes_per_token() * 3 / 4,
            "{name}: not quantized"
        );
        let vocab = config.vocab_size;
        for case in cases(&dir) {
            let n = case.len.min(2) * vocab;
            let p = packed.forward(&mut packed.new_session(256), &case.ids, Logits::All).unwrap();
            let e = exact.forward(&mut exact.new_session(256), &case.ids, Logits::All).unwrap();
            let err = rel_err(&p[..n], &e[..n]);
            println!(
                "{name} q8_0 T={}: packed vs exact {err:.2e} (whole prompt {:.2e})",
                case.len,
                rel_err(&p, &e)
            );
            assert!(err <= 0.2, "{name} T={}: {err:.2e}", case.len);
        }
    }
}

/// A fused checkpoint whose expert tensors do not hold the config's experts is refused with
/// the tensor and the shape it should have; one without them names the expert it lacks.
#[test]
fn damaged_fused_experts_are_errors_naming_the_tensor() {
    use damaged::{safetensors_from_parts, safetensors_parts};
    let src = fixture("moe-vlm-f32-fused");
    let load_err = |edit: &dyn Fn(&mut serde_json::Value)| {
        let tmp = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
        }
        let file = tmp.path().join("model.safetensors");
        let (mut header, data) = safetensors_parts(&std::fs::read(&file).unwrap());
        edit(&mut header);
        std::fs::write(&file, safetensors_from_parts(&header, &data)).unwrap();
        match Model::load(tmp.path(), CpuBackend::new(), None) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    };
    let gate_up = "model.language_model.layers.2.mlp.experts.gate_up_proj";
    // The same bytes seen as 16 experts of half the rows.
    let e = load_err(&|h| h[gate_up]["shape"] = serde_json::json!([16, 16, 64]));
    assert!(
        e.contains(gate_up) && e.contains("[16, 16, 64]") && e.contains("expected [experts > 0, 32, 64]"),
        "{e}"
    );
    let down = "model.language_model.layers.0.mlp.experts.down_proj";
    let e = load_err(&|h| {
        let entry = h.as_object_mut().unwrap().remove(down).unwrap();
        h["model.language_model.layers.0.mlp.experts.down"] = entry;
    });
    assert!(
        e.contains("missing tensor `model.language_model.layers.0.mlp.experts.0.down_proj.weight`"),
        "{e}"
    );
}
