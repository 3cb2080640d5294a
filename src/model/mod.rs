//! A model on the GPU: its validated config, its family row, its weights
//! (uploaded once, in a format the kernels decode in registers: a
//! safetensors checkpoint's as bf16, f16 and f32 converted, FP8 as FP8
//! blocks; a GGUF file's in their own type, any of the 13 it reads) and
//! the pipelines that run them.

pub mod config;
pub mod split;
mod synthetic;

// The model's machinery: public with the `internals` feature (the crate's
// own tests and benchmarks), private otherwise.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod experts;
#[cfg(not(feature = "internals"))]
pub(crate) mod experts;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod family;
#[cfg(not(feature = "internals"))]
pub(crate) mod family;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod gguf_checkpoint;
#[cfg(not(feature = "internals"))]
pub(crate) mod gguf_checkpoint;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod layers;
#[cfg(not(feature = "internals"))]
pub(crate) mod layers;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod vision;
#[cfg(not(feature = "internals"))]
pub(crate) mod vision;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod weights;
#[cfg(not(feature = "internals"))]
pub(crate) mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::kernels::attention::QkNorm;
pub use crate::kernels::router::ExpertSelection;
pub use crate::kv_cache::Heads;
pub use config::{ModelConfig, MoeConfig, Quantization, RopeConfig, RopeScaling, Yarn};
use experts::{ExpertStreaming, ExpertTensors, StreamedLayer};
pub use family::{ExpertNames, Family, MoeFamily, Renormalize, ScoringRule};
pub(crate) use layers::{FfnWeights, LayerWeights, MoeWeights, Weights};
pub use vision::VisionConfig;
use weights::{Checkpoint, TensorSource, Uploader};

use crate::error::{Error, Result};
use crate::format::WeightFormat;
use crate::gpu::{Gpu, GpuTensor};
use crate::kernels::Kernels;
use crate::progress::Progress;

/// How a model is placed on the GPU.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadOptions {
    /// Bytes of GPU memory the weights may take (on each device of a
    /// split): the resident weights first, the rest as expert slots. A MoE
    /// model whose experts do not all fit then streams them (`generate
    /// --gpu-memory`).
    pub gpu_memory: Option<u64>,
    /// GPU slots per MoE layer (at least the router's top-k), instead of a
    /// budget: fewer than the experts streams them (`--expert-slots`).
    pub expert_slots: Option<usize>,
}

impl LoadOptions {
    fn streams_nothing(&self) -> bool {
        self.gpu_memory.is_none() && self.expert_slots.is_none()
    }
}

/// The budget error of a MoE model, pointing at expert streaming.
fn suggest_streaming(e: Error, c: &ModelConfig) -> Error {
    match (e, &c.moe) {
        (Error::OutOfDeviceMemory { what, needed_bytes, message }, Some(_)) => Error::OutOfDeviceMemory {
            what,
            needed_bytes,
            message: format!(
                "{message}; a MoE model can keep its experts in host memory: give the GPU memory \
                 the weights may take (--gpu-memory, LoadOptions::gpu_memory)"
            ),
        },
        (e, _) => e,
    }
}

/// How a MoE model's experts stream: GPU slots per MoE layer and, per
/// layer, where its experts are (`None` for dense layers).
struct StreamingPlan {
    slots: usize,
    layers: Vec<Option<StreamedLayer>>,
}

/// A device's budget error in a split, naming the device and its layers.
fn on_device(e: Error, part: &split::StagePart, device: &str) -> Error {
    match e {
        Error::OutOfDeviceMemory { what, needed_bytes, message } => Error::OutOfDeviceMemory {
            what: format!("{what} of layers {}..{} on {device}", part.layers.start, part.layers.end),
            needed_bytes,
            message,
        },
        e => e,
    }
}

/// The streaming a model's options ask for on the device that holds
/// `part` of it (`bytes` of weights; `None`: every weight is resident),
/// after checking what is placed against the device's budget.
fn plan_streaming(
    gpu: &Gpu,
    c: &ModelConfig,
    source: &dyn TensorSource,
    (part, total_bytes): (&split::StagePart, u64),
    options: &LoadOptions,
) -> Result<Option<StreamingPlan>> {
    let resident_only = |bytes: u64| -> Result<Option<StreamingPlan>> {
        if let Some(budget) = options.gpu_memory.filter(|&b| bytes > b) {
            return Err(Error::OutOfDeviceMemory {
                what: "model weights".into(),
                needed_bytes: Some(bytes),
                message: format!("the GPU memory budget (--gpu-memory) is {budget} bytes"),
            });
        }
        gpu.check_budget("model weights", bytes).map_err(|e| suggest_streaming(e, c))?;
        Ok(None)
    };
    if let (Some(n), None) = (options.expert_slots, &c.moe) {
        return Err(Error::Unsupported {
            what: "expert slots for a model without experts",
            value: format!("{n} slots for {}", c.model_type),
        });
    }
    let Some(moe) = c.moe.as_ref().filter(|_| !options.streams_nothing()) else {
        return resident_only(total_bytes);
    };
    let streams = |l: usize| part.layers.contains(&l) && moe.sparse_layers[l];
    let layers = (0..c.layers)
        .map(|l| streams(l).then(|| streamed_layer(c, moe, source, l)).transpose())
        .collect::<Result<Vec<_>>>()?;
    if layers.iter().all(Option::is_none) {
        return resident_only(total_bytes);
    }
    let per_slot: u64 = layers.iter().flatten().map(|s| s.expert_bytes(c.hidden, moe.intermediate)).sum();
    let resident = total_bytes.saturating_sub(moe.experts as u64 * per_slot);
    let slots = match (options.expert_slots, options.gpu_memory) {
        (Some(n), _) if n < moe.top_k => {
            return Err(Error::Unsupported {
                what: "expert slots per MoE layer (at least the router's top-k)",
                value: format!("{n} slots, top-k {}", moe.top_k),
            });
        }
        (Some(n), _) => n,
        (None, Some(budget)) => experts::slots_for_budget(budget, resident, per_slot, moe)?,
        (None, None) => unreachable!("filtered above"),
    };
    if slots >= moe.experts {
        return resident_only(total_bytes);
    }
    gpu.check_budget("resident weights and expert slots", resident + slots as u64 * per_slot)?;
    Ok(Some(StreamingPlan { slots, layers }))
}

/// Where layer `layer`'s experts are and their formats, which a streamed
/// layer's slots must share.
fn streamed_layer(
    c: &ModelConfig,
    moe: &MoeConfig,
    source: &dyn TensorSource,
    layer: usize,
) -> Result<StreamedLayer> {
    let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
    let (h, i, e) = (c.hidden, moe.intermediate, moe.experts);
    let fused = name("mlp.experts.gate_up_proj");
    let tensors = if source.contains(&fused) {
        source.check_shape(&fused, &[e, 2 * i, h])?;
        ExpertTensors::Fused { gate_up: fused, down: name("mlp.experts.down_proj") }
    } else {
        let names = c.family.moe.expect("a MoE config comes from a MoE family").names;
        let expert = |x: usize, which: &str| name(&format!("{}.experts.{x}.{which}.weight", names.block));
        ExpertTensors::PerExpert {
            gate: (0..e).map(|x| expert(x, names.gate)).collect(),
            up: (0..e).map(|x| expert(x, names.up)).collect(),
            down: (0..e).map(|x| expert(x, names.down)).collect(),
        }
    };
    let one_format = |names: &[&String], shape: &[usize]| -> Result<WeightFormat> {
        let mut formats = names.iter().map(|n| {
            source.check_shape(n, shape)?;
            source.format(n)
        });
        let first = formats.next().expect("a MoE layer has experts")?;
        for (n, f) in names.iter().zip(formats) {
            let f = f?;
            if f != first {
                return Err(Error::Unsupported {
                    what: "streamed experts stored in different formats",
                    value: format!("{n} is {f}, {} is {first}", names[0]),
                });
            }
        }
        Ok(first)
    };
    let (gate_up_format, down_format) = match &tensors {
        ExpertTensors::Fused { gate_up, down } => {
            (one_format(&[gate_up], &[e, 2 * i, h])?, one_format(&[down], &[e, h, i])?)
        }
        ExpertTensors::PerExpert { gate, up, down } => {
            let gate_up: Vec<&String> = gate.iter().chain(up).collect();
            (one_format(&gate_up, &[i, h])?, one_format(&down.iter().collect::<Vec<_>>(), &[h, i])?)
        }
    };
    for (format, cols) in [(gate_up_format, h), (down_format, i)] {
        if !format.fits_row(cols) {
            return Err(Error::Unsupported {
                what: "row width for the experts' format",
                value: format!("layer {layer}: {cols} columns of {format}"),
            });
        }
    }
    Ok(StreamedLayer { tensors, gate_up_format, down_format })
}

/// A loaded model, ready to open sessions on.
#[derive(Debug)]
pub struct Model {
    /// The model's shape and family, from its config.json or GGUF metadata.
    pub config: ModelConfig,
    pub(crate) gpu: Gpu,
    pub(crate) weights: Weights,
    pub(crate) kernels: Kernels,
    /// `Some` when routed experts live in host memory and stream into GPU
    /// slots ([`LoadOptions`]).
    pub(crate) experts: Option<ExpertStreaming>,
    /// Where the model's files describe its tokenizer, read on request
    /// ([`Model::tokenizer`]), so that a caller who gives ids never needs it.
    tokenizer_source: Option<PathBuf>,
    /// How the model's images become patches (a folder's
    /// preprocessor_config.json, for a model with a vision tower).
    pub(crate) image_processor: Option<crate::vision::ImageProcessor>,
    /// The part of the model this device holds (all of it on one device).
    pub(crate) part: split::StagePart,
    /// The parts on the devices after this one, in order.
    next_parts: Vec<Model>,
}

impl Model {
    /// The model's layers this device holds, by their numbers in the model.
    pub(crate) fn layers(&self) -> std::ops::Range<usize> {
        self.part.layers.clone()
    }

    /// The weights of layer `layer` (numbered in the model), which this
    /// device holds.
    pub(crate) fn layer(&self, layer: usize) -> &LayerWeights {
        &self.weights.layers[layer - self.part.layers.start]
    }

    /// The device the model is loaded on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// How the model's images become patches (Qwen3-VL), where it has a
    /// vision tower.
    pub fn image_processor(&self) -> Option<&crate::vision::ImageProcessor> {
        self.image_processor.as_ref()
    }

    /// Bytes of weights on the GPU (streamed experts' slots included; on
    /// every device of a split).
    pub fn weight_bytes(&self) -> u64 {
        self.devices().map(|part| part.weights.bytes()).sum()
    }

    /// The weights on the GPU, layer by layer.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The expert cache, where experts stream from host memory.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn experts(&self) -> Option<&ExpertStreaming> {
        self.experts.as_ref()
    }

    /// Loads `path` onto `gpu`: a Hugging Face folder (config.json +
    /// safetensors, sharded or not; weights as bf16) or a GGUF file (or the
    /// first of a split set, or a folder holding one and no config.json;
    /// weights in their stored formats).
    ///
    /// ```no_run
    /// use wgspark::{Gpu, Model};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = Gpu::from_env()?;
    /// // A Hugging Face folder: config.json, safetensors, tokenizer.json ...
    /// let model = Model::load("path/to/SmolLM2-135M-Instruct", &gpu)?;
    /// // ... or a GGUF file, its tokenizer and chat template in its metadata.
    /// let model = Model::load("path/to/model.Q4_K_M.gguf", &gpu)?;
    /// let c = &model.config;
    /// println!("{}: {} layers of width {}", c.model_type, c.layers, c.hidden);
    /// println!("{} bytes of weights on the GPU", model.weight_bytes());
    /// # Ok(()) }
    /// ```
    pub fn load(path: impl AsRef<Path>, gpu: &Gpu) -> Result<Model> {
        Self::load_with_progress(path, gpu, |_| {})
    }

    /// [`Self::load`], reporting the weights' upload to `progress` (one
    /// step, in bytes).
    pub fn load_with_progress(
        path: impl AsRef<Path>,
        gpu: &Gpu,
        progress: impl FnMut(Progress<'_>),
    ) -> Result<Model> {
        Self::load_with(path, gpu, &LoadOptions::default(), progress)
    }

    /// [`Self::load_with_progress`], with a GPU memory budget or a number of
    /// expert slots that streams a MoE model's experts.
    ///
    /// ```no_run
    /// use wgspark::{Gpu, LoadOptions, Model, Progress};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = Gpu::from_env()?;
    /// // The weights may take 12 GiB of GPU memory: what is not resident is
    /// // expert slots, and the experts stream into them from host memory.
    /// let options = LoadOptions { gpu_memory: Some(12 << 30), ..LoadOptions::default() };
    /// let model = Model::load_with("path/to/Qwen3-30B-A3B", &gpu, &options, |p| {
    ///     if let Progress::Begin { what, total_bytes } = p {
    ///         eprintln!("{what}: {total_bytes:?} bytes");
    ///     }
    /// })?;
    /// println!("{} bytes of weights on the GPU", model.weight_bytes());
    /// # Ok(()) }
    /// ```
    pub fn load_with(
        path: impl AsRef<Path>,
        gpu: &Gpu,
        options: &LoadOptions,
        progress: impl FnMut(Progress<'_>),
    ) -> Result<Model> {
        Self::load_on(path.as_ref(), std::slice::from_ref(gpu), None, options, progress)
    }

    /// [`Self::load_with`], the layers split across `gpus` in order (see
    /// [`split::split_layers`]): in proportion to each device's memory
    /// budget (or memory), or to `shares`, one per device. The first
    /// device holds the embedding, the last the final norm and the head.
    /// Sessions run each token through the devices in turn, the residual
    /// rows copied from one to the next through host memory. A split
    /// model has no vision tower. Where `options` stream experts, each
    /// device streams those of its layers: [`LoadOptions::gpu_memory`] is
    /// then each device's budget (and, without `shares`, the layers are
    /// shared out equally), [`LoadOptions::expert_slots`] each of its MoE
    /// layers' slots.
    pub fn load_split(
        path: impl AsRef<Path>,
        gpus: &[Gpu],
        shares: Option<&[f64]>,
        options: &LoadOptions,
        progress: impl FnMut(Progress<'_>),
    ) -> Result<Model> {
        Self::load_on(path.as_ref(), gpus, shares, options, progress)
    }

    fn load_on(
        dir: &Path,
        gpus: &[Gpu],
        shares: Option<&[f64]>,
        options: &LoadOptions,
        mut progress: impl FnMut(Progress<'_>),
    ) -> Result<Model> {
        let (config, checkpoint, bytes, tokenizer_source): (_, Arc<dyn TensorSource + Send + Sync>, _, _) =
            match gguf_checkpoint::gguf_in(dir)? {
                Some(file) => {
                    let checkpoint = gguf_checkpoint::GgufCheckpoint::open(&file)?;
                    let config = checkpoint.config()?;
                    let bytes = checkpoint.gpu_bytes();
                    (config, Arc::new(checkpoint), bytes, file)
                }
                None => {
                    let config = ModelConfig::load(dir)?;
                    let bytes = config.weight_bytes();
                    // Before the checkpoint is opened: a model too large fails first.
                    if let ([gpu], true) = (gpus, options.streams_nothing()) {
                        gpu.check_budget("model weights", bytes)
                            .map_err(|e| suggest_streaming(e, &config))?;
                    }
                    let checkpoint = Checkpoint::open(dir, config.quantization)?
                        .transposing_fused_experts(config.family.transposed_experts);
                    (config, Arc::new(checkpoint), bytes, dir.to_path_buf())
                }
            };
        let what = format!("loading {}", dir.display());
        let mut model = match gpus {
            [gpu] => Self::place(config, gpu, checkpoint, bytes, options, (&what, &mut progress))?,
            _ => Self::place_split(config, gpus, shares, checkpoint, bytes, options, (&what, &mut progress))?,
        };
        if let (Some(v), true) = (&model.config.vision, tokenizer_source.is_dir()) {
            let path = tokenizer_source.join("preprocessor_config.json");
            if path.exists() {
                model.image_processor = Some(image_processor_for(v, &tokenizer_source, &path)?);
            }
        }
        model.tokenizer_source = Some(tokenizer_source);
        Ok(model)
    }

    /// The model of `config` with weights from `source` (`bytes` of them),
    /// resident or with experts streamed as `options` ask; the upload is
    /// reported to `progress` as `what`.
    fn place(
        config: ModelConfig,
        gpu: &Gpu,
        source: Arc<dyn TensorSource + Send + Sync>,
        bytes: u64,
        options: &LoadOptions,
        (what, progress): (&str, &mut dyn FnMut(Progress<'_>)),
    ) -> Result<Model> {
        let part = split::StagePart::whole(config.layers);
        let streaming = plan_streaming(gpu, &config, source.as_ref(), (&part, bytes), options)?;
        progress(Progress::Begin { what, total_bytes: Some(bytes) });
        let model = Self::place_part(&config, gpu, source, (part, streaming), progress)?;
        progress(Progress::End);
        Ok(model)
    }

    /// The model's `part` on `gpu`, its experts streamed as `streaming`
    /// plans (from `source`, as the weights).
    fn place_part(
        config: &ModelConfig,
        gpu: &Gpu,
        source: Arc<dyn TensorSource + Send + Sync>,
        (part, streaming): (split::StagePart, Option<StreamingPlan>),
        progress: &mut dyn FnMut(Progress<'_>),
    ) -> Result<Model> {
        let weights = upload(gpu, config, source.as_ref(), (streaming.as_ref(), &part), progress)?;
        let experts = match (streaming, &config.moe) {
            (Some(plan), Some(moe)) => {
                let experts =
                    ExpertStreaming::new(gpu, source, moe, (config.hidden, plan.slots), plan.layers);
                experts.fill_slots(gpu, &weights, part.layers.start)?;
                Some(experts)
            }
            _ => None,
        };
        Ok(Model {
            config: config.clone(),
            gpu: gpu.clone(),
            weights,
            kernels: Kernels::new(gpu)?,
            experts,
            tokenizer_source: None,
            image_processor: None,
            part,
            next_parts: Vec::new(),
        })
    }

    /// The model of `config` with weights from `source` split across
    /// `gpus` (see [`Self::load_split`]); the upload is reported to
    /// `progress` as `what`.
    fn place_split(
        config: ModelConfig,
        gpus: &[Gpu],
        shares: Option<&[f64]>,
        source: Arc<dyn TensorSource + Send + Sync>,
        bytes: u64,
        options: &LoadOptions,
        (what, progress): (&str, &mut dyn FnMut(Progress<'_>)),
    ) -> Result<Model> {
        if config.vision.is_some() {
            return Err(Error::Unsupported {
                what: "a split across devices of a model with a vision tower",
                value: format!("{} over {} devices", config.model_type, gpus.len()),
            });
        }
        let name = |i: usize, gpu: &Gpu| format!("{i}: {}", gpu.info.name);
        let rooms: Vec<split::DeviceRoom> = gpus
            .iter()
            .enumerate()
            .map(|(i, gpu)| split::DeviceRoom {
                name: name(i, gpu),
                bytes: options
                    .gpu_memory
                    .or(gpu.caps.memory_budget)
                    .or(gpu.caps.device_memory)
                    .unwrap_or(u64::MAX),
            })
            .collect();
        let split_bytes = split::SplitBytes::estimate(&config, bytes);
        // Where experts stream, each device streams its own layers' within
        // its room: the layers are shared out whatever their bytes.
        let ranges = match options.streams_nothing() {
            true => split::split_layers(&split_bytes, &rooms, shares)?,
            false => split::share_layers(&split_bytes, &rooms, shares)?,
        };
        let last = ranges.len() - 1;
        let mut plans = Vec::with_capacity(ranges.len());
        for (i, (layers, gpu)) in ranges.into_iter().zip(gpus).enumerate() {
            let part = split::StagePart { layers, begins: i == 0, ends: i == last };
            let part_bytes = split_bytes.of(&part);
            let streaming = plan_streaming(gpu, &config, source.as_ref(), (&part, part_bytes), options)
                .map_err(|e| on_device(e, &part, &name(i, gpu)))?;
            plans.push((part, streaming));
        }
        progress(Progress::Begin { what, total_bytes: Some(bytes) });
        let mut parts = Vec::with_capacity(plans.len());
        for ((part, streaming), gpu) in plans.into_iter().zip(gpus) {
            parts.push(Self::place_part(&config, gpu, source.clone(), (part, streaming), progress)?);
        }
        progress(Progress::End);
        let mut first = parts.remove(0);
        first.next_parts = parts;
        Ok(first)
    }

    /// [`Self::synthetic`] split across `gpus` (see [`Self::load_split`]).
    pub fn synthetic_split(
        config: ModelConfig,
        gpus: &[Gpu],
        shares: Option<&[f64]>,
        seed: u64,
    ) -> Result<Model> {
        Self::synthetic_split_with(config, gpus, shares, seed, &LoadOptions::default())
    }

    /// [`Self::synthetic_split`] with [`LoadOptions`]: random experts
    /// stream from host memory on each device like a checkpoint's.
    pub fn synthetic_split_with(
        config: ModelConfig,
        gpus: &[Gpu],
        shares: Option<&[f64]>,
        seed: u64,
        options: &LoadOptions,
    ) -> Result<Model> {
        let source = Arc::new(synthetic::RandomWeights::new(seed));
        let bytes = config.weight_bytes();
        Self::place_split(config, gpus, shares, source, bytes, options, ("random weights", &mut |_| {}))
    }

    /// The devices after this one, in order, each with its part of the
    /// layers (none: the model is on one device).
    pub(crate) fn next_parts(&self) -> &[Model] {
        &self.next_parts
    }

    /// This device's part and those after it, in order.
    fn devices(&self) -> impl Iterator<Item = &Model> {
        std::iter::once(self).chain(&self.next_parts)
    }

    /// The expert streaming of the first device that streams experts (of
    /// any device of a split).
    pub(crate) fn streamed_experts(&self) -> Option<&ExpertStreaming> {
        self.devices().find_map(|part| part.experts.as_ref())
    }

    /// The layers each device holds, in device order (one range where the
    /// model is on one device).
    pub fn layer_split(&self) -> Vec<std::ops::Range<usize>> {
        self.devices().map(Model::layers).collect()
    }

    /// The chat template the model's files carry: a GGUF's
    /// `tokenizer.chat_template` or a folder's tokenizer_config.json
    /// (`None`: they carry none).
    pub fn chat_template(&self) -> Result<Option<crate::chat::ChatTemplate>> {
        match &self.tokenizer_source {
            None => Ok(None),
            Some(path) if path.is_dir() => crate::chat::ChatTemplate::from_folder(path),
            Some(path) => crate::chat::ChatTemplate::from_gguf(&crate::gguf::Gguf::open(path)?),
        }
    }

    /// The tokenizer the model's files describe: a folder's tokenizer.json,
    /// or a GGUF file's metadata (`None`: there is none, or its kind is not
    /// one [`crate::tokenizer`] builds).
    pub fn tokenizer(&self) -> Result<Option<crate::tokenizer::Tokenizer>> {
        match &self.tokenizer_source {
            None => Ok(None),
            Some(path) if path.is_dir() => crate::tokenizer::from_folder(path),
            Some(path) => crate::tokenizer::from_gguf(&crate::gguf::Gguf::open(path)?),
        }
    }

    /// A model of `config`'s shapes with seeded random bf16 weights (scaled
    /// by `1/sqrt(fan_in)`; a MoE layer's experts share one random tensor
    /// per projection), for benchmarks at full size without a checkpoint.
    pub fn synthetic(config: ModelConfig, gpu: &Gpu, seed: u64) -> Result<Model> {
        Self::synthetic_with(config, gpu, seed, &LoadOptions::default())
    }

    /// [`Self::synthetic`] with [`LoadOptions`]: random experts stream
    /// from host memory like a checkpoint's.
    pub fn synthetic_with(config: ModelConfig, gpu: &Gpu, seed: u64, options: &LoadOptions) -> Result<Model> {
        let source = Arc::new(synthetic::RandomWeights::new(seed));
        let bytes = config.weight_bytes();
        Self::place(config, gpu, source, bytes, options, ("random weights", &mut |_| {}))
    }
}

/// The folder's image processor, which must cut the patches the tower reads.
fn image_processor_for(
    v: &vision::VisionConfig,
    dir: &Path,
    path: &Path,
) -> Result<crate::vision::ImageProcessor> {
    let p = crate::vision::ImageProcessor::load(dir)?;
    if (p.patch_size, p.temporal_patch_size, p.merge_size)
        != (v.patch_size, v.temporal_patch_size, v.merge_size)
    {
        return Err(Error::InvalidConfig {
            path: path.to_path_buf(),
            message: format!(
                "patch_size {}, temporal_patch_size {} and merge_size {} differ from the vision tower's {}, {} and {}",
                p.patch_size,
                p.temporal_patch_size,
                p.merge_size,
                v.patch_size,
                v.temporal_patch_size,
                v.merge_size
            ),
        });
    }
    Ok(p)
}

/// Uploads the weights of `part` of the model (its layers, and the
/// embedding and output where it begins or ends the model); with a
/// streaming plan, a streamed layer's experts get the plan's number of
/// empty slots instead.
fn upload(
    gpu: &Gpu,
    c: &ModelConfig,
    checkpoint: &dyn TensorSource,
    (streaming, part): (Option<&StreamingPlan>, &split::StagePart),
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Weights> {
    let mut up = Uploader::new(gpu, checkpoint, progress);
    let (hidden, heads) = (c.hidden, c.heads);
    let q_rows = heads.q * heads.dim;
    let kv_rows = heads.kv * heads.dim;

    let embed_name = "model.embed_tokens.weight";
    let embed = part.begins.then(|| up.matrix(embed_name, c.vocab, hidden)).transpose()?;
    let mut layers = Vec::with_capacity(part.layers.len());
    for i in part.layers.clone() {
        let name = |suffix: &str| format!("model.layers.{i}.{suffix}");
        let (q, k, v) = (
            name("self_attn.q_proj.weight"),
            name("self_attn.k_proj.weight"),
            name("self_attn.v_proj.weight"),
        );
        let (q_norm, k_norm) = match c.family.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(up.norm(&name("self_attn.q_norm.weight"), heads.dim)?),
                Some(up.norm(&name("self_attn.k_norm.weight"), heads.dim)?),
            ),
            QkNorm::WholeProjection => (
                Some(up.norm(&name("self_attn.q_norm.weight"), q_rows)?),
                Some(up.norm(&name("self_attn.k_norm.weight"), kv_rows)?),
            ),
        };
        layers.push(LayerWeights {
            attn_norm: up.norm(&name("input_layernorm.weight"), hidden)?,
            qkv: up.stack(
                &name("self_attn.qkv"),
                &[(&q, q_rows), (&k, kv_rows), (&v, kv_rows)],
                hidden,
                1,
            )?,
            q_norm,
            k_norm,
            o_proj: up.matrix(&name("self_attn.o_proj.weight"), hidden, q_rows)?,
            ffn_norm: up.norm(&name("post_attention_layernorm.weight"), hidden)?,
            ffn: match &c.moe {
                Some(moe) if moe.sparse_layers[i] => FfnWeights::Moe(match streaming {
                    Some(plan) => {
                        let layer = plan.layers[i].as_ref().expect("the plan has every MoE layer");
                        moe_slots(&mut up, gpu, c, moe, i, plan.slots, layer)?
                    }
                    None => upload_moe(&mut up, c, moe, i)?,
                }),
                _ => FfnWeights::Dense {
                    gate_up: up.gate_up(
                        &name("mlp.gate_up"),
                        &[
                            (&name("mlp.gate_proj.weight"), &[c.intermediate, hidden]),
                            (&name("mlp.up_proj.weight"), &[c.intermediate, hidden]),
                        ],
                        c.intermediate,
                        hidden,
                    )?,
                    down: up.matrix(&name("mlp.down_proj.weight"), hidden, c.intermediate)?,
                },
            },
        });
    }
    let output = match part.ends {
        true => {
            let final_norm = up.norm("model.norm.weight", hidden)?;
            // Tied embeddings: the embedding where this part holds it, else
            // a copy of it as the head.
            let lm_head = match (c.tie_embeddings, part.begins) {
                (true, true) => None,
                (true, false) => Some(up.matrix(embed_name, c.vocab, hidden)?),
                (false, _) => Some(up.matrix("lm_head.weight", c.vocab, hidden)?),
            };
            Some(layers::OutputWeights { final_norm, lm_head })
        }
        false => None,
    };
    let vision = match part.begins {
        true => c.vision.as_ref().map(|v| vision::upload(&mut up, v)).transpose()?,
        false => None,
    };
    up.flush()?;
    Ok(Weights { embed, layers, output, vision })
}

/// A streamed MoE layer: its router (resident) and `slots` empty expert
/// slots in the experts' formats. Slots of a format whose values may
/// exceed f16's range are marked [`crate::gpu::TensorPart::beyond_f16`]
/// whatever the experts hold: plans are made before the experts arrive,
/// and checking every expert at load would read the whole file.
fn moe_slots(
    up: &mut Uploader<'_>,
    gpu: &Gpu,
    c: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
    slots: usize,
    streamed: &StreamedLayer,
) -> Result<MoeWeights> {
    let (h, i) = (c.hidden, moe.intermediate);
    let label = |what: &str| format!("model.layers.{layer}.experts.{what} ({slots} slots)");
    let (router, score_bias) = upload_router(up, c, moe, layer)?;
    let slots_of = |what: &str, format: WeightFormat, (rows, cols, group): (usize, usize, usize)| {
        let mut tensor = GpuTensor::alloc_in(gpu, &label(what), format, rows, cols, group)?;
        if format.may_exceed_f16() {
            tensor.mark_beyond_f16(0..rows);
        }
        Ok::<_, Error>(tensor)
    };
    Ok(MoeWeights {
        router,
        score_bias,
        gate_up: slots_of("gate_up", streamed.gate_up_format, (slots * 2 * i, h, 2 * i))?,
        down: slots_of("down", streamed.down_format, (slots * h, i, h))?,
    })
}

/// A MoE layer's router and its score-correction bias, if the family has one.
fn upload_router(
    up: &mut Uploader<'_>,
    c: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
) -> Result<(GpuTensor, Option<wgpu::Buffer>)> {
    let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
    let names = c.family.moe.expect("a MoE config comes from a MoE family").names;
    let block = if up.contains(&name("mlp.experts.gate_up_proj")) { "mlp" } else { names.block };
    let score_bias = match moe.selection {
        ExpertSelection::SigmoidWithBias => {
            Some(up.f32_vector(&name(&format!("{block}.e_score_correction_bias")), moe.experts)?)
        }
        ExpertSelection::Softmax { .. } => None,
    };
    let router = up.matrix(&name(&format!("{block}.{}.weight", names.router)), moe.experts, c.hidden)?;
    Ok((router, score_bias))
}

/// A MoE layer, from the fused 3-D layout (`mlp.experts.gate_up_proj`) when
/// the checkpoint has it, else from the family's per-expert tensors.
fn upload_moe(up: &mut Uploader<'_>, c: &ModelConfig, moe: &MoeConfig, layer: usize) -> Result<MoeWeights> {
    let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
    let (h, i, e) = (c.hidden, moe.intermediate, moe.experts);
    let fused = name("mlp.experts.gate_up_proj");
    let names = c.family.moe.expect("a MoE config comes from a MoE family").names;
    let block = if up.contains(&fused) { "mlp" } else { names.block };
    let (gate_up, down) = if up.contains(&fused) {
        (
            up.gate_up(&fused, &[(&fused, &[e, 2 * i, h])], i, h)?,
            up.experts(&name("mlp.experts.down_proj"), e, h, i)?,
        )
    } else {
        let expert = |x: usize, which: &str| name(&format!("{block}.experts.{x}.{which}.weight"));
        let gate_up_names: Vec<(String, String)> =
            (0..e).map(|x| (expert(x, names.gate), expert(x, names.up))).collect();
        let shape = [i, h];
        let gate_up_sources: Vec<(&str, &[usize])> = gate_up_names
            .iter()
            .flat_map(|(g, u)| [(g.as_str(), &shape[..]), (u.as_str(), &shape[..])])
            .collect();
        let down_names: Vec<String> = (0..e).map(|x| expert(x, names.down)).collect();
        let down_sources: Vec<(&str, usize)> = down_names.iter().map(|d| (d.as_str(), h)).collect();
        (
            up.gate_up(&name(&format!("{block}.experts.gate_up")), &gate_up_sources, i, h)?,
            up.stack(&name(&format!("{block}.experts.down")), &down_sources, i, h)?,
        )
    };
    let (router, score_bias) = upload_router(up, c, moe, layer)?;
    Ok(MoeWeights { router, score_bias, gate_up, down })
}
