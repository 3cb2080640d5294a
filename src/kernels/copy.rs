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

/// `dst[..bytes] = src[..bytes]`, `bytes` a multiple of 16.
pub fn plan(gpu: &Gpu, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: u64) -> Result<Dispatch> {
    let n = (bytes / 16) as u32;
    let pipeline = super::pipeline(gpu, "copy", "main", &[], &[])?;
    let params = ParamsBuffer::new(gpu, "copy.params", &CopyParams { n });
    Ok(Dispatch {
        label: "copy",
        bind_group: gpu.bind("copy", &pipeline, &[&params.0, src, dst]),
        pipeline,
        workgroups: gpu.fold_grid(n.div_ceil(1024)),
        tokens_per_workgroup: 0,
    })
}
