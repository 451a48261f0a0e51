//! `strix bench-serve`: a serving benchmark. It drives a running OpenAI-compatible server
//! (`strix serve`, llama-server, vLLM, ...) with `--clients` concurrent streaming clients and
//! `--requests` requests in all, and reports what vLLM's `benchmark_serving` and llama.cpp's
//! server bench report: requests/s, output and prompt tok/s over the measured wall time, time
//! to first token (ttft), inter-token latency (itl: every gap between successive streamed
//! tokens of a request), time per output token (tpot) and end-to-end latency at p50 / p90 /
//! p99. One JSON object on stdout, a table of the same figures on stderr, as `strix bench`.
//!
//! Clients are closed-loop: each is a thread with its own kept-alive HTTP connection (a `ureq`
//! agent) that sends its next request as soon as its last one has ended, so at most
//! `--clients` requests are in flight. A blocking read per client stamps every event the moment
//! it arrives, with no async scheduler between the socket and the clock. Connections are kept
//! alive by default because clients pool them, and because only then does a server that leaves
//! Nagle's algorithm on show what it costs: after a connection's first exchange the client's
//! delayed ACKs (up to 40 ms on Linux) hold back every small write the server queues behind an
//! unacknowledged one, while a fresh connection starts in quick-ACK mode and hides it
//! (`--keep-alive false` compares).
//!
//! Two modes measure a prefix cache: `--shared-prefix-len N` starts every id prompt with the
//! same N random ids (a shared system prompt), and `--turns T --turn-len L` makes each request a
//! conversation of T turns sent one after another on one client, turn k resending turns
//! 1..k-1 (their prompts and, as stand-ins for the answers, as many random ids as each answer
//! had tokens) plus L new ids, with time to first token reported per turn.
//!
//! Responses are read as server-sent events, a line at a time under a length cap, and only the
//! figures are kept (a few numbers per request, four bytes per token gap): memory is bounded by
//! the run's size, never by what a server sends. A request that fails (no connection, a status
//! other than 2xx, a body that is not an event stream, an error object mid-stream, a stream cut
//! before `data: [DONE]`, the per-request timeout) is counted and its message kept; it never
//! stops the other clients.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Args, ValueEnum};
use serde_json::{json, Map, Value};

use crate::common;

/// Seed of the random prompts: request `i` gets the same prompt in every run.
const SEED: u64 = 0x5EED_5E4E;

/// Random token ids are drawn below this when neither `--vocab` nor the server says the
/// vocabulary size: under the special tokens of every common vocabulary (Llama's 32000 and up,
/// Qwen's 151643 and up).
const DEFAULT_ID_RANGE: usize = 10_000;

/// Sampling values of the `--mix` profiles when their flag is not given: Qwen3.5's
/// recommendation for non-thinking use.
const DEFAULT_TEMPERATURE: f64 = 0.7;
const DEFAULT_TOP_P: f64 = 0.8;
const DEFAULT_TOP_K: u64 = 20;

/// Longest line accepted in an event stream. A completion chunk is a few hundred bytes; a
/// longer line means the peer is not streaming completions, and reading on would buffer it.
const MAX_LINE_BYTES: u64 = 1 << 20;

/// Most bytes of an error response read for its message.
const MAX_ERROR_BODY: u64 = 64 << 10;

/// The request index whose random ids are the shared prefix (never a request's own index).
const SHARED_PREFIX_INDEX: u64 = u64::MAX;

/// Xor'd into a turn's index for the random ids that stand in for its answer.
const ANSWER_INDEX_BIT: u64 = 1 << 63;

/// Distinct error messages counted one by one; the rest are counted together.
const DISTINCT_ERRORS: usize = 8;

/// Connecting gets at most this long (or the request timeout, if shorter): a server that is
/// down should fail the run in seconds, not after the whole per-request timeout.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// POST /v1/completions: the prompt as text or token ids
    Completions,
    /// POST /v1/chat/completions: the prompt as one user message
    Chat,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PromptKind {
    /// Random token ids, so the prompt is exactly --prompt-len tokens whatever the tokenizer
    /// (/v1/completions only)
    Ids,
    /// --prompt-len random common English words (about one token each in most vocabularies;
    /// the server's usage reports the real count)
    Words,
}

/// One entry of `--mix`: the sampling fields a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Sampling {
    /// `temperature: 0`
    Greedy,
    /// `temperature` alone
    Temperature,
    /// `temperature` and `top_p`
    TopP,
    /// `temperature` and `top_k`
    TopK,
    /// No sampling field: the server's defaults
    Server,
}

#[derive(Args, Debug)]
#[command(after_help = "stdout gets one JSON object; stderr a table of the same figures.
Each of --clients threads sends a streaming request, reads its events as they arrive and sends
the next as soon as it ends, until --requests have been sent (after --warmup requests that are
not counted). Request i takes the sampling of --mix entry i mod |mix| and the prompt length
--prompt-len entry (i / |mix|) mod |lens|, so every pairing occurs. Prompts differ per request
(a prompt cache cannot skip a prefill), unless --shared-prefix-len gives them a common start or
--turns makes each request a conversation whose turns resend the history. In --turns mode a
request is a whole conversation: --requests and --warmup count conversations, and each turn's
answer is resent as that many random ids (the completions API returns text, not ids; a prefix
cache that keeps only prompt positions does the same prefill work either way).
cached: the prompt tokens the server reports in usage.prompt_tokens_details.cached_tokens.
Output tokens come from the usage chunk (stream_options.include_usage) when the server sends
one, else from the number of chunks that carry a token (the JSON says which). ttft: request
sent to its first token chunk; itl: every gap between successive token chunks of a request;
tpot: (e2e - ttft) / (output tokens - 1); e2e: request sent to `data: [DONE]`; throughputs:
tokens of the completed requests over the wall time of the measured phase. Percentiles
interpolate linearly (numpy's default).
Examples:
  strix bench-serve --url http://127.0.0.1:8080 --clients 64 --requests 256 --max-tokens 256
  strix bench-serve --clients 16 --mix greedy,temperature,top-p --prompt-len 128,4096
  strix bench-serve --clients 64 --shared-prefix-len 2000 --prompt-len 64
  strix bench-serve --clients 1 --requests 1 --warmup 1 --turns 10 --turn-len 500 --max-tokens 128
  strix bench-serve --endpoint chat --prompt-kind words --extra-body '{\"chat_template_kwargs\":{\"enable_thinking\":false}}'")]
pub struct BenchServeArgs {
    /// The server's base URL (http://HOST:PORT, with or without a trailing /v1)
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,

    /// The route to benchmark
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,

    /// The model name sent with each request [default: the first id /v1/models lists]
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,

    /// Sent as `Authorization: Bearer KEY`
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,

    /// Concurrent streaming clients
    #[arg(short, long, value_name = "N", default_value_t = 16)]
    pub clients: usize,

    /// Requests measured, in all [default: 4 x --clients]
    #[arg(short = 'n', long, value_name = "M")]
    pub requests: Option<usize>,

    /// Requests sent (at --clients concurrency) before the measured ones and not counted; a
    /// failed one stops the run [default: --clients]
    #[arg(long, value_name = "K")]
    pub warmup: Option<usize>,

    /// Tokens each request asks for (`max_tokens`)
    #[arg(short = 't', long, value_name = "T", default_value_t = 128)]
    pub max_tokens: usize,

    /// Prompt length in tokens (ids) or words; a list is cycled over the requests
    #[arg(short = 'p', long, value_name = "N,..", value_delimiter = ',', default_value = "128")]
    pub prompt_len: Vec<usize>,

    /// What a prompt is made of [default: ids on completions, words on chat]
    #[arg(long, value_enum, conflicts_with = "prompt_file")]
    pub prompt_kind: Option<PromptKind>,

    /// A text file as every request's prompt, after a line naming the request (so no two
    /// requests share a prefix a server could cache)
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_len")]
    pub prompt_file: Option<PathBuf>,

    /// Random prompt ids are drawn from [0, N) [default: the vocabulary size /v1/models reports
    /// (llama-server's meta.n_vocab), else 10000]
    #[arg(long, value_name = "N")]
    pub vocab: Option<usize>,

    /// Sampling of the requests, cycled per request: greedy, temperature, top-p, top-k, server
    /// [default: one profile of the sampling flags given; greedy when none is]
    #[arg(long, value_enum, value_name = "LIST", value_delimiter = ',')]
    pub mix: Vec<Sampling>,

    /// `temperature` of the sampled profiles [default with --mix: 0.7]
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,

    /// `top_p` of the top-p profile [default with --mix: 0.8]
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,

    /// `top_k` of the top-k profile [default with --mix: 20]
    #[arg(long, value_name = "K")]
    pub top_k: Option<u64>,

    /// Request i sends `seed: S + i` [default: no seed field]
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,

    /// Send `ignore_eos: true`, so every request generates exactly --max-tokens (vLLM,
    /// llama-server and strix accept it)
    #[arg(long, value_name = "BOOL", default_value_t = true, action = ArgAction::Set)]
    pub ignore_eos: bool,

    /// Send `stream_options: {include_usage: true}` and count output tokens from the usage chunk
    #[arg(long, value_name = "BOOL", default_value_t = true, action = ArgAction::Set)]
    pub usage: bool,

    /// Keep each client's connection open between its requests, as pooling clients (the
    /// OpenAI SDKs) do; false opens a connection per request
    #[arg(long, value_name = "BOOL", default_value_t = true, action = ArgAction::Set)]
    pub keep_alive: bool,

    /// Every id prompt starts with the same N random ids (a shared system prompt), before its
    /// own --prompt-len ids (/v1/completions with id prompts)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub shared_prefix_len: usize,

    /// Each request is a conversation of T turns on one client: turn k sends turns 1..k-1
    /// (prompts and answers) again plus --turn-len new ids; ttft is reported per turn
    /// (/v1/completions with id prompts)
    #[arg(long, value_name = "T", requires = "turn_len")]
    pub turns: Option<usize>,

    /// New prompt ids of each turn with --turns
    #[arg(long, value_name = "L", requires = "turns")]
    pub turn_len: Option<usize>,

    /// A JSON object merged into every request body, over the fields above
    #[arg(long, value_name = "JSON")]
    pub extra_body: Option<String>,

    /// Seconds a request may take, from sending it to the end of its stream
    #[arg(long, value_name = "SECONDS", default_value_t = 300.0)]
    pub timeout: f64,

    /// Send every request with `response_format` {"type": "json_schema"} of the JSON schema in
    /// FILE (structured output), and count the outputs that do not parse as JSON
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
}

pub fn bench_serve(args: BenchServeArgs) -> Result<()> {
    let plan = Plan::new(&args)?;
    let clients = args.clients;
    let requests = args.requests.unwrap_or(4 * clients);
    let warmup = args.warmup.unwrap_or(clients);
    // The progress bars count requests sent: a conversation sends one per turn.
    let turns = args.turns.unwrap_or(1);
    if requests == 0 {
        bail!("--requests must be at least 1");
    }

    if warmup > 0 {
        let bar = common::progress_bar("warming up", "requests");
        bar.set_length((warmup * turns) as u64);
        // Indices past the measured ones: warm-up prompts are never the measured prompts.
        let phase = run_phase(&plan, clients, warmup, requests, &bar);
        bar.finish_and_clear();
        if let Some((_, message)) = phase.first_error() {
            bail!("a warm-up request failed (--warmup 0 measures regardless): {message}");
        }
    }
    let bar = common::progress_bar("benchmarking", "requests");
    bar.set_length((requests * turns) as u64);
    let phase = run_phase(&plan, clients, requests, 0, &bar);
    bar.finish_and_clear();

    let report = Report::new(&plan, &phase);
    println!("{}", report.json(&plan, clients, requests, warmup));
    report.table(&plan, clients);
    if report.completed == 0 {
        let (index, message) = phase.first_error().unwrap_or((0, "no request completed".into()));
        bail!("every request failed; request {index}: {message}");
    }
    Ok(())
}

/// The server, as the preflight `GET /v1/models` found it.
struct Server {
    /// Base URL without a trailing `/` or `/v1`.
    base: String,
    model: String,
    owned_by: Option<String>,
    /// Tokens per request (vLLM's and strix's `max_model_len`).
    max_model_len: Option<usize>,
    /// llama-server's `meta.n_vocab`.
    vocab: Option<usize>,
}

/// Where a request's prompt comes from.
#[derive(Debug)]
enum Prompts {
    /// Random ids, after the same `shared` ids in every request.
    Ids {
        lens: Vec<usize>,
        vocab: usize,
        shared: Vec<usize>,
    },
    Words {
        lens: Vec<usize>,
    },
    File {
        path: PathBuf,
        text: String,
    },
}

impl Prompts {
    /// Lengths cycled over the requests (one entry, unknown, for a file).
    fn lens(&self) -> Vec<Option<usize>> {
        match self {
            Prompts::Ids { lens, .. } | Prompts::Words { lens, .. } => {
                lens.iter().map(|&n| Some(n)).collect()
            }
            Prompts::File { .. } => vec![None],
        }
    }
}

/// One sampling profile of the mix: a name and the fields it puts in a request.
#[derive(Clone, Debug)]
struct Profile {
    name: String,
    fields: Map<String, Value>,
}

/// Everything that decides the requests, fixed before the first one is sent.
struct Plan {
    server: Server,
    endpoint: Endpoint,
    api_key: Option<String>,
    prompts: Prompts,
    profiles: Vec<Profile>,
    max_tokens: usize,
    ignore_eos: bool,
    usage: bool,
    seed: Option<u64>,
    extra: Map<String, Value>,
    timeout: Duration,
    keep_alive: bool,
    /// --json-schema: its path and the `response_format` every request carries.
    json_schema: Option<(PathBuf, Value)>,
    /// Turns per conversation (`None`: one request is one prompt).
    turns: Option<usize>,
}

impl Plan {
    /// Checks the flags, asks the server for its model, and fixes the requests.
    fn new(args: &BenchServeArgs) -> Result<Plan> {
        if args.clients == 0 || args.max_tokens == 0 {
            bail!("--clients and --max-tokens must each be at least 1");
        }
        if args.prompt_len.is_empty() || args.prompt_len.contains(&0) {
            bail!("--prompt-len must be one or more positive lengths");
        }
        if !(args.timeout.is_finite() && args.timeout > 0.0) {
            bail!("--timeout must be a positive number of seconds, got {}", args.timeout);
        }
        if args.vocab == Some(0) {
            bail!("--vocab must be at least 1");
        }
        if let Some(t) = args.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
            bail!("--temperature must be 0 or more, got {t}");
        }
        if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            bail!("--top-p must be in (0, 1], got {p}");
        }
        let extra = match &args.extra_body {
            None => Map::new(),
            Some(text) => match serde_json::from_str(text) {
                Ok(Value::Object(map)) => map,
                Ok(_) => bail!("--extra-body must be a JSON object, got {text}"),
                Err(e) => bail!("--extra-body is not JSON ({e}): {text}"),
            },
        };
        let json_schema = match &args.json_schema {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --json-schema {}", path.display()))?;
                let schema: Value = serde_json::from_str(&text)
                    .with_context(|| format!("--json-schema {} is not JSON", path.display()))?;
                if !schema.is_object() {
                    bail!("--json-schema {} must hold a JSON schema object", path.display());
                }
                let format = json!({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": true}});
                Some((path.clone(), format))
            }
        };
        let kind = args.prompt_kind.unwrap_or(match args.endpoint {
            Endpoint::Completions => PromptKind::Ids,
            Endpoint::Chat => PromptKind::Words,
        });
        if args.endpoint == Endpoint::Chat && kind == PromptKind::Ids && args.prompt_file.is_none() {
            bail!("--endpoint chat takes text: use --prompt-kind words or --prompt-file");
        }
        let ids_only = |flag: &str| {
            if args.endpoint != Endpoint::Completions || kind != PromptKind::Ids || args.prompt_file.is_some()
            {
                bail!(
                    "{flag} needs id prompts on /v1/completions (--endpoint completions --prompt-kind ids)"
                );
            }
            Ok(())
        };
        if args.shared_prefix_len > 0 {
            ids_only("--shared-prefix-len")?;
        }
        if let (Some(turns), Some(turn_len)) = (args.turns, args.turn_len) {
            ids_only("--turns")?;
            if turns == 0 || turn_len == 0 {
                bail!("--turns and --turn-len must each be at least 1");
            }
        }
        let base = base_url(&args.url)?;
        let timeout = Duration::from_secs_f64(args.timeout);
        let server = preflight(&base, args.model.as_deref(), args.api_key.as_deref(), timeout)?;

        let prompts = match (&args.prompt_file, kind) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --prompt-file {}", path.display()))?;
                if text.trim().is_empty() {
                    bail!("--prompt-file {} is empty", path.display());
                }
                Prompts::File { path: path.clone(), text }
            }
            (None, PromptKind::Ids) => {
                let vocab = args.vocab.or(server.vocab).unwrap_or(DEFAULT_ID_RANGE);
                // A conversation's turns add --turn-len ids each; the shared ids come first.
                let lens = args.turn_len.map_or_else(|| args.prompt_len.clone(), |l| vec![l]);
                let shared = random_ids(args.shared_prefix_len, vocab, SHARED_PREFIX_INDEX);
                Prompts::Ids { lens, vocab, shared }
            }
            (None, PromptKind::Words) => Prompts::Words { lens: args.prompt_len.clone() },
        };
        // Only id prompts have an exact length; a text prompt's the server alone can count.
        if let (Prompts::Ids { lens, shared, .. }, Some(context)) = (&prompts, server.max_model_len) {
            let longest = lens.iter().max().copied().unwrap_or(0);
            // The last turn of a conversation carries every turn's ids and every answer before it.
            let turns = args.turns.unwrap_or(1);
            let longest = shared.len() + turns * longest + (turns - 1) * args.max_tokens;
            if longest + args.max_tokens > context {
                bail!(
                    "the longest prompt ({longest} ids: --shared-prefix-len, --prompt-len or --turns x \
                     --turn-len and the answers before) + --max-tokens {} is more than the server's \
                     max_model_len ({context})",
                    args.max_tokens
                );
            }
        }
        Ok(Plan {
            server,
            endpoint: args.endpoint,
            api_key: args.api_key.clone(),
            prompts,
            profiles: profiles(args),
            max_tokens: args.max_tokens,
            ignore_eos: args.ignore_eos,
            usage: args.usage,
            seed: args.seed,
            extra,
            timeout,
            keep_alive: args.keep_alive,
            json_schema,
            turns: args.turns,
        })
    }

    /// Number of request kinds: every profile with every prompt length.
    fn groups(&self) -> usize {
        self.profiles.len() * self.prompts.lens().len()
    }

    /// The (profile, prompt length) group of the request in cycle position `slot`.
    fn group_of(&self, slot: usize) -> usize {
        let profiles = self.profiles.len();
        let lens = self.prompts.lens().len();
        (slot % profiles) * lens + (slot / profiles) % lens
    }

    fn group_name(&self, group: usize) -> (&Profile, Option<usize>) {
        let lens = self.prompts.lens();
        (&self.profiles[group / lens.len()], lens[group % lens.len()])
    }

    /// The ids of its own that the request in cycle position `slot` sends after the shared
    /// ones (`index` picks them); `None` for text prompts.
    fn own_ids(&self, slot: usize, index: u64) -> Option<Vec<usize>> {
        let Prompts::Ids { vocab, .. } = &self.prompts else { return None };
        let len = self.group_name(self.group_of(slot)).1.unwrap_or(1);
        Some(random_ids(len, *vocab, index))
    }

    /// The ids every id prompt starts with (`--shared-prefix-len`).
    fn shared_ids(&self) -> &[usize] {
        match &self.prompts {
            Prompts::Ids { shared, .. } => shared,
            _ => &[],
        }
    }

    /// The body of the request in cycle position `slot`, with `ids` as its prompt when the
    /// prompts are ids; `index` makes a text prompt its own.
    fn body(&self, slot: usize, index: u64, ids: Option<&[usize]>) -> Value {
        let (profile, len) = self.group_name(self.group_of(slot));
        let mut body = Map::new();
        body.insert("model".into(), json!(self.server.model));
        let text = match &self.prompts {
            Prompts::Ids { .. } => {
                body.insert("prompt".into(), json!(ids.unwrap_or_default()));
                None
            }
            Prompts::Words { .. } => Some(random_words(len.unwrap_or(1), index)),
            Prompts::File { text, .. } => Some(format!("Request {index}.\n{text}")),
        };
        if let Some(text) = text {
            match self.endpoint {
                Endpoint::Completions => body.insert("prompt".into(), json!(text)),
                Endpoint::Chat => body.insert("messages".into(), json!([{"role": "user", "content": text}])),
            };
        }
        body.insert("max_tokens".into(), json!(self.max_tokens));
        body.insert("stream".into(), json!(true));
        if self.usage {
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        if self.ignore_eos {
            body.insert("ignore_eos".into(), json!(true));
        }
        body.extend(profile.fields.clone());
        if let Some((_, format)) = &self.json_schema {
            body.insert("response_format".into(), format.clone());
        }
        if let Some(seed) = self.seed {
            body.insert("seed".into(), json!(seed.wrapping_add(index)));
        }
        body.extend(self.extra.clone());
        Value::Object(body)
    }

    fn url(&self) -> String {
        format!("{}{}", self.server.base, self.endpoint.path())
    }

    /// A client's HTTP agent: one kept-alive connection, or (no pool) one per request.
    fn agent(&self) -> ureq::Agent {
        ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT.min(self.timeout))
            .max_idle_connections_per_host(usize::from(self.keep_alive))
            .user_agent(concat!("strix-bench-serve/", env!("CARGO_PKG_VERSION")))
            .build()
    }
}

/// `http://host:port` from what the user typed: no trailing `/`, no `/v1`.
fn base_url(url: &str) -> Result<String> {
    let trimmed = url.trim().trim_end_matches('/');
    if !(trimmed.starts_with("http://") || trimmed.starts_with("https://")) {
        bail!("--url must start with http:// or https://, got `{url}`");
    }
    Ok(trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string())
}

/// The sampling profiles: `--mix`, else one profile of the sampling flags given (greedy when
/// none is, so that runs against different servers compare the same work).
fn profiles(args: &BenchServeArgs) -> Vec<Profile> {
    let t = args.temperature.unwrap_or(DEFAULT_TEMPERATURE);
    if args.mix.is_empty() {
        let mut fields = Map::new();
        let mut name = Vec::new();
        for (key, value) in [
            ("temperature", args.temperature.map(|v| json!(v))),
            ("top_p", args.top_p.map(|v| json!(v))),
            ("top_k", args.top_k.map(|v| json!(v))),
        ] {
            if let Some(value) = value {
                name.push(format!("{key} {value}"));
                fields.insert(key.into(), value);
            }
        }
        if fields.is_empty() || (args.temperature == Some(0.0) && fields.len() == 1) {
            return vec![Profile { name: "greedy".into(), fields: greedy() }];
        }
        return vec![Profile { name: name.join(", "), fields }];
    }
    let mut mix = Vec::new();
    for s in &args.mix {
        let fields = match s {
            Sampling::Greedy => greedy(),
            Sampling::Temperature => json_map(json!({"temperature": t})),
            Sampling::TopP => {
                json_map(json!({"temperature": t, "top_p": args.top_p.unwrap_or(DEFAULT_TOP_P)}))
            }
            Sampling::TopK => {
                json_map(json!({"temperature": t, "top_k": args.top_k.unwrap_or(DEFAULT_TOP_K)}))
            }
            Sampling::Server => Map::new(),
        };
        let name = s.to_possible_value().map_or_else(|| format!("{s:?}"), |v| v.get_name().to_string());
        mix.push(Profile { name, fields });
    }
    mix
}

fn greedy() -> Map<String, Value> {
    json_map(json!({"temperature": 0}))
}

fn json_map(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

/// Asks `GET /v1/models` which model the server serves (and, where it says, its context and
/// vocabulary). A server that cannot be reached stops the run here, in seconds.
fn preflight(base: &str, model: Option<&str>, api_key: Option<&str>, timeout: Duration) -> Result<Server> {
    let url = format!("{base}/v1/models");
    let agent =
        ureq::AgentBuilder::new().timeout_connect(CONNECT_TIMEOUT.min(timeout)).timeout(timeout).build();
    let mut request = agent.get(&url);
    if let Some(key) = api_key {
        request = request.set("Authorization", &format!("Bearer {key}"));
    }
    let listed = match request.call() {
        Ok(response) => {
            let mut body = Vec::new();
            response
                .into_reader()
                .take(MAX_LINE_BYTES)
                .read_to_end(&mut body)
                .with_context(|| format!("cannot read the answer of GET {url}"))?;
            match serde_json::from_slice::<Value>(&body) {
                Ok(value) => value["data"].as_array().and_then(|d| d.first()).cloned(),
                Err(e) => bail!("GET {url} did not answer JSON ({e}): {}", snippet(&body)),
            }
        }
        // The model is known: a server without the route can still be measured.
        Err(ureq::Error::Status(..)) if model.is_some() => None,
        Err(ureq::Error::Status(status, response)) => {
            bail!("GET {url} answered {status}: {} (give --model NAME)", error_message(response))
        }
        Err(ureq::Error::Transport(e)) => bail!("cannot reach the server: {e}"),
    };
    let listed = listed.unwrap_or(Value::Null);
    let model = match (model, listed["id"].as_str()) {
        (Some(name), _) => name.to_string(),
        (None, Some(id)) => id.to_string(),
        (None, None) => bail!("GET {url} lists no model (give --model NAME)"),
    };
    let size = |v: &Value| v.as_u64().and_then(|n| usize::try_from(n).ok()).filter(|&n| n > 0);
    Ok(Server {
        base: base.to_string(),
        model,
        owned_by: listed["owned_by"].as_str().map(str::to_string),
        max_model_len: size(&listed["max_model_len"]),
        vocab: size(&listed["meta"]["n_vocab"]),
    })
}

/// What one request measured, or why it failed.
#[derive(Debug)]
struct Outcome {
    index: usize,
    group: usize,
    /// Its turn (from 0) in a conversation of `--turns`.
    turn: Option<usize>,
    /// Prompt tokens known without the server's word (an id prompt's length).
    sent_prompt_tokens: Option<usize>,
    /// From sending the request to `data: [DONE]` (or its failure).
    e2e: Duration,
    /// When it ended, from the start of its phase (orders the failures).
    ended: Duration,
    result: std::result::Result<Streamed, String>,
}

/// The figures of one streamed response.
#[derive(Debug, Default)]
struct Streamed {
    /// Request sent to `data: [DONE]`.
    e2e: Duration,
    /// Request sent to the first token chunk; `None` when none came.
    ttft: Option<Duration>,
    /// Gaps between successive token chunks, in microseconds (4 bytes a token).
    gaps_us: Vec<u32>,
    /// Token chunks.
    chunks: usize,
    usage: Option<Usage>,
    finish_reason: Option<String>,
    /// The answer's text (`text` or `content`), kept with --json-schema to check it parses.
    text: Option<String>,
}

impl Streamed {
    /// Kept text that does not parse as JSON.
    fn unparsable(&self) -> bool {
        self.text.as_deref().is_some_and(|t| serde_json::from_str::<Value>(t).is_err())
    }

    /// Output tokens: the server's count when it sent one, else the token chunks.
    fn output_tokens(&self) -> usize {
        self.usage.and_then(|u| u.completion_tokens).unwrap_or(self.chunks)
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Usage {
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    /// `prompt_tokens_details.cached_tokens`: prompt tokens the server's prefix cache held.
    cached_tokens: Option<usize>,
}

/// A phase (warm-up or measured): its outcomes, its wall time and the most requests that were
/// in flight at once.
struct Phase {
    outcomes: Vec<Outcome>,
    wall: Duration,
    max_in_flight: usize,
}

impl Phase {
    /// The failure that happened first: its request index and message.
    fn first_error(&self) -> Option<(usize, String)> {
        self.outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().err().map(|e| (o.ended, o.index, e)))
            .min_by_key(|(ended, ..)| *ended)
            .map(|(_, index, e)| (index, e.clone()))
    }
}

/// Sends `count` requests from `clients` threads (positions `0..count` of the cycle, prompts
/// `index_base..` so that each phase has prompts of its own). With `--turns`, each request is
/// a conversation whose turns one client sends in order.
fn run_phase(
    plan: &Plan,
    clients: usize,
    count: usize,
    index_base: usize,
    bar: &indicatif::ProgressBar,
) -> Phase {
    let next = AtomicUsize::new(0);
    let in_flight = AtomicUsize::new(0);
    let max_in_flight = AtomicUsize::new(0);
    let outcomes = Mutex::new(Vec::with_capacity(count));
    let url = plan.url();
    let start = Instant::now();
    std::thread::scope(|scope| {
        let client = || {
            let agent = plan.agent();
            loop {
                let slot = next.fetch_add(1, Ordering::Relaxed);
                if slot >= count {
                    break;
                }
                let index = index_base + slot;
                let turns = plan.turns.unwrap_or(1);
                // A conversation's history: every turn's prompt ids and answer stand-ins so far.
                let mut history: Vec<usize> = Vec::new();
                for turn in 0..turns {
                    // Turn t of conversation i draws its new ids as request i * turns + t.
                    let ids_index = (index * turns + turn) as u64;
                    let ids = plan.own_ids(slot, ids_index).map(|own| {
                        if turn == 0 {
                            history.extend(plan.shared_ids());
                        }
                        history.extend(own);
                        history.clone()
                    });
                    let body = plan.body(slot, index as u64, ids.as_deref()).to_string();
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    max_in_flight.fetch_max(now, Ordering::SeqCst);
                    let sent = Instant::now();
                    let keep_text = plan.json_schema.is_some();
                    let result = stream_request(
                        &agent,
                        &url,
                        plan.api_key.as_deref(),
                        &body,
                        plan.timeout,
                        sent,
                        keep_text,
                    );
                    let ended = Instant::now();
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let failed = result.is_err();
                    if let (Ok(streamed), Prompts::Ids { vocab, .. }) = (&result, &plan.prompts) {
                        // The answer, resent in the next turn: as many ids as it had tokens.
                        history.extend(random_ids(
                            streamed.output_tokens(),
                            *vocab,
                            ids_index ^ ANSWER_INDEX_BIT,
                        ));
                    }
                    let outcome = Outcome {
                        index,
                        group: plan.group_of(slot),
                        turn: plan.turns.map(|_| turn),
                        sent_prompt_tokens: ids.as_ref().map(Vec::len),
                        e2e: result.as_ref().map_or(ended - sent, |s| s.e2e),
                        ended: ended - start,
                        result,
                    };
                    outcomes.lock().unwrap_or_else(|e| e.into_inner()).push(outcome);
                    bar.inc(1);
                    if failed {
                        // The rest of the conversation has no history to resend.
                        bar.inc((turns - turn - 1) as u64);
                        break;
                    }
                }
            }
        };
        for _ in 0..clients.min(count) {
            // A thread that cannot be started leaves its share to the others: the run still
            // sends every request, at the concurrency the report then shows.
            let _ = std::thread::Builder::new().name("bench-client".into()).spawn_scoped(scope, client);
        }
    });
    let wall = start.elapsed();
    let mut outcomes = outcomes.into_inner().unwrap_or_else(|e| e.into_inner());
    outcomes.sort_by_key(|o| (o.index, o.turn));
    Phase { outcomes, wall, max_in_flight: max_in_flight.into_inner() }
}

/// Sends one streaming request and reads its events to the end.
fn stream_request(
    agent: &ureq::Agent,
    url: &str,
    api_key: Option<&str>,
    body: &str,
    timeout: Duration,
    sent: Instant,
    keep_text: bool,
) -> std::result::Result<Streamed, String> {
    let mut request = agent
        .post(url)
        .timeout(timeout)
        .set("Content-Type", "application/json")
        .set("Accept", "text/event-stream")
        // Asked for explicitly: a compressed stream may be held back by the compressor, and
        // ureq would otherwise offer gzip.
        .set("Accept-Encoding", "identity");
    if let Some(key) = api_key {
        request = request.set("Authorization", &format!("Bearer {key}"));
    }
    let response = match request.send_string(body) {
        Ok(response) => response,
        Err(ureq::Error::Status(status, response)) => {
            return Err(format!("HTTP {status}: {}", error_message(response)));
        }
        Err(ureq::Error::Transport(e)) => return Err(transport_message(&e.to_string(), timeout)),
    };
    if let Some(kind) = response.header("content-type").filter(|t| !t.starts_with("text/event-stream")) {
        let kind = kind.to_string();
        return Err(format!(
            "the answer is `{kind}`, not an event stream (text/event-stream): {}",
            error_message(response)
        ));
    }
    let mut events = SseReader::new(response.into_reader());
    let mut streamed = Streamed::default();
    let mut last_text: Option<Instant> = None;
    loop {
        let data = match events.next_event() {
            Ok(Some(data)) => data,
            Ok(None) => {
                return Err(format!(
                    "the event stream ended before `data: [DONE]` (after {} token chunks)",
                    streamed.chunks
                ))
            }
            Err(e) => return Err(read_error_message(&e, timeout)),
        };
        let now = Instant::now();
        if data.trim() == "[DONE]" {
            streamed.e2e = now - sent;
            break;
        }
        let chunk = read_chunk(&data)?;
        if keep_text {
            streamed.text.get_or_insert_with(String::new).push_str(&chunk.text);
        }
        if chunk.token {
            match last_text {
                None => streamed.ttft = Some(now - sent),
                Some(last) => {
                    streamed.gaps_us.push(u32::try_from((now - last).as_micros()).unwrap_or(u32::MAX))
                }
            }
            last_text = Some(now);
            streamed.chunks += 1;
        }
        if chunk.usage.is_some() {
            streamed.usage = chunk.usage;
        }
        if chunk.finish_reason.is_some() {
            streamed.finish_reason = chunk.finish_reason;
        }
    }
    // Read what follows `[DONE]` (the end of the chunked body), so that the connection goes
    // back to the agent for the next request; a server that keeps talking is cut off.
    let _ = std::io::copy(&mut events.into_inner().take(MAX_ERROR_BODY), &mut std::io::sink());
    Ok(streamed)
}

/// A transport error, saying which timeout ended it.
fn transport_message(message: &str, timeout: Duration) -> String {
    if message.to_ascii_lowercase().contains("timed out") {
        format!("{message} (--timeout {} s)", timeout.as_secs_f64())
    } else {
        message.to_string()
    }
}

fn read_error_message(e: &std::io::Error, timeout: Duration) -> String {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            format!("no end of the event stream within --timeout {} s", timeout.as_secs_f64())
        }
        _ => format!("reading the event stream: {e}"),
    }
}

/// The message of an error response: OpenAI's `error.message` when it is one, else the start
/// of the body.
fn error_message(response: ureq::Response) -> String {
    let mut body = Vec::new();
    if let Err(e) = response.into_reader().take(MAX_ERROR_BODY).read_to_end(&mut body) {
        return format!("(the body could not be read: {e})");
    }
    match serde_json::from_slice::<Value>(&body).ok().and_then(|v| error_in(&v)) {
        Some(message) => message,
        None if body.is_empty() => "(empty body)".to_string(),
        None => snippet(&body),
    }
}

/// The start of a body, on one line, for an error message.
fn snippet(bytes: &[u8]) -> String {
    const SHOWN: usize = 200;
    let text = String::from_utf8_lossy(bytes);
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match text.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// An error object's message: OpenAI's `{"error": {"message"}}` (also a bare string), or
/// vLLM's `{"object": "error", "message"}`.
fn error_in(value: &Value) -> Option<String> {
    let error = match value.get("error") {
        Some(Value::Null) | None if value["object"] == "error" => value,
        Some(Value::Null) | None => return None,
        Some(error) => error,
    };
    Some(match (&error["message"], error) {
        (Value::String(m), _) => m.clone(),
        (_, Value::String(s)) => s.clone(),
        (_, other) => other.to_string(),
    })
}

/// What one event of a completion stream says.
#[derive(Debug, Default, PartialEq)]
struct Chunk {
    /// It brings a token: a choice that is not over, with its piece of text (completions'
    /// `text`, chat's `content`, `reasoning_content` or `reasoning`) even when the piece is
    /// empty (half a UTF-8 character: strix sends a chunk per token), or that ends with text or
    /// `tool_calls`. Chat's opening chunk that only names the role, and the final chunk that
    /// only gives the finish reason, bring none.
    token: bool,
    usage: Option<Usage>,
    finish_reason: Option<String>,
    /// The answer's text in this chunk (`text` or `delta.content`).
    text: String,
}

fn read_chunk(data: &str) -> std::result::Result<Chunk, String> {
    let value: Value = serde_json::from_str(data)
        .map_err(|e| format!("an event that is not JSON ({e}): {}", snippet(data.as_bytes())))?;
    if !value.is_object() {
        return Err(format!("an event that is not a JSON object: {}", snippet(data.as_bytes())));
    }
    if let Some(message) = error_in(&value) {
        return Err(format!("error event: {message}"));
    }
    let mut chunk = Chunk::default();
    if let Some(choice) = value["choices"].as_array().and_then(|c| c.first()) {
        let delta = &choice["delta"];
        let pieces = [&choice["text"], &delta["content"], &delta["reasoning_content"], &delta["reasoning"]];
        let text = pieces.iter().any(|v| v.as_str().is_some_and(|s| !s.is_empty()))
            || delta["tool_calls"].as_array().is_some_and(|calls| !calls.is_empty());
        let empty_piece = pieces.iter().any(|v| v.is_string()) && delta.get("role").is_none();
        chunk.finish_reason = choice["finish_reason"].as_str().map(str::to_string);
        chunk.text = [&choice["text"], &delta["content"]].iter().filter_map(|v| v.as_str()).collect();
        chunk.token = text || (empty_piece && chunk.finish_reason.is_none());
    }
    if let Some(usage) = value["usage"].as_object() {
        let count = |key: &str| usage.get(key).and_then(Value::as_u64).and_then(|n| usize::try_from(n).ok());
        let cached = usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok());
        chunk.usage = Some(Usage {
            prompt_tokens: count("prompt_tokens"),
            completion_tokens: count("completion_tokens"),
            cached_tokens: cached,
        });
    }
    Ok(chunk)
}

/// Reads server-sent events (the WHATWG `text/event-stream` format) a line at a time: `data:`
/// lines joined by newlines, an event ended by an empty line, comments and other fields
/// skipped. Lines longer than [`MAX_LINE_BYTES`] are an error, so a peer that sends no line
/// ends cannot make it buffer without bound.
struct SseReader<R> {
    inner: BufReader<R>,
    line: Vec<u8>,
}

impl<R: Read> SseReader<R> {
    fn new(inner: R) -> Self {
        SseReader { inner: BufReader::new(inner), line: Vec::new() }
    }

    /// The data of the next event; `None` at the end of the stream.
    fn next_event(&mut self) -> std::io::Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            self.line.clear();
            let n = (&mut self.inner).take(MAX_LINE_BYTES + 1).read_until(b'\n', &mut self.line)?;
            if n == 0 {
                // An event not ended by an empty line still counts: the stream said it.
                return Ok(data);
            }
            if self.line.len() as u64 > MAX_LINE_BYTES {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a line longer than {MAX_LINE_BYTES} bytes: not a completion stream"),
                ));
            }
            let line = String::from_utf8_lossy(&self.line);
            let line = line.strip_suffix('\n').unwrap_or(&line);
            let line = line.strip_suffix('\r').unwrap_or(line);
            if line.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            if field == "data" {
                let value = value.strip_prefix(' ').unwrap_or(value);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => data = Some(value.to_string()),
                }
            }
        }
    }

    fn into_inner(self) -> BufReader<R> {
        self.inner
    }
}

/// Percentiles and mean of a set of durations, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Distribution {
    count: usize,
    mean: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

impl Distribution {
    /// `None` for no values.
    fn of(mut values: Vec<f64>) -> Option<Distribution> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        Some(Distribution {
            count: values.len(),
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: percentile(&values, 50.0),
            p90: percentile(&values, 90.0),
            p99: percentile(&values, 99.0),
            max: values[values.len() - 1],
        })
    }

    fn json(this: Option<Distribution>) -> Value {
        match this {
            Some(d) => {
                json!({"count": d.count, "mean": d.mean, "p50": d.p50, "p90": d.p90, "p99": d.p99, "max": d.max})
            }
            None => Value::Null,
        }
    }

    fn row(this: Option<Distribution>) -> String {
        match this {
            Some(d) => format!(
                "{:.2} / {:.2} / {:.2}  (mean {:.2}, max {:.2}, n {})",
                d.p50, d.p90, d.p99, d.mean, d.max, d.count
            ),
            None => "none measured".to_string(),
        }
    }
}

/// The `q`th percentile of sorted `values`, interpolated linearly between the closest ranks
/// (numpy's default, as vLLM's benchmark reports).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = q / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Latency distributions of a set of completed requests.
struct Latencies {
    ttft: Option<Distribution>,
    itl: Option<Distribution>,
    tpot: Option<Distribution>,
    e2e: Option<Distribution>,
}

impl Latencies {
    fn of<'a>(done: impl Iterator<Item = (&'a Outcome, &'a Streamed)> + Clone) -> Latencies {
        Latencies {
            ttft: Distribution::of(done.clone().filter_map(|(_, s)| s.ttft.map(ms)).collect()),
            itl: Distribution::of(
                done.clone().flat_map(|(_, s)| s.gaps_us.iter().map(|&us| f64::from(us) / 1e3)).collect(),
            ),
            tpot: Distribution::of(
                done.clone()
                    .filter_map(|(o, s)| {
                        let tokens = s.output_tokens();
                        let ttft = s.ttft?;
                        (tokens > 1).then(|| ms(o.e2e.saturating_sub(ttft)) / (tokens - 1) as f64)
                    })
                    .collect(),
            ),
            e2e: Distribution::of(done.map(|(o, _)| ms(o.e2e)).collect()),
        }
    }

    fn json(&self) -> Map<String, Value> {
        json_map(json!({
            "ttft_ms": Distribution::json(self.ttft),
            "itl_ms": Distribution::json(self.itl),
            "tpot_ms": Distribution::json(self.tpot),
            "e2e_ms": Distribution::json(self.e2e),
        }))
    }
}

/// The figures of the measured phase.
struct Report {
    completed: usize,
    failed: usize,
    first_error: Option<(usize, String)>,
    /// Distinct messages and their counts (the first [`DISTINCT_ERRORS`], then "other").
    errors: BTreeMap<String, usize>,
    wall: Duration,
    output_tokens: usize,
    /// `None` when a completed request's prompt length is unknown (text without usage).
    prompt_tokens: Option<usize>,
    /// Prompt tokens the server said its prefix cache held (`None`: it never said).
    cached_tokens: Option<usize>,
    /// Per turn of a conversation (`--turns`): requests, prompt and cached tokens, latencies.
    turns: Vec<Value>,
    chunks: usize,
    /// How many completed requests had a usage count of their output.
    with_usage: usize,
    /// Completed requests that produced fewer than `max_tokens`.
    short: usize,
    /// With --json-schema: completed outputs that do not parse as JSON.
    unparsable: usize,
    finish_reasons: BTreeMap<String, usize>,
    max_in_flight: usize,
    mean_in_flight: f64,
    latencies: Latencies,
    groups: Vec<Value>,
}

impl Report {
    fn new(plan: &Plan, phase: &Phase) -> Report {
        let done = || phase.outcomes.iter().filter_map(|o| o.result.as_ref().ok().map(|s| (o, s)));
        let mut errors = BTreeMap::new();
        for message in phase.outcomes.iter().filter_map(|o| o.result.as_ref().err()) {
            let key = if errors.len() < DISTINCT_ERRORS || errors.contains_key(message) {
                message.clone()
            } else {
                "(other)".to_string()
            };
            *errors.entry(key).or_insert(0) += 1;
        }
        let mut finish_reasons = BTreeMap::new();
        for (_, s) in done() {
            *finish_reasons.entry(s.finish_reason.clone().unwrap_or_else(|| "none".into())).or_insert(0) += 1;
        }
        let prompt_tokens = done()
            .map(|(o, s)| s.usage.and_then(|u| u.prompt_tokens).or(o.sent_prompt_tokens))
            .sum::<Option<usize>>();
        let groups = (0..plan.groups())
            .filter_map(|group| {
                let all: Vec<&Outcome> = phase.outcomes.iter().filter(|o| o.group == group).collect();
                if all.is_empty() {
                    return None;
                }
                let (profile, len) = plan.group_name(group);
                let ok = || all.iter().filter_map(|o| o.result.as_ref().ok().map(|s| (*o, s)));
                let mut entry = json_map(json!({
                    "sampling": profile.name,
                    "fields": profile.fields,
                    "prompt_len": len,
                    "requests": all.len(),
                    "failed": all.iter().filter(|o| o.result.is_err()).count(),
                    "output_tokens": ok().map(|(_, s)| s.output_tokens()).sum::<usize>(),
                }));
                entry.extend(Latencies::of(ok()).json());
                Some(Value::Object(entry))
            })
            .collect();
        let cached = |(_, s): (&Outcome, &Streamed)| s.usage.and_then(|u| u.cached_tokens);
        let cached_tokens = done().any(|d| cached(d).is_some()).then(|| done().filter_map(cached).sum());
        let turns = (0..plan.turns.unwrap_or(0))
            .map(|turn| {
                let all: Vec<&Outcome> = phase.outcomes.iter().filter(|o| o.turn == Some(turn)).collect();
                let ok = || all.iter().filter_map(|o| o.result.as_ref().ok().map(|s| (*o, s)));
                let mut entry = json_map(json!({
                    "turn": turn + 1,
                    "requests": all.len(),
                    "failed": all.iter().filter(|o| o.result.is_err()).count(),
                    "prompt_tokens": ok().filter_map(|(o, _)| o.sent_prompt_tokens).sum::<usize>(),
                    "cached_tokens": ok().any(|d| cached(d).is_some()).then(|| ok().filter_map(cached).sum::<usize>()),
                }));
                entry.extend(Latencies::of(ok()).json());
                Value::Object(entry)
            })
            .collect();
        let total_e2e: f64 = phase.outcomes.iter().map(|o| o.e2e.as_secs_f64()).sum();
        Report {
            completed: done().count(),
            failed: phase.outcomes.iter().filter(|o| o.result.is_err()).count(),
            first_error: phase.first_error(),
            errors,
            wall: phase.wall,
            output_tokens: done().map(|(_, s)| s.output_tokens()).sum(),
            prompt_tokens,
            cached_tokens,
            turns,
            chunks: done().map(|(_, s)| s.chunks).sum(),
            with_usage: done().filter(|(_, s)| s.usage.and_then(|u| u.completion_tokens).is_some()).count(),
            short: done().filter(|(_, s)| s.output_tokens() < plan.max_tokens).count(),
            unparsable: done().filter(|(_, s)| s.unparsable()).count(),
            finish_reasons,
            max_in_flight: phase.max_in_flight,
            // Little's law: requests in flight on average over the measured wall time.
            mean_in_flight: if phase.wall.is_zero() { 0.0 } else { total_e2e / phase.wall.as_secs_f64() },
            latencies: Latencies::of(done()),
            groups,
        }
    }

    /// Where the output token counts came from: "usage", "chunks" or "mixed".
    fn tokens_from(&self) -> &'static str {
        match self.with_usage {
            0 => "chunks",
            n if n == self.completed => "usage",
            _ => "mixed",
        }
    }

    fn per_second(&self, n: usize) -> f64 {
        common::rate(n, self.wall.as_secs_f64())
    }

    fn json(&self, plan: &Plan, clients: usize, requests: usize, warmup: usize) -> Value {
        let (kind, lens, vocab, file, shared) = match &plan.prompts {
            Prompts::Ids { lens, vocab, shared } => ("ids", Some(lens), Some(*vocab), None, shared.len()),
            Prompts::Words { lens } => ("words", Some(lens), None, None, 0),
            Prompts::File { path, .. } => ("file", None, None, Some(path.display().to_string()), 0),
        };
        let mut report = json_map(json!({
            "server": {
                "url": plan.server.base,
                "endpoint": plan.endpoint.path(),
                "model": plan.server.model,
                "owned_by": plan.server.owned_by,
                "max_model_len": plan.server.max_model_len,
            },
            "client": {
                "cpu": crate::bench::cpu_name(),
                "logical_cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
            },
            "clients": clients,
            "requests": requests,
            "warmup": warmup,
            "max_tokens": plan.max_tokens,
            "prompt": {"kind": kind, "lens": lens, "vocab": vocab, "file": file, "shared_prefix_len": shared},
            "turns": plan.turns,
            "mix": plan.profiles.iter().map(|p| json!({"sampling": p.name, "fields": p.fields})).collect::<Vec<_>>(),
            "ignore_eos": plan.ignore_eos,
            "include_usage": plan.usage,
            "keep_alive": plan.keep_alive,
            "seed": plan.seed,
            "extra_body": plan.extra,
            "timeout_s": plan.timeout.as_secs_f64(),
            "completed": self.completed,
            "failed": self.failed,
            "first_error": self.first_error.as_ref().map(|(i, m)| format!("request {i}: {m}")),
            "errors": self.errors,
            "duration_s": self.wall.as_secs_f64(),
            "requests_per_s": self.per_second(self.completed),
            "output_tok_s": self.per_second(self.output_tokens),
            "prompt_tok_s": self.prompt_tokens.map(|n| self.per_second(n)),
            "total_tok_s": self.prompt_tokens.map(|n| self.per_second(n + self.output_tokens)),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_tokens,
            "token_chunks": self.chunks,
            "output_tokens_from": self.tokens_from(),
            "short_requests": self.short,
            "json_schema": plan.json_schema.as_ref().map(|(path, _)| path.display().to_string()),
            "unparsable_outputs": plan.json_schema.as_ref().map(|_| self.unparsable),
            "finish_reasons": self.finish_reasons,
            "concurrency": {"max": self.max_in_flight, "mean": self.mean_in_flight},
        }));
        report.extend(self.latencies.json());
        report.insert("groups".into(), Value::Array(self.groups.clone()));
        if plan.turns.is_some() {
            report.insert("per_turn".into(), Value::Array(self.turns.clone()));
        }
        Value::Object(report)
    }

    fn table(&self, plan: &Plan, clients: usize) {
        let row = |k: &str, v: String| eprintln!("  {k:<26} {v}");
        let server = &plan.server;
        eprintln!("strix bench-serve");
        let owner = server.owned_by.as_ref().map_or(String::new(), |o| format!(", owned by {o}"));
        row("server", format!("{}{} ({}{owner})", server.base, plan.endpoint.path(), server.model));
        let prompt = match &plan.prompts {
            Prompts::Ids { lens, vocab, shared } => {
                let after = if shared.is_empty() {
                    String::new()
                } else {
                    format!(" after {} shared ones", shared.len())
                };
                let turns =
                    plan.turns.map_or(String::new(), |t| format!(" a turn, {t} turns resending the history"));
                format!("{} random token ids below {vocab}{after}{turns}", list(lens))
            }
            Prompts::Words { lens } => format!("{} random words", list(lens)),
            Prompts::File { path, .. } => format!("{} (after a line naming the request)", path.display()),
        };
        row("prompt", prompt);
        let names: Vec<&str> = plan.profiles.iter().map(|p| p.name.as_str()).collect();
        row("sampling", names.join(" | "));
        let eos = if plan.ignore_eos { ", ignore_eos" } else { "" };
        row("max tokens", format!("{}{eos}", plan.max_tokens));
        if let Some((path, _)) = &plan.json_schema {
            row("response_format", format!("json_schema of {}", path.display()));
        }
        let connections = if plan.keep_alive { "one per client, kept alive" } else { "one per request" };
        row("connections", connections.to_string());
        row(
            "requests",
            format!(
                "{} completed, {} failed; {clients} clients (max {} in flight, mean {:.1})",
                self.completed, self.failed, self.max_in_flight, self.mean_in_flight
            ),
        );
        row("duration", format!("{:.3} s", self.wall.as_secs_f64()));
        row("requests/s", format!("{:.3}", self.per_second(self.completed)));
        row(
            "output tok/s",
            format!(
                "{:.1} ({} tokens, counted from {}; {} short of max tokens)",
                self.per_second(self.output_tokens),
                self.output_tokens,
                self.tokens_from(),
                self.short
            ),
        );
        if plan.json_schema.is_some() {
            row("unparsable outputs", format!("{} of {} (not JSON)", self.unparsable, self.completed));
        }
        match self.prompt_tokens {
            Some(n) => row("prompt tok/s", format!("{:.1} ({n} tokens)", self.per_second(n))),
            None => row("prompt tok/s", "unknown (the server sent no usage)".to_string()),
        }
        if let Some(n) = self.cached_tokens {
            row("cached prompt tokens", n.to_string());
        }
        row("", "p50 / p90 / p99 ms".to_string());
        let l = &self.latencies;
        row("ttft", Distribution::row(l.ttft));
        row("itl", Distribution::row(l.itl));
        row("tpot", Distribution::row(l.tpot));
        row("e2e", Distribution::row(l.e2e));
        if self.groups.len() > 1 {
            for g in &self.groups {
                let len = g["prompt_len"].as_u64().map_or(String::new(), |n| format!(", prompt {n}"));
                let p50 = |key: &str| g[key]["p50"].as_f64().map_or("-".to_string(), |v| format!("{v:.2}"));
                row(
                    &format!("{}{len}", g["sampling"].as_str().unwrap_or("")),
                    format!(
                        "{} requests, p50 ttft {} / itl {} / e2e {} ms",
                        g["requests"],
                        p50("ttft_ms"),
                        p50("itl_ms"),
                        p50("e2e_ms")
                    ),
                );
            }
        }
        for t in &self.turns {
            let p50 = t["ttft_ms"]["p50"].as_f64().map_or("-".to_string(), |v| format!("{v:.2}"));
            let cached = t["cached_tokens"].as_u64().map_or("-".to_string(), |n| n.to_string());
            row(
                &format!("turn {}", t["turn"]),
                format!(
                    "{} requests, {} prompt tokens ({cached} cached), p50 ttft {p50} ms",
                    t["requests"], t["prompt_tokens"]
                ),
            );
        }
        if let Some((index, message)) = &self.first_error {
            row("first error", format!("request {index}: {message}"));
        }
    }
}

fn list(lens: &[usize]) -> String {
    lens.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// A fixed LCG stream per request: the same prompts every run, a different one per request.
struct Lcg(u64);

impl Lcg {
    fn for_request(index: u64) -> Lcg {
        Lcg(SEED ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

fn random_ids(len: usize, vocab: usize, index: u64) -> Vec<usize> {
    let mut rng = Lcg::for_request(index);
    (0..len).map(|_| rng.below(vocab)).collect()
}

/// Common English words, each one token (with its leading space) in the BPE vocabularies of
/// Qwen, Llama and GPT.
const WORDS: &str = "the of and to in is was for that with as on by he at from his it an were are which \
    this be or has had first one their its new after but who not they have her she two been other when \
    there all during into school time may years more most only over city some world would where later \
    up such used many can state about national out known university united then made team";

fn random_words(len: usize, index: u64) -> String {
    let words: Vec<&str> = WORDS.split_whitespace().collect();
    let mut rng = Lcg::for_request(index);
    (0..len).map(|_| words[rng.below(words.len())]).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(stream: &str) -> Vec<String> {
        let mut reader = SseReader::new(stream.as_bytes());
        let mut out = Vec::new();
        while let Some(data) = reader.next_event().expect("a well-formed stream") {
            out.push(data);
        }
        out
    }

    #[test]
    fn sse_events_are_data_lines_up_to_an_empty_line() {
        let stream = ": a comment\r\nevent: message\r\ndata: {\"a\":1}\r\n\r\ndata:x\ndata: y\nid: 3\n\n\n\ndata: [DONE]";
        assert_eq!(events(stream), ["{\"a\":1}", "x\ny", "[DONE]"]);
        assert!(events("").is_empty());
        assert!(events(": only comments\n\n").is_empty());
    }

    #[test]
    fn an_sse_line_without_end_is_refused_past_the_cap() {
        let long = format!("data: {}", "x".repeat(MAX_LINE_BYTES as usize + 10));
        let err = SseReader::new(long.as_bytes()).next_event().unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
        // Just under the cap is fine.
        let fits = format!("data: {}\n\n", "x".repeat(MAX_LINE_BYTES as usize - 10));
        assert_eq!(events(&fits)[0].len(), MAX_LINE_BYTES as usize - 10);
    }

    #[test]
    fn chunks_of_both_routes_are_read() {
        let c =
            read_chunk(r#"{"choices":[{"index":0,"text":"hi","finish_reason":null}],"usage":null}"#).unwrap();
        assert_eq!(c, Chunk { token: true, usage: None, finish_reason: None, text: "hi".into() });
        // A token whose text is held back (half a UTF-8 character) still arrived.
        let c = read_chunk(r#"{"choices":[{"text":"","finish_reason":null}]}"#).unwrap();
        assert!(c.token);
        // The end of the stream brings none, unless it has text.
        let c = read_chunk(r#"{"choices":[{"text":"","finish_reason":"length"}]}"#).unwrap();
        assert_eq!(
            c,
            Chunk { token: false, usage: None, finish_reason: Some("length".into()), text: String::new() }
        );
        let c = read_chunk(r#"{"choices":[{"text":"x","finish_reason":"length"}]}"#).unwrap();
        assert!(c.token);
        let c = read_chunk(r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#).unwrap();
        assert!(!c.token);
        for delta in [
            r#"{"content":"a"}"#,
            r#"{"reasoning_content":"a"}"#,
            r#"{"reasoning":"a"}"#,
            r#"{"tool_calls":[{"index":0}]}"#,
        ] {
            let c = read_chunk(&format!(r#"{{"choices":[{{"delta":{delta}}}]}}"#)).unwrap();
            assert!(c.token, "{delta}");
        }
        // Chat's opening chunks (vLLM's, llama-server's) only name the role.
        for opening in [r#"{"role":"assistant","content":""}"#, r#"{"role":"assistant","content":null}"#] {
            let c = read_chunk(&format!(r#"{{"choices":[{{"delta":{opening},"finish_reason":null}}]}}"#))
                .unwrap();
            assert!(!c.token, "{opening}");
        }
        let c = read_chunk(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}"#).unwrap();
        assert_eq!(
            c.usage,
            Some(Usage { prompt_tokens: Some(7), completion_tokens: Some(5), cached_tokens: None })
        );
        let c = read_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":4}}}"#,
        )
        .unwrap();
        assert_eq!(c.usage.and_then(|u| u.cached_tokens), Some(4), "OpenAI's cached prompt tokens");
    }

    #[test]
    fn error_events_and_garbage_are_errors_that_say_what_came() {
        let e = read_chunk(r#"{"error":{"message":"the engine stopped","type":"x"}}"#).unwrap_err();
        assert!(e.contains("the engine stopped"), "{e}");
        let e = read_chunk(r#"{"object":"error","message":"out of memory"}"#).unwrap_err();
        assert!(e.contains("out of memory"), "{e}");
        let e = read_chunk("<html>oops</html>").unwrap_err();
        assert!(e.contains("not JSON") && e.contains("<html>oops"), "{e}");
        let e = read_chunk("[1, 2]").unwrap_err();
        assert!(e.contains("not a JSON object"), "{e}");
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let d = Distribution::of(vec![4.0, 1.0, 3.0, 2.0, 5.0]).unwrap();
        assert_eq!((d.p50, d.max, d.mean, d.count), (3.0, 5.0, 3.0, 5));
        assert!((d.p90 - 4.6).abs() < 1e-12 && (d.p99 - 4.96).abs() < 1e-12, "{d:?}");
        let one = Distribution::of(vec![7.0]).unwrap();
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
        assert!(Distribution::of(Vec::new()).is_none());
    }

    #[test]
    fn base_urls_lose_their_slash_and_v1() {
        assert_eq!(base_url("http://h:1/v1/").unwrap(), "http://h:1");
        assert_eq!(base_url(" https://h/ ").unwrap(), "https://h");
        assert!(base_url("h:8080").unwrap_err().to_string().contains("--url"));
    }

    #[test]
    fn prompts_differ_per_request_and_repeat_per_index() {
        assert_eq!(random_ids(64, 300, 3), random_ids(64, 300, 3));
        assert_ne!(random_ids(64, 300, 3), random_ids(64, 300, 4));
        assert!(random_ids(1000, 300, 9).iter().all(|&id| id < 300));
        let words = random_words(50, 1);
        assert_eq!(words.split(' ').count(), 50);
        assert_ne!(words, random_words(50, 2));
    }
}
