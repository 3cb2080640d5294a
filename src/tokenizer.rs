//! A model's tokenizer, from its own files, built with the `tokenizers`
//! library: a Hugging Face folder's tokenizer.json, or a GGUF file's
//! metadata: llama.cpp's `gpt2` byte-level BPE (with the pre-tokenizer its
//! `tokenizer.ggml.pre` names) or `llama` SentencePiece BPE (merges by the
//! pieces' scores, byte fallback, the dummy space prefix). A GGUF with
//! another tokenizer model has none here: prompts are then given as ids.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Error, Result, catch_panic_quietly};
use crate::gguf::{Gguf, Meta};

/// A model's tokenizer: text to ids and back, every failure a
/// [`crate::Error`]. The `tokenizers` library's own tokenizer stays
/// reachable through [`Tokenizer::raw`].
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gpu = wgspark::Gpu::from_env()?;
/// let model = wgspark::Model::load("SmolLM2-135M-Instruct.Q4_1.gguf", &gpu)?;
/// let tokenizer = model.tokenizer()?.ok_or("the file describes no tokenizer")?;
/// let ids = tokenizer.encode_prompt("The capital of France is")?;
/// assert_eq!(tokenizer.decode(&ids, true)?, "The capital of France is");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The file it was built from, named in its errors.
    source_file: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source_file", &self.source_file)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// The ids of `text` as written: special tokens spelled in it
    /// (`<|im_start|>`) are read as such and none are added, which is what a
    /// rendered chat template needs.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    /// The ids of a plain prompt: as [`Self::encode`], with the special
    /// tokens the tokenizer puts around a text (Llama's beginning of
    /// sequence, say), as transformers encodes by default.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// A panic inside the library (a pattern that only fails on some input
    /// exhausts the regular expression engine, say) is an error, and prints
    /// nothing.
    fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match catch_panic_quietly(|| self.inner.encode(text, add_special_tokens)) {
            Ok(Ok(e)) => Ok(e.get_ids().to_vec()),
            Ok(Err(e)) => Err(self.error(format!("encoding a text: {e}"))),
            Err(_) => Err(self.error(
                "encoding a text panicked inside the tokenizers library (a pattern the text exhausts?)"
                    .into(),
            )),
        }
    }

    /// The text of `ids`, without the special tokens' text where
    /// `skip_special_tokens` (what a reply shows).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match catch_panic_quietly(|| self.inner.decode(ids, skip_special_tokens)) {
            Ok(Ok(text)) => Ok(text),
            Ok(Err(e)) => Err(self.error(format!("decoding ids: {e}"))),
            Err(_) => Err(self.error("decoding ids panicked inside the tokenizers library".into())),
        }
    }

    /// The id of a token given by its text (`"<|im_end|>"`), if the
    /// vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of the token `id` as the vocabulary stores it.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is one of the special tokens (`<|im_end|>`, `</s>`...),
    /// whose text a reply does not show.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }

    /// How many ids the vocabulary has, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The `tokenizers` library's tokenizer, for what this type does not
    /// offer (offsets, pairs, ...).
    pub fn raw(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The `tokenizers` library's tokenizer, owned.
    pub fn into_raw(self) -> tokenizers::Tokenizer {
        self.inner
    }

    /// A tokenizer from a `tokenizer.json`'s text, held to the same bounds
    /// as a model's own (see [`check_bounds`]); `source_file` names it in
    /// errors.
    pub fn from_json(json: &str, source_file: impl Into<PathBuf>) -> Result<Self> {
        let source_file = source_file.into();
        let problem = |message: String| Error::Tokenizer { source_file: source_file.clone(), message };
        let json: Value = serde_json::from_str(json).map_err(|e| problem(e.to_string()))?;
        let inner = build(json).map_err(problem)?;
        Ok(Tokenizer { inner, source_file })
    }

    fn error(&self, message: String) -> Error {
        Error::Tokenizer { source_file: self.source_file.clone(), message }
    }
}

/// The tokenizer of a Hugging Face folder (`None`: it has no tokenizer.json).
pub fn from_folder(dir: &Path) -> Result<Option<Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = crate::error::read_text(&path, MAX_FILE_BYTES)?;
    Tokenizer::from_json(&text, path).map(Some)
}

/// The tokenizer a GGUF file describes (`None`: its tokenizer model is not
/// one built here, or it has none).
pub fn from_gguf(g: &Gguf) -> Result<Option<Tokenizer>> {
    let problem = |message: String| Error::Tokenizer { source_file: g.path().to_path_buf(), message };
    let model = g.meta_str_opt("tokenizer.ggml.model")?;
    if !matches!(model, Some("gpt2" | "llama")) {
        return Ok(None);
    }
    let tokens = g.meta_strings("tokenizer.ggml.tokens")?;
    // A vocabulary maps each string to one id: a string twice would leave
    // one of its ids without a token.
    let mut seen = std::collections::HashMap::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        if let Some(first) = seen.insert(*token, id) {
            return Err(problem(format!("token {token:?} appears at ids {first} and {id}")));
        }
    }
    let json = match model {
        Some("gpt2") => tokenizer_json(g, &tokens)?,
        _ => sentencepiece_json(g, &tokens)?,
    };
    let inner = build(json).map_err(problem)?;
    Ok(Some(Tokenizer { inner, source_file: g.path().to_path_buf() }))
}

/// Largest tokenizer.json read (the largest shipped ones are about 35 MB).
pub const MAX_FILE_BYTES: u64 = 64 << 20;
/// Longest padding or truncation length a tokenizer may ask for.
pub const MAX_SEQUENCE: u64 = 1 << 24;
/// Most a tokenizer's `Replace` normalizers may multiply a text's length by.
pub const MAX_GROWTH: f64 = 64.0;
/// Longest added token: the library matches them all against every text
/// (a long one slows every prompt); real ones are a few dozen bytes.
pub const MAX_ADDED_TOKEN_BYTES: usize = 1 << 10;
/// Longest regular expression of a normalizer or pre-tokenizer.
pub const MAX_PATTERN_BYTES: usize = 64 << 10;

/// A `tokenizers` tokenizer from its JSON, once the JSON is known not to
/// ask for unbounded work (see [`check_bounds`]); a panic while building
/// it (in a regular expression engine, say) is an error like the others.
fn build(json: Value) -> std::result::Result<tokenizers::Tokenizer, String> {
    check_bounds(&json)?;
    match catch_panic_quietly(move || serde_json::from_value::<tokenizers::Tokenizer>(json)) {
        Ok(built) => {
            let mut tokenizer = built.map_err(|e| e.to_string())?;
            // A prompt is encoded as it is, as transformers encodes it by
            // default: a tokenizer.json's padding would feed pad tokens to
            // the model as text, its truncation would cut the prompt.
            tokenizer.with_padding(None);
            tokenizer.with_truncation(None).map_err(|e| e.to_string())?;
            Ok(tokenizer)
        }
        Err(_) => Err("building it panicked (a malformed pattern?)".into()),
    }
}

/// Generated text as it grows, one id at a time (for printing while a
/// model generates): each id's new text, from decoding only the ids since
/// the last text given out and the ids of that text (so that a decoder
/// that treats a first token apart, as SentencePiece's drops its leading
/// space, sees them in context). Decoding the whole text at every id instead
/// costs time that grows with the square of its length (4 s of CPU over
/// 8 192 ids of Llama 3's vocabulary). A character whose bytes span
/// several ids comes out once its last byte has.
pub struct TextStream<'t> {
    tokenizer: &'t Tokenizer,
    skip_special_tokens: bool,
    /// The ids of the text given out last, then the ids not given out yet.
    window: Vec<u32>,
    /// How many of `window`'s ids were given out.
    given: usize,
}

/// How many of a context's last ids a [`TextStream`] decodes with its
/// first ids (more than the bytes of a character a byte-fallback
/// vocabulary spells one by one).
const CONTEXT_IDS: usize = 8;

impl<'t> TextStream<'t> {
    /// A text of its own (a chat reply): its first token decodes as the
    /// start of a text, as a decode of the reply alone gives it.
    pub fn new(tokenizer: &'t Tokenizer, skip_special_tokens: bool) -> Self {
        Self::after(tokenizer, skip_special_tokens, &[])
    }

    /// The text that continues `context` (a prompt's ids): its first token
    /// decodes as it does after them, with the leading space a SentencePiece
    /// decoder drops at the start of a text ("is" + " Paris", not "isParis").
    pub fn after(tokenizer: &'t Tokenizer, skip_special_tokens: bool, context: &[u32]) -> Self {
        // Only a text's first token decodes apart: the last few ids of the
        // context (whole tokens among them, whatever bytes precede) will do.
        let window = context[context.len().saturating_sub(CONTEXT_IDS)..].to_vec();
        TextStream { tokenizer, skip_special_tokens, given: window.len(), window }
    }

    /// The text `id` adds: empty while the text ends inside a character.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.window.push(id);
        let new = self.pending()?;
        if new.is_empty() || new.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        self.window.drain(..self.given);
        self.given = self.window.len();
        Ok(new)
    }

    /// The text of the ids not given out yet, as it stands (an unfinished
    /// character as U+FFFD), for when generation has ended.
    pub fn finish(self) -> Result<String> {
        self.pending()
    }

    /// The text the ids after the given ones add to theirs. (Where the given
    /// text would decode otherwise once followed, which no decoder built
    /// here does, the text from the first change on counts as new.)
    fn pending(&self) -> Result<String> {
        let decode = |ids: &[u32]| self.tokenizer.decode(ids, self.skip_special_tokens);
        let (given, all) = (decode(&self.window[..self.given])?, decode(&self.window)?);
        let same: usize =
            given.chars().zip(all.chars()).take_while(|(a, b)| a == b).map(|(a, _)| a.len_utf8()).sum();
        Ok(all[same..].to_string())
    }
}

/// Refuses the parts of a tokenizer.json that make loading or encoding
/// unbounded: padding or truncation lengths past [`MAX_SEQUENCE`],
/// chained `Replace` normalizers that can multiply a text's length by more
/// than [`MAX_GROWTH`], added tokens longer than [`MAX_ADDED_TOKEN_BYTES`],
/// and patterns longer than [`MAX_PATTERN_BYTES`].
pub fn check_bounds(json: &Value) -> std::result::Result<(), String> {
    let lengths = [("padding", "pad_to_multiple_of"), ("truncation", "max_length"), ("truncation", "stride")];
    for (part, field) in lengths {
        if let Some(n) = json[part][field].as_u64().filter(|&n| n > MAX_SEQUENCE) {
            return Err(format!("{part}.{field} is {n}, more than {MAX_SEQUENCE}"));
        }
    }
    if let Some(n) = json["padding"]["strategy"]["Fixed"].as_u64().filter(|&n| n > MAX_SEQUENCE) {
        return Err(format!("padding.strategy.Fixed is {n}, more than {MAX_SEQUENCE}"));
    }
    for token in json["added_tokens"].as_array().into_iter().flatten() {
        let len = token["content"].as_str().map_or(0, str::len);
        if len > MAX_ADDED_TOKEN_BYTES {
            return Err(format!("an added token of {len} bytes (at most {MAX_ADDED_TOKEN_BYTES})"));
        }
    }
    check_merges(&json["model"])?;
    let growth = normalizer_growth(&json["normalizer"]);
    if growth > MAX_GROWTH {
        return Err(format!(
            "its normalizers can make a text {growth:.0} times longer (at most {MAX_GROWTH})"
        ));
    }
    check_patterns(json)
}

/// The most the `Replace` steps of `normalizer` can multiply a text's
/// length (in bytes) by. (Replacements chained one after another are the
/// normalizers that grow a text geometrically; the others add a bounded
/// amount, or change characters for a few others.)
fn normalizer_growth(normalizer: &Value) -> f64 {
    match normalizer["type"].as_str() {
        Some("Sequence") => {
            normalizer["normalizers"].as_array().into_iter().flatten().map(normalizer_growth).product()
        }
        Some("Replace") => {
            let content = normalizer["content"].as_str().unwrap_or("").len() as f64;
            match normalizer["pattern"]["String"].as_str() {
                // Each match of the literal becomes the content.
                Some(p) if !p.is_empty() => (content / p.len() as f64).max(1.0),
                // A regular expression (or an empty literal) may match a
                // single byte, or the nothing between every two.
                _ => 1.0 + content,
            }
        }
        _ => 1.0,
    }
}

/// A BPE model's merges can each drop its continuing-subword prefix from
/// the second part: the library slices the prefix off without checking.
fn check_merges(model: &Value) -> std::result::Result<(), String> {
    let prefix = model["continuing_subword_prefix"].as_str().unwrap_or("").len();
    for merge in model["merges"].as_array().into_iter().flatten() {
        let second = match merge {
            Value::Array(parts) => parts.get(1).and_then(Value::as_str),
            Value::String(pair) => pair.split_once(' ').map(|(_, b)| b),
            _ => None,
        };
        if let Some(b) = second.filter(|b| b.len() < prefix || !b.is_char_boundary(prefix)) {
            return Err(format!("the merge part {b:?} does not start with the continuing-subword prefix"));
        }
    }
    Ok(())
}

/// Every regular expression of the normalizers and pre-tokenizers is at
/// most [`MAX_PATTERN_BYTES`] long.
fn check_patterns(value: &Value) -> std::result::Result<(), String> {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("Regex").filter(|_| map.len() == 1) {
                if r.len() > MAX_PATTERN_BYTES {
                    return Err(format!(
                        "a {} byte regular expression (at most {MAX_PATTERN_BYTES})",
                        r.len()
                    ));
                }
            }
            // The vocabulary and merges hold no patterns.
            map.iter().filter(|(k, _)| *k != "model").try_for_each(|(_, v)| check_patterns(v))
        }
        Value::Array(items) => items.iter().try_for_each(check_patterns),
        _ => Ok(()),
    }
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

/// A bool the file may leave out (`default` then); another type is an error.
fn bool_meta(g: &Gguf, key: &str, default: bool) -> Result<bool> {
    match g.meta(key) {
        Ok(Meta::Bool(b)) => Ok(*b),
        Ok(other) => Err(Error::Tokenizer {
            source_file: g.path().to_path_buf(),
            message: format!("{key} is {other}, expected a bool"),
        }),
        Err(_) => Ok(default),
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
    let space_prefix = bool_meta(g, "tokenizer.ggml.add_space_prefix", true)?;
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
    let post_processor = bos_template(g, tokens, true)?.unwrap_or(Value::Null);
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

/// Llama 3's split before byte-level BPE: numbers in runs of up to three
/// digits (its tokenizer.json's `Split` pattern).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's (and Qwen3's) split: Llama 3's with digits one by one.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's split (o200k), which MiniMax-M2 uses: words by case runs with
/// their contraction, numbers in runs of up to three digits.
const O200K_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's tekken split (Mistral NeMo, Mistral Small 3): GPT-4o's case
/// runs without the contractions, digits one by one.
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's splits, one after another (its tokenizer.json's `Split`
/// stages): line breaks, runs of letters of the scripts with case, runs of
/// ASCII and full-width punctuation, trailing whitespace, runs of CJK, numbers.
/// The letter class ends ranges at code points that Unicode normalization
/// replaces (U+1F7D, U+1FD3, U+1FDB, the Kelvin sign U+212A): an editor that
/// normalizes this file breaks it (tests/gguf.rs checks it).
const DEEPSEEK_LLM_SPLITS: [&str; 6] = [
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
];

/// DeepSeek Coder's splits: line breaks, letters, punctuation, CJK, digits
/// one by one.
const DEEPSEEK_CODER_SPLITS: [&str; 5] =
    [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"];

/// How a byte-level BPE vocabulary splits text before its merges, by
/// llama.cpp's name for it (`tokenizer.ggml.pre`).
struct PreTokenizer {
    /// The pre-tokenizer stage of the tokenizer.json.
    stage: Value,
    /// Whether a word in the vocabulary is taken whole, before merges.
    ignore_merges: bool,
    /// Whether an encoding starts with BOS where the file does not say.
    adds_bos: bool,
}

impl PreTokenizer {
    fn named(name: &str) -> Result<Self> {
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        // Each pattern splits the pieces the ones before it left.
        let splits = |patterns: &[&str]| {
            let stages = patterns.iter().map(|pattern| {
                json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
            });
            json!({"type": "Sequence", "pretokenizers": stages.chain([byte_level(false)]).collect::<Vec<_>>()})
        };
        let (stage, ignore_merges, adds_bos) = match name {
            "default" | "gpt2" | "gpt-2" => (byte_level(true), false, false),
            // These split digits one by one before the GPT-2 regex.
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => (
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
                false,
                false,
            ),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (splits(&[LLAMA3_SPLIT]), true, true),
            "smaug-bpe" => (splits(&[LLAMA3_SPLIT]), false, false),
            // DeepSeek-R1's distills into Qwen models name Qwen2's split so.
            "qwen2" | "deepseek-r1-qwen" => (splits(&[QWEN2_SPLIT]), false, false),
            "gpt-4o" | "minimax-m2" => (splits(&[O200K_SPLIT]), false, false),
            // llama.cpp's converter names Mistral Small 3.1's tekken "pixtral".
            "tekken" | "pixtral" => (splits(&[TEKKEN_SPLIT]), true, true),
            "deepseek-llm" => (splits(&DEEPSEEK_LLM_SPLITS), false, false),
            "deepseek-coder" => (splits(&DEEPSEEK_CODER_SPLITS), false, false),
            other => {
                return Err(Error::Unsupported {
                    what: "GGUF pre-tokenizer (tokenizer.ggml.pre)",
                    value: format!(
                        "{other} (known: default, gpt2, llama-bpe, qwen2, minimax-m2, gpt-4o, tekken, pixtral, deepseek-llm, deepseek-coder, smollm, starcoder and their kin)"
                    ),
                });
            }
        };
        Ok(PreTokenizer { stage, ignore_merges, adds_bos })
    }
}

/// A tokenizers-library `tokenizer.json` for a GPT-2 style byte-level BPE
/// vocabulary (tokenizer.ggml.model = "gpt2"), split as its
/// `tokenizer.ggml.pre` names, BOS first where `add_bos_token` (or the
/// pre-tokenizer's default) says.
fn tokenizer_json(g: &Gguf, tokens: &[&str]) -> Result<Value> {
    let merges = g.meta_strings("tokenizer.ggml.merges")?;
    let types = token_types(g, tokens.len())?;
    let pre = PreTokenizer::named(g.meta_str_opt("tokenizer.ggml.pre")?.unwrap_or("default"))?;
    let byte_level =
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let post_processor = match bos_template(g, tokens, pre.adds_bos)? {
        Some(template) => json!({"type": "Sequence", "processors": [byte_level, template]}),
        None => byte_level,
    };
    let decoder =
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let bpe = json!({"unk_token": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": pre.ignore_merges});
    let merges = merges.into_iter().map(|m| json!(m)).collect();
    Ok(document(tokens, &types, merges, [Value::Null, pre.stage, post_processor, decoder], bpe))
}

/// The post-processor that puts BOS first where `tokenizer.ggml.add_bos_token`
/// (else `default`) asks for it and the file names a BOS token.
fn bos_template(g: &Gguf, tokens: &[&str], default: bool) -> Result<Option<Value>> {
    let adds = bool_meta(g, "tokenizer.ggml.add_bos_token", default)?;
    let Some(id) = g.meta_int_opt("tokenizer.ggml.bos_token_id")?.filter(|_| adds) else {
        return Ok(None);
    };
    let Some(bos) = usize::try_from(id).ok().and_then(|i| tokens.get(i)) else {
        return Err(Error::Tokenizer {
            source_file: g.path().to_path_buf(),
            message: format!("tokenizer.ggml.bos_token_id {id} is not among the {} tokens", tokens.len()),
        });
    };
    Ok(Some(json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {*bos: {"id": bos, "ids": [id], "tokens": [bos]}},
    })))
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
