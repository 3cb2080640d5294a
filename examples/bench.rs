//! Prefill and decode throughput on full-size shapes with random bf16
//! weights (or a real checkpoint), reported as ratios to the device's copy
//! bandwidth measured in the same run.
//!
//! ```text
//! cargo run --release --example bench -- --shape llama-3.2-1b --shape llama-3.1-8b
//! cargo run --release --example bench -- --model DIR
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use wgspark::sampling::argmax;
use wgspark::{
    Backend, CaptureOptions, ControlVector, Gpu, GpuOptions, Model, ModelConfig, Session, SessionOptions,
    Steering,
};

#[derive(Parser, Debug)]
#[command(about = "wgspark throughput benchmark")]
struct Args {
    /// Synthetic shapes: llama-3.2-1b, llama-3.1-8b, smollm2-135m, qwen3-moe-tiny.
    #[arg(long)]
    shape: Vec<String>,
    /// A real Hugging Face checkpoint folder.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt tokens of the prefill measurement (ppN).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Decoded tokens of the decode measurement (tgN).
    #[arg(long, default_value_t = 128)]
    decode: usize,
    /// Timed repetitions of the prefill (best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long)]
    prefill_chunk: Option<usize>,
    #[arg(long)]
    backend: Option<String>,
}

const LLAMA_3_2_1B: &str = r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
  "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
  "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
  "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;

const LLAMA_3_1_8B: &str = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
  "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;

const SMOLLM2_135M: &str = r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
  "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
  "rope_theta": 100000.0}"#;

const QWEN3_MOE_TINY: &str = r#"{"model_type": "qwen3_moe", "hidden_size": 1024, "intermediate_size": 3072,
  "moe_intermediate_size": 384, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
  "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": true,
  "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "rope_theta": 1000000.0}"#;

fn shape_config(name: &str) -> Result<ModelConfig, String> {
    let json = match name {
        "llama-3.2-1b" => LLAMA_3_2_1B,
        "llama-3.1-8b" => LLAMA_3_1_8B,
        "smollm2-135m" => SMOLLM2_135M,
        "qwen3-moe-tiny" => QWEN3_MOE_TINY,
        other => return Err(format!("unknown shape {other:?}")),
    };
    ModelConfig::parse(json, std::path::Path::new(name)).map_err(|e| e.to_string())
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let backend = match &args.backend {
        Some(name) => name.parse()?,
        None => Backend::from_env()?,
    };
    let gpu = Gpu::new(&GpuOptions { backend, ..Default::default() })?;
    println!("adapter: {}", gpu.describe());
    let copy = gpu.copy_bandwidth(256 << 20, 20)?;
    println!("copy bandwidth: {:.3} TB/s (read + write)", copy / 1e12);
    let round_trip = gpu.readback_round_trip(4, 50)?;
    println!("readback round trip (submit, map, read 4 bytes): {:.3} ms", round_trip.as_secs_f64() * 1e3);
    for bytes in [128 << 10, 512 << 10, 4 << 20] {
        let t = gpu.readback_round_trip(bytes, 20)?.as_secs_f64();
        println!(
            "readback round trip of {} KiB: {:.3} ms ({:.2} GB/s beyond the 4-byte trip)",
            bytes >> 10,
            t * 1e3,
            bytes as f64 / (t - round_trip.as_secs_f64()).max(1e-9) / 1e9
        );
    }

    let mut models: Vec<(String, Model)> = Vec::new();
    for name in &args.shape {
        let start = Instant::now();
        let model = Model::synthetic(shape_config(name)?, &gpu, 1)?;
        eprintln!("{name}: random weights uploaded in {:.1} s", start.elapsed().as_secs_f64());
        models.push((name.clone(), model));
        measure(&args, copy, models.last().unwrap())?;
        models.clear();
    }
    if let Some(dir) = &args.model {
        let model = Model::load(dir, &gpu)?;
        measure(&args, copy, &(dir.display().to_string(), model))?;
    }
    Ok(())
}

fn measure(
    args: &Args,
    copy: f64,
    (name, model): &(String, Model),
) -> Result<(), Box<dyn std::error::Error>> {
    let c = &model.config;
    let weight_bytes = c.weight_bytes();
    println!("\n{name}: {:.3} GB of bf16 weights", weight_bytes as f64 / 1e9);
    let options = SessionOptions {
        context_len: Some(args.prompt + args.decode + 1),
        prefill_chunk: args.prefill_chunk,
        ..Default::default()
    };
    let mut session = model.session(&options)?;
    let prompt: Vec<u32> = (0..args.prompt).map(|i| (i * 7919 % c.vocab) as u32).collect();

    // Prefill: warm up once (pipelines compile on first use), then best of reps.
    session.prefill(&prompt)?;
    let mut best = Duration::MAX;
    for _ in 0..args.reps.max(1) {
        session.truncate(0);
        let start = Instant::now();
        session.prefill(&prompt)?;
        best = best.min(start.elapsed());
    }
    let flops = prefill_flops(c, args.prompt);
    let secs = best.as_secs_f64();
    println!(
        "  prefill pp{}: {:.2} ms -> {:.0} tok/s, {:.2} TFLOP/s (chunk {})",
        args.prompt,
        secs * 1e3,
        args.prompt as f64 / secs,
        flops / secs / 1e12,
        session.prefill_chunk()
    );

    // Decode after the prompt, greedy, reading the logits every token.
    session.truncate(0);
    let mut logits = session.prefill(&prompt)?;
    let mut next = argmax(&logits);
    for _ in 0..4 {
        logits = session.step(next, session.position())?;
        next = argmax(&logits);
    }
    let per_token = decode_per_token(&mut session, args.prompt, next, args.decode)?;
    let bytes = decode_bytes(c, args.prompt + args.decode / 2);
    let achieved = bytes as f64 / per_token;
    println!(
        "  decode tg{}: {:.3} ms/token -> {:.1} tok/s; {:.3} GB read per token -> {:.3} TB/s = {:.1}% of copy bandwidth",
        args.decode,
        per_token * 1e3,
        1.0 / per_token,
        bytes as f64 / 1e9,
        achieved / 1e12,
        100.0 * achieved / copy
    );
    let stats = session.stats();

    // Plain decode, steering every layer, and steering while capturing one
    // or every layer, in alternation so that clock drift hits all alike;
    // best of 4 rounds of a quarter of the tokens each.
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
            *best = best.min(decode_per_token(&mut session, args.prompt, next, args.decode.div_ceil(4))?);
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

    // Where decode time goes: GPU time per phase (timestamps) against wall.
    let mut timed = model.session(&SessionOptions { timing: true, ..options.clone() })?;
    timed.prefill(&prompt)?;
    let timed_stats_before = timed.stats();
    let start = Instant::now();
    let n = 32.min(args.decode);
    for _ in 0..n {
        logits = timed.step(next, timed.position())?;
        next = argmax(&logits);
    }
    let wall = start.elapsed().as_secs_f64() / n as f64;
    let after = timed.stats();
    if let (Some(a), Some(b), Some(source)) = (after.phases, timed_stats_before.phases, after.timing_source) {
        let ms = |x: Duration, y: Duration| (x - y).as_secs_f64() * 1e3 / n as f64;
        println!(
            "  decode per token ({source:?}): attention {:.3} ms, routed {:.3} ms, head {:.3} ms; wall {:.3} ms",
            ms(a.attention, b.attention),
            ms(a.routed, b.routed),
            ms(a.head, b.head),
            wall * 1e3
        );
    }
    if stats.routing_readbacks > 0 {
        println!(
            "  routing readbacks: {} ({:.3} ms each including the GPU work before them)",
            stats.routing_readbacks,
            stats.routing_wait.as_secs_f64() * 1e3 / stats.routing_readbacks as f64
        );
    }
    Ok(())
}

/// Seconds per decoded token over `n` tokens from position `from`, each
/// reading its logits back.
fn decode_per_token(session: &mut Session<'_>, from: usize, mut next: u32, n: usize) -> wgspark::Result<f64> {
    session.truncate(from);
    let start = Instant::now();
    for _ in 0..n {
        next = argmax(&session.step(next, session.position())?);
    }
    Ok(start.elapsed().as_secs_f64() / n as f64)
}

/// Matmul and attention FLOPs of a prefill of `t` tokens (head on the last).
fn prefill_flops(c: &ModelConfig, t: usize) -> f64 {
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
    let t = t as f64;
    let matmul = 2.0 * t * (c.layers as f64 * attn_proj + ffn) + 2.0 * h * c.vocab as f64;
    // q.k and p.v over the causal triangle.
    let attention = c.layers as f64 * 4.0 * (heads.q * heads.dim) as f64 * t * (t + 1.0) / 2.0;
    matmul + attention
}

/// Bytes one decode step reads at position `pos`: every weight it uses
/// (one embedding row; the selected experts of MoE layers) and the KV cache.
fn decode_bytes(c: &ModelConfig, pos: usize) -> u64 {
    let h = c.hidden as u64;
    let heads = c.heads;
    let attn = h * heads.qkv_width() as u64 + (heads.q * heads.dim) as u64 * h;
    let ffn: u64 = (0..c.layers)
        .map(|l| match &c.moe {
            Some(m) if m.sparse_layers[l] => h * m.experts as u64 + 3 * h * (m.intermediate * m.top_k) as u64,
            _ => 3 * h * c.intermediate as u64,
        })
        .sum();
    let weights = 2 * (c.layers as u64 * (attn + 2 * h) + ffn + h + h * c.vocab as u64);
    let kv = 2 * c.layers as u64 * (pos * heads.kv_width()) as u64 * 4;
    weights + kv
}
