//! Where an expert's bytes are and how they sit inside a slot, per container kind.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use strata_storage::{ExpertLayout, ExpertManifest, ReadSegment, TierEntry};

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
}

/// strata's own container: one aligned region per expert, one read.
pub struct ContainerSource {
    files: Vec<PathBuf>,
    tier: TierEntry,
}

impl ContainerSource {
    pub fn open(dir: &Path, tier_name: &str) -> Result<Self> {
        let manifest = ExpertManifest::read(dir)?;
        let Some(tier) = manifest.tiers.iter().find(|t| t.name == tier_name).cloned() else {
            bail!("{}: container has no `{tier_name}` expert tier", dir.display());
        };
        let files = manifest.files.iter().map(|f| dir.join(f)).collect();
        Ok(Self { files, tier })
    }

    pub fn tier(&self) -> &TierEntry {
        &self.tier
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
        let Some(li) = self.tier.layers.iter().position(|&l| l == layer) else {
            bail!("layer {layer} has no routed experts in this container");
        };
        if expert >= self.tier.experts_per_layer {
            bail!("expert {expert} out of range (layer has {})", self.tier.experts_per_layer);
        }
        let loc = &self.tier.locations[li * self.tier.experts_per_layer + expert];
        let seg = ReadSegment { file: loc.file, offset: loc.offset, len: self.tier.layout.slot_bytes, dest_offset: 0 };
        Ok((vec![seg], &self.tier.layout))
    }
}
