//! What wgpu does not report about an adapter, read through its Vulkan
//! handles where the driver tells it: how many multiprocessors (NVIDIA's
//! SMs, AMD's compute units) it has, by which the chunk GEMM sizes its
//! tiles and the byte-activation GEMV its grid, and how much memory it
//! has, which loading checks a model against before allocating anything.
//! `None` where neither is known.

/// The adapter's multiprocessors, where its Vulkan driver reports them
/// (`VK_NV_shader_sm_builtins`, `VK_AMD_shader_core_properties`).
#[cfg(not(target_vendor = "apple"))]
pub fn multiprocessors(adapter: &wgpu::Adapter) -> Option<u32> {
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

/// The most the adapter's buffers can hold together: its largest
/// device-local memory heap where its Vulkan driver reports it, else, for a
/// software adapter (llvmpipe's GL), the host's memory.
pub fn device_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    vulkan_heap(adapter)
        .or_else(|| (adapter.get_info().device_type == wgpu::DeviceType::Cpu).then(host_memory).flatten())
}

/// The host's physical memory, from Linux's `/proc/meminfo`.
fn host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?;
    kib.trim().parse::<u64>().ok().map(|k| k * 1024)
}

#[cfg(not(target_vendor = "apple"))]
fn vulkan_heap(adapter: &wgpu::Adapter) -> Option<u64> {
    use ash::vk;
    // SAFETY: as in `multiprocessors`.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: a valid physical device of this instance.
    let memory = unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    let heaps = &memory.memory_heaps[..memory.memory_heap_count as usize];
    heaps.iter().filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL)).map(|h| h.size).max()
}

/// Apple's GPUs run Metal, which reports no such count.
#[cfg(target_vendor = "apple")]
pub fn multiprocessors(_adapter: &wgpu::Adapter) -> Option<u32> {
    None
}

/// Apple's GPUs run Metal, which reports no heap.
#[cfg(target_vendor = "apple")]
fn vulkan_heap(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}
