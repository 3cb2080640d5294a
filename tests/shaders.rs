//! Every kernel family's WGSL (with each of its variants) parses and
//! validates with naga, the baseline without optional capabilities, and
//! every entry point translates to MSL, HLSL and SPIR-V: a shader that
//! would break Metal or DX12 fails here.

use naga::back::pipeline_constants::process_overrides;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use wgspark::kernels::{SHADERS, VARIANTS, shader_source};

/// Every (family, variant) build: `(label, source, capabilities it may use)`.
fn builds() -> Vec<(String, String, Capabilities)> {
    let mut out = Vec::new();
    for (family, _) in SHADERS {
        let variants: Vec<_> = VARIANTS.iter().filter(|v| v.family == *family).collect();
        if variants.is_empty() {
            out.push((family.to_string(), shader_source(family, None).unwrap(), Capabilities::empty()));
        }
        for v in variants {
            let caps = if v.subgroups { Capabilities::SUBGROUP } else { Capabilities::empty() };
            out.push((format!("{family}.{}", v.name), shader_source(family, Some(v.name)).unwrap(), caps));
        }
    }
    out
}

#[test]
fn every_kernel_translates_to_msl_hlsl_and_spirv() {
    assert!(SHADERS.len() >= 9);
    for (name, source, caps) in builds() {
        let module = naga::front::wgsl::parse_str(&source)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&source)));
        let info = Validator::new(ValidationFlags::all(), caps).validate(&module).unwrap_or_else(|e| {
            panic!("{name} does not validate with {caps:?}: {}", e.emit_to_string(&source))
        });
        for ep in &module.entry_points {
            let label = format!("{name}:{}", ep.name);
            // Override constants at their defaults, one entry point, as each
            // backend receives it after pipeline creation.
            let (m, i) = process_overrides(
                &module,
                &info,
                Some((naga::ShaderStage::Compute, &ep.name)),
                &Default::default(),
            )
            .unwrap_or_else(|e| panic!("{label}: overrides: {e}"));

            let msl_options = naga::back::msl::Options { lang_version: (2, 4), ..Default::default() };
            naga::back::msl::write_string(&m, &i, &msl_options, &Default::default())
                .unwrap_or_else(|e| panic!("{label} -> MSL: {e}"));

            let mut hlsl = String::new();
            let hlsl_options = naga::back::hlsl::Options {
                shader_model: naga::back::hlsl::ShaderModel::V6_0,
                ..Default::default()
            };
            let hlsl_pipeline = naga::back::hlsl::PipelineOptions::default();
            naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
                .write(&m, &i, None)
                .unwrap_or_else(|e| panic!("{label} -> HLSL: {e}"));

            let spv = naga::back::spv::write_vec(&m, &i, &Default::default(), None)
                .unwrap_or_else(|e| panic!("{label} -> SPIR-V: {e}"));
            assert!(!spv.is_empty() && !hlsl.is_empty());
        }
    }
}

#[test]
fn every_wgsl_file_is_a_registered_kernel_or_variant() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("wgsl");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let stem = file.trim_end_matches(".wgsl");
        let registered = stem == "common"
            || SHADERS.iter().any(|(n, _)| *n == stem)
            || VARIANTS.iter().any(|v| format!("{}.{}", v.family, v.name) == stem);
        assert!(registered, "{} is not listed in kernels::SHADERS or VARIANTS", path.display());
    }
}
