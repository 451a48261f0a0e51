//! Loading checkpoints: both layouts (multimodal `qwen3_5` with `model.language_model.*`, flat
//! `qwen3_5_text` with `model.*`), single-file and sharded weights, tensors the text model does
//! not use (`model.visual.*`, `mtp.*`, odd dtypes among them) left alone — and bad input.
//!
//! Every broken-input test copies a committed fixture into a temporary directory, breaks one
//! thing (a tensor missing, mis-shaped or of an unreadable dtype; a truncated file; a corrupt
//! safetensors header; a bad `config.json` field; a broken shard index...) and checks that
//! `Model::load` returns an error — never a panic — whose message names the file and the
//! tensor or field at fault, and says what is wrong with it.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::{json, Value};
use strix::backend::cpu::CpuBackend;
use strix::checkpoint::Checkpoint;
use strix::config::LayerKind;
use strix::model::Model;
use tempfile::TempDir;

const VLM: &str = "vlm-f32-gdn2x";
const SHARDED: &str = "causal-bf16-sharded";
const SHARD1: &str = "model-00001-of-00003.safetensors";
const SHARD2: &str = "model-00002-of-00003.safetensors";
const SHARD3: &str = "model-00003-of-00003.safetensors";
const INDEX: &str = "model.safetensors.index.json";
const VLM_UP: &str = "model.language_model.layers.0.mlp.up_proj.weight";
const SHARDED_UP: &str = "model.layers.0.mlp.up_proj.weight";

// --- helpers ------------------------------------------------------------------------------------

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// A private copy of a fixture directory, free to break.
fn copy_fixture(name: &str) -> TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    tmp
}

fn load(dir: &Path) -> strix::Result<Model<CpuBackend>> {
    Model::load(dir, CpuBackend::new(), None)
}

/// The message of the error `Model::load` must return.
fn load_err(dir: &Path) -> String {
    match load(dir) {
        Ok(_) => panic!("{} loaded, but it is broken", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("error shown to the user: {msg}");
            msg
        }
    }
}

/// Asserts that `msg` contains every one of `parts`.
fn assert_mentions(msg: &str, parts: &[&str]) {
    for part in parts {
        assert!(msg.contains(part), "error message lacks {part:?}:\n  {msg}");
    }
}

/// The path of `file` in `dir`, as error messages print it.
fn shown(dir: &Path, file: &str) -> String {
    dir.join(file).display().to_string()
}

/// Loading the model in `dir` fails with an error that names its `file` and mentions every one
/// of `parts`; returns the message.
#[track_caller]
fn assert_load_error(dir: &Path, file: &str, parts: &[&str]) -> String {
    let msg = load_err(dir);
    assert_mentions(&msg, &[&[shown(dir, file).as_str()][..], parts].concat());
    msg
}

/// One tensor of a safetensors file, owned so it can be edited and written back.
struct Stored {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_tensors(path: &Path) -> Vec<Stored> {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<Stored> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| Stored {
            name,
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            data: v.data().to_vec(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn write_tensors(path: &Path, tensors: &[Stored]) {
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .map(|t| (t.name.as_str(), TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Reads a safetensors file, lets `f` change its tensors and writes it back.
fn edit_tensors(path: &Path, f: impl FnOnce(&mut Vec<Stored>)) {
    let mut tensors = read_tensors(path);
    f(&mut tensors);
    write_tensors(path, &tensors);
}

fn find<'a>(tensors: &'a mut [Stored], name: &str) -> &'a mut Stored {
    tensors.iter_mut().find(|t| t.name == name).unwrap_or_else(|| panic!("fixture lacks {name}"))
}

fn f32_values(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    f(&mut value);
    fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

/// Edits the text part of a `config.json`: `text_config` in the multimodal layout, the top
/// level in the flat one.
fn edit_text_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    edit_json(&dir.join("config.json"), |v| {
        let text = if v.get("text_config").is_some() { &mut v["text_config"] } else { v };
        f(text.as_object_mut().unwrap());
    });
}

fn truncate(path: &Path, len: usize) {
    let bytes = fs::read(path).unwrap();
    fs::write(path, &bytes[..len]).unwrap();
}

fn file_len(path: &Path) -> usize {
    fs::metadata(path).unwrap().len() as usize
}

/// The header length a safetensors file declares in its first 8 bytes.
fn header_len(path: &Path) -> usize {
    let bytes = fs::read(path).unwrap();
    u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

// --- good checkpoints ---------------------------------------------------------------------------

#[test]
fn every_fixture_loads() {
    for (name, layers, tied) in [
        (VLM, 5, false),
        (SHARDED, 6, true),
        ("causal-f32-tied-gdn2x", 4, true),
        ("causal-bf16-gdn3x", 4, false),
    ] {
        let model = load(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.config.num_layers, layers, "{name}");
        assert_eq!(model.config.tie_word_embeddings, tied, "{name}");
    }
}

#[test]
fn sharded_fixture_loads_with_interval_layer_types() {
    let model = load(&fixture(SHARDED)).unwrap();
    use LayerKind::*;
    assert_eq!(model.config.layer_kinds, vec![DeltaNet, DeltaNet, Attention, DeltaNet, DeltaNet, Attention]);
    let ckpt = Checkpoint::open_dir(&fixture(SHARDED)).unwrap();
    // Layer 0 lives in the first shard, the last layer in the third: all three are mapped.
    assert!(ckpt.file_of(SHARDED_UP).ends_with(SHARD1));
    assert!(ckpt.file_of("model.layers.5.mlp.up_proj.weight").ends_with(SHARD3));
}

#[test]
fn extras_are_present_in_the_checkpoint_and_ignored_by_the_model() {
    let ckpt = Checkpoint::open_dir(&fixture(VLM)).unwrap();
    let names: Vec<&str> = ckpt.names().collect();
    assert!(names.iter().any(|n| n.starts_with("model.visual.")), "no model.visual.* in {VLM}");
    assert!(names.iter().any(|n| n.starts_with("mtp.")), "no mtp.* in {VLM}");
    assert!(names.contains(&"model.visual.patch_embed.proj.weight"));
    load(&fixture(VLM)).unwrap();

    let ckpt = Checkpoint::open_dir(&fixture(SHARDED)).unwrap();
    assert!(ckpt.names().any(|n| n.starts_with("mtp.")), "no mtp.* in {SHARDED}");
    load(&fixture(SHARDED)).unwrap();
}

#[test]
fn unused_extras_of_unreadable_dtypes_do_not_break_loading() {
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    edit_tensors(&path, |t| {
        t.push(Stored { name: "mtp.extra".into(), dtype: Dtype::I8, shape: vec![3, 5], data: vec![7; 15] });
        t.push(Stored {
            name: "model.visual.foo".into(),
            dtype: Dtype::F64,
            shape: vec![4],
            data: vec![0; 32],
        });
        t.push(Stored {
            name: "model.visual.mask".into(),
            dtype: Dtype::BOOL,
            shape: vec![2],
            data: vec![1, 0],
        });
        t.push(Stored { name: "mtp.scale".into(), dtype: Dtype::F8_E4M3, shape: vec![8], data: vec![0; 8] });
        // An existing extra converted to an integer type.
        let fc = find(t, "mtp.fc.weight");
        fc.data = f32_values(&fc.data).iter().map(|&v| (v * 100.0) as i8 as u8).collect();
        fc.dtype = Dtype::I8;
    });
    let ckpt = Checkpoint::open_dir(dir.path()).unwrap();
    assert!(ckpt.contains("mtp.extra") && ckpt.contains("model.visual.foo"));
    let model = load(dir.path()).unwrap();
    assert_eq!(model.config.num_layers, 5);

    // The same in a sharded checkpoint, with the index listing the extras.
    let dir = copy_fixture(SHARDED);
    edit_tensors(&dir.path().join(SHARD2), |t| {
        t.push(Stored { name: "mtp.extra".into(), dtype: Dtype::I8, shape: vec![3], data: vec![1, 2, 3] });
        t.push(Stored {
            name: "model.visual.foo".into(),
            dtype: Dtype::F64,
            shape: vec![1],
            data: vec![0; 8],
        });
    });
    edit_json(&dir.path().join(INDEX), |v| {
        v["weight_map"]["mtp.extra"] = SHARD2.into();
        v["weight_map"]["model.visual.foo"] = SHARD2.into();
    });
    load(dir.path()).unwrap();
}

// --- tensors: missing, mis-shaped, unreadable dtype ----------------------------------------------

#[test]
fn missing_tensor_is_named_with_the_file() {
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    edit_tensors(&path, |t| t.retain(|t| t.name != VLM_UP));
    let msg = load_err(dir.path());
    assert_mentions(
        &msg,
        &["missing tensor", &format!("`{VLM_UP}`"), &shown(dir.path(), "model.safetensors")],
    );
}

#[test]
fn missing_lm_head_of_an_untied_model_is_named() {
    let dir = copy_fixture(VLM);
    edit_tensors(&dir.path().join("model.safetensors"), |t| t.retain(|t| t.name != "lm_head.weight"));
    let msg = load_err(dir.path());
    assert_mentions(&msg, &["missing tensor", "`lm_head.weight`", "model.safetensors"]);
}

#[test]
fn missing_embedding_of_the_multimodal_layout_is_named() {
    let dir = copy_fixture(VLM);
    let embed = "model.language_model.embed_tokens.weight";
    edit_tensors(&dir.path().join("model.safetensors"), |t| t.retain(|t| t.name != embed));
    let msg = load_err(dir.path());
    // Without its embedding the checkpoint no longer looks multimodal, so the flat name is asked
    // for: either name points at the embedding.
    assert_mentions(&msg, &["missing tensor", "embed_tokens.weight", "model.safetensors"]);
}

#[test]
fn missing_tensor_of_a_sharded_checkpoint_names_the_shards() {
    let dir = copy_fixture(SHARDED);
    edit_tensors(&dir.path().join(SHARD1), |t| t.retain(|t| t.name != SHARDED_UP));
    edit_json(&dir.path().join(INDEX), |v| {
        v["weight_map"].as_object_mut().unwrap().remove(SHARDED_UP);
    });
    let msg = load_err(dir.path());
    assert_mentions(&msg, &["missing tensor", &format!("`{SHARDED_UP}`"), SHARD1, SHARD2, SHARD3]);
}

#[test]
fn transposed_tensor_names_tensor_shapes_and_file() {
    let dir = copy_fixture(VLM);
    edit_tensors(&dir.path().join("model.safetensors"), |t| find(t, VLM_UP).shape = vec![64, 96]);
    let msg = load_err(dir.path());
    assert_mentions(
        &msg,
        &[
            &format!("`{VLM_UP}`"),
            "shape",
            "[64, 96]",
            "expected [96, 64]",
            &shown(dir.path(), "model.safetensors"),
        ],
    );
}

#[test]
fn truncated_shape_names_tensor_shapes_and_file() {
    let dir = copy_fixture(VLM);
    edit_tensors(&dir.path().join("model.safetensors"), |t| {
        let up = find(t, VLM_UP);
        up.shape = vec![95, 64];
        up.data.truncate(95 * 64 * 4);
    });
    let msg = load_err(dir.path());
    assert_mentions(
        &msg,
        &[&format!("`{VLM_UP}`"), "shape [95, 64]", "expected [96, 64]", "model.safetensors"],
    );

    // A vector (norm weight) one element short, and a 3-d conv weight flattened to 2-d.
    let dir = copy_fixture(VLM);
    let norm = "model.language_model.layers.2.input_layernorm.weight";
    let conv = "model.language_model.layers.0.linear_attn.conv1d.weight";
    edit_tensors(&dir.path().join("model.safetensors"), |t| {
        let n = find(t, norm);
        n.shape = vec![63];
        n.data.truncate(63 * 4);
        find(t, conv).shape = vec![160, 4];
    });
    let msg = load_err(dir.path());
    // Layer 0 is loaded first, so the conv weight is the one reported.
    assert_mentions(&msg, &[&format!("`{conv}`"), "shape [160, 4]", "expected [160, 1, 4]"]);
    edit_tensors(&dir.path().join("model.safetensors"), |t| find(t, conv).shape = vec![160, 1, 4]);
    let msg = load_err(dir.path());
    assert_mentions(&msg, &[&format!("`{norm}`"), "shape [63]", "expected [64]"]);
}

#[test]
fn misshaped_tensor_in_a_shard_names_that_shard() {
    let dir = copy_fixture(SHARDED);
    let name = "model.layers.5.mlp.down_proj.weight";
    edit_tensors(&dir.path().join(SHARD3), |t| find(t, name).shape = vec![96, 64]);
    let msg = load_err(dir.path());
    assert_mentions(
        &msg,
        &[&format!("`{name}`"), "shape [96, 64]", "expected [64, 96]", &shown(dir.path(), SHARD3)],
    );
    assert!(!msg.contains(SHARD1) && !msg.contains(SHARD2), "names the wrong shard: {msg}");
}

#[test]
fn config_disagreeing_with_the_weights_is_a_shape_error() {
    let dir = copy_fixture(VLM);
    edit_text_config(dir.path(), |c| {
        c.insert("intermediate_size".into(), json!(128));
    });
    let msg = load_err(dir.path());
    assert_mentions(
        &msg,
        &["mlp.gate_proj.weight", "shape [96, 64]", "expected [128, 64]", "model.safetensors"],
    );

    let dir = copy_fixture(SHARDED);
    edit_text_config(dir.path(), |c| {
        c.insert("vocab_size".into(), json!(500));
    });
    let msg = load_err(dir.path());
    assert_mentions(&msg, &["`model.embed_tokens.weight`", "shape [384, 64]", "expected [500, 64]", SHARD1]);
}

#[test]
fn used_tensor_of_unsupported_dtype_names_dtype_and_tensor() {
    // f32 -> f64, same values.
    let dir = copy_fixture(VLM);
    edit_tensors(&dir.path().join("model.safetensors"), |t| {
        let up = find(t, VLM_UP);
        up.data = f32_values(&up.data).iter().flat_map(|&v| (v as f64).to_le_bytes()).collect();
        up.dtype = Dtype::F64;
    });
    let msg = load_err(dir.path());
    assert_mentions(&msg, &[&format!("`{VLM_UP}`"), "dtype F64", "F32, F16 and BF16", "model.safetensors"]);

    // f32 -> i8 (a quantised checkpoint without its scales).
    let dir = copy_fixture(VLM);
    let norm = "model.language_model.norm.weight";
    edit_tensors(&dir.path().join("model.safetensors"), |t| {
        let n = find(t, norm);
        n.data = f32_values(&n.data).iter().map(|&v| v as i8 as u8).collect();
        n.dtype = Dtype::I8;
    });
    let msg = load_err(dir.path());
    assert_mentions(&msg, &[&format!("`{norm}`"), "dtype I8", "model.safetensors"]);

    // bf16 -> fp8 in a shard.
    let dir = copy_fixture(SHARDED);
    edit_tensors(&dir.path().join(SHARD1), |t| {
        let up = find(t, SHARDED_UP);
        up.data = up.data.chunks_exact(2).map(|c| c[1]).collect();
        up.dtype = Dtype::F8_E4M3;
    });
    let msg = load_err(dir.path());
    assert_mentions(&msg, &[&format!("`{SHARDED_UP}`"), "dtype F8_E4M3", SHARD1]);
}

// --- damaged safetensors files ------------------------------------------------------------------

#[test]
fn truncated_file_is_reported_with_its_name() {
    for cut in [1, 100, 4096] {
        let dir = copy_fixture(VLM);
        let path = dir.path().join("model.safetensors");
        truncate(&path, file_len(&path) - cut);
        assert_load_error(dir.path(), "model.safetensors", &["truncated"]);
    }
}

#[test]
fn file_cut_inside_its_header_is_reported_with_its_name() {
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    let header = header_len(&path);
    for len in [8 + header - 1, 8 + header / 2, 9] {
        truncate(&path, len);
        assert_load_error(dir.path(), "model.safetensors", &["corrupt safetensors header", "truncated"]);
    }
}

#[test]
fn truncated_shard_is_named() {
    let dir = copy_fixture(SHARDED);
    let path = dir.path().join(SHARD2);
    truncate(&path, file_len(&path) / 2);
    assert_load_error(dir.path(), SHARD2, &["truncated"]);
}

#[test]
fn tiny_and_empty_files_are_not_safetensors() {
    for len in [3, 0, 7] {
        let dir = copy_fixture(VLM);
        truncate(&dir.path().join("model.safetensors"), len);
        assert_load_error(
            dir.path(),
            "model.safetensors",
            &["not a safetensors file", &format!("{len} bytes")],
        );
    }
}

#[test]
fn garbage_header_json_names_the_file() {
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    let mut bytes = fs::read(&path).unwrap();
    // Overwrite the start of the JSON header, keeping its declared length.
    bytes[8..8 + 20].copy_from_slice(b"this is not json! {{");
    fs::write(&path, &bytes).unwrap();
    assert_load_error(dir.path(), "model.safetensors", &["corrupt safetensors header", "JSON"]);

    // Not UTF-8 either.
    bytes[8..12].copy_from_slice(&[0xff, 0xfe, 0x80, 0x81]);
    fs::write(&path, &bytes).unwrap();
    assert_load_error(dir.path(), "model.safetensors", &["corrupt safetensors header", "UTF-8"]);
}

#[test]
fn header_length_past_the_end_of_the_file_names_the_file() {
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    let mut bytes = fs::read(&path).unwrap();
    let past_end = bytes.len() as u64 + 1000;
    bytes[..8].copy_from_slice(&past_end.to_le_bytes());
    fs::write(&path, &bytes).unwrap();
    assert_load_error(dir.path(), "model.safetensors", &["header", "past the end of the file"]);

    // Absurd lengths: beyond safetensors' header limit, and beyond what usize arithmetic holds.
    for huge in [1u64 << 40, u64::MAX, u64::MAX - 7] {
        bytes[..8].copy_from_slice(&huge.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        assert_load_error(dir.path(), "model.safetensors", &["header"]);
    }
}

/// Rewrites the JSON header of a safetensors file (the data section is kept as it is).
fn edit_header(path: &Path, f: impl FnOnce(&mut Value)) {
    let bytes = fs::read(path).unwrap();
    let n = header_len(path);
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut header);
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    fs::write(path, out).unwrap();
}

#[test]
fn inconsistent_header_entries_name_the_file() {
    // A shape that no longer matches the entry's byte range.
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    edit_header(&path, |h| h[VLM_UP]["shape"] = json!([64, 64]));
    assert_load_error(dir.path(), "model.safetensors", &[VLM_UP]);

    // Byte ranges that overlap.
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    edit_header(&path, |h| {
        let offsets = h[VLM_UP]["data_offsets"].clone();
        h[VLM_UP]["data_offsets"] = json!([offsets[0].as_u64().unwrap() + 4, offsets[1]]);
    });
    assert_load_error(dir.path(), "model.safetensors", &["offset"]);

    // A dtype the safetensors format does not define.
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    edit_header(&path, |h| h[VLM_UP]["dtype"] = json!("Q4_K"));
    assert_load_error(dir.path(), "model.safetensors", &["corrupt safetensors header", "Q4_K"]);

    // An entry that is not a tensor description at all.
    let dir = copy_fixture(VLM);
    let path = dir.path().join("model.safetensors");
    edit_header(&path, |h| h[VLM_UP] = json!("nope"));
    assert_load_error(dir.path(), "model.safetensors", &["corrupt safetensors header"]);
}

// --- config.json ----------------------------------------------------------------------------------

/// Loads `fixture` with `edit` applied to its text config; returns the error message, which
/// must name the config file.
fn config_err(fixture: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let dir = copy_fixture(fixture);
    edit_text_config(dir.path(), edit);
    assert_load_error(dir.path(), "config.json", &[])
}

/// A copy of `fixture` whose text config sets `key` to `value` fails to load with an error
/// naming config.json and mentioning every one of `parts`.
#[track_caller]
fn assert_refused(fixture: &str, key: &str, value: Value, parts: &[&str]) {
    let msg = config_err(fixture, |c| {
        c.insert(key.into(), value);
    });
    assert_mentions(&msg, parts);
}

#[test]
fn unknown_model_type_is_named() {
    for fixture in [VLM, SHARDED] {
        let dir = copy_fixture(fixture);
        edit_json(&dir.path().join("config.json"), |v| v["model_type"] = "llama".into());
        assert_load_error(dir.path(), "config.json", &["unknown model_type `llama`", "qwen3_5"]);
    }
    let dir = copy_fixture(SHARDED);
    edit_json(&dir.path().join("config.json"), |v| {
        v.as_object_mut().unwrap().remove("model_type");
    });
    assert_mentions(&load_err(dir.path()), &["config.json", "missing field `model_type`"]);

    // The multimodal type without its text config.
    let dir = copy_fixture(VLM);
    edit_json(&dir.path().join("config.json"), |v| {
        v.as_object_mut().unwrap().remove("text_config");
    });
    assert_mentions(&load_err(dir.path()), &["config.json", "qwen3_5", "`text_config`"]);
}

#[test]
fn missing_required_field_is_named() {
    for field in ["hidden_size", "num_attention_heads", "vocab_size", "linear_num_value_heads"] {
        for fixture in [VLM, SHARDED] {
            let msg = config_err(fixture, |c| {
                c.remove(field);
            });
            // Fields of the multimodal layout are named where they sit: under `text_config`.
            let scoped = if fixture == VLM { format!("text_config.{field}") } else { field.to_string() };
            assert_mentions(&msg, &[&format!("missing field `{scoped}`")]);
        }
    }
}

#[test]
fn wrongly_typed_field_is_named() {
    let non_negative = "non-negative integer";
    for (fixture, key, value, parts) in [
        (VLM, "hidden_size", json!("64"), &["`text_config.hidden_size`", non_negative, "\"64\""][..]),
        (SHARDED, "num_key_value_heads", json!(-2), &["`num_key_value_heads`", non_negative, "-2"]),
        (SHARDED, "intermediate_size", json!(96.5), &["`intermediate_size`", "96.5"]),
        (SHARDED, "rms_norm_eps", json!("tiny"), &["`rms_norm_eps`", "must be a number"]),
        (SHARDED, "tie_word_embeddings", json!("yes"), &["`tie_word_embeddings`", "true or false"]),
        (SHARDED, "layer_types", json!("linear_attention"), &["`layer_types`", "must be a list"]),
        (SHARDED, "eos_token_id", json!("<|im_end|>"), &["`eos_token_id`"]),
        (SHARDED, "hidden_size", json!(0), &["`hidden_size` must be positive"]),
    ] {
        assert_refused(fixture, key, value, parts);
    }
}

#[test]
fn inconsistent_head_counts_are_named() {
    for (fixture, key, named) in [
        (VLM, "num_attention_heads", ["num_attention_heads (3)", "num_key_value_heads (2)"]),
        (SHARDED, "num_key_value_heads", ["num_attention_heads (4)", "num_key_value_heads (3)"]),
        (VLM, "linear_num_value_heads", ["linear_num_value_heads (3)", "linear_num_key_heads (2)"]),
        (SHARDED, "linear_num_key_heads", ["linear_num_value_heads (4)", "linear_num_key_heads (3)"]),
    ] {
        assert_refused(fixture, key, json!(3), &["inconsistent head counts", named[0], named[1]]);
    }
}

#[test]
fn layer_types_must_match_the_layer_count() {
    assert_refused(
        VLM,
        "num_hidden_layers",
        json!(4),
        &["`layer_types` has 5 entries", "num_hidden_layers is 4"],
    );
    let msg = config_err(VLM, |c| {
        c["layer_types"].as_array_mut().unwrap().push(json!("full_attention"));
    });
    assert_mentions(&msg, &["`layer_types` has 6 entries", "num_hidden_layers is 5"]);
    let msg = config_err(VLM, |c| {
        c["layer_types"][2] = json!("mamba");
    });
    assert_mentions(&msg, &["layer_types[2]", "\"mamba\""]);
    assert_refused(
        SHARDED,
        "full_attention_interval",
        json!(0),
        &["`full_attention_interval` must be positive"],
    );
}

#[test]
fn other_config_errors_name_the_field() {
    let msg = config_err(SHARDED, |c| {
        c["rope_parameters"]["rope_type"] = json!("yarn");
    });
    assert_mentions(&msg, &["rope_type `yarn`"]);
    let msg = config_err(SHARDED, |c| {
        c["rope_parameters"]["partial_rotary_factor"] = json!(1.5);
    });
    assert_mentions(&msg, &["partial_rotary_factor", "1.5"]);
    let msg = config_err(SHARDED, |c| {
        c["rope_parameters"]["partial_rotary_factor"] = json!(0.1);
    });
    assert_mentions(&msg, &["partial_rotary_factor", "rotary dimension of 3"]);
    let msg = config_err(SHARDED, |c| {
        c["rope_parameters"]["rope_theta"] = json!(-1.0);
    });
    assert_mentions(&msg, &["`rope_theta` must be a positive number"]);
    assert_refused(SHARDED, "rms_norm_eps", json!(0.0), &["`rms_norm_eps` must be a positive number"]);
}

#[test]
fn absurd_sizes_are_errors_not_panics() {
    // Weight shapes are products of these fields: sizes whose products overflow (which would
    // panic in the model's shape arithmetic) are refused by the config check, and so is a layer
    // count that would allocate per-layer state for billions of layers.
    let linear = "sizes too large: linear_num_{key,value}_heads * linear_{key,value}_head_dim";
    for (field, expected) in [
        ("linear_key_head_dim", linear),
        ("linear_value_head_dim", linear),
        ("linear_num_key_heads", linear),
        ("linear_num_value_heads", linear),
        ("linear_conv_kernel_dim", linear),
        ("head_dim", "sizes too large: num_attention_heads * head_dim * hidden_size overflows"),
        ("num_attention_heads", "sizes too large: num_attention_heads * head_dim * hidden_size overflows"),
        ("num_key_value_heads", "sizes too large: num_key_value_heads * head_dim * hidden_size overflows"),
        ("intermediate_size", "sizes too large: intermediate_size * hidden_size overflows"),
        ("vocab_size", "sizes too large: vocab_size * hidden_size overflows"),
        ("hidden_size", "sizes too large: vocab_size * hidden_size overflows"),
        ("num_hidden_layers", "`num_hidden_layers` is 4611686018427387904"),
    ] {
        let dir = copy_fixture(SHARDED);
        edit_text_config(dir.path(), |c| {
            c.insert(field.into(), json!(1u64 << 62));
        });
        assert_load_error(dir.path(), "config.json", &[expected]);
    }

    // Large but not overflowing: the config passes, the weights do not match it.
    let dir = copy_fixture(SHARDED);
    edit_text_config(dir.path(), |c| {
        c.insert("linear_key_head_dim".into(), json!(1u64 << 30));
    });
    let msg = load_err(dir.path());
    assert_mentions(
        &msg,
        &[
            "`model.layers.0.linear_attn.conv1d.weight`",
            "shape [192, 1, 4]",
            "expected [8589934656, 1, 4]",
            SHARD1,
        ],
    );
}

#[test]
fn deleted_model_safetensors_is_an_error_naming_a_file() {
    // The fixture keeps goldens.safetensors beside the weights: with model.safetensors gone,
    // the fallback to "any *.safetensors" opens it, and no embedding is found there.
    let dir = copy_fixture(VLM);
    fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    assert_load_error(dir.path(), "goldens.safetensors", &["missing tensor", "embed_tokens.weight"]);
}

#[test]
fn broken_config_json_names_the_file() {
    let dir = copy_fixture(VLM);
    fs::write(dir.path().join("config.json"), "{\"model_type\": \"qwen3_5\", ").unwrap();
    assert_load_error(dir.path(), "config.json", &["invalid JSON"]);
    fs::write(dir.path().join("config.json"), "[1, 2, 3]").unwrap();
    assert_load_error(dir.path(), "config.json", &["JSON object"]);

    let dir = copy_fixture(VLM);
    fs::write(dir.path().join("generation_config.json"), "{\"eos_token_id\": [1, \"x\"]}").unwrap();
    assert_load_error(dir.path(), "generation_config.json", &["`eos_token_id`"]);
    fs::write(dir.path().join("generation_config.json"), "not json").unwrap();
    assert_load_error(dir.path(), "generation_config.json", &["invalid JSON"]);
}

// --- sharded checkpoints ------------------------------------------------------------------------

#[test]
fn index_naming_a_missing_shard_names_index_and_shard() {
    let dir = copy_fixture(SHARDED);
    let ghost = "model-00004-of-00003.safetensors";
    edit_json(&dir.path().join(INDEX), |v| v["weight_map"][SHARDED_UP] = ghost.into());
    assert_load_error(dir.path(), INDEX, &[ghost, "does not exist"]);
}

#[test]
fn deleted_shard_is_named() {
    let dir = copy_fixture(SHARDED);
    fs::remove_file(dir.path().join(SHARD2)).unwrap();
    assert_load_error(dir.path(), INDEX, &[&shown(dir.path(), SHARD2), "does not exist"]);
}

#[test]
fn index_listing_a_tensor_in_the_wrong_shard_is_named() {
    let dir = copy_fixture(SHARDED);
    edit_json(&dir.path().join(INDEX), |v| v["weight_map"][SHARDED_UP] = SHARD3.into());
    assert_load_error(dir.path(), INDEX, &[&format!("`{SHARDED_UP}`"), SHARD3, "does not hold it"]);

    // A tensor the index lists that no shard holds.
    let dir = copy_fixture(SHARDED);
    edit_tensors(&dir.path().join(SHARD1), |t| t.retain(|t| t.name != SHARDED_UP));
    assert_load_error(dir.path(), INDEX, &[&format!("`{SHARDED_UP}`"), SHARD1, "does not hold it"]);
}

#[test]
fn tensor_defined_in_two_shards_is_named() {
    let dir = copy_fixture(SHARDED);
    let up = read_tensors(&dir.path().join(SHARD1)).into_iter().find(|t| t.name == SHARDED_UP).unwrap();
    edit_tensors(&dir.path().join(SHARD2), |t| t.push(up));
    let msg = load_err(dir.path());
    assert_mentions(&msg, &[&format!("`{SHARDED_UP}`"), "more than one file", SHARD2]);
}

#[test]
fn broken_index_is_named() {
    let dir = copy_fixture(SHARDED);
    fs::write(dir.path().join(INDEX), "{\"weight_map\": {").unwrap();
    assert_load_error(dir.path(), INDEX, &["invalid JSON"]);
    fs::write(dir.path().join(INDEX), "{\"metadata\": {}}").unwrap();
    assert_load_error(dir.path(), INDEX, &["`weight_map`"]);
    fs::write(dir.path().join(INDEX), json!({"weight_map": {SHARDED_UP: 3}}).to_string()).unwrap();
    assert_load_error(dir.path(), INDEX, &[&format!("`{SHARDED_UP}`")]);
}

#[test]
fn index_with_unlisted_extra_shard_tensors_still_loads() {
    // Shards may hold tensors the index does not list (the index is a promise, not an inventory).
    let dir = copy_fixture(SHARDED);
    edit_tensors(&dir.path().join(SHARD3), |t| {
        t.push(Stored { name: "mtp.unlisted".into(), dtype: Dtype::U8, shape: vec![2], data: vec![0, 1] });
    });
    load(dir.path()).unwrap();
}

// --- directories ----------------------------------------------------------------------------------

#[test]
fn missing_config_json_is_named() {
    // Said once, of the directory, as what it is: not a model directory, for want of config.json.
    let dir = copy_fixture(VLM);
    fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load(dir.path()).err().expect("a directory without config.json loaded");
    assert!(matches!(err, strix::Error::NotAModel { .. }), "{err:?}");
    let msg = err.to_string();
    assert_mentions(&msg, &[&dir.path().display().to_string(), "not a model directory", "no config.json"]);
    assert!(!msg.contains("os error"), "{msg}");
}

#[test]
fn directory_without_weights_is_named() {
    let dir = tempfile::tempdir().unwrap();
    fs::copy(fixture(VLM).join("config.json"), dir.path().join("config.json")).unwrap();
    let msg = load_err(dir.path());
    assert_mentions(&msg, &[&dir.path().display().to_string(), "model.safetensors", "*.safetensors"]);
}

#[test]
fn nonexistent_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("no-such-model");
    let msg = load_err(&gone);
    assert_mentions(&msg, &[&gone.display().to_string()]);
}

#[test]
fn single_file_with_another_name_is_found() {
    // No model.safetensors and no index: the only *.safetensors file is the checkpoint.
    let dir = copy_fixture("causal-bf16-gdn3x");
    fs::remove_file(dir.path().join("goldens.safetensors")).unwrap();
    fs::rename(dir.path().join("model.safetensors"), dir.path().join("weights.safetensors")).unwrap();
    load(dir.path()).unwrap();
}

#[test]
fn several_unnamed_safetensors_files_are_ambiguous() {
    // Without model.safetensors or an index, two candidate files: refuse to guess.
    let dir = copy_fixture("causal-bf16-gdn3x");
    fs::rename(dir.path().join("model.safetensors"), dir.path().join("weights.safetensors")).unwrap();
    let msg = load_err(dir.path());
    assert_mentions(&msg, &["goldens.safetensors", "weights.safetensors", "ambiguous"]);
}

#[test]
fn error_paths_of_single_and_sharded_layouts_agree() {
    // The same damage reported the same way whichever layout holds the tensor.
    let mut shapes = BTreeMap::new();
    for (fixture, file, name) in [(VLM, "model.safetensors", VLM_UP), (SHARDED, SHARD1, SHARDED_UP)] {
        let dir = copy_fixture(fixture);
        edit_tensors(&dir.path().join(file), |t| find(t, name).shape = vec![64, 96]);
        let msg = assert_load_error(dir.path(), file, &[&format!("`{name}`")]);
        let tail = msg.split_once(&format!("`{name}`")).unwrap().1.to_string();
        shapes.insert(fixture, tail);
    }
    assert_eq!(shapes[VLM], shapes[SHARDED]);
}
