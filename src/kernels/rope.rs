//! `wgsl/rope.wgsl`: rotary embedding of q and k, and the KV-cache store.

use super::Heads;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_q_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    half_rot: u32,
    qkv_stride: u32,
    _pad: [u32; 3],
}

/// The GPU-side buffers one layer's rope-and-store reads and writes.
pub struct RopeBindings<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub cos_sin: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct Rope {
    pipeline: wgpu::ComputePipeline,
}

impl Rope {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Rope { pipeline: super::pipeline(gpu, "rope", &[])? })
    }

    /// Rotates the first `rotary_dim` dims of every q and k head of `qkv`,
    /// writes the rotated k and the v of each token to the cache at its
    /// position.
    pub fn plan(&self, gpu: &Gpu, heads: Heads, rotary_dim: usize, b: RopeBindings<'_>) -> Dispatch {
        let params = ParamsBuffer::new(
            gpu,
            "rope.params",
            &Params {
                n_q_heads: heads.q as u32,
                n_kv_heads: heads.kv as u32,
                head_dim: heads.dim as u32,
                half_rot: (rotary_dim / 2) as u32,
                qkv_stride: heads.qkv_width() as u32,
                _pad: [0; 3],
            },
        );
        Dispatch {
            label: "rope",
            bind_group: gpu.bind(
                "rope",
                &self.pipeline,
                &[&params.0, b.step, b.qkv, b.cos_sin, b.k_cache, b.v_cache],
            ),
            pipeline: self.pipeline.clone(),
            workgroups: [(heads.q + 2 * heads.kv) as u32, 1, 1],
            tokens_per_workgroup: 1,
        }
    }
}
