//! `strix bench-serve` end to end: against a real strix server (in-process, on the tiny fixture
//! model) every request is accounted for and the figures agree with each other; against a dead
//! URL and against servers that misbehave (an error status, a body that is not an event stream,
//! an error mid-stream, a stream cut short, a stream that stalls) it ends in bounded time with
//! the reason, never a panic or a hang.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{fixtures, stderr, strix_bin};
use serde_json::Value;
use strix::backend::cpu::CpuBackend;
use strix_server::{ServedModel, Server, ServerConfig};

/// Long enough for any run here on a loaded 2-core machine; a run that takes longer hangs.
const HANG: Duration = Duration::from_secs(60);

fn strix_server() -> Server {
    strix_server_with_pass(None)
}

/// A fixture server; `Some(n)`: prefill passes (and prefix cache blocks) of `n` tokens.
fn strix_server_with_pass(pass: Option<usize>) -> Server {
    let dir = fixtures().join("models/vlm-f32-gdn2x");
    let mut served = ServedModel::load(&dir, CpuBackend::new()).expect("load the fixture model");
    let mut config = ServerConfig::new("fixture", 1024);
    config.port = 0;
    if let Some(pass) = pass {
        served.model.set_pass_tokens(pass).unwrap();
        config.engine.prefill_chunk = pass;
    }
    Server::start(served, config).expect("start the server")
}

/// Runs `strix bench-serve` with the words of `line` and then `more` as arguments, killing it
/// (and failing) if it outlives [`HANG`].
fn bench_serve(line: &str, more: &[&str]) -> Output {
    let args: Vec<&str> = line.split_whitespace().chain(more.iter().copied()).collect();
    // `$STRIX_BIN`, as in tests/cli.rs: a prebuilt binary (or a copy, where others rebuild the
    // shared target directory's).
    let mut child = Command::new(strix_bin())
        .arg("bench-serve")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start strix bench-serve");
    let start = Instant::now();
    while child.try_wait().expect("poll the child").is_none() {
        if start.elapsed() > HANG {
            child.kill().expect("kill the child");
            let out = child.wait_with_output().expect("wait");
            panic!("strix bench-serve {args:?} hung; stderr: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect the output")
}

fn report(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            stderr(out)
        )
    })
}

/// A successful `strix bench-serve` against `server` (its URL ends in `path`), with the words
/// of `flags` and then `more` as arguments: the output and its JSON report.
fn measured(server: &Server, path: &str, flags: &str, more: &[&str]) -> (Output, Value) {
    let out = bench_serve(&format!("--url http://{}{path} {flags}", server.addr()), more);
    assert!(out.status.success(), "bench-serve failed: {}", stderr(&out));
    let r = report(&out);
    (out, r)
}

/// Checks a latency distribution's shape and returns its [p50, p90, p99, max].
#[track_caller]
fn percentiles(d: &Value, count: u64) -> [f64; 4] {
    assert_eq!(d["count"], count, "{d}");
    let q = ["p50", "p90", "p99", "max"].map(|k| d[k].as_f64().unwrap_or_else(|| panic!("no {k} in {d}")));
    assert!(q[0] >= 0.0 && q.windows(2).all(|w| w[0] <= w[1]), "percentiles out of order: {d}");
    q
}

#[test]
fn measures_a_strix_server_with_every_request_accounted_for() {
    let server = strix_server();
    let (out, r) = measured(
        &server,
        "",
        "--clients 3 --requests 8 --warmup 2 --max-tokens 6 --prompt-len 12,30 \
         --vocab 300 --mix greedy,temperature,top-p --seed 1",
        &[],
    );

    assert_eq!(r["server"]["model"], "fixture", "the model comes from /v1/models");
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(8), Some(0)), "{r}");
    // ignore_eos: every request generates exactly --max-tokens, as the server's usage says.
    assert_eq!(r["output_tokens"], 8 * 6);
    assert_eq!(r["output_tokens_from"], "usage");
    assert_eq!(r["short_requests"], 0);
    assert_eq!(r["finish_reasons"]["length"], 8);
    // Request i takes length (i / 3) mod 2 of the list: 12 for i = 0..3 and 6..8, 30 for
    // 3..6. The server counted exactly the ids sent.
    assert_eq!(r["prompt_tokens"], 5 * 12 + 3 * 30);
    let in_flight = r["concurrency"]["max"].as_u64().unwrap();
    assert!((1..=3).contains(&in_flight), "{r}");

    // Throughputs are the counts over the measured wall time.
    let duration = r["duration_s"].as_f64().unwrap();
    assert!(duration > 0.0);
    let close = |a: &Value, b: f64| (a.as_f64().unwrap() - b).abs() <= 1e-9 * b.max(1.0);
    assert!(close(&r["requests_per_s"], 8.0 / duration), "{r}");
    assert!(close(&r["output_tok_s"], 48.0 / duration), "{r}");
    assert!(close(&r["prompt_tok_s"], 150.0 / duration), "{r}");

    // One ttft, tpot and e2e per request; an itl per gap between a request's token chunks.
    let chunks = r["token_chunks"].as_u64().unwrap();
    assert!(chunks >= 48, "strix streams a chunk per token: {r}");
    let ttft = percentiles(&r["ttft_ms"], 8);
    percentiles(&r["itl_ms"], chunks - 8);
    percentiles(&r["tpot_ms"], 8);
    let e2e = percentiles(&r["e2e_ms"], 8);
    // Each request's ttft is within its e2e, so every order statistic is too.
    assert!(ttft.iter().zip(&e2e).all(|(t, e)| t <= e), "ttft {ttft:?} beyond e2e {e2e:?}");
    assert!(e2e[3] <= duration * 1e3, "a request outlasted the run: {r}");

    // Every (sampling, prompt length) pairing occurs, and each accounts for its tokens.
    let groups = r["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 6, "{r}");
    let mut requests = 0;
    for g in groups {
        let n = g["requests"].as_u64().unwrap();
        assert_eq!(g["output_tokens"], n * 6, "{g}");
        requests += n;
    }
    assert_eq!(requests, 8);
    assert_eq!(groups[4]["fields"]["top_p"], 0.8, "top-p defaults to Qwen3.5's 0.8: {r}");

    let table = stderr(&out);
    for row in ["requests/s", "output tok/s", "ttft", "itl", "e2e", "top-p, prompt 30"] {
        assert!(table.contains(row), "no `{row}` row in the table:\n{table}");
    }
}

#[test]
fn chat_requests_with_word_prompts_on_fresh_connections_are_measured() {
    let server = strix_server();
    let (_, r) = measured(
        &server,
        "/v1",
        "--endpoint chat --clients 2 --requests 3 --warmup 0 --max-tokens 4 \
         --prompt-len 20 --temperature 0.5 --keep-alive false",
        &["--extra-body", r#"{"chat_template_kwargs": {"enable_thinking": false}}"#],
    );
    assert_eq!(r["server"]["endpoint"], "/v1/chat/completions");
    assert_eq!(r["keep_alive"], false);
    assert_eq!((r["completed"].as_u64(), r["output_tokens"].as_u64()), (Some(3), Some(12)), "{r}");
    assert_eq!(r["mix"][0]["fields"], serde_json::json!({"temperature": 0.5}));
    // Text prompts: only the server knows their length, and it said.
    assert!(r["prompt_tokens"].as_u64().unwrap() >= 3 * 20, "{r}");
    let ttft = percentiles(&r["ttft_ms"], 3);
    let e2e = percentiles(&r["e2e_ms"], 3);
    assert!(ttft.iter().zip(&e2e).all(|(t, e)| t <= e));
}

/// `--json-schema FILE` sends every request constrained by the repository's benchmark schema:
/// every output parses (the fixture's weights are random, so only the constraint makes them
/// JSON); cut short by `--max-tokens`, every output is counted as unparsable.
#[test]
fn json_schema_requests_are_constrained_and_their_outputs_checked() {
    let server = strix_server();
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/assets/bench_schema.json");
    let schema = schema.display().to_string();
    for (endpoint, max_tokens, unparsable) in [("chat", 700, 0), ("completions", 700, 0), ("chat", 6, 3)] {
        let (_, r) = measured(
            &server,
            "/v1",
            &format!(
                "--endpoint {endpoint} --clients 3 --requests 3 --warmup 0 --max-tokens {max_tokens} \
                 --prompt-len 20 --prompt-kind words --temperature 1 --seed 5 --json-schema {schema}"
            ),
            &[],
        );
        assert_eq!(r["completed"], 3, "{r}");
        assert_eq!(r["unparsable_outputs"], unparsable, "{endpoint} {max_tokens}: {r}");
        assert_eq!(r["json_schema"].as_str(), Some(schema.as_str()));
        if unparsable == 0 {
            assert_eq!(r["finish_reasons"], serde_json::json!({"stop": 3}), "{r}");
        }
    }
}

/// Every prompt starts with the same ids: the server's prefix cache holds the shared blocks
/// for every request after the first to prefill them, and the report counts what it said.
#[test]
fn a_shared_prefix_is_sent_and_the_cached_tokens_are_counted() {
    let server = strix_server_with_pass(Some(64));
    let (out, r) = measured(
        &server,
        "",
        "--clients 2 --requests 6 --warmup 0 --max-tokens 4 --shared-prefix-len 130 \
         --prompt-len 10 --vocab 300",
        &[],
    );
    assert_eq!(r["completed"], 6, "{r}");
    assert_eq!(r["prompt"]["shared_prefix_len"], 130);
    assert_eq!(r["prompt_tokens"], 6 * 140, "the server counted the shared ids too");
    // Blocks end at 64 and 128: the first request to prefill them caches them for the others.
    assert_eq!(r["cached_prompt_tokens"], 5 * 128, "{r}");
    assert!(stderr(&out).contains("after 130 shared ones"), "{}", stderr(&out));
}

/// Conversations of three turns, each resending the history: every turn's prompt is the last
/// one's plus its answer and the new ids, and the report gives each turn its own figures.
#[test]
fn multi_turn_conversations_resend_the_history_and_report_each_turn() {
    let server = strix_server_with_pass(Some(64));
    let (out, r) = measured(
        &server,
        "",
        "--clients 2 --requests 2 --warmup 0 --max-tokens 5 --turns 3 --turn-len 70 \
         --vocab 300",
        &[],
    );
    assert_eq!((r["completed"].as_u64(), r["turns"].as_u64()), (Some(6), Some(3)), "{r}");
    let turns = r["per_turn"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    // Turn k sends k x 70 new ids and the k - 1 answers of 5 tokens before it.
    let prompts: Vec<u64> = turns.iter().map(|t| t["prompt_tokens"].as_u64().unwrap()).collect();
    assert_eq!(prompts, [2 * 70, 2 * 145, 2 * 220]);
    assert_eq!(r["prompt_tokens"], 2 * (70 + 145 + 220), "the server counted what was sent");
    // Turn 2 resumes at turn 1's block boundary (64), turn 3 at turn 2's (128).
    let cached: Vec<u64> = turns.iter().map(|t| t["cached_tokens"].as_u64().unwrap()).collect();
    assert_eq!(cached, [0, 2 * 64, 2 * 128], "{r}");
    for t in turns {
        assert_eq!(t["requests"], 2);
        percentiles(&t["ttft_ms"], 2);
    }
    let table = stderr(&out);
    assert!(table.contains("turn 3") && table.contains("(256 cached)"), "{table}");
}

#[test]
fn prefix_modes_need_id_prompts_on_completions() {
    let server = strix_server();
    let url = format!("http://{}", server.addr());
    for flags in ["--endpoint chat --turns 2 --turn-len 5", "--prompt-kind words --shared-prefix-len 8"] {
        let out = bench_serve(&format!("--url {url} --warmup 0 {flags}"), &[]);
        assert_fails_with(&out, "needs id prompts");
    }
    let out = bench_serve(&format!("--url {url} --warmup 0 --turns 0 --turn-len 5"), &[]);
    assert_fails_with(&out, "--turns and --turn-len must each be at least 1");
}

/// A failed run: non-zero exit, an `error:` line on stderr naming `needle`, no panic.
#[track_caller]
fn assert_fails_with(out: &Output, needle: &str) {
    let err = stderr(out);
    assert!(!out.status.success(), "expected a failure; stderr: {err}");
    assert!(!err.contains("panicked"), "bench-serve panicked: {err}");
    let last = err.lines().last().unwrap_or("");
    assert!(last.starts_with("error: ") && last.contains(needle), "no error naming `{needle}`: {err}");
}

#[test]
fn a_dead_url_is_one_clear_error() {
    // A port that was just free: nothing listens there.
    let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let out = bench_serve(&format!("--url http://{addr} --clients 2"), &[]);
    assert_fails_with(&out, "cannot reach the server");
    assert!(stderr(&out).contains(&addr.to_string()), "the error names the URL: {}", stderr(&out));
    assert!(out.stdout.is_empty(), "no report without a server");

    let out = bench_serve("--url localhost:8080", &[]);
    assert_fails_with(&out, "--url must start with http://");
}

/// Completions asked of the `flaky` scenario so far.
static FLAKY: AtomicUsize = AtomicUsize::new(0);

/// A server that answers `/v1/models` and then misbehaves on every completion as the request's
/// `model` says.
fn fake_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || answer(stream));
        }
    });
    addr
}

/// Answers one request and closes the connection (every answer says `Connection: close`, so a
/// client never reuses a connection this server is about to drop).
fn answer(mut stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut head = String::new();
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap();
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let sse = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";
    let token = "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n";
    let reply = if head.starts_with("GET /v1/models") {
        let list = r#"{"object":"list","data":[{"id":"fake","object":"model"}]}"#;
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{list}",
            list.len()
        )
    } else {
        let request: Value = serde_json::from_slice(&body).unwrap();
        match request["model"].as_str().unwrap() {
            "overloaded" => {
                let error = r#"{"error":{"message":"the queue is full","type":"server_error"}}"#;
                format!("HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{error}", error.len())
            }
            "html" => {
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n\r\n<html>hello</html>"
                    .to_string()
            }
            "error-event" => {
                format!("{sse}{token}data: {{\"error\":{{\"message\":\"the engine stopped\"}}}}\n\n")
            }
            "cut" => format!("{sse}{token}{token}"),
            // Every other request is refused; the others stream two tokens and no usage.
            "flaky" if FLAKY.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) => {
                let error = r#"{"error":{"message":"busy","type":"server_error"}}"#;
                format!("HTTP/1.1 429 Too Many Requests\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{error}", error.len())
            }
            "flaky" => format!("{sse}{token}{token}data: [DONE]\n\n"),
            "stall" => {
                let _ = stream.write_all(format!("{sse}{token}").as_bytes());
                std::thread::sleep(HANG);
                return;
            }
            other => panic!("no scenario {other}"),
        }
    };
    let _ = stream.write_all(reply.as_bytes());
}

#[test]
fn misbehaving_servers_give_counted_failures_with_their_reason() {
    let url = format!("http://{}", fake_server());
    for (scenario, reason) in [
        ("overloaded", "HTTP 503: the queue is full"),
        ("html", "`text/html`, not an event stream"),
        ("error-event", "error event: the engine stopped"),
        ("cut", "ended before `data: [DONE]` (after 2 token chunks)"),
        ("stall", "within --timeout 1 s"),
    ] {
        let out = bench_serve(
            &format!("--url {url} --model {scenario} --clients 2 --requests 3 --warmup 0 --timeout 1"),
            &[],
        );
        assert_fails_with(&out, reason);
        let r = report(&out);
        assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(0), Some(3)), "{scenario}: {r}");
        assert!(r["first_error"].as_str().unwrap().contains(reason), "{scenario}: {r}");
    }
    // Some requests fail: the run reports them beside the figures of the others, and succeeds.
    let out = bench_serve(&format!("--url {url} --model flaky --clients 2 --requests 4 --warmup 0"), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r = report(&out);
    assert_eq!((r["completed"].as_u64(), r["failed"].as_u64()), (Some(2), Some(2)), "{r}");
    assert_eq!(r["errors"]["HTTP 429: busy"], 2, "{r}");
    assert!(stderr(&out).contains("HTTP 429: busy"), "the table shows the first error");
    // No usage chunk: the tokens are the chunks that carried them.
    assert_eq!((r["output_tokens"].as_u64(), r["output_tokens_from"].as_str()), (Some(4), Some("chunks")));
    assert_eq!(r["short_requests"], 2, "two tokens of --max-tokens 128");
    percentiles(&r["itl_ms"], 2);

    // A failed warm-up stops the run before it measures anything.
    let out = bench_serve(&format!("--url {url} --model overloaded --clients 2"), &[]);
    assert_fails_with(&out, "a warm-up request failed");
    assert!(out.stdout.is_empty());
}
