//! Mutation fuzzing, on stable Rust, of every parser that reads untrusted
//! files: config.json, safetensors files and their shard index, GGUF
//! models (header, metadata, the config and tokenizer built from them),
//! GGUF control vectors, and tokenizer.json. Each target mutates its seed
//! files (the fixtures), byte by byte or, for JSON, node by node, and must
//! answer with `Ok` or a typed error: never a panic, never more than
//! [`SLOWEST`] for one input. A failing input is written next to the
//! temporary files and named in the message. What a target does with an
//! input is `fuzz/src/lib.rs`, which the coverage-guided (cargo-fuzz)
//! targets share.
//!
//! `WGSPARK_FUZZ_ITERATIONS=N` sets the executions per target (default: a
//! short smoke run), `WGSPARK_FUZZ_SEED=S` the mutations' seed (runs with
//! different seeds try different inputs).

mod common;
#[allow(dead_code)]
#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Rng;
use common::checkpoint::{fixture_dir, temp_dir};
use serde_json::Value;
use targets::Target;

/// Longest any single input may take.
const SLOWEST: Duration = Duration::from_secs(5);

fn iterations(smoke: usize) -> usize {
    std::env::var("WGSPARK_FUZZ_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(smoke)
}

/// Integers that sit on the edges parsers get wrong.
const EDGES: [u64; 10] = [0, 1, 0x7f, 0x80, 0xff, 0x7fff_ffff, 0xffff_ffff, 1 << 32, 1 << 62, u64::MAX];

/// 1 to 4 byte-level edits: bit flips, edge integers written over the
/// bytes, insertions, deletions, duplicated runs, truncation. Edits land
/// in the first `focus` bytes three times in four (headers and metadata).
fn mutate_bytes(rng: &mut Rng, seed: &[u8], focus: usize) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let span = if rng.below(4) < 3 { focus.min(b.len()) } else { b.len() };
        if span == 0 {
            b.push(rng.below(256) as u8);
            continue;
        }
        let at = rng.below(span as u32) as usize;
        match rng.below(6) {
            0 => b[at] ^= 1 << rng.below(8),
            1 => {
                let v = EDGES[rng.below(EDGES.len() as u32) as usize].to_le_bytes();
                let n = [1, 2, 4, 8][rng.below(4) as usize].min(b.len() - at);
                b[at..at + n].copy_from_slice(&v[..n]);
            }
            2 => {
                let n = 1 + rng.below(16) as usize;
                let bytes: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
                b.splice(at..at, bytes);
            }
            3 => {
                let end = (at + 1 + rng.below(64) as usize).min(b.len());
                b.drain(at..end);
            }
            4 => {
                let end = (at + 1 + rng.below(64) as usize).min(b.len());
                let run = b[at..end].to_vec();
                b.splice(at..at, run);
            }
            _ => b.truncate(at),
        }
    }
    b
}

/// Values a JSON field should not be trusted to hold.
fn hostile_value(rng: &mut Rng) -> Value {
    let deep = (0..64).fold(Value::from(1), |v, _| Value::Array(vec![v]));
    let choices = [
        Value::from(0),
        Value::from(-1),
        Value::from(u64::MAX),
        Value::from(1u64 << 33),
        Value::from(1e308),
        Value::from(-1e308),
        Value::from(1e-320),
        Value::from(0.5),
        Value::Null,
        Value::from(true),
        Value::from("x".repeat(1 << 16)),
        Value::from(""),
        Value::Array(vec![]),
        Value::Object(Default::default()),
        deep,
    ];
    choices[rng.below(choices.len() as u32) as usize].clone()
}

/// Replaces, removes or duplicates one node of `v` (chosen by a walk).
fn mutate_node(rng: &mut Rng, v: &mut Value) {
    let children = match v {
        Value::Object(m) => m.len(),
        Value::Array(a) => a.len(),
        _ => 0,
    };
    if children == 0 || rng.below(4) == 0 {
        *v = hostile_value(rng);
        return;
    }
    let i = rng.below(children as u32) as usize;
    match v {
        Value::Object(m) => {
            let key = m.keys().nth(i).unwrap().clone();
            if rng.below(6) == 0 {
                m.remove(&key);
            } else {
                mutate_node(rng, m.get_mut(&key).unwrap());
            }
        }
        Value::Array(a) => match rng.below(8) {
            0 => {
                a.remove(i);
            }
            1 => {
                let copy = a[i].clone();
                a.extend(std::iter::repeat_n(copy, 100));
            }
            _ => mutate_node(rng, &mut a[i]),
        },
        _ => unreachable!(),
    }
}

/// Largest JSON mutant: duplicated runs multiply; past a few megabytes
/// they only measure the JSON parser.
const MAX_JSON_MUTANT: usize = 4 << 20;

/// A JSON seed mutated node-wise (three times in four) or byte-wise.
fn mutate_json(rng: &mut Rng, seed: &str) -> Vec<u8> {
    let mut out = match serde_json::from_str::<Value>(seed) {
        Ok(mut v) if rng.below(4) < 3 => {
            for _ in 0..1 + rng.below(3) {
                mutate_node(rng, &mut v);
            }
            v.to_string().into_bytes()
        }
        _ => mutate_bytes(rng, seed.as_bytes(), seed.len()),
    };
    out.truncate(MAX_JSON_MUTANT);
    out
}

/// Runs `target` on `iterations` mutants of the seeds, each written to
/// its file in a temporary folder first; fails naming the first input that
/// panics or takes too long, kept as `failing-<file>`.
fn fuzz(
    target: &Target,
    seeds: &[Vec<u8>],
    iterations: usize,
    mut mutate: impl FnMut(&mut Rng, &[u8]) -> Vec<u8>,
) {
    let name = target.name;
    assert!(!seeds.is_empty(), "{name}: no seed files");
    let seed: u64 = std::env::var("WGSPARK_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut rng = Rng::new(0xf022 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let dir = temp_dir(name);
    target.prepare(Path::new(env!("CARGO_MANIFEST_DIR")), &dir).unwrap();
    let started = Instant::now();
    for i in 0..iterations {
        let input = mutate(&mut rng, &seeds[i % seeds.len()]);
        let t = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| target.execute(&dir, &input)));
        let took = t.elapsed();
        if outcome.is_err() || took > SLOWEST {
            let kept = dir.join(format!("failing-{}", target.file));
            std::fs::write(&kept, &input).unwrap();
            let what = if outcome.is_err() { "panicked".to_string() } else { format!("took {took:?}") };
            panic!("{name}: input {i} {what}; kept as {}", kept.display());
        }
    }
    eprintln!("{name}: {iterations} executions in {:.1} s, no panic", started.elapsed().as_secs_f64());
}

fn read_all(paths: impl IntoIterator<Item = PathBuf>) -> Vec<Vec<u8>> {
    paths.into_iter().map(|p| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).collect()
}

fn fixture_files(file: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(fixture_dir(""))
        .unwrap()
        .map(|e| e.unwrap().path().join(file))
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn config_json() {
    let seeds = read_all(fixture_files("config.json"));
    let mutate = |rng: &mut Rng, s: &[u8]| mutate_json(rng, std::str::from_utf8(s).unwrap());
    fuzz(&targets::CONFIG_JSON, &seeds, iterations(2000), mutate);
}

#[test]
fn safetensors_files_and_shard_index() {
    let seeds = read_all(
        ["llama_untied", "qwen3_dense", "fp8_partial_blocks"]
            .map(|c| fixture_dir(c).join("model.safetensors")),
    );
    // The header: its 8-byte length and the JSON after it.
    let mutate = |rng: &mut Rng, s: &[u8]| mutate_bytes(rng, s, 2048);
    fuzz(&targets::SAFETENSORS_HEADER, &seeds, iterations(500), mutate);

    // An index whose shard names and tensor lists are mutated, beside a
    // real shard.
    let index = serde_json::json!({
        "metadata": {"total_size": 189_000},
        "weight_map": {"model.norm.weight": "model.safetensors", "lm_head.weight": "model.safetensors"}
    });
    let seeds = vec![index.to_string().into_bytes()];
    let mutate = |rng: &mut Rng, s: &[u8]| mutate_json(rng, std::str::from_utf8(s).unwrap());
    fuzz(&targets::SHARD_INDEX, &seeds, iterations(300), mutate);
}

#[test]
fn gguf_models() {
    let seeds = read_all(
        ["gguf_llama_q4_k_m", "gguf_qwen3moe_q4_k_m", "gguf_minimax_m2_q4_k_m", "gguf_llama_q8_0_tied"]
            .iter()
            .flat_map(|c| std::fs::read_dir(fixture_dir(c)).unwrap().map(|e| e.unwrap().path()))
            .filter(|p| p.extension().is_some_and(|e| e == "gguf")),
    );
    let mutate = |rng: &mut Rng, s: &[u8]| mutate_bytes(rng, s, 1 << 16);
    fuzz(&targets::GGUF_MODEL, &seeds, iterations(150), mutate);
}

#[test]
fn gguf_control_vectors() {
    let steering = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/steering");
    let seeds = read_all(
        std::fs::read_dir(&steering)
            .unwrap()
            .flat_map(|case| std::fs::read_dir(case.unwrap().path()).unwrap().map(|e| e.unwrap().path()))
            .filter(|p| p.extension().is_some_and(|e| e == "gguf")),
    );
    let mutate = |rng: &mut Rng, s: &[u8]| mutate_bytes(rng, s, 4096);
    fuzz(&targets::GGUF_CONTROL_VECTOR, &seeds, iterations(1000), mutate);
}

#[test]
fn tokenizer_json() {
    let seed = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 3, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+|[a-z]+"}, "behavior": "Isolated",
            "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": false,
            "vocab": {"<unk>": 0, "a": 1, "b": 2, "<s>": 3, "ab": 4, "▁": 5},
            "merges": [["a", "b"]]}
    });
    let seeds = vec![seed.to_string().into_bytes()];
    let mutate = |rng: &mut Rng, s: &[u8]| mutate_json(rng, std::str::from_utf8(s).unwrap());
    fuzz(&targets::TOKENIZER_JSON, &seeds, iterations(500), mutate);
}
