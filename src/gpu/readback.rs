//! Bringing GPU results to the host: copy into a `MAP_READ` staging buffer
//! at the end of a submission, map it, wait, read.

use super::Gpu;
use crate::error::{Error, Result};

/// A reusable staging buffer for reading back up to `capacity` bytes.
#[derive(Debug)]
pub struct Readback {
    staging: wgpu::Buffer,
}

impl Readback {
    pub fn new(gpu: &Gpu, label: &str, capacity: u64) -> Self {
        Readback {
            staging: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: capacity.max(4).next_multiple_of(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        }
    }

    /// Records the copy of `bytes` bytes of `src` (from `offset`) into the
    /// staging buffer; call before finishing the encoder.
    pub fn record(&self, encoder: &mut wgpu::CommandEncoder, src: &wgpu::Buffer, offset: u64, bytes: u64) {
        self.record_at(encoder, src, offset, 0, bytes);
    }

    /// As [`Self::record`], into the staging buffer from `staging_offset`.
    pub fn record_at(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        src: &wgpu::Buffer,
        offset: u64,
        staging_offset: u64,
        bytes: u64,
    ) {
        encoder.copy_buffer_to_buffer(src, offset, &self.staging, staging_offset, bytes);
    }

    /// Maps the staging buffer after the submission that recorded the copy,
    /// waits for it and returns its first `bytes` bytes as `T`s.
    pub fn read<T: bytemuck::Pod>(&self, gpu: &Gpu, bytes: u64) -> Result<Vec<T>> {
        self.read_with(gpu, bytes, |mapped| bytemuck::pod_collect_to_vec(mapped))
    }

    /// As [`Self::read`], handing the mapped bytes to `f` instead of
    /// copying them into a new vector first.
    pub fn read_with<R>(&self, gpu: &Gpu, bytes: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let slice = self.staging.slice(0..bytes);
        let (sender, receiver) = futures_intrusive::channel::shared::oneshot_channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            sender.send(r).ok();
        });
        gpu.wait()?;
        gpu.check("readback")?;
        let mapped = pollster::block_on(receiver.receive())
            .ok_or_else(|| Error::Gpu("readback callback was dropped".into()))?;
        mapped.map_err(|e| Error::Gpu(format!("map_async failed: {e}")))?;
        let out = {
            let view = slice.get_mapped_range().map_err(|e| Error::Gpu(format!("mapped range: {e}")))?;
            f(&view)
        };
        self.staging.unmap();
        Ok(out)
    }
}

impl Gpu {
    /// Reads `len` elements of `buffer` (test and debug helper; the flow
    /// keeps its own [`Readback`]s).
    pub fn read_buffer<T: bytemuck::Pod>(&self, buffer: &wgpu::Buffer, len: usize) -> Result<Vec<T>> {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        let readback = Readback::new(self, "read_buffer", bytes);
        let mut encoder = self.device.create_command_encoder(&Default::default());
        readback.record(&mut encoder, buffer, 0, bytes.next_multiple_of(4));
        self.queue.submit([encoder.finish()]);
        readback.read(self, bytes)
    }
}
