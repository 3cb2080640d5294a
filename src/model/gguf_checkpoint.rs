//! A GGUF model (llama.cpp's format, one file or a `-00001-of-0000N` split
//! set) as a [`TensorSource`]: its tensors keep their stored formats, are
//! looked up by the Hugging Face names the upload uses, and its config comes
//! from the metadata. llama.cpp's converter interleaves the q and k rows of
//! `llama` and `mistral3` models for its RoPE; they are put back in
//! transformers' order as they are read (rows are whole blocks, so this
//! works on quantized rows too). A MoE layer's experts are one 3-D tensor
//! per projection, served to the upload as per-expert slices; MiniMax-M2's
//! router bias is `exp_probs_b.bias` and its gating function (sigmoid)
//! `expert_gating_func`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::config::{ModelConfig, RopeScaling};
use super::weights::TensorSource;
use crate::error::{Error, Result};
use crate::format::WeightFormat;
use crate::gguf::{Gguf, TensorInfo};

/// An architecture a GGUF model may have: llama.cpp's name, the model type
/// it loads as, and whether llama.cpp's converter interleaved its q and k
/// rows (for its RoPE).
#[derive(Debug)]
struct Architecture {
    name: &'static str,
    model_type: &'static str,
    interleaved_qk: bool,
}

/// Written as its name, the prefix of its metadata keys.
impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// `mistral3` is how llama.cpp's converter writes Mistral Small 3.1 and
/// later: Llama's layers and tensors under another name.
const ARCHITECTURES: &[Architecture] = &[
    Architecture { name: "llama", model_type: "llama", interleaved_qk: true },
    Architecture { name: "mistral3", model_type: "mistral", interleaved_qk: true },
    Architecture { name: "qwen3", model_type: "qwen3", interleaved_qk: false },
    Architecture { name: "qwen3moe", model_type: "qwen3_moe", interleaved_qk: false },
    Architecture { name: "minimax-m2", model_type: "minimax_m2", interleaved_qk: false },
];

/// Where a Hugging Face tensor lives in the GGUF files.
#[derive(Debug, Clone, PartialEq)]
struct Location {
    gguf_name: String,
    /// Expert `e` of a 3-D `[experts, rows, cols]` tensor.
    expert: Option<usize>,
}

pub struct GgufCheckpoint {
    files: Vec<Gguf>,
    /// GGUF tensor name -> (file, index in that file's table).
    index: HashMap<String, (usize, usize)>,
    arch: &'static Architecture,
    /// (q heads, kv heads) whose q / k rows the converter interleaved.
    permuted: Option<(usize, usize)>,
}

/// Whether `path` names a GGUF file (by extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The GGUF file `path` names: itself, or the one GGUF file (or first of a
/// split set) of a folder without config.json. `None`: not a GGUF model.
pub fn gguf_in(path: &Path) -> Result<Option<PathBuf>> {
    if is_gguf(path) {
        return Ok(Some(path.to_path_buf()));
    }
    if !path.is_dir() || path.join("config.json").exists() {
        return Ok(None);
    }
    let found: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_gguf(p))
        .collect();
    // Each model once: a split set by its first part.
    let mut models: Vec<PathBuf> = found.iter().map(|p| split_files(p).swap_remove(0)).collect();
    models.sort();
    models.dedup();
    match models.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        _ => Err(Error::Unsupported {
            what: "a model folder with several GGUF models",
            value: format!("{}: name the file", path.display()),
        }),
    }
}

/// The most files a split set has: llama.cpp numbers them in five digits.
const MAX_SPLIT_FILES: usize = 99_999;

/// The files of the split set `path` is a part of (`NAME-00002-of-00003.gguf`
/// belongs to `NAME-00001-of-00003.gguf` .. `NAME-00003-of-00003.gguf`,
/// named with the same width), or the file itself.
fn split_files(path: &Path) -> Vec<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let Some(stem) = name.strip_suffix(".gguf") else { return vec![path.to_path_buf()] };
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    let [count, "of", index, base] = parts[..] else { return vec![path.to_path_buf()] };
    let (Ok(n), Ok(i)) = (count.parse::<usize>(), index.parse::<usize>()) else {
        return vec![path.to_path_buf()];
    };
    if i == 0 || i > n || n > MAX_SPLIT_FILES || index.len() != count.len() {
        return vec![path.to_path_buf()];
    }
    let width = count.len();
    (1..=n).map(|i| path.with_file_name(format!("{base}-{i:0width$}-of-{count}.gguf"))).collect()
}

/// Each file of a split set says which part it is (`split.no`, from 0) of
/// how many (`split.count`), as llama.cpp's and gguf-py's writers put it:
/// a file out of place or from another set is an error, not a model with
/// tensors missing.
fn check_split(files: &[Gguf]) -> Result<()> {
    let n = files.len();
    if n == 1 {
        return Ok(());
    }
    for (i, g) in files.iter().enumerate() {
        let stated = g.meta_int_opt("split.no")?.zip(g.meta_int_opt("split.count")?);
        if stated != Some((i as i64, n as i64)) {
            let says = match stated {
                Some((no, count)) => format!("split.no {no} and split.count {count}"),
                None => "no split.no and split.count".to_string(),
            };
            return Err(
                g.err(format!("{says}, where part {} of {n} says split.no {i} and split.count {n}", i + 1))
            );
        }
    }
    Ok(())
}

impl GgufCheckpoint {
    pub fn open(path: &Path) -> Result<Self> {
        let files = split_files(path).iter().map(Gguf::open).collect::<Result<Vec<_>>>()?;
        check_split(&files)?;
        let mut index = HashMap::new();
        for (f, g) in files.iter().enumerate() {
            for (i, t) in g.tensors.iter().enumerate() {
                if index.insert(t.name.clone(), (f, i)).is_some() {
                    return Err(g.err(format!("tensor {} appears in two files of the set", t.name)));
                }
            }
        }
        let name = files[0].meta_str("general.architecture")?;
        let Some(arch) = ARCHITECTURES.iter().find(|a| a.name == name) else {
            return Err(Error::UnsupportedArchitecture {
                model_type: format!("{name} (GGUF)"),
                supported: ARCHITECTURES.iter().map(|a| a.name).collect::<Vec<_>>().join(", "),
            });
        };
        let mut checkpoint = GgufCheckpoint { files, index, arch, permuted: None };
        if arch.interleaved_qk {
            let heads = checkpoint.meta_int("attention.head_count")? as usize;
            let kv = checkpoint.meta_int("attention.head_count_kv").map_or(heads, |v| v as usize);
            checkpoint.permuted = Some((heads, kv));
        }
        Ok(checkpoint)
    }

    fn meta(&self) -> &Gguf {
        &self.files[0]
    }

    /// `{arch}.{key}` as an integer.
    fn meta_int(&self, key: &str) -> Result<i64> {
        self.meta().meta_int(&format!("{}.{key}", self.arch))
    }

    fn meta_float(&self, key: &str) -> Result<f64> {
        self.meta().meta_float(&format!("{}.{key}", self.arch))
    }

    fn meta_int_opt(&self, key: &str) -> Result<Option<i64>> {
        self.meta().meta_int_opt(&format!("{}.{key}", self.arch))
    }

    fn meta_float_opt(&self, key: &str) -> Result<Option<f64>> {
        self.meta().meta_float_opt(&format!("{}.{key}", self.arch))
    }

    fn tensor(&self, gguf_name: &str) -> Option<(&Gguf, &TensorInfo)> {
        let &(f, i) = self.index.get(gguf_name)?;
        Some((&self.files[f], &self.files[f].tensors[i]))
    }

    /// The model's config, from the metadata (validated as a config.json is).
    pub fn config(&self) -> Result<ModelConfig> {
        let model_type = self.arch.model_type;
        let (_, embed) =
            self.tensor("token_embd.weight").ok_or_else(|| self.meta().err("no token_embd.weight".into()))?;
        let vocab = match embed.shape()[..] {
            [vocab, _] => vocab,
            _ => {
                let dims = &embed.dims;
                return Err(self.meta().err(format!("token_embd.weight has dims {dims:?}, expected 2")));
            }
        };
        let heads = self.meta_int("attention.head_count")?;
        let hidden = self.meta_int("embedding_length")?;
        let head_dim = self.meta_int_opt("attention.key_length")?.unwrap_or(hidden / heads.max(1));
        // Values as wide as keys: the attention kernels' one head width.
        if let Some(value_dim) = self.meta_int_opt("attention.value_length")?.filter(|&v| v != head_dim) {
            return Err(Error::Unsupported {
                what: "attention geometry",
                value: format!(
                    "{}.attention.value_length {value_dim} unlike key_length {head_dim}",
                    self.arch
                ),
            });
        }
        let experts = self.meta_int_opt("expert_count")?.unwrap_or(0);
        let mut config = json!({
            "model_type": if experts > 0 && model_type == "llama" { "mixtral" } else { model_type },
            "hidden_size": hidden,
            // MiniMax-M2 has experts only: their width is the MLP width.
            "intermediate_size": self.meta_int("feed_forward_length").or_else(|e| {
                self.meta_int("expert_feed_forward_length").map_err(|_| e)
            })?,
            "num_hidden_layers": self.meta_int("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": self.meta_int_opt("attention.head_count_kv")?.unwrap_or(heads),
            "head_dim": head_dim,
            "rms_norm_eps": self.meta_float("attention.layer_norm_rms_epsilon")?,
            "rope_theta": self.meta_float_opt("rope.freq_base")?.unwrap_or(10_000.0),
            "max_position_embeddings": self.meta_int("context_length")?,
            "vocab_size": vocab,
            "tie_word_embeddings": self.tensor("output.weight").is_none(),
            "eos_token_id": self.end_of_generation()?,
            "bos_token_id": self.meta().meta_int_opt("tokenizer.ggml.bos_token_id")?,
            "torch_dtype": "gguf",
        });
        let fields = config.as_object_mut().unwrap();
        if let Some(window) = self.meta_int_opt("attention.sliding_window")? {
            fields.insert("sliding_window".into(), json!(window));
        }
        if let Some(rot) = self.meta_int_opt("rope.dimension_count")? {
            fields.insert("rotary_dim".into(), json!(rot));
        }
        self.insert_rope_scaling(fields)?;
        // Llama 4's attention temperature (Ministral 3 writes it): queries
        // scaled by position, which the attention does not do.
        if let Some(scale) = self.meta_float_opt("attention.temperature_scale")?.filter(|s| *s != 0.0) {
            return Err(Error::Unsupported {
                what: "GGUF attention temperature scaling",
                value: format!("{}.attention.temperature_scale = {scale}", self.arch),
            });
        }
        if experts > 0 {
            self.insert_experts(fields, experts)?;
        }
        let path = self.meta().path().to_path_buf();
        let mut config = ModelConfig::parse(&config.to_string(), &path)?;
        // Llama 3's wavelength scaling ships as per-frequency divisors.
        if let Some((g, t)) = self.tensor("rope_freqs.weight") {
            let factors = g.dequantize(t)?;
            if factors.len() != config.rope.rotary_dim / 2 {
                return Err(g.err(format!(
                    "rope_freqs.weight has {} factors for {} rotary dimensions",
                    factors.len(),
                    config.rope.rotary_dim
                )));
            }
            config.rope.scaling = RopeScaling::Divisors(factors);
        }
        Ok(config)
    }

    /// The ids generation ends at, as llama.cpp ends it: the end of
    /// sequence, and the end of a turn and of a message where the file
    /// names them (Llama 3.1's `<|eot_id|>` and `<|eom_id|>`).
    fn end_of_generation(&self) -> Result<Vec<i64>> {
        let mut ids = Vec::new();
        for key in ["eos", "eot", "eom"] {
            let id = self.meta().meta_int_opt(&format!("tokenizer.ggml.{key}_token_id"))?;
            ids.extend(id.filter(|id| !ids.contains(id)));
        }
        Ok(ids)
    }

    /// config.json's `rope_scaling` for the metadata's (linear, YaRN, or
    /// none).
    fn insert_rope_scaling(&self, fields: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
        match self.meta().meta_str_opt(&format!("{}.rope.scaling.type", self.arch))? {
            None | Some("none") => Ok(()),
            Some("linear") => {
                let factor = self.meta_float("rope.scaling.factor")?;
                fields.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": factor}));
                Ok(())
            }
            Some("yarn") => self.insert_yarn(fields),
            Some(other) => Err(Error::Unsupported {
                what: "GGUF rope scaling",
                value: format!("{}.rope.scaling.type = {other}", self.arch),
            }),
        }
    }

    /// YaRN as llama.cpp runs it from the metadata: the factor and the
    /// pretraining context, beta_fast / beta_slow where given, and the
    /// attention factor from the factor alone (llama.cpp sets aside
    /// `yarn_attn_factor` for it). The keys for a partial ramp
    /// (`yarn_ext_factor`), DeepSeek's log multiplier and an extra attention
    /// factor would change the answer in ways not built here: refused.
    fn insert_yarn(&self, fields: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
        let unsupported = |key: &str, value: f64| Error::Unsupported {
            what: "GGUF YaRN parameter",
            value: format!("{}.{key} = {value}", self.arch),
        };
        for (key, neutral) in [
            ("rope.scaling.yarn_ext_factor", 1.0),
            ("rope.scaling.yarn_log_multiplier", 0.0),
            ("rope.scaling.attn_factor", 1.0),
        ] {
            if let Some(value) = self.meta_float_opt(key)?.filter(|v| *v != neutral) {
                return Err(unsupported(key, value));
            }
        }
        let mut yarn = json!({
            "rope_type": "yarn",
            "factor": self.meta_float("rope.scaling.factor")?,
            "original_max_position_embeddings": self.meta_int("rope.scaling.original_context_length")?,
        });
        for (key, field) in
            [("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")]
        {
            if let Some(value) = self.meta_float_opt(key)? {
                yarn[field] = json!(value);
            }
        }
        fields.insert("rope_scaling".into(), yarn);
        Ok(())
    }

    /// config.json's MoE fields for `experts` experts: how many each token
    /// uses, their width and how they are scored (the top-k's weights
    /// renormalised, as llama.cpp runs these architectures).
    fn insert_experts(
        &self,
        fields: &mut serde_json::Map<String, serde_json::Value>,
        experts: i64,
    ) -> Result<()> {
        let used = self.meta_int("expert_used_count")?;
        fields.insert("num_local_experts".into(), json!(experts));
        fields.insert("num_experts".into(), json!(experts));
        fields.insert("num_experts_per_tok".into(), json!(used));
        if let Some(ffn) = self.meta_int_opt("expert_feed_forward_length")? {
            fields.insert("moe_intermediate_size".into(), json!(ffn));
        }
        fields.insert("norm_topk_prob".into(), json!(true));
        // llama.cpp's gating functions: 1 softmax, 2 sigmoid.
        match self.meta_int_opt("expert_gating_func")? {
            Some(1) => fields.insert("scoring_func".into(), json!("softmax")),
            Some(2) => fields.insert("scoring_func".into(), json!("sigmoid")),
            Some(other) => return Err(self.meta().err(format!("expert_gating_func {other} is not 1 or 2"))),
            None => None,
        };
        Ok(())
    }

    /// Bytes the tensors take on the GPU: in their formats, but a gate and
    /// up projection of different types in f32 (see
    /// `Uploader::gate_up`).
    pub fn gpu_bytes(&self) -> u64 {
        let types: HashMap<&str, crate::gguf::GgmlType> =
            self.files.iter().flat_map(|g| g.tensors.iter().map(|t| (t.name.as_str(), t.ty))).collect();
        let partner = |name: &str| {
            let other = match name.contains(".ffn_gate") {
                true => name.replacen(".ffn_gate", ".ffn_up", 1),
                false => name.replacen(".ffn_up", ".ffn_gate", 1),
            };
            types.get(other.as_str()).copied()
        };
        let mut total = 0u64;
        for g in &self.files {
            for t in &g.tensors {
                // A tensor of no dimensions (a scalar) is one row of one value.
                let cols = t.dims.first().copied().unwrap_or(1);
                let mixed_pair = partner(&t.name).is_some_and(|ty| ty != t.ty);
                let bytes = match WeightFormat::from_ggml(t.ty) {
                    Some(_) if mixed_pair => 4 * t.elements(),
                    Some(f) if cols.is_multiple_of(f.block_elements()) => {
                        f.gpu_row_bytes(cols) * (t.elements() / cols.max(1))
                    }
                    _ => g.data(t).len(),
                };
                total += bytes as u64;
            }
        }
        total
    }

    /// Where the Hugging Face tensor `name` lives.
    fn locate(&self, name: &str) -> Option<Location> {
        let plain = |n: &str| Some(Location { gguf_name: n.to_string(), expert: None });
        match name {
            "model.embed_tokens.weight" => return plain("token_embd.weight"),
            "model.norm.weight" => return plain("output_norm.weight"),
            "lm_head.weight" => return plain("output.weight"),
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, part) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let blk = |n: &str| format!("blk.{layer}.{n}.weight");
        let found = match part {
            "input_layernorm.weight" => blk("attn_norm"),
            "self_attn.q_proj.weight" => blk("attn_q"),
            "self_attn.k_proj.weight" => blk("attn_k"),
            "self_attn.v_proj.weight" => blk("attn_v"),
            "self_attn.o_proj.weight" => blk("attn_output"),
            "self_attn.q_norm.weight" => blk("attn_q_norm"),
            "self_attn.k_norm.weight" => blk("attn_k_norm"),
            "post_attention_layernorm.weight" => blk("ffn_norm"),
            "mlp.gate_proj.weight" => blk("ffn_gate"),
            "mlp.up_proj.weight" => blk("ffn_up"),
            "mlp.down_proj.weight" => blk("ffn_down"),
            "mlp.gate.weight" | "block_sparse_moe.gate.weight" => blk("ffn_gate_inp"),
            "mlp.e_score_correction_bias" | "block_sparse_moe.e_score_correction_bias" => {
                format!("blk.{layer}.exp_probs_b.bias")
            }
            _ => {
                // mlp.experts.{e}.{gate,up,down}_proj.weight (Qwen3-MoE) or
                // block_sparse_moe.experts.{e}.{w1,w3,w2}.weight (Mixtral).
                let experts =
                    part.strip_prefix("mlp.experts.").or(part.strip_prefix("block_sparse_moe.experts."))?;
                let (e, which) = experts.split_once('.')?;
                let which = match which {
                    "gate_proj.weight" | "w1.weight" => "ffn_gate",
                    "up_proj.weight" | "w3.weight" => "ffn_up",
                    "down_proj.weight" | "w2.weight" => "ffn_down",
                    _ => return None,
                };
                let e: usize = e.parse().ok()?;
                let merged = blk(&format!("{which}_exps"));
                if self.tensor(&merged).is_some() {
                    return Some(Location { gguf_name: merged, expert: Some(e) });
                }
                // llama.cpp's files from before April 2024 (Mixtral's among
                // them) hold one tensor per expert.
                return Some(Location { gguf_name: format!("blk.{layer}.{which}.{e}.weight"), expert: None });
            }
        };
        Some(Location { gguf_name: found, expert: None })
    }

    /// The tensor behind `name` and the shape `name` has (an expert's slice
    /// of a 3-D tensor drops the leading dimension).
    fn resolve(&self, name: &str) -> Result<(&Gguf, &TensorInfo, Location, Vec<usize>)> {
        let missing = || Error::MissingTensor { name: name.to_string() };
        let loc = self.locate(name).ok_or_else(missing)?;
        let (g, t) = self.tensor(&loc.gguf_name).ok_or_else(missing)?;
        let shape = t.shape();
        let shape = match loc.expert {
            Some(e) if shape.len() == 3 && e < shape[0] => shape[1..].to_vec(),
            Some(_) => return Err(missing()),
            None => shape,
        };
        Ok((g, t, loc, shape))
    }
}

/// llama.cpp's q/k row order back to transformers': HF row `h d + j d/2 + i`
/// is GGUF row `h d + 2 i + j`.
fn unpermute_rows(bytes: &[u8], heads: usize, row_bytes: usize) -> Vec<u8> {
    let rows = bytes.len() / row_bytes;
    let d = rows / heads;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let (hf, gg) = (h * d + j * d / 2 + i, h * d + 2 * i + j);
                out[hf * row_bytes..(hf + 1) * row_bytes]
                    .copy_from_slice(&bytes[gg * row_bytes..(gg + 1) * row_bytes]);
            }
        }
    }
    out
}

impl TensorSource for GgufCheckpoint {
    fn contains(&self, name: &str) -> bool {
        self.resolve(name).is_ok()
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        let (_, _, _, shape) = self.resolve(name)?;
        if shape != expected {
            return Err(Error::WrongShape {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: shape,
            });
        }
        Ok(())
    }

    fn format(&self, name: &str) -> Result<WeightFormat> {
        let (_, t, _, _) = self.resolve(name)?;
        WeightFormat::from_ggml(t.ty).ok_or_else(|| Error::Unsupported {
            what: "GGUF tensor type for weights",
            value: format!("{name} ({}) is {}", t.name, t.ty),
        })
    }

    fn stored_bytes(&self, name: &str, _shape: &[usize]) -> Result<Cow<'_, [u8]>> {
        let (g, t, loc, shape) = self.resolve(name)?;
        let format = self.format(name)?;
        let row_bytes = format.file_row_bytes(*shape.last().unwrap_or(&1));
        let mut bytes = g.data(t);
        if let Some(e) = loc.expert {
            let expert_bytes = shape[0] * row_bytes;
            bytes = &bytes[e * expert_bytes..(e + 1) * expert_bytes];
        }
        let heads = match (self.permuted, loc.gguf_name.rsplit('.').nth(1)) {
            (Some((q, _)), Some("attn_q")) => q,
            (Some((_, kv)), Some("attn_k")) => kv,
            _ => return Ok(Cow::Borrowed(bytes)),
        };
        Ok(Cow::Owned(unpermute_rows(bytes, heads, row_bytes)))
    }

    fn f32_values(&self, name: &str, _len: usize) -> Result<Vec<f32>> {
        let (g, t, _, _) = self.resolve(name)?;
        g.dequantize(t)
    }
}
