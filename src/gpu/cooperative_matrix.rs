//! What the cooperative-matrix GEMM (`wgsl/gemm_coop.wgsl`, its wrapper
//! `kernels::gemm_coop`) needs of an adapter: checked when the device is
//! opened, so that the device requests the features and the kernels know
//! whether they may build it.

/// The kernel's subgroups: of 32 invocations, 8 or 16 to a workgroup
/// (the tile's `warps`), each computing a part of the workgroup's tile.
pub(crate) const SUBGROUP_SIZE: u32 = 32;

/// Subgroups of the largest build's workgroup.
pub(crate) const MAX_WARPS: u32 = 16;

/// Workgroup memory the kernel may use: 48 KiB, what NVIDIA's Vulkan
/// drivers offer (Vulkan itself guarantees 16 KiB: an adapter with less
/// than this runs the f32 GEMM). The kernel's tile choice keeps every build within it.
pub(crate) const WORKGROUP_BYTES: u32 = 48 * 1024;

/// Device features the kernel needs: on Vulkan, passthrough shaders carry
/// its SPIR-V (`kernels::vulkan_memory_model`).
pub(crate) const FEATURES: wgpu::Features = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::SUBGROUP_BARRIER)
    .union(wgpu::Features::PASSTHROUGH_SHADERS);

/// The adapter offers what the kernel needs: a Vulkan device (the one
/// backend whose translation has been fixed and tested) with 16 x 16 x 16
/// products of f16 into f32 at subgroup scope, f16 in shaders (and its
/// conversions in f32 ones, which the attention uses), subgroups of
/// exactly 32, and the workgroup memory and invocations of the largest
/// build.
pub(crate) fn usable(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    info.backend == wgpu::Backend::Vulkan
        && adapter.features().contains(FEATURES)
        && adapter.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32)
        && info.subgroup_min_size == SUBGROUP_SIZE
        && info.subgroup_max_size == SUBGROUP_SIZE
        && adapter.limits().max_compute_workgroup_storage_size >= WORKGROUP_BYTES
        && adapter.limits().max_compute_invocations_per_workgroup >= MAX_WARPS * SUBGROUP_SIZE
        && adapter.cooperative_matrix_properties().iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
}
