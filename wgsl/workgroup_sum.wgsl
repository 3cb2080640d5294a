// The sum over a workgroup of WG invocations (the family declares WG) of
// every invocation's v, l its local index. Every invocation calls it (it
// has barriers) and gets the same sum. SUBGROUP_SUM (subgroups of
// SUBGROUP_WIDTH lanes, in order of local index, as the builds that set it
// arrange): each subgroup's sum, then one barrier; otherwise a tree of
// barriers (adapters without subgroups, CPU rasterisers).
#if SUBGROUP_SUM
override SUBGROUP_WIDTH: u32 = 32u;
// One per subgroup: the GEMV's workgroups, the one family that sets
// SUBGROUP_SUM, are at most 512 invocations, in subgroups of at least 4.
var<workgroup> sum_partials: array<f32, 128>;
#else
var<workgroup> sum_partials: array<f32, WG>;
#endif

fn workgroup_sum(v: f32, l: u32) -> f32 {
    // A previous sum may still be being read.
    workgroupBarrier();
#if SUBGROUP_SUM
    let part = subgroupAdd(v);
    if (l % SUBGROUP_WIDTH == 0u) {
        sum_partials[l / SUBGROUP_WIDTH] = part;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < WG / SUBGROUP_WIDTH; i++) {
        total += sum_partials[i];
    }
    return total;
#else
    sum_partials[l] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (l < s) {
            sum_partials[l] += sum_partials[l + s];
        }
        workgroupBarrier();
    }
    return sum_partials[0];
#endif
}
