//! Text in, tokens streamed out, then prompt and decode speed.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "The capital of France is"
//! cargo run --release --example generate -- --model DIR --prompt-ids 1,2,3 --json
//! ```
//! Without `--model` it runs the default model (SmolLM2-135M-Instruct),
//! downloading it on first use. `--chat` without `--prompt` is a
//! conversation, one user message per line of stdin.
//!
//! Steering and capture follow llama.cpp's flags:
//! ```text
//! --control-vector happy.gguf --control-vector-scaled calm.gguf:0.5 \
//!     --control-vector-layer-range 10 20 --capture resid.safetensors
//! ```

mod common;

use std::io::{ErrorKind, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use common::{Reporter, parse_size};
use wgspark::chat::{ChatTemplate, Message};
use wgspark::model::vision::ImageTokens;
use wgspark::tokenizer::{TextStream, Tokenizer};
use wgspark::vision::RgbImage;
use wgspark::{
    CaptureOptions, ControlVector, GenerateOptions, Gpu, GpuOptions, KvFormat, Model, PromptPart, PromptRows,
    RoutingMode, Sampler, Sampling, Session, SessionOptions, Stats, Steering, StopReason,
};

type CliResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The text continued where no --prompt is given.
const DEFAULT_PROMPT: &str = "The capital of France is";

#[derive(Parser, Debug)]
#[command(about = "Generate text with wgspark", allow_negative_numbers = true)]
struct Args {
    /// Hugging Face model folder (config.json, safetensors, tokenizer.json),
    /// or a GGUF file (or a folder holding one).
    /// Default: SmolLM2-135M-Instruct, obtained and cached on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The text to continue (default "The capital of France is"); with
    /// --chat, the one user message (without it, --chat is a conversation
    /// read line by line from stdin).
    #[arg(long)]
    prompt: Option<String>,
    /// Comma-separated token ids, used instead of --prompt (fed as they are:
    /// no chat template).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "chat"])]
    prompt_ids: Option<Vec<u32>>,
    /// An image (PNG or JPEG) for a model with a vision tower (Qwen3-VL);
    /// repeatable, in order. With --chat the user message holds the images
    /// before its text; with --prompt-ids the config's image_token_id
    /// stands once for each (and --json reports the ids expanded, one per
    /// merged row of each image); with a plain --prompt they come first,
    /// each between the model's vision start and end tokens.
    #[arg(long, value_name = "FILE")]
    image: Vec<PathBuf>,
    /// Send the prompt as a user message through the model's chat template
    /// and print only the reply; with no --prompt, chat turn by turn.
    #[arg(long)]
    chat: bool,
    /// Default: 32, or 1024 per reply with --chat.
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample from the K most likely tokens (needs --temperature).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the most likely tokens whose probability reaches P
    /// (needs --temperature).
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Always take the most likely token (overrides --temperature, --top-k
    /// and --top-p).
    #[arg(long)]
    greedy: bool,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// vulkan, metal, dx12 or gl (default: WGSPARK_BACKEND, else the best adapter).
    #[arg(long)]
    backend: Option<String>,
    /// Which adapter of the backend to run on, by its number in
    /// --list-adapters (default: WGSPARK_ADAPTER, else the first, the best).
    #[arg(long)]
    adapter: Option<usize>,
    /// List the adapters of the backend, numbered for --adapter, and exit.
    #[arg(long)]
    list_adapters: bool,
    /// Split the model's layers across these adapters (their numbers in
    /// --list-adapters, e.g. 0,1), in proportion to their memory: the
    /// first holds the embedding, the last the head.
    #[arg(long, value_delimiter = ',', conflicts_with = "adapter")]
    devices: Vec<usize>,
    /// With --devices: each device's share of the layers (e.g. 3,1).
    #[arg(long, value_delimiter = ',', requires = "devices")]
    split: Vec<f64>,
    /// Prefill on cooperative matrices: auto, on or off (default:
    /// WGSPARK_COOPERATIVE_MATRIX, else auto).
    #[arg(long)]
    cooperative_matrix: Option<String>,
    /// KV cache positions (default: the model's, at most 8192).
    #[arg(long)]
    context: Option<usize>,
    /// KV cache format: f16 (default) or f32.
    #[arg(long, default_value = "f16")]
    kv_cache: KvFormat,
    /// Decode steps kept running ahead of the tokens printed (at most 64).
    #[arg(long, default_value_t = wgspark::session::DEFAULT_IN_FLIGHT)]
    in_flight: usize,
    /// Print one JSON object {prompt_ids, generated_ids, logits} on stdout
    /// (reads every step's logits back and samples on the host: slower).
    #[arg(long)]
    json: bool,
    /// Print per-phase time and each MoE layer's router histogram.
    #[arg(long)]
    stats: bool,
    /// Prompt tokens per prefill submission (default 4096).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// How prefill on cooperative matrices (tensor cores) rounds the
    /// activations: f16 (default) or split (two f16 parts, nearly f32's
    /// precision at twice the matrix work).
    #[arg(long, default_value = "f16")]
    prefill_precision: wgspark::PrefillPrecision,
    /// MoE layers keep the router's choice on the GPU (no readback).
    #[arg(long)]
    device_routing: bool,
    /// GPU memory the weights may take (24GiB, 512MiB, 8GB, bytes; on each
    /// device with --devices): a MoE model that does not fit keeps its
    /// experts in host memory and streams them into the GPU slots the rest
    /// leaves.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    gpu_memory: Option<u64>,
    /// GPU slots per MoE layer (at least the router's top-k), instead of
    /// --gpu-memory: fewer than the experts streams them.
    #[arg(long, value_name = "N")]
    expert_slots: Option<usize>,
    /// Add a control vector (llama.cpp GGUF) at strength 1. Repeatable.
    #[arg(long, value_name = "FILE")]
    control_vector: Vec<PathBuf>,
    /// Add a control vector times STRENGTH (`FILE:STRENGTH`, or
    /// `FILE STRENGTH` as in llama.cpp). Repeatable; vectors sum.
    #[arg(long, value_name = "FILE:STRENGTH", num_args = 1..=2, allow_negative_numbers = true)]
    control_vector_scaled: Vec<String>,
    /// Steer only layers START..=END.
    #[arg(long, num_args = 2, value_names = ["START", "END"])]
    control_vector_layer_range: Option<Vec<usize>>,
    /// Record the residual stream at layer outputs (after steering) and
    /// write it as safetensors: `resid.layer.N`, f32 `[rows, hidden]`, rows
    /// in processing order (the last prompt position, then each decoded
    /// token), their positions in the metadata.
    #[arg(long, value_name = "FILE")]
    capture: Option<PathBuf>,
    /// Capture only these layers (default: every layer).
    #[arg(long, value_delimiter = ',', requires = "capture")]
    capture_layers: Option<Vec<usize>>,
    /// Capture every prompt position, not only the last.
    #[arg(long, requires = "capture")]
    capture_all_prompt: bool,
}

/// `--control-vector` and `--control-vector-scaled` as (file, strength).
fn control_vectors(args: &Args) -> Result<Vec<(PathBuf, f32)>, String> {
    let number = |s: &str| s.parse::<f32>().ok().filter(|v| v.is_finite());
    let mut out: Vec<(PathBuf, f32)> = args.control_vector.iter().map(|p| (p.clone(), 1.0)).collect();
    let mut values = args.control_vector_scaled.iter().peekable();
    while let Some(value) = values.next() {
        // FILE:STRENGTH at the last colon (a path may hold colons, a
        // number does not), else FILE STRENGTH as llama.cpp spells it.
        let joined = value.rsplit_once(':').and_then(|(file, s)| Some((file, number(s)?)));
        let (file, strength) = match joined {
            Some(pair) => pair,
            None => match values.next_if(|next| number(next).is_some()) {
                Some(s) => (value.as_str(), number(s).expect("checked by next_if")),
                None => {
                    return Err(format!(
                        "--control-vector-scaled {value:?}: expected FILE:STRENGTH or FILE STRENGTH, \
                         STRENGTH a finite number"
                    ));
                }
            },
        };
        if file.is_empty() {
            return Err(format!("--control-vector-scaled {value}: the file path is empty"));
        }
        out.push((PathBuf::from(file), strength));
    }
    Ok(out)
}

fn main() {
    // SAFETY: first thing in main, before any other thread starts.
    unsafe { wgspark::set_runtime_dir_if_missing() };
    // RUST_LOG=wgpu_hal=info (for instance) shows why a backend fails.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("off")).init();
    match run(Args::parse()) {
        Ok(()) => {}
        // The reader of stdout has gone (`| head`): nothing more to say.
        Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == ErrorKind::BrokenPipe) => {}
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

/// The sampling the flags ask for, validated. A top-k or top-p cut
/// without a temperature would be ignored by greedy choice, so it is
/// refused rather than dropped in silence.
fn sampling(args: &Args) -> CliResult<Sampling> {
    if args.greedy {
        return Ok(Sampling::Greedy);
    }
    if args.temperature == 0.0 {
        if args.top_k.is_some() || args.top_p.is_some() {
            return Err(
                "--top-k and --top-p cut what is sampled: give a --temperature above 0 (or --greedy)".into(),
            );
        }
        return Ok(Sampling::Greedy);
    }
    let sampling = Sampling::Random { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p };
    sampling.validate()?;
    Ok(sampling)
}

fn run(args: Args) -> CliResult<()> {
    if args.list_adapters {
        return list_adapters(&args);
    }
    // Before anything is loaded or printed.
    let sampling = sampling(&args)?;
    if args.max_new_tokens == Some(0) {
        return Err("--max-new-tokens must be at least 1".into());
    }
    let gpus = open_gpus(&args)?;
    let gpu = gpus[0].clone();
    for gpu in &gpus {
        eprintln!("adapter: {}", gpu.describe());
    }
    let (dir, model) = load(&args, &gpus)?;
    let tokenizer = match args.prompt_ids {
        // Ids need no tokenizer, but one shows the text where there is one.
        Some(_) => model.tokenizer().ok().flatten(),
        None => Some(model.tokenizer()?.ok_or_else(|| {
            format!("{} has no tokenizer wgspark can build: give --prompt-ids", dir.display())
        })?),
    };
    let tokenizer = tokenizer.as_ref();
    let conversation = args.chat && args.prompt.is_none() && args.prompt_ids.is_none();
    if conversation && args.json {
        return Err("--json needs --prompt or --prompt-ids (--chat without them is a conversation)".into());
    }
    if conversation && !args.image.is_empty() {
        return Err("--image needs --prompt or --prompt-ids (--chat without them is a conversation)".into());
    }
    let images = args.image.iter().map(|p| RgbImage::open(p)).collect::<Result<Vec<_>, _>>()?;
    let image_tokens = model.config.vision.as_ref().map(|v| v.tokens).unwrap_or_default();
    let image_token = match (images.is_empty(), image_tokens.image) {
        (true, _) => None,
        (false, Some(token)) => Some(token),
        (false, None) => return Err(format!("{} reads no images (no vision tower)", dir.display()).into()),
    };
    let max_tokens = args.max_new_tokens.unwrap_or(if args.chat { 1024 } else { 32 });
    let template = match args.chat {
        true => Some(
            model.chat_template()?.ok_or_else(|| format!("{} carries no chat template", dir.display()))?,
        ),
        false => None,
    };
    let prompt_ids = match (&args.prompt_ids, tokenizer) {
        (Some(ids), _) => ids.clone(),
        (None, _) if conversation => Vec::new(),
        (None, Some(tok)) => {
            let prompt = args.prompt.as_deref().unwrap_or(DEFAULT_PROMPT);
            let images = ImagesInPrompt { count: images.len(), token: image_token, marks: image_tokens };
            text_prompt(tok, template.as_ref(), prompt, images)?
        }
        (None, None) => unreachable!("a missing tokenizer without --prompt-ids returned above"),
    };
    if let Some(path) = &args.capture {
        refuse_model_file(path, &dir)?;
    }
    let mut session = open_session(&args, &model)?;
    let stop = stop_tokens(&args, &model, template.as_ref(), tokenizer)?;
    let options = GenerateOptions {
        sampling,
        seed: args.seed,
        max_tokens,
        stop_tokens: stop.clone(),
        in_flight: args.in_flight,
    };
    if let (true, Some(template), Some(tok)) = (conversation, &template, tokenizer) {
        converse(&mut session, template, tok, &options)?;
        if args.stats {
            print_stats(&session.stats());
        }
        return finish_capture(&mut session, &args);
    }
    let parts = match image_token {
        Some(token) => PromptPart::split(&prompt_ids, token, &images)?,
        None => vec![PromptPart::Text(&prompt_ids)],
    };
    let (generated, rows, prefill_secs, decode_secs) = if args.json {
        with_logits(&mut session, &parts, sampling, args.seed, max_tokens, &stop)?
    } else {
        // The prompt as typed (given as ids, its text), which the text
        // generated continues.
        let echo_text = match (tokenizer, &args.prompt_ids) {
            _ if args.chat => None,
            (Some(_), None) => Some(args.prompt.clone().unwrap_or_else(|| DEFAULT_PROMPT.to_string())),
            (Some(tok), Some(ids)) => Some(tok.decode(ids, false)?),
            (None, _) => None,
        };
        let echo = echo_text.as_deref().map(|text| Echo { text, ids: &prompt_ids });
        let reply = stream(&mut session, &parts, &options, tokenizer, args.chat, echo)?;
        (reply.ids, Vec::new(), reply.prefill_secs, reply.decode_secs)
    };
    let prompt_ids = wgspark::multimodal::expanded_ids(&model, &parts)?;

    let decode_steps = generated.len().saturating_sub(1);
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.1} tok/s); adapter: {}",
        prompt_ids.len(),
        prefill_secs,
        prompt_ids.len() as f64 / prefill_secs,
        decode_steps,
        decode_secs,
        decode_steps as f64 / decode_secs.max(1e-9),
        gpu.describe()
    );
    if args.stats {
        print_stats(&session.stats());
    }
    finish_capture(&mut session, &args)?;
    if args.json {
        let out = serde_json::json!({
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "logits": rows,
        });
        writeln!(std::io::stdout(), "{out}")?;
    }
    Ok(())
}

/// Where a reply ends: the model's end-of-sequence ids and, in a chat, the
/// token its template ends an assistant's turn with (nothing with
/// --ignore-eos).
fn stop_tokens(
    args: &Args,
    model: &Model,
    template: Option<&ChatTemplate>,
    tokenizer: Option<&Tokenizer>,
) -> CliResult<Vec<u32>> {
    if args.ignore_eos {
        return Ok(Vec::new());
    }
    let mut stop = model.config.eos_token_ids.clone();
    if let (Some(template), Some(tok)) = (template, tokenizer) {
        stop.extend(template.end_of_turn(tok)?.filter(|id| !stop.contains(id)));
    }
    Ok(stop)
}

/// The device on the backend and with the matrix units the flags (or the
/// environment) ask for; with --devices, one per adapter named.
fn open_gpus(args: &Args) -> CliResult<Vec<Gpu>> {
    let options = gpu_options(args)?;
    if args.devices.is_empty() {
        return Ok(vec![Gpu::new(&options)?]);
    }
    let gpus = args
        .devices
        .iter()
        .map(|&adapter| Gpu::new(&GpuOptions { adapter: Some(adapter), ..options.clone() }));
    Ok(gpus.collect::<Result<_, _>>()?)
}

/// The environment's device options, overridden by the flags.
fn gpu_options(args: &Args) -> CliResult<GpuOptions> {
    let mut options = common::gpu_options(args.backend.as_deref(), args.adapter)?;
    if let Some(name) = &args.cooperative_matrix {
        options.cooperative_matrix = name.parse()?;
    }
    Ok(options)
}

/// Prints the backend's adapters, numbered as --adapter takes them.
fn list_adapters(args: &Args) -> CliResult<()> {
    let adapters = Gpu::adapters(gpu_options(args)?.backend);
    if adapters.is_empty() {
        return Err("no adapter with compute shaders".into());
    }
    for (i, a) in adapters.iter().enumerate() {
        let info = &a.info;
        let memory = a.device_memory.map(|b| format!(", {:.1} GiB", b as f64 / (1u64 << 30) as f64));
        let units = a.multiprocessors.map(|n| format!(", {n} multiprocessors"));
        println!(
            "{i}: {} ({:?}, {:?}{}{}, driver {} {})",
            info.name,
            info.backend,
            info.device_type,
            memory.unwrap_or_default(),
            units.unwrap_or_default(),
            info.driver,
            info.driver_info
        );
    }
    Ok(())
}

/// The model of `--model` (by default SmolLM2, fetched on first use) and
/// where it was loaded from, with progress shown as it loads.
fn load(args: &Args, gpus: &[Gpu]) -> CliResult<(PathBuf, Model)> {
    let mut reporter = Reporter::default();
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => wgspark::fetch::default_model(|p| reporter.report(p))?,
    };
    let load_start = Instant::now();
    let load = wgspark::LoadOptions { gpu_memory: args.gpu_memory, expert_slots: args.expert_slots };
    let model = match gpus {
        [gpu] => Model::load_with(&dir, gpu, &load, |p| reporter.report(p))?,
        _ => {
            let shares = (!args.split.is_empty()).then_some(args.split.as_slice());
            let model = Model::load_split(&dir, gpus, shares, &load, |p| reporter.report(p))?;
            eprintln!("layers per device: {:?}", model.layer_split());
            model
        }
    };
    eprintln!("loaded {} in {:.2} s", dir.display(), load_start.elapsed().as_secs_f64());
    Ok((dir, model))
}

/// The images of a prompt: how many, their placeholder id, and the markers
/// around each.
struct ImagesInPrompt {
    count: usize,
    token: Option<u32>,
    marks: ImageTokens,
}

/// The ids of a text prompt. A plain prompt gets what the tokenizer puts
/// around a text (a BOS token, for most) after its images; a chat
/// template writes its own, images included.
fn text_prompt(
    tok: &Tokenizer,
    template: Option<&ChatTemplate>,
    prompt: &str,
    images: ImagesInPrompt,
) -> CliResult<Vec<u32>> {
    if let Some(template) = template {
        let message = Message::with_images("user", images.count, prompt);
        return Ok(tok.encode(&template.render(&[message], true)?)?);
    }
    let marks = images.marks;
    let marked = |token: u32| [marks.start, Some(token), marks.end].into_iter().flatten().collect::<Vec<_>>();
    let mut ids: Vec<u32> =
        images.token.map_or_else(Vec::new, |t| (0..images.count).flat_map(|_| marked(t)).collect());
    ids.extend(tok.encode_prompt(prompt)?);
    Ok(ids)
}

/// A session as the flags set it up: its cache, routing and prefill,
/// steered by the control vectors given and capturing where asked.
fn open_session<'m>(args: &Args, model: &'m Model) -> CliResult<Session<'m>> {
    let mut session = model.session(&SessionOptions {
        context_len: args.context,
        routing: if args.device_routing { RoutingMode::DeviceResident } else { RoutingMode::Readback },
        timing: args.stats,
        prefill_chunk: args.prefill_chunk,
        prefill_precision: args.prefill_precision,
        kv_format: args.kv_cache,
        ..Default::default()
    })?;
    let vectors = control_vectors(args)?;
    if !vectors.is_empty() {
        let mut loaded = Vec::new();
        for (path, strength) in vectors {
            let vector = ControlVector::load(&path)?;
            if let Some(hint) = vector.model_hint.as_deref().filter(|h| *h != model.config.model_type) {
                eprintln!(
                    "note: {} was made for {hint:?}, this model is {:?}",
                    path.display(),
                    model.config.model_type
                );
            }
            loaded.push((vector, strength));
        }
        let range = args.control_vector_layer_range.as_ref().map(|r| r[0]..=r[1]);
        let steering = Steering::new(&model.config, &loaded, range)?;
        let layers: Vec<String> = steering.steered_layers().map(|l| l.to_string()).collect();
        eprintln!("steering layers {}", layers.join(","));
        session.set_steering(Some(&steering))?;
    } else if args.control_vector_layer_range.is_some() {
        return Err("--control-vector-layer-range needs --control-vector or --control-vector-scaled".into());
    }
    if args.capture.is_some() {
        let prompt_rows = if args.capture_all_prompt { PromptRows::All } else { PromptRows::Last };
        session.set_capture(Some(&CaptureOptions { layers: args.capture_layers.clone(), prompt_rows }))?;
    }
    Ok(session)
}

/// `--capture` must not overwrite the model: a file of the model folder, or
/// the GGUF file itself or one beside it (a split set's other parts).
fn refuse_model_file(capture: &Path, model: &Path) -> CliResult<()> {
    // Where the file cannot be written, say so before generating.
    let folder = capture.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if capture.is_dir() || !folder.is_dir() {
        return Err(format!("--capture {}: not a file in an existing folder", capture.display()).into());
    }
    let Ok(target) = capture.canonicalize() else { return Ok(()) };
    let model = model.canonicalize()?;
    let of_model = if model.is_dir() {
        target.starts_with(&model)
    } else {
        target == model
            || (target.parent() == model.parent() && target.extension().is_some_and(|e| e == "gguf"))
    };
    if of_model {
        return Err(format!("--capture {} would overwrite a file of the model", capture.display()).into());
    }
    Ok(())
}

/// Writes the captured rows where `--capture` says.
fn finish_capture(session: &mut Session<'_>, args: &Args) -> CliResult<()> {
    if let Some(path) = &args.capture {
        let capture = session.take_capture().expect("capture was set");
        capture.write_safetensors(path)?;
        eprintln!(
            "captured {} rows of {} layers to {}",
            capture.n_rows(),
            capture.layers.len(),
            path.display()
        );
    }
    Ok(())
}

/// What [`stream`] generated, and how long the prompt and the decode took.
struct Reply {
    ids: Vec<u32>,
    prefill_secs: f64,
    decode_secs: f64,
}

/// A prompt printed before the text that continues it.
struct Echo<'a> {
    /// As the user typed it.
    text: &'a str,
    /// Its ids, which the generated text's first token follows.
    ids: &'a [u32],
}

/// Generates from `prompt` (fed from the session's position), printing the
/// text as it comes where there is a tokenizer (else the ids, as
/// `--prompt-ids` takes them), after `echo` once the session has accepted
/// the prompt; `reply_only` leaves out special tokens (a chat reply).
fn stream(
    session: &mut Session<'_>,
    prompt: &[PromptPart<'_>],
    options: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    reply_only: bool,
    echo: Option<Echo<'_>>,
) -> CliResult<Reply> {
    let start = Instant::now();
    let mut ids: Vec<u32> = Vec::new();
    let context = echo.as_ref().map_or(&[][..], |e| e.ids);
    let mut text = tokenizer.map(|tok| TextStream::after(tok, reply_only, context));
    let mut first_id_at = None;
    let mut generation = session.generate_multimodal(prompt, options)?;
    // The prompt's text once the session has taken it (a bad prompt or
    // option is reported alone).
    // Written with errors returned (print! panics where stdout is closed).
    let mut out = std::io::stdout().lock();
    if let Some(echo) = &echo {
        write!(out, "{}", echo.text)?;
        out.flush()?;
    }
    for id in generation.by_ref() {
        let id = id?;
        ids.push(id);
        first_id_at.get_or_insert_with(Instant::now);
        match &mut text {
            // The token that stopped generation is not text.
            Some(_) if options.stop_tokens.contains(&id) => {}
            Some(text) => write!(out, "{}", text.push(id)?)?,
            // Without a tokenizer the ids are the output.
            None => write!(out, "{}{id}", if ids.len() > 1 { "," } else { "" })?,
        }
        out.flush()?;
    }
    if let Some(text) = text {
        write!(out, "{}", text.finish()?)?;
    }
    writeln!(out)?;
    let stop = generation.stop_reason();
    drop(generation);
    if stop == Some(StopReason::ContextFull) {
        eprintln!("stopped at the end of the context ({} positions: --context)", session.context_len());
    }
    // The first id comes with the prompt; the rest are decode steps.
    let first = first_id_at.unwrap_or(start);
    Ok(Reply { ids, prefill_secs: (first - start).as_secs_f64(), decode_secs: first.elapsed().as_secs_f64() })
}

/// The text of a chat reply's `ids`, special tokens left out; the token
/// that stopped generation is not text.
fn reply_text(tok: &Tokenizer, ids: &[u32], stop_tokens: &[u32]) -> CliResult<String> {
    let text_ids = match ids.split_last() {
        Some((last, before)) if stop_tokens.contains(last) => before,
        _ => ids,
    };
    Ok(tok.decode(text_ids, true)?)
}

/// A multi-turn chat: each line of stdin is a user message, answered
/// through the model's chat template. The conversation is rendered whole
/// every turn, and only what follows the part already in the KV cache is
/// fed (after rolling the cache back to where they differ, should the
/// template render earlier turns differently). Ends at end of input or
/// `/exit`.
fn converse(
    session: &mut Session<'_>,
    template: &ChatTemplate,
    tok: &Tokenizer,
    options: &GenerateOptions,
) -> CliResult<()> {
    let stdin = std::io::stdin();
    let terminal = stdin.is_terminal();
    if terminal {
        eprintln!("chat: one message per line; end with /exit or Ctrl-D");
    }
    let mut messages: Vec<Message> = Vec::new();
    // The ids in the KV cache, in order.
    let mut cached: Vec<u32> = Vec::new();
    let mut line = String::new();
    loop {
        if terminal {
            eprint!("> ");
        }
        line.clear();
        if stdin.read_line(&mut line)? == 0 {
            break;
        }
        let message = line.trim();
        if message == "/exit" {
            break;
        }
        if message.is_empty() {
            continue;
        }
        messages.push(Message::new("user", message));
        let ids = tok.encode(&template.render(&messages, true)?)?;
        // At least the last id is fed: its logits choose the reply's first.
        let kept = cached.iter().zip(&ids).take_while(|(a, b)| a == b).count().min(ids.len() - 1);
        session.truncate(kept);
        cached.truncate(kept);
        let reply = stream(session, &[PromptPart::Text(&ids[kept..])], options, Some(tok), true, None)?;
        // The last id generated is not in the cache.
        cached.extend_from_slice(&ids[kept..]);
        cached.extend_from_slice(&reply.ids[..reply.ids.len() - 1]);
        messages.push(Message::new("assistant", &reply_text(tok, &reply.ids, &options.stop_tokens)?));
    }
    Ok(())
}

/// The prompt, then one step per token with its logits read back and the
/// next token sampled on the host: what `--json` prints.
type WithLogits = (Vec<u32>, Vec<Vec<f32>>, f64, f64);

fn with_logits(
    session: &mut wgspark::Session<'_>,
    prompt: &[PromptPart<'_>],
    sampling: Sampling,
    seed: u64,
    max_tokens: usize,
    eos: &[u32],
) -> CliResult<WithLogits> {
    let mut sampler = Sampler::new(sampling, seed)?;
    let prefill_start = Instant::now();
    let mut logits = session.prefill_multimodal(prompt)?;
    let prefill_secs = prefill_start.elapsed().as_secs_f64();
    let mut generated = Vec::new();
    let mut rows = Vec::new();
    let decode_start = Instant::now();
    while generated.len() < max_tokens {
        let next = sampler.sample(&logits);
        generated.push(next);
        rows.push(std::mem::take(&mut logits));
        if eos.contains(&next) || generated.len() == max_tokens {
            break;
        }
        logits = session.step(next, session.position())?;
    }
    Ok((generated, rows, prefill_secs, decode_start.elapsed().as_secs_f64()))
}

fn print_stats(stats: &Stats) {
    eprintln!("forward passes: {}", stats.forward_passes);
    let cache = &stats.expert_cache;
    if cache.hits + cache.misses > 0 {
        eprintln!(
            "expert cache: {} hits, {} misses, {} bytes uploaded ({:.1} % hits, {:.3} ms uploading; \
             {} prefetched, {} of them used)",
            cache.hits,
            cache.misses,
            cache.bytes_uploaded,
            100.0 * cache.hits as f64 / (cache.hits + cache.misses) as f64,
            cache.upload_time.as_secs_f64() * 1e3,
            cache.prefetched,
            cache.prefetch_hits
        );
    }
    if stats.decode_dispatches > 0 {
        eprintln!("dispatches per token: {}", stats.decode_dispatches);
    }
    if let (Some(p), Some(source)) = (&stats.phases, stats.timing_source) {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        eprintln!(
            "phase time ({source:?}): layers {:.3} ms, routed experts {:.3} ms, head {:.3} ms",
            ms(p.layers),
            ms(p.routed),
            ms(p.head)
        );
    }
    if stats.routing_readbacks > 0 {
        eprintln!(
            "routing readbacks: {} ({:.3} ms each, GPU work of the submission included)",
            stats.routing_readbacks,
            stats.routing_wait.as_secs_f64() * 1e3 / stats.routing_readbacks as f64
        );
        for (layer, counts) in stats.router_histogram.iter().enumerate() {
            if !counts.is_empty() {
                let row: Vec<String> = counts.iter().map(u64::to_string).collect();
                eprintln!("layer {layer:>3} experts chosen: [{}]", row.join(" "));
            }
        }
    }
}
