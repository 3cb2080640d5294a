//! Building checkpoint folders in tests: copies of fixtures with tensors
//! changed, removed, re-typed or sharded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

pub type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

pub fn read_tensors(file: &Path) -> Tensors {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.dtype(), view.shape().to_vec(), view.data().to_vec())))
        .collect()
}

pub fn write_tensors(file: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, data))| {
            (name.clone(), TensorView::new(*dtype, shape.clone(), data).unwrap())
        })
        .collect();
    std::fs::write(file, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A fresh, empty directory under the system temp dir (or a path inside
/// one), removed with everything in it when the value is dropped, whether
/// the test passes or fails.
pub struct Scratch {
    dir: tempfile::TempDir,
    path: PathBuf,
}

impl Scratch {
    /// The path of `name` inside this scratch directory, which stays alive
    /// as long as the returned value.
    pub fn file(self, name: &str) -> Scratch {
        let path = self.dir.path().join(name);
        Scratch { dir: self.dir, path }
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
}

/// A fresh, empty scratch directory named after `name`.
pub fn temp_dir(name: &str) -> Scratch {
    let dir = tempfile::Builder::new().prefix(&format!("wgspark-test-{name}-")).tempdir().unwrap();
    let path = dir.path().to_path_buf();
    Scratch { dir, path }
}

pub fn fixture_dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(case)
}

/// A copy of fixture `case` whose config and tensors went through `edit`.
pub fn edited_fixture(case: &str, edit: impl FnOnce(&mut serde_json::Value, &mut Tensors)) -> Scratch {
    let src = fixture_dir(case);
    let dir = temp_dir(case);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let mut tensors = read_tensors(&src.join("model.safetensors"));
    edit(&mut config, &mut tensors);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    write_tensors(&dir.join("model.safetensors"), &tensors);
    dir
}

/// bf16 little-endian bytes to f32 little-endian bytes (exact).
pub fn bf16_to_f32_bytes(data: &[u8]) -> Vec<u8> {
    data.chunks_exact(2)
        .flat_map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32().to_le_bytes())
        .collect()
}

/// bf16 little-endian bytes to f16 bytes.
pub fn bf16_to_f16_bytes(data: &[u8]) -> Vec<u8> {
    data.chunks_exact(2)
        .flat_map(|b| half::f16::from_f32(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).to_le_bytes())
        .collect()
}
