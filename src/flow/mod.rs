//! The layer flow: the dispatches of one forward pass, built once per
//! session with every binding fixed, and replayed for each submission.
//!
//! One decoder layer (DESIGN.md section 1), as one token runs it: six
//! dispatches for a dense layer, each a pass over its weights or the cache.
//! ```text
//! qkv    = rms_norm(x, input_layernorm) @ [q; k; v]    gemv NORM
//! attn   = attention(rope(qk_norm(q)), K[..=pos], V[..=pos])
//!          with K[pos], V[pos] = rope(qk_norm(k)), v   attention decode
//!                                                      (+ combine when split)
//! x     += attn @ o_proj                               gemv ADD
//! dense: act = silu(h @ gate) * (h @ up),              gemv NORM SWIGLU
//!              h = rms_norm(x, post_attention_layernorm)
//!        x  += act @ down                              gemv ADD (+ steering, capture)
//! moe:   ids, w = family_topk(h @ router)              gemv NORM, router
//!                                    (readback: the host reads ids before the experts run)
//!        act_j = silu(h @ gate_e) * (h @ up_e), e = ids_j   gemv NORM SWIGLU SLOTS
//!        x  += sum_j w_j act_j @ down_e                gemv ADD SUM (+ steering, capture)
//! ```
//! then `logits = rms_norm(x, norm) @ lm_head` (gemv NORM), raw, and where
//! the session asks, the next token chosen on the GPU.
//! Where a layer's value rows are a part of the q/k/v weight of their own
//! (another weight format, as in Q4_K_M files), the projection is two
//! dispatches that write different buffers and so run side by side
//! (`first_value_row_apart`).
//!
//! A prompt chunk runs the same steps with kernels for many tokens: on
//! GPUs the projections are GEMMs of `h`, the normalised rows, which the
//! residual add before them writes beside `x` (`rms_norm` ADD; the first
//! layer's, a MoE layer's and the next after an image's rows `rms_norm`
//! alone), then the residual add (the gate/up GEMM applies the SwiGLU as
//! it writes), attention is
//! `rope_store` + `attend` (or `attend_coop`); MoE layers group the chunk's
//! tokens by expert (on the GPU, or on the host from the routing read back).
//! On cooperative matrices in f16, `h`, `attend_coop`'s rows and the
//! SwiGLU's outputs are also written as f16, which the large GEMMs read
//! instead (`kernels::gemm::HalfCopies`); the o and down projections, where
//! they have few tiles, as partial sums over k that their residual add
//! sums (`Gemm::plan_summed`).

mod buffers;
pub(crate) mod moe;
mod recorder;
pub mod vision;

pub use buffers::Activations;
#[cfg(feature = "internals")]
pub use buffers::{MoeActivations, ValueRows};
pub use moe::{ExpertPrefetch, RoutingMode};
pub use recorder::{PhaseTimer, Recorder};

use crate::capture::CapturePlan;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor};
use crate::kernels::Step;
use crate::kernels::attention::{
    AttentionBindings, AttentionShape, DecodeAttention, PagedAttention, PagedRows, PagedTiling,
    QkNormWeights, SplitScratch,
};
use crate::kernels::gemm::{Epilogue, Gemm, HalfCopies, PrefillPrecision};
use crate::kernels::gemv::{GemvSpec, Input, Output, Rows};
use crate::kernels::residual::LayerOutput;
use crate::kernels::rms_norm::Rows as NormRows;
use crate::kernels::sample::SampleBindings;
use crate::kernels::{gemm_coop, split_sum};
use crate::kv_cache::Heads;
use crate::kv_cache::KvCache;
use crate::model::{FfnWeights, Model};
use crate::sampling::Sampling;
use crate::stats::Phase;
use crate::steering::SteeringPlan;
use moe::MoePlan;

/// Where a plan's attention keeps its keys and values.
pub enum KvLayout<'a> {
    /// One sequence's cache: position j in row j; one token at a time runs
    /// the decode attention.
    Contiguous(&'a KvCache),
    /// A pool of blocks the rows of a ragged batch share, each row over its
    /// own sequence's blocks (`kernels::attention::Attention::plan_paged`).
    Paged(&'a KvCache, PagedRows<'a>),
}

impl KvLayout<'_> {
    fn cache(&self) -> &KvCache {
        match self {
            KvLayout::Contiguous(kv) | KvLayout::Paged(kv, _) => kv,
        }
    }
}

/// Which kernel runs the projections of a prompt chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChunkMatmul {
    /// The GEMM on GPUs; on CPU rasterisers (lavapipe, llvmpipe), where
    /// barrier-heavy kernels are slow, the GEMV once per token.
    #[default]
    Auto,
    /// The tiled GEMM: each weight read once per chunk.
    Gemm,
    /// The GEMV, once per token of the chunk.
    Gemv,
}

impl ChunkMatmul {
    /// Whether prompt chunks run on the GEMM on `gpu` (`Auto`: unless it
    /// is a CPU rasteriser).
    pub fn uses_gemm(self, gpu: &Gpu) -> bool {
        match self {
            ChunkMatmul::Auto => !gpu.caps.is_cpu,
            ChunkMatmul::Gemm => true,
            ChunkMatmul::Gemv => false,
        }
    }

    /// The GEMM that runs chunks, in `precision`; `None` where the GEMV does.
    pub fn gemm(self, gpu: &Gpu, precision: PrefillPrecision) -> Result<Option<Gemm>> {
        self.uses_gemm(gpu).then(|| Gemm::new(gpu, precision)).transpose()
    }
}

/// What a forward pass ends with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// No head (a prompt chunk before the last).
    None,
    /// The last token's logits.
    Logits,
    /// The logits, and the next token chosen from them into `tokens[0]`.
    Sample,
}

/// A projection: the fused GEMV (any token count), and for chunks, when
/// the plan uses the GEMM, the unfused GEMM sequence (norm, GEMM, then the
/// add or the gate).
#[derive(Debug)]
struct Projection {
    gemv: Vec<Dispatch>,
    chunk: ChunkPlans,
}

impl Projection {
    /// Encodes the projection of `n_tokens` rows: through the GEMM where
    /// `gemm` says so and the plan has one, else the GEMV per row.
    fn encode(&self, rec: &mut Recorder<'_>, phase: Phase, n_tokens: u32, gemm: bool) {
        let dispatches = match self.chunk.for_tokens(n_tokens as usize) {
            Some(chunk) if gemm => chunk,
            _ => self.gemv.as_slice(),
        };
        rec.encode(phase, dispatches, n_tokens);
    }
}

/// A chunk's GEMM sequence planned for each class of chunk lengths: the
/// tiles that keep the GPU busy at 4096 tokens leave it half idle at 512
/// (the 8B shape's 4096 x 14336 down projection runs 512 tokens faster in
/// 128 x 128 tiles than in the 128 x 256 chosen for 4096), and a batch's
/// decode steps of 16 to 64 rows run in tiles and ranges of k of their own
/// (`gemm_coop::Tile::few_tokens`). Classes end at powers of two from
/// [`Self::SHORTEST`] up to the longest chunk; neighbours planned alike
/// are merged. Empty where chunks run the GEMV.
#[derive(Debug, Default)]
struct ChunkPlans(Vec<(usize, Vec<Dispatch>)>);

impl ChunkPlans {
    /// The shortest class's longest chunk: below it, tiles of 32 tokens
    /// (the smallest) are chosen whatever the length, in as many ranges
    /// of k.
    const SHORTEST: usize = 16;

    /// `plan(gemm, most)` for each class, `most` its longest chunk.
    fn new(
        gemm: Option<&Gemm>,
        max_tokens: usize,
        plan: impl Fn(&Gemm, usize) -> Result<Vec<Dispatch>>,
    ) -> Result<Self> {
        let Some(gemm) = gemm else { return Ok(Self::default()) };
        let mut classes: Vec<(usize, Vec<Dispatch>)> = Vec::new();
        for most in Self::ends(max_tokens) {
            let dispatches = plan(gemm, most)?;
            match classes.last_mut() {
                Some((end, last)) if same_kernels(last, &dispatches) => *end = most,
                _ => classes.push((most, dispatches)),
            }
        }
        Ok(Self(classes))
    }

    /// Each class's longest chunk, shortest first.
    fn ends(max_tokens: usize) -> impl Iterator<Item = usize> {
        let below = std::iter::successors(Some(Self::SHORTEST), |&n| Some(2 * n))
            .take_while(move |&n| n < max_tokens);
        below.chain([max_tokens])
    }

    /// The sequence for a chunk of `n_tokens` (at most the longest chunk).
    fn for_tokens(&self, n_tokens: usize) -> Option<&[Dispatch]> {
        let class = self.0.iter().find(|(most, _)| n_tokens <= *most).or(self.0.last());
        class.map(|(_, dispatches)| dispatches.as_slice())
    }
}

/// The room a chunk's GEMMs need for partial sums over ranges of k
/// (`Gemm::plan_summed`), in the chunk's activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmScratch {
    /// Rows of `Activations::attn_out` and `ffn_out`, where a chunk's o
    /// and dense down projections write their products for the residual
    /// add: the longest chunk's tokens, or more where a class of chunks may
    /// run one as partial sums over k (which splits only a product reading
    /// an f16 copy of its input, or one over few tokens), a row per token
    /// and part; the most either projection may need, for both buffers.
    pub summed_rows: usize,
    /// Floats of `Activations::split_parts`, where a class of few tokens
    /// runs a layer's q/k/v or dense gate/up as partial sums over k (0:
    /// none does).
    pub split_floats: usize,
}

impl GemmScratch {
    /// The room the products of `model` need in chunks of up to
    /// `max_tokens` tokens through `gemm` (none: chunks run the GEMV).
    pub fn new(model: &Model, gemm: Option<&Gemm>, max_tokens: usize) -> Self {
        let Some(gemm) = gemm else { return GemmScratch { summed_rows: max_tokens, split_floats: 0 } };
        let layers = &model.weights.layers;
        let (summed, split): (Vec<&GpuTensor>, Vec<&GpuTensor>) = layers
            .iter()
            .flat_map(|l| match &l.ffn {
                FfnWeights::Dense { gate_up, down } => vec![(&l.o_proj, &l.qkv), (down, gate_up)],
                FfnWeights::Moe(_) => vec![(&l.o_proj, &l.qkv)],
            })
            .unzip();
        let parts = |w: &GpuTensor, most: usize| gemm.summed_splits(&model.gpu, w, most);
        let classes = || ChunkPlans::ends(max_tokens);
        let summed_rows = summed.iter().flat_map(|&w| classes().map(move |most| most * parts(w, most)));
        let split_floats = split.iter().flat_map(|&w| {
            classes()
                .filter(|&most| Builder::splits_few(most) && parts(w, most) > 1)
                .map(move |most| most * parts(w, most) * w.rows)
        });
        GemmScratch {
            summed_rows: summed_rows.fold(max_tokens, usize::max),
            split_floats: split_floats.max().unwrap_or(0),
        }
    }
}

/// Whether two sequences run the same pipelines over the same grids.
fn same_kernels(a: &[Dispatch], b: &[Dispatch]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(a, b)| {
            a.pipeline == b.pipeline
                && a.workgroups == b.workgroups
                && a.tokens_per_workgroup == b.tokens_per_workgroup
        })
}

/// What a prompt chunk holding image tokens adds to the forward pass: the
/// images' merged rows copied over the embeddings of their tokens, and
/// after the first layers, each image's deepstack rows added at them.
#[derive(Debug, Default)]
pub struct ChunkMedia<'a> {
    pub copies: Vec<RowCopy<'a>>,
    /// `after_layer[i]`: adds (and the rows each covers) after layer `i`.
    pub after_layer: Vec<Vec<(Dispatch, u32)>>,
}

/// `rows` rows of `src` from `src_row` into the residual stream's rows
/// from `dst_row`.
#[derive(Debug)]
pub struct RowCopy<'a> {
    pub src: &'a wgpu::Buffer,
    pub src_row: usize,
    pub dst_row: usize,
    pub rows: usize,
}

/// Builds projections for one model and session.
struct Builder<'a> {
    model: &'a Model,
    act: &'a Activations,
    /// The session's chunk GEMM; `None`: chunks run the GEMV per token.
    gemm: Option<&'a Gemm>,
    /// How chunks on cooperative matrices round their operands.
    precision: PrefillPrecision,
}

impl<'a> Builder<'a> {
    fn gemv(&self, spec: GemvSpec<'_>) -> Result<Vec<Dispatch>> {
        self.model.kernels.gemv.plan(&self.model.gpu, &spec)
    }

    /// `y = W rms_norm(x)`; a chunk's GEMM reads `act.h` (or `act.h16`),
    /// the rows normalised before it (by the add before it, or
    /// [`Self::input_norm`]).
    /// With `apart`, the rows from its `row` on go to its buffers.
    fn normed(
        &self,
        weight: &GpuTensor,
        norm: &GpuTensor,
        x: &wgpu::Buffer,
        (y, apart): (&wgpu::Buffer, Option<RowsApart<'_>>),
    ) -> Result<Projection> {
        let (gpu, act, eps) = (&self.model.gpu, self.act, self.model.config.rms_eps);
        let input = Input::RmsNorm { weight: norm, eps };
        let rows = match apart {
            Some(a) => Rows::DenseApart { from_row: a.row, tail: a.gemv },
            None => Rows::Dense,
        };
        let gemv = self.gemv(GemvSpec { input, rows, ..GemvSpec::plain(weight, x, y) })?;
        let tail = apart.map(|a| (a.row, a.gemm));
        let half = HalfCopies { x: act.h16.as_ref(), y: None };
        let chunk = self.chunk(|gemm, tokens| {
            match self.split(gemm, weight, Epilogue::Plain, tokens, (y, tail))? {
                Some(split) => Ok(split),
                None => {
                    gemm.plan_apart(gpu, weight, Epilogue::Plain, tokens, &act.step, &act.h, (y, tail), half)
                }
            }
        })?;
        Ok(Projection { gemv, chunk })
    }

    /// A chunk's `act.h = rms_norm(act.x)` (and `act.h16`) where no add
    /// before it wrote it; `None` where chunks run the GEMV (which
    /// normalises `x` itself).
    fn input_norm(&self, norm: &GpuTensor) -> Result<Option<Dispatch>> {
        let (gpu, k, act) = (&self.model.gpu, &self.model.kernels, self.act);
        let rows = NormRows::vector(act.hidden);
        let out = (&act.h, act.h16.as_ref());
        let eps = self.model.config.rms_eps;
        self.gemm.map(|_| k.rms_norm.plan_with_copy(gpu, norm, eps, &act.x, out, rows)).transpose()
    }

    /// Where a dense FFN's gate/up writes its outputs as f16 too (and its
    /// down projection reads them): where its product takes them.
    fn ffn_act16(&self, gate_up: &GpuTensor) -> Option<&'a wgpu::Buffer> {
        let takes = self.gemm.is_some_and(|g| g.takes_half_copies(gate_up));
        self.act.ffn_act16.as_ref().filter(|_| takes)
    }

    /// `x = layer_output(x + W a)` (a chunk's GEMM reading `a16`, an f16
    /// copy of `a`, where given, unless it has few tokens: see
    /// [`Self::splits_few`]); a chunk's GEMM goes through `scratch` (as
    /// partial sums over k where it has few tiles: the add sums them), and
    /// with `then_norm` its add also writes `act.h = rms_norm(x)` (and
    /// `act.h16`) for the projection after it.
    fn add_into(
        &self,
        weight: &GpuTensor,
        (a, a16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        (x, scratch): (&wgpu::Buffer, &wgpu::Buffer),
        output: &LayerOutput<'_>,
        then_norm: Option<&GpuTensor>,
    ) -> Result<Projection> {
        let (gpu, k, act) = (&self.model.gpu, &self.model.kernels, self.act);
        let gemv =
            self.gemv(GemvSpec { output: Output::Add(output.clone()), ..GemvSpec::plain(weight, a, x) })?;
        let chunk = self.chunk(|gemm, tokens| {
            let a16 = a16.filter(|_| !Self::splits_few(tokens));
            let (mut d, parts) = gemm.plan_summed(gpu, weight, tokens, &act.step, (a, a16), scratch)?;
            d.push(match then_norm {
                Some(norm) => k.rms_norm.plan_after_add(
                    gpu,
                    norm,
                    self.model.config.rms_eps,
                    (scratch, parts),
                    x,
                    (&act.h, act.h16.as_ref()),
                    output,
                )?,
                None => k.residual.plan(gpu, weight.rows, 1.0, (scratch, parts), x, output)?,
            });
            Ok(d)
        })?;
        Ok(Projection { gemv, chunk })
    }

    /// A dense layer's down projection, added into the residual stream at
    /// the layer's output (`output`), normalising it for the next layer's
    /// q/k/v where there is one.
    fn down(&self, layer: usize, down: &GpuTensor, output: &LayerOutput<'_>) -> Result<Projection> {
        let (model, act) = (self.model, self.act);
        // The add writes the next layer's normalised input where this
        // device holds that layer.
        let next_norm = model.layers().contains(&(layer + 1)).then(|| &model.layer(layer + 1).attn_norm);
        let act16 = match &model.layer(layer).ffn {
            FfnWeights::Dense { gate_up, .. } => self.ffn_act16(gate_up),
            FfnWeights::Moe(_) => None,
        };
        self.add_into(down, (&act.ffn_act, act16), (&act.x, &act.ffn_out), output, next_norm)
    }

    /// `act = silu(h W_gate) * (h W_up)`, h = rms_norm(x), W gate/up
    /// interleaved; a chunk's GEMM reads `act.h` or `act.h16` (see
    /// [`Self::normed`]) and writes `out` (and `act.ffn_act16`).
    fn gated(
        &self,
        weight: &GpuTensor,
        norm: &GpuTensor,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<Projection> {
        let (gpu, act) = (&self.model.gpu, self.act);
        let eps = self.model.config.rms_eps;
        let input = Input::RmsNorm { weight: norm, eps };
        let gemv =
            self.gemv(GemvSpec { input, output: Output::Swiglu, ..GemvSpec::plain(weight, x, out) })?;
        let half = HalfCopies { x: act.h16.as_ref(), y: self.ffn_act16(weight) };
        let chunk = self.chunk(|gemm, tokens| {
            match self.split(gemm, weight, Epilogue::Swiglu, tokens, (out, None))? {
                Some(split) => Ok(split),
                None => gemm.plan_apart(
                    gpu,
                    weight,
                    Epilogue::Swiglu,
                    tokens,
                    &act.step,
                    &act.h,
                    (out, None),
                    half,
                ),
            }
        })?;
        Ok(Projection { gemv, chunk })
    }

    /// Whether chunks of up to `tokens` tokens run a layer's q/k/v and
    /// dense gate/up as partial sums over k where they split
    /// (`Gemm::summed_splits`): few-token products, whose tiles leave a
    /// large GPU's multiprocessors short of workgroups, each walking all
    /// of k a step at a time. Their inputs are f32 rows, and their outputs
    /// f32 alone (the down projection over as few tokens reads the f32
    /// rows too).
    fn splits_few(tokens: usize) -> bool {
        tokens <= gemm_coop::FEW_TOKENS
    }

    /// `out = W act.h` through `epilogue` over up to `tokens` tokens as
    /// partial sums over ranges of k in `act.split_parts` and their sum
    /// (see [`Self::splits_few`]), where the product splits; `None` where
    /// it runs whole. With `apart`, the rows from its row on are summed
    /// into its buffer (as [`Gemm::plan_apart`] writes them).
    fn split(
        &self,
        gemm: &Gemm,
        weight: &GpuTensor,
        epilogue: Epilogue,
        tokens: usize,
        (out, apart): (&wgpu::Buffer, Option<(usize, &wgpu::Buffer)>),
    ) -> Result<Option<Vec<Dispatch>>> {
        let (gpu, act) = (&self.model.gpu, self.act);
        let Some(parts_buffer) = act.split_parts.as_ref() else { return Ok(None) };
        if !Self::splits_few(tokens) || gemm.summed_splits(gpu, weight, tokens) < 2 {
            return Ok(None);
        }
        let (mut d, parts) =
            gemm.plan_summed(gpu, weight, tokens, &act.step, (&act.h, None), parts_buffer)?;
        d.push(split_sum::plan(gpu, weight.rows, epilogue, (parts_buffer, parts), (out, apart))?);
        Ok(Some(d))
    }

    fn chunk(&self, plan: impl Fn(&Gemm, usize) -> Result<Vec<Dispatch>>) -> Result<ChunkPlans> {
        ChunkPlans::new(self.gemm, self.act.max_tokens, plan)
    }
}

/// The attention half of a layer, in flow order.
#[derive(Debug)]
struct AttentionPlan {
    /// A chunk's norm of the layer's input, where the add before it did
    /// not write it (`None` where chunks run the GEMV).
    input_norm: Option<Dispatch>,
    qkv: Projection,
    /// One token's attention (`None` over a paged cache, whose rows all
    /// run `paged`).
    decode: Option<DecodeAttention>,
    /// A chunk's rope_store and attend (over one sequence's cache).
    chunk: Vec<Dispatch>,
    /// A ragged batch's attention (over a paged cache).
    paged: Option<PagedAttention>,
    o_proj: Projection,
}

#[derive(Debug)]
struct DensePlan {
    gate_up: Projection,
    down: Projection,
}

#[derive(Debug)]
enum FfnPlan {
    Dense(DensePlan),
    Moe(Box<MoePlan>),
}

#[derive(Debug)]
struct LayerPlan {
    attention: AttentionPlan,
    ffn: FfnPlan,
}

/// The whole forward pass for up to `Activations::max_tokens` tokens.
#[derive(Debug)]
pub struct Plan {
    embed: Vec<Dispatch>,
    layers: Vec<LayerPlan>,
    /// One token: the head reads `x` itself.
    head: Vec<Dispatch>,
    /// A chunk: the head reads the last token's row, copied to `x_last`.
    head_last: Vec<Dispatch>,
    /// Token selection, once the session sets it.
    sample: Vec<Dispatch>,
    precision: PrefillPrecision,
    /// Fewest rows whose projections run through the GEMM (where there is
    /// one): fewer run the GEMV, once per row.
    gemm_rows: usize,
    /// Fewest rows per expert, on average over a MoE layer's experts, for
    /// which its experts run through the grouped GEMM (0: whenever the
    /// projections do).
    expert_gemm_rows: usize,
}

impl Plan {
    /// The session's passes; chunks through `gemm` (the GEMV where
    /// `None`), on cooperative matrices in `precision`.
    pub fn new(
        model: &Model,
        act: &Activations,
        gemm: Option<&Gemm>,
        precision: PrefillPrecision,
        kv: KvLayout<'_>,
    ) -> Result<Plan> {
        let b = Builder { model, act, gemm, precision };
        let w = &model.weights;
        let gpu: &Gpu = &model.gpu;
        // A device that does not end the model has no head, one that does
        // not begin it no embedding: their plans encode nothing for them.
        let head = |x: &wgpu::Buffer| match w.output() {
            Ok((norm, head)) => {
                let input = Input::RmsNorm { weight: norm, eps: model.config.rms_eps };
                b.gemv(GemvSpec { input, ..GemvSpec::plain(head, x, &act.logits) })
            }
            Err(_) => Ok(Vec::new()),
        };
        let layers = model
            .layers()
            .map(|i| {
                Ok(LayerPlan {
                    attention: AttentionPlan::new(&b, &kv, i)?,
                    ffn: match &model.layer(i).ffn {
                        FfnWeights::Dense { gate_up, down } => FfnPlan::Dense(DensePlan {
                            gate_up: b.gated(gate_up, &model.layer(i).ffn_norm, &act.x, &act.ffn_act)?,
                            down: b.down(i, down, &LayerOutput::default())?,
                        }),
                        FfnWeights::Moe(mw) => FfnPlan::Moe(Box::new(MoePlan::new(model, act, gemm, mw, i)?)),
                    },
                })
            })
            .collect::<Result<_>>()?;
        Ok(Plan {
            embed: match &w.embed {
                Some(embed) => model.kernels.embed.plan(gpu, embed, &act.tokens, &act.x)?,
                None => Vec::new(),
            },
            layers,
            head: head(&act.x)?,
            head_last: head(&act.x_last)?,
            sample: Vec::new(),
            precision,
            gemm_rows: 2,
            expert_gemm_rows: 0,
        })
    }

    /// Rebuilds every layer's last add with the session's steering and
    /// capture (either may be unset: that layer's add then does only the add).
    pub(crate) fn set_layer_outputs(
        &mut self,
        model: &Model,
        act: &Activations,
        gemm: Option<&Gemm>,
        steering: Option<&SteeringPlan>,
        capture: Option<&CapturePlan>,
    ) -> Result<()> {
        let b = Builder { model, act, gemm, precision: self.precision };
        for (i, layer) in model.layers().zip(self.layers.iter_mut()) {
            let output = LayerOutput {
                steer: steering.and_then(|s| s.layer(i)),
                steer_slots: steering.and_then(|s| s.slots()),
                capture: capture.and_then(|c| c.target(i)),
            };
            match (&mut layer.ffn, &model.layer(i).ffn) {
                (FfnPlan::Dense(dense), FfnWeights::Dense { down, .. }) => {
                    dense.down = b.down(i, down, &output)?
                }
                (FfnPlan::Moe(moe), FfnWeights::Moe(mw)) => moe.set_output(model, act, mw, &output)?,
                _ => unreachable!("a layer's plan follows its weights"),
            }
        }
        Ok(())
    }

    /// Runs the projections of passes of fewer than `rows` rows through the
    /// GEMV, once per row (the GEMM's weight tiles leave a large GPU idle
    /// on a few rows; a lone sequence's plan switches at 2).
    pub(crate) fn set_gemm_rows(&mut self, rows: usize) {
        self.gemm_rows = rows.max(2);
    }

    /// How the paged attention of every layer cuts a ragged batch's rows
    /// into tiles (the layers share the rows' buffer, their heads and
    /// kernels); `None` without a paged cache.
    pub(crate) fn paged_tiling(&self) -> Option<PagedTiling> {
        self.layers.first().and_then(|l| l.attention.paged.as_ref()).map(PagedAttention::tiling)
    }

    /// Runs a MoE layer's experts through the GEMV, one slot at a time, in
    /// passes whose rows give its experts fewer than `rows` each on
    /// average: the grouped GEMM's tiles of at least 32 tokens hold a
    /// batch step's few rows per expert.
    pub(crate) fn set_expert_gemm_rows(&mut self, rows: usize) {
        self.expert_gemm_rows = rows;
    }

    /// Whether a pass of `n` rows runs its projections through the GEMM.
    pub(crate) fn uses_gemm(&self, n: usize) -> bool {
        n >= self.gemm_rows
    }

    /// Whether a pass of `n` rows runs the experts of `moe` through the
    /// grouped GEMM.
    fn experts_use_gemm(&self, n: usize, moe: &MoePlan) -> bool {
        let (top_k, experts) = moe.routing_shape();
        self.uses_gemm(n) && n * top_k >= self.expert_gemm_rows * experts
    }

    /// Sets how [`Head::Sample`] chooses the next token.
    pub(crate) fn set_sampling(
        &mut self,
        model: &Model,
        act: &Activations,
        sampling: Sampling,
        seed: u64,
    ) -> Result<()> {
        let b = SampleBindings {
            step: &act.step,
            logits: &act.logits,
            tokens: &act.tokens,
            scratch: &act.sample,
        };
        self.sample = model.kernels.sample.plan(&model.gpu, model.config.vocab, sampling, seed, &b)?;
        Ok(())
    }

    /// Records (and, at routing readbacks, submits) the forward pass of
    /// the tokens `step` describes, whose ids are already in `tokens`. The
    /// caller records its readbacks and finishes `rec`.
    pub(crate) fn forward<'a>(
        &self,
        rec: &mut Recorder<'a>,
        act: &Activations,
        step: &Step,
        head: Head,
        routing: &moe::RoutingContext<'a>,
        media: Option<&ChunkMedia<'_>>,
    ) -> Result<()> {
        let n = step.n_tokens;
        let gemm = self.uses_gemm(n as usize);
        rec.encode(Phase::Layers, &self.embed, n);
        let row = 4 * act.hidden as u64;
        for c in media.iter().flat_map(|m| &m.copies) {
            let (src, dst, len) = (c.src_row as u64 * row, c.dst_row as u64 * row, c.rows as u64 * row);
            rec.encoder().copy_buffer_to_buffer(c.src, src, &act.x, dst, len);
        }
        // Whether a chunk's `h` holds the next layer's normalised input:
        // a dense layer's output add writes it, unless an image's rows are
        // added after it.
        let mut h_ready = false;
        for (i, layer) in self.layers.iter().enumerate() {
            layer.attention.encode(rec, step, h_ready, gemm);
            match &layer.ffn {
                FfnPlan::Dense(dense) => {
                    dense.gate_up.encode(rec, Phase::Layers, n, gemm);
                    dense.down.encode(rec, Phase::Layers, n, gemm);
                }
                FfnPlan::Moe(moe) => moe.run(rec, n, routing, self.experts_use_gemm(n as usize, moe))?,
            }
            // A chunk GEMM's add wrote the next layer's normalised input.
            h_ready = gemm && matches!(layer.ffn, FfnPlan::Dense(_));
            for (add, rows) in media.iter().flat_map(|m| m.after_layer.get(i)).flatten() {
                rec.encode(Phase::Layers, std::slice::from_ref(add), *rows);
                h_ready = false;
            }
        }
        if head != Head::None {
            if n == 1 {
                rec.encode(Phase::Head, &self.head, 1);
            } else {
                rec.encoder().copy_buffer_to_buffer(&act.x, (n as u64 - 1) * row, &act.x_last, 0, row);
                rec.encode(Phase::Head, &self.head_last, 1);
            }
        }
        if head == Head::Sample {
            assert!(!self.sample.is_empty(), "set_sampling before sampling on the GPU");
            rec.encode(Phase::Head, &self.sample, 1);
        }
        rec.stats().forward_passes += 1;
        Ok(())
    }
}

/// The head over rows gathered from a ragged batch's residual stream (the
/// rows that choose a token): their final norm and LM head into rows of
/// logits, through the GEMM where chunks use it (the head's own `step`
/// carries the row count), else the GEMV per row.
#[derive(Debug)]
pub(crate) struct RowsHead(Projection);

impl RowsHead {
    /// The head reading up to `max_rows` rows of `x_rows` into `logits`.
    pub(crate) fn new(
        model: &Model,
        act: &Activations,
        gemm: Option<&Gemm>,
        (x_rows, logits): (&wgpu::Buffer, &wgpu::Buffer),
        step: &wgpu::Buffer,
        max_rows: usize,
    ) -> Result<Self> {
        let (gpu, k) = (&model.gpu, &model.kernels);
        let (final_norm, head) = model.weights.output()?;
        let eps = model.config.rms_eps;
        let input = Input::RmsNorm { weight: final_norm, eps };
        let gemv = k.gemv.plan(gpu, &GemvSpec { input, ..GemvSpec::plain(head, x_rows, logits) })?;
        let chunk = ChunkPlans::new(gemm, max_rows, |gemm, tokens| {
            let rows = NormRows::vector(act.hidden);
            let mut d = vec![k.rms_norm.plan_with_copy(
                gpu,
                final_norm,
                eps,
                x_rows,
                (&act.h, act.h16.as_ref()),
                rows,
            )?];
            let half = HalfCopies { x: act.h16.as_ref(), y: None };
            d.extend(gemm.plan_apart(
                gpu,
                head,
                Epilogue::Plain,
                tokens,
                step,
                &act.h,
                (logits, None),
                half,
            )?);
            Ok(d)
        })?;
        Ok(RowsHead(Projection { gemv, chunk }))
    }

    /// Encodes the head over `n_rows` rows, through the GEMM where `gemm`.
    pub(crate) fn encode(&self, rec: &mut Recorder<'_>, n_rows: u32, gemm: bool) {
        self.0.encode(rec, Phase::Head, n_rows, gemm);
    }
}

/// Where a projection's rows from `row` on go: `gemv`'s buffer for the
/// GEMV, `gemm`'s for a chunk's GEMM.
#[derive(Clone, Copy)]
struct RowsApart<'b> {
    row: usize,
    gemv: &'b wgpu::Buffer,
    gemm: &'b wgpu::Buffer,
}

/// The first value row of a layer's q/k/v projection where a part of it
/// starts there, `None` where a part holds rows on both sides. Such a part
/// (value rows in another weight format than the keys', as a Q4_K_M file's
/// Q6_K ones beside Q4_K) writes `act.values`, not `act.qkv`, so that its
/// dispatch runs beside the one before it instead of after it.
pub fn first_value_row_apart(qkv: &GpuTensor, heads: Heads) -> Option<usize> {
    let row = (heads.q + heads.kv) * heads.dim;
    qkv.parts.iter().any(|p| p.first_row == row).then_some(row)
}

impl AttentionPlan {
    fn new(b: &Builder<'_>, layout: &KvLayout<'_>, i: usize) -> Result<Self> {
        let kv = layout.cache();
        let (model, act) = (b.model, b.act);
        let (gpu, c, k) = (&model.gpu, &model.config, &model.kernels);
        let lw = model.layer(i);
        // The cache and value buffers this device keeps for its own layers.
        let local = i - model.layers().start;
        let qk_norm = match (&lw.q_norm, &lw.k_norm) {
            (Some(q), Some(k)) => Some(QkNormWeights { mode: c.family.qk_norm, q, k, eps: c.rms_eps }),
            _ => None,
        };
        let shape = AttentionShape {
            heads: c.heads,
            rotary_dim: c.rope.rotary_dim,
            scale: (c.heads.dim as f32).powf(-0.5),
            window: c.sliding_window.unwrap_or(0),
            qk_norm,
            kv_format: kv.format,
            chunk_precision: b.precision,
        };
        let apart = first_value_row_apart(&lw.qkv, c.heads).map(|row| {
            let values = act.values.as_ref().expect("buffers for value rows apart");
            // Over a paged cache the GEMV runs a step's rows too: it writes
            // the buffer of many rows.
            let gemv = match layout {
                KvLayout::Contiguous(_) => values.decode(local),
                KvLayout::Paged(..) => &values.chunk,
            };
            RowsApart { row, gemv, gemm: &values.chunk }
        });
        // The chunk's attention writes its rows as f16 too where the
        // o-projection's GEMM takes such copies and the attention can; a
        // ragged batch's does not (its decode rows are written in f32
        // alone), so its o-projection reads the f32 rows.
        let takes = b.gemm.is_some_and(|g| g.takes_half_copies(&lw.o_proj));
        let contiguous = matches!(layout, KvLayout::Contiguous(_));
        let attn16 =
            act.attn16.as_ref().filter(|_| takes && contiguous && k.attention.chunk_writes_f16(&shape));
        let bindings = |values, out16| AttentionBindings {
            step: &act.step,
            qkv: &act.qkv,
            cos_sin: &act.cos_sin,
            k_cache: &kv.k[local],
            v_cache: &kv.v[local],
            out: &act.attn,
            values,
            out16,
        };
        let (decode_bindings, chunk_bindings) =
            (bindings(apart.map(|a| a.gemv), None), bindings(apart.map(|a| a.gemm), attn16));
        let scratch = SplitScratch { acc: &act.attn_split_acc, max_sum: &act.attn_split_max_sum };
        // A dense FFN's gate/up reads the norm the o-projection's add
        // writes; a MoE layer normalises its own input.
        let ffn_norm = matches!(lw.ffn, FfnWeights::Dense { .. }).then_some(&lw.ffn_norm);
        let o_out = (&act.x, &act.attn_out);
        Ok(AttentionPlan {
            input_norm: b.input_norm(&lw.attn_norm)?,
            qkv: b.normed(&lw.qkv, &lw.attn_norm, &act.x, (&act.qkv, apart))?,
            decode: match layout {
                KvLayout::Contiguous(_) => {
                    Some(k.attention.plan_decode(gpu, &shape, &decode_bindings, &scratch)?)
                }
                KvLayout::Paged(..) => None,
            },
            chunk: match layout {
                KvLayout::Contiguous(_) => k.attention.plan_chunk(gpu, &shape, &chunk_bindings)?,
                KvLayout::Paged(..) => Vec::new(),
            },
            paged: match layout {
                KvLayout::Contiguous(_) => None,
                KvLayout::Paged(_, paged) => {
                    Some(k.attention.plan_paged(gpu, &shape, &chunk_bindings, paged)?)
                }
            },
            o_proj: b.add_into(&lw.o_proj, (&act.attn, attn16), o_out, &LayerOutput::default(), ffn_norm)?,
        })
    }

    /// `h_ready`: a chunk's normalised input is in `act.h` (and `act.h16`)
    /// already; `gemm`: the projections run through the GEMM.
    fn encode(&self, rec: &mut Recorder<'_>, step: &Step, h_ready: bool, gemm: bool) {
        let n = step.n_tokens;
        if let Some(norm) = self.input_norm.as_ref().filter(|_| gemm && !h_ready) {
            rec.encode(Phase::Layers, std::slice::from_ref(norm), n);
        }
        self.qkv.encode(rec, Phase::Layers, n, gemm);
        match (&self.paged, &self.decode) {
            (Some(paged), _) => {
                for (d, rows) in paged.dispatches(n, step.decode_rows, step.attend_tiles) {
                    rec.encode(Phase::Layers, std::slice::from_ref(d), rows);
                }
            }
            (None, Some(decode)) if n == 1 => {
                let count = decode.encode(rec.pass(Phase::Layers), step.attn_splits);
                rec.count(count);
            }
            _ => rec.encode(Phase::Layers, &self.chunk, n),
        }
        self.o_proj.encode(rec, Phase::Layers, n, gemm);
    }
}
