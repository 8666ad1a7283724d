//! `strata`: the command line. Thin: parsing and printing; the work lives in the crates.

use clap::{Parser, Subcommand};
use strata_cli::{atlas, commands, quality, residency, serve, trace_cmd};

#[derive(Parser)]
#[command(name = "strata", version, about = "Run Mixture-of-Experts language models larger than fast memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(commands::GenerateArgs),
    /// Interactive multi-turn chat through the model's chat template.
    Chat(commands::ChatArgs),
    /// Print logits for token ids as JSON.
    Logits(commands::LogitsArgs),
    /// Architecture, parameters and bytes by kind, from the headers alone.
    Inspect(commands::InspectArgs),
    /// Convert an HF checkpoint into a model with a streamable expert container.
    Convert(residency::ConvertArgs),
    /// The memory plan for a budget, from headers alone.
    Fit(residency::FitArgs),
    /// Replay a route trace: hit rates of LRU, LFRU, pinned+LRU and the Belady optimum.
    Replay(residency::ReplayArgs),
    /// Serve the model over HTTP: OpenAI and Anthropic compatible APIs.
    Serve(serve::ServeArgs),
    /// Expert Atlas: which routed experts specialise in which topics (build, validate,
    /// render).
    #[command(subcommand)]
    Atlas(atlas::AtlasCommand),
    /// Perplexity of a model on a text (sliding windows of --context tokens).
    Perplexity(quality::PerplexityArgs),
    /// Offline analyses of route traces (coupling).
    #[command(subcommand)]
    Trace(trace_cmd::TraceCommand),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => commands::generate(a),
        Command::Chat(a) => commands::chat(a),
        Command::Logits(a) => commands::logits(a),
        Command::Inspect(a) => commands::inspect(a),
        Command::Convert(a) => residency::convert(a),
        Command::Fit(a) => residency::fit(a),
        Command::Replay(a) => residency::replay(a),
        Command::Serve(a) => serve::serve(a),
        Command::Atlas(c) => atlas::run(c),
        Command::Perplexity(a) => quality::run(a),
        Command::Trace(c) => trace_cmd::run(c),
    };
    if let Err(e) = result {
        // One line: the chain of contexts, outermost first.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
