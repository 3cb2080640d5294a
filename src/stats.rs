//! What a session observed: how often each layer's router chose each
//! expert, and where the time of a forward pass went.

use std::time::Duration;

/// The three phases a token's GPU work is split into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Embedding, attention, norms, dense FFNs and routers: everything up
    /// to a routing readback.
    Attention,
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

#[derive(Debug, Clone, Default)]
pub struct PhaseTimes {
    pub attention: Duration,
    pub routed: Duration,
    pub head: Duration,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Attention => "attention",
            Phase::Routed => "routed experts",
            Phase::Head => "head",
        }
    }
}

impl PhaseTimes {
    pub fn add(&mut self, phase: Phase, d: Duration) {
        match phase {
            Phase::Attention => self.attention += d,
            Phase::Routed => self.routed += d,
            Phase::Head => self.head += d,
        }
    }
}

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
    pub expert_cache: crate::model::experts::ExpertCacheStats,
    /// Per-phase time, when the session was opened with timing on.
    pub phases: Option<PhaseTimes>,
    /// With [`crate::SessionOptions::time_dispatches`]: the last forward
    /// pass's compute passes in order, each one dispatch (by its kernel's
    /// label) or the phase's, and its GPU time.
    pub last_passes: Vec<(&'static str, std::time::Duration)>,
    pub timing_source: Option<TimingSource>,
}
