//! The named intermediate tensors of the flow (f32, `[tokens, width]`),
//! sized for the most tokens one submission carries.

use super::GemmScratch;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::kernels::Step;
use crate::kernels::attention::Attention;
use crate::kernels::sample::SampleScratch;
use crate::model::ModelConfig;

#[derive(Debug)]
pub struct Activations {
    pub max_tokens: usize,
    /// Token ids in flight, u32. Token selection on the GPU writes the next
    /// step's id to element 0.
    pub tokens: wgpu::Buffer,
    /// The uniform [`Step`]: first position, token count, attention splits.
    pub step: wgpu::Buffer,
    /// cos/sin of every cache slot's rotary angles (its position's, as the
    /// session places them).
    pub cos_sin: wgpu::Buffer,
    /// Floats per row of `cos_sin`.
    pub cos_sin_row: usize,
    pub hidden: usize,
    /// The residual stream.
    pub x: wgpu::Buffer,
    /// The last token's row of `x`, input of the head.
    pub x_last: wgpu::Buffer,
    /// A normalised copy of `x`, input of a chunk's GEMMs (GEMVs normalise
    /// `x` themselves).
    pub h: wgpu::Buffer,
    pub qkv: wgpu::Buffer,
    /// Value rows that a layer's projection writes apart from `qkv`, where
    /// any layer does.
    pub values: Option<ValueRows>,
    pub attn: wgpu::Buffer,
    /// Split attention of one token: partial sums and (max, sum) pairs.
    pub attn_split_acc: wgpu::Buffer,
    pub attn_split_max_sum: wgpu::Buffer,
    /// Most key splits of one token's attention.
    pub max_splits: usize,
    /// `h`, `attn` and `ffn_act` as f16 too, where a chunk's GEMMs run on
    /// cooperative matrices in f16 (`kernels::gemm::HalfCopies`).
    pub h16: Option<wgpu::Buffer>,
    pub attn16: Option<wgpu::Buffer>,
    pub ffn_act16: Option<wgpu::Buffer>,
    /// Outputs of a chunk's GEMMs before their residual add (`attn_out`
    /// and `ffn_out`: `[summed_rows, hidden]`, see `flow::GemmScratch`).
    pub attn_out: wgpu::Buffer,
    pub ffn_act: wgpu::Buffer,
    pub ffn_out: wgpu::Buffer,
    /// Partial sums over k of a few-token chunk's q/k/v or gate/up, where
    /// those split (`flow::GemmScratch::split_floats`).
    pub split_parts: Option<wgpu::Buffer>,
    pub logits: wgpu::Buffer,
    pub sample: SampleScratch,
    pub moe: Option<MoeActivations>,
}

/// Value rows written apart from `qkv` (see `flow::first_value_row_apart`).
#[derive(Debug)]
pub struct ValueRows {
    /// `[tokens, kv heads x head_dim]`: a chunk's.
    pub chunk: wgpu::Buffer,
    /// One token's, a buffer per layer (none where chunks run the GEMV,
    /// which then writes `chunk` for one token too). A layer's buffer is
    /// first used in a step by the dispatch that writes it, so no barrier
    /// orders that dispatch after the q/k part's, as one does where the
    /// previous layer's attention read the same buffer (one buffer for
    /// every layer decodes slower).
    pub decode: Vec<wgpu::Buffer>,
}

impl ValueRows {
    /// The buffer layer `layer`'s one-token step writes.
    pub fn decode(&self, layer: usize) -> &wgpu::Buffer {
        self.decode.get(layer).unwrap_or(&self.chunk)
    }
}

/// The routed half of a MoE layer: `[tokens, experts]` router logits, the
/// selection `[tokens, k]`, and per-slot expert activations `[tokens, k, w]`.
#[derive(Debug)]
pub struct MoeActivations {
    pub top_k: usize,
    pub router_logits: wgpu::Buffer,
    pub route_ids: wgpu::Buffer,
    pub route_weights: wgpu::Buffer,
    pub expert_act: wgpu::Buffer,
    pub expert_out: wgpu::Buffer,
    /// One token's guess at the next MoE layer's choice (its router on
    /// this layer's input), for prefetching streamed experts.
    pub predicted_logits: wgpu::Buffer,
    pub predicted_ids: wgpu::Buffer,
    pub predicted_weights: wgpu::Buffer,
    /// Prefill grouping by expert, written by the host after the routing
    /// readback: u32 `[experts, 2]` (offset, count) and the pair indices
    /// `token * top_k + slot` of each expert, in expert order.
    pub groups: wgpu::Buffer,
    pub pairs: wgpu::Buffer,
}

impl Activations {
    /// The most tokens per submission (at most `wanted`) for which every
    /// activation fits one storage binding.
    pub fn max_chunk(gpu: &Gpu, c: &ModelConfig, wanted: usize) -> usize {
        let moe_width = c.moe.as_ref().map_or(0, |m| (m.top_k * m.intermediate.max(c.hidden)).max(m.experts));
        let widest = [c.hidden, c.heads.qkv_width(), c.intermediate, moe_width].into_iter().max().unwrap();
        let fits = (gpu.caps.max_storage_binding / (4 * widest as u64)).max(1) as usize;
        wanted.clamp(1, fits)
    }

    /// `values_apart`: some layer writes its value rows apart; `chunk_gemm`:
    /// a GEMM runs the chunks' projections (not the GEMV); `half_copies`:
    /// that GEMM reads f16 copies of its activations; `scratch`: the room
    /// its partial sums over k take.
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        (max_tokens, scratch): (usize, GemmScratch),
        context_len: usize,
        (values_apart, chunk_gemm, half_copies): (bool, bool, bool),
    ) -> Result<Self> {
        let t = max_tokens;
        let splits = Attention::max_splits(context_len, c.heads.kv);
        let buf = |name: &str, width: usize| gpu.storage_buffer(name, t * width);
        let half = |name: &str, width: usize| {
            half_copies.then(|| gpu.storage_buffer_bytes(name, (t * width * 2) as u64)).transpose()
        };
        let moe = match &c.moe {
            Some(m) => Some(MoeActivations {
                top_k: m.top_k,
                router_logits: buf("router_logits", m.experts)?,
                route_ids: buf("route_ids", m.top_k)?,
                route_weights: buf("route_weights", m.top_k)?,
                expert_act: buf("expert_act", m.top_k * m.intermediate)?,
                expert_out: buf("expert_out", m.top_k * c.hidden)?,
                predicted_logits: gpu.storage_buffer("predicted_logits", m.experts)?,
                predicted_ids: gpu.storage_buffer("predicted_ids", m.top_k)?,
                predicted_weights: gpu.storage_buffer("predicted_weights", m.top_k)?,
                groups: gpu.storage_buffer("moe_groups", 2 * m.experts)?,
                pairs: buf("moe_pairs", m.top_k)?,
            }),
            None => None,
        };
        Ok(Activations {
            max_tokens,
            tokens: gpu.storage_buffer("tokens", t)?,
            step: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("step"),
                size: std::mem::size_of::<Step>() as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            cos_sin: gpu.storage_buffer_init("cos_sin", &c.rope.cos_sin_table(context_len)),
            cos_sin_row: 2 * (c.rope.rotary_dim / 2),
            hidden: c.hidden,
            x: buf("x", c.hidden)?,
            x_last: gpu.storage_buffer("x_last", c.hidden)?,
            h: buf("h", c.hidden)?,
            qkv: buf("qkv", c.heads.qkv_width())?,
            values: match values_apart {
                true => Some(ValueRows {
                    chunk: buf("values", c.heads.kv_width())?,
                    decode: match chunk_gemm {
                        true => (0..c.layers)
                            .map(|i| gpu.storage_buffer(&format!("values.{i}"), c.heads.kv_width()))
                            .collect::<Result<_>>()?,
                        false => vec![],
                    },
                }),
                false => None,
            },
            attn: buf("attn", c.heads.q * c.heads.dim)?,
            attn_split_acc: gpu.storage_buffer("attn_split_acc", c.heads.q * splits * c.heads.dim)?,
            attn_split_max_sum: gpu.storage_buffer("attn_split_max_sum", c.heads.q * splits * 2)?,
            max_splits: splits,
            h16: half("h16", c.hidden)?,
            attn16: half("attn16", c.heads.q * c.heads.dim)?,
            ffn_act16: half("ffn_act16", c.intermediate)?,
            attn_out: gpu.storage_buffer("attn_out", scratch.summed_rows * c.hidden)?,
            ffn_act: buf("ffn_act", c.intermediate)?,
            ffn_out: gpu.storage_buffer("ffn_out", scratch.summed_rows * c.hidden)?,
            split_parts: match scratch.split_floats {
                0 => None,
                floats => Some(gpu.storage_buffer("split_parts", floats)?),
            },
            logits: gpu.storage_buffer("logits", c.vocab)?,
            sample: SampleScratch::new(gpu, c.vocab)?,
            moe,
        })
    }

    /// Replaces the rotary rows from cache slot `slot` on (rows of the
    /// rotary table's width: cosines, then sines).
    pub fn write_rotary_rows(&self, gpu: &Gpu, slot: usize, rows: &[f32]) {
        let row = self.cos_sin_row;
        gpu.queue.write_buffer(&self.cos_sin, (slot * row * 4) as u64, bytemuck::cast_slice(rows));
    }

    /// Sets the token ids of the next submission.
    pub fn write_tokens(&self, gpu: &Gpu, tokens: &[u32]) {
        debug_assert!(tokens.len() <= self.max_tokens);
        gpu.queue.write_buffer(&self.tokens, 0, bytemuck::cast_slice(tokens));
    }

    /// Sets the first position and token count of the next submission
    /// (queue writes land between submissions, in order, so the next one
    /// can be written while the current one runs) and returns it.
    pub fn write_step(&self, gpu: &Gpu, pos0: usize, n_tokens: usize, c: &ModelConfig) -> Step {
        debug_assert!(n_tokens <= self.max_tokens);
        let attn_splits = if n_tokens == 1 {
            let first_key = match c.sliding_window {
                Some(w) if pos0 + 1 > w => pos0 + 1 - w,
                _ => 0,
            };
            Attention::decode_splits(pos0 + 1 - first_key, c.heads.kv, self.max_splits)
        } else {
            1
        };
        let step = Step {
            pos0: pos0 as u32,
            n_tokens: n_tokens as u32,
            attn_splits: attn_splits as u32,
            ..Step::default()
        };
        gpu.queue.write_buffer(&self.step, 0, bytemuck::bytes_of(&step));
        step
    }
}
