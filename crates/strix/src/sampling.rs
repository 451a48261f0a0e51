//! Turning a logits vector into the next token id, and matching stop strings on streamed text.
//!
//! # Processing order
//!
//! [`Sampler::sample`] applies, in this order (the order of llama.cpp and vLLM):
//!
//! 0. **grammar mask** (structured output, `constraint.rs`): a constrained sequence's tokens
//!    that its grammar does not allow next get −∞, before anything else (as vLLM applies its
//!    grammar bitmask before the sampler), so every setting below draws only allowed tokens
//!    and the reported log-probabilities are those of the masked distribution;
//! 1. **logit bias** (OpenAI's `logit_bias`): each listed token's bias is added to its logit,
//!    right after the mask, so the penalties, the greedy argmax, the filters and the reported
//!    log-probabilities all see the biased logits (vLLM and OpenAI apply it first too); a bias
//!    of −100 all but bans a token, +100 all but forces it;
//! 2. **penalties**: repetition penalty (CTRL / Hugging Face style) over every distinct token of
//!    the prompt and the generated text, then frequency and presence penalties (OpenAI style)
//!    over the generated text only: vLLM does the same, so that a prompt that quotes a document
//!    does not make the model avoid that document's words;
//! 3. **temperature**: logits are divided by it, after subtracting the largest so that a tiny
//!    temperature cannot overflow (0 means greedy: the argmax of the biased, penalised logits,
//!    ties going to the lowest id, and nothing below applies);
//! 4. **top-k**: keep the `k` most likely tokens;
//! 5. **top-p** (nucleus): keep the smallest set of the most likely tokens whose probability,
//!    renormalised over what top-k kept, reaches `p`;
//! 6. **min-p**: drop tokens whose probability is below `min_p` times the most likely one's;
//! 7. **softmax** over what is left, and a **draw**.
//!
//! NaN logits count as −∞. Ties in the sort order (equal logits) always go to the lower token
//! id, and the draw walks the kept tokens in an order fixed by the logits (never by how std's
//! selection algorithms happen to shuffle), so the token is a function of the logits and the
//! seed alone.
//!
//! # Sampling next to the logits
//!
//! A backend that holds the logits on a device can finish the draw there, so that only the
//! token id (and the few log-probabilities asked for) cross to the host
//! ([`crate::backend::Backend::sample_rows`]). The host does the bookkeeping:
//! [`Sampler::prepare`] turns the history into a list of penalised tokens and takes the step's
//! random number, giving a [`PreparedSample`] (which carries the parameters, the logit bias's
//! few `(id, bias)` pairs among them); [`sample_prepared`] is the rest of
//! [`Sampler::sample`] on it, and picks the same token as `sample` would from the same logits
//! and state. Every setting can be prepared; the CUDA backend finishes every row on the device
//! but those its kernels cannot hold (see `backend/cuda/sample.rs`).
//!
//! `sample_prepared` also refuses rows that hold NaN or +∞, or nothing above −∞
//! ([`NonFiniteLogits`]): a model that produces them is broken, and a server must end the
//! request with an error rather than stream tokens drawn from garbage.
//!
//! # Reproducibility
//!
//! The random stream is xoshiro256** seeded through SplitMix64, both written out here, so a
//! seed gives the same draws in every release and on every platform (rand's `StdRng` does not
//! promise that). Each drawn token takes exactly one 64-bit output, turned into a uniform in
//! [0, 1) from its top 53 bits; greedy decoding takes none. The probabilities go through the
//! platform's `exp`, which may differ in the last bit between platforms: a uniform landing
//! within that rounding of the boundary between two tokens is the only way two platforms can
//! disagree.

use std::cmp::Ordering;
use std::sync::Arc;

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::noncontiguous::NFA;
use aho_corasick::{Anchored, MatchKind};

use crate::constraint::TokenMask;
use crate::error::{Error, Result};

/// How to pick the next token; see the module documentation for the order the steps apply in.
///
/// Deserialising fills missing fields from [`SamplingParams::default`], which is greedy.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy: the argmax of the biased, penalised logits, ties going to the lowest id.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`, in
    /// (0, 1]; 1 turns it off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one, in [0, 1]; 0 turns it
    /// off.
    pub min_p: f32,
    /// A positive logit `l` of a token seen in the prompt or the generated text becomes
    /// `l / p`, a negative one `l * p`, once per distinct token; 1 turns it off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token that appears in the generated text.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token, times its count in the generated text.
    pub frequency_penalty: f32,
    /// The same seed gives the same tokens for the same logits; `None` seeds from the OS.
    pub seed: Option<u64>,
    /// `(token id, bias)` pairs: the bias is added to the token's logit before anything else
    /// (see the module documentation). Each id at most once, each bias in
    /// [−[`LOGIT_BIAS_MAX`], [`LOGIT_BIAS_MAX`]]; ids outside the vocabulary are ignored by the
    /// sampler ([`SamplingParams::validate_vocab`] refuses them).
    pub logit_bias: Vec<(u32, f32)>,
}

/// The largest bias [`SamplingParams::logit_bias`] may add or subtract (OpenAI's range).
pub const LOGIT_BIAS_MAX: f32 = 100.0;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Argmax decoding with every penalty and filter off.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Rejects values outside each parameter's range, NaN and infinities, naming the parameter.
    /// Presence and frequency penalties may be any finite number (negative ones encourage
    /// repetition); a server wanting OpenAI's [-2, 2] checks that itself.
    pub fn validate(&self) -> Result<()> {
        let p = self;
        if !(p.temperature.is_finite() && p.temperature >= 0.0) {
            return Err(bad("temperature", "a finite number >= 0", p.temperature));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(bad("top_p", "in (0, 1]", p.top_p));
        }
        if !(p.min_p >= 0.0 && p.min_p <= 1.0) {
            return Err(bad("min_p", "in [0, 1]", p.min_p));
        }
        if !(p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0) {
            return Err(bad("repetition_penalty", "a finite number > 0", p.repetition_penalty));
        }
        if !p.presence_penalty.is_finite() {
            return Err(bad("presence_penalty", "a finite number", p.presence_penalty));
        }
        if !p.frequency_penalty.is_finite() {
            return Err(bad("frequency_penalty", "a finite number", p.frequency_penalty));
        }
        if let Some(&(id, bias)) =
            p.logit_bias.iter().find(|(_, b)| !(-LOGIT_BIAS_MAX..=LOGIT_BIAS_MAX).contains(b))
        {
            return Err(Error::input(format!(
                "sampling parameter logit_bias must map token ids to biases in [-{LOGIT_BIAS_MAX}, \
                 {LOGIT_BIAS_MAX}], got {bias} for token {id}"
            )));
        }
        let mut ids: Vec<u32> = p.logit_bias.iter().map(|b| b.0).collect();
        ids.sort_unstable();
        if let Some(twice) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::input(format!(
                "sampling parameter logit_bias names token {} more than once",
                twice[0]
            )));
        }
        Ok(())
    }

    /// Refuses a [`SamplingParams::logit_bias`] naming a token outside a vocabulary of `vocab`
    /// ids (the sampler would ignore it, which would hide a client's mistake).
    pub fn validate_vocab(&self, vocab: usize) -> Result<()> {
        match self.logit_bias.iter().find(|&&(id, _)| id as usize >= vocab) {
            Some(&(id, _)) => Err(Error::input(format!(
                "sampling parameter logit_bias names token {id}, outside the vocabulary ({vocab} ids)"
            ))),
            None => Ok(()),
        }
    }

    /// Whether the token is always the argmax of the penalised logits: temperature 0, or
    /// top-k 1 (which keeps the lowest-id maximum, the same token).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether any repetition, presence or frequency penalty is on.
    pub fn penalises(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether the logits are changed before the draw (a bias or a penalty): when not, a greedy
    /// token is the plain argmax of the model's logits.
    pub fn adjusts_logits(&self) -> bool {
        self.penalises() || !self.logit_bias.is_empty()
    }
}

fn bad(name: &str, range: &str, value: f32) -> Error {
    Error::input(format!("sampling parameter {name} must be {range}, got {value}"))
}

/// The log-probabilities reported for one sampled token, for an OpenAI-style `logprobs` field.
///
/// They are the log-softmax of the processed logits: after the penalties and the temperature,
/// before top-k, top-p and min-p. So they describe the distribution the filters cut from, and
/// tokens the filters removed still get a finite value. Temperature 0 (greedy) counts as 1.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Draws tokens for one sequence. Holds the random stream and scratch buffers, so reuse one
/// sampler across the tokens of a sequence rather than building one per token.
#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: Xoshiro256StarStar,
    /// Candidate `(id, logit)` pairs, which become `(id, weight)` once truncation is done.
    candidates: Vec<(u32, f32)>,
    /// Per-token counts for the penalties; all zero between calls. Sized to the vocabulary on
    /// first use, so samplers without penalties never allocate it.
    counts: Vec<u32>,
    scratch: Scratch,
    /// [`Sampler::prepare`]'s penalty list of the history it last saw, so that the next call
    /// folds in only the tokens generated since (a long prompt is hashed once, not every step).
    history: PenaltyHistory,
}

/// The penalised tokens of a history (`prompt` then `generated`): each id once, in order of
/// first appearance, with its flags, and which history it describes.
#[derive(Clone, Default)]
struct PenaltyHistory {
    /// `(id, flags)` as [`PreparedSample::penalties`] holds them, before dropping zero flags.
    entries: Vec<(u32, u32)>,
    at: std::collections::HashMap<u32, usize>,
    /// The prompt and the generated tokens folded in. The prompt is kept whole and compared,
    /// not hashed: a comparison streams at memory speed, where a hash is a chain of multiplies
    /// per token, and it cannot collide.
    prompt: Vec<u32>,
    generated: Vec<u32>,
}

/// Buffers for top-p, kept between calls.
#[derive(Clone, Default)]
struct Scratch {
    mass: Vec<f64>,
    crossing: Vec<(u32, f32)>,
}

impl Sampler {
    /// Validates `params` and seeds the random stream.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Ok(Sampler {
            params,
            seed,
            rng: Xoshiro256StarStar::from_seed(seed),
            candidates: Vec::new(),
            counts: Vec::new(),
            scratch: Scratch::default(),
            history: PenaltyHistory::default(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed in use: the one asked for, or the one drawn from the OS, so that an unseeded
    /// run can be logged and replayed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Picks the next token. `logits` is modified in place (bias, penalties, temperature, NaN
    /// made −∞). `prompt` and `generated` are the token history: the repetition penalty uses
    /// both, the presence and frequency penalties only `generated`; ids outside the vocabulary
    /// (in the history or the bias) are ignored. NaN logits count as −∞; a row that is all −∞ or NaN, or empty, gives token 0.
    /// [`sample_prepared`] instead refuses rows that are not [`usable`].
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) -> u32 {
        apply_bias(logits, &self.params.logit_bias);
        self.apply_penalties(logits, prompt, generated);
        let uniform = self.take_uniform();
        finish_draw(&self.params, logits, uniform, None, &mut self.candidates, &mut self.scratch).token
    }

    /// Like [`Sampler::sample`], and also returns the log-probabilities of the chosen token
    /// and of the `top_n` most likely ones (see [`TokenLogprobs`] for which distribution).
    /// Draws the same token as `sample` would from the same state.
    pub fn sample_with_logprobs(
        &mut self,
        logits: &mut [f32],
        prompt: &[u32],
        generated: &[u32],
        top_n: usize,
    ) -> (u32, TokenLogprobs) {
        apply_bias(logits, &self.params.logit_bias);
        self.apply_penalties(logits, prompt, generated);
        let uniform = self.take_uniform();
        let draw =
            finish_draw(&self.params, logits, uniform, Some(top_n), &mut self.candidates, &mut self.scratch);
        (draw.token, draw.logprobs.expect("asked for"))
    }

    /// The draw's random number: one per token unless greedy.
    fn take_uniform(&mut self) -> Option<f64> {
        (!self.params.is_greedy()).then(|| self.rng.next_f64())
    }

    /// The next token's draw, prepared for [`sample_prepared`] (or a backend's
    /// [`crate::backend::Backend::sample_rows`]): the parameters (the logit bias among them),
    /// the penalties of the history (as `sample` would apply them), the random number `sample`
    /// would take (none when greedy), and whether to report log-probabilities with `logprobs`
    /// alternatives.
    pub fn prepare(&mut self, prompt: &[u32], generated: &[u32], logprobs: Option<usize>) -> PreparedSample {
        let penalties = if self.params.penalises() { self.penalties(prompt, generated) } else { Vec::new() };
        let uniform = self.take_uniform();
        PreparedSample { params: self.params.clone(), uniform, penalties, logprobs, allowed: None }
    }

    /// The penalty list of `prompt` then `generated` (see [`PreparedSample::penalties`]). The
    /// history of the last call is extended when this one continues it (same prompt, the
    /// tokens generated then still at the front), else rebuilt.
    fn penalties(&mut self, prompt: &[u32], generated: &[u32]) -> Vec<(u32, u32)> {
        let p = &self.params;
        let repeated = if p.repetition_penalty != 1.0 { PENALTY_REPEATED } else { 0 };
        let counted = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let h = &mut self.history;
        let continues = h.prompt == prompt && generated.starts_with(&h.generated);
        if !continues {
            h.entries.clear();
            h.at.clear();
            h.generated.clear();
            h.prompt.clear();
            h.prompt.extend_from_slice(prompt);
            for &t in prompt {
                h.at.entry(t).or_insert_with(|| {
                    h.entries.push((t, repeated));
                    h.entries.len() - 1
                });
            }
        }
        for &t in &generated[h.generated.len()..] {
            let i = *h.at.entry(t).or_insert_with(|| {
                h.entries.push((t, repeated));
                h.entries.len() - 1
            });
            if counted {
                h.entries[i].1 += 1;
            }
        }
        h.generated.extend_from_slice(&generated[h.generated.len()..]);
        h.entries.iter().copied().filter(|&(_, flags)| flags != 0).collect()
    }

    fn apply_penalties(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        if !self.params.penalises() || logits.is_empty() {
            return;
        }
        let vocab = logits.len();
        if self.counts.len() < vocab {
            self.counts.resize(vocab, 0);
        }
        let counts = &mut self.counts[..vocab];
        let in_vocab = |t: &&u32| (**t as usize) < vocab;

        let rp = self.params.repetition_penalty;
        if rp != 1.0 {
            // Marks make each distinct token count once, however often it repeats.
            for &t in prompt.iter().chain(generated).filter(in_vocab) {
                let t = t as usize;
                if counts[t] == 0 {
                    counts[t] = 1;
                    let l = logits[t];
                    logits[t] = if l > 0.0 { l / rp } else { l * rp };
                }
            }
            for &t in prompt.iter().chain(generated).filter(in_vocab) {
                counts[t as usize] = 0;
            }
        }

        let (presence, frequency) = (self.params.presence_penalty, self.params.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            for &t in generated.iter().filter(in_vocab) {
                counts[t as usize] += 1;
            }
            for &t in generated.iter().filter(in_vocab) {
                let t = t as usize;
                let count = counts[t];
                if count > 0 {
                    logits[t] -= frequency * count as f32 + presence;
                    counts[t] = 0;
                }
            }
        }
    }
}

/// [`Sampler`]'s top-k, top-p and min-p: leaves in `cands` the tokens that survive, as `(id,
/// weight)` with weights proportional to their probabilities (the best one's is 1). `logits`
/// must have gone through [`normalise`] and returned true.
///
/// The candidates end up either in id order or sorted by [`by_value_desc`]; both are defined
/// by the logits alone, never by how std's selection happens to shuffle, so the draw walks them
/// in an order that cannot change between Rust releases.
fn truncate(p: &SamplingParams, logits: &[f32], cands: &mut Vec<(u32, f32)>, scratch: &mut Scratch) {
    let mut sorted = false;
    if p.top_k > 0 && p.top_k < logits.len() {
        best_n(logits, p.top_k, cands);
        sorted = true;
        while cands.last().is_some_and(|c| c.1 == f32::NEG_INFINITY) {
            cands.pop();
        }
    } else {
        cands.clear();
        cands.extend(
            logits.iter().enumerate().filter(|(_, &l)| l > f32::NEG_INFINITY).map(|(i, &l)| (i as u32, l)),
        );
    }
    if p.top_p < 1.0 {
        if sorted || cands.len() <= SORT_BELOW {
            if !sorted {
                cands.sort_unstable_by(by_value_desc);
            }
            let total: f64 = cands.iter().map(|c| f64::from(c.1.exp())).sum();
            let target = f64::from(p.top_p) * total;
            let mut cumulative = 0.0f64;
            if let Some(last) = cands.iter().position(|c| {
                cumulative += f64::from(c.1.exp());
                cumulative >= target
            }) {
                cands.truncate(last + 1);
            }
        } else if let Some(cutoff) = nucleus_cutoff(cands, p.top_p, scratch) {
            cands.retain(|c| by_value_desc(c, &cutoff) != Ordering::Greater);
        }
    }
    if p.min_p > 0.0 {
        // The best logit is 0, so "probability ≥ min_p × the best one's" is this.
        let threshold = p.min_p.ln();
        cands.retain(|c| c.1 >= threshold);
    }
    for c in cands.iter_mut() {
        c.1 = c.1.exp();
    }
}

/// The token a uniform `u` in [0, 1) picks from weighted candidates, walking them in order.
fn draw(cands: &[(u32, f32)], u: f64) -> u32 {
    let total: f64 = cands.iter().map(|c| f64::from(c.1)).sum();
    let target = u * total;
    let mut cumulative = 0.0f64;
    for &(id, w) in cands {
        cumulative += f64::from(w);
        if target < cumulative {
            return id;
        }
    }
    // Rounding can leave the target at the very top; the last token with any weight owns it.
    cands.iter().rev().find(|c| c.1 > 0.0).or(cands.first()).map_or(0, |c| c.0)
}

/// The largest top-k the CUDA backend draws with its exact one-block kernel (candidates
/// sorted in shared memory); larger ones go through its full-vocabulary kernels.
pub const PREPARED_TOP_K_MAX: usize = 1024;

/// In [`PreparedSample::penalties`]: the token is in the history and the repetition penalty
/// applies to it. The low bits hold its count in the generated text.
pub const PENALTY_REPEATED: u32 = 1 << 31;

/// One token's draw, prepared on the host by [`Sampler::prepare`] and finished next to the
/// logits by [`sample_prepared`] or a backend's [`crate::backend::Backend::sample_rows`].
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedSample {
    /// The sequence's parameters; their [`SamplingParams::logit_bias`] is applied first.
    pub params: SamplingParams,
    /// The draw's uniform in [0, 1); `None` for greedy decoding.
    pub uniform: Option<f64>,
    /// Each penalised token once: `(id, flags)`, flags [`PENALTY_REPEATED`] or'ed with the
    /// token's count in the generated text (for the presence and frequency penalties).
    pub penalties: Vec<(u32, u32)>,
    /// `Some(n)`: report the drawn token's log-probability and the `n` most likely tokens'.
    pub logprobs: Option<usize>,
    /// A constrained sequence's grammar mask for this token: every token it does not allow
    /// gets −∞ first (see the module documentation). `None`: unconstrained.
    pub allowed: Option<TokenMask>,
}

/// A token drawn from a row of logits, with its log-probabilities when they were asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Draw {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// A row of logits no token can be drawn from: it holds NaN or +∞, or nothing above −∞. A
/// model that produces one is broken (NaN or infinite weights, or an overflow), and a request
/// that meets one must end with an error rather than emit made-up tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the model produced logits that are not finite (NaN or infinity): its weights or its arithmetic are broken")]
pub struct NonFiniteLogits;

/// Whether a token can be drawn from `logits`: no NaN, no +∞, and something above −∞ (−∞
/// alone is a legitimate mask).
pub fn usable(logits: &[f32]) -> bool {
    let mut any = false;
    for &l in logits {
        if l.is_nan() || l == f32::INFINITY {
            return false;
        }
        any |= l > f32::NEG_INFINITY;
    }
    any
}

/// Sets every logit `mask` does not allow to −∞ (ids past the mask's vocabulary included).
pub fn apply_mask(logits: &mut [f32], mask: &TokenMask) {
    // A word at a time: the mask's bits past its vocabulary are clear, and logits past its
    // words meet zero words.
    let words = mask.words().iter().copied().chain(std::iter::repeat(0));
    for (chunk, word) in logits.chunks_mut(32).zip(words) {
        if word == u32::MAX {
            continue;
        }
        for (bit, l) in chunk.iter_mut().enumerate() {
            if word >> bit & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Adds each `(id, bias)` to its logit (one f32 addition, which the CUDA kernel mirrors); ids
/// outside `logits` are ignored.
fn apply_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(t, b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// One penalised logit: the repetition penalty (flag), then presence and frequency (count), as
/// [`Sampler::sample`] applies them. Kept to separate roundings (no fused multiply-add), which
/// the CUDA kernel mirrors.
pub fn penalise(l: f32, flags: u32, p: &SamplingParams) -> f32 {
    let mut l = l;
    if flags & PENALTY_REPEATED != 0 {
        let rp = p.repetition_penalty;
        l = if l > 0.0 { l / rp } else { l * rp };
    }
    let count = flags & !PENALTY_REPEATED;
    if count > 0 {
        l -= p.frequency_penalty * count as f32 + p.presence_penalty;
    }
    l
}

/// The draw [`Sampler::sample`] (or [`Sampler::sample_with_logprobs`]) makes, from a row
/// prepared by [`Sampler::prepare`] (the backends' host fallback, and the reference for their
/// own kernels), or `Err` when the biased and penalised row is not [`usable`]. `logits` is
/// modified in place; a bias or penalty naming an id outside it is ignored.
pub fn sample_prepared(logits: &mut [f32], prepared: &PreparedSample) -> Result<Draw, NonFiniteLogits> {
    let p = &prepared.params;
    if let Some(mask) = &prepared.allowed {
        apply_mask(logits, mask);
    }
    apply_bias(logits, &p.logit_bias);
    for &(t, flags) in &prepared.penalties {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = penalise(*l, flags, p);
        }
    }
    if !usable(logits) {
        return Err(NonFiniteLogits);
    }
    let (mut cands, mut scratch) = (Vec::new(), Scratch::default());
    Ok(finish_draw(p, logits, prepared.uniform, prepared.logprobs, &mut cands, &mut scratch))
}

/// Everything of a draw after the penalties: greedy (`uniform` `None`) or normalise, truncate
/// and draw with `uniform`; then, with `top_n`, the log-probabilities (of the logits
/// normalised with the temperature, 1 when greedy, before any truncation).
fn finish_draw(
    p: &SamplingParams,
    logits: &mut [f32],
    uniform: Option<f64>,
    top_n: Option<usize>,
    cands: &mut Vec<(u32, f32)>,
    scratch: &mut Scratch,
) -> Draw {
    let temperature = if p.temperature == 0.0 { 1.0 } else { p.temperature };
    let token = match uniform {
        None => {
            let token = argmax(logits);
            if top_n.is_some() {
                normalise(logits, temperature);
            }
            token
        }
        Some(_) if !normalise(logits, temperature) => 0,
        Some(u) => {
            truncate(p, logits, cands, scratch);
            draw(cands, u)
        }
    };
    let logprobs = top_n.map(|n| {
        let log_z = log_sum_exp(logits);
        let logprob_of = |l: f32| if log_z == f32::NEG_INFINITY { l } else { l - log_z };
        // The draw is done with the candidates, so they serve as scratch for the selection.
        best_n(logits, n, cands);
        let top = cands.iter().map(|&(id, l)| (id, logprob_of(l))).collect();
        let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| logprob_of(l));
        TokenLogprobs { token, logprob, top }
    });
    Draw { token, logprobs }
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

/// Descending by value, ties to the lower id. Values must not be NaN.
fn by_value_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1).unwrap_or(Ordering::Equal).then(a.0.cmp(&b.0))
}

/// The argmax, NaN counting as −∞ and ties going to the lowest id; 0 when nothing beats −∞.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_value {
            best = i;
            best_value = l;
        }
    }
    best as u32
}

/// The greedy pick of a row: [`argmax`], or `Err` when the row is not [`usable`].
pub fn greedy(logits: &[f32]) -> Result<u32, NonFiniteLogits> {
    if usable(logits) {
        Ok(argmax(logits))
    } else {
        Err(NonFiniteLogits)
    }
}

/// Turns NaN into −∞, subtracts the maximum and divides by the temperature. Subtracting first
/// keeps every logit ≤ 0, so a tiny temperature sends the others to −∞ rather than
/// overflowing, and the filters' thresholds become relative to the best token. +∞ logits
/// share all the mass: they become 0 and the rest −∞. Returns false when no logit is above −∞.
fn normalise(logits: &mut [f32], temperature: f32) -> bool {
    let mut max = f32::NEG_INFINITY;
    for l in logits.iter_mut() {
        if l.is_nan() {
            *l = f32::NEG_INFINITY;
        } else if *l > max {
            max = *l;
        }
    }
    if max == f32::NEG_INFINITY {
        return false;
    }
    if max == f32::INFINITY {
        for l in logits.iter_mut() {
            *l = if *l == f32::INFINITY { 0.0 } else { f32::NEG_INFINITY };
        }
    } else {
        for l in logits.iter_mut() {
            *l = (*l - max) / temperature;
        }
    }
    true
}

/// `ln Σ exp(l)`, −∞ for an empty or all −∞ row. Expects no NaN and no +∞.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    max + sum.ln() as f32
}

/// Below this many candidates top-p simply sorts them.
const SORT_BELOW: usize = 2048;
/// Top-p's histogram: buckets 1/64 nat wide over the top 64 nats, the rest in the last one.
const BUCKETS_PER_NAT: f32 = 64.0;
const BUCKETS: usize = 4096;

/// The bucket of a normalised logit (≤ 0); higher logits get lower buckets.
fn bucket(l: f32) -> usize {
    // `as` saturates, so very negative logits land in the last bucket.
    ((-l * BUCKETS_PER_NAT) as usize).min(BUCKETS - 1)
}

/// The last token of the nucleus in [`by_value_desc`] order: the smallest set of the most
/// likely `cands` whose probability reaches `top_p`. None keeps everything.
///
/// Sorting a 248k vocabulary would dominate decoding, so this is a radix select: one pass
/// sums the probability per logit bucket, which finds the bucket where the mass reaches
/// `top_p`, and only that bucket's tokens are sorted.
fn nucleus_cutoff(cands: &[(u32, f32)], top_p: f32, scratch: &mut Scratch) -> Option<(u32, f32)> {
    let mass = &mut scratch.mass;
    mass.clear();
    mass.resize(BUCKETS, 0.0);
    for c in cands {
        mass[bucket(c.1)] += f64::from(c.1.exp());
    }
    let target = f64::from(top_p) * mass.iter().sum::<f64>();
    let mut cumulative = 0.0f64;
    let crossing = mass.iter().position(|&m| {
        cumulative += m;
        cumulative >= target
    })?;
    cumulative -= mass[crossing];
    let crossing_tokens = &mut scratch.crossing;
    crossing_tokens.clear();
    crossing_tokens.extend(cands.iter().filter(|c| bucket(c.1) == crossing));
    crossing_tokens.sort_unstable_by(by_value_desc);
    let last = crossing_tokens
        .iter()
        .position(|c| {
            cumulative += f64::from(c.1.exp());
            cumulative >= target
        })
        // Summing in another order can fall short by a rounding error: keep the whole bucket.
        .unwrap_or(crossing_tokens.len() - 1);
    Some(crossing_tokens[last])
}

/// The `n` best `(id, value)` pairs of `values` in [`by_value_desc`] order (values must not be
/// NaN). Small `n`, the usual top-k and top-logprobs, takes one pass that mostly compares
/// each value with the current n-th best, without materialising the whole vocabulary.
fn best_n(values: &[f32], n: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    let n = n.min(values.len());
    if n == 0 {
        return;
    }
    if n > 64 {
        out.extend(values.iter().enumerate().map(|(i, &v)| (i as u32, v)));
        if n < out.len() {
            out.select_nth_unstable_by(n - 1, by_value_desc);
            out.truncate(n);
        }
        out.sort_unstable_by(by_value_desc);
        return;
    }
    for (i, &v) in values.iter().enumerate() {
        if out.len() == n {
            // Every id already in is lower, so an equal value loses the tie.
            if v <= out[n - 1].1 {
                continue;
            }
            out.pop();
        }
        let at = out.partition_point(|&(_, w)| w >= v);
        out.insert(at, (i as u32, v));
    }
}

/// A seed that differs between samplers and runs: std's `RandomState` carries per-process keys
/// from the OS (and changes for each instance), hashed together with the clock.
fn entropy_seed() -> u64 {
    use std::hash::BuildHasher;
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one(nanos)
}

/// SplitMix64 (Steele, Lea, Flood 2014), used only to expand a seed into xoshiro's state, as
/// xoshiro's authors recommend.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256** 1.0 (Blackman, Vigna 2018), as in the reference C code.
#[derive(Clone, Debug)]
struct Xoshiro256StarStar {
    s: [u64; 4],
}

impl Xoshiro256StarStar {
    fn from_seed(seed: u64) -> Self {
        let mut sm = seed;
        // SplitMix64 never yields four zeros in a row, so the state is never all zero.
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        Xoshiro256StarStar { s }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) from the top 53 bits, which an f64 holds exactly.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Matches stop strings on streamed text.
///
/// Call [`StopMatcher::push`] with each new piece of decoded text: it returns the text that is
/// safe to emit now, holding back any tail that could still be the beginning of a stop string,
/// and whether a stop string was hit. On a hit, the text up to (not including) the earliest
/// stop string is emitted and nothing after it; later pushes return nothing. At the end of
/// generation [`StopMatcher::finish`] returns what was held back. Held-back text always ends
/// and starts on character boundaries, since stop strings and chunks are whole `str`s.
///
/// The matching is an Aho-Corasick automaton over the stops (the `aho-corasick` crate), fed
/// the bytes of each piece once: the state it ends in is the longest tail of the text that
/// is a prefix of a stop, which is exactly the tail to hold back, so a push costs time
/// proportional to the piece, whatever the number or the length of the stops. (Searching
/// the held text again for every stop at each token made a request with long stops slow down
/// the engine thread, and every sequence it serves.)
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// `None` when there are no (non-empty) stops.
    automaton: Option<Arc<StopAutomaton>>,
    /// The automaton's state after every byte pushed so far.
    state: StateID,
    held: String,
    matched: Option<usize>,
}

/// The automaton of a set of stops, and how long the text is that each of its states stands
/// for (the length of the tail to hold back there).
#[derive(Debug)]
struct StopAutomaton {
    nfa: NFA,
    /// Indexed by `StateID::as_usize()` (dense for a noncontiguous NFA).
    depth: Vec<u32>,
}

impl StopAutomaton {
    /// `None` when the automaton cannot be built (more pattern bytes than its state ids can
    /// count, far beyond any request's stops): the caller falls back to no automaton only for
    /// empty stop lists, so this is reported as a plain failure to build.
    fn new(stops: &[String]) -> Option<Self> {
        // `Standard` reports every stop that ends at a position, so the earliest start and
        // the first-listed stop can be picked among them (leftmost-first semantics would
        // report a later-ending match first in a stream).
        let nfa = NFA::builder().match_kind(MatchKind::Standard).build(stops).ok()?;
        // Every state an unanchored search can reach is a prefix of some stop (the trie) or the
        // start; walking each stop anchored names the state of each of its prefixes.
        let mut depth = Vec::new();
        let mut set = |sid: StateID, d: usize| {
            let i = sid.as_usize();
            if depth.len() <= i {
                depth.resize(i + 1, 0);
            }
            depth[i] = d as u32;
        };
        set(nfa.start_state(Anchored::No).ok()?, 0);
        let anchored = nfa.start_state(Anchored::Yes).ok()?;
        set(anchored, 0);
        for stop in stops {
            let mut sid = anchored;
            for (i, &b) in stop.as_bytes().iter().enumerate() {
                sid = nfa.next_state(Anchored::Yes, sid, b);
                set(sid, i + 1);
            }
        }
        Some(StopAutomaton { nfa, depth })
    }

    fn depth(&self, sid: StateID) -> usize {
        self.depth.get(sid.as_usize()).map_or(0, |&d| d as usize)
    }
}

impl StopMatcher {
    /// Empty stop strings are dropped: they would match before any text.
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let automaton = if stops.is_empty() {
            None
        } else {
            // Building fails only past u32::MAX states; the callers bound stops far below.
            Some(Arc::new(StopAutomaton::new(&stops).expect("stop strings fit the automaton")))
        };
        let state = Self::start(&automaton);
        StopMatcher { stops, automaton, state, held: String::new(), matched: None }
    }

    fn start(automaton: &Option<Arc<StopAutomaton>>) -> StateID {
        automaton.as_ref().and_then(|a| a.nfa.start_state(Anchored::No).ok()).unwrap_or_default()
    }

    /// Adds the next piece of text; returns what is safe to emit and whether a stop was hit.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.matched.is_some() {
            return (String::new(), true);
        }
        let Some(automaton) = self.automaton.clone() else {
            return (text.to_owned(), false);
        };
        let nfa = &automaton.nfa;
        // The held text is the longest tail that is a prefix of a stop, so a stop that ends in
        // this piece starts inside `held + text`: its offsets are taken there.
        let base = self.held.len();
        self.held.push_str(text);
        // The earliest occurrence wins; at one position, the stop listed first.
        let mut hit: Option<(usize, usize)> = None;
        for (i, &b) in text.as_bytes().iter().enumerate() {
            self.state = nfa.next_state(Anchored::No, self.state, b);
            if nfa.is_match(self.state) {
                let end = base + i + 1;
                for k in 0..nfa.match_len(self.state) {
                    let pattern = nfa.match_pattern(self.state, k);
                    let candidate = (end - nfa.pattern_len(pattern), pattern.as_usize());
                    hit = Some(hit.map_or(candidate, |best| best.min(candidate)));
                }
            }
        }
        if let Some((pos, i)) = hit {
            self.matched = Some(i);
            self.held.truncate(pos);
            return (std::mem::take(&mut self.held), true);
        }
        // Any later match starts inside the longest tail that is a proper prefix of a stop (the
        // automaton's state), so everything before that tail is final.
        let keep = automaton.depth(self.state);
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (emit, false)
    }

    /// Returns the held-back text (nothing after a stop string was hit).
    pub fn finish(&mut self) -> String {
        self.state = Self::start(&self.automaton);
        std::mem::take(&mut self.held)
    }

    /// The stop string that was hit, if any.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params).unwrap()
    }

    fn seeded(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, seed: Some(seed), ..SamplingParams::default() }
    }

    fn ln_probs(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| x.ln()).collect()
    }

    /// The ids `truncate` keeps, sorted.
    fn kept(params: SamplingParams, logits: &[f32]) -> Vec<u32> {
        let mut l = logits.to_vec();
        assert!(normalise(&mut l, params.temperature));
        let (mut cands, mut scratch) = (Vec::new(), Scratch::default());
        truncate(&params, &l, &mut cands, &mut scratch);
        let mut ids: Vec<u32> = cands.iter().map(|c| c.0).collect();
        ids.sort_unstable();
        ids
    }

    /// `prepare` + `sample_prepared` picks what `sample` picks from the same logits, history
    /// and seed, step after step (so the random streams stay aligned), and reports what
    /// `sample_with_logprobs` reports, over greedy rows with penalties and rows with every
    /// filter and penalty (top-k of any size or none), on logits with ties and −∞.
    #[test]
    fn prepared_rows_pick_what_sample_picks() {
        let mut rng = Xoshiro256StarStar::from_seed(99);
        let mut uniform = move || rng.next_f64() as f32;
        let vocab = 3000;
        for case in 0..140u64 {
            let params = SamplingParams {
                temperature: if case % 5 == 0 { 0.0 } else { 0.2 + 1.5 * uniform() },
                top_k: [2, 7, 20, 40, 1000, 1024, 0][case as usize % 7],
                top_p: if case % 3 == 0 { 1.0 } else { 0.5 + 0.5 * uniform() },
                min_p: if case % 4 == 0 { 0.05 * uniform() } else { 0.0 },
                repetition_penalty: if case % 2 == 0 { 1.0 + uniform() } else { 1.0 },
                presence_penalty: if case % 7 < 3 { uniform() - 0.5 } else { 0.0 },
                frequency_penalty: if case % 6 < 2 { uniform() } else { 0.0 },
                seed: Some(case),
                // A bias on a third of the cases: ids inside the vocabulary (some in the
                // history, so bias and penalties meet) and one outside, which is ignored.
                logit_bias: if case % 3 == 2 {
                    vec![(5, 2.5), (17, -100.0), (vocab as u32 + 3, 7.0), ((case * 37 % 3000) as u32, 4.0)]
                } else {
                    Vec::new()
                },
            };
            let logprobs = (case % 3 == 1).then_some(case as usize % 6);
            let (mut host, mut prep) = (sampler(params.clone()), sampler(params.clone()));
            let prompt: Vec<u32> = (0..50).map(|_| (uniform() * (vocab + 10) as f32) as u32).collect();
            let mut generated = Vec::new();
            for step in 0..8 {
                let mut logits: Vec<f32> = (0..vocab).map(|_| (uniform() * 8.0).round() / 2.0).collect();
                if case % 11 == 0 {
                    logits[17] = f32::NEG_INFINITY;
                }
                let (want, want_lp) = match logprobs {
                    Some(n) => {
                        let (t, lp) = host.sample_with_logprobs(&mut logits.clone(), &prompt, &generated, n);
                        (t, Some(lp))
                    }
                    None => (host.sample(&mut logits.clone(), &prompt, &generated), None),
                };
                let row = prep.prepare(&prompt, &generated, logprobs);
                assert_eq!(row.uniform.is_none(), params.is_greedy());
                let got = sample_prepared(&mut logits.clone(), &row).unwrap();
                assert_eq!(
                    got,
                    Draw { token: want, logprobs: want_lp },
                    "case {case} step {step}: {params:?}"
                );
                generated.push(want);
            }
        }
    }

    /// A grammar mask applies before everything else, with every setting: the draw is the one
    /// `sample` makes from the logits with the disallowed tokens at −∞, never a disallowed
    /// token (a +100 bias on one included), and the log-probabilities are those of the masked
    /// distribution.
    #[test]
    fn a_mask_applies_first_with_every_setting() {
        let mut rng = Xoshiro256StarStar::from_seed(7);
        let mut uniform = move || rng.next_f64() as f32;
        let vocab = 1000;
        for case in 0..60u64 {
            let allowed: Vec<u32> = (0..vocab as u32).filter(|i| (i * 7 + case as u32) % 13 < 2).collect();
            let mask = TokenMask::from_ids(vocab, &allowed);
            let banned = (0..vocab as u32).find(|&i| !mask.allows(i)).unwrap();
            let params = SamplingParams {
                temperature: if case % 4 == 0 { 0.0 } else { 0.3 + uniform() },
                top_k: [0, 3, 50, 2000][case as usize % 4],
                top_p: if case % 3 == 0 { 1.0 } else { 0.6 },
                min_p: if case % 5 == 0 { 0.1 } else { 0.0 },
                repetition_penalty: if case % 2 == 0 { 1.3 } else { 1.0 },
                frequency_penalty: if case % 3 == 1 { 0.5 } else { 0.0 },
                seed: Some(case),
                logit_bias: vec![(banned, 100.0)],
                ..SamplingParams::default()
            };
            let logprobs = (case % 2 == 1).then_some(5);
            let (mut reference, mut prep) = (sampler(params.clone()), sampler(params.clone()));
            let prompt = [banned, allowed[0], 3];
            let mut generated = Vec::new();
            for _ in 0..6 {
                let logits: Vec<f32> = (0..vocab).map(|_| uniform() * 6.0).collect();
                let mut masked = logits.clone();
                apply_mask(&mut masked, &mask);
                let mut row = prep.prepare(&prompt, &generated, logprobs);
                row.allowed = Some(mask.clone());
                let got = sample_prepared(&mut logits.clone(), &row).unwrap();
                let want = match logprobs {
                    Some(n) => {
                        let (t, lp) = reference.sample_with_logprobs(&mut masked, &prompt, &generated, n);
                        Draw { token: t, logprobs: Some(lp) }
                    }
                    None => {
                        Draw { token: reference.sample(&mut masked, &prompt, &generated), logprobs: None }
                    }
                };
                assert_eq!(got, want, "case {case}: {params:?}");
                assert!(mask.allows(got.token), "case {case}: drew {} outside the mask", got.token);
                if let Some(lp) = &got.logprobs {
                    assert!(
                        lp.top.iter().all(|&(id, l)| mask.allows(id) || l == f32::NEG_INFINITY),
                        "{lp:?}"
                    );
                }
                generated.push(got.token);
            }
        }
    }

    /// `prepare` keeps the penalty list of the history it saw and folds in only new tokens: its
    /// list equals a fresh sampler's over a growing history, and after the history changes
    /// under it (another prompt of the same length, generated tokens taken back or replaced).
    #[test]
    fn prepared_penalties_follow_the_history() {
        let params = SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..seeded(0.8, 3)
        };
        let fresh = |prompt: &[u32], generated: &[u32]| {
            sampler(params.clone()).prepare(prompt, generated, None).penalties
        };
        let mut kept = sampler(params.clone());
        let mut check = |prompt: &[u32], generated: &[u32]| {
            assert_eq!(
                kept.prepare(prompt, generated, None).penalties,
                fresh(prompt, generated),
                "{prompt:?} {generated:?}"
            );
        };
        let prompt = [7u32, 3, 7, 9, 1];
        let mut generated = Vec::new();
        for t in [3u32, 11, 11, 7, 2, 11] {
            check(&prompt, &generated);
            generated.push(t);
        }
        check(&prompt, &generated);
        check(&[7, 3, 7, 9, 2], &generated);
        check(&[7, 3, 7, 9, 2], &generated[..3]);
        check(&[7, 3, 7, 9, 2], &[3, 11, 5]);
        check(&[], &[4, 4]);
        // Only the presence and frequency penalties: prompt tokens carry no flags.
        let params = SamplingParams { repetition_penalty: 1.0, ..params };
        let mut kept = sampler(params.clone());
        let row = kept.prepare(&prompt, &[9, 9, 4], None);
        assert_eq!(row.penalties, vec![(9, 2), (4, 1)]);
        assert_eq!(kept.prepare(&prompt, &[9, 9, 4, 7], None).penalties, vec![(7, 1), (9, 2), (4, 1)]);
    }

    /// Rows with NaN, +∞ or nothing above −∞ are refused by `sample_prepared` (before or after
    /// the penalties), and only those.
    #[test]
    fn non_finite_rows_are_refused() {
        let mut s = sampler(seeded(0.8, 1));
        let row = s.prepare(&[], &[], Some(2));
        let ok = [1.0f32, f32::NEG_INFINITY, 0.5];
        assert!(usable(&ok) && sample_prepared(&mut ok.to_vec(), &row).is_ok());
        for bad in [[1.0, f32::NAN, 0.5], [1.0, f32::INFINITY, 0.5], [f32::NEG_INFINITY; 3]] {
            assert!(!usable(&bad), "{bad:?}");
            assert_eq!(sample_prepared(&mut bad.to_vec(), &row), Err(NonFiniteLogits), "{bad:?}");
        }
        assert!(!usable(&[]));
        // A repetition penalty below 1 divides: a huge logit overflows to +∞.
        let mut s = sampler(SamplingParams { repetition_penalty: 0.5, ..seeded(0.0, 1) });
        let row = s.prepare(&[0], &[], None);
        assert_eq!(sample_prepared(&mut [3e38, 1.0], &row), Err(NonFiniteLogits));
    }

    #[test]
    fn splitmix_and_xoshiro_match_reference_streams() {
        // SplitMix64 from seed 1234567, as published with the algorithm's reference code.
        let mut sm = 1234567u64;
        let got: Vec<u64> = (0..5).map(|_| splitmix64(&mut sm)).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
        // xoshiro256** pinned so the stream cannot change between releases; the values were
        // checked against the reference C code seeded with the same SplitMix64 state.
        let mut rng = Xoshiro256StarStar::from_seed(0);
        let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        assert_eq!(
            got,
            [11091344671253066420, 13793997310169335082, 1900383378846508768, 7684712102626143532]
        );
    }

    #[test]
    fn uniform_is_in_unit_interval() {
        let mut rng = Xoshiro256StarStar::from_seed(7);
        for _ in 0..10_000 {
            let u = rng.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
        let mut top = Xoshiro256StarStar { s: [0; 4] };
        assert_eq!(top.next_f64(), 0.0);
    }

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id() {
        let mut s = sampler(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, 2.0, -1.0, 2.0], &[], &[]), 1);
        assert_eq!(s.sample(&mut [5.0, 5.0], &[], &[]), 0);
        assert_eq!(s.sample(&mut [-3.0, -1.0, -2.0], &[], &[]), 1);
        assert!(SamplingParams::greedy().is_greedy());
        assert_eq!(SamplingParams::greedy(), SamplingParams::default());
    }

    #[test]
    fn nan_and_infinite_logits_are_handled() {
        let mut g = sampler(SamplingParams::greedy());
        let mut r = sampler(seeded(1.0, 3));
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        assert_eq!(g.sample(&mut [nan, 1.0, nan, 0.5], &[], &[]), 1);
        for _ in 0..200 {
            let t = r.sample(&mut [nan, 1.0, nan, 0.5], &[], &[]);
            assert!(t == 1 || t == 3, "drew a NaN token {t}");
        }
        for row in [vec![nan, nan], vec![-inf, -inf, -inf], vec![]] {
            assert_eq!(g.sample(&mut row.clone(), &[], &[]), 0);
            assert_eq!(r.sample(&mut row.clone(), &[], &[]), 0);
            let (t, lp) = r.sample_with_logprobs(&mut row.clone(), &[], &[], 2);
            assert_eq!(t, 0);
            assert_eq!(lp.top.len(), row.len().min(2));
        }
        // +inf tokens share all the mass.
        assert_eq!(g.sample(&mut [1.0, inf, inf], &[], &[]), 1);
        let mut seen = [0; 3];
        for _ in 0..200 {
            seen[r.sample(&mut [1.0, inf, inf], &[], &[]) as usize] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 50 && seen[2] > 50, "{seen:?}");
    }

    #[test]
    fn same_seed_same_draws_different_seed_different_draws() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = sampler(SamplingParams { top_p: 0.95, ..seeded(0.8, seed) });
            (0..1000).map(|_| s.sample(&mut logits.clone(), &[], &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // Unseeded samplers draw from different streams.
        let a = Sampler::new(SamplingParams { seed: None, ..seeded(1.0, 0) }).unwrap();
        let b = Sampler::new(SamplingParams { seed: None, ..seeded(1.0, 0) }).unwrap();
        assert_ne!(a.rng.s, b.rng.s);
    }

    #[test]
    fn seeded_draws_are_pinned() {
        // The promise to users: a seed keeps giving these tokens in every later release.
        let mut s = sampler(seeded(1.0, 1234));
        let logits = ln_probs(&[0.1, 0.2, 0.3, 0.4]);
        let got: Vec<u32> = (0..16).map(|_| s.sample(&mut logits.clone(), &[], &[])).collect();
        assert_eq!(got, [0, 3, 3, 3, 1, 3, 2, 1, 2, 3, 2, 1, 1, 3, 2, 3]);
    }

    #[test]
    fn temperature_to_zero_approaches_greedy() {
        let logits = [1.0, 3.0, 2.999, -5.0];
        for t in [1e-6, 1e-20, f32::MIN_POSITIVE] {
            let mut s = sampler(seeded(t, 9));
            for _ in 0..1000 {
                assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 1);
            }
        }
        // Exact ties stay ties at any temperature.
        let mut s = sampler(seeded(1e-30, 9));
        let mut seen = [0; 3];
        for _ in 0..1000 {
            seen[s.sample(&mut [3.0, 0.0, 3.0], &[], &[]) as usize] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 400 && seen[2] > 400, "{seen:?}");
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut rng = Xoshiro256StarStar::from_seed(5);
        let mut s = sampler(SamplingParams { top_k: 1, ..seeded(1.5, 1) });
        assert!(s.params().is_greedy());
        for _ in 0..200 {
            // Coarse values so ties are common.
            let logits: Vec<f32> = (0..40).map(|_| (rng.next_u64() % 8) as f32).collect();
            let expect = argmax(&logits);
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), expect);
            // The sampling path's top-k, too, keeps the lowest-id maximum.
            assert_eq!(kept(SamplingParams { top_k: 1, ..seeded(1.0, 0) }, &logits), [expect]);
        }
    }

    #[test]
    fn top_k_keeps_the_k_best_with_ties_to_lower_ids() {
        let logits = [0.5, 2.0, 1.0, 2.0, 1.0, -1.0];
        let p = |k| SamplingParams { top_k: k, ..seeded(1.0, 0) };
        assert_eq!(kept(p(2), &logits), [1, 3]);
        assert_eq!(kept(p(3), &logits), [1, 2, 3]);
        assert_eq!(kept(p(4), &logits), [1, 2, 3, 4]);
        assert_eq!(kept(p(100), &logits), [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let logits = ln_probs(&[0.05, 0.5, 0.1, 0.2, 0.15]);
        let p = |top_p| SamplingParams { top_p, ..seeded(1.0, 0) };
        assert_eq!(kept(p(0.3), &logits), [1]);
        assert_eq!(kept(p(0.69), &logits), [1, 3]);
        assert_eq!(kept(p(0.71), &logits), [1, 3, 4]);
        assert_eq!(kept(p(0.9), &logits), [1, 2, 3, 4]);
        assert_eq!(kept(p(0.99), &logits), [0, 1, 2, 3, 4]);
        // After top-k, mass is measured against what top-k kept: 0.5 / 0.7 > 0.7.
        let pk = SamplingParams { top_k: 2, ..p(0.7) };
        assert_eq!(kept(pk, &logits), [1]);
        // The draws never leave the nucleus.
        let mut s = sampler(p(0.71));
        for _ in 0..500 {
            assert!([1, 3, 4].contains(&s.sample(&mut logits.clone(), &[], &[])));
        }
    }

    /// Top-k then top-p by the definition: a full sort and a running sum.
    fn reference_kept(logits: &[f32], top_k: usize, top_p: f32) -> Vec<u32> {
        let mut sorted: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        sorted.sort_by(by_value_desc);
        if top_k > 0 {
            sorted.truncate(top_k);
        }
        let max = sorted[0].1;
        let weights: Vec<f64> = sorted.iter().map(|c| f64::from((c.1 - max).exp())).collect();
        let total: f64 = weights.iter().sum();
        let mut cum = 0.0;
        // Top-p 1 is off: even tokens too unlikely to change the sum stay.
        let n = weights.iter().position(|w| {
            cum += w;
            top_p < 1.0 && cum >= f64::from(top_p) * total
        });
        let mut ids: Vec<u32> = sorted[..n.map_or(sorted.len(), |n| n + 1)].iter().map(|c| c.0).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn top_k_and_top_p_on_a_large_vocabulary_match_a_full_sort() {
        let mut rng = Xoshiro256StarStar::from_seed(11);
        let continuous: Vec<f32> = (0..20_000).map(|_| (rng.next_f64() * 6.0) as f32).collect();
        // Few distinct values, so the cut falls among ties and must go to the lower ids.
        let coarse: Vec<f32> = (0..20_000).map(|_| (rng.next_u64() % 12) as f32 * 0.5).collect();
        let flat = vec![0.25f32; 5000];
        let small: Vec<f32> = continuous[..1000].to_vec();
        let spiky: Vec<f32> = (0..30_000).map(|i| if i % 997 == 0 { 20.0 } else { -30.0 }).collect();
        for logits in [&continuous, &coarse, &flat, &small, &spiky] {
            for top_k in [0, 20, 64, 65, 500] {
                for top_p in [0.01, 0.2, 0.5, 0.9, 0.999, 1.0] {
                    let params = SamplingParams { top_k, top_p, ..seeded(1.0, 0) };
                    let got = kept(params, logits);
                    let expect = reference_kept(logits, top_k, top_p);
                    // Lengths first: a failure should not print 20k ids.
                    let case = format!("top_k {top_k} top_p {top_p} on {}", logits.len());
                    assert_eq!(got.len(), expect.len(), "{case}");
                    assert!(got == expect, "{case}");
                }
            }
        }
        // The histogram path really ran: more candidates than the sorting path takes.
        assert!(continuous.len() > SORT_BELOW && flat.len() > SORT_BELOW);
    }

    #[test]
    fn best_n_matches_a_full_sort() {
        let mut rng = Xoshiro256StarStar::from_seed(4);
        let values: Vec<f32> = (0..3000).map(|_| (rng.next_u64() % 50) as f32).collect();
        let mut sorted: Vec<(u32, f32)> = values.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        sorted.sort_by(by_value_desc);
        let mut out = Vec::new();
        for n in [0, 1, 7, 64, 65, 1000, 3000, 5000] {
            best_n(&values, n, &mut out);
            assert_eq!(out, sorted[..n.min(3000)], "n {n}");
        }
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        let logits = ln_probs(&[0.05, 0.5, 0.1, 0.2, 0.15]);
        let p = |min_p| SamplingParams { min_p, ..seeded(1.0, 0) };
        // Thresholds 0.125, 0.175 and 0.45 in probability.
        assert_eq!(kept(p(0.25), &logits), [1, 3, 4]);
        assert_eq!(kept(p(0.35), &logits), [1, 3]);
        assert_eq!(kept(p(0.9), &logits), [1]);
        assert_eq!(kept(p(1.0), &logits), [1]);
        // Combined with top-p, the smaller of the two prefixes survives.
        assert_eq!(kept(SamplingParams { top_p: 0.71, ..p(0.35) }, &logits), [1, 3]);
        assert_eq!(kept(SamplingParams { top_p: 0.3, ..p(0.25) }, &logits), [1]);
    }

    /// Draws `n` tokens and checks each frequency is within 4.5 standard errors of `expect`.
    fn check_frequencies(params: SamplingParams, logits: &[f32], expect: &[f64]) {
        let n = 20_000;
        let mut s = sampler(params);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[s.sample(&mut logits.to_vec(), &[], &[]) as usize] += 1;
        }
        for (i, (&c, &p)) in counts.iter().zip(expect).enumerate() {
            let freq = c as f64 / n as f64;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            assert!((freq - p).abs() <= 4.5 * se + 1e-12, "token {i}: {freq} vs {p}");
        }
    }

    #[test]
    fn empirical_frequencies_match_the_softmax() {
        let probs = [0.1, 0.2, 0.3, 0.4, 0.0];
        let logits: Vec<f32> = probs.iter().map(|&p: &f64| (p as f32).ln() + 7.0).collect();
        check_frequencies(seeded(1.0, 2024), &logits, &probs);
        // Temperature 2 takes square roots of the probabilities.
        let roots: Vec<f64> = probs.iter().map(|p| p.sqrt()).collect();
        let z: f64 = roots.iter().sum();
        let tempered: Vec<f64> = roots.iter().map(|r| r / z).collect();
        check_frequencies(seeded(2.0, 7), &logits, &tempered);
        // Top-k renormalises over what it keeps.
        let topk = [0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0, 0.0];
        check_frequencies(SamplingParams { top_k: 2, ..seeded(1.0, 8) }, &logits, &topk);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let mut s = sampler(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() });
        let mut logits = [2.0, -2.0, 1.0, 0.5, 3.0];
        // Token 0 from the prompt, 1 twice in the output, 99 outside the vocabulary.
        s.apply_penalties(&mut logits, &[0, 99], &[1, 1, 0]);
        assert_eq!(logits, [1.0, -4.0, 1.0, 0.5, 3.0]);
        assert!(s.counts.iter().all(|&c| c == 0));
        // It can change the greedy choice.
        let mut s = sampler(SamplingParams { repetition_penalty: 1.5, ..SamplingParams::greedy() });
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.5], &[1], &[]), 2);
    }

    #[test]
    fn sampler_reports_its_seed() {
        assert_eq!(sampler(seeded(1.0, 77)).seed(), 77);
        let unseeded = sampler(SamplingParams::greedy());
        let replay = sampler(SamplingParams { seed: Some(unseeded.seed()), ..SamplingParams::greedy() });
        assert_eq!(unseeded.rng.s, replay.rng.s);
        assert!(format!("{unseeded:?}").contains("seed"));
    }

    #[test]
    fn presence_and_frequency_penalties_count_only_generated_tokens() {
        let base = [1.0, 1.0, 1.0, 1.0];
        let mut presence = sampler(SamplingParams { presence_penalty: 0.5, ..SamplingParams::greedy() });
        let mut logits = base;
        presence.apply_penalties(&mut logits, &[0, 0, 0], &[1, 1, 2, 7]);
        assert_eq!(logits, [1.0, 0.5, 0.5, 1.0]);

        let mut frequency = sampler(SamplingParams { frequency_penalty: 0.5, ..SamplingParams::greedy() });
        let mut logits = base;
        frequency.apply_penalties(&mut logits, &[0, 0, 0], &[1, 1, 2, 1]);
        assert_eq!(logits, [1.0, -0.5, 0.5, 1.0]);

        let both = SamplingParams {
            presence_penalty: 0.25,
            frequency_penalty: 0.5,
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        };
        let mut s = sampler(both);
        let mut logits = [4.0, 4.0, -1.0, 1.0];
        s.apply_penalties(&mut logits, &[3], &[1, 1, 2]);
        // Repetition first (1: 4/2, 2: -1*2, 3: 1/2), then 1: -(2*0.5+0.25), 2: -(0.5+0.25).
        assert_eq!(logits, [4.0, 0.75, -2.75, 0.5]);
        assert!(s.counts.iter().all(|&c| c == 0));
        // A negative presence penalty encourages repetition.
        let mut s = sampler(SamplingParams { presence_penalty: -2.0, ..SamplingParams::greedy() });
        assert_eq!(s.sample(&mut [1.0, 0.0], &[], &[1]), 1);
    }

    #[test]
    fn validate_rejects_out_of_range_values_naming_the_parameter() {
        let d = SamplingParams::default;
        let cases: Vec<(SamplingParams, &str)> = vec![
            (SamplingParams { temperature: -0.1, ..d() }, "temperature"),
            (SamplingParams { temperature: f32::NAN, ..d() }, "temperature"),
            (SamplingParams { temperature: f32::INFINITY, ..d() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..d() }, "top_p"),
            (SamplingParams { top_p: 1.01, ..d() }, "top_p"),
            (SamplingParams { top_p: f32::NAN, ..d() }, "top_p"),
            (SamplingParams { min_p: -0.01, ..d() }, "min_p"),
            (SamplingParams { min_p: 1.5, ..d() }, "min_p"),
            (SamplingParams { min_p: f32::NAN, ..d() }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..d() }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: -1.0, ..d() }, "repetition_penalty"),
            (SamplingParams { repetition_penalty: f32::NAN, ..d() }, "repetition_penalty"),
            (SamplingParams { presence_penalty: f32::NAN, ..d() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: f32::INFINITY, ..d() }, "frequency_penalty"),
        ];
        for (params, name) in cases {
            let err = params.validate().unwrap_err();
            assert!(matches!(err, Error::Input(_)), "{err:?}");
            assert!(err.to_string().contains(name), "{err} should name {name}");
            assert!(Sampler::new(params).is_err());
        }
        let fine = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 1.0,
            min_p: 1.0,
            repetition_penalty: 1.1,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            seed: Some(1),
            logit_bias: vec![(3, -100.0), (9, 100.0), (1 << 30, 0.5)],
        };
        assert!(fine.validate().is_ok());
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn logit_bias_is_refused_out_of_range_twice_or_outside_the_vocabulary() {
        let with = |logit_bias: Vec<(u32, f32)>| SamplingParams { logit_bias, ..SamplingParams::default() };
        for bias in [vec![(1, 100.5)], vec![(1, -101.0)], vec![(2, f32::NAN)], vec![(2, f32::INFINITY)]] {
            let err = with(bias.clone()).validate().unwrap_err();
            assert!(err.to_string().contains("logit_bias"), "{bias:?}: {err}");
            assert!(Sampler::new(with(bias)).is_err());
        }
        let err = with(vec![(4, 1.0), (2, 1.0), (4, -1.0)]).validate().unwrap_err();
        assert!(err.to_string().contains("logit_bias names token 4 more than once"), "{err}");
        let inside = with(vec![(0, 1.0), (9, -1.0)]);
        assert!(inside.validate().is_ok() && inside.validate_vocab(10).is_ok());
        let err = inside.validate_vocab(9).unwrap_err();
        assert!(
            err.to_string().contains("logit_bias names token 9, outside the vocabulary (9 ids)"),
            "{err}"
        );
        assert!(with(Vec::new()).validate_vocab(0).is_ok());
        assert!(inside.adjusts_logits() && !SamplingParams::greedy().adjusts_logits());
    }

    /// The bias is added before everything else: it moves the greedy argmax, forces or bans a
    /// token under a temperature, is what the penalties see, and shows in the log-probabilities.
    #[test]
    fn logit_bias_applies_first_and_everywhere() {
        let logits = [1.0f32, 2.0, 3.0, 0.5];
        let greedy = |logit_bias| SamplingParams { logit_bias, ..SamplingParams::greedy() };
        let mut s = sampler(greedy(vec![(0, 2.5)]));
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 0);
        let mut s = sampler(greedy(vec![(2, -100.0)]));
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 1);
        // An id outside the row is ignored.
        let mut s = sampler(greedy(vec![(40, 100.0)]));
        assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 2);

        // +100 forces a token and -100 bans one, whatever the draw.
        let forced = SamplingParams { logit_bias: vec![(3, 100.0)], ..seeded(1.0, 5) };
        let banned = SamplingParams { logit_bias: vec![(2, -100.0)], ..seeded(1.5, 6) };
        let (mut f, mut b) = (sampler(forced), sampler(banned));
        let mut seen = [0u32; 4];
        for _ in 0..2000 {
            assert_eq!(f.sample(&mut logits.clone(), &[], &[]), 3);
            seen[b.sample(&mut logits.clone(), &[], &[]) as usize] += 1;
        }
        assert_eq!(seen[2], 0, "{seen:?}");
        assert!(seen[0] > 0 && seen[1] > 0 && seen[3] > 0, "{seen:?}");

        // Bias before the repetition penalty: 1 - 3 = -2, then * 2 = -4 (the other order gives
        // 1 / 2 - 3 = -2.5); a greedy draw without log-probabilities leaves that in the row.
        let both = SamplingParams { logit_bias: vec![(0, -3.0)], repetition_penalty: 2.0, ..seeded(0.0, 1) };
        let mut row = logits;
        sampler(both.clone()).sample(&mut row, &[0], &[]);
        assert_eq!(row, [-4.0, 2.0, 3.0, 0.5]);
        // A bias that lifts a negative logit above 0 makes the penalty divide: (-1 + 3) / 2.
        let lift = SamplingParams { logit_bias: vec![(0, 3.0)], repetition_penalty: 2.0, ..seeded(0.0, 1) };
        let mut row = [-1.0f32, 0.0];
        sampler(lift).sample(&mut row, &[0], &[]);
        assert_eq!(row, [1.0, 0.0]);
        // The prepared path agrees.
        let mut row = logits;
        let prepared = sampler(both).prepare(&[0], &[], None);
        assert_eq!(sample_prepared(&mut row, &prepared).unwrap().token, 2);
        assert_eq!(row, [-4.0, 2.0, 3.0, 0.5]);

        // Log-probabilities are those of the biased distribution.
        let mut s = sampler(greedy(vec![(3, 4.0)]));
        let (t, lp) = s.sample_with_logprobs(&mut logits.clone(), &[], &[], 1);
        let z: f32 = [1.0f32, 2.0, 3.0, 4.5].iter().map(|l| l.exp()).sum();
        assert_eq!((t, lp.top[0].0), (3, 3));
        assert!((lp.logprob - (4.5 - z.ln())).abs() < 1e-6, "{lp:?}");
    }

    #[test]
    fn params_deserialise_with_defaults_and_round_trip() {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature":0.6,"top_k":20}"#).unwrap();
        assert_eq!(p, SamplingParams { temperature: 0.6, top_k: 20, ..SamplingParams::default() });
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<SamplingParams>(&json).unwrap(), p);
        let biased = SamplingParams { logit_bias: vec![(7, -1.5), (2, 100.0)], ..p };
        let json = serde_json::to_string(&biased).unwrap();
        assert_eq!(serde_json::from_str::<SamplingParams>(&json).unwrap(), biased);
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_processed_logits() {
        let logits = [1.0, 2.0, 0.5, 2.0, -1.0];
        let params = SamplingParams { top_k: 2, ..seeded(2.0, 5) };
        let mut a = sampler(params.clone());
        let mut b = sampler(params);
        for _ in 0..50 {
            let (t, lp) = a.sample_with_logprobs(&mut logits.clone(), &[], &[], 5);
            // Same token as `sample` from the same state.
            assert_eq!(t, b.sample(&mut logits.clone(), &[], &[]));
            assert_eq!(lp.token, t);
            let total: f32 = lp.top.iter().map(|e| e.1.exp()).sum();
            assert!((total - 1.0).abs() < 1e-5, "{total}");
            assert_eq!(lp.top.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 3, 0, 2, 4]);
            assert_eq!(lp.top.iter().find(|e| e.0 == t).unwrap().1, lp.logprob);
            // Temperature 2 applies; top-k's truncation does not.
            let z: f32 = logits.iter().map(|l| (l / 2.0).exp()).sum();
            assert!((lp.top[2].1 - (0.5 - z.ln())).abs() < 1e-5);
        }
        // Greedy: temperature 1, and fewer entries when asked.
        let mut g = sampler(SamplingParams::greedy());
        let (t, lp) = g.sample_with_logprobs(&mut logits.clone(), &[], &[], 2);
        assert_eq!(t, 1);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (2.0 - z.ln())).abs() < 1e-5);
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0], (1, lp.logprob));
        assert_eq!(lp.top[1].0, 3);
        let (_, lp) = g.sample_with_logprobs(&mut logits.clone(), &[], &[], 0);
        assert!(lp.top.is_empty());
        // Top-k 1 is greedy too, but its temperature still shapes the reported distribution.
        let mut k1 = sampler(SamplingParams { top_k: 1, ..seeded(0.5, 1) });
        let (t, lp) = k1.sample_with_logprobs(&mut logits.clone(), &[], &[], 1);
        let z: f32 = logits.iter().map(|l| (l / 0.5).exp()).sum();
        assert_eq!(t, 1);
        assert!((lp.logprob - (4.0 - z.ln())).abs() < 1e-5);
    }

    fn stream(stops: &[&str], chunks: &[&str]) -> (String, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        let mut hit = false;
        for c in chunks {
            let (emit, stopped) = m.push(c);
            out.push_str(&emit);
            hit |= stopped;
        }
        let rest = m.finish();
        (out, hit, rest)
    }

    #[test]
    fn stop_matcher_holds_back_possible_prefixes() {
        let mut m = StopMatcher::new(vec!["world".into()]);
        assert_eq!(m.push("Hello wo"), ("Hello ".to_string(), false));
        assert_eq!(m.push("rld, bye"), (String::new(), true));
        assert_eq!(m.matched(), Some("world"));
        assert_eq!(m.push("more"), (String::new(), true));
        assert_eq!(m.finish(), "");

        let mut m = StopMatcher::new(vec!["world".into()]);
        assert_eq!(m.push("Hello wo"), ("Hello ".to_string(), false));
        assert_eq!(m.push("ndrous"), ("wondrous".to_string(), false));
        assert_eq!(m.push(" w"), (" ".to_string(), false));
        assert_eq!(m.finish(), "w");
        assert_eq!(m.matched(), None);
    }

    #[test]
    fn stop_matcher_handles_overlapping_prefixes() {
        assert_eq!(stream(&["abc"], &["ababc"]), ("ab".into(), true, String::new()));
        assert_eq!(stream(&["abc"], &["ab", "ab", "c", "d"]), ("ab".into(), true, String::new()));
        assert_eq!(stream(&["abc"], &["a", "b", "a", "b", "c"]), ("ab".into(), true, String::new()));
        assert_eq!(stream(&["aab"], &["a", "a", "a", "b"]), ("a".into(), true, String::new()));
        assert_eq!(stream(&["abc"], &["ab", "ab"]), ("ab".into(), false, "ab".into()));
    }

    #[test]
    fn stop_matcher_picks_the_earliest_of_several_stops() {
        let (out, hit, _) = stream(&["END", "\n\n", "x"], &["one\n", "\nEND"]);
        assert_eq!((out.as_str(), hit), ("one", true));
        let mut m = StopMatcher::new(vec!["cd".into(), "bcd".into(), String::new()]);
        assert_eq!(m.push("abcde"), ("a".to_string(), true));
        assert_eq!(m.matched(), Some("bcd"));
        // No stops: everything passes straight through.
        assert_eq!(stream(&[], &["a", "b"]), ("ab".into(), false, String::new()));
        assert_eq!(stream(&[""], &["a", "b"]), ("ab".into(), false, String::new()));
    }

    #[test]
    fn stop_matcher_never_splits_multibyte_characters() {
        let mut m = StopMatcher::new(vec!["éa".into()]);
        assert_eq!(m.push("xé"), ("x".to_string(), false));
        assert_eq!(m.push("é"), ("é".to_string(), false));
        assert_eq!(m.finish(), "é");

        // A stop whose first bytes match the start of a different character must not hold it.
        let mut m = StopMatcher::new(vec!["é".into()]);
        assert_eq!(m.push("è"), ("è".to_string(), false));
        assert_eq!(m.push("aé"), ("a".to_string(), true));

        assert_eq!(stream(&["日本語"], &["今日", "本", "語です"]), ("今".into(), true, String::new()));
        assert_eq!(stream(&["日本語"], &["今日", "本", "人"]), ("今日本人".into(), false, String::new()));
        assert_eq!(stream(&["🦀!"], &["a🦀", "🦀", "!b"]), ("a🦀".into(), true, String::new()));
    }

    /// The matcher as it was before the automaton (every stop searched in the held text at
    /// each push), kept as the oracle of its exact semantics.
    struct SimpleStopMatcher {
        stops: Vec<String>,
        held: String,
        matched: Option<usize>,
    }

    impl SimpleStopMatcher {
        fn new(stops: Vec<String>) -> Self {
            let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
            SimpleStopMatcher { stops, held: String::new(), matched: None }
        }

        fn push(&mut self, text: &str) -> (String, bool) {
            if self.matched.is_some() {
                return (String::new(), true);
            }
            self.held.push_str(text);
            let hit = self
                .stops
                .iter()
                .enumerate()
                .filter_map(|(i, stop)| self.held.find(stop.as_str()).map(|pos| (pos, i)))
                .min();
            if let Some((pos, i)) = hit {
                self.matched = Some(i);
                self.held.truncate(pos);
                return (std::mem::take(&mut self.held), true);
            }
            let keep = self
                .stops
                .iter()
                .filter_map(|stop| {
                    stop.char_indices()
                        .map(|(i, _)| i)
                        .skip(1)
                        .filter(|&i| self.held.ends_with(&stop[..i]))
                        .last()
                })
                .max()
                .unwrap_or(0);
            let emit = self.held[..self.held.len() - keep].to_string();
            self.held.drain(..self.held.len() - keep);
            (emit, false)
        }

        fn finish(&mut self) -> String {
            std::mem::take(&mut self.held)
        }

        fn matched(&self) -> Option<&str> {
            self.matched.map(|i| self.stops[i].as_str())
        }
    }

    /// Push by push, the automaton emits, holds back and matches exactly what the simple
    /// search did: random stops (overlapping, prefixes of each other, repeated, empty,
    /// multi-byte) over random text in random pieces, and pushes after a hit or a finish.
    #[test]
    fn stop_matcher_pushes_exactly_like_the_simple_search() {
        let mut rng = Xoshiro256StarStar::from_seed(7);
        let alphabet = ['a', 'b', 'c', 'é', 'è', '日', '本', '🦀'];
        let word = |rng: &mut Xoshiro256StarStar, letters: u64, n: u64| -> String {
            (0..rng.next_u64() % n).map(|_| alphabet[(rng.next_u64() % letters) as usize]).collect()
        };
        for case in 0..3000 {
            let letters = 2 + rng.next_u64() % 7;
            let stops: Vec<String> = (0..rng.next_u64() % 6).map(|_| word(&mut rng, letters, 7)).collect();
            let (mut fast, mut slow) =
                (StopMatcher::new(stops.clone()), SimpleStopMatcher::new(stops.clone()));
            for step in 0..30 {
                let piece = word(&mut rng, letters, 6);
                assert_eq!(fast.push(&piece), slow.push(&piece), "case {case} step {step}: {stops:?}");
                assert_eq!(fast.matched(), slow.matched());
                if rng.next_u64().is_multiple_of(17) {
                    assert_eq!(fast.finish(), slow.finish(), "case {case} step {step}: {stops:?}");
                }
            }
            assert_eq!(fast.finish(), slow.finish(), "case {case}: {stops:?}");
        }
    }

    #[test]
    fn stop_matcher_agrees_with_a_search_of_the_whole_text() {
        let mut rng = Xoshiro256StarStar::from_seed(99);
        let alphabet = ['a', 'b', 'é', '日'];
        let pick = |rng: &mut Xoshiro256StarStar, n: u64| -> String {
            (0..1 + rng.next_u64() % n).map(|_| alphabet[(rng.next_u64() % 4) as usize]).collect()
        };
        for _ in 0..2000 {
            let stops: Vec<String> = (0..1 + rng.next_u64() % 3).map(|_| pick(&mut rng, 4)).collect();
            let text = pick(&mut rng, 30);
            let mut chunks = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            let mut i = 0;
            while i < chars.len() {
                let n = (1 + rng.next_u64() % 4) as usize;
                let end = (i + n).min(chars.len());
                chunks.push(chars[i..end].iter().collect::<String>());
                i = end;
            }
            let first = stops.iter().filter_map(|s| text.find(s.as_str())).min();
            let expect = match first {
                Some(pos) => (text[..pos].to_string(), true, String::new()),
                None => (String::new(), false, String::new()),
            };
            let chunk_refs: Vec<&str> = chunks.iter().map(|s| s.as_str()).collect();
            let stop_refs: Vec<&str> = stops.iter().map(|s| s.as_str()).collect();
            let (out, hit, rest) = stream(&stop_refs, &chunk_refs);
            if hit {
                assert_eq!((out, hit, rest), expect, "{stops:?} {chunks:?}");
            } else {
                assert!(first.is_none(), "{stops:?} {chunks:?}");
                assert_eq!(out + &rest, text);
            }
        }
    }
}
