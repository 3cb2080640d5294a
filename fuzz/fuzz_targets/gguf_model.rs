#![no_main]
//! Coverage-guided fuzzing of [`wgspark_fuzz::GGUF_MODEL`].

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    wgspark_fuzz::fuzz_input(&wgspark_fuzz::GGUF_MODEL, root, input);
});
