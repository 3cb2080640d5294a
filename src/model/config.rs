//! `config.json`, in both layouts it ships in: the hub's (`rope_theta`,
//! `rope_scaling`, `torch_dtype`) and transformers 5's (`rope_parameters`,
//! `dtype`). Unknown keys are ignored.

use std::path::Path;

use serde::Deserialize;

use super::family::{self, Family, Renormalize, ScoringRule};
use super::vision::{ImageTokens, VisionConfig};
use crate::error::{Error, Result};
use crate::format::FP8_BLOCK_ELEMS;
use crate::kernels::router::ExpertSelection;
use crate::kv_cache::Heads;

/// More decoder layers than any model has: a config stating more is broken
/// (and would size per-layer tables before any tensor is read).
const MAX_LAYERS: usize = 1 << 16;

/// The most query heads a config may give (real models have at most a few
/// hundred): head counts times widths then stay far from overflow.
const MAX_HEADS: usize = 1 << 16;

/// The fields of `config.json` this engine reads, as written.
#[derive(Debug, Clone, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    /// The pretraining context, where a config keeps it outside its rope
    /// parameters (transformers then prefers it).
    original_max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    partial_rotary_factor: Option<f64>,
    rotary_dim: Option<usize>,
    sliding_window: Option<usize>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    /// An id or a list of ids.
    eos_token_id: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    // Qwen3-VL: the ids that stand for an image's or a video's rows.
    image_token_id: Option<u32>,
    video_token_id: Option<u32>,
    vision_start_token_id: Option<u32>,
    vision_end_token_id: Option<u32>,
    // Mixture of experts: hub configs say `num_local_experts` (Mixtral,
    // MiniMax) or `num_experts` (Qwen3-MoE); transformers 5 writes the former.
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    scoring_func: Option<String>,
    quantization_config: Option<RawQuantization>,
}

/// `quantization_config`, as the hub's FP8 releases write it.
#[derive(Debug, Clone, Deserialize)]
struct RawQuantization {
    quant_method: String,
    fmt: Option<String>,
    weight_block_size: Option<Vec<usize>>,
}

/// `rope_scaling` (hub) or `rope_parameters` (transformers 5, which also
/// carries `rope_theta`).
#[derive(Debug, Clone, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    // YaRN's.
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    attention_factor: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
    truncate: Option<bool>,
    partial_rotary_factor: Option<f64>,
    /// M-RoPE (Qwen3-VL): rotary frequencies per position axis (t, h, w).
    mrope_section: Option<Vec<usize>>,
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No rescaling: the frequencies of `theta` as they are (rope type
    /// "default").
    None,
    /// Positions divided by `factor`.
    Linear {
        /// What positions (and so every frequency) are divided by.
        factor: f64,
    },
    /// Llama 3.1: scaling by wavelength band.
    Llama3 {
        /// What the low frequencies are divided by.
        factor: f64,
        /// Wavelengths longer than `original_max_position_embeddings /
        /// low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original_max_position_embeddings /
        /// high_freq_factor` are kept; those between are interpolated.
        high_freq_factor: f64,
        /// The pretraining context, in positions.
        original_max_position_embeddings: usize,
    },
    /// Frequency `i` divided by `divisors[i]` (how GGUF files carry Llama
    /// 3's scaling, as the `rope_freqs` tensor).
    Divisors(Vec<f32>),
    /// YaRN (Qwen3's long contexts).
    Yarn(Yarn),
}

/// Llama 3.1's scaling by wavelength: frequencies whose wavelength exceeds
/// `old_len / low` are divided by `factor`, those under `old_len / high`
/// are kept, the band between interpolated.
struct Llama3Bands {
    factor: f32,
    low: f32,
    high: f32,
    old_len: f32,
}

impl Llama3Bands {
    fn scale(&self, f: f32) -> f32 {
        let (low_freq_wavelen, high_freq_wavelen) = (self.old_len / self.low, self.old_len / self.high);
        let wavelen = 2.0 * std::f32::consts::PI / f;
        let scaled = if wavelen > low_freq_wavelen { f / self.factor } else { f };
        // As transformers writes it (`~(a < b) * ~(a > c)`), NaN included.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
        if medium {
            let smooth = (self.old_len / wavelen - self.low) / (self.high - self.low);
            (1.0 - smooth) * scaled / self.factor + smooth * scaled
        } else {
            scaled
        }
    }
}

/// YaRN: frequencies that turn fewer than `beta_slow` times over the
/// pretraining context are divided by `factor`, those that turn more than
/// `beta_fast` times are kept, a ramp between; cos and sin are multiplied
/// by `attention_factor`.
#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    /// What the slow frequencies are divided by: how many times longer the
    /// context is than the pretraining one (from the context lengths where
    /// the config gives no factor).
    pub factor: f64,
    /// The pretraining context, in positions.
    pub original_max_position_embeddings: usize,
    /// Frequencies that turn more than this many times over the pretraining
    /// context are kept (32 where the config gives none, or 0).
    pub beta_fast: f64,
    /// Frequencies that turn fewer than this many times are divided by
    /// `factor` (1 where the config gives none, or 0).
    pub beta_slow: f64,
    /// Whether the ramp's ends are rounded out to whole dimensions.
    pub truncate: bool,
    /// What cos and sin are multiplied by: the config's
    /// `attention_factor`, else YaRN's magnitude correction
    /// `0.1 ln(factor) + 1` (1 for a factor of at most 1; with `mscale` and
    /// `mscale_all_dim`, the ratio of the two corrections they give).
    pub attention_factor: f64,
}

impl Yarn {
    /// The frequencies for `pos_freqs` (`theta^(2i/dim)`), as transformers
    /// computes them: the ramp's ends in f64 (Python's math), the rest in f32.
    fn inv_freq(&self, pos_freqs: &[f32], theta: f64) -> Vec<f32> {
        let dim = 2 * pos_freqs.len();
        // The dimension whose frequency turns `rotations` times over the
        // pretraining context.
        let turns = |rotations: f64| {
            let len = self.original_max_position_embeddings as f64;
            dim as f64 * (len / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (turns(self.beta_fast), turns(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        let factor = self.factor as f32;
        let ramp = |i: usize| ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
        pos_freqs
            .iter()
            .enumerate()
            .map(|(i, &pos_freq)| {
                let (extrapolation, interpolation) = (1.0 / pos_freq, 1.0 / (factor * pos_freq));
                let kept = 1.0 - ramp(i);
                interpolation * (1.0 - kept) + extrapolation * kept
            })
            .collect()
    }
}

/// Rotary position embedding: the frequencies q and k are rotated by.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base of the frequencies (`rope_theta`; 10000 where absent).
    pub theta: f64,
    /// Leading dims of each head that rotate; the rest pass through.
    pub rotary_dim: usize,
    /// How the frequencies are rescaled for long contexts.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// `inv_freq[i]` for `i < rotary_dim / 2`, computed in f32 the way
    /// transformers does, so angles agree to the last bit where they can.
    pub fn inv_freq(&self) -> Vec<f32> {
        let (dim, base) = (self.rotary_dim, self.theta as f32);
        let pos_freqs: Vec<f32> = (0..dim / 2).map(|i| base.powf((2 * i) as f32 / dim as f32)).collect();
        let plain = pos_freqs.iter().map(|p| 1.0 / p);
        match &self.scaling {
            RopeScaling::None => plain.collect(),
            RopeScaling::Divisors(divisors) => plain.zip(divisors).map(|(f, d)| f / d).collect(),
            RopeScaling::Linear { factor } => plain.map(|f| f / *factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let bands = Llama3Bands {
                    factor: *factor as f32,
                    low: *low_freq_factor as f32,
                    high: *high_freq_factor as f32,
                    old_len: *original_max_position_embeddings as f32,
                };
                plain.map(|f| bands.scale(f)).collect()
            }
            RopeScaling::Yarn(yarn) => yarn.inv_freq(&pos_freqs, self.theta),
        }
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; 1
    /// otherwise).
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn(Yarn { attention_factor, .. }) => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// cos and sin of `pos * inv_freq` for positions `0..positions`, laid
    /// out `[pos][cos(half) | sin(half)]` as `wgsl/attention.wgsl` reads
    /// them (it rotates q and k before their use).
    pub fn cos_sin_table(&self, positions: usize) -> Vec<f32> {
        let (inv_freq, scale) = (self.inv_freq(), self.attention_factor());
        (0..positions as u32).flat_map(|pos| rotary_row(&inv_freq, scale, |_| pos)).collect()
    }
}

/// A mixture-of-experts model's routing: how many experts, how many each
/// token runs, and which layers route.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer (`num_local_experts` or `num_experts`).
    pub experts: usize,
    /// Experts each token runs per MoE layer (`num_experts_per_tok`).
    pub top_k: usize,
    /// Width of one expert's gate/up projection.
    pub intermediate: usize,
    /// How router logits become the chosen experts and their weights.
    pub selection: ExpertSelection,
    /// `sparse_layers[i]`: layer `i` routes to experts (else dense FFN).
    pub sparse_layers: Vec<bool>,
}

/// How a checkpoint's weights are quantized (`quantization_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// Block FP8: projections stored as float8_e4m3fn, each with a
    /// `weight_scale_inv` holding one scale per block of `block_rows` rows
    /// x 128 columns; the modules the release leaves unconverted keep
    /// their own dtype.
    Fp8 {
        /// Rows per scale block (`weight_block_size[0]`).
        block_rows: usize,
    },
}

/// A validated model configuration: everything the layer flow needs.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The architecture family `model_type` names: its tensor names, q/k
    /// norm, expert layout and vision tower.
    pub family: &'static Family,
    /// config.json's `model_type`, else its first `architectures` class
    /// (for a GGUF file: the type its `general.architecture` maps to).
    pub model_type: String,
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    /// Width of a dense FFN's gate and up projections (`intermediate_size`).
    pub intermediate: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads, key/value heads and head width.
    pub heads: Heads,
    /// RMSNorm's epsilon (`rms_norm_eps`; 1e-6 where absent).
    pub rms_eps: f32,
    /// Rotary embedding: base, rotary width and long-context scaling.
    pub rope: RopeConfig,
    /// Token ids: rows of the embedding and of the LM head (`vocab_size`).
    pub vocab: usize,
    /// The context the model was made for (`max_position_embeddings`; 2048
    /// where absent). A session's default context is this, at most
    /// 8192 positions (`SessionOptions::context_len`).
    pub max_positions: usize,
    /// The LM head is the embedding matrix (`tie_word_embeddings`; false
    /// where absent).
    pub tie_embeddings: bool,
    /// Keys older than this many positions are not attended (Mistral).
    pub sliding_window: Option<usize>,
    /// The checkpoint's declared dtype, for information.
    pub dtype: Option<String>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Placeholders of images and videos (Qwen3-VL's `image_token_id` and
    /// `video_token_id`): a prompt holding one needs the vision tower's
    /// rows in its place, which a prompt of ids does not carry.
    pub media_token_ids: Vec<u32>,
    /// `None` for dense models.
    pub moe: Option<MoeConfig>,
    /// `None`: weights in bf16, f16 or f32.
    pub quantization: Option<Quantization>,
    /// The vision tower, for the families that have one and whose config
    /// describes it.
    pub vision: Option<VisionConfig>,
    /// M-RoPE (Qwen3-VL): how many of the rotary frequencies follow the
    /// (t, h, w) position axes, interleaved t, h, w, t, h, w, ... as
    /// transformers' Qwen3-VL does it (the rest follow t).
    pub mrope_section: Option<[usize; 3]>,
}

impl ModelConfig {
    /// One position's row of the rotary table the attention reads (cosines
    /// then sines of `rotary_dim / 2` angles), for the position triple
    /// `(t, h, w)`: RoPE's row of `t` when the three are equal or the model
    /// has no M-RoPE.
    pub fn rotary_row(&self, position: [u32; 3]) -> Vec<f32> {
        let axis = |f: usize| match self.mrope_section {
            Some([_, h, _]) if f % 3 == 1 && f < 3 * h => 1,
            Some([_, _, w]) if f % 3 == 2 && f < 3 * w => 2,
            _ => 0,
        };
        rotary_row(&self.rope.inv_freq(), self.rope.attention_factor(), |f| position[axis(f)])
    }
}

/// A row of a rotary table as the attention kernels read it: the cosines,
/// then the sines, of `inv_freq[f] * position(f)` for each frequency `f`
/// (the angle rounded to f32 first, as transformers computes it), times
/// `scale` (YaRN's attention factor).
pub fn rotary_row(inv_freq: &[f32], scale: f32, position: impl Fn(usize) -> u32) -> Vec<f32> {
    let angles: Vec<f64> =
        inv_freq.iter().enumerate().map(|(f, &freq)| (freq * position(f) as f32) as f64).collect();
    let (cos, sin) = (angles.iter().map(|a| a.cos() as f32), angles.iter().map(|a| a.sin() as f32));
    cos.chain(sin).map(|v| v * scale).collect()
}

impl ModelConfig {
    /// Bytes the weights take on the GPU (bf16, projections in FP8 where
    /// the config says so), known before loading.
    pub fn weight_bytes(&self) -> u64 {
        let (h, i, heads) = (self.hidden, self.intermediate, self.heads);
        let attn = h * heads.qkv_width() + heads.q * heads.dim * h;
        let qk_norm = match self.family.qk_norm {
            super::QkNorm::None => 0,
            super::QkNorm::PerHead => 2 * heads.dim,
            super::QkNorm::WholeProjection => (heads.q + heads.kv) * heads.dim,
        };
        // Projection values, and the values kept in bf16 (norms, routers).
        let (projections, others) = (0..self.layers).fold((0, 0), |(p, o), l| match &self.moe {
            Some(m) if m.sparse_layers[l] => {
                (p + attn + m.experts * 3 * h * m.intermediate, o + m.experts * h)
            }
            _ => (p + attn + 3 * h * i, o),
        });
        let others = others + self.layers * (qk_norm + 2 * h);
        let heads_and_embed = if self.tie_embeddings { 1 } else { 2 } * self.vocab * h;
        let projection_bytes = match self.quantization {
            // A byte per value and a 4-byte scale per 128 of a row.
            Some(Quantization::Fp8 { .. }) => {
                projections as u64 * (FP8_BLOCK_ELEMS as u64 + 4) / FP8_BLOCK_ELEMS as u64
            }
            None => 2 * projections as u64,
        };
        let vision = self.vision.as_ref().map_or(0, VisionConfig::weight_bytes);
        projection_bytes + 2 * (others + heads_and_embed + h) as u64 + vision
    }

    /// Reads and validates `dir/config.json`, with the end-of-sequence ids
    /// of `dir/generation_config.json` where there is one (transformers
    /// stops generation at those: Llama 3 Instruct's config.json names
    /// `<|end_of_text|>` alone, its generation config `<|eot_id|>` too).
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::error::read_text(&path, crate::error::MAX_JSON_BYTES)?;
        let mut config = Self::parse(&text, &path)?;
        let generation = dir.join("generation_config.json");
        if generation.exists() {
            let value: serde_json::Value = crate::error::read_json(&generation)?;
            let ids = eos_token_ids(value.get("eos_token_id"))
                .map_err(|message| Error::InvalidConfig { path: generation.clone(), message })?;
            for id in ids {
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    /// Parses and validates the text of a config.json (`path` names it in
    /// errors), without generation_config.json's end-of-sequence ids (see
    /// [`Self::load`]). A multimodal config's `text_config` is read as the
    /// language model's.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        // Syntax errors are malformed JSON; a well-formed file with a missing
        // or mistyped field is an invalid config, named by its path.
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Json { path: path.to_path_buf(), message: e.to_string() })?;
        let vision_config = value.get("vision_config").cloned();
        let raw: RawConfig = serde_path_to_error::deserialize(text_model(value)).map_err(|e| {
            Error::InvalidConfig { path: path.to_path_buf(), message: format!("{}: {}", e.path(), e.inner()) }
        })?;
        let invalid = |message: String| Error::InvalidConfig { path: path.to_path_buf(), message };

        let model_type = raw
            .model_type
            .clone()
            .or_else(|| raw.architectures.first().cloned())
            .ok_or_else(|| invalid("neither model_type nor architectures is given".into()))?;
        let family = family::for_model_type(&model_type)?;
        check_mlp(&raw)?;
        let heads = parse_heads(&raw, path)?;
        let intermediate =
            raw.intermediate_size.ok_or_else(|| invalid("missing field `intermediate_size`".into()))?;
        check_sizes(&raw, intermediate).map_err(invalid)?;

        let rope = parse_rope(&raw, heads.dim).map_err(invalid)?;
        let mrope_section = raw
            .rope_parameters
            .as_ref()
            .or(raw.rope_scaling.as_ref())
            .and_then(|p| p.mrope_section.as_ref())
            .map(|s| [s[0], s[1], s[2]]);
        let quantization =
            raw.quantization_config.as_ref().map(|q| parse_quantization(q, path)).transpose()?;
        let moe = parse_moe(&raw, family, intermediate, &invalid)?;
        let sliding_window = sliding_window(&raw)?;
        let rms_eps = raw.rms_norm_eps.unwrap_or(1e-6) as f32;
        if !(rms_eps > 0.0 && rms_eps.is_finite()) {
            let stated = raw.rms_norm_eps.unwrap_or(1e-6);
            return Err(invalid(format!("rms_norm_eps {stated} must be a positive finite f32")));
        }
        let vision = match (&vision_config, family.vision_tower) {
            (Some(v), true) => {
                let tokens = ImageTokens {
                    image: raw.image_token_id,
                    start: raw.vision_start_token_id,
                    end: raw.vision_end_token_id,
                };
                Some(VisionConfig::parse(v, path, raw.hidden_size, tokens)?)
            }
            _ => None,
        };
        Ok(ModelConfig {
            vision,
            mrope_section,
            family,
            model_type,
            hidden: raw.hidden_size,
            intermediate,
            layers: raw.num_hidden_layers,
            heads,
            rms_eps,
            rope,
            vocab: raw.vocab_size,
            max_positions: raw.max_position_embeddings.unwrap_or(2048),
            tie_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            sliding_window,
            dtype: raw.dtype.or(raw.torch_dtype),
            eos_token_ids: eos_token_ids(raw.eos_token_id.as_ref()).map_err(invalid)?,
            media_token_ids: raw.image_token_id.into_iter().chain(raw.video_token_id).collect(),
            moe,
            quantization,
        })
    }
}

/// Keys of a multimodal config that describe the whole checkpoint, not its
/// language model: where both levels state one, the top level's holds (as
/// transformers reads them: the top-level class, its lm_head tying, its
/// quantization).
const CHECKPOINT_KEYS: &[&str] =
    &["model_type", "architectures", "tie_word_embeddings", "quantization_config", "torch_dtype", "dtype"];

/// The language model's config: a multimodal config (Qwen3-VL) nests it as
/// `text_config`, whose keys it takes, with the top level's
/// [`CHECKPOINT_KEYS`] and any key the text config lacks.
fn text_model(value: serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(mut top) = value else { return value };
    let Some(serde_json::Value::Object(mut text)) = top.remove("text_config") else {
        return serde_json::Value::Object(top);
    };
    for (key, v) in top {
        if CHECKPOINT_KEYS.contains(&key.as_str()) || !text.contains_key(&key) {
            text.insert(key, v);
        }
    }
    serde_json::Value::Object(text)
}

/// The one method this engine reads: block FP8 (e4m3) with blocks 128
/// columns wide, the layout of the hub's FP8 releases.
fn parse_quantization(q: &RawQuantization, path: &Path) -> Result<Quantization> {
    let unsupported =
        |value: String| Error::Unsupported { what: "quantization_config in config.json", value };
    if q.quant_method != "fp8" {
        return Err(unsupported(format!(
            "quant_method {:?} (this engine reads \"fp8\" safetensors and GGUF files)",
            q.quant_method
        )));
    }
    if let Some(fmt) = q.fmt.as_deref().filter(|f| !matches!(*f, "e4m3" | "float8_e4m3fn")) {
        return Err(unsupported(format!("fp8 fmt {fmt:?} (e4m3 is supported)")));
    }
    match q.weight_block_size.as_deref() {
        Some(&[rows, FP8_BLOCK_ELEMS]) if (1..=1 << 20).contains(&rows) => {
            Ok(Quantization::Fp8 { block_rows: rows })
        }
        Some(&[rows, cols]) if rows > 0 && cols > 0 => Err(unsupported(format!(
            "fp8 weight_block_size [{rows}, {cols}] (blocks {FP8_BLOCK_ELEMS} columns wide are supported)"
        ))),
        Some(other) => Err(Error::InvalidConfig {
            path: path.to_path_buf(),
            message: format!("quantization_config.weight_block_size {other:?} is not two positive sizes"),
        }),
        None => Err(unsupported("fp8 without weight_block_size (per-tensor scales)".to_string())),
    }
}

fn parse_moe(
    raw: &RawConfig,
    family: &Family,
    dense_intermediate: usize,
    invalid: &dyn Fn(String) -> Error,
) -> Result<Option<MoeConfig>> {
    let Some(moe) = family.moe else {
        return Ok(None);
    };
    let experts = raw
        .num_local_experts
        .or(raw.num_experts)
        .ok_or_else(|| invalid("missing field `num_local_experts` (or `num_experts`)".into()))?;
    let top_k =
        raw.num_experts_per_tok.ok_or_else(|| invalid("missing field `num_experts_per_tok`".into()))?;
    if experts == 0 || top_k == 0 || top_k > experts {
        return Err(invalid(format!(
            "num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({experts})"
        )));
    }
    if top_k > crate::kernels::router::MAX_TOP_K || experts > crate::kernels::router::MAX_EXPERTS {
        return Err(Error::Unsupported {
            what: "expert count",
            value: format!(
                "{experts} experts, top {top_k} (at most {} experts and top {})",
                crate::kernels::router::MAX_EXPERTS,
                crate::kernels::router::MAX_TOP_K
            ),
        });
    }
    if let Some(func) = &raw.scoring_func {
        if !moe.scoring_funcs.contains(&func.as_str()) {
            return Err(Error::Unsupported {
                what: "router scoring_func",
                value: format!("{func:?} for {} (supported: {})", family.name, moe.scoring_funcs.join(", ")),
            });
        }
    }
    let routing = match moe.scoring {
        ScoringRule::Softmax { renormalize } => ExpertSelection::Softmax {
            renormalize: match renormalize {
                Renormalize::Always => true,
                Renormalize::IfNormTopkProb => raw.norm_topk_prob.unwrap_or(false),
            },
        },
        ScoringRule::SigmoidWithBias => ExpertSelection::SigmoidWithBias,
    };
    let intermediate = raw.moe_intermediate_size.unwrap_or(dense_intermediate);
    if intermediate == 0 || !intermediate.is_multiple_of(2) {
        return Err(invalid(format!("expert intermediate size {intermediate} must be even and positive")));
    }
    let step = raw.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        return Err(invalid("decoder_sparse_step must be positive".into()));
    }
    let dense_only: std::collections::HashSet<usize> =
        raw.mlp_only_layers.iter().flatten().copied().collect();
    let sparse_layers =
        (0..raw.num_hidden_layers).map(|i| !dense_only.contains(&i) && (i + 1) % step == 0).collect();
    Ok(Some(MoeConfig { experts, top_k, intermediate, selection: routing, sparse_layers }))
}

/// config.json's `eos_token_id`: an id, a list of ids, or none (null or
/// absent); anything else (a string, a float, a negative or oversized id)
/// is refused rather than dropped, which would let generation run past the
/// end of a reply.
fn eos_token_ids(value: Option<&serde_json::Value>) -> std::result::Result<Vec<u32>, String> {
    let id = |v: &serde_json::Value| {
        v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
            format!("eos_token_id holds {v}, expected token ids (non-negative integers below 2^32)")
        })
    };
    match value {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(ids)) => ids.iter().map(id).collect(),
        Some(v) => id(v).map(|id| vec![id]),
    }
}

/// Every family's MLP is SwiGLU, its projections without biases: a config
/// saying otherwise describes a model the flow would compute wrongly.
fn check_mlp(raw: &RawConfig) -> Result<()> {
    if let Some(act) = raw.hidden_act.as_deref().filter(|a| !matches!(*a, "silu" | "swish")) {
        return Err(Error::Unsupported {
            what: "hidden_act",
            value: format!("{act} (the MLP is SwiGLU: silu)"),
        });
    }
    for (name, set) in [("attention_bias", raw.attention_bias), ("mlp_bias", raw.mlp_bias)] {
        if set == Some(true) {
            return Err(Error::Unsupported { what: "projection biases", value: format!("{name} = true") });
        }
    }
    Ok(())
}

/// The attention heads, checked against what the attention kernels hold.
fn parse_heads(raw: &RawConfig, path: &Path) -> Result<Heads> {
    let invalid = |message: String| Error::InvalidConfig { path: path.to_path_buf(), message };
    let heads_q = raw.num_attention_heads;
    let heads_kv = raw.num_key_value_heads.unwrap_or(heads_q);
    // Checked before any width is a product of it.
    if heads_q > MAX_HEADS {
        return Err(invalid(format!(
            "num_attention_heads {heads_q} is more than any model has (at most {MAX_HEADS})"
        )));
    }
    if heads_q == 0 || heads_kv == 0 || !heads_q.is_multiple_of(heads_kv) {
        return Err(invalid(format!(
            "num_attention_heads ({heads_q}) must be a positive multiple of num_key_value_heads ({heads_kv})"
        )));
    }
    let head_dim = match raw.head_dim {
        Some(d) => d,
        None if raw.hidden_size.is_multiple_of(heads_q) => raw.hidden_size / heads_q,
        None => {
            return Err(invalid(format!(
                "hidden_size {} is not divisible by num_attention_heads {heads_q} and no head_dim is given",
                raw.hidden_size
            )));
        }
    };
    if head_dim == 0 || head_dim % 2 != 0 || head_dim > crate::kernels::attention::MAX_HEAD_DIM {
        return Err(invalid(format!(
            "head_dim {head_dim} must be even and at most {}",
            crate::kernels::attention::MAX_HEAD_DIM
        )));
    }
    let group = heads_q / heads_kv;
    if group > crate::kernels::attention::MAX_GROUP
        || group * head_dim > crate::kernels::attention::MAX_GROUP_WIDTH
    {
        return Err(Error::Unsupported {
            what: "attention geometry",
            value: format!(
                "{group} query heads per KV head of width {head_dim} (at most {} heads and {} values per group)",
                crate::kernels::attention::MAX_GROUP,
                crate::kernels::attention::MAX_GROUP_WIDTH
            ),
        });
    }
    Ok(Heads { q: heads_q, kv: heads_kv, dim: head_dim })
}

/// The widths are even and positive, the depth and vocabulary positive
/// and the depth bounded (checked before anything is sized by it).
fn check_sizes(raw: &RawConfig, intermediate: usize) -> std::result::Result<(), String> {
    for (name, v) in [("hidden_size", raw.hidden_size), ("intermediate_size", intermediate)] {
        if v == 0 || v % 2 != 0 {
            return Err(format!("{name} {v} must be even and positive"));
        }
    }
    if raw.num_hidden_layers == 0 || raw.vocab_size == 0 {
        return Err("num_hidden_layers and vocab_size must be positive".into());
    }
    if raw.num_hidden_layers > MAX_LAYERS {
        return Err(format!(
            "num_hidden_layers {} is more than any model has (at most {MAX_LAYERS})",
            raw.num_hidden_layers
        ));
    }
    Ok(())
}

/// Qwen's `use_sliding_window` switches windows on for some layers
/// (`max_window_layers`); off, its `sliding_window` value is unused.
fn sliding_window(raw: &RawConfig) -> Result<Option<usize>> {
    match raw.use_sliding_window {
        Some(true) => Err(Error::Unsupported {
            what: "use_sliding_window",
            value: "per-layer sliding windows (use_sliding_window = true)".into(),
        }),
        Some(false) => Ok(None),
        None => Ok(raw.sliding_window.filter(|&w| w > 0)),
    }
}

fn parse_rope(raw: &RawConfig, head_dim: usize) -> std::result::Result<RopeConfig, String> {
    // transformers 5 folds everything into rope_parameters; the hub layout
    // keeps theta at the top level and scaling (if any) in rope_scaling.
    let params = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref());
    let theta = params.and_then(|p| p.rope_theta).or(raw.rope_theta).unwrap_or(10_000.0);
    // The rotation tables are computed in f32: a theta that is positive
    // only as an f64 (1e-50) is 0 there.
    if !(theta as f32 > 0.0 && (theta as f32).is_finite()) {
        return Err(format!("rope_theta {theta} must be a positive finite f32"));
    }
    let partial = params.and_then(|p| p.partial_rotary_factor).or(raw.partial_rotary_factor);
    let rotary_dim = match (raw.rotary_dim, partial) {
        (Some(d), _) => d,
        (None, Some(f)) => (head_dim as f64 * f) as usize,
        (None, None) => head_dim,
    };
    if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
        return Err(format!("rotary width {rotary_dim} must be even and at most head_dim {head_dim}"));
    }
    // M-RoPE splits the frequencies among the (t, h, w) position axes. Text
    // positions are (p, p, p), whose rotation is plain RoPE's, so only the
    // split's total matters here.
    if let Some(section) = params.and_then(|p| p.mrope_section.as_ref()) {
        let total = section.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
        if section.len() != 3 || total != Some(rotary_dim / 2) {
            return Err(format!(
                "mrope_section {section:?} must be three sizes summing to the rotary width / 2 ({})",
                rotary_dim / 2
            ));
        }
    }

    let kind = params
        .and_then(|p| p.rope_type.clone().or(p.legacy_type.clone()))
        .unwrap_or_else(|| "default".to_string());
    // A scaling factor without its type (transformers refuses it too)
    // would otherwise be dropped.
    if kind == "default" && params.is_some_and(|p| p.factor.is_some_and(|f| f != 1.0)) {
        return Err("rope scaling gives a factor but no rope_type (linear, llama3, ...)".to_string());
    }
    let factor = || params.and_then(|p| p.factor).ok_or_else(|| format!("rope type {kind:?} needs `factor`"));
    // The pretraining context: the config's own key first, as transformers
    // reads it, else the rope parameters', else max_position_embeddings.
    let original_len = || {
        raw.original_max_position_embeddings
            .or(params.and_then(|p| p.original_max_position_embeddings))
            .or(raw.max_position_embeddings)
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("rope type {kind:?} needs `original_max_position_embeddings`"))
    };
    let scaling = match kind.as_str() {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => {
            let p = params.expect("a rope type implies rope parameters");
            let field =
                |v: Option<f64>, name: &str| v.ok_or_else(|| format!("llama3 rope scaling needs `{name}`"));
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: field(p.low_freq_factor, "low_freq_factor")?,
                high_freq_factor: field(p.high_freq_factor, "high_freq_factor")?,
                original_max_position_embeddings: original_len()?,
            }
        }
        "yarn" => parse_yarn(params.expect("a rope type implies rope parameters"), original_len()?, raw)?,
        other => {
            return Err(format!(
                "unsupported rope type {other:?} (supported: default, linear, llama3, yarn)"
            ));
        }
    };
    let factors: &[(f64, &str)] = match &scaling {
        RopeScaling::None | RopeScaling::Divisors(_) => &[],
        RopeScaling::Linear { factor } => &[(*factor, "factor")],
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, .. } => &[
            (*factor, "factor"),
            (*low_freq_factor, "low_freq_factor"),
            (*high_freq_factor, "high_freq_factor"),
        ],
        RopeScaling::Yarn(Yarn { factor, beta_fast, beta_slow, attention_factor, .. }) => &[
            (*factor, "factor"),
            (*beta_fast, "beta_fast"),
            (*beta_slow, "beta_slow"),
            (*attention_factor, "attention_factor"),
        ],
    };
    for (value, name) in factors {
        if !(*value as f32 > 0.0 && (*value as f32).is_finite()) {
            return Err(format!("rope scaling {name} {value} must be a positive finite f32"));
        }
    }
    Ok(RopeConfig { theta, rotary_dim, scaling })
}

/// YaRN's parameters as transformers completes them: the factor from the
/// context lengths where it is missing, beta_fast 32 and beta_slow 1 where
/// missing or 0, the attention factor from `mscale` / `mscale_all_dim` or
/// else the factor alone.
fn parse_yarn(p: &RawRope, original_len: usize, raw: &RawConfig) -> std::result::Result<RopeScaling, String> {
    let factor = match (p.factor, raw.max_position_embeddings) {
        (Some(factor), _) => factor,
        (None, Some(max)) => max as f64 / original_len as f64,
        (None, None) => return Err("yarn rope scaling needs `factor`".into()),
    };
    // 0.1 * mscale * ln(factor) + 1, the paper's magnitude correction.
    let mscale = |m: f64| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
    let attention_factor = match (p.attention_factor, p.mscale, p.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
        _ => mscale(1.0),
    };
    let nonzero = |v: Option<f64>, default: f64| v.filter(|v| *v != 0.0).unwrap_or(default);
    Ok(RopeScaling::Yarn(Yarn {
        factor,
        original_max_position_embeddings: original_len,
        beta_fast: nonzero(p.beta_fast, 32.0),
        beta_slow: nonzero(p.beta_slow, 1.0),
        truncate: p.truncate.unwrap_or(true),
        attention_factor,
    }))
}
