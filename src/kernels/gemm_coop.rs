//! `wgsl/gemm_coop.wgsl`: the chunk product of [`super::Gemm`] on
//! cooperative matrices, where the adapter offers the one configuration the
//! kernel is written for. [`super::Gemm`] plans it with the same parameters
//! and bindings as the f32 kernel.

/// Staged activations as two f16s (high and low part) rather than one.
pub const X_SPLIT: &str = "X_SPLIT";
/// Staged weights as two f16s, for formats whose values f16 does not hold.
pub const W_SPLIT: &str = "W_SPLIT";

/// The kernel's subgroups: 8 of 32 invocations (its workgroup of 256 is
/// tiled into 8 subgroup tiles).
pub const SUBGROUP_SIZE: u32 = 32;

/// Weight rows per workgroup.
pub const TILE_ROWS: usize = 128;

/// Workgroup memory of the build with [`X_SPLIT`] and [`W_SPLIT`]: four
/// staged tiles of 128 rows of 40 f16s (32 and padding) and eight 16 x 16
/// f32 accumulators on their way out.
const WORKGROUP_BYTES: u32 = 4 * 128 * 40 * 2 + 8 * 256 * 4;

/// The kernel stages eight k at a time with 16-byte loads: bf16 rows must
/// hold a multiple of 8 values (other formats' rows are read four at a
/// time, as [`super::Gemm`] requires of them anyway). A matrix it does not
/// take runs on the f32 GEMM.
pub fn takes(format: crate::format::WeightFormat, cols: usize) -> bool {
    use crate::format::WeightFormat;
    match format {
        WeightFormat::Bf16 => cols.is_multiple_of(8),
        _ => cols.is_multiple_of(4),
    }
}

/// The flags of a build reading `format` (see [`super::weight_flags`]),
/// precise (`split`) or not.
pub fn flags(gpu: &crate::gpu::Gpu, format: crate::format::WeightFormat, split: bool) -> Vec<&'static str> {
    use crate::format::WeightFormat;
    let mut flags = super::weight_flags(gpu, format);
    if split {
        flags.push(X_SPLIT);
        if !matches!(format, WeightFormat::Bf16 | WeightFormat::F16) {
            flags.push(W_SPLIT);
        }
    }
    flags
}

/// Device features the kernel needs: on Vulkan, passthrough shaders carry
/// its SPIR-V ([`super::vulkan_memory_model`]).
pub const FEATURES: wgpu::Features = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::PASSTHROUGH_SHADERS);

/// The adapter offers what the kernel needs: a Vulkan device (the one
/// backend whose translation has been fixed and measured) with 16 x 16 x 16
/// products of f16 into f32 at subgroup scope, f16 in shaders (and its
/// conversions in f32 ones, which the attention uses), subgroups of
/// exactly 32, and the workgroup memory of the largest build.
pub fn usable(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    info.backend == wgpu::Backend::Vulkan
        && adapter.features().contains(FEATURES)
        && adapter.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32)
        && info.subgroup_min_size == SUBGROUP_SIZE
        && info.subgroup_max_size == SUBGROUP_SIZE
        && adapter.limits().max_compute_workgroup_storage_size >= WORKGROUP_BYTES
        && adapter.cooperative_matrix_properties().iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
}

/// Tokens per workgroup (32, 64 or 128): the widest tile that still gives
/// the chunk at least [`MIN_WORKGROUPS`] workgroups, or 32 for expert
/// groups, whose sizes are known only at encode time.
pub fn tile_tokens(n_rows: usize, max_tokens: usize) -> u32 {
    let row_tiles = n_rows.div_ceil(TILE_ROWS);
    [128, 64]
        .into_iter()
        .find(|&m| max_tokens >= m && row_tiles * max_tokens.div_ceil(m) >= MIN_WORKGROUPS)
        .unwrap_or(32) as u32
}

/// Fewest workgroups a dense product should have: about one per
/// multiprocessor of a large GPU.
pub const MIN_WORKGROUPS: usize = 128;

/// Every flag set the flow may build: each weight format, with and
/// without splits.
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = Vec::new();
    for flags in super::weight_flag_sets() {
        let exact = flags.is_empty() || flags.contains(&"W_F16");
        let mut split = flags.clone();
        split.push(X_SPLIT);
        if !exact {
            split.push(W_SPLIT);
        }
        out.push(flags);
        out.push(split);
    }
    out
}
