// A linear layer's bias and activation, in place, for the vision tower:
//   y[t, i] = act(y[t, i] + bias[i]),  i < n
// act: none; GELU_TANH: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3)))
// (torch's gelu approximate="tanh"); GELU_ERF: 0.5 v (1 + erf(v / sqrt 2))
// (the exact GELU), with erf from Numerical Recipes' Chebyshev fit of erfc
// (fractional error below 1.2e-7).
// Grid: x covers n in workgroups of 64, y = token.

@group(0) @binding(0) var<uniform> p: BiasActParams;
@group(0) @binding(1) var<storage, read> bias: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

#if GELU_ERF
// erf(x) for x >= 0 from Numerical Recipes' erfc Chebyshev fit (fractional
// error below 1.2e-7 everywhere), odd extension for x < 0.
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

fn act(v: f32) -> f32 {
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

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.n) {
        return;
    }
    let at = t * p.n + i;
    y[at] = act(y[at] + bias[i]);
}
