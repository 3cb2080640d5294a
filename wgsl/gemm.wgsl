// Matrix product for a chunk of tokens (prefill):
//   Y[yrow(m), col(n)] = sum_k X[xrow(m), k] * W[wrow(n), k]
// or with SWIGLU, W's rows gate and up interleaved (n even a gate, n + 1
// its up), half as many columns:
//   Y[yrow(m), col(n) / 2] = swiglu(Y'[m, n], Y'[m, n + 1])
// or with BIAS (dense) Y[m, col(n)] = activate(Y'[m, n] + bias[col(n)]),
// and with BIAS_ADD Y[m, col(n)] += Y'[m, n] + bias[col(n)] (a residual add).
// W: [rows, cols] (one part of a possibly split tensor): bf16 (cols even),
// or with WEIGHT_FORMAT any format of weights.wgsl (cols a multiple of 4),
// decoded as it is staged into workgroup memory;
// X, Y: f32 rows of cols and y_stride elements.
// Dense mode (expert_rows = 0): m < step.n_tokens, xrow = yrow = m; n covers
//   the part's rows, col(n) = first_row + n.
// Grouped mode (MoE prefill): every expert e = expert + grid z at once, over
//   the tokens routed to it, listed as pair indices idx = token * top_k +
//   slot in pairs[groups[2e] .. groups[2e] + groups[2e + 1]]; xrow =
//   idx / x_div, yrow = idx; n < expert_rows, weight row e * expert_rows + n
//   (where this part holds it), col(n) = n. The grid's y covers the most
//   tokens an expert can have; tiles past an expert's count end at once.
// Tiles of TILE_M tokens x TILE_N weight rows per workgroup of 256 (both 64
// or 128, pipeline constants: small tiles give narrow matrices enough
// workgroups, large ones do more work per load), k in steps of 16 through
// workgroup memory, the next step's tiles loaded into registers while this
// one computes. Each invocation owns (TILE_M / 16) x (TILE_N / 16) outputs
// in vec4 accumulators, written out by hand so that they stay in registers
// on every compiler.
// Grid: x = row tiles (dense: folded into z), y = token tiles, z = experts
// (grouped).

override TILE_M: u32 = 64u;
override TILE_N: u32 = 128u;
// Weight rows per output: a gate/up pair with SWIGLU.
#if SWIGLU
const OUTPUT_STEP: u32 = 2u;
#else
const OUTPUT_STEP: u32 = 1u;
#endif
const TILE_K: u32 = 16u;
// Loader shapes: invocations per X row (token) and floats each loads;
// invocations per W row and words each loads.
override X_THREADS: u32 = 256u / TILE_M;
override X_FLOATS: u32 = 16u / X_THREADS;
override W_THREADS: u32 = 256u / TILE_N;
override W_WORDS: u32 = 8u / W_THREADS;

@group(0) @binding(0) var<uniform> p: GemmParams;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> weight: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> groups: array<u32>;
@group(0) @binding(6) var<storage, read> pairs: array<u32>;
#if BIAS
// A dense product's bias, per output column (BIAS: y = activate(W x +
// bias), activate of common.wgsl).
@group(0) @binding(7) var<storage, read> bias: array<f32>;
#endif

// xs[kk * TILE_M / 4 + q]: tokens 4q..4q+3 of the tile at k step kk.
// ws[kk * TILE_N / 4 + r]: weight rows 4r..4r+3 of the tile at k step kk.
var<workgroup> xs: array<vec4<f32>, 512>;
var<workgroup> ws: array<vec4<f32>, 512>;

fn weight_word(i: u32) -> u32 {
    return weight[i];
}

fn weight_quad(q: u32) -> vec4<u32> {
    return words4(4u * q);
}

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
    var n0 = (wid.x + wid.z * nwg.x) * TILE_N;
    let expert = p.expert + wid.z;
    if (grouped) {
        first_pair = groups[2u * expert];
        count = groups[2u * expert + 1u];
        n_rows = p.expert_rows;
        n0 = wid.x * TILE_N;
    }
    let m0 = wid.y * TILE_M;
    if (m0 >= count) {
        return;
    }
    let k_words = p.cols / 2u;

    // Loader roles: X token lm with X_FLOATS k values from lkx; W row ln
    // with 2 W_WORDS k values from lkw.
    let lm = li / X_THREADS;
    let lkx = (li % X_THREADS) * X_FLOATS;
    let ln = li / W_THREADS;
    let lkw = (li % W_THREADS) * 2u * W_WORDS;
    let x_vecs = TILE_M / 4u;
    let w_vecs = TILE_N / 4u;
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
        w_local = expert * p.expert_rows + n0 + ln - p.first_row;
    }
    let w_ok = n0 + ln < n_rows && w_local < p.rows;
#if WEIGHT_FORMAT
    let w_base = w_local * row_words(p.cols);
    var wv = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
#else
    let w_base = w_local * k_words;
    var wr = vec4<u32>(0u);
#endif

    // Compute roles: tokens 4 tm + i (+ 64 with TILE_M 128), rows 4 tn + j
    // (+ 64 with TILE_N 128): neighbouring invocations read neighbouring
    // vec4s, free of bank conflicts.
    let tm = li / 16u;
    let tn = li % 16u;
    var c00 = vec4<f32>(0.0);
    var c01 = vec4<f32>(0.0);
    var c02 = vec4<f32>(0.0);
    var c03 = vec4<f32>(0.0);
    var c04 = vec4<f32>(0.0);
    var c05 = vec4<f32>(0.0);
    var c06 = vec4<f32>(0.0);
    var c07 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0);
    var c11 = vec4<f32>(0.0);
    var c12 = vec4<f32>(0.0);
    var c13 = vec4<f32>(0.0);
    var c14 = vec4<f32>(0.0);
    var c15 = vec4<f32>(0.0);
    var c16 = vec4<f32>(0.0);
    var c17 = vec4<f32>(0.0);

    var xr = vec4<f32>(0.0);
    var xr2 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.cols; k0 += TILE_K) {
        // This step's tiles: from registers (loaded during the previous
        // step's compute) except on the first step.
        if (k0 == 0u) {
            xr = load_x(x_ok, x_base, lkx);
            if (TILE_M == 128u) {
                xr2 = load_x(x_ok, x_base, lkx + 4u);
            }
#if WEIGHT_FORMAT
            wv = load_w_values(w_ok, w_base, lkw);
#else
            wr = load_w(w_ok, w_base, lkw / 2u, k_words);
#endif
        }
        for (var c = 0u; c < 4u; c++) {
            xs[(lkx + c) * x_vecs + lm / 4u][lm % 4u] = xr[c];
            if (TILE_M == 128u) {
                xs[(lkx + 4u + c) * x_vecs + lm / 4u][lm % 4u] = xr2[c];
            }
        }
#if WEIGHT_FORMAT
        for (var c = 0u; c < 2u * W_WORDS; c++) {
            ws[(lkw + c) * w_vecs + ln / 4u][ln % 4u] = wv[c / 4u][c % 4u];
        }
#else
        for (var c = 0u; c < W_WORDS; c++) {
            ws[(lkw + 2u * c) * w_vecs + ln / 4u][ln % 4u] = bf16_lo(wr[c]);
            ws[(lkw + 2u * c + 1u) * w_vecs + ln / 4u][ln % 4u] = bf16_hi(wr[c]);
        }
#endif
        workgroupBarrier();
        let k1 = k0 + TILE_K;
        if (k1 < p.cols) {
            xr = load_x(x_ok, x_base, k1 + lkx);
            if (TILE_M == 128u) {
                xr2 = load_x(x_ok, x_base, k1 + lkx + 4u);
            }
#if WEIGHT_FORMAT
            wv = load_w_values(w_ok, w_base, k1 + lkw);
#else
            wr = load_w(w_ok, w_base, (k1 + lkw) / 2u, k_words);
#endif
        }
        for (var kk = 0u; kk < TILE_K; kk++) {
            let a0 = xs[kk * x_vecs + tm];
            let b0 = ws[kk * w_vecs + tn];
            var b1 = vec4<f32>(0.0);
            if (TILE_N == 128u) {
                b1 = ws[kk * w_vecs + 16u + tn];
            }
            c00 += a0 * b0.x;
            c01 += a0 * b0.y;
            c02 += a0 * b0.z;
            c03 += a0 * b0.w;
            if (TILE_N == 128u) {
                c04 += a0 * b1.x;
                c05 += a0 * b1.y;
                c06 += a0 * b1.z;
                c07 += a0 * b1.w;
            }
            if (TILE_M == 128u) {
                let a1 = xs[kk * x_vecs + 16u + tm];
                c10 += a1 * b0.x;
                c11 += a1 * b0.y;
                c12 += a1 * b0.z;
                c13 += a1 * b0.w;
                if (TILE_N == 128u) {
                    c14 += a1 * b1.x;
                    c15 += a1 * b1.y;
                    c16 += a1 * b1.z;
                    c17 += a1 * b1.w;
                }
            }
        }
        workgroupBarrier();
    }

    let acc = array<vec4<f32>, 16>(
        c00, c01, c02, c03, c04, c05, c06, c07,
        c10, c11, c12, c13, c14, c15, c16, c17,
    );
    for (var i = 0u; i < TILE_M / 16u; i++) {
        let m = m0 + 64u * (i / 4u) + 4u * tm + (i % 4u);
        if (m >= count) {
            continue;
        }
        var yrow = m;
        if (grouped) {
            yrow = pairs[first_pair + m];
        }
        // An invocation's rows 4 tn .. 4 tn + 3: SWIGLU's pairs are its
        // own, j even a gate and j + 1 its up.
        for (var j = 0u; j < TILE_N / 16u; j += OUTPUT_STEP) {
            let n = n0 + 64u * (j / 4u) + 4u * tn + (j % 4u);
            var w_row = n;
            if (grouped) {
                w_row = expert * p.expert_rows + n - p.first_row;
            }
            if (n < n_rows && w_row < p.rows) {
                var col = n;
                if (!grouped) {
                    col = p.first_row + n;
                }
                let v = acc[8u * (i / 4u) + j][i % 4u];
#if SWIGLU
                y[yrow * p.y_stride + col / 2u] = swiglu(v, acc[8u * (i / 4u) + j + 1u][i % 4u]);
#else
#if BIAS
#if BIAS_ADD
                y[yrow * p.y_stride + col] += v + bias[col];
#else
                y[yrow * p.y_stride + col] = activate(v + bias[col]);
#endif
#else
                y[yrow * p.y_stride + col] = v;
#endif
#endif
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

#if WEIGHT_FORMAT
// 2 W_WORDS consecutive weights of the row at word `row` from column k,
// decoded (zero past the row's end).
fn load_w_values(ok: bool, row: u32, k: u32) -> array<vec4<f32>, 2> {
    var v = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var q = 0u; q < W_WORDS / 2u; q++) {
        if (ok && k + 4u * q < p.cols) {
            v[q] = weights4(row, k + 4u * q);
        }
    }
    return v;
}
#endif
