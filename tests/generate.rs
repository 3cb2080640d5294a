//! Generation with the next token chosen on the GPU and several steps in
//! flight: the same greedy ids as stepping with the logits read back, on
//! every fixture; stops (a stop token mid-flight or first, the end of the
//! context, the caller's cancel) leave the session where the ids it
//! yielded left it; seeded sampling repeats.

mod common;

use common::fixtures::{Case, cases, exact};
use common::{max_abs_diff, on_each_backend};
use wgspark::sampling::argmax;
use wgspark::{GenerateOptions, Model, RoutingMode, Sampling, Session, SessionOptions, StopReason};

/// Greedy ids of `n` tokens after `prompt`, stepping with logits read back.
fn stepped(session: &mut Session<'_>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut logits = session.prefill(prompt).unwrap();
    let mut ids = vec![argmax(&logits)];
    while ids.len() < n {
        logits = session.step(*ids.last().unwrap(), session.position()).unwrap();
        ids.push(argmax(&logits));
    }
    ids
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, ..Default::default() }
}

#[test]
fn greedy_generation_gives_the_stepped_ids_on_every_fixture() {
    let cases = cases();
    on_each_backend(|gpu| {
        for case in &cases {
            let e = &case.expected;
            let model = Model::load(&case.dir, gpu).unwrap();
            let n = e.generated_ids.len();
            for options in [exact(), SessionOptions::default()] {
                let what = format!("{} on {:?}, {:?} cache", case.name, gpu.info.backend, options.kv_format);
                let want = stepped(&mut model.session(&options).unwrap(), &e.prompt_ids, n);
                let mut session = model.session(&options).unwrap();
                let mut generation = session.generate(&e.prompt_ids, &greedy(n)).unwrap();
                let got: Vec<u32> = generation.by_ref().map(|id| id.unwrap()).collect();
                assert_eq!(generation.stop_reason(), Some(StopReason::MaxTokens), "{what}");
                drop(generation);
                assert_eq!(got, want, "{what}: generated and stepped ids");
                if options.kv_format == exact().kv_format {
                    assert_eq!(got, e.generated_ids, "{what}: transformers' ids");
                }
                assert_eq!(session.position(), e.prompt_ids.len() + n - 1, "{what}: position");
                assert_eq!(session.stats().decode_dispatches > 0, n > 1, "{what}");
            }
        }
    });
}

/// After a generation stopped at `yielded` ids, the session continues as
/// if only those had been fed: the next step's logits are the fixture's.
fn assert_continues(session: &mut Session<'_>, case: &Case, yielded: usize) {
    let e = &case.expected;
    assert_eq!(
        session.position(),
        e.prompt_ids.len() + yielded - 1,
        "{}: position after the stop",
        case.name
    );
    let logits = session.step(e.generated_ids[yielded - 1], session.position()).unwrap();
    let err = max_abs_diff(&logits, &e.logits[yielded]);
    assert!(err <= 1e-3, "{}: the step after the stop is off by {err}", case.name);
}

#[test]
fn stops_drop_the_steps_in_flight_and_roll_back_the_position() {
    let cases = cases();
    let case = cases.iter().find(|c| c.name == "llama_untied").unwrap();
    let e = &case.expected;
    on_each_backend(|gpu| {
        let model = Model::load(&case.dir, gpu).unwrap();
        // More in flight than the engine keeps (or than the tokens asked
        // for) runs as many as it keeps.
        for in_flight in [1, 2, 4, wgspark::session::MAX_IN_FLIGHT + 1, usize::MAX] {
            // A stop token mid-flight: the third id, with steps queued after it.
            let mut session = model.session(&exact()).unwrap();
            let stop = e.generated_ids[2];
            assert!(!e.generated_ids[..2].contains(&stop), "the fixture's third id is new");
            let options =
                GenerateOptions { stop_tokens: vec![stop], in_flight, ..greedy(e.generated_ids.len()) };
            let mut generation = session.generate(&e.prompt_ids, &options).unwrap();
            let got: Vec<u32> = generation.by_ref().map(|id| id.unwrap()).collect();
            assert_eq!(got, e.generated_ids[..3], "in flight {in_flight}");
            assert_eq!(generation.stop_reason(), Some(StopReason::StopToken(stop)));
            drop(generation);
            assert_continues(&mut session, case, 3);

            // The caller cancels after two ids, by dropping the iterator.
            let mut session = model.session(&exact()).unwrap();
            let mut generation =
                session.generate(&e.prompt_ids, &GenerateOptions { in_flight, ..greedy(50) }).unwrap();
            let got: Vec<u32> = generation.by_ref().take(2).map(|id| id.unwrap()).collect();
            assert_eq!(got, e.generated_ids[..2]);
            generation.cancel();
            assert_eq!(generation.stop_reason(), Some(StopReason::Cancelled));
            assert!(generation.next().is_none(), "nothing after a cancel");
            drop(generation);
            assert_continues(&mut session, case, 2);
        }

        // A stop token as the very first id: the prompt alone is fed.
        let mut session = model.session(&exact()).unwrap();
        let options = GenerateOptions { stop_tokens: vec![e.generated_ids[0]], ..greedy(10) };
        let got: Vec<u32> =
            session.generate(&e.prompt_ids, &options).unwrap().map(|id| id.unwrap()).collect();
        assert_eq!(got, e.generated_ids[..1]);
        assert_continues(&mut session, case, 1);

        // The end of the context: 3 positions after the prompt allow 3 steps,
        // so 4 ids, whatever max_tokens says.
        let context = e.prompt_ids.len() + 3;
        let mut session = model.session(&SessionOptions { context_len: Some(context), ..exact() }).unwrap();
        let mut generation = session.generate(&e.prompt_ids, &greedy(100)).unwrap();
        let got: Vec<u32> = generation.by_ref().map(|id| id.unwrap()).collect();
        assert_eq!(got, e.generated_ids[..4]);
        assert_eq!(generation.stop_reason(), Some(StopReason::ContextFull));
        drop(generation);
        assert_eq!(session.position(), context);
        assert!(session.step(got[3], context).is_err(), "the context is full");
    });
}

#[test]
fn seeded_sampling_repeats_and_readback_routing_counts_every_token() {
    let cases = cases();
    let case = cases.iter().find(|c| c.name == "qwen3_moe_norm").unwrap();
    let e = &case.expected;
    on_each_backend(|gpu| {
        let model = Model::load(&case.dir, gpu).unwrap();
        let sampling = Sampling::Random { temperature: 1.5, top_k: Some(50), top_p: Some(0.95) };
        let draw = |seed: u64, routing: RoutingMode| {
            let mut session = model.session(&SessionOptions { routing, ..Default::default() }).unwrap();
            let options = GenerateOptions { sampling, seed, ..greedy(16) };
            let ids: Vec<u32> =
                session.generate(&e.prompt_ids, &options).unwrap().map(|id| id.unwrap()).collect();
            (ids, session.stats())
        };
        let (a, stats) = draw(3, RoutingMode::Readback);
        assert_eq!(a.len(), 16);
        assert_eq!(draw(3, RoutingMode::Readback).0, a, "the same seed draws the same tokens");
        assert_eq!(draw(3, RoutingMode::DeviceResident).0, a, "routing mode does not change the draws");
        assert_ne!(draw(4, RoutingMode::Readback).0, a, "another seed draws other tokens");
        // Every token fed (the prompt and 15 generated) was routed by every
        // MoE layer, and each routing was read back.
        let moe = model.config.moe.as_ref().unwrap();
        let fed = (e.prompt_ids.len() + 15) as u64;
        for (layer, counts) in stats.router_histogram.iter().enumerate() {
            if moe.sparse_layers[layer] {
                assert_eq!(counts.iter().sum::<u64>(), fed * moe.top_k as u64, "layer {layer}");
            }
        }
    });
}

#[test]
fn bad_generation_requests_are_typed_errors() {
    let cases = cases();
    let case = &cases[0];
    let gpu = common::gpu(common::backends()[0]);
    let model = Model::load(&case.dir, &gpu).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let vocab = model.config.vocab as u32;
    let check = |r: wgspark::Result<wgspark::Generation<'_, '_>>, want: &str| match r {
        Err(e) => assert!(format!("{e:?}").contains(want), "{e:?} names {want}"),
        Ok(_) => panic!("expected an error naming {want}"),
    };
    check(session.generate(&[], &greedy(4)), "EmptyPrompt");
    check(session.generate(&[vocab], &greedy(4)), "TokenOutOfRange");
    check(session.generate(&[1], &greedy(0)), "InvalidSampling");
    let hot = GenerateOptions {
        sampling: Sampling::Random { temperature: 0.0, top_k: None, top_p: None },
        ..greedy(4)
    };
    check(session.generate(&[1], &hot), "InvalidSampling");
    let long = vec![1; session.context_len() + 1];
    check(session.generate(&long, &greedy(4)), "ContextOverflow");
    assert_eq!(session.position(), 0, "a refused request feeds nothing");
}

/// Capture while generating reads each step's rows with its id (the
/// pipeline keeps going) and records what stepping records; rows of steps
/// computed past a stop are dropped.
#[test]
fn capture_while_generating_matches_capture_while_stepping() {
    use wgspark::{CaptureOptions, PromptRows};
    let cases = cases();
    let case = cases.iter().find(|c| c.name == "mixtral_deep").unwrap();
    let e = &case.expected;
    on_each_backend(|gpu| {
        let model = Model::load(&case.dir, gpu).unwrap();
        let options = SessionOptions { prefill_chunk: Some(5), ..exact() };
        let capture = CaptureOptions { layers: None, prompt_rows: PromptRows::All };
        let n = e.generated_ids.len();

        let mut stepping = model.session(&options).unwrap();
        stepping.set_capture(Some(&capture)).unwrap();
        let ids = stepped(&mut stepping, &e.prompt_ids, n);
        let want = stepping.take_capture().unwrap();

        let mut generating = model.session(&options).unwrap();
        generating.set_capture(Some(&capture)).unwrap();
        let got_ids: Vec<u32> =
            generating.generate(&e.prompt_ids, &greedy(n)).unwrap().map(|id| id.unwrap()).collect();
        assert_eq!(got_ids, ids);
        let got = generating.take_capture().unwrap();
        assert_eq!(got.positions, want.positions, "rows of every position fed, in order");
        assert_eq!(got.rows, want.rows, "the same kernels write the same rows");

        // Stopped at the third id with steps in flight: positions up to the
        // last token fed, nothing after.
        let mut stopped = model.session(&options).unwrap();
        stopped.set_capture(Some(&capture)).unwrap();
        let options = GenerateOptions { stop_tokens: vec![ids[2]], in_flight: 4, ..greedy(n) };
        let got_ids: Vec<u32> =
            stopped.generate(&e.prompt_ids, &options).unwrap().map(|id| id.unwrap()).collect();
        let fed = e.prompt_ids.len() + got_ids.len() - 1;
        let got = stopped.take_capture().unwrap();
        assert_eq!(got.positions, (0..fed).collect::<Vec<_>>());
        assert_eq!(got.layer(1).unwrap(), &want.layer(1).unwrap()[..fed * model.config.hidden]);
    });
}
