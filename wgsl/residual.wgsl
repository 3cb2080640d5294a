// Residual add of k weighted rows per token, for i < n:
//   x[t, i] += sum_{j < k} s_j * y[t * y_token_stride + j * n + i]
// s_j = weights[t * k + j] when weighted (the routed experts' weights,
// read on the GPU), else the constant scale (k = 1: plain residual add).
// y_token_stride is k * n when y holds rows per token, and 0 when one row
// is added to every token (a control vector).
// Grid: x covers n in workgroups of 64, y = token.

struct Params {
    n: u32,
    k: u32,
    weighted: u32,
    scale: f32,
    y_token_stride: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.n) {
        return;
    }
    var sum = 0.0;
    for (var j = 0u; j < p.k; j++) {
        var s = p.scale;
        if (p.weighted != 0u) {
            s = weights[t * p.k + j];
        }
        sum += s * y[t * p.y_token_stride + j * p.n + i];
    }
    x[t * p.n + i] += sum;
}
