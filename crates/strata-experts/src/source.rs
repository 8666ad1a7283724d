//! Where an expert's bytes are and how they sit inside a slot, per container kind.

use crate::MoeLayout;
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
    /// Where the matrices of `(layer, expert)` lie inside its slot.
    fn layout(&self, layer: usize, expert: usize) -> Result<&ExpertLayout>;
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
    fn layout(&self, _layer: usize, _expert: usize) -> Result<&ExpertLayout> {
        Ok(&self.tier.layout)
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
    pub fn open(dir: &Path, moe: &MoeLayout) -> Result<Self> {
        Self::open_tier(dir, moe, "main")?
            .ok_or_else(|| anyhow::anyhow!("{}: Colibri container has no main experts", dir.display()))
    }

    /// The container's `tier` (`main` or `mtp`), if it has one.
    pub fn open_tier(dir: &Path, moe: &MoeLayout, tier: &str) -> Result<Option<Self>> {
        let dims = GlmDims {
            hidden: moe.hidden,
            moe_inter: moe.inter,
            n_experts: moe.experts_per_layer,
            sparse_layers: moe.layers.clone(),
            mtp_layers: moe.mtp_layers.clone(),
        };
        let mut container = ColibriContainer::open(dir, &dims)?;
        for w in container.ensure_checksums()? {
            eprintln!("warning: {w}");
        }
        let Some(tier) = container.tier(tier).cloned() else { return Ok(None) };
        Ok(Some(Self { files: container.file_paths(), tier }))
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
    fn layout(&self, layer: usize, expert: usize) -> Result<&ExpertLayout> {
        self.tier
            .expert(layer, expert)
            .map(|e| &e.layout)
            .ok_or_else(|| anyhow::anyhow!("the container has no expert {expert} in layer {layer}"))
    }
    fn read_check(&self, layer: usize, expert: usize) -> Option<ReadCheck> {
        self.tier.read_check(layer, expert)
    }
}

/// The expert source of a model directory: strata's container or a Colibri one; None for
/// an HF checkpoint (or a model without routed experts).
pub fn open_source(dir: &Path, moe: Option<&MoeLayout>) -> Result<Option<Box<dyn ExpertSource>>> {
    let Some(moe) = moe else { return Ok(None) };
    if ExpertManifest::exists(dir) {
        return Ok(Some(Box::new(ContainerSource::open(dir, "main")?)));
    }
    if ColibriContainer::detect(dir) {
        return Ok(Some(Box::new(ColibriSource::open(dir, moe)?)));
    }
    Ok(None)
}

/// Whether `dir` holds an expert container (strata's or Colibri's).
pub fn is_container(dir: &Path) -> bool {
    ExpertManifest::exists(dir) || ColibriContainer::detect(dir)
}

/// Tier `tier` ("main", "mtp") of the container in `dir` (a strata container or a
/// Colibri one), or None where it has no such tier (or `dir` holds no container).
pub fn open_tier(dir: &Path, moe: &MoeLayout, tier: &str) -> Result<Option<Box<dyn ExpertSource>>> {
    if strata_storage::ExpertManifest::exists(dir) {
        let m = strata_storage::ExpertManifest::read(dir)?;
        if m.tier(tier).is_none() {
            return Ok(None);
        }
        return Ok(Some(Box::new(ContainerSource::open(dir, tier)?)));
    }
    if strata_storage::ColibriContainer::detect(dir) {
        return Ok(ColibriSource::open_tier(dir, moe, tier)?.map(|s| Box::new(s) as Box<dyn ExpertSource>));
    }
    Ok(None)
}
