//! What a session observed: how often each layer's router chose each
//! expert, and where the time of a forward pass went.

use std::time::Duration;

/// The three phases a token's GPU work is split into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The layers but their routed experts: embedding, attention, norms,
    /// dense FFNs and routers (everything up to a routing readback).
    Layers,
    /// The selected experts of MoE layers and their weighted sum.
    Routed,
    /// Final norm and LM head.
    Head,
}

/// Where phase times come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimingSource {
    /// GPU timestamps written at the start and end of each phase's pass.
    GpuTimestamps,
    /// Host wall clock from submission to completion, with the work
    /// submitted at every phase boundary so phases can be told apart.
    WallClock,
}

/// Time per [`Phase`], summed over the session's forward passes (GPU time
/// or wall clock, as [`Stats::timing_source`] says).
#[derive(Debug, Clone, Default)]
pub struct PhaseTimes {
    /// Time in [`Phase::Layers`].
    pub layers: Duration,
    /// Time in [`Phase::Routed`].
    pub routed: Duration,
    /// Time in [`Phase::Head`].
    pub head: Duration,
}

impl Phase {
    /// The phase's name in reports: "layers", "routed experts" or "head".
    pub fn name(self) -> &'static str {
        match self {
            Phase::Layers => "layers",
            Phase::Routed => "routed experts",
            Phase::Head => "head",
        }
    }
}

impl PhaseTimes {
    /// Adds `d` to `phase`'s time.
    pub fn add(&mut self, phase: Phase, d: Duration) {
        match phase {
            Phase::Layers => self.layers += d,
            Phase::Routed => self.routed += d,
            Phase::Head => self.head += d,
        }
    }
}

/// What a session observed so far ([`crate::Session::stats`]).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// `router_histogram[layer][expert]`: tokens routed to the expert
    /// (empty rows for dense layers). Filled from the routing readbacks.
    pub router_histogram: Vec<Vec<u64>>,
    /// Forward passes run (submissions of one or more tokens).
    pub forward_passes: u64,
    /// Routing readbacks (one per MoE layer per forward pass).
    pub routing_readbacks: u64,
    /// Host time from submitting the work that ends with a router to
    /// having its selection mapped: GPU work plus the round trip.
    pub routing_wait: Duration,
    /// Dispatches of the last one-token forward pass (a decode step).
    pub decode_dispatches: u64,
    /// Host time inside `queue.submit` for the forward passes.
    pub submit_time: Duration,
    /// Residual capture readbacks: one per submission that captured rows,
    /// however many layers it captured.
    pub capture_readbacks: u64,
    /// Expert streaming: the cache's hits, misses and uploads for this
    /// session (zero when every expert is resident).
    pub expert_cache: ExpertCacheStats,
    /// Per-phase time, when the session was opened with timing on.
    pub phases: Option<PhaseTimes>,
    /// With [`crate::SessionOptions::time_dispatches`]: the last forward
    /// pass's compute passes in order, each one dispatch (by its kernel's
    /// label) or the phase's, and its GPU time.
    pub last_passes: Vec<(&'static str, std::time::Duration)>,
    /// Where `phases` come from; `None` when timing is off.
    pub timing_source: Option<TimingSource>,
}

/// How the expert cache served a session (or, summed over all sessions,
/// the model): experts a dispatch found in a slot, experts it had to wait
/// for, and what their uploads took.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertCacheStats {
    /// Experts a dispatch found in a GPU slot (prefetched ones included).
    pub hits: u64,
    /// Experts a dispatch had to upload before it could run.
    pub misses: u64,
    /// Bytes uploaded into expert slots, for misses and prefetches.
    pub bytes_uploaded: u64,
    /// Host time from the first upload of a dispatch's misses (or a
    /// prefetch) to their submission (reading the checkpoint, filling the
    /// staging ring, waiting for a staging buffer to come back).
    pub upload_time: Duration,
    /// Experts uploaded ahead of their dispatch, on a prediction of the
    /// next MoE layer's choice ([`crate::ExpertPrefetch::Predicted`]).
    pub prefetched: u64,
    /// Prefetched experts that their dispatch then needed (counted among
    /// `hits` too).
    pub prefetch_hits: u64,
}

impl ExpertCacheStats {
    /// Adds `other`'s counts and times to these.
    pub fn add(&mut self, other: &ExpertCacheStats) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.bytes_uploaded += other.bytes_uploaded;
        self.upload_time += other.upload_time;
        self.prefetched += other.prefetched;
        self.prefetch_hits += other.prefetch_hits;
    }
}
