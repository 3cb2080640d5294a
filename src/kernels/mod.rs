//! One Rust wrapper per `wgsl/*.wgsl` kernel family: typed parameters and
//! the construction of [`Dispatch`](crate::gpu::Dispatch)es with their bindings fixed at load.
//!
//! A family is specialised at pipeline creation:
//! - **flags** select `#if NAME` / `#else` / `#endif` sections of its
//!   source (a binding that a build does not use is not declared, so no
//!   placeholder buffer is ever bound);
//! - **override constants** set workgroup and tile shapes.
//!
//! What a dispatch's parameters carry is read at run time, and a few
//! kernels branch on it where the bindings stay the same: the router's
//! scoring, attention's sliding window, the sampler's top-k and top-p, the
//! cooperative GEMM's expert groups.
//!
//! Pipelines are cached by (family, entry point, flags, constants) in the
//! device's `gpu::PipelineCache`, created once at load or when a session's
//! plan asks for a new specialisation, never per token.
//!
//! Every parameter struct is declared once, in Rust, by [`wgsl_struct!`](crate::wgsl_struct),
//! which also writes its WGSL declaration; [`shader_source`] prepends the
//! declarations a family names, so the two sides cannot disagree.

pub mod attention;
pub mod bias_act;
pub mod copy;
pub mod embed;
pub mod gemm;
pub mod gemm_coop;
pub mod gemv;
pub mod group_by_expert;
pub mod residual;
pub mod rms_norm;
pub mod router;
pub mod sample;
pub mod split_sum;
pub mod vulkan_memory_model;

pub use attention::Attention;
pub use bias_act::BiasAct;
pub use embed::Embed;
#[cfg(feature = "internals")]
pub use gemm::Gemm;
pub use gemv::Gemv;
pub use group_by_expert::GroupByExpert;
pub use residual::Residual;
pub use rms_norm::RmsNorm;
pub use router::Router;
pub use sample::Sample;

use crate::error::Result;
use crate::format::WeightFormat;
use crate::gpu::Gpu;

/// A `#[repr(C)]` struct of 4-byte fields whose WGSL declaration is
/// generated from the same definition.
pub trait WgslStruct: bytemuck::Pod {
    /// `struct Name { field: type, ... }`.
    const WGSL: &'static str;
}

/// Declares a parameter struct for Rust (Pod, `#[repr(C)]`) and WGSL at
/// once. Fields are `u32`, `i32` or `f32`.
#[macro_export]
macro_rules! wgsl_struct {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ident),* $(,)? }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name { $($(#[$fmeta])* $fvis $field: $ty,)* }

        impl $crate::kernels::WgslStruct for $name {
            const WGSL: &'static str =
                concat!("struct ", stringify!($name), " {\n", $("    ", stringify!($field), ": ", stringify!($ty), ",\n",)* "}\n");
        }
    };
}

wgsl_struct! {
    /// The per-submission values every position-dependent kernel reads,
    /// written by the host before each submission.
    pub struct Step {
        /// Position of the first token in flight.
        pub pos0: u32,
        /// Tokens in flight.
        pub n_tokens: u32,
        /// Key splits of one token's attention (decode only).
        pub attn_splits: u32,
        /// A ragged batch's decode rows (its first rows), which the
        /// subgroup-lane attention runs apart.
        pub decode_rows: u32,
        /// A ragged batch's tiles of paged attention
        /// (`attention::PagedAttention::tiles`).
        pub attend_tiles: u32,
    }
}

/// A kernel family: its WGSL and the parameter structs it reads.
pub struct KernelFamily {
    pub name: &'static str,
    pub source: &'static str,
    /// WGSL declarations prepended to the source ([`WgslStruct::WGSL`]).
    pub structs: fn() -> Vec<&'static str>,
    /// Reads weight matrices in any [`WeightFormat`] (`weights.wgsl` is
    /// prepended; the family defines `weight_word`).
    pub reads_weights: bool,
    /// Sums over its workgroups (`workgroup_sum.wgsl` is prepended; the
    /// family declares `WG`).
    pub sums_workgroups: bool,
}

/// Every kernel family, by file name (without `.wgsl`).
pub const KERNEL_FAMILIES: &[KernelFamily] = &[
    KernelFamily {
        name: "attention",
        source: include_str!("../../wgsl/attention.wgsl"),
        structs: attention::structs,
        reads_weights: false,
        sums_workgroups: true,
    },
    KernelFamily {
        name: "bias_act",
        source: include_str!("../../wgsl/bias_act.wgsl"),
        structs: bias_act::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "copy",
        source: include_str!("../../wgsl/copy.wgsl"),
        structs: copy::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "embed",
        source: include_str!("../../wgsl/embed.wgsl"),
        structs: embed::structs,
        reads_weights: true,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "gemm",
        source: include_str!("../../wgsl/gemm.wgsl"),
        structs: gemm::structs,
        reads_weights: true,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "gemm_coop",
        source: include_str!("../../wgsl/gemm_coop.wgsl"),
        structs: gemm::structs,
        reads_weights: true,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "gemv",
        source: include_str!("../../wgsl/gemv.wgsl"),
        structs: gemv::structs,
        reads_weights: true,
        sums_workgroups: true,
    },
    KernelFamily {
        name: "group_by_expert",
        source: include_str!("../../wgsl/group_by_expert.wgsl"),
        structs: group_by_expert::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "residual",
        source: include_str!("../../wgsl/residual.wgsl"),
        structs: residual::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "rms_norm",
        source: include_str!("../../wgsl/rms_norm.wgsl"),
        structs: rms_norm::structs,
        reads_weights: false,
        sums_workgroups: true,
    },
    KernelFamily {
        name: "router",
        source: include_str!("../../wgsl/router.wgsl"),
        structs: router::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "sample",
        source: include_str!("../../wgsl/sample.wgsl"),
        structs: sample::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
    KernelFamily {
        name: "split_sum",
        source: include_str!("../../wgsl/split_sum.wgsl"),
        structs: split_sum::structs,
        reads_weights: false,
        sums_workgroups: false,
    },
];

const COMMON: &str = include_str!("../../wgsl/common.wgsl");
const WEIGHTS: &str = include_str!("../../wgsl/weights.wgsl");
const WORKGROUP_SUM: &str = include_str!("../../wgsl/workgroup_sum.wgsl");

/// One specialisation the engine may build: a family with a set of flags.
#[cfg(feature = "internals")]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Build {
    pub family: &'static str,
    pub flags: Vec<&'static str>,
}

#[cfg(feature = "internals")]
impl Build {
    /// Uses subgroup operations (needs the SUBGROUP feature).
    pub fn uses_subgroups(&self) -> bool {
        self.flags.contains(&SUBGROUPS)
    }

    /// Uses cooperative matrices, f16 and subgroups (needs the adapter's
    /// EXPERIMENTAL_COOPERATIVE_MATRIX, SHADER_F16, SUBGROUP and
    /// SUBGROUP_BARRIER).
    pub fn uses_cooperative_matrix(&self) -> bool {
        self.family == "gemm_coop" || self.flags.contains(&attention::COOP)
    }

    /// Uses f16 values (needs the adapter's SHADER_F16).
    pub fn uses_f16(&self) -> bool {
        self.uses_cooperative_matrix() || self.flags.contains(&rms_norm::OUT_F16)
    }

    /// Uses `pack2x16float` / `unpack2x16float` (needs the adapter's
    /// SHADER_F16_IN_F32 downlevel flag).
    pub fn uses_f16_in_f32(&self) -> bool {
        self.flags.contains(&F16_NATIVE)
    }
}

/// The flag of builds that use subgroup operations.
pub const SUBGROUPS: &str = "SUBGROUPS";

/// The subgroup size when the adapter has subgroups of one fixed size, so
/// that a kernel may make a group of lanes (or a workgroup) exactly one
/// subgroup.
pub(crate) fn subgroup_width(gpu: &Gpu) -> Option<u32> {
    let (min, max) = (gpu.caps.subgroup_min_size, gpu.caps.subgroup_max_size);
    (gpu.caps.subgroups && min == max && min.is_power_of_two() && (4..=128).contains(&min)).then_some(min)
}
/// The flag of builds that convert f16 with the WGSL builtins.
pub const F16_NATIVE: &str = "F16_NATIVE";
/// The flag of builds that read weights in a format other than bf16 (with
/// the format's own flag, [`WeightFormat::flag`]).
pub const WEIGHT_FORMAT: &str = "WEIGHT_FORMAT";

/// The flags of a build reading weights in `format` on `gpu`.
pub fn weight_flags(gpu: &Gpu, format: WeightFormat) -> Vec<&'static str> {
    match format.flag() {
        None => vec![],
        Some(flag) => {
            let mut flags = vec![WEIGHT_FORMAT, flag];
            if gpu.caps.f16_in_f32 {
                flags.push(F16_NATIVE);
            }
            flags
        }
    }
}

/// `buffers` bound for `pipeline`, a kernel reading weights in `format`,
/// with the format's grid at [`crate::format::GRID_BINDING`] where it has
/// one (uploaded once per device).
pub(crate) fn bind_reading(
    gpu: &Gpu,
    label: &str,
    pipeline: &wgpu::ComputePipeline,
    format: WeightFormat,
    buffers: &[(u32, wgpu::BufferBinding<'_>)],
) -> wgpu::BindGroup {
    let grid = format.grid().zip(format.flag()).map(|(grid, name)| {
        gpu.pipelines.table(name, || gpu.storage_buffer_init(&format!("{name} grid"), &grid.words()))
    });
    let mut all = buffers.to_vec();
    all.extend(grid.as_ref().map(|g| (crate::format::GRID_BINDING, g.as_entire_buffer_binding())));
    gpu.bind_ranges(label, pipeline, &all)
}

/// The flag sets [`weight_flags`] gives, on adapters with and without
/// f16 conversions.
#[cfg(feature = "internals")]
pub fn weight_flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = vec![vec![]];
    for format in WeightFormat::ALL {
        if let Some(flag) = format.flag() {
            out.push(vec![WEIGHT_FORMAT, flag]);
            out.push(vec![WEIGHT_FORMAT, flag, F16_NATIVE]);
        }
    }
    out
}

/// Every specialisation any session may build (the shader test translates
/// each one for every backend).
#[cfg(feature = "internals")]
pub fn builds() -> Vec<Build> {
    let mut out = Vec::new();
    for family in KERNEL_FAMILIES {
        let flag_sets = match family.name {
            "gemv" => gemv::flag_sets(),
            "embed" => weight_flag_sets(),
            "gemm" => gemm::flag_sets(),
            "gemm_coop" => gemm_coop::flag_sets(),
            "attention" => attention::flag_sets(),
            "residual" => residual::flag_sets(),
            "sample" => sample::flag_sets(),
            "router" => vec![vec![], vec![SUBGROUPS]],
            "bias_act" => bias_act::flag_sets(),
            "rms_norm" => rms_norm::flag_sets(),
            "split_sum" => split_sum::flag_sets(),
            _ => vec![vec![]],
        };
        out.extend(flag_sets.into_iter().map(|flags| Build { family: family.name, flags }));
    }
    out
}

/// The complete source of a build as it is compiled: the shared helpers of
/// `common.wgsl` (and of `weights.wgsl`, `workgroup_sum.wgsl` where the
/// family uses them) and the family's file, with the family's parameter structs
/// declared, and `#if` sections resolved by `flags`. The `enable`
/// directives a build keeps move to the top, where WGSL wants them.
pub fn shader_source(family: &str, flags: &[&str]) -> Option<String> {
    let f = KERNEL_FAMILIES.iter().find(|f| f.name == family)?;
    let structs: String = std::iter::once(Step::WGSL).chain((f.structs)()).collect();
    let weights =
        if f.reads_weights { format!("{}{WEIGHTS}", crate::format::wgsl_tables()) } else { String::new() };
    let sum = if f.sums_workgroups { WORKGROUP_SUM } else { "" };
    let body = preprocess(f.source, flags);
    let is_enable = |l: &&str| l.starts_with("enable ");
    let enables: String = body.lines().filter(is_enable).map(|l| format!("{l}\n")).collect();
    // The moved lines stay as empty lines, so the file's own line count is kept.
    let body: String =
        body.lines().map(|l| if is_enable(&l) { "\n".to_string() } else { format!("{l}\n") }).collect();
    let prefix = preprocess(&format!("{structs}\n{COMMON}\n{weights}\n{sum}\n"), flags);
    Some(format!("{enables}{prefix}{body}"))
}

/// Resolves `#if NAME`, `#if !NAME`, `#else` and `#endif` lines (nesting
/// allowed): a section is kept when its condition holds for `flags`.
/// Dropped lines become empty lines, so naga's line numbers stay those of
/// the file.
pub fn preprocess(source: &str, flags: &[&str]) -> String {
    // One entry per open #if: (this section is kept, the #if's condition held).
    let mut stack: Vec<(bool, bool)> = Vec::new();
    let mut out = String::with_capacity(source.len());
    for line in source.lines() {
        let trimmed = line.trim_start();
        let enclosing = stack.last().is_none_or(|s| s.0);
        if let Some(cond) = trimmed.strip_prefix("#if ") {
            let cond = cond.trim();
            let held = match cond.strip_prefix('!') {
                Some(name) => !flags.contains(&name.trim()),
                None => flags.contains(&cond),
            };
            stack.push((enclosing && held, held));
        } else if trimmed.starts_with("#else") {
            let (_, held) = stack.pop().expect("#else without #if");
            let enclosing = stack.last().is_none_or(|s| s.0);
            stack.push((enclosing && !held, !held));
        } else if trimmed.starts_with("#endif") {
            stack.pop().expect("#endif without #if");
        } else if enclosing {
            out.push_str(line);
        }
        out.push('\n');
    }
    assert!(stack.is_empty(), "#if without #endif");
    out
}

/// The pipeline of `entry` in `family` built with `flags` and override
/// `constants`, from the device's cache (built on first request).
pub(crate) fn pipeline(
    gpu: &Gpu,
    family: &str,
    entry: &str,
    flags: &[&str],
    constants: &[(&str, f64)],
) -> Result<wgpu::ComputePipeline> {
    let mut sorted = flags.to_vec();
    sorted.sort_unstable();
    let key = format!("{family}:{entry}:{sorted:?}:{constants:?}");
    gpu.pipelines.get_or_build(key, || {
        let source = shader_source(family, flags).expect("a registered kernel family");
        compile(gpu, family, &source, entry, constants)
    })
}

fn compile(
    gpu: &Gpu,
    name: &str,
    source: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<wgpu::ComputePipeline> {
    if gpu.info.backend == wgpu::Backend::Vulkan && source.contains("enable wgpu_cooperative_matrix;") {
        return compile_spirv(gpu, name, source, entry, constants);
    }
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(name),
        source: wgpu::ShaderSource::Wgsl(source.to_string().into()),
    };
    // wgpu by default guards every loop against running forever, which on
    // NVIDIA keeps the compiler from unrolling inner loops (and slows the
    // GEMM). Bounds checks stay on.
    // SAFETY: every loop in wgsl/ runs over a range bounded by a constant or
    // a parameter and advances by a positive step, so none can run forever.
    let checks =
        wgpu::ShaderRuntimeChecks { force_loop_bounding: false, ..wgpu::ShaderRuntimeChecks::checked() };
    let module = unsafe { gpu.device.create_shader_module_trusted(desc, checks) };
    let options = wgpu::PipelineCompilationOptions { constants, zero_initialize_workgroup_memory: false };
    create_pipeline(gpu, (name, entry), &module, None, options)
}

/// The pipeline of `entry` in `module` (`layout`: the module's own when
/// `None`), failing with the GPU's complaint.
fn create_pipeline(
    gpu: &Gpu,
    (name, entry): (&str, &str),
    module: &wgpu::ShaderModule,
    layout: Option<&wgpu::PipelineLayout>,
    compilation_options: wgpu::PipelineCompilationOptions<'_>,
) -> Result<wgpu::ComputePipeline> {
    let pipeline = gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout,
        module,
        entry_point: Some(entry),
        compilation_options,
        cache: None,
    });
    gpu.check(&format!("compiling kernel {name}:{entry}"))?;
    Ok(pipeline)
}

/// A cooperative-matrix kernel on Vulkan: translated by
/// [`vulkan_memory_model`] and passed to the driver as it is, with the
/// bind group layout its bindings declare.
fn compile_spirv(
    gpu: &Gpu,
    name: &str,
    source: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> Result<wgpu::ComputePipeline> {
    let (words, module) = vulkan_memory_model::spirv(source, entry, constants)
        .map_err(|e| crate::Error::Gpu(format!("compiling kernel {name}:{entry}: {e}")))?;
    let group = vulkan_memory_model::bind_group_layout(&gpu.device, name, &module);
    let layout = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(name),
        bind_group_layouts: &[Some(&group)],
        immediate_size: 0,
    });
    let size = module.entry_points.iter().find(|e| e.name == entry).map_or([1, 1, 1], |e| e.workgroup_size);
    let desc = wgpu::ShaderModuleDescriptorPassthrough {
        label: Some(name),
        entry_points: vec![wgpu::PassthroughShaderEntryPoint {
            name: entry.into(),
            workgroup_size: (size[0], size[1], size[2]),
        }]
        .into(),
        spirv: Some(words.into()),
        ..Default::default()
    };
    // SAFETY: the words are naga's translation of a module that naga
    // validated, changed only in memory-access masks and barrier semantics.
    let module = unsafe { gpu.device.create_shader_module_passthrough(desc) };
    create_pipeline(gpu, (name, entry), &module, Some(&layout), Default::default())
}

/// All kernels of the layer flow, created once per model; specialisations
/// a session asks for later come from the device's pipeline cache. (The
/// chunk GEMM, whose precision a session chooses, is the session's:
/// [`crate::ChunkMatmul::gemm`].)
#[derive(Debug)]
pub struct Kernels {
    pub embed: Embed,
    pub rms_norm: RmsNorm,
    pub gemv: Gemv,
    pub group_by_expert: GroupByExpert,
    pub attention: Attention,
    pub residual: Residual,
    pub router: Router,
    pub sample: Sample,
    pub bias_act: BiasAct,
}

impl Kernels {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Kernels {
            embed: Embed::new(gpu)?,
            rms_norm: RmsNorm::new(gpu)?,
            gemv: Gemv::new(gpu),
            group_by_expert: GroupByExpert::new(gpu)?,
            attention: Attention::new(gpu),
            residual: Residual::new(),
            router: Router::new(gpu)?,
            sample: Sample::new(gpu),
            bias_act: BiasAct,
        })
    }
}
