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
//! x      = x + down(silu(gate h) * up h)
//! ```
//! then `logits = rms_norm(x, norm) @ lm_head`, raw.

mod buffers;

pub use buffers::Activations;

use crate::gpu::{Dispatch, Gpu, encode_all};
use crate::kernels::attention::AttentionBindings;
use crate::kernels::rms_norm::Rows;
use crate::kernels::rope::RopeBindings;
use crate::kv_cache::KvCache;
use crate::model::{Model, QkNorm};

/// One layer's dispatches, in flow order.
#[derive(Debug)]
struct LayerPlan {
    attn_norm: Dispatch,
    qkv_proj: Vec<Dispatch>,
    qk_norm: Vec<Dispatch>,
    rope_and_store: Dispatch,
    attention: Dispatch,
    o_proj: Vec<Dispatch>,
    attn_residual: Dispatch,
    ffn_norm: Dispatch,
    gate_up_proj: Vec<Dispatch>,
    swiglu: Dispatch,
    down_proj: Vec<Dispatch>,
    ffn_residual: Dispatch,
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
        let heads = c.heads;
        let hidden = Rows::vector(c.hidden);
        let scale = (heads.dim as f32).powf(-0.5);
        let window = c.sliding_window.unwrap_or(0);

        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, lw)| {
                let qk_norm = match (c.family.qk_norm, &lw.q_norm, &lw.k_norm) {
                    (QkNorm::None, _, _) => Vec::new(),
                    (norm, Some(qn), Some(kn)) => {
                        // Rows of q heads, then of k heads, in the qkv buffer.
                        let (q_rows, k_rows) = qk_norm_rows(norm, heads);
                        vec![
                            k.rms_norm.plan(gpu, qn, c.rms_eps, &act.qkv, &act.qkv, q_rows),
                            k.rms_norm.plan(gpu, kn, c.rms_eps, &act.qkv, &act.qkv, k_rows),
                        ]
                    }
                    _ => unreachable!("q/k norm weights are loaded whenever the family has them"),
                };
                LayerPlan {
                    attn_norm: k.rms_norm.plan(gpu, &lw.attn_norm, c.rms_eps, &act.x, &act.h, hidden),
                    qkv_proj: k.gemv.plan(gpu, &lw.qkv, &act.h, &act.qkv),
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
                    attention: k.attention.plan(
                        gpu,
                        heads,
                        scale,
                        window,
                        AttentionBindings {
                            step: &act.step,
                            qkv: &act.qkv,
                            k_cache: &kv.k[i],
                            v_cache: &kv.v[i],
                            out: &act.attn,
                        },
                    ),
                    o_proj: k.gemv.plan(gpu, &lw.o_proj, &act.attn, &act.attn_out),
                    attn_residual: k.residual.plan(gpu, c.hidden, 1.0, &act.attn_out, &act.x),
                    ffn_norm: k.rms_norm.plan(gpu, &lw.ffn_norm, c.rms_eps, &act.x, &act.h, hidden),
                    gate_up_proj: k.gemv.plan(gpu, &lw.gate_up, &act.h, &act.gate_up),
                    swiglu: k.swiglu.plan(gpu, c.intermediate, &act.gate_up, &act.ffn_act),
                    down_proj: k.gemv.plan(gpu, &lw.down, &act.ffn_act, &act.ffn_out),
                    ffn_residual: k.residual.plan(gpu, c.hidden, 1.0, &act.ffn_out, &act.x),
                }
            })
            .collect();

        Plan {
            embed: k.embed.plan(gpu, &w.embed, &act.tokens, &act.x),
            layers,
            final_norm: k.rms_norm.plan(gpu, &w.final_norm, c.rms_eps, &act.x, &act.h, hidden),
            lm_head: k.gemv.plan(gpu, w.head(), &act.h, &act.logits),
        }
    }

    /// Records the forward pass of `n_tokens` tokens (their ids and first
    /// position already written to the activations' `tokens` and `step`).
    /// The head runs only when `with_head`; it reads the hidden state of
    /// token 0, so a caller that wants logits passes one token.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32, with_head: bool) {
        encode_all(&self.embed, pass, n_tokens);
        for layer in &self.layers {
            layer.attn_norm.encode(pass, n_tokens);
            encode_all(&layer.qkv_proj, pass, n_tokens);
            encode_all(&layer.qk_norm, pass, n_tokens);
            layer.rope_and_store.encode(pass, n_tokens);
            layer.attention.encode(pass, n_tokens);
            encode_all(&layer.o_proj, pass, n_tokens);
            layer.attn_residual.encode(pass, n_tokens);
            layer.ffn_norm.encode(pass, n_tokens);
            encode_all(&layer.gate_up_proj, pass, n_tokens);
            layer.swiglu.encode(pass, n_tokens);
            encode_all(&layer.down_proj, pass, n_tokens);
            layer.ffn_residual.encode(pass, n_tokens);
        }
        if with_head {
            self.final_norm.encode(pass, 1);
            encode_all(&self.lm_head, pass, 1);
        }
    }
}

/// Where the q and k heads sit in a token's qkv row, for the family's norm.
fn qk_norm_rows(norm: QkNorm, heads: crate::kernels::Heads) -> (Rows, Rows) {
    let stride = heads.qkv_width();
    let q_width = heads.q * heads.dim;
    match norm {
        QkNorm::PerHead => (
            Rows {
                n: heads.dim,
                heads: heads.q,
                head_stride: heads.dim,
                token_stride: stride,
                offset: 0,
            },
            Rows {
                n: heads.dim,
                heads: heads.kv,
                head_stride: heads.dim,
                token_stride: stride,
                offset: q_width,
            },
        ),
        QkNorm::WholeProjection => (
            Rows {
                n: q_width,
                heads: 1,
                head_stride: 0,
                token_stride: stride,
                offset: 0,
            },
            Rows {
                n: heads.kv_width(),
                heads: 1,
                head_stride: 0,
                token_stride: stride,
                offset: q_width,
            },
        ),
        QkNorm::None => unreachable!("no rows to normalise"),
    }
}
