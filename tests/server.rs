//! The HTTP server in-process on an ephemeral port, over tiny fixture
//! models, through a real HTTP client: streamed and whole replies equal
//! each other and a lone session's ids (greedy and seeded); concurrent
//! requests each get their lone ids; per-request steering equals a lone
//! steered session beside an unsteered request; a client that disconnects
//! frees its sequence; the queue bound, the API key, and every kind of bad
//! input answered with OpenAI's error object naming the field; a Qwen3-VL
//! chat message with an image gets a lone session's ids.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::checkpoint::{Scratch, edited_fixture, fixture_dir, temp_dir};
use serde_json::{Value, json};
use wgspark::server::{Server, ServerOptions};
use wgspark::{
    ControlVector, GenerateOptions, Gpu, KvFormat, Message, Model, Sampling, SessionOptions, Steering,
};

/// The device of the first backend under test: the server's logic is host
/// code over kernels the other tests cover on every backend.
fn gpu() -> Gpu {
    common::gpu(common::backends()[0])
}

/// A ChatML-like template, written into the fixture's GGUF.
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
                        {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// tests/fixtures/tokenizers/spm_model.gguf (a tiny random Llama with a
/// SentencePiece vocabulary) with a chat template: a metadata entry put
/// first, its length padded to the file's 32-byte alignment so that the
/// data after it stays aligned.
fn chat_model() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let source = fixture_dir("tokenizers").join("spm_model.gguf");
        let bytes = std::fs::read(source).unwrap();
        let key = b"tokenizer.chat_template";
        let entry_len = |template: &str| 8 + key.len() + 4 + 8 + template.len();
        // A Jinja comment writes nothing: it pads the entry.
        let pad = (32 - (entry_len(TEMPLATE) + 4) % 32) % 32;
        let template = format!("{TEMPLATE}{{#{}#}}", " ".repeat(pad));
        assert_eq!(entry_len(&template) % 32, 0);
        let mut entry = Vec::new();
        entry.extend((key.len() as u64).to_le_bytes());
        entry.extend(key);
        entry.extend(8u32.to_le_bytes());
        entry.extend((template.len() as u64).to_le_bytes());
        entry.extend(template.as_bytes());
        let mut out = bytes[..24].to_vec();
        let entries = u64::from_le_bytes(out[16..24].try_into().unwrap());
        out[16..24].copy_from_slice(&(entries + 1).to_le_bytes());
        out.extend(entry);
        out.extend(&bytes[24..]);
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("server_chat_model.gguf");
        std::fs::write(&path, out).unwrap();
        path
    })
}

/// A server started on an ephemeral port, its model loaded.
struct Running {
    server: Server,
    agent: ureq::Agent,
}

fn start(options: ServerOptions) -> Running {
    let options = ServerOptions { listen: "127.0.0.1:0".parse().unwrap(), log_requests: false, ..options };
    let server = Server::start(&gpu(), options, |_| {}).unwrap();
    server.wait_until_loaded().unwrap();
    let agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    Running { server, agent }
}

/// Options of the chat model with an f32 cache (the lone sessions' here).
fn chat_options() -> ServerOptions {
    ServerOptions { kv_format: KvFormat::F32, ..ServerOptions::new(chat_model()) }
}

/// The server of [`chat_options`], shared by the tests whose requests
/// need not run alone.
fn chat_server() -> &'static Running {
    static SERVER: OnceLock<Running> = OnceLock::new();
    SERVER.get_or_init(|| start(chat_options()))
}

/// Another, for the bad requests alone: none of them is ever admitted.
fn refusing_server() -> &'static Running {
    static SERVER: OnceLock<Running> = OnceLock::new();
    SERVER.get_or_init(|| start(chat_options()))
}

/// An answer: status, the `Retry-After` header, the body.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of a stream, `[DONE]` last.
    fn events(&self) -> Vec<String> {
        self.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }
}

impl Running {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.server.local_addr())
    }

    fn post_bytes(&self, path: &str, body: &[u8], key: Option<&str>) -> Answer {
        let mut request = self.agent.post(self.url(path)).header("Content-Type", "application/json");
        if let Some(key) = key {
            request = request.header("Authorization", format!("Bearer {key}"));
        }
        answer(request.send(body).unwrap())
    }

    fn post(&self, path: &str, body: &Value) -> Answer {
        self.post_bytes(path, body.to_string().as_bytes(), None)
    }

    fn get(&self, path: &str, key: Option<&str>) -> Answer {
        let mut request = self.agent.get(self.url(path));
        if let Some(key) = key {
            request = request.header("Authorization", format!("Bearer {key}"));
        }
        answer(request.call().unwrap())
    }

    /// A value of `/metrics` (the first line naming it).
    fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics", None).body;
        let line = text
            .lines()
            .find(|l| l.split([' ', '{']).next() == Some(name))
            .unwrap_or_else(|| panic!("{name}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    /// `wgspark_requests_total` of `route` answered with `status` (0 before
    /// the first).
    fn requests(&self, route: &str, status: u16) -> f64 {
        let series = format!("wgspark_requests_total{{route=\"{route}\",status=\"{status}\"}} ");
        let text = self.get("/metrics", None).body;
        text.lines().find_map(|l| l.strip_prefix(&series)).map_or(0.0, |v| v.parse().unwrap())
    }

    /// Reads `/metrics` until `done` holds of it, at most 10 000 times.
    fn until(&self, what: &str, done: impl Fn(&Running) -> bool) {
        let polls = (0..10_000).position(|_| done(self));
        assert!(polls.is_some(), "{what}: never");
    }

    /// A raw connection that has sent a streamed completion of `body` and
    /// read the response up to its headers.
    fn open_stream(&self, body: &Value) -> BufReader<TcpStream> {
        let body = body.to_string();
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let (head, reader) = self.send_raw(&request);
        assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
        reader
    }

    /// Sends `request` whole on a fresh connection and reads the answer's
    /// head: its status line and headers, lower-cased, and the connection
    /// at the body.
    fn send_raw(&self, request: &str) -> (Vec<String>, BufReader<TcpStream>) {
        let mut socket = TcpStream::connect(self.server.local_addr()).unwrap();
        socket.write_all(request.as_bytes()).unwrap();
        let mut reader = BufReader::new(socket);
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            assert!(reader.read_line(&mut line).unwrap() > 0, "the connection closed before the head ended");
            if line == "\r\n" {
                return (head, reader);
            }
            head.push(line.trim_end().to_ascii_lowercase());
        }
    }
}

fn answer(response: ureq::http::Response<ureq::Body>) -> Answer {
    let status = response.status().as_u16();
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    let mut body = String::new();
    response.into_body().into_reader().read_to_string(&mut body).unwrap();
    Answer { status, retry_after, body }
}

/// Reads a stream's lines until a `data:` line.
fn read_event(stream: &mut BufReader<TcpStream>) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(stream.read_line(&mut line).unwrap() > 0, "the stream ended");
        if let Some(data) = line.strip_prefix("data: ") {
            return data.trim_end().to_string();
        }
    }
}

/// The ids a lone session generates (the stop id, where one ends it, last).
fn lone_ids(
    model: &Model,
    prompt: &[u32],
    options: &GenerateOptions,
    steering: Option<&Steering>,
) -> Vec<u32> {
    let mut session =
        model.session(&SessionOptions { kv_format: KvFormat::F32, ..Default::default() }).unwrap();
    session.set_steering(steering).unwrap();
    session.generate(prompt, options).unwrap().map(Result::unwrap).collect()
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// A streamed reply's text, token ids and finish reason, from its chunks.
fn streamed(answer: &Answer, chat: bool) -> (String, Vec<u32>, String, Vec<Value>) {
    let events = answer.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{}", answer.body);
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let (mut text, mut tokens, mut finish) = (String::new(), Vec::new(), String::new());
    for chunk in &chunks {
        let Some(choice) = chunk["choices"].get(0) else { continue };
        let piece = if chat { &choice["delta"]["content"] } else { &choice["text"] };
        text += piece.as_str().unwrap_or("");
        if !choice["token_ids"].is_null() {
            tokens.extend(ids(&choice["token_ids"]));
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = reason.to_string();
        }
    }
    (text, tokens, finish, chunks)
}

/// A chat reply, greedy, streamed and whole: the same text and ids, the
/// lone session's ids (the template's prompt, the model's stop ids), the
/// text the tokenizer gives those ids; usage counts them, and a second
/// request with the same prompt finds its whole blocks in the prefix cache.
#[test]
fn chat_replies_streamed_and_whole_equal_the_lone_session() {
    // A server of its own: nothing else evicts the prompt's cached blocks.
    let server = &start(chat_options());
    let model = Model::load(chat_model(), &gpu()).unwrap();
    let tokenizer = model.tokenizer().unwrap().unwrap();
    let messages = [
        Message::new("system", "Answer in French."),
        Message::new("user", "Paris is the capital of France, and Berlin is"),
    ];
    let prompt =
        tokenizer.encode(&model.chat_template().unwrap().unwrap().render(&messages, true).unwrap()).unwrap();
    let options = GenerateOptions {
        max_tokens: 12,
        stop_tokens: model.config.eos_token_ids.clone(),
        ..Default::default()
    };
    let want = lone_ids(&model, &prompt, &options, None);
    let want_text = tokenizer.decode(&want, true).unwrap();

    let body = |stream: bool| {
        json!({
            "messages": [
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "Paris is the capital of France, and Berlin is"}]},
            ],
            "max_tokens": 12, "temperature": 0, "return_token_ids": true, "stream": stream,
            "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2,
        })
    };
    let whole = server.post("/v1/chat/completions", &body(false));
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    let choice = &whole["choices"][0];
    assert_eq!(ids(&choice["token_ids"]), want);
    assert_eq!(ids(&whole["prompt_token_ids"]), prompt);
    assert_eq!(choice["message"]["content"], want_text);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["logprobs"]["content"].as_array().unwrap().len(), want.len());
    assert_eq!(choice["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 2);
    let usage = &whole["usage"];
    assert_eq!(
        (usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()),
        (Some(prompt.len() as u64), Some(12))
    );

    let stream = server.post("/v1/chat/completions", &body(true));
    assert_eq!(stream.status, 200);
    let (text, tokens, finish, chunks) = streamed(&stream, true);
    assert_eq!((text, tokens, finish.as_str()), (want_text, want, "length"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(ids(&chunks[0]["prompt_token_ids"]), prompt);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    let cached = last["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert_eq!(cached as usize, (prompt.len() - 1) / 16 * 16, "the first request's whole blocks of 16");
}

/// A completion of a text prompt, sampled with a seed, streamed and whole:
/// the lone session's draws with that seed.
#[test]
fn seeded_completions_streamed_and_whole_equal_the_lone_session() {
    let server = chat_server();
    let model = Model::load(chat_model(), &gpu()).unwrap();
    let tokenizer = model.tokenizer().unwrap().unwrap();
    let text = "The quick brown fox";
    let prompt = tokenizer.encode_prompt(text).unwrap();
    let sampling = Sampling::Random { temperature: 0.8, top_k: Some(20), top_p: Some(0.9) };
    let stop_tokens = model.config.eos_token_ids.clone();
    let options = GenerateOptions { sampling, seed: 42, max_tokens: 10, stop_tokens, ..Default::default() };
    let want = lone_ids(&model, &prompt, &options, None);
    let body = |stream: bool| {
        json!({"prompt": text, "max_tokens": 10, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 42,
               "return_token_ids": true, "stream": stream})
    };
    let whole = server.post("/v1/completions", &body(false)).json();
    assert_eq!(ids(&whole["choices"][0]["token_ids"]), want);
    assert_eq!(whole["object"], "text_completion");
    let (text, tokens, _, _) = streamed(&server.post("/v1/completions", &body(true)), false);
    assert_eq!(tokens, want);
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
}

/// A stop string ends the reply where it starts: no part of it is sent,
/// streamed or whole, and the reason is `stop`.
#[test]
fn stop_strings_end_the_reply_unsent() {
    let server = chat_server();
    let body = json!({"prompt": "Paris is the capital", "max_tokens": 20, "temperature": 0});
    let full =
        server.post("/v1/completions", &body).json()["choices"][0]["text"].as_str().unwrap().to_string();
    // Three characters from the middle of the reply (not whitespace at its ends).
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 8, "{full:?}");
    let stop: String = chars[4..7].iter().collect();
    let before = &full[..full.find(&stop).unwrap()];
    let mut stopped = body.clone();
    stopped["stop"] = json!(["zzzz-never", stop]);
    let whole = server.post("/v1/completions", &stopped).json();
    assert_eq!(whole["choices"][0]["text"], before);
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    stopped["stream"] = json!(true);
    let (text, _, finish, _) = streamed(&server.post("/v1/completions", &stopped), false);
    assert_eq!((text.as_str(), finish.as_str()), (before, "stop"));
}

/// 16 requests at once (8 run, the rest queue), prompts of different
/// lengths: each gets the ids of a lone session.
#[test]
fn concurrent_requests_each_get_their_lone_ids() {
    concurrent_requests_get_lone_ids(chat_server());
}

/// Steps of 8 rows: prompts run in chunks over many steps, and the decode
/// rows of the running streams leave some steps no room for them.
#[test]
fn a_small_step_budget_keeps_the_lone_ids() {
    concurrent_requests_get_lone_ids(&start(ServerOptions { step_tokens: 8, ..chat_options() }));
}

#[test]
fn a_step_budget_of_zero_is_an_error() {
    let options = ServerOptions { step_tokens: 0, listen: "127.0.0.1:0".parse().unwrap(), ..chat_options() };
    let server = Server::start(&gpu(), options, |_| {}).unwrap();
    let err = server.wait_until_loaded().expect_err("a step of no rows");
    assert!(err.to_string().contains("step_tokens 0"), "{err}");
}

/// 16 requests of different lengths at once, streamed and not.
fn concurrent_requests_get_lone_ids(server: &Running) {
    let model = Model::load(chat_model(), &gpu()).unwrap();
    let mut rng = common::Rng::new(5);
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| (0..3 + 4 * i).map(|_| 3 + rng.below(model.config.vocab as u32 - 3)).collect())
        .collect();
    let replies: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                scope.spawn(move || {
                    let body = json!({"prompt": prompt, "max_tokens": 4 + i % 5, "temperature": 0,
                                      "return_token_ids": true, "stream": i % 2 == 0});
                    let answer = server.post("/v1/completions", &body);
                    assert_eq!(answer.status, 200, "{}", answer.body);
                    if i % 2 == 0 {
                        streamed(&answer, false).1
                    } else {
                        ids(&answer.json()["choices"][0]["token_ids"])
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (prompt, got)) in prompts.iter().zip(&replies).enumerate() {
        let options = GenerateOptions {
            max_tokens: 4 + i % 5,
            stop_tokens: model.config.eos_token_ids.clone(),
            ..Default::default()
        };
        assert_eq!(*got, lone_ids(&model, prompt, &options, None), "request {i}");
    }
}

/// Two requests in the same steps, one steered by a named control vector
/// at scale 0.8 and one not: each gets the ids of a lone session steered
/// the same way (or not at all).
#[test]
fn each_request_is_steered_its_own_way() {
    let dir = fixture_dir("mixtral_deep");
    let vector_file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering/mixtral_deep/llama_cpp.gguf");
    let server = start(ServerOptions {
        control_vectors: vec![("happy".into(), vector_file.clone())],
        kv_format: KvFormat::F32,
        ..ServerOptions::new(&dir)
    });
    let model = Model::load(&dir, &gpu()).unwrap();
    let steering =
        Steering::new(&model.config, &[(ControlVector::load(&vector_file).unwrap(), 0.8)], None).unwrap();
    let prompt: Vec<u32> = vec![5, 17, 33, 2, 90, 41, 7];
    let options = GenerateOptions { max_tokens: 8, ..Default::default() };
    let want_steered = lone_ids(&model, &prompt, &options, Some(&steering));
    let want_plain = lone_ids(&model, &prompt, &options, None);
    assert_ne!(want_steered, want_plain, "the vector changes the ids");
    let [steered, plain] = std::thread::scope(|scope| {
        let ask = |vectors: Value| {
            let server = &server;
            let prompt = &prompt;
            scope.spawn(move || {
                let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true,
                                  "control_vectors": vectors});
                ids(&server.post("/v1/completions", &body).json()["choices"][0]["token_ids"])
            })
        };
        let handles = [ask(json!([{"name": "happy", "scale": 0.8}])), ask(json!([]))];
        handles.map(|h| h.join().unwrap())
    });
    assert_eq!(steered, want_steered);
    assert_eq!(plain, want_plain);
}

/// llama_untied with a context of 4096 positions (its config's
/// `max_position_embeddings` raised): room for a long reply.
fn long_context_model() -> common::checkpoint::Scratch {
    edited_fixture("llama_untied", |config, _| config["max_position_embeddings"] = json!(4096))
}

/// A client that disconnects mid-stream, and one that disconnects while its
/// request waits in the queue (before its first token): each sequence is
/// cancelled and the pool's blocks come back.
#[test]
fn a_disconnect_frees_the_sequence() {
    let dir = long_context_model();
    let server = start(ServerOptions { parallel: 1, ..ServerOptions::new(&*dir) });
    assert_eq!(server.metric("wgspark_kv_blocks_used"), 0.0);
    let long = json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 2000, "temperature": 0, "stream": true});
    let mut running = server.open_stream(&long);
    assert!(read_event(&mut running).contains("\"choices\""));
    let queued = server.open_stream(&long);
    server.until("the second request queued", |s| s.metric("wgspark_sequences_queued") == 1.0);
    drop(queued);
    server.until("the queued request cancelled", |s| s.metric("wgspark_sequences_queued") == 0.0);
    assert_eq!(server.metric("wgspark_sequences_running"), 1.0, "the first still runs");
    read_event(&mut running);
    drop(running);
    server.until("the pool given back", |s| {
        s.metric("wgspark_kv_blocks_used") == 0.0 && s.metric("wgspark_requests_admitted") == 0.0
    });
    assert_eq!(server.metric("wgspark_sequences_running"), 0.0);
    assert!(server.metric("wgspark_generated_tokens_total") < 1000.0, "cancelled long before its end");
    // Both counted as logged, 499, though the running one's status line
    // went out as 200.
    server.until("both counted", |s| s.requests("/v1/completions", 499) == 2.0);
    assert_eq!(server.requests("/v1/completions", 200), 0.0);
}

/// Past `parallel` + `queue` requests, a 503 with `Retry-After`.
#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let dir = long_context_model();
    let server = start(ServerOptions { parallel: 1, queue: 1, ..ServerOptions::new(&*dir) });
    let long = json!({"prompt": [1, 2, 3], "max_tokens": 2000, "temperature": 0, "stream": true});
    let mut running = server.open_stream(&long);
    read_event(&mut running);
    let queued = server.open_stream(&long);
    let refused = server.post("/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 2}));
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.retry_after.as_deref(), Some("1"));
    assert_eq!(refused.json()["error"]["type"], "unavailable_error");
    drop((running, queued));
    server.until("both cancelled", |s| s.metric("wgspark_requests_admitted") == 0.0);
    let served = server.post("/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 2}));
    assert_eq!(served.status, 200, "room again: {}", served.body);
}

/// With an API key, every endpoint but /health wants it.
#[test]
fn the_api_key_is_required_but_for_health() {
    let server = start(ServerOptions {
        api_key: Some("sesame".into()),
        ..ServerOptions::new(fixture_dir("qwen3_dense"))
    });
    assert_eq!(server.get("/health", None).status, 200);
    for key in [None, Some("wrong"), Some("sesame!")] {
        let answer = server.get("/v1/models", key);
        assert_eq!(answer.status, 401, "{key:?}");
        assert_eq!(answer.json()["error"]["type"], "authentication_error");
        let body = br#"{"prompt": [1, 2], "max_tokens": 2}"#;
        assert_eq!(server.post_bytes("/v1/completions", body, key).status, 401);
    }
    assert_eq!(server.get("/metrics", Some("sesame")).status, 200);
    let answer =
        server.post_bytes("/v1/completions", br#"{"prompt": [1, 2], "max_tokens": 2}"#, Some("sesame"));
    assert_eq!(answer.status, 200, "{}", answer.body);
}

/// A request refused before its body is read (a wrong key, no such route)
/// closes its connection and says so, so that a client never sends its
/// next request down a connection the server is closing; an answered
/// request keeps its connection.
#[test]
fn a_body_left_unread_closes_its_connection() {
    let server = start(ServerOptions {
        api_key: Some("sesame".into()),
        ..ServerOptions::new(fixture_dir("qwen3_dense"))
    });
    let post = |path: &str, key: &str, body: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let body = r#"{"prompt": [1, 2], "max_tokens": 2}"#;
    // Headers alone, the body promised: answered before any of it comes.
    let unsent = post("/v1/completions", "wrong", body).replace(body, "");
    for (request, status) in [
        (unsent, "401"),
        (post("/v1/completions", "wrong", body), "401"),
        (post("/v1/nothing", "sesame", body), "404"),
    ] {
        let head = server.send_raw(&request).0;
        assert!(head[0].starts_with(&format!("http/1.1 {status}")), "{head:?}");
        assert!(head.contains(&"connection: close".to_string()), "{status}: {head:?}");
    }
    let head = server.send_raw(&post("/v1/completions", "sesame", body)).0;
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert!(!head.contains(&"connection: close".to_string()), "{head:?}");
}

/// A route that does not exist, and one asked with a method it does not
/// take, get OpenAI's error object (the latter with the route's methods).
#[test]
fn a_wrong_route_or_method_gets_an_error_object() {
    let server = refusing_server();
    let missing = server.get("/v1/nothing", None);
    assert_eq!(missing.status, 404, "{}", missing.body);
    assert_eq!(missing.json()["error"]["type"], "not_found_error");
    let wrong = server.get("/v1/chat/completions", None);
    assert_eq!(wrong.status, 405, "{}", wrong.body);
    let message = wrong.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("/v1/chat/completions") && message.contains("GET"), "{message}");
    let raw = "DELETE /v1/models HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n";
    let head = server.send_raw(raw).0;
    assert!(head[0].starts_with("http/1.1 405"), "{head:?}");
    assert!(head.iter().any(|h| h.starts_with("allow: ") && h.contains("get")), "{head:?}");
    assert!(head.contains(&"content-type: application/json".to_string()), "{head:?}");
}

/// The models list, health, tokenize and detokenize, and metrics.
#[test]
fn models_health_tokenize_and_metrics() {
    let server = chat_server();
    let models = server.get("/v1/models", None).json();
    assert_eq!(models["data"][0]["id"], "server_chat_model");
    assert_eq!(server.get("/health", None).json()["status"], "ok");
    let tokens = server.post("/tokenize", &json!({"content": "Hello world"})).json()["tokens"].clone();
    assert!(!ids(&tokens).is_empty());
    let text = server.post("/detokenize", &json!({"tokens": tokens})).json();
    assert_eq!(text["content"].as_str().unwrap().trim_start(), "Hello world");
    server.post("/v1/completions", &json!({"prompt": "Hello", "max_tokens": 3}));
    let metrics = server.get("/metrics", None).body;
    for name in [
        "wgspark_requests_total{route=\"/v1/completions\",status=\"200\"}",
        "wgspark_prompt_tokens_total",
        "wgspark_generated_tokens_total",
        "wgspark_time_to_first_token_seconds_bucket",
        "wgspark_time_per_output_token_seconds_count",
        "wgspark_sequences_running",
        "wgspark_sequences_queued",
        "wgspark_kv_blocks_used",
        "wgspark_kv_blocks_free",
        "wgspark_prefix_cache_hits_total",
    ] {
        assert!(metrics.contains(name), "{name} in\n{metrics}");
    }
}

/// A 4xx whose error object is of `kind` and names `field` (as `param`
/// where given, and in the message); the server holds no request after it.
fn assert_refused(server: &Running, answer: Answer, status: u16, field: &str, param: Option<&str>) {
    assert_eq!(answer.status, status, "{}", answer.body);
    let error = &answer.json()["error"];
    assert_eq!(error["type"], "invalid_request_error", "{error}");
    assert_eq!(error["param"].as_str(), param, "{error}");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains(field), "{field:?} in {message:?}");
    assert_eq!(server.metric("wgspark_requests_admitted"), 0.0, "nothing held after {error}");
}

fn chat_with(fields: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    body.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
    body
}

#[test]
fn invalid_json_is_refused() {
    let s = refusing_server();
    assert_refused(s, s.post_bytes("/v1/chat/completions", b"{\"messages\": [", None), 400, "JSON", None);
}

#[test]
fn a_non_utf8_body_is_refused() {
    let s = refusing_server();
    assert_refused(
        s,
        s.post_bytes("/v1/completions", b"{\"prompt\": \"\xff\xfe\"}", None),
        400,
        "UTF-8",
        None,
    );
}

#[test]
fn a_body_over_the_limit_is_refused() {
    let server = start(ServerOptions { max_body: 1000, ..ServerOptions::new(fixture_dir("qwen3_dense")) });
    let body = json!({"prompt": "x".repeat(2000)}).to_string();
    assert_refused(&server, server.post_bytes("/v1/completions", body.as_bytes(), None), 413, "body", None);
}

#[test]
fn a_field_of_the_wrong_type_is_refused() {
    let s = refusing_server();
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"temperature": "hot"})));
    assert_refused(s, answer, 400, "temperature", Some("temperature"));
    let answer = s.post("/v1/completions", &json!({"prompt": 12}));
    assert_refused(s, answer, 400, "prompt", Some("prompt"));
    // What a field that takes several forms takes, named.
    for prompt in [json!([-1]), json!([4_294_967_296u64]), json!([1.5]), json!([null])] {
        let answer = s.post("/v1/completions", &json!({ "prompt": prompt }));
        assert_refused(s, answer, 400, "a list of token ids", Some("prompt"));
    }
    let answer = s.post("/v1/completions", &json!({"prompt": "Hi", "stop": [1]}));
    assert_refused(s, answer, 400, "a string or a list of strings", Some("stop"));
    let part = json!({"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]});
    let answer = s.post("/v1/chat/completions", &part);
    assert_refused(s, answer, 400, "a list of parts", Some("messages[0].content"));
}

#[test]
fn a_system_or_user_message_without_content_is_refused() {
    let s = refusing_server();
    for content in [None, Some(Value::Null)] {
        let mut message = json!({"role": "user"});
        if let Some(c) = content {
            message["content"] = c;
        }
        let body = json!({"messages": [{"role": "system", "content": "Be brief."}, message]});
        let answer = s.post("/v1/chat/completions", &body);
        assert_refused(s, answer, 400, "needs content", Some("messages[1].content"));
    }
}

#[test]
fn missing_messages_are_refused() {
    let s = refusing_server();
    assert_refused(
        s,
        s.post("/v1/chat/completions", &json!({"max_tokens": 4})),
        400,
        "messages",
        Some("messages"),
    );
}

#[test]
fn an_unknown_role_is_refused() {
    let s = refusing_server();
    let body = json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Hi"}]});
    assert_refused(
        s,
        s.post("/v1/chat/completions", &body),
        400,
        "messages[1].role",
        Some("messages[1].role"),
    );
}

#[test]
fn a_prompt_beyond_the_context_is_refused() {
    let s = refusing_server();
    let long = "tokenization ".repeat(200);
    assert_refused(s, s.post("/v1/completions", &json!({"prompt": long})), 400, "context", Some("prompt"));
    let body = json!({"messages": [{"role": "user", "content": long}]});
    assert_refused(s, s.post("/v1/chat/completions", &body), 400, "context", Some("messages"));
}

#[test]
fn max_tokens_beyond_the_context_is_refused() {
    let s = refusing_server();
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"max_tokens": 100_000})));
    assert_refused(s, answer, 400, "max_tokens", Some("max_tokens"));
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"max_completion_tokens": 0})));
    assert_refused(s, answer, 400, "max_completion_tokens", Some("max_completion_tokens"));
}

#[test]
fn token_ids_out_of_range_are_refused() {
    let s = refusing_server();
    assert_refused(
        s,
        s.post("/v1/completions", &json!({"prompt": [1, 2, 100_000]})),
        400,
        "100000",
        Some("prompt"),
    );
    assert_refused(s, s.post("/detokenize", &json!({"tokens": [100_000]})), 400, "100000", Some("tokens"));
}

#[test]
fn temperature_and_top_p_out_of_range_are_refused() {
    let s = refusing_server();
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"temperature": 2.5})));
    assert_refused(s, answer, 400, "temperature", Some("temperature"));
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"temperature": 1, "top_p": 0})));
    assert_refused(s, answer, 400, "top_p", Some("top_p"));
    // Checked as sent, not as f32 rounds them.
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"temperature": 2.0000001})));
    assert_refused(s, answer, 400, "2.0000001", Some("temperature"));
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"top_p": 1.00000001})));
    assert_refused(s, answer, 400, "1.00000001", Some("top_p"));
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"logprobs": true, "top_logprobs": 21})));
    assert_refused(s, answer, 400, "top_logprobs", Some("top_logprobs"));
}

#[test]
fn too_many_stop_strings_are_refused() {
    let s = refusing_server();
    let answer = s.post("/v1/chat/completions", &chat_with(json!({"stop": ["a", "b", "c", "d", "e"]})));
    assert_refused(s, answer, 400, "stop", Some("stop"));
}

#[test]
fn more_than_one_choice_is_refused() {
    let s = refusing_server();
    assert_refused(s, s.post("/v1/chat/completions", &chat_with(json!({"n": 2}))), 400, "n = 1", Some("n"));
}

/// Fields asking for what the server cannot give (tool calls, structured
/// output, biased logits, audio, insertion, several candidates, other
/// servers' samplers and grammars) are refused by name rather than ignored;
/// their values that ask for nothing pass.
#[test]
fn fields_the_server_cannot_honour_are_refused() {
    let s = refusing_server();
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for (field, value) in [
        ("tools", tool.clone()),
        ("functions", json!([{"name": "f", "parameters": {}}])),
        ("tool_choice", json!("required")),
        ("function_call", json!({"name": "f"})),
        ("response_format", json!({"type": "json_object"})),
        ("logit_bias", json!({"50": 10})),
        ("modalities", json!(["text", "audio"])),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("response_format", json!({"type": "text", "json_schema": {"type": "object"}})),
        ("suffix", json!("end")),
        ("best_of", json!(2)),
        ("echo", json!(true)),
    ] {
        // On both endpoints: each is OpenAI's on one of them.
        let answer = s.post("/v1/chat/completions", &chat_with(json!({ field: value.clone() })));
        assert_refused(s, answer, 400, field, Some(field));
        let answer = s.post("/v1/completions", &json!({"prompt": "Hi", field: value}));
        assert_refused(s, answer, 400, field, Some(field));
    }
    // Chat's alternatives field on a completion, which asks with logprobs: N.
    let answer = s.post("/v1/completions", &json!({"prompt": "Hi", "top_logprobs": 5}));
    assert_refused(s, answer, 400, "logprobs: N", Some("top_logprobs"));
    let call = json!([{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
    let body = json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": null, "tool_calls": call},
    ]});
    let answer = s.post("/v1/chat/completions", &body);
    assert_refused(s, answer, 400, "tool_calls", Some("messages[1].tool_calls"));
    for (field, value) in
        [("logit_bias", json!({"1": -100})), ("suffix", json!("end")), ("best_of", json!(2))]
    {
        let answer = s.post("/v1/completions", &json!({"prompt": "Hi", field: value}));
        assert_refused(s, answer, 400, field, Some(field));
    }
    // Other servers' sampling and constrained-output extensions, on both endpoints.
    let extensions = [
        ("min_p", json!(0.05)),
        ("typical_p", json!(0.9)),
        ("tfs_z", json!(0.95)),
        ("top_a", json!(0.1)),
        ("repetition_penalty", json!(1.1)),
        ("repeat_penalty", json!(1.1)),
        ("dry_multiplier", json!(0.8)),
        ("xtc_probability", json!(0.5)),
        ("mirostat", json!(2)),
        ("use_beam_search", json!(true)),
        ("grammar", json!("root ::= \"a\"")),
        ("json_schema", json!({"type": "object"})),
        ("guided_json", json!({"type": "object"})),
        ("guided_regex", json!("a+")),
        ("guided_choice", json!(["a", "b"])),
        ("guided_grammar", json!("root ::= \"a\"")),
    ];
    for (field, value) in extensions {
        let chat = s.post("/v1/chat/completions", &chat_with(json!({ field: value.clone() })));
        assert_refused(s, chat, 400, field, Some(field));
        let completion = s.post("/v1/completions", &json!({"prompt": "Hi", field: value}));
        assert_refused(s, completion, 400, field, Some(field));
    }

    let server = chat_server();
    let asks_nothing = json!({"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "logit_bias": {}, "modalities": ["text"], "audio": null, "functions": null});
    let answer = server.post("/v1/chat/completions", &chat_with(asks_nothing));
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = server.post(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2, "suffix": "", "best_of": 1, "logit_bias": null,
            "tools": [], "response_format": {"type": "text"}, "echo": false, "top_logprobs": null}),
    );
    assert_eq!(answer.status, 200, "{}", answer.body);
    let neutral = json!({"min_p": 0.0, "typical_p": 1, "tfs_z": 1.0, "top_a": 0, "repetition_penalty": 1.0,
        "repeat_penalty": 1, "dry_multiplier": 0, "xtc_probability": 0.0, "mirostat": 0,
        "use_beam_search": false, "grammar": "", "json_schema": {}, "guided_json": null});
    let answer = server.post("/v1/chat/completions", &chat_with(neutral));
    assert_eq!(answer.status, 200, "{}", answer.body);
}

#[test]
fn an_unknown_control_vector_is_refused() {
    let s = refusing_server();
    let answer =
        s.post("/v1/chat/completions", &chat_with(json!({"control_vectors": [{"name": "/etc/passwd"}]})));
    assert_refused(s, answer, 400, "/etc/passwd", Some("control_vectors[0].name"));
}

#[test]
fn an_image_for_a_model_without_vision_is_refused() {
    let s = refusing_server();
    let content = json!([{"type": "text", "text": "What is this?"},
                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]);
    let body = json!({"messages": [{"role": "user", "content": content}]});
    let param = "messages[0].content[1].image_url";
    assert_refused(s, s.post("/v1/chat/completions", &body), 400, "vision", Some(param));
}

#[test]
fn a_text_prompt_to_a_model_without_tokenizer_is_refused() {
    let server = start(ServerOptions::new(fixture_dir("qwen3_dense")));
    assert_refused(
        &server,
        server.post("/v1/completions", &json!({"prompt": "Hello"})),
        400,
        "token ids",
        Some("prompt"),
    );
    let body = json!({"messages": [{"role": "user", "content": "Hi"}]});
    assert_refused(&server, server.post("/v1/chat/completions", &body), 400, "tokenizer", Some("messages"));
}

/// A step that fails (a prompt whose token's embedding is NaN makes the
/// sampling see non-finite logits) fails its request with a 500, and the
/// server goes on: the next request gets the lone session's ids.
#[test]
fn a_failed_step_fails_its_request_and_the_server_goes_on() {
    let clean = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let good: Vec<u32> = vec![1, 2, 3, 4];
    let options = GenerateOptions { max_tokens: 6, ..Default::default() };
    let want = lone_ids(&clean, &good, &options, None);
    let poison = (5..clean.config.vocab as u32).find(|t| !want.contains(t)).unwrap();
    let dir = edited_fixture("llama_untied", |_, tensors| {
        let (_, shape, data) = tensors.get_mut("model.embed_tokens.weight").unwrap();
        let row = shape[1] * 2;
        let nan = half::bf16::NAN.to_le_bytes();
        for b in data[poison as usize * row..(poison as usize + 1) * row].chunks_exact_mut(2) {
            b.copy_from_slice(&nan);
        }
    });
    let server = start(ServerOptions { kv_format: KvFormat::F32, ..ServerOptions::new(&*dir) });
    let failed =
        server.post("/v1/completions", &json!({"prompt": [1, poison, 2], "max_tokens": 6, "temperature": 0}));
    assert_eq!(failed.status, 500, "{}", failed.body);
    assert_eq!(failed.json()["error"]["type"], "server_error");
    let body = json!({"prompt": good, "max_tokens": 6, "temperature": 0, "return_token_ids": true});
    let served = server.post("/v1/completions", &body);
    assert_eq!(served.status, 200, "{}", served.body);
    assert_eq!(ids(&served.json()["choices"][0]["token_ids"]), want);
    // The engine lets a finished sequence go once its steps in flight end.
    server.until("the pool given back", |s| s.metric("wgspark_kv_blocks_used") == 0.0);
}

/// tests/fixtures/qwen3_vl_images (a vocabulary of 230 ids) with a
/// word-level tokenizer over it (`w0` to `w199`, the chat marks, Qwen's
/// vision marks at their config's ids) and a template that writes an
/// image as Qwen3-VL's does.
fn vision_chat_model() -> Scratch {
    let source = fixture_dir("qwen3_vl_images");
    let dir = temp_dir("vision-chat");
    for file in ["config.json", "model.safetensors", "preprocessor_config.json"] {
        std::fs::copy(source.join(file), dir.join(file)).unwrap();
    }
    let mut vocab: serde_json::Map<String, Value> = (0..200).map(|i| (format!("w{i}"), json!(i))).collect();
    vocab.insert("user".into(), json!(200));
    vocab.insert("assistant".into(), json!(201));
    vocab.insert("[UNK]".into(), json!(202));
    let special = [
        (203, "<|im_start|>"),
        (204, "<|im_end|>"),
        (226, "<|image_pad|>"),
        (228, "<|vision_start|>"),
        (229, "<|vision_end|>"),
    ];
    let added: Vec<Value> = special
        .iter()
        .map(|&(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    for &(id, content) in &special {
        vocab.insert(content.into(), json!(id));
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}\
        {% else %}{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>\
        {% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let config = json!({"chat_template": template, "eos_token": "<|im_end|>"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// A chat message whose parts are text and a PNG as a `data:` URI, on a
/// Qwen3-VL model: the prompt is the template's (the image's placeholder
/// once, its rows counted in usage), and the reply's ids are a lone
/// session's given the same prompt and image; the same request without
/// the image gets other ids.
#[test]
fn a_chat_message_with_an_image_gets_the_lone_session_ids() {
    use base64::Engine as _;
    use wgspark::PromptPart;
    use wgspark::vision::RgbImage;
    let dir = vision_chat_model();
    let server = start(ServerOptions { kv_format: KvFormat::F32, ..ServerOptions::new(&*dir) });
    let png = fixture_dir("qwen3_vl_images").join("wide.png");
    let url = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(std::fs::read(&png).unwrap())
    );
    let ask = |parts: Value| {
        let body = json!({"messages": [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": parts}],
                          "max_tokens": 6, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
        let answer = server.post("/v1/chat/completions", &body);
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json()
    };
    let reply =
        ask(json!([{"type": "text", "text": "w3 w7 w11"}, {"type": "image_url", "image_url": {"url": url}}]));

    let model = Model::load(&*dir, &gpu()).unwrap();
    let tokenizer = model.tokenizer().unwrap().unwrap();
    let template = model.chat_template().unwrap().unwrap();
    let messages = [Message::new("system", "w5 w6"), Message::with_images("user", 1, "w3 w7 w11")];
    let prompt = tokenizer.encode(&template.render(&messages, true).unwrap()).unwrap();
    assert_eq!(ids(&reply["prompt_token_ids"]), prompt);
    assert_eq!(prompt.iter().filter(|&&id| id == 226).count(), 1, "one placeholder");
    let image = RgbImage::open(&png).unwrap();
    let parts = PromptPart::split(&prompt, 226, std::slice::from_ref(&image)).unwrap();
    let mut session =
        model.session(&SessionOptions { kv_format: KvFormat::F32, ..Default::default() }).unwrap();
    let argmax = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap() as u32;
    let mut want = vec![argmax(&session.prefill_multimodal(&parts).unwrap())];
    while want.len() < 6 {
        let position = session.position();
        want.push(argmax(&session.step(*want.last().unwrap(), position).unwrap()));
    }
    let choice = &reply["choices"][0];
    assert_eq!(ids(&choice["token_ids"]), want);
    assert_eq!(choice["finish_reason"], "length");
    let rows = reply["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(rows > prompt.len(), "the image counts its rows: {rows}");

    let without = ask(json!("w3 w7 w11"));
    assert_ne!(ids(&without["choices"][0]["token_ids"]), want, "the image changes the reply");
}

/// A server over a model split across two devices (`Server::start_split`,
/// shares 1 : 1): whole and streamed completions, greedy and seeded, give
/// the lone session's ids on one device.
#[test]
fn a_split_model_serves_the_lone_session_ids() {
    let backend = common::backends()[0];
    let gpus = [gpu(), Gpu::new(&wgspark::GpuOptions { backend, ..Default::default() }).unwrap()];
    let options =
        ServerOptions { listen: "127.0.0.1:0".parse().unwrap(), log_requests: false, ..chat_options() };
    let server = Server::start_split(&gpus, Some(&[1.0, 1.0]), options, |_| {}).unwrap();
    server.wait_until_loaded().unwrap();
    let agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let running = Running { server, agent };
    let model = Model::load(chat_model(), &gpu()).unwrap();
    let prompt = model.tokenizer().unwrap().unwrap().encode_prompt("The quick brown fox").unwrap();
    let stop_tokens = model.config.eos_token_ids.clone();
    for (temperature, sampling) in
        [(0.0, Sampling::Greedy), (0.8, Sampling::Random { temperature: 0.8, top_k: None, top_p: None })]
    {
        let options = GenerateOptions {
            sampling,
            seed: 7,
            max_tokens: 8,
            stop_tokens: stop_tokens.clone(),
            ..Default::default()
        };
        let want = lone_ids(&model, &prompt, &options, None);
        let body = |stream: bool| {
            json!({"prompt": "The quick brown fox", "max_tokens": 8, "temperature": temperature, "seed": 7,
                   "return_token_ids": true, "stream": stream})
        };
        let whole = running.post("/v1/completions", &body(false)).json();
        assert_eq!(ids(&whole["choices"][0]["token_ids"]), want, "temperature {temperature}");
        let (_, tokens, _, _) = streamed(&running.post("/v1/completions", &body(true)), false);
        assert_eq!(tokens, want, "temperature {temperature}, streamed");
    }
}

/// A MoE model larger than its GPU budget is served with its experts
/// streamed (`ServerOptions::load`), on one device and split across two
/// (each streaming its own layers' experts into top-k slots): greedy
/// completions of an id prompt give the ids of a lone session with every
/// expert resident.
#[test]
fn streamed_experts_serve_the_resident_ids() {
    let dir = fixture_dir("mixtral_deep");
    let model = Model::load(&dir, &gpu()).unwrap();
    let top_k = model.config.moe.as_ref().unwrap().top_k;
    let prompt = [5u32, 9, 2, 7, 1, 3];
    let options = GenerateOptions { max_tokens: 6, ..Default::default() };
    let want = lone_ids(&model, &prompt, &options, None);
    let backend = common::backends()[0];
    let second = Gpu::new(&wgspark::GpuOptions { backend, ..Default::default() }).unwrap();
    for gpus in [vec![gpu()], vec![gpu(), second]] {
        let options = ServerOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            log_requests: false,
            kv_format: KvFormat::F32,
            load: wgspark::LoadOptions { expert_slots: Some(top_k), ..Default::default() },
            ..ServerOptions::new(&dir)
        };
        let server = Server::start_split(&gpus, None, options, |_| {}).unwrap();
        server.wait_until_loaded().unwrap();
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let running = Running { server, agent };
        let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": true});
        let reply = running.post("/v1/completions", &body).json();
        assert_eq!(ids(&reply["choices"][0]["token_ids"]), want, "{} devices: {reply}", gpus.len());
    }
}
