//! One safetensors file: header parsed and validated at open, data left in the mmap.

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use strata_kernels::ElementType;

/// A tensor's place in a file: element type, shape and byte range (absolute offsets).
#[derive(Clone, Debug)]
pub struct TensorRef {
    pub dtype: ElementType,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn byte_len(&self) -> usize {
        self.end - self.start
    }
}

pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    tensors: BTreeMap<String, TensorRef>,
}

fn element_type(dtype: Dtype) -> Option<ElementType> {
    Some(match dtype {
        Dtype::F64 => ElementType::F64,
        Dtype::F32 => ElementType::F32,
        Dtype::F16 => ElementType::F16,
        Dtype::BF16 => ElementType::BF16,
        Dtype::F8_E4M3 => ElementType::F8E4M3,
        Dtype::I64 => ElementType::I64,
        Dtype::I32 => ElementType::I32,
        Dtype::I16 => ElementType::I16,
        Dtype::I8 => ElementType::I8,
        Dtype::U8 => ElementType::U8,
        Dtype::BOOL => ElementType::Bool,
        _ => return None,
    })
}

impl SafetensorsFile {
    /// Maps the file and validates its header (offsets, shapes, sizes); reads no tensor data.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        // SAFETY: the mapping is read-only; a file truncated underneath us is the
        // documented hazard of mmap, which callers accept for model weights.
        let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("{}: cannot mmap", path.display()))?;
        let tensors = Self::parse_header(&mmap).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(Self { path: path.to_path_buf(), mmap, tensors })
    }

    /// Validates a safetensors header held in `bytes` (the file's start: the length,
    /// the JSON header and as much data as it describes) and lists its tensors with
    /// absolute byte ranges. Errors say what is wrong (without the file name).
    pub fn parse_header(bytes: &[u8]) -> Result<BTreeMap<String, TensorRef>> {
        let (header_len, metadata) =
            SafeTensors::read_metadata(bytes).map_err(|e| anyhow!("corrupt safetensors header: {e}"))?;
        let data_start = 8 + header_len;
        let mut tensors = BTreeMap::new();
        for (name, info) in metadata.tensors() {
            let dtype = element_type(info.dtype)
                .ok_or_else(|| anyhow!("tensor `{name}` has unsupported dtype {:?}", info.dtype))?;
            let (s, e) = info.data_offsets;
            tensors.insert(
                name,
                TensorRef { dtype, shape: info.shape.clone(), start: data_start + s, end: data_start + e },
            );
        }
        Ok(tensors)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensors(&self) -> &BTreeMap<String, TensorRef> {
        &self.tensors
    }

    /// Drops this mapping's resident pages for the tensor (those wholly inside it), so a
    /// tensor decoded into its own buffer stops counting twice in the process footprint.
    /// Advisory: the bytes stay readable (they fault back in from the file).
    pub fn release(&self, t: &TensorRef) {
        self.release_bytes(t, 0, t.end - t.start);
    }

    /// [`Self::release`] for bytes `from..to` of the tensor only (one expert's rows of a
    /// fused 3-D tensor, once they are copied out).
    pub fn release_bytes(&self, t: &TensorRef, from: usize, to: usize) {
        const PAGE: usize = 4096;
        let base = self.mmap.as_ptr() as usize;
        let to = to.min(t.end - t.start);
        let start = (base + t.start + from).div_ceil(PAGE) * PAGE;
        let end = ((base + t.start + to) / PAGE) * PAGE;
        if end > start {
            // SAFETY: the range lies inside our read-only private mapping; MADV_DONTNEED
            // on it only discards cached pages, which later reads fault back in.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        }
    }

    /// The raw little-endian bytes of a tensor.
    pub fn bytes(&self, t: &TensorRef) -> Result<&[u8]> {
        self.mmap.get(t.start..t.end).ok_or_else(|| {
            anyhow!(
                "{}: tensor bytes {}..{} lie outside the file ({} bytes)",
                self.path.display(),
                t.start,
                t.end,
                self.mmap.len()
            )
        })
    }
}

/// Fails with a message naming the file when a header is not a safetensors header.
pub(crate) fn ensure_nonempty(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).with_context(|| format!("{}: cannot stat", path.display()))?;
    if meta.len() < 8 {
        bail!("{}: corrupt safetensors header: file is only {} bytes", path.display(), meta.len());
    }
    Ok(())
}
