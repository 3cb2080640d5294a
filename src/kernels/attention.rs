//! `wgsl/attention.wgsl`: causal grouped-query attention over the KV cache.

use super::Heads;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_q_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    out_stride: u32,
    window: u32,
    scale: f32,
    _pad: u32,
}

/// Largest head width the kernel supports (its workgroup copy of q).
pub const MAX_HEAD_DIM: usize = 256;

pub struct AttentionBindings<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct Attention {
    pipeline: wgpu::ComputePipeline,
}

/// Each invocation owns up to 4 head dims, so 64 covers MAX_HEAD_DIM.
const WORKGROUP: u32 = 64;

impl Attention {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Attention {
            pipeline: super::pipeline(gpu, "attention", &[("WG", WORKGROUP as f64)])?,
        })
    }

    /// `out[t, h] = softmax(scale q k^T) v` for every query head of every
    /// token, keys limited to a trailing `window` when it is non-zero.
    pub fn plan(&self, gpu: &Gpu, heads: Heads, scale: f32, window: usize, b: AttentionBindings<'_>) -> Dispatch {
        debug_assert!(heads.dim <= 4 * WORKGROUP as usize && heads.dim <= MAX_HEAD_DIM);
        let params = ParamsBuffer::new(
            gpu,
            "attention.params",
            &Params {
                n_q_heads: heads.q as u32,
                n_kv_heads: heads.kv as u32,
                head_dim: heads.dim as u32,
                q_stride: heads.qkv_width() as u32,
                out_stride: (heads.q * heads.dim) as u32,
                window: window as u32,
                scale,
                _pad: 0,
            },
        );
        Dispatch {
            label: "attention",
            bind_group: gpu.bind(
                "attention",
                &self.pipeline,
                &[&params.0, b.step, b.qkv, b.k_cache, b.v_cache, b.out],
            ),
            pipeline: self.pipeline.clone(),
            workgroups: [heads.q as u32, 1, 1],
            tokens_per_workgroup: 1,
        }
    }
}
