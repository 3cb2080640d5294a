// A linear layer's bias and activation, in place, for the vision tower
// where its products run on the GEMV (the GEMMs add them as they write
// their outputs: their BIAS epilogue):
//   y[t, i] = activate(y[t, i] + bias[i]),  i < n
// (activate: common.wgsl's, by the GELU_TANH or GELU_ERF flag.)
// Grid: x covers n in workgroups of 64, y = token.

@group(0) @binding(0) var<uniform> p: BiasActParams;
@group(0) @binding(1) var<storage, read> bias: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.n) {
        return;
    }
    let at = t * p.n + i;
    y[at] = activate(y[at] + bias[i]);
}
