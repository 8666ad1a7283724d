//! strata's expert container: a model directory plus
//!
//! ```text
//! strata-experts.json           the manifest (versioned JSON, written atomically)
//! experts/experts-NNNNN.bin     regions of the "main" tier (all sparse layers)
//! experts/experts-mtp-NNNNN.bin regions of the "mtp" tier (the MTP layer)
//! ```
//!
//! Every expert is one contiguous region of `slot_bytes` (a multiple of [`ALIGN`], the same
//! for every expert of a tier) at an [`ALIGN`]-aligned file offset, so one O_DIRECT read
//! of one segment fills one slab slot. Inside a region: gate payload, gate scales, up
//! payload, up scales, down payload, down scales, each starting [`TENSOR_ALIGN`]-aligned,
//! zero padding after. gate/up are `[moe_inter, hidden]`, down is `[hidden, moe_inter]`;
//! encodings are `strata_kernels::QuantKind`'s. Every size and offset is in the manifest:
//! nothing needs reading from the expert files to plan.

use crate::checksum::{region_checksum, ReadCheck};
use crate::io::ReadSegment;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use strata_kernels::{decode_scales, dequantize, encode_scales, QuantKind, ScaleType, Scales};

pub const MANIFEST_FILE: &str = "strata-experts.json";
/// Folder of the expert files, relative to the model directory.
pub const EXPERTS_DIR: &str = "experts";
/// Region (and file offset) alignment: O_DIRECT-safe.
pub const ALIGN: u64 = 4096;
/// Alignment of each payload and scale array inside a region.
pub const TENSOR_ALIGN: usize = 64;
/// The manifest version this build writes and the newest it reads.
pub const MANIFEST_VERSION: u32 = 1;
/// The `format` tag of a manifest.
pub const MANIFEST_FORMAT: &str = "strata-experts";
/// Largest matrix a layout may describe (elements): far beyond any model, small enough
/// that no size computed from it overflows.
pub const MAX_MATRIX_ELEMENTS: usize = 1 << 40;
/// Default cap on one expert file's size (a new file starts beyond it).
pub const DEFAULT_MAX_FILE_BYTES: u64 = 8 << 30;

/// Where one matrix lies inside a slot (byte offsets from the start of the slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatrixLayout {
    #[serde(with = "kind_serde")]
    pub kind: QuantKind,
    pub rows: usize,
    pub cols: usize,
    pub payload_offset: usize,
    pub payload_len: usize,
    /// Byte offset of the scales (f32; bf16 for `int4-gN-bf16`; for `int4-gN-e4m3` an
    /// f32 factor, then a byte a scale).
    pub scales_offset: usize,
    /// Bytes of scales (see [`ScaleType::region_bytes`]).
    pub scales_len: usize,
}

impl MatrixLayout {
    /// Expected sizes for `kind` at `payload_offset` and `scales_offset`.
    pub fn new(kind: QuantKind, rows: usize, cols: usize, payload_offset: usize, scales_offset: usize) -> Self {
        Self {
            kind,
            rows,
            cols,
            payload_offset,
            payload_len: kind.payload_bytes(rows, cols),
            scales_offset,
            scales_len: kind.scale_bytes(rows, cols),
        }
    }

    /// One past the last byte used.
    /// Saturates (a layout read from a manifest may hold any numbers; a saturated end
    /// never fits a slot).
    pub fn end(&self) -> usize {
        self.payload_offset.saturating_add(self.payload_len).max(self.scales_offset.saturating_add(self.scales_len))
    }

    pub fn scale_count(&self) -> usize {
        self.kind.scale_type().count(self.scales_len)
    }

    /// The payload bytes inside a slot.
    pub fn payload<'a>(&self, slot: &'a [u8]) -> Result<&'a [u8]> {
        slot.get(self.payload_offset..self.payload_offset.saturating_add(self.payload_len)).ok_or_else(|| {
            anyhow!(
                "matrix payload {}..{} lies outside the {}-byte slot",
                self.payload_offset,
                self.payload_offset + self.payload_len,
                slot.len()
            )
        })
    }

    /// The scales inside a slot, borrowed in place: the slot's address plus
    /// `scales_offset` must be aligned to the scale type (always so in strata's container
    /// read into an aligned buffer; see [`scales_vec`](Self::scales_vec) otherwise).
    pub fn scales<'a>(&self, slot: &'a [u8]) -> Result<Scales<'a>> {
        let bytes = self.scale_bytes(slot)?;
        let misaligned = || anyhow!("matrix scales at slot offset {} are not aligned in memory", self.scales_offset);
        // SAFETY: every bit pattern is a valid f32 / u16; alignment is checked by align_to.
        match self.kind.scale_type() {
            ScaleType::F32 => match unsafe { bytes.align_to::<f32>() } {
                ([], s, []) => Ok(Scales::F32(s)),
                _ => Err(misaligned()),
            },
            ScaleType::Bf16 => match unsafe { bytes.align_to::<u16>() } {
                ([], s, []) => Ok(Scales::Bf16(s)),
                _ => Err(misaligned()),
            },
            // Bytes at any address; the factor is read as little-endian bytes.
            ScaleType::E4m3 => Scales::e4m3(bytes).ok_or_else(|| anyhow!("e4m3 scales shorter than their factor")),
            ScaleType::E8m0 => Ok(Scales::E8m0(bytes)),
        }
    }

    fn scale_bytes<'a>(&self, slot: &'a [u8]) -> Result<&'a [u8]> {
        slot.get(self.scales_offset..self.scales_offset.saturating_add(self.scales_len)).ok_or_else(|| {
            anyhow!(
                "matrix scales {}..{} lie outside the {}-byte slot",
                self.scales_offset,
                self.scales_offset + self.scales_len,
                slot.len()
            )
        })
    }

    /// The scales as f32 values, copied out (any alignment).
    pub fn scales_vec(&self, slot: &[u8]) -> Result<Vec<f32>> {
        Ok(decode_scales(self.kind, self.scale_bytes(slot)?))
    }

    /// The matrix as f32 values (reference decoder).
    pub fn dequantize(&self, slot: &[u8]) -> Result<Vec<f32>> {
        let scales = self.scales_vec(slot)?;
        Ok(dequantize(self.kind, self.payload(slot)?, &scales, self.rows, self.cols))
    }

    fn check_sizes(&self) -> Result<(), String> {
        // Bound the shape first: the encodings' size formulas assume it fits.
        if self.rows.checked_mul(self.cols).is_none_or(|n| n > MAX_MATRIX_ELEMENTS) {
            return Err(format!(
                "{} [{}, {}] has more than {MAX_MATRIX_ELEMENTS} elements",
                self.kind.name(),
                self.rows,
                self.cols
            ));
        }
        let (p, s) = (self.kind.payload_bytes(self.rows, self.cols), self.kind.scale_bytes(self.rows, self.cols));
        if self.payload_len != p || self.scales_len != s {
            return Err(format!(
                "{} [{}, {}] needs {p} payload bytes and {s} scale bytes, the layout says {} and {}",
                self.kind.name(),
                self.rows,
                self.cols,
                self.payload_len,
                self.scales_len
            ));
        }
        Ok(())
    }
}

/// The three matrices of one expert inside a slot of `slot_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertLayout {
    pub gate: MatrixLayout,
    pub up: MatrixLayout,
    pub down: MatrixLayout,
    /// Slot (region) size: a multiple of [`ALIGN`]; the same for every expert of a tier.
    pub slot_bytes: usize,
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl ExpertLayout {
    /// strata's packed layout of a SwiGLU expert: gate/up `[moe_inter, hidden]` encoded
    /// as `gate_up`, down `[hidden, moe_inter]` encoded as `down`.
    pub fn new(gate_up: QuantKind, down: QuantKind, hidden: usize, moe_inter: usize) -> Self {
        Self::packed([(gate_up, moe_inter, hidden), (gate_up, moe_inter, hidden), (down, hidden, moe_inter)])
    }

    /// Packs `[(kind, rows, cols); 3]` (gate, up, down) in order, every array
    /// [`TENSOR_ALIGN`]-aligned, the region rounded up to [`ALIGN`].
    pub fn packed(mats: [(QuantKind, usize, usize); 3]) -> Self {
        let mut at = 0usize;
        let mut out = [None; 3];
        for (i, (kind, rows, cols)) in mats.into_iter().enumerate() {
            let p = align_up(at, TENSOR_ALIGN);
            let s = align_up(p + kind.payload_bytes(rows, cols), TENSOR_ALIGN);
            let m = MatrixLayout::new(kind, rows, cols, p, s);
            at = m.scales_offset + m.scales_len;
            out[i] = Some(m);
        }
        let [gate, up, down] = out.map(Option::unwrap);
        Self { gate, up, down, slot_bytes: align_up(at.max(1), ALIGN as usize) }
    }

    /// gate, up, down.
    pub fn matrices(&self) -> [&MatrixLayout; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// Bytes actually used by payloads and scales.
    pub fn used_bytes(&self) -> usize {
        self.matrices().iter().map(|m| m.payload_len + m.scales_len).sum()
    }

    /// Sizes agree with the encodings and every array lies inside the slot.
    pub fn check_fits(&self) -> Result<(), String> {
        for (name, m) in ["gate", "up", "down"].iter().zip(self.matrices()) {
            m.check_sizes().map_err(|e| format!("{name}: {e}"))?;
            if m.end() > self.slot_bytes {
                return Err(format!("{name}: ends at byte {} of a {}-byte slot", m.end(), self.slot_bytes));
            }
        }
        Ok(())
    }

    /// [`check_fits`](Self::check_fits) plus strata's own rules: aligned arrays in order,
    /// no overlap, `slot_bytes` a multiple of [`ALIGN`].
    pub fn check_packed(&self) -> Result<(), String> {
        self.check_fits()?;
        if self.slot_bytes == 0 || !self.slot_bytes.is_multiple_of(ALIGN as usize) {
            return Err(format!("slot_bytes {} is not a positive multiple of {ALIGN}", self.slot_bytes));
        }
        let mut at = 0usize;
        for (name, m) in ["gate", "up", "down"].iter().zip(self.matrices()) {
            for (what, off, len) in
                [("payload", m.payload_offset, m.payload_len), ("scales", m.scales_offset, m.scales_len)]
            {
                if off % TENSOR_ALIGN != 0 || off < at {
                    return Err(format!("{name} {what} at byte {off}: not {TENSOR_ALIGN}-aligned or overlaps the previous array (ends at {at})"));
                }
                at = off + len;
            }
        }
        Ok(())
    }
}

/// Where one expert's region starts: `offset % ALIGN == 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "(usize, u64)", into = "(usize, u64)")]
pub struct ExpertLocation {
    /// Index into [`ExpertManifest::files`].
    pub file: usize,
    pub offset: u64,
}

impl From<(usize, u64)> for ExpertLocation {
    fn from((file, offset): (usize, u64)) -> Self {
        Self { file, offset }
    }
}

impl From<ExpertLocation> for (usize, u64) {
    fn from(l: ExpertLocation) -> Self {
        (l.file, l.offset)
    }
}

/// One tier: "main" (all sparse layers) or "mtp".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierEntry {
    pub name: String,
    pub layout: ExpertLayout,
    /// Model layer ids, in location order.
    pub layers: Vec<usize>,
    pub experts_per_layer: usize,
    /// `[layer_index * experts_per_layer + expert]`, `layer_index` = position in `layers`.
    pub locations: Vec<ExpertLocation>,
    /// [`CHECKSUM_ALGORITHM`](crate::CHECKSUM_ALGORITHM) of each whole region, in
    /// `locations` order; empty in manifests written before checksums existed (their
    /// reads are not verified).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checksums: Vec<u64>,
}

impl TierEntry {
    pub fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes
    }

    /// Saturates (a manifest may claim any counts; validation refuses the mismatch).
    pub fn expert_count(&self) -> usize {
        self.layers.len().saturating_mul(self.experts_per_layer)
    }

    /// Index into `locations` of (model layer id, expert).
    pub fn index(&self, layer: usize, expert: usize) -> Option<usize> {
        let li = self.layers.iter().position(|&l| l == layer)?;
        (expert < self.experts_per_layer).then_some(li * self.experts_per_layer + expert)
    }

    pub fn location(&self, layer: usize, expert: usize) -> Option<ExpertLocation> {
        self.index(layer, expert).map(|i| self.locations[i])
    }

    /// The reads that fill a slot (from offset 0) with (layer, expert), and where the
    /// matrices lie in it. Same signature as [`ColibriTier::locate`](crate::ColibriTier::locate).
    pub fn locate(&self, layer: usize, expert: usize) -> Result<(Vec<ReadSegment>, &ExpertLayout)> {
        let seg = self
            .read_segment(layer, expert, 0)
            .ok_or_else(|| anyhow!("tier `{}` has no expert {expert} in layer {layer}", self.name))?;
        Ok((vec![seg], &self.layout))
    }

    /// What a read of (layer, expert) must hash to (None without recorded checksums).
    pub fn read_check(&self, layer: usize, expert: usize) -> Option<ReadCheck> {
        let sum = *self.checksums.get(self.index(layer, expert)?)?;
        Some(ReadCheck::new(sum, format!("tier `{}` layer {layer} expert {expert}", self.name)))
    }

    /// The one segment that reads (layer, expert) into a slot starting at `dest_offset`.
    pub fn read_segment(&self, layer: usize, expert: usize, dest_offset: usize) -> Option<ReadSegment> {
        let loc = self.location(layer, expert)?;
        Some(ReadSegment { file: loc.file, offset: loc.offset, len: self.layout.slot_bytes, dest_offset })
    }
}

/// How to bring one expert into a slot, whatever the container: read `segments` (their
/// `dest_offset`s relative to the slot start) into a slot of at least
/// `layout.slot_bytes`, then find the matrices with `layout`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRead {
    pub segments: Vec<ReadSegment>,
    pub layout: ExpertLayout,
}

/// The manifest, `strata-experts.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertManifest {
    pub version: u32,
    /// Expert files relative to the model directory (`experts/experts-00000.bin`, ...).
    pub files: Vec<String>,
    pub tiers: Vec<TierEntry>,
}

#[derive(Serialize, Deserialize)]
struct ManifestJson {
    format: String,
    #[serde(flatten)]
    manifest: ExpertManifest,
}

impl ExpertManifest {
    /// Whether `dir` holds a strata expert container.
    pub fn exists(dir: &Path) -> bool {
        dir.join(MANIFEST_FILE).is_file()
    }

    /// Reads and validates `dir/strata-experts.json`: version, layouts, locations, and that
    /// every file exists and is long enough for the regions it is said to hold.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("{}: missing: {} is not a strata expert container", path.display(), dir.display())
            }
            Err(e) => return Err(anyhow!(e)).with_context(|| format!("{}: cannot read", path.display())),
        };
        let m = Self::parse(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        m.validate(dir).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(m)
    }

    /// Parses a manifest's text: format tag, version, fields, and every check that needs
    /// no file ([`Self::validate_structure`]). Errors do not name the file.
    pub fn parse(text: &str) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| anyhow!("corrupt manifest (invalid JSON): {e}"))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(MANIFEST_FORMAT) => {}
            other => bail!("corrupt manifest: format is {other:?}, expected \"{MANIFEST_FORMAT}\""),
        }
        let version = value
            .get("version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| anyhow!("corrupt manifest: no numeric `version`"))?;
        if version > MANIFEST_VERSION as u64 {
            bail!(
                "manifest version {version} is newer than this build of strata reads (up to {MANIFEST_VERSION}); upgrade strata"
            );
        }
        let parsed: ManifestJson = serde_json::from_value(value).map_err(|e| anyhow!("corrupt manifest: {e}"))?;
        let m = parsed.manifest;
        m.validate_structure()?;
        Ok(m)
    }

    /// Checks everything that can be checked without reading weights.
    pub fn validate(&self, dir: &Path) -> Result<()> {
        let needs = self.validate_structure()?;
        for (f, need) in self.files.iter().zip(needs) {
            let p = dir.join(f);
            let len = match std::fs::metadata(&p) {
                Ok(m) => m.len(),
                Err(_) => bail!("expert file {} is missing", p.display()),
            };
            if len < need {
                bail!(
                    "expert file {} is too short: {len} bytes, but its regions extend to byte {need} ({} bytes missing)",
                    p.display(),
                    need - len
                );
            }
        }
        Ok(())
    }

    /// The checks that need no file: unique tiers, packed layouts, one aligned location
    /// per expert, no overlapping regions, checksum counts. Returns the bytes each file
    /// must hold.
    pub fn validate_structure(&self) -> Result<Vec<u64>> {
        let mut needs = vec![0u64; self.files.len()];
        let mut seen = std::collections::HashSet::new();
        for t in &self.tiers {
            if !seen.insert(t.name.as_str()) {
                bail!("tier `{}` appears twice", t.name);
            }
            t.layout.check_packed().map_err(|e| anyhow!("tier `{}`: layout: {e}", t.name))?;
            if t.locations.len() != t.expert_count() {
                bail!(
                    "tier `{}`: {} locations for {} layers x {} experts",
                    t.name,
                    t.locations.len(),
                    t.layers.len(),
                    t.experts_per_layer
                );
            }
            if !t.checksums.is_empty() && t.checksums.len() != t.locations.len() {
                bail!("tier `{}`: {} checksums for {} experts", t.name, t.checksums.len(), t.locations.len());
            }
            let slot = t.layout.slot_bytes as u64;
            let mut regions: Vec<(usize, u64, usize)> = Vec::with_capacity(t.locations.len());
            for (i, loc) in t.locations.iter().enumerate() {
                let (layer, expert) = (t.layers[i / t.experts_per_layer], i % t.experts_per_layer);
                if loc.file >= self.files.len() {
                    bail!(
                        "tier `{}` layer {layer} expert {expert}: file #{} does not exist ({} files)",
                        t.name,
                        loc.file,
                        self.files.len()
                    );
                }
                if loc.offset % ALIGN != 0 {
                    bail!(
                        "tier `{}` layer {layer} expert {expert}: offset {} is not {ALIGN}-aligned",
                        t.name,
                        loc.offset
                    );
                }
                let Some(end) = loc.offset.checked_add(slot) else {
                    bail!(
                        "tier `{}` layer {layer} expert {expert}: region at offset {} of {slot} bytes ends past 2^64",
                        t.name,
                        loc.offset
                    );
                };
                needs[loc.file] = needs[loc.file].max(end);
                regions.push((loc.file, loc.offset, i));
            }
            regions.sort_unstable();
            for w in regions.windows(2) {
                if w[0].0 == w[1].0 && w[0].1 + slot > w[1].1 {
                    bail!(
                        "tier `{}`: regions of experts #{} and #{} overlap in {} at offset {}",
                        t.name,
                        w[0].2,
                        w[1].2,
                        self.files[w[0].0],
                        w[1].1
                    );
                }
            }
        }
        Ok(needs)
    }

    /// Writes `dir/strata-experts.json` atomically (temp file, fsync, rename, fsync dir).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let json = ManifestJson { format: MANIFEST_FORMAT.into(), manifest: self.clone() };
        let text = serde_json::to_string(&json)?;
        write_atomic(&dir.join(MANIFEST_FILE), text.as_bytes())
    }

    pub fn tier(&self, name: &str) -> Option<&TierEntry> {
        self.tiers.iter().find(|t| t.name == name)
    }

    /// Absolute paths of the expert files, in [`ExpertLocation::file`] order (open an
    /// [`IoPool`](crate::IoPool) over these).
    pub fn file_paths(&self, dir: &Path) -> Vec<PathBuf> {
        self.files.iter().map(|f| dir.join(f)).collect()
    }

    /// Bytes of all regions.
    pub fn total_expert_bytes(&self) -> u64 {
        self.tiers
            .iter()
            .map(|t| (t.expert_count() as u64).saturating_mul(t.layout.slot_bytes as u64))
            .fold(0, u64::saturating_add)
    }

    /// The read of (layer, expert) of `tier` into a slot: one segment.
    pub fn expert_read(&self, tier: &str, layer: usize, expert: usize) -> Result<ExpertRead> {
        let t = self.tier(tier).ok_or_else(|| anyhow!("the expert container has no tier `{tier}`"))?;
        let seg = t
            .read_segment(layer, expert, 0)
            .ok_or_else(|| anyhow!("tier `{tier}` has no expert {expert} in layer {layer}"))?;
        Ok(ExpertRead { segments: vec![seg], layout: t.layout })
    }
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    {
        let mut f = File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        f.write_all(bytes).with_context(|| format!("{}: write failed", tmp.display()))?;
        f.sync_all().with_context(|| format!("{}: fsync failed", tmp.display()))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot rename into place", path.display()))?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

mod kind_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    use strata_kernels::QuantKind;

    pub fn serialize<S: Serializer>(k: &QuantKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&k.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<QuantKind, D::Error> {
        let s = String::deserialize(d)?;
        QuantKind::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// What [`ContainerWriter`] needs to know about a tier up front.
#[derive(Clone, Debug)]
pub struct TierSpec {
    pub name: String,
    pub layout: ExpertLayout,
    pub layers: Vec<usize>,
    pub experts_per_layer: usize,
}

struct TierState {
    spec: TierSpec,
    locations: Vec<Option<ExpertLocation>>,
    checksums: Vec<u64>,
    /// (manifest file index, writer, bytes written) of the file being filled.
    current: Option<(usize, BufWriter<File>, u64)>,
    next_file: usize,
}

/// Writes an expert container: files under `experts/`, then the manifest on `finish`.
/// Experts may be added in any order; each is written once, padded to its slot.
pub struct ContainerWriter {
    dir: PathBuf,
    files: Vec<String>,
    tiers: Vec<TierState>,
    max_file_bytes: u64,
    region: Vec<u8>,
    done: Vec<File>,
}

impl ContainerWriter {
    /// Starts a container in `dir` (created if needed). A manifest already there is
    /// removed first, so a crash mid-write never leaves a manifest naming partial files.
    pub fn create(dir: &Path, tiers: Vec<TierSpec>) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        for t in &tiers {
            if !seen.insert(t.name.clone()) {
                bail!("tier `{}` given twice", t.name);
            }
            if t.name.is_empty() || !t.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                bail!("tier name `{}`: use letters, digits and _", t.name);
            }
            t.layout.check_packed().map_err(|e| anyhow!("tier `{}`: layout: {e}", t.name))?;
        }
        std::fs::create_dir_all(dir.join(EXPERTS_DIR))
            .with_context(|| format!("{}: cannot create", dir.join(EXPERTS_DIR).display()))?;
        let manifest = dir.join(MANIFEST_FILE);
        if manifest.exists() {
            std::fs::remove_file(&manifest).with_context(|| format!("{}: cannot remove", manifest.display()))?;
        }
        let tiers = tiers
            .into_iter()
            .map(|spec| TierState {
                locations: vec![None; spec.layers.len() * spec.experts_per_layer],
                checksums: vec![0; spec.layers.len() * spec.experts_per_layer],
                spec,
                current: None,
                next_file: 0,
            })
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tiers,
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            region: Vec::new(),
            done: Vec::new(),
        })
    }

    /// Caps each expert file near `bytes` (at least one region per file).
    pub fn set_max_file_bytes(&mut self, bytes: u64) {
        self.max_file_bytes = bytes;
    }

    /// Writes one expert: `[gate, up, down]` as (payload, scales), sizes checked against
    /// the tier's layout. Returns where it went.
    pub fn add_expert(
        &mut self,
        tier: &str,
        layer: usize,
        expert: usize,
        mats: [(&[u8], &[f32]); 3],
    ) -> Result<ExpertLocation> {
        let max_file = self.max_file_bytes;
        let ti = self
            .tiers
            .iter()
            .position(|t| t.spec.name == tier)
            .ok_or_else(|| anyhow!("no tier `{tier}` in this container"))?;
        let t = &mut self.tiers[ti];
        let li = t
            .spec
            .layers
            .iter()
            .position(|&l| l == layer)
            .ok_or_else(|| anyhow!("tier `{tier}` has no layer {layer}"))?;
        if expert >= t.spec.experts_per_layer {
            bail!("tier `{tier}`: expert {expert} out of range ({} per layer)", t.spec.experts_per_layer);
        }
        let idx = li * t.spec.experts_per_layer + expert;
        if t.locations[idx].is_some() {
            bail!("tier `{tier}` layer {layer} expert {expert} written twice");
        }
        let layout = t.spec.layout;
        self.region.clear();
        self.region.resize(layout.slot_bytes, 0);
        for ((name, m), (payload, scales)) in ["gate", "up", "down"].iter().zip(layout.matrices()).zip(mats) {
            if payload.len() != m.payload_len || scales.len() != m.scale_count() {
                bail!(
                    "tier `{tier}` layer {layer} expert {expert} {name}: {} payload bytes and {} scales, the layout ({}) needs {} and {}",
                    payload.len(),
                    scales.len(),
                    m.kind.name(),
                    m.payload_len,
                    m.scale_count()
                );
            }
            self.region[m.payload_offset..m.payload_offset + m.payload_len].copy_from_slice(payload);
            let bytes = encode_scales(m.kind, scales)
                .map_err(|e| anyhow!("tier `{tier}` layer {layer} expert {expert} {name}: {e}"))?;
            self.region[m.scales_offset..m.scales_offset + m.scales_len].copy_from_slice(&bytes);
        }
        let slot = layout.slot_bytes as u64;
        if t.current.as_ref().is_some_and(|(_, _, written)| *written > 0 && written + slot > max_file) {
            let (_, w, _) = t.current.take().unwrap();
            self.done.push(finish_file(w)?);
        }
        if t.current.is_none() {
            let name = if t.spec.name == "main" {
                format!("{EXPERTS_DIR}/experts-{:05}.bin", t.next_file)
            } else {
                format!("{EXPERTS_DIR}/experts-{}-{:05}.bin", t.spec.name, t.next_file)
            };
            t.next_file += 1;
            let path = self.dir.join(&name);
            let f = File::create(&path).with_context(|| format!("{}: cannot create", path.display()))?;
            self.files.push(name);
            t.current = Some((self.files.len() - 1, BufWriter::with_capacity(1 << 22, f), 0));
        }
        let (file, w, written) = t.current.as_mut().unwrap();
        w.write_all(&self.region)
            .with_context(|| format!("{}: write failed", self.dir.join(&self.files[*file]).display()))?;
        let loc = ExpertLocation { file: *file, offset: *written };
        *written += slot;
        t.locations[idx] = Some(loc);
        t.checksums[idx] = region_checksum(&self.region);
        Ok(loc)
    }

    /// Flushes and syncs the files, checks every expert was written, writes the manifest
    /// atomically and returns it.
    pub fn finish(mut self) -> Result<ExpertManifest> {
        let mut tiers = Vec::with_capacity(self.tiers.len());
        for t in &mut self.tiers {
            if let Some((_, w, _)) = t.current.take() {
                self.done.push(finish_file(w)?);
            }
            if let Some(i) = t.locations.iter().position(Option::is_none) {
                let missing = t.locations.iter().filter(|l| l.is_none()).count();
                bail!(
                    "tier `{}`: {missing} of {} experts never written (first: layer {} expert {})",
                    t.spec.name,
                    t.locations.len(),
                    t.spec.layers[i / t.spec.experts_per_layer],
                    i % t.spec.experts_per_layer
                );
            }
            tiers.push(TierEntry {
                name: t.spec.name.clone(),
                layout: t.spec.layout,
                layers: t.spec.layers.clone(),
                experts_per_layer: t.spec.experts_per_layer,
                locations: t.locations.iter().map(|l| l.unwrap()).collect(),
                checksums: t.checksums.clone(),
            });
        }
        let manifest = ExpertManifest { version: MANIFEST_VERSION, files: self.files.clone(), tiers };
        manifest.validate(&self.dir)?;
        manifest.write(&self.dir)?;
        Ok(manifest)
    }
}

fn finish_file(w: BufWriter<File>) -> Result<File> {
    let f = w.into_inner().map_err(|e| anyhow!("expert file flush failed: {}", e.error()))?;
    f.sync_all().context("expert file fsync failed")?;
    Ok(f)
}

#[cfg(test)]
#[path = "container_tests.rs"]
mod tests;
