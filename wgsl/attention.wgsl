#if COOP
enable f16;
enable wgpu_cooperative_matrix;
#endif
// Causal grouped-query attention over the KV cache, with the q/k norm,
// RoPE and the cache store before it. For query head h of token t
// (position pos = step.pos0 + t):
//   out[t, h] = softmax_j(scale * q[t, h] . K[j, g]) V[j, g],  g = h / (nq / nkv)
// over keys j in [start, pos], start = pos + 1 - window when a sliding
// window is set (window = 0: none).
// q, k, v: f32 rows as the projection wrote them (v: see value_rows). Before
// use, q and k are normalised (QK_NORM: RMSNorm per head with a [hd]
// weight, or with QK_NORM_WHOLE over the whole q or k projection with an
// [n * hd] weight) and rotated: dimension i < half_rot pairs with
// i + half_rot; dims from 2 half_rot to hd pass through (partial rotary).
// cos_sin: f32 [positions, 2 * half_rot], cos then sin (scaling already
// applied by the host). The caches, K and V: [positions, nkv * hd], in
// f32 words, or with KV_F16 as f16 pairs (pack2x16float
// with F16_NATIVE, else the same conversion in integer arithmetic).
// Entry points:
//   attend_coop (COOP) the chunk's attention on cooperative matrices (below);
//               OUT_F16: its rows also go to out16 as f16, for the
//               o-projection's GEMM to read (kernels::gemm::HalfCopies);
//               BIDIRECTIONAL as attend's.
//   rope_store  (a chunk) one workgroup per (KV head, token): k heads
//               normalised, rotated and stored, v heads copied, into the cache.
//   attend      (BIDIRECTIONAL: every row sees every key of the cache up to
//               the chunk's end, no window: the vision tower's attention
//               over an image's patches)
//               one workgroup per (KV head, block of tokens_per_wg tokens,
//               key split): its query rows, normalised and rotated into
//               workgroup memory, go over the keys in tiles of up to 32:
//               the tile's K loaded into workgroup memory by consecutive
//               invocations (coalesced), scores one (key, row) per
//               invocation, an online softmax per row, then the tile's V
//               in the same place and one output pair per invocation. A
//               chunk runs after rope_store, unsplit; one token (DECODE)
//               stores its own k and v first (the split that holds its
//               position) and is split over the keys by step.attn_splits:
//               each split writes its unnormalised sums and (max, sum) per
//               row, and `combine` merges them.
// qkv is only read: a whole-projection q norm reads every q head, so no
// head may be rewritten in place while others are normalised. The value
// rows are read through `value_rows`, from element p.v_offset, rows of
// p.v_stride: the qkv buffer itself (after the keys), or a buffer of
// their own where the projection wrote them apart (a part in another
// weight format, which then runs beside the q/k part instead of after it).
// PAGED (rope_store one token per workgroup, attend and attend_coop one
// tile of up to tokens_per_wg consecutive rows of one sequence, the tiles
// listed by the host in rows_meta): the step's rows
// are a ragged batch, each of its own sequence: row t's position and its
// sequence's block table come from rows_meta, its rotation from row t of
// cos_sin (the host writes each row's angles), and position j of its
// sequence lives in cache row block_table[first + j / block_size] *
// block_size + j % block_size (the caches are a pool of blocks). A row
// given a partial slot (a decode row) splits its keys into runs of
// p.split_keys (at most p.max_splits runs, the workgroups of later splits
// idle), its partials at that slot, merged by `combine`; its split count
// depends on its own keys alone. With p.decode_apart, attend_lanes runs
// the decode rows (the step's first) and stores their k and v, and
// rope_store and attend pass them by.
// Limits (attend): head_dim <= 256 (even), tokens_per_wg * (nq / nkv) <= 32
// rows, rows * head_dim <= 2048; attend_coop's are in its section.

// The heads' width and query heads per KV head: constants of each build,
// so that the index arithmetic on them compiles to shifts and multiplies
// rather than divisions (rope_store computes several per element).
override HEAD_DIM: u32;
override GROUP: u32;

const WG: u32 = 128u;
const Q_FLOATS: u32 = 2048u;
// Query rows and one k row.
const ROW_FLOATS: u32 = 2304u; // Q_FLOATS + MAX_HEAD_DIM
const ROT_PER_THREAD: u32 = 18u; // ROW_FLOATS / WG
// 32 keys of head_dim 128 (+ 1 of padding).
const TILE_FLOATS: u32 = 4224u;
const MAX_ROWS: u32 = 32u;
const MAX_ROWS_K: u32 = 33u;
const S_FLOATS: u32 = 1024u; // MAX_ROWS * 32 keys
const MAX_HEAD_DIM: u32 = 256u;
const OUT_PER_THREAD: u32 = 8u; // Q_FLOATS / 2 / WG dimension pairs
const MAX_SPLITS: u32 = 128u;
// Quads a tile load gives each invocation: 32 keys of 128 f32 (or 256 f16).
const TILE_QUADS_PER_THREAD: u32 = 8u;
const NEG_BIG: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> p: AttentionParams;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> cos_sin: array<f32>;
// Words of the caches, read four at a time where rows allow.
@group(0) @binding(4) var<storage, read_write> k_cache: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
// Partials of split attention, per (query head, split): head_dim sums,
// then (max, sum) pairs.
@group(0) @binding(7) var<storage, read_write> part_acc: array<f32>;
@group(0) @binding(8) var<storage, read_write> part_ml: array<f32>;
#if QK_NORM
@group(0) @binding(9) var<storage, read> q_norm: array<f32>;
@group(0) @binding(10) var<storage, read> k_norm: array<f32>;
#endif
@group(0) @binding(11) var<storage, read> value_rows: array<f32>;
#if OUT_F16
@group(0) @binding(12) var<storage, read_write> out16: array<f16>;
#endif
#if PAGED
// Per step row: (position, first entry of its sequence's block table,
// partial slot or NO_SLOT, attend's tile i: see TILE_ROW_BITS).
@group(0) @binding(13) var<storage, read> rows_meta: array<vec4<u32>>;
@group(0) @binding(14) var<storage, read> block_table: array<u32>;
#endif

// Element e (KV head * head_dim + dimension) of token t's value row.
fn value_at(t: u32, e: u32) -> f32 {
    return value_rows[p.v_offset + t * p.v_stride + e];
}

#if KV_F16
#if F16_NATIVE
fn unpack_f16(w: u32) -> vec2<f32> {
    return unpack2x16float(w);
}

fn pack_f16(v: vec2<f32>) -> u32 {
    return pack2x16float(v);
}
#else
// The same conversions in integer arithmetic, for adapters whose shaders
// lack pack2x16float (round to nearest even; inf and NaN kept; the
// widening is f16_bits_to_f32 of common.wgsl).
fn f32_to_f16_bits(f: f32) -> u32 {
    let b = bitcast<u32>(f);
    let sign = (b >> 16u) & 0x8000u;
    let abs = b & 0x7fffffffu;
    if (abs > 0x7f800000u) {
        return sign | 0x7e00u;
    }
    let e = i32(abs >> 23u) - 112;
    if (e >= 31) {
        return sign | 0x7c00u;
    }
    var m = abs & 0x7fffffu;
    var shift = 13u;
    var r = 0u;
    if (e <= 0) {
        if (e < -10) {
            return sign;
        }
        m |= 0x800000u;
        shift = u32(14 - e);
    } else {
        r = u32(e) << 10u;
    }
    r |= m >> shift;
    let rest = m & ((1u << shift) - 1u);
    let halfway = 1u << (shift - 1u);
    // A carry into the exponent is the right rounding (up to inf).
    if (rest > halfway || (rest == halfway && (r & 1u) == 1u)) {
        r += 1u;
    }
    return sign | r;
}

fn unpack_f16(w: u32) -> vec2<f32> {
    return vec2<f32>(f16_bits_to_f32(w & 0xffffu), f16_bits_to_f32(w >> 16u));
}

fn pack_f16(v: vec2<f32>) -> u32 {
    return f32_to_f16_bits(v.x) | (f32_to_f16_bits(v.y) << 16u);
}
#endif
#endif

// Word w of the K cache (V with `values`).
fn cache_word(values: bool, w: u32) -> u32 {
    if (values) {
        return v_cache[w >> 2u][w & 3u];
    }
    return k_cache[w >> 2u][w & 3u];
}

// Words 4q .. 4q + 3 of the K cache (V with `values`).
fn cache_quad(values: bool, q: u32) -> vec4<u32> {
    if (values) {
        return v_cache[q];
    }
    return k_cache[q];
}

// Elements e and e + 1 (e even) of the K cache (V with `values`).
fn kv_load2(values: bool, e: u32) -> vec2<f32> {
#if KV_F16
    return unpack_f16(cache_word(values, e >> 1u));
#else
    return vec2<f32>(bitcast<f32>(cache_word(values, e)), bitcast<f32>(cache_word(values, e + 1u)));
#endif
}

fn cache_store(values: bool, w: u32, word: u32) {
    if (values) {
        v_cache[w >> 2u][w & 3u] = word;
    } else {
        k_cache[w >> 2u][w & 3u] = word;
    }
}

fn kv_store2(values: bool, e: u32, v: vec2<f32>) {
#if KV_F16
    cache_store(values, e >> 1u, pack_f16(v));
#else
    cache_store(values, e, bitcast<u32>(v.x));
    cache_store(values, e + 1u, bitcast<u32>(v.y));
#endif
}

// Cache element of dimension d of KV head g at position j.
fn kv_index(j: u32, g: u32, d: u32) -> u32 {
    return j * p.n_kv_heads * HEAD_DIM + g * HEAD_DIM + d;
}

// The position of step row t.
fn row_position(t: u32) -> u32 {
#if PAGED
    return rows_meta[t].x;
#else
    return step.pos0 + t;
#endif
}

// The row of cos_sin that rotates step row t: its position's, or with
// PAGED the step's row t.
fn rotary_row(t: u32) -> u32 {
#if PAGED
    return t;
#else
    return step.pos0 + t;
#endif
}

#if PAGED
const NO_SLOT: u32 = 0xffffffffu;
// rows_meta[i].w: attend's tile i, its first row << TILE_ROW_BITS | its
// row count (0: no tile).
const TILE_ROW_BITS: u32 = 8u;

// Key splits of step row t, which attends n_keys keys.
fn row_splits(t: u32, n_keys: u32) -> u32 {
    if (rows_meta[t].z == NO_SLOT) {
        return 1u;
    }
    return clamp((n_keys + p.split_keys - 1u) / p.split_keys, 1u, p.max_splits);
}
#endif

// The cache row of position j of step row t's sequence.
fn cache_row(t: u32, j: u32) -> u32 {
#if PAGED
    let block = block_table[rows_meta[t].y + j / p.block_size];
    return block * p.block_size + j % p.block_size;
#else
    return j;
#endif
}

// First attended key of the token at `pos`.
fn first_key(pos: u32) -> u32 {
    if (p.window > 0u && pos + 1u > p.window) {
        return pos + 1u - p.window;
    }
    return 0u;
}

// ---- q/k norm and RoPE of a workgroup's heads, shared by rope_store and attend ----

// Rows of heads, hd floats each: a workgroup's query rows, then (with a k
// head) that head's row.
var<workgroup> q_sh: array<f32, ROW_FLOATS>;
var<workgroup> row_scale: array<f32, MAX_ROWS_K>;

// Where loaded row r comes from: query rows r < n_q are token t0 + r /
// group, q head g * group + r % group; row n_q is k head g of token t_k.
struct HeadRow {
    token: u32,
    /// Index among the q heads, or among the k heads.
    head: u32,
    is_k: bool,
}

fn head_row(r: u32, t0: u32, g: u32, n_q: u32, t_k: u32) -> HeadRow {
    if (r < n_q) {
        return HeadRow(t0 + r / GROUP, g * GROUP + r % GROUP, false);
    }
    return HeadRow(t_k, g, true);
}

fn row_offset(h: HeadRow) -> u32 {
    return h.token * p.qkv_stride + (select(0u, p.n_q_heads, h.is_k) + h.head) * HEAD_DIM;
}

// The dimension that d turns with: d + half_rot or d - half_rot (d itself
// past the rotated dimensions).
fn rope_partner(d: u32) -> u32 {
    let half = p.half_rot;
    if (d >= 2u * half) {
        return d;
    }
    return select(d - half, d + half, d < half);
}

// Dimension d of a row, of value v and partner value w (see rope_partner),
// rotated for position `pos`.
fn rope(v: f32, w: f32, d: u32, pos: u32) -> f32 {
    let half = p.half_rot;
    if (d >= 2u * half) {
        return v;
    }
    let i = select(d - half, d, d < half);
    let table = pos * 2u * half + i;
    let c = cos_sin[table];
    let s = cos_sin[table + half];
    return select(v * c + w * s, v * c - w * s, d < half);
}

// Element d of row r of q_sh rotated for position `pos`.
fn rotated(r: u32, d: u32, pos: u32) -> f32 {
    let row = r * HEAD_DIM;
    return rope(q_sh[row + d], q_sh[row + rope_partner(d)], d, pos);
}

// Element d of the row at qkv[row] rotated for position `pos`, straight
// from qkv (rows without a norm).
fn rotated_qkv(row: u32, d: u32, pos: u32) -> f32 {
    return rope(qkv[row + d], qkv[row + rope_partner(d)], d, pos);
}

// Loads n_q query rows and, with `with_k`, one k row (see head_row) into
// q_sh, each normalised (QK_NORM) and rotated for its token's position.
// All invocations call it; the rows are processed together, so the cost
// is a few global round trips whatever their number.
fn load_rows(t0: u32, g: u32, n_q: u32, with_k: bool, t_k: u32, l: u32) {
    let n = n_q + select(0u, 1u, with_k);
    for (var i = l; i < n * HEAD_DIM; i += WG) {
        let r = i / HEAD_DIM;
        q_sh[i] = qkv[row_offset(head_row(r, t0, g, n_q, t_k)) + i % HEAD_DIM];
    }
#if QK_NORM
    workgroupBarrier();
#if QK_NORM_WHOLE
    // Over the token's whole q (or k) projection: summed by the workgroup,
    // once per (token, projection) that a row needs.
    let n_tok = (n_q + GROUP - 1u) / GROUP;
    for (var c = 0u; c < n_tok + select(0u, 1u, with_k); c++) {
        let is_k = c == n_tok;
        let token = select(t0 + c, t_k, is_k);
        let len = select(p.n_q_heads, p.n_kv_heads, is_k) * HEAD_DIM;
        let first_value = token * p.qkv_stride + select(0u, p.n_q_heads * HEAD_DIM, is_k);
        var ss = 0.0;
        for (var i = l; i < len; i += WG) {
            let v = qkv[first_value + i];
            ss += v * v;
        }
        let scale = inverseSqrt(workgroup_sum(ss, l) / f32(len) + p.eps);
        // Rows of this token (query rows c * group ..) or the k row.
        let first = select(c * GROUP, n_q, is_k);
        let count = select(min(GROUP, n_q - c * GROUP), 1u, is_k);
        if (l < count) {
            row_scale[first + l] = scale;
        }
    }
#else
    if (l < n) {
        var ss = 0.0;
        for (var d = 0u; d < HEAD_DIM; d++) {
            let v = q_sh[l * HEAD_DIM + d];
            ss += v * v;
        }
        row_scale[l] = inverseSqrt(ss / f32(HEAD_DIM) + p.eps);
    }
#endif
    workgroupBarrier();
    for (var i = l; i < n * HEAD_DIM; i += WG) {
        let h = head_row(i / HEAD_DIM, t0, g, n_q, t_k);
#if QK_NORM_WHOLE
        let w_index = h.head * HEAD_DIM + i % HEAD_DIM;
#else
        let w_index = i % HEAD_DIM;
#endif
        var w: f32;
        if (h.is_k) {
            w = k_norm[w_index];
        } else {
            w = q_norm[w_index];
        }
        q_sh[i] = w * (q_sh[i] * row_scale[i / HEAD_DIM]);
    }
#endif
    workgroupBarrier();
    var rot: array<f32, ROT_PER_THREAD>;
    for (var c = 0u; c < ROT_PER_THREAD; c++) {
        let i = l + c * WG;
        if (i < n * HEAD_DIM) {
            let r = i / HEAD_DIM;
            rot[c] = rotated(r, i % HEAD_DIM, rotary_row(head_row(r, t0, g, n_q, t_k).token));
        }
    }
    workgroupBarrier();
    for (var c = 0u; c < ROT_PER_THREAD; c++) {
        let i = l + c * WG;
        if (i < n * HEAD_DIM) {
            q_sh[i] = rot[c];
        }
    }
    workgroupBarrier();
}

// Without a q/k norm no row needs another, so each invocation rotates its
// elements straight from qkv: no workgroup memory, no barriers (the
// normalised rows go through load_rows).
@compute @workgroup_size(WG)
fn rope_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    // K heads first, then V heads (value rows c - nkv), then (for
    // attend_coop) the query rows of each KV head.
    let c = wid.x;
    let t = wid.y;
#if PAGED
    // attend_lanes stores the decode rows it runs.
    if (p.decode_apart == 1u && rows_meta[t].z != NO_SLOT) {
        return;
    }
#endif
    let pos = row_position(t);
    let rot = rotary_row(t);
    let slot = cache_row(t, pos);
    let nkv = p.n_kv_heads;
    if (c >= 2u * nkv) {
        // Normalised and rotated into `out`, where attend_coop reads them
        // before it writes its results over them.
        let g = c - 2u * nkv;
        let dst = t * p.out_stride + g * GROUP * HEAD_DIM;
#if QK_NORM
        load_rows(t, g, GROUP, false, 0u, l);
        for (var i = l; i < GROUP * HEAD_DIM; i += WG) {
            out[dst + i] = q_sh[i];
        }
#else
        let src = t * p.qkv_stride + g * GROUP * HEAD_DIM;
        for (var i = l; i < GROUP * HEAD_DIM; i += WG) {
            let d = i % HEAD_DIM;
            out[dst + i] = rotated_qkv(src + i - d, d, rot);
        }
#endif
        return;
    }
    if (c >= nkv) {
        let src = (c - nkv) * HEAD_DIM;
        for (var i = l; i < HEAD_DIM / 2u; i += WG) {
            let s = src + 2u * i;
            kv_store2(true, kv_index(slot, c - nkv, 2u * i), vec2<f32>(value_at(t, s), value_at(t, s + 1u)));
        }
        return;
    }
#if QK_NORM
    load_rows(0u, c, 0u, true, t, l);
    for (var i = l; i < HEAD_DIM / 2u; i += WG) {
        kv_store2(false, kv_index(slot, c, 2u * i), vec2<f32>(q_sh[2u * i], q_sh[2u * i + 1u]));
    }
#else
    let src = t * p.qkv_stride + (p.n_q_heads + c) * HEAD_DIM;
    for (var i = l; i < HEAD_DIM / 2u; i += WG) {
        let pair = vec2<f32>(rotated_qkv(src, 2u * i, rot), rotated_qkv(src, 2u * i + 1u, rot));
        kv_store2(false, kv_index(slot, c, 2u * i), pair);
    }
#endif
}

// Where query head qh of step row t leaves its partials of split `split`
// (of `splits`): per (query head, split) for one token, or with PAGED per
// (the row's partial slot, query head, split).
fn partial_slot(t: u32, qh: u32, split: u32, splits: u32) -> u32 {
#if PAGED
    return (rows_meta[t].z * p.n_q_heads + qh) * p.max_splits + split;
#else
    return qh * splits + split;
#endif
}

// Dimensions d and d + 1 of a split's unnormalised sums at `slot`, and
// with d = 0 its (max, sum).
fn write_partial(slot: u32, d: u32, acc: vec2<f32>, m: f32, sum: f32) {
    part_acc[slot * HEAD_DIM + d] = acc.x;
    part_acc[slot * HEAD_DIM + d + 1u] = acc.y;
    if (d == 0u) {
        part_ml[2u * slot] = m;
        part_ml[2u * slot + 1u] = sum;
    }
}

// ---- attend: query rows against a range of keys, tile by tile ----

// A tile of TK keys' K, then the same keys' V: rows of hd + 1 floats
// (padded against bank conflicts).
var<workgroup> tile_sh: array<f32, TILE_FLOATS>;
// Scores, then probabilities, [row, key of the tile].
var<workgroup> s_sh: array<f32, S_FLOATS>;
var<workgroup> row_max: array<f32, MAX_ROWS>;
var<workgroup> row_sum: array<f32, MAX_ROWS>;
var<workgroup> row_rescale: array<f32, MAX_ROWS>;

// Copies keys [k0, k0 + n) of KV head g (V with `values`) of step row t's
// sequence into tile_sh, consecutive invocations reading consecutive words.
fn load_tile(values: bool, t: u32, k0: u32, n: u32, g: u32, l: u32) {
#if KV_F16
    let per_quad = 8u;
#else
    let per_quad = 4u;
#endif
    if (HEAD_DIM % per_quad == 0u) {
        // Whole rows of quads: every invocation issues all its 16-byte
        // loads before storing any, so many are in flight.
        let quads = HEAD_DIM / per_quad;
        let first = kv_index(k0, g, 0u) / per_quad;
        let row_quads = p.n_kv_heads * quads;
        var held: array<vec4<u32>, TILE_QUADS_PER_THREAD>;
        for (var c = 0u; c < TILE_QUADS_PER_THREAD; c++) {
            let i = l + c * WG;
            if (i < n * quads) {
#if PAGED
                held[c] = cache_quad(values, kv_index(cache_row(t, k0 + i / quads), g, 0u) / per_quad + i % quads);
#else
                held[c] = cache_quad(values, first + (i / quads) * row_quads + i % quads);
#endif
            }
        }
        for (var c = 0u; c < TILE_QUADS_PER_THREAD; c++) {
            let i = l + c * WG;
            if (i < n * quads) {
                let at = (i / quads) * (HEAD_DIM + 1u) + (i % quads) * per_quad;
                let w = held[c];
#if KV_F16
                let lo = vec4<f32>(unpack_f16(w.x), unpack_f16(w.y));
                let hi = vec4<f32>(unpack_f16(w.z), unpack_f16(w.w));
                for (var e = 0u; e < 4u; e++) {
                    tile_sh[at + e] = lo[e];
                    tile_sh[at + 4u + e] = hi[e];
                }
#else
                for (var e = 0u; e < 4u; e++) {
                    tile_sh[at + e] = bitcast<f32>(w[e]);
                }
#endif
            }
        }
        return;
    }
    let pairs = HEAD_DIM / 2u;
    for (var i = l; i < n * pairs; i += WG) {
        let j = i / pairs;
        let d = 2u * (i % pairs);
        let v = kv_load2(values, kv_index(cache_row(t, k0 + j), g, d));
        tile_sh[j * (HEAD_DIM + 1u) + d] = v.x;
        tile_sh[j * (HEAD_DIM + 1u) + d + 1u] = v.y;
    }
}

// Rows r = token t0 + r / group, query head g * group + r % group; keys
// split across wid.z (step.attn_splits); with DECODE the one token's k and
// v are first stored by the split that holds its position.
@compute @workgroup_size(WG)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let g = wid.x;
    let split = wid.z;
#if PAGED
    // Tile wid.y: consecutive rows of one sequence (see rows_meta).
    let tile = rows_meta[wid.y].w;
    let t0 = tile >> TILE_ROW_BITS;
    let n_tok = tile & ((1u << TILE_ROW_BITS) - 1u);
    if (n_tok == 0u) {
        return;
    }
#else
    let t0 = wid.y * p.tokens_per_wg;
    let n_tok = min(p.tokens_per_wg, step.n_tokens - t0);
#endif
    let rows = n_tok * GROUP;
    let tk = min(32u, TILE_FLOATS / (HEAD_DIM + 1u));

    // Keys any row attends, divided among the splits.
#if BIDIRECTIONAL
    let start = 0u;
    let n_keys = step.pos0 + step.n_tokens;
#else
    let start = first_key(row_position(t0));
    let n_keys = row_position(t0 + n_tok - 1u) + 1u - start;
#endif
#if PAGED
    let splits = row_splits(t0, n_keys);
    // Runs of keys past the row's splits, and decode rows that
    // attend_lanes runs, are not this workgroup's.
    if (split >= splits || (p.decode_apart == 1u && rows_meta[t0].z != NO_SLOT)) {
        return;
    }
#else
    let splits = step.attn_splits;
#endif
    let chunk = (n_keys + splits - 1u) / splits;
    var lo = start + min(split * chunk, n_keys);
    let hi = start + min((split + 1u) * chunk, n_keys);
#if PAGED
    // An unsplit tile's key tiles start at multiples of tk whatever its
    // first row, so that a row's sums do not depend on the rows tiled with
    // it (keys before a row's window are masked).
    if (splits == 1u) {
        lo -= lo % tk;
    }
#endif

#if DECODE
    // The new position's k and v, stored by the split that reads them.
    let pos = step.pos0;
    let stores = lo <= pos && pos < hi;
    load_rows(t0, g, rows, stores, 0u, l);
    if (stores) {
        let k_row = rows * HEAD_DIM;
        for (var i = l; i < HEAD_DIM / 2u; i += WG) {
            kv_store2(false, kv_index(pos, g, 2u * i), vec2<f32>(q_sh[k_row + 2u * i], q_sh[k_row + 2u * i + 1u]));
            let v = g * HEAD_DIM + 2u * i;
            kv_store2(true, kv_index(pos, g, 2u * i), vec2<f32>(value_at(0u, v), value_at(0u, v + 1u)));
        }
        storageBarrier();
    }
#else
    load_rows(t0, g, rows, false, 0u, l);
#endif
    if (l < rows) {
        row_max[l] = NEG_BIG;
        row_sum[l] = 0.0;
    }

    // Score roles: key l % tk of the tile, rows l / tk (+ WG / tk ...).
    // PV roles: outputs o = l (+ WG ...) of rows * (hd / 2) dimension pairs.
    let pairs = HEAD_DIM / 2u;
    var acc: array<vec2<f32>, OUT_PER_THREAD>;
    for (var c = 0u; c < OUT_PER_THREAD; c++) {
        acc[c] = vec2<f32>(0.0);
    }

    for (var k0 = lo; k0 < hi; k0 += tk) {
        let n = min(tk, hi - k0);
        workgroupBarrier();
        load_tile(false, t0, k0, n, g, l);
        workgroupBarrier();
        let j = l % tk;
        for (var c = 0u; c < MAX_ROWS; c++) {
            let r = l / tk + c * (WG / tk);
            if (r >= rows) {
                break;
            }
            let row_pos = row_position(t0 + r / GROUP);
            let key = k0 + j;
            var s = NEG_BIG;
#if BIDIRECTIONAL
            let visible = j < n;
#else
            let visible = j < n && key <= row_pos && key >= first_key(row_pos);
#endif
            if (visible) {
                var dot = 0.0;
                for (var d = 0u; d < HEAD_DIM; d++) {
                    dot += q_sh[r * HEAD_DIM + d] * tile_sh[j * (HEAD_DIM + 1u) + d];
                }
                s = dot * p.scale;
            }
            s_sh[r * tk + j] = s;
        }
        workgroupBarrier();
        if (l < rows) {
            var m = row_max[l];
            for (var jj = 0u; jj < n; jj++) {
                m = max(m, s_sh[l * tk + jj]);
            }
            row_rescale[l] = exp(row_max[l] - m);
            row_max[l] = m;
        }
        workgroupBarrier();
        for (var i = l; i < rows * tk; i += WG) {
            let s = s_sh[i];
            s_sh[i] = select(exp(s - row_max[i / tk]), 0.0, s <= NEG_BIG);
        }
        load_tile(true, t0, k0, n, g, l);
        workgroupBarrier();
        if (l < rows) {
            var sum = 0.0;
            for (var jj = 0u; jj < n; jj++) {
                sum += s_sh[l * tk + jj];
            }
            row_sum[l] = row_sum[l] * row_rescale[l] + sum;
        }
        for (var c = 0u; c < OUT_PER_THREAD; c++) {
            let o = l + c * WG;
            if (o < rows * pairs) {
                let r = o / pairs;
                let d = 2u * (o % pairs);
                var a = acc[c] * row_rescale[r];
                for (var jj = 0u; jj < n; jj++) {
                    let v = vec2<f32>(tile_sh[jj * (HEAD_DIM + 1u) + d], tile_sh[jj * (HEAD_DIM + 1u) + d + 1u]);
                    a += s_sh[r * tk + jj] * v;
                }
                acc[c] = a;
            }
        }
    }
    workgroupBarrier();

    for (var c = 0u; c < OUT_PER_THREAD; c++) {
        let o = l + c * WG;
        if (o < rows * pairs) {
            let r = o / pairs;
            let d = 2u * (o % pairs);
            let t = t0 + r / GROUP;
            let qh = g * GROUP + r % GROUP;
#if DECODE
            if (splits > 1u) {
                write_partial(partial_slot(t, qh, split, splits), d, acc[c], row_max[r], row_sum[r]);
                continue;
            }
#endif
#if PAGED
            if (splits > 1u) {
                write_partial(partial_slot(t, qh, split, splits), d, acc[c], row_max[r], row_sum[r]);
                continue;
            }
#endif
            let v = acc[c] / row_sum[r];
            out[t * p.out_stride + qh * HEAD_DIM + d] = v.x;
            out[t * p.out_stride + qh * HEAD_DIM + d + 1u] = v.y;
        }
    }
}

#if SUBGROUPS
// ---- attend_lanes: one token, each key's products across a few subgroup lanes ----
// One workgroup per (KV head, block of BLOCK_ROWS query rows, key split),
// the same split of the keys and the same partials as `attend` DECODE.
// Invocations form slots of LANES consecutive lanes (inside one subgroup);
// a slot takes every (WG / LANES)-th key. Lane i holds quad i (16 bytes)
// of the key row (lanes past the row's quads hold zeros), the matching
// query elements and its share of every row's output in registers: the K and V
// rows are read straight from the cache, coalesced across a slot's lanes,
// two keys ahead of their use (the first two before the query rows are
// prepared: in a decode step the cache comes from memory, not from the
// L2 that holds it in a benchmark of this kernel alone; one key ahead, or
// four keys a batch held in arrays, faster alone, decode slower), and a score is its
// lanes' partial dots summed by shuffles. Each slot keeps an online softmax per
// row; at the end the slots of a subgroup merge by shuffles, the subgroups
// leave their partials in workgroup memory, and after one barrier every
// invocation combines a share of the outputs.
// PAGED, over a grid of one split (a step of rows enough to fill the GPU):
// each workgroup walks its row's splits in order, leaving the same
// partials as the workgroups of a split grid would, and merges them
// itself as `combine` does (merge_splits): a row's output does not depend
// on which grid ran it, and the step needs no `combine`.
// No barrier runs before the key loop: every slot loads, normalises
// (sums over its lanes by shuffles) and rotates (the partner element half_rot
// away is a shuffle from the lane half_rot / 8 or / 4 away: LaneLayout asks
// for whole quads) the query rows and the new key itself, and the slot that
// meets the new position uses its own k and v rather than the cache's
// (the first row block's slot 0 stores them). None in the key loop either,
// which is what holds a long cache at memory speed. A block is at most
// four rows, held as vec4s of scores, maxima and sums: each step of a
// key's work runs on the four rows at once, so that their shuffles and
// exponentials overlap rather than queue row after row. (Eight rows hold
// more registers than a large GPU keeps, and run slower at short depths.)

// A power of two, at least the row's quads.
override LANES: u32 = 16u;
override BLOCK_ROWS: u32 = 4u;
#if KV_F16
const VEC4_PER_QUAD: u32 = 2u;
#else
const VEC4_PER_QUAD: u32 = 1u;
#endif
const PER_QUAD: u32 = 4u * VEC4_PER_QUAD;
// A block's rows (at most four; rows past BLOCK_ROWS repeat later rows
// of the group and are never written out): a lane's query and output
// elements, VEC4_PER_QUAD vec4s per row.
const LANE_VEC4S: u32 = 4u * VEC4_PER_QUAD;

// Each subgroup's partials after its slots merged: per (subgroup, row),
// the row's sums (LaneLayout::MERGE_FLOATS in kernels/attention.rs bounds subgroups x
// BLOCK_ROWS x head_dim) and its (max, sum).
const LANE_MERGE_FLOATS: u32 = 4096u;
var<workgroup> merge_acc: array<f32, LANE_MERGE_FLOATS>;
var<workgroup> merge_ml: array<vec2<f32>, 256>;

// A lane's share of a head row: elements lane * PER_QUAD .. + PER_QUAD.
struct LaneRow {
    v: array<vec4<f32>, 2>,
}

// This lane's share of the head row at qkv[base] (zeros past the row).
fn lane_row(base: u32, lane: u32, in_row: bool) -> LaneRow {
    var r: LaneRow;
    let e0 = base + select(0u, lane * PER_QUAD, in_row);
    for (var j = 0u; j < VEC4_PER_QUAD; j++) {
        let e = e0 + 4u * j;
        r.v[j] = select(vec4<f32>(0.0), vec4<f32>(qkv[e], qkv[e + 1u], qkv[e + 2u], qkv[e + 3u]), in_row);
    }
    return r;
}

// This lane's share of KV head g's value row of token t (zeros past the row).
fn lane_value_row(t: u32, g: u32, lane: u32, in_row: bool) -> LaneRow {
    var r: LaneRow;
    let e0 = g * HEAD_DIM + select(0u, lane * PER_QUAD, in_row);
    for (var j = 0u; j < VEC4_PER_QUAD; j++) {
        let e = e0 + 4u * j;
        let v = vec4<f32>(value_at(t, e), value_at(t, e + 1u), value_at(t, e + 2u), value_at(t, e + 3u));
        r.v[j] = select(vec4<f32>(0.0), v, in_row);
    }
    return r;
}

// The sum of v over the lanes of a slot.
fn slot_sum(v: f32) -> f32 {
    var s = v;
    for (var o = LANES / 2u; o > 0u; o >>= 1u) {
        s += subgroupShuffleXor(s, o);
    }
    return s;
}

// r normalised (QK_NORM) by `scale` (QK_NORM_WHOLE: the projection's,
// computed by the workgroup; else the head's, summed over the slot) and
// the weight's elements from w0 on, then rotated for position pos.
fn prepare_row(row: LaneRow, lane: u32, sg_lane: u32, in_row: bool, is_k: bool, w0: u32, whole_scale: f32, pos: u32) -> LaneRow {
    var r = row;
#if QK_NORM
#if QK_NORM_WHOLE
    let scale = whole_scale;
#else
    var ss = 0.0;
    for (var j = 0u; j < VEC4_PER_QUAD; j++) {
        ss += dot(r.v[j], r.v[j]);
    }
    let scale = inverseSqrt(slot_sum(ss) / f32(HEAD_DIM) + p.eps);
#endif
    for (var j = 0u; j < VEC4_PER_QUAD; j++) {
        let w = w0 + select(0u, lane * PER_QUAD, in_row) + 4u * j;
        var wv: vec4<f32>;
        if (is_k) {
            wv = vec4<f32>(k_norm[w], k_norm[w + 1u], k_norm[w + 2u], k_norm[w + 3u]);
        } else {
            wv = vec4<f32>(q_norm[w], q_norm[w + 1u], q_norm[w + 2u], q_norm[w + 3u]);
        }
        r.v[j] = select(vec4<f32>(0.0), wv * (r.v[j] * scale), in_row);
    }
#endif
    // Element e pairs with e + half (e < half) or e - half (half <= e <
    // 2 half), held by the lane half / PER_QUAD away.
    let half = p.half_rot;
    let e0 = lane * PER_QUAD;
    let low = e0 < half;
    let rotates = in_row && e0 < 2u * half;
    let delta = half / PER_QUAD;
    let src = select(sg_lane, select(sg_lane - delta, sg_lane + delta, low), rotates);
    let i0 = select(0u, select(e0 - half, e0, low), rotates);
    let table = pos * 2u * half;
    var out: LaneRow;
    for (var j = 0u; j < VEC4_PER_QUAD; j++) {
        let other = subgroupShuffle(r.v[j], src);
        let c = table + i0 + 4u * j;
        let cos = vec4<f32>(cos_sin[c], cos_sin[c + 1u], cos_sin[c + 2u], cos_sin[c + 3u]);
        let sin = vec4<f32>(cos_sin[c + half], cos_sin[c + half + 1u], cos_sin[c + half + 2u], cos_sin[c + half + 3u]);
        let turned = select(r.v[j] * cos + other * sin, r.v[j] * cos - other * sin, low);
        out.v[j] = select(r.v[j], turned, rotates);
    }
    return out;
}

// A lane's row as the cache holds it (f16 pairs, or f32 words).
fn cache_quad_of(r: LaneRow) -> vec4<u32> {
#if KV_F16
    return vec4<u32>(pack_f16(r.v[0].xy), pack_f16(r.v[0].zw), pack_f16(r.v[1].xy), pack_f16(r.v[1].zw));
#else
    return bitcast<vec4<u32>>(r.v[0]);
#endif
}

// Vec4 j of a cache quad's values.
fn quad_vec4(w: vec4<u32>, j: u32) -> vec4<f32> {
#if KV_F16
    if (j == 0u) {
        return vec4<f32>(unpack_f16(w.x), unpack_f16(w.y));
    }
    return vec4<f32>(unpack_f16(w.z), unpack_f16(w.w));
#else
    return bitcast<vec4<f32>>(w);
#endif
}

@compute @workgroup_size(WG)
fn attend_lanes(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) grid: vec3<u32>,
    @builtin(local_invocation_index) l: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let g = wid.x;
#if PAGED
    // Decode row t of a ragged batch (its first rows), block wid.y % its
    // row blocks of the row's query heads.
    let row_blocks = (GROUP + BLOCK_ROWS - 1u) / BLOCK_ROWS;
    let t = wid.y / row_blocks;
    let r0 = (wid.y % row_blocks) * BLOCK_ROWS;
    let pos = row_position(t);
    let start = first_key(pos);
    let n_keys = pos + 1u - start;
    let splits = row_splits(t, n_keys);
    let walks = grid.z == 1u && splits > 1u;
    let first_split = select(wid.z, 0u, walks);
    let end_split = select(wid.z + 1u, splits, walks);
    if (first_split >= splits) {
        return;
    }
#else
    let t = 0u;
    let r0 = wid.y * BLOCK_ROWS;
    let splits = step.attn_splits;
    let pos = step.pos0;
    let start = first_key(pos);
    let n_keys = pos + 1u - start;
    let walks = false;
    let first_split = wid.z;
    let end_split = wid.z + 1u;
#endif
    let rows = min(BLOCK_ROWS, GROUP - r0);
    // The row's q/k/v and its rotation.
    let qkv0 = t * p.qkv_stride;
    let rot = rotary_row(t);
    let chunk = (n_keys + splits - 1u) / splits;
    var lo = start + min(first_split * chunk, n_keys);
    var hi = start + min((first_split + 1u) * chunk, n_keys);

    let lane = l % LANES;
    let slot = l / LANES;
    let slots = WG / LANES;
    let in_row = lane * PER_QUAD < HEAD_DIM;

    // The first two passes' keys and values, on their way from memory
    // while the query rows are prepared; each pass then loads the keys of
    // the pass after next.
    let row_quads = p.n_kv_heads * HEAD_DIM / PER_QUAD;
    let head_quad = g * (HEAD_DIM / PER_QUAD) + select(0u, lane, in_row);
    let first = cache_row(t, min(lo + slot, hi - 1u)) * row_quads + head_quad;
    var k_next = k_cache[first];
    var v_next = v_cache[first];
    let second = cache_row(t, min(lo + slots + slot, hi - 1u)) * row_quads + head_quad;
    var k_after = k_cache[second];
    var v_after = v_cache[second];
    // The cache row of the key that the next pass loads, its block table
    // entry (PAGED) read a pass before that load: a load that waits on
    // its own block table read made a 64-row batch step's decode 0.89x as
    // fast on an NVIDIA H100.
    var row_later = cache_row(t, min(lo + 2u * slots + slot, hi - 1u));

    // Whole-projection norms: the workgroup sums the token's q and k.
    var q_scale = 1.0;
    var k_scale = 1.0;
#if QK_NORM_WHOLE
    var q_ss = 0.0;
    var k_ss = 0.0;
    for (var i = l; i < p.n_q_heads * HEAD_DIM; i += WG) {
        q_ss += qkv[qkv0 + i] * qkv[qkv0 + i];
    }
    for (var i = l; i < p.n_kv_heads * HEAD_DIM; i += WG) {
        let v = qkv[qkv0 + p.n_q_heads * HEAD_DIM + i];
        k_ss += v * v;
    }
    q_scale = inverseSqrt(workgroup_sum(q_ss, l) / f32(p.n_q_heads * HEAD_DIM) + p.eps);
    k_scale = inverseSqrt(workgroup_sum(k_ss, l) / f32(p.n_kv_heads * HEAD_DIM) + p.eps);
#endif

    // The block's query rows, normalised, rotated and scaled, in registers.
    var q: array<vec4<f32>, LANE_VEC4S>;
    for (var r = 0u; r < 4u; r++) {
        let head = g * GROUP + min(r0 + r, GROUP - 1u);
#if QK_NORM_WHOLE
        let w0 = head * HEAD_DIM;
#else
        let w0 = 0u;
#endif
        let row = prepare_row(lane_row(qkv0 + head * HEAD_DIM, lane, in_row), lane, sg_lane, in_row, false, w0, q_scale, rot);
        for (var j = 0u; j < VEC4_PER_QUAD; j++) {
            q[r * VEC4_PER_QUAD + j] = row.v[j] * p.scale;
        }
    }

    // The new key and value, as the cache holds them, where this split
    // (or, walking, the last) meets the new position.
    let stores = walks || (lo <= pos && pos < hi);
    var k_own = vec4<u32>(0u);
    var v_own = vec4<u32>(0u);
    if (stores) {
#if QK_NORM_WHOLE
        let w0 = g * HEAD_DIM;
#else
        let w0 = 0u;
#endif
        let k_base = qkv0 + (p.n_q_heads + g) * HEAD_DIM;
        k_own = cache_quad_of(prepare_row(lane_row(k_base, lane, in_row), lane, sg_lane, in_row, true, w0, k_scale, rot));
        v_own = cache_quad_of(lane_value_row(t, g, lane, in_row));
    }

    // Stored by the split's first block of rows (PAGED: rope_store leaves
    // decode rows to this kernel, so that a decode row's k and v are the
    // same whatever else its step runs).
#if PAGED
    let first_block = wid.y % row_blocks == 0u;
#else
    let first_block = wid.y == 0u;
#endif
    if (stores && first_block && slot == 0u && in_row) {
        let own_row = cache_row(t, pos) * row_quads + head_quad;
        k_cache[own_row] = k_own;
        v_cache[own_row] = v_own;
    }

    for (var split = first_split; split < end_split; split++) {
        if (split > first_split) {
            // The merge below reuses the workgroup memory of the split before.
            workgroupBarrier();
        }
        // Per row: the running max, the sum of weights, and this lane's
        // share of the weighted values.
        var m = vec4<f32>(NEG_BIG);
        var sum = vec4<f32>(0.0);
        var acc: array<vec4<f32>, LANE_VEC4S>;
        for (var a = 0u; a < LANE_VEC4S; a++) {
            acc[a] = vec4<f32>(0.0);
        }

        let passes = (hi - lo + slots - 1u) / slots;
        for (var it = 0u; it < passes; it++) {
            let key = lo + it * slots + slot;
            // The new position's k and v are this workgroup's own.
            let own = key == pos;
            let k_quad = select(k_next, k_own, own);
            let v_quad = select(vec4<u32>(0u), select(v_next, v_own, own), in_row);
            k_next = k_after;
            v_next = v_after;
            let after = row_later * row_quads + head_quad;
            row_later = cache_row(t, min(key + 3u * slots, hi - 1u));
            k_after = k_cache[after];
            v_after = v_cache[after];
            let valid = key < hi;
            // Element a of q (and acc) is row a / VEC4_PER_QUAD's.
            var s = vec4<f32>(0.0);
            for (var j = 0u; j < VEC4_PER_QUAD; j++) {
                let k = quad_vec4(k_quad, j);
                s += vec4<f32>(dot(q[j], k), dot(q[j + VEC4_PER_QUAD], k),
                    dot(q[j + 2u * VEC4_PER_QUAD], k), dot(q[j + 3u * VEC4_PER_QUAD], k));
            }
            for (var o = LANES / 2u; o > 0u; o >>= 1u) {
                s += subgroupShuffleXor(s, o);
            }
            // One exp: the new key either raises a row's max (the old terms
            // rescale) or not (the key's weight is below one).
            let e = exp(-abs(s - m));
            let raises = s > m;
            let rescale = select(select(vec4<f32>(1.0), e, raises), vec4<f32>(1.0), !valid);
            let weight = select(select(e, vec4<f32>(1.0), raises), vec4<f32>(0.0), !valid);
            m = select(m, max(m, s), valid);
            sum = sum * rescale + weight;
            for (var j = 0u; j < VEC4_PER_QUAD; j++) {
                let v = quad_vec4(v_quad, j);
                acc[j] = acc[j] * rescale.x + weight.x * v;
                acc[j + VEC4_PER_QUAD] = acc[j + VEC4_PER_QUAD] * rescale.y + weight.y * v;
                acc[j + 2u * VEC4_PER_QUAD] = acc[j + 2u * VEC4_PER_QUAD] * rescale.z + weight.z * v;
                acc[j + 3u * VEC4_PER_QUAD] = acc[j + 3u * VEC4_PER_QUAD] * rescale.w + weight.w * v;
            }
        }
        // Walking, the next split's first keys load while this one merges.
        if (split + 1u < end_split) {
            lo = start + min((split + 1u) * chunk, n_keys);
            hi = start + min((split + 2u) * chunk, n_keys);
            let first = cache_row(t, min(lo + slot, hi - 1u)) * row_quads + head_quad;
            k_next = k_cache[first];
            v_next = v_cache[first];
            let second = cache_row(t, min(lo + slots + slot, hi - 1u)) * row_quads + head_quad;
            k_after = k_cache[second];
            v_after = v_cache[second];
            row_later = cache_row(t, min(lo + 2u * slots + slot, hi - 1u));
        }

        // The slots of a subgroup merge by shuffles ...
        for (var mask = LANES; mask < sg_size; mask <<= 1u) {
            let m_other = subgroupShuffleXor(m, mask);
            let sum_other = subgroupShuffleXor(sum, mask);
            let m_new = max(m, m_other);
            let w_self = exp(m - m_new);
            let w_other = exp(m_other - m_new);
            for (var j = 0u; j < VEC4_PER_QUAD; j++) {
                acc[j] = acc[j] * w_self.x + subgroupShuffleXor(acc[j], mask) * w_other.x;
                let b = j + VEC4_PER_QUAD;
                acc[b] = acc[b] * w_self.y + subgroupShuffleXor(acc[b], mask) * w_other.y;
                let c = j + 2u * VEC4_PER_QUAD;
                acc[c] = acc[c] * w_self.z + subgroupShuffleXor(acc[c], mask) * w_other.z;
                let d = j + 3u * VEC4_PER_QUAD;
                acc[d] = acc[d] * w_self.w + subgroupShuffleXor(acc[d], mask) * w_other.w;
            }
            m = m_new;
            sum = sum * w_self + sum_other * w_other;
        }
        // ... the first slot of each subgroup leaves their partials ...
        let subgroup = l / sg_size;
        if (l % sg_size < LANES && in_row) {
            // Bounded by a constant, so that acc is indexed by constants once
            // unrolled (an index the compiler cannot resolve moves the whole
            // array out of registers: 2-4x the time at every depth).
            for (var r = 0u; r < 4u; r++) {
                if (r >= rows) {
                    break;
                }
                let at = subgroup * BLOCK_ROWS + r;
                for (var j = 0u; j < VEC4_PER_QUAD; j++) {
                    let v = acc[r * VEC4_PER_QUAD + j];
                    let e = at * HEAD_DIM + lane * PER_QUAD + 4u * j;
                    merge_acc[e] = v.x;
                    merge_acc[e + 1u] = v.y;
                    merge_acc[e + 2u] = v.z;
                    merge_acc[e + 3u] = v.w;
                }
                if (lane == 0u) {
                    merge_ml[at] = vec2<f32>(m[r], sum[r]);
                }
            }
        }
        workgroupBarrier();

        // ... and every invocation merges the subgroups' for a share of the outputs.
        let subgroups = WG / sg_size;
        for (var o = l; o < rows * HEAD_DIM; o += WG) {
            let r = o / HEAD_DIM;
            let d = o % HEAD_DIM;
            var m_all = NEG_BIG;
            for (var sg = 0u; sg < subgroups; sg++) {
                m_all = max(m_all, merge_ml[sg * BLOCK_ROWS + r].x);
            }
            var total = 0.0;
            var sum_all = 0.0;
            for (var sg = 0u; sg < subgroups; sg++) {
                let at = sg * BLOCK_ROWS + r;
                let w = exp(merge_ml[at].x - m_all);
                total += merge_acc[at * HEAD_DIM + d] * w;
                sum_all += merge_ml[at].y * w;
            }
            let qh = g * GROUP + r0 + r;
            if (splits > 1u) {
                let slot_index = partial_slot(t, qh, split, splits);
                part_acc[slot_index * HEAD_DIM + d] = total;
                if (d == 0u) {
                    part_ml[2u * slot_index] = m_all;
                    part_ml[2u * slot_index + 1u] = sum_all;
                }
            } else {
                out[t * p.out_stride + qh * HEAD_DIM + d] = total / sum_all;
            }
        }
    }
#if PAGED
    if (walks) {
        // Every partial of the rows is written (by this workgroup).
        storageBarrier();
        for (var r = 0u; r < rows; r++) {
            let qh = g * GROUP + r0 + r;
            merge_splits(t, qh, splits, t * p.out_stride + qh * HEAD_DIM, l);
        }
    }
#endif
}
#endif

#if COOP
// ---- attend_coop: a chunk's attention on cooperative matrices ----
// One workgroup per (KV head, block of C_ROWS = 16 C_SUBGROUPS query rows
// = C_ROWS / group tokens), C_SUBGROUPS subgroups of 16 rows; the blocks
// with the most keys (the chunk's last tokens) start first, so that the
// short ones fill the GPU's tail. Each subgroup stages its rows' q
// (normalised and rotated into `out` by rope_store) 32 dimensions at a
// time through its own P memory into f16 A fragments (with Q_SPLIT as
// high and low parts: 22 bits of mantissa) held for the whole key loop.
// Keys go by in tiles of 32, K and V staged as the f16 cache stores them,
// each invocation's share of the next tile loaded into registers while
// this one is multiplied, its K stored over this one's once every subgroup
// has its scores and its V once every subgroup has added P V: two
// workgroup barriers a tile. S = q k^T into f32; a lane pair per row
// masks and applies the online softmax; O += P V with P in f16, O held in
// f32 accumulators. S and P go through memory of the subgroup's own, so
// subgroup barriers order them. The probabilities are taken against a
// reference maximum that moves only when a row's scores exceed it by
// RESCALE_MARGIN, so P stays below e^RESCALE_MARGIN and O is rescaled
// (through memory) only then: rarely after a row's first keys. Whether a
// subgroup rescales is the subgroup's own decision (subgroupAny): a
// branch uniform over the subgroup, the scope of the matrix operations.
// naga's uniformity analysis holds matrix operations in a branch to
// workgroup-uniform control flow (which would take a workgroup-uniform
// load, two barriers, a tile); the attribute on the entry point turns
// that check off, and with it every other uniformity check of naga's in
// this entry point: a branch around matrix operations here must stay
// uniform over each subgroup by construction.
// Eight subgroups (one K/V tile for 128 rows) run faster than four, and
// rows of 36 scores faster than rows of 32; a second K/V buffer, stored
// while the other is multiplied, gains nothing, and staging from a view
// of the caches as f16s (no conversions) runs slower. Two barriers a
// tile rather than three (K and V stored together before the scores), and
// the rescale decided per subgroup rather than through a
// workgroup-uniform load, each run faster. Slower: q k^T in four chains
// of products, no next tile held in registers.
// The staged tiles are arrays of vec4<f16> (as in gemm_coop.wgsl: 8-byte
// stores, strides in vec4s).
// BIDIRECTIONAL: every row sees every key of the chunk (the vision
// tower's attention over an image's patches).
// Needs KV_F16, head_dim a multiple of 8 up to 128 (HD_FRAGS = head_dim /
// 16 rounded up: a head of 72, the vision tower's, runs as 80 whose last
// 8 dimensions are zero in q, K and V and never written out), a group
// dividing 16 and subgroups of 32; workgroup memory of
// kernels::attention::CoopLayout::workgroup_bytes.
// PAGED: the workgroup's rows are a tile of the host's list, the last
// tiles first (a sequence's later rows see more keys); its key tiles start
// at a multiple of 32 so that each row sees the same tiles whatever rows
// share its workgroup. Decode rows run on attend_lanes, never here.

override HD_FRAGS: u32 = (HEAD_DIM + 15u) / 16u;
// 8, or 4 where workgroup memory is short.
override C_SUBGROUPS: u32 = 8u;
override C_WG: u32 = 32u * C_SUBGROUPS;
override C_ROWS: u32 = 16u * C_SUBGROUPS;
const C_KEYS: u32 = 32u;
// Row stride of the K/V tiles in vec4<f16>s (128 f16s + 8 of padding).
const C_STRIDE: u32 = 34u;
// Row stride of P (and of q as it is staged) in vec4<f16>s (32 f16s + 8
// of padding).
const P_STRIDE: u32 = 10u;
const P_LEN: u32 = 160u;
// Row stride of the scores in f32s: 32 and 4 of padding (with rows of
// 32, the 16 rows' reads of one column all fell on one bank).
const S_STRIDE: u32 = 36u;
const RESCALE_MARGIN: f32 = 8.0;
// Quads of 8 f16s (one vec4<u32> of the cache) of a tile each invocation
// stages: at most 32 keys of head_dim 128, K and V, over 128 invocations.
const TILE_LOADS: u32 = 4u;
// The tile's K (rows 0 .. 31) and V (rows 32 .. 63).
const V_ROWS: u32 = 1088u;
var<workgroup> kv_sh: array<vec4<f16>, 2176>;
// Per subgroup: 16 rows x 32 scores, or one 16 x 16 block of O.
override SC_LEN: u32 = C_SUBGROUPS * 16u * S_STRIDE;
var<workgroup> sc_sh: array<f32, SC_LEN>;
override PC_LEN: u32 = C_SUBGROUPS * P_LEN;
var<workgroup> pc_sh: array<vec4<f16>, PC_LEN>;
var<workgroup> alpha_sh: array<f32, C_ROWS>;

// An invocation's share of a tile: its quads of K and V.
struct TileLoads {
    k: array<vec4<u32>, TILE_LOADS>,
    v: array<vec4<u32>, TILE_LOADS>,
}

// Whether quad slot c of each invocation lies in the tile.
fn slot_used(c: u32) -> bool {
    return c * C_WG < C_KEYS * (HEAD_DIM / 8u);
}

// This invocation's quads of the tile of keys from k0 (k0 < end) of KV
// head g (PAGED: of step row `row`'s sequence), zero from `end` on.
fn load_coop_tile(row: u32, k0: u32, end: u32, g: u32, l: u32) -> TileLoads {
    let quads = HEAD_DIM / 8u;
    let n = min(C_KEYS, end - k0);
    var t: TileLoads;
    for (var c = 0u; c < TILE_LOADS; c++) {
        let i = l + c * C_WG;
        let j = i / quads;
        t.k[c] = vec4<u32>(0u);
        t.v[c] = vec4<u32>(0u);
        if (slot_used(c) && i < C_KEYS * quads && j < n) {
            let q = kv_index(cache_row(row, k0 + j), g, 0u) / 8u + i % quads;
            t.k[c] = k_cache[q];
            t.v[c] = v_cache[q];
        }
    }
    return t;
}

// Four f16s from two words of f16 pairs (naga has no bitcast between them).
fn f16x4(a: u32, b: u32) -> vec4<f16> {
    return vec4<f16>(vec4<f32>(unpack2x16float(a), unpack2x16float(b)));
}

// Stores the loads of K (`values` false) or V into kv_sh.
fn store_coop_tile(t: TileLoads, values: bool, l: u32) {
    let quads = HEAD_DIM / 8u;
    for (var c = 0u; c < TILE_LOADS; c++) {
        let i = l + c * C_WG;
        if (slot_used(c) && i < C_KEYS * quads) {
            let at = (i / quads) * C_STRIDE + (i % quads) * 2u + select(0u, V_ROWS, values);
            let w = select(t.k[c], t.v[c], values);
            kv_sh[at] = f16x4(w.x, w.y);
            kv_sh[at + 1u] = f16x4(w.z, w.w);
        }
    }
}

// Multiplies the 16 x 16 block of subgroup sg's accumulator `o` by each
// row's alpha_sh (the subgroup's lanes call it together).
fn rescale(o: coop_mat16x16<f32, C>, sg: u32, lane: u32) -> coop_mat16x16<f32, C> {
    let at = sg * 16u * S_STRIDE;
    coopStoreT(o, &sc_sh[at], 16u);
    subgroupBarrier();
    for (var c = 0u; c < 8u; c++) {
        let e = lane + 32u * c;
        sc_sh[at + e] *= alpha_sh[sg * 16u + e / 16u];
    }
    subgroupBarrier();
    let scaled = coopLoadT<coop_mat16x16<f32, C>>(&sc_sh[at], 16u);
    subgroupBarrier();
    return scaled;
}

// Fragments 2 h and 2 h + 1 (head dimensions 32 h ..) of subgroup sg's
// query rows (their high or low parts with Q_SPLIT), staged from `out`
// through the subgroup's P memory (zero past the block's `rows`).
struct QPair {
    a: coop_mat16x16<f16, A>,
    b: coop_mat16x16<f16, A>,
}

fn q_pair(low: bool, h: u32, t0: u32, g: u32, rows: u32, sg: u32, lane: u32) -> QPair {
    // 16 rows x 8 quads of the 32 dimensions: four per lane.
    for (var c = 0u; c < 4u; c++) {
        let i = lane + 32u * c;
        let r = sg * 16u + i / 8u;
        let d = 32u * h + 4u * (i % 8u);
        var v = vec4<f32>(0.0);
        if (r < rows && d < HEAD_DIM) {
            let at = (t0 + r / GROUP) * p.out_stride + (g * GROUP + r % GROUP) * HEAD_DIM + d;
            v = vec4<f32>(out[at], out[at + 1u], out[at + 2u], out[at + 3u]);
        }
#if Q_SPLIT
        let high = bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) & vec4<u32>(0xffffe000u));
        v = select(high, v - high, low);
#endif
        pc_sh[sg * P_LEN + (i / 8u) * P_STRIDE + i % 8u] = vec4<f16>(v);
    }
    subgroupBarrier();
    let pair = QPair(
        coopLoadT<coop_mat16x16<f16, A>>(&pc_sh[sg * P_LEN], P_STRIDE),
        coopLoadT<coop_mat16x16<f16, A>>(&pc_sh[sg * P_LEN + 4u], P_STRIDE),
    );
    subgroupBarrier();
    return pair;
}

// s + q k^T over head dimensions 16 i .. for the tile's keys 16 j .. (q
// in its high and low parts with Q_SPLIT, else high alone).
fn qk(q_high: coop_mat16x16<f16, A>, q_low: coop_mat16x16<f16, A>, s: coop_mat16x16<f32, C>, j: u32, i: u32) -> coop_mat16x16<f32, C> {
    let k = coopLoad<coop_mat16x16<f16, B>>(&kv_sh[16u * j * C_STRIDE + 4u * i], C_STRIDE);
#if Q_SPLIT
    return coopMultiplyAdd(q_low, k, coopMultiplyAdd(q_high, k, s));
#else
    return coopMultiplyAdd(q_high, k, s);
#endif
}

// o + P V for head dimensions 16 i .. (P: the tile's two blocks of keys).
fn pv(p0: coop_mat16x16<f16, A>, p1: coop_mat16x16<f16, A>, o: coop_mat16x16<f32, C>, i: u32) -> coop_mat16x16<f32, C> {
    let v0 = coopLoadT<coop_mat16x16<f16, B>>(&kv_sh[V_ROWS + 4u * i], C_STRIDE);
    let v1 = coopLoadT<coop_mat16x16<f16, B>>(&kv_sh[V_ROWS + 16u * C_STRIDE + 4u * i], C_STRIDE);
    return coopMultiplyAdd(p1, v1, coopMultiplyAdd(p0, v0, o));
}

// Writes head dimensions 16 i .. of subgroup sg's rows, times alpha_sh
// (1 / the row's sum), to `out` (the subgroup's lanes call it together).
fn write_rows(o: coop_mat16x16<f32, C>, sg: u32, lane: u32, i: u32, t0: u32, g: u32, rows: u32) {
    let at = sg * 16u * S_STRIDE;
    coopStoreT(o, &sc_sh[at], 16u);
    subgroupBarrier();
    for (var c = 0u; c < 8u; c++) {
        let e = lane + 32u * c;
        let row = sg * 16u + e / 16u;
        if (row < rows && 16u * i + e % 16u < HEAD_DIM) {
            let t = t0 + row / GROUP;
            let head = g * GROUP + row % GROUP;
            let v = sc_sh[at + e] * alpha_sh[row];
            out[t * p.out_stride + head * HEAD_DIM + 16u * i + e % 16u] = v;
#if OUT_F16
            out16[t * p.out_stride + head * HEAD_DIM + 16u * i + e % 16u] = f16(v);
#endif
        }
    }
    subgroupBarrier();
}

// Fragments are named rather than indexed: drivers may not index arrays
// of cooperative matrices. Those past HD_FRAGS are loaded but unused.
@diagnostic(off, derivative_uniformity)
@compute @workgroup_size(C_WG)
fn attend_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) l: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let g = wid.x;
#if PAGED
    // Tile nwg.y - 1 - wid.y of the host's list (see rows_meta): rows of
    // consecutive positions of one sequence.
    let tile_entry = rows_meta[nwg.y - 1u - wid.y].w;
    let t0 = tile_entry >> TILE_ROW_BITS;
    let n_tok = tile_entry & ((1u << TILE_ROW_BITS) - 1u);
    // A decode row's tile (listed for a device of a split that runs them
    // on `attend`) is attend_lanes' here.
    if (n_tok == 0u || rows_meta[t0].z != NO_SLOT) {
        return;
    }
    let pos0 = row_position(t0);
    // Key tiles start at multiples of C_KEYS whatever the tile's first
    // row, so that a row's sums do not depend on the rows tiled with it
    // (keys before a row's window are masked).
    let start = first_key(pos0) / C_KEYS * C_KEYS;
    let end = pos0 + n_tok;
#else
    let t0 = (nwg.y - 1u - wid.y) * p.tokens_per_wg;
    let n_tok = min(p.tokens_per_wg, step.n_tokens - t0);
    let pos0 = step.pos0 + t0;
#if BIDIRECTIONAL
    let start = 0u;
    let end = step.pos0 + step.n_tokens;
#else
    let start = first_key(pos0);
    let end = pos0 + n_tok;
#endif
#endif
    let rows = n_tok * GROUP;
    // The first tile's loads are in flight while q is staged.
    var tile = load_coop_tile(t0, start, end, g, l);
    // A head narrower than its fragments: the 8 columns past it in every K
    // and V row of the tile, which no store reaches, are zero.
    if (HEAD_DIM % 16u != 0u) {
        for (var i = l; i < 4u * C_KEYS; i += C_WG) {
            kv_sh[(i / 2u) * C_STRIDE + HEAD_DIM / 4u + i % 2u] = vec4<f16>(0.0);
        }
    }
    let q01 = q_pair(false, 0u, t0, g, rows, sg, lane);
    let q23 = q_pair(false, 1u, t0, g, rows, sg, lane);
    let q45 = q_pair(false, 2u, t0, g, rows, sg, lane);
    let q67 = q_pair(false, 3u, t0, g, rows, sg, lane);
#if Q_SPLIT
    let l01 = q_pair(true, 0u, t0, g, rows, sg, lane);
    let l23 = q_pair(true, 1u, t0, g, rows, sg, lane);
    let l45 = q_pair(true, 2u, t0, g, rows, sg, lane);
    let l67 = q_pair(true, 3u, t0, g, rows, sg, lane);
#else
    let l01 = q01;
    let l23 = q23;
    let l45 = q45;
    let l67 = q67;
#endif

    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    var o4 = coop_mat16x16<f32, C>();
    var o5 = coop_mat16x16<f32, C>();
    var o6 = coop_mat16x16<f32, C>();
    var o7 = coop_mat16x16<f32, C>();
    // This lane's row (with its pair lane) in the softmax: running
    // reference maximum and sum.
    let r = lane / 2u;
    let half = lane % 2u;
    let row = sg * 16u + r;
    let row_pos = pos0 + row / GROUP;
    let s_at = sg * 16u * S_STRIDE;
    var m_ref = NEG_BIG;
    var l_sum = 0.0;

    store_coop_tile(tile, false, l);
    store_coop_tile(tile, true, l);
    if (start + C_KEYS < end) {
        tile = load_coop_tile(t0, start + C_KEYS, end, g, l);
    }
    workgroupBarrier();
    // Two barriers a tile: once every subgroup has its scores, the next
    // tile's K goes over this one's; once every subgroup has added P V,
    // its V over this one's. `tile` holds the next tile's loads until both
    // are stored.
    for (var k0 = start; k0 < end; k0 += C_KEYS) {
        let n = min(C_KEYS, end - k0);
        let more = k0 + C_KEYS < end;

        var s0 = coop_mat16x16<f32, C>();
        var s1 = coop_mat16x16<f32, C>();
        s0 = qk(q01.a, l01.a, s0, 0u, 0u);
        s1 = qk(q01.a, l01.a, s1, 1u, 0u);
        if (HD_FRAGS > 1u) {
            s0 = qk(q01.b, l01.b, s0, 0u, 1u);
            s1 = qk(q01.b, l01.b, s1, 1u, 1u);
        }
        if (HD_FRAGS > 2u) {
            s0 = qk(q23.a, l23.a, s0, 0u, 2u);
            s1 = qk(q23.a, l23.a, s1, 1u, 2u);
        }
        if (HD_FRAGS > 3u) {
            s0 = qk(q23.b, l23.b, s0, 0u, 3u);
            s1 = qk(q23.b, l23.b, s1, 1u, 3u);
        }
        if (HD_FRAGS > 4u) {
            s0 = qk(q45.a, l45.a, s0, 0u, 4u);
            s1 = qk(q45.a, l45.a, s1, 1u, 4u);
        }
        if (HD_FRAGS > 5u) {
            s0 = qk(q45.b, l45.b, s0, 0u, 5u);
            s1 = qk(q45.b, l45.b, s1, 1u, 5u);
        }
        if (HD_FRAGS > 6u) {
            s0 = qk(q67.a, l67.a, s0, 0u, 6u);
            s1 = qk(q67.a, l67.a, s1, 1u, 6u);
        }
        if (HD_FRAGS > 7u) {
            s0 = qk(q67.b, l67.b, s0, 0u, 7u);
            s1 = qk(q67.b, l67.b, s1, 1u, 7u);
        }
        coopStoreT(s0, &sc_sh[s_at], S_STRIDE);
        coopStoreT(s1, &sc_sh[s_at + 16u], S_STRIDE);
        subgroupBarrier();

        var s: array<f32, 16>;
        var m_tile = NEG_BIG;
        for (var c = 0u; c < 16u; c++) {
            let j = 16u * half + c;
            let key = k0 + j;
#if BIDIRECTIONAL
            let valid = j < n && row < rows;
#else
            let valid = j < n && row < rows && key <= row_pos && key >= first_key(row_pos);
#endif
            s[c] = select(NEG_BIG, sc_sh[s_at + r * S_STRIDE + j] * p.scale, valid);
            m_tile = max(m_tile, s[c]);
        }
        m_tile = max(m_tile, subgroupShuffleXor(m_tile, 1u));
        var alpha = 1.0;
        if (m_tile > m_ref + RESCALE_MARGIN) {
            alpha = exp(m_ref - m_tile);
            m_ref = m_tile;
        }
        var sum = 0.0;
        // The row's 16 probabilities of this lane, four to a store.
        for (var c = 0u; c < 16u; c += 4u) {
            let e = vec4<f32>(s[c], s[c + 1u], s[c + 2u], s[c + 3u]);
            let pr = select(exp(e - m_ref), vec4<f32>(0.0), e <= vec4<f32>(NEG_BIG));
            sum += pr.x + pr.y + pr.z + pr.w;
            pc_sh[sg * P_LEN + r * P_STRIDE + 4u * half + c / 4u] = vec4<f16>(pr);
        }
        sum += subgroupShuffleXor(sum, 1u);
        // O holds earlier keys' sums only where l_sum > 0.
        let grows = alpha != 1.0 && l_sum > 0.0;
        l_sum = l_sum * alpha + sum;
        if (half == 0u) {
            alpha_sh[row] = alpha;
        }
        let rescales = subgroupAny(grows);
        // Ends every subgroup's reads of this tile's K, and orders P and
        // alpha_sh before their reads and the reads of the scores before
        // the rescale's stores over them.
        workgroupBarrier();
        if (more) {
            store_coop_tile(tile, false, l);
        }
        if (rescales) {
            o0 = rescale(o0, sg, lane);
            if (HD_FRAGS > 1u) { o1 = rescale(o1, sg, lane); }
            if (HD_FRAGS > 2u) { o2 = rescale(o2, sg, lane); }
            if (HD_FRAGS > 3u) { o3 = rescale(o3, sg, lane); }
            if (HD_FRAGS > 4u) { o4 = rescale(o4, sg, lane); }
            if (HD_FRAGS > 5u) { o5 = rescale(o5, sg, lane); }
            if (HD_FRAGS > 6u) { o6 = rescale(o6, sg, lane); }
            if (HD_FRAGS > 7u) { o7 = rescale(o7, sg, lane); }
        }

        let p0 = coopLoadT<coop_mat16x16<f16, A>>(&pc_sh[sg * P_LEN], P_STRIDE);
        let p1 = coopLoadT<coop_mat16x16<f16, A>>(&pc_sh[sg * P_LEN + 4u], P_STRIDE);
        o0 = pv(p0, p1, o0, 0u);
        if (HD_FRAGS > 1u) { o1 = pv(p0, p1, o1, 1u); }
        if (HD_FRAGS > 2u) { o2 = pv(p0, p1, o2, 2u); }
        if (HD_FRAGS > 3u) { o3 = pv(p0, p1, o3, 3u); }
        if (HD_FRAGS > 4u) { o4 = pv(p0, p1, o4, 4u); }
        if (HD_FRAGS > 5u) { o5 = pv(p0, p1, o5, 5u); }
        if (HD_FRAGS > 6u) { o6 = pv(p0, p1, o6, 6u); }
        if (HD_FRAGS > 7u) { o7 = pv(p0, p1, o7, 7u); }
        workgroupBarrier();
        if (more) {
            store_coop_tile(tile, true, l);
            if (k0 + 2u * C_KEYS < end) {
                tile = load_coop_tile(t0, k0 + 2u * C_KEYS, end, g, l);
            }
        }
    }

    // out = O / l.
    if (half == 0u) {
        alpha_sh[row] = 1.0 / l_sum;
    }
    write_rows(o0, sg, lane, 0u, t0, g, rows);
    if (HD_FRAGS > 1u) { write_rows(o1, sg, lane, 1u, t0, g, rows); }
    if (HD_FRAGS > 2u) { write_rows(o2, sg, lane, 2u, t0, g, rows); }
    if (HD_FRAGS > 3u) { write_rows(o3, sg, lane, 3u, t0, g, rows); }
    if (HD_FRAGS > 4u) { write_rows(o4, sg, lane, 4u, t0, g, rows); }
    if (HD_FRAGS > 5u) { write_rows(o5, sg, lane, 5u, t0, g, rows); }
    if (HD_FRAGS > 6u) { write_rows(o6, sg, lane, 6u, t0, g, rows); }
    if (HD_FRAGS > 7u) { write_rows(o7, sg, lane, 7u, t0, g, rows); }
}
#endif

// The splits' (max, sum) pairs go through workgroup memory, so the sums
// over splits are independent loads rather than a chain.
var<workgroup> split_weight: array<f32, MAX_SPLITS>;

// Merges the `splits` partials of query head qh of step row t into
// out[dst ..], the splits in order, as one workgroup (which may call it
// again right after: it starts with a barrier).
fn merge_splits(t: u32, qh: u32, splits: u32, dst: u32, l: u32) {
    workgroupBarrier();
    let base = partial_slot(t, qh, 0u, splits);
    for (var s = l; s < splits; s += WG) {
        split_weight[s] = part_ml[2u * (base + s)];
    }
    workgroupBarrier();
    var m = NEG_BIG;
    for (var s = 0u; s < splits; s++) {
        m = max(m, split_weight[s]);
    }
    workgroupBarrier();
    for (var s = l; s < splits; s += WG) {
        split_weight[s] = exp(split_weight[s] - m);
    }
    workgroupBarrier();
    var sum = 0.0;
    for (var s = 0u; s < splits; s++) {
        sum += split_weight[s] * part_ml[2u * (base + s) + 1u];
    }
    for (var d = l; d < HEAD_DIM; d += WG) {
        var a = 0.0;
        for (var s = 0u; s < splits; s++) {
            a += split_weight[s] * part_acc[(base + s) * HEAD_DIM + d];
        }
        out[dst + d] = a / sum;
    }
}

// Merges the splits of one query head: one workgroup each.
@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let qh = wid.x;
#if PAGED
    // Row wid.y's partials, where it split.
    let t = wid.y;
    let pos = row_position(t);
    let splits = row_splits(t, pos + 1u - first_key(pos));
    if (splits == 1u) {
        return;
    }
    let dst = t * p.out_stride + qh * HEAD_DIM;
#else
    let t = 0u;
    let splits = step.attn_splits;
    let dst = qh * HEAD_DIM;
#endif
    merge_splits(t, qh, splits, dst, l);
}
