//! `wgsl/copy.wgsl`: copies through the shader cores: a whole buffer (the
//! bandwidth reference) and the last rows of the tokens in flight
//! (residual capture).

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    rows: u32,
    _pad: [u32; 2],
}

#[derive(Debug)]
pub struct Copy {
    pipeline: wgpu::ComputePipeline,
    rows_pipeline: wgpu::ComputePipeline,
}

impl Copy {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Copy {
            pipeline: super::pipeline(gpu, "copy", &[])?,
            rows_pipeline: super::pipeline_entry(gpu, "copy", "rows", &[])?,
        })
    }

    /// `dst[..bytes] = src[..bytes]`, `bytes` a multiple of 16.
    pub fn plan(&self, gpu: &Gpu, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: u64) -> Dispatch {
        let n = (bytes / 16) as u32;
        let params = ParamsBuffer::new(gpu, "copy.params", &Params { n, rows: 0, _pad: [0; 2] });
        Dispatch {
            label: "copy",
            bind_group: gpu.bind("copy", &self.pipeline, &[&params.0, src, dst]),
            pipeline: self.pipeline.clone(),
            workgroups: [n.div_ceil(256 * 8).clamp(1, 65535), 1, 1],
            tokens_per_workgroup: 0,
        }
    }

    /// Copies the last `min(tokens, rows)` rows of `src` (packed
    /// `[tokens, n]`) to the start of `dst` (a range of at least `rows * n`
    /// f32). With `rows == 1` the grid is one row whatever the tokens in
    /// flight.
    pub fn plan_rows(
        &self,
        gpu: &Gpu,
        n: usize,
        rows: usize,
        step: &wgpu::Buffer,
        src: &wgpu::Buffer,
        dst: wgpu::BufferBinding<'_>,
    ) -> Dispatch {
        let params = ParamsBuffer::new(
            gpu,
            "copy.rows.params",
            &Params { n: n as u32, rows: rows as u32, _pad: [0; 2] },
        );
        let bindings = [
            (0, params.0.as_entire_buffer_binding()),
            (3, step.as_entire_buffer_binding()),
            (4, src.as_entire_buffer_binding()),
            (5, dst),
        ];
        Dispatch {
            label: "copy.rows",
            bind_group: gpu.bind_ranges("copy.rows", &self.rows_pipeline, &bindings),
            pipeline: self.rows_pipeline.clone(),
            workgroups: [(n as u32).div_ceil(256), 1, 1],
            tokens_per_workgroup: if rows == 1 { 0 } else { 1 },
        }
    }
}
