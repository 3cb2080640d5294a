//! A model's tokenizer, from its own files, built with the `tokenizers`
//! library: a Hugging Face folder's tokenizer.json, or a GGUF file's
//! metadata (llama.cpp's `gpt2` byte-level BPE, with the pre-tokenizer its
//! `tokenizer.ggml.pre` names). A GGUF with another tokenizer model (such
//! as `llama` SentencePiece) has none here yet: prompts are then given as
//! ids.

use std::path::Path;

use serde_json::{Value, json};
pub use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::gguf::{Gguf, Meta};

/// The tokenizer of a Hugging Face folder (`None`: it has no tokenizer.json).
pub fn from_folder(dir: &Path) -> Result<Option<Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| Error::Tokenizer { source_file: path.clone(), message: e.to_string() })
}

/// The tokenizer a GGUF file describes (`None`: its tokenizer model is not
/// one built here, or it has none).
pub fn from_gguf(g: &Gguf) -> Result<Option<Tokenizer>> {
    if g.meta_str("tokenizer.ggml.model").ok() != Some("gpt2") {
        return Ok(None);
    }
    let tokens = g.meta_strings("tokenizer.ggml.tokens")?;
    let json = tokenizer_json(g, &tokens)?;
    let tokenizer: Tokenizer = serde_json::from_value(json)
        .map_err(|e| Error::Tokenizer { source_file: g.path().to_path_buf(), message: e.to_string() })?;
    Ok(Some(tokenizer))
}

/// A tokenizers-library `tokenizer.json` for a GPT-2 style byte-level BPE
/// vocabulary (tokenizer.ggml.model = "gpt2"). Control tokens (type 3) are
/// special added tokens.
fn tokenizer_json(g: &Gguf, tokens: &[&str]) -> Result<Value> {
    let model = g.meta_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::Unsupported { what: "GGUF tokenizer model", value: model.to_string() });
    }
    let merges = g.meta_strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g.meta("tokenizer.ggml.token_type")? {
        Meta::Array(items) => items.iter().map(|m| if let Meta::Int(v) = m { *v } else { 1 }).collect(),
        _ => vec![1; tokens.len()],
    };
    // llama.cpp's pre-tokenizer names; these split digits one by one before
    // the GPT-2 byte-level regex.
    let digits_first = matches!(
        g.meta_str("tokenizer.ggml.pre").unwrap_or("default"),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b"
    );
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = if digits_first {
        json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
    } else {
        byte_level.clone()
    };
    let vocab: serde_json::Map<String, Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types.get(*i) == Some(&3))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}
