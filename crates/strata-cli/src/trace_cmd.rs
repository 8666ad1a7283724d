//! `strata trace ...`: offline analyses of route traces (`--trace` of generate/chat).

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use strata_residency::{coupling, CouplingOptions};

#[derive(Subcommand)]
pub enum TraceCommand {
    /// Cross-layer coupling: how well a row's experts at layer L predict its experts at
    /// L+1 and L+2 (co-activation fitted on the first part of the trace, recall measured
    /// on the rest, next to a most-frequent-experts baseline).
    Coupling(CouplingArgs),
}

#[derive(Args)]
pub struct CouplingArgs {
    /// A route trace written by `--trace`.
    #[arg(long)]
    trace: PathBuf,
    /// Leading share of the trace's rows to fit on; the rest is the test.
    #[arg(long, default_value_t = 0.5)]
    train_fraction: f64,
    /// Layer distances to predict across.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    deltas: Vec<usize>,
    /// Score only rows of forwards with at most this many rows (8: the calls PILOT
    /// predicts; it skips wider ones). Every fit row is used regardless.
    #[arg(long)]
    score_max_rows: Option<usize>,
    #[arg(long)]
    json: bool,
}

pub fn run(c: TraceCommand) -> Result<()> {
    match c {
        TraceCommand::Coupling(a) => {
            let file =
                std::fs::File::open(&a.trace).map_err(|e| anyhow!("{}: cannot open trace: {e}", a.trace.display()))?;
            let records = strata_residency::read_trace(std::io::BufReader::new(file))
                .map_err(|e| anyhow!("{}: {e}", a.trace.display()))?;
            let report = coupling(
                &records,
                &CouplingOptions {
                    train_fraction: a.train_fraction,
                    deltas: a.deltas,
                    score_max_rows: a.score_max_rows,
                },
            )
            .map_err(|e| anyhow!("{}: {e}", a.trace.display()))?;
            if a.json {
                crate::commands::emit(&serde_json::to_string_pretty(&report)?)
            } else {
                crate::commands::emit(report.to_string().trim_end())
            }
        }
    }
}
