//! `strata-bench`: benchmarks of strata, kept out of the `strata` binary (with the counting
//! allocator that `decode`'s allocations-per-token figure needs): synthetic GLM-5-shaped
//! checkpoints, decode and serving throughput against their floors, memory and disk
//! bandwidth. Figures: docs/performance.md.

mod alloc_count;
mod bench;
mod bench_serve;

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "strata-bench",
    version,
    about = "Benchmarks of strata: decode, serving, memory, disk, synthetic models"
)]
struct Cli {
    #[command(subcommand)]
    command: bench::BenchCommand,
}

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

fn main() {
    if let Err(e) = bench::run(Cli::parse().command) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
