//! Images into the vision tower's patches, as transformers' Qwen2-VL image
//! processor (the one Qwen3-VL ships with) makes them with its PIL backend:
//! decoded and made RGB (transparency composited onto white), resized with
//! Pillow's bicubic ([`super::resample`]) to sides that are multiples of
//! patch x merge size and whose area lies between the processor's least
//! and most pixels, rescaled and normalised in f32, and cut into patches
//! ordered merge block by merge block, each repeated over the temporal
//! patch (a still image is one frame).

use std::path::Path;

use rayon::prelude::*;
use serde::Deserialize;

use crate::error::{Error, Result};

/// Largest image file read.
pub const MAX_IMAGE_FILE_BYTES: u64 = 256 << 20;
/// Most pixels a decoded image may have: Pillow's limit, past which it
/// refuses a file as a decompression bomb.
pub const MAX_IMAGE_PIXELS: u64 = 2 * 89_478_485;
/// Most pixels a resized image may have (a processor's `longest_edge`);
/// Qwen3-VL's is 2^24.
pub const MAX_RESIZED_PIXELS: usize = 1 << 28;
/// Widest aspect ratio transformers' processor resizes.
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// An 8-bit RGB image, rows top to bottom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Pixels per row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// `width * height` pixels of 3 bytes.
    pub pixels: Vec<u8>,
}

fn image_error(origin: &str, message: impl Into<String>) -> Error {
    Error::Image { origin: origin.to_string(), message: message.into() }
}

impl RgbImage {
    /// Reads a PNG or JPEG file.
    pub fn open(path: &Path) -> Result<RgbImage> {
        crate::error::check_regular_file(path)?;
        let size = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
        let origin = path.display().to_string();
        if size > MAX_IMAGE_FILE_BYTES {
            return Err(image_error(&origin, format!("{size} bytes, more than {MAX_IMAGE_FILE_BYTES}")));
        }
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::decode(&bytes, &origin)
    }

    /// Decodes a PNG or JPEG held in memory (`origin` names it in errors):
    /// its EXIF orientation applied, as transformers' `load_image` does;
    /// grayscale widened to RGB; transparency composited onto white, with
    /// Pillow's rounding. JPEGs go through `jpeg-decoder`, whose output is
    /// closest to the libjpeg that Pillow uses (a few levels apart).
    pub fn decode(bytes: &[u8], origin: &str) -> Result<RgbImage> {
        let (image, orientation) = match image::guess_format(bytes) {
            Ok(image::ImageFormat::Png) => Self::decode_png(bytes, origin)?,
            Ok(image::ImageFormat::Jpeg) => Self::decode_jpeg(bytes, origin)?,
            Ok(other) => {
                return Err(image_error(origin, format!("{other:?} images are not read (PNG and JPEG are)")));
            }
            Err(_) => return Err(image_error(origin, "not a PNG or JPEG image")),
        };
        let mut image = image;
        image.apply_orientation(orientation);
        Self::from_dynamic(image, origin)
    }

    fn check_pixels(width: u64, height: u64, origin: &str) -> Result<()> {
        if width * height > MAX_IMAGE_PIXELS {
            return Err(image_error(
                origin,
                format!("{width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} an image may have"),
            ));
        }
        Ok(())
    }

    fn decode_png(bytes: &[u8], origin: &str) -> Result<(image::DynamicImage, image::metadata::Orientation)> {
        use image::ImageDecoder;
        let failed = |e: image::ImageError| image_error(origin, format!("PNG: {e}"));
        let mut decoder = image::codecs::png::PngDecoder::new(std::io::Cursor::new(bytes)).map_err(failed)?;
        let (width, height) = decoder.dimensions();
        Self::check_pixels(width.into(), height.into(), origin)?;
        let mut limits = image::Limits::default();
        limits.max_alloc = Some(8 * MAX_IMAGE_PIXELS);
        decoder.set_limits(limits).map_err(failed)?;
        let orientation = decoder.orientation().map_err(failed)?;
        Ok((image::DynamicImage::from_decoder(decoder).map_err(failed)?, orientation))
    }

    fn decode_jpeg(
        bytes: &[u8],
        origin: &str,
    ) -> Result<(image::DynamicImage, image::metadata::Orientation)> {
        use jpeg_decoder::PixelFormat;
        let failed = |e: jpeg_decoder::Error| image_error(origin, format!("JPEG: {e}"));
        let mut decoder = jpeg_decoder::Decoder::new(std::io::Cursor::new(bytes));
        decoder.read_info().map_err(failed)?;
        let info = decoder.info().ok_or_else(|| image_error(origin, "JPEG: no frame header"))?;
        Self::check_pixels(info.width.into(), info.height.into(), origin)?;
        decoder.set_max_decoding_buffer_size(4 * MAX_IMAGE_PIXELS as usize);
        let pixels = decoder.decode().map_err(failed)?;
        let (w, h) = (u32::from(info.width), u32::from(info.height));
        let image = match info.pixel_format {
            PixelFormat::RGB24 => image::RgbImage::from_raw(w, h, pixels).map(image::DynamicImage::ImageRgb8),
            PixelFormat::L8 => image::GrayImage::from_raw(w, h, pixels).map(image::DynamicImage::ImageLuma8),
            other => {
                return Err(image_error(
                    origin,
                    format!("JPEG: {other:?} pixels are not read (gray and RGB are)"),
                ));
            }
        }
        .ok_or_else(|| image_error(origin, "JPEG: fewer pixels than its size"))?;
        let orientation = decoder
            .exif_data()
            .and_then(image::metadata::Orientation::from_exif_chunk)
            .unwrap_or(image::metadata::Orientation::NoTransforms);
        Ok((image, orientation))
    }

    fn from_dynamic(image: image::DynamicImage, origin: &str) -> Result<RgbImage> {
        use image::DynamicImage as D;
        let (width, height) = (image.width() as usize, image.height() as usize);
        let pixels = match image {
            D::ImageRgb8(rgb) => rgb.into_raw(),
            D::ImageLuma8(gray) => gray.into_raw().iter().flat_map(|&l| [l, l, l]).collect(),
            D::ImageRgba8(rgba) => rgba
                .into_raw()
                .chunks_exact(4)
                .flat_map(|p| onto_white(p[..3].try_into().unwrap(), p[3]))
                .collect(),
            D::ImageLumaA8(gray) => {
                gray.into_raw().chunks_exact(2).flat_map(|p| onto_white([p[0]; 3], p[1])).collect()
            }
            other => {
                return Err(image_error(
                    origin,
                    format!("{:?} pixels are not read (8-bit gray, RGB and their alpha are)", other.color()),
                ));
            }
        };
        Ok(RgbImage { width, height, pixels })
    }
}

/// A pixel of alpha `a` composited onto opaque white, rounded as Pillow's
/// `alpha_composite` rounds.
fn onto_white(rgb: [u8; 3], a: u8) -> [u8; 3] {
    let a = u32::from(a);
    rgb.map(|c| {
        let v = u32::from(c) * a + 255 * (255 - a) + 128;
        ((v + (v >> 8)) >> 8) as u8
    })
}

/// `preprocessor_config.json`'s fields that this processor reads.
#[derive(Debug, Deserialize)]
struct RawProcessor {
    size: Option<RawSize>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<Vec<f64>>,
    image_std: Option<Vec<f64>>,
    rescale_factor: Option<f64>,
    resample: Option<u32>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_convert_rgb: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct RawSize {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
}

/// How images become patches.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessor {
    /// Pixels per patch side.
    pub patch_size: usize,
    /// Frames per patch (a still image is repeated over them).
    pub temporal_patch_size: usize,
    /// Patches per side of a merged token.
    pub merge_size: usize,
    /// Least pixels of the resized image (`size.shortest_edge`, or
    /// `min_pixels`).
    pub min_pixels: usize,
    /// Most pixels of the resized image (`size.longest_edge`, or
    /// `max_pixels`).
    pub max_pixels: usize,
    /// Per channel (R, G, B), what is subtracted from a rescaled value
    /// (`image_mean`; CLIP's by default).
    pub mean: [f32; 3],
    /// Per channel, what a value is divided by after the mean is
    /// subtracted (`image_std`; CLIP's by default; never 0).
    pub std: [f32; 3],
    /// What 8-bit values are multiplied by first (`rescale_factor`;
    /// 1/255 by default).
    pub rescale_factor: f64,
}

/// OpenAI CLIP's channel statistics, transformers' defaults, as the Python
/// floats it narrows to f32.
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

impl Default for ImageProcessor {
    /// transformers' defaults for the processor class.
    fn default() -> Self {
        ImageProcessor {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            mean: CLIP_MEAN.map(|v| v as f32),
            std: CLIP_STD.map(|v| v as f32),
            rescale_factor: 1.0 / 255.0,
        }
    }
}

/// An image as the tower reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Patches {
    /// `grid[0] * grid[1] * grid[2]` rows of [`Self::patch_len`] values
    /// (channel, frame, patch row, patch column).
    pub values: Vec<f32>,
    /// Frames, rows and columns of patches.
    pub grid: [usize; 3],
    /// Values per patch: 3 channels x `temporal_patch_size` x
    /// `patch_size`².
    pub patch_len: usize,
}

impl ImageProcessor {
    /// Reads `dir/preprocessor_config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let text = crate::error::read_text(&path, crate::error::MAX_JSON_BYTES)?;
        Self::parse(&text, &path)
    }

    /// Parses and validates the text of a preprocessor_config.json (`path`
    /// names it in errors); keys it lacks take transformers' defaults. A
    /// step switched off, or a filter other than bicubic, is
    /// [`Error::Unsupported`].
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Json { path: path.to_path_buf(), message: e.to_string() })?;
        let raw: RawProcessor = serde_path_to_error::deserialize(value).map_err(|e| {
            Error::InvalidConfig { path: path.to_path_buf(), message: format!("{}: {}", e.path(), e.inner()) }
        })?;
        let invalid = |message: String| Error::InvalidConfig { path: path.to_path_buf(), message };
        let defaults = Self::default();
        for (key, on) in [
            ("do_resize", raw.do_resize),
            ("do_rescale", raw.do_rescale),
            ("do_normalize", raw.do_normalize),
            ("do_convert_rgb", raw.do_convert_rgb),
        ] {
            if on == Some(false) {
                return Err(Error::Unsupported {
                    what: "image processor step switched off",
                    value: key.to_string(),
                });
            }
        }
        // PILImageResampling.BICUBIC.
        if let Some(r) = raw.resample.filter(|&r| r != 3) {
            return Err(Error::Unsupported {
                what: "image resampling filter (bicubic, 3, is read)",
                value: r.to_string(),
            });
        }
        let size = raw.size.as_ref();
        let min_pixels = size.and_then(|s| s.shortest_edge).or(raw.min_pixels).unwrap_or(defaults.min_pixels);
        let max_pixels = size.and_then(|s| s.longest_edge).or(raw.max_pixels).unwrap_or(defaults.max_pixels);
        if min_pixels > max_pixels || max_pixels == 0 || max_pixels > MAX_RESIZED_PIXELS {
            return Err(invalid(format!(
                "size: least pixels {min_pixels} and most {max_pixels} must be ordered, the most positive and at most {MAX_RESIZED_PIXELS}"
            )));
        }
        let three = |v: Option<Vec<f64>>, name: &str, default: [f32; 3]| -> Result<[f32; 3]> {
            match v {
                None => Ok(default),
                Some(v) if v.len() == 3 && v.iter().all(|x| (*x as f32).is_finite()) => {
                    Ok([v[0] as f32, v[1] as f32, v[2] as f32])
                }
                Some(v) => Err(invalid(format!("{name} {v:?} must be three finite values"))),
            }
        };
        let mean = three(raw.image_mean, "image_mean", defaults.mean)?;
        let std = three(raw.image_std, "image_std", defaults.std)?;
        if std.contains(&0.0) {
            return Err(invalid(format!("image_std {std:?} must not hold 0")));
        }
        let patch_size = raw.patch_size.unwrap_or(defaults.patch_size);
        let temporal_patch_size = raw.temporal_patch_size.unwrap_or(defaults.temporal_patch_size);
        let merge_size = raw.merge_size.unwrap_or(defaults.merge_size);
        for (name, v) in [
            ("patch_size", patch_size),
            ("temporal_patch_size", temporal_patch_size),
            ("merge_size", merge_size),
        ] {
            if v == 0 || v > 1024 {
                return Err(invalid(format!("{name} {v} must be between 1 and 1024")));
            }
        }
        let merged_patch = patch_size * merge_size;
        if merged_patch * merged_patch > max_pixels {
            return Err(invalid(format!(
                "a merged patch of {merged_patch} x {merged_patch} pixels is more than the most pixels, {max_pixels}"
            )));
        }
        let rescale_factor = raw.rescale_factor.unwrap_or(defaults.rescale_factor);
        if !(rescale_factor.is_finite() && rescale_factor > 0.0) {
            return Err(invalid(format!("rescale_factor {rescale_factor} must be positive and finite")));
        }
        Ok(ImageProcessor {
            patch_size,
            temporal_patch_size,
            merge_size,
            min_pixels,
            max_pixels,
            mean,
            std,
            rescale_factor,
        })
    }

    /// The side lengths (height, width) an image of `height x width` is
    /// resized to: the nearest multiples of patch x merge size, scaled as a
    /// whole into the processor's pixel range (transformers' `smart_resize`,
    /// with Python's rounding).
    pub fn resized_size(&self, height: usize, width: usize) -> std::result::Result<(usize, usize), String> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (h, w) = (height as f64, width as f64);
        if height == 0 || width == 0 {
            return Err(format!("{width} x {height} pixels: an image has at least one"));
        }
        let ratio = h.max(w) / h.min(w);
        if ratio > MAX_ASPECT_RATIO {
            return Err(format!("aspect ratio {ratio:.1} is wider than {MAX_ASPECT_RATIO}"));
        }
        let mut h_bar = (h / factor).round_ties_even() * factor;
        let mut w_bar = (w / factor).round_ties_even() * factor;
        if h_bar * w_bar > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if h_bar * w_bar < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        if h_bar == 0.0 || w_bar == 0.0 {
            return Err(format!(
                "{width} x {height} pixels resize to a side of none at {} least pixels",
                self.min_pixels
            ));
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// The image's patches. Merge blocks are cut in parallel, each a run
    /// of the values.
    pub fn patches(&self, image: &RgbImage, origin: &str) -> Result<Patches> {
        let pixels = image.width.checked_mul(image.height).and_then(|n| n.checked_mul(3));
        if pixels != Some(image.pixels.len()) {
            return Err(image_error(
                origin,
                format!("{} bytes are not {} x {} RGB pixels", image.pixels.len(), image.width, image.height),
            ));
        }
        let (height, width) =
            self.resized_size(image.height, image.width).map_err(|m| image_error(origin, m))?;
        let resized;
        let rgb = if (height, width) == (image.height, image.width) {
            &image.pixels
        } else {
            resized = super::resample::resize_rgb(&image.pixels, image.width, image.height, width, height);
            &resized
        };
        let normalised = self.normalised_levels();
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (grid_h, grid_w) = (height / p, width / p);
        let patch_len = 3 * t * p * p;
        let blocks_across = grid_w / m;
        let mut values = vec![0.0; grid_h * grid_w * patch_len];
        values.par_chunks_mut(m * m * patch_len).enumerate().for_each(|(block, values)| {
            let (block_y, block_x) = (block / blocks_across, block % blocks_across);
            // Rows of a patch's p values, in the order they are stored.
            let mut rows = values.chunks_exact_mut(p);
            for my in 0..m {
                for mx in 0..m {
                    let (y0, x0) = ((block_y * m + my) * p, (block_x * m + mx) * p);
                    for (c, table) in normalised.iter().enumerate() {
                        for _ in 0..t {
                            for y in y0..y0 + p {
                                let pixels = &rgb[(y * width + x0) * 3..(y * width + x0 + p) * 3];
                                let row = rows.next().expect("a merge block holds m² patches");
                                for (v, pixel) in row.iter_mut().zip(pixels.chunks_exact(3)) {
                                    *v = table[usize::from(pixel[c])];
                                }
                            }
                        }
                    }
                }
            }
        });
        Ok(Patches { values, grid: [1, grid_h, grid_w], patch_len })
    }

    /// Each channel's value of each 8-bit level: rescaled in f64 and
    /// stored in f32, then normalised in f32, as the processor's numpy
    /// steps are.
    fn normalised_levels(&self) -> [[f32; 256]; 3] {
        std::array::from_fn(|c| {
            std::array::from_fn(|level| {
                let v = (level as f64 * self.rescale_factor) as f32;
                (v - self.mean[c]) / self.std[c]
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compositing_onto_white_keeps_opaque_pixels_and_whitens_clear_ones() {
        assert_eq!(onto_white([10, 20, 30], 255), [10, 20, 30]);
        assert_eq!(onto_white([10, 20, 30], 0), [255, 255, 255]);
        assert_eq!(onto_white([0, 0, 0], 128), [127, 127, 127]);
    }

    #[test]
    fn sizes_are_multiples_of_the_merged_patch_within_the_pixel_range() {
        let p =
            ImageProcessor { patch_size: 16, min_pixels: 65536, max_pixels: 1 << 24, ..Default::default() };
        for (h, w) in [(1, 1), (37, 53), (480, 640), (1000, 70), (5000, 4000), (32, 6000)] {
            let (rh, rw) = p.resized_size(h, w).unwrap();
            assert!(rh % 32 == 0 && rw % 32 == 0 && rh > 0 && rw > 0, "{h} x {w} -> {rh} x {rw}");
            assert!((p.min_pixels..=p.max_pixels).contains(&(rh * rw)), "{h} x {w} -> {rh} x {rw}");
        }
        assert!(p.resized_size(10, 2001).unwrap_err().contains("aspect ratio"));
        assert!(p.resized_size(0, 3).is_err());
    }
}
