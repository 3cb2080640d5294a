//! Reference measurements on the open device (timed passes and copies,
//! upload and readback costs), for benchmarks to report their figures as
//! ratios measured in the same run.

use std::time::{Duration, Instant};

use super::{Gpu, Readback};
use crate::error::Result;

impl Gpu {
    /// Best of 3 submissions of `reps` recorded copies.
    pub(crate) fn time_copies(
        &self,
        reps: u32,
        record: impl Fn(&mut wgpu::CommandEncoder, u32),
    ) -> Result<Duration> {
        let run = |n: u32| -> Result<Duration> {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            for i in 0..n {
                record(&mut encoder, i);
            }
            let start = Instant::now();
            self.queue.submit([encoder.finish()]);
            self.wait()?;
            Ok(start.elapsed())
        };
        run(1)?;
        let times = (0..3).map(|_| run(reps)).collect::<Result<Vec<_>>>()?;
        Ok(times.into_iter().min().unwrap())
    }

    /// Best of 3 compute passes of `reps` recorded dispatches: GPU time
    /// between the pass's timestamps where the adapter has them (no
    /// submission or wake-up latency), else wall clock.
    pub fn time_pass(&self, reps: u32, record: impl Fn(&mut wgpu::ComputePass<'_>, u32)) -> Result<Duration> {
        if !self.caps.timestamps {
            return self.time_copies(reps, |encoder, i| {
                record(&mut encoder.begin_compute_pass(&Default::default()), i)
            });
        }
        let timestamps = PassTimestamps::new(self, "time_pass", 1)?;
        let run = |n: u32| -> Result<Duration> {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("time_pass"),
                    timestamp_writes: Some(timestamps.writes(0)),
                });
                for i in 0..n {
                    record(&mut pass, i);
                }
            }
            timestamps.record(&mut encoder, 1);
            self.queue.submit([encoder.finish()]);
            Ok(timestamps.read(self, 1)?[0])
        };
        run(1)?;
        let times = (0..3).map(|_| run(reps)).collect::<Result<Vec<_>>>()?;
        Ok(times.into_iter().min().unwrap())
    }

    /// Each of `dispatches` (with the tokens it is encoded for) in a
    /// compute pass of its own, in order, in one submission: each one's
    /// label and GPU time between its pass's timestamps (which include its
    /// launch). Needs timestamps ([`super::Caps::timestamps`]).
    #[cfg(feature = "internals")]
    pub fn time_each(&self, dispatches: &[(super::Dispatch, u32)]) -> Result<Vec<(&'static str, Duration)>> {
        if !self.caps.timestamps {
            return Err(crate::Error::Unsupported {
                what: "timing each dispatch without GPU timestamps",
                value: self.info.name.clone(),
            });
        }
        if dispatches.is_empty() {
            return Ok(Vec::new());
        }
        let timestamps = PassTimestamps::new(self, "time_each", dispatches.len())?;
        let mut encoder = self.device.create_command_encoder(&Default::default());
        for (i, (d, tokens)) in dispatches.iter().enumerate() {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.label),
                timestamp_writes: Some(timestamps.writes(i as u32)),
            });
            d.encode(&mut pass, *tokens);
        }
        let passes = dispatches.len() as u32;
        timestamps.record(&mut encoder, passes);
        self.queue.submit([encoder.finish()]);
        let times = timestamps.read(self, passes)?;
        Ok(dispatches.iter().map(|(d, _)| d.label).zip(times).collect())
    }

    /// Host-to-device bandwidth in bytes per second: `bytes` (a multiple of
    /// 4) of host memory written into a device buffer through the queue
    /// and waited for, best of 3 (the reference for expert uploads).
    pub fn upload_bandwidth(&self, bytes: u64) -> Result<f64> {
        let dst = self.storage_buffer_bytes("upload.dst", bytes)?;
        let host = vec![0x5au8; bytes as usize];
        let mut best = Duration::MAX;
        for _ in 0..4 {
            let start = Instant::now();
            self.queue.write_buffer(&dst, 0, &host);
            self.queue.submit([]);
            self.wait()?;
            best = best.min(start.elapsed());
        }
        self.check("measuring upload bandwidth")?;
        Ok(bytes as f64 / best.as_secs_f64())
    }

    /// One submission of a `bytes`-byte copy (a multiple of 4), mapped
    /// and read on the host, waited for as routing readbacks are (spinning).
    /// With 4 bytes: the fixed cost of every routing readback; with a
    /// vocabulary of logits: what a decode step pays to bring them back.
    /// Median of `reps`.
    pub fn readback_round_trip(&self, bytes: u64, reps: usize) -> Result<Duration> {
        let src = self.storage_buffer_bytes("round_trip.src", bytes)?;
        let readback = Readback::new(self, "round_trip.readback", bytes);
        let mut times: Vec<Duration> = (0..reps.max(1))
            .map(|_| {
                let start = Instant::now();
                let mut encoder = self.device.create_command_encoder(&Default::default());
                readback.record(&mut encoder, &src, 0, bytes);
                self.queue.submit([encoder.finish()]);
                readback.start_map(bytes);
                readback.finish_map(self, super::MapWait::Spin, |_| ())?;
                Ok(start.elapsed())
            })
            .collect::<Result<_>>()?;
        times.sort();
        Ok(times[times.len() / 2])
    }
}

/// Timestamps at the beginning and end of each of up to `capacity` compute
/// passes of a submission, resolved and read back as each pass's GPU time.
pub(crate) struct PassTimestamps {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    readback: Readback,
    capacity: u32,
    period_ns: f64,
}

impl PassTimestamps {
    /// Room for `passes` passes: at least one, and at most half the
    /// queries a query set holds. The adapter must have timestamps.
    pub(crate) fn new(gpu: &Gpu, label: &str, passes: usize) -> Result<Self> {
        let capacity = u32::try_from(passes)
            .ok()
            .filter(|n| (1..=wgpu::QUERY_SET_MAX_QUERIES / 2).contains(n))
            .ok_or_else(|| crate::Error::Unsupported {
                what: "timing this many passes in one submission",
                value: passes.to_string(),
            })?;
        let bytes = 16 * capacity as u64;
        Ok(PassTimestamps {
            queries: gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some(label),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * capacity,
            }),
            resolved: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(&format!("{label}.resolved")),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            readback: Readback::new(gpu, &format!("{label}.readback"), bytes),
            capacity,
            period_ns: gpu.queue.get_timestamp_period() as f64,
        })
    }

    /// Passes it has room for.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// The writes that time pass `i` (below the capacity).
    pub(crate) fn writes(&self, i: u32) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        }
    }

    /// Records the resolve of the first `passes` passes' timestamps and
    /// their copy to the host.
    pub(crate) fn record(&self, encoder: &mut wgpu::CommandEncoder, passes: u32) {
        encoder.resolve_query_set(&self.queries, 0..2 * passes, &self.resolved, 0);
        self.readback.record(encoder, &self.resolved, 0, 16 * passes as u64);
    }

    /// After the submission [`Self::record`] was recorded in: each of the
    /// first `passes` passes' GPU time.
    pub(crate) fn read(&self, gpu: &Gpu, passes: u32) -> Result<Vec<Duration>> {
        let ticks: Vec<u64> = self.readback.read(gpu, 16 * passes as u64)?;
        Ok(ticks
            .chunks_exact(2)
            .map(|t| Duration::from_nanos((t[1].saturating_sub(t[0]) as f64 * self.period_ns) as u64))
            .collect())
    }
}
