//! The routed FFN of a MoE layer. The router and its top-k run on the GPU,
//! and the expert kernels read the choice there: one dispatch for every
//! slot's gate/up and one for the weighted sum of their down projections.
//! In readback mode the choice is also copied to the host, which ends the
//! submission: for one token the host records what follows while the GPU
//! runs and reads the choice before submitting it; a prompt chunk waits for
//! it, groups its tokens by expert and runs one GEMM per chosen expert, so
//! each expert's weights are read once per chunk.
//!
//! With expert streaming the host places the experts a dispatch needs in
//! the layer's GPU slots before it runs ([`ExpertStreaming::place`]) and
//! rewrites the ids the kernels read into slot numbers: a token's experts
//! all at once (the tokens of a chunk in runs whose experts fit the
//! slots, the others marked [`EXPERT_ELSEWHERE`]), or for a chunk grouped
//! by expert, the chosen experts in waves of as many as there are slots.
//! Each expert's products are the same arithmetic as when resident.
//!
//! Prefetch: in a decode step of a streamed layer, the next MoE layer's
//! router also runs on this layer's input (the residual changes little from
//! one layer to the next), and its choice is read back with this layer's.
//! Once this layer's experts are submitted, the host uploads the predicted
//! experts the next layer's slots lack, while the GPU runs; a right guess
//! is a hit when that layer's routing arrives. The guess only moves
//! experts between slots: the logits are the same with or without it.

use super::{Activations, Recorder};
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, Readback};
use crate::kernels::gemm::{Epilogue, Gemm, GroupedBuffers};
use crate::kernels::gemv::{EXPERT_ELSEWHERE, GemvSpec, Input, Output, Rows};
use crate::kernels::group_by_expert::GroupBuffers;
use crate::kernels::residual::LayerOutput;
use crate::kernels::rms_norm::Rows as NormRows;
use crate::kernels::router::RouterBindings;
use crate::model::experts::ExpertStreaming;
use crate::model::{Model, MoeWeights};
use crate::stats::Phase;

/// How a MoE layer's expert selection reaches the expert kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoutingMode {
    /// Read the selection back to the host (one round trip per MoE layer)
    /// before the experts run. Needed when experts may live off the GPU;
    /// gives the router histogram.
    #[default]
    Readback,
    /// Keep the selection on the GPU: no mid-layer submission.
    DeviceResident,
}

/// Whether a decode step prefetches the streamed experts it predicts the
/// next MoE layer will choose. Off by default: a guess that is wrong
/// costs a whole expert's upload, and where the uploads are what a token
/// waits for (a GPU that computes a layer in a fraction of the time its
/// misses take to cross the bus) a right guess saves little, so a guess
/// must be nearly always right to pay. On random-weight models most of
/// the guessed uploads go unused and decode runs slower; a real
/// checkpoint's residual stream may be more predictable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPrefetch {
    /// Upload only what a dispatch needs, when it needs it.
    #[default]
    Off,
    /// Predict with the next layer's router on this layer's input, and
    /// upload what it chooses while this layer's experts run.
    Predicted,
}

/// What routing needs beyond the plan: the mode, the staging buffer, and
/// the model's streamed experts, if any, with their prefetch.
pub struct RoutingContext<'a> {
    pub mode: RoutingMode,
    pub readback: &'a Readback,
    pub experts: Option<&'a ExpertStreaming>,
    pub prefetch: ExpertPrefetch,
}

#[derive(Debug)]
pub struct MoePlan {
    layer: usize,
    router: Vec<Dispatch>,
    top_k: Dispatch,
    /// Every slot's expert, chosen on the GPU: gate/up + SwiGLU, then the
    /// weighted down projections added to the residual.
    gate_up: Vec<Dispatch>,
    down: Vec<Dispatch>,
    /// A chunk grouped by expert (with the GEMM): norm, then every expert's
    /// gate/up GEMM over its tokens with its SwiGLU, every expert's down
    /// GEMM, the weighted add.
    grouped: Option<Grouped>,
    ids: wgpu::Buffer,
    top_k_slots: usize,
    n_experts: usize,
    /// The layer's expert slots, when its experts stream.
    slots: Option<(GpuTensor, GpuTensor)>,
    /// The guess at the next MoE layer's choice, when both stream.
    prediction: Option<Prediction>,
}

/// The next MoE layer's router and top-k, run on this layer's input (the
/// next layer's FFN norm applied to it), and that layer's slots.
#[derive(Debug)]
struct Prediction {
    router: Vec<Dispatch>,
    top_k: Dispatch,
    ids: wgpu::Buffer,
    layer: usize,
    slots: (GpuTensor, GpuTensor),
}

#[derive(Debug)]
struct Grouped {
    norm: Dispatch,
    /// The pairs grouped by expert on the GPU (device-resident routing).
    group: Dispatch,
    /// Every expert's (or slot's) GEMM, one dispatch per weight part.
    gate_up: Vec<Dispatch>,
    down: Vec<Dispatch>,
    output: Dispatch,
    groups: wgpu::Buffer,
    pairs: wgpu::Buffer,
}

impl MoePlan {
    pub fn new(
        model: &Model,
        act: &Activations,
        gemm: Option<&Gemm>,
        w: &MoeWeights,
        layer: usize,
    ) -> Result<Self> {
        let gpu: &Gpu = &model.gpu;
        let c = &model.config;
        let m = c.moe.as_ref().expect("MoE weights come with a MoE config");
        let a = act.moe.as_ref().expect("MoE activations exist for MoE models");
        let k = &model.kernels;
        let ffn_norm = &model.layer(layer).ffn_norm;
        let (h, i, top_k) = (c.hidden, m.intermediate, m.top_k);
        let normed = Input::RmsNorm { weight: ffn_norm, eps: c.rms_eps };
        let streamed = model.experts.as_ref().filter(|s| s.streams(layer));
        // Expert `e`'s GEMMs, or slot `e`'s when the experts stream.
        let held = streamed.map_or(m.experts, |s| s.slots);
        let grouped = gemm.map(|gemm| -> Result<Grouped> {
            let b = |x, y| GroupedBuffers { x, y, groups: &a.groups, pairs: &a.pairs };
            // What a held expert gets of a full chunk on average sizes the tiles.
            let per_expert = (act.max_tokens * top_k).div_ceil(held);
            let experts = |weight, epilogue, rows, x_div, x, y| {
                gemm.plan_experts(gpu, weight, epilogue, 0..held, rows, x_div, per_expert, &act.step, b(x, y))
            };
            Ok(Grouped {
                norm: k.rms_norm.plan(gpu, ffn_norm, c.rms_eps, &act.x, &act.h, NormRows::vector(h)),
                group: k.group_by_expert.plan(
                    gpu,
                    m.experts,
                    top_k,
                    GroupBuffers { step: &act.step, ids: &a.route_ids, groups: &a.groups, pairs: &a.pairs },
                ),
                gate_up: experts(&w.gate_up, Epilogue::Swiglu, 2 * i, top_k, &act.h, &a.expert_act)?,
                down: experts(&w.down, Epilogue::Plain, h, 1, &a.expert_act, &a.expert_out)?,
                output: Self::grouped_output(model, act, &LayerOutput::default())?,
                groups: a.groups.clone(),
                pairs: a.pairs.clone(),
            })
        });
        let choice = RouterBindings {
            logits: &a.router_logits,
            bias: w.score_bias.as_ref(),
            ids: &a.route_ids,
            weights: &a.route_weights,
        };
        let (router, top_k_dispatch) = Self::routing(model, act, w, ffn_norm, choice)?;
        Ok(MoePlan {
            layer,
            router,
            top_k: top_k_dispatch,
            gate_up: k.gemv.plan(
                gpu,
                &GemvSpec {
                    input: normed,
                    output: Output::Swiglu,
                    rows: Rows::Slots { ids: &a.route_ids, top_k, expert_rows: 2 * i },
                    ..GemvSpec::plain(&w.gate_up, &act.x, &a.expert_act)
                },
            )?,
            down: Self::down(model, act, w, &LayerOutput::default())?,
            grouped: grouped.transpose()?,
            ids: a.route_ids.clone(),
            top_k_slots: top_k,
            n_experts: m.experts,
            slots: streamed.map(|_| (w.gate_up.clone(), w.down.clone())),
            prediction: streamed.map(|_| Self::prediction(model, act, layer)).transpose()?.flatten(),
        })
    }

    /// The next MoE layer's router on `act.x` as this layer's router sees
    /// it, when that layer's experts stream too.
    fn prediction(model: &Model, act: &Activations, layer: usize) -> Result<Option<Prediction>> {
        let a = act.moe.as_ref().expect("MoE activations exist for MoE models");
        let streams = |l: usize| model.experts.as_ref().is_some_and(|s| s.streams(l));
        let Some(next) = (layer + 1..model.layers().end).find(|&l| streams(l)) else { return Ok(None) };
        let crate::model::FfnWeights::Moe(w) = &model.layer(next).ffn else { return Ok(None) };
        let guess = RouterBindings {
            logits: &a.predicted_logits,
            bias: w.score_bias.as_ref(),
            ids: &a.predicted_ids,
            weights: &a.predicted_weights,
        };
        let (router, top_k) = Self::routing(model, act, w, &model.layer(next).ffn_norm, guess)?;
        Ok(Some(Prediction {
            router,
            top_k,
            ids: a.predicted_ids.clone(),
            layer: next,
            slots: (w.gate_up.clone(), w.down.clone()),
        }))
    }

    /// A MoE layer's router (`w`'s, on `act.x` normed by `ffn_norm`) and
    /// its top-k, writing the choice where `b` says.
    fn routing(
        model: &Model,
        act: &Activations,
        w: &MoeWeights,
        ffn_norm: &GpuTensor,
        b: RouterBindings<'_>,
    ) -> Result<(Vec<Dispatch>, Dispatch)> {
        let (gpu, k, c) = (&model.gpu, &model.kernels, &model.config);
        let m = c.moe.as_ref().expect("MoE weights come with a MoE config");
        let normed = Input::RmsNorm { weight: ffn_norm, eps: c.rms_eps };
        let router =
            k.gemv.plan(gpu, &GemvSpec { input: normed, ..GemvSpec::plain(&w.router, &act.x, b.logits) })?;
        Ok((router, k.router.plan(gpu, m.selection, m.experts, m.top_k, b)))
    }

    fn down(
        model: &Model,
        act: &Activations,
        w: &MoeWeights,
        output: &LayerOutput<'_>,
    ) -> Result<Vec<Dispatch>> {
        let a = act.moe.as_ref().expect("MoE activations exist for MoE models");
        let (top_k, h) = (a.top_k, model.config.hidden);
        model.kernels.gemv.plan(
            &model.gpu,
            &GemvSpec {
                output: Output::Add(output.clone()),
                rows: Rows::Sum { ids: &a.route_ids, weights: &a.route_weights, top_k, expert_rows: h },
                ..GemvSpec::plain(&w.down, &a.expert_act, &act.x)
            },
        )
    }

    fn grouped_output(model: &Model, act: &Activations, output: &LayerOutput<'_>) -> Result<Dispatch> {
        let a = act.moe.as_ref().expect("MoE activations exist for MoE models");
        let h = model.config.hidden;
        model.kernels.residual.plan_weighted(
            &model.gpu,
            h,
            a.top_k,
            &a.route_weights,
            &a.expert_out,
            &act.x,
            output,
        )
    }

    /// Rebuilds the layer's last add with its steering and capture.
    pub fn set_output(
        &mut self,
        model: &Model,
        act: &Activations,
        w: &MoeWeights,
        output: &LayerOutput<'_>,
    ) -> Result<()> {
        self.down = Self::down(model, act, w, output)?;
        if let Some(g) = &mut self.grouped {
            g.output = Self::grouped_output(model, act, output)?;
        }
        Ok(())
    }

    /// (experts chosen per token, experts of the layer).
    pub fn routing_shape(&self) -> (usize, usize) {
        (self.top_k_slots, self.n_experts)
    }

    /// Runs the layer's router and experts over `n_tokens` rows, added to
    /// the residual, the experts grouped by expert through the GEMM where
    /// `gemm` says so.
    pub fn run<'a>(
        &self,
        rec: &mut Recorder<'a>,
        n_tokens: u32,
        routing: &RoutingContext<'a>,
        gemm: bool,
    ) -> Result<()> {
        rec.encode(Phase::Layers, &self.router, n_tokens);
        rec.encode(Phase::Layers, std::slice::from_ref(&self.top_k), n_tokens);
        let bytes = (n_tokens as usize * self.top_k_slots * 4) as u64;
        if let (Some(experts), Some(slots)) = (routing.experts, &self.slots) {
            let placed = Placement { experts, slots, layer: self.layer };
            let prediction = self.prediction.as_ref().filter(|_| n_tokens == 1);
            if let (Some(p), ExpertPrefetch::Predicted) = (prediction, routing.prefetch) {
                return self.run_predicting(rec, routing, &placed, p);
            }
            let ids =
                rec.submit_routing_and_wait(routing.readback, &self.ids, bytes, self.layer, self.n_experts)?;
            return match &self.grouped {
                Some(grouped) if gemm => grouped.encode_in_waves(rec, n_tokens, &ids, &placed),
                _ => self.encode_in_runs(rec, n_tokens, &ids, &placed),
            };
        }
        match (routing.mode, &self.grouped) {
            (RoutingMode::Readback, Some(grouped)) if gemm => {
                let ids = rec.submit_routing_and_wait(
                    routing.readback,
                    &self.ids,
                    bytes,
                    self.layer,
                    self.n_experts,
                )?;
                grouped.encode(rec, n_tokens, Some(&ids), self.n_experts);
                return Ok(());
            }
            (RoutingMode::DeviceResident, Some(grouped)) if gemm => {
                grouped.encode(rec, n_tokens, None, self.n_experts);
                return Ok(());
            }
            (RoutingMode::Readback, _) => {
                rec.submit_routing(routing.readback, &self.ids, bytes, self.layer, self.n_experts)?;
            }
            (RoutingMode::DeviceResident, _) => {}
        }
        rec.encode(Phase::Routed, &self.gate_up, n_tokens);
        rec.encode(Phase::Routed, &self.down, n_tokens);
        Ok(())
    }
}

impl MoePlan {
    /// One token through a streamed layer with a prediction: its experts
    /// placed and submitted, then the predicted experts of the next layer
    /// uploaded while they run.
    fn run_predicting<'a>(
        &self,
        rec: &mut Recorder<'a>,
        routing: &RoutingContext<'a>,
        placed: &Placement<'_>,
        p: &Prediction,
    ) -> Result<()> {
        rec.encode(Phase::Layers, &p.router, 1);
        rec.encode(Phase::Layers, std::slice::from_ref(&p.top_k), 1);
        let bytes = (self.top_k_slots * 4) as u64;
        let (ids, predicted) = rec.submit_routing_and_wait_with_prediction(
            routing.readback,
            (&self.ids, &p.ids),
            bytes,
            self.layer,
            self.n_experts,
        )?;
        self.encode_in_runs(rec, 1, &ids, placed)?;
        rec.submit()?;
        // A guess from non-finite scores (ids past the experts) is no guess.
        let guess: Vec<usize> =
            predicted.iter().map(|&e| e as usize).filter(|&e| e < self.n_experts).collect();
        let gpu = rec.gpu();
        let stats = &mut rec.stats().expert_cache;
        placed.experts.prefetch(gpu, (&p.slots.0, &p.slots.1), p.layer, &guess, stats)
    }
}

/// A streamed layer's experts and slots.
struct Placement<'a> {
    experts: &'a ExpertStreaming,
    slots: &'a (GpuTensor, GpuTensor),
    layer: usize,
}

impl Placement<'_> {
    /// Puts `needed` in slots (uploading what is missing); their slots.
    fn place(&self, rec: &mut Recorder<'_>, needed: &[usize]) -> Result<Vec<u32>> {
        let gpu = rec.gpu();
        let stats = &mut rec.stats().expert_cache;
        self.experts.place(gpu, &self.slots.0, &self.slots.1, self.layer, needed, stats)
    }
}

impl MoePlan {
    /// The slot GEMVs over runs of tokens whose experts fit the slots
    /// together, one submission per run: each run's tokens read their
    /// experts' slots, the others are skipped ([`EXPERT_ELSEWHERE`]).
    fn encode_in_runs(
        &self,
        rec: &mut Recorder<'_>,
        n_tokens: u32,
        ids: &[u32],
        placed: &Placement<'_>,
    ) -> Result<()> {
        let (k, n) = (self.top_k_slots, n_tokens as usize);
        let mut first = 0;
        while first < n {
            let mut needed: Vec<usize> = Vec::new();
            let mut end = first;
            while end < n {
                let mut with = needed.clone();
                for &e in &ids[end * k..(end + 1) * k] {
                    if !with.contains(&(e as usize)) {
                        with.push(e as usize);
                    }
                }
                // A token's own experts always fit: there are at least top-k slots.
                if with.len() > placed.experts.slots && end > first {
                    break;
                }
                needed = with;
                end += 1;
            }
            let slots = placed.place(rec, &needed)?;
            let slot_ids: Vec<u32> = ids
                .iter()
                .enumerate()
                .map(|(pair, &e)| match (first..end).contains(&(pair / k)) {
                    true => slots[needed.iter().position(|&x| x == e as usize).expect("placed above")],
                    false => EXPERT_ELSEWHERE,
                })
                .collect();
            rec.gpu().queue.write_buffer(&self.ids, 0, bytemuck::cast_slice(&slot_ids));
            rec.encode(Phase::Routed, &self.gate_up, n_tokens);
            rec.encode(Phase::Routed, &self.down, n_tokens);
            first = end;
            if first < n {
                // The next run's ids land before the next submission.
                rec.submit()?;
            }
        }
        Ok(())
    }
}

impl Grouped {
    /// [`Self::encode`] with the chosen experts in waves of as many as
    /// there are slots, one submission per wave: each wave's GEMMs (over
    /// the pairs of its experts), then the weighted sum once.
    fn encode_in_waves(
        &self,
        rec: &mut Recorder<'_>,
        n_tokens: u32,
        ids: &[u32],
        placed: &Placement<'_>,
    ) -> Result<()> {
        let mut chosen: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        chosen.sort_unstable();
        chosen.dedup();
        let waves: Vec<&[usize]> = chosen.chunks(placed.experts.slots).collect();
        rec.encode(Phase::Routed, std::slice::from_ref(&self.norm), n_tokens);
        for (w, wave) in waves.iter().enumerate() {
            let slots = placed.place(rec, wave)?;
            let mut slot_of = vec![None; chosen.last().map_or(0, |&e| e + 1)];
            for (&e, &s) in wave.iter().zip(&slots) {
                slot_of[e] = Some(s);
            }
            let pair_slots: Vec<Option<u32>> = ids.iter().map(|&e| slot_of[e as usize]).collect();
            self.group_by_slot(rec.gpu(), &pair_slots, placed.experts.slots);
            self.encode_experts(rec, n_tokens);
            if w + 1 < waves.len() {
                // The next wave's groups and uploads land before its submission.
                rec.submit()?;
            }
        }
        rec.encode(Phase::Routed, std::slice::from_ref(&self.output), n_tokens);
        Ok(())
    }

    /// Writes the (token, slot) pairs whose expert sits in a slot this
    /// wave, grouped by slot.
    fn group_by_slot(&self, gpu: &Gpu, pair_slots: &[Option<u32>], n_slots: usize) {
        let ids: Vec<(usize, u32)> =
            pair_slots.iter().enumerate().filter_map(|(pair, s)| s.map(|s| (pair, s))).collect();
        self.write_groups(gpu, &ids, n_slots)
    }

    /// The chunk's experts, grouped on the host from `ids` (the routing it
    /// read back) or else on the GPU.
    fn encode(&self, rec: &mut Recorder<'_>, n_tokens: u32, ids: Option<&[u32]>, n_experts: usize) {
        match ids {
            Some(ids) => self.group_by_expert(rec.gpu(), ids, n_experts),
            None => rec.encode(Phase::Routed, std::slice::from_ref(&self.group), n_tokens),
        }
        rec.encode(Phase::Routed, std::slice::from_ref(&self.norm), n_tokens);
        self.encode_experts(rec, n_tokens);
        rec.encode(Phase::Routed, std::slice::from_ref(&self.output), n_tokens);
    }

    /// Every expert's gate/up GEMM with its SwiGLU, every expert's down
    /// GEMM: sized for the chunk's tokens, the most one expert can have
    /// (those with fewer end their extra tiles at once).
    fn encode_experts(&self, rec: &mut Recorder<'_>, n_tokens: u32) {
        rec.encode(Phase::Routed, &self.gate_up, n_tokens);
        rec.encode(Phase::Routed, &self.down, n_tokens);
    }

    /// Writes the chunk's (token, slot) pairs grouped by expert for the
    /// grouped GEMMs. The queue writes land before the next submission,
    /// which is the one that reads them.
    fn group_by_expert(&self, gpu: &Gpu, ids: &[u32], n_experts: usize) {
        let pairs: Vec<(usize, u32)> = ids.iter().copied().enumerate().collect();
        self.write_groups(gpu, &pairs, n_experts)
    }

    /// Writes `(pair, group)` grouped by group (`groups` entries for
    /// `n_groups`), in pair order within each.
    fn write_groups(&self, gpu: &Gpu, ids: &[(usize, u32)], n_groups: usize) {
        let mut counts = vec![0u32; n_groups];
        for &(_, e) in ids {
            counts[e as usize] += 1;
        }
        let mut offsets = vec![0u32; n_groups];
        let mut groups = Vec::with_capacity(2 * n_groups);
        let mut next = 0;
        for (e, &count) in counts.iter().enumerate() {
            offsets[e] = next;
            groups.extend([next, count]);
            next += count;
        }
        let mut pairs = vec![0u32; ids.len().max(1)];
        for &(pair, e) in ids {
            pairs[offsets[e as usize] as usize] = pair as u32;
            offsets[e as usize] += 1;
        }
        gpu.queue.write_buffer(&self.groups, 0, bytemuck::cast_slice(&groups));
        gpu.queue.write_buffer(&self.pairs, 0, bytemuck::cast_slice(&pairs));
    }
}
