// Causal grouped-query attention over the KV cache. For query head h of
// token t (position pos = step.pos0 + t):
//   out[t, h] = softmax_j(scale * q[t, h] . K[j, g]) V[j, g],  g = h / (nq / nkv)
// over keys j in [start, pos], start = pos + 1 - window when a sliding
// window is set (window = 0: none).
// main: one workgroup per (KV head g, block of tokens_per_wg tokens, split
//   s). Its query rows, (token, query head of the group), share every K and
//   V tile, which is loaded once into workgroup memory (rows padded by one
//   float against bank conflicts); scores and an online softmax run per
//   tile, keys outside a row's causal range masked. The keys are divided among `splits`
//   workgroups: with one split the result is written to out, otherwise each
//   writes its unnormalised partial sum with its running max and sum, and
//   `combine` merges them (flash decoding, for one token in flight).
// q: f32 rows of the qkv buffer (already rotated). K, V: f32 [ctx, nkv * hd].
// Limits: tokens_per_wg * (nq / nkv) * head_dim <= 2048, head_dim <= 256,
// tokens_per_wg * (nq / nkv) <= 32.

const WG: u32 = 128u;
const Q_FLOATS: u32 = 2048u;
const KV_FLOATS: u32 = 4112u;
const SCORE_FLOATS: u32 = 1024u;
const MAX_ROWS: u32 = 32u;
const OUT_PER_THREAD: u32 = 16u; // Q_FLOATS / WG
const NEG_BIG: f32 = -3.0e38;

struct Params {
    n_q_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    q_stride: u32,
    out_stride: u32,
    window: u32,
    scale: f32,
    splits: u32,
    tokens_per_wg: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> q: array<f32>;
@group(0) @binding(3) var<storage, read> k_cache: array<f32>;
@group(0) @binding(4) var<storage, read> v_cache: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
// Partials of split attention, per (token, query head, split): head_dim sums,
// then (max, sum) pairs.
@group(0) @binding(6) var<storage, read_write> part_acc: array<f32>;
@group(0) @binding(7) var<storage, read_write> part_ml: array<f32>;

var<workgroup> q_sh: array<f32, Q_FLOATS>;
var<workgroup> kv_sh: array<f32, KV_FLOATS>;
var<workgroup> scores: array<f32, SCORE_FLOATS>;
var<workgroup> row_max: array<f32, MAX_ROWS>;
var<workgroup> row_sum: array<f32, MAX_ROWS>;
var<workgroup> row_rescale: array<f32, MAX_ROWS>;

// Copies keys [k0, k0 + n) of one cache into kv_sh, rows of hd + 1.
fn load_tile(from_k: bool, k0: u32, n: u32, kv_off: u32, kv_row: u32, hd: u32, l: u32) {
    for (var i = l; i < n * hd; i += WG) {
        let j = i / hd;
        let d = i % hd;
        let src = (k0 + j) * kv_row + kv_off + d;
        var v: f32;
        if (from_k) {
            v = k_cache[src];
        } else {
            v = v_cache[src];
        }
        kv_sh[j * (hd + 1u) + d] = v;
    }
}

// First attended key of the token at `pos`.
fn first_key(pos: u32) -> u32 {
    if (p.window > 0u && pos + 1u > p.window) {
        return pos + 1u - p.window;
    }
    return 0u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let g = wid.x;
    let t0 = wid.y * p.tokens_per_wg;
    let split = wid.z;
    let hd = p.head_dim;
    let group = p.n_q_heads / p.n_kv_heads;
    let n_tok = min(p.tokens_per_wg, step.n_tokens - t0);
    let rows = n_tok * group;
    let kv_row = p.n_kv_heads * hd;
    let kv_off = g * hd;
    let tile = min(KV_FLOATS / (hd + 1u), SCORE_FLOATS / (p.tokens_per_wg * group));

    // Keys any row of the block attends, divided among the splits.
    let start = first_key(step.pos0 + t0);
    let end = step.pos0 + t0 + n_tok;
    let n_keys = end - start;
    let chunk = (n_keys + p.splits - 1u) / p.splits;
    let lo = start + min(split * chunk, n_keys);
    let hi = start + min((split + 1u) * chunk, n_keys);

    // Row r is token t0 + r / group, query head g * group + r % group.
    for (var i = l; i < rows * hd; i += WG) {
        let r = i / hd;
        let t = t0 + r / group;
        q_sh[i] = q[t * p.q_stride + (g * group + r % group) * hd + i % hd];
    }
    if (l < rows) {
        row_max[l] = NEG_BIG;
        row_sum[l] = 0.0;
    }
    var acc: array<f32, OUT_PER_THREAD>;
    for (var c = 0u; c < OUT_PER_THREAD; c++) {
        acc[c] = 0.0;
    }

    for (var k0 = lo; k0 < hi; k0 += tile) {
        let n = min(tile, hi - k0);
        workgroupBarrier();
        load_tile(true, k0, n, kv_off, kv_row, hd, l);
        workgroupBarrier();
        for (var i = l; i < rows * tile; i += WG) {
            let r = i / tile;
            let j = i % tile;
            let pos = step.pos0 + t0 + r / group;
            let key = k0 + j;
            var s = NEG_BIG;
            if (j < n && key <= pos && key >= first_key(pos)) {
                var dot = 0.0;
                for (var d = 0u; d < hd; d++) {
                    dot += q_sh[r * hd + d] * kv_sh[j * (hd + 1u) + d];
                }
                s = dot * p.scale;
            }
            scores[r * tile + j] = s;
        }
        workgroupBarrier();
        if (l < rows) {
            let r = l;
            var m = row_max[r];
            for (var j = 0u; j < n; j++) {
                m = max(m, scores[r * tile + j]);
            }
            var sum = 0.0;
            for (var j = 0u; j < n; j++) {
                let s = scores[r * tile + j];
                var e = 0.0;
                if (s > NEG_BIG) {
                    e = exp(s - m);
                }
                scores[r * tile + j] = e;
                sum += e;
            }
            let rescale = exp(row_max[r] - m);
            row_rescale[r] = rescale;
            row_sum[r] = row_sum[r] * rescale + sum;
            row_max[r] = m;
        }
        load_tile(false, k0, n, kv_off, kv_row, hd, l);
        workgroupBarrier();
        for (var c = 0u; c < OUT_PER_THREAD; c++) {
            let o = l + c * WG;
            if (o < rows * hd) {
                let r = o / hd;
                let d = o % hd;
                var a = acc[c] * row_rescale[r];
                for (var j = 0u; j < n; j++) {
                    a += scores[r * tile + j] * kv_sh[j * (hd + 1u) + d];
                }
                acc[c] = a;
            }
        }
    }
    workgroupBarrier();

    for (var c = 0u; c < OUT_PER_THREAD; c++) {
        let o = l + c * WG;
        if (o < rows * hd) {
            let r = o / hd;
            let d = o % hd;
            let t = t0 + r / group;
            let qh = g * group + r % group;
            if (p.splits == 1u) {
                out[t * p.out_stride + qh * hd + d] = acc[c] / row_sum[r];
            } else {
                let slot = (t * p.n_q_heads + qh) * p.splits + split;
                part_acc[slot * hd + d] = acc[c];
                if (d == 0u) {
                    part_ml[2u * slot] = row_max[r];
                    part_ml[2u * slot + 1u] = row_sum[r];
                }
            }
        }
    }
}

// Merges the splits of one (query head, token): one workgroup each.
@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let qh = wid.x;
    let t = wid.y;
    let hd = p.head_dim;
    let base = (t * p.n_q_heads + qh) * p.splits;
    var m = NEG_BIG;
    for (var s = 0u; s < p.splits; s++) {
        m = max(m, part_ml[2u * (base + s)]);
    }
    var sum = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        sum += exp(part_ml[2u * (base + s)] - m) * part_ml[2u * (base + s) + 1u];
    }
    for (var d = l; d < hd; d += WG) {
        var a = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            a += exp(part_ml[2u * (base + s)] - m) * part_acc[(base + s) * hd + d];
        }
        out[t * p.out_stride + qh * hd + d] = a / sum;
    }
}
