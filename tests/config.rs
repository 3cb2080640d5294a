//! config.json parsing: both layouts mean the same model, and RoPE scaling
//! is computed as transformers computes it.

use std::path::Path;

use wgspark::ModelConfig;
use wgspark::model::{RopeScaling, Yarn};

fn parse(json: &str) -> ModelConfig {
    ModelConfig::parse(json, Path::new("config.json")).unwrap()
}

const BASE: &str = r#""model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 100, "rms_norm_eps": 1e-5, "unknown_key": {"ignored": true}"#;

#[test]
fn hub_and_transformers_5_layouts_agree() {
    let hub = parse(&format!(
        r#"{{ {BASE}, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
            "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}} }}"#
    ));
    let v5 = parse(&format!(
        r#"{{ {BASE}, "dtype": "bfloat16",
            "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}} }}"#
    ));
    assert_eq!(hub.rope, v5.rope);
    assert_eq!(hub.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(v5.dtype.as_deref(), Some("bfloat16"));
    assert!(matches!(hub.rope.scaling, RopeScaling::Llama3 { .. }));
    assert_eq!(hub.rope.theta, 500000.0);
}

#[test]
fn defaults_and_derived_values() {
    let c = parse(&format!("{{ {BASE} }}"));
    assert_eq!(c.heads.dim, 16, "head_dim defaults to hidden / heads");
    assert_eq!(c.rope.rotary_dim, 16);
    assert_eq!(c.rope.theta, 10000.0);
    assert!(!c.tie_embeddings);
    let c = parse(&format!(r#"{{ {BASE}, "head_dim": 24, "eos_token_id": [2, 7] }}"#));
    assert_eq!(c.heads.dim, 24);
    assert_eq!(c.eos_token_ids, vec![2, 7]);
}

#[test]
fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
    let c = parse(&format!(
        r#"{{ {BASE}, "rope_scaling": {{"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}} }}"#
    ));
    let plain = parse(&format!("{{ {BASE} }}")).rope.inv_freq();
    let scaled = c.rope.inv_freq();
    let wavelen = |f: f32| 2.0 * std::f32::consts::PI / f;
    for (p, s) in plain.iter().zip(&scaled) {
        if wavelen(*p) < 64.0 / 4.0 {
            assert_eq!(p, s, "high frequencies are kept");
        } else if wavelen(*p) > 64.0 {
            assert!((s - p / 8.0).abs() <= 1e-7 * p, "low frequencies are divided by the factor");
        } else {
            assert!(*s < *p && *s > p / 8.0, "the middle band is interpolated");
        }
    }
}

/// YaRN's parameters are completed as transformers completes them: the
/// pretraining context from the config's own key, else the rope
/// parameters', else max_position_embeddings; the factor from the two
/// lengths where it is missing; betas 32 / 1 and a truncated ramp; the
/// attention factor 0.1 ln(factor) + 1, or the ratio of mscale's and
/// mscale_all_dim's, or as given. High frequencies are kept, low ones divided
/// by the factor.
#[test]
fn yarn_parameters_are_completed_as_transformers_does() {
    let yarn = |rope: &str, extra: &str| {
        let c = parse(&format!(
            r#"{{ {BASE}, "max_position_embeddings": 256, {extra} "rope_scaling": {{"rope_type": "yarn", {rope}}} }}"#
        ));
        match c.rope.scaling {
            RopeScaling::Yarn(Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            }) => {
                (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, attention_factor)
            }
            other => panic!("{other:?}"),
        }
    };
    let mscale = |factor: f64, m: f64| 0.1 * m * factor.ln() + 1.0;
    let given = yarn(r#""factor": 4.0, "original_max_position_embeddings": 32"#, "");
    assert_eq!(given, (4.0, 32, 32.0, 1.0, true, mscale(4.0, 1.0)));
    assert_eq!(yarn(r#""factor": 4.0"#, "").1, 256, "max_position_embeddings");
    assert_eq!(
        yarn(
            r#""factor": 4.0, "original_max_position_embeddings": 32"#,
            r#""original_max_position_embeddings": 64,"#
        )
        .1,
        64
    );
    assert_eq!(yarn(r#""factor": null, "original_max_position_embeddings": 32"#, "").0, 8.0, "256 / 32");
    let betas = yarn(r#""factor": 4.0, "beta_fast": 0, "beta_slow": 3.0, "truncate": false"#, "");
    assert_eq!((betas.2, betas.3, betas.4), (32.0, 3.0, false));
    let ratio = yarn(r#""factor": 4.0, "mscale": 2.0, "mscale_all_dim": 0.5"#, "").5;
    assert_eq!(ratio, mscale(4.0, 2.0) / mscale(4.0, 0.5));
    assert_eq!(
        yarn(r#""factor": 4.0, "attention_factor": 1.25, "mscale": 2.0, "mscale_all_dim": 1.0"#, "").5,
        1.25
    );

    let c = parse(&format!(
        r#"{{ {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}} }}"#
    ));
    let (plain, scaled) = (parse(&format!("{{ {BASE} }}")).rope.inv_freq(), c.rope.inv_freq());
    assert_eq!(plain[0], scaled[0], "the highest frequency is kept");
    let last = plain.len() - 1;
    assert!((scaled[last] - plain[last] / 4.0).abs() <= 1e-7 * plain[last], "the lowest is divided");
}

/// A multimodal config (Qwen3-VL) nests its language model in
/// `text_config`: its keys describe the text model, the top level's the
/// checkpoint (class, lm_head tying, dtype), as transformers reads them.
#[test]
fn a_multimodal_config_reads_its_text_model() {
    let text = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
        "rms_norm_eps": 1e-6, "model_type": "qwen3_vl_text", "tie_word_embeddings": true,
        "eos_token_id": 7, "rope_theta": 5000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": true}"#;
    let c = parse(&format!(
        r#"{{ "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "image_token_id": 96,
            "text_config": {{ {text} }}, "vision_config": {{"out_hidden_size": 64}} }}"#
    ));
    // The tower's absent fields take transformers' defaults.
    let v = c.vision.as_ref().expect("a vision tower");
    assert_eq!(
        (v.depth, v.hidden, v.heads, v.patch_size, v.merge_size, v.position_side),
        (27, 1152, 16, 16, 2, 48)
    );
    let wrong_width = format!(
        r#"{{ "model_type": "qwen3_vl", "text_config": {{ {text} }}, "vision_config": {{"out_hidden_size": 65}} }}"#
    );
    let err = ModelConfig::parse(&wrong_width, Path::new("config.json")).unwrap_err().to_string();
    assert!(err.contains("out_hidden_size 65"), "{err}");
    assert_eq!(c.family.name, "qwen3_vl");
    assert_eq!((c.hidden, c.layers, c.heads.dim, c.vocab), (64, 3, 16, 100));
    assert!(!c.tie_embeddings, "the top level's tying holds");
    assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(c.eos_token_ids, vec![7]);
    assert_eq!(c.rope.theta, 5000000.0);
    assert_eq!(c.rope.scaling, RopeScaling::None);
    // The text config's own tying when the top level says nothing.
    let tied = parse(&format!(r#"{{ "model_type": "qwen3_vl", "text_config": {{ {text} }} }}"#));
    assert!(tied.tie_embeddings);
    // M-RoPE's sections must split the rotary frequencies exactly.
    for bad in ["[2, 3, 2]", "[8]", "[18446744073709551615, 1, 0]"] {
        let text = text.replace("[2, 3, 3]", bad);
        let json = format!(r#"{{ "model_type": "qwen3_vl", "text_config": {{ {text} }} }}"#);
        let err = ModelConfig::parse(&json, Path::new("config.json")).unwrap_err().to_string();
        assert!(err.contains("mrope_section"), "{bad}: {err}");
    }
}

/// A folder's generation_config.json adds its end-of-sequence ids to
/// config.json's (Llama 3 Instruct names `<|eot_id|>` only there); a
/// malformed one is an error naming it.
#[test]
fn generation_config_adds_its_end_of_sequence_ids() {
    let scratch = tempfile::Builder::new().prefix("wgspark-test-generation-config-").tempdir().unwrap();
    let dir = scratch.path();
    std::fs::write(dir.join("config.json"), format!(r#"{{ {BASE}, "eos_token_id": 98 }}"#)).unwrap();
    assert_eq!(ModelConfig::load(dir).unwrap().eos_token_ids, [98]);
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [98, 99], "do_sample": true}"#)
        .unwrap();
    assert_eq!(ModelConfig::load(dir).unwrap().eos_token_ids, [98, 99]);
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": "99"}"#).unwrap();
    let err = ModelConfig::load(dir).unwrap_err().to_string();
    assert!(err.contains("generation_config.json") && err.contains("eos_token_id"), "{err}");
    std::fs::write(dir.join("generation_config.json"), "{").unwrap();
    assert!(ModelConfig::load(dir).unwrap_err().to_string().contains("generation_config.json"));
}
