// Router top-k: from router logits [tokens, n_experts] to the k selected
// experts of each token, ids [tokens, k] (u32) and weights [tokens, k] (f32),
// in descending order of the selection score.
// scoring 0 (softmax): p = softmax(logits); select the k largest p; weights
//   p, divided by their sum when renormalize.
// scoring 1 (sigmoid with bias): s = sigmoid(logits); select the k largest
//   s + bias; weights s / sum of the selected s.
// Ties go to the lower expert id. One workgroup per token (wid.y): with
// SUBGROUPS exactly one subgroup, whose reductions are subgroup operations
// (a top-8 of 128 experts was some 60 barriers otherwise).

override WG: u32 = 64u;
const MAX_EXPERTS: u32 = 512u;

@group(0) @binding(0) var<uniform> p: RouterParams;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> weights: array<f32>;

var<workgroup> weight_of: array<f32, MAX_EXPERTS>;
var<workgroup> choice_of: array<f32, MAX_EXPERTS>;
var<workgroup> best_value: array<f32, WG>;
var<workgroup> best_index: array<u32, WG>;
var<workgroup> picked: array<f32, 16>;

#if SUBGROUPS
fn token_max(v: f32, l: u32) -> f32 {
    return subgroupMax(v);
}

fn token_sum(v: f32, l: u32) -> f32 {
    return subgroupAdd(v);
}

// The largest value of the invocations' (value, index) pairs, the lowest
// index among equals.
fn token_best(v: f32, i: u32, l: u32) -> u32 {
    let top = subgroupMax(v);
    return subgroupMin(select(0xffffffffu, i, v == top));
}
#else
fn token_max(v: f32, l: u32) -> f32 {
    best_value[l] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (l < s) {
            best_value[l] = max(best_value[l], best_value[l + s]);
        }
        workgroupBarrier();
    }
    let m = best_value[0];
    workgroupBarrier();
    return m;
}

fn token_sum(v: f32, l: u32) -> f32 {
    best_value[l] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (l < s) {
            best_value[l] += best_value[l + s];
        }
        workgroupBarrier();
    }
    let total = best_value[0];
    workgroupBarrier();
    return total;
}

fn token_best(v: f32, i: u32, l: u32) -> u32 {
    best_value[l] = v;
    best_index[l] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (l < s) {
            let ov = best_value[l + s];
            let oi = best_index[l + s];
            if (ov > best_value[l] || (ov == best_value[l] && oi < best_index[l])) {
                best_value[l] = ov;
                best_index[l] = oi;
            }
        }
        workgroupBarrier();
    }
    let best = best_index[0];
    workgroupBarrier();
    return best;
}
#endif

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let t = wid.y;
    let l = lid.x;
    let n = p.n_experts;
    let base = t * n;

    // Scores. Softmax needs the max and the sum over all experts.
    var local_max = -3.0e38;
    for (var e = l; e < n; e += WG) {
        local_max = max(local_max, logits[base + e]);
    }
    let max_logit = token_max(local_max, l);
    var local_sum = 0.0;
    for (var e = l; e < n; e += WG) {
        let z = logits[base + e];
        if (p.scoring == 0u) {
            let v = exp(z - max_logit);
            weight_of[e] = v;
            local_sum += v;
        } else {
            let s = 1.0 / (1.0 + exp(-z));
            weight_of[e] = s;
            choice_of[e] = s + bias[e];
        }
    }
    let total = token_sum(local_sum, l);
    if (p.scoring == 0u) {
        for (var e = l; e < n; e += WG) {
            weight_of[e] = weight_of[e] / total;
            choice_of[e] = weight_of[e];
        }
    }
    workgroupBarrier();

    // k rounds of argmax; a taken expert's choice is set below any score.
    for (var j = 0u; j < p.top_k; j++) {
        var v = -3.0e38;
        var idx = 0xffffffffu;
        for (var e = l; e < n; e += WG) {
            let c = choice_of[e];
            if (c > v) {
                v = c;
                idx = e;
            }
        }
        let best = token_best(v, idx, l);
        if (l == 0u) {
            // No expert beats -3e38 only when the scores are not numbers:
            // its weight is then NaN, so that the layer's output (and the
            // logits, where the sampler reports it) says so.
            let e = best;
            ids[t * p.top_k + j] = e;
            if (e < n) {
                picked[j] = weight_of[e];
                choice_of[e] = -3.4e38;
            } else {
                picked[j] = bitcast<f32>(0x7fc00000u);
            }
        }
        workgroupBarrier();
    }

    if (l == 0u) {
        var sum = 0.0;
        for (var j = 0u; j < p.top_k; j++) {
            sum += picked[j];
        }
        let norm = select(1.0, sum, p.renormalize != 0u);
        for (var j = 0u; j < p.top_k; j++) {
            weights[t * p.top_k + j] = picked[j] / norm;
        }
    }
}
