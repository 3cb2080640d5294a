// Matrix-vector products, for every token t in flight,
// with what comes before and after the product fused in, so that a
// projection is one pass over its weights and one dispatch per weight part:
//   (plain)  y[t, o] = W[o] . x[t]
//   NORM     x[t] is first replaced by rms_norm(x[t]) * norm_w (f32), computed here:
//            W[o] . (norm_w * x[t]) * rsqrt(mean(x[t]^2) + eps)
//   SWIGLU   W holds gate and up rows interleaved (row 2o gate, 2o+1 up):
//            y[t, o] = silu(W[2o] . x[t]) * (W[2o+1] . x[t])
//   ADD      y[t, o] = layer_output(y[t, o] + result): the residual add,
//            steered and captured where STEER / CAPTURE are set (common.wgsl)
//   EXPERTS  W stacks experts of expert_rows rows; ids / route_weights
//            [tokens, top_k] are the router's choice, read on the GPU:
//     SLOTS  grid y = t * top_k + j: the rows of expert ids[t, j];
//            output row (t * top_k + j)
//     SUM    (with ADD) y[t, o] += sum_j route_weights[t, j] * W_{ids[t, j]}[o] . x[t * top_k + j]
//            (INT8_DOTS: as one long row, each x[t * top_k + j] staged times
//            its weight)
//     An id of EXPERT_ELSEWHERE (expert streaming: not on the GPU in this
//     pass) skips its slot, and a token all of whose slots it marks is
//     left as it is: another pass computes it.
// Outputs o run over [0, outputs) and are written at out_offset + o. W is
// one part (rows first_row .. first_row + rows) of a tensor that may be
// split over bindings; an output whose rows this part does not hold is
// left to the part that does (SUM: each part adds the slots it holds).
// A group of THREADS_PER_ROW invocations computes two rows, sharing each
// load of x: outputs o and o + 1, or SWIGLU's gate and up of output o
// (ONE_ROW: one row, output o); ROWS_PER_WG groups per workgroup. One invocation per group suits CPU
// rasterisers; a subgroup (SUBGROUPS) or a workgroup reduction per group
// suits GPUs. bf16 rows of 8k columns
// are read 8 weights at a time, other widths (even) one word at a time;
// with WEIGHT_FORMAT, rows in any format of weights.wgsl are read by its
// units (UNIT_DOTS: the 256-element block formats), consecutive lanes on
// consecutive units, or else four weights at a time, consecutive lanes on
// consecutive quads; INT8_DOTS: by units against x staged by the whole
// workgroup as bytes (below), for the formats whose quants fit a byte or
// become bytes through a table or grid (weights.wgsl).
// Grid: workgroups folded over x and z, each taking blocks of ROWS_PER_WG
// groups' outputs in turn (one block each unless the host caps the grid:
// then INT8_DOTS stages x once for all of them where it fits one chunk);
// y = token (SLOTS: token * top_k + slot), relabelled in main so that
// tokens vary fastest in launch order.

override ROWS_PER_WG: u32 = 64u;
override THREADS_PER_ROW: u32 = 1u;
override WG: u32 = 64u; // = ROWS_PER_WG * THREADS_PER_ROW, set by the host
// 8-weight loads (or units) each lane issues together (loads in flight).
override UNROLL: u32 = 1u;

// kernels::gemv::EXPERT_ELSEWHERE.
const EXPERT_ELSEWHERE: u32 = 0xfffffffeu;

@group(0) @binding(0) var<uniform> p: GemvParams;
@group(0) @binding(1) var<storage, read> weight: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if NORM
@group(0) @binding(4) var<storage, read> norm_w: array<vec4<f32>>;
#endif
#if EXPERTS
@group(0) @binding(5) var<storage, read> ids: array<u32>;
#endif
#if SUM
@group(0) @binding(6) var<storage, read> route_weights: array<f32>;
#endif

fn x_at(i: u32) -> f32 {
    return x[i >> 2u][i & 3u];
}

fn weight_word(i: u32) -> u32 {
    return weight[i >> 2u][i & 3u];
}

fn weight_quad(q: u32) -> vec4<u32> {
    return weight[q];
}

// This lane's share of W[row] . x[xb ..] in .x and of W[row_b] . x in .y
// (each load of x serves both rows), x multiplied by norm_w with NORM, and
// of x . x in .z.
#if WEIGHT_FORMAT
#if INT8_DOTS
// x, a chunk of X_CHUNK elements at a time, staged by the whole workgroup:
// each block of 32 elements (times norm_w with NORM) rounded to steps of
// s = max |x| / (63 * 2^16), as three signed bytes h, m, l of 256^2 h +
// 256 m + l, so that the rows' quants meet x on the integer dot units.
// The error is within two steps, 2^-21 of the block's largest element
// (half a step, and the f32 roundings of x / s and of its product with s;
// f32 itself: 2^-24 of each element; two bytes gave errors of 1e-3 in the
// fixtures' logits).
// X_CHUNK is set by the host (kernels::gemv::x_chunk): 4096, or with
// SUBGROUPS (whose staging needs no per-quad arrays beside the chunk), for
// rows of more than two such chunks (SUM: past one), as much of the row as
// workgroup memory holds (14336 in NVIDIA's 48 KiB), staged once rather than in four
// chunks, each of which drained the weight loads (a 4096 x 14336 down
// projection runs faster so).
// Beside it the host sets X_RUNS = X_CHUNK / 16, X_BLOCKS = X_CHUNK / 32
// and X_QUADS = X_CHUNK / 4: naga sizes a workgroup array by an
// override's name, not by an expression of one.
override X_CHUNK: u32 = 4096u;
override X_RUNS: u32 = 256u;
override X_BLOCKS: u32 = 128u;
override X_QUADS: u32 = 1024u;
// Run r (16 elements) of the chunk: its bytes h, m, l.
var<workgroup> x_high: array<vec4<u32>, X_RUNS>;
var<workgroup> x_mid: array<vec4<u32>, X_RUNS>;
var<workgroup> x_low: array<vec4<u32>, X_RUNS>;
// s of each block of 32, and the sum of each run of the values staged.
var<workgroup> x_scale: array<f32, X_BLOCKS>;
var<workgroup> x_sums: array<f32, X_RUNS>;

// The 16 signed bytes of q dotted with each byte of run r: (h, m, l).
fn digit_dots(q: vec4<u32>, r: u32) -> vec3<i32> {
    let h = x_high[r];
    let m = x_mid[r];
    let l = x_low[r];
    return vec3<i32>(
        dot4I8Packed(q.x, h.x) + dot4I8Packed(q.y, h.y) + dot4I8Packed(q.z, h.z) + dot4I8Packed(q.w, h.w),
        dot4I8Packed(q.x, m.x) + dot4I8Packed(q.y, m.y) + dot4I8Packed(q.z, m.z) + dot4I8Packed(q.w, m.w),
        dot4I8Packed(q.x, l.x) + dot4I8Packed(q.y, l.y) + dot4I8Packed(q.z, l.z) + dot4I8Packed(q.w, l.w),
    );
}

// Digit dots within the block of 32 that holds run r, as a value.
fn block_value(d: vec3<i32>, r: u32) -> f32 {
    // Each at most 32 * 128 * 128 in magnitude: converted from its bits.
    return x_scale[r / 2u] * fma(small_int_f32(d.x), 65536.0, fma(small_int_f32(d.y), 256.0, small_int_f32(d.z)));
}

fn x_run16(q: vec4<u32>, r: u32) -> f32 {
    return block_value(digit_dots(q, r), r);
}

fn x_run32(qa: vec4<u32>, qb: vec4<u32>, r: u32) -> f32 {
    return block_value(digit_dots(qa, r) + digit_dots(qb, r + 1u), r);
}

fn x_sum16(r: u32) -> f32 {
    return x_sums[r];
}

fn x_sum32(r: u32) -> f32 {
    return x_sums[r] + x_sums[r + 1u];
}

// 1.5 * 2^23: the bits of v + ROUNDER less those of ROUNDER are v rounded
// to an integer (|v| < 2^22), read as integers: rounding without a
// float-to-integer conversion (a quarter of the float rate on NVIDIA), and
// without a float subtraction that a compiler may fold into v.
const ROUNDER: f32 = 12582912.0;

// The lowest base-256 digit of n in -128 .. 127 (n less it is a multiple of 256).
fn balanced_digit(n: vec4<i32>) -> vec4<i32> {
    return ((n + vec4<i32>(128)) & vec4<i32>(255)) - vec4<i32>(128);
}

// Bytes b0 .. b3 (low 8 bits of each) as one word.
fn pack_bytes(b: vec4<i32>) -> u32 {
    let u = bitcast<vec4<u32>>(b) & vec4<u32>(0xffu);
    return u.x | (u.y << 8u) | (u.z << 16u) | (u.w << 24u);
}

// Steps per block scale.
const STEPS: f32 = 63.0 * 65536.0;

// Quad q of the chunk at c0 of the vector whose first quad is xq, times
// norm_w with NORM.
fn chunk_quad(xq: u32, c0: u32, q: u32) -> vec4<f32> {
    var v = x[xq + c0 / 4u + q];
#if NORM
    v *= norm_w[c0 / 4u + q];
#endif
#if SUM
    // The slot's route weight: the sum over slots is one long row.
    v *= route_weights[(4u * xq + c0 + 4u * q) / p.cols];
#endif
    return v;
}

// Quad a of the chunk, at quad q, as digits in x_high, x_mid, x_low, with
// inv = STEPS / (its block's largest magnitude); returns the sum of its steps.
// Each value becomes t steps, t = 65536 h + 256 m + l in balanced digits
// (each in -128 .. 127); at most 4 * STEPS in all: exact in f32.
fn stage_digits(a: vec4<f32>, inv: f32, q: u32) -> f32 {
    let t = bitcast<vec4<i32>>(a * inv + ROUNDER) - vec4<i32>(0x4b400000);
    let l = balanced_digit(t);
    let n1 = (t - l) >> vec4<u32>(8u);
    let m = balanced_digit(n1);
    x_high[q / 4u][q % 4u] = pack_bytes((n1 - m) >> vec4<u32>(8u));
    x_mid[q / 4u][q % 4u] = pack_bytes(m);
    x_low[q / 4u][q % 4u] = pack_bytes(l);
    return f32(t.x + t.y + t.z + t.w);
}

// The largest magnitude of a quad, infinite where a value is not finite
// (then its block gets no steps and a NaN scale, which reaches every
// product of the block).
fn quad_largest(a: vec4<f32>) -> f32 {
    let m = abs(a);
    let finite = all((bitcast<vec4<u32>>(a) & vec4<u32>(0x7f800000u)) != vec4<u32>(0x7f800000u));
    return select(bitcast<f32>(0x7f800000u), max(max(m.x, m.y), max(m.z, m.w)), finite);
}

// A block's scale s from its largest magnitude.
fn block_scale(largest: f32) -> f32 {
    return select(largest / STEPS, bitcast<f32>(0x7fc00000u), bitcast<u32>(largest) == 0x7f800000u);
}

#if SUBGROUPS
// Quads of x each invocation loads before staging any of them: all
// that it stages of a chunk (STAGED_QUADS, set by the host for dense
// products; expert products keep one), at most MAX_STAGE_BATCH (the
// size of the arrays that hold them). A chunk of 4096 (two quads an
// invocation of 512) has all its loads in flight together, a
// 14336-column row its seven in two rounds rather than seven, each of
// which waited for its load. Four for every product, expert ones
// included, slow a MoE decode (`qwen3-30b-a3b-16l`), whose expert
// products stage one quad an invocation (three, the slot sum).
const MAX_STAGE_BATCH: u32 = 4u;
override STAGED_QUADS: u32 = 1u;
override STAGE_BATCH: u32 = min(STAGED_QUADS, MAX_STAGE_BATCH);

// Stages elements c0 .. c0 + n (n a multiple of 32) of the vector whose
// first quad is xq, one quad per invocation at a time (STAGE_BATCH of
// them loaded first): the eight
// invocations of a block (lanes 8k .. 8k + 7 of a subgroup: subgroups of
// at least 8 lanes numbered in order of local index, as SUBGROUP_SUM's
// builds arrange them) agree on its largest magnitude, and the four of a
// run sum their steps, by shuffles, so that staging is one pass with no
// barrier inside (rather than three with two, which decodes slower with
// whole 14336-column chunks; staging a whole block per invocation, 128 of
// 512 busy, slower still). Returns this invocation's share of their sum of squares (before norm_w). Every invocation calls it
// (the shuffles need the whole subgroup); the caller puts a barrier before
// and after.
fn stage_x(xq: u32, c0: u32, n: u32, li: u32) -> f32 {
    let quads = n / 4u;
    var squares = 0.0;
    for (var q0 = 0u; q0 < quads; q0 += STAGE_BATCH * WG) {
        // The batch's loads all issued before any of them is waited for.
        var a: array<vec4<f32>, MAX_STAGE_BATCH>;
#if NORM
        var raw: array<vec4<f32>, MAX_STAGE_BATCH>;
#endif
        for (var i = 0u; i < STAGE_BATCH; i++) {
            let q = min(q0 + i * WG + li, quads - 1u);
            a[i] = chunk_quad(xq, c0, q);
#if NORM
            raw[i] = x[xq + c0 / 4u + q];
#endif
        }
        for (var i = 0u; i < STAGE_BATCH; i++) {
            // Uniform: the whole workgroup leaves together.
            if (q0 + i * WG >= quads) {
                break;
            }
            let q = q0 + i * WG + li;
            let live = q < quads;
#if NORM
            squares += select(0.0, dot(raw[i], raw[i]), live);
#endif
            var largest = quad_largest(a[i]);
            for (var o = 1u; o < 8u; o <<= 1u) {
                largest = max(largest, subgroupShuffleXor(largest, o));
            }
            let inv = select(0.0, STEPS / largest, largest > 0.0);
            var steps = 0.0;
            if (live) {
                steps = stage_digits(a[i], inv, q);
            }
            // The run's four quads' steps, summed in their order.
            let run_steps = ((steps + subgroupShuffleXor(steps, 1u)) + subgroupShuffleXor(steps, 2u)) + subgroupShuffleXor(steps, 3u);
            let scale = block_scale(largest);
            if (live && q % 8u == 0u) {
                x_scale[q / 8u] = scale;
            }
            if (live && q % 4u == 0u) {
                x_sums[q / 4u] = run_steps * scale;
            }
        }
    }
    return squares;
}
#else
// Per quad of the chunk: its largest magnitude (infinite where a value is
// not finite), then the sum of its steps.
var<workgroup> quad_max: array<f32, X_QUADS>;
var<workgroup> quad_steps: array<f32, X_QUADS>;

// Stages elements c0 .. c0 + n (n a multiple of 32) of the vector whose
// first quad is xq, one quad per invocation at a time; returns this
// invocation's share of their sum of squares (before norm_w). Every
// invocation calls it (it has barriers).
fn stage_x(xq: u32, c0: u32, n: u32, li: u32) -> f32 {
    var squares = 0.0;
    for (var q = li; q < n / 4u; q += WG) {
#if NORM
        let raw = x[xq + c0 / 4u + q];
        squares += dot(raw, raw);
#endif
        quad_max[q] = quad_largest(chunk_quad(xq, c0, q));
    }
    workgroupBarrier();
    for (var q = li; q < n / 4u; q += WG) {
        let block = q / 8u;
        var largest = 0.0;
        for (var k = 0u; k < 8u; k++) {
            largest = max(largest, quad_max[8u * block + k]);
        }
        let inv = select(0.0, STEPS / largest, largest > 0.0);
        quad_steps[q] = stage_digits(chunk_quad(xq, c0, q), inv, q);
        if (q % 8u == 0u) {
            x_scale[block] = block_scale(largest);
        }
    }
    workgroupBarrier();
    for (var r = li; r < n / 16u; r += WG) {
        let steps = quad_steps[4u * r] + quad_steps[4u * r + 1u] + quad_steps[4u * r + 2u] + quad_steps[4u * r + 3u];
        x_sums[r] = steps * x_scale[r / 2u];
    }
    return squares;
}
#endif

// This lane's share of the two rows' dots over their units [begin, end),
// the staged chunk starting at run r0 of the rows (16 elements a run).
fn chunk_dots(row: u32, row_b: u32, lane: u32, begin: u32, end: u32, r0: u32) -> vec2<f32> {
    var r = vec2<f32>(0.0);
    let words_per_row = row_words(p.cols);
    let wa = row * words_per_row;
    let wb = row_b * words_per_row;
    for (var u0 = begin + lane; u0 < end; u0 += THREADS_PER_ROW * UNROLL) {
      // Units past the end read the last one and are not counted (no
      // branch: the UNROLL units' loads are all issued together).
      for (var i = 0u; i < UNROLL; i++) {
        let u = u0 + i * THREADS_PER_ROW;
        r += select(vec2<f32>(0.0), unit_dots(wa, wb, min(u, end - 1u), r0), u < end);
      }
    }
    return r;
}

// The workgroup's sum of squares of the x staged last, for a block that
// reuses it.
var<workgroup> staged_squares: f32;

// pair_dots over x staged chunk by chunk; .z is the whole workgroup's sum
// of squares. With `staged`, the vector is the one the workgroup staged
// for its previous block: a single chunk is still in place and is not
// staged again. Every invocation calls it.
fn product(live: vec2<bool>, row: u32, xb: u32, lane: u32, li: u32, staged: bool) -> vec3<f32> {
    let rows = live_rows(live, row);
    let reuse = staged && p.cols <= X_CHUNK;
    var d = vec3<f32>(0.0);
    for (var c0 = 0u; c0 < p.cols; c0 += X_CHUNK) {
        let n = min(X_CHUNK, p.cols - c0);
        if (!reuse) {
            // The previous chunk (or product) may still be being read.
            workgroupBarrier();
            d.z += stage_x(xb / 4u, c0, n, li);
            workgroupBarrier();
        }
        if (any(live)) {
            let c = chunk_dots(rows.x, rows.y, lane, c0 / UNIT_ELEMS, (c0 + n) / UNIT_ELEMS, c0 / 16u);
            d.x += c.x;
            d.y += c.y;
        }
    }
#if NORM
    if (reuse) {
        d.z = staged_squares;
    } else {
        d.z = workgroup_sum(d.z, li);
        staged_squares = d.z;
    }
#endif
    return d;
}

#if SUM
// SUM: token t's slots as one long row of top_k * cols elements, each
// slot's x times its route weight, staged chunk by chunk, so that the
// workgroup stages once for all its slots (a block of 32 never straddles
// two: cols is a whole number of weight blocks). Each slot's units meet
// the rows of its expert, where this part holds them. The lanes walk the
// chunk's units across its slots, UNROLL at a time, so that a round's
// loads are in flight together whichever slots they fall in (a
// Qwen3-30B-A3B slot of 768 columns is 24 units: walked slot by slot, a
// round of 32 lanes left 8 idle, and each slot waited on its own loads).
fn slots_product(o: u32, t: u32, lane: u32, li: u32) -> vec2<f32> {
    let long = p.top_k * p.cols;
    let slot_units = p.cols / UNIT_ELEMS;
    let words_per_row = row_words(p.cols);
    let first_pair = t * p.top_k;
    var d = vec2<f32>(0.0);
    for (var c0 = 0u; c0 < long; c0 += X_CHUNK) {
        let n = min(X_CHUNK, long - c0);
        // The previous chunk may still be being read.
        workgroupBarrier();
        stage_x(first_pair * p.cols / 4u, c0, n, li);
        workgroupBarrier();
        let end = (c0 + n) / UNIT_ELEMS;
        for (var u0 = c0 / UNIT_ELEMS + lane; u0 < end; u0 += THREADS_PER_ROW * UNROLL) {
          for (var i = 0u; i < UNROLL; i++) {
            // Units past the end read the last one and are not counted
            // (no branch: the round's loads are all issued together).
            let f = u0 + i * THREADS_PER_ROW;
            let u = min(f, end - 1u);
            let j = u / slot_units;
            let id = ids[first_pair + j];
            // Wraps to a huge value (not live) when the row is before this part.
            let row = id * p.expert_rows + o - p.first_row;
            let live = pair_live(o, row) & vec2<bool>(id != EXPERT_ELSEWHERE && f < end);
            // A pair with no live row reads row 0 of the part.
            let rows = select(vec2<u32>(0u), live_rows(live, row), any(live));
            // The chunk's first run counted from the slot's (wrapping when
            // the chunk starts before the slot: unit_dots' runs are the
            // same either way).
            let r0 = c0 / 16u - j * (p.cols / 16u);
            let c = unit_dots(rows.x * words_per_row, rows.y * words_per_row, u - j * slot_units, r0);
            d += select(vec2<f32>(0.0), c, live);
          }
        }
    }
    return d;
}
#endif
#else
#if UNIT_DOTS

// Quad q of the vector whose first quad is xq, times norm_w with NORM.
fn x4(xq: u32, q: u32) -> vec4<f32> {
#if NORM
    return x[xq + q] * norm_w[q];
#else
    return x[xq + q];
#endif
}

fn lane_dots(row: u32, row_b: u32, xb: u32, lane: u32) -> vec3<f32> {
    var r = vec3<f32>(0.0);
    let words_per_row = row_words(p.cols);
    let wa = row * words_per_row;
    let wb = row_b * words_per_row;
    let xq = xb / 4u;
    let units = p.cols / UNIT_ELEMS;
    for (var u0 = lane; u0 < units; u0 += THREADS_PER_ROW * UNROLL) {
      // Units past the end read the last one and are not counted (no
      // branch: the UNROLL units' loads are all issued together).
      for (var i = 0u; i < UNROLL; i++) {
        let u = u0 + i * THREADS_PER_ROW;
        let d = select(vec2<f32>(0.0), unit_dots(wa, wb, min(u, units - 1u), xq), u < units);
        r.x += d.x;
        r.y += d.y;
      }
    }
#if NORM
    for (var q = lane; q < p.cols / 4u; q += THREADS_PER_ROW) {
        let a = x[xq + q];
        r.z += dot(a, a);
    }
#endif
    return r;
}
#else
fn lane_dots(row: u32, row_b: u32, xb: u32, lane: u32) -> vec3<f32> {
    var r = vec3<f32>(0.0);
    let quads = p.cols / 4u;
    let words_per_row = row_words(p.cols);
    let wa = row * words_per_row;
    let wb = row_b * words_per_row;
    let xq = xb / 4u;
    // A quad is a word or two of weights: four times as many per load round.
    for (var k0 = lane; k0 < quads; k0 += THREADS_PER_ROW * 4u * UNROLL) {
      // Quads past the end read the last one and count as zeros (no
      // branch: the round's loads are all issued together).
      for (var u = 0u; u < 4u * UNROLL; u++) {
        let k = min(k0 + u * THREADS_PER_ROW, quads - 1u);
        var a = x[xq + k];
        var d = vec3<f32>(0.0);
#if NORM
        d.z = dot(a, a);
        a *= norm_w[k];
#endif
        d.x = dot(weights4(wa, 4u * k), a);
        d.y = dot(weights4(wb, 4u * k), a);
        r += select(vec3<f32>(0.0), d, k0 + u * THREADS_PER_ROW < quads);
      }
    }
    return r;
}
#endif
#endif
#else
fn lane_dots(row: u32, row_b: u32, xb: u32, lane: u32) -> vec3<f32> {
    var r = vec3<f32>(0.0);
    if (p.cols % 8u == 0u && xb % 4u == 0u) {
        let per_row = p.cols / 8u;
        let wa = row * per_row;
        let wb = row_b * per_row;
        let xv = xb / 4u;
        for (var k0 = lane; k0 < per_row; k0 += THREADS_PER_ROW * UNROLL) {
          // Loads past the row read its last 8 weights and count as zeros
          // (no branch: the round's loads are all issued together).
          for (var u = 0u; u < UNROLL; u++) {
            let k = min(k0 + u * THREADS_PER_ROW, per_row - 1u);
            var a = x[xv + 2u * k];
            var b = x[xv + 2u * k + 1u];
            var d = vec3<f32>(0.0);
#if NORM
            d.z = dot(a, a) + dot(b, b);
            a *= norm_w[2u * k];
            b *= norm_w[2u * k + 1u];
#endif
            let w = weight[wa + k];
            d.x = dot(bf16x4_lo(w), a) + dot(bf16x4_hi(w), b);
#if !ONE_ROW
            let w2 = weight[wb + k];
            d.y = dot(bf16x4_lo(w2), a) + dot(bf16x4_hi(w2), b);
#endif
            r += select(vec3<f32>(0.0), d, k0 + u * THREADS_PER_ROW < per_row);
          }
        }
    } else {
        let words = p.cols / 2u;
        let wa = row * words;
        let wb = row_b * words;
        for (var k = lane; k < words; k += THREADS_PER_ROW) {
            var a = x_at(xb + 2u * k);
            var b = x_at(xb + 2u * k + 1u);
#if NORM
            r.z += a * a + b * b;
            a *= norm_w[k >> 1u][2u * (k & 1u)];
            b *= norm_w[k >> 1u][2u * (k & 1u) + 1u];
#endif
            let w = weight_word(wa + k);
            r.x += bf16_lo(w) * a + bf16_hi(w) * b;
#if !ONE_ROW
            let w2 = weight_word(wb + k);
            r.y += bf16_lo(w2) * a + bf16_hi(w2) * b;
#endif
        }
    }
    return r;
}
#endif

#if SUBGROUPS
// The lanes of an output are exactly one subgroup.
fn reduce_row(v: f32, l: u32, lane: u32) -> f32 {
    return subgroupAdd(v);
}
#else
var<workgroup> partial: array<f32, WG>;

// Sum over the lanes of an output through workgroup memory. Every
// invocation must call it (it has barriers).
fn reduce_row(v: f32, l: u32, lane: u32) -> f32 {
    if (THREADS_PER_ROW == 1u) {
        return v;
    }
    // The previous reduction's result may still be being read.
    workgroupBarrier();
    partial[l] = v;
    workgroupBarrier();
    for (var s = THREADS_PER_ROW / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            partial[l] += partial[l + s];
        }
        workgroupBarrier();
    }
    return partial[l - lane];
}
#endif

// A group's outputs: one SwiGLU of its two rows, or its two rows' outputs,
// or (ONE_ROW: bf16 rows, for which x is few loads per weight, so more
// groups in flight pay better) one row's.
#if SWIGLU
const OUTPUTS_PER_GROUP: u32 = 1u;
#else
#if ONE_ROW
const OUTPUTS_PER_GROUP: u32 = 1u;
#else
const OUTPUTS_PER_GROUP: u32 = 2u;
#endif
#endif

// The rows a group reads for rows row and row + 1 where live says so (a
// dead row reads the other's, and its dot is not used).
fn live_rows(live: vec2<bool>, row: u32) -> vec2<u32> {
    let a = select(row + 1u, row, live.x);
    return vec2<u32>(a, select(a, row + 1u, live.y));
}

// Whether outputs o and o + 1, rows row and row + 1 of this part, are
// this group's to compute (row wraps past p.rows when it precedes the part).
fn pair_live(o: u32, row: u32) -> vec2<bool> {
    let second = OUTPUTS_PER_GROUP == 2u && o + 1u < p.outputs && row + 1u < p.rows;
    return vec2<bool>(o < p.outputs && row < p.rows, second);
}

#if !INT8_DOTS
// lane_dots of rows row (.x) and row + 1 (.y) where live says so (a dead
// row's dot is a copy of the other's).
fn pair_dots(live: vec2<bool>, row: u32, xb: u32, lane: u32) -> vec3<f32> {
    let rows = live_rows(live, row);
    return lane_dots(rows.x, rows.y, xb, lane);
}

// pair_dots where a row is live (nothing is staged: `staged` is the
// INT8_DOTS product's).
fn product(live: vec2<bool>, row: u32, xb: u32, lane: u32, li: u32, staged: bool) -> vec3<f32> {
    if (any(live)) {
        return pair_dots(live, row, xb, lane);
    }
    return vec3<f32>(0.0);
}
#endif

// The sum of squares of x from product's .z: the lanes' shares of the
// output's group, or (INT8_DOTS) already the workgroup's sum.
fn sum_of_squares(z: f32, l: u32, lane: u32) -> f32 {
#if INT8_DOTS
    return z;
#else
    return reduce_row(z, l, lane);
#endif
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    // Workgroups take blocks of outputs in turn: a grid of fewer
    // workgroups than blocks stages x once for several blocks.
    let per_block = OUTPUTS_PER_GROUP * ROWS_PER_WG;
    let blocks = (p.outputs + per_block - 1u) / per_block;
    // The grid's tokens (y) are relabelled to vary fastest in launch
    // order (x, then y, then z), so that the workgroups of every token that
    // read one block of rows run side by side and the block comes from
    // memory once, the other tokens' reads from the cache.
#if INT8_TABLE
    // Read after the barrier before the first staging.
    fill_table16(lid.x, WG);
#endif
    let launched = wid.x + nwg.x * (wid.y + nwg.y * wid.z);
    let gy = launched % nwg.y;
    let first = launched / nwg.y;
    for (var block = first; block < blocks; block += nwg.x * nwg.z) {
        output_block(block, gy, lid.x, block != first);
    }
}

// Block `block` of outputs for grid row `gy` (a token, or SLOTS a token's
// slot); `staged`: the workgroup's previous block read the same x.
fn output_block(block: u32, gy: u32, li: u32, staged: bool) {
    let lane = li % THREADS_PER_ROW;
    let group = block * ROWS_PER_WG + li / THREADS_PER_ROW;
    let o = OUTPUTS_PER_GROUP * group;
#if SUM
    let t = gy;
    let y_row = t;
    var acc = vec2<f32>(0.0);
    var here = false;
    for (var j = 0u; j < p.top_k; j++) {
        let pair = t * p.top_k + j;
        if (ids[pair] == EXPERT_ELSEWHERE) {
            continue;
        }
        here = true;
#if INT8_DOTS
        // The products are slots_product's (weighted as staged); here a NaN
        // weight (routing that failed, its expert id out of range) is
        // made to reach the sum all the same.
        acc += route_weights[pair] * vec2<f32>(0.0);
#else
        // Wraps to a huge value (skipped) when the row is before this part.
        let row = ids[pair] * p.expert_rows + o - p.first_row;
        let live = pair_live(o, row);
        // Each slot reads its own x.
        let d = product(live, row, pair * p.cols, lane, li, false);
        // Outside the test: a NaN weight (routing that failed, its expert
        // id out of range) must reach the sum.
        acc += route_weights[pair] * select(vec2<f32>(0.0), d.xy, live);
#endif
    }
#if INT8_DOTS
    acc += slots_product(o, t, lane, li);
#endif
    let v = vec2<f32>(reduce_row(acc.x, li, lane), reduce_row(acc.y, li, lane));
    let written = vec2<bool>(o < p.outputs && here, OUTPUTS_PER_GROUP == 2u && o + 1u < p.outputs && here);
#else
#if SLOTS
    let t = gy / p.top_k;
    let y_row = gy;
    // A slot whose expert is elsewhere starts past this part: nothing live.
    let first = select(ids[gy] * p.expert_rows, p.first_row + p.rows, ids[gy] == EXPERT_ELSEWHERE);
#else
    let t = gy;
    let y_row = t;
    let first = p.first_row;
#endif
#if SWIGLU
    let row = first + 2u * o - p.first_row;
    let live = vec2<bool>(o < p.outputs && row < p.rows);
#else
    let row = first + o - p.first_row;
    let live = pair_live(o, row);
#endif
    let d = product(live, row, t * p.cols, lane, li, staged);
#if NORM
    let scale = inverseSqrt(sum_of_squares(d.z, li, lane) / f32(p.cols) + p.eps);
#else
    let scale = 1.0;
#endif
    var v = vec2<f32>(reduce_row(d.x, li, lane), reduce_row(d.y, li, lane)) * scale;
#if SWIGLU
    v.x = swiglu(v.x, v.y);
    let written = vec2<bool>(live.x, false);
#else
    let written = live;
#endif
#endif
    if (lane == 0u) {
        for (var i = 0u; i < 2u; i++) {
            if (written[i]) {
                let out = p.out_offset + o + i;
                let at = y_row * p.y_stride + out;
#if ADD
                y[at] = layer_output(t, out, p.y_stride, y[at] + v[i]);
#else
                y[at] = v[i];
#endif
            }
        }
    }
}
