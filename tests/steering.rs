//! Control-vector steering and residual capture against transformers with
//! forward hooks (tests/steering/), for a dense and a MoE family: steered
//! logits within 1e-3 with identical greedy ids, capture within 1e-3 of the
//! hooked layer outputs, strength 0 identical to no steering, and both
//! writers' file layouts (llama.cpp's cvector-generator, repeng) loading.

mod common;

use common::fixtures::exact;

use common::steering::{SteeringCase, replay_steered, steering_cases};
use common::{max_abs_diff, on_each_backend};
use wgspark::sampling::argmax;
use wgspark::{
    Capture, CaptureOptions, ControlVector, Gpu, Model, PromptRows, RoutingMode, SessionOptions, Steering,
};

const TOLERANCE: f32 = 1e-3;

/// Worst |error| of `capture` against `want[layer][row]` over the rows
/// `first_row..` of `want`; checks layers and positions.
fn capture_error(capture: &Capture, want: &[Vec<Vec<f32>>], first_row: usize, prompt_len: usize) -> f32 {
    let n_rows = want[0].len() - first_row;
    assert_eq!(capture.n_rows(), n_rows, "captured rows");
    let positions: Vec<usize> = (first_row..first_row + n_rows).collect();
    assert_eq!(capture.positions, positions, "positions (prompt of {prompt_len})");
    let mut worst = 0.0f32;
    for &layer in &capture.layers {
        let got = capture.layer(layer).unwrap();
        let want_rows: Vec<f32> = want[layer][first_row..].concat();
        worst = worst.max(max_abs_diff(got, &want_rows));
    }
    worst
}

fn check_rows(what: &str, rows: &[Vec<f32>], logits: &[Vec<f32>], ids: &[u32]) -> f32 {
    assert_eq!(rows.len(), logits.len(), "{what}: rows");
    let mut worst = 0.0f32;
    for (row, (got, want)) in rows.iter().zip(logits).enumerate() {
        let err = max_abs_diff(got, want);
        assert!(err <= TOLERANCE, "{what}: row {row}: max |logit error| {err:.3e}");
        assert_eq!(argmax(got), ids[row], "{what}: row {row}: greedy id");
        worst = worst.max(err);
    }
    worst
}

/// The two ways a session runs a case: one prefill submission capturing
/// every prompt row; and a 5-token prefill chunk (several submissions),
/// device-resident routing, capturing only the last prompt row.
fn variants() -> [(&'static str, SessionOptions, CaptureOptions); 2] {
    [
        (
            "one chunk, all prompt rows",
            exact(),
            CaptureOptions { layers: None, prompt_rows: PromptRows::All },
        ),
        (
            "5-token chunks, device routing, last prompt row",
            SessionOptions { prefill_chunk: Some(5), routing: RoutingMode::DeviceResident, ..exact() },
            CaptureOptions { layers: None, prompt_rows: PromptRows::Last },
        ),
    ]
}

fn run_case(gpu: &Gpu, case: &SteeringCase) {
    let model = Model::load(case.model_dir(), gpu).unwrap();
    let prompt_len = case.prompt_ids.len();
    for run in &case.runs {
        let steering = case.steering(&model, &run.vectors, run.layer_range);
        for (variant, options, capture_options) in variants() {
            let what = format!("{} {} on {:?} ({variant})", case.name(), run.name, gpu.info.backend);
            let (rows, capture, stats) = replay_steered(
                &model,
                &options,
                Some(&steering),
                &capture_options,
                &case.prompt_ids,
                &run.generated_ids,
            )
            .unwrap();
            let logit_err = check_rows(&what, &rows, &run.logits, &run.generated_ids);
            let first_row = match capture_options.prompt_rows {
                PromptRows::All => 0,
                PromptRows::Last => prompt_len - 1,
            };
            let capture_err = capture_error(&capture, &run.capture, first_row, prompt_len);
            assert!(capture_err <= TOLERANCE, "{what}: capture max |error| {capture_err:.3e}");
            // Once per step, however many layers.
            let submissions_read = match capture_options.prompt_rows {
                PromptRows::All => prompt_len.div_ceil(options.prefill_chunk.unwrap_or(prompt_len)),
                PromptRows::Last => 1,
            };
            assert_eq!(
                stats.capture_readbacks as usize,
                submissions_read + run.generated_ids.len() - 1,
                "{what}: capture readbacks"
            );
            eprintln!("{what}: max |logit error| {logit_err:.2e}, capture {capture_err:.2e}");
        }
    }
}

#[test]
fn steered_logits_and_capture_match_transformers() {
    let cases = steering_cases();
    on_each_backend(|gpu| {
        for case in &cases {
            run_case(gpu, case);
        }
    });
}

#[test]
fn strength_zero_equals_unsteered() {
    let cases = steering_cases();
    on_each_backend(|gpu| {
        for case in &cases {
            let model = Model::load(case.model_dir(), gpu).unwrap();
            let base = common::fixtures::expected(&case.model_dir());
            let all_files: Vec<(String, f32)> =
                case.runs[0].vectors.iter().map(|(f, _)| (f.clone(), 0.0)).collect();
            let zero = case.steering(&model, &all_files, None);
            let capture = CaptureOptions { layers: None, prompt_rows: PromptRows::All };
            let options = exact();
            let (plain, plain_capture, _) =
                replay_steered(&model, &options, None, &capture, &case.prompt_ids, &base.generated_ids)
                    .unwrap();
            let (zeroed, zeroed_capture, _) = replay_steered(
                &model,
                &options,
                Some(&zero),
                &capture,
                &case.prompt_ids,
                &base.generated_ids,
            )
            .unwrap();
            let what = format!("{} on {:?}", case.name(), gpu.info.backend);
            assert_eq!(zeroed, plain, "{what}: strength 0 changed the logits");
            assert_eq!(zeroed_capture, plain_capture, "{what}: strength 0 changed the capture");
            check_rows(&what, &plain, &base.logits, &base.generated_ids);
            let err = capture_error(&plain_capture, &case.unsteered_capture, 0, case.prompt_ids.len());
            assert!(err <= TOLERANCE, "{what}: unsteered capture max |error| {err:.3e}");
        }
    });
}

/// A steering case on the first backend under test: the case, its model,
/// and the steering of its first run (both files, every layer).
fn first_run(base: &str) -> (SteeringCase, Model, Steering) {
    let case = steering_cases().into_iter().find(|c| c.base == base).unwrap();
    let model = Model::load(case.model_dir(), &common::gpu(common::backends()[0])).unwrap();
    let run = &case.runs[0];
    let steering = case.steering(&model, &run.vectors, run.layer_range);
    (case, model, steering)
}

#[test]
fn capture_of_chosen_layers_and_safetensors_file() {
    let (case, model, steering) = first_run("mixtral_deep");
    let run = &case.runs[0];
    let options = CaptureOptions { layers: Some(vec![3, 1, 3]), prompt_rows: PromptRows::Last };
    let (_, capture, _) =
        replay_steered(&model, &exact(), Some(&steering), &options, &case.prompt_ids, &run.generated_ids)
            .unwrap();
    assert_eq!(capture.layers, [1, 3]);
    let first_row = case.prompt_ids.len() - 1;
    assert!(capture_error(&capture, &run.capture, first_row, case.prompt_ids.len()) <= TOLERANCE);

    let path = common::checkpoint::temp_dir("capture").file("resid.safetensors");
    capture.write_safetensors(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    assert_eq!(names, ["resid.layer.1", "resid.layer.3"]);
    for layer in [1, 3] {
        let t = file.tensor(&format!("resid.layer.{layer}")).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        assert_eq!(t.shape(), [capture.n_rows(), model.config.hidden]);
        let values: Vec<f32> = bytemuck::pod_collect_to_vec(t.data());
        assert_eq!(values, capture.layer(layer).unwrap());
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let positions: Vec<usize> =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["positions"]).unwrap();
    assert_eq!(positions, capture.positions);
}

#[test]
fn steering_is_set_and_cleared_between_steps() {
    let (case, model, steering) = first_run("mistral_window");
    let run = &case.runs[0];
    let mut session = model.session(&exact()).unwrap();
    session.set_steering(Some(&steering)).unwrap();
    let steered = session.prefill(&case.prompt_ids).unwrap();
    assert!(max_abs_diff(&steered, &run.logits[0]) <= TOLERANCE);
    // Steering off from here: the next position runs unsteered layers over
    // a steered prefix, which differs from both fixtures' runs.
    session.set_steering(None).unwrap();
    let next = session.step(run.generated_ids[0], case.prompt_ids.len()).unwrap();
    assert!(max_abs_diff(&next, &run.logits[1]) > 1e-2, "steering was not cleared");
    // And on again: rewinding one position gives the steered row back.
    session.truncate(case.prompt_ids.len());
    session.set_steering(Some(&steering)).unwrap();
    let again = session.step(run.generated_ids[0], case.prompt_ids.len()).unwrap();
    assert!(max_abs_diff(&again, &run.logits[1]) <= TOLERANCE);
}

#[test]
fn control_vector_files_load_in_both_layouts() {
    for case in steering_cases() {
        let config = wgspark::ModelConfig::load(&case.model_dir()).unwrap();
        for file in ["llama_cpp.gguf", "repeng.gguf"] {
            let path = case.dir.join(file);
            let v = ControlVector::load(&path).unwrap();
            assert_eq!(v.model_hint.as_deref(), Some(config.model_type.as_str()), "{file}: model_hint");
            assert_eq!(
                v.directions.keys().copied().collect::<Vec<_>>(),
                (1..config.layers).collect::<Vec<_>>()
            );
            assert_eq!(v.hidden(), config.hidden);
            // What save writes (llama.cpp's layout) reads back the same.
            let copy = common::checkpoint::temp_dir("cvec").file(file);
            v.save(&copy).unwrap();
            let reread = ControlVector::load(&copy).unwrap();
            assert_eq!((reread.model_hint, reread.directions), (v.model_hint.clone(), v.directions.clone()));
        }
    }
}

#[test]
fn layer_range_limits_and_sums_scale() {
    let case = steering_cases().into_iter().find(|c| c.base == "mixtral_deep").unwrap();
    let config = wgspark::ModelConfig::load(&case.model_dir()).unwrap();
    let a = ControlVector::load(case.dir.join("llama_cpp.gguf")).unwrap();
    let b = ControlVector::load(case.dir.join("repeng.gguf")).unwrap();
    let s = Steering::new(&config, &[(a.clone(), 2.0), (b.clone(), -0.5)], Some(2..=9)).unwrap();
    assert_eq!(s.steered_layers().collect::<Vec<_>>(), [2, 3], "the range is cut at the last layer");
    let want: Vec<f32> =
        a.directions[&3].iter().zip(&b.directions[&3]).map(|(x, y)| 2.0 * x - 0.5 * y).collect();
    assert_eq!(s.layer(3).unwrap(), want.as_slice());
    assert!(s.layer(1).is_none() && s.layer(0).is_none());
}
