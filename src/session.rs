//! A decoding session: one sequence's KV cache and the flow's bindings,
//! advanced one position at a time ([`Session::step`], which hands the
//! logits back) or generating with the next token chosen on the GPU and
//! several steps in flight ([`Session::generate`]).

use std::collections::VecDeque;

use crate::capture::{Capture, CaptureOptions, CapturePlan, PromptRows};
use crate::error::{Error, Result};
use crate::flow::moe::{ExpertPrefetch, RoutingContext};
use crate::flow::{
    Activations, ChunkMatmul, ChunkMedia, Head, KvLayout, PhaseTimer, Plan, Recorder, RoutingMode,
    first_value_row_apart,
};
use crate::gpu::{MapWait, Readback};
use crate::kernels::gemm::{Gemm, PrefillPrecision};
use crate::kv_cache::{KvCache, KvFormat};
use crate::model::Model;
use crate::multimodal::{PreparedPrompt, PromptPart, SlotPositions};
use crate::sampling::Sampling;
use crate::stats::Stats;
use crate::steering::{Steering, SteeringPlan};

/// Default context when the caller gives none: the config's
/// `max_position_embeddings`, capped so that a 128k-context model does not
/// reserve gigabytes of KV cache it may never use.
pub const DEFAULT_CONTEXT_CAP: usize = 8192;

/// Prompt tokens per prefill submission: each weight is read once per
/// chunk, and a chunk's attention runs its keys once for all its rows;
/// the products of a longer chunk fill the last wave of workgroups better.
/// A chunk of 4096 holds about 680 MB of the Llama-3.1-8B shape's
/// activations; a device whose storage
/// bindings cannot hold a chunk's widest activations gets shorter chunks.
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;

/// Decode steps [`Session::generate`] keeps submitted ahead of the ids it
/// has read: the host records step N + 1 while the GPU runs step N.
pub const DEFAULT_IN_FLIGHT: usize = 3;

/// The most decode steps [`GenerateOptions::in_flight`] keeps in flight
/// (a larger value runs as this many).
pub const MAX_IN_FLIGHT: usize = 64;

/// How a session is opened ([`crate::Model::session`]): its context, how
/// MoE layers route, how prompts run, how the KV cache stores values, and
/// whether time is measured. The default suits generation.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Positions the KV cache holds. `None`: the config's
    /// `max_position_embeddings`, at most [`DEFAULT_CONTEXT_CAP`].
    pub context_len: Option<usize>,
    /// How MoE layers hand the router's choice to the expert kernels.
    pub routing: RoutingMode,
    /// Whether a decode step uploads the streamed experts it predicts the
    /// next MoE layer will choose while this layer's experts run (off
    /// unless asked for: see [`ExpertPrefetch`]).
    pub expert_prefetch: ExpertPrefetch,
    /// Prompt tokens per submission in [`Session::prefill`] (default
    /// [`DEFAULT_PREFILL_CHUNK`]; lowered to the context, and if the
    /// activations of a chunk would not fit one storage binding; 0 is an
    /// error).
    pub prefill_chunk: Option<usize>,
    /// Which kernel runs the projections of a prompt chunk.
    pub chunk_matmul: ChunkMatmul,
    /// How the chunk GEMM rounds its operands on cooperative matrices.
    pub prefill_precision: PrefillPrecision,
    /// How the KV cache stores K and V (f16 unless asked otherwise).
    pub kv_format: KvFormat,
    /// Measure per-phase time (GPU timestamps where the adapter has them,
    /// else wall clock with a submission at every phase boundary). Each
    /// submission is then waited for.
    pub timing: bool,
    /// With `timing` on an adapter with GPU timestamps: every dispatch in a
    /// compute pass of its own, timed ([`Stats::last_passes`]), for
    /// profiling (the extra passes cost some time of their own).
    pub time_dispatches: bool,
}

/// Passes timed per forward pass with [`SessionOptions::time_dispatches`]
/// (two timestamps each, wgpu's most per query set; the passes past it go
/// untimed).
pub(crate) const MAX_TIMED_PASSES: usize = 2048;

/// How [`Session::generate`] chooses and stops.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// How each next token is chosen (default greedy).
    pub sampling: Sampling,
    /// Seeds the draws of [`Sampling::Random`]; a seed gives the same
    /// tokens on the same backend and adapter.
    pub seed: u64,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Generation stops after yielding any of these (end-of-sequence ids).
    pub stop_tokens: Vec<u32>,
    /// Decode steps submitted ahead of the ids read (at least 1, at most
    /// [`MAX_IN_FLIGHT`] and the tokens asked for).
    pub in_flight: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            sampling: Sampling::Greedy,
            seed: 0,
            max_tokens: 128,
            stop_tokens: Vec::new(),
            in_flight: DEFAULT_IN_FLIGHT,
        }
    }
}

/// Why a [`Generation`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` were generated.
    MaxTokens,
    /// One of the stop tokens was generated (and yielded).
    StopToken(u32),
    /// The KV cache is full.
    ContextFull,
    /// The caller ended it ([`Generation::cancel`], or dropping it).
    Cancelled,
    /// A step failed; its error was yielded.
    Failed,
}

/// One sequence on a model: its KV cache, its position, and the buffers
/// its forward passes run in. Opened by [`crate::Model::session`]; a model
/// may have several sessions, each with a cache of its own.
pub struct Session<'m> {
    model: &'m Model,
    activations: Activations,
    kv: KvCache,
    plan: Plan,
    logits_readback: Readback,
    routing_readback: Readback,
    expert_prefetch: ExpertPrefetch,
    /// Where generated ids come back, one slot per step in flight.
    id_readbacks: Vec<Readback>,
    /// The token selection the plan was built with.
    sampling: Option<(Sampling, u64)>,
    routing: RoutingMode,
    timer: Option<PhaseTimer>,
    steering: Option<SteeringPlan>,
    capture: Option<CapturePlan>,
    stats: Stats,
    len: usize,
    /// Each cache slot's position, as its rotary row rotates it.
    positions: SlotPositions,
    /// What runs a chunk's projections, and an image's in the vision tower:
    /// the GEMM, or the GEMV where `None`.
    gemm: Option<Gemm>,
    /// Where a split model's residual rows leave this device, and the
    /// devices after it (none: the model is on one device).
    split: Option<(Readback, Vec<SessionPart<'m>>)>,
}

/// A device after the first of a model split across several
/// ([`crate::Model::load_split`]): its layers' activations, KV cache and
/// plan, and where its residual rows (or, on the last, its logits) leave it.
struct SessionPart<'m> {
    model: &'m Model,
    flow: DeviceFlow,
    out: Readback,
    /// The steering of its layers.
    steering: Option<SteeringPlan>,
    /// The capture of its layers.
    capture: Option<CapturePlan>,
}

/// What a session keeps on each device for the layers it holds: their KV
/// cache, the chunk GEMM, the activations and plan, and where MoE routing
/// comes back.
struct DeviceFlow {
    kv: KvCache,
    gemm: Option<Gemm>,
    activations: Activations,
    plan: Plan,
    routing_readback: Readback,
}

impl DeviceFlow {
    /// The flow of `model`'s layers on its device for a cache of
    /// `context_len` positions and chunks of `chunk` tokens, once the
    /// device's budget (named `what`) holds them.
    fn new(
        model: &Model,
        options: &SessionOptions,
        (context_len, chunk): (usize, usize),
        what: &str,
    ) -> Result<Self> {
        let (gpu, c) = (&model.gpu, &model.config);
        let kv_bytes = KvCache::bytes(model.layers().len(), c.heads, context_len, options.kv_format);
        gpu.check_budget(what, model.weights.bytes().saturating_add(kv_bytes))?;
        let kv = KvCache::new(gpu, model.layers().len(), c.heads, context_len, options.kv_format)?;
        let gemm = options.chunk_matmul.gemm(gpu, options.prefill_precision)?;
        let values_apart =
            model.weights.layers.iter().any(|l| first_value_row_apart(&l.qkv, c.heads).is_some());
        let half_copies = gemm.as_ref().is_some_and(|g| g.keeps_half_copies());
        let scratch = crate::flow::GemmScratch::new(model, gemm.as_ref(), chunk);
        let layout = (values_apart, gemm.is_some(), half_copies);
        let activations = Activations::new(gpu, c, (chunk, scratch), context_len, layout)?;
        let kv_layout = KvLayout::Contiguous(&kv);
        let plan = Plan::new(model, &activations, gemm.as_ref(), options.prefill_precision, kv_layout)?;
        let top_k = c.moe.as_ref().map_or(1, |m| m.top_k);
        // A chunk's choices, or one token's and its prediction of the next layer's.
        let routing_readback = Readback::new(gpu, "routing.readback", (chunk.max(2) * top_k * 4) as u64);
        Ok(DeviceFlow { kv, gemm, activations, plan, routing_readback })
    }
}

impl<'m> SessionPart<'m> {
    fn new(model: &'m Model, options: &SessionOptions, (context_len, chunk): (usize, usize)) -> Result<Self> {
        let what = format!("layers {:?} and their KV cache of {context_len} positions", model.layers());
        let flow = DeviceFlow::new(model, options, (context_len, chunk), &what)?;
        let c = &model.config;
        let out_bytes = (chunk * c.hidden).max(c.vocab) * 4;
        let out = Readback::new(&model.gpu, "part.out", out_bytes as u64);
        Ok(SessionPart { model, flow, out, steering: None, capture: None })
    }
}

impl<'m> Session<'m> {
    /// Opens a session on `model` (as [`crate::Model::session`] does), its
    /// KV cache and activations allocated for the whole context. Fails with
    /// [`Error::InvalidContext`] for a context of 0,
    /// [`Error::InvalidPrefillChunk`] for chunks of 0,
    /// [`Error::OutOfDeviceMemory`] where the weights and the cache exceed
    /// the device's budget or memory, and [`Error::Unsupported`] for
    /// device-resident routing of streamed experts.
    pub fn new(model: &'m Model, options: &SessionOptions) -> Result<Self> {
        let c = &model.config;
        let context_len = options.context_len.unwrap_or_else(|| c.max_positions.min(DEFAULT_CONTEXT_CAP));
        if context_len == 0 {
            return Err(Error::InvalidContext {
                context_len,
                reason: "a session needs at least one position (SessionOptions::context_len, --context)"
                    .into(),
            });
        }
        if options.prefill_chunk == Some(0) {
            return Err(Error::InvalidPrefillChunk);
        }
        let gpu = &model.gpu;
        if let (Some(experts), RoutingMode::DeviceResident) = (model.streamed_experts(), options.routing) {
            return Err(Error::Unsupported {
                what: "device-resident routing with streamed experts (the host places each dispatch's experts)",
                value: format!(
                    "{} GPU slots per MoE layer of {} experts",
                    experts.slots,
                    model.config.moe.as_ref().map_or(0, |m| m.experts)
                ),
            });
        }
        // No prompt chunk is longer than the context.
        let wanted = options.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK).min(context_len);
        let chunk = Activations::max_chunk(gpu, c, wanted);
        let what = format!("model weights and a KV cache of {context_len} positions");
        let DeviceFlow { kv, gemm, activations, plan, routing_readback } =
            DeviceFlow::new(model, options, (context_len, chunk), &what)?;
        let logits_readback = Readback::new(gpu, "logits.readback", (c.vocab * 4) as u64);
        let moe_layers = c.moe.as_ref().map_or(0, |m| m.sparse_layers.iter().filter(|&&s| s).count());
        // Passes per forward: attention and routed per MoE layer, the rest,
        // the head; or, timing dispatches, at most MAX_TIMED_PASSES.
        let passes = if options.time_dispatches { MAX_TIMED_PASSES } else { 2 * moe_layers + 2 };
        let timer = options.timing.then(|| PhaseTimer::new(gpu, passes, options.time_dispatches));
        let split = match model.next_parts() {
            [] => None,
            parts => {
                if options.timing {
                    return Err(Error::Unsupported {
                        what: "timed sessions of a model split across devices",
                        value: format!("{} devices", parts.len() + 1),
                    });
                }
                let parts = parts
                    .iter()
                    .map(|part| SessionPart::new(part, options, (context_len, chunk)))
                    .collect::<Result<Vec<_>>>()?;
                Some((Readback::new(gpu, "rows.readback", (chunk * c.hidden * 4) as u64), parts))
            }
        };
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
            id_readbacks: Vec::new(),
            sampling: None,
            routing: options.routing,
            expert_prefetch: options.expert_prefetch,
            timer,
            steering: None,
            capture: None,
            stats,
            len: 0,
            positions: SlotPositions::new(context_len),
            gemm,
            split,
        })
    }

    /// The model the session runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Positions filled so far: the position the next token takes.
    pub fn position(&self) -> usize {
        self.len
    }

    /// Positions the KV cache holds: the longest the sequence may grow.
    pub fn context_len(&self) -> usize {
        self.kv.context_len
    }

    /// How the KV cache stores K and V.
    pub fn kv_format(&self) -> KvFormat {
        self.kv.format
    }

    /// Router histogram, routing readbacks, dispatches and phase times so far.
    pub fn stats(&self) -> Stats {
        let mut stats = self.stats.clone();
        stats.phases = self.timer.as_ref().map(|t| t.totals.clone());
        stats.last_passes = self.timer.as_ref().map(|t| t.last_passes.clone()).unwrap_or_default();
        stats
    }

    /// Steers every following position (prompt and decode) with
    /// `steering`, or stops steering with `None`. Positions already in the
    /// KV cache keep the steering they were computed with.
    pub fn set_steering(&mut self, steering: Option<&Steering>) -> Result<()> {
        self.steering = steering.map(|s| s.upload(self.model)).transpose()?;
        for part in self.split.iter_mut().flat_map(|(_, parts)| parts) {
            part.steering = steering.map(|s| s.upload(part.model)).transpose()?;
        }
        self.rebuild_layer_outputs()
    }

    /// Starts recording the residual stream at layer outputs (after
    /// steering) for every following submission, or stops with `None`
    /// (rows not yet taken are dropped).
    pub fn set_capture(&mut self, options: Option<&CaptureOptions>) -> Result<()> {
        let plan = |model, act: &Activations| match options {
            Some(o) => CapturePlan::new(model, o, act.max_tokens, &act.step).map(Some),
            None => Ok(None),
        };
        self.capture = plan(self.model, &self.activations)?;
        for part in self.split.iter_mut().flat_map(|(_, parts)| parts) {
            part.capture = plan(part.model, &part.flow.activations)?;
        }
        self.rebuild_layer_outputs()
    }

    fn rebuild_layer_outputs(&mut self) -> Result<()> {
        let (steering, capture) = (self.steering.as_ref(), self.capture.as_ref());
        self.plan.set_layer_outputs(self.model, &self.activations, self.gemm.as_ref(), steering, capture)?;
        for part in self.split.iter_mut().flat_map(|(_, parts)| parts) {
            let (flow, steering, capture) = (&mut part.flow, part.steering.as_ref(), part.capture.as_ref());
            flow.plan.set_layer_outputs(
                part.model,
                &flow.activations,
                flow.gemm.as_ref(),
                steering,
                capture,
            )?;
        }
        Ok(())
    }

    /// The rows captured since capture started or was last taken; `None`
    /// when capture is off.
    pub fn take_capture(&mut self) -> Option<Capture> {
        let parts = self.split.iter_mut().flat_map(|(_, parts)| parts).filter_map(|p| p.capture.as_mut());
        CapturePlan::take_all(self.capture.as_mut().into_iter().chain(parts))
    }

    /// Forgets every position from `len` on, so the sequence can continue
    /// from there (the cache rows are overwritten as it does).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        self.positions.truncate(&self.model.gpu, &self.activations, &self.model.config, self.len);
    }

    /// Runs `token` at `position` (which must be [`Self::position`]) and
    /// returns the raw next-token logits, `vocab` f32 values.
    pub fn step(&mut self, token: u32, position: usize) -> Result<Vec<f32>> {
        self.check_next(token, position)?;
        self.submit(Some(&[token]), 1, Head::Logits, None, None)?;
        self.read_logits()
    }

    /// Runs a prompt from the current position, in chunks of up to
    /// [`Self::prefill_chunk`] tokens, and returns the logits of its last
    /// token (the only position that runs the head).
    ///
    /// Prefilling, then stepping with a host sampler:
    /// ```no_run
    /// use wgspark::{Gpu, Model, Sampler, Sampling, SessionOptions};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = Gpu::from_env()?;
    /// let model = Model::load("path/to/model", &gpu)?;
    /// let tokenizer = model.tokenizer()?.ok_or("the model has no tokenizer")?;
    /// let mut session = model.session(&SessionOptions::default())?;
    /// let prompt = tokenizer.encode_prompt("The capital of France is")?;
    /// let mut logits = session.prefill(&prompt)?; // `vocab` raw f32 logits
    /// let sampling = Sampling::Random { temperature: 0.7, top_k: Some(40), top_p: None };
    /// let mut sampler = Sampler::new(sampling, 1)?;
    /// let mut ids = Vec::new();
    /// for _ in 0..16 {
    ///     let next = sampler.sample(&logits);
    ///     if model.config.eos_token_ids.contains(&next) {
    ///         break;
    ///     }
    ///     ids.push(next);
    ///     logits = session.step(next, session.position())?;
    /// }
    /// println!("{}", tokenizer.decode(&ids, true)?);
    /// # Ok(()) }
    /// ```
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.prefill_multimodal(&[PromptPart::Text(tokens)])
    }

    /// [`Self::prefill`] of a prompt of text and images (Qwen3-VL): each
    /// image through the vision tower, standing in the prompt as one
    /// `image_token_id` token per merged row of it.
    pub fn prefill_multimodal(&mut self, parts: &[PromptPart<'_>]) -> Result<Vec<f32>> {
        self.run_prompt(parts, Head::Logits, None)?;
        self.read_logits()
    }

    /// Runs `prompt` from the current position and generates from it, the
    /// next token chosen on the GPU: the first from the prompt's logits,
    /// each next from the step that takes the previous. Ids stream from the
    /// returned iterator as they are read back, while further steps run;
    /// when it stops (a stop token, `max_tokens`, the end of the context,
    /// or the caller's cancel) the steps computed past the stop are
    /// dropped and the position is left after the last token fed (the
    /// last id yielded is not yet in the cache).
    ///
    /// ```no_run
    /// use wgspark::{GenerateOptions, Gpu, Model, SessionOptions};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = Gpu::from_env()?;
    /// let model = Model::load("path/to/model", &gpu)?;
    /// let mut session = model.session(&SessionOptions::default())?;
    /// let options = GenerateOptions {
    ///     max_tokens: 32,
    ///     stop_tokens: model.config.eos_token_ids.clone(),
    ///     ..GenerateOptions::default() // greedy, 3 steps in flight
    /// };
    /// let mut generation = session.generate(&[1, 2, 3], &options)?;
    /// let ids: Vec<u32> = generation.by_ref().collect::<wgspark::Result<_>>()?;
    /// println!("{:?} after {} ids", generation.stop_reason(), ids.len());
    /// drop(generation);
    /// // The sequence goes on from the last id, which is not yet in the cache.
    /// let last = *ids.last().ok_or("no id was generated")?;
    /// let logits = session.step(last, session.position())?;
    /// # Ok(()) }
    /// ```
    pub fn generate(&mut self, prompt: &[u32], options: &GenerateOptions) -> Result<Generation<'_, 'm>> {
        self.generate_multimodal(&[PromptPart::Text(prompt)], options)
    }

    /// [`Self::generate`] from a prompt of text and images (see
    /// [`Self::prefill_multimodal`]).
    pub fn generate_multimodal(
        &mut self,
        prompt: &[PromptPart<'_>],
        options: &GenerateOptions,
    ) -> Result<Generation<'_, 'm>> {
        options.sampling.validate()?;
        if options.max_tokens == 0 {
            return Err(Error::InvalidSampling("max_tokens must be at least 1".into()));
        }
        let key = (options.sampling, options.seed);
        if self.sampling != Some(key) {
            // A split samples on its last device, which holds the head.
            match self.split.as_mut().and_then(|(_, parts)| parts.last_mut()) {
                Some(last) => last.flow.plan.set_sampling(
                    last.model,
                    &last.flow.activations,
                    options.sampling,
                    options.seed,
                )?,
                None => {
                    self.plan.set_sampling(self.model, &self.activations, options.sampling, options.seed)?
                }
            }
            self.sampling = Some(key);
        }
        // More steps in flight than it will take, or than MAX_IN_FLIGHT,
        // would only hold readback buffers.
        let depth = options.in_flight.clamp(1, options.max_tokens.min(MAX_IN_FLIGHT));
        while self.id_readbacks.len() < depth + 1 {
            let slot = Readback::new(&self.model.gpu, "generated_id.readback", 4);
            self.id_readbacks.push(slot);
        }
        if let Some(capture) = self.capture.as_mut() {
            capture.ensure_slots(&self.model.gpu, self.id_readbacks.len());
        }
        let first = self.run_prompt(prompt, Head::Sample, Some(0))?;
        let prompt_end = self.len;
        // A step takes the id yielded before it: the last id needs no step.
        let steps = (options.max_tokens - 1).min(self.kv.context_len - prompt_end);
        Ok(Generation {
            session: self,
            max_tokens: options.max_tokens,
            stop_tokens: options.stop_tokens.clone(),
            depth,
            prompt_end,
            steps,
            submitted: 0,
            yielded: 0,
            in_flight: VecDeque::from([(0, first)]),
            next_slot: 1,
            stopped: None,
        })
    }

    /// Most prompt tokens one prefill submission carries.
    pub fn prefill_chunk(&self) -> usize {
        self.activations.max_tokens
    }

    /// Runs a prompt in chunks; the last one ends with `head`. Returns its
    /// submission.
    fn run_prompt(
        &mut self,
        parts: &[PromptPart<'_>],
        head: Head,
        id_slot: Option<usize>,
    ) -> Result<wgpu::SubmissionIndex> {
        let vocab = self.model.config.vocab;
        let media = &self.model.config.media_token_ids;
        let mut at = self.len;
        for part in parts {
            match part {
                PromptPart::Text(tokens) => {
                    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
                        return Err(Error::TokenOutOfRange { token: bad, vocab });
                    }
                    if let Some(i) = tokens.iter().position(|t| media.contains(t)) {
                        return Err(Error::Unsupported {
                            what: "image or video placeholder in a prompt of token ids",
                            value: format!("token {} at prompt position {}", tokens[i], at + i),
                        });
                    }
                    at += tokens.len();
                }
                PromptPart::Image(_) => {}
            }
        }
        let images = parts.iter().any(|p| matches!(p, PromptPart::Image(_)));
        let prompt = match images {
            true => {
                PreparedPrompt::new(self.model, parts, self.positions.next(self.len), self.gemm.as_ref())?
            }
            false => PreparedPrompt::text(parts),
        };
        let tokens = &prompt.ids;
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let end = self.len + tokens.len();
        if end > self.kv.context_len {
            return Err(Error::ContextOverflow { position: end - 1, context_len: self.kv.context_len });
        }
        if images {
            let (gpu, c) = (&self.model.gpu, &self.model.config);
            self.positions.place_prompt(gpu, &self.activations, c, self.len, &prompt.positions);
        }
        let size = self.activations.max_tokens;
        let ranges: Vec<_> =
            (0..tokens.len().div_ceil(size)).map(|i| i * size..((i + 1) * size).min(tokens.len())).collect();
        if self.split.is_some() && !images {
            return self.submit_split(Some(tokens), &ranges, head, id_slot, false);
        }
        let chunks = ranges.len();
        let mut last = None;
        for (i, range) in ranges.into_iter().enumerate() {
            let media = match images {
                true => Some((
                    prompt.chunk_media(self.model, &self.activations, range.clone())?,
                    &prompt.positions[range.clone()],
                )),
                false => None,
            };
            // Queue writes land between submissions in order, so chunks need
            // no wait between them: the GPU runs them back to back.
            let (head, slot) = if i + 1 == chunks { (head, id_slot) } else { (Head::None, None) };
            last = Some(self.submit(
                Some(&tokens[range.clone()]),
                range.len(),
                head,
                slot,
                media.as_ref().map(|(m, p)| (m, *p)),
            )?);
        }
        Ok(last.expect("a prompt has at least one chunk"))
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

    /// The last position's logits; a value that is not a finite number
    /// (NaN or overflowed activations) is an error rather than a row to use.
    fn read_logits(&self) -> Result<Vec<f32>> {
        let bytes = (self.model.config.vocab * 4) as u64;
        let logits: Vec<f32> = match &self.split {
            Some((_, parts)) => {
                let last = parts.last().expect("a split has a device after the first");
                last.out.read(&last.model.gpu, bytes)?
            }
            None => self.logits_readback.read(&self.model.gpu, bytes)?,
        };
        if let Some(token) = logits.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFiniteLogits { position: self.len - 1, token, value: logits[token] });
        }
        Ok(logits)
    }

    /// Records and submits the forward pass of `n_tokens` tokens at the
    /// current position (`tokens`: their ids; `None`: the id the GPU chose
    /// last, already in place), ending with `head`; with `id_slot`, the
    /// chosen id is copied to that readback slot and its map started.
    /// Advances the position.
    fn submit(
        &mut self,
        tokens: Option<&[u32]>,
        n_tokens: usize,
        head: Head,
        id_slot: Option<usize>,
        media: Option<(&ChunkMedia<'_>, &[[u32; 3]])>,
    ) -> Result<wgpu::SubmissionIndex> {
        if self.split.is_some() {
            return self.submit_split(
                tokens,
                std::slice::from_ref(&(0..n_tokens)),
                head,
                id_slot,
                media.is_some(),
            );
        }
        let gpu = &self.model.gpu;
        let act = &self.activations;
        if let Some(tokens) = tokens {
            act.write_tokens(gpu, tokens);
        }
        let step = act.write_step(gpu, self.len, n_tokens, &self.model.config);
        let mut rec = Recorder::new(gpu, self.timer.as_mut(), &mut self.stats);
        let routing = RoutingContext {
            mode: self.routing,
            readback: &self.routing_readback,
            experts: self.model.experts.as_ref(),
            prefetch: self.expert_prefetch,
        };
        self.plan.forward(&mut rec, act, &step, head, &routing, media.map(|(m, _)| m))?;
        if head == Head::Logits {
            let bytes = (self.model.config.vocab * 4) as u64;
            self.logits_readback.record(rec.encoder(), &act.logits, 0, bytes);
        }
        if let Some(slot) = id_slot {
            self.id_readbacks[slot].record(rec.encoder(), &act.tokens, 0, 4);
        }
        // Every submission writes the captured layers' rows; they are read
        // back for the decoded token and the prompt's last position, and
        // for earlier prompt chunks when every prompt row is asked for.
        let capture =
            self.capture.as_ref().filter(|c| head != Head::None || c.prompt_rows == PromptRows::All);
        let captured_rows = capture.map(|c| {
            let rows = c.rows_for(n_tokens);
            c.record_readback(rec.encoder(), rows, id_slot.unwrap_or(0));
            rows
        });
        let dispatches = rec.dispatches();
        let index = rec.finish()?;
        if let Some(slot) = id_slot {
            self.id_readbacks[slot].start_map(4);
        }
        if n_tokens == 1 {
            self.stats.decode_dispatches = dispatches;
        }
        if let (Some(rows), Some(c)) = (captured_rows, self.capture.as_mut()) {
            // A generated step's rows are read with its id; others now.
            let slot = id_slot.unwrap_or(0);
            c.start(slot, rows, self.len + n_tokens - rows);
            if id_slot.is_none() {
                c.finish(gpu, slot, MapWait::Block(Some(index.clone())))?;
            }
            self.stats.capture_readbacks += 1;
        }
        self.positions.record(self.len, n_tokens, media.map(|(_, p)| p));
        self.len += n_tokens;
        Ok(index)
    }

    /// [`Self::submit`] for a model split across devices, over the chunks
    /// `chunks` of `tokens` (`None`: one token, the id the GPU chose last,
    /// already in place) from the current position. The chunks run in
    /// waves: in wave w device d runs chunk w - d on the residual rows
    /// device d - 1 gave at the end of the wave before, so that the devices
    /// work on different chunks of a prompt at once (a chunk's keys and
    /// values on each device are written before the next chunk reaches it).
    /// The last device runs `head` on the last chunk. A sampled id comes
    /// back from the last device and goes to the first device's tokens,
    /// where the next step takes it, and (with `id_slot`) on to that
    /// readback slot: steps after a prompt run one at a time. Images are
    /// refused there.
    fn submit_split(
        &mut self,
        tokens: Option<&[u32]>,
        chunks: &[std::ops::Range<usize>],
        head: Head,
        id_slot: Option<usize>,
        media: bool,
    ) -> Result<wgpu::SubmissionIndex> {
        let devices = self.model.next_parts().len() + 1;
        if media {
            return Err(Error::Unsupported {
                what: "images in the prompt of a model split across devices (it has no vision tower)",
                value: format!("a model split across {devices} devices"),
            });
        }
        let start = self.len;
        // The residual rows waiting to enter each device.
        let mut carried: Vec<Option<Vec<f32>>> = vec![None; devices];
        let mut index = None;
        let mut sampled = None;
        for wave in crate::model::split::waves(chunks.len(), devices) {
            for &(d, c) in &wave {
                let range = chunks[c].clone();
                let chunk_head = if c + 1 == chunks.len() { head } else { Head::None };
                let input = match d {
                    0 => SplitInput::Tokens(tokens.map(|t| &t[range.clone()])),
                    _ => {
                        SplitInput::Rows(carried[d].take().expect("the device before gave this chunk's rows"))
                    }
                };
                index =
                    Some(self.run_split_device(d, (start + range.start, range.len()), input, chunk_head)?);
            }
            for (d, c) in wave {
                if d + 1 < devices {
                    carried[d + 1] = Some(self.read_split(d, chunks[c].len() * self.model.config.hidden)?);
                } else if c + 1 == chunks.len() && head == Head::Sample {
                    sampled = Some(self.read_split::<u32>(d, 1)?[0]);
                }
            }
        }
        let mut index = index.expect("a submission has a chunk");
        if let Some(id) = sampled {
            index = self.take_sampled_id(id, id_slot)?;
        }
        for range in chunks {
            self.positions.record(start + range.start, range.len(), None);
        }
        self.len = start + chunks.last().map_or(0, |r| r.end);
        Ok(index)
    }

    /// Submits split device `d`'s layers over `n` rows at position `pos`
    /// (`at`) from `input`: tokens on the first device, the residual rows
    /// of the device before on the others. Its residual rows go to its
    /// readback for the device after; the last device runs `head`, its
    /// logits or its sampled id going there instead.
    fn run_split_device(
        &mut self,
        d: usize,
        (pos, n): (usize, usize),
        input: SplitInput<'_>,
        head: Head,
    ) -> Result<wgpu::SubmissionIndex> {
        let Session { model, activations, plan, routing_readback, capture, stats, split, routing, .. } = self;
        let Some((first_out, parts)) = split.as_mut() else { unreachable!("a split session") };
        let last = d == parts.len();
        let (part_model, act, plan, readback, out, capture) = match d {
            0 => (*model, &*activations, &*plan, &*routing_readback, &*first_out, capture),
            _ => {
                let p = &mut parts[d - 1];
                (p.model, &p.flow.activations, &p.flow.plan, &p.flow.routing_readback, &p.out, &mut p.capture)
            }
        };
        let (gpu, config) = (&part_model.gpu, &part_model.config);
        match input {
            SplitInput::Tokens(Some(tokens)) => act.write_tokens(gpu, tokens),
            SplitInput::Tokens(None) => {}
            SplitInput::Rows(rows) => gpu.queue.write_buffer(&act.x, 0, bytemuck::cast_slice(&rows)),
        }
        let step = act.write_step(gpu, pos, n, config);
        let mut rec = Recorder::new(gpu, None, stats);
        let routing = RoutingContext {
            mode: *routing,
            readback,
            experts: part_model.experts.as_ref(),
            prefetch: self.expert_prefetch,
        };
        let device_head = if last { head } else { Head::None };
        plan.forward(&mut rec, act, &step, device_head, &routing, None)?;
        match device_head {
            _ if !last => out.record(rec.encoder(), &act.x, 0, (n * config.hidden * 4) as u64),
            Head::Logits => out.record(rec.encoder(), &act.logits, 0, (config.vocab * 4) as u64),
            Head::Sample => out.record(rec.encoder(), &act.tokens, 0, 4),
            Head::None => {}
        }
        let captured = record_capture(capture.as_ref(), head, n, rec.encoder());
        let index = rec.finish()?;
        finish_capture(gpu, capture.as_mut(), captured, (pos + n, &index))?;
        // Counted once per submission, as on one device.
        self.stats.capture_readbacks += u64::from(d == 0 && captured.is_some());
        Ok(index)
    }

    /// The first `words` words split device `d` left in its readback with
    /// its last submission: its residual rows, or on the last device its
    /// sampled id.
    fn read_split<T: bytemuck::Pod>(&self, d: usize, words: usize) -> Result<Vec<T>> {
        let Some((first_out, parts)) = self.split.as_ref() else { unreachable!("a split session") };
        let (gpu, out) = match d {
            0 => (&self.model.gpu, first_out),
            _ => (&parts[d - 1].model.gpu, &parts[d - 1].out),
        };
        out.read(gpu, (words * 4) as u64)
    }

    /// Places the id a split's last device sampled in the first device's
    /// tokens, where the next step reads it, and (with `id_slot`) copies it
    /// to that readback slot, as a single device's sampling leaves it.
    fn take_sampled_id(&mut self, id: u32, id_slot: Option<usize>) -> Result<wgpu::SubmissionIndex> {
        let (gpu, act) = (&self.model.gpu, &self.activations);
        act.write_tokens(gpu, &[id]);
        let mut rec = Recorder::new(gpu, None, &mut self.stats);
        if let Some(slot) = id_slot {
            self.id_readbacks[slot].record(rec.encoder(), &act.tokens, 0, 4);
        }
        let index = rec.finish()?;
        if let Some(slot) = id_slot {
            self.id_readbacks[slot].start_map(4);
        }
        Ok(index)
    }
}

/// What a split device's submission starts from.
enum SplitInput<'a> {
    /// The first device's tokens (`None`: the id already in place).
    Tokens(Option<&'a [u32]>),
    /// The residual rows the device before gave.
    Rows(Vec<f32>),
}

/// Records the copy of a split device's captured rows of a submission of
/// `n_tokens` ending with `head`, where its capture records them (as
/// [`Session::submit`] decides); returns how many.
fn record_capture(
    capture: Option<&CapturePlan>,
    head: Head,
    n_tokens: usize,
    encoder: &mut wgpu::CommandEncoder,
) -> Option<usize> {
    let capture = capture.filter(|c| head != Head::None || c.prompt_rows == PromptRows::All)?;
    let rows = capture.rows_for(n_tokens);
    capture.record_readback(encoder, rows, 0);
    Some(rows)
}

/// Reads a split device's captured rows (`rows` of them, the last ending
/// before position `end`) once `index` is done: a split waits for each
/// submission anyway.
fn finish_capture(
    gpu: &crate::gpu::Gpu,
    capture: Option<&mut CapturePlan>,
    rows: Option<usize>,
    (end, index): (usize, &wgpu::SubmissionIndex),
) -> Result<()> {
    if let (Some(rows), Some(c)) = (rows, capture) {
        c.start(0, rows, end - rows);
        c.finish(gpu, 0, MapWait::Block(Some(index.clone())))?;
    }
    Ok(())
}

/// Generated ids as they come back from the GPU, with the steps after them
/// already running. See [`Session::generate`].
pub struct Generation<'s, 'm> {
    session: &'s mut Session<'m>,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    depth: usize,
    /// The position after the prompt.
    prompt_end: usize,
    /// Decode steps this generation may run.
    steps: usize,
    submitted: usize,
    yielded: usize,
    /// (id readback slot, submission) of every id not yet read, oldest first.
    in_flight: VecDeque<(usize, wgpu::SubmissionIndex)>,
    next_slot: usize,
    stopped: Option<StopReason>,
}

impl Generation<'_, '_> {
    /// Why generation ended, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stopped
    }

    /// Ids yielded so far.
    pub fn generated(&self) -> usize {
        self.yielded
    }

    /// Ends generation here: the steps in flight are dropped and the
    /// session's position rolled back (as dropping the iterator does).
    pub fn cancel(&mut self) {
        self.stop(StopReason::Cancelled);
    }

    /// Ends generation: waits for the steps in flight (their ids are
    /// dropped) and leaves the position after the last token fed.
    fn stop(&mut self, reason: StopReason) {
        if self.stopped.is_some() {
            return;
        }
        self.stopped = Some(reason);
        for (slot, index) in std::mem::take(&mut self.in_flight) {
            // A failed wait leaves the slot mapped or pending; the session's
            // next submission reports the device error.
            let _ = self.read_slot(slot, index);
        }
        let fed = self.prompt_end + self.yielded.max(1) - 1;
        self.session.len = fed;
        let parts =
            self.session.split.iter_mut().flat_map(|(_, parts)| parts).filter_map(|p| p.capture.as_mut());
        for capture in self.session.capture.as_mut().into_iter().chain(parts) {
            capture.drop_from_position(fed);
        }
    }

    /// The id a step (or the prompt) chose, and its captured rows if any.
    fn read_slot(&mut self, slot: usize, index: wgpu::SubmissionIndex) -> Result<u32> {
        let gpu = &self.session.model.gpu;
        let wait = MapWait::Block(Some(index));
        let id = self.session.id_readbacks[slot]
            .finish_map(gpu, wait.clone(), |m| u32::from_le_bytes(m[..4].try_into().unwrap()))?;
        if let Some(capture) = self.session.capture.as_mut() {
            capture.finish(gpu, slot, wait)?;
        }
        Ok(id)
    }

    fn submit_step(&mut self) -> Result<()> {
        let slot = self.next_slot;
        self.next_slot = (self.next_slot + 1) % self.session.id_readbacks.len();
        let index = self.session.submit(None, 1, Head::Sample, Some(slot), None)?;
        self.submitted += 1;
        self.in_flight.push_back((slot, index));
        Ok(())
    }

    fn next_id(&mut self) -> Result<u32> {
        while self.in_flight.len() < self.depth + 1 && self.submitted < self.steps {
            self.submit_step()?;
        }
        let (slot, index) = self.in_flight.pop_front().expect("an id is in flight while not stopped");
        let id = self.read_slot(slot, index)?;
        if id == crate::kernels::sample::NON_FINITE {
            // The logits of the last token fed (the prompt's, then each id's).
            return Err(Error::NonFiniteSample {
                position: (self.prompt_end + self.yielded).saturating_sub(1),
            });
        }
        self.yielded += 1;
        if self.stop_tokens.contains(&id) {
            self.stop(StopReason::StopToken(id));
        } else if self.yielded == self.max_tokens {
            self.stop(StopReason::MaxTokens);
        } else if self.yielded > self.steps {
            self.stop(StopReason::ContextFull);
        }
        Ok(id)
    }
}

impl Iterator for Generation<'_, '_> {
    type Item = Result<u32>;

    fn next(&mut self) -> Option<Result<u32>> {
        if self.stopped.is_some() {
            return None;
        }
        let id = self.next_id();
        if id.is_err() {
            self.stop(StopReason::Failed);
        }
        Some(id)
    }
}

impl Drop for Generation<'_, '_> {
    fn drop(&mut self) {
        self.stop(StopReason::Cancelled);
    }
}
