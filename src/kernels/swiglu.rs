//! `wgsl/swiglu.wgsl`: the gated activation of a prompt chunk's FFN (one
//! token's is fused into its gate/up GEMV).

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

crate::wgsl_struct! {
    pub struct SwigluParams {
        n: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![SwigluParams::WGSL]
}

#[derive(Debug)]
pub struct Swiglu {
    pipeline: wgpu::ComputePipeline,
}

impl Swiglu {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Swiglu { pipeline: super::pipeline(gpu, "swiglu", "main", &[], &[])? })
    }

    /// `act[t, i] = silu(gate_up[t, 2i]) * gate_up[t, 2i + 1]` for `rows`
    /// rows per token (routing slots: `top_k`).
    pub fn plan(
        &self,
        gpu: &Gpu,
        n: usize,
        rows: usize,
        gate_up: &wgpu::Buffer,
        act: &wgpu::Buffer,
    ) -> Dispatch {
        let params = ParamsBuffer::new(gpu, "swiglu.params", &SwigluParams { n: n as u32 });
        Dispatch {
            label: "swiglu",
            bind_group: gpu.bind("swiglu", &self.pipeline, &[&params.0, gate_up, act]),
            pipeline: self.pipeline.clone(),
            workgroups: [(n as u32).div_ceil(64), rows as u32, 1],
            tokens_per_workgroup: 1,
        }
    }
}
