// Residual add: x[t, i] += scale * y[t, i] for i < n.
// Grid: x covers n in workgroups of 64, y = token.

struct Params {
    n: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.n) {
        return;
    }
    x[t * p.n + i] += p.scale * y[t * p.n + i];
}
