//! GGUF import: reads a llama-architecture GGUF file (llama.cpp's format),
//! dequantizes its tensors and writes a Hugging Face folder (config.json,
//! bf16 model.safetensors, tokenizer.json) that [`crate::Model::load`] and
//! transformers both read.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Error, Result};

/// A metadata value of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<usize>,
    pub ggml_type: u32,
    offset: usize,
}

/// A GGUF file read into memory.
pub struct Gguf {
    path: PathBuf,
    bytes: Vec<u8>,
    pub metadata: HashMap<String, Meta>,
    pub tensors: Vec<TensorInfo>,
    data_start: usize,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn err(&self, message: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            message: format!("{} (at byte {})", message.into(), self.pos),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| self.err("unexpected end of file"))?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        if n > self.bytes.len() as u64 {
            return Err(self.err(format!("length {n} exceeds the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        let bytes = self.take(n)?.to_vec();
        String::from_utf8(bytes).map_err(|_| self.err("string is not UTF-8"))
    }

    fn value(&mut self, ty: u32) -> Result<Meta> {
        Ok(match ty {
            0 => Meta::Int(self.take(1)?[0] as i64),
            1 => Meta::Int(self.take(1)?[0] as i8 as i64),
            2 => Meta::Int(u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            3 => Meta::Int(i16::from_le_bytes(self.take(2)?.try_into().unwrap()) as i64),
            4 => Meta::Int(self.u32()? as i64),
            5 => Meta::Int(self.u32()? as i32 as i64),
            6 => Meta::Float(f32::from_le_bytes(self.take(4)?.try_into().unwrap()) as f64),
            7 => Meta::Bool(self.take(1)?[0] != 0),
            8 => Meta::Str(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len()?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(elem)?);
                }
                Meta::Array(items)
            }
            10 => Meta::Int(self.u64()? as i64),
            11 => Meta::Int(self.u64()? as i64),
            12 => Meta::Float(f64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            other => return Err(self.err(format!("unknown metadata type {other}"))),
        })
    }
}

const GGML_F32: u32 = 0;
const GGML_F16: u32 = 1;
const GGML_Q4_0: u32 = 2;
const GGML_Q4_1: u32 = 3;
const GGML_Q8_0: u32 = 8;
const GGML_BF16: u32 = 30;

impl Gguf {
    pub fn open(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, bytes)
    }

    fn parse(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let mut c = Cursor { bytes: &bytes, pos: 0, path };
        if c.take(4)? != b"GGUF" {
            return Err(c.err("not a GGUF file (bad magic)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("unsupported GGUF version {version}")));
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            metadata.insert(key, c.value(ty)?);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            if n_dims > 4 {
                return Err(c.err(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| c.len()).collect::<Result<Vec<_>>>()?;
            let ggml_type = c.u32()?;
            let offset = c.len()?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            Some(Meta::Int(a)) if *a > 0 => *a as usize,
            _ => 32,
        };
        let data_start = c.pos.next_multiple_of(alignment);
        let gguf = Gguf { path: path.to_path_buf(), bytes, metadata, tensors, data_start };
        for t in &gguf.tensors {
            let end = gguf.data_start + t.offset + gguf.byte_len(t)?;
            if end > gguf.bytes.len() {
                return Err(gguf.err(format!("tensor {} runs past the end of the file", t.name)));
            }
        }
        Ok(gguf)
    }

    fn err(&self, message: String) -> Error {
        Error::Gguf { path: self.path.clone(), message }
    }

    fn byte_len(&self, t: &TensorInfo) -> Result<usize> {
        let n: usize = t.dims.iter().product();
        let (block, block_bytes) = match t.ggml_type {
            GGML_F32 => (1, 4),
            GGML_F16 | GGML_BF16 => (1, 2),
            GGML_Q4_0 => (32, 18),
            GGML_Q4_1 => (32, 20),
            GGML_Q8_0 => (32, 34),
            other => {
                return Err(self.err(format!("tensor {}: unsupported ggml type {other}", t.name)));
            }
        };
        if n % block != 0 {
            return Err(self.err(format!("tensor {}: {n} elements is not a whole number of blocks", t.name)));
        }
        Ok(n / block * block_bytes)
    }

    pub fn meta(&self, key: &str) -> Result<&Meta> {
        self.metadata.get(key).ok_or_else(|| self.err(format!("missing metadata key {key}")))
    }

    pub fn meta_int(&self, key: &str) -> Result<i64> {
        match self.meta(key)? {
            Meta::Int(v) => Ok(*v),
            other => Err(self.err(format!("{key} is {other:?}, expected an integer"))),
        }
    }

    pub fn meta_float(&self, key: &str) -> Result<f64> {
        match self.meta(key)? {
            Meta::Float(v) => Ok(*v),
            Meta::Int(v) => Ok(*v as f64),
            other => Err(self.err(format!("{key} is {other:?}, expected a number"))),
        }
    }

    pub fn meta_str(&self, key: &str) -> Result<&str> {
        match self.meta(key)? {
            Meta::Str(v) => Ok(v),
            other => Err(self.err(format!("{key} is {other:?}, expected a string"))),
        }
    }

    fn meta_strings(&self, key: &str) -> Result<Vec<&str>> {
        match self.meta(key)? {
            Meta::Array(items) => items
                .iter()
                .map(|m| match m {
                    Meta::Str(s) => Ok(s.as_str()),
                    other => Err(self.err(format!("{key} holds {other:?}, expected strings"))),
                })
                .collect(),
            other => Err(self.err(format!("{key} is {other:?}, expected an array"))),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's values as f32, row-major in HF order (`dims` reversed).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        let start = self.data_start + t.offset;
        let data = &self.bytes[start..start + self.byte_len(t)?];
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        Ok(match t.ggml_type {
            GGML_F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
            GGML_F16 => data.chunks_exact(2).map(f16).collect(),
            GGML_BF16 => {
                data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            GGML_Q8_0 => data
                .chunks_exact(34)
                .flat_map(|b| {
                    let d = f16(&b[0..2]);
                    b[2..34].iter().map(move |&q| q as i8 as f32 * d)
                })
                .collect(),
            GGML_Q4_0 | GGML_Q4_1 => {
                let with_min = t.ggml_type == GGML_Q4_1;
                let block = if with_min { 20 } else { 18 };
                let mut out = Vec::with_capacity(data.len() / block * 32);
                for b in data.chunks_exact(block) {
                    let d = f16(&b[0..2]);
                    let (m, qs) = if with_min { (f16(&b[2..4]), &b[4..20]) } else { (-8.0 * d, &b[2..18]) };
                    // Low nibbles are elements 0..16, high nibbles 16..32.
                    out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                    out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
                }
                out
            }
            _ => unreachable!("byte_len rejected the type"),
        })
    }
}

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
        let shape: Vec<usize> = t.dims.iter().rev().copied().collect();
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
