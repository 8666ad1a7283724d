//! The streamed-expert runtime: routed experts live in a byte-budgeted slab of slots and
//! are read from the container on demand. Policy (plan, slot table, ledger) comes from
//! strata-residency, bytes from strata-storage's I/O pool, arithmetic from
//! strata-kernels. See ARCHITECTURE.md ("A token's path", "Streaming invariants").

mod runtime;
mod source;
pub mod telemetry;

pub use runtime::{PilotMode, RuntimeOptions, RuntimeReport, StreamedExperts, UsageSetting};
pub use source::{is_container, open_source, ColibriSource, ContainerSource, ExpertSource};
