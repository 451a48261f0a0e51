//! Damaged copies of the committed fixtures, for the hostile-input tests (`hostile_files.rs`,
//! `mutated_files.rs`): where each field of a GGUF header lies (so a test can change a count,
//! a type or an offset in place), rewriting a GGUF with edited metadata or tensors, editing a
//! safetensors header, the error a damaged model fails to load with, and a watchdog that turns
//! a hang into a test failure.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use strix::backend::cpu::CpuBackend;
use strix::gguf::{GgufFile, GgufValue, GgufWriter};
use strix::model::Model;
use strix::quant::QuantType;
use tempfile::TempDir;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

pub fn gguf_model(name: &str) -> PathBuf {
    fixtures().join("gguf-models").join(name)
}

/// Loads the model at `path` (a directory or a GGUF file) on the CPU, which must fail; the
/// error's message.
pub fn load_error(path: &Path) -> String {
    match Model::load_path(path, CpuBackend::new(), None) {
        Ok(_) => panic!("{} loaded, but it is broken", path.display()),
        Err(e) => e.to_string(),
    }
}

/// A private copy of a fixture model directory, free to break.
pub fn copy_dir(name: &str) -> TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(model_dir(name)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
    }
    tmp
}

/// Runs `f` on its own thread and returns what it returns, failing the test when it has not
/// answered within `secs` seconds: a hang (a FIFO opened for reading) becomes a failure
/// instead of a stuck suite. A bound against hanging forever, not a speed requirement.
pub fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: no answer within {secs} s: it hangs"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// Makes a FIFO at `path` (no writer will ever open it).
#[cfg(unix)]
pub fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a directory entry.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

/// Asserts that a message shown to a user holds no character a terminal would act on.
pub fn assert_printable(msg: &str) {
    let bad: Vec<char> =
        msg.chars().filter(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(c)).collect();
    assert!(bad.is_empty(), "message carries control characters {bad:?}: {msg:?}");
}

// --- GGUF ------------------------------------------------------------------------------------

/// Where one metadata pair lies in a GGUF file.
#[derive(Clone, Debug)]
pub struct KvAt {
    pub key: String,
    pub key_at: usize,
    pub type_at: usize,
    pub value_at: usize,
    pub end: usize,
}

/// Where one tensor info lies in a GGUF file.
#[derive(Clone, Debug)]
pub struct TensorAt {
    pub name: String,
    pub name_at: usize,
    pub n_dims_at: usize,
    pub dims: Vec<u64>,
    pub type_at: usize,
    pub offset_at: usize,
    pub end: usize,
}

impl TensorAt {
    pub fn dim_at(&self, i: usize) -> usize {
        self.n_dims_at + 4 + 8 * i
    }
}

/// The positions of every header field of a valid GGUF file.
#[derive(Clone, Debug)]
pub struct GgufLayout {
    pub n_tensors_at: usize,
    pub n_kv_at: usize,
    pub kvs: Vec<KvAt>,
    pub tensors: Vec<TensorAt>,
    /// End of the tensor table (the data section starts at the next multiple of the alignment).
    pub table_end: usize,
}

impl GgufLayout {
    pub fn kv(&self, key: &str) -> &KvAt {
        self.kvs.iter().find(|k| k.key == key).unwrap_or_else(|| panic!("no key {key}"))
    }

    pub fn tensor(&self, name: &str) -> &TensorAt {
        self.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Walks the header of a valid GGUF file (panics on an invalid one: test input only).
pub fn gguf_layout(b: &[u8]) -> GgufLayout {
    fn skip_value(b: &[u8], pos: &mut usize, ty: u32) {
        match ty {
            0 | 1 | 7 => *pos += 1,
            2 | 3 => *pos += 2,
            4..=6 => *pos += 4,
            10..=12 => *pos += 8,
            8 => *pos += 8 + u64_at(b, *pos) as usize,
            9 => {
                let et = u32_at(b, *pos);
                let n = u64_at(b, *pos + 4);
                *pos += 12;
                for _ in 0..n {
                    skip_value(b, pos, et);
                }
            }
            t => panic!("value type {t}"),
        }
    }
    let string = |pos: &mut usize| {
        let n = u64_at(b, *pos) as usize;
        let s = String::from_utf8(b[*pos + 8..*pos + 8 + n].to_vec()).unwrap();
        *pos += 8 + n;
        s
    };
    let n_tensors = u64_at(b, 8) as usize;
    let n_kv = u64_at(b, 16) as usize;
    let mut pos = 24;
    let mut kvs = Vec::new();
    for _ in 0..n_kv {
        let key_at = pos;
        let key = string(&mut pos);
        let type_at = pos;
        let ty = u32_at(b, pos);
        pos += 4;
        let value_at = pos;
        skip_value(b, &mut pos, ty);
        kvs.push(KvAt { key, key_at, type_at, value_at, end: pos });
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name_at = pos;
        let name = string(&mut pos);
        let n_dims_at = pos;
        let n_dims = u32_at(b, pos) as usize;
        let dims = (0..n_dims).map(|i| u64_at(b, pos + 4 + 8 * i)).collect();
        pos += 4 + 8 * n_dims;
        let type_at = pos;
        let offset_at = pos + 4;
        pos += 12;
        tensors.push(TensorAt { name, name_at, n_dims_at, dims, type_at, offset_at, end: pos });
    }
    GgufLayout { n_tensors_at: 8, n_kv_at: 16, kvs, tensors, table_end: pos }
}

/// Rewrites the GGUF `src` at `out` through [`GgufWriter`] (so the layout stays valid), with
/// each metadata pair and tensor passed through an edit that may change or drop it.
pub fn rewrite_gguf(
    src: &Path,
    out: &Path,
    edit_meta: impl Fn(&str, &GgufValue) -> Option<GgufValue>,
    edit_tensor: impl Fn(&str, QuantType, Vec<u8>) -> Option<(QuantType, Vec<u8>)>,
) {
    let f = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata_entries() {
        if let Some(v) = edit_meta(k, v) {
            w.add_metadata(k, v).unwrap();
        }
    }
    for t in f.tensors() {
        let bytes = f.tensor_bytes(&t.name).unwrap().to_vec();
        if let Some((ty, bytes)) = edit_tensor(&t.name, t.ty, bytes) {
            w.add_tensor(&t.name, &t.dims, ty, bytes).unwrap();
        }
    }
    w.write(out).unwrap();
}

/// [`rewrite_gguf`]'s metadata edit that keeps every pair as it is.
pub fn keep_metadata(_: &str, v: &GgufValue) -> Option<GgufValue> {
    Some(v.clone())
}

/// [`rewrite_gguf`]'s tensor edit that keeps every tensor as it is.
pub fn keep_tensor(_: &str, ty: QuantType, bytes: Vec<u8>) -> Option<(QuantType, Vec<u8>)> {
    Some((ty, bytes))
}

/// [`rewrite_gguf`] changing one metadata value.
pub fn with_metadata(src: &Path, out: &Path, key: &str, value: impl Into<GgufValue>) {
    let value = value.into();
    rewrite_gguf(src, out, |k, v| Some(if k == key { value.clone() } else { v.clone() }), keep_tensor);
}

/// [`rewrite_gguf`] leaving out the metadata pair `key`.
pub fn without_metadata(src: &Path, out: &Path, key: &str) {
    rewrite_gguf(src, out, |k, v| (k != key).then(|| v.clone()), keep_tensor);
}

/// [`rewrite_gguf`] leaving out the tensor `name`.
pub fn without_tensor(src: &Path, out: &Path, name: &str) {
    rewrite_gguf(src, out, keep_metadata, |n, ty, b| (n != name).then_some((ty, b)));
}

// --- safetensors ---------------------------------------------------------------------------

/// The JSON header of a safetensors file and the data after it.
pub fn safetensors_parts(bytes: &[u8]) -> (Value, Vec<u8>) {
    let n = u64_at(bytes, 0) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), bytes[8 + n..].to_vec())
}

/// A safetensors file from a header and data (the header padded with spaces to 8 bytes, as
/// the format's writers do).
pub fn safetensors_from_parts(header: &Value, data: &[u8]) -> Vec<u8> {
    let mut h = serde_json::to_vec(header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    [&(h.len() as u64).to_le_bytes()[..], &h, data].concat()
}
