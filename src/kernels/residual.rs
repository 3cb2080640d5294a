//! `wgsl/residual.wgsl`: the residual add, plain (scaled), as the weighted
//! sum of the routed experts' outputs, or of one row added to every token
//! (a control vector).

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    k: u32,
    weighted: u32,
    scale: f32,
    y_token_stride: u32,
    _pad: [u32; 3],
}

#[derive(Debug)]
pub struct Residual {
    pipeline: wgpu::ComputePipeline,
    /// Bound as `weights` by unweighted adds, which never read it.
    no_weights: wgpu::Buffer,
}

impl Residual {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Residual {
            pipeline: super::pipeline(gpu, "residual", &[])?,
            no_weights: gpu.storage_buffer("residual.no_weights", 1)?,
        })
    }

    fn dispatch(
        &self,
        gpu: &Gpu,
        params: Params,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        weights: &wgpu::Buffer,
    ) -> Dispatch {
        let n = params.n;
        let params = ParamsBuffer::new(gpu, "residual.params", &params);
        Dispatch {
            label: "residual",
            bind_group: gpu.bind("residual", &self.pipeline, &[&params.0, y, x, weights]),
            pipeline: self.pipeline.clone(),
            workgroups: [n.div_ceil(64), 1, 1],
            tokens_per_workgroup: 1,
        }
    }

    /// `x[t] += scale * y[t]`, both packed `[tokens, n]`.
    pub fn plan(&self, gpu: &Gpu, n: usize, scale: f32, y: &wgpu::Buffer, x: &wgpu::Buffer) -> Dispatch {
        let params = Params { n: n as u32, k: 1, weighted: 0, scale, y_token_stride: n as u32, _pad: [0; 3] };
        self.dispatch(gpu, params, y, x, &self.no_weights)
    }

    /// `x[t] += scale * y` for every token, `y` one row of `n`.
    pub fn plan_broadcast(
        &self,
        gpu: &Gpu,
        n: usize,
        scale: f32,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
    ) -> Dispatch {
        let params = Params { n: n as u32, k: 1, weighted: 0, scale, y_token_stride: 0, _pad: [0; 3] };
        self.dispatch(gpu, params, y, x, &self.no_weights)
    }

    /// `x[t] += sum_j weights[t, j] * y[t, j]`, y packed `[tokens, k, n]`.
    pub fn plan_weighted(
        &self,
        gpu: &Gpu,
        n: usize,
        k: usize,
        weights: &wgpu::Buffer,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
    ) -> Dispatch {
        let params = Params {
            n: n as u32,
            k: k as u32,
            weighted: 1,
            scale: 0.0,
            y_token_stride: (k * n) as u32,
            _pad: [0; 3],
        };
        self.dispatch(gpu, params, y, x, weights)
    }
}
