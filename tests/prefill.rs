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

/// On cooperative matrices in f16 (the default where a GPU has them), a
/// chunk long enough for the products that read f16 copies of their
/// activations (`kernels::gemm::HalfCopies`: the q/k/v, gate/up and down
/// projections of a model 2048 wide, at least 128 tiles of 128 tokens x 256
/// rows each, which the tile rule is checked to take) gives the last
/// position's logits of the f32 GEMV run token by
/// token, within the bound the conformance suite holds f16 prefill to (0.4
/// % of the row's largest logit), and those of the same chunk with split
/// operands (no copies); so does a chunk of 512, whose o and down
/// projections read their copies (the attention's and the SwiGLU's) as
/// partial sums over k (`Gemm::plan_summed`) that the residual adds sum. Runs where the adapter has cooperative matrices
/// (CPU rasterisers have none, and the chunk would take minutes there).
#[test]
fn a_long_chunk_reading_f16_copies_matches_the_f32_products() {
    use wgspark::PrefillPrecision;
    use wgspark::kernels::gemm_coop::Tile;
    common::on_each_backend(|gpu| {
        if !gpu.caps.cooperative_matrix {
            return;
        }
        let model = common::wide_model(gpu, 7);
        let long: Vec<u32> = (0..2048u32).map(|i| (i * 7919 + 13) % 1024).collect();
        // q/k/v, gate/up and down (bf16 weights: no format flags).
        for rows in [3072, 4096, 2048] {
            let tile = Tile::reads_f16(rows, 2048, long.len(), &[], gpu.caps.multiprocessors);
            assert!(tile.is_some(), "{rows} x 2048 over {} tokens reads f16 copies", long.len());
        }
        assert_eq!(Tile::k_splits(2048, 2048, 512, &[]), 4, "the o and down projections of 512 tokens");
        for prompt in [&long[..], &long[..512]] {
            let logits = |chunk_matmul, prefill_precision| {
                let options = SessionOptions {
                    prefill_chunk: Some(prompt.len()),
                    chunk_matmul,
                    prefill_precision,
                    ..SessionOptions::default()
                };
                model.session(&options).unwrap().prefill(prompt).unwrap()
            };
            let copies = logits(ChunkMatmul::Gemm, PrefillPrecision::F16);
            let largest = copies.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(largest > 0.0 && copies.iter().all(|v| v.is_finite()));
            for (reference, name) in [
                (logits(ChunkMatmul::Gemv, PrefillPrecision::F16), "the f32 GEMV"),
                (logits(ChunkMatmul::Gemm, PrefillPrecision::Split), "split operands"),
            ] {
                let err = max_abs_diff(&copies, &reference);
                let what = format!(
                    "{} tokens against {name}: {err:.3e} of a largest logit {largest:.3e}",
                    prompt.len()
                );
                assert!(err <= 4e-3 * largest, "{what}");
                eprintln!("f16 copies, {what}");
            }
        }
    });
}

/// On cooperative matrices, chunks of few tokens (a batch step's) run the
/// products whose tiles leave the GPU short of workgroups in ranges of k
/// (`gemm_coop::Tile::few_tokens`, checked to split each here): the q/k/v
/// and gate/up summed by `split_sum` (the gate/up through its SwiGLU), the
/// o and down projections by their residual adds. The last position's
/// logits match the f32 GEMV run token by token within the bound the
/// conformance suite holds f16 prefill to (0.4 % of the row's largest
/// logit). Runs where the adapter has cooperative matrices.
#[test]
fn few_token_chunks_in_ranges_of_k_match_the_f32_products() {
    use wgspark::kernels::gemm_coop::{MAX_FEW_TOKEN_K_SPLITS, Tile};
    common::on_each_backend(|gpu| {
        if !gpu.caps.cooperative_matrix {
            return;
        }
        let model = common::wide_model(gpu, 11);
        let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 13) % 1024).collect();
        for tokens in [16, 64] {
            // q/k/v, gate/up, o and down (bf16 weights: no format flags).
            for rows in [3072, 4096, 2048] {
                let splits = Tile::few_tokens(rows, 2048, tokens, &[], MAX_FEW_TOKEN_K_SPLITS).map(|f| f.1);
                assert!(splits > Some(1), "{rows} x 2048 over {tokens} tokens splits: {splits:?}");
            }
            let logits = |chunk_matmul| {
                let options =
                    SessionOptions { prefill_chunk: Some(tokens), chunk_matmul, ..SessionOptions::default() };
                model.session(&options).unwrap().prefill(&prompt[..tokens]).unwrap()
            };
            let split = logits(ChunkMatmul::Gemm);
            let largest = split.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(largest > 0.0 && split.iter().all(|v| v.is_finite()));
            let err = max_abs_diff(&split, &logits(ChunkMatmul::Gemv));
            let what =
                format!("{tokens} tokens against the f32 GEMV: {err:.3e} of a largest logit {largest:.3e}");
            assert!(err <= 4e-3 * largest, "{what}");
            eprintln!("ranges of k, {what}");
        }
    });
}
