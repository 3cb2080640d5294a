//! Expert streaming: with fewer GPU slots than experts (as few as the
//! router's top-k, so that experts are evicted on nearly every token), every
//! MoE fixture gives logits bit for bit equal to the fully resident run's,
//! in chunked prefill (each chunk path) and in decode; budgets are turned
//! into slots, and budgets or modes that cannot work are typed errors.

mod common;

use common::checkpoint::fixture_dir;
use common::fixtures::{Case, cases};
use common::on_each_backend;
use wgspark::model::LoadOptions;
use wgspark::model::experts::ExpertCacheStats;
use wgspark::{ChunkMatmul, Error, ExpertPrefetch, Gpu, Model, RoutingMode, SessionOptions};

/// Logits of the prompt (in chunks of 5 tokens) and of each generated id
/// fed back, and the session's expert cache counts.
fn replay(
    model: &Model,
    case: &Case,
    chunk_matmul: ChunkMatmul,
    expert_prefetch: ExpertPrefetch,
) -> (Vec<Vec<f32>>, ExpertCacheStats) {
    let e = &case.expected;
    let options =
        SessionOptions { prefill_chunk: Some(5), chunk_matmul, expert_prefetch, ..common::fixtures::exact() };
    let mut session = model.session(&options).unwrap();
    let mut rows = vec![session.prefill(&e.prompt_ids).unwrap()];
    for &id in &e.generated_ids[..e.generated_ids.len() - 1] {
        let pos = session.position();
        rows.push(session.step(id, pos).unwrap());
    }
    (rows, session.stats().expert_cache)
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect()
}

fn moe_cases(gpu: &Gpu) -> Vec<(Case, Model)> {
    cases()
        .into_iter()
        .filter_map(|case| {
            let model = Model::load(&case.dir, gpu).unwrap();
            model.config.moe.is_some().then_some((case, model))
        })
        .collect()
}

fn streamed(case: &Case, gpu: &Gpu, slots: usize) -> Model {
    let options = LoadOptions { expert_slots: Some(slots), ..Default::default() };
    Model::load_with(&case.dir, gpu, &options, |_| {}).unwrap()
}

#[test]
fn streamed_experts_give_the_resident_logits_bit_for_bit() {
    on_each_backend(|gpu| {
        let cases = moe_cases(gpu);
        assert!(cases.len() >= 8, "{} MoE fixtures", cases.len());
        let mut prefetched = 0;
        for (case, resident) in &cases {
            let moe = resident.config.moe.as_ref().unwrap();
            // The grouped GEMM (a GPU's prefill) on a few cases: each build
            // compiles slowly on CPU rasterisers.
            let paths: &[ChunkMatmul] = match case.name.as_str() {
                "mixtral_deep" | "qwen3_moe_dense_layers" | "fp8_minimax_m2" => {
                    &[ChunkMatmul::Gemv, ChunkMatmul::Gemm]
                }
                _ => &[ChunkMatmul::Gemv],
            };
            // Two streamed MoE layers at least: decode predicts the next one's experts.
            let predicts = moe.sparse_layers.iter().filter(|&&s| s).count() > 1;
            for &path in paths {
                let (want, _) = replay(resident, case, path, ExpertPrefetch::Off);
                let runs = [
                    (moe.top_k, ExpertPrefetch::Predicted),
                    (moe.top_k, ExpertPrefetch::Off),
                    (moe.top_k + 1, ExpertPrefetch::Predicted),
                ];
                for (slots, prefetch) in runs {
                    let model = streamed(case, gpu, slots);
                    assert_eq!(model.experts().map(|e| e.slots), Some(slots), "{}", case.name);
                    let (got, cache) = replay(&model, case, path, prefetch);
                    let what = format!(
                        "{} on {:?}, {slots} slots, {path:?}, prefetch {prefetch:?}",
                        case.name, gpu.info.backend
                    );
                    assert!(bits(&got) == bits(&want), "{what}: logits differ from the resident run");
                    assert!(cache.misses > 0, "{what}: {cache:?}");
                    if predicts && prefetch == ExpertPrefetch::Predicted {
                        prefetched += cache.prefetched;
                    } else {
                        assert_eq!(cache.prefetched, 0, "{what}: {cache:?}");
                    }
                    assert!(cache.prefetch_hits <= cache.prefetched.min(cache.hits), "{what}: {cache:?}");
                }
            }
        }
        assert!(prefetched > 0, "no decode step prefetched an expert");
    });
}

/// A budget becomes slots: the smallest that works holds exactly top-k
/// experts per layer, a byte less is an error that states it, and one that
/// holds every expert keeps them all resident.
#[test]
fn gpu_memory_budgets_become_expert_slots() {
    let gpu = common::gpu(common::backends()[0]);
    for case in [
        "mixtral_8x2",
        "qwen3_moe_norm",
        "gguf_qwen3moe_q4_k_m",
        "gguf_qwen3moe_mixed",
        "gguf_qwen3moe_iq2_m",
        "fp8_minimax_m2",
    ] {
        let dir = fixture_dir(case);
        let load = |gpu_memory| {
            Model::load_with(
                &dir,
                &gpu,
                &LoadOptions { gpu_memory: Some(gpu_memory), ..Default::default() },
                |_| {},
            )
        };
        let minimum = match load(1).expect_err("a budget of one byte") {
            Error::OutOfDeviceMemory { needed_bytes: Some(n), ref message, .. } => {
                assert!(message.contains("--gpu-memory"), "{case}: {message}");
                n
            }
            other => panic!("{case}: {other}"),
        };
        let model = load(minimum).unwrap();
        let top_k = model.config.moe.as_ref().unwrap().top_k;
        assert_eq!(model.experts().map(|e| e.slots), Some(top_k), "{case}");
        let err = load(minimum - 1).expect_err("a byte short");
        assert!(
            matches!(err, Error::OutOfDeviceMemory { needed_bytes: Some(n), .. } if n == minimum),
            "{case}"
        );
        let model = load(u64::MAX / 2).unwrap();
        assert!(model.experts().is_none(), "{case}: a budget for everything streams nothing");
    }
}

#[test]
fn streaming_modes_that_cannot_work_are_errors() {
    let gpu = common::gpu(common::backends()[0]);
    let dir = fixture_dir("mixtral_8x2");
    let slots = |n| {
        Model::load_with(&dir, &gpu, &LoadOptions { expert_slots: Some(n), ..Default::default() }, |_| {})
    };
    let err = slots(1).expect_err("fewer slots than top-k");
    assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("top-k"), "{err}");
    let model = slots(2).unwrap();
    let device = SessionOptions { routing: RoutingMode::DeviceResident, ..Default::default() };
    let Err(err) = model.session(&device) else { panic!("device-resident routing needs every expert") };
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    // A dense model has nothing to stream.
    let dense = fixture_dir("llama_untied");
    let err =
        Model::load_with(&dense, &gpu, &LoadOptions { expert_slots: Some(2), ..Default::default() }, |_| {})
            .expect_err("no experts");
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
}

/// The staging ring: uploads larger than one fill task (pieces of odd
/// sizes, split across threads) land whole, in order, at their offsets,
/// when one call holds more uploads than the ring has buffers (it goes in
/// batches) and when the next call finds the ring's buffers still in use.
#[test]
fn upload_ring_copies_every_piece_in_order() {
    on_each_backend(|gpu| {
        let row = 4100; // a multiple of 4, not of 8
        let rows = 700;
        let size = row * rows;
        let mut ring = wgspark::gpu::UploadRing::new(gpu, 2, size as u64);
        let dst = gpu.storage_buffer_bytes("dst", 5 * size as u64 + 16).unwrap();
        let mut rng = common::Rng::new(7);
        let mut want = vec![0u8; 5 * size + 16];
        let data: Vec<Vec<u8>> = (0..5).map(|_| (0..size).map(|_| rng.next_u32() as u8).collect()).collect();
        let upload = |i: usize| wgspark::gpu::Upload {
            dst: &dst,
            offset: (16 + i * size) as u64,
            pieces: data[i].chunks(row).collect(),
        };
        let empty = wgspark::gpu::Upload { dst: &dst, offset: 0, pieces: vec![] };
        ring.upload(gpu, &[upload(0), empty, upload(1), upload(2)]).unwrap();
        ring.upload(gpu, &[upload(3), upload(4)]).unwrap();
        for (i, d) in data.iter().enumerate() {
            want[16 + i * size..16 + (i + 1) * size].copy_from_slice(d);
        }
        let got: Vec<u32> = gpu.read_buffer(&dst, want.len() / 4).unwrap();
        assert!(bytemuck::cast_slice::<u32, u8>(&got) == &want[..], "uploaded bytes differ");
    });
}
