//! `wgsl/embed.wgsl`: embedding rows for the tokens in flight.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer};

crate::wgsl_struct! {
    pub struct EmbedParams {
        hidden: u32,
        first_row: u32,
        rows: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![EmbedParams::WGSL]
}

#[derive(Debug)]
pub struct Embed {
    pipeline: wgpu::ComputePipeline,
}

impl Embed {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Embed { pipeline: super::pipeline(gpu, "embed", "main", &[], &[])? })
    }

    /// `x[t] = table[tokens[t]]`, one dispatch per part of the table.
    pub fn plan(
        &self,
        gpu: &Gpu,
        table: &GpuTensor,
        tokens: &wgpu::Buffer,
        x: &wgpu::Buffer,
    ) -> Vec<Dispatch> {
        table
            .parts
            .iter()
            .map(|part| {
                let params = ParamsBuffer::new(
                    gpu,
                    "embed.params",
                    &EmbedParams {
                        hidden: table.cols as u32,
                        first_row: part.first_row as u32,
                        rows: part.rows as u32,
                    },
                );
                Dispatch {
                    label: "embed",
                    bind_group: gpu.bind("embed", &self.pipeline, &[&params.0, &part.buffer, tokens, x]),
                    pipeline: self.pipeline.clone(),
                    workgroups: [(table.cols as u32).div_ceil(64), 1, 1],
                    tokens_per_workgroup: 1,
                }
            })
            .collect()
    }
}
