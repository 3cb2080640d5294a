//! Every class of bad input gets its typed error, naming the problem;
//! nothing panics.

mod common;

use common::checkpoint::{Scratch, edited_fixture, fixture_dir, temp_dir};
use safetensors::Dtype;
use wgspark::gguf::{GgmlType, GgufWriter, MetaValue};
use wgspark::{
    Backend, CaptureOptions, ControlVector, ControlVectorProblem, Error, GenerateOptions, Gpu, GpuOptions,
    Model, Sampler, Sampling, SessionOptions, Steering,
};

fn gpu() -> Gpu {
    common::gpu(common::backends()[0])
}

fn load_err(dir: &std::path::Path) -> Error {
    match Model::load(dir, &gpu()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn token_out_of_range() {
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let vocab = model.config.vocab;
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let err = session.step(vocab as u32, 0).unwrap_err();
    assert!(
        matches!(err, Error::TokenOutOfRange { token, vocab: v } if token as usize == vocab && v == vocab),
        "{err}"
    );
    let err = session.prefill(&[1, 2, vocab as u32 + 7]).unwrap_err();
    assert!(matches!(err, Error::TokenOutOfRange { .. }), "{err}");
    assert_eq!(session.position(), 0, "a rejected prompt leaves the session untouched");
}

/// A Qwen3-VL prompt of ids that holds an image's or a video's placeholder
/// would need the vision tower's rows in its place: an error naming the
/// token and its position, the session untouched.
#[test]
fn image_placeholders_in_a_prompt_of_ids() {
    let model = Model::load(fixture_dir("qwen3_vl_dense"), &gpu()).unwrap();
    let (image, video) = (model.config.vocab as u32 - 4, model.config.vocab as u32 - 3);
    assert_eq!(model.config.media_token_ids, vec![image, video]);
    let mut session = model.session(&SessionOptions::default()).unwrap();
    for token in [image, video] {
        let err = session.prefill(&[1, 2, token, 3]).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { .. })
                && err.to_string().contains(&format!("token {token} at prompt position 2")),
            "{err}"
        );
        assert_eq!(session.position(), 0);
    }
    // Text models have none, and take no images.
    let text = Model::load(fixture_dir("qwen3_dense"), &gpu()).unwrap();
    assert!(text.config.media_token_ids.is_empty());
    let image = wgspark::vision::RgbImage { width: 32, height: 32, pixels: vec![128; 32 * 32 * 3] };
    let mut session = text.session(&SessionOptions::default()).unwrap();
    let err = session.prefill_multimodal(&[wgspark::PromptPart::Image(&image)]).unwrap_err();
    assert!(matches!(&err, Error::Unsupported { what, .. } if what.contains("vision tower")), "{err}");
    assert_eq!(session.position(), 0);
    // A Qwen3-VL folder without its preprocessor_config.json has a tower
    // but no way to cut patches.
    let dir = common::checkpoint::temp_dir("no-processor");
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir("qwen3_vl_images").join(file), dir.join(file)).unwrap();
    }
    let model = Model::load(&dir, &gpu()).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let err = session.prefill_multimodal(&[wgspark::PromptPart::Image(&image)]).unwrap_err();
    assert!(
        matches!(&err, Error::Unsupported { what, .. } if what.contains("preprocessor_config.json")),
        "{err}"
    );
}

#[test]
fn non_sequential_position() {
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    session.step(1, 0).unwrap();
    let err = session.step(1, 2).unwrap_err();
    assert!(matches!(err, Error::NonSequentialPosition { expected: 1, got: 2 }), "{err}");
    let err = session.step(1, 0).unwrap_err();
    assert!(matches!(err, Error::NonSequentialPosition { expected: 1, got: 0 }), "{err}");
    // Rewinding is explicit.
    session.truncate(0);
    session.step(1, 0).unwrap();
}

#[test]
fn context_overflow() {
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let mut session = model.session(&SessionOptions { context_len: Some(4), ..Default::default() }).unwrap();
    let err = session.prefill(&[1, 2, 3, 4, 5]).unwrap_err();
    assert!(matches!(err, Error::ContextOverflow { position: 4, context_len: 4 }), "{err}");
    session.prefill(&[1, 2, 3, 4]).unwrap();
    let err = session.step(1, 4).unwrap_err();
    assert!(matches!(err, Error::ContextOverflow { position: 4, context_len: 4 }), "{err}");
}

/// A context no device holds (sizes that would overflow included) fails the
/// budget or binding check; an empty one says which option sets it.
#[test]
fn context_sizes_out_of_reach() {
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let session = |len| model.session(&SessionOptions { context_len: Some(len), ..Default::default() });
    for len in [1usize << 40, 1 << 59, 1 << 60, usize::MAX] {
        let err = session(len).err().expect("does not fit");
        let refused = match &err {
            Error::OutOfDeviceMemory { needed_bytes, .. } => needed_bytes.is_some_and(|b| b > 1 << 40),
            Error::Unsupported { what, .. } => what.contains("context"),
            _ => false,
        };
        assert!(refused, "{len}: {err}");
    }
    let err = session(0).err().expect("no positions");
    assert!(matches!(&err, Error::InvalidContext { .. }) && err.to_string().contains("--context"), "{err}");
}

#[test]
fn prefill_chunk_of_zero() {
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let err = model
        .session(&SessionOptions { prefill_chunk: Some(0), ..Default::default() })
        .err()
        .expect("no chunk");
    assert!(
        matches!(err, Error::InvalidPrefillChunk) && err.to_string().contains("--prefill-chunk"),
        "{err}"
    );
    // One token a chunk is a chunk.
    assert!(model.session(&SessionOptions { prefill_chunk: Some(1), ..Default::default() }).is_ok());
}

#[test]
fn empty_prompt() {
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    assert!(matches!(session.prefill(&[]), Err(Error::EmptyPrompt)));
}

#[test]
fn unsupported_architecture() {
    let dir = edited_fixture("llama_untied", |c, _| c["model_type"] = "gpt2".into());
    let err = load_err(&dir);
    assert!(
        matches!(&err, Error::UnsupportedArchitecture { model_type, .. } if model_type == "gpt2"),
        "{err}"
    );
    assert!(err.to_string().contains("llama"), "the message lists what is supported: {err}");
}

#[test]
fn missing_tensor_is_named() {
    let name = "model.layers.1.mlp.down_proj.weight";
    let dir = edited_fixture("llama_untied", |_, t| {
        t.remove(name);
    });
    let err = load_err(&dir);
    assert!(matches!(&err, Error::MissingTensor { name: n } if n == name), "{err}");
    assert!(err.to_string().contains(name));
}

#[test]
fn missing_lm_head_of_an_untied_model_is_named() {
    let dir = edited_fixture("llama_untied", |_, t| {
        t.remove("lm_head.weight");
    });
    assert!(matches!(load_err(&dir), Error::MissingTensor { name } if name == "lm_head.weight"));
}

#[test]
fn wrong_dtype_names_both() {
    let name = "model.layers.0.self_attn.k_proj.weight";
    let dir = edited_fixture("llama_untied", |_, t| {
        let entry = t.get_mut(name).unwrap();
        entry.0 = Dtype::I16;
    });
    let err = load_err(&dir);
    assert!(matches!(&err, Error::WrongDtype { name: n, found, .. } if n == name && found == "I16"), "{err}");
}

#[test]
fn wrong_shape_names_both() {
    let name = "model.layers.0.mlp.up_proj.weight";
    let dir = edited_fixture("llama_untied", |_, t| {
        t.get_mut(name).unwrap().1 = vec![64, 96];
    });
    let err = load_err(&dir);
    assert!(
        matches!(&err, Error::WrongShape { name: n, expected, found }
            if n == name && expected == &vec![96, 64] && found == &vec![64, 96]),
        "{err}"
    );
}

/// FP8 checkpoints: a weight's scale missing, of the wrong block grid or
/// dtype; FP8 weights that config.json does not declare; quantization
/// methods and layouts this engine does not read.
#[test]
fn fp8_checkpoint_errors() {
    let (case, weight) = ("fp8_qwen3_dense", "model.layers.0.self_attn.k_proj.weight");
    let scale = format!("{weight}_scale_inv");
    let dir = edited_fixture(case, |_, t| {
        t.remove(&scale);
    });
    assert!(matches!(load_err(&dir), Error::MissingTensor { name } if name == scale));
    // k_proj is [128, 256]: its scales are [1, 2], in f32.
    let dir = edited_fixture(case, |_, t| t.get_mut(&scale).unwrap().1 = vec![2, 1]);
    let err = load_err(&dir);
    assert!(
        matches!(&err, Error::WrongShape { name, expected, .. } if name == &scale && expected == &[1, 2]),
        "{err}"
    );
    let dir = edited_fixture(case, |_, t| t.get_mut(&scale).unwrap().0 = Dtype::I32);
    let err = load_err(&dir);
    assert!(
        matches!(&err, Error::WrongDtype { name, found, .. } if name == &scale && found == "I32"),
        "{err}"
    );

    let dir = edited_fixture(case, |c, _| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    let err = load_err(&dir);
    assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("F8_E4M3"), "{err}");
    for (edit, needle) in [
        (serde_json::json!({"quant_method": "gptq", "bits": 4}), "gptq"),
        (serde_json::json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}), "e5m2"),
        (serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 64]}), "[128, 64]"),
        (serde_json::json!({"quant_method": "fp8"}), "per-tensor"),
    ] {
        let dir = edited_fixture(case, |c, _| c["quantization_config"] = edit.clone());
        let err = load_err(&dir);
        assert!(
            matches!(err, Error::Unsupported { .. }) && err.to_string().contains(needle),
            "{edit}: {err}"
        );
    }
    let dir = edited_fixture(case, |c, _| {
        c["quantization_config"] = serde_json::json!({"quant_method": "fp8", "weight_block_size": [0, 128]})
    });
    assert!(matches!(load_err(&dir), Error::InvalidConfig { .. }));
}

#[test]
fn malformed_json_is_reported_with_its_path() {
    let dir = temp_dir("bad-json");
    std::fs::copy(fixture_dir("llama_untied").join("model.safetensors"), dir.join("model.safetensors"))
        .unwrap();
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let err = load_err(&dir);
    assert!(matches!(&err, Error::Json { path, .. } if path.ends_with("config.json")), "{err}");
}

#[test]
fn invalid_config_values() {
    for (edit, needle) in [
        (("num_key_value_heads", serde_json::json!(3)), "multiple"),
        (("hidden_size", serde_json::json!("wide")), "hidden_size"),
        (("rope_scaling", serde_json::json!({"rope_type": "dynamic", "factor": 2.0})), "dynamic"),
        (("head_dim", serde_json::json!(1024)), "head_dim"),
        // Values that parse but mean nothing: zero as f32, negative, zero.
        (("rope_theta", serde_json::json!(1e-50)), "rope_theta"),
        (("rms_norm_eps", serde_json::json!(-1e-5)), "rms_norm_eps"),
        (("rope_scaling", serde_json::json!({"rope_type": "linear", "factor": 0.0})), "factor"),
        // Would size per-layer tables of 2^33 entries before any tensor is read.
        (("num_hidden_layers", serde_json::json!(1u64 << 33)), "more than any model has"),
    ] {
        let dir = edited_fixture("llama_untied", |c, _| c[edit.0] = edit.1.clone());
        let err = load_err(&dir);
        assert!(matches!(err, Error::InvalidConfig { .. }), "{}: {err}", edit.0);
        assert!(err.to_string().contains(needle), "{}: {err}", edit.0);
    }
}

#[test]
fn missing_files() {
    let dir = temp_dir("empty");
    assert!(matches!(load_err(&dir), Error::Io { path, .. } if path.ends_with("config.json")));
    std::fs::copy(fixture_dir("llama_untied").join("config.json"), dir.join("config.json")).unwrap();
    assert!(matches!(load_err(&dir), Error::Io { path, .. } if path.ends_with("model.safetensors")));
    std::fs::write(dir.join("model.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}").unwrap();
    assert!(matches!(load_err(&dir), Error::Safetensors { .. }));
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": {\"a\": \"shard-1.safetensors\"}}",
    )
    .unwrap();
    assert!(matches!(load_err(&dir), Error::Io { path, .. } if path.ends_with("shard-1.safetensors")));
}

/// Shards are files of the model folder: an index naming a path elsewhere
/// is refused before anything is opened, and a tensor in two shards is an
/// error rather than one silently winning.
#[test]
fn shard_index_that_leads_elsewhere_or_repeats_a_tensor() {
    let dir = temp_dir("shards");
    std::fs::copy(fixture_dir("llama_untied").join("config.json"), dir.join("config.json")).unwrap();
    for shard in ["../model.safetensors", "/etc/passwd", "sub/model.safetensors", ".."] {
        let index = serde_json::json!({"weight_map": {"a": shard}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let err = load_err(&dir);
        assert!(
            matches!(&err, Error::Json { message, .. } if message.contains("not a file name")),
            "{shard}: {err}"
        );
    }
    let weights = fixture_dir("llama_untied").join("model.safetensors");
    std::fs::copy(&weights, dir.join("a.safetensors")).unwrap();
    std::fs::copy(&weights, dir.join("b.safetensors")).unwrap();
    let index = serde_json::json!({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let err = load_err(&dir);
    assert!(matches!(&err, Error::Safetensors { message, .. } if message.contains("is also in")), "{err}");
}

/// A FIFO would block the read and a directory is not a file: both are
/// named as what they are, without opening them.
#[test]
fn model_files_that_are_not_regular_files() {
    let dir = temp_dir("not_regular");
    let fifo = dir.join("config.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success());
    let err = load_err(&dir);
    assert!(
        matches!(&err, Error::Io { path, source } if path == &fifo && source.to_string().contains("FIFO")),
        "{err}"
    );
    std::fs::remove_file(&fifo).unwrap();
    std::fs::copy(fixture_dir("llama_untied").join("config.json"), &fifo).unwrap();
    std::fs::create_dir(dir.join("model.safetensors")).unwrap();
    let err = load_err(&dir);
    assert!(matches!(&err, Error::Io { source, .. } if source.to_string().contains("a directory")), "{err}");
}

#[test]
fn model_larger_than_the_device_budget() {
    let gpu = Gpu::new(&wgspark::GpuOptions {
        backend: common::backends()[0],
        memory_budget: Some(100_000),
        ..Default::default()
    })
    .unwrap();
    let err = Model::load(fixture_dir("llama_untied"), &gpu).unwrap_err();
    assert!(matches!(err, Error::OutOfDeviceMemory { .. }), "{err}");
}

/// A model larger than the device can hold (here a sparse file whose
/// embedding alone is 48 GiB) is refused before anything is allocated,
/// naming what it needs and what the device allows, where allocating
/// would have lost the device.
#[test]
fn model_larger_than_the_device() {
    let fixture = fixture_dir("llama3_tied");
    let dir = temp_dir("huge_embedding");
    let vocab: usize = 400_000_000;
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = vocab.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let hidden = config["hidden_size"].as_u64().unwrap() as usize;
    sparse_with_embedding(
        &fixture.join("model.safetensors"),
        &dir.join("model.safetensors"),
        [vocab, hidden],
    );
    common::on_each_backend(|gpu| {
        let software = gpu.info.device_type == wgpu::DeviceType::Cpu;
        assert!(gpu.caps.device_memory.is_some() || !software, "a software adapter reports its memory");
        let Some(memory) = gpu.caps.device_memory else {
            eprintln!("{} reports no memory size: nothing to check against", gpu.describe());
            return;
        };
        let err = Model::load(&*dir, gpu).unwrap_err();
        assert!(
            matches!(&err, Error::OutOfDeviceMemory { needed_bytes: Some(n), message, .. }
                if *n > memory && message.contains(&format!("the device allows {memory} bytes"))),
            "{err}"
        );
    });
}

/// `source`'s tensors written to `dest` with the embedding given `shape`,
/// its bytes a hole of the file (sparse: it takes no disk).
fn sparse_with_embedding(source: &std::path::Path, dest: &std::path::Path, shape: [usize; 2]) {
    use std::io::{Seek, Write};
    let bytes = std::fs::read(source).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut header = serde_json::Map::new();
    let mut parts = Vec::new();
    let mut offset = 0usize;
    for (name, view) in file.tensors() {
        let embedding = name == "model.embed_tokens.weight";
        let dims = if embedding { shape.to_vec() } else { view.shape().to_vec() };
        let size = if embedding { shape[0] * shape[1] * 2 } else { view.data().len() };
        let dtype = serde_json::to_value(view.dtype()).unwrap();
        header.insert(
            name,
            serde_json::json!({"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + size]}),
        );
        parts.push((offset, (!embedding).then(|| view.data().to_vec())));
        offset += size;
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = std::fs::File::create(dest).unwrap();
    out.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    out.write_all(&text).unwrap();
    let base = 8 + text.len() as u64;
    for (at, data) in parts {
        if let Some(data) = data {
            out.seek(std::io::SeekFrom::Start(base + at as u64)).unwrap();
            out.write_all(&data).unwrap();
        }
    }
    out.set_len(base + offset as u64).unwrap();
}

/// An adapter number past those `Gpu::adapters` lists is an error that
/// lists them; each number in range opens the adapter it names.
#[test]
fn adapters_by_number() {
    let adapters = Gpu::adapters(Backend::Auto);
    assert!(!adapters.is_empty(), "no adapter on this machine");
    for (i, a) in adapters.iter().enumerate() {
        let gpu = Gpu::new(&GpuOptions { adapter: Some(i), ..GpuOptions::default() }).unwrap();
        assert_eq!((&gpu.info.name, gpu.info.backend), (&a.info.name, a.info.backend), "adapter {i}");
        assert_eq!(gpu.caps.device_memory, a.device_memory, "adapter {i}");
    }
    let past = GpuOptions { adapter: Some(adapters.len()), ..GpuOptions::default() };
    match Gpu::new(&past) {
        Err(Error::AdapterOutOfRange { index, adapters: listed }) => {
            assert_eq!(index, adapters.len());
            assert_eq!(listed.len(), adapters.len());
            assert!(listed[0].starts_with(&format!("0: {}", adapters[0].info.name)), "{listed:?}");
        }
        other => panic!("adapter {} of {}: {other:?}", adapters.len(), adapters.len()),
    }
}

#[test]
fn bad_backend_and_sampling_parameters() {
    assert!(matches!("cuda".parse::<Backend>(), Err(Error::UnknownBackend(name)) if name == "cuda"));
    for sampling in [
        Sampling::Random { temperature: 0.0, top_k: None, top_p: None },
        Sampling::Random { temperature: f32::NAN, top_k: None, top_p: None },
        Sampling::Random { temperature: 1.0, top_k: Some(0), top_p: None },
        Sampling::Random { temperature: 1.0, top_k: None, top_p: Some(1.5) },
        Sampling::Random { temperature: 1.0, top_k: None, top_p: Some(0.0) },
    ] {
        assert!(matches!(Sampler::new(sampling, 0), Err(Error::InvalidSampling(_))), "{sampling:?}");
    }
}

/// A dense model whose activations turn NaN gives an error naming the
/// position, not a row of NaN logits.
#[test]
fn logits_that_are_not_numbers() {
    let dir = edited_fixture("llama_untied", |_, tensors| {
        let (dtype, _, bytes) = tensors.get_mut("model.norm.weight").expect("the final norm");
        assert_eq!(*dtype, Dtype::BF16);
        bytes[..2].copy_from_slice(&0x7fc0u16.to_le_bytes()); // one bf16 NaN
    });
    let model = Model::load(&dir, &gpu()).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let err = session.prefill(&[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::NonFiniteLogits { position: 2, .. }), "{err}");
}

/// The same model generating (tokens chosen on the GPU, greedy or drawn):
/// the sampler sees the logits are not numbers and generation stops with
/// an error naming the position, instead of yielding id 0.
#[test]
fn sampling_from_logits_that_are_not_numbers() {
    let dir = edited_fixture("llama_untied", |_, tensors| {
        let (_, _, bytes) = tensors.get_mut("model.norm.weight").expect("the final norm");
        bytes[..2].copy_from_slice(&0x7fc0u16.to_le_bytes()); // one bf16 NaN
    });
    let model = Model::load(&dir, &gpu()).unwrap();
    let draw = Sampling::Random { temperature: 0.8, top_k: Some(5), top_p: Some(0.9) };
    for sampling in [Sampling::Greedy, draw] {
        let mut session = model.session(&SessionOptions::default()).unwrap();
        let options = wgspark::GenerateOptions { max_tokens: 4, sampling, ..Default::default() };
        let first = session.generate(&[1, 2, 3], &options).unwrap().next().expect("a first id");
        let err = first.unwrap_err();
        assert!(matches!(err, Error::NonFiniteSample { position: 2 }), "{sampling:?}: {err}");
        assert_eq!(session.position(), 3, "the prompt stays, nothing after it");
    }
}

/// NaN activations reach the router as scores that are not numbers: the
/// routing readback says so (naming the layer) instead of indexing experts
/// with what the top-k made of them.
#[test]
fn router_scores_that_are_not_numbers() {
    let dir = edited_fixture("mixtral_8x2", |_, tensors| {
        let (name, (dtype, _, bytes)) = tensors
            .iter_mut()
            .find(|(n, _)| {
                n.starts_with("model.layers.1.") && n.ends_with("gate.weight") && !n.contains("expert")
            })
            .expect("layer 1 has a router");
        assert_eq!(*dtype, Dtype::BF16, "{name}");
        for b in bytes.chunks_exact_mut(2) {
            b.copy_from_slice(&0x7fc0u16.to_le_bytes()); // a bf16 NaN
        }
    });
    let model = Model::load(&dir, &gpu()).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let err = session.prefill(&[1, 2, 3]).unwrap_err();
    assert!(matches!(err, Error::NonFiniteRouting { layer: 1 }), "{err}");
    // ExpertSelection kept on the device is not read back (a chunk grouped by
    // expert still reads it): the experts' weights become NaN, and so do
    // the logits, which the sampler reports.
    let device = SessionOptions { routing: wgspark::RoutingMode::DeviceResident, ..Default::default() };
    let mut session = model.session(&device).unwrap();
    let err = session.prefill(&[1, 2, 3]).unwrap_err();
    let named =
        matches!(err, Error::NonFiniteLogits { position: 2, .. } | Error::NonFiniteRouting { layer: 1 });
    assert!(named, "{err}");
    let mut session = model.session(&device).unwrap();
    let options = wgspark::GenerateOptions { max_tokens: 2, ..Default::default() };
    let err = session.generate(&[1, 2, 3], &options).unwrap().next().unwrap().unwrap_err();
    assert!(matches!(err, Error::NonFiniteSample { position: 2 }), "{err}");
}

#[test]
fn moe_config_errors() {
    let dir = edited_fixture("mixtral_8x2", |c, _| c["num_experts_per_tok"] = 9.into());
    let err = load_err(&dir);
    assert!(
        matches!(err, Error::InvalidConfig { .. }) && err.to_string().contains("num_experts_per_tok"),
        "{err}"
    );

    let dir = edited_fixture("minimax_m2", |c, _| c["scoring_func"] = "softmax".into());
    let err = load_err(&dir);
    assert!(matches!(&err, Error::Unsupported { what, .. } if *what == "router scoring_func"), "{err}");

    let dir = edited_fixture("mixtral_8x2", |c, _| {
        c.as_object_mut().unwrap().remove("num_local_experts");
    });
    assert!(load_err(&dir).to_string().contains("num_local_experts"));
}

#[test]
fn missing_expert_and_bias_tensors_are_named() {
    for (case, name) in [
        ("mixtral_8x2", "model.layers.1.block_sparse_moe.experts.5.w3.weight"),
        ("qwen3_moe_no_norm", "model.layers.0.mlp.experts.7.down_proj.weight"),
        ("qwen3_moe_norm", "model.layers.1.mlp.experts.down_proj"),
        ("minimax_m2", "model.layers.0.block_sparse_moe.e_score_correction_bias"),
        ("minimax_m2", "model.layers.1.block_sparse_moe.gate.weight"),
        ("qwen3_dense", "model.layers.0.self_attn.k_norm.weight"),
    ] {
        let dir = edited_fixture(case, |_, t| {
            assert!(t.remove(name).is_some(), "{case} has {name}");
        });
        let err = load_err(&dir);
        assert!(matches!(&err, Error::MissingTensor { name: n } if n == name), "{case}: {err}");
    }
}

#[test]
fn wrong_expert_shapes_are_named() {
    let name = "model.layers.0.block_sparse_moe.experts.2.w1.weight";
    let dir = edited_fixture("mixtral_8x2", |_, t| {
        t.get_mut(name).unwrap().1 = vec![64, 48];
    });
    assert!(matches!(load_err(&dir), Error::WrongShape { name: n, expected, found }
        if n == name && expected == vec![48, 64] && found == vec![64, 48]));

    let name = "model.layers.0.mlp.experts.gate_up_proj";
    let dir = edited_fixture("qwen3_moe_norm", |_, t| {
        t.get_mut(name).unwrap().1 = vec![4, 128, 64];
    });
    assert!(matches!(load_err(&dir), Error::WrongShape { name: n, expected, .. }
        if n == name && expected == vec![8, 64, 64]));
}

/// A control vector file written with `build`, in a fresh temp folder.
fn control_vector_file(name: &str, build: impl FnOnce(&mut GgufWriter)) -> Scratch {
    let path = temp_dir(&format!("cvec_{name}")).file(&format!("{name}.gguf"));
    let mut w = GgufWriter::new();
    build(&mut w);
    w.write(&path).unwrap();
    path
}

fn well_formed(w: &mut GgufWriter, directions: &[(usize, Vec<f32>)]) {
    w.meta("general.architecture", MetaValue::Str("controlvector".into()));
    w.meta("controlvector.model_hint", MetaValue::Str("llama".into()));
    w.meta("controlvector.layer_count", MetaValue::I32(directions.len() as i32));
    for (layer, d) in directions {
        w.tensor_f32(&format!("direction.{layer}"), &[d.len()], d);
    }
}

fn control_vector_problem(path: &std::path::Path) -> ControlVectorProblem {
    match ControlVector::load(path) {
        Err(Error::ControlVector { path: p, problem }) => {
            assert_eq!(p, path, "the error names the file");
            problem
        }
        other => panic!("{}: expected a control vector error, got {other:?}", path.display()),
    }
}

#[test]
fn control_vector_bad_files() {
    use ControlVectorProblem as P;
    let d = vec![0.25f32; 64];
    let arch = |w: &mut GgufWriter, a: &str| {
        w.meta("general.architecture", MetaValue::Str(a.into()));
    };
    type Build<'a> = Box<dyn FnOnce(&mut GgufWriter) + 'a>;
    let cases: Vec<(&str, Build, P)> = vec![
        (
            "wrong_architecture",
            Box::new(|w| {
                arch(w, "llama");
                w.meta("controlvector.layer_count", MetaValue::I32(1));
                w.tensor_f32("direction.1", &[64], &d);
            }),
            P::WrongArchitecture { found: "llama".into() },
        ),
        (
            "missing_architecture",
            Box::new(|w| {
                w.meta("controlvector.layer_count", MetaValue::I32(1));
                w.tensor_f32("direction.1", &[64], &d);
            }),
            P::WrongArchitecture { found: "(missing)".into() },
        ),
        (
            "missing_layer_count",
            Box::new(|w| {
                arch(w, "controlvector");
                w.tensor_f32("direction.1", &[64], &d);
            }),
            P::MissingLayerCount,
        ),
        (
            "layer_count_mismatch",
            Box::new(|w| {
                arch(w, "controlvector");
                w.meta("controlvector.layer_count", MetaValue::U32(3));
                w.tensor_f32("direction.1", &[64], &d);
            }),
            P::LayerCountMismatch { declared: 3, found: 1 },
        ),
        ("no_directions", Box::new(|w| well_formed(w, &[])), P::NoDirections),
        (
            "unexpected_tensor",
            Box::new(|w| {
                well_formed(w, &[(1, d.clone())]);
                w.tensor_f32("bias.1", &[64], &d);
            }),
            P::UnexpectedTensor { name: "bias.1".into() },
        ),
        (
            "signed_layer",
            Box::new(|w| {
                well_formed(w, &[(2, d.clone())]);
                w.tensor_f32("direction.+1", &[64], &d);
            }),
            P::UnexpectedTensor { name: "direction.+1".into() },
        ),
        (
            "zero_padded_layer",
            Box::new(|w| {
                well_formed(w, &[(2, d.clone())]);
                w.tensor_f32("direction.01", &[64], &d);
            }),
            P::UnexpectedTensor { name: "direction.01".into() },
        ),
        ("layer_zero", Box::new(|w| well_formed(w, &[(0, d.clone())])), P::LayerZero),
        (
            "f16",
            Box::new(|w| {
                arch(w, "controlvector");
                w.meta("controlvector.layer_count", MetaValue::I32(1));
                let bytes = d.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
                w.tensor_bytes("direction.1", &[64], GgmlType::F16, bytes);
            }),
            P::NotF32 { layer: 1, found: "F16".into() },
        ),
        (
            "two_dims",
            Box::new(|w| {
                arch(w, "controlvector");
                w.meta("controlvector.layer_count", MetaValue::I32(1));
                w.tensor_f32("direction.1", &[32, 2], &d);
            }),
            P::NotOneDimensional { layer: 1, dims: vec![32, 2] },
        ),
        (
            "inconsistent_length",
            Box::new(|w| well_formed(w, &[(1, d.clone()), (2, vec![0.5; 32])])),
            P::InconsistentLength { layer: 2, found: 32, expected: 64 },
        ),
        (
            "not_finite",
            Box::new(|w| {
                let mut bad = d.clone();
                bad[7] = f32::NAN;
                well_formed(w, &[(1, bad)]);
            }),
            P::NotFinite { layer: 1 },
        ),
    ];
    for (name, build, want) in cases {
        let path = control_vector_file(name, build);
        assert_eq!(control_vector_problem(&path), want, "{name}");
    }

    // Truncated inside the tensor data and inside the header; not GGUF.
    let good = control_vector_file("good", |w| well_formed(w, &[(1, d.clone()), (2, d.clone())]));
    ControlVector::load(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    for (name, len) in [("truncated_data", bytes.len() - 10), ("truncated_header", 40), ("empty", 0)] {
        let path = good.with_file_name(format!("{name}.gguf"));
        std::fs::write(&path, &bytes[..len]).unwrap();
        match ControlVector::load(&path) {
            Err(Error::Gguf { path: p, message }) => {
                assert_eq!(p, path);
                assert!(message.contains("truncated") || message.contains("bad magic"), "{name}: {message}");
            }
            other => panic!("{name}: expected a GGUF error, got {other:?}"),
        }
    }
    let not_gguf = fixture_dir("llama_untied").join("config.json");
    assert!(matches!(ControlVector::load(&not_gguf), Err(Error::Gguf { .. })));
    let missing = good.with_file_name("missing.gguf");
    assert!(matches!(ControlVector::load(&missing), Err(Error::Io { .. })));
}

#[test]
fn control_vector_that_does_not_fit_the_model() {
    use ControlVectorProblem as P;
    let model = Model::load(fixture_dir("llama_untied"), &gpu()).unwrap();
    let (layers, hidden) = (model.config.layers, model.config.hidden);
    let vector = |name: &str, directions: &[(usize, Vec<f32>)]| {
        let path = control_vector_file(name, |w| well_formed(w, directions));
        ControlVector::load(path).unwrap()
    };
    let problem = |v: &ControlVector| match Steering::new(&model.config, &[(v.clone(), 1.0)], None) {
        Err(Error::ControlVector { path, problem }) => {
            assert_eq!(path, v.path);
            problem
        }
        other => panic!("expected a control vector error, got {other:?}"),
    };
    let beyond = vector("beyond", &[(1, vec![0.1; hidden]), (layers, vec![0.1; hidden])]);
    assert_eq!(problem(&beyond), P::LayerOutOfRange { layer: layers, layers });
    let short = vector("short", &[(1, vec![0.1; hidden - 4])]);
    assert_eq!(problem(&short), P::WrongLength { layer: 1, found: hidden - 4, expected: hidden });

    let fits = vector("fits", &[(1, vec![0.1; hidden])]);
    let (start, end) = (1, 0);
    let err = Steering::new(&model.config, &[(fits.clone(), 1.0)], Some(start..=end)).unwrap_err();
    assert!(matches!(err, Error::InvalidLayerRange { start: 1, end: 0, .. }), "{err}");
    // A range that starts past the last layer would steer nothing.
    let err = Steering::new(&model.config, &[(fits, 1.0)], Some(layers..=layers + 4)).unwrap_err();
    assert!(
        matches!(err, Error::InvalidLayerRange { .. }) && err.to_string().contains("has layers"),
        "{err}"
    );

    // Steering made for another model.
    let other = wgspark::ModelConfig::load(&fixture_dir("mistral_window")).unwrap();
    let foreign = vector("foreign", &[(1, vec![0.1; other.hidden])]);
    let steering = Steering::new(&other, &[(foreign, 1.0)], None).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let err = session.set_steering(Some(&steering)).unwrap_err();
    assert!(matches!(err, Error::SteeringMismatch { steering_layers: 3, layers: 2, .. }), "{err}");

    let options = CaptureOptions { layers: Some(vec![0, layers]), ..Default::default() };
    let err = session.set_capture(Some(&options)).unwrap_err();
    assert!(
        matches!(err, Error::CaptureLayerOutOfRange { layer, layers: l } if layer == layers && l == layers)
    );
}

/// A chat template that fails (here by its own `raise_exception`, as
/// transformers' templates reject unsupported roles) is a typed error naming
/// the file and the template's message; a malformed tokenizer_config.json
/// is a JSON error.
#[test]
fn chat_template_errors_name_the_file() {
    let dir = temp_dir("chat_template");
    let template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}\
                    {% endif %}{{ m.content }}{% endfor %}";
    let config = serde_json::json!({"chat_template": template, "eos_token": {"content": "</s>"}});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = wgspark::chat::ChatTemplate::from_folder(&dir).unwrap().expect("a template");
    assert_eq!(t.eos_token, "</s>");
    use wgspark::chat::Message;
    assert_eq!(t.render(&[Message::new("user", "hi")], true).unwrap(), "hi");
    match t.render(&[Message::new("tool", "x")], true) {
        Err(Error::ChatTemplate { origin, message }) => {
            assert!(
                origin.contains("tokenizer_config.json") && message.contains("no tools"),
                "{origin}: {message}"
            );
        }
        other => panic!("{other:?}"),
    }
    std::fs::write(dir.join("tokenizer_config.json"), "{\"chat_template\": ").unwrap();
    let err = wgspark::chat::ChatTemplate::from_folder(&dir).unwrap_err();
    assert!(matches!(err, Error::Json { .. }), "{err}");
}

/// Cooperative matrices: an unknown mode is refused, and asking for them
/// on an adapter that lacks them (or forcing the cooperative GEMM on a
/// device opened without them) names the adapter.
#[test]
fn cooperative_matrices_where_there_are_none() {
    use wgspark::kernels::gemm::{Gemm, GemmKernel};
    use wgspark::{CooperativeMatrix, GpuOptions};
    let err = "sometimes".parse::<CooperativeMatrix>().unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }) && err.to_string().contains("sometimes"), "{err}");
    for backend in common::backends() {
        let plain = Gpu::new(&GpuOptions {
            backend,
            cooperative_matrix: CooperativeMatrix::Off,
            ..Default::default()
        })
        .unwrap();
        assert!(!plain.caps.cooperative_matrix);
        let err = Gemm::with_kernel(&plain, GemmKernel::Cooperative { split: true, tile: None }).unwrap_err();
        assert!(err.to_string().contains(&plain.info.name), "{err}");
        match Gpu::new(&GpuOptions {
            backend,
            cooperative_matrix: CooperativeMatrix::On,
            ..Default::default()
        }) {
            Ok(gpu) => assert!(gpu.caps.cooperative_matrix, "{} opened without them", gpu.describe()),
            Err(err) => {
                assert!(matches!(err, Error::Unsupported { .. }), "{err}");
                assert!(err.to_string().contains(&plain.info.name), "{err}");
            }
        }
    }
}

/// A tokenizer.json that asks for unbounded work is refused when it is
/// loaded, naming what it asks for; a pattern its regex engine rejects is
/// an error, not a panic.
#[test]
fn hostile_tokenizers_are_refused() {
    use serde_json::json;
    use wgspark::tokenizer;
    let base = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"}
    });
    let load = |doc: &serde_json::Value| {
        let dir = temp_dir("tokenizer");
        std::fs::write(dir.join("tokenizer.json"), doc.to_string()).unwrap();
        tokenizer::from_folder(&dir)
    };
    let tok = load(&base).unwrap().unwrap();
    assert_eq!(tok.encode("a").unwrap(), [0]);

    let replace = json!({"type": "Replace", "pattern": {"String": "a"}, "content": "aa"});
    let padding = json!({"strategy": {"Fixed": 4_000_000_000u64}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "a"});
    let split = |pattern: String| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let cases = [
        ("padding", json!({"padding": padding}), "padding.strategy.Fixed"),
        (
            "chained replacements",
            json!({"normalizer": {"type": "Sequence", "normalizers": vec![replace; 10]}}),
            "1024 times longer",
        ),
        (
            "a huge pattern",
            json!({"pre_tokenizer": split("a".repeat(100_000))}),
            "100000 byte regular expression",
        ),
        (
            "a huge added token",
            json!({"added_tokens": [{"id": 3, "content": "x".repeat(65_536), "special": true}]}),
            "65536 bytes",
        ),
        ("a malformed pattern", json!({"pre_tokenizer": split("(a".into())}), ""),
    ];
    for (what, edit, named) in cases {
        let mut doc = base.clone();
        for (k, v) in edit.as_object().unwrap() {
            doc[k] = v.clone();
        }
        match load(&doc) {
            Err(Error::Tokenizer { message, .. }) => assert!(message.contains(named), "{what}: {message}"),
            Err(other) => panic!("{what}: {other}"),
            Ok(_) => panic!("{what}: loaded"),
        }
    }

    // Padding and truncation within bounds are not applied to a prompt (as
    // transformers encodes by default): no pad tokens fed as text, no cut.
    let mut doc = base.clone();
    doc["padding"] = json!({"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
        "pad_id": 1, "pad_type_id": 0, "pad_token": "b"});
    doc["truncation"] =
        json!({"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0});
    doc["pre_tokenizer"] = json!({"type": "Whitespace"});
    let tok = load(&doc).unwrap().unwrap();
    assert_eq!(tok.encode("a a a").unwrap(), [0, 0, 0]);

    // Larger than any tokenizer: refused before it is read (a sparse file).
    let dir = temp_dir("tokenizer");
    let file = std::fs::File::create(dir.join("tokenizer.json")).unwrap();
    file.set_len(tokenizer::MAX_FILE_BYTES + 1).unwrap();
    let err = tokenizer::from_folder(&dir).unwrap_err();
    assert!(err.to_string().contains("bytes, more than the"), "{err}");
}

/// JSON side files far larger than any model ships are refused before
/// they are read (sparse files).
#[test]
fn json_files_beyond_their_size() {
    let dir = edited_fixture("llama_untied", |_, _| {});
    let config = std::fs::OpenOptions::new().write(true).open(dir.join("config.json")).unwrap();
    config.set_len(wgspark::error::MAX_JSON_BYTES + 1).unwrap();
    let err = load_err(&dir);
    assert!(
        err.to_string().contains("config.json") && err.to_string().contains("bytes, more than the"),
        "{err}"
    );
}

/// A copy of the GGUF fixture `case`, each tensor passed through `tensor`
/// (None keeps it), then `extra` tensors added.
fn edited_gguf(
    case: &str,
    tensor: impl Fn(&str) -> Option<(Vec<usize>, GgmlType, Vec<u8>)>,
    extra: &[(&str, Vec<usize>, GgmlType, Vec<u8>)],
) -> Scratch {
    gguf_with(case, tensor, extra, &[])
}

/// [`edited_gguf`] with the metadata keys of `meta` set (added, or
/// replacing the fixture's).
fn gguf_with(
    case: &str,
    tensor: impl Fn(&str) -> Option<(Vec<usize>, GgmlType, Vec<u8>)>,
    extra: &[(&str, Vec<usize>, GgmlType, Vec<u8>)],
    meta: &[(&str, MetaValue)],
) -> Scratch {
    use wgspark::gguf::{Gguf, Meta};
    let source = Gguf::open(fixture_dir(case).join("model.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in source.metadata.iter().filter(|(k, _)| !meta.iter().any(|(m, _)| m == k)) {
        w.meta(
            key,
            match value {
                Meta::Int(v) => MetaValue::U32(*v as u32),
                Meta::Float(v) => MetaValue::F32(*v as f32),
                Meta::Bool(v) => MetaValue::Bool(*v),
                Meta::Str(v) => MetaValue::Str(v.clone()),
                Meta::Array(_) => panic!("the fixture has no array metadata"),
            },
        );
    }
    for (key, value) in meta {
        w.meta(key, value.clone());
    }
    for t in &source.tensors {
        let (dims, ty, bytes) = tensor(&t.name).unwrap_or((t.dims.clone(), t.ty, source.data(t).to_vec()));
        w.tensor_bytes(&t.name, &dims, ty, bytes);
    }
    for (name, dims, ty, bytes) in extra {
        w.tensor_bytes(name, dims, *ty, bytes.clone());
    }
    let path = temp_dir(case).file("model.gguf");
    w.write(&path).unwrap();
    path
}

/// A GGUF tensor of no dimensions is a scalar (llama.cpp reads it as one
/// value): a model carrying one loads, and a token embedding that is not a
/// matrix, scalar or vector, is named. (Found by `fuzz/`'s gguf_model
/// target: both were index panics.)
#[test]
fn gguf_tensors_of_no_dimensions() {
    let embedding = |dims: Vec<usize>| {
        let bytes = vec![0u8; 4 * dims.iter().product::<usize>()];
        edited_gguf(
            "gguf_llama_q8_0_tied",
            |name| (name == "token_embd.weight").then(|| (dims.clone(), GgmlType::F32, bytes.clone())),
            &[],
        )
    };
    for dims in [vec![], vec![256]] {
        let err = load_err(&embedding(dims.clone()));
        assert!(
            matches!(&err, Error::Gguf { message, .. }
                if message.contains(&format!("token_embd.weight has dims {dims:?}, expected 2"))),
            "{err}"
        );
    }

    let scalar =
        edited_gguf("gguf_llama_q8_0_tied", |_| None, &[("scale", vec![], GgmlType::F32, vec![0; 4])]);
    let checkpoint = wgspark::model::gguf_checkpoint::GgufCheckpoint::open(&scalar).unwrap();
    let whole = wgspark::model::gguf_checkpoint::GgufCheckpoint::open(
        &fixture_dir("gguf_llama_q8_0_tied").join("model.gguf"),
    )
    .unwrap();
    assert_eq!(checkpoint.gpu_bytes(), whole.gpu_bytes() + 4, "the scalar counts as one f32");
    Model::load(&scalar, &gpu()).expect("a model with a scalar tensor loads");
}

/// A device that is lost mid-session (destroyed here, as a driver reset or
/// a removed GPU leaves it) makes the next step a typed error, neither a
/// panic nor a hang, in every mode of running; a new device, model and
/// session work afterwards.
#[test]
fn a_lost_device_is_an_error_and_a_new_one_works() {
    for backend in common::backends() {
        lose_a_device_and_open_another(backend);
    }
}

fn lose_a_device_and_open_another(backend: Backend) {
    let open = || Gpu::new(&wgspark::GpuOptions { backend, ..Default::default() }).unwrap();
    let prompt = [1, 5, 9, 17];
    let gpu = open();
    let model = Model::load(fixture_dir("llama_untied"), &gpu).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    let before = session.prefill(&prompt).unwrap();
    gpu.device.destroy();
    let lost = |e: &Error| matches!(e, Error::DeviceLost { .. });
    let err = session.step(3, prompt.len()).unwrap_err();
    assert!(lost(&err), "step: {err}");
    let err = session.prefill(&[2, 4]).unwrap_err();
    assert!(lost(&err), "prefill: {err}");
    let options = GenerateOptions { max_tokens: 4, ..GenerateOptions::default() };
    match session.generate(&[2, 4], &options) {
        Err(err) => assert!(lost(&err), "generate: {err}"),
        Ok(mut generation) => {
            let err = generation.find_map(|id| id.err()).expect("a lost device yields an error");
            assert!(lost(&err), "generate: {err}");
        }
    }
    let err = model.session(&SessionOptions::default()).err().expect("no session on a lost device");
    assert!(lost(&err), "session: {err}");

    let gpu = open();
    let model = Model::load(fixture_dir("llama_untied"), &gpu).unwrap();
    let mut session = model.session(&SessionOptions::default()).unwrap();
    assert_eq!(session.prefill(&prompt).unwrap(), before);
}

/// A session refused for memory (a KV cache beyond the device) leaves the
/// model as it was: the next session runs and computes what it would have.
#[test]
fn a_session_refused_for_memory_leaves_the_model_usable() {
    let gpu = Gpu::new(&wgspark::GpuOptions {
        backend: common::backends()[0],
        memory_budget: Some(4 << 20),
        ..Default::default()
    })
    .unwrap();
    let model = Model::load(fixture_dir("llama_untied"), &gpu).unwrap();
    let prompt = [1, 5, 9, 17];
    let before = model.session(&SessionOptions::default()).unwrap().prefill(&prompt).unwrap();
    // 2 layers x K and V x 2 heads of 16 x 2 bytes: 256 bytes a position.
    let huge = SessionOptions { context_len: Some(100_000), ..Default::default() };
    let err = model.session(&huge).err().expect("a cache beyond the device");
    assert!(matches!(err, Error::OutOfDeviceMemory { .. }), "{err}");
    let after = model.session(&SessionOptions::default()).unwrap().prefill(&prompt).unwrap();
    assert_eq!(after, before);
}

/// Qwen3-VL-MoE's fused experts are read in either layout, `[E, 2I, H]` or
/// the hub's `[E, H, 2I]`: any other shape is named, and an FP8 tensor in
/// the hub's layout (its block scales would run across the wrong axis) is
/// refused.
#[test]
fn fused_experts_of_neither_layout_are_errors() {
    let (case, name) = ("qwen3_vl_moe", "model.language_model.layers.0.mlp.experts.gate_up_proj");
    let canonical = "model.layers.0.mlp.experts.gate_up_proj";
    let dir = edited_fixture(case, |_, t| {
        let (_, shape, data) = t.get_mut(name).unwrap();
        assert_eq!(shape, &vec![6, 64, 80], "the fixture is in the hub's layout");
        *shape = vec![6, 32, 160];
        data.truncate(6 * 32 * 160 * 2);
    });
    let err = load_err(&dir);
    assert!(
        matches!(&err, Error::WrongShape { name, found, .. } if name == canonical && found == &vec![6, 32, 160]),
        "{err}"
    );
    let dir = edited_fixture(case, |c, t| {
        c["quantization_config"] =
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
        let (dtype, shape, data) = t.get_mut(name).unwrap();
        *dtype = Dtype::F8_E4M3;
        *data = vec![0x38; shape.iter().product()];
        let scale = (Dtype::F32, vec![6, 1, 1], 1f32.to_le_bytes().repeat(6));
        t.insert(format!("{name}_scale_inv"), scale);
    });
    let err = load_err(&dir);
    assert!(
        matches!(err, Error::Unsupported { .. }) && err.to_string().contains("stored transposed"),
        "{err}"
    );
}

/// Config values the flow cannot honour are refused, not dropped: an
/// `eos_token_id` that is no token id (generation would run past the end
/// of a reply), an activation other than SwiGLU's, projection biases, a
/// rope factor without its type, head counts beyond any model.
#[test]
fn config_values_that_would_be_dropped_are_refused() {
    use serde_json::json;
    let cases: [(&str, serde_json::Value, &str); 10] = [
        ("eos_token_id", json!("2"), "eos_token_id"),
        ("eos_token_id", json!(2.5), "eos_token_id"),
        ("eos_token_id", json!(-1), "eos_token_id"),
        ("eos_token_id", json!(4_294_967_298u64), "eos_token_id"),
        ("eos_token_id", json!([2, "3"]), "eos_token_id"),
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("attention_bias", json!(true), "attention_bias"),
        ("mlp_bias", json!(true), "mlp_bias"),
        ("rope_scaling", json!({"factor": 2.0}), "rope_type"),
        ("num_attention_heads", json!(1u64 << 61), "num_attention_heads"),
    ];
    for (key, value, named) in cases {
        let dir = edited_fixture("llama_untied", |c, _| c[key] = value.clone());
        let err = load_err(&dir);
        assert!(
            matches!(err, Error::InvalidConfig { .. } | Error::Unsupported { .. }),
            "{key} = {value}: {err}"
        );
        assert!(err.to_string().contains(named), "{key} = {value}: {err}");
    }
    // Ids, lists of ids and null are what the key holds.
    for value in [json!(2), json!([2, 3]), serde_json::Value::Null] {
        let dir = edited_fixture("llama_untied", |c, _| c["eos_token_id"] = value.clone());
        let model = Model::load(&dir, &gpu()).unwrap();
        let expected: Vec<u32> = match &value {
            serde_json::Value::Null => vec![],
            serde_json::Value::Array(ids) => ids.iter().map(|v| v.as_u64().unwrap() as u32).collect(),
            v => vec![v.as_u64().unwrap() as u32],
        };
        assert_eq!(model.config.eos_token_ids, expected);
    }
}

/// GGUF metadata the loader cannot use is an error naming the key, not a
/// default in its place: a NaN or infinite rope base or epsilon, an
/// end-of-sequence id of the wrong type, a rope scaling it does not apply,
/// YaRN parameters it does not apply or without those it needs.
#[test]
fn gguf_metadata_that_would_be_replaced_by_defaults() {
    let cases = [
        ("llama.rope.freq_base", MetaValue::F32(f32::NAN)),
        ("llama.rope.freq_base", MetaValue::F32(f32::INFINITY)),
        ("llama.rope.freq_base", MetaValue::Str("10000".into())),
        ("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(f32::NAN)),
        ("tokenizer.ggml.eos_token_id", MetaValue::Str("2".into())),
        ("llama.attention.head_count_kv", MetaValue::Str("2".into())),
        ("llama.rope.scaling.type", MetaValue::Str("longrope".into())),
        ("llama.attention.value_length", MetaValue::U32(8)),
    ];
    for (key, value) in cases {
        let path = gguf_with("gguf_llama_q8_0_tied", |_| None, &[], &[(key, value.clone())]);
        let err = load_err(&path);
        assert!(err.to_string().contains(key), "{key} = {value:?}: {err}");
    }
    // YaRN's keys that would change the answer in ways not built, and its
    // required ones left out.
    let yarn = [
        ("llama.rope.scaling.type", MetaValue::Str("yarn".into())),
        ("llama.rope.scaling.factor", MetaValue::F32(4.0)),
        ("llama.rope.scaling.original_context_length", MetaValue::U32(32)),
    ];
    let refused = [
        ("llama.rope.scaling.yarn_ext_factor", MetaValue::F32(0.5)),
        ("llama.rope.scaling.yarn_log_multiplier", MetaValue::F32(0.1)),
        ("llama.rope.scaling.attn_factor", MetaValue::F32(1.5)),
    ];
    for (key, value) in refused {
        let path = gguf_with("gguf_llama_q8_0_tied", |_| None, &[], &[&yarn[..], &[(key, value)]].concat());
        let err = load_err(&path);
        assert!(err.to_string().contains(key), "{key}: {err}");
    }
    for missing in ["llama.rope.scaling.factor", "llama.rope.scaling.original_context_length"] {
        let meta: Vec<_> = yarn.iter().filter(|(k, _)| *k != missing).cloned().collect();
        let err = load_err(&gguf_with("gguf_llama_q8_0_tied", |_| None, &[], &meta));
        assert!(err.to_string().contains(missing), "{missing}: {err}");
    }
}
