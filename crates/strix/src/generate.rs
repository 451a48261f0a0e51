//! The decode loop: prefill a prompt into a session, then sample one token at a time until an
//! end-of-sequence token, a stop string, the token budget or the context runs out — streaming
//! the text as it completes.

use std::time::Instant;

use serde::Serialize;

use crate::backend::Backend;
use crate::error::Result;
use crate::model::{Logits, Model};
use crate::sampling::{sample_prepared, Sampler, SamplingParams, StopMatcher};
use crate::session::Session;
use crate::tokenizer::Tokenizer;

/// What to generate and when to stop.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before the first occurrence of any of these; the stop string is not emitted.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string appeared in the text.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The session's context is full.
    Context,
}

/// Wall-clock time spent in the prefill and in the decode steps.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    pub prefill_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_tokens: usize,
    pub decode_seconds: f64,
}

impl Timings {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prefill_tokens, self.prefill_seconds)
    }
    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.decode_tokens, self.decode_seconds)
    }
}

fn rate(tokens: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

#[derive(Clone, Debug)]
pub struct Generated {
    /// The sampled ids, the final end-of-sequence token included when there was one.
    pub ids: Vec<u32>,
    /// The streamed text (special tokens and stop strings left out).
    pub text: String,
    pub finish: FinishReason,
    pub timings: Timings,
}

/// Feeds `prompt` to `session` and samples a continuation, calling `on_text` with each piece
/// of text as soon as it is complete UTF-8 and cannot be the start of a stop string.
///
/// The session ends holding the prompt and every generated token but the last (its logits were
/// never needed); feed that one too before continuing the conversation.
pub fn generate<B: Backend>(
    model: &Model<B>,
    session: &mut Session<B>,
    prompt: &[u32],
    tokenizer: Option<&Tokenizer>,
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<Generated> {
    let mut sampler = Sampler::new(params.sampling.clone())?;
    params.sampling.validate_vocab(model.config.vocab_size)?;
    let mut decoder = tokenizer.map(|t| t.stream_decoder(true));
    let mut stops = StopMatcher::new(params.stop.clone());
    let mut history = session.tokens().to_vec();
    history.extend_from_slice(prompt);

    let mut timings = Timings { prefill_tokens: prompt.len(), ..Timings::default() };
    let start = Instant::now();
    let mut logits = model.forward(session, prompt, Logits::Last)?;
    timings.prefill_seconds = start.elapsed().as_secs_f64();

    // Only the token comes back from the backend after the first: greedy decoding as an
    // argmax, any other draw finished next to the logits (`Model::decode_batch_prepared`).
    let plain_greedy = params.sampling.is_greedy() && !params.sampling.adjusts_logits();
    let mut picked: Option<u32> = None;
    let mut ids = Vec::new();
    let mut text = String::new();
    let decode_start = Instant::now();
    let mut finish = loop {
        if ids.len() >= params.max_tokens {
            break FinishReason::Length;
        }
        let token = match picked.take() {
            Some(token) => token,
            None => sample_prepared(&mut logits, &sampler.prepare(&history, &ids, None))?.token,
        };
        ids.push(token);
        if !params.ignore_eos && model.config.eos_token_ids.contains(&token) {
            break FinishReason::Eos;
        }
        if let Some(decoder) = decoder.as_mut() {
            let piece = decoder.push_sampled(token)?;
            let (emit, hit) = stops.push(&piece);
            on_text(&emit);
            text.push_str(&emit);
            if hit {
                break FinishReason::Stop;
            }
        }
        if ids.len() >= params.max_tokens {
            break FinishReason::Length;
        }
        if session.remaining() == 0 {
            break FinishReason::Context;
        }
        picked = Some(if plain_greedy {
            model.decode_batch_greedy(&mut [&mut *session], &[token])?[0]
        } else {
            let row = sampler.prepare(&history, &ids, None);
            let draw = model.decode_batch_prepared(&mut [&mut *session], &[token], &[row])?.remove(0);
            draw?.token
        });
        timings.decode_tokens += 1;
    };
    timings.decode_seconds = decode_start.elapsed().as_secs_f64();
    if finish != FinishReason::Stop {
        if let Some(decoder) = decoder.as_mut() {
            let (mut emit, hit) = stops.push(&decoder.flush()?);
            if hit {
                finish = FinishReason::Stop;
            } else {
                emit.push_str(&stops.finish());
            }
            on_text(&emit);
            text.push_str(&emit);
        }
    }
    Ok(Generated { ids, text, finish, timings })
}
