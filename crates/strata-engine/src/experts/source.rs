//! Where an expert's bytes are and how they sit inside a slot, per container kind.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use strata_storage::{
    ColibriContainer, ColibriTier, ExpertLayout, ExpertManifest, GlmDims, ReadCheck, ReadSegment, TierEntry,
};

pub trait ExpertSource: Send + Sync {
    /// Bytes of one slot (identical for every expert of the tier).
    fn slot_bytes(&self) -> usize;
    /// The files segments refer to (by index).
    fn files(&self) -> &[PathBuf];
    /// Model layer ids with routed experts, and experts per layer.
    fn layers(&self) -> &[usize];
    fn experts_per_layer(&self) -> usize;
    /// The reads that fill a slot with expert `(layer, expert)`, and the matrices'
    /// places inside the slot.
    fn locate(&self, layer: usize, expert: usize) -> Result<(Vec<ReadSegment>, &ExpertLayout)>;
    /// What a read of `(layer, expert)` must hash to; None: not verified.
    fn read_check(&self, _layer: usize, _expert: usize) -> Option<ReadCheck> {
        None
    }
}

/// strata's own container: one aligned region per expert, one read.
pub struct ContainerSource {
    files: Vec<PathBuf>,
    tier: TierEntry,
}

impl ContainerSource {
    pub fn open(dir: &Path, tier_name: &str) -> Result<Self> {
        let manifest = ExpertManifest::read(dir)?;
        let Some(tier) = manifest.tier(tier_name).cloned() else {
            bail!("{}: container has no `{tier_name}` expert tier", dir.display());
        };
        Ok(Self { files: manifest.file_paths(dir), tier })
    }
}

impl ExpertSource for ContainerSource {
    fn slot_bytes(&self) -> usize {
        self.tier.layout.slot_bytes
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn layers(&self) -> &[usize] {
        &self.tier.layers
    }
    fn experts_per_layer(&self) -> usize {
        self.tier.experts_per_layer
    }
    fn locate(&self, layer: usize, expert: usize) -> Result<(Vec<ReadSegment>, &ExpertLayout)> {
        self.tier.locate(layer, expert)
    }
    fn read_check(&self, layer: usize, expert: usize) -> Option<ReadCheck> {
        self.tier.read_check(layer, expert)
    }
}

/// The public GLM-5.2 container (`out-*.safetensors`, U8 payloads + `.qs` scales), read
/// in place: each expert's tensors are adjacent, so one 4096-aligned covering read fills
/// a slot, and each expert carries its own layout inside that read.
pub struct ColibriSource {
    files: Vec<PathBuf>,
    tier: ColibriTier,
}

impl ColibriSource {
    pub fn open(dir: &Path) -> Result<Self> {
        let mut container = ColibriContainer::open(dir, &GlmDims::from_dir(dir)?)?;
        for w in container.ensure_checksums()? {
            eprintln!("warning: {w}");
        }
        let Some(tier) = container.tier("main").cloned() else {
            bail!("{}: Colibri container has no main experts", dir.display());
        };
        Ok(Self { files: container.file_paths(), tier })
    }
}

impl ExpertSource for ColibriSource {
    fn slot_bytes(&self) -> usize {
        self.tier.slot_bytes
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn layers(&self) -> &[usize] {
        &self.tier.layers
    }
    fn experts_per_layer(&self) -> usize {
        self.tier.experts_per_layer
    }
    fn locate(&self, layer: usize, expert: usize) -> Result<(Vec<ReadSegment>, &ExpertLayout)> {
        self.tier.locate(layer, expert)
    }
    fn read_check(&self, layer: usize, expert: usize) -> Option<ReadCheck> {
        self.tier.read_check(layer, expert)
    }
}

/// The expert source of a model directory: strata's container or a Colibri one; None for
/// an HF checkpoint.
pub fn open_source(dir: &Path) -> Result<Option<Box<dyn ExpertSource>>> {
    if ExpertManifest::exists(dir) {
        return Ok(Some(Box::new(ContainerSource::open(dir, "main")?)));
    }
    if ColibriContainer::detect(dir) {
        return Ok(Some(Box::new(ColibriSource::open(dir)?)));
    }
    Ok(None)
}
