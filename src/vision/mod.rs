//! Images in the prompt (Qwen3-VL): their preprocessing into the vision
//! tower's patches.

pub mod preprocess;
pub mod resample;

pub use preprocess::{ImageProcessor, Patches, RgbImage};
