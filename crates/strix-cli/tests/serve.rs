//! `strix serve` as a process: it starts on a free port, says where it listens, answers
//! HTTP, and exits cleanly on Ctrl-C (SIGINT). The API itself is tested in strix-server.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{fixtures, strix_bin};

fn get(addr: &str, path: &str) -> String {
    get_as(addr, path, "localhost")
}

/// A GET with this `Host`.
fn get_as(addr: &str, path: &str, host: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    response
}

fn post(addr: &str, path: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    response
}

/// A llama.cpp GGUF file is served with the tokenizer and chat template of its metadata.
#[test]
fn serve_takes_a_gguf_file() {
    let model = fixtures().join("gguf-models/causal-bf16-gdn3x.bf16.gguf");
    let (mut child, addr) = start(&model, &[]);
    let chat = post(
        &addr,
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"temperature":0}"#,
    );
    assert!(chat.starts_with("HTTP/1.1 200") && chat.contains("\"completion_tokens\":"), "{chat}");
    let text = post(&addr, "/v1/completions", r#"{"prompt":"hello","max_tokens":3,"temperature":0}"#);
    assert!(text.starts_with("HTTP/1.1 200") && text.contains("\"text\":"), "{text}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Starts `strix serve` on a free port with `extra` options; the child and the address it
/// listens on.
fn start(model: &Path, extra: &[&str]) -> (std::process::Child, String) {
    let mut child = Command::new(strix_bin())
        .args(["serve", "--device", "cpu", "--port", "0", "--served-model-name", "fixture"])
        .args(extra)
        .arg("--model")
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start strix serve");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).expect("the startup line");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    (child, addr)
}

#[test]
fn serve_listens_answers_and_stops_on_ctrl_c() {
    let model = fixtures().join("models/vlm-f32-gdn2x");
    let (mut child, addr) = start(&model, &["--allowed-hosts", "box.lan", "--idle-timeout", "1"]);
    assert!(addr.starts_with("127.0.0.1:"), "binds loopback by default: {addr}");

    let health = get(&addr, "/health");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(get(&addr, "/v1/models").contains("\"id\":\"fixture\""));
    // Loopback and --allowed-hosts names only.
    assert!(get_as(&addr, "/health", "box.lan:8080").starts_with("HTTP/1.1 200"));
    let rebound = get_as(&addr, "/health", "evil.example");
    assert!(rebound.starts_with("HTTP/1.1 403") && rebound.contains("host_not_allowed"), "{rebound}");
    // --idle-timeout: a connection that says nothing is closed (read gives end of file).
    let mut idle = TcpStream::connect(&addr).unwrap();
    idle.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    assert_eq!(idle.read(&mut [0u8; 16]).expect("closed, not timed out"), 0);

    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "strix serve exited with {exit}");
}

/// Options that make the server unusable are refused before the model loads (the model path
/// here does not exist, so reaching the load would fail differently).
#[test]
fn serve_refuses_bad_options_up_front() {
    for (args, says) in [
        (["--api-key", ""], "--api-key is empty"),
        (["--api-key", "   "], "--api-key is empty"),
        (["--cors-origin", "app.example"], "is not an origin"),
        (["--allowed-hosts", "a.example:80"], "is not a host name"),
        (["--idle-timeout", "0"], "must be at least 1"),
        (["--max-connections", "0"], "must be at least 1"),
        (["--max-seqs", "100000"], "must be at most 4096"),
        (["--max-seqs", "-1"], "must be at least 1"),
        (["--ctx", "99999999999"], "must be at most"),
        (["--header-timeout", "1e9"], "is not a whole number"),
        (["--max-body", "0"], "must be at least 1"),
        (["--state-budget-mib", "-5"], "must be at least 1"),
        (["--prefix-cache-mib", "-1"], "must be 0 or more"),
        (["--prefix-cache-mib", "2000000"], "must be at most"),
    ] {
        let out = Command::new(strix_bin())
            .args(["serve", "--device", "cpu", "--port", "0", "--model", "/nonexistent/strix-model"])
            .args(args)
            .output()
            .expect("run strix serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
