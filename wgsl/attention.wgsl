// Causal attention of one query row over the KV cache, grouped-query.
// For query head h of token t (position pos = step.pos0 + t):
//   out[t, h] = softmax_j(scale * q[t, h] . K[j, h / group]) V[j, h / group]
// over keys j in [start, pos], start = pos + 1 - window when a sliding
// window is set (window = 0: none). Keys are walked in tiles of WG with an
// online softmax (running max and sum), so no score buffer is needed and
// any context length works. Each invocation owns head dims lid, lid + WG, ...
// (head_dim <= 4 * WG and <= 256).
// q: f32 rows of the qkv buffer (already rotated). K, V: f32 [ctx, nkv * hd].

override WG: u32 = 64u;

struct Params {
    n_q_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    out_stride: u32,
    window: u32,
    scale: f32,
    _pad: u32,
}

struct Step {
    pos0: u32,
    n_tokens: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k_cache: array<f32>;
@group(0) @binding(4) var<storage, read> v_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

const MAX_HEAD_DIM: u32 = 256u;
const NEG_BIG: f32 = -3.0e38;

var<workgroup> q_row: array<f32, MAX_HEAD_DIM>;
var<workgroup> probs: array<f32, WG>;
var<workgroup> red: array<f32, WG>;

fn reduce_max(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let l = lid.x;
    let hd = p.head_dim;
    let pos = step.pos0 + t;
    let kv_row = p.n_kv_heads * hd;
    let kv_head_off = (h / (p.n_q_heads / p.n_kv_heads)) * hd;
    var start = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        start = pos + 1u - p.window;
    }

    let qb = t * p.q_stride + h * hd;
    for (var d = l; d < hd; d += WG) {
        q_row[d] = q[qb + d];
    }
    workgroupBarrier();

    var m = NEG_BIG;
    var sum = 0.0;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var tile = start; tile <= pos; tile += WG) {
        let j = tile + l;
        var s = NEG_BIG;
        if (j <= pos) {
            let kb = j * kv_row + kv_head_off;
            var dot = 0.0;
            for (var d = 0u; d < hd; d++) {
                dot += q_row[d] * k_cache[kb + d];
            }
            s = dot * p.scale;
        }
        let m_new = max(m, reduce_max(s, l));
        var e = 0.0;
        if (j <= pos) {
            e = exp(s - m_new);
        }
        probs[l] = e;
        let rescale = exp(m - m_new);
        sum = sum * rescale + reduce_sum(e, l);
        m = m_new;
        let n = min(WG, pos + 1u - tile);
        for (var c = 0u; c < 4u; c++) {
            let d = l + c * WG;
            if (d < hd) {
                var a = acc[c] * rescale;
                for (var jj = 0u; jj < n; jj++) {
                    a += probs[jj] * v_cache[(tile + jj) * kv_row + kv_head_off + d];
                }
                acc[c] = a;
            }
        }
        workgroupBarrier();
    }

    let ob = t * p.out_stride + h * hd;
    for (var c = 0u; c < 4u; c++) {
        let d = l + c * WG;
        if (d < hd) {
            out[ob + d] = acc[c] / sum;
        }
    }
}
