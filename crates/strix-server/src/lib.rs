//! strix-server: an OpenAI-compatible HTTP server for strix models, with continuous batching.
//!
//! - [`engine`]: the scheduler thread that owns the model and batches every running
//!   sequence into one decode step; [`prefix_cache`]: the blocks of earlier prompts' state it
//!   resumes new requests from;
//! - [`api`]: the axum routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//!   `/health`, `/metrics`), authentication, and OpenAI response and SSE chunk shapes;
//! - [`request`]: request decoding and validation; [`output`]: splitting the output into
//!   reasoning, content and tool calls; [`metrics`]: the Prometheus counters;
//!   [`error`]: the OpenAI error body;
//! - [`connection`]: the accept loop on hyper, with its timeouts and connection cap, and
//!   [`wire`], what it watches on each connection; [`guard`]: the `Host`, `Origin` (CORS)
//!   and content-type checks that keep browser pages from driving the server.
//!
//! [`Server::start`] runs it all in the background (tests start one on port 0);
//! `strix serve` is the command-line front end.

pub mod api;
pub mod connection;
pub mod engine;
pub mod error;
pub mod guard;
pub mod ids;
pub mod metrics;
pub mod output;
pub mod prefix_cache;
pub mod request;
pub mod wire;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use strix::backend::Backend;
use strix::chat::ChatTemplate;
use strix::model::Model;
use strix::sampling::SamplingParams;
use strix::tokenizer::Tokenizer;
use tokio::sync::oneshot;

pub use connection::ConnectionLimits;
pub use engine::EngineConfig;

/// The prefix cache's default budget in MiB (`strix serve --prefix-cache-mib`).
pub const DEFAULT_PREFIX_CACHE_MIB: u64 = 2048;
pub use error::ApiError;
pub use guard::BrowserPolicy;

/// How the server listens and what it admits.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port ([`Server::addr`] tells which).
    pub port: u16,
    /// When set, every `/v1` route requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// The model id reported by `/v1/models` and in responses.
    pub model_name: String,
    /// Largest request body accepted, in bytes.
    pub max_body: usize,
    /// Timeouts and the connection cap.
    pub connections: ConnectionLimits,
    /// `Host` names served besides loopback ones (`*`: any). Bound to a loopback address
    /// only loopback names are served without them; bound elsewhere, any name.
    pub allowed_hosts: Vec<String>,
    /// Origins whose pages may call the API from a browser (CORS; `*`: any).
    pub cors_origins: Vec<String>,
    pub engine: EngineConfig,
}

impl ServerConfig {
    /// Loopback only, port 8080, no key, 64 sequences, 256 waiting, a 4 GiB state budget, a
    /// prefix cache of [`DEFAULT_PREFIX_CACHE_MIB`].
    pub fn new(model_name: impl Into<String>, context: usize) -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            model_name: model_name.into(),
            max_body: 4 << 20,
            connections: ConnectionLimits::default(),
            allowed_hosts: Vec::new(),
            cors_origins: Vec::new(),
            engine: EngineConfig {
                max_seqs: 64,
                max_queue: 256,
                state_budget_bytes: 4 << 30,
                context,
                prefill_chunk: strix::model::DEFAULT_PASS_TOKENS,
                prefix_cache_bytes: DEFAULT_PREFIX_CACHE_MIB << 20,
            },
        }
    }

    /// Checks what can be checked before a model is loaded: the API key, the host and origin
    /// lists, the connection limits. The error names the option at fault.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(key) = &self.api_key {
            check_api_key(key)?;
        }
        self.browser_policy()?;
        self.connections.validate()
    }

    fn browser_policy(&self) -> Result<BrowserPolicy, String> {
        BrowserPolicy::new(&self.host, &self.allowed_hosts, &self.cors_origins)
    }
}

/// An API key a client can send: not empty, and only characters an `Authorization` header
/// carries unchanged (printable ASCII; no space at either end, which HTTP strips).
pub fn check_api_key(key: &str) -> Result<(), String> {
    if key.trim().is_empty() {
        return Err("--api-key is empty: give a key, or leave the option out to serve without one".into());
    }
    if key.trim() != key {
        return Err("--api-key starts or ends with whitespace, which no client can send".into());
    }
    if !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err("--api-key must be printable ASCII (an HTTP header cannot carry it otherwise)".into());
    }
    Ok(())
}

/// What the server serves: the model and the text side of the checkpoint.
pub struct ServedModel<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    /// `None`: only `/v1/completions` works.
    pub template: Option<ChatTemplate>,
    /// Sampling defaults (the checkpoint's `generation_config.json`), overridden per request.
    pub defaults: SamplingParams,
}

impl<B: Backend> ServedModel<B> {
    /// Loads a model directory: weights, `tokenizer.json` (required), the chat template and
    /// the sampling defaults.
    pub fn load(dir: &Path, backend: B) -> strix::Result<Self> {
        let model = Model::load(dir, backend, None)?;
        Self::with_model(dir, model)
    }

    /// Reads the text side of a model directory for an already loaded model.
    pub fn with_model(dir: &Path, model: Model<B>) -> strix::Result<Self> {
        let tokenizer = Tokenizer::from_model_dir(dir)?.ok_or_else(|| {
            strix::Error::Tokenizer(format!("{} has no tokenizer.json; the server needs one", dir.display()))
        })?;
        let template = ChatTemplate::from_model_dir(dir)?;
        let defaults = sampling_defaults(dir)?;
        Ok(ServedModel { model, tokenizer, template, defaults })
    }
}

/// The sampling fields of `generation_config.json`, over OpenAI's defaults (temperature 1,
/// nothing else). A checkpoint with `do_sample: false` defaults to greedy. No file means
/// those defaults; a file that cannot be read as JSON (not a regular file, over the JSON cap,
/// malformed) is an error naming it, so a broken checkpoint does not serve with made-up
/// defaults.
pub fn sampling_defaults(dir: &Path) -> strix::Result<SamplingParams> {
    let p = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let path = dir.join("generation_config.json");
    if path.symlink_metadata().is_err() {
        return Ok(p);
    }
    let config = strix::files::read_json(&path)?;
    Ok(defaults_from(&config, p))
}

/// [`sampling_defaults`] from the parsed file.
fn defaults_from(config: &serde_json::Value, mut p: SamplingParams) -> SamplingParams {
    let number = |key: &str| config.get(key).and_then(serde_json::Value::as_f64);
    if let Some(t) = number("temperature") {
        p.temperature = t as f32;
    }
    if let Some(v) = number("top_p") {
        p.top_p = v as f32;
    }
    if let Some(v) = config.get("top_k").and_then(serde_json::Value::as_u64) {
        p.top_k = v as usize;
    }
    if let Some(v) = number("min_p") {
        p.min_p = v as f32;
    }
    if let Some(v) = number("repetition_penalty") {
        p.repetition_penalty = v as f32;
    }
    if config.get("do_sample").and_then(serde_json::Value::as_bool) == Some(false) {
        p.temperature = 0.0;
    }
    // Checkpoint files are not trusted to hold sane values; an invalid one falls back.
    if p.validate().is_err() {
        return SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    }
    p
}

/// A running server: the HTTP listener on its own runtime thread, the engine on another.
/// Dropping it shuts both down.
pub struct Server {
    addr: SocketAddr,
    max_connections: usize,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Ctrl-C (SIGINT), listened for from the moment it is installed.
struct Interrupt {
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Interrupt {
    /// Installs the handler now; needs the runtime's context.
    fn install() -> std::io::Result<Interrupt> {
        #[cfg(unix)]
        {
            Ok(Interrupt {
                signal: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(Interrupt {})
        }
    }

    /// Waits for the next Ctrl-C.
    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            self.signal.recv().await;
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// How long open connections (streams) get to finish after a shutdown is asked for.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

impl Server {
    /// Binds `config.host:config.port` and starts serving. Errors: the configuration is
    /// invalid ([`ServerConfig::validate`]), the open-file limit leaves no room for
    /// connections, the address cannot be bound, or a thread cannot be started.
    pub fn start<B: Backend + 'static>(
        served: ServedModel<B>,
        config: ServerConfig,
    ) -> std::io::Result<Server> {
        Self::start_with(served, config, false)
    }

    /// [`Server::start`], also shutting down on Ctrl-C (for the command line).
    pub fn start_with<B: Backend + 'static>(
        served: ServedModel<B>,
        config: ServerConfig,
        ctrl_c: bool,
    ) -> std::io::Result<Server> {
        let invalid = |message: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, message);
        config.validate().map_err(invalid)?;
        let policy = Arc::new(config.browser_policy().map_err(invalid)?);
        let limits = config.connections.clone();
        let file_limit = connection::open_file_limit();
        let max_connections = connection::connection_cap(limits.max_connections, file_limit);
        if max_connections == 0 {
            return Err(invalid(format!(
                "the open-file limit ({}) leaves no room for connections; raise it (ulimit -n)",
                file_limit.unwrap_or(0)
            )));
        }
        let listener = connection::bind(&config.host, config.port)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;

        let metrics = Arc::new(metrics::Metrics::default());
        let ServedModel { model, tokenizer, template, defaults } = served;
        // Built once: llguidance's index of the vocabulary, shared by every request's grammar.
        let constraints = strix::constraint::Constraints::new(
            &tokenizer,
            model.config.vocab_size,
            &model.config.eos_token_ids,
        )
        .map_err(|e| e.to_string());
        let (engine, engine_thread) =
            engine::EngineHandle::start(model, tokenizer.clone(), config.engine.clone(), metrics.clone())?;
        let state = Arc::new(api::AppState {
            engine,
            tokenizer,
            template: template.map(Arc::new),
            defaults,
            metrics,
            model_name: config.model_name.clone(),
            api_key: config.api_key.clone(),
            max_body: config.max_body,
            created: api::unix_time(),
            prompt_gate: api::PromptGate::per_core(
                config.engine.max_seqs.saturating_add(config.engine.max_queue),
            ),
            constraints,
        });

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("strix-http")
            .enable_all()
            .build()?;
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("strix-server".into()).spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(e) => {
                        eprintln!("strix serve: cannot listen: {e}");
                        return;
                    }
                };
                // The Ctrl-C handler goes in before the first request can be answered: installed
                // lazily (on the select's first poll) it raced the server, and an interrupt sent
                // right after startup killed the process instead of shutting it down.
                let interrupt = if ctrl_c {
                    match Interrupt::install() {
                        Ok(interrupt) => Some(interrupt),
                        Err(e) => {
                            eprintln!("strix serve: cannot listen for Ctrl-C: {e}");
                            return;
                        }
                    }
                } else {
                    None
                };
                let app = api::router(state, policy);
                let (stop_tx, stop_rx) = oneshot::channel::<()>();
                let server = tokio::spawn(connection::serve(listener, app, limits, max_connections, stop_rx));
                if let Some(mut interrupt) = interrupt {
                    tokio::select! {
                        _ = shutdown_rx => {}
                        _ = interrupt.recv() => eprintln!("strix serve: shutting down"),
                    }
                } else {
                    let _ = shutdown_rx.await;
                }
                let _ = stop_tx.send(());
                let _ = tokio::time::timeout(SHUTDOWN_GRACE, server).await;
            });
            // Dropping the runtime drops every connection and with them the engine's handles
            // and event receivers: the engine cancels what is left and stops.
            drop(runtime);
            let _ = engine_thread.join();
        })?;
        Ok(Server { addr, max_connections, shutdown: Some(shutdown), thread: Some(thread) })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections served at once: `--max-connections`, lowered to fit the open-file limit.
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Blocks until the server stops (Ctrl-C, with [`Server::start_with`]).
    pub fn wait(mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults_of(json: &str) -> strix::Result<SamplingParams> {
        let dir = tempdir();
        std::fs::write(dir.join("generation_config.json"), json).unwrap();
        let p = sampling_defaults(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        p
    }

    fn tempdir() -> std::path::PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("strix-defaults-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn sampling_defaults_come_from_generation_config() {
        let p =
            defaults_of(r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20}"#).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.6, 0.95, 20));
        assert_eq!(defaults_of(r#"{"do_sample": false, "temperature": 0.6}"#).unwrap().temperature, 0.0);
        // OpenAI's defaults when the file says nothing, or nothing sane, or is absent.
        assert_eq!(defaults_of("{}").unwrap().temperature, 1.0);
        assert_eq!(
            defaults_of(r#"{"top_p": 7}"#).unwrap(),
            SamplingParams { temperature: 1.0, ..SamplingParams::default() }
        );
        assert_eq!(sampling_defaults(Path::new("/nonexistent")).unwrap().temperature, 1.0);
    }

    /// A file that cannot be read as JSON is an error naming it, never a hang (a FIFO) or
    /// silently made-up defaults.
    #[test]
    fn a_broken_generation_config_is_an_error_naming_it() {
        let e = defaults_of("{not json").unwrap_err().to_string();
        assert!(e.contains("generation_config.json"), "{e}");
        #[cfg(unix)]
        {
            let dir = tempdir();
            let fifo = dir.join("generation_config.json");
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: a valid C string; mkfifo only creates the node.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            let e = sampling_defaults(&dir).unwrap_err().to_string();
            let _ = std::fs::remove_dir_all(&dir);
            assert!(e.contains("generation_config.json"), "{e}");
        }
    }
}
