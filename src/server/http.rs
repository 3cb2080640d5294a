//! The routes, their handlers, and the layers around them: a log line and
//! a count per request, the API key, a connection closed after a body left
//! unread, and a panic turned into a 500.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::rejection::{BytesRejection, FailedToBufferBody};
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::FutureExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::engine_thread::{Event, ModelInfo, Submission, panic_text};
use super::openai::{ApiError, Endpoint, Job, chat_job, completion_job, fields, parse_body};
use super::reply::{Cut, Outcome, Piece, choice, chunk_choice, collect, usage};
use super::{LoadState, ServerOptions, Shared};
use crate::batch::{Request as EngineRequest, SequenceId};
use crate::error::Error;

/// The handlers' shared state.
pub(super) struct App {
    shared: Arc<Shared>,
    submissions: std::sync::mpsc::Sender<Submission>,
    api_key: Option<String>,
    max_body: usize,
    /// Most requests admitted at once: those running and those queued.
    capacity: usize,
    log_requests: bool,
    next_id: AtomicU64,
}

impl App {
    pub fn new(
        options: &ServerOptions,
        shared: Arc<Shared>,
        submissions: std::sync::mpsc::Sender<Submission>,
    ) -> Self {
        App {
            shared,
            submissions,
            api_key: options.api_key.clone(),
            max_body: options.max_body,
            capacity: options.parallel.saturating_add(options.queue),
            log_requests: options.log_requests,
            next_id: AtomicU64::new(1),
        }
    }

    /// The model served, or a 503 while it loads.
    fn model(&self) -> Result<Arc<ModelInfo>, ApiError> {
        match &*self.shared.state.lock().unwrap_or_else(|e| e.into_inner()) {
            LoadState::Ready(info) => Ok(info.clone()),
            LoadState::Loading => Err(ApiError::unavailable("the model is loading")),
            LoadState::Failed(e) => Err(ApiError::unavailable(format!("the model failed to load: {e}"))),
        }
    }

    /// A place among the requests running or queued, or a 503 when all are
    /// taken.
    fn admit(&self) -> Result<Admission, ApiError> {
        let admitted = &self.shared.metrics.admitted;
        if admitted.fetch_add(1, Ordering::SeqCst) >= self.capacity {
            admitted.fetch_sub(1, Ordering::SeqCst);
            let message =
                format!("the server is busy ({} requests running or queued): retry later", self.capacity);
            return Err(ApiError::unavailable(message));
        }
        Ok(Admission(self.shared.clone()))
    }

    fn log(&self, method: &str, path: &str, status: u16, tokens: TokenCounts, started: Instant) {
        if self.log_requests {
            let ms = started.elapsed().as_secs_f64() * 1e3;
            let TokenCounts { prompt, generated } = tokens;
            eprintln!("{method} {path} {status} prompt={prompt} generated={generated} {ms:.1}ms");
        }
    }
}

/// A request's place among those admitted, given back when dropped.
struct Admission(Arc<Shared>);

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.metrics.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Tokens of a request, for its log line.
#[derive(Debug, Clone, Copy, Default)]
struct TokenCounts {
    prompt: usize,
    generated: usize,
}

/// Marks a streamed response: its stream writes its own log line.
#[derive(Debug, Clone, Copy)]
struct Streamed;

pub(super) fn router(app: App) -> Router {
    let app = Arc::new(app);
    let max_body = app.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(from_fn(catch_panic))
        .layer(from_fn_with_state(app.clone(), authorize))
        .layer(from_fn(close_if_unread))
        .layer(from_fn_with_state(app.clone(), observe))
        .with_state(app)
}

/// Counts the request by route and status, and logs it (a stream counts
/// and logs itself once it ends; a request whose client went away before
/// its answer, as status 499).
async fn observe(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let route = request.extensions().get::<MatchedPath>().map_or("other", |m| m.as_str()).to_string();
    let mut pending = Pending {
        app: &app,
        method: request.method().to_string(),
        path: request.uri().path().to_string(),
        route,
        started: Instant::now(),
        answered: false,
    };
    let response = next.run(request).await;
    pending.answered = true;
    if response.extensions().get::<Streamed>().is_none() {
        let status = response.status().as_u16();
        app.shared.metrics.count_request(&pending.route, status);
        let tokens = response.extensions().get::<TokenCounts>().copied().unwrap_or_default();
        app.log(&pending.method, &pending.path, status, tokens, pending.started);
    }
    response
}

/// A request being answered; dropped unanswered, its client has gone.
struct Pending<'a> {
    app: &'a App,
    method: String,
    path: String,
    route: String,
    started: Instant,
    answered: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.app.shared.metrics.count_request(&self.route, CLIENT_GONE);
            self.app.log(&self.method, &self.path, CLIENT_GONE, TokenCounts::default(), self.started);
        }
    }
}

/// The status logged for a request whose client went away (nginx's).
const CLIENT_GONE: u16 = 499;

/// Longest a stream goes without writing: then a comment line.
const STREAM_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

/// With an API key set, every route but `/health` wants it as a bearer token.
async fn authorize(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if request.uri().path() != "/health" && !given.is_some_and(|g| same_key(g.as_bytes(), key.as_bytes()))
        {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// A request answered before its body was read to its end (refused by the
/// key or the size limit, or by a route that takes no body) closes its
/// connection, and the answer says so: HTTP/1.1 finds the next request's
/// start only past the body's last byte, so such a connection ends, and a
/// client that is not told would send its next request into it.
async fn close_if_unread(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let carries_body = !body.is_end_stream();
    let ended = Arc::new(AtomicBool::new(false));
    let watched = WatchedBody { inner: body, ended: ended.clone() };
    let mut response = next.run(Request::from_parts(parts, Body::new(watched))).await;
    if carries_body && !ended.load(Ordering::Relaxed) {
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request's body that notes when it has been read to its end.
struct WatchedBody {
    inner: Body,
    ended: Arc<AtomicBool>,
}

impl HttpBody for WatchedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.ended.store(true, Ordering::Relaxed);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Compares keys in a time that does not tell how much of a guess is right.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len() && given.iter().zip(key).fold(0, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// A panic while handling a request fails that request alone, with a 500.
async fn catch_panic(request: Request, next: Next) -> Response {
    match AssertUnwindSafe(next.run(request)).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => ApiError::internal(format!("handling the request panicked: {}", panic_text(&panic)))
            .into_response(),
    }
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!("no route {} {}", request.method(), request.uri().path()))
}

/// (The router adds the route's methods as `Allow`.)
async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::method_not_allowed(format!("{} does not take {}", request.uri().path(), request.method()))
}

/// The body as a JSON object, within the size limit.
fn body_json(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    parse_body(&body_bytes(app, body)?)
}

/// The body's bytes, within the size limit.
fn body_bytes(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| match rejection {
        BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_)) => {
            ApiError::too_large(app.max_body)
        }
        other => ApiError::bad_body(format!("reading the body: {}", other.body_text())),
    })
}

async fn chat_completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(app, body, Endpoint::Chat).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(app, body, Endpoint::Completion).await.unwrap_or_else(IntoResponse::into_response)
}

/// A completion: the request checked, admitted, handed to the GPU thread,
/// and its reply streamed or returned whole.
async fn generate(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let info = app.model()?;
    let bytes = body_bytes(&app, body)?;
    // Parsing, templates and tokenizing take CPU time in proportion to the
    // body: off the threads that serve the other requests.
    let checked = info.clone();
    let mut job = tokio::task::spawn_blocking(move || {
        let body = parse_body(&bytes)?;
        match endpoint {
            Endpoint::Chat => chat_job(&body, &checked),
            Endpoint::Completion => completion_job(&body, &checked),
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("checking the request failed: {e}")))??;
    let admission = app.admit()?;
    let events = submit(&app, &mut job, arrived).await?;
    let reply =
        Reply { id: app.next_id.fetch_add(1, Ordering::Relaxed), created: unix_now(), info, job, events };
    if reply.job.stream { Ok(reply.stream(app, admission, arrived)) } else { reply.whole().await }
}

/// Hands the job to the GPU thread; its tokens come on the channel returned.
async fn submit(
    app: &App,
    job: &mut Job,
    arrived: Instant,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    let request = EngineRequest {
        prompt: job.prompt.clone(),
        sampling: job.sampling,
        seed: job.seed,
        max_tokens: job.max_tokens,
        stop_tokens: job.stop_tokens.clone(),
        logprobs: job.logprobs,
        return_logits: false,
        steering: job.steering.take(),
        images: std::mem::take(&mut job.images),
    };
    let (events, receiver) = mpsc::unbounded_channel();
    let (accepted, acceptance) = tokio::sync::oneshot::channel();
    let submission = Submission { request, events, accepted, prompt_tokens: job.prompt_tokens, arrived };
    let stopped = || ApiError::internal("the engine has stopped");
    app.submissions.send(submission).map_err(|_| stopped())?;
    let added: crate::Result<SequenceId> = acceptance.await.map_err(|_| stopped())?;
    added.map_err(|e| engine_refusal(e, job.endpoint))?;
    Ok(receiver)
}

/// The engine's refusal of a request: its fault (400) unless the GPU's.
fn engine_refusal(error: Error, endpoint: Endpoint) -> ApiError {
    match error {
        Error::Gpu(_) | Error::DeviceLost { .. } | Error::OutOfDeviceMemory { .. } => {
            ApiError::internal(error.to_string())
        }
        other => ApiError::invalid(
            if endpoint == Endpoint::Chat { "messages" } else { "prompt" },
            other.to_string(),
        ),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A reply being written: the request's job and its tokens' channel.
struct Reply {
    id: u64,
    created: u64,
    info: Arc<ModelInfo>,
    job: Job,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Reply {
    /// The response's fields every body and chunk has.
    fn envelope(&self, object: &str) -> Value {
        let prefix = if self.job.endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        json!({"id": format!("{prefix}-{}", self.id), "object": object, "created": self.created, "model": self.info.name})
    }

    /// The reply as one JSON body.
    async fn whole(mut self) -> Result<Response, ApiError> {
        let mut pieces = Vec::new();
        let collected = collect(&self.job, &self.info, &mut self.events, std::future::pending(), |piece| {
            pieces.push(piece);
            true
        })
        .await;
        let outcome = match collected {
            Ok(outcome) => outcome,
            Err(Cut::Failed(e)) => return Err(e),
            Err(Cut::Gone { .. }) => return Err(ApiError::internal("the reply ended early")),
        };
        let object = if self.job.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
        let mut body = self.envelope(object);
        body["choices"] = json!([choice(&self.job, &self.info, &pieces, Some(outcome.finish))]);
        body["usage"] = usage(&self.job, &outcome);
        if self.job.return_token_ids {
            body["prompt_token_ids"] = json!(self.job.prompt);
        }
        let mut response = axum::Json(body).into_response();
        response
            .extensions_mut()
            .insert(TokenCounts { prompt: self.job.prompt_tokens, generated: outcome.generated });
        Ok(response)
    }

    /// The reply as server-sent events, written by a task of its own that
    /// holds the request's admission until the reply ends.
    fn stream(self, app: Arc<App>, admission: Admission, arrived: Instant) -> Response {
        let (chunks, received) = mpsc::unbounded_channel::<SseEvent>();
        tokio::spawn(async move {
            let _admission = admission;
            let path =
                if self.job.endpoint == Endpoint::Chat { "/v1/chat/completions" } else { "/v1/completions" };
            let prompt = self.job.prompt_tokens;
            let (status, generated) = match self.write_chunks(&chunks).await {
                Ok(outcome) => (200, outcome.generated),
                Err(Cut::Gone { generated }) => (CLIENT_GONE, generated),
                Err(Cut::Failed(e)) => {
                    let _ = chunks.send(SseEvent::default().data(e.body().to_string()));
                    (e.status.as_u16(), 0)
                }
            };
            app.shared.metrics.count_request(path, status);
            app.log("POST", path, status, TokenCounts { prompt, generated }, arrived);
        });
        let body = futures_util::stream::unfold(received, |mut received| async move {
            received.recv().await.map(|event| (Ok::<_, std::convert::Infallible>(event), received))
        });
        // A comment line whenever no chunk went out for a while (a request
        // waiting for room, a long prompt): a client that left is noticed
        // at the next write, and its sequence cancelled, rather than when
        // its first token is due.
        let keep_alive = KeepAlive::new().interval(STREAM_KEEP_ALIVE).text("waiting");
        let mut response = Sse::new(body).keep_alive(keep_alive).into_response();
        response.extensions_mut().insert(Streamed);
        response
    }

    /// Sends the reply's chunks, then its usage where asked, then `[DONE]`.
    async fn write_chunks(mut self, chunks: &mpsc::UnboundedSender<SseEvent>) -> Result<Outcome, Cut> {
        let object =
            if self.job.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut envelope = self.envelope(object);
        if self.job.include_usage {
            envelope["usage"] = Value::Null;
        }
        let mut prompt_ids = self.job.return_token_ids.then(|| self.job.prompt.clone());
        let mut chunk = |choices: Value| {
            let mut chunk = envelope.clone();
            chunk["choices"] = choices;
            if let Some(ids) = prompt_ids.take() {
                chunk["prompt_token_ids"] = json!(ids);
            }
            SseEvent::default().data(chunk.to_string())
        };
        let (job, info) = (&self.job, &self.info);
        // The response's head goes out with the first event: this one sends
        // it now, before the first token (a completion's has no opening).
        let opening = match job.endpoint {
            Endpoint::Chat => chunk(json!([chunk_choice(job, info, Piece::default(), true)])),
            Endpoint::Completion => SseEvent::default().comment("accepted"),
        };
        let _ = chunks.send(opening);
        // A token without text still makes a chunk where the client wants
        // its logprobs or id, or where the model has no tokenizer (no text).
        let every_token = job.logprobs.is_some() || job.return_token_ids || info.tokenizer.is_none();
        let outcome = collect(job, info, &mut self.events, chunks.closed(), |piece: Piece| {
            if piece.text.is_empty() && piece.finish.is_none() && !every_token {
                return !chunks.is_closed();
            }
            chunks.send(chunk(json!([chunk_choice(job, info, piece, false)]))).is_ok()
        })
        .await?;
        if job.include_usage {
            let mut last = envelope.clone();
            last["choices"] = json!([]);
            last["usage"] = usage(job, &outcome);
            let _ = chunks.send(SseEvent::default().data(last.to_string()));
        }
        let _ = chunks.send(SseEvent::default().data("[DONE]"));
        Ok(outcome)
    }
}

async fn models(State(app): State<Arc<App>>) -> Result<axum::Json<Value>, ApiError> {
    let info = app.model()?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": info.name,
            "object": "model",
            "created": info.created,
            "owned_by": "wgspark",
            "meta": {"n_ctx": info.context_len, "n_vocab": info.config.vocab},
        }],
    })))
}

/// 200 once the model is loaded; 503 while it loads (or if it failed).
async fn health(State(app): State<Arc<App>>) -> Result<axum::Json<Value>, ApiError> {
    app.model()?;
    Ok(axum::Json(json!({"status": "ok"})))
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let content_type = [(header::CONTENT_TYPE, "text/plain; version=0.0.4")];
    (StatusCode::OK, content_type, app.shared.metrics.render()).into_response()
}

#[derive(Deserialize)]
struct TokenizeFields {
    content: String,
    #[serde(default)]
    add_special: bool,
}

#[derive(Deserialize)]
struct DetokenizeFields {
    tokens: Vec<u32>,
}

/// llama-server's `{"content": "..."}` to `{"tokens": [...]}`.
async fn tokenize(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let info = app.model()?;
    let fields: TokenizeFields = fields(&body_json(&app, body)?)?;
    let tokenizer =
        info.tokenizer.as_ref().ok_or_else(|| ApiError::invalid("content", "the model has no tokenizer"))?;
    let encoded = match fields.add_special {
        true => tokenizer.encode_prompt(&fields.content),
        false => tokenizer.encode(&fields.content),
    };
    let tokens = encoded.map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(axum::Json(json!({"tokens": tokens})))
}

/// llama-server's `{"tokens": [...]}` to `{"content": "..."}`.
async fn detokenize(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let info = app.model()?;
    let fields: DetokenizeFields = fields(&body_json(&app, body)?)?;
    let tokenizer =
        info.tokenizer.as_ref().ok_or_else(|| ApiError::invalid("tokens", "the model has no tokenizer"))?;
    let vocab = tokenizer.vocab_size().min(info.config.vocab);
    if let Some(bad) = fields.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(
            "tokens",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    let content = tokenizer.decode(&fields.tokens, false).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(axum::Json(json!({"content": content})))
}
