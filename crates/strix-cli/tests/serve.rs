//! `strix serve` as a process: it starts on a free port, says where it listens, answers
//! HTTP, and exits cleanly on Ctrl-C (SIGINT). The API itself is tested in strix-server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};

fn get(addr: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    response
}

fn post(addr: &str, path: &str, body: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
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
    let model = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf-models/causal-bf16-gdn3x.bf16.gguf");
    let (mut child, addr) = start(&model);
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

/// Starts `strix serve` on a free port; the child and the address it listens on.
fn start(model: &Path) -> (std::process::Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strix"))
        .args(["serve", "--device", "cpu", "--port", "0", "--served-model-name", "fixture", "--model"])
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
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/vlm-f32-gdn2x");
    let (mut child, addr) = start(&model);
    assert!(addr.starts_with("127.0.0.1:"), "binds loopback by default: {addr}");

    let health = get(&addr, "/health");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(get(&addr, "/v1/models").contains("\"id\":\"fixture\""));

    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "strix serve exited with {exit}");
}
