// Shared by every kernel (prepended at pipeline creation, after the
// parameter structs that kernels/*.rs declare with wgsl_struct!).
// bf16 weights are stored two per u32: element 2i in the low half, 2i+1 in
// the high half. A bf16 is the top 16 bits of an f32, so unpacking is a shift.
fn bf16_lo(w: u32) -> f32 { return bitcast<f32>(w << 16u); }
fn bf16_hi(w: u32) -> f32 { return bitcast<f32>(w & 0xffff0000u); }
// Element `e` of a packed bf16 array whose word is `w`.
fn bf16_at(w: u32, e: u32) -> f32 { return select(bf16_lo(w), bf16_hi(w), (e & 1u) == 1u); }
// Elements 0..3 and 4..7 of eight packed bf16 values.
fn bf16x4_lo(w: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
}
fn bf16x4_hi(w: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w));
}
// The SwiGLU gate of a gate and an up projection: silu(gate) * up,
// silu(g) = g * sigmoid(g).
fn swiglu(gate: f32, up: f32) -> f32 { return gate / (1.0 + exp(-gate)) * up; }
// The activation after a linear layer's bias (bias_act, and the GEMMs'
// BIAS epilogue): none; GELU_TANH: 0.5 v (1 + tanh(sqrt(2 / pi) (v +
// 0.044715 v^3))) (torch's gelu approximate="tanh"); GELU_ERF: 0.5 v (1 +
// erf(v / sqrt 2)) (the exact GELU), with erf from Numerical Recipes'
// Chebyshev fit of erfc (fractional error below 1.2e-7 everywhere), odd
// extension for v < 0.
#if GELU_ERF
fn erf(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
        t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
        t * (-0.82215223 + t * 0.17087277))))))));
    let erfc = t * exp(poly);
    return select(erfc - 1.0, 1.0 - erfc, x >= 0.0);
}
#endif
fn activate(v: f32) -> f32 {
#if GELU_TANH
    // Clamped: tanh is 1 in f32 well before 10, and some backends compute
    // it as a ratio of exponentials that overflows to NaN.
    let inner = clamp(0.7978845608028654 * (v + 0.044715 * v * v * v), -10.0, 10.0);
    return 0.5 * v * (1.0 + tanh(inner));
#else
#if GELU_ERF
    return 0.5 * v * (1.0 + erf(v * 0.7071067811865476));
#else
    return v;
#endif
#endif
}
// An f16 (the low 16 bits of h) widened in integer arithmetic, exactly,
// subnormals, inf and NaN included: for adapters whose shaders lack
// unpack2x16float.
fn f16_bits_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        return bitcast<f32>(sign | bitcast<u32>(f32(m) * 5.9604645e-8));
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// The end of a decoder layer (DESIGN.md section 7), fused into whichever
// kernel does the layer's last residual add (gemv ADD, residual):
//   STEER:   a control vector's row is added to every token; with
//            STEER_ROWS, token t adds row steer_slots[t] of a table of rows
//            (a ragged batch's sequences, each steered its own way; row 0
//            of the table is zeros);
//   CAPTURE: the last min(n_tokens, CAPTURE_ROWS) tokens' results are
//            copied to the capture region, row (t - first) * n.
#if STEER
@group(0) @binding(10) var<storage, read> steer_row: array<f32>;
#endif
#if STEER_ROWS
@group(0) @binding(13) var<storage, read> steer_slots: array<u32>;
#endif
#if CAPTURE
override CAPTURE_ROWS: u32 = 1u;
@group(0) @binding(11) var<storage, read_write> capture: array<f32>;
@group(0) @binding(12) var<uniform> capture_step: Step;
#endif

// Element i (of n) of token t at the layer's output, whose residual sum is v.
fn layer_output(t: u32, i: u32, n: u32, v: f32) -> f32 {
    var out = v;
#if STEER_ROWS
    out += steer_row[steer_slots[t] * n + i];
#else
#if STEER
    out += steer_row[i];
#endif
#endif
#if CAPTURE
    let count = min(capture_step.n_tokens, CAPTURE_ROWS);
    let first = capture_step.n_tokens - count;
    if (t >= first) {
        capture[(t - first) * n + i] = out;
    }
#endif
    return out;
}
