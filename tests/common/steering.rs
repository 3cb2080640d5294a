//! Steering fixture cases (tests/steering/, made by scripts/make_fixtures.py
//! --steering): a fixture case run with control vector files, with
//! transformers' logits and hooked layer outputs.

use std::path::{Path, PathBuf};

use wgspark::{Capture, CaptureOptions, ControlVector, Model, SessionOptions, Stats, Steering};

#[derive(Debug, serde::Deserialize)]
pub struct SteeringCase {
    /// The fixture case (tests/fixtures/<base>) whose model is steered.
    pub base: String,
    pub prompt_ids: Vec<u32>,
    pub runs: Vec<Run>,
    /// `[layer][row][i]`: every prompt row, then each decoded token's.
    pub unsteered_capture: Vec<Vec<Vec<f32>>>,
    #[serde(skip)]
    pub dir: PathBuf,
}

#[derive(Debug, serde::Deserialize)]
pub struct Run {
    pub name: String,
    /// (file in the case folder, strength)
    pub vectors: Vec<(String, f32)>,
    /// Inclusive.
    pub layer_range: Option<(usize, usize)>,
    pub generated_ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    /// `[layer][row][i]`, after steering.
    pub capture: Vec<Vec<Vec<f32>>>,
}

pub fn steering_cases() -> Vec<SteeringCase> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 2, "{} should hold a dense and a MoE case", root.display());
    dirs.into_iter()
        .map(|dir| {
            let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
            let mut case: SteeringCase = serde_json::from_str(&text).unwrap();
            case.dir = dir;
            case
        })
        .collect()
}

impl SteeringCase {
    pub fn name(&self) -> String {
        self.dir.file_name().unwrap().to_string_lossy().into_owned()
    }

    pub fn model_dir(&self) -> PathBuf {
        super::checkpoint::fixture_dir(&self.base)
    }

    pub fn steering(
        &self,
        model: &Model,
        vectors: &[(String, f32)],
        range: Option<(usize, usize)>,
    ) -> Steering {
        let vectors: Vec<(ControlVector, f32)> =
            vectors.iter().map(|(file, s)| (ControlVector::load(self.dir.join(file)).unwrap(), *s)).collect();
        Steering::new(&model.config, &vectors, range.map(|(a, b)| a..=b)).unwrap()
    }
}

/// The prompt, then each id of `generated` but the last fed back, with
/// `steering` and `capture` set: one logits row per generated id, the
/// capture, and the session's stats.
pub fn replay_steered(
    model: &Model,
    options: &SessionOptions,
    steering: Option<&Steering>,
    capture: &CaptureOptions,
    prompt: &[u32],
    generated: &[u32],
) -> wgspark::Result<(Vec<Vec<f32>>, Capture, Stats)> {
    let mut session = model.session(options)?;
    session.set_steering(steering)?;
    session.set_capture(Some(capture))?;
    let mut rows = vec![session.prefill(prompt)?];
    for &id in &generated[..generated.len() - 1] {
        let pos = session.position();
        rows.push(session.step(id, pos)?);
    }
    let capture = session.take_capture().expect("capture is on");
    Ok((rows, capture, session.stats()))
}
