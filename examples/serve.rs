//! An OpenAI-compatible HTTP server for one model (see docs/server.md).
//!
//! ```text
//! cargo run --release --example serve -- --model DIR --port 8080
//! curl http://127.0.0.1:8080/v1/chat/completions \
//!     -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
//! ```
//! Without `--model` it serves the default model (SmolLM2-135M-Instruct),
//! downloading it on first use.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use clap::Parser;
use common::{Reporter, parse_size};
use wgspark::server::{DEFAULT_MAX_BODY, DEFAULT_STEP_TOKENS, Server, ServerOptions};
use wgspark::{Gpu, KvFormat, Progress};

type CliResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser, Debug)]
#[command(about = "Serve a model over an OpenAI-compatible HTTP API")]
struct Args {
    /// Hugging Face model folder or GGUF file. Default: SmolLM2-135M-Instruct,
    /// obtained and cached on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model's name in responses and /v1/models (default: its file name).
    #[arg(long)]
    model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences generated at once.
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Requests waiting beyond --parallel; past them, 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// GPU memory of the KV block pool (2GiB, 512MiB, bytes). Default: room
    /// for --parallel sequences of the context, up to 2048 positions each.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    kv_memory: Option<u64>,
    /// Positions of one sequence (default: the model's, at most 8192).
    #[arg(long)]
    context: Option<usize>,
    /// Most rows of one step, decode rows and prompt chunks together:
    /// fewer bound the pause a new prompt puts in the running streams,
    /// more prefill faster.
    #[arg(long, default_value_t = DEFAULT_STEP_TOKENS)]
    step_tokens: usize,
    /// KV cache format: f16 (default) or f32.
    #[arg(long, default_value = "f16")]
    kv_cache: KvFormat,
    /// Every endpoint but /health wants `Authorization: Bearer KEY`.
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// As --api-key, the key read from a file (its first line).
    #[arg(long, value_name = "FILE")]
    api_key_file: Option<PathBuf>,
    /// Largest request body (a size as --kv-memory takes).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value_t = DEFAULT_MAX_BODY as u64)]
    max_body: u64,
    /// A control vector requests may apply by name (`NAME=FILE`, a
    /// llama.cpp GGUF control vector). Repeatable.
    #[arg(long, value_name = "NAME=FILE", value_parser = parse_named_file)]
    control_vector: Vec<(String, PathBuf)>,
    /// Steer only layers START..=END.
    #[arg(long, num_args = 2, value_names = ["START", "END"])]
    control_vector_layer_range: Option<Vec<usize>>,
    /// vulkan, metal, dx12 or gl (default: WGSPARK_BACKEND, else the best adapter).
    #[arg(long)]
    backend: Option<String>,
    /// Which adapter of the backend to run on, by its number in `generate
    /// --list-adapters` (default: WGSPARK_ADAPTER, else the first, the best).
    #[arg(long, conflicts_with = "devices")]
    adapter: Option<usize>,
    /// Split the model's layers across these adapters (their numbers in
    /// `generate --list-adapters`, e.g. 0,1), in proportion to their memory.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// With --devices: each device's share of the layers (e.g. 3,1).
    #[arg(long, value_delimiter = ',', requires = "devices")]
    split: Vec<f64>,
    /// GPU memory the weights may take on each device (24GiB, 512MiB,
    /// bytes): a MoE model that does not fit streams its experts from host
    /// memory into the GPU slots the rest leaves.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    gpu_memory: Option<u64>,
    /// GPU slots per MoE layer (at least the router's top-k), instead of
    /// --gpu-memory: fewer than the experts streams them.
    #[arg(long, value_name = "N", conflicts_with = "gpu_memory")]
    expert_slots: Option<usize>,
}

/// `NAME=FILE`.
fn parse_named_file(text: &str) -> Result<(String, PathBuf), String> {
    match text.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => {
            Ok((name.to_string(), PathBuf::from(file)))
        }
        _ => Err(format!("{text:?}: expected NAME=FILE")),
    }
}

fn main() {
    // SAFETY: first thing in main, before any other thread starts.
    unsafe { wgspark::set_runtime_dir_if_missing() };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("off")).init();
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> CliResult<()> {
    let api_key = match &args.api_key_file {
        Some(path) => Some(read_key(path)?),
        None => args.api_key.clone(),
    };
    if args.control_vector_layer_range.is_some() && args.control_vector.is_empty() {
        return Err("--control-vector-layer-range needs --control-vector".into());
    }
    let gpu_options = common::gpu_options(args.backend.as_deref(), args.adapter)?;
    let gpus = match args.devices.as_slice() {
        [] => vec![Gpu::new(&gpu_options)?],
        devices => devices
            .iter()
            .map(|&adapter| Gpu::new(&wgspark::GpuOptions { adapter: Some(adapter), ..gpu_options.clone() }))
            .collect::<Result<_, _>>()?,
    };
    for gpu in &gpus {
        eprintln!("adapter: {}", gpu.describe());
    }
    let reporter = Arc::new(Mutex::new(Reporter::default()));
    let report = {
        let reporter = reporter.clone();
        move |p: Progress<'_>| reporter.lock().unwrap_or_else(|e| e.into_inner()).report(p)
    };
    let model = match args.model {
        Some(model) => model,
        None => wgspark::fetch::default_model(report.clone())?,
    };
    let options = ServerOptions {
        model_name: args.model_name,
        listen: SocketAddr::new(args.host, args.port),
        parallel: args.parallel,
        queue: args.queue,
        kv_memory: args.kv_memory,
        context_len: args.context,
        step_tokens: args.step_tokens,
        kv_format: args.kv_cache,
        api_key,
        max_body: usize::try_from(args.max_body)?,
        control_vectors: args.control_vector,
        control_vector_layers: args.control_vector_layer_range.map(|r| r[0]..=r[1]),
        load: wgspark::LoadOptions { gpu_memory: args.gpu_memory, expert_slots: args.expert_slots },
        ..ServerOptions::new(&model)
    };
    let shares = (!args.split.is_empty()).then_some(args.split.as_slice());
    let server = Server::start_split(&gpus, shares, options, report)?;
    eprintln!("listening on http://{} (loading {})", server.local_addr(), model.display());
    server.wait_until_loaded()?;
    eprintln!("ready: http://{}/v1", server.local_addr());
    server.join();
    Ok(())
}

/// The first line of a key file, which must not be empty.
fn read_key(path: &PathBuf) -> CliResult<String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let key = text.lines().next().unwrap_or("").trim().to_string();
    if key.is_empty() {
        return Err(format!("{}: no key on its first line", path.display()).into());
    }
    Ok(key)
}
