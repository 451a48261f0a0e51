//! Splitting a chat model's streamed output into what the OpenAI API reports separately:
//! the thinking (`reasoning_content`), the answer (`content`) and tool calls (`tool_calls`).
//!
//! Qwen3.5 thinks inside `<think>…</think>`, and its chat template usually opens the block
//! in the prompt itself (`<|im_start|>assistant\n<think>\n`), so the output may begin inside
//! the thinking with only the closing tag to come; [`OutputParser::new`] is told which case
//! holds. Tool calls are `<tool_call>…</tool_call>` blocks holding either Qwen3.5's XML form
//! (`<function=NAME><parameter=ARG>value</parameter></function>`, what its template teaches)
//! or the JSON form of Qwen3 and Hermes (`{"name": …, "arguments": {…}}`).
//!
//! The parser works on text as it streams: a tag split across two pieces is held back until
//! it is known whether it is a tag, and a tool call is reported whole once it is closed. The
//! newlines the template puts around the tags are dropped (leading and trailing whitespace
//! of the reasoning, leading whitespace of the answer, whitespace next to tool calls).

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

/// One tool call, as OpenAI reports it: `arguments` is a string holding a JSON object.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A piece of parsed output, in the order it was produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Reasoning,
    Content,
    /// Inside `<tool_call>`, collecting the body.
    ToolCall,
}

#[derive(Debug)]
pub struct OutputParser {
    mode: Mode,
    /// Text not yet classified: at most a partial tag at its end.
    pending: String,
    /// Whitespace at the end of the reasoning or answer, emitted only if more text follows.
    held_space: String,
    reasoning_started: bool,
    content_started: bool,
    /// `Some` when `<tool_call>` blocks become tool calls: the request's tool definitions.
    tools: Option<Value>,
    tool_body: String,
    /// Whitespace held before the open `<tool_call>`: dropped if the call parses, given back
    /// with the tag's text if it does not.
    space_before_tool: String,
    tool_calls: usize,
}

impl OutputParser {
    /// `in_reasoning`: the prompt left a `<think>` block open. `tools`: the request's tool
    /// definitions when tool calls are to be parsed (their schemas give argument types).
    pub fn new(in_reasoning: bool, tools: Option<Value>) -> Self {
        OutputParser {
            mode: if in_reasoning { Mode::Reasoning } else { Mode::Content },
            pending: String::new(),
            held_space: String::new(),
            reasoning_started: false,
            content_started: false,
            tools,
            tool_body: String::new(),
            space_before_tool: String::new(),
            tool_calls: 0,
        }
    }

    /// Whether a prompt ends inside a `<think>` block: its last `<think>` is not closed.
    pub fn prompt_opens_reasoning(prompt: &str) -> bool {
        match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
            (Some(open), Some(close)) => open > close,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// How many tool calls were reported so far.
    pub fn tool_calls(&self) -> usize {
        self.tool_calls
    }

    /// Adds the next piece of text and returns what it completes.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            let tags: &[&str] = match self.mode {
                Mode::Reasoning => &[THINK_CLOSE],
                Mode::Content if self.tools.is_some() => &[THINK_OPEN, TOOL_OPEN],
                Mode::Content => &[THINK_OPEN],
                Mode::ToolCall => &[TOOL_CLOSE],
            };
            let found = tags.iter().filter_map(|tag| self.pending.find(tag).map(|at| (at, *tag))).min();
            match found {
                Some((at, tag)) => {
                    let before: String = self.pending.drain(..at + tag.len()).collect();
                    self.text(&before[..at], &mut out);
                    self.enter(tag, &mut out);
                }
                None => {
                    let keep = tags.iter().map(|tag| partial_tag_len(&self.pending, tag)).max().unwrap_or(0);
                    let ready: String = self.pending.drain(..self.pending.len() - keep).collect();
                    self.text(&ready, &mut out);
                    return out;
                }
            }
        }
    }

    /// Ends the output: whatever was held back is reported. An unclosed tool call (the token
    /// budget ran out inside it) is reported as the text it was.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::ToolCall => {
                let body = std::mem::take(&mut self.tool_body) + &rest;
                self.mode = Mode::Content;
                self.held_space = std::mem::take(&mut self.space_before_tool);
                self.content(&format!("{TOOL_OPEN}{body}"), &mut out);
            }
            _ => self.text(&rest, &mut out),
        }
        // Trailing whitespace of the answer is kept unless tool calls followed it.
        if self.mode == Mode::Content && self.tool_calls == 0 && self.content_started {
            let held = std::mem::take(&mut self.held_space);
            if !held.is_empty() {
                out.push(Delta::Content(held));
            }
        }
        self.held_space.clear();
        out
    }

    fn enter(&mut self, tag: &str, out: &mut Vec<Delta>) {
        // Whitespace before a tag is the template's layout, not text.
        let space = std::mem::take(&mut self.held_space);
        match tag {
            THINK_OPEN => self.mode = Mode::Reasoning,
            THINK_CLOSE => self.mode = Mode::Content,
            TOOL_OPEN => {
                self.mode = Mode::ToolCall;
                self.space_before_tool = space;
            }
            _ => {
                let body = std::mem::take(&mut self.tool_body);
                let space = std::mem::take(&mut self.space_before_tool);
                self.mode = Mode::Content;
                match parse_tool_call(&body, self.tools.as_ref()) {
                    Some(call) => {
                        self.tool_calls += 1;
                        out.push(Delta::ToolCall(call));
                    }
                    None => {
                        self.held_space = space;
                        self.content(&format!("{TOOL_OPEN}{body}{TOOL_CLOSE}"), out);
                    }
                }
            }
        }
    }

    fn text(&mut self, text: &str, out: &mut Vec<Delta>) {
        match self.mode {
            Mode::ToolCall => self.tool_body.push_str(text),
            Mode::Reasoning => {
                if let Some(text) = self.trimmed(text, self.reasoning_started) {
                    self.reasoning_started = true;
                    out.push(Delta::Reasoning(text));
                }
            }
            Mode::Content => self.content(text, out),
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<Delta>) {
        if let Some(text) = self.trimmed(text, self.content_started) {
            self.content_started = true;
            out.push(Delta::Content(text));
        }
    }

    /// The text to emit now: leading whitespace dropped at the start of a section, trailing
    /// whitespace held until something else follows it.
    fn trimmed(&mut self, text: &str, started: bool) -> Option<String> {
        let text = if started { text } else { text.trim_start() };
        let body = text.trim_end();
        if body.is_empty() {
            if started {
                self.held_space.push_str(text);
            }
            return None;
        }
        let emit = std::mem::take(&mut self.held_space) + body;
        self.held_space.push_str(&text[body.len()..]);
        Some(emit)
    }
}

/// Length of the longest tail of `text` that is a proper prefix of `tag`.
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&n| text.ends_with(&tag[..n])).unwrap_or(0)
}

/// Parses the body of a `<tool_call>` block; `None` when it is neither form.
pub fn parse_tool_call(body: &str, tools: Option<&Value>) -> Option<ToolCall> {
    let body = body.trim();
    let (name, arguments) = if body.starts_with('{') {
        let Value::Object(call) = serde_json::from_str::<Value>(body).ok()? else {
            return None;
        };
        let name = call.get("name")?.as_str()?.to_owned();
        let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
            None | Some(Value::Null) => "{}".to_owned(),
            Some(Value::String(text)) => text.clone(),
            Some(value) => value.to_string(),
        };
        (name, arguments)
    } else {
        let (name, arguments) = parse_xml_call(body, tools)?;
        (name, Value::Object(arguments).to_string())
    };
    if name.is_empty() {
        return None;
    }
    Some(ToolCall { id: crate::ids::fresh_id("call_"), name, arguments })
}

/// `<function=NAME><parameter=ARG>\nvalue\n</parameter>…</function>`.
fn parse_xml_call(body: &str, tools: Option<&Value>) -> Option<(String, Map<String, Value>)> {
    let rest = body.strip_prefix("<function=")?;
    let end = rest.find('>')?;
    let name = rest[..end].trim().to_owned();
    let mut rest = &rest[end + 1..];
    let close = rest.rfind("</function>")?;
    if !rest[close + "</function>".len()..].trim().is_empty() {
        return None;
    }
    rest = &rest[..close];
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix("<parameter=")?;
        let end = after.find('>')?;
        let key = after[..end].trim().to_owned();
        let after = &after[end + 1..];
        let close = after.find("</parameter>")?;
        let raw = &after[..close];
        // The template writes each value on its own lines.
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = typed_argument(raw, parameter_type(tools, &name, &key));
        arguments.insert(key, value);
        rest = &after[close + "</parameter>".len()..];
    }
    Some((name, arguments))
}

/// The JSON-schema `type` of a tool's parameter, if the tool definitions give one.
fn parameter_type<'a>(tools: Option<&'a Value>, function: &str, parameter: &str) -> Option<&'a str> {
    tools?
        .as_array()?
        .iter()
        .filter_map(|tool| tool.get("function"))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(function))?
        .get("parameters")?
        .get("properties")?
        .get(parameter)?
        .get("type")?
        .as_str()
}

/// XML values are text; a parameter declared as a number, boolean, object or array is
/// parsed as JSON (kept as text when it does not parse), anything else stays a string.
fn typed_argument(raw: &str, declared: Option<&str>) -> Value {
    match declared {
        Some("integer" | "number" | "boolean" | "object" | "array" | "null") => {
            serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_owned()))
        }
        _ => Value::String(raw.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Parses `pieces` streamed one by one; joins consecutive deltas of one kind.
    fn parse(in_reasoning: bool, tools: Option<Value>, pieces: &[&str]) -> Vec<Delta> {
        let mut p = OutputParser::new(in_reasoning, tools);
        let mut out: Vec<Delta> = Vec::new();
        for piece in pieces {
            out.extend(p.push(piece));
        }
        out.extend(p.finish());
        let mut joined: Vec<Delta> = Vec::new();
        for d in out {
            match (joined.last_mut(), d) {
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
                (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
                (_, d) => joined.push(d),
            }
        }
        joined
    }

    /// Every split of `text` into two pieces, and one piece per character, parse alike.
    fn parse_all_splits(in_reasoning: bool, tools: Option<Value>, text: &str) -> Vec<Delta> {
        let whole = parse(in_reasoning, tools.clone(), &[text]);
        for (i, _) in text.char_indices() {
            let split = parse(in_reasoning, tools.clone(), &[&text[..i], &text[i..]]);
            assert_eq!(strip_ids(&split), strip_ids(&whole), "split at {i} of {text:?}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(strip_ids(&parse(in_reasoning, tools, &pieces)), strip_ids(&whole));
        whole
    }

    fn strip_ids(deltas: &[Delta]) -> Vec<Delta> {
        deltas
            .iter()
            .map(|d| match d {
                Delta::ToolCall(c) => Delta::ToolCall(ToolCall { id: String::new(), ..c.clone() }),
                d => d.clone(),
            })
            .collect()
    }

    fn reasoning(s: &str) -> Delta {
        Delta::Reasoning(s.into())
    }
    fn content(s: &str) -> Delta {
        Delta::Content(s.into())
    }

    #[test]
    fn reasoning_opened_by_the_prompt_is_split_from_the_answer() {
        let out = parse_all_splits(true, None, "Let me think.\nOK.\n</think>\n\nThe answer is 4.");
        assert_eq!(out, vec![reasoning("Let me think.\nOK."), content("The answer is 4.")]);
    }

    #[test]
    fn reasoning_opened_by_the_model_is_split_too() {
        let out = parse_all_splits(false, None, "<think>\nhmm\n</think>\n\nHi <b>there</b>\n");
        assert_eq!(out, vec![reasoning("hmm"), content("Hi <b>there</b>\n")]);
    }

    #[test]
    fn output_without_tags_is_content_or_reasoning_by_the_prompt() {
        assert_eq!(parse_all_splits(false, None, "plain <thin text"), vec![content("plain <thin text")]);
        assert_eq!(
            parse_all_splits(true, None, "cut off mid-thought <"),
            vec![reasoning("cut off mid-thought <")]
        );
        assert_eq!(parse(true, None, &["\n\n"]), vec![]);
    }

    #[test]
    fn the_prompt_tells_whether_reasoning_is_open() {
        assert!(OutputParser::prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!OutputParser::prompt_opens_reasoning("assistant\n<think>\n\n</think>\n\n"));
        assert!(!OutputParser::prompt_opens_reasoning("no tags"));
        assert!(OutputParser::prompt_opens_reasoning("<think>a</think> b <think>\n"));
    }

    #[test]
    fn qwen35_xml_tool_calls_become_tool_calls() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "opts": {"type": "object"}}}}}]);
        let text =
            "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                    <parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n\
                    </function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n10\n\
                    </parameter>\n</function>\n</tool_call>";
        let out = parse_all_splits(true, Some(tools.clone()), &format!("thinking\n</think>\n\n{text}"));
        assert_eq!(out.len(), 4, "{out:?}");
        assert_eq!(out[0], reasoning("thinking"));
        assert_eq!(out[1], content("I'll check."));
        let Delta::ToolCall(call) = &out[2] else { panic!("{out:?}") };
        assert_eq!(call.name, "get_weather");
        let args: Value = serde_json::from_str(&call.arguments).unwrap();
        assert_eq!(args, json!({"city": "Paris", "days": 3, "opts": {"unit": "C"}}));
        let Delta::ToolCall(second) = &out[3] else { panic!("{out:?}") };
        // Declared a string, so it stays one even though it looks like a number.
        assert_eq!(serde_json::from_str::<Value>(&second.arguments).unwrap(), json!({"city": "10"}));
        assert_ne!(call.id, second.id);
    }

    #[test]
    fn json_tool_calls_become_tool_calls() {
        let tools = Some(json!([{"type": "function", "function": {"name": "f"}}]));
        let out = parse_all_splits(
            false,
            tools,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>",
        );
        let [Delta::ToolCall(call)] = out.as_slice() else { panic!("{out:?}") };
        assert_eq!(call.name, "f");
        assert_eq!(serde_json::from_str::<Value>(&call.arguments).unwrap(), json!({"x": [1, 2]}));
    }

    #[test]
    fn tool_tags_are_text_without_tools_or_when_malformed() {
        let text = "<tool_call>{\"name\": \"f\"}</tool_call>";
        assert_eq!(parse_all_splits(false, None, text), vec![content(text)]);
        let tools = Some(json!([]));
        let bad = "<tool_call>not a call</tool_call>";
        assert_eq!(parse_all_splits(false, tools.clone(), bad), vec![content(bad)]);
        let unclosed = "a <tool_call>\n<function=f>";
        assert_eq!(parse_all_splits(false, tools, unclosed), vec![content(unclosed)]);
    }

    #[test]
    fn xml_calls_parse_on_strings() {
        let (name, args) = parse_xml_call("<function=f>\n</function>", None).unwrap();
        assert_eq!((name.as_str(), args.len()), ("f", 0));
        let (_, args) =
            parse_xml_call("<function=f>\n<parameter=a>\nline 1\nline 2\n</parameter>\n</function>", None)
                .unwrap();
        assert_eq!(args["a"], json!("line 1\nline 2"));
        for bad in
            ["<function=f>", "<function=f><parameter=a>x</function>", "<function=f></function> tail", "x"]
        {
            assert!(parse_xml_call(bad, None).is_none(), "{bad}");
        }
    }
}
