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
// The staged tiles are arrays of vec4<f16>: every invocation stages eight
// values with two 8-byte stores (element-wise f16 stores made staging, not
// the products, the kernel's cost). Workgroup arrays of u32 reinterpreted
// as f16 by the matrix loads are not an option: NVIDIA's compiler rejects
// such pipelines.
// X_SPLIT: each x is staged as two f16s, x_hi (x cut to 11 bits of
// mantissa) and x_lo = f16(x - x_hi), both multiplied: the activations keep
// 22 bits of mantissa instead of 11, at twice the matrix work. bf16 weights are exact
// in f16 (within its range: weights of magnitude below 2^-14 lose bits).
// The accumulators go out through workgroup memory, 16 x 16 at a time, so
// that ragged tiles and the grouped mode's scattered rows are written by
// plain invocations.
// Needs cols % 8 == 0 for bf16 weights, cols % 4 == 0 otherwise.
// Grid: x = row tiles (dense: folded into z), y = token tiles, z = experts
// (grouped).

// Tokens per workgroup: 32, 64 or 128 (pipeline constant: narrow tiles for
// expert groups and short chunks).
override TILE_M: u32 = 128u;
const TILE_N: u32 = 128u;
const TILE_K: u32 = 32u;
// A staged row in vec4<f16>s: TILE_K f16s and 16 bytes of padding, which
// keep the 16 x 16 loads of consecutive rows off the same banks.
const ROW: u32 = 10u;
// Subgroups: WARPS_M along the tokens (32 each) x WARPS_N along the rows.
const WARPS: u32 = 8u;
override WARPS_M: u32 = TILE_M / 32u;
override WARPS_N: u32 = WARPS / WARPS_M;
override WARP_N: u32 = TILE_N / WARPS_N;
// 16-row accumulator columns per subgroup: 1, 2 or 4.
override FRAGS_N: u32 = WARP_N / 16u;
// Each invocation stages runs of eight k: four invocations cover a row's
// step, 64 rows a round.
const ROUND_ROWS: u32 = 64u;
override X_ROUNDS: u32 = (TILE_M + ROUND_ROWS - 1u) / ROUND_ROWS;
const W_ROUNDS: u32 = TILE_N / ROUND_ROWS;

@group(0) @binding(0) var<uniform> p: GemmParams;
@group(0) @binding(1) var<uniform> step: Step;
#if WEIGHT_FORMAT
@group(0) @binding(2) var<storage, read> weight: array<u32>;
#else
@group(0) @binding(2) var<storage, read> weight: array<vec4<u32>>;
#endif
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> groups: array<u32>;
@group(0) @binding(6) var<storage, read> pairs: array<u32>;

// xs[m * ROW + k / 4]: token m of the tile at k (row-major A);
// ws[n * ROW + k / 4]: weight row n at k (column-major B).
var<workgroup> xs: array<vec4<f16>, 128 * 10>;
#if X_SPLIT
var<workgroup> xs_lo: array<vec4<f16>, 128 * 10>;
#endif
var<workgroup> ws: array<vec4<f16>, 128 * 10>;
#if W_SPLIT
var<workgroup> ws_lo: array<vec4<f16>, 128 * 10>;
#endif
// One 16 x 16 accumulator per subgroup on its way out.
var<workgroup> out_tile: array<f32, 8 * 256>;
// The tile's token count (its expert's, when grouped).
var<workgroup> tile_count: u32;

fn weight_word(i: u32) -> u32 {
#if WEIGHT_FORMAT
    return weight[i];
#else
    return weight[i / 4u][i % 4u];
#endif
}

// Where this invocation's staged values come from, fixed for the whole k
// loop: round r stages tile row 64 r + li / 4 (tokens for X, weight rows
// for W) at k 8 (li % 4) of the step.
struct Sources {
    x_base: array<u32, 2>,
    x_ok: array<bool, 2>,
    w_base: array<u32, 2>,
    w_ok: array<bool, 2>,
}

struct Tile {
    grouped: bool,
    count: u32,
    first_pair: u32,
    n_rows: u32,
    m0: u32,
    n0: u32,
    expert: u32,
}

fn tile_of(wid: vec3<u32>, nwg: vec3<u32>) -> Tile {
    var t = Tile(p.expert_rows > 0u, step.n_tokens, 0u, p.rows, wid.y * TILE_M, (wid.x + wid.z * nwg.x) * TILE_N, 0u);
    if (t.grouped) {
        t.expert = p.expert + wid.z;
        t.first_pair = groups[2u * t.expert];
        t.count = groups[2u * t.expert + 1u];
        t.n_rows = p.expert_rows;
        t.n0 = wid.x * TILE_N;
    }
    return t;
}

// The weight part's row of tile row n (a huge value when the grouped
// expert's row lies outside this part).
fn part_row(t: Tile, n: u32) -> u32 {
    if (t.grouped) {
        return t.expert * p.expert_rows + n - p.first_row;
    }
    return n;
}

fn sources(t: Tile, li: u32) -> Sources {
    var s: Sources;
    for (var r = 0u; r < X_ROUNDS; r++) {
        let local = ROUND_ROWS * r + li / 4u;
        let m = t.m0 + local;
        s.x_ok[r] = local < TILE_M && m < t.count;
        var xrow = m;
        if (t.grouped && s.x_ok[r]) {
            xrow = pairs[t.first_pair + m] / p.x_div;
        }
        s.x_base[r] = xrow * (p.cols / 4u);
    }
#if WEIGHT_FORMAT
    let row_stride = row_words(p.cols);
#else
    let row_stride = p.cols / 8u;
#endif
    for (var r = 0u; r < W_ROUNDS; r++) {
        let n = t.n0 + ROUND_ROWS * r + li / 4u;
        let w_row = part_row(t, n);
        s.w_ok[r] = n < t.n_rows && w_row < p.rows;
        s.w_base[r] = select(0u, w_row * row_stride, s.w_ok[r]);
    }
    return s;
}

// The staged values of one k step, in registers: eight consecutive k of
// each round's row.
struct Staged {
    x: array<array<vec4<f32>, 2>, 2>,
#if WEIGHT_FORMAT
    w: array<array<vec4<f32>, 2>, 2>,
#else
    w: array<vec4<u32>, 2>,
#endif
}

fn load_step(s: Sources, k0: u32, li: u32) -> Staged {
    var st: Staged;
    let k = k0 + 8u * (li % 4u);
    for (var r = 0u; r < X_ROUNDS; r++) {
        for (var h = 0u; h < 2u; h++) {
            st.x[r][h] = vec4<f32>(0.0);
            if (s.x_ok[r] && k + 4u * h < p.cols) {
                st.x[r][h] = x[s.x_base[r] + k / 4u + h];
            }
        }
    }
    for (var r = 0u; r < W_ROUNDS; r++) {
#if WEIGHT_FORMAT
        for (var h = 0u; h < 2u; h++) {
            st.w[r][h] = vec4<f32>(0.0);
            if (s.w_ok[r] && k + 4u * h < p.cols) {
                st.w[r][h] = weights4(s.w_base[r], k + 4u * h);
            }
        }
#else
        st.w[r] = vec4<u32>(0u);
        if (s.w_ok[r] && k < p.cols) {
            st.w[r] = weight[s.w_base[r] + k / 8u];
        }
#endif
    }
    return st;
}

// The part of each value that f16 holds exactly: the top 10 mantissa bits,
// by integer masking, which no compiler folds away as it may f32(f16(v)).
fn high8(v: array<vec4<f32>, 2>) -> array<vec4<f32>, 2> {
    let mask = vec4<u32>(0xffffe000u);
    return array(bitcast<vec4<f32>>(bitcast<vec4<u32>>(v[0]) & mask), bitcast<vec4<f32>>(bitcast<vec4<u32>>(v[1]) & mask));
}

fn minus8(a: array<vec4<f32>, 2>, b: array<vec4<f32>, 2>) -> array<vec4<f32>, 2> {
    return array(a[0] - b[0], a[1] - b[1]);
}

fn store_step(st: Staged, li: u32) {
    for (var r = 0u; r < X_ROUNDS; r++) {
        let at = (ROUND_ROWS * r + li / 4u) * ROW + 2u * (li % 4u);
#if X_SPLIT
        let hi = high8(st.x[r]);
        let lo = minus8(st.x[r], hi);
        xs_lo[at] = vec4<f16>(lo[0]);
        xs_lo[at + 1u] = vec4<f16>(lo[1]);
#else
        let hi = st.x[r];
#endif
        xs[at] = vec4<f16>(hi[0]);
        xs[at + 1u] = vec4<f16>(hi[1]);
    }
    for (var r = 0u; r < W_ROUNDS; r++) {
        let at = (ROUND_ROWS * r + li / 4u) * ROW + 2u * (li % 4u);
#if WEIGHT_FORMAT
#if W_SPLIT
        let hi = high8(st.w[r]);
        let lo = minus8(st.w[r], hi);
        ws_lo[at] = vec4<f16>(lo[0]);
        ws_lo[at + 1u] = vec4<f16>(lo[1]);
#else
        let hi = st.w[r];
#endif
        ws[at] = vec4<f16>(hi[0]);
        ws[at + 1u] = vec4<f16>(hi[1]);
#else
        // bf16 pairs to f16 pairs: exact within f16's range.
        let w = st.w[r];
        ws[at] = vec4<f16>(vec4<f32>(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y)));
        ws[at + 1u] = vec4<f16>(vec4<f32>(bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w)));
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
    // Grouped: a tile past its expert's tokens has nothing to do. The count
    // goes through workgroup memory so that the matrix operations stay in
    // control flow that the compiler sees is uniform.
    if (li == 0u) {
        tile_count = t.count;
    }
    if (t.m0 < workgroupUniformLoad(&tile_count)) {
        product(t, li, warp, lane);
    }
}

// The tile's product, written to y.
fn product(t: Tile, li: u32, warp: u32, lane: u32) {
    let s = sources(t, li);
    // This subgroup's 32 tokens and WARP_N rows within the tile.
    let wm = warp % WARPS_M;
    let wn = warp / WARPS_M;
    let a_at = wm * 32u * ROW;
    let b_at = wn * WARP_N * ROW;

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
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&xs[a_at + kk / 4u], ROW);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&xs[a_at + 16u * ROW + kk / 4u], ROW);
#if X_SPLIT
            let l0 = coopLoadT<coop_mat16x16<f16, A>>(&xs_lo[a_at + kk / 4u], ROW);
            let l1 = coopLoadT<coop_mat16x16<f16, A>>(&xs_lo[a_at + 16u * ROW + kk / 4u], ROW);
#endif
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + kk / 4u], ROW);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c10 = coopMultiplyAdd(a1, b0, c10);
#if X_SPLIT
            c00 = coopMultiplyAdd(l0, b0, c00);
            c10 = coopMultiplyAdd(l1, b0, c10);
#endif
#if W_SPLIT
            let bl0 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + kk / 4u], ROW);
            c00 = coopMultiplyAdd(a0, bl0, c00);
            c10 = coopMultiplyAdd(a1, bl0, c10);
#endif
            if (FRAGS_N > 1u) {
                let b1 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + 16u * ROW + kk / 4u], ROW);
                c01 = coopMultiplyAdd(a0, b1, c01);
                c11 = coopMultiplyAdd(a1, b1, c11);
#if X_SPLIT
                c01 = coopMultiplyAdd(l0, b1, c01);
                c11 = coopMultiplyAdd(l1, b1, c11);
#endif
#if W_SPLIT
                let bl1 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + 16u * ROW + kk / 4u], ROW);
                c01 = coopMultiplyAdd(a0, bl1, c01);
                c11 = coopMultiplyAdd(a1, bl1, c11);
#endif
            }
            if (FRAGS_N > 2u) {
                let b2 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + 32u * ROW + kk / 4u], ROW);
                c02 = coopMultiplyAdd(a0, b2, c02);
                c12 = coopMultiplyAdd(a1, b2, c12);
#if X_SPLIT
                c02 = coopMultiplyAdd(l0, b2, c02);
                c12 = coopMultiplyAdd(l1, b2, c12);
#endif
#if W_SPLIT
                let bl2 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + 32u * ROW + kk / 4u], ROW);
                c02 = coopMultiplyAdd(a0, bl2, c02);
                c12 = coopMultiplyAdd(a1, bl2, c12);
#endif
            }
            if (FRAGS_N > 3u) {
                let b3 = coopLoad<coop_mat16x16<f16, B>>(&ws[b_at + 48u * ROW + kk / 4u], ROW);
                c03 = coopMultiplyAdd(a0, b3, c03);
                c13 = coopMultiplyAdd(a1, b3, c13);
#if X_SPLIT
                c03 = coopMultiplyAdd(l0, b3, c03);
                c13 = coopMultiplyAdd(l1, b3, c13);
#endif
#if W_SPLIT
                let bl3 = coopLoad<coop_mat16x16<f16, B>>(&ws_lo[b_at + 48u * ROW + kk / 4u], ROW);
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
