//! A long run: thousands of decoded tokens on a MoE model with readback
//! routing and a small context, so that generation fills it again and
//! again and the session is truncated and continued; steering and capture
//! are switched on and off along the way. Host memory (resident set) and,
//! where the backend reports it, GPU allocation must stay flat after the
//! first passes, and no step may fail.
//!
//! `WGSPARK_SOAK_TOKENS=N` sets the tokens decoded (default: a short run).

mod common;

use common::checkpoint::fixture_dir;
use wgspark::{
    CaptureOptions, ControlVector, GenerateOptions, Model, RoutingMode, SessionOptions, Steering, StopReason,
};

/// Resident host memory in bytes (Linux), else 0.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// Growth allowed after the warm-up: allocator noise, not a leak per token.
const SLACK_BYTES: u64 = 24 << 20;
const GPU_SLACK_BYTES: u64 = 64 << 10;

#[test]
fn thousands_of_tokens_keep_memory_flat() {
    let tokens: usize =
        std::env::var("WGSPARK_SOAK_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(1200);
    let gpu = common::gpu(common::backends()[0]);
    let model = Model::load(fixture_dir("mixtral_deep"), &gpu).unwrap();
    let vector = ControlVector::load(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering/mixtral_deep/llama_cpp.gguf"),
    )
    .unwrap();
    let steering = Steering::new(&model.config, &[(vector, 0.5)], None).unwrap();
    let options =
        SessionOptions { context_len: Some(48), routing: RoutingMode::Readback, ..Default::default() };
    let mut session = model.session(&options).unwrap();
    let generate = GenerateOptions { max_tokens: 1000, ..Default::default() };

    let mut prompt: Vec<u32> = vec![1, 5, 9, 13];
    let (mut decoded, mut refills, mut round) = (0usize, 0usize, 0usize);
    let mut baseline: Option<(u64, Option<u64>)> = None;
    let mut last_measure = baseline;
    let gpu_bytes = || gpu.device.generate_allocator_report().map(|r| r.total_allocated_bytes);
    while decoded < tokens {
        // Steering and capture on and off, in turns.
        session.set_steering(if round % 2 == 0 { Some(&steering) } else { None }).unwrap();
        let capture = (round % 3 == 0).then(CaptureOptions::default);
        session.set_capture(capture.as_ref()).unwrap();
        let mut generation = session.generate(&prompt, &generate).unwrap();
        let mut last = Vec::new();
        for id in generation.by_ref() {
            last.push(id.unwrap());
        }
        assert_eq!(generation.stop_reason(), Some(StopReason::ContextFull));
        drop(generation);
        decoded += last.len();
        let _ = session.take_capture();
        // Keep the last few positions and continue from the last ids.
        session.truncate(8);
        prompt = last[last.len().saturating_sub(4)..].to_vec();
        refills += 1;
        round += 1;
        gpu.check("soak").unwrap();
        // Measured in the same phase of the steering and capture turns.
        if round % 6 == 0 {
            let now = (resident_bytes(), gpu_bytes());
            if baseline.is_none() && decoded >= tokens / 5 {
                baseline = Some(now);
            }
            last_measure = Some(now);
        }
    }
    let (host0, gpu0) = baseline.expect("a baseline after the warm-up");
    let (host1, gpu1) = last_measure.unwrap();
    eprintln!(
        "{decoded} tokens in {refills} refills of a 48-position context: resident {:.1} -> {:.1} MB, \
         GPU allocation {gpu0:?} -> {gpu1:?} bytes",
        host0 as f64 / 1e6,
        host1 as f64 / 1e6
    );
    assert!(host1 <= host0 + SLACK_BYTES, "host memory grew from {host0} to {host1} bytes");
    if let (Some(a), Some(b)) = (gpu0, gpu1) {
        assert!(b <= a + GPU_SLACK_BYTES, "GPU allocation grew from {a} to {b} bytes");
    }
}
