// Matrix-vector product with bf16 weights, for every token t in flight:
//   y[t * y_stride + y_offset + r] = sum_c W[row(r), c] * x[t * x_stride + x_offset + c]
// W: bf16 [rows, cols] (one row range, a "part" starting at global row
// first_row, of a tensor that may be split across bindings); cols even.
// Plain mode (expert_rows = 0): r covers the part's rows, row(r) = r.
// Expert mode: W stacks experts of expert_rows rows each, and the expert is
// read from the GPU, e = ids[t * top_k + slot]; r covers one expert's rows,
// global row e * expert_rows + r, computed only where this part holds it.
// ROWS_PER_WG rows per workgroup, THREADS_PER_ROW invocations per row: one
// row per invocation (THREADS_PER_ROW = 1) suits CPU rasterisers; a
// subgroup (or workgroup reduction) per row suits GPUs. reduce_row comes
// from the variant prepended at pipeline creation (gemv.reduce_*.wgsl).
// When cols % 8 == 0, rows are 16-byte aligned and read 8 weights at a time.
// Grid: row blocks folded over x and z, y = token.

override ROWS_PER_WG: u32 = 64u;
override THREADS_PER_ROW: u32 = 1u;
override WG: u32 = 64u; // = ROWS_PER_WG * THREADS_PER_ROW, set by the host

struct Params {
    rows: u32,
    cols: u32,
    first_row: u32,
    expert_rows: u32,
    top_k: u32,
    slot: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> weight: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

fn x_at(i: u32) -> f32 {
    return x[i >> 2u][i & 3u];
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let block = wid.x + wid.z * nwg.x;
    let lane = lid.x % THREADS_PER_ROW;
    let r = block * ROWS_PER_WG + lid.x / THREADS_PER_ROW;
    let t = wid.y;
    var n_rows = p.rows;
    var local_row = r;
    if (p.expert_rows > 0u) {
        n_rows = p.expert_rows;
        // Wraps to a huge value (skipped) when the row is before this part.
        local_row = ids[t * p.top_k + p.slot] * p.expert_rows + r - p.first_row;
    }
    let in_part = r < n_rows && local_row < p.rows;
    var acc = 0.0;
    if (in_part) {
        let xb = t * p.x_stride + p.x_offset;
        if (p.cols % 8u == 0u && xb % 4u == 0u) {
            let per_row = p.cols / 8u;
            let wb = local_row * per_row;
            let xv = xb / 4u;
            for (var k = lane; k < per_row; k += THREADS_PER_ROW) {
                let w = weight[wb + k];
                let a = x[xv + 2u * k];
                let b = x[xv + 2u * k + 1u];
                acc += dot(vec4<f32>(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y)), a)
                    + dot(vec4<f32>(bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w)), b);
            }
        } else {
            let words = p.cols / 2u;
            let wb = local_row * words;
            for (var k = lane; k < words; k += THREADS_PER_ROW) {
                let i = wb + k;
                let w = weight[i >> 2u][i & 3u];
                acc += bf16_lo(w) * x_at(xb + 2u * k) + bf16_hi(w) * x_at(xb + 2u * k + 1u);
            }
        }
    }
    acc = reduce_row(acc, lid.x, lane);
    if (in_part && lane == 0u) {
        y[t * p.y_stride + p.y_offset + r] = acc;
    }
}
