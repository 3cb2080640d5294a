//! Every kernel against its CPU f32 reference on random data, on every
//! backend under test, with sizes that are not multiples of the workgroup.

mod common;

use common::{Rng, assert_close, bf16_bytes, bf16_round, on_each_backend, reference, run, step_buffer};
use wgspark::gpu::{Gpu, GpuOptions, GpuTensor};
use wgspark::kernels::attention::{
    AttentionBindings, AttentionShape, CoopLayout, LaneLayout, PagedRow, PagedRows, PagedSplits,
    QkNormWeights, SplitScratch,
};
use wgspark::kernels::bias_act::{Activation, BiasAct};
use wgspark::kernels::gemm::{AfterBias, Bias, Epilogue, GroupedBuffers, PrefillPrecision};
use wgspark::kernels::gemv::{GemvShape, GemvSpec, Input, Output, Rows as GemvRows};
use wgspark::kernels::group_by_expert::GroupBuffers;
use wgspark::kernels::residual::{CaptureTarget, LayerOutput};
use wgspark::kernels::rms_norm::Rows;
use wgspark::kernels::router::RouterBindings;
use wgspark::kernels::sample::{SampleBindings, SampleScratch};
use wgspark::kernels::split_sum;
use wgspark::kernels::{
    Attention, Embed, Gemm, Gemv, GroupByExpert, Residual, RmsNorm, Router, Sample, Step,
};
use wgspark::kv_cache::Heads;
use wgspark::model::{ExpertSelection, QkNorm};
use wgspark::model::{RopeConfig, RopeScaling};
use wgspark::{KvFormat, Sampling};

fn upload(gpu: &Gpu, name: &str, rows: usize, cols: usize, values: &[f32]) -> GpuTensor {
    let t = GpuTensor::alloc(gpu, name, rows, cols).unwrap();
    t.write_rows(gpu, 0, &bf16_bytes(values));
    t
}

fn check_gemv(gpu: &Gpu, gemv: &Gemv, rng: &mut Rng, rows: usize, cols: usize, tokens: usize) {
    let w = bf16_round(&rng.vec(rows * cols, 1.0));
    let x = rng.vec(tokens * cols, 1.0);
    let weight = upload(gpu, "w", rows, cols, &w);
    let xb = gpu.storage_buffer_init("x", &x);
    let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
    run(gpu, &gemv.plan(gpu, &GemvSpec::plain(&weight, &xb, &yb)).unwrap(), tokens as u32);
    let got: Vec<f32> = gpu.read_buffer(&yb, tokens * rows).unwrap();
    let want: Vec<f32> =
        (0..tokens).flat_map(|t| reference::gemv(&w, rows, cols, &x[t * cols..(t + 1) * cols])).collect();
    assert_close(&got, &want, 1e-5 * (cols as f32).sqrt(), &format!("gemv {rows}x{cols} x{tokens}"));
}

const GEMV_SIZES: &[(usize, usize, usize)] = &[(1, 2, 1), (37, 100, 1), (130, 258, 3), (65, 1030, 2)];

/// The GEMV shapes every fused test runs: one output per invocation, a
/// workgroup reduction, the adapter's own, and one on its subgroups.
fn gemv_shapes(gpu: &Gpu) -> Vec<GemvShape> {
    let mut shapes = vec![
        GemvShape { int8: false, ..GemvShape::ONE_PER_INVOCATION },
        GemvShape {
            rows_per_workgroup: 4,
            threads_per_row: 16,
            unroll: 3,
            norm_unroll: 2,
            sum_unroll: 3,
            units: true,
            int8: true,
            int8_rows_per_workgroup: 4,
            int8_workgroups: 2,
            spread_below: 0,
        },
        GemvShape::for_gpu(gpu),
    ];
    shapes.extend(GemvShape::on_subgroups(gpu));
    shapes
}

/// NVIDIA's and AMD's Vulkan drivers report the multiprocessors the chunk
/// GEMM sizes its tiles by (an NVIDIA H200: 132); other backends report none
/// (CPU rasterisers included), and those kernels then take their default
/// sizes.
#[test]
fn the_multiprocessor_count_comes_from_the_vulkan_drivers_that_report_it() {
    const NVIDIA: u32 = 0x10de;
    const AMD: u32 = 0x1002;
    on_each_backend(|gpu| {
        let vulkan = gpu.info.backend == wgpu::Backend::Vulkan;
        let nvidia_driver = gpu.info.vendor == NVIDIA && gpu.info.driver == "NVIDIA";
        let reports = vulkan && (nvidia_driver || gpu.info.vendor == AMD);
        match gpu.caps.multiprocessors {
            Some(n) => assert!(vulkan && (1..=4096).contains(&n), "{}: {n}", gpu.describe()),
            None => assert!(!reports, "{}: no count", gpu.describe()),
        }
    });
}

#[test]
fn gemv_matches_cpu_in_every_shape() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(1);
        for shape in gemv_shapes(gpu) {
            let gemv = Gemv::with_shape(gpu, shape);
            for &(rows, cols, tokens) in GEMV_SIZES {
                check_gemv(gpu, &gemv, &mut rng, rows, cols, tokens);
            }
        }
    });
}

#[test]
fn gemv_and_embed_work_on_tensors_split_across_bindings() {
    for backend in common::backends() {
        // A 600-byte binding limit splits a 37 x 100 bf16 matrix (200-byte
        // rows) into 13 parts of 3 rows.
        let gpu =
            Gpu::new(&GpuOptions { backend, max_storage_binding: Some(600), ..Default::default() }).unwrap();
        let mut rng = Rng::new(2);
        let weight = upload(&gpu, "w", 37, 100, &bf16_round(&rng.vec(37 * 100, 1.0)));
        assert_eq!(weight.parts.len(), 13);
        let gemv = Gemv::new(&gpu);
        check_gemv(&gpu, &gemv, &mut rng, 37, 100, 2);
        check_embed(&gpu, &mut rng, 37, 100);
    }
}

/// The fused forms against their unfused references: the RMSNorm before
/// the product, the SwiGLU of interleaved gate/up rows after it, and the
/// residual add with steering and capture; on split tensors too.
#[test]
fn fused_gemv_matches_norm_then_product_then_gate_or_add() {
    for backend in common::backends() {
        for limit in [None, Some(1200)] {
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: limit, ..Default::default() }).unwrap();
            let mut rng = Rng::new(16);
            for shape in gemv_shapes(&gpu) {
                let gemv = Gemv::with_shape(&gpu, shape);
                for &(rows, cols, tokens) in &[(6, 8, 1), (38, 100, 2), (64, 264, 3), (10, 290, 1)] {
                    let what = format!("{rows}x{cols} x{tokens}, {shape:?}, binding limit {limit:?}");
                    let w = bf16_round(&rng.vec(rows * cols, 1.0));
                    let weight = GpuTensor::alloc_grouped(&gpu, "w", rows, cols, rows).unwrap();
                    weight.write_rows(&gpu, 0, &bf16_bytes(&w));
                    let nw = bf16_round(&rng.vec(cols, 1.5));
                    let norm = GpuTensor::vector_f32(&gpu, "norm", &nw).unwrap();
                    let x = rng.vec(tokens * cols, 2.0);
                    let xb = gpu.storage_buffer_init("x", &x);
                    let h: Vec<f32> = (0..tokens)
                        .flat_map(|t| reference::rms_norm(&x[t * cols..(t + 1) * cols], &nw, 1e-5))
                        .collect();
                    let product: Vec<f32> = (0..tokens)
                        .flat_map(|t| reference::gemv(&w, rows, cols, &h[t * cols..(t + 1) * cols]))
                        .collect();
                    let tol = 2e-5 * (cols as f32).sqrt();
                    let input = Input::RmsNorm { weight: &norm, eps: 1e-5 };

                    let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
                    run(
                        &gpu,
                        &gemv.plan(&gpu, &GemvSpec { input, ..GemvSpec::plain(&weight, &xb, &yb) }).unwrap(),
                        tokens as u32,
                    );
                    assert_close(
                        &gpu.read_buffer(&yb, product.len()).unwrap(),
                        &product,
                        tol,
                        &format!("norm {what}"),
                    );

                    // Rows 2i and 2i + 1 are the gate and up rows of output i.
                    let act = gpu.storage_buffer("act", tokens * rows / 2).unwrap();
                    let spec =
                        GemvSpec { input, output: Output::Swiglu, ..GemvSpec::plain(&weight, &xb, &act) };
                    run(&gpu, &gemv.plan(&gpu, &spec).unwrap(), tokens as u32);
                    let gated: Vec<f32> =
                        product.chunks_exact(2).map(|gu| reference::silu(gu[0]) * gu[1]).collect();
                    assert_close(
                        &gpu.read_buffer(&act, gated.len()).unwrap(),
                        &gated,
                        tol,
                        &format!("swiglu {what}"),
                    );

                    // y = layer_output(y + W a): a residual of `rows` per token.
                    let resid = rng.vec(tokens * rows, 1.0);
                    let steer = rng.vec(rows, 1.0);
                    let (rb, sb) =
                        (gpu.storage_buffer_init("resid", &resid), gpu.storage_buffer_init("steer", &steer));
                    let capture = gpu.storage_buffer("capture", 2 * rows).unwrap();
                    let step = step_buffer(&gpu, 0, tokens, 1);
                    let region = capture.as_entire_buffer_binding();
                    let output = LayerOutput {
                        steer: Some(&sb),
                        steer_slots: None,
                        capture: Some(CaptureTarget { region, rows: 2, step: &step }),
                    };
                    let spec = GemvSpec { output: Output::Add(output), ..GemvSpec::plain(&weight, &xb, &rb) };
                    run(&gpu, &gemv.plan(&gpu, &spec).unwrap(), tokens as u32);
                    let plain: Vec<f32> = (0..tokens)
                        .flat_map(|t| reference::gemv(&w, rows, cols, &x[t * cols..(t + 1) * cols]))
                        .collect();
                    let added: Vec<f32> =
                        (0..tokens * rows).map(|e| resid[e] + plain[e] + steer[e % rows]).collect();
                    assert_close(
                        &gpu.read_buffer(&rb, added.len()).unwrap(),
                        &added,
                        tol,
                        &format!("add {what}"),
                    );
                    let kept = tokens.min(2);
                    let got: Vec<f32> = gpu.read_buffer(&capture, kept * rows).unwrap();
                    assert_close(&got, &added[(tokens - kept) * rows..], tol, &format!("capture {what}"));
                }
            }
        }
    }
}

/// Experts chosen on the GPU: every slot's gate/up + SwiGLU in one
/// dispatch, and the router-weighted sum of their down projections added
/// to the residual in another, with experts straddling binding parts.
#[test]
fn expert_gemv_runs_every_slot_and_sums_them_across_split_parts() {
    for backend in common::backends() {
        for limit in [None, Some(1000)] {
            // 1000-byte bindings: 5 rows of 100 bf16 per part, so experts of
            // 8 or 7 rows straddle part boundaries.
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: limit, ..Default::default() }).unwrap();
            let gemv = Gemv::new(&gpu);
            let mut rng = Rng::new(10);
            let (experts, inter, hidden, k, tokens) = (6, 4, 100, 3, 2);
            let ids: Vec<u32> = vec![5, 0, 3, 2, 1, 4];
            let route_w = rng.vec(tokens * k, 1.0);
            let (idb, rwb) = (gpu.storage_buffer_init("ids", &ids), gpu.storage_buffer_init("w", &route_w));
            let what = format!("binding limit {limit:?}");

            // gate/up: [experts * 2 inter, hidden], interleaved per expert.
            let gu = bf16_round(&rng.vec(experts * 2 * inter * hidden, 1.0));
            let gate_up =
                GpuTensor::alloc_grouped(&gpu, "gate_up", experts * 2 * inter, hidden, 2 * inter).unwrap();
            gate_up.write_rows(&gpu, 0, &bf16_bytes(&gu));
            let nw = bf16_round(&rng.vec(hidden, 1.5));
            let norm = GpuTensor::vector_f32(&gpu, "norm", &nw).unwrap();
            let x = rng.vec(tokens * hidden, 1.0);
            let xb = gpu.storage_buffer_init("x", &x);
            let act = gpu.storage_buffer("act", tokens * k * inter).unwrap();
            let spec = GemvSpec {
                input: Input::RmsNorm { weight: &norm, eps: 1e-5 },
                output: Output::Swiglu,
                rows: GemvRows::Slots { ids: &idb, top_k: k, expert_rows: 2 * inter },
                ..GemvSpec::plain(&gate_up, &xb, &act)
            };
            run(&gpu, &gemv.plan(&gpu, &spec).unwrap(), tokens as u32);
            let mut want_act = Vec::new();
            for t in 0..tokens {
                let h = reference::rms_norm(&x[t * hidden..(t + 1) * hidden], &nw, 1e-5);
                for j in 0..k {
                    let e = ids[t * k + j] as usize;
                    let rows = &gu[e * 2 * inter * hidden..(e + 1) * 2 * inter * hidden];
                    let y = reference::gemv(rows, 2 * inter, hidden, &h);
                    want_act.extend(y.chunks_exact(2).map(|p| reference::silu(p[0]) * p[1]));
                }
            }
            let got_act: Vec<f32> = gpu.read_buffer(&act, want_act.len()).unwrap();
            assert_close(&got_act, &want_act, 1e-4, &format!("expert gate/up, {what}"));

            // down: [experts * hidden', inter'] with inter' = 100 columns so
            // that its parts split too; inputs per (token, slot).
            let (rows, cols) = (7, 100);
            let dw = bf16_round(&rng.vec(experts * rows * cols, 1.0));
            let down = GpuTensor::alloc_grouped(&gpu, "down", experts * rows, cols, rows).unwrap();
            down.write_rows(&gpu, 0, &bf16_bytes(&dw));
            let a = rng.vec(tokens * k * cols, 1.0);
            let ab = gpu.storage_buffer_init("a", &a);
            let resid = rng.vec(tokens * rows, 1.0);
            let rb = gpu.storage_buffer_init("resid", &resid);
            let spec = GemvSpec {
                output: Output::Add(LayerOutput::default()),
                rows: GemvRows::Sum { ids: &idb, weights: &rwb, top_k: k, expert_rows: rows },
                ..GemvSpec::plain(&down, &ab, &rb)
            };
            run(&gpu, &gemv.plan(&gpu, &spec).unwrap(), tokens as u32);
            let mut want = resid.clone();
            for t in 0..tokens {
                for j in 0..k {
                    let e = ids[t * k + j] as usize;
                    let y = reference::gemv(
                        &dw[e * rows * cols..(e + 1) * rows * cols],
                        rows,
                        cols,
                        &a[(t * k + j) * cols..(t * k + j + 1) * cols],
                    );
                    for (o, v) in y.iter().enumerate() {
                        want[t * rows + o] += route_w[t * k + j] * v;
                    }
                }
            }
            assert_close(
                &gpu.read_buffer(&rb, want.len()).unwrap(),
                &want,
                1e-4,
                &format!("expert down sum, {what}"),
            );
        }
    }
}

fn check_embed(gpu: &Gpu, rng: &mut Rng, vocab: usize, hidden: usize) {
    let table = bf16_round(&rng.vec(vocab * hidden, 1.0));
    let t = upload(gpu, "table", vocab, hidden, &table);
    let tokens: Vec<u32> = vec![0, vocab as u32 - 1, rng.below(vocab as u32), 5];
    let tb = gpu.storage_buffer_init("tokens", &tokens);
    let xb = gpu.storage_buffer("x", tokens.len() * hidden).unwrap();
    let embed = Embed::new(gpu).unwrap();
    run(gpu, &embed.plan(gpu, &t, &tb, &xb).unwrap(), tokens.len() as u32);
    let got: Vec<f32> = gpu.read_buffer(&xb, tokens.len() * hidden).unwrap();
    let want: Vec<f32> = tokens
        .iter()
        .flat_map(|&id| table[id as usize * hidden..(id as usize + 1) * hidden].to_vec())
        .collect();
    assert_eq!(got, want, "embedding rows are copied exactly");
}

#[test]
fn embed_copies_rows_exactly() {
    on_each_backend(|gpu| check_embed(gpu, &mut Rng::new(3), 50, 70));
}

#[test]
fn rms_norm_matches_cpu_for_vectors_heads_and_whole_projections() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(4);
        let norm = RmsNorm::new(gpu).unwrap();
        let eps = 1e-5;
        // A token row of width 3 * 10 + 7: heads of 10 at offset 7.
        for (rows, tokens) in [
            (Rows::vector(100), 3),
            (Rows { n: 10, heads: 3, head_stride: 10, token_stride: 37, offset: 7 }, 2),
            (Rows { n: 30, heads: 1, head_stride: 0, token_stride: 37, offset: 7 }, 2),
            (Rows::vector(1030), 1),
        ] {
            let width = rows.token_stride;
            let x: Vec<f32> = rng.vec(tokens * width, 2.0);
            let w = bf16_round(&rng.vec(rows.n, 1.5));
            let wt = GpuTensor::vector_f32(gpu, "w", &w).unwrap();
            let xb = gpu.storage_buffer_init("x", &x);
            let ob = gpu.storage_buffer_init("out", &vec![0.0f32; x.len()]);
            run(gpu, &[norm.plan(gpu, &wt, eps, &xb, &ob, rows)], tokens as u32);
            // In place on a copy of x: untouched elements must survive.
            let inplace = gpu.storage_buffer_init("x2", &x);
            run(gpu, &[norm.plan(gpu, &wt, eps, &inplace, &inplace, rows)], tokens as u32);

            let mut want = vec![0.0f32; x.len()];
            let mut want_inplace = x.clone();
            for t in 0..tokens {
                for h in 0..rows.heads {
                    let start = rows.offset + t * rows.token_stride + h * rows.head_stride;
                    let r = reference::rms_norm(&x[start..start + rows.n], &w, eps);
                    want[start..start + rows.n].copy_from_slice(&r);
                    want_inplace[start..start + rows.n].copy_from_slice(&r);
                }
            }
            let what = format!("rms_norm {rows:?}");
            assert_close(&gpu.read_buffer(&ob, x.len()).unwrap(), &want, 1e-5, &what);
            assert_close(&gpu.read_buffer(&inplace, x.len()).unwrap(), &want_inplace, 1e-5, &what);
        }
    });
}

/// A K or V cache (rows of positions) as the kernels store it.
fn cache_words(rows: &[Vec<f32>], format: KvFormat) -> Vec<u32> {
    let values: Vec<f32> = rows.concat();
    match format {
        KvFormat::F32 => values.iter().map(|x| x.to_bits()).collect(),
        KvFormat::F16 => values
            .chunks_exact(2)
            .map(|p| {
                let lo = half::f16::from_f32(p[0]).to_bits() as u32;
                let hi = half::f16::from_f32(p[1]).to_bits() as u32;
                lo | hi << 16
            })
            .collect(),
    }
}

fn cache_values(words: &[u32], format: KvFormat) -> Vec<f32> {
    match format {
        KvFormat::F32 => words.iter().map(|&w| f32::from_bits(w)).collect(),
        KvFormat::F16 => words
            .iter()
            .flat_map(|&w| {
                [half::f16::from_bits(w as u16).to_f32(), half::f16::from_bits((w >> 16) as u16).to_f32()]
            })
            .collect(),
    }
}

/// q/k norm, RoPE, the cache store and attention, for a chunk (rope_store,
/// then attend) and for one token (attend_lanes, or attend without
/// subgroups, split over the keys, then combine): outputs and stored K/V
/// against the CPU, in both cache formats, the value rows in qkv or in a
/// buffer of their own; a chunk on cooperative matrices in f16 also writes
/// its rows as f16 (the f32 rows rounded) where asked, and elsewhere asking
/// is a typed error.
#[test]
fn attention_matches_cpu_across_norms_rotations_windows_splits_and_formats() {
    on_each_backend(|gpu| {
        check_attention(gpu);
        // The f16 cache as adapters without pack2x16float store it: the
        // conversions in integer arithmetic.
        let mut emulated = gpu.clone();
        emulated.caps.f16_in_f32 = false;
        check_attention(&emulated);
        // One token on the tiled kernel, as adapters without subgroups run it.
        if gpu.caps.subgroups {
            let mut tiled = gpu.clone();
            tiled.caps.subgroups = false;
            check_attention(&tiled);
        }
    });
}

fn check_attention(gpu: &Gpu) {
    let mut rng = Rng::new(6);
    // The default kernels, then the chunk attention in each other layout
    // the device has memory for.
    let attentions: Vec<Attention> = std::iter::once(Attention::new(gpu))
        .chain(CoopLayout::fitting(gpu).skip(1).map(|l| Attention::with_coop_layout(gpu, l)))
        .collect();
    use KvFormat::{F16, F32};
    use QkNorm::{None as NoNorm, PerHead, WholeProjection};
    // (heads, context, first position, tokens, window, key splits, q/k norm, rotary dims, format,
    // growth of the keys' scale with their position)
    for (case, (heads, ctx, pos0, tokens, window, splits, norm, rot, format, growth, all_keys)) in [
        (Heads { q: 4, kv: 2, dim: 12 }, 150, 0, 1, 0, 1, NoNorm, 12, F32, 0.0, false),
        (Heads { q: 4, kv: 2, dim: 12 }, 150, 70, 2, 0, 1, PerHead, 6, F16, 0.0, false),
        (Heads { q: 6, kv: 1, dim: 130 }, 200, 140, 1, 0, 7, WholeProjection, 130, F16, 0.0, false),
        (Heads { q: 2, kv: 2, dim: 256 }, 20, 9, 1, 0, 3, PerHead, 256, F32, 0.0, false),
        (Heads { q: 16, kv: 1, dim: 128 }, 300, 290, 1, 0, 64, NoNorm, 128, F16, 0.0, false),
        (Heads { q: 4, kv: 4, dim: 8 }, 150, 100, 3, 37, 1, NoNorm, 8, F32, 0.0, false),
        (Heads { q: 4, kv: 4, dim: 8 }, 150, 100, 1, 37, 5, WholeProjection, 8, F16, 0.0, false),
        (Heads { q: 9, kv: 3, dim: 64 }, 300, 200, 1, 0, 4, NoNorm, 40, F32, 0.0, false),
        (Heads { q: 8, kv: 2, dim: 64 }, 600, 0, 520, 0, 1, PerHead, 64, F16, 0.0, false),
        // Chunks as the cooperative-matrix kernel takes them where the
        // device has one (groups of 4, 8 and 1, a window, partial blocks of
        // rows and keys; keys whose scale grows, so that the running maximum
        // moves far past its reference), and a group of 3, which it leaves
        // to the tiled kernel.
        (Heads { q: 32, kv: 8, dim: 128 }, 300, 37, 200, 0, 1, NoNorm, 128, F16, 0.0, false),
        (Heads { q: 16, kv: 2, dim: 128 }, 200, 10, 90, 50, 1, WholeProjection, 64, F16, 0.0, false),
        (Heads { q: 4, kv: 4, dim: 32 }, 300, 100, 150, 0, 1, NoNorm, 32, F16, 40.0, false),
        (Heads { q: 6, kv: 2, dim: 64 }, 100, 20, 40, 0, 1, NoNorm, 64, F16, 0.0, false),
        // Model-sized heads: the lanes' shares of a row, row blocks and
        // keys that end mid-pass.
        (Heads { q: 32, kv: 8, dim: 128 }, 700, 650, 1, 0, 4, NoNorm, 128, F16, 0.0, false),
        (Heads { q: 32, kv: 2, dim: 128 }, 400, 333, 1, 0, 2, PerHead, 128, F16, 0.0, false),
        (Heads { q: 12, kv: 2, dim: 128 }, 300, 201, 1, 0, 1, NoNorm, 64, F32, 0.0, false),
        (Heads { q: 8, kv: 1, dim: 64 }, 90, 77, 1, 0, 1, NoNorm, 64, F16, 0.0, false),
        (Heads { q: 4, kv: 2, dim: 256 }, 100, 60, 1, 50, 3, WholeProjection, 128, F16, 0.0, false),
        // Heads of 8 lanes (what an 8-wide subgroup holds), a whole-
        // projection norm, a partial rotation and an f32 cache in a window.
        (Heads { q: 8, kv: 2, dim: 64 }, 300, 250, 1, 0, 3, WholeProjection, 64, F16, 0.0, false),
        (Heads { q: 6, kv: 2, dim: 64 }, 200, 150, 1, 0, 1, PerHead, 32, F16, 0.0, false),
        (Heads { q: 4, kv: 1, dim: 32 }, 100, 60, 1, 20, 2, NoNorm, 32, F32, 0.0, false),
        // Rows of 3 and 6 quads: lanes past the row hold zeros.
        (Heads { q: 6, kv: 2, dim: 24 }, 100, 80, 1, 0, 2, PerHead, 16, F16, 0.0, false),
        (Heads { q: 24, kv: 2, dim: 48 }, 200, 190, 1, 0, 3, NoNorm, 32, F16, 0.0, false),
        // Bidirectional (the vision tower's): every row sees the chunk's
        // keys, later ones too; heads of 72 as Qwen3-VL's tower has them.
        (Heads { q: 4, kv: 4, dim: 72 }, 64, 0, 64, 0, 1, NoNorm, 72, F32, 0.0, true),
        (Heads { q: 2, kv: 2, dim: 16 }, 100, 0, 37, 0, 1, NoNorm, 16, F32, 0.0, true),
        (Heads { q: 6, kv: 2, dim: 32 }, 90, 20, 50, 0, 1, NoNorm, 32, F16, 0.0, true),
        // Heads of 72 and 40 on cooperative matrices (whole runs of 8, the
        // last fragment half empty): the tower's, and causal chunks.
        (Heads { q: 4, kv: 4, dim: 72 }, 300, 0, 300, 0, 1, NoNorm, 72, F16, 0.0, true),
        (Heads { q: 8, kv: 2, dim: 72 }, 200, 30, 150, 0, 1, PerHead, 72, F16, 20.0, false),
        (Heads { q: 4, kv: 4, dim: 40 }, 120, 0, 100, 0, 1, NoNorm, 40, F16, 0.0, false),
    ]
    .into_iter()
    .enumerate()
    {
        let what = format!(
            "{heads:?} pos0 {pos0} x{tokens} window {window} splits {splits} {norm:?} rot {rot} {format:?} all keys {all_keys}"
        );
        let (hd, kvw, width) = (heads.dim, heads.kv_width(), heads.qkv_width());
        let rope = RopeConfig { theta: 10_000.0, rotary_dim: rot, scaling: RopeScaling::None };
        let inv_freq = rope.inv_freq();
        let eps = 1e-6;
        let (qn_len, kn_len) = match norm {
            WholeProjection => (heads.q * hd, kvw),
            _ => (hd, hd),
        };
        let (qn, kn) = (bf16_round(&rng.vec(qn_len, 1.5)), bf16_round(&rng.vec(kn_len, 1.5)));
        let (qn_t, kn_t) = (
            GpuTensor::vector_f32(gpu, "q_norm", &qn).unwrap(),
            GpuTensor::vector_f32(gpu, "k_norm", &kn).unwrap(),
        );
        let qkv = rng.vec(tokens * width, 1.0);
        let round = |v: Vec<f32>| if format == F16 { reference::f16_round(&v) } else { v };
        let scale_at = |j: usize| 1.0 + growth * j as f32 / ctx as f32;
        let mut k: Vec<Vec<f32>> = (0..ctx).map(|j| round(rng.vec(kvw, scale_at(j)))).collect();
        let mut v: Vec<Vec<f32>> = (0..ctx).map(|_| round(rng.vec(kvw, 1.0))).collect();
        let k_b = gpu.storage_buffer_init("k_cache", &cache_words(&k, format));
        let v_b = gpu.storage_buffer_init("v_cache", &cache_words(&v, format));

        // The reference: norm and rotate q and the new k, store k and v.
        let normed = |x: &[f32], w: &[f32]| match norm {
            NoNorm => x.to_vec(),
            _ => reference::rms_norm(x, w, eps),
        };
        let mut q_rot = vec![0.0f32; tokens * heads.q * hd];
        for t in 0..tokens {
            let pos = pos0 + t;
            let row = &qkv[t * width..(t + 1) * width];
            let (q_all, k_all) = (&row[..heads.q * hd], &row[heads.q * hd..(heads.q + heads.kv) * hd]);
            let (q_n, k_n) = match norm {
                WholeProjection => (normed(q_all, &qn), normed(k_all, &kn)),
                _ => (
                    q_all.chunks(hd).flat_map(|h| normed(h, &qn)).collect(),
                    k_all.chunks(hd).flat_map(|h| normed(h, &kn)).collect::<Vec<f32>>(),
                ),
            };
            for h in 0..heads.q {
                let r = reference::rope(&q_n[h * hd..(h + 1) * hd], pos, rot, &inv_freq);
                q_rot[(t * heads.q + h) * hd..(t * heads.q + h + 1) * hd].copy_from_slice(&r);
            }
            k[pos] = round(k_n.chunks(hd).flat_map(|h| reference::rope(h, pos, rot, &inv_freq)).collect());
            v[pos] = round(row[(heads.q + heads.kv) * hd..].to_vec());
        }
        let mut want = Vec::new();
        for t in 0..tokens {
            let pos = pos0 + t;
            let start = if window > 0 && pos + 1 > window { pos + 1 - window } else { 0 };
            let last = if all_keys { pos0 + tokens - 1 } else { pos };
            for h in 0..heads.q {
                let q = &q_rot[(t * heads.q + h) * hd..(t * heads.q + h + 1) * hd];
                let kv_head = h / heads.group();
                want.extend(reference::attention(
                    q,
                    &k[start..=last],
                    &v[start..=last],
                    kv_head,
                    (hd as f32).powf(-0.5),
                ));
            }
        }

        // Odd cases read their value rows from a buffer of their own (as a
        // projection writes them apart), their slots in qkv poisoned.
        let apart = case % 2 == 1;
        let first_value = (heads.q + heads.kv) * hd;
        let values: Vec<f32> = qkv.chunks(width).flat_map(|r| r[first_value..].to_vec()).collect();
        let poisoned: Vec<f32> = qkv
            .chunks(width)
            .flat_map(|r| r[..first_value].iter().copied().chain(std::iter::repeat_n(f32::NAN, kvw)))
            .collect();
        let qkv_b = gpu.storage_buffer_init("qkv", if apart { &poisoned } else { &qkv });
        let values_b = gpu.storage_buffer_init("values", &values);
        let cos_sin = gpu.storage_buffer_init("cos_sin", &rope.cos_sin_table(ctx));
        let out = gpu.storage_buffer("out", tokens * heads.q * hd).unwrap();
        let acc = gpu.storage_buffer("split_acc", heads.q * splits * hd).unwrap();
        let max_sum = gpu.storage_buffer("split_max_sum", heads.q * splits * 2).unwrap();
        let step = step_buffer(gpu, pos0, tokens, splits);
        let b = AttentionBindings {
            step: &step,
            qkv: &qkv_b,
            cos_sin: &cos_sin,
            k_cache: &k_b,
            v_cache: &v_b,
            out: &out,
            values: apart.then_some(&values_b),
            out16: None,
        };
        let out16 = gpu.storage_buffer_bytes("out16", (tokens * heads.q * hd * 2) as u64).unwrap();
        let what = format!("{what}, value rows apart {apart}");
        let tol = if format == F16 { 2e-3 } else { 1e-5 };
        // A chunk on cooperative matrices in both precisions and every
        // layout (each run stores the same keys).
        let layouts = attentions.iter().enumerate();
        for ((layout, attention), chunk_precision) in
            layouts.flat_map(|a| [(a, PrefillPrecision::Split), (a, PrefillPrecision::F16)])
        {
            let shape = AttentionShape {
                heads,
                rotary_dim: rot,
                scale: (hd as f32).powf(-0.5),
                window,
                qk_norm: (norm != NoNorm).then_some(QkNormWeights { mode: norm, q: &qn_t, k: &kn_t, eps }),
                kv_format: format,
                chunk_precision,
            };
            if tokens == 1 {
                let d = attention
                    .plan_decode(gpu, &shape, &b, &SplitScratch { acc: &acc, max_sum: &max_sum })
                    .unwrap();
                let mut encoder = gpu.device.create_command_encoder(&Default::default());
                d.encode(&mut encoder.begin_compute_pass(&Default::default()), splits as u32);
                gpu.queue.submit([encoder.finish()]);
            } else if all_keys {
                run(gpu, &attention.plan_bidirectional(gpu, &shape, &b).unwrap(), tokens as u32);
            } else if attention.chunk_writes_f16(&shape) {
                let b16 = AttentionBindings { out16: Some(&out16), ..b };
                run(gpu, &attention.plan_chunk(gpu, &shape, &b16).unwrap(), tokens as u32);
            } else {
                let with_copy =
                    attention.plan_chunk(gpu, &shape, &AttentionBindings { out16: Some(&out16), ..b });
                assert!(matches!(with_copy, Err(wgspark::Error::Unsupported { .. })), "f16 copy asked");
                run(gpu, &attention.plan_chunk(gpu, &shape, &b).unwrap(), tokens as u32);
            }
            let what = format!("attention {what} {chunk_precision:?} layout {layout}");
            let got = gpu.read_buffer(&out, want.len()).unwrap();
            assert_close(&got, &want, tol, &what);
            if tokens > 1 && !all_keys && attention.chunk_writes_f16(&shape) {
                assert_eq!(
                    common::read_f16(gpu, &out16, got.len()),
                    common::f16_bits(&got),
                    "{what}: f16 copy"
                );
            }
            if tokens == 1 || !attention.coop_fits(&shape) {
                break;
            }
        }
        let words = match format {
            F32 => ctx * kvw,
            F16 => ctx * kvw / 2,
        };
        let stored_k = cache_values(&gpu.read_buffer(&k_b, words).unwrap(), format);
        let stored_v = cache_values(&gpu.read_buffer(&v_b, words).unwrap(), format);
        for pos in pos0..pos0 + tokens {
            let row = pos * kvw..(pos + 1) * kvw;
            assert_close(&stored_k[row.clone()], &k[pos], tol, &format!("stored k at {pos}, {what}"));
            assert_close(&stored_v[row], &v[pos], tol, &format!("stored v at {pos}, {what}"));
        }
    }
}

/// A ragged batch over a paged cache: sequences of different lengths, each
/// adding a few rows (a prompt chunk) or one (a decode step, its keys split
/// into runs and merged), their positions in blocks scattered over the pool
/// by each sequence's block table: every row's attention over its own
/// sequence's keys, and the stored K/V, against the CPU; with splits and
/// without; decode rows on subgroup lanes also with each row's splits
/// walked by one workgroup, to the same bits. Where the adapter has
/// cooperative matrices, the prompt rows of the f16 cases whose decode rows run on subgroup lanes (split runs) go to
/// `attend_coop` (a window's rows from a key tile that starts before it).
#[test]
fn paged_attention_runs_each_row_over_its_own_sequence() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(61);
        use KvFormat::{F16, F32};
        use QkNorm::{None as NoNorm, PerHead, WholeProjection};
        // (heads, block size, window, q/k norm, rotary dims, format, value rows apart,
        // per sequence (positions already cached, rows added))
        // (positions already cached, rows added) of each sequence.
        type Sequences = &'static [(usize, usize)];
        type Case = (Heads, usize, usize, QkNorm, usize, KvFormat, bool, Sequences);
        let cases: [Case; 7] = [
            (Heads { q: 4, kv: 2, dim: 12 }, 4, 0, NoNorm, 12, F32, false, &[(0, 5), (9, 1), (3, 1)]),
            (
                Heads { q: 8, kv: 2, dim: 64 },
                16,
                0,
                PerHead,
                64,
                F16,
                true,
                &[(40, 1), (0, 20), (17, 1), (5, 3)],
            ),
            (
                Heads { q: 6, kv: 3, dim: 32 },
                8,
                10,
                WholeProjection,
                16,
                F16,
                false,
                &[(30, 1), (2, 12), (45, 8)],
            ),
            // One query head per KV head: a chunk's rows in tiles of as many
            // as 128 on cooperative matrices.
            (Heads { q: 4, kv: 4, dim: 64 }, 16, 0, NoNorm, 64, F16, false, &[(50, 1), (3, 140)]),
            (Heads { q: 32, kv: 8, dim: 128 }, 16, 0, NoNorm, 128, F16, false, &[(70, 1), (33, 1), (0, 9)]),
            (Heads { q: 2, kv: 1, dim: 256 }, 4, 0, PerHead, 128, F32, true, &[(6, 2), (1, 1)]),
            // Decode rows alone (attend_lanes runs them all where it can).
            (Heads { q: 8, kv: 2, dim: 64 }, 16, 0, NoNorm, 64, F16, false, &[(40, 1), (17, 1), (3, 1)]),
        ];
        for (heads, block, window, norm, rot, format, apart, seqs) in cases {
            let what = format!("{heads:?} block {block} window {window} {norm:?} rot {rot} {format:?}");
            let (hd, kvw, width) = (heads.dim, heads.kv_width(), heads.qkv_width());
            let rope = RopeConfig { theta: 10_000.0, rotary_dim: rot, scaling: RopeScaling::None };
            let inv_freq = rope.inv_freq();
            let eps = 1e-6;
            let (qn_len, kn_len) = if norm == WholeProjection { (heads.q * hd, kvw) } else { (hd, hd) };
            let (qn, kn) = (bf16_round(&rng.vec(qn_len, 1.5)), bf16_round(&rng.vec(kn_len, 1.5)));
            let qn_t = GpuTensor::vector_f32(gpu, "q_norm", &qn).unwrap();
            let kn_t = GpuTensor::vector_f32(gpu, "k_norm", &kn).unwrap();
            let round = |v: Vec<f32>| if format == F16 { reference::f16_round(&v) } else { v };
            // Every sequence's blocks, taken from the pool in a shuffled order.
            let blocks_of: Vec<usize> =
                seqs.iter().map(|&(cached, rows)| (cached + rows).div_ceil(block)).collect();
            let pool_blocks: usize = blocks_of.iter().sum::<usize>() + 3;
            let mut free: Vec<usize> = (0..pool_blocks).collect();
            for i in (1..free.len()).rev() {
                free.swap(i, rng.below(i as u32 + 1) as usize);
            }
            let mut table = Vec::new();
            let mut firsts = Vec::new();
            for &n in &blocks_of {
                firsts.push(table.len());
                table.extend(free.drain(..n).map(|b| b as u32));
            }
            let slot = |s: usize, j: usize| table[firsts[s] + j / block] as usize * block + j % block;
            // The pool's rows: the cached positions random, the rest poisoned.
            let mut k_pool = vec![vec![f32::NAN; kvw]; pool_blocks * block];
            let mut v_pool = k_pool.clone();
            let mut k_seq: Vec<Vec<Vec<f32>>> = Vec::new();
            let mut v_seq: Vec<Vec<Vec<f32>>> = Vec::new();
            for (s, &(cached, rows)) in seqs.iter().enumerate() {
                let k: Vec<Vec<f32>> = (0..cached + rows).map(|_| round(rng.vec(kvw, 1.0))).collect();
                let v: Vec<Vec<f32>> = (0..cached + rows).map(|_| round(rng.vec(kvw, 1.0))).collect();
                for j in 0..cached {
                    k_pool[slot(s, j)] = k[j].clone();
                    v_pool[slot(s, j)] = v[j].clone();
                }
                k_seq.push(k);
                v_seq.push(v);
            }
            // The step's rows, sequence by sequence; each row's metadata and angles.
            // Decode rows (a lone row after cached keys: it splits) first,
            // as the engine lays a step out.
            let mut meta: Vec<u32> = Vec::new();
            let mut row_of: Vec<(usize, usize)> = Vec::new();
            let decodes = |&(cached, rows): &(usize, usize)| rows == 1 && cached > 0;
            let mut slots = 0u32;
            for decode in [true, false] {
                for (s, seq) in seqs.iter().enumerate().filter(|(_, q)| decodes(q) == decode) {
                    for pos in seq.0..seq.0 + seq.1 {
                        let slot = if decode {
                            slots += 1;
                            slots - 1
                        } else {
                            u32::MAX
                        };
                        meta.extend([pos as u32, firsts[s] as u32, slot, 0]);
                        row_of.push((s, pos));
                    }
                }
            }
            let n = row_of.len();
            let table_rows = rope.cos_sin_table(row_of.iter().map(|r| r.1).max().unwrap() + 1);
            let per_row = 2 * (rot / 2);
            let cos_sin: Vec<f32> = row_of
                .iter()
                .flat_map(|&(_, pos)| table_rows[pos * per_row..(pos + 1) * per_row].to_vec())
                .collect();
            let qkv = rng.vec(n * width, 1.0);
            let normed = |x: &[f32], w: &[f32]| {
                if norm == NoNorm { x.to_vec() } else { reference::rms_norm(x, w, eps) }
            };
            let mut q_rot = vec![0.0f32; n * heads.q * hd];
            for (t, &(s, pos)) in row_of.iter().enumerate() {
                let row = &qkv[t * width..(t + 1) * width];
                let (q_all, k_all) = (&row[..heads.q * hd], &row[heads.q * hd..(heads.q + heads.kv) * hd]);
                let (q_n, k_n): (Vec<f32>, Vec<f32>) = match norm {
                    WholeProjection => (normed(q_all, &qn), normed(k_all, &kn)),
                    _ => (
                        q_all.chunks(hd).flat_map(|h| normed(h, &qn)).collect(),
                        k_all.chunks(hd).flat_map(|h| normed(h, &kn)).collect(),
                    ),
                };
                for h in 0..heads.q {
                    let r = reference::rope(&q_n[h * hd..(h + 1) * hd], pos, rot, &inv_freq);
                    q_rot[(t * heads.q + h) * hd..(t * heads.q + h + 1) * hd].copy_from_slice(&r);
                }
                k_seq[s][pos] =
                    round(k_n.chunks(hd).flat_map(|h| reference::rope(h, pos, rot, &inv_freq)).collect());
                v_seq[s][pos] = round(row[(heads.q + heads.kv) * hd..].to_vec());
            }
            let mut want = Vec::new();
            for (t, &(s, pos)) in row_of.iter().enumerate() {
                let start = if window > 0 && pos + 1 > window { pos + 1 - window } else { 0 };
                for h in 0..heads.q {
                    let q = &q_rot[(t * heads.q + h) * hd..(t * heads.q + h + 1) * hd];
                    let (k, v) = (&k_seq[s][start..=pos], &v_seq[s][start..=pos]);
                    want.extend(reference::attention(q, k, v, h / heads.group(), (hd as f32).powf(-0.5)));
                }
            }
            let first_value = (heads.q + heads.kv) * hd;
            let values: Vec<f32> = qkv.chunks(width).flat_map(|r| r[first_value..].to_vec()).collect();
            let qkv_b = gpu.storage_buffer_init("qkv", &qkv);
            let values_b = gpu.storage_buffer_init("values", &values);
            let k_b = gpu.storage_buffer_init("k_pool", &cache_words(&k_pool, format));
            let v_b = gpu.storage_buffer_init("v_pool", &cache_words(&v_pool, format));
            let cos_sin_b = gpu.storage_buffer_init("cos_sin", &cos_sin);
            let meta_b = gpu.storage_buffer_init("rows", &meta);
            let table_b = gpu.storage_buffer_init("block_table", &table);
            let out = gpu.storage_buffer("out", n * heads.q * hd).unwrap();
            let step = step_buffer(gpu, 0, n, 1);
            let b = AttentionBindings {
                step: &step,
                qkv: &qkv_b,
                cos_sin: &cos_sin_b,
                k_cache: &k_b,
                v_cache: &v_b,
                out: &out,
                values: apart.then_some(&values_b),
                out16: None,
            };
            let shape = AttentionShape {
                heads,
                rotary_dim: rot,
                scale: (hd as f32).powf(-0.5),
                window,
                qk_norm: (norm != NoNorm).then_some(QkNormWeights { mode: norm, q: &qn_t, k: &kn_t, eps }),
                kv_format: format,
                chunk_precision: PrefillPrecision::F16,
            };
            let max_splits = 8;
            let acc =
                gpu.storage_buffer("split_acc", slots.max(1) as usize * heads.q * max_splits * hd).unwrap();
            let max_sum = gpu
                .storage_buffer("split_max_sum", slots.max(1) as usize * heads.q * max_splits * 2)
                .unwrap();
            let tol = if format == F16 { 2e-3 } else { 1e-5 };
            // On cooperative matrices, the query rows in f16 and in two f16 parts.
            let split_q = AttentionShape { chunk_precision: PrefillPrecision::Split, ..shape };
            let shapes =
                if Attention::new(gpu).coop_fits(&shape) { vec![shape, split_q] } else { vec![shape] };
            // (Decode rows also one query row a workgroup, as benchmarks may
            // run them.)
            let runs = shapes.iter().flat_map(|s| {
                [
                    (s, 1, 1, None),
                    (s, 4, max_splits, None),
                    (s, 4, max_splits, Some(1)),
                    (s, 9, max_splits, None),
                ]
            });
            for (shape, split_keys, max_splits, lane_rows) in runs {
                let splits = PagedSplits { acc: &acc, max_sum: &max_sum, split_keys, max_splits };
                let paged = PagedRows { rows: &meta_b, block_table: &table_b, block_size: block, splits };
                let kernels = match lane_rows {
                    Some(rows) => Attention::new(gpu).with_lane_rows(rows),
                    None => Attention::new(gpu),
                };
                let attention = kernels.plan_paged(gpu, shape, &b, &paged).unwrap();
                // Decode rows run on subgroup lanes where the adapter's take a row.
                let lanes = LaneLayout::choose(gpu, heads, rot, format).is_some() && max_splits > 1;
                assert_eq!(attention.decode.is_some(), lanes, "{what}");
                // Rows of a sequence's chunk share tiles of attend.
                let paged_rows: Vec<PagedRow> = row_of
                    .iter()
                    .enumerate()
                    .map(|(t, &(s, pos))| PagedRow {
                        sequence: s,
                        position: pos,
                        decode: meta[4 * t + 2] != u32::MAX,
                    })
                    .collect();
                let tiles = attention.tiling().tiles(&paged_rows);
                let chunks = seqs.iter().any(|&(_, rows)| rows > 1);
                assert_eq!(tiles.iter().any(|t| t & 255 > 1), chunks, "a chunk's rows share tiles: {what}");
                let mut tiled = meta.clone();
                for (i, &tile) in tiles.iter().enumerate() {
                    tiled[4 * i + 3] = tile;
                }
                gpu.queue.write_buffer(&meta_b, 0, bytemuck::cast_slice(&tiled));
                let what = format!(
                    "{what}, {:?}, split keys {split_keys}, at most {max_splits}, lane rows {lane_rows:?}",
                    shape.chunk_precision
                );
                // The decode rows a workgroup per split, then (where they run
                // on subgroup lanes) each row's splits walked by one: the
                // same bits.
                let mut split_out = Vec::new();
                for walks in [false, true].into_iter().filter(|&w| !w || lanes) {
                    gpu.queue.write_buffer(&out, 0, bytemuck::cast_slice(&vec![f32::NAN; want.len()]));
                    let mut encoder = gpu.device.create_command_encoder(&Default::default());
                    let mut pass = encoder.begin_compute_pass(&Default::default());
                    for (d, rows) in attention.dispatches_walking(n as u32, slots, tiles.len() as u32, walks)
                    {
                        d.encode(&mut pass, rows);
                    }
                    drop(pass);
                    gpu.queue.submit([encoder.finish()]);
                    gpu.check("paged attention").unwrap();
                    let got = gpu.read_buffer(&out, want.len()).unwrap();
                    assert_close(&got, &want, tol, &format!("{what}, walked {walks}"));
                    let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    if walks {
                        assert!(bits == split_out, "walked splits differ from split workgroups: {what}");
                    }
                    split_out = bits;
                }
            }
            let words = if format == F32 { pool_blocks * block * kvw } else { pool_blocks * block * kvw / 2 };
            let stored_k = cache_values(&gpu.read_buffer(&k_b, words).unwrap(), format);
            let stored_v = cache_values(&gpu.read_buffer(&v_b, words).unwrap(), format);
            for &(s, pos) in &row_of {
                let at = slot(s, pos) * kvw..(slot(s, pos) + 1) * kvw;
                assert_close(
                    &stored_k[at.clone()],
                    &k_seq[s][pos],
                    tol,
                    &format!("stored k {s}:{pos}, {what}"),
                );
                assert_close(&stored_v[at], &v_seq[s][pos], tol, &format!("stored v {s}:{pos}, {what}"));
            }
        }
    });
}

/// LayerNorm against its f64 reference, in place and not, rows of sizes
/// around the workgroup's; large offsets (a mean far from 0) too.
#[test]
fn layer_norm_matches_cpu() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(21);
        let norm = RmsNorm::new(gpu).unwrap();
        for (n, tokens, offset) in [(1, 1, 0.0), (72, 3, 0.0), (300, 2, 50.0), (1152, 2, -3.0)] {
            let x: Vec<f32> = rng.vec(n * tokens, 2.0).iter().map(|v| v + offset).collect();
            let (w, b) = (rng.vec(n, 1.5), rng.vec(n, 1.0));
            let want: Vec<f32> = x.chunks(n).flat_map(|r| reference::layer_norm(r, &w, &b, 1e-6)).collect();
            let (wb, bb) = (gpu.storage_buffer_init("w", &w), gpu.storage_buffer_init("b", &b));
            for in_place in [false, true] {
                let xb = gpu.storage_buffer_init("x", &x);
                let out = if in_place { xb.clone() } else { gpu.storage_buffer("out", n * tokens).unwrap() };
                let rows = Rows { heads: tokens, head_stride: n, ..Rows::vector(n) };
                // Out of place, an f16 copy of the rows too where the device has f16.
                let out16 = (!in_place && has_f16(gpu)).then(|| {
                    gpu.storage_buffer_bytes("out16", (n * tokens * 2).next_multiple_of(4) as u64).unwrap()
                });
                let d = norm.plan_layer_norm(gpu, &wb, &bb, 1e-6, &xb, (&out, out16.as_ref()), rows);
                run(gpu, &[d.unwrap()], 1);
                let what =
                    format!("layer norm of {tokens} rows of {n} (offset {offset}), in place {in_place}");
                let got = gpu.read_buffer(&out, n * tokens).unwrap();
                assert_close(&got, &want, 2e-5, &what);
                if let Some(out16) = &out16 {
                    assert_eq!(
                        common::read_f16(gpu, out16, got.len()),
                        common::f16_bits(&got),
                        "{what}: f16 copy"
                    );
                }
            }
        }
    });
}

/// A bias and each activation against the f64 reference, on values from
/// -12 to 12 (tanh's saturation included).
#[test]
fn bias_then_activation_matches_cpu() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(22);
        let kernel = BiasAct;
        let (n, tokens) = (133, 3);
        let mut y = rng.vec(n * tokens, 4.0);
        y[0] = 12.0;
        y[1] = -12.0;
        let bias = rng.vec(n, 1.0);
        let bb = gpu.storage_buffer_init("bias", &bias);
        for activation in [Activation::None, Activation::GeluTanh, Activation::GeluErf] {
            let yb = gpu.storage_buffer_init("y", &y);
            run(gpu, &[kernel.plan(gpu, activation, n, tokens, &bb, &yb).unwrap()], 1);
            let want: Vec<f32> = y
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let v = v + bias[i % n];
                    match activation {
                        Activation::None => v,
                        Activation::GeluTanh => reference::gelu(v, true),
                        Activation::GeluErf => reference::gelu(v, false),
                    }
                })
                .collect();
            assert_close(&gpu.read_buffer(&yb, n * tokens).unwrap(), &want, 2e-6, &format!("{activation:?}"));
        }
    });
}

/// The residual add of a product, or of its partial sums over k side by
/// side (`Gemm::plan_summed`), scaled.
#[test]
fn residual_adds_scaled_sums_of_parts() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(8);
        // Rows shorter than a workgroup's elements, and rows of several
        // workgroups with a ragged last one.
        for (n, tokens, parts) in [(77, 2, 1), (2500, 3, 1), (77, 3, 4), (2500, 2, 3)] {
            let x = rng.vec(tokens * n, 1.0);
            let y = rng.vec(tokens * parts * n, 1.0);
            let xb = gpu.storage_buffer_init("x", &x);
            let yb = gpu.storage_buffer_init("y", &y);
            let residual = Residual::new();
            run(
                gpu,
                &[residual.plan(gpu, n, 0.5, (&yb, parts), &xb, &LayerOutput::default()).unwrap()],
                tokens as u32,
            );
            let want: Vec<f32> = (0..tokens * n)
                .map(|e| {
                    let (t, i) = (e / n, e % n);
                    x[e] + 0.5 * (0..parts).map(|j| y[(t * parts + j) * n + i]).sum::<f32>()
                })
                .collect();
            let what = format!("residual of {n} in {parts} parts");
            assert_close(&gpu.read_buffer(&xb, want.len()).unwrap(), &want, 1e-6, &what);
        }
    });
}

/// A few-token product from its partial sums over k (`Gemm::plan_summed`),
/// plain and through the SwiGLU gate of each interleaved gate/up pair, each
/// sum in the order of its parts.
#[test]
fn split_sums_add_the_parts_in_order_then_gate() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(9);
        let silu = |g: f32| g / (1.0 + (-g).exp());
        for (n, tokens, parts) in [(78, 2, 2), (2500, 3, 4), (6144, 1, 3), (514, 5, 8)] {
            let y = rng.vec(tokens * parts * n, 1.0);
            let yb = gpu.storage_buffer_init("y", &y);
            let sum = |t: usize, i: usize| (0..parts).fold(0f32, |s, j| s + y[(t * parts + j) * n + i]);
            for epilogue in [Epilogue::Plain, Epilogue::Swiglu] {
                let outputs = if epilogue == Epilogue::Plain { n } else { n / 2 };
                let out = gpu.storage_buffer("out", tokens * outputs).unwrap();
                run(
                    gpu,
                    &[split_sum::plan(gpu, n, epilogue, (&yb, parts), (&out, None)).unwrap()],
                    tokens as u32,
                );
                let want: Vec<f32> = (0..tokens * outputs)
                    .map(|e| {
                        let (t, o) = (e / outputs, e % outputs);
                        match epilogue {
                            Epilogue::Plain => sum(t, o),
                            Epilogue::Swiglu => silu(sum(t, 2 * o)) * sum(t, 2 * o + 1),
                        }
                    })
                    .collect();
                let what = format!("{epilogue:?} sum of {n} in {parts} parts over {tokens} tokens");
                assert_close(&gpu.read_buffer(&out, want.len()).unwrap(), &want, 1e-6, &what);
            }
            // Plain, the rows from `row` on into a buffer of their own rows.
            let row = n * 2 / 3;
            let (out, tail) = (
                gpu.storage_buffer("out", tokens * n).unwrap(),
                gpu.storage_buffer("tail", tokens * (n - row)).unwrap(),
            );
            let d =
                split_sum::plan(gpu, n, Epilogue::Plain, (&yb, parts), (&out, Some((row, &tail)))).unwrap();
            run(gpu, &[d], tokens as u32);
            let (got, got_tail) = (
                gpu.read_buffer(&out, tokens * n).unwrap(),
                gpu.read_buffer(&tail, tokens * (n - row)).unwrap(),
            );
            for t in 0..tokens {
                let what = format!("sum of {n} in {parts} parts, rows from {row} apart, token {t}");
                let want: Vec<f32> = (0..n).map(|i| sum(t, i)).collect();
                assert_close(&got[t * n..t * n + row], &want[..row], 1e-6, &what);
                assert_close(&got_tail[t * (n - row)..(t + 1) * (n - row)], &want[row..], 1e-6, &what);
            }
            let gated = split_sum::plan(gpu, n, Epilogue::Swiglu, (&yb, parts), (&out, Some((row, &tail))));
            assert!(matches!(gated, Err(wgspark::Error::Unsupported { .. })), "gated sums apart are refused");
        }
    });
}

/// The add at the end of a chunk's projection (of its partial sums over k,
/// where it has them) also writes the RMSNorm of the new rows for the next
/// projection: of the steered rows, at a layer's output; and its f16 copy
/// (the rows rounded) where the device has f16.
#[test]
fn residual_add_then_norm_matches_cpu() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(16);
        let rms_norm = RmsNorm::new(gpu).unwrap();
        // A row shorter than a workgroup, and rows of several strides with a
        // ragged last one; whole products and partial sums.
        for (n, tokens, parts) in [(77, 2, 1), (2500, 3, 1), (77, 3, 2), (2500, 2, 4)] {
            let x = rng.vec(tokens * n, 1.0);
            let y = rng.vec(tokens * parts * n, 1.0);
            let w = rng.vec(n, 1.0);
            let steer = rng.vec(n, 1.0);
            let (xb, yb, sb) = (
                gpu.storage_buffer_init("x", &x),
                gpu.storage_buffer_init("y", &y),
                gpu.storage_buffer_init("s", &steer),
            );
            let hb = gpu.storage_buffer("h", tokens * n).unwrap();
            let hb16 = gpu.storage_buffer_bytes("h16", (tokens * n * 2) as u64).unwrap();
            let weight = GpuTensor::vector_f32(gpu, "norm", &w).unwrap();
            let eps = 1e-5;
            for steered in [false, true] {
                let output = LayerOutput { steer: steered.then_some(&sb), steer_slots: None, capture: None };
                gpu.queue.write_buffer(&xb, 0, bytemuck::cast_slice(&x));
                let y_parts = (&yb, parts);
                let d = rms_norm.plan_after_add(gpu, &weight, eps, y_parts, &xb, (&hb, Some(&hb16)), &output);
                let (d, copied) = match d {
                    Ok(d) => (d, true),
                    Err(e) => {
                        assert!(!has_f16(gpu), "{e}");
                        let d =
                            rms_norm.plan_after_add(gpu, &weight, eps, y_parts, &xb, (&hb, None), &output);
                        (d.unwrap(), false)
                    }
                };
                run(gpu, &[d], tokens as u32);
                let added: Vec<f32> = (0..tokens * n)
                    .map(|e| {
                        let (t, i) = (e / n, e % n);
                        let product: f32 = (0..parts).map(|j| y[(t * parts + j) * n + i]).sum();
                        x[e] + product + if steered { steer[i] } else { 0.0 }
                    })
                    .collect();
                let want_h: Vec<f32> =
                    added.chunks(n).flat_map(|row| reference::rms_norm(row, &w, eps)).collect();
                let what = format!("{tokens} rows of {n} in {parts} parts, steered {steered}");
                assert_close(&gpu.read_buffer(&xb, added.len()).unwrap(), &added, 1e-6, &what);
                let h = gpu.read_buffer(&hb, want_h.len()).unwrap();
                assert_close(&h, &want_h, 1e-5, &format!("{what}: norm"));
                if copied {
                    assert_eq!(
                        common::read_f16(gpu, &hb16, h.len()),
                        common::f16_bits(&h),
                        "{what}: f16 copy"
                    );
                }
            }
        }
    });
}

fn has_f16(gpu: &Gpu) -> bool {
    gpu.device.features().contains(wgpu::Features::SHADER_F16)
}

/// The RMSNorm of rows of the hidden state also writes them as f16 where
/// asked (for the products that read f16 copies): the f32 rows rounded;
/// devices without f16 in shaders refuse.
#[test]
fn rms_norm_writes_an_f16_copy_of_its_rows() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(17);
        let rms_norm = RmsNorm::new(gpu).unwrap();
        let (n, tokens) = (2500, 3);
        let x = rng.vec(tokens * n, 4.0);
        let w = rng.vec(n, 1.0);
        let xb = gpu.storage_buffer_init("x", &x);
        let hb = gpu.storage_buffer("h", tokens * n).unwrap();
        let hb16 = gpu.storage_buffer_bytes("h16", (tokens * n * 2) as u64).unwrap();
        let weight = GpuTensor::vector_f32(gpu, "norm", &w).unwrap();
        let rows = wgspark::kernels::rms_norm::Rows::vector(n);
        let d = rms_norm.plan_with_copy(gpu, &weight, 1e-5, &xb, (&hb, Some(&hb16)), rows);
        if !has_f16(gpu) {
            assert!(matches!(d, Err(wgspark::Error::Unsupported { .. })), "{}", gpu.info.name);
            return;
        }
        run(gpu, &[d.unwrap()], tokens as u32);
        let want: Vec<f32> = x.chunks(n).flat_map(|row| reference::rms_norm(row, &w, 1e-5)).collect();
        let h = gpu.read_buffer(&hb, want.len()).unwrap();
        assert_close(&h, &want, 1e-5, "norm");
        assert_eq!(common::read_f16(gpu, &hb16, h.len()), common::f16_bits(&h), "f16 copy");
    });
}

#[test]
fn residual_at_a_layer_output_steers_and_captures() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(15);
        let residual = Residual::new();
        let (n, k) = (93, 3);
        // (tokens in flight, rows captured, weighted): every row, only the
        // last, and a chunk shorter than the rows kept.
        for (tokens, rows, weighted) in [(5, 5, false), (5, 1, true), (3, 8, false), (1, 1, true)] {
            let k = if weighted { k } else { 1 };
            let x = rng.vec(tokens * n, 1.0);
            let y = rng.vec(tokens * k * n, 1.0);
            let w = rng.vec(tokens * k, 1.0);
            let steer = rng.vec(n, 1.0);
            let (xb, yb, wb) = (
                gpu.storage_buffer_init("x", &x),
                gpu.storage_buffer_init("y", &y),
                gpu.storage_buffer_init("w", &w),
            );
            let sb = gpu.storage_buffer_init("steer", &steer);
            // The region sits at an offset, as layer regions do.
            let offset = gpu.device.limits().min_storage_buffer_offset_alignment as u64;
            let capture = gpu.storage_buffer_bytes("capture", offset + (rows * n * 4) as u64).unwrap();
            let step = step_buffer(gpu, 0, tokens, 1);
            let region = wgpu::BufferBinding {
                buffer: &capture,
                offset,
                size: wgpu::BufferSize::new((rows * n * 4) as u64),
            };
            let output = LayerOutput {
                steer: Some(&sb),
                steer_slots: None,
                capture: Some(CaptureTarget { region, rows, step: &step }),
            };
            let d = if weighted {
                residual.plan_weighted(gpu, n, k, &wb, &yb, &xb, &output)
            } else {
                residual.plan(gpu, n, 1.0, (&yb, 1), &xb, &output)
            };
            run(gpu, &[d.unwrap()], tokens as u32);
            let want: Vec<f32> = (0..tokens * n)
                .map(|e| {
                    let (t, i) = (e / n, e % n);
                    let s: f32 = (0..k)
                        .map(|j| if weighted { w[t * k + j] } else { 1.0 } * y[(t * k + j) * n + i])
                        .sum();
                    x[e] + s + steer[i]
                })
                .collect();
            let what = format!("tokens {tokens}, rows {rows}, weighted {weighted}");
            assert_close(&gpu.read_buffer(&xb, want.len()).unwrap(), &want, 1e-6, &what);
            let count = tokens.min(rows);
            let all = gpu.read_buffer::<f32>(&capture, offset as usize / 4 + rows * n).unwrap();
            let got = &all[offset as usize / 4..];
            assert_close(&got[..count * n], &want[(tokens - count) * n..], 1e-6, &what);
            assert!(got[count * n..].iter().all(|&v| v == 0.0), "{what}: wrote past the captured rows");
            assert!(all[..offset as usize / 4].iter().all(|&v| v == 0.0), "{what}: wrote before the region");
        }
    });
}

#[test]
fn router_selects_and_weighs_like_each_family() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(9);
        let router = Router::new(gpu).unwrap();
        for (experts, k, routing) in [
            (8, 2, ExpertSelection::Softmax { renormalize: true }),
            (60, 3, ExpertSelection::Softmax { renormalize: false }),
            (130, 8, ExpertSelection::Softmax { renormalize: true }),
            (8, 2, ExpertSelection::SigmoidWithBias),
            (257, 5, ExpertSelection::SigmoidWithBias),
        ] {
            let tokens = 3;
            let mut logits = rng.vec(tokens * experts, 3.0);
            // An exact tie: the lower id must win.
            logits[1] = logits[0];
            let bias = rng.vec(experts, 0.3);
            let lb = gpu.storage_buffer_init("logits", &logits);
            let bb = gpu.storage_buffer_init("bias", &bias);
            let ids = gpu.storage_buffer("ids", tokens * k).unwrap();
            let weights = gpu.storage_buffer("weights", tokens * k).unwrap();
            let sigmoid = routing == ExpertSelection::SigmoidWithBias;
            let d = router.plan(
                gpu,
                routing,
                experts,
                k,
                RouterBindings { logits: &lb, bias: sigmoid.then_some(&bb), ids: &ids, weights: &weights },
            );
            run(gpu, &[d], tokens as u32);
            let got_ids: Vec<u32> = gpu.read_buffer(&ids, tokens * k).unwrap();
            let got_w: Vec<f32> = gpu.read_buffer(&weights, tokens * k).unwrap();
            let renormalize = matches!(routing, ExpertSelection::Softmax { renormalize: true });
            for t in 0..tokens {
                let (want_ids, want_w) = reference::route(
                    &logits[t * experts..(t + 1) * experts],
                    k,
                    sigmoid.then_some(&bias[..]),
                    renormalize,
                );
                let what = format!("{routing:?} {experts} experts top {k}, token {t}");
                assert_eq!(&got_ids[t * k..(t + 1) * k], &want_ids[..], "{what}");
                assert_close(&got_w[t * k..(t + 1) * k], &want_w, 1e-5, &what);
            }
        }
    });
}

#[test]
fn weighted_residual_sums_the_routed_outputs() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(11);
        let (n, k, tokens) = (70, 3, 2);
        let x = rng.vec(tokens * n, 1.0);
        let y = rng.vec(tokens * k * n, 1.0);
        let w = rng.vec(tokens * k, 1.0);
        let xb = gpu.storage_buffer_init("x", &x);
        let yb = gpu.storage_buffer_init("y", &y);
        let wb = gpu.storage_buffer_init("w", &w);
        let residual = Residual::new();
        run(
            gpu,
            &[residual.plan_weighted(gpu, n, k, &wb, &yb, &xb, &LayerOutput::default()).unwrap()],
            tokens as u32,
        );
        let want: Vec<f32> = (0..tokens * n)
            .map(|ti| {
                let (t, i) = (ti / n, ti % n);
                x[ti] + (0..k).map(|j| w[t * k + j] * y[(t * k + j) * n + i]).sum::<f32>()
            })
            .collect();
        assert_close(&gpu.read_buffer(&xb, want.len()).unwrap(), &want, 1e-5, "weighted residual");
    });
}

#[test]
fn gemm_matches_cpu_on_ragged_tiles_and_split_parts() {
    for backend in common::backends() {
        for limit in [None, Some(20_000)] {
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: limit, ..Default::default() }).unwrap();
            for kernel in Gemm::kernels(&gpu) {
                let gemm = Gemm::with_kernel(&gpu, kernel).unwrap();
                let mut rng = Rng::new(12);
                // Tokens around the 64-token tile, rows around the row tiles,
                // k not a multiple of the 16- and 32-wide k steps (widths
                // that are not whole runs of eight the cooperative kernel
                // leaves to the f32 one).
                for (tokens, rows, cols) in
                    [(2, 5, 2), (3, 130, 40), (64, 128, 64), (65, 200, 100), (130, 77, 258), (97, 260, 136)]
                {
                    let w = bf16_round(&rng.vec(rows * cols, 1.0));
                    let x = rng.vec(tokens * cols, 1.0);
                    let weight = upload(&gpu, "w", rows, cols, &w);
                    let xb = gpu.storage_buffer_init("x", &x);
                    let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
                    let step = step_buffer(&gpu, 0, tokens, 1);
                    run(
                        &gpu,
                        &gemm.plan(&gpu, &weight, Epilogue::Plain, tokens, &step, &xb, &yb).unwrap(),
                        tokens as u32,
                    );
                    let want: Vec<f32> = (0..tokens)
                        .flat_map(|t| reference::gemv(&w, rows, cols, &x[t * cols..(t + 1) * cols]))
                        .collect();
                    let got: Vec<f32> = gpu.read_buffer(&yb, want.len()).unwrap();
                    let what =
                        format!("gemm {tokens} x {rows} x {cols}, binding limit {limit:?}, {kernel:?}");
                    let tolerance = kernel.activation_rounding().max(1e-5) * (cols as f32).sqrt();
                    assert_close(&got, &want, tolerance, &what);

                    // A linear layer's bias and activation, applied as the
                    // outputs are written (GELU's slope is below 1.13) ...
                    let bias = rng.vec(rows, 1.0);
                    let bias_b = gpu.storage_buffer_init("bias", &bias);
                    // Or added, with the bias, to what the outputs hold (a residual add).
                    let held = rng.vec(tokens * rows, 1.0);
                    let activations = [Activation::None, Activation::GeluTanh, Activation::GeluErf];
                    let thens = activations.map(AfterBias::Activate).into_iter().chain([AfterBias::AddTo]);
                    for then in thens {
                        let yb = gpu.storage_buffer_init("y", &held);
                        let biased = Bias { buffer: &bias_b, then };
                        let plan = gemm.plan_biased(&gpu, &weight, biased, tokens, &step, (&xb, None), &yb);
                        run(&gpu, &plan.unwrap(), tokens as u32);
                        let after: Vec<f32> = want
                            .iter()
                            .enumerate()
                            .map(|(i, &v)| {
                                let v = v + bias[i % rows];
                                match then {
                                    AfterBias::Activate(Activation::None) => v,
                                    AfterBias::Activate(Activation::GeluTanh) => reference::gelu(v, true),
                                    AfterBias::Activate(Activation::GeluErf) => reference::gelu(v, false),
                                    AfterBias::AddTo => held[i] + v,
                                }
                            })
                            .collect();
                        let got: Vec<f32> = gpu.read_buffer(&yb, want.len()).unwrap();
                        assert_close(&got, &after, 1.2 * tolerance + 1e-6, &format!("{what} {then:?}"));
                    }
                    // A bias shorter than the rows is refused.
                    let short = gpu.storage_buffer_init("bias", &bias[..rows / 2]);
                    let short = Bias { buffer: &short, then: AfterBias::Activate(Activation::None) };
                    let refused = gemm.plan_biased(&gpu, &weight, short, tokens, &step, (&xb, None), &yb);
                    assert!(matches!(refused, Err(wgspark::Error::Unsupported { .. })), "{what}");

                    // The rows as gate/up pairs (parts holding whole pairs, as
                    // the loader allocates them), gated in the epilogue; odd
                    // rows have no pairs to gate.
                    let pairs = GpuTensor::alloc_grouped(&gpu, "w", rows, cols, 2).unwrap();
                    pairs.write_rows(&gpu, 0, &bf16_bytes(&w));
                    let gated = gemm.plan(&gpu, &pairs, Epilogue::Swiglu, tokens, &step, &xb, &yb);
                    if rows % 2 == 1 {
                        assert!(matches!(gated, Err(wgspark::Error::Unsupported { .. })), "{what}");
                        continue;
                    }
                    run(&gpu, &gated.unwrap(), tokens as u32);
                    let want: Vec<f32> =
                        want.chunks_exact(2).map(|gu| reference::silu(gu[0]) * gu[1]).collect();
                    let got: Vec<f32> = gpu.read_buffer(&yb, want.len()).unwrap();
                    // silu's slope is below 1.1 and the up product's magnitude
                    // a few units: the product's error grows by that much.
                    let gate_tolerance = 8.0 * tolerance + 1e-5;
                    assert_close(&got, &want, gate_tolerance, &format!("{what} swiglu"));
                }
            }
        }
    }
}

/// A product large enough for the tile that reads f16 copies of its
/// activations (the vision tower's layers), with a bias and GELU: equal to
/// the CPU's over the f16-rounded activations (the f32 rows beside them
/// hold NaNs). Runs where a GEMM keeps such copies (cooperative matrices in
/// f16; CPU rasterisers have none).
#[test]
fn biased_gemm_reads_the_f16_copies_of_its_activations() {
    use wgspark::kernels::gemm_coop::Tile;
    for backend in common::backends() {
        let gpu = Gpu::new(&GpuOptions { backend, ..Default::default() }).unwrap();
        for kernel in Gemm::kernels(&gpu) {
            let gemm = Gemm::with_kernel(&gpu, kernel).unwrap();
            if !gemm.keeps_half_copies() {
                continue;
            }
            let mut rng = Rng::new(31);
            let (tokens, rows, cols) = (1024, 3072, 256);
            let tile = Tile::reads_f16(rows, cols, tokens, &[], gpu.caps.multiprocessors);
            assert!(tile.is_some(), "{rows} x {cols} over {tokens} tokens reads f16 copies");
            let w = bf16_round(&rng.vec(rows * cols, 1.0));
            let x: Vec<f32> =
                rng.vec(tokens * cols, 1.0).iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            let bias = rng.vec(rows, 1.0);
            let weight = upload(&gpu, "w", rows, cols, &w);
            let x16 = gpu.storage_buffer_init("x16", &common::f16_bits(&x));
            let garbage = gpu.storage_buffer_init("x", &vec![f32::NAN; tokens * cols]);
            let bias_b = gpu.storage_buffer_init("bias", &bias);
            let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
            let step = step_buffer(&gpu, 0, tokens, 1);
            let biased = Bias { buffer: &bias_b, then: AfterBias::Activate(Activation::GeluErf) };
            let plan = gemm.plan_biased(&gpu, &weight, biased, tokens, &step, (&garbage, Some(&x16)), &yb);
            run(&gpu, &plan.unwrap(), tokens as u32);
            let want: Vec<f32> = (0..tokens)
                .flat_map(|t| reference::gemv(&w, rows, cols, &x[t * cols..(t + 1) * cols]))
                .enumerate()
                .map(|(i, v)| reference::gelu(v + bias[i % rows], false))
                .collect();
            let got: Vec<f32> = gpu.read_buffer(&yb, want.len()).unwrap();
            assert_close(&got, &want, 1e-4 * (cols as f32).sqrt(), &format!("{kernel:?}"));
        }
    }
}

/// The GPU's grouping equals the host's: each expert's pairs in increasing
/// order, experts in order, ids past the experts (elsewhere) left out;
/// chunks of more pairs than the kernel's workgroup, and experts with none.
#[test]
fn pairs_are_grouped_by_expert_on_the_gpu() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(14);
        let group = GroupByExpert::new(gpu).unwrap();
        for (tokens, top_k, experts) in [(1, 2, 8), (70, 2, 5), (300, 8, 128), (513, 3, 512)] {
            let ids: Vec<u32> = (0..tokens * top_k)
                .map(|_| match rng.below(10) {
                    0 => wgspark::kernels::gemv::EXPERT_ELSEWHERE,
                    _ => rng.below(experts as u32 / 2 + 1) * 2 % experts as u32,
                })
                .collect();
            let idb = gpu.storage_buffer_init("ids", &ids);
            let gb = gpu.storage_buffer_init("groups", &vec![u32::MAX; 2 * experts]);
            let pb = gpu.storage_buffer_init("pairs", &vec![u32::MAX; ids.len()]);
            let step = step_buffer(gpu, 0, tokens, 1);
            let b = GroupBuffers { step: &step, ids: &idb, groups: &gb, pairs: &pb };
            run(gpu, &[group.plan(gpu, experts, top_k, b)], tokens as u32);
            let mut want_groups = Vec::new();
            let mut want_pairs = Vec::new();
            for e in 0..experts as u32 {
                let members: Vec<u32> = (0..ids.len() as u32).filter(|&i| ids[i as usize] == e).collect();
                want_groups.extend([want_pairs.len() as u32, members.len() as u32]);
                want_pairs.extend(members);
            }
            let what = format!("{tokens} tokens, top {top_k} of {experts}");
            assert_eq!(gpu.read_buffer::<u32>(&gb, 2 * experts).unwrap(), want_groups, "{what}: groups");
            assert_eq!(gpu.read_buffer::<u32>(&pb, want_pairs.len()).unwrap(), want_pairs, "{what}: pairs");
        }
    });
}

#[test]
fn grouped_gemm_runs_each_expert_over_its_tokens() {
    for backend in common::backends() {
        for limit in [None, Some(1000)] {
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: limit, ..Default::default() }).unwrap();
            // Odd rows plain; gate/up pairs gated.
            for (kernel, (rows, epilogue)) in Gemm::kernels(&gpu)
                .into_iter()
                .flat_map(|kernel| [(7, Epilogue::Plain), (10, Epilogue::Swiglu)].map(|r| (kernel, r)))
            {
                let gemm = Gemm::with_kernel(&gpu, kernel).unwrap();
                let mut rng = Rng::new(13);
                let (experts, cols, k, tokens) = (5, 136, 2, 70);
                let w = bf16_round(&rng.vec(experts * rows * cols, 1.0));
                let weight = GpuTensor::alloc_grouped(&gpu, "experts", experts * rows, cols, rows).unwrap();
                weight.write_rows(&gpu, 0, &bf16_bytes(&w));
                let x = rng.vec(tokens * cols, 1.0);
                // Each (token, slot) pair to an expert; expert 3 gets none.
                let ids: Vec<u32> = (0..tokens * k).map(|_| [0, 1, 2, 4][rng.below(4) as usize]).collect();
                let mut groups = Vec::new();
                let mut pairs = Vec::new();
                for e in 0..experts as u32 {
                    let members: Vec<u32> = (0..ids.len() as u32).filter(|&p| ids[p as usize] == e).collect();
                    groups.extend([pairs.len() as u32, members.len() as u32]);
                    pairs.extend(members);
                }
                let xb = gpu.storage_buffer_init("x", &x);
                let yb = gpu.storage_buffer_init("y", &vec![0.0f32; tokens * k * rows]);
                let gb = gpu.storage_buffer_init("groups", &groups);
                let pb = gpu.storage_buffer_init("pairs", &pairs);
                let step = step_buffer(&gpu, 0, tokens, 1);
                let b = GroupedBuffers { x: &xb, y: &yb, groups: &gb, pairs: &pb };
                let per_expert = tokens * k / experts;
                let dispatches = gemm
                    .plan_experts(&gpu, &weight, epilogue, 0..experts, rows, k, per_expert, &step, b)
                    .unwrap();
                run(&gpu, &dispatches, tokens as u32);
                let products: Vec<f32> = (0..tokens * k)
                    .flat_map(|pair| {
                        let e = ids[pair] as usize;
                        let t = pair / k;
                        reference::gemv(
                            &w[e * rows * cols..(e + 1) * rows * cols],
                            rows,
                            cols,
                            &x[t * cols..(t + 1) * cols],
                        )
                    })
                    .collect();
                let (want, tolerance): (Vec<f32>, f32) = match epilogue {
                    Epilogue::Plain => (products, 1.0),
                    Epilogue::Swiglu => {
                        (products.chunks_exact(2).map(|gu| reference::silu(gu[0]) * gu[1]).collect(), 8.0)
                    }
                };
                let got: Vec<f32> = gpu.read_buffer(&yb, want.len()).unwrap();
                let tolerance = tolerance * kernel.activation_rounding().max(1e-5) * (cols as f32).sqrt();
                assert_close(
                    &got,
                    &want,
                    tolerance,
                    &format!("grouped gemm {epilogue:?}, binding limit {limit:?}, {kernel:?}"),
                );
            }
        }
    }
}

#[test]
fn copy_kernel_copies() {
    on_each_backend(|gpu| {
        // Not a multiple of the 1024 vec4s a workgroup copies.
        let data: Vec<f32> = Rng::new(14).vec(5000, 1.0);
        let src = gpu.storage_buffer_init("src", &data);
        let dst = gpu.storage_buffer("dst", 5000).unwrap();
        run(gpu, &[wgspark::kernels::copy::plan(gpu, &src, &dst, 20_000).unwrap()], 1);
        assert_eq!(gpu.read_buffer::<f32>(&dst, 5000).unwrap(), data);
    });
}

/// Runs token selection `draws` times, one submission each at successive
/// positions (the random stream is keyed by position), and returns the ids.
fn sample_many(gpu: &Gpu, logits: &[f32], sampling: Sampling, seed: u64, draws: usize) -> Vec<u32> {
    let lb = gpu.storage_buffer_init("logits", logits);
    let tokens = gpu.storage_buffer("tokens", 1).unwrap();
    let results = gpu.storage_buffer("results", draws).unwrap();
    let scratch = SampleScratch::new(gpu, logits.len()).unwrap();
    let step = step_buffer(gpu, 0, 1, 1);
    let b = SampleBindings { step: &step, logits: &lb, tokens: &tokens, scratch: &scratch };
    let d = Sample::new(gpu).plan(gpu, logits.len(), sampling, seed, &b).unwrap();
    for i in 0..draws {
        let s = Step { pos0: i as u32, n_tokens: 1, attn_splits: 1, decode_rows: 0, attend_tiles: 0 };
        gpu.queue.write_buffer(&step, 0, bytemuck::bytes_of(&s));
        let mut encoder = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            wgspark::gpu::encode_all(&d, &mut pass, 1);
        }
        encoder.copy_buffer_to_buffer(&tokens, 0, &results, 4 * i as u64, 4);
        gpu.queue.submit([encoder.finish()]);
    }
    gpu.read_buffer(&results, draws).unwrap()
}

#[test]
fn gpu_greedy_is_the_host_argmax() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(20);
        // Several partial blocks of 1024, a tie across blocks (the lower id
        // wins), and a vocabulary of one.
        for vocab in [1, 50, 3000, 5000] {
            let mut logits = rng.vec(vocab, 10.0);
            if vocab > 2000 {
                let best = logits.iter().copied().fold(f32::MIN, f32::max) + 1.0;
                logits[2500] = best;
                logits[1500] = best;
            }
            let got = sample_many(gpu, &logits, Sampling::Greedy, 0, 1);
            assert_eq!(got[0], wgspark::sampling::argmax(&logits), "greedy over {vocab}");
            // One logit that is not a number, or infinite, in any block:
            // the id says so instead, greedy or drawn.
            let draw = Sampling::Random { temperature: 1.0, top_k: Some(3), top_p: Some(0.9) };
            for (bad, sampling) in [(f32::NAN, Sampling::Greedy), (f32::INFINITY, draw)] {
                let mut broken = logits.clone();
                broken[vocab - 1] = bad;
                let got = sample_many(gpu, &broken, sampling, 0, 1);
                assert_eq!(got[0], wgspark::kernels::sample::NON_FINITE, "{bad} among {vocab}, {sampling:?}");
            }
        }
    });
}

/// Draws from the GPU against the host sampler's probabilities: every id
/// drawn is one the host would allow, and frequencies are within 4.5
/// standard deviations (and 0.01) of its probabilities.
#[test]
fn gpu_sampling_follows_the_host_samplers_distribution() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(21);
        let draws = if gpu.caps.is_cpu { 3000 } else { 20000 };
        for (vocab, temperature, top_k, top_p) in [
            (40, 1.0, None, None),
            (40, 0.5, Some(5), None),
            (40, 2.0, None, Some(0.7)),
            (2500, 0.8, Some(30), Some(0.9)),
            (2500, 1.0, None, Some(0.5)),
        ] {
            let logits = rng.vec(vocab, 3.0);
            let sampling = Sampling::Random { temperature, top_k, top_p };
            let want = reference::sampling_distribution(&logits, temperature, top_k, top_p);
            let got = sample_many(gpu, &logits, sampling, 7, draws);
            let mut counts = vec![0usize; vocab];
            for &id in &got {
                counts[id as usize] += 1;
            }
            for (id, (&c, &p)) in counts.iter().zip(&want).enumerate() {
                let f = c as f64 / draws as f64;
                let sigma = (p * (1.0 - p) / draws as f64).sqrt();
                assert!(
                    p > 0.0 || c == 0,
                    "{sampling:?}: id {id} drawn {c} times, outside the host's candidates"
                );
                assert!(
                    (f - p).abs() <= (4.5 * sigma).max(0.01),
                    "{sampling:?}: id {id} frequency {f:.4}, host probability {p:.4}"
                );
            }
            // The same seed draws the same ids; another seed others.
            assert_eq!(sample_many(gpu, &logits, sampling, 7, 50), got[..50]);
            assert_ne!(sample_many(gpu, &logits, sampling, 8, 50), got[..50]);
        }
    });
}

/// A ragged batch's rows, each with its own sampling, seed and position,
/// chosen in one selection: every row's id is the one a lone selection
/// with the row's parameters (the session's) draws, greedy rows the argmax;
/// a non-finite logit marks its own row only.
#[test]
fn each_row_of_a_batch_is_chosen_as_alone() {
    use wgspark::kernels::sample::{RowSampleBindings, RowSampling};
    on_each_backend(|gpu| {
        let mut rng = Rng::new(22);
        let vocab = 2500;
        let samplings = [
            Sampling::Greedy,
            Sampling::Random { temperature: 0.8, top_k: Some(30), top_p: Some(0.9) },
            Sampling::Random { temperature: 1.3, top_k: None, top_p: None },
            Sampling::Greedy,
            Sampling::Random { temperature: 0.5, top_k: Some(4), top_p: None },
            Sampling::Random { temperature: 1.0, top_k: None, top_p: Some(0.6) },
        ];
        let rows: Vec<(Sampling, u64, usize, Vec<f32>)> = samplings
            .iter()
            .enumerate()
            .map(|(i, &s)| (s, 100 + i as u64 % 3, 17 * i, rng.vec(vocab, 3.0)))
            .collect();
        let mut logits: Vec<f32> = rows.iter().flat_map(|r| r.3.clone()).collect();
        logits[4 * vocab + 7] = f32::NAN;
        let params: Vec<RowSampling> =
            rows.iter().map(|&(s, seed, pos, _)| RowSampling::new(s, seed, pos, vocab)).collect();
        let lb = gpu.storage_buffer_init("logits", &logits);
        let pb = gpu.storage_buffer_init("rows", &params);
        let tokens = gpu.storage_buffer("tokens", rows.len()).unwrap();
        let scratch = SampleScratch::for_rows(gpu, vocab, rows.len()).unwrap();
        let b = RowSampleBindings { logits: &lb, rows: &pb, tokens: &tokens, scratch: &scratch };
        run(gpu, &Sample::new(gpu).plan_rows(gpu, vocab, &b).unwrap(), rows.len() as u32);
        let got: Vec<u32> = gpu.read_buffer(&tokens, rows.len()).unwrap();
        for (i, ((sampling, seed, pos, row), id)) in rows.iter().zip(got).enumerate() {
            let want = if i == 4 {
                wgspark::kernels::sample::NON_FINITE
            } else {
                // A lone selection draws at step.pos0 + step.n_tokens.
                lone_sample(gpu, row, *sampling, *seed, *pos)
            };
            assert_eq!(id, want, "row {i}: {sampling:?}");
            if *sampling == Sampling::Greedy {
                assert_eq!(id, wgspark::sampling::argmax(row), "row {i}");
            }
        }
    });
}

/// One selection as a session runs it, drawing the token at `pos`.
fn lone_sample(gpu: &Gpu, logits: &[f32], sampling: Sampling, seed: u64, pos: usize) -> u32 {
    let lb = gpu.storage_buffer_init("logits", logits);
    let tokens = gpu.storage_buffer("tokens", 1).unwrap();
    let scratch = SampleScratch::new(gpu, logits.len()).unwrap();
    let step = step_buffer(gpu, pos, 0, 1);
    let b = SampleBindings { step: &step, logits: &lb, tokens: &tokens, scratch: &scratch };
    run(gpu, &Sample::new(gpu).plan(gpu, logits.len(), sampling, seed, &b).unwrap(), 1);
    gpu.read_buffer(&tokens, 1).unwrap()[0]
}
