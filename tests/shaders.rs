//! Every kernel family's WGSL parses and validates with naga without
//! optional capabilities (the portable baseline), and translates to MSL,
//! HLSL and SPIR-V: a shader that would break Metal or DX12 fails here.

use naga::back::pipeline_constants::process_overrides;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use wgspark::kernels::{SHADERS, shader_source};

fn baseline_module(name: &str) -> (naga::Module, naga::valid::ModuleInfo) {
    let source = shader_source(name).unwrap();
    let module = naga::front::wgsl::parse_str(&source)
        .unwrap_or_else(|e| panic!("{name}.wgsl: {}", e.emit_to_string(&source)));
    let info = Validator::new(ValidationFlags::all(), Capabilities::empty())
        .validate(&module)
        .unwrap_or_else(|e| {
            panic!(
                "{name}.wgsl does not validate without optional capabilities: {}",
                e.emit_to_string(&source)
            )
        });
    (module, info)
}

/// Each entry point's module with its override constants at their
/// defaults, as each backend receives it after pipeline creation.
fn specialised(name: &str) -> Vec<(String, naga::Module, naga::valid::ModuleInfo)> {
    let (module, info) = baseline_module(name);
    module
        .entry_points
        .iter()
        .map(|ep| {
            let (m, i) = process_overrides(
                &module,
                &info,
                Some((naga::ShaderStage::Compute, &ep.name)),
                &Default::default(),
            )
            .unwrap_or_else(|e| panic!("{name}.wgsl {}: overrides: {e}", ep.name));
            (
                format!("{name}.wgsl:{}", ep.name),
                m.into_owned(),
                i.into_owned(),
            )
        })
        .collect()
}

#[test]
fn every_kernel_translates_to_msl_hlsl_and_spirv() {
    assert!(SHADERS.len() >= 7);
    for (file, _) in SHADERS {
        for (name, module, info) in specialised(file) {
            let msl_options = naga::back::msl::Options {
                lang_version: (2, 1),
                ..Default::default()
            };
            naga::back::msl::write_string(&module, &info, &msl_options, &Default::default())
                .unwrap_or_else(|e| panic!("{name} -> MSL: {e}"));

            let mut hlsl = String::new();
            let hlsl_options = naga::back::hlsl::Options::default();
            let hlsl_pipeline = naga::back::hlsl::PipelineOptions::default();
            naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
                .write(&module, &info, None)
                .unwrap_or_else(|e| panic!("{name} -> HLSL: {e}"));

            let spv = naga::back::spv::write_vec(&module, &info, &Default::default(), None)
                .unwrap_or_else(|e| panic!("{name} -> SPIR-V: {e}"));
            assert!(!spv.is_empty() && !hlsl.is_empty());
        }
    }
}

#[test]
fn every_wgsl_file_is_a_registered_kernel() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("wgsl");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        if stem == "common" {
            continue;
        }
        assert!(
            SHADERS.iter().any(|(n, _)| *n == stem),
            "{} is not listed in kernels::SHADERS",
            path.display()
        );
    }
}
