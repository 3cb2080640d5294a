// Matrix product with bf16 weights for a chunk of tokens (prefill):
//   Y[yrow(m), col(n)] = sum_k X[xrow(m), k] * W[wrow(n), k]
// W: bf16 [rows, cols] (one part of a possibly split tensor), cols even;
// X, Y: f32 rows of cols and y_stride elements.
// Dense mode (expert_rows = 0): m < step.n_tokens, xrow = yrow = m; n covers
//   the part's rows, col(n) = first_row + n.
// Grouped mode (MoE prefill): the tokens routed to `expert`, listed by the
//   host as pair indices idx = token * top_k + slot in
//   pairs[groups[2e] .. groups[2e] + groups[2e + 1]]; xrow = idx / x_div,
//   yrow = idx; n < expert_rows, weight row expert * expert_rows + n (where
//   this part holds it), col(n) = n.
// Tiles of 64 tokens x 128 rows per workgroup of 256, k in steps of 16
// through workgroup memory; each invocation owns 4 x 8 outputs.
// Grid: x = row tiles (folded into z), y = token tiles.

const TILE_M: u32 = 64u;
const TILE_N: u32 = 128u;
const TILE_K: u32 = 16u;

struct Params {
    rows: u32,
    cols: u32,
    first_row: u32,
    expert_rows: u32,
    expert: u32,
    x_div: u32,
    y_stride: u32,
    _pad: u32,
}

struct Step {
    pos0: u32,
    n_tokens: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> weight: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> groups: array<u32>;
@group(0) @binding(6) var<storage, read> pairs: array<u32>;

var<workgroup> xs: array<array<f32, TILE_M>, TILE_K>;
var<workgroup> ws: array<array<f32, TILE_N>, TILE_K>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let grouped = p.expert_rows > 0u;
    var count = step.n_tokens;
    var first_pair = 0u;
    var n_rows = p.rows;
    if (grouped) {
        first_pair = groups[2u * p.expert];
        count = groups[2u * p.expert + 1u];
        n_rows = p.expert_rows;
    }
    let m0 = wid.y * TILE_M;
    let n0 = (wid.x + wid.z * nwg.x) * TILE_N;
    let k_words = p.cols / 2u;

    // Loader roles: X row m = li / 4, k quad (li % 4) * 4; W row n = li / 2,
    // 8 k values (4 words) from (li % 2) * 8.
    let lm = li / 4u;
    let lkx = (li % 4u) * 4u;
    let ln = li / 2u;
    let lkw = (li % 2u) * 8u;
    var x_base = 0u;
    let x_ok = m0 + lm < count;
    if (x_ok) {
        var xrow = m0 + lm;
        if (grouped) {
            xrow = pairs[first_pair + m0 + lm] / p.x_div;
        }
        x_base = xrow * p.cols;
    }
    var w_local = n0 + ln;
    if (grouped) {
        // Wraps to a huge value (skipped) when the row is before this part.
        w_local = p.expert * p.expert_rows + n0 + ln - p.first_row;
    }
    let w_ok = n0 + ln < n_rows && w_local < p.rows;
    let w_base = w_local * k_words;

    // Compute roles: rows m0 + tm + 16 i, columns n0 + tn + 16 j.
    let tm = li / 16u;
    let tn = li % 16u;
    var acc: array<array<f32, 8>, 4>;
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 8u; j++) {
            acc[i][j] = 0.0;
        }
    }

    for (var k0 = 0u; k0 < p.cols; k0 += TILE_K) {
        for (var c = 0u; c < 4u; c++) {
            let k = k0 + lkx + c;
            var v = 0.0;
            if (x_ok && k < p.cols) {
                v = x[x_base + k];
            }
            xs[lkx + c][lm] = v;
        }
        for (var c = 0u; c < 4u; c++) {
            let kw = (k0 + lkw) / 2u + c;
            var wv = 0u;
            if (w_ok && kw < k_words) {
                wv = weight[w_base + kw];
            }
            ws[lkw + 2u * c][ln] = bf16_lo(wv);
            ws[lkw + 2u * c + 1u][ln] = bf16_hi(wv);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TILE_K; kk++) {
            var a: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = xs[kk][tm + 16u * i];
            }
            for (var j = 0u; j < 8u; j++) {
                let b = ws[kk][tn + 16u * j];
                for (var i = 0u; i < 4u; i++) {
                    acc[i][j] += a[i] * b;
                }
            }
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < 4u; i++) {
        let m = m0 + tm + 16u * i;
        if (m >= count) {
            continue;
        }
        var yrow = m;
        if (grouped) {
            yrow = pairs[first_pair + m];
        }
        for (var j = 0u; j < 8u; j++) {
            let n = n0 + tn + 16u * j;
            var w_row = n;
            if (grouped) {
                w_row = p.expert * p.expert_rows + n - p.first_row;
            }
            if (n < n_rows && w_row < p.rows) {
                var col = n;
                if (!grouped) {
                    col = p.first_row + n;
                }
                y[yrow * p.y_stride + col] = acc[i][j];
            }
        }
    }
}
