//! What a generation is (a request, its output, why it ended), and the routing trace a
//! generation can write. Generating text, for the CLI as for the server, is the serving
//! engine's one decode loop ([`crate::serving::BatchEngine::generate`]).

use crate::draft_policy::DraftPolicy;
use crate::sampling::SamplingParams;
use crate::stats::GenerationStats;
use anyhow::Result;
use strata_models::Routes;

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_strings: Vec<String>,
    pub eos_token_ids: Vec<u32>,
    /// Drop special tokens from the text (true for chat output; tool-call parsers that
    /// look for special markers want false).
    pub skip_special_tokens: bool,
    /// A prompt that does not fit the context loses its oldest tokens instead of failing.
    pub truncate_left: bool,
    /// Tokens the draft (MTP) layer proposes per target forward; 0 decodes one token a
    /// forward. Used when the model has a draft layer loaded.
    pub draft_tokens: usize,
    /// Whether each round drafts `draft_tokens` or adapts (see [`DraftPolicy`]).
    pub draft_policy: DraftPolicy,
}

/// Tokens the draft (MTP) layer proposes per round unless asked otherwise.
pub const DEFAULT_DRAFT_TOKENS: usize = 3;

impl GenerateRequest {
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Self {
            prompt_ids,
            max_tokens,
            sampling,
            stop_strings: Vec::new(),
            eos_token_ids: Vec::new(),
            skip_special_tokens: true,
            truncate_left: false,
            draft_tokens: DEFAULT_DRAFT_TOKENS,
            draft_policy: DraftPolicy::Adaptive,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// The caller's callback asked to stop (e.g. a client went away).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenerationOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Prompts are prefilled in forwards of at most this many tokens on the CPU (a bound on
/// activation memory that the residency plan counts); a model's own is
/// `Model::prefill_chunk` (twice as many on CUDA).
pub const PREFILL_CHUNK: usize = strata_backend::PREFILL_CHUNK;

/// Writes every routing decision in strata-residency's trace format (`segment forward
/// row layer experts...`), which `strata replay` reads.
pub struct RouteTrace {
    out: std::io::BufWriter<std::fs::File>,
    path: std::path::PathBuf,
    /// A segment is one generate call (a turn).
    pub segment: u32,
    pub forward: u64,
}

impl RouteTrace {
    pub fn create(path: &std::path::Path) -> Result<Self> {
        use std::io::Write;
        let f =
            std::fs::File::create(path).map_err(|e| anyhow::anyhow!("{}: cannot create trace: {e}", path.display()))?;
        let mut out = std::io::BufWriter::new(f);
        writeln!(out, "{}", strata_residency::TRACE_HEADER)?;
        Ok(Self { out, path: path.to_path_buf(), segment: 0, forward: 0 })
    }

    pub(crate) fn record(&mut self, routes: &Routes) -> Result<()> {
        use std::io::Write;
        for i in 0..routes.len() {
            let (layer, ids) = routes.layer(i);
            for (row, r) in ids.chunks(routes.top_k.max(1)).enumerate() {
                let rec = strata_residency::TraceRecord {
                    segment: self.segment,
                    forward: self.forward,
                    row: row as u32,
                    layer,
                    experts: r.iter().map(|&e| e as usize).collect(),
                };
                writeln!(self.out, "{}", rec.to_line())
                    .map_err(|e| anyhow::anyhow!("{}: trace write failed: {e}", self.path.display()))?;
            }
        }
        self.forward += 1;
        Ok(())
    }

    pub(crate) fn flush(&mut self) -> Result<()> {
        use std::io::Write;
        self.out.flush().map_err(|e| anyhow::anyhow!("{}: trace write failed: {e}", self.path.display()))
    }
}

/// Where stop strings could still begin: the longest suffix of `text` that is a proper
/// prefix of some stop string is held back from streaming.
pub(crate) fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for k in (1..s.len()).rev() {
            if k <= text.len()
                && s.is_char_boundary(k)
                && text.is_char_boundary(text.len() - k)
                && text.ends_with(&s[..k])
            {
                hold = hold.max(k);
                break;
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</s>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </", &stops), 2);
        assert_eq!(held_back("hello ST", &stops), 2);
        assert_eq!(held_back("hello", &stops), 0);
    }
}
