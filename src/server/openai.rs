//! The OpenAI schema: request bodies read and checked field by field into
//! a [`Job`] (what the engine is asked and how the reply is written), and
//! errors as OpenAI's error object naming the field at fault.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::engine_thread::ModelInfo;
use crate::batch::MAX_TOP_LOGPROBS;
use crate::chat::Message;
use crate::sampling::Sampling;
use crate::steering::Steering;
use crate::vision::RgbImage;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault (`messages[1].role`), where one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds to wait before trying again (a 503's `Retry-After`).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code: None, retry_after: None }
    }

    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// A 400 about the body as a whole.
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn too_large(limit: usize) -> Self {
        let message = format!("the request body is larger than {limit} bytes (the server's --max-body)");
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
    }

    pub fn unauthorized() -> Self {
        let message = "a valid API key is needed: send `Authorization: Bearer KEY`";
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
        }
    }

    /// A 503 to try again after a second.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", message)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    /// A route asked with a method it does not take.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message)
    }

    /// The error object itself.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The body as a JSON object: valid UTF-8, valid JSON, an object.
pub(crate) fn parse_body(bytes: &[u8]) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        ApiError::bad_body(format!("the body is not UTF-8 (invalid byte at offset {})", e.valid_up_to()))
    })?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_body(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_body("the body must be a JSON object"));
    }
    Ok(value)
}

/// `body` read as `T`; a field of the wrong type or a missing one is a
/// 400 naming it.
pub(crate) fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().to_string();
        // serde names a missing field in its message, at its parent's path.
        let missing = message.strip_prefix("missing field `").and_then(|m| m.split('`').next());
        let param = match (missing, path.as_str()) {
            (Some(field), ".") => field.to_string(),
            (Some(field), parent) => format!("{parent}.{field}"),
            (None, path) => path.to_string(),
        };
        ApiError::invalid(param.clone(), format!("{param}: {message}"))
    })
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A control vector a request applies: a name given at start, and a scale.
#[derive(Debug, Deserialize)]
struct ControlVectorUse {
    name: String,
    #[serde(default = "one")]
    scale: f32,
}

fn one() -> f32 {
    1.0
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields both endpoints read (sampling, limits, extensions).
#[derive(Debug, Deserialize)]
struct CommonFields {
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    n: Option<u64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    return_token_ids: Option<bool>,
    ignore_eos: Option<bool>,
    control_vectors: Option<Vec<ControlVectorUse>>,
}

/// A chat message: a role and text, or parts of text and images.
#[derive(Debug, Deserialize)]
struct ChatMessage {
    role: Role,
    content: Option<Content>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    /// OpenAI's newer models call the system prompt's role `developer`.
    #[serde(alias = "developer")]
    System,
    User,
    Assistant,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, or a list of parts {\"type\": \"text\", \"text\": ...} and {\"type\": \"image_url\", \"image_url\": {\"url\": ...}}"
)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Debug, Deserialize)]
struct ImageUrl {
    url: String,
}

#[derive(Debug, Deserialize)]
struct ChatFields {
    messages: Vec<ChatMessage>,
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
}

/// A completion's prompt: text, token ids, or a list of one of them.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, a list of token ids (integers from 0 to 4294967295), or a list of one of them"
)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct CompletionFields {
    prompt: Prompt,
    logprobs: Option<u64>,
    echo: Option<bool>,
}

/// Which endpoint a job answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

/// A request checked and ready: what the engine runs and how the reply
/// is written.
#[derive(Debug)]
pub(crate) struct Job {
    pub endpoint: Endpoint,
    pub prompt: Vec<u32>,
    pub images: Vec<RgbImage>,
    /// The prompt's positions (each image counted by its rows).
    pub prompt_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    pub max_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub stop_strings: Vec<String>,
    /// Top alternatives per token, where logprobs were asked for.
    pub logprobs: Option<usize>,
    pub steering: Option<Steering>,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
}

/// A `/v1/chat/completions` body checked against the model.
pub(crate) fn chat_job(body: &Value, info: &ModelInfo) -> Result<Job, ApiError> {
    refuse_unhonoured(body, Endpoint::Chat)?;
    let common: CommonFields = fields(body)?;
    let chat: ChatFields = fields(body)?;
    let (tokenizer, template) = match (&info.tokenizer, &info.template) {
        (Some(t), Some(c)) => (t, c),
        (None, _) => {
            return Err(ApiError::invalid(
                "messages",
                "the model has no tokenizer: send token ids to /v1/completions",
            ));
        }
        (_, None) => return Err(ApiError::invalid("messages", "the model carries no chat template")),
    };
    if chat.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must hold at least one message"));
    }
    let mut messages = Vec::with_capacity(chat.messages.len());
    let mut images = Vec::new();
    for (i, message) in chat.messages.iter().enumerate() {
        let (text, mut message_images) = message_content(message, i, info)?;
        messages.push(Message::with_images(message.role.name(), message_images.len(), &text));
        images.append(&mut message_images);
    }
    let rendered = template
        .render(&messages, true)
        .map_err(|e| ApiError::invalid("messages", format!("rendering the chat template: {e}")))?;
    let prompt = tokenizer.encode(&rendered).map_err(|e| ApiError::internal(e.to_string()))?;
    let logprobs = match (chat.logprobs.unwrap_or(false), chat.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true"));
        }
        (false, None) => None,
        (true, n) => Some(top_logprobs(n.unwrap_or(0), "top_logprobs")?),
    };
    job(Endpoint::Chat, common, (prompt, images), logprobs, info)
}

/// A `/v1/completions` body checked against the model.
pub(crate) fn completion_job(body: &Value, info: &ModelInfo) -> Result<Job, ApiError> {
    refuse_unhonoured(body, Endpoint::Completion)?;
    let common: CommonFields = fields(body)?;
    let completion: CompletionFields = fields(body)?;
    if completion.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported: it must be false"));
    }
    let text = |text: &str| match &info.tokenizer {
        Some(tokenizer) => tokenizer.encode_prompt(text).map_err(|e| ApiError::internal(e.to_string())),
        None => Err(ApiError::invalid("prompt", "the model has no tokenizer: give the prompt as token ids")),
    };
    let one = |n: usize| {
        (n == 1).then_some(()).ok_or_else(|| ApiError::invalid("prompt", "one prompt per request"))
    };
    let prompt = match &completion.prompt {
        Prompt::Text(s) => text(s)?,
        Prompt::Ids(ids) => ids.clone(),
        Prompt::Texts(list) => {
            one(list.len())?;
            text(&list[0])?
        }
        Prompt::IdLists(list) => {
            one(list.len())?;
            list[0].clone()
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt holds no token"));
    }
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= info.config.vocab) {
        let vocab = info.config.vocab;
        return Err(ApiError::invalid(
            "prompt",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    let logprobs = completion.logprobs.map(|n| top_logprobs(n, "logprobs")).transpose()?;
    job(Endpoint::Completion, common, (prompt, Vec::new()), logprobs, info)
}

/// OpenAI fields that ask for a reply the server cannot give (tool calls,
/// structured output, biased logits, audio, insertion, several candidates),
/// each with why, and whether a value of it asks for nothing (null always
/// does). Such a request is refused, naming the field: a reply that
/// ignored the field would look like an answer to it and not be one.
/// Fields that change no reply (`user`, `metadata`, `store`, ...) are read
/// and ignored, as `model` is.
type Unhonoured = (&'static str, &'static str, fn(&Value) -> bool);

/// Refused on both endpoints: each is OpenAI's on one of them, and means
/// the same on the other.
const UNHONOURED: &[Unhonoured] = &[
    ("tools", "tool calling is not supported", empty_list),
    ("functions", "tool calling is not supported", empty_list),
    ("tool_choice", "tool calling is not supported", no_tool_call),
    ("function_call", "tool calling is not supported", no_tool_call),
    ("response_format", "structured output is not supported: the type must be text", text_format),
    ("logit_bias", "biased logits are not supported", empty_map),
    ("modalities", "only text output is supported", text_only),
    ("audio", "only text output is supported", |_| false),
    ("suffix", "suffix (text after the insertion) is not supported", |v| v == ""),
    ("best_of", "best_of must be 1 (one candidate per request)", |v| v == 1),
    ("echo", "echo is not supported: it must be false", |v| v == false),
];

/// Refused on `/v1/completions` alone: chat's form of a field it has too.
const UNHONOURED_COMPLETION: &[Unhonoured] = &[(
    "top_logprobs",
    "top_logprobs is chat's field: a completion asks for its alternatives with logprobs: N",
    |_| false,
)];

/// Other servers' sampling and constrained-output extensions (llama-server's,
/// vLLM's), refused on both endpoints where they would change the reply:
/// the sampler here has temperature, top-k and top-p alone.
const UNHONOURED_EXTENSIONS: &[Unhonoured] = &[
    ("min_p", "min_p sampling is not supported: it must be 0", is_zero),
    ("typical_p", "typical sampling is not supported: it must be 1", is_one),
    ("tfs_z", "tail-free sampling is not supported: it must be 1", is_one),
    ("top_a", "top-a sampling is not supported: it must be 0", is_zero),
    ("repetition_penalty", "repetition penalties are not supported: it must be 1", is_one),
    ("repeat_penalty", "repetition penalties are not supported: it must be 1", is_one),
    ("dry_multiplier", "DRY sampling is not supported: it must be 0", is_zero),
    ("xtc_probability", "XTC sampling is not supported: it must be 0", is_zero),
    ("mirostat", "mirostat sampling is not supported: it must be 0", is_zero),
    ("use_beam_search", "beam search is not supported", |v| v == false),
    ("grammar", "grammar-constrained output is not supported", |v| v == ""),
    ("json_schema", "structured output is not supported", empty_map),
    ("guided_json", "structured output is not supported", |_| false),
    ("guided_regex", "structured output is not supported", |_| false),
    ("guided_choice", "structured output is not supported", |_| false),
    ("guided_grammar", "structured output is not supported", |_| false),
];

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

fn is_one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}

fn empty_list(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
}

fn empty_map(v: &Value) -> bool {
    v.as_object().is_some_and(serde_json::Map::is_empty)
}

fn no_tool_call(v: &Value) -> bool {
    v == "none" || v == "auto"
}

fn text_format(v: &Value) -> bool {
    v.as_object().is_some_and(|format| format.len() == 1 && format.get("type").is_some_and(|t| t == "text"))
}

fn text_only(v: &Value) -> bool {
    v.as_array().is_some_and(|list| list.iter().all(|m| m == "text"))
}

/// A 400 for the first field of `body` the endpoint cannot honour (see
/// [`Unhonoured`]), and for a chat message carrying tool calls.
fn refuse_unhonoured(body: &Value, endpoint: Endpoint) -> Result<(), ApiError> {
    let own = match endpoint {
        Endpoint::Chat => &[][..],
        Endpoint::Completion => UNHONOURED_COMPLETION,
    };
    for &(field, why, asks_nothing) in UNHONOURED.iter().chain(own).chain(UNHONOURED_EXTENSIONS) {
        match body.get(field) {
            Some(value) if !value.is_null() && !asks_nothing(value) => {
                return Err(ApiError::invalid(field, format!("{field}: {why}")));
            }
            _ => {}
        }
    }
    let messages = body.get("messages").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    for (i, message) in messages.iter().enumerate() {
        if message.get("tool_calls").is_some_and(|calls| !calls.is_null() && !empty_list(calls)) {
            let param = format!("messages[{i}].tool_calls");
            return Err(ApiError::invalid(param.clone(), format!("{param}: tool calling is not supported")));
        }
    }
    Ok(())
}

fn top_logprobs(n: u64, param: &str) -> Result<usize, ApiError> {
    if n > MAX_TOP_LOGPROBS as u64 {
        return Err(ApiError::invalid(param, format!("{param} must be at most {MAX_TOP_LOGPROBS}, got {n}")));
    }
    Ok(n as usize)
}

/// A message's text (its text parts, one per line) and images.
fn message_content(
    message: &ChatMessage,
    i: usize,
    info: &ModelInfo,
) -> Result<(String, Vec<RgbImage>), ApiError> {
    let parts = match &message.content {
        // An assistant turn may have no text; a system or user one says something.
        None if matches!(message.role, Role::Assistant) => return Ok((String::new(), Vec::new())),
        None => {
            let param = format!("messages[{i}].content");
            let role = message.role.name();
            return Err(ApiError::invalid(param.clone(), format!("{param}: a {role} message needs content")));
        }
        Some(Content::Text(text)) => return Ok((text.clone(), Vec::new())),
        Some(Content::Parts(parts)) => parts,
    };
    let mut texts = Vec::new();
    let mut images = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        match part {
            Part::Text { text } => texts.push(text.as_str()),
            Part::ImageUrl { image_url } => {
                let param = format!("messages[{i}].content[{j}].image_url");
                if info.image_token().is_none() {
                    return Err(ApiError::invalid(
                        param,
                        "the model reads no images (it has no vision tower)",
                    ));
                }
                images.push(data_uri_image(&image_url.url, &param)?);
            }
        }
    }
    Ok((texts.join("\n"), images))
}

/// An image given as a `data:` URI (base64). The server fetches nothing.
fn data_uri_image(url: &str, param: &str) -> Result<RgbImage, ApiError> {
    let invalid = |why: String| ApiError::invalid(param, format!("{param}: {why}"));
    let rest = url
        .strip_prefix("data:")
        .ok_or_else(|| invalid("only data: URIs are read (base64 PNG or JPEG)".into()))?;
    let (meta, data) =
        rest.split_once(',').ok_or_else(|| invalid("a data: URI holds a comma before its data".into()))?;
    if !meta.ends_with(";base64") {
        return Err(invalid("the data: URI must be base64 (data:image/png;base64,...)".into()));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| invalid(format!("invalid base64: {e}")))?;
    RgbImage::decode(&bytes, param).map_err(|e| invalid(e.to_string()))
}

/// The job of a prompt, its sampling and limits checked.
fn job(
    endpoint: Endpoint,
    common: CommonFields,
    (prompt, images): (Vec<u32>, Vec<RgbImage>),
    logprobs: Option<usize>,
    info: &ModelInfo,
) -> Result<Job, ApiError> {
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("n", "only n = 1 is supported (one choice per request)"));
    }
    for (param, value) in
        [("presence_penalty", common.presence_penalty), ("frequency_penalty", common.frequency_penalty)]
    {
        if value.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid(param, format!("{param} is not supported: it must be 0")));
        }
    }
    let prompt_tokens = prompt_positions(&prompt, &images, info)?;
    let room = info.context_len.saturating_sub(prompt_tokens);
    if room == 0 {
        let param = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
        let context = info.context_len;
        return Err(ApiError::invalid(
            param,
            format!("the prompt's {prompt_tokens} tokens leave no room in the context of {context}"),
        ));
    }
    let (param, asked) = match (common.max_completion_tokens, common.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    let max_tokens = match asked {
        None => room,
        Some(0) => return Err(ApiError::invalid(param, format!("{param} must be at least 1"))),
        Some(n) if n > room as u64 => {
            let context = info.context_len;
            return Err(ApiError::invalid(
                param,
                format!(
                    "{param} {n} and the prompt's {prompt_tokens} tokens exceed the context of {context}"
                ),
            ));
        }
        Some(n) => n as usize,
    };
    let stop_strings = stop_strings(common.stop, info)?;
    // `ignore_eos` (llama-server's and vLLM's): the model's end-of-sequence
    // and end-of-turn ids do not end the reply; it runs to its limit.
    let stop_tokens = match (common.ignore_eos.unwrap_or(false), endpoint) {
        (true, _) => Vec::new(),
        (false, Endpoint::Chat) => info.chat_stop_tokens.clone(),
        (false, Endpoint::Completion) => info.stop_tokens.clone(),
    };
    Ok(Job {
        endpoint,
        prompt,
        images,
        prompt_tokens,
        sampling: sampling(common.temperature, common.top_p, common.top_k)?,
        seed: common.seed.map_or_else(random_seed, |s| s as u64),
        max_tokens,
        stop_tokens,
        stop_strings,
        logprobs,
        steering: steering(common.control_vectors, info)?,
        stream: common.stream.unwrap_or(false),
        include_usage: common.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: common.return_token_ids.unwrap_or(false),
    })
}

/// Positions the prompt takes: its ids, each image's one placeholder
/// counted as the image's merged rows.
fn prompt_positions(prompt: &[u32], images: &[RgbImage], info: &ModelInfo) -> Result<usize, ApiError> {
    let Some(processor) = &info.image_processor else { return Ok(prompt.len()) };
    let side = processor.patch_size * processor.merge_size;
    // Each image's placeholder stands once in the prompt (the engine checks).
    let mut positions = prompt.len().saturating_sub(images.len());
    for (i, image) in images.iter().enumerate() {
        let (h, w) = processor
            .resized_size(image.height, image.width)
            .map_err(|why| ApiError::invalid("messages", format!("image {i}: {why}")))?;
        positions += (h / side) * (w / side);
    }
    Ok(positions)
}

/// OpenAI's sampling fields: temperature 0 is greedy (top_p and top_k
/// then have nothing to cut); `top_k` 0 or below is no cut (as llama.cpp
/// and vLLM read it). Without a temperature, 1, as OpenAI's default.
/// Ranges are checked on the values as sent, before the sampler's f32: a
/// temperature too small for f32 is greedy, a top_p too small keeps the
/// likeliest token alone.
fn sampling(temperature: Option<f64>, top_p: Option<f64>, top_k: Option<i64>) -> Result<Sampling, ApiError> {
    let temperature = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be in [0, 2], got {temperature}"),
        ));
    }
    if let Some(p) = top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(ApiError::invalid("top_p", format!("top_p must be in (0, 1], got {p}")));
    }
    let temperature = temperature as f32;
    if temperature == 0.0 {
        return Ok(Sampling::Greedy);
    }
    let top_k = top_k.filter(|&k| k > 0).map(|k| k as usize);
    let top_p = top_p.map(|p| (p as f32).max(f32::MIN_POSITIVE));
    Ok(Sampling::Random { temperature, top_k, top_p })
}

/// A seed for a request that gives none: the clock's nanoseconds, mixed.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

fn stop_strings(stop: Option<Stop>, info: &ModelInfo) -> Result<Vec<String>, ApiError> {
    let strings = match stop {
        None => return Ok(Vec::new()),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(list)) => list,
    };
    if strings.len() > MAX_STOP_STRINGS {
        let n = strings.len();
        return Err(ApiError::invalid(
            "stop",
            format!("stop holds {n} strings, at most {MAX_STOP_STRINGS} are allowed"),
        ));
    }
    if strings.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "a stop string is empty"));
    }
    if !strings.is_empty() && info.tokenizer.is_none() {
        return Err(ApiError::invalid("stop", "stop strings need text: the model has no tokenizer"));
    }
    Ok(strings)
}

/// The steering of `control_vectors`, each named at the server's start.
fn steering(uses: Option<Vec<ControlVectorUse>>, info: &ModelInfo) -> Result<Option<Steering>, ApiError> {
    let uses = uses.unwrap_or_default();
    if uses.is_empty() {
        return Ok(None);
    }
    let mut vectors = Vec::with_capacity(uses.len());
    for (i, u) in uses.iter().enumerate() {
        let vector = info.control_vectors.get(&u.name).ok_or_else(|| {
            let known: Vec<&str> = info.control_vectors.keys().map(String::as_str).collect();
            ApiError::invalid(
                format!("control_vectors[{i}].name"),
                format!("unknown control vector {:?} (the server has: {})", u.name, known.join(", ")),
            )
        })?;
        if !u.scale.is_finite() {
            return Err(ApiError::invalid(format!("control_vectors[{i}].scale"), "the scale must be finite"));
        }
        vectors.push((vector, u.scale));
    }
    info.steering(&vectors).map(Some).map_err(|e| ApiError::invalid("control_vectors", e.to_string()))
}
