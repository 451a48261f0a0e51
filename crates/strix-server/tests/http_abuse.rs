//! The server against hostile connections and browsers, over raw TCP so that every byte is
//! the test's: slow and idle connections are timed out, a flood of idle connections cannot
//! lock `/health` out, a full server refuses cleanly, streams outlive the timeouts, requests
//! hyper cannot parse get the OpenAI error body, and the `Host`, `Origin` (CORS) and
//! content-type checks keep browser pages out. Timeouts are configured small (a few hundred
//! milliseconds); every wait has a bound of seconds, so a hang fails instead of blocking.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use strix_server::{Server, ServerConfig};

/// Longest any single wait may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(10);

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(HANG)).unwrap();
    stream
}

/// Sends `bytes` as they are on a fresh connection and reads the answer to the end.
fn raw(addr: SocketAddr, bytes: &[u8]) -> Response {
    let mut stream = connect(addr);
    // The server may answer and close before it has read everything (a head too large).
    let _ = stream.write_all(bytes);
    read_response(&mut stream)
}

/// Reads a whole response from a connection the server closes after it.
fn read_response(stream: &mut TcpStream) -> Response {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            // A reset after the answer arrived (the server closed with bytes unread).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && !bytes.is_empty() => break,
            Err(e) => panic!("reading the response: {e} (after {} bytes)", bytes.len()),
        }
    }
    parse_response(&bytes)
}

fn parse_response(bytes: &[u8]) -> Response {
    let text = String::from_utf8_lossy(bytes);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no response head in {text:?}"));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {text:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let chunked =
        headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        let mut decoded = Vec::new();
        Chunked::new(body.as_bytes()).read_to_end(&mut decoded).expect("chunked body");
        decoded
    } else {
        body.as_bytes().to_vec()
    };
    Response { status, headers, body }
}

/// A request with exactly these headers (and `Connection: close`).
fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    head.push_str(body);
    raw(addr, head.as_bytes())
}

fn health(addr: SocketAddr) -> Response {
    send(addr, "GET", "/health", &[("Host", "localhost")], "")
}

/// Whether the server has closed `stream` (end of file or a reset) within [`HANG`];
/// `Err` with what it sent instead.
fn closed_by_server(stream: &mut TcpStream) -> Result<(), Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return if got.is_empty() { Ok(()) } else { Err(got) },
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
            Err(e) => panic!("the server did not close the connection within {HANG:?}: {e}"),
        }
    }
}

fn short_timeouts(c: &mut ServerConfig) {
    c.connections.header_timeout = Duration::from_millis(300);
    c.connections.body_timeout = Duration::from_millis(300);
    c.connections.idle_timeout = Duration::from_millis(300);
}

const CHAT: &str = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;

#[test]
fn a_slow_head_is_cut_with_a_408() {
    let server = start(short_timeouts);
    let mut stream = connect(server.addr());
    let started = Instant::now();
    // One byte every 50 ms: the head never ends in time.
    let mut writer = stream.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        for byte in
            b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        {
            if writer.write_all(&[*byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let error = read_response(&mut stream).error(408);
    assert_eq!(error["code"], "request_timeout");
    assert!(error["message"].as_str().unwrap().contains("--header-timeout"), "{error}");
    // Cut after the timeout: not before it, and not after the head would have ended (3.2 s).
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
    trickle.join().unwrap();
    assert_eq!(health(server.addr()).status, 200);
}

#[test]
fn idle_connections_are_closed_silently() {
    let server = start(short_timeouts);
    let addr = server.addr();
    // Never says anything.
    let mut silent = connect(addr);
    // Asks once, keeps the connection open.
    let mut kept = connect(addr);
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut answer = vec![0u8; 4096];
    let n = kept.read(&mut answer).unwrap();
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer[..n]));
    let started = Instant::now();
    assert_eq!(closed_by_server(&mut silent), Ok(()));
    assert_eq!(closed_by_server(&mut kept), Ok(()));
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[test]
fn a_slow_body_is_cut_with_a_408() {
    let server = start(short_timeouts);
    let mut stream = connect(server.addr());
    // 20 of the 200 bytes promised, then nothing.
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: 200\r\n\r\n{{\"prompt\": \"hello\","
    )
    .unwrap();
    let error = read_response(&mut stream).error(408);
    assert!(error["message"].as_str().unwrap().contains("--body-timeout"), "{error}");
    assert_eq!(error["code"], "request_timeout");
}

#[test]
fn an_idle_flood_does_not_lock_out_health() {
    const CAP: usize = 8;
    let server = start(|c| {
        short_timeouts(c);
        // Long enough that no connection of the flood times out during the test.
        c.connections.idle_timeout = Duration::from_secs(60);
        c.connections.header_timeout = Duration::from_secs(60);
        c.connections.max_connections = CAP;
    });
    let addr = server.addr();
    assert_eq!(server.max_connections(), CAP);
    // Twice the cap: half say nothing, half send part of a head.
    let mut flood: Vec<TcpStream> = (0..2 * CAP)
        .map(|i| {
            let mut s = connect(addr);
            if i % 2 == 1 {
                s.write_all(b"GET /health HTTP/1.1\r\nHost: loc").unwrap();
            }
            // In order, so that "oldest" is well defined.
            std::thread::sleep(Duration::from_millis(20));
            s
        })
        .collect();
    for _ in 0..3 {
        let r = health(addr);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The oldest were closed to make room, silently.
    for (i, s) in flood.iter_mut().take(CAP).enumerate() {
        assert_eq!(closed_by_server(s), Ok(()), "connection {i}");
    }
    // The newest are still served.
    let mut last = flood.pop().unwrap();
    last.write_all(b"alhost\r\nConnection: close\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut last).status, 200);
}

#[test]
fn a_server_full_of_requests_refuses_with_503_and_recovers() {
    let server = start(|c| {
        c.connections.max_connections = 2;
        c.engine.context = 1 << 20;
    });
    let addr = server.addr();
    let endless = json!({"prompt": "Count:", "max_tokens": 1_000_000, "ignore_eos": true, "stream": true});
    let mut streams: Vec<EventStream> =
        (0..2).map(|_| open_stream(addr, COMPLETIONS_PATH, &[], &endless).ok().unwrap()).collect();
    for s in &mut streams {
        s.next_data().unwrap();
    }
    let error = health(addr).error(503);
    assert_eq!(error["code"], "too_many_connections");
    drop(streams);
    wait_until("a slot frees", || health(addr).status == 200);
}

#[test]
fn a_stream_outlives_the_idle_and_header_timeouts() {
    let server = start(|c| {
        short_timeouts(c);
        c.connections.idle_timeout = Duration::from_millis(100);
        c.connections.header_timeout = Duration::from_millis(100);
        c.engine.context = 1 << 20;
    });
    let addr = server.addr();
    let body = json!({"prompt": "Count:", "max_tokens": 1_000_000, "ignore_eos": true, "stream": true});
    let mut stream = open_stream(addr, COMPLETIONS_PATH, &[], &body).ok().unwrap();
    let started = Instant::now();
    let mut chunks = 0;
    // Ten idle timeouts' worth of streaming.
    while started.elapsed() < Duration::from_secs(1) {
        let data = stream.next_data().expect("the stream was cut");
        assert!(data.starts_with('{'), "{data}");
        chunks += 1;
    }
    assert!(chunks > 1);
    drop(stream);
    // A whole answer that takes a while is not cut either: a client reading slowly.
    let r = post(addr, COMPLETIONS_PATH, &json!({"prompt": "Count:", "max_tokens": 300, "ignore_eos": true}));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn requests_hyper_cannot_parse_get_openai_errors() {
    let server = start(|_| {});
    let addr = server.addr();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n";
    let cases: [(&str, Vec<u8>, u16, &str); 7] = [
        (
            "Content-Length not a number",
            format!("{head}Content-Length: abc\r\n\r\n{{}}").into(),
            400,
            "content-length",
        ),
        (
            "two Content-Lengths",
            format!("{head}Content-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}").into(),
            400,
            "content-length",
        ),
        (
            "a Transfer-Encoding not chunked",
            format!("{head}Transfer-Encoding: gzip\r\n\r\n").into(),
            400,
            "transfer-encoding",
        ),
        ("a header name with a space", format!("{head}Bad Header: x\r\n\r\n").into(), 400, "header"),
        ("a request line that is not HTTP", b"HELLO\r\n\r\n".to_vec(), 400, "malformed"),
        (
            "a head larger than 64 KiB",
            format!("{head}X-Big: {}\r\n\r\n", "a".repeat(100_000)).into(),
            431,
            "too large",
        ),
        (
            "broken chunking",
            format!("{head}Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n").into(),
            400,
            "chunk size",
        ),
    ];
    for (what, bytes, status, says) in cases {
        let r = raw(addr, &bytes);
        assert_eq!(r.status, status, "{what}: {}", r.text());
        let error = r.error(status);
        let message = error["message"].as_str().unwrap().to_ascii_lowercase();
        assert!(message.contains(says), "{what}: {message}");
        assert_eq!(r.header("content-type"), Some("application/json"), "{what}");
    }
    // A good request on a kept-alive connection, then a bad one: the good answer is whole,
    // then the error body.
    let mut stream = connect(addr);
    write!(stream, "GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut first = vec![0u8; 4096];
    let n = stream.read(&mut first).unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"));
    write!(stream, "GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n").unwrap();
    read_response(&mut stream).error(400);
    // The same pipelined (sent at once): both answers whole, in order.
    let mut stream = connect(addr);
    let good = "GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n";
    write!(stream, "{good}{good}GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: x\r\n\r\n")
        .unwrap();
    let mut all = String::new();
    stream.read_to_string(&mut all).unwrap();
    let error_at = all.find("HTTP/1.1 400 Bad Request\r\n").unwrap_or_else(|| panic!("no 400 in {all}"));
    assert_eq!(all[..error_at].matches("HTTP/1.1 200 OK\r\n").count(), 2, "{all}");
    assert_eq!(parse_response(&all.as_bytes()[error_at..]).error(400)["code"], "malformed_request");
    assert_eq!(health(addr).status, 200);
}

#[test]
fn a_rebinding_host_is_refused() {
    let server = start(|_| {});
    let addr = server.addr();
    for host in ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil.example:80"] {
        let error = send(addr, "GET", "/v1/models", &[("Host", host)], "").error(403);
        assert_eq!(error["code"], "host_not_allowed", "{host}");
        send(addr, "POST", CHAT_PATH, &[("Host", host), ("Content-Type", "application/json")], CHAT)
            .error(403);
    }
    let own = addr.to_string();
    for host in ["localhost", "localhost:8080", "127.0.0.1", own.as_str(), "[::1]:8080"] {
        assert_eq!(send(addr, "GET", "/v1/models", &[("Host", host)], "").status, 200, "{host}");
    }
    // Widened by --allowed-hosts.
    let widened = start(|c| c.allowed_hosts = vec!["box.lan".into()]);
    assert_eq!(send(widened.addr(), "GET", "/health", &[("Host", "box.lan:8080")], "").status, 200);
    send(widened.addr(), "GET", "/health", &[("Host", "evil.example")], "").error(403);
}

#[test]
fn cors_answers_allowed_origins_and_refuses_others() {
    let server = start(|c| c.cors_origins = vec!["http://app.example".into()]);
    let addr = server.addr();
    let preflight = |origin: &str| {
        send(
            addr,
            "OPTIONS",
            CHAT_PATH,
            &[
                ("Host", "localhost"),
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                ("Access-Control-Request-Headers", "authorization, content-type, x-stainless-os"),
            ],
            "",
        )
    };
    let ok = preflight("http://app.example");
    assert_eq!(ok.status, 204, "{}", ok.text());
    assert_eq!(ok.header("access-control-allow-origin"), Some("http://app.example"));
    assert!(ok.header("access-control-allow-methods").is_some_and(|m| m.contains("POST")));
    assert!(ok.header("access-control-allow-headers").is_some_and(|h| h.contains("x-stainless-os")));
    assert_eq!(preflight("http://evil.example").error(403)["code"], "origin_not_allowed");

    let chat = |origin: &str| {
        send(
            addr,
            "POST",
            CHAT_PATH,
            &[("Host", "localhost"), ("Origin", origin), ("Content-Type", "application/json")],
            CHAT,
        )
    };
    let allowed = chat("http://app.example");
    assert_eq!(allowed.status, 200, "{}", allowed.text());
    assert_eq!(allowed.header("access-control-allow-origin"), Some("http://app.example"));
    chat("http://evil.example").error(403);
    chat("null").error(403);
    // The server's own page (same origin) needs no CORS.
    let own = send(
        addr,
        "POST",
        CHAT_PATH,
        &[
            ("Host", "localhost:8080"),
            ("Origin", "http://localhost:8080"),
            ("Content-Type", "application/json"),
        ],
        CHAT,
    );
    assert_eq!(own.status, 200, "{}", own.text());
    assert_eq!(own.header("access-control-allow-origin"), None);
    // The refused requests never ran.
    assert_eq!(
        metric_line(addr, "strix_requests_total{route=\"/v1/chat/completions\",status=\"200\"}"),
        Some(2.0)
    );

    // Off by default: no origin but the server's own.
    let closed = start(|_| {});
    let r = send(
        closed.addr(),
        "OPTIONS",
        "/v1/models",
        &[("Host", "localhost"), ("Origin", "http://app.example"), ("Access-Control-Request-Method", "GET")],
        "",
    );
    r.error(403);
    assert_eq!(r.header("access-control-allow-origin"), None);
}

fn metric_line(addr: SocketAddr, series: &str) -> Option<f64> {
    let text = get(addr, "/metrics").text();
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn bodies_must_be_json() {
    let server = start(|_| {});
    let addr = server.addr();
    let chat = |content_type: Option<&str>| {
        let mut headers = vec![("Host", "localhost")];
        headers.extend(content_type.map(|t| ("Content-Type", t)));
        send(addr, "POST", CHAT_PATH, &headers, CHAT)
    };
    for refused in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
        None,
    ] {
        let error = chat(refused).error(415);
        assert_eq!(error["code"], "unsupported_media_type", "{refused:?}");
        assert!(error["message"].as_str().unwrap().contains("application/json"));
    }
    for accepted in ["application/json", "application/json; charset=utf-8", "Application/JSON"] {
        assert_eq!(chat(Some(accepted)).status, 200, "{accepted}");
    }
}

#[test]
fn shutdown_closes_open_connections() {
    let server = start(|_| {});
    let addr = server.addr();
    let mut idle = connect(addr);
    let mut partial = connect(addr);
    partial.write_all(b"GET /health HTT").unwrap();
    let started = Instant::now();
    drop(server);
    assert_eq!(closed_by_server(&mut idle), Ok(()));
    assert_eq!(closed_by_server(&mut partial), Ok(()));
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    let _ = partial.shutdown(Shutdown::Both);
}

#[test]
fn an_empty_api_key_is_refused_at_start() {
    for key in ["", "   ", " padded", "tab\there"] {
        let mut config = ServerConfig::new("tiny", 64);
        config.port = 0;
        config.api_key = Some(key.into());
        let error = Server::start(served(), config).err().expect("refused");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
        assert!(error.to_string().contains("--api-key"), "{error}");
    }
}
