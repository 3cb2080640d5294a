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
        let queries = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("time_pass"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolved = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("time_pass.resolved"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = Readback::new(self, "time_pass.readback", 16);
        let period = self.queue.get_timestamp_period() as f64;
        let run = |n: u32| -> Result<Duration> {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("time_pass"),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &queries,
                        beginning_of_pass_write_index: Some(0),
                        end_of_pass_write_index: Some(1),
                    }),
                });
                for i in 0..n {
                    record(&mut pass, i);
                }
            }
            encoder.resolve_query_set(&queries, 0..2, &resolved, 0);
            readback.record(&mut encoder, &resolved, 0, 16);
            self.queue.submit([encoder.finish()]);
            let ticks: Vec<u64> = readback.read(self, 16)?;
            Ok(Duration::from_nanos((ticks[1].saturating_sub(ticks[0]) as f64 * period) as u64))
        };
        run(1)?;
        let times = (0..3).map(|_| run(reps)).collect::<Result<Vec<_>>>()?;
        Ok(times.into_iter().min().unwrap())
    }

    /// Each of `dispatches` (with the tokens it is encoded for) in a
    /// compute pass of its own, in order, in one submission: each one's
    /// label and GPU time between its pass's timestamps (which include its
    /// launch). Needs timestamps ([`super::Caps::timestamps`]).
    pub fn time_each(&self, dispatches: &[(super::Dispatch, u32)]) -> Result<Vec<(&'static str, Duration)>> {
        if !self.caps.timestamps {
            return Err(crate::Error::Unsupported {
                what: "timing each dispatch without GPU timestamps",
                value: self.info.name.clone(),
            });
        }
        let count = 2 * dispatches.len() as u32;
        if count > wgpu::QUERY_SET_MAX_QUERIES {
            return Err(crate::Error::Unsupported {
                what: "timing more dispatches each than a query set holds",
                value: dispatches.len().to_string(),
            });
        }
        let queries = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("time_each"),
            ty: wgpu::QueryType::Timestamp,
            count,
        });
        let bytes = count as u64 * 8;
        let resolved = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("time_each.resolved"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = Readback::new(self, "time_each.readback", bytes);
        let mut encoder = self.device.create_command_encoder(&Default::default());
        for (i, (d, tokens)) in dispatches.iter().enumerate() {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.label),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &queries,
                    beginning_of_pass_write_index: Some(2 * i as u32),
                    end_of_pass_write_index: Some(2 * i as u32 + 1),
                }),
            });
            d.encode(&mut pass, *tokens);
        }
        encoder.resolve_query_set(&queries, 0..count, &resolved, 0);
        readback.record(&mut encoder, &resolved, 0, bytes);
        self.queue.submit([encoder.finish()]);
        let ticks: Vec<u64> = readback.read(self, bytes)?;
        let period = self.queue.get_timestamp_period() as f64;
        Ok(dispatches
            .iter()
            .zip(ticks.chunks_exact(2))
            .map(|((d, _), t)| {
                (d.label, Duration::from_nanos((t[1].saturating_sub(t[0]) as f64 * period) as u64))
            })
            .collect())
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
