// Rotary position embedding (rotate-half layout) of q and k in place, and
// the store of this position's k and v into the KV cache.
// qkv: f32 [tokens, (nq + 2 nkv) * head_dim], q heads then k heads then v.
// Dimension i < half is paired with i + half, half = rotary_dim / 2; dims
// from rotary_dim to head_dim pass through (partial rotary).
// cos_sin: f32 [positions, 2 * half], cos then sin of pos * inv_freq[i]
// (scaling already applied by the host, in f64, once per session).
// One workgroup per head (q heads, k heads, then v heads), wid.y = token,
// whose position is step.pos0 + token.

struct Params {
    n_q_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    half_rot: u32,
    qkv_stride: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> cos_sin: array<f32>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let head = wid.x;
    let t = wid.y;
    let pos = step.pos0 + t;
    let hd = p.head_dim;
    let half = p.half_rot;
    let src = t * p.qkv_stride + head * hd;
    let kv_row = p.n_kv_heads * hd;

    if (head >= p.n_q_heads + p.n_kv_heads) {
        let dst = pos * kv_row + (head - p.n_q_heads - p.n_kv_heads) * hd;
        for (var d = lid.x; d < hd; d += 64u) {
            v_cache[dst + d] = qkv[src + d];
        }
        return;
    }

    let is_k = head >= p.n_q_heads;
    let k_dst = pos * kv_row + (head - select(0u, p.n_q_heads, is_k)) * hd;
    let table = pos * 2u * half;
    for (var i = lid.x; i < half; i += 64u) {
        let c = cos_sin[table + i];
        let s = cos_sin[table + half + i];
        let x1 = qkv[src + i];
        let x2 = qkv[src + i + half];
        let r1 = x1 * c - x2 * s;
        let r2 = x2 * c + x1 * s;
        if (is_k) {
            k_cache[k_dst + i] = r1;
            k_cache[k_dst + i + half] = r2;
        } else {
            qkv[src + i] = r1;
            qkv[src + i + half] = r2;
        }
    }
    if (is_k) {
        for (var d = 2u * half + lid.x; d < hd; d += 64u) {
            k_cache[k_dst + d] = qkv[src + d];
        }
    }
}
