//! wgspark: decoder-only LLM inference whose whole layer flow runs as WGSL
//! compute shaders through wgpu (Vulkan, Metal, DX12, GL).
//!
//! Generating, with the next token chosen on the GPU and steps in flight:
//! ```no_run
//! use wgspark::{GenerateOptions, Gpu, Model, Sampling, SessionOptions};
//!
//! let gpu = Gpu::from_env()?;
//! let model = Model::load("path/to/hf-checkpoint", &gpu)?;
//! let mut session = model.session(&SessionOptions::default())?;
//! let options = GenerateOptions {
//!     sampling: Sampling::Random { temperature: 0.7, top_k: Some(40), top_p: Some(0.9) },
//!     seed: 42,
//!     max_tokens: 64,
//!     stop_tokens: model.config.eos_token_ids.clone(),
//!     ..GenerateOptions::default()
//! };
//! let mut generation = session.generate(&[1, 2, 3], &options)?;
//! while let Some(id) = generation.next() {
//!     if id? == 13 {
//!         generation.cancel(); // or drop the iterator
//!     }
//! }
//! println!("{:?}", generation.stop_reason());
//! # Ok::<(), wgspark::Error>(())
//! ```
//!
//! Stepping, with the raw logits of each step read back:
//! ```no_run
//! use wgspark::{Gpu, Model, Sampler, SessionOptions};
//!
//! let gpu = Gpu::from_env()?;
//! let model = Model::load("path/to/hf-checkpoint", &gpu)?;
//! let mut session = model.session(&SessionOptions::default())?;
//! let mut logits = session.prefill(&[1, 2, 3])?;
//! let mut sampler = Sampler::greedy();
//! for _ in 0..8 {
//!     let next = sampler.sample(&logits);
//!     logits = session.step(next, session.position())?;
//! }
//! # Ok::<(), wgspark::Error>(())
//! ```

#![warn(missing_docs)]

// The engine's machinery: public with the `internals` feature (this
// crate's own tests and benchmarks turn it on; it is no stable API), private
// to the crate otherwise.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod flow;
#[cfg(not(feature = "internals"))]
mod flow;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod format;
#[cfg(not(feature = "internals"))]
mod format;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod gpu;
#[cfg(not(feature = "internals"))]
mod gpu;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod kernels;
#[cfg(not(feature = "internals"))]
mod kernels;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod kv_cache;
#[cfg(not(feature = "internals"))]
mod kv_cache;

pub mod batch;
pub mod capture;
pub mod chat;
pub mod error;
#[cfg(feature = "fetch")]
pub mod fetch;
pub mod gguf;
pub mod model;
pub mod multimodal;
pub mod progress;
pub mod sampling;
#[cfg(feature = "server")]
pub mod server;
pub mod session;
pub mod stats;
pub mod steering;
pub mod tokenizer;
pub mod vision;

pub use capture::{Capture, CaptureOptions, PromptRows};
pub use chat::{ChatTemplate, Message};
pub use error::{ControlVectorProblem, Error, Result};
pub use flow::{ChunkMatmul, ExpertPrefetch, RoutingMode};
pub use format::WeightFormat;
pub use gpu::{
    AdapterSummary, Backend, Caps, CooperativeMatrix, Gpu, GpuOptions, set_runtime_dir_if_missing,
};
pub use kernels::gemm::PrefillPrecision;
pub use kv_cache::KvFormat;
pub use model::{LoadOptions, Model, ModelConfig};
pub use multimodal::PromptPart;
pub use progress::Progress;
pub use sampling::{Sampler, Sampling};
pub use session::{GenerateOptions, Generation, Session, SessionOptions, StopReason};
pub use stats::{ExpertCacheStats, Stats};
pub use steering::{ControlVector, Steering};
pub use tokenizer::{TextStream, Tokenizer};
pub use vision::RgbImage;

/// README's code blocks, compiled and run as doc tests so that they cannot
/// drift from the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

impl Model {
    /// Opens a decoding session with its own KV cache (see [`Session::new`]).
    ///
    /// ```no_run
    /// use wgspark::{Gpu, KvFormat, Model, SessionOptions};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = Gpu::from_env()?;
    /// let model = Model::load("path/to/model", &gpu)?;
    /// // 4096 positions of f32 K and V; the rest as default.
    /// let options =
    ///     SessionOptions { context_len: Some(4096), kv_format: KvFormat::F32, ..SessionOptions::default() };
    /// let session = model.session(&options)?;
    /// assert_eq!(session.context_len(), 4096);
    /// # Ok(()) }
    /// ```
    pub fn session(&self, options: &SessionOptions) -> Result<Session<'_>> {
        Session::new(self, options)
    }
}
