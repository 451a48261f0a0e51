//! Property tests of the loaders on mutated model files: valid fixtures (GGUF files made by
//! llama.cpp, safetensors checkpoints with their shard index, `config.json` in both layouts)
//! with bits flipped, bytes set, cut, spliced, inserted and deleted, and with the fields
//! that parsers trust changed on purpose (GGUF counts, lengths, dims, types and offsets;
//! safetensors dtypes, shapes, data offsets, names and header lengths; config values of every
//! JSON type, or removed). Each mutated file goes through the whole load (`Model::load_path`
//! on the CPU backend) and, when it loads, through a short forward pass. The properties:
//! - no panic, no hang: the load returns `Ok` or an `Err`;
//! - an `Err` names the file (its message holds the model's path), carries no control
//!   character and is at most [`MAX_MESSAGE`] bytes;
//! - memory stays bounded: the most bytes live at once during a load, measured by a counting
//!   global allocator, stay under [`MEMORY_CEILING`] (the fixtures are under 1.3 MB; a count
//!   or size trusted from the file would ask for gigabytes).
//!
//! Case counts are bounded so the whole file runs in seconds on CI's two cores (2,700 loads);
//! `PROPTEST_CASES=N` runs N cases of each test instead, and the `cargo fuzz` targets in
//! `fuzz/` run the same parsers for as long as one likes. Seeds are random: a failure prints
//! its shrunk case, which belongs in `hostile_files.rs` as a unit test once fixed.

mod damaged;

use std::alloc::{GlobalAlloc, Layout, System};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use damaged::{
    assert_printable, gguf_layout, gguf_model, model_dir, safetensors_from_parts, safetensors_parts,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;
use strix::backend::cpu::CpuBackend;
use strix::model::{Logits, Model};

/// Longest message an error of a mutated file may have.
const MAX_MESSAGE: usize = 2048;
/// Most bytes a load of a mutated fixture may hold at once.
const MEMORY_CEILING: usize = 64 << 20;

// --- a global allocator that knows the peak ------------------------------------------------

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are only
// arithmetic on the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The tests of this file measure the process's allocations, so they run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `f` and returns its result and the most bytes that were live at once beyond those
/// live before it.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(before))
}

// --- checking one mutated model ------------------------------------------------------------

/// What happened to the mutated files, for the counts each test prints.
#[derive(Default, Debug)]
struct Tally {
    loaded: usize,
    refused: usize,
    peak: usize,
}

/// Loads `path` (a model directory or GGUF file whose files live under `root`), and checks
/// the properties of the module doc. A model that loads runs three tokens.
fn check_load(path: &Path, root: &Path, tally: &Mutex<Tally>) -> Result<(), TestCaseError> {
    let (outcome, peak) = peak_during(|| {
        Model::load_path(path, CpuBackend::new(), None).map(|model| {
            let vocab = model.config.vocab_size as u32;
            let ids: Vec<u32> = [1, 2, 3].iter().map(|i| i % vocab).collect();
            let mut session = model.new_session(8);
            // Weights may hold anything; the pass must not panic, its values are not checked.
            let _ = model.forward(&mut session, &ids, Logits::Last);
        })
    });
    let mut t = tally.lock().unwrap();
    t.peak = t.peak.max(peak);
    prop_assert!(peak <= MEMORY_CEILING, "{} bytes live at once while loading", peak);
    match outcome {
        Ok(()) => t.loaded += 1,
        Err(e) => {
            t.refused += 1;
            let msg = e.to_string();
            let root = root.display().to_string();
            prop_assert!(msg.contains(&root), "the error does not name the file: {msg}");
            prop_assert!(msg.len() <= MAX_MESSAGE, "a {}-byte message: {msg}", msg.len());
            assert_printable(&msg);
        }
    }
    Ok(())
}

/// A runner of `cases` cases (`PROPTEST_CASES` overrides it, for longer runs by hand).
fn runner(cases: u32) -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(cases);
    // No regression files: a failure prints its minimal case, to be made a unit test.
    TestRunner::new(Config { cases, failure_persistence: None, max_shrink_iters: 256, ..Config::default() })
}

/// Runs `cases` cases of `strategy`: `write` puts each case's mutated files in place and
/// returns the path to load and the folder its files live under, and the load is checked
/// (`check_load`). Prints the tally, labelled `what`, and returns it.
fn load_mutations<S: Strategy>(
    what: &str,
    cases: u32,
    strategy: S,
    write: impl Fn(S::Value) -> (PathBuf, PathBuf),
) -> Tally {
    let tally = Mutex::new(Tally::default());
    runner(cases)
        .run(&strategy, |case| {
            let (path, root) = write(case);
            check_load(&path, &root, &tally)
        })
        .unwrap();
    let t = tally.into_inner().unwrap();
    println!("{what}: {t:?}");
    t
}

/// [`load_mutations`] of one file of model directories: each case picks one of `dirs` (`i`)
/// and writes its `file` as `mutate(i, edits)` makes it, with one to three edits.
fn load_mutated_file<S: Strategy>(
    what: &str,
    cases: u32,
    dirs: &[tempfile::TempDir],
    file: &str,
    edit: S,
    mutate: impl Fn(usize, &[S::Value]) -> Vec<u8>,
) -> Tally {
    load_mutations(what, cases, (any::<Index>(), prop::collection::vec(edit, 1..4)), |(which, edits)| {
        let i = which.index(dirs.len());
        let dir = dirs[i].path();
        fs::write(dir.join(file), mutate(i, &edits)).unwrap();
        (dir.to_path_buf(), dir.to_path_buf())
    })
}

// --- byte-level mutations ------------------------------------------------------------------

/// A change of a file's bytes. Positions are drawn in the header (where a parser reads
/// counts, lengths and offsets) three times out of four, else anywhere.
#[derive(Clone, Debug)]
enum ByteEdit {
    Flip {
        at: Index,
        bit: u8,
        in_header: bool,
    },
    Set {
        at: Index,
        value: u8,
        in_header: bool,
    },
    Truncate {
        at: Index,
    },
    /// Copies `len` bytes from one place of the file over another.
    Splice {
        from: Index,
        to: Index,
        len: usize,
    },
    Insert {
        at: Index,
        bytes: Vec<u8>,
        in_header: bool,
    },
    Delete {
        at: Index,
        len: usize,
        in_header: bool,
    },
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    let header = prop::bool::weighted(0.75);
    let at = any::<Index>;
    prop_oneof![
        3 => (at(), 0u8..8, header)
            .prop_map(|(at, bit, in_header)| ByteEdit::Flip { at, bit, in_header }),
        2 => (at(), any::<u8>(), header)
            .prop_map(|(at, value, in_header)| ByteEdit::Set { at, value, in_header }),
        1 => at().prop_map(|at| ByteEdit::Truncate { at }),
        1 => (at(), at(), 1usize..64).prop_map(|(from, to, len)| ByteEdit::Splice { from, to, len }),
        1 => (at(), prop::collection::vec(any::<u8>(), 1..16), header)
            .prop_map(|(at, bytes, in_header)| ByteEdit::Insert { at, bytes, in_header }),
        1 => (at(), 1usize..16, header)
            .prop_map(|(at, len, in_header)| ByteEdit::Delete { at, len, in_header }),
    ]
}

fn apply_bytes(b: &mut Vec<u8>, header_len: usize, edit: &ByteEdit) {
    if b.is_empty() {
        return;
    }
    let pick = |at: &Index, in_header: bool| {
        at.index(if in_header { header_len.clamp(1, b.len()) } else { b.len() })
    };
    match edit {
        ByteEdit::Flip { at, bit, in_header } => {
            let i = pick(at, *in_header);
            b[i] ^= 1 << bit;
        }
        ByteEdit::Set { at, value, in_header } => {
            let i = pick(at, *in_header);
            b[i] = *value;
        }
        ByteEdit::Truncate { at } => {
            let len = at.index(b.len());
            b.truncate(len);
        }
        ByteEdit::Splice { from, to, len } => {
            let (from, to) = (from.index(b.len()), to.index(b.len()));
            let len = (*len).min(b.len() - from).min(b.len() - to);
            let chunk = b[from..from + len].to_vec();
            b[to..to + len].copy_from_slice(&chunk);
        }
        ByteEdit::Insert { at, bytes, in_header } => {
            let i = pick(at, *in_header);
            b.splice(i..i, bytes.iter().copied());
        }
        ByteEdit::Delete { at, len, in_header } => {
            let i = pick(at, *in_header);
            let end = (i + len).min(b.len());
            b.drain(i..end);
        }
    }
}

/// A number a field is set to: the edges a parser must survive, or another field's value.
#[derive(Clone, Debug)]
enum Number {
    Zero,
    One,
    Small(u8),
    PowerOfTwo(u8),
    Max,
    /// The field's own value moved by a little.
    Nudged(i8),
    /// The value of another field of the same kind (another tensor's offset, type...).
    Other(Index),
}

fn number() -> impl Strategy<Value = Number> {
    prop_oneof![
        Just(Number::Zero),
        Just(Number::One),
        any::<u8>().prop_map(Number::Small),
        (0u8..64).prop_map(Number::PowerOfTwo),
        Just(Number::Max),
        any::<i8>().prop_map(Number::Nudged),
        any::<Index>().prop_map(Number::Other),
    ]
}

impl Number {
    fn value(&self, own: u64, others: &[u64]) -> u64 {
        match self {
            Number::Zero => 0,
            Number::One => 1,
            Number::Small(v) => u64::from(*v),
            Number::PowerOfTwo(p) => 1u64 << p,
            Number::Max => u64::MAX,
            Number::Nudged(d) => own.wrapping_add_signed(i64::from(*d)),
            Number::Other(i) => others[i.index(others.len())],
        }
    }
}

// --- GGUF ----------------------------------------------------------------------------------

const GGUF_FILES: [&str; 6] = [
    "causal-bf16-gdn3x.bf16.gguf",
    "causal-bf16-gdn3x.q8_0.gguf",
    "causal-bf16-gdn3x.q4_0.gguf",
    "causal-bf16-gdn3x.q4_k_m.gguf",
    "causal-f32-tied-gdn2x.f32.gguf",
    "causal-f32-tied-gdn2x.q8_0.gguf",
];

/// The kinds of GGUF header field that parsers trust, as an enum and a list of them all.
macro_rules! gguf_fields {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// A kind of GGUF header field that parsers trust.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        enum GgufField {
            $($(#[$doc])* $name,)*
        }
        impl GgufField {
            const ALL: &'static [GgufField] = &[$(GgufField::$name,)*];
        }
    };
}
gguf_fields! {
    TensorCount,
    MetadataCount,
    KeyLength,
    ValueType,
    /// A string value's length, or an array's element count.
    ValueLength,
    ArrayElementType,
    NameLength,
    DimCount,
    Dim,
    TensorType,
    TensorOffset,
}

/// Every field of one kind in a file: (position, width in bytes).
fn gguf_fields(b: &[u8], kind: GgufField) -> Vec<(usize, usize)> {
    let l = gguf_layout(b);
    let ty_at = |k: &damaged::KvAt| u32::from_le_bytes(b[k.type_at..k.type_at + 4].try_into().unwrap());
    match kind {
        GgufField::TensorCount => vec![(l.n_tensors_at, 8)],
        GgufField::MetadataCount => vec![(l.n_kv_at, 8)],
        GgufField::KeyLength => l.kvs.iter().map(|k| (k.key_at, 8)).collect(),
        GgufField::ValueType => l.kvs.iter().map(|k| (k.type_at, 4)).collect(),
        GgufField::ValueLength => l
            .kvs
            .iter()
            .filter_map(|k| match ty_at(k) {
                8 => Some((k.value_at, 8)),
                9 => Some((k.value_at + 4, 8)),
                _ => None,
            })
            .collect(),
        GgufField::ArrayElementType => {
            l.kvs.iter().filter(|k| ty_at(k) == 9).map(|k| (k.value_at, 4)).collect()
        }
        GgufField::NameLength => l.tensors.iter().map(|t| (t.name_at, 8)).collect(),
        GgufField::DimCount => l.tensors.iter().map(|t| (t.n_dims_at, 4)).collect(),
        GgufField::Dim => {
            l.tensors.iter().flat_map(|t| (0..t.dims.len()).map(move |i| (t.dim_at(i), 8))).collect()
        }
        GgufField::TensorType => l.tensors.iter().map(|t| (t.type_at, 4)).collect(),
        GgufField::TensorOffset => l.tensors.iter().map(|t| (t.offset_at, 8)).collect(),
    }
}

#[derive(Clone, Debug)]
enum GgufEdit {
    Bytes(ByteEdit),
    Field { kind: GgufField, which: Index, to: Number },
}

fn gguf_edit() -> impl Strategy<Value = GgufEdit> {
    let kind = prop::sample::select(GgufField::ALL.to_vec());
    prop_oneof![
        byte_edit().prop_map(GgufEdit::Bytes),
        (kind, any::<Index>(), number()).prop_map(|(kind, which, to)| GgufEdit::Field { kind, which, to }),
    ]
}

fn read_le(b: &[u8], at: usize, width: usize) -> u64 {
    let mut x = [0u8; 8];
    x[..width].copy_from_slice(&b[at..at + width]);
    u64::from_le_bytes(x)
}

/// Applies field edits to the valid file first (so the fields are where the layout says),
/// then the byte edits.
fn mutate_gguf(orig: &[u8], edits: &[GgufEdit]) -> Vec<u8> {
    let mut b = orig.to_vec();
    for e in edits {
        if let GgufEdit::Field { kind, which, to } = e {
            let fields = gguf_fields(orig, *kind);
            let (at, width) = fields[which.index(fields.len())];
            let others: Vec<u64> = fields.iter().map(|&(a, w)| read_le(orig, a, w)).collect();
            let v = to.value(read_le(orig, at, width), &others);
            b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
        }
    }
    let header_len = gguf_layout(orig).table_end;
    for e in edits {
        if let GgufEdit::Bytes(edit) = e {
            apply_bytes(&mut b, header_len, edit);
        }
    }
    b
}

fn fixture_bytes(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn mutated_gguf_files_load_or_fail_cleanly() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let files: Vec<Vec<u8>> = GGUF_FILES.iter().map(|f| fixture_bytes(&gguf_model(f))).collect();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("mutated.gguf");
    let strategy = (any::<Index>(), prop::collection::vec(gguf_edit(), 1..4));
    let t = load_mutations("mutated GGUF files", 1000, strategy, |(file, edits)| {
        fs::write(&path, mutate_gguf(&files[file.index(files.len())], &edits)).unwrap();
        (path.clone(), tmp.path().to_path_buf())
    });
    assert!(t.refused > 0, "no mutation was refused: the mutations do not reach the parser");
}

// --- safetensors ---------------------------------------------------------------------------

const DTYPES: [&str; 12] =
    ["F32", "F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "F4", "f32", "X"];

#[derive(Clone, Debug)]
enum HeaderEdit {
    Dtype {
        entry: Index,
        dtype: Index,
    },
    Dim {
        entry: Index,
        dim: Index,
        to: Number,
    },
    PushDim {
        entry: Index,
        to: Number,
    },
    PopDim {
        entry: Index,
    },
    Offset {
        entry: Index,
        end: bool,
        to: Number,
    },
    Remove {
        entry: Index,
    },
    /// The entry again under another name (same bytes: overlapping data).
    Duplicate {
        entry: Index,
    },
    Rename {
        entry: Index,
        name: String,
    },
    Metadata {
        value: JsonValue,
    },
    /// An entry's field replaced by a value of any JSON type.
    FieldType {
        entry: Index,
        field: Index,
        value: JsonValue,
    },
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    prop_oneof![
        (any::<Index>(), any::<Index>()).prop_map(|(entry, dtype)| HeaderEdit::Dtype { entry, dtype }),
        (any::<Index>(), any::<Index>(), number()).prop_map(|(entry, dim, to)| HeaderEdit::Dim {
            entry,
            dim,
            to
        }),
        (any::<Index>(), number()).prop_map(|(entry, to)| HeaderEdit::PushDim { entry, to }),
        any::<Index>().prop_map(|entry| HeaderEdit::PopDim { entry }),
        (any::<Index>(), any::<bool>(), number()).prop_map(|(entry, end, to)| HeaderEdit::Offset {
            entry,
            end,
            to
        }),
        any::<Index>().prop_map(|entry| HeaderEdit::Remove { entry }),
        any::<Index>().prop_map(|entry| HeaderEdit::Duplicate { entry }),
        (any::<Index>(), name()).prop_map(|(entry, name)| HeaderEdit::Rename { entry, name }),
        json_value().prop_map(|value| HeaderEdit::Metadata { value }),
        (any::<Index>(), any::<Index>(), json_value())
            .prop_map(|(entry, field, value)| HeaderEdit::FieldType { entry, field, value }),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("__metadata__".to_string()),
        Just("model.norm.weight".to_string()),
        Just("\x1b[31mred\x1b[0m".to_string()),
        "[a-z._0-9]{1,40}",
        Just("x".repeat(5000)),
    ]
}

fn edit_header(header: &mut Value, edit: &HeaderEdit) {
    let obj = header.as_object_mut().unwrap();
    let names: Vec<String> = obj.keys().filter(|k| *k != "__metadata__").cloned().collect();
    if names.is_empty() {
        return;
    }
    let pick = |i: &Index| names[i.index(names.len())].clone();
    let others = |field: &str, obj: &serde_json::Map<String, Value>| -> Vec<u64> {
        obj.values().filter_map(|v| v.get(field)?.as_array()?.first()?.as_u64()).chain([0]).collect()
    };
    match edit {
        HeaderEdit::Dtype { entry, dtype } => {
            obj[&pick(entry)]["dtype"] = DTYPES[dtype.index(DTYPES.len())].into();
        }
        HeaderEdit::Dim { entry, dim, to } => {
            let dims = others("shape", obj);
            if let Some(shape) = obj[&pick(entry)]["shape"].as_array_mut().filter(|s| !s.is_empty()) {
                let i = dim.index(shape.len());
                let own = shape[i].as_u64().unwrap_or(0);
                shape[i] = to.value(own, &dims).into();
            }
        }
        HeaderEdit::PushDim { entry, to } => {
            if let Some(shape) = obj[&pick(entry)]["shape"].as_array_mut() {
                shape.push(to.value(1, &[1]).into());
            }
        }
        HeaderEdit::PopDim { entry } => {
            if let Some(shape) = obj[&pick(entry)]["shape"].as_array_mut() {
                shape.pop();
            }
        }
        HeaderEdit::Offset { entry, end, to } => {
            let starts = others("data_offsets", obj);
            if let Some(offsets) = obj[&pick(entry)]["data_offsets"].as_array_mut() {
                let i = usize::from(*end).min(offsets.len().saturating_sub(1));
                if let Some(o) = offsets.get_mut(i) {
                    let own = o.as_u64().unwrap_or(0);
                    *o = to.value(own, &starts).into();
                }
            }
        }
        HeaderEdit::Remove { entry } => {
            obj.remove(&pick(entry));
        }
        HeaderEdit::Duplicate { entry } => {
            let name = pick(entry);
            let v = obj[&name].clone();
            obj.insert(format!("{name}.copy"), v);
        }
        HeaderEdit::Rename { entry, name } => {
            let v = obj.remove(&pick(entry)).unwrap();
            obj.insert(name.clone(), v);
        }
        HeaderEdit::Metadata { value } => {
            obj.insert("__metadata__".into(), value.to_json());
        }
        HeaderEdit::FieldType { entry, field, value } => {
            let fields = ["dtype", "shape", "data_offsets"];
            obj[&pick(entry)][fields[field.index(3)]] = value.to_json();
        }
    }
}

#[derive(Clone, Debug)]
enum SafetensorsEdit {
    Bytes(ByteEdit),
    Header(HeaderEdit),
    /// The header-length prefix changed (header and data kept).
    HeaderLength(Number),
}

fn safetensors_edit() -> impl Strategy<Value = SafetensorsEdit> {
    prop_oneof![
        2 => byte_edit().prop_map(SafetensorsEdit::Bytes),
        3 => header_edit().prop_map(SafetensorsEdit::Header),
        1 => number().prop_map(SafetensorsEdit::HeaderLength),
    ]
}

fn mutate_safetensors(orig: &[u8], edits: &[SafetensorsEdit]) -> Vec<u8> {
    let (mut header, data) = safetensors_parts(orig);
    for e in edits {
        if let SafetensorsEdit::Header(h) = e {
            edit_header(&mut header, h);
        }
    }
    let mut b = safetensors_from_parts(&header, &data);
    let header_len = 8 + read_le(&b, 0, 8) as usize;
    for e in edits {
        match e {
            SafetensorsEdit::HeaderLength(n) => {
                let v = n.value(header_len as u64 - 8, &[b.len() as u64]);
                b[..8].copy_from_slice(&v.to_le_bytes());
            }
            SafetensorsEdit::Bytes(edit) => apply_bytes(&mut b, header_len, edit),
            SafetensorsEdit::Header(_) => {}
        }
    }
    b
}

/// A model directory holding `fixture`'s config (the weights are written per case).
fn scratch_model(fixture: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors.index.json"] {
        let src = model_dir(fixture).join(f);
        if src.exists() {
            fs::copy(src, tmp.path().join(f)).unwrap();
        }
    }
    tmp
}

#[test]
fn mutated_safetensors_checkpoints_load_or_fail_cleanly() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let fixtures = ["causal-bf16-gdn3x", "vlm-f32-gdn2x"];
    let dirs: Vec<tempfile::TempDir> = fixtures.iter().map(|f| scratch_model(f)).collect();
    let weights: Vec<Vec<u8>> =
        fixtures.iter().map(|f| fixture_bytes(&model_dir(f).join("model.safetensors"))).collect();
    let mutate = |i: usize, edits: &[SafetensorsEdit]| mutate_safetensors(&weights[i], edits);
    let what = "mutated safetensors checkpoints";
    let t = load_mutated_file(what, 600, &dirs, "model.safetensors", safetensors_edit(), mutate);
    assert!(t.refused > 0 && t.loaded > 0, "{t:?}");
}

/// The shard index: names of tensors and shards changed, entries of other types, removed or
/// added, the whole file cut or flipped; one shard's header mutated alongside.
#[test]
fn mutated_shard_indexes_load_or_fail_cleanly() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const FIXTURE: &str = "causal-bf16-sharded";
    let dir = scratch_model(FIXTURE);
    let shards: Vec<String> = (1..=3).map(|i| format!("model-0000{i}-of-00003.safetensors")).collect();
    for s in &shards {
        fs::copy(model_dir(FIXTURE).join(s), dir.path().join(s)).unwrap();
    }
    let index: Value =
        serde_json::from_slice(&fixture_bytes(&model_dir(FIXTURE).join("model.safetensors.index.json")))
            .unwrap();
    let shard0 = fixture_bytes(&model_dir(FIXTURE).join(&shards[0]));
    let index_path = dir.path().join("model.safetensors.index.json");
    #[derive(Clone, Debug)]
    enum IndexEdit {
        Shard { entry: Index, to: String },
        Tensor { entry: Index, to: String },
        Entry { entry: Index, value: JsonValue },
        Remove { entry: Index },
        WeightMap(JsonValue),
        Text(ByteEdit),
        Shard0(SafetensorsEdit),
    }
    let shard_name = prop_oneof![
        Just("model-00002-of-00003.safetensors".to_string()),
        Just("../model-00001-of-00003.safetensors".to_string()),
        Just("/dev/zero".to_string()),
        Just("/etc/passwd".to_string()),
        Just(".".to_string()),
        Just("config.json".to_string()),
        Just("a\\b.safetensors".to_string()),
        name(),
    ];
    let edit = prop_oneof![
        (any::<Index>(), shard_name).prop_map(|(entry, to)| IndexEdit::Shard { entry, to }),
        (any::<Index>(), name()).prop_map(|(entry, to)| IndexEdit::Tensor { entry, to }),
        (any::<Index>(), json_value()).prop_map(|(entry, value)| IndexEdit::Entry { entry, value }),
        any::<Index>().prop_map(|entry| IndexEdit::Remove { entry }),
        json_value().prop_map(IndexEdit::WeightMap),
        byte_edit().prop_map(IndexEdit::Text),
        safetensors_edit().prop_map(IndexEdit::Shard0),
    ];
    let t = load_mutations("mutated shard indexes", 300, prop::collection::vec(edit, 1..3), |edits| {
        let mut v = index.clone();
        let mut shard_edits = Vec::new();
        let mut text_edits = Vec::new();
        for e in &edits {
            let map = v["weight_map"].as_object_mut();
            let names: Vec<String> = map.as_ref().map(|m| m.keys().cloned().collect()).unwrap_or_default();
            let pick = |i: &Index| names.get(i.index(names.len().max(1))).cloned();
            match (e, map) {
                (IndexEdit::Shard { entry, to }, Some(m)) => {
                    if let Some(n) = pick(entry) {
                        m[&n] = to.clone().into();
                    }
                }
                (IndexEdit::Tensor { entry, to }, Some(m)) => {
                    if let Some(n) = pick(entry) {
                        let f = m.remove(&n).unwrap();
                        m.insert(to.clone(), f);
                    }
                }
                (IndexEdit::Entry { entry, value }, Some(m)) => {
                    if let Some(n) = pick(entry) {
                        m[&n] = value.to_json();
                    }
                }
                (IndexEdit::Remove { entry }, Some(m)) => {
                    if let Some(n) = pick(entry) {
                        m.remove(&n);
                    }
                }
                (IndexEdit::WeightMap(value), _) => v["weight_map"] = value.to_json(),
                (IndexEdit::Text(b), _) => text_edits.push(b.clone()),
                (IndexEdit::Shard0(s), _) => shard_edits.push(s.clone()),
                _ => {}
            }
        }
        let mut text = serde_json::to_vec_pretty(&v).unwrap();
        let len = text.len();
        for b in &text_edits {
            apply_bytes(&mut text, len, b);
        }
        fs::write(&index_path, &text).unwrap();
        fs::write(dir.path().join(&shards[0]), mutate_safetensors(&shard0, &shard_edits)).unwrap();
        (dir.path().to_path_buf(), dir.path().to_path_buf())
    });
    assert!(t.refused > 0, "{t:?}");
}

// --- config.json ---------------------------------------------------------------------------

/// A JSON value of any type, leaning to the edges of each.
#[derive(Clone, Debug)]
enum JsonValue {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<JsonValue>),
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    fn to_json(&self) -> Value {
        match self {
            JsonValue::Null => Value::Null,
            JsonValue::Bool(b) => (*b).into(),
            JsonValue::Int(i) => match (i64::try_from(*i), u64::try_from(*i)) {
                (Ok(v), _) => v.into(),
                (_, Ok(v)) => v.into(),
                // Past u64: the JSON number as text (serde_json keeps it as f64).
                _ => serde_json::from_str(&i.to_string()).unwrap_or(Value::Null),
            },
            JsonValue::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
            JsonValue::Str(s) => s.clone().into(),
            JsonValue::List(items) => items.iter().map(JsonValue::to_json).collect(),
            JsonValue::Object(fields) => fields.iter().map(|(k, v)| (k.clone(), v.to_json())).collect(),
        }
    }
}

fn json_value() -> impl Strategy<Value = JsonValue> {
    let ints = prop::sample::select(vec![
        0i128,
        1,
        -1,
        2,
        3,
        4,
        7,
        8,
        16,
        32,
        63,
        64,
        255,
        1 << 31,
        1 << 32,
        1 << 62,
        i64::MAX as i128,
        u64::MAX as i128,
        i64::MIN as i128,
        1 << 70,
    ]);
    let floats = prop::sample::select(vec![0.0, 0.25, 0.5, 1.0, 1.5, -1.0, 1e-300, 1e308, -0.0, 1e7, 0.01]);
    let strings = prop_oneof![
        prop::sample::select(vec![
            "",
            "silu",
            "gelu",
            "default",
            "yarn",
            "linear_attention",
            "full_attention",
            "qwen3_5",
            "qwen3_5_text",
            "\x1b[31m",
            "\u{202e}evil",
        ])
        .prop_map(str::to_string),
        "[a-z_]{0,12}",
        Just("z".repeat(10_000)),
    ];
    let leaf = prop_oneof![
        Just(JsonValue::Null),
        any::<bool>().prop_map(JsonValue::Bool),
        ints.prop_map(JsonValue::Int),
        floats.prop_map(JsonValue::Float),
        strings.prop_map(JsonValue::Str),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(JsonValue::List),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3).prop_map(JsonValue::Object),
        ]
    })
}

#[derive(Clone, Debug)]
enum ConfigEdit {
    Set { field: Index, value: JsonValue },
    Remove { field: Index },
    Text(ByteEdit),
}

/// The JSON paths of every field of a config (objects' fields and list items), depth first.
fn json_paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let children: Vec<(String, &Value)> = match v {
        Value::Object(m) => m.iter().map(|(k, v)| (k.clone(), v)).collect(),
        Value::Array(a) => a.iter().enumerate().map(|(i, v)| (i.to_string(), v)).collect(),
        _ => return,
    };
    for (k, child) in children {
        prefix.push(k);
        out.push(prefix.clone());
        json_paths(child, prefix, out);
        prefix.pop();
    }
}

fn at_path<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, k| match v {
        Value::Object(m) => m.get_mut(k),
        Value::Array(a) => a.get_mut(k.parse::<usize>().ok()?),
        _ => None,
    })
}

fn mutate_config(orig: &Value, edits: &[ConfigEdit]) -> Vec<u8> {
    let mut v = orig.clone();
    let mut paths = Vec::new();
    json_paths(orig, &mut Vec::new(), &mut paths);
    for e in edits {
        match e {
            ConfigEdit::Set { field, value } => {
                if let Some(slot) = at_path(&mut v, &paths[field.index(paths.len())]) {
                    *slot = value.to_json();
                }
            }
            ConfigEdit::Remove { field } => {
                let path = &paths[field.index(paths.len())];
                let (last, parent) = path.split_last().unwrap();
                match at_path(&mut v, parent) {
                    Some(Value::Object(m)) => {
                        m.remove(last);
                    }
                    Some(Value::Array(a)) => {
                        if let Some(i) = last.parse::<usize>().ok().filter(|&i| i < a.len()) {
                            a.remove(i);
                        }
                    }
                    _ => {}
                }
            }
            ConfigEdit::Text(_) => {}
        }
    }
    let mut text = serde_json::to_vec_pretty(&v).unwrap();
    let len = text.len();
    for e in edits {
        if let ConfigEdit::Text(b) = e {
            apply_bytes(&mut text, len, b);
        }
    }
    text
}

#[test]
fn mutated_config_json_loads_or_fails_cleanly() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The flat and the multimodal layout, with their real weights: a change the weights do not
    // fit is refused by shape, one that fits must run.
    let fixtures = ["causal-bf16-gdn3x", "vlm-f32-gdn2x"];
    let dirs: Vec<tempfile::TempDir> = fixtures
        .iter()
        .map(|f| {
            let d = scratch_model(f);
            fs::copy(model_dir(f).join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
            d
        })
        .collect();
    let configs: Vec<Value> = fixtures
        .iter()
        .map(|f| serde_json::from_slice(&fixture_bytes(&model_dir(f).join("config.json"))).unwrap())
        .collect();
    let edit = prop_oneof![
        4 => (any::<Index>(), json_value()).prop_map(|(field, value)| ConfigEdit::Set { field, value }),
        2 => any::<Index>().prop_map(|field| ConfigEdit::Remove { field }),
        1 => byte_edit().prop_map(ConfigEdit::Text),
    ];
    let mutate = |i: usize, edits: &[ConfigEdit]| mutate_config(&configs[i], edits);
    let t = load_mutated_file("mutated config.json", 800, &dirs, "config.json", edit, mutate);
    assert!(t.refused > 0 && t.loaded > 0, "{t:?}");
}
