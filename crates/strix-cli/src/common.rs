//! What the subcommands share: finding the model (local directory, GGUF file or Hugging Face
//! repo id, with a diagnosis of paths that are none of these), the hub settings from the `HF_*`
//! environment variables, loading the model onto the chosen backend behind a progress bar, the
//! thread pool, the sampling and generation flags, turning a prompt (text, chat message or
//! token ids) into ids, and an error as the one line the user reads.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use strix::chat::{ChatMessage, ChatOptions, ChatTemplate};
use strix::hub::{fetch_model, HubOptions, DEFAULT_ENDPOINT, DEFAULT_MODEL};
use strix::model::{is_gguf_path, ModelFiles};
use strix::sampling::SamplingParams;
use strix::tokenizer::Tokenizer;

use crate::device::DeviceArgs;
use crate::limits::{self, Seed};
pub use crate::loading::{load_model, progress_bar, with_progress};

/// Context used when `--ctx` is not given, unless the prompt and its completion need more
/// (and the model allows it).
pub const DEFAULT_CONTEXT: usize = 4096;

#[derive(Args, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json), a llama.cpp `qwen35`
    /// GGUF file, or a Hugging Face repo id such as Qwen/Qwen3.5-2B (downloaded to the
    /// Hugging Face cache on first use).
    /// Default: Qwen/Qwen3.5-0.8B
    #[arg(short, long, value_name = "PATH")]
    pub model: Option<String>,

    /// Worker threads, at most 4 per logical CPU [default: one per logical CPU]
    #[arg(short, long, value_name = "N", value_parser = limits::threads)]
    pub threads: Option<usize>,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub quant: crate::quant_flag::QuantArgs,
}

/// Sampling flags, with llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95,
/// min-p 0.05, no penalties, a random seed.
#[derive(Args, Debug)]
#[command(next_help_heading = "Sampling (llama.cpp's defaults; --temperature 0 is greedy)")]
pub struct SamplingArgs {
    /// Divide the logits by T before sampling; 0 picks the most likely token (greedy)
    #[arg(
        long,
        visible_alias = "temp",
        value_name = "T",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub temperature: f32,

    /// Sample from the K most likely tokens only (0: all)
    #[arg(long, value_name = "K", default_value_t = 40, value_parser = limits::top_k)]
    pub top_k: usize,

    /// Sample from the smallest set of most likely tokens whose probability reaches P (1: off)
    #[arg(long, value_name = "P", default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,

    /// Drop tokens less likely than P times the most likely one (0: off)
    #[arg(long, value_name = "P", default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,

    /// Divide positive (multiply negative) logits of tokens already in the prompt or output (1: off)
    #[arg(
        long,
        visible_alias = "repetition-penalty",
        value_name = "X",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub repeat_penalty: f32,

    /// Subtract X from the logit of every token already generated (0: off)
    #[arg(long, value_name = "X", default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,

    /// Subtract X times its count from the logit of every token already generated (0: off)
    #[arg(long, value_name = "X", default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,

    /// Random seed: the same seed, prompt and flags give the same output; -1 draws one, as
    /// when none is given [default: random]
    #[arg(short, long, value_name = "N", value_parser = limits::seed)]
    pub seed: Option<Seed>,

    /// Add BIAS (-100 to 100) to token ID's logit before anything else; repeat for more tokens
    /// (-100 all but bans a token, 100 all but forces it)
    #[arg(long, value_name = "ID=BIAS", value_parser = limits::logit_bias, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f32)>,
}

impl SamplingArgs {
    /// The sampling parameters, with a seed drawn now when none was given, so that it can be
    /// reported and the run replayed.
    pub fn params(&self) -> Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: Some(match self.seed {
                Some(Seed::Fixed(seed)) => seed,
                None | Some(Seed::Random) => random_seed(),
            }),
            logit_bias: self.logit_bias.clone(),
        };
        params.validate()?;
        Ok(params)
    }
}

/// Chat template switches shared by `run --chat` and `chat`.
#[derive(Args, Debug)]
pub struct ChatTemplateArgs {
    /// A system message to start the conversation with
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,

    /// Ask for a direct answer: the template's enable_thinking=false (an empty <think> block)
    #[arg(long, conflicts_with = "think")]
    pub no_think: bool,

    /// Ask for thinking before the answer: enable_thinking=true [default: the template's
    /// default, which for Qwen3.5 is to think]
    #[arg(long)]
    pub think: bool,
}

impl ChatTemplateArgs {
    pub fn enable_thinking(&self) -> Option<bool> {
        match (self.think, self.no_think) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        }
    }

    pub fn system_messages(&self) -> Vec<ChatMessage> {
        self.system.iter().map(|s| ChatMessage::system(s.as_str())).collect()
    }

    pub fn options(&self, add_generation_prompt: bool) -> ChatOptions {
        ChatOptions {
            add_generation_prompt,
            enable_thinking: self.enable_thinking(),
            ..ChatOptions::default()
        }
    }
}

/// A seed from the OS-seeded hasher of the standard library (no extra dependency).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Sizes rayon's global pool; must run before anything touches rayon. The workers get the
/// main thread's stack size, since [`on_pool`] runs whole commands on one of them.
pub fn init_threads(threads: Option<usize>) -> Result<()> {
    let mut builder = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK);
    if let Some(n) = threads {
        // The flags' parser checks this too (crate::limits); here for any other caller.
        if n == 0 || n > limits::max_threads() {
            bail!("--threads must be 1 to {}", limits::max_threads());
        }
        builder = builder.num_threads(n);
    }
    match (builder.build_global(), threads) {
        (Err(e), Some(n)) => Err(anyhow!("cannot start {n} worker threads: {e}")),
        // Without --threads a pool that already exists will do.
        _ => Ok(()),
    }
}

const WORKER_STACK: usize = 8 << 20;

/// Runs `f` on a worker of rayon's global pool and waits for it. The model's parallel ops
/// then run as fork-join work on the calling worker, which takes part in them, instead of
/// each being sent from the main thread to the pool and waited for on a lock: on the 2-core
/// CPU that round trip (two thread wake-ups per op, hundreds of ops per token) cost about a
/// tenth of the decode time.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// `owner/name`, as Hugging Face spells repo ids: one slash, no path-like pieces.
fn looks_like_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    let (Some(owner), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    ok(owner) && ok(name)
}

/// The model `--model` names, opened once (`ModelFiles`: a GGUF file's metadata is read from
/// this one opening by every later step): a model directory, a GGUF file, else a Hugging Face
/// repo id to fetch; no `--model` fetches the default model. Anything else is refused with
/// what it is.
pub fn resolve_model(arg: Option<&str>) -> Result<ModelFiles> {
    let path = model_path(arg)?;
    Ok(ModelFiles::open(&path)?)
}

/// Where the model `--model` names is (fetched first for a repo id), checked for what it is.
fn model_path(arg: Option<&str>) -> Result<PathBuf> {
    let Some(arg) = arg else {
        eprintln!("strix: no --model given, using {DEFAULT_MODEL} (fetched from the Hugging Face Hub once)");
        return fetch_model(DEFAULT_MODEL, &hub_options(env_var)?)
            .context("fetching the default model (--model DIR runs a local one)");
    };
    let path = Path::new(arg);
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            check_model_dir(path, arg)?;
            Ok(path.to_path_buf())
        }
        Ok(_) if is_gguf_path(path) => Ok(path.to_path_buf()),
        Ok(_) => {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let hint = if name.ends_with(".safetensors") || name.ends_with(".json") {
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                format!(": give the directory that holds it ({})", parent.display())
            } else {
                String::new()
            };
            bail!("--model {arg} is a file but not a GGUF file, and not a model directory{hint}")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if looks_like_repo_id(arg) {
                return fetch_model(arg, &hub_options(env_var)?).with_context(|| {
                    format!("--model {arg}: no such file or directory here, so it was taken for a Hugging Face repo id")
                });
            }
            bail!(
                "--model {arg}: no such file or directory (nor a Hugging Face repo id, which is owner/name)"
            )
        }
        Err(e) => bail!("--model {arg}: {e}"),
    }
}

/// A directory is a model directory when the library says so (`strix::config::check_model_dir`:
/// a regular `config.json`); otherwise say so before any other file is looked for, with what
/// the directory holds instead when that helps.
pub fn check_model_dir(dir: &Path, arg: &str) -> Result<()> {
    match strix::config::check_model_dir(dir) {
        Err(strix::Error::NotAModel { .. }) => {}
        other => return Ok(other?),
    }
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()
        })
        .unwrap_or_default();
    names.sort();
    let ggufs: Vec<&String> =
        names.iter().filter(|n| n.to_ascii_lowercase().ends_with(".gguf")).take(3).collect();
    let hint = if !ggufs.is_empty() {
        let list: Vec<&str> = ggufs.iter().map(|n| n.as_str()).collect();
        format!("; it holds {}: give --model that file", list.join(", "))
    } else if names.iter().any(|n| n.ends_with(".safetensors")) {
        "; it has safetensors weights but not the config that goes with them".to_string()
    } else {
        String::new()
    };
    bail!(
        "--model {arg} is not a model directory: it has no config.json (a Hugging Face model directory \
         holds config.json, *.safetensors and tokenizer.json){hint}"
    )
}

/// A non-empty environment variable.
fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The hub settings from the environment variables huggingface_hub reads (`var` looks one
/// up): `HF_ENDPOINT`; the cache `HF_HUB_CACHE` (or `HUGGINGFACE_HUB_CACHE`), by default
/// `$HF_HOME/hub`, `HF_HOME` itself by default `$XDG_CACHE_HOME/huggingface` or
/// `~/.cache/huggingface`; the token `HF_TOKEN` (or `HUGGING_FACE_HUB_TOKEN`), else the file
/// `huggingface-cli login` writes (`$HF_TOKEN_PATH`, by default `$HF_HOME/token`);
/// `HF_HUB_OFFLINE` (1, true, yes or on); `HF_HUB_DOWNLOAD_TIMEOUT` in seconds; the proxy for
/// the endpoint's scheme (`HTTPS_PROXY` or `HTTP_PROXY`, else `ALL_PROXY`, also in lower case)
/// unless `NO_PROXY` names the endpoint's host.
pub fn hub_options(var: impl Fn(&str) -> Option<String>) -> Result<HubOptions> {
    let hf_home = match var("HF_HOME") {
        Some(home) => PathBuf::from(home),
        None => match (var("XDG_CACHE_HOME"), var("HOME")) {
            (Some(cache), _) => Path::new(&cache).join("huggingface"),
            (None, Some(home)) => Path::new(&home).join(".cache").join("huggingface"),
            (None, None) => {
                bail!("no home directory for the Hugging Face cache: set HF_HOME or HF_HUB_CACHE")
            }
        },
    };
    let cache_dir = var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .map_or(hf_home.join("hub"), PathBuf::from);
    let token = var("HF_TOKEN").or_else(|| var("HUGGING_FACE_HUB_TOKEN")).or_else(|| {
        let path = var("HF_TOKEN_PATH").map_or(hf_home.join("token"), PathBuf::from);
        std::fs::read_to_string(path).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
    });
    let offline = var("HF_HUB_OFFLINE")
        .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
    let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string()).trim().to_string();
    let scheme_proxy = if endpoint.starts_with("https://") { "HTTPS_PROXY" } else { "HTTP_PROXY" };
    let proxy = [scheme_proxy, "ALL_PROXY"]
        .iter()
        .find_map(|name| var(name).or_else(|| var(&name.to_ascii_lowercase())))
        .filter(|_| {
            let no_proxy = var("NO_PROXY").or_else(|| var("no_proxy")).unwrap_or_default();
            !bypasses_proxy(&no_proxy, url_host(&endpoint))
        });
    let mut options = HubOptions {
        endpoint,
        token: token.map(|t| t.trim().to_string()),
        offline,
        proxy,
        ..HubOptions::new(cache_dir)
    };
    if let Some(text) = var("HF_HUB_DOWNLOAD_TIMEOUT") {
        let seconds: f64 =
            text.trim().parse().ok().filter(|s: &f64| s.is_finite() && *s > 0.0).ok_or_else(|| {
                anyhow!("HF_HUB_DOWNLOAD_TIMEOUT={text} is not a positive number of seconds")
            })?;
        options.timeout = std::time::Duration::from_secs_f64(seconds.min(86_400.0));
    }
    Ok(options)
}

/// The tokenizer of a model directory; `None` when it ships none. For a GGUF file: the
/// `tokenizer.json` beside it when there is one, else the one in its `tokenizer.ggml.*` metadata.
pub fn load_tokenizer(files: &ModelFiles) -> Result<Option<Tokenizer>> {
    if let Some(t) = Tokenizer::from_model_dir(files.side_dir())? {
        return Ok(Some(t));
    }
    match files.gguf() {
        Some(gguf) => Ok(Some(Tokenizer::from_gguf(gguf.file())?)),
        None => Ok(None),
    }
}

/// The tokenizer, or an error saying why `what` needs one.
pub fn require_tokenizer<'a>(
    tokenizer: Option<&'a Tokenizer>,
    dir: &Path,
    what: &str,
) -> Result<&'a Tokenizer> {
    tokenizer.ok_or_else(|| {
        anyhow!(
            "{} has no tokenizer.json, so {what} cannot be tokenized; give token ids with --prompt-ids",
            dir.display()
        )
    })
}

/// The chat template: a model directory's, or for a GGUF file its `tokenizer.chat_template`
/// (with the BOS/EOS token texts of its metadata), else the template files beside it.
pub fn require_template(files: &ModelFiles) -> Result<ChatTemplate> {
    if let Some(file) = files.gguf().map(|g| g.file()) {
        if file.metadata("tokenizer.chat_template").is_some() {
            let token = |key: &str| -> Option<String> {
                let id = file.get_u32(key).ok()? as usize;
                file.get_str_array("tokenizer.ggml.tokens").ok()?.get(id).cloned()
            };
            let template = ChatTemplate::from_source(file.get_str("tokenizer.chat_template")?)
                .with_context(|| format!("{}: tokenizer.chat_template", files.path().display()))?;
            return Ok(template.with_special_tokens(
                token("tokenizer.ggml.bos_token_id"),
                token("tokenizer.ggml.eos_token_id"),
            ));
        }
    }
    ChatTemplate::from_model_dir(files.side_dir())?.ok_or_else(|| {
        anyhow!(
            "{} has no chat template (chat_template.jinja or tokenizer_config.json)",
            files.path().display()
        )
    })
}

/// Parses `--prompt-ids 1,2,3` (spaces allowed around the commas; an empty id, as in `1,,2`
/// or `1,2,`, is refused rather than skipped, since it is more likely a slip than intended).
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    if text.trim().is_empty() {
        bail!("--prompt-ids is empty");
    }
    text.split(',')
        .map(str::trim)
        .enumerate()
        .map(|(i, s)| {
            if s.is_empty() {
                bail!("invalid --prompt-ids: id {} is empty (expected comma-separated token ids, e.g. 1,2,3)", i + 1)
            }
            s.parse::<u32>().map_err(|_| {
                anyhow!("invalid --prompt-ids: `{s}` is not a token id (expected comma-separated non-negative integers)")
            })
        })
        .collect()
}

/// Rejects ids the model has no embedding for, before any work is done.
pub fn check_ids(ids: &[u32], vocab_size: usize) -> Result<()> {
    if ids.is_empty() {
        bail!("the prompt is empty (0 tokens)");
    }
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
        bail!("token id {bad} is outside the model's vocabulary (ids 0..{vocab_size})");
    }
    Ok(())
}

/// The context size: `--ctx` if given, else enough for `needed` tokens and at least
/// [`DEFAULT_CONTEXT`], within what the model was trained for.
pub fn context_size(ctx: Option<usize>, needed: usize, model_max: usize) -> Result<usize> {
    match ctx {
        Some(0) => bail!("--ctx must be at least 1"),
        Some(n) => {
            if n > model_max {
                eprintln!(
                    "strix: warning: --ctx {n} exceeds the model's max_position_embeddings ({model_max})"
                );
            }
            Ok(n)
        }
        None => Ok(needed.max(DEFAULT_CONTEXT).min(model_max)),
    }
}

/// Writes to stdout as text streams in, remembering the first write error instead of
/// panicking (as `print!` would) when the reader goes away, e.g. `strix run ... | head`.
#[derive(Default)]
pub struct StdoutStream {
    error: Option<std::io::Error>,
}

impl StdoutStream {
    pub fn write(&mut self, text: &str) {
        if self.error.is_some() || text.is_empty() {
            return;
        }
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
            self.error = Some(e);
        }
    }

    /// The write error, if any; a closed pipe is the reader's choice, not an error.
    pub fn finish(self) -> Result<()> {
        match self.error {
            Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(anyhow!("writing to stdout: {e}")),
            _ => Ok(()),
        }
    }
}

/// The host of `scheme://host:port/path` (`[::1]` without its brackets).
fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.split(':').next().unwrap_or(""),
    }
}

/// Whether a `NO_PROXY` list (`*`, hosts and domain suffixes, comma-separated, ports ignored)
/// covers `host`, as curl and Python's requests read it.
fn bypasses_proxy(no_proxy: &str, host: &str) -> bool {
    let host = host.to_ascii_lowercase();
    no_proxy.split(',').map(|entry| entry.trim().to_ascii_lowercase()).filter(|e| !e.is_empty()).any(
        |entry| {
            let entry = url_host(&entry).trim_start_matches('.').to_string();
            entry == "*" || host == entry || host.ends_with(&format!(".{entry}"))
        },
    )
}

/// The error and its causes on one line (so scripts and logs keep the message together),
/// each cause after a colon, leaving out what the line already says: the library's I/O error
/// names its file and prints its OS error, which is also its source, and a context that names
/// a file is often followed by a cause that starts with the same file.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string().replace('\n', " ");
        if line.is_empty() {
            line = text;
            continue;
        }
        if line.ends_with(&text) {
            continue;
        }
        // The longest `PREFIX: ` of the cause that the line already ends with is left out.
        let repeated =
            text.match_indices(": ").map(|(i, _)| i).filter(|&i| line.ends_with(&text[..i])).last();
        line.push_str(": ");
        line.push_str(repeated.map_or(&text[..], |i| &text[i + 2..]));
    }
    line
}

/// All of `reader` as UTF-8 text, refusing more than `limit` bytes: `what` names the source
/// in the message (a prompt piped from /dev/zero would otherwise grow without bound).
pub fn read_text(reader: impl std::io::Read, limit: u64, what: &str) -> Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    reader.take(limit + 1).read_to_end(&mut bytes).with_context(|| format!("reading {what}"))?;
    if bytes.len() as u64 > limit {
        bail!("{what} is longer than {} MiB", limit >> 20);
    }
    String::from_utf8(bytes)
        .map_err(|e| anyhow!("{what} is not UTF-8 text (byte {})", e.utf8_error().valid_up_to()))
}

/// The lines of `reader` without their `\n`, each at most `limit` bytes (an error past that,
/// rather than a line that grows without bound).
pub fn bounded_lines<R: std::io::BufRead>(
    mut reader: R,
    limit: u64,
) -> impl Iterator<Item = std::io::Result<String>> {
    use std::io::{BufRead, Error, ErrorKind, Read};
    std::iter::from_fn(move || {
        let mut line = Vec::new();
        match (&mut reader).take(limit + 1).read_until(b'\n', &mut line) {
            Ok(0) => None,
            Ok(_) => {
                if line.last() == Some(&b'\n') {
                    line.pop();
                } else if line.len() as u64 > limit {
                    let message = format!("a line of input is longer than {} MiB", limit >> 20);
                    return Some(Err(Error::new(ErrorKind::InvalidData, message)));
                }
                Some(
                    String::from_utf8(line)
                        .map_err(|_| Error::new(ErrorKind::InvalidData, "the input is not UTF-8 text")),
                )
            }
            Err(e) => Some(Err(e)),
        }
    })
}

/// Tokens per second, 0 when nothing was timed.
pub fn rate(tokens: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_told_from_paths() {
        assert!(looks_like_repo_id("Qwen/Qwen3.5-0.8B"));
        for path in ["./Qwen3.5", "/tmp/x/y", "a/b/c", "../x", "model", "a/", "a b/c"] {
            assert!(!looks_like_repo_id(path), "{path}");
        }
    }

    #[test]
    fn ids_parse_and_bad_ones_are_named() {
        assert_eq!(parse_ids("1, 2,3").unwrap(), vec![1, 2, 3]);
        assert!(parse_ids("x,y").unwrap_err().to_string().contains("`x`"));
        assert!(parse_ids("-1").is_err());
        assert!(parse_ids(",").is_err());
        assert!(parse_ids(" ").unwrap_err().to_string().contains("empty"));
        assert!(parse_ids("1,,2").unwrap_err().to_string().contains("id 2 is empty"));
        assert!(parse_ids("1,2,").unwrap_err().to_string().contains("id 3 is empty"));
        assert!(parse_ids("4294967296").unwrap_err().to_string().contains("not a token id"));
    }

    #[test]
    fn input_is_read_within_its_bounds() {
        use std::io::Read;
        assert_eq!(read_text(&b"hello"[..], 5, "the prompt").unwrap(), "hello");
        let e = read_text(std::io::repeat(0).take(1 << 21), 1 << 20, "the prompt").unwrap_err();
        assert_eq!(e.to_string(), "the prompt is longer than 1 MiB");
        assert!(read_text(&b"\xff"[..], 5, "x").unwrap_err().to_string().contains("UTF-8"));
        let lines: Vec<_> = bounded_lines(&b"ab\r\ncd\nef"[..], 4).map(Result::unwrap).collect();
        assert_eq!(lines, ["ab\r", "cd", "ef"]);
        let mut long = bounded_lines(std::io::BufReader::new(std::io::repeat(b'x').take(100)), 10);
        assert!(long.next().unwrap().unwrap_err().to_string().contains("longer than"));
    }

    #[test]
    fn error_lines_say_each_thing_once() {
        let io =
            || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        // The library's I/O error is its own source.
        let e = anyhow::Error::from(strix::Error::io("/m/config.json", io()));
        assert_eq!(error_line(&e), "/m/config.json: No such file or directory (os error 2)");
        // A context naming the file the cause starts with.
        let e = e.context("writing /m/config.json");
        assert_eq!(error_line(&e), "writing /m/config.json: No such file or directory (os error 2)");
        // Distinct causes are all kept.
        let e = anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_line(&e), "outer: middle: inner");
        let e = anyhow!("two\nlines");
        assert_eq!(error_line(&e), "two lines");
    }

    #[test]
    fn hub_options_follow_the_huggingface_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let o = hub_options(env(&[("HOME", "/home/u")])).unwrap();
        assert_eq!(o.cache_dir, Path::new("/home/u/.cache/huggingface/hub"));
        assert_eq!((o.endpoint.as_str(), o.offline), (DEFAULT_ENDPOINT, false));
        let o = hub_options(env(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")])).unwrap();
        assert_eq!(o.cache_dir, Path::new("/x/huggingface/hub"));
        let o = hub_options(env(&[
            ("HF_HOME", "/hf"),
            ("HF_ENDPOINT", "http://mirror:8080/"),
            ("HF_TOKEN", " hf_abc "),
            ("HF_HUB_OFFLINE", "TRUE"),
            ("HF_HUB_DOWNLOAD_TIMEOUT", "2.5"),
        ]))
        .unwrap();
        assert_eq!(o.cache_dir, Path::new("/hf/hub"));
        assert_eq!(
            (o.endpoint.as_str(), o.token.as_deref(), o.offline),
            ("http://mirror:8080/", Some("hf_abc"), true)
        );
        assert_eq!(o.timeout, std::time::Duration::from_millis(2500));
        let o =
            hub_options(env(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/c"), ("HF_HUB_OFFLINE", "0")])).unwrap();
        assert_eq!((o.cache_dir.as_path(), o.offline), (Path::new("/c"), false));

        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_from_file\n").unwrap();
        let home = dir.path().display().to_string();
        let o = hub_options(|k: &str| (k == "HF_HOME").then(|| home.clone())).unwrap();
        assert_eq!(o.token.as_deref(), Some("hf_from_file"));

        assert!(hub_options(env(&[])).unwrap_err().to_string().contains("HF_HOME"));
        let e = hub_options(env(&[("HOME", "/h"), ("HF_HUB_DOWNLOAD_TIMEOUT", "-1")])).unwrap_err();
        assert!(e.to_string().contains("HF_HUB_DOWNLOAD_TIMEOUT"), "{e}");

        // The proxy of the endpoint's scheme, unless NO_PROXY covers its host.
        let o = hub_options(env(&[
            ("HOME", "/h"),
            ("https_proxy", "http://p:3128"),
            ("HTTP_PROXY", "http://q:1"),
        ]));
        assert_eq!(o.unwrap().proxy.as_deref(), Some("http://p:3128"));
        let o = hub_options(env(&[
            ("HOME", "/h"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("ALL_PROXY", "socks5://s:1"),
        ]));
        assert_eq!(o.unwrap().proxy.as_deref(), Some("socks5://s:1"));
        let o = hub_options(env(&[
            ("HOME", "/h"),
            ("HTTPS_PROXY", "http://p:3128"),
            ("NO_PROXY", "localhost, .huggingface.co"),
        ]));
        assert_eq!(o.unwrap().proxy, None);
        assert!(bypasses_proxy("*", "example.org"));
        assert!(bypasses_proxy("example.org:443", "cdn.example.org"));
        assert!(!bypasses_proxy("ample.org", "example.org"));
        assert_eq!(url_host("http://u:p@[::1]:8080/x"), "::1");
        assert_eq!(url_host("https://huggingface.co"), "huggingface.co");
    }

    #[test]
    fn default_context_fits_the_request_within_the_model() {
        assert_eq!(context_size(None, 10, 262_144).unwrap(), DEFAULT_CONTEXT);
        assert_eq!(context_size(None, 10_000, 262_144).unwrap(), 10_000);
        assert_eq!(context_size(None, 10, 1024).unwrap(), 1024);
        assert_eq!(context_size(Some(16), 10, 1024).unwrap(), 16);
    }
}
