//! The one error type of the library. Every variant names what is at fault: the file,
//! the tensor, the config field or the request parameter.
//!
//! Messages quote what files say (tensor names, metadata keys, JSON values), and a file may
//! say anything: [`printable`] escapes control characters and caps the length of such a
//! quote, and the variants that carry a path or a file's message escape them again when
//! displayed (and so do template errors, which may quote the template), so nothing from a
//! file can drive the terminal that shows the error.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", escaped_path(path))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file that cannot be what it should be, before its contents are even parsed: not a
    /// regular file (a FIFO, a device, a directory), larger than the cap for its kind, or a
    /// git-lfs pointer in place of the file itself.
    #[error("{}: {}", escaped_path(path), escape_controls(message))]
    File { path: PathBuf, message: String },

    /// A path given as a model that is none: a directory without `config.json`, a file that
    /// is neither a model directory nor a GGUF file.
    #[error("{}: {}", escaped_path(path), escape_controls(message))]
    NotAModel { path: PathBuf, message: String },

    /// A config file is unreadable, has an unknown model type, or a field is missing,
    /// mistyped or inconsistent with another.
    #[error("{}: {}", escaped_path(file), escape_controls(message))]
    Config { file: PathBuf, message: String },

    /// A checkpoint file is corrupt, truncated, or a tensor is missing, mis-shaped or of an
    /// unsupported dtype.
    #[error("{}: {}", escaped_path(file), escape_controls(message))]
    Checkpoint { file: PathBuf, message: String },

    #[error("tokenizer: {}", escape_controls(.0))]
    Tokenizer(String),

    /// A template's syntax or rendering error; it may quote the template, which came from a
    /// file (tokenizer_config.json, a GGUF's `tokenizer.chat_template`), so it is escaped too.
    #[error("chat template: {}", escape_controls(.0))]
    Template(String),

    /// A caller asked for something the model or session cannot do (prompt longer than the
    /// context, token id outside the vocabulary, bad sampling parameter...).
    #[error("{0}")]
    Input(String),

    #[error("model download: {0}")]
    Download(String),

    /// The model's output holds NaN or +∞ (or nothing above −∞): no token can be drawn.
    #[error(transparent)]
    NonFinite(#[from] crate::sampling::NonFiniteLogits),

    /// The CUDA driver, a device, NVRTC or cuBLAS is missing or failed.
    #[error("cuda: {0}")]
    Cuda(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: path.into(), source }
    }

    pub fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Error {
        Error::File { path: path.into(), message: message.into() }
    }

    pub fn not_a_model(path: impl Into<PathBuf>, message: impl Into<String>) -> Error {
        Error::NotAModel { path: path.into(), message: message.into() }
    }

    pub fn config(file: impl Into<PathBuf>, message: impl Into<String>) -> Error {
        Error::Config { file: file.into(), message: message.into() }
    }

    pub fn checkpoint(file: impl Into<PathBuf>, message: impl Into<String>) -> Error {
        Error::Checkpoint { file: file.into(), message: message.into() }
    }

    pub fn input(message: impl Into<String>) -> Error {
        Error::Input(message.into())
    }
}

/// The most characters of a file's string that a message quotes; longer ones are cut and
/// say how long they were. Tensor names and metadata keys are far shorter (~60).
pub const MAX_QUOTED_CHARS: usize = 160;

/// A string read from a file, fit to be quoted in an error message: control characters and
/// the invisible characters that reorder or hide text are escaped (`\x1b`, `\u{202e}`), and
/// past [`MAX_QUOTED_CHARS`] characters it is cut, saying how many bytes it had.
pub fn printable(text: &str) -> String {
    printable_capped(text, MAX_QUOTED_CHARS)
}

/// [`printable`] with another cap, for a message of another crate that may quote a file
/// (a JSON parser's "unknown variant `…`").
pub fn printable_capped(text: &str, max_chars: usize) -> String {
    quoted(text.chars(), text.len(), max_chars)
}

/// Bytes from a file that should have been text, fit for a message: valid UTF-8 as
/// [`printable`] shows it, other bytes as `\xNN`, capped alike.
pub fn printable_bytes(bytes: &[u8]) -> String {
    let chars = bytes.utf8_chunks().flat_map(|chunk| {
        let invalid = chunk.invalid().iter().map(|&b| Err(b));
        chunk.valid().chars().map(Ok).chain(invalid)
    });
    let mut out = String::new();
    for (n, c) in chars.enumerate() {
        if n == MAX_QUOTED_CHARS {
            let _ = write!(out, "… ({} bytes in all)", bytes.len());
            break;
        }
        match c {
            Ok(c) => push_escaped(&mut out, c),
            Err(b) => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out
}

fn quoted(chars: impl Iterator<Item = char>, total_bytes: usize, max_chars: usize) -> String {
    let mut out = String::new();
    for (n, c) in chars.enumerate() {
        if n == max_chars {
            let _ = write!(out, "… ({total_bytes} bytes in all)");
            break;
        }
        push_escaped(&mut out, c);
    }
    out
}

/// `text` with its control characters escaped (nothing cut): the last line of defence for
/// messages that may hold a file's strings.
fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        push_escaped(&mut out, c);
    }
    Cow::Owned(out)
}

/// A path as a message shows it: lossy UTF-8 with control characters escaped (shard names
/// come from a file, and a directory name may hold anything).
fn escaped_path(path: &Path) -> String {
    escape_controls(&path.display().to_string()).into_owned()
}

/// Characters that a terminal acts on or that hide or reorder the text around them: C0 and
/// C1 controls (ESC, CSI...), DEL, zero-width characters, bidirectional overrides.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{206f}' | '\u{feff}')
}

fn push_escaped(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if needs_escape(c) && (c as u32) < 0x80 => {
            let _ = write!(out, "\\x{:02x}", c as u32);
        }
        c if needs_escape(c) => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
        c => out.push(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_escapes_terminal_controls_and_caps_the_length() {
        assert_eq!(printable("blk.0.attn_q.weight"), "blk.0.attn_q.weight");
        assert_eq!(printable("a\x1b[2Jb\u{9b}c\u{202e}d\0\n"), "a\\x1b[2Jb\\u{9b}c\\u{202e}d\\x00\\n");
        let long = "é".repeat(1000);
        let shown = printable(&long);
        assert!(shown.starts_with(&"é".repeat(MAX_QUOTED_CHARS)), "{shown}");
        assert!(shown.ends_with("… (2000 bytes in all)"), "{shown}");
        assert_eq!(printable_bytes(b"ok\xff\x1b"), "ok\\xff\\x1b");
        assert_eq!(printable_bytes(&[0u8; 740]).chars().filter(|&c| c == '\\').count(), MAX_QUOTED_CHARS);
    }

    #[test]
    fn displayed_errors_carry_no_control_characters() {
        let e = Error::checkpoint("dir/\x1b]0;x\x07.gguf", "tensor `\x1b[31mred`");
        let shown = e.to_string();
        assert!(!shown.chars().any(needs_escape), "{shown:?}");
        assert_eq!(shown, "dir/\\x1b]0;x\\x07.gguf: tensor `\\x1b[31mred`");
        // Escaping is idempotent: what printable() made is displayed as it is.
        let e = Error::config("config.json", printable("\x1b[0m"));
        assert_eq!(e.to_string(), "config.json: \\x1b[0m");
    }
}
