// Residual add of k rows per token, for i < n (rows counted from x_first
// in x and from y_first in y, 0 but for rows added at some of a chunk's
// tokens):
//   v = x[t, i] + sum_{j < k} s_j * y[(t * k + j) * n + i]
// s_j = weights[t * k + j] with WEIGHTED (the routed experts' weights, read
// on the GPU), else the constant scale (k = 1: plain residual add); then
// x[t, i] = layer_output(t, i, n, v): steered and captured at a layer's
// output where STEER / CAPTURE are set (common.wgsl).
// NORM: then also h[t, i] = norm_w[i] * (x[t, i] * rsqrt(mean_i(x[t, i]^2)
// + eps)), the RMSNorm of the new row (as rms_norm.wgsl computes it) that
// the next projection of a chunk reads: one dispatch for the add and the
// norm after it.
// Grid: x covers n in workgroups of WG invocations, each adding RUNS
// elements WG apart (RUNS independent loads in flight, consecutive
// invocations on consecutive elements), y = token; NORM: one workgroup
// per token (y), the row in strides of WG.

@group(0) @binding(0) var<uniform> p: ResidualParams;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
#if WEIGHTED
@group(0) @binding(3) var<storage, read> weights: array<f32>;
#endif
#if NORM
@group(0) @binding(4) var<storage, read> norm_w: array<f32>;
@group(0) @binding(5) var<storage, read_write> h: array<f32>;
#endif

// Set by kernels::residual, whose workgroup grid depends on them.
override WG: u32 = 256u;
override RUNS: u32 = 4u;

// x[t, i] = layer_output(x[t, i] + the rows' sum), returned.
fn add(t: u32, i: u32) -> f32 {
    var sum = 0.0;
    for (var j = 0u; j < p.k; j++) {
#if WEIGHTED
        let s = weights[t * p.k + j];
#else
        let s = p.scale;
#endif
        sum += s * y[(p.y_first + t * p.k + j) * p.n + i];
    }
    let at = (p.x_first + t) * p.n + i;
    let v = layer_output(t, i, p.n, x[at] + sum);
    x[at] = v;
    return v;
}

#if NORM
var<workgroup> partial: array<f32, WG>;

// The sum over the workgroup of every invocation's v (all call it).
fn workgroup_sum(v: f32, l: u32) -> f32 {
    partial[l] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (l < s) {
            partial[l] += partial[l + s];
        }
        workgroupBarrier();
    }
    return partial[0];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let t = wid.y;
    var squares = 0.0;
    for (var i = l; i < p.n; i += WG) {
        let v = add(t, i);
        squares += v * v;
    }
    let scale = inverseSqrt(workgroup_sum(squares, l) / f32(p.n) + p.eps);
    // Each invocation reads back only the elements it wrote.
    let row = (p.x_first + t) * p.n;
    for (var i = l; i < p.n; i += WG) {
        h[row + i] = norm_w[i] * (x[row + i] * scale);
    }
}
#else
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let t = wid.y;
    for (var r = 0u; r < RUNS; r++) {
        let i = (wid.x * RUNS + r) * WG + l;
        if (i < p.n) {
            add(t, i);
        }
    }
}
#endif
