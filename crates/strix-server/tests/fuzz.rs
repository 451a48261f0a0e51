//! Property tests of request decoding: random bytes, random JSON and random mutations of
//! valid requests never panic, and whatever is refused is refused with a 400 whose body
//! has OpenAI's error shape. The last property sends such requests to a live server (which
//! also renders the template and generates): every answer is a 200 or a 4xx with an error
//! body, and the server keeps serving.

mod common;

use proptest::prelude::*;
use serde_json::{json, Value};
use strix::sampling::SamplingParams;
use strix_server::request::{parse_chat, parse_completion};
use strix_server::ApiError;

fn check(result: Result<impl Sized, ApiError>) {
    if let Err(e) = result {
        assert_eq!(e.status.as_u16(), 400, "{e}");
        let body = e.body();
        assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}

fn decode_both(bytes: &[u8]) {
    let defaults = SamplingParams::default();
    check(parse_chat(bytes, &defaults));
    check(parse_completion(bytes, &defaults));
}

/// Any JSON value, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter("JSON has no NaN or infinity", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every field either endpoint reads, and two it refuses by name.
fn fields() -> Vec<&'static str> {
    use strix_server::request::{CHAT_FIELDS, COMMON_FIELDS, COMPLETION_FIELDS};
    COMMON_FIELDS
        .iter()
        .chain(&CHAT_FIELDS)
        .chain(&COMPLETION_FIELDS)
        .copied()
        .chain(["functions", "audio"])
        .collect()
}

/// A valid request with one known field replaced by a random value.
fn mutated_request() -> impl Strategy<Value = Value> {
    (prop::sample::select(fields()), any_json(), any::<bool>()).prop_map(|(field, value, chat)| {
        let mut request = if chat {
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        } else {
            json!({"model": "m", "prompt": "hi", "max_tokens": 4})
        };
        request[field] = value;
        request
    })
}

/// One server for every case of the live property: a short context bounds each generation.
fn live_server() -> std::net::SocketAddr {
    static SERVER: std::sync::OnceLock<strix_server::Server> = std::sync::OnceLock::new();
    SERVER
        .get_or_init(|| {
            common::start(|c| {
                c.engine.context = 96;
                c.max_body = 1 << 16;
            })
        })
        .addr()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        decode_both(&bytes);
    }

    #[test]
    fn random_json_never_panics(value in any_json()) {
        decode_both(value.to_string().as_bytes());
    }

    #[test]
    fn mutated_requests_never_panic(request in mutated_request()) {
        decode_both(request.to_string().as_bytes());
    }

    #[test]
    fn random_messages_never_panic(messages in prop::collection::vec(any_json(), 0..4)) {
        decode_both(json!({"messages": messages}).to_string().as_bytes());
    }

    #[test]
    fn a_live_server_answers_random_requests_with_200_or_an_error_body(request in mutated_request()) {
        let addr = live_server();
        for path in [common::CHAT_PATH, common::COMPLETIONS_PATH] {
            let r = common::post(addr, path, &request);
            if r.status == 200 && r.header("content-type") == Some("text/event-stream") {
                prop_assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
            } else if r.status == 200 {
                prop_assert!(r.json()["choices"].is_array());
            } else {
                let body = r.json();
                prop_assert!((400..500).contains(&r.status), "{} {}", r.status, r.text());
                prop_assert!(body["error"]["message"].is_string());
            }
        }
    }

    #[test]
    fn truncated_requests_never_panic(cut in 0usize..200) {
        let full = json!({"messages": [{"role": "user", "content": "héllo ✓"}], "stop": ["a", "b"],
                          "temperature": 0.5, "stream": true}).to_string();
        let bytes = full.as_bytes();
        decode_both(&bytes[..cut.min(bytes.len())]);
    }
}
