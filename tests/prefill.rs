//! Chunked prefill is the same computation as token-by-token decoding: for
//! every fixture case, chunk sizes 1, 2, 5 and one longer than the prompt
//! (and 32 and 80 where the prompt is long),
//! and both chunk kernels (GEMM, per-token GEMV), the last prompt
//! position's logits match transformers within 1e-3 and the greedy
//! continuation is the fixture's.

mod common;

use common::fixtures::{cases, exact};
use common::max_abs_diff;
use wgspark::sampling::argmax;
use wgspark::{ChunkMatmul, Model, SessionOptions};

#[test]
fn every_chunk_size_matches_the_fixture() {
    let cases = cases();
    assert!(
        cases.iter().any(|c| c.expected.prompt_ids.len() >= 100),
        "a fixture with a prompt several chunks long exists"
    );
    let mut failures = Vec::new();
    common::on_each_backend(|gpu| {
        for case in &cases {
            let e = &case.expected;
            let model = Model::load(&case.dir, gpu).unwrap();
            let mut chunks = vec![1, 2, 5, e.prompt_ids.len() + 1];
            if e.prompt_ids.len() >= 64 {
                chunks.push(32);
            }
            if e.prompt_ids.len() >= 100 {
                // Chunks of 80, then one shorter than 64: the GEMM's plan
                // for the shorter chunks' class.
                chunks.push(80);
            }
            for (chunk, matmul) in
                chunks.into_iter().flat_map(|c| [(c, ChunkMatmul::Gemm), (c, ChunkMatmul::Gemv)])
            {
                let options = SessionOptions { prefill_chunk: Some(chunk), chunk_matmul: matmul, ..exact() };
                let mut session = model.session(&options).unwrap();
                assert_eq!(session.prefill_chunk(), chunk);
                let mut logits = session.prefill(&e.prompt_ids).unwrap();
                let err = max_abs_diff(&logits, &e.logits[0]);
                let what = format!("{} on {:?}, chunk {chunk} by {matmul:?}", case.name, gpu.info.backend);
                if err > 1e-3 {
                    failures.push(format!("{what}: row 0 max |logit error| {err:.2e}"));
                    continue;
                }
                let mut ids = vec![argmax(&logits)];
                while ids.len() < e.generated_ids.len() {
                    logits = session.step(*ids.last().unwrap(), session.position()).unwrap();
                    ids.push(argmax(&logits));
                }
                if ids != e.generated_ids {
                    failures
                        .push(format!("{what}: continuation {ids:?}, transformers {:?}", e.generated_ids));
                }
            }
        }
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
