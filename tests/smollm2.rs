//! The real default model: SmolLM2-135M-Instruct, obtained by wgspark itself
//! and loaded as shipped (a GGUF of Q4_1 layers and a Q8_0 embedding, its
//! tokenizer built from the file's metadata, its chat template rendered as
//! transformers renders it), continues three prompts with
//! exactly the greedy ids that transformers produced (recorded by
//! scripts/smollm2_reference.py), on every backend under test. Needs network
//! access on the first run.

mod common;

use common::{max_abs_diff, on_each_backend};
use wgspark::chat::Message;
use wgspark::sampling::argmax;
use wgspark::{Model, SessionOptions};

#[derive(serde::Deserialize)]
struct Reference {
    cases: Vec<Case>,
    chat: Chat,
}

/// A conversation and transformers' rendering of it with the file's template.
#[derive(serde::Deserialize)]
struct Chat {
    messages: Vec<ChatMessage>,
    text: String,
    first_turn: String,
}

#[derive(serde::Deserialize)]
struct ChatMessage {
    role: String,
    content: String,
}

#[derive(serde::Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    first_row_logits: Vec<f32>,
}

#[test]
fn smollm2_matches_transformers_greedy_ids() {
    let file = wgspark::fetch::default_model(|p| {
        if let wgspark::progress::Progress::Begin { what, .. } = p {
            eprintln!("{what}")
        }
    })
    .unwrap_or_else(|e| panic!("the default model could not be obtained: {e}"));
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/smollm2/expected.json");
    let reference: Reference = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();

    let mut tokenizer_checked = false;
    on_each_backend(|gpu| {
        let model = Model::load(&file, gpu).unwrap();
        if !tokenizer_checked {
            let template = model.chat_template().unwrap().expect("the GGUF carries a chat template");
            let messages: Vec<Message> =
                reference.chat.messages.iter().map(|m| Message::new(&m.role, &m.content)).collect();
            assert_eq!(template.render(&messages, true).unwrap(), reference.chat.text);
            // Without a system message the template adds its own.
            assert_eq!(template.render(&messages[1..2], true).unwrap(), reference.chat.first_turn);
            let tokenizer = model.tokenizer().unwrap().expect("the GGUF describes its tokenizer");
            for case in &reference.cases {
                let ids = tokenizer.encode(&case.prompt).unwrap();
                assert_eq!(
                    ids, case.prompt_ids,
                    "the GGUF's tokenizer encodes {:?} as transformers did",
                    case.prompt
                );
                let text = tokenizer.decode(&case.generated_ids, false).unwrap();
                assert!(!text.is_empty(), "decodes {:?}", case.generated_ids);
            }
            tokenizer_checked = true;
        }
        for case in &reference.cases {
            let mut session = model
                .session(&SessionOptions { context_len: Some(64), ..common::fixtures::exact() })
                .unwrap();
            let mut logits = session.prefill(&case.prompt_ids).unwrap();
            let first_row_error = max_abs_diff(&logits, &case.first_row_logits);
            let mut ids = Vec::new();
            for _ in 0..case.generated_ids.len() {
                let next = argmax(&logits);
                ids.push(next);
                if ids.len() < case.generated_ids.len() {
                    logits = session.step(next, session.position()).unwrap();
                }
            }
            eprintln!(
                "{:?} on {:?}: ids {} transformers'; first row max |logit error| {first_row_error:.2e}",
                case.prompt,
                gpu.info.backend,
                if ids == case.generated_ids { "match" } else { "DIFFER from" }
            );
            assert_eq!(ids, case.generated_ids, "{:?} on {:?}", case.prompt, gpu.info.backend);
            assert!(first_row_error <= 1e-3, "first row max |logit error| {first_row_error}");
        }
    });
}
