//! Checkpoint tensors: safetensors files (single or sharded), memory-mapped,
//! looked up by canonical name, checked for dtype and shape, and streamed to
//! the GPU one tensor at a time (as bf16, FP8 projections as FP8 blocks;
//! other sources, such as GGUF files, keep their tensors' own formats).

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::Quantization;
use crate::error::{Error, Result, check_regular_file};
use crate::format::{FP8_BLOCK_ELEMS, WeightFormat};
use crate::gpu::{Gpu, GpuTensor};
use crate::progress::Progress;

/// Maps a checkpoint's tensor name to the text-model name the flow uses:
/// multimodal checkpoints nest the language model under a prefix.
pub fn canonical_name(name: &str) -> Cow<'_, str> {
    const PREFIXES: &[(&str, &str)] = &[
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ];
    for (from, to) in PREFIXES {
        if let Some(rest) = name.strip_prefix(from) {
            return Cow::Owned(format!("{to}{rest}"));
        }
    }
    Cow::Borrowed(name)
}

#[derive(Debug)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Range<usize>,
}

/// The tensors of a checkpoint directory, memory-mapped.
#[derive(Debug)]
pub struct Checkpoint {
    files: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, Entry>,
    /// Rows per FP8 scale block, where config.json declares block FP8.
    fp8_block_rows: Option<usize>,
    /// Fused expert tensors may be stored with their last two dimensions
    /// swapped ([`Checkpoint::transposing_fused_experts`]).
    transposed_experts: bool,
}

/// The fused 3-D expert tensors of transformers 5's layout.
fn is_fused_expert(name: &str) -> bool {
    name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj")
}

/// `shape` with its last two dimensions swapped.
fn swapped(shape: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    let n = s.len();
    if n >= 2 {
        s.swap(n - 2, n - 1);
    }
    s
}

/// Each of `matrices` `[p, q]` matrices of `elem`-byte values in `data`,
/// transposed to `[q, p]` (in tiles, so that both sides stay in cache).
fn transpose_matrices(data: &[u8], matrices: usize, p: usize, q: usize, elem: usize) -> Vec<u8> {
    const TILE: usize = 32;
    let mut out = vec![0u8; data.len()];
    for m in 0..matrices {
        let (src, dst) =
            (&data[m * p * q * elem..][..p * q * elem], &mut out[m * p * q * elem..][..p * q * elem]);
        for p0 in (0..p).step_by(TILE) {
            for q0 in (0..q).step_by(TILE) {
                for i in p0..(p0 + TILE).min(p) {
                    for j in q0..(q0 + TILE).min(q) {
                        dst[(j * p + i) * elem..][..elem].copy_from_slice(&src[(i * q + j) * elem..][..elem]);
                    }
                }
            }
        }
    }
    out
}

/// The scale tensor of an FP8 weight `name` (`...weight_scale_inv`).
fn scale_name(name: &str) -> String {
    format!("{name}_scale_inv")
}

impl Checkpoint {
    /// Opens `model.safetensors`, or the shards listed in
    /// `model.safetensors.index.json` when that exists; `quantization` is
    /// config.json's.
    pub fn open(dir: &Path, quantization: Option<Quantization>) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let shard_names =
            if index.exists() { shard_list(&index, dir)? } else { vec!["model.safetensors".to_string()] };
        let fp8_block_rows = quantization.map(|Quantization::Fp8 { block_rows }| block_rows);
        let mut checkpoint = Checkpoint {
            files: Vec::new(),
            tensors: HashMap::new(),
            fp8_block_rows,
            transposed_experts: false,
        };
        for shard in shard_names {
            checkpoint.add_file(dir.join(shard))?;
        }
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<()> {
        check_regular_file(&path)?;
        let file = std::fs::File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is opened read-only and the map lives as long as
        // the checkpoint; a checkpoint rewritten while loading is outside
        // what any loader can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| Error::Safetensors { path: path.clone(), message: e.to_string() })?;
        let data_start = 8 + header_len;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            let (lo, hi) = info.data_offsets;
            let entry = Entry {
                file: file_index,
                dtype: info.dtype,
                shape: info.shape.clone(),
                bytes: data_start + lo..data_start + hi,
            };
            if let Some(earlier) = self.tensors.insert(canonical_name(&name).into_owned(), entry) {
                return Err(Error::Safetensors {
                    path: path.clone(),
                    message: format!("tensor {name} is also in {}", self.files[earlier.file].0.display()),
                });
            }
        }
        self.files.push((path, map));
        Ok(())
    }

    /// Reads fused expert tensors (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
    /// `mlp.experts.down_proj` `[E, H, I]`) that are stored with their last
    /// two dimensions swapped, as the hub ships Qwen3-VL-MoE, transposed
    /// into the layout asked for; as transformers does on load, a tensor
    /// whose stored shape is the one asked for is read as it is.
    pub fn transposing_fused_experts(mut self, transposed: bool) -> Self {
        self.transposed_experts = transposed;
        self
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Whether `entry` holds `expected` with its last two dimensions swapped
    /// (see [`Self::transposing_fused_experts`]).
    fn stored_transposed(&self, name: &str, entry: &Entry, expected: &[usize]) -> bool {
        self.transposed_experts
            && is_fused_expert(name)
            && expected.len() == 3
            && entry.shape != expected
            && entry.shape == swapped(expected)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor { name: name.to_string() })
    }

    #[cfg(feature = "internals")]
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.entry(name)?.shape)
    }

    /// Fails with `WrongShape` unless the tensor has `expected` shape (a
    /// vector stored as `[n]` or `[1, n]` is the same data).
    pub fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        let entry = self.entry(name)?;
        if self.stored_transposed(name, entry, expected) {
            return Ok(());
        }
        let found = &entry.shape;
        let squeeze = |s: &[usize]| -> Vec<usize> { s.iter().copied().filter(|&d| d != 1).collect() };
        if squeeze(found) != squeeze(expected) {
            return Err(Error::WrongShape {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: found.clone(),
            });
        }
        Ok(())
    }

    /// A BF16, F16 or F32 tensor's bytes as stored (borrowed from the
    /// map), after checking its shape; transposed if stored so.
    fn float_bytes(&self, name: &str, expected_shape: &[usize]) -> Result<Cow<'_, [u8]>> {
        self.check_shape(name, expected_shape)?;
        let entry = self.entry(name)?;
        let width = float_width(name, entry.dtype)?;
        let bytes = &self.files[entry.file].1[entry.bytes.clone()];
        if self.stored_transposed(name, entry, expected_shape) {
            let [e, p, q] = entry.shape[..] else {
                unreachable!("a fused expert tensor has three dimensions")
            };
            return Ok(Cow::Owned(transpose_matrices(bytes, e, p, q, width)));
        }
        Ok(Cow::Borrowed(bytes))
    }
}

/// The bytes per element of a tensor kept in its own float format.
fn float_width(name: &str, dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::BF16 | Dtype::F16 => Ok(2),
        Dtype::F32 => Ok(4),
        other => Err(Error::WrongDtype {
            name: name.to_string(),
            expected: "BF16, F16, F32 or F8_E4M3".to_string(),
            found: format!("{other:?}"),
        }),
    }
}

impl Checkpoint {
    /// The format a tensor is uploaded in: its own (BF16, F16 or F32: an
    /// F32 router kept out of a release's quantization stays F32), FP8 for
    /// float8_e4m3fn weights with their scales.
    pub fn format(&self, name: &str) -> Result<WeightFormat> {
        let entry = self.entry(name)?;
        match entry.dtype {
            Dtype::F8_E4M3 => {}
            Dtype::F32 => return Ok(WeightFormat::F32),
            Dtype::F16 => return Ok(WeightFormat::F16),
            other => {
                float_width(name, other)?;
                return Ok(WeightFormat::Bf16);
            }
        }
        if self.fp8_block_rows.is_none() {
            return Err(Error::Unsupported {
                what: "F8_E4M3 weights without an fp8 quantization_config in config.json",
                value: name.to_string(),
            });
        }
        self.entry(&scale_name(name))?;
        Ok(WeightFormat::F8E4M3)
    }

    /// An FP8 weight `[.., rows, cols]` as FP8 row blocks (see
    /// [`crate::format`]): each 128 values of a row after their scale,
    /// widened to f32 from the scale tensor `[.., rows / block_rows,
    /// cols / 128]` (rounded up) in f32, bf16 or f16.
    fn fp8_blocks(
        &self,
        name: &str,
        entry: &Entry,
        block_rows: usize,
        range: Option<Range<usize>>,
    ) -> Result<Vec<u8>> {
        let (rows, cols) = match entry.shape[..] {
            [.., rows, cols] => (rows, cols),
            _ => {
                return Err(Error::WrongShape {
                    name: name.to_string(),
                    expected: vec![0, 0],
                    found: entry.shape.clone(),
                });
            }
        };
        let matrices: usize = entry.shape[..entry.shape.len() - 2].iter().product();
        let scale_name = scale_name(name);
        let (scale_rows, blocks) = (rows.div_ceil(block_rows), cols.div_ceil(FP8_BLOCK_ELEMS));
        let mut scale_shape = entry.shape[..entry.shape.len() - 2].to_vec();
        scale_shape.extend([scale_rows, blocks]);
        // Exactly: a grid of [1, 2] blocks read as [2, 1] would scale the
        // wrong values.
        let found = &self.entry(&scale_name)?.shape;
        if found != &scale_shape {
            return Err(Error::WrongShape { name: scale_name, expected: scale_shape, found: found.clone() });
        }
        let scales = self.f32_values(&scale_name)?;
        let range = range.unwrap_or(0..matrices * rows);
        let data = &self.files[entry.file].1[entry.bytes.clone()][range.start * cols..range.end * cols];
        let block_bytes = 4 + FP8_BLOCK_ELEMS;
        let mut out = vec![0u8; range.len() * blocks * block_bytes];
        for (i, (row, out_row)) in
            data.chunks_exact(cols).zip(out.chunks_exact_mut(blocks * block_bytes)).enumerate()
        {
            let (matrix, r) = ((range.start + i) / rows, (range.start + i) % rows);
            let row_scales = &scales[(matrix * scale_rows + r / block_rows) * blocks..][..blocks];
            for ((values, block), scale) in
                row.chunks(FP8_BLOCK_ELEMS).zip(out_row.chunks_exact_mut(block_bytes)).zip(row_scales)
            {
                block[..4].copy_from_slice(&scale.to_le_bytes());
                block[4..4 + values.len()].copy_from_slice(values);
            }
        }
        Ok(out)
    }

    /// A tensor's bytes in the layout of its [`Self::format`].
    pub fn stored_bytes(&self, name: &str, shape: &[usize]) -> Result<Cow<'_, [u8]>> {
        let entry = self.entry(name)?;
        self.check_transposable(name, entry, shape)?;
        match (entry.dtype, self.fp8_block_rows) {
            (Dtype::F8_E4M3, Some(block_rows)) => {
                self.check_shape(name, shape)?;
                Ok(Cow::Owned(self.fp8_blocks(name, entry, block_rows, None)?))
            }
            _ => self.float_bytes(name, shape),
        }
    }

    /// Rows `rows` of a tensor read as `[rows, last dim]`, in the layout of
    /// its [`Self::format`] (floats borrowed from the map).
    pub fn stored_rows(&self, name: &str, shape: &[usize], rows: Range<usize>) -> Result<Cow<'_, [u8]>> {
        self.check_shape(name, shape)?;
        let entry = self.entry(name)?;
        let cols = *shape.last().unwrap_or(&1);
        let total = shape.iter().product::<usize>() / cols.max(1);
        if rows.end > total || rows.start > rows.end {
            return Err(Error::WrongShape {
                name: name.to_string(),
                expected: vec![rows.end, cols],
                found: entry.shape.clone(),
            });
        }
        self.check_transposable(name, entry, shape)?;
        if self.stored_transposed(name, entry, shape) {
            // The matrices the rows fall in, transposed, then the rows.
            let per_matrix = shape[1];
            let matrices = rows.start / per_matrix..rows.end.div_ceil(per_matrix);
            let (p, q) = (entry.shape[1], entry.shape[2]);
            let width = float_width(name, entry.dtype)?;
            let data = &self.files[entry.file].1[entry.bytes.clone()];
            let part = &data[matrices.start * p * q * width..matrices.end * p * q * width];
            let transposed = transpose_matrices(part, matrices.len(), p, q, width);
            let first = matrices.start * per_matrix;
            return Ok(Cow::Owned(
                transposed[(rows.start - first) * cols * width..(rows.end - first) * cols * width].to_vec(),
            ));
        }
        match (entry.dtype, self.fp8_block_rows) {
            (Dtype::F8_E4M3, Some(block_rows)) => {
                Ok(Cow::Owned(self.fp8_blocks(name, entry, block_rows, Some(rows))?))
            }
            (dtype, _) => {
                let width = float_width(name, dtype)?;
                let data = &self.files[entry.file].1[entry.bytes.clone()];
                Ok(Cow::Borrowed(
                    data.get(rows.start * cols * width..rows.end * cols * width).unwrap_or_default(),
                ))
            }
        }
    }

    /// A transposed tensor must be one this reader transposes: not FP8,
    /// whose block scales run along the stored rows.
    fn check_transposable(&self, name: &str, entry: &Entry, shape: &[usize]) -> Result<()> {
        if self.stored_transposed(name, entry, shape) && entry.dtype == Dtype::F8_E4M3 {
            return Err(Error::Unsupported {
                what: "FP8 expert tensors stored transposed",
                value: format!("{name}: {:?} where {shape:?} is read", entry.shape),
            });
        }
        Ok(())
    }

    /// A tensor's values as f32 (for small tensors kept in f32).
    pub fn f32_values(&self, name: &str) -> Result<Vec<f32>> {
        let entry = self.entry(name)?;
        let data = &self.files[entry.file].1[entry.bytes.clone()];
        Ok(match entry.dtype {
            Dtype::F32 => {
                data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            Dtype::BF16 => {
                data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            Dtype::F16 => {
                data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            other => {
                return Err(Error::WrongDtype {
                    name: name.to_string(),
                    expected: "F32, BF16 or F16".to_string(),
                    found: format!("{other:?}"),
                });
            }
        })
    }
}

/// The shard files `index` names, each a plain file name in `dir`: a path
/// that leads elsewhere (`../x`, `/etc/passwd`, `sub/x`) is refused rather
/// than read.
fn shard_list(index: &Path, dir: &Path) -> Result<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let parsed: Index = crate::error::read_json(index)?;
    let mut shards: Vec<String> = parsed.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    for shard in &shards {
        let plain = matches!(
            Path::new(shard).components().collect::<Vec<_>>()[..],
            [std::path::Component::Normal(_)]
        );
        if !plain {
            return Err(Error::Json {
                path: index.to_path_buf(),
                message: format!(
                    "weight_map names shard {shard:?}, which is not a file name in {}",
                    dir.display()
                ),
            });
        }
    }
    Ok(shards)
}

/// Where weights come from: a checkpoint, or random values of the right
/// shapes for benchmarks.
pub trait TensorSource {
    fn contains(&self, name: &str) -> bool;
    /// Fails with `MissingTensor` or `WrongShape` unless `name` has `shape`.
    fn check_shape(&self, name: &str, shape: &[usize]) -> Result<()>;
    /// The format a tensor whose shape was checked is uploaded in.
    fn format(&self, _name: &str) -> Result<WeightFormat> {
        Ok(WeightFormat::Bf16)
    }
    /// The bytes of a tensor whose shape was checked, in the file layout of
    /// its [`Self::format`] (bf16: little-endian pairs).
    fn stored_bytes(&self, name: &str, shape: &[usize]) -> Result<Cow<'_, [u8]>>;
    /// Rows `rows` of a tensor whose shape was checked, read as `[rows,
    /// last dim]`: that part of [`Self::stored_bytes`].
    fn stored_rows(&self, name: &str, shape: &[usize], rows: Range<usize>) -> Result<Cow<'_, [u8]>> {
        let row_bytes = self.format(name)?.file_row_bytes(*shape.last().unwrap_or(&1));
        let bytes = self.stored_bytes(name, shape)?;
        let part = bytes.get(rows.start * row_bytes..rows.end * row_bytes);
        part.map(|b| Cow::Owned(b.to_vec())).ok_or_else(|| Error::WrongShape {
            name: name.to_string(),
            expected: vec![rows.end],
            found: shape.to_vec(),
        })
    }
    /// The values of a vector of `len` whose shape was checked.
    fn f32_values(&self, name: &str, len: usize) -> Result<Vec<f32>>;
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }
    fn check_shape(&self, name: &str, shape: &[usize]) -> Result<()> {
        Checkpoint::check_shape(self, name, shape)
    }
    fn format(&self, name: &str) -> Result<WeightFormat> {
        Checkpoint::format(self, name)
    }
    fn stored_bytes(&self, name: &str, shape: &[usize]) -> Result<Cow<'_, [u8]>> {
        Checkpoint::stored_bytes(self, name, shape)
    }
    fn stored_rows(&self, name: &str, shape: &[usize], rows: Range<usize>) -> Result<Cow<'_, [u8]>> {
        Checkpoint::stored_rows(self, name, shape, rows)
    }
    fn f32_values(&self, name: &str, _len: usize) -> Result<Vec<f32>> {
        Checkpoint::f32_values(self, name)
    }
}

/// Streams tensors to the GPU, flushing the queue's staging memory
/// regularly so host memory never holds a second copy of the model.
pub struct Uploader<'a> {
    gpu: &'a Gpu,
    checkpoint: &'a dyn TensorSource,
    pending_bytes: u64,
    progress: &'a mut dyn FnMut(Progress<'_>),
}

const FLUSH_BYTES: u64 = 256 << 20;

impl<'a> Uploader<'a> {
    /// `progress` hears of every tensor's bytes as they are written.
    pub fn new(
        gpu: &'a Gpu,
        checkpoint: &'a dyn TensorSource,
        progress: &'a mut dyn FnMut(Progress<'_>),
    ) -> Self {
        Uploader { gpu, checkpoint, pending_bytes: 0, progress }
    }

    /// One `[rows, cols]` tensor (a vector when `rows` is 1).
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<GpuTensor> {
        let shape: &[usize] = if rows == 1 { &[cols] } else { &[rows, cols] };
        self.upload(name, &[(name, shape)], cols, 1)
    }

    /// A tensor of any `shape` read as rows of `cols` (a convolution's
    /// kernel as the matrix of its output channels).
    pub fn tensor(&mut self, name: &str, shape: &[usize], cols: usize) -> Result<GpuTensor> {
        self.upload(name, &[(name, shape)], cols, 1)
    }

    /// A fused 3-D expert tensor `[experts, rows, cols]`, stored as
    /// `experts * rows` rows grouped by expert.
    pub fn experts(&mut self, name: &str, experts: usize, rows: usize, cols: usize) -> Result<GpuTensor> {
        self.upload(name, &[(name, &[experts, rows, cols])], cols, rows)
    }

    /// Several `[rows_i, cols]` tensors stacked by rows into one GPU tensor
    /// (fused projections: q|k|v, gate|up, and per-expert tensors stacked
    /// into groups of `group_rows`).
    pub fn stack(
        &mut self,
        label: &str,
        sources: &[(&str, usize)],
        cols: usize,
        group_rows: usize,
    ) -> Result<GpuTensor> {
        let shapes: Vec<[usize; 2]> = sources.iter().map(|(_, rows)| [*rows, cols]).collect();
        let sources: Vec<(&str, &[usize])> =
            sources.iter().zip(&shapes).map(|((n, _), s)| (*n, &s[..])).collect();
        self.upload(label, &sources, cols, group_rows)
    }

    /// Gate and up projections with their rows interleaved (row `2i` gate
    /// row `i`, row `2i + 1` up row `i`), so that one GEMV output reads
    /// both rows of its SwiGLU. `sources` hold, in order, groups of
    /// `2 * n` rows: `n` gate rows then `n` up rows (`[gate; up]` of a
    /// dense layer, per-expert gate and up tensors one after the other, or
    /// the fused 3-D `gate_up_proj` of transformers 5). Each group of `2n`
    /// rows is written interleaved at the same place. Sources stored in
    /// different formats (a mixed GGUF may give gate and up types of their
    /// own) are all decoded to f32, which holds every format's values
    /// exactly: the interleaved rows share one format.
    pub fn gate_up(
        &mut self,
        label: &str,
        sources: &[(&str, &[usize])],
        n: usize,
        cols: usize,
    ) -> Result<GpuTensor> {
        let formats = self.formats(sources, cols)?;
        let same = formats.iter().all(|&f| f == formats[0]);
        let format = if same { formats[0] } else { WeightFormat::F32 };
        let total_rows: usize = sources.iter().map(|(_, s)| s.iter().product::<usize>() / cols).sum();
        let mut tensor = GpuTensor::alloc_in(self.gpu, label, format, total_rows, cols, 2 * n)?;
        let row_bytes = format.gpu_row_bytes(cols);
        let mut fits_f16 = true;
        let group_bytes = 2 * n * row_bytes;
        let mut group: Vec<u8> = Vec::with_capacity(group_bytes);
        let mut interleaved = vec![0u8; group_bytes];
        let mut first_row = 0;
        for ((name, shape), &stored) in sources.iter().zip(&formats) {
            let stored_bytes = self.checkpoint.stored_bytes(name, shape)?;
            let (gpu_layout, decoded);
            fits_f16 &= stored.fits_f16(&stored_bytes);
            let bytes: &[u8] = match stored == format {
                true => {
                    gpu_layout = format.to_gpu_layout(&stored_bytes);
                    &gpu_layout
                }
                false => {
                    decoded = stored.dequantize(&stored_bytes, cols);
                    bytemuck::cast_slice(&decoded)
                }
            };
            let mut rest: &[u8] = bytes;
            while !rest.is_empty() {
                let take = (group_bytes - group.len()).min(rest.len());
                group.extend_from_slice(&rest[..take]);
                rest = &rest[take..];
                if group.len() == group_bytes {
                    for (i, row) in group.chunks_exact(row_bytes).enumerate() {
                        let (half, r) = (i / n, i % n);
                        let to = (2 * r + half) * row_bytes;
                        interleaved[to..to + row_bytes].copy_from_slice(row);
                    }
                    tensor.write_rows(self.gpu, first_row, &interleaved);
                    first_row += 2 * n;
                    group.clear();
                }
            }
            self.written(bytes.len() as u64)?;
        }
        if !fits_f16 {
            tensor.mark_beyond_f16(0..total_rows);
        }
        Ok(tensor)
    }

    /// A small f32 vector kept in f32 (a router's score-correction bias,
    /// whose precision decides expert selection).
    pub fn f32_vector(&mut self, name: &str, len: usize) -> Result<wgpu::Buffer> {
        self.checkpoint.check_shape(name, &[len])?;
        let values = self.checkpoint.f32_values(name, len)?;
        Ok(self.gpu.storage_buffer_init(name, &values[..len]))
    }

    /// A norm's weight vector, in f32 whatever its stored type (bf16 and
    /// f16 widen exactly; GGUF files store norms in f32).
    pub fn norm(&mut self, name: &str, len: usize) -> Result<GpuTensor> {
        self.checkpoint.check_shape(name, &[len])?;
        let values = self.checkpoint.f32_values(name, len)?;
        GpuTensor::vector_f32(self.gpu, name, &values[..len])
    }

    /// The formats of `sources` (checked), each able to hold rows of `cols`.
    fn formats(&self, sources: &[(&str, &[usize])], cols: usize) -> Result<Vec<WeightFormat>> {
        sources
            .iter()
            .map(|(name, shape)| {
                self.checkpoint.check_shape(name, shape)?;
                let format = self.checkpoint.format(name)?;
                if !format.fits_row(cols) {
                    return Err(Error::Unsupported {
                        what: "row width for the tensor's format",
                        value: format!("{name}: {cols} columns of {format}"),
                    });
                }
                Ok(format)
            })
            .collect()
    }

    fn upload(
        &mut self,
        label: &str,
        sources: &[(&str, &[usize])],
        cols: usize,
        group_rows: usize,
    ) -> Result<GpuTensor> {
        // Check every source before allocating anything.
        let formats = self.formats(sources, cols)?;
        let rows_of = |shape: &[usize]| shape.iter().product::<usize>() / cols;
        // Consecutive sources of one format share parts.
        let mut segments: Vec<(WeightFormat, usize)> = Vec::new();
        for ((_, shape), &format) in sources.iter().zip(&formats) {
            match segments.last_mut() {
                Some((f, rows)) if *f == format => *rows += rows_of(shape),
                _ => segments.push((format, rows_of(shape))),
            }
        }
        let mut tensor = GpuTensor::alloc_stacked(self.gpu, label, &segments, cols, group_rows)?;
        let mut row = 0;
        for (name, shape) in sources {
            let bytes = self.checkpoint.stored_bytes(name, shape)?;
            tensor.write_file_rows(self.gpu, row, &bytes);
            row += rows_of(shape);
            self.written(bytes.len() as u64)?;
        }
        Ok(tensor)
    }

    /// Counts `bytes` more written: reported, and flushed every FLUSH_BYTES
    /// so that the staging memory stays bounded.
    fn written(&mut self, bytes: u64) -> Result<()> {
        (self.progress)(Progress::Advance { bytes });
        self.pending_bytes += bytes;
        if self.pending_bytes >= FLUSH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.checkpoint.contains(name)
    }

    pub fn flush(&mut self) -> Result<()> {
        self.gpu.queue.submit([]);
        self.gpu.wait()?;
        self.gpu.check("uploading weights")?;
        self.pending_bytes = 0;
        Ok(())
    }
}
