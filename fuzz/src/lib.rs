//! What each fuzz target does with one input, defined once for the
//! coverage-guided targets (`fuzz/fuzz_targets/`, cargo-fuzz) and for the
//! stable mutation run (`tests/fuzz.rs`, which includes this file as a
//! module). An input is written as [`Target::file`] in a folder that holds
//! the target's [`Target::beside`] files, and [`Target::run`] reads the
//! folder as the library reads such a file when it loads a model. Every
//! answer must be `Ok` or a typed error: a panic, a hang or a runaway
//! allocation is a finding.

use std::path::{Path, PathBuf};

use wgspark::gguf::Gguf;
use wgspark::model::Quantization;
use wgspark::model::gguf_checkpoint::GgufCheckpoint;
use wgspark::model::weights::Checkpoint;
use wgspark::{ControlVector, ModelConfig, Steering};

/// One parser under test.
pub struct Target {
    /// The cargo-fuzz target's name (and its corpus folder's).
    pub name: &'static str,
    /// The file name the input is written as.
    pub file: &'static str,
    /// Files the folder holds beside the input: a repository path and the
    /// name it has in the folder.
    pub beside: &'static [(&'static str, &'static str)],
    /// Reads the folder; says how far the input got (`ok` or the error of
    /// each step), which shows whether seeds reach the deeper checks.
    pub run: fn(&Path) -> String,
}

/// config.json, as a Hugging Face folder's.
pub const CONFIG_JSON: Target =
    Target { name: "config_json", file: "config.json", beside: &[], run: config_json };

/// A safetensors file: its header (length and JSON), then tensors read as
/// the upload reads them, bf16, f32 and block FP8.
pub const SAFETENSORS_HEADER: Target =
    Target { name: "safetensors_header", file: "model.safetensors", beside: &[], run: safetensors };

/// `model.safetensors.index.json`, beside a real shard.
pub const SHARD_INDEX: Target = Target {
    name: "shard_index",
    file: "model.safetensors.index.json",
    beside: &[("tests/fixtures/llama_untied/model.safetensors", "model.safetensors")],
    run: shard_index,
};

/// A GGUF model: header, metadata and tensor table, the config and the
/// tokenizer built from the metadata, the small tensors dequantized.
pub const GGUF_MODEL: Target =
    Target { name: "gguf_model", file: "model.gguf", beside: &[], run: gguf_model };

/// A GGUF control vector, and the steering it makes for a model (the
/// mixtral_deep fixture's config).
pub const GGUF_CONTROL_VECTOR: Target = Target {
    name: "gguf_control_vector",
    file: "vector.gguf",
    beside: &[("tests/fixtures/mixtral_deep/config.json", "config.json")],
    run: control_vector,
};

/// tokenizer.json, built and used to encode a text.
pub const TOKENIZER_JSON: Target =
    Target { name: "tokenizer_json", file: "tokenizer.json", beside: &[], run: tokenizer_json };

pub const ALL: [&Target; 6] =
    [&CONFIG_JSON, &SAFETENSORS_HEADER, &SHARD_INDEX, &GGUF_MODEL, &GGUF_CONTROL_VECTOR, &TOKENIZER_JSON];

/// The text the tokenizers encode: words, digits, special-token text,
/// spaces in runs, characters outside a small vocabulary.
pub const TEXT: &str = "ab ba aab b Hello world 123  <s> \u{e9}\u{65e5}\u{672c} \u{2581}x\n";

/// Tensors up to this many elements are dequantized.
const DEQUANTIZED_ELEMENTS: usize = 1 << 16;

impl Target {
    /// Puts [`Self::beside`] (read from the repository at `root`) into `dir`.
    pub fn prepare(&self, root: &Path, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for (from, to) in self.beside {
            std::fs::copy(root.join(from), dir.join(to))?;
        }
        Ok(())
    }

    /// Writes `input` into the prepared `dir` and runs the target on it.
    pub fn execute(&self, dir: &Path, input: &[u8]) -> String {
        let path = dir.join(self.file);
        if let Err(e) = std::fs::write(&path, input) {
            panic!("{}: cannot write the input: {e}", path.display());
        }
        (self.run)(dir)
    }
}

fn outcome<T>(step: &str, result: &wgspark::Result<T>) -> String {
    match result {
        Ok(_) => format!("{step}: ok"),
        Err(e) => format!("{step}: {e}"),
    }
}

fn config_json(dir: &Path) -> String {
    outcome("config", &ModelConfig::load(dir))
}

fn safetensors(dir: &Path) -> String {
    let mut steps = Vec::new();
    let opened = Checkpoint::open(dir, None);
    steps.push(outcome("open", &opened));
    if let Ok(c) = opened {
        steps.push(outcome(
            "stored",
            &c.format("model.norm.weight").and_then(|_| c.stored_bytes("model.norm.weight", &[64])),
        ));
        steps.push(outcome("f32", &c.f32_values("model.layers.0.input_layernorm.weight")));
    }
    let opened = Checkpoint::open(dir, Some(Quantization::Fp8 { block_rows: 128 }));
    steps.push(outcome("open fp8", &opened));
    if let Ok(c) = opened {
        // At the shape the file gives it (a config would give the same, or
        // fail the shape check).
        let name = "model.layers.0.self_attn.q_proj.weight";
        match c.shape(name).map(<[usize]>::to_vec) {
            Ok(shape) => {
                steps.push(outcome("fp8 bytes", &c.format(name).and_then(|_| c.stored_bytes(name, &shape))));
                let rows = shape.iter().rev().skip(1).try_fold(1usize, |n, &d| n.checked_mul(d));
                if let Some(rows) = rows {
                    steps.push(outcome("fp8 rows", &c.stored_rows(name, &shape, rows / 3..rows)));
                }
            }
            Err(e) => steps.push(format!("fp8: {e}")),
        }
    }
    steps.join("; ")
}

fn shard_index(dir: &Path) -> String {
    outcome("open", &Checkpoint::open(dir, None))
}

fn gguf_model(dir: &Path) -> String {
    let path = dir.join(GGUF_MODEL.file);
    let mut steps = Vec::new();
    // What Model::load does before the upload.
    let opened = GgufCheckpoint::open(&path);
    steps.push(outcome("open", &opened));
    if let Ok(checkpoint) = opened {
        steps.push(outcome("config", &checkpoint.config()));
        steps.push(format!("{} bytes on the GPU", checkpoint.gpu_bytes()));
    }
    // Model::tokenizer, and the tensors' values.
    if let Ok(g) = Gguf::open(&path) {
        let tokenizer = wgspark::tokenizer::from_gguf(&g);
        steps.push(outcome("tokenizer", &tokenizer));
        if let Ok(Some(tokenizer)) = tokenizer {
            steps.push(outcome("encode", &tokenizer.encode_prompt(TEXT)));
        }
        let small = g.tensors.iter().filter(|t| t.elements() <= DEQUANTIZED_ELEMENTS);
        let failed = small.map(|t| g.dequantize(t)).filter(Result::is_err).count();
        steps.push(format!("{failed} small tensors not dequantized"));
    }
    steps.join("; ")
}

fn control_vector(dir: &Path) -> String {
    let vector = ControlVector::load(dir.join(GGUF_CONTROL_VECTOR.file));
    let mut steps = vec![outcome("load", &vector)];
    if let (Ok(vector), Ok(config)) = (vector, ModelConfig::load(dir)) {
        steps.push(outcome("steering", &Steering::new(&config, &[(vector, 0.5)], Some(1..=2))));
    }
    steps.join("; ")
}

fn tokenizer_json(dir: &Path) -> String {
    let built = wgspark::tokenizer::from_folder(dir);
    let mut steps = vec![outcome("tokenizer", &built)];
    if let Ok(Some(tokenizer)) = built {
        steps.push(outcome("encode", &tokenizer.encode_prompt(TEXT)));
    }
    steps.join("; ")
}

/// The folder a fuzzing process writes its inputs into, prepared with
/// the target's files from the repository at `root`: in memory
/// (`/dev/shm`) where there is one, one per target and process, reused for
/// every input. Folders of processes that have ended are removed first.
pub fn scratch_dir(target: &Target, root: &Path) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
    let prefix = format!("wgspark-fuzz-{}-", target.name);
    let processes = Path::new("/proc/self").exists();
    for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok());
        if processes && pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let dir = base.join(format!("{prefix}{}", std::process::id()));
    if let Err(e) = target.prepare(root, &dir) {
        panic!("{}: cannot prepare {}: {e}", target.name, dir.display());
    }
    dir
}

/// One input of a cargo-fuzz target (a process fuzzes one target). A
/// panic the library catches itself (it turns the tokenizers library's
/// into errors) is an answer like any other, and passes silently; one that
/// reaches here is printed and aborts, which libFuzzer reports as a crash.
/// `WGSPARK_FUZZ_SHOW=1` prints each input's outcome (to see how far the
/// seeds get).
pub fn fuzz_input(target: &'static Target, root: &Path, input: &[u8]) {
    use std::sync::{Mutex, OnceLock};
    static STATE: OnceLock<(PathBuf, bool)> = OnceLock::new();
    static LAST_PANIC: Mutex<String> = Mutex::new(String::new());
    let (dir, show) = STATE.get_or_init(|| {
        // libfuzzer-sys's hook aborts on every panic, even one caught
        // inside the library: this one keeps the message for below.
        std::panic::set_hook(Box::new(|info| {
            let message = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let location = info.location().map_or(String::new(), |l| l.to_string());
            *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) =
                format!("panicked at {location}: {message}");
        }));
        (scratch_dir(target, root), std::env::var_os("WGSPARK_FUZZ_SHOW").is_some_and(|v| v == "1"))
    });
    match std::panic::catch_unwind(|| target.execute(dir, input)) {
        Ok(outcome) if *show => eprintln!("{}: {outcome}", target.name),
        Ok(_) => {}
        Err(_) => {
            eprintln!("{}: {}", target.name, LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()));
            std::process::abort();
        }
    }
}
