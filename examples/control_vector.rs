//! Makes a control vector from contrasting prompts and generates with it:
//! the residual capture of each prompt's last position, averaged per layer,
//! the positive mean minus the negative mean (the "mean" method of
//! llama.cpp's cvector-generator), saved in llama.cpp's GGUF layout.
//!
//! ```text
//! cargo run --release --example control_vector -- --out happy.gguf --strength 0.3
//! cargo run --release --example generate -- --control-vector-scaled happy.gguf:0.3 --prompt "Today I"
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use clap::Parser;
use wgspark::sampling::argmax;
use wgspark::tokenizer::TextStream;
use wgspark::{Backend, CaptureOptions, ControlVector, Gpu, GpuOptions, Model, SessionOptions, Steering};

#[derive(Parser, Debug)]
#[command(about = "Make a control vector from contrasting prompts")]
struct Args {
    /// Hugging Face model folder (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompts the vector steers towards (repeatable).
    #[arg(long, default_values_t = [
        "I am so happy and grateful today, everything is".to_string(),
        "What a wonderful, joyful morning, I feel".to_string(),
        "The party was fun and full of laughter, we".to_string(),
    ])]
    positive: Vec<String>,
    /// Prompts it steers away from (repeatable, as many as --positive).
    #[arg(long, default_values_t = [
        "I am so sad and lonely today, everything is".to_string(),
        "What a miserable, gloomy morning, I feel".to_string(),
        "The funeral was quiet and full of tears, we".to_string(),
    ])]
    negative: Vec<String>,
    #[arg(long, default_value = "control_vector.gguf")]
    out: PathBuf,
    /// Strength of the demonstration run after saving.
    #[arg(long, default_value_t = 0.3)]
    strength: f32,
    #[arg(long, default_value = "Today I went to the market and")]
    prompt: String,
    #[arg(long, default_value_t = 24)]
    max_new_tokens: usize,
    #[arg(long)]
    backend: Option<String>,
}

fn main() {
    // SAFETY: first thing in main, before any other thread starts.
    unsafe { wgspark::set_runtime_dir_if_missing() };
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if args.positive.len() != args.negative.len() || args.positive.is_empty() {
        return Err("give as many --positive as --negative prompts, at least one".into());
    }
    let backend = match &args.backend {
        Some(name) => name.parse()?,
        None => Backend::from_env()?,
    };
    let gpu = Gpu::new(&GpuOptions { backend, ..Default::default() })?;
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => wgspark::fetch::default_model(|p| {
            if let wgspark::progress::Progress::Begin { what, .. } = p {
                eprintln!("{what}")
            }
        })?,
    };
    let model = Model::load(&dir, &gpu)?;
    let tokenizer =
        model.tokenizer()?.ok_or_else(|| format!("{} has no tokenizer wgspark can build", dir.display()))?;
    let c = &model.config;
    let encode = |text: &str| -> Result<Vec<u32>, Box<dyn std::error::Error + Send + Sync>> {
        Ok(tokenizer.encode(text)?)
    };

    // Per layer, the mean last-position residual of a prompt set.
    let mut session = model.session(&SessionOptions::default())?;
    session.set_capture(Some(&CaptureOptions::default()))?;
    let mut mean_of =
        |prompts: &[String]| -> Result<Vec<Vec<f32>>, Box<dyn std::error::Error + Send + Sync>> {
            let mut sum = vec![vec![0.0f32; c.hidden]; c.layers];
            for prompt in prompts {
                session.truncate(0);
                session.prefill(&encode(prompt)?)?;
                let capture = session.take_capture().expect("capture is on");
                for (layer, acc) in sum.iter_mut().enumerate() {
                    for (a, v) in acc.iter_mut().zip(capture.layer(layer).expect("every layer")) {
                        *a += v / prompts.len() as f32;
                    }
                }
            }
            Ok(sum)
        };
    let positive = mean_of(&args.positive)?;
    let negative = mean_of(&args.negative)?;
    // Strength 1 moves a layer's output by the whole gap between the means.
    let directions: BTreeMap<usize, Vec<f32>> = (1..c.layers)
        .map(|layer| (layer, positive[layer].iter().zip(&negative[layer]).map(|(p, n)| p - n).collect()))
        .collect();
    let vector = ControlVector { path: args.out.clone(), model_hint: Some(c.model_type.clone()), directions };
    vector.save(&args.out)?;
    eprintln!("wrote {} ({} layers of {})", args.out.display(), vector.directions.len(), c.hidden);

    // The same prompt unsteered, then steered each way.
    let prompt = encode(&args.prompt)?;
    let vector = ControlVector::load(&args.out)?;
    for strength in [0.0, args.strength, -args.strength] {
        let steering = Steering::new(c, &[(vector.clone(), strength)], None)?;
        let mut session = model.session(&SessionOptions::default())?;
        session.set_steering(Some(&steering))?;
        let mut logits = session.prefill(&prompt)?;
        let mut generated = Vec::new();
        for _ in 0..args.max_new_tokens {
            let next = argmax(&logits);
            generated.push(next);
            logits = session.step(next, session.position())?;
        }
        // Decoded as the prompt's continuation (a SentencePiece vocabulary
        // drops the leading space of a text decoded alone).
        let mut text = TextStream::after(&tokenizer, false, &prompt);
        let continuation = generated.iter().map(|&id| text.push(id)).collect::<Result<String, _>>()?;
        println!("strength {strength:+}: {}{continuation}{}", args.prompt, text.finish()?);
        std::io::stdout().flush()?;
    }
    Ok(())
}
