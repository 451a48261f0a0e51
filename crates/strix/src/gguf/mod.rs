//! GGUF files (llama.cpp's model format): a validating reader over a memory map and a
//! writer.
//!
//! Layout (all little-endian): magic `GGUF`, version (2 or 3; they differ only in that v3
//! may also be big-endian, which strix does not read), tensor count, metadata count, the
//! metadata key/value pairs, the tensor infos (name, dims in GGML order — `dims[0]` is the
//! row length, the fastest-varying —, type, offset), padding to `general.alignment`
//! (default 32), then the data section, each tensor at its offset from the section start.
//!
//! [`GgufFile::open`] checks everything a later access relies on before returning: counts
//! and lengths against the bytes left, types, dimension counts, element and byte counts
//! for overflow, row lengths against block sizes, every tensor's byte range against the
//! file size, and that the tensors' data tile the data section as llama.cpp lays it out
//! (each tensor padded to the alignment, no overlaps, no gaps, nothing after the last): a
//! tensor whose type or dims were changed, so that its bytes no longer match the space it
//! was given, is refused as llama.cpp refuses it. A bad file is an [`Error::Checkpoint`]
//! naming the file and the fault, never a panic; past `open`, tensor accesses cannot go out
//! of bounds. Only a regular file is opened ([`crate::files`]); strings of the file (keys,
//! tensor names, values) are quoted through [`printable`] in messages.

pub mod q5_0;
pub mod qwen35;
mod writer;

pub use qwen35::Qwen35Gguf;
pub use writer::GgufWriter;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{printable, Error, Result};
use crate::files;
use crate::quant::{self, QuantType};
use crate::tensor::{Bytes, DType, HostTensor};

/// `GGUF` read as a little-endian u32.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version [`GgufWriter`] writes.
pub const GGUF_VERSION: u32 = 3;
/// Alignment of the data section and of each tensor when `general.alignment` is absent.
pub const GGUF_DEFAULT_ALIGNMENT: usize = 32;
/// The metadata key that sets the alignment (a u32 power of two).
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// GGML tensors have at most 4 dimensions (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays are legal GGUF but unused in practice; a cap on their depth keeps a
/// crafted file from exhausting the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// The type tag of a metadata value, numbered as in GGUF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    pub fn from_id(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes in a file (a string or array may be
    /// empty but still has its length fields). Used to reject absurd counts before
    /// allocating for them.
    fn min_size(self) -> usize {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array: all elements share one type. Stored typed, so a 250k-entry vocabulary
/// is one `Vec<String>` and a score table one `Vec<f32>`.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        use GgufValue as V;
        use GgufValueType as T;
        match self {
            V::U8(_) => T::U8,
            V::I8(_) => T::I8,
            V::U16(_) => T::U16,
            V::I16(_) => T::I16,
            V::U32(_) => T::U32,
            V::I32(_) => T::I32,
            V::F32(_) => T::F32,
            V::Bool(_) => T::Bool,
            V::String(_) => T::String,
            V::Array(_) => T::Array,
            V::U64(_) => T::U64,
            V::I64(_) => T::I64,
            V::F64(_) => T::F64,
        }
    }

    /// The value as a signed integer when it is one of the integer types (bool is not).
    pub fn as_i128(&self) -> Option<i128> {
        use GgufValue as V;
        Some(match *self {
            V::U8(v) => v.into(),
            V::I8(v) => v.into(),
            V::U16(v) => v.into(),
            V::I16(v) => v.into(),
            V::U32(v) => v.into(),
            V::I32(v) => v.into(),
            V::U64(v) => v.into(),
            V::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// "u32", "array of string (3 elements)"... for error messages.
    pub fn type_description(&self) -> String {
        match self {
            GgufValue::Array(a) => a.type_description(),
            v => v.value_type().name().to_string(),
        }
    }

    /// The value for an error message: a scalar as it is (a string quoted through
    /// [`printable`]), an array by its type and length only, never its contents.
    pub fn summary(&self) -> String {
        use GgufValue as V;
        match self {
            V::String(s) => format!("the string \"{}\"", printable(s)),
            V::Array(a) => a.type_description(),
            V::Bool(b) => format!("bool {b}"),
            V::F32(x) => format!("f32 {x}"),
            V::F64(x) => format!("f64 {x}"),
            v => format!("{} {}", v.value_type().name(), v.as_i128().unwrap_or_default()),
        }
    }
}

impl GgufArray {
    pub fn element_type(&self) -> GgufValueType {
        use GgufArray as A;
        use GgufValueType as T;
        match self {
            A::U8(_) => T::U8,
            A::I8(_) => T::I8,
            A::U16(_) => T::U16,
            A::I16(_) => T::I16,
            A::U32(_) => T::U32,
            A::I32(_) => T::I32,
            A::F32(_) => T::F32,
            A::Bool(_) => T::Bool,
            A::String(_) => T::String,
            A::Array(_) => T::Array,
            A::U64(_) => T::U64,
            A::I64(_) => T::I64,
            A::F64(_) => T::F64,
        }
    }

    pub fn len(&self) -> usize {
        use GgufArray as A;
        match self {
            A::U8(v) => v.len(),
            A::I8(v) => v.len(),
            A::U16(v) => v.len(),
            A::I16(v) => v.len(),
            A::U32(v) => v.len(),
            A::I32(v) => v.len(),
            A::F32(v) => v.len(),
            A::Bool(v) => v.len(),
            A::String(v) => v.len(),
            A::Array(v) => v.len(),
            A::U64(v) => v.len(),
            A::I64(v) => v.len(),
            A::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// "array of u8 (740 elements)", for error messages.
    pub fn type_description(&self) -> String {
        format!("array of {} ({} elements)", self.element_type().name(), self.len())
    }
}

macro_rules! value_from {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl From<$t> for GgufValue {
            fn from(v: $t) -> GgufValue {
                GgufValue::$v(v)
            }
        }
        impl From<Vec<$t>> for GgufValue {
            fn from(v: Vec<$t>) -> GgufValue {
                GgufValue::Array(GgufArray::$v(v))
            }
        }
    )*};
}

value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32, bool => Bool,
    String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for GgufValue {
    fn from(v: &str) -> GgufValue {
        GgufValue::String(v.to_string())
    }
}

impl From<GgufArray> for GgufValue {
    fn from(v: GgufArray) -> GgufValue {
        GgufValue::Array(v)
    }
}

/// One tensor's entry in the file's tensor table, validated against the file.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the row length (fastest-varying), so a
    /// PyTorch `[out, in]` matrix is stored as `[in, out]`. Empty for a scalar.
    pub dims: Vec<u64>,
    pub ty: QuantType,
    /// Offset of the data from the start of the data section, as stored.
    pub offset: u64,
    /// Absolute byte range of the data in the file.
    pub range: Range<usize>,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> usize {
        // Checked not to overflow when the file was opened.
        self.dims.iter().product::<u64>() as usize
    }

    /// The shape in row-major (PyTorch, safetensors) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Weights per row (`dims[0]`; 1 for a scalar).
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| d as usize)
    }

    /// Number of rows: the product of all dims but the first.
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }

    pub fn n_bytes(&self) -> usize {
        self.range.len()
    }
}

/// A memory-mapped, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<Mmap>,
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` and validates its header, metadata and tensor table.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let map = files::map_regular(path)?;
        if map.len() < 4 {
            return Err(Error::checkpoint(path, format!("not a GGUF file: only {} bytes long", map.len())));
        }
        let parsed = parse(&map).map_err(|m| Error::checkpoint(path, m))?;
        let metadata_index = parsed.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensor_index = parsed.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            map: Arc::new(map),
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            metadata_index,
            tensors: parsed.tensors,
            tensor_index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// All metadata pairs in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn err(&self, msg: impl Into<String>) -> Error {
        Error::checkpoint(&self.path, msg)
    }

    fn required(&self, key: &str) -> Result<&GgufValue> {
        self.metadata(key).ok_or_else(|| self.err(format!("metadata key `{}` is missing", printable(key))))
    }

    fn wrong_type(&self, key: &str, want: &str, got: &GgufValue) -> Error {
        self.wrong_type_named(key, want, &got.type_description())
    }

    fn wrong_type_named(&self, key: &str, want: &str, got: &str) -> Error {
        self.err(format!("metadata key `{}` is {got}, expected {want}", printable(key)))
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, want: &str) -> Result<T> {
        let v = self.required(key)?;
        let i = v.as_i128().ok_or_else(|| self.wrong_type(key, want, v))?;
        T::try_from(i)
            .map_err(|_| self.err(format!("metadata key `{}` = {i} does not fit in {want}", printable(key))))
    }

    /// An integer value of any integer type that fits in a u32 (converters differ in which
    /// width they write counts with).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_int(key, "u32")
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_int(key, "u64")
    }

    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.get_int(key, "i32")
    }

    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_int(key, "i64")
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.get_int(key, "usize")
    }

    /// A float value, f32 or f64 (narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.required(key)? {
            GgufValue::F32(v) => Ok(*v),
            GgufValue::F64(v) => Ok(*v as f32),
            v => Err(self.wrong_type(key, "f32", v)),
        }
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        match self.required(key)? {
            GgufValue::F32(v) => Ok(f64::from(*v)),
            GgufValue::F64(v) => Ok(*v),
            v => Err(self.wrong_type(key, "f64", v)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.required(key)? {
            GgufValue::Bool(v) => Ok(*v),
            v => Err(self.wrong_type(key, "bool", v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.required(key)? {
            GgufValue::String(v) => Ok(v),
            v => Err(self.wrong_type(key, "string", v)),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&GgufArray> {
        match self.required(key)? {
            GgufValue::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, "array", v)),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            GgufArray::String(v) => Ok(v),
            a => Err(self.wrong_type_named(key, "array of string", &a.type_description())),
        }
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.get_array(key)? {
            GgufArray::F32(v) => Ok(v),
            a => Err(self.wrong_type_named(key, "array of f32", &a.type_description())),
        }
    }

    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        match self.get_array(key)? {
            GgufArray::I32(v) => Ok(v),
            a => Err(self.wrong_type_named(key, "array of i32", &a.type_description())),
        }
    }

    /// An array of integers of any integer element type, each fitting in a u32 (per-layer
    /// head counts and the like).
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<u32>) -> Option<Vec<u32>> {
            v.iter().map(|&x| f(x)).collect()
        }
        let a = self.get_array(key)?;
        let out = match a {
            GgufArray::U8(v) => conv(v, |x| Some(x.into())),
            GgufArray::I8(v) => conv(v, |x| x.try_into().ok()),
            GgufArray::U16(v) => conv(v, |x| Some(x.into())),
            GgufArray::I16(v) => conv(v, |x| x.try_into().ok()),
            GgufArray::U32(v) => Some(v.clone()),
            GgufArray::I32(v) => conv(v, |x| x.try_into().ok()),
            GgufArray::U64(v) => conv(v, |x| x.try_into().ok()),
            GgufArray::I64(v) => conv(v, |x| x.try_into().ok()),
            _ => return Err(self.wrong_type_named(key, "array of integers", &a.type_description())),
        };
        out.ok_or_else(|| {
            self.err(format!("metadata key `{}` has an element that does not fit in u32", printable(key)))
        })
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn contains_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| self.err(format!("tensor `{name}` is not in the file")))
    }

    /// The raw (possibly quantized) bytes of a tensor, borrowed from the map.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor_info(name)?;
        Ok(&self.map[info.range.clone()])
    }

    /// The raw bytes of a tensor as a view that keeps the map alive.
    pub fn tensor_data(&self, name: &str) -> Result<Bytes> {
        let info = self.tensor_info(name)?;
        Ok(Bytes::Mapped { map: self.map.clone(), range: info.range.clone() })
    }

    /// Bytes `offset..offset + len` of a tensor's data as a view that keeps the map alive (a
    /// routed expert's rows of a merged 3-D tensor); an error when they are not inside it.
    pub fn tensor_data_slice(&self, name: &str, offset: usize, len: usize) -> Result<Bytes> {
        let info = self.tensor_info(name)?;
        let end = offset.checked_add(len).filter(|&e| e <= info.range.len()).ok_or_else(|| {
            self.err(format!("bytes {offset}..+{len} are outside tensor `{}`", crate::error::printable(name)))
        })?;
        Ok(Bytes::Mapped { map: self.map.clone(), range: info.range.start + offset..info.range.start + end })
    }

    /// A tensor of one of the types strix computes with (F32, F16, BF16, Q8_0, Q4_0, Q4_K,
    /// Q6_K) as a [`HostTensor`] (row-major shape), without copying.
    pub fn host_tensor(&self, name: &str) -> Result<HostTensor> {
        let info = self.tensor_info(name)?;
        let Some(dtype) = DType::from_quant_type(info.ty) else {
            return Err(self.err(format!(
                "tensor `{name}` is {}, which strix cannot compute with (F32, F16, BF16, Q8_0, Q4_0, \
                 Q4_K and Q6_K are supported)",
                info.ty
            )));
        };
        Ok(HostTensor { name: name.to_string(), dtype, shape: info.shape(), bytes: self.tensor_data(name)? })
    }

    /// All elements of a tensor as f32, dequantized if need be (F32, F16, BF16, Q8_0, Q4_0,
    /// Q4_K, Q6_K), in storage order: row-major over [`GgufTensorInfo::shape`].
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor_info(name)?;
        if !info.ty.can_dequantize() {
            return Err(self.err(format!("tensor `{name}` is {}, which strix cannot dequantize", info.ty)));
        }
        let mut out = vec![0f32; info.n_elements()];
        quant::dequantize_row(info.ty, &self.map[info.range.clone()], &mut out)
            .map_err(|e| self.err(format!("tensor `{name}`: {e}")))?;
        Ok(out)
    }
}

// ------------------------------------------------------------------------------------
// Parsing

struct Parsed {
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensorInfo>,
}

type PResult<T> = std::result::Result<T, String>;

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> PResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {n} bytes needed at offset {} but the file ends at {}",
                self.pos,
                self.buf.len()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> PResult<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items each at least `min_size` bytes long, checked against the bytes left
    /// so that a corrupt count fails here instead of in an allocation.
    fn count(&mut self, min_size: usize, what: &str) -> PResult<usize> {
        let n = self.u64()?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_size))
            .is_some_and(|b| b <= self.remaining());
        if !fits {
            return Err(format!(
                "{what} count {n} is impossible: {} bytes are left in the file and each takes at least {min_size}",
                self.remaining()
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> PResult<String> {
        let at = self.pos;
        let len = self.u64()?;
        if len > self.remaining() as u64 {
            return Err(format!(
                "string at offset {at} claims {len} bytes but only {} are left in the file",
                self.remaining()
            ));
        }
        let bytes = self.take(len as usize)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("string at offset {at} is not valid UTF-8"))
    }

    fn value(&mut self, ty: GgufValueType) -> PResult<GgufValue> {
        use GgufValueType as T;
        Ok(match ty {
            T::U8 => GgufValue::U8(self.array::<1>()?[0]),
            T::I8 => GgufValue::I8(self.array::<1>()?[0] as i8),
            T::U16 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            T::I16 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            T::U32 => GgufValue::U32(self.u32()?),
            T::I32 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            T::F32 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            // GGML reads a bool as a byte and tests it against zero; so do we.
            T::Bool => GgufValue::Bool(self.array::<1>()?[0] != 0),
            T::String => GgufValue::String(self.string()?),
            T::Array => GgufValue::Array(self.array_value(0)?),
            T::U64 => GgufValue::U64(self.u64()?),
            T::I64 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            T::F64 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
        })
    }

    fn value_type(&mut self) -> PResult<GgufValueType> {
        let at = self.pos;
        let id = self.u32()?;
        GgufValueType::from_id(id).ok_or_else(|| format!("unknown value type {id} at offset {at}"))
    }

    fn array_value(&mut self, depth: usize) -> PResult<GgufArray> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"));
        }
        let ty = self.value_type()?;
        let n = self.count(ty.min_size(), &format!("array of {}", ty.name()))?;
        macro_rules! fixed {
            ($v:ident, $t:ty) => {{
                let bytes = self.take(n * std::mem::size_of::<$t>())?;
                GgufArray::$v(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                )
            }};
        }
        use GgufValueType as T;
        Ok(match ty {
            T::U8 => GgufArray::U8(self.take(n)?.to_vec()),
            T::I8 => GgufArray::I8(self.take(n)?.iter().map(|&b| b as i8).collect()),
            T::Bool => GgufArray::Bool(self.take(n)?.iter().map(|&b| b != 0).collect()),
            T::U16 => fixed!(U16, u16),
            T::I16 => fixed!(I16, i16),
            T::U32 => fixed!(U32, u32),
            T::I32 => fixed!(I32, i32),
            T::F32 => fixed!(F32, f32),
            T::U64 => fixed!(U64, u64),
            T::I64 => fixed!(I64, i64),
            T::F64 => fixed!(F64, f64),
            T::String => GgufArray::String((0..n).map(|_| self.string()).collect::<PResult<_>>()?),
            T::Array => {
                GgufArray::Array((0..n).map(|_| self.array_value(depth + 1)).collect::<PResult<_>>()?)
            }
        })
    }
}

fn parse(buf: &[u8]) -> PResult<Parsed> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array()?;
    if magic != GGUF_MAGIC {
        return Err(format!(
            "not a GGUF file: starts with {:?} ({:02x?}), expected \"GGUF\"",
            String::from_utf8_lossy(&magic),
            magic
        ));
    }
    let version = c.u32().map_err(|e| format!("reading the version: {e}"))?;
    match version {
        2 | 3 => {}
        0 => return Err("bad GGUF version 0".into()),
        1 => return Err("GGUF version 1 is not supported (strix reads versions 2 and 3)".into()),
        v if v & 0xffff == 0 => {
            return Err(format!(
                "GGUF version {v:#010x} looks byte-swapped: big-endian GGUF files are not supported"
            ))
        }
        v => return Err(format!("unsupported GGUF version {v} (strix reads versions 2 and 3)")),
    }
    // Minimal sizes: a tensor info is a name (8), n_dims (4), type (4) and offset (8); a
    // metadata pair a key (8), a type (4) and at least one byte of value.
    let n_tensors = c.count(24, "tensor").map_err(|e| format!("header: {e}"))?;
    let n_kv = c.count(13, "metadata").map_err(|e| format!("header: {e}"))?;

    let mut metadata: Vec<(String, GgufValue)> = Vec::with_capacity(n_kv);
    let mut seen = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string().map_err(|e| format!("metadata pair {i}: key: {e}"))?;
        if key.is_empty() {
            return Err(format!("metadata pair {i} has an empty key"));
        }
        if seen.insert(key.clone(), i).is_some() {
            return Err(format!("metadata key `{}` appears twice", printable(&key)));
        }
        let value = c
            .value_type()
            .and_then(|ty| c.value(ty))
            .map_err(|e| format!("metadata key `{}`: {e}", printable(&key)))?;
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == KEY_ALIGNMENT) {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some((_, GgufValue::U32(a))) if a.is_power_of_two() => *a as usize,
        Some((_, GgufValue::U32(a))) => return Err(format!("`{KEY_ALIGNMENT}` = {a} is not a power of two")),
        Some((_, v)) => return Err(format!("`{KEY_ALIGNMENT}` is {}, expected u32", v.type_description())),
    };

    struct Raw {
        name: String,
        dims: Vec<u64>,
        ty: QuantType,
        offset: u64,
        n_bytes: usize,
    }
    let mut raw = Vec::with_capacity(n_tensors);
    let mut names = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string().map_err(|e| format!("tensor info {i}: name: {e}"))?;
        if names.insert(name.clone(), i).is_some() {
            return Err(format!("tensor `{}` appears twice", printable(&name)));
        }
        let info = (|| -> PResult<Raw> {
            let n_dims = c.u32()?;
            if n_dims as usize > MAX_DIMS {
                return Err(format!("{n_dims} dimensions (GGML tensors have at most {MAX_DIMS})"));
            }
            let dims = (0..n_dims).map(|_| c.u64()).collect::<PResult<Vec<u64>>>()?;
            let type_id = c.u32()?;
            let ty = QuantType::from_id(type_id).ok_or_else(|| format!("unknown GGML type id {type_id}"))?;
            let offset = c.u64()?;
            // GGML counts elements in i64; anything larger is corrupt.
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| format!("dimensions {dims:?} overflow the element count"))?;
            let row = dims.first().copied().unwrap_or(1);
            if row % ty.block_size() as u64 != 0 {
                return Err(format!(
                    "{ty} row length {row} is not a multiple of its block size {}",
                    ty.block_size()
                ));
            }
            let n_bytes = (n_elements / ty.block_size() as u64)
                .checked_mul(ty.type_size() as u64)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| format!("{ty} dimensions {dims:?} overflow the byte count"))?;
            if offset % alignment as u64 != 0 {
                return Err(format!("data offset {offset} is not a multiple of the alignment {alignment}"));
            }
            Ok(Raw { name: String::new(), dims, ty, offset, n_bytes })
        })()
        .map_err(|e| format!("tensor `{}`: {e}", printable(&name)))?;
        raw.push(Raw { name, ..info });
    }

    let data_offset = c
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| "the data section offset overflows".to_string())?;
    if n_tensors > 0 && data_offset > buf.len() {
        return Err(format!(
            "truncated: the data section starts at offset {data_offset} but the file ends at {}",
            buf.len()
        ));
    }

    let tensors = raw
        .into_iter()
        .map(|r| {
            let range = usize::try_from(r.offset)
                .ok()
                .and_then(|o| o.checked_add(data_offset))
                .and_then(|start| Some(start..start.checked_add(r.n_bytes)?))
                .filter(|range| range.end <= buf.len())
                .ok_or_else(|| {
                    format!(
                        "tensor `{}` ({}, dims {:?}, {} bytes at data offset {}) extends past the end of \
                         the file ({} bytes): truncated or corrupt",
                        printable(&r.name),
                        r.ty,
                        r.dims,
                        r.n_bytes,
                        r.offset,
                        buf.len()
                    )
                })?;
            Ok(GgufTensorInfo { name: r.name, dims: r.dims, ty: r.ty, offset: r.offset, range })
        })
        .collect::<PResult<Vec<_>>>()?;
    check_layout(&tensors, alignment, data_offset, buf.len())?;

    Ok(Parsed { version, alignment, data_offset, metadata, tensors })
}

/// Checks that the tensors' data tile the data section as every GGUF writer lays it out
/// (llama.cpp's `gguf_init_from_file` requires it): sorted by offset, each tensor starts
/// where the previous one's data, padded to the alignment, ends; the first at the start of
/// the section; the file ends within the padding of the last. Tensors whose data overlap
/// fail this, and so does a tensor whose type or dims were changed to fit fewer bytes than
/// it was given: its byte range alone would still be in bounds, but its weights would be
/// read from another tensor's bytes.
fn check_layout(
    tensors: &[GgufTensorInfo],
    alignment: usize,
    data_offset: usize,
    file_len: usize,
) -> PResult<()> {
    let mut order: Vec<&GgufTensorInfo> = tensors.iter().filter(|t| !t.range.is_empty()).collect();
    order.sort_by_key(|t| (t.range.start, t.range.end));
    let describe = |t: &GgufTensorInfo| {
        format!(
            "tensor `{}` ({}, dims {:?}, {} bytes at data offset {})",
            printable(&t.name),
            t.ty,
            t.dims,
            t.n_bytes(),
            t.offset
        )
    };
    let mut expected = data_offset;
    let mut previous: Option<&GgufTensorInfo> = None;
    for t in order {
        if t.range.start != expected {
            return Err(match previous {
                None => format!(
                    "{} is the first tensor of the data section, but it starts {} bytes into it: \
                     corrupt tensor table",
                    describe(t),
                    t.range.start - data_offset
                ),
                Some(p) if t.range.start < expected => {
                    format!("{} overlaps {}: corrupt tensor table", describe(t), describe(p))
                }
                Some(p) => format!(
                    "{} is followed by {} bytes that belong to no tensor before {}: the type or dims of \
                     a tensor were changed, or the tensor table is corrupt",
                    describe(p),
                    t.range.start - expected,
                    describe(t)
                ),
            });
        }
        // In bounds (checked above), so neither this nor the rounding overflows.
        expected = t.range.end.next_multiple_of(alignment);
        previous = Some(t);
    }
    if let Some(last) = previous {
        if file_len > expected {
            return Err(format!(
                "{} is the last tensor, but {} bytes follow its data to the end of the file: the type \
                 or dims of a tensor were changed, or the file is corrupt",
                describe(last),
                file_len - expected
            ));
        }
    }
    Ok(())
}
