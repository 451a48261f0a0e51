//! The engine: one thread that owns the model and runs continuous batching.
//!
//! Requests ([`Job`]s, already tokenized) arrive over a channel. Each step of the loop:
//!
//! 1. takes in new jobs, and drops every job or sequence whose client went away (its event
//!    receiver was dropped), so a disconnect cancels within one step and frees its state;
//! 2. admits waiting jobs in arrival order while the batch has room (`max_seqs`) and the
//!    state budget allows (a job reserves its prompt plus `max_tokens` worth of KV cache, plus
//!    the fixed DeltaNet state); a job that arrives to an empty batch is always admitted;
//! 3. prefills: pushes prompt chunks through the model, at most `prefill_chunk` tokens per
//!    step, so a long prompt is spread over several steps and running streams keep flowing
//!    between them. A sequence whose prompt is done samples its first token at once. With the
//!    [`PrefixCache`] on, a sequence at a pass boundary first resumes from the longest cached
//!    prefix of its prompt, and every pass boundary its prefill reaches is saved there;
//! 4. decodes: one [`Model::decode_batch`] over every sequence past its prompt, then each
//!    samples with its own [`Sampler`] and streams the new text; finished sequences leave the
//!    batch and their session is dropped right away.
//!
//! Structured output: a job may carry a grammar ([`Constraint`], compiled by the HTTP layer, which
//! answers a bad one with 400). Its sequence holds it; each step's masks are computed while the
//! backend runs the step ([`Model::decode_batch_masked`], [`fill_masks`]) and applied before the
//! draw, so unconstrained sequences in the batch pay nothing.
//!
//! Batch invariance: `decode_batch` rows are bitwise what decoding alone gives, and prompt
//! chunks always end on multiples of [`Model::pass_tokens`] (the split one `forward` call
//! makes by itself), so a sequence's logits never depend on what else was scheduled, and a
//! greedy request returns the same tokens alone or beside any others.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strix::backend::Backend;
use strix::config::LayerKind;
use strix::constraint::Constraint;
use strix::generate::{fill_masks, FinishReason, Sequence};
use strix::model::{attention_shape, deltanet_shape, Model};
use strix::sampling::{Draw, NonFiniteLogits, Sampler, StopMatcher, TokenLogprobs};
use strix::session::Session;
use strix::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::prefix_cache::{block_keys, BlockKey, PrefixCache};

/// A tokenized request, ready to run.
pub struct Job {
    pub prompt: Vec<u32>,
    /// At most what fits in the context after the prompt.
    pub max_tokens: usize,
    pub sampler: Sampler,
    /// The request's stop strings, matched on its text.
    pub stops: StopMatcher,
    /// `Some(n)`: report each token's log-probability and the `n` most likely alternatives.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// Structured output: the grammar the generated tokens must follow.
    pub constraint: Option<Constraint>,
    pub events: UnboundedSender<Event>,
    /// When the request arrived, for time-to-first-token.
    pub submitted: Instant,
}

/// What the engine sends back for a job.
#[derive(Debug)]
pub enum Event {
    /// A sampled token and the text it completes (possibly empty: held back as part of a
    /// character or a possible stop string). `logprobs` is `None` for end-of-sequence tokens
    /// and for the text released at the end.
    Token { text: String, logprobs: Option<TokenLogprobs> },
    /// The last event of a job that ran to completion.
    /// `cached_tokens` of the prompt were restored from the prefix cache, not prefilled.
    Done { finish: FinishReason, prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize },
    /// The last event of a job that failed.
    Error(ApiError),
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_seqs: usize,
    /// Requests that may wait beyond a full batch; more get 429.
    pub max_queue: usize,
    /// Bytes of KV cache and DeltaNet state the running sequences may reserve together.
    pub state_budget_bytes: u64,
    /// Tokens per sequence (prompt and generated).
    pub context: usize,
    /// Prompt tokens prefilled per step at most (whole passes of [`Model::pass_tokens`]).
    pub prefill_chunk: usize,
    /// Bytes the prefix cache may hold, apart from `state_budget_bytes` (0: no prefix cache).
    pub prefix_cache_bytes: u64,
}

/// Bytes of state a sequence holds: a fixed part (DeltaNet conv and recurrent states) and a
/// part per token (keys and values of every attention layer).
#[derive(Clone, Copy, Debug)]
pub struct StateSizes {
    pub per_sequence: u64,
    pub per_token: u64,
}

impl StateSizes {
    pub fn of<B: Backend>(model: &Model<B>) -> Self {
        let c = &model.config;
        let dn = deltanet_shape(c);
        let at = attention_shape(c);
        let f32_bytes = 4u64;
        let mut sizes = StateSizes { per_sequence: 0, per_token: 0 };
        for kind in &c.layer_kinds {
            match kind {
                LayerKind::DeltaNet => {
                    sizes.per_sequence += (dn.conv_state_len() + dn.state_len()) as u64 * f32_bytes
                }
                LayerKind::Attention => {
                    sizes.per_token += 2 * at.kv_dim() as u64 * model.backend().kv_cache_type().bytes() as u64
                }
            }
        }
        sizes
    }

    pub fn for_tokens(&self, tokens: usize) -> u64 {
        self.per_sequence + tokens as u64 * self.per_token
    }
}

/// The HTTP side's handle on the engine: submits jobs, enforcing the queue bound.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Job>,
    /// Jobs submitted and not yet finished (waiting or running).
    in_flight: Arc<AtomicUsize>,
    alive: Arc<AtomicBool>,
    limit: usize,
    max_queue: usize,
    pub context: usize,
    pub vocab_size: usize,
}

impl EngineHandle {
    /// Starts the engine thread. It runs until every handle is dropped and its work is done.
    pub fn start<B: Backend + 'static>(
        model: Model<B>,
        tokenizer: Tokenizer,
        config: EngineConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(EngineHandle, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let alive = Arc::new(AtomicBool::new(true));
        let handle = EngineHandle {
            tx,
            in_flight: in_flight.clone(),
            alive: alive.clone(),
            limit: config.max_seqs.saturating_add(config.max_queue),
            max_queue: config.max_queue,
            context: config.context,
            vocab_size: model.config.vocab_size,
        };
        let engine = Engine::new(model, tokenizer, config, metrics, rx, in_flight);
        let thread = std::thread::Builder::new().name("strix-engine".into()).spawn(move || {
            // Marks the engine dead however the thread ends, panics included, so requests
            // get 503 and /health reports it.
            struct Dead(Arc<AtomicBool>);
            impl Drop for Dead {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::SeqCst);
                }
            }
            let _dead = Dead(alive);
            engine.run();
        })?;
        Ok((handle, thread))
    }

    /// Queues a job, or refuses it: 429 when `max_seqs + max_queue` jobs are in flight, 503
    /// when the engine has stopped.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        if !self.is_alive() {
            return Err(ApiError::unavailable("the engine has stopped"));
        }
        if self.in_flight.fetch_add(1, Ordering::SeqCst) >= self.limit {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::queue_full(self.max_queue));
        }
        self.tx.send(job).map_err(|_| {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            ApiError::unavailable("the engine has stopped")
        })
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
}

/// A sequence in the batch.
struct Seq<B: Backend> {
    job: Job,
    session: Session<B>,
    /// Its tokens and text, and the rules that end it (the library's, as `generate` runs them).
    sequence: Sequence,
    /// Prompt tokens fed so far (prefilled or restored from the prefix cache).
    fed: usize,
    /// The prompt's [`block_keys`] when the prefix cache is on.
    block_keys: Vec<BlockKey>,
    /// Prompt tokens restored from the prefix cache.
    cached: usize,
    /// The last sampled token, fed at the next decode step.
    next: u32,
    reserved: u64,
    last_token: Option<Instant>,
    /// The client went away (a send failed).
    gone: bool,
}

impl<B: Backend> Seq<B> {
    fn send(&mut self, event: Event) {
        if self.job.events.send(event).is_err() {
            self.gone = true;
        }
    }

    fn cancelled(&self) -> bool {
        self.gone || self.job.events.is_closed()
    }
}

struct Engine<B: Backend> {
    model: Model<B>,
    tokenizer: Tokenizer,
    config: EngineConfig,
    sizes: StateSizes,
    eos: Vec<u32>,
    metrics: Arc<Metrics>,
    rx: Receiver<Job>,
    in_flight: Arc<AtomicUsize>,
    waiting: VecDeque<Job>,
    prefilling: VecDeque<Seq<B>>,
    decoding: Vec<Seq<B>>,
    prefix_cache: Option<PrefixCache<B>>,
    /// State bytes reserved by the sequences in the batch.
    reserved: u64,
    /// Time spent in the model's calls during the current step (for the step histograms).
    in_model: Duration,
}

impl<B: Backend> Engine<B> {
    fn new(
        model: Model<B>,
        tokenizer: Tokenizer,
        config: EngineConfig,
        metrics: Arc<Metrics>,
        rx: Receiver<Job>,
        in_flight: Arc<AtomicUsize>,
    ) -> Self {
        let sizes = StateSizes::of(&model);
        let pass = model.pass_tokens();
        let prefix_cache = (config.prefix_cache_bytes > 0)
            .then(|| PrefixCache::new(pass, sizes.for_tokens(pass), config.prefix_cache_bytes));
        Engine {
            prefix_cache,
            sizes,
            eos: model.config.eos_token_ids.clone(),
            model,
            tokenizer,
            config,
            metrics,
            rx,
            in_flight,
            waiting: VecDeque::new(),
            prefilling: VecDeque::new(),
            decoding: Vec::new(),
            reserved: 0,
            in_model: Duration::ZERO,
        }
    }

    fn run(mut self) {
        let mut open = true;
        loop {
            if self.is_idle() {
                if !open {
                    return;
                }
                match self.rx.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => return,
                }
            }
            while open {
                match self.rx.try_recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            self.publish();
            // A panic in a step (a bug, never input) fails the sequences in the batch rather
            // than taking the server down; their sessions may be half-updated, so they go.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step())).is_err() {
                let lost: Vec<Seq<B>> = self.prefilling.drain(..).chain(self.decoding.drain(..)).collect();
                for mut seq in lost {
                    seq.send(Event::Error(ApiError::internal(
                        "the engine failed while running this request",
                    )));
                    self.release(&seq);
                }
            }
            self.metrics.steps.fetch_add(1, Ordering::Relaxed);
            self.publish();
        }
    }

    fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.prefilling.is_empty() && self.decoding.is_empty()
    }

    fn step(&mut self) {
        let start = Instant::now();
        self.in_model = Duration::ZERO;
        self.drop_cancelled();
        self.admit();
        self.prefill();
        self.decode();
        if self.in_model > Duration::ZERO {
            let whole = start.elapsed();
            self.metrics.step.observe(whole);
            self.metrics.step_host.observe(whole.saturating_sub(self.in_model));
        }
    }

    fn publish(&self) {
        let running = self.prefilling.len() + self.decoding.len();
        let in_flight = self.in_flight.load(Ordering::SeqCst);
        self.metrics.running.store(running as u64, Ordering::Relaxed);
        self.metrics.queue_depth.store(in_flight.saturating_sub(running) as u64, Ordering::Relaxed);
        self.metrics.reserved_bytes.store(self.reserved, Ordering::Relaxed);
        let cached = self.prefix_cache.as_ref().map_or(0, |c| c.bytes());
        self.metrics.prefix_cache_bytes.store(cached, Ordering::Relaxed);
    }

    /// Forgets a sequence that left the batch: its reservation and its place in flight.
    fn release(&mut self, seq: &Seq<B>) {
        self.reserved -= seq.reserved;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|job| !job.events.is_closed());
        let gone_waiting = before - self.waiting.len();
        self.in_flight.fetch_sub(gone_waiting, Ordering::SeqCst);
        let mut cancelled = gone_waiting;

        let (keep, gone): (Vec<_>, Vec<_>) = self.prefilling.drain(..).partition(|s| !s.cancelled());
        self.prefilling = keep.into();
        let (keep2, gone2): (Vec<_>, Vec<_>) = self.decoding.drain(..).partition(|s| !s.cancelled());
        self.decoding = keep2;
        for seq in gone.iter().chain(&gone2) {
            self.release(seq);
            cancelled += 1;
        }
        self.metrics.cancelled.fetch_add(cancelled as u64, Ordering::Relaxed);
    }

    fn admit(&mut self) {
        while let Some(job) = self.waiting.front() {
            let running = self.prefilling.len() + self.decoding.len();
            let need = self.sizes.for_tokens(job.prompt.len() + job.max_tokens);
            let over_budget = self.reserved + need > self.config.state_budget_bytes;
            if running >= self.config.max_seqs || (running > 0 && over_budget) {
                break;
            }
            let Some(mut job) = self.waiting.pop_front() else { break };
            if let Some(error) = self.invalid(&job) {
                let _ = job.events.send(Event::Error(error));
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            self.reserved += need;
            let block_keys = match &self.prefix_cache {
                Some(cache) => {
                    self.metrics
                        .prefix_cache_queries_tokens
                        .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
                    block_keys(&job.prompt, cache.block_tokens())
                }
                None => Vec::new(),
            };
            let seq = Seq {
                block_keys,
                cached: 0,
                session: self.model.new_session(self.config.context),
                sequence: Sequence::new(
                    Some(self.tokenizer.stream_decoder(true)),
                    job.stops.clone(),
                    &self.eos,
                    job.ignore_eos,
                    job.max_tokens,
                )
                .with_constraint(job.constraint.take()),
                fed: 0,
                next: 0,
                reserved: need,
                last_token: None,
                gone: false,
                job,
            };
            self.prefilling.push_back(seq);
        }
    }

    /// The HTTP layer checks all of this first; the engine does not trust it to.
    fn invalid(&self, job: &Job) -> Option<ApiError> {
        let vocab = self.model.config.vocab_size;
        if job.prompt.is_empty() {
            return Some(ApiError::bad_request("the prompt is empty"));
        }
        if job.prompt.len() >= self.config.context {
            return Some(ApiError::context_length(format!(
                "the prompt has {} tokens; the context holds {}",
                job.prompt.len(),
                self.config.context
            )));
        }
        if let Some(bad) = job.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Some(ApiError::invalid_param(
                "prompt",
                format!("token id {bad} is outside the vocabulary"),
            ));
        }
        if job.prompt.len() + job.max_tokens > self.config.context {
            return Some(ApiError::context_length(format!(
                "the prompt has {} tokens and max_tokens is {}; the context holds {}",
                job.prompt.len(),
                job.max_tokens,
                self.config.context
            )));
        }
        if job.max_tokens == 0 {
            return Some(ApiError::invalid_param("max_tokens", "max_tokens must be at least 1"));
        }
        None
    }

    fn prefill(&mut self) {
        let mut budget = self.config.prefill_chunk.max(1);
        let mut i = 0;
        while i < self.prefilling.len() && budget > 0 {
            let seq = &mut self.prefilling[i];
            if let Some(cache) = &mut self.prefix_cache {
                match cache.resume(&self.model, &mut seq.session, &seq.job.prompt, &seq.block_keys) {
                    Ok(restored) => {
                        seq.fed += restored;
                        seq.cached += restored;
                        self.metrics.prefix_cache_hit_tokens.fetch_add(restored as u64, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let mut seq = self.prefilling.remove(i).expect("index checked by the loop");
                        seq.send(Event::Error(ApiError::internal(format!(
                            "prefix cache restore failed: {e}"
                        ))));
                        self.release(&seq);
                        continue;
                    }
                }
            }
            let start = seq.fed;
            let pass = self.model.pass_tokens();
            let end = seq.job.prompt.len().min((start / pass + 1) * pass);
            // The last piece finishes the first token's draw next to the logits, as a decode
            // step does: only the token leaves the backend.
            let piece = &seq.job.prompt[start..end];
            let called = Instant::now();
            let result = if end == seq.job.prompt.len() {
                let mut row =
                    seq.job.sampler.prepare(&seq.job.prompt, seq.sequence.generated(), seq.job.logprobs);
                seq.sequence.allowed().and_then(|mask| {
                    row.allowed = mask;
                    self.model.prefill_draw(&mut seq.session, piece, &row).map(Some)
                })
            } else {
                self.model.prefill(&mut seq.session, piece).map(|()| None)
            };
            self.in_model += called.elapsed();
            budget = budget.saturating_sub(end - start);
            self.metrics.prompt_tokens.fetch_add((end - start) as u64, Ordering::Relaxed);
            seq.fed = end;
            // A pass boundary of the prompt: the one place a session is bitwise what any other
            // feed of the same prompt computes, so the one place a block is saved.
            let saved = match (&mut self.prefix_cache, &result) {
                (Some(cache), Ok(_)) => {
                    // The running sequences' reservations, an upper bound on what they may
                    // still allocate, stay free on the device.
                    let headroom = self.reserved;
                    cache.insert(&self.model, &seq.session, &seq.job.prompt, &seq.block_keys, headroom)
                }
                _ => Ok(()),
            };
            let result = result.and_then(|draw| saved.map(|()| draw));
            let draw = match result {
                Ok(draw) => draw,
                Err(e) => {
                    let mut seq = self.prefilling.remove(i).expect("index checked by the loop");
                    seq.send(Event::Error(ApiError::internal(format!("prefill failed: {e}"))));
                    self.release(&seq);
                    continue;
                }
            };
            let Some(draw) = draw else {
                i += 1;
                continue;
            };
            let seq = self.prefilling.remove(i).expect("index checked by the loop");
            self.take(seq, draw);
        }
    }

    fn decode(&mut self) {
        if self.decoding.is_empty() {
            return;
        }
        let tokens: Vec<u32> = self.decoding.iter().map(|s| s.next).collect();
        // Every row's draw is finished next to the logits: only the token ids (and the few
        // log-probabilities asked for) leave the backend.
        let rows: Vec<_> = self
            .decoding
            .iter_mut()
            .map(|s| s.job.sampler.prepare(&s.job.prompt, s.sequence.generated(), s.job.logprobs))
            .collect();
        let (mut sessions, mut sequences): (Vec<&mut Session<B>>, Vec<&mut Sequence>) =
            self.decoding.iter_mut().map(|s| (&mut s.session, &mut s.sequence)).unzip();
        // The grammar masks are computed while the backend runs the step.
        let mut mask_errors = Vec::new();
        let mut masks =
            |rows: &mut [strix::sampling::PreparedSample]| mask_errors = fill_masks(&mut sequences, rows);
        let called = Instant::now();
        let result = self.model.decode_batch_masked(&mut sessions, &tokens, rows, &mut masks);
        self.in_model += called.elapsed();
        match result {
            Ok(draws) => {
                let batch = std::mem::take(&mut self.decoding);
                mask_errors.resize_with(batch.len(), || None);
                for ((mut seq, draw), mask_error) in batch.into_iter().zip(draws).zip(mask_errors) {
                    match mask_error {
                        Some(e) => self.fail(&mut seq, e),
                        None => self.take(seq, draw),
                    }
                }
            }
            Err(e) => self.fail_decoding(e),
        }
    }

    /// A failed decode step: every decoding sequence gets the error and its memory back.
    fn fail_decoding(&mut self, e: strix::Error) {
        let lost: Vec<Seq<B>> = self.decoding.drain(..).collect();
        for mut seq in lost {
            seq.send(Event::Error(ApiError::internal(format!("decode failed: {e}"))));
            self.release(&seq);
        }
    }

    /// A drawn token (or logits no token can be drawn from): streams it, and the sequence
    /// goes on decoding, finishes, or fails.
    fn take(&mut self, mut seq: Seq<B>, draw: Result<Draw, NonFiniteLogits>) {
        match draw {
            Ok(draw) => match self.accept(&mut seq, draw.token, draw.logprobs) {
                Ok(Some(finish)) => self.finish(seq, finish),
                Ok(None) => self.decoding.push(seq),
                Err(e) => self.fail(&mut seq, e),
            },
            Err(e) => self.fail(&mut seq, e),
        }
    }

    /// A sequence that cannot go on (logits no token can be drawn from, a failed grammar): the
    /// error ends it.
    fn fail(&mut self, seq: &mut Seq<B>, e: impl std::fmt::Display) {
        seq.send(Event::Error(ApiError::internal(format!("generation stopped: {e}"))));
        self.metrics.finished.fetch_add(1, Ordering::Relaxed);
        self.release(seq);
    }

    /// Takes `token` as the sequence's next and streams its text; returns why the sequence
    /// ends, if it does.
    fn accept(
        &self,
        seq: &mut Seq<B>,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Result<Option<FinishReason>, strix::Error> {
        let now = Instant::now();
        match seq.last_token {
            None => self.metrics.ttft.observe(now - seq.job.submitted),
            Some(last) => self.metrics.itl.observe(now - last),
        }
        seq.last_token = Some(now);
        seq.next = token;
        self.metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let accepted = seq.sequence.accept(token, seq.session.remaining())?;
        if let Some(text) = accepted.text {
            seq.send(Event::Token { text, logprobs });
        }
        Ok(accepted.finish)
    }

    /// Releases the text held back, reports the end, and drops the sequence's state.
    fn finish(&mut self, mut seq: Seq<B>, finish: FinishReason) {
        let (text, finish) = seq.sequence.finish(finish);
        if !text.is_empty() {
            seq.send(Event::Token { text, logprobs: None });
        }
        let prompt_tokens = seq.job.prompt.len();
        let completion_tokens = seq.sequence.generated().len();
        let cached_tokens = seq.cached;
        seq.send(Event::Done { finish, prompt_tokens, completion_tokens, cached_tokens });
        self.metrics.finished.fetch_add(1, Ordering::Relaxed);
        self.release(&seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use strix::backend::cpu::CpuBackend;
    use strix::sampling::SamplingParams;
    use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

    fn engine(prefill_chunk: usize) -> Engine<CpuBackend> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/vlm-f32-gdn2x");
        let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
        let tokenizer = Tokenizer::from_model_dir(&dir).unwrap().unwrap();
        let config = EngineConfig {
            max_seqs: 8,
            max_queue: 8,
            state_budget_bytes: u64::MAX,
            context: 4096,
            prefill_chunk,
            prefix_cache_bytes: 0,
        };
        let (_tx, rx) = mpsc::channel();
        Engine::new(model, tokenizer, config, Arc::new(Metrics::default()), rx, Arc::new(AtomicUsize::new(0)))
    }

    fn job(prompt_len: usize, max_tokens: usize) -> (Job, UnboundedReceiver<Event>) {
        let (events, rx) = unbounded_channel();
        let job = Job {
            prompt: (0..prompt_len).map(|i| (i % 300) as u32).collect(),
            max_tokens,
            sampler: Sampler::new(SamplingParams::greedy()).unwrap(),
            stops: StopMatcher::new(Vec::new()),
            logprobs: None,
            ignore_eos: true,
            constraint: None,
            events,
            submitted: Instant::now(),
        };
        (job, rx)
    }

    fn tokens(rx: &mut UnboundedReceiver<Event>) -> usize {
        let mut n = 0;
        while let Ok(event) = rx.try_recv() {
            n += matches!(event, Event::Token { .. }) as usize;
        }
        n
    }

    #[test]
    fn long_prompts_prefill_in_chunks_between_decode_steps() {
        let mut e = engine(512);
        let (a, mut a_rx) = job(5, 100);
        e.in_flight.fetch_add(2, Ordering::SeqCst);
        e.waiting.push_back(a);
        e.step();
        assert_eq!(
            (e.decoding.len(), tokens(&mut a_rx)),
            (1, 2),
            "prefill + first token, then a decode step"
        );

        // 1100 prompt tokens: chunks of 512, 512 and 76, one per step.
        let (b, mut b_rx) = job(1100, 10);
        e.waiting.push_back(b);
        for fed in [512, 1024] {
            e.step();
            assert_eq!(e.prefilling[0].fed, fed);
            assert_eq!(
                tokens(&mut a_rx),
                1,
                "the running stream got its token while the prompt was prefilled"
            );
            assert_eq!(tokens(&mut b_rx), 0);
        }
        e.step();
        assert!(e.prefilling.is_empty());
        assert_eq!(e.decoding.len(), 2);
        assert_eq!(tokens(&mut a_rx), 1);
        assert_eq!(tokens(&mut b_rx), 2, "first token after the prefill, second from the decode step");
        assert_eq!(e.metrics.prompt_tokens.load(Ordering::Relaxed), 1105);
        // Every step ran the model, so each is in the step histograms.
        let text = e.metrics.render();
        assert!(text.contains("strix_engine_step_seconds_count 4"), "{text}");
        assert!(text.contains("strix_engine_step_host_seconds_count 4"), "{text}");
    }

    #[test]
    fn a_dropped_receiver_leaves_the_batch_at_the_next_step() {
        let mut e = engine(512);
        let (a, a_rx) = job(5, 100);
        let (b, mut b_rx) = job(5, 100);
        e.in_flight.fetch_add(2, Ordering::SeqCst);
        e.waiting.extend([a, b]);
        e.step();
        assert_eq!(e.decoding.len(), 2);
        let reserved = e.reserved;
        drop(a_rx);
        e.step();
        assert_eq!(e.decoding.len(), 1);
        assert_eq!(e.reserved, reserved / 2);
        assert_eq!(e.in_flight.load(Ordering::SeqCst), 1);
        assert_eq!(e.metrics.cancelled.load(Ordering::Relaxed), 1);
        assert!(tokens(&mut b_rx) > 0);
    }

    /// The fixture with its final norm's weights made NaN: every logit is NaN.
    struct Broken(strix::checkpoint::Checkpoint);

    impl strix::model::TensorSource for Broken {
        fn contains(&self, name: &str) -> bool {
            self.0.contains(name)
        }
        fn tensor(&self, name: &str, shape: &[usize]) -> strix::Result<strix::tensor::HostTensor> {
            let t = self.0.tensor(name, shape)?;
            if !(name.ends_with("language_model.norm.weight") || name == "model.norm.weight") {
                return Ok(t);
            }
            let nan: Vec<u8> = (0..t.numel()).flat_map(|_| f32::NAN.to_le_bytes()).collect();
            let bytes = strix::tensor::Bytes::owned(&nan);
            Ok(strix::tensor::HostTensor { dtype: strix::tensor::DType::F32, bytes, ..t })
        }
    }

    /// Logits that are not finite end the request with an error, never with made-up tokens,
    /// and the sequence's memory comes back.
    #[test]
    fn non_finite_logits_end_the_request_with_an_error() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/vlm-f32-gdn2x");
        let config = strix::config::ModelConfig::from_model_dir(&dir).unwrap();
        let ckpt = strix::checkpoint::Checkpoint::open_dir(&dir).unwrap();
        let model = Model::from_source(config, &Broken(ckpt), CpuBackend::new(), None).unwrap();
        let tokenizer = Tokenizer::from_model_dir(&dir).unwrap().unwrap();
        let mut e = engine(512);
        e.model = model;
        e.tokenizer = tokenizer;
        for params in
            [SamplingParams::greedy(), SamplingParams { temperature: 0.7, ..SamplingParams::default() }]
        {
            let (mut j, mut rx) = job(5, 10);
            j.sampler = Sampler::new(params).unwrap();
            e.in_flight.fetch_add(1, Ordering::SeqCst);
            e.waiting.push_back(j);
            e.step();
            match rx.try_recv() {
                Ok(Event::Error(err)) => {
                    assert_eq!(err.status.as_u16(), 500);
                    assert!(err.message.contains("not finite"), "{}", err.message);
                }
                other => panic!("expected an error, got {other:?}"),
            }
            assert!(e.is_idle());
            assert_eq!(e.reserved, 0);
            assert_eq!(e.in_flight.load(Ordering::SeqCst), 0);
        }
    }

    #[test]
    fn admission_respects_the_batch_size_and_the_state_budget() {
        let mut e = engine(512);
        let need = e.sizes.for_tokens(5 + 100);
        e.config.state_budget_bytes = 2 * need + need / 2;
        let receivers: Vec<_> = (0..4)
            .map(|_| {
                let (j, rx) = job(5, 100);
                e.waiting.push_back(j);
                rx
            })
            .collect();
        e.in_flight.fetch_add(4, Ordering::SeqCst);
        e.step();
        assert_eq!((e.decoding.len(), e.waiting.len()), (2, 2), "two fit the budget");
        e.config.state_budget_bytes = u64::MAX;
        e.config.max_seqs = 3;
        e.step();
        assert_eq!((e.decoding.len(), e.waiting.len()), (3, 1), "three fit the batch");
        drop(receivers);
        e.step();
        assert!(e.is_idle());
        assert_eq!(e.reserved, 0);
        assert_eq!(e.in_flight.load(Ordering::SeqCst), 0);
    }
}
