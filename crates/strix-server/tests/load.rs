//! Continuous batching under load, on the tiny fixture model: batch invariance (a greedy
//! request gives the same tokens, bit for bit the same log-probabilities, alone and beside
//! 63 others) and a load test of 64 concurrent clients with mixed prompt lengths (some past
//! one 512-token prefill chunk) and random cancellations, in which every completed response
//! must equal the library's own greedy generation and no request may be lost. Throughput is
//! printed, never asserted.

mod common;

use std::time::Instant;

use common::*;
use serde_json::{json, Value};
use strix::generate::{generate, FinishReason, GenerateParams};

const CLIENTS: usize = 64;

#[test]
fn a_greedy_request_is_the_same_alone_and_in_a_full_batch() {
    let server = start(|_| {});
    let addr = server.addr();
    let target = json!({"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "logprobs": 5,
                        "ignore_eos": true});
    let alone = post(addr, COMPLETIONS_PATH, &target).json();

    let others: Vec<_> = (0..CLIENTS - 1)
        .map(|i| {
            std::thread::spawn(move || {
                // Sampled, with penalties and different lengths: nothing like the target.
                let body = json!({"prompt": format!("Other request {i} {}", "word ".repeat((i % 16) * 10)),
                    "max_tokens": 16 + i % 16, "temperature": 1.0, "seed": i, "presence_penalty": 0.5,
                    "ignore_eos": true, "stream": i % 2 == 0});
                if i % 2 == 0 {
                    stream(addr, COMPLETIONS_PATH, &body).len()
                } else {
                    post(addr, COMPLETIONS_PATH, &body).body.len()
                }
            })
        })
        .collect();
    // Start the target once the batch is busy.
    wait_until("the batch fills", || metric(addr, "strix_running_sequences") >= 8.0);
    let beside = post(addr, COMPLETIONS_PATH, &target).json();
    for other in others {
        assert!(other.join().unwrap() > 0);
    }
    assert_eq!(beside["choices"][0]["text"], alone["choices"][0]["text"]);
    // Log-probabilities are floats computed from the logits: equal only if the logits are.
    assert_eq!(beside["choices"][0]["logprobs"], alone["choices"][0]["logprobs"]);
}

struct Case {
    body: Value,
    /// Drop the connection after this many chunks.
    cancel_after: Option<usize>,
    expected_text: String,
    expected_tokens: usize,
    expected_finish: &'static str,
}

/// A small deterministic generator, so the mix is the same on every run.
fn mix(i: usize, salt: u64) -> u64 {
    let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

#[test]
fn sixty_four_clients_with_cancellations_lose_nothing() {
    let served = served();
    let server = start(|_| {});
    let addr = server.addr();

    // The cases and what the library alone generates for each.
    let cases: Vec<Case> = (0..CLIENTS)
        .map(|i| {
            // The fixture's tokenizer has few merges: about one token per character.
            let chars = match mix(i, 1) % 8 {
                0 => 520 + (mix(i, 2) % 380) as usize, // past one 512-token prefill chunk
                1 | 2 => 40 + (mix(i, 3) % 160) as usize,
                _ => (mix(i, 4) % 20) as usize,
            };
            let filler: String = "lorem ipsum dolor sit amet ".chars().cycle().take(chars).collect();
            let prompt = format!("Client {i} says: {filler}");
            let max_tokens = 4 + (mix(i, 5) % 12) as usize;
            let ids = served.tokenizer.encode(&prompt, false).unwrap();
            let mut session = served.model.new_session(1024);
            let params = GenerateParams { max_tokens, ..Default::default() };
            let out = generate(&served.model, &mut session, &ids, Some(&served.tokenizer), &params, |_| {})
                .unwrap();
            let stream = mix(i, 6).is_multiple_of(2);
            Case {
                body: json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}),
                cancel_after: (stream && mix(i, 7).is_multiple_of(4)).then_some((mix(i, 8) % 3) as usize),
                expected_text: out.text,
                expected_tokens: out.ids.len(),
                expected_finish: match out.finish {
                    FinishReason::Eos | FinishReason::Stop => "stop",
                    FinishReason::Length | FinishReason::Context => "length",
                },
            }
        })
        .collect();
    let long_prompts = cases.iter().filter(|c| c.body["prompt"].as_str().unwrap().len() > 530).count();
    let cancels = cases.iter().filter(|c| c.cancel_after.is_some()).count();
    let rss_before = rss_kib();

    let start_time = Instant::now();
    let clients: Vec<_> = cases
        .into_iter()
        .map(|case| {
            std::thread::spawn(move || -> (bool, usize) {
                if let Some(after) = case.cancel_after {
                    let mut events = open_stream(addr, COMPLETIONS_PATH, &[], &case.body).ok().unwrap();
                    for _ in 0..after {
                        events.next_data();
                    }
                    return (false, 0);
                }
                let (text, tokens, finish) = if case.body["stream"] == true {
                    let mut body = case.body.clone();
                    body["stream_options"] = json!({"include_usage": true});
                    let chunks = stream(addr, COMPLETIONS_PATH, &body);
                    let usage = &chunks.last().unwrap()["usage"];
                    (joined_text(&chunks), usage["completion_tokens"].as_u64().unwrap(), finish_of(&chunks))
                } else {
                    let r = post(addr, COMPLETIONS_PATH, &case.body);
                    assert_eq!(r.status, 200, "{}", r.text());
                    let r = r.json();
                    let choice = &r["choices"][0];
                    (
                        choice["text"].as_str().unwrap().to_owned(),
                        r["usage"]["completion_tokens"].as_u64().unwrap(),
                        choice["finish_reason"].as_str().unwrap().to_owned(),
                    )
                };
                assert_eq!(text, case.expected_text, "request {}", case.body);
                assert_eq!(tokens as usize, case.expected_tokens);
                assert_eq!(finish, case.expected_finish);
                (true, tokens as usize)
            })
        })
        .collect();
    let results: Vec<(bool, usize)> =
        clients.into_iter().map(|c| c.join().expect("a client failed")).collect();
    let seconds = start_time.elapsed().as_secs_f64();

    wait_until("the server is idle", || {
        metric(addr, "strix_running_sequences") == 0.0 && metric(addr, "strix_queue_depth") == 0.0
    });
    // Every request is accounted for: it finished, or it was cancelled (a cancelled one may
    // also have finished before its client went away).
    let finished = metric(addr, "strix_requests_finished_total");
    let cancelled = metric(addr, "strix_requests_cancelled_total");
    assert_eq!(finished + cancelled, CLIENTS as f64);
    assert!(finished >= (CLIENTS - cancels) as f64);
    assert_eq!(metric(addr, "strix_reserved_state_bytes"), 0.0);
    let completed = results.iter().filter(|r| r.0).count();
    assert_eq!(completed, CLIENTS - cancels);

    let tokens = metric(addr, "strix_generation_tokens_total");
    let prompt_tokens = metric(addr, "strix_prompt_tokens_total");
    println!(
        "load: {CLIENTS} clients ({long_prompts} prompts past 512 tokens, {cancels} cancelled) in {seconds:.2} s: \
         {:.1} requests/s, {:.0} generated tokens/s, {:.0} prompt tokens/s; RSS {:?} KiB before, {:?} KiB after",
        completed as f64 / seconds,
        tokens / seconds,
        prompt_tokens / seconds,
        rss_before,
        rss_kib(),
    );
}
