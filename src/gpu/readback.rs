//! Bringing GPU results to the host: copy into a `MAP_READ` staging buffer
//! at the end of a submission, map it, wait, read. The map can start right
//! after the submission and be waited on later, so the host records more
//! work while the GPU runs.

use std::sync::{Arc, Mutex};

use super::Gpu;
use crate::error::{Error, Result};

type MapResult = Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>>;

/// How the host waits for a map.
#[derive(Debug, Clone)]
pub enum MapWait {
    /// Sleeps until the submission (or, with `None`, all submitted work)
    /// is done.
    Block(Option<wgpu::SubmissionIndex>),
    /// Polls without sleeping: the quickest wake-up, for a wait whose
    /// latency the GPU idles through (a routing readback).
    Spin,
}

/// A reusable staging buffer for reading back up to `capacity` bytes.
#[derive(Debug)]
pub struct Readback {
    staging: wgpu::Buffer,
    /// Set by the map callback.
    mapped: MapResult,
    /// Bytes of the map in progress.
    pending: Mutex<Option<u64>>,
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
            mapped: Arc::default(),
            pending: Mutex::new(None),
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

    /// Starts mapping the first `bytes` bytes, after the submission that
    /// recorded the copy. Does not wait.
    pub fn start_map(&self, bytes: u64) {
        *self.mapped.lock().unwrap() = None;
        *self.pending.lock().unwrap() = Some(bytes);
        let mapped = self.mapped.clone();
        self.staging.slice(0..bytes).map_async(wgpu::MapMode::Read, move |r| {
            *mapped.lock().unwrap() = Some(r);
        });
    }

    /// Waits for the map [`Self::start_map`] started, hands the mapped
    /// bytes to `f` and unmaps.
    pub fn finish_map<R>(&self, gpu: &Gpu, wait: MapWait, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let bytes = self.pending.lock().unwrap().take().expect("finish_map after start_map");
        let poll_error = |e: wgpu::PollError| gpu.poll_error(e);
        match wait {
            MapWait::Block(submission) => {
                let poll = wgpu::PollType::Wait { submission_index: submission, timeout: None };
                gpu.device.poll(poll).map_err(poll_error)?;
            }
            MapWait::Spin => {
                while self.mapped.lock().unwrap().is_none() {
                    gpu.device.poll(wgpu::PollType::Poll).map_err(poll_error)?;
                    gpu.check("readback")?;
                    std::hint::spin_loop();
                }
            }
        }
        gpu.check("readback")?;
        // The poll ran the callbacks of everything it waited for; a map can
        // still be queued behind them on some backends.
        while self.mapped.lock().unwrap().is_none() {
            gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(poll_error)?;
        }
        let mapped = self.mapped.lock().unwrap().take().expect("checked above");
        gpu.alive()?;
        mapped.map_err(|e| Error::Gpu(format!("map_async failed: {e}")))?;
        let slice = self.staging.slice(0..bytes);
        let out = {
            let view = slice.get_mapped_range().map_err(|e| Error::Gpu(format!("mapped range: {e}")))?;
            f(&view)
        };
        self.staging.unmap();
        Ok(out)
    }

    /// Maps the staging buffer after the submission that recorded the copy,
    /// waits for it and returns its first `bytes` bytes as `T`s.
    pub fn read<T: bytemuck::Pod>(&self, gpu: &Gpu, bytes: u64) -> Result<Vec<T>> {
        self.read_with(gpu, bytes, |mapped| bytemuck::pod_collect_to_vec(mapped))
    }

    /// As [`Self::read`], handing the mapped bytes to `f` instead of
    /// copying them into a new vector first.
    pub fn read_with<R>(&self, gpu: &Gpu, bytes: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.start_map(bytes);
        self.finish_map(gpu, MapWait::Block(None), f)
    }
}

impl Gpu {
    /// Reads `len` elements of `buffer` (test and debug helper; the flow
    /// keeps its own readback buffers).
    pub fn read_buffer<T: bytemuck::Pod>(&self, buffer: &wgpu::Buffer, len: usize) -> Result<Vec<T>> {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        let readback = Readback::new(self, "read_buffer", bytes);
        let mut encoder = self.device.create_command_encoder(&Default::default());
        readback.record(&mut encoder, buffer, 0, bytes.next_multiple_of(4));
        self.queue.submit([encoder.finish()]);
        readback.read(self, bytes)
    }
}
