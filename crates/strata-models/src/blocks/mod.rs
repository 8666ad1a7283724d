//! Building blocks shared by families: each holds its weights on a backend and runs as a
//! short sequence of the backend's fused ops.

pub mod ffn;
pub mod gqa;
pub mod mla;
pub mod mlp;
pub mod moe;

pub use ffn::{pilot_predict, Ffn, FfnBufs, FfnLayer, PILOT_MAX_ROWS};
pub use gqa::{GqaScratch, GqaWeights};
pub use mla::{MlaCache, MlaConfig, MlaScratch, MlaWeights};
pub use mlp::SwiGlu;
pub use moe::{ExpertSource, Moe, MoeScratch, Router};
