//! The GPU thread: it loads the model, owns it and its batch engine, takes
//! requests from the handlers' channel and hands each token to its
//! request's own channel. It blocks on the requests' channel only while the
//! engine is idle; otherwise it takes what has come without waiting,
//! cancels the sequences whose handler has gone, and runs a step.

use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::{LoadState, ServerError, ServerOptions, Shared};
use crate::Gpu;
use crate::batch::{BatchEngine, BatchOptions, Output, Request, SequenceId};
use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{Model, ModelConfig};
use crate::progress::Progress;
use crate::steering::{ControlVector, Steering};
use crate::tokenizer::Tokenizer;
use crate::vision::ImageProcessor;

/// What the handlers know of the model served: enough to tokenize, render
/// chat templates and check requests without the GPU thread.
#[derive(Debug)]
pub(crate) struct ModelInfo {
    /// The name responses carry.
    pub name: String,
    /// When the model was loaded (Unix seconds), as `/v1/models` says.
    pub created: u64,
    pub config: ModelConfig,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// Ids that end a completion: the model's end-of-sequence ids.
    pub stop_tokens: Vec<u32>,
    /// Ids that end a chat reply: those and the template's end of turn.
    pub chat_stop_tokens: Vec<u32>,
    /// Most positions of a sequence (prompt and generated tokens).
    pub context_len: usize,
    /// How images become rows, for a model with a vision tower.
    pub image_processor: Option<ImageProcessor>,
    /// The control vectors requests may name.
    pub control_vectors: BTreeMap<String, ControlVector>,
    pub control_vector_layers: Option<RangeInclusive<usize>>,
}

impl ModelInfo {
    /// The id standing for an image in a rendered prompt, where the model
    /// reads images.
    pub fn image_token(&self) -> Option<u32> {
        self.image_processor.as_ref()?;
        self.config.vision.as_ref()?.tokens.image
    }

    /// The steering of `vectors` (names and scales), over the configured
    /// layers.
    pub fn steering(&self, vectors: &[(&ControlVector, f32)]) -> Result<Steering> {
        let owned: Vec<(ControlVector, f32)> = vectors.iter().map(|&(v, s)| (v.clone(), s)).collect();
        Steering::new(&self.config, &owned, self.control_vector_layers.clone())
    }
}

/// A request for the GPU thread.
pub(crate) struct Submission {
    pub request: Request,
    /// Where its tokens go; dropping the receiver cancels the sequence.
    pub events: mpsc::UnboundedSender<Event>,
    /// Whether the engine took it.
    pub accepted: oneshot::Sender<Result<SequenceId>>,
    /// Its prompt's positions (images counted by their rows).
    pub prompt_tokens: usize,
    /// When the request arrived (for time to first token).
    pub arrived: Instant,
}

/// What a request's channel carries.
#[derive(Debug)]
pub(crate) enum Event {
    Token(Output),
    /// The step running the sequence failed: it is over.
    Failed(String),
}

/// A sequence being generated, as the GPU thread follows it.
struct Active {
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    last_token: Option<Instant>,
}

/// Starts the GPU thread: it loads the model (its layers split across the
/// devices where there are several, in the shares given) and serves
/// `submitted` until every sender is gone and the engine is idle.
pub(super) fn spawn(
    (gpus, shares): (Vec<Gpu>, Option<Vec<f64>>),
    options: ServerOptions,
    shared: Arc<Shared>,
    submitted: Receiver<Submission>,
    mut progress: impl FnMut(Progress<'_>) + Send + 'static,
) -> std::result::Result<JoinHandle<()>, ServerError> {
    let body = move || {
        let model = match gpus.as_slice() {
            [gpu] => Model::load_with(&options.model, gpu, &options.load, &mut progress),
            _ => Model::load_split(&options.model, &gpus, shares.as_deref(), &options.load, &mut progress),
        };
        let model = match model {
            Ok(model) => model,
            Err(e) => return shared.set_state(LoadState::Failed(Arc::new(e))),
        };
        let loaded = model_info(&model, &options)
            .and_then(|info| Ok((info, BatchEngine::new(&model, &batch_options(&model, &options))?)));
        match loaded {
            Ok((mut info, mut engine)) => {
                info.context_len = engine.context_len();
                shared.set_state(LoadState::Ready(Arc::new(info)));
                serve(&mut engine, &submitted, &shared);
            }
            Err(e) => shared.set_state(LoadState::Failed(Arc::new(e))),
        }
    };
    std::thread::Builder::new().name("wgspark-gpu".into()).spawn(body).map_err(ServerError::Start)
}

/// The engine's layout: `parallel` sequences, the pool `kv_memory` holds.
fn batch_options(model: &Model, options: &ServerOptions) -> BatchOptions {
    let defaults = BatchOptions::default();
    let c = &model.config;
    let block_bytes = KvCache::bytes(c.layers, c.heads, defaults.block_size, options.kv_format).max(1);
    BatchOptions {
        max_sequences: options.parallel,
        context_len: options.context_len,
        step_tokens: options.step_tokens,
        kv_format: options.kv_format,
        kv_blocks: options.kv_memory.map(|bytes| (bytes / block_bytes) as usize),
        ..defaults
    }
}

/// The model's tokenizer, template, stop ids and the control vectors of
/// the options, each checked against the model.
fn model_info(model: &Model, options: &ServerOptions) -> Result<ModelInfo> {
    let tokenizer = model.tokenizer()?;
    let template = match tokenizer {
        Some(_) => model.chat_template()?,
        None => None,
    };
    let stop_tokens = model.config.eos_token_ids.clone();
    let mut chat_stop_tokens = stop_tokens.clone();
    if let (Some(template), Some(tokenizer)) = (&template, &tokenizer) {
        chat_stop_tokens.extend(template.end_of_turn(tokenizer)?);
    }
    let mut control_vectors = BTreeMap::new();
    for (name, path) in &options.control_vectors {
        let vector = ControlVector::load(path)?;
        // Checked now: a vector that cannot steer this model fails the start.
        Steering::new(&model.config, &[(vector.clone(), 1.0)], options.control_vector_layers.clone())?;
        control_vectors.insert(name.clone(), vector);
    }
    let name = options.model_name.clone().unwrap_or_else(|| default_name(&options.model));
    let created =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(ModelInfo {
        name,
        created,
        config: model.config.clone(),
        tokenizer,
        template,
        stop_tokens,
        chat_stop_tokens,
        context_len: 0,
        image_processor: model.image_processor().cloned(),
        control_vectors,
        control_vector_layers: options.control_vector_layers.clone(),
    })
}

/// A model's name from its path: the file's name less `.gguf`, or the
/// folder's name.
fn default_name(path: &Path) -> String {
    let name =
        path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    name.strip_suffix(".gguf").map(str::to_string).unwrap_or(name)
}

/// The loop: take requests, cancel the abandoned, step, hand out tokens.
fn serve(engine: &mut BatchEngine<'_>, submitted: &Receiver<Submission>, shared: &Shared) {
    let mut active: HashMap<SequenceId, Active> = HashMap::new();
    loop {
        shared.metrics.set_engine(engine.stats());
        if engine.is_idle() {
            match submitted.recv() {
                Ok(submission) => admit(engine, &mut active, submission, shared),
                Err(_) => return,
            }
        }
        // Whatever else has come, without waiting (a closed channel is
        // noticed by `recv` once the engine is idle).
        while let Ok(submission) = submitted.try_recv() {
            admit(engine, &mut active, submission, shared);
        }
        cancel_abandoned(engine, &mut active);
        if !engine.is_idle() {
            step(engine, &mut active, shared);
        }
    }
}

/// Adds a request to the engine and tells its handler whether it was taken.
fn admit(
    engine: &mut BatchEngine<'_>,
    active: &mut HashMap<SequenceId, Active>,
    submission: Submission,
    shared: &Shared,
) {
    let prompt_tokens = submission.prompt_tokens;
    let added = std::panic::catch_unwind(AssertUnwindSafe(|| engine.add(submission.request))).unwrap_or_else(
        |panic| Err(Error::InvalidBatch(format!("adding the request panicked: {}", panic_text(&panic)))),
    );
    let id = added.as_ref().ok().copied();
    if submission.accepted.send(added).is_err() {
        // The handler went away meanwhile.
        if let Some(id) = id {
            let _ = engine.cancel(id);
        }
        return;
    }
    if let Some(id) = id {
        shared.metrics.add_prompt_tokens(prompt_tokens);
        active
            .insert(id, Active { events: submission.events, arrived: submission.arrived, last_token: None });
    }
}

/// Cancels the sequences whose receiver is gone (the client disconnected,
/// or a stop string ended the reply).
fn cancel_abandoned(engine: &mut BatchEngine<'_>, active: &mut HashMap<SequenceId, Active>) {
    let gone: Vec<SequenceId> =
        active.iter().filter(|(_, a)| a.events.is_closed()).map(|(&id, _)| id).collect();
    for id in gone {
        active.remove(&id);
        if let Err(e) = engine.cancel(id) {
            // Completing the steps in flight failed: those sequences are over.
            fail_running(engine, active, &e.to_string());
        }
    }
}

/// Runs a step and hands each token to its sequence's channel. A failed
/// (or panicking) step fails the sequences it ran, and the engine goes on.
fn step(engine: &mut BatchEngine<'_>, active: &mut HashMap<SequenceId, Active>, shared: &Shared) {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| engine.step()));
    let outputs = match outcome {
        Ok(Ok(outputs)) => outputs,
        Ok(Err(e)) => return fail_running(engine, active, &e.to_string()),
        Err(panic) => {
            return fail_running(engine, active, &format!("the step panicked: {}", panic_text(&panic)));
        }
    };
    let now = Instant::now();
    for output in outputs {
        let Some(sequence) = active.get_mut(&output.sequence) else { continue };
        match sequence.last_token.replace(now) {
            None => shared.metrics.observe_first_token(now - sequence.arrived),
            Some(last) => shared.metrics.observe_next_token(now - last),
        }
        let (id, finished) = (output.sequence, output.finish.is_some());
        // A receiver gone meanwhile is cancelled before the next step.
        let _ = sequence.events.send(Event::Token(output));
        if finished {
            active.remove(&id);
        }
    }
}

/// Ends every running sequence with `message` (their step failed).
fn fail_running(engine: &mut BatchEngine<'_>, active: &mut HashMap<SequenceId, Active>, message: &str) {
    eprintln!("server: a step failed: {message}");
    for id in engine.running() {
        if let Some(sequence) = active.remove(&id) {
            let _ = sequence.events.send(Event::Failed(message.to_string()));
        }
        // The failed step left no step in flight: nothing to complete.
        let _ = engine.cancel(id);
    }
}

/// A panic's message, where it carries one.
pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}
