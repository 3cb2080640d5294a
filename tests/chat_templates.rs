//! Chat templates render as transformers renders them: its jinja2
//! environment's whitespace rules (trim_blocks, lstrip_blocks), loop controls
//! and neighbours, its `{% generation %}` tags and its undefined values'
//! length of 0, over conversations whose
//! expected text transformers wrote
//! (tests/fixtures/chat_templates/cases.json, from
//! scripts/make_chat_template_fixtures.py).

use wgspark::chat::{ChatTemplate, Message};

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    template: String,
    bos_token: String,
    eos_token: String,
    renders: Vec<Render>,
}

#[derive(serde::Deserialize)]
struct Render {
    messages: Vec<Turn>,
    add_generation_prompt: bool,
    text: String,
}

#[derive(serde::Deserialize)]
struct Turn {
    role: String,
    content: String,
}

#[test]
fn templates_render_as_transformers_renders_them() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat_templates/cases.json");
    let cases: Vec<Case> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let scratch = tempfile::Builder::new().prefix("wgspark-test-chat-").tempdir().unwrap();
        let dir = scratch.path();
        let config = serde_json::json!({
            "chat_template": case.template,
            "bos_token": case.bos_token,
            "eos_token": case.eos_token,
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_folder(dir).unwrap().expect("a template");
        for (i, render) in case.renders.iter().enumerate() {
            let messages: Vec<Message> =
                render.messages.iter().map(|t| Message::new(&t.role, &t.content)).collect();
            let text = template.render(&messages, render.add_generation_prompt).unwrap();
            assert_eq!(text, render.text, "{} conversation {i}", case.name);
        }
    }
}
