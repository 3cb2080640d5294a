//! Every kernel against its CPU f32 reference on random data, on every
//! backend under test, with sizes that are not multiples of the workgroup.

mod common;

use common::{Rng, assert_close, bf16_bytes, bf16_round, on_each_backend, reference};
use wgspark::gpu::{Dispatch, Gpu, GpuOptions, GpuTensor};
use wgspark::kernels::attention::{AttentionBindings, SplitScratch};
use wgspark::kernels::gemm::{GroupedBuffers, Tiling};
use wgspark::kernels::gemv::{ExpertBuffers, ExpertLayout, GemvShape};
use wgspark::kernels::rms_norm::Rows;
use wgspark::kernels::rope::RopeBindings;
use wgspark::kernels::router::RouterBindings;
use wgspark::kernels::{Attention, Embed, Gemm, Gemv, Heads, Residual, RmsNorm, Rope, Router, Step, Swiglu};
use wgspark::model::Routing;
use wgspark::model::{RopeConfig, RopeScaling};

fn upload(gpu: &Gpu, name: &str, rows: usize, cols: usize, values: &[f32]) -> GpuTensor {
    let t = GpuTensor::alloc(gpu, name, rows, cols).unwrap();
    t.write_rows(gpu, 0, &bf16_bytes(values));
    t
}

fn run(gpu: &Gpu, dispatches: &[Dispatch], n_tokens: u32) {
    let mut encoder = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        wgspark::gpu::encode_all(dispatches, &mut pass, n_tokens);
    }
    gpu.queue.submit([encoder.finish()]);
    gpu.wait().unwrap();
    gpu.check("test dispatch").unwrap();
}

fn step_buffer(gpu: &Gpu, pos0: usize, n_tokens: usize) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    let step = Step { pos0: pos0 as u32, n_tokens: n_tokens as u32, _pad: [0; 2] };
    gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("step"),
        contents: bytemuck::bytes_of(&step),
        usage: wgpu::BufferUsages::UNIFORM,
    })
}

fn check_gemv(gpu: &Gpu, gemv: &Gemv, rng: &mut Rng, rows: usize, cols: usize, tokens: usize) {
    let w = bf16_round(&rng.vec(rows * cols, 1.0));
    let x = rng.vec(tokens * cols, 1.0);
    let weight = upload(gpu, "w", rows, cols, &w);
    let xb = gpu.storage_buffer_init("x", &x);
    let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
    run(gpu, &gemv.plan(gpu, &weight, &xb, &yb), tokens as u32);
    let got: Vec<f32> = gpu.read_buffer(&yb, tokens * rows).unwrap();
    let want: Vec<f32> =
        (0..tokens).flat_map(|t| reference::gemv(&w, rows, cols, &x[t * cols..(t + 1) * cols])).collect();
    assert_close(&got, &want, 1e-5 * (cols as f32).sqrt(), &format!("gemv {rows}x{cols} x{tokens}"));
}

const GEMV_SIZES: &[(usize, usize, usize)] = &[(1, 2, 1), (37, 100, 1), (130, 258, 3), (65, 1030, 2)];

#[test]
fn gemv_matches_cpu_in_both_shapes() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(1);
        for shape in [
            GemvShape { rows_per_workgroup: 64, threads_per_row: 1 },
            GemvShape { rows_per_workgroup: 4, threads_per_row: 16 },
            GemvShape::for_gpu(gpu),
        ] {
            let gemv = Gemv::with_shape(gpu, shape).unwrap();
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
        let gemv = Gemv::new(&gpu).unwrap();
        check_gemv(&gpu, &gemv, &mut rng, 37, 100, 2);
        check_embed(&gpu, &mut rng, 37, 100);
    }
}

fn check_embed(gpu: &Gpu, rng: &mut Rng, vocab: usize, hidden: usize) {
    let table = bf16_round(&rng.vec(vocab * hidden, 1.0));
    let t = upload(gpu, "table", vocab, hidden, &table);
    let tokens: Vec<u32> = vec![0, vocab as u32 - 1, rng.below(vocab as u32), 5];
    let tb = gpu.storage_buffer_init("tokens", &tokens);
    let xb = gpu.storage_buffer("x", tokens.len() * hidden).unwrap();
    let embed = Embed::new(gpu).unwrap();
    run(gpu, &embed.plan(gpu, &t, &tb, &xb), tokens.len() as u32);
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
            let wt = upload(gpu, "w", 1, rows.n, &w);
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

#[test]
fn rope_rotates_q_and_k_and_stores_the_cache() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(5);
        let rope = Rope::new(gpu).unwrap();
        for (heads, rotary_dim, scaling) in [
            (Heads { q: 3, kv: 1, dim: 10 }, 10, RopeScaling::None),
            (Heads { q: 4, kv: 2, dim: 12 }, 6, RopeScaling::None),
            (
                Heads { q: 2, kv: 2, dim: 64 },
                64,
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 16,
                },
            ),
        ] {
            let config = RopeConfig { theta: 10_000.0, rotary_dim, scaling };
            let (ctx, pos0, tokens) = (40, 29, 3);
            let width = heads.qkv_width();
            let qkv: Vec<f32> = rng.vec(tokens * width, 1.0);
            let qkv_b = gpu.storage_buffer_init("qkv", &qkv);
            let table = gpu.storage_buffer_init("cos_sin", &config.cos_sin_table(ctx));
            let k_cache = gpu.storage_buffer("k", ctx * heads.kv_width()).unwrap();
            let v_cache = gpu.storage_buffer("v", ctx * heads.kv_width()).unwrap();
            let step = step_buffer(gpu, pos0, tokens);
            let d = rope.plan(
                gpu,
                heads,
                rotary_dim,
                RopeBindings {
                    step: &step,
                    qkv: &qkv_b,
                    cos_sin: &table,
                    k_cache: &k_cache,
                    v_cache: &v_cache,
                },
            );
            run(gpu, &[d], tokens as u32);

            let inv_freq = config.inv_freq();
            let hd = heads.dim;
            let mut want_qkv = qkv.clone();
            let mut want_k = vec![0.0f32; ctx * heads.kv_width()];
            let mut want_v = want_k.clone();
            for t in 0..tokens {
                let pos = pos0 + t;
                let row = &qkv[t * width..(t + 1) * width];
                for h in 0..heads.q {
                    let r = reference::rope(&row[h * hd..(h + 1) * hd], pos, rotary_dim, &inv_freq);
                    want_qkv[t * width + h * hd..t * width + (h + 1) * hd].copy_from_slice(&r);
                }
                for h in 0..heads.kv {
                    let k_off = (heads.q + h) * hd;
                    let v_off = (heads.q + heads.kv + h) * hd;
                    let r = reference::rope(&row[k_off..k_off + hd], pos, rotary_dim, &inv_freq);
                    let dst = pos * heads.kv_width() + h * hd;
                    want_k[dst..dst + hd].copy_from_slice(&r);
                    want_v[dst..dst + hd].copy_from_slice(&row[v_off..v_off + hd]);
                }
            }
            let what = format!("rope {heads:?} rot {rotary_dim}");
            // q rows are rotated in place; k and v rows of qkv are left as
            // they were (only q is read from qkv afterwards).
            let got_qkv: Vec<f32> = gpu.read_buffer(&qkv_b, qkv.len()).unwrap();
            for t in 0..tokens {
                let q = t * width..t * width + heads.q * hd;
                assert_close(&got_qkv[q.clone()], &want_qkv[q], 1e-5, &what);
            }
            assert_close(&gpu.read_buffer(&k_cache, want_k.len()).unwrap(), &want_k, 1e-5, &what);
            assert_eq!(gpu.read_buffer::<f32>(&v_cache, want_v.len()).unwrap(), want_v, "{what}: v stored");
        }
    });
}

#[test]
fn attention_matches_cpu_across_tiles_groups_windows_and_splits() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(6);
        let attention = Attention::new(gpu).unwrap();
        // (heads, context, first position, tokens, window, key splits)
        for (heads, ctx, pos0, tokens, window, splits) in [
            (Heads { q: 4, kv: 2, dim: 12 }, 150, 0, 1, 0, 1),
            (Heads { q: 4, kv: 2, dim: 12 }, 150, 70, 2, 0, 1),
            (Heads { q: 6, kv: 1, dim: 130 }, 200, 140, 1, 0, 1),
            (Heads { q: 6, kv: 1, dim: 130 }, 200, 140, 1, 0, 7),
            (Heads { q: 2, kv: 2, dim: 256 }, 20, 9, 1, 0, 3),
            (Heads { q: 16, kv: 1, dim: 128 }, 300, 290, 1, 0, 32),
            (Heads { q: 4, kv: 4, dim: 8 }, 150, 100, 3, 37, 1),
            (Heads { q: 4, kv: 4, dim: 8 }, 150, 100, 1, 37, 5),
            (Heads { q: 8, kv: 2, dim: 64 }, 600, 0, 520, 0, 1),
        ] {
            let kvw = heads.kv_width();
            let width = heads.qkv_width();
            let qkv = rng.vec(tokens * width, 1.0);
            let k: Vec<Vec<f32>> = (0..ctx).map(|_| rng.vec(kvw, 1.0)).collect();
            let v: Vec<Vec<f32>> = (0..ctx).map(|_| rng.vec(kvw, 1.0)).collect();
            let scale = (heads.dim as f32).powf(-0.5);
            let qkv_b = gpu.storage_buffer_init("qkv", &qkv);
            let k_b = gpu.storage_buffer_init("k", &k.concat());
            let v_b = gpu.storage_buffer_init("v", &v.concat());
            let out = gpu.storage_buffer("out", tokens * heads.q * heads.dim).unwrap();
            let acc = gpu.storage_buffer("split_acc", heads.q * splits * heads.dim).unwrap();
            let max_sum = gpu.storage_buffer("split_max_sum", heads.q * splits * 2).unwrap();
            let step = step_buffer(gpu, pos0, tokens);
            let split = (splits > 1).then(|| (splits, SplitScratch { acc: &acc, max_sum: &max_sum }));
            let d = attention.plan(
                gpu,
                heads,
                scale,
                window,
                AttentionBindings { step: &step, qkv: &qkv_b, k_cache: &k_b, v_cache: &v_b, out: &out },
                split,
            );
            run(gpu, &d, tokens as u32);
            let mut want = Vec::new();
            for t in 0..tokens {
                let pos = pos0 + t;
                let start = if window > 0 && pos + 1 > window { pos + 1 - window } else { 0 };
                for h in 0..heads.q {
                    let q = &qkv[t * width + h * heads.dim..t * width + (h + 1) * heads.dim];
                    let kv_head = h / (heads.q / heads.kv);
                    want.extend(reference::attention(q, &k[start..=pos], &v[start..=pos], kv_head, scale));
                }
            }
            let got: Vec<f32> = gpu.read_buffer(&out, want.len()).unwrap();
            let what = format!("attention {heads:?} pos0 {pos0} x{tokens} window {window} splits {splits}");
            assert_close(&got, &want, 1e-5, &what);
        }
    });
}

#[test]
fn swiglu_matches_cpu() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(7);
        let (n, tokens) = (131, 3);
        let gate_up = rng.vec(tokens * 2 * n, 6.0);
        let gb = gpu.storage_buffer_init("gate_up", &gate_up);
        let out = gpu.storage_buffer("act", tokens * n).unwrap();
        let swiglu = Swiglu::new(gpu).unwrap();
        run(gpu, &[swiglu.plan(gpu, n, &gb, &out)], tokens as u32);
        let want: Vec<f32> = (0..tokens)
            .flat_map(|t| {
                let row = &gate_up[t * 2 * n..(t + 1) * 2 * n];
                (0..n).map(|i| reference::silu(row[i]) * row[n + i]).collect::<Vec<_>>()
            })
            .collect();
        assert_close(&gpu.read_buffer(&out, want.len()).unwrap(), &want, 1e-5, "swiglu");
    });
}

#[test]
fn residual_adds_scaled() {
    on_each_backend(|gpu| {
        let mut rng = Rng::new(8);
        let (n, tokens) = (77, 2);
        let x = rng.vec(tokens * n, 1.0);
        let y = rng.vec(tokens * n, 1.0);
        let xb = gpu.storage_buffer_init("x", &x);
        let yb = gpu.storage_buffer_init("y", &y);
        let residual = Residual::new(gpu).unwrap();
        run(gpu, &[residual.plan(gpu, n, 0.5, &yb, &xb)], tokens as u32);
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + 0.5 * b).collect();
        assert_close(&gpu.read_buffer(&xb, want.len()).unwrap(), &want, 1e-6, "residual");
    });
}

#[test]
fn residual_at_a_layer_output_steers_and_captures() {
    use wgspark::kernels::residual::{CaptureTarget, LayerOutput};
    on_each_backend(|gpu| {
        let mut rng = Rng::new(15);
        let residual = Residual::new(gpu).unwrap();
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
            let step = step_buffer(gpu, 0, tokens);
            let region = wgpu::BufferBinding {
                buffer: &capture,
                offset,
                size: wgpu::BufferSize::new((rows * n * 4) as u64),
            };
            let output =
                LayerOutput { steer: Some(&sb), capture: Some(CaptureTarget { region, rows, step: &step }) };
            let d = if weighted {
                residual.plan_weighted(gpu, n, k, &wb, &yb, &xb, output)
            } else {
                residual.plan_output(gpu, n, 1.0, &yb, &xb, output)
            };
            run(gpu, &[d], tokens as u32);
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
            (8, 2, Routing::Softmax { renormalize: true }),
            (60, 3, Routing::Softmax { renormalize: false }),
            (130, 8, Routing::Softmax { renormalize: true }),
            (8, 2, Routing::SigmoidWithBias),
            (257, 5, Routing::SigmoidWithBias),
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
            let sigmoid = routing == Routing::SigmoidWithBias;
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
            let renormalize = matches!(routing, Routing::Softmax { renormalize: true });
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
fn expert_gemv_reads_the_expert_from_the_gpu_across_split_parts() {
    for backend in common::backends() {
        for limit in [None, Some(1000)] {
            // 1000-byte bindings: 5 rows of 100 bf16 per part, so experts of
            // 7 rows straddle part boundaries.
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: limit, ..Default::default() }).unwrap();
            let mut rng = Rng::new(10);
            let (experts, rows, cols, k, tokens) = (6, 7, 100, 3, 2);
            let w = bf16_round(&rng.vec(experts * rows * cols, 1.0));
            let weight = GpuTensor::alloc_grouped(&gpu, "experts", experts * rows, cols, rows).unwrap();
            weight.write_rows(&gpu, 0, &bf16_bytes(&w));
            // Per-slot inputs, as the down projection reads them.
            let x = rng.vec(tokens * k * cols, 1.0);
            let ids: Vec<u32> = vec![5, 0, 3, 2, 2, 4];
            let xb = gpu.storage_buffer_init("x", &x);
            let yb = gpu.storage_buffer("y", tokens * k * rows).unwrap();
            let idb = gpu.storage_buffer_init("ids", &ids);
            let gemv = Gemv::new(&gpu).unwrap();
            let layout =
                ExpertLayout { top_k: k, expert_rows: rows, x_stride: k * cols, x_slot_stride: cols };
            let mut dispatches = Vec::new();
            for slot in 0..k {
                dispatches.extend(gemv.plan_expert(
                    &gpu,
                    &weight,
                    layout,
                    slot,
                    ExpertBuffers { x: &xb, y: &yb, ids: &idb },
                ));
            }
            run(&gpu, &dispatches, tokens as u32);
            let got: Vec<f32> = gpu.read_buffer(&yb, tokens * k * rows).unwrap();
            let mut want = Vec::new();
            for t in 0..tokens {
                for slot in 0..k {
                    let e = ids[t * k + slot] as usize;
                    let we = &w[e * rows * cols..(e + 1) * rows * cols];
                    let xs = &x[(t * k + slot) * cols..(t * k + slot + 1) * cols];
                    want.extend(reference::gemv(we, rows, cols, xs));
                }
            }
            assert_close(&got, &want, 1e-4, &format!("expert gemv, binding limit {limit:?}"));
        }
    }
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
        let residual = Residual::new(gpu).unwrap();
        run(gpu, &[residual.plan_weighted(gpu, n, k, &wb, &yb, &xb, Default::default())], tokens as u32);
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
            for tiling in [Tiling::Narrow, Tiling::Wide] {
                let gemm = Gemm::with_tiling(&gpu, tiling).unwrap();
                let mut rng = Rng::new(12);
                // Tokens around the 64-token tile, rows around the row tiles,
                // k not a multiple of the 16-wide k tile.
                for (tokens, rows, cols) in
                    [(2, 5, 2), (3, 130, 40), (64, 128, 64), (65, 200, 100), (130, 77, 258)]
                {
                    let w = bf16_round(&rng.vec(rows * cols, 1.0));
                    let x = rng.vec(tokens * cols, 1.0);
                    let weight = upload(&gpu, "w", rows, cols, &w);
                    let xb = gpu.storage_buffer_init("x", &x);
                    let yb = gpu.storage_buffer("y", tokens * rows).unwrap();
                    let step = step_buffer(&gpu, 0, tokens);
                    run(&gpu, &gemm.plan(&gpu, &weight, tokens, &step, &xb, &yb), tokens as u32);
                    let want: Vec<f32> = (0..tokens)
                        .flat_map(|t| reference::gemv(&w, rows, cols, &x[t * cols..(t + 1) * cols]))
                        .collect();
                    let got: Vec<f32> = gpu.read_buffer(&yb, want.len()).unwrap();
                    let what =
                        format!("gemm {tokens} x {rows} x {cols}, binding limit {limit:?}, {tiling:?} tiles");
                    assert_close(&got, &want, 1e-5 * (cols as f32).sqrt(), &what);
                }
            }
        }
    }
}

#[test]
fn grouped_gemm_runs_each_expert_over_its_tokens() {
    for backend in common::backends() {
        for limit in [None, Some(1000)] {
            let gpu =
                Gpu::new(&GpuOptions { backend, max_storage_binding: limit, ..Default::default() }).unwrap();
            for tiling in [Tiling::Narrow, Tiling::Wide] {
                let gemm = Gemm::with_tiling(&gpu, tiling).unwrap();
                let mut rng = Rng::new(13);
                let (experts, rows, cols, k, tokens) = (5, 7, 100, 2, 70);
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
                let step = step_buffer(&gpu, 0, tokens);
                for e in 0..experts {
                    let count = groups[2 * e + 1];
                    if count == 0 {
                        continue;
                    }
                    let b = GroupedBuffers { x: &xb, y: &yb, groups: &gb, pairs: &pb };
                    run(&gpu, &gemm.plan_expert(&gpu, &weight, e, rows, k, &step, b), count);
                }
                let got: Vec<f32> = gpu.read_buffer(&yb, tokens * k * rows).unwrap();
                let want: Vec<f32> = (0..tokens * k)
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
                assert_close(
                    &got,
                    &want,
                    1e-4,
                    &format!("grouped gemm, binding limit {limit:?}, {tiling:?} tiles"),
                );
            }
        }
    }
}

#[test]
fn copy_kernel_copies() {
    on_each_backend(|gpu| {
        let data: Vec<f32> = Rng::new(14).vec(1000, 1.0);
        let src = gpu.storage_buffer_init("src", &data);
        let dst = gpu.storage_buffer("dst", 1000).unwrap();
        let copy = wgspark::kernels::copy::Copy::new(gpu).unwrap();
        run(gpu, &[copy.plan(gpu, &src, &dst, 4000)], 1);
        assert_eq!(gpu.read_buffer::<f32>(&dst, 1000).unwrap(), data);
    });
}
