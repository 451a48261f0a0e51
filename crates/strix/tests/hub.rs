//! Hub downloads against a mock hub on loopback (`mock_hub`): a benign repo lands in the
//! Hugging Face cache layout and loads; hostile answers (shard names with `..` or absolute
//! paths, crafted ETags and commits, redirects, truncated, overlong and stalled bodies, error
//! statuses) each end in a clean error that names the problem, and nothing is ever written
//! outside the temporary cache.

mod mock_hub;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mock_hub::{etag_of, hub_reply, HubRepo, MockServer, Reply, Request};
use strix::hub::{fetch_model, HubOptions};
use tempfile::TempDir;

const REPO: &str = "org/tiny";
const SHARD1: &str = "model-00001-of-00003.safetensors";
const INDEX: &str = "model.safetensors.index.json";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

fn sharded_repo() -> HubRepo {
    HubRepo::from_dir(REPO, &fixture("causal-bf16-sharded"))
}

/// A temporary root holding the cache at `root/cache`, so anything written beside the cache
/// shows.
struct Sandbox {
    root: TempDir,
}

impl Sandbox {
    fn new() -> Sandbox {
        Sandbox { root: tempfile::tempdir().unwrap() }
    }

    fn cache(&self) -> PathBuf {
        self.root.path().join("cache")
    }

    fn options(&self, endpoint: &str) -> HubOptions {
        HubOptions {
            endpoint: endpoint.to_string(),
            progress: false,
            timeout: Duration::from_secs(10),
            ..HubOptions::new(self.cache())
        }
    }

    /// Every path under the root, symlinks not followed.
    fn entries(&self) -> Vec<PathBuf> {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                out.push(path.clone());
                if std::fs::symlink_metadata(&path).unwrap().is_dir() {
                    walk(&path, out);
                }
            }
        }
        let mut out = Vec::new();
        walk(self.root.path(), &mut out);
        out
    }

    /// Nothing outside the cache, no symlink in it pointing outside it, and no file whose
    /// name carries `marker` anywhere.
    #[track_caller]
    fn assert_contained(&self, marker: &str) {
        let cache = self.cache();
        for path in self.entries() {
            assert!(path.starts_with(&cache), "written outside the cache: {}", path.display());
            assert!(
                !path.to_string_lossy().contains(marker),
                "a hostile name became a path: {}",
                path.display()
            );
            if let Ok(target) = std::fs::read_link(&path) {
                let resolved = path.parent().unwrap().join(&target);
                let resolved = normalize(&resolved);
                assert!(resolved.starts_with(&cache), "{} links outside the cache", path.display());
            }
        }
        // Where `..` segments or an absolute path would have led: every folder above the cache.
        for base in cache.ancestors().chain([std::env::temp_dir().as_path()]) {
            for name in [marker.to_string(), format!("{marker}.lock"), format!("{marker}.incomplete")] {
                assert!(!base.join(&name).exists(), "{name} written in {}", base.display());
            }
        }
    }
}

/// `a/b/../c` as `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// A hub serving `repo` (weights redirected to a CDN on another port, `/blobs/{etag}`), with
/// `bend` applied to every answer of both.
struct Hub {
    hub: MockServer,
    cdn: MockServer,
}

impl Hub {
    fn start(repo: HubRepo, bend: impl Fn(&Request, Reply) -> Reply + Send + Sync + 'static) -> Hub {
        let repo = Arc::new(repo);
        let bend = Arc::new(bend);
        let (cdn_repo, cdn_bend) = (repo.clone(), bend.clone());
        let cdn = MockServer::start(move |r| cdn_bend(r, hub_reply(&cdn_repo, None, r)));
        let cdn_url = cdn.url();
        let hub = MockServer::start(move |r| bend(r, hub_reply(&repo, Some(&cdn_url), r)));
        Hub { hub, cdn }
    }

    fn plain(repo: HubRepo) -> Hub {
        Hub::start(repo, |_, reply| reply)
    }
}

#[track_caller]
fn expect_error(result: strix::Result<PathBuf>, needles: &[&str]) -> String {
    let message = match result {
        Ok(dir) => panic!("expected an error, got {}", dir.display()),
        Err(e) => e.to_string(),
    };
    for needle in needles {
        assert!(message.contains(needle), "`{needle}` not in: {message}");
    }
    assert!(!message.chars().any(|c| c.is_control()), "control characters in: {message:?}");
    message
}

#[test]
fn a_repo_downloads_into_the_huggingface_cache_layout_and_loads() {
    let sandbox = Sandbox::new();
    let repo = sharded_repo();
    let hub = Hub::plain(repo.clone());
    let dir = fetch_model(REPO, &sandbox.options(&hub.hub.url())).expect("download");

    let root = sandbox.cache().join("models--org--tiny");
    assert_eq!(dir, root.join("snapshots").join(&repo.commit));
    assert_eq!(std::fs::read_to_string(root.join("refs/main")).unwrap(), repo.commit);
    for (name, bytes) in &repo.files {
        let pointer = dir.join(name);
        let target = std::fs::read_link(&pointer).unwrap_or_else(|e| panic!("{name} is not a link: {e}"));
        assert_eq!(target, Path::new("../../blobs").join(etag_of(name, bytes)), "{name}");
        assert_eq!(&std::fs::read(&pointer).unwrap(), bytes, "{name}");
    }
    // A sharded repo is not asked for a single weights file.
    assert!(hub.hub.requests().iter().all(|r| !r.path.ends_with("/model.safetensors")));
    assert!(std::fs::read_dir(root.join("blobs"))
        .unwrap()
        .all(|e| { !e.unwrap().file_name().to_string_lossy().ends_with(".incomplete") }));
    // The weights went through the CDN, the small files straight from the hub.
    assert!(hub.cdn.requests().iter().any(|r| r.method == "GET" && r.path.starts_with("/blobs/")));
    let config = strix::config::ModelConfig::from_model_dir(&dir).expect("config loads");
    let ckpt = strix::checkpoint::Checkpoint::open_dir(&dir).expect("shards open");
    assert!(ckpt.contains("model.layers.0.mlp.up_proj.weight"), "{}", config.hidden_size);
    sandbox.assert_contained("pwned");

    // A second fetch is served by the cache alone.
    let asked = hub.hub.requests().len();
    assert_eq!(fetch_model(REPO, &sandbox.options(&hub.hub.url())).unwrap(), dir);
    assert_eq!(hub.hub.requests().len(), asked, "the cache should answer a second fetch");
    let offline = HubOptions { offline: true, ..sandbox.options("http://127.0.0.1:1") };
    assert_eq!(fetch_model(REPO, &offline).unwrap(), dir);
}

#[test]
fn a_single_file_repo_and_missing_optional_files() {
    let sandbox = Sandbox::new();
    let mut repo = HubRepo::from_dir(REPO, &fixture("causal-bf16-gdn3x"));
    repo.files.retain(|(n, _)| n != "chat_template.jinja");
    let hub = Hub::plain(repo.clone());
    let dir = fetch_model(REPO, &sandbox.options(&hub.hub.url())).expect("download");
    assert!(dir.join("model.safetensors").is_file());
    assert!(!dir.join("chat_template.jinja").exists());
    let no_exist = sandbox.cache().join("models--org--tiny/.no_exist").join(&repo.commit);
    assert!(no_exist.join("chat_template.jinja").is_file());
    assert!(no_exist.join(INDEX).is_file());
    sandbox.assert_contained("pwned");
}

/// An index naming `shard` as a weights file, for the sharded fixture.
fn repo_with_shard_name(shard: &str) -> HubRepo {
    let mut repo = sharded_repo();
    let mut index: serde_json::Value = serde_json::from_slice(repo.file(INDEX).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let first = map.keys().next().unwrap().clone();
    map.insert(first, serde_json::Value::from(shard));
    repo.set_file(INDEX, serde_json::to_vec(&index).unwrap());
    repo
}

#[test]
fn hostile_shard_names_are_refused_before_they_are_asked_for() {
    let marker = format!("pwned-{}", std::process::id());
    let names = [
        format!("../../../../../../../../../../tmp/{marker}.safetensors"),
        format!("../../{marker}.safetensors"),
        format!("/tmp/{marker}.safetensors"),
        format!("sub/../../{marker}.safetensors"),
        format!("..\\..\\{marker}.safetensors"),
        format!("sub//{marker}.safetensors"),
        format!(".{marker}.safetensors"),
        format!("{marker}\u{1b}[2J.safetensors"),
        format!("{marker}.bin"),
        format!("{}{marker}.safetensors", "a/".repeat(600)),
        String::new(),
    ];
    for name in &names {
        let sandbox = Sandbox::new();
        let hub = Hub::plain(repo_with_shard_name(name));
        let message = expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &[INDEX, "refused"]);
        assert!(!message.contains('\u{1b}'), "{message:?}");
        assert!(
            hub.hub.requests().iter().all(|r| !r.path.contains("pwned")),
            "{name:?} was requested: {:?}",
            hub.hub.requests()
        );
        sandbox.assert_contained(&marker);
    }
}

#[test]
fn a_cached_index_with_hostile_names_is_refused_too() {
    // An index already in the cache (written by another program) is checked like a fresh one.
    let sandbox = Sandbox::new();
    let repo = repo_with_shard_name("../../../escape.safetensors");
    let commit = repo.commit.clone();
    let snapshot = sandbox.cache().join("models--org--tiny/snapshots").join(&commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(sandbox.cache().join("models--org--tiny/refs")).unwrap();
    std::fs::write(sandbox.cache().join("models--org--tiny/refs/main"), &commit).unwrap();
    for (name, bytes) in &repo.files {
        std::fs::write(snapshot.join(name), bytes).unwrap();
    }
    let offline = HubOptions { offline: true, ..sandbox.options("http://127.0.0.1:1") };
    expect_error(fetch_model(REPO, &offline), &["escape.safetensors", "refused"]);
}

#[test]
fn hostile_etags_and_commits_never_become_paths() {
    let marker = format!("pwned-{}", std::process::id());
    let tmp_marker = std::env::temp_dir().join(&marker).display().to_string();
    let cases: Vec<(&str, String, &str)> = vec![
        ("ETag", format!("\"../../../../../../../../{marker}\""), "ETag"),
        ("ETag", format!("\"{tmp_marker}\""), "ETag"),
        ("ETag", "\"..\"".to_string(), "ETag"),
        ("ETag", "\"\"".to_string(), "ETag"),
        ("ETag", format!("\"a/{marker}\""), "ETag"),
        ("ETag", format!("\"{}\"", "f".repeat(300)), "ETag"),
        ("X-Repo-Commit", format!("../../../../{marker}"), "X-Repo-Commit"),
        ("X-Repo-Commit", "main".to_string(), "X-Repo-Commit"),
        ("X-Repo-Commit", format!("/tmp/{marker}"), "X-Repo-Commit"),
        ("X-Linked-Etag", format!("../../../../{marker}"), "ETag"),
        ("Content-Length", "-5".to_string(), "size"),
        ("Content-Length", "99999999999999999999999".to_string(), "size"),
    ];
    for (header, value, needle) in cases {
        let sandbox = Sandbox::new();
        let (h, v) = (header.to_string(), value.clone());
        let hub = Hub::start(sharded_repo(), move |request, mut reply| {
            if request.method == "HEAD" && request.path.ends_with("/config.json") {
                reply.set(&h, &v);
            }
            reply
        });
        expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &["config.json", needle]);
        sandbox.assert_contained(&marker);
    }
    // The same on the weights' redirect, where the blob name is X-Linked-Etag.
    for value in [format!("../../../../{marker}"), tmp_marker.clone()] {
        let sandbox = Sandbox::new();
        let hub = Hub::start(sharded_repo(), move |request, mut reply| {
            if request.path.ends_with(SHARD1) {
                reply.set("X-Linked-Etag", &value);
            }
            reply
        });
        expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &[SHARD1, "ETag"]);
        sandbox.assert_contained(&marker);
    }
}

#[test]
fn missing_headers_and_a_commit_that_changes_midway_are_errors() {
    for header in ["X-Repo-Commit", "ETag"] {
        let sandbox = Sandbox::new();
        let hub = Hub::start(sharded_repo(), move |_, mut reply| {
            reply.remove(header);
            reply
        });
        let needle = if header == "ETag" { "ETag" } else { "X-Repo-Commit" };
        expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &[needle]);
        sandbox.assert_contained("pwned");
    }
    let sandbox = Sandbox::new();
    let other = "f".repeat(40);
    let hub = Hub::start(sharded_repo(), move |request, mut reply| {
        if request.path.ends_with(SHARD1) {
            reply.set("X-Repo-Commit", &other);
        }
        reply
    });
    expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &[SHARD1, "commit"]);
}

#[test]
fn hostile_redirects_are_refused() {
    let cases: Vec<(String, &str)> = vec![
        ("file:///etc/passwd".to_string(), "redirect"),
        ("ftp://127.0.0.1/x".to_string(), "redirect"),
        ("/org/tiny/resolve/main/config.json".to_string(), "redirects"),
    ];
    for (location, needle) in cases {
        let sandbox = Sandbox::new();
        let hub = Hub::start(sharded_repo(), move |request, reply| {
            if request.path.ends_with("/config.json") {
                return Reply::new(302).header("Location", &location);
            }
            reply
        });
        expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &["config.json", needle]);
        sandbox.assert_contained("pwned");
    }
    // A redirect without a Location.
    let sandbox = Sandbox::new();
    let hub = Hub::start(sharded_repo(), |_, _| Reply::new(307));
    expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &["Location"]);

    // A relative redirect (a renamed repo) is followed, as huggingface_hub follows it.
    let sandbox = Sandbox::new();
    let repo = sharded_repo();
    let hub = Hub::start(repo.clone(), |request, reply| match request.path.strip_prefix("/old/tiny/") {
        Some(rest) => Reply::new(307).header("Location", &format!("/org/tiny/{rest}")),
        None => reply,
    });
    let dir = fetch_model("old/tiny", &sandbox.options(&hub.hub.url())).expect("follows relative redirects");
    assert_eq!(std::fs::read(dir.join("config.json")).unwrap(), repo.file("config.json").unwrap());
}

#[test]
fn truncated_bodies_never_become_blobs_and_resume_later() {
    let sandbox = Sandbox::new();
    let repo = sharded_repo();
    let bytes = repo.file(SHARD1).unwrap().to_vec();
    let blob = sandbox.cache().join("models--org--tiny/blobs").join(etag_of(SHARD1, &bytes));
    let cut = Arc::new(Mutex::new(true));
    let cut2 = cut.clone();
    // The CDN serves the weights; cut the first full answer after 1000 bytes.
    let cdn_repo = Arc::new(repo.clone());
    let cdn = MockServer::start(move |request| {
        let mut reply = hub_reply(&cdn_repo, None, request);
        if request.path.ends_with(&etag_of(SHARD1, &bytes)) && std::mem::take(&mut *cut2.lock().unwrap()) {
            reply.cut_after = Some(1000);
        }
        reply
    });
    let cdn_url = cdn.url();
    let hub_repo = repo.clone();
    let hub = MockServer::start(move |r| hub_reply(&hub_repo, Some(&cdn_url), r));

    expect_error(fetch_model(REPO, &sandbox.options(&hub.url())), &[SHARD1, "1000 of", "resume"]);
    assert!(!blob.exists(), "a truncated download became a blob");
    assert!(!sandbox.cache().join("models--org--tiny/snapshots").join(&repo.commit).join(SHARD1).exists());
    let partial = blob.with_file_name(format!("{}.incomplete", blob.file_name().unwrap().to_string_lossy()));
    assert_eq!(std::fs::metadata(&partial).unwrap().len(), 1000);

    // The next run asks for the rest only, and completes the file.
    let dir = fetch_model(REPO, &sandbox.options(&hub.url())).expect("resumed download");
    assert!(cdn.requests().iter().any(|r| r.header("Range") == Some("bytes=1000-")), "{:?}", cdn.requests());
    assert_eq!(std::fs::read(dir.join(SHARD1)).unwrap(), repo.file(SHARD1).unwrap());
    assert!(!partial.exists());
    sandbox.assert_contained("pwned");
}

#[test]
fn bodies_longer_or_shorter_than_announced_are_refused() {
    for (size_delta, needle) in [(-10i64, "longer than"), (10, "ended after")] {
        let sandbox = Sandbox::new();
        let hub = Hub::start(sharded_repo(), move |request, mut reply| {
            if request.method == "HEAD" && request.path.ends_with("/tokenizer.json") {
                let size = reply.body.len() as i64 + size_delta;
                reply.set("Content-Length", &size.to_string());
            }
            reply
        });
        expect_error(fetch_model(REPO, &sandbox.options(&hub.hub.url())), &["tokenizer.json", needle]);
        let blobs = sandbox.cache().join("models--org--tiny/blobs");
        let repo = sharded_repo();
        let etag = etag_of("tokenizer.json", repo.file("tokenizer.json").unwrap());
        assert!(!blobs.join(&etag).exists(), "a body of the wrong size became a blob");
        sandbox.assert_contained("pwned");
    }
}

#[test]
fn a_stalled_download_times_out() {
    let sandbox = Sandbox::new();
    let hub = Hub::start(sharded_repo(), |request, mut reply| {
        if request.method == "GET" && request.path.ends_with("/config.json") {
            reply.cut_after = Some(10);
            reply.stall = true;
        }
        reply
    });
    let options = HubOptions { timeout: Duration::from_millis(500), ..sandbox.options(&hub.hub.url()) };
    let started = Instant::now();
    expect_error(fetch_model(REPO, &options), &["config.json", "stopped after 10 of"]);
    // A hang check, not a speed claim: the timeout is half a second.
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}

#[test]
fn refusals_and_unreachable_hubs_are_named() {
    let sandbox = Sandbox::new();
    let hub = Hub::plain(sharded_repo());
    expect_error(fetch_model("org/absent", &sandbox.options(&hub.hub.url())), &["org/absent", "HF_TOKEN"]);

    let gated = Hub::start(sharded_repo(), |_, _| {
        Reply::new(403).header("X-Error-Code", "GatedRepo").header("X-Error-Message", "Access is restricted")
    });
    expect_error(fetch_model(REPO, &sandbox.options(&gated.hub.url())), &["gated", "restricted"]);

    let failing = Hub::start(sharded_repo(), |_, _| Reply::new(503));
    expect_error(fetch_model(REPO, &sandbox.options(&failing.hub.url())), &["HTTP 503"]);

    let not_a_model =
        Hub::start(sharded_repo(), |_, _| Reply::new(404).header("X-Error-Code", "EntryNotFound"));
    expect_error(fetch_model(REPO, &sandbox.options(&not_a_model.hub.url())), &["no config.json"]);

    // A port nothing listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    expect_error(fetch_model(REPO, &sandbox.options(&closed)), &["no answer from"]);
    expect_error(fetch_model(REPO, &sandbox.options("ftp://example.org")), &["endpoint"]);
    expect_error(fetch_model("../etc", &sandbox.options(&closed)), &["repo id"]);
    let offline = HubOptions { offline: true, ..sandbox.options(&closed) };
    expect_error(fetch_model(REPO, &offline), &["offline", "not in the cache"]);
    sandbox.assert_contained("pwned");
}

#[test]
fn the_token_goes_to_the_hub_and_never_to_the_cdn() {
    let sandbox = Sandbox::new();
    let hub = Hub::plain(sharded_repo());
    let options = HubOptions { token: Some("hf_secret".to_string()), ..sandbox.options(&hub.hub.url()) };
    fetch_model(REPO, &options).expect("download");
    let requests = hub.hub.requests();
    assert!(requests.iter().all(|r| r.header("Authorization") == Some("Bearer hf_secret")), "{requests:?}");
    let cdn = hub.cdn.requests();
    assert!(!cdn.is_empty() && cdn.iter().all(|r| r.header("Authorization").is_none()), "{cdn:?}");
}

#[test]
fn requests_go_through_the_proxy_the_options_name() {
    let sandbox = Sandbox::new();
    let proxy = MockServer::start(|_| Reply::new(503));
    let options = HubOptions { proxy: Some(proxy.url()), ..sandbox.options("http://hub.invalid") };
    let message = expect_error(fetch_model(REPO, &options), &["config.json"]);
    let seen = proxy.requests();
    assert!(seen.iter().any(|r| r.path.contains("hub.invalid")), "{seen:?} ({message})");
    let bad = HubOptions { proxy: Some("gopher://x".to_string()), ..sandbox.options("http://hub.invalid") };
    expect_error(fetch_model(REPO, &bad), &["proxy"]);
}

/// A small deterministic generator for the random answers below (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Random hostile answers: one header, the status or the body of one answer replaced by
/// garbage built from path-like pieces. Whatever the outcome, no panic, nothing outside the
/// cache, and a fetch that succeeds holds exactly the repo's bytes (an optional file the hub
/// answered 404 for may be left out).
#[test]
fn random_hostile_answers_never_escape_the_cache() {
    const CASES: usize = 96;
    let marker = format!("pwned-{}", std::process::id());
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let pieces = [
        "..", "/", "\\", ".", "%2e%2e", "%2F", ":", "~", "-", "_", "\"", "W/", "a", "0f", " ", "@", "?x", "#",
    ];
    let headers = [
        "ETag",
        "X-Linked-Etag",
        "X-Repo-Commit",
        "Content-Length",
        "X-Linked-Size",
        "Location",
        "Content-Range",
    ];
    let files = ["config.json", "tokenizer.json", INDEX, SHARD1, "model-00003-of-00003.safetensors"];
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..CASES {
        let mut value: String = (0..1 + rng.below(8)).map(|_| *rng.pick(&pieces)).collect();
        if rng.below(3) == 0 {
            value.push_str(&marker);
        }
        let header = *rng.pick(&headers);
        let file = *rng.pick(&files);
        let method = *rng.pick(&["HEAD", "GET"]);
        let status = *rng.pick(&[0u16, 0, 0, 200, 206, 301, 302, 307, 404, 416, 500]);
        let cut = rng.pick(&[None, None, Some(0usize), Some(7)]).to_owned();
        let (header_name, value2) = (header.to_string(), value.clone());
        let sandbox = Sandbox::new();
        let repo = sharded_repo();
        let repo_bytes = repo.file(file).map(<[u8]>::to_vec);
        let hub = Hub::start(repo.clone(), move |request, mut reply| {
            // The file's own path on the hub, or its blob on the CDN.
            let blob = format!("/blobs/{}", etag_of(file, repo_bytes.as_deref().unwrap_or_default()));
            let hit = request.method == method
                && (request.path.ends_with(&format!("/{file}")) || request.path == blob);
            if hit {
                reply.set(&header_name, &value2);
                if status != 0 {
                    reply.status = status;
                }
                reply.cut_after = cut;
            }
            reply
        });
        // A garbled Content-Length can leave the client waiting for bytes that never come.
        let options = HubOptions { timeout: Duration::from_millis(500), ..sandbox.options(&hub.hub.url()) };
        match fetch_model(REPO, &options) {
            Ok(dir) => {
                ok += 1;
                for (name, bytes) in &repo.files {
                    let optional =
                        !(name == "config.json" || name.ends_with(".safetensors") || name == INDEX);
                    match std::fs::read(dir.join(name)) {
                        Ok(got) => assert_eq!(&got, bytes, "{name} after {header} {value:?}"),
                        Err(_) if optional => {}
                        Err(e) => panic!("{name} missing after {header} {value:?}: {e}"),
                    }
                }
            }
            Err(e) => {
                refused += 1;
                let message = e.to_string();
                assert!(!message.chars().any(|c| c.is_control()), "{message:?}");
            }
        }
        sandbox.assert_contained(&marker);
    }
    eprintln!("random hostile answers: {CASES} cases, {ok} fetched intact, {refused} refused");
    assert!(refused > 0 && ok + refused == CASES);
}
