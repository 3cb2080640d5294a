//! Control vectors and steering: a direction added to the residual stream
//! at layer outputs (after the FFN's residual add), at every position, as
//! llama.cpp applies its control vectors.
//!
//! Files use llama.cpp's GGUF layout, which repeng also exports:
//! `general.architecture = "controlvector"`, `controlvector.layer_count`
//! (the number of direction tensors), optionally `controlvector.model_hint`,
//! and one F32 1-D tensor `direction.N` of `hidden` values per steered
//! layer, `N >= 1` the 0-based layer index (layer 0 is never steered).
//!
//! ```no_run
//! use wgspark::{ControlVector, Gpu, Model, SessionOptions, Steering};
//!
//! let gpu = Gpu::from_env()?;
//! let model = Model::load("path/to/checkpoint", &gpu)?;
//! let happy = ControlVector::load("happy.gguf")?;
//! let calm = ControlVector::load("calm.gguf")?;
//! // llama.cpp's --control-vector happy.gguf --control-vector-scaled calm.gguf:0.5
//! //             --control-vector-layer-range 2 10
//! let steering = Steering::new(&model.config, &[(happy, 1.0), (calm, 0.5)], Some(2..=10))?;
//! let mut session = model.session(&SessionOptions::default())?;
//! session.set_steering(Some(&steering))?;
//! let logits = session.prefill(&[1, 2, 3])?;
//! # Ok::<(), wgspark::Error>(())
//! ```

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use crate::error::{ControlVectorProblem, Error, Result};
use crate::gguf::{GgmlType, Gguf, GgufWriter, MetaValue};
use crate::model::{Model, ModelConfig};

/// The GGUF metadata key naming a file's architecture.
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// The architecture of a control vector file.
pub const ARCHITECTURE: &str = "controlvector";
/// The metadata key holding the number of direction tensors.
pub const LAYER_COUNT_KEY: &str = "controlvector.layer_count";
/// The optional metadata key naming the model type a vector was made for.
pub const MODEL_HINT_KEY: &str = "controlvector.model_hint";

/// One control vector: a direction per steered layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlVector {
    /// Where it was read from (errors name it).
    pub path: PathBuf,
    /// The model type the writer recorded (`controlvector.model_hint`).
    pub model_hint: Option<String>,
    /// Layer (>= 1) to direction; every direction has the same length.
    pub directions: BTreeMap<usize, Vec<f32>>,
}

impl ControlVector {
    /// Reads a control vector file, checking everything that does not
    /// depend on the model: the architecture key, the layer count, and that
    /// each tensor is a finite F32 1-D `direction.N` with `N >= 1`, all of
    /// one length. A truncated or malformed file is an [`Error::Gguf`].
    ///
    /// ```no_run
    /// use wgspark::{ControlVector, Gpu, Model, SessionOptions, Steering};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = Gpu::from_env()?;
    /// let model = Model::load("path/to/model", &gpu)?;
    /// let vector = ControlVector::load("happy.gguf")?;
    /// println!("steers layers {:?}", vector.directions.keys().collect::<Vec<_>>());
    /// // Half strength, on every layer the vector has.
    /// let steering = Steering::new(&model.config, &[(vector, 0.5)], None)?;
    /// let mut session = model.session(&SessionOptions::default())?;
    /// session.set_steering(Some(&steering))?;
    /// let steered = session.prefill(&[1, 2, 3])?;
    /// session.truncate(0);
    /// session.set_steering(None)?; // positions from here on are not steered
    /// let plain = session.prefill(&[1, 2, 3])?;
    /// # Ok(()) }
    /// ```
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let gguf = Gguf::open(path)?;
        let problem = |problem| Error::ControlVector { path: path.to_path_buf(), problem };
        match gguf.meta_str(ARCHITECTURE_KEY) {
            Ok(ARCHITECTURE) => {}
            Ok(other) => {
                return Err(problem(ControlVectorProblem::WrongArchitecture { found: other.into() }));
            }
            Err(_) => {
                let found = gguf.metadata.get(ARCHITECTURE_KEY).map_or("(missing)".into(), |m| m.to_string());
                return Err(problem(ControlVectorProblem::WrongArchitecture { found }));
            }
        }
        let declared =
            gguf.meta_int(LAYER_COUNT_KEY).map_err(|_| problem(ControlVectorProblem::MissingLayerCount))?;
        let mut directions = BTreeMap::new();
        let mut length = None;
        for t in &gguf.tensors {
            let layer =
                t.name.strip_prefix("direction.").and_then(layer_number).ok_or_else(|| {
                    problem(ControlVectorProblem::UnexpectedTensor { name: t.name.clone() })
                })?;
            if layer == 0 {
                return Err(problem(ControlVectorProblem::LayerZero));
            }
            if t.ty != GgmlType::F32 {
                return Err(problem(ControlVectorProblem::NotF32 { layer, found: t.ty.to_string() }));
            }
            if t.dims.len() != 1 {
                return Err(problem(ControlVectorProblem::NotOneDimensional { layer, dims: t.dims.clone() }));
            }
            let values = gguf.dequantize(t)?;
            let expected = *length.get_or_insert(values.len());
            if values.len() != expected {
                return Err(problem(ControlVectorProblem::InconsistentLength {
                    layer,
                    found: values.len(),
                    expected,
                }));
            }
            if values.iter().any(|v| !v.is_finite()) {
                return Err(problem(ControlVectorProblem::NotFinite { layer }));
            }
            directions.insert(layer, values);
        }
        if directions.is_empty() {
            return Err(problem(ControlVectorProblem::NoDirections));
        }
        if declared != directions.len() as i64 {
            return Err(problem(ControlVectorProblem::LayerCountMismatch {
                declared,
                found: directions.len(),
            }));
        }
        let model_hint = gguf.meta_str(MODEL_HINT_KEY).ok().map(str::to_string);
        Ok(ControlVector { path: path.to_path_buf(), model_hint, directions })
    }

    /// Writes the vector in llama.cpp's layout (what its cvector-generator
    /// writes: int32 layer count, directions in layer order).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut w = GgufWriter::new();
        w.meta(ARCHITECTURE_KEY, MetaValue::Str(ARCHITECTURE.into()));
        if let Some(hint) = &self.model_hint {
            w.meta(MODEL_HINT_KEY, MetaValue::Str(hint.clone()));
        }
        w.meta(LAYER_COUNT_KEY, MetaValue::I32(self.directions.len() as i32));
        for (layer, direction) in &self.directions {
            w.tensor_f32(&format!("direction.{layer}"), &[direction.len()], direction);
        }
        w.write(path)
    }

    /// Length of the directions (the hidden size of the model it was made for).
    pub fn hidden(&self) -> usize {
        self.directions.values().next().map_or(0, Vec::len)
    }
}

/// What is added to each layer's output: the sum of control vectors, each
/// times its strength, over an inclusive layer range.
#[derive(Debug, Clone, PartialEq)]
pub struct Steering {
    hidden: usize,
    /// `[layer]`: the row added to that layer's output, if any.
    layers: Vec<Option<Vec<f32>>>,
}

impl Steering {
    /// Sums `(vector, strength)` pairs for a model with `config`, keeping
    /// only layers in `layer_range` (inclusive, as llama.cpp's
    /// `--control-vector-layer-range`; `None` is every layer). A range
    /// reaching past the last layer is cut there, as in llama.cpp. Each
    /// direction must have the model's hidden size and a layer the model has.
    pub fn new(
        config: &ModelConfig,
        vectors: &[(ControlVector, f32)],
        layer_range: Option<RangeInclusive<usize>>,
    ) -> Result<Self> {
        if let Some(range) = &layer_range {
            let invalid = |reason: String| Error::InvalidLayerRange {
                start: *range.start(),
                end: *range.end(),
                reason,
            };
            if range.start() > range.end() {
                return Err(invalid("the start is after the end".into()));
            }
            // A range past the last layer would steer nothing.
            if *range.start() >= config.layers {
                return Err(invalid(format!("the model has layers 0..{}", config.layers)));
            }
        }
        let mut layers: Vec<Option<Vec<f32>>> = vec![None; config.layers];
        for (vector, strength) in vectors {
            let problem = |problem| Error::ControlVector { path: vector.path.clone(), problem };
            for (&layer, direction) in &vector.directions {
                if layer >= config.layers {
                    return Err(problem(ControlVectorProblem::LayerOutOfRange {
                        layer,
                        layers: config.layers,
                    }));
                }
                if direction.len() != config.hidden {
                    return Err(problem(ControlVectorProblem::WrongLength {
                        layer,
                        found: direction.len(),
                        expected: config.hidden,
                    }));
                }
                if layer_range.as_ref().is_some_and(|r| !r.contains(&layer)) {
                    continue;
                }
                let row = layers[layer].get_or_insert_with(|| vec![0.0; config.hidden]);
                for (sum, d) in row.iter_mut().zip(direction) {
                    *sum += strength * d;
                }
            }
        }
        Ok(Steering { hidden: config.hidden, layers })
    }

    /// The row added to `layer`'s output, if it is steered.
    pub fn layer(&self, layer: usize) -> Option<&[f32]> {
        self.layers.get(layer)?.as_deref()
    }

    /// The steered layers, ascending.
    pub fn steered_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().enumerate().filter_map(|(i, row)| row.as_ref().map(|_| i))
    }

    /// Fails unless the steering was made for `config`'s layers and width.
    pub(crate) fn check_fits(&self, config: &ModelConfig) -> Result<()> {
        if self.layers.len() != config.layers || self.hidden != config.hidden {
            return Err(Error::SteeringMismatch {
                steering_layers: self.layers.len(),
                steering_hidden: self.hidden,
                layers: config.layers,
                hidden: config.hidden,
            });
        }
        Ok(())
    }

    /// The steering's rows on `model`'s device.
    pub(crate) fn upload(&self, model: &Model) -> Result<SteeringPlan> {
        let c = &model.config;
        self.check_fits(c)?;
        let gpu = &model.gpu;
        // A device of a split holds the rows of its own layers only.
        let rows = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, row)| {
                let row = row.as_ref().filter(|_| model.layers().contains(&i))?;
                Some(gpu.storage_buffer_init(&format!("steering.layer.{i}"), row))
            })
            .collect();
        gpu.check("uploading the steering")?;
        Ok(SteeringPlan { rows, slots: None, hidden: c.hidden })
    }
}

/// The steering of a session: per layer, the row its output add adds to
/// every token in flight. Unsteered layers have none and add nothing.
/// A batch's (`slots` set): per layer a table of rows, token t adding row
/// `slots[t]` (row 0 zeros), so that sequences steered differently, or
/// not at all, share a step.
#[derive(Debug)]
pub(crate) struct SteeringPlan {
    rows: Vec<Option<wgpu::Buffer>>,
    slots: Option<wgpu::Buffer>,
    hidden: usize,
}

impl SteeringPlan {
    pub fn layer(&self, layer: usize) -> Option<&wgpu::Buffer> {
        self.rows.get(layer)?.as_ref()
    }

    /// Per token, its row of each layer's table (a batch's plan).
    pub fn slots(&self) -> Option<&wgpu::Buffer> {
        self.slots.as_ref()
    }

    /// A batch's tables: `rows` rows of every layer's the device holds
    /// (all zeros), and slots for `max_tokens` tokens.
    pub fn tables(model: &Model, rows: usize, max_tokens: usize) -> Result<Self> {
        let (gpu, c) = (&model.gpu, &model.config);
        let table = |i| gpu.storage_buffer(&format!("steering.table.{i}"), rows * c.hidden);
        let tables = (0..c.layers)
            .map(|i| model.layers().contains(&i).then(|| table(i)).transpose())
            .collect::<Result<_>>()?;
        let slots = gpu.storage_buffer("steering.slots", max_tokens)?;
        Ok(SteeringPlan { rows: tables, slots: Some(slots), hidden: c.hidden })
    }

    /// Writes `steering` (checked against the model already) as row `slot`
    /// of every layer's table: zeros where it steers no layer.
    pub fn write_row(&self, gpu: &crate::gpu::Gpu, slot: usize, steering: &Steering) {
        let zeros = vec![0.0f32; self.hidden];
        // (Each device of a split holds its own layers' tables.)
        for (i, table) in self.rows.iter().enumerate().filter_map(|(i, t)| Some((i, t.as_ref()?))) {
            let row = steering.layer(i).unwrap_or(&zeros);
            gpu.queue.write_buffer(table, (slot * self.hidden * 4) as u64, bytemuck::cast_slice(row));
        }
    }

    /// Sets each token's row of the tables for the next pass.
    pub fn write_slots(&self, gpu: &crate::gpu::Gpu, slots: &[u32]) {
        let buffer = self.slots.as_ref().expect("a batch's plan");
        gpu.queue.write_buffer(buffer, 0, bytemuck::cast_slice(slots));
    }
}

/// N of `direction.N` written as llama.cpp writes it: decimal digits, no
/// sign and no leading zero (`+1` and `01` would name layer 1 twice over).
fn layer_number(n: &str) -> Option<usize> {
    let canonical =
        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && (n == "0" || !n.starts_with('0'));
    canonical.then(|| n.parse().ok()).flatten()
}
