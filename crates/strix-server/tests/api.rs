//! The HTTP API end to end, on a server started in-process on the tiny fixture model:
//! response shapes, streaming, sampling parameters, stop strings, seeds, logprobs, the
//! reasoning split, tools reaching the template, auth, every kind of bad request, the queue
//! bound, context limits and cancellation.

mod common;

use common::*;
use serde_json::{json, Value};
use strix::backend::cpu::CpuBackend;
use strix::chat::{ChatMessage, ChatOptions};
use strix::generate::{generate, GenerateParams, Generated};
use strix_server::output::{Delta, OutputParser};
use strix_server::ServedModel;

#[test]
fn models_health_and_metrics_answer() {
    let server = start(|_| {});
    let models = get(server.addr(), "/v1/models");
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "tiny");
    assert_eq!(models.json()["object"], "list");
    assert_eq!(get(server.addr(), "/health").json()["status"], "ok");
    let metrics = get(server.addr(), "/metrics");
    assert!(metrics.header("content-type").is_some_and(|t| t.starts_with("text/plain")));
    for family in [
        "strix_requests_total",
        "strix_prompt_tokens_total",
        "strix_generation_tokens_total",
        "strix_queue_depth",
        "strix_running_sequences",
        "strix_time_to_first_token_seconds_bucket",
        "strix_inter_token_latency_seconds_bucket",
    ] {
        assert!(metrics.text().contains(family), "{family} missing");
    }
    assert!(get(server.addr(), "/").text().contains("<html"));
}

#[test]
fn chat_completion_has_the_openai_shape() {
    let server = start(|_| {});
    let r = post(
        server.addr(),
        CHAT_PATH,
        &json!({"model": "tiny", "messages": user("Hello"), "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let usage = &body["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion));
    assert_eq!(usage["total_tokens"], usage["prompt_tokens"].as_u64().unwrap() + completion);
}

#[test]
fn streamed_chat_equals_the_whole_answer() {
    let server = start(|_| {});
    for thinking in [true, false] {
        let request = json!({
            "messages": user("Tell me a story"), "max_tokens": 24, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": thinking},
        });
        let whole = post(server.addr(), CHAT_PATH, &request).json();
        let mut streamed = request.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let chunks = stream(server.addr(), CHAT_PATH, &streamed);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
        let message = &whole["choices"][0]["message"];
        assert_eq!(joined(&chunks, "content"), message["content"].as_str().unwrap_or(""));
        assert_eq!(joined(&chunks, "reasoning_content"), message["reasoning_content"].as_str().unwrap_or(""));
        assert_eq!(finish_of(&chunks), whole["choices"][0]["finish_reason"]);
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"], whole["usage"]);
    }
}

#[test]
fn completions_whole_and_streamed_agree() {
    let server = start(|_| {});
    let request = json!({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0});
    let whole = post(server.addr(), COMPLETIONS_PATH, &request);
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    assert_eq!(whole["object"], "text_completion");
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(server.addr(), COMPLETIONS_PATH, &streamed);
    assert_eq!(joined_text(&chunks), whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(finish_of(&chunks), whole["choices"][0]["finish_reason"]);
    // Token ids work as a prompt too, and give what their text gives.
    let served = served();
    let ids = served.tokenizer.encode("The capital of France is", false).unwrap();
    let by_ids =
        post(server.addr(), COMPLETIONS_PATH, &json!({"prompt": ids, "max_tokens": 16, "temperature": 0}));
    assert_eq!(by_ids.json()["choices"][0]["text"], whole["choices"][0]["text"]);
}

/// What the library's `generate` makes of `prompt` on the served model, in a fresh session.
fn library_generate(served: &ServedModel<CpuBackend>, prompt: &[u32], params: &GenerateParams) -> Generated {
    let mut session = served.model.new_session(1024);
    generate(&served.model, &mut session, prompt, Some(&served.tokenizer), params, |_| {}).unwrap()
}

#[test]
fn greedy_output_matches_the_library() {
    let server = start(|_| {});
    let served = served();
    let prompt = served.tokenizer.encode("Once upon a time", false).unwrap();
    let params = GenerateParams { max_tokens: 20, ..Default::default() };
    let expected = library_generate(&served, &prompt, &params);
    let r = post(
        server.addr(),
        COMPLETIONS_PATH,
        &json!({"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}),
    )
    .json();
    assert_eq!(r["choices"][0]["text"].as_str().unwrap(), expected.text);
    assert_eq!(r["usage"]["completion_tokens"].as_u64().unwrap() as usize, expected.ids.len());
}

/// `logit_bias` changes what the server generates exactly as it changes the library's
/// `generate`: greedy with a banned token, greedy with a forced one, and a seeded draw.
#[test]
fn logit_bias_steers_the_output_like_the_library() {
    let server = start(|_| {});
    let served = served();
    let prompt = served.tokenizer.encode("Once upon a time", false).unwrap();
    let library = |sampling: strix::sampling::SamplingParams| {
        let params = GenerateParams { max_tokens: 12, sampling, ignore_eos: true, ..Default::default() };
        library_generate(&served, &prompt, &params)
    };
    let greedy = strix::sampling::SamplingParams::greedy();
    let plain = library(greedy.clone());
    let first = plain.ids[0];
    let forced = (first + 1) % served.model.config.vocab_size as u32;
    let sampled = strix::sampling::SamplingParams { temperature: 1.0, seed: Some(9), ..greedy.clone() };
    let cases = [
        (greedy.clone(), vec![(first, -100.0f32)]),
        (greedy.clone(), vec![(forced, 100.0), (first, 3.0)]),
        (sampled.clone(), vec![(first, -100.0), (forced, 2.0)]),
    ];
    for (sampling, bias) in cases {
        let expected =
            library(strix::sampling::SamplingParams { logit_bias: bias.clone(), ..sampling.clone() });
        if sampling.temperature == 0.0 {
            assert_ne!(expected.ids, plain.ids, "{bias:?} changed nothing");
        }
        if bias[0].1 == 100.0 {
            assert!(expected.ids.iter().all(|&t| t == forced), "{:?}", expected.ids);
        }
        let map: serde_json::Map<String, Value> =
            bias.iter().map(|&(id, b)| (id.to_string(), Value::from(b))).collect();
        let r = post(
            server.addr(),
            COMPLETIONS_PATH,
            &json!({"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": true,
                    "temperature": sampling.temperature, "seed": sampling.seed, "logit_bias": map}),
        )
        .json();
        assert_eq!(r["choices"][0]["text"].as_str().unwrap(), expected.text, "{bias:?}");
        assert_eq!(r["usage"]["completion_tokens"], 12);
    }
    // An id past the vocabulary names the field.
    let vocab = served.model.config.vocab_size;
    let mut body = json!({"prompt": "x", "max_tokens": 2, "logit_bias": {}});
    body["logit_bias"][vocab.to_string()] = json!(1);
    let e = post(server.addr(), COMPLETIONS_PATH, &body).error(400);
    assert_eq!(e["param"], "logit_bias");
    assert!(e["message"].as_str().unwrap().contains("outside the vocabulary"), "{e}");
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let server = start(|_| {});
    let base = json!({"prompt": "One two three", "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let full = post(server.addr(), COMPLETIONS_PATH, &base).json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..10].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];

    let mut request = base.clone();
    request["stop"] = json!(["never appears ✓", stop]);
    let r = post(server.addr(), COMPLETIONS_PATH, &request).json();
    assert_eq!(r["choices"][0]["text"].as_str().unwrap(), expected);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    request["stream"] = json!(true);
    let chunks = stream(server.addr(), COMPLETIONS_PATH, &request);
    assert_eq!(joined_text(&chunks), expected);
    assert_eq!(finish_of(&chunks), "stop");
}

#[test]
fn seeds_reproduce_samples() {
    let server = start(|_| {});
    let sample = |seed: u64| {
        let r = post(
            server.addr(),
            COMPLETIONS_PATH,
            &json!({"prompt": "Hello", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": seed}),
        );
        r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    assert_eq!(sample(7), sample(7));
    let others: Vec<String> = (100..104).map(sample).collect();
    assert!(others.iter().any(|o| *o != sample(7)), "four other seeds all gave the same text");
}

#[test]
fn logprobs_describe_the_chosen_tokens() {
    let server = start(|_| {});
    let r = post(
        server.addr(),
        CHAT_PATH,
        &json!({"messages": user("Hi"), "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 3,
                "ignore_eos": true}),
    )
    .json();
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 8);
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(entry["logprob"], top[0]["logprob"]);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{lps:?}");
        assert!(entry["bytes"].is_array());
    }
    // Without logprobs the field is null.
    let r = post(server.addr(), CHAT_PATH, &json!({"messages": user("Hi"), "max_tokens": 2})).json();
    assert!(r["choices"][0]["logprobs"].is_null());

    let c = post(
        server.addr(),
        COMPLETIONS_PATH,
        &json!({"prompt": "Hi", "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": true}),
    )
    .json();
    let lp = &c["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 5);
    // Two alternatives, fewer when two tokens share a spelling (the legacy form is a map).
    assert!((1..=2).contains(&lp["top_logprobs"][0].as_object().unwrap().len()));

    let streamed = json!({"messages": user("Hi"), "max_tokens": 8, "temperature": 0, "logprobs": true,
                          "top_logprobs": 3, "ignore_eos": true, "stream": true});
    let chunks = stream(server.addr(), CHAT_PATH, &streamed);
    let streamed_lps: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed_lps, content);
}

#[test]
fn reasoning_and_content_split_like_the_parser_on_the_raw_text() {
    let server = start(|_| {});
    let served = served();
    let template = served.template.as_ref().unwrap();
    for thinking in [None, Some(false), Some(true)] {
        let options =
            ChatOptions { add_generation_prompt: true, enable_thinking: thinking, ..Default::default() };
        let prompt = template.render(&[ChatMessage::user("Why is the sky blue?")], &options).unwrap();
        let raw = post(
            server.addr(),
            COMPLETIONS_PATH,
            &json!({"prompt": prompt, "max_tokens": 30, "temperature": 0}),
        )
        .json()["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned();
        let mut parser = OutputParser::new(OutputParser::prompt_opens_reasoning(&prompt), None);
        let mut deltas = parser.push(&raw);
        deltas.extend(parser.finish());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for d in deltas {
            match d {
                Delta::Reasoning(t) => reasoning.push_str(&t),
                Delta::Content(t) => content.push_str(&t),
                Delta::ToolCall(_) => unreachable!("no tools"),
            }
        }
        let mut request =
            json!({"messages": user("Why is the sky blue?"), "max_tokens": 30, "temperature": 0});
        if let Some(t) = thinking {
            request["chat_template_kwargs"] = json!({"enable_thinking": t});
        }
        let message = post(server.addr(), CHAT_PATH, &request).json()["choices"][0]["message"].clone();
        assert_eq!(message["content"].as_str().unwrap_or(""), content, "thinking {thinking:?}");
        assert_eq!(message["reasoning_content"].as_str().unwrap_or(""), reasoning, "thinking {thinking:?}");
        // The template opens a think block unless thinking is off.
        assert_eq!(thinking != Some(false), OutputParser::prompt_opens_reasoning(&prompt));
    }
}

#[test]
fn tools_reach_the_template() {
    let server = start(|_| {});
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let prompt_tokens = |extra: Value| {
        let mut request = json!({"messages": user("Weather in Paris?"), "max_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            request[k] = v.clone();
        }
        let r = post(server.addr(), CHAT_PATH, &request);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let plain = prompt_tokens(json!({}));
    assert!(prompt_tokens(json!({"tools": tools})) > plain + 50);
    assert_eq!(prompt_tokens(json!({"tools": tools, "tool_choice": "none"})), plain);
    // Multi-turn with an assistant tool call and a tool result renders too.
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]);
    let r = post(server.addr(), CHAT_PATH, &json!({"messages": history, "tools": tools, "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn api_key_guards_the_v1_routes() {
    let server = start(|c| c.api_key = Some("sekrit".into()));
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    for headers in [vec![], vec![("Authorization", "Bearer wrong")], vec![("Authorization", "sekrit")]] {
        let r = request(server.addr(), "POST", COMPLETIONS_PATH, &headers, body.as_bytes());
        assert_eq!(r.error(401)["code"], "invalid_api_key");
        assert_eq!(request(server.addr(), "GET", "/v1/models", &headers, b"").status, 401);
    }
    let ok = request(
        server.addr(),
        "POST",
        COMPLETIONS_PATH,
        &[("Authorization", "Bearer sekrit")],
        body.as_bytes(),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(get(server.addr(), "/health").status, 200);
    assert_eq!(get(server.addr(), "/metrics").status, 200);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_lives_on() {
    let server = start(|c| c.max_body = 4096);
    let addr = server.addr();
    let raw = |path: &str, body: &[u8]| request(addr, "POST", path, &[], body);

    raw(CHAT_PATH, b"{not json").error(400);
    raw(CHAT_PATH, b"").error(400);
    raw(CHAT_PATH, b"[1, 2]").error(400);
    raw(CHAT_PATH, b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}").error(400);
    assert_eq!(raw(CHAT_PATH, b"{\"messages\": []}").error(400)["param"], "messages");
    assert_eq!(raw(CHAT_PATH, b"{\"messages\": \"hi\"}").error(400)["param"], "messages");
    assert_eq!(
        post(addr, CHAT_PATH, &json!({"messages": user("x"), "temperature": "hot"})).error(400)["param"],
        "temperature"
    );
    assert_eq!(post(addr, CHAT_PATH, &json!({"messages": user("x"), "n": 3})).error(400)["param"], "n");
    assert_eq!(
        post(addr, CHAT_PATH, &json!({"messages": user("x"), "max_tokens": -1})).error(400)["param"],
        "max_tokens"
    );
    assert_eq!(
        post(addr, CHAT_PATH, &json!({"messages": [{"role": "user", "content": {"a": 1}}]})).error(400)
            ["param"],
        "messages[0].content"
    );
    // A conversation the template refuses (no user message) is the client's error.
    assert_eq!(
        post(addr, CHAT_PATH, &json!({"messages": [{"role": "system", "content": "x"}]})).error(400)["param"],
        "messages"
    );
    assert_eq!(post(addr, COMPLETIONS_PATH, &json!({"prompt": ""})).error(400)["param"], "prompt");
    assert_eq!(post(addr, COMPLETIONS_PATH, &json!({"prompt": [999999]})).error(400)["param"], "prompt");
    assert_eq!(post(addr, COMPLETIONS_PATH, &json!({"prompt": ["a", "b"]})).error(400)["param"], "prompt");

    let huge = vec![b' '; 100_000];
    assert_eq!(raw(CHAT_PATH, &huge).error(413)["code"], "request_too_large");
    // Chunked bodies (no Content-Length) are limited too.
    let mut big = json!({"messages": user(&"x".repeat(5000))}).to_string().into_bytes();
    let mut chunked = format!("{:x}\r\n", big.len()).into_bytes();
    chunked.append(&mut big);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    request(addr, "POST", CHAT_PATH, &[("Transfer-Encoding", "chunked")], &chunked).error(413);

    assert_eq!(get(addr, "/v1/nothing").error(404)["type"], "not_found_error");
    get(addr, "/etc/passwd").error(404);
    request(addr, "DELETE", "/v1/models", &[], b"").error(405);
    request(addr, "GET", CHAT_PATH, &[], b"").error(405);

    // Still serving.
    let ok = post(addr, CHAT_PATH, &json!({"messages": user("still there?"), "max_tokens": 2}));
    assert_eq!(ok.status, 200, "{}", ok.text());
    let metrics = get(addr, "/metrics").text();
    assert!(
        metrics.contains("strix_requests_total{route=\"/v1/chat/completions\",status=\"400\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("strix_requests_total{route=\"other\",status=\"404\"}"), "{metrics}");
}

#[test]
fn prompts_longer_than_the_context_are_400() {
    let server = start(|c| c.engine.context = 64);
    let long = "word ".repeat(200);
    let e = post(server.addr(), COMPLETIONS_PATH, &json!({"prompt": long, "max_tokens": 4})).error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["param"], "prompt");
    let e = post(server.addr(), CHAT_PATH, &json!({"messages": user(&long)})).error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    // A completion that cannot fit is refused (as OpenAI and vLLM do), naming the field.
    for (body, param) in [
        (json!({"prompt": "hi", "max_tokens": 1_000_000_000}), "max_tokens"),
        (json!({"prompt": "hi", "max_tokens": 64}), "max_tokens"),
        (json!({"prompt": [1, 2, 3], "max_tokens": 62}), "max_tokens"),
        (json!({"prompt": "hi", "max_completion_tokens": 1000}), "max_completion_tokens"),
    ] {
        let e = post(server.addr(), COMPLETIONS_PATH, &body).error(400);
        assert_eq!(
            (e["code"].as_str(), e["param"].as_str()),
            (Some("context_length_exceeded"), Some(param)),
            "{body}"
        );
    }
    let e = post(server.addr(), CHAT_PATH, &json!({"messages": user("hi"), "max_tokens": 60})).error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    // A prompt that fits beside its max_tokens but not beside the rest of the context...
    let e = post(server.addr(), COMPLETIONS_PATH, &json!({"prompt": "word ".repeat(30), "max_tokens": 40}))
        .error(400);
    assert_eq!((e["code"].as_str(), e["param"].as_str()), (Some("context_length_exceeded"), Some("prompt")));
    // ... and exactly the context is fine; no max_tokens runs to the end of the context.
    let r = post(
        server.addr(),
        COMPLETIONS_PATH,
        &json!({"prompt": [1, 2, 3, 4], "max_tokens": 60, "ignore_eos": true, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["total_tokens"], 64);
    let r =
        post(server.addr(), COMPLETIONS_PATH, &json!({"prompt": "hi", "ignore_eos": true, "temperature": 0}))
            .json();
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["total_tokens"], 64);
}

#[test]
fn what_the_server_does_not_do_is_refused_by_name() {
    let server = start(|_| {});
    let addr = server.addr();
    let cases = [
        (json!({"messages": user("x"), "response_format": {"type": "xml"}}), "response_format"),
        (json!({"messages": user("x"), "logit_bias": {"1": 10, "4000000000": 10}}), "logit_bias"),
        (json!({"messages": user("x"), "logit_bias": {"1": 101}}), "logit_bias"),
        (json!({"messages": user("x"), "functions": [{"name": "f"}]}), "functions"),
        (json!({"messages": user("x"), "some_new_option": true}), "some_new_option"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                   {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]}),
            "messages[0].content[1].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
            "messages[0].content[0].text",
        ),
    ];
    for (body, param) in cases {
        let e = post(addr, CHAT_PATH, &body).error(400);
        assert_eq!(e["param"], param, "{body}");
        assert_eq!(e["type"], "invalid_request_error");
    }
    let e = post(addr, COMPLETIONS_PATH, &json!({"prompt": "x", "best_of": 1, "mirostat": 2})).error(400);
    assert!(
        e["message"].as_str().unwrap().starts_with("Unrecognized request argument supplied: mirostat"),
        "{e}"
    );
    // What asks for nothing more than the server does is accepted.
    let ok = post(
        addr,
        CHAT_PATH,
        &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2,
                "response_format": {"type": "text"}, "logit_bias": {}, "user": "u", "store": false,
                "metadata": {"a": "b"}, "service_tier": "auto", "parallel_tool_calls": true,
                "stream_options": null, "seed": null}),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
}

/// A request that runs until cancelled: a long context and no end-of-sequence.
fn endless(stream: bool) -> Value {
    json!({"prompt": "Count forever:", "max_tokens": 1_000_000, "ignore_eos": true, "temperature": 0, "stream": stream})
}

#[test]
fn a_full_queue_answers_429() {
    let server = start(|c| {
        c.engine.max_seqs = 1;
        c.engine.max_queue = 1;
        c.engine.context = 1 << 20;
    });
    let addr = server.addr();
    let mut running = open_stream(addr, COMPLETIONS_PATH, &[], &endless(true)).ok().unwrap();
    running.next_data().unwrap();
    wait_until("the first request runs", || metric(addr, "strix_running_sequences") == 1.0);
    let queued = open_stream(addr, COMPLETIONS_PATH, &[], &endless(true)).ok().unwrap();
    wait_until("the second request waits", || metric(addr, "strix_queue_depth") == 1.0);

    let refused = post(addr, COMPLETIONS_PATH, &json!({"prompt": "x", "max_tokens": 1}));
    let error = refused.error(429);
    assert_eq!(error["type"], "rate_limit_error");

    // Cancelling the running one lets the queued one in; cancelling that empties the batch.
    drop(running);
    wait_until("the queued request runs", || {
        metric(addr, "strix_queue_depth") == 0.0 && metric(addr, "strix_running_sequences") == 1.0
    });
    drop(queued);
    wait_until("the batch empties", || metric(addr, "strix_running_sequences") == 0.0);
    assert_eq!(metric(addr, "strix_requests_cancelled_total"), 2.0);
    assert_eq!(metric(addr, "strix_reserved_state_bytes"), 0.0);
    let ok = post(addr, COMPLETIONS_PATH, &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(ok.status, 200);
}

#[test]
fn disconnecting_cancels_the_request() {
    let server = start(|c| c.engine.context = 1 << 20);
    let addr = server.addr();
    let mut streams: Vec<EventStream> =
        (0..3).map(|_| open_stream(addr, COMPLETIONS_PATH, &[], &endless(true)).ok().unwrap()).collect();
    for s in &mut streams {
        s.next_data().unwrap();
    }
    wait_until("three sequences run", || metric(addr, "strix_running_sequences") == 3.0);
    streams.pop();
    wait_until("the batch shrinks to two", || metric(addr, "strix_running_sequences") == 2.0);
    streams.clear();
    wait_until("the batch empties", || metric(addr, "strix_running_sequences") == 0.0);
    assert_eq!(metric(addr, "strix_requests_cancelled_total"), 3.0);

    // A non-streaming client that goes away cancels too.
    let handle = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let body = endless(false).to_string();
        use std::io::Write;
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        wait_until("it runs", || metric(addr, "strix_running_sequences") == 1.0);
    });
    handle.join().unwrap();
    wait_until("the batch empties again", || metric(addr, "strix_running_sequences") == 0.0);
    assert_eq!(metric(addr, "strix_requests_cancelled_total"), 4.0);
}
