//! The KV cache: per layer, f32 K and V rows `[context_len, nkv * head_dim]`,
//! written by the rope kernel after q/k norm and RoPE, read by attention.

use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::kernels::Heads;

#[derive(Debug)]
pub struct KvCache {
    pub k: Vec<wgpu::Buffer>,
    pub v: Vec<wgpu::Buffer>,
    pub context_len: usize,
}

impl KvCache {
    pub fn new(gpu: &Gpu, layers: usize, heads: Heads, context_len: usize) -> Result<Self> {
        let layer_bytes = (context_len * heads.kv_width() * 4) as u64;
        if layer_bytes > gpu.caps.max_storage_binding {
            return Err(Error::Unsupported {
                what: "context length",
                value: format!(
                    "{context_len} positions need {layer_bytes} bytes of K per layer, more than one \
                     storage binding may hold on this adapter ({} bytes)",
                    gpu.caps.max_storage_binding
                ),
            });
        }
        let alloc = |kind: &str, layer: usize| {
            gpu.storage_buffer(&format!("{kind}_cache.{layer}"), context_len * heads.kv_width())
        };
        Ok(KvCache {
            k: (0..layers).map(|l| alloc("k", l)).collect::<Result<_>>()?,
            v: (0..layers).map(|l| alloc("v", l)).collect::<Result<_>>()?,
            context_len,
        })
    }
}
