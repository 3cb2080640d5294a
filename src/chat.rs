//! A model's chat template, from its own files (a GGUF's
//! `tokenizer.chat_template`, or a folder's tokenizer_config.json), rendered
//! with minijinja as transformers renders it with Jinja: the messages, the
//! `add_generation_prompt` flag, the special tokens, Python's string
//! methods, and `raise_exception`.

use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.to_string(), content: content.to_string() }
    }
}

/// A Jinja chat template and the special tokens it may name.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
    /// Where it came from, for errors.
    origin: String,
}

impl ChatTemplate {
    /// The template of a GGUF file (`None`: it has none).
    pub fn from_gguf(g: &Gguf) -> Result<Option<Self>> {
        let Ok(source) = g.meta_str("tokenizer.chat_template") else { return Ok(None) };
        let token = |key: &str| -> String {
            let tokens = g.meta_strings("tokenizer.ggml.tokens").unwrap_or_default();
            g.meta_int(key)
                .ok()
                .and_then(|id| tokens.get(id as usize).map(|t| t.to_string()))
                .unwrap_or_default()
        };
        Ok(Some(ChatTemplate {
            source: source.to_string(),
            bos_token: token("tokenizer.ggml.bos_token_id"),
            eos_token: token("tokenizer.ggml.eos_token_id"),
            origin: g.path().display().to_string(),
        }))
    }

    /// The template of a Hugging Face folder's tokenizer_config.json
    /// (`None`: there is no such file or it has no template).
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = crate::error::read_text(&path, crate::error::MAX_JSON_BYTES)?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Json { path: path.clone(), message: e.to_string() })?;
        let Some(source) = config.get("chat_template").and_then(|t| t.as_str()) else { return Ok(None) };
        // Special tokens are strings, or {"content": ...} objects.
        let token = |key: &str| -> String {
            match config.get(key) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => v.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
                None => String::new(),
            }
        };
        Ok(Some(ChatTemplate {
            source: source.to_string(),
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            origin: path.display().to_string(),
        }))
    }

    /// The text of `messages`, ending with the assistant's opening when
    /// `add_generation_prompt` is set.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let error = |e: minijinja::Error| Error::ChatTemplate {
            origin: self.origin.clone(),
            message: format!("{e:#}"),
        };
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template("chat", &self.source).map_err(error)?;
        let template = env.get_template("chat").map_err(error)?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(error)
    }
}
