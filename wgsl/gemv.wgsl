// Matrix-vector product with bf16 weights: y[t, r] = sum_c W[r, c] * x[t, c],
// x: f32 [tokens, cols], y: f32 [tokens, y_stride].
// W: bf16 [rows, cols] (one row range of a possibly split tensor), cols even.
// ROWS_PER_WG rows per workgroup, THREADS_PER_ROW invocations per row: one
// row per invocation (THREADS_PER_ROW = 1) suits CPU rasterisers, a
// workgroup reduction per row suits GPUs. Both are pipeline constants.
// Grid: row blocks folded over x and z, y = token.

override ROWS_PER_WG: u32 = 64u;
override THREADS_PER_ROW: u32 = 1u;
override WG: u32 = 64u; // = ROWS_PER_WG * THREADS_PER_ROW, set by the host

// rows: this part's rows, written at y[t, first_row + r] of a y with
// y_stride (the whole tensor's rows) per token.
struct Params {
    rows: u32,
    cols: u32,
    first_row: u32,
    y_stride: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> weight: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let block = wid.x + wid.z * nwg.x;
    let lane = lid.x % THREADS_PER_ROW;
    let row = block * ROWS_PER_WG + lid.x / THREADS_PER_ROW;
    let t = wid.y;
    let words = p.cols / 2u;
    var acc = 0.0;
    if (row < p.rows) {
        let wb = row * words;
        let xb = t * p.cols;
        for (var k = lane; k < words; k += THREADS_PER_ROW) {
            let wv = weight[wb + k];
            acc += bf16_lo(wv) * x[xb + 2u * k] + bf16_hi(wv) * x[xb + 2u * k + 1u];
        }
    }
    if (THREADS_PER_ROW > 1u) {
        partial[lid.x] = acc;
        workgroupBarrier();
        for (var s = THREADS_PER_ROW / 2u; s > 0u; s >>= 1u) {
            if (lane < s) {
                partial[lid.x] += partial[lid.x + s];
            }
            workgroupBarrier();
        }
        acc = partial[lid.x - lane];
    }
    if (row < p.rows && lane == 0u) {
        y[t * p.y_stride + p.first_row + row] = acc;
    }
}
