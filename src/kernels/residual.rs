//! `wgsl/residual.wgsl`: the residual add, plain (scaled) or as the
//! weighted sum of the routed experts' outputs; at a layer's output it also
//! adds the steering row and writes the capture.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};
use crate::kernels::Step;

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    k: u32,
    weighted: u32,
    scale: f32,
    steer: u32,
    capture_rows: u32,
    _pad: [u32; 2],
}

/// What the add at a layer's output also does: add `steer` (one row of
/// `n`) to every token, then copy the last `capture.rows` tokens' results.
#[derive(Debug, Clone, Default)]
pub struct LayerOutput<'a> {
    pub steer: Option<&'a wgpu::Buffer>,
    pub capture: Option<CaptureTarget<'a>>,
}

#[derive(Debug, Clone)]
pub struct CaptureTarget<'a> {
    /// Room for `rows * n` f32.
    pub region: wgpu::BufferBinding<'a>,
    pub rows: usize,
    /// The [`Step`] uniform: how many tokens are in flight.
    pub step: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct Residual {
    pipeline: wgpu::ComputePipeline,
    /// Bound in place of the inputs an add does not read.
    unused_input: wgpu::Buffer,
    unused_capture: wgpu::Buffer,
    unused_step: wgpu::Buffer,
}

impl Residual {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        use wgpu::util::DeviceExt;
        Ok(Residual {
            pipeline: super::pipeline(gpu, "residual", &[])?,
            unused_input: gpu.storage_buffer("residual.unused_input", 1)?,
            unused_capture: gpu.storage_buffer("residual.unused_capture", 1)?,
            unused_step: gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("residual.unused_step"),
                contents: bytemuck::bytes_of(&Step { pos0: 0, n_tokens: 0, _pad: [0; 2] }),
                usage: wgpu::BufferUsages::UNIFORM,
            }),
        })
    }

    fn dispatch(
        &self,
        gpu: &Gpu,
        mut params: Params,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        weights: Option<&wgpu::Buffer>,
        output: LayerOutput<'_>,
    ) -> Dispatch {
        params.steer = output.steer.is_some() as u32;
        params.capture_rows = output.capture.as_ref().map_or(0, |c| c.rows as u32);
        let n = params.n;
        let params = ParamsBuffer::new(gpu, "residual.params", &params);
        let unused = &self.unused_input;
        let (capture, step) = match output.capture {
            Some(c) => (c.region, c.step),
            None => (self.unused_capture.as_entire_buffer_binding(), &self.unused_step),
        };
        let bindings = [
            (0, params.0.as_entire_buffer_binding()),
            (1, y.as_entire_buffer_binding()),
            (2, x.as_entire_buffer_binding()),
            (3, weights.unwrap_or(unused).as_entire_buffer_binding()),
            (4, output.steer.unwrap_or(unused).as_entire_buffer_binding()),
            (5, capture),
            (6, step.as_entire_buffer_binding()),
        ];
        Dispatch {
            label: "residual",
            bind_group: gpu.bind_ranges("residual", &self.pipeline, &bindings),
            pipeline: self.pipeline.clone(),
            workgroups: [n.div_ceil(64), 1, 1],
            tokens_per_workgroup: 1,
        }
    }

    /// `x[t] += scale * y[t]`, both packed `[tokens, n]`.
    pub fn plan(&self, gpu: &Gpu, n: usize, scale: f32, y: &wgpu::Buffer, x: &wgpu::Buffer) -> Dispatch {
        self.plan_output(gpu, n, scale, y, x, LayerOutput::default())
    }

    /// As [`Self::plan`], at a layer's output.
    pub fn plan_output(
        &self,
        gpu: &Gpu,
        n: usize,
        scale: f32,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        output: LayerOutput<'_>,
    ) -> Dispatch {
        let params =
            Params { n: n as u32, k: 1, weighted: 0, scale, steer: 0, capture_rows: 0, _pad: [0; 2] };
        self.dispatch(gpu, params, y, x, None, output)
    }

    /// `x[t] += sum_j weights[t, j] * y[t, j]`, y packed `[tokens, k, n]`,
    /// at a layer's output.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_weighted(
        &self,
        gpu: &Gpu,
        n: usize,
        k: usize,
        weights: &wgpu::Buffer,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        output: LayerOutput<'_>,
    ) -> Dispatch {
        let params = Params {
            n: n as u32,
            k: k as u32,
            weighted: 1,
            scale: 0.0,
            steer: 0,
            capture_rows: 0,
            _pad: [0; 2],
        };
        self.dispatch(gpu, params, y, x, Some(weights), output)
    }
}
