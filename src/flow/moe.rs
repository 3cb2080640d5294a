//! The routed FFN of a MoE layer. The router and its top-k run on the GPU;
//! in readback mode the k ids of every token in flight are copied to a
//! mapped buffer, which ends the submission, and the next one encodes only
//! the chosen experts: for one token, a GEMV per slot over the parts that
//! hold the expert; for a prefill chunk, the tokens grouped by expert and
//! one GEMM per chosen expert, so each expert's weights are read once per
//! chunk. In device-resident mode nothing is read back: every part is
//! encoded and the expert kernels, which read the ids from the GPU either
//! way, skip the rows of experts that were not chosen.

use std::ops::Range;
use std::time::Instant;

use super::{Activations, Recorder};
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, Readback};
use crate::kernels::gemm::GroupedBuffers;
use crate::kernels::gemv::{ExpertBuffers, ExpertLayout};
use crate::kernels::router::RouterBindings;
use crate::model::{Model, MoeWeights};
use crate::stats::{Phase, Stats};

/// How a MoE layer's expert selection reaches the expert kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoutingMode {
    /// Read the selection back to the host (one round trip per MoE layer)
    /// and encode only the selected experts. Needed when experts may live
    /// off the GPU; gives the router histogram.
    #[default]
    Readback,
    /// Keep the selection on the GPU: no mid-layer submission, every
    /// expert part is dispatched and unselected rows are skipped.
    DeviceResident,
}

/// What routing needs beyond the plan: the mode and the staging buffer.
pub struct RoutingContext<'a> {
    pub mode: RoutingMode,
    pub readback: &'a Readback,
    pub moe: Option<&'a super::MoeActivations>,
}

#[derive(Debug)]
pub struct MoePlan {
    router_proj: Vec<Dispatch>,
    top_k: Dispatch,
    /// `[slot][part]`
    gate_up: Vec<Vec<Dispatch>>,
    swiglu: Dispatch,
    /// `[slot][part]`
    down: Vec<Vec<Dispatch>>,
    /// Prefill, `[expert][part]`: the expert's GEMM over its grouped tokens.
    grouped_gate_up: Vec<Vec<Dispatch>>,
    grouped_down: Vec<Vec<Dispatch>>,
    gate_up_parts: Vec<Range<usize>>,
    down_parts: Vec<Range<usize>>,
    k: usize,
    n_experts: usize,
    /// Rows of one expert in `gate_up` and in `down`.
    gate_up_rows: usize,
    down_rows: usize,
}

impl MoePlan {
    pub fn new(model: &Model, act: &Activations, w: &MoeWeights) -> Self {
        let gpu: &Gpu = &model.gpu;
        let c = &model.config;
        let m = c.moe.as_ref().expect("MoE weights come with a MoE config");
        let a = act.moe.as_ref().expect("MoE activations exist for MoE models");
        let k = &model.kernels;
        let (h, i, top_k) = (c.hidden, m.intermediate, m.top_k);
        let ids = &a.route_ids;
        let gate_up_layout = ExpertLayout { top_k, expert_rows: 2 * i, x_stride: h, x_slot_stride: 0 };
        let down_layout = ExpertLayout { top_k, expert_rows: h, x_stride: top_k * i, x_slot_stride: i };
        let ranges =
            |t: &crate::gpu::GpuTensor| t.parts.iter().map(|p| p.first_row..p.first_row + p.rows).collect();
        let mut swiglu = k.swiglu.plan(gpu, i, &a.expert_gate_up, &a.expert_act);
        // One swiglu row per (token, slot).
        swiglu.workgroups[1] = top_k as u32;
        MoePlan {
            router_proj: k.gemv.plan(gpu, &w.router, &act.h, &a.router_logits),
            top_k: k.router.plan(
                gpu,
                m.routing,
                m.experts,
                top_k,
                RouterBindings {
                    logits: &a.router_logits,
                    bias: w.score_bias.as_ref(),
                    ids,
                    weights: &a.route_weights,
                },
            ),
            gate_up: (0..top_k)
                .map(|slot| {
                    let b = ExpertBuffers { x: &act.h, y: &a.expert_gate_up, ids };
                    k.gemv.plan_expert(gpu, &w.gate_up, gate_up_layout, slot, b)
                })
                .collect(),
            swiglu,
            down: (0..top_k)
                .map(|slot| {
                    let b = ExpertBuffers { x: &a.expert_act, y: &a.expert_out, ids };
                    k.gemv.plan_expert(gpu, &w.down, down_layout, slot, b)
                })
                .collect(),
            grouped_gate_up: (0..m.experts)
                .map(|e| {
                    let b = GroupedBuffers {
                        x: &act.h,
                        y: &a.expert_gate_up,
                        groups: &a.groups,
                        pairs: &a.pairs,
                    };
                    k.gemm.plan_expert(gpu, &w.gate_up, e, 2 * i, top_k, &act.step, b)
                })
                .collect(),
            grouped_down: (0..m.experts)
                .map(|e| {
                    let b = GroupedBuffers {
                        x: &a.expert_act,
                        y: &a.expert_out,
                        groups: &a.groups,
                        pairs: &a.pairs,
                    };
                    k.gemm.plan_expert(gpu, &w.down, e, h, 1, &act.step, b)
                })
                .collect(),
            gate_up_parts: ranges(&w.gate_up),
            down_parts: ranges(&w.down),
            k: top_k,
            n_experts: m.experts,
            gate_up_rows: 2 * i,
            down_rows: h,
        }
    }

    /// Router, selection, and the selected experts of the tokens in flight
    /// (their weighted sum is the layer's output add, encoded by the flow).
    pub fn run(
        &self,
        rec: &mut Recorder<'_>,
        n_tokens: u32,
        layer: usize,
        routing: &mut RoutingContext<'_>,
        stats: &mut Stats,
    ) -> Result<()> {
        {
            let pass = rec.pass(Phase::Attention);
            crate::gpu::encode_all(&self.router_proj, pass, n_tokens);
            self.top_k.encode(pass, n_tokens);
        }
        let a = routing.moe.expect("MoE activations exist for MoE models");
        let chosen: Option<Vec<u32>> = match routing.mode {
            RoutingMode::DeviceResident => None,
            RoutingMode::Readback => {
                let bytes = (n_tokens as usize * self.k * 4) as u64;
                routing.readback.record(rec.encoder(), &a.route_ids, 0, bytes);
                let start = Instant::now();
                rec.submit()?;
                let ids: Vec<u32> = routing.readback.read(rec.gpu(), bytes)?;
                stats.routing_wait += start.elapsed();
                stats.routing_readbacks += 1;
                let histogram = &mut stats.router_histogram[layer];
                histogram.resize(self.n_experts, 0);
                for &e in &ids {
                    histogram[e as usize] += 1;
                }
                Some(ids)
            }
        };

        match &chosen {
            Some(ids) if n_tokens > 1 => {
                let counts = self.group_by_expert(rec.gpu(), a, ids);
                let pass = rec.pass(Phase::Routed);
                for (e, &count) in counts.iter().enumerate() {
                    if count > 0 {
                        crate::gpu::encode_all(&self.grouped_gate_up[e], pass, count);
                    }
                }
                self.swiglu.encode(pass, n_tokens);
                for (e, &count) in counts.iter().enumerate() {
                    if count > 0 {
                        crate::gpu::encode_all(&self.grouped_down[e], pass, count);
                    }
                }
            }
            _ => {
                let pass = rec.pass(Phase::Routed);
                // One token: only the parts holding each slot's expert.
                // Device-resident: every part, for every token.
                let encode_slots =
                    |plans: &[Vec<Dispatch>],
                     parts: &[Range<usize>],
                     rows: usize,
                     pass: &mut wgpu::ComputePass<'static>| {
                        for (slot, slot_plans) in plans.iter().enumerate() {
                            for (part, range) in parts.iter().enumerate() {
                                let needed = match &chosen {
                                    None => true,
                                    Some(ids) => {
                                        let e = ids[slot] as usize;
                                        range.start < (e + 1) * rows && e * rows < range.end
                                    }
                                };
                                if needed {
                                    slot_plans[part].encode(pass, n_tokens);
                                }
                            }
                        }
                    };
                encode_slots(&self.gate_up, &self.gate_up_parts, self.gate_up_rows, pass);
                self.swiglu.encode(pass, n_tokens);
                encode_slots(&self.down, &self.down_parts, self.down_rows, pass);
            }
        }
        Ok(())
    }

    /// Writes the chunk's (token, slot) pairs grouped by expert for the
    /// grouped GEMMs; returns each expert's count. The queue writes land
    /// before the next submission, which is the one that reads them.
    fn group_by_expert(&self, gpu: &Gpu, a: &super::MoeActivations, ids: &[u32]) -> Vec<u32> {
        let mut counts = vec![0u32; self.n_experts];
        for &e in ids {
            counts[e as usize] += 1;
        }
        let mut offsets = vec![0u32; self.n_experts];
        let mut groups = Vec::with_capacity(2 * self.n_experts);
        let mut next = 0;
        for (e, &count) in counts.iter().enumerate() {
            offsets[e] = next;
            groups.extend([next, count]);
            next += count;
        }
        let mut pairs = vec![0u32; ids.len()];
        for (pair, &e) in ids.iter().enumerate() {
            pairs[offsets[e as usize] as usize] = pair as u32;
            offsets[e as usize] += 1;
        }
        gpu.queue.write_buffer(&a.groups, 0, bytemuck::cast_slice(&groups));
        gpu.queue.write_buffer(&a.pairs, 0, bytemuck::cast_slice(&pairs));
        counts
    }
}
