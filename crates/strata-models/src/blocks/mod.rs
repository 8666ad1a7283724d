//! Building blocks shared by families: each holds its weights on a backend and runs as a
//! short sequence of the backend's fused ops.

pub mod gqa;
pub mod mla;
pub mod mlp;
pub mod moe;

pub use gqa::{GqaScratch, GqaWeights};
pub use mla::{MlaCache, MlaConfig, MlaScratch, MlaWeights};
pub use mlp::SwiGlu;
pub use moe::{
    pilot_predict, ExpertSource, Ffn, FfnBufs, FfnLayer, Moe, MoeScratch, Router, SharedExpert, PILOT_MAX_ROWS,
};
