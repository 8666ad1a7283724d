//! Streaming safetensors writer: the header first (all sizes known up front), then each
//! tensor's bytes in order, so files larger than memory can be produced.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use strata_kernels::ElementType;

pub struct TensorSpec {
    pub name: String,
    pub dtype: ElementType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_bytes()
    }
}

pub struct SafetensorsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    specs: Vec<TensorSpec>,
    next: usize,
}

impl SafetensorsWriter {
    /// Writes the header for `specs` (in this order) to a new file at `path`.
    pub fn create(path: &Path, specs: Vec<TensorSpec>) -> Result<Self> {
        let mut header = serde_json::Map::new();
        let mut offset = 0usize;
        for s in &specs {
            let end = offset + s.byte_len();
            header.insert(
                s.name.clone(),
                serde_json::json!({"dtype": s.dtype.name(), "shape": s.shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut json = serde_json::to_vec(&header)?;
        // Pad the header so tensor data starts 8-byte aligned, as the reference writer does.
        while (8 + json.len()) % 8 != 0 {
            json.push(b' ');
        }
        let file = File::create(path).with_context(|| format!("{}: cannot create", path.display()))?;
        let mut out = BufWriter::with_capacity(1 << 22, file);
        out.write_all(&(json.len() as u64).to_le_bytes())?;
        out.write_all(&json)?;
        Ok(Self { path: path.to_path_buf(), out, specs, next: 0 })
    }

    /// The spec of the next tensor to write, if any.
    pub fn next_spec(&self) -> Option<&TensorSpec> {
        self.specs.get(self.next)
    }

    /// Writes the next tensor's bytes; their length must match its spec.
    pub fn write_next(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(spec) = self.specs.get(self.next) else {
            bail!("{}: more tensors written than declared", self.path.display());
        };
        if bytes.len() != spec.byte_len() {
            bail!(
                "{}: tensor `{}` needs {} bytes, got {}",
                self.path.display(),
                spec.name,
                spec.byte_len(),
                bytes.len()
            );
        }
        self.out.write_all(bytes).with_context(|| format!("{}: write failed", self.path.display()))?;
        self.next += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        if self.next != self.specs.len() {
            bail!("{}: {} of {} tensors written", self.path.display(), self.next, self.specs.len());
        }
        self.out.flush().with_context(|| format!("{}: flush failed", self.path.display()))?;
        self.out.get_ref().sync_all().with_context(|| format!("{}: fsync failed", self.path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WeightStore;

    #[test]
    fn written_file_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let specs = vec![
            TensorSpec { name: "a".into(), dtype: ElementType::F32, shape: vec![2] },
            TensorSpec { name: "b".into(), dtype: ElementType::BF16, shape: vec![3] },
        ];
        let mut w = SafetensorsWriter::create(&dir.path().join("model.safetensors"), specs).unwrap();
        w.write_next(&[1f32.to_le_bytes(), 2f32.to_le_bytes()].concat()).unwrap();
        assert!(w.write_next(&[0u8; 5]).is_err());
        w.write_next(&[0x80, 0x3f, 0x00, 0x40, 0x40, 0x40]).unwrap();
        w.finish().unwrap();
        let store = WeightStore::open_dir(dir.path()).unwrap();
        assert_eq!(store.load_f32("a", &[2], None).unwrap(), vec![1.0, 2.0]);
        assert_eq!(store.load_f32("b", &[3], None).unwrap(), vec![1.0, 2.0, 3.0]);
    }
}
