//! Kernel throughput on the current adapter (`WGSPARK_BACKEND`): GEMV
//! bandwidth (plain and fused, over workgroup shapes; bf16 and quantized) as a fraction of the
//! copy bandwidth measured in the same run, GEMM TFLOP/s, and attention
//! time by depth and cache format. `cargo bench --bench kernel_throughput`
//! runs every section; `-- gemv` (or `copy`, `gemm`, `quantized`, `attention`, `paged`) one of them,
//! `-- quantized Q4_K Q8_0` some formats (`-- gemm 28672x4096 Q8_0` a shape
//! and formats), `-- attention chunk` prompt chunks alone.

use wgspark::gpu::{Dispatch, Gpu, GpuTensor};
use wgspark::kernels::attention::{
    AttentionBindings, AttentionShape, CoopLayout, PagedRows, PagedSplits, QkNormWeights, SplitScratch,
};
use wgspark::kernels::gemm::{Epilogue, GemmKernel, HalfCopies, Tiling};
use wgspark::kernels::gemv::{GemvShape, GemvSpec, Input, Output, Rows, has_int8_units};
use wgspark::kernels::residual::LayerOutput;
use wgspark::kernels::{Attention, Gemm, Gemv, Step};
use wgspark::kv_cache::Heads;
use wgspark::model::QkNorm;
use wgspark::{KvFormat, WeightFormat};

/// Seconds per repetition of `dispatches` (GPU timestamps where the
/// adapter has them), `reps` repetitions in one pass; `split_grid`: the
/// grid's z for a split attention.
fn time(gpu: &Gpu, dispatches: &[Dispatch], split_grid: Option<u32>, n_tokens: u32, reps: usize) -> f64 {
    let secs = gpu
        .time_pass(reps as u32, |pass, _| {
            for d in dispatches {
                match split_grid {
                    Some(z) => d.encode_grid(pass, [d.workgroups[0], d.workgroups[1], z]),
                    None => d.encode(pass, n_tokens),
                }
            }
        })
        .unwrap();
    secs.as_secs_f64() / reps as f64
}

/// A xorshift generator: the benchmark's data, the same in every run.
struct Xorshift(u64);

impl Xorshift {
    fn new() -> Self {
        Xorshift(0x2545_f491_4f6c_dd1d)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in -0.5 .. 0.5.
    fn centred(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// A tensor of random values in `format` (quantized formats: random block
/// bytes, whose values do not matter to the time).
fn random_tensor(gpu: &Gpu, format: WeightFormat, rows: usize, cols: usize) -> GpuTensor {
    let t = GpuTensor::alloc_in(gpu, "w", format, rows, cols, 1).unwrap();
    let mut rng = Xorshift::new();
    let bytes: Vec<u8> = if format == WeightFormat::Bf16 {
        (0..rows * cols).flat_map(|_| half::bf16::from_f32(rng.centred() * 0.05).to_le_bytes()).collect()
    } else {
        (0..rows * format.gpu_row_bytes(cols)).map(|_| (rng.next() >> 32) as u8).collect()
    };
    t.write_rows(gpu, 0, &bytes);
    t
}

/// `n` activations in -1 .. 1. Matrix units draw less power on constant
/// or zero operands, and so may hold higher clocks than on a model's
/// data: a product is timed on values like those it meets in the flow.
fn random_activations(n: usize) -> Vec<f32> {
    let mut rng = Xorshift::new();
    (0..n).map(|_| 2.0 * rng.centred()).collect()
}

fn step(gpu: &Gpu, pos0: u32, n_tokens: u32, attn_splits: u32) -> wgpu::Buffer {
    let s = Step { pos0, n_tokens, attn_splits, decode_rows: 0, attend_tiles: 0 };
    let b = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("step"),
        size: (std::mem::size_of::<Step>() as u64).next_multiple_of(16),
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    gpu.queue.write_buffer(&b, 0, bytemuck::bytes_of(&s));
    b
}

fn main() {
    // SAFETY: first thing in main, before any other thread starts.
    unsafe { wgspark::set_runtime_dir_if_missing() };
    let gpu = Gpu::from_env().expect("an adapter");
    println!("adapter: {}", gpu.describe());
    let cpu = gpu.caps.is_cpu;
    let bandwidth = wgspark::kernels::copy::bandwidth(
        &gpu,
        if cpu { 16 << 20 } else { 1 << 30 },
        if cpu { 2 } else { 10 },
    )
    .unwrap();
    let copy = bandwidth.best;
    println!(
        "copy bandwidth: {:.3} TB/s (read + write; buffer copy {:.3}, copy kernel {:.3})",
        copy / 1e12,
        bandwidth.api / 1e12,
        bandwidth.kernel / 1e12
    );
    let reps = if cpu { 2 } else { 50 };
    // `kernel_throughput [SECTION [ARG...]]`: one section; `quantized
    // Q4_K Q6_K` in those formats only, `gemm 28672x4096` in that shape
    // only, `attention chunk` prompt chunks only.
    let positional: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let section = positional.first();
    let runs = |name: &str| section.is_none_or(|s| s == name);
    let section_args = &positional[positional.len().min(1)..];
    if !cpu && runs("copy") {
        let bytes = 1u64 << 30;
        let (a, b) =
            (gpu.storage_buffer_bytes("a", bytes).unwrap(), gpu.storage_buffer_bytes("b", bytes).unwrap());
        // The least a dependent dispatch takes here: a 4 KiB copy, timed as
        // every kernel below is (what no kernel's time can go under).
        let small = wgspark::kernels::copy::plan_with(&gpu, &a, &b, 4096, 1).unwrap();
        println!("dispatch floor (4 KiB copy): {:.2} us", time(&gpu, &[small], None, 1, reps) * 1e6);
        for per_thread in [2, 4, 8, 16] {
            let d = wgspark::kernels::copy::plan_with(&gpu, &a, &b, bytes, per_thread).unwrap();
            let secs = time(&gpu, &[d], None, 1, 10);
            println!(
                "copy kernel, {per_thread:>2} vec4 per invocation: {:.3} TB/s",
                2.0 * bytes as f64 / secs / 1e12
            );
        }
    }

    let default_shape = GemvShape::for_gpu(&gpu);
    let mut shapes = vec![default_shape];
    if !cpu {
        let lanes = default_shape.threads_per_row;
        for unroll in [1, 2, 4] {
            for rows in [2, 4, 8, 16] {
                let shape = GemvShape {
                    rows_per_workgroup: rows,
                    threads_per_row: lanes,
                    unroll,
                    norm_unroll: unroll,
                    ..default_shape
                };
                if shape != default_shape {
                    shapes.push(shape);
                }
            }
        }
    }
    let sizes: &[(usize, usize)] = if cpu {
        &[(1536, 576), (49152, 576)]
    } else {
        &[
            (6144, 4096),
            (4096, 4096),
            (28672, 4096),
            (4096, 14336),
            (128256, 4096),
            (3072, 2048),
            (16384, 2048),
            (1536, 2048),
        ]
    };
    let norm = GpuTensor::vector_f32(&gpu, "norm", &vec![1.0f32; 16384]).unwrap();
    for &(rows, cols) in sizes.iter().filter(|_| runs("gemv")) {
        let w = random_tensor(&gpu, WeightFormat::Bf16, rows, cols);
        let norm_w = GpuTensor { cols, ..norm.clone() };
        let x = gpu.storage_buffer_init("x", &vec![0.01f32; cols]);
        let y = gpu.storage_buffer("y", rows).unwrap();
        let bytes = (rows * cols * 2) as f64;
        for shape in &shapes {
            let gemv = Gemv::with_shape(&gpu, *shape);
            let variants = [
                ("plain", GemvSpec::plain(&w, &x, &y)),
                (
                    "norm",
                    GemvSpec {
                        input: Input::RmsNorm { weight: &norm_w, eps: 1e-5 },
                        ..GemvSpec::plain(&w, &x, &y)
                    },
                ),
                (
                    "norm+swiglu",
                    GemvSpec {
                        input: Input::RmsNorm { weight: &norm_w, eps: 1e-5 },
                        output: Output::Swiglu,
                        ..GemvSpec::plain(&w, &x, &y)
                    },
                ),
                (
                    "add",
                    GemvSpec { output: Output::Add(LayerOutput::default()), ..GemvSpec::plain(&w, &x, &y) },
                ),
            ];
            for (name, spec) in variants {
                let secs = time(&gpu, &gemv.plan(&gpu, &spec).unwrap(), None, 1, reps);
                println!(
                    "gemv {rows:>6} x {cols:>5} {name:<12} {:>2} rows/wg x{}: {:8.4} ms, {:.3} TB/s = {:5.1}% of copy",
                    shape.rows_per_workgroup,
                    shape.unroll_for(&spec, false),
                    secs * 1e3,
                    bytes / secs / 1e12,
                    100.0 * bytes / secs / copy
                );
            }
        }
    }

    // Routers: a MoE layer's expert logits from its normed input, in the
    // formats checkpoints store them (GGUF keeps them f32), Qwen3-30B-A3B's
    // 128 x 2048 and Mixtral's 8 x 4096.
    for &(rows, cols) in [(128usize, 2048usize), (8, 4096)].iter().filter(|_| runs("router")) {
        for format in [WeightFormat::F32, WeightFormat::Bf16] {
            let w = random_tensor(&gpu, format, rows, cols);
            let norm_w = GpuTensor { cols, ..norm.clone() };
            let x = gpu.storage_buffer_init("x", &vec![0.01f32; cols]);
            let y = gpu.storage_buffer("y", rows).unwrap();
            let spec = GemvSpec {
                input: Input::RmsNorm { weight: &norm_w, eps: 1e-5 },
                ..GemvSpec::plain(&w, &x, &y)
            };
            // The default (spread: one group per workgroup) and, on GPUs,
            // more groups per workgroup and other unrolls.
            let mut router_shapes = vec![("default".to_string(), default_shape)];
            if !cpu {
                for groups in [1, 2, 4] {
                    for unroll in [1, 2, 4] {
                        let shape = GemvShape {
                            rows_per_workgroup: groups,
                            unroll,
                            spread_below: 0,
                            ..default_shape
                        };
                        router_shapes.push((format!("{groups} groups x{unroll}"), shape));
                    }
                }
            }
            for (name, shape) in &router_shapes {
                let plan = Gemv::with_shape(&gpu, *shape).plan(&gpu, &spec).unwrap();
                let secs = time(&gpu, &plan, None, 1, reps);
                println!("router {format:<5} {rows:>4} x {cols:>5} norm {name:<14}: {:8.4} ms", secs * 1e3);
            }
        }
    }

    // GEMM: each kernel the device runs, bf16 and Q4_K weights (or the
    // formats named: `gemm 28672x4096 Q8_0 Q6_K`), on 512 and 4096 tokens:
    // the 8B shape's projections and head, Qwen3-30B-A3B's expert gate/up,
    // the 1B shape's q/k/v and down projections.
    let gemm_sizes: &[(usize, usize)] = if cpu {
        &[(1536, 576)]
    } else {
        &[
            (6144, 4096),
            (28672, 4096),
            (4096, 14336),
            (128256, 4096),
            (1536, 2048),
            (3072, 2048),
            (2048, 8192),
        ]
    };
    // The wide f32 tiling, the cooperative kernel split in its chosen tile
    // and unsplit (the default) in its chosen tile and every tile that fits.
    let kernels: Vec<GemmKernel> = Gemm::kernels(&gpu)
        .into_iter()
        .filter(|k| match k {
            GemmKernel::Alu(tiling) => *tiling == Tiling::Wide,
            GemmKernel::Cooperative { split, tile } => !split || tile.is_none(),
        })
        .collect();
    let builds = |format: WeightFormat, kernel: &GemmKernel| match kernel {
        GemmKernel::Cooperative { split, tile: Some(tile) } => {
            tile.fits(&wgspark::kernels::gemm_coop::flags(&gpu, format, *split))
        }
        _ => true,
    };
    // `gemm 28672x4096 ...`: those weight shapes (rows x cols) only, listed or not.
    let picked: Vec<(usize, usize)> = section_args
        .iter()
        .filter_map(|a| a.split_once('x').and_then(|(r, c)| Some((r.parse().ok()?, c.parse().ok()?))))
        .collect();
    let gemm_sizes = if picked.is_empty() { gemm_sizes.to_vec() } else { picked };
    let named: Vec<WeightFormat> =
        WeightFormat::ALL.into_iter().filter(|f| section_args.contains(&f.to_string())).collect();
    let gemm_formats = if named.is_empty() { vec![WeightFormat::Bf16, WeightFormat::Q4K] } else { named };
    // `gemm tokens=16,64 ...`: those token counts (a batch's decode steps).
    let gemm_tokens: Vec<u32> = match section_args.iter().find_map(|a| a.strip_prefix("tokens=")) {
        Some(list) => list.split(',').map(|n| n.parse().expect("tokens=N,N,...")).collect(),
        None if cpu => vec![16],
        None => vec![512, 4096],
    };
    for &(rows, cols) in gemm_sizes.iter().filter(|_| runs("gemm")) {
        for &format in &gemm_formats {
            let w = random_tensor(&gpu, format, rows, cols);
            for &tokens in &gemm_tokens {
                let values = random_activations(tokens as usize * cols);
                let x = gpu.storage_buffer_init("x", &values);
                let y = gpu.storage_buffer("y", tokens as usize * rows).unwrap();
                let s = step(&gpu, 0, tokens, 1);
                // The chosen tile also reading f16 copies of the activations
                // (where the product takes them: the flow's default).
                let halves: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
                let x16 = gpu.storage_buffer_init("x16", &halves);
                let copies = HalfCopies { x: Some(&x16), y: None };
                for kernel in kernels.iter().filter(|k| builds(format, k)) {
                    let gemm = Gemm::with_kernel(&gpu, *kernel).unwrap();
                    let chosen = matches!(kernel, GemmKernel::Cooperative { tile: None, .. });
                    let reads =
                        if chosen && gemm.takes_half_copies(&w) { vec![false, true] } else { vec![false] };
                    for f16_copies in reads {
                        let half = if f16_copies { copies } else { HalfCopies::default() };
                        let (n, step) = (tokens as usize, &s);
                        let d = gemm
                            .plan_apart(&gpu, &w, Epilogue::Plain, n, step, &x, (&y, None), half)
                            .unwrap();
                        time(&gpu, &d, None, tokens, 1);
                        let secs = time(&gpu, &d, None, tokens, if cpu { 1 } else { 5 });
                        let flops = 2.0 * (rows * cols) as f64 * tokens as f64;
                        let label = format!("{kernel:?}{}", if f16_copies { " f16 copies" } else { "" });
                        println!(
                            "gemm {format:<5} {tokens:>4} x {rows:>6} x {cols:>5} {label:<47}: {:8.3} ms, {:6.2} TFLOP/s",
                            secs * 1e3,
                            flops / secs / 1e12
                        );
                    }
                    // A given tile over few tokens, also as partial sums
                    // over 2, 4 and 8 ranges of k.
                    let tiled = matches!(kernel, GemmKernel::Cooperative { tile: Some(_), split: false });
                    for splits in
                        [2, 4, 8].into_iter().filter(|&n| tiled && tokens <= 128 && cols % (n * 256) == 0)
                    {
                        let partial = gpu.storage_buffer("partial", splits * tokens as usize * rows).unwrap();
                        let d = gemm
                            .plan_dense(
                                &gpu,
                                &w,
                                Epilogue::Plain,
                                (tokens as usize, splits),
                                &s,
                                &x,
                                (&partial, None),
                                HalfCopies::default(),
                            )
                            .unwrap();
                        time(&gpu, &d, None, tokens, 1);
                        let secs = time(&gpu, &d, None, tokens, 5);
                        let label = format!("{kernel:?}, k in {splits}");
                        println!(
                            "gemm {format:<5} {tokens:>4} x {rows:>6} x {cols:>5} {label:<47}: {:8.3} ms, {:6.2} TFLOP/s",
                            secs * 1e3,
                            2.0 * (rows * cols) as f64 * tokens as f64 / secs / 1e12
                        );
                    }
                    // As partial sums over k, where a residual add's
                    // product would split (Gemm::plan_summed).
                    let parts = gemm.summed_splits(&gpu, &w, tokens as usize);
                    if chosen && parts > 1 {
                        let partial = gpu.storage_buffer("partial", parts * tokens as usize * rows).unwrap();
                        let (d, _) = gemm
                            .plan_summed(&gpu, &w, tokens as usize, &s, (&x, Some(&x16)), &partial)
                            .unwrap();
                        time(&gpu, &d, None, tokens, 1);
                        let secs = time(&gpu, &d, None, tokens, 5);
                        let label = format!("{kernel:?} f16 copies, k in {parts}");
                        println!(
                            "gemm {format:<5} {tokens:>4} x {rows:>6} x {cols:>5} {label:<47}: {:8.3} ms, {:6.2} TFLOP/s",
                            secs * 1e3,
                            2.0 * (rows * cols) as f64 * tokens as f64 / secs / 1e12
                        );
                    }
                }
            }
        }
    }

    // Quantized GEMV: the formats of llama.cpp's common presets and FP8, on the
    // 8B shape's projections and head.
    let formats = [
        WeightFormat::Q4K,
        WeightFormat::Q6K,
        WeightFormat::Q8_0,
        WeightFormat::Q5K,
        WeightFormat::Q4_0,
        WeightFormat::Q3K,
        WeightFormat::Q2K,
        WeightFormat::F8E4M3,
    ];
    let sizes: &[(usize, usize)] = if cpu {
        &[(1536, 512)]
    } else {
        &[(1024, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    };
    let read_by = [
        ("default", default_shape),
        ("x1", GemvShape { unroll: 1, ..default_shape }),
        ("x4", GemvShape { unroll: 4, ..default_shape }),
        (
            "wg 256",
            GemvShape { int8_rows_per_workgroup: 256 / default_shape.threads_per_row, ..default_shape },
        ),
        (
            "wg 1024",
            GemvShape { int8_rows_per_workgroup: 1024 / default_shape.threads_per_row, ..default_shape },
        ),
        (
            "wg 128",
            GemvShape { int8_rows_per_workgroup: 128 / default_shape.threads_per_row, ..default_shape },
        ),
        ("wg 64", GemvShape { int8_rows_per_workgroup: 64 / default_shape.threads_per_row, ..default_shape }),
        ("one block each", GemvShape { int8_workgroups: 0, ..default_shape }),
        ("132 wgs", GemvShape { int8_workgroups: 132, ..default_shape }),
        ("264 wgs", GemvShape { int8_workgroups: 264, ..default_shape }),
        ("f32", GemvShape { int8: false, ..default_shape }),
        ("f32 quads", GemvShape { units: false, int8: false, ..default_shape }),
    ];
    // `quantized IQ2_XXS ...`: any formats named, else the list above.
    let named: Vec<WeightFormat> =
        WeightFormat::ALL.into_iter().filter(|f| section_args.contains(&f.to_string())).collect();
    let formats = if named.is_empty() { formats.to_vec() } else { named };
    for format in formats.into_iter().filter(|_| runs("quantized")) {
        for &(rows, cols) in sizes {
            let bytes = rows * format.gpu_row_bytes(cols);
            // Enough copies that they do not stay in the GPU's cache.
            let copies = if cpu { 1 } else { (512 << 20) / bytes + 1 };
            let ws: Vec<GpuTensor> = (0..copies).map(|_| random_tensor(&gpu, format, rows, cols)).collect();
            let norm_w = GpuTensor { cols, ..norm.clone() };
            let x = gpu.storage_buffer_init("x", &vec![0.01f32; cols]);
            let y = gpu.storage_buffer("y", rows).unwrap();
            // The default timed again after the others: a size's first
            // variant can run slow on fresh buffers (slower than the next
            // row, which differs from it in its unroll alone).
            let again = ("again", default_shape);
            for (read, shape) in read_by.iter().chain([&again]) {
                let k_quant = matches!(
                    format,
                    WeightFormat::Q2K
                        | WeightFormat::Q3K
                        | WeightFormat::Q4K
                        | WeightFormat::Q5K
                        | WeightFormat::Q6K
                );
                // Variants that read the format as the default does.
                let int8 = has_int8_units(format);
                let int8_variant = shape.int8_rows_per_workgroup != default_shape.int8_rows_per_workgroup;
                if (!shape.units && !k_quant) || (!shape.int8 && !int8) || (int8_variant && !int8) {
                    continue;
                }
                let gemv = Gemv::with_shape(&gpu, *shape);
                let dispatches: Vec<Dispatch> = ws
                    .iter()
                    .flat_map(|w| {
                        let spec = if rows == 28672 {
                            GemvSpec {
                                input: Input::RmsNorm { weight: &norm_w, eps: 1e-5 },
                                output: Output::Swiglu,
                                ..GemvSpec::plain(w, &x, &y)
                            }
                        } else {
                            GemvSpec::plain(w, &x, &y)
                        };
                        gemv.plan(&gpu, &spec).unwrap()
                    })
                    .collect();
                // The first passes over fresh buffers are slower (clocks
                // rise after the host's uploads, and a warm-up alone can
                // leave the first variant of a size slow): warm up, then
                // the best of three timed passes.
                time(&gpu, &dispatches, None, 1, 20);
                let secs =
                    (0..3).map(|_| time(&gpu, &dispatches, None, 1, reps)).fold(f64::INFINITY, f64::min)
                        / copies as f64;
                let print = |read: &str, secs: f64| {
                    println!(
                        "gemv {format:<5} {rows:>6} x {cols:>5}{:<12} {read:<9}: {:8.4} ms, {:.3} TB/s = {:5.1}% of copy",
                        if rows == 28672 { " norm+swiglu" } else { "" },
                        secs * 1e3,
                        bytes as f64 / secs / 1e12,
                        100.0 * bytes as f64 / secs / copy
                    )
                };
                print(read, secs);
                if *read == "default" && copies > 1 && bytes < 32 << 20 {
                    // One copy, read again and again from the GPU's cache:
                    // what the kernel takes when memory is not its limit.
                    let cached = time(&gpu, &dispatches[..1], None, 1, reps);
                    print("in cache", cached);
                }
            }
        }
    }

    // Routed experts of Qwen3-30B-A3B's geometry (128 experts of 768 x
    // 2048, top 8) at decode: every slot's normed gate/up in one dispatch,
    // the router-weighted sum of their down projections in another; bytes
    // are those of the 8 experts read.
    let (experts, top_k, hidden, inter) = (128usize, 8usize, 2048usize, 768usize);
    let ids = gpu.storage_buffer_init("ids", &[3u32, 17, 40, 58, 77, 90, 101, 126]);
    let route = gpu.storage_buffer_init("route", &[0.125f32; 8]);
    for format in [WeightFormat::Bf16, WeightFormat::Q4K, WeightFormat::Q6K, WeightFormat::Q8_0]
        .into_iter()
        .filter(|_| runs("experts") && !cpu)
    {
        let gate_up = random_tensor(&gpu, format, experts * 2 * inter, hidden);
        let down = random_tensor(&gpu, format, experts * hidden, inter);
        let norm_w = GpuTensor { cols: hidden, ..norm.clone() };
        let x = gpu.storage_buffer_init("x", &vec![0.01f32; hidden]);
        let act = gpu.storage_buffer_init("act", &vec![0.01f32; top_k * inter]);
        let y = gpu.storage_buffer("y", top_k * inter.max(hidden)).unwrap();
        let mut shapes =
            vec![("default", default_shape), ("f32", GemvShape { int8: false, ..default_shape })];
        if has_int8_units(format) {
            for (name, threads) in [("wg 64", 64), ("wg 128", 128), ("wg 256", 256), ("wg 1024", 1024)] {
                let groups = threads / default_shape.threads_per_row;
                shapes.push((name, GemvShape { int8_rows_per_workgroup: groups, ..default_shape }));
            }
            for (name, sum_unroll) in [("unroll 1", 1), ("unroll 2", 2), ("unroll 8", 8)] {
                shapes.push((name, GemvShape { sum_unroll, ..default_shape }));
            }
        } else {
            shapes.truncate(1);
        }
        for (name, shape) in shapes {
            let gemv = Gemv::with_shape(&gpu, shape);
            let gu = GemvSpec {
                input: Input::RmsNorm { weight: &norm_w, eps: 1e-5 },
                output: Output::Swiglu,
                rows: Rows::Slots { ids: &ids, top_k, expert_rows: 2 * inter },
                ..GemvSpec::plain(&gate_up, &x, &y)
            };
            let dn = GemvSpec {
                output: Output::Add(LayerOutput::default()),
                rows: Rows::Sum { ids: &ids, weights: &route, top_k, expert_rows: hidden },
                ..GemvSpec::plain(&down, &act, &y)
            };
            for (what, spec, rows, cols) in [("gate/up", gu, 2 * inter, hidden), ("down", dn, hidden, inter)]
            {
                let d = gemv.plan(&gpu, &spec).unwrap();
                time(&gpu, &d, None, 1, 20);
                let secs = time(&gpu, &d, None, 1, reps);
                let bytes = (top_k * rows * format.gpu_row_bytes(cols)) as f64;
                println!(
                    "experts {format:<5} {what:<8} 8 x {rows:>5} x {cols:>5} {name:<8}: {:8.4} ms, {:.3} TB/s = {:5.1}% of copy",
                    secs * 1e3,
                    bytes / secs / 1e12,
                    100.0 * bytes / secs / copy
                );
            }
        }
    }

    // Attention of Llama-3.1-8B's and Llama-3.2-1B's geometry by depth and
    // cache format, and of Qwen3-30B-A3B's with its per-head q/k norm.
    let attention = Attention::new(&gpu);
    // Chunks in every layout of the cooperative-matrix kernel the device
    // has memory for (else the default kernels alone).
    let mut chunk_kernels: Vec<(String, Attention)> = CoopLayout::fitting(&gpu)
        .filter(|_| gpu.caps.cooperative_matrix)
        .map(|l| (format!(", {} subgroups", l.subgroups), Attention::with_coop_layout(&gpu, l)))
        .collect();
    if chunk_kernels.is_empty() {
        chunk_kernels.push((String::new(), attention));
    }
    let depths: &[usize] = if cpu { &[64] } else { &[64, 512, 4096, 16384] };
    let geometries = [
        (Heads { q: 32, kv: 8, dim: 128 }, KvFormat::F16, QkNorm::None),
        (Heads { q: 32, kv: 8, dim: 128 }, KvFormat::F32, QkNorm::None),
        (Heads { q: 32, kv: 8, dim: 64 }, KvFormat::F16, QkNorm::None),
        (Heads { q: 32, kv: 4, dim: 128 }, KvFormat::F16, QkNorm::PerHead),
    ];
    let norm_weight = GpuTensor::vector_f32(&gpu, "qk_norm", &vec![1.0f32; 128]).unwrap();
    // `attention chunk`: the prompt chunks alone, on the caches they run on
    // cooperative matrices with.
    let chunks_only = section_args.iter().any(|a| a == "chunk");
    for (heads, format, norm) in
        geometries.into_iter().filter(|g| runs("attention") && !(chunks_only && g.1 == KvFormat::F32))
    {
        for &ctx in depths {
            // f16 values in -1 .. 1, two a word.
            let cache: Vec<half::f16> =
                random_activations(2 * ctx * heads.kv_width()).into_iter().map(half::f16::from_f32).collect();
            let k_cache = gpu.storage_buffer_init("k_cache", &cache);
            let v_cache = gpu.storage_buffer_init("v_cache", &cache);
            let cos_sin = gpu.storage_buffer_init("cos_sin", &random_activations(ctx * heads.dim));
            let shape = attention_shape(heads, norm, format, &norm_weight);
            let max_splits = wgspark::kernels::attention::MAX_SPLITS;
            let acc = gpu.storage_buffer("split_acc", heads.q * max_splits * heads.dim).unwrap();
            let max_sum = gpu.storage_buffer("split_max_sum", heads.q * max_splits * 2).unwrap();
            let token_counts = if cpu { vec![1u32, 8] } else { vec![1, 512, 2048] };
            for tokens in token_counts.into_iter().filter(|&t| t as usize <= ctx && !(chunks_only && t == 1))
            {
                let qkv =
                    gpu.storage_buffer_init("qkv", &random_activations(tokens as usize * heads.qkv_width()));
                let out = gpu.storage_buffer("out", tokens as usize * heads.q * heads.dim).unwrap();
                let pos0 = ctx as u32 - tokens;
                let splits =
                    if tokens == 1 { Attention::decode_splits(ctx, heads.kv, max_splits) } else { 1 };
                let s = step(&gpu, pos0, tokens, splits as u32);
                let b = attention_bindings(&s, &qkv, &cos_sin, (&k_cache, &v_cache), &out);
                if tokens == 1 && ctx <= 4096 && format == KvFormat::F16 {
                    // How the time scales with the keys per split.
                    let scratch = SplitScratch { acc: &acc, max_sum: &max_sum };
                    let d = attention.plan_decode(&gpu, &shape, &b, &scratch).unwrap();
                    for sweep in [1, 2, 4, 8, 16, 32, 64, 128].into_iter().filter(|&n| n <= ctx as u32) {
                        let value =
                            Step { pos0, n_tokens: 1, attn_splits: sweep, decode_rows: 0, attend_tiles: 0 };
                        gpu.queue.write_buffer(&s, 0, bytemuck::bytes_of(&value));
                        let attend = time(&gpu, std::slice::from_ref(&d.attend), Some(sweep), 1, reps);
                        let combine = time(&gpu, std::slice::from_ref(&d.combine), None, 1, reps);
                        println!(
                            "  {sweep:>3} splits: attend {:.4} ms, combine {:.4} ms",
                            attend * 1e3,
                            combine * 1e3
                        );
                    }
                    let value = Step {
                        pos0,
                        n_tokens: 1,
                        attn_splits: splits as u32,
                        decode_rows: 0,
                        attend_tiles: 0,
                    };
                    gpu.queue.write_buffer(&s, 0, bytemuck::bytes_of(&value));
                }
                let timings: Vec<(&str, f64)> = if tokens == 1 {
                    let d = attention
                        .plan_decode(&gpu, &shape, &b, &SplitScratch { acc: &acc, max_sum: &max_sum })
                        .unwrap();
                    let attend = time(&gpu, std::slice::from_ref(&d.attend), Some(splits as u32), 1, reps);
                    let combine = if splits > 1 {
                        time(&gpu, std::slice::from_ref(&d.combine), None, 1, reps)
                    } else {
                        0.0
                    };
                    println!("  attend {:.4} ms, combine {:.4} ms", attend * 1e3, combine * 1e3);
                    vec![("", attend + combine)]
                } else {
                    let chunk_reps = if cpu { 1 } else { 5 };
                    let time_chunk = |a: &Attention| {
                        time(&gpu, &a.plan_chunk(&gpu, &shape, &b).unwrap(), None, tokens, chunk_reps)
                    };
                    chunk_kernels.iter().map(|(name, a)| (name.as_str(), time_chunk(a))).collect()
                };
                let kv_bytes = (2 * ctx * heads.kv_width() * format.bytes_per_value()) as f64;
                for (layout, secs) in timings {
                    // (f32 caches read the same words as f16 values: only the timing matters here.)
                    println!(
                        "attention {format:?} {}/{} heads x {}{}, {tokens} tokens ending at {ctx} ({splits} splits{layout}): {:.4} ms{}",
                        heads.q,
                        heads.kv,
                        heads.dim,
                        if norm == QkNorm::None { "" } else { ", q/k norm" },
                        secs * 1e3,
                        if tokens == 1 {
                            format!(", {:.1}% of copy bandwidth", 100.0 * kv_bytes / secs / copy)
                        } else {
                            // Causal: token t sees pos0 + t + 1 keys; q k^T and P V.
                            let row_keys = (0..tokens as u64).map(|t| pos0 as u64 + t + 1).sum::<u64>();
                            let flops = 4.0 * (row_keys * (heads.q * heads.dim) as u64) as f64;
                            format!(", {:.1} TFLOP/s", flops / secs / 1e12)
                        }
                    );
                }
            }
        }
    }
    if runs("paged") {
        // `paged rows=1,2`: attend_lanes with those query rows per
        // workgroup as well as its own choice.
        let lane_rows: Vec<usize> = match section_args.iter().find_map(|a| a.strip_prefix("rows=")) {
            Some(list) => list.split(',').map(|n| n.parse().expect("rows=N,N,...")).collect(),
            None => Vec::new(),
        };
        paged_decode(&gpu, copy, reps, &lane_rows);
    }
}

/// A layer's attention of `heads`, rotating whole heads, no window, its
/// q/k norm (if any) weighted by `norm_weight`, over a cache in `format`.
fn attention_shape(
    heads: Heads,
    norm: QkNorm,
    format: KvFormat,
    norm_weight: &GpuTensor,
) -> AttentionShape<'_> {
    AttentionShape {
        heads,
        rotary_dim: heads.dim,
        scale: 0.088,
        window: 0,
        qk_norm: (norm != QkNorm::None).then_some(QkNormWeights {
            mode: norm,
            q: norm_weight,
            k: norm_weight,
            eps: 1e-6,
        }),
        kv_format: format,
        chunk_precision: Default::default(),
    }
}

/// The bindings of an attention whose value rows follow the keys in
/// `qkv`, without f16 copies of its output.
fn attention_bindings<'a>(
    step: &'a wgpu::Buffer,
    qkv: &'a wgpu::Buffer,
    cos_sin: &'a wgpu::Buffer,
    (k_cache, v_cache): (&'a wgpu::Buffer, &'a wgpu::Buffer),
    out: &'a wgpu::Buffer,
) -> AttentionBindings<'a> {
    AttentionBindings { step, qkv, cos_sin, k_cache, v_cache, out, values: None, out16: None }
}

/// A batch step's decode rows over a paged cache (blocks of 16 positions,
/// each sequence's scattered over the pool), as the batch engine splits
/// their keys: a workgroup per split then `combine`, or each row's splits
/// walked by one workgroup; beside them one token over a contiguous cache
/// (a session's decode). Geometries of Llama-3.1-8B and of Qwen3-30B-A3B
/// (per-head q/k norm).
fn paged_decode(gpu: &Gpu, copy: f64, reps: usize, lane_rows: &[usize]) {
    let cpu = gpu.caps.is_cpu;
    let layouts: Vec<(String, Attention)> = std::iter::once(("".to_string(), Attention::new(gpu)))
        .chain(
            lane_rows
                .iter()
                .map(|&r| (format!(", {r} rows a workgroup"), Attention::new(gpu).with_lane_rows(r))),
        )
        .collect();
    let (block, split_keys, max_splits) = (16, 64, 16);
    let norm_weight = GpuTensor::vector_f32(gpu, "qk_norm", &vec![1.0f32; 128]).unwrap();
    let depths: &[usize] = if cpu { &[100] } else { &[512, 4096] };
    let row_counts: &[usize] = if cpu { &[1, 4] } else { &[1, 4, 16, 64] };
    for (heads, norm) in [
        (Heads { q: 32, kv: 8, dim: 128 }, QkNorm::None),
        (Heads { q: 32, kv: 4, dim: 128 }, QkNorm::PerHead),
    ] {
        let shape = attention_shape(heads, norm, KvFormat::F16, &norm_weight);
        for &ctx in depths {
            for &rows in row_counts {
                let blocks = rows * ctx.div_ceil(block);
                // The pool's blocks in a shuffled order, the sequences' tables in turn.
                let mut rng = Xorshift::new();
                let mut table: Vec<u32> = (0..blocks as u32).collect();
                for i in (1..table.len()).rev() {
                    table.swap(i, (rng.next() % (i as u64 + 1)) as usize);
                }
                let per_seq = ctx.div_ceil(block);
                let meta: Vec<u32> =
                    (0..rows).flat_map(|r| [ctx as u32 - 1, (r * per_seq) as u32, r as u32, 0]).collect();
                let words = blocks * block * heads.kv_width() / 2;
                let cache: Vec<u32> = (0..words)
                    .map(|_| {
                        let (a, b) = (half::f16::from_f32(rng.centred()), half::f16::from_f32(rng.centred()));
                        a.to_bits() as u32 | (b.to_bits() as u32) << 16
                    })
                    .collect();
                let k_cache = gpu.storage_buffer_init("k_pool", &cache);
                let v_cache = gpu.storage_buffer_init("v_pool", &cache);
                let qkv = gpu.storage_buffer_init("qkv", &random_activations(rows * heads.qkv_width()));
                let cos_sin = gpu.storage_buffer_init("cos_sin", &random_activations(rows * heads.dim));
                let out = gpu.storage_buffer("out", rows * heads.q * heads.dim).unwrap();
                let acc = gpu.storage_buffer("split_acc", rows * heads.q * max_splits * heads.dim).unwrap();
                let max_sum = gpu.storage_buffer("split_max_sum", rows * heads.q * max_splits * 2).unwrap();
                let (meta_b, table_b) =
                    (gpu.storage_buffer_init("rows", &meta), gpu.storage_buffer_init("block_table", &table));
                let unused_step = step(gpu, 0, rows as u32, 1);
                let b = attention_bindings(&unused_step, &qkv, &cos_sin, (&k_cache, &v_cache), &out);
                let splits = PagedSplits { acc: &acc, max_sum: &max_sum, split_keys, max_splits };
                let paged = PagedRows { rows: &meta_b, block_table: &table_b, block_size: block, splits };
                for (layout, attention) in &layouts {
                    let plan = attention.plan_paged(gpu, &shape, &b, &paged).unwrap();
                    let n = rows as u32;
                    let timed = |walks: bool| {
                        let dispatches = plan.dispatches_walking(n, n, 0, walks);
                        let record = |pass: &mut wgpu::ComputePass<'_>, _| {
                            for &(d, r) in &dispatches {
                                d.encode(pass, r);
                            }
                        };
                        gpu.time_pass(2, record).unwrap();
                        gpu.time_pass(reps as u32, record).unwrap().as_secs_f64() / reps as f64
                    };
                    let (apart, walked) = (timed(false), timed(true));
                    let kv_bytes = (2 * rows * ctx * heads.kv_width() * 2) as f64;
                    let share = |secs: f64| 100.0 * kv_bytes / secs / copy;
                    println!(
                        "paged decode {}/{} heads x {}{}{layout}, {rows:>2} rows at {ctx:>4} keys: split {:.4} ms ({:.1}% of copy), \
                     walked {:.4} ms ({:.1}%); the engine walks: {}",
                        heads.q,
                        heads.kv,
                        heads.dim,
                        if norm == QkNorm::None { "" } else { ", q/k norm" },
                        apart * 1e3,
                        share(apart),
                        walked * 1e3,
                        share(walked),
                        plan.walks(n),
                    );
                }
            }
            // One token over a contiguous cache of ctx positions.
            let cache = gpu.storage_buffer("cache", ctx * heads.kv_width() / 2).unwrap();
            let qkv = gpu.storage_buffer_init("qkv", &random_activations(heads.qkv_width()));
            let cos_sin = gpu.storage_buffer_init("cos_sin", &random_activations(ctx * heads.dim));
            let out = gpu.storage_buffer("out", heads.q * heads.dim).unwrap();
            let acc = gpu.storage_buffer("split_acc", heads.q * max_splits * heads.dim).unwrap();
            let max_sum = gpu.storage_buffer("split_max_sum", heads.q * max_splits * 2).unwrap();
            let splits = Attention::decode_splits(ctx, heads.kv, max_splits);
            let s = step(gpu, ctx as u32 - 1, 1, splits as u32);
            let b = attention_bindings(&s, &qkv, &cos_sin, (&cache, &cache), &out);
            let d = Attention::new(gpu)
                .plan_decode(gpu, &shape, &b, &SplitScratch { acc: &acc, max_sum: &max_sum })
                .unwrap();
            let record = |pass: &mut wgpu::ComputePass<'_>, _| {
                d.encode(pass, splits as u32);
            };
            gpu.time_pass(2, record).unwrap();
            let secs = gpu.time_pass(reps as u32, record).unwrap().as_secs_f64() / reps as f64;
            println!("  a session's token at {ctx} keys ({splits} splits): {:.4} ms", secs * 1e3);
        }
    }
}
