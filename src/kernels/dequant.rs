//! `wgsl/dequant.wgsl`: an f16 copy of a quantized weight part, for the
//! cooperative-matrix GEMM's products over many tokens
//! ([`super::gemm_coop::W_COPY`]).

use crate::error::{Error, Result};
use crate::format::WeightFormat;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer, TensorPart};

crate::wgsl_struct! {
    pub struct DequantParams {
        rows: u32,
        cols: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![DequantParams::WGSL]
}

/// Whether a part in `format` of rows of `cols` can be copied: a format
/// that decodes (not bf16 or f16, read as they are) in runs of eight, on
/// a device that converts f16 in its shaders.
pub fn takes(gpu: &Gpu, format: WeightFormat, cols: usize) -> bool {
    !matches!(format, WeightFormat::Bf16 | WeightFormat::F16) && cols.is_multiple_of(8) && gpu.caps.f16_in_f32
}

/// Bytes of the copy of `rows` rows of `cols`.
pub fn copy_bytes(rows: usize, cols: usize) -> u64 {
    (rows * cols * 2) as u64
}

/// `out[row * cols + k] = f16(part[row][k])` for every row of `part`
/// (`out` at least [`copy_bytes`] long).
pub fn plan(gpu: &Gpu, part: &TensorPart, cols: usize, out: &wgpu::Buffer) -> Result<Dispatch> {
    if !takes(gpu, part.format, cols) || out.size() < copy_bytes(part.rows, cols) {
        return Err(Error::Unsupported {
            what: "f16 copy of a weight part",
            value: format!(
                "{} rows of {cols} in {} into {} bytes on {}",
                part.rows,
                part.format,
                out.size(),
                gpu.info.name
            ),
        });
    }
    let flags = super::weight_flags(gpu, part.format);
    let pipeline = super::pipeline(gpu, "dequant", "main", &flags, &[])?;
    let params = DequantParams { rows: part.rows as u32, cols: cols as u32 };
    let params = ParamsBuffer::new(gpu, "dequant.params", &params);
    let runs = (part.rows * cols / 8) as u32;
    Ok(Dispatch {
        label: "dequant",
        bind_group: gpu.bind("dequant", &pipeline, &[&params.0, &part.buffer, out]),
        pipeline,
        workgroups: gpu.fold_grid(runs.div_ceil(256)),
        tokens_per_workgroup: 0,
    })
}

/// The flag sets of the builds: every format [`takes`] takes, with f16
/// conversions.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let f16 = WeightFormat::F16.flag();
    let copied = |f: &Vec<&str>| f.contains(&super::F16_NATIVE) && !f.iter().any(|&flag| Some(flag) == f16);
    super::weight_flag_sets().into_iter().filter(copied).collect()
}
