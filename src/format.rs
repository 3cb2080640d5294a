//! Weight formats: how a matrix's values are stored, in the file and on
//! the GPU. Weights keep their stored format on the GPU and are decoded in
//! registers by the kernels that read them (`wgsl/weights.wgsl`); the CPU
//! decoding here is the reference those kernels are tested against, and
//! equals the `gguf` Python package's `dequantize` bit for bit.
//!
//! A block format's GPU block is its file block with every field on a
//! 4-byte boundary: the blocks whose size is 2 mod 4 get two zero bytes
//! after their leading f16 scale (Q4_0, Q5_0, Q8_0, IQ4_NL, IQ2_XXS,
//! IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S) or after their trailing one (Q3_K,
//! Q6_K), MXFP4 three after its leading exponent byte. The values and
//! their bits are the file's.
//!
//! The i-quants below 4 bits pick each group of 4 or 8 values from a
//! lattice (a "grid", `format::grids`) by index, with signs and scales beside.
//!
//! FP8 checkpoints (`float8_e4m3fn` weights with a `weight_scale_inv` per
//! block of rows x 128 columns) are stored on the GPU, and handed over by
//! the checkpoint, as row blocks of 128 values: the block's f32 scale,
//! then its 128 bytes, the last block of a row zero-padded. The scale is
//! repeated on every row of its block (4 bytes per 128 weights) so that a
//! row is read like any other block format.

use std::borrow::Cow;

mod grids;
pub use grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// The storage format of a weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// bfloat16, 2 bytes a value.
    Bf16,
    /// IEEE half precision, 2 bytes a value.
    F16,
    /// IEEE single precision, 4 bytes a value.
    F32,
    /// ggml's Q4_0: blocks of 32 4-bit values and an f16 scale.
    Q4_0,
    /// ggml's Q4_1: blocks of 32 4-bit values, an f16 scale and minimum.
    Q4_1,
    /// ggml's Q5_0: blocks of 32 5-bit values and an f16 scale.
    Q5_0,
    /// ggml's Q5_1: blocks of 32 5-bit values, an f16 scale and minimum.
    Q5_1,
    /// ggml's Q8_0: blocks of 32 8-bit values and an f16 scale.
    Q8_0,
    /// ggml's Q2_K: super-blocks of 256 2-bit values.
    Q2K,
    /// ggml's Q3_K: super-blocks of 256 3-bit values.
    Q3K,
    /// ggml's Q4_K: super-blocks of 256 4-bit values.
    Q4K,
    /// ggml's Q5_K: super-blocks of 256 5-bit values.
    Q5K,
    /// ggml's Q6_K: super-blocks of 256 6-bit values.
    Q6K,
    /// float8_e4m3fn with an f32 scale per 128 values of a row.
    F8E4M3,
    /// ggml's IQ4_NL: blocks of 32 4-bit indexes into `IQ4NL_VALUES`
    /// and an f16 scale.
    IQ4NL,
    /// ggml's IQ4_XS: super-blocks of 256 4-bit indexes into
    /// `IQ4NL_VALUES`, an f16 scale and 6-bit scales per 32.
    IQ4XS,
    /// ggml's IQ2_XXS: super-blocks of 256, each 8 values an 8-bit index
    /// into `IQ2XXS_GRID` with 7 sign bits, a 4-bit scale per 32.
    IQ2XXS,
    /// ggml's IQ2_XS: as IQ2_XXS with 9-bit indexes into `IQ2XS_GRID` and
    /// a 4-bit scale per 16.
    IQ2XS,
    /// ggml's IQ2_S: 10-bit indexes into `IQ2S_GRID`, 8 sign bits per 8
    /// values, a 4-bit scale per 16.
    IQ2S,
    /// ggml's IQ3_XXS: each 4 values an 8-bit index into `IQ3XXS_GRID`,
    /// 7 sign bits per 8, a 4-bit scale per 32.
    IQ3XXS,
    /// ggml's IQ3_S: 9-bit indexes into `IQ3S_GRID`, 8 sign bits per 8, a
    /// 4-bit odd scale per 32.
    IQ3S,
    /// ggml's IQ1_S: each 8 values an 11-bit index into `IQ1S_GRID` (of
    /// -1, 0, 1), a 3-bit scale and a shift of +-1/8 per 32.
    IQ1S,
    /// ggml's IQ1_M: as IQ1_S with a scale per 16 and a shift per 8; its
    /// f16 scale is spread over the top nibbles of the scales.
    IQ1M,
    /// ggml's MXFP4 (OCP microscaling): blocks of 32 e2m1 values
    /// (`MXFP4_VALUES`, doubled) and a power-of-two scale byte (e8m0).
    MXFP4,
}

impl WeightFormat {
    /// Every format, in declaration order.
    pub const ALL: [WeightFormat; 24] = [
        WeightFormat::Bf16,
        WeightFormat::F16,
        WeightFormat::F32,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
        WeightFormat::F8E4M3,
        WeightFormat::IQ4NL,
        WeightFormat::IQ4XS,
        WeightFormat::IQ2XXS,
        WeightFormat::IQ2XS,
        WeightFormat::IQ2S,
        WeightFormat::IQ3XXS,
        WeightFormat::IQ3S,
        WeightFormat::IQ1S,
        WeightFormat::IQ1M,
        WeightFormat::MXFP4,
    ];

    /// The format's name: its GGUF type's, or safetensors' `F8_E4M3`.
    pub fn name(self) -> &'static str {
        match self.ggml() {
            Some(ty) => ty.name(),
            None => "F8_E4M3",
        }
    }

    /// Elements per block (1 for the float formats).
    pub fn block_elements(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 | Self::F32 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::IQ4NL | Self::MXFP4 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::IQ4XS => 256,
            Self::IQ2XXS | Self::IQ2XS | Self::IQ2S | Self::IQ3XXS | Self::IQ3S | Self::IQ1S | Self::IQ1M => {
                256
            }
            Self::F8E4M3 => FP8_BLOCK_ELEMS,
        }
    }

    /// Bytes per block in the file.
    pub fn file_block_bytes(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::F8E4M3 => 4 + FP8_BLOCK_ELEMS,
            Self::IQ4NL => 18,
            Self::IQ4XS => 136,
            Self::IQ2XXS => 66,
            Self::IQ2XS => 74,
            Self::IQ2S => 82,
            Self::IQ3XXS => 98,
            Self::IQ3S => 110,
            Self::IQ1S => 50,
            Self::IQ1M => 56,
            Self::MXFP4 => 17,
        }
    }

    /// Where a block gets zero bytes on the GPU, and how many: (offset in
    /// the file block, bytes).
    fn padding(self) -> (usize, usize) {
        match self {
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 | Self::IQ4NL => (2, 2),
            Self::IQ2XXS | Self::IQ2XS | Self::IQ2S | Self::IQ3XXS | Self::IQ3S | Self::IQ1S => (2, 2),
            Self::Q3K | Self::Q6K => (self.file_block_bytes(), 2),
            Self::MXFP4 => (1, 3),
            _ => (0, 0),
        }
    }

    /// Bytes per block on the GPU.
    pub fn gpu_block_bytes(self) -> usize {
        self.file_block_bytes() + self.padding().1
    }

    /// Whether a row of `cols` values is whole blocks, and whole words on
    /// the GPU (the float formats of 2 bytes need an even width); FP8 rows
    /// end in a padded block, and need whole quads (kernels read four
    /// values at a time).
    pub fn fits_row(self, cols: usize) -> bool {
        match self {
            Self::F8E4M3 => cols.is_multiple_of(4),
            _ => cols.is_multiple_of(self.block_elements()) && (self.gpu_row_bytes(cols)).is_multiple_of(4),
        }
    }

    /// Blocks of a row of `cols` values (FP8: the last one padded).
    fn row_blocks(self, cols: usize) -> usize {
        match self {
            Self::F8E4M3 => cols.div_ceil(FP8_BLOCK_ELEMS),
            _ => cols / self.block_elements(),
        }
    }

    /// Bytes of a row of `cols` values in the file (FP8: as the checkpoint
    /// hands it over, in the GPU layout).
    pub fn file_row_bytes(self, cols: usize) -> usize {
        self.row_blocks(cols) * self.file_block_bytes()
    }

    /// Bytes of a row of `cols` values on the GPU.
    pub fn gpu_row_bytes(self, cols: usize) -> usize {
        self.row_blocks(cols) * self.gpu_block_bytes()
    }

    /// The build flag of the kernels that read this format (`None`: bf16,
    /// the kernels' default).
    pub fn flag(self) -> Option<&'static str> {
        Some(match self {
            Self::Bf16 => return None,
            Self::F16 => "W_F16",
            Self::F32 => "W_F32",
            Self::Q4_0 => "W_Q4_0",
            Self::Q4_1 => "W_Q4_1",
            Self::Q5_0 => "W_Q5_0",
            Self::Q5_1 => "W_Q5_1",
            Self::Q8_0 => "W_Q8_0",
            Self::Q2K => "W_Q2_K",
            Self::Q3K => "W_Q3_K",
            Self::Q4K => "W_Q4_K",
            Self::Q5K => "W_Q5_K",
            Self::Q6K => "W_Q6_K",
            Self::F8E4M3 => "W_F8_E4M3",
            Self::IQ4NL => "W_IQ4_NL",
            Self::IQ4XS => "W_IQ4_XS",
            Self::IQ2XXS => "W_IQ2_XXS",
            Self::IQ2XS => "W_IQ2_XS",
            Self::IQ2S => "W_IQ2_S",
            Self::IQ3XXS => "W_IQ3_XXS",
            Self::IQ3S => "W_IQ3_S",
            Self::IQ1S => "W_IQ1_S",
            Self::IQ1M => "W_IQ1_M",
            Self::MXFP4 => "W_MXFP4",
        })
    }

    /// Whether every value of these whole blocks (file layout) lies within
    /// f16's range, as the cooperative-matrix GEMM stages weights. Checked
    /// where the format's range exceeds f16's: MXFP4's power-of-two scales
    /// (up to 2^127), FP8's f32 block scales and F32 values, read in place. The other formats' values are f16 themselves, or f16
    /// scales times small integers, or bf16 (whose range is f32's, but
    /// which no checkpoint fills beyond 65504: it is not scanned).
    pub fn fits_f16(self, file_bytes: &[u8]) -> bool {
        if !self.may_exceed_f16() {
            return true;
        }
        const F16_MAX: f32 = 65504.0;
        match self {
            // 6 * 2^(e - 127) at most: e <= 140.
            Self::MXFP4 => file_bytes.chunks_exact(self.file_block_bytes()).all(|b| b[0] <= 140),
            Self::F8E4M3 => {
                let largest_code = 448.0;
                file_bytes.chunks_exact(self.file_block_bytes()).all(|b| {
                    let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    scale.abs() * largest_code <= F16_MAX
                })
            }
            Self::F32 => file_bytes
                .chunks_exact(4)
                .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).abs() <= F16_MAX),
            _ => true,
        }
    }

    /// Whether some bytes of this format hold values beyond f16's range
    /// (those [`Self::fits_f16`] scans).
    pub fn may_exceed_f16(self) -> bool {
        matches!(self, Self::MXFP4 | Self::F8E4M3 | Self::F32)
    }

    /// File bytes (whole blocks) in the GPU layout.
    pub fn to_gpu_layout(self, file_bytes: &[u8]) -> Cow<'_, [u8]> {
        let block = self.file_block_bytes();
        let (pad_at, pad) = self.padding();
        if pad == 0 {
            return Cow::Borrowed(file_bytes);
        }
        let mut out = Vec::with_capacity(file_bytes.len() / block * self.gpu_block_bytes());
        for b in file_bytes.chunks_exact(block) {
            out.extend_from_slice(&b[..pad_at]);
            out.extend_from_slice(&[0; 3][..pad]);
            out.extend_from_slice(&b[pad_at..]);
        }
        Cow::Owned(out)
    }

    /// The values of whole rows of `cols` values in file bytes (the
    /// reference decoding).
    pub fn dequantize(self, file_bytes: &[u8], cols: usize) -> Vec<f32> {
        let (block, elements) = (self.file_block_bytes(), self.block_elements());
        let row_bytes = self.file_row_bytes(cols);
        let mut out = Vec::with_capacity(file_bytes.len().checked_div(row_bytes).unwrap_or(0) * cols);
        let mut decoded = vec![0.0f32; self.row_blocks(cols) * elements];
        for row in file_bytes.chunks_exact(row_bytes.max(1)).filter(|_| row_bytes > 0) {
            for (b, y) in row.chunks_exact(block).zip(decoded.chunks_exact_mut(elements)) {
                dequantize_block(self, b, y);
            }
            out.extend_from_slice(&decoded[..cols.min(decoded.len())]);
        }
        out
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Values per FP8 block on the GPU: the column width of the checkpoints'
/// scale blocks.
pub const FP8_BLOCK_ELEMS: usize = 128;

/// A float8_e4m3fn value: sign, 4 exponent bits (bias 7), 3 mantissa
/// bits; no infinities, 0x7f and 0xff are NaN.
pub fn f8_e4m3_to_f32(b: u8) -> f32 {
    let (exponent, mantissa) = ((b >> 3) & 0xf, (b & 7) as f32);
    let magnitude = match (exponent, b & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => mantissa / 8.0 * 2f32.powi(-6),
        (e, _) => (1.0 + mantissa / 8.0) * 2f32.powi(e as i32 - 7),
    };
    if b & 0x80 != 0 { -magnitude } else { magnitude }
}

/// The 16 values IQ4_NL's and IQ4_XS's 4-bit indexes select (ggml's
/// `kvalues_iq4nl`).
pub const IQ4NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The 16 values of MXFP4's e2m1 codes, doubled (ggml's `kvalues_mxfp4`):
/// the block's scale is halved to match.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of MXFP4's e8m0 scale 2^(e - 127), as ggml's
/// `ggml_e8m0_to_fp32_half` computes it (0 and 1 give subnormals).
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

/// IQ1_S's and IQ1_M's shift of a grid value: + or - this.
pub const IQ1S_DELTA: f32 = 0.125;

/// An i-quant's lattice: `entries` of values, each entry's codes in a u16
/// (`bits` per code, the first value's lowest), `values[code]` the value a
/// code stands for.
pub struct Grid {
    /// Bits per code slot: 2, or 4 (3-bit codes).
    pub bits: u32,
    pub values: &'static [i8],
    pub entries: &'static [u16],
}

impl Grid {
    /// Value `j` of entry `index`.
    pub fn value(&self, index: usize, j: usize) -> f32 {
        let code = (self.entries[index] >> (self.bits as usize * j)) & ((1 << self.bits) - 1);
        self.values[code as usize] as f32
    }

    /// The grid as the kernels read it ([`WeightFormat::grid`]): entries
    /// of 8 values two to a word (the first in the low half), codes as in
    /// `entries`; entries of 4 values one to a word, their values as bytes.
    pub fn words(&self) -> Vec<u32> {
        if self.bits == 2 {
            self.entries.chunks(2).map(|p| p[0] as u32 | (p[1] as u32) << 16).collect()
        } else {
            (0..self.entries.len())
                .map(|i| (0..4).map(|j| (self.value(i, j) as u8 as u32) << (8 * j)).sum())
                .collect()
        }
    }
}

/// The binding of a format's grid ([`WeightFormat::grid`]) in every kernel
/// that reads weights: a storage buffer of [`Grid::words`] (`wgsl/weights.wgsl`'s
/// `GRID`). A grid in the shader itself, a `const` array indexed at run
/// time, is copied at every access (one GEMV of an IQ2_S row ran a hundred
/// times slower on lavapipe); a `private` one is a copy per invocation (an
/// IQ2_XXS GEMV of 1024 x 4096 took 21.2 us on an NVIDIA H100, 12.9 us
/// with the grid bound).
pub const GRID_BINDING: u32 = 16;

impl WeightFormat {
    /// The grid this format's indexes point into, for the i-quants that
    /// have one.
    pub fn grid(self) -> Option<&'static Grid> {
        match self {
            Self::IQ2XXS => Some(&IQ2XXS_GRID),
            Self::IQ2XS => Some(&IQ2XS_GRID),
            Self::IQ2S => Some(&IQ2S_GRID),
            Self::IQ3XXS => Some(&IQ3XXS_GRID),
            Self::IQ3S => Some(&IQ3S_GRID),
            Self::IQ1S | Self::IQ1M => Some(&IQ1S_GRID),
            _ => None,
        }
    }
}

/// The sign bits of IQ2_XXS's, IQ2_XS's and IQ3_XXS's 7-bit sign indexes
/// (ggml's `ksigns_iq2xs`): the eighth makes the count of minus signs even.
pub fn iq_signs(index: u32) -> u32 {
    index | ((index.count_ones() & 1) << 7)
}

/// Sixteen signed bytes as the WGSL `vec4<u32>` `name`, four to a word,
/// the first in the low byte.
fn wgsl_bytes16(name: &str, values: &[i8; 16]) -> String {
    let words: Vec<String> = values
        .chunks(4)
        .map(|c| format!("0x{:08x}u", u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8])))
        .collect();
    format!("const {name} = vec4<u32>({});\n", words.join(", "))
}

/// The formats' tables in WGSL, for the kernels that read
/// weights (`wgsl/weights.wgsl`), each in an `#if` section of the formats
/// that read it: IQ4NL_TABLE and MXFP4_TABLE hold those values as bytes;
/// GRID, the format's grid, is bound at [`GRID_BINDING`]; IQ2_VALUES /
/// IQ1_VALUES hold the values of the 2-bit grids' codes as bytes (of
/// IQ1's, plus one).
/// Written once: every build of a weight-reading family prepends them.
pub fn wgsl_tables() -> &'static str {
    static TABLES: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TABLES.get_or_init(write_wgsl_tables)
}

fn write_wgsl_tables() -> String {
    // IQ2_VALUES serves the three IQ2 grids: their codes stand for the same values.
    debug_assert!(IQ2XS_GRID.values == IQ2XXS_GRID.values && IQ2S_GRID.values == IQ2XXS_GRID.values);
    let grid_values = |g: &Grid, bias: i8| -> u32 {
        g.values.iter().enumerate().map(|(i, &v)| ((v + bias) as u8 as u32) << (8 * i)).sum()
    };
    let sections = [
        ("W_IQ4_NL", wgsl_bytes16("IQ4NL_TABLE", &IQ4NL_VALUES)),
        ("W_IQ4_XS", wgsl_bytes16("IQ4NL_TABLE", &IQ4NL_VALUES)),
        ("W_MXFP4", wgsl_bytes16("MXFP4_TABLE", &MXFP4_VALUES)),
    ];
    let mut out = format!(
        "const IQ2_VALUES: u32 = 0x{:x}u;\nconst IQ1_VALUES: u32 = 0x{:x}u;\n",
        grid_values(&IQ2XXS_GRID, 0),
        grid_values(&IQ1S_GRID, 1)
    );
    for (flag, table) in sections {
        out.push_str(&format!("#if {flag}\n{table}#endif\n"));
    }
    let grid = format!("@group(0) @binding({GRID_BINDING}) var<storage, read> GRID: array<u32>;\n");
    for format in WeightFormat::ALL.into_iter().filter(|f| f.grid().is_some()) {
        out.push_str(&format!("#if {}\n{grid}#endif\n", format.flag().expect("a quantized format")));
    }
    out
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn u16_at(b: &[u8], at: usize) -> u32 {
    u16::from_le_bytes([b[at], b[at + 1]]) as u32
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `y` (4 or 8 values) from entry `index` of `grid`, times `scale`, negated
/// where bit j of `signs` is set.
fn signed_grid(grid: &Grid, index: usize, signs: u32, scale: f32, y: &mut [f32]) {
    for (j, v) in y.iter_mut().enumerate() {
        let value = scale * grid.value(index, j);
        *v = if (signs >> j) & 1 == 1 { -value } else { value };
    }
}

/// The 4-bit scale `n` of the bytes `scales`, two to a byte, low nibble first.
fn nibble(scales: &[u8], n: usize) -> f32 {
    ((scales[n / 2] >> (4 * (n % 2))) & 15) as f32
}

/// The 6-bit scale and min `j` of a Q4_K / Q5_K block's 12 scale bytes.
fn scale_min_k4(s: &[u8], j: usize) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        (((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4)) as f32, ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as f32)
    }
}

/// Decodes one file block `b` into `y`. Every product of a scale and a
/// quant is exact in f32, so the one rounding is the final add, as in the
/// reference.
fn dequantize_block(format: WeightFormat, b: &[u8], y: &mut [f32]) {
    use WeightFormat::*;
    match format {
        Bf16 => y[0] = half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        F16 => y[0] = f16_at(b, 0),
        F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        Q4_0 | Q4_1 => {
            let d = f16_at(b, 0);
            let (m, qs) = if format == Q4_1 { (Some(f16_at(b, 2)), &b[4..20]) } else { (None, &b[2..18]) };
            for (j, &q) in qs.iter().enumerate() {
                for (e, nibble) in [(j, q & 0xf), (j + 16, q >> 4)] {
                    y[e] = match m {
                        Some(m) => d * nibble as f32 + m,
                        None => d * (nibble as f32 - 8.0),
                    };
                }
            }
        }
        Q5_0 | Q5_1 => {
            let d = f16_at(b, 0);
            let (m, rest) = if format == Q5_1 { (Some(f16_at(b, 2)), &b[4..]) } else { (None, &b[2..]) };
            let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let qs = &rest[4..20];
            for (e, v) in y.iter_mut().enumerate() {
                let nibble = if e < 16 { qs[e] & 0xf } else { qs[e - 16] >> 4 } as u32;
                let q = (nibble | (((qh >> e) & 1) << 4)) as f32;
                *v = match m {
                    Some(m) => d * q + m,
                    None => d * (q - 16.0),
                };
            }
        }
        Q8_0 => {
            let d = f16_at(b, 0);
            for (v, &q) in y.iter_mut().zip(&b[2..34]) {
                *v = q as i8 as f32 * d;
            }
        }
        Q2K => {
            let (scales, qs) = (&b[..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (e, v) in y.iter_mut().enumerate() {
                let sc = scales[e / 16];
                let q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
                *v = d * (sc & 0xf) as f32 * q as f32 - dmin * (sc >> 4) as f32;
            }
        }
        Q3K => {
            let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
            let d = f16_at(b, 108);
            for (e, v) in y.iter_mut().enumerate() {
                let i = e / 16;
                let low = (scales[i % 8] >> (4 * (i / 8))) & 0xf;
                let high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
                let sc = (low | (high << 4)) as f32 - 32.0;
                let q = ((qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3) as f32;
                let offset = if (hmask[e % 32] >> (e / 32)) & 1 == 1 { 0.0 } else { 4.0 };
                *v = d * sc * (q - offset);
            }
        }
        Q4K | Q5K => {
            let (d, dmin, scales) = (f16_at(b, 0), f16_at(b, 2), &b[4..16]);
            let (qh, qs) = if format == Q5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for (e, v) in y.iter_mut().enumerate() {
                let (sc, m) = scale_min_k4(scales, e / 32);
                let byte = qs[32 * (e / 64) + e % 32];
                let mut q = if e % 64 < 32 { byte & 0xf } else { byte >> 4 } as f32;
                if let Some(qh) = qh {
                    q += 16.0 * ((qh[e % 32] >> (e / 32)) & 1) as f32;
                }
                *v = d * sc * q - dmin * m;
            }
        }
        Q6K => {
            let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for (e, v) in y.iter_mut().enumerate() {
                let (n, r) = (e / 128, e % 128);
                let byte = ql[64 * n + r % 64];
                let low = if r < 64 { byte & 0xf } else { byte >> 4 };
                let high = (qh[32 * n + r % 32] >> (2 * (r / 32))) & 3;
                let q = (low | (high << 4)) as f32 - 32.0;
                *v = d * scales[e / 16] as i8 as f32 * q;
            }
        }
        IQ4NL => {
            let d = f16_at(b, 0);
            for (j, &q) in b[2..18].iter().enumerate() {
                y[j] = d * IQ4NL_VALUES[(q & 0xf) as usize] as f32;
                y[j + 16] = d * IQ4NL_VALUES[(q >> 4) as usize] as f32;
            }
        }
        IQ4XS => {
            let d = f16_at(b, 0);
            let scales_h = u16::from_le_bytes([b[2], b[3]]);
            let (scales_l, qs) = (&b[4..8], &b[8..136]);
            for (i, (y, qs)) in y.chunks_exact_mut(32).zip(qs.chunks_exact(16)).enumerate() {
                let low = (scales_l[i / 2] >> (4 * (i % 2))) & 0xf;
                let high = ((scales_h >> (2 * i)) & 3) as u8;
                let dl = d * ((low | (high << 4)) as f32 - 32.0);
                for (j, &q) in qs.iter().enumerate() {
                    y[j] = dl * IQ4NL_VALUES[(q & 0xf) as usize] as f32;
                    y[j + 16] = dl * IQ4NL_VALUES[(q >> 4) as usize] as f32;
                }
            }
        }
        IQ2XXS => {
            let d = f16_at(b, 0);
            for (ib, y) in y.chunks_exact_mut(32).enumerate() {
                let (indexes, aux) = (&b[2 + 8 * ib..6 + 8 * ib], u32_at(b, 6 + 8 * ib));
                let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
                for (l, y) in y.chunks_exact_mut(8).enumerate() {
                    let signs = iq_signs((aux >> (7 * l)) & 127);
                    signed_grid(&IQ2XXS_GRID, indexes[l] as usize, signs, db, y);
                }
            }
        }
        IQ2XS => {
            let (d, scales) = (f16_at(b, 0), &b[66..74]);
            for (g, y) in y.chunks_exact_mut(8).enumerate() {
                let q = u16_at(b, 2 + 2 * g);
                let db = d * (0.5 + nibble(scales, g / 2)) * 0.25;
                signed_grid(&IQ2XS_GRID, (q & 511) as usize, iq_signs(q >> 9), db, y);
            }
        }
        IQ2S => {
            let d = f16_at(b, 0);
            let (low, signs, high, scales) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
            for (g, y) in y.chunks_exact_mut(8).enumerate() {
                let index = low[g] as usize | (((high[g / 4] >> (2 * (g % 4))) & 3) as usize) << 8;
                let db = d * (0.5 + nibble(scales, g / 2)) * 0.25;
                signed_grid(&IQ2S_GRID, index, signs[g] as u32, db, y);
            }
        }
        IQ3XXS => {
            let (d, indexes) = (f16_at(b, 0), &b[2..66]);
            for (k, y) in y.chunks_exact_mut(4).enumerate() {
                let aux = u32_at(b, 66 + 4 * (k / 8));
                let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
                let signs = iq_signs((aux >> (7 * ((k % 8) / 2))) & 127) >> (4 * (k % 2));
                signed_grid(&IQ3XXS_GRID, indexes[k] as usize, signs, db, y);
            }
        }
        IQ3S => {
            let d = f16_at(b, 0);
            let (low, high, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
            for (k, y) in y.chunks_exact_mut(4).enumerate() {
                let index = low[k] as usize | (((high[k / 8] >> (k % 8)) & 1) as usize) << 8;
                let db = d * (1.0 + 2.0 * nibble(scales, k / 8));
                signed_grid(&IQ3S_GRID, index, (signs[k / 2] as u32) >> (4 * (k % 2)), db, y);
            }
        }
        IQ1S => {
            let (d, low) = (f16_at(b, 0), &b[2..34]);
            for (g, y) in y.chunks_exact_mut(8).enumerate() {
                let qh = u16_at(b, 34 + 2 * (g / 4));
                let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
                let delta = if qh & 0x8000 != 0 { -IQ1S_DELTA } else { IQ1S_DELTA };
                let index = low[g] as usize | (((qh >> (3 * (g % 4))) & 7) as usize) << 8;
                for (j, v) in y.iter_mut().enumerate() {
                    *v = dl * (IQ1S_GRID.value(index, j) + delta);
                }
            }
        }
        IQ1M => {
            let (low, high) = (&b[..32], &b[32..48]);
            let sc: Vec<u32> = (0..4).map(|i| u16_at(b, 48 + 2 * i)).collect();
            let bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000);
            let d = half::f16::from_bits(bits as u16).to_f32();
            for (g, y) in y.chunks_exact_mut(8).enumerate() {
                let (ib, l) = (g / 4, g % 4);
                let dl = d * (2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3 * (l / 2))) & 7) + 1) as f32;
                let h = (high[g / 2] >> (4 * (g % 2))) & 15;
                let delta = if h & 8 != 0 { -IQ1S_DELTA } else { IQ1S_DELTA };
                let index = low[g] as usize | ((h & 7) as usize) << 8;
                for (j, v) in y.iter_mut().enumerate() {
                    *v = dl * (IQ1S_GRID.value(index, j) + delta);
                }
            }
        }
        MXFP4 => {
            let d = e8m0_half(b[0]);
            for (j, &q) in b[1..17].iter().enumerate() {
                y[j] = d * MXFP4_VALUES[(q & 0xf) as usize] as f32;
                y[j + 16] = d * MXFP4_VALUES[(q >> 4) as usize] as f32;
            }
        }
        F8E4M3 => {
            let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            for (v, &q) in y.iter_mut().zip(&b[4..]) {
                *v = scale * f8_e4m3_to_f32(q);
            }
        }
    }
}
