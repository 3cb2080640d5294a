// Weight formats, decoded in registers (prepended to the families that
// read weight matrices; the family defines `weight_word(i)`, word i of the
// bound weight part). A build with WEIGHT_FORMAT reads one of the formats
// below (W_F16, W_F32, W_Q4_0, ... W_Q6_K) through
//   weights4(row_word, e): elements e .. e + 3 (e % 4 == 0) of the row
//                          whose first word is row_word,
//   BLOCK_ELEMS, BLOCK_WORDS: a row of n elements is n / BLOCK_ELEMS blocks
//                          of BLOCK_WORDS words.
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

#if W_F32
const BLOCK_ELEMS: u32 = 1u;
const BLOCK_WORDS: u32 = 1u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let i = row + e;
    return bitcast<vec4<f32>>(vec4<u32>(weight_word(i), weight_word(i + 1u), weight_word(i + 2u), weight_word(i + 3u)));
}
#endif

#if W_F16
const BLOCK_ELEMS: u32 = 2u;
const BLOCK_WORDS: u32 = 1u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let a = weight_word(row + e / 2u);
    let b = weight_word(row + e / 2u + 1u);
    return vec4<f32>(f16_lo(a), f16_hi(a), f16_lo(b), f16_hi(b));
}
#endif

// Q4_0: [d f16, pad][16 bytes: element j low nibble, j + 16 high]: d (q - 8).
#if W_Q4_0
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 32u) * 5u;
    let j = e % 32u;
    let q = fields4(weight_word(b + 1u + (j % 16u) / 4u), select(0u, 4u, j >= 16u), 15u);
    return f16_lo(weight_word(b)) * (vec4<f32>(q) - 8.0);
}
#endif

// Q4_1: [d f16, m f16][16 bytes as Q4_0]: d q + m.
#if W_Q4_1
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 5u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 32u) * 5u;
    let j = e % 32u;
    let q = fields4(weight_word(b + 1u + (j % 16u) / 4u), select(0u, 4u, j >= 16u), 15u);
    let dm = weight_word(b);
    return f16_lo(dm) * vec4<f32>(q) + f16_hi(dm);
}
#endif

// Q5_0 / Q5_1: [d f16, pad or m f16][qh: bit j is element j's fifth bit]
// [16 bytes as Q4_0]: d (q - 16), or d q + m.
#if W_Q5_0
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 6u;
#endif
#if W_Q5_1
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 6u;
#endif
fn q5_quants(b: u32, j: u32) -> vec4<f32> {
    let low = fields4(weight_word(b + 2u + (j % 16u) / 4u), select(0u, 4u, j >= 16u), 15u);
    let high = (vec4<u32>(weight_word(b + 1u)) >> (vec4<u32>(0u, 1u, 2u, 3u) + j)) & vec4<u32>(1u);
    return vec4<f32>(low | (high << vec4<u32>(4u)));
}
#if W_Q5_0
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 32u) * 6u;
    return f16_lo(weight_word(b)) * (q5_quants(b, e % 32u) - 16.0);
}
#endif
#if W_Q5_1
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 32u) * 6u;
    let dm = weight_word(b);
    return f16_lo(dm) * q5_quants(b, e % 32u) + f16_hi(dm);
}
#endif

// Q8_0: [d f16, pad][32 signed bytes]: d q.
#if W_Q8_0
const BLOCK_ELEMS: u32 = 32u;
const BLOCK_WORDS: u32 = 9u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 32u) * 9u;
    let w = weight_word(b + 1u + (e % 32u) / 4u);
    let q = vec4<i32>(vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u);
    return f16_lo(weight_word(b)) * vec4<f32>(q);
}
#endif

// The 2-bit quants of Q2_K / Q3_K: element e (of 256) is bits 2 (e % 128) / 32
// of byte 32 (e / 128) + e % 32 of the 64 bytes at word `qs`.
fn quants2(qs: u32, e: u32) -> vec4<u32> {
    return fields4(weight_word(qs + (32u * (e / 128u) + e % 32u) / 4u), 2u * ((e % 128u) / 32u), 3u);
}

// Q2_K: [16 scale bytes: low nibble scale, high nibble min, per 16
// elements][64 quant bytes][d f16, dmin f16]: d sc q - dmin m.
#if W_Q2_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 21u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 256u) * 21u;
    let i = e % 256u;
    let sc = block_byte(b, i / 16u);
    let dm = weight_word(b + 20u);
    return f16_lo(dm) * f32(sc & 15u) * vec4<f32>(quants2(b + 4u, i)) - f16_hi(dm) * f32(sc >> 4u);
}
#endif

// Q3_K: [32 bytes hmask: bit e / 32 of byte e % 32 set means no -4]
// [64 quant bytes][12 bytes of sixteen 6-bit scales][d f16, pad]:
// d (sc - 32) (q - 4 (1 - h)).
#if W_Q3_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 28u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 256u) * 28u;
    let i = e % 256u;
    let s = i / 16u;
    let low = (block_byte(b + 24u, s % 8u) >> (4u * (s / 8u))) & 15u;
    let high = (block_byte(b + 26u, s % 4u) >> (2u * (s / 4u))) & 3u;
    let sc = f32(low | (high << 4u)) - 32.0;
    let h = fields4(weight_word(b + (i % 32u) / 4u), i / 32u, 1u);
    let q = vec4<f32>(quants2(b + 8u, i)) - 4.0 * (1.0 - vec4<f32>(h));
    return f16_lo(weight_word(b + 27u)) * sc * q;
}
#endif

// Q4_K / Q5_K: [d f16, dmin f16][12 bytes of eight 6-bit (scale, min)
// pairs, one per 32 elements](Q5_K: [32 bytes qh: bit e / 32 of byte
// e % 32 is the fifth bit])[128 bytes: element e is the low nibble of byte
// 32 (e / 64) + e % 32 when e % 64 < 32, else its high nibble]:
// d sc q - dmin m.
#if W_Q4_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 36u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 256u) * 36u;
    return k4_weights(b, e % 256u, b + 4u, vec4<u32>(0u));
}
#endif
#if W_Q5_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 44u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 256u) * 44u;
    let i = e % 256u;
    let high = fields4(weight_word(b + 4u + (i % 32u) / 4u), i / 32u, 1u);
    return k4_weights(b, i, b + 12u, high << vec4<u32>(4u));
}
#endif
// Elements i .. i + 3 of the Q4_K / Q5_K block at word b, whose 128 nibble
// bytes start at word qs; `high` adds Q5_K's fifth bits.
fn k4_weights(b: u32, i: u32, qs: u32, high: vec4<u32>) -> vec4<f32> {
    let j = i / 32u;
    var sc: u32;
    var m: u32;
    if (j < 4u) {
        sc = block_byte(b + 1u, j) & 63u;
        m = block_byte(b + 1u, j + 4u) & 63u;
    } else {
        sc = (block_byte(b + 1u, j + 4u) & 15u) | ((block_byte(b + 1u, j - 4u) >> 6u) << 4u);
        m = (block_byte(b + 1u, j + 4u) >> 4u) | ((block_byte(b + 1u, j) >> 6u) << 4u);
    }
    let low = fields4(weight_word(qs + (32u * (i / 64u) + i % 32u) / 4u), select(0u, 4u, i % 64u >= 32u), 15u);
    let dm = weight_word(b);
    return f16_lo(dm) * f32(sc) * vec4<f32>(low | high) - f16_hi(dm) * f32(m);
}

// Q6_K: [128 bytes: low 4 bits][64 bytes: high 2 bits][16 signed scales,
// one per 16 elements][d f16, pad]: d sc (q - 32).
#if W_Q6_K
const BLOCK_ELEMS: u32 = 256u;
const BLOCK_WORDS: u32 = 53u;
fn weights4(row: u32, e: u32) -> vec4<f32> {
    let b = row + (e / 256u) * 53u;
    let i = e % 256u;
    let half = i / 128u;
    let r = i % 128u;
    let low = fields4(weight_word(b + (64u * half + r % 64u) / 4u), select(0u, 4u, r >= 64u), 15u);
    let high = fields4(weight_word(b + 32u + (32u * half + r % 32u) / 4u), 2u * (r / 32u), 3u);
    let s = i / 16u;
    let sc = f32((i32(weight_word(b + 48u + s / 4u)) << (24u - 8u * (s % 4u))) >> 24u);
    let q = vec4<f32>(low | (high << vec4<u32>(4u))) - 32.0;
    return f16_lo(weight_word(b + 52u)) * sc * q;
}
#endif
