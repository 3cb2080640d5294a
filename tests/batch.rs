//! The batch engine against lone sessions: sequences of different prompt
//! lengths and options run together, joining and leaving mid-way, each get
//! exactly the greedy ids of a lone `Session` on the same prompt and logits
//! within 1e-4 of it (f32 caches); seeded sampling draws the lone session's
//! ids; prefix reuse, pre-emption and cancellation change no id and leave
//! the pool as it found it.

mod common;

use std::collections::HashMap;

use common::checkpoint::fixture_dir;
use common::{max_abs_diff, on_each_backend};
use wgspark::batch::{BatchEngine, BatchOptions, FinishReason, Output, Request, SequenceId};
use wgspark::sampling::argmax;
use wgspark::{ChunkMatmul, GenerateOptions, Gpu, KvFormat, Model, Sampling, SessionOptions};

/// Fixtures of every kind the engine runs: dense (with a sliding window,
/// q/k norm), Mixtral, Qwen3-MoE, MiniMax-M2, a GGUF and an FP8 model.
const FIXTURES: [&str; 8] = [
    "llama_untied",
    "qwen3_dense",
    "mistral_window",
    "mixtral_8x2",
    "qwen3_moe_norm",
    "minimax_m2",
    "gguf_llama_q4_k_m",
    "fp8_qwen3_dense",
];

// Every row's projections through the GEMV, alone and batched (the
// default on CPU rasterisers): the batch-invariant path, which the
// comparisons below hold to 1e-4. On GPUs the default GEMM rounds a
// step's activations to f16.
fn lone_options() -> SessionOptions {
    SessionOptions { kv_format: KvFormat::F32, chunk_matmul: ChunkMatmul::Gemv, ..Default::default() }
}

fn batch_options() -> BatchOptions {
    BatchOptions {
        kv_format: KvFormat::F32,
        step_tokens: 12,
        block_size: 4,
        chunk_matmul: ChunkMatmul::Gemv,
        ..Default::default()
    }
}

/// Greedy ids and each one's logits, a lone session stepping.
fn lone_greedy(model: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut session = model.session(&lone_options()).unwrap();
    let mut logits = vec![session.prefill(prompt).unwrap()];
    let mut ids = vec![argmax(&logits[0])];
    while ids.len() < n {
        let pos = session.position();
        logits.push(session.step(*ids.last().unwrap(), pos).unwrap());
        ids.push(argmax(logits.last().unwrap()));
    }
    (ids, logits)
}

/// A prompt of `len` ids below `vocab`, seeded.
fn prompt(vocab: usize, len: usize, seed: u64) -> Vec<u32> {
    let mut rng = common::Rng::new(seed);
    (0..len).map(|_| rng.below(vocab as u32)).collect()
}

/// Runs the engine until idle, `joins[i]` = (step at which request i is
/// added, request); returns each sequence's outputs.
fn run(engine: &mut BatchEngine<'_>, joins: Vec<(usize, Request)>) -> Vec<Vec<Output>> {
    let mut ids: Vec<Option<SequenceId>> = vec![None; joins.len()];
    let mut outputs: HashMap<SequenceId, Vec<Output>> = HashMap::new();
    let mut step = 0;
    loop {
        for (i, (at, request)) in joins.iter().enumerate() {
            if *at == step {
                ids[i] = Some(engine.add(request.clone()).unwrap());
            }
        }
        if engine.is_idle() && joins.iter().all(|(at, _)| *at <= step) {
            break;
        }
        for out in engine.step().unwrap() {
            outputs.entry(out.sequence).or_default().push(out);
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    ids.into_iter().map(|id| outputs.remove(&id.unwrap()).unwrap_or_default()).collect()
}

fn tokens(outputs: &[Output]) -> Vec<u32> {
    outputs.iter().map(|o| o.token).collect()
}

/// `requests` twice over, joining at steps 0 to 2 in turn, in a pool of
/// `kv_blocks` blocks: each gets the ids of its run in `results` and the
/// pool ends with no block held; returns the engine's stats.
fn run_crowded(
    model: &Model,
    requests: &[Request],
    results: &[Vec<Output>],
    kv_blocks: usize,
    what: &str,
) -> wgspark::batch::BatchStats {
    let twice: Vec<(usize, Request)> =
        requests.iter().chain(requests).enumerate().map(|(i, r)| (i % 3, r.clone())).collect();
    let small = BatchOptions { kv_blocks: Some(kv_blocks), ..batch_options() };
    let mut crowded = BatchEngine::new(model, &small).unwrap();
    for (i, outputs) in run(&mut crowded, twice).iter().enumerate() {
        assert_eq!(tokens(outputs), tokens(&results[i % requests.len()]), "{what}: request {i} crowded");
    }
    let stats = crowded.stats();
    assert_eq!(stats.blocks_used, 0, "{what}");
    stats
}

fn check_against_lone(gpu: &Gpu, name: &str) {
    let model = Model::load(fixture_dir(name), gpu).unwrap();
    let vocab = model.config.vocab;
    // Prompt lengths around the block and the step budget; joins at several steps.
    let plan: [(usize, usize, usize); 6] =
        [(0, 9, 6), (0, 1, 4), (2, 30, 5), (3, 5, 7), (5, 16, 3), (9, 2, 6)];
    let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
    let joins: Vec<(usize, Request)> = plan
        .iter()
        .enumerate()
        .map(|(i, &(at, len, n))| {
            let request = Request {
                max_tokens: n,
                return_logits: true,
                ..Request::new(prompt(vocab, len, 100 + i as u64))
            };
            (at, request)
        })
        .collect();
    let results = run(&mut engine, joins.clone());
    for ((_, request), outputs) in joins.iter().zip(&results) {
        let what = format!("{name} on {:?}, prompt of {}", gpu.info.backend, request.prompt.len());
        let (want, want_logits) = lone_greedy(&model, &request.prompt, request.max_tokens);
        assert_eq!(tokens(outputs), want, "{what}: ids");
        for (i, (out, want)) in outputs.iter().zip(&want_logits).enumerate() {
            let err = max_abs_diff(out.logits.as_ref().unwrap(), want);
            assert!(err <= 1e-4, "{what}: token {i} logits {err}");
        }
        assert_eq!(outputs.last().unwrap().finish, Some(FinishReason::MaxTokens), "{what}");
        assert!(outputs[..outputs.len() - 1].iter().all(|o| o.finish.is_none()), "{what}");
    }
    let stats = engine.stats();
    assert_eq!((stats.running, stats.waiting, stats.blocks_used), (0, 0, 0), "{name}: all given back");
    assert!(stats.steps > 0 && stats.decode_rows > 0 && stats.prompt_rows > 0, "{name}: {stats:?}");
}

#[test]
fn every_sequence_gets_its_lone_ids_and_logits() {
    on_each_backend(|gpu| {
        for name in FIXTURES {
            check_against_lone(gpu, name);
        }
    });
}

/// Seeded draws are the lone session's (its GPU selection with the same
/// seed), sequence by sequence, beside greedy ones and whatever else runs.
#[test]
fn seeded_sampling_draws_the_lone_sessions_ids() {
    on_each_backend(|gpu| {
        let model = Model::load(fixture_dir("qwen3_dense"), gpu).unwrap();
        let vocab = model.config.vocab;
        let samplings = [
            Sampling::Random { temperature: 1.0, top_k: None, top_p: None },
            Sampling::Greedy,
            Sampling::Random { temperature: 0.7, top_k: Some(20), top_p: Some(0.9) },
            Sampling::Random { temperature: 1.5, top_k: None, top_p: Some(0.8) },
        ];
        let requests: Vec<Request> = samplings
            .iter()
            .enumerate()
            .map(|(i, &sampling)| Request {
                sampling,
                seed: 7 + i as u64,
                max_tokens: 8,
                ..Request::new(prompt(vocab, 3 + 5 * i, i as u64))
            })
            .collect();
        let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
        let results = run(&mut engine, requests.iter().map(|r| (0, r.clone())).collect());
        for (request, outputs) in requests.iter().zip(&results) {
            let mut session = model.session(&lone_options()).unwrap();
            let options = GenerateOptions {
                sampling: request.sampling,
                seed: request.seed,
                max_tokens: request.max_tokens,
                ..Default::default()
            };
            let want: Vec<u32> =
                session.generate(&request.prompt, &options).unwrap().map(|id| id.unwrap()).collect();
            assert_eq!(tokens(outputs), want, "{:?} seed {}", request.sampling, request.seed);
        }
    });
}

/// Stop ids end a sequence on the id (which is output); logprobs come with
/// each token, the chosen one's and the likeliest, from the logits.
#[test]
fn stop_ids_and_logprobs() {
    on_each_backend(|gpu| {
        let model = Model::load(fixture_dir("llama_untied"), gpu).unwrap();
        let p = prompt(model.config.vocab, 6, 3);
        let (want, logits) = lone_greedy(&model, &p, 6);
        let stop = want[3];
        let cut = want.iter().position(|&t| t == stop).unwrap();
        let request =
            Request { max_tokens: 6, stop_tokens: vec![stop], logprobs: Some(3), ..Request::new(p) };
        let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
        let outputs = run(&mut engine, vec![(0, request)]).remove(0);
        assert_eq!(tokens(&outputs), want[..=cut]);
        assert_eq!(outputs.last().unwrap().finish, Some(FinishReason::StopToken(stop)));
        for (out, row) in outputs.iter().zip(&logits) {
            let lp = out.logprobs.as_ref().unwrap();
            assert_eq!(lp.top.len(), 3);
            assert_eq!(lp.top[0].0, out.token, "greedy: the likeliest");
            let max = row.iter().copied().fold(f32::MIN, f32::max);
            let z: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
            let want_lp = (row[out.token as usize] - max) as f64 - z.ln();
            assert!((lp.logprob as f64 - want_lp).abs() < 1e-5, "{} against {want_lp}", lp.logprob);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        }
    });
}

/// A second sequence whose prompt starts with a first one's whole blocks
/// takes them from the cache (counted as hits) and gets the ids of a cold
/// start; a conversation's next turn too.
#[test]
fn prefix_reuse_gives_the_cold_start_ids() {
    on_each_backend(|gpu| {
        let model = Model::load(fixture_dir("mixtral_8x2"), gpu).unwrap();
        let vocab = model.config.vocab;
        let system = prompt(vocab, 13, 40);
        let first = [system.clone(), prompt(vocab, 3, 41)].concat();
        let second = [system.clone(), prompt(vocab, 6, 42)].concat();
        let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
        let a =
            run(&mut engine, vec![(0, Request { max_tokens: 5, ..Request::new(first.clone()) })]).remove(0);
        let hits = engine.stats().prefix_hits;
        let b =
            run(&mut engine, vec![(0, Request { max_tokens: 5, ..Request::new(second.clone()) })]).remove(0);
        assert_eq!(engine.stats().prefix_hits - hits, 3, "the system prompt's three whole blocks of 4");
        assert!(b.iter().all(|o| o.cached_tokens == 12), "each output tells the prompt's cached tokens");
        assert!(a.iter().all(|o| o.cached_tokens == 0));
        assert_eq!(tokens(&b), lone_greedy(&model, &second, 5).0);
        // The next turn: the first conversation and its reply, then more.
        let turn = [first.clone(), tokens(&a), prompt(vocab, 4, 43)].concat();
        let hits = engine.stats().prefix_hits;
        let c =
            run(&mut engine, vec![(0, Request { max_tokens: 4, ..Request::new(turn.clone()) })]).remove(0);
        assert!(engine.stats().prefix_hits - hits >= 4, "{:?}", engine.stats());
        assert_eq!(tokens(&c), lone_greedy(&model, &turn, 4).0);
        let cold = BatchOptions { prefix_cache: false, ..batch_options() };
        let mut engine = BatchEngine::new(&model, &cold).unwrap();
        let d = run(&mut engine, vec![(0, Request { max_tokens: 4, ..Request::new(turn) })]).remove(0);
        assert_eq!(tokens(&d), tokens(&c));
        assert_eq!(engine.stats().prefix_hits, 0);
    });
}

/// A pool too small for every sequence at once: the newest are pre-empted
/// and recomputed later, with the same ids; the pool ends empty.
#[test]
fn preemption_and_resumption_give_the_same_ids() {
    on_each_backend(|gpu| {
        let model = Model::load(fixture_dir("qwen3_moe_norm"), gpu).unwrap();
        let vocab = model.config.vocab;
        let options = BatchOptions { kv_blocks: Some(12), prefix_cache: false, ..batch_options() };
        let mut engine = BatchEngine::new(&model, &options).unwrap();
        let requests: Vec<Request> = (0..5)
            .map(|i| Request { max_tokens: 10, ..Request::new(prompt(vocab, 6 + i, 60 + i as u64)) })
            .collect();
        let results = run(&mut engine, requests.iter().map(|r| (0, r.clone())).collect());
        assert!(engine.stats().preemptions > 0, "{:?}", engine.stats());
        for (request, outputs) in requests.iter().zip(&results) {
            assert_eq!(tokens(outputs), lone_greedy(&model, &request.prompt, 10).0);
        }
        assert_eq!(engine.stats().blocks_used, 0);
    });
}

/// Cancelling gives a sequence's blocks back at once (pool usage back to
/// where it started); the others go on unchanged. A request that can
/// never run is refused when added.
#[test]
fn cancel_frees_blocks_and_bad_requests_are_refused() {
    on_each_backend(|gpu| {
        let model = Model::load(fixture_dir("llama_untied"), gpu).unwrap();
        let vocab = model.config.vocab;
        let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
        let keep = prompt(vocab, 7, 70);
        let kept = engine.add(Request { max_tokens: 6, ..Request::new(keep.clone()) }).unwrap();
        let gone = engine.add(Request { max_tokens: 50, ..Request::new(prompt(vocab, 20, 71)) }).unwrap();
        let mut got = Vec::new();
        for _ in 0..4 {
            got.extend(engine.step().unwrap().into_iter().filter(|o| o.sequence == kept).map(|o| o.token));
        }
        let held = engine.stats().blocks_used;
        assert!(engine.cancel(gone).unwrap());
        assert!(!engine.cancel(gone).unwrap(), "cancelled once");
        assert!(engine.stats().blocks_used < held);
        while !engine.is_idle() {
            got.extend(engine.step().unwrap().into_iter().map(|o| o.token));
        }
        assert_eq!(got, lone_greedy(&model, &keep, 6).0);
        assert_eq!(engine.stats().blocks_used, 0);

        use wgspark::Error;
        let context_len = engine.context_len();
        let mut bad = |r: Request| engine.add(r).unwrap_err();
        assert!(matches!(bad(Request::new(vec![])), Error::EmptyPrompt));
        assert!(matches!(bad(Request::new(vec![vocab as u32])), Error::TokenOutOfRange { .. }));
        assert!(matches!(bad(Request { max_tokens: 0, ..Request::new(vec![1]) }), Error::InvalidSampling(_)));
        assert!(matches!(
            bad(Request { logprobs: Some(21), ..Request::new(vec![1]) }),
            Error::InvalidSampling(_)
        ));
        let hot = Sampling::Random { temperature: -1.0, top_k: None, top_p: None };
        assert!(matches!(bad(Request { sampling: hot, ..Request::new(vec![1]) }), Error::InvalidSampling(_)));
        let long = vec![1; context_len + 1];
        assert!(matches!(bad(Request::new(long)), Error::ContextOverflow { .. }));
        assert!(engine.is_idle());

        // Options no engine can have: typed errors, never a panic.
        for (options, what) in [
            (BatchOptions { max_sequences: 0, ..batch_options() }, "max_sequences"),
            (BatchOptions { block_size: 0, ..batch_options() }, "block_size"),
            (BatchOptions { kv_blocks: Some(0), ..batch_options() }, "less than one step"),
            (BatchOptions { context_len: Some(0), ..batch_options() }, "at least one position"),
            (BatchOptions { max_sequences: usize::MAX, ..batch_options() }, "out of device memory"),
            (BatchOptions { kv_blocks: Some(usize::MAX), ..batch_options() }, "out of device memory"),
            (
                BatchOptions { block_size: usize::MAX, kv_blocks: Some(2), ..batch_options() },
                "out of device memory",
            ),
        ] {
            let err = BatchEngine::new(&model, &options).err().expect(what).to_string();
            assert!(err.contains(what), "{what}: {err}");
        }
    });
}

/// Sequences steered differently (a control vector at two strengths, one
/// limited to a layer range) and one unsteered run in the same steps: each
/// gets the ids and logits of a lone session steered the same way (or not
/// at all), also pre-empted and recomputed in a crowded pool. A steered
/// sequence's blocks are never shared through the prefix cache.
#[test]
fn each_sequence_is_steered_its_own_way() {
    use wgspark::{ControlVector, Steering};
    on_each_backend(|gpu| {
        for name in ["mixtral_deep", "mistral_window"] {
            let model = Model::load(fixture_dir(name), gpu).unwrap();
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering").join(name);
            let vector = ControlVector::load(dir.join("llama_cpp.gguf")).unwrap();
            let c = &model.config;
            let steerings = [
                Some(Steering::new(c, &[(vector.clone(), 1.0)], None).unwrap()),
                None,
                Some(Steering::new(c, &[(vector.clone(), -0.5)], Some(1..=1)).unwrap()),
                Some(Steering::new(c, &[(vector.clone(), 1.0)], None).unwrap()),
            ];
            let shared = prompt(c.vocab, 9, 90);
            let requests: Vec<Request> = steerings
                .iter()
                .enumerate()
                .map(|(i, steering)| Request {
                    steering: steering.clone(),
                    max_tokens: 5,
                    return_logits: true,
                    // The unsteered sequence and the last share the first's prompt.
                    ..Request::new(if i % 2 == 1 || i == 0 {
                        shared.clone()
                    } else {
                        prompt(c.vocab, 4 + i, 91)
                    })
                })
                .collect();
            let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
            let results =
                run(&mut engine, requests.iter().enumerate().map(|(i, r)| (i / 2, r.clone())).collect());
            for (request, outputs) in requests.iter().zip(&results) {
                let mut session = model.session(&lone_options()).unwrap();
                session.set_steering(request.steering.as_ref()).unwrap();
                let mut want_logits = vec![session.prefill(&request.prompt).unwrap()];
                let mut want = vec![argmax(&want_logits[0])];
                while want.len() < request.max_tokens {
                    let pos = session.position();
                    want_logits.push(session.step(*want.last().unwrap(), pos).unwrap());
                    want.push(argmax(want_logits.last().unwrap()));
                }
                let what = format!("{name}, steered {}", request.steering.is_some());
                assert_eq!(tokens(outputs), want, "{what}");
                for (out, row) in outputs.iter().zip(&want_logits) {
                    let err = max_abs_diff(out.logits.as_ref().unwrap(), row);
                    assert!(err <= 1e-4, "{what}: logits {err}");
                }
            }
            let stats = engine.stats();
            assert_eq!(stats.blocks_used, 0);
            assert_eq!(stats.prefix_hits, 0, "the unsteered sequence shares no steered block");
            // Twice over, joining at different steps, in a pool too small for
            // all: a pre-empted sequence is steered its own way again.
            let stats = run_crowded(&model, &requests, &results, 8, name);
            assert!(stats.preemptions > 0, "{name}: {stats:?}");
        }
        // Steering made for another model is refused when the request is added.
        let model = Model::load(fixture_dir("llama_untied"), gpu).unwrap();
        let other = Model::load(fixture_dir("mixtral_deep"), gpu).unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering/mixtral_deep");
        let vector = ControlVector::load(dir.join("llama_cpp.gguf")).unwrap();
        let steering = Steering::new(&other.config, &[(vector, 1.0)], None).unwrap();
        let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
        let err = engine.add(Request { steering: Some(steering), ..Request::new(vec![1, 2]) }).unwrap_err();
        assert!(matches!(err, wgspark::Error::SteeringMismatch { .. }), "{err}");
    });
}

/// A MoE model whose experts stream from host memory (GPU slots for the
/// top-k only) runs the batched steps too: each sequence gets the ids of a
/// lone session on the resident model, also pre-empted and recomputed in a
/// crowded pool.
#[test]
fn streamed_experts_run_in_the_batch() {
    use wgspark::LoadOptions;
    let gpu = common::gpu(common::backends()[0]);
    for case in ["mixtral_8x2", "gguf_qwen3moe_q4_k_m"] {
        let resident = Model::load(fixture_dir(case), &gpu).unwrap();
        let top_k = resident.config.moe.as_ref().unwrap().top_k;
        let load = LoadOptions { expert_slots: Some(top_k), ..Default::default() };
        let streamed = Model::load_with(fixture_dir(case), &gpu, &load, |_| {}).unwrap();
        let vocab = resident.config.vocab;
        let requests: Vec<Request> = (0..4)
            .map(|i| Request { max_tokens: 6, ..Request::new(prompt(vocab, 3 + 7 * i, 80 + i as u64)) })
            .collect();
        let mut engine = BatchEngine::new(&streamed, &batch_options()).unwrap();
        let results = run(&mut engine, requests.iter().enumerate().map(|(i, r)| (i, r.clone())).collect());
        for (request, outputs) in requests.iter().zip(&results) {
            assert_eq!(tokens(outputs), lone_greedy(&resident, &request.prompt, 6).0, "{case}");
        }
        // Twice over in a pool too small for all (pre-emption), joining at
        // different steps, with the prefix cache sharing the repeats.
        let stats = run_crowded(&streamed, &requests, &results, 12, case);
        assert!(stats.preemptions > 0 && stats.prefix_hits > 0, "{case}: {stats:?}");
        let device = BatchOptions { routing: wgspark::RoutingMode::DeviceResident, ..batch_options() };
        assert!(matches!(BatchEngine::new(&streamed, &device), Err(wgspark::Error::Unsupported { .. })));
    }
}

/// Prompts with images (Qwen3-VL, dense and MoE, fixtures of
/// tests/images.rs) beside text-only sequences: each gets the ids and
/// logits of a lone session given the same parts, also pre-empted and
/// recomputed in a crowded pool.
#[test]
fn prompts_with_images_run_beside_text() {
    use wgspark::PromptPart;
    use wgspark::vision::RgbImage;
    on_each_backend(|gpu| {
        for name in ["qwen3_vl_images", "qwen3_vl_moe_images"] {
            let dir = fixture_dir(name);
            let model = Model::load(&dir, gpu).unwrap();
            let image_token = model.config.vision.as_ref().unwrap().tokens.image.unwrap();
            let e: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("expected_images.json")).unwrap())
                    .unwrap();
            let mut requests = Vec::new();
            for case in e["cases"].as_array().unwrap() {
                let (mut ids, mut images) = (Vec::new(), Vec::new());
                for part in case["parts"].as_array().unwrap() {
                    match part.get("text") {
                        Some(t) => {
                            ids.extend(t.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32))
                        }
                        None => {
                            ids.push(image_token);
                            images.push(RgbImage::open(&dir.join(part["image"].as_str().unwrap())).unwrap());
                        }
                    }
                }
                requests.push(Request { images, max_tokens: 4, return_logits: true, ..Request::new(ids) });
            }
            assert!(
                requests.iter().filter(|r| !r.images.is_empty()).count() >= 2,
                "{name}: cases with images"
            );
            requests.push(Request {
                max_tokens: 4,
                return_logits: true,
                ..Request::new(prompt(model.config.vocab, 10, 95))
            });
            let mut engine = BatchEngine::new(&model, &batch_options()).unwrap();
            let results = run(&mut engine, requests.iter().map(|r| (0, r.clone())).collect());
            // Twice over, joining at different steps, in a pool too small for
            // all: pre-empted image prompts are recomputed with their images.
            let stats = run_crowded(&model, &requests, &results, 12, name);
            assert!(stats.preemptions > 0, "{name}: {stats:?}");
            for (request, outputs) in requests.iter().zip(&results) {
                let parts = PromptPart::split(&request.prompt, image_token, &request.images).unwrap();
                let mut session = model.session(&lone_options()).unwrap();
                let mut want_logits = vec![session.prefill_multimodal(&parts).unwrap()];
                let mut want = vec![argmax(&want_logits[0])];
                while want.len() < request.max_tokens {
                    let pos = session.position();
                    want_logits.push(session.step(*want.last().unwrap(), pos).unwrap());
                    want.push(argmax(want_logits.last().unwrap()));
                }
                let what = format!("{name}, {} images", request.images.len());
                assert_eq!(tokens(outputs), want, "{what}");
                for (out, row) in outputs.iter().zip(&want_logits) {
                    let err = max_abs_diff(out.logits.as_ref().unwrap(), row);
                    assert!(err <= 1e-4, "{what}: logits {err}");
                }
            }
            assert_eq!(engine.stats().blocks_used, 0);
        }
    });
}

/// Random schedules of everything at once: requests joining at random
/// steps, half of them sharing a system prompt (prefix reuse), a pool too
/// small for all (pre-emption), greedy and seeded sampling, stop ids,
/// cancels at random steps, blocks of 2 to 8 positions, and 0 to 3 steps
/// in flight. Every sequence that is not cancelled gets its lone
/// session's ids (cut at its stop id; a greedy one, its logits within
/// 1e-4), a cancelled one (or one the context cut short) a beginning of
/// them, and the pool ends with no block held.
#[test]
fn random_schedules_keep_every_sequences_ids() {
    on_each_backend(|gpu| {
        for name in ["llama_untied", "qwen3_moe_norm"] {
            let model = Model::load(fixture_dir(name), gpu).unwrap();
            let vocab = model.config.vocab;
            let system = prompt(vocab, 9, 150);
            let mut preempted = 0;
            for schedule in 0..3u64 {
                let mut rng = common::Rng::new(160 + schedule);
                // (pool blocks, block size, rows a step, sequences at once, steps in flight)
                let (kv_blocks, block_size, step_tokens, max_sequences, in_flight) =
                    [(10, 4, 12, 5, 0), (14, 2, 5, 4, 1), (8, 8, 9, 6, 3)][schedule as usize];
                let options = BatchOptions {
                    kv_blocks: Some(kv_blocks),
                    block_size,
                    step_tokens,
                    max_sequences,
                    in_flight,
                    ..batch_options()
                };
                let mut engine = BatchEngine::new(&model, &options).unwrap();
                // (joins at step, request, its lone ids, cancelled at step)
                let mut plan = Vec::new();
                for i in 0..8u64 {
                    let own = prompt(vocab, 1 + rng.below(12) as usize, 170 + 10 * schedule + i);
                    let shared = rng.below(2) == 0;
                    let text = if shared { [system.clone(), own].concat() } else { own };
                    let max_tokens = 4 + rng.below(9) as usize;
                    let sampling = match rng.below(3) {
                        0 => Sampling::Random { temperature: 0.8, top_k: Some(30), top_p: None },
                        _ => Sampling::Greedy,
                    };
                    let seed = 180 + i;
                    // Greedy replies come with their logits, the lone session's.
                    let (lone, lone_logits) = match sampling {
                        Sampling::Greedy => lone_greedy(&model, &text, max_tokens),
                        _ => {
                            let mut session = model.session(&lone_options()).unwrap();
                            let run = GenerateOptions { sampling, seed, max_tokens, ..Default::default() };
                            (session.generate(&text, &run).unwrap().map(|id| id.unwrap()).collect(), vec![])
                        }
                    };
                    let return_logits = !lone_logits.is_empty();
                    // A stop id from the lone reply for a third of them.
                    let stop_tokens = if rng.below(3) == 0 {
                        vec![lone[rng.below(lone.len() as u32) as usize]]
                    } else {
                        vec![]
                    };
                    let request = Request {
                        max_tokens,
                        stop_tokens,
                        sampling,
                        seed,
                        return_logits,
                        ..Request::new(text)
                    };
                    let at = rng.below(10) as usize;
                    let cancel_at = (rng.below(4) == 0).then(|| at + rng.below(8) as usize);
                    plan.push((at, request, (lone, lone_logits), cancel_at));
                }
                let what = format!("{name} on {:?}, schedule {schedule}", gpu.info.backend);
                let mut ids: Vec<Option<SequenceId>> = vec![None; plan.len()];
                let mut cancelled = vec![false; plan.len()];
                let mut outputs: HashMap<SequenceId, Vec<Output>> = HashMap::new();
                for step in 0.. {
                    for (i, (at, request, _, cancel_at)) in plan.iter().enumerate() {
                        if *at == step {
                            // A prompt the context cannot hold is refused.
                            match engine.add(request.clone()) {
                                Ok(id) => ids[i] = Some(id),
                                Err(wgspark::Error::ContextOverflow { .. }) => {
                                    assert!(request.prompt.len() >= engine.context_len(), "{what}");
                                }
                                Err(e) => panic!("{what}: {e}"),
                            }
                        }
                        if let (Some(id), Some(cancel)) = (ids[i], cancel_at) {
                            if *cancel == step {
                                cancelled[i] = engine.cancel(id).unwrap();
                            }
                        }
                    }
                    if engine.is_idle() && plan.iter().all(|p| p.0 <= step) {
                        break;
                    }
                    for out in engine.step().unwrap() {
                        outputs.entry(out.sequence).or_default().push(out);
                    }
                    assert!(step < 1_000, "{what}: the engine does not finish");
                }
                for (i, (_, request, (lone, lone_logits), _)) in plan.iter().enumerate() {
                    let Some(id) = ids[i] else { continue };
                    let outs = outputs.get(&id).map_or(&[][..], |o| o.as_slice());
                    let got = tokens(outs);
                    // Cut short by a cancel, or by the end of the context.
                    let full = outs.last().is_some_and(|o| o.finish == Some(FinishReason::ContextFull));
                    let cut = request
                        .stop_tokens
                        .first()
                        .map_or(lone.len(), |s| lone.iter().position(|t| t == s).unwrap() + 1);
                    let want = &lone[..cut];
                    match cancelled[i] || full {
                        true => {
                            assert!(want.starts_with(&got), "{what}, request {i}: {got:?} of {want:?}")
                        }
                        false => assert_eq!(got, want, "{what}, request {i}"),
                    }
                    for (k, (out, row)) in outs.iter().zip(lone_logits).enumerate() {
                        let err = max_abs_diff(out.logits.as_ref().unwrap(), row);
                        assert!(err <= 1e-4, "{what}, request {i}: token {k} logits {err}");
                    }
                }
                let stats = engine.stats();
                assert_eq!((stats.running, stats.waiting, stats.blocks_used), (0, 0, 0), "{what}");
                preempted += stats.preemptions;
            }
            assert!(preempted > 0, "{name}: a pool of 10 blocks of 4 pre-empts");
        }
    });
}

/// Steps in flight past a stop: a sequence that stops while later steps
/// already run for it ends on its stop id (the tokens computed past it are
/// dropped), and the sequence beside it goes on unchanged; cancelling
/// while steps are in flight keeps the other's tokens.
#[test]
fn stops_while_steps_are_in_flight() {
    on_each_backend(|gpu| {
        let model = Model::load(fixture_dir("qwen3_dense"), gpu).unwrap();
        let vocab = model.config.vocab;
        let (a, b) = (prompt(vocab, 5, 110), prompt(vocab, 8, 111));
        let want_a = lone_greedy(&model, &a, 12).0;
        let want_b = lone_greedy(&model, &b, 12).0;
        let stop = want_a[6];
        let cut = want_a.iter().position(|&t| t == stop).unwrap();
        for in_flight in [0, 1, 3, 6] {
            let options = BatchOptions { in_flight, ..batch_options() };
            let mut engine = BatchEngine::new(&model, &options).unwrap();
            let requests = vec![
                (0, Request { max_tokens: 12, stop_tokens: vec![stop], ..Request::new(a.clone()) }),
                (0, Request { max_tokens: 12, ..Request::new(b.clone()) }),
            ];
            let results = run(&mut engine, requests);
            assert_eq!(tokens(&results[0]), want_a[..=cut], "in flight {in_flight}");
            assert_eq!(results[0].last().unwrap().finish, Some(FinishReason::StopToken(stop)));
            assert_eq!(tokens(&results[1]), want_b, "in flight {in_flight}");
            assert_eq!(engine.stats().blocks_used, 0);
        }
    });
}

/// With the f16 cache, decode rows run on the subgroup-lane attention where
/// the adapter's subgroups take a row (lavapipe's, for these heads): each
/// sequence still gets a lone f16 session's ids, logits within 2e-3 (or,
/// where the session's prompt attention runs on cooperative matrices in
/// f16, the f16 cache's bound: 0.4 % of the row's largest logit).
#[test]
fn f16_cache_decode_rows_on_subgroup_lanes() {
    on_each_backend(|gpu| {
        for name in ["qwen3_dense", "mixtral_8x2"] {
            let model = Model::load(fixture_dir(name), gpu).unwrap();
            let vocab = model.config.vocab;
            let options = BatchOptions { kv_format: KvFormat::F16, ..batch_options() };
            let mut engine = BatchEngine::new(&model, &options).unwrap();
            let requests: Vec<Request> = (0..3)
                .map(|i| Request {
                    max_tokens: 8,
                    return_logits: true,
                    ..Request::new(prompt(vocab, 5 + 9 * i, 120 + i as u64))
                })
                .collect();
            let results = run(&mut engine, requests.iter().map(|r| (0, r.clone())).collect());
            for (request, outputs) in requests.iter().zip(&results) {
                let f16 = SessionOptions { kv_format: KvFormat::F16, ..lone_options() };
                let mut session = model.session(&f16).unwrap();
                let mut logits = vec![session.prefill(&request.prompt).unwrap()];
                let mut want = vec![argmax(&logits[0])];
                while want.len() < request.max_tokens {
                    let pos = session.position();
                    logits.push(session.step(*want.last().unwrap(), pos).unwrap());
                    want.push(argmax(logits.last().unwrap()));
                }
                assert_eq!(tokens(outputs), want, "{name}");
                for (out, row) in outputs.iter().zip(&logits) {
                    let err = max_abs_diff(out.logits.as_ref().unwrap(), row);
                    let largest = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let bound = if gpu.caps.cooperative_matrix { 4e-3 * largest } else { 2e-3 };
                    assert!(err <= bound, "{name}: logits {err} (bound {bound})");
                }
            }
        }
    });
}

/// On cooperative matrices (the default f16 GEMM and f16 cache), prompts
/// batched into steps of 2048 rows, one of them chunked across two steps,
/// run their attention tile by tile on the matrix units (`attend_coop`
/// over the paged cache) and their projections in the prompt tiles; steps
/// that long give the o-projection of a 2048-wide model the tiles that read
/// f16 copies of their input, which a lone chunk's attention writes and a
/// batch's does not. Each sequence's first logits match a lone session's
/// within the bound the conformance suite holds f16 prefill to (0.4 % of
/// the row's largest logit). Runs where the adapter has cooperative
/// matrices (CPU rasterisers have none, and the steps would take minutes).
#[test]
fn long_prompts_on_cooperative_matrices_match_lone_sessions() {
    use wgspark::kernels::gemm_coop::Tile;
    on_each_backend(|gpu| {
        if !gpu.caps.cooperative_matrix {
            return;
        }
        let model = common::wide_model(gpu, 13);
        assert!(Tile::reads_f16(2048, 2048, 2048, &[], gpu.caps.multiprocessors).is_some());
        let options = BatchOptions { step_tokens: 2048, ..BatchOptions::default() };
        let mut engine = BatchEngine::new(&model, &options).unwrap();
        let requests: Vec<Request> = [1500, 37, 700]
            .into_iter()
            .enumerate()
            .map(|(i, len)| Request {
                max_tokens: 2,
                return_logits: true,
                ..Request::new(prompt(1024, len, 140 + i as u64))
            })
            .collect();
        let results = run(&mut engine, requests.iter().map(|r| (0, r.clone())).collect());
        assert!(engine.stats().steps >= 3, "the third prompt is chunked: {:?}", engine.stats());
        for (request, outputs) in requests.iter().zip(&results) {
            let want = model.session(&SessionOptions::default()).unwrap().prefill(&request.prompt).unwrap();
            let got = outputs[0].logits.as_ref().unwrap();
            let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let err = max_abs_diff(got, &want);
            let what =
                format!("prompt of {}: {err:.3e} of a largest logit {largest:.3e}", request.prompt.len());
            assert!(largest > 0.0 && err <= 4e-3 * largest, "{what}");
            eprintln!("batched on cooperative matrices, {what}");
        }
    });
}

/// A MoE layer's experts take the grouped GEMM only in steps that give each
/// expert enough rows on average (`BatchOptions::expert_gemm_rows`), else
/// the GEMV, one chosen expert of a row at a time; the other projections
/// take the GEMM either way, and every sequence gets its lone ids.
#[test]
fn moe_experts_take_the_gemm_by_their_rows_per_expert() {
    let gpu = common::gpu(common::backends()[0]);
    assert!(gpu.caps.timestamps, "the step's dispatches are told apart by their timed labels");
    let model = Model::load(fixture_dir("qwen3_moe_norm"), &gpu).unwrap();
    let (vocab, layers) = (model.config.vocab, model.config.layers);
    let moe = model.config.moe.as_ref().unwrap();
    let requests: Vec<Request> = (0..3)
        .map(|i| Request { max_tokens: 5, ..Request::new(prompt(vocab, 4 + 2 * i, 140 + i as u64)) })
        .collect();
    // Three decode rows choose 6 experts' rows among 8: under one per expert.
    assert!(requests.len() * moe.top_k < moe.experts);
    for (expert_rows, gemv_experts) in [(0, false), (1, true), (wgspark::batch::EXPERT_GEMM_ROWS, true)] {
        let options = BatchOptions {
            chunk_matmul: ChunkMatmul::Gemm,
            gemm_rows: Some(2),
            expert_gemm_rows: Some(expert_rows),
            time_dispatches: true,
            in_flight: 0,
            ..batch_options()
        };
        let mut engine = BatchEngine::new(&model, &options).unwrap();
        let ids: Vec<SequenceId> = requests.iter().map(|r| engine.add(r.clone()).unwrap()).collect();
        let mut outputs: HashMap<SequenceId, Vec<Output>> = HashMap::new();
        let mut decode_steps = 0;
        while !engine.is_idle() {
            let step = engine.step().unwrap();
            let all_decode = step.len() == requests.len() && engine.stats().waiting == 0;
            if all_decode && outputs.len() == requests.len() {
                decode_steps += 1;
                let labels: Vec<&str> = engine.stats().last_passes.iter().map(|p| p.0).collect();
                // One GEMV a layer beside the experts' two: the router's logits.
                let gemvs = labels.iter().filter(|&&l| l == "gemv").count();
                let want = if gemv_experts { 3 * layers } else { layers };
                assert_eq!(gemvs, want, "expert_gemm_rows {expert_rows}: {labels:?}");
                assert!(labels.contains(&"gemm"), "the other projections take the GEMM: {labels:?}");
            }
            for out in step {
                outputs.entry(out.sequence).or_default().push(out);
            }
        }
        assert!(decode_steps > 0, "no step decoded every sequence");
        for (request, id) in requests.iter().zip(&ids) {
            let want = lone_greedy(&model, &request.prompt, request.max_tokens).0;
            assert_eq!(tokens(&outputs[id]), want, "expert_gemm_rows {expert_rows}");
        }
    }
}
