//! Chat templates: the Qwen3.5 template rendered byte for byte as transformers'
//! `apply_chat_template` renders it (goldens from scripts/make_qwen_tokenizer.py), the
//! Python-compatible helpers templates rely on, and loading from a model directory.

use std::path::PathBuf;

use serde_json::json;
use strix::chat::{ChatMessage, ChatOptions, ChatTemplate, MessageContent};
use strix::Error;

fn repo_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative)
}

fn qwen_source() -> String {
    std::fs::read_to_string(repo_path("scripts/assets/qwen3_5_chat_template.jinja")).unwrap()
}

fn qwen() -> ChatTemplate {
    ChatTemplate::from_source(qwen_source()).unwrap().with_special_tokens(None, Some("<|im_end|>".into()))
}

fn render(source: &str, context: serde_json::Value) -> Result<String, Error> {
    let options = ChatOptions { extra: context.as_object().unwrap().clone(), ..ChatOptions::default() };
    ChatTemplate::from_source(source)?.render(&[], &options)
}

fn assert_key_order_is_kept() {
    let probe: serde_json::Value = serde_json::from_str(r#"{"b": 1, "a": 2}"#).unwrap();
    let keys: Vec<&String> = probe.as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        ["b", "a"],
        "serde_json sorts object keys: enable its `preserve_order` feature, or tool schemas \
         and tool-call arguments reach the prompt in a different order than the model was trained on"
    );
}

struct Golden {
    name: String,
    messages: Vec<ChatMessage>,
    options: ChatOptions,
    expected: Result<String, String>,
}

fn goldens() -> Vec<Golden> {
    let text = std::fs::read_to_string(repo_path("tests/fixtures/tokenizer/chat_goldens.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    cases
        .into_iter()
        .map(|case| Golden {
            name: case["name"].as_str().unwrap().to_owned(),
            messages: serde_json::from_value(case["messages"].clone()).unwrap(),
            options: ChatOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                enable_thinking: case["enable_thinking"].as_bool(),
                tools: Some(case["tools"].clone()).filter(|t| !t.is_null()),
                extra: case["kwargs"].as_object().cloned().unwrap_or_default(),
            },
            expected: match case.get("expected") {
                Some(expected) => Ok(expected.as_str().unwrap().to_owned()),
                None => Err(case["error"].as_str().unwrap().to_owned()),
            },
        })
        .collect()
}

#[test]
fn qwen3_5_template_matches_transformers() {
    assert_key_order_is_kept();
    let template = qwen();
    let goldens = goldens();
    let names: Vec<&str> = goldens.iter().map(|g| g.name.as_str()).collect();
    for wanted in
        ["system_user_generation_prompt", "multi_turn_reasoning_content", "tools", "enable_thinking_false"]
    {
        assert!(names.contains(&wanted), "golden {wanted} missing from {names:?}");
    }
    for golden in goldens {
        let got = template.render(&golden.messages, &golden.options);
        match (&golden.expected, got) {
            (Ok(want), Ok(got)) => assert_eq!(&got, want, "case {}", golden.name),
            (Err(want), Err(Error::Template(got))) => assert_eq!(&got, want, "case {}", golden.name),
            (want, got) => panic!("case {}: want {want:?}, got {got:?}", golden.name),
        }
    }
}

#[test]
fn tool_call_arguments_as_json_strings_render_like_objects() {
    assert_key_order_is_kept();
    let golden = goldens().into_iter().find(|g| g.name == "tools").unwrap();
    let mut messages = golden.messages.clone();
    for message in &mut messages {
        if let Some(calls) = message.tool_calls.as_mut().and_then(|c| c.as_array_mut()) {
            for call in calls {
                let arguments = call["function"]["arguments"].to_string();
                call["function"]["arguments"] = serde_json::Value::String(arguments);
            }
        }
    }
    assert_ne!(messages, golden.messages);
    let got = qwen().render(&messages, &golden.options).unwrap();
    assert_eq!(Ok(got), golden.expected);
}

#[test]
fn simple_conversation() {
    let messages = [ChatMessage::system("Be nice."), ChatMessage::user("hi")];
    let options =
        ChatOptions { add_generation_prompt: true, enable_thinking: Some(false), ..ChatOptions::default() };
    assert_eq!(
        qwen().render(&messages, &options).unwrap(),
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    let history = [ChatMessage::user("hi"), ChatMessage::assistant("hello").with_reasoning("greet back")];
    assert_eq!(
        qwen().render(&history, &ChatOptions::default()).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nhello<|im_end|>\n"
    );
}

#[test]
fn template_errors_are_template_errors() {
    let err = qwen().render(&[], &ChatOptions::default()).unwrap_err();
    assert!(matches!(&err, Error::Template(m) if m == "No messages provided."), "{err}");
    let err = qwen()
        .render(&[ChatMessage::user("hi"), ChatMessage::new("robot", "beep")], &ChatOptions::default())
        .unwrap_err();
    assert!(matches!(&err, Error::Template(m) if m == "Unexpected message role."), "{err}");
    // Raised from inside a macro, with a content-parts message.
    let image = MessageContent::Parts(vec![json!({"type": "image", "image": "a.png"})]);
    let err = qwen().render(&[ChatMessage::system(image), ChatMessage::user("hi")], &ChatOptions::default());
    assert!(
        matches!(&err, Err(Error::Template(m)) if m == "System message cannot contain images."),
        "{err:?}"
    );
    // Errors of the engine itself (not raised by the template) say where they happened.
    let err = render("{{ 1 + }}", json!({})).unwrap_err();
    assert!(matches!(&err, Error::Template(m) if m.contains("syntax error")), "{err}");
    let err = render("{{ x.y.z }}", json!({})).unwrap_err();
    assert!(matches!(err, Error::Template(_)), "{err}");
}

#[test]
fn tojson_writes_python_json_dumps() {
    let x = json!({"b": [1, 2.5, null, true], "a": "é\n\"<>&'", "n": {}, "l": [], "z": 1e-05});
    let context = json!({"x": x, "e": {"e": "😀\u{1}\u{7f}"}});
    let cases = [
        (
            "{{ x | tojson }}",
            r#"{"b": [1, 2.5, null, true], "a": "é\n\"<>&'", "n": {}, "l": [], "z": 1e-05}"#,
        ),
        (
            "{{ x | tojson(indent=2) }}",
            "{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": \"é\\n\\\"<>&'\",\n  \
             \"n\": {},\n  \"l\": [],\n  \"z\": 1e-05\n}",
        ),
        (
            "{{ x | tojson(ensure_ascii=true, sort_keys=true) }}",
            r#"{"a": "\u00e9\n\"<>&'", "b": [1, 2.5, null, true], "l": [], "n": {}, "z": 1e-05}"#,
        ),
        (
            "{{ x | tojson(separators=(',', ':')) }}",
            r#"{"b":[1,2.5,null,true],"a":"é\n\"<>&'","n":{},"l":[],"z":1e-05}"#,
        ),
        ("{{ e | tojson(ensure_ascii=true) }}", r#"{"e": "\ud83d\ude00\u0001\u007f"}"#),
    ];
    assert_key_order_is_kept();
    for (source, want) in cases {
        assert_eq!(render(source, context.clone()).unwrap(), want, "{source}");
    }
}

#[test]
fn values_print_like_python() {
    let context = json!({"x": true, "y": null, "z": 1.0, "w": [1, "a", null], "v": false});
    assert_eq!(
        render("{{ x }}|{{ y }}|{{ z }}|{{ w }}|{{ v|string }}|{{ nope }}", context).unwrap(),
        "True|None|1.0|[1, 'a', None]|False|"
    );
}

#[test]
fn python_methods_namespace_and_loop_controls() {
    let source = "{%- set ns = namespace(n=0) %}\
        {%- for m in messages[::-1] %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
        {%- set ns.n = ns.n + 1 %}{{ m.content.strip().split(' ')[-1].upper() }}\
        {%- if m.content.startswith('  a') %}!{% endif %}{% if loop.index == 2 %}{% break %}{% endif %},\
        {%- endfor %}|{{ ns.n }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}\
        {{- d.get('missing', 'dflt') }}|{{ 'x' ~ 1 }}";
    let messages = [
        ChatMessage::user("  a b  "),
        ChatMessage::new("skip", "c"),
        ChatMessage::user("d e"),
        ChatMessage::user("f"),
    ];
    let options = ChatOptions {
        extra: json!({"d": {"z": 1, "a": 2}}).as_object().unwrap().clone(),
        ..ChatOptions::default()
    };
    assert_key_order_is_kept();
    assert_eq!(
        ChatTemplate::from_source(source).unwrap().render(&messages, &options).unwrap(),
        "F,E|2|z=1;a=2;dflt|x1"
    );
}

#[test]
fn variables_reach_the_template() {
    let source = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|\
        {{ enable_thinking is defined }}|{{ tools is none }}|{{ custom }}|{{ messages | length }}";
    let template = ChatTemplate::from_source(source)
        .unwrap()
        .with_special_tokens(Some("<s>".into()), Some("</s>".into()));
    let mut options = ChatOptions::default();
    assert_eq!(template.render(&[], &options).unwrap(), "<s>|</s>|False|False|True||0");

    // Explicit options win over chat_template_kwargs of the same name.
    options.extra = json!({"custom": "yes", "add_generation_prompt": false, "enable_thinking": true})
        .as_object()
        .unwrap()
        .clone();
    options.add_generation_prompt = true;
    options.enable_thinking = Some(false);
    options.tools = Some(json!([]));
    assert_eq!(
        template.render(&[ChatMessage::user("x")], &options).unwrap(),
        "<s>|</s>|True|True|False|yes|1"
    );

    let year = render("{{ strftime_now('%Y') }}", json!({})).unwrap();
    assert!(year.len() == 4 && year.starts_with('2'), "{year}");
}

#[test]
fn messages_deserialize_from_openai_requests() {
    let request = json!([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"k\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done", "custom_field": 7}
    ]);
    let messages: Vec<ChatMessage> = serde_json::from_value(request).unwrap();
    assert_eq!(messages[0].content.as_ref().map(MessageContent::text).as_deref(), Some("a"));
    assert_eq!(messages[1].content, None);
    assert_eq!(messages[2].tool_call_id.as_deref(), Some("c1"));
    assert_eq!(messages[2].extra["custom_field"], 7);

    let source = "{% for m in messages %}{{ m.role }}:{{ m.content is none }}:{{ m.custom_field }}:\
        {% for c in m.tool_calls or [] %}{{ c.function.arguments.k }}{% endfor %};{% endfor %}";
    let rendered =
        ChatTemplate::from_source(source).unwrap().render(&messages, &ChatOptions::default()).unwrap();
    assert_eq!(rendered, "user:False::;assistant:True::1;tool:False:7:;");
}

#[test]
fn loads_from_model_directories() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    assert!(ChatTemplate::from_model_dir(path).unwrap().is_none());

    let config = |template: serde_json::Value| {
        json!({"bos_token": null, "eos_token": {"content": "<|im_end|>", "special": true},
               "chat_template": template})
        .to_string()
    };
    std::fs::write(path.join("tokenizer_config.json"), config(json!("A{{ eos_token }}"))).unwrap();
    let template = ChatTemplate::from_model_dir(path).unwrap().unwrap();
    assert_eq!(template.eos_token(), Some("<|im_end|>"));
    assert_eq!(template.bos_token(), None);
    assert_eq!(template.render(&[], &ChatOptions::default()).unwrap(), "A<|im_end|>");

    let named = json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
    std::fs::write(path.join("tokenizer_config.json"), config(named)).unwrap();
    let template = ChatTemplate::from_model_dir(path).unwrap().unwrap();
    assert_eq!(template.source(), "D");

    let no_default = json!([{"name": "tool_use", "template": "T"}]);
    std::fs::write(path.join("tokenizer_config.json"), config(no_default)).unwrap();
    let err = ChatTemplate::from_model_dir(path).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json") && err.contains("default"), "{err}");

    std::fs::write(path.join("chat_template.jinja"), qwen_source()).unwrap();
    let template = ChatTemplate::from_model_dir(path).unwrap().unwrap();
    assert_eq!(template.source(), qwen_source());
    assert_eq!(template.eos_token(), Some("<|im_end|>"));

    std::fs::write(path.join("chat_template.jinja"), "{% if %}").unwrap();
    let err = ChatTemplate::from_model_dir(path).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja"), "{err}");

    std::fs::remove_file(path.join("chat_template.jinja")).unwrap();
    std::fs::write(path.join("tokenizer_config.json"), "{ broken").unwrap();
    let err = ChatTemplate::from_model_dir(path).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn types_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ChatTemplate>();
    send_sync::<ChatMessage>();
    send_sync::<strix::tokenizer::Tokenizer>();
    send_sync::<strix::tokenizer::StreamDecoder>();
}
