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

    #[error("the model does not fit on the device ({what} needs {needed_bytes} bytes): {message}")]
    OutOfDeviceMemory { what: String, needed_bytes: u64, message: String },

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

    #[error("empty prompt: prefill needs at least one token")]
    EmptyPrompt,

    #[error("invalid sampling parameter: {0}")]
    InvalidSampling(String),

    #[error("could not fetch {what}: {message}")]
    Fetch { what: String, message: String },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
