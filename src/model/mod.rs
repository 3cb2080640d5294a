//! A model on the GPU: its validated config, its family row, its weights
//! (uploaded once, bf16) and the pipelines that run them.

pub mod config;
pub mod family;
pub mod gguf_checkpoint;
mod synthetic;
pub mod weights;

use std::path::{Path, PathBuf};

pub use config::{ModelConfig, MoeConfig, Quantization, RopeConfig, RopeScaling, Routing};
pub use family::{Family, QkNorm};
use weights::{Checkpoint, TensorSource, Uploader};

use crate::error::Result;
use crate::gpu::{Gpu, GpuTensor};
use crate::kernels::Kernels;
use crate::progress::Progress;

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
/// stacked into this layout.
#[derive(Debug)]
pub struct MoeWeights {
    /// `[experts, hidden]`.
    pub router: GpuTensor,
    /// f32 `[experts]`, for sigmoid-with-bias scoring.
    pub score_bias: Option<wgpu::Buffer>,
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

    /// Bytes of GPU memory the weights take, in their stored formats.
    pub fn bytes(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(LayerWeights::bytes).sum();
        self.embed.bytes()
            + layers
            + self.final_norm.bytes()
            + self.lm_head.as_ref().map_or(0, GpuTensor::bytes)
    }

    /// Bytes one decode step reads: every weight it uses, the embedding's
    /// one row and, of a MoE layer's experts, the `top_k` it selects.
    pub fn decode_bytes(&self, top_k: usize) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| match &l.ffn {
                FfnWeights::Moe(m) => {
                    let experts = m.router.rows as u64;
                    l.bytes() - m.gate_up.bytes() - m.down.bytes()
                        + (m.gate_up.bytes() + m.down.bytes()) * top_k as u64 / experts
                }
                FfnWeights::Dense { .. } => l.bytes(),
            })
            .sum();
        let embed_row = self.embed.bytes() / self.embed.rows.max(1) as u64;
        embed_row + layers + self.final_norm.bytes() + self.head().bytes()
    }
}

impl LayerWeights {
    fn bytes(&self) -> u64 {
        let norms = [&self.attn_norm, &self.ffn_norm].into_iter().chain(&self.q_norm).chain(&self.k_norm);
        let ffn = match &self.ffn {
            FfnWeights::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
            FfnWeights::Moe(m) => m.router.bytes() + m.gate_up.bytes() + m.down.bytes(),
        };
        norms.map(GpuTensor::bytes).sum::<u64>() + self.qkv.bytes() + self.o_proj.bytes() + ffn
    }
}

/// A loaded model, ready to open sessions on.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub gpu: Gpu,
    pub weights: Weights,
    pub kernels: Kernels,
    /// Where the model's files describe its tokenizer, read on request
    /// ([`Model::tokenizer`]), so that a caller who gives ids never needs it.
    tokenizer_source: Option<PathBuf>,
}

impl Model {
    /// Loads `path` onto `gpu`: a Hugging Face folder (config.json +
    /// safetensors, sharded or not; weights as bf16) or a GGUF file (or the
    /// first of a split set, or a folder holding one and no config.json;
    /// weights in their stored formats).
    pub fn load(path: impl AsRef<Path>, gpu: &Gpu) -> Result<Model> {
        Self::load_with_progress(path, gpu, |_| {})
    }

    /// [`Self::load`], reporting the weights' upload to `progress` (one
    /// step, in bytes).
    pub fn load_with_progress(
        path: impl AsRef<Path>,
        gpu: &Gpu,
        mut progress: impl FnMut(Progress<'_>),
    ) -> Result<Model> {
        let dir = path.as_ref();
        let (config, checkpoint, bytes, tokenizer_source): (_, Box<dyn TensorSource>, _, _) =
            match gguf_checkpoint::gguf_in(dir)? {
                Some(file) => {
                    let checkpoint = gguf_checkpoint::GgufCheckpoint::open(&file)?;
                    let config = checkpoint.config()?;
                    let bytes = checkpoint.gpu_bytes();
                    gpu.check_budget("model weights", bytes)?;
                    (config, Box::new(checkpoint), bytes, file)
                }
                None => {
                    let config = ModelConfig::load(dir)?;
                    let bytes = config.weight_bytes();
                    // Before the checkpoint is opened: a model too large fails first.
                    gpu.check_budget("model weights", bytes)?;
                    let checkpoint = Checkpoint::open(dir, config.quantization)?;
                    (config, Box::new(checkpoint), bytes, dir.to_path_buf())
                }
            };
        let kernels = Kernels::new(gpu)?;
        progress(Progress::Begin { what: &format!("loading {}", dir.display()), total_bytes: Some(bytes) });
        let weights = upload(gpu, &config, checkpoint.as_ref(), &mut progress)?;
        progress(Progress::End);
        Ok(Model { config, gpu: gpu.clone(), weights, kernels, tokenizer_source: Some(tokenizer_source) })
    }

    /// The chat template the model's files carry: a GGUF's
    /// `tokenizer.chat_template` or a folder's tokenizer_config.json
    /// (`None`: they carry none).
    pub fn chat_template(&self) -> Result<Option<crate::chat::ChatTemplate>> {
        match &self.tokenizer_source {
            None => Ok(None),
            Some(path) if path.is_dir() => crate::chat::ChatTemplate::from_folder(path),
            Some(path) => crate::chat::ChatTemplate::from_gguf(&crate::gguf::Gguf::open(path)?),
        }
    }

    /// The tokenizer the model's files describe: a folder's tokenizer.json,
    /// or a GGUF file's metadata (`None`: there is none, or its kind is not
    /// one [`crate::tokenizer`] builds).
    pub fn tokenizer(&self) -> Result<Option<crate::tokenizer::Tokenizer>> {
        match &self.tokenizer_source {
            None => Ok(None),
            Some(path) if path.is_dir() => crate::tokenizer::from_folder(path),
            Some(path) => crate::tokenizer::from_gguf(&crate::gguf::Gguf::open(path)?),
        }
    }

    /// A model of `config`'s shapes with seeded random bf16 weights (scaled
    /// by `1/sqrt(fan_in)`), for benchmarks at full size without a
    /// checkpoint.
    pub fn synthetic(config: ModelConfig, gpu: &Gpu, seed: u64) -> Result<Model> {
        gpu.check_budget("model weights", config.weight_bytes())?;
        let kernels = Kernels::new(gpu)?;
        let weights = upload(gpu, &config, &synthetic::RandomWeights { seed }, &mut |_| {})?;
        Ok(Model { config, gpu: gpu.clone(), weights, kernels, tokenizer_source: None })
    }
}

fn upload(
    gpu: &Gpu,
    c: &ModelConfig,
    checkpoint: &dyn TensorSource,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Weights> {
    let mut up = Uploader::new(gpu, checkpoint, progress);
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
        let (q_norm, k_norm) = match c.family.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(up.norm(&name("self_attn.q_norm.weight"), heads.dim)?),
                Some(up.norm(&name("self_attn.k_norm.weight"), heads.dim)?),
            ),
            QkNorm::WholeProjection => (
                Some(up.norm(&name("self_attn.q_norm.weight"), q_rows)?),
                Some(up.norm(&name("self_attn.k_norm.weight"), kv_rows)?),
            ),
        };
        layers.push(LayerWeights {
            attn_norm: up.norm(&name("input_layernorm.weight"), hidden)?,
            qkv: up.stack(
                &name("self_attn.qkv"),
                &[(&q, q_rows), (&k, kv_rows), (&v, kv_rows)],
                hidden,
                1,
            )?,
            q_norm,
            k_norm,
            o_proj: up.matrix(&name("self_attn.o_proj.weight"), hidden, q_rows)?,
            ffn_norm: up.norm(&name("post_attention_layernorm.weight"), hidden)?,
            ffn: match &c.moe {
                Some(moe) if moe.sparse_layers[i] => FfnWeights::Moe(upload_moe(&mut up, c, moe, i)?),
                _ => FfnWeights::Dense {
                    gate_up: up.gate_up(
                        &name("mlp.gate_up"),
                        &[
                            (&name("mlp.gate_proj.weight"), &[c.intermediate, hidden]),
                            (&name("mlp.up_proj.weight"), &[c.intermediate, hidden]),
                        ],
                        c.intermediate,
                        hidden,
                    )?,
                    down: up.matrix(&name("mlp.down_proj.weight"), hidden, c.intermediate)?,
                },
            },
        });
    }
    let final_norm = up.norm("model.norm.weight", hidden)?;
    let lm_head = if c.tie_embeddings { None } else { Some(up.matrix("lm_head.weight", c.vocab, hidden)?) };
    up.flush()?;
    Ok(Weights { embed, layers, final_norm, lm_head })
}

/// A MoE layer, from the fused 3-D layout (`mlp.experts.gate_up_proj`) when
/// the checkpoint has it, else from the family's per-expert tensors.
fn upload_moe(up: &mut Uploader<'_>, c: &ModelConfig, moe: &MoeConfig, layer: usize) -> Result<MoeWeights> {
    let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
    let (h, i, e) = (c.hidden, moe.intermediate, moe.experts);
    let fused = name("mlp.experts.gate_up_proj");
    let names = c.family.moe.expect("a MoE config comes from a MoE family").names;
    let block = if up.contains(&fused) { "mlp" } else { names.block };
    let (gate_up, down) = if up.contains(&fused) {
        (
            up.gate_up(&fused, &[(&fused, &[e, 2 * i, h])], i, h)?,
            up.experts(&name("mlp.experts.down_proj"), e, h, i)?,
        )
    } else {
        let expert = |x: usize, which: &str| name(&format!("{block}.experts.{x}.{which}.weight"));
        let gate_up_names: Vec<(String, String)> =
            (0..e).map(|x| (expert(x, names.gate), expert(x, names.up))).collect();
        let shape = [i, h];
        let gate_up_sources: Vec<(&str, &[usize])> = gate_up_names
            .iter()
            .flat_map(|(g, u)| [(g.as_str(), &shape[..]), (u.as_str(), &shape[..])])
            .collect();
        let down_names: Vec<String> = (0..e).map(|x| expert(x, names.down)).collect();
        let down_sources: Vec<(&str, usize)> = down_names.iter().map(|d| (d.as_str(), h)).collect();
        (
            up.gate_up(&name(&format!("{block}.experts.gate_up")), &gate_up_sources, i, h)?,
            up.stack(&name(&format!("{block}.experts.down")), &down_sources, i, h)?,
        )
    };
    let score_bias = match moe.routing {
        Routing::SigmoidWithBias => {
            Some(up.f32_vector(&name(&format!("{block}.e_score_correction_bias")), e)?)
        }
        Routing::Softmax { .. } => None,
    };
    Ok(MoeWeights {
        router: up.matrix(&name(&format!("{block}.{}.weight", names.router)), e, h)?,
        score_bias,
        gate_up,
        down,
    })
}
