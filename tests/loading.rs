//! Checkpoints as they ship: sharded, f32 or f16, multimodal tensor names,
//! and tensors split across storage bindings all give the fixture's logits.

mod common;

use common::checkpoint::{
    Tensors, bf16_to_f16_bytes, bf16_to_f32_bytes, edited_fixture, fixture_dir, write_tensors,
};
use common::fixtures::{expected, replay};
use common::max_abs_diff;
use safetensors::Dtype;
use wgspark::{Gpu, GpuOptions, Model};

const CASE: &str = "llama_untied";

fn reference_rows(gpu: &Gpu) -> Vec<Vec<f32>> {
    let model = Model::load(fixture_dir(CASE), gpu).unwrap();
    replay(&model, &expected(&fixture_dir(CASE))).unwrap()
}

/// Bit-identical logits, reported by their largest difference.
fn assert_same_rows(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len());
    for (row, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w, "{what}: row {row} differs by up to {}", max_abs_diff(g, w));
    }
}

fn rows_of(gpu: &Gpu, dir: &std::path::Path) -> Vec<Vec<f32>> {
    let model = Model::load(dir, gpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    replay(&model, &expected(&fixture_dir(CASE))).unwrap()
}

#[test]
fn sharded_checkpoint_loads_identically() {
    let src = fixture_dir(CASE);
    let dir = edited_fixture(CASE, |_, _| {});
    let tensors = common::checkpoint::read_tensors(&src.join("model.safetensors"));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut shards: [Tensors; 3] = Default::default();
    let mut weight_map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let shard = i % 3;
        weight_map.insert(name.clone(), format!("model-0000{}-of-00003.safetensors", shard + 1).into());
        shards[shard].insert(name, t);
    }
    for (i, shard) in shards.iter().enumerate() {
        write_tensors(&dir.join(format!("model-0000{}-of-00003.safetensors", i + 1)), shard);
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    common::on_each_backend(|gpu| assert_same_rows(&rows_of(gpu, &dir), &reference_rows(gpu), CASE));
}

/// f32 and f16 weights stay in their own format on the GPU (twice and as
/// many bytes as bf16) and, holding the bf16 fixture's values, give its
/// logits up to the order of the GEMV's sums.
#[test]
fn f32_and_f16_checkpoints_keep_their_format() {
    let to = |dtype: Dtype, convert: fn(&[u8]) -> Vec<u8>| {
        edited_fixture(CASE, move |c, t| {
            c["torch_dtype"] = if dtype == Dtype::F32 { "float32" } else { "float16" }.into();
            for (d, _, data) in t.values_mut() {
                *d = dtype;
                *data = convert(data);
            }
        })
    };
    let f32_dir = to(Dtype::F32, bf16_to_f32_bytes);
    let f16_dir = to(Dtype::F16, bf16_to_f16_bytes);
    common::on_each_backend(|gpu| {
        let bf16 = Model::load(fixture_dir(CASE), gpu).unwrap();
        let want = replay(&bf16, &expected(&fixture_dir(CASE))).unwrap();
        for (dir, bytes, bound) in [(&f32_dir, 2, 1e-4), (&f16_dir, 1, 1e-3)] {
            let model = Model::load(dir, gpu).unwrap();
            // Norms are f32 in every case; matrices hold the dtype's width.
            assert!(model.weight_bytes() > bf16.weight_bytes() * bytes * 9 / 10, "{}", dir.display());
            let got = replay(&model, &expected(&fixture_dir(CASE))).unwrap();
            // f16 keeps bf16's mantissa but not its smallest exponents.
            for (row, (g, w)) in got.iter().zip(&want).enumerate() {
                let err = max_abs_diff(g, w);
                assert!(err < bound, "{}: row {row} differs by {err}", dir.display());
            }
        }
    });
}

#[test]
fn multimodal_prefixed_names_map_to_the_text_model() {
    let dir = edited_fixture(CASE, |_, t| {
        let renamed: Tensors = std::mem::take(t)
            .into_iter()
            .map(|(name, v)| {
                let name = match name.strip_prefix("model.") {
                    Some(rest) => format!("language_model.model.{rest}"),
                    None => format!("language_model.{name}"),
                };
                (name, v)
            })
            .collect();
        *t = renamed;
    });
    common::on_each_backend(|gpu| assert_same_rows(&rows_of(gpu, &dir), &reference_rows(gpu), CASE));
}

#[test]
fn tensors_split_across_bindings_give_the_same_logits() {
    let e = expected(&fixture_dir(CASE));
    for backend in common::backends() {
        // 16 KiB bindings (what the 128-position KV cache needs): the 250 x 64
        // embedding and head, and the stacked gate/up projection, split in 2.
        let gpu = Gpu::new(&GpuOptions { backend, max_storage_binding: Some(16384), ..Default::default() })
            .unwrap();
        let model = Model::load(fixture_dir(CASE), &gpu).unwrap();
        let embed = model.weights().embed.as_ref().expect("one device holds the embedding");
        assert_eq!(embed.parts.len(), 2);
        let wgspark::model::layers::FfnWeights::Dense { gate_up, .. } = &model.weights().layers[0].ffn else {
            panic!("llama layers are dense");
        };
        assert_eq!(gate_up.parts.len(), 2);
        let rows = replay(&model, &e).unwrap();
        for (got, want) in rows.iter().zip(&e.logits) {
            let err = max_abs_diff(got, want);
            assert!(err <= 1e-3, "split tensors: {err}");
        }
    }
}
