//! `wgsl/rms_norm.wgsl`: RMSNorm over rows of the hidden state or of q/k
//! heads (after a residual add, for a chunk's projections), and LayerNorm
//! (the vision tower's) over rows.

use super::residual::LayerOutput;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer};

crate::wgsl_struct! {
    pub struct RmsNormParams {
        n: u32,
        head_stride: u32,
        token_stride: u32,
        offset: u32,
        eps: f32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![RmsNormParams::WGSL]
}

/// Where the rows to normalise are: `heads` rows of `n` elements per token,
/// `head_stride` apart, starting at `offset` in a buffer of `token_stride`
/// elements per token.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    pub n: usize,
    pub heads: usize,
    pub head_stride: usize,
    pub token_stride: usize,
    pub offset: usize,
}

impl Rows {
    /// One row of `n` per token, tokens packed.
    pub fn vector(n: usize) -> Self {
        Rows { n, heads: 1, head_stride: 0, token_stride: n, offset: 0 }
    }
}

/// The flag of the LayerNorm build.
pub const LAYER_NORM: &str = "LAYER_NORM";

/// The flag of builds that add a row into x before normalising it.
pub const ADD: &str = "ADD";

/// The flag of builds that also write the normalised rows as f16.
pub const OUT_F16: &str = "OUT_F16";

#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let after_add = LayerOutput::flag_sets().into_iter().map(|layer| [&[ADD][..], &layer].concat());
    let norms: Vec<Vec<&str>> = [vec![], vec![LAYER_NORM]].into_iter().chain(after_add).collect();
    let with_copies: Vec<Vec<&str>> = norms
        .iter()
        .filter(|f| !f.contains(&LAYER_NORM))
        .map(|f| [f.as_slice(), &[OUT_F16]].concat())
        .collect();
    norms.into_iter().chain(with_copies).collect()
}

/// `flags` and the f16 copy's binding where `out16` asks for one: devices
/// without f16 in shaders have none to write.
fn with_copy<'a>(
    gpu: &Gpu,
    flags: &mut Vec<&'static str>,
    buffers: &mut Vec<(u32, wgpu::BufferBinding<'a>)>,
    out16: Option<&'a wgpu::Buffer>,
) -> Result<()> {
    let Some(out16) = out16 else { return Ok(()) };
    if !gpu.device.features().contains(wgpu::Features::SHADER_F16) {
        return Err(crate::Error::Unsupported {
            what: "f16 copy of normalised rows (a device with f16 in shaders)",
            value: gpu.info.name.clone(),
        });
    }
    flags.push(OUT_F16);
    buffers.push((6, out16.as_entire_buffer_binding()));
    Ok(())
}

#[derive(Debug)]
pub struct RmsNorm {
    pipeline: wgpu::ComputePipeline,
    wg: f64,
}

impl RmsNorm {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let wg = if gpu.caps.is_cpu { 64.0 } else { 256.0 };
        Ok(RmsNorm { pipeline: super::pipeline(gpu, "rms_norm", "main", &[], &[("WG", wg)])?, wg })
    }

    fn params(gpu: &Gpu, eps: f32, rows: Rows) -> ParamsBuffer {
        ParamsBuffer::new(
            gpu,
            "rms_norm.params",
            &RmsNormParams {
                n: rows.n as u32,
                head_stride: rows.head_stride as u32,
                token_stride: rows.token_stride as u32,
                offset: rows.offset as u32,
                eps,
            },
        )
    }

    /// [`Self::plan`] writing the rows also as f16 to `out16` where given
    /// (see `kernels::gemm::HalfCopies`).
    pub fn plan_with_copy(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        eps: f32,
        x: &wgpu::Buffer,
        (out, out16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        rows: Rows,
    ) -> Result<Dispatch> {
        if out16.is_none() {
            return Ok(self.plan(gpu, weight, eps, x, out, rows));
        }
        let params = Self::params(gpu, eps, rows);
        let mut flags = vec![];
        let mut buffers = vec![
            (0, params.0.as_entire_buffer_binding()),
            (1, weight.parts[0].buffer.as_entire_buffer_binding()),
            (2, x.as_entire_buffer_binding()),
            (3, out.as_entire_buffer_binding()),
        ];
        with_copy(gpu, &mut flags, &mut buffers, out16)?;
        let pipeline = super::pipeline(gpu, "rms_norm", "main", &flags, &[("WG", self.wg)])?;
        Ok(Dispatch {
            label: "rms_norm",
            bind_group: gpu.bind_ranges("rms_norm", &pipeline, &buffers),
            pipeline,
            workgroups: [rows.heads as u32, 1, 1],
            tokens_per_workgroup: 1,
        })
    }

    /// `out = w * x * rsqrt(mean(x^2) + eps)` per row; `x` and `out` may be
    /// the same buffer (the rows are then normalised in place, at the same
    /// offsets).
    pub fn plan(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        eps: f32,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        rows: Rows,
    ) -> Dispatch {
        let params = Self::params(gpu, eps, rows);
        Dispatch {
            label: "rms_norm",
            bind_group: gpu.bind("rms_norm", &self.pipeline, &[&params.0, &weight.parts[0].buffer, x, out]),
            pipeline: self.pipeline.clone(),
            workgroups: [rows.heads as u32, 1, 1],
            tokens_per_workgroup: 1,
        }
    }

    /// `x[t] = output(x[t] + sum_j y[t, j])` (the residual add of a
    /// product, or of its partial sums over k, y packed `[tokens, parts,
    /// n]`: see `kernels::gemm::Gemm::plan_summed`; steered and captured
    /// at a layer's output), then `out[t]` = the RMSNorm of the new `x[t]`
    /// (times `weight`), rows of `n = weight.cols` packed per token (also
    /// as f16 to `out16` where given): a chunk's add and the next
    /// projection's norm in one dispatch.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_after_add(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        eps: f32,
        (y, parts): (&wgpu::Buffer, usize),
        x: &wgpu::Buffer,
        (out, out16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        output: &LayerOutput<'_>,
    ) -> Result<Dispatch> {
        let mut flags = vec![ADD];
        let mut constants = vec![("WG", self.wg), ("ADD_PARTS", parts as f64)];
        let params = Self::params(gpu, eps, Rows::vector(weight.cols));
        let mut buffers = vec![
            (0, params.0.as_entire_buffer_binding()),
            (1, weight.parts[0].buffer.as_entire_buffer_binding()),
            (2, x.as_entire_buffer_binding()),
            (3, out.as_entire_buffer_binding()),
            (5, y.as_entire_buffer_binding()),
        ];
        with_copy(gpu, &mut flags, &mut buffers, out16)?;
        output.bind(&mut flags, &mut buffers, &mut constants);
        let pipeline = super::pipeline(gpu, "rms_norm", "main", &flags, &constants)?;
        Ok(Dispatch {
            label: "add_rms_norm",
            bind_group: gpu.bind_ranges("add_rms_norm", &pipeline, &buffers),
            pipeline,
            workgroups: [1, 1, 1],
            tokens_per_workgroup: 1,
        })
    }

    /// LayerNorm per row, `out = (x - mean) * rsqrt(var + eps) * w + b`
    /// (biased variance, as torch's), f32 weight and bias of `rows.n`; each
    /// value also to `out16` as f16 where given.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_layer_norm(
        &self,
        gpu: &Gpu,
        weight: &wgpu::Buffer,
        bias: &wgpu::Buffer,
        eps: f32,
        x: &wgpu::Buffer,
        (out, out16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        rows: Rows,
    ) -> Result<Dispatch> {
        let params = Self::params(gpu, eps, rows);
        let mut flags = vec![LAYER_NORM];
        let mut buffers = vec![
            (0, params.0.as_entire_buffer_binding()),
            (1, weight.as_entire_buffer_binding()),
            (2, x.as_entire_buffer_binding()),
            (3, out.as_entire_buffer_binding()),
            (4, bias.as_entire_buffer_binding()),
        ];
        with_copy(gpu, &mut flags, &mut buffers, out16)?;
        let pipeline = super::pipeline(gpu, "rms_norm", "main", &flags, &[("WG", self.wg)])?;
        Ok(Dispatch {
            label: "layer_norm",
            bind_group: gpu.bind_ranges("layer_norm", &pipeline, &buffers),
            pipeline,
            workgroups: [rows.heads as u32, 1, 1],
            tokens_per_workgroup: 1,
        })
    }
}
