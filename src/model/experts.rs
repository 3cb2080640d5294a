//! Expert streaming: the routed experts of a MoE model that does not fit
//! the GPU stay in host memory (the memory-mapped checkpoint, in its
//! stored format) and are copied on demand into a fixed pool of GPU slots
//! per MoE layer. Everything else is resident. The routing readback tells
//! the host which experts the next dispatch needs: those in a slot are
//! hits; the others are uploaded together (through [`UploadRing`]) into the
//! slots the dispatch does not need whose experts the router has asked for
//! least lately (its histogram, decayed), and the expert kernels read slot
//! numbers where they would read expert numbers.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::MoeConfig;
use super::weights::TensorSource;
use crate::error::{Error, Result};
use crate::format::WeightFormat;
use crate::gpu::{Gpu, GpuTensor, Upload, UploadRing};
pub use crate::stats::ExpertCacheStats;

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
    /// How often each expert was needed lately: every need adds 1, and
    /// the counts halve every [`DEMAND_HALF_LIFE`] dispatches.
    demand: Vec<f32>,
    /// Per slot: holds a prefetched expert no dispatch has used yet.
    prefetched: Vec<bool>,
}

/// Dispatches over which an expert's past demand halves: long enough to
/// tell the experts a layer's router favours from those it picked once,
/// short enough to follow a change of subject.
const DEMAND_HALF_LIFE: f32 = 256.0;

impl LayerSlots {
    /// Empties the [`Self::victim`] slot and marks it used at `now`, for an
    /// upload that fills it once recorded (a failed one leaves no stale
    /// expert behind).
    fn evict(&mut self, now: u64) -> Option<usize> {
        let slot = self.victim(now)?;
        self.expert[slot] = None;
        self.prefetched[slot] = false;
        self.last_used[slot] = now;
        Some(slot)
    }

    /// The slot to evict: not used at `now`, holding the expert least in
    /// demand (an empty slot first), the least recently used among equals.
    fn victim(&self, now: u64) -> Option<usize> {
        let demand = |s: usize| match self.expert[s] {
            Some(x) => self.demand[x],
            None => f32::NEG_INFINITY,
        };
        (0..self.expert.len())
            .filter(|&s| self.last_used[s] != now)
            .min_by(|&a, &b| demand(a).total_cmp(&demand(b)).then(self.last_used[a].cmp(&self.last_used[b])))
    }
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
        let slot_table = || LayerSlots {
            expert: (0..slots).map(Some).collect(),
            last_used: vec![0; slots],
            demand: vec![0.0; moe.experts],
            prefetched: vec![false; slots],
        };
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
    #[cfg(feature = "internals")]
    pub fn totals(&self) -> ExpertCacheStats {
        self.cache.lock().unwrap().totals
    }

    /// Host memory of the staging ring.
    #[cfg(feature = "internals")]
    pub fn staging_bytes(&self) -> u64 {
        self.cache.lock().unwrap().ring.bytes()
    }

    /// Fills slot `s` of every streamed layer with expert `s`, as the
    /// slot tables start; `weights` hold the model's layers from
    /// `first_layer` on (a device's part of a split model).
    pub fn fill_slots(&self, gpu: &Gpu, weights: &super::Weights, first_layer: usize) -> Result<()> {
        let mut cache = self.cache.lock().unwrap();
        for (layer, streamed) in self.layers.iter().enumerate() {
            let Some(streamed) = streamed else { continue };
            let super::FfnWeights::Moe(moe) = &weights.layers[layer - first_layer].ffn else { continue };
            let placements: Vec<(usize, usize)> = (0..self.slots).map(|s| (s, s)).collect();
            self.upload(gpu, &mut cache.ring, streamed, (&moe.gate_up, &moe.down), &placements)?;
        }
        Ok(())
    }

    /// Puts `needed` (distinct experts of `layer`, at most [`Self::slots`])
    /// on the GPU: the missing ones are uploaded, together, into the slots
    /// that `needed` does not occupy holding the experts least in demand
    /// (`LayerSlots::victim`). Returns each one's slot; the uploads run before anything submitted after this
    /// returns.
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
        let decay = 0.5f32.powf(1.0 / DEMAND_HALF_LIFE);
        table.demand.iter_mut().for_each(|d| *d *= decay);
        for &x in needed {
            table.demand[x] += 1.0;
        }
        let mut slots: Vec<Option<usize>> =
            needed.iter().map(|&x| table.expert.iter().position(|&held| held == Some(x))).collect();
        let mut served = ExpertCacheStats::default();
        for &s in slots.iter().flatten() {
            table.last_used[s] = now;
            served.prefetch_hits += std::mem::take(&mut table.prefetched[s]) as u64;
        }
        served.hits = slots.iter().flatten().count() as u64;
        let mut misses = Vec::new();
        for (k, &x) in needed.iter().enumerate() {
            if slots[k].is_some() {
                continue;
            }
            // The expert least in demand, of those this dispatch does not
            // need (just marked `now`); the least recently used of equals.
            let victim = table.evict(now).expect("fewer needed experts than slots");
            slots[k] = Some(victim);
            misses.push((x, victim));
        }
        if !misses.is_empty() {
            let start = Instant::now();
            served.bytes_uploaded = self.upload(gpu, ring, streamed, (gate_up, down), &misses)?;
            served.upload_time = start.elapsed();
            served.misses = misses.len() as u64;
            for (x, slot) in misses {
                table.expert[slot] = Some(x);
            }
        }
        totals.add(&served);
        stats.add(&served);
        Ok(slots.into_iter().map(|s| s.expect("every needed expert has a slot") as u32).collect())
    }

    /// Uploads the experts of `guess` (distinct experts of `layer`, at most
    /// [`Self::slots`]) that no slot holds, as [`Self::place`] would, ahead
    /// of the dispatch that may need them. The experts of the guess already
    /// there are kept from eviction by it; demand does not change (only
    /// needs count).
    pub fn prefetch(
        &self,
        gpu: &Gpu,
        (gate_up, down): (&GpuTensor, &GpuTensor),
        layer: usize,
        guess: &[usize],
        stats: &mut ExpertCacheStats,
    ) -> Result<()> {
        let streamed = self.layers[layer].as_ref().expect("prefetching experts of a streamed layer");
        let mut guard = self.cache.lock().unwrap();
        let Cache { layers, ring, clock, totals } = &mut *guard;
        *clock += 1;
        let now = *clock;
        let table = &mut layers[layer];
        let mut uploads = Vec::new();
        for &x in guess.iter().take(self.slots) {
            match table.expert.iter().position(|&held| held == Some(x)) {
                Some(s) => table.last_used[s] = now,
                None => {
                    let victim = table.evict(now).expect("fewer guessed experts than slots");
                    uploads.push((x, victim));
                }
            }
        }
        if uploads.is_empty() {
            return Ok(());
        }
        let start = Instant::now();
        let served = ExpertCacheStats {
            bytes_uploaded: self.upload(gpu, ring, streamed, (gate_up, down), &uploads)?,
            upload_time: start.elapsed(),
            prefetched: uploads.len() as u64,
            ..Default::default()
        };
        for (x, slot) in uploads {
            table.expert[slot] = Some(x);
            table.prefetched[slot] = true;
        }
        totals.add(&served);
        stats.add(&served);
        Ok(())
    }

    /// Copies each `(expert, slot)` of a layer into its slot (its gate and
    /// up rows interleaved, and its down rows), as many experts at a time
    /// as the ring holds. Returns the bytes copied.
    fn upload(
        &self,
        gpu: &Gpu,
        ring: &mut UploadRing,
        streamed: &StreamedLayer,
        (gate_up_slots, down_slots): (&GpuTensor, &GpuTensor),
        placements: &[(usize, usize)],
    ) -> Result<u64> {
        let (h, i) = self.dims;
        let gate_up_row = streamed.gate_up_format.gpu_row_bytes(h);
        let down_row = streamed.down_format.gpu_row_bytes(i);
        let mut bytes = 0;
        for group in placements.chunks(ring.uploads_at_once().div_ceil(2)) {
            let values = group
                .iter()
                .map(|&(x, _)| {
                    let [gate, up, down] =
                        streamed.tensors.read(self.source.as_ref(), x, (self.experts, h, i))?;
                    Ok([
                        gpu_layout(streamed.gate_up_format, gate),
                        gpu_layout(streamed.gate_up_format, up),
                        gpu_layout(streamed.down_format, down),
                    ])
                })
                .collect::<Result<Vec<_>>>()?;
            let mut uploads = Vec::new();
            for (&(_, slot), [gate, up, down]) in group.iter().zip(&values) {
                let interleaved: Vec<&[u8]> = gate
                    .chunks_exact(gate_up_row)
                    .zip(up.chunks_exact(gate_up_row))
                    .flat_map(|(g, u)| [g, u])
                    .collect();
                uploads.extend(row_uploads(gate_up_slots, slot * 2 * i, interleaved));
                uploads.extend(row_uploads(down_slots, slot * h, down.chunks_exact(down_row).collect()));
                bytes += (gate.len() + up.len() + down.len()) as u64;
            }
            ring.upload(gpu, &uploads)?;
        }
        Ok(bytes)
    }
}

/// `file` (bytes of `format` as the checkpoint stores them) in the GPU
/// layout, still borrowed from the checkpoint where the two agree.
fn gpu_layout(format: WeightFormat, file: Cow<'_, [u8]>) -> Cow<'_, [u8]> {
    let converted = match format.to_gpu_layout(&file) {
        Cow::Owned(bytes) => Some(bytes),
        Cow::Borrowed(_) => None,
    };
    converted.map_or(file, Cow::Owned)
}

/// The uploads that put `rows` (each one row in the tensor's GPU layout)
/// into `tensor` from row `first` on: one per part they fall in.
fn row_uploads<'a>(tensor: &'a GpuTensor, first: usize, rows: Vec<&'a [u8]>) -> Vec<Upload<'a>> {
    let end = first + rows.len();
    let mut out = Vec::new();
    for part in &tensor.parts {
        let (lo, hi) = (first.max(part.first_row), end.min(part.first_row + part.rows));
        if lo >= hi {
            continue;
        }
        let offset = (lo - part.first_row) as u64 * rows[0].len() as u64;
        out.push(Upload { dst: &part.buffer, offset, pieces: rows[lo - first..hi - first].to_vec() });
    }
    out
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

#[cfg(test)]
mod tests {
    use super::LayerSlots;

    fn table(expert: Vec<Option<usize>>, last_used: Vec<u64>, demand: Vec<f32>) -> LayerSlots {
        let prefetched = vec![false; expert.len()];
        LayerSlots { expert, last_used, demand, prefetched }
    }

    #[test]
    fn the_victim_is_the_expert_least_in_demand_that_the_dispatch_does_not_need() {
        // Slot 1 holds the expert least in demand, but this dispatch (at 9) uses it.
        let t = table(vec![Some(0), Some(1), Some(2), Some(3)], vec![5, 9, 3, 4], vec![4.0, 0.5, 2.0, 1.0]);
        assert_eq!(t.victim(9), Some(3));
        // Equal demand: the least recently used.
        let t = table(vec![Some(0), Some(1), Some(2)], vec![7, 2, 5], vec![1.0, 1.0, 1.0]);
        assert_eq!(t.victim(9), Some(1));
        // An empty slot (a failed upload left it so) goes first.
        let t = table(vec![Some(0), None, Some(2)], vec![1, 8, 2], vec![0.0, 3.0, 0.0]);
        assert_eq!(t.victim(9), Some(1));
        // Every slot in use by the dispatch: none.
        let t = table(vec![Some(0), Some(1)], vec![9, 9], vec![0.0, 0.0]);
        assert_eq!(t.victim(9), None);
    }
}
