//! What the server's test binaries share: a server on the tiny fixture model on a free
//! loopback port, a small blocking HTTP/1.1 client (plain `std::net`, so a test controls
//! every byte it sends and can drop a connection mid-stream), an SSE reader, and metric
//! polling.
//!
//! Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use strix::backend::cpu::CpuBackend;
use strix_server::{ServedModel, Server, ServerConfig};

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/vlm-f32-gdn2x")
}

pub fn served() -> ServedModel<CpuBackend> {
    ServedModel::load(&fixture(), CpuBackend::new()).expect("load the fixture model")
}

/// A server on the fixture model, port 0, after `configure` has adjusted the defaults.
pub fn start(configure: impl FnOnce(&mut ServerConfig)) -> Server {
    let mut config = ServerConfig::new("tiny", 1024);
    config.port = 0;
    configure(&mut config);
    Server::start(served(), config).expect("start the server")
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("status {}: body is not JSON ({e}): {}", self.status, self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Checks the OpenAI error shape and returns `error`.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.text());
        let body = self.json();
        let error = body.get("error").unwrap_or_else(|| panic!("no `error` in {body}")).clone();
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
        assert!(error["type"].is_string(), "{body}");
        assert!(error.get("param").is_some() && error.get("code").is_some(), "{body}");
        error
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    stream
}

fn write_request(stream: &mut TcpStream, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    // A server may answer (413) and close before reading a large body: ignore write errors.
    let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(body));
}

fn read_head(reader: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).expect("header line");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
}

/// One request on a fresh connection; the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut stream = connect(addr);
    write_request(&mut stream, method, path, headers, body);
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader);
    let body = read_body(reader, &headers);
    Response { status, headers, body }
}

/// A response body: chunked, `Content-Length` bytes (some peers keep the connection open
/// after them), or everything up to the end of the connection.
fn read_body(mut reader: BufReader<TcpStream>, headers: &[(String, String)]) -> Vec<u8> {
    let mut body = Vec::new();
    let length = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok());
    if is_chunked(headers) {
        Chunked::new(reader).read_to_end(&mut body).expect("chunked body");
    } else if let Some(length) = length {
        body.resize(length, 0);
        reader.read_exact(&mut body).expect("body");
    } else {
        reader.read_to_end(&mut body).expect("body");
    }
    body
}

/// The endpoints the tests post requests to.
pub const CHAT_PATH: &str = "/v1/chat/completions";
pub const COMPLETIONS_PATH: &str = "/v1/completions";

/// A chat request's `messages`: one user turn.
pub fn user(text: &str) -> Value {
    serde_json::json!([{"role": "user", "content": text}])
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, &[], b"")
}

/// Decodes a chunked transfer-encoding body as it arrives.
pub struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Chunked<R> {
    pub fn new(inner: R) -> Self {
        Chunked { inner, left: 0, done: false }
    }
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                self.done = true;
                return Ok(0);
            }
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = usize::from_str_radix(size, 16).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("chunk size {line:?}"))
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            self.done = true;
            return Ok(0);
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

/// A server-sent event stream being read. Dropping it closes the connection.
pub struct EventStream {
    lines: BufReader<Chunked<BufReader<TcpStream>>>,
}

impl EventStream {
    /// The payload of the next `data:` line; `None` once the stream ends.
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            match self.lines.read_line(&mut line) {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                return Some(data.trim_start().to_owned());
            }
        }
    }

    /// Every JSON chunk up to `[DONE]` (which must come).
    pub fn collect(mut self) -> Vec<Value> {
        let mut chunks = Vec::new();
        loop {
            match self.next_data() {
                Some(data) if data == "[DONE]" => return chunks,
                Some(data) => chunks.push(serde_json::from_str(&data).expect("SSE data is JSON")),
                None => panic!("the stream ended without [DONE] after {} chunks", chunks.len()),
            }
        }
    }
}

/// Opens a streaming request: `Ok` with the event stream on 200, else the error response.
pub fn open_stream(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<EventStream, Response> {
    let mut stream = connect(addr);
    write_request(&mut stream, "POST", path, headers, body.to_string().as_bytes());
    let mut reader = BufReader::new(stream);
    let (status, resp_headers) = read_head(&mut reader);
    if status != 200 {
        let body = read_body(reader, &resp_headers);
        return Err(Response { status, headers: resp_headers, body });
    }
    let content_type =
        resp_headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("content-type")).map(|(_, v)| v.clone());
    assert_eq!(content_type.as_deref(), Some("text/event-stream"));
    Ok(EventStream { lines: BufReader::new(Chunked::new(reader)) })
}

pub fn stream(addr: SocketAddr, path: &str, body: &Value) -> Vec<Value> {
    match open_stream(addr, path, &[], body) {
        Ok(events) => events.collect(),
        Err(response) => panic!("streaming request failed: {} {}", response.status, response.text()),
    }
}

/// The value of an unlabelled metric.
pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = get(addr, "/metrics").text();
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

/// Polls `condition` until it holds; fails after a minute (never a timing assertion: a
/// condition that holds at all holds long before that).
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < Duration::from_secs(60), "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The concatenated `delta.<field>` of chat chunks.
pub fn joined(chunks: &[Value], field: &str) -> String {
    chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"][field].as_str().map(str::to_owned)).collect()
}

/// The concatenated `text` of completion chunks.
pub fn joined_text(chunks: &[Value]) -> String {
    chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str().map(str::to_owned)).collect()
}

/// The `finish_reason` of the chunk that has one.
pub fn finish_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .find_map(|c| c["choices"].get(0)?["finish_reason"].as_str().map(str::to_owned))
        .expect("a chunk with a finish_reason")
}
