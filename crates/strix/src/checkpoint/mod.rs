//! Reading Hugging Face safetensors checkpoints: one file or shards listed in
//! `model.safetensors.index.json`, memory-mapped, with every header validated up front.
//!
//! A [`Checkpoint`] maps tensor names to their bytes without copying. Only the tensors the
//! model asks for are checked for dtype and shape, so tensors the text model never uses
//! (`model.visual.*`, `mtp.*`, odd dtypes among them) do not stop a load.
//!
//! A MoE checkpoint stores its routed experts one by one (`mlp.experts.{e}.gate_proj.weight`,
//! what `save_pretrained` writes) or fused into 3-D tensors (`mlp.experts.gate_up_proj`
//! `[experts, 2 * width, hidden]`, gate rows first, and `mlp.experts.down_proj`
//! `[experts, hidden, width]`, transformers' own parameters): [`Checkpoint::expert_tensor`]
//! answers the per-expert names from either, a fused tensor's slice being a window of the map.
//!
//! Files are opened through [`crate::files`]: regular files only, the index under the JSON
//! cap, a git-lfs pointer in place of a shard named as such. Names read from the files
//! (tensors, shards) are quoted through [`printable`] in messages.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};

use crate::error::{printable, printable_capped, Error, Result};
use crate::files;
use crate::tensor::{Bytes, DType, HostTensor};

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the mapped file.
    start: usize,
    end: usize,
}

/// A set of memory-mapped safetensors files and the tensors they hold.
pub struct Checkpoint {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Opens the weights of a model directory: `model.safetensors.index.json` (sharded) if
    /// present, else `model.safetensors`, else the only `*.safetensors` file.
    pub fn open_dir(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        // Present, even as a dangling link (a download cut short): the error names it.
        if index.symlink_metadata().is_ok() {
            return Checkpoint::open_index(&index);
        }
        let single = dir.join("model.safetensors");
        if single.symlink_metadata().is_ok() {
            return Checkpoint::open_files(&[single]);
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        found.sort();
        match found.as_slice() {
            [] => Err(Error::checkpoint(
                dir,
                "no model.safetensors, model.safetensors.index.json or *.safetensors file",
            )),
            [only] => Checkpoint::open_files(std::slice::from_ref(only)),
            many => {
                let names: Vec<String> = many
                    .iter()
                    .filter_map(|p| p.file_name())
                    .map(|n| printable(&n.to_string_lossy()))
                    .collect();
                Err(Error::checkpoint(
                    dir,
                    format!(
                        "no model.safetensors or model.safetensors.index.json, and several *.safetensors files ({}): \
                         which are the weights is ambiguous",
                        names.join(", ")
                    ),
                ))
            }
        }
    }

    /// Opens the shards named by a `model.safetensors.index.json`.
    pub fn open_index(index: &Path) -> Result<Checkpoint> {
        let value = files::read_json(index).map_err(|e| match e {
            Error::Config { file, message } => Error::Checkpoint { file, message },
            other => other,
        })?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::checkpoint(index, "missing object `weight_map`"))?;
        if map.is_empty() {
            return Err(Error::checkpoint(index, "`weight_map` lists no tensors"));
        }
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shards: BTreeMap<String, ()> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                Error::checkpoint(
                    index,
                    format!("weight_map entry for `{}` is not a file name", printable(name)),
                )
            })?;
            // A shard is a file of the model directory: a name that leads elsewhere
            // (`../x`, `/etc/x`, `a/b`) is a broken or hostile index.
            if !is_plain_file_name(file) {
                return Err(Error::checkpoint(
                    index,
                    format!(
                        "weight_map puts tensor `{}` in `{}`, which is not the name of a file in the \
                         model directory",
                        printable(name),
                        printable(file)
                    ),
                ));
            }
            shards.insert(file.to_string(), ());
        }
        let paths: Vec<PathBuf> = shards.keys().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.exists() {
                return Err(Error::checkpoint(
                    index,
                    format!(
                        "shard {} listed in weight_map does not exist",
                        printable(&p.display().to_string())
                    ),
                ));
            }
        }
        let ckpt = Checkpoint::open_files(&paths)?;
        // The index is a promise about where tensors live: a name it lists that no shard holds
        // is a broken download, better reported now than as a missing tensor later.
        for (name, file) in map {
            let file = file.as_str().unwrap_or_default();
            match ckpt.entries.get(name) {
                Some(e) if ckpt.files[e.file].0.file_name().is_some_and(|f| f == file) => {}
                Some(_) | None => {
                    return Err(Error::checkpoint(
                        index,
                        format!(
                            "weight_map says tensor `{}` is in {}, but that shard does not hold it",
                            printable(name),
                            printable(file)
                        ),
                    ))
                }
            }
        }
        Ok(ckpt)
    }

    /// Maps and validates each file; later files may not redefine a tensor.
    pub fn open_files(paths: &[PathBuf]) -> Result<Checkpoint> {
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let map = files::map_regular(path)?;
            let (header_len, metadata) = SafeTensors::read_metadata(&map)
                .map_err(|e| Error::checkpoint(path, describe_safetensors_error(&e, &map)))?;
            let base = 8 + header_len;
            for (name, info) in metadata.tensors() {
                let (s, e) = info.data_offsets;
                let entry = Entry {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + s,
                    end: base + e,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(Error::checkpoint(
                        path,
                        format!("tensor `{}` is defined in more than one file", printable(&name)),
                    ));
                }
            }
            files.push((path.clone(), Arc::new(map)));
        }
        Ok(Checkpoint { files, entries })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The file holding `name`, or the first file when no file holds it (for error messages).
    pub fn file_of(&self, name: &str) -> &Path {
        let i = self.entries.get(name).map_or(0, |e| e.file);
        self.files.get(i).map_or(Path::new("<no file>"), |f| f.0.as_path())
    }

    /// Total bytes of all mapped files.
    pub fn total_bytes(&self) -> usize {
        self.files.iter().map(|f| f.1.len()).sum()
    }

    /// Reads every page of every file once, so the weights are in the page cache before the
    /// first token instead of trickling in from disk during it. `progress` gets (bytes, total).
    pub fn prefetch(&self, progress: Option<&dyn Fn(u64, u64)>) {
        const STEP: usize = 16 << 20;
        const PAGE: usize = 4096;
        let total = self.total_bytes() as u64;
        let mut done = 0u64;
        for (_, map) in &self.files {
            // Only a hint: the reads below do the work if the kernel ignores it.
            let _ = map.advise(memmap2::Advice::WillNeed);
            for chunk in map.chunks(STEP) {
                let mut acc = 0u8;
                for i in (0..chunk.len()).step_by(PAGE) {
                    acc ^= chunk[i];
                }
                std::hint::black_box(acc);
                done += chunk.len() as u64;
                if let Some(p) = progress {
                    p(done, total);
                }
            }
        }
    }

    /// Whether routed expert `name` (`…mlp.experts.{e}.{gate,up,down}_proj.weight`) can be
    /// read: stored by that name or inside its fused tensor.
    pub fn contains_expert(&self, name: &str) -> bool {
        self.contains(name) || fused_expert(name).is_some_and(|f| self.fused_name(&f).is_some())
    }

    /// The fused tensor's name as this checkpoint spells it (with or without `.weight`).
    fn fused_name(&self, f: &FusedExpert) -> Option<String> {
        [f.fused.clone(), format!("{}.weight", f.fused)].into_iter().find(|n| self.contains(n))
    }

    /// A routed expert's `[rows, cols]` matrix by its per-expert name: the tensor of that name,
    /// or its slice of the fused 3-D tensor (`gate_up_proj` rows `0..width` for the gate,
    /// `width..2 * width` for up; `down_proj` whole), checked against `shape`.
    pub fn expert_tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        if self.contains(name) {
            return self.tensor(name, shape);
        }
        let (Some(f), &[rows, cols]) = (fused_expert(name), shape) else { return self.tensor(name, shape) };
        let Some(fused) = self.fused_name(&f) else { return self.tensor(name, shape) };
        let entry = &self.entries[&fused];
        let (path, _) = &self.files[entry.file];
        let per_expert = if f.half.is_some() { 2 * rows } else { rows };
        let experts = entry.shape.first().copied().unwrap_or(0);
        if entry.shape.len() != 3
            || entry.shape[1] != per_expert
            || entry.shape[2] != cols
            || f.expert >= experts
        {
            return Err(Error::checkpoint(
                path,
                format!(
                    "tensor `{}` has shape {:?}: expected [experts > {}, {per_expert}, {cols}] for `{name}`",
                    printable(&fused),
                    entry.shape,
                    f.expert
                ),
            ));
        }
        let dtype = float_dtype(entry.dtype).ok_or_else(|| unreadable(path, &fused, entry.dtype))?;
        let row_bytes = dtype.row_bytes(cols).expect("float rows are any length");
        let first_row = f.expert * per_expert + f.half.unwrap_or(0) * rows;
        let start = entry.start + first_row * row_bytes;
        // Only the slice is re-aligned (copied) when the file leaves it misaligned.
        let map = self.files[entry.file].1.clone();
        let bytes = Bytes::Mapped { map, range: start..start + rows * row_bytes }.aligned(dtype.align());
        Ok(HostTensor { name: name.to_string(), dtype, shape: vec![rows, cols], bytes })
    }

    /// A tensor by name, checked to have `shape`, in one of the float dtypes strix reads.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let entry = self.entries.get(name).ok_or_else(|| {
            let files: Vec<String> = self.files.iter().map(|f| f.0.display().to_string()).collect();
            Error::checkpoint(files.join(", "), format!("missing tensor `{name}`"))
        })?;
        let (path, map) = &self.files[entry.file];
        let dtype = float_dtype(entry.dtype).ok_or_else(|| unreadable(path, name, entry.dtype))?;
        if entry.shape != shape {
            return Err(Error::checkpoint(
                path,
                format!("tensor `{name}` has shape {:?}, expected {:?}", entry.shape, shape),
            ));
        }
        let bytes = Bytes::Mapped { map: map.clone(), range: entry.start..entry.end }.aligned(dtype.align());
        let t = HostTensor { name: name.to_string(), dtype, shape: entry.shape.clone(), bytes };
        // Matrices, and the fused experts' stacks of them, are not scanned.
        if shape.len() == 1 || (shape.len() == 3 && !name.contains(".experts.")) {
            check_finite(&t).map_err(|m| Error::checkpoint(path, m))?;
        }
        Ok(t)
    }
}

/// The float dtypes strix reads from safetensors.
fn float_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

fn unreadable(path: &Path, name: &str, d: Dtype) -> Error {
    Error::checkpoint(path, format!("tensor `{name}` has dtype {d:?}; strix reads F32, F16 and BF16"))
}

/// Where a routed expert's matrix sits in a fused checkpoint.
struct FusedExpert {
    /// `…mlp.experts.gate_up_proj` or `…mlp.experts.down_proj`.
    fused: String,
    expert: usize,
    /// For `gate_up_proj`: 0 for the gate's rows, 1 for up's; `None` for `down_proj`.
    half: Option<usize>,
}

/// Parses `{prefix}mlp.experts.{e}.{gate,up,down}_proj.weight`.
fn fused_expert(name: &str) -> Option<FusedExpert> {
    let at = name.find("mlp.experts.")? + "mlp.experts.".len();
    let (head, rest) = name.split_at(at);
    let (e, proj) = rest.split_once('.')?;
    if e.is_empty() || !e.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let expert = e.parse().ok()?;
    let (fused, half) = match proj {
        "gate_proj.weight" => ("gate_up_proj", Some(0)),
        "up_proj.weight" => ("gate_up_proj", Some(1)),
        "down_proj.weight" => ("down_proj", None),
        _ => return None,
    };
    Some(FusedExpert { fused: format!("{head}{fused}"), expert, half })
}

/// Refuses a tensor holding NaN or ±inf. Meant for the small tensors that are not matrices
/// (norms, `A_log`, `dt_bias`, conv1d: thousands of values, read whole at load anyway); a
/// non-finite value there poisons every logit. The matrices are not scanned: that would read
/// every weight at load, and non-finite logits are caught where tokens are sampled.
pub(crate) fn check_finite(t: &HostTensor) -> std::result::Result<(), String> {
    let values = t.to_f32_vec();
    match values.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(format!(
            "tensor `{}` holds {} at index {i}: a damaged checkpoint",
            printable(&t.name),
            values[i]
        )),
    }
}

fn describe_safetensors_error(e: &safetensors::SafeTensorError, file: &[u8]) -> String {
    use safetensors::SafeTensorError as E;
    let file_len = file.len();
    match e {
        E::HeaderTooSmall => format!("not a safetensors file: {file_len} bytes is too short for a header"),
        // safetensors does not say which entry is wrong: find it.
        E::TensorInvalidInfo | E::ValidationOverflow | E::MisalignedSlice => match inconsistent_entry(file) {
            Some(name) => format!(
                "corrupt safetensors header: the dtype and shape of tensor `{}` do not match its data_offsets",
                printable(&name)
            ),
            None => format!("corrupt safetensors header: {}", foreign(e)),
        },
        E::InvalidHeaderLength => {
            "corrupt safetensors header: its declared length runs past the end of the file (truncated?)".into()
        }
        E::MetadataIncompleteBuffer => {
            "truncated or padded safetensors file: the tensor data does not end where the header says".into()
        }
        E::InvalidHeader(_) | E::InvalidHeaderDeserialization(_) | E::JsonError(_) => {
            format!("corrupt safetensors header: {}", foreign(e))
        }
        other => format!("invalid safetensors file: {}", foreign(other)),
    }
}

/// The safetensors crate's message, which may quote the header (serde's "unknown variant
/// `…`"), made printable and capped.
fn foreign(e: &safetensors::SafeTensorError) -> String {
    printable_capped(&e.to_string(), 400)
}

/// Whether `name` names a file directly inside a directory: one normal path component, no
/// separator of any platform.
fn is_plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None))
        && !name.contains(['/', '\\', '\0'])
}

/// The first header entry whose byte range does not hold `shape` elements of `dtype`.
fn inconsistent_entry(file: &[u8]) -> Option<String> {
    let n = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(file.get(8..8usize.checked_add(n)?)?).ok()?;
    header.into_iter().filter(|(name, _)| name != "__metadata__").find_map(|(name, value)| {
        let info: safetensors::tensor::TensorInfo = serde_json::from_value(value).ok()?;
        let bits = info.shape.iter().try_fold(info.dtype.bitsize(), |a, &d| a.checked_mul(d));
        let (s, e) = info.data_offsets;
        let ok = bits.is_some_and(|b| b % 8 == 0 && e.checked_sub(s) == Some(b / 8));
        (!ok).then_some(name)
    })
}
