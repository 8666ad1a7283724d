//! The `strata` command line's commands (thin: parsing and printing; the work lives in the
//! crates below), shared by the `strata` binary and `strata-bench`.

pub mod atlas;
mod atlas_html;
pub mod commands;
pub mod quality;
pub mod residency;
pub mod serve;
pub mod trace_cmd;
