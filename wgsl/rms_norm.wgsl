// RMSNorm: out[r, i] = w[i] * (x[r, i] * rsqrt(mean_i(x[r, i]^2) + eps)), f32.
// The row of token t = wid.y, head h = wid.x starts at
//   offset + t * token_stride + h * head_stride  (in x and out alike)
// which covers the hidden state (one head of `hidden`), per-head q/k norm
// (heads of head_dim sharing one weight) and whole-projection q/k norm.
// x and out may be the same buffer (in-place): each invocation rewrites only
// the elements it read.
// w: f32 [n]. One workgroup per row; WG must be a power of two.

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: RmsNormParams;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = p.offset + wid.y * p.token_stride + wid.x * p.head_stride;
    var sum = 0.0;
    for (var i = lid.x; i < p.n; i += WG) {
        let v = x[row + i];
        sum += v * v;
    }
    partial[lid.x] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            partial[lid.x] += partial[lid.x + s];
        }
        workgroupBarrier();
    }
    let scale = inverseSqrt(partial[0] / f32(p.n) + p.eps);
    for (var i = lid.x; i < p.n; i += WG) {
        out[row + i] = w[i] * (x[row + i] * scale);
    }
}
