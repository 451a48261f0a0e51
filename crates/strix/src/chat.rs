//! Chat templates: turning a conversation (messages, tools, options) into the prompt text
//! a checkpoint was trained on, by rendering the Jinja template it ships.
//!
//! Templates are written for Python's Jinja2 as driven by transformers'
//! `apply_chat_template`; they are rendered here with `minijinja`, configured to match:
//! `trim_blocks`/`lstrip_blocks`, Python string and dict methods (`.startswith`,
//! `.split`, `.items()`...), `raise_exception`, `strftime_now`, and a `tojson` that writes
//! what Python's `json.dumps(..., ensure_ascii=False)` writes. Values print the way
//! Python prints them (`True`, `None`), and JSON objects keep their key order, which
//! reaches the prompt through `tojson` and `|items` (tool schemas, tool-call arguments).
//! Key order survives only as far as `serde_json` keeps it: that needs its
//! `preserve_order` feature, without which objects arrive sorted.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Rest};
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation, in the OpenAI chat format.
///
/// Fields beyond the named ones are kept in `extra` and reach the template too, so a
/// server can deserialize a request's messages into this type without losing anything
/// a template might read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` is sent to the template as `none` (an assistant turn that only calls tools).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// The thinking of an earlier assistant turn, without the `<think>` tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// OpenAI `tool_calls`: `[{"id", "type": "function", "function": {"name", "arguments"}}]`.
    /// `arguments` may be a JSON object or, as OpenAI sends it, a string holding one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A message's content: plain text, or OpenAI content parts
/// (`{"type": "text", "text": ...}`, `{"type": "image_url", ...}`) passed to the template
/// as they are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<serde_json::Value>),
}

impl MessageContent {
    /// The text of the content: the text itself, or its text parts joined.
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(text) => text.clone(),
            MessageContent::Parts(parts) => {
                parts.iter().filter_map(|part| part.get("text").and_then(|text| text.as_str())).collect()
            }
        }
    }
}

impl From<&str> for MessageContent {
    fn from(text: &str) -> Self {
        MessageContent::Text(text.to_owned())
    }
}

impl From<String> for MessageContent {
    fn from(text: String) -> Self {
        MessageContent::Text(text)
    }
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<MessageContent>) -> Self {
        ChatMessage { role: role.into(), content: Some(content.into()), ..ChatMessage::default() }
    }

    pub fn system(content: impl Into<MessageContent>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<MessageContent>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<MessageContent>) -> Self {
        Self::new("assistant", content)
    }

    /// The result of a tool call, answering the call with id `tool_call_id`.
    pub fn tool(content: impl Into<MessageContent>, tool_call_id: impl Into<String>) -> Self {
        ChatMessage { tool_call_id: Some(tool_call_id.into()), ..Self::new("tool", content) }
    }

    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }

    pub fn with_tool_calls(mut self, tool_calls: serde_json::Value) -> Self {
        self.tool_calls = Some(tool_calls);
        self
    }
}

/// What to render besides the messages.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    /// End with the opening of an assistant turn, for the model to continue.
    pub add_generation_prompt: bool,
    /// Qwen's switch between thinking and direct answers; passed only when set, since
    /// templates test `enable_thinking is defined`.
    pub enable_thinking: Option<bool>,
    /// Tool definitions, OpenAI style: `[{"type": "function", "function": {...}}]`.
    pub tools: Option<serde_json::Value>,
    /// Further template variables (OpenAI `chat_template_kwargs`). The fields above win
    /// over entries of the same name.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template, with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: Arc<str>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a template's source; fails on a syntax error.
    pub fn from_source(source: impl Into<String>) -> Result<Self> {
        let source: Arc<str> = Arc::from(source.into());
        let mut env = environment();
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::Template(describe(&e)))?;
        Ok(ChatTemplate { env, source, bos_token: None, eos_token: None })
    }

    /// The chat template of a model directory: `chat_template.jinja`, else the
    /// `chat_template` of `chat_template.json`, else that of `tokenizer_config.json` (a
    /// string, or a list of `{name, template}` of which `default` is taken). `bos_token`
    /// and `eos_token` come from `tokenizer_config.json`. `None` when there is no template.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?;

        let jinja_path = dir.join("chat_template.jinja");
        let json_path = dir.join("chat_template.json");
        let (source, file) = if jinja_path.symlink_metadata().is_ok() {
            let source = crate::files::read_text(&jinja_path, crate::files::TEMPLATE_CAP)?;
            (source, jinja_path)
        } else if let Some(source) = template_field(read_json(&json_path)?.as_ref(), &json_path)? {
            (source, json_path)
        } else if let Some(source) = template_field(config.as_ref(), &config_path)? {
            (source, config_path)
        } else {
            return Ok(None);
        };

        let mut template = Self::from_source(source).map_err(|e| match e {
            Error::Template(message) => Error::Template(format!("{}: {message}", file.display())),
            other => other,
        })?;
        if let Some(config) = &config {
            template.bos_token = token_field(config, "bos_token");
            template.eos_token = token_field(config, "eos_token");
        }
        Ok(Some(template))
    }

    /// Sets the special tokens passed to the template as `bos_token` / `eos_token`.
    pub fn with_special_tokens(mut self, bos: Option<String>, eos: Option<String>) -> Self {
        self.bos_token = bos;
        self.eos_token = eos;
        self
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a conversation. A template's own `raise_exception('...')` comes back as
    /// `Error::Template` holding exactly its message (a client error, to a server).
    ///
    /// Tool-call `arguments` given as a JSON string are parsed first (as vLLM does):
    /// Qwen's templates iterate them as a mapping.
    pub fn render(&self, messages: &[ChatMessage], options: &ChatOptions) -> Result<String> {
        let mut context = BTreeMap::<String, Value>::new();
        if let Some(bos) = &self.bos_token {
            context.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            context.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        for (key, value) in &options.extra {
            context.insert(key.clone(), json_to_value(value));
        }
        let messages = messages.iter().map(message_value).collect::<Result<Vec<_>>>()?;
        context.insert("messages".into(), Value::from(messages));
        // transformers always defines `tools` and `documents`, as none when absent.
        match &options.tools {
            Some(tools) => {
                context.insert("tools".into(), json_to_value(tools));
            }
            None => {
                context.entry("tools".into()).or_insert(Value::from(()));
            }
        }
        context.entry("documents".into()).or_insert(Value::from(()));
        context.insert("add_generation_prompt".into(), Value::from(options.add_generation_prompt));
        if let Some(enable_thinking) = options.enable_thinking {
            context.insert("enable_thinking".into(), Value::from(enable_thinking));
        }

        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| Error::Template(describe(&e)))?;
        template.render(Value::from(context)).map_err(|e| Error::Template(describe(&e)))
    }
}

/// A JSON file's contents, `None` when the file does not exist (one that is there but not a
/// regular file, or over the JSON cap, is an error).
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if path.symlink_metadata().is_err() {
        return Ok(None);
    }
    crate::files::read_json(path).map(Some)
}

/// The `chat_template` field: a string, or named templates of which `default` is used.
fn template_field(config: Option<&serde_json::Value>, path: &Path) -> Result<Option<String>> {
    let Some(field) = config.and_then(|config| config.get("chat_template")) else {
        return Ok(None);
    };
    match field {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(source) => Ok(Some(source.clone())),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|entry| entry.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|entry| entry.get("template").and_then(|t| t.as_str()))
            .map(|source| Some(source.to_owned()))
            .ok_or_else(|| Error::config(path, "chat_template: no template named \"default\" in the list")),
        _ => Err(Error::config(path, "chat_template: expected a string or a list of {name, template}")),
    }
}

/// A special token of `tokenizer_config.json`: a string or an added-token object.
fn token_field(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(token) => Some(token.clone()),
        serde_json::Value::Object(token) => token.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn message_value(message: &ChatMessage) -> Result<Value> {
    let mut json = serde_json::to_value(message)
        .map_err(|e| Error::Template(format!("cannot pass a message to the template: {e}")))?;
    if let Some(calls) = json.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
        for call in calls {
            let call = match call.get_mut("function") {
                Some(function) if function.is_object() => function,
                _ => call,
            };
            if let Some(arguments) = call.get_mut("arguments") {
                if let Some(text) = arguments.as_str() {
                    if let Ok(parsed @ serde_json::Value::Object(_)) = serde_json::from_str(text) {
                        *arguments = parsed;
                    }
                }
            }
        }
    }
    Ok(json_to_value(&json))
}

/// Marks the errors a template raised itself, so that their message is passed on as is.
#[derive(Debug)]
struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

fn describe(error: &minijinja::Error) -> String {
    let raised = std::error::Error::source(error).is_some_and(|s| s.is::<Raised>());
    if raised {
        return error.detail().unwrap_or_default().to_owned();
    }
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let _ = write!(message, ": {cause}");
        source = cause.source();
    }
    message
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // transformers renders with these two on; without them the whitespace differs.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        if value.is_undefined() {
            return Ok(());
        }
        let text = match value.as_str() {
            Some(text) => text.to_owned(),
            None => py_str(value),
        };
        out.write_str(&text).map_err(|_| minijinja::Error::from(ErrorKind::WriteFailure))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| match value.as_str() {
        Some(_) => value.clone(),
        None => Value::from(py_str(value)),
    });
    env.add_function("raise_exception", |message: String| -> Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
    });
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    env
}

/// A JSON object as a template value, keeping the key order (minijinja's own maps sort
/// their keys unless its `preserve_order` feature is on).
#[derive(Debug)]
struct JsonObject(Vec<(Value, Value)>);

impl Object for JsonObject {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

fn json_to_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        serde_json::Value::Object(map) => Value::from_object(JsonObject(
            map.iter().map(|(k, v)| (Value::from(k.as_str()), json_to_value(v))).collect(),
        )),
    }
}

/// Python's `json.dumps`, as transformers exposes it to templates:
/// `tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let positional = |i: usize, name: &str| -> Result<Option<Value>, minijinja::Error> {
        match args.get(i) {
            Some(v) => Ok(Some(v.clone())),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = positional(0, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match positional(1, "indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let (item_sep, key_sep) = match positional(2, "separators")? {
        Some(v) if !v.is_none() => {
            let parts = v.try_iter()?.map(|p| p.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>();
            match parts.map(<[String; 2]>::try_from) {
                Some(Ok([item, key])) => (item, key),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let sort_keys = positional(3, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let style = JsonStyle { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::Undefined => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: cannot serialize an undefined value",
            ))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&py_number(value)),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                // json.dumps turns non-string keys into their JSON spelling.
                let key = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
                    ValueKind::None => "null".to_owned(),
                    ValueKind::Bool => key.is_true().to_string(),
                    _ => py_str(&key),
                };
                entries.push((key, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                separate(out, style, i, depth + 1);
                write_json_string(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, item, style, depth + 1)?;
            }
            close(out, style, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separate(out, style, i, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            close(out, style, depth);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of type {}", value.kind()),
            ))
        }
    }
    Ok(())
}

fn separate(out: &mut String, style: &JsonStyle, index: usize, depth: usize) {
    if index > 0 {
        out.push_str(&style.item_sep);
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn close(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str()` of a value, which is what Jinja2 prints.
fn py_str(value: &Value) -> String {
    match value.as_str() {
        Some(s) => s.to_owned(),
        None => py_repr(value),
    }
}

/// Python's `repr()` of a value: strings quoted, containers as Python literals.
fn py_repr(value: &Value) -> String {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".to_owned(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_owned(),
        ValueKind::Number => py_number(value),
        ValueKind::String => py_quote(value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let items: Vec<String> =
                value.try_iter().map(|items| items.map(|item| py_repr(&item)).collect()).unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            if let Ok(keys) = value.try_iter() {
                for key in keys {
                    let item = value.get_item(&key).unwrap_or_default();
                    entries.push(format!("{}: {}", py_repr(&key), py_repr(&item)));
                }
            }
            format!("{{{}}}", entries.join(", "))
        }
        _ => value.to_string(),
    }
}

fn py_quote(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// A number the way Python writes it: integers in full, floats with `repr`
/// (`1.0`, `0.5`, `1e-05`, `1.5e+16`, `inf`).
fn py_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) => py_float(f),
        Err(_) => value.to_string(),
    }
}

fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // Rust's `{:e}` is the shortest round-trip digits, like Python's repr; only the
    // layout differs.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

/// Python's `datetime.now().strftime(format)`, in UTC (a server's local time is
/// usually UTC, and templates only print the date).
fn strftime_now(format: &str) -> Result<String, minijinja::Error> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(strftime(format, seconds))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // glibc's `%-d` (no padding) appears in Llama templates.
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let _ = match spec {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{}", num(year.rem_euclid(100), 2)),
            Some('m') => write!(out, "{}", num(month, 2)),
            Some('d') => write!(out, "{}", num(day, 2)),
            Some('e') => write!(out, "{day:2}"),
            Some('H') => write!(out, "{}", num(hour, 2)),
            Some('I') => write!(out, "{}", num(hour12, 2)),
            Some('M') => write!(out, "{}", num(minute, 2)),
            Some('S') => write!(out, "{}", num(second, 2)),
            Some('p') => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            Some('j') => write!(out, "{}", num(day_of_year, 3)),
            Some('B') => write!(out, "{month_name}"),
            Some('b') | Some('h') => write!(out, "{}", &month_name[..3]),
            Some('A') => write!(out, "{weekday_name}"),
            Some('a') => write!(out, "{}", &weekday_name[..3]),
            Some('w') => write!(out, "{weekday}"),
            Some('F') => write!(out, "{year}-{month:02}-{day:02}"),
            Some('T') => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            Some('Z') => write!(out, "UTC"),
            Some('z') => write!(out, "+0000"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{}{other}", if unpadded { "-" } else { "" }),
            None => write!(out, "%"),
        };
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f), want, "{f}");
        }
    }

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-02-29T13:05:09Z, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            strftime("%d %b %Y, %A %B %-d %j %I%p %%", t),
            "29 Feb 2024, Thursday February 29 060 01PM %"
        );
        assert_eq!(strftime("%F %a", 0), "1970-01-01 Thu");
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
    }

    #[test]
    fn python_reprs() {
        assert_eq!(py_quote("it's"), "\"it's\"");
        assert_eq!(py_quote("a\nb'\""), "'a\\nb\\'\"'");
        let v = Value::from_serialize(serde_json::json!([1, "x", null, true, 2.5]));
        assert_eq!(py_str(&v), "[1, 'x', None, True, 2.5]");
    }
}
