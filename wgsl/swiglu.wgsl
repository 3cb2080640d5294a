// SwiGLU gate: act[t, i] = silu(gate[t, i]) * up[t, i], silu(g) = g * sigmoid(g).
// gate_up: f32 [tokens, 2 * n], gate in the first n columns, up in the rest
// (the gate and up projections run as one fused GEMV).
// Grid: x covers n in workgroups of 64, y = token.

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.n) {
        return;
    }
    let g = gate_up[t * 2u * p.n + i];
    let u = gate_up[t * 2u * p.n + p.n + i];
    act[t * p.n + i] = g / (1.0 + exp(-g)) * u;
}
