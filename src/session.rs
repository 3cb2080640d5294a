//! A decoding session: one sequence's KV cache and the flow's bindings,
//! advanced one position at a time.

use crate::capture::{Capture, CaptureOptions, CapturePlan, PromptRows};
use crate::error::{Error, Result};
use crate::flow::{Activations, ChunkMatmul, PhaseTimer, Plan, Recorder, RoutingMode};
use crate::gpu::Readback;
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::stats::Stats;
use crate::steering::{Steering, SteeringPlan};

/// Default context when the caller gives none: the config's
/// `max_position_embeddings`, capped so that a 128k-context model does not
/// reserve gigabytes of KV cache it may never use.
pub const DEFAULT_CONTEXT_CAP: usize = 8192;

/// Prompt tokens per prefill submission: enough to fill the GEMM's 64-token
/// tiles many times over and read each weight once per 512 tokens.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Positions the KV cache holds. `None`: the config's
    /// `max_position_embeddings`, at most [`DEFAULT_CONTEXT_CAP`].
    pub context_len: Option<usize>,
    /// How MoE layers hand the router's choice to the expert kernels.
    pub routing: RoutingMode,
    /// Prompt tokens per submission in [`Session::prefill`] (default
    /// [`DEFAULT_PREFILL_CHUNK`]; lowered if the activations of a chunk
    /// would not fit one storage binding).
    pub prefill_chunk: Option<usize>,
    /// Which kernel runs the projections of a prompt chunk.
    pub chunk_matmul: ChunkMatmul,
    /// Measure per-phase time (GPU timestamps where the adapter has them,
    /// else wall clock with a submission at every phase boundary).
    pub timing: bool,
}

pub struct Session<'m> {
    model: &'m Model,
    activations: Activations,
    kv: KvCache,
    plan: Plan,
    logits_readback: Readback,
    routing_readback: Readback,
    routing: RoutingMode,
    timer: Option<PhaseTimer>,
    steering: Option<SteeringPlan>,
    capture: Option<CapturePlan>,
    stats: Stats,
    len: usize,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Model, options: &SessionOptions) -> Result<Self> {
        let c = &model.config;
        let context_len = options.context_len.unwrap_or_else(|| c.max_positions.min(DEFAULT_CONTEXT_CAP));
        if context_len == 0 {
            return Err(Error::ContextOverflow { position: 0, context_len });
        }
        let gpu = &model.gpu;
        let kv_bytes = (2 * c.layers * context_len * c.heads.kv_width() * 4) as u64;
        gpu.check_budget(
            &format!("model weights and a KV cache of {context_len} positions"),
            c.weight_bytes() + kv_bytes,
        )?;
        let kv = KvCache::new(gpu, c.layers, c.heads, context_len)?;
        let chunk = Activations::max_chunk(gpu, c, options.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK));
        let chunk_gemm = options.chunk_matmul.uses_gemm(gpu);
        let activations = Activations::new(gpu, c, chunk, context_len, chunk_gemm)?;
        let plan = Plan::new(model, &activations, &kv);
        let logits_readback = Readback::new(gpu, "logits.readback", (c.vocab * 4) as u64);
        let top_k = c.moe.as_ref().map_or(1, |m| m.top_k);
        let routing_readback = Readback::new(gpu, "routing.readback", (chunk * top_k * 4) as u64);
        let moe_layers = c.moe.as_ref().map_or(0, |m| m.sparse_layers.iter().filter(|&&s| s).count());
        // Passes per forward: attention and routed per MoE layer, the rest, the head.
        let timer = options.timing.then(|| PhaseTimer::new(gpu, 2 * moe_layers + 2));
        gpu.check("creating the session")?;
        let stats = Stats {
            router_histogram: vec![Vec::new(); c.layers],
            timing_source: timer.as_ref().map(|t| t.source),
            ..Stats::default()
        };
        Ok(Session {
            model,
            activations,
            kv,
            plan,
            logits_readback,
            routing_readback,
            routing: options.routing,
            timer,
            steering: None,
            capture: None,
            stats,
            len: 0,
        })
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Positions filled so far: the position the next token takes.
    pub fn position(&self) -> usize {
        self.len
    }

    pub fn context_len(&self) -> usize {
        self.kv.context_len
    }

    /// Router histogram, routing readbacks and phase times so far.
    pub fn stats(&self) -> Stats {
        let mut stats = self.stats.clone();
        stats.phases = self.timer.as_ref().map(|t| t.totals.clone());
        stats
    }

    /// Steers every following position (prompt and decode) with
    /// `steering`, or stops steering with `None`. Positions already in the
    /// KV cache keep the steering they were computed with.
    pub fn set_steering(&mut self, steering: Option<&Steering>) -> Result<()> {
        self.steering = match steering {
            Some(s) => Some(s.upload(self.model)?),
            None => None,
        };
        self.rebuild_layer_outputs();
        Ok(())
    }

    /// Starts recording the residual stream at layer outputs (after
    /// steering) for every following submission, or stops with `None`
    /// (rows not yet taken are dropped).
    pub fn set_capture(&mut self, options: Option<&CaptureOptions>) -> Result<()> {
        self.capture = match options {
            Some(o) => {
                Some(CapturePlan::new(self.model, o, self.activations.max_tokens, &self.activations.step)?)
            }
            None => None,
        };
        self.rebuild_layer_outputs();
        Ok(())
    }

    fn rebuild_layer_outputs(&mut self) {
        let (steering, capture) = (self.steering.as_ref(), self.capture.as_ref());
        self.plan.set_layer_outputs(self.model, &self.activations, steering, capture);
    }

    /// The rows captured since capture started or was last taken; `None`
    /// when capture is off.
    pub fn take_capture(&mut self) -> Option<Capture> {
        self.capture.as_mut().map(CapturePlan::take)
    }

    /// Forgets every position from `len` on, so the sequence can continue
    /// from there (the cache rows are overwritten as it does).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Runs `token` at `position` (which must be [`Self::position`]) and
    /// returns the raw next-token logits, `vocab` f32 values.
    pub fn step(&mut self, token: u32, position: usize) -> Result<Vec<f32>> {
        self.check_next(token, position)?;
        self.submit(&[token], true)?;
        self.len += 1;
        self.read_logits()
    }

    /// Runs a prompt from the current position, in chunks of up to
    /// [`Self::prefill_chunk`] tokens, and returns the logits of its last
    /// token (the only position that runs the head).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let end = self.len + tokens.len();
        if end > self.kv.context_len {
            return Err(Error::ContextOverflow { position: end - 1, context_len: self.kv.context_len });
        }
        let vocab = self.model.config.vocab;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange { token: bad, vocab });
        }
        let chunks: Vec<&[u32]> = tokens.chunks(self.activations.max_tokens).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            // Queue writes land between submissions in order, so chunks need
            // no wait between them: the GPU runs them back to back.
            let last = i + 1 == chunks.len();
            self.submit(chunk, last)?;
            self.len += chunk.len();
        }
        self.read_logits()
    }

    /// Most prompt tokens one prefill submission carries.
    pub fn prefill_chunk(&self) -> usize {
        self.activations.max_tokens
    }

    fn check_next(&self, token: u32, position: usize) -> Result<()> {
        let vocab = self.model.config.vocab;
        if token as usize >= vocab {
            return Err(Error::TokenOutOfRange { token, vocab });
        }
        if position != self.len {
            return Err(Error::NonSequentialPosition { expected: self.len, got: position });
        }
        if position >= self.kv.context_len {
            return Err(Error::ContextOverflow { position, context_len: self.kv.context_len });
        }
        Ok(())
    }

    fn read_logits(&self) -> Result<Vec<f32>> {
        let bytes = (self.model.config.vocab * 4) as u64;
        self.logits_readback.read(&self.model.gpu, bytes)
    }

    fn submit(&mut self, tokens: &[u32], with_head: bool) -> Result<()> {
        let gpu = &self.model.gpu;
        self.activations.write_step(gpu, tokens, self.len);
        let mut rec = Recorder::new(gpu, self.timer.as_mut());
        let mut routing = crate::flow::moe::RoutingContext {
            mode: self.routing,
            readback: &self.routing_readback,
            moe: self.activations.moe.as_ref(),
        };
        let n_tokens = tokens.len() as u32;
        self.plan.forward(&mut rec, &self.activations, n_tokens, with_head, &mut routing, &mut self.stats)?;
        if with_head {
            let bytes = (self.model.config.vocab * 4) as u64;
            self.logits_readback.record(rec.encoder(), &self.activations.logits, 0, bytes);
        }
        // Every submission writes the captured layers' rows; they are read
        // back for the decoded token and the prompt's last position, and
        // for earlier prompt chunks when every prompt row is asked for.
        let capture = self.capture.as_ref().filter(|c| with_head || c.prompt_rows == PromptRows::All);
        let captured_rows = capture.map(|c| {
            let rows = c.rows_for(tokens.len());
            c.record_readback(rec.encoder(), rows);
            rows
        });
        rec.finish()?;
        if let (Some(rows), Some(c)) = (captured_rows, self.capture.as_mut()) {
            c.read(gpu, rows, self.len + tokens.len() - rows)?;
            self.stats.capture_readbacks += 1;
        }
        Ok(())
    }
}
