//! Expert streaming: the routed experts of a MoE model that does not fit
//! the GPU stay in host memory (the memory-mapped checkpoint, in its
//! stored format) and are copied on demand into a fixed pool of GPU slots
//! per MoE layer. Everything else is resident. The routing readback tells
//! the host which experts the next dispatch needs: those in a slot are
//! hits; the others are uploaded (through [`UploadRing`]) into the least
//! recently used slots the dispatch does not need, and the expert kernels
//! read slot numbers where they would read expert numbers.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::MoeConfig;
use super::weights::TensorSource;
use crate::error::{Error, Result};
use crate::format::WeightFormat;
use crate::gpu::{Gpu, GpuTensor, UploadRing};

/// How the expert cache served a session (or, from [`ExpertStreaming::totals`],
/// the model): experts a dispatch found in a slot, experts it had to wait
/// for, and what their uploads took.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_uploaded: u64,
    /// Host time from the first upload of a dispatch's misses to their
    /// submission (reading the checkpoint, filling the staging ring,
    /// waiting for a staging buffer to come back).
    pub upload_time: Duration,
}

impl ExpertCacheStats {
    pub fn add(&mut self, other: &ExpertCacheStats) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.bytes_uploaded += other.bytes_uploaded;
        self.upload_time += other.upload_time;
    }
}

/// Where a MoE layer's experts are in the checkpoint.
#[derive(Debug, Clone)]
pub enum ExpertTensors {
    /// One gate, up and down tensor per expert.
    PerExpert { gate: Vec<String>, up: Vec<String>, down: Vec<String> },
    /// transformers 5's `gate_up_proj` `[E, 2I, H]` (gate rows, then up
    /// rows) and `down_proj` `[E, H, I]`.
    Fused { gate_up: String, down: String },
}

impl ExpertTensors {
    /// Expert `x`'s gate and up rows, and its down rows, in the file layout
    /// of their formats.
    fn read<'s>(
        &self,
        source: &'s dyn TensorSource,
        x: usize,
        (e, h, i): (usize, usize, usize),
    ) -> Result<[Cow<'s, [u8]>; 3]> {
        Ok(match self {
            ExpertTensors::PerExpert { gate, up, down } => [
                source.stored_bytes(&gate[x], &[i, h])?,
                source.stored_bytes(&up[x], &[i, h])?,
                source.stored_bytes(&down[x], &[h, i])?,
            ],
            ExpertTensors::Fused { gate_up, down } => [
                source.stored_rows(gate_up, &[e, 2 * i, h], 2 * i * x..2 * i * x + i)?,
                source.stored_rows(gate_up, &[e, 2 * i, h], 2 * i * x + i..2 * i * (x + 1))?,
                source.stored_rows(down, &[e, h, i], h * x..h * (x + 1))?,
            ],
        })
    }
}

/// One streamed layer: where its experts come from and their formats.
#[derive(Debug)]
pub struct StreamedLayer {
    pub tensors: ExpertTensors,
    pub gate_up_format: WeightFormat,
    pub down_format: WeightFormat,
}

impl StreamedLayer {
    /// GPU bytes of one expert: its gate and up rows and its down rows.
    pub fn expert_bytes(&self, hidden: usize, intermediate: usize) -> u64 {
        (2 * intermediate * self.gate_up_format.gpu_row_bytes(hidden)
            + hidden * self.down_format.gpu_row_bytes(intermediate)) as u64
    }
}

/// The slots of one layer: which expert each holds and when it was last
/// needed.
#[derive(Debug)]
struct LayerSlots {
    expert: Vec<Option<usize>>,
    last_used: Vec<u64>,
}

#[derive(Debug)]
struct Cache {
    layers: Vec<LayerSlots>,
    ring: UploadRing,
    clock: u64,
    totals: ExpertCacheStats,
}

/// A model's streamed experts and its GPU slots.
pub struct ExpertStreaming {
    source: Arc<dyn TensorSource + Send + Sync>,
    /// GPU slots per MoE layer (at least top-k, fewer than the experts).
    pub slots: usize,
    experts: usize,
    dims: (usize, usize),
    /// Per layer; `None` for dense layers.
    layers: Vec<Option<StreamedLayer>>,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for ExpertStreaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStreaming").field("slots", &self.slots).field("experts", &self.experts).finish()
    }
}

impl ExpertStreaming {
    /// Streaming over `slots` GPU slots per MoE layer, slot `s` holding
    /// expert `s` at first (the loader fills them so).
    pub fn new(
        gpu: &Gpu,
        source: Arc<dyn TensorSource + Send + Sync>,
        moe: &MoeConfig,
        (hidden, slots): (usize, usize),
        layers: Vec<Option<StreamedLayer>>,
    ) -> Self {
        let i = moe.intermediate;
        let largest = layers
            .iter()
            .flatten()
            .map(|l| {
                (2 * i * l.gate_up_format.gpu_row_bytes(hidden)).max(hidden * l.down_format.gpu_row_bytes(i))
            })
            .max()
            .unwrap_or(0);
        let slot_table = || LayerSlots { expert: (0..slots).map(Some).collect(), last_used: vec![0; slots] };
        let cache = Cache {
            layers: layers.iter().map(|_| slot_table()).collect(),
            // Two of each kind per slot of a dispatch: one dispatch's
            // misses are copied without waiting for the staging memory.
            ring: UploadRing::new(gpu, 2 * moe.top_k, largest as u64),
            clock: 0,
            totals: ExpertCacheStats::default(),
        };
        ExpertStreaming {
            source,
            slots,
            experts: moe.experts,
            dims: (hidden, i),
            layers,
            cache: Mutex::new(cache),
        }
    }

    /// Whether `layer`'s experts are streamed.
    pub fn streams(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(Option::is_some)
    }

    /// Everything the cache has served since the model was loaded.
    pub fn totals(&self) -> ExpertCacheStats {
        self.cache.lock().unwrap().totals
    }

    /// Host memory of the staging ring.
    pub fn staging_bytes(&self) -> u64 {
        self.cache.lock().unwrap().ring.bytes()
    }

    /// Fills slot `s` of every streamed layer with expert `s`, as the
    /// slot tables start.
    pub fn fill_slots(&self, gpu: &Gpu, weights: &super::Weights) -> Result<()> {
        let mut cache = self.cache.lock().unwrap();
        for (layer, streamed) in self.layers.iter().enumerate() {
            let (Some(streamed), super::FfnWeights::Moe(moe)) = (streamed, &weights.layers[layer].ffn) else {
                continue;
            };
            for slot in 0..self.slots {
                self.upload(gpu, &mut cache.ring, streamed, (&moe.gate_up, &moe.down), slot, slot)?;
            }
        }
        Ok(())
    }

    /// Puts `needed` (distinct experts of `layer`, at most [`Self::slots`])
    /// on the GPU: the missing ones are uploaded into the least recently
    /// used slots that `needed` does not occupy. Returns each one's slot;
    /// the uploads run before anything submitted after this returns.
    pub fn place(
        &self,
        gpu: &Gpu,
        gate_up: &GpuTensor,
        down: &GpuTensor,
        layer: usize,
        needed: &[usize],
        stats: &mut ExpertCacheStats,
    ) -> Result<Vec<u32>> {
        debug_assert!(needed.len() <= self.slots);
        let streamed = self.layers[layer].as_ref().expect("placing experts of a streamed layer");
        let mut guard = self.cache.lock().unwrap();
        let Cache { layers, ring, clock, totals } = &mut *guard;
        *clock += 1;
        let now = *clock;
        let table = &mut layers[layer];
        let mut slots: Vec<Option<usize>> =
            needed.iter().map(|&x| table.expert.iter().position(|&held| held == Some(x))).collect();
        let mut served = ExpertCacheStats::default();
        for s in slots.iter().flatten() {
            table.last_used[*s] = now;
        }
        served.hits = slots.iter().flatten().count() as u64;
        let start = Instant::now();
        for (k, &x) in needed.iter().enumerate() {
            if slots[k].is_some() {
                continue;
            }
            // Least recently used; slots placed for this dispatch were just
            // marked `now`, so they are never chosen.
            let victim = (0..self.slots).min_by_key(|&s| table.last_used[s]).expect("at least one slot");
            // Empty until the upload is recorded: a failed one leaves no
            // stale expert behind.
            table.expert[victim] = None;
            table.last_used[victim] = now;
            served.bytes_uploaded += self.upload(gpu, ring, streamed, (gate_up, down), x, victim)?;
            table.expert[victim] = Some(x);
            slots[k] = Some(victim);
            served.misses += 1;
        }
        if served.misses > 0 {
            served.upload_time = start.elapsed();
        }
        totals.add(&served);
        stats.add(&served);
        Ok(slots.into_iter().map(|s| s.expect("every needed expert has a slot") as u32).collect())
    }

    /// Copies expert `x` of a layer into `slot`: its gate and up rows
    /// interleaved, and its down rows. Returns the bytes copied.
    fn upload(
        &self,
        gpu: &Gpu,
        ring: &mut UploadRing,
        streamed: &StreamedLayer,
        (gate_up_slots, down_slots): (&GpuTensor, &GpuTensor),
        x: usize,
        slot: usize,
    ) -> Result<u64> {
        let (h, i) = self.dims;
        let [gate, up, down] = streamed.tensors.read(self.source.as_ref(), x, (self.experts, h, i))?;
        let (gate, up) =
            (streamed.gate_up_format.to_gpu_layout(&gate), streamed.gate_up_format.to_gpu_layout(&up));
        let down = streamed.down_format.to_gpu_layout(&down);
        let row = streamed.gate_up_format.gpu_row_bytes(h);
        let interleaved: Vec<&[u8]> =
            gate.chunks_exact(row).zip(up.chunks_exact(row)).flat_map(|(g, u)| [g, u]).collect();
        copy_rows(gpu, ring, gate_up_slots, slot * 2 * i, &interleaved)?;
        let down_rows: Vec<&[u8]> = down.chunks_exact(streamed.down_format.gpu_row_bytes(i)).collect();
        copy_rows(gpu, ring, down_slots, slot * h, &down_rows)?;
        Ok((gate.len() + up.len() + down.len()) as u64)
    }
}

/// Copies `rows` (each one row in the tensor's GPU layout) to `tensor` from
/// row `first` on, one ring upload per part they fall in.
fn copy_rows(
    gpu: &Gpu,
    ring: &mut UploadRing,
    tensor: &GpuTensor,
    first: usize,
    rows: &[&[u8]],
) -> Result<()> {
    let end = first + rows.len();
    for part in &tensor.parts {
        let (lo, hi) = (first.max(part.first_row), end.min(part.first_row + part.rows));
        if lo >= hi {
            continue;
        }
        let row_bytes = rows[0].len() as u64;
        let offset = (lo - part.first_row) as u64 * row_bytes;
        ring.upload(gpu, &part.buffer, offset, &rows[lo - first..hi - first])?;
    }
    Ok(())
}

/// GPU slots per MoE layer for a weight budget of `gpu_memory` bytes:
/// what is left after the `resident` bytes, shared by the MoE layers, one
/// slot holding one expert of each (`expert_bytes` summed over them).
/// Below top-k slots the budget is too small: the error states the
/// smallest that works.
pub fn slots_for_budget(gpu_memory: u64, resident: u64, expert_bytes: u64, moe: &MoeConfig) -> Result<usize> {
    let minimum = resident + moe.top_k as u64 * expert_bytes;
    let slots = gpu_memory.saturating_sub(resident) / expert_bytes.max(1);
    if slots < moe.top_k as u64 {
        return Err(Error::OutOfDeviceMemory {
            what: format!(
                "resident weights and {} expert slots per MoE layer (the router's top-k)",
                moe.top_k
            ),
            needed_bytes: Some(minimum),
            message: format!("a GPU memory budget (--gpu-memory) of {gpu_memory} bytes is too small"),
        });
    }
    Ok(slots.min(moe.experts as u64) as usize)
}
