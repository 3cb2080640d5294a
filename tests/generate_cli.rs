//! The `generate` example as scripts use it: `--prompt-ids ... --json` prints
//! one JSON object whose ids and logits match every fixture, on every
//! backend under test; bad input exits non-zero with a message.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::fixtures::cases;
use common::max_abs_diff;

/// The example binary `cargo test` builds beside this test.
fn generate_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let bin = profile_dir.join("examples").join(format!("generate{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run the whole suite with `cargo test`, which builds the examples",
        bin.display()
    );
    bin
}

#[test]
fn json_output_matches_every_fixture() {
    let bin = generate_bin();
    for backend in common::backends() {
        for case in cases() {
            let e = &case.expected;
            let ids: Vec<String> = e.prompt_ids.iter().map(u32::to_string).collect();
            let out = Command::new(&bin)
                .arg("--model")
                .arg(&case.dir)
                .args(["--prompt-ids", &ids.join(",")])
                .args(["--max-new-tokens", &e.generated_ids.len().to_string()])
                .args(["--ignore-eos", "--json", "--backend", &format!("{backend:?}")])
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{} on {backend:?}: {stderr}", case.name);
            let json: serde_json::Value = serde_json::from_slice(&out.stdout)
                .unwrap_or_else(|err| panic!("{}: stdout is not one JSON object: {err}", case.name));
            let got_ids: Vec<u32> = serde_json::from_value(json["generated_ids"].clone()).unwrap();
            let prompt: Vec<u32> = serde_json::from_value(json["prompt_ids"].clone()).unwrap();
            let rows: Vec<Vec<f32>> = serde_json::from_value(json["logits"].clone()).unwrap();
            assert_eq!(prompt, e.prompt_ids);
            assert_eq!(got_ids, e.generated_ids, "{} on {backend:?}", case.name);
            assert_eq!(rows.len(), e.logits.len());
            for (row, (got, want)) in rows.iter().zip(&e.logits).enumerate() {
                let err = max_abs_diff(got, want);
                assert!(err <= 1e-3, "{} on {backend:?}, row {row}: {err}", case.name);
            }
        }
    }
}

#[test]
fn bad_input_exits_with_a_message() {
    let bin = generate_bin();
    let fixture = common::checkpoint::fixture_dir("llama_untied");
    for (args, needle) in [
        (
            vec!["--model".to_string(), "/nonexistent/model".into(), "--prompt-ids".into(), "1".into()],
            "config.json",
        ),
        (
            vec!["--model".into(), fixture.display().to_string(), "--prompt-ids".into(), "1,99999".into()],
            "out of range",
        ),
        (vec!["--backend".into(), "cuda".into(), "--prompt-ids".into(), "1".into()], "unknown backend"),
    ] {
        let out = Command::new(&bin).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty() || !String::from_utf8_lossy(&out.stdout).contains('{'));
    }
}
