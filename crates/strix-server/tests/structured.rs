//! Structured output end to end, on the tiny fixture model: its weights are random, so only the
//! constraint can make its output valid. `response_format` json_schema and json_object,
//! `structured_outputs` regex, choice and Lark grammars, forced tool calls, `logit_bias` on the
//! chat endpoint, and the 400s of grammars that cannot be compiled.

mod common;

use common::*;
use serde_json::{json, Value};

/// The schema of the tests: enums, bounded integers, a nested object, an array of objects,
/// bounded strings, every property required, no others.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 500},
            "ok": {"type": "boolean"},
            "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                      "required": ["name"], "additionalProperties": false},
            "items": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["id"], "additionalProperties": false}}
        },
        "required": ["colour", "count", "ok", "owner", "items"],
        "additionalProperties": false
    })
}

/// `text` parses and follows [`schema`].
fn check_document(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.keys().collect::<Vec<_>>(), ["colour", "count", "ok", "owner", "items"], "{text}");
    assert!(["red", "green", "blue"].contains(&o["colour"].as_str().unwrap()), "{text}");
    assert!((0..=500).contains(&o["count"].as_i64().unwrap()), "{text}");
    assert!(o["ok"].is_boolean(), "{text}");
    let owner = o["owner"].as_object().unwrap();
    assert_eq!(owner.len(), 1, "{text}");
    assert!(owner["name"].as_str().unwrap().chars().count() <= 6, "{text}");
    let items = o["items"].as_array().unwrap();
    assert!(items.len() <= 2, "{text}");
    for item in items {
        assert_eq!(item.as_object().unwrap().len(), 1, "{text}");
        assert!((1..=9).contains(&item["id"].as_i64().unwrap()), "{text}");
    }
}

#[test]
fn json_schema_outputs_parse_and_follow_the_schema() {
    let server = start(|_| {});
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema(), "strict": true}});
    for seed in 0..6 {
        for stream in [false, true] {
            let body = json!({"messages": user(&format!("Describe thing {seed}")), "max_tokens": 400,
                              "temperature": 1.0, "seed": seed, "response_format": format, "stream": stream});
            let (content, finish) = if stream {
                let chunks = common::stream(server.addr(), CHAT_PATH, &body);
                assert_eq!(joined(&chunks, "reasoning_content"), "");
                (joined(&chunks, "content"), finish_of(&chunks))
            } else {
                let body = post(server.addr(), CHAT_PATH, &body).json();
                let message = &body["choices"][0]["message"];
                assert!(message.get("reasoning_content").is_none_or(Value::is_null), "{body}");
                let finish = body["choices"][0]["finish_reason"].as_str().unwrap().to_owned();
                (message["content"].as_str().unwrap().to_owned(), finish)
            };
            assert_eq!(finish, "stop", "seed {seed}: {content}");
            check_document(&content);
        }
    }
}

#[test]
fn json_object_outputs_parse_as_objects() {
    let server = start(|_| {});
    for seed in 0..4 {
        let body = json!({"messages": user("Any object"), "max_tokens": 600, "temperature": 0.7, "seed": seed,
                          "response_format": {"type": "json_object"}});
        let r = post(server.addr(), CHAT_PATH, &body).json();
        let choice = &r["choices"][0];
        // An unbounded object may run out of tokens; what finished must parse.
        if choice["finish_reason"] == "stop" {
            let text = choice["message"]["content"].as_str().unwrap();
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v.is_object(), "{text}");
        } else {
            assert!(choice["message"]["content"].as_str().unwrap().starts_with('{'), "{r}");
        }
    }
}

#[test]
fn regex_choice_and_lark_constraints_hold_on_both_endpoints() {
    let server = start(|_| {});
    for seed in 0..4 {
        let r = post(
            server.addr(),
            COMPLETIONS_PATH,
            &json!({"prompt": "Phone:", "max_tokens": 30, "temperature": 1.0, "seed": seed,
                    "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}),
        )
        .json();
        let text = r["choices"][0]["text"].as_str().unwrap();
        assert!(
            text.len() == 8
                && text.as_bytes()[3] == b'-'
                && text.bytes().filter(u8::is_ascii_digit).count() == 7,
            "{text:?}"
        );
        assert_eq!(r["choices"][0]["finish_reason"], "stop");

        let r = post(
            server.addr(),
            CHAT_PATH,
            &json!({"messages": user("Pick"), "max_tokens": 30, "temperature": 1.0, "seed": seed,
                    "structured_outputs": {"choice": ["alpha", "beta gamma", "δ"]}}),
        )
        .json();
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(["alpha", "beta gamma", "δ"].contains(&text), "{text:?}");

        let r = post(
            server.addr(),
            COMPLETIONS_PATH,
            &json!({"prompt": "x", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                    "structured_outputs": {"grammar": "start: \"(\" N (\",\" N)? \")\"\nN: /[1-9]/\n"}}),
        )
        .json();
        let text = r["choices"][0]["text"].as_str().unwrap();
        assert!(text.starts_with('(') && text.ends_with(')') && text.len() <= 5, "{text:?}");
        // response_format works on completions too (an extension).
        let r = post(
            server.addr(),
            COMPLETIONS_PATH,
            &json!({"prompt": "x", "max_tokens": 400, "temperature": 1.0, "seed": seed,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema()}}}),
        )
        .json();
        check_document(r["choices"][0]["text"].as_str().unwrap());
    }
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": false}}}
    ])
}

#[test]
fn forced_tool_calls_have_valid_arguments() {
    // The template's tool instructions are long in the fixture's small vocabulary.
    let server = start(|c| c.engine.context = 4096);
    for seed in 0..4 {
        for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_time"}})] {
            let body = json!({"messages": user("Weather?"), "max_tokens": 300, "temperature": 1.0, "seed": seed,
                              "tools": weather_tools(), "tool_choice": choice});
            let r = post(server.addr(), CHAT_PATH, &body).json();
            let c = &r["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{r}");
            let calls = c["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{r}"));
            assert!(!calls.is_empty());
            if choice.is_object() {
                assert_eq!(calls.len(), 1, "{r}");
            }
            for call in calls {
                let name = call["function"]["name"].as_str().unwrap();
                let args: Value =
                    serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
                match name {
                    "get_weather" => {
                        assert!(choice.is_string(), "{r}");
                        assert!(
                            ["Paris", "Oslo", "Lima"].contains(&args["city"].as_str().unwrap()),
                            "{args}"
                        );
                        assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
                        assert_eq!(args.as_object().unwrap().len(), 2);
                    }
                    "get_time" => {
                        assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap()), "{args}");
                        assert_eq!(args.as_object().unwrap().len(), 1);
                    }
                    other => panic!("called {other}"),
                }
            }
        }
    }
}

/// `logit_bias` +100 on one token forces it on the chat endpoint too.
#[test]
fn logit_bias_forces_a_token_in_chat() {
    let server = start(|_| {});
    let served = served();
    let forced = served.tokenizer.encode("k", false).unwrap()[0];
    let r = post(
        server.addr(),
        CHAT_PATH,
        &json!({"messages": user("Hi"), "max_tokens": 5, "temperature": 1.0, "seed": 3,
                "logit_bias": {forced.to_string(): 100}, "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .json();
    assert_eq!(r["choices"][0]["message"]["content"], "kkkkk", "{r}");
}

#[test]
fn grammars_that_cannot_compile_are_400s_naming_the_field() {
    let server = start(|_| {});
    let chat = |extra: Value| {
        let mut body = json!({"messages": user("x"), "max_tokens": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(server.addr(), CHAT_PATH, &body).error(400)
    };
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}),
            "response_format",
            "cannot compile the JSON schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
            "required",
        ),
        (json!({"response_format": {"type": "yaml"}}), "response_format", "json_schema"),
        (
            json!({"structured_outputs": {"grammar": "start: ("}}),
            "structured_outputs",
            "cannot compile the Lark grammar",
        ),
        (json!({"structured_outputs": {"regex": "("}}), "structured_outputs", "cannot compile the regex"),
        (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
        (
            json!({"structured_outputs": {"structural_tag": "a"}}),
            "structured_outputs.structural_tag",
            "nrecognized",
        ),
        (json!({"structured_outputs": {"choice": []}}), "structured_outputs.choice", "non-empty"),
        (
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            "structured_outputs",
            "not both",
        ),
        (
            json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
            "not among `tools`",
        ),
        (json!({"tool_choice": "required"}), "tool_choice", "needs `tools`"),
        (
            json!({"tools": weather_tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
            "cannot be combined",
        ),
    ];
    for (extra, param, message) in cases {
        let e = chat(extra.clone());
        assert_eq!(e["param"], param, "{extra}: {e}");
        assert!(e["message"].as_str().unwrap().contains(message), "{extra}: {e}");
    }
}
