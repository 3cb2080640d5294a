//! Qwen3-VL's vision tower as config.json describes it (`vision_config`)
//! and its weights (`model.visual.*`): a ViT over an image's patches, whose
//! merger turns each 2 x 2 block of patches into one row of the language
//! model's width, and whose deepstack mergers do the same from the
//! outputs of chosen blocks.

use std::path::Path;

use serde::Deserialize;

use super::weights::Uploader;
use crate::error::{Error, Result};
use crate::gpu::GpuTensor;
use crate::kernels::bias_act::Activation;

/// `vision_config`'s fields, as written; an absent one takes the default
/// of transformers' `Qwen3VLVisionConfig` (Qwen3-VL-4B's tower).
#[derive(Debug, Deserialize)]
#[serde(default)]
struct RawVision {
    depth: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_heads: usize,
    patch_size: usize,
    temporal_patch_size: usize,
    spatial_merge_size: usize,
    out_hidden_size: usize,
    num_position_embeddings: usize,
    deepstack_visual_indexes: Vec<usize>,
    hidden_act: String,
    in_channels: usize,
    rope_parameters: Option<RawVisionRope>,
}

impl Default for RawVision {
    fn default() -> Self {
        RawVision {
            depth: 27,
            hidden_size: 1152,
            intermediate_size: 4304,
            num_heads: 16,
            patch_size: 16,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            out_hidden_size: 3584,
            num_position_embeddings: 2304,
            deepstack_visual_indexes: vec![8, 16, 24],
            hidden_act: "gelu_pytorch_tanh".into(),
            in_channels: 3,
            rope_parameters: None,
        }
    }
}

#[derive(Debug, Deserialize)]
struct RawVisionRope {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

/// A validated vision tower configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Transformer blocks of the tower.
    pub depth: usize,
    /// The tower's width.
    pub hidden: usize,
    /// Width of a block's MLP.
    pub intermediate: usize,
    /// Attention heads of a block.
    pub heads: usize,
    /// Side of a square patch, in pixels.
    pub patch_size: usize,
    /// Frames a patch spans (an image repeats its one frame).
    pub temporal_patch_size: usize,
    /// Side of the square of patches one merged row covers.
    pub merge_size: usize,
    /// The language model's width, that merged rows have.
    pub out_hidden: usize,
    /// The learned position table is `side x side` rows.
    pub position_side: usize,
    /// Blocks after which a deepstack merger reads the patches, in the
    /// order of the mergers (the language model's layers 0, 1, ... add them).
    pub deepstack_layers: Vec<usize>,
    /// The blocks' MLP activation.
    pub activation: Activation,
    /// Of the 2-D rotary embedding.
    pub rope_theta: f64,
    /// The ids that stand for an image in a prompt.
    pub tokens: ImageTokens,
}

/// The ids of an image in a prompt: its placeholder (one per merged row,
/// once expanded) between the markers the chat template writes around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ImageTokens {
    pub image: Option<u32>,
    pub start: Option<u32>,
    pub end: Option<u32>,
}

/// Vision towers deeper than this are broken configs.
const MAX_DEPTH: usize = 1 << 10;

impl VisionConfig {
    /// From config.json's `vision_config` (`value`), for a language model
    /// of width `text_hidden`.
    pub fn parse(
        value: &serde_json::Value,
        path: &Path,
        text_hidden: usize,
        tokens: ImageTokens,
    ) -> Result<Self> {
        let invalid = |message: String| Error::InvalidConfig {
            path: path.to_path_buf(),
            message: format!("vision_config: {message}"),
        };
        let raw: RawVision = serde_path_to_error::deserialize(value.clone())
            .map_err(|e| invalid(format!("{}: {}", e.path(), e.inner())))?;
        let positive = [
            ("depth", raw.depth),
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_heads", raw.num_heads),
            ("patch_size", raw.patch_size),
            ("num_position_embeddings", raw.num_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(invalid(format!("{name} must be positive")));
        }
        if raw.depth > MAX_DEPTH {
            return Err(invalid(format!(
                "depth {} is more than any tower has (at most {MAX_DEPTH})",
                raw.depth
            )));
        }
        if !raw.hidden_size.is_multiple_of(raw.num_heads) {
            return Err(invalid(format!(
                "hidden_size {} is not a multiple of num_heads {}",
                raw.hidden_size, raw.num_heads
            )));
        }
        let head_dim = raw.hidden_size / raw.num_heads;
        // The 2-D rotation gives a quarter of each head to each axis's
        // frequencies.
        if !head_dim.is_multiple_of(4) || head_dim > crate::kernels::attention::MAX_HEAD_DIM {
            return Err(Error::Unsupported {
                what: "vision head width (a multiple of 4, at most 256)",
                value: format!("{head_dim}"),
            });
        }
        if raw.in_channels != 3 {
            return Err(Error::Unsupported {
                what: "vision input channels (3 are read)",
                value: raw.in_channels.to_string(),
            });
        }
        if raw.out_hidden_size != text_hidden {
            return Err(invalid(format!(
                "out_hidden_size {} differs from the language model's hidden_size {text_hidden}",
                raw.out_hidden_size
            )));
        }
        let (merge_size, temporal_patch_size) = (raw.spatial_merge_size, raw.temporal_patch_size);
        if merge_size == 0
            || merge_size > 16
            || temporal_patch_size == 0
            || temporal_patch_size > 16
            || raw.patch_size > 1024
        {
            return Err(invalid(format!(
                "patch_size {}, temporal_patch_size {temporal_patch_size} and spatial_merge_size {merge_size} must be positive and small",
                raw.patch_size
            )));
        }
        if let Some(&bad) = raw.deepstack_visual_indexes.iter().find(|&&i| i >= raw.depth) {
            return Err(invalid(format!(
                "deepstack_visual_indexes holds {bad}, past the {} blocks",
                raw.depth
            )));
        }
        let activation = Activation::from_name(&raw.hidden_act)
            .ok_or_else(|| Error::Unsupported { what: "vision hidden_act", value: raw.hidden_act.clone() })?;
        let rope = raw.rope_parameters.as_ref();
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref()).filter(|k| *k != "axial") {
            return Err(Error::Unsupported {
                what: "vision rope_type (axial is read)",
                value: kind.to_string(),
            });
        }
        let rope_theta = rope.and_then(|r| r.rope_theta).unwrap_or(10_000.0);
        if !(rope_theta as f32 > 0.0 && (rope_theta as f32).is_finite()) {
            return Err(invalid(format!("rope_theta {rope_theta} must be a positive finite f32")));
        }
        Ok(VisionConfig {
            depth: raw.depth,
            hidden: raw.hidden_size,
            intermediate: raw.intermediate_size,
            heads: raw.num_heads,
            patch_size: raw.patch_size,
            temporal_patch_size,
            merge_size,
            out_hidden: raw.out_hidden_size,
            // transformers takes the integer square root.
            position_side: (raw.num_position_embeddings as f64).sqrt() as usize,
            deepstack_layers: raw.deepstack_visual_indexes,
            activation,
            rope_theta,
            tokens,
        })
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Values per patch: 3 channels x frames x patch rows x patch columns.
    pub fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Width of a merged row's input: a merge block of patches side by side.
    pub fn merged_width(&self) -> usize {
        self.hidden * self.merge_size * self.merge_size
    }

    /// Bytes of the tower's weights on the GPU.
    pub fn weight_bytes(&self) -> u64 {
        let (h, i, m) = (self.hidden, self.intermediate, self.merged_width());
        let block = 3 * h * h + h * h + 2 * h * i;
        let merger = m * m + self.out_hidden * m;
        let bf16 = h * self.patch_len()
            + self.position_side.pow(2) * h
            + self.depth * block
            + (1 + self.deepstack_layers.len()) * merger;
        let f32s =
            self.depth * (9 * h + i) + (1 + self.deepstack_layers.len()) * (3 * m + self.out_hidden) + h;
        2 * bf16 as u64 + 4 * f32s as u64
    }
}

/// A linear layer with its bias.
#[derive(Debug)]
pub struct Linear {
    pub weight: GpuTensor,
    pub bias: wgpu::Buffer,
}

/// A LayerNorm's weight and bias.
#[derive(Debug)]
pub struct LayerNorm {
    pub weight: wgpu::Buffer,
    pub bias: wgpu::Buffer,
}

#[derive(Debug)]
pub struct VisionBlock {
    pub norm1: LayerNorm,
    pub qkv: Linear,
    pub proj: Linear,
    pub norm2: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// A merger: its norm (over one patch, or over a merge block's patches
/// side by side for the deepstack mergers), then two linear layers.
#[derive(Debug)]
pub struct Merger {
    pub norm: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

#[derive(Debug)]
pub struct VisionWeights {
    pub patch_embed: Linear,
    /// `side x side` learned positions, `[side^2, hidden]`.
    pub pos_embed: GpuTensor,
    pub blocks: Vec<VisionBlock>,
    pub merger: Merger,
    pub deepstack: Vec<Merger>,
}

fn linear(up: &mut Uploader<'_>, name: &str, rows: usize, cols: usize) -> Result<Linear> {
    Ok(Linear {
        weight: up.matrix(&format!("{name}.weight"), rows, cols)?,
        bias: up.f32_vector(&format!("{name}.bias"), rows)?,
    })
}

fn layer_norm(up: &mut Uploader<'_>, name: &str, n: usize) -> Result<LayerNorm> {
    Ok(LayerNorm {
        weight: up.f32_vector(&format!("{name}.weight"), n)?,
        bias: up.f32_vector(&format!("{name}.bias"), n)?,
    })
}

fn merger(up: &mut Uploader<'_>, name: &str, v: &VisionConfig, norm_width: usize) -> Result<Merger> {
    let m = v.merged_width();
    Ok(Merger {
        norm: layer_norm(up, &format!("{name}.norm"), norm_width)?,
        fc1: linear(up, &format!("{name}.linear_fc1"), m, m)?,
        fc2: linear(up, &format!("{name}.linear_fc2"), v.out_hidden, m)?,
    })
}

/// Uploads the tower's weights (`model.visual.*`).
pub fn upload(up: &mut Uploader<'_>, v: &VisionConfig) -> Result<VisionWeights> {
    let (h, i) = (v.hidden, v.intermediate);
    let name = |suffix: &str| format!("model.visual.{suffix}");
    let kernel = [h, 3, v.temporal_patch_size, v.patch_size, v.patch_size];
    let patch_embed = Linear {
        weight: up.tensor(&name("patch_embed.proj.weight"), &kernel, v.patch_len())?,
        bias: up.f32_vector(&name("patch_embed.proj.bias"), h)?,
    };
    let pos_embed = up.matrix(&name("pos_embed.weight"), v.position_side * v.position_side, h)?;
    let blocks = (0..v.depth)
        .map(|b| {
            let block = |suffix: &str| name(&format!("blocks.{b}.{suffix}"));
            Ok(VisionBlock {
                norm1: layer_norm(up, &block("norm1"), h)?,
                qkv: linear(up, &block("attn.qkv"), 3 * h, h)?,
                proj: linear(up, &block("attn.proj"), h, h)?,
                norm2: layer_norm(up, &block("norm2"), h)?,
                fc1: linear(up, &block("mlp.linear_fc1"), i, h)?,
                fc2: linear(up, &block("mlp.linear_fc2"), h, i)?,
            })
        })
        .collect::<Result<_>>()?;
    let merger_weights = merger(up, &name("merger"), v, h)?;
    let deepstack = (0..v.deepstack_layers.len())
        .map(|j| merger(up, &name(&format!("deepstack_merger_list.{j}")), v, v.merged_width()))
        .collect::<Result<_>>()?;
    Ok(VisionWeights { patch_embed, pos_embed, blocks, merger: merger_weights, deepstack })
}
