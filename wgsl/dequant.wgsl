// A weight part in any format of weights.wgsl (WEIGHT_FORMAT) written out
// as f16, row-major, rows of cols values: the cooperative-matrix GEMM's
// quantized products over many tokens read it as they read bf16 rows
// (gemm_coop.wgsl's W_COPY), rather than each tile of tokens decoding the
// same weights again in its inner loop.
//   out[row * cols + k] = f16(decode(weight row `row`, element k))
// Values decode as gemm_coop.wgsl stages them (load8 / decode8), so a
// product over the copy multiplies the same f16 values as one that decodes
// in its tiles. F16_NATIVE: pack2x16float rounds them.
// Needs cols % 8 == 0. Grid: runs of eight values, 256 a workgroup,
// folded over x and z.

@group(0) @binding(0) var<uniform> p: DequantParams;
@group(0) @binding(1) var<storage, read> weight: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<u32>>;

fn weight_word(i: u32) -> u32 {
    return weight[i];
}

fn weight_quad(q: u32) -> vec4<u32> {
    return words4(4u * q);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) l: u32,
) {
    let run = (wid.x + wid.z * nwg.x) * 256u + l;
    let runs_per_row = p.cols / 8u;
    if (run >= p.rows * runs_per_row) {
        return;
    }
    let row = run / runs_per_row;
    let k = 8u * (run % runs_per_row);
    let w = decode8(load8(row * row_words(p.cols), k, p.cols), k);
    out[run] = vec4<u32>(
        pack2x16float(w[0].xy),
        pack2x16float(w[0].zw),
        pack2x16float(w[1].xy),
        pack2x16float(w[1].zw),
    );
}
