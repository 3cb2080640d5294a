//! `wgsl/embed.wgsl`: embedding rows for the tokens in flight.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer, in_order};

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

#[derive(Debug, Default)]
pub struct Embed;

impl Embed {
    pub fn new(_gpu: &Gpu) -> Result<Self> {
        Ok(Embed)
    }

    /// `x[t] = table[tokens[t]]`, one dispatch per part of the table.
    pub fn plan(
        &self,
        gpu: &Gpu,
        table: &GpuTensor,
        tokens: &wgpu::Buffer,
        x: &wgpu::Buffer,
    ) -> Result<Vec<Dispatch>> {
        table
            .parts
            .iter()
            .map(|part| {
                let flags = super::weight_flags(gpu, part.format);
                let pipeline = super::pipeline(gpu, "embed", "main", &flags, &[])?;
                // A format other than bf16 decodes four values per invocation.
                let per_invocation = if flags.is_empty() { 1 } else { 4 };
                if !table.cols.is_multiple_of(per_invocation) {
                    return Err(crate::Error::Unsupported {
                        what: "embedding width (a multiple of 4 in formats other than bf16)",
                        value: format!("{}: {} columns of {}", table.name, table.cols, part.format),
                    });
                }
                let params = ParamsBuffer::new(
                    gpu,
                    "embed.params",
                    &EmbedParams {
                        hidden: table.cols as u32,
                        first_row: part.first_row as u32,
                        rows: part.rows as u32,
                    },
                );
                Ok(Dispatch {
                    label: "embed",
                    bind_group: super::bind_reading(
                        gpu,
                        "embed",
                        &pipeline,
                        part.format,
                        &in_order(&[&params.0, &part.buffer, tokens, x]),
                    ),
                    pipeline,
                    workgroups: [((table.cols / per_invocation) as u32).div_ceil(64), 1, 1],
                    tokens_per_workgroup: 1,
                })
            })
            .collect()
    }
}
