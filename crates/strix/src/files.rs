//! Opening a model's files without trusting what the path points to: every loader goes
//! through here.
//!
//! Only regular files are opened. A path naming a FIFO, a socket or a device
//! (`config.json -> /dev/zero`) is refused from its metadata before any `open`, because
//! opening a FIFO with no writer blocks forever and a device reads without end; the open
//! itself is non-blocking too, and the opened handle is checked again, so a file swapped
//! for a FIFO between the two steps cannot hang the load either. The small text files
//! (JSON, the tokenizer, chat templates) are read under a size cap ([`Cap`]); weights
//! (safetensors, GGUF) are memory-mapped, so their size costs address space, not memory.
//!
//! A git-lfs pointer (a clone made without git-lfs leaves these ~130-byte text files in
//! place of every large file) is recognised wherever a file is read, and the error says to
//! fetch the real file.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{Error, Result};

/// How large a small file of a model may be before it is refused unread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap {
    /// What the file is, for the message ("JSON file", "tokenizer.json").
    pub what: &'static str,
    pub bytes: u64,
}

/// `config.json`, `generation_config.json`, `tokenizer_config.json`, `chat_template.json`,
/// `model.safetensors.index.json`. Real ones are a few KB (Qwen3.5's tokenizer_config.json
/// with its template ~20 KB); the largest index files of published checkpoints (tens of
/// thousands of tensors) stay under 10 MB.
pub const JSON_CAP: Cap = Cap { what: "JSON file", bytes: 16 << 20 };

/// `tokenizer.json`: Qwen3.5's is ~12 MB (248k tokens, 247k merges); the largest
/// vocabularies published (Gemma's 262k tokens) are ~33 MB.
pub const TOKENIZER_CAP: Cap = Cap { what: "tokenizer.json", bytes: 64 << 20 };

/// `chat_template.jinja`: Qwen3.5's is ~7 KB.
pub const TEMPLATE_CAP: Cap = Cap { what: "chat template", bytes: 1 << 20 };

/// What every git-lfs pointer file starts with (git-lfs's spec, v1 and the pre-release
/// `hawser` URL share the `version https://` line; only this one is in use).
const LFS_POINTER_PREFIX: &[u8] = b"version https://git-lfs.github.com/spec/";

/// The metadata of `path` (following symlinks), refusing anything but a regular file.
pub fn regular_file_metadata(path: &Path) -> Result<Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    check_regular(path, &meta)?;
    Ok(meta)
}

fn check_regular(path: &Path, meta: &Metadata) -> Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    Err(Error::file(path, format!("is {}, not a regular file", kind_of(meta))))
}

/// "a directory", "a FIFO", "a character device"... for messages.
fn kind_of(meta: &Metadata) -> &'static str {
    let ty = meta.file_type();
    if ty.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ty.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ty.is_socket() {
            return "a socket";
        }
        if ty.is_char_device() {
            return "a character device";
        }
        if ty.is_block_device() {
            return "a block device";
        }
    }
    "not a regular file"
}

/// Opens a regular file for reading: refused from its metadata if it is anything else,
/// opened without blocking (a FIFO put in its place meanwhile cannot hang the open), and
/// checked again through the handle. Returns the file and its metadata.
pub fn open_regular(path: &Path) -> Result<(File, Metadata)> {
    regular_file_metadata(path)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    check_regular(path, &meta)?;
    Ok((file, meta))
}

/// The bytes of a small regular file, at most `cap.bytes` of them; a larger file is refused
/// without being read, and so is a git-lfs pointer.
pub fn read_capped(path: &Path, cap: Cap) -> Result<Vec<u8>> {
    let (file, meta) = open_regular(path)?;
    let too_large = || {
        Error::file(
            path,
            format!(
                "is larger than the {} bytes a {} may have: not a real one, refused unread",
                cap.bytes, cap.what
            ),
        )
    };
    if meta.len() > cap.bytes {
        return Err(too_large());
    }
    // The size can change under us (and /proc files report 0): read one byte past the cap
    // to notice, never more.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(cap.bytes + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > cap.bytes {
        return Err(too_large());
    }
    check_not_lfs_pointer(path, &bytes)?;
    Ok(bytes)
}

/// A small text file under `cap`, which must be UTF-8.
pub fn read_text(path: &Path, cap: Cap) -> Result<String> {
    let bytes = read_capped(path, cap)?;
    String::from_utf8(bytes).map_err(|e| {
        Error::file(
            path,
            format!("is not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// A JSON file under [`JSON_CAP`], parsed; a syntax error is an [`Error::Config`] naming it.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = read_text(path, JSON_CAP)?;
    serde_json::from_str(&text).map_err(|e| Error::config(path, format!("invalid JSON: {e}")))
}

/// Memory-maps a regular file read-only (weights), refusing a git-lfs pointer.
pub fn map_regular(path: &Path) -> Result<Mmap> {
    let (file, _) = open_regular(path)?;
    // SAFETY: the file is opened read-only; strix never writes a model file while it is
    // mapped (modifying one under a running process is outside our contract).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    check_not_lfs_pointer(path, &map)?;
    Ok(map)
}

/// Whether `bytes` are a git-lfs pointer file rather than the content it stands for.
pub fn is_lfs_pointer(bytes: &[u8]) -> bool {
    // A pointer is a few lines of text (spec: under 1024 bytes); the size check keeps a
    // large file that happens to start with the line from being taken for one.
    bytes.len() < 1024 && bytes.starts_with(LFS_POINTER_PREFIX)
}

/// Refuses a git-lfs pointer with what to do about it.
pub fn check_not_lfs_pointer(path: &Path, bytes: &[u8]) -> Result<()> {
    if !is_lfs_pointer(bytes) {
        return Ok(());
    }
    let text = String::from_utf8_lossy(bytes);
    let size = text
        .lines()
        .find_map(|l| l.strip_prefix("size "))
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(String::new(), |n| format!(" (the real file has {n} bytes)"));
    Err(Error::file(
        path,
        format!(
            "is a git-lfs pointer, not the file itself{size}: the repository was cloned without \
             git-lfs. Fetch the real files with `git lfs pull` in the model's directory (or download \
             the model again)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lfs_pointers_are_recognised_with_their_size() {
        let pointer = b"version https://git-lfs.github.com/spec/v1\n\
            oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n";
        assert!(is_lfs_pointer(pointer));
        let e = check_not_lfs_pointer(Path::new("m/model.safetensors"), pointer).unwrap_err().to_string();
        assert!(e.contains("m/model.safetensors: is a git-lfs pointer"), "{e}");
        assert!(e.contains("12345 bytes") && e.contains("git lfs pull"), "{e}");
        assert!(!is_lfs_pointer(b"{\"version https://git-lfs.github.com/spec/v1\"}"));
        let mut big = pointer.to_vec();
        big.resize(4096, b' ');
        assert!(!is_lfs_pointer(&big));
    }
}
