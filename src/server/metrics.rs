//! What `/metrics` reports, in Prometheus' text format: requests by path
//! and status, prompt and generated tokens, latency histograms, and the
//! engine's sequences and KV blocks as of its last step.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::batch::BatchStats;

/// Upper bounds (seconds) of the time-to-first-token buckets.
const FIRST_TOKEN_BUCKETS: [f64; 13] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds (seconds) of the time-between-tokens buckets.
const NEXT_TOKEN_BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// A Prometheus histogram: counts per bucket (not cumulative), sum, count.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// One count per bound, then the count above the last.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0 }
    }

    fn observe(&mut self, seconds: f64) {
        let bucket = self.bounds.iter().position(|&b| seconds <= b).unwrap_or(self.bounds.len());
        self.counts[bucket] += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            total += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {total}");
        }
        total += self.counts[self.bounds.len()];
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {total}\n{name}_sum {}\n{name}_count {total}",
            self.sum
        );
    }
}

/// The server's counters; the GPU thread and the handlers update them.
#[derive(Debug)]
pub(crate) struct Metrics {
    /// Requests answered, by (route, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    first_token: Mutex<Histogram>,
    next_token: Mutex<Histogram>,
    /// Requests admitted and not answered yet (running or queued).
    pub admitted: AtomicUsize,
    engine: Mutex<BatchStats>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            first_token: Mutex::new(Histogram::new(&FIRST_TOKEN_BUCKETS)),
            next_token: Mutex::new(Histogram::new(&NEXT_TOKEN_BUCKETS)),
            admitted: AtomicUsize::new(0),
            engine: Mutex::default(),
        }
    }
}

/// A lock whose holder panicked still guards plain counters.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    pub fn count_request(&self, route: &str, status: u16) {
        *lock(&self.requests).entry((route.to_string(), status)).or_default() += 1;
    }

    pub fn add_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A sequence's first token, `latency` after its request arrived.
    pub fn observe_first_token(&self, latency: Duration) {
        self.generated_tokens.fetch_add(1, Ordering::Relaxed);
        lock(&self.first_token).observe(latency.as_secs_f64());
    }

    /// A later token, `latency` after the sequence's one before.
    pub fn observe_next_token(&self, latency: Duration) {
        self.generated_tokens.fetch_add(1, Ordering::Relaxed);
        lock(&self.next_token).observe(latency.as_secs_f64());
    }

    /// The engine's state after a step.
    pub fn set_engine(&self, stats: BatchStats) {
        *lock(&self.engine) = stats;
    }

    /// The engine's state as of its last step.
    pub fn engine(&self) -> BatchStats {
        lock(&self.engine).clone()
    }

    /// Everything, in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP wgspark_requests_total HTTP requests answered, by route and status.\n\
             # TYPE wgspark_requests_total counter"
        );
        for ((route, status), count) in lock(&self.requests).iter() {
            let _ = writeln!(out, "wgspark_requests_total{{route=\"{route}\",status=\"{status}\"}} {count}");
        }
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, value: usize| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}");
        };
        let prompt = self.prompt_tokens.load(Ordering::Relaxed);
        counter(&mut out, "wgspark_prompt_tokens_total", "Prompt tokens of the requests admitted.", prompt);
        let generated = self.generated_tokens.load(Ordering::Relaxed);
        counter(&mut out, "wgspark_generated_tokens_total", "Tokens generated.", generated);
        lock(&self.first_token).render(
            &mut out,
            "wgspark_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        lock(&self.next_token).render(
            &mut out,
            "wgspark_time_per_output_token_seconds",
            "Time between a sequence's consecutive tokens.",
        );
        let e = self.engine();
        let admitted = self.admitted.load(Ordering::Relaxed);
        gauge(&mut out, "wgspark_requests_admitted", "Requests admitted and not yet answered.", admitted);
        gauge(&mut out, "wgspark_sequences_running", "Sequences in the engine's steps.", e.running);
        gauge(&mut out, "wgspark_sequences_queued", "Sequences waiting for room in the engine.", e.waiting);
        gauge(&mut out, "wgspark_kv_blocks_used", "KV blocks held by sequences.", e.blocks_used);
        let free = e.blocks_total - e.blocks_used;
        gauge(&mut out, "wgspark_kv_blocks_free", "KV blocks no sequence holds.", free);
        gauge(&mut out, "wgspark_kv_blocks_cached", "KV blocks kept for prefix reuse.", e.blocks_cached);
        counter(
            &mut out,
            "wgspark_prefix_cache_hits_total",
            "Prompt blocks taken from the prefix cache.",
            e.prefix_hits,
        );
        counter(
            &mut out,
            "wgspark_prefix_cache_lookups_total",
            "Prompt blocks looked for in the prefix cache.",
            e.prefix_lookups,
        );
        counter(&mut out, "wgspark_steps_total", "Forward passes the engine ran.", e.steps);
        out
    }
}
