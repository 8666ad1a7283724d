//! Gemma 4's vision tower (`vision_config`): not run yet. A checkpoint with one loads for
//! text; an image is refused.

use super::config::Gemma4Config;
use crate::fields::Fields;
use crate::weights::WeightMap;
use anyhow::Result;

/// The vision tower's fields.
#[derive(Clone, Debug)]
pub struct VisionConfig {
    pub hidden_size: usize,
}

impl VisionConfig {
    pub(super) fn from_fields(f: &Fields) -> Result<Self> {
        Ok(Self { hidden_size: f.usize_or("hidden_size", 768)? })
    }
}

/// The tower's tensors (none are read yet).
pub(super) fn add_weights(_cfg: &Gemma4Config, _v: &VisionConfig, _map: &mut WeightMap) {}
