//! The one error type of the library. Every variant names what is at fault: the file,
//! the tensor, the config field or the request parameter.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A config file is unreadable, has an unknown model type, or a field is missing,
    /// mistyped or inconsistent with another.
    #[error("{file}: {message}")]
    Config { file: PathBuf, message: String },

    /// A checkpoint file is corrupt, truncated, or a tensor is missing, mis-shaped or of an
    /// unsupported dtype.
    #[error("{file}: {message}")]
    Checkpoint { file: PathBuf, message: String },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
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
