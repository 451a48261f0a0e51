//! Reading and writing GGUF files.
//!
//! `tests/fixtures/gguf/fixture.gguf` and `aligned64.gguf` were written by the `gguf` PyPI
//! package's `GGUFWriter` (`scripts/make_gguf_fixtures.py`); `fixture.json` says what they hold
//! as read back by the package's `GGUFReader`, and `fixture_values.safetensors` every tensor
//! dequantized by the package. strix must read every metadata value and tensor info exactly,
//! dequantize every tensor bit for bit, and write the same files byte for byte.
//!
//! Broken files (truncated anywhere, bad magic or version, impossible counts, lengths, types,
//! dimensions or offsets, random corruption) must give an error that names the file and the
//! fault, never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::Value;
use strix::gguf::{GgufArray, GgufFile, GgufValue, GgufWriter};
use strix::quant::{self, QuantType};
use strix::Error;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
}

fn expectations() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("fixture.json")).unwrap()).unwrap()
}

fn expected_file(name: &str) -> Value {
    expectations()["files"].as_array().unwrap().iter().find(|f| f["file"] == name).unwrap().clone()
}

// --- JSON expectations → values ------------------------------------------------------------

fn scalar(ty: &str, v: &Value) -> GgufValue {
    let int = || v.as_i64().unwrap();
    let text = || v.as_str().unwrap();
    match ty {
        "u8" => GgufValue::U8(int() as u8),
        "i8" => GgufValue::I8(int() as i8),
        "u16" => GgufValue::U16(int() as u16),
        "i16" => GgufValue::I16(int() as i16),
        "u32" => GgufValue::U32(int() as u32),
        "i32" => GgufValue::I32(int() as i32),
        "u64" => GgufValue::U64(text().parse().unwrap()),
        "i64" => GgufValue::I64(text().parse().unwrap()),
        "f32" => GgufValue::F32(f32::from_bits(v.as_u64().unwrap() as u32)),
        "f64" => GgufValue::F64(f64::from_bits(text().parse().unwrap())),
        "bool" => GgufValue::Bool(v.as_bool().unwrap()),
        "string" => GgufValue::String(text().to_string()),
        t => panic!("type {t}"),
    }
}

fn array(desc: &Value) -> GgufArray {
    let ty = desc["element_type"].as_str().unwrap();
    let items = desc["value"].as_array().unwrap();
    if ty == "array" {
        return GgufArray::Array(items.iter().map(array).collect());
    }
    let vals: Vec<GgufValue> = items.iter().map(|v| scalar(ty, v)).collect();
    macro_rules! collect {
        ($v:ident) => {
            GgufArray::$v(
                vals.into_iter()
                    .map(|x| match x {
                        GgufValue::$v(x) => x,
                        _ => unreachable!(),
                    })
                    .collect(),
            )
        };
    }
    match ty {
        "u8" => collect!(U8),
        "i8" => collect!(I8),
        "u16" => collect!(U16),
        "i16" => collect!(I16),
        "u32" => collect!(U32),
        "i32" => collect!(I32),
        "u64" => collect!(U64),
        "i64" => collect!(I64),
        "f32" => collect!(F32),
        "f64" => collect!(F64),
        "bool" => collect!(Bool),
        "string" => collect!(String),
        t => panic!("element type {t}"),
    }
}

fn value(desc: &Value) -> GgufValue {
    match desc["type"].as_str().unwrap() {
        "array" => GgufValue::Array(array(desc)),
        ty => scalar(ty, &desc["value"]),
    }
}

fn values_file() -> Vec<u8> {
    std::fs::read(fixture("fixture_values.safetensors")).unwrap()
}

// --- reading what GGUFWriter wrote ----------------------------------------------------------

fn check_against_expectations(name: &str) {
    let path = fixture(name);
    let want = expected_file(name);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version() as u64, want["version"].as_u64().unwrap());
    assert_eq!(f.alignment() as u64, want["alignment"].as_u64().unwrap());
    assert_eq!(f.data_offset() as u64, want["data_offset"].as_u64().unwrap());

    let meta = want["metadata"].as_array().unwrap();
    let keys: Vec<&str> = f.metadata_entries().iter().map(|(k, _)| k.as_str()).collect();
    let want_keys: Vec<&str> = meta.iter().map(|m| m["key"].as_str().unwrap()).collect();
    assert_eq!(keys, want_keys, "{name}: metadata keys in file order");
    for m in meta {
        let key = m["key"].as_str().unwrap();
        let got = f.metadata(key).unwrap();
        let expected = value(m);
        // PartialEq on floats is fine: the fixture has no NaN; bits are compared anyway.
        assert_eq!(got, &expected, "{name}: `{key}`");
        if let (GgufValue::F32(a), GgufValue::F32(b)) = (got, &expected) {
            assert_eq!(a.to_bits(), b.to_bits(), "{key}");
        }
    }

    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(f.tensors().len(), tensors.len());
    for (info, t) in f.tensors().iter().zip(tensors) {
        assert_eq!(info.name, t["name"].as_str().unwrap());
        assert_eq!(info.ty.name(), t["type"].as_str().unwrap(), "{}", info.name);
        let dims: Vec<u64> = t["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(info.dims, dims, "{}", info.name);
        assert_eq!(info.offset, t["offset"].as_u64().unwrap(), "{}", info.name);
        assert_eq!(info.n_bytes() as u64, t["n_bytes"].as_u64().unwrap(), "{}", info.name);
        assert_eq!(info.range.start, f.data_offset() + info.offset as usize);
        assert_eq!(info.range.start % f.alignment(), 0);
        assert_eq!(f.tensor_bytes(&info.name).unwrap().len(), info.n_bytes());
    }
}

#[test]
fn reads_every_metadata_value_and_tensor_info() {
    check_against_expectations("fixture.gguf");
}

#[test]
fn reads_a_file_with_custom_alignment() {
    check_against_expectations("aligned64.gguf");
    let f = GgufFile::open(fixture("aligned64.gguf")).unwrap();
    assert_eq!(f.alignment(), 64);
    assert!(f.tensors().iter().all(|t| t.offset % 64 == 0 && t.range.start % 64 == 0));
}

#[test]
fn dequantizes_every_tensor_bit_exactly() {
    let bytes = values_file();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut seen = 0;
    for file in ["fixture.gguf", "aligned64.gguf"] {
        let f = GgufFile::open(fixture(file)).unwrap();
        for info in f.tensors() {
            let want = st.tensor(&info.name).unwrap();
            assert_eq!(info.shape(), want.shape(), "{}: row-major shape", info.name);
            let got = f.tensor_f32(&info.name).unwrap();
            let want: Vec<f32> =
                want.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{} ({}) element {i}: {g} vs {w}", info.name, info.ty);
            }
            seen += 1;
        }
    }
    assert_eq!(seen, st.len());
    // Every type strix dequantizes is in the fixture.
    let f = GgufFile::open(fixture("fixture.gguf")).unwrap();
    for ty in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"] {
        assert!(f.tensors().iter().any(|t| t.ty.name() == ty), "no {ty} tensor");
    }
}

#[test]
fn tensor_shapes_and_views() {
    let f = GgufFile::open(fixture("fixture.gguf")).unwrap();
    let t = f.tensor_info("q4_k.mat").unwrap();
    assert_eq!(
        (t.dims.clone(), t.shape(), t.row_len(), t.n_rows(), t.n_elements()),
        (vec![512, 3], vec![3, 512], 512, 3, 1536)
    );
    let s = f.tensor_info("f32.scalar").unwrap();
    assert_eq!((s.dims.len(), s.shape(), s.row_len(), s.n_rows(), s.n_elements()), (0, vec![], 1, 1, 1));
    assert_eq!(f.tensor_f32("f32.scalar").unwrap(), vec![2.5]);
    assert_eq!(f.tensor_info("f32.cube").unwrap().shape(), vec![2, 3, 4]);

    let h = f.host_tensor("bf16.mat").unwrap();
    assert_eq!((h.dtype, h.shape.clone()), (strix::tensor::DType::BF16, vec![7, 5]));
    assert_eq!(h.to_f32_vec(), f.tensor_f32("bf16.mat").unwrap());
    // Block formats come out packed, and dequantize to what the file's reader gives.
    let q = f.host_tensor("q4_k.mat").unwrap();
    assert_eq!((q.dtype, q.shape.clone()), (strix::tensor::DType::Q4_K, vec![3, 512]));
    q.check_matrix(3, 512).unwrap();
    assert!(q.check_matrix(512, 3).is_err());
    assert_eq!(q.to_f32_vec(), f.tensor_f32("q4_k.mat").unwrap());

    // A view outlives the file handle: it holds the map.
    let view = f.tensor_data("q8_0.mat").unwrap();
    let copy = f.tensor_bytes("q8_0.mat").unwrap().to_vec();
    drop(f);
    assert_eq!(view.as_slice(), &copy[..]);

    let f = GgufFile::open(fixture("fixture.gguf")).unwrap();
    let err = f.tensor_f32("nope").unwrap_err().to_string();
    assert!(err.contains("fixture.gguf") && err.contains("`nope`"), "{err}");
}

#[test]
fn typed_getters() {
    let path = fixture("fixture.gguf");
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "qwen35");
    assert_eq!(f.get_u32("qwen35.block_count").unwrap(), 3);
    assert_eq!(f.get_usize("qwen35.context_length").unwrap(), 4096);
    assert_eq!(f.get_f32("qwen35.rope.freq_base").unwrap(), 1e7);
    assert_eq!(f.get_f32("qwen35.attention.layer_norm_rms_epsilon").unwrap(), 1e-6);
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap(), ["!", "\"", "Ġthe", "<|endoftext|>"]);
    assert_eq!(f.get_i32_array("tokenizer.ggml.token_type").unwrap(), [1, 1, 1, 3]);
    assert_eq!(f.get_f32_array("tokenizer.ggml.scores").unwrap(), [0.0, -1.0, -2.5, 0.0]);
    assert_eq!(
        f.get_str("tokenizer.chat_template").unwrap(),
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    );
    assert!(f.get_bool("test.bool_true").unwrap());
    assert_eq!(f.get_u64("test.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("test.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_f64("test.f64").unwrap(), -1.5e300);
    assert_eq!(f.get_str("test.empty_string").unwrap(), "");
    // Integer getters take any integer type whose value fits.
    assert_eq!(f.get_u32("test.u8").unwrap(), 255);
    assert_eq!(f.get_i32("test.i16").unwrap(), -32768);
    assert_eq!(f.get_u32_array("test.arr.u8").unwrap(), [0, 1, 255]);
    assert_eq!(f.get_u32_array("test.arr.u32").unwrap(), [0, 7, u32::MAX]);
    let nested = f.get_array("test.arr.nested").unwrap();
    assert_eq!(
        nested,
        &GgufArray::Array(vec![
            GgufArray::I32(vec![1, 2, 3]),
            GgufArray::I32(vec![4]),
            GgufArray::I32(vec![-5, 6])
        ])
    );

    let p = path.display().to_string();
    let cases: [(Error, &[&str]); 6] = [
        (f.get_u32("missing.key").unwrap_err(), &["`missing.key`", "missing"]),
        (f.get_u32("test.i32").unwrap_err(), &["`test.i32`", "-2147483648", "u32"]),
        (f.get_u32("test.string").unwrap_err(), &["`test.string`", "string", "expected u32"]),
        (f.get_str("test.u8").unwrap_err(), &["u8", "expected string"]),
        (f.get_str_array("test.arr.i32").unwrap_err(), &["array of i32", "array of string"]),
        (f.get_u32_array("test.arr.i8").unwrap_err(), &["`test.arr.i8`", "u32"]),
    ];
    for (err, words) in cases {
        let msg = err.to_string();
        assert!(msg.contains(&p), "{msg}");
        for w in words {
            assert!(msg.contains(w), "`{w}` not in: {msg}");
        }
    }
}

// --- writing ---------------------------------------------------------------------------------

/// Where to leave the files written here for `scripts/make_gguf_fixtures.py --check-strix-dir`
/// (Python's GGUFReader and llama.cpp's C reader), when `$STRIX_GGUF_KEEP_DIR` is set.
/// (name, row-major shape, values) of a tensor as strix dequantizes it.
type Values = (String, Vec<usize>, Vec<f32>);

fn keep(path: &Path, values: Option<&[Values]>) {
    let Some(dir) = std::env::var_os("STRIX_GGUF_KEEP_DIR") else { return };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let dest = dir.join(path.file_name().unwrap());
    std::fs::copy(path, &dest).unwrap();
    if let Some(values) = values {
        let bytes: Vec<Vec<u8>> =
            values.iter().map(|v| v.2.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
        let views: Vec<(String, TensorView)> = values
            .iter()
            .zip(&bytes)
            .map(|(v, b)| (v.0.clone(), TensorView::new(Dtype::F32, v.1.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dest.with_extension("values.safetensors")).unwrap();
    }
}

/// Rewriting a GGUFWriter file with strix's writer gives the same bytes.
#[test]
fn rewriting_the_fixtures_is_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["fixture.gguf", "aligned64.gguf"] {
        let f = GgufFile::open(fixture(name)).unwrap();
        let mut w = GgufWriter::new();
        for (k, v) in f.metadata_entries() {
            w.add_metadata(k, v.clone()).unwrap();
        }
        for t in f.tensors() {
            w.add_tensor(&t.name, &t.dims, t.ty, f.tensor_bytes(&t.name).unwrap().to_vec()).unwrap();
        }
        let out = dir.path().join(format!("rewritten_{name}"));
        w.write(&out).unwrap();
        let (a, b) = (std::fs::read(fixture(name)).unwrap(), std::fs::read(&out).unwrap());
        assert_eq!(a.len(), b.len(), "{name}: size");
        assert!(a == b, "{name}: first difference at byte {:?}", a.iter().zip(&b).position(|(x, y)| x != y));
        keep(&out, None);
    }
}

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// strix quantizes, writes, reads back: metadata of every kind (including empty and nested
/// arrays) and tensors of every type survive, some given up front and some streamed.
#[test]
fn write_read_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strix_written.gguf");
    let mut w = GgufWriter::new();
    let meta: Vec<(&str, GgufValue)> = vec![
        ("general.architecture", "qwen35".into()),
        ("general.alignment", GgufValue::U32(64)),
        ("a.u8", 7u8.into()),
        ("a.i8", (-7i8).into()),
        ("a.u16", 700u16.into()),
        ("a.i16", (-700i16).into()),
        ("a.u32", 70000u32.into()),
        ("a.i32", (-70000i32).into()),
        ("a.f32", 0.1f32.into()),
        ("a.bool", true.into()),
        ("a.string", "ünïcode".into()),
        ("a.u64", u64::MAX.into()),
        ("a.i64", i64::MIN.into()),
        ("a.f64", std::f64::consts::PI.into()),
        ("a.arr.empty_i32", GgufValue::Array(GgufArray::I32(vec![]))),
        ("a.arr.empty_string", GgufValue::Array(GgufArray::String(vec![]))),
        ("a.arr.strings", vec!["x".to_string(), String::new(), "🦀".to_string()].into()),
        ("a.arr.bool", vec![true, false].into()),
        ("a.arr.f64", vec![1.0f64, -2.0].into()),
        ("a.arr.u16", vec![1u16, 2, 3].into()),
        ("a.arr.i64", vec![i64::MIN, 0].into()),
    ];
    for (k, v) in &meta {
        w.add_metadata(k, v.clone()).unwrap();
    }

    let mut seed = 42;
    let shapes: [(&str, QuantType, Vec<u64>); 8] = [
        ("t.f32", QuantType::F32, vec![5, 3]),
        ("t.f16", QuantType::F16, vec![9]),
        ("t.bf16", QuantType::BF16, vec![2, 3, 5]),
        ("t.q8_0", QuantType::Q8_0, vec![64, 3]),
        ("t.q4_0", QuantType::Q4_0, vec![32, 5]),
        ("t.q4_k", QuantType::Q4_K, vec![512, 3]),
        ("blk.0.attn_qkv.weight", QuantType::Q6_K, vec![256, 1, 3]),
        ("t.empty", QuantType::Q8_0, vec![32, 0]),
    ];
    let mut encoded = HashMap::new();
    let mut values = Vec::new();
    for (i, (name, ty, dims)) in shapes.iter().enumerate() {
        let n: usize = dims.iter().product::<u64>() as usize;
        let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed) * 3.0).collect();
        let mut q = vec![0u8; ty.row_size(n).unwrap()];
        quant::quantize_row(*ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; n];
        quant::dequantize_row(*ty, &q, &mut y).unwrap();
        values.push((name.to_string(), dims.iter().rev().map(|&d| d as usize).collect::<Vec<_>>(), y));
        if i % 2 == 0 {
            w.add_tensor(name, dims, *ty, q).unwrap();
        } else {
            w.add_tensor_info(name, dims, *ty).unwrap();
            encoded.insert(name.to_string(), q);
        }
    }
    let mut asked = Vec::new();
    w.write_with(&path, |name, index| {
        asked.push((name.to_string(), index));
        Ok(encoded[name].clone())
    })
    .unwrap();
    assert_eq!(asked.iter().map(|a| a.1).collect::<Vec<_>>(), [1, 3, 5, 7], "streamed tensors, in order");

    let f = GgufFile::open(&path).unwrap();
    assert_eq!((f.version(), f.alignment()), (3, 64));
    let keys: Vec<&str> = f.metadata_entries().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, meta.iter().map(|m| m.0).collect::<Vec<_>>());
    for (k, v) in &meta {
        assert_eq!(f.metadata(k).unwrap(), v, "{k}");
    }
    assert_eq!(f.tensors().len(), shapes.len());
    for ((name, ty, dims), (_, shape, y)) in shapes.iter().zip(&values) {
        let info = f.tensor_info(name).unwrap();
        assert_eq!((&info.ty, &info.dims, &info.shape()), (ty, dims, shape));
        assert_eq!(info.range.start % 64, 0);
        let got = f.tensor_f32(name).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    assert_eq!(len % 64, 0, "the last tensor is padded too");
    keep(&path, Some(&values));
}

/// Arrays of arrays (legal GGUF, which llama.cpp's reader refuses, so kept out of the file
/// above) survive too.
#[test]
fn nested_arrays_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested.gguf");
    let nested = GgufValue::Array(GgufArray::Array(vec![
        GgufArray::Array(vec![GgufArray::String(vec!["deep".into()]), GgufArray::Array(vec![])]),
        GgufArray::F32(vec![]),
        GgufArray::U8(vec![1, 2]),
    ]));
    let mut w = GgufWriter::new();
    w.add_metadata("n", nested.clone()).unwrap();
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.metadata("n"), Some(&nested));
    assert!(f.tensors().is_empty());

    let mut deep = GgufArray::U8(vec![]);
    for _ in 0..8 {
        deep = GgufArray::Array(vec![deep]);
    }
    let err = GgufWriter::new().add_metadata("deep", deep).unwrap_err().to_string();
    assert!(err.contains("nested deeper"), "{err}");
}

#[test]
fn writer_rejects_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.add_metadata("k", 1u32).unwrap();
    let errs = [
        w.add_metadata("k", 2u32).unwrap_err(),
        w.add_metadata("", 2u32).unwrap_err(),
        w.add_metadata("general.alignment", 48u32).unwrap_err(),
        w.add_metadata("general.alignment", 64u64).unwrap_err(),
        w.add_tensor("t", &[100, 2], QuantType::Q4_K, vec![]).unwrap_err(),
        w.add_tensor("t", &[32, 2], QuantType::Q8_0, vec![0; 67]).unwrap_err(),
        w.add_tensor(&"x".repeat(64), &[4], QuantType::F32, vec![0; 16]).unwrap_err(),
        w.add_tensor("t", &[1, 1, 1, 1, 1], QuantType::F32, vec![0; 4]).unwrap_err(),
        w.add_tensor("t", &[u64::MAX, 2], QuantType::F32, vec![]).unwrap_err(),
        w.add_tensor_info("t", &[32], QuantType::Q5_K).unwrap_err(),
    ];
    let want = [
        "twice",
        "empty",
        "power of two",
        "power of two",
        "multiple",
        "68 bytes, got 67",
        "63",
        "5 dimensions",
        "overflow",
        "multiple",
    ];
    for (e, w) in errs.iter().zip(want) {
        assert!(e.to_string().contains(w), "`{w}` not in: {e}");
    }
    w.add_tensor("t", &[4], QuantType::F32, vec![0; 16]).unwrap();
    assert!(w.add_tensor("t", &[4], QuantType::F32, vec![0; 16]).unwrap_err().to_string().contains("twice"));
    w.add_tensor_info("later", &[4], QuantType::F32).unwrap();
    let err = w.write(dir.path().join("x.gguf")).unwrap_err().to_string();
    assert!(err.contains("`later`") && err.contains("without data"), "{err}");
    let err = w.write_with(dir.path().join("y.gguf"), |_, _| Ok(vec![0; 3])).unwrap_err().to_string();
    assert!(err.contains("16 bytes, got 3"), "{err}");
}

// --- broken files ----------------------------------------------------------------------------

/// Little-endian GGUF pieces for hand-made (possibly invalid) files.
fn string(s: &[u8]) -> Vec<u8> {
    [&(s.len() as u64).to_le_bytes()[..], s].concat()
}

fn kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    [string(key.as_bytes()), ty.to_le_bytes().to_vec(), value.to_vec()].concat()
}

fn tensor_info(name: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut v = string(name.as_bytes());
    v.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        v.extend(d.to_le_bytes());
    }
    v.extend(ty.to_le_bytes());
    v.extend(offset.to_le_bytes());
    v
}

/// A file with these pairs and tensor infos, the data section aligned to 32.
fn file(version: u32, kvs: &[Vec<u8>], tensors: &[Vec<u8>], data: &[u8]) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend(version.to_le_bytes());
    v.extend((tensors.len() as u64).to_le_bytes());
    v.extend((kvs.len() as u64).to_le_bytes());
    for p in kvs.iter().chain(tensors) {
        v.extend(p);
    }
    v.resize(v.len().next_multiple_of(32), 0);
    v.extend(data);
    v
}

/// One F32 [4] tensor and a u32 pair: a valid file the corruptions start from.
fn valid() -> Vec<u8> {
    file(3, &[kv("a.b", 4, &7u32.to_le_bytes())], &[tensor_info("w", &[4], 0, 0)], &[0u8; 16])
}

fn open_bytes(dir: &Path, name: &str, bytes: &[u8]) -> (PathBuf, Result<GgufFile, Error>) {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    let r = GgufFile::open(&path);
    (path, r)
}

fn expect_error(dir: &Path, name: &str, bytes: &[u8], words: &[&str]) {
    let (path, r) = open_bytes(dir, name, bytes);
    let err = match r {
        Ok(_) => panic!("{name}: opened without error"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Checkpoint { .. }), "{name}: {err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{name}: the message does not name the file: {msg}");
    for w in words {
        assert!(msg.contains(w), "{name}: `{w}` not in: {msg}");
    }
}

#[test]
fn hand_made_valid_file_opens() {
    let dir = tempfile::tempdir().unwrap();
    let (_, r) = open_bytes(dir.path(), "valid.gguf", &valid());
    let f = r.unwrap();
    assert_eq!(f.get_u32("a.b").unwrap(), 7);
    assert_eq!(f.tensor_f32("w").unwrap(), [0.0; 4]);
    let (_, r) =
        open_bytes(dir.path(), "v2.gguf", &file(2, &[], &[tensor_info("w", &[4], 0, 0)], &[0u8; 16]));
    assert_eq!(r.unwrap().version(), 2);
    // No tensors: the data section may be absent altogether.
    let (_, r) = open_bytes(dir.path(), "empty.gguf", &b"GGUF\x03\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0"[..]);
    assert!(r.unwrap().tensors().is_empty());
}

#[test]
fn header_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    expect_error(d, "empty.gguf", b"", &["only 0 bytes"]);
    expect_error(d, "short.gguf", b"GG", &["only 2 bytes"]);
    let mut bad = valid();
    bad[..4].copy_from_slice(b"GGML");
    expect_error(d, "magic.gguf", &bad, &["not a GGUF file", "GGML"]);
    let mut safetensors_like = valid();
    safetensors_like[..4].copy_from_slice(&[0x10, 0, 0, 0]);
    expect_error(d, "magic2.gguf", &safetensors_like, &["not a GGUF file"]);
    expect_error(d, "v1.gguf", &file(1, &[], &[], &[]), &["version 1", "not supported"]);
    expect_error(d, "v4.gguf", &file(4, &[], &[], &[]), &["unsupported GGUF version 4"]);
    expect_error(d, "v0.gguf", &file(0, &[], &[], &[]), &["bad GGUF version 0"]);
    expect_error(d, "be.gguf", &file(0x0300_0000, &[], &[], &[]), &["byte-swapped", "big-endian"]);
    expect_error(d, "noversion.gguf", b"GGUF\x03\0", &["truncated", "version"]);
    let mut counts = valid();
    counts[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_error(d, "ntensors.gguf", &counts, &["tensor count 18446744073709551615 is impossible"]);
    let mut counts = valid();
    counts[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_error(d, "nkv.gguf", &counts, &["metadata count", "impossible"]);
}

#[test]
fn metadata_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let with = |kvs: Vec<Vec<u8>>| file(3, &kvs, &[], &[]);
    // A key whose length runs past the end of the file.
    let mut long_key = string(b"abc");
    long_key[..8].copy_from_slice(&1_000_000u64.to_le_bytes());
    expect_error(d, "keylen.gguf", &with(vec![long_key]), &["metadata pair 0", "claims 1000000 bytes"]);
    // A string value whose length runs past the end.
    let mut s = string(b"hello");
    s[..8].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    expect_error(d, "strlen.gguf", &with(vec![kv("x.s", 8, &s)]), &["`x.s`", "claims", "bytes"]);
    expect_error(d, "utf8.gguf", &with(vec![kv("x.s", 8, &string(&[0xff, 0xfe]))]), &["`x.s`", "UTF-8"]);
    expect_error(d, "vtype.gguf", &with(vec![kv("x.t", 13, &[0; 8])]), &["`x.t`", "unknown value type 13"]);
    // An array of u64 claiming 2^61 elements: refused before any allocation.
    let arr = [10u32.to_le_bytes().to_vec(), (1u64 << 61).to_le_bytes().to_vec()].concat();
    expect_error(
        d,
        "arrlen.gguf",
        &with(vec![kv("x.a", 9, &arr)]),
        &["`x.a`", "array of u64 count", "impossible"],
    );
    // Arrays nested 20 deep.
    let mut nested = [8u32.to_le_bytes().to_vec(), 0u64.to_le_bytes().to_vec()].concat();
    for _ in 0..20 {
        nested = [9u32.to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec(), nested].concat();
    }
    expect_error(d, "nested.gguf", &with(vec![kv("x.n", 9, &nested)]), &["`x.n`", "nested deeper"]);
    let pair = kv("x.y", 4, &1u32.to_le_bytes());
    expect_error(d, "dupkey.gguf", &with(vec![pair.clone(), pair]), &["`x.y` appears twice"]);
    expect_error(d, "emptykey.gguf", &with(vec![kv("", 4, &1u32.to_le_bytes())]), &["empty key"]);
    let pair = kv("x.z", 10, &[1, 2, 3]);
    let mut truncated_value = with(vec![pair.clone()]);
    truncated_value.truncate(24 + pair.len());
    expect_error(d, "value.gguf", &truncated_value, &["`x.z`", "truncated"]);
    let align = |ty: u32, v: &[u8]| file(3, &[kv("general.alignment", ty, v)], &[], &[]);
    expect_error(
        d,
        "align48.gguf",
        &align(4, &48u32.to_le_bytes()),
        &["general.alignment", "48", "power of two"],
    );
    expect_error(d, "align0.gguf", &align(4, &0u32.to_le_bytes()), &["power of two"]);
    expect_error(
        d,
        "alignu64.gguf",
        &align(10, &64u64.to_le_bytes()),
        &["general.alignment", "u64", "expected u32"],
    );
}

#[test]
fn tensor_info_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let one = |ti: Vec<u8>, data: &[u8]| file(3, &[], &[ti], data);
    expect_error(d, "past_end.gguf", &one(tensor_info("w", &[4], 0, 64), &[0; 16]), &["`w`", "past the end"]);
    expect_error(
        d,
        "short_data.gguf",
        &one(tensor_info("w", &[8], 0, 0), &[0; 16]),
        &["`w`", "32 bytes", "past the end"],
    );
    expect_error(
        d,
        "huge_offset.gguf",
        &one(tensor_info("w", &[4], 0, u64::MAX - 31), &[0; 16]),
        &["`w`", "past the end"],
    );
    expect_error(
        d,
        "misaligned.gguf",
        &one(tensor_info("w", &[4], 0, 4), &[0; 32]),
        &["`w`", "offset 4", "alignment 32"],
    );
    expect_error(
        d,
        "ndims5.gguf",
        &one(tensor_info("w", &[1, 1, 1, 1, 1], 0, 0), &[0; 4]),
        &["`w`", "5 dimensions"],
    );
    // n_dims = 2^32 - 1 with no dims following: refused before reading them.
    let mut ti = tensor_info("w", &[], 0, 0);
    ti[9..13].copy_from_slice(&u32::MAX.to_le_bytes());
    expect_error(d, "ndims_max.gguf", &one(ti, &[]), &["`w`", "4294967295 dimensions"]);
    let big = 1u64 << 40;
    expect_error(d, "overflow.gguf", &one(tensor_info("w", &[big, big], 0, 0), &[]), &["`w`", "overflow"]);
    expect_error(
        d,
        "overflow_i64.gguf",
        &one(tensor_info("w", &[1 << 32, 1 << 31], 0, 0), &[]),
        &["overflow"],
    );
    expect_error(
        d,
        "bytes_overflow.gguf",
        &one(tensor_info("w", &[1 << 62], 0, 0), &[]),
        &["`w`", "overflow"],
    );
    expect_error(
        d,
        "huge_dim.gguf",
        &one(tensor_info("w", &[1 << 40], 0, 0), &[0; 16]),
        &["`w`", "past the end"],
    );
    expect_error(
        d,
        "type4.gguf",
        &one(tensor_info("w", &[32], 4, 0), &[0; 32]),
        &["`w`", "unknown GGML type id 4"],
    );
    expect_error(
        d,
        "type99.gguf",
        &one(tensor_info("w", &[32], 99, 0), &[0; 32]),
        &["unknown GGML type id 99"],
    );
    expect_error(
        d,
        "block.gguf",
        &one(tensor_info("w", &[100, 2], 12, 0), &[0; 512]),
        &["`w`", "Q4_K row length 100", "256"],
    );
    let mut name = tensor_info("w", &[4], 0, 0);
    name[..8].copy_from_slice(&(1u64 << 50).to_le_bytes());
    expect_error(d, "namelen.gguf", &one(name, &[0; 16]), &["tensor info 0", "claims"]);
    let two = file(3, &[], &[tensor_info("w", &[4], 0, 0), tensor_info("w", &[4], 0, 32)], &[0; 64]);
    expect_error(d, "dupname.gguf", &two, &["`w` appears twice"]);
    // The tensor table itself cut short.
    let mut cut = valid();
    cut.truncate(24 + kv("a.b", 4, &7u32.to_le_bytes()).len() + 10);
    expect_error(d, "cut_table.gguf", &cut, &["truncated"]);
}

/// Every prefix of the fixture fails cleanly, except those that still hold all tensor data
/// (only the final padding missing), which GGUF allows.
#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture("fixture.gguf")).unwrap();
    let full = GgufFile::open(fixture("fixture.gguf")).unwrap();
    let data_end = full.tensors().iter().map(|t| t.range.end).max().unwrap();
    let path = dir.path().join("cut.gguf");
    for len in 0..bytes.len() {
        std::fs::write(&path, &bytes[..len]).unwrap();
        match GgufFile::open(&path) {
            Ok(_) => assert!(len >= data_end, "a {len}-byte prefix opened"),
            Err(e) => {
                assert!(len < data_end, "a {len}-byte prefix holding all data failed: {e}");
                let msg = e.to_string();
                assert!(msg.contains("cut.gguf"), "{msg}");
                assert!(
                    msg.contains("truncated")
                        || msg.contains("past the end")
                        || msg.contains("only")
                        || msg.contains("claims")
                        || msg.contains("impossible"),
                    "{len}: {msg}"
                );
            }
        }
    }
}

/// Random byte corruption of the header region: always a result, never a panic; whatever
/// opens can be read in full without going out of bounds.
#[test]
fn random_corruption_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let orig = std::fs::read(fixture("fixture.gguf")).unwrap();
    let header_end = GgufFile::open(fixture("fixture.gguf")).unwrap().data_offset();
    let path = dir.path().join("fuzz.gguf");
    let mut seed = 1u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..1500 {
        let mut bytes = orig.clone();
        for _ in 0..1 + next() % 4 {
            let at = next() % header_end;
            bytes[at] = match next() % 3 {
                0 => next() as u8,
                1 => 0xff,
                _ => bytes[at] ^ (1 << (next() % 8)),
            };
        }
        std::fs::write(&path, &bytes).unwrap();
        match GgufFile::open(&path) {
            Ok(f) => {
                ok += 1;
                for t in f.tensors() {
                    let _ = f.tensor_bytes(&t.name).unwrap();
                    let _ = f.tensor_f32(&t.name);
                }
                for (k, _) in f.metadata_entries() {
                    let _ = f.get_u32(k);
                    let _ = f.get_str_array(k);
                }
            }
            Err(e) => {
                failed += 1;
                assert!(e.to_string().contains("fuzz.gguf"), "{e}");
            }
        }
    }
    assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
}
