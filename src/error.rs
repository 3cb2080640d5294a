//! Every user-facing failure is one variant of [`Error`]: callers match on
//! the kind of problem, and the message names the file, tensor or value.

use std::path::PathBuf;

/// The crate's result type: [`Error`] unless another error type is given.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why an operation of the engine failed: one variant per kind of
/// problem, whose fields hold the facts its message states.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No adapter of the backends tried can run compute shaders.
    #[error("no GPU adapter found (backends tried: {tried})")]
    NoAdapter {
        /// The wgpu backends searched, comma-separated (with
        /// [`crate::Backend::Auto`]: the native ones, then GL).
        tried: String,
    },

    /// [`crate::GpuOptions::adapter`] (`--adapter`) numbers no adapter of
    /// the backend: [`crate::Gpu::adapters`] lists them.
    #[error("no adapter {index}: there are {} ({})", adapters.len(), adapters.join(", "))]
    AdapterOutOfRange {
        /// The index asked for.
        index: usize,
        /// The adapters there are, in their numbering: "name (backend)".
        adapters: Vec<String>,
    },

    /// `WGSPARK_ADAPTER` is not an adapter number.
    #[error("WGSPARK_ADAPTER={given:?} is not an adapter number (generate --list-adapters lists them)")]
    InvalidAdapterIndex {
        /// The value given.
        given: String,
    },

    /// A backend name (`WGSPARK_BACKEND`, or a string parsed as
    /// [`crate::Backend`]) that is none of auto, vulkan, metal, dx12 or gl.
    #[error("unknown backend {0:?} (expected vulkan, metal, dx12 or gl)")]
    UnknownBackend(String),

    /// The chosen adapter refused to open a device with the features and
    /// limits the engine asks for.
    #[error("could not open a device on adapter {adapter:?}: {message}")]
    RequestDevice {
        /// The adapter's name.
        adapter: String,
        /// wgpu's error, with a hint where a GL context lacks compute
        /// shaders.
        message: String,
    },

    /// A validation error wgpu reported, a kernel that failed to compile,
    /// or a failed buffer map: a fault of the engine or the driver rather
    /// than of the input.
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
    DeviceLost {
        /// wgpu's reason and the driver's message.
        reason: String,
    },

    /// Device memory ran out, or would have: a budget or limit checked
    /// before allocating, or an allocation the driver refused.
    #[error(
        "out of device memory ({what}{}): {message}",
        .needed_bytes.map(|b| format!(" needs {b} bytes")).unwrap_or_default()
    )]
    OutOfDeviceMemory {
        /// What was being allocated (a buffer's label, "model weights", ...).
        what: String,
        /// The bytes asked for, where a budget or limit was checked before
        /// allocating; `None` where the driver refused an allocation.
        needed_bytes: Option<u64>,
        /// Which limit was met: the memory budget
        /// ([`crate::GpuOptions::memory_budget`], [`crate::LoadOptions::gpu_memory`]),
        /// the device's memory, the largest buffer, or the driver's refusal.
        message: String,
    },

    /// A file that cannot be read or written, or that is not a regular file
    /// (a folder, a FIFO, a device) or is larger than such a file may be.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error, or the engine's reason.
        #[source]
        source: std::io::Error,
    },

    /// A JSON side file (config.json, tokenizer_config.json,
    /// generation_config.json, a shard index, ...) that is not valid JSON,
    /// or whose content is not of the shape the engine reads.
    #[error("{path}: malformed JSON: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error or what is wrong with the content.
        message: String,
    },

    /// A config file (config.json, generation_config.json,
    /// preprocessor_config.json) that is valid JSON but misses a field, or
    /// gives a value of the wrong type or one no model can have.
    #[error("{path}: invalid config: {message}")]
    InvalidConfig {
        /// The file.
        path: PathBuf,
        /// The field and what is wrong with it.
        message: String,
    },

    /// A model of no family the engine implements.
    #[error("unsupported architecture {model_type:?} (supported: {supported})")]
    UnsupportedArchitecture {
        /// config.json's `model_type` (or first `architectures` class), or a
        /// GGUF file's `general.architecture` followed by "(GGUF)".
        model_type: String,
        /// The names the engine reads, comma-separated.
        supported: String,
    },

    /// A valid input the engine does not implement: a quantization, a
    /// tensor type, an attention geometry, an option on this adapter ...
    #[error("unsupported {what}: {value}")]
    Unsupported {
        /// The kind of thing refused ("hidden_act", "expert count", ...).
        what: &'static str,
        /// The value found, often with what is supported.
        value: String,
    },

    /// A safetensors file whose header cannot be parsed, or whose tensors
    /// do not lie inside it.
    #[error("{path}: malformed safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    /// A GGUF file that is truncated or malformed, of an unsupported
    /// version or tensor type, or missing a metadata key the engine needs.
    #[error("{path}: malformed GGUF file: {message}")]
    Gguf {
        /// The file (the first of a split set names the part at fault).
        path: PathBuf,
        /// What is wrong, with the byte offset where parsing stopped.
        message: String,
    },

    /// A tokenizer that cannot be built from its file, or that failed to
    /// encode or decode.
    #[error("{source_file}: tokenizer: {message}")]
    Tokenizer {
        /// tokenizer.json, or the GGUF file whose metadata describes it.
        source_file: PathBuf,
        /// The tokenizers library's error, or what the file lacks.
        message: String,
    },

    /// A chat template that does not compile, raised an exception
    /// (`raise_exception`), or ran out of its instruction budget
    /// (a fixed number of steps).
    #[error("{origin}: chat template: {message}")]
    ChatTemplate {
        /// The file the template came from.
        origin: String,
        /// minijinja's error, with its chain of causes.
        message: String,
    },

    /// An image that cannot be read or resized: unreadable, not PNG or
    /// JPEG, too large, or of an aspect ratio the processor refuses.
    #[error("{origin}: image: {message}")]
    Image {
        /// The image's file, or a name for an image held in memory.
        origin: String,
        /// What is wrong with it.
        message: String,
    },

    /// A prompt of ids whose image placeholders are not one per image.
    #[error(
        "the prompt holds {placeholders} image placeholder tokens ({token}) for {images} images: one stands for each"
    )]
    ImageCount {
        /// The image placeholder id (config.json's `image_token_id`).
        token: u32,
        /// How often it occurs in the prompt.
        placeholders: usize,
        /// Images given.
        images: usize,
    },

    /// A tensor the model's config implies that the checkpoint lacks.
    #[error("missing tensor {name:?}")]
    MissingTensor {
        /// The tensor's name (Hugging Face naming).
        name: String,
    },

    /// A tensor stored in a data type the engine does not read there.
    #[error("tensor {name:?} has dtype {found}, expected {expected}")]
    WrongDtype {
        /// The tensor's name.
        name: String,
        /// The types read for it.
        expected: String,
        /// The type the file gives.
        found: String,
    },

    /// A tensor whose shape is not the one the model's config implies.
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    WrongShape {
        /// The tensor's name.
        name: String,
        /// The shape the config implies, row-major.
        expected: Vec<usize>,
        /// The shape the file gives, row-major.
        found: Vec<usize>,
    },

    /// A token id at or past the vocabulary's size.
    #[error("token id {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        token: u32,
        /// Rows of the model's embedding (config.json's `vocab_size`).
        vocab: usize,
    },

    /// A [`crate::Session::step`] at a position other than the session's
    /// next one.
    #[error("position {got} is not the next position of the session ({expected})")]
    NonSequentialPosition {
        /// The session's next position ([`crate::Session::position`]).
        expected: usize,
        /// The position given.
        got: usize,
    },

    /// A token that would not fit the session's KV cache.
    #[error("context overflow: position {position} does not fit a context of {context_len}")]
    ContextOverflow {
        /// The position that does not fit (for a prompt: its last).
        position: usize,
        /// Positions the cache holds.
        context_len: usize,
    },

    /// A MoE layer's router scores held NaN or infinite values, so no
    /// expert can be chosen.
    #[error(
        "layer {layer}: the router's scores are not numbers (NaN or infinite activations: check the \
         weights, rms_norm_eps, the rope factors and any control vectors)"
    )]
    NonFiniteRouting {
        /// The MoE layer, counted from 0.
        layer: usize,
    },
    /// The logits read back hold a NaN or infinite value.
    #[error(
        "position {position}: logit {token} is {value} (NaN or infinite activations: check the weights, \
         rms_norm_eps, the rope factors and any control vectors)"
    )]
    NonFiniteLogits {
        /// The position whose logits they are.
        position: usize,
        /// The first token whose logit is not finite.
        token: usize,
        /// Its logit.
        value: f32,
    },
    /// The logits a token was sampled from on the GPU held NaN or infinite
    /// values ([`crate::Session::generate`]).
    #[error(
        "position {position}: the logits the token was sampled from hold NaN or infinite values (NaN or \
         infinite activations: check the weights, rms_norm_eps, the rope factors and any control vectors)"
    )]
    NonFiniteSample {
        /// The position whose logits they were (the last token fed).
        position: usize,
    },
    /// A context length a session cannot have.
    #[error("a context of {context_len} positions: {reason}")]
    InvalidContext {
        /// The length asked for.
        context_len: usize,
        /// Why it cannot be used.
        reason: String,
    },
    /// [`crate::SessionOptions::prefill_chunk`] of 0.
    #[error(
        "a prefill chunk of 0 tokens: a chunk needs at least one (SessionOptions::prefill_chunk, --prefill-chunk)"
    )]
    InvalidPrefillChunk,
    /// A split of a model's layers across devices that cannot be made:
    /// shares that are not positive numbers, or not one per device, or
    /// more devices than layers (see [`crate::model::split`]).
    #[error("layer split {split}: {reason}")]
    InvalidSplit {
        /// The shares as given, or how the split was to be made.
        split: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A prompt of no tokens, given to prefill or generate.
    #[error("empty prompt: prefill needs at least one token")]
    EmptyPrompt,

    /// A temperature, top-k, top-p or token count that cannot be used
    /// (see [`crate::Sampling::validate`]).
    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),

    /// A control vector file that is not one, or that does not fit the
    /// model it is applied to.
    #[error("{path}: invalid control vector: {problem}")]
    ControlVector {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: ControlVectorProblem,
    },

    /// A steering layer range whose start is after its end, or past the
    /// model's last layer.
    #[error("invalid control vector layer range {start}..={end}: {reason}")]
    InvalidLayerRange {
        /// The range's first layer.
        start: usize,
        /// The range's last layer (inclusive).
        end: usize,
        /// Why it cannot be used.
        reason: String,
    },

    /// A [`crate::Steering`] built for another model's shape, set on a
    /// session.
    #[error(
        "steering made for {steering_layers} layers of width {steering_hidden} does not fit this model \
         ({layers} layers of width {hidden})"
    )]
    SteeringMismatch {
        /// Layers the steering was built for.
        steering_layers: usize,
        /// Hidden size the steering was built for.
        steering_hidden: usize,
        /// The model's layers.
        layers: usize,
        /// The model's hidden size.
        hidden: usize,
    },

    /// A layer to capture that the model does not have.
    #[error("capture of layer {layer}: the model has layers 0..{layers}")]
    CaptureLayerOutOfRange {
        /// The layer asked for.
        layer: usize,
        /// The model's layers.
        layers: usize,
    },

    /// Downloading, verifying or extracting the default model failed.
    #[error("could not fetch {what}: {message}")]
    Fetch {
        /// The URL or file at fault.
        what: String,
        /// What went wrong.
        message: String,
    },
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
    /// The file is not a control vector: its `general.architecture` is not
    /// "controlvector".
    WrongArchitecture {
        /// The value the file gives, or "(missing)".
        found: String,
    },

    #[error("controlvector.layer_count is missing or not an integer")]
    /// `controlvector.layer_count` is absent or not an integer.
    MissingLayerCount,

    #[error("controlvector.layer_count is {declared}, but the file holds {found} direction tensors")]
    /// `controlvector.layer_count` differs from the number of directions.
    LayerCountMismatch {
        /// `controlvector.layer_count`.
        declared: i64,
        /// Direction tensors in the file.
        found: usize,
    },

    #[error("the file holds no direction tensors")]
    /// The file holds no tensor.
    NoDirections,

    #[error("tensor {name:?} is not named direction.N")]
    /// A tensor not named `direction.N` (N a layer number).
    UnexpectedTensor {
        /// The tensor's name.
        name: String,
    },

    #[error("direction.0: layer 0 is never steered (directions count from layer 1)")]
    /// A `direction.0` tensor: llama.cpp's layout never steers layer 0.
    LayerZero,

    #[error("direction.{layer} is for layer {layer}, but the model has layers 0..{layers}")]
    /// A direction for a layer the model does not have.
    LayerOutOfRange {
        /// The direction's layer.
        layer: usize,
        /// The model's layers.
        layers: usize,
    },

    #[error("direction.{layer} is {found}, expected F32")]
    /// A direction stored in another type than F32.
    NotF32 {
        /// The direction's layer.
        layer: usize,
        /// Its ggml type.
        found: String,
    },

    #[error("direction.{layer} has dims {dims:?}, expected one dimension")]
    /// A direction of more (or fewer) than one dimension.
    NotOneDimensional {
        /// The direction's layer.
        layer: usize,
        /// Its dimensions, in ggml order.
        dims: Vec<usize>,
    },

    #[error("direction.{layer} has {found} values, but the file's other directions have {expected}")]
    /// Directions of different lengths in one file.
    InconsistentLength {
        /// The direction's layer.
        layer: usize,
        /// Its length.
        found: usize,
        /// The length of the file's first direction.
        expected: usize,
    },

    #[error("direction.{layer} has {found} values, but the model's hidden size is {expected}")]
    /// Directions whose length is not the model's hidden size.
    WrongLength {
        /// The direction's layer.
        layer: usize,
        /// Its length.
        found: usize,
        /// The model's hidden size.
        expected: usize,
    },

    #[error("direction.{layer} holds a value that is not finite")]
    /// A direction holding NaN or an infinity.
    NotFinite {
        /// The direction's layer.
        layer: usize,
    },
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
