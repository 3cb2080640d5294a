// RMSNorm: out[r, i] = w[i] * (x[r, i] * rsqrt(mean_i(x[r, i]^2) + eps)), f32;
// with LAYER_NORM, LayerNorm (the vision tower's): with m = mean_i x[r, i]
// and v = mean_i (x[r, i] - m)^2,
//   out[r, i] = (x[r, i] - m) * rsqrt(v + eps) * w[i] + b[i].
// The row of token t = wid.y, head h = wid.x starts at
//   offset + t * token_stride + h * head_stride  (in x and out alike)
// which covers the hidden state (one head of `hidden`), per-head q/k norm
// (heads of head_dim sharing one weight) and whole-projection q/k norm.
// x and out may be the same buffer (in-place): each invocation rewrites only
// the elements it read.
// ADD (RMSNorm of rows of the hidden state): first x[r, i] =
// layer_output(t, i, n, x[r, i] + sum_j y[t, j, i]), the residual add at
// the end of a chunk's projection (steered and captured at a layer's
// output, common.wgsl), so that the add and the next projection's norm are
// one dispatch; y holds the product, or ADD_PARTS partial sums of it over
// k side by side ([tokens, ADD_PARTS, n]: the GEMM's K_SPLIT).
// OUT_F16: each value of out also goes to out16 as f16, for the products
// on cooperative matrices that read their activations so.
// w (and b): f32 [n]. One workgroup per row; WG must be a power of two.
#if OUT_F16
enable f16;
#endif

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: RmsNormParams;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
#if LAYER_NORM
@group(0) @binding(4) var<storage, read> b: array<f32>;
#endif
#if ADD
@group(0) @binding(5) var<storage, read> y: array<f32>;
override ADD_PARTS: u32 = 1u;

// Element i of token t's product: its partial sums added in order. ADD
// rows are whole vectors (offset 0, token_stride n).
fn added(t: u32, i: u32) -> f32 {
    var sum = y[t * ADD_PARTS * p.n + i];
    for (var j = 1u; j < ADD_PARTS; j++) {
        sum += y[(t * ADD_PARTS + j) * p.n + i];
    }
    return sum;
}
#endif
#if OUT_F16
@group(0) @binding(6) var<storage, read_write> out16: array<f16>;
#endif

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = p.offset + wid.y * p.token_stride + wid.x * p.head_stride;
    let n = f32(p.n);
#if LAYER_NORM
    var sum = 0.0;
    for (var i = lid.x; i < p.n; i += WG) {
        sum += x[row + i];
    }
    let mean = workgroup_sum(sum, lid.x) / n;
    var squares = 0.0;
    for (var i = lid.x; i < p.n; i += WG) {
        let d = x[row + i] - mean;
        squares += d * d;
    }
    let scale = inverseSqrt(workgroup_sum(squares, lid.x) / n + p.eps);
    for (var i = lid.x; i < p.n; i += WG) {
        let v = (x[row + i] - mean) * scale * w[i] + b[i];
        out[row + i] = v;
#if OUT_F16
        out16[row + i] = f16(v);
#endif
    }
#else
    var squares = 0.0;
    for (var i = lid.x; i < p.n; i += WG) {
#if ADD
        let v = layer_output(wid.y, i, p.n, x[row + i] + added(wid.y, i));
        x[row + i] = v;
#else
        let v = x[row + i];
#endif
        squares += v * v;
    }
    let scale = inverseSqrt(workgroup_sum(squares, lid.x) / n + p.eps);
    for (var i = lid.x; i < p.n; i += WG) {
        let v = w[i] * (x[row + i] * scale);
        out[row + i] = v;
#if OUT_F16
        out16[row + i] = f16(v);
#endif
    }
#endif
}
