//! Routed experts streamed end to end. A model routes on its backend and asks an
//! [`ExpertProvider`] for the chosen experts: all resident ([`ResidentExperts`]), or a
//! byte-budgeted slab of slots filled from an expert container on demand
//! ([`StreamedExperts`]), with a GPU slab in front on CUDA ([`gpu::GpuExperts`]).
//! Policy (the plan, the slot table, the usage ledger) comes from strata-residency, bytes
//! from strata-storage's readers and I/O pool, arithmetic from the backend. Families depend
//! on the provider interface only ([`provider`]).

#[cfg(feature = "cuda")]
pub mod gpu;
mod layout;
pub mod provider;
pub mod rss;
mod runtime;
mod source;
pub mod telemetry;

pub use layout::MoeLayout;
pub use provider::{ExpertProvider, ReadyExperts, ResidentExperts, Routes, Union};
pub use runtime::{PilotMode, RuntimeOptions, RuntimeReport, SharedLedger, StreamedExperts, UsageSetting};
pub use source::{is_container, open_source, open_tier, ColibriSource, ContainerSource, ExpertSource};
