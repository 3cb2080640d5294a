//! config.json parsing: both layouts mean the same model, and RoPE scaling
//! is computed as transformers computes it.

use std::path::Path;

use wgspark::ModelConfig;
use wgspark::model::RopeScaling;

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
