//! Choosing the next token from raw logits: greedy, or temperature with
//! optional top-k and top-p, reproducible from a seed.

use crate::error::{Error, Result};

/// How the next token is chosen from logits: on the GPU by
/// [`crate::Session::generate`] ([`crate::GenerateOptions::sampling`]), on
/// the host by [`Sampler`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The highest logit (the lowest id on ties).
    Greedy,
    /// Softmax of `logits / temperature`, cut to the `top_k` most likely
    /// tokens and then to the smallest set whose probability reaches
    /// `top_p`, renormalised and drawn from.
    Random {
        /// What logits are divided by before the softmax: below 1 sharpens
        /// the distribution, above 1 flattens it (positive and finite).
        temperature: f32,
        /// Draw from the `k` most likely tokens only (`None`: all; at
        /// least 1).
        top_k: Option<usize>,
        /// Draw from the smallest set of most likely tokens whose
        /// probability reaches `p`, in (0, 1] (`None`: 1, all of them).
        top_p: Option<f32>,
    },
}

impl Sampling {
    /// Fails with `InvalidSampling` unless temperature is positive and
    /// finite, top_k at least 1 and top_p in (0, 1].
    pub fn validate(&self) -> Result<()> {
        if let Sampling::Random { temperature, top_k, top_p } = *self {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(Error::InvalidSampling(format!(
                    "temperature must be positive and finite, got {temperature} (use greedy for 0)"
                )));
            }
            if top_k == Some(0) {
                return Err(Error::InvalidSampling("top_k must be at least 1".into()));
            }
            if let Some(p) = top_p {
                if !(p > 0.0 && p <= 1.0) {
                    return Err(Error::InvalidSampling(format!("top_p must be in (0, 1], got {p}")));
                }
            }
        }
        Ok(())
    }
}

/// Token selection on the host from logits read back (the GPU's own is
/// `kernels::sample`, which [`crate::Session::generate`] uses).
///
/// ```
/// use wgspark::{Sampler, Sampling};
///
/// let logits = [0.1, 2.0, -1.0];
/// assert_eq!(Sampler::greedy().sample(&logits), 1);
///
/// // Temperature 0.8 over the two most likely ids (1 and 0); a seed gives
/// // the same draws every time.
/// let sampling = Sampling::Random { temperature: 0.8, top_k: Some(2), top_p: None };
/// let draws = |seed| -> wgspark::Result<Vec<u32>> {
///     let mut sampler = Sampler::new(sampling, seed)?;
///     Ok((0..16).map(|_| sampler.sample(&logits)).collect())
/// };
/// let first = draws(7)?;
/// assert!(first.iter().all(|&id| id == 0 || id == 1));
/// assert_eq!(first, draws(7)?);
/// # Ok::<(), wgspark::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    rng: Xoshiro256,
}

impl Sampler {
    /// A sampler that takes the highest logit ([`Sampling::Greedy`]).
    pub fn greedy() -> Self {
        Sampler { sampling: Sampling::Greedy, rng: Xoshiro256::new(0) }
    }

    /// A sampler of `sampling`, its draws seeded by `seed`; fails with
    /// [`crate::Error::InvalidSampling`] where a parameter is out of range
    /// ([`Sampling::validate`]).
    pub fn new(sampling: Sampling, seed: u64) -> Result<Self> {
        sampling.validate()?;
        Ok(Sampler { sampling, rng: Xoshiro256::new(seed) })
    }

    /// The id chosen from `logits` (one value per token of the
    /// vocabulary). NaN logits are never chosen; where all are NaN, the id
    /// is 0.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.sampling {
            Sampling::Greedy => argmax(logits),
            Sampling::Random { temperature, top_k, top_p } => {
                let mut ids: Vec<u32> =
                    (0..logits.len() as u32).filter(|&i| !logits[i as usize].is_nan()).collect();
                if ids.is_empty() {
                    return 0;
                }
                let by_logit =
                    |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
                let k = top_k.unwrap_or(ids.len()).min(ids.len());
                if k < ids.len() {
                    ids.select_nth_unstable_by(k - 1, by_logit);
                    ids.truncate(k);
                }
                ids.sort_unstable_by(by_logit);
                let max = logits[ids[0] as usize];
                let mut probs: Vec<f64> =
                    ids.iter().map(|&i| (((logits[i as usize] - max) / temperature) as f64).exp()).collect();
                let total: f64 = probs.iter().sum();
                probs.iter_mut().for_each(|p| *p /= total);
                if let Some(top_p) = top_p {
                    let mut cumulative = 0.0;
                    let keep = probs
                        .iter()
                        .position(|p| {
                            cumulative += p;
                            cumulative >= top_p as f64
                        })
                        .map_or(probs.len(), |i| i + 1);
                    probs.truncate(keep);
                }
                let total: f64 = probs.iter().sum();
                let mut u = self.rng.next_f64() * total;
                for (i, p) in probs.iter().enumerate() {
                    if u < *p {
                        return ids[i];
                    }
                    u -= p;
                }
                ids[probs.len() - 1]
            }
        }
    }
}

/// Index of the largest logit, the lowest on ties; NaNs never win.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best as u32
}

/// xoshiro256**, seeded through splitmix64: small, fast, and the same
/// stream on every platform.
#[derive(Debug, Clone)]
struct Xoshiro256([u64; 4]);

impl Xoshiro256 {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}
