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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The turn's text.
    pub content: String,
    /// Images before the text (templates render each as its placeholder).
    pub images: usize,
}

impl Message {
    /// A message of text alone.
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.to_string(), content: content.to_string(), images: 0 }
    }

    /// A message of `images` images, then `content`.
    pub fn with_images(role: &str, images: usize, content: &str) -> Self {
        Message { images, ..Message::new(role, content) }
    }
}

/// As transformers hands messages to templates: the content a string, or
/// (with images) a list of parts, `{"type": "image"}` then `{"type":
/// "text", "text": ...}`.
impl Serialize for Message {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(2))?;
        map.serialize_entry("role", &self.role)?;
        if self.images == 0 {
            map.serialize_entry("content", &self.content)?;
        } else {
            let mut parts: Vec<serde_json::Value> = vec![serde_json::json!({"type": "image"}); self.images];
            parts.push(serde_json::json!({"type": "text", "text": self.content}));
            map.serialize_entry("content", &parts)?;
        }
        map.end()
    }
}

/// The most instructions rendering a chat template may take: far more
/// than any real template spends on a long conversation (a few hundred
/// thousand), far fewer than one that never ends.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

/// A Jinja chat template and the special tokens it may name. A model's
/// own comes from [`crate::Model::chat_template`].
///
/// ```no_run
/// use wgspark::{Gpu, Message, Model};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gpu = Gpu::from_env()?;
/// let model = Model::load("path/to/instruct-model", &gpu)?;
/// let tokenizer = model.tokenizer()?.ok_or("the model has no tokenizer")?;
/// let template = model.chat_template()?.ok_or("the model has no chat template")?;
/// let messages = [
///     Message::new("system", "Answer in one word."),
///     Message::new("user", "Capital of France?"),
/// ];
/// // Ends with the assistant's opening, as a reply is to follow.
/// let text = template.render(&messages, true)?;
/// let prompt = tokenizer.encode(&text)?; // the special tokens as the template wrote them
/// // A reply ends at an end-of-sequence id or at the template's end of turn
/// // (`<|im_end|>`, `<|eot_id|>`, ...).
/// let mut stop_tokens = model.config.eos_token_ids.clone();
/// stop_tokens.extend(template.end_of_turn(&tokenizer)?);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The template's Jinja source.
    pub source: String,
    /// The text of the beginning-of-sequence token, as `bos_token` in the
    /// template (empty where the files name none).
    pub bos_token: String,
    /// The text of the end-of-sequence token, as `eos_token` in the
    /// template (empty where the files name none).
    pub eos_token: String,
    /// Where it came from, for errors.
    origin: String,
}

impl ChatTemplate {
    /// The template of a GGUF file (`None`: it has none).
    pub fn from_gguf(g: &Gguf) -> Result<Option<Self>> {
        let Some(source) = g.meta_str_opt("tokenizer.chat_template")? else { return Ok(None) };
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

    /// The template of a Hugging Face folder: tokenizer_config.json's, else
    /// a `chat_template.jinja` file's, else `chat_template.json`'s (where
    /// multimodal releases such as Qwen3-VL keep theirs); `None`: none of
    /// them holds one.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("tokenizer_config.json");
        let read_json = crate::error::read_json::<serde_json::Value>;
        let config = if path.exists() { read_json(&path)? } else { serde_json::Value::Null };
        let (jinja, json_file) = (dir.join("chat_template.jinja"), dir.join("chat_template.json"));
        let (source, origin) = match template_source(&config, &path)? {
            Some(source) => (source, path.clone()),
            None if jinja.exists() => (crate::error::read_text(&jinja, crate::error::MAX_JSON_BYTES)?, jinja),
            None if json_file.exists() => match template_source(&read_json(&json_file)?, &json_file)? {
                Some(source) => (source, json_file),
                None => return Ok(None),
            },
            None => return Ok(None),
        };
        // Special tokens are strings, or {"content": ...} objects.
        let token = |key: &str| -> String {
            match config.get(key) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => v.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
                None => String::new(),
            }
        };
        Ok(Some(ChatTemplate {
            source,
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            origin: origin.display().to_string(),
        }))
    }

    /// The text of `messages`, ending with the assistant's opening when
    /// `add_generation_prompt` is set.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let error = |e: minijinja::Error| Error::ChatTemplate {
            origin: self.origin.clone(),
            message: format!("{e:#}"),
        };
        let source = generation_tags_as_blocks(&self.source);
        let mut env = minijinja::Environment::new();
        // As transformers compiles a template (jinja2 with trim_blocks and
        // lstrip_blocks): a line holding only a block tag writes nothing.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // A template from a file may loop without end (nested ranges each
        // within minijinja's own limit): its steps are bounded.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", tojson);
        // jinja2's undefined has length 0 (`tools|length` where no tools are
        // passed); minijinja's refuses to count it.
        env.add_filter("length", length);
        env.add_filter("count", length);
        env.add_template("chat", &source).map_err(error)?;
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

/// minijinja's `length`, with jinja2's length 0 for an undefined value.
fn length(value: &minijinja::Value) -> std::result::Result<usize, minijinja::Error> {
    if value.is_undefined() { Ok(0) } else { minijinja::filters::length(value) }
}

/// transformers' `{% generation %}` ... `{% endgeneration %}` (which marks
/// the assistant's tokens for training and writes nothing of its own) as a
/// block that writes what it holds, its whitespace control kept.
fn generation_tags_as_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let Some(len) = rest[open..].find("%}") else { break };
        let tag = &rest[open + 2..open + len];
        let inner = tag.trim_start_matches(['-', '+']).trim_end_matches(['-', '+']);
        let keyword = match inner.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        out.push_str(&rest[..open + 2]);
        match keyword {
            Some(keyword) => {
                let (lead, trail) = (
                    &tag[..tag.len() - tag.trim_start_matches(['-', '+']).len()],
                    &tag[tag.trim_end_matches(['-', '+']).len()..],
                );
                out.push_str(&format!("{lead} {keyword} {trail}"));
            }
            None => out.push_str(tag),
        }
        out.push_str("%}");
        rest = &rest[open + len + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson` (Python's `json.dumps` with `ensure_ascii=False`):
/// `", "` and `": "` between items, or lines indented by `indent`; no HTML
/// escaping, keys in their order.
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    use serde::Serialize;
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let unit = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&unit),
            );
            value.serialize(&mut ser)
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonJson)),
    };
    written
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(minijinja::Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// Python's `json.dumps` separators: `", "` between items, `": "` after keys.
struct PythonJson;

/// `", "` before every item of an array or object but its first.
fn item_separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first { Ok(()) } else { writer.write_all(b", ") }
}

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// transformers' `strftime_now`: the time now (UTC here) in a C `strftime`
/// format (Llama 3.2's template dates its system message with
/// `%d %b %Y`); other specifiers are written as they stand.
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format_time(format, secs)
}

/// `format` for the UTC time `secs` after the Unix epoch.
fn format_time(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = (secs / 86_400) as i64;
    // Days to a civil date (proleptic Gregorian), after Howard Hinnant.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (month_name, weekday) = (MONTHS[month as usize - 1], DAYS[days.rem_euclid(7) as usize]);
    let time = secs % 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", time / 3_600)),
            Some('M') => out.push_str(&format!("{:02}", time / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", time % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Text no template writes, standing for a reply while a template is read.
const REPLY_MARK: &str = "wgspark-reply-7f3a";

impl ChatTemplate {
    /// The token that ends an assistant's turn in this template: the first
    /// thing it writes after an assistant message's text (past whitespace),
    /// where that is one of `tokenizer`'s special tokens (`<|eot_id|>`,
    /// `<|im_end|>`, `<end_of_turn>`, `</s>` ...). A reply is over when the
    /// model writes it, whatever the model's end-of-sequence ids say
    /// (Llama 3 Instruct's config.json names `<|end_of_text|>` only).
    /// `None` where the template writes no special token there, or cannot
    /// render a user message and an assistant's reply.
    pub fn end_of_turn(&self, tokenizer: &crate::tokenizer::Tokenizer) -> Result<Option<u32>> {
        let conversation = [Message::new("user", "Hi"), Message::new("assistant", REPLY_MARK)];
        let Ok(text) = self.render(&conversation, false) else { return Ok(None) };
        let Some(at) = text.rfind(REPLY_MARK) else { return Ok(None) };
        let after = text[at + REPLY_MARK.len()..].trim_start();
        let ids = tokenizer.encode(after)?;
        Ok(ids.first().copied().filter(|&id| tokenizer.is_special(id)))
    }
}

/// The `chat_template` of a JSON config: a string, or a list of named
/// templates (`{"name", "template"}`) of which transformers renders the one
/// named "default"; `None` where the key is absent or null.
fn template_source(config: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    let invalid = |message: String| Error::Json { path: path.to_path_buf(), message };
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(source)) => Ok(Some(source.clone())),
        Some(serde_json::Value::Array(named)) => {
            let default = named.iter().find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
            match default.and_then(|t| t.get("template")).and_then(|t| t.as_str()) {
                Some(source) => Ok(Some(source.to_string())),
                None => Err(invalid("chat_template lists named templates but none named \"default\"".into())),
            }
        }
        Some(other) => {
            Err(invalid(format!("chat_template is {other}, expected a string or named templates")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message with images reaches the template as transformers hands it
    /// over: a list of parts, the images first (Qwen3-VL's template writes
    /// each as its vision markers and placeholder), the text last.
    #[test]
    fn images_reach_the_template_as_content_parts() {
        let source = "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}\
            {% for c in m.content %}{% if c.type == 'image' %}[image]{% else %}{{ c.text }}{% endif %}{% endfor %}\
            {% endif %};{% endfor %}";
        let template = ChatTemplate {
            source: source.into(),
            bos_token: String::new(),
            eos_token: String::new(),
            origin: "test".into(),
        };
        let messages =
            [Message::with_images("user", 2, "what differs?"), Message::new("assistant", "the colour")];
        assert_eq!(
            template.render(&messages, false).unwrap(),
            "user:[image][image]what differs?;assistant:the colour;"
        );
    }

    /// A template that would loop for ever (nested ranges, each within
    /// minijinja's own limit on one range) is an error once its fuel is spent.
    #[test]
    fn a_template_without_end_runs_out_of_fuel() {
        let source = "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}\
            {% endfor %}{% endfor %}{% endfor %}";
        let template = ChatTemplate {
            source: source.into(),
            bos_token: String::new(),
            eos_token: String::new(),
            origin: "test".into(),
        };
        let err = template.render(&[Message::new("user", "hi")], true).unwrap_err();
        assert!(matches!(&err, Error::ChatTemplate { message, .. } if message.contains("fuel")), "{err}");
    }

    fn template(source: &str, eos_token: &str) -> ChatTemplate {
        ChatTemplate {
            source: source.into(),
            bos_token: String::new(),
            eos_token: eos_token.into(),
            origin: "test".into(),
        }
    }

    /// A word-level tokenizer of a few words and three special tokens.
    fn tokenizer() -> crate::tokenizer::Tokenizer {
        let json = r#"{
            "version": "1.0",
            "added_tokens": [
                {"id": 5, "content": "<|eot|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 6, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 7, "content": "<|start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "pre_tokenizer": {"type": "Whitespace"},
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "user": 1, "assistant": 2, "hi": 3, "no": 4}, "unk_token": "<unk>"}
        }"#;
        crate::tokenizer::Tokenizer::from_json(json, "test").unwrap()
    }

    /// The end of an assistant's turn is the special token its template
    /// writes after the reply (past whitespace: Llama 2's `' ' + eos_token`),
    /// and nothing where the template writes plain text there.
    #[test]
    fn end_of_turn_is_the_special_token_after_a_reply() {
        let tok = tokenizer();
        let llama3 = "{% for m in messages %}<|start|>{{ m.role }}\n\n{{ m.content }}<|eot|>{% endfor %}\
            {% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}";
        assert_eq!(template(llama3, "").end_of_turn(&tok).unwrap(), Some(5));
        let llama2 = "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content.strip() }} [/INST]\
            {% else %} {{ m.content.strip() }} {{ eos_token }}{% endif %}{% endfor %}";
        assert_eq!(template(llama2, "</s>").end_of_turn(&tok).unwrap(), Some(6));
        let plain = "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}";
        assert_eq!(template(plain, "").end_of_turn(&tok).unwrap(), None);
        let refusing = "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% endif %}{% endfor %}";
        assert_eq!(template(refusing, "").end_of_turn(&tok).unwrap(), None);
    }

    /// transformers' `strftime_now` as Llama 3.2's template calls it, and
    /// the other specifiers, at a known time (2024-07-26 13:20:00 UTC, a
    /// Friday).
    #[test]
    fn strftime_formats_the_time_as_c_does() {
        assert_eq!(format_time("%d %b %Y", 1_722_000_000), "26 Jul 2024");
        assert_eq!(
            format_time("%A %a %B %m/%d/%y %H:%M:%S %% %Q", 1_722_000_000),
            "Friday Fri July 07/26/24 13:20:00 % %Q"
        );
        assert_eq!(format_time("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(format_time("%Y-%m-%d", 951_782_400), "2000-02-29");
    }

    /// Multimodal releases keep their template beside the tokenizer's
    /// config: chat_template.jinja, or chat_template.json.
    #[test]
    fn templates_come_from_the_files_beside_the_tokenizer_config() {
        let scratch = tempfile::Builder::new().prefix("wgspark-test-chat-").tempdir().unwrap();
        let dir = scratch.path();
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "<end>"}"#).unwrap();
        assert!(ChatTemplate::from_folder(dir).unwrap().is_none());
        std::fs::write(dir.join("chat_template.json"), r#"{"chat_template": "from json {{ eos_token }}"}"#)
            .unwrap();
        let t = ChatTemplate::from_folder(dir).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "from json <end>");
        // A list of named templates: the one named "default".
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}"#,
        )
        .unwrap();
        assert_eq!(ChatTemplate::from_folder(dir).unwrap().unwrap().render(&[], false).unwrap(), "plain");
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": 5}"#).unwrap();
        assert!(ChatTemplate::from_folder(dir).unwrap_err().to_string().contains("chat_template is 5"));
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "<end>"}"#).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "from jinja").unwrap();
        assert_eq!(
            ChatTemplate::from_folder(dir).unwrap().unwrap().render(&[], false).unwrap(),
            "from jinja"
        );
    }
}
