//! One Rust wrapper per `wgsl/*.wgsl` kernel family: typed parameters and
//! the construction of [`Dispatch`]es with their bindings fixed at load.

pub mod attention;
pub mod copy;
pub mod embed;
pub mod gemm;
pub mod gemv;
pub mod residual;
pub mod rms_norm;
pub mod rope;
pub mod router;
pub mod swiglu;

pub use attention::Attention;
pub use embed::Embed;
pub use gemm::Gemm;
pub use gemv::Gemv;
pub use residual::Residual;
pub use rms_norm::RmsNorm;
pub use rope::Rope;
pub use router::Router;
pub use swiglu::Swiglu;

use crate::error::Result;
use crate::gpu::Gpu;

/// Every kernel family's WGSL, by file name (without `.wgsl`).
pub const SHADERS: &[(&str, &str)] = &[
    ("attention", include_str!("../../wgsl/attention.wgsl")),
    ("copy", include_str!("../../wgsl/copy.wgsl")),
    ("embed", include_str!("../../wgsl/embed.wgsl")),
    ("gemm", include_str!("../../wgsl/gemm.wgsl")),
    ("gemv", include_str!("../../wgsl/gemv.wgsl")),
    ("residual", include_str!("../../wgsl/residual.wgsl")),
    ("rms_norm", include_str!("../../wgsl/rms_norm.wgsl")),
    ("rope", include_str!("../../wgsl/rope.wgsl")),
    ("router", include_str!("../../wgsl/router.wgsl")),
    ("swiglu", include_str!("../../wgsl/swiglu.wgsl")),
];

/// A feature-specialised piece of a kernel family (`wgsl/<family>.<name>.wgsl`),
/// prepended to it at pipeline creation. A family with variants is always
/// built with one of them; the first is the portable baseline.
#[derive(Debug)]
pub struct Variant {
    pub family: &'static str,
    pub name: &'static str,
    pub source: &'static str,
    /// Uses subgroup operations (needs the SUBGROUP feature).
    pub subgroups: bool,
}

pub const VARIANTS: &[Variant] = &[
    Variant {
        family: "gemv",
        name: "reduce_workgroup",
        source: include_str!("../../wgsl/gemv.reduce_workgroup.wgsl"),
        subgroups: false,
    },
    Variant {
        family: "gemv",
        name: "reduce_subgroup",
        source: include_str!("../../wgsl/gemv.reduce_subgroup.wgsl"),
        subgroups: true,
    },
];

const COMMON: &str = include_str!("../../wgsl/common.wgsl");

/// The complete source of a kernel family as it is compiled: the shared
/// helpers of `common.wgsl`, the variant (the family's baseline when
/// `variant` is `None`), then the family's file.
pub fn shader_source(name: &str, variant: Option<&str>) -> Option<String> {
    let (_, src) = SHADERS.iter().find(|(n, _)| *n == name)?;
    let mut variants = VARIANTS.iter().filter(|v| v.family == name);
    let piece = match variant {
        Some(v) => variants.find(|x| x.name == v)?.source,
        None => variants.next().map_or("", |v| v.source),
    };
    Some(format!("{COMMON}\n{piece}\n{src}"))
}

/// The per-submission values every position-dependent kernel reads: the
/// position of the first token in flight and how many tokens there are.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Step {
    pub pos0: u32,
    pub n_tokens: u32,
    pub _pad: [u32; 2],
}

/// Compiles a kernel family's entry point `main` with pipeline constants.
pub(crate) fn pipeline(gpu: &Gpu, name: &str, constants: &[(&str, f64)]) -> Result<wgpu::ComputePipeline> {
    pipeline_entry(gpu, name, "main", constants)
}

/// Compiles a variant of a kernel family's `main`.
pub(crate) fn pipeline_variant(
    gpu: &Gpu,
    name: &str,
    variant: &str,
    constants: &[(&str, f64)],
) -> Result<wgpu::ComputePipeline> {
    let source = shader_source(name, Some(variant)).expect("a registered variant");
    compile(gpu, name, &source, "main", constants)
}

/// Compiles entry point `entry` of a kernel family with pipeline constants.
pub(crate) fn pipeline_entry(
    gpu: &Gpu,
    name: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<wgpu::ComputePipeline> {
    let source = shader_source(name, None).expect("kernel name is one of SHADERS");
    compile(gpu, name, &source, entry, constants)
}

fn compile(
    gpu: &Gpu,
    name: &str,
    source: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<wgpu::ComputePipeline> {
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(source.to_string().into()),
    };
    // wgpu by default guards every loop against running forever, which on
    // NVIDIA keeps the compiler from unrolling inner loops (the GEMM ran at
    // two thirds of its speed). Bounds checks stay on.
    // SAFETY: every loop in wgsl/ runs over a range bounded by a constant or
    // a parameter and advances by a positive step, so none can run forever.
    let checks =
        wgpu::ShaderRuntimeChecks { force_loop_bounding: false, ..wgpu::ShaderRuntimeChecks::checked() };
    let module = unsafe { gpu.device.create_shader_module_trusted(desc, checks) };
    let pipeline = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants,
            zero_initialize_workgroup_memory: false,
        },
        cache: None,
    });
    gpu.check(&format!("compiling kernel {name}"))?;
    Ok(pipeline)
}

/// All pipelines of the layer flow, created once per model.
#[derive(Debug)]
pub struct Kernels {
    pub embed: Embed,
    pub rms_norm: RmsNorm,
    pub gemv: Gemv,
    pub gemm: Gemm,
    pub rope: Rope,
    pub attention: Attention,
    pub swiglu: Swiglu,
    pub residual: Residual,
    pub router: Router,
}

impl Kernels {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Kernels {
            embed: Embed::new(gpu)?,
            rms_norm: RmsNorm::new(gpu)?,
            gemv: Gemv::new(gpu)?,
            gemm: Gemm::new(gpu)?,
            rope: Rope::new(gpu)?,
            attention: Attention::new(gpu)?,
            swiglu: Swiglu::new(gpu)?,
            residual: Residual::new(gpu)?,
            router: Router::new(gpu)?,
        })
    }
}

/// The attention geometry: query heads, key/value heads and head width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
}

impl Heads {
    /// Width of one token's fused q, k, v projection.
    pub fn qkv_width(&self) -> usize {
        (self.q + 2 * self.kv) * self.dim
    }

    /// Width of one position's row in the K (or V) cache.
    pub fn kv_width(&self) -> usize {
        self.kv * self.dim
    }
}
