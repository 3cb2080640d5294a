//! Residual capture: the residual stream at chosen layers' outputs (after
//! steering), recorded on the GPU while the layers run and read back once
//! per submission: once per decoded token, once per prompt chunk that
//! contributes rows. While generating with steps in flight, each step's
//! rows go to a staging slot of their own and are read as its id is, so
//! capture does not stop the pipeline.
//!
//! Written as safetensors ([`Capture::to_safetensors`]): one f32 tensor
//! `resid.layer.N` of shape `[rows, hidden]` per captured layer, rows in
//! processing order, and the position of each row in the metadata
//! (`positions`, a JSON array).
//!
//! ```no_run
//! use wgspark::{CaptureOptions, Gpu, Model, PromptRows, SessionOptions};
//!
//! let gpu = Gpu::from_env()?;
//! let model = Model::load("path/to/checkpoint", &gpu)?;
//! let mut session = model.session(&SessionOptions::default())?;
//! let options = CaptureOptions { layers: Some(vec![4, 8]), prompt_rows: PromptRows::All };
//! session.set_capture(Some(&options))?;
//! session.prefill(&[1, 2, 3])?;
//! let capture = session.take_capture().expect("capture is on");
//! assert_eq!(capture.positions, [0, 1, 2]);
//! let layer_8 = capture.layer(8).unwrap(); // [3, hidden] row-major
//! capture.write_safetensors("resid.safetensors")?;
//! # Ok::<(), wgspark::Error>(())
//! ```

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::gpu::{Gpu, MapWait, Readback};
use crate::kernels::residual::CaptureTarget;
use crate::model::Model;

/// Which prompt rows are recorded. Every decoded token's row always is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptRows {
    /// Only the last prompt position (the one whose logits come back).
    #[default]
    Last,
    /// Every prompt position.
    All,
}

/// What [`crate::Session::set_capture`] records: which layers' outputs,
/// and which prompt rows. The default is every layer, with the last
/// prompt row and every decoded token's.
///
/// ```no_run
/// use wgspark::{CaptureOptions, Gpu, Model, Sampler, SessionOptions};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gpu = Gpu::from_env()?;
/// let model = Model::load("path/to/model", &gpu)?;
/// let mut session = model.session(&SessionOptions::default())?;
/// session.set_capture(Some(&CaptureOptions { layers: Some(vec![6]), ..CaptureOptions::default() }))?;
/// let logits = session.prefill(&[1, 2, 3])?;
/// session.step(Sampler::greedy().sample(&logits), session.position())?;
/// let capture = session.take_capture().ok_or("capture is on")?;
/// assert_eq!(capture.positions, [2, 3]); // the prompt's last row, then the step's
/// let rows = capture.layer(6).ok_or("layer 6 was captured")?;
/// assert_eq!(rows.len(), capture.n_rows() * capture.hidden);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CaptureOptions {
    /// The layers to record; `None` is every layer.
    pub layers: Option<Vec<usize>>,
    /// Which prompt rows are recorded (decoded tokens' rows always are).
    pub prompt_rows: PromptRows,
}

/// Rows of the residual stream at layer outputs, in processing order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Capture {
    /// Values per row: the model's hidden size.
    pub hidden: usize,
    /// The captured layers, ascending.
    pub layers: Vec<usize>,
    /// The position of each row.
    pub positions: Vec<usize>,
    /// Per captured layer (in `layers` order), `[rows, hidden]` row-major.
    pub rows: Vec<Vec<f32>>,
}

impl Capture {
    fn empty(hidden: usize, layers: Vec<usize>) -> Self {
        Capture { hidden, rows: vec![Vec::new(); layers.len()], layers, positions: Vec::new() }
    }

    /// Layer `layer`'s rows, `[rows, hidden]` row-major, if it was captured.
    pub fn layer(&self, layer: usize) -> Option<&[f32]> {
        let slot = self.layers.iter().position(|&l| l == layer)?;
        Some(&self.rows[slot])
    }

    /// Rows captured per layer: one per recorded position.
    pub fn n_rows(&self) -> usize {
        self.positions.len()
    }

    /// The safetensors encoding: `resid.layer.N` tensors (f32,
    /// `[rows, hidden]`) and `positions` in the metadata.
    pub fn to_safetensors(&self) -> Vec<u8> {
        let names: Vec<String> = self.layers.iter().map(|l| format!("resid.layer.{l}")).collect();
        let views = names.iter().zip(&self.rows).map(|(name, rows)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![self.n_rows(), self.hidden],
                bytemuck::cast_slice(rows),
            )
            .expect("rows hold n_rows * hidden values");
            (name.as_str(), view)
        });
        let metadata = HashMap::from([
            ("format".to_string(), "wgspark residual capture".to_string()),
            ("positions".to_string(), serde_json::to_string(&self.positions).expect("a list of integers")),
        ]);
        safetensors::serialize(views, Some(metadata)).expect("views are valid")
    }

    /// Writes [`Self::to_safetensors`] to `path`, replacing any file there.
    pub fn write_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_safetensors()).map_err(|e| Error::io(path, e))
    }
}

/// The capture of a session. Each captured layer's output add writes its
/// rows into the layer's own region of one buffer; the regions are read
/// back together, in one copy when they are full.
#[derive(Debug)]
pub(crate) struct CapturePlan {
    pub prompt_rows: PromptRows,
    /// `[layer]`: the index of the layer's region, if it is captured.
    region_of_layer: Vec<Option<usize>>,
    step: wgpu::Buffer,
    buffer: wgpu::Buffer,
    /// Bytes from one layer's region to the next (a storage binding offset
    /// must be a multiple of the adapter's alignment).
    region_stride: u64,
    /// Staging slots: slot 0 for submissions read at once; one per step in
    /// flight while generating.
    slots: Vec<CaptureSlot>,
    /// Most rows one submission records.
    max_rows: usize,
    captured: Capture,
}

/// A staging buffer and the rows it holds once its submission is done:
/// (rows, position of the first).
#[derive(Debug)]
struct CaptureSlot {
    readback: Readback,
    pending: Option<(usize, usize)>,
}

impl CapturePlan {
    /// Room for `max_tokens` rows per layer when every prompt row is
    /// captured; `step` is the uniform holding the tokens in flight.
    pub fn new(
        model: &Model,
        options: &CaptureOptions,
        max_tokens: usize,
        step: &wgpu::Buffer,
    ) -> Result<Self> {
        let c = &model.config;
        let gpu: &Gpu = &model.gpu;
        let mut layers = options.layers.clone().unwrap_or_else(|| (0..c.layers).collect());
        layers.sort_unstable();
        layers.dedup();
        if let Some(&layer) = layers.iter().find(|&&l| l >= c.layers) {
            return Err(Error::CaptureLayerOutOfRange { layer, layers: c.layers });
        }
        // A device of a split records the layers it holds (maybe none: it
        // still counts the positions).
        layers.retain(|l| model.layers().contains(l));
        let max_rows = match options.prompt_rows {
            PromptRows::Last => 1,
            PromptRows::All => max_tokens,
        };
        let region_bytes = (max_rows * c.hidden * 4) as u64;
        let alignment = gpu.device.limits().min_storage_buffer_offset_alignment as u64;
        let region_stride = region_bytes.next_multiple_of(alignment.max(16));
        // (At least one region's bytes: a buffer is never empty.)
        let bytes = layers.len().max(1) as u64 * region_stride;
        let buffer = gpu.storage_buffer_bytes("capture", bytes)?;
        let mut region_of_layer = vec![None; c.layers];
        for (region, &layer) in layers.iter().enumerate() {
            region_of_layer[layer] = Some(region);
        }
        let readback = Readback::new(gpu, "capture.readback", bytes);
        gpu.check("creating the residual capture")?;
        let slots = vec![CaptureSlot { readback, pending: None }];
        Ok(CapturePlan {
            prompt_rows: options.prompt_rows,
            region_of_layer,
            step: step.clone(),
            buffer,
            region_stride,
            slots,
            max_rows,
            captured: Capture::empty(c.hidden, layers),
        })
    }

    /// Where `layer`'s output add writes its rows, if it is captured.
    pub fn target(&self, layer: usize) -> Option<CaptureTarget<'_>> {
        let index = (*self.region_of_layer.get(layer)?)? as u64;
        let region = wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: index * self.region_stride,
            size: wgpu::BufferSize::new((self.max_rows * self.captured.hidden * 4) as u64),
        };
        Some(CaptureTarget { region, rows: self.max_rows, step: &self.step })
    }

    /// Rows a submission of `n_tokens` records.
    pub fn rows_for(&self, n_tokens: usize) -> usize {
        n_tokens.min(self.max_rows)
    }

    fn n_regions(&self) -> u64 {
        self.captured.layers.len() as u64
    }

    /// Makes room for `n` submissions whose rows are read later.
    pub fn ensure_slots(&mut self, gpu: &Gpu, n: usize) {
        let bytes = self.n_regions().max(1) * self.region_stride;
        while self.slots.len() < n {
            self.slots
                .push(CaptureSlot { readback: Readback::new(gpu, "capture.readback", bytes), pending: None });
        }
    }

    /// Records the copy of the first `rows` rows of every region into the
    /// staging buffer of `slot`, at the same offsets.
    pub fn record_readback(&self, encoder: &mut wgpu::CommandEncoder, rows: usize, slot: usize) {
        let bytes = (rows * self.captured.hidden * 4) as u64;
        let readback = &self.slots[slot].readback;
        if self.n_regions() == 0 {
            return;
        }
        if rows == self.max_rows {
            readback.record(encoder, &self.buffer, 0, self.n_regions() * self.region_stride);
        } else {
            for region in 0..self.n_regions() {
                let offset = region * self.region_stride;
                readback.record_at(encoder, &self.buffer, offset, offset, bytes);
            }
        }
    }

    /// After the submission that recorded `slot`'s copy: starts mapping
    /// its `rows` rows, whose positions begin at `first_position`.
    pub fn start(&mut self, slot: usize, rows: usize, first_position: usize) {
        if self.n_regions() > 0 {
            let used = self.used_bytes(rows);
            self.slots[slot].readback.start_map(used);
        }
        self.slots[slot].pending = Some((rows, first_position));
    }

    /// Waits for `slot`'s map (its submission) and appends its rows; does
    /// nothing when the slot holds none.
    pub fn finish(&mut self, gpu: &Gpu, slot: usize, wait: MapWait) -> Result<()> {
        let Some((rows, first_position)) = self.slots[slot].pending.take() else { return Ok(()) };
        let per_layer = rows * self.captured.hidden * 4;
        let stride = self.region_stride as usize;
        let captured = &mut self.captured.rows;
        // Straight from the mapped staging buffer into the kept rows: no
        // intermediate copy of every layer's rows.
        if !captured.is_empty() {
            self.slots[slot].readback.finish_map(gpu, wait, |mapped| {
                for (index, layer_rows) in captured.iter_mut().enumerate() {
                    let region = &mapped[index * stride..index * stride + per_layer];
                    layer_rows
                        .extend(region.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())));
                }
            })?;
        }
        self.captured.positions.extend(first_position..first_position + rows);
        Ok(())
    }

    fn used_bytes(&self, rows: usize) -> u64 {
        (self.n_regions() - 1) * self.region_stride + (rows * self.captured.hidden * 4) as u64
    }

    /// Drops the rows of positions from `position` on (steps computed past
    /// the end of a generation).
    pub fn drop_from_position(&mut self, position: usize) {
        let keep = self.captured.positions.iter().take_while(|&&p| p < position).count();
        self.captured.positions.truncate(keep);
        let hidden = self.captured.hidden;
        for rows in &mut self.captured.rows {
            rows.truncate(keep * hidden);
        }
    }

    /// The rows captured so far; the capture goes on from empty.
    pub fn take(&mut self) -> Capture {
        let empty = Capture::empty(self.captured.hidden, self.captured.layers.clone());
        std::mem::replace(&mut self.captured, empty)
    }

    /// [`Self::take`] of a split's devices in order: their layers and rows
    /// one after another, the positions (the same on each) once.
    pub fn take_all<'a>(plans: impl IntoIterator<Item = &'a mut CapturePlan>) -> Option<Capture> {
        plans.into_iter().map(CapturePlan::take).reduce(|mut all, part| {
            all.layers.extend(part.layers);
            all.rows.extend(part.rows);
            all
        })
    }
}
