//! `strix serve`: the OpenAI-compatible HTTP server (crate `strix-server`) on the backend
//! `--device` picks, configured from the command line.

use anyhow::{bail, Context, Result};
use clap::Args;
use strix::chat::ChatTemplate;
use strix::model::ModelFiles;
use strix::sampling::SamplingParams;
use strix::tokenizer::Tokenizer;
use strix_server::{ConnectionLimits, ServedModel, Server, ServerConfig};

use crate::common::{self, ModelArgs};
use crate::device::{self, with_backend};
use crate::limits;

#[derive(Args, Debug)]
#[command(after_help = "Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health, GET /metrics (Prometheus), GET / (a chat page). Request bodies must be sent as
Content-Type: application/json.
Example: curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"stream\": true}'")]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0: any free port, printed at start)
    #[arg(long, default_value_t = 8080)]
    pub port: u16,

    /// Require `Authorization: Bearer KEY` on every /v1 route
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,

    /// The model id reported by /v1/models [default: the model directory's name]
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,

    /// Tokens per sequence, prompt and completion together [default: 4096, at most the
    /// model's max_position_embeddings]
    #[arg(short = 'c', long, visible_alias = "ctx-size", value_name = "N", value_parser = limits::tokens)]
    pub ctx: Option<usize>,

    /// Sequences decoded together at most
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = limits::serve_seqs)]
    pub max_seqs: usize,

    /// Requests that may wait beyond a full batch; more are refused with 429
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = limits::serve_queue)]
    pub max_queue: usize,

    /// Memory the running sequences may reserve for KV cache and DeltaNet state, in MiB
    /// (each reserves its prompt plus max_tokens)
    #[arg(long, value_name = "MIB", default_value_t = 4096, value_parser = limits::budget_mib)]
    pub state_budget_mib: u64,

    /// Prompt tokens prefilled per scheduler step, between decode steps (rounded up to whole
    /// passes; the pass is this rounded up to a multiple of 64 unless --ubatch sets it, so a
    /// long prompt does not hold up the running streams for a whole 4096-token pass)
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = limits::tokens)]
    pub prefill_chunk: usize,

    /// Memory the prefix cache may hold, in MiB, apart from --state-budget-mib: copies of the
    /// KV rows and DeltaNet states at each prefill pass boundary (every --prefill-chunk
    /// tokens), so a request whose prompt starts like an earlier one resumes there. 0 turns it
    /// off
    #[arg(long, value_name = "MIB", default_value_t = strix_server::DEFAULT_PREFIX_CACHE_MIB, value_parser = limits::budget_mib_or_off)]
    pub prefix_cache_mib: u64,

    /// No prefix cache: every request prefills its whole prompt (same as --prefix-cache-mib 0)
    #[arg(long)]
    pub no_prefix_cache: bool,

    /// Largest request body accepted, in bytes
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20, value_parser = limits::body_bytes)]
    pub max_body: usize,

    /// Host names served besides localhost, 127.0.0.1 and [::1], comma-separated (`*`: any).
    /// Bound to a loopback address the server answers only loopback names (so a web page
    /// cannot reach it through DNS rebinding); bound elsewhere, any name unless this lists them
    #[arg(long, value_name = "HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,

    /// An origin whose web pages may call the API (CORS), as scheme://host[:port]; repeatable,
    /// `*` for any. Without it only the server's own page (/) may
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,

    /// Seconds a client has to send a request's line and headers, from their first byte
    #[arg(long, value_name = "SECS", default_value_t = ConnectionLimits::default().header_timeout.as_secs(), value_parser = limits::seconds)]
    pub header_timeout: u64,

    /// Seconds a client has to send a request's body, once its headers are in
    #[arg(long, value_name = "SECS", default_value_t = ConnectionLimits::default().body_timeout.as_secs(), value_parser = limits::seconds)]
    pub body_timeout: u64,

    /// Seconds a connection may stay open with no request (keep-alive). Requests in flight and
    /// streamed answers are never timed out
    #[arg(long, value_name = "SECS", default_value_t = ConnectionLimits::default().idle_timeout.as_secs(), value_parser = limits::seconds)]
    pub idle_timeout: u64,

    /// Connections open at once (lowered to fit the open-file limit). Beyond it a new
    /// connection closes the oldest one without a request in flight; when every one has a
    /// request in flight it is refused with 503
    #[arg(long, value_name = "N", default_value_t = ConnectionLimits::default().max_connections, value_parser = limits::connections)]
    pub max_connections: usize,
}

pub fn serve(args: ServeArgs) -> Result<()> {
    common::init_threads(args.model.threads)?;
    // The server's options are checked before the model loads, which can take minutes.
    let mut options = ServerConfig::new("", 2);
    configure(&args, &mut options);
    options.validate().map_err(anyhow::Error::msg)?;
    // Every connection is an open file: the soft limit (often 1024) would cap them early.
    strix_server::connection::raise_open_file_limit();
    let files = common::resolve_model(args.model.model.as_deref())?;
    let side = ServedSide::read(&files)?;
    let opened = device::open(&args.model.device, false)?;
    with_backend!(opened, backend => {
        let mut model = crate::quant_flag::load_model(files, backend, args.model.quant.quant)?;
        if args.model.device.ubatch.is_none() {
            model.set_pass_tokens(serve_pass_tokens(args.prefill_chunk))?;
        }
        args.model.device.configure(&mut model)?;
        serve_with(&args, side, model)
    })
}

/// The listening, admission and connection options of `args`.
fn configure(args: &ServeArgs, config: &mut ServerConfig) {
    config.host = args.host.clone();
    config.port = args.port;
    config.api_key = args.api_key.clone();
    config.max_body = args.max_body;
    config.allowed_hosts = args.allowed_hosts.clone();
    config.cors_origins = args.cors_origin.clone();
    config.connections = ConnectionLimits {
        header_timeout: std::time::Duration::from_secs(args.header_timeout),
        body_timeout: std::time::Duration::from_secs(args.body_timeout),
        idle_timeout: std::time::Duration::from_secs(args.idle_timeout),
        max_connections: args.max_connections,
    };
}

/// The server's pass length without --ubatch: the prefill chunk rounded up to the delta rule's
/// chunk, so a scheduler step prefills about --prefill-chunk tokens, as documented.
fn serve_pass_tokens(prefill_chunk: usize) -> usize {
    prefill_chunk.max(1).next_multiple_of(strix::model::PASS_TOKENS_ALIGN)
}

/// What the server needs beside the weights, read before they load: a model directory's side
/// files are read by `ServedModel::with_model`; a GGUF file's come from its one opening.
struct ServedSide {
    path: std::path::PathBuf,
    gguf: Option<GgufSide>,
}

/// A GGUF file carries its tokenizer and chat template (unless files beside it override them),
/// and the sampling defaults come from the folder it is in.
struct GgufSide {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    defaults: SamplingParams,
}

impl ServedSide {
    fn read(files: &ModelFiles) -> Result<ServedSide> {
        let path = files.path().to_path_buf();
        if files.gguf().is_none() {
            return Ok(ServedSide { path, gguf: None });
        }
        let tokenizer = common::load_tokenizer(files)?
            .ok_or_else(|| anyhow::anyhow!("{} has no tokenizer; the server needs one", path.display()))?;
        let template = common::require_template(files).ok();
        let defaults = strix_server::sampling_defaults(files.side_dir())?;
        Ok(ServedSide { path, gguf: Some(GgufSide { tokenizer, template, defaults }) })
    }
}

/// Starts the server on whichever backend the model was loaded on and waits for it to stop.
fn serve_with<B: strix::backend::Backend + 'static>(
    args: &ServeArgs,
    side: ServedSide,
    model: strix::model::Model<B>,
) -> Result<()> {
    let context = common::context_size(args.ctx, 0, model.config.max_position_embeddings)?;
    if context < 2 {
        bail!("--ctx must be at least 2 (a prompt token and a generated one)");
    }
    let dir = side.path;
    let served = match side.gguf {
        Some(GgufSide { tokenizer, template, defaults }) => {
            ServedModel { model, tokenizer, template, defaults }
        }
        None => ServedModel::with_model(&dir, model)?,
    };
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        args.model
            .model
            .clone()
            .filter(|m| !std::path::Path::new(m).is_dir())
            .or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "strix".into())
    });

    let mut config = ServerConfig::new(name.clone(), context);
    configure(args, &mut config);
    config.engine.max_seqs = args.max_seqs;
    config.engine.max_queue = args.max_queue;
    config.engine.state_budget_bytes = args.state_budget_mib.saturating_mul(1 << 20);
    config.engine.prefill_chunk = args.prefill_chunk;
    config.engine.prefix_cache_bytes =
        if args.no_prefix_cache { 0 } else { args.prefix_cache_mib.saturating_mul(1 << 20) };

    let server = Server::start_with(served, config, true)
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    eprintln!(
        "strix serve: {name} on http://{} (context {context}, up to {} sequences, {} connections{})",
        server.addr(),
        args.max_seqs,
        server.max_connections(),
        if args.api_key.is_some() { ", API key required" } else { "" }
    );
    if server.max_connections() < args.max_connections {
        eprintln!(
            "strix serve: --max-connections lowered to {} to fit the open-file limit ({}); raise it with ulimit -n",
            server.max_connections(),
            strix_server::connection::open_file_limit().unwrap_or(0)
        );
    }
    server.wait();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::serve_pass_tokens;

    #[test]
    fn the_server_pass_follows_the_prefill_chunk() {
        assert_eq!(serve_pass_tokens(512), 512);
        assert_eq!(serve_pass_tokens(600), 640);
        assert_eq!(serve_pass_tokens(1), 64);
        assert_eq!(serve_pass_tokens(0), 64);
        assert_eq!(serve_pass_tokens(4096), 4096);
    }
}
