//! Prompts of text and images against transformers' Qwen3VLForConditionalGeneration
//! and Qwen3VLMoeForConditionalGeneration (fixtures from
//! `scripts/make_vl_fixtures.py`): one image, and two images of
//! different sizes, then greedy decoding. Every logits row within 1e-3 of
//! transformers' with an f32 cache (0.4 % of the row's largest with the
//! f16 one), ids identical, on Vulkan and GL; whatever the prefill chunk
//! (boundaries inside an image, and one token at a time).

mod common;

use std::path::{Path, PathBuf};

use common::{max_abs_diff, on_each_backend};
use wgspark::sampling::argmax;
use wgspark::vision::RgbImage;
use wgspark::{KvFormat, Model, PromptPart, SessionOptions};

/// The fixture folders: a dense and a MoE language model.
fn dirs() -> [PathBuf; 2] {
    ["qwen3_vl_images", "qwen3_vl_moe_images"]
        .map(|d| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(d))
}

enum Part {
    Text(Vec<u32>),
    Image(RgbImage),
}

struct Case {
    name: String,
    parts: Vec<Part>,
    prompt_len: usize,
    generated: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn cases(dir: &Path) -> Vec<Case> {
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected_images.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    e["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: format!("{}/{}", dir.file_name().unwrap().to_string_lossy(), c["name"].as_str().unwrap()),
            parts: c["parts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| match p.get("text") {
                    Some(t) => Part::Text(ids(t)),
                    None => Part::Image(RgbImage::open(&dir.join(p["image"].as_str().unwrap())).unwrap()),
                })
                .collect(),
            prompt_len: c["prompt_ids"].as_array().unwrap().len(),
            generated: ids(&c["generated_ids"]),
            logits: c["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
                .collect(),
        })
        .collect()
}

impl Case {
    fn prompt(&self) -> Vec<PromptPart<'_>> {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Text(ids) => PromptPart::Text(ids),
                Part::Image(image) => PromptPart::Image(image),
            })
            .collect()
    }
}

/// The case's rows: the prompt's last, then one per generated id fed.
fn replay(model: &Model, case: &Case, options: &SessionOptions) -> Vec<Vec<f32>> {
    let mut session = model.session(options).unwrap();
    let parts = case.prompt();
    let mut rows = vec![session.prefill_multimodal(&parts).unwrap()];
    assert_eq!(
        session.position(),
        case.prompt_len,
        "{}: the images expand as transformers' processor expands them",
        case.name
    );
    for &id in &case.generated[..case.generated.len() - 1] {
        let pos = session.position();
        rows.push(session.step(id, pos).unwrap());
    }
    rows
}

fn check(case: &Case, rows: &[Vec<f32>], (abs, rel): (f32, f32), what: &str) -> f32 {
    let mut worst = 0.0f32;
    for (i, (got, want)) in rows.iter().zip(&case.logits).enumerate() {
        let tolerance = abs.max(rel * want.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        let err = max_abs_diff(got, want);
        worst = worst.max(err);
        assert!(err <= tolerance, "{what}: row {i}: max |logit error| {err:.3e} > {tolerance:e}");
        assert_eq!(argmax(got), case.generated[i], "{what}: row {i}: greedy id");
    }
    worst
}

#[test]
fn image_prompts_match_transformers() {
    on_each_backend(|gpu| {
        for dir in dirs() {
            let cases = cases(&dir);
            assert!(cases.len() >= 2);
            let model = Model::load(&dir, gpu).unwrap();
            for case in &cases {
                for (format, tol) in [(KvFormat::F32, (1e-3, 0.0)), (KvFormat::F16, (0.0, 4e-3))] {
                    let options = SessionOptions { kv_format: format, ..common::fixtures::exact() };
                    let what = format!("{} on {:?}, {format:?} cache", case.name, gpu.info.backend);
                    let worst = check(case, &replay(&model, case, &options), tol, &what);
                    println!("{what}: max |logit error| {worst:.2e}");
                }
                // Chunks whose boundaries fall inside an image, and a token
                // at a time, give the same rows as one chunk.
                let whole = replay(&model, case, &common::fixtures::exact());
                for chunk in [5, 1] {
                    let options = SessionOptions { prefill_chunk: Some(chunk), ..common::fixtures::exact() };
                    let rows = replay(&model, case, &options);
                    for (i, (a, b)) in rows.iter().zip(&whole).enumerate() {
                        let d = max_abs_diff(a, b);
                        assert!(d <= 1e-5, "{}: chunks of {chunk}: row {i} differs by {d}", case.name);
                    }
                }
            }
        }
    });
}

/// With images in the prompt, capture records each layer's output at every
/// prompt position as transformers' hidden states give it (before the
/// deepstack rows are added), and steering adds its direction there.
#[test]
fn capture_and_steering_see_image_prompts() {
    use wgspark::{CaptureOptions, ControlVector, PromptRows, Steering};
    on_each_backend(|gpu| {
        for dir in dirs() {
            let model = Model::load(&dir, gpu).unwrap();
            let e: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("expected_images.json")).unwrap())
                    .unwrap();
            for (case, json) in cases(&dir).iter().zip(e["cases"].as_array().unwrap()) {
                let parts = case.prompt();
                let layers = model.config.layers;
                let capture = CaptureOptions { layers: None, prompt_rows: PromptRows::All };
                let run = |steering: Option<&Steering>| {
                    let mut session = model.session(&common::fixtures::exact()).unwrap();
                    session.set_steering(steering).unwrap();
                    session.set_capture(Some(&capture)).unwrap();
                    let logits = session.prefill_multimodal(&parts).unwrap();
                    (logits, session.take_capture().unwrap())
                };
                let (plain_logits, plain) = run(None);
                let want = json["layer_outputs"].as_array().unwrap();
                assert_eq!(want.len(), layers - 1);
                for (layer, rows) in want.iter().enumerate() {
                    let rows: Vec<f32> = rows
                        .as_array()
                        .unwrap()
                        .iter()
                        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
                        .collect();
                    common::assert_close(
                        &plain.rows[layer],
                        &rows,
                        1e-4,
                        &format!("{}: layer {layer}", case.name),
                    );
                }
                // A direction at the last layer: its rows move by exactly it.
                let hidden = model.config.hidden;
                let direction: Vec<f32> = (0..hidden).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.05).collect();
                let vector = ControlVector {
                    path: "test".into(),
                    model_hint: None,
                    directions: [(layers - 1, direction.clone())].into(),
                };
                let steering = Steering::new(&model.config, &[(vector, 2.0)], None).unwrap();
                let (steered_logits, steered) = run(Some(&steering));
                let last = layers - 1;
                for (row, (s, p)) in
                    steered.rows[last].chunks(hidden).zip(plain.rows[last].chunks(hidden)).enumerate()
                {
                    let moved: Vec<f32> = s.iter().zip(p).map(|(a, b)| a - b).collect();
                    let want: Vec<f32> = direction.iter().map(|d| 2.0 * d).collect();
                    common::assert_close(&moved, &want, 1e-5, &format!("{}: steered row {row}", case.name));
                }
                assert!(
                    max_abs_diff(&steered_logits, &plain_logits) > 1e-2,
                    "{}: steering moves the logits",
                    case.name
                );
            }
        }
    });
}
