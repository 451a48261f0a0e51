//! The server under hostile requests, on the tiny fixture model: prompts of megabytes sent
//! at once stay within a memory ceiling and are refused with `context_length_exceeded`;
//! stop strings past the caps are refused, and the most the caps allow do not stop a
//! concurrent request from completing with its usual answer; fields the server does not
//! implement are refused by name. Each property is checked by behaviour (status, body,
//! answer, memory), never by timing.

mod common;

use std::net::SocketAddr;

use common::*;
use serde_json::{json, Value};

/// This process's peak resident memory since the last [`reset_peak_rss`], in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kib << 10
}

/// Restarts the peak (Linux's `clear_refs` 5); `false` where the kernel does not allow it.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// "a a a ...": 3.9 MB, about two million tokens of the fixture's tokenizer, as in the
/// report that 24 of them at once aborted the server.
fn huge_prompt() -> String {
    "a ".repeat(3_900_000 / 2)
}

fn refused_as_too_long(r: &Response, param: &str) {
    let e = r.error(400);
    assert_eq!(e["code"], "context_length_exceeded", "{e}");
    assert_eq!(e["param"], param, "{e}");
}

/// Sixteen 3.9 MB prompts at once (completions and chat) are refused for their length, and
/// the process grows by less than 600 MB at its peak. The bodies themselves account for up
/// to 16 x ~5 copies x 3.9 MB = 310 MB (the server's body buffer, its JSON, the prompt text,
/// for chat the message and the rendered template); tokenizing one such prompt whole takes
/// more than that by itself (~740 MB with Qwen's tokenizer; 16: 10.6 GB), so the bound fails
/// if even one request tokenizes its prompt to the end rather than stopping at the context.
#[test]
fn concurrent_megabyte_prompts_are_refused_within_a_memory_ceiling() {
    let server = start(|c| c.max_body = 8 << 20);
    let addr = server.addr();
    let prompt = huge_prompt();
    // The clients share two bodies, so that what grows is the server.
    let completion = json!({"prompt": prompt, "max_tokens": 8}).to_string().into_bytes();
    let chat = json!({"messages": [{"role": "user", "content": prompt}]}).to_string().into_bytes();
    drop(prompt);
    // Warm up (the first request allocates the runtime's buffers and the tokenizer's rules).
    refused_as_too_long(&request(addr, "POST", COMPLETIONS_PATH, &[], &completion), "prompt");
    let resettable = reset_peak_rss();
    let before = peak_rss();
    let results: Vec<(Response, &str)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let (completion, chat) = (&completion, &chat);
                scope.spawn(move || {
                    if i % 2 == 0 {
                        (request(addr, "POST", COMPLETIONS_PATH, &[], completion), "prompt")
                    } else {
                        (request(addr, "POST", CHAT_PATH, &[], chat), "messages")
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let grown = peak_rss().saturating_sub(before);
    for (response, param) in &results {
        refused_as_too_long(response, param);
    }
    eprintln!("peak RSS growth for 16 concurrent 3.9 MB prompts: {} MB", grown >> 20);
    if resettable {
        assert!(grown < 600 << 20, "peak RSS grew by {} MB", grown >> 20);
    } else {
        eprintln!("(cannot reset the peak RSS here: the ceiling is not checked)");
    }
    // Still serving, and a prompt that fits is tokenized exactly as the library does.
    let ok = post(addr, COMPLETIONS_PATH, &json!({"prompt": "a ".repeat(300), "max_tokens": 2}));
    assert_eq!(ok.status, 200, "{}", ok.text());
    let ids = served().tokenizer.encode(&"a ".repeat(300), false).unwrap();
    assert_eq!(ok.json()["usage"]["prompt_tokens"], ids.len());
}

/// A prompt made of one word with no place to cut it is refused by its length alone.
#[test]
fn a_prompt_without_word_breaks_is_refused_too() {
    let server = start(|c| c.max_body = 8 << 20);
    let r = post(server.addr(), COMPLETIONS_PATH, &json!({"prompt": "a".repeat(3_900_000)}));
    refused_as_too_long(&r, "prompt");
}

/// The stops of `n` strings of `len` bytes, unlikely to appear in the output.
fn stops(n: usize, len: usize) -> Vec<String> {
    (0..n).map(|i| format!("{i}{}", "~".repeat(len - i.to_string().len()))).collect()
}

fn completion_text(addr: SocketAddr, body: &Value) -> String {
    let r = post(addr, COMPLETIONS_PATH, body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[test]
fn stop_strings_beyond_the_caps_are_refused_and_the_largest_allowed_harm_no_one() {
    let server = start(|_| {});
    let addr = server.addr();
    let max = strix_server::request::MAX_STOP_STRINGS;
    let longest = strix_server::request::MAX_STOP_BYTES;
    // The report's 16 stops of 200 KB, too many stops, one too long.
    for stop in [stops(16, 200_000), stops(max + 1, 4), stops(1, longest + 1)] {
        let e = post(addr, COMPLETIONS_PATH, &json!({"prompt": "x", "stop": stop})).error(400);
        assert_eq!(e["param"], "stop");
    }
    // The most the caps allow, streaming long beside a normal request: both complete, and
    // neither answer changes (the stops never match).
    let normal =
        json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let alone = completion_text(addr, &normal);
    let mut stopped =
        json!({"prompt": "One two three", "max_tokens": 200, "temperature": 0, "ignore_eos": true});
    let plain = completion_text(addr, &stopped);
    stopped["stop"] = json!(stops(max, longest));
    let (beside, with_stops) = std::thread::scope(|scope| {
        let long = scope.spawn(|| completion_text(addr, &stopped));
        let short = scope.spawn(|| completion_text(addr, &normal));
        (short.join().unwrap(), long.join().unwrap())
    });
    assert_eq!(beside, alone);
    assert_eq!(with_stops, plain);
}

#[test]
fn unimplemented_fields_are_refused_not_ignored() {
    let server = start(|_| {});
    let addr = server.addr();
    let user = json!([{"role": "user", "content": "hi"}]);
    for (field, value) in [
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
        ),
        // vLLM's older spelling; `structured_outputs` is the one read.
        ("guided_regex", json!("a+")),
        ("structured_outputs", json!({"regex": "a", "grammar": "b"})),
        // A forced tool call without tools.
        ("tool_choice", json!("required")),
    ] {
        let mut body = json!({"messages": user, "max_tokens": 2});
        body[field] = value;
        let e = post(addr, CHAT_PATH, &body).error(400);
        assert_eq!(e["param"], field, "{body}");
    }
    let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]);
    let e = post(addr, CHAT_PATH, &json!({"messages": image})).error(400);
    assert_eq!(e["param"], "messages[0].content[0].type");
    let e = post(addr, COMPLETIONS_PATH, &json!({"prompt": "x", "max_tokens": 1_000_000_000})).error(400);
    assert_eq!(
        (e["code"].as_str(), e["param"].as_str()),
        (Some("context_length_exceeded"), Some("max_tokens"))
    );
}
