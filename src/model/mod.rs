//! A model on the GPU: its validated config, its family row, its weights
//! (uploaded once, bf16) and the pipelines that run them.

pub mod config;
pub mod family;
pub mod gguf;
pub mod weights;

use std::path::Path;

pub use config::{ModelConfig, RopeConfig, RopeScaling};
pub use family::{Family, QkNorm};
use weights::{Checkpoint, Uploader};

use crate::error::Result;
use crate::gpu::{Gpu, GpuTensor};
use crate::kernels::Kernels;

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
    /// gate and up projections stacked: `[2 * intermediate, hidden]`.
    pub gate_up: GpuTensor,
    pub down: GpuTensor,
}

#[derive(Debug)]
pub struct Weights {
    pub embed: GpuTensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: GpuTensor,
    /// `None` for tied embeddings: the head is `embed`.
    pub lm_head: Option<GpuTensor>,
}

impl Weights {
    pub fn head(&self) -> &GpuTensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// A loaded model, ready to open sessions on.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub gpu: Gpu,
    pub weights: Weights,
    pub kernels: Kernels,
}

impl Model {
    /// Loads `dir` (config.json + safetensors, sharded or not) onto `gpu`.
    pub fn load(dir: impl AsRef<Path>, gpu: &Gpu) -> Result<Model> {
        let dir = dir.as_ref();
        let config = ModelConfig::load(dir)?;
        gpu.check_budget("model weights", config.weight_bytes())?;
        let checkpoint = Checkpoint::open(dir)?;
        let kernels = Kernels::new(gpu)?;
        let weights = upload(gpu, &config, &checkpoint)?;
        Ok(Model {
            config,
            gpu: gpu.clone(),
            weights,
            kernels,
        })
    }
}

fn upload(gpu: &Gpu, c: &ModelConfig, checkpoint: &Checkpoint) -> Result<Weights> {
    let mut up = Uploader::new(gpu, checkpoint);
    let (hidden, heads) = (c.hidden, c.heads);
    let q_rows = heads.q * heads.dim;
    let kv_rows = heads.kv * heads.dim;

    let embed = up.matrix("model.embed_tokens.weight", c.vocab, hidden)?;
    let mut layers = Vec::with_capacity(c.layers);
    for i in 0..c.layers {
        let name = |suffix: &str| format!("model.layers.{i}.{suffix}");
        let (q, k, v) = (
            name("self_attn.q_proj.weight"),
            name("self_attn.k_proj.weight"),
            name("self_attn.v_proj.weight"),
        );
        let (gate, up_proj) = (name("mlp.gate_proj.weight"), name("mlp.up_proj.weight"));
        let (q_norm, k_norm) = match c.family.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(up.matrix(&name("self_attn.q_norm.weight"), 1, heads.dim)?),
                Some(up.matrix(&name("self_attn.k_norm.weight"), 1, heads.dim)?),
            ),
            QkNorm::WholeProjection => (
                Some(up.matrix(&name("self_attn.q_norm.weight"), 1, q_rows)?),
                Some(up.matrix(&name("self_attn.k_norm.weight"), 1, kv_rows)?),
            ),
        };
        layers.push(LayerWeights {
            attn_norm: up.matrix(&name("input_layernorm.weight"), 1, hidden)?,
            qkv: up.stack(
                &name("self_attn.qkv"),
                &[(&q, q_rows), (&k, kv_rows), (&v, kv_rows)],
                hidden,
            )?,
            q_norm,
            k_norm,
            o_proj: up.matrix(&name("self_attn.o_proj.weight"), hidden, q_rows)?,
            ffn_norm: up.matrix(&name("post_attention_layernorm.weight"), 1, hidden)?,
            gate_up: up.stack(
                &name("mlp.gate_up"),
                &[(&gate, c.intermediate), (&up_proj, c.intermediate)],
                hidden,
            )?,
            down: up.matrix(&name("mlp.down_proj.weight"), hidden, c.intermediate)?,
        });
    }
    let final_norm = up.matrix("model.norm.weight", 1, hidden)?;
    let lm_head = if c.tie_embeddings {
        None
    } else {
        Some(up.matrix("lm_head.weight", c.vocab, hidden)?)
    };
    up.flush()?;
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}
