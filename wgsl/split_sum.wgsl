// The product of a matrix over few tokens from its partial sums over k
// ranges (kernels::gemm's K_SPLIT builds, y packed [tokens, k, n]):
//   out[t, i] = sum_{j < k} y[(t * k + j) * n + i],  i < n
// or with SWIGLU, y's rows gate and up interleaved (row 2i a gate, 2i + 1
// its up):
//   out[t, i] = swiglu(sum_j y[.., 2i], sum_j y[.., 2i + 1]),  i < n / 2
// Each sum runs over j in order, whatever the number of tokens.
// APART (plain): rows from p.apart_row on go to `tail` instead, in rows
// of their own width, n - apart_row (a layer's value rows written apart).
// Grid: x covers the outputs in workgroups of 256, y = token.

@group(0) @binding(0) var<uniform> p: SplitSumParams;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
#if APART
@group(0) @binding(3) var<storage, read_write> tail: array<f32>;
#endif

fn partial_sum(t: u32, row: u32) -> f32 {
    var sum = 0.0;
    for (var j = 0u; j < p.k; j++) {
        sum += y[(t * p.k + j) * p.n + row];
    }
    return sum;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let t = wid.y;
    let i = wid.x * 256u + l;
#if SWIGLU
    let outputs = p.n / 2u;
    if (i < outputs) {
        out[t * outputs + i] = swiglu(partial_sum(t, 2u * i), partial_sum(t, 2u * i + 1u));
    }
#else
#if APART
    if (i >= p.apart_row && i < p.n) {
        tail[t * (p.n - p.apart_row) + i - p.apart_row] = partial_sum(t, i);
        return;
    }
#endif
    if (i < p.n) {
        out[t * p.n + i] = partial_sum(t, i);
    }
#endif
}
