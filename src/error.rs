//! Every user-facing failure is one variant of [`Error`]: callers match on
//! the kind of problem, and the message names the file, tensor or value.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no GPU adapter found (backends tried: {tried})")]
    NoAdapter { tried: String },

    #[error("unknown backend {0:?} (expected vulkan, metal, dx12 or gl)")]
    UnknownBackend(String),

    #[error("could not open a device on adapter {adapter:?}: {message}")]
    RequestDevice { adapter: String, message: String },

    #[error("GPU error: {0}")]
    Gpu(String),

    /// A batch engine's options that cannot work, or a request no pool of
    /// its size can run.
    #[error("batch engine: {0}")]
    InvalidBatch(String),

    /// The device is gone (a driver reset, a removed GPU, or
    /// `wgpu::Device::destroy`): nothing on it can run again. Open a new
    /// [`crate::Gpu`] and load the model on it.
    #[error("the GPU device was lost ({reason}): open a new device and load the model again")]
    DeviceLost { reason: String },

    /// `needed_bytes` where known: a budget or limit checked before
    /// allocating; `None` where the driver refused an allocation.
    #[error(
        "out of device memory ({what}{}): {message}",
        .needed_bytes.map(|b| format!(" needs {b} bytes")).unwrap_or_default()
    )]
    OutOfDeviceMemory { what: String, needed_bytes: Option<u64>, message: String },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: malformed JSON: {message}")]
    Json { path: PathBuf, message: String },

    #[error("{path}: invalid config: {message}")]
    InvalidConfig { path: PathBuf, message: String },

    #[error("unsupported architecture {model_type:?} (supported: {supported})")]
    UnsupportedArchitecture { model_type: String, supported: String },

    #[error("unsupported {what}: {value}")]
    Unsupported { what: &'static str, value: String },

    #[error("{path}: malformed safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },

    #[error("{path}: malformed GGUF file: {message}")]
    Gguf { path: PathBuf, message: String },

    #[error("{source_file}: tokenizer: {message}")]
    Tokenizer { source_file: PathBuf, message: String },

    #[error("{origin}: chat template: {message}")]
    ChatTemplate { origin: String, message: String },

    /// An image that cannot be read or resized: unreadable, not PNG or
    /// JPEG, too large, or of an aspect ratio the processor refuses.
    #[error("{origin}: image: {message}")]
    Image { origin: String, message: String },

    /// A prompt of ids whose image placeholders are not one per image.
    #[error(
        "the prompt holds {placeholders} image placeholder tokens ({token}) for {images} images: one stands for each"
    )]
    ImageCount { token: u32, placeholders: usize, images: usize },

    #[error("missing tensor {name:?}")]
    MissingTensor { name: String },

    #[error("tensor {name:?} has dtype {found}, expected {expected}")]
    WrongDtype { name: String, expected: String, found: String },

    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    WrongShape { name: String, expected: Vec<usize>, found: Vec<usize> },

    #[error("token id {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },

    #[error("position {got} is not the next position of the session ({expected})")]
    NonSequentialPosition { expected: usize, got: usize },

    #[error("context overflow: position {position} does not fit a context of {context_len}")]
    ContextOverflow { position: usize, context_len: usize },

    #[error(
        "layer {layer}: the router's scores are not numbers (NaN or infinite activations: check the \
         weights, rms_norm_eps, the rope factors and any control vectors)"
    )]
    NonFiniteRouting { layer: usize },
    #[error(
        "position {position}: logit {token} is {value} (NaN or infinite activations: check the weights, \
         rms_norm_eps, the rope factors and any control vectors)"
    )]
    NonFiniteLogits { position: usize, token: usize, value: f32 },
    #[error(
        "position {position}: the logits the token was sampled from hold NaN or infinite values (NaN or \
         infinite activations: check the weights, rms_norm_eps, the rope factors and any control vectors)"
    )]
    NonFiniteSample { position: usize },
    #[error("a context of {context_len} positions: {reason}")]
    InvalidContext { context_len: usize, reason: String },
    #[error(
        "a prefill chunk of 0 tokens: a chunk needs at least one (SessionOptions::prefill_chunk, --prefill-chunk)"
    )]
    InvalidPrefillChunk,
    #[error("empty prompt: prefill needs at least one token")]
    EmptyPrompt,

    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),

    #[error("{path}: invalid control vector: {problem}")]
    ControlVector { path: PathBuf, problem: ControlVectorProblem },

    #[error("invalid control vector layer range {start}..={end}: {reason}")]
    InvalidLayerRange { start: usize, end: usize, reason: String },

    #[error(
        "steering made for {steering_layers} layers of width {steering_hidden} does not fit this model \
         ({layers} layers of width {hidden})"
    )]
    SteeringMismatch { steering_layers: usize, steering_hidden: usize, layers: usize, hidden: usize },

    #[error("capture of layer {layer}: the model has layers 0..{layers}")]
    CaptureLayerOutOfRange { layer: usize, layers: usize },

    #[error("could not fetch {what}: {message}")]
    Fetch { what: String, message: String },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// Most bytes of a JSON side file (config.json, a shard index,
/// tokenizer_config.json) the engine reads: the largest real ones are a few
/// hundred kilobytes.
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// The text of `path`, a regular file of at most `limit` bytes (checked
/// before it is read).
pub(crate) fn read_text(path: &std::path::Path, limit: u64) -> Result<String> {
    check_regular_file(path)?;
    let size = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    if size > limit {
        let why = format!("{size} bytes, more than the {limit} such a file may have");
        return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, why)));
    }
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// A JSON side file (at most [`MAX_JSON_BYTES`]) parsed as `T`; malformed
/// JSON, or JSON of another shape, is an error naming the file.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = read_text(path, MAX_JSON_BYTES)?;
    serde_json::from_str(&text).map_err(|e| Error::Json { path: path.to_path_buf(), message: e.to_string() })
}

/// Fails unless `path` is a regular file (links followed), checked before
/// it is opened: a FIFO would block the open, a device (`/dev/zero`) never
/// ends, and a directory fails with a message that does not say so.
pub(crate) fn check_regular_file(path: &std::path::Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_file() {
        return Ok(());
    }
    let kind = if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
    Err(Error::io(
        path,
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{kind}, not a model file")),
    ))
}

/// What is wrong with a control vector file, or with its fit to a model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ControlVectorProblem {
    #[error("general.architecture is {found:?}, expected \"controlvector\"")]
    WrongArchitecture { found: String },

    #[error("controlvector.layer_count is missing or not an integer")]
    MissingLayerCount,

    #[error("controlvector.layer_count is {declared}, but the file holds {found} direction tensors")]
    LayerCountMismatch { declared: i64, found: usize },

    #[error("the file holds no direction tensors")]
    NoDirections,

    #[error("tensor {name:?} is not named direction.N")]
    UnexpectedTensor { name: String },

    #[error("direction.0: layer 0 is never steered (directions count from layer 1)")]
    LayerZero,

    #[error("direction.{layer} is for layer {layer}, but the model has layers 0..{layers}")]
    LayerOutOfRange { layer: usize, layers: usize },

    #[error("direction.{layer} is {found}, expected F32")]
    NotF32 { layer: usize, found: String },

    #[error("direction.{layer} has dims {dims:?}, expected one dimension")]
    NotOneDimensional { layer: usize, dims: Vec<usize> },

    #[error("direction.{layer} has {found} values, but the file's other directions have {expected}")]
    InconsistentLength { layer: usize, found: usize, expected: usize },

    #[error("direction.{layer} has {found} values, but the model's hidden size is {expected}")]
    WrongLength { layer: usize, found: usize, expected: usize },

    #[error("direction.{layer} holds a value that is not finite")]
    NotFinite { layer: usize },
}

thread_local! {
    /// Set while [`catch_panic_quietly`] runs on this thread.
    static QUIET_PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, a panic inside it returned as `Err` and not printed: a library
/// the engine calls (the tokenizers library's regular expressions, say) may
/// panic on hostile input, which the caller turns into an error of its own,
/// so the user sees that error alone rather than a panic message and a
/// backtrace first. Panics on other threads, or outside `f`, print as ever:
/// the hook installed once only keeps quiet while this thread is inside `f`.
pub(crate) fn catch_panic_quietly<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET_PANICS.with(|quiet| quiet.get()) {
                previous(info);
            }
        }));
    });
    let was = QUIET_PANICS.with(|quiet| quiet.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET_PANICS.with(|quiet| quiet.set(was));
    result
}
