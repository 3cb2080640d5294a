//! `wgsl/attention.wgsl`: causal grouped-query attention over the KV cache,
//! optionally split over the keys and merged (flash decoding).

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
    splits: u32,
    tokens_per_wg: u32,
    _pad: [u32; 3],
}

/// Largest head width the kernel supports.
pub const MAX_HEAD_DIM: usize = 256;
/// Largest number of query heads per KV head.
pub const MAX_GROUP: usize = 16;
/// Largest `group * head_dim` (the workgroup's copy of its queries).
pub const MAX_GROUP_WIDTH: usize = 2048;
/// Most query rows (token, head) one workgroup holds.
const MAX_ROWS: usize = 32;
/// Most key splits of one token's attention.
pub const MAX_SPLITS: usize = 32;

pub struct AttentionBindings<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
}

/// Scratch of split attention for one token: `[nq, splits, head_dim]`
/// partial sums and `[nq, splits, 2]` (max, sum) pairs.
pub struct SplitScratch<'a> {
    pub acc: &'a wgpu::Buffer,
    pub max_sum: &'a wgpu::Buffer,
}

#[derive(Debug)]
pub struct Attention {
    main: wgpu::ComputePipeline,
    combine: wgpu::ComputePipeline,
    no_scratch: wgpu::Buffer,
}

impl Attention {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Attention {
            main: super::pipeline_entry(gpu, "attention", "main", &[])?,
            combine: super::pipeline_entry(gpu, "attention", "combine", &[])?,
            no_scratch: gpu.storage_buffer("attention.no_scratch", 1)?,
        })
    }

    /// Key splits worth using for one token over a cache of `context_len`.
    pub fn decode_splits(context_len: usize) -> usize {
        context_len.div_ceil(64).clamp(1, MAX_SPLITS)
    }

    /// `out[t, h] = softmax(scale q k^T) v` for every query head of every
    /// token in flight, keys limited to a trailing `window` when it is
    /// non-zero. With `split` (one token at a time), the keys are divided
    /// among that many workgroups per KV head and merged by a second
    /// dispatch.
    pub fn plan(
        &self,
        gpu: &Gpu,
        heads: Heads,
        scale: f32,
        window: usize,
        b: AttentionBindings<'_>,
        split: Option<(usize, SplitScratch<'_>)>,
    ) -> Vec<Dispatch> {
        let group = heads.q / heads.kv;
        debug_assert!(
            heads.dim <= MAX_HEAD_DIM && group <= MAX_GROUP && group * heads.dim <= MAX_GROUP_WIDTH
        );
        let splits = split.as_ref().map_or(1, |(n, _)| *n);
        // A chunk of tokens shares each K/V tile among as many query rows as
        // fit; split attention runs one token.
        let tokens_per_wg = if split.is_some() {
            1
        } else {
            (MAX_ROWS / group).min(MAX_GROUP_WIDTH / (group * heads.dim)).max(1)
        };
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
                splits: splits as u32,
                tokens_per_wg: tokens_per_wg as u32,
                _pad: [0; 3],
            },
        );
        let (acc, max_sum) = match &split {
            Some((_, s)) => (s.acc, s.max_sum),
            None => (&self.no_scratch, &self.no_scratch),
        };
        let buffers = [&params.0, b.step, b.qkv, b.k_cache, b.v_cache, b.out, acc, max_sum];
        let mut dispatches = vec![Dispatch {
            label: "attention",
            bind_group: gpu.bind("attention", &self.main, &buffers),
            pipeline: self.main.clone(),
            workgroups: [heads.kv as u32, 1, splits as u32],
            tokens_per_workgroup: tokens_per_wg as u32,
        }];
        if splits > 1 {
            dispatches.push(Dispatch {
                label: "attention.combine",
                bind_group: gpu.bind_at(
                    "attention.combine",
                    &self.combine,
                    &[(0, &params.0), (5, b.out), (6, acc), (7, max_sum)],
                ),
                pipeline: self.combine.clone(),
                workgroups: [heads.q as u32, 1, 1],
                tokens_per_workgroup: 1,
            });
        }
        dispatches
    }
}
