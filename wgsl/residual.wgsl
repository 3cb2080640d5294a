// Residual add of k rows per token, for i < n (rows counted from x_first
// in x and from y_first in y, 0 but for rows added at some of a chunk's
// tokens):
//   v = x[t, i] + sum_{j < k} s_j * y[(t * k + j) * n + i]
// s_j = weights[t * k + j] with WEIGHTED (the routed experts' weights, read
// on the GPU), else the constant scale (k = 1: plain residual add); then
// x[t, i] = layer_output(t, i, n, v): steered and captured at a layer's
// output where STEER / CAPTURE are set (common.wgsl).
// Grid: x covers n in workgroups of WG invocations, each adding RUNS
// elements WG apart (RUNS independent loads in flight, consecutive
// invocations on consecutive elements), y = token.

@group(0) @binding(0) var<uniform> p: ResidualParams;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
#if WEIGHTED
@group(0) @binding(3) var<storage, read> weights: array<f32>;
#endif

// Set by kernels::residual, whose workgroup grid depends on them.
override WG: u32 = 256u;
override RUNS: u32 = 4u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let t = wid.y;
    for (var r = 0u; r < RUNS; r++) {
        let i = (wid.x * RUNS + r) * WG + l;
        if (i < p.n) {
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
            x[at] = layer_output(t, i, p.n, x[at] + sum);
        }
    }
}
