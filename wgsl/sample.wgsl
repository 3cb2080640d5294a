// Token selection on the GPU, writing the chosen id to tokens[0], where
// the next decode step's embedding reads it.
//   greedy:  the highest logit, the lowest id on ties.
//   RANDOM:  a draw from softmax(logits / temperature) by the Gumbel-max
//            trick: argmax_i (l_i / T + G_i), G_i = -log(-log(u_i)), u_i a
//            hash of (seed, position of the token drawn, i): reproducible for
//            a seed on a backend, independent across positions.
//   FILTER:  only candidates whose logit is at least the threshold that
//            `threshold` found: the k-th largest logit (top_k > 0), then
//            the smallest logit of the shortest run from the top whose
//            probability reaches top_p (top_p < 1), the probabilities being
//            those of the tempered softmax over the top-k candidates.
//            Tokens tied with the threshold are all kept.
// Entry points: `threshold` (one workgroup, FILTER), `partial` (one
// workgroup per PER_WG logits: the best of its block), `finish` (one
// workgroup: the best of the partials, into tokens[0]).
// ROWS (with RANDOM and FILTER): one logits row per grid row y of each
// entry point, chosen as rows[y] says (temperature 0: greedy; top_k 0 and
// top_p 1: no cut; the position that keys its noise), into tokens[y]: the
// rows of a ragged batch, each sampled as a lone sequence with the same
// parameters would be.
// Logits are compared as order-preserving u32 keys (NaN lowest).
// Any logit that is NaN or infinite makes the id NON_FINITE instead: the
// activations have failed, and the host reports it.
// threshold's radix selection: 4 rounds of 8 bits, histograms of counts
// (top-k) or of probability in 2^-31 units (top-p) in workgroup atomics.

const WG: u32 = 256u;
const PER_WG: u32 = 1024u;
const NEG_INF: f32 = -3.4028235e38;
const MAX_F32: f32 = 3.4028235e38;
// The id written when a logit is not finite (kernels::sample::NON_FINITE).
const NON_FINITE: u32 = 0xfffffffeu;

@group(0) @binding(0) var<uniform> p: SampleParams;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> logits: array<f32>;
// (score bits, id) of each partial block.
@group(0) @binding(3) var<storage, read_write> partials: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> tokens: array<u32>;
// The smallest key a candidate may have (FILTER), written by `threshold`.
@group(0) @binding(5) var<storage, read_write> candidate_floor: array<u32>;
#if ROWS
@group(0) @binding(6) var<storage, read> rows: array<RowSampling>;
#endif

// How row r of the logits is chosen: the build's parameters, or with ROWS
// the row's own.
fn temperature(r: u32) -> f32 {
#if ROWS
    return rows[r].temperature;
#else
    return p.temperature;
#endif
}

fn top_k(r: u32) -> u32 {
#if ROWS
    return rows[r].top_k;
#else
    return p.top_k;
#endif
}

fn top_p(r: u32) -> f32 {
#if ROWS
    return rows[r].top_p;
#else
    return p.top_p;
#endif
}

fn seed(r: u32) -> vec2<u32> {
#if ROWS
    return vec2<u32>(rows[r].seed_lo, rows[r].seed_hi);
#else
    return vec2<u32>(p.seed_lo, p.seed_hi);
#endif
}

fn key(l: f32) -> u32 {
    if (l != l) {
        return 0u;
    }
    let b = bitcast<u32>(l);
    return select(b | 0x80000000u, ~b, (b >> 31u) == 1u);
}

fn mix(h0: u32) -> u32 {
    var h = h0;
    h ^= h >> 16u;
    h *= 0x7feb352du;
    h ^= h >> 15u;
    h *= 0x846ca68bu;
    h ^= h >> 16u;
    return h;
}

// Gumbel noise for candidate i of the token drawn at `pos` with `seed`.
fn gumbel(i: u32, pos: u32, seed: vec2<u32>) -> f32 {
    let h = mix(i ^ mix(pos ^ mix(seed.x ^ mix(seed.y + 0x9e3779b9u))));
    let u = (f32(h >> 8u) + 0.5) / 16777216.0;
    return -log(-log(u));
}

var<workgroup> best_score: array<f32, WG>;
var<workgroup> best_id: array<u32, WG>;
// Set when a logit (partial) or a block (finish) is not finite.
var<workgroup> non_finite: atomic<u32>;

// Reduces (best_score, best_id) over the workgroup into slot 0: higher
// score wins, then the lower id.
fn reduce_best(l: u32) {
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if (l < s) {
            let os = best_score[l + s];
            let oi = best_id[l + s];
            if (os > best_score[l] || (os == best_score[l] && oi < best_id[l])) {
                best_score[l] = os;
                best_id[l] = oi;
            }
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let r = wid.y;
    let base = r * p.vocab;
#if ROWS
    let pos = rows[r].pos;
    // A greedy row's score is its logit.
    let random = rows[r].temperature > 0.0;
#else
    let pos = step.pos0 + step.n_tokens;
    let random = true;
#endif
#if FILTER
    let floor_key = candidate_floor[r];
#endif
    if (l == 0u) {
        atomicStore(&non_finite, 0u);
    }
    workgroupBarrier();
    var bs = NEG_INF;
    var bi = 0xffffffffu;
    for (var c = 0u; c < PER_WG / WG; c++) {
        let i = wid.x * PER_WG + c * WG + l;
        if (i < p.vocab) {
            let logit = logits[base + i];
            if (!(abs(logit) <= MAX_F32)) {
                atomicOr(&non_finite, 1u);
            }
#if FILTER
            if (key(logit) < floor_key) {
                continue;
            }
#endif
#if RANDOM
            let s = select(logit, logit / temperature(r) + gumbel(i, pos, seed(r)), random);
#else
            let s = logit;
#endif
            // Ids rise with c: a tie keeps the first.
            if (s > bs) {
                bs = s;
                bi = i;
            }
        }
    }
    best_score[l] = bs;
    best_id[l] = bi;
    reduce_best(l);
    if (l == 0u) {
        let id = select(best_id[0], NON_FINITE, atomicLoad(&non_finite) != 0u);
        partials[r * ((p.vocab + PER_WG - 1u) / PER_WG) + wid.x] = vec2<u32>(bitcast<u32>(best_score[0]), id);
    }
}

@compute @workgroup_size(WG)
fn finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let r = wid.y;
    if (l == 0u) {
        atomicStore(&non_finite, 0u);
    }
    workgroupBarrier();
    var bs = NEG_INF;
    var bi = 0xffffffffu;
    let n = (p.vocab + PER_WG - 1u) / PER_WG;
    for (var i = l; i < n; i += WG) {
        let s = bitcast<f32>(partials[r * n + i].x);
        let id = partials[r * n + i].y;
        if (id == NON_FINITE) {
            atomicOr(&non_finite, 1u);
            continue;
        }
        if (s > bs || (s == bs && id < bi)) {
            bs = s;
            bi = id;
        }
    }
    best_score[l] = bs;
    best_id[l] = bi;
    reduce_best(l);
    if (l == 0u) {
        // No candidate beat -inf (every one filtered out): id 0, as the
        // CPU sampler.
        let id = select(best_id[0], 0u, best_id[0] == 0xffffffffu);
        tokens[r] = select(id, NON_FINITE, atomicLoad(&non_finite) != 0u);
    }
}

var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> chosen: u32;
var<workgroup> carried: u32;
var<workgroup> red: array<f32, WG>;

// The max (`take_max`) or the sum of every invocation's v (all must call it).
fn reduce(v: f32, l: u32, take_max: bool) -> f32 {
    workgroupBarrier();
    red[l] = v;
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if (l < s) {
            red[l] = select(red[l] + red[l + s], max(red[l], red[l + s]), take_max);
        }
    }
    workgroupBarrier();
    return red[0];
}

// One round of radix selection: among candidates (key >= floor_key) whose
// key matches `prefix` in the bits above `shift + 8`, histograms the next
// 8 bits at `shift` by count, or (`by_mass`) by probability
// exp((l - m) / T) / z in units of 2^-31; then picks, from the top bin
// down, the bin where `carried` plus the bins above reach `goal`, and adds
// the bins above it to `carried`. Returns the extended prefix.
fn radix_round(l: u32, r: u32, prefix: u32, shift: u32, floor_key: u32, m: f32, z: f32, by_mass: bool, goal: u32) -> u32 {
    let base = r * p.vocab;
    // Bits above shift + 8 (none in the first round, where 2 << 31 wraps to 0).
    let mask = ~((2u << (shift + 7u)) - 1u);
    atomicStore(&hist[l], 0u);
    workgroupBarrier();
    for (var i = l; i < p.vocab; i += WG) {
        let logit = logits[base + i];
        let k = key(logit);
        if (k >= floor_key && (k & mask) == prefix) {
            var add = 1u;
            if (by_mass) {
                add = u32(exp((logit - m) / temperature(r)) / z * 2147483648.0);
            }
            atomicAdd(&hist[(k >> shift) & 255u], add);
        }
    }
    workgroupBarrier();
    if (l == 0u) {
        var sum = carried;
        var pick = 0u;
        var found = false;
        for (var b = 255i; b >= 0i; b--) {
            let c = atomicLoad(&hist[u32(b)]);
            if (c > 0u) {
                // Ends as the lowest non-empty bin if the goal is never reached.
                pick = u32(b);
                if (sum + c >= goal) {
                    found = true;
                    break;
                }
                sum += c;
            }
        }
        if (!found) {
            // Rounding of the masses fell short of the goal: take the lowest
            // non-empty bin (every candidate stays in).
            sum = carried;
            for (var b = 255i; b > i32(pick); b--) {
                sum += atomicLoad(&hist[u32(b)]);
            }
        }
        chosen = pick;
        carried = sum;
    }
    workgroupBarrier();
    return prefix | (chosen << shift);
}

@compute @workgroup_size(WG)
fn threshold(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let r = wid.y;
    let base = r * p.vocab;
    var floor_key = 0u;
    if (top_k(r) > 0u && top_k(r) < p.vocab) {
        if (l == 0u) {
            carried = 0u;
        }
        var prefix = 0u;
        for (var shift = 24i; shift >= 0i; shift -= 8i) {
            prefix = radix_round(l, r, prefix, u32(shift), 0u, 0.0, 1.0, false, top_k(r));
        }
        floor_key = prefix;
    }
    if (top_p(r) < 1.0) {
        var m = NEG_INF;
        for (var i = l; i < p.vocab; i += WG) {
            let logit = logits[base + i];
            if (key(logit) >= floor_key) {
                m = max(m, logit);
            }
        }
        m = reduce(m, l, true);
        var z = 0.0;
        for (var i = l; i < p.vocab; i += WG) {
            let logit = logits[base + i];
            if (key(logit) >= floor_key) {
                z += exp((logit - m) / temperature(r));
            }
        }
        z = reduce(z, l, false);
        if (l == 0u) {
            carried = 0u;
        }
        let goal = u32(top_p(r) * 2147483648.0);
        var prefix = 0u;
        for (var shift = 24i; shift >= 0i; shift -= 8i) {
            prefix = radix_round(l, r, prefix, u32(shift), floor_key, m, z, true, goal);
        }
        floor_key = max(floor_key, prefix);
    }
    if (l == 0u) {
        candidate_floor[r] = floor_key;
    }
}
