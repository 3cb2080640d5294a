//! Every class of bad input gets its typed error, naming the problem;
//! nothing panics.

mod common;

use common::checkpoint::{edited_fixture, fixture_dir, temp_dir};
use safetensors::Dtype;
use wgspark::{Backend, Error, Gpu, Model, Sampler, Sampling, SessionOptions};

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
