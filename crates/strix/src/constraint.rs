//! Structured output: constraining a sequence's tokens to a grammar (a JSON schema, any JSON
//! object, a Lark grammar, a regex, a list of choices, a forced tool call), with llguidance.
//!
//! [`Constraints`] is built once per tokenizer: llguidance's view of the vocabulary (a token
//! trie of every id's bytes) and its parser factory. [`Constraints::compile`] turns a
//! [`Grammar`] into a [`Constraint`], one per sequence, or refuses it with an error naming the
//! problem (a schema llguidance cannot compile, a Lark syntax error). Each step,
//! [`Constraint::allowed`] gives the tokens the grammar allows next as a packed bitmask
//! ([`TokenMask`]: bit `i % 32` of word `i / 32` is token `i`), the sampler sets every other
//! logit to −∞ before anything else (`sampling.rs`), and [`Constraint::advance`] takes the
//! drawn token. When the grammar is complete the mask allows only the end-of-sequence tokens,
//! so a constrained sequence ends by drawing one; [`Constraint::is_finished`] says when the
//! grammar can go no further, so that a sequence that ignores end-of-sequence tokens still ends.
//!
//! The vocabulary: byte-level BPE spells each byte as a printable character (GPT-2's table), so
//! a token's bytes are its spelling mapped back through that table; added tokens the tokenizer
//! marks special (`<|im_end|>`...) are special to llguidance too (a grammar never produces them
//! as text); Qwen's ordinary added tokens (`<think>`, `<tool_call>`) are their text, so a grammar
//! that writes `<tool_call>` may produce it as the one token or as pieces, which decode alike.
//! Ids past the tokenizer (the embedding's padding) are special placeholders, never allowed.
//!
//! JSON is compact by default: `", "` and `": "` between items and keys (what `json.dumps`
//! writes) and no other whitespace, so that a model cannot pad its output with endless
//! whitespace (llguidance's `x-guidance` options in a schema override this).

use std::sync::Arc;

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// What a sequence's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON value valid under this JSON schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// A Lark grammar in llguidance's dialect (its `start` rule; `%json {schema}` embeds a schema).
    Lark(String),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Tool calls in the `<tool_call>` JSON form Qwen's output parser reads:
    /// `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`, where ARGS is valid
    /// under the named function's `parameters` schema. `tools` are OpenAI's tool definitions
    /// (`{"type": "function", "function": {"name", "parameters"}}`); `one`: exactly one call,
    /// else one or more.
    ToolCalls { tools: Vec<Value>, one: bool },
}

/// The tokens allowed next: bit `i % 32` of word `i / 32` is token `i`, for a vocabulary of
/// `vocab` ids (bits past it are clear).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    vocab: usize,
}

impl TokenMask {
    /// A mask of `vocab` ids allowing those of `allowed`.
    pub fn from_ids(vocab: usize, allowed: &[u32]) -> TokenMask {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for &id in allowed.iter().filter(|&&id| (id as usize) < vocab) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
        TokenMask { words, vocab }
    }

    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.vocab && self.words[id as usize / 32] & (1 << (id % 32)) != 0
    }

    /// The packed words, `vocab.div_ceil(32)` of them.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// llguidance's view of a tokenizer: the trie of every id's bytes, and our tokenizer for the
/// literal text a grammar forces.
struct TrieEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.tokenizer.encode(text, false).unwrap_or_default())
    }
}

/// The grammar compiler of one tokenizer and vocabulary; cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct Constraints {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraints").field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

impl Constraints {
    /// The compiler for `tokenizer` and a model of `vocab` ids (at least the tokenizer's),
    /// whose end-of-sequence ids are `eos` (the tokens a finished grammar allows).
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Constraints> {
        if vocab < tokenizer.vocab_size() {
            return Err(Error::Input(format!(
                "the model's vocabulary ({vocab} ids) is smaller than its tokenizer's ({})",
                tokenizer.vocab_size()
            )));
        }
        let eos: Vec<u32> = eos.iter().copied().filter(|&id| (id as usize) < vocab).collect();
        let Some(&first_eos) = eos.first() else {
            return Err(Error::Input(
                "structured output needs an end-of-sequence token, and the model has none".into(),
            ));
        };
        let specials = tokenizer.special_ids();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.id_to_token(id) {
                Some(name) if specials.binary_search(&id).is_ok() => special_name(name.as_bytes()),
                Some(_) => tokenizer.token_bytes(id),
                None => special_name(format!("<[{id}]>").as_bytes()),
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TrieEnv { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Input(format!("structured output: cannot index the vocabulary: {e}")))?;
        // Errors come back as values; nothing is printed.
        factory.quiet();
        Ok(Constraints { factory: Arc::new(factory), vocab })
    }

    /// The vocabulary size of every mask.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles `grammar` for one sequence. `prefix`: literal text the output starts with before
    /// the grammar's own (a chat prompt that leaves a thinking block open gets `</think>\n\n`).
    /// Errors (an [`Error::Input`]) name what llguidance could not compile.
    pub fn compile(&self, grammar: &Grammar, prefix: &str) -> Result<Constraint> {
        let top = top_level(grammar, prefix)?;
        let parser =
            self.factory.create_parser(top).map_err(|e| Error::Input(compile_message(grammar, &e)))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Input(compile_message(grammar, &anyhow::anyhow!(e))));
        }
        Ok(Constraint { matcher, vocab: self.vocab })
    }
}

/// The text a constrained output starts with after `prompt`: `</think>\n\n` when the prompt
/// leaves a thinking block open (Qwen's template opens one unless thinking is off), so that
/// the grammar's text is the answer, not the thinking; else nothing.
pub fn thinking_prefix(prompt: &str) -> &'static str {
    match (prompt.rfind("<think>"), prompt.rfind("</think>")) {
        (Some(open), Some(close)) if open > close => "</think>\n\n",
        (Some(_), None) => "</think>\n\n",
        _ => "",
    }
}

/// A special token's trie entry: llguidance's marker byte, then its name.
fn special_name(name: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(name.len() + 1);
    bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
    bytes.extend_from_slice(name);
    bytes
}

fn compile_message(grammar: &Grammar, e: &anyhow::Error) -> String {
    let what = match grammar {
        Grammar::JsonSchema(_) => "the JSON schema",
        Grammar::JsonObject => "the JSON object grammar",
        Grammar::Lark(_) => "the Lark grammar",
        Grammar::Regex(_) => "the regex",
        Grammar::Choice(_) => "the choices",
        Grammar::ToolCalls { .. } => "the tools' parameter schemas",
    };
    // llguidance's messages may quote the grammar: one line, capped.
    let message = crate::error::printable_capped(&e.to_string().replace('\n', " "), 500);
    format!("cannot compile {what}: {message}")
}

/// Compact JSON (see the module documentation), unless the schema sets its own options.
fn with_json_options(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// A Lark string literal of `text` (JSON's escapes, which llguidance's Lark reads).
fn lark_literal(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

fn top_level(grammar: &Grammar, prefix: &str) -> Result<TopLevelGrammar> {
    let body = match grammar {
        Grammar::JsonSchema(schema) => {
            if !matches!(schema, Value::Object(_) | Value::Bool(_)) {
                return Err(Error::Input("the JSON schema must be an object (or a boolean)".into()));
            }
            if prefix.is_empty() {
                return Ok(TopLevelGrammar::from_grammar(GrammarWithLexer::from_json_schema(
                    with_json_options(schema),
                )));
            }
            format!("%json {}", with_json_options(schema))
        }
        Grammar::JsonObject => format!("%json {}", with_json_options(&json!({"type": "object"}))),
        Grammar::Lark(lark) => {
            if !prefix.is_empty() {
                return Err(Error::Input(
                    "a Lark grammar cannot follow the open thinking block this prompt leaves; turn thinking off"
                        .into(),
                ));
            }
            return TopLevelGrammar::from_lark_or_grammar_list(lark)
                .map_err(|e| Error::Input(compile_message(grammar, &e)));
        }
        Grammar::Regex(rx) => format!("/{}/", llguidance::regex_to_lark(rx, "")),
        Grammar::Choice(choices) => {
            if choices.is_empty() {
                return Err(Error::Input("the list of choices is empty".into()));
            }
            let alternatives: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
            format!("({})", alternatives.join(" | "))
        }
        Grammar::ToolCalls { tools, one } => {
            let call = tool_call_schema(tools)?;
            let call = format!(
                "{} %json {} {}",
                lark_literal("<tool_call>\n"),
                call,
                lark_literal("\n</tool_call>")
            );
            if *one {
                call
            } else {
                format!("tool_call ({} tool_call)*\ntool_call: {call}", lark_literal("\n"))
            }
        }
    };
    let start = if prefix.is_empty() { body } else { format!("{} {body}", lark_literal(prefix)) };
    let lark = match start.split_once('\n') {
        // A rule defined after `start` (the tool calls').
        Some((first, rest)) => format!("start: {first}\n{rest}\n"),
        None => format!("start: {start}\n"),
    };
    Ok(TopLevelGrammar::from_lark(lark))
}

/// The schema of one call's JSON: `{"name": NAME, "arguments": ARGS}` for any of `tools`.
fn tool_call_schema(tools: &[Value]) -> Result<Value> {
    if tools.is_empty() {
        return Err(Error::Input("forcing a tool call needs at least one tool".into()));
    }
    let mut calls = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function").unwrap_or(tool);
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            return Err(Error::Input(format!("tools[{i}] has no function name")));
        };
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(Error::Input(format!(
                    "tools[{i}].function.parameters must be a JSON schema object"
                )))
            }
        };
        calls.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    let schema = if calls.len() == 1 { calls.remove(0) } else { json!({"anyOf": calls}) };
    Ok(with_json_options(&schema))
}

/// One sequence's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("finished", &self.is_finished()).finish_non_exhaustive()
    }
}

impl Constraint {
    /// The tokens the grammar allows next (only end-of-sequence ids once it is complete).
    pub fn allowed(&mut self) -> Result<TokenMask> {
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| grammar_error(&e))?;
        let n = self.vocab.div_ceil(32);
        let mut words: Vec<u32> = vob.as_slice().iter().copied().take(n).collect();
        words.resize(n, 0);
        if !self.vocab.is_multiple_of(32) {
            // Bits past the vocabulary stay clear.
            words[n - 1] &= (1u32 << (self.vocab % 32)) - 1;
        }
        Ok(TokenMask { words, vocab: self.vocab })
    }

    /// Takes the drawn token. An end-of-sequence token once the grammar is complete is fine;
    /// a token the grammar does not allow is an error (the sampler never draws one).
    pub fn advance(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| grammar_error(&e))
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && self.matcher.get_error().is_none()
    }
}

fn grammar_error(e: &anyhow::Error) -> Error {
    Error::Input(format!("structured output: {}", crate::error::printable_capped(&e.to_string(), 500)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> (Tokenizer, Constraints) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/vlm-f32-gdn2x");
        let tokenizer = Tokenizer::from_model_dir(&dir).unwrap().unwrap();
        // The fixture's model pads its 327 tokens to an embedding of 384 ids.
        let constraints = Constraints::new(&tokenizer, 384, &[322]).unwrap();
        (tokenizer, constraints)
    }

    /// Walks `text`'s tokens through a fresh constraint, checking each is allowed; returns
    /// whether the end-of-sequence token is allowed after them.
    fn accepts(c: &Constraints, t: &Tokenizer, grammar: &Grammar, text: &str) -> Option<bool> {
        let mut constraint = c.compile(grammar, "").unwrap();
        for id in t.encode(text, false).unwrap() {
            if !constraint.allowed().unwrap().allows(id) {
                return None;
            }
            constraint.advance(id).unwrap();
        }
        Some(constraint.allowed().unwrap().allows(322))
    }

    /// A random walk through the grammar: each step picks an allowed token with a fixed
    /// pseudo-random sequence, ending on end-of-sequence; returns the text.
    fn walk(c: &Constraints, t: &Tokenizer, grammar: &Grammar, seed: u64, max: usize) -> Option<String> {
        let mut constraint = c.compile(grammar, "").unwrap();
        let mut state = seed;
        let mut ids = Vec::new();
        for _ in 0..max {
            let mask = constraint.allowed().unwrap();
            let allowed: Vec<u32> = (0..mask.vocab() as u32).filter(|&i| mask.allows(i)).collect();
            assert!(!allowed.is_empty());
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Prefer ending when allowed, half the time, so walks terminate.
            let id = if mask.allows(322) && state >> 63 == 1 {
                322
            } else {
                allowed[(state >> 33) as usize % allowed.len()]
            };
            constraint.advance(id).unwrap();
            if id == 322 {
                assert!(constraint.is_finished());
                return Some(t.decode(&ids, false).unwrap());
            }
            ids.push(id);
        }
        None
    }

    #[test]
    fn masks_pack_ids_in_32_bit_words() {
        let m = TokenMask::from_ids(70, &[0, 31, 32, 69, 70, 500]);
        assert_eq!(m.words(), &[1 | 1 << 31, 1, 1 << 5]);
        assert!(m.allows(69) && !m.allows(70) && !m.allows(1));
        assert_eq!(m.count(), 4);
    }

    #[test]
    fn a_schema_allows_exactly_its_documents() {
        let (t, c) = fixture();
        let schema = Grammar::JsonSchema(json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"],
            "additionalProperties": false
        }));
        assert_eq!(accepts(&c, &t, &schema, r#"{"a": 12, "b": "y"}"#), Some(true));
        assert_eq!(accepts(&c, &t, &schema, r#"{"a": 12"#), Some(false), "incomplete: no end yet");
        assert_eq!(accepts(&c, &t, &schema, r#"{"a": "12"}"#), None, "a string where an integer goes");
        assert_eq!(accepts(&c, &t, &schema, r#"{"a": 1, "b": "z"}"#), None, "outside the enum");
        assert_eq!(accepts(&c, &t, &schema, r#"{"a":1}"#), None, "compact separators only");
        assert_eq!(accepts(&c, &t, &schema, r#"{"a": 1, "c": 2}"#), None, "no additional properties");
    }

    #[test]
    fn random_walks_through_a_schema_are_valid_documents() {
        let (t, c) = fixture();
        let schema = json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
                "tags": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 3},
                "ok": {"type": "boolean"},
                "inner": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
                          "required": ["s"], "additionalProperties": false}
            },
            "required": ["n", "tags", "ok", "inner"],
            "additionalProperties": false
        });
        let grammar = Grammar::JsonSchema(schema);
        let mut finished = 0;
        for seed in 0..20 {
            let Some(text) = walk(&c, &t, &grammar, seed, 200) else { continue };
            finished += 1;
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let n = v["n"].as_i64().unwrap();
            assert!((0..=99).contains(&n), "{text}");
            assert!(v["tags"].as_array().unwrap().len() <= 3, "{text}");
            assert!(v["ok"].is_boolean(), "{text}");
            assert!(v["inner"]["s"].as_str().unwrap().chars().count() <= 4, "{text}");
            assert_eq!(v.as_object().unwrap().len(), 4, "{text}");
        }
        assert!(finished >= 10, "only {finished} walks finished");
    }

    #[test]
    fn regexes_choices_lark_and_json_objects_hold() {
        let (t, c) = fixture();
        let regex = Grammar::Regex("[0-9]{3}-(ab|cd)".into());
        assert_eq!(accepts(&c, &t, &regex, "123-cd"), Some(true));
        assert_eq!(accepts(&c, &t, &regex, "12-cd"), None);
        let choice = Grammar::Choice(vec!["yes".into(), "no \"way\"".into()]);
        assert_eq!(accepts(&c, &t, &choice, "no \"way\""), Some(true));
        // llguidance keeps a literal's canonical tokens ("yes" is "y" "es", so not "y" "e").
        assert_eq!(accepts(&c, &t, &choice, "y"), Some(false));
        assert_eq!(accepts(&c, &t, &choice, "maybe"), None);
        let lark = Grammar::Lark("start: \"a\" B\nB: /[xy]+/\n".into());
        assert_eq!(accepts(&c, &t, &lark, "axyx"), Some(true));
        assert_eq!(accepts(&c, &t, &lark, "b"), None);
        assert_eq!(accepts(&c, &t, &Grammar::JsonObject, r#"{"k": [1, {"z": null}]}"#), Some(true));
        assert_eq!(accepts(&c, &t, &Grammar::JsonObject, "[1]"), None);
        for seed in 0..10 {
            if let Some(text) = walk(&c, &t, &regex, seed, 50) {
                assert!(text.len() == 6 && text.as_bytes()[3] == b'-', "{text}");
            }
        }
    }

    #[test]
    fn tool_calls_follow_the_function_schema() {
        let (t, c) = fixture();
        let tools = vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"], "additionalProperties": false}}})];
        let one = Grammar::ToolCalls { tools: tools.clone(), one: true };
        let call =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        assert_eq!(accepts(&c, &t, &one, call), Some(true));
        assert_eq!(accepts(&c, &t, &one, &call.replace("Oslo", "Rome")), None);
        assert_eq!(accepts(&c, &t, &one, &call.replace("get_weather", "get_time")), None);
        let many = Grammar::ToolCalls { tools, one: false };
        assert_eq!(accepts(&c, &t, &many, &format!("{call}\n{call}")), Some(true));
        // The thinking block a prompt leaves open is closed first.
        let mut constraint = c.compile(&one, "</think>\n\n").unwrap();
        for id in t.encode(&format!("</think>\n\n{call}"), false).unwrap() {
            assert!(constraint.allowed().unwrap().allows(id));
            constraint.advance(id).unwrap();
        }
        assert!(constraint.allowed().unwrap().allows(322));
    }

    #[test]
    fn an_open_thinking_block_is_closed_first() {
        assert_eq!(thinking_prefix("<|im_start|>assistant\n<think>\n"), "</think>\n\n");
        assert_eq!(thinking_prefix("assistant\n<think>\n\n</think>\n\n"), "");
        assert_eq!(thinking_prefix("plain"), "");
    }

    #[test]
    fn bad_grammars_are_refused_naming_the_problem() {
        let (_, c) = fixture();
        let err = |g: Grammar| c.compile(&g, "").unwrap_err().to_string();
        let e = err(Grammar::JsonSchema(json!({"type": "objekt"})));
        assert!(e.contains("cannot compile the JSON schema"), "{e}");
        let e = err(Grammar::JsonSchema(json!([1])));
        assert!(e.contains("must be an object"), "{e}");
        let e = err(Grammar::Lark("start: (".into()));
        assert!(e.contains("cannot compile the Lark grammar"), "{e}");
        let e = err(Grammar::Regex("(".into()));
        assert!(e.contains("cannot compile the regex"), "{e}");
        assert!(err(Grammar::Choice(Vec::new())).contains("empty"));
        let e = err(Grammar::ToolCalls { tools: vec![json!({"function": {}})], one: true });
        assert!(e.contains("tools[0] has no function name"), "{e}");
    }
}
