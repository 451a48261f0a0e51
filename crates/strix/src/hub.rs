//! Fetching a model from the Hugging Face Hub into the Hugging Face cache, so `strix run` works
//! with no `--model` and `--model org/name` downloads on first use: the config, tokenizer, chat
//! template and safetensors weights of a repo, with a progress bar per file.
//!
//! The cache layout is `huggingface_hub`'s, so either program finds what the other downloaded:
//! `{cache}/models--{org}--{name}/blobs/{etag}` holds the bytes, `snapshots/{commit}/{file}` is a
//! relative symlink to its blob, `refs/main` names the commit, `.no_exist/{commit}/{file}` marks
//! a file the repo does not have, and `{cache}/.locks/models--{org}--{name}/{etag}.lock` is the
//! lock both programs hold while writing a blob.
//!
//! Nothing the hub answers chooses a path. File names (the shard names of
//! `model.safetensors.index.json` among them), ETags and commits are checked against strict
//! patterns before they are joined to the cache directory, so a hostile repo or mirror can make
//! a download fail but never write outside the cache; header sizes are bounded by the HTTP client
//! and bodies by the size announced. A blob is written to `blobs/{etag}.incomplete` and renamed
//! into place only once it holds exactly the announced number of bytes, so an interrupted
//! download never leaves a truncated file that later loads (the next run resumes it).
//!
//! Files already in the cache are used without asking the hub (a snapshot is not updated once
//! its `config.json` is there). Options are values ([`HubOptions`]); the CLI reads the `HF_*`
//! environment variables into them.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use url::Url;

use crate::error::{Error, Result};

/// The model `strix run` uses when no `--model` is given.
pub const DEFAULT_MODEL: &str = "Qwen/Qwen3.5-0.8B";

/// The Hugging Face Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How long a download waits for a connection or for the next bytes of an answer by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

const CONFIG: &str = "config.json";
const INDEX: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

/// Files fetched when present in the repository; missing ones are fine.
const OPTIONAL_FILES: &[&str] =
    &["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"];

/// The hub's own limit on a repo id.
const MAX_REPO_ID_LEN: usize = 96;
/// Longest file name accepted from a repo, and longest part of one (a file system's usual
/// limit on one name).
const MAX_FILE_NAME_LEN: usize = 1024;
const MAX_FILE_NAME_PART: usize = 255;
/// Most distinct shards an index may name (the largest published checkpoints have a few
/// hundred), and the largest index read: real ones are tens of kilobytes.
const MAX_SHARDS: usize = 4096;
const MAX_INDEX_BYTES: u64 = 16 << 20;
/// Longest ETag accepted as a blob name (the hub's are 40 or 64 hex digits).
const MAX_ETAG_LEN: usize = 128;
/// Relative redirects followed while asking for a file's metadata (renamed repos).
const MAX_REDIRECTS: usize = 5;

/// Where and how to fetch from the hub.
#[derive(Clone, Debug)]
pub struct HubOptions {
    /// Base URL of the hub, or of a mirror (`HF_ENDPOINT`).
    pub endpoint: String,
    /// The Hugging Face cache (`HF_HUB_CACHE`; `~/.cache/huggingface/hub` by default).
    pub cache_dir: PathBuf,
    /// Sent as `Authorization: Bearer` to the endpoint's host only (`HF_TOKEN`).
    pub token: Option<String>,
    /// Use the cache only, never the network (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Draw a progress bar per downloaded file on stderr (when it is a terminal).
    pub progress: bool,
    /// Longest wait for a connection or for the next bytes of an answer.
    pub timeout: Duration,
    /// Proxy for every request (`http://host:port`, `socks5://host:port`; the CLI takes it
    /// from `HTTPS_PROXY` / `HTTP_PROXY` / `ALL_PROXY` as huggingface_hub does).
    pub proxy: Option<String>,
}

impl HubOptions {
    /// The Hugging Face Hub, online, with progress bars, caching in `cache_dir`.
    pub fn new(cache_dir: impl Into<PathBuf>) -> HubOptions {
        HubOptions {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            cache_dir: cache_dir.into(),
            token: None,
            offline: false,
            progress: true,
            timeout: DEFAULT_TIMEOUT,
            proxy: None,
        }
    }
}

/// Finds in the cache, or downloads into it, the config, tokenizer and safetensors weights of
/// `repo_id` (every file at one commit) and returns the snapshot directory that holds them.
pub fn fetch_model(repo_id: &str, options: &HubOptions) -> Result<PathBuf> {
    check_repo_id(repo_id).map_err(|why| Error::Download(format!("repo id `{}`: {why}", shown(repo_id))))?;
    let fetcher = Fetcher { repo: RepoCache::new(&options.cache_dir, repo_id), repo_id, options, hub: None };
    fetcher.fetch()
}

/// Whether a file is needed, or only taken when the repo has it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    Required,
    Optional,
}

struct Fetcher<'a> {
    repo: RepoCache,
    repo_id: &'a str,
    options: &'a HubOptions,
    /// The connection to the hub, made on first use (never when everything is cached).
    hub: Option<Hub<'a>>,
}

impl<'a> Fetcher<'a> {
    fn fetch(mut self) -> Result<PathBuf> {
        // Every file comes from one commit: the cached snapshot's when it has the config, else
        // the one the hub's `main` points to now.
        let cached = self.repo.cached_commit().filter(|c| self.repo.pointer(c, CONFIG).exists());
        let from_cache = cached.is_some();
        let commit = match cached {
            Some(commit) => commit,
            None => {
                if self.options.offline {
                    return Err(self.error(format!(
                        "offline, and the repo is not in the cache ({})",
                        self.options.cache_dir.display()
                    )));
                }
                let file = match self.hub()?.metadata("main", CONFIG).map_err(|f| self.fault(CONFIG, f))? {
                    Remote::File(file) => file,
                    Remote::Missing { .. } => {
                        return Err(self.error(format!(
                            "{} has no {CONFIG} for it: not a model repository",
                            self.options.endpoint.trim_end_matches('/')
                        )))
                    }
                };
                let commit = file.commit.clone();
                self.download(&file, CONFIG)?;
                self.repo.set_main(&commit).map_err(|e| self.io_error(e))?;
                commit
            }
        };
        for name in OPTIONAL_FILES {
            self.file(&commit, name, Need::Optional, from_cache)?;
        }
        match self.file(&commit, INDEX, Need::Optional, from_cache)? {
            Some(index) => {
                for shard in shard_names(&index)? {
                    self.file(&commit, &shard, Need::Required, from_cache)?;
                }
            }
            None => {
                self.file(&commit, SINGLE_FILE, Need::Required, from_cache)?;
            }
        }
        Ok(self.repo.snapshot(&commit))
    }

    /// The cached copy of `name` at `commit`, else the hub's. `None` when the repo does not have
    /// an optional file, or when it cannot be asked (offline, or unreachable while the rest
    /// came from the cache).
    fn file(&mut self, commit: &str, name: &str, need: Need, from_cache: bool) -> Result<Option<PathBuf>> {
        let pointer = self.repo.pointer(commit, name);
        if pointer.exists() {
            return Ok(Some(pointer));
        }
        let missing = |this: &Self| match need {
            Need::Optional => Ok(None),
            Need::Required => Err(this.error(format!("the repo has no {}", shown(name)))),
        };
        if self.repo.no_exist(commit, name).exists() {
            return missing(self);
        }
        if self.options.offline {
            return match need {
                Need::Optional => Ok(None),
                Need::Required => Err(self.error(format!(
                    "offline, and {} is not in the cache ({})",
                    shown(name),
                    self.options.cache_dir.display()
                ))),
            };
        }
        let remote = match self.hub()?.metadata(commit, name) {
            Ok(remote) => remote,
            // A cached model stays usable without the network; only its extras are skipped.
            Err(Fault { unreachable: true, .. }) if from_cache && need == Need::Optional => return Ok(None),
            Err(fault) => return Err(self.fault(name, fault)),
        };
        match remote {
            Remote::File(file) => {
                if file.commit != commit {
                    return Err(self.error(format!(
                        "{}: the hub answered for commit {} while the rest of the model is at {commit}",
                        shown(name),
                        file.commit
                    )));
                }
                Ok(Some(self.download(&file, name)?))
            }
            Remote::Missing { commit: said } => {
                if said.as_deref().is_none_or(|c| c == commit) {
                    // Remembered as huggingface_hub does, so later runs need not ask again.
                    self.repo.mark_missing(commit, name).map_err(|e| self.io_error(e))?;
                }
                missing(self)
            }
        }
    }

    /// Downloads `file` into its blob (unless it is there already) and links it from the
    /// snapshot as `name`.
    fn download(&mut self, file: &RemoteFile, name: &str) -> Result<PathBuf> {
        let blob = self.repo.blob(&file.etag);
        let complete =
            |blob: &Path| std::fs::metadata(blob).is_ok_and(|m| m.is_file() && m.len() == file.size);
        if !complete(&blob) {
            let lock_path = self.repo.lock(&file.etag);
            let _lock = self.lock(&lock_path, name).map_err(|e| self.io_error(e))?;
            // Another process may have written it while this one waited for the lock.
            if !complete(&blob) {
                let hub = self.hub()?;
                hub.download(file, name, &blob).map_err(|f| self.fault(name, f))?;
            }
        }
        let pointer = self.repo.pointer(&file.commit, name);
        self.repo.link(&pointer, &file.etag, name).map_err(|e| self.io_error(e))?;
        Ok(pointer)
    }

    /// Takes the blob's lock, saying so when another download holds it.
    fn lock(&self, path: &Path, name: &str) -> std::io::Result<File> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                if self.options.progress {
                    eprintln!("strix: waiting for another download of {} ({})", shown(name), path.display());
                }
                file.lock()?;
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
        Ok(file)
    }

    fn hub(&mut self) -> Result<&Hub<'a>> {
        if self.hub.is_none() {
            self.hub = Some(Hub::new(self.options, self.repo_id).map_err(|why| self.error(why))?);
        }
        Ok(self.hub.as_ref().expect("set above"))
    }

    fn error(&self, message: String) -> Error {
        Error::Download(format!("{}: {message}", self.repo_id))
    }

    fn fault(&self, name: &str, fault: Fault) -> Error {
        self.error(format!("{}: {}", shown(name), fault.message))
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        self.error(format!("writing the cache ({}): {e}", self.options.cache_dir.display()))
    }
}

/// The shards a weights index names, each checked before it can become a path.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let bad = |message: String| Error::checkpoint(index, message);
    let file = File::open(index).map_err(|e| Error::io(index, e))?;
    let mut text = String::new();
    file.take(MAX_INDEX_BYTES + 1).read_to_string(&mut text).map_err(|e| Error::io(index, e))?;
    if text.len() as u64 > MAX_INDEX_BYTES {
        return Err(bad(format!("larger than {} MiB: not a weights index", MAX_INDEX_BYTES >> 20)));
    }
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("has no weight_map object".to_string()))?;
    let mut shards = Vec::new();
    for (tensor, file) in map {
        let name =
            file.as_str().ok_or_else(|| bad(format!("weight_map[{}] is not a file name", shown(tensor))))?;
        check_file_name(name)
            .and_then(|()| {
                if name.ends_with(".safetensors") {
                    Ok(())
                } else {
                    Err("a shard must be a .safetensors file".to_string())
                }
            })
            .map_err(|why| bad(format!("shard name {} refused: {why}", shown(name))))?;
        shards.push(name.to_string());
    }
    shards.sort();
    shards.dedup();
    if shards.len() > MAX_SHARDS {
        return Err(bad(format!("names {} shards, more than the {MAX_SHARDS} accepted", shards.len())));
    }
    Ok(shards)
}

/// Checks a repo id as the hub does: `name` or `owner/name`, each part of ASCII letters,
/// digits, `-`, `_` and `.`, neither starting nor ending with `-` or `.`, without `--` or
/// `..`, at most 96 characters in all.
pub fn check_repo_id(id: &str) -> std::result::Result<(), String> {
    if id.is_empty() || id.len() > MAX_REPO_ID_LEN {
        return Err(format!("must have 1 to {MAX_REPO_ID_LEN} characters"));
    }
    let parts: Vec<&str> = id.split('/').collect();
    if parts.len() > 2 {
        return Err("must be `name` or `owner/name`".to_string());
    }
    for part in parts {
        if part.is_empty() {
            return Err("has an empty owner or name".to_string());
        }
        if let Some(c) = part.chars().find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        {
            return Err(format!("has the character {c:?} (letters, digits, -, _ and . only)"));
        }
        if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
            return Err("a part starts or ends with - or .".to_string());
        }
        if part.contains("--") || part.contains("..") {
            return Err("has -- or ..".to_string());
        }
    }
    Ok(())
}

/// Checks a file name that came from a repo before it becomes a path in the cache: relative,
/// `/`-separated parts of ASCII letters, digits, `-`, `_` and `.`, none empty or starting with
/// `.` (so no `.`, `..` or hidden parts), at most 255 bytes a part and 1024 in all.
pub fn check_file_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("it is empty".to_string());
    }
    if name.len() > MAX_FILE_NAME_LEN {
        return Err(format!("it is longer than {MAX_FILE_NAME_LEN} bytes"));
    }
    if name.starts_with('/') {
        return Err("it is an absolute path".to_string());
    }
    for part in name.split('/') {
        if part.is_empty() {
            return Err("it has an empty path segment".to_string());
        }
        if part == ".." || part == "." {
            return Err(format!("it has a `{part}` segment"));
        }
        if part.starts_with('.') {
            return Err("a segment starts with `.`".to_string());
        }
        if part.len() > MAX_FILE_NAME_PART {
            return Err(format!("a segment is longer than {MAX_FILE_NAME_PART} bytes"));
        }
        if let Some(c) = part.chars().find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        {
            return Err(format!("it has the character {c:?} (letters, digits, -, _ and . only)"));
        }
    }
    Ok(())
}

/// A commit as the hub names them: 40 lowercase hex digits.
fn check_commit(commit: &str) -> std::result::Result<(), String> {
    if commit.len() == 40 && commit.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(format!("{} is not a commit (40 lowercase hex digits)", shown(commit)))
    }
}

/// The blob name of an ETag: the quotes and weak prefix removed, as huggingface_hub does, and
/// what remains checked to be a plain name (the hub's are hex digests).
fn blob_name(etag: &str) -> std::result::Result<String, String> {
    let name = etag.trim().trim_start_matches("W/").trim_matches('"');
    let plain = name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'));
    if name.is_empty() || name.len() > MAX_ETAG_LEN || !plain {
        return Err(format!(
            "{} is not a usable ETag (1 to {MAX_ETAG_LEN} letters, digits, - or _)",
            shown(etag)
        ));
    }
    Ok(name.to_string())
}

/// `text` for a message: control characters escaped, at most 80 characters, so that nothing a
/// server or a file says can drive the terminal or flood the message.
fn shown(text: &str) -> String {
    format!("`{}`", escaped(text, 80))
}

/// At most `max` characters of `text`, control characters as escapes (`\u{1b}`, `\n`).
fn escaped(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars().take(max) {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

/// One repo's corner of the cache. Every path below is built from the checked repo id and
/// checked commits, ETags and file names.
struct RepoCache {
    /// `{cache}/models--{owner}--{name}`.
    root: PathBuf,
    /// `{cache}/.locks/models--{owner}--{name}`.
    locks: PathBuf,
}

impl RepoCache {
    fn new(cache_dir: &Path, repo_id: &str) -> RepoCache {
        let folder = format!("models--{}", repo_id.replace('/', "--"));
        RepoCache { root: cache_dir.join(&folder), locks: cache_dir.join(".locks").join(folder) }
    }

    /// The commit `refs/main` names, when it names one.
    fn cached_commit(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.root.join("refs").join("main")).ok()?;
        let commit = text.trim();
        check_commit(commit).ok().map(|()| commit.to_string())
    }

    fn set_main(&self, commit: &str) -> std::io::Result<()> {
        if self.cached_commit().as_deref() == Some(commit) {
            return Ok(());
        }
        let refs = self.root.join("refs");
        std::fs::create_dir_all(&refs)?;
        // Written whole, then renamed: a reader never sees half a commit.
        let tmp = refs.join(format!(".main.{}.tmp", std::process::id()));
        std::fs::write(&tmp, commit)?;
        std::fs::rename(&tmp, refs.join("main"))
    }

    fn snapshot(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    fn pointer(&self, commit: &str, name: &str) -> PathBuf {
        self.snapshot(commit).join(name)
    }

    fn no_exist(&self, commit: &str, name: &str) -> PathBuf {
        self.root.join(".no_exist").join(commit).join(name)
    }

    fn blob(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(etag)
    }

    fn lock(&self, etag: &str) -> PathBuf {
        self.locks.join(format!("{etag}.lock"))
    }

    fn mark_missing(&self, commit: &str, name: &str) -> std::io::Result<()> {
        let marker = self.no_exist(commit, name);
        if let Some(dir) = marker.parent() {
            std::fs::create_dir_all(dir)?;
        }
        File::create(marker).map(drop)
    }

    /// Points `pointer` (`snapshots/{commit}/{name}`) at the blob, by a relative symlink as
    /// huggingface_hub makes it (a copy where symlinks are not available).
    fn link(&self, pointer: &Path, etag: &str, name: &str) -> std::io::Result<()> {
        if let Some(dir) = pointer.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // From the pointer's folder up to the repo folder: the commit's and `snapshots`, plus
        // one per folder inside the name.
        let up = 2 + name.matches('/').count();
        let target: PathBuf = std::iter::repeat_n("..", up).chain(["blobs", etag]).collect::<PathBuf>();
        if std::fs::symlink_metadata(pointer).is_ok() {
            std::fs::remove_file(pointer)?;
        }
        #[cfg(unix)]
        let linked = std::os::unix::fs::symlink(&target, pointer);
        #[cfg(not(unix))]
        let linked = std::fs::copy(self.blob(etag), pointer).map(drop);
        match linked {
            // Another process linked the same file meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            other => other,
        }
    }
}

/// What the hub says about a file at a revision.
enum Remote {
    File(RemoteFile),
    /// The repo has no such file (at `commit`, when the hub said which).
    Missing {
        commit: Option<String>,
    },
}

/// A file the hub has: the commit it answered for, the blob name, the size, and where the
/// bytes are (the hub itself, or the CDN it redirects to).
struct RemoteFile {
    commit: String,
    etag: String,
    size: u64,
    url: Url,
}

/// Why the hub could not be used: `unreachable` when no answer came at all.
struct Fault {
    message: String,
    unreachable: bool,
}

impl Fault {
    fn refused(message: String) -> Fault {
        Fault { message, unreachable: false }
    }
}

/// The HTTP side: metadata requests to the endpoint and blob downloads.
struct Hub<'a> {
    options: &'a HubOptions,
    endpoint: Url,
    repo_id: &'a str,
    metadata_agent: ureq::Agent,
    download_agent: ureq::Agent,
}

impl<'a> Hub<'a> {
    fn new(options: &'a HubOptions, repo_id: &'a str) -> std::result::Result<Hub<'a>, String> {
        let endpoint = Url::parse(options.endpoint.trim_end_matches('/'))
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .filter(|u| u.query().is_none() && u.fragment().is_none())
            .ok_or_else(|| format!("endpoint {} is not an http(s) URL", shown(&options.endpoint)))?;
        let proxy = match &options.proxy {
            Some(p) => Some(ureq::Proxy::new(p).map_err(|e| format!("proxy {}: {e}", shown(p)))?),
            None => None,
        };
        // Never from an https hub to plain http; downloads follow a few redirects (to a CDN, and
        // on), metadata requests look at theirs. The proxy is the options', never the
        // client's own reading of the environment.
        let agent = |redirects: usize| {
            let builder = ureq::AgentBuilder::new().try_proxy_from_env(false);
            let builder = match &proxy {
                Some(p) => builder.proxy(p.clone()),
                None => builder,
            };
            builder
                .timeout_connect(options.timeout)
                .timeout_read(options.timeout)
                .timeout_write(options.timeout)
                .redirects(redirects as u32)
                .https_only(endpoint.scheme() == "https")
                .user_agent(concat!("strix/", env!("CARGO_PKG_VERSION")))
                .build()
        };
        let metadata_agent = agent(0);
        let download_agent = agent(MAX_REDIRECTS);
        Ok(Hub { options, endpoint, repo_id, metadata_agent, download_agent })
    }

    /// `{endpoint}/{repo}/resolve/{revision}/{name}`: every piece is checked, none needs escaping.
    fn resolve_url(&self, revision: &str, name: &str) -> std::result::Result<Url, Fault> {
        let text = format!(
            "{}/{}/resolve/{revision}/{name}",
            self.endpoint.as_str().trim_end_matches('/'),
            self.repo_id
        );
        Url::parse(&text).map_err(|e| Fault::refused(format!("bad URL {text}: {e}")))
    }

    /// A request with the headers every request carries; the token only to the endpoint.
    fn request(&self, agent: &ureq::Agent, method: &str, url: &Url) -> ureq::Request {
        let request = agent.request_url(method, url).set("Accept-Encoding", "identity");
        match &self.options.token {
            Some(token) if same_origin(url, &self.endpoint) => {
                request.set("Authorization", &format!("Bearer {token}"))
            }
            _ => request,
        }
    }

    /// The commit, blob name, size and location of `name` at `revision`, from a HEAD request
    /// as huggingface_hub makes it: relative redirects (renamed repos) are followed, an
    /// absolute one is where the bytes are.
    fn metadata(&self, revision: &str, name: &str) -> std::result::Result<Remote, Fault> {
        let mut url = self.resolve_url(revision, name)?;
        for _ in 0..=MAX_REDIRECTS {
            let response = match self.request(&self.metadata_agent, "HEAD", &url).call() {
                Ok(r) => r,
                Err(ureq::Error::Status(status, response)) => return self.refused(status, &response),
                Err(e) => return Err(unreachable(&self.options.endpoint, e)),
            };
            if !(300..400).contains(&response.status()) {
                return self.described(&response, url).map(Remote::File);
            }
            let location = response.header("Location").ok_or_else(|| {
                Fault::refused(format!("redirect {} without a Location", response.status()))
            })?;
            let target = checked_location(&url, location)?;
            if Url::parse(location).is_ok() {
                // An absolute redirect: the bytes are there (a CDN); this answer describes them.
                return self.described(&response, target).map(Remote::File);
            }
            url = target;
        }
        Err(Fault::refused(format!("more than {MAX_REDIRECTS} redirects")))
    }

    /// The file a metadata answer describes.
    fn described(&self, response: &ureq::Response, url: Url) -> std::result::Result<RemoteFile, Fault> {
        let header = |name: &str| response.header(name).map(str::trim).filter(|v| !v.is_empty());
        let commit = header("X-Repo-Commit").ok_or_else(|| {
            Fault::refused(format!(
                "the answer of {} has no X-Repo-Commit header: is it a Hugging Face hub?",
                self.options.endpoint.trim_end_matches('/')
            ))
        })?;
        check_commit(commit).map_err(|why| Fault::refused(format!("X-Repo-Commit {why}")))?;
        let etag = header("X-Linked-Etag")
            .or_else(|| header("ETag"))
            .ok_or_else(|| Fault::refused("the answer has no ETag".to_string()))?;
        let etag = blob_name(etag).map_err(Fault::refused)?;
        let size = header("X-Linked-Size").or_else(|| header("Content-Length")).ok_or_else(|| {
            Fault::refused("the answer gives no size (X-Linked-Size or Content-Length)".to_string())
        })?;
        let size = size
            .parse::<u64>()
            .map_err(|_| Fault::refused(format!("size {} is not a number of bytes", shown(size))))?;
        Ok(RemoteFile { commit: commit.to_string(), etag, size, url })
    }

    /// An error status: a missing file is an answer, the rest are faults named for the user.
    fn refused(&self, status: u16, response: &ureq::Response) -> std::result::Result<Remote, Fault> {
        let code = response.header("X-Error-Code").unwrap_or("");
        let said = response.header("X-Error-Message").map(|m| format!(" ({})", shown(m))).unwrap_or_default();
        let endpoint = self.options.endpoint.trim_end_matches('/');
        let message = match (status, code) {
            (404, "EntryNotFound") | (404, "") => {
                let commit = response.header("X-Repo-Commit").filter(|c| check_commit(c).is_ok());
                return Ok(Remote::Missing { commit: commit.map(String::from) });
            }
            (_, "RepoNotFound") | (401, _) => format!(
                "{endpoint} has no repo {} it will show (a private or gated repo needs HF_TOKEN){said}",
                self.repo_id
            ),
            (_, "GatedRepo") => {
                format!("the repo is gated: accept its terms on {endpoint} and set HF_TOKEN{said}")
            }
            (_, "RevisionNotFound") => format!("the revision is not on {endpoint}{said}"),
            (403, _) => format!("{endpoint} refused access (HTTP 403){said}"),
            _ => format!("{endpoint} answered HTTP {status}{said}"),
        };
        Err(Fault::refused(message))
    }

    /// Streams the file into `blobs/{etag}.incomplete` (resuming what an interrupted download
    /// left there) and renames it to `blob` once it holds exactly `file.size` bytes.
    fn download(&self, file: &RemoteFile, name: &str, blob: &Path) -> std::result::Result<(), Fault> {
        let io = |what: &str, e: std::io::Error| Fault::refused(format!("{what} {}: {e}", blob.display()));
        let partial = blob.with_file_name(format!("{}.incomplete", file.etag));
        if let Some(dir) = blob.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io("creating the folder of", e))?;
        }
        let mut out = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&partial)
            .map_err(|e| io("opening", e))?;
        let mut start = out.metadata().map_err(|e| io("reading", e))?.len();
        if start > file.size {
            start = 0;
        }
        let mut request = self.request(&self.download_agent, "GET", &file.url);
        if start > 0 {
            request = request.set("Range", &format!("bytes={start}-"));
        }
        let response = match request.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(status, r)) => {
                let said =
                    r.header("X-Error-Message").map(|m| format!(" ({})", shown(m))).unwrap_or_default();
                return Err(Fault::refused(format!("the download answered HTTP {status}{said}")));
            }
            Err(e) => return Err(unreachable(&self.options.endpoint, e)),
        };
        match response.status() {
            // The server sent the whole file: whatever was kept is written over.
            200 => start = 0,
            206 if content_range_start(&response) == Some(start) => {}
            206 => return Err(Fault::refused("a partial answer for the wrong range".to_string())),
            status => return Err(Fault::refused(format!("the download answered HTTP {status}"))),
        }
        out.set_len(start).map_err(|e| io("truncating", e))?;
        out.seek(SeekFrom::Start(start)).map_err(|e| io("seeking in", e))?;

        let bar = self.progress_bar(name, file.size, start);
        // One byte past the announced size is enough to tell a body that is too long.
        let mut body = response.into_reader().take(file.size - start + 1);
        let mut buffer = vec![0u8; 1 << 16];
        let mut written = start;
        let ended = loop {
            match body.read(&mut buffer) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    out.write_all(&buffer[..n]).map_err(|e| io("writing", e))?;
                    written += n as u64;
                    bar.set_position(written.min(file.size));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        bar.finish();
        if written > file.size {
            drop(out);
            let _ = std::fs::remove_file(&partial);
            return Err(Fault::refused(format!(
                "the download is longer than the {} bytes announced",
                file.size
            )));
        }
        if let Err(e) = ended {
            return Err(Fault {
                message: format!(
                    "the download stopped after {written} of {} bytes ({e}); run again to resume it",
                    file.size
                ),
                unreachable: false,
            });
        }
        if written < file.size {
            return Err(Fault::refused(format!(
                "the download ended after {written} of {} bytes; run again to resume it",
                file.size
            )));
        }
        out.sync_all().map_err(|e| io("syncing", e))?;
        drop(out);
        std::fs::rename(&partial, blob).map_err(|e| io("renaming into place", e))
    }

    fn progress_bar(&self, name: &str, size: u64, position: u64) -> ProgressBar {
        if !self.options.progress {
            return ProgressBar::hidden();
        }
        let style = ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        let message = match name.char_indices().rev().nth(29) {
            Some((i, _)) => format!("..{}", &name[i..]),
            None => name.to_string(),
        };
        ProgressBar::new(size).with_style(style).with_message(message).with_position(position)
    }
}

/// Where a redirect points, resolved against the URL it answered; http(s) only.
fn checked_location(from: &Url, location: &str) -> std::result::Result<Url, Fault> {
    from.join(location)
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
        .ok_or_else(|| Fault::refused(format!("redirect to {}, not an http(s) URL", shown(location))))
}

/// The first byte of a `206 Partial Content` answer (`Content-Range: bytes START-END/SIZE`).
fn content_range_start(response: &ureq::Response) -> Option<u64> {
    let range = response.header("Content-Range")?.trim().strip_prefix("bytes ")?;
    range.split('-').next()?.trim().parse().ok()
}

fn same_origin(a: &Url, b: &Url) -> bool {
    a.scheme() == b.scheme()
        && a.host_str() == b.host_str()
        && a.port_or_known_default() == b.port_or_known_default()
}

/// A request that got no HTTP answer (refused connection, DNS, TLS, timeout).
fn unreachable(endpoint: &str, e: ureq::Error) -> Fault {
    let cause = escaped(&e.to_string(), 300);
    Fault {
        message: format!("no answer from {} ({cause})", endpoint.trim_end_matches('/')),
        unreachable: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_that_could_leave_the_snapshot_are_refused() {
        for ok in ["model.safetensors", "model-00001-of-00002.safetensors", "sub/dir/w_1.safetensors"] {
            assert_eq!(check_file_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "../x.safetensors",
            "a/../../x",
            "/etc/passwd",
            "a//b",
            "a/",
            "./a",
            ".hidden",
            "a\\..\\b",
            "C:x",
            "a b",
            "a\nb",
            "é.safetensors",
            &"a".repeat(256),
            &["a"; 600].join("/"),
        ] {
            assert!(check_file_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn repo_ids_follow_the_hubs_rules() {
        for ok in ["Qwen/Qwen3.5-0.8B", "gpt2", "a_b/c.d"] {
            assert_eq!(check_repo_id(ok), Ok(()), "{ok}");
        }
        for bad in ["", "a/b/c", "../x", "a/..", "a--b/c", "-a/b", "a./b", "a/b c", &"a".repeat(97), "a/"] {
            assert!(check_repo_id(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn etags_become_plain_blob_names_or_are_refused() {
        assert_eq!(blob_name("\"0123abcd\"").unwrap(), "0123abcd");
        assert_eq!(blob_name("W/\"abc-1\"").unwrap(), "abc-1");
        for bad in ["", "\"\"", "../../x", "/tmp/x", "a.b", "a/b", "a\\b", &"f".repeat(129)] {
            assert!(blob_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_commit(&"a".repeat(40)).is_ok());
        for bad in ["main", "../../x", &"A".repeat(40), &"a".repeat(41)] {
            assert!(check_commit(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn messages_show_hostile_text_escaped_and_short() {
        assert_eq!(shown("a\u{1b}[2Jb"), "`a\\u{1b}[2Jb`");
        assert_eq!(shown("it's\n"), "`it's\\n`");
        let long = shown(&"x".repeat(1000));
        assert!(long.len() < 100 && long.ends_with("…`"), "{long}");
    }
}
