//! Every specialisation of every kernel family (each flag set the flow
//! may build) parses and validates with naga, without optional
//! capabilities unless it uses subgroups, f16 (or cooperative matrices), and
//! every entry point translates to MSL, HLSL and SPIR-V (cooperative
//! matrices: MSL and SPIR-V, the backends that offer them): a shader that
//! would break Metal or DX12 fails here.

use naga::back::pipeline_constants::process_overrides;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use wgspark::kernels::gemm_coop::Tile;
use wgspark::kernels::{KERNEL_FAMILIES, builds, preprocess, shader_source};

/// Every build: `(label, source, capabilities it may use)`.
fn sources() -> Vec<(String, String, Capabilities)> {
    builds()
        .into_iter()
        .map(|b| {
            let mut caps = Capabilities::empty();
            caps.set(Capabilities::SUBGROUP, b.uses_subgroups());
            caps.set(Capabilities::SHADER_FLOAT16_IN_FLOAT32, b.uses_f16_in_f32());
            caps.set(Capabilities::SHADER_FLOAT16, b.uses_f16());
            if b.uses_cooperative_matrix() {
                caps |= Capabilities::COOPERATIVE_MATRIX
                    | Capabilities::SHADER_FLOAT16
                    | Capabilities::SHADER_FLOAT16_IN_FLOAT32
                    | Capabilities::SUBGROUP
                    | Capabilities::SUBGROUP_BARRIER;
            }
            (format!("{}{:?}", b.family, b.flags), shader_source(b.family, &b.flags).unwrap(), caps)
        })
        .collect()
}

#[test]
fn every_kernel_translates_to_msl_hlsl_and_spirv() {
    assert!(KERNEL_FAMILIES.len() >= 10);
    let sources = sources();
    assert!(sources.len() > 40, "every flag set of gemv, attention, residual and sample is built");
    for (name, source, caps) in sources {
        let module = naga::front::wgsl::parse_str(&source)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&source)));
        let info = Validator::new(ValidationFlags::all(), caps).validate(&module).unwrap_or_else(|e| {
            panic!("{name} does not validate with {caps:?}: {}", e.emit_to_string(&source))
        });
        for ep in &module.entry_points {
            let label = format!("{name}:{}", ep.name);
            // Override constants at their defaults (the attention's head
            // shape, which has none, at Llama-3's), one entry point, as each
            // backend receives it after pipeline creation.
            let heads: naga::back::PipelineConstants = if name.starts_with("attention") {
                [("HEAD_DIM".to_string(), 128.0), ("GROUP".to_string(), 4.0)].into()
            } else {
                Default::default()
            };
            let (m, i) =
                process_overrides(&module, &info, Some((naga::ShaderStage::Compute, &ep.name)), &heads)
                    .unwrap_or_else(|e| panic!("{label}: overrides: {e}"));

            let msl_options = naga::back::msl::Options { lang_version: (2, 4), ..Default::default() };
            naga::back::msl::write_string(&m, &i, &msl_options, &Default::default())
                .unwrap_or_else(|e| panic!("{label} -> MSL: {e}"));

            if !caps.contains(Capabilities::COOPERATIVE_MATRIX) {
                let mut hlsl = String::new();
                let hlsl_options = naga::back::hlsl::Options {
                    shader_model: naga::back::hlsl::ShaderModel::V6_0,
                    ..Default::default()
                };
                let hlsl_pipeline = naga::back::hlsl::PipelineOptions::default();
                naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
                    .write(&m, &i, None)
                    .unwrap_or_else(|e| panic!("{label} -> HLSL: {e}"));
                assert!(!hlsl.is_empty());
            }

            let spv = naga::back::spv::write_vec(&m, &i, &Default::default(), None)
                .unwrap_or_else(|e| panic!("{label} -> SPIR-V: {e}"));
            assert!(!spv.is_empty());
        }
    }
}

/// On Vulkan the cooperative-matrix builds go to the driver as SPIR-V that
/// the engine fixes up (`kernels::vulkan_memory_model`): every build, in
/// every tile shape, goes through that translation.
#[test]
fn cooperative_builds_translate_to_spirv_under_the_vulkan_memory_model() {
    let coop: Vec<_> = builds().into_iter().filter(|b| b.uses_cooperative_matrix()).collect();
    assert!(coop.len() >= 2 * 13 + 2, "every weight format, with and without splits; attention");
    for b in coop {
        let source = shader_source(b.family, &b.flags).unwrap();
        // Each entry point with every value of its shape constants.
        let (entry, shapes): (_, Vec<Vec<(&str, f64)>>) = match b.family {
            "gemm_coop" => {
                let tiles = Tile::ALL.into_iter().filter(|t| t.fits(&b.flags));
                ("main", tiles.map(|t| t.constants(&b.flags).to_vec()).collect())
            }
            _ => (
                "attend_coop",
                vec![vec![("HEAD_DIM", 64.0), ("GROUP", 8.0)], vec![("HEAD_DIM", 128.0), ("GROUP", 4.0)]],
            ),
        };
        for constants in shapes {
            let (words, _) = wgspark::kernels::vulkan_memory_model::spirv(&source, entry, &constants)
                .unwrap_or_else(|e| panic!("{}{:?} {constants:?}: {e}", b.family, b.flags));
            assert_eq!(words[0], 0x0723_0203, "SPIR-V magic");
        }
    }
}

#[test]
fn every_wgsl_file_is_a_registered_kernel() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("wgsl");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let stem = file.trim_end_matches(".wgsl");
        // common.wgsl, weights.wgsl and workgroup_sum.wgsl are prepended to the families.
        let registered = ["common", "weights", "workgroup_sum"].contains(&stem)
            || KERNEL_FAMILIES.iter().any(|f| f.name == stem);
        assert!(registered, "{} is not listed in kernels::KERNEL_FAMILIES", path.display());
    }
}

#[test]
fn preprocessing_keeps_the_sections_whose_flags_are_set() {
    let source = "a\n#if X\nb\n#if !Y\nc\n#else\nd\n#endif\n#else\ne\n#endif\nf\n";
    let kept = |flags: &[&str]| -> Vec<String> {
        preprocess(source, flags).lines().filter(|l| !l.is_empty()).map(String::from).collect()
    };
    assert_eq!(kept(&[]), ["a", "e", "f"]);
    assert_eq!(kept(&["X"]), ["a", "b", "c", "f"]);
    assert_eq!(kept(&["X", "Y"]), ["a", "b", "d", "f"]);
    assert_eq!(kept(&["Y"]), ["a", "e", "f"]);
    // Dropped lines stay as empty lines, so naga's line numbers are the file's.
    assert_eq!(preprocess(source, &[]).lines().count(), source.lines().count());
}

#[test]
fn parameter_structs_are_declared_from_their_rust_definition() {
    use wgspark::kernels::WgslStruct;
    use wgspark::kernels::gemv::GemvParams;
    assert!(GemvParams::WGSL.starts_with("struct GemvParams {"));
    assert_eq!(GemvParams::WGSL.matches(": u32").count() + GemvParams::WGSL.matches(": f32").count(), 9);
    assert_eq!(std::mem::size_of::<GemvParams>(), 9 * 4);
    // No shader declares a uniform's struct of its own (shader-internal
    // structs are theirs).
    for f in KERNEL_FAMILIES {
        for line in f.source.lines() {
            let line = line.trim_start();
            let uniform_struct =
                line.starts_with("struct ") && (line.contains("Params") || line.starts_with("struct Step"));
            assert!(!uniform_struct, "{}.wgsl declares {line:?}", f.name);
        }
        for line in f.source.lines().filter(|l| l.contains("var<uniform>")) {
            let ty = line.rsplit(':').next().unwrap().trim().trim_end_matches(';');
            assert!(
                (f.structs)().iter().any(|s| s.starts_with(&format!("struct {ty} "))) || ty == "Step",
                "{}.wgsl binds a uniform of type {ty} that its Rust wrapper does not declare",
                f.name
            );
        }
    }
}
