//! Weight formats: the CPU and GPU decodings of every format against the
//! `gguf` Python package's `dequantize` (tests/fixtures/formats/blocks.gguf,
//! written by scripts/make_format_fixtures.py; FP8 against ml_dtypes'
//! float8_e4m3fn) bit for bit, and the GEMV in every format against a CPU
//! product of the decoded weights.

mod common;

use std::path::Path;

use common::{Rng, assert_close, on_each_backend, reference, run, step_buffer};
use wgspark::format::WeightFormat;
use wgspark::gguf::Gguf;
use wgspark::gpu::{Gpu, GpuOptions, GpuTensor};
use wgspark::kernels::gemm::{Epilogue, GemmKernel, HalfCopies};
use wgspark::kernels::gemv::{
    EXPERT_ELSEWHERE, GemvShape, GemvSpec, INT8_ROUNDING, Input, Output, Rows, has_int8_units, x_chunk,
};
use wgspark::kernels::residual::LayerOutput;
use wgspark::kernels::{Embed, Gemm, Gemv, split_sum};

fn fixture() -> Gguf {
    Gguf::open(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/formats/blocks.gguf")).unwrap()
}

/// The fixture's blocks of `format` as a matrix, and their expected values.
struct Case {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    file_bytes: Vec<u8>,
    values: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let g = fixture();
    WeightFormat::ALL
        .into_iter()
        .map(|format| {
            let name = format.to_string();
            let w = g.tensor(&format!("w.{name}")).unwrap_or_else(|| panic!("fixture has no w.{name}"));
            let y = g.tensor(&format!("y.{name}")).unwrap();
            // The values' shape: FP8's blocks are stored as bytes.
            let (rows, cols) = (y.shape()[0], y.shape()[1]);
            Case {
                format,
                rows,
                cols,
                file_bytes: g.data(w).to_vec(),
                values: bytemuck::pod_collect_to_vec(g.data(y)),
            }
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn upload(gpu: &Gpu, c: &Case) -> GpuTensor {
    let mut t = GpuTensor::alloc_in(gpu, "w", c.format, c.rows, c.cols, 1).unwrap();
    t.write_file_rows(gpu, 0, &c.file_bytes);
    t
}

#[test]
fn cpu_decoding_equals_the_gguf_package_bit_for_bit() {
    for c in cases() {
        assert_eq!(bits(&c.format.dequantize(&c.file_bytes, c.cols)), bits(&c.values), "{}", c.format);
    }
}

/// The embedding kernel decodes whole rows: every value of every format,
/// with the f16 conversions native and in integer arithmetic.
#[test]
fn gpu_decoding_equals_the_gguf_package_bit_for_bit() {
    on_each_backend(|gpu| {
        let mut emulated = gpu.clone();
        emulated.caps.f16_in_f32 = false;
        for gpu in [gpu, &emulated] {
            for c in cases() {
                let table = upload(gpu, &c);
                let ids: Vec<u32> = (0..c.rows as u32).rev().collect();
                let tokens = gpu.storage_buffer_init("tokens", &ids);
                let x = gpu.storage_buffer("x", c.rows * c.cols).unwrap();
                run(gpu, &Embed::new(gpu).unwrap().plan(gpu, &table, &tokens, &x).unwrap(), c.rows as u32);
                let got: Vec<f32> = gpu.read_buffer(&x, c.rows * c.cols).unwrap();
                let want: Vec<f32> =
                    ids.iter().flat_map(|&r| c.values[r as usize * c.cols..][..c.cols].to_vec()).collect();
                let f16 = if gpu.caps.f16_in_f32 { "native" } else { "emulated" };
                assert_eq!(bits(&got), bits(&want), "{} ({f16} f16)", c.format);
            }
        }
    });
}

/// float8_e4m3fn has no infinities: 0x7f and 0xff are NaN, on the CPU and
/// on the GPU (native and emulated f16), and the largest finite values are
/// +-448; a NaN weight must not turn into a finite one.
#[test]
fn fp8_nan_codes_decode_to_nan() {
    let format = WeightFormat::F8E4M3;
    let codes: Vec<u8> = (0..128).map(|i| [0x7f, 0xff, 0x7e, 0xfe, 0x00, 0x80, 0x01, 0x38][i % 8]).collect();
    let mut block = 2.0f32.to_le_bytes().to_vec();
    block.extend(&codes);
    let cpu = format.dequantize(&block, 128);
    assert!(cpu[0].is_nan() && cpu[1].is_nan(), "{:?}", &cpu[..2]);
    assert_eq!(cpu[2..8], [896.0, -896.0, 0.0, -0.0, 2.0 / 512.0, 2.0]);
    on_each_backend(|gpu| {
        let mut emulated = gpu.clone();
        emulated.caps.f16_in_f32 = false;
        for gpu in [gpu, &emulated] {
            let table = GpuTensor::alloc_in(gpu, "w", format, 1, 128, 1).unwrap();
            table.write_rows(gpu, 0, &block);
            let tokens = gpu.storage_buffer_init("tokens", &[0u32]);
            let x = gpu.storage_buffer("x", 128).unwrap();
            run(gpu, &Embed::new(gpu).unwrap().plan(gpu, &table, &tokens, &x).unwrap(), 1);
            let got: Vec<f32> = gpu.read_buffer(&x, 128).unwrap();
            for (i, (g, c)) in got.iter().zip(&cpu).enumerate() {
                assert!(g.to_bits() == c.to_bits() || (g.is_nan() && c.is_nan()), "value {i}: {g} vs {c}");
            }
        }
    });
}

/// Byte-activation builds whose two workgroups take blocks of rows in
/// turn (one group each), reusing the activations they staged where these
/// fit one chunk.
fn int8_in_turns(shape: GemvShape) -> GemvShape {
    GemvShape { int8: true, int8_rows_per_workgroup: 1, int8_workgroups: 2, ..shape }
}

/// Plain, normed with SwiGLU (gate and up rows interleaved), and adding
/// into the residual, in one output per invocation and in the adapter's
/// own shape.
#[test]
fn gemv_in_every_format_matches_the_cpu_product_of_its_values() {
    on_each_backend(|gpu| {
        // The formats after IQ4_XS draw from a stream of their own, so that
        // the earlier formats' inputs stay those they were tested with.
        let (mut first_rng, mut later_rng) = (Rng::new(11), Rng::new(12));
        let index = |f: WeightFormat| WeightFormat::ALL.iter().position(|&g| g == f);
        let later = |f: WeightFormat| index(f) > index(WeightFormat::IQ4XS);
        let one_per_invocation = GemvShape { int8: false, ..GemvShape::ONE_PER_INVOCATION };
        let gpu_shape = GemvShape::for_gpu(gpu);
        for shape in [
            one_per_invocation,
            GemvShape { units: false, ..one_per_invocation },
            GemvShape { int8: true, ..one_per_invocation },
            int8_in_turns(one_per_invocation),
            GemvShape { int8: false, ..gpu_shape },
            GemvShape { units: false, int8: false, ..gpu_shape },
            GemvShape { int8: true, ..gpu_shape },
        ]
        .into_iter()
        .chain(GemvShape::on_subgroups(gpu))
        {
            let gemv = Gemv::with_shape(gpu, shape);
            for c in cases() {
                let (rows, cols, tokens) = (c.rows, c.cols, 2);
                let what = format!("{} {shape:?}", c.format);
                let rng = if later(c.format) { &mut later_rng } else { &mut first_rng };
                let weight = upload(gpu, &c);
                // The activations as the kernel multiplies them.
                let int8 = shape.int8 && has_int8_units(c.format);
                let staged = |x: &[f32]| if int8 { reference::int8_activations(x) } else { x.to_vec() };
                let x = rng.vec(tokens * cols, 1.0);
                let xb = gpu.storage_buffer_init("x", &x);
                let products: Vec<f32> = (0..tokens)
                    .flat_map(|t| {
                        reference::gemv(&c.values, rows, cols, &staged(&x[t * cols..(t + 1) * cols]))
                    })
                    .collect();
                let tol = 1e-5 * (cols as f32).sqrt();

                let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
                run(gpu, &gemv.plan(gpu, &GemvSpec::plain(&weight, &xb, &yb)).unwrap(), tokens as u32);
                assert_close(&gpu.read_buffer(&yb, tokens * rows).unwrap(), &products, tol, &what);

                let residual = rng.vec(tokens * rows, 1.0);
                let yb = gpu.storage_buffer_init("y", &residual);
                let spec = GemvSpec {
                    output: Output::Add(LayerOutput::default()),
                    ..GemvSpec::plain(&weight, &xb, &yb)
                };
                run(gpu, &gemv.plan(gpu, &spec).unwrap(), tokens as u32);
                let want: Vec<f32> = residual.iter().zip(&products).map(|(r, p)| r + p).collect();
                assert_close(
                    &gpu.read_buffer(&yb, tokens * rows).unwrap(),
                    &want,
                    tol,
                    &format!("{what} add"),
                );

                // Rows 2o and 2o + 1 are output o's gate and up.
                let norm: Vec<f32> = common::bf16_round(&rng.vec(cols, 1.0));
                let norm_t = GpuTensor::vector_f32(gpu, "norm", &norm).unwrap();
                let yb = gpu.storage_buffer("y", tokens * (rows / 2)).unwrap();
                let spec = GemvSpec {
                    input: Input::RmsNorm { weight: &norm_t, eps: 1e-5 },
                    output: Output::Swiglu,
                    rows: Rows::Dense,
                    ..GemvSpec::plain(&weight, &xb, &yb)
                };
                run(gpu, &gemv.plan(gpu, &spec).unwrap(), tokens as u32);
                let want: Vec<f32> = (0..tokens)
                    .flat_map(|t| {
                        let h = reference::rms_norm(&x[t * cols..(t + 1) * cols], &norm, 1e-5);
                        let p = reference::gemv(&c.values, rows, cols, &staged(&h));
                        p.chunks_exact(2).map(|gu| reference::silu(gu[0]) * gu[1]).collect::<Vec<f32>>()
                    })
                    .collect();
                let got = gpu.read_buffer(&yb, tokens * (rows / 2)).unwrap();
                // A product of two dot products: their relative errors add.
                assert_close(&got, &want, 2.0 * tol, &format!("{what} norm swiglu"));
            }
        }
    });
}

/// Random blocks of `format` whose scales are small and finite (FP8: and
/// whose codes are numbers); the float formats' values in -1 .. 1.
fn random_blocks(rng: &mut Rng, format: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
    use WeightFormat::*;
    let values = |rng: &mut Rng| rng.vec(rows * cols, 1.0);
    let f16_scales: &[usize] = match format {
        F16 => return values(rng).iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        F32 => return values(rng).iter().flat_map(|v| v.to_le_bytes()).collect(),
        Bf16 => panic!("bf16 weights are values, not blocks"),
        Q8_0 | Q4_0 | Q5_0 | IQ4NL | IQ4XS => &[0],
        IQ2XXS | IQ2XS | IQ2S | IQ3XXS | IQ3S | IQ1S => &[0],
        Q4_1 | Q5_1 | Q4K | Q5K => &[0, 2],
        Q2K => &[80, 82],
        Q3K => &[108],
        Q6K => &[208],
        F8E4M3 | IQ1M | MXFP4 => &[],
    };
    let block = format.file_block_bytes();
    let mut bytes: Vec<u8> = (0..format.file_row_bytes(cols) * rows).map(|_| rng.next_u32() as u8).collect();
    for b in bytes.chunks_exact_mut(block) {
        for &at in f16_scales {
            let v = half::f16::from_f32(0.02 * rng.uniform());
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        if format == F8E4M3 {
            // [scale f32][codes]: 0x7f and 0xff are NaN.
            b[..4].copy_from_slice(&(0.01 * rng.uniform()).to_le_bytes());
            b[4..].iter_mut().filter(|q| **q & 0x7f == 0x7f).for_each(|q| *q = 0);
        }
        if format == IQ1M {
            // d's four nibbles are the top nibbles of the u16 scales at 48 .. 56.
            let d = half::f16::from_f32(0.02 * rng.uniform()).to_bits();
            for i in 0..4 {
                b[49 + 2 * i] = (b[49 + 2 * i] & 0x0f) | ((((d >> (4 * i)) & 0xf) as u8) << 4);
            }
        }
        if format == MXFP4 {
            // Scales 2^-20 .. 2^-5: normal values.
            b[0] = 107 + (rng.next_u32() % 16) as u8;
        }
    }
    bytes
}

/// A `rows` x `cols` tensor of [`random_blocks`] (bf16: of values in -1 ..
/// 1) on `gpu`, and its values.
fn random_weight(
    gpu: &Gpu,
    rng: &mut Rng,
    format: WeightFormat,
    rows: usize,
    cols: usize,
) -> (GpuTensor, Vec<f32>) {
    if format == WeightFormat::Bf16 {
        let values = common::bf16_round(&rng.vec(rows * cols, 1.0));
        let weight = GpuTensor::alloc(gpu, "w", rows, cols).unwrap();
        weight.write_rows(gpu, 0, &common::bf16_bytes(&values));
        return (weight, values);
    }
    let bytes = random_blocks(rng, format, rows, cols);
    let weight = GpuTensor::alloc_in(gpu, "w", format, rows, cols, 1).unwrap();
    weight.write_rows(gpu, 0, &format.to_gpu_layout(&bytes));
    (weight, format.dequantize(&bytes, cols))
}

/// A random weight shape for `format`: 1 to 300 rows, and a width of
/// whole blocks (the float formats: whole quads; FP8: whole quads, its
/// last block partial), now and then past one staged chunk of x.
fn random_shape(rng: &mut Rng, format: WeightFormat, widest: usize) -> (usize, usize) {
    let rows = 1 + rng.below(300) as usize;
    let step = match format {
        WeightFormat::F8E4M3 => 4,
        other => other.block_elements().max(4),
    };
    let widest = if rng.below(3) == 0 { widest } else { 1200 };
    (rows, step * (1 + rng.below((widest / step) as u32) as usize))
}

/// Each output's error against its scale: the sum of its products'
/// magnitudes (f32 accumulation in any order stays far within 1e-5 of
/// it).
fn worst_error(got: &[f32], want: &[f32], values: &[f32], x: &[f32], cols: usize) -> f32 {
    let rows = values.len() / cols;
    let scale = x.chunks_exact(cols).flat_map(|x| {
        values.chunks_exact(cols).map(move |w| w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum::<f32>())
    });
    assert_eq!(got.len(), want.len());
    assert_eq!(got.len(), rows * x.len() / cols);
    got.iter().zip(want).zip(scale).map(|((g, w), s)| (g - w).abs() / s.max(1e-30)).fold(0.0, f32::max)
}

/// Every format's GEMV (in one of its builds, drawn) and GEMM (in one of
/// the adapter's kernels, drawn) match the CPU product of its values on
/// random shapes, two of each a format.
#[test]
fn every_format_multiplies_random_shapes() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(17);
        let one_per_invocation = GemvShape::ONE_PER_INVOCATION;
        let gemv_shapes: Vec<GemvShape> = [
            one_per_invocation,
            GemvShape { int8: false, ..one_per_invocation },
            int8_in_turns(one_per_invocation),
            GemvShape::lanes(gpu, 32),
            GemvShape { int8: false, ..GemvShape::lanes(gpu, 32) },
        ]
        .into_iter()
        .chain(GemvShape::on_subgroups(gpu))
        .collect();
        let kernels = Gemm::kernels(gpu);
        for format in WeightFormat::ALL {
            for _ in 0..2 {
                let shape = gemv_shapes[rng.below(gemv_shapes.len() as u32) as usize];
                check_random_gemv(gpu, &mut rng, format, shape);
                let kernel = kernels[rng.below(kernels.len() as u32) as usize];
                check_random_gemm(gpu, &mut rng, format, kernel);
            }
        }
    });
}

/// A GEMV of `shape` on a random weight of `format` and 1 to 3 tokens.
fn check_random_gemv(gpu: &Gpu, rng: &mut Rng, format: WeightFormat, shape: GemvShape) {
    let (rows, cols) = random_shape(rng, format, 9000);
    let tokens = 1 + rng.below(3) as usize;
    let what = format!("GEMV {format} {rows} x {cols}, {tokens} tokens, {shape:?}");
    let (weight, values) = random_weight(gpu, rng, format, rows, cols);
    let x = rng.vec(tokens * cols, 1.0);
    // The activations as the kernel multiplies them.
    let staged: Vec<f32> = match shape.int8 && has_int8_units(format) {
        true => x.chunks_exact(cols).flat_map(reference::int8_activations).collect(),
        false => x.clone(),
    };
    let want: Vec<f32> =
        staged.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
    let (xb, yb) = (gpu.storage_buffer_init("x", &x), gpu.storage_buffer("y", tokens * rows).unwrap());
    let gemv = Gemv::with_shape(gpu, shape);
    run(gpu, &gemv.plan(gpu, &GemvSpec::plain(&weight, &xb, &yb)).unwrap(), tokens as u32);
    let got = gpu.read_buffer(&yb, tokens * rows).unwrap();
    let error = worst_error(&got, &want, &values, &staged, cols);
    assert!(error <= 1e-5, "{what}: error {error} of the products' magnitudes");
}

/// A GEMM in `kernel` on a random weight of `format` and 1 to 70 tokens.
fn check_random_gemm(gpu: &Gpu, rng: &mut Rng, format: WeightFormat, kernel: GemmKernel) {
    let (rows, cols) = random_shape(rng, format, 2400);
    let tokens = 1 + rng.below(70) as usize;
    let what = format!("GEMM {format} {rows} x {cols}, {tokens} tokens, {kernel:?}");
    let (weight, values) = random_weight(gpu, rng, format, rows, cols);
    let x = rng.vec(tokens * cols, 1.0);
    let (xb, yb) = (gpu.storage_buffer_init("x", &x), gpu.storage_buffer("y", tokens * rows).unwrap());
    let step = step_buffer(gpu, 0, tokens, 1);
    let gemm = Gemm::with_kernel(gpu, kernel).unwrap();
    run(gpu, &gemm.plan(gpu, &weight, Epilogue::Plain, tokens, &step, &xb, &yb).unwrap(), tokens as u32);
    let want: Vec<f32> = x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
    let got = gpu.read_buffer(&yb, tokens * rows).unwrap();
    assert_close(&got, &want, product_tolerance(kernel, &values, &x, rows, cols), &what);
}

/// The byte-activation GEMV stages x in chunks of 4096, or for rows of
/// more than two such chunks (a slot sum: one), with subgroups, in chunks of as much as
/// workgroup memory holds: rows wider than one chunk of either, ending
/// mid-chunk, in every format it reads, plain, normed (the norm's sum of
/// squares over every chunk) and summed over experts.
#[test]
fn int8_gemv_spans_chunks_of_the_activations() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(12);
        // Past the longest chunk this adapter's workgroup memory holds
        // (14336 in 48 KiB, 9472 in 32 KiB), ending mid-chunk.
        let (rows, cols, tokens) = (6, x_chunk(gpu, true, 1 << 20, &Rows::Dense) + 2048 + 256, 2);
        let shapes = [
            GemvShape::for_gpu(gpu),
            GemvShape::ONE_PER_INVOCATION,
            int8_in_turns(GemvShape::ONE_PER_INVOCATION),
        ];
        for shape in shapes.into_iter().chain(GemvShape::on_subgroups(gpu)) {
            let gemv = Gemv::with_shape(gpu, GemvShape { int8: true, ..shape });
            for format in WeightFormat::ALL.into_iter().filter(|f| has_int8_units(*f)) {
                let what = format!("{format} {shape:?}");
                // Where a run stops, with --nocapture.
                eprintln!("{what}");
                let (weight, values) = random_weight(gpu, &mut rng, format, rows, cols);
                let x = rng.vec(tokens * cols, 1.0);
                let xb = gpu.storage_buffer_init("x", &x);
                let tol = 1e-5 * (cols as f32).sqrt();
                // The staged values keep the bound the kernel documents.
                for (block, staged) in x.chunks(32).zip(reference::int8_activations(&x).chunks(32)) {
                    let largest = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    for (v, s) in block.iter().zip(staged) {
                        assert!((v - s).abs() <= INT8_ROUNDING * largest, "{v} staged as {s}");
                    }
                }

                let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
                run(gpu, &gemv.plan(gpu, &GemvSpec::plain(&weight, &xb, &yb)).unwrap(), tokens as u32);
                let want: Vec<f32> = x
                    .chunks_exact(cols)
                    .flat_map(|x| reference::gemv(&values, rows, cols, &reference::int8_activations(x)))
                    .collect();
                assert_close(&gpu.read_buffer(&yb, tokens * rows).unwrap(), &want, tol, &what);

                let norm: Vec<f32> = common::bf16_round(&rng.vec(cols, 1.0));
                let norm_t = GpuTensor::vector_f32(gpu, "norm", &norm).unwrap();
                let spec = GemvSpec {
                    input: Input::RmsNorm { weight: &norm_t, eps: 1e-5 },
                    ..GemvSpec::plain(&weight, &xb, &yb)
                };
                eprintln!("{what} norm");
                run(gpu, &gemv.plan(gpu, &spec).unwrap(), tokens as u32);
                let want: Vec<f32> = x
                    .chunks_exact(cols)
                    .flat_map(|x| {
                        let h = reference::rms_norm(x, &norm, 1e-5);
                        reference::gemv(&values, rows, cols, &reference::int8_activations(&h))
                    })
                    .collect();
                assert_close(
                    &gpu.read_buffer(&yb, tokens * rows).unwrap(),
                    &want,
                    tol,
                    &format!("{what} norm"),
                );

                // Experts of 2 rows: token t's slots are experts 2 and 0,
                // weighted 0.75 and 0.25, each slot with its own input.
                let (top_k, expert_rows) = (2, 2);
                let ids = gpu.storage_buffer_init("ids", &[2u32, 0, 2, 0]);
                let route = gpu.storage_buffer_init("route", &[0.75f32, 0.25, 0.75, 0.25]);
                let slots_x = rng.vec(tokens * top_k * cols, 1.0);
                let slots_xb = gpu.storage_buffer_init("x", &slots_x);
                let residual = rng.vec(tokens * expert_rows, 1.0);
                let yb = gpu.storage_buffer_init("y", &residual);
                let spec = GemvSpec {
                    output: Output::Add(LayerOutput::default()),
                    rows: Rows::Sum { ids: &ids, weights: &route, top_k, expert_rows },
                    ..GemvSpec::plain(&weight, &slots_xb, &yb)
                };
                eprintln!("{what} experts");
                run(gpu, &gemv.plan(gpu, &spec).unwrap(), tokens as u32);
                let expert = |e: usize, x: &[f32], weight: f32| {
                    int8_expert_product(&values, e, expert_rows, cols, x, weight)
                };
                let want: Vec<f32> = (0..tokens)
                    .flat_map(|t| {
                        let slot = |j: usize| &slots_x[(t * top_k + j) * cols..(t * top_k + j + 1) * cols];
                        let (a, b) = (expert(2, slot(0), 0.75), expert(0, slot(1), 0.25));
                        (0..expert_rows)
                            .map(|o| residual[t * expert_rows + o] + a[o] + b[o])
                            .collect::<Vec<f32>>()
                    })
                    .collect();
                assert_close(
                    &gpu.read_buffer(&yb, tokens * expert_rows).unwrap(),
                    &want,
                    tol,
                    &format!("{what} experts"),
                );
            }
        }
    });
}

/// Expert `e`'s rows (of a stack of `expert_rows`-row experts in `values`)
/// times a slot's input as the byte-activation expert sum stages it: times
/// the slot's route weight, then quantized.
fn int8_expert_product(
    values: &[f32],
    e: usize,
    expert_rows: usize,
    cols: usize,
    x: &[f32],
    weight: f32,
) -> Vec<f32> {
    let rows = &values[e * expert_rows * cols..(e + 1) * expert_rows * cols];
    let weighted: Vec<f32> = x.iter().map(|v| v * weight).collect();
    reference::gemv(rows, expert_rows, cols, &reference::int8_activations(&weighted))
}

/// The byte-activation sum over slots runs them as one long row: experts
/// that straddle binding parts (each part adds the rows it holds), a slot
/// whose expert is elsewhere (skipped) and a token all of whose slots are
/// elsewhere (left as it is), in the adapter's shape and one output per
/// invocation; the slots' 6912 columns are more than one chunk of 4096
/// (with subgroups, one long chunk; else the second slot straddles two).
#[test]
fn int8_expert_sum_spans_binding_parts_and_skips_experts_elsewhere() {
    let (experts, expert_rows, cols, top_k, tokens) = (4, 3, 2304, 3, 3);
    let ids: Vec<u32> =
        vec![2, 0, EXPERT_ELSEWHERE, 3, 1, 2, EXPERT_ELSEWHERE, EXPERT_ELSEWHERE, EXPERT_ELSEWHERE];
    for backend in common::backends() {
        for format in [WeightFormat::Q8_0, WeightFormat::Q4K] {
            // Parts of 5 rows: experts of 3 rows straddle them.
            let limit = 5 * format.gpu_row_bytes(cols) as u64;
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: Some(limit), ..Default::default() })
                    .unwrap();
            let mut rng = Rng::new(14);
            let (weight, values) = random_weight(&gpu, &mut rng, format, experts * expert_rows, cols);
            assert!(weight.parts.len() > 2, "{} parts", weight.parts.len());
            let route: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform()).collect();
            let x = rng.vec(tokens * top_k * cols, 1.0);
            let residual = rng.vec(tokens * expert_rows, 1.0);
            let (idb, rwb, xb) = (
                gpu.storage_buffer_init("ids", &ids),
                gpu.storage_buffer_init("route", &route),
                gpu.storage_buffer_init("x", &x),
            );
            let want: Vec<f32> = (0..tokens)
                .flat_map(|t| {
                    let mut y = residual[t * expert_rows..(t + 1) * expert_rows].to_vec();
                    for j in (0..top_k).filter(|&j| ids[t * top_k + j] != EXPERT_ELSEWHERE) {
                        let pair = t * top_k + j;
                        let slot_x = &x[pair * cols..(pair + 1) * cols];
                        let p = int8_expert_product(
                            &values,
                            ids[pair] as usize,
                            expert_rows,
                            cols,
                            slot_x,
                            route[pair],
                        );
                        y.iter_mut().zip(p).for_each(|(y, p)| *y += p);
                    }
                    y
                })
                .collect();
            // The adapter's shape, one whose lanes walk the slots' units three at a time, one
            // output per invocation.
            let odd_unroll = GemvShape { sum_unroll: 3, ..GemvShape::for_gpu(&gpu) };
            let shapes = [GemvShape::for_gpu(&gpu), odd_unroll, GemvShape::ONE_PER_INVOCATION];
            for shape in shapes.into_iter().chain(GemvShape::on_subgroups(&gpu)) {
                let yb = gpu.storage_buffer_init("y", &residual);
                let spec = GemvSpec {
                    output: Output::Add(LayerOutput::default()),
                    rows: Rows::Sum { ids: &idb, weights: &rwb, top_k, expert_rows },
                    ..GemvSpec::plain(&weight, &xb, &yb)
                };
                let gemv = Gemv::with_shape(&gpu, GemvShape { int8: true, ..shape });
                run(&gpu, &gemv.plan(&gpu, &spec).unwrap(), tokens as u32);
                let got = gpu.read_buffer(&yb, want.len()).unwrap();
                assert_close(
                    &got,
                    &want,
                    1e-5 * ((top_k * cols) as f32).sqrt(),
                    &format!("{format} {shape:?}"),
                );
                assert_eq!(
                    got[2 * expert_rows..],
                    residual[2 * expert_rows..],
                    "a token whose experts are all elsewhere"
                );
            }
        }
    }
}

/// A NaN or an infinity in the activations must reach the byte-activation
/// GEMV's outputs (as it would in f32), not vanish in the rounding to bytes.
#[test]
fn int8_gemv_keeps_activations_that_are_not_numbers_visible() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(13);
        let (rows, cols) = (4, 512);
        let shapes = [GemvShape { int8: true, ..GemvShape::for_gpu(gpu) }];
        let shapes: Vec<GemvShape> = shapes.into_iter().chain(GemvShape::on_subgroups(gpu)).collect();
        for (shape, format) in
            shapes.iter().flat_map(|s| [WeightFormat::Q8_0, WeightFormat::Q4K].map(|f| (*s, f)))
        {
            let gemv = Gemv::with_shape(gpu, shape);
            let (weight, _) = random_weight(gpu, &mut rng, format, rows, cols);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                // Token 0 is clean, token 1 has one bad value.
                let mut x = rng.vec(2 * cols, 1.0);
                x[cols + 77] = bad;
                let xb = gpu.storage_buffer_init("x", &x);
                let yb = gpu.storage_buffer("y", 2 * rows).unwrap();
                run(gpu, &gemv.plan(gpu, &GemvSpec::plain(&weight, &xb, &yb)).unwrap(), 2);
                let y: Vec<f32> = gpu.read_buffer(&yb, 2 * rows).unwrap();
                let what = format!("{format} {bad} {shape:?}");
                assert!(y[..rows].iter().all(|v| v.is_finite()), "{what}: clean token {y:?}");
                assert!(y[rows..].iter().all(|v| !v.is_finite()), "{what}: bad token {y:?}");
            }
        }
    });
}

/// The cooperative-matrix GEMM stages weights as f16, so a tensor with
/// values beyond f16's range (the fixture's MXFP4 values reach 7.6e6) is
/// marked for the f32 GEMM when it is written, and no other is; at the edge
/// of MXFP4's scales, 6 * 2^13 is held and 6 * 2^14 is not.
#[test]
fn weights_beyond_f16_are_marked_for_the_f32_gemm() {
    on_each_backend(|gpu| {
        for c in cases() {
            let beyond = c.values.iter().any(|v| v.abs() > 65504.0);
            let marked = upload(gpu, &c).parts.iter().any(|p| p.beyond_f16);
            assert_eq!(marked, beyond, "{} values beyond f16 marked", c.format);
        }
        for (scale, beyond) in [(140u8, false), (141, true)] {
            let format = WeightFormat::MXFP4;
            // Two rows of one block, the second's codes all +6 (0x7).
            let bytes: Vec<u8> = [[127u8; 17], [scale; 17]]
                .iter()
                .flat_map(|b| {
                    let mut b = *b;
                    b[1..].fill(0x77);
                    b
                })
                .collect();
            let largest = format.dequantize(&bytes, 32).iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(largest > 65504.0, beyond, "scale byte {scale}: largest value {largest}");
            let mut t = GpuTensor::alloc_in(gpu, "w", format, 2, 32, 1).unwrap();
            t.write_file_rows(gpu, 0, &bytes);
            assert_eq!(t.parts[0].beyond_f16, beyond, "scale byte {scale}");
        }
    });
}

/// The prefill GEMM decodes the weights as it stages them: the formats
/// take the device's kernels and tilings in turn (each build compiles
/// slowly on CPU rasterisers), and where there are cooperative matrices
/// each format also runs their default kernels, with and without split
/// operands; a token count that ends mid-tile.
#[test]
fn gemm_in_every_format_matches_the_cpu_product_of_its_values() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(12);
        let kernels = Gemm::kernels(gpu);
        let cases = cases();
        let cases_and_kernels = cases.iter().enumerate().flat_map(|(i, c)| {
            let mut picked = vec![kernels[i % kernels.len()]];
            if gpu.caps.cooperative_matrix {
                for split in [false, true] {
                    let default = GemmKernel::Cooperative { split, tile: None };
                    if !picked.contains(&default) {
                        picked.push(default);
                    }
                }
            }
            picked.into_iter().map(move |kernel| (c, kernel))
        });
        for (c, kernel) in cases_and_kernels {
            let gemm = Gemm::with_kernel(gpu, kernel).unwrap();
            let (rows, cols, tokens) = (c.rows, c.cols, 70);
            let weight = upload(gpu, c);
            let x = rng.vec(tokens * cols, 1.0);
            let xb = gpu.storage_buffer_init("x", &x);
            let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
            let step = step_buffer(gpu, 0, tokens, 1);
            run(
                gpu,
                &gemm.plan(gpu, &weight, Epilogue::Plain, tokens, &step, &xb, &yb).unwrap(),
                tokens as u32,
            );
            let want: Vec<f32> = (0..tokens)
                .flat_map(|t| reference::gemv(&c.values, rows, cols, &x[t * cols..(t + 1) * cols]))
                .collect();
            let got = gpu.read_buffer(&yb, want.len()).unwrap();
            let tolerance = product_tolerance(kernel, &c.values, &x, rows, cols);
            assert_close(&got, &want, tolerance, &format!("{} {kernel:?}", c.format));
        }
    });
}

/// The error a GEMM kernel may make on `rows` x `cols` weight `values`
/// times activations `x` (tokens of `cols`): each product's operands are
/// rounded (the weights too where f16 does not hold them), so an output's
/// error grows with the root of the sum of its squared products, which the
/// formats' scales make large (Q5_K's and Q6_K's values reach 150).
fn product_tolerance(kernel: GemmKernel, values: &[f32], x: &[f32], rows: usize, cols: usize) -> f32 {
    let norm = x
        .chunks_exact(cols)
        .flat_map(|x| values.chunks_exact(cols).take(rows).map(move |w| (x, w)))
        .map(|(x, w)| x.iter().zip(w).map(|(a, b)| (a * b).powi(2)).sum::<f32>().sqrt())
        .fold(0.0, f32::max);
    (4.0 * kernel.activation_rounding() * norm).max(1e-5 * (cols as f32).sqrt())
}

/// Q8_0 in cooperative tiles of 16 subgroups loads two k steps ahead, in a
/// loop of its own: products of one, two, three and five steps (the loop's
/// last round whole or half), with ragged row and token tiles, match the
/// CPU product of the values. Runs where the adapter has cooperative
/// matrices (a GPU's Vulkan driver: CPU rasterisers have none, and the default tiles
/// of the test above do not load two steps ahead).
#[test]
fn q8_0_loading_two_steps_ahead_matches_the_cpu_product_at_every_loop_length() {
    use wgspark::kernels::gemm_coop::{Tile, flags};
    on_each_backend(|gpu| {
        if !gpu.caps.cooperative_matrix {
            return;
        }
        let format = WeightFormat::Q8_0;
        let tile = Tile { tokens: 128, rows: 256, k: 32, warps: 16 };
        let build = flags(gpu, format, false);
        assert!(tile.fits(&build) && tile.ahead(&build) == 2, "the tile this test is for");
        let kernel = GemmKernel::Cooperative { split: false, tile: Some(tile) };
        let gemm = Gemm::with_kernel(gpu, kernel).unwrap();
        let mut rng = Rng::new(15);
        let (rows, tokens) = (300, 70);
        for cols in [32, 64, 96, 160] {
            let (weight, values) = random_weight(gpu, &mut rng, format, rows, cols);
            let x = rng.vec(tokens * cols, 1.0);
            let xb = gpu.storage_buffer_init("x", &x);
            let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
            let step = step_buffer(gpu, 0, tokens, 1);
            let d = gemm.plan(gpu, &weight, Epilogue::Plain, tokens, &step, &xb, &yb).unwrap();
            run(gpu, &d, tokens as u32);
            let want: Vec<f32> =
                x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
            let tolerance = product_tolerance(kernel, &values, &x, rows, cols);
            let got = gpu.read_buffer(&yb, want.len()).unwrap();
            assert_close(&got, &want, tolerance, &format!("{cols} columns, {} steps", cols / 32));
        }
    });
}

/// On cooperative matrices in f16, a product large enough for the tile that
/// reads f16 copies of the activations reads them rather than the f32 rows
/// (zeros here), and a SwiGLU product writes its outputs as f16 too (the
/// f32 outputs rounded): in bf16 and llama.cpp's Q8_0, Q4_K and Q6_K, with
/// ragged row and token tiles;
/// rows that are not whole loads of eight f16s read the f32 rows. Elsewhere
/// no kernel takes f16 copies: they read the f32 rows beside them, and
/// asking for an f16 output is a typed error.
#[test]
fn large_products_read_and_write_f16_copies_of_the_activations() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(18);
        // 8 x 12 tiles of 256 rows and 128 tokens: the fewest the tile takes.
        let (rows, tokens, cols) = (2000, 1500, 256);
        let step = step_buffer(gpu, 0, tokens, 1);
        // Small enough that the gated products of Q6_K's large values (up
        // to 150) stay within f16's range.
        let x: Vec<f32> =
            rng.vec(tokens * cols, 1.0 / 32.0).iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        let x16 = common::f16_bits(&x);
        let zeros = gpu.storage_buffer("x", tokens * cols).unwrap();
        let xb16 = gpu.storage_buffer_bytes("x16", (tokens * cols * 2) as u64).unwrap();
        gpu.queue.write_buffer(&xb16, 0, bytemuck::cast_slice(&x16));
        let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
        let yb16 = gpu.storage_buffer_bytes("y16", (tokens * rows) as u64).unwrap();
        let chosen_tiles = Gemm::kernels(gpu)
            .into_iter()
            .filter(|k| !matches!(k, GemmKernel::Cooperative { tile: Some(_), .. }));
        for kernel in chosen_tiles {
            let gemm = Gemm::with_kernel(gpu, kernel).unwrap();
            for format in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
                let (weight, values) = random_weight(gpu, &mut rng, format, rows, cols);
                let what = format!("{format} {kernel:?}");
                let swiglu = HalfCopies { x: Some(&xb16), y: Some(&yb16) };
                let gated = gemm.plan_apart(
                    gpu,
                    &weight,
                    Epilogue::Swiglu,
                    tokens,
                    &step,
                    &zeros,
                    (&yb, None),
                    swiglu,
                );
                if !gemm.takes_half_copies(&weight) {
                    assert!(matches!(gated, Err(wgspark::Error::Unsupported { .. })), "{what}");
                    reads_the_f32_rows_beside_a_copy(gpu, &gemm, &mut rng, format, &what);
                    continue;
                }
                let plain = HalfCopies { x: Some(&xb16), y: None };
                let d =
                    gemm.plan_apart(gpu, &weight, Epilogue::Plain, tokens, &step, &zeros, (&yb, None), plain);
                run(gpu, &d.unwrap(), tokens as u32);
                let want: Vec<f32> =
                    x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
                let tolerance = product_tolerance(kernel, &values, &x, rows, cols);
                assert_close(&gpu.read_buffer(&yb, want.len()).unwrap(), &want, tolerance, &what);

                run(gpu, &gated.unwrap(), tokens as u32);
                // silu(g) u moves by at most 1.1 |u| for a unit of g and |g|
                // for a unit of u.
                let gated_tolerance = want
                    .chunks_exact(2)
                    .map(|gu| tolerance * (1.1 * gu[1].abs() + gu[0].abs()))
                    .fold(1e-5, f32::max);
                let want: Vec<f32> = want.chunks_exact(2).map(|gu| reference::silu(gu[0]) * gu[1]).collect();
                let y = gpu.read_buffer(&yb, want.len()).unwrap();
                assert_close(&y, &want, gated_tolerance, &format!("{what} swiglu"));
                let copy = common::read_f16(gpu, &yb16, y.len());
                assert_eq!(copy, common::f16_bits(&y), "{what}: f16 copy of the gated outputs");
            }
            // Rows that are not whole loads of eight f16s read the f32 rows
            // (beside a copy of zeros).
            if gemm.takes_half_copies(&upload_f16(gpu, &[0.0; 4], 1, 4)) {
                let cols = 260;
                let values: Vec<f32> = common::bf16_round(&rng.vec(rows * cols, 1.0));
                let weight = upload_f16(gpu, &values, rows, cols);
                let x = rng.vec(tokens * cols, 1.0 / 32.0);
                let xb = gpu.storage_buffer_init("x", &x);
                let x16 = gpu.storage_buffer_bytes("x16", (tokens * cols * 2) as u64).unwrap();
                let half = HalfCopies { x: Some(&x16), y: None };
                let d = gemm.plan_apart(gpu, &weight, Epilogue::Plain, tokens, &step, &xb, (&yb, None), half);
                run(gpu, &d.unwrap(), tokens as u32);
                let want: Vec<f32> =
                    x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
                let tolerance = product_tolerance(kernel, &values, &x, rows, cols);
                let got = gpu.read_buffer(&yb, want.len()).unwrap();
                assert_close(&got, &want, tolerance, &format!("F16 rows of {cols}, {kernel:?}"));
            }
        }
    });
}

/// A product of a kernel that takes no f16 copies, given one (of zeros)
/// beside its f32 rows, reads the rows (a few tiles: CPU rasterisers run it).
fn reads_the_f32_rows_beside_a_copy(gpu: &Gpu, gemm: &Gemm, rng: &mut Rng, format: WeightFormat, what: &str) {
    let (rows, tokens, cols) = (130, 70, 256);
    let (weight, values) = random_weight(gpu, rng, format, rows, cols);
    let x = rng.vec(tokens * cols, 1.0 / 32.0);
    let xb = gpu.storage_buffer_init("x", &x);
    let x16 = gpu.storage_buffer_bytes("x16", (tokens * cols * 2) as u64).unwrap();
    let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
    let step = step_buffer(gpu, 0, tokens, 1);
    let half = HalfCopies { x: Some(&x16), y: None };
    let d = gemm.plan_apart(gpu, &weight, Epilogue::Plain, tokens, &step, &xb, (&yb, None), half).unwrap();
    run(gpu, &d, tokens as u32);
    let want: Vec<f32> = x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
    let tolerance = product_tolerance(gemm.kernel(), &values, &x, rows, cols);
    assert_close(
        &gpu.read_buffer(&yb, want.len()).unwrap(),
        &want,
        tolerance,
        &format!("{what} beside a copy"),
    );
}

/// A product with too few of the tiles that read f16 copies runs, on
/// cooperative matrices in f16, as partial sums over ranges of k
/// (`Gemm::plan_summed`, for the residual add to sum) that add up to it:
/// bf16, and Q8_0, Q4_K and Q6_K (whose blocks each range holds whole),
/// with ragged row and token tiles. Every other kernel writes the whole
/// product as one part.
#[test]
fn products_of_few_tiles_sum_partial_products_over_k() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(19);
        let chosen_tiles = Gemm::kernels(gpu)
            .into_iter()
            .filter(|k| !matches!(k, GemmKernel::Cooperative { tile: Some(_), .. }));
        for kernel in chosen_tiles {
            let gemm = Gemm::with_kernel(gpu, kernel).unwrap();
            let splits = matches!(kernel, GemmKernel::Cooperative { split: false, .. });
            // 8 x 4 tiles of 256 rows and 128 tokens: three ranges of 512
            // columns; elsewhere a product of a few tiles.
            let (rows, tokens, cols) = if splits { (2000, 500, 1536) } else { (130, 70, 512) };
            let x: Vec<f32> =
                rng.vec(tokens * cols, 1.0 / 32.0).iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            let xb = gpu.storage_buffer_init("x", &x);
            let xb16 = gpu.storage_buffer_bytes("x16", (tokens * cols * 2) as u64).unwrap();
            gpu.queue.write_buffer(&xb16, 0, bytemuck::cast_slice(&common::f16_bits(&x)));
            let step = step_buffer(gpu, 0, tokens, 1);
            for format in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
                let (weight, values) = random_weight(gpu, &mut rng, format, rows, cols);
                let what = format!("{format} {kernel:?}");
                let parts_wanted = if splits && gemm.takes_half_copies(&weight) { 3 } else { 1 };
                let yb = gpu.storage_buffer("y", tokens * parts_wanted * rows).unwrap();
                let (d, parts) =
                    gemm.plan_summed(gpu, &weight, tokens, &step, (&xb, Some(&xb16)), &yb).unwrap();
                assert_eq!(parts, parts_wanted, "{what}");
                run(gpu, &d, tokens as u32);
                let y: Vec<f32> = gpu.read_buffer(&yb, tokens * parts * rows).unwrap();
                let summed: Vec<f32> = (0..tokens * rows)
                    .map(|e| (0..parts).map(|j| y[((e / rows) * parts + j) * rows + e % rows]).sum())
                    .collect();
                let want: Vec<f32> =
                    x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
                let tolerance = product_tolerance(kernel, &values, &x, rows, cols);
                assert_close(&summed, &want, tolerance, &format!("{what}, {parts} parts"));
            }
        }
    });
}

/// A batch's decode steps (products over at most `FEW_TOKENS` tokens) run
/// in tiles of their own, the products a residual add sums as partial
/// sums over ranges of k: for 1 to 64 tokens (ragged token and row
/// tiles), bf16, Q8_0, Q4_K and Q6_K, plain, summed and gated, against the
/// CPU. Runs where the adapter has cooperative matrices.
#[test]
fn products_over_few_tokens_run_in_their_own_tiles_and_ranges_of_k() {
    use wgspark::kernels::gemm_coop::{FEW_TOKENS, MAX_FEW_TOKEN_K_SPLITS, Tile};
    on_each_backend(|gpu| {
        if !gpu.caps.cooperative_matrix {
            return;
        }
        let mut rng = Rng::new(23);
        let gemm = Gemm::with_kernel(gpu, GemmKernel::Cooperative { split: false, tile: None }).unwrap();
        let (rows, cols) = (1000, 2048);
        let mut split_seen = false;
        for tokens in [1, 5, 16, 33, FEW_TOKENS] {
            let x = rng.vec(tokens * cols, 1.0 / 32.0);
            let xb = gpu.storage_buffer_init("x", &x);
            let step = step_buffer(gpu, 0, tokens, 1);
            for format in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
                let (weight, values) = random_weight(gpu, &mut rng, format, rows, cols);
                let what = format!("{format}, {tokens} tokens");
                let flags = wgspark::kernels::gemm_coop::flags(gpu, format, false);
                let (_, splits) =
                    Tile::few_tokens(rows, cols, tokens, &flags, MAX_FEW_TOKEN_K_SPLITS).unwrap();
                let yb = gpu.storage_buffer("y", tokens * splits * rows).unwrap();
                let (d, parts) = gemm.plan_summed(gpu, &weight, tokens, &step, (&xb, None), &yb).unwrap();
                assert_eq!(parts, splits, "{what}");
                split_seen |= parts > 1;
                run(gpu, &d, tokens as u32);
                let y: Vec<f32> = gpu.read_buffer(&yb, tokens * parts * rows).unwrap();
                let summed: Vec<f32> = (0..tokens * rows)
                    .map(|e| (0..parts).map(|j| y[((e / rows) * parts + j) * rows + e % rows]).sum())
                    .collect();
                let want: Vec<f32> =
                    x.chunks_exact(cols).flat_map(|x| reference::gemv(&values, rows, cols, x)).collect();
                let tolerance = product_tolerance(gemm.kernel(), &values, &x, rows, cols);
                assert_close(&summed, &want, tolerance, &format!("{what}, {parts} parts"));

                let plain = gemm.plan(gpu, &weight, Epilogue::Plain, tokens, &step, &xb, &yb).unwrap();
                run(gpu, &plain, tokens as u32);
                assert_close(&gpu.read_buffer(&yb, tokens * rows).unwrap(), &want, tolerance, &what);

                let gated = gemm.plan(gpu, &weight, Epilogue::Swiglu, tokens, &step, &xb, &yb).unwrap();
                run(gpu, &gated, tokens as u32);
                // An error e in the gate and up moves silu(g) u by at most
                // e (1.1 |u| + |silu(g)| + e) (silu's slope is under 1.1).
                let silu = |g: f32| g / (1.0 + (-g).exp());
                let got: Vec<f32> = gpu.read_buffer(&yb, tokens * rows / 2).unwrap();
                for (i, (got, pair)) in got.iter().zip(want.chunks_exact(2)).enumerate() {
                    let (g, u) = (pair[0], pair[1]);
                    let bound = tolerance * (1.1 * u.abs() + silu(g).abs() + tolerance);
                    let err = (got - silu(g) * u).abs();
                    assert!(err <= bound, "{what}, gated: output {i}: got {got}, want {}", silu(g) * u);
                }
            }
        }
        assert!(split_seen, "some product over few tokens splits k");
    });
}

/// A `rows` x `cols` tensor of f16 weights holding `values`.
fn upload_f16(gpu: &Gpu, values: &[f32], rows: usize, cols: usize) -> GpuTensor {
    let bytes: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let weight = GpuTensor::alloc_in(gpu, "w", WeightFormat::F16, rows, cols, 1).unwrap();
    weight.write_rows(gpu, 0, &WeightFormat::F16.to_gpu_layout(&bytes));
    weight
}

/// Formats other than bf16 are read four values at a time.
#[test]
fn a_width_that_is_not_whole_quads_is_a_typed_error() {
    on_each_backend(|gpu| {
        let weight = GpuTensor::alloc_in(gpu, "odd", WeightFormat::F32, 3, 6, 1).unwrap();
        let xb = gpu.storage_buffer("x", 6).unwrap();
        let yb = gpu.storage_buffer("y", 3).unwrap();
        let err = Gemv::new(gpu).plan(gpu, &GemvSpec::plain(&weight, &xb, &yb)).unwrap_err();
        assert!(matches!(err, wgspark::Error::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains("odd"), "names the tensor: {err}");
    });
}

/// A projection whose last rows are a part in another format (a Q4_K_M
/// file's Q6_K value rows after Q4_K queries and keys) writes those rows
/// to a buffer of their own, in rows of their own width, when asked: the
/// GEMV (normed, as the q/k/v projection runs) and every GEMM kernel.
#[test]
fn rows_apart_go_to_their_own_buffer() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(13);
        let (head, tail, cols, tokens) = (6, 4, 512, 3);
        let rows = head + tail;
        let segments = [(WeightFormat::Q4K, head), (WeightFormat::Q6K, tail)];
        let weight = GpuTensor::alloc_stacked(gpu, "qkv", &segments, cols, 1).unwrap();
        let mut values = Vec::new();
        let mut first = 0;
        for (format, n) in segments {
            let bytes = random_blocks(&mut rng, format, n, cols);
            weight.write_rows(gpu, first, &format.to_gpu_layout(&bytes));
            values.extend(format.dequantize(&bytes, cols));
            first += n;
        }
        assert_eq!(weight.parts.iter().map(|p| p.first_row).collect::<Vec<_>>(), [0, head]);
        let x = rng.vec(tokens * cols, 1.0);
        let xb = gpu.storage_buffer_init("x", &x);
        // Rows of `width` outputs from `first` of each token's product, as
        // `products` rounds x.
        let expect = |products: &dyn Fn(&[f32]) -> Vec<f32>, first: usize, width: usize| -> Vec<f32> {
            (0..tokens)
                .flat_map(|t| products(&x[t * cols..(t + 1) * cols])[first..first + width].to_vec())
                .collect()
        };
        let tol = 1e-5 * (cols as f32).sqrt();

        let norm: Vec<f32> = common::bf16_round(&rng.vec(cols, 1.0));
        let norm_t = GpuTensor::vector_f32(gpu, "norm", &norm).unwrap();
        let gemv = Gemv::new(gpu);
        let int8 = gemv.shape.int8;
        let normed = |x: &[f32]| {
            let h = reference::rms_norm(x, &norm, 1e-5);
            let h = if int8 { reference::int8_activations(&h) } else { h };
            reference::gemv(&values, rows, cols, &h)
        };
        let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
        let tail_b = gpu.storage_buffer("tail", tokens * tail).unwrap();
        let spec = GemvSpec {
            input: Input::RmsNorm { weight: &norm_t, eps: 1e-5 },
            rows: Rows::DenseApart { from_row: head, tail: &tail_b },
            ..GemvSpec::plain(&weight, &xb, &yb)
        };
        run(gpu, &gemv.plan(gpu, &spec).unwrap(), tokens as u32);
        let y = gpu.read_buffer(&yb, tokens * rows).unwrap();
        let y_head: Vec<f32> = y.chunks_exact(rows).flat_map(|r| r[..head].to_vec()).collect();
        assert_close(&y_head, &expect(&normed, 0, head), tol, "gemv rows before");
        let got = gpu.read_buffer(&tail_b, tokens * tail).unwrap();
        assert_close(&got, &expect(&normed, head, tail), tol, "gemv rows apart");

        let step = step_buffer(gpu, 0, tokens, 1);
        let plain = |x: &[f32]| reference::gemv(&values, rows, cols, x);
        for kernel in Gemm::kernels(gpu) {
            let gemm = Gemm::with_kernel(gpu, kernel).unwrap();
            let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
            let tail_b = gpu.storage_buffer("tail", tokens * tail).unwrap();
            let plan = gemm.plan_apart(
                gpu,
                &weight,
                Epilogue::Plain,
                tokens,
                &step,
                &xb,
                (&yb, Some((head, &tail_b))),
                HalfCopies::default(),
            );
            run(gpu, &plan.unwrap(), tokens as u32);
            // As in gemm_in_every_format_matches_the_cpu_product_of_its_values.
            let largest = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let tol = (4.0 * kernel.activation_rounding() * largest * (cols as f32).sqrt()).max(tol);
            let y = gpu.read_buffer(&yb, tokens * rows).unwrap();
            let y_head: Vec<f32> = y.chunks_exact(rows).flat_map(|r| r[..head].to_vec()).collect();
            assert_close(&y_head, &expect(&plain, 0, head), tol, &format!("{kernel:?} rows before"));
            let got = gpu.read_buffer(&tail_b, tokens * tail).unwrap();
            assert_close(&got, &expect(&plain, head, tail), tol, &format!("{kernel:?} rows apart"));

            // As a few-token step runs it: partial sums over ranges of k
            // (where the kernel splits it: the cooperative one, in 2), then
            // their sums, the rows apart into their own buffer.
            let parts_b = gpu.storage_buffer("parts", tokens * 2 * rows).unwrap();
            let (mut d, parts) =
                gemm.plan_summed(gpu, &weight, tokens, &step, (&xb, None), &parts_b).unwrap();
            assert!(parts <= 2, "{kernel:?}: {parts} parts");
            let (yb, tail_b) = (
                gpu.storage_buffer("y", tokens * rows).unwrap(),
                gpu.storage_buffer("tail", tokens * tail).unwrap(),
            );
            d.push(
                split_sum::plan(gpu, rows, Epilogue::Plain, (&parts_b, parts), (&yb, Some((head, &tail_b))))
                    .unwrap(),
            );
            run(gpu, &d, tokens as u32);
            let y = gpu.read_buffer(&yb, tokens * rows).unwrap();
            let y_head: Vec<f32> = y.chunks_exact(rows).flat_map(|r| r[..head].to_vec()).collect();
            let what = format!("{kernel:?} in {parts} ranges of k");
            assert_close(&y_head, &expect(&plain, 0, head), tol, &format!("{what}: rows before"));
            let got = gpu.read_buffer(&tail_b, tokens * tail).unwrap();
            assert_close(&got, &expect(&plain, head, tail), tol, &format!("{what}: rows apart"));
        }
    });
}

/// Streamed experts arrive after their slots' products are planned: the
/// slots of a format whose values may pass f16's range (the MXFP4 fixture's
/// experts) go to the f32 GEMM whatever they will hold, and slots of other
/// formats (Q4_K) stay on the cooperative one.
#[test]
fn streamed_expert_slots_beyond_f16_are_marked_for_the_f32_gemm() {
    use wgspark::model::layers::FfnWeights;
    use wgspark::{LoadOptions, Model};
    let gpu = common::gpu(common::backends()[0]);
    for (fixture, format, marked) in [
        ("gguf_qwen3moe_mxfp4", WeightFormat::MXFP4, true),
        ("gguf_qwen3moe_q4_k_m", WeightFormat::Q4K, false),
    ] {
        let dir = common::checkpoint::fixture_dir(fixture);
        let top_k = Model::load(&dir, &gpu).unwrap().config.moe.as_ref().unwrap().top_k;
        let options = LoadOptions { expert_slots: Some(top_k), ..LoadOptions::default() };
        let model = Model::load_with(&dir, &gpu, &options, |_| {}).unwrap();
        let mut slots = 0;
        for layer in &model.weights().layers {
            let FfnWeights::Moe(moe) = &layer.ffn else { continue };
            assert_eq!(
                moe.gate_up.rows,
                top_k * 2 * model.config.moe.as_ref().unwrap().intermediate,
                "{fixture}"
            );
            for part in [&moe.gate_up, &moe.down].iter().flat_map(|t| &t.parts).filter(|p| p.format == format)
            {
                assert_eq!(part.beyond_f16, marked, "{fixture}: slots marked");
                slots += 1;
            }
        }
        assert!(slots > 0, "{fixture}: streamed {format} slots checked");
    }
}
