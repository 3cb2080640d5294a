//! `wgsl/group_by_expert.wgsl`: a chunk's (token, slot) pairs grouped by
//! their expert on the GPU, so that the grouped GEMMs run without the host
//! seeing the routing.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

/// The kernel's workgroup arrays hold this many experts' counts: as many
/// as the router chooses among.
pub const MAX_EXPERTS: usize = 512;
const _: () = assert!(MAX_EXPERTS >= super::router::MAX_EXPERTS);

crate::wgsl_struct! {
    pub struct GroupParams {
        n_experts: u32,
        top_k: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![GroupParams::WGSL]
}

/// The buffers of a grouping: the router's choice in, the groups out.
pub struct GroupBuffers<'a> {
    pub step: &'a wgpu::Buffer,
    /// u32 `[tokens, top_k]`: each pair's expert.
    pub ids: &'a wgpu::Buffer,
    /// u32 `[n_experts, 2]`: offset and count of each expert's pairs.
    pub groups: &'a wgpu::Buffer,
    /// u32 pair indices grouped by expert, in increasing order within each.
    pub pairs: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct GroupByExpert {
    pipeline: wgpu::ComputePipeline,
}

impl GroupByExpert {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(GroupByExpert { pipeline: super::pipeline(gpu, "group_by_expert", "main", &[], &[])? })
    }

    /// Groups the pairs of the tokens in flight among `n_experts` experts
    /// (at most [`MAX_EXPERTS`], as the router allows).
    pub fn plan(&self, gpu: &Gpu, n_experts: usize, top_k: usize, b: GroupBuffers<'_>) -> Dispatch {
        debug_assert!(n_experts <= MAX_EXPERTS);
        let params = ParamsBuffer::new(
            gpu,
            "group_by_expert.params",
            &GroupParams { n_experts: n_experts as u32, top_k: top_k as u32 },
        );
        Dispatch {
            label: "group_by_expert",
            bind_group: gpu.bind(
                "group_by_expert",
                &self.pipeline,
                &[&params.0, b.step, b.ids, b.groups, b.pairs],
            ),
            pipeline: self.pipeline.clone(),
            workgroups: [1, 1, 1],
            tokens_per_workgroup: 0,
        }
    }
}
