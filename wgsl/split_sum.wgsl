// The product of a matrix over few tokens from its partial sums over k
// ranges (kernels::gemm's K_SPLIT builds, y packed [tokens, k, n]), for
// `count` of its rows from row `first`:
//   out[t, i] = sum_{j < k} y[(t * k + j) * n + first + i],  i < count
// or with SWIGLU, y's rows gate and up interleaved (row 2i a gate, 2i + 1
// its up, counted from `first`), `count` pairs:
//   out[t, i] = swiglu(sum_j y[.., first + 2i], sum_j y[.., first + 2i + 1])
// Each sum runs over j in order, whatever the number of tokens.
// Grid: x covers the outputs in workgroups of 256, y = token.

@group(0) @binding(0) var<uniform> p: SplitSumParams;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

fn partial_sum(t: u32, row: u32) -> f32 {
    var sum = 0.0;
    for (var j = 0u; j < p.k; j++) {
        sum += y[(t * p.k + j) * p.n + p.first + row];
    }
    return sum;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let t = wid.y;
    let i = wid.x * 256u + l;
    if (i >= p.count) {
        return;
    }
#if SWIGLU
    out[t * p.count + i] = swiglu(partial_sum(t, 2u * i), partial_sum(t, 2u * i + 1u));
#else
    out[t * p.count + i] = partial_sum(t, i);
#endif
}
