//! `wgsl/gemv.wgsl`: weight (bf16, or any format of `wgsl/weights.wgsl`)
//! x f32 vector, one dispatch per weight part, with the RMSNorm before
//! it, the residual add (and the layer's
//! steering and capture) or the SwiGLU gate after it, and expert selection
//! by the GPU's routing fused in as build flags.

use crate::error::Result;
use crate::format::WeightFormat;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer, TensorPart};
use crate::kernels::residual::LayerOutput;

crate::wgsl_struct! {
    pub struct GemvParams {
        /// Weight rows in this part, and the global index of its first.
        rows: u32,
        cols: u32,
        first_row: u32,
        /// Outputs per token (per token and slot with SLOTS).
        outputs: u32,
        /// Where output 0 of this dispatch goes in a row of y.
        out_offset: u32,
        y_stride: u32,
        top_k: u32,
        /// Rows of one expert in the stacked weight.
        expert_rows: u32,
        eps: f32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![GemvParams::WGSL]
}

/// An expert id that [`Rows::Slots`] and [`Rows::Sum`] skip (the expert
/// is not on the GPU in this pass; `wgsl/gemv.wgsl` has the same value).
pub const EXPERT_ELSEWHERE: u32 = 0xffff_fffe;

/// How rows are spread over a workgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvShape {
    /// Groups of `threads_per_row` lanes per workgroup, each computing a
    /// pair of rows (two outputs, or a SwiGLU's gate and up; bf16 rows
    /// outside a SwiGLU: one row).
    pub rows_per_workgroup: u32,
    /// Must be a power of two; 1 means one output per invocation.
    pub threads_per_row: u32,
    /// 8-weight loads (or units) a lane issues together.
    pub unroll: u32,
    /// `unroll` of the products that read the norm's weight beside x
    /// (SwiGLU's excepted): with twice the loads of activations per
    /// weight they need more weights in flight: 4 rather than 2 runs them
    /// nearer the copy rate, the gate/up with its SwiGLU alike with either.
    pub norm_unroll: u32,
    /// `unroll` of a byte-activation sum over slots (a MoE layer's down
    /// projections), whose lanes walk all the slots' units at once: in
    /// `kernel_throughput -- experts` (Qwen3-30B-A3B's 8 slots of 768) 1
    /// and 2 run alike and 8 slower; GPUs take 4.
    pub sum_unroll: u32,
    /// Whether rows in the 256-element block formats are read by units
    /// (`unit_dots` in `weights.wgsl`) rather than four weights at a time.
    pub units: bool,
    /// Whether rows in the formats whose quants fit a signed byte meet the
    /// activations on the integer dot units, the activations quantized in
    /// workgroup memory to three bytes each: see [`INT8_ROUNDING`].
    pub int8: bool,
    /// `rows_per_workgroup` of those builds: each workgroup stages the
    /// activations once for all its rows, so more rows amortise it.
    pub int8_rows_per_workgroup: u32,
    /// Most workgroups of those builds (0: one per block of rows): each
    /// then takes blocks in turn, and stages activations that fit one
    /// chunk (see [`x_chunk`]) once for all of them.
    pub int8_workgroups: u32,
    /// Products of f32-activation builds with fewer groups' worth of
    /// outputs than this run one group per workgroup (0: never): a
    /// router's few rows then spread over many multiprocessors.
    pub spread_below: u32,
}

/// Invocations per workgroup of the byte-activation builds on GPUs.
const INT8_WORKGROUP: u32 = 512;

/// Elements of x a byte-activation build stages at a time, unless its
/// rows are longer than two such chunks, or a slot sum's longer than one
/// (see [`x_chunk`]).
const X_CHUNK: usize = 4096;

/// Workgroup memory of the byte-activation staging by subgroup shuffles
/// per 8 elements of the chunk: their three bytes each, an eighth of their
/// block's scale and half their run's sum.
const STAGED_BYTES_PER_8: usize = 3 * 8 + 1 + 2;

/// Workgroup memory of that staging beside the chunk: the workgroup's sum
/// of squares and its subgroups' partials (`wgsl/workgroup_sum.wgsl`).
const STAGING_FIXED_BYTES: usize = 4 + 4 * 128;

/// The elements of x a byte-activation GEMV stages at a time (`X_CHUNK` of
/// `wgsl/gemv.wgsl`) for `rows` of `cols` columns (a slot sum: all its
/// slots' columns): 4096, or, with the staging by `subgroups`, for rows
/// of more than two such chunks (the down projections), as much
/// of the row as the adapter's workgroup memory holds, in multiples of 256
/// (14336 in 48 KiB). Rows of two chunks come with many-row products (the
/// gate/up of models 5120-8192 wide), for which more workgroup memory means
/// fewer workgroups in flight (an 8192-element chunk slows the 8B shape's
/// gate/up), so they stay in chunks of 4096.
/// A slot sum (a MoE layer's down projections) has the model's width in
/// rows, a workgroup or less per multiprocessor, and takes chunks as long
/// as workgroup memory holds once its slots pass one chunk of 4096.
pub fn x_chunk(gpu: &Gpu, subgroups: bool, cols: usize, rows: &Rows<'_>) -> usize {
    let (staged, long) = match rows {
        Rows::Sum { top_k, .. } => (top_k * cols, X_CHUNK),
        _ => (cols, 2 * X_CHUNK),
    };
    if !subgroups || staged <= long {
        return X_CHUNK;
    }
    let memory = gpu.limits.max_compute_workgroup_storage_size as usize;
    let fits = memory.saturating_sub(STAGING_FIXED_BYTES) * 8 / STAGED_BYTES_PER_8 / 256 * 256;
    fits.clamp(X_CHUNK, staged.next_multiple_of(256))
}

/// Lanes of one block of 32 activations in the byte-activation staging
/// by subgroup shuffles (a quad each).
const STAGING_LANES: u32 = 8;

/// Workgroups of the byte-activation builds per multiprocessor, where the
/// GPU reports how many it has (four of 512 invocations fill an NVIDIA
/// multiprocessor's 2048).
const INT8_WORKGROUPS_PER_MULTIPROCESSOR: u32 = 4;

/// Workgroups of the byte-activation builds on GPUs that do not report
/// their multiprocessors: four for each of a large GPU's (an NVIDIA H200's
/// 132).
const INT8_WORKGROUPS: u32 = 528;

/// [`GemvShape::spread_below`] on GPUs: a 128 x 2048 router runs faster
/// in workgroups of one group (64 of them in f32, 128 in bf16) than in
/// workgroups of eight.
const SPREAD_BELOW: u32 = 256;

/// The largest error of an activation quantized for [`GemvShape::int8`],
/// relative to the largest magnitude in its block of 32: two steps of
/// 1 / (63 * 2^16) (half a step of rounding, and the f32 roundings of the
/// value in steps and back).
#[cfg(feature = "internals")]
pub const INT8_ROUNDING: f32 = 2.0 / (63.0 * 65536.0);

impl GemvShape {
    /// 64 outputs per workgroup, one per invocation (no barriers).
    pub const ONE_PER_INVOCATION: GemvShape = GemvShape {
        rows_per_workgroup: 64,
        threads_per_row: 1,
        unroll: 1,
        norm_unroll: 1,
        sum_unroll: 1,
        units: true,
        int8: true,
        int8_rows_per_workgroup: 64,
        int8_workgroups: 0,
        spread_below: 0,
    };

    /// CPU rasterisers do best with one output per invocation (no
    /// barriers); GPUs with a subgroup (or else a workgroup) reduction per
    /// output, whose lanes read consecutive weights.
    pub fn for_gpu(gpu: &Gpu) -> Self {
        if gpu.caps.is_cpu {
            Self::ONE_PER_INVOCATION
        } else {
            Self::lanes(gpu, super::subgroup_width(gpu).unwrap_or(32))
        }
    }

    /// The GPU shape with `lanes` invocations per group of rows.
    pub fn lanes(gpu: &Gpu, lanes: u32) -> Self {
        GemvShape {
            rows_per_workgroup: (256 / lanes).max(1),
            threads_per_row: lanes,
            unroll: 2,
            norm_unroll: 4,
            sum_unroll: 4,
            units: true,
            int8: true,
            int8_rows_per_workgroup: (INT8_WORKGROUP.min(gpu.limits.max_compute_invocations_per_workgroup)
                / lanes)
                .max(1),
            int8_workgroups: gpu
                .caps
                .multiprocessors
                .map_or(INT8_WORKGROUPS, |n| n * INT8_WORKGROUPS_PER_MULTIPROCESSOR),
            spread_below: SPREAD_BELOW,
        }
    }

    /// The loads a lane issues together for `spec` (`int8`: in the
    /// byte-activation build).
    pub fn unroll_for(&self, spec: &GemvSpec<'_>, int8: bool) -> u32 {
        let norm = matches!(spec.input, Input::RmsNorm { .. });
        let swiglu = matches!(spec.output, Output::Swiglu);
        if int8 && matches!(spec.rows, Rows::Sum { .. }) {
            self.sum_unroll
        } else if norm && !swiglu && !int8 {
            self.norm_unroll
        } else {
            self.unroll
        }
    }

    /// The GPU shape on the adapter's subgroups, where they have one width
    /// (the builds that reduce with subgroup operations), CPU rasterisers
    /// included.
    #[cfg(feature = "internals")]
    pub fn on_subgroups(gpu: &Gpu) -> Option<Self> {
        super::subgroup_width(gpu).map(|w| Self::lanes(gpu, w))
    }
}

/// What the product reads: `x` as it is, or its RMSNorm.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    Plain,
    /// `x` normalised per token (`w * x * rsqrt(mean(x^2) + eps)`).
    RmsNorm {
        weight: &'a GpuTensor,
        eps: f32,
    },
}

/// What becomes of the product.
#[derive(Debug, Clone)]
pub enum Output<'a> {
    /// `y = W x`.
    Store,
    /// `y += W x`, then the layer output (steering, capture) if any.
    Add(LayerOutput<'a>),
    /// `y[o] = silu(W[2o] x) * W[2o+1] x` (gate and up rows interleaved).
    Swiglu,
}

/// Which rows each token multiplies.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// The whole matrix.
    Dense,
    /// The whole matrix, the rows from `from_row` (where a part starts) on
    /// written to `tail` instead, in rows of `W.rows - from_row`: the parts
    /// before it and from it write different buffers, so they run side by
    /// side rather than one after the other.
    DenseApart { from_row: usize, tail: &'a wgpu::Buffer },
    /// Per routing slot: the chosen expert's `expert_rows` rows, input
    /// `x[t]`, output row `t * top_k + slot` (grid y = tokens x top_k).
    Slots { ids: &'a wgpu::Buffer, top_k: usize, expert_rows: usize },
    /// Summed over slots, weighted by the router: input row
    /// `t * top_k + slot`, output row `t` (needs [`Output::Add`]).
    Sum { ids: &'a wgpu::Buffer, weights: &'a wgpu::Buffer, top_k: usize, expert_rows: usize },
}

/// One projection: `y = out(W in(x))` for every token in flight.
#[derive(Debug, Clone)]
pub struct GemvSpec<'a> {
    pub weight: &'a GpuTensor,
    pub x: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    pub input: Input<'a>,
    pub output: Output<'a>,
    pub rows: Rows<'a>,
}

impl<'a> GemvSpec<'a> {
    /// `y = W x`.
    pub fn plain(weight: &'a GpuTensor, x: &'a wgpu::Buffer, y: &'a wgpu::Buffer) -> Self {
        GemvSpec { weight, x, y, input: Input::Plain, output: Output::Store, rows: Rows::Dense }
    }
}

#[derive(Debug)]
pub struct Gemv {
    pub shape: GemvShape,
    subgroups: bool,
}

impl Gemv {
    pub fn new(gpu: &Gpu) -> Self {
        Self::with_shape(gpu, GemvShape::for_gpu(gpu))
    }

    pub fn with_shape(gpu: &Gpu, shape: GemvShape) -> Self {
        assert!(shape.threads_per_row.is_power_of_two());
        Gemv { shape, subgroups: super::subgroup_width(gpu) == Some(shape.threads_per_row) }
    }

    /// The dispatches of `spec`, one per weight part, in part order.
    pub fn plan(&self, gpu: &Gpu, spec: &GemvSpec<'_>) -> Result<Vec<Dispatch>> {
        let w = spec.weight;
        let swiglu = matches!(spec.output, Output::Swiglu);
        let rows_per_output = if swiglu { 2 } else { 1 };
        let last = w.parts.len() - 1;
        w.parts
            .iter()
            .enumerate()
            .map(|(i, part)| {
                // Experts: every part covers all outputs (for the experts it
                // holds), so only the last one finishes the layer output.
                let output = match (&spec.output, spec.rows) {
                    (Output::Add(_), Rows::Sum { .. }) if i != last => Output::Add(LayerOutput::default()),
                    (o, _) => o.clone(),
                };
                self.dispatch(gpu, spec, part, output, rows_per_output)
            })
            .collect()
    }

    fn dispatch(
        &self,
        gpu: &Gpu,
        spec: &GemvSpec<'_>,
        part: &TensorPart,
        output: Output<'_>,
        rows_per_output: usize,
    ) -> Result<Dispatch> {
        let w = spec.weight;
        if part.format != WeightFormat::Bf16 && !w.cols.is_multiple_of(4) {
            return Err(crate::Error::Unsupported {
                what: "GEMV width (a multiple of 4 in formats other than bf16)",
                value: format!("{}: {} columns of {}", w.name, w.cols, part.format),
            });
        }
        let int8 = self.shape.int8 && has_int8_units(part.format);
        // bf16 rows need few loads of x per weight: pairing rows to share
        // them would only halve the groups in flight; with the norm's
        // weight loaded beside x, pairs share twice the loads (and decode
        // faster).
        let swiglu = matches!(output, Output::Swiglu);
        let one_row =
            part.format == WeightFormat::Bf16 && !swiglu && !matches!(spec.input, Input::RmsNorm { .. });
        let (y, y_first_row, y_rows) = dense_target(spec, part);
        let mut b = Build {
            flags: self.format_flags(gpu, part.format, int8, one_row),
            constants: vec![],
            buffers: vec![
                (1, part.buffer.as_entire_buffer_binding()),
                (2, spec.x.as_entire_buffer_binding()),
                (3, y.as_entire_buffer_binding()),
            ],
            params: GemvParams {
                rows: part.rows as u32,
                cols: w.cols as u32,
                first_row: part.first_row as u32,
                top_k: 1,
                ..Default::default()
            },
        };
        b.input(spec.input);
        b.output(&output);
        let (outputs, grid_y) =
            b.rows(spec.rows, &output, part.first_row - y_first_row, y_rows, rows_per_output);
        // A group of lanes computes two rows (two outputs, or one SwiGLU)
        // or one.
        let outputs_per_group = if swiglu || one_row { 1 } else { 2 };
        let groups = self.workgroup(gpu, spec, &mut b, int8, outputs.div_ceil(outputs_per_group));
        let pipeline = super::pipeline(gpu, "gemv", "main", &b.flags, &b.constants)?;
        let params = ParamsBuffer::new(gpu, "gemv.params", &b.params);
        b.buffers.push((0, params.0.as_entire_buffer_binding()));
        let mut blocks = outputs.div_ceil(groups * outputs_per_group);
        if int8 && self.shape.int8_workgroups > 0 {
            blocks = blocks.min(self.shape.int8_workgroups);
        }
        let mut workgroups = gpu.fold_grid(blocks);
        workgroups[1] = grid_y;
        Ok(Dispatch {
            label: "gemv",
            bind_group: super::bind_reading(gpu, "gemv", &pipeline, part.format, &b.buffers),
            pipeline,
            workgroups,
            tokens_per_workgroup: 1,
        })
    }

    /// The build flags of a part in `format`: its decoding and the dot
    /// products that read it.
    fn format_flags(&self, gpu: &Gpu, format: WeightFormat, int8: bool, one_row: bool) -> Vec<&'static str> {
        let mut flags = super::weight_flags(gpu, format);
        if int8 {
            flags.extend(int8_flags(format));
        } else if self.shape.units && has_units(format) {
            flags.push(UNIT_DOTS);
        }
        if one_row {
            flags.push("ONE_ROW");
        }
        flags
    }

    /// Sets the workgroup's constants (its groups of lanes, their
    /// reductions, unroll and staging) for `groups_of_outputs` groups'
    /// work, and returns the groups per workgroup.
    fn workgroup(
        &self,
        gpu: &Gpu,
        spec: &GemvSpec<'_>,
        b: &mut Build<'_>,
        int8: bool,
        groups_of_outputs: u32,
    ) -> u32 {
        let s = self.shape;
        // The byte-activation staging shuffles within the lanes of a block.
        let subgroups = self.subgroups && (!int8 || s.threads_per_row >= STAGING_LANES);
        if subgroups {
            // A group's lanes are one subgroup: the workgroup's sum of
            // squares is its subgroups' sums (faster than a tree of
            // barriers).
            b.flags.extend([super::SUBGROUPS, SUBGROUP_SUM]);
            b.constants.push(("SUBGROUP_WIDTH", s.threads_per_row as f64));
        }
        let groups = if int8 {
            s.int8_rows_per_workgroup
        } else if groups_of_outputs < s.spread_below {
            1
        } else {
            s.rows_per_workgroup
        };
        if int8 {
            let cols = spec.weight.cols;
            let chunk = x_chunk(gpu, subgroups, cols, &spec.rows);
            // Dense products' staging loads every quad an invocation stages
            // before staging any (the kernel caps them; expert products
            // keep one at a time: `STAGE_BATCH` in `wgsl/gemv.wgsl`).
            if subgroups && matches!(spec.rows, Rows::Dense | Rows::DenseApart { .. }) {
                let quads = (chunk.min(cols) / 4) as u32;
                b.constants.push(("STAGED_QUADS", quads.div_ceil(groups * s.threads_per_row) as f64));
            }
            b.constants.extend([
                ("X_CHUNK", chunk as f64),
                ("X_RUNS", (chunk / 16) as f64),
                ("X_BLOCKS", (chunk / 32) as f64),
                ("X_QUADS", (chunk / 4) as f64),
            ]);
        }
        b.constants.extend([
            ("ROWS_PER_WG", groups as f64),
            ("THREADS_PER_ROW", s.threads_per_row as f64),
            ("WG", (groups * s.threads_per_row) as f64),
            ("UNROLL", s.unroll_for(spec, int8) as f64),
        ]);
        groups
    }
}

/// The buffer a part's dense rows of y go to, the row of the product
/// where that buffer starts, and the product's rows it holds.
fn dense_target<'b>(spec: &GemvSpec<'b>, part: &TensorPart) -> (&'b wgpu::Buffer, usize, usize) {
    let w = spec.weight;
    match spec.rows {
        Rows::DenseApart { from_row, tail } if part.first_row >= from_row => {
            (tail, from_row, w.rows - from_row)
        }
        Rows::DenseApart { from_row, .. } => {
            assert!(part.first_row + part.rows <= from_row, "{}: a part straddles row {from_row}", w.name);
            (spec.y, 0, w.rows)
        }
        _ => (spec.y, 0, w.rows),
    }
}

/// A dispatch's build flags, override constants, bindings and parameters
/// as [`Gemv::dispatch`] assembles them.
struct Build<'b> {
    flags: Vec<&'static str>,
    constants: Vec<(&'static str, f64)>,
    buffers: Vec<(u32, wgpu::BufferBinding<'b>)>,
    params: GemvParams,
}

impl<'b> Build<'b> {
    fn input(&mut self, input: Input<'b>) {
        if let Input::RmsNorm { weight, eps } = input {
            self.flags.push("NORM");
            self.params.eps = eps;
            self.buffers.push((4, weight.parts[0].buffer.as_entire_buffer_binding()));
        }
    }

    fn output(&mut self, output: &Output<'b>) {
        match output {
            Output::Store => {}
            Output::Swiglu => self.flags.push("SWIGLU"),
            Output::Add(layer) => {
                self.flags.push("ADD");
                layer.bind(&mut self.flags, &mut self.buffers, &mut self.constants);
            }
        }
    }

    /// Binds which rows each token multiplies; returns the outputs per
    /// token (per token and slot) and the grid's y. Dense rows: this
    /// part's outputs start `offset` rows into a target of `target_rows`.
    fn rows(
        &mut self,
        rows: Rows<'b>,
        output: &Output<'_>,
        offset: usize,
        target_rows: usize,
        rows_per_output: usize,
    ) -> (u32, u32) {
        let (outputs, grid_y) = match rows {
            Rows::Dense | Rows::DenseApart { .. } => {
                self.params.out_offset = (offset / rows_per_output) as u32;
                self.params.y_stride = (target_rows / rows_per_output) as u32;
                (self.params.rows as usize / rows_per_output, 1)
            }
            Rows::Slots { ids, top_k, expert_rows } => {
                self.flags.extend(["EXPERTS", "SLOTS"]);
                self.buffers.push((5, ids.as_entire_buffer_binding()));
                self.params.top_k = top_k as u32;
                self.params.expert_rows = expert_rows as u32;
                self.params.y_stride = (expert_rows / rows_per_output) as u32;
                (expert_rows / rows_per_output, top_k as u32)
            }
            Rows::Sum { ids, weights, top_k, expert_rows } => {
                assert!(matches!(output, Output::Add(_)), "a sum over slots adds into y");
                self.flags.extend(["EXPERTS", "SUM"]);
                self.buffers.push((5, ids.as_entire_buffer_binding()));
                self.buffers.push((6, weights.as_entire_buffer_binding()));
                self.params.top_k = top_k as u32;
                self.params.expert_rows = expert_rows as u32;
                self.params.y_stride = expert_rows as u32;
                (expert_rows, 1)
            }
        };
        self.params.outputs = outputs as u32;
        (outputs as u32, grid_y)
    }
}

/// Workgroup sums through subgroup sums (`wgsl/workgroup_sum.wgsl`).
const SUBGROUP_SUM: &str = "SUBGROUP_SUM";

/// Rows in a format that `weights.wgsl` gives units are read by units.
const UNIT_DOTS: &str = "UNIT_DOTS";

/// The formats `weights.wgsl` defines `unit_dots` for.
fn has_units(format: WeightFormat) -> bool {
    use WeightFormat::*;
    matches!(format, Q2K | Q3K | Q4K | Q5K | Q6K)
}

/// Rows dotted with activations quantized to bytes, on the integer dot units.
const INT8_DOTS: &str = "INT8_DOTS";

/// The formats `weights.wgsl` defines `unit_dots` against byte activations for.
pub fn has_int8_units(format: WeightFormat) -> bool {
    use WeightFormat::*;
    matches!(
        format,
        Q8_0 | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q4K
            | Q5K
            | Q6K
            | IQ4NL
            | IQ4XS
            | MXFP4
            | IQ2XXS
            | IQ2XS
            | IQ2S
            | IQ3XXS
            | IQ3S
            | IQ1S
            | IQ1M
    )
}

/// The flags of a build reading `format` against byte activations: those
/// whose quants index a table of bytes also fill it in workgroup memory.
fn int8_flags(format: WeightFormat) -> Vec<&'static str> {
    use WeightFormat::*;
    match format {
        IQ4NL | IQ4XS | MXFP4 => vec![INT8_DOTS, "INT8_TABLE"],
        _ => vec![INT8_DOTS],
    }
}

/// The flag sets of every GEMV the flow builds (for the shader test).
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = Vec::new();
    for reduce in [&[][..], &[super::SUBGROUPS, SUBGROUP_SUM]] {
        let mut sets: Vec<Vec<&'static str>> =
            vec![vec![], vec!["NORM"], vec!["NORM", "SWIGLU"], vec!["NORM", "SWIGLU", "EXPERTS", "SLOTS"]];
        for layer in LayerOutput::flag_sets() {
            sets.push([&["ADD"][..], &layer].concat());
            sets.push([&["ADD", "EXPERTS", "SUM"][..], &layer].concat());
        }
        out.extend(sets.into_iter().map(|mut s| {
            if !s.contains(&"SWIGLU") {
                s.push("ONE_ROW");
            }
            s.extend_from_slice(reduce);
            s
        }));
    }
    // Every format, in the forms the flow builds, with one reduction.
    for format in WeightFormat::ALL.into_iter().filter(|f| f.flag().is_some()) {
        let int8 = int8_flags(format);
        let mut reads: Vec<&[&str]> = vec![if has_units(format) { &[UNIT_DOTS] } else { &[] }];
        if has_int8_units(format) {
            reads.push(&int8);
        }
        for weights in super::weight_flag_sets().into_iter().filter(|f| f.contains(&format.flag().unwrap())) {
            for form in [&["NORM"][..], &["NORM", "SWIGLU", "EXPERTS", "SLOTS"], &["ADD", "EXPERTS", "SUM"]] {
                for read in &reads {
                    out.push([form, &weights, read].concat());
                }
                // The byte-activation staging by shuffles.
                if has_int8_units(format) {
                    out.push([form, &weights, &int8, &[super::SUBGROUPS, SUBGROUP_SUM]].concat());
                }
            }
        }
    }
    out
}
