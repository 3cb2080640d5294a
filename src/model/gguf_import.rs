//! GGUF import: reads a llama-architecture GGUF file (llama.cpp's format),
//! dequantizes its tensors and writes a Hugging Face folder (config.json,
//! bf16 model.safetensors, tokenizer.json) that [`crate::Model::load`] and
//! transformers both read.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::gguf::{Gguf, Meta};

/// llama.cpp stores q and k rows interleaved for its RoPE (pairs `2i, 2i+1`);
/// transformers pairs `i, i + d/2`. HF row `h*d + j*d/2 + i` is GGUF row
/// `h*d + 2i + j`.
fn unpermute_rows(values: &[f32], n_heads: usize, cols: usize) -> Vec<f32> {
    let rows = values.len() / cols;
    let d = rows / n_heads;
    let mut out = vec![0.0; values.len()];
    for h in 0..n_heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let hf = h * d + j * d / 2 + i;
                let gg = h * d + 2 * i + j;
                out[hf * cols..(hf + 1) * cols].copy_from_slice(&values[gg * cols..(gg + 1) * cols]);
            }
        }
    }
    out
}

/// Converts a llama-architecture GGUF file into a Hugging Face folder at
/// `out`: config.json, model.safetensors (bf16), tokenizer.json and
/// tokenizer_config.json.
pub fn convert_llama_to_hf(gguf_path: &Path, out: &Path) -> Result<()> {
    let g = Gguf::open(gguf_path)?;
    let arch = g.meta_str("general.architecture")?.to_string();
    if arch != "llama" {
        return Err(Error::UnsupportedArchitecture {
            model_type: arch,
            supported: "llama (GGUF import)".into(),
        });
    }
    let key = |k: &str| format!("llama.{k}");
    let hidden = g.meta_int(&key("embedding_length"))? as usize;
    let heads = g.meta_int(&key("attention.head_count"))? as usize;
    let kv_heads = g.meta_int(&key("attention.head_count_kv")).unwrap_or(heads as i64) as usize;
    let tokens = g.meta_strings("tokenizer.ggml.tokens")?;
    let vocab = tokens.len();
    let tied = g.tensor("output.weight").is_none();
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": g.meta_int(&key("feed_forward_length"))?,
        "num_hidden_layers": g.meta_int(&key("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden / heads,
        "rms_norm_eps": g.meta_float(&key("attention.layer_norm_rms_epsilon"))?,
        "rope_theta": g.meta_float(&key("rope.freq_base")).unwrap_or(10_000.0),
        "max_position_embeddings": g.meta_int(&key("context_length"))?,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": g.meta_int("tokenizer.ggml.bos_token_id").ok(),
        "eos_token_id": g.meta_int("tokenizer.ggml.eos_token_id").ok(),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    });

    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out.join(name);
        std::fs::write(&path, bytes).map_err(|e| Error::io(&path, e))
    };

    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in &g.tensors {
        let hf_name =
            hf_tensor_name(&t.name).ok_or_else(|| g.err(format!("unexpected tensor {}", t.name)))?;
        let shape = t.shape();
        let mut values = g.dequantize(t)?;
        let cols = *shape.last().unwrap();
        if t.name.ends_with("attn_q.weight") {
            values = unpermute_rows(&values, heads, cols);
        } else if t.name.ends_with("attn_k.weight") {
            values = unpermute_rows(&values, kv_heads, cols);
        }
        let bytes = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        tensors.push((hf_name, shape, bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes)
                .expect("shape and byte count agree");
            (name.clone(), view)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let st = safetensors::serialize(views, Some(metadata)).map_err(|e| g.err(e.to_string()))?;
    write("model.safetensors", &st)?;
    write("config.json", serde_json::to_string_pretty(&config).unwrap().as_bytes())?;
    write("tokenizer.json", serde_json::to_string(&tokenizer_json(&g, &tokens)?).unwrap().as_bytes())?;
    let token_name = |k: &str| -> Value {
        g.meta_int(k).ok().and_then(|id| tokens.get(id as usize)).map_or(Value::Null, |t| json!(t))
    };
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_name("tokenizer.ggml.bos_token_id"),
        "eos_token": token_name("tokenizer.ggml.eos_token_id"),
        "unk_token": token_name("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_name("tokenizer.ggml.padding_token_id"),
        "chat_template": g.meta_str("tokenizer.chat_template").ok(),
        "add_bos_token": false,
        "model_max_length": g.meta_int(&key("context_length"))?,
    });
    write("tokenizer_config.json", serde_json::to_string_pretty(&tokenizer_config).unwrap().as_bytes())
}

fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
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
