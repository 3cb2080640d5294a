// Embedding lookup: x[t, i] = table[tokens[t], i] for i < hidden.
// table: bf16 [rows, hidden], one row range of a table that may be split
//        across bindings; tokens outside [first_row, first_row + rows) are
//        left to the dispatch of the part that holds them.
// Grid: x covers hidden in workgroups of 64, y = token.

@group(0) @binding(0) var<uniform> p: EmbedParams;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    let token = tokens[t];
    if (i >= p.hidden || token < p.first_row || token - p.first_row >= p.rows) {
        return;
    }
    let e = (token - p.first_row) * p.hidden + i;
    x[t * p.hidden + i] = bf16_at(table[e >> 1u], e);
}
