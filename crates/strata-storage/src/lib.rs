//! Weight storage: safetensors checkpoints opened header-only over mmap.
//!
//! A [`WeightStore`] is a model directory's set of safetensors shards (with or without
//! `model.safetensors.index.json`). Opening one reads only the headers; tensor bytes are
//! touched when a tensor is decoded. Every error names the file and the problem.

pub mod checksum;
pub mod colibri;
mod colibri_sums;
pub mod container;
pub mod io;
mod safetensors_file;
mod store;
mod writer;

pub use checksum::{parts_checksum, region_checksum, ReadCheck, CHECKSUM_ALGORITHM};
pub use colibri::{infer_quant_kind, ColibriContainer, ColibriExpert, ColibriFamily, ColibriTier, GlmDims};
pub use colibri_sums::COLIBRI_SUMS_FILE;
pub use container::{
    ContainerWriter, ExpertLayout, ExpertLocation, ExpertManifest, ExpertRead, MatrixLayout, TierEntry, TierSpec,
    ALIGN, MANIFEST_FILE,
};
pub use io::{AlignedBuf, IoPool, ReadSegment, ReadStats, ReadTicket};
pub use safetensors_file::{SafetensorsFile, TensorRef};
pub use store::{StoredMatrix, WeightStore};
pub use strata_kernels::ElementType;
pub use writer::{SafetensorsWriter, TensorSpec};
