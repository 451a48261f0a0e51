//! Text ↔ token ids: a thin wrapper over the Hugging Face `tokenizers` crate that reads a
//! checkpoint's `tokenizer.json`, plus [`StreamDecoder`], which turns the ids of a
//! generation into text one token at a time without ever splitting a character.
//!
//! Qwen3.5's tokenizer is byte-level BPE: a token is a run of bytes, and a character
//! outside ASCII (CJK, emoji...) is often spread over several tokens. Decoding a single
//! such token yields U+FFFD, which is why streaming needs its own decoder.

use std::path::Path;
use std::sync::Arc;

use crate::error::{printable, printable_capped, Error, Result};
use crate::files;

/// A checkpoint's tokenizer. Cloning is cheap (the vocabulary is shared), so a
/// [`StreamDecoder`] can own a clone next to the generation loop that owns the original.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// Reads a `tokenizer.json`: a regular file under [`files::TOKENIZER_CAP`], not a
    /// git-lfs pointer. Errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = files::read_capped(path, files::TOKENIZER_CAP)?;
        Self::from_bytes(&bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {}", path.display(), tokenizer_message(e))))
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            // The parser's message may quote the file (an unknown variant): capped.
            .map_err(|e| {
                Error::Tokenizer(format!("invalid tokenizer.json: {}", printable_capped(&e.to_string(), 400)))
            })?;
        Ok(Tokenizer { inner: Arc::new(inner) })
    }

    /// The tokenizer of a model directory, or `None` when it has no `tokenizer.json` (one
    /// that is there but not a regular file is an error, not `None`).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let path = dir.as_ref().join("tokenizer.json");
        if path.symlink_metadata().is_err() {
            return Ok(None);
        }
        Self::from_file(&path).map(Some)
    }

    /// The tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata, rebuilt as the
    /// `tokenizer.json` Hugging Face ships for it: byte-level BPE (`tokenizer.ggml.model` =
    /// `gpt2`) with the vocabulary, merges and token types of the file and the pre-tokenizer
    /// that `tokenizer.ggml.pre` names (`qwen35`, `qwen2`). Tokens typed CONTROL or
    /// USER_DEFINED become added tokens (CONTROL ones special); UNUSED ones (the converter's
    /// `[PAD…]` fillers up to the embedding size) are left out. Errors name the file and key.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        let json = gguf_tokenizer_json(file)?;
        Self::from_bytes(json.to_string().as_bytes())
            .map_err(|e| Error::Tokenizer(format!("{}: {}", file.path().display(), tokenizer_message(e))))
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`,
    /// `<think>`...) become their own ids, as in the chat template's output.
    /// `add_special_tokens` asks the post-processor for the tokens it adds around a
    /// sequence (BOS and the like); Qwen's adds none.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        // encode_fast skips the character offsets, which nothing here uses.
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`. With `skip_special_tokens`, the tokens the checkpoint marks
    /// special (`<|im_end|>`...) are left out; Qwen marks `<think>` and the tool tags as
    /// ordinary, so they stay. An id outside the vocabulary is an error rather than
    /// silently dropped, as the underlying library would.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(Error::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.vocab_size()
            )));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("cannot decode ids: {e}")))
    }

    /// The id of a token, written as the vocabulary spells it (byte-level BPE spells a
    /// leading space `Ġ`) or as an added token's text (`<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary's spelling of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of token ids, added tokens included. The model's embedding table may be
    /// larger (Qwen3.5 pads it to 248,320), never smaller.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A decoder for the ids of one generation.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special_tokens)
    }
}

/// The pre-tokenizer split of Qwen3.5's `tokenizer.json` (llama.cpp: `LLAMA_VOCAB_PRE_TYPE_QWEN35`).
const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The pre-tokenizer split of Qwen2/Qwen3's `tokenizer.json` (llama.cpp: `qwen2`).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` name llama.cpp gives a `tokenizer.json` pre-tokenizer split.
pub fn gguf_pre_tokenizer_name(pattern: &str) -> Option<&'static str> {
    match pattern {
        QWEN35_PATTERN => Some("qwen35"),
        QWEN2_PATTERN => Some("qwen2"),
        _ => None,
    }
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

fn gguf_tokenizer_json(file: &crate::gguf::GgufFile) -> Result<serde_json::Value> {
    use serde_json::{json, Map, Value};
    let path = file.path().display();
    let bad = |m: String| Error::Tokenizer(format!("{path}: {m}"));
    let model = file.get_str("tokenizer.ggml.model").map_err(|e| bad(e.to_string()))?;
    if model != "gpt2" {
        return Err(bad(format!(
            "tokenizer.ggml.model is `{}`: only byte-level BPE (`gpt2`) tokenizers are supported",
            printable(model)
        )));
    }
    let pre = file.get_str("tokenizer.ggml.pre").map_err(|e| bad(e.to_string()))?;
    let (pattern, ignore_merges) = match pre {
        "qwen35" => (QWEN35_PATTERN, true),
        "qwen2" => (QWEN2_PATTERN, false),
        other => {
            return Err(bad(format!(
                "tokenizer.ggml.pre is `{}`: strix knows the pre-tokenizers `qwen35` and `qwen2`",
                printable(other)
            )))
        }
    };
    let tokens = file.get_str_array("tokenizer.ggml.tokens").map_err(|e| bad(e.to_string()))?;
    let types: Vec<i32> = if file.metadata("tokenizer.ggml.token_type").is_some() {
        let t = file.get_i32_array("tokenizer.ggml.token_type").map_err(|e| bad(e.to_string()))?;
        if t.len() != tokens.len() {
            return Err(bad(format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                t.len(),
                tokens.len()
            )));
        }
        t.to_vec()
    } else {
        vec![TOKEN_NORMAL; tokens.len()]
    };
    let merges = file.get_str_array("tokenizer.ggml.merges").map_err(|e| bad(e.to_string()))?;

    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        match ty {
            TOKEN_UNUSED => {}
            TOKEN_CONTROL | TOKEN_USER_DEFINED => added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == TOKEN_CONTROL,
            })),
            _ => {
                if vocab.insert(tok.clone(), Value::from(id)).is_some() {
                    return Err(bad(format!("tokenizer.ggml.tokens has `{}` twice", printable(tok))));
                }
            }
        }
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => Ok(json!([a, b])),
            _ => Err(bad(format!(
                "tokenizer.ggml.merges[{i}] is `{}`, not two tokens separated by a space",
                printable(m)
            ))),
        })
        .collect::<Result<Vec<_>>>()?;
    let byte_level = |prefix: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": prefix, "use_regex": prefix});
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]},
        "post_processor": byte_level(false),
        "decoder": byte_level(true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        },
    }))
}

fn tokenizer_message(e: Error) -> String {
    match e {
        Error::Tokenizer(message) => message,
        other => other.to_string(),
    }
}

/// Turns generated token ids into text incrementally.
///
/// Each [`push`](StreamDecoder::push) returns the text that the new id completes,
/// possibly empty: a token carrying the first bytes of a character is held back until
/// the tokens with its remaining bytes arrive. The concatenation of every push and the
/// final [`flush`](StreamDecoder::flush) equals [`Tokenizer::decode`] of all the ids.
///
/// The approach is the usual one (text-generation-inference, vLLM): decode the pending
/// ids together with the few ids before them, and emit the part past the previous
/// text once it no longer ends in U+FFFD. The context ids matter for decoders whose
/// output for a token depends on its neighbours (SentencePiece's leading space).
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The ids emitted last (context) followed by the ids not emitted yet. Older ids
    /// are dropped, so a long generation does not re-decode its history at every token.
    ids: Vec<u32>,
    /// `ids[..read]` is the context, `ids[read..]` the pending ids.
    read: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder { tokenizer, skip_special_tokens, ids: Vec::new(), read: 0 }
    }

    /// Adds one generated id and returns the text it completes (possibly empty). A bad
    /// id is an error and leaves the decoder as it was.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let emitted = self.emit();
        if emitted.is_err() {
            self.ids.pop();
        }
        emitted
    }

    /// [`StreamDecoder::push`] for an id a model sampled. Checkpoints pad the embedding past
    /// the tokenizer's vocabulary (Qwen3.5: 248,320 rows for about 248,000 tokens) and a
    /// model can sample those rows: they carry no text rather than failing the generation.
    pub fn push_sampled(&mut self, id: u32) -> Result<String> {
        if self.tokenizer.id_to_token(id).is_none() {
            return Ok(String::new());
        }
        self.push(id)
    }

    fn emit(&mut self) -> Result<String> {
        let before = self.decode(..self.read)?;
        let now = self.decode(..)?;
        if now.len() <= before.len() || now.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        // A decoder that rewrites earlier text would break the prefix property; hold
        // such text back rather than emit something inconsistent (flush emits it).
        let Some(new) = now.strip_prefix(before.as_str()) else {
            return Ok(String::new());
        };
        let new = new.to_owned();
        // The ids just emitted become the context of the next ones.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(new)
    }

    /// Emits whatever is still held back, replacing incomplete characters with U+FFFD,
    /// and resets the decoder for a new sequence.
    pub fn flush(&mut self) -> Result<String> {
        let before = self.decode(..self.read)?;
        let now = self.decode(..)?;
        let rest = now[common_prefix_len(&before, &now)..].to_owned();
        self.ids.clear();
        self.read = 0;
        Ok(rest)
    }

    fn decode(&self, range: impl std::slice::SliceIndex<[u32], Output = [u32]>) -> Result<String> {
        self.tokenizer.decode(&self.ids[range], self.skip_special_tokens)
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a character
/// boundary of both.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).find(|((_, x), y)| x != y).map_or(a.len().min(b.len()), |((i, _), _)| i)
}
