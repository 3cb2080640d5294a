//! Shared test support: the backends under test, one device per backend
//! per test binary, seeded random data and CPU references.
#![allow(dead_code)]

pub mod checkpoint;
pub mod fixtures;
pub mod reference;
pub mod steering;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use wgspark::gpu::Dispatch;
use wgspark::{Backend, Gpu, GpuOptions};

/// Backends every GPU test runs on: `WGSPARK_TEST_BACKENDS` (comma list),
/// by default Vulkan and GL. A listed backend without an adapter fails the
/// test instead of being skipped.
pub fn backends() -> Vec<Backend> {
    let list = std::env::var("WGSPARK_TEST_BACKENDS").unwrap_or_else(|_| "vulkan,gl".into());
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().expect("WGSPARK_TEST_BACKENDS names a backend"))
        .collect()
}

/// The shared device of `backend` in this test binary.
pub fn gpu(backend: Backend) -> Gpu {
    static DEVICES: OnceLock<Mutex<HashMap<String, Gpu>>> = OnceLock::new();
    let mut devices = DEVICES.get_or_init(Default::default).lock().unwrap();
    devices
        .entry(format!("{backend:?}"))
        .or_insert_with(|| {
            Gpu::new(&GpuOptions { backend, ..GpuOptions::default() })
                .unwrap_or_else(|e| panic!("backend {backend:?} is under test but unavailable: {e}"))
        })
        .clone()
}

/// Runs `f` once per backend under test, naming the backend on failure.
/// On GL one test at a time: wgpu's GL backend gives up on its context
/// lock after 6 s (a panic), and one thread's shader compile on llvmpipe
/// can hold it that long.
pub fn on_each_backend(mut f: impl FnMut(&Gpu)) {
    static GL: Mutex<()> = Mutex::new(());
    for backend in backends() {
        let gpu = gpu(backend);
        let _turn = (backend == Backend::Gl).then(|| GL.lock().unwrap_or_else(|e| e.into_inner()));
        eprintln!("-- on {}", gpu.describe());
        f(&gpu);
    }
}

/// A small deterministic generator for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 32) as u32
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        self.next_u32() as f32 / 2_147_483_648.0 - 1.0
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    pub fn below(&mut self, n: u32) -> u32 {
        self.next_u32() % n
    }
}

/// Rounds to bf16 and back, as the GPU sees weights.
pub fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
}

/// `values` rounded to f16 (to nearest, ties to even, as GPUs convert),
/// as bits.
pub fn f16_bits(values: &[f32]) -> Vec<u16> {
    values.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect()
}

/// The first `len` f16s of `buffer`, as bits.
pub fn read_f16(gpu: &Gpu, buffer: &wgpu::Buffer, len: usize) -> Vec<u16> {
    let words: Vec<u32> = gpu.read_buffer(buffer, len.div_ceil(2)).unwrap();
    words.iter().flat_map(|w| [*w as u16, (w >> 16) as u16]).take(len).collect()
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Asserts `|got - want| <= tol * (1 + |want|)` elementwise.
pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length mismatch");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w} (max abs diff {})",
            max_abs_diff(got, want)
        );
    }
}

/// Encodes `dispatches` for `n_tokens` in one pass, submits and waits.
pub fn run(gpu: &Gpu, dispatches: &[Dispatch], n_tokens: u32) {
    let mut encoder = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        wgspark::gpu::encode_all(dispatches, &mut pass, n_tokens);
    }
    gpu.queue.submit([encoder.finish()]);
    gpu.wait().unwrap();
    gpu.check("test dispatch").unwrap();
}

/// A uniform [`wgspark::kernels::Step`] buffer.
pub fn step_buffer(gpu: &Gpu, pos0: usize, n_tokens: usize, attn_splits: usize) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    let step = wgspark::kernels::Step {
        pos0: pos0 as u32,
        n_tokens: n_tokens as u32,
        attn_splits: attn_splits as u32,
        ..Default::default()
    };
    gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("step"),
        contents: bytemuck::bytes_of(&step),
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
    })
}

/// A Llama of 2 layers 2048 wide (16 query heads of 128, 4 KV heads, a
/// 2048-wide FFN, 1024 tokens) with random weights from `seed`: wide
/// enough for the products whose tiles the tests check.
pub fn wide_model(gpu: &Gpu, seed: u64) -> wgspark::Model {
    let config = r#"{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 2048,
      "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
      "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
      "tie_word_embeddings": false, "rope_theta": 500000.0}"#;
    let config = wgspark::model::ModelConfig::parse(config, std::path::Path::new("config.json")).unwrap();
    wgspark::Model::synthetic(config, gpu, seed).unwrap()
}
