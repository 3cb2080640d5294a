//! Buffer creation and the recorded-dispatch type every kernel wrapper returns.

use super::Gpu;
use crate::error::{Error, Result};

/// A kernel invocation with its pipeline, bindings and grid fixed at load
/// time, so that encoding a token only replays these.
#[derive(Debug, Clone)]
pub struct Dispatch {
    pub label: &'static str,
    pub pipeline: wgpu::ComputePipeline,
    pub bind_group: wgpu::BindGroup,
    /// Workgroups for one token (or one tile of tokens).
    pub workgroups: [u32; 3],
    /// How `y` grows with the tokens in flight `T`: multiplied by
    /// `ceil(T / tokens_per_workgroup)`; 0 keeps it fixed.
    pub tokens_per_workgroup: u32,
}

impl Dispatch {
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
        let [x, y, z] = self.workgroups;
        let y = match self.tokens_per_workgroup {
            0 => y,
            n => y * n_tokens.div_ceil(n),
        };
        self.encode_grid(pass, [x, y, z]);
    }

    /// Encodes over a grid the caller sizes (one that depends on more
    /// than the tokens in flight).
    pub fn encode_grid(&self, pass: &mut wgpu::ComputePass<'_>, [x, y, z]: [u32; 3]) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
    }
}

/// `buffers` whole, as bindings 0, 1, ... in order.
pub fn in_order<'b>(buffers: &[&'b wgpu::Buffer]) -> Vec<(u32, wgpu::BufferBinding<'b>)> {
    buffers.iter().enumerate().map(|(i, b)| (i as u32, b.as_entire_buffer_binding())).collect()
}

#[cfg(feature = "internals")]
pub fn encode_all(dispatches: &[Dispatch], pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
    for d in dispatches {
        d.encode(pass, n_tokens);
    }
}

/// A small uniform buffer of kernel parameters, written once at creation.
#[derive(Debug, Clone)]
pub struct ParamsBuffer(pub wgpu::Buffer);

impl ParamsBuffer {
    pub fn new<T: bytemuck::Pod>(gpu: &Gpu, label: &str, params: &T) -> Self {
        // Uniform buffers are sized in 16-byte multiples.
        let mut contents = bytemuck::bytes_of(params).to_vec();
        contents.resize(contents.len().next_multiple_of(16), 0);
        ParamsBuffer(gpu.buffer_with(label, &contents, wgpu::BufferUsages::UNIFORM))
    }
}

impl Gpu {
    /// A zero-filled f32/u32 storage buffer of `len` 4-byte elements.
    pub fn storage_buffer(&self, label: &str, len: usize) -> Result<wgpu::Buffer> {
        self.storage_buffer_bytes(label, (len.max(1) * 4) as u64)
    }

    /// A zero-filled storage buffer of `bytes` bytes, rounded up to a
    /// multiple of 16 (at least 16); [`crate::Error::OutOfDeviceMemory`]
    /// where that exceeds the adapter's largest buffer.
    pub fn storage_buffer_bytes(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        // 16-byte multiples: kernels may read any buffer as vec4s.
        let size = bytes.max(16).next_multiple_of(16);
        if size > self.caps.max_buffer_size {
            return Err(Error::OutOfDeviceMemory {
                what: label.to_string(),
                needed_bytes: Some(size),
                message: format!(
                    "one buffer may hold at most {} bytes on this adapter",
                    self.caps.max_buffer_size
                ),
            });
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer holding `data`.
    pub fn storage_buffer_init<T: bytemuck::Pod>(&self, label: &str, data: &[T]) -> wgpu::Buffer {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut padded;
        let contents = if bytes.len().is_multiple_of(16) && !bytes.is_empty() {
            bytes
        } else {
            padded = bytes.to_vec();
            padded.resize(bytes.len().max(16).next_multiple_of(16), 0);
            &padded
        };
        self.buffer_with(label, contents, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC)
    }

    /// A buffer holding `contents` (a multiple of 4 bytes) once the queue
    /// runs: written through the queue rather than mapped at creation,
    /// which panics inside wgpu on a lost device.
    fn buffer_with(&self, label: &str, contents: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: contents.len() as u64,
            usage: usage | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buffer, 0, contents);
        buffer
    }

    /// Splits `n` workgroups into an `(x, z)` grid within the per-dimension
    /// limit; kernels recover the linear index as `wid.x + wid.z * nwg.x`.
    pub fn fold_grid(&self, n: u32) -> [u32; 3] {
        let max = self.caps.max_workgroups_per_dim.max(1);
        if n <= max {
            [n.max(1), 1, 1]
        } else {
            let z = n.div_ceil(max);
            [n.div_ceil(z), 1, z]
        }
    }

    /// Binds `buffers` (as bindings 0..) in a bind group for `pipeline`.
    pub fn bind(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
        self.bind_ranges(label, pipeline, &in_order(buffers))
    }

    /// Binds buffers at the given binding indices (an entry point that uses
    /// only some of its module's bindings).
    pub fn bind_at(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
    ) -> wgpu::BindGroup {
        let ranges: Vec<(u32, wgpu::BufferBinding<'_>)> =
            buffers.iter().map(|(i, b)| (*i, b.as_entire_buffer_binding())).collect();
        self.bind_ranges(label, pipeline, &ranges)
    }

    /// Binds buffer ranges at the given binding indices.
    pub fn bind_ranges(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        ranges: &[(u32, wgpu::BufferBinding<'_>)],
    ) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry<'_>> = ranges
            .iter()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: *i,
                resource: wgpu::BindingResource::Buffer(b.clone()),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        })
    }
}
