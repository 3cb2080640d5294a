//! `wgsl/residual.wgsl`: the residual add (scaled, for steering and
//! weighted expert sums).

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    scale: f32,
    _pad: [u32; 2],
}

#[derive(Debug)]
pub struct Residual {
    pipeline: wgpu::ComputePipeline,
}

impl Residual {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Residual {
            pipeline: super::pipeline(gpu, "residual", &[])?,
        })
    }

    /// `x[t] += scale * y[t]`, both packed `[tokens, n]`.
    pub fn plan(&self, gpu: &Gpu, n: usize, scale: f32, y: &wgpu::Buffer, x: &wgpu::Buffer) -> Dispatch {
        let params = ParamsBuffer::new(
            gpu,
            "residual.params",
            &Params {
                n: n as u32,
                scale,
                _pad: [0; 2],
            },
        );
        Dispatch {
            label: "residual",
            bind_group: gpu.bind("residual", &self.pipeline, &[&params.0, y, x]),
            pipeline: self.pipeline.clone(),
            workgroups: [(n as u32).div_ceil(64), 1, 1],
            per_token: true,
        }
    }
}
