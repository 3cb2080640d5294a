//! Host-to-device uploads through a fixed ring of mapped staging buffers:
//! the host fills a buffer while it is mapped, a copy command moves it to
//! its destination, and the buffer is mapped again once the GPU has run
//! the copy. The footprint is the ring, whatever is uploaded: no staging
//! memory is allocated per upload.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Gpu;
use crate::error::Result;

#[derive(Debug)]
struct Slot {
    buffer: wgpu::Buffer,
    /// Mapped: free to fill (after its copy ran on the GPU).
    mapped: Arc<AtomicBool>,
}

#[derive(Debug)]
pub struct UploadRing {
    slots: Vec<Slot>,
    next: usize,
}

impl UploadRing {
    /// `count` staging buffers of `bytes` each (the largest single upload).
    pub fn new(gpu: &Gpu, count: usize, bytes: u64) -> Self {
        let slots = (0..count.max(1))
            .map(|i| Slot {
                buffer: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(&format!("upload ring {i}")),
                    size: bytes.max(4).next_multiple_of(4),
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                }),
                mapped: Arc::new(AtomicBool::new(true)),
            })
            .collect();
        UploadRing { slots, next: 0 }
    }

    /// Host memory the ring holds.
    pub fn bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.buffer.size()).sum()
    }

    /// Copies `pieces`, one after the other, to `dst` at `offset` (their
    /// total and the offset multiples of 4, the total at most the ring's
    /// buffer size), submitted at once: the bus carries it while the next
    /// one is filled, and it runs before anything submitted after it.
    pub fn upload(&mut self, gpu: &Gpu, dst: &wgpu::Buffer, offset: u64, pieces: &[&[u8]]) -> Result<()> {
        let len: usize = pieces.iter().map(|p| p.len()).sum();
        let slot = &self.slots[self.next];
        self.next = (self.next + 1) % self.slots.len();
        while !slot.mapped.load(Ordering::Acquire) {
            gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| gpu.poll_error(e))?;
            gpu.alive()?;
        }
        fill_in_parallel(&slot.buffer, pieces)?;
        slot.buffer.unmap();
        slot.mapped.store(false, Ordering::Release);
        let mut encoder = gpu.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(&slot.buffer, 0, dst, offset, len as u64);
        gpu.queue.submit([encoder.finish()]);
        let mapped = slot.mapped.clone();
        slot.buffer.map_async(wgpu::MapMode::Write, .., move |r| mapped.store(r.is_ok(), Ordering::Release));
        gpu.check("uploading experts")
    }
}

/// Bytes one thread fills: one core's copy into mapped (often
/// write-combined) memory runs well below the bus, and a thread costs a
/// spawn.
const BYTES_PER_FILL_THREAD: usize = 1 << 20;

/// Writes `pieces` one after the other into `buffer` (mapped), by up to 8
/// threads, each through its own view of a run of whole pieces (views
/// start on the 8-byte boundaries mapping needs).
fn fill_in_parallel(buffer: &wgpu::Buffer, pieces: &[&[u8]]) -> Result<()> {
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    let share = total.div_ceil(total.div_ceil(BYTES_PER_FILL_THREAD).clamp(1, cores));
    let mut runs = Vec::new();
    let (mut first, mut at, mut start) = (0, 0, 0);
    for (i, piece) in pieces.iter().enumerate() {
        at += piece.len();
        if at - start >= share && at % wgpu::MAP_ALIGNMENT as usize == 0 || i + 1 == pieces.len() {
            runs.push((start, at, &pieces[first..=i]));
            (first, start) = (i + 1, at);
        }
    }
    let copy = |(start, end, run): (usize, usize, &[&[u8]])| -> Result<()> {
        let mut view = buffer
            .slice(start as u64..end as u64)
            .get_mapped_range_mut()
            .map_err(|e| crate::Error::Gpu(format!("upload staging: {e}")))?;
        let mut at = 0;
        for piece in run {
            view.slice(at..at + piece.len()).copy_from_slice(piece);
            at += piece.len();
        }
        Ok(())
    };
    if runs.len() == 1 {
        return copy(runs[0]);
    }
    std::thread::scope(|scope| {
        let copies: Vec<_> = runs.into_iter().map(|run| scope.spawn(move || copy(run))).collect();
        copies.into_iter().try_for_each(|c| c.join().expect("a staging copy does not panic"))
    })
}
