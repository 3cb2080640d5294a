//! A weight matrix on the GPU in its stored format, split into row ranges
//! when it is larger than one storage binding may be.

use super::Gpu;
use crate::error::Result;
use crate::format::WeightFormat;

/// One row range of a [`GpuTensor`], in its own buffer.
#[derive(Debug, Clone)]
pub struct TensorPart {
    pub buffer: wgpu::Buffer,
    pub first_row: usize,
    pub rows: usize,
}

/// A `[rows, cols]` matrix (a vector is one row) in `format`'s GPU layout
/// (bf16: packed pairs), in one or more buffers of whole rows.
#[derive(Debug, Clone)]
pub struct GpuTensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub parts: Vec<TensorPart>,
}

impl GpuTensor {
    /// Allocates an uninitialised tensor, split so that every part fits the
    /// adapter's (or the caller's lowered) storage binding limit.
    pub fn alloc(gpu: &Gpu, name: &str, rows: usize, cols: usize) -> Result<Self> {
        Self::alloc_grouped(gpu, name, rows, cols, 1)
    }

    /// As [`Self::alloc`], for a stack of groups of `group_rows` rows (the
    /// experts of a MoE layer): parts hold whole groups whenever one group
    /// fits a binding, so an expert is usually one dispatch. Otherwise,
    /// when groups have an even number of rows, parts hold whole pairs of
    /// rows (interleaved gate/up rows stay together).
    pub fn alloc_grouped(gpu: &Gpu, name: &str, rows: usize, cols: usize, group_rows: usize) -> Result<Self> {
        Self::alloc_in(gpu, name, WeightFormat::Bf16, rows, cols, group_rows)
    }

    /// As [`Self::alloc_grouped`], in `format` (whose blocks `cols` must fill:
    /// [`WeightFormat::fits_row`]).
    pub fn alloc_in(
        gpu: &Gpu,
        name: &str,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        group_rows: usize,
    ) -> Result<Self> {
        let row_bytes = format.gpu_row_bytes(cols) as u64;
        let limit = gpu.caps.max_storage_binding.min(gpu.caps.max_buffer_size);
        let mut rows_per_part = (limit / row_bytes.max(1)).max(1) as usize;
        if rows_per_part >= group_rows && group_rows > 1 {
            rows_per_part -= rows_per_part % group_rows;
        } else if group_rows.is_multiple_of(2) && rows_per_part >= 2 {
            rows_per_part -= rows_per_part % 2;
        }
        let mut parts = Vec::new();
        let mut first_row = 0;
        while first_row < rows.max(1) {
            let n = rows_per_part.min(rows.max(1) - first_row);
            let buffer = gpu.storage_buffer_bytes(
                &format!("{name}[{first_row}..{}]", first_row + n),
                n as u64 * row_bytes,
            )?;
            parts.push(TensorPart { buffer, first_row, rows: n });
            first_row += n;
        }
        Ok(GpuTensor { name: name.to_string(), rows, cols, format, parts })
    }

    /// Writes rows in the format's GPU layout (bf16: raw little-endian
    /// bytes) starting at `first_row`, spreading them over the parts they
    /// fall in.
    pub fn write_rows(&self, gpu: &Gpu, first_row: usize, bytes: &[u8]) {
        let row_bytes = self.format.gpu_row_bytes(self.cols);
        let n_rows = bytes.len() / row_bytes.max(1);
        for part in &self.parts {
            let lo = first_row.max(part.first_row);
            let hi = (first_row + n_rows).min(part.first_row + part.rows);
            if lo >= hi {
                continue;
            }
            let src = &bytes[(lo - first_row) * row_bytes..(hi - first_row) * row_bytes];
            let offset = ((lo - part.first_row) * row_bytes) as u64;
            write_padded(gpu, &part.buffer, offset, src);
        }
    }

    /// Indices of the parts holding any of `rows`.
    pub fn parts_overlapping(&self, rows: std::ops::Range<usize>) -> impl Iterator<Item = usize> + '_ {
        self.parts
            .iter()
            .enumerate()
            .filter(move |(_, p)| p.first_row < rows.end && rows.start < p.first_row + p.rows)
            .map(|(i, _)| i)
    }
}

/// `queue.write_buffer` needs 4-byte multiples. Rows start on a word
/// boundary (matrices have an even number of columns, checked at load), so
/// only the end of an odd-length vector needs a zero half of padding.
fn write_padded(gpu: &Gpu, buffer: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
    if bytes.len().is_multiple_of(4) {
        gpu.queue.write_buffer(buffer, offset, bytes);
    } else {
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().next_multiple_of(4), 0);
        gpu.queue.write_buffer(buffer, offset, &padded);
    }
}
