//! `wgsl/bias_act.wgsl`: a linear layer's bias and activation, in place
//! (the vision tower's layers carry biases; the language model's do not).

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

crate::wgsl_struct! {
    pub struct BiasActParams {
        n: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![BiasActParams::WGSL]
}

/// The activation after the bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    None,
    /// torch's `gelu(approximate="tanh")` (`gelu_pytorch_tanh`).
    GeluTanh,
    /// The exact GELU, `0.5 v (1 + erf(v / sqrt 2))` (`nn.GELU()`).
    GeluErf,
}

impl Activation {
    /// transformers' `hidden_act` names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Activation::GeluTanh),
            "gelu" => Some(Activation::GeluErf),
            _ => None,
        }
    }

    pub(crate) fn flags(self) -> &'static [&'static str] {
        match self {
            Activation::None => &[],
            Activation::GeluTanh => &["GELU_TANH"],
            Activation::GeluErf => &["GELU_ERF"],
        }
    }
}

#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    [Activation::None, Activation::GeluTanh, Activation::GeluErf].iter().map(|a| a.flags().to_vec()).collect()
}

#[derive(Debug, Default)]
pub struct BiasAct;

impl BiasAct {
    /// `y[t, i] = act(y[t, i] + bias[i])` for `i < n` and `tokens` rows.
    pub fn plan(
        &self,
        gpu: &Gpu,
        activation: Activation,
        n: usize,
        tokens: usize,
        bias: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<Dispatch> {
        let pipeline = super::pipeline(gpu, "bias_act", "main", activation.flags(), &[])?;
        let params = ParamsBuffer::new(gpu, "bias_act.params", &BiasActParams { n: n as u32 });
        Ok(Dispatch {
            label: "bias_act",
            bind_group: gpu.bind("bias_act", &pipeline, &[&params.0, bias, y]),
            pipeline,
            workgroups: [(n as u32).div_ceil(64), tokens as u32, 1],
            tokens_per_workgroup: 0,
        })
    }
}
