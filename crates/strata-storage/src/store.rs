//! A model directory's weights: one or more safetensors shards behind one name space.

use crate::colibri::{infer_quant_kind, QS_SUFFIX};
use crate::safetensors_file::{ensure_nonempty, SafetensorsFile, TensorRef};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use strata_kernels::{decode_to_f32, dequantize, dequantize_fp8_blocks, ElementType, QuantKind};

const INDEX_FILE: &str = "model.safetensors.index.json";

/// A quantized matrix as a checkpoint stores it: its encoding, payload and f32 scales.
pub struct StoredMatrix {
    pub kind: QuantKind,
    pub payload: Vec<u8>,
    pub scales: Vec<f32>,
}

pub struct WeightStore {
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    names: BTreeMap<String, usize>,
}

impl WeightStore {
    /// Opens every shard of `dir`: those named by `model.safetensors.index.json`, else
    /// `model.safetensors`, else `model-*.safetensors`, else the `out-*.safetensors` of a
    /// Colibri-layout container. Headers only.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        Self::open_files(&shard_paths(dir)?)
    }

    /// Opens these safetensors files as one name space (a name in two files is an error).
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut names = BTreeMap::new();
        for path in paths {
            ensure_nonempty(path)?;
            let file = SafetensorsFile::open(path)?;
            for name in file.tensors().keys() {
                if names.insert(name.clone(), files.len()).is_some() {
                    bail!("{}: tensor `{name}` also appears in another shard", path.display());
                }
            }
            files.push(file);
        }
        Ok(Self { files, names })
    }

    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path())
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// The index (in [`files`](Self::files) order) of the file holding `name`, and its
    /// header entry (offsets are absolute byte offsets in that file).
    pub fn locate(&self, name: &str) -> Option<(usize, &TensorRef)> {
        let i = *self.names.get(name)?;
        Some((i, &self.files[i].tensors()[name]))
    }

    /// The file holding `name` and its header entry.
    pub fn get(&self, name: &str) -> Option<(&SafetensorsFile, &TensorRef)> {
        let file = &self.files[*self.names.get(name)?];
        Some((file, &file.tensors()[name]))
    }

    fn require(&self, name: &str) -> Result<(&SafetensorsFile, &TensorRef)> {
        self.get(name).ok_or_else(|| {
            let first = self.files.first().map(|f| f.path().display().to_string());
            anyhow!("{}: missing tensor `{name}`", first.unwrap_or_else(|| "weights".into()))
        })
    }

    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.require(name)?.1.shape.clone())
    }

    /// Decodes `name` to f32, checking its shape. FP8 weights are dequantized with their
    /// `<name>_scale_inv` block scales (`block` = the checkpoint's `weight_block_size`).
    pub fn load_f32(&self, name: &str, shape: &[usize], block: Option<(usize, usize)>) -> Result<Vec<f32>> {
        let (file, t) = self.require(name)?;
        let qs_name = format!("{name}{QS_SUFFIX}");
        if matches!(t.dtype, ElementType::U8 | ElementType::I8) && self.contains(&qs_name) {
            return self.load_qs(name, &qs_name, shape);
        }
        if t.shape != shape {
            bail!(
                "{}: tensor `{name}` has shape {:?} but the config implies {:?}",
                file.path().display(),
                t.shape,
                shape
            );
        }
        let bytes = file.bytes(t)?;
        let mut out = vec![0f32; t.numel()];
        if t.dtype == ElementType::F8E4M3 {
            let scale_name = format!("{name}_scale_inv");
            let scale_shape = self
                .get(&scale_name)
                .map(|(_, s)| s.shape.clone())
                .ok_or_else(|| anyhow!("{}: FP8 tensor `{name}` has no `{scale_name}`", file.path().display()))?;
            if shape.len() != 2 || scale_shape.len() != 2 {
                bail!("{}: FP8 tensor `{name}` must be 2-D with a 2-D scale", file.path().display());
            }
            // The block size follows from the scale grid when the config gives none.
            let block = block.unwrap_or((shape[0].div_ceil(scale_shape[0]), shape[1].div_ceil(scale_shape[1])));
            let scales = self.load_f32(&scale_name, &scale_shape, None)?;
            dequantize_fp8_blocks(bytes, shape[0], shape[1], &scales, block, &mut out)
                .map_err(|e| anyhow!("{}: tensor `{name}`: {e}", file.path().display()))?;
        } else {
            decode_to_f32(t.dtype, bytes, &mut out)
                .map_err(|e| anyhow!("{}: tensor `{name}`: {e}", file.path().display()))?;
        }
        file.release(t);
        Ok(out)
    }

    /// A Colibri-layout tensor: U8 payload `name` plus F32 scales `qs_name`, the encoding
    /// inferred from the byte counts against the expected `[rows, cols]`.
    fn load_qs(&self, name: &str, qs_name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let &[rows, cols] = shape else {
            bail!(
                "{}: tensor `{name}` is a quantized payload (with `{qs_name}`) but the config implies shape {shape:?}, not a 2-D matrix",
                self.require(name)?.0.path().display()
            );
        };
        let (kind, payload, scales) = self.qs_parts(name, qs_name, rows, cols)?;
        Ok(dequantize(kind, payload, &scales, rows, cols))
    }

    /// A Colibri-layout tensor as stored, for the expected `[rows, cols]`; `None` when
    /// `name` is not such a tensor.
    pub fn load_quantized(&self, name: &str, rows: usize, cols: usize) -> Option<Result<StoredMatrix>> {
        let qs_name = format!("{name}{QS_SUFFIX}");
        (self.contains(name) && self.contains(&qs_name)).then(|| {
            let (kind, payload, scales) = self.qs_parts(name, &qs_name, rows, cols)?;
            Ok(StoredMatrix { kind, payload: payload.to_vec(), scales })
        })
    }

    /// A Colibri-layout tensor's encoding (from the byte counts against `[rows, cols]`),
    /// payload bytes and f32 scales.
    fn qs_parts(&self, name: &str, qs_name: &str, rows: usize, cols: usize) -> Result<(QuantKind, &[u8], Vec<f32>)> {
        let (file, t) = self.require(name)?;
        let (qfile, q) = self.require(qs_name)?;
        if q.dtype != ElementType::F32 {
            bail!("{}: scale tensor `{qs_name}` is {:?}, expected F32", qfile.path().display(), q.dtype);
        }
        let kind = infer_quant_kind(rows, cols, t.byte_len(), q.numel())
            .map_err(|e| anyhow!("{}: tensor `{name}`: {e}", file.path().display()))?;
        let mut scales = vec![0f32; q.numel()];
        decode_to_f32(ElementType::F32, qfile.bytes(q)?, &mut scales)
            .map_err(|e| anyhow!("{}: tensor `{qs_name}`: {e}", qfile.path().display()))?;
        Ok((kind, file.bytes(t)?, scales))
    }

    /// The encoding of a Colibri-layout tensor (`name` + `name.qs`) for the expected
    /// `[rows, cols]`; `None` when `name` is not such a tensor.
    pub fn quant_kind(&self, name: &str, rows: usize, cols: usize) -> Option<Result<QuantKind>> {
        let (file, t) = self.get(name)?;
        let (_, q) = self.get(&format!("{name}{QS_SUFFIX}"))?;
        Some(
            infer_quant_kind(rows, cols, t.byte_len(), q.numel())
                .map_err(|e| anyhow!("{}: tensor `{name}`: {e}", file.path().display())),
        )
    }

    /// Bytes on disk of the named tensor (plus its FP8 `_scale_inv` or Colibri `.qs`
    /// scales, if any).
    pub fn stored_bytes(&self, name: &str) -> usize {
        let own = self.get(name).map_or(0, |(_, t)| t.byte_len());
        let scale = self.get(&format!("{name}_scale_inv")).map_or(0, |(_, t)| t.byte_len());
        let qs = self.get(&format!("{name}{QS_SUFFIX}")).map_or(0, |(_, t)| t.byte_len());
        own + scale + qs
    }
}

fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        bail!("{}: model directory not found", dir.display());
    }
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("{}: cannot read", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| anyhow!("{}: no `weight_map` object", index.display()))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        if files.is_empty() {
            bail!("{}: `weight_map` names no files", index.display());
        }
        let paths: Vec<PathBuf> = files.into_iter().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.exists() {
                bail!("{}: shard named in {INDEX_FILE} is missing", p.display());
            }
        }
        return Ok(paths);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut shards = list_safetensors(dir, "model-")?;
    if shards.is_empty() {
        shards = list_safetensors(dir, "out-")?;
    }
    if shards.is_empty() {
        bail!(
            "{}: no weights (expected {INDEX_FILE}, model.safetensors, model-*.safetensors or out-*.safetensors)",
            dir.display()
        );
    }
    Ok(shards)
}

/// `dir/<prefix>*.safetensors`, sorted.
pub(crate) fn list_safetensors(dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(prefix) && name.ends_with(".safetensors") && p.is_file()
        })
        .collect();
    shards.sort();
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_st(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
        f.write_all(&h).unwrap();
        f.write_all(&data).unwrap();
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn opens_single_file_and_decodes() {
        let dir = tempfile::tempdir().unwrap();
        write_st(&dir.path().join("model.safetensors"), &[("a", "F32", vec![2, 2], f32_bytes(&[1., 2., 3., 4.]))]);
        let store = WeightStore::open_dir(dir.path()).unwrap();
        assert_eq!(store.load_f32("a", &[2, 2], None).unwrap(), vec![1., 2., 3., 4.]);
        let err = store.load_f32("a", &[4], None).unwrap_err().to_string();
        assert!(err.contains("has shape [2, 2] but the config implies [4]"), "{err}");
        let err = store.load_f32("b", &[4], None).unwrap_err().to_string();
        assert!(err.contains("missing tensor `b`"), "{err}");
    }

    #[test]
    fn sharded_with_index() {
        let dir = tempfile::tempdir().unwrap();
        write_st(&dir.path().join("s1.safetensors"), &[("a", "F32", vec![1], f32_bytes(&[1.]))]);
        write_st(&dir.path().join("s2.safetensors"), &[("b", "F32", vec![1], f32_bytes(&[2.]))]);
        std::fs::write(
            dir.path().join(INDEX_FILE),
            r#"{"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}"#,
        )
        .unwrap();
        let store = WeightStore::open_dir(dir.path()).unwrap();
        assert_eq!(store.load_f32("b", &[1], None).unwrap(), vec![2.]);
        std::fs::remove_file(dir.path().join("s2.safetensors")).unwrap();
        let err = WeightStore::open_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("s2.safetensors: shard named in"), "{err}");
    }

    #[test]
    fn corrupt_and_truncated_headers_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        std::fs::write(&p, [1u8, 2, 3]).unwrap();
        let err = WeightStore::open_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("model.safetensors: corrupt safetensors header"), "{err}");
        // Header length pointing past the end of the file.
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&p, &bytes).unwrap();
        let err = WeightStore::open_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("corrupt safetensors header"), "{err}");
        // Data shorter than the header promises.
        write_st(&p, &[("a", "F32", vec![4], f32_bytes(&[1., 2., 3., 4.]))]);
        let len = std::fs::metadata(&p).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len - 4).unwrap();
        let err = WeightStore::open_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("corrupt safetensors header"), "{err}");
    }

    #[test]
    fn missing_weights_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = WeightStore::open_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("no weights"), "{err}");
    }

    #[test]
    fn fp8_with_block_scales() {
        let dir = tempfile::tempdir().unwrap();
        // 0x38 = 1.0, 0x40 = 2.0 in e4m3.
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("w", "F8_E4M3", vec![2, 3], vec![0x38, 0x40, 0x38, 0x40, 0x38, 0x40]),
                ("w_scale_inv", "F32", vec![1, 1], f32_bytes(&[0.5])),
            ],
        );
        let store = WeightStore::open_dir(dir.path()).unwrap();
        let w = store.load_f32("w", &[2, 3], Some((128, 128))).unwrap();
        assert_eq!(w, vec![0.5, 1.0, 0.5, 1.0, 0.5, 1.0]);
    }
}
