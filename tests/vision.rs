//! Image preprocessing against transformers' Qwen2-VL image processor (PIL
//! backend, what Qwen3-VL ships), fixtures from
//! `scripts/make_vision_fixtures.py`: the decoded RGB of each file, and the
//! pixel values of the patches, bit for bit.

mod common;

use std::path::{Path, PathBuf};

use wgspark::Error;
use wgspark::vision::{ImageProcessor, RgbImage};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vision")
}

struct Case {
    name: String,
    file: PathBuf,
    processor: ImageProcessor,
    /// What transformers decoded the file to.
    decoded: RgbImage,
    grid: [usize; 3],
    values: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    let cases = meta["cases"].as_object().unwrap();
    assert!(cases.len() >= 10, "the fixtures hold every kind of image");
    cases
        .iter()
        .map(|(name, c)| {
            let processor =
                ImageProcessor::parse(&c["processor"].to_string(), Path::new("preprocessor_config.json"))
                    .unwrap();
            let [height, width] = [0, 1].map(|i| c["decoded_size"][i].as_u64().unwrap() as usize);
            let pixels = std::fs::read(dir().join(format!("{name}.rgb"))).unwrap();
            assert_eq!(pixels.len(), width * height * 3);
            let values: Vec<f32> = std::fs::read(dir().join(format!("{name}.f32")))
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            Case {
                name: name.clone(),
                file: dir().join(c["file"].as_str().unwrap()),
                processor,
                decoded: RgbImage { width, height, pixels },
                grid: [0, 1, 2].map(|i| c["grid"][i].as_u64().unwrap() as usize),
                values,
            }
        })
        .collect()
}

#[test]
fn patches_equal_transformers_bit_for_bit() {
    for case in cases() {
        let patches = case.processor.patches(&case.decoded, &case.name).unwrap();
        assert_eq!(patches.grid, case.grid, "{}: grid", case.name);
        assert_eq!(patches.values.len(), case.values.len(), "{}: values", case.name);
        let differing =
            patches.values.iter().zip(&case.values).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differing, 0, "{}: {differing} of {} values differ", case.name, case.values.len());
        // From the file itself: the same bits for a PNG.
        if case.file.extension().is_some_and(|e| e == "png") {
            let image = RgbImage::open(&case.file).unwrap();
            assert!(
                case.processor.patches(&image, &case.name).unwrap().values == case.values,
                "{}",
                case.name
            );
        }
    }
}

/// PNGs decode to transformers' RGB exactly (gray widened, palettes
/// expanded, transparency composited onto white); JPEGs through another
/// decoder than Pillow's libjpeg, within a few levels.
#[test]
fn files_decode_to_transformers_rgb() {
    for case in cases() {
        let image = RgbImage::open(&case.file).unwrap();
        assert_eq!((image.width, image.height), (case.decoded.width, case.decoded.height), "{}", case.name);
        let worst = image.pixels.iter().zip(&case.decoded.pixels).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
        let jpeg = case.file.extension().is_some_and(|e| e == "jpg");
        println!("{:<22} largest difference from transformers' decoding: {worst}", case.name);
        assert!(
            worst <= if jpeg { JPEG_LEVELS } else { 0 },
            "{}: decoded pixels differ by {worst}",
            case.name
        );
    }
}

/// Largest difference between this engine's JPEG decoding and Pillow's
/// (libjpeg's): their inverse DCTs and chroma upsampling round apart.
const JPEG_LEVELS: u8 = 4;

/// The CRC-32 of PNG chunks.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn unreadable_images_are_typed_errors() {
    let tmp = common::checkpoint::temp_dir("vision");
    let png = std::fs::read(dir().join("rgb_odd.png")).unwrap();
    let jpeg = std::fs::read(dir().join("jpeg.jpg")).unwrap();
    // A PNG whose header claims 30 000 x 30 000 pixels (its CRC fixed).
    let mut bomb = png.clone();
    bomb[16..24].copy_from_slice(&[30_000u32.to_be_bytes(), 30_000u32.to_be_bytes()].concat());
    let crc = crc32(&bomb[12..29]);
    bomb[29..33].copy_from_slice(&crc.to_be_bytes());
    for (name, bytes, needle) in [
        ("truncated.png", png[..png.len() / 2].to_vec(), "PNG"),
        ("truncated.jpg", jpeg[..jpeg.len() / 3].to_vec(), "JPEG"),
        ("text.png", b"not an image at all".to_vec(), "not a PNG or JPEG"),
        ("image.gif", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;".to_vec(), "Gif images are not read"),
        ("bomb.png", bomb, "30000 x 30000 pixels"),
    ] {
        let path = tmp.join(name);
        std::fs::write(&path, bytes).unwrap();
        let err = RgbImage::open(&path).unwrap_err();
        assert!(matches!(&err, Error::Image { message, .. } if message.contains(needle)), "{name}: {err}");
    }
    let err = RgbImage::open(&tmp.join("missing.png")).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    let err = RgbImage::open(&tmp).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "a directory: {err}");
    // An aspect ratio the processor refuses.
    let thin = RgbImage { width: 500, height: 2, pixels: vec![0; 500 * 2 * 3] };
    let err = ImageProcessor::default().patches(&thin, "thin").unwrap_err();
    assert!(matches!(&err, Error::Image { message, .. } if message.contains("aspect ratio")), "{err}");
    // A side that rounds to no merged patch, where the least pixels allow it.
    let none_least = ImageProcessor { min_pixels: 0, ..ImageProcessor::default() };
    let narrow = RgbImage { width: 1000, height: 5, pixels: vec![0; 1000 * 5 * 3] };
    let err = none_least.patches(&narrow, "narrow").unwrap_err();
    assert!(matches!(&err, Error::Image { message, .. } if message.contains("side of none")), "{err}");
    // Pixels that are not the image's size.
    let short = RgbImage { width: 64, height: 64, pixels: vec![0; 64 * 63 * 3] };
    let err = ImageProcessor::default().patches(&short, "short").unwrap_err();
    assert!(
        matches!(&err, Error::Image { message, .. } if message.contains("not 64 x 64 RGB pixels")),
        "{err}"
    );
}

/// preprocessor_config.json: Qwen3-VL's as shipped, and settings that mean
/// nothing or that this processor does not follow.
#[test]
fn processor_configs() {
    let path = Path::new("preprocessor_config.json");
    let shipped = r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast"}"#;
    let p = ImageProcessor::parse(shipped, path).unwrap();
    assert_eq!((p.patch_size, p.merge_size, p.min_pixels, p.max_pixels), (16, 2, 65536, 16777216));
    let legacy = ImageProcessor::parse(r#"{"min_pixels": 3136, "max_pixels": 12845056}"#, path).unwrap();
    assert_eq!((legacy.min_pixels, legacy.max_pixels, legacy.patch_size), (3136, 12845056, 14));
    for (bad, invalid) in [
        (r#"{"size": {"shortest_edge": 100, "longest_edge": 10}}"#, true),
        (r#"{"max_pixels": 1099511627776}"#, true),
        (r#"{"patch_size": 0}"#, true),
        // A merged patch larger than the most pixels.
        (r#"{"patch_size": 1024, "merge_size": 2, "max_pixels": 1048576}"#, true),
        (r#"{"image_std": [0.5, 0.0, 0.5]}"#, true),
        (r#"{"image_mean": [0.5, 0.5]}"#, true),
        (r#"{"rescale_factor": -1.0}"#, true),
        (r#"{"patch_size": "sixteen"}"#, true),
        (r#"{"resample": 2}"#, false),
        (r#"{"do_normalize": false}"#, false),
    ] {
        let err = ImageProcessor::parse(bad, path).unwrap_err();
        let kind = if invalid {
            matches!(err, Error::InvalidConfig { .. })
        } else {
            matches!(err, Error::Unsupported { .. })
        };
        assert!(kind, "{bad}: {err}");
    }
    assert!(matches!(ImageProcessor::parse("{", path).unwrap_err(), Error::Json { .. }));
}

/// The vision tower on the GPU against transformers' `model.visual`: the
/// merged rows and each deepstack merger's rows of two images of different
/// grids (fixtures of a dense and a MoE model from
/// `scripts/make_vl_fixtures.py`), with the GEMM in both precisions and
/// with the GEMV, on every backend under test: within 1e-4, or 1e-2 where
/// the tower runs on cooperative matrices in f16.
#[test]
fn the_tower_gives_transformers_rows() {
    for fixture in ["qwen3_vl_images", "qwen3_vl_moe_images"] {
        check_tower(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(fixture));
    }
}

fn check_tower(dir: &Path) {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("vision.json")).unwrap()).unwrap();
    let processor = ImageProcessor::load(dir).unwrap();
    let rows = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
            .collect()
    };
    common::on_each_backend(|gpu| {
        let model = wgspark::Model::load(dir, gpu).unwrap();
        let width = model.config.hidden;
        for (name, want) in expected["images"].as_object().unwrap() {
            let image = RgbImage::open(&dir.join(name)).unwrap();
            let patches = processor.patches(&image, name).unwrap();
            use wgspark::kernels::gemm::PrefillPrecision::{F16, Split};
            let runs = [
                (wgspark::ChunkMatmul::Gemm, F16),
                (wgspark::ChunkMatmul::Gemm, Split),
                (wgspark::ChunkMatmul::Gemv, F16),
            ];
            for (matmul, precision) in runs {
                let what = format!("{name} on {:?} with {matmul:?} in {precision:?}", gpu.info.backend);
                let gemm = matmul.gemm(gpu, precision).unwrap();
                // On cooperative matrices in f16 the GEMM's operands and the
                // attention's are rounded to 11 bits (27 blocks of them);
                // elsewhere the tower keeps f32 (split: 22 bits).
                let tol = if gemm.as_ref().is_some_and(|g| g.keeps_half_copies()) { 1e-2 } else { 1e-4 };
                let got = wgspark::flow::vision::encode_image(&model, &patches, gemm.as_ref()).unwrap();
                let (merged, deepstack) = got.read(gpu, width).unwrap();
                let want_merged = rows(&want["merged"]);
                assert_eq!(got.tokens * width, want_merged.len(), "{what}: merged rows");
                common::assert_close(&merged, &want_merged, tol, &format!("{what}: merged"));
                let want_deep = want["deepstack"].as_array().unwrap();
                assert_eq!(deepstack.len(), want_deep.len(), "{what}: deepstack mergers");
                for (j, (g, w)) in deepstack.iter().zip(want_deep).enumerate() {
                    common::assert_close(g, &rows(w), tol, &format!("{what}: deepstack {j}"));
                }
                println!("{what}: merged max |error| {:.2e}", common::max_abs_diff(&merged, &want_merged));
            }
        }
    });
}

/// `profile_image` times each of the tower's dispatches where the adapter
/// has GPU timestamps: in flow order (the patch embedding's product
/// first), one attention for each block among them. Without timestamps it
/// is a typed refusal that says so.
#[test]
fn the_tower_profile_times_each_dispatch() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_vl_images");
    let processor = ImageProcessor::load(&dir).unwrap();
    let patches = processor.patches(&RgbImage::open(&dir.join("wide.png")).unwrap(), "wide.png").unwrap();
    common::on_each_backend(|gpu| {
        let model = wgspark::Model::load(&dir, gpu).unwrap();
        let blocks = model.config.vision.as_ref().unwrap().depth;
        let gemm = wgspark::ChunkMatmul::Auto.gemm(gpu, Default::default()).unwrap();
        match wgspark::flow::vision::profile_image(&model, &patches, gemm.as_ref()) {
            Ok(passes) => {
                assert!(gpu.caps.timestamps, "timed without timestamps");
                assert!(matches!(passes[0].0, "gemm" | "gemv"), "first: {:?}", passes[0]);
                let attention = passes.iter().filter(|(label, _)| label.starts_with("attend")).count();
                assert_eq!(attention, blocks, "attention passes");
                assert!(passes.iter().any(|(_, t)| !t.is_zero()), "no pass took time");
            }
            Err(Error::Unsupported { what, .. }) => {
                assert!(!gpu.caps.timestamps && what.contains("timestamps"), "{what}");
            }
            Err(e) => panic!("{e}"),
        }
    });
}
