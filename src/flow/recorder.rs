//! Recording a forward pass into command encoders: one compute pass per
//! phase, a new submission wherever the host must read something back, and
//! the phase timing (GPU timestamps or wall clock) when it is asked for.
//!
//! A routing readback (one token) does not stall recording: the submission
//! ends with the copy of the router's choice, its map starts, and the host
//! goes on recording the work after it (which reads the choice on the GPU)
//! while the GPU runs; the map is waited for just before the next
//! submission, so the host still knows each choice before the work that
//! follows it runs.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu, MapWait, PassTimestamps, Readback};
use crate::stats::{Phase, PhaseTimes, Stats, TimingSource};

/// A routing readback whose map is in flight.
struct PendingRouting<'a> {
    readback: &'a Readback,
    layer: usize,
    bytes: u64,
    experts: usize,
    /// Bytes of a predicted choice read back after the choice.
    predicted_bytes: u64,
}

/// Records into the current encoder, in one compute pass per phase.
pub struct Recorder<'a> {
    gpu: &'a Gpu,
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    /// The phase of the work recorded last.
    phase: Option<Phase>,
    timer: Option<&'a mut PhaseTimer>,
    stats: &'a mut Stats,
    routing: Option<PendingRouting<'a>>,
    dispatches: u64,
    /// The label of the next pass (a dispatch timed alone), else its phase's.
    label: Option<&'static str>,
}

impl<'a> Recorder<'a> {
    pub fn new(gpu: &'a Gpu, timer: Option<&'a mut PhaseTimer>, stats: &'a mut Stats) -> Self {
        Recorder {
            gpu,
            encoder: None,
            pass: None,
            phase: None,
            timer,
            stats,
            routing: None,
            dispatches: 0,
            label: None,
        }
    }

    pub fn gpu(&self) -> &'a Gpu {
        self.gpu
    }

    /// Dispatches recorded so far.
    pub fn dispatches(&self) -> u64 {
        self.dispatches
    }

    /// Encodes `dispatches` for `n_tokens` tokens in the pass of `phase`
    /// (each in a pass of its own when the timer times dispatches).
    pub fn encode(&mut self, phase: Phase, dispatches: &[Dispatch], n_tokens: u32) {
        let alone = self.timer.as_ref().is_some_and(|t| t.per_dispatch);
        for d in dispatches {
            if alone {
                self.end_pass();
                self.label = Some(d.label);
            }
            d.encode(self.pass(phase), n_tokens);
        }
        if alone {
            self.end_pass();
        }
        self.dispatches += dispatches.len() as u64;
    }

    /// Counts dispatches a caller encoded into [`Self::pass`] itself.
    pub fn count(&mut self, dispatches: u32) {
        self.dispatches += dispatches as u64;
    }

    /// The compute pass of `phase`, ending the current one if it belongs
    /// to another phase.
    pub fn pass(&mut self, phase: Phase) -> &mut wgpu::ComputePass<'static> {
        if self.phase != Some(phase) {
            self.end_pass();
            if let (Some(timer), Some(_)) = (self.timer.as_deref_mut(), self.phase) {
                timer.phase_boundary(self.gpu, &mut self.encoder);
            }
            self.phase = Some(phase);
        }
        if self.pass.is_none() {
            let gpu = self.gpu;
            let encoder = self.encoder.get_or_insert_with(|| {
                gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("forward") })
            });
            let label = self.label.take().unwrap_or(phase.name());
            let timestamp_writes = self.timer.as_deref_mut().and_then(|t| t.pass_writes(phase, label));
            let pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(label), timestamp_writes })
                .forget_lifetime();
            if let Some(timer) = self.timer.as_deref_mut() {
                timer.phase_started(phase);
            }
            self.pass = Some(pass);
        }
        self.pass.as_mut().unwrap()
    }

    fn end_pass(&mut self) {
        self.pass = None;
    }

    /// The encoder, outside any pass (for copies).
    pub fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        self.end_pass();
        let gpu = self.gpu;
        self.encoder.get_or_insert_with(|| gpu.device.create_command_encoder(&Default::default()))
    }

    /// Submits what was recorded, once the routing readback in flight (if
    /// any) has been read.
    pub fn submit(&mut self) -> Result<Option<wgpu::SubmissionIndex>> {
        self.end_pass();
        let commands = self.encoder.take().map(|encoder| encoder.finish());
        self.finish_routing()?;
        let start = Instant::now();
        let index = commands.map(|c| self.gpu.queue.submit([c]));
        self.stats.submit_time += start.elapsed();
        self.gpu.check("running the layer flow")?;
        Ok(index)
    }

    /// Ends the submission with the copy of `bytes` of a MoE layer's
    /// router choice (`ids`) into `readback`, submits it and starts the
    /// map; recording goes on while it runs. Its ids reach the stats
    /// before the next submission.
    pub fn submit_routing(
        &mut self,
        readback: &'a Readback,
        ids: &wgpu::Buffer,
        bytes: u64,
        layer: usize,
        experts: usize,
    ) -> Result<()> {
        readback.record(self.encoder(), ids, 0, bytes);
        self.submit()?;
        readback.start_map(bytes);
        self.routing = Some(PendingRouting { readback, layer, bytes, experts, predicted_bytes: 0 });
        self.stats.routing_readbacks += 1;
        Ok(())
    }

    /// As [`Self::submit_routing`], and waits for the ids: a prompt chunk
    /// needs them to group its tokens by expert.
    pub fn submit_routing_and_wait(
        &mut self,
        readback: &'a Readback,
        ids: &wgpu::Buffer,
        bytes: u64,
        layer: usize,
        experts: usize,
    ) -> Result<Vec<u32>> {
        self.submit_routing(readback, ids, bytes, layer, experts)?;
        Ok(self.finish_routing()?.expect("a routing readback is in flight"))
    }

    /// As [`Self::submit_routing_and_wait`], with a guess at the next
    /// layer's choice (`predicted`, `bytes` long) read back in the same
    /// copy and returned beside the choice, as the top-k kernel wrote it.
    pub fn submit_routing_and_wait_with_prediction(
        &mut self,
        readback: &'a Readback,
        (ids, predicted): (&wgpu::Buffer, &wgpu::Buffer),
        bytes: u64,
        layer: usize,
        experts: usize,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        readback.record(self.encoder(), ids, 0, bytes);
        readback.record_at(self.encoder(), predicted, 0, bytes, bytes);
        self.submit()?;
        readback.start_map(2 * bytes);
        self.routing = Some(PendingRouting { readback, layer, bytes, experts, predicted_bytes: bytes });
        self.stats.routing_readbacks += 1;
        let mut ids = self.finish_routing()?.expect("a routing readback is in flight");
        let predicted = ids.split_off((bytes / 4) as usize);
        Ok((ids, predicted))
    }

    /// Waits for the routing readback in flight, counts its choices in the
    /// router histogram and returns them (followed by the predicted choice
    /// where one was read back).
    fn finish_routing(&mut self) -> Result<Option<Vec<u32>>> {
        let Some(r) = self.routing.take() else { return Ok(None) };
        let start = Instant::now();
        let mut ids: Vec<u32> =
            r.readback.finish_map(self.gpu, MapWait::Spin, bytemuck::pod_collect_to_vec)?;
        self.stats.routing_wait += start.elapsed();
        ids.truncate(((r.bytes + r.predicted_bytes) / 4) as usize);
        let predicted = ids.split_off((r.bytes / 4) as usize);
        // The top-k kernel answers NaN scores with an id past the experts.
        if ids.iter().any(|&e| e as usize >= r.experts) {
            return Err(Error::NonFiniteRouting { layer: r.layer });
        }
        let histogram = &mut self.stats.router_histogram[r.layer];
        histogram.resize(r.experts, 0);
        for &e in &ids {
            histogram[e as usize] += 1;
        }
        ids.extend(predicted);
        Ok(Some(ids))
    }

    pub fn stats(&mut self) -> &mut Stats {
        self.stats
    }

    /// Ends the forward pass: resolves GPU timestamps into the timer's
    /// readback (before the final submission) or closes the last wall-clock
    /// phase (after it, by waiting). Returns the final submission.
    pub fn finish(mut self) -> Result<wgpu::SubmissionIndex> {
        self.end_pass();
        let gpu = self.gpu;
        let encoder =
            self.encoder.get_or_insert_with(|| gpu.device.create_command_encoder(&Default::default()));
        if let Some(timer) = self.timer.as_deref_mut() {
            timer.before_final_submit(encoder);
        }
        let index = self.submit()?.expect("the encoder was created above");
        if let Some(timer) = self.timer.take() {
            timer.after_final_submit(self.gpu)?;
        }
        Ok(index)
    }
}

/// Accumulates per-phase time over forward passes; with `per_dispatch`
/// (GPU timestamps only) every dispatch runs in a pass of its own, and the
/// last forward pass's passes are kept in order, by label.
pub struct PhaseTimer {
    pub totals: PhaseTimes,
    pub source: TimingSource,
    pub per_dispatch: bool,
    /// The last forward pass: each pass's label and GPU time, in order.
    pub last_passes: Vec<(&'static str, Duration)>,
    gpu: Option<GpuTimestamps>,
    /// Wall clock: the phase running since when.
    current: Option<(Phase, Instant)>,
}

struct GpuTimestamps {
    stamps: PassTimestamps,
    /// The phase and label of each pass, in timing order, this forward pass.
    passes: Vec<(Phase, &'static str)>,
}

impl PhaseTimer {
    /// GPU timestamps where the adapter has them, else wall clock; room
    /// for `max_passes` passes per forward pass (dispatches, when timed
    /// alone, which needs timestamps), at most half a query set's queries.
    pub fn new(gpu: &Gpu, max_passes: usize, per_dispatch: bool) -> Self {
        let room = max_passes.clamp(1, wgpu::QUERY_SET_MAX_QUERIES as usize / 2);
        let gpu_timestamps = gpu
            .caps
            .timestamps
            .then(|| PassTimestamps::new(gpu, "phase timestamps", room).ok())
            .flatten()
            .map(|stamps| GpuTimestamps { stamps, passes: Vec::new() });
        PhaseTimer {
            per_dispatch: per_dispatch && gpu_timestamps.is_some(),
            last_passes: Vec::new(),
            totals: PhaseTimes::default(),
            source: if gpu_timestamps.is_some() {
                TimingSource::GpuTimestamps
            } else {
                TimingSource::WallClock
            },
            gpu: gpu_timestamps,
            current: None,
        }
    }

    fn pass_writes(
        &mut self,
        phase: Phase,
        label: &'static str,
    ) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        let ts = self.gpu.as_mut()?;
        let index = ts.passes.len() as u32;
        if index >= ts.stamps.capacity() {
            return None;
        }
        ts.passes.push((phase, label));
        Some(ts.stamps.writes(index))
    }

    fn phase_started(&mut self, phase: Phase) {
        if self.gpu.is_none() && self.current.is_none() {
            self.current = Some((phase, Instant::now()));
        }
    }

    /// Wall clock only: the work of the phase that just ended is submitted
    /// and waited for, so its time is its own.
    fn phase_boundary(&mut self, gpu: &Gpu, encoder: &mut Option<wgpu::CommandEncoder>) {
        if self.gpu.is_some() {
            return;
        }
        if let Some(e) = encoder.take() {
            gpu.queue.submit([e.finish()]);
        }
        let _ = gpu.wait();
        self.close_wall_phase();
    }

    fn close_wall_phase(&mut self) {
        if let Some((phase, start)) = self.current.take() {
            self.totals.add(phase, start.elapsed());
        }
    }

    fn before_final_submit(&mut self, encoder: &mut wgpu::CommandEncoder) {
        if let Some(ts) = self.gpu.as_ref().filter(|ts| !ts.passes.is_empty()) {
            ts.stamps.record(encoder, ts.passes.len() as u32);
        }
    }

    fn after_final_submit(&mut self, gpu: &Gpu) -> Result<()> {
        match &mut self.gpu {
            Some(ts) => {
                if !ts.passes.is_empty() {
                    let times = ts.stamps.read(gpu, ts.passes.len() as u32)?;
                    self.last_passes.clear();
                    for ((phase, label), time) in ts.passes.drain(..).zip(times) {
                        self.totals.add(phase, time);
                        self.last_passes.push((label, time));
                    }
                }
            }
            None => {
                gpu.wait()?;
                self.close_wall_phase();
            }
        }
        Ok(())
    }
}
