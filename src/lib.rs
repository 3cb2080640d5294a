//! wgspark: decoder-only LLM inference whose whole layer flow runs as WGSL
//! compute shaders through wgpu (Vulkan, Metal, DX12, GL).
//!
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

pub mod capture;
pub mod error;
#[cfg(feature = "fetch")]
pub mod fetch;
pub mod flow;
pub mod gguf;
pub mod gpu;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod sampling;
pub mod session;
pub mod stats;
pub mod steering;

pub use capture::{Capture, CaptureOptions, PromptRows};
pub use error::{ControlVectorProblem, Error, Result};
pub use flow::{ChunkMatmul, RoutingMode};
pub use gpu::{Backend, Gpu, GpuOptions};
pub use kv_cache::KvFormat;
pub use model::{Model, ModelConfig};
pub use sampling::{Sampler, Sampling};
pub use session::{GenerateOptions, Generation, Session, SessionOptions, StopReason};
pub use stats::Stats;
pub use steering::{ControlVector, Steering};

impl Model {
    /// Opens a decoding session with its own KV cache.
    pub fn session(&self, options: &SessionOptions) -> Result<Session<'_>> {
        Session::new(self, options)
    }
}
