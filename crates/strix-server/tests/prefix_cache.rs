//! The prefix cache end to end: requests served from the cache return bit for bit the tokens
//! and log-probabilities of a server without it — single prompts, prompts that diverge inside
//! a block, multi-turn chats that resend their history, concurrent requests sharing a system
//! prompt, and a budget so small that blocks are evicted — and report what they reused in
//! `usage.prompt_tokens_details.cached_tokens` and the Prometheus metrics.
//!
//! The fixture's context is small, so the servers run passes (and cache blocks) of 64 tokens,
//! the shortest pass there is: a 200-token prompt crosses three block boundaries.

mod common;

use common::{metric, post, stream, CHAT_PATH, COMPLETIONS_PATH};
use serde_json::{json, Value};
use strix_server::engine::StateSizes;
use strix_server::Server;

const PASS: usize = 64;

/// A server on the fixture with passes of [`PASS`] tokens and a prefix cache of
/// `cache_bytes` (0: none).
fn server(cache_bytes: u64) -> Server {
    let mut served = common::served();
    served.model.set_pass_tokens(PASS).unwrap();
    let mut config = strix_server::ServerConfig::new("tiny", 1024);
    config.port = 0;
    config.engine.prefill_chunk = PASS;
    config.engine.prefix_cache_bytes = cache_bytes;
    Server::start(served, config).expect("start the server")
}

fn ids(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed * 101 + 11) % 380).collect()
}

/// A greedy completion of `prompt` with the log-probabilities of each token and its 5 best
/// alternatives.
fn complete(server: &Server, prompt: &[u32]) -> Value {
    let body =
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 5, "ignore_eos": true});
    let r = post(server.addr(), COMPLETIONS_PATH, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn cached_tokens(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.prompt_tokens_details.cached_tokens in {response}"))
}

/// The same tokens and log-probabilities, compared as the JSON the server wrote: an f32 that
/// differs in its last bit prints differently.
#[track_caller]
fn assert_same_choices(with_cache: &Value, without: &Value) {
    assert_eq!(with_cache["choices"], without["choices"], "the cache changed the answer");
    assert_eq!(with_cache["usage"]["prompt_tokens"], without["usage"]["prompt_tokens"]);
}

#[test]
fn single_prompts_from_the_cache_match_the_cache_off() {
    let (on, off) = (server(256 << 20), server(0));
    let p = ids(200, 1);
    let mut diverging = p[..150].to_vec();
    diverging.extend(ids(50, 2));
    // (prompt, prompt tokens the cache holds when it is sent)
    let cases: [(&[u32], u64); 7] = [
        (&p, 0),
        // Blocks end at 64, 128 and 192; the last piece is always fed.
        (&p, 192),
        (&diverging, 128),
        (&p[..130], 128),
        (&p[..128], 64),
        (&p[..64], 0),
        (&p[..65], 64),
    ];
    let mut queried = 0;
    for (prompt, cached) in cases {
        let (a, b) = (complete(&on, prompt), complete(&off, prompt));
        assert_same_choices(&a, &b);
        assert_eq!(cached_tokens(&a), cached, "prompt of {} tokens", prompt.len());
        assert_eq!(cached_tokens(&b), 0);
        queried += prompt.len();
    }
    assert_eq!(metric(on.addr(), "strix_prefix_cache_queries_tokens_total"), queried as f64);
    assert_eq!(metric(on.addr(), "strix_prefix_cache_hit_tokens_total"), (192 + 128 + 128 + 64 + 64) as f64);
    // Blocks ending at 64, 128 and 192 of `p`, and the diverging prompt's own at 192.
    let block = StateSizes::of(&common::served().model);
    let block_bytes = block.for_tokens(PASS) as f64;
    assert_eq!(metric(on.addr(), "strix_prefix_cache_bytes"), 4.0 * block_bytes);
    assert_eq!(metric(off.addr(), "strix_prefix_cache_bytes"), 0.0);
    assert_eq!(metric(off.addr(), "strix_prefix_cache_queries_tokens_total"), 0.0);
}

/// The streamed answer's final usage chunk reports the cached tokens too.
#[test]
fn the_streamed_usage_reports_the_cached_tokens() {
    let on = server(256 << 20);
    let p = ids(150, 3);
    complete(&on, &p);
    let body = json!({"prompt": p, "max_tokens": 4, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = stream(on.addr(), COMPLETIONS_PATH, &body);
    let usage = chunks.iter().find(|c| c["usage"].is_object()).expect("a usage chunk");
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 128, "{usage}");
}

/// A chat whose every turn resends the history: each turn resumes where the last one's
/// prompt crossed its last block boundary, and answers as the server without a cache does.
#[test]
fn multi_turn_chats_match_the_cache_off() {
    let (on, off) = (server(256 << 20), server(0));
    let words = |seed: usize, n: usize| -> String {
        let vocab =
            ["river", "stone", "light", "window", "garden", "paper", "silver", "morning", "cloud", "engine"];
        (0..n).map(|i| vocab[(i * 7 + seed * 3) % vocab.len()]).collect::<Vec<_>>().join(" ")
    };
    let mut messages = vec![json!({"role": "system", "content": words(0, 24)})];
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": words(turn + 1, 12)}));
        let body = json!({"messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": true,
            "top_logprobs": 4, "ignore_eos": true,
            "chat_template_kwargs": {"enable_thinking": false}});
        let a = post(on.addr(), CHAT_PATH, &body).json();
        let b = post(off.addr(), CHAT_PATH, &body).json();
        assert_same_choices(&a, &b);
        let prompt = a["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = cached_tokens(&a);
        if turn > 0 {
            assert!(cached > 0, "turn {turn} of {prompt} tokens found nothing cached");
        }
        assert!(cached < prompt && cached.is_multiple_of(PASS as u64), "turn {turn}: {cached} of {prompt}");
        let answer = a["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
        messages.push(json!({"role": "assistant", "content": answer}));
    }
}

/// Requests that share a system prompt, sent at once: the first to prefill caches the shared
/// blocks and every other resumes from them, each answering as it does alone without a cache.
#[test]
fn concurrent_requests_sharing_a_system_prompt_match_the_cache_off() {
    let (on, off) = (server(256 << 20), server(0));
    let system = ids(150, 4);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = system.clone();
            p.extend(ids(20 + 5 * i, 10 + i as u32));
            p
        })
        .collect();
    let answers: Vec<Value> = std::thread::scope(|scope| {
        let on = &on;
        let handles: Vec<_> = prompts.iter().map(|p| scope.spawn(move || complete(on, p))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut cached: Vec<u64> = answers.iter().map(cached_tokens).collect();
    for (answer, p) in answers.iter().zip(&prompts) {
        assert_same_choices(answer, &complete(&off, p));
    }
    cached.sort_unstable();
    assert_eq!(cached, [0, 128, 128, 128], "the shared blocks end at 64 and 128");
    assert_eq!(metric(on.addr(), "strix_prefix_cache_hit_tokens_total"), 384.0);
}

/// A budget of two blocks: older blocks are evicted as new ones come, the bytes never exceed
/// it, and what is served from what remains is still exact.
#[test]
fn a_small_budget_evicts_and_stays_exact() {
    let block = StateSizes::of(&common::served().model).for_tokens(PASS);
    let (on, off) = (server(2 * block), server(0));
    let (a, b) = (ids(200, 5), ids(200, 6));
    for (prompt, cached) in [(&a, 0), (&b, 0), (&b, 128), (&a, 0)] {
        let (x, y) = (complete(&on, prompt), complete(&off, prompt));
        assert_same_choices(&x, &y);
        assert_eq!(cached_tokens(&x), cached);
        assert!(metric(on.addr(), "strix_prefix_cache_bytes") <= (2 * block) as f64);
    }
}
