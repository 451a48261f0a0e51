//! The HTTP API: routes, authentication, request → [`Job`] (template rendering and
//! tokenization), and engine events → OpenAI responses, whole or as server-sent events.
//!
//! Handlers never block the async runtime on model work: rendering and tokenizing run on
//! the blocking pool, generation on the engine thread. The prompt work is bounded: a
//! [`PromptGate`] lets as many prompts be rendered and tokenized at once as there are cores
//! (a bounded number more wait, cancellably; beyond that, 429), and tokenization stops as
//! soon as the prompt cannot fit the context ([`Tokenizer::encode_within`]), so a request
//! costs memory and time in proportion to the context, not to the text it sends. A handler's event receiver lives as
//! long as its client: when the connection closes, axum drops the handler future or the SSE
//! stream, the receiver goes with it, and the engine cancels the sequence at its next step.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use strix::chat::ChatTemplate;
use strix::constraint::{thinking_prefix, Constraint, Constraints};
use strix::generate::FinishReason;
use strix::sampling::{Sampler, SamplingParams, StopMatcher, TokenLogprobs};
use strix::tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::engine::{EngineHandle, Event, Job};
use crate::error::ApiError;
use crate::guard::{self, BrowserPolicy};
pub use crate::ids::{fresh_id, unix_time};
use crate::metrics::Metrics;
use crate::output::{Delta, OutputParser, ToolCall};
use crate::request::{self, GenOptions, Prompt};

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Tokenizer,
    pub template: Option<Arc<ChatTemplate>>,
    /// Sampling defaults from the model's `generation_config.json`.
    pub defaults: SamplingParams,
    pub metrics: Arc<Metrics>,
    pub model_name: String,
    pub api_key: Option<String>,
    pub max_body: usize,
    /// Unix time the server started, reported as the model's `created`.
    pub created: u64,
    /// Turns at rendering and tokenizing prompts.
    pub prompt_gate: PromptGate,
    /// The grammar compiler for structured output, or why this model has none.
    pub constraints: Result<Constraints, String>,
}

type AppStateRef = Arc<AppState>;

/// Bounds the prompt work on the blocking pool (rendering the chat template, tokenizing):
/// `permits` prompts at once, and at most `max_waiting` requests waiting for a turn, beyond
/// which a request gets 429 at once. A waiting request waits asynchronously (a client that
/// goes away leaves the line); its work, once started, is bounded by the context.
///
/// Without it every request tokenized at once: 16 concurrent 3.9 MB prompts took 10.6 GB,
/// and 24 aborted the process.
pub struct PromptGate {
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: usize,
}

impl PromptGate {
    pub fn new(permits: usize, max_waiting: usize) -> Self {
        PromptGate {
            permits: Arc::new(Semaphore::new(permits.max(1))),
            waiting: AtomicUsize::new(0),
            max_waiting,
        }
    }

    /// One prompt at a time per core: tokenizing is compute-bound, more at once would only
    /// hold more memory.
    pub fn per_core(max_waiting: usize) -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()), max_waiting)
    }

    /// Waits for a turn; the permit is the turn, given back when dropped.
    async fn enter(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Ok(permit);
        }
        /// Leaves the line however the wait ends (a turn, or the client going away).
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiting);
        if waiting >= self.max_waiting {
            return Err(ApiError {
                code: Some("rate_limit_exceeded"),
                ..ApiError::new(
                    axum::http::StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    format!("the server is busy: {waiting} prompts are already waiting to be tokenized; retry later"),
                )
            });
        }
        self.permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::unavailable("the server is shutting down"))
    }
}

/// The known routes, as labels for the request counter (anything else is `other`, so that
/// scanners cannot grow the metric without bound).
const ROUTES: [&str; 6] =
    ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/"];

/// Every route, behind the browser checks of `policy` (see [`crate::guard`]).
pub fn router(state: AppStateRef, policy: Arc<BrowserPolicy>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        // The key is checked first (the outer layer): a client without one learns nothing more.
        .route_layer(middleware::from_fn(guard::require_json))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/", get(page))
        .fallback(not_found)
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn_with_state(policy, guard::check))
        .layer(middleware::from_fn_with_state(state.clone(), count_responses))
        .with_state(state)
}

async fn count_responses(State(state): State<AppStateRef>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let route = ROUTES.iter().find(|r| **r == path).copied().unwrap_or("other");
    let response = next.run(request).await;
    state.metrics.count_response(route, response.status().as_u16());
    response
}

async fn authenticate(State(state): State<AppStateRef>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|given| constant_time_eq(given.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// Compares without an early exit, so the time taken says nothing about where a guess went wrong.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!("no route for {} {}", request.method(), request.uri().path()))
}

async fn health(State(state): State<AppStateRef>) -> Response {
    if state.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::unavailable("the engine has stopped").into_response()
    }
}

async fn metrics(State(state): State<AppStateRef>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render())
        .into_response()
}

async fn models(State(state): State<AppStateRef>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "strix",
            "max_model_len": state.engine.context,
        }]
    }))
}

async fn page() -> Html<&'static str> {
    Html(include_str!("chat.html"))
}

/// Reads the body, refusing more than `limit` bytes (413) before buffering them.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let mut data = Vec::new();
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| match crate::wire::body_timeout_of(&e) {
            Some(limit) => ApiError::body_timeout(limit),
            None => ApiError::bad_request(format!("cannot read the request body: {e}")),
        })?;
        if data.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit));
        }
        data.extend_from_slice(&chunk);
    }
    Ok(data)
}

async fn chat_completions(State(state): State<AppStateRef>, headers: HeaderMap, body: Body) -> Response {
    chat_inner(state, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(state): State<AppStateRef>, headers: HeaderMap, body: Body) -> Response {
    completion_inner(state, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(state: AppStateRef, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let submitted = Instant::now();
    let body = read_body(&headers, body, state.max_body).await?;
    let mut req = request::parse_chat(&body, &state.defaults)?;
    // A constrained answer comes without thinking unless thinking is asked for (then the
    // grammar closes the thinking block first: `thinking_prefix`).
    if req.gen.structured.is_some() && req.template.enable_thinking.is_none() {
        req.template.enable_thinking = Some(false);
    }
    let compiler = compiler(&state, &req.gen)?;
    let template = state
        .template
        .clone()
        .ok_or_else(|| ApiError::bad_request("this model has no chat template; use /v1/completions"))?;
    let limit = prompt_limit(&state, &req.gen)?;
    let tokenizer = state.tokenizer.clone();
    let (messages, options) = (req.messages, req.template.clone());
    let turn = state.prompt_gate.enter().await?;
    let structured = req.gen.structured.clone();
    let (prompt_text, ids, constraint) = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let text = template.render(&messages, &options).map_err(|e| {
            ApiError::invalid_param("messages", format!("cannot apply the chat template: {e}"))
        })?;
        let constraint = compile(compiler.as_ref(), structured.as_ref(), thinking_prefix(&text))?;
        let ids = tokenizer.encode_within(&text, limit).map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok::<_, ApiError>((text, ids, constraint))
    })
    .await
    .map_err(|_| ApiError::internal("rendering the prompt failed"))??;
    let ids = ids.ok_or_else(|| prompt_too_long(&state, &req.gen, "messages", limit))?;

    let tools = if req.parse_tools { req.template.tools.clone() } else { None };
    let parser = OutputParser::new(OutputParser::prompt_opens_reasoning(&prompt_text), tools);
    let events = submit(&state, ids, &req.gen, constraint, "messages", submitted)?;
    let reply = Reply::new(&state, "chatcmpl-", req.gen.clone());
    if req.gen.stream {
        Ok(sse(chat_stream(reply, events, parser)))
    } else {
        chat_whole(reply, events, parser).await
    }
}

async fn completion_inner(state: AppStateRef, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let submitted = Instant::now();
    let body = read_body(&headers, body, state.max_body).await?;
    let req = request::parse_completion(&body, &state.defaults)?;
    let compiler = compiler(&state, &req.gen)?;
    let structured = req.gen.structured.clone();
    let constraint = match (&compiler, &structured) {
        (Some(_), Some(_)) => {
            let turn = state.prompt_gate.enter().await?;
            tokio::task::spawn_blocking(move || {
                let _turn = turn;
                compile(compiler.as_ref(), structured.as_ref(), "")
            })
            .await
            .map_err(|_| ApiError::internal("compiling the grammar failed"))??
        }
        _ => None,
    };
    let ids = match req.prompt {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            let limit = prompt_limit(&state, &req.gen)?;
            let tokenizer = state.tokenizer.clone();
            let turn = state.prompt_gate.enter().await?;
            tokio::task::spawn_blocking(move || {
                let _turn = turn;
                tokenizer.encode_within(&text, limit)
            })
            .await
            .map_err(|_| ApiError::internal("tokenizing the prompt failed"))?
            .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?
            .ok_or_else(|| prompt_too_long(&state, &req.gen, "prompt", limit))?
        }
    };
    let events = submit(&state, ids, &req.gen, constraint, "prompt", submitted)?;
    let reply = Reply::new(&state, "cmpl-", req.gen.clone());
    if req.gen.stream {
        Ok(sse(completion_stream(reply, events)))
    } else {
        completion_whole(reply, events).await
    }
}

/// The most prompt tokens a request may have: the context less `max_tokens`, or less one
/// token to generate when it asks for none. A `max_tokens` that leaves no room is refused
/// here, before any tokenizing.
fn prompt_limit(state: &AppState, gen: &GenOptions) -> Result<usize, ApiError> {
    let context = state.engine.context;
    match gen.max_tokens {
        Some(max) if max >= context => Err(ApiError {
            param: Some(gen.max_tokens_param.to_owned()),
            ..ApiError::context_length(format!(
                "`{}` is {max}, and this server's context holds {context} tokens (prompt and completion \
                 together); ask for fewer than {context} tokens",
                gen.max_tokens_param
            ))
        }),
        Some(max) => Ok(context - max),
        None => Ok(context.saturating_sub(1)),
    }
}

/// The prompt has more than `limit` tokens (tokenizing stopped there).
fn prompt_too_long(state: &AppState, gen: &GenOptions, prompt_param: &str, limit: usize) -> ApiError {
    let context = state.engine.context;
    let room = match gen.max_tokens {
        Some(max) => format!("{max} of them asked for the completion (`{}`)", gen.max_tokens_param),
        None => "at least one of them for the completion".to_owned(),
    };
    ApiError {
        param: Some(prompt_param.to_owned()),
        ..ApiError::context_length(format!(
            "the prompt is longer than {limit} tokens, and this server's context holds {context} tokens \
             with {room}; shorten the prompt"
        ))
    }
}

/// The grammar compiler when the request asks for structured output; 400 when this model
/// has none.
fn compiler(state: &AppState, gen: &GenOptions) -> Result<Option<Constraints>, ApiError> {
    match (&gen.structured, &state.constraints) {
        (None, _) => Ok(None),
        (Some(_), Ok(constraints)) => Ok(Some(constraints.clone())),
        (Some(s), Err(why)) => {
            Err(ApiError::invalid_param(s.param, format!("structured output is unavailable: {why}")))
        }
    }
}

/// Compiles the request's grammar (on the blocking pool: a large schema takes milliseconds);
/// what llguidance cannot compile is a 400 naming the field.
fn compile(
    compiler: Option<&Constraints>,
    structured: Option<&request::Structured>,
    prefix: &str,
) -> Result<Option<Constraint>, ApiError> {
    let (Some(compiler), Some(s)) = (compiler, structured) else { return Ok(None) };
    compiler
        .compile(&s.grammar, prefix)
        .map(Some)
        .map_err(|e| ApiError::invalid_param(s.param, e.to_string()))
}

/// Checks the prompt against the context, fixes `max_tokens` and queues the job.
fn submit(
    state: &AppState,
    prompt: Vec<u32>,
    gen: &GenOptions,
    constraint: Option<Constraint>,
    prompt_param: &str,
    submitted: Instant,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    let context = state.engine.context;
    if let Err(e) = gen.sampling.validate_vocab(state.engine.vocab_size) {
        return Err(ApiError::invalid_param("logit_bias", e.to_string()));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(prompt_param, "the prompt is empty (0 tokens)"));
    }
    if prompt.len() >= context {
        return Err(ApiError {
            param: Some(prompt_param.to_owned()),
            ..ApiError::context_length(format!(
                "the prompt is {} tokens long, and this server's context holds {context} tokens \
                 (prompt and completion together); shorten the prompt",
                prompt.len()
            ))
        });
    }
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= state.engine.vocab_size) {
        return Err(ApiError::invalid_param(
            prompt_param,
            format!("token id {bad} is outside the vocabulary ({} ids)", state.engine.vocab_size),
        ));
    }
    let room = context - prompt.len();
    // As OpenAI and vLLM do: a completion that cannot fit is refused, not cut short.
    if let Some(max) = gen.max_tokens.filter(|&max| max > room) {
        return Err(ApiError {
            param: Some(gen.max_tokens_param.to_owned()),
            ..ApiError::context_length(format!(
                "the prompt is {} tokens long and `{}` asks for {max} more, {} in all, and this \
                 server's context holds {context} tokens; ask for at most {room} or shorten the prompt",
                prompt.len(),
                gen.max_tokens_param,
                prompt.len() + max
            ))
        });
    }
    let max_tokens = gen.max_tokens.unwrap_or(room);
    let sampler = Sampler::new(gen.sampling.clone()).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let (events, receiver) = unbounded_channel();
    state.engine.submit(Job {
        prompt,
        max_tokens,
        sampler,
        // Built here, off the engine thread (the stops are capped by request.rs).
        stops: StopMatcher::new(gen.stop.clone()),
        logprobs: gen.logprobs,
        ignore_eos: gen.ignore_eos,
        constraint,
        events,
        submitted,
    })?;
    Ok(receiver)
}

/// Identity and options of one response, shared by its chunks.
struct Reply {
    id: String,
    created: u64,
    model: String,
    gen: GenOptions,
    tokenizer: Tokenizer,
}

impl Reply {
    fn new(state: &AppState, prefix: &str, gen: GenOptions) -> Self {
        Reply {
            id: fresh_id(prefix),
            created: unix_time(),
            model: state.model_name.clone(),
            gen,
            tokenizer: state.tokenizer.clone(),
        }
    }

    fn chunk(&self, object: &str, choice: Value) -> Value {
        let mut chunk = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice],
        });
        if self.gen.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    fn usage_chunk(&self, object: &str, usage: Value) -> Value {
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": usage,
        })
    }
}

/// OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens the
/// prefix cache restored rather than prefilled.
fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

fn finish_reason(finish: FinishReason, tool_calls: bool) -> &'static str {
    match finish {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eos | FinishReason::Stop if tool_calls => "tool_calls",
        FinishReason::Eos | FinishReason::Stop => "stop",
    }
}

fn tool_call_json(call: &ToolCall, index: Option<usize>) -> Value {
    let mut value = json!({
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if let Some(index) = index {
        value["index"] = json!(index);
    }
    value
}

/// The parts of a chat answer, gathered from the parser's deltas.
#[derive(Default)]
struct ChatParts {
    reasoning: String,
    content: String,
    tool_calls: Vec<ToolCall>,
}

impl ChatParts {
    fn add(&mut self, deltas: Vec<Delta>) {
        for delta in deltas {
            match delta {
                Delta::Reasoning(text) => self.reasoning.push_str(&text),
                Delta::Content(text) => self.content.push_str(&text),
                Delta::ToolCall(call) => self.tool_calls.push(call),
            }
        }
    }
}

async fn chat_whole(
    reply: Reply,
    mut events: UnboundedReceiver<Event>,
    mut parser: OutputParser,
) -> Result<Response, ApiError> {
    let mut parts = ChatParts::default();
    let mut logprobs = Vec::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token { text, logprobs: lp } => {
                parts.add(parser.push(&text));
                logprobs.extend(lp);
            }
            Event::Done { finish, prompt_tokens, completion_tokens, cached_tokens } => {
                parts.add(parser.finish());
                let has_tools = !parts.tool_calls.is_empty();
                let mut message = json!({
                    "role": "assistant",
                    "content": if parts.content.is_empty() && has_tools { Value::Null } else { json!(parts.content) },
                    "reasoning_content": if parts.reasoning.is_empty() { Value::Null } else { json!(parts.reasoning) },
                });
                if has_tools {
                    message["tool_calls"] =
                        parts.tool_calls.iter().map(|c| tool_call_json(c, None)).collect::<Vec<_>>().into();
                }
                let logprobs = reply.gen.logprobs.map(|_| chat_logprobs(&reply.tokenizer, &logprobs));
                return Ok(Json(json!({
                    "id": reply.id,
                    "object": "chat.completion",
                    "created": reply.created,
                    "model": reply.model,
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason(finish, has_tools),
                    }],
                    "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
                }))
                .into_response());
            }
            Event::Error(e) => return Err(e),
        }
    }
    Err(ApiError::unavailable("the engine stopped before the request finished"))
}

async fn completion_whole(reply: Reply, mut events: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token { text: piece, logprobs: lp } => {
                text.push_str(&piece);
                logprobs.extend(lp);
            }
            Event::Done { finish, prompt_tokens, completion_tokens, cached_tokens } => {
                let logprobs =
                    reply.gen.logprobs.map(|_| completion_logprobs(&reply.tokenizer, &logprobs, 0));
                return Ok(Json(json!({
                    "id": reply.id,
                    "object": "text_completion",
                    "created": reply.created,
                    "model": reply.model,
                    "choices": [{
                        "index": 0,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason(finish, false),
                    }],
                    "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
                }))
                .into_response());
            }
            Event::Error(e) => return Err(e),
        }
    }
    Err(ApiError::unavailable("the engine stopped before the request finished"))
}

fn sse(chunks: impl Stream<Item = Value> + Send + 'static) -> Response {
    let events = chunks
        .map(|chunk| SseEvent::default().data(chunk.to_string()))
        .chain(stream::once(async { SseEvent::default().data("[DONE]") }))
        .map(Ok::<_, Infallible>);
    Sse::new(events).into_response()
}

/// Where a streamed response is.
enum Phase {
    Start,
    Running,
    Over,
}

struct ChatStream {
    reply: Reply,
    events: UnboundedReceiver<Event>,
    parser: OutputParser,
    /// Log-probabilities not yet sent: they ride on the next chunk.
    logprobs: Vec<TokenLogprobs>,
    tool_index: usize,
    phase: Phase,
}

impl ChatStream {
    fn delta_chunk(&mut self, delta: Value, finish: Option<&str>) -> Value {
        let logprobs = if self.reply.gen.logprobs.is_some() && !self.logprobs.is_empty() {
            chat_logprobs(&self.reply.tokenizer, &std::mem::take(&mut self.logprobs))
        } else {
            Value::Null
        };
        self.reply.chunk(
            "chat.completion.chunk",
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}),
        )
    }

    fn deltas(&mut self, deltas: Vec<Delta>) -> Vec<Value> {
        deltas
            .into_iter()
            .map(|delta| {
                let delta = match delta {
                    Delta::Reasoning(text) => json!({"reasoning_content": text}),
                    Delta::Content(text) => json!({"content": text}),
                    Delta::ToolCall(call) => {
                        self.tool_index += 1;
                        json!({"tool_calls": [tool_call_json(&call, Some(self.tool_index - 1))]})
                    }
                };
                self.delta_chunk(delta, None)
            })
            .collect()
    }

    async fn next_chunks(&mut self) -> Option<Vec<Value>> {
        match self.phase {
            Phase::Start => {
                self.phase = Phase::Running;
                Some(vec![self.delta_chunk(json!({"role": "assistant", "content": ""}), None)])
            }
            Phase::Over => None,
            Phase::Running => {
                let event = self.events.recv().await;
                Some(match event {
                    Some(Event::Token { text, logprobs }) => {
                        self.logprobs.extend(logprobs);
                        let deltas = self.parser.push(&text);
                        self.deltas(deltas)
                    }
                    Some(Event::Done { finish, prompt_tokens, completion_tokens, cached_tokens }) => {
                        self.phase = Phase::Over;
                        let deltas = self.parser.finish();
                        let mut chunks = self.deltas(deltas);
                        let reason = finish_reason(finish, self.parser.tool_calls() > 0);
                        chunks.push(self.delta_chunk(json!({}), Some(reason)));
                        if self.reply.gen.include_usage {
                            chunks.push(self.reply.usage_chunk(
                                "chat.completion.chunk",
                                usage(prompt_tokens, completion_tokens, cached_tokens),
                            ));
                        }
                        chunks
                    }
                    Some(Event::Error(e)) => {
                        self.phase = Phase::Over;
                        vec![e.body()]
                    }
                    None => {
                        self.phase = Phase::Over;
                        vec![ApiError::unavailable("the engine stopped before the request finished").body()]
                    }
                })
            }
        }
    }
}

fn chat_stream(
    reply: Reply,
    events: UnboundedReceiver<Event>,
    parser: OutputParser,
) -> impl Stream<Item = Value> + Send + 'static {
    let state =
        ChatStream { reply, events, parser, logprobs: Vec::new(), tool_index: 0, phase: Phase::Start };
    stream::unfold(state, |mut s| async move { s.next_chunks().await.map(|chunks| (chunks, s)) })
        .flat_map(stream::iter)
}

fn completion_stream(
    reply: Reply,
    events: UnboundedReceiver<Event>,
) -> impl Stream<Item = Value> + Send + 'static {
    // (reply, events, text offset so far, over)
    let state = (reply, events, 0usize, false);
    stream::unfold(state, |(reply, mut events, offset, over)| async move {
        if over {
            return None;
        }
        let choice = |text: &str, logprobs: Value, finish: Option<&str>| {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish})
        };
        let (chunks, offset, over) = match events.recv().await {
            Some(Event::Token { text, logprobs }) => {
                let lp = match (&reply.gen.logprobs, logprobs) {
                    (Some(_), Some(lp)) => completion_logprobs(&reply.tokenizer, &[lp], offset),
                    _ => Value::Null,
                };
                let chunk = reply.chunk("text_completion", choice(&text, lp, None));
                (vec![chunk], offset + text.len(), false)
            }
            Some(Event::Done { finish, prompt_tokens, completion_tokens, cached_tokens }) => {
                let mut chunks =
                    vec![reply.chunk("text_completion", choice("", Value::Null, Some(finish_reason(finish, false))))];
                if reply.gen.include_usage {
                    chunks.push(reply.usage_chunk("text_completion", usage(prompt_tokens, completion_tokens, cached_tokens)));
                }
                (chunks, offset, true)
            }
            Some(Event::Error(e)) => (vec![e.body()], offset, true),
            None => (vec![ApiError::unavailable("the engine stopped").body()], offset, true),
        };
        Some((chunks, (reply, events, offset, over)))
    })
    .flat_map(stream::iter)
}

/// JSON has no −∞; OpenAI-compatible servers report it as −9999 (as vLLM does).
fn finite(logprob: f32) -> f64 {
    if logprob.is_finite() {
        f64::from(logprob)
    } else {
        -9999.0
    }
}

/// `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
fn chat_logprobs(tokenizer: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let bytes = tokenizer.token_bytes(id);
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": finite(logprob), "bytes": bytes})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect::<Vec<_>>().into();
            e
        })
        .collect();
    json!({"content": content})
}

/// The legacy completions form: parallel arrays, `top_logprobs` as maps from token to logprob.
fn completion_logprobs(tokenizer: &Tokenizer, tokens: &[TokenLogprobs], mut offset: usize) -> Value {
    let text = |id: u32| String::from_utf8_lossy(&tokenizer.token_bytes(id)).into_owned();
    let (mut strings, mut logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for t in tokens {
        let token = text(t.token);
        let top: serde_json::Map<String, Value> =
            t.top.iter().map(|&(id, lp)| (text(id), json!(finite(lp)))).collect();
        offsets.push(json!(offset));
        offset += token.len();
        strings.push(json!(token));
        logprobs.push(json!(finite(t.logprob)));
        tops.push(Value::Object(top));
    }
    json!({"tokens": strings, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(stream: bool) -> Reply {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/vlm-f32-gdn2x");
        let gen = GenOptions {
            max_tokens: None,
            max_tokens_param: "max_tokens",
            structured: None,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            logprobs: None,
            stream,
            include_usage: stream,
            ignore_eos: false,
        };
        Reply {
            id: fresh_id("chatcmpl-"),
            created: 0,
            model: "m".into(),
            gen,
            tokenizer: Tokenizer::from_model_dir(&dir).unwrap().unwrap(),
        }
    }

    /// Engine events for a model that thinks, says a word, and calls two tools.
    fn tool_events() -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        let text = "Let me look.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n\
                    <parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n\
                    {\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>";
        for piece in text.as_bytes().chunks(7) {
            let text = String::from_utf8(piece.to_vec()).unwrap();
            tx.send(Event::Token { text, logprobs: None }).unwrap();
        }
        tx.send(Event::Done {
            finish: FinishReason::Eos,
            prompt_tokens: 10,
            completion_tokens: 40,
            cached_tokens: 0,
        })
        .unwrap();
        rx
    }

    fn tools() -> Option<Value> {
        Some(json!([{"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "function": {"name": "get_time"}}]))
    }

    #[tokio::test]
    async fn tool_calls_have_openais_whole_shape() {
        let response =
            chat_whole(reply(false), tool_events(), OutputParser::new(true, tools())).await.unwrap();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "Checking.");
        assert_eq!(choice["message"]["reasoning_content"], "Let me look.");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(calls[1]["function"]["arguments"], "{\"tz\":\"CET\"}");
        assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    }

    #[tokio::test]
    async fn tool_calls_have_openais_streamed_shape() {
        let chunks: Vec<Value> =
            chat_stream(reply(true), tool_events(), OutputParser::new(true, tools())).collect().await;
        let deltas: Vec<&Value> =
            chunks.iter().filter_map(|c| c["choices"].get(0).map(|c| &c["delta"])).collect();
        assert_eq!(deltas[0]["role"], "assistant");
        let calls: Vec<&Value> = deltas.iter().filter_map(|d| d["tool_calls"].get(0)).collect();
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0]["index"].as_u64(), calls[1]["index"].as_u64()), (Some(0), Some(1)));
        assert_eq!(calls[1]["function"]["name"], "get_time");
        let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
        assert_eq!(content, "Checking.");
        let finish: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0)?.get("finish_reason"))
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, vec![&json!("tool_calls")]);
        let usage = chunks.last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 50);
    }

    /// A turn each for `permits` requests; `max_waiting` more wait, and leave the line when
    /// their client goes away (the future is dropped); beyond them, 429 at once.
    #[tokio::test]
    async fn the_prompt_gate_bounds_work_and_waiting() {
        use std::future::Future;
        use std::task::{Context, Poll};
        let gate = PromptGate::new(1, 1);
        let turn = gate.enter().await.unwrap();
        let mut waiter = Box::pin(gate.enter());
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        assert!(waiter.as_mut().poll(&mut cx).is_pending());
        let refused = gate.enter().await.unwrap_err();
        assert_eq!((refused.status.as_u16(), refused.kind), (429, "rate_limit_error"));
        drop(waiter);
        let mut waiter = Box::pin(gate.enter());
        assert!(waiter.as_mut().poll(&mut cx).is_pending(), "the cancelled waiter left the line");
        drop(turn);
        assert!(matches!(waiter.as_mut().poll(&mut cx), Poll::Ready(Ok(_))));
    }

    #[test]
    fn ids_are_unique() {
        let a = fresh_id("x-");
        let b = fresh_id("x-");
        assert!(a.starts_with("x-") && a != b);
    }

    #[test]
    fn keys_compare_whole() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
