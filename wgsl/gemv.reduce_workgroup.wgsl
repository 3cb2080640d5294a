// gemv.wgsl's row reduction without subgroups: through workgroup memory.
// Every invocation must call it (it has barriers).

var<workgroup> partial: array<f32, WG>;

fn reduce_row(v: f32, l: u32, lane: u32) -> f32 {
    if (THREADS_PER_ROW == 1u) {
        return v;
    }
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
