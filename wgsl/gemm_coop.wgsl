enable f16;
enable wgpu_cooperative_matrix;

// The chunk product of gemm.wgsl (same parameters, bindings, dense and
// grouped modes) on cooperative matrices (tensor cores):
//   Y[yrow(m), col(n)] = sum_k X[xrow(m), k] * W[wrow(n), k]
// A workgroup of 8 subgroups of 32 computes TILE_M tokens x 128 weight rows,
// k in steps of 32: the step's X (f32) and W (bf16, or with WEIGHT_FORMAT
// any format of weights.wgsl, decoded) are converted to f16 as they are
// staged into workgroup memory, the next step's loaded into registers
// while this one multiplies. Each subgroup owns 32 tokens x WARP_N rows as
// 16 x 16 f32 accumulators fed by 16 x 16 x 16 f16 products.
// X_SPLIT: each x is staged as two f16s, x_hi (x cut to 11 bits of
// mantissa) and x_lo = f16(x - x_hi), both multiplied: the activations keep
// 22 bits of mantissa instead of 11, at twice the matrix work. bf16 weights are exact
// in f16 (within its range: weights of magnitude below 2^-14 lose bits).
// The accumulators go out through workgroup memory, 16 x 16 at a time, so
// that ragged tiles and the grouped mode's scattered rows are written by
// plain invocations.
// Grid: x = row tiles (folded into z), y = token tiles.

// Tokens per workgroup: 32, 64 or 128 (pipeline constant: narrow tiles for
// expert groups and short chunks).
override TILE_M: u32 = 128u;
const TILE_N: u32 = 128u;
const TILE_K: u32 = 32u;
// Row stride of the staged tiles in f16s: 16 bytes of padding per row keep
// the 16 x 16 loads off a single bank.
const STRIDE: u32 = 40u;
// Subgroups: WARPS_M along the tokens (32 each) x WARPS_N along the rows.
const WARPS: u32 = 8u;
override WARPS_M: u32 = TILE_M / 32u;
override WARPS_N: u32 = WARPS / WARPS_M;
override WARP_N: u32 = TILE_N / WARPS_N;
// 16-row accumulator columns per subgroup: 1, 2 or 4.
override FRAGS_N: u32 = WARP_N / 16u;
// Staging rounds per k step (see Sources) and weight rows per round.
override X_ROUNDS: u32 = TILE_M / 8u;
#if WEIGHT_FORMAT
const W_ROUNDS: u32 = 4u;
#else
const W_ROUNDS: u32 = 8u;
#endif
const W_ROWS: u32 = TILE_N / W_ROUNDS;

@group(0) @binding(0) var<uniform> p: GemmParams;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> weight: array<u32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> groups: array<u32>;
@group(0) @binding(6) var<storage, read> pairs: array<u32>;

// xs[m * STRIDE + k]: token m of the tile at k (row-major A);
// ws[n * STRIDE + k]: weight row n at k (column-major B).
var<workgroup> xs: array<f16, 128 * 40>;
#if X_SPLIT
var<workgroup> xs_lo: array<f16, 128 * 40>;
#endif
var<workgroup> ws: array<f16, 128 * 40>;
#if W_SPLIT
var<workgroup> ws_lo: array<f16, 128 * 40>;
#endif
// One 16 x 16 accumulator per subgroup on its way out.
var<workgroup> out_tile: array<f32, 8 * 256>;

fn weight_word(i: u32) -> u32 {
    return weight[i];
}

// Where this invocation's staged values come from, fixed for the whole k
// loop. Consecutive invocations stage consecutive elements of a row, so
// that each subgroup's load is one contiguous run: X round r is token
// 8 r + li / 32 at k li % 32; W round r (bf16) is row 16 r + li / 16 at
// word li % 16, or (other formats) row 32 r + li / 8 at k 4 (li % 8).
struct Sources {
    x_base: array<u32, 16>,
    x_ok: array<bool, 16>,
    w_base: array<u32, 8>,
    w_ok: array<bool, 8>,
}

struct Tile {
    grouped: bool,
    count: u32,
    first_pair: u32,
    n_rows: u32,
    m0: u32,
    n0: u32,
}

fn tile_of(wid: vec3<u32>, nwg: vec3<u32>) -> Tile {
    var t = Tile(p.expert_rows > 0u, step.n_tokens, 0u, p.rows, wid.y * TILE_M, (wid.x + wid.z * nwg.x) * TILE_N);
    if (t.grouped) {
        t.first_pair = groups[2u * p.expert];
        t.count = groups[2u * p.expert + 1u];
        t.n_rows = p.expert_rows;
    }
    return t;
}

// The weight part's row of tile row n (a huge value when the grouped
// expert's row lies outside this part).
fn part_row(t: Tile, n: u32) -> u32 {
    if (t.grouped) {
        return p.expert * p.expert_rows + n - p.first_row;
    }
    return n;
}

fn sources(t: Tile, li: u32) -> Sources {
    var s: Sources;
    for (var r = 0u; r < X_ROUNDS; r++) {
        let m = t.m0 + 8u * r + li / 32u;
        s.x_ok[r] = m < t.count;
        var xrow = m;
        if (t.grouped && s.x_ok[r]) {
            xrow = pairs[t.first_pair + m] / p.x_div;
        }
        s.x_base[r] = xrow * p.cols;
    }
#if WEIGHT_FORMAT
    let words_per_row = row_words(p.cols);
#else
    let words_per_row = p.cols / 2u;
#endif
    for (var r = 0u; r < W_ROUNDS; r++) {
        let n = t.n0 + W_ROWS * r + li / (256u / W_ROWS);
        let w_row = part_row(t, n);
        s.w_ok[r] = n < t.n_rows && w_row < p.rows;
        s.w_base[r] = select(0u, w_row * words_per_row, s.w_ok[r]);
    }
    return s;
}

// The staged values of one k step, in registers.
struct Staged {
    x: array<f32, 16>,
#if WEIGHT_FORMAT
    w: array<vec4<f32>, 4>,
#else
    w: array<u32, 8>,
#endif
}

fn load_step(s: Sources, k0: u32, li: u32) -> Staged {
    var st: Staged;
    let kx = k0 + li % 32u;
    for (var r = 0u; r < X_ROUNDS; r++) {
        st.x[r] = 0.0;
        if (s.x_ok[r] && kx < p.cols) {
            st.x[r] = x[s.x_base[r] + kx];
        }
    }
#if WEIGHT_FORMAT
    let kw = k0 + (li % 8u) * 4u;
    for (var r = 0u; r < W_ROUNDS; r++) {
        st.w[r] = vec4<f32>(0.0);
        if (s.w_ok[r] && kw < p.cols) {
            st.w[r] = weights4(s.w_base[r], kw);
        }
    }
#else
    let kw = k0 / 2u + li % 16u;
    for (var r = 0u; r < W_ROUNDS; r++) {
        st.w[r] = 0u;
        if (s.w_ok[r] && kw < p.cols / 2u) {
            st.w[r] = weight[s.w_base[r] + kw];
        }
    }
#endif
    return st;
}

fn store_step(st: Staged, li: u32) {
    for (var r = 0u; r < X_ROUNDS; r++) {
        let at = (8u * r + li / 32u) * STRIDE + li % 32u;
#if X_SPLIT
        // The high part keeps the top 10 mantissa bits (exact in f16), so
        // the low part is exact in f32; integer masking, which no compiler
        // folds away as it may f32(f16(x)).
        let hi = bitcast<f32>(bitcast<u32>(st.x[r]) & 0xffffe000u);
        xs[at] = f16(hi);
        xs_lo[at] = f16(st.x[r] - hi);
#else
        xs[at] = f16(st.x[r]);
#endif
    }
    for (var r = 0u; r < W_ROUNDS; r++) {
        let at = (W_ROWS * r + li / (256u / W_ROWS)) * STRIDE;
#if WEIGHT_FORMAT
        // Converted as a vector: converting st.w[r][c] element by element
        // gave wrong values on the NVIDIA H200's Vulkan driver.
        let staged = vec4<f16>(st.w[r]);
        for (var c = 0u; c < 4u; c++) {
#if W_SPLIT
            let high = bitcast<f32>(bitcast<u32>(st.w[r][c]) & 0xffffe000u);
            ws[at + (li % 8u) * 4u + c] = f16(high);
            ws_lo[at + (li % 8u) * 4u + c] = f16(st.w[r][c] - high);
#else
            ws[at + (li % 8u) * 4u + c] = staged[c];
#endif
        }
#else
        ws[at + 2u * (li % 16u)] = f16(bf16_lo(st.w[r]));
        ws[at + 2u * (li % 16u) + 1u] = f16(bf16_hi(st.w[r]));
#endif
    }
}

// Writes subgroup `warp`'s accumulator for tokens m_first .. + 15 and tile
// rows n_first .. + 15 (all subgroups call it together).
fn write_out(c: coop_mat16x16<f32, C>, t: Tile, warp: u32, lane: u32, m_first: u32, n_first: u32) {
    coopStoreT(c, &out_tile[warp * 256u], 16u);
    workgroupBarrier();
    for (var r = 0u; r < 8u; r++) {
        let e = lane + 32u * r;
        let m = m_first + e / 16u;
        let n = n_first + e % 16u;
        let w_row = part_row(t, n);
        if (m < t.count && n < t.n_rows && w_row < p.rows) {
            var yrow = m;
            var col = n;
            if (t.grouped) {
                yrow = pairs[t.first_pair + m];
            } else {
                col = p.first_row + n;
            }
            y[yrow * p.y_stride + col] = out_tile[warp * 256u + e];
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) warp: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let t = tile_of(wid, nwg);
    let s = sources(t, li);
    // This subgroup's 32 tokens and WARP_N rows within the tile.
    let wm = warp % WARPS_M;
    let wn = warp / WARPS_M;
    let a_at = wm * 32u * STRIDE;
    let b_at = wn * WARP_N * STRIDE;

    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c03 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c13 = coop_mat16x16<f32, C>();

    var st = load_step(s, 0u, li);
    for (var k0 = 0u; k0 < p.cols; k0 += TILE_K) {
        store_step(st, li);
        workgroupBarrier();
        if (k0 + TILE_K < p.cols) {
            st = load_step(s, k0 + TILE_K, li);
        }
        for (var kk = 0u; kk < TILE_K; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&xs[a_at + kk], STRIDE);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&xs[a_at + 16u * STRIDE + kk], STRIDE);
#if X_SPLIT
            let l0 = coopLoadT<coop_mat16x16<f16, A>>(&xs_lo[a_at + kk], STRIDE);
            let l1 = coopLoadT<coop_mat16x16<f16, A>>(&xs_lo[a_at + 16u * STRIDE + kk], STRIDE);
#endif
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + kk], STRIDE);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c10 = coopMultiplyAdd(a1, b0, c10);
#if X_SPLIT
            c00 = coopMultiplyAdd(l0, b0, c00);
            c10 = coopMultiplyAdd(l1, b0, c10);
#endif
#if W_SPLIT
            let bl0 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + kk], STRIDE);
            c00 = coopMultiplyAdd(a0, bl0, c00);
            c10 = coopMultiplyAdd(a1, bl0, c10);
#endif
            if (FRAGS_N > 1u) {
                let b1 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + 16u * STRIDE + kk], STRIDE);
                c01 = coopMultiplyAdd(a0, b1, c01);
                c11 = coopMultiplyAdd(a1, b1, c11);
#if X_SPLIT
                c01 = coopMultiplyAdd(l0, b1, c01);
                c11 = coopMultiplyAdd(l1, b1, c11);
#endif
#if W_SPLIT
                let bl1 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + 16u * STRIDE + kk], STRIDE);
                c01 = coopMultiplyAdd(a0, bl1, c01);
                c11 = coopMultiplyAdd(a1, bl1, c11);
#endif
            }
            if (FRAGS_N > 2u) {
                let b2 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + 32u * STRIDE + kk], STRIDE);
                c02 = coopMultiplyAdd(a0, b2, c02);
                c12 = coopMultiplyAdd(a1, b2, c12);
#if X_SPLIT
                c02 = coopMultiplyAdd(l0, b2, c02);
                c12 = coopMultiplyAdd(l1, b2, c12);
#endif
#if W_SPLIT
                let bl2 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + 32u * STRIDE + kk], STRIDE);
                c02 = coopMultiplyAdd(a0, bl2, c02);
                c12 = coopMultiplyAdd(a1, bl2, c12);
#endif
            }
            if (FRAGS_N > 3u) {
                let b3 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + 48u * STRIDE + kk], STRIDE);
                c03 = coopMultiplyAdd(a0, b3, c03);
                c13 = coopMultiplyAdd(a1, b3, c13);
#if X_SPLIT
                c03 = coopMultiplyAdd(l0, b3, c03);
                c13 = coopMultiplyAdd(l1, b3, c13);
#endif
#if W_SPLIT
                let bl3 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + 48u * STRIDE + kk], STRIDE);
                c03 = coopMultiplyAdd(a0, bl3, c03);
                c13 = coopMultiplyAdd(a1, bl3, c13);
#endif
            }
        }
        workgroupBarrier();
    }

    let m_first = t.m0 + wm * 32u;
    let n_first = t.n0 + wn * WARP_N;
    write_out(c00, t, warp, lane, m_first, n_first);
    write_out(c10, t, warp, lane, m_first + 16u, n_first);
    if (FRAGS_N > 1u) {
        write_out(c01, t, warp, lane, m_first, n_first + 16u);
        write_out(c11, t, warp, lane, m_first + 16u, n_first + 16u);
    }
    if (FRAGS_N > 2u) {
        write_out(c02, t, warp, lane, m_first, n_first + 32u);
        write_out(c12, t, warp, lane, m_first + 16u, n_first + 32u);
        write_out(c03, t, warp, lane, m_first, n_first + 48u);
        write_out(c13, t, warp, lane, m_first + 16u, n_first + 48u);
    }
}
