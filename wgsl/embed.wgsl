// Embedding lookup: x[t, i] = table[tokens[t], i] for i < hidden.
// table: [rows, hidden] in its stored format (bf16, or with WEIGHT_FORMAT
//        any of weights.wgsl's, four values per invocation), one row
//        range of a table that may be split across bindings; tokens
//        outside [first_row, first_row + rows) are left to the dispatch of
//        the part that holds them.
// Grid: x covers hidden (WEIGHT_FORMAT: hidden / 4) in workgroups of 64,
// y = token.

@group(0) @binding(0) var<uniform> p: EmbedParams;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;

fn weight_word(i: u32) -> u32 {
    return table[i];
}

fn weight_quad(q: u32) -> vec4<u32> {
    return words4(4u * q);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let token = tokens[t];
#if WEIGHT_FORMAT
    let i = 4u * gid.x;
#else
    let i = gid.x;
#endif
    if (i >= p.hidden || token < p.first_row || token - p.first_row >= p.rows) {
        return;
    }
#if WEIGHT_FORMAT
    let values = weights4((token - p.first_row) * row_words(p.hidden), i);
    for (var c = 0u; c < 4u; c++) {
        x[t * p.hidden + i + c] = values[c];
    }
#else
    let e = (token - p.first_row) * p.hidden + i;
    x[t * p.hidden + i] = bf16_at(table[e >> 1u], e);
#endif
}
