// Groups a chunk's (token, slot) pairs by the expert the router chose for
// them, on the GPU, for the grouped GEMMs (gemm.wgsl's grouped mode):
//   ids[idx]: the expert of pair idx = token * top_k + slot
//   groups[2e], groups[2e + 1]: offset and count of expert e's pairs
//   pairs[groups[2e] ..]: its pair indices, in increasing order
// Ids of n_experts or more (pairs whose expert is elsewhere) are left out.
// One workgroup: a histogram, a scan, then the pairs placed in blocks of
// 256 in order, each at its expert's cursor plus its rank among the
// block's pairs of that expert (so the order does not depend on timing).

const WG: u32 = 256u;
const MAX_EXPERTS: u32 = 512u;
const NONE: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> p: GroupParams;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> groups: array<u32>;
@group(0) @binding(4) var<storage, read_write> pairs: array<u32>;

var<workgroup> counts: array<atomic<u32>, MAX_EXPERTS>;
// Where expert e's next pair goes.
var<workgroup> cursor: array<u32, MAX_EXPERTS>;
var<workgroup> block: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    let n_pairs = step.n_tokens * p.top_k;
    for (var e = li; e < p.n_experts; e += WG) {
        atomicStore(&counts[e], 0u);
    }
    workgroupBarrier();
    for (var i = li; i < n_pairs; i += WG) {
        let e = ids[i];
        if (e < p.n_experts) {
            atomicAdd(&counts[e], 1u);
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        var offset = 0u;
        for (var e = 0u; e < p.n_experts; e++) {
            let count = atomicLoad(&counts[e]);
            groups[2u * e] = offset;
            groups[2u * e + 1u] = count;
            cursor[e] = offset;
            offset += count;
        }
    }
    workgroupBarrier();
    for (var base = 0u; base < n_pairs; base += WG) {
        let i = base + li;
        var e = NONE;
        if (i < n_pairs && ids[i] < p.n_experts) {
            e = ids[i];
        }
        block[li] = e;
        workgroupBarrier();
        var before = 0u;
        var after = 0u;
        for (var j = 0u; j < WG; j++) {
            let same = u32(block[j] == e);
            before += select(0u, same, j < li);
            after += select(0u, same, j > li);
        }
        if (e != NONE) {
            pairs[cursor[e] + before] = i;
        }
        workgroupBarrier();
        // The block's last pair of each expert moves its cursor.
        if (e != NONE && after == 0u) {
            cursor[e] += before + 1u;
        }
        workgroupBarrier();
    }
}
