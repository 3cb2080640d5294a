//! A model split by layers across two devices (`Model::load_split`) is the
//! same computation as on one: on every fixture without a vision tower,
//! with the split at each boundary between layers, two lavapipe devices
//! (and lavapipe then llvmpipe at the first boundary, where GL is tested)
//! give the single device's logits (f32 cache) within 1e-5 after the
//! prompt and after each step of its greedy continuation, and the same ids.

mod common;

use common::fixtures::{cases, exact};
use common::max_abs_diff;
use wgspark::gpu::{Backend, Gpu, GpuOptions};
use wgspark::sampling::argmax;
use wgspark::{LoadOptions, Model};

/// The prompt's logits and those after each greedy step, and the ids.
fn run(model: &Model, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    run_with(model, &exact(), prompt, steps)
}

/// [`run`] in a session opened with `options`.
fn run_with(
    model: &Model,
    options: &wgspark::SessionOptions,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut session = model.session(options).unwrap();
    let mut logits = vec![session.prefill(prompt).unwrap()];
    let mut ids = vec![argmax(&logits[0])];
    while ids.len() < steps {
        logits.push(session.step(*ids.last().unwrap(), session.position()).unwrap());
        ids.push(argmax(logits.last().unwrap()));
    }
    (logits, ids)
}

#[test]
fn a_split_at_every_layer_boundary_gives_the_single_device_logits() {
    let backends = common::backends();
    let open = |backend| Gpu::new(&GpuOptions { backend, ..Default::default() }).unwrap();
    assert!(backends.contains(&Backend::Vulkan), "the split runs on two Vulkan devices");
    let (first, second) = (common::gpu(Backend::Vulkan), open(Backend::Vulkan));
    let gl = backends.contains(&Backend::Gl).then(|| common::gpu(Backend::Gl));
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in cases() {
        let whole = Model::load(&case.dir, &first).unwrap();
        let layers = whole.config.layers;
        if whole.config.vision.is_some() || layers < 2 {
            continue;
        }
        let e = &case.expected;
        let steps = e.generated_ids.len().min(4);
        let (want, want_ids) = run(&whole, &e.prompt_ids, steps);
        for boundary in 1..layers {
            let mut pairs = vec![(&second, "two lavapipe devices")];
            if boundary == 1 {
                pairs.extend(gl.as_ref().map(|g| (g, "lavapipe then llvmpipe")));
            }
            for (next, how) in pairs {
                let shares = [boundary as f64, (layers - boundary) as f64];
                let gpus = [first.clone(), next.clone()];
                let options = LoadOptions::default();
                let split = Model::load_split(&case.dir, &gpus, Some(&shares), &options, |_| {}).unwrap();
                assert_eq!(split.layer_split(), vec![0..boundary, boundary..layers], "{}", case.name);
                let (got, ids) = run(&split, &e.prompt_ids, steps);
                let what = format!("{} split at layer {boundary} over {how}", case.name);
                let err = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
                if err > 1e-5 || ids != want_ids {
                    failures.push(format!(
                        "{what}: max |logit error| {err:.2e}, ids {ids:?} against {want_ids:?}"
                    ));
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "splits of the fixtures checked: {checked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What a split refuses is a typed error: shares that are not one positive
/// number per device, a device whose budget its layers exceed (named, with
/// the bytes it lacks), a model with a vision tower, and timing a split
/// session.
#[test]
fn a_split_refuses_with_typed_errors() {
    let dir = |name: &str| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let open = |budget| {
        Gpu::new(&GpuOptions { backend: Backend::Vulkan, memory_budget: budget, ..Default::default() })
            .unwrap()
    };
    let gpus = [common::gpu(Backend::Vulkan), open(None)];
    let options = LoadOptions::default();
    let llama = dir("llama_untied");
    let err = Model::load_split(&llama, &gpus, Some(&[1.0]), &options, |_| {}).unwrap_err();
    assert!(
        matches!(err, wgspark::Error::InvalidSplit { .. }) && err.to_string().contains("1 shares for 2"),
        "{err}"
    );
    let tight = [common::gpu(Backend::Vulkan), open(Some(1000))];
    let err = Model::load_split(&llama, &tight, Some(&[1.0, 1.0]), &options, |_| {}).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, wgspark::Error::OutOfDeviceMemory { .. })
            && text.contains("1: ")
            && text.contains("fewer"),
        "{text}"
    );
    let err = Model::load_split(dir("qwen3_vl_dense"), &gpus, None, &options, |_| {}).unwrap_err();
    assert!(matches!(err, wgspark::Error::Unsupported { .. }), "{err}");

    let model = Model::load_split(&llama, &gpus, None, &options, |_| {}).unwrap();
    let timed = model.session(&wgspark::SessionOptions { timing: true, ..exact() }).err();
    assert!(matches!(timed, Some(wgspark::Error::Unsupported { .. })), "{timed:?}");
}

/// Each device of a split streams the experts of its own layers into its
/// own slots: on every MoE fixture, split at its middle layer with top-k
/// slots per MoE layer, the logits are the resident single device's within
/// 1e-5 and the ids the same, and the expert cache serves exactly what one
/// device streaming every layer serves (each layer's slots behave as they
/// would there). A budget per device too small for its layers' slots names
/// the device.
#[test]
fn streamed_experts_across_a_split_give_the_single_device_logits() {
    use wgspark::{RoutingMode, SessionOptions};
    let first = common::gpu(Backend::Vulkan);
    let second = Gpu::new(&GpuOptions { backend: Backend::Vulkan, ..Default::default() }).unwrap();
    let options = SessionOptions { routing: RoutingMode::Readback, ..exact() };
    let run = |model: &Model, prompt: &[u32], steps: usize| {
        let mut session = model.session(&options).unwrap();
        let mut logits = vec![session.prefill(prompt).unwrap()];
        while logits.len() < steps {
            let id = argmax(logits.last().unwrap());
            logits.push(session.step(id, session.position()).unwrap());
        }
        let cache = session.stats().expert_cache;
        (logits, (cache.hits, cache.misses))
    };
    let mut checked = 0;
    for case in cases() {
        let whole = Model::load(&case.dir, &first).unwrap();
        let c = &whole.config;
        let (Some(moe), None, true) = (&c.moe, &c.vision, c.layers >= 2) else { continue };
        let load = LoadOptions { expert_slots: Some(moe.top_k), ..Default::default() };
        let e = &case.expected;
        let steps = e.generated_ids.len().clamp(1, 4);
        let (want, _) = run(&whole, &e.prompt_ids, steps);
        let one_device = Model::load_with(&case.dir, &first, &load, |_| {}).unwrap();
        let (_, want_cache) = run(&one_device, &e.prompt_ids, steps);
        let boundary = c.layers / 2;
        let shares = [boundary as f64, (c.layers - boundary) as f64];
        let gpus = [first.clone(), second.clone()];
        let split = Model::load_split(&case.dir, &gpus, Some(&shares), &load, |_| {}).unwrap();
        let (got, cache) = run(&split, &e.prompt_ids, steps);
        let err = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
        let ids = |rows: &[Vec<f32>]| rows.iter().map(|r| argmax(r)).collect::<Vec<_>>();
        assert!(err <= 1e-5 && ids(&got) == ids(&want), "{}: max |logit error| {err:.2e}", case.name);
        assert!(
            cache == want_cache && cache.1 > 0,
            "{}: hits, misses {cache:?} against {want_cache:?}",
            case.name
        );
        checked += 1;
    }
    assert!(checked >= 8, "MoE fixtures split: {checked}");

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mixtral_deep");
    let tight = LoadOptions { gpu_memory: Some(1000), ..Default::default() };
    let err = Model::load_split(&dir, &[first, second], None, &tight, |_| {}).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, wgspark::Error::OutOfDeviceMemory { .. }) && text.contains("on 0: "), "{text}");
}

/// A middle device holds neither the embedding nor the head: three lavapipe
/// devices, the layers of a random-weight model in shares 1 : 2 : 1, give
/// the logits of the same model (same seed) on one device, the prompt whole
/// or in chunks that pipeline across the devices (fewer, as many and more
/// chunks than devices).
#[test]
fn three_devices_give_the_single_device_logits() {
    use wgspark::model::ModelConfig;
    let config = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
      "tie_word_embeddings": true, "rope_theta": 10000.0}"#;
    let config = || ModelConfig::parse(config, std::path::Path::new("config.json")).unwrap();
    let open = || Gpu::new(&GpuOptions { backend: Backend::Vulkan, ..Default::default() }).unwrap();
    let first = common::gpu(Backend::Vulkan);
    let whole = Model::synthetic(config(), &first, 5).unwrap();
    let gpus = [first, open(), open()];
    let split = Model::synthetic_split(config(), &gpus, Some(&[1.0, 2.0, 1.0]), 5).unwrap();
    assert_eq!(split.layer_split(), vec![0..1, 1..3, 3..4]);
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    for prefill_chunk in [None, Some(4), Some(3), Some(1)] {
        let options = wgspark::SessionOptions { prefill_chunk, ..exact() };
        let (want, want_ids) = run_with(&whole, &options, &prompt, 4);
        let (got, ids) = run_with(&split, &options, &prompt, 4);
        let err = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
        assert!(
            err <= 1e-5 && ids == want_ids,
            "chunks of {prefill_chunk:?}: max |logit error| {err:.2e}, ids {ids:?} against {want_ids:?}"
        );
    }
}

/// `generate` on a split samples on the last device and feeds each id back
/// to the first: greedy and seeded sampling, with steps in flight, give the
/// ids and stop reasons of the same generation on one device, and the
/// session goes on from where the generation left it (a MoE fixture split
/// over two lavapipe devices).
#[test]
fn generation_on_a_split_gives_the_single_device_ids() {
    use wgspark::{GenerateOptions, Sampling};
    let generate = |model: &Model, prompt: &[u32], options: &GenerateOptions| {
        let mut session = model.session(&exact()).unwrap();
        let mut generation = session.generate(prompt, options).unwrap();
        let ids: Vec<u32> = generation.by_ref().map(Result::unwrap).collect();
        let reason = generation.stop_reason();
        drop(generation);
        // The last id is not yet in the cache: stepping it gives its logits.
        let next = session.step(*ids.last().unwrap(), session.position()).unwrap();
        (ids, reason, argmax(&next))
    };
    let random = Sampling::Random { temperature: 1.0, top_k: Some(40), top_p: Some(0.9) };
    let options = [
        GenerateOptions { max_tokens: 9, in_flight: 3, ..GenerateOptions::default() },
        GenerateOptions {
            sampling: random,
            seed: 7,
            max_tokens: 9,
            in_flight: 1,
            ..GenerateOptions::default()
        },
    ];
    let open = || Gpu::new(&GpuOptions { backend: Backend::Vulkan, ..Default::default() }).unwrap();
    let first = common::gpu(Backend::Vulkan);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe_norm");
    let whole = Model::load(&dir, &first).unwrap();
    let gpus = [first.clone(), open()];
    let split = Model::load_split(&dir, &gpus, None, &LoadOptions::default(), |_| {}).unwrap();
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    for options in &options {
        let want = generate(&whole, &prompt, options);
        assert_eq!(generate(&split, &prompt, options), want, "qwen3_moe_norm, {:?}", options.sampling);
        // Stopping at an id the generation yields.
        let stop = GenerateOptions { stop_tokens: vec![want.0[4]], ..options.clone() };
        let want = generate(&whole, &prompt, &stop);
        assert_eq!(want.1, Some(wgspark::StopReason::StopToken(stop.stop_tokens[0])));
        assert_eq!(generate(&split, &prompt, &stop), want, "qwen3_moe_norm stopping, {:?}", options.sampling);
    }
}

/// Steering reaches every device of a split: each holds the rows of its own
/// layers. A steered prompt and steps over two lavapipe devices give the
/// logits of the same steering on one device (and not the unsteered ones),
/// and turning steering off gives the plain logits again.
#[test]
fn steering_across_a_split_gives_the_single_device_logits() {
    use std::collections::BTreeMap;
    use wgspark::{ControlVector, Steering};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_untied");
    let first = common::gpu(Backend::Vulkan);
    let second = Gpu::new(&GpuOptions { backend: Backend::Vulkan, ..Default::default() }).unwrap();
    let whole = Model::load(&dir, &first).unwrap();
    let split = Model::load_split(&dir, &[first, second], None, &LoadOptions::default(), |_| {}).unwrap();
    let c = &whole.config;
    assert!(split.layer_split().len() == 2 && c.layers >= 2);
    // A direction on every layer, so that both devices steer.
    let directions: BTreeMap<usize, Vec<f32>> = (0..c.layers)
        .map(|l| (l, (0..c.hidden).map(|i| ((i * 7 + l * 3) % 11) as f32 / 11.0 - 0.5).collect()))
        .collect();
    let vector = ControlVector { path: "synthetic.gguf".into(), model_hint: None, directions };
    let steering = Steering::new(c, &[(vector, 2.0)], None).unwrap();
    let prompt = [3, 1, 4, 1, 5];
    let run = |model: &Model, steering: Option<&Steering>| {
        let mut session = model.session(&exact()).unwrap();
        session.set_steering(steering).unwrap();
        let mut logits = vec![session.prefill(&prompt).unwrap()];
        for _ in 0..2 {
            let next = argmax(logits.last().unwrap());
            logits.push(session.step(next, session.position()).unwrap());
        }
        logits
    };
    let err =
        |a: &[Vec<f32>], b: &[Vec<f32>]| a.iter().zip(b).map(|(a, b)| max_abs_diff(a, b)).fold(0.0, f32::max);
    let (want, plain) = (run(&whole, Some(&steering)), run(&whole, None));
    assert!(err(&want, &plain) > 1e-2, "the steering moves the logits");
    let got = run(&split, Some(&steering));
    assert!(err(&got, &want) <= 1e-5, "steered split: max |logit error| {:.2e}", err(&got, &want));
    let got = run(&split, None);
    assert!(err(&got, &plain) <= 1e-5, "unsteered split: max |logit error| {:.2e}", err(&got, &plain));
}

/// Residual capture reaches every device of a split: each records the
/// layers it holds, and `take_capture` gives the layers, positions and rows
/// of the same capture on one device, the prompt whole and in chunks, for
/// every prompt row and for the last, with steps and with a generation
/// (whose rows past its stop are dropped); a device holding none of the
/// asked layers still counts the positions.
#[test]
fn capture_across_a_split_gives_the_single_device_rows() {
    use wgspark::{CaptureOptions, GenerateOptions, PromptRows};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_untied");
    let first = common::gpu(Backend::Vulkan);
    let second = Gpu::new(&GpuOptions { backend: Backend::Vulkan, ..Default::default() }).unwrap();
    let whole = Model::load(&dir, &first).unwrap();
    let split = Model::load_split(&dir, &[first, second], None, &LoadOptions::default(), |_| {}).unwrap();
    assert_eq!(split.layer_split(), vec![0..1, 1..2]);
    assert_eq!(split.weight_bytes(), whole.weight_bytes(), "the devices' weights together");
    let prompt = [3, 1, 4, 1, 5];
    let run = |model: &Model, options: &CaptureOptions, prefill_chunk| {
        let mut session = model.session(&wgspark::SessionOptions { prefill_chunk, ..exact() }).unwrap();
        session.set_capture(Some(options)).unwrap();
        let logits = session.prefill(&prompt).unwrap();
        session.step(argmax(&logits), session.position()).unwrap();
        let stepped = session.take_capture().unwrap();
        let generate = GenerateOptions { max_tokens: 4, in_flight: 2, ..GenerateOptions::default() };
        let ids: Vec<u32> = session.generate(&[7, 2], &generate).unwrap().map(Result::unwrap).collect();
        (stepped, session.take_capture().unwrap(), ids)
    };
    let cases = [None, Some(vec![1]), Some(vec![0])].into_iter().flat_map(|layers| {
        [PromptRows::All, PromptRows::Last].into_iter().map(move |rows| (layers.clone(), rows))
    });
    // The prompt whole, and in chunks of 2 that pipeline across the devices.
    for ((layers, prompt_rows), chunk) in cases.flat_map(|c| [(c.clone(), None), (c, Some(2))]) {
        let options = CaptureOptions { layers: layers.clone(), prompt_rows };
        let (want, got) = (run(&whole, &options, chunk), run(&split, &options, chunk));
        let what = format!("layers {layers:?}, {prompt_rows:?}, chunks of {chunk:?}");
        assert_eq!(got.2, want.2, "{what}: ids");
        for (got, want) in [(&got.0, &want.0), (&got.1, &want.1)] {
            assert_eq!((&got.layers, &got.positions), (&want.layers, &want.positions), "{what}");
            assert!(!want.positions.is_empty() && want.rows.iter().all(|r| !r.is_empty()), "{what}");
            let err = got.rows.iter().zip(&want.rows).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
            assert!(err <= 1e-5, "{what}: max |row error| {err:.2e}");
        }
    }
}

/// The batch engine over a split: every device holds the KV blocks of its
/// layers and runs the same rows, the last one the head and the selection.
/// Sequences joining at different steps, greedy and seeded, steered and
/// not, give the ids, logits and stop reasons of the same engine on one
/// device, with every expert resident or streamed on each device, with
/// steps run as passes pipelined across the devices, and (where GL is
/// tested) split over lavapipe then llvmpipe; every block comes back.
#[test]
fn the_batch_engine_on_a_split_gives_the_single_device_outputs() {
    use std::collections::HashMap;
    use wgspark::batch::{BatchEngine, BatchOptions, Request};
    use wgspark::{ControlVector, Sampling, Steering};
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let dir = fixtures.join("fixtures/mixtral_deep");
    let first = common::gpu(Backend::Vulkan);
    let second = Gpu::new(&GpuOptions { backend: Backend::Vulkan, ..Default::default() }).unwrap();
    let whole = Model::load(&dir, &first).unwrap();
    let gpus = [first, second];
    let split = Model::load_split(&dir, &gpus, None, &LoadOptions::default(), |_| {}).unwrap();
    assert_eq!(split.layer_split().len(), 2);
    let c = &whole.config;
    let top_k = c.moe.as_ref().unwrap().top_k;
    let streaming = LoadOptions { expert_slots: Some(top_k), ..Default::default() };
    let streamed = Model::load_split(&dir, &gpus, None, &streaming, |_| {}).unwrap();
    let vector = ControlVector::load(fixtures.join("steering/mixtral_deep/llama_cpp.gguf")).unwrap();
    let steering = Steering::new(c, &[(vector, 1.0)], None).unwrap();
    let random = Sampling::Random { temperature: 0.8, top_k: Some(20), top_p: None };
    let requests = [
        (0, Request { max_tokens: 6, return_logits: true, ..Request::new(vec![5, 9, 2, 7, 1, 3, 8, 4, 6]) }),
        (0, Request { max_tokens: 4, sampling: random, seed: 3, ..Request::new(vec![11, 2]) }),
        (
            1,
            Request {
                max_tokens: 5,
                steering: Some(steering),
                return_logits: true,
                ..Request::new(vec![4; 14])
            },
        ),
        (
            3,
            Request { max_tokens: 3, logprobs: Some(3), ..Request::new(vec![5, 9, 2, 7, 1, 3, 8, 4, 6, 10]) },
        ),
    ];
    let options = BatchOptions {
        kv_format: wgspark::KvFormat::F32,
        step_tokens: 12,
        block_size: 4,
        ..Default::default()
    };
    let run_with = |model: &Model, options: &BatchOptions| {
        let mut engine = BatchEngine::new(model, options).unwrap();
        let mut ids = Vec::new();
        let mut outputs: HashMap<_, Vec<_>> = HashMap::new();
        for step in 0.. {
            for (at, request) in &requests {
                if *at == step {
                    ids.push(engine.add(request.clone()).unwrap());
                }
            }
            if engine.is_idle() && ids.len() == requests.len() {
                break;
            }
            for out in engine.step().unwrap() {
                outputs.entry(out.sequence).or_default().push(out);
            }
            assert!(step < 1000, "the engine does not finish");
        }
        assert_eq!(engine.stats().blocks_used, 0, "every block comes back");
        ids.iter().map(|id| outputs.remove(id).unwrap()).collect::<Vec<_>>()
    };
    let run = |model: &Model| run_with(model, &options);
    let want = run(&whole);
    let streamed_runs = run(&streamed);
    let cache = streamed.experts().expect("the first device streams its experts").totals();
    assert!(cache.misses > 0, "{cache:?}");
    // Every step of two rows or more as two passes pipelined across the
    // devices, on the GEMV (where a row's sums do not depend on how many
    // rows its pass has), against the GEMV on one device.
    let gemv = BatchOptions { chunk_matmul: wgspark::ChunkMatmul::Gemv, ..options.clone() };
    let want_gemv = run_with(&whole, &gemv);
    let pipelined = run_with(&split, &BatchOptions { pipeline_rows: 2, ..gemv });
    let mut runs = vec![(run(&split), &want), (streamed_runs, &want), (pipelined, &want_gemv)];
    // lavapipe then llvmpipe, whose attention kernels differ (llvmpipe has
    // no subgroups: its decode rows run on the tiled kernel), on one tiling
    // of the rows that both take.
    if common::backends().contains(&Backend::Gl) {
        let mixed = [gpus[0].clone(), common::gpu(Backend::Gl)];
        let split = Model::load_split(&dir, &mixed, None, &LoadOptions::default(), |_| {}).unwrap();
        runs.push((run(&split), &want));
    }
    let pairs = runs.iter().flat_map(|(got, want)| got.iter().zip(want.iter()));
    for (i, (got, want)) in pairs.enumerate() {
        let i = i % requests.len();
        let ids = |o: &[wgspark::batch::Output]| o.iter().map(|o| (o.token, o.finish)).collect::<Vec<_>>();
        assert_eq!(ids(got), ids(want), "request {i}: ids and stop reasons");
        for (g, w) in got.iter().zip(want) {
            if let (Some(g), Some(w)) = (&g.logits, &w.logits) {
                assert!(max_abs_diff(g, w) <= 1e-5, "request {i}: logits {:.2e}", max_abs_diff(g, w));
            }
            let top = |o: &wgspark::batch::Output| {
                o.logprobs.as_ref().map(|l| l.top.iter().map(|t| t.0).collect::<Vec<_>>())
            };
            assert_eq!(top(g), top(w), "request {i}: top logprobs");
        }
    }
}
