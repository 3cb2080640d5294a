//! A reply as tokens come: their text (detokenized incrementally, a
//! character never split), stop strings matched on that text with the
//! text that could begin one held back (no part of a stop string is ever
//! sent), and the pieces of the response each token adds.

use std::future::Future;

use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::engine_thread::{Event, ModelInfo};
use super::openai::{ApiError, Endpoint, Job};
use crate::batch::{FinishReason, Logprobs};
use crate::tokenizer::TextStream;

/// Text held back until it is known not to begin a stop string.
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, held: String::new() }
    }

    /// Takes `text` and returns what can be sent, and whether a stop
    /// string was found (the text before it is what is sent; the rest is
    /// dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let found = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = found {
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self.longest_stop_prefix_at_end();
        let sendable = self.held.len() - keep;
        let rest = self.held.split_off(sendable);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// What is held when the reply ends without a stop string.
    pub fn finish(self) -> String {
        self.held
    }

    /// Bytes at the end of the held text that begin some stop string.
    fn longest_stop_prefix_at_end(&self) -> usize {
        let held = &self.held;
        (1..=held.len())
            .rev()
            .filter(|&n| held.is_char_boundary(held.len() - n))
            .find(|&n| self.stops.iter().any(|s| s.starts_with(&held[held.len() - n..])))
            .unwrap_or(0)
    }
}

/// What one token adds to the response.
#[derive(Debug, Default)]
pub(crate) struct Piece {
    pub text: String,
    pub token: Option<u32>,
    pub logprobs: Option<(String, Logprobs)>,
    /// Set on the last piece: `stop` or `length`.
    pub finish: Option<&'static str>,
}

/// How a reply ended.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub generated: usize,
    pub cached_tokens: usize,
    pub finish: &'static str,
}

/// Why a reply was not finished.
pub(crate) enum Cut {
    /// The client went away after `generated` tokens: nothing more is sent.
    Gone {
        generated: usize,
    },
    Failed(ApiError),
}

/// Reads `events` to the reply's end, handing each token's [`Piece`] to
/// `emit` (false: the client is gone). `gone` completes when the client
/// disconnects before a token shows it.
pub(crate) async fn collect(
    job: &Job,
    info: &ModelInfo,
    events: &mut UnboundedReceiver<Event>,
    gone: impl Future<Output = ()>,
    mut emit: impl FnMut(Piece) -> bool,
) -> Result<Outcome, Cut> {
    let chat = job.endpoint == Endpoint::Chat;
    let mut text = info.tokenizer.as_ref().map(|tok| match chat {
        true => TextStream::new(tok, true),
        false => TextStream::after(tok, true, &job.prompt),
    });
    let mut stops = StopMatcher::new(job.stop_strings.clone());
    let mut generated = 0;
    tokio::pin!(gone);
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            () = &mut gone => return Err(Cut::Gone { generated }),
        };
        let output = match event {
            Some(Event::Token(output)) => output,
            Some(Event::Failed(message)) => return Err(Cut::Failed(ApiError::internal(message))),
            None => {
                return Err(Cut::Failed(ApiError::internal(
                    "the engine stopped (the server is shutting down)",
                )));
            }
        };
        generated += 1;
        let decode = |r: crate::Result<String>| r.map_err(|e| Cut::Failed(ApiError::internal(e.to_string())));
        // A stop id is no text.
        let new = match (&mut text, output.finish) {
            (Some(t), finish) if !matches!(finish, Some(FinishReason::StopToken(_))) => {
                decode(t.push(output.token))?
            }
            _ => String::new(),
        };
        let (mut sendable, stopped) = stops.push(&new);
        let mut finish = match (stopped, output.finish) {
            (true, _) | (_, Some(FinishReason::StopToken(_))) => Some("stop"),
            (false, Some(FinishReason::MaxTokens | FinishReason::ContextFull)) => Some("length"),
            (false, None) => None,
        };
        if finish.is_some() && !stopped {
            // The end: an unfinished character's bytes, and the text held back.
            let rest = decode(text.take().map_or(Ok(String::new()), TextStream::finish))?;
            let (tail, stopped_at_end) = stops.push(&rest);
            sendable += &tail;
            if stopped_at_end {
                finish = Some("stop");
            } else {
                sendable += &std::mem::replace(&mut stops, StopMatcher::new(Vec::new())).finish();
            }
        }
        let logprobs = output.logprobs.map(|l| (info.token_text(output.token), l));
        let piece = Piece { text: sendable, token: Some(output.token), logprobs, finish };
        if !emit(piece) {
            return Err(Cut::Gone { generated });
        }
        if let Some(finish) = finish {
            return Ok(Outcome { generated, cached_tokens: output.cached_tokens, finish });
        }
    }
}

impl ModelInfo {
    /// A token's text as logprobs show it (`token_id:N` without a tokenizer).
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_else(|| format!("token_id:{id}"))
    }
}

/// `usage`, with the prompt tokens the prefix cache held.
pub(crate) fn usage(job: &Job, outcome: &Outcome) -> Value {
    json!({
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": outcome.generated,
        "total_tokens": job.prompt_tokens + outcome.generated,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    })
}

/// A chat token's logprob entry: the token, its log-probability, its bytes
/// and the likeliest alternatives.
fn chat_logprob(info: &ModelInfo, token: &str, l: &Logprobs) -> Value {
    let top: Vec<Value> = l
        .top
        .iter()
        .map(|&(id, lp)| {
            let text = info.token_text(id);
            json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
        })
        .collect();
    json!({"token": token, "logprob": l.logprob, "bytes": token.as_bytes(), "top_logprobs": top})
}

/// The logprobs of `pieces` as the endpoint writes them: chat's
/// `{"content": [...]}`, or completions' `tokens`, `token_logprobs` and
/// `top_logprobs` lists.
pub(crate) fn logprobs_json(job: &Job, info: &ModelInfo, pieces: &[&(String, Logprobs)]) -> Value {
    if job.logprobs.is_none() {
        return Value::Null;
    }
    match job.endpoint {
        Endpoint::Chat => {
            json!({"content": pieces.iter().map(|(t, l)| chat_logprob(info, t, l)).collect::<Vec<_>>()})
        }
        Endpoint::Completion => {
            let tops: Vec<Value> = pieces
                .iter()
                .map(|(_, l)| {
                    let map: serde_json::Map<String, Value> =
                        l.top.iter().map(|&(id, lp)| (info.token_text(id), json!(lp))).collect();
                    Value::Object(map)
                })
                .collect();
            json!({
                "tokens": pieces.iter().map(|(t, _)| t).collect::<Vec<_>>(),
                "token_logprobs": pieces.iter().map(|(_, l)| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": tops,
            })
        }
    }
}

/// One choice's fields beside its text: logprobs, finish reason and,
/// where asked, its token ids.
pub(crate) fn choice(job: &Job, info: &ModelInfo, pieces: &[Piece], finish: Option<&str>) -> Value {
    let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
    let logprobs: Vec<&(String, Logprobs)> = pieces.iter().filter_map(|p| p.logprobs.as_ref()).collect();
    let mut choice =
        json!({"index": 0, "logprobs": logprobs_json(job, info, &logprobs), "finish_reason": finish});
    let fields = choice.as_object_mut().expect("an object");
    match job.endpoint {
        Endpoint::Chat => fields.insert("message".into(), json!({"role": "assistant", "content": text})),
        Endpoint::Completion => fields.insert("text".into(), json!(text)),
    };
    if job.return_token_ids {
        let ids: Vec<u32> = pieces.iter().filter_map(|p| p.token).collect();
        fields.insert("token_ids".into(), json!(ids));
    }
    choice
}

/// A streamed chunk's choice: chat's `delta` (the message field renamed)
/// or a completion's `text`.
pub(crate) fn chunk_choice(job: &Job, info: &ModelInfo, piece: Piece, opening: bool) -> Value {
    let finish = piece.finish;
    let mut choice = choice(job, info, std::slice::from_ref(&piece), finish);
    let fields = choice.as_object_mut().expect("an object");
    if let Some(Value::Object(mut message)) = fields.remove("message") {
        if !opening {
            message.remove("role");
        }
        if finish.is_some() && piece.text.is_empty() {
            message.remove("content");
        }
        fields.insert("delta".into(), Value::Object(message));
    }
    choice
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reply of `pieces` as generation checks it: after each piece, if
    /// a stop string occurs in the text so far, the text before the first
    /// one, and the reply ends there.
    fn cut_at_stops(pieces: &[String], stops: &[String]) -> (String, bool) {
        let mut text = String::new();
        for piece in pieces {
            text += piece;
            if let Some(at) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
                return (text[..at].to_string(), true);
            }
        }
        (text, false)
    }

    /// A xorshift generator: numbers below `n`.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }

        /// `len` characters, multibyte ones among them.
        fn text(&mut self, len: usize) -> String {
            let alphabet: Vec<char> = "ab é€\n".chars().collect();
            (0..len).map(|_| alphabet[self.below(alphabet.len())]).collect()
        }
    }

    /// Random texts pushed in random pieces: what is sent is the text up
    /// to the first stop string found, or all of it where none occurs
    /// (nothing lost, no part of a stop string sent).
    #[test]
    fn pieces_send_the_text_before_the_first_stop_string() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for _ in 0..5000 {
            let len = rng.below(24);
            let text = rng.text(len);
            let stops: Vec<String> = (0..1 + rng.below(3))
                .map(|_| {
                    let len = 1 + rng.below(4);
                    rng.text(len)
                })
                .collect();
            let chars: Vec<char> = text.chars().collect();
            let mut pieces = Vec::new();
            let mut at = 0;
            while at < chars.len() {
                let end = (at + 1 + rng.below(4)).min(chars.len());
                pieces.push(chars[at..end].iter().collect::<String>());
                at = end;
            }
            let mut matcher = StopMatcher::new(stops.clone());
            let (mut sent, mut stopped) = (String::new(), false);
            for piece in &pieces {
                let (sendable, found) = matcher.push(piece);
                sent += &sendable;
                stopped = found;
                if found {
                    break;
                }
            }
            if !stopped {
                sent += &matcher.finish();
            }
            assert_eq!((sent, stopped), cut_at_stops(&pieces, &stops), "{pieces:?} with {stops:?}");
        }
    }
}
