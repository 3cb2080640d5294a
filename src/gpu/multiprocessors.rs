//! How many multiprocessors (NVIDIA's SMs, AMD's compute units) the
//! adapter has: the chunk GEMM sizes its tiles by how its waves of
//! workgroups fill them ([`crate::kernels::gemm_coop::Tile::reads_f16`]),
//! the byte-activation GEMV its grid by their number
//! ([`crate::kernels::gemv::GemvShape`]). wgpu does not report it;
//! Vulkan drivers do through vendor extensions, read here through the
//! adapter's Vulkan handles. `None` on other backends and drivers.

/// The adapter's multiprocessors, where its Vulkan driver reports them
/// (`VK_NV_shader_sm_builtins`, `VK_AMD_shader_core_properties`).
#[cfg(not(target_vendor = "apple"))]
pub fn count(adapter: &wgpu::Adapter) -> Option<u32> {
    use ash::vk;
    // SAFETY: the handles are only used to query properties, while the
    // adapter (which owns them) is borrowed.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let shared = hal.shared_instance();
    let instance = shared.raw_instance();
    let device = hal.raw_physical_device();
    if shared.instance_api_version() < vk::API_VERSION_1_1 {
        return None;
    }
    // SAFETY: a valid physical device of this instance.
    let extensions = unsafe { instance.enumerate_device_extension_properties(device) }.ok()?;
    let has = |name: &std::ffi::CStr| extensions.iter().any(|e| e.extension_name_as_c_str() == Ok(name));
    if has(vk::NV_SHADER_SM_BUILTINS_NAME) {
        let mut sm = vk::PhysicalDeviceShaderSMBuiltinsPropertiesNV::default();
        let mut properties = vk::PhysicalDeviceProperties2::default().push_next(&mut sm);
        // SAFETY: the chained structure belongs to an extension the device has.
        unsafe { instance.get_physical_device_properties2(device, &mut properties) };
        return (sm.shader_sm_count > 0).then_some(sm.shader_sm_count);
    }
    if has(vk::AMD_SHADER_CORE_PROPERTIES_NAME) {
        let mut core = vk::PhysicalDeviceShaderCorePropertiesAMD::default();
        let mut properties = vk::PhysicalDeviceProperties2::default().push_next(&mut core);
        // SAFETY: as above.
        unsafe { instance.get_physical_device_properties2(device, &mut properties) };
        let units = core.shader_engine_count
            * core.shader_arrays_per_engine_count
            * core.compute_units_per_shader_array;
        return (units > 0).then_some(units);
    }
    None
}

/// Apple's GPUs run Metal, which reports no such count.
#[cfg(target_vendor = "apple")]
pub fn count(_adapter: &wgpu::Adapter) -> Option<u32> {
    None
}
