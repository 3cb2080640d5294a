//! `wgsl/residual.wgsl`: the residual add, plain (scaled) or as the
//! weighted sum of the routed experts' outputs, and the layer output
//! (steering and capture, `common.wgsl`) that any layer-ending add carries.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

crate::wgsl_struct! {
    pub struct ResidualParams {
        n: u32,
        k: u32,
        scale: f32,
        /// Rows of x and y before the first one added.
        x_first: u32,
        y_first: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![ResidualParams::WGSL]
}

/// What the add at a layer's output also does: add `steer` (one row of
/// `n`) to every token, or with `steer_slots` row `steer_slots[t]` of
/// `steer` to token t, then copy the last `capture.rows` tokens' results.
#[derive(Debug, Clone, Default)]
pub struct LayerOutput<'a> {
    pub steer: Option<&'a wgpu::Buffer>,
    /// Per token (u32), its row of `steer`.
    pub steer_slots: Option<&'a wgpu::Buffer>,
    pub capture: Option<CaptureTarget<'a>>,
}

#[derive(Debug, Clone)]
pub struct CaptureTarget<'a> {
    /// Room for `rows * n` f32.
    pub region: wgpu::BufferBinding<'a>,
    pub rows: usize,
    /// The [`super::Step`] uniform: how many tokens are in flight.
    pub step: &'a wgpu::Buffer,
}

impl<'a> LayerOutput<'a> {
    /// Adds the flags, bindings and constants of `common.wgsl`'s
    /// `layer_output` for this output to a kernel's.
    pub(crate) fn bind(
        &self,
        flags: &mut Vec<&'static str>,
        buffers: &mut Vec<(u32, wgpu::BufferBinding<'a>)>,
        constants: &mut Vec<(&'static str, f64)>,
    ) {
        if let Some(steer) = self.steer {
            flags.push("STEER");
            buffers.push((10, steer.as_entire_buffer_binding()));
            if let Some(slots) = self.steer_slots {
                flags.push("STEER_ROWS");
                buffers.push((13, slots.as_entire_buffer_binding()));
            }
        }
        if let Some(c) = &self.capture {
            flags.push("CAPTURE");
            buffers.push((11, c.region.clone()));
            buffers.push((12, c.step.as_entire_buffer_binding()));
            constants.push(("CAPTURE_ROWS", c.rows as f64));
        }
    }

    /// Every combination of layer-output flags.
    #[cfg(feature = "internals")]
    pub fn flag_sets() -> Vec<Vec<&'static str>> {
        vec![vec![], vec!["STEER"], vec!["STEER", "STEER_ROWS"], vec!["CAPTURE"], vec!["STEER", "CAPTURE"]]
    }
}

/// Invocations per workgroup, and elements each adds (`WG` and `RUNS` of
/// `wgsl/residual.wgsl`): a chunk's add runs faster so than in workgroups
/// of 64 adding one element each.
const WG: u32 = 256;
const RUNS: u32 = 4;

#[derive(Debug, Default)]
pub struct Residual;

impl Residual {
    pub fn new() -> Self {
        Residual
    }

    fn dispatch(
        &self,
        gpu: &Gpu,
        params: ResidualParams,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        weights: Option<&wgpu::Buffer>,
        output: &LayerOutput<'_>,
    ) -> Result<Dispatch> {
        let mut flags = vec![];
        let mut constants = vec![("WG", WG as f64), ("RUNS", RUNS as f64)];
        let mut buffers = vec![(1, y.as_entire_buffer_binding()), (2, x.as_entire_buffer_binding())];
        if let Some(w) = weights {
            flags.push("WEIGHTED");
            buffers.push((3, w.as_entire_buffer_binding()));
        }
        output.bind(&mut flags, &mut buffers, &mut constants);
        let pipeline = super::pipeline(gpu, "residual", "main", &flags, &constants)?;
        let n = params.n;
        let params = ParamsBuffer::new(gpu, "residual.params", &params);
        buffers.push((0, params.0.as_entire_buffer_binding()));
        Ok(Dispatch {
            label: "residual",
            bind_group: gpu.bind_ranges("residual", &pipeline, &buffers),
            pipeline,
            workgroups: [n.div_ceil(WG * RUNS), 1, 1],
            tokens_per_workgroup: 1,
        })
    }

    /// `x[t] = layer_output(x[t] + scale * sum_j y[t, j])`, x packed
    /// `[tokens, n]`, y `[tokens, parts, n]`: a product and its partial
    /// sums over k (`kernels::gemm::Gemm::plan_summed`; one part: y is
    /// the product).
    pub fn plan(
        &self,
        gpu: &Gpu,
        n: usize,
        scale: f32,
        (y, parts): (&wgpu::Buffer, usize),
        x: &wgpu::Buffer,
        output: &LayerOutput<'_>,
    ) -> Result<Dispatch> {
        let params = ResidualParams { n: n as u32, k: parts as u32, scale, ..Default::default() };
        self.dispatch(gpu, params, y, x, None, output)
    }

    /// `x[x_first + t] += y[y_first + t]` for the tokens encoded, rows of
    /// `n` (rows of another buffer added at some of the chunk's tokens: an
    /// image's deepstack rows).
    pub fn plan_rows(
        &self,
        gpu: &Gpu,
        n: usize,
        (y, y_first): (&wgpu::Buffer, usize),
        (x, x_first): (&wgpu::Buffer, usize),
    ) -> Result<Dispatch> {
        let params = ResidualParams {
            n: n as u32,
            k: 1,
            scale: 1.0,
            x_first: x_first as u32,
            y_first: y_first as u32,
        };
        self.dispatch(gpu, params, y, x, None, &LayerOutput::default())
    }

    /// `x[t] = layer_output(x[t] + sum_j weights[t, j] * y[t, j])`, y
    /// packed `[tokens, k, n]`.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_weighted(
        &self,
        gpu: &Gpu,
        n: usize,
        k: usize,
        weights: &wgpu::Buffer,
        y: &wgpu::Buffer,
        x: &wgpu::Buffer,
        output: &LayerOutput<'_>,
    ) -> Result<Dispatch> {
        let params = ResidualParams { n: n as u32, k: k as u32, scale: 0.0, ..Default::default() };
        self.dispatch(gpu, params, y, x, Some(weights), output)
    }
}

/// The flag sets of every residual add the flow builds.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = Vec::new();
    for layer in LayerOutput::flag_sets() {
        out.push(layer.clone());
        out.push([&["WEIGHTED"][..], &layer].concat());
    }
    out
}
