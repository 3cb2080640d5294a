//! A model's tokenizer, from its own files, built with the `tokenizers`
//! library: a Hugging Face folder's tokenizer.json, or a GGUF file's
//! metadata: llama.cpp's `gpt2` byte-level BPE (with the pre-tokenizer its
//! `tokenizer.ggml.pre` names) or `llama` SentencePiece BPE (merges by the
//! pieces' scores, byte fallback, the dummy space prefix). A GGUF with
//! another tokenizer model has none here: prompts are then given as ids.

use std::path::Path;

use serde_json::{Value, json};
pub use tokenizers::Tokenizer;

use crate::error::{Error, Result};
use crate::gguf::{Gguf, Meta};

/// The tokenizer of a Hugging Face folder (`None`: it has no tokenizer.json).
pub fn from_folder(dir: &Path) -> Result<Option<Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    crate::error::check_regular_file(&path)?;
    Tokenizer::from_file(&path)
        .map(Some)
        .map_err(|e| Error::Tokenizer { source_file: path.clone(), message: e.to_string() })
}

/// The tokenizer a GGUF file describes (`None`: its tokenizer model is not
/// one built here, or it has none).
pub fn from_gguf(g: &Gguf) -> Result<Option<Tokenizer>> {
    let json = match g.meta_str("tokenizer.ggml.model").ok() {
        Some("gpt2") => tokenizer_json(g, &g.meta_strings("tokenizer.ggml.tokens")?)?,
        Some("llama") => sentencepiece_json(g, &g.meta_strings("tokenizer.ggml.tokens")?)?,
        _ => return Ok(None),
    };
    let tokenizer: Tokenizer = serde_json::from_value(json)
        .map_err(|e| Error::Tokenizer { source_file: g.path().to_path_buf(), message: e.to_string() })?;
    Ok(Some(tokenizer))
}

/// llama.cpp's token types.
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Each token's type (`tokenizer.ggml.token_type`; normal where absent).
fn token_types(g: &Gguf, n: usize) -> Result<Vec<i64>> {
    Ok(match g.meta("tokenizer.ggml.token_type") {
        Ok(Meta::Array(items)) => {
            items.iter().map(|m| if let Meta::Int(v) = m { *v } else { NORMAL }).collect()
        }
        _ => vec![NORMAL; n],
    })
}

/// Control tokens as special added tokens, user-defined ones as plain added
/// tokens: both are matched whole before the model splits the rest.
fn added_tokens(tokens: &[&str], types: &[i64]) -> Vec<Value> {
    tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(&CONTROL) | Some(&USER_DEFINED)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": types[i] == CONTROL})
        })
        .collect()
}

fn bool_meta(g: &Gguf, key: &str, default: bool) -> bool {
    match g.meta(key) {
        Ok(Meta::Bool(b)) => *b,
        _ => default,
    }
}

/// A tokenizers-library `tokenizer.json` for a SentencePiece BPE vocabulary
/// (tokenizer.ggml.model = "llama"), as transformers converts one: spaces
/// become `▁` (and one is put in front where `add_space_prefix`), pieces
/// merge in the order of their scores (the file's merges where it has
/// them), characters outside the vocabulary fall back to byte tokens, and
/// the BOS token leads an encoding with special tokens where `add_bos_token`.
fn sentencepiece_json(g: &Gguf, tokens: &[&str]) -> Result<Value> {
    let types = token_types(g, tokens.len())?;
    let merges: Vec<Value> = match g.meta_strings("tokenizer.ggml.merges") {
        Ok(merges) => merges.into_iter().map(|m| json!(m)).collect(),
        Err(_) => score_merges(g, tokens, &types)?,
    };
    let token_at = |key: &str| -> Option<&str> {
        g.meta_int(key).ok().and_then(|i| usize::try_from(i).ok()).and_then(|i| tokens.get(i).copied())
    };
    let space_prefix = bool_meta(g, "tokenizer.ggml.add_space_prefix", true);
    let mut normalizers = vec![json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"})];
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if space_prefix {
        normalizers.insert(0, json!({"type": "Prepend", "prepend": "\u{2581}"}));
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let bos_id = g.meta_int("tokenizer.ggml.bos_token_id").ok();
    let post_processor = match (bos_id, token_at("tokenizer.ggml.bos_token_id")) {
        (Some(id), Some(bos)) if bool_meta(g, "tokenizer.ggml.add_bos_token", true) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}},
        }),
        _ => Value::Null,
    };
    let normalizer = json!({"type": "Sequence", "normalizers": normalizers});
    let decoder = json!({"type": "Sequence", "decoders": decoders});
    let bpe = json!({"unk_token": token_at("tokenizer.ggml.unknown_token_id"), "fuse_unk": true, "byte_fallback": true});
    Ok(document(tokens, &types, merges, [normalizer, Value::Null, post_processor, decoder], bpe))
}

/// SentencePiece BPE merges the adjacent pair whose joined piece scores
/// highest: every way of splitting a normal piece into two normal pieces is
/// a merge, ranked by the joined piece's score (ties by id), as
/// transformers derives them.
fn score_merges(g: &Gguf, tokens: &[&str], types: &[i64]) -> Result<Vec<Value>> {
    let scores: Vec<f64> = match g.meta("tokenizer.ggml.scores")? {
        Meta::Array(items) => items.iter().map(|m| if let Meta::Float(v) = m { *v } else { 0.0 }).collect(),
        _ => return Err(Error::Unsupported { what: "tokenizer.ggml.scores", value: "not an array".into() }),
    };
    if scores.len() != tokens.len() {
        return Err(Error::Tokenizer {
            source_file: g.path().to_path_buf(),
            message: format!("{} scores for {} tokens", scores.len(), tokens.len()),
        });
    }
    let normal = |i: usize| types.get(i).is_none_or(|t| *t == NORMAL);
    let ids: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().filter(|(i, _)| normal(*i)).map(|(i, t)| (*t, i)).collect();
    let mut ranked: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (joined, piece) in tokens.iter().enumerate().filter(|(i, _)| normal(*i)) {
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&piece[..split]), ids.get(&piece[split..])) {
                ranked.push((scores[joined], joined, l, r));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3))));
    Ok(ranked.into_iter().map(|(_, _, l, r)| json!([tokens[l], tokens[r]])).collect())
}

/// A tokenizers-library `tokenizer.json` for a GPT-2 style byte-level BPE
/// vocabulary (tokenizer.ggml.model = "gpt2").
fn tokenizer_json(g: &Gguf, tokens: &[&str]) -> Result<Value> {
    let merges = g.meta_strings("tokenizer.ggml.merges")?;
    let types = token_types(g, tokens.len())?;
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
    let decoder =
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let bpe = json!({"unk_token": null, "fuse_unk": false, "byte_fallback": false});
    let merges = merges.into_iter().map(|m| json!(m)).collect();
    Ok(document(tokens, &types, merges, [Value::Null, pre_tokenizer, byte_level, decoder], bpe))
}

/// A tokenizers-library `tokenizer.json` of a BPE model over `tokens`:
/// `stages` are the normalizer, pre-tokenizer, post-processor and decoder,
/// `bpe` the model fields that differ between vocabularies (unk_token,
/// fuse_unk, byte_fallback).
fn document(tokens: &[&str], types: &[i64], merges: Vec<Value>, stages: [Value; 4], bpe: Value) -> Value {
    let vocab: serde_json::Map<String, Value> =
        tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
    let mut model = json!({
        "type": "BPE", "dropout": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
        "ignore_merges": false, "vocab": vocab, "merges": merges,
    });
    model.as_object_mut().unwrap().extend(bpe.as_object().cloned().unwrap_or_default());
    let [normalizer, pre_tokenizer, post_processor, decoder] = stages;
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens(tokens, types),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model,
    })
}
