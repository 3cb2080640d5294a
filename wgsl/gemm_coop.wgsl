enable f16;
enable wgpu_cooperative_matrix;

// The chunk product of gemm.wgsl (same parameters, bindings, dense and
// grouped modes, SWIGLU; X_F16 and Y_F16 below are its own) on cooperative
// matrices (tensor cores):
//   Y[yrow(m), col(n)] = sum_k X[xrow(m), k] * W[wrow(n), k]
// A workgroup of WARPS subgroups of 32 computes TILE_M tokens x TILE_N weight
// rows, k in steps of TILE_K: the step's X (f32) and W (bf16, or with
// WEIGHT_FORMAT any format of weights.wgsl, decoded) are converted to f16
// as they are staged into workgroup memory, the next step's (AHEAD: or the
// next two steps') loaded into registers while this one multiplies. Each subgroup owns WARP_M tokens x
// WARP_N rows as 16 x 16 f32 accumulators (up to 4 x 4) fed by 16 x 16 x 16
// f16 products; a subgroup loads each of its B fragments once per k slice
// and meets them with its A fragments one row at a time.
// The staged tiles are arrays of vec4<f16>: every invocation stages its
// runs of eight (Q4_K and Q5_K weights: sixteen) values with 8-byte stores
// (element-wise f16 stores made staging, not the products, the kernel's
// cost). Workgroup arrays of u32 reinterpreted
// as f16 by the matrix loads are not an option: NVIDIA's compiler rejects
// such pipelines.
// X_SPLIT: each x is staged as two f16s, x_hi (x cut to 11 bits of
// mantissa) and x_lo = f16(x - x_hi), both multiplied: the activations keep
// 22 bits of mantissa instead of 11, at twice the matrix work. bf16 weights are exact
// in f16 (within its range: weights of magnitude below 2^-14 lose bits).
// X_F16: X is read as the f16 copy of the activations that the kernel
// before wrote beside them (x16, eight values a 16-byte load), the values
// the f32 rows would be rounded to here, in half the bytes, and faster
// than from f32 rows (128 x 256 tiles of 16 subgroups, bf16 and Q8_0). Its
// staging must take one round (TILE_M <= ROUND_ROWS): in two rounds the
// same kernel runs far slower (kernels::gemm_coop::Tile::reads_f16).
// Y_F16 (with SWIGLU): the gated outputs also go to y16 as f16, for the
// product after it to read with X_F16.
// BIAS (dense, whole k), BIAS_ADD: gemm.wgsl's bias epilogues.
// K_SPLIT (dense, plain outputs): K_SPLITS workgroups share each tile, each
// summing one of K_SPLITS consecutive ranges of k, and write their partial
// sums side by side, y packed [tokens, K_SPLITS, y_stride], for the
// residual add after the product to sum: a product of few tiles (the o and
// down projections of a short chunk) then fills the GPU in the tile that
// reads f16 copies (kernels::gemm_coop::Tile::k_splits).
// The accumulators go out through workgroup memory, 16 x 16 at a time, so
// that ragged tiles and the grouped mode's scattered rows are written by
// plain invocations.
// Needs cols % 8 == 0 for bf16 weights and with X_F16, cols % 4 == 0
// otherwise.
// Grid: dense: x = row tiles (K_SPLIT: of each range of k in turn; folded
// into z), y = token tiles, walked token tiles first (consecutive
// workgroups share a weight tile, read once from memory while it sits in
// the cache); grouped: x = row tiles, y = token tiles, z = experts.

// Tokens per workgroup: 32, 64 or 128, weight rows: 128, 192 or 256, and k per
// step: 32 or 64 (pipeline constants, chosen per product by
// kernels::gemm_coop::Tile among those whose staged tiles fit).
override TILE_M: u32 = 128u;
override TILE_N: u32 = 128u;
override TILE_K: u32 = 32u;
// Weight rows per output: a gate/up pair with SWIGLU.
#if SWIGLU
const OUTPUT_STEP: u32 = 2u;
#else
const OUTPUT_STEP: u32 = 1u;
#endif
// A staged row in vec4<f16>s: TILE_K f16s and 16 bytes of padding, which
// keep the 16 x 16 loads of consecutive rows off the same banks.
override ROW: u32 = TILE_K / 4u + 2u;
override XS_LEN: u32 = TILE_M * ROW;
override WS_LEN: u32 = TILE_N * ROW;
// Subgroups: 8 or 16 (a pipeline constant with the tile), WARPS_M
// along the tokens x WARPS_N along the rows, each WARP_M x WARP_N: 32 or
// 64 tokens, 16 to 64 rows (48 in tiles of 192).
override WARPS: u32 = 8u;
override WG: u32 = 32u * WARPS;
override WARP_M: u32 = max(32u, TILE_M * TILE_N / (WARPS * 64u));
override WARPS_M: u32 = TILE_M / WARP_M;
override WARPS_N: u32 = WARPS / WARPS_M;
override WARP_N: u32 = TILE_N / WARPS_N;
// 16 x 16 accumulators per subgroup: FRAGS_M (2 or 4) x FRAGS_N (1 to 4).
override FRAGS_M: u32 = WARP_M / 16u;
override FRAGS_N: u32 = WARP_N / 16u;
// Each invocation stages runs of eight k of X: TILE_K / 8 invocations
// cover a token's step, ROUND_ROWS tokens a round; and runs of W_RUN k of
// W (the format's run: weights.wgsl's RUN), W_ROUND_ROWS rows a round.
override RUNS_PER_ROW: u32 = TILE_K / 8u;
override ROUND_ROWS: u32 = WG / RUNS_PER_ROW;
override X_ROUNDS: u32 = (TILE_M + ROUND_ROWS - 1u) / ROUND_ROWS;
#if WEIGHT_FORMAT
const W_RUN: u32 = RUN;
#else
const W_RUN: u32 = 8u;
#endif
override W_RUNS_PER_ROW: u32 = TILE_K / W_RUN;
override W_ROUND_ROWS: u32 = WG / W_RUNS_PER_ROW;
override W_ROUNDS: u32 = (TILE_N + W_ROUND_ROWS - 1u) / W_ROUND_ROWS;
// K steps whose loads are in flight while a step multiplies: 1, or 2 (a
// second step's values in registers, a loop of its own) where that
// runs faster (kernels::gemm_coop::Tile::ahead).
override AHEAD: u32 = 1u;
#if K_SPLIT
override K_SPLITS: u32 = 2u;
#endif

@group(0) @binding(0) var<uniform> p: GemmParams;
@group(0) @binding(1) var<uniform> step: Step;
// Quads, or (WEIGHT_WORDS: the formats whose runs load words) words.
#if WEIGHT_WORDS
@group(0) @binding(2) var<storage, read> weight: array<u32>;
#else
@group(0) @binding(2) var<storage, read> weight: array<vec4<u32>>;
#endif
#if X_F16
@group(0) @binding(3) var<storage, read> x: array<vec4<u32>>;
#else
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
#endif
#if Y_F16
@group(0) @binding(7) var<storage, read_write> y16: array<f16>;
#endif
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> groups: array<u32>;
@group(0) @binding(6) var<storage, read> pairs: array<u32>;
#if BIAS
// gemm.wgsl's BIAS (never with Y_F16, whose binding it shares).
@group(0) @binding(7) var<storage, read> bias: array<f32>;
#endif

// xs[m * ROW + k / 4]: token m of the tile at k (row-major A);
// ws[n * ROW + k / 4]: weight row n at k (column-major B).
var<workgroup> xs: array<vec4<f16>, XS_LEN>;
#if X_SPLIT
var<workgroup> xs_lo: array<vec4<f16>, XS_LEN>;
#endif
var<workgroup> ws: array<vec4<f16>, WS_LEN>;
#if W_SPLIT
var<workgroup> ws_lo: array<vec4<f16>, WS_LEN>;
#endif
// One 16 x 16 accumulator per subgroup on its way out.
override OUT_LEN: u32 = WARPS * 256u;
var<workgroup> out_tile: array<f32, OUT_LEN>;

fn weight_word(i: u32) -> u32 {
#if WEIGHT_WORDS
    return weight[i];
#else
    return weight[i / 4u][i % 4u];
#endif
}

fn weight_quad(q: u32) -> vec4<u32> {
#if WEIGHT_WORDS
    return words4(4u * q);
#else
    return weight[q];
#endif
}

// Where this invocation's staged values come from, fixed for the whole k
// loop: round r stages token ROUND_ROWS r + li / RUNS_PER_ROW of X at k
// 8 (li % RUNS_PER_ROW) of the step, and weight row W_ROUND_ROWS r + li /
// W_RUNS_PER_ROW of W at k W_RUN (li % W_RUNS_PER_ROW).
// (Arrays of the most rounds of any tile: X_ROUNDS <= 4, W_ROUNDS <= 8.)
struct Sources {
    x_base: array<u32, 4>,
    x_ok: array<bool, 4>,
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
    expert: u32,
#if K_SPLIT
    // Which range of k the workgroup sums.
    split: u32,
#endif
}

// The tile's token count: the chunk's, or its expert's (grouped). Read
// from uniform and read-only memory at a workgroup-uniform index, so that
// the matrix operations after a test of it stay in uniform control flow.
fn tile_count(wid: vec3<u32>) -> u32 {
    if (p.expert_rows > 0u) {
        return groups[2u * (p.expert + wid.z) + 1u];
    }
    return step.n_tokens;
}

// Row tiles of a dense product (K_SPLIT: of each split; the grid walks
// the splits one after another).
fn dense_row_tiles() -> u32 {
    return (p.rows + TILE_N - 1u) / TILE_N;
}

fn tile_of(wid: vec3<u32>, nwg: vec3<u32>) -> Tile {
    // Dense: the dispatch order's index d walks the token tiles of a row
    // tile before the next row tile.
    let d = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
#if K_SPLIT
    let r = d / nwg.y;
    let row_tiles = dense_row_tiles();
    var t = Tile(false, step.n_tokens, 0u, p.rows, (d % nwg.y) * TILE_M, (r % row_tiles) * TILE_N, 0u, r / row_tiles);
#else
    var t = Tile(false, step.n_tokens, 0u, p.rows, (d % nwg.y) * TILE_M, (d / nwg.y) * TILE_N, 0u);
#endif
    if (p.expert_rows > 0u) {
        t.grouped = true;
        t.expert = p.expert + wid.z;
        t.first_pair = groups[2u * t.expert];
        t.count = groups[2u * t.expert + 1u];
        t.n_rows = p.expert_rows;
        t.m0 = wid.y * TILE_M;
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
        let local = ROUND_ROWS * r + li / RUNS_PER_ROW;
        let m = t.m0 + local;
        s.x_ok[r] = local < TILE_M && m < t.count;
        var xrow = m;
        if (t.grouped && s.x_ok[r]) {
            xrow = pairs[t.first_pair + m] / p.x_div;
        }
#if X_F16
        s.x_base[r] = xrow * (p.cols / 8u);
#else
        s.x_base[r] = xrow * (p.cols / 4u);
#endif
    }
#if WEIGHT_FORMAT
    let row_stride = row_words(p.cols);
#else
    let row_stride = p.cols / 8u;
#endif
    for (var r = 0u; r < W_ROUNDS; r++) {
        let local = W_ROUND_ROWS * r + li / W_RUNS_PER_ROW;
        let n = t.n0 + local;
        let w_row = part_row(t, n);
        s.w_ok[r] = local < TILE_N && n < t.n_rows && w_row < p.rows;
        s.w_base[r] = select(0u, w_row * row_stride, s.w_ok[r]);
    }
    return s;
}

// The staged values of one k step, in registers: eight consecutive k of
// each round's token, W_RUN of each round's weight row.
// With WEIGHT_FORMAT, the weights' words as loaded (weights.wgsl's Run),
// decoded when they are stored: decoding them right after their loads
// makes each step wait for the next step's loads before its products, and
// runs Q8_0, Q6_K and Q4_K slower (Q5_K alike). Q4_K's and Q5_K's runs
// of sixteen (their quants one aligned quad: two or three 16-byte loads
// with the block's head) stage 1.2 to 1.4 times faster than their runs of
// eight did (six word loads, the head held once per run; NVIDIA H100, 16
// to 512 tokens).
struct Staged {
#if X_F16
    x: array<vec4<u32>, 4>,
#else
    x: array<array<vec4<f32>, 2>, 4>,
#endif
#if WEIGHT_FORMAT
    w: array<Run, 8>,
#else
    w: array<vec4<u32>, 8>,
#endif
}

// The k of this invocation's run of eight of X in the step at k0.
fn run_k(k0: u32, li: u32) -> u32 {
    return k0 + 8u * (li % RUNS_PER_ROW);
}

// The k of this invocation's run of W.
fn w_run_k(k0: u32, li: u32) -> u32 {
    return k0 + W_RUN * (li % W_RUNS_PER_ROW);
}

fn load_step(s: Sources, k0: u32, li: u32) -> Staged {
    var st: Staged;
    let k = run_k(k0, li);
#if X_F16
    for (var r = 0u; r < X_ROUNDS; r++) {
        st.x[r] = vec4<u32>(0u);
        if (s.x_ok[r] && k < p.cols) {
            st.x[r] = x[s.x_base[r] + k / 8u];
        }
    }
#else
    for (var r = 0u; r < X_ROUNDS; r++) {
        for (var h = 0u; h < 2u; h++) {
            st.x[r][h] = vec4<f32>(0.0);
            if (s.x_ok[r] && k + 4u * h < p.cols) {
                st.x[r][h] = x[s.x_base[r] + k / 4u + h];
            }
        }
    }
#endif
    let wk = w_run_k(k0, li);
    for (var r = 0u; r < W_ROUNDS; r++) {
#if WEIGHT_FORMAT
        // All-zero words decode to zeros in every format.
        st.w[r] = Run();
        if (s.w_ok[r] && wk < p.cols) {
            st.w[r] = load_run(s.w_base[r], wk, p.cols);
        }
#else
        st.w[r] = vec4<u32>(0u);
        if (s.w_ok[r] && wk < p.cols) {
            st.w[r] = weight[s.w_base[r] + wk / 8u];
        }
#endif
    }
    return st;
}

// The part of each value that f16 holds exactly: the top 10 mantissa bits,
// by integer masking, which no compiler folds away as it may f32(f16(v)).
fn high4(v: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) & vec4<u32>(0xffffe000u));
}

fn store_step(st: Staged, k0: u32, li: u32) {
    for (var r = 0u; r < X_ROUNDS; r++) {
        let local = ROUND_ROWS * r + li / RUNS_PER_ROW;
        if (local < TILE_M) {
            let at = local * ROW + 2u * (li % RUNS_PER_ROW);
#if X_SPLIT
            let hi = array(high4(st.x[r][0]), high4(st.x[r][1]));
            xs_lo[at] = vec4<f16>(st.x[r][0] - hi[0]);
            xs_lo[at + 1u] = vec4<f16>(st.x[r][1] - hi[1]);
#else
            let hi = st.x[r];
#endif
#if X_F16
            xs[at] = vec4<f16>(vec4<f32>(unpack2x16float(hi.x), unpack2x16float(hi.y)));
            xs[at + 1u] = vec4<f16>(vec4<f32>(unpack2x16float(hi.z), unpack2x16float(hi.w)));
#else
            xs[at] = vec4<f16>(hi[0]);
            xs[at + 1u] = vec4<f16>(hi[1]);
#endif
        }
    }
    for (var r = 0u; r < W_ROUNDS; r++) {
        let local = W_ROUND_ROWS * r + li / W_RUNS_PER_ROW;
        if (local >= TILE_N) {
            break;
        }
        let at = local * ROW + (W_RUN / 4u) * (li % W_RUNS_PER_ROW);
#if WEIGHT_FORMAT
        let w = decode_run(st.w[r], w_run_k(k0, li));
        for (var j = 0u; j < W_RUN / 4u; j++) {
#if W_SPLIT
            let hi = high4(w[j]);
            ws_lo[at + j] = vec4<f16>(w[j] - hi);
            ws[at + j] = vec4<f16>(hi);
#else
            ws[at + j] = vec4<f16>(w[j]);
#endif
        }
#else
        // bf16 pairs to f16 pairs: exact within f16's range.
        let w = st.w[r];
        ws[at] = vec4<f16>(bf16x4_lo(w));
        ws[at + 1u] = vec4<f16>(bf16x4_hi(w));
#endif
    }
}

alias FragA = coop_mat16x16<f16, A>;
alias FragB = coop_mat16x16<f16, B>;
alias Acc = coop_mat16x16<f32, C>;

// A k slice's B fragments of the subgroup's rows (16-row columns j <
// FRAGS_N; the others are never read).
struct FragsB {
    b0: FragB,
    b1: FragB,
    b2: FragB,
    b3: FragB,
}

fn frags_b(at: u32) -> FragsB {
    var f: FragsB;
    f.b0 = coopLoad<FragB>(&ws[at], ROW);
    if (FRAGS_N > 1u) {
        f.b1 = coopLoad<FragB>(&ws[at + 16u * ROW], ROW);
    }
    if (FRAGS_N > 2u) {
        f.b2 = coopLoad<FragB>(&ws[at + 32u * ROW], ROW);
    }
    if (FRAGS_N > 3u) {
        f.b3 = coopLoad<FragB>(&ws[at + 48u * ROW], ROW);
    }
    return f;
}

#if W_SPLIT
fn frags_b_lo(at: u32) -> FragsB {
    var f: FragsB;
    f.b0 = coopLoad<FragB>(&ws_lo[at], ROW);
    if (FRAGS_N > 1u) {
        f.b1 = coopLoad<FragB>(&ws_lo[at + 16u * ROW], ROW);
    }
    if (FRAGS_N > 2u) {
        f.b2 = coopLoad<FragB>(&ws_lo[at + 32u * ROW], ROW);
    }
    if (FRAGS_N > 3u) {
        f.b3 = coopLoad<FragB>(&ws_lo[at + 48u * ROW], ROW);
    }
    return f;
}
#endif

// One row of accumulators c0 .. c3 (16 tokens): c_j += a b_j.
fn mma_row(a: FragA, b: FragsB, c0: ptr<function, Acc>, c1: ptr<function, Acc>, c2: ptr<function, Acc>, c3: ptr<function, Acc>) {
    *c0 = coopMultiplyAdd(a, b.b0, *c0);
    if (FRAGS_N > 1u) {
        *c1 = coopMultiplyAdd(a, b.b1, *c1);
    }
    if (FRAGS_N > 2u) {
        *c2 = coopMultiplyAdd(a, b.b2, *c2);
    }
    if (FRAGS_N > 3u) {
        *c3 = coopMultiplyAdd(a, b.b3, *c3);
    }
}

// The products of A fragment row i (tokens 16 i ..) at k slice kk of the
// staged step with the slice's B fragments, into that row's accumulators.
fn slice_row(a_at: u32, b: FragsB, b_lo: FragsB, c0: ptr<function, Acc>, c1: ptr<function, Acc>, c2: ptr<function, Acc>, c3: ptr<function, Acc>) {
    let a = coopLoadT<FragA>(&xs[a_at], ROW);
    mma_row(a, b, c0, c1, c2, c3);
#if X_SPLIT
    mma_row(coopLoadT<FragA>(&xs_lo[a_at], ROW), b, c0, c1, c2, c3);
#endif
#if W_SPLIT
    mma_row(a, b_lo, c0, c1, c2, c3);
#endif
}

// The products of one staged k step into the subgroup's accumulators
// (rows of A fragments c0*, c1*, and with FRAGS_M 4 c2*, c3*).
fn multiply_step(
    a_at: u32, b_at: u32,
    c00: ptr<function, Acc>, c01: ptr<function, Acc>, c02: ptr<function, Acc>, c03: ptr<function, Acc>,
    c10: ptr<function, Acc>, c11: ptr<function, Acc>, c12: ptr<function, Acc>, c13: ptr<function, Acc>,
    c20: ptr<function, Acc>, c21: ptr<function, Acc>, c22: ptr<function, Acc>, c23: ptr<function, Acc>,
    c30: ptr<function, Acc>, c31: ptr<function, Acc>, c32: ptr<function, Acc>, c33: ptr<function, Acc>,
) {
    for (var kk = 0u; kk < TILE_K / 4u; kk += 4u) {
        let b = frags_b(b_at + kk);
#if W_SPLIT
        let b_lo = frags_b_lo(b_at + kk);
#else
        let b_lo = b;
#endif
        slice_row(a_at + kk, b, b_lo, c00, c01, c02, c03);
        slice_row(a_at + 16u * ROW + kk, b, b_lo, c10, c11, c12, c13);
        if (FRAGS_M > 2u) {
            slice_row(a_at + 32u * ROW + kk, b, b_lo, c20, c21, c22, c23);
            slice_row(a_at + 48u * ROW + kk, b, b_lo, c30, c31, c32, c33);
        }
    }
}

// Writes subgroup `warp`'s accumulator for tokens m_first .. + 15 and tile
// rows n_first .. + 15 through its own part of out_tile: only its own
// lanes meet there, so subgroup barriers order it (which the Vulkan
// translation makes order workgroup memory).
// (SWIGLU: each lane takes gate/up pairs, even n and n + 1.)
fn write_out(c: Acc, t: Tile, warp: u32, lane: u32, m_first: u32, n_first: u32) {
    coopStoreT(c, &out_tile[warp * 256u], 16u);
    subgroupBarrier();
    for (var r = 0u; r < 8u / OUTPUT_STEP; r++) {
        let e = OUTPUT_STEP * (lane + 32u * r);
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
            let v = out_tile[warp * 256u + e];
#if SWIGLU
            let gated = swiglu(v, out_tile[warp * 256u + e + 1u]);
            y[yrow * p.y_stride + col / 2u] = gated;
#if Y_F16
            y16[yrow * p.y_stride + col / 2u] = f16(gated);
#endif
#else
#if K_SPLIT
            y[(yrow * K_SPLITS + t.split) * p.y_stride + col] = v;
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
#endif
        }
    }
    subgroupBarrier();
}

// The accumulators of fragment row i (tokens m_first + 16 i ..).
fn write_row(c0: Acc, c1: Acc, c2: Acc, c3: Acc, t: Tile, warp: u32, lane: u32, m_first: u32, n_first: u32) {
    write_out(c0, t, warp, lane, m_first, n_first);
    if (FRAGS_N > 1u) {
        write_out(c1, t, warp, lane, m_first, n_first + 16u);
    }
    if (FRAGS_N > 2u) {
        write_out(c2, t, warp, lane, m_first, n_first + 32u);
    }
    if (FRAGS_N > 3u) {
        write_out(c3, t, warp, lane, m_first, n_first + 48u);
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) warp: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    // A tile past its expert's tokens (grouped) or past the rows (the
    // last of a folded grid) has nothing to do. The test is computed here
    // from workgroup-uniform values, so that the matrix operations stay in
    // control flow that the compiler sees is uniform.
    var live = wid.y * TILE_M < tile_count(wid);
    if (p.expert_rows == 0u) {
#if K_SPLIT
        live = (wid.x + nwg.x * (wid.y + nwg.y * wid.z)) / nwg.y < dense_row_tiles() * K_SPLITS;
#else
        live = (wid.x + nwg.x * (wid.y + nwg.y * wid.z)) / nwg.y * TILE_N < p.rows;
#endif
    }
    if (live) {
        product(tile_of(wid, nwg), li, warp, lane);
    }
}

// The tile's product, written to y.
fn product(t: Tile, li: u32, warp: u32, lane: u32) {
    let s = sources(t, li);
    // This subgroup's WARP_M tokens and WARP_N rows within the tile.
    let wm = warp % WARPS_M;
    let wn = warp / WARPS_M;
    let a_at = wm * WARP_M * ROW;
    let b_at = wn * WARP_N * ROW;

    var c00 = Acc();
    var c01 = Acc();
    var c02 = Acc();
    var c03 = Acc();
    var c10 = Acc();
    var c11 = Acc();
    var c12 = Acc();
    var c13 = Acc();
    var c20 = Acc();
    var c21 = Acc();
    var c22 = Acc();
    var c23 = Acc();
    var c30 = Acc();
    var c31 = Acc();
    var c32 = Acc();
    var c33 = Acc();

    // The range of k summed: all of it, or (K_SPLIT) the tile's split.
#if K_SPLIT
    let k_len = p.cols / K_SPLITS;
    let k_begin = t.split * k_len;
#else
    let k_len = p.cols;
    let k_begin = 0u;
#endif
    let k_end = k_begin + k_len;

    // Store, barrier, load the step after (AHEAD 2: two after), multiply,
    // barrier: a loop ordered multiply, barrier, store, load, barrier (the
    // order a double-buffered staging needs) runs the 128 x 256 tile
    // slower, and its double-buffered tiles no faster than this.
    if (AHEAD > 1u) {
        // Two sets of registers in turn, st_a (steps k0) and st_b (k0 +
        // TILE_K), each loaded two steps before it is stored.
        var st_a = load_step(s, k_begin, li);
        var st_b = load_step(s, k_begin + TILE_K, li);
        for (var k0 = k_begin; k0 < k_end; k0 += 2u * TILE_K) {
            store_step(st_a, k0, li);
            workgroupBarrier();
            if (k0 + 2u * TILE_K < k_end) {
                st_a = load_step(s, k0 + 2u * TILE_K, li);
            }
            multiply_step(a_at, b_at, &c00, &c01, &c02, &c03, &c10, &c11, &c12, &c13, &c20, &c21, &c22, &c23, &c30, &c31, &c32, &c33);
            workgroupBarrier();
            if (k0 + TILE_K < k_end) {
                store_step(st_b, k0 + TILE_K, li);
                workgroupBarrier();
                if (k0 + 3u * TILE_K < k_end) {
                    st_b = load_step(s, k0 + 3u * TILE_K, li);
                }
                multiply_step(a_at, b_at, &c00, &c01, &c02, &c03, &c10, &c11, &c12, &c13, &c20, &c21, &c22, &c23, &c30, &c31, &c32, &c33);
                workgroupBarrier();
            }
        }
    } else {
        var st = load_step(s, k_begin, li);
        for (var k0 = k_begin; k0 < k_end; k0 += TILE_K) {
            store_step(st, k0, li);
            workgroupBarrier();
            if (k0 + TILE_K < k_end) {
                st = load_step(s, k0 + TILE_K, li);
            }
            multiply_step(a_at, b_at, &c00, &c01, &c02, &c03, &c10, &c11, &c12, &c13, &c20, &c21, &c22, &c23, &c30, &c31, &c32, &c33);
            workgroupBarrier();
        }
    }

    let m_first = t.m0 + wm * WARP_M;
    let n_first = t.n0 + wn * WARP_N;
    write_row(c00, c01, c02, c03, t, warp, lane, m_first, n_first);
    write_row(c10, c11, c12, c13, t, warp, lane, m_first + 16u, n_first);
    if (FRAGS_M > 2u) {
        write_row(c20, c21, c22, c23, t, warp, lane, m_first + 32u, n_first);
        write_row(c30, c31, c32, c33, t, warp, lane, m_first + 48u, n_first);
    }
}
