// Weight formats, decoded in registers (prepended to the families that
// read weight matrices; the family defines `weight_word(i)`, word i of the
// bound weight part, and `weight_quad(q)`, words 4q .. 4q + 3, in one load
// where its binding is of quads, else as `words4(4q)`: rows in these
// formats are whole quads of words). A build with WEIGHT_FORMAT reads one
// of the formats below (W_F16, W_F32, W_Q4_0, ... W_Q6_K, W_IQ4_NL,
// W_IQ4_XS, the lower i-quants W_IQ2_XXS ... W_IQ1_M, W_MXFP4) through
//   weights4(row_word, e): elements e .. e + 3 (e % 4 == 0) of the row
//                          whose first word is row_word (or the same in
//                          two steps, load4 and decode4: below),
//   BLOCK_ELEMS, BLOCK_WORDS: a row of n elements is row_words(n) words,
//                          ceil(n / BLOCK_ELEMS) blocks of BLOCK_WORDS
//                          (a partial block only in FP8, zero-padded).
// Blocks are the GGUF blocks with their fields on word boundaries
// (src/format.rs); every product of a scale and a quant below is exact in
// f32, so the values equal the reference decoding bit for bit whether or
// not the compiler fuses the final add.

// The low and high f16 of a word.
fn f16_lo(w: u32) -> f32 {
#if F16_NATIVE
    return unpack2x16float(w).x;
#else
    return f16_bits_to_f32(w & 0xffffu);
#endif
}

fn f16_hi(w: u32) -> f32 {
#if F16_NATIVE
    return unpack2x16float(w).y;
#else
    return f16_bits_to_f32(w >> 16u);
#endif
}

// f32(v) - minus for unsigned v below 2^23 and integral minus below 2^23,
// exactly, from the bits: 2^23 + v has v as its mantissa. An OR and a
// subtraction, full-rate on GPUs that convert integers at a quarter of
// their float rate (NVIDIA's), where the quantized kernels convert every
// weight.
fn uint_f32(v: vec4<u32>, minus: f32) -> vec4<f32> {
    return bitcast<vec4<f32>>(v | vec4<u32>(0x4b000000u)) - (8388608.0 + minus);
}

// f32(v) for one unsigned v below 2^23, the same way (the scales of the
// block formats: NVIDIA converts integers at an eighth of its float rate).
fn small_uint_f32(v: u32) -> f32 {
    return uint_f32(vec4<u32>(v), 0.0).x;
}

// f32(i) for |i| < 2^22, exactly: 1.5 * 2^23 + i has i + 2^22 as its
// mantissa (an integer add and a float subtraction).
fn small_int_f32(i: i32) -> f32 {
    return bitcast<f32>(i + 0x4b400000) - 12582912.0;
}

// Byte b of a word.
fn byte_of(w: u32, b: u32) -> u32 {
    return (w >> (8u * b)) & 0xffu;
}

// The four bytes of a word, each shifted right by `shift` and masked.
fn fields4(w: u32, shift: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> (vec4<u32>(0u, 8u, 16u, 24u) + shift)) & vec4<u32>(mask);
}

// Byte b of the block bytes starting at word `at`.
fn block_byte(at: u32, b: u32) -> u32 {
    return byte_of(weight_word(at + b / 4u), b % 4u);
}

// Each format reads elements e .. e + 3 (e % 4 == 0) of the row whose first
// word is `row` in two steps: load4(row, e) issues the loads of the words
// they need (a Raw4) and nothing that waits for them, and decode4(raw, e)
// computes their values from those words. weights4 is both at once; a
// kernel that loads a step ahead of using it (gemm_coop.wgsl) holds the
// next step's raw words (Run, runs of RUN: below) while it multiplies,
// so that the decoding, which waits for the loads, runs after the
// products rather than before them.
#if WEIGHT_FORMAT
fn weights4(row: u32, e: u32) -> vec4<f32> {
    return decode4(load4(row, e), e);
}
#endif

#if W_F32
const BLOCK_ELEMS: u32 = 1u;
const BLOCK_WORDS: u32 = 1u;
struct Raw4 {
    q: vec4<u32>,
}
fn load4(row: u32, e: u32) -> Raw4 {
    // One load of the quad (four loads of words are slower).
    return Raw4(weight_quad((row + e) / 4u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(r.q);
}
#endif

#if W_F16
const BLOCK_ELEMS: u32 = 2u;
const BLOCK_WORDS: u32 = 1u;
struct Raw4 {
    a: u32,
    b: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    return Raw4(weight_word(row + e / 2u), weight_word(row + e / 2u + 1u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return vec4<f32>(f16_lo(r.a), f16_hi(r.a), f16_lo(r.b), f16_hi(r.b));
}
#endif

// The Raw4 of F8_E4M3, Q4_0, Q4_1 and Q8_0: the block's scale word and the
// word of quants that holds elements e .. e + 3.
struct ScaledWord {
    scale: u32,
    q: u32,
}

#if W_F8_E4M3
const BLOCK_ELEMS: u32 = 128u;
const BLOCK_WORDS: u32 = 33u;
alias Raw4 = ScaledWord;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 128u) * 33u;
    return Raw4(weight_word(b), weight_word(b + 1u + (e % 128u) / 4u));
}
// F8_E4M3 (float8_e4m3fn): [scale f32][128 bytes]: scale v. Each byte's
// exponent and mantissa move into an f16's (bias 15 rather than 7: a factor
// 2^8 taken back exactly), subnormals included; 0x7f and 0xff are NaN.
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let q = fields4(r.q, 0u, 255u);
    let h = ((q & vec4<u32>(0x7fu)) << vec4<u32>(7u)) | ((q & vec4<u32>(0x80u)) << vec4<u32>(8u));
    let v = vec4<f32>(f16_lo(h.x | (h.y << 16u)), f16_hi(h.x | (h.y << 16u)), f16_lo(h.z | (h.w << 16u)), f16_hi(h.z | (h.w << 16u)));
    let nan = (q & vec4<u32>(0x7fu)) == vec4<u32>(0x7fu);
    return select(bitcast<f32>(r.scale) * 256.0 * v, vec4<f32>(bitcast<f32>(0x7fc00000u)), nan);
}
#endif

// The 4-bit quants of Q4_0 .. Q5_1: element j of a block is the low nibble
// of byte j when j < 16, else the high nibble of byte j - 16 of its 16
// bytes of nibbles from word qs; the word holding elements e .. e + 3, and
// their nibbles.
fn nibble_word(qs: u32, e: u32) -> u32 {
    return weight_word(qs + (e % 16u) / 4u);
}
fn nibbles4(q: u32, e: u32) -> vec4<u32> {
    return fields4(q, select(0u, 4u, e % 32u >= 16u), 15u);
}

// Q4_0: [d f16, pad][16 bytes of nibbles]: d (q - 8).
#if W_Q4_0
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;
alias Raw4 = ScaledWord;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 32u) * 5u;
    return Raw4(weight_word(b), nibble_word(b + 1u, e));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return f16_lo(r.scale) * uint_f32(nibbles4(r.q, e), 8.0);
}
#endif

// Q4_1: [d f16, m f16][16 bytes of nibbles]: d q + m.
#if W_Q4_1
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;
alias Raw4 = ScaledWord;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 32u) * 5u;
    return Raw4(weight_word(b), nibble_word(b + 1u, e));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return f16_lo(r.scale) * uint_f32(nibbles4(r.q, e), 0.0) + f16_hi(r.scale);
}
#endif

// Q5_0 / Q5_1: [d f16, pad or m f16][qh: bit j is element j's fifth bit]
// [16 bytes of nibbles]: d (q - 16), or d q + m.
struct Q5Raw4 {
    scale: u32,
    qh: u32,
    q: u32,
}
fn q5_load4(row: u32, e: u32) -> Q5Raw4 {
    let b = row + (e / 32u) * 6u;
    return Q5Raw4(weight_word(b), weight_word(b + 1u), nibble_word(b + 2u, e));
}
fn q5_quants(r: Q5Raw4, e: u32) -> vec4<f32> {
    let high = (vec4<u32>(r.qh) >> (vec4<u32>(0u, 1u, 2u, 3u) + e % 32u)) & vec4<u32>(1u);
    return uint_f32(nibbles4(r.q, e) | (high << vec4<u32>(4u)), 0.0);
}
#if W_Q5_0
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 6u;
alias Raw4 = Q5Raw4;
fn load4(row: u32, e: u32) -> Raw4 {
    return q5_load4(row, e);
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return f16_lo(r.scale) * (q5_quants(r, e) - 16.0);
}
#endif
#if W_Q5_1
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 6u;
alias Raw4 = Q5Raw4;
fn load4(row: u32, e: u32) -> Raw4 {
    return q5_load4(row, e);
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return f16_lo(r.scale) * q5_quants(r, e) + f16_hi(r.scale);
}
#endif

// Q8_0: [d f16, pad][32 signed bytes]: d q.
#if W_Q8_0
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 9u;
alias Raw4 = ScaledWord;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 32u) * 9u;
    return Raw4(weight_word(b), weight_word(b + 1u + (e % 32u) / 4u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    // Signed bytes, biased by 128 to unsigned.
    return f16_lo(r.scale) * uint_f32(fields4(r.q ^ 0x80808080u, 0u, 255u), 128.0);
}
#endif

// The values of four 4-bit indexes into a table of 16 signed bytes, four
// to a word (t, prepended from src/format.rs): each index's word by two
// selects, then its byte.
fn table16_values(t: vec4<u32>, q: vec4<u32>) -> vec4<f32> {
    let odd = (q & vec4<u32>(4u)) != vec4<u32>(0u);
    let low = select(vec4<u32>(t.x), vec4<u32>(t.y), odd);
    let high = select(vec4<u32>(t.z), vec4<u32>(t.w), odd);
    let w = select(low, high, q >= vec4<u32>(8u));
    let b = (w >> (8u * (q & vec4<u32>(3u)))) & vec4<u32>(255u);
    // Signed bytes, biased by 128 to unsigned.
    return uint_f32(b ^ vec4<u32>(0x80u), 128.0);
}


// IQ4_NL: [d f16, pad][16 bytes of nibbles, laid out as Q4_0's]: d v(q),
// v IQ4_NL's table.
#if W_IQ4_NL
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;
alias Raw4 = ScaledWord;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 32u) * 5u;
    return Raw4(weight_word(b), nibble_word(b + 1u, e));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return f16_lo(r.scale) * table16_values(IQ4NL_TABLE, nibbles4(r.q, e));
}
#endif

// IQ4_XS: [d f16, scales_h u16][scales_l: 4 bytes][128 bytes of nibbles]:
// 32 elements per sub-block n, each laid out as a Q4_0 block in bytes
// 16 n ..; its 6-bit scale is nibble n of scales_l topped by bits 2 n of
// scales_h, less 32: d (scale) v(q), v IQ4_NL's table.
#if W_IQ4_XS
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 34u;
struct Raw4 {
    head: u32,
    scales_l: u32,
    q: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 34u;
    let i = e % 256u;
    return Raw4(weight_word(b), weight_word(b + 1u), weight_word(b + 2u + (i / 32u) * 4u + (i % 16u) / 4u));
}
// The scale of sub-block n of the block whose first words are head and scales_l.
fn iq4xs_scale(head: u32, scales_l: u32, n: u32) -> f32 {
    let low = (byte_of(scales_l, n / 2u) >> (4u * (n % 2u))) & 15u;
    let high = (head >> (16u + 2u * n)) & 3u;
    return f16_lo(head) * (small_uint_f32(low | (high << 4u)) - 32.0);
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return iq4xs_scale(r.head, r.scales_l, (e % 256u) / 32u) * table16_values(IQ4NL_TABLE, nibbles4(r.q, e));
}
#endif

// MXFP4: [e, 3 bytes pad][16 bytes of nibbles, laid out as Q4_0's]:
// 2^(e - 128) v(q), v MXFP4's e2m1 values doubled (ggml's
// ggml_e8m0_to_fp32_half: e < 2 gives subnormals).
#if W_MXFP4
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;
alias Raw4 = ScaledWord;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 32u) * 5u;
    return Raw4(weight_word(b), nibble_word(b + 1u, e));
}
// The scale in the low byte of a block's first word.
fn mxfp4_scale(word: u32) -> f32 {
    let x = word & 255u;
    return bitcast<f32>(select((x - 1u) << 23u, 0x00200000u << x, x < 2u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return mxfp4_scale(r.scale) * table16_values(MXFP4_TABLE, nibbles4(r.q, e));
}
#endif

// The i-quants below 4 bits (src/format.rs has their CPU decoding): each
// group of 8 (IQ2, IQ1) or 4 (IQ3) values is an entry of the format's grid,
// GRID, a storage buffer bound at binding 16 (src/format.rs: GRID_BINDING,
// Grid::words). A grid of 8-value entries holds two to a
// word, each entry's 2-bit codes in 16 bits (the first value's lowest); one
// of 4-value entries holds an entry a word, its values as bytes.

// The sign bits of a 7-bit sign index: the eighth makes the count of minus
// signs even.
fn iq_signs(index: u32) -> u32 {
    return index | ((countOneBits(index) & 1u) << 7u);
}

// v, negated where bits shift .. shift + 3 of signs are set.
fn signed4(v: vec4<f32>, signs: u32, shift: u32) -> vec4<f32> {
    let bits = (vec4<u32>(signs) >> (vec4<u32>(0u, 1u, 2u, 3u) + shift)) & vec4<u32>(1u);
    return select(v, -v, bits == vec4<u32>(1u));
}

// Entry g of a grid of 8-value entries from its word.
fn grid8_entry(word: u32, g: u32) -> u32 {
    return (word >> (16u * (g % 2u))) & 0xffffu;
}

// Values j .. j + 3 (j 0 or 4) of an 8-value entry: each code c is byte c
// of `values`, less `bias`.
fn grid8_values(entry: u32, j: u32, values: u32, bias: f32) -> vec4<f32> {
    let codes = (vec4<u32>(entry) >> (2u * j + vec4<u32>(0u, 2u, 4u, 6u))) & vec4<u32>(3u);
    return uint_f32((vec4<u32>(values) >> (8u * codes)) & vec4<u32>(255u), bias);
}

// The values of a 4-value entry (its bytes).
fn grid4_values(word: u32) -> vec4<f32> {
    return uint_f32(fields4(word, 0u, 255u), 0.0);
}

// IQ2_XXS: [d f16, pad][per 32 values: 4 grid indexes (bytes), then 4
// 7-bit sign indexes and a 4-bit scale s (top bits)]: d (s + 1/2) / 4 v,
// signed.
#if W_IQ2_XXS
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 17u;
struct Raw4 {
    head: u32,
    indexes: u32,
    aux: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 17u;
    let s = b + 1u + ((e % 256u) / 32u) * 2u;
    return Raw4(weight_word(b), weight_word(s), weight_word(s + 1u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let l = (e % 32u) / 8u;
    let g = byte_of(r.indexes, l);
    let db = f16_lo(r.head) * (small_uint_f32(r.aux >> 28u) + 0.5) * 0.25;
    let v = db * grid8_values(grid8_entry(GRID[g / 2u], g), e % 8u, IQ2_VALUES, 0.0);
    return signed4(v, iq_signs((r.aux >> (7u * l)) & 127u), e % 8u);
}
#endif

// IQ2_XS: [d f16, pad][32 u16: 9-bit grid index, 7-bit sign index][8
// bytes of two 4-bit scales s, one per 16 values]: d (s + 1/2) / 4 v, signed.
#if W_IQ2_XS
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 19u;
struct Raw4 {
    head: u32,
    q: u32,
    scales: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 19u;
    let i = e % 256u;
    return Raw4(weight_word(b), weight_word(b + 1u + i / 16u), weight_word(b + 17u + i / 128u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let i = e % 256u;
    let q = grid8_entry(r.q, i / 8u);
    let s = (byte_of(r.scales, (i / 32u) % 4u) >> (4u * ((i % 32u) / 16u))) & 15u;
    let db = f16_lo(r.head) * (small_uint_f32(s) + 0.5) * 0.25;
    let g = q & 511u;
    let v = db * grid8_values(grid8_entry(GRID[g / 2u], g), e % 8u, IQ2_VALUES, 0.0);
    return signed4(v, iq_signs(q >> 9u), e % 8u);
}
#endif

// IQ2_S: [d f16, pad][32 bytes: grid index low bits][32 sign bytes][8
// bytes: the top 2 bits of 4 indexes][8 bytes of two 4-bit scales s, one
// per 16 values]: d (s + 1/2) / 4 v, signed.
#if W_IQ2_S
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 21u;
struct Raw4 {
    head: u32,
    low: u32,
    signs: u32,
    high: u32,
    scales: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 21u;
    let g = (e % 256u) / 8u;
    return Raw4(
        weight_word(b),
        weight_word(b + 1u + g / 4u),
        weight_word(b + 9u + g / 4u),
        weight_word(b + 17u + g / 16u),
        weight_word(b + 19u + g / 16u),
    );
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let g = (e % 256u) / 8u;
    let high = (byte_of(r.high, (g / 4u) % 4u) >> (2u * (g % 4u))) & 3u;
    let index = byte_of(r.low, g % 4u) | (high << 8u);
    let s = (byte_of(r.scales, (g / 4u) % 4u) >> (4u * ((g % 4u) / 2u))) & 15u;
    let db = f16_lo(r.head) * (small_uint_f32(s) + 0.5) * 0.25;
    let v = db * grid8_values(grid8_entry(GRID[index / 2u], index), e % 8u, IQ2_VALUES, 0.0);
    return signed4(v, byte_of(r.signs, g % 4u), e % 8u);
}
#endif

// IQ3_XXS: [d f16, pad][64 grid indexes (bytes), one per 4 values][per 32
// values: 4 7-bit sign indexes and a 4-bit scale s (top bits)]:
// d (s + 1/2) / 2 v, signed.
#if W_IQ3_XXS
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 25u;
struct Raw4 {
    head: u32,
    indexes: u32,
    aux: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 25u;
    let i = e % 256u;
    return Raw4(weight_word(b), weight_word(b + 1u + i / 16u), weight_word(b + 17u + i / 32u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let k = (e % 256u) / 4u;
    let db = f16_lo(r.head) * (small_uint_f32(r.aux >> 28u) + 0.5) * 0.5;
    let v = db * grid4_values(GRID[byte_of(r.indexes, k % 4u)]);
    return signed4(v, iq_signs((r.aux >> (7u * ((k % 8u) / 2u))) & 127u), 4u * (k % 2u));
}
#endif

// IQ3_S: [d f16, pad][64 bytes: grid index low bits, one per 4 values][8
// bytes: their top bits][32 sign bytes][4 bytes of two 4-bit scales s, one
// per 32 values]: d (1 + 2 s) v, signed.
#if W_IQ3_S
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 28u;
struct Raw4 {
    head: u32,
    low: u32,
    high: u32,
    signs: u32,
    scales: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 28u;
    let k = (e % 256u) / 4u;
    return Raw4(
        weight_word(b),
        weight_word(b + 1u + k / 4u),
        weight_word(b + 17u + k / 32u),
        weight_word(b + 19u + k / 8u),
        weight_word(b + 27u),
    );
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let k = (e % 256u) / 4u;
    let ib = k / 8u;
    let index = byte_of(r.low, k % 4u) | (((byte_of(r.high, ib % 4u) >> (k % 8u)) & 1u) << 8u);
    let s = (byte_of(r.scales, ib / 2u) >> (4u * (ib % 2u))) & 15u;
    let v = f16_lo(r.head) * small_uint_f32(1u + 2u * s) * grid4_values(GRID[index]);
    return signed4(v, byte_of(r.signs, (k / 2u) % 4u), 4u * (k % 2u));
}
#endif

// IQ1_S / IQ1_M: values j .. j + 3 (j 0 or 4) of the grid entry whose
// word is grid_word, as dl (v + delta): v -1, 0 or 1 (the code less one),
// delta -1/8 where `negative`, else 1/8.
fn iq1_values(grid_word: u32, index: u32, j: u32, dl: f32, negative: bool) -> vec4<f32> {
    let delta = select(0.125, -0.125, negative);
    return dl * (grid8_values(grid8_entry(grid_word, index), j, IQ1_VALUES, 1.0) + delta);
}

// IQ1_S: [d f16, pad][32 bytes: grid index low bits, one per 8 values][8
// u16, one per 32 values: 4 x 3 top index bits, a 3-bit scale s, the sign
// of delta]: d (2 s + 1) (v + delta).
#if W_IQ1_S
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 13u;
struct Raw4 {
    head: u32,
    low: u32,
    high: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 13u;
    let g = (e % 256u) / 8u;
    return Raw4(weight_word(b), weight_word(b + 1u + g / 4u), weight_word(b + 9u + g / 8u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let g = (e % 256u) / 8u;
    let qh = grid8_entry(r.high, g / 4u);
    let dl = f16_lo(r.head) * small_uint_f32(2u * ((qh >> 12u) & 7u) + 1u);
    let index = byte_of(r.low, g % 4u) | (((qh >> (3u * (g % 4u))) & 7u) << 8u);
    return iq1_values(GRID[index / 2u], index, e % 8u, dl, (qh & 0x8000u) != 0u);
}
#endif

// IQ1_M: [32 bytes: grid index low bits, one per 8 values][16 bytes, a
// nibble per 8 values: 3 top index bits, the sign of delta][4 u16: 3-bit
// scales s, one per 16 values, and the block's f16 d in their top
// nibbles]: d (2 s + 1) (v + delta).
#if W_IQ1_M
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 14u;
struct Raw4 {
    low: u32,
    high: u32,
    scales01: u32,
    scales23: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 14u;
    let g = (e % 256u) / 8u;
    return Raw4(weight_word(b + g / 4u), weight_word(b + 8u + g / 8u), weight_word(b + 12u), weight_word(b + 13u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let g = (e % 256u) / 8u;
    let top = ((r.scales01 >> 12u) & 0xfu) | ((r.scales01 >> 24u) & 0xf0u)
        | ((r.scales23 >> 4u) & 0xf00u) | ((r.scales23 >> 16u) & 0xf000u);
    let ib = g / 4u;
    let sc = grid8_entry(select(r.scales01, r.scales23, ib >= 4u), ib / 2u);
    let s = (sc >> (6u * (ib % 2u) + 3u * ((g % 4u) / 2u))) & 7u;
    let dl = f16_lo(top) * small_uint_f32(2u * s + 1u);
    let h = (byte_of(r.high, (g / 2u) % 4u) >> (4u * (g % 2u))) & 15u;
    let index = byte_of(r.low, g % 4u) | ((h & 7u) << 8u);
    return iq1_values(GRID[index / 2u], index, e % 8u, dl, (h & 8u) != 0u);
}
#endif
// The 2-bit quants of Q2_K / Q3_K: element i (of 256) is bits 2 (i % 128) / 32
// of byte 32 (i / 128) + i % 32 of the 64 bytes at word `qs`; the word
// holding elements i .. i + 3, and their fields.
fn quants2_word(qs: u32, i: u32) -> u32 {
    return weight_word(qs + (32u * (i / 128u) + i % 32u) / 4u);
}
fn quants2(q: u32, i: u32) -> vec4<u32> {
    return fields4(q, 2u * ((i % 128u) / 32u), 3u);
}

// Q2_K: [16 scale bytes: low nibble scale, high nibble min, per 16
// elements][64 quant bytes][d f16, dmin f16]: d sc q - dmin m.
#if W_Q2_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 21u;
struct Raw4 {
    scales: u32,
    dm: u32,
    q: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 21u;
    let i = e % 256u;
    return Raw4(weight_word(b + i / 64u), weight_word(b + 20u), quants2_word(b + 4u, i));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let i = e % 256u;
    let sc = byte_of(r.scales, (i / 16u) % 4u);
    return f16_lo(r.dm) * small_uint_f32(sc & 15u) * uint_f32(quants2(r.q, i), 0.0) - f16_hi(r.dm) * small_uint_f32(sc >> 4u);
}
#endif

// Q3_K: [32 bytes hmask: bit i / 32 of byte i % 32 set means no -4]
// [64 quant bytes][12 bytes of sixteen 6-bit scales][d f16, pad]:
// d (sc - 32) (q - 4 (1 - h)).
#if W_Q3_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 28u;
struct Raw4 {
    scales: vec2<u32>,
    h: u32,
    q: u32,
    d: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 28u;
    let i = e % 256u;
    return Raw4(q3_scale_words(b, i / 16u), weight_word(b + (i % 32u) / 4u), quants2_word(b + 8u, i), weight_word(b + 27u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let i = e % 256u;
    let h = fields4(r.h, i / 32u, 1u);
    let q = uint_f32(quants2(r.q, i) | (h << vec4<u32>(2u)), 4.0);
    return f16_lo(r.d) * q3_scale_of(r.scales, i / 16u) * q;
}
#endif

// Q4_K / Q5_K: [d f16, dmin f16][12 bytes of eight 6-bit (scale, min)
// pairs, one per 32 elements](Q5_K: [32 bytes qh: bit i / 32 of byte
// i % 32 is the fifth bit])[128 bytes: element i is the low nibble of byte
// 32 (i / 64) + i % 32 when i % 64 < 32, else its high nibble]:
// d sc q - dmin m. Raw: the block's first quad (d, dmin and the scales),
// the quant word and Q5_K's qh word (zero for Q4_K).
struct K4Raw4 {
    head: vec4<u32>,
    qh: u32,
    q: u32,
}
// The word of the block's quants (from word qs) holding elements i .. i + 3.
fn k4_quant_word(qs: u32, i: u32) -> u32 {
    return weight_word(qs + (32u * (i / 64u) + i % 32u) / 4u);
}
// The 6-bit scale and min (as integers) of element i of the block whose
// first quad is `head`, by a branch: the GEMMs' lanes decode the same 32
// elements of a block together. (k4_scale_min, below, gives them by scale
// number as floats without branching, for lanes on different scales.)
fn k4_scale_min_bits(head: vec4<u32>, i: u32) -> vec2<u32> {
    let j = i / 32u;
    if (j < 4u) {
        return vec2<u32>(byte_of(head.y, j) & 63u, byte_of(head.z, j) & 63u);
    }
    let w = byte_of(head.w, j - 4u);
    return vec2<u32>((w & 15u) | ((byte_of(head.y, j - 4u) >> 6u) << 4u), (w >> 4u) | ((byte_of(head.z, j - 4u) >> 6u) << 4u));
}
// Elements i .. i + 3 of the block of head `head` from their quant word q,
// with scale and min sm; `high` adds Q5_K's fifth bits.
fn k4_values(head: vec4<u32>, sm: vec2<u32>, q: u32, i: u32, high: vec4<u32>) -> vec4<f32> {
    let low = fields4(q, select(0u, 4u, i % 64u >= 32u), 15u);
    return f16_lo(head.x) * small_uint_f32(sm.x) * uint_f32(low | high, 0.0) - f16_hi(head.x) * small_uint_f32(sm.y);
}
fn k4_decode4(r: K4Raw4, i: u32, high: vec4<u32>) -> vec4<f32> {
    return k4_values(r.head, k4_scale_min_bits(r.head, i), r.q, i, high);
}
#if W_Q4_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 36u;
alias Raw4 = K4Raw4;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 36u;
    return Raw4(weight_quad(b / 4u), 0u, k4_quant_word(b + 4u, e % 256u));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    return k4_decode4(r, e % 256u, vec4<u32>(0u));
}
#endif
#if W_Q5_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 44u;
alias Raw4 = K4Raw4;
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 44u;
    let i = e % 256u;
    return Raw4(weight_quad(b / 4u), weight_word(b + 4u + (i % 32u) / 4u), k4_quant_word(b + 12u, i));
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let i = e % 256u;
    return k4_decode4(r, i, fields4(r.qh, i / 32u, 1u) << vec4<u32>(4u));
}
#endif

// Runs of sixteen of Q4_K / Q5_K for the cooperative GEMM (below): the
// quants of elements i .. i + 15 (i % 16 == 0) are one aligned quad (and
// Q5_K's fifth bits another), so a run is two or three 16-byte loads with
// the block's head, where runs of eight took six word loads (see
// gemm_coop.wgsl's Staged). Rows are whole blocks of 256, so a run never
// ends early (`cols` is not needed).
struct K4Run {
    head: vec4<u32>,
    qh: vec4<u32>,
    q: vec4<u32>,
}
// The quad of the block's quants (from word qs) holding elements i .. i + 15.
fn k4_quant_quad(qs: u32, i: u32) -> vec4<u32> {
    return weight_quad((qs + (32u * (i / 64u) + i % 32u) / 4u) / 4u);
}
fn k4_decode_run(r: K4Run, i: u32, high: array<vec4<u32>, 4>) -> array<vec4<f32>, 4> {
    let sm = k4_scale_min_bits(r.head, i);
    return array(
        k4_values(r.head, sm, r.q.x, i, high[0]),
        k4_values(r.head, sm, r.q.y, i + 4u, high[1]),
        k4_values(r.head, sm, r.q.z, i + 8u, high[2]),
        k4_values(r.head, sm, r.q.w, i + 12u, high[3]),
    );
}
#if W_Q4_K
const RUN: u32 = 16u;
alias Run = K4Run;
fn load_run(row: u32, e: u32, cols: u32) -> Run {
    let b = row + (e / 256u) * 36u;
    return Run(weight_quad(b / 4u), vec4<u32>(0u), k4_quant_quad(b + 4u, e % 256u));
}
fn decode_run(r: Run, e: u32) -> array<vec4<f32>, 4> {
    let none = vec4<u32>(0u);
    return k4_decode_run(r, e % 256u, array(none, none, none, none));
}
#endif
#if W_Q5_K
const RUN: u32 = 16u;
alias Run = K4Run;
fn load_run(row: u32, e: u32, cols: u32) -> Run {
    let b = row + (e / 256u) * 44u;
    let i = e % 256u;
    return Run(weight_quad(b / 4u), weight_quad((b + 4u + (i % 32u) / 4u) / 4u), k4_quant_quad(b + 12u, i));
}
fn decode_run(r: Run, e: u32) -> array<vec4<f32>, 4> {
    let i = e % 256u;
    let bit = i / 32u;
    let high = array(
        fields4(r.qh.x, bit, 1u) << vec4<u32>(4u),
        fields4(r.qh.y, bit, 1u) << vec4<u32>(4u),
        fields4(r.qh.z, bit, 1u) << vec4<u32>(4u),
        fields4(r.qh.w, bit, 1u) << vec4<u32>(4u),
    );
    return k4_decode_run(r, i, high);
}
#endif

// Q6_K: [128 bytes: low 4 bits][64 bytes: high 2 bits][16 signed scales,
// one per 16 elements][d f16, pad]: d sc (q - 32).
#if W_Q6_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 53u;
struct Raw4 {
    low: u32,
    high: u32,
    scales: u32,
    d: u32,
}
fn load4(row: u32, e: u32) -> Raw4 {
    let b = row + (e / 256u) * 53u;
    let i = e % 256u;
    let r = i % 128u;
    return Raw4(
        weight_word(b + (64u * (i / 128u) + r % 64u) / 4u),
        weight_word(b + 32u + (32u * (i / 128u) + r % 32u) / 4u),
        weight_word(b + 48u + i / 64u),
        weight_word(b + 52u),
    );
}
fn decode4(r: Raw4, e: u32) -> vec4<f32> {
    let i = e % 256u;
    let low = fields4(r.low, select(0u, 4u, i % 128u >= 64u), 15u);
    let high = fields4(r.high, 2u * ((i % 128u) / 32u), 3u);
    let q = uint_f32(low | (high << vec4<u32>(4u)), 32.0);
    return f16_lo(r.d) * q6_scale_of(r.scales, i / 16u) * q;
}
#endif

// Runs of RUN elements e .. e + RUN - 1 (e % RUN == 0) for the
// cooperative GEMM's staging, in the same two steps: load_run issues the
// loads, decode_run decodes them. Eight elements (a row of `cols` may end
// after the first four), two Raw4s, but for Q4_K / Q5_K (above).
#if WEIGHT_FORMAT
#if !W_Q4_K
#if !W_Q5_K
const RUN: u32 = 8u;
struct Run {
    a: Raw4,
    b: Raw4,
}
fn load_run(row: u32, e: u32, cols: u32) -> Run {
    // All-zero words decode to zeros in every format.
    var r = Run(load4(row, e), Raw4());
    if (e + 4u < cols) {
        r.b = load4(row, e + 4u);
    }
    return r;
}
fn decode_run(r: Run, e: u32) -> array<vec4<f32>, 2> {
    return array(decode4(r.a, e), decode4(r.b, e + 4u));
}
#endif
#endif
#endif

// Words i .. i + 3 of the bound weight part.
fn words4(i: u32) -> vec4<u32> {
    return vec4<u32>(weight_word(i), weight_word(i + 1u), weight_word(i + 2u), weight_word(i + 3u));
}

// The scale and min numbered n of a Q4_K / Q5_K block whose first quad is head.
// Branch-free: the lanes of a subgroup read different n.
fn k4_scale_min(head: vec4<u32>, n: u32) -> vec2<f32> {
    // n < 4: the low 6 bits of bytes n of head.y and head.z; n >= 4: the
    // nibbles of byte n - 4 of head.w, topped by the high 2 bits of those.
    let yz = vec2<u32>(byte_of(head.y, n % 4u), byte_of(head.z, n % 4u));
    let w = byte_of(head.w, n % 4u);
    let high = (vec2<u32>(w & 15u, w >> 4u)) | ((yz >> vec2<u32>(6u)) << vec2<u32>(4u));
    let v = select(yz & vec2<u32>(63u), high, n >= 4u);
    return vec2<f32>(small_uint_f32(v.x), small_uint_f32(v.y));
}
// Q3_K's scale n (of 16, 6 bits, less 32) of the block at word b.
fn q3_scale(b: u32, n: u32) -> f32 {
    return q3_scale_of(q3_scale_words(b, n), n);
}
// The two words that hold Q3_K's scale n of the block at word b, and the scale from them.
fn q3_scale_words(b: u32, n: u32) -> vec2<u32> {
    return vec2<u32>(weight_word(b + 24u + (n % 8u) / 4u), weight_word(b + 26u));
}
fn q3_scale_of(w: vec2<u32>, n: u32) -> f32 {
    let low = (byte_of(w.x, n % 4u) >> (4u * (n / 8u))) & 15u;
    let high = (byte_of(w.y, n % 4u) >> (2u * (n / 4u))) & 3u;
    return small_uint_f32(low | (high << 4u)) - 32.0;
}
// Q6_K's scale n (signed byte) of the block at word b.
fn q6_scale(b: u32, n: u32) -> f32 {
    return q6_scale_of(weight_word(b + 48u + n / 4u), n);
}
// Q6_K's scale n from the word that holds it.
fn q6_scale_of(w: u32, n: u32) -> f32 {
    // The byte biased by 128 to unsigned.
    return small_uint_f32(byte_of(w ^ 0x80808080u, n % 4u)) - 128.0;
}
#if WEIGHT_FORMAT
// Words of a row of n elements.
fn row_words(n: u32) -> u32 {
    return (n + BLOCK_ELEMS - 1u) / BLOCK_ELEMS * BLOCK_WORDS;
}
#endif

// Dot products by unit, for kernels that stream rows once (the GEMV):
// with UNIT_DOTS the family also defines `x4(xq, q)` (elements 4q ..
// 4q + 3 of the vector whose first quad is xq), and gets
//   unit_dots(wa, wb, u, xq): elements u * UNIT_ELEMS .. of the rows whose
//                             first words are wa and wb, dotted with x
//                             (each load of x serves both rows).
// The formats of 256-element blocks have them: a unit is one 16-byte run of
// a block's quants (32 or 64 elements), what one lane decodes with one
// look at the block's packed scales, rather than one look per four
// weights. Quants are dotted with x first and scaled after (one multiply
// per run of elements that share a scale).
//
// INT8_DOTS (instead of UNIT_DOTS): the GEMV's activations are quantized to
// three signed bytes per element (see gemv.wgsl); the family defines
//   x_run16(q, r):      the 16 signed bytes of q dotted with run r of x
//                       (elements 16 r .. 16 r + 15 of the staged chunk), scaled,
//   x_run32(qa, qb, r): qa with run r and qb with run r + 1 (r even: one
//                       block of 32 of x, converted and scaled once),
//   x_sum16(r), x_sum32(r): the sum of run r (and r + 1) of x,
// and gets unit_dots(wa, wb, u, r0), runs numbered from r0, over the
// UNIT_DOTS units (Q4_K, Q5_K, Q6_K) or a block of 32 (Q8_0, Q4_0 .. Q5_1).
// The quants go to the integer dot units (dot4I8Packed) four at a time
// as they lie in their bytes, masked into place, never converted to floats
// one by one: the formats whose quants fit a signed byte have them (Q8_0,
// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), those whose quants index
// a table of signed bytes (IQ4_NL, IQ4_XS, MXFP4), and the i-quants below
// 4 bits, whose grid entries become signed bytes.
#if UNIT_DOTS
fn sum4(a: vec4<f32>) -> f32 {
    return dot(a, vec4<f32>(1.0));
}

// Q2_K / Q3_K: unit u is quant bytes 32 c + 16 v .. + 15 (c = u / 2 % 2,
// v = u % 2) of block u / 4: elements 128 c + 32 s + 16 v + 0..15 for the
// four 2-bit fields s, each run of 16 with its own scale (number 8 c + 2 s + v).
#if W_Q2_K
const UNIT_ELEMS: u32 = 64u;
// Run n of the block at word b: (d sc) t - (dmin m) xs.
fn q2_scaled(b: u32, n: u32, t: f32, xs: f32) -> f32 {
    let sc = block_byte(b, n);
    let dm = weight_word(b + 20u);
    return f16_lo(dm) * small_uint_f32(sc & 15u) * t - f16_hi(dm) * small_uint_f32(sc >> 4u) * xs;
}
fn unit_dots(wa: u32, wb: u32, u: u32, xq: u32) -> vec2<f32> {
    let c = u / 2u % 2u;
    let v = u % 2u;
    let ba = wa + (u / 4u) * 21u;
    let bb = wb + (u / 4u) * 21u;
    let qa = words4(ba + 4u + 8u * c + 4u * v);
    let qb = words4(bb + 4u + 8u * c + 4u * v);
    let x0 = 64u * (u / 4u) + 32u * c + 4u * v;
    var r = vec2<f32>(0.0);
    for (var s = 0u; s < 4u; s++) {
        var t = vec2<f32>(0.0);
        var xs = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let a = x4(xq, x0 + 8u * s + k);
            t += vec2<f32>(dot(uint_f32(fields4(qa[k], 2u * s, 3u), 0.0), a), dot(uint_f32(fields4(qb[k], 2u * s, 3u), 0.0), a));
            xs += sum4(a);
        }
        let n = 8u * c + 2u * s + v;
        r += vec2<f32>(q2_scaled(ba, n, t.x, xs), q2_scaled(bb, n, t.y, xs));
    }
    return r;
}
#endif
#if W_Q3_K
const UNIT_ELEMS: u32 = 64u;
// Field s of quants q, less 4 where hmask hm (bit 4 c + s) is clear.
fn q3_quants(q: u32, hm: u32, c: u32, s: u32) -> vec4<f32> {
    return uint_f32(fields4(q, 2u * s, 3u) | (fields4(hm, 4u * c + s, 1u) << vec4<u32>(2u)), 4.0);
}
fn unit_dots(wa: u32, wb: u32, u: u32, xq: u32) -> vec2<f32> {
    let c = u / 2u % 2u;
    let v = u % 2u;
    let ba = wa + (u / 4u) * 28u;
    let bb = wb + (u / 4u) * 28u;
    let qa = weight_quad((ba + 8u + 8u * c + 4u * v) / 4u);
    let qb = weight_quad((bb + 8u + 8u * c + 4u * v) / 4u);
    // hmask bytes 16 v .. + 15.
    let ha = weight_quad((ba + 4u * v) / 4u);
    let hb = weight_quad((bb + 4u * v) / 4u);
    let x0 = 64u * (u / 4u) + 32u * c + 4u * v;
    var r = vec2<f32>(0.0);
    for (var s = 0u; s < 4u; s++) {
        var t = vec2<f32>(0.0);
        for (var k = 0u; k < 4u; k++) {
            let a = x4(xq, x0 + 8u * s + k);
            t += vec2<f32>(dot(q3_quants(qa[k], ha[k], c, s), a), dot(q3_quants(qb[k], hb[k], c, s), a));
        }
        let n = 8u * c + 2u * s + v;
        r += vec2<f32>(q3_scale(ba, n), q3_scale(bb, n)) * t;
    }
    return vec2<f32>(f16_lo(weight_word(ba + 27u)), f16_lo(weight_word(bb + 27u))) * r;
}
#endif

// Q4_K / Q5_K: unit u is nibble bytes 32 j + 16 h .. + 15 (j = u / 2 % 4,
// h = u % 2) of block u / 8: elements 64 j + 16 h + 0..15 (low nibbles,
// scale 2 j) and 32 more on (high nibbles, scale 2 j + 1); Q5_K's fifth
// bits are bits 2 j and 2 j + 1 of qh bytes 16 h ...
#if W_Q4_K
const UNIT_ELEMS: u32 = 32u;
fn unit_dots(wa: u32, wb: u32, u: u32, xq: u32) -> vec2<f32> {
    let ba = (wa + (u / 8u) * 36u) / 4u;
    let bb = (wb + (u / 8u) * 36u) / 4u;
    let none = vec4<u32>(0u);
    return k4_unit_dots(
        weight_quad(ba), weight_quad(ba + 1u + u % 8u), none,
        weight_quad(bb), weight_quad(bb + 1u + u % 8u), none, u, xq);
}
#endif
#if W_Q5_K
const UNIT_ELEMS: u32 = 32u;
fn unit_dots(wa: u32, wb: u32, u: u32, xq: u32) -> vec2<f32> {
    let ba = (wa + (u / 8u) * 44u) / 4u;
    let bb = (wb + (u / 8u) * 44u) / 4u;
    return k4_unit_dots(
        weight_quad(ba), weight_quad(ba + 3u + u % 8u), weight_quad(ba + 1u + u % 2u),
        weight_quad(bb), weight_quad(bb + 3u + u % 8u), weight_quad(bb + 1u + u % 2u), u, xq);
}
#endif
// (low nibbles . a, high nibbles . c) of one quant word q, fifth bits in qh.
fn k4_step(q: u32, qh: u32, j: u32, a: vec4<f32>, c: vec4<f32>) -> vec2<f32> {
    let lo = fields4(q, 0u, 15u) | (fields4(qh, 2u * j, 1u) << vec4<u32>(4u));
    let hi = fields4(q, 4u, 15u) | (fields4(qh, 2u * j + 1u, 1u) << vec4<u32>(4u));
    return vec2<f32>(dot(uint_f32(lo, 0.0), a), dot(uint_f32(hi, 0.0), c));
}
// The unit's value from its quant dots t and x sums xs (low run, high run).
fn k4_scaled(head: vec4<u32>, j: u32, t: vec2<f32>, xs: vec2<f32>) -> f32 {
    let s0 = k4_scale_min(head, 2u * j);
    let s1 = k4_scale_min(head, 2u * j + 1u);
    return f16_lo(head.x) * (s0.x * t.x + s1.x * t.y) - f16_hi(head.x) * (s0.y * xs.x + s1.y * xs.y);
}
fn k4_unit_dots(
    head_a: vec4<u32>, qa: vec4<u32>, qha: vec4<u32>,
    head_b: vec4<u32>, qb: vec4<u32>, qhb: vec4<u32>, u: u32, xq: u32,
) -> vec2<f32> {
    let j = u / 2u % 4u;
    let x0 = 64u * (u / 8u) + 16u * j + 4u * (u % 2u);
    var ta = vec2<f32>(0.0);
    var tb = vec2<f32>(0.0);
    var xs = vec2<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let a = x4(xq, x0 + k);
        let c = x4(xq, x0 + 8u + k);
        ta += k4_step(qa[k], qha[k], j, a, c);
        tb += k4_step(qb[k], qhb[k], j, a, c);
        xs += vec2<f32>(sum4(a), sum4(c));
    }
    return vec2<f32>(k4_scaled(head_a, j, ta, xs), k4_scaled(head_b, j, tb, xs));
}

// Q6_K: unit u is low-nibble bytes 64 half + 16 v .. + 15 (half = u / 4 % 2,
// v = u % 4) of block u / 8: elements 128 half + 16 v + 0..15 (low nibbles,
// scale 8 half + v) and 64 more on (high nibbles, scale 8 half + 4 + v),
// their top two bits in qh bytes 32 half + 16 (v % 2) .., fields v / 2 and 2 + v / 2.
#if W_Q6_K
const UNIT_ELEMS: u32 = 32u;
fn q6_step(ql: u32, qh: u32, v: u32, a: vec4<f32>, c: vec4<f32>) -> vec2<f32> {
    let lo = fields4(ql, 0u, 15u) | (fields4(qh, 2u * (v / 2u), 3u) << vec4<u32>(4u));
    let hi = fields4(ql, 4u, 15u) | (fields4(qh, 2u * (2u + v / 2u), 3u) << vec4<u32>(4u));
    return vec2<f32>(dot(uint_f32(lo, 0.0), a), dot(uint_f32(hi, 0.0), c));
}
fn q6_scaled(b: u32, n: u32, t: vec2<f32>, xs: vec2<f32>) -> f32 {
    return f16_lo(weight_word(b + 52u)) * (q6_scale(b, n) * (t.x - 32.0 * xs.x) + q6_scale(b, n + 4u) * (t.y - 32.0 * xs.y));
}
fn unit_dots(wa: u32, wb: u32, u: u32, xq: u32) -> vec2<f32> {
    let half = u / 4u % 2u;
    let v = u % 4u;
    let ba = wa + (u / 8u) * 53u;
    let bb = wb + (u / 8u) * 53u;
    let la = words4(ba + 16u * half + 4u * v);
    let lb = words4(bb + 16u * half + 4u * v);
    let ha = words4(ba + 32u + 8u * half + 4u * (v % 2u));
    let hb = words4(bb + 32u + 8u * half + 4u * (v % 2u));
    let x0 = 64u * (u / 8u) + 32u * half + 4u * v;
    var ta = vec2<f32>(0.0);
    var tb = vec2<f32>(0.0);
    var xs = vec2<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let a = x4(xq, x0 + k);
        let c = x4(xq, x0 + 16u + k);
        ta += q6_step(la[k], ha[k], v, a, c);
        tb += q6_step(lb[k], hb[k], v, a, c);
        xs += vec2<f32>(sum4(a), sum4(c));
    }
    let n = 8u * half + v;
    return vec2<f32>(q6_scaled(ba, n, ta, xs), q6_scaled(bb, n, tb, xs));
}
#endif
#endif

#if INT8_DOTS
// The low and high nibbles of 16 bytes, as 16 bytes.
fn nibbles_lo(q: vec4<u32>) -> vec4<u32> {
    return q & vec4<u32>(0x0f0f0f0fu);
}
fn nibbles_hi(q: vec4<u32>) -> vec4<u32> {
    return (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
}
// Bits `shift` .. of qh's bytes, `mask` each (0x01010101: one bit), moved
// to bit 4 of each byte: the fifth (and sixth) bits of 16 quants.
fn high_bits(qh: vec4<u32>, shift: u32, mask: u32) -> vec4<u32> {
    return ((qh >> vec4<u32>(shift)) & vec4<u32>(mask)) << vec4<u32>(4u);
}

// Each format's int8_unit(w, u, r0): the dot of unit u of the row at word
// w with the staged chunk whose first run is r0.

// Q8_0: a unit is a block, 32 quants with its scale.
#if W_Q8_0
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 9u;
    return f16_lo(weight_word(b)) * x_run32(words4(b + 1u), words4(b + 5u), 2u * u - r0);
}
#endif

// Q4_0, Q4_1, Q5_0, Q5_1: a unit is a block, its low nibbles elements 0..15
// (run r) and its high nibbles 16..31 (run r + 1); Q5's fifth bits are bit
// e of qh for element e.
#if W_Q4_0
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 5u;
    let r = 2u * u - r0;
    let q = words4(b + 1u);
    return f16_lo(weight_word(b)) * (x_run32(nibbles_lo(q), nibbles_hi(q), r) - 8.0 * x_sum32(r));
}
#endif
#if W_Q4_1
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 5u;
    let r = 2u * u - r0;
    let q = words4(b + 1u);
    let dm = weight_word(b);
    return f16_lo(dm) * x_run32(nibbles_lo(q), nibbles_hi(q), r) + f16_hi(dm) * x_sum32(r);
}
#endif
// The dots of a Q5 block at word b with runs r and r + 1: its quants with
// their fifth bits (bit e of qh to bit 4 of element e's byte).
fn q5_dots(b: u32, r: u32) -> f32 {
    let qh = weight_word(b + 1u);
    let q = words4(b + 2u);
    // Bits 4 k .. 4 k + 3 of qh spread over the bytes of word k.
    let nib = (vec4<u32>(qh) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    let spread = (nib & vec4<u32>(1u)) | ((nib & vec4<u32>(2u)) << vec4<u32>(7u))
        | ((nib & vec4<u32>(4u)) << vec4<u32>(14u)) | ((nib & vec4<u32>(8u)) << vec4<u32>(21u));
    let nib_hi = (vec4<u32>(qh) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
    let spread_hi = (nib_hi & vec4<u32>(1u)) | ((nib_hi & vec4<u32>(2u)) << vec4<u32>(7u))
        | ((nib_hi & vec4<u32>(4u)) << vec4<u32>(14u)) | ((nib_hi & vec4<u32>(8u)) << vec4<u32>(21u));
    return x_run32(nibbles_lo(q) | (spread << vec4<u32>(4u)), nibbles_hi(q) | (spread_hi << vec4<u32>(4u)), r);
}
#if W_Q5_0
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 6u;
    let r = 2u * u - r0;
    return f16_lo(weight_word(b)) * (q5_dots(b, r) - 16.0 * x_sum32(r));
}
#endif
#if W_Q5_1
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 6u;
    let r = 2u * u - r0;
    let dm = weight_word(b);
    return f16_lo(dm) * q5_dots(b, r) + f16_hi(dm) * x_sum32(r);
}
#endif

// IQ4_NL, IQ4_XS, MXFP4 (INT8_TABLE): quants are 4-bit indexes into a
// table of 16 signed bytes. The kernel fills `table_bytes` once
// (fill_table16, before its first barrier): entry 16 k + i is value i
// shifted to byte k, so that a word of four values is four lookups and
// three ors. A lookup instruction's lanes read at most 16 entries, one per
// bank: in a register table, each value took four selects.
#if INT8_TABLE
#if W_IQ4_NL
const TABLE16 = IQ4NL_TABLE;
#endif
#if W_IQ4_XS
const TABLE16 = IQ4NL_TABLE;
#endif
#if W_MXFP4
const TABLE16 = MXFP4_TABLE;
#endif
var<workgroup> table_bytes: array<u32, 64>;
fn fill_table16(li: u32, wg: u32) {
    for (var i = li; i < 64u; i += wg) {
        table_bytes[i] = byte_of(TABLE16[(i % 16u) / 4u], i % 4u) << (8u * (i / 16u));
    }
}
// The table's values of 16 indexes, one in each byte of q.
fn table16_bytes(q: vec4<u32>) -> vec4<u32> {
    var r = vec4<u32>(0u);
    for (var k = 0u; k < 4u; k++) {
        let i = ((q >> vec4<u32>(8u * k)) & vec4<u32>(15u)) + vec4<u32>(16u * k);
        r |= vec4<u32>(table_bytes[i.x], table_bytes[i.y], table_bytes[i.z], table_bytes[i.w]);
    }
    return r;
}
// A Q4_0-like run of 32 (low nibbles run r, high nibbles run r + 1).
fn table16_run32(q: vec4<u32>, r: u32) -> f32 {
    return x_run32(table16_bytes(nibbles_lo(q)), table16_bytes(nibbles_hi(q)), r);
}
#endif
#if W_IQ4_NL
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 5u;
    return f16_lo(weight_word(b)) * table16_run32(words4(b + 1u), 2u * u - r0);
}
#endif
// IQ4_XS: a unit is a sub-block of 32 (bytes 16 n .. of block u / 8).
#if W_IQ4_XS
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 34u;
    let d = iq4xs_scale(weight_word(b), weight_word(b + 1u), n);
    return d * table16_run32(words4(b + 2u + 4u * n), 2u * u - r0);
}
#endif
#if W_MXFP4
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + u * 5u;
    return mxfp4_scale(weight_word(b)) * table16_run32(words4(b + 1u), 2u * u - r0);
}
#endif

// The i-quants below 4 bits: a unit is 32 values (the block's 32-value
// group that shares its scale and sign indexes), whose grid entries become
// signed bytes: their codes' values as bytes (below 128 and never 0),
// negated where their sign bits are set, or for IQ1, 8 v + 8 delta (odd,
// within -9 .. 9) against an eighth of the scale.

// Codes 4 h .. 4 h + 3 (h 0 or 1) of an 8-value entry.
fn grid8_codes(entry: u32, h: u32) -> vec4<u32> {
    return (vec4<u32>(entry) >> (8u * h + vec4<u32>(0u, 2u, 4u, 6u))) & vec4<u32>(3u);
}

// Bytes 1 .. 127 of w negated where bits 0 .. 3 of signs are set: (v ^ 0xff)
// + 1 is 256 - v, which carries into no other byte.
fn negate_bytes(w: u32, signs: u32) -> u32 {
    let mask = (((signs & 15u) * 0x00204081u) & 0x01010101u) * 255u;
    return (w ^ mask) + (mask & 0x01010101u);
}

// An IQ2 grid's 8-value entry as signed bytes (two words), `signs` its 8
// sign bits.
fn iq2_bytes(entry: u32, signs: u32) -> vec2<u32> {
    let lo = pack_bytes(bitcast<vec4<i32>>(vec4<u32>(IQ2_VALUES) >> (8u * grid8_codes(entry, 0u))));
    let hi = pack_bytes(bitcast<vec4<i32>>(vec4<u32>(IQ2_VALUES) >> (8u * grid8_codes(entry, 1u))));
    return vec2<u32>(negate_bytes(lo, signs), negate_bytes(hi, signs >> 4u));
}

// IQ2_XS / IQ2_S: a unit's two halves (runs r and r + 1), each with its
// 4-bit scale s (the low and high nibbles of `scales`): d (s + 1/2) / 4.
fn iq2_scaled_halves(head: u32, scales: u32, qa: vec4<u32>, qb: vec4<u32>, r: u32) -> f32 {
    let s = vec2<f32>(small_uint_f32(scales & 15u), small_uint_f32(scales >> 4u)) + 0.5;
    return f16_lo(head) * 0.25 * (s.x * x_run16(qa, r) + s.y * x_run16(qb, r + 1u));
}

#if W_IQ2_XXS
const UNIT_ELEMS: u32 = 32u;
// Entry l of the group whose indexes and aux words are given.
fn iq2xxs_pair(indexes: u32, aux: u32, l: u32) -> vec2<u32> {
    let g = byte_of(indexes, l);
    return iq2_bytes(grid8_entry(GRID[g / 2u], g), iq_signs((aux >> (7u * l)) & 127u));
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = w + (u / 8u) * 17u;
    let indexes = weight_word(b + 1u + (u % 8u) * 2u);
    let aux = weight_word(b + 2u + (u % 8u) * 2u);
    let qa = vec4<u32>(iq2xxs_pair(indexes, aux, 0u), iq2xxs_pair(indexes, aux, 1u));
    let qb = vec4<u32>(iq2xxs_pair(indexes, aux, 2u), iq2xxs_pair(indexes, aux, 3u));
    let db = f16_lo(weight_word(b)) * (small_uint_f32(aux >> 28u) + 0.5) * 0.25;
    return db * x_run32(qa, qb, 2u * u - r0);
}
#endif

#if W_IQ2_XS
const UNIT_ELEMS: u32 = 32u;
// Entry h of the two (9-bit grid index, 7-bit sign index) in word q.
fn iq2xs_pair(q: u32, h: u32) -> vec2<u32> {
    let e = grid8_entry(q, h);
    let g = e & 511u;
    return iq2_bytes(grid8_entry(GRID[g / 2u], g), iq_signs(e >> 9u));
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 19u;
    let q0 = weight_word(b + 1u + 2u * n);
    let q1 = weight_word(b + 2u + 2u * n);
    let qa = vec4<u32>(iq2xs_pair(q0, 0u), iq2xs_pair(q0, 1u));
    let qb = vec4<u32>(iq2xs_pair(q1, 0u), iq2xs_pair(q1, 1u));
    return iq2_scaled_halves(weight_word(b), byte_of(weight_word(b + 17u + n / 4u), n % 4u), qa, qb, 2u * u - r0);
}
#endif

#if W_IQ2_S
const UNIT_ELEMS: u32 = 32u;
// Entry l of the group whose low index bytes, top bits and sign bytes are given.
fn iq2s_pair(low: u32, high: u32, signs: u32, l: u32) -> vec2<u32> {
    let index = byte_of(low, l) | (((high >> (2u * l)) & 3u) << 8u);
    return iq2_bytes(grid8_entry(GRID[index / 2u], index), byte_of(signs, l));
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 21u;
    let low = weight_word(b + 1u + n);
    let signs = weight_word(b + 9u + n);
    let high = byte_of(weight_word(b + 17u + n / 4u), n % 4u);
    let qa = vec4<u32>(iq2s_pair(low, high, signs, 0u), iq2s_pair(low, high, signs, 1u));
    let qb = vec4<u32>(iq2s_pair(low, high, signs, 2u), iq2s_pair(low, high, signs, 3u));
    return iq2_scaled_halves(weight_word(b), byte_of(weight_word(b + 19u + n / 4u), n % 4u), qa, qb, 2u * u - r0);
}
#endif

#if W_IQ3_XXS
const UNIT_ELEMS: u32 = 32u;
// Entries 2 l and 2 l + 1 (of the 8 whose index bytes are in words i0, i1).
fn iq3xxs_pair(i0: u32, i1: u32, aux: u32, l: u32) -> vec2<u32> {
    let indexes = select(i0, i1, l >= 2u);
    let signs = iq_signs((aux >> (7u * l)) & 127u);
    let a = GRID[byte_of(indexes, 2u * (l % 2u))];
    let c = GRID[byte_of(indexes, 2u * (l % 2u) + 1u)];
    return vec2<u32>(negate_bytes(a, signs), negate_bytes(c, signs >> 4u));
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 25u;
    let i0 = weight_word(b + 1u + 2u * n);
    let i1 = weight_word(b + 2u + 2u * n);
    let aux = weight_word(b + 17u + n);
    let qa = vec4<u32>(iq3xxs_pair(i0, i1, aux, 0u), iq3xxs_pair(i0, i1, aux, 1u));
    let qb = vec4<u32>(iq3xxs_pair(i0, i1, aux, 2u), iq3xxs_pair(i0, i1, aux, 3u));
    let db = f16_lo(weight_word(b)) * (small_uint_f32(aux >> 28u) + 0.5) * 0.5;
    return db * x_run32(qa, qb, 2u * u - r0);
}
#endif

#if W_IQ3_S
const UNIT_ELEMS: u32 = 32u;
// Entries 2 l and 2 l + 1 (of the 8 whose low index bytes are in words
// l0, l1 and top bits in `high`), signed by byte l of `signs`.
fn iq3s_pair(l0: u32, l1: u32, high: u32, signs: u32, l: u32) -> vec2<u32> {
    let low = select(l0, l1, l >= 2u);
    let k = 2u * l;
    let a = byte_of(low, k % 4u) | (((high >> k) & 1u) << 8u);
    let c = byte_of(low, k % 4u + 1u) | (((high >> (k + 1u)) & 1u) << 8u);
    let s = byte_of(signs, l);
    return vec2<u32>(negate_bytes(GRID[a], s), negate_bytes(GRID[c], s >> 4u));
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 28u;
    let l0 = weight_word(b + 1u + 2u * n);
    let l1 = weight_word(b + 2u + 2u * n);
    let high = byte_of(weight_word(b + 17u + n / 4u), n % 4u);
    let signs = weight_word(b + 19u + n);
    let qa = vec4<u32>(iq3s_pair(l0, l1, high, signs, 0u), iq3s_pair(l0, l1, high, signs, 1u));
    let qb = vec4<u32>(iq3s_pair(l0, l1, high, signs, 2u), iq3s_pair(l0, l1, high, signs, 3u));
    let s = (byte_of(weight_word(b + 27u), n / 2u) >> (4u * (n % 2u))) & 15u;
    return f16_lo(weight_word(b)) * small_uint_f32(1u + 2u * s) * x_run32(qa, qb, 2u * u - r0);
}
#endif

// IQ1: an entry as the bytes 8 v + 8 delta, v = its code's value (byte c
// of IQ1_VALUES, less one), delta -1/8 where `negative`, else 1/8.
fn iq1_bytes(entry: u32, negative: bool) -> vec2<u32> {
    let lo = bitcast<vec4<i32>>((vec4<u32>(IQ1_VALUES) >> (8u * grid8_codes(entry, 0u))) & vec4<u32>(255u));
    let hi = bitcast<vec4<i32>>((vec4<u32>(IQ1_VALUES) >> (8u * grid8_codes(entry, 1u))) & vec4<u32>(255u));
    // 8 (v + 1) - 7 or - 9.
    let bias = vec4<i32>(select(7, 9, negative));
    return vec2<u32>(pack_bytes(8 * lo - bias), pack_bytes(8 * hi - bias));
}

#if W_IQ1_S
const UNIT_ELEMS: u32 = 32u;
fn iq1s_pair(low: u32, qh: u32, l: u32) -> vec2<u32> {
    let index = byte_of(low, l) | (((qh >> (3u * l)) & 7u) << 8u);
    return iq1_bytes(grid8_entry(GRID[index / 2u], index), (qh & 0x8000u) != 0u);
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 13u;
    let low = weight_word(b + 1u + n);
    let qh = grid8_entry(weight_word(b + 9u + n / 2u), n);
    let qa = vec4<u32>(iq1s_pair(low, qh, 0u), iq1s_pair(low, qh, 1u));
    let qb = vec4<u32>(iq1s_pair(low, qh, 2u), iq1s_pair(low, qh, 3u));
    let dl = f16_lo(weight_word(b)) * small_uint_f32(2u * ((qh >> 12u) & 7u) + 1u);
    return 0.125 * dl * x_run32(qa, qb, 2u * u - r0);
}
#endif

#if W_IQ1_M
const UNIT_ELEMS: u32 = 32u;
// Entry l of the group whose low index bytes are in `low` and nibbles
// (3 top index bits, the sign of delta) in the 16 bits `high`.
fn iq1m_pair(low: u32, high: u32, l: u32) -> vec2<u32> {
    let h = (high >> (4u * l)) & 15u;
    let index = byte_of(low, l) | ((h & 7u) << 8u);
    return iq1_bytes(grid8_entry(GRID[index / 2u], index), (h & 8u) != 0u);
}
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let n = u % 8u;
    let b = w + (u / 8u) * 14u;
    let low = weight_word(b + n);
    let high = grid8_entry(weight_word(b + 8u + n / 2u), n);
    let qa = vec4<u32>(iq1m_pair(low, high, 0u), iq1m_pair(low, high, 1u));
    let qb = vec4<u32>(iq1m_pair(low, high, 2u), iq1m_pair(low, high, 3u));
    let scales01 = weight_word(b + 12u);
    let scales23 = weight_word(b + 13u);
    let top = ((scales01 >> 12u) & 0xfu) | ((scales01 >> 24u) & 0xf0u)
        | ((scales23 >> 4u) & 0xf00u) | ((scales23 >> 16u) & 0xf000u);
    let sc = grid8_entry(select(scales01, scales23, n >= 4u), n / 2u) >> (6u * (n % 2u));
    let d = 0.125 * f16_lo(top);
    let r = 2u * u - r0;
    return d * (small_uint_f32(2u * (sc & 7u) + 1u) * x_run16(qa, r) + small_uint_f32(2u * ((sc >> 3u) & 7u) + 1u) * x_run16(qb, r + 1u));
}
#endif

// Q4_K / Q5_K: the units of UNIT_DOTS (16 nibble bytes: run r in the low
// nibbles, scale 2 j, and run r + 2 in the high ones, scale 2 j + 1).
#if W_Q4_K
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = (w + (u / 8u) * 36u) / 4u;
    return k4_unit(weight_quad(b), weight_quad(b + 1u + u % 8u), vec4<u32>(0u), u, k4_run(u) - r0);
}
#endif
#if W_Q5_K
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let b = (w + (u / 8u) * 44u) / 4u;
    let qh = weight_quad(b + 1u + u % 2u);
    return k4_unit(weight_quad(b), weight_quad(b + 3u + u % 8u), qh, u, k4_run(u) - r0);
}
#endif
// The first run of Q4_K / Q5_K unit u: elements 256 (u / 8) + 64 j + 16 h.
fn k4_run(u: u32) -> u32 {
    return 16u * (u / 8u) + 4u * (u / 2u % 4u) + u % 2u;
}
fn k4_unit(head: vec4<u32>, q: vec4<u32>, qh: vec4<u32>, u: u32, r: u32) -> f32 {
    let j = u / 2u % 4u;
    let lo = nibbles_lo(q) | high_bits(qh, 2u * j, 0x01010101u);
    let hi = nibbles_hi(q) | high_bits(qh, 2u * j + 1u, 0x01010101u);
    let s0 = k4_scale_min(head, 2u * j);
    let s1 = k4_scale_min(head, 2u * j + 1u);
    return f16_lo(head.x) * (s0.x * x_run16(lo, r) + s1.x * x_run16(hi, r + 2u))
        - f16_hi(head.x) * (s0.y * x_sum16(r) + s1.y * x_sum16(r + 2u));
}

// Q6_K: the units of UNIT_DOTS (run r in the low nibbles, scale n, run
// r + 4 in the high ones, scale n + 4; quants less 32 through the run sums).
#if W_Q6_K
const UNIT_ELEMS: u32 = 32u;
fn int8_unit(w: u32, u: u32, r0: u32) -> f32 {
    let r = 16u * (u / 8u) + 8u * (u / 4u % 2u) + u % 4u - r0;
    let half = u / 4u % 2u;
    let v = u % 4u;
    let b = w + (u / 8u) * 53u;
    let ql = words4(b + 16u * half + 4u * v);
    let qh = words4(b + 32u + 8u * half + 4u * (v % 2u));
    let lo = nibbles_lo(ql) | high_bits(qh, 2u * (v / 2u), 0x03030303u);
    let hi = nibbles_hi(ql) | high_bits(qh, 2u * (2u + v / 2u), 0x03030303u);
    let n = 8u * half + v;
    return f16_lo(weight_word(b + 52u)) * (q6_scale(b, n) * (x_run16(lo, r) - 32.0 * x_sum16(r))
        + q6_scale(b, n + 4u) * (x_run16(hi, r + 4u) - 32.0 * x_sum16(r + 4u)));
}
#endif

// Unit u of the rows at words wa and wb.
fn unit_dots(wa: u32, wb: u32, u: u32, r0: u32) -> vec2<f32> {
    return vec2<f32>(int8_unit(wa, u, r0), int8_unit(wb, u, r0));
}
#endif
