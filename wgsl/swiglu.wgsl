// SwiGLU gate: act[t, i] = silu(gate[t, i]) * up[t, i], silu(g) = g * sigmoid(g).
// gate_up: f32 [tokens, 2 * n], gate and up interleaved (2i gate, 2i + 1 up),
// as the projection's interleaved gate/up weight rows produce them.
// Grid: x covers n in workgroups of 64, y = token.

@group(0) @binding(0) var<uniform> p: SwigluParams;
@group(0) @binding(1) var<storage, read> gate_up: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read_write> act: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.n) {
        return;
    }
    let gu = gate_up[t * p.n + i];
    act[t * p.n + i] = gu.x / (1.0 + exp(-gu.x)) * gu.y;
}
