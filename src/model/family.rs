//! The family table: what the model families differ in, held as data. The
//! layer flow reads a row; adding a family means adding a row.

use crate::error::{Error, Result};

/// Normalisation of q and k before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm of each head with one `[head_dim]` weight shared by heads.
    PerHead,
    /// RMSNorm over the whole q (`[nh * hd]`) and k (`[nkv * hd]`) projections.
    WholeProjection,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Family {
    pub name: &'static str,
    /// `model_type` values of config.json, and `architectures` class names.
    pub model_types: &'static [&'static str],
    pub architectures: &'static [&'static str],
    pub qk_norm: QkNorm,
}

pub static FAMILIES: &[Family] = &[
    Family {
        name: "llama",
        model_types: &["llama"],
        architectures: &["LlamaForCausalLM"],
        qk_norm: QkNorm::None,
    },
    Family {
        name: "mistral",
        model_types: &["mistral"],
        architectures: &["MistralForCausalLM"],
        qk_norm: QkNorm::None,
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
