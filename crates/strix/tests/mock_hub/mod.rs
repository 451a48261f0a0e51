//! A Hugging Face hub on loopback for the download tests: a small HTTP/1.1 server (std
//! `TcpListener`, a thread per connection, keep-alive) whose answers a test chooses, and the
//! hub's protocol as `huggingface_hub` sees it (`HEAD /{repo}/resolve/{revision}/{file}` with
//! `X-Repo-Commit`, `ETag` / `X-Linked-Etag`, sizes; weights redirected to a CDN; `Range`
//! requests) for a test to serve as is or to bend into a hostile answer.
//!
//! Shared by `crates/strix/tests/hub.rs` and the CLI's tests (through `#[path]`).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A request as the server read it.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// An answer. `Content-Length` is the body's unless `headers` sets one; `cut_after` closes the
/// connection after that many body bytes, `stall` stops sending after them and holds the
/// connection open until the server stops.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub cut_after: Option<usize>,
    pub stall: bool,
}

impl Reply {
    pub fn new(status: u16) -> Reply {
        Reply { status, ..Reply::default() }
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.set(name, value);
        self
    }

    /// Replaces (or adds) a header.
    pub fn set(&mut self, name: &str, value: &str) {
        self.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        self.headers.push((name.to_string(), value.to_string()));
    }

    pub fn remove(&mut self, name: &str) {
        self.headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

/// The server; it stops when dropped.
pub struct MockServer {
    addr: SocketAddr,
    log: Arc<Mutex<Vec<Request>>>,
    stop: Arc<AtomicBool>,
}

impl MockServer {
    pub fn start(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> MockServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(handler);
        let (log2, stop2) = (log.clone(), stop.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (handler, log, stop) = (handler.clone(), log2.clone(), stop2.clone());
                std::thread::spawn(move || serve_connection(stream, &*handler, &log, &stop));
            }
        });
        MockServer { addr, log, stop }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Request> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve_connection(stream: TcpStream, handler: &Handler, log: &Mutex<Vec<Request>>, stop: &AtomicBool) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    // Small answers in several writes would otherwise wait on delayed ACKs (40 ms each).
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (Some(method), Some(path)) = (parts.next(), parts.next()) else { return };
        let mut request = Request { method: method.to_string(), path: path.to_string(), headers: Vec::new() };
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((k, v)) = header.split_once(':') {
                request.headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        log.lock().unwrap().push(request.clone());
        let reply = handler(&request);
        let mut head = format!("HTTP/1.1 {} Mock\r\n", reply.status);
        for (k, v) in &reply.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if reply.get("Content-Length").is_none() {
            head.push_str(&format!("Content-Length: {}\r\n", reply.body.len()));
        }
        head.push_str("\r\n");
        let mut answer = head.into_bytes();
        if request.method != "HEAD" {
            let sent = reply.cut_after.unwrap_or(reply.body.len()).min(reply.body.len());
            answer.extend_from_slice(&reply.body[..sent]);
        }
        if out.write_all(&answer).and_then(|_| out.flush()).is_err() {
            return;
        }
        if request.method == "HEAD" {
            continue;
        }
        if reply.stall {
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
            return;
        }
        if reply.cut_after.is_some() {
            return;
        }
    }
}

/// A repo to serve: files by name, at one commit.
#[derive(Clone)]
pub struct HubRepo {
    pub id: String,
    pub commit: String,
    pub files: Vec<(String, Vec<u8>)>,
}

impl HubRepo {
    /// The files of a fixture model directory (all of them but the goldens).
    pub fn from_dir(id: &str, dir: &Path) -> HubRepo {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap() != "goldens.safetensors")
            .map(|p| (p.file_name().unwrap().to_str().unwrap().to_string(), std::fs::read(&p).unwrap()))
            .collect();
        files.sort();
        HubRepo { id: id.to_string(), commit: hex_digest(id.as_bytes(), 40), files }
    }

    pub fn file(&self, name: &str) -> Option<&[u8]> {
        self.files.iter().find(|(n, _)| n == name).map(|(_, b)| b.as_slice())
    }

    pub fn set_file(&mut self, name: &str, bytes: Vec<u8>) {
        self.files.retain(|(n, _)| n != name);
        self.files.push((name.to_string(), bytes));
    }
}

/// A hex digest of `n` digits standing in for the hub's sha1 / sha256 (FNV-1a, widened).
pub fn hex_digest(bytes: &[u8], n: usize) -> String {
    let mut out = String::new();
    let mut round = 0u64;
    while out.len() < n {
        let mut h = 0xcbf29ce484222325u64 ^ round;
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        out.push_str(&format!("{h:016x}"));
        round += 1;
    }
    out.truncate(n);
    out
}

/// The blob name (ETag) the mock hub gives a file: 64 hex digits for weights (LFS), 40 for
/// the rest, as the real hub does.
pub fn etag_of(name: &str, bytes: &[u8]) -> String {
    hex_digest(bytes, if is_lfs(name) { 64 } else { 40 })
}

fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors")
}

/// The hub's answer to `request` for `repo`, as huggingface.co gives it: metadata of a small
/// file in a 200 (`ETag`, `Content-Length`), of weights in a 302 to `{cdn}/blobs/{etag}`
/// (`X-Linked-Etag`, `X-Linked-Size`); GETs of the bytes with `Range` support; a missing file
/// is a 404 `EntryNotFound`, another repo a 401 `RepoNotFound`. `cdn` is the base URL the
/// weights are redirected to (`None`: served by the hub itself, without a redirect).
pub fn hub_reply(repo: &HubRepo, cdn: Option<&str>, request: &Request) -> Reply {
    if let Some(etag) = request.path.strip_prefix("/blobs/") {
        return match repo.files.iter().find(|(n, b)| etag_of(n, b) == etag) {
            Some((_, bytes)) => bytes_reply(bytes, request),
            None => Reply::new(404),
        };
    }
    let prefix = format!("/{}/resolve/", repo.id);
    let Some(rest) = request.path.strip_prefix(&prefix) else {
        return Reply::new(401)
            .header("X-Error-Code", "RepoNotFound")
            .header("X-Error-Message", "Repository not found");
    };
    let Some((revision, name)) = rest.split_once('/') else { return Reply::new(400) };
    if revision != "main" && revision != repo.commit {
        return Reply::new(404).header("X-Error-Code", "RevisionNotFound");
    }
    let Some(bytes) = repo.file(name) else {
        return Reply::new(404)
            .header("X-Error-Code", "EntryNotFound")
            .header("X-Repo-Commit", &repo.commit)
            .header("X-Error-Message", "Entry not found");
    };
    let etag = etag_of(name, bytes);
    match (cdn, is_lfs(name)) {
        (Some(cdn), true) => Reply::new(302)
            .header("Location", &format!("{cdn}/blobs/{etag}"))
            .header("X-Repo-Commit", &repo.commit)
            .header("X-Linked-Etag", &format!("\"{etag}\""))
            .header("X-Linked-Size", &bytes.len().to_string())
            .header("ETag", "\"not-the-blob\""),
        _ => {
            let mut reply = bytes_reply(bytes, request);
            reply.set("X-Repo-Commit", &repo.commit);
            reply.set("ETag", &format!("\"{etag}\""));
            reply
        }
    }
}

/// `bytes`, or the part a `Range: bytes=N-` asks for (206 with its `Content-Range`).
pub fn bytes_reply(bytes: &[u8], request: &Request) -> Reply {
    let start = request
        .header("Range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    match start {
        Some(start) if start < bytes.len() => Reply {
            body: bytes[start..].to_vec(),
            ..Reply::new(206)
                .header("Content-Range", &format!("bytes {start}-{}/{}", bytes.len() - 1, bytes.len()))
        },
        _ => Reply { body: bytes.to_vec(), ..Reply::new(200) },
    }
}
