//! MoE routing: device-resident and readback routing agree bit for bit,
//! experts split across bindings still match the fixtures, and the router
//! histogram and phase times are reported.

mod common;

use common::checkpoint::fixture_dir;
use common::fixtures::{cases, expected};
use common::max_abs_diff;
use wgspark::stats::TimingSource;
use wgspark::{ChunkMatmul, Gpu, GpuOptions, Model, RoutingMode, Session, SessionOptions};

const MOE_CASES: &[&str] = &[
    "mixtral_8x2",
    "mixtral_long_prompt",
    "mixtral_kv1_top3",
    "qwen3_moe_norm",
    "qwen3_moe_no_norm",
    "qwen3_moe_dense_layers",
    "minimax_m2",
    "qwen3_vl_moe",
];

fn replay_with<'m>(model: &'m Model, case: &str, options: &SessionOptions) -> (Vec<Vec<f32>>, Session<'m>) {
    let e = expected(&fixture_dir(case));
    let mut session = model.session(options).unwrap();
    let mut rows = vec![session.prefill(&e.prompt_ids).unwrap()];
    for &id in &e.generated_ids[..e.generated_ids.len() - 1] {
        let pos = session.position();
        rows.push(session.step(id, pos).unwrap());
    }
    (rows, session)
}

#[test]
fn every_moe_family_has_a_fixture() {
    let names: Vec<String> = cases().into_iter().map(|c| c.name).collect();
    for case in MOE_CASES {
        assert!(names.iter().any(|n| n == case), "fixture {case} is missing");
    }
    let families: Vec<&str> = MOE_CASES
        .iter()
        .map(|case| wgspark::ModelConfig::load(&fixture_dir(case)).unwrap().family.name)
        .collect();
    for family in wgspark::model::family::FAMILIES.iter().filter(|f| f.moe.is_some()) {
        assert!(families.contains(&family.name), "no MoE case of family {}", family.name);
    }
}

#[test]
fn device_resident_routing_matches_readback_routing() {
    common::on_each_backend(|gpu| {
        for case in MOE_CASES {
            let model = Model::load(fixture_dir(case), gpu).unwrap();
            // Token by token both modes run the same kernels: identical bits.
            let one = |routing| SessionOptions { routing, prefill_chunk: Some(1), ..Default::default() };
            let readback = replay_with(&model, case, &one(RoutingMode::Readback)).0;
            let (rows, session) = replay_with(&model, case, &one(RoutingMode::DeviceResident));
            assert!(rows == readback, "{case}: device-resident logits differ from readback routing");
            assert_eq!(session.stats().routing_readbacks, 0, "{case}: nothing is read back");
            // A chunked prompt (on CPU rasterisers, through the GEMV) groups
            // tokens by expert (readback) or runs each token's experts
            // (device-resident): the same sums in another order
            // (with an f32 cache: an f16 one can round such a difference up to
            // a unit of its last place).
            let chunked_with = |routing| SessionOptions { routing, ..common::fixtures::exact() };
            let (chunked, _) = replay_with(&model, case, &chunked_with(RoutingMode::DeviceResident));
            let readback_chunked = replay_with(&model, case, &chunked_with(RoutingMode::Readback)).0;
            for (a, b) in chunked.iter().zip(&readback_chunked) {
                assert!(max_abs_diff(a, b) <= 1e-5, "{case}: chunked prefill modes differ");
            }
            // With the GEMM, both group the chunk by expert, on the GPU or on
            // the host, in the same order: identical bits again.
            let grouped_with =
                |routing| SessionOptions { chunk_matmul: ChunkMatmul::Gemm, ..chunked_with(routing) };
            let (grouped, session) = replay_with(&model, case, &grouped_with(RoutingMode::DeviceResident));
            let readback_grouped = replay_with(&model, case, &grouped_with(RoutingMode::Readback)).0;
            assert!(grouped == readback_grouped, "{case}: grouping on the GPU changes the logits");
            assert_eq!(session.stats().routing_readbacks, 0, "{case}: the chunk's routing stays on the GPU");
        }
    });
}

#[test]
fn experts_split_across_bindings_match_the_fixture() {
    for backend in common::backends() {
        // 8 KiB bindings: an expert's 96 x 64 gate/up rows (12 KiB) span two
        // parts, and the 190 x 64 head splits too.
        let gpu =
            Gpu::new(&GpuOptions { backend, max_storage_binding: Some(8192), ..Default::default() }).unwrap();
        let model = Model::load(fixture_dir("mixtral_8x2"), &gpu).unwrap();
        let e = expected(&fixture_dir("mixtral_8x2"));
        let options = SessionOptions { context_len: Some(32), ..common::fixtures::exact() };
        let (rows, _) = replay_with(&model, "mixtral_8x2", &options);
        for (row, (got, want)) in rows.iter().zip(&e.logits).enumerate() {
            let err = max_abs_diff(got, want);
            assert!(err <= 1e-3, "{backend:?} row {row}: {err}");
        }
    }
}

#[test]
fn stats_report_router_histograms_and_phase_times() {
    common::on_each_backend(|gpu| {
        let case = "qwen3_moe_dense_layers";
        let model = Model::load(fixture_dir(case), gpu).unwrap();
        let moe = model.config.moe.clone().unwrap();
        let options = SessionOptions { timing: true, ..Default::default() };
        let (rows, session) = replay_with(&model, case, &options);
        let stats = session.stats();
        let tokens = (expected(&fixture_dir(case)).prompt_ids.len() + rows.len() - 1) as u64;
        // The prompt is one chunk, then one pass per decoded token.
        let passes = rows.len() as u64;
        assert_eq!(stats.forward_passes, passes);
        for (layer, counts) in stats.router_histogram.iter().enumerate() {
            if moe.sparse_layers[layer] {
                assert_eq!(counts.len(), moe.experts);
                assert_eq!(counts.iter().sum::<u64>(), tokens * moe.top_k as u64, "layer {layer}");
            } else {
                assert!(counts.is_empty(), "dense layer {layer} has no histogram");
            }
        }
        let moe_layers = moe.sparse_layers.iter().filter(|&&s| s).count() as u64;
        assert_eq!(stats.routing_readbacks, passes * moe_layers);
        let phases = stats.phases.expect("timing was asked for");
        let want_source =
            if gpu.caps.timestamps { TimingSource::GpuTimestamps } else { TimingSource::WallClock };
        assert_eq!(stats.timing_source, Some(want_source));
        assert!(!phases.layers.is_zero() && !phases.routed.is_zero() && !phases.head.is_zero(), "{phases:?}");
        // Timing dispatches: each in a pass of its own, by kernel, in order.
        let options = SessionOptions { timing: true, time_dispatches: true, ..Default::default() };
        let (_, session) = replay_with(&model, case, &options);
        let passes = session.stats().last_passes;
        if gpu.caps.timestamps {
            let count = |label| passes.iter().filter(|p| p.0 == label).count();
            assert_eq!(count("embed"), 1, "{passes:?}");
            assert!(count("gemv") >= 3 * model.config.layers, "{passes:?}");
            assert_eq!(count("router"), moe_layers as usize, "{passes:?}");
        } else {
            assert!(passes.is_empty(), "dispatches are timed only with GPU timestamps");
        }
        eprintln!(
            "{:?}: {:?}; routing readback {:.3} ms each",
            gpu.info.backend,
            phases,
            stats.routing_wait.as_secs_f64() * 1e3 / stats.routing_readbacks as f64
        );
    });
}
