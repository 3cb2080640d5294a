//! `wgsl/gemv.wgsl`: bf16 weight x f32 vector, one dispatch per weight part.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    first_row: u32,
    y_stride: u32,
}

/// How rows are spread over a workgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvShape {
    pub rows_per_workgroup: u32,
    /// Must be a power of two; 1 means one row per invocation.
    pub threads_per_row: u32,
}

impl GemvShape {
    /// CPU rasterisers do best with one row per invocation (no barriers);
    /// GPUs with a workgroup reduction per row (coalesced weight reads).
    pub fn for_gpu(gpu: &Gpu) -> Self {
        if gpu.caps.is_cpu {
            GemvShape {
                rows_per_workgroup: 64,
                threads_per_row: 1,
            }
        } else {
            GemvShape {
                rows_per_workgroup: 8,
                threads_per_row: 32,
            }
        }
    }
}

#[derive(Debug)]
pub struct Gemv {
    pipeline: wgpu::ComputePipeline,
    shape: GemvShape,
}

impl Gemv {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Self::with_shape(gpu, GemvShape::for_gpu(gpu))
    }

    pub fn with_shape(gpu: &Gpu, shape: GemvShape) -> Result<Self> {
        assert!(shape.threads_per_row.is_power_of_two());
        let wg = shape.rows_per_workgroup * shape.threads_per_row;
        let pipeline = super::pipeline(
            gpu,
            "gemv",
            &[
                ("ROWS_PER_WG", shape.rows_per_workgroup as f64),
                ("THREADS_PER_ROW", shape.threads_per_row as f64),
                ("WG", wg as f64),
            ],
        )?;
        Ok(Gemv { pipeline, shape })
    }

    /// `y[t] = W x[t]` with x packed `[tokens, W.cols]` and y packed
    /// `[tokens, W.rows]`.
    pub fn plan(&self, gpu: &Gpu, weight: &GpuTensor, x: &wgpu::Buffer, y: &wgpu::Buffer) -> Vec<Dispatch> {
        weight
            .parts
            .iter()
            .map(|part| {
                let params = ParamsBuffer::new(
                    gpu,
                    "gemv.params",
                    &Params {
                        rows: part.rows as u32,
                        cols: weight.cols as u32,
                        first_row: part.first_row as u32,
                        y_stride: weight.rows as u32,
                    },
                );
                let blocks = (part.rows as u32).div_ceil(self.shape.rows_per_workgroup);
                Dispatch {
                    label: "gemv",
                    bind_group: gpu.bind("gemv", &self.pipeline, &[&params.0, &part.buffer, x, y]),
                    pipeline: self.pipeline.clone(),
                    workgroups: gpu.fold_grid(blocks),
                    per_token: true,
                }
            })
            .collect()
    }
}
