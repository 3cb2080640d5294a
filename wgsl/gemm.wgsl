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
// Tiles of 64 tokens x TILE_N rows (64 or 128, a pipeline constant: 64 gives
// more workgroups for narrow matrices) per workgroup of 256, k in steps of 16
// through workgroup memory, the next step's tiles loaded into registers
// while this one computes. Each invocation owns 4 tokens x TILE_N / 16
// rows, held as vec4 accumulators (written out by hand so that they stay
// in registers on every compiler).
// Grid: x = row tiles (folded into z), y = token tiles.

const TILE_M: u32 = 64u;
override TILE_N: u32 = 128u;
const TILE_K: u32 = 16u;
// Invocations loading one weight row of a k step, and words each loads.
override W_THREADS: u32 = 256u / TILE_N;
override W_WORDS: u32 = 8u / W_THREADS;

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

// xs[kk * 16 + q]: tokens 4q..4q+3 of the tile at k step kk.
// ws[kk * TILE_N / 4 + r]: weight rows 4r..4r+3 of the tile at k step kk.
var<workgroup> xs: array<vec4<f32>, 256>;
var<workgroup> ws: array<vec4<f32>, 512>;

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

    // Loader roles: X token lm = li / 4 with 4 k values from (li % 4) * 4;
    // W row ln = li / W_THREADS with 2 W_WORDS k values from lkw.
    let lm = li / 4u;
    let lkx = (li % 4u) * 4u;
    let ln = li / W_THREADS;
    let lkw = (li % W_THREADS) * 2u * W_WORDS;
    let vecs_per_k = TILE_N / 4u;
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

    // Compute roles: tokens m0 + 4 tm + i, rows n0 + 4 tn + j and
    // n0 + 64 + 4 tn + j (j < 4): neighbouring invocations read neighbouring
    // vec4s of ws, free of bank conflicts.
    let tm = li / 16u;
    let tn = li % 16u;
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0);
    var c5 = vec4<f32>(0.0);
    var c6 = vec4<f32>(0.0);
    var c7 = vec4<f32>(0.0);

    var xr = vec4<f32>(0.0);
    var wr = vec4<u32>(0u);
    for (var k0 = 0u; k0 < p.cols; k0 += TILE_K) {
        // This step's tiles: from registers (loaded during the previous
        // step's compute) except on the first step.
        if (k0 == 0u) {
            xr = load_x(x_ok, x_base, lkx);
            wr = load_w(w_ok, w_base, lkw / 2u, k_words);
        }
        for (var c = 0u; c < 4u; c++) {
            xs[(lkx + c) * 16u + lm / 4u][lm % 4u] = xr[c];
        }
        for (var c = 0u; c < W_WORDS; c++) {
            ws[(lkw + 2u * c) * vecs_per_k + ln / 4u][ln % 4u] = bf16_lo(wr[c]);
            ws[(lkw + 2u * c + 1u) * vecs_per_k + ln / 4u][ln % 4u] = bf16_hi(wr[c]);
        }
        workgroupBarrier();
        let k1 = k0 + TILE_K;
        if (k1 < p.cols) {
            xr = load_x(x_ok, x_base, k1 + lkx);
            wr = load_w(w_ok, w_base, (k1 + lkw) / 2u, k_words);
        }
        for (var kk = 0u; kk < TILE_K; kk++) {
            let a = xs[kk * 16u + tm];
            let b0 = ws[kk * vecs_per_k + tn];
            c0 += a * b0.x;
            c1 += a * b0.y;
            c2 += a * b0.z;
            c3 += a * b0.w;
            if (TILE_N == 128u) {
                let b1 = ws[kk * vecs_per_k + 16u + tn];
                c4 += a * b1.x;
                c5 += a * b1.y;
                c6 += a * b1.z;
                c7 += a * b1.w;
            }
        }
        workgroupBarrier();
    }

    let cols = array<vec4<f32>, 8>(c0, c1, c2, c3, c4, c5, c6, c7);
    for (var i = 0u; i < 4u; i++) {
        let m = m0 + 4u * tm + i;
        if (m >= count) {
            continue;
        }
        var yrow = m;
        if (grouped) {
            yrow = pairs[first_pair + m];
        }
        for (var j = 0u; j < TILE_N / 16u; j++) {
            let n = n0 + 4u * tn + (j % 4u) + 64u * (j / 4u);
            var w_row = n;
            if (grouped) {
                w_row = p.expert * p.expert_rows + n - p.first_row;
            }
            if (n < n_rows && w_row < p.rows) {
                var col = n;
                if (!grouped) {
                    col = p.first_row + n;
                }
                y[yrow * p.y_stride + col] = cols[j][i];
            }
        }
    }
}

// 4 consecutive x values from column k (zero past the row's end).
fn load_x(ok: bool, base: u32, k: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
        if (ok && k + c < p.cols) {
            v[c] = x[base + k + c];
        }
    }
    return v;
}

// W_WORDS consecutive weight words from word w (zero past the row's end).
fn load_w(ok: bool, base: u32, w: u32, k_words: u32) -> vec4<u32> {
    var v = vec4<u32>(0u);
    for (var c = 0u; c < W_WORDS; c++) {
        if (ok && w + c < k_words) {
            v[c] = weight[base + w + c];
        }
    }
    return v;
}
