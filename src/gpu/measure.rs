//! Reference measurements on the open device, for benchmarks to report
//! their figures as ratios measured in the same run.

use std::time::{Duration, Instant};

use super::{Gpu, Readback};
use crate::error::Result;

impl Gpu {
    /// Device-to-device copy bandwidth in bytes per second, counting the
    /// read and the write (as memory-bound kernels count their traffic):
    /// `reps` copies of a `bytes` buffer in one submission, best of 3.
    pub fn copy_bandwidth(&self, bytes: u64, reps: u32) -> Result<f64> {
        let bytes = bytes.min(self.caps.max_buffer_size).next_multiple_of(4);
        let make = |label| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let (a, b) = (make("copy.a"), make("copy.b"));
        let run = |n: u32| -> Result<Duration> {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            for i in 0..n {
                let (src, dst) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
                encoder.copy_buffer_to_buffer(src, 0, dst, 0, bytes);
            }
            let start = Instant::now();
            self.queue.submit([encoder.finish()]);
            self.wait()?;
            Ok(start.elapsed())
        };
        run(1)?;
        let best = (0..3)
            .map(|_| run(reps))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .min()
            .unwrap();
        self.check("measuring copy bandwidth")?;
        Ok(2.0 * bytes as f64 * reps as f64 / best.as_secs_f64())
    }

    /// One submission of a 4-byte copy, mapped and read on the host: the
    /// fixed cost of every routing readback. Median of `reps`.
    pub fn readback_round_trip(&self, reps: usize) -> Result<Duration> {
        let src = self.storage_buffer("round_trip.src", 1)?;
        let readback = Readback::new(self, "round_trip.readback", 4);
        let mut times: Vec<Duration> = (0..reps.max(1))
            .map(|_| {
                let start = Instant::now();
                let mut encoder = self.device.create_command_encoder(&Default::default());
                readback.record(&mut encoder, &src, 0, 4);
                self.queue.submit([encoder.finish()]);
                readback.read::<u32>(self, 4)?;
                Ok(start.elapsed())
            })
            .collect::<Result<_>>()?;
        times.sort();
        Ok(times[times.len() / 2])
    }
}
