//! Random weights of any shape, generated as they are uploaded: full-size
//! benchmark models without a checkpoint on disk. The routed experts of
//! every layer share one random tensor per projection, generated once and
//! kept in host memory: a streamed model then copies experts from memory,
//! as it would from a checkpoint in the page cache, without the host
//! holding a whole model's experts (their values do not change the speed,
//! and routing stays random since the routers are).

use std::borrow::Cow;
use std::sync::OnceLock;

use super::weights::TensorSource;
use crate::error::Result;

pub struct RandomWeights {
    pub seed: u64,
    /// The experts' gate, up and down tensors.
    experts: [OnceLock<Vec<u8>>; 3],
}

impl RandomWeights {
    pub fn new(seed: u64) -> Self {
        RandomWeights { seed, experts: Default::default() }
    }

    /// Which shared expert tensor `name` is, if it is one.
    fn expert_kind(name: &str) -> Option<usize> {
        let (_, which) = name.split_once(".experts.")?;
        let kind = which.rsplit('.').nth(1)?;
        ["gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"].iter().position(|k| *k == kind).map(|i| i % 3)
    }

    fn stream(&self, name: &str) -> u64 {
        // FNV-1a of the name: every tensor gets its own stream.
        let hash =
            name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        hash ^ self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
    }
}

impl TensorSource for RandomWeights {
    fn contains(&self, name: &str) -> bool {
        // The per-expert layout is the one synthetic MoE models use.
        !name.contains("experts.gate_up_proj")
    }

    fn check_shape(&self, _name: &str, _shape: &[usize]) -> Result<()> {
        Ok(())
    }

    fn stored_bytes(&self, name: &str, shape: &[usize]) -> Result<Cow<'_, [u8]>> {
        if let Some(kind) = Self::expert_kind(name) {
            let shared = self.experts[kind].get_or_init(|| self.generate(name, shape));
            return Ok(Cow::Borrowed(shared));
        }
        Ok(Cow::Owned(self.generate(name, shape)))
    }

    fn f32_values(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let bytes = self.stored_bytes(name, &[len])?;
        Ok(bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect())
    }
}

impl RandomWeights {
    /// `shape`'s values for `name`, as bf16 bytes.
    fn generate(&self, name: &str, shape: &[usize]) -> Vec<u8> {
        let n: usize = shape.iter().product();
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        // 1-D tensors are norm weights, around 1, or a router's bias, around
        // 0. Matrices: U(-1, 1) / sqrt(fan_in).
        let (center, scale) = match shape.len() {
            1 if name.ends_with("bias") => (0.0, 0.1),
            1 => (1.0, 0.1),
            _ => (0.0, 1.0 / fan_in.sqrt()),
        };
        let mut bytes = vec![0u8; n * 2];
        let threads = std::thread::available_parallelism().map_or(1, |p| p.get()).min(16);
        let per_thread = n.div_ceil(threads).max(1);
        let stream = self.stream(name);
        std::thread::scope(|s| {
            for (i, chunk) in bytes.chunks_mut(per_thread * 2).enumerate() {
                s.spawn(move || {
                    let mut x = stream ^ ((i as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03));
                    for v in chunk.chunks_exact_mut(2) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let u = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                        v.copy_from_slice(&half::bf16::from_f32(center + u * scale).to_le_bytes());
                    }
                });
            }
        });
        bytes
    }
}
