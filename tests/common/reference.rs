//! CPU f32 references of the kernels, written for clarity, not speed.

/// `w` is `[rows, cols]` row-major.
pub fn gemv(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum()).collect()
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| w * (v * scale)).collect()
}

pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// Rotate-half RoPE of one head at `pos` over its first `rot` dims.
pub fn rope(head: &[f32], pos: usize, rot: usize, inv_freq: &[f32]) -> Vec<f32> {
    let half = rot / 2;
    let mut out = head.to_vec();
    for i in 0..half {
        let angle = (inv_freq[i] * pos as f32) as f64;
        let (s, c) = (angle.sin() as f32, angle.cos() as f32);
        out[i] = head[i] * c - head[i + half] * s;
        out[i + half] = head[i + half] * c + head[i] * s;
    }
    out
}

/// One query head against keys/values `[len, kv_width]` (already limited
/// to the attended range), head `kv_head`.
pub fn attention(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], kv_head: usize, scale: f32) -> Vec<f32> {
    let hd = q.len();
    let scores: Vec<f32> = k
        .iter()
        .map(|row| q.iter().zip(&row[kv_head * hd..]).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    (0..hd).map(|d| e.iter().zip(v).map(|(p, row)| p * row[kv_head * hd + d]).sum::<f32>() / sum).collect()
}

/// Router selection as the families define it: `(ids, weights)` in
/// descending order of the selection score, ties to the lower id.
pub fn route(
    logits: &[f32],
    k: usize,
    sigmoid_bias: Option<&[f32]>,
    renormalize: bool,
) -> (Vec<u32>, Vec<f32>) {
    let (weight, choice): (Vec<f32>, Vec<f32>) = match sigmoid_bias {
        Some(bias) => {
            let s: Vec<f32> = logits.iter().map(|z| 1.0 / (1.0 + (-z).exp())).collect();
            let c = s.iter().zip(bias).map(|(s, b)| s + b).collect();
            (s, c)
        }
        None => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|z| (z - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            let p: Vec<f32> = e.iter().map(|v| v / sum).collect();
            (p.clone(), p)
        }
    };
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
    let ids: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
    let picked: Vec<f32> = ids.iter().map(|&i| weight[i as usize]).collect();
    let norm = if renormalize || sigmoid_bias.is_some() { picked.iter().sum() } else { 1.0 };
    (ids, picked.iter().map(|w| w / norm).collect())
}

/// The probability the host sampler gives each id: softmax of
/// `logits / temperature` over the `top_k` best (ties to the lower id),
/// cut to the shortest run from the top whose probability reaches `top_p`,
/// renormalised.
pub fn sampling_distribution(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
) -> Vec<f64> {
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    ids.truncate(top_k.unwrap_or(ids.len()));
    let max = logits[ids[0]];
    let mut p: Vec<f64> = ids.iter().map(|&i| (((logits[i] - max) / temperature) as f64).exp()).collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= total);
    if let Some(top_p) = top_p {
        let mut cumulative = 0.0;
        let keep = p
            .iter()
            .position(|v| {
                cumulative += v;
                cumulative >= top_p as f64
            })
            .map_or(p.len(), |i| i + 1);
        p.truncate(keep);
    }
    let total: f64 = p.iter().sum();
    let mut out = vec![0.0; logits.len()];
    for (&i, v) in ids.iter().zip(&p) {
        out[i] = v / total;
    }
    out
}

/// Rounds to f16 and back, as an f16 KV cache stores values.
pub fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// Activations as the GEMV's integer path stages them
/// (`GemvShape::int8`): each block of 32 rounded to steps of
/// max |x| / (63 * 2^16) (three signed bytes).
pub fn int8_activations(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|block| {
            let largest = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let inv = if largest > 0.0 { 63.0 * 65536.0 / largest } else { 0.0 };
            let step = largest / (63.0 * 65536.0);
            block.iter().map(move |v| step * (v * inv).round_ties_even())
        })
        .collect()
}

/// LayerNorm of a row: `(x - mean) / sqrt(var + eps) * w + b`, biased
/// variance, in f64.
pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let scale = 1.0 / (var + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .zip(b)
        .map(|((&v, &w), &b)| ((v as f64 - mean) * scale * w as f64 + b as f64) as f32)
        .collect()
}

/// erf by its Taylor series (|x| <= 5; beyond, +-1 within 2e-12).
pub fn erf(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// The exact GELU and torch's tanh approximation, in f64.
pub fn gelu(v: f32, tanh: bool) -> f32 {
    let v = v as f64;
    let g = if tanh {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    } else {
        0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))
    };
    g as f32
}
