//! The public GLM-5.2 expert container ("Colibri" layout), opened in place, read-only.
//!
//! ```text
//! out-NNNNN.safetensors       main weights (dense part and the routed experts)
//! out-mtp-NNNNN.safetensors   the MTP layer (layer id num_hidden_layers), int8 experts
//! out-idx-NNNNN.safetensors   optional: the DSA indexer
//! ```
//! Every 2-D weight is a `U8` payload `<name>` plus an `F32` scale tensor `<name>.qs`; the
//! encoding follows from the byte counts against the expected `[O, I]`
//! ([`infer_quant_kind`]). Norms, routers and `e_score_correction_bias` are plain F32.
//! A routed expert's six tensors (gate/up/down payloads and scales) lie adjacent, so one
//! expert is one read: [`ColibriExpert::cover_offset`]/[`ColibriExpert::cover_len`] is the
//! [`ALIGN`]-aligned range covering them (O_DIRECT-safe), and the expert's
//! [`ExpertLayout`] gives where each tensor lies inside a slot filled by that read. The
//! tier's slot size is the largest covering range over its experts.
//!
//! The dense weights load through [`WeightStore`], which dequantizes `<name>` +
//! `<name>.qs` on the fly.

use crate::checksum::ReadCheck;
use crate::container::{ExpertLayout, ExpertRead, MatrixLayout, ALIGN};
use crate::io::ReadSegment;
use crate::safetensors_file::TensorRef;
use crate::store::{list_safetensors, WeightStore};
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};
use strata_kernels::{ElementType, QuantKind};

/// Suffix of a payload's scale tensor.
pub const QS_SUFFIX: &str = ".qs";

/// The encoding of a `[rows, cols]` weight stored as `payload_bytes` bytes with
/// `scale_count` f32 scales:
/// - `rows*cols` bytes: int8, one scale per row (`rows` scales);
/// - `rows*ceil(cols/2)` bytes: int4; `rows*n` scales give groups of
///   `gs = ceil(cols/n)` inputs (`n == 1`: per-row, reported as `int4(cols)`).
///
/// The error names the byte counts when the geometry matches no encoding.
pub fn infer_quant_kind(
    rows: usize,
    cols: usize,
    payload_bytes: usize,
    scale_count: usize,
) -> Result<QuantKind, String> {
    let shape = format!("[{rows}, {cols}]");
    if rows == 0 || cols == 0 {
        return Err(format!("empty expected shape {shape}"));
    }
    let int8 = rows * cols;
    let int4 = rows * cols.div_ceil(2);
    if payload_bytes == int8 && cols > 1 {
        if scale_count != rows {
            return Err(format!(
                "payload of {payload_bytes} bytes is int8 for {shape}, which needs {rows} row scales, but there are {scale_count}"
            ));
        }
        return Ok(QuantKind::Int8Row);
    }
    if payload_bytes == int4 {
        if scale_count == 0 || !scale_count.is_multiple_of(rows) {
            return Err(format!(
                "payload of {payload_bytes} bytes is int4 for {shape}, but {scale_count} scales is not a positive multiple of {rows} rows"
            ));
        }
        let per_row = scale_count / rows;
        let group = cols.div_ceil(per_row);
        if per_row > cols || cols.div_ceil(group) != per_row {
            return Err(format!(
                "payload of {payload_bytes} bytes is int4 for {shape}, but {per_row} scales per row fit no group size"
            ));
        }
        return Ok(QuantKind::int4(group));
    }
    Err(format!(
        "payload of {payload_bytes} bytes with {scale_count} scales matches no encoding of {shape} \
         (int8 needs {int8} bytes, int4 needs {int4})"
    ))
}

/// The dimensions of a GLM-5 MoE model that the container layout depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GlmDims {
    pub hidden: usize,
    pub moe_inter: usize,
    pub n_experts: usize,
    /// Model layer ids with routed experts.
    pub sparse_layers: Vec<usize>,
    /// MTP layer ids (`num_hidden_layers ..`), looked for in `out-mtp-*`.
    pub mtp_layers: Vec<usize>,
}

impl GlmDims {
    /// From a `config.json` value: `hidden_size`, `moe_intermediate_size`,
    /// `n_routed_experts`, `num_hidden_layers`, the sparse layers from `mlp_layer_types`
    /// (else `first_k_dense_replace`), `num_nextn_predict_layers` (default 1).
    pub fn from_config(cfg: &serde_json::Value) -> Result<Self> {
        let num = |k: &str| -> Result<usize> {
            cfg.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| anyhow!("config: missing or non-integer `{k}`"))
        };
        let layers = num("num_hidden_layers")?;
        let sparse_layers = match cfg.get("mlp_layer_types").and_then(|v| v.as_array()) {
            Some(types) => {
                types.iter().enumerate().filter(|(_, t)| t.as_str() == Some("sparse")).map(|(i, _)| i).collect()
            }
            None => (num("first_k_dense_replace").unwrap_or(0)..layers).collect(),
        };
        let nextn = cfg.get("num_nextn_predict_layers").and_then(|v| v.as_u64()).unwrap_or(1) as usize;
        Ok(Self {
            hidden: num("hidden_size")?,
            moe_inter: num("moe_intermediate_size")?,
            n_experts: num("n_routed_experts")?,
            sparse_layers,
            mtp_layers: (layers..layers + nextn).collect(),
        })
    }

    /// From `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display()))?;
        Self::from_config(&json).map_err(|e| anyhow!("{}: {e}", path.display()))
    }
}

/// Which part of the model a container file holds, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColibriFamily {
    Main,
    Mtp,
    Indexer,
}

#[derive(Clone, Debug)]
pub struct ColibriFile {
    pub path: PathBuf,
    pub family: ColibriFamily,
    pub len: u64,
}

/// A byte range of one tensor in a container file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSpan {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
}

/// One routed expert in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColibriExpert {
    pub layer: usize,
    pub expert: usize,
    /// gate, up, down.
    pub kinds: [QuantKind; 3],
    /// gate payload, gate scales, up payload, up scales, down payload, down scales.
    pub tensors: [TensorSpan; 6],
    /// The file of all six tensors.
    pub file: usize,
    /// [`ALIGN`]-aligned start of the covering read.
    pub cover_offset: u64,
    /// Covering read length, a multiple of [`ALIGN`] (may pass the end of the file by
    /// less than a page; the I/O pool reads that overhang as zeros).
    pub cover_len: usize,
    /// Where the matrices lie in a slot filled from `cover_offset`; `slot_bytes` is the
    /// tier's slot size.
    pub layout: ExpertLayout,
}

impl ColibriExpert {
    /// The covering read into a slot starting at `dest_offset`: one O_DIRECT-safe segment.
    pub fn cover_segment(&self, dest_offset: usize) -> ReadSegment {
        ReadSegment { file: self.file, offset: self.cover_offset, len: self.cover_len, dest_offset }
    }

    /// The tensors' bytes only (adjacent tensors merged), each placed where `layout` expects
    /// it in a slot starting at `dest_offset`: fewer bytes than the covering read, but not
    /// page-aligned (the I/O pool serves them buffered).
    pub fn exact_segments(&self, dest_offset: usize) -> Vec<ReadSegment> {
        let mut spans: Vec<TensorSpan> = self.tensors.to_vec();
        spans.sort_by_key(|s| s.offset);
        let mut out: Vec<ReadSegment> = Vec::with_capacity(6);
        for s in spans {
            let dest = dest_offset + (s.offset - self.cover_offset) as usize;
            match out.last_mut() {
                Some(last) if last.offset + last.len as u64 == s.offset => last.len += s.len,
                _ => out.push(ReadSegment { file: s.file, offset: s.offset, len: s.len, dest_offset: dest }),
            }
        }
        out
    }

    /// Where the six tensors lie in a slot filled by the covering read, as
    /// `(offset, len)` in file order: the bytes the checksum covers.
    pub fn tensor_ranges(&self) -> Vec<(usize, usize)> {
        let mut spans = self.tensors.to_vec();
        spans.sort_by_key(|s| s.offset);
        spans.iter().map(|s| ((s.offset - self.cover_offset) as usize, s.len)).collect()
    }

    /// Bytes of the six tensors.
    pub fn used_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

/// The experts of one tier ("main": the sparse layers; "mtp": the MTP layer).
#[derive(Clone, Debug)]
pub struct ColibriTier {
    pub name: String,
    pub layers: Vec<usize>,
    pub experts_per_layer: usize,
    /// The largest covering read over the tier's experts: the slot size.
    pub slot_bytes: usize,
    /// `[layer_index * experts_per_layer + expert]`.
    pub experts: Vec<ColibriExpert>,
    /// Checksums of the experts' covering reads, in `experts` order: empty until
    /// [`ColibriContainer::ensure_checksums`] loads or computes them.
    pub checksums: Vec<u64>,
}

impl ColibriTier {
    pub fn expert(&self, layer: usize, expert: usize) -> Option<&ColibriExpert> {
        let li = self.layers.iter().position(|&l| l == layer)?;
        (expert < self.experts_per_layer).then(|| &self.experts[li * self.experts_per_layer + expert])
    }

    /// The reads that fill a slot (from offset 0) with (layer, expert) — the one covering,
    /// O_DIRECT-safe segment — and where the matrices lie in it. Same signature as
    /// [`TierEntry::locate`](crate::TierEntry::locate).
    pub fn locate(&self, layer: usize, expert: usize) -> Result<(Vec<ReadSegment>, &ExpertLayout)> {
        let e = self
            .expert(layer, expert)
            .ok_or_else(|| anyhow!("tier `{}` has no expert {expert} in layer {layer}", self.name))?;
        Ok((vec![e.cover_segment(0)], &e.layout))
    }

    /// What the covering read of (layer, expert) must hash to (None before
    /// [`ColibriContainer::ensure_checksums`]).
    pub fn read_check(&self, layer: usize, expert: usize) -> Option<ReadCheck> {
        let li = self.layers.iter().position(|&l| l == layer)?;
        let i = (expert < self.experts_per_layer).then_some(li * self.experts_per_layer + expert)?;
        let sum = *self.checksums.get(i)?;
        Some(ReadCheck::new(sum, format!("layer {layer} expert {expert}")).with_ranges(self.experts[i].tensor_ranges()))
    }

    /// The encodings (gate, up, down) when every expert of the tier has the same.
    pub fn uniform_kinds(&self) -> Option<[QuantKind; 3]> {
        let first = self.experts.first()?.kinds;
        self.experts.iter().all(|e| e.kinds == first).then_some(first)
    }

    /// Bytes of all experts' tensors.
    pub fn used_bytes(&self) -> u64 {
        self.experts.iter().map(|e| e.used_bytes() as u64).sum()
    }
}

/// A Colibri-layout container opened in place: headers only.
pub struct ColibriContainer {
    dir: PathBuf,
    files: Vec<ColibriFile>,
    tiers: Vec<ColibriTier>,
    store: WeightStore,
}

fn family_of(path: &Path) -> ColibriFamily {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.starts_with("out-mtp-") {
        ColibriFamily::Mtp
    } else if name.starts_with("out-idx-") {
        ColibriFamily::Indexer
    } else {
        ColibriFamily::Main
    }
}

impl ColibriContainer {
    /// Whether `dir` looks like a Colibri-layout container (`out-*.safetensors`).
    pub fn detect(dir: &Path) -> bool {
        list_safetensors(dir, "out-").is_ok_and(|v| !v.is_empty())
    }

    /// Opens `dir` (headers only) and locates every routed expert of `dims`: the main tier
    /// always, the MTP tier when the container has its experts. Fails naming the tensor
    /// when one is missing, has the wrong dtype, or its geometry matches no encoding.
    pub fn open(dir: &Path, dims: &GlmDims) -> Result<Self> {
        let paths = list_safetensors(dir, "out-")?;
        if paths.is_empty() {
            bail!("{}: no out-*.safetensors files: not a Colibri-layout container", dir.display());
        }
        let store = WeightStore::open_files(&paths)?;
        let files = paths
            .iter()
            .map(|p| {
                let len = std::fs::metadata(p).with_context(|| format!("{}: cannot stat", p.display()))?.len();
                Ok(ColibriFile { path: p.clone(), family: family_of(p), len })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut me = Self { dir: dir.to_path_buf(), files, tiers: Vec::new(), store };
        let main = me.build_tier("main", &dims.sparse_layers, dims)?;
        me.tiers.push(main);
        let has_mtp = dims
            .mtp_layers
            .first()
            .is_some_and(|&l| me.store.contains(&format!("model.layers.{l}.mlp.experts.0.gate_proj.weight")));
        if has_mtp {
            let mtp = me.build_tier("mtp", &dims.mtp_layers, dims)?;
            me.tiers.push(mtp);
        }
        Ok(me)
    }

    fn tensor(&self, name: &str, want: &[ElementType]) -> Result<(usize, &TensorRef)> {
        let (file, t) = self
            .store
            .locate(name)
            .ok_or_else(|| anyhow!("{}: Colibri container has no tensor `{name}`", self.dir.display()))?;
        if !want.contains(&t.dtype) {
            bail!("{}: tensor `{name}` is {:?}, expected {:?}", self.files[file].path.display(), t.dtype, want);
        }
        Ok((file, t))
    }

    fn build_tier(&self, name: &str, layers: &[usize], dims: &GlmDims) -> Result<ColibriTier> {
        let (h, inter) = (dims.hidden, dims.moe_inter);
        let mut experts = Vec::with_capacity(layers.len() * dims.n_experts);
        for &layer in layers {
            for e in 0..dims.n_experts {
                let mut kinds = [QuantKind::F32; 3];
                let mut spans = [TensorSpan { file: 0, offset: 0, len: 0 }; 6];
                for (i, (proj, rows, cols)) in
                    [("gate", inter, h), ("up", inter, h), ("down", h, inter)].into_iter().enumerate()
                {
                    let pname = format!("model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight");
                    let qname = format!("{pname}{QS_SUFFIX}");
                    let (pf, p) = self.tensor(&pname, &[ElementType::U8, ElementType::I8])?;
                    let (qf, q) = self.tensor(&qname, &[ElementType::F32])?;
                    kinds[i] = infer_quant_kind(rows, cols, p.byte_len(), q.numel())
                        .map_err(|err| anyhow!("{}: tensor `{pname}`: {err}", self.files[pf].path.display()))?;
                    spans[2 * i] = TensorSpan { file: pf, offset: p.start as u64, len: p.byte_len() };
                    spans[2 * i + 1] = TensorSpan { file: qf, offset: q.start as u64, len: q.byte_len() };
                }
                let file = spans[0].file;
                if spans.iter().any(|s| s.file != file) {
                    bail!(
                        "layer {layer} expert {e}: tensors are split across {} and other files; one expert must be one read",
                        self.files[file].path.display()
                    );
                }
                let start = spans.iter().map(|s| s.offset).min().unwrap();
                let end = spans.iter().map(|s| s.offset + s.len as u64).max().unwrap();
                let cover_offset = start / ALIGN * ALIGN;
                let cover_len = ((end - cover_offset).div_ceil(ALIGN) * ALIGN) as usize;
                let at = |s: &TensorSpan| (s.offset - cover_offset) as usize;
                let mats: Vec<MatrixLayout> = (0..3)
                    .map(|i| {
                        let (rows, cols) = if i < 2 { (inter, h) } else { (h, inter) };
                        MatrixLayout::new(kinds[i], rows, cols, at(&spans[2 * i]), at(&spans[2 * i + 1]))
                    })
                    .collect();
                let layout = ExpertLayout { gate: mats[0], up: mats[1], down: mats[2], slot_bytes: cover_len };
                layout.check_fits().map_err(|err| anyhow!("layer {layer} expert {e}: {err}"))?;
                experts.push(ColibriExpert {
                    layer,
                    expert: e,
                    kinds,
                    tensors: spans,
                    file,
                    cover_offset,
                    cover_len,
                    layout,
                });
            }
        }
        let slot_bytes = experts.iter().map(|e| e.cover_len).max().unwrap_or(0);
        for e in &mut experts {
            e.layout.slot_bytes = slot_bytes;
        }
        Ok(ColibriTier {
            name: name.to_string(),
            layers: layers.to_vec(),
            experts_per_layer: dims.n_experts,
            slot_bytes,
            experts,
            checksums: Vec::new(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every `out-*` file, in [`ReadSegment::file`] order (open an
    /// [`IoPool`](crate::IoPool) over [`file_paths`](Self::file_paths)).
    pub fn files(&self) -> &[ColibriFile] {
        &self.files
    }

    pub fn file_paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }

    /// The headers as a [`WeightStore`] (the dense weights load through it).
    pub fn store(&self) -> &WeightStore {
        &self.store
    }

    pub fn tiers(&self) -> &[ColibriTier] {
        &self.tiers
    }

    pub(crate) fn tiers_mut(&mut self) -> &mut [ColibriTier] {
        &mut self.tiers
    }

    pub fn tier(&self, name: &str) -> Option<&ColibriTier> {
        self.tiers.iter().find(|t| t.name == name)
    }

    pub fn expert(&self, tier: &str, layer: usize, expert: usize) -> Option<&ColibriExpert> {
        self.tier(tier)?.expert(layer, expert)
    }

    /// The read of (layer, expert) of `tier` into a slot: the one covering segment.
    pub fn expert_read(&self, tier: &str, layer: usize, expert: usize) -> Result<ExpertRead> {
        let t =
            self.tier(tier).ok_or_else(|| anyhow!("{}: the container has no `{tier}` experts", self.dir.display()))?;
        let e =
            t.expert(layer, expert).ok_or_else(|| anyhow!("tier `{tier}` has no expert {expert} in layer {layer}"))?;
        Ok(ExpertRead { segments: vec![e.cover_segment(0)], layout: e.layout })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::container::{ContainerWriter, ExpertManifest, TierSpec};
    use crate::io::{AlignedBuf, IoPool};
    use crate::writer::{SafetensorsWriter, TensorSpec};
    use strata_kernels::{dequantize, quantize};

    #[test]
    fn geometry_inference() {
        assert_eq!(infer_quant_kind(16, 64, 1024, 16), Ok(QuantKind::Int8Row));
        assert_eq!(infer_quant_kind(16, 64, 512, 16), Ok(QuantKind::int4(64)));
        assert_eq!(infer_quant_kind(16, 64, 512, 64), Ok(QuantKind::int4(16)));
        assert_eq!(infer_quant_kind(2048, 6144, 2048 * 3072, 2048 * 96), Ok(QuantKind::int4(64)));
        assert_eq!(infer_quant_kind(6144, 2048, 6144 * 1024, 6144 * 16), Ok(QuantKind::int4(128)));
        // Odd column count: ceil(I/2) bytes per row.
        assert_eq!(infer_quant_kind(3, 7, 12, 3), Ok(QuantKind::int4(7)));
        let err = infer_quant_kind(16, 64, 700, 16).unwrap_err();
        assert!(err.contains("700 bytes") && err.contains("int8 needs 1024 bytes, int4 needs 512"), "{err}");
        let err = infer_quant_kind(16, 64, 1024, 32).unwrap_err();
        assert!(err.contains("needs 16 row scales, but there are 32"), "{err}");
        let err = infer_quant_kind(16, 64, 512, 24).unwrap_err();
        assert!(err.contains("24 scales is not a positive multiple of 16"), "{err}");
        assert!(infer_quant_kind(16, 64, 512, 16 * 65).is_err());
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn weights(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 1999) as f32 / 999.5) - 1.0).collect()
    }

    /// A synthetic container: one main file with 2 sparse layers x 3 experts (int4 g8),
    /// one MTP file (int8), a dense int8 tensor and an F32 norm.
    pub(crate) type Originals = Vec<((usize, usize), [Vec<f32>; 3])>;

    pub(crate) fn synthetic(dir: &Path) -> (GlmDims, Originals) {
        let dims = GlmDims { hidden: 24, moe_inter: 8, n_experts: 3, sparse_layers: vec![1, 2], mtp_layers: vec![3] };
        let mut originals = Vec::new();
        let mut write = |path: &Path, layers: &[usize], kind: QuantKind, extra: bool| {
            let mut specs = Vec::new();
            let mut blobs: Vec<Vec<u8>> = Vec::new();
            if extra {
                let w = weights(5 * 24, 99);
                let (p, s) = quantize(QuantKind::Int8Row, &w, 5, 24);
                specs.push(TensorSpec { name: "dense.weight".into(), dtype: ElementType::U8, shape: vec![5, 24] });
                specs.push(TensorSpec { name: "dense.weight.qs".into(), dtype: ElementType::F32, shape: vec![5] });
                specs.push(TensorSpec { name: "norm.weight".into(), dtype: ElementType::F32, shape: vec![3] });
                blobs.extend([p, f32_bytes(&s), f32_bytes(&[1.0, 2.0, 3.0])]);
            }
            for &l in layers {
                for e in 0..3 {
                    let mut orig: Vec<Vec<f32>> = Vec::new();
                    for (proj, rows, cols) in [("gate", 8, 24), ("up", 8, 24), ("down", 24, 8)] {
                        let w = weights(rows * cols, l * 100 + e * 10 + rows);
                        let (p, s) = quantize(kind, &w, rows, cols);
                        let name = format!("model.layers.{l}.mlp.experts.{e}.{proj}_proj.weight");
                        specs.push(TensorSpec { name: name.clone(), dtype: ElementType::U8, shape: vec![p.len()] });
                        specs.push(TensorSpec {
                            name: format!("{name}.qs"),
                            dtype: ElementType::F32,
                            shape: vec![s.len()],
                        });
                        blobs.extend([p, f32_bytes(&s)]);
                        orig.push(w);
                    }
                    originals.push(((l, e), [orig[0].clone(), orig[1].clone(), orig[2].clone()]));
                }
            }
            let mut w = SafetensorsWriter::create(path, specs).unwrap();
            for b in blobs {
                w.write_next(&b).unwrap();
            }
            w.finish().unwrap();
        };
        write(&dir.join("out-00000.safetensors"), &[1, 2], QuantKind::int4(8), true);
        write(&dir.join("out-mtp-00000.safetensors"), &[3], QuantKind::Int8Row, false);
        (dims, originals)
    }

    #[test]
    fn synthetic_container_reads_back_through_the_pool() {
        let dir = tempfile::tempdir().unwrap();
        let (dims, originals) = synthetic(dir.path());
        let c = ColibriContainer::open(dir.path(), &dims).unwrap();
        assert_eq!(c.files().len(), 2);
        assert_eq!(c.files()[1].family, ColibriFamily::Mtp);
        let main = c.tier("main").unwrap();
        let mtp = c.tier("mtp").unwrap();
        let g8 = QuantKind::int4(8);
        assert_eq!(main.uniform_kinds(), Some([g8, g8, g8]));
        assert_eq!(mtp.uniform_kinds(), Some([QuantKind::Int8Row; 3]));
        assert_eq!(main.slot_bytes % 4096, 0);
        for direct in [true, false] {
            let pool = IoPool::open(&c.file_paths(), 2, direct).unwrap();
            for ((l, e), orig) in &originals {
                let tier = if *l == 3 { "mtp" } else { "main" };
                let kind = if *l == 3 { QuantKind::Int8Row } else { g8 };
                let read = c.expert_read(tier, *l, *e).unwrap();
                let (segs, lay) = c.tier(tier).unwrap().locate(*l, *e).unwrap();
                assert_eq!((&segs, lay), (&read.segments, &read.layout));
                let mut slot = AlignedBuf::new(read.layout.slot_bytes).unwrap();
                pool.read(read.segments.clone(), slot.as_mut_slice()).unwrap();
                // The exact (tensor-only) segments land at the same places.
                let mut slot2 = AlignedBuf::new(read.layout.slot_bytes).unwrap();
                let exact = c.expert(tier, *l, *e).unwrap().exact_segments(0);
                assert_eq!(exact.len(), 1, "six adjacent tensors coalesce: {exact:?}");
                pool.read(exact, slot2.as_mut_slice()).unwrap();
                for (m, w) in read.layout.matrices().into_iter().zip(orig) {
                    let (p, s) = quantize(kind, w, m.rows, m.cols);
                    let want = dequantize(kind, &p, &s, m.rows, m.cols);
                    assert_eq!(m.dequantize(slot.as_slice()).unwrap(), want);
                    assert_eq!(m.dequantize(slot2.as_slice()).unwrap(), want);
                }
            }
        }
        // Dense weights load through the store, dequantized.
        let store = WeightStore::open_dir(dir.path()).unwrap();
        let (p, s) = quantize(QuantKind::Int8Row, &weights(5 * 24, 99), 5, 24);
        assert_eq!(
            store.load_f32("dense.weight", &[5, 24], None).unwrap(),
            dequantize(QuantKind::Int8Row, &p, &s, 5, 24)
        );
        assert_eq!(store.load_f32("norm.weight", &[3], None).unwrap(), vec![1.0, 2.0, 3.0]);
        let err = store.load_f32("dense.weight", &[5, 25], None).unwrap_err().to_string();
        assert!(err.contains("tensor `dense.weight`") && err.contains("120 bytes"), "{err}");
        let err = store.load_f32("dense.weight", &[120], None).unwrap_err().to_string();
        assert!(err.contains("not a 2-D matrix"), "{err}");
    }

    #[test]
    fn bad_containers_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = ColibriContainer::open(
            dir.path(),
            &GlmDims { hidden: 24, moe_inter: 8, n_experts: 3, sparse_layers: vec![1], mtp_layers: vec![] },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("no out-*.safetensors"), "{err}");
        let (mut dims, _) = synthetic(dir.path());
        dims.n_experts = 4;
        let err = ColibriContainer::open(dir.path(), &dims).err().unwrap().to_string();
        assert!(err.contains("no tensor `model.layers.1.mlp.experts.3.gate_proj.weight`"), "{err}");
        dims.n_experts = 3;
        dims.moe_inter = 9;
        let err = ColibriContainer::open(dir.path(), &dims).err().unwrap().to_string();
        assert!(err.contains("out-00000.safetensors: tensor `model.layers.1.mlp.experts.0.gate_proj.weight`"), "{err}");
        assert!(err.contains("matches no encoding of [9, 24]"), "{err}");
    }

    // ---- the fixture made by scripts/make_colibri_fixture.py ----

    fn repo_path(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
    }

    #[test]
    fn fixture_experts_match_quantized_originals_and_strata_container() {
        let src = repo_path("fixtures/glm5/dsa-sparse");
        let dir = repo_path("fixtures/colibri/dsa-sparse-int4");
        let dims = GlmDims::from_dir(&dir).unwrap();
        assert_eq!(dims.sparse_layers, vec![1, 2, 3, 4]);
        let c = ColibriContainer::open(&dir, &dims).unwrap();
        assert!(c.tier("mtp").is_none());
        assert!(c.files().iter().any(|f| f.family == ColibriFamily::Indexer));
        let main = c.tier("main").unwrap();
        let (g16, h, inter) = (QuantKind::int4(16), dims.hidden, dims.moe_inter);
        assert_eq!(main.uniform_kinds(), Some([g16, g16, g16]));
        assert_eq!(main.experts.len(), 4 * 16);
        assert_eq!(main.slot_bytes % 4096, 0);
        let orig = WeightStore::open_dir(&src).unwrap();

        // strata's own container from the same quantized values.
        let out = tempfile::tempdir().unwrap();
        let layout = ExpertLayout::new(g16, g16, h, inter);
        let mut w = ContainerWriter::create(
            out.path(),
            vec![TierSpec { name: "main".into(), layout, layers: dims.sparse_layers.clone(), experts_per_layer: 16 }],
        )
        .unwrap();
        let shapes = [(inter, h), (inter, h), (h, inter)];
        let mut want_all = Vec::new();
        for &l in &dims.sparse_layers {
            for e in 0..16 {
                let mut q = Vec::new();
                for (proj, (rows, cols)) in ["gate", "up", "down"].iter().zip(shapes) {
                    let wt = orig
                        .load_f32(&format!("model.layers.{l}.mlp.experts.{e}.{proj}_proj.weight"), &[rows, cols], None)
                        .unwrap();
                    q.push(quantize(g16, &wt, rows, cols));
                }
                w.add_expert("main", l, e, [(&q[0].0, &q[0].1), (&q[1].0, &q[1].1), (&q[2].0, &q[2].1)]).unwrap();
                want_all.push(((l, e), q));
            }
        }
        let manifest = w.finish().unwrap();
        assert_eq!(ExpertManifest::read(out.path()).unwrap(), manifest);
        let cpool = IoPool::open(&c.file_paths(), 2, true).unwrap();
        let spool = IoPool::open(&manifest.file_paths(out.path()), 2, true).unwrap();
        for ((l, e), q) in &want_all {
            let cr = c.expert_read("main", *l, *e).unwrap();
            let sr = manifest.expert_read("main", *l, *e).unwrap();
            let mut cslot = AlignedBuf::new(cr.layout.slot_bytes).unwrap();
            let mut sslot = AlignedBuf::new(sr.layout.slot_bytes).unwrap();
            cpool.read(cr.segments.clone(), cslot.as_mut_slice()).unwrap();
            spool.read(sr.segments.clone(), sslot.as_mut_slice()).unwrap();
            for (i, (rows, cols)) in shapes.into_iter().enumerate() {
                let want = dequantize(g16, &q[i].0, &q[i].1, rows, cols);
                let cm = cr.layout.matrices()[i];
                let sm = sr.layout.matrices()[i];
                assert_eq!(cm.payload(cslot.as_slice()).unwrap(), &q[i].0[..], "layer {l} expert {e} matrix {i}");
                assert_eq!(cm.scales(cslot.as_slice()).unwrap().to_vec(), q[i].1);
                assert_eq!(cm.dequantize(cslot.as_slice()).unwrap(), want);
                assert_eq!(sm.dequantize(sslot.as_slice()).unwrap(), want);
            }
        }
    }

    #[test]
    fn fixture_dense_weights_load_dequantized() {
        let src = repo_path("fixtures/glm5/dsa-sparse");
        let dir = repo_path("fixtures/colibri/dsa-sparse-int4");
        let orig = WeightStore::open_dir(&src).unwrap();
        let store = WeightStore::open_dir(&dir).unwrap();
        assert_eq!(store.files().count(), 3);
        let mut checked = 0;
        for name in orig.names() {
            let shape = orig.shape(name).unwrap();
            let w = orig.load_f32(name, &shape, None).unwrap();
            let got = store.load_f32(name, &shape, None).unwrap();
            let f32_kept = shape.len() != 2 || name.ends_with("mlp.gate.weight");
            let want = if f32_kept {
                assert!(store.quant_kind(name, 1, 1).is_none(), "{name}");
                w
            } else {
                let kind = if name.contains(".mlp.experts.") { QuantKind::int4(16) } else { QuantKind::Int8Row };
                assert_eq!(store.quant_kind(name, shape[0], shape[1]).unwrap().unwrap(), kind, "{name}");
                let (p, s) = quantize(kind, &w, shape[0], shape[1]);
                dequantize(kind, &p, &s, shape[0], shape[1])
            };
            assert_eq!(got, want, "{name}");
            checked += 1;
        }
        assert_eq!(checked, orig.names().count());
        assert!(store.stored_bytes("lm_head.weight") == 512 * 64 + 512 * 4);
    }
}
