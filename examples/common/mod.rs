//! What the examples share: progress shown while a model loads, byte
//! counts as flags take them, and the device the flags choose.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};
use wgspark::GpuOptions;
use wgspark::progress::Progress;

/// The environment's device options (`GpuOptions::from_env`), with
/// `--backend` and `--adapter` where given.
pub fn gpu_options(backend: Option<&str>, adapter: Option<usize>) -> wgspark::Result<GpuOptions> {
    let mut options = GpuOptions::from_env()?;
    if let Some(name) = backend {
        options.backend = name.parse()?;
    }
    options.adapter = adapter.or(options.adapter);
    Ok(options)
}

/// Progress as a bar on a terminal, as one line per step otherwise.
#[derive(Default)]
pub struct Reporter {
    bar: Option<ProgressBar>,
}

impl Reporter {
    pub fn report(&mut self, progress: Progress<'_>) {
        match progress {
            Progress::Begin { what, total_bytes } if std::io::stderr().is_terminal() => {
                let bar = match total_bytes {
                    Some(total) => ProgressBar::new(total).with_style(
                        ProgressStyle::with_template(
                            "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
                        )
                        .expect("a valid template")
                        .progress_chars("=> "),
                    ),
                    None => ProgressBar::new_spinner().with_style(
                        ProgressStyle::with_template("{msg} {bytes} ({bytes_per_sec})")
                            .expect("a valid template"),
                    ),
                };
                self.bar = Some(bar.with_message(what.to_string()));
            }
            Progress::Begin { what, total_bytes } => match total_bytes {
                Some(total) => eprintln!("{what} ({:.1} MB)", total as f64 / 1e6),
                None => eprintln!("{what}"),
            },
            Progress::Advance { bytes } => {
                if let Some(bar) = &self.bar {
                    bar.inc(bytes);
                }
            }
            Progress::End => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
            }
        }
    }
}

/// A byte count: a number with an optional unit (B, KB, MB, GB, TB in
/// powers of 1000; KiB, MiB, GiB, TiB in powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number.parse().map_err(|_| format!("{text:?} is not a size such as 24GiB"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ));
        }
    };
    let bytes = number * scale;
    // `number` holds digits and dots only: never NaN, infinite when long.
    if bytes < 1.0 {
        return Err(format!("{text:?} is not a size of at least one byte"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(format!("{text:?} is more bytes than a 64-bit count holds"));
    }
    Ok(bytes as u64)
}
