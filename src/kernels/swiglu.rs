//! `wgsl/swiglu.wgsl`: the gated activation of the dense FFN.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    _pad: [u32; 3],
}

#[derive(Debug)]
pub struct Swiglu {
    pipeline: wgpu::ComputePipeline,
}

impl Swiglu {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Swiglu { pipeline: super::pipeline(gpu, "swiglu", &[])? })
    }

    /// `act[t] = silu(gate_up[t, ..n]) * gate_up[t, n..]`.
    pub fn plan(&self, gpu: &Gpu, n: usize, gate_up: &wgpu::Buffer, act: &wgpu::Buffer) -> Dispatch {
        let params = ParamsBuffer::new(gpu, "swiglu.params", &Params { n: n as u32, _pad: [0; 3] });
        Dispatch {
            label: "swiglu",
            bind_group: gpu.bind("swiglu", &self.pipeline, &[&params.0, gate_up, act]),
            pipeline: self.pipeline.clone(),
            workgroups: [(n as u32).div_ceil(64), 1, 1],
            tokens_per_workgroup: 1,
        }
    }
}
