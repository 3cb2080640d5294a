//! The KV cache: per layer a K and a V buffer of `[context_len, nkv *
//! head_dim]`, written after q/k norm and RoPE, read by attention. f16 by
//! default: half the bytes of every attention read, which is what long
//! contexts pay for.

use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// How the cache stores its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvFormat {
    /// IEEE half precision, two per 32-bit word (`pack2x16float`, so
    /// adapters without SHADER_F16 run it too).
    #[default]
    F16,
    /// f32: exact, twice the bytes.
    F32,
}

impl KvFormat {
    /// Bytes one cached value takes: 2 for f16, 4 for f32.
    pub fn bytes_per_value(self) -> usize {
        match self {
            KvFormat::F16 => 2,
            KvFormat::F32 => 4,
        }
    }
}

impl std::str::FromStr for KvFormat {
    type Err = Error;
    fn from_str(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvFormat::F16),
            "f32" => Ok(KvFormat::F32),
            _ => Err(Error::Unsupported { what: "KV cache format", value: format!("{name:?} (f16 or f32)") }),
        }
    }
}

#[derive(Debug)]
pub struct KvCache {
    /// Per layer.
    pub k: Vec<wgpu::Buffer>,
    pub v: Vec<wgpu::Buffer>,
    pub context_len: usize,
    pub format: KvFormat,
}

impl KvCache {
    /// Bytes of every layer's cache for `context_len` positions.
    /// Saturates rather than wraps: a context too large for any device
    /// then fails the budget check.
    pub fn bytes(layers: usize, heads: Heads, context_len: usize, format: KvFormat) -> u64 {
        Self::layer_bytes(heads, context_len, format).saturating_mul(2 * layers as u64)
    }

    /// Bytes of one layer's K (or V), saturating.
    fn layer_bytes(heads: Heads, context_len: usize, format: KvFormat) -> u64 {
        (context_len as u64).saturating_mul((heads.kv_width() * format.bytes_per_value()) as u64)
    }

    pub fn new(gpu: &Gpu, layers: usize, heads: Heads, context_len: usize, format: KvFormat) -> Result<Self> {
        let layer_bytes = Self::layer_bytes(heads, context_len, format);
        if layer_bytes > gpu.caps.max_storage_binding {
            return Err(Error::Unsupported {
                what: "context length",
                value: format!(
                    "{context_len} positions need {layer_bytes} bytes of {format:?} K per layer, more than \
                     one storage binding may hold on this adapter ({} bytes)",
                    gpu.caps.max_storage_binding
                ),
            });
        }
        let alloc = |kind: &str| -> Result<Vec<wgpu::Buffer>> {
            (0..layers).map(|l| gpu.storage_buffer_bytes(&format!("{kind}_cache.{l}"), layer_bytes)).collect()
        };
        Ok(KvCache { k: alloc("k")?, v: alloc("v")?, context_len, format })
    }
}

/// The attention geometry: query heads, key/value heads and head width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub q: usize,
    /// Key/value heads (a divisor of `q`).
    pub kv: usize,
    /// Width of one head.
    pub dim: usize,
}

impl Heads {
    /// Width of one token's fused q, k, v projection.
    pub fn qkv_width(&self) -> usize {
        (self.q + 2 * self.kv) * self.dim
    }

    /// Width of one position's K (or V) in the cache.
    pub fn kv_width(&self) -> usize {
        self.kv * self.dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.q / self.kv
    }
}
