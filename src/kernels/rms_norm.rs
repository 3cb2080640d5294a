//! `wgsl/rms_norm.wgsl`: RMSNorm over rows of the hidden state or of q/k
//! heads, and LayerNorm (the vision tower's) over rows.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer};

crate::wgsl_struct! {
    pub struct RmsNormParams {
        n: u32,
        head_stride: u32,
        token_stride: u32,
        offset: u32,
        eps: f32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![RmsNormParams::WGSL]
}

/// Where the rows to normalise are: `heads` rows of `n` elements per token,
/// `head_stride` apart, starting at `offset` in a buffer of `token_stride`
/// elements per token.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    pub n: usize,
    pub heads: usize,
    pub head_stride: usize,
    pub token_stride: usize,
    pub offset: usize,
}

impl Rows {
    /// One row of `n` per token, tokens packed.
    pub fn vector(n: usize) -> Self {
        Rows { n, heads: 1, head_stride: 0, token_stride: n, offset: 0 }
    }
}

/// The flag of the LayerNorm build.
pub const LAYER_NORM: &str = "LAYER_NORM";

pub fn flag_sets() -> Vec<Vec<&'static str>> {
    vec![vec![], vec![LAYER_NORM]]
}

#[derive(Debug)]
pub struct RmsNorm {
    pipeline: wgpu::ComputePipeline,
    wg: f64,
}

impl RmsNorm {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let wg = if gpu.caps.is_cpu { 64.0 } else { 256.0 };
        Ok(RmsNorm { pipeline: super::pipeline(gpu, "rms_norm", "main", &[], &[("WG", wg)])?, wg })
    }

    fn params(gpu: &Gpu, eps: f32, rows: Rows) -> ParamsBuffer {
        ParamsBuffer::new(
            gpu,
            "rms_norm.params",
            &RmsNormParams {
                n: rows.n as u32,
                head_stride: rows.head_stride as u32,
                token_stride: rows.token_stride as u32,
                offset: rows.offset as u32,
                eps,
            },
        )
    }

    /// `out = w * x * rsqrt(mean(x^2) + eps)` per row; `x` and `out` may be
    /// the same buffer (the rows are then normalised in place, at the same
    /// offsets).
    pub fn plan(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        eps: f32,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        rows: Rows,
    ) -> Dispatch {
        let params = Self::params(gpu, eps, rows);
        Dispatch {
            label: "rms_norm",
            bind_group: gpu.bind("rms_norm", &self.pipeline, &[&params.0, &weight.parts[0].buffer, x, out]),
            pipeline: self.pipeline.clone(),
            workgroups: [rows.heads as u32, 1, 1],
            tokens_per_workgroup: 1,
        }
    }

    /// LayerNorm per row, `out = (x - mean) * rsqrt(var + eps) * w + b`
    /// (biased variance, as torch's), f32 weight and bias of `rows.n`.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_layer_norm(
        &self,
        gpu: &Gpu,
        weight: &wgpu::Buffer,
        bias: &wgpu::Buffer,
        eps: f32,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        rows: Rows,
    ) -> Result<Dispatch> {
        let pipeline = super::pipeline(gpu, "rms_norm", "main", &[LAYER_NORM], &[("WG", self.wg)])?;
        let params = Self::params(gpu, eps, rows);
        Ok(Dispatch {
            label: "layer_norm",
            bind_group: gpu.bind("layer_norm", &pipeline, &[&params.0, weight, x, out, bias]),
            pipeline,
            workgroups: [rows.heads as u32, 1, 1],
            tokens_per_workgroup: 1,
        })
    }
}
