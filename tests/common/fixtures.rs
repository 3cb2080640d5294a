//! Conformance fixture cases: folders with config.json, model.safetensors and
//! expected.json, made by scripts/make_fixtures.py.

use std::path::{Path, PathBuf};

#[derive(Debug, serde::Deserialize)]
pub struct Expected {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    /// A case's own bound on the exact configuration's error, tighter than
    /// the default (a checkpoint whose F32 tensors must stay F32).
    #[serde(default)]
    pub exact_tolerance: Option<f32>,
}

pub struct Case {
    pub name: String,
    pub dir: PathBuf,
    pub expected: Expected,
}

/// Every case under tests/fixtures and under each directory of the
/// colon-separated `WGSPARK_FIXTURES`. A listed directory that does not
/// exist, or holds no case, is an error, not a silent skip.
pub fn cases() -> Vec<Case> {
    let mut roots = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")];
    if let Ok(extra) = std::env::var("WGSPARK_FIXTURES") {
        roots.extend(extra.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    let mut cases = Vec::new();
    for root in roots {
        let mut found = 0;
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
            .unwrap_or_else(|e| panic!("fixture directory {}: {e}", root.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("expected.json").is_file())
            .collect();
        dirs.sort();
        for dir in dirs {
            let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
            let expected: Expected = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.join("expected.json").display()));
            assert_eq!(
                expected.logits.len(),
                expected.generated_ids.len(),
                "{}: one logits row per generated id",
                dir.display()
            );
            cases.push(Case { name: dir.file_name().unwrap().to_string_lossy().into_owned(), dir, expected });
            found += 1;
        }
        assert!(found > 0, "fixture directory {} holds no case", root.display());
    }
    cases
}

/// Runs a case as the fixture was made: the prompt, then each generated id
/// fed back. Returns one logits row per expected row.
pub fn replay(model: &wgspark::Model, e: &Expected) -> wgspark::Result<Vec<Vec<f32>>> {
    replay_with(model, e, &exact())
}

/// Session options whose logits are held to transformers' within 1e-3:
/// an f32 KV cache and, on cooperative matrices, prompt chunks multiplied
/// in two f16 parts (the defaults, f16 for both, have their own tolerance).
pub fn exact() -> wgspark::SessionOptions {
    wgspark::SessionOptions {
        kv_format: wgspark::KvFormat::F32,
        prefill_precision: wgspark::PrefillPrecision::Split,
        ..Default::default()
    }
}

/// As [`replay`], with a session opened with `options`.
pub fn replay_with(
    model: &wgspark::Model,
    e: &Expected,
    options: &wgspark::SessionOptions,
) -> wgspark::Result<Vec<Vec<f32>>> {
    let mut session = model.session(options)?;
    let mut rows = vec![session.prefill(&e.prompt_ids)?];
    for &id in &e.generated_ids[..e.generated_ids.len() - 1] {
        let pos = session.position();
        rows.push(session.step(id, pos)?);
    }
    Ok(rows)
}

pub fn expected(dir: &Path) -> Expected {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}
