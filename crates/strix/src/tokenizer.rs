//! Text ↔ token ids: a thin wrapper over the Hugging Face `tokenizers` crate that reads a
//! checkpoint's `tokenizer.json`, plus [`StreamDecoder`], which turns the ids of a
//! generation into text one token at a time without ever splitting a character.
//!
//! Qwen3.5's tokenizer is byte-level BPE: a token is a run of bytes, and a character
//! outside ASCII (CJK, emoji...) is often spread over several tokens. Decoding a single
//! such token yields U+FFFD, which is why streaming needs its own decoder.
//!
//! [`Tokenizer::encode_within`] tokenizes text of untrusted length (a server's prompt) at a cost
//! bounded by the number of tokens it may have, not by the length of the text.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::error::{printable, printable_capped, Error, Result};
use crate::files;

/// A checkpoint's tokenizer. Cloning is cheap (the vocabulary is shared), so a
/// [`StreamDecoder`] can own a clone next to the generation loop that owns the original.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    /// Where a text may be cut for [`Tokenizer::encode_within`], worked out on first use.
    pieces: Arc<OnceLock<Pieces>>,
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
        Ok(Tokenizer { inner: Arc::new(inner), pieces: Arc::default() })
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

    /// Token ids of `text` (what [`Tokenizer::encode`] gives, without special tokens added),
    /// or `None` as soon as it is certain that there are more than `max_tokens` of them.
    ///
    /// Memory and time stay proportional to `max_tokens` (plus one piece), however long the
    /// text: tokenizing a few megabytes at once takes hundreds of bytes of the library's
    /// bookkeeping per byte of text, and seconds. For the pre-tokenizers of Qwen's tokenizers
    /// (`qwen35`, `qwen2`) the text is tokenized in pieces of a few kilobytes, cut only where
    /// the whole text's tokenization necessarily splits too (see [`Pieces::cut_after`]), so
    /// the ids are the whole text's, and counting stops once they pass `max_tokens`. A piece
    /// with no such cut is refused unseen when its bytes could not fit in the tokens left.
    /// Other tokenizers are tokenized whole, after that same bound on the text's length.
    pub fn encode_within(&self, text: &str, max_tokens: usize) -> Result<Option<Vec<u32>>> {
        self.encode_in_pieces(text, max_tokens, PIECE_BYTES)
    }

    fn encode_in_pieces(
        &self,
        text: &str,
        max_tokens: usize,
        piece_bytes: usize,
    ) -> Result<Option<Vec<u32>>> {
        let pieces = self.pieces.get_or_init(|| Pieces::of(&self.inner));
        if pieces.cannot_fit(text, max_tokens) {
            return Ok(None);
        }
        let Some(cuts) = &pieces.cuts else {
            let ids = self.encode(text, false)?;
            return Ok((ids.len() <= max_tokens).then_some(ids));
        };
        let mut ids = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let end = pieces.cut_after(cuts, text, start + piece_bytes);
            let left = max_tokens - ids.len();
            if pieces.cannot_fit(&text[start..end], left) {
                return Ok(None);
            }
            ids.extend(self.encode(&text[start..end], false)?);
            if ids.len() > max_tokens {
                return Ok(None);
            }
            start = end;
        }
        Ok(Some(ids))
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

    /// The bytes a token stands for. Byte-level BPE vocabularies spell bytes as printable
    /// characters (GPT-2's table: `Ġ` is a space); tokens outside that alphabet (added tokens)
    /// are their own UTF-8. Ids without a token (embedding padding) have no bytes.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(token) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        token.chars().map(gpt2_byte).collect::<Option<Vec<u8>>>().unwrap_or_else(|| token.into_bytes())
    }

    /// The ids of the added tokens the tokenizer marks special (`<|im_end|>`...), ascending;
    /// Qwen's `<think>` and `<tool_call>` are ordinary added tokens, not among them.
    pub fn special_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// A decoder for the ids of one generation.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special_tokens)
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: the byte a character of a byte-level BPE token
/// stands for. Bytes 33..=126, 161..=172 and 174..=255 stand for themselves; the other 68,
/// in order, are the characters from U+0100 on.
fn gpt2_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let code = c as u32;
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    // The 68 others, in order: 0..=32, 127..=160, 173.
    match code - 256 {
        n @ 0..=32 => Some(n as u8),
        n @ 33..=66 => Some((n - 33 + 127) as u8),
        67 => Some(173),
        _ => None,
    }
}

/// Bytes of text [`Tokenizer::encode_within`] tokenizes at a time (at least: a piece ends at
/// the first cut past this).
const PIECE_BYTES: usize = 4096;

/// NFC turns at most this many bytes of text into one (a Hangul syllable, three bytes, from its
/// three jamo of three bytes each; composing accents shrinks less): with margin.
const NFC_MAX_SHRINK: usize = 4;

/// How a tokenizer lets [`Tokenizer::encode_within`] cut a text.
struct Pieces {
    /// A letter or digit followed by a character that is none of letter, mark or digit, in the
    /// tokenizer's own regex engine (so its Unicode tables are the pre-tokenizer's); `None`
    /// when the tokenizer is not one whose cuts are known.
    cuts: Option<onig::Regex>,
    /// Every character of an added token (`<|im_start|>`...): a cut never falls before one.
    added_chars: Vec<char>,
    /// The most bytes of normalized text one token stands for, when the normalizer is NFC or
    /// none (so text shrinks by at most [`NFC_MAX_SHRINK`]); `None` for other normalizers.
    max_token_bytes: Option<usize>,
}

impl Pieces {
    fn of(tokenizer: &tokenizers::Tokenizer) -> Pieces {
        use tokenizers::NormalizerWrapper;
        let plain_normalizer = matches!(tokenizer.get_normalizer(), None | Some(NormalizerWrapper::NFC(_)));
        let added = tokenizer.get_added_tokens_decoder();
        let mut added_chars: Vec<char> = added.values().flat_map(|t| t.content.chars()).collect();
        added_chars.sort_unstable();
        added_chars.dedup();
        // Added tokens that take in the whitespace around them, or match only as whole words,
        // make a token depend on its neighbours beyond the cuts' reach.
        let plain_added = added.values().all(|t| !(t.lstrip || t.rstrip || t.single_word));
        let untruncated = tokenizer.get_truncation().is_none() && tokenizer.get_padding().is_none();
        let cuts = (plain_normalizer && plain_added && untruncated)
            .then(|| qwen_split(tokenizer))
            .flatten()
            .and_then(|_| onig::Regex::new(r"[\p{L}\p{N}][^\p{L}\p{M}\p{N}]").ok());
        // A token's text is at least as long in UTF-8 as the bytes it stands for; a byte-level
        // vocabulary (the split above ends in one) spells each byte as one character (`Ġ`).
        let vocab = tokenizer.get_vocab(false);
        let spelled = |token: &String| if cuts.is_some() { token.chars().count() } else { token.len() };
        let max_token_bytes = vocab
            .keys()
            .map(spelled)
            .chain(added.values().map(|t| t.content.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        Pieces { cuts, added_chars, max_token_bytes: plain_normalizer.then_some(max_token_bytes) }
    }

    /// Whether `text` certainly holds more than `tokens` tokens: each token stands for at most
    /// `max_token_bytes` bytes of the normalized text (ASCII is its own NFC).
    fn cannot_fit(&self, text: &str, tokens: usize) -> bool {
        let shrink = if text.is_ascii() { 1 } else { NFC_MAX_SHRINK };
        self.max_token_bytes
            .is_some_and(|most| text.len() / shrink > most.saturating_mul(tokens.saturating_add(1)))
    }

    /// The first cut at or after byte `from` of `text`, or its end.
    ///
    /// A cut goes between a letter or digit `p` and a character `c` that is none of letter,
    /// mark or digit ("word|," or "word| next"), where the tokenization of the whole text
    /// splits too, so the two sides tokenize alone to the same ids:
    /// - the added tokens: `c` is in none of them, so no added token spans the cut;
    /// - NFC: `p` and `c` are each their own NFC form, `c` is neither a mark nor a Hangul
    ///   jamo (the only characters that compose with what precedes them) and `p` no jamo
    ///   (which could compose into something else than a letter), so normalizing the two
    ///   sides apart gives the normalized whole, `p` and `c` keeping their classes;
    /// - the split regex of `qwen35` and `qwen2`: no alternative matches a letter or digit
    ///   followed by a character that is not a letter, mark or digit (a letter run continues
    ///   only with letters and marks, a digit stands alone, contractions end in a letter, the
    ///   punctuation and whitespace runs take no letter or digit), the only lookahead
    ///   (`\s+(?!\S)`) ends in whitespace, not at `p`, and every character is matched by
    ///   some alternative: a match ends at the cut, the one after starts there, and matches
    ///   on either side do not look across it;
    /// - the model (BPE) works on each pre-tokenized word alone.
    fn cut_after(&self, cuts: &onig::Regex, text: &str, from: usize) -> usize {
        let mut from = from.min(text.len());
        while !text.is_char_boundary(from) {
            from += 1;
        }
        for (start, end) in cuts.find_iter(&text[from..]) {
            let pair = &text[from + start..from + end];
            let mut chars = pair.chars();
            let (Some(p), Some(c)) = (chars.next(), chars.next()) else { continue };
            if self.added_chars.binary_search(&c).is_ok() {
                continue;
            }
            let stable = |ch: char| {
                let mut buf = [0u8; 4];
                let s = ch.encode_utf8(&mut buf);
                tokenizers::NormalizedString::from(&*s).nfc().get() == s
            };
            let jamo = |ch: char| matches!(ch, '\u{1100}'..='\u{11FF}' | '\u{A960}'..='\u{A97F}' | '\u{D7B0}'..='\u{D7FF}');
            if (p.is_ascii() && c.is_ascii()) || (!jamo(p) && !jamo(c) && stable(p) && stable(c)) {
                return from + start + p.len_utf8();
            }
        }
        text.len()
    }
}

/// `Some` when the pre-tokenizer is the split regex of `qwen35` or `qwen2` followed by a
/// byte-level mapping without a prefix space or a split of its own, the tokenizers whose cuts
/// [`Pieces::cut_after`] knows.
fn qwen_split(tokenizer: &tokenizers::Tokenizer) -> Option<()> {
    let json = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
    let steps = json.get("pretokenizers")?.as_array()?;
    let [split, bytes] = steps.as_slice() else { return None };
    let pattern = split.get("pattern")?.get("Regex")?.as_str()?;
    let known = json["type"] == "Sequence"
        && split["type"] == "Split"
        && gguf_pre_tokenizer_name(pattern).is_some()
        && split["behavior"] == "Isolated"
        && split["invert"] == false
        && bytes["type"] == "ByteLevel"
        && bytes["add_prefix_space"] == false
        && bytes["use_regex"] == false;
    known.then_some(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's table inverted: each byte stands for exactly one character.
    #[test]
    fn the_byte_table_is_gpt2s() {
        assert_eq!(gpt2_byte('!'), Some(b'!'));
        assert_eq!(gpt2_byte('Ġ'), Some(b' '));
        assert_eq!(gpt2_byte('Ċ'), Some(b'\n'));
        assert_eq!(gpt2_byte(' '), None, "a space is spelled Ġ");
        let mut seen: Vec<u8> = (0..0x200u32).filter_map(char::from_u32).filter_map(gpt2_byte).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
    }

    fn fixture(path: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(path)
    }

    /// The real Qwen3.5 `tokenizer.json`, as JSON to edit.
    fn qwen_json() -> serde_json::Value {
        static JSON: OnceLock<serde_json::Value> = OnceLock::new();
        JSON.get_or_init(|| {
            let packed = std::fs::read(fixture("tokenizer/qwen3_5.tokenizer.json.zst")).unwrap();
            serde_json::from_slice(&zstd::decode_all(packed.as_slice()).unwrap()).unwrap()
        })
        .clone()
    }

    fn tokenizer(json: &serde_json::Value) -> Tokenizer {
        Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap()
    }

    /// Qwen3.5's tokenizer, the same with Qwen2's split, and the tiny fixture model's.
    fn qwen_tokenizers() -> Vec<(&'static str, Tokenizer)> {
        let json = qwen_json();
        let mut qwen2 = json.clone();
        qwen2["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = QWEN2_PATTERN.into();
        qwen2["model"]["ignore_merges"] = false.into();
        let tiny = Tokenizer::from_model_dir(fixture("models/vlm-f32-gdn2x")).unwrap().unwrap();
        vec![("qwen35", tokenizer(&json)), ("qwen2", tokenizer(&qwen2)), ("tiny", tiny)]
    }

    /// Pieces of text chosen to sit on both sides of every cut rule: letters, digits and marks
    /// of several scripts, characters NFC changes or composes (decomposed accents, Hangul
    /// jamo, composition exclusions, singletons, `<` + combining slash), contractions,
    /// whitespace runs, punctuation runs, added tokens and their characters.
    const FRAGMENTS: &[&str] = &[
        "a",
        "Z",
        "word",
        " the",
        "é",
        "e\u{301}",
        "\u{301}",
        "\u{338}",
        "<",
        ">",
        "|",
        "_",
        "/",
        "≮",
        "'s",
        "'",
        "’",
        "1",
        "23",
        "٣",
        "Ⅻ",
        "²",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n",
        ",",
        ".",
        "!!",
        "...",
        "-",
        "—",
        "，",
        "。",
        "「",
        "日本",
        "語",
        "今日は",
        "가",
        "\u{1100}",
        "\u{1161}",
        "\u{11A8}",
        "\u{0958}",
        "\u{0915}",
        "\u{093C}",
        "\u{2126}",
        "\u{212B}",
        "\u{F900}",
        "\u{037E}",
        "\u{FB1D}",
        "ﬁ",
        "ǅ",
        "ß",
        "🦀",
        "\u{200D}",
        "\u{FEFF}",
        "\u{0}",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|endoftext|>",
        "<|im",
        "think>",
        "Ġ",
        "\u{FFFD}",
    ];

    fn random_text(rng: &mut u64, fragments: usize) -> String {
        let mut next = || {
            // xorshift64*
            *rng ^= *rng >> 12;
            *rng ^= *rng << 25;
            *rng ^= *rng >> 27;
            rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        let n = 1 + next() as usize % fragments;
        (0..n).map(|_| FRAGMENTS[next() as usize % FRAGMENTS.len()]).collect()
    }

    /// Tokenized in pieces, cut as small as the rules allow, a text gives exactly its whole
    /// ids; with a limit, the ids when they fit and `None` as soon as they do not.
    #[test]
    fn pieces_tokenize_exactly_like_the_whole_text() {
        let corpus: serde_json::Value =
            serde_json::from_slice(&std::fs::read(fixture("tokenizer/corpus.json")).unwrap()).unwrap();
        let corpus: Vec<String> = corpus
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e.get("text").or(Some(e)).and_then(|t| t.as_str()).map(str::to_owned))
            .collect();
        assert!(corpus.len() > 10);
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        for (name, tokenizer) in qwen_tokenizers() {
            let pieces = tokenizer.pieces.get_or_init(|| Pieces::of(&tokenizer.inner));
            assert!(pieces.cuts.is_some(), "{name}: no cut rules");
            let texts = corpus.iter().cloned().chain((0..250).map(|_| random_text(&mut rng, 60)));
            for text in texts {
                let whole = tokenizer.encode(&text, false).unwrap();
                for piece_bytes in [1, 5, 64] {
                    let got = tokenizer.encode_in_pieces(&text, usize::MAX, piece_bytes).unwrap();
                    assert_eq!(got.as_ref(), Some(&whole), "{name}, pieces of {piece_bytes}: {text:?}");
                }
                let n = whole.len();
                assert_eq!(tokenizer.encode_in_pieces(&text, n, 3).unwrap(), Some(whole), "{name}: {text:?}");
                if n > 0 {
                    assert_eq!(
                        tokenizer.encode_in_pieces(&text, n - 1, 3).unwrap(),
                        None,
                        "{name}: {text:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn long_texts_are_refused_from_their_first_pieces() {
        let (_, qwen) = qwen_tokenizers().swap_remove(0);
        // "a a a ..." (4 MB, two million tokens) against a limit of 1000, and text with no
        // cut at all (one four-megabyte word), refused by its length alone.
        for text in ["a ".repeat(2 << 20), "a".repeat(4 << 20)] {
            assert_eq!(qwen.encode_within(&text, 1000).unwrap(), None);
        }
        // The longest Qwen token stands for 128 bytes: ASCII of more than 128 bytes a token is
        // refused unseen, at the server's default context too.
        let pieces = qwen.pieces.get().unwrap();
        assert_eq!(pieces.max_token_bytes, Some(128));
        assert!(pieces.cannot_fit(&"a".repeat(128 * 4096 + 1), 4095));
        assert!(!pieces.cannot_fit(&"a".repeat(128 * 4096), 4095));
        assert!(!pieces.cannot_fit(&"é".repeat(128 * 4096), 4095), "NFC may shrink what is not ASCII");
        let text = "a ".repeat(3000);
        assert_eq!(qwen.encode_within(&text, 10_000).unwrap(), Some(qwen.encode(&text, false).unwrap()));
        assert_eq!(qwen.encode_within("", 0).unwrap(), Some(vec![]));
    }

    /// A tokenizer whose pre-tokenizer has no known cuts is tokenized whole, still refused
    /// beyond the limit.
    #[test]
    fn other_tokenizers_are_tokenized_whole() {
        let mut json = qwen_json();
        json["pre_tokenizer"] = serde_json::json!({"type": "ByteLevel", "add_prefix_space": true,
                                                   "trim_offsets": true, "use_regex": true});
        let t = tokenizer(&json);
        let text = "Hello there, general Kenobi. ".repeat(50);
        let whole = t.encode(&text, false).unwrap();
        assert!(t.pieces.get_or_init(|| Pieces::of(&t.inner)).cuts.is_none());
        assert_eq!(t.encode_within(&text, whole.len()).unwrap(), Some(whole.clone()));
        assert_eq!(t.encode_within(&text, whole.len() - 1).unwrap(), None);
    }
}
