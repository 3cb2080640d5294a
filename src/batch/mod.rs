//! Many sequences at once over one loaded [`Model`]: each [`BatchEngine::step`]
//! is one forward pass over a ragged list of rows, every row a (sequence,
//! position, token): one decode row for every running sequence, then the
//! next chunk of each waiting prompt, up to a budget of rows per step, so
//! that a long prompt arriving does not stall the streams already running.
//! Projections and experts run once over all rows (each weight read once per
//! step); attention runs each row over its own sequence's keys in a paged KV
//! cache (a pool of blocks); each row that ends its sequence's known tokens
//! chooses the next token with its own sampling.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use wgspark::batch::{BatchEngine, BatchOptions, Request};
//! let gpu = wgspark::Gpu::from_env()?;
//! let model = wgspark::Model::load("SmolLM2-135M-Instruct.Q4_1.gguf", &gpu)?;
//! let mut engine = BatchEngine::new(&model, &BatchOptions::default())?;
//! let a = engine.add(Request { max_tokens: 16, ..Request::new(vec![504, 3575, 282, 4649, 314]) })?;
//! let b = engine.add(Request { max_tokens: 8, ..Request::new(vec![1, 2, 3]) })?;
//! while !engine.is_idle() {
//!     for out in engine.step()? {
//!         println!("{:?}: {} {:?}", out.sequence, out.token, out.finish);
//!     }
//! }
//! # let _ = (a, b);
//! # Ok(())
//! # }
//! ```

mod blocks;

use std::collections::VecDeque;

use blocks::{Block, BlockPool, PrefixHash};

use crate::error::{Error, Result};
use crate::flow::ChunkMedia;
use crate::flow::moe::RoutingContext;
use crate::flow::vision::ImageRows;
use crate::flow::{
    Activations, ChunkMatmul, ExpertPrefetch, Head, KvLayout, PhaseTimer, Plan, Recorder, RoutingMode,
    RowsHead,
};
use crate::gpu::{MapWait, Readback};
use crate::kernels::Step;
use crate::kernels::attention::{PagedRow, PagedRows, PagedSplits, PagedTiling};
use crate::kernels::gemm::PrefillPrecision;
use crate::kernels::sample::{RowSampleBindings, RowSampling, SampleScratch};
use crate::kv_cache::{KvCache, KvFormat};
use crate::model::Model;
use crate::multimodal::{PreparedPrompt, PromptPart, add_image_rows};
use crate::sampling::Sampling;
use crate::session::DEFAULT_CONTEXT_CAP;
use crate::stats::Stats;
use crate::steering::{Steering, SteeringPlan};
use crate::vision::RgbImage;

/// How a [`BatchEngine`] is laid out.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchOptions {
    /// Most sequences running at once; more wait in the queue.
    pub max_sequences: usize,
    /// Most rows (prompt tokens and decode tokens together) one step runs.
    pub step_tokens: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool. `None`: enough for `max_sequences` sequences
    /// of `min(context_len, 2048)` positions.
    pub kv_blocks: Option<usize>,
    /// Most positions of one sequence (prompt and generated tokens).
    /// `None`: the config's `max_position_embeddings`, at most
    /// [`DEFAULT_CONTEXT_CAP`].
    pub context_len: Option<usize>,
    /// How the KV pool stores K and V.
    pub kv_format: KvFormat,
    /// Keep whole blocks of computed tokens for sequences that start with
    /// the same tokens.
    pub prefix_cache: bool,
    /// Which kernel runs the projections of a step of several rows (see
    /// [`ChunkMatmul`]: its GEMV choice runs every row alone, so that a
    /// row's sums never depend on the step's other rows).
    pub chunk_matmul: ChunkMatmul,
    /// How the GEMM rounds its operands on cooperative matrices.
    pub prefill_precision: PrefillPrecision,
    /// How MoE layers hand the router's choice to the expert kernels.
    pub routing: RoutingMode,
    /// Decode steps submitted ahead of the one whose ids are read, while
    /// every running sequence only decodes (0: each step waits for the one
    /// before).
    pub in_flight: usize,
    /// Fewest rows of a step whose projections run through the GEMM; fewer
    /// run the GEMV once per row. `None`: 5 for 16-bit weights, 10 for
    /// quantized ones, where the GEMV reads less and the GEMM decodes more
    /// (a step of up to 32 rows of the 8B shape in Q4_K_M takes the GEMM
    /// about as long as 8 rows take the GEMV on an NVIDIA H100).
    pub gemm_rows: Option<usize>,
    /// Fewest rows per expert, on average over a MoE layer's experts, of a
    /// step whose experts run through the grouped GEMM (where its other
    /// projections do); fewer run the GEMV, once per chosen expert of each
    /// row. `None`: [`EXPERT_GEMM_ROWS`].
    pub expert_gemm_rows: Option<usize>,
    /// Each dispatch of a step in a compute pass of its own, timed on the
    /// GPU where it has timestamps ([`BatchStats::last_passes`]): for
    /// profiling; every step then waits for its timestamps.
    pub time_dispatches: bool,
    /// Fewest rows of a step that, on a model split across devices, runs
    /// as one pass per device pipelined across them (each pass reads every
    /// weight again, which pays where a step's rows, not its weights, take
    /// the time: prompt chunks). Default [`PIPELINE_ROWS`].
    pub pipeline_rows: usize,
}

/// The default [`BatchOptions::pipeline_rows`]: a step of the server's
/// default size, mostly prompt rows (decode steps of up to 64 sequences
/// stay whole).
pub const PIPELINE_ROWS: usize = 256;

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            max_sequences: 64,
            step_tokens: 512,
            block_size: 16,
            kv_blocks: None,
            context_len: None,
            kv_format: KvFormat::F16,
            prefix_cache: true,
            chunk_matmul: ChunkMatmul::Auto,
            prefill_precision: PrefillPrecision::F16,
            routing: RoutingMode::Readback,
            gemm_rows: None,
            expert_gemm_rows: None,
            in_flight: crate::session::DEFAULT_IN_FLIGHT,
            time_dispatches: false,
            pipeline_rows: PIPELINE_ROWS,
        }
    }
}

/// A sequence to run: its prompt and how it is continued.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Seeds the draws of [`Sampling::Random`]: the same seed gives the ids
    /// a lone [`crate::Session::generate`] gives with it.
    pub seed: u64,
    /// Most tokens generated (at least 1).
    pub max_tokens: usize,
    /// Ids that end the sequence (the id itself is output).
    pub stop_tokens: Vec<u32>,
    /// With each token, its log-probability and those of the `n` likeliest
    /// (at most [`MAX_TOP_LOGPROBS`]); `None`: none.
    pub logprobs: Option<usize>,
    /// With each token, the raw logits it was chosen from.
    pub return_logits: bool,
    /// Control vectors added at the sequence's layer outputs (prompt and
    /// generated tokens), whatever the other sequences of a step use.
    pub steering: Option<Steering>,
    /// The images of a prompt for a model with a vision tower (Qwen3-VL),
    /// in order: `prompt` holds the model's image token once for each,
    /// where its rows go (as the chat template renders an image).
    pub images: Vec<RgbImage>,
}

impl Request {
    /// A request for `prompt`, greedy, 16 tokens, no stop ids.
    pub fn new(prompt: Vec<u32>) -> Self {
        Request {
            prompt,
            sampling: Sampling::Greedy,
            seed: 0,
            max_tokens: 16,
            stop_tokens: Vec::new(),
            logprobs: None,
            return_logits: false,
            steering: None,
            images: Vec::new(),
        }
    }
}

/// Most alternatives [`Request::logprobs`] may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sequence of the engine, as [`BatchEngine::add`] numbered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceId(pub u64);

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced one of its stop ids (the last token output).
    StopToken(u32),
    /// It produced `max_tokens` tokens.
    MaxTokens,
    /// Its tokens fill the context: none can follow.
    ContextFull,
}

/// A token's log-probability (natural log, from the softmax of the raw
/// logits) and the likeliest alternatives', most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// (id, log-probability) of the likeliest tokens.
    pub top: Vec<(u32, f32)>,
}

/// A token a step produced for a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// Whose token it is.
    pub sequence: SequenceId,
    /// The token chosen.
    pub token: u32,
    /// Set where the request asked for them.
    pub logprobs: Option<Logprobs>,
    /// The raw logits the token was chosen from, where the request asked.
    pub logits: Option<Vec<f32>>,
    /// Set on the sequence's last token: the engine has let it go.
    pub finish: Option<FinishReason>,
    /// Prompt tokens whose keys the sequence took from the prefix cache
    /// when it was first admitted, rather than computing them.
    pub cached_tokens: usize,
}

/// What the engine holds and has done.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchStats {
    /// Sequences admitted to the steps.
    pub running: usize,
    /// Sequences queued for room (new, or pre-empted).
    pub waiting: usize,
    /// Blocks of the KV pool held by sequences.
    pub blocks_used: usize,
    /// Blocks in the KV pool.
    pub blocks_total: usize,
    /// Blocks whose tokens are kept for reuse.
    pub blocks_cached: usize,
    /// Prompt blocks taken from the prefix cache.
    pub prefix_hits: u64,
    /// Prompt blocks looked for in the prefix cache.
    pub prefix_lookups: u64,
    /// Sequences pre-empted (their blocks given back, recomputed later).
    pub preemptions: u64,
    /// Forward passes run.
    pub steps: u64,
    /// Rows run for prompt tokens (and recomputed ones).
    pub prompt_rows: u64,
    /// Rows run for generated tokens.
    pub decode_rows: u64,
    /// With [`BatchOptions::time_dispatches`]: the last step's dispatches,
    /// each label with its GPU time, in order.
    pub last_passes: Vec<(&'static str, std::time::Duration)>,
}

#[derive(Debug)]
struct Sequence {
    id: SequenceId,
    request: Request,
    /// Prompt, then every token generated.
    tokens: Vec<u32>,
    /// Positions whose K and V are in the sequence's blocks.
    computed: usize,
    blocks: Vec<Block>,
    /// Hashes of the leading blocks kept for reuse (block i after i - 1).
    kept: Vec<PrefixHash>,
    generated: usize,
    /// Its row of the steering tables while running (0: none, unsteered).
    steer_slot: u32,
    /// A prompt with images: their rows and the prompt's positions.
    media: Option<SequenceMedia>,
    /// Why it ended, once it has (it is let go when no step is in flight).
    finish: Option<FinishReason>,
    /// Prompt tokens taken from the prefix cache at its first admission
    /// (`None`: not admitted yet).
    cached_tokens: Option<usize>,
}

/// What a prompt with images adds to its tokens (see [`crate::multimodal`]).
#[derive(Debug)]
struct SequenceMedia {
    /// Each prompt token's position triple (M-RoPE).
    positions: Vec<[u32; 3]>,
    /// The position of a token after the prompt is its index plus this.
    offset: i64,
    /// Each image's first token and its rows from the vision tower.
    images: Vec<(usize, ImageRows)>,
}

impl Sequence {
    /// Keys of its own, not to share through the prefix cache: a steered
    /// sequence's, or one whose image tokens (all one id) hide what they are.
    fn keeps_blocks_apart(&self) -> bool {
        self.request.steering.is_some() || self.media.is_some()
    }

    /// Its tokens come with their logits (or logprobs, made from them).
    fn wants_logits(&self) -> bool {
        self.request.return_logits || self.request.logprobs.is_some()
    }
}

impl Sequence {
    fn finished_prompt(&self) -> bool {
        self.computed + 1 >= self.tokens.len()
    }
}

/// A row of a step: a sequence's token at a position.
struct Row {
    seq: usize,
    pos: usize,
    /// This row chooses the sequence's next token.
    samples: bool,
    /// A generated token's row (its sequence's only row): its attention
    /// splits its keys, as a lone session's decode does.
    decode: bool,
}

/// The default [`BatchOptions::expert_gemm_rows`]. On an NVIDIA H200, a
/// step of 16 sequences of `qwen3-30b-a3b-16l` in Q4_K_M (one row per
/// expert) decodes 2.2 times as fast with its experts on the GEMV as on the
/// grouped GEMM; at 64 sequences (four per expert) the GEMM is ahead.
pub const EXPERT_GEMM_ROWS: usize = 4;

/// Keys per split of a decode row's attention, and most splits: fixed, so
/// that a row's splits depend on its own keys alone.
const SPLIT_KEYS: usize = 64;
const MAX_SPLITS: usize = 16;
/// The partial slot of a row that does not split.
const NO_SLOT: u32 = u32::MAX;

/// The GPU side of a step beside the layer flow: rows and block tables,
/// the head over the rows that choose, and the selection.
#[derive(Debug)]
struct StepBuffers {
    rows: wgpu::Buffer,
    /// Decode rows' split attention: partial sums and (max, sum) pairs.
    split_acc: wgpu::Buffer,
    split_max_sum: wgpu::Buffer,
    block_table: wgpu::Buffer,
    /// The residual rows that run the head, gathered.
    x_rows: wgpu::Buffer,
    logits: wgpu::Buffer,
    /// The head's own step (its row count).
    head_step: wgpu::Buffer,
    sampling: wgpu::Buffer,
    sampled: wgpu::Buffer,
    scratch: SampleScratch,
    /// The chosen ids of each step in flight.
    ids: Vec<Readback>,
    logits_readback: Readback,
    routing: Readback,
}

impl StepBuffers {
    /// Buffers for steps of up to `max_rows` rows, `max_seqs` of which
    /// choose a token, block tables of `max_blocks` blocks, and readbacks
    /// for `in_flight` steps ahead of the one read.
    fn new(
        model: &Model,
        (max_rows, max_seqs): (usize, usize),
        max_blocks: usize,
        in_flight: usize,
    ) -> Result<Self> {
        let (gpu, c) = (&model.gpu, &model.config);
        Ok(StepBuffers {
            rows: gpu.storage_buffer("batch.rows", 4 * max_rows)?,
            split_acc: gpu
                .storage_buffer("batch.split_acc", max_seqs * c.heads.q * MAX_SPLITS * c.heads.dim)?,
            split_max_sum: gpu
                .storage_buffer("batch.split_max_sum", max_seqs * c.heads.q * MAX_SPLITS * 2)?,
            block_table: gpu.storage_buffer("batch.block_table", max_seqs * max_blocks)?,
            x_rows: gpu.storage_buffer("batch.x_rows", max_seqs * c.hidden)?,
            logits: gpu.storage_buffer("batch.logits", max_seqs * c.vocab)?,
            head_step: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("batch.head_step"),
                size: std::mem::size_of::<Step>() as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            sampling: gpu.storage_buffer_bytes(
                "batch.sampling",
                (max_seqs * std::mem::size_of::<RowSampling>()) as u64,
            )?,
            sampled: gpu.storage_buffer("batch.sampled", max_seqs)?,
            scratch: SampleScratch::for_rows(gpu, c.vocab, max_seqs)?,
            ids: (0..=in_flight.max(1))
                .map(|_| Readback::new(gpu, "batch.ids", (max_seqs * 4) as u64))
                .collect(),
            logits_readback: Readback::new(gpu, "batch.logits", (max_seqs * c.vocab * 4) as u64),
            routing: Readback::new(
                gpu,
                "batch.routing",
                (max_rows.max(2) * c.moe.as_ref().map_or(1, |m| m.top_k) * 4) as u64,
            ),
        })
    }
}

/// A device's part of the steps: the KV pool of its layers (every device
/// holds the same blocks, of its own layers), its activations, plan and
/// step buffers. Every device runs the same rows and block tables.
struct DeviceSteps<'m> {
    model: &'m Model,
    act: Activations,
    plan: Plan,
    /// The GEMM of steps of many rows (`None`: the GEMV runs every step).
    gemm: Option<crate::kernels::gemm::Gemm>,
    buffers: StepBuffers,
    /// The pool's buffers (kept alive: the plan binds them).
    _kv: KvCache,
    /// The steering tables of its layers, made when a first request asks
    /// for steering.
    steering: Option<SteeringPlan>,
    /// Where a step's residual rows leave it for the next device.
    rows_out: Readback,
}

impl<'m> DeviceSteps<'m> {
    /// The steps of `model`'s layers on its device: a pool of `blocks`
    /// blocks of `block` positions, steps of `max_rows` rows of which
    /// `max_seqs` choose, block tables of `max_blocks` blocks.
    fn new(
        model: &'m Model,
        options: &BatchOptions,
        (blocks, block): (usize, usize),
        (max_rows, max_seqs, max_blocks): (usize, usize, usize),
    ) -> Result<Self> {
        let (gpu, c) = (&model.gpu, &model.config);
        // Saturating: a pool no device holds then fails the budget check.
        let pool_positions = blocks.saturating_mul(block);
        let kv_bytes = KvCache::bytes(model.layers().len(), c.heads, pool_positions, options.kv_format);
        let weights = match model.layers() {
            layers if layers.len() == c.layers => "model weights".to_string(),
            layers => format!("layers {layers:?}"),
        };
        gpu.check_budget(
            &format!("{weights} and a KV pool of {blocks} blocks of {block} positions"),
            model.weights.bytes().saturating_add(kv_bytes),
        )?;
        let kv = KvCache::new(gpu, model.layers().len(), c.heads, pool_positions, options.kv_format)?;
        let gemm = options.chunk_matmul.gemm(gpu, options.prefill_precision)?;
        let values_apart = model
            .weights
            .layers
            .iter()
            .any(|l| crate::flow::first_value_row_apart(&l.qkv, c.heads).is_some());
        let half_copies = gemm.as_ref().is_some_and(|g| g.keeps_half_copies());
        let scratch = crate::flow::GemmScratch::new(model, gemm.as_ref(), max_rows);
        // The rotary rows are the step's (context_len sizes only cos_sin).
        let act = Activations::new(
            gpu,
            c,
            (max_rows, scratch),
            max_rows,
            (values_apart, gemm.is_some(), half_copies),
        )?;
        let buffers = StepBuffers::new(model, (max_rows, max_seqs), max_blocks, options.in_flight)?;
        let splits = PagedSplits {
            acc: &buffers.split_acc,
            max_sum: &buffers.split_max_sum,
            split_keys: SPLIT_KEYS,
            max_splits: MAX_SPLITS,
        };
        let paged =
            PagedRows { rows: &buffers.rows, block_table: &buffers.block_table, block_size: block, splits };
        let mut plan =
            Plan::new(model, &act, gemm.as_ref(), options.prefill_precision, KvLayout::Paged(&kv, paged))?;
        let qkv = &model.weights.layers[0].qkv;
        let sixteen_bits = qkv.bytes() >= (qkv.rows * qkv.cols * 2) as u64;
        plan.set_gemm_rows(options.gemm_rows.unwrap_or(if sixteen_bits { 5 } else { 10 }));
        plan.set_expert_gemm_rows(options.expert_gemm_rows.unwrap_or(EXPERT_GEMM_ROWS));
        let rows_out = Readback::new(gpu, "batch.rows_out", (max_rows * c.hidden * 4) as u64);
        Ok(DeviceSteps { model, act, plan, gemm, buffers, _kv: kv, steering: None, rows_out })
    }

    /// Records its layers over the step's rows: their residual rows
    /// `carried` from the device before (none: the first device embeds the
    /// tokens), the step's `media` on the first.
    fn forward<'a>(
        &'a self,
        rec: &mut Recorder<'a>,
        step: &Step,
        carried: Option<&[f32]>,
        mode: RoutingMode,
        media: Option<&ChunkMedia<'_>>,
    ) -> Result<()> {
        if let Some(x) = carried {
            self.model.gpu.queue.write_buffer(&self.act.x, 0, bytemuck::cast_slice(x));
        }
        let routing = RoutingContext {
            mode,
            readback: &self.buffers.routing,
            experts: self.model.experts.as_ref(),
            prefetch: ExpertPrefetch::Off,
        };
        self.plan.forward(rec, &self.act, step, Head::None, &routing, media)
    }

    /// Writes a step's rows, block tables, rotary rows and steering slots.
    fn write_step(&self, step: &Step, (meta, table): (&[u32], &[u32]), rotary: &[f32], steer_slots: &[u32]) {
        let gpu = &self.model.gpu;
        gpu.queue.write_buffer(&self.act.step, 0, bytemuck::bytes_of(step));
        gpu.queue.write_buffer(&self.buffers.rows, 0, bytemuck::cast_slice(meta));
        gpu.queue.write_buffer(&self.buffers.block_table, 0, bytemuck::cast_slice(table));
        self.act.write_rotary_rows(gpu, 0, rotary);
        if let Some(plan) = &self.steering {
            plan.write_slots(gpu, steer_slots);
        }
    }
}

/// Many sequences over one model; see the module's documentation.
pub struct BatchEngine<'m> {
    model: &'m Model,
    options: BatchOptions,
    context_len: usize,
    /// Each device's part of the steps: one, or one per device of a model
    /// split across several, in the order the rows pass through them.
    devices: Vec<DeviceSteps<'m>>,
    /// Rows of the steering tables no running sequence holds.
    free_steer_slots: Vec<u32>,
    /// The head and the selection, on the last device.
    head: RowsHead,
    sample: Vec<crate::gpu::Dispatch>,
    pool: BlockPool,
    /// Host copy of the rotary table, one row per position.
    rotary: Vec<f32>,
    rotary_row: usize,
    /// Running sequences, oldest first.
    running: Vec<Sequence>,
    /// Steps submitted, their ids not yet read, oldest first.
    in_flight: VecDeque<Submitted>,
    /// Outputs of steps completed early (by a cancel), to hand out first.
    ready: VecDeque<Vec<Output>>,
    /// The ids readback the next step takes.
    next_readback: usize,
    waiting: VecDeque<Sequence>,
    next_id: u64,
    stats: BatchStats,
    flow_stats: Stats,
    /// Times each dispatch, with [`BatchOptions::time_dispatches`].
    timer: Option<PhaseTimer>,
}

impl<'m> BatchEngine<'m> {
    /// An engine over `model` laid out as `options` say: the KV pool, the
    /// activations of `step_tokens` rows and the pipelines are made here.
    pub fn new(model: &'m Model, options: &BatchOptions) -> Result<Self> {
        let c = &model.config;
        let gpu = &model.gpu;
        let invalid = |why: String| Error::InvalidBatch(why);
        if options.max_sequences == 0 || options.step_tokens == 0 || options.block_size == 0 {
            return Err(invalid(format!(
                "max_sequences {}, step_tokens {} and block_size {} must all be at least 1",
                options.max_sequences, options.step_tokens, options.block_size
            )));
        }
        if model.streamed_experts().is_some() && options.routing == RoutingMode::DeviceResident {
            return Err(Error::Unsupported {
                what: "device-resident routing with streamed experts (the host places each dispatch's experts)",
                value: "a batch engine".into(),
            });
        }
        let context_len = options.context_len.unwrap_or_else(|| c.max_positions.min(DEFAULT_CONTEXT_CAP));
        if context_len == 0 {
            return Err(Error::InvalidContext {
                context_len,
                reason: "a sequence needs at least one position".into(),
            });
        }
        let block = options.block_size;
        let blocks = options
            .kv_blocks
            .unwrap_or(options.max_sequences.saturating_mul(context_len.min(2048).div_ceil(block)));
        if blocks < context_len.min(options.step_tokens).div_ceil(block) {
            return Err(invalid(format!("{blocks} KV blocks of {block} positions hold less than one step")));
        }
        let parts: Vec<&'m Model> = std::iter::once(model).chain(model.next_parts()).collect();
        if parts.len() > 1 && options.time_dispatches {
            return Err(Error::Unsupported {
                what: "timed steps of a model split across devices",
                value: format!("{} devices", parts.len()),
            });
        }
        // A sequence alone can always grow to its context.
        let context_len = context_len.min(blocks.saturating_mul(block));
        let max_rows = parts.iter().map(|m| Activations::max_chunk(&m.gpu, c, options.step_tokens)).min();
        let max_rows = max_rows.expect("a model is on at least one device");
        let max_seqs = options.max_sequences.min(max_rows);
        let max_blocks = context_len.div_ceil(block);
        let devices = parts
            .iter()
            .map(|m| DeviceSteps::new(m, options, (blocks, block), (max_rows, max_seqs, max_blocks)))
            .collect::<Result<Vec<_>>>()?;
        let last = devices.last().expect("a model is on at least one device");
        let lb = &last.buffers;
        let head = RowsHead::new(
            last.model,
            &last.act,
            last.gemm.as_ref(),
            (&lb.x_rows, &lb.logits),
            &lb.head_step,
            max_seqs,
        )?;
        let sample = last.model.kernels.sample.plan_rows(
            &last.model.gpu,
            c.vocab,
            &RowSampleBindings {
                logits: &lb.logits,
                rows: &lb.sampling,
                tokens: &lb.sampled,
                scratch: &lb.scratch,
            },
        )?;
        for part in &parts {
            part.gpu.check("creating the batch engine")?;
        }
        let rotary_row = devices[0].act.cos_sin_row;
        Ok(BatchEngine {
            model,
            options: BatchOptions { max_sequences: max_seqs, step_tokens: max_rows, ..options.clone() },
            context_len,
            devices,
            free_steer_slots: (1..=max_seqs as u32).rev().collect(),
            head,
            sample,
            pool: BlockPool::new(blocks, block),
            rotary: c.rope.cos_sin_table(context_len),
            rotary_row,
            running: Vec::new(),
            in_flight: VecDeque::new(),
            ready: VecDeque::new(),
            next_readback: 0,
            waiting: VecDeque::new(),
            next_id: 0,
            stats: BatchStats { blocks_total: blocks, ..BatchStats::default() },
            flow_stats: Stats { router_histogram: vec![Vec::new(); c.layers], ..Stats::default() },
            timer: options
                .time_dispatches
                .then(|| PhaseTimer::new(gpu, crate::session::MAX_TIMED_PASSES, true)),
        })
    }

    /// The model the engine runs.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The options in force (`max_sequences` and `step_tokens` as far as the
    /// device allowed them).
    pub fn options(&self) -> &BatchOptions {
        &self.options
    }

    /// Most positions of one sequence.
    pub fn context_len(&self) -> usize {
        self.context_len
    }

    /// Queues a sequence; it joins the steps as room allows. Fails on a
    /// request that could never run (an empty prompt, ids out of range, a
    /// prompt longer than the context or than the whole KV pool, bad
    /// sampling).
    pub fn add(&mut self, request: Request) -> Result<SequenceId> {
        let vocab = self.model.config.vocab;
        if request.prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(&bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::TokenOutOfRange { token: bad, vocab });
        }
        if request.max_tokens == 0 {
            return Err(Error::InvalidSampling("max_tokens must be at least 1".into()));
        }
        request.sampling.validate()?;
        if let Some(n) = request.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(Error::InvalidSampling(format!(
                "top logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}"
            )));
        }
        if let Some(steering) = &request.steering {
            steering.check_fits(&self.model.config)?;
        }
        let (tokens, media) = self.prepare_media(&request)?;
        if tokens.len() > self.context_len {
            return Err(Error::ContextOverflow { position: tokens.len() - 1, context_len: self.context_len });
        }
        let blocks = tokens.len().div_ceil(self.pool.block_size());
        if blocks > self.pool.len() {
            return Err(Error::InvalidBatch(format!(
                "a prompt of {} tokens needs {blocks} KV blocks, the pool has {}",
                tokens.len(),
                self.pool.len()
            )));
        }
        if request.steering.is_some() && self.devices[0].steering.is_none() {
            // Tables of a row per running sequence, and row 0 of zeros.
            let rows = self.options.max_sequences + 1;
            for d in &mut self.devices {
                let plan = SteeringPlan::tables(d.model, rows, self.options.step_tokens)?;
                d.plan.set_layer_outputs(d.model, &d.act, d.gemm.as_ref(), Some(&plan), None)?;
                d.steering = Some(plan);
            }
        }
        let id = SequenceId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Sequence {
            id,
            request,
            tokens,
            computed: 0,
            blocks: Vec::new(),
            kept: Vec::new(),
            generated: 0,
            steer_slot: 0,
            media,
            finish: None,
            cached_tokens: None,
        });
        Ok(id)
    }

    /// The ids a request's prompt runs as, its images through the vision
    /// tower (each image's token repeated once per merged row).
    fn prepare_media(&self, request: &Request) -> Result<(Vec<u32>, Option<SequenceMedia>)> {
        let c = &self.model.config;
        if request.images.is_empty() {
            if let Some(i) = request.prompt.iter().position(|t| c.media_token_ids.contains(t)) {
                return Err(Error::Unsupported {
                    what: "image or video placeholder in a prompt of token ids",
                    value: format!("token {} at prompt position {i}", request.prompt[i]),
                });
            }
            return Ok((request.prompt.clone(), None));
        }
        let token = c.vision.as_ref().and_then(|v| v.tokens.image).ok_or_else(|| Error::Unsupported {
            what: "images for a model without a vision tower or an image_token_id",
            value: c.model_type.clone(),
        })?;
        let parts = PromptPart::split(&request.prompt, token, &request.images)?;
        let prompt = PreparedPrompt::new(self.model, &parts, 0, self.devices[0].gemm.as_ref())?;
        let next = prompt.positions.iter().flat_map(|p| p.iter()).max().map_or(0, |&m| m as i64 + 1);
        let offset = next - prompt.ids.len() as i64;
        let media = SequenceMedia { positions: prompt.positions, offset, images: prompt.images };
        Ok((prompt.ids, Some(media)))
    }

    /// Ends a sequence now (running or waiting): its blocks go back to the
    /// pool. The steps in flight complete first (their tokens come with the
    /// next calls of [`Self::step`]). Returns whether the sequence was
    /// there and had not ended.
    pub fn cancel(&mut self, id: SequenceId) -> Result<bool> {
        if !self.in_flight.is_empty() {
            self.drain()?;
            for outputs in &mut self.ready {
                outputs.retain(|o| o.sequence != id);
            }
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.release(seq);
            return Ok(true);
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(i).expect("found");
            self.release(seq);
            return Ok(true);
        }
        Ok(false)
    }

    /// The sequences admitted to the steps, oldest first (those a failed
    /// [`Self::step`] ran).
    pub fn running(&self) -> Vec<SequenceId> {
        self.running.iter().map(|s| s.id).collect()
    }

    /// No sequence is running or waiting, and every token was handed out.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty()
            && self.waiting.is_empty()
            && self.in_flight.is_empty()
            && self.ready.is_empty()
    }

    /// The pool, the queue and what the steps ran.
    pub fn stats(&self) -> BatchStats {
        BatchStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            blocks_used: self.pool.held(),
            blocks_cached: self.pool.cached(),
            prefix_hits: self.pool.hits,
            prefix_lookups: self.pool.lookups,
            last_passes: self.timer.as_ref().map(|t| t.last_passes.clone()).unwrap_or_default(),
            ..self.stats.clone()
        }
    }

    /// Runs one step: a forward pass over the rows the scheduler picks
    /// (see the module), and returns the tokens it produced, one per
    /// sequence that chose one. Nothing to run returns no output.
    pub fn step(&mut self) -> Result<Vec<Output>> {
        if let Some(outputs) = self.ready.pop_front() {
            return Ok(outputs);
        }
        let result = self.advance();
        if result.is_err() {
            // A failed pass leaves nothing trustworthy in the rows it wrote:
            // the steps in flight are dropped, and those sequences start over
            // from their last kept state.
            self.in_flight.clear();
            self.release_finished();
            for seq in &mut self.running {
                seq.computed = seq.computed.min(seq.kept.len() * self.pool.block_size());
            }
        }
        result
    }

    /// Submits the steps the pipeline can take and completes the oldest.
    fn advance(&mut self) -> Result<Vec<Output>> {
        if self.in_flight.is_empty() {
            let rows = self.schedule();
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            let submitted = self.submit(rows, false)?;
            self.in_flight.push_back(submitted);
        }
        // While every running sequence only decodes, the next steps are
        // known before their ids are: their tokens come from the step before
        // on the GPU, and they run while the host reads.
        // (A split's ids go back through the host to its first device.)
        while self.in_flight.len() <= self.options.in_flight && self.devices.len() == 1 {
            let Some(rows) = self.next_decode_rows() else { break };
            let submitted = self.submit(rows, true)?;
            self.in_flight.push_back(submitted);
        }
        let oldest = self.in_flight.pop_front().expect("a step in flight");
        let outputs = self.complete(oldest)?;
        if self.in_flight.is_empty() {
            self.release_finished();
        }
        Ok(outputs)
    }

    /// The rows of a pure decode step after the last one in flight, where
    /// one may follow without a look at its ids: it was a decode row for
    /// every running sequence, none has ended, none wants its logits, none
    /// waits for room, and every one has tokens left and a block to grow
    /// into without pre-empting another.
    fn next_decode_rows(&mut self) -> Option<Vec<Row>> {
        let last = self.in_flight.back()?;
        let pure = last.rows.len() == self.running.len()
            && last.rows.iter().enumerate().all(|(i, r)| r.seq == i && r.decode && r.samples);
        let room = self.waiting.is_empty() || self.running.len() >= self.options.max_sequences;
        if !pure || !room || self.running.iter().any(|s| s.finish.is_some() || s.wants_logits()) {
            return None;
        }
        let rows: Vec<Row> = last
            .rows
            .iter()
            .map(|r| Row { seq: r.seq, pos: r.pos + 1, samples: true, decode: true })
            .collect();
        let ahead = self.in_flight.len();
        let fits = rows.iter().all(|r| {
            let seq = &self.running[r.seq];
            seq.generated + ahead < seq.request.max_tokens && r.pos < self.context_len
        });
        let block = self.pool.block_size();
        let needed: usize = rows
            .iter()
            .map(|r| (r.pos + 1).div_ceil(block).saturating_sub(self.running[r.seq].blocks.len()))
            .sum();
        if !fits || needed > self.pool.available() {
            return None;
        }
        for r in &rows {
            let grown = self.grow(r.seq, r.pos + 1);
            debug_assert!(grown, "blocks were available");
        }
        Some(rows)
    }

    /// Releases the sequences that ended (none may be in flight).
    fn release_finished(&mut self) {
        debug_assert!(self.in_flight.is_empty());
        let (done, running): (Vec<Sequence>, Vec<Sequence>) =
            std::mem::take(&mut self.running).into_iter().partition(|s| s.finish.is_some());
        self.running = running;
        for seq in done {
            self.release(seq);
        }
    }

    /// Completes every step in flight, keeping their outputs for the next
    /// calls of [`Self::step`], and releases the sequences that ended.
    fn drain(&mut self) -> Result<()> {
        while let Some(oldest) = self.in_flight.pop_front() {
            let outputs = self.complete(oldest)?;
            self.ready.push_back(outputs);
        }
        self.release_finished();
        Ok(())
    }

    /// Picks this step's rows: a decode row for every running sequence that
    /// has finished its prompt, then prompt chunks (running sequences' first,
    /// then sequences admitted from the queue) within the row budget; takes
    /// the blocks they write, pre-empting the newest sequences when the pool
    /// runs out.
    fn schedule(&mut self) -> Vec<Row> {
        let budget = self.options.step_tokens;
        let mut rows = Vec::new();
        // Decode rows first: the streams already running never wait.
        let mut i = 0;
        while i < self.running.len() && rows.len() < budget {
            if self.running[i].finished_prompt() {
                if !self.grow(i, self.running[i].computed + 1) {
                    continue; // `i` was pre-empted, or one after it
                }
                let pos = self.running[i].computed;
                let decode = self.running[i].generated > 0;
                rows.push(Row { seq: i, pos, samples: true, decode });
            }
            i += 1;
        }
        // Then running prompts, oldest first, in chunks.
        for i in 0..self.running.len() {
            if rows.len() >= budget {
                break;
            }
            if !self.running[i].finished_prompt() {
                self.add_prompt_rows(i, &mut rows);
            }
        }
        // Then new sequences while there is room.
        while rows.len() < budget && self.running.len() < self.options.max_sequences {
            let Some(mut seq) = self.waiting.pop_front() else { break };
            let cached_before = seq.cached_tokens;
            self.reuse_prefix(&mut seq);
            let first = (seq.tokens.len() - seq.computed).min(budget - rows.len());
            if self.pool.available()
                < (seq.computed + first).div_ceil(self.pool.block_size()) - seq.blocks.len()
            {
                // No room yet: it waits at the head of the queue, holding
                // nothing, to look for its prefix again when it is admitted
                // (the blocks it found may be evicted before then).
                self.release_blocks(&mut seq);
                (seq.computed, seq.cached_tokens) = (0, cached_before);
                seq.kept.clear();
                self.waiting.push_front(seq);
                break;
            }
            self.admit(seq);
            let i = self.running.len() - 1;
            self.add_prompt_rows(i, &mut rows);
        }
        // Decode rows first (a stable order: each sequence's rows stay
        // together): the attention runs them apart.
        rows.sort_by_key(|r| !r.decode);
        rows
    }

    /// Starts running `seq`, with its steering in a row of the tables.
    fn admit(&mut self, mut seq: Sequence) {
        if let Some(steering) = &seq.request.steering {
            let slot = self.free_steer_slots.pop().expect("a steering row for every running sequence");
            for d in &self.devices {
                let plan = d.steering.as_ref().expect("the tables are made when a steered request is added");
                plan.write_row(&d.model.gpu, slot as usize, steering);
            }
            seq.steer_slot = slot;
        }
        self.running.push(seq);
    }

    /// Gives back a sequence's steering row.
    fn unsteer(&mut self, seq: &mut Sequence) {
        if seq.steer_slot != 0 {
            self.free_steer_slots.push(std::mem::take(&mut seq.steer_slot));
        }
    }

    /// Adds the next chunk of sequence `i`'s tokens not yet computed (as
    /// many rows as the budget and the pool allow).
    fn add_prompt_rows(&mut self, i: usize, rows: &mut Vec<Row>) {
        let seq = &self.running[i];
        let left = self.options.step_tokens - rows.len();
        let end = (seq.computed + left).min(seq.tokens.len());
        let start = seq.computed;
        if end <= start {
            return;
        }
        // Only blocks available without pre-empting: prompts wait.
        let block = self.pool.block_size();
        let can = (seq.blocks.len() + self.pool.available()) * block;
        let end = end.min(can);
        if end <= start {
            return;
        }
        let ok = self.grow(i, end);
        debug_assert!(ok, "blocks were available");
        let len = self.running[i].tokens.len();
        rows.extend((start..end).map(|pos| Row { seq: i, pos, samples: pos + 1 == len, decode: false }));
    }

    /// Takes blocks until sequence `i` holds positions `..end`, pre-empting
    /// the newest other sequences if the pool runs out. `false` when `i`
    /// itself had to go (it was the newest).
    fn grow(&mut self, i: usize, end: usize) -> bool {
        let block = self.pool.block_size();
        while self.running[i].blocks.len() * block < end {
            match self.pool.take() {
                Some(b) => self.running[i].blocks.push(b),
                None => {
                    let newest = self.running.len() - 1;
                    self.preempt(newest);
                    if newest == i {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Gives sequence `i`'s blocks back and queues it again at the front,
    /// to be recomputed (its whole blocks first kept, so that a prefix
    /// cache hit may spare the work).
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        if self.options.prefix_cache {
            keep_full_blocks(&mut self.pool, &mut seq);
        }
        self.release_blocks(&mut seq);
        self.unsteer(&mut seq);
        seq.computed = 0;
        seq.kept.clear();
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Starts a sequence after the blocks of its tokens the cache holds
    /// (at least its last token is left to compute, for its logits).
    fn reuse_prefix(&mut self, seq: &mut Sequence) {
        if !self.options.prefix_cache || seq.computed > 0 || seq.keeps_blocks_apart() {
            seq.cached_tokens.get_or_insert(0);
            return;
        }
        let block = self.pool.block_size();
        let reusable = (seq.tokens.len() - 1) / block;
        let mut parent = None;
        for b in 0..reusable {
            match self.pool.lookup(parent, &seq.tokens[b * block..(b + 1) * block]) {
                Some((found, hash)) => {
                    seq.blocks.push(found);
                    seq.kept.push(hash);
                    parent = Some(hash);
                }
                None => break,
            }
        }
        seq.computed = seq.blocks.len() * block;
        // A pre-empted sequence finds its own blocks again: not a hit of its prompt.
        seq.cached_tokens.get_or_insert(seq.computed);
    }

    fn release_blocks(&mut self, seq: &mut Sequence) {
        for b in seq.blocks.drain(..) {
            self.pool.release(b);
        }
    }

    fn release(&mut self, mut seq: Sequence) {
        if self.options.prefix_cache {
            keep_full_blocks(&mut self.pool, &mut seq);
        }
        self.release_blocks(&mut seq);
        self.unsteer(&mut seq);
    }

    /// Writes a step's inputs and submits its forward pass, the head over
    /// the rows that choose and their selection. With `tokens_on_gpu`, the
    /// rows' tokens are the ones the step before chose, copied there by it.
    /// On a split, a step of at least [`BatchOptions::pipeline_rows`] rows
    /// runs as one pass per device over consecutive ranges of its rows, in
    /// waves: in wave w device d runs pass w - d on the residual rows device
    /// d - 1 gave at the end of the wave before, so that the devices work
    /// on different passes at once (a sequence's rows in an earlier pass
    /// write their keys and values on each device before the later pass
    /// reaches it).
    fn submit(&mut self, rows: Vec<Row>, tokens_on_gpu: bool) -> Result<Submitted> {
        let (c, n, devices) = (&self.model.config, rows.len(), self.devices.len());
        let passes = match devices > 1 && n >= self.options.pipeline_rows.max(devices) {
            true => devices,
            false => 1,
        };
        let ranges: Vec<std::ops::Range<usize>> =
            (0..passes).map(|m| n * m / passes..n * (m + 1) / passes).collect();
        let inputs: Vec<PassInputs> = ranges.iter().map(|r| self.pass_inputs(&rows[r.clone()])).collect();
        let choosing: Vec<usize> = ranges
            .iter()
            .zip(&inputs)
            .flat_map(|(r, p)| p.choosing.iter().map(move |&i| r.start + i))
            .collect();
        let wants_logits = choosing.iter().any(|&i| self.running[rows[i].seq].wants_logits());
        let slot = self.next_readback;
        let mut chosen = 0;
        let mut carried: Vec<Option<Vec<f32>>> = vec![None; devices];
        let mut index = None;
        for wave in crate::model::split::waves(passes, devices) {
            for &(d, m) in &wave {
                let device = &self.devices[d];
                let (pass, pass_rows) = (&inputs[m], &rows[ranges[m].clone()]);
                let gpu = &device.model.gpu;
                device.write_step(&pass.step, (&pass.meta, &pass.table), &pass.rotary, &pass.steer_slots);
                let media = match d {
                    0 => {
                        if !tokens_on_gpu {
                            let tokens: Vec<u32> =
                                pass_rows.iter().map(|r| self.running[r.seq].tokens[r.pos]).collect();
                            device.act.write_tokens(gpu, &tokens);
                        }
                        step_media(self.model, &device.act, &self.running, pass_rows)?
                    }
                    _ => None,
                };
                let last = d + 1 == devices;
                if last {
                    write_head_inputs(device, pass);
                }
                let mut rec = Recorder::new(gpu, self.timer.as_mut(), &mut self.flow_stats);
                device.forward(
                    &mut rec,
                    &pass.step,
                    carried[d].take().as_deref(),
                    self.options.routing,
                    media.as_ref(),
                )?;
                if !last {
                    let bytes = (pass_rows.len() * c.hidden * 4) as u64;
                    device.rows_out.record(rec.encoder(), &device.act.x, 0, bytes);
                    rec.finish()?;
                    continue;
                }
                let head = (&self.head, self.sample.as_slice());
                chosen += record_head(&mut rec, head, (device, pass), (slot, chosen), wants_logits);
                index = Some(rec.finish()?);
            }
            for (d, m) in wave.into_iter().filter(|&(d, _)| d + 1 < devices) {
                let (device, bytes) = (&self.devices[d], (ranges[m].len() * c.hidden * 4) as u64);
                carried[d + 1] = Some(device.rows_out.read(&device.model.gpu, bytes)?);
            }
        }
        let last = self.devices.last().expect("a model is on a device");
        self.next_readback = (self.next_readback + 1) % last.buffers.ids.len();
        if chosen > 0 {
            last.buffers.ids[slot].start_map((chosen * 4) as u64);
        }
        let index = index.expect("a step has a pass on the last device");
        Ok(Submitted { rows, choosing, slot, wants_logits, index })
    }

    /// The inputs of a pass over `rows`: each row's position, block table
    /// entry, partial slot and attention tile, the block tables, rotary
    /// rows and steering slots, the pass's step, and the rows that choose a
    /// token (their indexes in `rows`) with their sampling.
    fn pass_inputs(&self, rows: &[Row]) -> PassInputs {
        let c = &self.model.config;
        // The sequences of the pass, in order, and their block tables.
        let mut table_at = vec![usize::MAX; self.running.len()];
        let mut table: Vec<u32> = Vec::new();
        for r in rows {
            if table_at[r.seq] == usize::MAX {
                table_at[r.seq] = table.len();
                table.extend(&self.running[r.seq].blocks);
            }
        }
        let paged_rows: Vec<PagedRow> =
            rows.iter().map(|r| PagedRow { sequence: r.seq, position: r.pos, decode: r.decode }).collect();
        // Tiles every device's kernels take (devices of a split may differ
        // in their attention kernels, hence in their tiles).
        let tiling = PagedTiling::common(self.devices.iter().filter_map(|d| d.plan.paged_tiling()));
        let tiles = tiling.map_or_else(Vec::new, |t| t.tiles(&paged_rows));
        let mut slots = 0..;
        let meta: Vec<u32> = rows
            .iter()
            .enumerate()
            .flat_map(|(i, r)| {
                let slot = if r.decode { slots.next().unwrap() } else { NO_SLOT };
                [r.pos as u32, table_at[r.seq] as u32, slot, tiles.get(i).copied().unwrap_or(0)]
            })
            .collect();
        let width = self.rotary_row;
        let mut rotary: Vec<f32> = Vec::with_capacity(rows.len() * width);
        for r in rows {
            let text = |pos: usize| &self.rotary[pos * width..(pos + 1) * width];
            match &self.running[r.seq].media {
                Some(m) if r.pos < m.positions.len() => rotary.extend(c.rotary_row(m.positions[r.pos])),
                Some(m) => rotary.extend_from_slice(text((r.pos as i64 + m.offset).max(0) as usize)),
                None => rotary.extend_from_slice(text(r.pos)),
            }
        }
        let choosing: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].samples).collect();
        let sampling: Vec<RowSampling> = choosing
            .iter()
            .map(|&i| {
                let seq = &self.running[rows[i].seq];
                RowSampling::new(seq.request.sampling, seq.request.seed, rows[i].pos + 1, c.vocab)
            })
            .collect();
        let decode_rows = rows.iter().filter(|r| r.decode).count() as u32;
        let attend_tiles = tiles.len() as u32;
        let step = Step { pos0: 0, n_tokens: rows.len() as u32, attn_splits: 1, decode_rows, attend_tiles };
        let steer_slots: Vec<u32> = rows.iter().map(|r| self.running[r.seq].steer_slot).collect();
        PassInputs { step, meta, table, rotary, steer_slots, choosing, sampling }
    }

    /// Waits for a submitted step's ids and hands out its tokens (those of
    /// sequences that ended in an earlier step are dropped).
    fn complete(&mut self, step: Submitted) -> Result<Vec<Output>> {
        let last = self.devices.last().expect("a model is on at least one device");
        let (gpu, c, b) = (&last.model.gpu, &self.model.config, &last.buffers);
        let k = step.choosing.len();
        let ids: Vec<u32> = if k > 0 {
            b.ids[step.slot].finish_map(gpu, MapWait::Block(Some(step.index)), |m| {
                bytemuck::cast_slice::<u8, u32>(&m[..k * 4]).to_vec()
            })?
        } else {
            Vec::new()
        };
        let logits: Vec<f32> = if step.wants_logits {
            b.logits_readback.read(gpu, (k * c.vocab * 4) as u64)?
        } else {
            Vec::new()
        };

        self.stats.steps += 1;
        for r in &step.rows {
            let seq = &mut self.running[r.seq];
            if seq.finish.is_some() {
                continue;
            }
            seq.computed = seq.computed.max(r.pos + 1);
            if r.samples && seq.generated > 0 {
                self.stats.decode_rows += 1;
            } else {
                self.stats.prompt_rows += 1;
            }
        }
        let mut outputs = Vec::with_capacity(k);
        for (j, &i) in step.choosing.iter().enumerate() {
            let seq = &mut self.running[step.rows[i].seq];
            if seq.finish.is_some() {
                continue;
            }
            let id = ids[j];
            if id == crate::kernels::sample::NON_FINITE {
                return Err(Error::NonFiniteSample { position: step.rows[i].pos });
            }
            let row_logits = step.wants_logits.then(|| &logits[j * c.vocab..(j + 1) * c.vocab]);
            let logprobs = seq.request.logprobs.zip(row_logits).map(|(n, l)| logprobs_of(l, id, n));
            let logits = row_logits.filter(|_| seq.request.return_logits).map(<[f32]>::to_vec);
            seq.tokens.push(id);
            seq.generated += 1;
            seq.finish = if seq.request.stop_tokens.contains(&id) {
                Some(FinishReason::StopToken(id))
            } else if seq.generated >= seq.request.max_tokens {
                Some(FinishReason::MaxTokens)
            } else if seq.tokens.len() > self.context_len {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            let cached_tokens = seq.cached_tokens.unwrap_or(0);
            outputs.push(Output {
                sequence: seq.id,
                token: id,
                logprobs,
                logits,
                finish: seq.finish,
                cached_tokens,
            });
        }
        if self.options.prefix_cache {
            // Whole blocks are kept as soon as they are computed.
            for seq in &mut self.running {
                keep_full_blocks(&mut self.pool, seq);
            }
        }
        Ok(outputs)
    }
}

/// What one pass of a step writes to its devices (see
/// [`BatchEngine::pass_inputs`]).
struct PassInputs {
    step: Step,
    meta: Vec<u32>,
    table: Vec<u32>,
    rotary: Vec<f32>,
    steer_slots: Vec<u32>,
    /// The rows that choose a token, in the order of their ids.
    choosing: Vec<usize>,
    sampling: Vec<RowSampling>,
}

/// Writes the head's row count and the choosing rows' sampling of `pass`
/// to the last device.
fn write_head_inputs(last: &DeviceSteps<'_>, pass: &PassInputs) {
    let (gpu, b) = (&last.model.gpu, &last.buffers);
    let head_step = Step { n_tokens: pass.choosing.len() as u32, attn_splits: 1, ..Step::default() };
    gpu.queue.write_buffer(&b.head_step, 0, bytemuck::bytes_of(&head_step));
    if !pass.sampling.is_empty() {
        gpu.queue.write_buffer(&b.sampling, 0, bytemuck::cast_slice(&pass.sampling));
    }
}

/// Records the head and the selection of `pass`'s choosing rows on the
/// last device, their ids (and with `wants_logits` their logits) copied
/// into the readbacks of the step's ids `slot` after the `chosen` before
/// them; returns how many rows chose.
fn record_head(
    rec: &mut Recorder<'_>,
    (head, sample): (&RowsHead, &[crate::gpu::Dispatch]),
    (last, pass): (&DeviceSteps<'_>, &PassInputs),
    (slot, chosen): (usize, usize),
    wants_logits: bool,
) -> usize {
    let k = pass.choosing.len();
    if k == 0 {
        return 0;
    }
    let c = &last.model.config;
    let (b, row_bytes) = (&last.buffers, (c.hidden * 4) as u64);
    for (j, &i) in pass.choosing.iter().enumerate() {
        let (from, to) = (i as u64 * row_bytes, j as u64 * row_bytes);
        rec.encoder().copy_buffer_to_buffer(&last.act.x, from, &b.x_rows, to, row_bytes);
    }
    head.encode(rec, k as u32, last.plan.uses_gemm(k));
    rec.encode(crate::stats::Phase::Head, sample, k as u32);
    // The chosen ids are the next decode step's tokens, in order (taken
    // from there only where one device runs every layer).
    rec.encoder().copy_buffer_to_buffer(&b.sampled, 0, &last.act.tokens, 0, (k * 4) as u64);
    b.ids[slot].record_at(rec.encoder(), &b.sampled, 0, (chosen * 4) as u64, (k * 4) as u64);
    if wants_logits {
        let (at, bytes) = ((chosen * c.vocab * 4) as u64, (k * c.vocab * 4) as u64);
        b.logits_readback.record_at(rec.encoder(), &b.logits, 0, at, bytes);
    }
    k
}

/// A step on the GPU, its ids not yet read.
struct Submitted {
    rows: Vec<Row>,
    /// The rows that choose a token, in the order of the ids.
    choosing: Vec<usize>,
    /// Its ids' readback.
    slot: usize,
    wants_logits: bool,
    index: wgpu::SubmissionIndex,
}

/// What the step's image tokens add: each image's rows copied over its
/// tokens' embeddings and its deepstack rows added after the first layers
/// (`None`: no row of the step is an image's).
fn step_media<'a>(
    model: &Model,
    act: &Activations,
    running: &'a [Sequence],
    rows: &[Row],
) -> Result<Option<ChunkMedia<'a>>> {
    let mut media = ChunkMedia::default();
    let mut first = 0;
    while first < rows.len() {
        // A sequence's rows are consecutive, at consecutive positions.
        let (seq, start) = (rows[first].seq, rows[first].pos);
        let end = first + rows[first..].iter().take_while(|r| r.seq == seq).count();
        if let Some(m) = &running[seq].media {
            add_image_rows(model, act, &m.images, start..start + (end - first), first, &mut media)?;
        }
        first = end;
    }
    Ok((!media.copies.is_empty()).then_some(media))
}

/// Keeps the sequence's whole computed blocks (not kept yet) for reuse.
fn keep_full_blocks(pool: &mut BlockPool, seq: &mut Sequence) {
    if seq.keeps_blocks_apart() {
        return;
    }
    let block = pool.block_size();
    while (seq.kept.len() + 1) * block <= seq.computed {
        let b = seq.kept.len();
        let hash =
            pool.keep(seq.blocks[b], seq.kept.last().copied(), &seq.tokens[b * block..(b + 1) * block]);
        seq.kept.push(hash);
    }
}

/// The log-softmax of `logits` at `id`, and the `n` likeliest ids'.
fn logprobs_of(logits: &[f32], id: u32, n: usize) -> Logprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |i: u32| (logits[i as usize] as f64 - log_z) as f32;
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if n > 0 && n < ids.len() {
        ids.select_nth_unstable_by(n - 1, by_logit);
    }
    ids.truncate(n);
    ids.sort_unstable_by(by_logit);
    Logprobs { logprob: lp(id), top: ids.into_iter().map(|i| (i, lp(i))).collect() }
}
