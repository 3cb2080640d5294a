//! Prefill and decode throughput on full-size shapes with random bf16
//! weights (or a real checkpoint), reported as ratios to the device's copy
//! bandwidth measured in the same run. Decode runs as `generate` runs it:
//! greedy on the GPU, steps in flight, ids read back as they come.
//!
//! ```text
//! cargo run --release --example bench -- --shape llama-3.2-1b --shape llama-3.1-8b
//! cargo run --release --example bench -- --shape qwen3-30b-a3b-16l --routing both
//! cargo run --release --example bench -- --shape llama-3.1-8b --prompt 4096 --decode 64 --depth 0
//! cargo run --release --example bench -- --model DIR
//! cargo run --release --example bench -- --shape qwen3-30b-a3b --routing readback --expert-budget 100,50,25
//! cargo run --release --example bench -- --shape llama-3.1-8b --prompt 0 --decode 32 --profile
//! cargo run --release --example bench -- --shape qwen3-vl-8b-4l --prompt 0 --decode 0 --image-size 1024
//! ```
//! Shapes match those `synth_gguf.py` writes for llama.cpp's `llama-bench`,
//! so both engines measure the same sizes; `--depth D` is llama-bench's
//! `-d D` (both measurements start after D cached positions).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use wgspark::model::experts::ExpertCacheStats;
use wgspark::{
    CaptureOptions, ControlVector, ExpertPrefetch, GenerateOptions, Gpu, GpuOptions, KvFormat, Model,
    ModelConfig, PrefillPrecision, RoutingMode, Sampling, Session, SessionOptions, Steering,
};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// How long prefill (and the batch engine, before each `--parallel` row)
/// runs before it is timed.
const PREFILL_WARM_UP: Duration = Duration::from_secs(2);

#[derive(Parser, Debug)]
#[command(about = "wgspark throughput benchmark")]
struct Args {
    /// Synthetic shapes (see SHAPES).
    #[arg(long)]
    shape: Vec<String>,
    /// A real Hugging Face checkpoint folder.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt tokens of the prefill measurement (ppN; 0 skips it).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Decoded tokens of the decode measurement (tgN; 0 skips it).
    #[arg(long, default_value_t = 128)]
    decode: usize,
    /// Positions already in the cache when both measurements start.
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// Timed repetitions (the best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// MoE routing: readback, device, or both (compared).
    #[arg(long, default_value = "both")]
    routing: String,
    #[arg(long, default_value = "f16")]
    kv_cache: KvFormat,
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// How the cooperative-matrix GEMM rounds a chunk's activations: f16
    /// or split (two f16 parts).
    #[arg(long, default_value = "f16")]
    prefill_precision: PrefillPrecision,
    /// Also measure steering and capture against plain decode.
    #[arg(long)]
    steering: bool,
    /// Time one decode step's dispatches one by one, and the prompt's last
    /// chunk's; with --parallel, also the batch engine's first step (prompt
    /// rows) and a step where every sequence decodes; with a vision shape,
    /// the tower's (GPU timestamps; one device's, so not with --devices).
    #[arg(long, conflicts_with = "devices")]
    profile: bool,
    #[arg(long)]
    backend: Option<String>,
    /// Split the model's layers across these adapters (their numbers in
    /// `generate --list-adapters`, e.g. 0,1), as `generate --devices` does;
    /// a number may repeat. GPU timing and --profile do not run on a split.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// With --devices: each device's share of the layers (e.g. 3,1).
    #[arg(long, value_delimiter = ',', requires = "devices")]
    split: Vec<f64>,
    /// MoE shapes: GPU slots per layer as percentages of the experts
    /// (comma list; at least top-k slots), each measured with its experts
    /// streamed from host memory (100: all resident).
    #[arg(long, value_delimiter = ',')]
    expert_budget: Vec<f64>,
    /// Streamed experts: off, predicted, or both (compared).
    #[arg(long, default_value = "off")]
    expert_prefetch: String,
    /// Models with a vision tower: the side of the square image (random
    /// pixels) the tower is timed on (0 skips it).
    #[arg(long, default_value_t = 1024)]
    image_size: usize,
    /// Also run the batch engine with N sequences at once (comma list):
    /// each a random prompt of --prompt tokens, then --decode tokens
    /// generated greedily; prints the time to prefill every prompt and
    /// the aggregate decode tokens per second while all of them decode
    /// (as llama-batched-bench's S_TG).
    #[arg(long, value_delimiter = ',')]
    parallel: Vec<usize>,
    /// Rows per step of the batch engine (--parallel).
    #[arg(long, default_value_t = 2048)]
    step_tokens: usize,
    /// Fewest rows of a batch step that run the GEMM (--parallel; default:
    /// the engine's).
    #[arg(long)]
    gemm_rows: Option<usize>,
    /// Fewest rows per expert, on average, of a batch step whose experts
    /// run through the grouped GEMM (--parallel; default: the engine's).
    #[arg(long)]
    expert_gemm_rows: Option<usize>,
}

/// (name, config.json) of every synthetic shape.
const SHAPES: &[(&str, &str)] = &[
    (
        "llama-3.2-1b",
        r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
      "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
      "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
      "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
    ),
    (
        "llama-3.1-8b",
        r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
      "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
      "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
    ),
    (
        "smollm2-135m",
        r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
      "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
      "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
      "rope_theta": 100000.0}"#,
    ),
    (
        "qwen3-moe-tiny",
        r#"{"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 3072,
      "moe_intermediate_size": 384, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
      "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": true,
      "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
      "rope_theta": 1000000.0}"#,
    ),
    ("qwen3-30b-a3b", QWEN3_30B_A3B),
    ("qwen3-30b-a3b-16l", QWEN3_30B_A3B),
    ("mixtral-8x7b", MIXTRAL_8X7B),
    ("mixtral-8x7b-8l", MIXTRAL_8X7B),
    ("qwen3-vl-8b", QWEN3_VL_8B),
];

/// Qwen3-VL-8B-Instruct's config (its text model is Qwen3-8B's shape).
const QWEN3_VL_8B: &str = r#"{"model_type": "qwen3_vl", "image_token_id": 151655,
  "vision_start_token_id": 151652, "video_token_id": 151656,
  "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
    "rope_theta": 5000000, "rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20],
    "rope_type": "default"}},
  "vision_config": {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "out_hidden_size": 4096, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh"},
  "tie_word_embeddings": false}"#;

/// Qwen3-VL's preprocessor_config.json (the processor the tower is timed with).
const QWEN3_VL_PREPROCESSOR: &str = r#"{"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
  "size": {"longest_edge": 16777216, "shortest_edge": 65536}}"#;

const QWEN3_30B_A3B: &str = r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
  "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
  "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
  "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "rope_theta": 1000000.0}"#;

const MIXTRAL_8X7B: &str = r#"{"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
  "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "rope_theta": 1000000.0}"#;

/// The config of a shape; `-Nl` suffixes keep the first N layers (the
/// per-layer cost is what is compared, where a whole model would not fit
/// llama.cpp's disk as a file).
fn shape_config(name: &str) -> Result<ModelConfig, String> {
    let layers =
        name.rsplit_once('-').and_then(|(base, s)| Some((base, s.strip_suffix('l')?.parse::<u64>().ok()?)));
    let base = match layers {
        Some((base, _)) if !SHAPES.iter().any(|(n, _)| *n == name) => base,
        _ => name,
    };
    let (_, json) = SHAPES.iter().find(|(n, _)| *n == base).ok_or_else(|| {
        let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
        format!(
            "unknown shape {name:?} (one of {}, each also as NAME-Nl: its first N layers)",
            names.join(", ")
        )
    })?;
    let mut value: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    if let Some((_, layers)) = layers {
        // A multimodal config's layers are its text model's.
        match value.get_mut("text_config") {
            Some(text) => text["num_hidden_layers"] = layers.into(),
            None => value["num_hidden_layers"] = layers.into(),
        }
    }
    ModelConfig::parse(&value.to_string(), std::path::Path::new(name)).map_err(|e| e.to_string())
}

fn main() {
    // SAFETY: first thing in main, before any other thread starts.
    unsafe { wgspark::set_runtime_dir_if_missing() };
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> BenchResult<()> {
    let mut options = GpuOptions::from_env()?;
    if let Some(name) = &args.backend {
        options.backend = name.parse()?;
    }
    let gpus: Vec<Gpu> = match args.devices.as_slice() {
        [] => vec![Gpu::new(&options)?],
        devices => devices
            .iter()
            .map(|&adapter| Gpu::new(&GpuOptions { adapter: Some(adapter), ..options.clone() }))
            .collect::<Result<_, _>>()?,
    };
    for gpu in &gpus {
        println!("adapter: {}", gpu.describe());
    }
    let gpu = &gpus[0];
    let shares = (!args.split.is_empty()).then_some(args.split.as_slice());
    let copy = wgspark::kernels::copy::bandwidth(gpu, 1 << 30, 10)?;
    println!(
        "copy bandwidth: {:.3} TB/s (read + write; buffer copy {:.3}, copy kernel {:.3})",
        copy.best / 1e12,
        copy.api / 1e12,
        copy.kernel / 1e12
    );
    let round_trip = gpu.readback_round_trip(4, 50)?;
    println!("readback round trip (submit, map, read 4 bytes): {:.3} ms", round_trip.as_secs_f64() * 1e3);
    if !args.expert_budget.is_empty() {
        println!(
            "host-to-device upload: {:.1} GB/s (256 MiB through the queue)",
            gpu.upload_bandwidth(256 << 20)? / 1e9
        );
    }

    for name in &args.shape {
        let config = shape_config(name)?;
        let budgets: Vec<Option<usize>> = match &config.moe {
            Some(m) if !args.expert_budget.is_empty() => args
                .expert_budget
                .iter()
                .map(|pct| Some(((m.experts as f64 * pct / 100.0).ceil() as usize).clamp(m.top_k, m.experts)))
                .collect(),
            _ => vec![None],
        };
        for expert_slots in budgets {
            let start = Instant::now();
            let load = wgspark::LoadOptions { expert_slots, ..Default::default() };
            let model = match gpus.as_slice() {
                [gpu] => Model::synthetic_with(config.clone(), gpu, 1, &load)?,
                gpus => Model::synthetic_split_with(config.clone(), gpus, shares, 1, &load)?,
            };
            eprintln!("{name}: random weights uploaded in {:.1} s", start.elapsed().as_secs_f64());
            let label = match expert_slots {
                Some(slots) => format!("{name}, {slots} expert slots per layer"),
                None => name.clone(),
            };
            measure(&args, copy.best, round_trip, &label, &model)?;
        }
    }
    if let Some(dir) = &args.model {
        let model = match gpus.as_slice() {
            [gpu] => Model::load(dir, gpu)?,
            gpus => Model::load_split(dir, gpus, shares, &wgspark::LoadOptions::default(), |_| {})?,
        };
        if gpus.len() > 1 {
            println!("layers per device: {:?}", model.layer_split());
        }
        measure(&args, copy.best, round_trip, &dir.display().to_string(), &model)?;
    }
    Ok(())
}

fn measure(args: &Args, copy: f64, round_trip: Duration, name: &str, model: &Model) -> BenchResult<()> {
    let c = &model.config;
    println!("\n{name}: {:.3} GB of weights, depth {}", model.weight_bytes() as f64 / 1e9, args.depth);
    for &n in &args.parallel {
        measure_parallel(args, model, n)?;
    }
    if c.vision.is_some() && args.image_size > 0 {
        measure_vision_tower(args, model)?;
    }
    let (modes, prefetches) = session_modes(args, model)?;
    let mut decode_per_mode = Vec::new();
    for (routing, expert_prefetch) in modes.iter().flat_map(|&r| prefetches.iter().map(move |&p| (r, p))) {
        let options = SessionOptions {
            context_len: Some(args.depth + args.prompt.max(args.decode) + 1),
            prefill_chunk: args.prefill_chunk,
            kv_format: args.kv_cache,
            prefill_precision: args.prefill_precision,
            routing,
            expert_prefetch,
            ..Default::default()
        };
        let mode = match (c.moe.is_some(), model.experts().is_some()) {
            (true, true) => format!(" ({routing:?} routing, prefetch {expert_prefetch:?})"),
            (true, false) => format!(" ({routing:?} routing)"),
            _ => String::new(),
        };
        let mut session = model.session(&options)?;
        let context: Vec<u32> = (0..args.depth).map(|i| (i * 7919 % c.vocab) as u32).collect();
        let fill = |session: &mut Session<'_>| -> wgspark::Result<()> {
            session.truncate(0);
            if !context.is_empty() {
                session.prefill(&context)?;
            }
            Ok(())
        };
        if args.prompt > 0 {
            measure_prefill(args, model, &options, &mut session, &fill, &mode)?;
        }
        if args.decode > 0 {
            let per_token = measure_decode(args, copy, model, &mut session, &fill, &mode)?;
            // GPU timestamps are one device's: a split has no timed session.
            if model.layer_split().len() == 1 {
                gpu_time(args.profile, model, &options, &fill, c.vocab)?;
            }
            decode_per_mode.push((routing, per_token));
        }
        if args.steering && routing == modes[0] && args.decode > 0 {
            steering_cost(&mut session, &fill, args.decode, c)?;
        }
    }
    if let [(_, device), (_, readback)] = decode_per_mode[..] {
        let moe_layers = c.moe.as_ref().map_or(0, |m| m.sparse_layers.iter().filter(|&&s| s).count());
        let per_readback = (readback - device) / moe_layers as f64;
        println!(
            "  routing readback: {:.3} ms per MoE layer over device-resident = {:.2}x the bare round trip ({:.3} ms)",
            per_readback * 1e3,
            per_readback / round_trip.as_secs_f64(),
            round_trip.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// The routing modes and expert prefetches `--routing` and
/// `--expert-prefetch` ask to measure, of those `model` runs.
fn session_modes(
    args: &Args,
    model: &Model,
) -> BenchResult<(&'static [RoutingMode], &'static [ExpertPrefetch])> {
    let modes: &[RoutingMode] = match (model.config.moe.is_some(), args.routing.as_str()) {
        // Streamed experts need the host to see the routing.
        _ if model.experts().is_some() => &[RoutingMode::Readback],
        (false, _) | (true, "readback") => &[RoutingMode::Readback],
        (true, "device") => &[RoutingMode::DeviceResident],
        (true, "both") => &[RoutingMode::DeviceResident, RoutingMode::Readback],
        (true, other) => return Err(format!("--routing {other:?}: readback, device or both").into()),
    };
    let prefetches: &[ExpertPrefetch] = match (model.experts().is_some(), args.expert_prefetch.as_str()) {
        (false, _) | (true, "off") => &[ExpertPrefetch::Off],
        (true, "predicted") => &[ExpertPrefetch::Predicted],
        (true, "both") => &[ExpertPrefetch::Off, ExpertPrefetch::Predicted],
        (true, other) => return Err(format!("--expert-prefetch {other:?}: off, predicted or both").into()),
    };
    Ok((modes, prefetches))
}

/// Prints the best of `--reps` prefills of `--prompt` tokens after the
/// context, once the GPU is warm.
fn measure_prefill(
    args: &Args,
    model: &Model,
    options: &SessionOptions,
    session: &mut Session<'_>,
    fill: &dyn Fn(&mut Session<'_>) -> wgspark::Result<()>,
    mode: &str,
) -> wgspark::Result<()> {
    let c = &model.config;
    let prompt: Vec<u32> = (0..args.prompt).map(|i| (i * 104729 % c.vocab) as u32).collect();
    // Warm up (pipelines compile on first use, and a GPU that has
    // idled runs short prompts at a fraction of its clock until it has
    // been busy a while), then best of reps.
    let warm = Instant::now();
    while warm.elapsed() < PREFILL_WARM_UP {
        fill(session)?;
        session.prefill(&prompt)?;
    }
    let mut best = Duration::MAX;
    for _ in 0..args.reps.max(1) {
        fill(session)?;
        let start = Instant::now();
        session.prefill(&prompt)?;
        best = best.min(start.elapsed());
    }
    let secs = best.as_secs_f64();
    println!(
        "  prefill pp{}{mode}: {:.2} ms -> {:.0} tok/s, {:.2} TFLOP/s (chunk {})",
        args.prompt,
        secs * 1e3,
        args.prompt as f64 / secs,
        prefill_flops(c, args.depth, args.prompt) / secs / 1e12,
        session.prefill_chunk()
    );
    if args.profile {
        prefill_profile(model, options, fill, &prompt)?;
    }
    Ok(())
}

/// `n` sequences through the batch engine at once: random prompts of
/// `--prompt` tokens, `--decode` tokens each, greedy, no stop ids. A batch
/// of one is also timed against a lone session decoding the same
/// positions (`tg` above starts at `--depth`).
fn measure_parallel(args: &Args, model: &Model, n: usize) -> BenchResult<()> {
    use wgspark::batch::{BatchEngine, BatchOptions, Request};
    let c = &model.config;
    let routing = match (c.moe.is_some(), model.experts().is_some()) {
        (true, false) => RoutingMode::DeviceResident,
        _ => RoutingMode::Readback,
    };
    let options = BatchOptions {
        max_sequences: n,
        step_tokens: args.step_tokens,
        context_len: Some(args.prompt + args.decode),
        kv_format: args.kv_cache,
        prefill_precision: args.prefill_precision,
        prefix_cache: false,
        routing,
        gemm_rows: args.gemm_rows,
        expert_gemm_rows: args.expert_gemm_rows,
        ..Default::default()
    };
    let mut engine = BatchEngine::new(model, &options)?;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % c.vocab as u64) as u32
    };
    let requests: Vec<Request> = (0..n)
        .map(|_| Request {
            max_tokens: args.decode,
            ..Request::new((0..args.prompt.max(1)).map(|_| next()).collect())
        })
        .collect();
    // Warm-up runs of two sequences for PREFILL_WARM_UP, then the timed
    // one: warmed by one short run, the first row after the model loaded
    // decoded at three quarters of the rate it showed when run again.
    let warm = Instant::now();
    while warm.elapsed() < PREFILL_WARM_UP {
        for r in requests.iter().take(2) {
            engine.add(Request { max_tokens: 2, ..r.clone() })?;
        }
        while !engine.is_idle() {
            engine.step()?;
        }
    }
    let start = Instant::now();
    for r in requests.iter().cloned() {
        engine.add(r)?;
    }
    let (mut first_all, mut after_first) = (None, 0usize);
    let mut steps = 0;
    while !engine.is_idle() {
        let outputs = engine.step()?;
        steps += 1;
        if first_all.is_none() {
            // Every prompt has run (its last row chose the first token).
            if engine.stats().waiting == 0 && engine.stats().prompt_rows >= (n * args.prompt.max(1)) as u64 {
                first_all = Some(Instant::now());
            }
        } else {
            after_first += outputs.len();
        }
    }
    let total = start.elapsed();
    let prefill = first_all.map_or(total, |t| t - start);
    let decode = total - prefill;
    let stats = engine.stats();
    println!(
        "  batch of {n}: prefill of {n} x {} tokens {:.3} s ({:.0} tok/s); decode {:.1} tok/s aggregate \
         ({after_first} tokens in {:.3} s while all decode); {:.3} s in all, {steps} steps, {} preemptions",
        args.prompt,
        prefill.as_secs_f64(),
        (n * args.prompt) as f64 / prefill.as_secs_f64(),
        after_first as f64 / decode.as_secs_f64(),
        decode.as_secs_f64(),
        total.as_secs_f64(),
        stats.preemptions,
    );
    if n == 1 {
        let session_rate = lone_decode(args, model, &requests[0], routing)?;
        println!(
            "  a lone session over the same positions: {session_rate:.1} tok/s (the batch of one at {:.3} of it)",
            after_first as f64 / decode.as_secs_f64() / session_rate
        );
    }
    if args.profile {
        parallel_profile(model, &options, &requests)?;
    }
    Ok(())
}

/// Tokens per second of a lone session given `request`'s prompt, over the
/// tokens after its first, as the batch row counts them; the best of
/// `--reps` after a round that warms up.
fn lone_decode(
    args: &Args,
    model: &Model,
    request: &wgspark::batch::Request,
    routing: RoutingMode,
) -> BenchResult<f64> {
    let options = SessionOptions {
        context_len: Some(request.prompt.len() + args.decode),
        prefill_chunk: args.prefill_chunk,
        kv_format: args.kv_cache,
        prefill_precision: args.prefill_precision,
        routing,
        ..Default::default()
    };
    let mut session = model.session(&options)?;
    let generate = GenerateOptions { max_tokens: args.decode, ..Default::default() };
    let mut best = 0.0f64;
    for round in 0..=args.reps.max(1) {
        session.truncate(0);
        let mut ids = session.generate(&request.prompt, &generate)?;
        ids.next().transpose()?;
        let start = Instant::now();
        let mut tokens = 0;
        for id in ids {
            id?;
            tokens += 1;
        }
        if round > 0 {
            best = best.max(tokens as f64 / start.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}

/// The first step (prompt rows of every sequence it admits) and a step in
/// which all of `requests` decode, each dispatch timed alone.
fn parallel_profile(
    model: &Model,
    options: &wgspark::batch::BatchOptions,
    requests: &[wgspark::batch::Request],
) -> BenchResult<()> {
    use wgspark::batch::{BatchEngine, BatchOptions};
    let options = BatchOptions { time_dispatches: true, in_flight: 0, ..options.clone() };
    let mut engine = BatchEngine::new(model, &options)?;
    for r in requests {
        engine.add(r.clone())?;
    }
    let prompt_rows: usize = requests.iter().map(|r| r.prompt.len()).sum();
    engine.step()?;
    let first_rows = engine.stats().prompt_rows;
    println!("  prompt step of {first_rows} rows:");
    print_profile(&engine.stats().last_passes);
    // The first step after every prompt in which every sequence decodes.
    while !engine.is_idle() {
        let prompts_done = engine.stats().prompt_rows >= prompt_rows as u64;
        if engine.step()?.len() == requests.len() && prompts_done {
            println!("  decode step of {} sequences:", requests.len());
            print_profile(&engine.stats().last_passes);
            return Ok(());
        }
    }
    Err("no step of the profile ran every sequence".into())
}

/// Prints the best of `--reps` decodes of `--decode` tokens after the
/// context (and how the expert cache served them), as a share of the
/// copy bandwidth; returns the seconds per token.
fn measure_decode(
    args: &Args,
    copy: f64,
    model: &Model,
    session: &mut Session<'_>,
    fill: &dyn Fn(&mut Session<'_>) -> wgspark::Result<()>,
    mode: &str,
) -> wgspark::Result<f64> {
    let cache_before = session.stats().expert_cache;
    let decode_start = Instant::now();
    // With streamed experts, tokens drawn at temperature 1 from the
    // random model's near-uniform logits: routing then changes
    // every step (the worst case for the cache), where greedy
    // decoding of random weights tends to repeat a token.
    let sampling = match args.expert_budget.is_empty() {
        true => Sampling::Greedy,
        false => Sampling::Random { temperature: 1.0, top_k: None, top_p: None },
    };
    let per_token = best_decode(session, fill, args.decode, args.reps, model.config.vocab, sampling)?;
    let tokens = ((args.reps.max(1) + 1) * (args.decode + 1)) as f64;
    let secs = decode_start.elapsed().as_secs_f64();
    print_expert_cache(model, &session.stats().expert_cache, &cache_before, tokens, secs, mode);
    let bytes = decode_bytes(model, args.depth + args.decode / 2, args.kv_cache);
    let achieved = bytes as f64 / per_token;
    let stats = session.stats();
    println!(
        "  decode tg{}{mode}: {:.3} ms/token -> {:.1} tok/s; {:.3} GB read per token -> {:.3} TB/s = {:.1}% \
         of copy bandwidth; {} dispatches per token",
        args.decode,
        per_token * 1e3,
        1.0 / per_token,
        bytes as f64 / 1e9,
        achieved / 1e12,
        100.0 * achieved / copy,
        stats.decode_dispatches
    );
    if stats.routing_readbacks > 0 {
        let per = |d: Duration| d.as_secs_f64() * 1e3 / stats.routing_readbacks as f64;
        println!(
            "  host per routing readback: {:.3} ms waiting for the map, {:.3} ms in submissions",
            per(stats.routing_wait),
            per(stats.submit_time)
        );
    }
    Ok(per_token)
}

/// Where experts stream, how their cache served the `tokens` decoded in
/// `secs`: the session's totals `now` less those `before` them.
fn print_expert_cache(
    model: &Model,
    now: &ExpertCacheStats,
    before: &ExpertCacheStats,
    tokens: f64,
    secs: f64,
    mode: &str,
) {
    let Some(experts) = model.experts() else { return };
    let cache = ExpertCacheStats {
        hits: now.hits - before.hits,
        misses: now.misses - before.misses,
        bytes_uploaded: now.bytes_uploaded - before.bytes_uploaded,
        upload_time: now.upload_time - before.upload_time,
        prefetched: now.prefetched - before.prefetched,
        prefetch_hits: now.prefetch_hits - before.prefetch_hits,
    };
    println!(
        "  expert cache{mode}: {} of {} slots per layer, {:.1} % hits ({:.1} % prefetched), \
         {:.1} of {:.1} prefetched per token used, {:.1} MB uploaded per token, \
         {:.1} GB/s of uploads while decoding, {:.1} GB/s while uploading ({:.2} ms per token) \
         (staging ring {:.0} MB)",
        experts.slots,
        model.config.moe.as_ref().map_or(0, |m| m.experts),
        100.0 * cache.hits as f64 / (cache.hits + cache.misses).max(1) as f64,
        100.0 * cache.prefetch_hits as f64 / (cache.hits + cache.misses).max(1) as f64,
        cache.prefetch_hits as f64 / tokens,
        cache.prefetched as f64 / tokens,
        cache.bytes_uploaded as f64 / tokens / 1e6,
        cache.bytes_uploaded as f64 / secs / 1e9,
        cache.bytes_uploaded as f64 / cache.upload_time.as_secs_f64().max(1e-9) / 1e9,
        cache.upload_time.as_secs_f64() * 1e3 / tokens,
        experts.staging_bytes() as f64 / 1e6
    );
}

/// Seconds per decoded token, best of `reps` generations of `n` tokens
/// (no stop token) from the filled context.
fn best_decode(
    session: &mut Session<'_>,
    fill: &dyn Fn(&mut Session<'_>) -> wgspark::Result<()>,
    n: usize,
    reps: usize,
    vocab: usize,
    sampling: Sampling,
) -> wgspark::Result<f64> {
    let options = GenerateOptions { max_tokens: n + 1, sampling, ..Default::default() };
    let mut best = f64::MAX;
    // The first round warms up.
    for round in 0..=reps.max(1) {
        fill(session)?;
        let mut ids = session.generate(&[(vocab / 2) as u32], &options)?;
        // The first id comes from the one-token prompt: time the n steps after it.
        ids.next().transpose()?;
        let start = Instant::now();
        for id in ids {
            id?;
        }
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64() / n as f64);
        }
    }
    Ok(best)
}

/// GPU time per decode step (timestamps where the adapter has them)
/// against wall time, each step waited for.
fn gpu_time(
    profile: bool,
    model: &Model,
    options: &SessionOptions,
    fill: &dyn Fn(&mut Session<'_>) -> wgspark::Result<()>,
    vocab: usize,
) -> wgspark::Result<()> {
    let mut timed =
        model.session(&SessionOptions { timing: true, time_dispatches: profile, ..options.clone() })?;
    fill(&mut timed)?;
    let n = 32;
    let before = timed.stats();
    let start = Instant::now();
    timed
        .generate(&[(vocab / 2) as u32], &GenerateOptions { max_tokens: n + 1, ..Default::default() })?
        .count();
    let wall = start.elapsed().as_secs_f64() / (n + 1) as f64;
    let after = timed.stats();
    if let (Some(a), Some(b), Some(source)) = (after.phases, before.phases, after.timing_source) {
        let ms = |x: Duration, y: Duration| (x - y).as_secs_f64() * 1e3 / (n + 1) as f64;
        println!(
            "  per step ({source:?}, each waited for): layers {:.3} ms, routed {:.3} ms, head {:.3} ms; \
             wall {:.3} ms",
            ms(a.layers, b.layers),
            ms(a.routed, b.routed),
            ms(a.head, b.head),
            wall * 1e3
        );
    }
    if profile {
        println!("  decode step:");
        print_profile(&after.last_passes);
    }
    Ok(())
}

/// The prompt's last chunk with each dispatch timed in a pass of its own.
fn prefill_profile(
    model: &Model,
    options: &SessionOptions,
    fill: &dyn Fn(&mut Session<'_>) -> wgspark::Result<()>,
    prompt: &[u32],
) -> wgspark::Result<()> {
    let mut timed =
        model.session(&SessionOptions { timing: true, time_dispatches: true, ..options.clone() })?;
    fill(&mut timed)?;
    timed.prefill(prompt)?;
    println!("  prefill, the last chunk:");
    print_profile(&timed.stats().last_passes);
    Ok(())
}

/// A step's (or the vision tower's) dispatches, each timed in a pass of
/// its own: the total per kernel and the first `SHOWN` in order (a layer
/// and more).
fn print_profile(passes: &[(&'static str, Duration)]) {
    const SHOWN: usize = 24;
    let mut totals: Vec<(&str, Duration, usize)> = Vec::new();
    for &(label, t) in passes {
        match totals.iter_mut().find(|(l, _, _)| *l == label) {
            Some(entry) => {
                entry.1 += t;
                entry.2 += 1;
            }
            None => totals.push((label, t, 1)),
        }
    }
    let us = |t: Duration| t.as_secs_f64() * 1e6;
    let all: Duration = passes.iter().map(|p| p.1).sum();
    println!("  each dispatch in its own pass: {:.1} us in {} passes", us(all), passes.len());
    for (label, t, n) in totals {
        println!("    {label:<16} {n:>4} x {:8.2} us = {:8.1} us", us(t) / n as f64, us(t));
    }
    let first: Vec<String> = passes.iter().take(SHOWN).map(|(l, t)| format!("{l} {:.1}", us(*t))).collect();
    println!("    in order: {}", first.join(", "));
}

/// Plain decode, steering every layer, and steering while capturing one
/// or every layer, in alternation so that clock drift hits all alike;
/// best of 4 rounds of a quarter of the tokens each.
fn steering_cost(
    session: &mut Session<'_>,
    fill: &dyn Fn(&mut Session<'_>) -> wgspark::Result<()>,
    n: usize,
    c: &ModelConfig,
) -> BenchResult<()> {
    let directions = (1..c.layers).map(|l| (l, vec![0.01 * (l % 3) as f32; c.hidden])).collect();
    let vector = ControlVector { path: "bench".into(), model_hint: None, directions };
    let steering = Steering::new(c, &[(vector, 1.0)], None)?;
    let one_layer = CaptureOptions { layers: Some(vec![c.layers / 2]), ..Default::default() };
    let every_layer = CaptureOptions::default();
    let variants = [
        (None, None),
        (Some(&steering), None),
        (Some(&steering), Some(&one_layer)),
        (Some(&steering), Some(&every_layer)),
    ];
    let mut best = [f64::MAX; 4];
    for _ in 0..4 {
        for ((steer, capture), best) in variants.iter().zip(&mut best) {
            session.set_steering(*steer)?;
            session.set_capture(*capture)?;
            *best = best.min(best_decode(session, fill, n.div_ceil(4), 1, c.vocab, Sampling::Greedy)?);
        }
    }
    let [plain, steered, captured_one, captured_all] = best;
    println!(
        "  decode (best of 4 alternating rounds): plain {:.3} ms/token; steering {} layers {:.3}x; \
         plus capturing 1 layer {:.3}x, all {} layers {:.3}x",
        plain * 1e3,
        c.layers - 1,
        steered / plain,
        captured_one / plain,
        c.layers,
        captured_all / plain
    );
    session.set_steering(None)?;
    session.set_capture(None)?;
    Ok(())
}

/// Matmul and attention FLOPs of a prefill of `t` tokens after `depth`
/// cached positions (head on the last).
fn prefill_flops(c: &ModelConfig, depth: usize, t: usize) -> f64 {
    let h = c.hidden as f64;
    let heads = c.heads;
    let attn_proj = h * heads.qkv_width() as f64 + (heads.q * heads.dim) as f64 * h;
    let ffn: f64 = (0..c.layers)
        .map(|l| match &c.moe {
            Some(m) if m.sparse_layers[l] => {
                h * m.experts as f64 + 3.0 * h * m.intermediate as f64 * m.top_k as f64
            }
            _ => 3.0 * h * c.intermediate as f64,
        })
        .sum();
    let (d, t) = (depth as f64, t as f64);
    let matmul = 2.0 * t * (c.layers as f64 * attn_proj + ffn) + 2.0 * h * c.vocab as f64;
    // q.k and p.v: each token attends to the depth and the chunk before it.
    let attention = c.layers as f64 * 4.0 * (heads.q * heads.dim) as f64 * t * (d + (t + 1.0) / 2.0);
    matmul + attention
}

/// Bytes one decode step reads at position `pos`: every weight it uses
/// (one embedding row; the selected experts of MoE layers), in their stored
/// formats, and the KV cache.
fn decode_bytes(model: &Model, pos: usize, format: KvFormat) -> u64 {
    let c = &model.config;
    let top_k = c.moe.as_ref().map_or(0, |m| m.top_k);
    let kv = 2 * c.layers as u64 * (pos * c.heads.kv_width() * format.bytes_per_value()) as u64;
    model.weights().decode_bytes(top_k) + kv
}

/// The vision tower's time for one square image of random pixels, as
/// Qwen3-VL's processor cuts it (16-pixel patches, 2 x 2 merged), best of
/// `--reps` after a warm-up.
fn measure_vision_tower(args: &Args, model: &Model) -> BenchResult<()> {
    let gemm = wgspark::ChunkMatmul::Auto.gemm(model.gpu(), args.prefill_precision)?;
    let gemm = gemm.as_ref();
    let v = model.config.vision.as_ref().expect("a vision tower");
    let processor =
        wgspark::vision::ImageProcessor::parse(QWEN3_VL_PREPROCESSOR, std::path::Path::new("qwen3-vl"))?;
    let side = args.image_size;
    let mut x = 0x9e37_79b9u32;
    let pixels = (0..side * side * 3)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8
        })
        .collect();
    let image = wgspark::vision::RgbImage { width: side, height: side, pixels };
    let start = Instant::now();
    let patches = processor.patches(&image, "random")?;
    let preprocess = start.elapsed();
    let [_, rows, cols] = patches.grid;
    // The whole encode, and its host part: planning the buffers and
    // dispatches, recording and submitting them.
    let encode = || -> BenchResult<(Duration, Duration)> {
        let start = Instant::now();
        let out = wgspark::flow::vision::encode_image(model, &patches, gemm)?;
        let submitted = start.elapsed();
        model.gpu().wait()?;
        let elapsed = start.elapsed();
        drop(out);
        Ok((elapsed, submitted))
    };
    encode()?;
    let (best, host) =
        (0..args.reps.max(1)).map(|_| encode()).collect::<Result<Vec<_>, _>>()?.into_iter().min().unwrap();
    let patches_n = rows * cols;
    println!(
        "  vision tower, {side} x {side} image: {patches_n} patches ({rows} x {cols}) -> {} merged rows; \
         preprocessing {:.1} ms (host), tower {:.2} ms (planned, submitted and done; {:.2} ms to submit) \
         = {:.0} patches/s",
        patches_n / (v.merge_size * v.merge_size),
        preprocess.as_secs_f64() * 1e3,
        best.as_secs_f64() * 1e3,
        host.as_secs_f64() * 1e3,
        patches_n as f64 / best.as_secs_f64()
    );
    if args.profile && model.gpu().caps.timestamps {
        println!("  vision tower:");
        print_profile(&wgspark::flow::vision::profile_image(model, &patches, gemm)?);
    } else if args.profile {
        println!("  vision tower: no profile (the adapter has no GPU timestamps)");
    }
    Ok(())
}
