//! GLM-5.x (`glm_moe_dsa`): MLA attention with a compressed latent KV cache, DeepSeek
//! Sparse Attention (the lightning indexer), and a DeepSeek-V3 `noaux_tc` MoE with a
//! shared expert. Reference: transformers `models/glm_moe_dsa/modeling_glm_moe_dsa.py`.
//!
//! Files, in the order a token meets them: `model.rs` (embedding -> layers -> norm ->
//! head, the KV cache), `attention.rs` (MLA + indexer), `moe.rs` (router + experts),
//! `rope.rs`, `inspect.rs` (parameter accounting), `config.rs`.

mod attention;
mod config;
mod convert;
mod inspect;
mod layout;
mod model;
mod moe;
mod rope;
mod synth;

pub use config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
pub use convert::{convert, ConvertOptions, ConvertReport};
pub use inspect::{inspect, inspect_with_container, memory_needs, MemoryNeeds, TensorGroup, WeightSummary};
pub use layout::{expected_tensors, TensorRole};
pub use model::{GlmMoeDsa, GlmSession};
pub use moe::route;
pub use synth::{synth_config, synthesize, Preset, SynthFormat, SynthRng, SynthSpec};
