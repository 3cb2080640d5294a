//! A model's weights on the GPU, layer by layer, in the layout the layer
//! flow reads.

use super::vision;
use crate::gpu::GpuTensor;

/// One decoder layer's weights. Projections that read the same input are
/// stacked into one tensor so they run as one GEMV.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: GpuTensor,
    /// q, k and v projections stacked: `[(nh + 2 nkv) * hd, hidden]`.
    pub qkv: GpuTensor,
    pub q_norm: Option<GpuTensor>,
    pub k_norm: Option<GpuTensor>,
    pub o_proj: GpuTensor,
    pub ffn_norm: GpuTensor,
    pub ffn: FfnWeights,
}

#[derive(Debug)]
pub enum FfnWeights {
    Dense {
        /// gate and up projections, rows interleaved: `[2 * intermediate,
        /// hidden]`, row `2i` gate row `i`, row `2i + 1` up row `i`.
        gate_up: GpuTensor,
        down: GpuTensor,
    },
    Moe(MoeWeights),
}

/// A MoE layer's router and experts. Expert `e` owns rows
/// `[e * 2I, (e + 1) * 2I)` of `gate_up` (its gate and up rows
/// interleaved, as a dense layer's) and rows `[e * H, (e + 1) * H)` of
/// `down`: per-expert tensors and transformers 5's fused ones are both
/// stacked into this layout. With expert streaming the two hold the
/// layer's slots instead, in the same layout: slot `s` is where expert `e`
/// would be.
#[derive(Debug)]
pub struct MoeWeights {
    /// `[experts, hidden]`.
    pub router: GpuTensor,
    /// f32 `[experts]`, for sigmoid-with-bias scoring.
    pub score_bias: Option<wgpu::Buffer>,
    pub gate_up: GpuTensor,
    pub down: GpuTensor,
}

/// The weights one device holds: every layer of a model on one device;
/// of a model split across several (`model::split`), a range of layers,
/// with the embedding on the first device and the output on the last.
#[derive(Debug)]
pub struct Weights {
    /// The embedding, where these weights begin the model.
    pub embed: Option<GpuTensor>,
    pub layers: Vec<LayerWeights>,
    /// The final norm and the head, where these weights end the model.
    pub output: Option<OutputWeights>,
    pub vision: Option<vision::VisionWeights>,
}

/// The final norm and the LM head.
#[derive(Debug)]
pub struct OutputWeights {
    pub final_norm: GpuTensor,
    /// `None` for tied embeddings held beside it: the head is `embed`.
    pub lm_head: Option<GpuTensor>,
}

impl Weights {
    /// The final norm and the head; `Unsupported` where these weights do
    /// not end the model.
    pub fn output(&self) -> crate::error::Result<(&GpuTensor, &GpuTensor)> {
        let missing = || crate::Error::Unsupported {
            what: "the head on a device that does not hold the model's last layers",
            value: format!("{} layers without the output", self.layers.len()),
        };
        let output = self.output.as_ref().ok_or_else(missing)?;
        let head = output.lm_head.as_ref().or(self.embed.as_ref()).ok_or_else(missing)?;
        Ok((&output.final_norm, head))
    }

    /// Bytes of GPU memory the weights take, in their stored formats.
    pub fn bytes(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(LayerWeights::bytes).sum();
        let output = self
            .output
            .as_ref()
            .map_or(0, |o| o.final_norm.bytes() + o.lm_head.as_ref().map_or(0, GpuTensor::bytes));
        self.embed.as_ref().map_or(0, GpuTensor::bytes) + layers + output
    }

    #[cfg(feature = "internals")]
    /// Bytes one decode step reads: every weight it uses, the embedding's
    /// one row and, of a MoE layer's experts, the `top_k` it selects.
    pub fn decode_bytes(&self, top_k: usize) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| match &l.ffn {
                FfnWeights::Moe(m) => {
                    // Experts (or slots, when they stream) held: `down` is
                    // `[held * hidden, intermediate]`.
                    let held = (m.down.rows / m.router.cols.max(1)).max(1) as u64;
                    l.bytes() - m.gate_up.bytes() - m.down.bytes()
                        + (m.gate_up.bytes() + m.down.bytes()) * top_k as u64 / held
                }
                FfnWeights::Dense { .. } => l.bytes(),
            })
            .sum();
        let embed_row = self.embed.as_ref().map_or(0, |e| e.bytes() / e.rows.max(1) as u64);
        let output = self.output().map_or(0, |(norm, head)| norm.bytes() + head.bytes());
        embed_row + layers + output
    }
}

impl LayerWeights {
    pub(crate) fn bytes(&self) -> u64 {
        let norms = [&self.attn_norm, &self.ffn_norm].into_iter().chain(&self.q_norm).chain(&self.k_norm);
        let ffn = match &self.ffn {
            FfnWeights::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
            FfnWeights::Moe(m) => m.router.bytes() + m.gate_up.bytes() + m.down.bytes(),
        };
        norms.map(GpuTensor::bytes).sum::<u64>() + self.qkv.bytes() + self.o_proj.bytes() + ffn
    }
}
