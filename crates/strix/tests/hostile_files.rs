//! Model files made to hurt the loaders, each refused with a message naming the file and
//! what is wrong, within seconds and within bounded memory:
//! - special files in place of a model's files (`/dev/zero`, `/dev/urandom`, FIFOs), files
//!   over their size cap, git-lfs pointers in place of the real files, paths that are no model;
//! - damaged GGUF files: overlapping tensor data, a tensor retyped to a smaller type,
//!   `block_count` disagreeing with the tensors, nonsense rotary dimensions, non-finite norms;
//! - `config.json` fields asking for what the model does not implement (`hidden_act: gelu`,
//!   `rope_parameters: []`, scaled RoPE, biases, rotary dimension 0);
//! - strings of files (keys, names, values) that would drive a terminal or flood a message.

mod damaged;

use std::fs;
use std::path::{Path, PathBuf};

use damaged::{
    assert_printable, copy_dir, gguf_layout, gguf_model, model_dir, put_u32, put_u64, rewrite_gguf,
    safetensors_from_parts, safetensors_parts, with_metadata, within,
};
use serde_json::{json, Value};
use strix::backend::cpu::CpuBackend;
use strix::chat::ChatTemplate;
use strix::checkpoint::Checkpoint;
use strix::files::{JSON_CAP, TEMPLATE_CAP, TOKENIZER_CAP};
use strix::gguf::{GgufArray, GgufFile, GgufValue};
use strix::model::{is_gguf_path, model_format, Model, ModelFormat};
use strix::quant::QuantType;
use strix::tokenizer::Tokenizer;
use strix::Error;

const SHARDED: &str = "causal-bf16-sharded";
const VLM: &str = "vlm-f32-gdn2x";
const BF16_GGUF: &str = "causal-bf16-gdn3x.bf16.gguf";
const LFS_POINTER: &str = "version https://git-lfs.github.com/spec/v1\n\
    oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1737418240\n";

fn load(path: &Path) -> strix::Result<Model<CpuBackend>> {
    Model::load_path(path, CpuBackend::new(), None)
}

/// The error loading `path` must give, within 10 s (a hang fails the test).
fn load_err(path: &Path) -> Error {
    let owned = path.to_path_buf();
    match within(10, &path.display().to_string(), move || load(&owned).err()) {
        Some(e) => e,
        None => panic!("{} loaded, but it is damaged", path.display()),
    }
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    assert_printable(msg);
    for part in parts {
        assert!(msg.contains(part), "error message lacks {part:?}:\n  {msg}");
    }
}

fn shown(path: &Path) -> String {
    path.display().to_string()
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    f(&mut value);
    fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

/// Replaces `file` of `dir` by a symlink to `target` (a device).
#[cfg(unix)]
fn replace_with_link(dir: &Path, file: &str, target: &str) -> PathBuf {
    let path = dir.join(file);
    let _ = fs::remove_file(&path);
    std::os::unix::fs::symlink(target, &path).unwrap();
    path
}

#[cfg(unix)]
fn replace_with_fifo(dir: &Path, file: &str) -> PathBuf {
    let path = dir.join(file);
    let _ = fs::remove_file(&path);
    damaged::mkfifo(&path);
    path
}

// --- special files -------------------------------------------------------------------------

/// `config.json` as `/dev/zero` or `/dev/urandom` read without end, and as a FIFO with no
/// writer blocked forever: each is refused from its metadata, at once.
#[cfg(unix)]
#[test]
fn special_files_in_place_of_config_json_are_refused_at_once() {
    for (target, kind) in [
        (Some("/dev/zero"), "a character device"),
        (Some("/dev/urandom"), "a character device"),
        (None, "a FIFO"),
    ] {
        let dir = copy_dir(SHARDED);
        let path = match target {
            Some(t) => replace_with_link(dir.path(), "config.json", t),
            None => replace_with_fifo(dir.path(), "config.json"),
        };
        let e = load_err(dir.path());
        assert!(matches!(e, Error::File { .. }), "{e:?}");
        assert_mentions(&e.to_string(), &[&shown(&path), kind, "not a regular file"]);
    }
}

/// Every other file a model is read from, as a FIFO: refused naming it, never waited on.
#[cfg(unix)]
#[test]
fn fifos_in_place_of_any_model_file_are_refused_at_once() {
    type Reader = fn(&Path) -> Option<Error>;
    let cases: [(&str, &str, Reader); 8] = [
        (SHARDED, "generation_config.json", |d| load(d).err()),
        (SHARDED, "model.safetensors.index.json", |d| load(d).err()),
        (SHARDED, "model-00002-of-00003.safetensors", |d| load(d).err()),
        (VLM, "model.safetensors", |d| load(d).err()),
        (SHARDED, "tokenizer.json", |d| Tokenizer::from_model_dir(d).err()),
        (SHARDED, "tokenizer_config.json", |d| ChatTemplate::from_model_dir(d).err()),
        (SHARDED, "chat_template.jinja", |d| ChatTemplate::from_model_dir(d).err()),
        (SHARDED, "config.json", |d| model_format(d).err()),
    ];
    for (fixture, file, read) in cases {
        let dir = copy_dir(fixture);
        let path = replace_with_fifo(dir.path(), file);
        let owned = dir.path().to_path_buf();
        let e = within(10, file, move || read(&owned)).unwrap_or_else(|| panic!("{file}: a FIFO was read"));
        assert_mentions(&e.to_string(), &[&shown(&path), "a FIFO", "not a regular file"]);
    }
    // A GGUF file given by path: as a FIFO it is recognised by its name, then refused; one
    // without the extension is not taken for GGUF, and deciding so does not open it.
    let tmp = tempfile::tempdir().unwrap();
    let gguf = replace_with_fifo(tmp.path(), "model.gguf");
    assert!(within(10, "is_gguf_path", move || is_gguf_path(&gguf)));
    let gguf = tmp.path().join("model.gguf");
    assert_mentions(&load_err(&gguf).to_string(), &[&shown(&gguf), "a FIFO"]);
    let bare = replace_with_fifo(tmp.path(), "model");
    assert!(!within(10, "is_gguf_path", move || is_gguf_path(&bare)));
    let bare = tmp.path().join("model");
    assert_mentions(&load_err(&bare).to_string(), &[&shown(&bare), "a FIFO"]);
    // Weights as a device.
    let dir = copy_dir(VLM);
    let path = replace_with_link(dir.path(), "model.safetensors", "/dev/zero");
    assert_mentions(&load_err(dir.path()).to_string(), &[&shown(&path), "a character device"]);
}

/// Text files over their cap are refused by their size, before a byte is read (sparse files:
/// the test writes nothing); files within the cap still load.
#[test]
fn text_files_over_their_size_cap_are_refused() {
    let sparse = |path: &Path, len: u64| {
        let f = fs::OpenOptions::new().write(true).create(true).truncate(true).open(path).unwrap();
        f.set_len(len).unwrap();
    };
    let dir = copy_dir(SHARDED);
    let config = dir.path().join("config.json");
    sparse(&config, JSON_CAP.bytes + 1);
    let e = load_err(dir.path());
    assert!(matches!(e, Error::File { .. }), "{e:?}");
    assert_mentions(
        &e.to_string(),
        &[&shown(&config), "larger than the 16777216 bytes a JSON file may have"],
    );

    let dir = copy_dir(SHARDED);
    let tokenizer = dir.path().join("tokenizer.json");
    sparse(&tokenizer, TOKENIZER_CAP.bytes + 1);
    let e = Tokenizer::from_model_dir(dir.path()).unwrap_err();
    assert_mentions(&e.to_string(), &[&shown(&tokenizer), "larger than the 67108864 bytes a tokenizer.json"]);

    let template = dir.path().join("chat_template.jinja");
    sparse(&template, TEMPLATE_CAP.bytes + 1);
    let e = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
    assert_mentions(&e.to_string(), &[&shown(&template), "chat template"]);
    // At the cap exactly: read.
    let mut text = "{{ messages[0].content }}".to_string();
    text.push_str(&" ".repeat(TEMPLATE_CAP.bytes as usize - text.len()));
    fs::write(&template, text).unwrap();
    assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_some());
}

/// A clone made without git-lfs leaves ~130-byte pointer files in place of the large files:
/// each says so and how to fetch the real one (before: "header too large").
#[test]
fn git_lfs_pointers_say_to_fetch_the_real_file() {
    let check = |e: Error, path: &Path| {
        assert!(matches!(e, Error::File { .. }), "{e:?}");
        assert_mentions(
            &e.to_string(),
            &[&shown(path), "git-lfs pointer", "1737418240 bytes", "git lfs pull"],
        );
    };
    let dir = copy_dir(VLM);
    let weights = dir.path().join("model.safetensors");
    fs::write(&weights, LFS_POINTER).unwrap();
    check(load_err(dir.path()), &weights);

    let dir = copy_dir(SHARDED);
    let shard = dir.path().join("model-00003-of-00003.safetensors");
    fs::write(&shard, LFS_POINTER).unwrap();
    check(load_err(dir.path()), &shard);

    let tokenizer = dir.path().join("tokenizer.json");
    fs::write(&tokenizer, LFS_POINTER).unwrap();
    check(Tokenizer::from_model_dir(dir.path()).unwrap_err(), &tokenizer);

    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("model.gguf");
    fs::write(&gguf, LFS_POINTER).unwrap();
    check(load_err(&gguf), &gguf);
    check(model_format(&gguf).unwrap_err(), &gguf);
}

/// What a path given as a model is, told before anything is loaded: a directory without
/// config.json is not a model directory (once, without an OS error), a text file is neither
/// kind of model.
#[test]
fn paths_that_are_not_models_are_named_as_such() {
    assert_eq!(model_format(&model_dir(SHARDED)).unwrap(), ModelFormat::Directory);
    assert_eq!(model_format(&gguf_model(BF16_GGUF)).unwrap(), ModelFormat::Gguf);

    let tmp = tempfile::tempdir().unwrap();
    for e in [model_format(tmp.path()).unwrap_err(), load_err(tmp.path())] {
        assert!(matches!(e, Error::NotAModel { .. }), "{e:?}");
        let msg = e.to_string();
        assert_mentions(&msg, &[&shown(tmp.path()), "not a model directory", "no config.json"]);
        assert!(!msg.contains("os error"), "{msg}");
    }
    let text = tmp.path().join("notes.txt");
    fs::write(&text, "hello").unwrap();
    for e in [model_format(&text).unwrap_err(), load_err(&text)] {
        assert!(matches!(e, Error::NotAModel { .. }), "{e:?}");
        assert_mentions(&e.to_string(), &[&shown(&text), "not a model", "model directory"]);
    }
    let gone = tmp.path().join("gone");
    assert!(matches!(model_format(&gone), Err(Error::Io { .. })));
}

// --- damaged GGUF files --------------------------------------------------------------------

fn gguf_bytes() -> Vec<u8> {
    fs::read(gguf_model(BF16_GGUF)).unwrap()
}

fn write_tmp(tmp: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = tmp.path().join(name);
    fs::write(&path, bytes).unwrap();
    path
}

/// Two tensors pointing at the same bytes: each is in bounds, together they are corrupt.
#[test]
fn gguf_tensors_with_overlapping_data_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = gguf_bytes();
    let layout = gguf_layout(&b);
    let up = layout.tensor("blk.0.ffn_up.weight");
    let gate = layout.tensor("blk.0.ffn_gate.weight");
    let gate_offset = u64::from_le_bytes(b[gate.offset_at..gate.offset_at + 8].try_into().unwrap());
    put_u64(&mut b, up.offset_at, gate_offset);
    let path = write_tmp(&tmp, "overlap.gguf", &b);
    let e = GgufFile::open(&path).unwrap_err();
    assert_mentions(
        &e.to_string(),
        &[&shown(&path), "`blk.0.ffn_up.weight`", "overlaps", "`blk.0.ffn_gate.weight`"],
    );
}

/// A BF16 matrix retyped as Q8_0 (the same dims, so its byte range is consistent and in
/// bounds, only shorter) would read its weights out of BF16 bytes: refused, as llama.cpp
/// refuses it, for a tensor in the middle of the file and for the last one.
#[test]
fn gguf_tensor_retyped_to_a_smaller_type_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["blk.2.ffn_up.weight", "token_embd.weight", "blk.3.attn_v.weight"] {
        let mut b = gguf_bytes();
        let t = gguf_layout(&b).tensor(name).clone();
        put_u32(&mut b, t.type_at, QuantType::Q8_0.id());
        let path = write_tmp(&tmp, "retyped.gguf", &b);
        let e = load_err(&path);
        assert_mentions(&e.to_string(), &[&shown(&path), &format!("`{name}` (Q8_0"), "type or dims"]);
    }
    // The last tensor of the data section, retyped: the bytes after it are no tensor's.
    let mut b = gguf_bytes();
    let t = gguf_layout(&b).tensor("output_norm.weight").clone();
    put_u32(&mut b, t.type_at, QuantType::F16.id());
    let path = write_tmp(&tmp, "last.gguf", &b);
    let e = load_err(&path);
    assert_mentions(
        &e.to_string(),
        &[&shown(&path), "`output_norm.weight` (F16", "last tensor", "bytes follow"],
    );

    // Laid out consistently, a norm stored in a block type is still refused by its role.
    let path = tmp.path().join("q8-norm.gguf");
    rewrite_gguf(
        &gguf_model(BF16_GGUF),
        &path,
        |_, v| Some(v.clone()),
        |n, ty, b| {
            if n == "blk.0.attn_norm.weight" {
                let x: Vec<f32> =
                    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
                Some((QuantType::Q8_0, strix::gguf::qwen35::encode(QuantType::Q8_0, &x).unwrap()))
            } else {
                Some((ty, b))
            }
        },
    );
    let e = load_err(&path);
    assert_mentions(&e.to_string(), &[&shown(&path), "`blk.0.attn_norm.weight` is Q8_0", "1-D", "F32"]);
}

/// `block_count` smaller than the layers the tensors hold would drop layers silently; larger,
/// the file lacks layers. llama.cpp refuses both ("wrong number of tensors").
#[test]
fn gguf_block_count_must_match_the_layers_of_the_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("fewer.gguf");
    with_metadata(&gguf_model(BF16_GGUF), &path, "qwen35.block_count", GgufValue::U32(3));
    let e = load_err(&path);
    assert_mentions(
        &e.to_string(),
        &[&shown(&path), "`blk.3.", "layer 3", "qwen35.block_count is 3", "wrong number of tensors"],
    );

    let path = tmp.path().join("more.gguf");
    with_metadata(&gguf_model(BF16_GGUF), &path, "qwen35.block_count", GgufValue::U32(6));
    let e = load_err(&path);
    assert_mentions(
        &e.to_string(),
        &[&shown(&path), "6 decoder layers", "no tensor of layer 4", "wrong number"],
    );

    // The same through the byte in place (no rewrite): the check does not depend on the writer.
    let mut b = gguf_bytes();
    let at = gguf_layout(&b).kv("qwen35.block_count").value_at;
    put_u32(&mut b, at, 2);
    let path = write_tmp(&tmp, "two.gguf", &b);
    assert_mentions(&load_err(&path).to_string(), &["qwen35.block_count is 2"]);
}

/// The rotary dimension must be even, positive and within the head: 0 (RoPE silently off),
/// odd, or past head_dim are refused.
#[test]
fn gguf_rotary_dimension_must_make_sense() {
    let tmp = tempfile::tempdir().unwrap();
    for dim in [0u32, 7, 34] {
        let path = tmp.path().join(format!("rot{dim}.gguf"));
        with_metadata(&gguf_model(BF16_GGUF), &path, "qwen35.rope.dimension_count", GgufValue::U32(dim));
        let e = load_err(&path);
        assert_mentions(
            &e.to_string(),
            &[&shown(&path), &format!("rotary dimension of {dim} for head_dim 32"), "even, positive"],
        );
    }
}

/// A NaN or infinity in a norm poisons every logit: the small tensors, read whole at load, are
/// checked (matrices are not scanned; non-finite logits are caught where tokens are drawn).
#[test]
fn non_finite_vector_weights_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for (bad, name) in [(f32::NAN, "output_norm.weight"), (f32::INFINITY, "blk.1.attn_q_norm.weight")] {
        let path = tmp.path().join("nan.gguf");
        rewrite_gguf(
            &gguf_model(BF16_GGUF),
            &path,
            |_, v| Some(v.clone()),
            |n, ty, mut b| {
                if n == name {
                    b[4..8].copy_from_slice(&bad.to_le_bytes());
                }
                Some((ty, b))
            },
        );
        let e = load_err(&path);
        assert_mentions(&e.to_string(), &[&shown(&path), &format!("`{name}` holds {bad} at index 1")]);
    }

    // The same in a safetensors checkpoint (f32 fixture).
    let dir = copy_dir(VLM);
    let weights = dir.path().join("model.safetensors");
    let (header, mut data) = safetensors_parts(&fs::read(&weights).unwrap());
    let name = "model.language_model.layers.1.input_layernorm.weight";
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    data[start + 8..start + 12].copy_from_slice(&f32::NAN.to_le_bytes());
    fs::write(&weights, safetensors_from_parts(&header, &data)).unwrap();
    let e = load_err(dir.path());
    assert_mentions(&e.to_string(), &[&shown(&weights), &format!("`{name}` holds NaN at index 2")]);
}

// --- config.json -----------------------------------------------------------------------------

/// Loads a copy of a fixture whose text config `edit` changed; returns the error message.
fn config_err(fixture: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let dir = copy_dir(fixture);
    edit_json(&dir.path().join("config.json"), |v| {
        let text = if v.get("text_config").is_some() { &mut v["text_config"] } else { v };
        edit(text.as_object_mut().unwrap());
    });
    let e = load_err(dir.path());
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
    let msg = e.to_string();
    assert_mentions(&msg, &[&shown(&dir.path().join("config.json"))]);
    msg
}

/// Fields asking for what the forward pass does not do are refused, not ignored; both
/// layouts name the field where it is written.
#[test]
fn config_fields_the_model_does_not_implement_are_refused() {
    let msg = config_err(SHARDED, |c| {
        c.insert("hidden_act".into(), json!("gelu"));
    });
    assert_mentions(&msg, &["`hidden_act` is `gelu`", "silu"]);
    let msg = config_err(VLM, |c| {
        c.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
    });
    assert_mentions(&msg, &["`text_config.hidden_act` is `gelu_pytorch_tanh`"]);
    let msg = config_err(SHARDED, |c| {
        c.insert("hidden_act".into(), json!(7));
    });
    assert_mentions(&msg, &["`hidden_act` must be a string, got 7"]);
    let msg = config_err(SHARDED, |c| {
        c.insert("attention_bias".into(), json!(true));
    });
    assert_mentions(&msg, &["`attention_bias` is true", "not implemented"]);
    let msg = config_err(SHARDED, |c| {
        c.insert("attn_output_gate".into(), json!(false));
    });
    assert_mentions(&msg, &["`attn_output_gate` is false"]);
    let msg = config_err(SHARDED, |c| {
        c.insert("rope_scaling".into(), json!({"rope_type": "yarn", "factor": 4.0}));
    });
    assert_mentions(&msg, &["`rope_scaling` asks for `yarn` RoPE scaling", "only unscaled"]);
    // `rope_scaling: null` (as many configs write it) is no request.
    let dir = copy_dir(SHARDED);
    edit_json(&dir.path().join("config.json"), |v| v["rope_scaling"] = Value::Null);
    load(dir.path()).unwrap();
}

/// `rope_parameters` of the wrong type fell back to theta 10000 silently; now it is an error,
/// and so is a rotary dimension of 0 (a factor that rounds to no dimension).
#[test]
fn rope_parameters_of_the_wrong_shape_are_refused() {
    for (value, shown) in [(json!([]), "[]"), (json!("default"), "\"default\""), (json!(10000), "10000")] {
        let msg = config_err(SHARDED, |c| {
            c.insert("rope_parameters".into(), value);
        });
        assert_mentions(&msg, &[&format!("field `rope_parameters` must be an object, got {shown}")]);
    }
    let msg = config_err(VLM, |c| {
        c.insert("rope_parameters".into(), json!([]));
    });
    assert_mentions(&msg, &["`text_config.rope_parameters` must be an object"]);
    let msg = config_err(SHARDED, |c| {
        c["rope_parameters"]["rope_type"] = json!(["default"]);
    });
    assert_mentions(&msg, &["`rope_parameters.rope_type` must be a string"]);
    let msg = config_err(SHARDED, |c| {
        c["rope_parameters"]["partial_rotary_factor"] = json!(0.01);
    });
    assert_mentions(&msg, &["rotary dimension of 0 for head_dim 32", "even, positive"]);
}

// --- what messages quote ---------------------------------------------------------------------

/// Terminal escape sequences in a GGUF string reach the message escaped; a 740-byte binary
/// key is cut; an array of the wrong element type is described by type and length.
#[test]
fn strings_from_gguf_files_reach_messages_escaped_and_capped() {
    let tmp = tempfile::tempdir().unwrap();
    let evil = "\x1b[2J\x1b]0;pwned\x07llama\u{202e}";
    let path = tmp.path().join("arch.gguf");
    with_metadata(&gguf_model(BF16_GGUF), &path, "general.architecture", evil);
    let msg = load_err(&path).to_string();
    assert_mentions(&msg, &["general.architecture is `\\x1b[2J\\x1b]0;pwned\\x07llama\\u{202e}`"]);

    // A metadata value type changed from string to an unknown id: the parser stops at a key
    // that is the binary bytes after it.
    let b = gguf_bytes();
    let key = [&b"x"[..], &[0x1b, b'['][..], &[1u8; 737][..]].concat();
    let kv = gguf_layout(&b).kv("general.name").clone();
    let mut crafted = b[..kv.key_at].to_vec();
    crafted.extend((key.len() as u64).to_le_bytes());
    crafted.extend(&key);
    crafted.extend(77u32.to_le_bytes());
    crafted.extend(&b[kv.end..]);
    let path = write_tmp(&tmp, "binary-key.gguf", &crafted);
    let msg = GgufFile::open(&path).unwrap_err().to_string();
    assert_mentions(&msg, &[&shown(&path), "unknown value type 77", "(740 bytes in all)"]);
    assert!(msg.len() < shown(&path).len() + 900, "{} bytes: {msg}", msg.len());

    // Arrays of an unexpected element type: type and length, never the contents.
    let junk = GgufValue::Array(GgufArray::U8((0..=255u8).cycle().take(740).collect()));
    let mut meta = GgufFile::open(gguf_model(BF16_GGUF)).unwrap().metadata_entries().to_vec();
    meta.push(("qwen35.rope.scaling.type".into(), junk.clone()));
    let scaled = tmp.path().join("scaled.gguf");
    write_with_metadata(&gguf_model(BF16_GGUF), &scaled, meta);
    let msg = load_err(&scaled).to_string();
    assert_mentions(&msg, &["qwen35.rope.scaling.type is array of u8 (740 elements)"]);
    assert!(msg.len() < 400, "{msg}");

    let tokens = tmp.path().join("tokens.gguf");
    with_metadata(&gguf_model(BF16_GGUF), &tokens, "tokenizer.ggml.tokens", junk);
    let msg = Tokenizer::from_gguf(&GgufFile::open(&tokens).unwrap()).unwrap_err().to_string();
    assert_mentions(
        &msg,
        &["tokenizer.ggml.tokens", "array of u8 (740 elements)", "expected array of string"],
    );
    assert!(msg.len() < 400, "{msg}");

    // A tensor name with an escape sequence (of the same length, so nothing else moves),
    // quoted by the error about its type.
    let mut b = gguf_bytes();
    let t = gguf_layout(&b).tensor("blk.0.ffn_up.weight").clone();
    let evil = b"\x1b[31mblk.0.ffn_upxx";
    assert_eq!(evil.len(), t.name.len());
    b[t.name_at + 8..t.name_at + 8 + evil.len()].copy_from_slice(evil);
    put_u32(&mut b, t.type_at, 99);
    let path = write_tmp(&tmp, "name.gguf", &b);
    let msg = GgufFile::open(&path).unwrap_err().to_string();
    assert_mentions(&msg, &[&shown(&path), "tensor `\\x1b[31mblk.0.ffn_upxx`: unknown GGML type id 99"]);
}

/// Writes `src`'s tensors with exactly the metadata `meta`.
fn write_with_metadata(src: &Path, out: &Path, meta: Vec<(String, GgufValue)>) {
    let f = GgufFile::open(src).unwrap();
    let mut w = strix::gguf::GgufWriter::new();
    for (k, v) in meta {
        w.add_metadata(&k, v).unwrap();
    }
    for t in f.tensors() {
        w.add_tensor(&t.name, &t.dims, t.ty, f.tensor_bytes(&t.name).unwrap().to_vec()).unwrap();
    }
    w.write(out).unwrap();
}

/// JSON strings of config.json, a safetensors header and the shard index reach messages
/// escaped and capped; a shard name leading out of the model directory is refused.
#[test]
fn strings_from_json_files_reach_messages_escaped_and_capped() {
    let long = format!("\x1b[31m{}", "q".repeat(100_000));
    let dir = copy_dir(SHARDED);
    edit_json(&dir.path().join("config.json"), |v| v["model_type"] = json!(long));
    let msg = load_err(dir.path()).to_string();
    assert_mentions(&msg, &["unknown model_type `\\x1b[31mqqq", "(100005 bytes in all)"]);
    assert!(msg.len() < 600, "{} bytes", msg.len());

    let msg = config_err(SHARDED, |c| {
        c.insert("layer_types".into(), json!([long, "x", "y", "z", "w", "v"]));
    });
    assert_mentions(&msg, &["layer_types[0] is \"\\u001b[31mqqq", "bytes in all"]);
    assert!(msg.len() < 600, "{} bytes", msg.len());

    // A tensor of a safetensors header whose dtype and shape disagree with its offsets.
    let dir = copy_dir(VLM);
    let weights = dir.path().join("model.safetensors");
    let (mut header, data) = safetensors_parts(&fs::read(&weights).unwrap());
    let name = "model.language_model.norm.weight";
    let entry = header.as_object_mut().unwrap().remove(name).unwrap();
    let evil = "\x1b]52;c;ZXZpbA==\x07norm";
    header[evil] = entry;
    header[evil]["shape"] = json!([7]);
    fs::write(&weights, safetensors_from_parts(&header, &data)).unwrap();
    let msg = load_err(dir.path()).to_string();
    assert_mentions(&msg, &[&shown(&weights), "tensor `\\x1b]52;c;ZXZpbA==\\x07norm`"]);

    // Shard names of the index: never outside the directory, escaped when quoted.
    for (shard, quoted) in [
        ("../../../etc/passwd", "../../../etc/passwd"),
        ("/etc/passwd", "/etc/passwd"),
        ("sub/model.safetensors", "sub/model.safetensors"),
        ("..", ".."),
        ("\x1b[8mhidden.safetensors", "\\x1b[8mhidden.safetensors"),
    ] {
        let dir = copy_dir(SHARDED);
        let index = dir.path().join("model.safetensors.index.json");
        edit_json(&index, |v| v["weight_map"]["model.norm.weight"] = json!(shard));
        let msg = load_err(dir.path()).to_string();
        if shard.starts_with('\x1b') {
            assert_mentions(&msg, &[&shown(&index), quoted]);
        } else {
            assert_mentions(
                &msg,
                &[&shown(&index), &format!("`{quoted}`"), "not the name of a file in the model directory"],
            );
        }
    }

    // The tokenizer parser's message quoting the file.
    let dir = copy_dir(SHARDED);
    let tokenizer = dir.path().join("tokenizer.json");
    edit_json(&tokenizer, |v| v["model"]["type"] = json!("\x1b[5mBPE"));
    let msg = Tokenizer::from_model_dir(dir.path()).unwrap_err().to_string();
    assert_mentions(&msg, &[&shown(&tokenizer)]);

    // Checkpoint::open_files quotes tensor names it finds twice.
    let dir = copy_dir(SHARDED);
    let a = dir.path().join("model-00001-of-00003.safetensors");
    let (header, data) = safetensors_parts(&fs::read(&a).unwrap());
    let b = dir.path().join("copy.safetensors");
    fs::write(&b, safetensors_from_parts(&header, &data)).unwrap();
    let e = Checkpoint::open_files(&[a, b.clone()]).err().unwrap();
    assert_mentions(&e.to_string(), &[&shown(&b), "is defined in more than one file"]);
}

/// Found by `mutated_files.rs`: an index with an empty `weight_map` opened no file, and the
/// missing embedding was then reported naming none.
#[test]
fn an_index_listing_no_tensor_is_named() {
    let dir = copy_dir(SHARDED);
    let index = dir.path().join("model.safetensors.index.json");
    edit_json(&index, |v| v["weight_map"] = json!({}));
    assert_mentions(&load_err(dir.path()).to_string(), &[&shown(&index), "`weight_map` lists no tensors"]);
}

/// A template's own error (`raise_exception`) is the template's text, from a file: shown
/// escaped like any file's string.
#[test]
fn template_errors_quoting_the_template_are_escaped() {
    let dir = copy_dir(SHARDED);
    let template = dir.path().join("chat_template.jinja");
    fs::write(&template, "{{ raise_exception('\x1b[2J\x1b]0;pwned\x07 roles must alternate') }}").unwrap();
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
    let e = t.render(&[strix::chat::ChatMessage::user("hi")], &Default::default()).unwrap_err();
    let Error::Template(raw) = &e else { panic!("{e:?}") };
    assert!(raw.contains('\x1b'), "the raised message is passed on as written: {raw:?}");
    assert_mentions(&e.to_string(), &["\\x1b[2J\\x1b]0;pwned\\x07 roles must alternate"]);
}
