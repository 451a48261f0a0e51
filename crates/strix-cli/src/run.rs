//! `strix run`: one prompt (text, a chat message, or token ids) in, one completion out —
//! streamed to stdout, or as a single JSON object with `--json`.

use std::io::IsTerminal;

use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;
use strix::backend::Backend;
use strix::constraint::{thinking_prefix, Constraints, Grammar};
use strix::generate::{generate, GenerateParams};
use strix::model::Model;
use strix::sampling::SamplingParams;
use strix::tokenizer::Tokenizer;

use crate::common::{self, ChatTemplateArgs, ModelArgs, SamplingArgs, StdoutStream};
use crate::device::{self, with_backend, DeviceInfo};

#[derive(Args, Debug)]
#[command(after_help = "The prompt is PROMPT, --prompt, --prompt-ids, or (when none is given) all of stdin.
Without a tokenizer.json only --prompt-ids works, and the generated ids are printed.
With --json, stdout is one object: {\"prompt_ids\", \"ids\", \"text\", \"finish_reason\"
(eos | stop | length | context), \"seed\", \"timings\"}.
--json-schema FILE / --grammar FILE (Lark) constrain the output (structured output); with --chat
and the thinking block the template opens, the output starts with </think> and the answer.")]
pub struct RunArgs {
    /// The prompt text
    #[arg(value_name = "PROMPT")]
    pub prompt: Option<String>,

    /// The prompt text (the same as PROMPT)
    #[arg(short = 'p', long = "prompt", value_name = "TEXT", conflicts_with = "prompt")]
    pub prompt_flag: Option<String>,

    /// The prompt as token ids, e.g. 151644,872,198 (for models without a tokenizer)
    #[arg(long, value_name = "IDS", conflicts_with_all = ["prompt", "prompt_flag", "chat"])]
    pub prompt_ids: Option<String>,

    #[command(flatten)]
    pub model: ModelArgs,

    /// Generate at most N tokens
    #[arg(
        short = 'n',
        long,
        visible_alias = "n-predict",
        value_name = "N",
        default_value_t = 256,
        value_parser = crate::limits::tokens
    )]
    pub max_tokens: usize,

    /// Stop before this text (repeatable); it is not printed
    #[arg(long, value_name = "TEXT", value_parser = crate::limits::stop_text)]
    pub stop: Vec<String>,

    /// Keep generating past end-of-sequence tokens (until --max-tokens or the context is full)
    #[arg(long)]
    pub ignore_eos: bool,

    /// Context size in tokens [default: the prompt plus --max-tokens, at least 4096, at most
    /// the model's max_position_embeddings]
    #[arg(short = 'c', long, visible_alias = "ctx-size", value_name = "N", value_parser = crate::limits::tokens)]
    pub ctx: Option<usize>,

    /// Wrap the prompt in the model's chat template, as a user message
    #[arg(long)]
    pub chat: bool,

    #[command(flatten)]
    pub template: ChatTemplateArgs,

    /// Print one JSON object (ids, text, finish reason, timings) instead of streaming text
    #[arg(long)]
    pub json: bool,

    /// Print the device and the timings on stderr
    #[arg(short, long)]
    pub verbose: bool,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    /// Constrain the output to JSON valid under the JSON schema in FILE (structured output)
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,

    /// Constrain the output to the Lark grammar in FILE (llguidance's dialect; `start` rule)
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
}

/// Largest --json-schema or --grammar file read.
const GRAMMAR_FILE_CAP: strix::files::Cap = strix::files::Cap { what: "grammar file", bytes: 1 << 20 };

/// The grammar of --json-schema or --grammar, if either is given.
fn grammar_of(args: &RunArgs) -> Result<Option<Grammar>> {
    let read = |path: &std::path::Path| -> Result<String> {
        let bytes = strix::files::read_capped(path, GRAMMAR_FILE_CAP)?;
        String::from_utf8(bytes).map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", path.display()))
    };
    if let Some(path) = &args.json_schema {
        let schema: serde_json::Value = serde_json::from_str(&read(path)?)
            .map_err(|e| anyhow::anyhow!("{}: not a JSON schema: {e}", path.display()))?;
        return Ok(Some(Grammar::JsonSchema(schema)));
    }
    args.grammar.as_deref().map(|path| Ok(Grammar::Lark(read(path)?))).transpose()
}

pub fn run(args: RunArgs) -> Result<()> {
    common::init_threads(args.model.threads)?;
    common::on_pool(|| run_on_pool(args))
}

fn run_on_pool(args: RunArgs) -> Result<()> {
    if !args.chat && (args.template.system.is_some() || args.template.enable_thinking().is_some()) {
        bail!("--system, --think and --no-think apply to the chat template: add --chat");
    }
    let sampling = args.sampling.params()?;
    let files = common::resolve_model(args.model.model.as_deref())?;
    let tokenizer = common::load_tokenizer(&files)?;
    if !args.stop.is_empty() && tokenizer.is_none() {
        bail!("--stop matches text, and {} has no tokenizer.json to decode ids with", files.path().display());
    }

    let prompt_ids = match &args.prompt_ids {
        Some(ids) => common::parse_ids(ids)?,
        None => {
            let text = prompt_text(&args)?;
            let tokenizer = common::require_tokenizer(tokenizer.as_ref(), files.path(), "a text prompt")?;
            encode_prompt(&args, &files, tokenizer, &text)?
        }
    };

    let opened = device::open(&args.model.device, args.verbose)?;
    with_backend!(opened, backend => {
        // One sequence at a time: the GEMV that streams fastest at batch 1.
        backend.tune_for_single_stream(true);
        let mut model = crate::quant_flag::load_model(files, backend, args.model.quant.quant)?;
        args.model.device.configure(&mut model)?;
        run_with(&model, &args, tokenizer.as_ref(), &prompt_ids, &sampling)
    })
}

/// Generates the completion on whichever backend the model was loaded on.
fn run_with<B: Backend>(
    model: &Model<B>,
    args: &RunArgs,
    tokenizer: Option<&Tokenizer>,
    prompt_ids: &[u32],
    sampling: &SamplingParams,
) -> Result<()> {
    common::check_ids(prompt_ids, model.config.vocab_size)?;
    let ctx = common::context_size(
        args.ctx,
        prompt_ids.len() + args.max_tokens,
        model.config.max_position_embeddings,
    )?;
    if prompt_ids.len() > ctx {
        bail!("the prompt has {} tokens, more than the {ctx}-token context (--ctx)", prompt_ids.len());
    }

    let constraint = match grammar_of(args)? {
        None => None,
        Some(grammar) => {
            let Some(tokenizer) = tokenizer else {
                bail!("--json-schema and --grammar constrain text, and this model has no tokenizer.json");
            };
            let constraints =
                Constraints::new(tokenizer, model.config.vocab_size, &model.config.eos_token_ids)?;
            let prompt = tokenizer.decode(prompt_ids, false)?;
            Some(constraints.compile(&grammar, thinking_prefix(&prompt))?)
        }
    };
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling: sampling.clone(),
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        constraint,
    };
    let mut session = model.try_new_session(ctx)?;
    let mut out = StdoutStream::default();
    let generated = generate(model, &mut session, prompt_ids, tokenizer, &params, |text| {
        if !args.json {
            out.write(text)
        }
    })?;

    if args.json {
        let t = &generated.timings;
        let object = json!({
            "prompt_ids": prompt_ids,
            "ids": generated.ids,
            "text": generated.text,
            "finish_reason": generated.finish,
            "seed": (!sampling.is_greedy()).then_some(sampling.seed).flatten(),
            "timings": {
                "prefill_tokens": t.prefill_tokens,
                "prefill_seconds": t.prefill_seconds,
                "prefill_tok_s": t.prefill_tokens_per_second(),
                "decode_tokens": t.decode_tokens,
                "decode_seconds": t.decode_seconds,
                "decode_tok_s": t.decode_tokens_per_second(),
            },
        });
        out.write(&format!("{object}\n"));
    } else if tokenizer.is_none() {
        // Nothing was streamed: without a tokenizer the ids are the output.
        let ids: Vec<String> = generated.ids.iter().map(u32::to_string).collect();
        out.write(&format!("{}\n", ids.join(",")));
    } else if std::io::stdout().is_terminal() && !generated.text.ends_with('\n') {
        // Leave the shell prompt on its own line; a pipe gets the completion exactly.
        out.write("\n");
    }
    out.finish()?;

    if args.verbose {
        let t = &generated.timings;
        eprintln!(
            "strix: prompt {} tokens in {:.3} s ({:.1} tok/s); generated {} tokens, decode {:.1} tok/s; \
             finish: {}; seed: {}",
            t.prefill_tokens,
            t.prefill_seconds,
            t.prefill_tokens_per_second(),
            generated.ids.len(),
            t.decode_tokens_per_second(),
            serde_json::to_value(generated.finish)?.as_str().unwrap_or("?"),
            sampling.seed.filter(|_| !sampling.is_greedy()).map_or("-".to_string(), |s| s.to_string()),
        );
    }
    Ok(())
}

/// PROMPT, --prompt, or stdin when neither is given and stdin is not a terminal.
fn prompt_text(args: &RunArgs) -> Result<String> {
    if let Some(text) = args.prompt.as_ref().or(args.prompt_flag.as_ref()) {
        return Ok(text.clone());
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        bail!("no prompt: give PROMPT, --prompt-ids, or pipe the prompt on stdin");
    }
    common::read_text(stdin.lock(), crate::limits::MAX_PROMPT_BYTES, "the prompt on stdin")
}

/// The ids of a text prompt, through the chat template with `--chat`.
fn encode_prompt(
    args: &RunArgs,
    files: &strix::model::ModelFiles,
    tokenizer: &Tokenizer,
    text: &str,
) -> Result<Vec<u32>> {
    let ids = if args.chat {
        let template = common::require_template(files)?;
        let mut messages = args.template.system_messages();
        messages.push(strix::chat::ChatMessage::user(text));
        let rendered = template.render(&messages, &args.template.options(true))?;
        // The template writes the special tokens out; they are parsed, not re-added.
        tokenizer.encode(&rendered, false)?
    } else {
        tokenizer.encode(text, true)?
    };
    if ids.is_empty() {
        bail!("the prompt is empty (0 tokens)");
    }
    Ok(ids)
}
