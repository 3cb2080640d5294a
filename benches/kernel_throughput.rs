//! Kernel throughput on the current adapter (`WGSPARK_BACKEND`): GEMV
//! bandwidth as a fraction of the copy bandwidth measured in the same run,
//! GEMM TFLOP/s, and attention time. `cargo bench --bench kernel_throughput`.

use std::time::Instant;

use wgspark::gpu::{Dispatch, Gpu, GpuTensor};
use wgspark::kernels::attention::{AttentionBindings, SplitScratch};
use wgspark::kernels::rope::RopeBindings;
use wgspark::kernels::{Attention, Gemm, Gemv, Heads, Rope, Step};

/// Seconds per repetition of `dispatches`, `reps` repetitions in one submission.
fn time(gpu: &Gpu, dispatches: &[Dispatch], n_tokens: u32, reps: usize) -> f64 {
    let run = |reps: usize| {
        let mut encoder = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            for _ in 0..reps {
                wgspark::gpu::encode_all(dispatches, &mut pass, n_tokens);
            }
        }
        let start = Instant::now();
        gpu.queue.submit([encoder.finish()]);
        gpu.wait().unwrap();
        start.elapsed().as_secs_f64()
    };
    run(1);
    (0..3).map(|_| run(reps)).fold(f64::MAX, f64::min) / reps as f64
}

fn random_tensor(gpu: &Gpu, rows: usize, cols: usize) -> GpuTensor {
    let t = GpuTensor::alloc(gpu, "w", rows, cols).unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..rows * cols)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            half::bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05).to_le_bytes()
        })
        .collect();
    t.write_rows(gpu, 0, &bytes);
    t
}

fn step(gpu: &Gpu, pos0: u32, n_tokens: u32) -> wgpu::Buffer {
    let s = Step { pos0, n_tokens, _pad: [0; 2] };
    let b = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("step"),
        size: 16,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    gpu.queue.write_buffer(&b, 0, bytemuck::bytes_of(&s));
    b
}

fn main() {
    let gpu = Gpu::from_env().expect("an adapter");
    println!("adapter: {}", gpu.describe());
    let cpu = gpu.caps.is_cpu;
    let copy = gpu.copy_bandwidth(if cpu { 16 << 20 } else { 256 << 20 }, if cpu { 2 } else { 20 }).unwrap();
    println!("copy bandwidth: {:.3} TB/s (read + write)", copy / 1e12);

    let gemv = Gemv::new(&gpu).unwrap();
    let gemm = Gemm::new(&gpu).unwrap();
    let shapes: &[(usize, usize)] = if cpu {
        &[(1536, 576), (49152, 576)]
    } else {
        &[(4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (2048, 8192), (16384, 2048)]
    };
    for &(rows, cols) in shapes {
        let w = random_tensor(&gpu, rows, cols);
        let x = gpu.storage_buffer_init("x", &vec![0.01f32; 512 * cols]);
        let y = gpu.storage_buffer("y", 512 * rows).unwrap();
        let secs = time(&gpu, &gemv.plan(&gpu, &w, &x, &y), 1, if cpu { 2 } else { 50 });
        let bytes = (rows * cols * 2) as f64;
        println!(
            "gemv {rows:>6} x {cols:>5}: {:8.3} ms, {:.3} TB/s = {:5.1}% of copy bandwidth",
            secs * 1e3,
            bytes / secs / 1e12,
            100.0 * bytes / secs / copy
        );
        let tokens = if cpu { 16 } else { 512 };
        let s = step(&gpu, 0, tokens);
        let secs =
            time(&gpu, &gemm.plan(&gpu, &w, tokens as usize, &s, &x, &y), tokens, if cpu { 1 } else { 10 });
        let flops = 2.0 * (rows * cols) as f64 * tokens as f64;
        println!(
            "gemm {tokens:>4} x {rows:>6} x {cols:>5}: {:8.3} ms, {:.2} TFLOP/s",
            secs * 1e3,
            flops / secs / 1e12
        );
    }

    // Attention of Llama-3.1-8B's geometry over 1024 cached positions.
    let heads = Heads { q: 32, kv: 8, dim: 128 };
    let ctx = if cpu { 64 } else { 1024 };
    let attention = Attention::new(&gpu).unwrap();
    let rope = Rope::new(&gpu).unwrap();
    let kv = gpu.storage_buffer_init("kv", &vec![0.01f32; ctx * heads.kv_width()]);
    let v = gpu.storage_buffer_init("v", &vec![0.02f32; ctx * heads.kv_width()]);
    let cos_sin = gpu.storage_buffer_init("cos_sin", &vec![0.5f32; ctx * heads.dim]);
    for tokens in [1u32, if cpu { 8 } else { 512 }] {
        let qkv = gpu.storage_buffer_init("qkv", &vec![0.01f32; tokens as usize * heads.qkv_width()]);
        let out = gpu.storage_buffer("out", tokens as usize * heads.q * heads.dim).unwrap();
        let pos0 = ctx as u32 - tokens;
        let s = step(&gpu, pos0, tokens);
        let splits = if tokens == 1 { Attention::decode_splits(ctx) } else { 1 };
        let acc = gpu.storage_buffer("split_acc", heads.q * splits * heads.dim).unwrap();
        let max_sum = gpu.storage_buffer("split_max_sum", heads.q * splits * 2).unwrap();
        let split = (splits > 1).then(|| (splits, SplitScratch { acc: &acc, max_sum: &max_sum }));
        let b = AttentionBindings { step: &s, qkv: &qkv, k_cache: &kv, v_cache: &v, out: &out };
        let d = attention.plan(&gpu, heads, 0.088, 0, b, split);
        let secs = time(&gpu, &d, tokens, if cpu { 1 } else { 20 });
        let r = rope.plan(
            &gpu,
            heads,
            heads.dim,
            RopeBindings { step: &s, qkv: &qkv, cos_sin: &cos_sin, k_cache: &kv, v_cache: &v },
        );
        let rope_secs = time(&gpu, &[r], tokens, if cpu { 1 } else { 20 });
        println!(
            "attention 32/8 heads x 128, {tokens} tokens ending at {ctx}: {:.3} ms (rope and KV store {:.3} ms)",
            secs * 1e3,
            rope_secs * 1e3
        );
    }
}
