//! `wgsl/gemv.wgsl`: bf16 weight x f32 vector, one dispatch per weight part;
//! in expert mode the rows are those of the expert the GPU-side routing
//! chose for a slot.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer, TensorPart};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    first_row: u32,
    expert_rows: u32,
    top_k: u32,
    slot: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    _pad: [u32; 2],
}

impl Params {
    /// One part of a plain matrix: packed inputs, outputs at the part's rows.
    fn plain(weight: &GpuTensor, part: &TensorPart) -> Self {
        Params {
            rows: part.rows as u32,
            cols: weight.cols as u32,
            first_row: part.first_row as u32,
            expert_rows: 0,
            top_k: 1,
            slot: 0,
            x_offset: 0,
            x_stride: weight.cols as u32,
            y_offset: part.first_row as u32,
            y_stride: weight.rows as u32,
            _pad: [0; 2],
        }
    }
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
    /// GPUs with a subgroup (or else a workgroup) reduction per row, whose
    /// lanes read consecutive weights.
    pub fn for_gpu(gpu: &Gpu) -> Self {
        if gpu.caps.is_cpu {
            GemvShape { rows_per_workgroup: 64, threads_per_row: 1 }
        } else {
            let lanes = subgroup_width(gpu).unwrap_or(32);
            GemvShape { rows_per_workgroup: (256 / lanes).max(1), threads_per_row: lanes }
        }
    }
}

/// The subgroup size when the adapter has subgroups of one fixed size
/// (each row's lanes are then exactly one subgroup).
fn subgroup_width(gpu: &Gpu) -> Option<u32> {
    let (min, max) = (gpu.caps.subgroup_min_size, gpu.caps.subgroup_max_size);
    (gpu.caps.subgroups && min == max && min.is_power_of_two() && (4..=128).contains(&min)).then_some(min)
}

/// Where an expert GEMV reads its input and writes its output, per token:
/// slot `j` reads `x[t * x_stride + j * x_slot_stride ..]` and writes
/// `y[t * y_stride + j * expert_rows ..]` with `y_stride = top_k * expert_rows`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertLayout {
    pub top_k: usize,
    /// Rows of one expert in the stacked weight.
    pub expert_rows: usize,
    pub x_stride: usize,
    /// 0 when every slot reads the same input row.
    pub x_slot_stride: usize,
}

#[derive(Debug)]
pub struct Gemv {
    pipeline: wgpu::ComputePipeline,
    shape: GemvShape,
    /// Bound as `ids` by plain GEMVs, which never read it.
    no_ids: wgpu::Buffer,
}

impl Gemv {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Self::with_shape(gpu, GemvShape::for_gpu(gpu))
    }

    pub fn with_shape(gpu: &Gpu, shape: GemvShape) -> Result<Self> {
        assert!(shape.threads_per_row.is_power_of_two());
        let wg = shape.rows_per_workgroup * shape.threads_per_row;
        let variant = if subgroup_width(gpu) == Some(shape.threads_per_row) {
            "reduce_subgroup"
        } else {
            "reduce_workgroup"
        };
        let pipeline = super::pipeline_variant(
            gpu,
            "gemv",
            variant,
            &[
                ("ROWS_PER_WG", shape.rows_per_workgroup as f64),
                ("THREADS_PER_ROW", shape.threads_per_row as f64),
                ("WG", wg as f64),
            ],
        )?;
        Ok(Gemv { pipeline, shape, no_ids: gpu.storage_buffer("gemv.no_ids", 1)? })
    }

    fn dispatch(
        &self,
        gpu: &Gpu,
        part: &TensorPart,
        params: Params,
        rows: usize,
        buffers: [&wgpu::Buffer; 3],
    ) -> Dispatch {
        let params = ParamsBuffer::new(gpu, "gemv.params", &params);
        let [x, y, ids] = buffers;
        let blocks = (rows as u32).div_ceil(self.shape.rows_per_workgroup);
        Dispatch {
            label: "gemv",
            bind_group: gpu.bind("gemv", &self.pipeline, &[&params.0, &part.buffer, x, y, ids]),
            pipeline: self.pipeline.clone(),
            workgroups: gpu.fold_grid(blocks),
            tokens_per_workgroup: 1,
        }
    }

    /// `y[t] = W x[t]` with x packed `[tokens, W.cols]` and y packed
    /// `[tokens, W.rows]`.
    pub fn plan(&self, gpu: &Gpu, weight: &GpuTensor, x: &wgpu::Buffer, y: &wgpu::Buffer) -> Vec<Dispatch> {
        weight
            .parts
            .iter()
            .map(|part| {
                self.dispatch(gpu, part, Params::plain(weight, part), part.rows, [x, y, &self.no_ids])
            })
            .collect()
    }

    /// For routing slot `slot`: `y[t, slot] = W_e x[t, slot]` where `e` is
    /// read from `ids[t * top_k + slot]` on the GPU and `W_e` is rows
    /// `[e * expert_rows, (e + 1) * expert_rows)` of the stacked `weight`.
    /// One dispatch per part, in part order; each computes the rows its
    /// part holds, so dispatching only the parts that overlap the chosen
    /// expert (see [`GpuTensor::parts_overlapping`]) is enough.
    pub fn plan_expert(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        layout: ExpertLayout,
        slot: usize,
        buffers: ExpertBuffers<'_>,
    ) -> Vec<Dispatch> {
        weight
            .parts
            .iter()
            .map(|part| {
                let params = Params {
                    expert_rows: layout.expert_rows as u32,
                    top_k: layout.top_k as u32,
                    slot: slot as u32,
                    x_offset: (slot * layout.x_slot_stride) as u32,
                    x_stride: layout.x_stride as u32,
                    y_offset: (slot * layout.expert_rows) as u32,
                    y_stride: (layout.top_k * layout.expert_rows) as u32,
                    ..Params::plain(weight, part)
                };
                self.dispatch(gpu, part, params, layout.expert_rows, [buffers.x, buffers.y, buffers.ids])
            })
            .collect()
    }
}

pub struct ExpertBuffers<'a> {
    pub x: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    pub ids: &'a wgpu::Buffer,
}
