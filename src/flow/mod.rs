//! The layer flow: the dispatches of one forward pass, built once per
//! session with every binding fixed, and replayed for each submission.
//!
//! One decoder layer (DESIGN.md section 1):
//! ```text
//! h      = rms_norm(x, input_layernorm)
//! qkv    = h @ [q_proj; k_proj; v_proj]
//! q,k    = family_qk_norm(q, k)                     // before RoPE
//! q,k    = rope(q, k, pos); K[pos], V[pos] = k, v    // cached after norm + RoPE
//! attn   = attention(q, K[..=pos], V[..=pos])
//! x      = x + attn @ o_proj
//! h      = rms_norm(x, post_attention_layernorm)
//! dense: x = x + down(silu(gate h) * up h)
//! moe:   ids, w = family_topk(h @ router)           // read back: ends the submission
//!        x = x + sum_j w_j * down_e(silu(gate_e h) * up_e h),  e = ids_j
//! x      = x + steering[layer]                      // if a control vector steers it
//! capture[layer] = x                                 // if the layer is captured
//!                                  (both fused into the layer's last residual add)
//! ```
//! then `logits = rms_norm(x, norm) @ lm_head`, raw.

mod buffers;
pub(crate) mod moe;
mod recorder;

pub use buffers::{Activations, MoeActivations};
pub use moe::RoutingMode;
pub use recorder::{PhaseTimer, Recorder};

use crate::capture::CapturePlan;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, encode_all};
use crate::kernels::attention::{AttentionBindings, SplitScratch};
use crate::kernels::residual::LayerOutput;
use crate::kernels::rms_norm::Rows;
use crate::kernels::rope::RopeBindings;
use crate::kv_cache::KvCache;
use crate::model::{FfnWeights, Model, QkNorm};
use crate::stats::{Phase, Stats};
use crate::steering::SteeringPlan;
use moe::MoePlan;

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
    pub fn uses_gemm(self, gpu: &Gpu) -> bool {
        match self {
            ChunkMatmul::Auto => !gpu.caps.is_cpu,
            ChunkMatmul::Gemm => true,
            ChunkMatmul::Gemv => false,
        }
    }
}

/// A projection by a weight matrix: a GEMV for one token in flight, a
/// tiled GEMM (when the plan uses it) for a chunk.
#[derive(Debug)]
pub(crate) struct Projection {
    gemv: Vec<Dispatch>,
    gemm: Option<Vec<Dispatch>>,
}

impl Projection {
    fn new(model: &Model, weight: &GpuTensor, act: &Activations, x: &wgpu::Buffer, y: &wgpu::Buffer) -> Self {
        let (gpu, k) = (&model.gpu, &model.kernels);
        Projection {
            gemv: k.gemv.plan(gpu, weight, x, y),
            gemm: act.chunk_gemm.then(|| k.gemm.plan(gpu, weight, act.max_tokens, &act.step, x, y)),
        }
    }

    fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
        let dispatches = match &self.gemm {
            Some(gemm) if n_tokens > 1 => gemm,
            _ => &self.gemv,
        };
        encode_all(dispatches, pass, n_tokens);
    }
}

/// The attention half of a layer and the FFN norm, in flow order.
#[derive(Debug)]
struct AttentionPlan {
    attn_norm: Dispatch,
    qkv_proj: Projection,
    qk_norm: Vec<Dispatch>,
    rope_and_store: Dispatch,
    /// One token: split over the keys and merged. A chunk: one workgroup
    /// per (KV head, token).
    attention_decode: Vec<Dispatch>,
    attention_prefill: Vec<Dispatch>,
    o_proj: Projection,
    attn_residual: Dispatch,
    ffn_norm: Dispatch,
}

#[derive(Debug)]
struct DensePlan {
    gate_up_proj: Projection,
    swiglu: Dispatch,
    down_proj: Projection,
}

#[derive(Debug)]
enum FfnPlan {
    Dense(DensePlan),
    Moe(MoePlan),
}

#[derive(Debug)]
struct LayerPlan {
    attention: AttentionPlan,
    ffn: FfnPlan,
    /// `x += ffn output` (dense) or `x += sum_j w_j expert_j` (MoE), with
    /// the layer's steering and capture when they are set.
    output: Dispatch,
}

/// The whole forward pass for up to `Activations::max_tokens` tokens.
#[derive(Debug)]
pub struct Plan {
    embed: Vec<Dispatch>,
    layers: Vec<LayerPlan>,
    final_norm: Dispatch,
    lm_head: Vec<Dispatch>,
}

impl Plan {
    pub fn new(model: &Model, act: &Activations, kv: &KvCache) -> Plan {
        let gpu: &Gpu = &model.gpu;
        let c = &model.config;
        let k = &model.kernels;
        let w = &model.weights;
        let hidden = Rows::vector(c.hidden);

        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, lw)| LayerPlan {
                attention: AttentionPlan::new(model, act, kv, i),
                ffn: match &lw.ffn {
                    FfnWeights::Dense { gate_up, down } => FfnPlan::Dense(DensePlan {
                        gate_up_proj: Projection::new(model, gate_up, act, &act.h, &act.gate_up),
                        swiglu: k.swiglu.plan(gpu, c.intermediate, &act.gate_up, &act.ffn_act),
                        down_proj: Projection::new(model, down, act, &act.ffn_act, &act.ffn_out),
                    }),
                    FfnWeights::Moe(mw) => FfnPlan::Moe(MoePlan::new(model, act, mw)),
                },
                output: layer_output(model, act, i, LayerOutput::default()),
            })
            .collect();

        Plan {
            embed: k.embed.plan(gpu, &w.embed, &act.tokens, &act.x),
            layers,
            final_norm: k.rms_norm.plan(gpu, &w.final_norm, c.rms_eps, &act.x_last, &act.h, hidden),
            lm_head: k.gemv.plan(gpu, w.head(), &act.h, &act.logits),
        }
    }

    /// Rebuilds every layer's output add with the session's steering and
    /// capture (either may be unset: that layer's add then does only the add).
    pub(crate) fn set_layer_outputs(
        &mut self,
        model: &Model,
        act: &Activations,
        steering: Option<&SteeringPlan>,
        capture: Option<&CapturePlan>,
    ) {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let output = LayerOutput {
                steer: steering.and_then(|s| s.layer(i)),
                capture: capture.and_then(|c| c.target(i)),
            };
            layer.output = layer_output(model, act, i, output);
        }
    }

    /// Records (and, at routing readbacks, submits) the forward pass of
    /// `n_tokens` tokens whose ids and first position are already written
    /// to the activations. The head runs only when `with_head`, on the last
    /// token. The caller records its readbacks and finishes `rec`.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder<'_>,
        act: &Activations,
        n_tokens: u32,
        with_head: bool,
        routing: &mut moe::RoutingContext<'_>,
        stats: &mut Stats,
    ) -> Result<()> {
        encode_all(&self.embed, rec.pass(Phase::Attention), n_tokens);
        for (i, layer) in self.layers.iter().enumerate() {
            layer.attention.encode(rec.pass(Phase::Attention), n_tokens);
            let ffn_phase = match &layer.ffn {
                FfnPlan::Dense(dense) => {
                    dense.encode(rec.pass(Phase::Attention), n_tokens);
                    Phase::Attention
                }
                FfnPlan::Moe(moe) => {
                    moe.run(rec, n_tokens, i, routing, stats)?;
                    Phase::Routed
                }
            };
            layer.output.encode(rec.pass(ffn_phase), n_tokens);
        }
        if with_head {
            let row = 4 * act.hidden as u64;
            rec.encoder().copy_buffer_to_buffer(&act.x, (n_tokens as u64 - 1) * row, &act.x_last, 0, row);
            let pass = rec.pass(Phase::Head);
            self.final_norm.encode(pass, 1);
            encode_all(&self.lm_head, pass, 1);
        }
        stats.forward_passes += 1;
        Ok(())
    }
}

impl AttentionPlan {
    fn new(model: &Model, act: &Activations, kv: &KvCache, i: usize) -> Self {
        let gpu: &Gpu = &model.gpu;
        let c = &model.config;
        let k = &model.kernels;
        let lw = &model.weights.layers[i];
        let heads = c.heads;
        let hidden = Rows::vector(c.hidden);
        let scale = (heads.dim as f32).powf(-0.5);
        let window = c.sliding_window.unwrap_or(0);
        let attention_bindings = || AttentionBindings {
            step: &act.step,
            qkv: &act.qkv,
            k_cache: &kv.k[i],
            v_cache: &kv.v[i],
            out: &act.attn,
        };
        let qk_norm = match (c.family.qk_norm, &lw.q_norm, &lw.k_norm) {
            (QkNorm::None, _, _) => Vec::new(),
            (norm, Some(qn), Some(kn)) => {
                // Rows of q heads, then of k heads, in place in the qkv buffer.
                let (q_rows, k_rows) = qk_norm_rows(norm, heads);
                vec![
                    k.rms_norm.plan(gpu, qn, c.rms_eps, &act.qkv, &act.qkv, q_rows),
                    k.rms_norm.plan(gpu, kn, c.rms_eps, &act.qkv, &act.qkv, k_rows),
                ]
            }
            _ => unreachable!("q/k norm weights are loaded whenever the family has them"),
        };
        AttentionPlan {
            attn_norm: k.rms_norm.plan(gpu, &lw.attn_norm, c.rms_eps, &act.x, &act.h, hidden),
            qkv_proj: Projection::new(model, &lw.qkv, act, &act.h, &act.qkv),
            qk_norm,
            rope_and_store: k.rope.plan(
                gpu,
                heads,
                c.rope.rotary_dim,
                RopeBindings {
                    step: &act.step,
                    qkv: &act.qkv,
                    cos_sin: &act.cos_sin,
                    k_cache: &kv.k[i],
                    v_cache: &kv.v[i],
                },
            ),
            attention_decode: k.attention.plan(
                gpu,
                heads,
                scale,
                window,
                attention_bindings(),
                Some((
                    act.attn_splits,
                    SplitScratch { acc: &act.attn_split_acc, max_sum: &act.attn_split_max_sum },
                )),
            ),
            attention_prefill: k.attention.plan(gpu, heads, scale, window, attention_bindings(), None),
            o_proj: Projection::new(model, &lw.o_proj, act, &act.attn, &act.attn_out),
            attn_residual: k.residual.plan(gpu, c.hidden, 1.0, &act.attn_out, &act.x),
            ffn_norm: k.rms_norm.plan(gpu, &lw.ffn_norm, c.rms_eps, &act.x, &act.h, hidden),
        }
    }

    fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
        self.attn_norm.encode(pass, n_tokens);
        self.qkv_proj.encode(pass, n_tokens);
        encode_all(&self.qk_norm, pass, n_tokens);
        self.rope_and_store.encode(pass, n_tokens);
        let attention = if n_tokens == 1 { &self.attention_decode } else { &self.attention_prefill };
        encode_all(attention, pass, n_tokens);
        self.o_proj.encode(pass, n_tokens);
        self.attn_residual.encode(pass, n_tokens);
        self.ffn_norm.encode(pass, n_tokens);
    }
}

impl DensePlan {
    fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
        self.gate_up_proj.encode(pass, n_tokens);
        self.swiglu.encode(pass, n_tokens);
        self.down_proj.encode(pass, n_tokens);
    }
}

/// The add that ends layer `i`: the dense FFN's output, or the routed
/// experts' outputs weighted by the router, into the residual stream.
fn layer_output(model: &Model, act: &Activations, i: usize, output: LayerOutput<'_>) -> Dispatch {
    let (gpu, c, residual) = (&model.gpu, &model.config, &model.kernels.residual);
    match (&model.weights.layers[i].ffn, &act.moe) {
        (FfnWeights::Dense { .. }, _) => {
            residual.plan_output(gpu, c.hidden, 1.0, &act.ffn_out, &act.x, output)
        }
        (FfnWeights::Moe(_), Some(a)) => {
            let top_k = c.moe.as_ref().expect("MoE layers come with a MoE config").top_k;
            residual.plan_weighted(gpu, c.hidden, top_k, &a.route_weights, &a.expert_out, &act.x, output)
        }
        (FfnWeights::Moe(_), None) => unreachable!("MoE activations exist for MoE models"),
    }
}

/// Where the q and k heads sit in a token's qkv row, for the family's norm.
fn qk_norm_rows(norm: QkNorm, heads: crate::kernels::Heads) -> (Rows, Rows) {
    let stride = heads.qkv_width();
    let q_width = heads.q * heads.dim;
    let (n_q, n_k, heads_q, heads_k, head_stride) = match norm {
        QkNorm::PerHead => (heads.dim, heads.dim, heads.q, heads.kv, heads.dim),
        QkNorm::WholeProjection => (q_width, heads.kv_width(), 1, 1, 0),
        QkNorm::None => unreachable!("no rows to normalise"),
    };
    let rows = |n, heads, offset| Rows { n, heads, head_stride, token_stride: stride, offset };
    (rows(n_q, heads_q, 0), rows(n_k, heads_k, q_width))
}
