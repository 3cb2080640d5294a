// Buffer copy through the shader cores: dst[i] = src[i] for i < n vec4s.
// The reference a memory-bound kernel's bandwidth is compared with (see
// Gpu::copy_bandwidth), so it keeps several loads in flight per
// invocation: each workgroup copies PER_THREAD * 256 consecutive vec4s,
// all of an invocation's loads issued before its stores.
// Grid: blocks of PER_THREAD * 256 vec4s folded over x and z.

override PER_THREAD: u32 = 8u;
const MAX_PER_THREAD: u32 = 16u;

@group(0) @binding(0) var<uniform> p: CopyParams;
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) l: u32,
) {
    let base = (wid.x + wid.z * nwg.x) * PER_THREAD * 256u + l;
    var v: array<vec4<f32>, MAX_PER_THREAD>;
    for (var c = 0u; c < PER_THREAD; c++) {
        let i = base + c * 256u;
        if (i < p.n) {
            v[c] = src[i];
        }
    }
    for (var c = 0u; c < PER_THREAD; c++) {
        let i = base + c * 256u;
        if (i < p.n) {
            dst[i] = v[c];
        }
    }
}
