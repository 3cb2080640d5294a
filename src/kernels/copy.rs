//! `wgsl/copy.wgsl`: a buffer copy through the shader cores.

use crate::error::Result;
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
pub const PER_THREAD: u32 = 8;

/// `dst[..bytes] = src[..bytes]`, `bytes` a multiple of 16.
pub fn plan(gpu: &Gpu, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: u64) -> Result<Dispatch> {
    plan_with(gpu, src, dst, bytes, PER_THREAD)
}

/// As [`plan`], `per_thread` (at most 16) vec4s per invocation.
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
