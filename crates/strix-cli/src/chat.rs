//! `strix chat`: a multi-turn conversation on stdin/stdout that keeps one session across
//! turns, so each turn prefills only its own tokens, never the whole history again.
//!
//! After a turn the session holds the prompt, the answer and the end-of-turn token. For the
//! next user message the conversation is rendered twice, as llama.cpp does: PAST (the history,
//! ending with the answer, no generation prompt) and NEW (plus the new message, with the
//! generation prompt). When NEW starts with PAST, the tokens to feed are what follows the
//! end-of-turn token in PAST (the "\n" after `<|im_end|>`) followed by NEW past PAST.
//!
//! Qwen3.5's template never passes that test: an answer is rendered with its `<think>` block
//! while it is the last message, and without it once a user message follows. A recurrent
//! state cannot be rolled back to before the thinking, so matching the template exactly
//! means re-prefilling everything, every turn. By default the session keeps the answer as it
//! was generated (thinking included) and only the new turn is fed, located in NEW just past
//! its history (see [`new_turn_start`]); `--exact-history` re-prefills the whole conversation
//! as the template renders it instead.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use strix::backend::Backend;
use strix::chat::{ChatMessage, ChatOptions, ChatTemplate};
use strix::generate::{generate, FinishReason, GenerateParams};
use strix::model::{Logits, Model};
use strix::session::Session;
use strix::tokenizer::Tokenizer;

use crate::common::{self, ChatTemplateArgs, ModelArgs, SamplingArgs, StdoutStream};
use crate::device::{self, with_backend, DeviceInfo};

#[derive(Args, Debug)]
#[command(
    after_help = "Each line of stdin is a user message; end a line with \\ to continue the message on the
next line. Commands: /reset (forget the conversation), /exit or end of input (quit).
With --verbose, each turn prints on stderr the tokens it prefilled and the speeds."
)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub template: ChatTemplateArgs,

    /// Answer with at most N tokens per turn [default: until the end of the turn or a full
    /// context]
    #[arg(short = 'n', long, visible_alias = "n-predict", value_name = "N", value_parser = crate::limits::tokens)]
    pub max_tokens: Option<usize>,

    /// Stop an answer before this text (repeatable)
    #[arg(long, value_name = "TEXT", value_parser = crate::limits::stop_text)]
    pub stop: Vec<String>,

    /// Context size in tokens, for the whole conversation [default: 4096, at most the model's
    /// max_position_embeddings]
    #[arg(short = 'c', long, visible_alias = "ctx-size", value_name = "N", value_parser = crate::limits::tokens)]
    pub ctx: Option<usize>,

    /// When the chat template renders earlier turns differently from how they were generated
    /// (Qwen3.5 drops the thinking of past answers), re-prefill the whole conversation as
    /// rendered instead of feeding only the new turn
    #[arg(long)]
    pub exact_history: bool,

    /// Print the device and per-turn statistics on stderr
    #[arg(short, long)]
    pub verbose: bool,

    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// The conversation: its messages and the session that has seen them.
struct Conversation<'m, B: Backend> {
    model: &'m Model<B>,
    template: &'m ChatTemplate,
    tokenizer: &'m Tokenizer,
    args: &'m ChatArgs,
    /// The system message (if any) and the turns so far.
    messages: Vec<ChatMessage>,
    session: Session<B>,
    ctx: usize,
    /// The token that ends a turn in the template's text (`<|im_end|>`), and its text.
    end_of_turn: Option<(u32, String)>,
    /// Set when the session could not be closed after a turn; the next turn starts afresh.
    stale: bool,
    turn: usize,
    /// Whether --verbose has explained that the template rewrites history.
    noted_rewrite: bool,
}

pub fn chat(args: ChatArgs) -> Result<()> {
    common::init_threads(args.model.threads)?;
    // Validate the flags before the (possibly long) load.
    args.sampling.params()?;
    let files = common::resolve_model(args.model.model.as_deref())?;
    let dir = files.path().to_path_buf();
    let tokenizer = common::load_tokenizer(&files)?
        .ok_or_else(|| anyhow!("{} has no tokenizer.json, which chat needs", dir.display()))?;
    let template = common::require_template(&files)?;
    let opened = device::open(&args.model.device, args.verbose)?;
    with_backend!(opened, backend => {
        // One sequence at a time: the GEMV that streams fastest at batch 1.
        backend.tune_for_single_stream(true);
        let mut model = crate::quant_flag::load_model(files, backend, args.model.quant.quant)?;
        args.model.device.configure(&mut model)?;
        chat_with(&model, &args, &dir, &tokenizer, &template)
    })
}

/// The conversation loop, on whichever backend the model was loaded on.
fn chat_with<B: Backend>(
    model: &Model<B>,
    args: &ChatArgs,
    dir: &std::path::Path,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<()> {
    let ctx = common::context_size(args.ctx, 0, model.config.max_position_embeddings)?;
    let end_of_turn = find_end_of_turn(template, tokenizer, &model.config.eos_token_ids)?;
    if end_of_turn.is_none() && args.verbose {
        eprintln!(
            "strix: the chat template ends turns with no end-of-sequence token; every turn re-prefills"
        );
    }

    let mut conversation = Conversation {
        model,
        template,
        tokenizer,
        args,
        messages: args.template.system_messages(),
        session: model.try_new_session(ctx)?,
        ctx,
        end_of_turn,
        stale: false,
        turn: 0,
        noted_rewrite: false,
    };

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("strix: chatting with {} (/reset to start over, /exit or Ctrl-D to quit)", dir.display());
    }
    let mut lines = common::bounded_lines(std::io::stdin().lock(), crate::limits::MAX_PROMPT_BYTES);
    let mut failed = 0usize;
    loop {
        if interactive {
            // A prompt that cannot be shown is no reason to stop reading.
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(b"> ").and_then(|_| out.flush());
        }
        let Some(message) = read_message(&mut lines)? else { break };
        match message.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                conversation.reset();
                if interactive || args.verbose {
                    eprintln!("strix: conversation reset");
                }
                continue;
            }
            _ => {}
        }
        if let Err(e) = conversation.turn(&message) {
            failed += 1;
            eprintln!("error: {}", common::error_line(&e));
        }
    }
    if failed > 0 {
        bail!("{failed} turn(s) failed");
    }
    Ok(())
}

/// One user message: a line, or several joined where a line ends with a backslash.
/// `None` at the end of input.
fn read_message(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> Result<Option<String>> {
    let mut message = String::new();
    for line in lines {
        let line = line.context("reading stdin")?;
        let line = line.strip_suffix('\r').unwrap_or(&line);
        match line.strip_suffix('\\') {
            Some(part) => {
                if (message.len() + part.len()) as u64 > crate::limits::MAX_PROMPT_BYTES {
                    bail!("a message on stdin is longer than {} MiB", crate::limits::MAX_PROMPT_BYTES >> 20);
                }
                message.push_str(part);
                message.push('\n');
            }
            None => {
                message.push_str(line);
                return Ok(Some(message));
            }
        }
    }
    Ok((!message.is_empty()).then_some(message))
}

/// The end-of-sequence token that closes a turn in the template's text: the template's
/// `eos_token` if it appears in a rendered answer, else the first of the model's that does.
fn find_end_of_turn(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    eos_ids: &[u32],
) -> Result<Option<(u32, String)>> {
    let sample =
        template.render(&[ChatMessage::user("x"), ChatMessage::assistant("y")], &ChatOptions::default())?;
    let named = template.eos_token().and_then(|t| tokenizer.token_to_id(t));
    for id in named.into_iter().chain(eos_ids.iter().copied()) {
        let Ok(text) = tokenizer.decode(&[id], false) else { continue };
        if !text.is_empty() && sample.contains(&text) {
            return Ok(Some((id, text)));
        }
    }
    Ok(None)
}

/// Where the new turn starts in `new`, the rendering of `history` plus a user message with
/// the generation prompt: just past the end-of-turn text that closes the history. The user
/// message's text is located by rendering two different messages after the same history
/// (their common prefix ends where the message does), so a message that itself contains
/// the end-of-turn text cannot mislead the search.
fn new_turn_start(
    template: &ChatTemplate,
    history: &[ChatMessage],
    new: &str,
    options: &ChatOptions,
    end_of_turn: &str,
) -> Result<Option<usize>> {
    let probe = |text: &str| -> Result<String> {
        let mut messages = history.to_vec();
        messages.push(ChatMessage::user(text));
        Ok(template.render(&messages, options)?)
    };
    let (a, b) = (probe("A")?, probe("B")?);
    let content = a.char_indices().zip(b.chars()).find(|((_, x), y)| x != y).map_or(a.len(), |((i, _), _)| i);
    if !new.starts_with(&a[..content]) {
        return Ok(None);
    }
    Ok(new[..content].rfind(end_of_turn).map(|i| i + end_of_turn.len()))
}

/// The text that takes a session holding `history` (up to its end-of-turn token `eot`) to
/// `new`, the rendering of `history` plus a user message with the generation prompt; and
/// whether the template rendered `history` differently there than on its own. `None` when
/// only a fresh prefill of `new` will do.
fn turn_suffix(
    template: &ChatTemplate,
    history: &[ChatMessage],
    new: &str,
    without_prompt: &ChatOptions,
    with_prompt: &ChatOptions,
    eot: &str,
    exact_history: bool,
) -> Result<(Option<String>, bool)> {
    let past = template.render(history, without_prompt)?;
    if let Some(added) = new.strip_prefix(past.as_str()) {
        // llama.cpp's rule: the session ends at the end-of-turn token; feed what PAST has
        // after it, then NEW past PAST.
        let tail = past.rfind(eot).map(|i| &past[i + eot.len()..]);
        return Ok((tail.map(|tail| format!("{tail}{added}")), false));
    }
    if exact_history {
        return Ok((None, true));
    }
    let start = new_turn_start(template, history, new, with_prompt, eot)?;
    Ok((start.map(|i| new[i..].to_string()), true))
}

/// What a turn feeds the session.
struct Prefill {
    ids: Vec<u32>,
    /// Whether the session was reset first.
    fresh: bool,
    /// Whether the template rendered the history differently from what the session holds.
    rewritten: bool,
}

impl<B: Backend> Conversation<'_, B> {
    fn reset(&mut self) {
        self.messages = self.args.template.system_messages();
        self.session = self.model.new_session(self.ctx);
        self.stale = false;
    }

    fn turn(&mut self, text: &str) -> Result<()> {
        self.turn += 1;
        let user = ChatMessage::user(text);
        let prefill = self.prefill_for(&user)?;
        if prefill.rewritten && self.args.verbose && !self.noted_rewrite {
            self.noted_rewrite = true;
            eprintln!(
                "strix: the chat template renders earlier answers differently once a new message follows \
                 (Qwen3.5 drops their thinking); {}",
                if self.args.exact_history {
                    "re-prefilling the whole conversation as rendered (--exact-history)"
                } else {
                    "keeping them as generated and feeding only each new turn (--exact-history re-prefills)"
                }
            );
        }
        if prefill.fresh {
            self.session = self.model.new_session(self.ctx);
        }
        let position = self.session.position();
        let params = GenerateParams {
            max_tokens: self.args.max_tokens.unwrap_or(usize::MAX),
            sampling: self.args.sampling.params()?,
            stop: self.args.stop.clone(),
            ignore_eos: false,
            constraint: None,
        };
        let mut out = StdoutStream::default();
        let started = Instant::now();
        let result =
            generate(self.model, &mut self.session, &prefill.ids, Some(self.tokenizer), &params, |t| {
                out.write(t)
            });
        let generated = match result {
            Ok(generated) => generated,
            Err(e) => {
                // A failed forward pass may have advanced the session part way.
                self.stale = true;
                return Err(e.into());
            }
        };
        out.write("\n");
        out.finish()?;

        self.messages.push(user);
        self.messages.push(ChatMessage::assistant(generated.text.as_str()));
        self.close_turn(&generated.ids, generated.finish)?;

        if self.args.verbose {
            let t = &generated.timings;
            eprintln!(
                "[turn {}] prefilled {} tokens at position {} ({}) in {:.3} s ({:.1} tok/s); \
                 generated {} tokens ({:.1} tok/s, finish: {}); context {}/{}; {:.2} s",
                self.turn,
                prefill.ids.len(),
                position,
                if prefill.fresh { "full conversation" } else { "new turn only" },
                t.prefill_seconds,
                t.prefill_tokens_per_second(),
                generated.ids.len(),
                t.decode_tokens_per_second(),
                serde_json::to_value(generated.finish)?.as_str().unwrap_or("?"),
                self.session.position(),
                self.ctx,
                started.elapsed().as_secs_f64(),
            );
        }
        if generated.finish == FinishReason::Context {
            eprintln!("strix: the {}-token context is full: /reset, or start with a larger --ctx", self.ctx);
        }
        Ok(())
    }

    /// The tokens that bring the session from the conversation so far to `user`'s turn and
    /// the generation prompt.
    fn prefill_for(&self, user: &ChatMessage) -> Result<Prefill> {
        let with_prompt = self.args.template.options(true);
        let mut messages = self.messages.clone();
        messages.push(user.clone());
        let new = self.template.render(&messages, &with_prompt)?;
        let whole = || -> Result<Prefill> {
            let ids = self.tokenizer.encode(&new, false)?;
            if ids.len() > self.ctx {
                bail!(
                    "the conversation needs {} tokens, more than the {}-token context: /reset or a larger --ctx",
                    ids.len(),
                    self.ctx
                );
            }
            Ok(Prefill { ids, fresh: true, rewritten: false })
        };
        let Some((_, eot)) = self.end_of_turn.as_ref().filter(|_| self.session.position() > 0 && !self.stale)
        else {
            return whole();
        };

        let (suffix, rewritten) = turn_suffix(
            self.template,
            &self.messages,
            &new,
            &self.args.template.options(false),
            &with_prompt,
            eot,
            self.args.exact_history,
        )?;
        let Some(suffix) = suffix else {
            return Ok(Prefill { rewritten, ..whole()? });
        };
        let ids = self.tokenizer.encode(&suffix, false)?;
        if ids.len() > self.session.remaining() {
            // What no longer fits incrementally may fit rendered afresh (rewritten history
            // can be shorter than what the session holds).
            return Ok(Prefill { rewritten, ..whole()? });
        }
        Ok(Prefill { ids, fresh: false, rewritten })
    }

    /// Leaves the session ending with the end-of-turn token, as the rendered history does:
    /// `generate` does not feed the last sampled token, and an answer cut short (length,
    /// stop string) has no end-of-turn token at all.
    fn close_turn(&mut self, ids: &[u32], finish: FinishReason) -> Result<()> {
        let Some((eot, _)) = self.end_of_turn else {
            self.stale = true;
            return Ok(());
        };
        let eos = &self.model.config.eos_token_ids;
        let mut feed = Vec::with_capacity(2);
        match ids.last() {
            Some(&last) if last == eot => feed.push(eot),
            // Another end-of-sequence token (`<|endoftext|>`) is not the template's.
            Some(&last) if eos.contains(&last) => feed.push(eot),
            Some(&last) => feed.extend([last, eot]),
            None => feed.push(eot),
        }
        if finish == FinishReason::Context || feed.len() > self.session.remaining() {
            self.stale = true;
            return Ok(());
        }
        if let Err(e) = self.model.forward(&mut self.session, &feed, Logits::Last) {
            self.stale = true;
            return Err(e.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ChatML without thinking: history renders the same whatever follows it.
    const CHATML: &str =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                          {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn options(add_generation_prompt: bool) -> ChatOptions {
        ChatOptions { add_generation_prompt, ..ChatOptions::default() }
    }

    fn suffix(
        template: &ChatTemplate,
        history: &[ChatMessage],
        user: &str,
        exact: bool,
    ) -> (Option<String>, bool) {
        let mut messages = history.to_vec();
        messages.push(ChatMessage::user(user));
        let new = template.render(&messages, &options(true)).unwrap();
        turn_suffix(template, history, &new, &options(false), &options(true), "<|im_end|>", exact).unwrap()
    }

    #[test]
    fn a_stable_template_feeds_what_follows_the_end_of_turn_token() {
        let template = ChatTemplate::from_source(CHATML).unwrap();
        let history = [ChatMessage::user("hi"), ChatMessage::assistant("hello")];
        let (text, rewritten) = suffix(&template, &history, "bye", false);
        assert!(!rewritten);
        assert_eq!(text.unwrap(), "\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn qwen35_drops_past_thinking_and_only_the_new_turn_is_fed() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/models/causal-bf16-gdn3x");
        let template = ChatTemplate::from_model_dir(dir).unwrap().unwrap();
        let history = [
            ChatMessage::system("sys"),
            ChatMessage::user("hi"),
            ChatMessage::assistant("pondering\n</think>\n\nhello"),
        ];
        // The user's text holds the end-of-turn marker: it must not be taken for the history's end.
        let (text, rewritten) = suffix(&template, &history, "a<|im_end|>b", false);
        assert!(rewritten);
        assert_eq!(
            text.unwrap(),
            "\n<|im_start|>user\na<|im_end|>b<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );
        assert_eq!(suffix(&template, &history, "bye", true), (None, true));
    }
}
