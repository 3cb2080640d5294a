//! The GGUF file format (llama.cpp's): a header of typed metadata, a table
//! of tensors, then their data. [`Gguf`] memory-maps a file and checks that
//! every tensor lies inside it; [`GgufWriter`] writes one. Control vectors,
//! GGUF models and their tokenizers are read with these.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::format::WeightFormat;

/// A metadata value. Integers of every width read as `Int`, floats of both
/// widths as `Float`.
#[derive(Debug, Clone, PartialEq)]
pub enum Meta {
    /// An integer of any width, signed or not (a u64 past `i64::MAX`
    /// reads as `Float`).
    Int(i64),
    /// An f32 or f64.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array, whose items may be arrays (nested at most 8 deep).
    Array(Vec<Meta>),
}

/// A short description for error messages: a value from a hostile file may
/// be a megabyte of string or array, which a message must not quote whole.
impl std::fmt::Display for Meta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const QUOTED_CHARS: usize = 64;
        match self {
            Meta::Int(v) => write!(f, "{v}"),
            Meta::Float(v) => write!(f, "{v}"),
            Meta::Bool(v) => write!(f, "{v}"),
            Meta::Str(v) if v.chars().count() > QUOTED_CHARS => {
                let head: String = v.chars().take(QUOTED_CHARS).collect();
                write!(f, "{head:?}... ({} bytes)", v.len())
            }
            Meta::Str(v) => write!(f, "{v:?}"),
            Meta::Array(items) => write!(f, "an array of {} values", items.len()),
        }
    }
}

/// A ggml tensor type: the ones the reader knows. Tensors of the others
/// (the other i-quants, ternary and FP4 types) make [`Gguf::open`] fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE double precision.
    F64,
    /// Signed 8-bit integers.
    I8,
    /// Signed 16-bit integers.
    I16,
    /// Signed 32-bit integers.
    I32,
    /// Signed 64-bit integers.
    I64,
    /// Blocks of 32 4-bit values and an f16 scale (18 bytes).
    Q4_0,
    /// Blocks of 32 4-bit values, an f16 scale and an f16 minimum (20 bytes).
    Q4_1,
    /// Blocks of 32 5-bit values and an f16 scale (22 bytes).
    Q5_0,
    /// Blocks of 32 5-bit values, an f16 scale and an f16 minimum (24 bytes).
    Q5_1,
    /// Blocks of 32 8-bit values and an f16 scale (34 bytes).
    Q8_0,
    /// Blocks of 32 8-bit values, an f16 scale and the scaled sum (36
    /// bytes): llama.cpp's activation type, not a weight format.
    Q8_1,
    /// k-quant: super-blocks of 256 2-bit values with 4-bit scales and
    /// minima per 16 (84 bytes).
    Q2K,
    /// k-quant: super-blocks of 256 3-bit values with 6-bit scales per 16
    /// (110 bytes).
    Q3K,
    /// k-quant: super-blocks of 256 4-bit values with 6-bit scales and
    /// minima per 32 (144 bytes).
    Q4K,
    /// k-quant: super-blocks of 256 5-bit values with 6-bit scales and
    /// minima per 32 (176 bytes).
    Q5K,
    /// k-quant: super-blocks of 256 6-bit values with 8-bit scales per 16
    /// (210 bytes).
    Q6K,
    /// k-quant: super-blocks of 256 8-bit values with an f32 scale and
    /// sums per 16 (292 bytes): llama.cpp's activation type, not a weight
    /// format.
    Q8K,
    /// i-quant: blocks of 32 4-bit indexes into a table of 16 non-linear
    /// values and an f16 scale (18 bytes).
    IQ4NL,
    /// i-quant: super-blocks of 256 4-bit indexes into IQ4_NL's table, with
    /// 6-bit scales per 32 (136 bytes).
    IQ4XS,
    /// i-quant: super-blocks of 256, 8-bit lattice indexes per 8 values (66 bytes).
    IQ2XXS,
    /// i-quant: super-blocks of 256, 9-bit lattice indexes per 8 values (74 bytes).
    IQ2XS,
    /// i-quant: super-blocks of 256, 10-bit lattice indexes per 8 values (82 bytes).
    IQ2S,
    /// i-quant: super-blocks of 256, 8-bit lattice indexes per 4 values (98 bytes).
    IQ3XXS,
    /// i-quant: super-blocks of 256, 9-bit lattice indexes per 4 values (110 bytes).
    IQ3S,
    /// i-quant: super-blocks of 256, 11-bit ternary lattice indexes per 8 values (50 bytes).
    IQ1S,
    /// i-quant: as IQ1_S with finer scales and shifts (56 bytes).
    IQ1M,
    /// OCP microscaling FP4: blocks of 32 e2m1 values and an e8m0 scale (17 bytes).
    MXFP4,
}

/// The mapping between GGUF tensor types and the GPU weight formats
/// (defined here, so that the formats know nothing of the file).
impl WeightFormat {
    /// The format of a GGUF tensor type, if weights may be stored in it.
    pub fn from_ggml(ty: GgmlType) -> Option<Self> {
        Some(match ty {
            GgmlType::BF16 => Self::Bf16,
            GgmlType::F16 => Self::F16,
            GgmlType::F32 => Self::F32,
            GgmlType::Q4_0 => Self::Q4_0,
            GgmlType::Q4_1 => Self::Q4_1,
            GgmlType::Q5_0 => Self::Q5_0,
            GgmlType::Q5_1 => Self::Q5_1,
            GgmlType::Q8_0 => Self::Q8_0,
            GgmlType::Q2K => Self::Q2K,
            GgmlType::Q3K => Self::Q3K,
            GgmlType::Q4K => Self::Q4K,
            GgmlType::Q5K => Self::Q5K,
            GgmlType::Q6K => Self::Q6K,
            GgmlType::IQ4NL => Self::IQ4NL,
            GgmlType::IQ4XS => Self::IQ4XS,
            GgmlType::IQ2XXS => Self::IQ2XXS,
            GgmlType::IQ2XS => Self::IQ2XS,
            GgmlType::IQ2S => Self::IQ2S,
            GgmlType::IQ3XXS => Self::IQ3XXS,
            GgmlType::IQ3S => Self::IQ3S,
            GgmlType::IQ1S => Self::IQ1S,
            GgmlType::IQ1M => Self::IQ1M,
            GgmlType::MXFP4 => Self::MXFP4,
            _ => return None,
        })
    }

    /// The GGUF tensor type (`None`: FP8, which GGUF files do not hold).
    pub fn ggml(self) -> Option<GgmlType> {
        Some(match self {
            Self::Bf16 => GgmlType::BF16,
            Self::F16 => GgmlType::F16,
            Self::F32 => GgmlType::F32,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q5_0 => GgmlType::Q5_0,
            Self::Q5_1 => GgmlType::Q5_1,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q2K => GgmlType::Q2K,
            Self::Q3K => GgmlType::Q3K,
            Self::Q4K => GgmlType::Q4K,
            Self::Q5K => GgmlType::Q5K,
            Self::Q6K => GgmlType::Q6K,
            Self::IQ4NL => GgmlType::IQ4NL,
            Self::IQ4XS => GgmlType::IQ4XS,
            Self::IQ2XXS => GgmlType::IQ2XXS,
            Self::IQ2XS => GgmlType::IQ2XS,
            Self::IQ2S => GgmlType::IQ2S,
            Self::IQ3XXS => GgmlType::IQ3XXS,
            Self::IQ3S => GgmlType::IQ3S,
            Self::IQ1S => GgmlType::IQ1S,
            Self::IQ1M => GgmlType::IQ1M,
            Self::MXFP4 => GgmlType::MXFP4,
            Self::F8E4M3 => return None,
        })
    }
}

/// Every type the reader knows: the type, its ggml id, its name, and its
/// elements and bytes per block.
const GGML_TYPES: [(GgmlType, u32, &str, usize, usize); 30] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
];

/// ggml's other type ids, named in the error that refuses a tensor of one:
/// the ternary types, NVFP4, the 1- and 2-bit Q types, and the repacked
/// ones llama.cpp no longer writes.
const UNREAD_GGML_TYPES: [(u32, &str); 11] = [
    (31, "Q4_0_4_4"),
    (32, "Q4_0_4_8"),
    (33, "Q4_0_8_8"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (36, "IQ4_NL_4_4"),
    (37, "IQ4_NL_4_8"),
    (38, "IQ4_NL_8_8"),
    (40, "NVFP4"),
    (41, "Q1_0"),
    (42, "Q2_0"),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        GGML_TYPES.iter().find(|e| e.0 == self).expect("every type has a row in GGML_TYPES")
    }

    /// The type of ggml's numeric id (`None`: a type the reader does not
    /// know).
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// ggml's numeric id of the type, as GGUF files store it.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// ggml's name of the type (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per block and bytes per block.
    fn block(self) -> (usize, usize) {
        let e = self.entry();
        (e.3, e.4)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's entry in a GGUF file's table: name, dimensions, type, and
/// where its bytes are (read with [`Gguf::data`]).
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The tensor's name (llama.cpp's naming: `blk.0.attn_q.weight`).
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<usize>,
    /// How its values are stored.
    pub ty: GgmlType,
    /// From the start of the data section.
    offset: usize,
    byte_len: usize,
}

impl TensorInfo {
    /// The number of values: the product of `dims`.
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// The shape in row-major (Hugging Face) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A GGUF file, memory-mapped.
pub struct Gguf {
    path: PathBuf,
    map: Mmap,
    /// The format version: 2 or 3.
    pub version: u32,
    /// The header's key-value metadata.
    pub metadata: HashMap<String, Meta>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    data_start: usize,
}

/// The metadata key of the data section's alignment, and its default.
const ALIGNMENT_KEY: &str = "general.alignment";
const DEFAULT_ALIGNMENT: usize = 32;
/// Metadata arrays may hold arrays; real files nest one or two deep.
const MAX_ARRAY_DEPTH: usize = 8;

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn err(&self, message: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            message: format!("{} (at byte {})", message.into(), self.pos),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| self.err("unexpected end of file (truncated?)"))?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count or length, which cannot exceed the file.
    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        if n > self.bytes.len() as u64 {
            return Err(self.err(format!("length {n} exceeds the file (truncated or corrupt)")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        let bytes = self.take(n)?.to_vec();
        String::from_utf8(bytes).map_err(|_| self.err("string is not UTF-8"))
    }

    /// A metadata value of type `ty`, inside `depth` arrays.
    fn value(&mut self, ty: u32, depth: usize) -> Result<Meta> {
        Ok(match ty {
            0 => Meta::Int(self.array::<1>()?[0] as i64),
            1 => Meta::Int(self.array::<1>()?[0] as i8 as i64),
            2 => Meta::Int(u16::from_le_bytes(self.array()?) as i64),
            3 => Meta::Int(i16::from_le_bytes(self.array()?) as i64),
            4 => Meta::Int(self.u32()? as i64),
            5 => Meta::Int(self.u32()? as i32 as i64),
            6 => Meta::Float(f32::from_le_bytes(self.array()?) as f64),
            7 => Meta::Bool(self.array::<1>()?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 => {
                // Bounded: nesting is read by recursion.
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("metadata arrays nested more than {MAX_ARRAY_DEPTH} deep")));
                }
                let elem = self.u32()?;
                let n = self.len()?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Meta::Array(items)
            }
            // A u64 past i64's range is no count or id a model has: kept as
            // the number it is (an error where an integer is read), not as a
            // negative one.
            10 => {
                let v = self.u64()?;
                i64::try_from(v).map(Meta::Int).unwrap_or(Meta::Float(v as f64))
            }
            11 => Meta::Int(self.u64()? as i64),
            12 => Meta::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(format!("unknown metadata type {other}"))),
        })
    }
}

impl Gguf {
    /// Memory-maps and parses a little-endian GGUF file of version 2 or 3,
    /// checking that every tensor is of a known type, whole blocks, and
    /// inside the file: a file that is not is an [`Error::Gguf`], one that
    /// cannot be opened an [`Error::Io`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        crate::error::check_regular_file(path)?;
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; like every memory-mapped loader we
        // rely on the file not being truncated by another process meanwhile.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path, map)
    }

    fn parse(path: &Path, map: Mmap) -> Result<Self> {
        let mut c = Cursor { bytes: &map, pos: 0, path };
        if c.take(4).ok() != Some(b"GGUF".as_slice()) {
            return Err(Error::Gguf {
                path: path.to_path_buf(),
                message: "not a GGUF file (bad magic)".into(),
            });
        }
        let version = c.u32()?;
        if (2..=3).contains(&version.swap_bytes()) {
            return Err(c.err("a big-endian GGUF (llama.cpp's --bigendian): only little-endian files load"));
        }
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("unsupported GGUF version {version}")));
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let value = c.value(ty, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.err(format!("metadata key {key} appears twice")));
            }
        }
        let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors.min(1 << 16));
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            if n_dims > 4 {
                return Err(c.err(format!("tensor {name} has {n_dims} dimensions (at most 4)")));
            }
            let dims = (0..n_dims).map(|_| c.len()).collect::<Result<Vec<_>>>()?;
            let type_id = c.u32()?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| {
                let known = UNREAD_GGML_TYPES.iter().find(|(id, _)| *id == type_id);
                let type_name = known.map_or("an unknown type".to_string(), |(_, n)| n.to_string());
                c.err(format!("tensor {name}: unsupported ggml type {type_id} ({type_name})"))
            })?;
            let offset = c.len()?;
            let elements = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let (block, block_bytes) = ty.block();
            if dims.first().is_some_and(|d| d % block != 0) {
                return Err(
                    c.err(format!("tensor {name}: rows of {} elements are not whole {ty} blocks", dims[0]))
                );
            }
            let byte_len = elements
                .filter(|n| n % block == 0)
                .map(|n| n / block * block_bytes)
                .ok_or_else(|| c.err(format!("tensor {name}: dims {dims:?} are not whole {ty} blocks")))?;
            if !names.insert(name.clone()) {
                return Err(c.err(format!("tensor {name} appears twice")));
            }
            tensors.push(TensorInfo { name, dims, ty, offset, byte_len });
        }
        let alignment = match metadata.get(ALIGNMENT_KEY) {
            Some(Meta::Int(a)) if *a > 0 => *a as usize,
            None => DEFAULT_ALIGNMENT,
            Some(other) => return Err(c.err(format!("{ALIGNMENT_KEY} is {other}"))),
        };
        let data_start = c.pos.next_multiple_of(alignment);
        for t in &tensors {
            let end = data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.byte_len));
            if end.is_none_or(|end| end > map.len()) {
                return Err(Error::Gguf {
                    path: path.to_path_buf(),
                    message: format!(
                        "tensor {} runs past the end of the file ({} bytes; truncated?)",
                        t.name,
                        map.len()
                    ),
                });
            }
        }
        Ok(Gguf { path: path.to_path_buf(), map, version, metadata, tensors, data_start })
    }

    /// The file's path, as given to [`Self::open`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn err(&self, message: String) -> Error {
        Error::Gguf { path: self.path.clone(), message }
    }

    /// The metadata value of `key`; an error naming it where it is absent.
    pub fn meta(&self, key: &str) -> Result<&Meta> {
        self.metadata.get(key).ok_or_else(|| self.err(format!("missing metadata key {key}")))
    }

    /// The integer value of `key`; an error where it is absent or not an
    /// integer.
    pub fn meta_int(&self, key: &str) -> Result<i64> {
        match self.meta(key)? {
            Meta::Int(v) => Ok(*v),
            other => Err(self.err(format!("{key} is {other}, expected an integer"))),
        }
    }

    /// A finite number (no model parameter is NaN or infinite).
    pub fn meta_float(&self, key: &str) -> Result<f64> {
        match self.meta(key)? {
            Meta::Float(v) if v.is_finite() => Ok(*v),
            Meta::Int(v) => Ok(*v as f64),
            other => Err(self.err(format!("{key} is {other}, expected a finite number"))),
        }
    }

    /// [`Self::meta_int`] of a key the file may leave out: `None` where it
    /// does, an error where it holds something else.
    pub fn meta_int_opt(&self, key: &str) -> Result<Option<i64>> {
        self.metadata.contains_key(key).then(|| self.meta_int(key)).transpose()
    }

    /// [`Self::meta_str`] of a key the file may leave out.
    pub fn meta_str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.metadata.contains_key(key).then(|| self.meta_str(key)).transpose()
    }

    /// [`Self::meta_float`] of a key the file may leave out.
    pub fn meta_float_opt(&self, key: &str) -> Result<Option<f64>> {
        self.metadata.contains_key(key).then(|| self.meta_float(key)).transpose()
    }

    /// The string value of `key`; an error where it is absent or not a
    /// string.
    pub fn meta_str(&self, key: &str) -> Result<&str> {
        match self.meta(key)? {
            Meta::Str(v) => Ok(v),
            other => Err(self.err(format!("{key} is {other}, expected a string"))),
        }
    }

    /// The array of strings of `key` (a vocabulary, merges); an error
    /// where it is absent, not an array, or holds anything but strings.
    pub fn meta_strings(&self, key: &str) -> Result<Vec<&str>> {
        match self.meta(key)? {
            Meta::Array(items) => items
                .iter()
                .map(|m| match m {
                    Meta::Str(s) => Ok(s.as_str()),
                    other => Err(self.err(format!("{key} holds {other}, expected strings"))),
                })
                .collect(),
            other => Err(self.err(format!("{key} is {other}, expected an array"))),
        }
    }

    /// The tensor named `name`, if the file has one.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's bytes as stored.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.data_start + t.offset;
        &self.map[start..start + t.byte_len]
    }

    /// The tensor's values as f32 in row-major (Hugging Face) order, for
    /// the types weights may be stored in ([`WeightFormat`]).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        match WeightFormat::from_ggml(t.ty) {
            Some(format) => Ok(format.dequantize(self.data(t), t.dims.first().copied().unwrap_or(1))),
            None => Err(self.err(format!("tensor {}: cannot dequantize {}", t.name, t.ty))),
        }
    }
}

/// Writes a GGUF (version 3) file: metadata in insertion order, then
/// tensors in insertion order, each aligned to 32 bytes.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)>,
}

/// A metadata value with its exact GGUF type, for writing.
#[derive(Debug, Clone)]
pub enum MetaValue {
    /// GGUF type 4, an unsigned 32-bit integer.
    U32(u32),
    /// GGUF type 5, a signed 32-bit integer.
    I32(i32),
    /// GGUF type 10, an unsigned 64-bit integer.
    U64(u64),
    /// GGUF type 6, an f32.
    F32(f32),
    /// GGUF type 7, a boolean.
    Bool(bool),
    /// GGUF type 8, a UTF-8 string.
    Str(String),
    /// An array of strings (a vocabulary, merges).
    Strings(Vec<String>),
}

impl GgufWriter {
    /// A writer with no metadata and no tensors.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the metadata entry `key` (keys are not checked for repeats,
    /// which [`Gguf::open`] refuses).
    pub fn meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// A tensor of `dims` (ggml order) whose bytes are already encoded as `ty`.
    pub fn tensor_bytes(&mut self, name: &str, dims: &[usize], ty: GgmlType, bytes: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, bytes));
        self
    }

    /// An F32 tensor of `dims` (ggml order).
    pub fn tensor_f32(&mut self, name: &str, dims: &[usize], values: &[f32]) -> &mut Self {
        self.tensor_bytes(name, dims, GgmlType::F32, bytemuck::cast_slice(values).to_vec())
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            string(&mut out, key);
            match value {
                MetaValue::U32(v) => out.extend(4u32.to_le_bytes().into_iter().chain(v.to_le_bytes())),
                MetaValue::I32(v) => out.extend(5u32.to_le_bytes().into_iter().chain(v.to_le_bytes())),
                MetaValue::F32(v) => out.extend(6u32.to_le_bytes().into_iter().chain(v.to_le_bytes())),
                MetaValue::Bool(v) => out.extend(7u32.to_le_bytes().into_iter().chain([*v as u8])),
                MetaValue::Str(v) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, v);
                }
                MetaValue::U64(v) => out.extend(10u32.to_le_bytes().into_iter().chain(v.to_le_bytes())),
                MetaValue::Strings(items) => {
                    out.extend(9u32.to_le_bytes().into_iter().chain(8u32.to_le_bytes()));
                    out.extend((items.len() as u64).to_le_bytes());
                    for item in items {
                        string(&mut out, item);
                    }
                }
            }
        }
        let mut offset = 0usize;
        for (name, dims, ty, bytes) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for &d in dims {
                out.extend((d as u64).to_le_bytes());
            }
            out.extend(ty.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).next_multiple_of(DEFAULT_ALIGNMENT);
        }
        for (_, _, _, bytes) in &self.tensors {
            out.resize(out.len().next_multiple_of(DEFAULT_ALIGNMENT), 0);
            out.extend(bytes);
        }
        out
    }

    /// Writes the file to `path`, replacing any file there.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes()).map_err(|e| Error::io(path, e))
    }
}
