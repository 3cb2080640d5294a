//! `wgsl/router.wgsl`: router scoring and top-k selection on the GPU.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

/// Invocations per token without subgroups (a power of two).
const WORKGROUP: u32 = 64;

/// Limits of the kernel's workgroup arrays.
pub const MAX_EXPERTS: usize = 512;
pub const MAX_TOP_K: usize = 16;

/// How a MoE layer turns router logits into experts and weights, resolved
/// from the family row and the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertSelection {
    /// softmax, top-k of the probabilities, renormalised when `renormalize`.
    Softmax {
        /// Whether the top-k probabilities are divided by their sum.
        renormalize: bool,
    },
    /// sigmoid, top-k of `s + e_score_correction_bias`, unbiased `s`
    /// renormalised as weights.
    SigmoidWithBias,
}

crate::wgsl_struct! {
    pub struct RouterParams {
        n_experts: u32,
        top_k: u32,
        /// 0: softmax; 1: sigmoid with bias.
        scoring: u32,
        renormalize: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![RouterParams::WGSL]
}

pub struct RouterBindings<'a> {
    /// Router logits `[tokens, n_experts]`.
    pub logits: &'a wgpu::Buffer,
    /// `e_score_correction_bias` (f32 `[n_experts]`) for sigmoid scoring.
    pub bias: Option<&'a wgpu::Buffer>,
    pub ids: &'a wgpu::Buffer,
    pub weights: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct Router {
    pipeline: wgpu::ComputePipeline,
    no_bias: wgpu::Buffer,
}

impl Router {
    /// One subgroup per token where the adapter's subgroups have one size,
    /// else a workgroup of `WORKGROUP` with barriered reductions.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let pipeline = match super::subgroup_width(gpu) {
            Some(width) => {
                super::pipeline(gpu, "router", "main", &[super::SUBGROUPS], &[("WG", width as f64)])?
            }
            None => super::pipeline(gpu, "router", "main", &[], &[("WG", WORKGROUP as f64)])?,
        };
        Ok(Router { pipeline, no_bias: gpu.storage_buffer("router.no_bias", 1)? })
    }

    /// Selects `top_k` of `n_experts` for every token in flight.
    pub fn plan(
        &self,
        gpu: &Gpu,
        routing: ExpertSelection,
        n_experts: usize,
        top_k: usize,
        b: RouterBindings<'_>,
    ) -> Dispatch {
        debug_assert!(n_experts <= MAX_EXPERTS && top_k <= MAX_TOP_K);
        let (scoring, renormalize) = match routing {
            ExpertSelection::Softmax { renormalize } => (0, renormalize as u32),
            ExpertSelection::SigmoidWithBias => (1, 1),
        };
        let params = ParamsBuffer::new(
            gpu,
            "router.params",
            &RouterParams { n_experts: n_experts as u32, top_k: top_k as u32, scoring, renormalize },
        );
        let bias = b.bias.unwrap_or(&self.no_bias);
        Dispatch {
            label: "router",
            bind_group: gpu.bind("router", &self.pipeline, &[&params.0, b.logits, bias, b.ids, b.weights]),
            pipeline: self.pipeline.clone(),
            workgroups: [1, 1, 1],
            tokens_per_workgroup: 1,
        }
    }
}
