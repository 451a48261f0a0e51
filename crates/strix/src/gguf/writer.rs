//! Writing GGUF v3 files the way llama.cpp's `gguf_write_to_file` lays them out, so that
//! llama.cpp (whose reader insists on it) loads them: tensors in the order added, each at
//! the next multiple of the alignment after the previous one, zero padding between.
//!
//! Tensor data is either given up front ([`GgufWriter::add_tensor`]) or produced while
//! writing ([`GgufWriter::add_tensor_info`] + [`GgufWriter::write_with`]), so a quantizer
//! can stream a large model through without holding all of it in memory.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::{
    GgufArray, GgufValue, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, KEY_ALIGNMENT, MAX_DIMS,
};
use crate::error::{Error, Result};
use crate::quant::QuantType;

/// llama.cpp keeps tensor names in a 64-byte buffer with its NUL (`GGML_MAX_NAME`) and
/// rejects files with longer names.
pub const MAX_TENSOR_NAME: usize = 63;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: QuantType,
    n_bytes: usize,
    data: Option<Vec<u8>>,
}

/// A GGUF file being assembled: metadata and tensors in the order they are added.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
    keys: HashSet<String>,
    names: HashSet<String>,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// The alignment the file will use: `general.alignment` if set, else 32.
    pub fn alignment(&self) -> usize {
        self.metadata
            .iter()
            .find_map(|(k, v)| match (k.as_str(), v) {
                (KEY_ALIGNMENT, GgufValue::U32(a)) => Some(*a as usize),
                _ => None,
            })
            .unwrap_or(GGUF_DEFAULT_ALIGNMENT)
    }

    /// Adds a metadata pair. Keys must be unique and non-empty; `general.alignment` must
    /// be a u32 power of two.
    pub fn add_metadata(&mut self, key: &str, value: impl Into<GgufValue>) -> Result<()> {
        let value = value.into();
        if key.is_empty() {
            return Err(Error::input("GGUF metadata keys cannot be empty"));
        }
        if self.keys.contains(key) {
            return Err(Error::input(format!("GGUF metadata key `{key}` added twice")));
        }
        if key == KEY_ALIGNMENT {
            match value {
                GgufValue::U32(a) if a.is_power_of_two() => {}
                ref v => {
                    return Err(Error::input(format!(
                        "`{KEY_ALIGNMENT}` must be a u32 power of two, not {v:?}"
                    )))
                }
            }
        }
        check_depth(&value, 0).map_err(|m| Error::input(format!("GGUF metadata key `{key}`: {m}")))?;
        self.keys.insert(key.to_string());
        self.metadata.push((key.to_string(), value));
        Ok(())
    }

    /// Declares a tensor whose data [`GgufWriter::write_with`] will ask for. `dims` are in
    /// GGML order (`dims[0]` is the row length) and the row length must be whole blocks.
    pub fn add_tensor_info(&mut self, name: &str, dims: &[u64], ty: QuantType) -> Result<()> {
        self.push_tensor(name, dims, ty, None)
    }

    /// Adds a tensor with its data (already encoded as `ty`).
    pub fn add_tensor(&mut self, name: &str, dims: &[u64], ty: QuantType, data: Vec<u8>) -> Result<()> {
        self.push_tensor(name, dims, ty, Some(data))
    }

    /// A tensor's entry, checked (and its data, when given, checked to be its size).
    fn push_tensor(&mut self, name: &str, dims: &[u64], ty: QuantType, data: Option<Vec<u8>>) -> Result<()> {
        let n_bytes = self.check_tensor(name, dims, ty)?;
        if let Some(data) = &data {
            if data.len() != n_bytes {
                return Err(Error::input(format!(
                    "GGUF tensor `{name}`: {ty} dims {dims:?} take {n_bytes} bytes, got {}",
                    data.len()
                )));
            }
        }
        self.names.insert(name.to_string());
        self.tensors.push(PendingTensor { name: name.to_string(), dims: dims.to_vec(), ty, n_bytes, data });
        Ok(())
    }

    fn check_tensor(&self, name: &str, dims: &[u64], ty: QuantType) -> Result<usize> {
        let bad = |m: String| Error::input(format!("GGUF tensor `{name}`: {m}"));
        if name.is_empty() || name.len() > MAX_TENSOR_NAME {
            return Err(bad(format!("names must be 1 to {MAX_TENSOR_NAME} bytes long (llama.cpp's limit)")));
        }
        if self.names.contains(name) {
            return Err(bad("added twice".into()));
        }
        if dims.len() > MAX_DIMS {
            return Err(bad(format!("{} dimensions, at most {MAX_DIMS} allowed", dims.len())));
        }
        let n = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("dims {dims:?} overflow")))?;
        let row = dims.first().copied().unwrap_or(1);
        if row % ty.block_size() as u64 != 0 {
            return Err(bad(format!("{ty} row length {row} is not a multiple of {}", ty.block_size())));
        }
        (n / ty.block_size() as u64)
            .checked_mul(ty.type_size() as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| bad(format!("dims {dims:?} overflow")))
    }

    /// Writes the file; every tensor must have been added with its data.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_with(path, |name, _| {
            Err(Error::input(format!("GGUF tensor `{name}` was declared without data")))
        })
    }

    /// Writes the file, calling `data(name, index)` for each tensor declared with
    /// [`GgufWriter::add_tensor_info`], in file order; it must return exactly the tensor's
    /// bytes.
    pub fn write_with(
        &self,
        path: impl AsRef<Path>,
        data: impl FnMut(&str, usize) -> Result<Vec<u8>>,
    ) -> Result<()> {
        let path = path.as_ref();
        let result = self.write_file(path, data);
        if result.is_err() {
            // A half-written file must not pass for a model.
            let _ = std::fs::remove_file(path);
        }
        result
    }

    fn write_file(&self, path: &Path, mut data: impl FnMut(&str, usize) -> Result<Vec<u8>>) -> Result<()> {
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut w = Counting { inner: BufWriter::new(file), written: 0 };
        let io = |e| Error::io(path, e);
        let align = self.alignment() as u64;

        w.write_all(&GGUF_MAGIC).map_err(io)?;
        w.write_all(&GGUF_VERSION.to_le_bytes()).map_err(io)?;
        w.write_all(&(self.tensors.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&(self.metadata.len() as u64).to_le_bytes()).map_err(io)?;
        for (key, value) in &self.metadata {
            write_str(&mut w, key).map_err(io)?;
            w.write_all(&(value.value_type() as u32).to_le_bytes()).map_err(io)?;
            write_value(&mut w, value).map_err(io)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_str(&mut w, &t.name).map_err(io)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes()).map_err(io)?;
            for d in &t.dims {
                w.write_all(&d.to_le_bytes()).map_err(io)?;
            }
            w.write_all(&t.ty.id().to_le_bytes()).map_err(io)?;
            w.write_all(&offset.to_le_bytes()).map_err(io)?;
            offset += (t.n_bytes as u64).next_multiple_of(align);
        }
        pad(&mut w, align).map_err(io)?;
        for (i, t) in self.tensors.iter().enumerate() {
            let produced;
            let bytes: &[u8] = match &t.data {
                Some(d) => d,
                None => {
                    produced = data(&t.name, i)?;
                    &produced
                }
            };
            if bytes.len() != t.n_bytes {
                return Err(Error::input(format!(
                    "GGUF tensor `{}`: {} dims {:?} take {} bytes, got {}",
                    t.name,
                    t.ty,
                    t.dims,
                    t.n_bytes,
                    bytes.len()
                )));
            }
            w.write_all(bytes).map_err(io)?;
            pad(&mut w, align).map_err(io)?;
        }
        w.inner.flush().map_err(io)?;
        Ok(())
    }
}

fn check_depth(v: &GgufValue, depth: usize) -> std::result::Result<(), String> {
    fn arr(a: &GgufArray, depth: usize) -> std::result::Result<(), String> {
        if depth >= super::MAX_ARRAY_DEPTH {
            return Err(format!("arrays nested deeper than {} levels", super::MAX_ARRAY_DEPTH));
        }
        if let GgufArray::Array(items) = a {
            for item in items {
                arr(item, depth + 1)?;
            }
        }
        Ok(())
    }
    match v {
        GgufValue::Array(a) => arr(a, depth),
        _ => Ok(()),
    }
}

/// Tracks the file position for padding without seeking.
struct Counting<W: Write> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn pad<W: Write>(w: &mut Counting<W>, align: u64) -> std::io::Result<()> {
    let n = w.written.next_multiple_of(align) - w.written;
    w.write_all(&vec![0u8; n as usize])
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, v: &GgufValue) -> std::io::Result<()> {
    match v {
        GgufValue::U8(x) => w.write_all(&[*x]),
        GgufValue::I8(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::U16(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I16(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::U32(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I32(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::F32(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::Bool(x) => w.write_all(&[*x as u8]),
        GgufValue::String(s) => write_str(w, s),
        GgufValue::Array(a) => write_array(w, a),
        GgufValue::U64(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::I64(x) => w.write_all(&x.to_le_bytes()),
        GgufValue::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

fn write_array(w: &mut impl Write, a: &GgufArray) -> std::io::Result<()> {
    w.write_all(&(a.element_type() as u32).to_le_bytes())?;
    w.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                w.write_all(&x.to_le_bytes())?;
            }
        };
    }
    match a {
        GgufArray::U8(v) => w.write_all(v)?,
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::Bool(v) => {
            for x in v {
                w.write_all(&[*x as u8])?;
            }
        }
        GgufArray::String(v) => {
            for s in v {
                write_str(w, s)?;
            }
        }
        GgufArray::Array(v) => {
            for inner in v {
                write_array(w, inner)?;
            }
        }
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F64(v) => each!(v),
    }
    Ok(())
}
