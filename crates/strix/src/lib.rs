//! strix: an inference engine for the Qwen3.5 family of hybrid language models.
//!
//! The layers, from the file on disk to the sampled token (see ARCHITECTURE.md):
//! [`checkpoint`] reads safetensors → [`config`] and [`model::Weights`] describe the model →
//! [`gguf`] reads llama.cpp files → [`model`] is the forward pass, written once against the
//! [`backend::Backend`] ops → [`backend::cpu`] and [`backend::cuda`] implement those ops →
//! [`session`] holds the per-sequence state and
//! [`generate`] drives decoding with [`sampling`], [`tokenizer`] and [`chat`].

pub mod backend;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod constraint;
pub mod error;
pub mod files;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod model;
pub mod perplexity;
pub mod quant;
pub mod sampling;
pub mod session;
pub mod synthetic;
pub mod tensor;
#[cfg(test)]
mod testing;
pub mod tokenizer;

pub use error::{Error, Result};
