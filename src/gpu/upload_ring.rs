//! Host-to-device uploads through a fixed ring of mapped staging buffers:
//! the host fills buffers while they are mapped, copy commands move them to
//! their destinations, and each buffer is mapped again once the GPU has run
//! its copy. The footprint is the ring, whatever is uploaded: no staging
//! memory is allocated per upload.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::Gpu;
use crate::error::Result;

#[derive(Debug)]
struct Slot {
    buffer: wgpu::Buffer,
    /// Mapped: free to fill (after its copy ran on the GPU).
    mapped: Arc<AtomicBool>,
}

/// One upload: `pieces`, one after the other, to `dst` at `offset` (their
/// total and the offset multiples of 4, the total at most the ring's
/// buffer size).
pub struct Upload<'a> {
    pub dst: &'a wgpu::Buffer,
    pub offset: u64,
    pub pieces: Vec<&'a [u8]>,
}

impl Upload<'_> {
    fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.len()).sum()
    }
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
    #[cfg(feature = "internals")]
    pub fn bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.buffer.size()).sum()
    }

    /// Uploads one [`Self::upload`] call runs together.
    pub fn uploads_at_once(&self) -> usize {
        self.slots.len()
    }

    /// Runs `uploads`, as many at a time as the ring has buffers: their
    /// buffers are filled together (the copying spread over the host's
    /// cores), and their copies go in one submission, which runs before
    /// anything submitted after this returns.
    pub fn upload(&mut self, gpu: &Gpu, uploads: &[Upload<'_>]) -> Result<()> {
        let uploads: Vec<&Upload<'_>> = uploads.iter().filter(|u| u.len() > 0).collect();
        for batch in uploads.chunks(self.slots.len()) {
            let first = self.next;
            self.next = (self.next + batch.len()) % self.slots.len();
            let slots: Vec<&Slot> =
                (0..batch.len()).map(|i| &self.slots[(first + i) % self.slots.len()]).collect();
            for slot in &slots {
                while !slot.mapped.load(Ordering::Acquire) {
                    gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| gpu.poll_error(e))?;
                    gpu.alive()?;
                }
            }
            let runs: Vec<Run<'_>> = batch
                .iter()
                .zip(&slots)
                .flat_map(|(upload, slot)| runs(&slot.buffer, &upload.pieces))
                .collect();
            runs.into_par_iter().try_for_each(Run::copy)?;
            let mut encoder = gpu.device.create_command_encoder(&Default::default());
            for (upload, slot) in batch.iter().zip(&slots) {
                slot.buffer.unmap();
                slot.mapped.store(false, Ordering::Release);
                encoder.copy_buffer_to_buffer(
                    &slot.buffer,
                    0,
                    upload.dst,
                    upload.offset,
                    upload.len() as u64,
                );
            }
            gpu.queue.submit([encoder.finish()]);
            for slot in slots {
                let mapped = slot.mapped.clone();
                slot.buffer
                    .map_async(wgpu::MapMode::Write, .., move |r| mapped.store(r.is_ok(), Ordering::Release));
            }
            gpu.check("uploading experts")?;
        }
        Ok(())
    }
}

/// Bytes one fill task copies at least: one core's copy into mapped (often
/// write-combined) memory runs well below the bus.
const BYTES_PER_FILL_TASK: usize = 1 << 20;

/// A run of whole pieces and where it goes in a mapped staging buffer.
struct Run<'a> {
    buffer: &'a wgpu::Buffer,
    start: usize,
    end: usize,
    pieces: &'a [&'a [u8]],
}

impl Run<'_> {
    fn copy(self) -> Result<()> {
        let mut view = self
            .buffer
            .slice(self.start as u64..self.end as u64)
            .get_mapped_range_mut()
            .map_err(|e| crate::Error::Gpu(format!("upload staging: {e}")))?;
        let mut at = 0;
        for piece in self.pieces {
            view.slice(at..at + piece.len()).copy_from_slice(piece);
            at += piece.len();
        }
        Ok(())
    }
}

/// `pieces` (laid out one after the other in `buffer`) cut into runs of
/// about [`BYTES_PER_FILL_TASK`], each starting on the 8-byte boundary a
/// mapped view needs.
fn runs<'a>(buffer: &'a wgpu::Buffer, pieces: &'a [&'a [u8]]) -> Vec<Run<'a>> {
    let mut out = Vec::new();
    let (mut first, mut at, mut start) = (0, 0, 0);
    for (i, piece) in pieces.iter().enumerate() {
        at += piece.len();
        if at - start >= BYTES_PER_FILL_TASK && at % wgpu::MAP_ALIGNMENT as usize == 0
            || i + 1 == pieces.len()
        {
            out.push(Run { buffer, start, end: at, pieces: &pieces[first..=i] });
            (first, start) = (i + 1, at);
        }
    }
    out
}
