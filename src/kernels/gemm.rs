//! `wgsl/gemm.wgsl`: weights x f32 activations for a chunk of tokens, dense
//! or over the tokens grouped under each expert; on cooperative
//! matrices (`wgsl/gemm_coop.wgsl`, same parameters and bindings) where the
//! device was opened with them.

use super::bias_act::Activation;
use super::gemm_coop;
use crate::error::Result;
use crate::format::WeightFormat;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer, TensorPart, in_order};

crate::wgsl_struct! {
    pub struct GemmParams {
        rows: u32,
        cols: u32,
        first_row: u32,
        expert_rows: u32,
        expert: u32,
        x_div: u32,
        y_stride: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![GemmParams::WGSL]
}

/// Tile shapes (tokens x weight rows per workgroup) the GEMM is built in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tiling {
    /// 64 x 64: many workgroups, for narrow matrices and expert groups.
    Narrow,
    /// 128 x 128: twice the work per load, for wide matrices.
    Wide,
    /// Wide where that still gives at least [`WIDE_MIN_WORKGROUPS`]
    /// workgroups for a full chunk, else narrow.
    Auto,
}

/// Fewest 128 x 128 tiles for which the wide tiling beats the narrow one
/// (below it a large GPU runs short of workgroups).
pub const WIDE_MIN_WORKGROUPS: usize = 128;

/// A chunk's activations in f16 beside their f32 rows (packed the same,
/// two bytes a value), where the flow keeps them for the products on
/// cooperative matrices that round their operands to f16: such a product
/// reads `x` instead of its f32 input where its tile reads f16 copies well
/// ([`gemm_coop::Tile::reads_f16`]), and a SwiGLU product writes `y` beside
/// its f32 outputs.
#[derive(Debug, Clone, Copy, Default)]
pub struct HalfCopies<'a> {
    pub x: Option<&'a wgpu::Buffer>,
    pub y: Option<&'a wgpu::Buffer>,
}

/// The buffers of a grouped (MoE prefill) product.
pub struct GroupedBuffers<'a> {
    pub x: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    /// u32 `[experts, 2]`: offset and count of each expert's pairs.
    pub groups: &'a wgpu::Buffer,
    /// u32 pair indices `token * top_k + slot`, grouped by expert.
    pub pairs: &'a wgpu::Buffer,
}

/// A product's extent: `rows` weight rows for `tokens` tokens (at most,
/// or on average per expert), for `experts` experts side by side (0: a
/// dense product), over `k_splits` ranges of k (dense; 1: all of k).
struct Shape {
    rows: usize,
    tokens: usize,
    experts: usize,
    k_splits: usize,
}

impl Shape {
    /// The rows tiles are chosen for (the whole product: all experts'
    /// rows) and the most tokens.
    fn whole(&self) -> (usize, usize) {
        (self.rows * self.experts.max(1), self.tokens)
    }

    /// Row tiles along x (each range of k's in turn, folded into z when
    /// dense), experts along z.
    fn grid(&self, gpu: &Gpu, name: &str, tile_rows: u32) -> Result<[u32; 3]> {
        let tiles = (self.rows as u32).div_ceil(tile_rows);
        if self.experts == 0 {
            return Ok(gpu.fold_grid(tiles * self.k_splits as u32));
        }
        let max = gpu.caps.max_workgroups_per_dim as usize;
        if tiles as usize > max || self.experts > max {
            return Err(crate::Error::Unsupported {
                what: "expert GEMM grid (row tiles of one expert, experts)",
                value: format!("{name}: {} experts of {} rows", self.experts, self.rows),
            });
        }
        Ok([tiles, 1, self.experts as u32])
    }
}

/// A product's width suits its format, and a SwiGLU's rows are whole
/// gate/up pairs.
fn check_product(weight: &GpuTensor, part: &TensorPart, epilogue: Epilogue, shape: &Shape) -> Result<()> {
    if part.format != WeightFormat::Bf16 && !weight.cols.is_multiple_of(4) {
        return Err(crate::Error::Unsupported {
            what: "GEMM width (a multiple of 4 in formats other than bf16)",
            value: format!("{}: {} columns of {}", weight.name, weight.cols, part.format),
        });
    }
    // Pairs never straddle parts (GpuTensor keeps them together).
    if epilogue == Epilogue::Swiglu && !(shape.rows.is_multiple_of(2) && part.first_row.is_multiple_of(2)) {
        return Err(crate::Error::Unsupported {
            what: "SwiGLU GEMM rows (gate/up pairs)",
            value: format!("{}: {} rows of a part from row {}", weight.name, shape.rows, part.first_row),
        });
    }
    Ok(())
}

/// Whether the cooperative-matrix kernel takes a part of `cols` columns:
/// its format and width suit it ([`gemm_coop::takes`]), and f16 holds its
/// values (the f32 kernel runs the others).
fn on_matrix_units(part: &TensorPart, cols: usize) -> bool {
    gemm_coop::takes(part.format, cols) && !part.beyond_f16
}

/// A product's pipeline, its tile (tokens and rows), the f16 copy of the
/// activations it reads instead of their f32 rows, and the bindings after
/// the common ones.
struct Build<'b> {
    pipeline: wgpu::ComputePipeline,
    tile_tokens: u32,
    tile_rows: u32,
    x16: Option<&'b wgpu::Buffer>,
    extra: Vec<&'b wgpu::Buffer>,
}

impl<'b> Build<'b> {
    /// `gemm.wgsl` in square tiles: 128 wide where a full chunk still
    /// gives [`WIDE_MIN_WORKGROUPS`] of them (`Tiling::Auto`).
    fn alu(
        gpu: &Gpu,
        format: WeightFormat,
        (epilogue, extra_flags): (Epilogue, &[&'static str]),
        tiling: Tiling,
        shape: &Shape,
    ) -> Result<Self> {
        let (n_rows, max_tokens) = shape.whole();
        let wide = match tiling {
            Tiling::Narrow => false,
            Tiling::Wide => true,
            Tiling::Auto => n_rows.div_ceil(128) * max_tokens.div_ceil(128) >= WIDE_MIN_WORKGROUPS,
        };
        let tile = if wide { 128 } else { 64 };
        let mut flags = super::weight_flags(gpu, format);
        if epilogue == Epilogue::Swiglu {
            flags.push(SWIGLU);
        }
        flags.extend(extra_flags);
        let constants = [("TILE_M", tile as f64), ("TILE_N", tile as f64)];
        let pipeline = super::pipeline(gpu, "gemm", "main", &flags, &constants)?;
        Ok(Build { pipeline, tile_tokens: tile, tile_rows: tile, x16: None, extra: vec![] })
    }

    /// `gemm_coop.wgsl` in `tile` where given and the build fits it, else
    /// in the tile it reads f16 copies in (where `half` has them and the
    /// product suits it), else in the tile [`gemm_coop::Tile::choose`]
    /// picks; split over k where `shape` is.
    fn cooperative(
        gpu: &Gpu,
        (weight, part): (&GpuTensor, &TensorPart),
        (epilogue, extra_flags): (Epilogue, &[&'static str]),
        (split, tile): (bool, Option<gemm_coop::Tile>),
        shape: &Shape,
        half: HalfCopies<'b>,
    ) -> Result<Self> {
        let (n_rows, max_tokens) = shape.whole();
        let mut flags = gemm_coop::flags(gpu, part.format, split);
        if epilogue == Epilogue::Swiglu {
            flags.push(SWIGLU);
        }
        flags.extend(extra_flags);
        // A dense product over few tokens runs in its own tile (which
        // reads the f32 rows: its staging takes two rounds).
        let few = (shape.experts == 0 && max_tokens <= gemm_coop::FEW_TOKENS)
            .then(|| gemm_coop::Tile::few_tokens(n_rows, weight.cols, max_tokens, &flags, shape.k_splits))
            .flatten()
            .map(|(tile, _)| tile);
        let copy_tile = match (few, shape.k_splits) {
            (Some(_), _) => None,
            (None, 1) => {
                gemm_coop::Tile::reads_f16(n_rows, weight.cols, max_tokens, &flags, gpu.caps.multiprocessors)
            }
            // Gemm::summed_splits found the product suits the tile.
            (None, _) => Some(gemm_coop::Tile::COPIES),
        };
        let half_tile = half.x.filter(|_| tile.is_none()).zip(copy_tile);
        let mut extra = vec![];
        if let Some(y16) = half.y {
            flags.push(gemm_coop::Y_F16);
            extra.push(y16);
        }
        let (tile, x16) = match half_tile {
            Some((x16, tile)) => {
                flags.push(gemm_coop::X_F16);
                (tile, Some(x16))
            }
            None => {
                let fitting = tile.filter(|t| t.fits(&flags)).or(few);
                (fitting.unwrap_or_else(|| gemm_coop::Tile::choose(n_rows, max_tokens, &flags)), None)
            }
        };
        let mut constants = tile.constants(&flags).to_vec();
        if shape.k_splits > 1 {
            flags.push(gemm_coop::K_SPLIT);
            constants.push(("K_SPLITS", shape.k_splits as f64));
        }
        let pipeline = super::pipeline(gpu, "gemm_coop", "main", &flags, &constants)?;
        Ok(Build { pipeline, tile_tokens: tile.tokens, tile_rows: tile.rows, x16, extra })
    }
}

/// What becomes of a product's outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// `y = W x`.
    Plain,
    /// W's rows are gate and up interleaved (row 2o gate, 2o + 1 up):
    /// `y[o] = silu(W[2o] x) * (W[2o + 1] x)`, half as many outputs as rows.
    Swiglu,
}

/// The flag of builds with [`Epilogue::Swiglu`].
pub const SWIGLU: &str = "SWIGLU";

/// The flag of builds that add a bias to each output and then activate it
/// ([`Gemm::plan_biased`]).
pub const BIAS: &str = "BIAS";
/// With [`BIAS`]: the biased outputs are added to what the output rows hold.
pub const BIAS_ADD: &str = "BIAS_ADD";

/// A linear layer's bias (one f32 per weight row) and what follows it,
/// which a plain dense product applies as it writes its outputs.
#[derive(Debug, Clone, Copy)]
pub struct Bias<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub then: AfterBias,
}

/// What becomes of a biased output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterBias {
    /// `y = activation(W x + b)`.
    Activate(Activation),
    /// `y += W x + b`: a residual add.
    AddTo,
}

impl Bias<'_> {
    fn flags(then: AfterBias) -> Vec<&'static str> {
        match then {
            AfterBias::Activate(activation) => [&[BIAS], activation.flags()].concat(),
            AfterBias::AddTo => vec![BIAS, BIAS_ADD],
        }
    }
}

/// Every flag set of `gemm.wgsl` builds.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    with_epilogues(super::weight_flag_sets())
}

/// Each of `sets` plain, with [`SWIGLU`], and with [`BIAS`] (and an
/// activation, or [`BIAS_ADD`]).
#[cfg(feature = "internals")]
pub(crate) fn with_epilogues(sets: Vec<Vec<&'static str>>) -> Vec<Vec<&'static str>> {
    let (activated, added) =
        (Bias::flags(AfterBias::Activate(Activation::GeluErf)), Bias::flags(AfterBias::AddTo));
    sets.into_iter()
        .flat_map(|flags| {
            [
                flags.clone(),
                [flags.clone(), vec![SWIGLU]].concat(),
                [flags.clone(), activated.clone()].concat(),
                [flags, added.clone()].concat(),
            ]
        })
        .collect()
}

/// The kernel that computes the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKernel {
    /// `gemm.wgsl`, on the f32 ALUs.
    Alu(Tiling),
    /// `gemm_coop.wgsl`, f16 products into f32; with `split`, each
    /// activation (and each decoded weight of the formats f16 does not
    /// hold) as two f16 parts; in `tile` where given (if the build fits
    /// it), else in the tile [`gemm_coop::Tile::choose`] picks.
    Cooperative { split: bool, tile: Option<gemm_coop::Tile> },
}

impl GemmKernel {
    /// Relative rounding of each activation (and each decoded weight of the
    /// quantized formats) before it is multiplied: none on the ALUs (f32),
    /// 2^-22 as two f16 parts, 2^-11 as one f16.
    pub fn activation_rounding(self) -> f32 {
        match self {
            GemmKernel::Alu(_) => 0.0,
            GemmKernel::Cooperative { split: true, .. } => 2f32.powi(-22),
            GemmKernel::Cooperative { split: false, .. } => 2f32.powi(-11),
        }
    }
}

/// How the cooperative-matrix GEMM rounds a prompt chunk's activations
/// (and the decoded weights of the formats f16 does not hold) before it
/// multiplies them; the f32 GEMM of devices without cooperative matrices
/// rounds nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillPrecision {
    /// One f16 each: 11 significant bits.
    #[default]
    F16,
    /// Two f16 parts each, high and low: 22 significant bits, at twice the
    /// matrix work.
    Split,
}

impl std::str::FromStr for PrefillPrecision {
    type Err = crate::Error;
    fn from_str(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "f16" => Ok(PrefillPrecision::F16),
            "split" => Ok(PrefillPrecision::Split),
            _ => Err(crate::Error::Unsupported {
                what: "prefill precision",
                value: format!("{name:?} (f16 or split)"),
            }),
        }
    }
}

#[derive(Debug)]
pub struct Gemm {
    kernel: GemmKernel,
    /// Bound as `groups` and `pairs` by dense products, which never read them.
    no_groups: wgpu::Buffer,
}

impl Gemm {
    /// On cooperative matrices in `precision` where the device has them,
    /// else on the ALUs.
    pub fn new(gpu: &Gpu, precision: PrefillPrecision) -> Result<Self> {
        let kernel = if gpu.caps.cooperative_matrix {
            GemmKernel::Cooperative { split: precision == PrefillPrecision::Split, tile: None }
        } else {
            GemmKernel::Alu(Tiling::Auto)
        };
        Self::with_kernel(gpu, kernel)
    }

    /// As [`Self::new`] with one kernel forced (tests and benches compare
    /// them); cooperative matrices need a device opened with them.
    pub fn with_kernel(gpu: &Gpu, kernel: GemmKernel) -> Result<Self> {
        if matches!(kernel, GemmKernel::Cooperative { .. }) && !gpu.caps.cooperative_matrix {
            return Err(crate::Error::Unsupported {
                what: "cooperative-matrix GEMM",
                value: format!("{} was opened without cooperative matrices", gpu.info.name),
            });
        }
        Ok(Gemm { kernel, no_groups: gpu.storage_buffer("gemm.no_groups", 2)? })
    }

    /// Every kernel `gpu` can run, in every tiling and precision.
    pub fn kernels(gpu: &Gpu) -> Vec<GemmKernel> {
        let mut out = vec![GemmKernel::Alu(Tiling::Narrow), GemmKernel::Alu(Tiling::Wide)];
        if gpu.caps.cooperative_matrix {
            for split in [false, true] {
                out.push(GemmKernel::Cooperative { split, tile: None });
                let tiles = gemm_coop::Tile::ALL.map(Some);
                out.extend(tiles.into_iter().map(|tile| GemmKernel::Cooperative { split, tile }));
            }
        }
        out
    }

    pub fn kernel(&self) -> GemmKernel {
        self.kernel
    }

    /// Whether products read and write [`HalfCopies`]: on cooperative
    /// matrices in f16.
    pub fn keeps_half_copies(&self) -> bool {
        matches!(self.kernel, GemmKernel::Cooperative { split: false, .. })
    }

    /// Whether `weight`'s products read and write [`HalfCopies`]: they keep
    /// them, and take its format and width.
    pub fn takes_half_copies(&self, weight: &GpuTensor) -> bool {
        self.keeps_half_copies() && weight.parts.iter().all(|p| on_matrix_units(p, weight.cols))
    }

    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        gpu: &Gpu,
        (weight, part): (&GpuTensor, &TensorPart),
        epilogue: Epilogue,
        params: GemmParams,
        shape: Shape,
        b: [&wgpu::Buffer; 5],
        (half, bias): (HalfCopies<'_>, Option<Bias<'_>>),
    ) -> Result<Dispatch> {
        check_product(weight, part, epilogue, &shape)?;
        if bias.is_some() && (epilogue != Epilogue::Plain || shape.experts > 0 || shape.k_splits > 1) {
            return Err(crate::Error::Unsupported {
                what: "a bias in a GEMM other than a plain dense product over all of k",
                value: format!("{}: {epilogue:?}, {} ranges of k", weight.name, shape.k_splits),
            });
        }
        let extra_flags = bias.map_or_else(Vec::new, |b| Bias::flags(b.then));
        let kernel = match self.kernel {
            GemmKernel::Cooperative { .. } if !on_matrix_units(part, weight.cols) => {
                GemmKernel::Alu(Tiling::Auto)
            }
            kernel => kernel,
        };
        if half.y.is_some() && !(epilogue == Epilogue::Swiglu && self.takes_half_copies(weight)) {
            return Err(crate::Error::Unsupported {
                what: "f16 copy of a GEMM's outputs (SwiGLU products on cooperative matrices in f16)",
                value: format!("{}: {epilogue:?} on {kernel:?}", weight.name),
            });
        }
        let [step, x, y, groups, pairs] = b;
        let build = match kernel {
            GemmKernel::Alu(tiling) => {
                Build::alu(gpu, part.format, (epilogue, &extra_flags), tiling, &shape)?
            }
            GemmKernel::Cooperative { split, tile } => Build::cooperative(
                gpu,
                (weight, part),
                (epilogue, &extra_flags),
                (split, tile),
                &shape,
                half,
            )?,
        };
        let params = ParamsBuffer::new(gpu, "gemm.params", &params);
        let x = build.x16.unwrap_or(x);
        // The bias takes the binding after the common ones (which an f16
        // copy of SwiGLU outputs takes in the builds without a bias).
        let bias = bias.map(|b| b.buffer);
        let buffers =
            [[&params.0, step, &part.buffer, x, y, groups, pairs].as_slice(), &build.extra, bias.as_slice()]
                .concat();
        Ok(Dispatch {
            label: "gemm",
            bind_group: super::bind_reading(gpu, "gemm", &build.pipeline, part.format, &in_order(&buffers)),
            pipeline: build.pipeline,
            workgroups: shape.grid(gpu, &weight.name, build.tile_rows)?,
            tokens_per_workgroup: build.tile_tokens,
        })
    }

    /// `y[t] = W x[t]` for the `step.n_tokens` tokens in flight (at most
    /// `max_tokens`), x packed `[tokens, W.cols]`, y packed `[tokens, W.rows]`
    /// (or `W.rows / 2` with [`Epilogue::Swiglu`]).
    #[allow(clippy::too_many_arguments)]
    pub fn plan(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        epilogue: Epilogue,
        max_tokens: usize,
        step: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<Vec<Dispatch>> {
        self.plan_apart(gpu, weight, epilogue, max_tokens, step, x, (y, None), HalfCopies::default())
    }

    /// [`Self::plan`], with `apart = Some((from_row, tail))` the rows from
    /// `from_row` (where a part starts) on written to `tail` instead, packed
    /// `[tokens, W.rows - from_row]` (as the GEMV's `Rows::DenseApart`), and
    /// the activations' f16 copies read or written where `half` has them.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_apart(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        epilogue: Epilogue,
        max_tokens: usize,
        step: &wgpu::Buffer,
        x: &wgpu::Buffer,
        (y, apart): (&wgpu::Buffer, Option<(usize, &wgpu::Buffer)>),
        half: HalfCopies<'_>,
    ) -> Result<Vec<Dispatch>> {
        self.plan_dense(gpu, weight, epilogue, (max_tokens, 1), step, x, (y, apart), half)
    }

    /// [`Self::plan_apart`] over `k_splits` ranges of k (see
    /// [`Self::plan_summed`]; 1: the whole product).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_dense(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        epilogue: Epilogue,
        (max_tokens, k_splits): (usize, usize),
        step: &wgpu::Buffer,
        x: &wgpu::Buffer,
        (y, apart): (&wgpu::Buffer, Option<(usize, &wgpu::Buffer)>),
        half: HalfCopies<'_>,
    ) -> Result<Vec<Dispatch>> {
        let extent = (max_tokens, k_splits);
        self.plan_parts(gpu, weight, epilogue, extent, step, x, (y, apart), (half, None))
    }

    /// `y[t] = activation(W x[t] + bias)`, or `y[t] += W x[t] + bias`
    /// ([`AfterBias`]), as [`Self::plan`] writes `W x[t]` (its rows reading
    /// f16 copies of `x` where `x16` holds them and the tile reads them): a
    /// linear layer with a bias, and its activation or residual add.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_biased(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        bias: Bias<'_>,
        max_tokens: usize,
        step: &wgpu::Buffer,
        (x, x16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        y: &wgpu::Buffer,
    ) -> Result<Vec<Dispatch>> {
        let needed = 4 * weight.rows as u64;
        if bias.buffer.size() < needed {
            return Err(crate::Error::Unsupported {
                what: "a GEMM bias shorter than the weight's rows",
                value: format!("{}: {} bytes for {} rows", weight.name, bias.buffer.size(), weight.rows),
            });
        }
        let half = HalfCopies { x: x16, y: None };
        self.plan_parts(gpu, weight, Epilogue::Plain, (max_tokens, 1), step, x, (y, None), (half, Some(bias)))
    }

    /// [`Self::plan_dense`], adding `bias` where given.
    #[allow(clippy::too_many_arguments)]
    fn plan_parts(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        epilogue: Epilogue,
        (max_tokens, k_splits): (usize, usize),
        step: &wgpu::Buffer,
        x: &wgpu::Buffer,
        (y, apart): (&wgpu::Buffer, Option<(usize, &wgpu::Buffer)>),
        (half, bias): (HalfCopies<'_>, Option<Bias<'_>>),
    ) -> Result<Vec<Dispatch>> {
        if half.y.is_some() && apart.is_some() {
            return Err(crate::Error::Unsupported {
                what: "f16 copy of a GEMM's outputs written apart",
                value: weight.name.clone(),
            });
        }
        let outputs = |rows: usize| match epilogue {
            Epilogue::Plain => rows,
            Epilogue::Swiglu => rows / 2,
        };
        weight
            .parts
            .iter()
            .map(|part| {
                let (y, first_row) = match apart {
                    Some((from_row, tail)) if part.first_row >= from_row => (tail, from_row),
                    Some((from_row, _)) => {
                        let name = &weight.name;
                        assert!(
                            part.first_row + part.rows <= from_row,
                            "{name}: a part straddles row {from_row}"
                        );
                        (y, 0)
                    }
                    None => (y, 0),
                };
                let params = GemmParams {
                    rows: part.rows as u32,
                    cols: weight.cols as u32,
                    // Dense: only the output's column moves with it.
                    first_row: (part.first_row - first_row) as u32,
                    expert_rows: 0,
                    expert: 0,
                    x_div: 1,
                    y_stride: outputs(weight.rows - first_row) as u32,
                };
                let g = &self.no_groups;
                let shape = Shape { rows: part.rows, tokens: max_tokens, experts: 0, k_splits };
                self.dispatch(gpu, (weight, part), epilogue, params, shape, [step, x, y, g, g], (half, bias))
            })
            .collect()
    }

    /// The ranges of k [`Self::plan_summed`] splits `weight`'s product over
    /// `max_tokens` tokens into (over few tokens see
    /// [`gemm_coop::Tile::few_tokens`], in the tiles of its first part's
    /// format, for its smallest part: the parts run one after another, each
    /// in these ranges, so each must fill the GPU; else, reading f16
    /// copies, [`gemm_coop::Tile::k_splits`]): 1 for a product that does
    /// not split, or a tensor of several parts over more tokens.
    pub fn summed_splits(&self, gpu: &Gpu, weight: &GpuTensor, max_tokens: usize) -> usize {
        let GemmKernel::Cooperative { split: false, tile: None } = self.kernel else { return 1 };
        if !weight.parts.iter().all(|p| on_matrix_units(p, weight.cols)) {
            return 1;
        }
        let flags = gemm_coop::flags(gpu, weight.parts[0].format, false);
        if max_tokens <= gemm_coop::FEW_TOKENS {
            let max = gemm_coop::MAX_FEW_TOKEN_K_SPLITS;
            let rows = weight.parts.iter().map(|p| p.rows).min().unwrap_or(weight.rows);
            return gemm_coop::Tile::few_tokens(rows, weight.cols, max_tokens, &flags, max)
                .map_or(1, |f| f.1);
        }
        if weight.parts.len() > 1 || !self.takes_half_copies(weight) {
            return 1;
        }
        gemm_coop::Tile::k_splits(weight.rows, weight.cols, max_tokens, &flags)
    }

    /// `y = W x` as [`Self::plan`] (reading `x16`, the f16 copy of `x`,
    /// where given and the tile reads it) for a consumer that sums partial
    /// products: y packed `[tokens, splits, W.rows]`, the product over
    /// consecutive ranges of k, [`Self::summed_splits`] of them (returned
    /// beside the dispatches; 1: y is the whole product).
    pub fn plan_summed(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        max_tokens: usize,
        step: &wgpu::Buffer,
        (x, x16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        y: &wgpu::Buffer,
    ) -> Result<(Vec<Dispatch>, usize)> {
        let few = max_tokens <= gemm_coop::FEW_TOKENS;
        let splits = if x16.is_some() || few { self.summed_splits(gpu, weight, max_tokens) } else { 1 };
        let half = HalfCopies { x: x16, y: None };
        let d =
            self.plan_dense(gpu, weight, Epilogue::Plain, (max_tokens, splits), step, x, (y, None), half)?;
        Ok((d, splits))
    }

    /// For the experts `experts` of a stacked `weight` (`expert_rows` rows
    /// each), all in one dispatch per part holding any of their rows:
    /// `y[idx] = W_e x[idx / x_div]` for every pair index `idx` grouped under
    /// expert `e` (rows of `expert_rows`, or half that with
    /// [`Epilogue::Swiglu`]). Encoded for the chunk's tokens, the most any
    /// expert can have; `tokens_per_expert`, what an expert has on average,
    /// sizes the tiles.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_experts(
        &self,
        gpu: &Gpu,
        weight: &GpuTensor,
        epilogue: Epilogue,
        experts: std::ops::Range<usize>,
        expert_rows: usize,
        x_div: usize,
        tokens_per_expert: usize,
        step: &wgpu::Buffer,
        b: GroupedBuffers<'_>,
    ) -> Result<Vec<Dispatch>> {
        let rows = experts.start * expert_rows..experts.end * expert_rows;
        weight
            .parts_overlapping(rows)
            .map(|i| {
                let part = &weight.parts[i];
                let first = experts.start.max(part.first_row / expert_rows);
                let end = experts.end.min((part.first_row + part.rows).div_ceil(expert_rows));
                let params = GemmParams {
                    rows: part.rows as u32,
                    cols: weight.cols as u32,
                    first_row: part.first_row as u32,
                    expert_rows: expert_rows as u32,
                    expert: first as u32,
                    x_div: x_div as u32,
                    y_stride: match epilogue {
                        Epilogue::Plain => expert_rows as u32,
                        Epilogue::Swiglu => (expert_rows / 2) as u32,
                    },
                };
                let shape =
                    Shape { rows: expert_rows, tokens: tokens_per_expert, experts: end - first, k_splits: 1 };
                let b = [step, b.x, b.y, b.groups, b.pairs];
                self.dispatch(gpu, (weight, part), epilogue, params, shape, b, (HalfCopies::default(), None))
            })
            .collect()
    }
}
