//! Every fixture case (tests/fixtures and `WGSPARK_FIXTURES`) on every
//! backend under test: greedy ids identical to transformers', and every
//! logits row within 1e-3 of transformers' float32 logits with an f32 KV
//! cache and (on cooperative matrices) prompt chunks multiplied in two f16
//! parts, and with the defaults, an f16 cache and chunks in one f16 part,
//! within 0.4% of the row's largest |logit| (what rounding K, V and the
//! chunks' activations to 11 significant bits costs; the errors are printed).

mod common;

use common::fixtures::{Case, cases, exact, replay_with};
use common::{max_abs_diff, on_each_backend};
use wgspark::sampling::argmax;
use wgspark::{Gpu, Model, PrefillPrecision, SessionOptions};

/// (name, options, absolute tolerance, tolerance relative to the row's
/// largest |logit|): the larger applies. The exact configuration's bound is
/// 1e-3 unless the case sets its own. On cooperative matrices also the
/// f32 cache with chunks in one f16 part, so that the printed errors tell
/// the two roundings apart.
fn configurations(gpu: &Gpu, case: &Case) -> Vec<(&'static str, SessionOptions, f32, f32)> {
    let exact_bound = case.expected.exact_tolerance.unwrap_or(1e-3);
    let mut out =
        vec![("exact", exact(), exact_bound, 0.0), ("default", SessionOptions::default(), 0.0, 4e-3)];
    if gpu.caps.cooperative_matrix {
        let f16_chunks = SessionOptions { prefill_precision: PrefillPrecision::F16, ..exact() };
        out.push(("f16 chunks", f16_chunks, 0.0, 4e-3));
    }
    out
}

/// Compares every row of the case; returns the worst row error, or what
/// went wrong first.
fn run_case(
    model: &Model,
    case: &Case,
    options: &SessionOptions,
    (abs, rel): (f32, f32),
) -> Result<f32, String> {
    let e = &case.expected;
    let rows = replay_with(model, e, options).map_err(|e| e.to_string())?;
    let mut worst = 0.0f32;
    for (row, (got, want)) in rows.iter().zip(&e.logits).enumerate() {
        let tolerance = abs.max(rel * want.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        let err = max_abs_diff(got, want);
        worst = worst.max(err);
        if err > tolerance {
            return Err(format!("row {row}: max |logit error| {err:.3e} > {tolerance:e}"));
        }
        let id = argmax(got);
        if id != e.generated_ids[row] {
            return Err(format!("row {row}: greedy id {id}, transformers {}", e.generated_ids[row]));
        }
    }
    Ok(worst)
}

#[test]
fn fixtures_match_transformers() {
    let cases = cases();
    let mut failures = Vec::new();
    on_each_backend(|gpu: &Gpu| {
        for case in &cases {
            let model = match Model::load(&case.dir, gpu) {
                Ok(m) => m,
                Err(e) => {
                    failures.push(format!("{} on {:?}: {e}", case.name, gpu.info.backend));
                    continue;
                }
            };
            let mut line = format!("{:<28} {:<8?}", case.name, gpu.info.backend);
            for (name, options, abs, rel) in configurations(gpu, case) {
                match run_case(&model, case, &options, (abs, rel)) {
                    Ok(err) => line.push_str(&format!(" {name}: max |logit error| {err:.2e}")),
                    Err(why) => {
                        failures.push(format!("{} on {:?}, {name}: {why}", case.name, gpu.info.backend))
                    }
                }
            }
            eprintln!("{line}");
        }
    });
    assert!(failures.is_empty(), "{} failing:\n{}", failures.len(), failures.join("\n"));
}
