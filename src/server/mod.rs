//! An OpenAI-compatible HTTP server over the [batch engine](crate::batch)
//! (feature `server`): chat and text completions, streamed as server-sent
//! events or whole, token counting, Prometheus metrics.
//!
//! The server is a thin layer: HTTP (axum on tokio), JSON and the OpenAI
//! schema live here; scheduling lives in [`crate::batch::BatchEngine`]. The
//! engine and its model live on a thread of their own (the GPU thread);
//! request handlers send it requests over a channel and receive tokens over
//! a channel of their own, and never wait on the GPU. A handler that goes
//! away (the client disconnected, or a stop string matched) drops its
//! receiver, and the GPU thread cancels the sequence before its next step.
//!
//! ```no_run
//! use wgspark::server::{Server, ServerOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = wgspark::Gpu::from_env()?;
//! let options = ServerOptions::new("SmolLM2-135M-Instruct.Q4_1.gguf");
//! let server = Server::start(&gpu, options, |_| {})?;
//! println!("listening on http://{}", server.local_addr());
//! server.wait_until_loaded()?; // /health answers 503 until then
//! server.join();
//! # Ok(()) }
//! ```
//!
//! See docs/server.md for the endpoints, fields and metrics.

mod engine_thread;
mod http;
mod metrics;
mod openai;
mod reply;

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::kv_cache::KvFormat;
use crate::progress::Progress;
use crate::{Gpu, LoadOptions};

use engine_thread::ModelInfo;
use metrics::Metrics;

/// How a [`Server`] is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOptions {
    /// The model to serve: a Hugging Face folder or a GGUF file.
    pub model: PathBuf,
    /// The name `/v1/models` lists and responses carry (default: the
    /// model's file or folder name).
    pub model_name: Option<String>,
    /// Where to listen (`127.0.0.1:8080`; port 0 picks a free port).
    pub listen: SocketAddr,
    /// Most sequences generating at once.
    pub parallel: usize,
    /// Most requests waiting beyond `parallel`; past them a request is
    /// refused with 503 and `Retry-After`.
    pub queue: usize,
    /// Bytes of the KV block pool (`None`: room for `parallel` sequences
    /// of the context, up to 2048 positions each).
    pub kv_memory: Option<u64>,
    /// Most positions of one sequence (`None`: the model's, at most
    /// [`crate::session::DEFAULT_CONTEXT_CAP`]).
    pub context_len: Option<usize>,
    /// Most rows of one step, decode rows and prompt chunks together
    /// ([`DEFAULT_STEP_TOKENS`]). Fewer bound the pause a new prompt puts
    /// in the running streams; more prefill faster.
    pub step_tokens: usize,
    /// How the KV pool stores keys and values.
    pub kv_format: KvFormat,
    /// Every endpoint but `/health` wants `Authorization: Bearer` this key.
    pub api_key: Option<String>,
    /// Largest request body, in bytes.
    pub max_body: usize,
    /// Control vectors requests may name (`control_vectors` field): name
    /// and llama.cpp GGUF control-vector file.
    pub control_vectors: Vec<(String, PathBuf)>,
    /// The layers control vectors steer (`None`: every layer they have).
    pub control_vector_layers: Option<RangeInclusive<usize>>,
    /// Print a line per request to stderr.
    pub log_requests: bool,
    /// How the weights are placed: a MoE model larger than the GPU (each
    /// GPU of a split) streams its experts from host memory.
    pub load: LoadOptions,
}

/// Default for [`ServerOptions::step_tokens`]: half the batch engine's, so
/// that a step that takes in a prompt chunk beside 64 streams stays under
/// 100 ms on a datacenter GPU with an 8B model (docs/performance.md).
pub const DEFAULT_STEP_TOKENS: usize = 256;

/// Default for [`ServerOptions::max_body`]: room for a few large images.
pub const DEFAULT_MAX_BODY: usize = 32 << 20;

impl ServerOptions {
    /// Options serving `model` on 127.0.0.1:8080, 8 sequences at once and
    /// 64 more queued.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        ServerOptions {
            model: model.into(),
            model_name: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            parallel: 8,
            queue: 64,
            kv_memory: None,
            context_len: None,
            step_tokens: DEFAULT_STEP_TOKENS,
            kv_format: KvFormat::F16,
            api_key: None,
            max_body: DEFAULT_MAX_BODY,
            control_vectors: Vec::new(),
            control_vector_layers: None,
            log_requests: true,
            load: LoadOptions::default(),
        }
    }
}

/// Why a server did not start or load its model.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be listened on.
    #[error("listening on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A thread or the async runtime could not be started.
    #[error("starting the server: {0}")]
    Start(#[source] std::io::Error),
    /// Options no server can run with.
    #[error("invalid server options: {0}")]
    InvalidOptions(String),
    /// The model, its tokenizer, a control vector or the batch engine
    /// failed to load.
    #[error("loading the model: {0}")]
    Load(#[source] Arc<crate::Error>),
}

/// Where loading the model stands.
enum LoadState {
    Loading,
    Ready(Arc<ModelInfo>),
    Failed(Arc<crate::Error>),
}

/// What the HTTP side and the GPU thread share: the load state (with a
/// condition variable to wait for it) and the metrics.
struct Shared {
    state: Mutex<LoadState>,
    loaded: Condvar,
    metrics: Metrics,
}

impl Shared {
    fn set_state(&self, state: LoadState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
        self.loaded.notify_all();
    }
}

/// A running server: it listens from [`Server::start`] on and loads its
/// model on the GPU thread meanwhile. Dropping it stops it.
pub struct Server {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    http_thread: Option<JoinHandle<()>>,
    gpu_thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Listens on `options.listen` and starts loading the model on `gpu`
    /// (its upload reported to `progress`); requests are served from the
    /// moment this returns (`/health` says 503 until the model is loaded).
    pub fn start(
        gpu: &Gpu,
        options: ServerOptions,
        progress: impl FnMut(Progress<'_>) + Send + 'static,
    ) -> Result<Server, ServerError> {
        Self::start_split(std::slice::from_ref(gpu), None, options, progress)
    }

    /// [`Self::start`] with the model's layers split across `gpus`
    /// ([`crate::Model::load_split`]: in proportion to their memory, or to
    /// `shares`, one per device).
    pub fn start_split(
        gpus: &[Gpu],
        shares: Option<&[f64]>,
        options: ServerOptions,
        progress: impl FnMut(Progress<'_>) + Send + 'static,
    ) -> Result<Server, ServerError> {
        if gpus.is_empty() {
            return Err(ServerError::InvalidOptions("a server needs at least one device".into()));
        }
        if options.parallel == 0 {
            return Err(ServerError::InvalidOptions("parallel must be at least 1".into()));
        }
        let listener = std::net::TcpListener::bind(options.listen)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| ServerError::Bind { addr: options.listen, source })?;
        let local_addr = listener.local_addr().map_err(ServerError::Start)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(LoadState::Loading),
            loaded: Condvar::new(),
            metrics: Metrics::default(),
        });
        let (submissions, submitted) = std::sync::mpsc::channel();
        let devices = (gpus.to_vec(), shares.map(<[f64]>::to_vec));
        let gpu_thread = engine_thread::spawn(devices, options.clone(), shared.clone(), submitted, progress)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("wgspark-http")
            .enable_all()
            .build()
            .map_err(ServerError::Start)?;
        let app = http::router(http::App::new(&options, shared.clone(), submissions));
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let http_thread = std::thread::Builder::new()
            .name("wgspark-http".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(e) => return eprintln!("server: {e}"),
                    };
                    let serve = axum::serve(listener, app).with_graceful_shutdown(async {
                        let _ = stopped.await;
                    });
                    if let Err(e) = serve.await {
                        eprintln!("server: {e}");
                    }
                });
            })
            .map_err(ServerError::Start)?;
        Ok(Server {
            local_addr,
            shared,
            shutdown: Some(shutdown),
            http_thread: Some(http_thread),
            gpu_thread: Some(gpu_thread),
        })
    }

    /// The address the server listens on (with port 0 asked, the port
    /// given).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the model is loaded and the engine made, or their
    /// loading failed.
    pub fn wait_until_loaded(&self) -> Result<(), ServerError> {
        let state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = self
            .shared
            .loaded
            .wait_while(state, |s| matches!(s, LoadState::Loading))
            .unwrap_or_else(|e| e.into_inner());
        match &*state {
            LoadState::Failed(e) => Err(ServerError::Load(e.clone())),
            _ => Ok(()),
        }
    }

    /// Serves until the process ends.
    pub fn join(mut self) {
        if let Some(thread) = self.http_thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Server {
    /// Stops listening, waits for the replies under way to end, then for
    /// the GPU thread to finish.
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        for thread in [self.http_thread.take(), self.gpu_thread.take()].into_iter().flatten() {
            let _ = thread.join();
        }
    }
}
