// gemv.wgsl's row reduction with subgroup operations, for adapters whose
// subgroups are exactly THREADS_PER_ROW invocations (one row each).

fn reduce_row(v: f32, l: u32, lane: u32) -> f32 {
    return subgroupAdd(v);
}
