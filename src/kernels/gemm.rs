//! `wgsl/gemm.wgsl`: bf16 weight x f32 activations for a chunk of tokens,
//! dense or over the tokens the host grouped under one expert.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer, TensorPart};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    first_row: u32,
    expert_rows: u32,
    expert: u32,
    x_div: u32,
    y_stride: u32,
    _pad: u32,
}

const TILE_M: u32 = 64;

/// Matrices of at most this many rows use 64-row tiles (twice the
/// workgroups of 128-row tiles, which keeps a large GPU busy on narrow
/// projections); wider ones use 128-row tiles (more work per load).
pub const NARROW_ROWS: usize = 4096;

/// The buffers of a grouped (MoE prefill) product.
pub struct GroupedBuffers<'a> {
    pub x: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    /// u32 `[experts, 2]`: offset and count of each expert's pairs.
    pub groups: &'a wgpu::Buffer,
    /// u32 pair indices `token * top_k + slot`, grouped by expert.
    pub pairs: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct Gemm {
    /// 64-row and 128-row tiles.
    narrow: wgpu::ComputePipeline,
    wide: wgpu::ComputePipeline,
    narrow_rows: usize,
    /// Bound as `groups` and `pairs` by dense products, which never read them.
    no_groups: wgpu::Buffer,
}

impl Gemm {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Self::with_narrow_rows(gpu, NARROW_ROWS)
    }

    /// As [`Self::new`] with another threshold for 64-row tiles (tests use
    /// it to exercise both tilings).
    pub fn with_narrow_rows(gpu: &Gpu, narrow_rows: usize) -> Result<Self> {
        Ok(Gemm {
            narrow: super::pipeline(gpu, "gemm", &[("TILE_N", 64.0)])?,
            wide: super::pipeline(gpu, "gemm", &[("TILE_N", 128.0)])?,
            narrow_rows,
            no_groups: gpu.storage_buffer("gemm.no_groups", 2)?,
        })
    }

    fn dispatch(
        &self,
        gpu: &Gpu,
        part: &TensorPart,
        params: Params,
        n_rows: usize,
        b: [&wgpu::Buffer; 5],
    ) -> Dispatch {
        let [step, x, y, groups, pairs] = b;
        let params = ParamsBuffer::new(gpu, "gemm.params", &params);
        let (pipeline, tile_n) = if n_rows <= self.narrow_rows {
            (&self.narrow, 64)
        } else {
            (&self.wide, 128)
        };
        let tiles = (n_rows as u32).div_ceil(tile_n);
        Dispatch {
            label: "gemm",
            bind_group: gpu.bind(
                "gemm",
                pipeline,
                &[&params.0, step, &part.buffer, x, y, groups, pairs],
            ),
            pipeline: pipeline.clone(),
            workgroups: gpu.fold_grid(tiles),
            tokens_per_workgroup: TILE_M,
        }
    }

    /// `y[t] = W x[t]` for the `step.n_tokens` tokens in flight, x packed
    /// `[tokens, W.cols]`, y packed `[tokens, W.rows]`.
    pub fn plan(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        step: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Vec<Dispatch> {
        weight
            .parts
            .iter()
            .map(|part| {
                let params = Params {
                    rows: part.rows as u32,
                    cols: weight.cols as u32,
                    first_row: part.first_row as u32,
                    expert_rows: 0,
                    expert: 0,
                    x_div: 1,
                    y_stride: weight.rows as u32,
                    _pad: 0,
                };
                let g = &self.no_groups;
                self.dispatch(gpu, part, params, part.rows, [step, x, y, g, g])
            })
            .collect()
    }

    /// For expert `expert` of a stacked `weight` (`expert_rows` rows each):
    /// `y[idx] = W_e x[idx / x_div]` for every pair index `idx` grouped
    /// under it. One dispatch per part holding any of the expert's rows.
    /// The grid's `y` must be sized by the group's count at encode time.
    pub fn plan_expert(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        expert: usize,
        expert_rows: usize,
        x_div: usize,
        step: &wgpu::Buffer,
        b: GroupedBuffers<'_>,
    ) -> Vec<Dispatch> {
        let rows = expert * expert_rows..(expert + 1) * expert_rows;
        weight
            .parts_overlapping(rows)
            .map(|i| {
                let part = &weight.parts[i];
                let params = Params {
                    rows: part.rows as u32,
                    cols: weight.cols as u32,
                    first_row: part.first_row as u32,
                    expert_rows: expert_rows as u32,
                    expert: expert as u32,
                    x_div: x_div as u32,
                    y_stride: expert_rows as u32,
                    _pad: 0,
                };
                self.dispatch(
                    gpu,
                    part,
                    params,
                    expert_rows,
                    [step, b.x, b.y, b.groups, b.pairs],
                )
            })
            .collect()
    }
}
