// Shared by every kernel (prepended at pipeline creation).
// bf16 weights are stored two per u32: element 2i in the low half, 2i+1 in
// the high half. A bf16 is the top 16 bits of an f32, so unpacking is a shift.
fn bf16_lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn bf16_hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }
// Element `e` of a packed bf16 array whose word is `w`.
fn bf16_at(w: u32, e: u32) -> f32 { return select(bf16_lo(w), bf16_hi(w), (e & 1u) == 1u); }

// Per submission (the kernels::Step uniform): the first position and the
// number of tokens in flight.
struct Step {
    pos0: u32,
    n_tokens: u32,
    _pad0: u32,
    _pad1: u32,
}
