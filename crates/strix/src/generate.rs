//! The decode loop: prefill a prompt into a session, then sample one token at a time until an
//! end-of-sequence token, a stop string, the token budget or the context runs out — streaming
//! the text as it completes. [`Sequence`] holds those rules for one sequence; [`generate`] is a
//! batch of one, and the server's engine runs every sequence of its batches through it too.
//!
//! A sequence may carry a grammar ([`Constraint`], structured output): [`Sequence::allowed`]
//! gives the mask its next draw applies, [`Sequence::accept`] advances the grammar with the
//! drawn token, and the sequence ends as soon as the grammar is complete. The mask of a decode
//! step is computed while the backend runs the step ([`Model::decode_batch_masked`]).

use std::time::Instant;

use serde::Serialize;

use crate::backend::Backend;
use crate::constraint::{Constraint, TokenMask};
use crate::error::Result;
use crate::model::Model;
use crate::sampling::{PreparedSample, Sampler, SamplingParams, StopMatcher};
use crate::session::Session;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// What to generate and when to stop.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before the first occurrence of any of these; the stop string is not emitted.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Structured output: the grammar every generated token must follow.
    pub constraint: Option<Constraint>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            ignore_eos: false,
            constraint: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-sequence token, or the sequence's grammar is complete.
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

/// One sequence's generated side: the tokens sampled so far, their text as it becomes final
/// (complete UTF-8 that cannot be the start of a stop string), and why the sequence ends.
pub struct Sequence {
    decoder: Option<StreamDecoder>,
    stops: StopMatcher,
    /// End-of-sequence ids (none when they are ignored).
    eos: Vec<u32>,
    max_tokens: usize,
    generated: Vec<u32>,
    constraint: Option<Constraint>,
}

/// What [`Sequence::accept`] made of a token.
#[derive(Debug, PartialEq, Eq)]
pub struct Accepted {
    /// The text the token completes (often empty: part of a character, or of what may be a
    /// stop string); `None` for an end-of-sequence token, which has none.
    pub text: Option<String>,
    /// Why the sequence ends with this token, if it does.
    pub finish: Option<FinishReason>,
}

impl Sequence {
    /// `decoder`: `None` when there is no tokenizer (ids only, no text and no stop strings).
    pub fn new(
        decoder: Option<StreamDecoder>,
        stops: StopMatcher,
        eos: &[u32],
        ignore_eos: bool,
        max_tokens: usize,
    ) -> Sequence {
        Sequence {
            decoder,
            stops,
            eos: if ignore_eos { Vec::new() } else { eos.to_vec() },
            max_tokens,
            generated: Vec::with_capacity(max_tokens.min(1024)),
            constraint: None,
        }
    }

    /// The sequence with a grammar its tokens must follow (structured output).
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> Sequence {
        self.constraint = constraint;
        self
    }

    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// The mask of the next draw: `None` when unconstrained. An error when the grammar failed
    /// (llguidance's limits on the work of one step).
    pub fn allowed(&mut self) -> Result<Option<TokenMask>> {
        self.constraint.as_mut().map(Constraint::allowed).transpose()
    }

    /// The tokens accepted so far, an end-of-sequence token included.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Takes `token` as the sequence's next; `context_left` is how many more tokens the
    /// session can hold. Ends on an end-of-sequence token, then a stop string, then a
    /// completed grammar, then the token budget, then the context. A piece the tokenizer cannot
    /// decode carries no text (ids a model can sample past the tokenizer's vocabulary are not
    /// errors either). An error when a grammar does not allow the token (the draw ignored its
    /// mask).
    pub fn accept(&mut self, token: u32, context_left: usize) -> Result<Accepted> {
        self.generated.push(token);
        if let Some(constraint) = self.constraint.as_mut() {
            constraint.advance(token)?;
        }
        if self.eos.contains(&token) {
            return Ok(Accepted { text: None, finish: Some(FinishReason::Eos) });
        }
        let piece = match self.decoder.as_mut() {
            Some(decoder) => decoder.push_sampled(token).unwrap_or_default(),
            None => String::new(),
        };
        let (text, hit) = self.stops.push(&piece);
        let finish = if hit {
            Some(FinishReason::Stop)
        } else if self.constraint.as_ref().is_some_and(Constraint::is_finished) {
            // Only an end-of-sequence token could follow: no step is spent drawing it.
            Some(FinishReason::Eos)
        } else if self.generated.len() >= self.max_tokens {
            Some(FinishReason::Length)
        } else if context_left == 0 {
            Some(FinishReason::Context)
        } else {
            None
        };
        Ok(Accepted { text: Some(text), finish })
    }

    /// The end of the sequence: the text held back (released unless a stop string is found in
    /// it, which makes the reason `Stop`) and the final reason.
    pub fn finish(&mut self, finish: FinishReason) -> (String, FinishReason) {
        if finish == FinishReason::Stop {
            return (String::new(), finish);
        }
        let held = self.decoder.as_mut().map(|d| d.flush().unwrap_or_default()).unwrap_or_default();
        let (mut text, hit) = self.stops.push(&held);
        if hit {
            return (text, FinishReason::Stop);
        }
        text.push_str(&self.stops.finish());
        (text, finish)
    }
}

/// Fills in the grammar mask of each constrained sequence's row (`rows[i]` is `sequences[i]`'s
/// next draw), the sequences in parallel on rayon's pool (llguidance's work per mask is tens of
/// microseconds to a few milliseconds, and a batch may hold dozens). Returns each sequence's
/// error, if its grammar failed; unconstrained sequences cost nothing.
pub fn fill_masks(sequences: &mut [&mut Sequence], rows: &mut [PreparedSample]) -> Vec<Option<crate::Error>> {
    use rayon::prelude::*;
    let constrained = sequences.iter().filter(|s| s.is_constrained()).count();
    let fill = |(seq, row): (&mut &mut Sequence, &mut PreparedSample)| match seq.allowed() {
        Ok(mask) => {
            row.allowed = mask;
            None
        }
        Err(e) => Some(e),
    };
    if constrained < 2 {
        sequences.iter_mut().zip(rows.iter_mut()).map(fill).collect()
    } else {
        sequences.par_iter_mut().zip(rows.par_iter_mut()).map(fill).collect()
    }
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
    let decoder = tokenizer.map(|t| t.stream_decoder(true));
    let mut seq = Sequence::new(
        decoder,
        StopMatcher::new(params.stop.clone()),
        &model.config.eos_token_ids,
        params.ignore_eos,
        params.max_tokens,
    )
    .with_constraint(params.constraint.clone());
    let mut history = session.tokens().to_vec();
    history.extend_from_slice(prompt);

    let mut timings = Timings { prefill_tokens: prompt.len(), ..Timings::default() };
    let start = Instant::now();
    // Only tokens come back from the backend: the first drawn next to the prompt's last
    // logits, then greedy decoding as an argmax and any other draw finished next to the
    // logits (`Model::decode_batch_prepared`).
    let mut first = sampler.prepare(&history, seq.generated(), None);
    first.allowed = seq.allowed()?;
    let first = model.prefill_draw(session, prompt, &first)?;
    timings.prefill_seconds = start.elapsed().as_secs_f64();
    let plain_greedy =
        params.sampling.is_greedy() && !params.sampling.adjusts_logits() && !seq.is_constrained();
    let mut token = first?.token;
    let mut text = String::new();
    let decode_start = Instant::now();
    let finish = loop {
        if seq.generated().len() >= params.max_tokens {
            break FinishReason::Length;
        }
        let accepted = seq.accept(token, session.remaining())?;
        if let Some(emit) = accepted.text {
            on_text(&emit);
            text.push_str(&emit);
        }
        if let Some(finish) = accepted.finish {
            break finish;
        }
        token = if plain_greedy {
            model.decode_batch_greedy(&mut [&mut *session], &[token])?[0]
        } else {
            let row = sampler.prepare(&history, seq.generated(), None);
            let mut mask_error = None;
            let mut masks = |rows: &mut [PreparedSample]| match seq.allowed() {
                Ok(mask) => rows[0].allowed = mask,
                Err(e) => mask_error = Some(e),
            };
            let draw =
                model.decode_batch_masked(&mut [&mut *session], &[token], vec![row], &mut masks)?.remove(0);
            if let Some(e) = mask_error {
                return Err(e);
            }
            draw?.token
        };
        timings.decode_tokens += 1;
    };
    timings.decode_seconds = decode_start.elapsed().as_secs_f64();
    let (emit, finish) = seq.finish(finish);
    on_text(&emit);
    text.push_str(&emit);
    let ids = seq.generated().to_vec();
    Ok(Generated { ids, text, finish, timings })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/vlm-f32-gdn2x");
        Tokenizer::from_model_dir(&dir).unwrap().unwrap()
    }

    /// The order in which a sequence ends: end-of-sequence, then a stop string, then the token
    /// budget, then the context; ids alone without a tokenizer.
    #[test]
    fn a_sequence_ends_by_its_rules_in_order() {
        let none = || StopMatcher::new(Vec::new());
        let mut s = Sequence::new(None, none(), &[7], false, 3);
        assert_eq!(s.accept(5, 10).unwrap(), Accepted { text: Some(String::new()), finish: None });
        assert_eq!(s.accept(7, 10).unwrap(), Accepted { text: None, finish: Some(FinishReason::Eos) });
        assert_eq!(s.generated(), &[5, 7]);
        // Ignored end-of-sequence ids; the budget comes before the context.
        let mut s = Sequence::new(None, none(), &[7], true, 2);
        assert_eq!(s.accept(7, 1).unwrap().finish, None);
        assert_eq!(s.accept(7, 0).unwrap().finish, Some(FinishReason::Length));
        let mut s = Sequence::new(None, none(), &[], false, 9);
        assert_eq!(s.accept(1, 0).unwrap().finish, Some(FinishReason::Context));
        assert_eq!(s.finish(FinishReason::Context), (String::new(), FinishReason::Context));
    }

    /// A constrained sequence: its mask allows the grammar's tokens only, a token outside it is
    /// an error, and the sequence ends (as `Eos`) the moment the grammar is complete, even when
    /// end-of-sequence tokens are ignored; an unconstrained one has no mask.
    #[test]
    fn a_constrained_sequence_follows_its_grammar_and_ends_with_it() {
        use crate::constraint::{Constraints, Grammar};
        let t = tokenizer();
        let constraints = Constraints::new(&t, 384, &[322]).unwrap();
        let grammar = Grammar::Choice(vec!["yes".into()]);
        let ids = t.encode("yes", false).unwrap();
        for ignore_eos in [false, true] {
            let constraint = constraints.compile(&grammar, "").unwrap();
            let mut s = Sequence::new(
                Some(t.stream_decoder(true)),
                StopMatcher::new(Vec::new()),
                &[322],
                ignore_eos,
                50,
            )
            .with_constraint(Some(constraint));
            let mut text = String::new();
            let mut finish = None;
            for &id in &ids {
                let mask = s.allowed().unwrap().unwrap();
                assert!(mask.allows(id) && mask.count() == 1);
                let a = s.accept(id, 100).unwrap();
                text.push_str(&a.text.unwrap());
                finish = a.finish;
            }
            assert_eq!(finish, Some(FinishReason::Eos), "ignore_eos {ignore_eos}");
            let (rest, finish) = s.finish(FinishReason::Eos);
            assert_eq!((text + &rest, finish), ("yes".to_string(), FinishReason::Eos));
        }
        let mut s = Sequence::new(None, StopMatcher::new(Vec::new()), &[322], false, 50)
            .with_constraint(Some(constraints.compile(&grammar, "").unwrap()));
        let wrong = t.encode("no", false).unwrap()[0];
        assert!(s.accept(wrong, 100).is_err());
        let mut plain = Sequence::new(None, StopMatcher::new(Vec::new()), &[322], false, 50);
        assert_eq!(plain.allowed().unwrap(), None);
    }

    /// Text streams as it becomes final; a stop string ends the sequence and is not emitted, also
    /// when it only completes in the text held back at the end.
    #[test]
    fn a_sequence_streams_text_and_stops_on_stop_strings() {
        let t = tokenizer();
        let ids = t.encode("Hello world, again", false).unwrap();
        let text_of = |stops: Vec<String>, max: usize| {
            let mut s = Sequence::new(Some(t.stream_decoder(true)), StopMatcher::new(stops), &[], false, max);
            let mut text = String::new();
            let mut finish = None;
            for &id in &ids {
                let a = s.accept(id, 100).unwrap();
                text.push_str(&a.text.unwrap());
                if a.finish.is_some() {
                    finish = a.finish;
                    break;
                }
            }
            let (rest, finish) = s.finish(finish.unwrap_or(FinishReason::Length));
            (text + &rest, finish)
        };
        assert_eq!(text_of(Vec::new(), 100), ("Hello world, again".to_string(), FinishReason::Length));
        assert_eq!(text_of(vec!["world".into()], 100), ("Hello ".to_string(), FinishReason::Stop));
        assert_eq!(text_of(vec!["again".into()], 100), ("Hello world, ".to_string(), FinishReason::Stop));
    }
}
