//! The vision tower's forward pass over one image's patches (Qwen3-VL),
//! all on the GPU, one submission:
//! ```text
//! x  = patches @ patch_embed + b + interp(pos_embed)    GEMM + bias; embed, weighted residual
//! per block:
//!   x += proj(attend(rope2d(qkv(ln1 x))))               layer norm, GEMM + bias, bidirectional attention
//!   x += fc2(gelu(fc1(ln2 x)))                          layer norm, GEMM + bias + GELU, GEMM + bias
//!   after a deepstack block j:
//!     deep_j = fc2(gelu(fc1(ln(x as merge blocks))))    the block's patches side by side, normed together
//! merged = fc2(gelu(fc1(ln(x) as merge blocks)))        each patch normed, then side by side
//! ```
//! A GEMM adds its layer's bias and activation, or (proj, fc2) adds its
//! outputs into x, as it writes them; after the GEMV, where there is no
//! GEMM, `bias_act` and the residual add do.
//! Patches come in merge-block order (the processor's), so a merge block's
//! rows are consecutive and a `[n, h]` buffer is `[n / m^2, m^2 h]` as it is.
//! The learned `side x side` positions are interpolated bilinearly (corners
//! aligned) to the image's patch grid, four taps per patch computed on the
//! host; the 2-D rotary gives the first quarter of each head's frequencies
//! the patch's row and the second its column.

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu};
use crate::kernels::attention::{AttentionBindings, AttentionShape};
use crate::kernels::bias_act::Activation;
use crate::kernels::gemm::{AfterBias, Bias, Gemm, PrefillPrecision};
use crate::kernels::gemv::GemvSpec;
use crate::kernels::residual::LayerOutput;
use crate::kernels::rms_norm::Rows;
use crate::kernels::{Kernels, Step};
use crate::kv_cache::Heads;
use crate::kv_cache::KvFormat;
use crate::model::config::rotary_row;
use crate::model::vision::{LayerNorm, Linear, Merger, VisionConfig};
use crate::model::{Model, RopeConfig, RopeScaling};
use crate::vision::Patches;

/// LayerNorm epsilon of every norm of the tower.
const LAYER_NORM_EPS: f32 = 1e-6;

/// An image's rows for the language model, on the GPU.
#[derive(Debug)]
pub struct ImageRows {
    /// Merged rows (one per merge block of patches), `[tokens, out_hidden]`.
    pub tokens: usize,
    pub merged: wgpu::Buffer,
    /// The deepstack mergers' rows, each `[tokens, out_hidden]`, in the
    /// order of the language model's layers that add them.
    pub deepstack: Vec<wgpu::Buffer>,
    /// Frames, rows and columns of merged tokens.
    pub grid: [usize; 3],
}

impl ImageRows {
    /// The rows read back: merged, then each deepstack merger's.
    #[cfg(feature = "internals")]
    pub fn read(&self, gpu: &Gpu, width: usize) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let n = self.tokens * width;
        let deep = self.deepstack.iter().map(|b| gpu.read_buffer(b, n)).collect::<Result<_>>()?;
        Ok((gpu.read_buffer(&self.merged, n)?, deep))
    }
}

/// Row and column of each patch, in merge-block order.
fn patch_positions(grid_h: usize, grid_w: usize, m: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(grid_h * grid_w);
    for block_row in 0..grid_h / m {
        for block_col in 0..grid_w / m {
            for in_row in 0..m {
                for in_col in 0..m {
                    out.push((block_row * m + in_row, block_col * m + in_col));
                }
            }
        }
    }
    out
}

/// Bilinear taps (corners aligned) of position `index` of an axis of `size`
/// into a table side of `side`: two indices and their weights, in f32 as
/// transformers computes them.
fn axis_taps(index: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let floor = src.floor();
    [0, 1].map(|o| {
        let tap = (floor as usize + o).min(side - 1);
        let distance = (src - floor - o as f32).abs();
        (tap, (1.0 - distance).max(0.0))
    })
}

/// The four taps into the position table of each patch, and their weights.
fn position_taps(
    positions: &[(usize, usize)],
    grid_h: usize,
    grid_w: usize,
    side: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut weights) =
        (Vec::with_capacity(4 * positions.len()), Vec::with_capacity(4 * positions.len()));
    for &(row, col) in positions {
        for (h, hw) in axis_taps(row, grid_h, side) {
            for (w, ww) in axis_taps(col, grid_w, side) {
                ids.push((h * side + w) as u32);
                weights.push(hw * ww);
            }
        }
    }
    (ids, weights)
}

/// Each patch's rotary angles as the attention kernels read them, `[n,
/// head_dim]`: cosines then sines of `head_dim / 2` angles, the first half
/// the row times its frequencies, the second the column times the same.
fn rotary_table(positions: &[(usize, usize)], v: &VisionConfig) -> Vec<f32> {
    let quarter =
        RopeConfig { theta: v.rope_theta, rotary_dim: v.head_dim() / 2, scaling: RopeScaling::None };
    let inv_freq = quarter.inv_freq();
    let both = [&inv_freq[..], &inv_freq[..]].concat();
    let q = inv_freq.len();
    positions
        .iter()
        .flat_map(|&(row, col)| rotary_row(&both, 1.0, |f| (if f < q { row } else { col }) as u32))
        .collect()
}

/// The dispatches of a pass and the tokens each is encoded for.
struct Pass<'a> {
    gpu: &'a Gpu,
    kernels: &'a Kernels,
    /// The GEMM of the projections; `None`: the GEMV, once per row.
    gemm: Option<&'a Gemm>,
    dispatches: Vec<(Dispatch, u32)>,
}

impl Pass<'_> {
    fn push(&mut self, d: Dispatch, tokens: usize) {
        self.dispatches.push((d, tokens as u32));
    }

    /// `y = x W^T + b` for `tokens` rows, then `activation` (the GEMM
    /// reading `x`'s f16 copy where given and its tile reads it).
    fn linear(
        &mut self,
        l: &Linear,
        step: &wgpu::Buffer,
        tokens: usize,
        (x, x16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        y: &wgpu::Buffer,
        activation: Activation,
    ) -> Result<()> {
        // The GEMM adds the bias and activates as it writes its outputs;
        // after the GEMV, a kernel of their own does.
        if let Some(gemm) = self.gemm {
            let bias = Bias { buffer: &l.bias, then: AfterBias::Activate(activation) };
            return self.biased_gemm(gemm, l, bias, step, tokens, (x, x16), y);
        }
        self.gemv_then_bias(l, tokens, x, y, activation)
    }

    /// `residual += x W^T + b` for `tokens` rows of `l.weight.rows`: in the
    /// GEMM's outputs, or after the GEMV through `scratch`.
    #[allow(clippy::too_many_arguments)]
    fn linear_into_residual(
        &mut self,
        l: &Linear,
        step: &wgpu::Buffer,
        tokens: usize,
        (x, x16): (&wgpu::Buffer, Option<&wgpu::Buffer>),
        residual: &wgpu::Buffer,
        scratch: Option<&wgpu::Buffer>,
    ) -> Result<()> {
        if let Some(gemm) = self.gemm {
            let bias = Bias { buffer: &l.bias, then: AfterBias::AddTo };
            return self.biased_gemm(gemm, l, bias, step, tokens, (x, x16), residual);
        }
        let scratch = scratch.expect("the GEMV's outputs have a buffer where there is no GEMM");
        self.gemv_then_bias(l, tokens, x, scratch, Activation::None)?;
        let n = l.weight.rows;
        let add =
            self.kernels.residual.plan(self.gpu, n, 1.0, (scratch, 1), residual, &LayerOutput::default())?;
        self.push(add, tokens);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn biased_gemm(
        &mut self,
        gemm: &Gemm,
        l: &Linear,
        bias: Bias<'_>,
        step: &wgpu::Buffer,
        tokens: usize,
        x: (&wgpu::Buffer, Option<&wgpu::Buffer>),
        y: &wgpu::Buffer,
    ) -> Result<()> {
        for d in gemm.plan_biased(self.gpu, &l.weight, bias, tokens, step, x, y)? {
            self.push(d, tokens);
        }
        Ok(())
    }

    /// The GEMV's `y = x W^T` for each of `tokens` rows, then `bias_act`.
    fn gemv_then_bias(
        &mut self,
        l: &Linear,
        tokens: usize,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        activation: Activation,
    ) -> Result<()> {
        let (gpu, k) = (self.gpu, self.kernels);
        for d in k.gemv.plan(gpu, &GemvSpec::plain(&l.weight, x, y))? {
            self.push(d, tokens);
        }
        let bias = k.bias_act.plan(gpu, activation, l.weight.rows, tokens, &l.bias, y)?;
        self.push(bias, tokens);
        Ok(())
    }

    /// LayerNorm of `count` rows of `n` (also as f16 into `out16` where given).
    fn layer_norm(
        &mut self,
        norm: &LayerNorm,
        n: usize,
        count: usize,
        x: &wgpu::Buffer,
        out: (&wgpu::Buffer, Option<&wgpu::Buffer>),
    ) -> Result<()> {
        let rows = Rows { heads: count, head_stride: n, ..Rows::vector(n) };
        let d = self.kernels.rms_norm.plan_layer_norm(
            self.gpu,
            &norm.weight,
            &norm.bias,
            LAYER_NORM_EPS,
            x,
            out,
            rows,
        )?;
        self.push(d, 1);
        Ok(())
    }

    /// A merger into `out`: `x`'s `n` patches normed (each, or with
    /// `side_by_side` a merge block's together), then its two layers.
    #[allow(clippy::too_many_arguments)]
    fn merger(
        &mut self,
        m: &Merger,
        v: &VisionConfig,
        n: usize,
        side_by_side: bool,
        step: &wgpu::Buffer,
        x: &wgpu::Buffer,
        scratch: [&wgpu::Buffer; 2],
        out: &wgpu::Buffer,
    ) -> Result<()> {
        let tokens = n / (v.merge_size * v.merge_size);
        let [normed, hidden] = scratch;
        if side_by_side {
            self.layer_norm(&m.norm, v.merged_width(), tokens, x, (normed, None))?;
        } else {
            self.layer_norm(&m.norm, v.hidden, n, x, (normed, None))?;
        }
        self.linear(&m.fc1, step, tokens, (normed, None), hidden, Activation::GeluErf)?;
        self.linear(&m.fc2, step, tokens, (hidden, None), out, Activation::None)
    }
}

fn step_buffer(gpu: &Gpu, n_tokens: usize) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    let step = Step { pos0: 0, n_tokens: n_tokens as u32, attn_splits: 1, decode_rows: 0, attend_tiles: 0 };
    gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("vision.step"),
        contents: bytemuck::bytes_of(&step),
        usage: wgpu::BufferUsages::UNIFORM,
    })
}

/// The tower over `patches` (one image): its merged rows and deepstack
/// rows, computed with `gemm`, or with the GEMV where `None`
/// ([`crate::ChunkMatmul::gemm`] makes one).
pub fn encode_image(model: &Model, patches: &Patches, gemm: Option<&Gemm>) -> Result<ImageRows> {
    let (rows, dispatches) = plan_image(model, patches, gemm)?;
    let gpu = &model.gpu;
    let mut encoder =
        gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("vision") });
    {
        let mut compute = encoder.begin_compute_pass(&Default::default());
        for (d, t) in &dispatches {
            d.encode(&mut compute, *t);
        }
    }
    gpu.queue.submit([encoder.finish()]);
    gpu.check("the vision tower")?;
    Ok(rows)
}

/// [`encode_image`]'s dispatches, each timed in a pass of its own (GPU
/// timestamps, which the adapter must have): each one's kernel and time,
/// in order.
#[cfg(feature = "internals")]
pub fn profile_image(
    model: &Model,
    patches: &Patches,
    gemm: Option<&Gemm>,
) -> Result<Vec<(&'static str, std::time::Duration)>> {
    let (_rows, dispatches) = plan_image(model, patches, gemm)?;
    let times = model.gpu.time_each(&dispatches)?;
    model.gpu.check("the vision tower")?;
    Ok(times)
}

/// The buffers of the tower's output over `patches` and the dispatches
/// (with the tokens each is encoded for) that fill them.
fn plan_image(
    model: &Model,
    patches: &Patches,
    gemm: Option<&Gemm>,
) -> Result<(ImageRows, Vec<(Dispatch, u32)>)> {
    let (gpu, kernels) = (&model.gpu, &model.kernels);
    let (v, w) = match (&model.config.vision, &model.weights.vision) {
        (Some(v), Some(w)) => (v, w),
        _ => {
            return Err(Error::Unsupported {
                what: "images for a model without a vision tower",
                value: model.config.model_type.clone(),
            });
        }
    };
    check_patches(v, patches)?;
    let [_, grid_h, grid_w] = patches.grid;
    let n = grid_h * grid_w;
    let m2 = v.merge_size * v.merge_size;
    let tokens = n / m2;
    let h = v.hidden;
    let positions = patch_positions(grid_h, grid_w, v.merge_size);
    let (tap_ids, tap_weights) = position_taps(&positions, grid_h, grid_w, v.position_side);

    let buffer = |label: &str, len: usize| gpu.storage_buffer(label, len);
    let pixels = gpu.storage_buffer_init("vision.pixels", &patches.values);
    let x = buffer("vision.x", n * h)?;
    let normed = buffer("vision.normed", n * h)?;
    let qkv = buffer("vision.qkv", n * 3 * h)?;
    let attended = buffer("vision.attended", n * h)?;
    // The GEMV's outputs before their residual add (the GEMM adds its own).
    let gemv_out = gemm.is_none().then(|| buffer("vision.out", n * h)).transpose()?;
    let ffn = buffer("vision.ffn", n * v.intermediate)?;
    let (k_cache, v_cache) = (buffer("vision.k", n * h)?, buffer("vision.v", n * h)?);
    let taps = buffer("vision.taps", 4 * n * h)?;
    let ids = gpu.storage_buffer_init("vision.tap_ids", &tap_ids);
    let weights = gpu.storage_buffer_init("vision.tap_weights", &tap_weights);
    let cos_sin = gpu.storage_buffer_init("vision.cos_sin", &rotary_table(&positions, v));
    let merged = buffer("vision.merged", tokens * v.out_hidden)?;
    let deepstack: Vec<wgpu::Buffer> = (0..v.deepstack_layers.len())
        .map(|j| buffer(&format!("vision.deepstack.{j}"), tokens * v.out_hidden))
        .collect::<Result<_>>()?;
    let (step, merged_step) = (step_buffer(gpu, n), step_buffer(gpu, tokens));

    // f16 copies of the blocks' normed and attended rows, for GEMMs that
    // read their activations so (where the attention writes them too).
    let shape = attention_shape(v, gemm, kernels);
    let copies = gemm.is_some_and(|g| g.keeps_half_copies()) && kernels.attention.chunk_writes_f16(&shape);
    let half = |label: &str| copies.then(|| gpu.storage_buffer_bytes(label, (n * h * 2) as u64)).transpose();
    let (normed16, attended16) = (half("vision.normed16")?, half("vision.attended16")?);

    let mut pass = Pass { gpu, kernels, gemm, dispatches: Vec::new() };
    pass.linear(&w.patch_embed, &step, n, (&pixels, None), &x, Activation::None)?;
    for d in kernels.embed.plan(gpu, &w.pos_embed, &ids, &taps)? {
        pass.push(d, 4 * n);
    }
    let sum = kernels.residual.plan_weighted(gpu, h, 4, &weights, &taps, &x, &LayerOutput::default())?;
    pass.push(sum, n);

    let bindings = AttentionBindings {
        step: &step,
        qkv: &qkv,
        cos_sin: &cos_sin,
        k_cache: &k_cache,
        v_cache: &v_cache,
        out: &attended,
        values: None,
        out16: attended16.as_ref(),
    };
    for (b, block) in w.blocks.iter().enumerate() {
        pass.layer_norm(&block.norm1, h, n, &x, (&normed, normed16.as_ref()))?;
        pass.linear(&block.qkv, &step, n, (&normed, normed16.as_ref()), &qkv, Activation::None)?;
        for d in kernels.attention.plan_bidirectional(gpu, &shape, &bindings)? {
            pass.push(d, n);
        }
        pass.linear_into_residual(
            &block.proj,
            &step,
            n,
            (&attended, attended16.as_ref()),
            &x,
            gemv_out.as_ref(),
        )?;
        pass.layer_norm(&block.norm2, h, n, &x, (&normed, normed16.as_ref()))?;
        pass.linear(&block.fc1, &step, n, (&normed, normed16.as_ref()), &ffn, v.activation)?;
        pass.linear_into_residual(&block.fc2, &step, n, (&ffn, None), &x, gemv_out.as_ref())?;
        if let Some(j) = v.deepstack_layers.iter().position(|&l| l == b) {
            pass.merger(&w.deepstack[j], v, n, true, &merged_step, &x, [&normed, &attended], &deepstack[j])?;
        }
    }
    pass.merger(&w.merger, v, n, false, &merged_step, &x, [&normed, &attended], &merged)?;
    let rows =
        ImageRows { tokens, merged, deepstack, grid: [1, grid_h / v.merge_size, grid_w / v.merge_size] };
    Ok((rows, pass.dispatches))
}

/// The tower's attention: where the GEMM rounds its operands to f16 and
/// the heads fit the cooperative-matrix attention, it runs there, over an
/// f16 cache; elsewhere on the tiled f32 kernel over an f32 one.
fn attention_shape(v: &VisionConfig, gemm: Option<&Gemm>, kernels: &Kernels) -> AttentionShape<'static> {
    let hd = v.head_dim();
    let f16_shape = AttentionShape {
        heads: Heads { q: v.heads, kv: v.heads, dim: hd },
        rotary_dim: hd,
        scale: (hd as f32).powf(-0.5),
        window: 0,
        qk_norm: None,
        kv_format: KvFormat::F16,
        chunk_precision: PrefillPrecision::F16,
    };
    if gemm.is_some_and(|g| g.keeps_half_copies()) && kernels.attention.coop_fits(&f16_shape) {
        f16_shape
    } else {
        AttentionShape { kv_format: KvFormat::F32, chunk_precision: PrefillPrecision::Split, ..f16_shape }
    }
}

/// The patches are of the tower's size and form whole merge blocks of one
/// frame.
fn check_patches(v: &VisionConfig, p: &Patches) -> Result<()> {
    let [t, gh, gw] = p.grid;
    let fits = p.patch_len == v.patch_len()
        && t == 1
        && gh > 0
        && gw > 0
        && gh.is_multiple_of(v.merge_size)
        && gw.is_multiple_of(v.merge_size)
        && p.values.len() == gh * gw * p.patch_len;
    if !fits {
        return Err(Error::Unsupported {
            what: "image patches for this vision tower",
            value: format!(
                "grid {:?} of {} values per patch; the tower reads one frame of patches of {} values in whole {}x{} merge blocks",
                p.grid,
                p.patch_len,
                v.patch_len(),
                v.merge_size,
                v.merge_size
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_run_block_by_block_and_taps_interpolate_corners_exactly() {
        assert_eq!(
            patch_positions(2, 4, 2),
            vec![(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
        );
        // Corners land on the table's corners with weight 1.
        let (ids, weights) = position_taps(&[(0, 0), (3, 5)], 4, 6, 8);
        assert_eq!((ids[0], weights[0]), (0, 1.0));
        assert_eq!(weights[1..4].iter().sum::<f32>(), 0.0);
        let last = 7 * 8 + 7;
        assert!(ids[4..].iter().zip(&weights[4..]).all(|(&i, &w)| w == 0.0 || i == last));
        for patch in weights.chunks(4) {
            assert!((patch.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
    }
}
