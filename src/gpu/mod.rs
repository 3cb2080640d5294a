//! The GPU context: adapter and device selection, the features and limits
//! the kernels specialise on, buffer helpers and readback.

mod buffers;
pub(crate) mod cooperative_matrix;
mod driver_facts;
mod measure;
mod readback;
mod tensor;
mod upload_ring;

#[cfg(feature = "internals")]
pub use buffers::encode_all;
pub use buffers::{Dispatch, ParamsBuffer, in_order};
pub(crate) use measure::PassTimestamps;
pub use readback::{MapWait, Readback};
pub use tensor::{GpuTensor, TensorPart};
pub use upload_ring::{Upload, UploadRing};

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// A graphics API wgpu can drive. `Auto` takes the best adapter of any
/// native API (discrete GPU first), falling back to GL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The best adapter of Vulkan, Metal or DX12, else GL's (`auto`).
    Auto,
    /// Vulkan (`vulkan`, `vk`).
    Vulkan,
    /// Metal (`metal`, `mtl`).
    Metal,
    /// Direct3D 12 (`dx12`, `d3d12`).
    Dx12,
    /// OpenGL or OpenGL ES (`gl`, `gles`, `opengl`); compute shaders need
    /// OpenGL 4.3 or OpenGL ES 3.1.
    Gl,
}

impl Backend {
    /// The backend named by `WGSPARK_BACKEND`, or `Auto` when it is unset.
    pub fn from_env() -> Result<Self> {
        match std::env::var("WGSPARK_BACKEND") {
            Ok(name) if !name.is_empty() => name.parse(),
            _ => Ok(Backend::Auto),
        }
    }

    fn wgpu_backends(self) -> wgpu::Backends {
        match self {
            Backend::Auto => wgpu::Backends::PRIMARY,
            Backend::Vulkan => wgpu::Backends::VULKAN,
            Backend::Metal => wgpu::Backends::METAL,
            Backend::Dx12 => wgpu::Backends::DX12,
            Backend::Gl => wgpu::Backends::GL,
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "auto" => Ok(Backend::Auto),
            "vulkan" | "vk" => Ok(Backend::Vulkan),
            "metal" | "mtl" => Ok(Backend::Metal),
            "dx12" | "d3d12" => Ok(Backend::Dx12),
            "gl" | "gles" | "opengl" => Ok(Backend::Gl),
            _ => Err(Error::UnknownBackend(name.to_string())),
        }
    }
}

/// How to open a [`Gpu`].
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Which API's adapters to choose from.
    pub backend: Backend,
    /// Lowers the largest storage binding the engine will use below the
    /// adapter's limit; tensors larger than this are split into row ranges.
    /// Exists to exercise the split path on adapters with a large limit.
    pub max_storage_binding: Option<u64>,
    /// Most bytes of device memory the engine may use for one model and
    /// its session (weights, KV cache, activations). Loading beyond it
    /// fails with `OutOfDeviceMemory` before anything is allocated; the
    /// driver's own out-of-memory errors are reported the same way.
    pub memory_budget: Option<u64>,
    /// Whether chunk products (prefill) run on cooperative matrices.
    pub cooperative_matrix: CooperativeMatrix,
    /// Which of [`Gpu::adapters`] of `backend` to open (`generate
    /// --adapter N`); `None`: the first, the best one.
    pub adapter: Option<usize>,
}

impl GpuOptions {
    /// The defaults, with the backend, the cooperative-matrix mode and the
    /// adapter that `WGSPARK_BACKEND`, `WGSPARK_COOPERATIVE_MATRIX` and
    /// `WGSPARK_ADAPTER` (an index into [`Gpu::adapters`]) name.
    pub fn from_env() -> Result<Self> {
        let adapter = match std::env::var("WGSPARK_ADAPTER") {
            Ok(n) if !n.trim().is_empty() => {
                Some(n.trim().parse().map_err(|_| Error::InvalidAdapterIndex { given: n.clone() })?)
            }
            _ => None,
        };
        Ok(GpuOptions {
            backend: Backend::from_env()?,
            cooperative_matrix: CooperativeMatrix::from_env()?,
            adapter,
            ..GpuOptions::default()
        })
    }
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            backend: Backend::Auto,
            max_storage_binding: None,
            memory_budget: None,
            cooperative_matrix: CooperativeMatrix::Auto,
            adapter: None,
        }
    }
}

/// Use of cooperative matrices (tensor cores) by the prefill GEMM, which
/// otherwise runs on the f32 ALUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CooperativeMatrix {
    /// Where the adapter offers the configuration the kernel is written
    /// for (see `cooperative_matrix::usable`).
    Auto,
    /// Never: the f32 GEMM everywhere.
    Off,
    /// Always: opening a device that lacks it is an error.
    On,
}

impl CooperativeMatrix {
    /// The choice named by `WGSPARK_COOPERATIVE_MATRIX` (`auto`, `on`,
    /// `off`), or `Auto` when it is unset.
    pub fn from_env() -> Result<Self> {
        match std::env::var("WGSPARK_COOPERATIVE_MATRIX") {
            Ok(name) if !name.is_empty() => name.parse(),
            _ => Ok(CooperativeMatrix::Auto),
        }
    }
}

impl std::str::FromStr for CooperativeMatrix {
    type Err = Error;
    fn from_str(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "auto" => Ok(CooperativeMatrix::Auto),
            "on" => Ok(CooperativeMatrix::On),
            "off" => Ok(CooperativeMatrix::Off),
            _ => Err(Error::Unsupported {
                what: "cooperative matrix mode (auto, on or off)",
                value: name.to_string(),
            }),
        }
    }
}

/// What the kernels may use on this adapter, decided once at device
/// creation. Pipelines pick their variant from this.
#[derive(Debug, Clone)]
pub struct Caps {
    /// f16 arithmetic in shaders (SHADER_F16).
    pub shader_f16: bool,
    /// `pack2x16float` / `unpack2x16float` work (all but some Mesa Vulkan
    /// drivers without SHADER_F16).
    pub f16_in_f32: bool,
    /// Subgroup operations (SUBGROUP).
    pub subgroups: bool,
    /// GPU timestamps inside compute passes.
    pub timestamps: bool,
    /// The prefill GEMM runs on cooperative matrices (the device was opened
    /// with the experimental feature).
    pub cooperative_matrix: bool,
    /// A CPU rasteriser (lavapipe, llvmpipe, WARP): favours one row per
    /// invocation over workgroup reductions.
    pub is_cpu: bool,
    /// Most bytes one storage binding may hold (larger tensors are split).
    pub max_storage_binding: u64,
    /// Most bytes one buffer may hold.
    pub max_buffer_size: u64,
    /// Most workgroups along one dimension of a dispatch.
    pub max_workgroups_per_dim: u32,
    /// Narrowest and widest subgroups the adapter runs.
    pub subgroup_min_size: u32,
    /// See `subgroup_min_size`.
    pub subgroup_max_size: u32,
    /// The caller's limit on the bytes the model may place on the device
    /// ([`GpuOptions::memory_budget`]).
    pub memory_budget: Option<u64>,
    /// The device's memory (its largest device-local heap), where the
    /// driver reports it.
    pub device_memory: Option<u64>,
    /// Multiprocessors (SMs, compute units), where the driver reports them.
    pub multiprocessors: Option<u32>,
}

/// An adapter as [`Gpu::adapters`] lists it, before a device is opened on it.
#[derive(Debug, Clone)]
pub struct AdapterSummary {
    /// Its name, backend, device type and driver.
    pub info: wgpu::AdapterInfo,
    /// Its largest device-local memory heap (the host's memory for a CPU
    /// rasteriser), where the driver reports it.
    pub device_memory: Option<u64>,
    /// Its multiprocessors (SMs, compute units), where the driver reports them.
    pub multiprocessors: Option<u32>,
}

/// An open device: the adapter that was chosen, its queue, and what it can do.
#[derive(Clone)]
pub struct Gpu {
    /// The wgpu device that holds the engine's buffers and pipelines.
    pub device: wgpu::Device,
    /// The device's queue, which every submission goes to.
    pub queue: wgpu::Queue,
    /// The adapter's name, backend, device type and driver.
    pub info: wgpu::AdapterInfo,
    /// The optional features the device was opened with: those of
    /// SHADER_F16, SUBGROUP and TIMESTAMP_QUERY the adapter offers, and
    /// cooperative matrices where they are used.
    pub features: wgpu::Features,
    /// The device's limits (the adapter's own, all of them requested).
    pub limits: wgpu::Limits,
    /// What the kernels may use on this device, decided when it was opened.
    pub caps: Caps,
    errors: ErrorSink,
    /// Why the device was lost, once it is.
    lost: LostReason,
    /// Every specialised pipeline built on this device.
    pub(crate) pipelines: Arc<PipelineCache>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .field("caps", &self.caps)
            .finish()
    }
}

/// Optional features the kernels use where present.
const WANTED_FEATURES: wgpu::Features =
    wgpu::Features::SHADER_F16.union(wgpu::Features::SUBGROUP).union(wgpu::Features::TIMESTAMP_QUERY);

fn device_type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// A device's errors not yet reported.
type ErrorSink = Arc<Mutex<Vec<wgpu::Error>>>;
/// Why a device was lost, once it is.
type LostReason = Arc<Mutex<Option<String>>>;

/// Validation and out-of-memory errors are collected instead of
/// panicking, and turned into `Error`s at the next checkpoint; a lost
/// device's reason is kept for the same.
fn collect_errors(device: &wgpu::Device) -> (ErrorSink, LostReason) {
    let errors = ErrorSink::default();
    let sink = errors.clone();
    device.on_uncaptured_error(Arc::new(move |e| sink.lock().unwrap().push(e)));
    let lost = LostReason::default();
    let lost_reason = lost.clone();
    device.set_device_lost_callback(move |reason, message| {
        *lost_reason.lock().unwrap() = Some(format!("{reason:?}: {message}"));
    });
    (errors, lost)
}

/// What to do when a GL device will not open because of its context:
/// where the driver offers desktop OpenGL, wgpu's GL backend asks EGL for
/// an OpenGL 3.3 context, and a driver that gives exactly that (NVIDIA's,
/// headless) leaves out compute shaders, which need OpenGL 4.3 or OpenGL
/// ES 3.1.
fn gl_context_hint(backend: wgpu::Backend, driver_info: &str) -> Option<String> {
    let version: Vec<u32> = driver_info
        .split_whitespace()
        .next()?
        .split('.')
        .take(2)
        .map(|n| n.parse().ok())
        .collect::<Option<_>>()?;
    let old = backend == wgpu::Backend::Gl && !driver_info.contains("OpenGL ES") && version < vec![4, 3];
    old.then(|| {
        format!(
            "wgpu's GL backend got an OpenGL {driver_info} context, which has no compute shaders \
             (they need OpenGL 4.3 or OpenGL ES 3.1): use the Vulkan backend on this adapter \
             (--backend vulkan, WGSPARK_BACKEND=vulkan)"
        )
    })
}

impl Gpu {
    /// Opens the device [`GpuOptions::from_env`] describes: the best
    /// adapter of `WGSPARK_BACKEND` (or adapter `WGSPARK_ADAPTER` of it),
    /// with cooperative matrices as `WGSPARK_COOPERATIVE_MATRIX` says.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gpu = wgspark::Gpu::from_env()?;
    /// println!("{}", gpu.describe()); // the adapter, its backend and type
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<Self> {
        Self::new(&GpuOptions::from_env()?)
    }

    /// The adapters of `backend` the engine can run on (those with compute
    /// shaders), numbered as [`GpuOptions::adapter`] chooses them: each
    /// API's discrete GPUs first, then integrated, virtual and other ones,
    /// CPU rasterisers last; with [`Backend::Auto`], Vulkan's, Metal's and
    /// DX12's, then GL's.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// for (i, a) in wgspark::Gpu::adapters(wgspark::Backend::Auto).iter().enumerate() {
    ///     println!("{i}: {} ({:?}, {:?}, {:?} bytes)", a.info.name, a.info.backend, a.info.device_type, a.device_memory);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn adapters(backend: Backend) -> Vec<AdapterSummary> {
        let all = pollster::block_on(Self::candidates(backend, true));
        all.iter()
            .map(|a| AdapterSummary {
                info: a.get_info(),
                device_memory: driver_facts::device_memory(a),
                multiprocessors: driver_facts::multiprocessors(a),
            })
            .collect()
    }

    /// Opens the best adapter of `options.backend` (a discrete GPU before
    /// an integrated one, a CPU rasteriser last; only adapters with compute
    /// shaders) with its full limits and the optional features the kernels
    /// use. Fails with [`Error::NoAdapter`] where there is none,
    /// [`Error::Unsupported`] where cooperative matrices are
    /// [`CooperativeMatrix::On`] and not offered, and
    /// [`Error::RequestDevice`] where the device will not open.
    ///
    /// ```no_run
    /// use wgspark::{Backend, Gpu, GpuOptions};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let options = GpuOptions {
    ///     backend: Backend::Vulkan,
    ///     // Loads and sessions past 6 GiB fail before allocating.
    ///     memory_budget: Some(6 << 30),
    ///     ..GpuOptions::default()
    /// };
    /// let gpu = Gpu::new(&options)?;
    /// println!("{}", gpu.describe());
    /// # Ok(()) }
    /// ```
    pub fn new(options: &GpuOptions) -> Result<Self> {
        pollster::block_on(Self::open(options))
    }

    async fn open(options: &GpuOptions) -> Result<Self> {
        let adapter = Self::adapter(options.backend, options.adapter).await?;
        let info = adapter.get_info();
        let downlevel = adapter.get_downlevel_capabilities().flags;
        let mut features = adapter.features() & WANTED_FEATURES;
        let limits = adapter.limits();
        let cooperative = match options.cooperative_matrix {
            CooperativeMatrix::Off => false,
            CooperativeMatrix::Auto => cooperative_matrix::usable(&adapter),
            CooperativeMatrix::On if cooperative_matrix::usable(&adapter) => true,
            CooperativeMatrix::On => {
                return Err(Error::Unsupported {
                    what: "cooperative matrices (16 x 16 x 16 f16 products into f32, subgroups of 32)",
                    value: format!("not offered by {}", info.name),
                });
            }
        };
        if cooperative {
            features |= cooperative_matrix::FEATURES;
        }
        let experimental_features = if cooperative {
            // SAFETY: the only experimental feature requested; the kernel
            // that uses it is validated by naga and tested against the CPU
            // reference on every adapter that offers it.
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("wgspark"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features,
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| {
                let mut message = e.to_string();
                if let Some(hint) = gl_context_hint(info.backend, &info.driver_info) {
                    message.push_str(&format!(" ({hint})"));
                }
                Error::RequestDevice { adapter: info.name.clone(), message }
            })?;

        let (errors, lost) = collect_errors(&device);

        let mut max_storage_binding = limits.max_storage_buffer_binding_size;
        if let Some(cap) = options.max_storage_binding {
            max_storage_binding = max_storage_binding.min(cap);
        }
        let caps = Caps {
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            f16_in_f32: downlevel.contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            cooperative_matrix: cooperative,
            is_cpu: info.device_type == wgpu::DeviceType::Cpu || is_software_renderer(&info.name),
            max_storage_binding,
            max_buffer_size: limits.max_buffer_size,
            max_workgroups_per_dim: limits.max_compute_workgroups_per_dimension,
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            memory_budget: options.memory_budget,
            device_memory: driver_facts::device_memory(&adapter),
            multiprocessors: driver_facts::multiprocessors(&adapter),
        };
        Ok(Gpu { device, queue, info, features, limits, caps, errors, lost, pipelines: Arc::default() })
    }

    /// Adapter `index` of [`Self::adapters`], or the best adapter of
    /// `backend` (with `Backend::Auto`, GL's where no other backend has one).
    async fn adapter(backend: Backend, index: Option<usize>) -> Result<wgpu::Adapter> {
        let Some(index) = index else {
            let adapter = Self::candidates(backend, false).await.into_iter().next();
            return adapter.ok_or_else(|| Error::NoAdapter { tried: Self::tried(backend) });
        };
        let mut all = Self::candidates(backend, true).await;
        if index >= all.len() {
            let info = all.iter().map(|a| a.get_info());
            let adapters =
                info.enumerate().map(|(i, a)| format!("{i}: {} ({:?})", a.name, a.backend)).collect();
            return Err(Error::AdapterOutOfRange { index, adapters });
        }
        Ok(all.swap_remove(index))
    }

    /// The wgpu backends `backend` searches, as errors name them.
    fn tried(backend: Backend) -> String {
        let mut tried = vec![backend.wgpu_backends()];
        if backend == Backend::Auto {
            tried.push(wgpu::Backends::GL);
        }
        tried.iter().map(|b| format!("{b:?}")).collect::<Vec<_>>().join(", ")
    }

    /// The adapters of `backend` with compute shaders, best first; with
    /// `Backend::Auto`, GL's after the others' (`with_gl`), or only where
    /// there are no others.
    async fn candidates(backend: Backend, with_gl: bool) -> Vec<wgpu::Adapter> {
        let mut all = Self::ranked_adapters(backend.wgpu_backends()).await;
        if backend == Backend::Auto && (with_gl || all.is_empty()) {
            all.extend(Self::ranked_adapters(wgpu::Backends::GL).await);
        }
        all
    }

    async fn ranked_adapters(backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let mut adapters: Vec<wgpu::Adapter> = instance
            .enumerate_adapters(backends)
            .await
            .into_iter()
            // Compute shaders are all this engine needs.
            .filter(|a| a.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS))
            .collect();
        adapters.sort_by_key(|a| device_type_rank(a.get_info().device_type));
        adapters
    }

    /// One line naming the adapter and backend, for logs.
    pub fn describe(&self) -> String {
        let matrices = if self.caps.cooperative_matrix { ", cooperative matrices" } else { "" };
        let units = self.caps.multiprocessors.map(|n| format!(", {n} multiprocessors")).unwrap_or_default();
        format!("{} ({:?}, {:?}{matrices}{units})", self.info.name, self.info.backend, self.info.device_type)
    }

    /// Fails with `DeviceLost` once the device is lost.
    pub fn alive(&self) -> Result<()> {
        match self.lost.lock().unwrap().as_ref() {
            Some(reason) => Err(Error::DeviceLost { reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// Turns the first GPU error recorded since the last call into an
    /// `Error` (`DeviceLost` before any other: on a lost device every
    /// call fails).
    pub fn check(&self, what: &str) -> Result<()> {
        self.alive()?;
        let mut errors = self.errors.lock().unwrap();
        if errors.is_empty() {
            return Ok(());
        }
        let first = errors.remove(0);
        errors.clear();
        Err(match first {
            wgpu::Error::OutOfMemory { .. } => Error::OutOfDeviceMemory {
                what: what.to_string(),
                needed_bytes: None,
                message: "the device ran out of memory".to_string(),
            },
            other => {
                // The description is often in the source chain.
                let mut message = other.to_string();
                let mut source = std::error::Error::source(&other);
                while let Some(s) = source {
                    message.push_str(&format!(": {s}"));
                    source = s.source();
                }
                Error::Gpu(format!("{what}: {message}"))
            }
        })
    }

    /// Fails with `OutOfDeviceMemory` when `bytes` exceed the memory budget
    /// or the device's memory, checked before anything is allocated: a
    /// driver asked for more than it has may lose the device instead of
    /// refusing the allocation.
    pub fn check_budget(&self, what: &str, bytes: u64) -> Result<()> {
        let over = |limit: Option<u64>| limit.filter(|&limit| bytes > limit);
        let message = if let Some(budget) = over(self.caps.memory_budget) {
            format!("the device memory budget is {budget} bytes")
        } else if let Some(memory) = over(self.caps.device_memory) {
            format!("the device allows {memory} bytes")
        } else {
            return Ok(());
        };
        Err(Error::OutOfDeviceMemory { what: what.to_string(), needed_bytes: Some(bytes), message })
    }

    /// Blocks until all submitted work is done.
    pub fn wait(&self) -> Result<()> {
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| self.poll_error(e))?;
        Ok(())
    }

    /// A failed poll as an `Error`: `DeviceLost` where that is why.
    pub fn poll_error(&self, e: wgpu::PollError) -> Error {
        self.alive().err().unwrap_or_else(|| Error::Gpu(e.to_string()))
    }
}

/// Gives Mesa's drivers a private runtime directory when the environment
/// has none: without one, lavapipe prints `error: XDG_RUNTIME_DIR is invalid
/// or not set in the environment.` at every device creation (it looks for
/// a Wayland display there). A directory `wgspark-runtime` under the
/// temporary directory, readable by its owner only, is used; nothing
/// happens elsewhere than on Linux or when the variable names a directory.
///
/// # Safety
/// Changes the process environment, which other threads may be reading:
/// call it at the start of `main`, before any other thread starts.
pub unsafe fn set_runtime_dir_if_missing() {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::PermissionsExt;
        let valid = std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| std::path::Path::new(&d).is_dir());
        if valid {
            return;
        }
        let dir = std::env::temp_dir().join("wgspark-runtime");
        let private = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)));
        if private.is_ok() {
            // SAFETY: the caller guarantees no other thread is running.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
        }
    }
}

fn is_software_renderer(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["llvmpipe", "lavapipe", "softpipe", "swiftshader", "warp", "microsoft basic render"]
        .iter()
        .any(|s| name.contains(s))
}

#[cfg(test)]
mod tests {
    use super::gl_context_hint;

    /// NVIDIA's headless EGL gives wgpu OpenGL 3.3; Mesa gives 4.5, and a
    /// GLES context names itself.
    #[test]
    fn an_opengl_context_without_compute_gets_a_hint() {
        let hint = gl_context_hint(wgpu::Backend::Gl, "3.3.0 NVIDIA 580.159.04").expect("a hint");
        assert!(hint.contains("3.3.0 NVIDIA") && hint.contains("--backend vulkan"), "{hint}");
        assert_eq!(gl_context_hint(wgpu::Backend::Gl, "4.5 (Core Profile) Mesa 22.3.6"), None);
        assert_eq!(gl_context_hint(wgpu::Backend::Gl, "OpenGL ES 3.2 NVIDIA 580.159.04"), None);
        assert_eq!(gl_context_hint(wgpu::Backend::Vulkan, "3.3.0"), None);
    }
}

/// A device's compute pipelines by key, each built once, on first request
/// (a driver compiles a shader when its pipeline is created: never per
/// token), and the read-only tables their bindings share (a weight
/// format's grid), each uploaded once. What a key means, and how its
/// pipeline or table is made, is the kernels' business.
#[derive(Debug, Default)]
pub(crate) struct PipelineCache {
    pipelines: Mutex<std::collections::HashMap<String, wgpu::ComputePipeline>>,
    tables: Mutex<std::collections::HashMap<&'static str, wgpu::Buffer>>,
}

impl PipelineCache {
    /// The pipeline cached under `key`, built by `build` if there is none.
    pub(crate) fn get_or_build(
        &self,
        key: String,
        build: impl FnOnce() -> Result<wgpu::ComputePipeline>,
    ) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return Ok(p.clone());
        }
        let pipeline = build()?;
        self.pipelines.lock().unwrap().insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// The table cached under `name`, made by `make` if there is none.
    pub(crate) fn table(&self, name: &'static str, make: impl FnOnce() -> wgpu::Buffer) -> wgpu::Buffer {
        self.tables.lock().unwrap().entry(name).or_insert_with(make).clone()
    }
}
