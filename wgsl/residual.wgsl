// Residual add of k weighted rows per token, for i < n:
//   v = x[t, i] + sum_{j < k} s_j * y[(t * k + j) * n + i]
// s_j = weights[t * k + j] when weighted (the routed experts' weights,
// read on the GPU), else the constant scale (k = 1: plain residual add).
//
// At a layer's output the add also steers and captures (DESIGN section 7),
// so neither costs a dispatch of its own:
//   steer != 0:        v += steer_row[i]            (a control vector)
//   capture_rows != 0: the last count = min(step.n_tokens, capture_rows)
//                      tokens' v go to capture[(t - first) * n + i],
//                      first = step.n_tokens - count
// then x[t, i] = v.
// Grid: x covers n in workgroups of 64, y = token.

struct Params {
    n: u32,
    k: u32,
    weighted: u32,
    scale: f32,
    steer: u32,
    capture_rows: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read> weights: array<f32>;
@group(0) @binding(4) var<storage, read> steer_row: array<f32>;
@group(0) @binding(5) var<storage, read_write> capture: array<f32>;
@group(0) @binding(6) var<uniform> step: Step;

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
        sum += s * y[(t * p.k + j) * p.n + i];
    }
    var v = x[t * p.n + i] + sum;
    if (p.steer != 0u) {
        v += steer_row[i];
    }
    x[t * p.n + i] = v;
    if (p.capture_rows != 0u) {
        let count = min(step.n_tokens, p.capture_rows);
        let first = step.n_tokens - count;
        if (t >= first) {
            capture[(t - first) * p.n + i] = v;
        }
    }
}
