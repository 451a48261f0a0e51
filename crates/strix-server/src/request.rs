//! Decoding request bodies into typed requests: JSON parsing, the type and range of every
//! field the server reads, and errors that name the field at fault (`param`).
//!
//! Fields are read one by one from the JSON object rather than through a derived
//! `Deserialize`, because a field of the wrong type must be a 400 naming that field, and
//! OpenAI's fields have several shapes (`stop` is a string or a list, a completion `prompt`
//! text or token ids). `null` counts as absent everywhere, as in OpenAI's API.
//!
//! What the server does not do, it refuses rather than ignores: a field outside the lists of
//! what each endpoint reads ([`CHAT_FIELDS`], [`COMPLETION_FIELDS`], [`COMMON_FIELDS`]) is a 400
//! naming it, as OpenAI answers ("Unrecognized request argument supplied"), and so is a known
//! field in a form the server cannot honour (image or audio content parts, a
//! `structured_outputs` key other than the ones read...). A few
//! informational fields clients send are accepted and have no effect (`user`, `metadata`,
//! `store`, `service_tier`). Nothing here panics on any input: the property tests in
//! `tests/fuzz.rs` feed it random bytes and random JSON.

use serde_json::{Map, Value};
use strix::chat::{ChatMessage, ChatOptions};
use strix::constraint::Grammar;
use strix::sampling::{SamplingParams, LOGIT_BIAS_MAX};

use crate::error::ApiError;

/// Most stop strings a request may give. OpenAI allows 4; strix took 16 before it capped
/// their length and keeps that, since matching costs nothing per stop (an automaton).
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes. The matcher holds back up to this much text that could
/// still become a stop, and builds an automaton as large as all stops together: 256 bytes
/// keeps both small while far exceeding any delimiter a client stops on.
pub const MAX_STOP_BYTES: usize = 256;
/// Most `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most `logit_bias` entries (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Fields both endpoints read; `user`, `metadata`, `store` and `service_tier` are
/// informational (accepted, without effect). `structured_outputs` is vLLM's extension for
/// grammars (`json`, `regex`, `grammar`, `choice`, `json_object`).
pub const COMMON_FIELDS: [&str; 23] = [
    "structured_outputs",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "logprobs",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "logit_bias",
    "user",
    "metadata",
    "store",
    "service_tier",
];
/// Fields only `/v1/chat/completions` reads (`modalities` only in the form that asks for
/// nothing more than text, `parallel_tool_calls` only as `true`).
pub const CHAT_FIELDS: [&str; 8] = [
    "messages",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "response_format",
    "modalities",
];
/// Fields only `/v1/completions` reads (`echo` only as false, `best_of` only as 1; `suffix` is
/// known to be refused; `response_format` is an extension there, read as in chat).
pub const COMPLETION_FIELDS: [&str; 5] = ["prompt", "echo", "suffix", "best_of", "response_format"];

/// The most bytes of grammar text (a schema, a Lark grammar, a regex, the choices) a request
/// may give; the body cap bounds it too, and llguidance bounds the work of compiling it.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// Structured output asked for: the grammar, and the field it came from (for errors).
#[derive(Clone, Debug, PartialEq)]
pub struct Structured {
    pub grammar: Grammar,
    pub param: &'static str,
}

/// What both endpoints share: how much to generate, how to sample, when to stop, what to report.
#[derive(Clone, Debug, PartialEq)]
pub struct GenOptions {
    /// `max_completion_tokens`, else `max_tokens`; `None` runs to the end of the context.
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came from, for errors.
    pub max_tokens_param: &'static str,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// `Some(n)` when log-probabilities are asked for, with the `n` most likely alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
    /// vLLM's extension: keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// `response_format`, `structured_outputs` or a forced tool call: the output's grammar.
    pub structured: Option<Structured>,
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Template options: `tools`, `enable_thinking` and the rest of `chat_template_kwargs`.
    pub template: ChatOptions,
    /// Whether `<tool_call>` blocks of the output become `tool_calls`: when tools were given
    /// and `tool_choice` is not `"none"`.
    pub parse_tools: bool,
    pub gen: GenOptions,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub gen: GenOptions,
}

/// Parses a `/v1/chat/completions` body. `defaults` are the server's sampling defaults (the
/// model's `generation_config.json`), which the request's fields override.
pub fn parse_chat(body: &[u8], defaults: &SamplingParams) -> Result<ChatRequest, ApiError> {
    let object = parse_object(body)?;
    let f = Fields(&object);
    f.only(&CHAT_FIELDS)?;
    let mut gen = gen_options(&f, defaults, LogprobsStyle::Chat)?;
    match f.get("modalities") {
        None => {}
        Some(Value::Array(m)) if m.iter().all(|m| m == "text") => {}
        Some(_) => {
            return Err(ApiError::invalid_param("modalities", "only the \"text\" modality is supported"))
        }
    }
    match f.get("parallel_tool_calls") {
        None | Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => {
            return Err(ApiError::invalid_param(
                "parallel_tool_calls",
                "`parallel_tool_calls: false` is not supported: the model may call several tools in one turn",
            ))
        }
        Some(_) => return Err(type_error("parallel_tool_calls", "a boolean")),
    }

    let messages = match f.get("messages") {
        None => return Err(ApiError::invalid_param("messages", "`messages` is required")),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid_param("messages", "`messages` must not be empty"))
        }
        Some(Value::Array(items)) => {
            items.iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>, _>>()?
        }
        Some(_) => return Err(type_error("messages", "an array of messages")),
    };

    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(tools)) => {
            for (i, tool) in tools.iter().enumerate() {
                let name = tool.get("function").and_then(|function| function.get("name"));
                if !matches!(name, Some(Value::String(_))) {
                    return Err(ApiError::invalid_param(
                        format!("tools[{i}]"),
                        "each tool must be {\"type\": \"function\", \"function\": {\"name\": string, ...}}",
                    ));
                }
            }
            (!tools.is_empty()).then(|| Value::Array(tools.clone()))
        }
        Some(_) => return Err(type_error("tools", "an array of tools")),
    };
    let forced = forced_tools(f.get("tool_choice"), tools.as_ref())?;
    let tool_choice_none = matches!(f.get("tool_choice"), Some(Value::String(c)) if c == "none");
    let tools = if tool_choice_none { None } else { tools };
    if let Some(grammar) = forced {
        if gen.structured.is_some() {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "a forced tool call (`tool_choice` \"required\" or a function) cannot be combined with \
                 `response_format` or `structured_outputs`",
            ));
        }
        gen.structured = Some(Structured { grammar, param: "tool_choice" });
    }

    let mut extra = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(kwargs)) => kwargs.clone(),
        Some(_) => return Err(type_error("chat_template_kwargs", "an object")),
    };
    let enable_thinking = match extra.remove("enable_thinking") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(b),
        Some(_) => return Err(type_error("chat_template_kwargs.enable_thinking", "a boolean")),
    };
    // These belong to the server: a request must not be able to turn the generation prompt off.
    for reserved in ["messages", "tools", "add_generation_prompt"] {
        extra.remove(reserved);
    }

    Ok(ChatRequest {
        messages,
        parse_tools: tools.is_some(),
        template: ChatOptions { add_generation_prompt: true, enable_thinking, tools, extra },
        gen,
    })
}

/// The grammar of a `tool_choice` that forces a call: `"required"` (one or more calls to any
/// of `tools`) or `{"type": "function", "function": {"name": ...}}` (one call to that one);
/// `None` for `"auto"`, `"none"` or no `tool_choice`.
fn forced_tools(choice: Option<&Value>, tools: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let listed = || tools.and_then(Value::as_array).cloned().unwrap_or_default();
    let name_of = |tool: &Value| {
        tool.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).map(str::to_owned)
    };
    match choice {
        None => Ok(None),
        Some(Value::String(choice)) => match choice.as_str() {
            "none" | "auto" => Ok(None),
            "required" if listed().is_empty() => {
                Err(ApiError::invalid_param("tool_choice", "`tool_choice` \"required\" needs `tools`"))
            }
            "required" => Ok(Some(Grammar::ToolCalls { tools: listed(), one: false })),
            other => Err(ApiError::invalid_param(
                "tool_choice",
                format!(
                    "`tool_choice` must be \"none\", \"auto\", \"required\" or a function, got \"{other}\""
                ),
            )),
        },
        Some(Value::Object(choice)) => {
            let name =
                match (choice.get("type"), choice.get("function").and_then(|f| f.get("name"))) {
                    (Some(Value::String(t)), Some(Value::String(name))) if t == "function" => name.clone(),
                    _ => return Err(ApiError::invalid_param(
                        "tool_choice",
                        "`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": string}}",
                    )),
                };
            match listed().into_iter().find(|t| name_of(t).as_deref() == Some(name.as_str())) {
                Some(tool) => Ok(Some(Grammar::ToolCalls { tools: vec![tool], one: true })),
                None => Err(ApiError::invalid_param(
                    "tool_choice",
                    format!("`tool_choice` names the function \"{name}\", which is not among `tools`"),
                )),
            }
        }
        Some(_) => Err(type_error("tool_choice", "a string or an object")),
    }
}

/// `response_format` (OpenAI's): `{"type": "text"}` (nothing), `{"type": "json_object"}`, or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
fn response_format(value: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    const P: &str = "response_format";
    let Some(value) = value else { return Ok(None) };
    let Value::Object(format) = value else { return Err(type_error(P, "an object")) };
    let only = |keys: &[&str], at: &str| match format
        .iter()
        .find(|(k, v)| !keys.contains(&k.as_str()) && !v.is_null())
    {
        Some((k, _)) => Err(unrecognized(&format!("{at}.{k}"))),
        None => Ok(()),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => only(&["type"], P).map(|()| None),
        Some("json_object") => only(&["type"], P).map(|()| Some(Grammar::JsonObject)),
        Some("json_schema") => {
            only(&["type", "json_schema"], P)?;
            let Some(Value::Object(spec)) = format.get("json_schema") else {
                return Err(type_error("response_format.json_schema", "an object with a `schema`"));
            };
            if let Some((k, _)) = spec.iter().find(|(k, v)| {
                !["name", "schema", "strict", "description"].contains(&k.as_str()) && !v.is_null()
            }) {
                return Err(unrecognized(&format!("response_format.json_schema.{k}")));
            }
            if !matches!(spec.get("strict"), None | Some(Value::Null | Value::Bool(_))) {
                return Err(type_error("response_format.json_schema.strict", "a boolean"));
            }
            match spec.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(Grammar::JsonSchema(schema.clone())))
                }
                None | Some(Value::Null) => Err(ApiError::invalid_param(
                    "response_format.json_schema.schema",
                    "`response_format.json_schema.schema` is required",
                )),
                Some(_) => Err(type_error("response_format.json_schema.schema", "a JSON schema (an object)")),
            }
        }
        _ => Err(ApiError::invalid_param(
            P,
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// `structured_outputs` (vLLM's extension): exactly one of `json` (a schema, or its JSON text),
/// `regex`, `grammar` (Lark, llguidance's dialect), `choice` (strings) or `json_object: true`.
fn structured_outputs(value: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    const P: &str = "structured_outputs";
    let Some(value) = value else { return Ok(None) };
    let Value::Object(spec) = value else { return Err(type_error(P, "an object")) };
    let given: Vec<(&String, &Value)> = spec.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, value)] = given.as_slice() else {
        return Err(ApiError::invalid_param(
            P,
            "`structured_outputs` must hold exactly one of `json`, `regex`, `grammar`, `choice`, `json_object`",
        ));
    };
    let param = format!("{P}.{key}");
    match (key.as_str(), value) {
        ("json", Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(Grammar::JsonSchema(schema))),
            _ => Err(type_error(param, "a JSON schema (an object, or its JSON text)")),
        },
        ("json", schema @ (Value::Object(_) | Value::Bool(_))) => {
            Ok(Some(Grammar::JsonSchema((*schema).clone())))
        }
        ("json", _) => Err(type_error(param, "a JSON schema (an object, or its JSON text)")),
        ("regex", Value::String(rx)) => Ok(Some(Grammar::Regex(rx.clone()))),
        ("grammar", Value::String(lark)) => Ok(Some(Grammar::Lark(lark.clone()))),
        ("regex" | "grammar", _) => Err(type_error(param, "a string")),
        ("choice", Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|c| {
                c.as_str().map(str::to_owned).ok_or_else(|| type_error(param.clone(), "an array of strings"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|choices| Some(Grammar::Choice(choices))),
        ("choice", _) => Err(type_error(param, "a non-empty array of strings")),
        ("json_object", Value::Bool(true)) => Ok(Some(Grammar::JsonObject)),
        ("json_object", _) => Err(type_error(param, "true")),
        _ => Err(unrecognized(&param)),
    }
}

/// The grammar of `response_format` or `structured_outputs` (not both).
fn structured(f: &Fields) -> Result<Option<Structured>, ApiError> {
    let format = response_format(f.get("response_format"))?;
    let outputs = structured_outputs(f.get("structured_outputs"))?;
    let structured = match (format, outputs) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "structured_outputs",
                "give `response_format` or `structured_outputs`, not both",
            ))
        }
        (Some(grammar), None) => Some(Structured { grammar, param: "response_format" }),
        (None, Some(grammar)) => Some(Structured { grammar, param: "structured_outputs" }),
        (None, None) => None,
    };
    if let Some(s) = &structured {
        let bytes = match &s.grammar {
            Grammar::JsonSchema(schema) => schema.to_string().len(),
            Grammar::Lark(text) | Grammar::Regex(text) => text.len(),
            Grammar::Choice(choices) => choices.iter().map(String::len).sum(),
            Grammar::JsonObject | Grammar::ToolCalls { .. } => 0,
        };
        if bytes > MAX_GRAMMAR_BYTES {
            return Err(ApiError::invalid_param(
                s.param,
                format!("the grammar is {bytes} bytes; at most {MAX_GRAMMAR_BYTES} are allowed"),
            ));
        }
    }
    Ok(structured)
}

/// Parses a `/v1/completions` body.
pub fn parse_completion(body: &[u8], defaults: &SamplingParams) -> Result<CompletionRequest, ApiError> {
    let object = parse_object(body)?;
    let f = Fields(&object);
    f.only(&COMPLETION_FIELDS)?;
    let gen = gen_options(&f, defaults, LogprobsStyle::Completion)?;
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::invalid_param("prompt", "`prompt` is required")),
        Some(value) => prompt(value)?,
    };
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid_param("echo", "`echo` is not supported"));
    }
    if f.get("suffix").is_some() {
        return Err(ApiError::invalid_param("suffix", "`suffix` is not supported"));
    }
    if let Some(best_of) = f.int("best_of")? {
        if best_of != 1 {
            return Err(ApiError::invalid_param("best_of", "only `best_of` = 1 is supported"));
        }
    }
    Ok(CompletionRequest { prompt, gen })
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::bad_request("the request body is not valid UTF-8"));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(_) => Err(ApiError::bad_request("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("the request body is not valid JSON: {e}"))),
    }
}

fn prompt(value: &Value) -> Result<Prompt, ApiError> {
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|id| {
                id.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                    type_error("prompt", "a string, or an array of token ids (non-negative integers)")
                })
            })
            .collect()
    };
    match value {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) => match items.as_slice() {
            [] => Err(ApiError::invalid_param("prompt", "`prompt` must not be empty")),
            [Value::String(text)] => Ok(Prompt::Text(text.clone())),
            [Value::Array(inner)] => Ok(Prompt::Ids(ids(inner)?)),
            [Value::String(_) | Value::Array(_), _, ..] => {
                Err(ApiError::invalid_param("prompt", "only one prompt per request is supported"))
            }
            _ => Ok(Prompt::Ids(ids(items)?)),
        },
        _ => Err(type_error("prompt", "a string or an array of token ids")),
    }
}

fn message(index: usize, value: &Value) -> Result<ChatMessage, ApiError> {
    let param = format!("messages[{index}]");
    let Value::Object(object) = value else {
        return Err(ApiError::invalid_param(param, "each message must be an object"));
    };
    let role = match object.get("role") {
        Some(Value::String(role)) => role.as_str(),
        Some(_) => return Err(type_error(format!("{param}.role"), "a string")),
        None => return Err(ApiError::invalid_param(format!("{param}.role"), "each message needs a `role`")),
    };
    if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
        return Err(ApiError::invalid_param(
            format!("{param}.role"),
            format!("unknown role \"{role}\" (expected system, developer, user, assistant or tool)"),
        ));
    }
    match object.get("content") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            for (i, part) in parts.iter().enumerate() {
                content_part(&format!("{param}.content[{i}]"), part)?;
            }
        }
        Some(_) => return Err(type_error(format!("{param}.content"), "a string, an array of parts or null")),
    }
    for field in ["reasoning_content", "name", "tool_call_id"] {
        if !matches!(object.get(field), None | Some(Value::Null | Value::String(_))) {
            return Err(type_error(format!("{param}.{field}"), "a string"));
        }
    }
    if !matches!(object.get("tool_calls"), None | Some(Value::Null | Value::Array(_))) {
        return Err(type_error(format!("{param}.tool_calls"), "an array"));
    }
    // Other fields reach the template, which may use them; these the Qwen templates never read.
    for field in ["function_call", "audio"] {
        if !matches!(object.get(field), None | Some(Value::Null)) {
            return Err(ApiError::invalid_param(
                format!("{param}.{field}"),
                format!("`{field}` in a message is not supported"),
            ));
        }
    }
    let mut message: ChatMessage = serde_json::from_value(value.clone())
        .map_err(|e| ApiError::invalid_param(param.clone(), format!("invalid message: {e}")))?;
    // OpenAI's newer name for the system role; the Qwen templates know only `system`.
    if message.role == "developer" {
        message.role = "system".into();
    }
    Ok(message)
}

/// A content part: only `{"type": "text", "text": "..."}`; the served models read no images,
/// audio or files, and dropping them would answer a question that was not asked.
fn content_part(param: &str, part: &Value) -> Result<(), ApiError> {
    const SHAPE: &str = "content parts must be {\"type\": \"text\", \"text\": \"...\"}";
    let Value::Object(part) = part else {
        return Err(ApiError::invalid_param(param, SHAPE));
    };
    match part.get("type") {
        Some(Value::String(kind)) if kind == "text" => {}
        Some(Value::String(kind)) => {
            return Err(ApiError::invalid_param(
                format!("{param}.type"),
                format!("content parts of type \"{kind}\" are not supported: this server reads text only"),
            ))
        }
        _ => return Err(ApiError::invalid_param(format!("{param}.type"), SHAPE)),
    }
    if !matches!(part.get("text"), Some(Value::String(_))) {
        return Err(type_error(format!("{param}.text"), "a string"));
    }
    if let Some((key, _)) = part.iter().find(|(k, v)| !matches!(k.as_str(), "type" | "text") && !v.is_null())
    {
        return Err(unrecognized(&format!("{param}.{key}")));
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum LogprobsStyle {
    /// `logprobs: bool` and `top_logprobs: int`.
    Chat,
    /// `logprobs: int` (the number of alternatives), the legacy completions API.
    Completion,
}

fn gen_options(f: &Fields, defaults: &SamplingParams, style: LogprobsStyle) -> Result<GenOptions, ApiError> {
    if let Some(n) = f.int("n")? {
        if n != 1 {
            return Err(ApiError::invalid_param("n", "only `n` = 1 is supported"));
        }
    }
    if !matches!(f.get("model"), None | Some(Value::String(_))) {
        return Err(type_error("model", "a string"));
    }
    let (max_tokens, max_tokens_param) = match f.positive("max_completion_tokens")? {
        Some(n) => (Some(n), "max_completion_tokens"),
        None => (f.positive("max_tokens")?, "max_tokens"),
    };
    let mut s = defaults.clone();
    s.logit_bias = logit_bias(f.get("logit_bias"))?;
    if let Some(t) = f.number("temperature")? {
        if !(t.is_finite() && t >= 0.0) {
            return Err(ApiError::invalid_param("temperature", "`temperature` must be >= 0"));
        }
        s.temperature = t as f32;
    }
    if let Some(p) = f.number("top_p")? {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", "`top_p` must be in (0, 1]"));
        }
        s.top_p = p as f32;
    }
    if let Some(k) = f.int("top_k")? {
        s.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            _ => return Err(ApiError::invalid_param("top_k", "`top_k` must be >= 0 (0 or -1: off)")),
        };
    }
    if let Some(p) = f.number("min_p")? {
        if !(0.0..=1.0).contains(&p) {
            return Err(ApiError::invalid_param("min_p", "`min_p` must be in [0, 1]"));
        }
        s.min_p = p as f32;
    }
    for (name, slot) in
        [("presence_penalty", &mut s.presence_penalty), ("frequency_penalty", &mut s.frequency_penalty)]
    {
        if let Some(p) = f.number(name)? {
            if !(-2.0..=2.0).contains(&p) {
                return Err(ApiError::invalid_param(name, format!("`{name}` must be in [-2, 2]")));
            }
            *slot = p as f32;
        }
    }
    if let Some(p) = f.number("repetition_penalty")? {
        if !(p.is_finite() && p > 0.0) {
            return Err(ApiError::invalid_param("repetition_penalty", "`repetition_penalty` must be > 0"));
        }
        s.repetition_penalty = p as f32;
    }
    match f.get("seed") {
        None => {}
        // Negative seeds are valid OpenAI seeds; any integer names one stream.
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(seed), _) => s.seed = Some(seed),
            (None, Some(seed)) => s.seed = Some(seed as u64),
            _ => return Err(type_error("seed", "an integer")),
        },
    }
    s.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;

    let stop: Vec<String> = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                return Err(ApiError::invalid_param(
                    "stop",
                    format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
                ));
            }
            items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| type_error("stop", "a string or an array of strings"))
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => return Err(type_error("stop", "a string or an array of strings")),
    };
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid_param(
            "stop",
            format!("a stop string may be at most {MAX_STOP_BYTES} bytes long; one is {} bytes", long.len()),
        ));
    }

    let logprobs = match style {
        LogprobsStyle::Chat => {
            let top = f.int("top_logprobs")?;
            let top = match top {
                None => 0,
                Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => n as usize,
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        "top_logprobs",
                        format!("`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}]"),
                    ))
                }
            };
            match f.bool("logprobs")? {
                Some(true) => Some(top),
                _ if top > 0 => {
                    return Err(ApiError::invalid_param(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`",
                    ))
                }
                _ => None,
            }
        }
        LogprobsStyle::Completion => match f.get("logprobs") {
            None => None,
            Some(Value::Bool(_)) => return Err(type_error("logprobs", "an integer")),
            Some(_) => match f.int("logprobs")? {
                Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
                _ => {
                    return Err(ApiError::invalid_param(
                        "logprobs",
                        format!("`logprobs` must be in [0, {MAX_TOP_LOGPROBS}]"),
                    ))
                }
            },
        },
    };

    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(options)) => {
            if let Some((key, _)) = options.iter().find(|(k, v)| *k != "include_usage" && !v.is_null()) {
                return Err(unrecognized(&format!("stream_options.{key}")));
            }
            match options.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(type_error("stream_options.include_usage", "a boolean")),
            }
        }
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    Ok(GenOptions {
        max_tokens,
        max_tokens_param,
        sampling: s,
        stop,
        logprobs,
        stream,
        include_usage,
        ignore_eos,
        structured: structured(f)?,
    })
}

/// `logit_bias`: an object from token ids (decimal strings, as JSON keys must be strings) to
/// biases in [-100, 100], at most [`MAX_LOGIT_BIAS`] of them. Ids are written the one way
/// (no sign, no leading zero), so no token can be named twice. Whether the ids are in the
/// vocabulary is checked where the model is known (`api.rs`).
fn logit_bias(value: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bias = match value {
        None => return Ok(Vec::new()),
        Some(Value::Object(bias)) => bias,
        Some(_) => return Err(type_error("logit_bias", "an object mapping token ids to biases")),
    };
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens, not {}", bias.len()),
        ));
    }
    let max = f64::from(LOGIT_BIAS_MAX);
    bias.iter()
        .map(|(key, value)| {
            let id = key.parse::<u32>().ok().filter(|id| id.to_string() == *key).ok_or_else(|| {
                ApiError::invalid_param(
                    "logit_bias",
                    format!(
                        "`logit_bias` keys must be token ids (non-negative integers without sign or leading \
                         zeros), got \"{}\"",
                        key.chars().take(32).collect::<String>().escape_debug()
                    ),
                )
            })?;
            match value.as_f64() {
                Some(b) if (-max..=max).contains(&b) => Ok((id, b as f32)),
                Some(b) => Err(ApiError::invalid_param(
                    "logit_bias",
                    format!("`logit_bias` values must be in [-{max}, {max}], got {b} for token {id}"),
                )),
                None => Err(ApiError::invalid_param(
                    "logit_bias",
                    format!("`logit_bias` values must be numbers, and token {id}'s is not"),
                )),
            }
        })
        .collect()
}

/// OpenAI's answer to a field it does not know, with a hint for the usual ones.
fn unrecognized(param: &str) -> ApiError {
    let hint = match param {
        "functions" | "function_call" => " (use `tools` and `tool_choice`)",
        "max_new_tokens" => " (use `max_tokens`)",
        _ => "",
    };
    ApiError::invalid_param(
        param,
        format!("Unrecognized request argument supplied: {param}{hint}. strix-server does not implement it"),
    )
}

fn type_error(param: impl Into<String>, expected: &str) -> ApiError {
    let param = param.into();
    ApiError::invalid_param(param.clone(), format!("`{param}` must be {expected}"))
}

/// Typed access to the fields of a request object.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    /// Refuses any field (not null) that is neither one of `endpoint`'s nor a common one.
    fn only(&self, endpoint: &[&str]) -> Result<(), ApiError> {
        let unknown = self.0.iter().find(|(name, value)| {
            !value.is_null() && !endpoint.contains(&name.as_str()) && !COMMON_FIELDS.contains(&name.as_str())
        });
        match unknown {
            Some((name, _)) => Err(unrecognized(name)),
            None => Ok(()),
        }
    }

    /// The field, `None` when absent or null.
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| type_error(name, "a number")),
        }
    }

    /// An integer; a float with no fractional part (`5.0`) counts, as Python clients send them.
    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => {
                if let Some(i) = v.as_i64() {
                    return Ok(Some(i));
                }
                if v.as_u64().is_some() {
                    return Ok(Some(i64::MAX));
                }
                match v.as_f64() {
                    Some(x) if x.fract() == 0.0 && x.abs() < 9e15 => Ok(Some(x as i64)),
                    _ => Err(type_error(name, "an integer")),
                }
            }
        }
    }

    fn positive(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.int(name)? {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
            Some(_) => Err(ApiError::invalid_param(name, format!("`{name}` must be at least 1"))),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(type_error(name, "a boolean")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        parse_chat(body.as_bytes(), &SamplingParams::default())
    }

    fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
        parse_completion(body.as_bytes(), &SamplingParams::default())
    }

    fn param(e: ApiError) -> String {
        assert_eq!(e.status.as_u16(), 400, "{e}");
        e.param.unwrap_or_default()
    }

    #[test]
    fn a_full_chat_request_decodes() {
        let r = chat(
            r#"{"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                "top_k": -1, "min_p": 0.1, "presence_penalty": 1, "frequency_penalty": -1,
                "repetition_penalty": 1.1, "seed": -3, "stop": "x", "logprobs": true,
                "top_logprobs": 2, "stream": true, "stream_options": {"include_usage": true},
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "chat_template_kwargs": {"enable_thinking": false, "custom": 1},
                "unknown_field": null, "n": 1, "user": "u1", "metadata": {"k": "v"}, "store": false,
                "service_tier": "auto", "parallel_tool_calls": true, "response_format": {"type": "text"},
                "logit_bias": {}, "modalities": ["text"], "tool_choice": "auto"}"#,
        )
        .unwrap();
        assert_eq!(r.messages[0].role, "system");
        assert_eq!((r.gen.max_tokens, r.gen.max_tokens_param), (Some(7), "max_completion_tokens"));
        assert_eq!(r.gen.sampling.top_k, 0);
        assert_eq!(r.gen.sampling.seed, Some(-3i64 as u64));
        assert_eq!(r.gen.stop, vec!["x"]);
        assert_eq!(r.gen.logprobs, Some(2));
        assert!(r.gen.stream && r.gen.include_usage && r.parse_tools);
        assert_eq!(r.template.enable_thinking, Some(false));
        assert_eq!(r.template.extra.get("custom"), Some(&Value::from(1)));
        assert!(r.template.add_generation_prompt);
    }

    #[test]
    fn wrong_types_name_their_field() {
        let cases = [
            (r#"{"messages": "hi"}"#, "messages"),
            (r#"{"messages": []}"#, "messages"),
            (r#"{}"#, "messages"),
            (r#"{"messages": [1]}"#, "messages[0]"),
            (r#"{"messages": [{"content": "x"}]}"#, "messages[0].role"),
            (r#"{"messages": [{"role": "robot", "content": "x"}]}"#, "messages[0].role"),
            (r#"{"messages": [{"role": "user", "content": 5}]}"#, "messages[0].content"),
            (r#"{"messages": [{"role": "user", "content": [1]}]}"#, "messages[0].content[0]"),
            (r#"{"messages": [{"role": "user"}], "temperature": "hot"}"#, "temperature"),
            (r#"{"messages": [{"role": "user"}], "temperature": -1}"#, "temperature"),
            (r#"{"messages": [{"role": "user"}], "max_tokens": 0}"#, "max_tokens"),
            (r#"{"messages": [{"role": "user"}], "max_tokens": 1.5}"#, "max_tokens"),
            (r#"{"messages": [{"role": "user"}], "n": 2}"#, "n"),
            (r#"{"messages": [{"role": "user"}], "stop": [1]}"#, "stop"),
            (r#"{"messages": [{"role": "user"}], "seed": "x"}"#, "seed"),
            (r#"{"messages": [{"role": "user"}], "top_p": 0}"#, "top_p"),
            (r#"{"messages": [{"role": "user"}], "top_k": -2}"#, "top_k"),
            (r#"{"messages": [{"role": "user"}], "presence_penalty": 3}"#, "presence_penalty"),
            (r#"{"messages": [{"role": "user"}], "logprobs": 1}"#, "logprobs"),
            (r#"{"messages": [{"role": "user"}], "top_logprobs": 2}"#, "top_logprobs"),
            (r#"{"messages": [{"role": "user"}], "logprobs": true, "top_logprobs": 21}"#, "top_logprobs"),
            (r#"{"messages": [{"role": "user"}], "stream": "yes"}"#, "stream"),
            (r#"{"messages": [{"role": "user"}], "stream_options": []}"#, "stream_options"),
            (r#"{"messages": [{"role": "user"}], "tools": {}}"#, "tools"),
            (r#"{"messages": [{"role": "user"}], "tools": [{}]}"#, "tools[0]"),
            (r#"{"messages": [{"role": "user"}], "tool_choice": "maybe"}"#, "tool_choice"),
            (r#"{"messages": [{"role": "user"}], "chat_template_kwargs": 1}"#, "chat_template_kwargs"),
            (r#"{"messages": [{"role": "user"}], "model": 1}"#, "model"),
        ];
        for (body, expected) in cases {
            assert_eq!(param(chat(body).unwrap_err()), expected, "{body}");
        }
    }

    #[test]
    fn bodies_that_are_not_json_objects_are_400() {
        for body in [&b"{"[..], b"[]", b"null", b"\"x\"", b"", b"{\"messages\": \"\xff\"}"] {
            let e = parse_chat(body, &SamplingParams::default()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.param, None);
        }
    }

    #[test]
    fn completion_prompts_take_every_openai_shape() {
        assert_eq!(completion(r#"{"prompt": "hi"}"#).unwrap().prompt, Prompt::Text("hi".into()));
        assert_eq!(completion(r#"{"prompt": ["hi"]}"#).unwrap().prompt, Prompt::Text("hi".into()));
        assert_eq!(completion(r#"{"prompt": [1, 2]}"#).unwrap().prompt, Prompt::Ids(vec![1, 2]));
        assert_eq!(completion(r#"{"prompt": [[1, 2]]}"#).unwrap().prompt, Prompt::Ids(vec![1, 2]));
        for body in [
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": 5}"#,
            r#"{}"#,
            r#"{"prompt": "x", "echo": true}"#,
            r#"{"prompt": "x", "logprobs": true}"#,
            r#"{"prompt": "x", "logprobs": 50}"#,
        ] {
            assert!(!param(completion(body).unwrap_err()).is_empty(), "{body}");
        }
        assert_eq!(completion(r#"{"prompt": "x", "logprobs": 2}"#).unwrap().gen.logprobs, Some(2));
        assert_eq!(completion(r#"{"prompt": "x", "logprobs": 0}"#).unwrap().gen.logprobs, Some(0));
    }

    #[test]
    fn server_defaults_apply_unless_the_request_overrides_them() {
        let defaults = SamplingParams { temperature: 0.6, top_k: 20, ..SamplingParams::default() };
        let r = parse_completion(br#"{"prompt": "x", "temperature": 0}"#, &defaults).unwrap();
        assert_eq!(r.gen.sampling.temperature, 0.0);
        assert_eq!(r.gen.sampling.top_k, 20);
    }

    #[test]
    fn tool_choice_none_drops_the_tools() {
        let r = chat(
            r#"{"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                "tools": [{"type": "function", "function": {"name": "f"}}]}"#,
        )
        .unwrap();
        assert!(!r.parse_tools);
        assert_eq!(r.template.tools, None);
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let e = chat(r#"{"messages": [{"role": "user", "content": "x"}], "max_new_tokens": 5}"#).unwrap_err();
        assert!(e.message.starts_with("Unrecognized request argument supplied: max_new_tokens"), "{e}");
        assert_eq!(param(e), "max_new_tokens");
        let cases = [
            (r#"{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}"#, "messages"),
            (r#"{"prompt": "x", "tools": []}"#, "tools"),
            (r#"{"prompt": "x", "top_logprobs": 2}"#, "top_logprobs"),
            (r#"{"prompt": "x", "guided_json": {}}"#, "guided_json"),
            (
                r#"{"prompt": "x", "stream_options": {"include_usage": true, "include_obfuscation": true}}"#,
                "stream_options.include_obfuscation",
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(param(completion(body).unwrap_err()), expected, "{body}");
        }
        for body in [
            r#"{"messages": [{"role": "user", "content": "x"}], "prompt": "x"}"#,
            r#"{"messages": [{"role": "user", "content": "x"}], "echo": false}"#,
        ] {
            assert!(chat(body).is_err(), "{body}");
        }
        // Null is absent, for unknown fields too; informational fields are accepted.
        completion(
            r#"{"prompt": "x", "guided_json": null, "user": "u", "metadata": {}, "store": true,
                       "service_tier": "default", "logit_bias": {}, "echo": false, "best_of": 1}"#,
        )
        .unwrap();
    }

    #[test]
    fn features_the_server_lacks_are_refused_not_ignored() {
        let with = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {extra}}}"#);
        let cases = [
            (with(r#""response_format": {"type": "xml"}"#), "response_format"),
            (
                with(r#""response_format": {"type": "json_schema", "json_schema": {}}"#),
                "response_format.json_schema.schema",
            ),
            (with(r#""response_format": {"type": "json_object", "schema": {}}"#), "response_format.schema"),
            (with(r#""structured_outputs": {"structural_tag": "x"}"#), "structured_outputs.structural_tag"),
            (with(r#""functions": [{"name": "f"}]"#), "functions"),
            (with(r#""function_call": "auto""#), "function_call"),
            // Forcing a tool call needs the tool.
            (with(r#""tool_choice": "required""#), "tool_choice"),
            (with(r#""tool_choice": {"type": "function", "function": {"name": "f"}}"#), "tool_choice"),
            (with(r#""parallel_tool_calls": false"#), "parallel_tool_calls"),
            (with(r#""modalities": ["text", "audio"]"#), "modalities"),
            (with(r#""audio": {"voice": "alloy"}"#), "audio"),
        ];
        for (body, expected) in &cases {
            let e =
                if body.contains("prompt") { completion(body).map(|_| ()) } else { chat(body).map(|_| ()) };
            assert_eq!(param(e.unwrap_err()), *expected, "{body}");
        }
        let part = |p: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "a"}}, {p}]}}]}}"#
            )
        };
        let parts = [
            (
                r#"{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}"#,
                "messages[0].content[1].type",
            ),
            (
                r#"{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}"#,
                "messages[0].content[1].type",
            ),
            (r#"{"type": "file", "file": {"file_id": "f"}}"#, "messages[0].content[1].type"),
            (r#"{"type": "hologram"}"#, "messages[0].content[1].type"),
            (r#"{"text": "no type"}"#, "messages[0].content[1].type"),
            (r#"{"type": "text", "text": 5}"#, "messages[0].content[1].text"),
            (r#"{"type": "text"}"#, "messages[0].content[1].text"),
            (
                r#"{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}"#,
                "messages[0].content[1].cache_control",
            ),
            (r#""text""#, "messages[0].content[1]"),
        ];
        for (p, expected) in parts {
            assert_eq!(param(chat(&part(p)).unwrap_err()), expected, "{p}");
        }
        let e =
            chat(r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#)
                .unwrap_err();
        assert!(e.message.contains("\"image_url\"") && e.message.contains("not supported"), "{e}");
        assert_eq!(
            param(
                chat(r#"{"messages": [{"role": "assistant", "function_call": {"name": "f"}}]}"#).unwrap_err()
            ),
            "messages[0].function_call"
        );
        chat(&part(r#"{"type": "text", "text": "b"}"#)).unwrap();
    }

    #[test]
    fn logit_bias_decodes_into_the_sampling_parameters() {
        let r = chat(
            r#"{"messages": [{"role": "user", "content": "x"}],
                "logit_bias": {"50256": -100, "0": 100, "7": 2.5, "12": -0.0}}"#,
        )
        .unwrap();
        let mut bias = r.gen.sampling.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(0, 100.0), (7, 2.5), (12, 0.0), (50256, -100.0)]);
        let r = completion(r#"{"prompt": "x", "logit_bias": {"3": 1}}"#).unwrap();
        assert_eq!(r.gen.sampling.logit_bias, vec![(3, 1.0)]);
        // Empty and null ask for nothing.
        assert!(completion(r#"{"prompt": "x", "logit_bias": {}}"#)
            .unwrap()
            .gen
            .sampling
            .logit_bias
            .is_empty());
        assert!(completion(r#"{"prompt": "x", "logit_bias": null}"#)
            .unwrap()
            .gen
            .sampling
            .logit_bias
            .is_empty());
        // At most 300 entries.
        let many = |n: usize| {
            let bias: serde_json::Map<String, Value> =
                (0..n).map(|i| (i.to_string(), Value::from(1))).collect();
            completion(&serde_json::json!({"prompt": "x", "logit_bias": bias}).to_string())
        };
        assert_eq!(many(MAX_LOGIT_BIAS).unwrap().gen.sampling.logit_bias.len(), MAX_LOGIT_BIAS);
        let e = many(MAX_LOGIT_BIAS + 1).unwrap_err();
        assert!(e.message.contains("at most 300"), "{e}");
        assert_eq!(param(e), "logit_bias");
    }

    #[test]
    fn malformed_logit_bias_is_a_400_naming_it() {
        for bias in [
            r#"[1]"#,
            r#""5: 1""#,
            r#"5"#,
            r#"{"a": 1}"#,
            r#"{"-1": 1}"#,
            r#"{"+1": 1}"#,
            r#"{"01": 1}"#,
            r#"{" 1": 1}"#,
            r#"{"1.0": 1}"#,
            r#"{"4294967296": 1}"#,
            r#"{"1": "1"}"#,
            r#"{"1": null}"#,
            r#"{"1": [1]}"#,
            r#"{"1": true}"#,
            r#"{"1": 100.01}"#,
            r#"{"1": -101}"#,
            r#"{"1": 1e300}"#,
        ] {
            let body =
                format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], "logit_bias": {bias}}}"#);
            assert_eq!(param(chat(&body).unwrap_err()), "logit_bias", "{bias}");
            let body = format!(r#"{{"prompt": "x", "logit_bias": {bias}}}"#);
            assert_eq!(param(completion(&body).unwrap_err()), "logit_bias", "{bias}");
        }
    }

    #[test]
    fn stop_strings_are_capped_in_count_and_length() {
        let stops = |n: usize, len: usize| {
            let stops: Vec<String> = (0..n).map(|i| format!("{i:0>len$}")).collect();
            completion(&serde_json::json!({"prompt": "x", "stop": stops}).to_string())
        };
        assert_eq!(stops(MAX_STOP_STRINGS, MAX_STOP_BYTES).unwrap().gen.stop.len(), MAX_STOP_STRINGS);
        assert_eq!(param(stops(MAX_STOP_STRINGS + 1, 1).unwrap_err()), "stop");
        let e = stops(1, MAX_STOP_BYTES + 1).unwrap_err();
        assert!(e.message.contains("at most 256 bytes"), "{e}");
        assert_eq!(param(e), "stop");
        // A single string is capped too, in bytes (UTF-8), not characters.
        let long = "é".repeat(MAX_STOP_BYTES / 2 + 1);
        let e = completion(&serde_json::json!({"prompt": "x", "stop": long}).to_string()).unwrap_err();
        assert_eq!(param(e), "stop");
    }
}
