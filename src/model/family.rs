//! The family table: what the model families differ in, held as data. The
//! layer flow reads a row; adding a family means adding a row.

use crate::error::{Error, Result};
use crate::kernels::attention::QkNorm;

/// How router logits become the k experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoringRule {
    /// `p = softmax(logits)`; the k largest `p`, renormalised to sum 1
    /// always, or only when the config's `norm_topk_prob` says so.
    Softmax {
        /// Whether the k weights are renormalised.
        renormalize: Renormalize,
    },
    /// `s = sigmoid(logits)`; select the k largest `s + e_score_correction_bias`,
    /// weight them by the unbiased `s`, renormalised.
    SigmoidWithBias,
}

/// When the selected experts' softmax weights are renormalised to sum 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renormalize {
    /// Always (Mixtral).
    Always,
    /// As `norm_topk_prob` (default false).
    IfNormTopkProb,
}

/// Per-expert tensor names of hub checkpoints:
/// `model.layers.{i}.{block}.experts.{e}.{gate|up|down}.weight`, the router
/// at `{block}.{router}.weight`, the bias at `{block}.e_score_correction_bias`.
/// (The fused layout transformers 5 writes always uses `mlp`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The MoE block's name in a layer (`mlp`, `block_sparse_moe`).
    pub block: &'static str,
    /// An expert's gate, up and down projections.
    pub gate: &'static str,
    /// See `gate`.
    pub up: &'static str,
    /// See `gate`.
    pub down: &'static str,
    /// The router's name in the block.
    pub router: &'static str,
}

const MIXTRAL_NAMES: ExpertNames =
    ExpertNames { block: "block_sparse_moe", gate: "w1", up: "w3", down: "w2", router: "gate" };

const QWEN3_MOE_NAMES: ExpertNames =
    ExpertNames { block: "mlp", gate: "gate_proj", up: "up_proj", down: "down_proj", router: "gate" };

/// The mixture-of-experts half of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeFamily {
    /// How the router's logits become experts and weights.
    pub scoring: ScoringRule,
    /// Where the experts' tensors are.
    pub names: ExpertNames,
    /// `scoring_func` values a config may state for this family.
    pub scoring_funcs: &'static [&'static str],
}

/// A row of the family table: what one model family's layers differ in.
#[derive(Debug, PartialEq, Eq)]
pub struct Family {
    /// The family's name.
    pub name: &'static str,
    /// `model_type` values of config.json that name it.
    pub model_types: &'static [&'static str],
    /// `architectures` class names that name it.
    pub architectures: &'static [&'static str],
    /// The q/k norm before RoPE.
    pub qk_norm: QkNorm,
    /// `None`: every layer has a dense SwiGLU FFN. `Some`: layers are MoE
    /// as the config's `mlp_only_layers` / `decoder_sparse_step` say.
    pub moe: Option<MoeFamily>,
    /// The hub ships the fused expert tensors as `[E, in, out]`, which
    /// are read transposed (Qwen3-VL-MoE).
    pub transposed_experts: bool,
    /// config.json's `vision_config` describes a vision tower (Qwen3-VL).
    pub vision_tower: bool,
}

pub static FAMILIES: &[Family] = &[
    Family {
        name: "llama",
        model_types: &["llama"],
        architectures: &["LlamaForCausalLM"],
        qk_norm: QkNorm::None,
        moe: None,
        transposed_experts: false,
        vision_tower: false,
    },
    Family {
        name: "mistral",
        model_types: &["mistral"],
        architectures: &["MistralForCausalLM"],
        qk_norm: QkNorm::None,
        moe: None,
        transposed_experts: false,
        vision_tower: false,
    },
    Family {
        name: "mixtral",
        model_types: &["mixtral"],
        architectures: &["MixtralForCausalLM"],
        qk_norm: QkNorm::None,
        moe: Some(MoeFamily {
            scoring: ScoringRule::Softmax { renormalize: Renormalize::Always },
            names: MIXTRAL_NAMES,
            scoring_funcs: &["softmax"],
        }),
        transposed_experts: false,
        vision_tower: false,
    },
    Family {
        name: "qwen3",
        model_types: &["qwen3"],
        architectures: &["Qwen3ForCausalLM"],
        qk_norm: QkNorm::PerHead,
        moe: None,
        transposed_experts: false,
        vision_tower: false,
    },
    Family {
        name: "qwen3_moe",
        model_types: &["qwen3_moe"],
        architectures: &["Qwen3MoeForCausalLM"],
        qk_norm: QkNorm::PerHead,
        moe: Some(MoeFamily {
            scoring: ScoringRule::Softmax { renormalize: Renormalize::IfNormTopkProb },
            names: QWEN3_MOE_NAMES,
            scoring_funcs: &["softmax"],
        }),
        transposed_experts: false,
        vision_tower: false,
    },
    Family {
        name: "minimax_m2",
        model_types: &["minimax_m2"],
        architectures: &["MiniMaxM2ForCausalLM"],
        qk_norm: QkNorm::WholeProjection,
        moe: Some(MoeFamily {
            scoring: ScoringRule::SigmoidWithBias,
            names: MIXTRAL_NAMES,
            scoring_funcs: &["sigmoid"],
        }),
        transposed_experts: false,
        vision_tower: false,
    },
    // Mistral Small 3.1 and later (Mistral3ForConditionalGeneration): a
    // Mistral language model nested in `text_config` and under
    // `model.language_model.` / `language_model.model.`, read for text (its
    // Pixtral tower is not built: a prompt with images is refused).
    Family {
        name: "mistral3",
        model_types: &["mistral3"],
        architectures: &["Mistral3ForConditionalGeneration"],
        qk_norm: QkNorm::None,
        moe: None,
        transposed_experts: false,
        vision_tower: false,
    },
    // Qwen3-VL's language models: config.json nests them in `text_config`
    // and the checkpoint under `model.language_model.`; a text prompt
    // rotates by positions (p, p, p), for which their M-RoPE is RoPE.
    Family {
        name: "qwen3_vl",
        model_types: &["qwen3_vl"],
        architectures: &["Qwen3VLForConditionalGeneration"],
        qk_norm: QkNorm::PerHead,
        moe: None,
        transposed_experts: false,
        vision_tower: true,
    },
    Family {
        name: "qwen3_vl_moe",
        model_types: &["qwen3_vl_moe"],
        architectures: &["Qwen3VLMoeForConditionalGeneration"],
        qk_norm: QkNorm::PerHead,
        moe: Some(MoeFamily {
            scoring: ScoringRule::Softmax { renormalize: Renormalize::Always },
            names: QWEN3_MOE_NAMES,
            scoring_funcs: &["softmax"],
        }),
        transposed_experts: true,
        vision_tower: true,
    },
];

/// The row for a config's `model_type` (or architecture class name).
pub fn for_model_type(model_type: &str) -> Result<&'static Family> {
    FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&model_type) || f.architectures.contains(&model_type))
        .ok_or_else(|| Error::UnsupportedArchitecture {
            model_type: model_type.to_string(),
            supported: FAMILIES
                .iter()
                .flat_map(|f| f.model_types.iter().copied())
                .collect::<Vec<_>>()
                .join(", "),
        })
}
