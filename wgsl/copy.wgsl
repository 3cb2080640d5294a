// Copies through the shader cores.
//
// main: dst[i] = src[i] for i < p.n vec4s, each invocation striding over
// the buffer. The reference a memory-bound kernel's bandwidth is compared
// with (see Gpu::copy_bandwidth).
//
// rows: the last count = min(step.n_tokens, p.rows) rows of the tokens in
// flight, rows of p.n f32:
//   rows_dst[r, i] = rows_src[step.n_tokens - count + r, i],  r < count
// (residual capture: every row of a chunk, or only its last).
// Grid: x covers p.n in workgroups of 256, y = row.

struct Params {
    n: u32,
    rows: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;

@group(0) @binding(3) var<uniform> step: Step;
@group(0) @binding(4) var<storage, read> rows_src: array<f32>;
@group(0) @binding(5) var<storage, read_write> rows_dst: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var i = gid.x; i < p.n; i += stride) {
        dst[i] = src[i];
    }
}

@compute @workgroup_size(256)
fn rows(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let r = gid.y;
    let count = min(step.n_tokens, p.rows);
    if (i >= p.n || r >= count) {
        return;
    }
    let t = step.n_tokens - count + r;
    rows_dst[r * p.n + i] = rows_src[t * p.n + i];
}
