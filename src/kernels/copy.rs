//! `wgsl/copy.wgsl`: a buffer copy through the shader cores.

#[cfg(feature = "internals")]
use std::time::Duration;

#[cfg(feature = "internals")]
use crate::error::Result;
#[cfg(feature = "internals")]
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

crate::wgsl_struct! {
    pub struct CopyParams {
        /// vec4s to copy.
        n: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![CopyParams::WGSL]
}

/// vec4s each invocation copies: enough loads in flight for a large GPU
/// (`kernel_throughput` times the other counts).
#[cfg(feature = "internals")]
pub const PER_THREAD: u32 = 8;

/// `dst[..bytes] = src[..bytes]`, `bytes` a multiple of 16.
#[cfg(feature = "internals")]
pub fn plan(gpu: &Gpu, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: u64) -> Result<Dispatch> {
    plan_with(gpu, src, dst, bytes, PER_THREAD)
}

/// As [`plan`], `per_thread` (at most 16) vec4s per invocation.
#[cfg(feature = "internals")]
pub fn plan_with(
    gpu: &Gpu,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    bytes: u64,
    per_thread: u32,
) -> Result<Dispatch> {
    let n = (bytes / 16) as u32;
    let pipeline = super::pipeline(gpu, "copy", "main", &[], &[("PER_THREAD", per_thread as f64)])?;
    let params = ParamsBuffer::new(gpu, "copy.params", &CopyParams { n });
    Ok(Dispatch {
        label: "copy",
        bind_group: gpu.bind("copy", &pipeline, &[&params.0, src, dst]),
        pipeline,
        workgroups: gpu.fold_grid(n.div_ceil(256 * per_thread)),
        tokens_per_workgroup: 0,
    })
}

/// Device-to-device copy bandwidth in bytes per second, counting the read
/// and the write (as memory-bound kernels count their traffic).
#[cfg(feature = "internals")]
#[derive(Debug, Clone, Copy)]
pub struct CopyBandwidth {
    /// The API's buffer copy (a DMA engine on some GPUs).
    pub api: f64,
    /// The copy kernel (`wgsl/copy.wgsl`).
    pub kernel: f64,
    /// The better of the two: the reference for memory-bound kernels.
    pub best: f64,
}

/// The copy bandwidth of `reps` copies of a `bytes` buffer in one
/// submission, best of 3, by the API's copy (wall clock) and by the
/// copy kernel (GPU timestamps where the adapter has them).
#[cfg(feature = "internals")]
pub fn bandwidth(gpu: &Gpu, bytes: u64, reps: u32) -> Result<CopyBandwidth> {
    let bytes = bytes.min(gpu.caps.max_buffer_size).min(gpu.caps.max_storage_binding) / 16 * 16;
    let a = gpu.storage_buffer_bytes("copy.a", bytes)?;
    let b = gpu.storage_buffer_bytes("copy.b", bytes)?;
    let by_kernel = [plan(gpu, &a, &b, bytes)?, plan(gpu, &b, &a, bytes)?];
    let api = gpu.time_copies(reps, |encoder, i| {
        let (src, dst) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        encoder.copy_buffer_to_buffer(src, 0, dst, 0, bytes);
    })?;
    let shader = gpu.time_pass(reps, |pass, i| by_kernel[(i % 2) as usize].encode(pass, 1))?;
    gpu.check("measuring copy bandwidth")?;
    let rate = |t: Duration| 2.0 * bytes as f64 * reps as f64 / t.as_secs_f64();
    let (api, kernel) = (rate(api), rate(shader));
    Ok(CopyBandwidth { api, kernel, best: api.max(kernel) })
}
