//! Every fixture case (tests/fixtures and `WGSPARK_FIXTURES`) on every
//! backend under test: greedy ids identical to transformers', and every
//! logits row within 1e-3 of transformers' float32 logits.

mod common;

use common::fixtures::{Case, cases, replay};
use common::{max_abs_diff, on_each_backend};
use wgspark::sampling::argmax;
use wgspark::{Gpu, Model};

const TOLERANCE: f32 = 1e-3;

/// Compares every row of the case; returns the worst row error, or what
/// went wrong first.
fn run_case(gpu: &Gpu, case: &Case) -> Result<f32, String> {
    let e = &case.expected;
    let model = Model::load(&case.dir, gpu).map_err(|e| e.to_string())?;
    let rows = replay(&model, e).map_err(|e| e.to_string())?;
    let mut worst = 0.0f32;
    for (row, (got, want)) in rows.iter().zip(&e.logits).enumerate() {
        let err = max_abs_diff(got, want);
        worst = worst.max(err);
        if err > TOLERANCE {
            return Err(format!("row {row}: max |logit error| {err:.3e} > {TOLERANCE:e}"));
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
    on_each_backend(|gpu| {
        for case in &cases {
            match run_case(gpu, case) {
                Ok(err) => {
                    eprintln!("{:<28} {:<8?} max |logit error| {err:.2e}", case.name, gpu.info.backend)
                }
                Err(why) => failures.push(format!("{} on {:?}: {why}", case.name, gpu.info.backend)),
            }
        }
    });
    assert!(failures.is_empty(), "{} failing:\n{}", failures.len(), failures.join("\n"));
}
