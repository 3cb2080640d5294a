//! A weight matrix on the GPU in its stored format, split into row ranges
//! when it is larger than one storage binding may be.

use super::Gpu;
use crate::error::Result;
use crate::format::WeightFormat;

/// One row range of a [`GpuTensor`], in its own buffer, in `format`'s GPU
/// layout (bf16: packed pairs).
#[derive(Debug, Clone)]
pub struct TensorPart {
    pub buffer: wgpu::Buffer,
    pub first_row: usize,
    pub rows: usize,
    pub format: WeightFormat,
    /// Some value of the part may lie beyond f16's range
    /// ([`WeightFormat::fits_f16`]), so products that stage weights as f16
    /// must not read it.
    pub beyond_f16: bool,
}

/// A `[rows, cols]` matrix (a vector is one row) in one or more buffers of
/// whole rows. A stack of tensors stored in different formats (a GGUF
/// layer's q, k and v) keeps each in its own parts.
#[derive(Debug, Clone)]
pub struct GpuTensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
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
        Self::alloc_stacked(gpu, name, &[(format, rows.max(1))], cols, group_rows)
            .map(|t| GpuTensor { rows, ..t })
    }

    /// Row ranges of `(format, rows)` stacked in order, each split as
    /// [`Self::alloc_grouped`] splits a tensor.
    pub fn alloc_stacked(
        gpu: &Gpu,
        name: &str,
        segments: &[(WeightFormat, usize)],
        cols: usize,
        group_rows: usize,
    ) -> Result<Self> {
        let mut parts = Vec::new();
        let mut first_row = 0;
        for &(format, rows) in segments {
            parts.extend(Self::alloc_parts(gpu, name, format, first_row, rows, cols, group_rows)?);
            first_row += rows;
        }
        Ok(GpuTensor { name: name.to_string(), rows: first_row, cols, parts })
    }

    fn alloc_parts(
        gpu: &Gpu,
        name: &str,
        format: WeightFormat,
        start: usize,
        rows: usize,
        cols: usize,
        group_rows: usize,
    ) -> Result<Vec<TensorPart>> {
        let row_bytes = format.gpu_row_bytes(cols) as u64;
        let limit = gpu.caps.max_storage_binding.min(gpu.caps.max_buffer_size);
        let mut rows_per_part = (limit / row_bytes.max(1)).max(1) as usize;
        if rows_per_part >= group_rows && group_rows > 1 {
            rows_per_part -= rows_per_part % group_rows;
        } else if group_rows.is_multiple_of(2) && rows_per_part >= 2 {
            rows_per_part -= rows_per_part % 2;
        }
        let mut parts = Vec::new();
        let mut first_row = start;
        while first_row < start + rows {
            let n = rows_per_part.min(start + rows - first_row);
            let buffer = gpu.storage_buffer_bytes(
                &format!("{name}[{first_row}..{}]", first_row + n),
                n as u64 * row_bytes,
            )?;
            parts.push(TensorPart { buffer, first_row, rows: n, format, beyond_f16: false });
            first_row += n;
        }
        Ok(parts)
    }

    /// Writes whole rows stored in the file layout of the format of the
    /// parts they fall in from `first_row` on (see [`Self::write_rows`]),
    /// and marks those parts [`TensorPart::beyond_f16`] where some value
    /// lies beyond f16's range.
    pub fn write_file_rows(&mut self, gpu: &Gpu, first_row: usize, file_bytes: &[u8]) {
        let format = self.format_at(first_row);
        self.write_rows(gpu, first_row, &format.to_gpu_layout(file_bytes));
        if !format.fits_f16(file_bytes) {
            let rows = file_bytes.len() / format.file_row_bytes(self.cols).max(1);
            self.mark_beyond_f16(first_row..first_row + rows);
        }
    }

    /// Marks the parts holding any of `rows` as holding values beyond
    /// f16's range.
    pub(crate) fn mark_beyond_f16(&mut self, rows: std::ops::Range<usize>) {
        for part in &mut self.parts {
            if part.first_row < rows.end && rows.start < part.first_row + part.rows {
                part.beyond_f16 = true;
            }
        }
    }

    /// Writes rows in their parts' GPU layout (bf16: raw little-endian
    /// bytes) starting at `first_row`, spreading them over the parts they
    /// fall in (which share one format).
    pub fn write_rows(&self, gpu: &Gpu, first_row: usize, bytes: &[u8]) {
        let row_bytes = self.format_at(first_row).gpu_row_bytes(self.cols);
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

    /// A vector of f32 values (a norm's weight) as a one-row tensor.
    pub fn vector_f32(gpu: &Gpu, name: &str, values: &[f32]) -> Result<Self> {
        let t = Self::alloc_in(gpu, name, WeightFormat::F32, 1, values.len(), 1)?;
        t.write_rows(gpu, 0, bytemuck::cast_slice(values));
        Ok(t)
    }

    /// Bytes the tensor takes on the GPU.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.buffer.size()).sum()
    }

    /// The format of row `row`.
    pub fn format_at(&self, row: usize) -> WeightFormat {
        let part = self.parts.iter().find(|p| p.first_row <= row && row < p.first_row + p.rows);
        part.unwrap_or(&self.parts[0]).format
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
