//! `wgsl/copy.wgsl`: a buffer copy through the shader cores.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    _pad: [u32; 3],
}

#[derive(Debug)]
pub struct Copy {
    pipeline: wgpu::ComputePipeline,
}

impl Copy {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Copy { pipeline: super::pipeline(gpu, "copy", &[])? })
    }

    /// `dst[..bytes] = src[..bytes]`, `bytes` a multiple of 16.
    pub fn plan(&self, gpu: &Gpu, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: u64) -> Dispatch {
        let n = (bytes / 16) as u32;
        let params = ParamsBuffer::new(gpu, "copy.params", &Params { n, _pad: [0; 3] });
        Dispatch {
            label: "copy",
            bind_group: gpu.bind("copy", &self.pipeline, &[&params.0, src, dst]),
            pipeline: self.pipeline.clone(),
            workgroups: [n.div_ceil(256 * 8).clamp(1, 65535), 1, 1],
            tokens_per_workgroup: 0,
        }
    }
}
