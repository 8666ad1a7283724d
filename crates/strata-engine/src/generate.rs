//! The generation loop: prefill the prompt in one forward, then decode one token at a
//! time against the cache; stop on EOS ids, stop strings or the token limit; stream text.

use crate::sampling::{Sampler, SamplingParams};
use crate::stats::{peak_rss_bytes, GenerationStats};
use crate::tokenizer::{StreamDecoder, TextTokenizer};
use anyhow::{bail, Result};
use std::time::Instant;
use strata_models::{CausalLm, Session};

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
}

impl GenerateRequest {
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Self {
            prompt_ids,
            max_tokens,
            sampling,
            stop_strings: Vec::new(),
            eos_token_ids: Vec::new(),
            skip_special_tokens: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// `max_tokens` or the model's context.
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

/// Prompts are prefilled in forwards of at most this many tokens: a bound on
/// activation memory that the residency plan counts.
pub const PREFILL_CHUNK: usize = 256;

/// A session plus the tokens it holds, so a later prompt that extends an earlier
/// conversation reuses the cached prefix (multi-turn chat).
pub struct Generator<'m> {
    model: &'m dyn CausalLm,
    session: Box<dyn Session + 'm>,
    tokens: Vec<u32>,
    trace: Option<RouteTrace>,
}

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

    fn record(&mut self, routes: &[(usize, Vec<strata_models::Routing>)]) -> Result<()> {
        use std::io::Write;
        for (layer, rows) in routes {
            for (row, r) in rows.iter().enumerate() {
                let rec = strata_residency::TraceRecord {
                    segment: self.segment,
                    forward: self.forward,
                    row: row as u32,
                    layer: *layer,
                    experts: r.experts.clone(),
                };
                writeln!(self.out, "{}", rec.to_line())
                    .map_err(|e| anyhow::anyhow!("{}: trace write failed: {e}", self.path.display()))?;
            }
        }
        self.forward += 1;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        use std::io::Write;
        self.out.flush().map_err(|e| anyhow::anyhow!("{}: trace write failed: {e}", self.path.display()))
    }
}

/// Where stop strings could still begin: the longest suffix of `text` that is a proper
/// prefix of some stop string is held back from streaming.
fn held_back(text: &str, stops: &[String]) -> usize {
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

impl<'m> Generator<'m> {
    pub fn new(model: &'m dyn CausalLm) -> Result<Self> {
        Ok(Self { model, session: model.new_session()?, tokens: Vec::new(), trace: None })
    }

    /// Records every routing decision of later forwards to `trace`.
    pub fn set_trace(&mut self, trace: RouteTrace) {
        self.trace = Some(trace);
    }

    /// One forward over `ids` appended to the session: the last position's logits.
    fn forward(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let logits = self.session.forward(ids, false)?.squeeze(0)?.to_vec1::<f32>()?;
        self.tokens.extend_from_slice(ids);
        if let Some(trace) = self.trace.as_mut() {
            trace.record(self.session.last_routes())?;
        }
        Ok(logits)
    }

    /// Generates for `req`, calling `on_text` with each printable delta; `on_text`
    /// returns false to cancel.
    pub fn generate(
        &mut self,
        tok: Option<&TextTokenizer>,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<GenerationOutput> {
        if req.prompt_ids.is_empty() {
            bail!("the prompt is empty (no tokens to condition on)");
        }
        let max_ctx = self.model.max_context();
        if req.prompt_ids.len() >= max_ctx {
            bail!("the prompt has {} tokens but the model's context is {max_ctx}", req.prompt_ids.len());
        }
        if !req.stop_strings.is_empty() && tok.is_none() {
            bail!("stop strings need a tokenizer");
        }
        let mut sampler = Sampler::new(req.sampling.clone())?;
        // Reuse the cached prefix; at least one prompt token must be computed for logits.
        let common = self.tokens.iter().zip(&req.prompt_ids).take_while(|(a, b)| a == b).count();
        let keep = common.min(req.prompt_ids.len() - 1);
        self.session.truncate(keep);
        self.tokens.truncate(keep);

        let t0 = Instant::now();
        let fresh = &req.prompt_ids[keep..];
        let mut logits = Vec::new();
        for chunk in fresh.chunks(PREFILL_CHUNK) {
            logits = self.forward(chunk)?;
        }
        let prefill_s = t0.elapsed().as_secs_f64();

        let mut stats = GenerationStats {
            prompt_tokens: req.prompt_ids.len(),
            prefill_tokens: fresh.len(),
            prefill_seconds: prefill_s,
            prefill_tokens_per_s: fresh.len() as f64 / prefill_s.max(1e-9),
            time_to_first_token_s: prefill_s,
            ..Default::default()
        };
        let mut out = Vec::new();
        let mut decoder = StreamDecoder::default();
        let mut streamed = 0usize; // bytes of the text handed to `on_text`
        let mut text = String::new();
        let mut finish = FinishReason::Length;
        let t_decode = Instant::now();
        // `self.tokens` is what the cache holds: the prompt and every generated token but
        // the last (which needs no forward).
        while out.len() < req.max_tokens {
            let next = sampler.sample(&mut logits, &self.tokens);
            if req.eos_token_ids.contains(&next) {
                finish = FinishReason::Stop;
                break;
            }
            out.push(next);
            if let Some(tok) = tok {
                let (full, _) = decoder.push(tok, next, req.skip_special_tokens)?;
                text = full;
                if let Some(cut) = req.stop_strings.iter().filter_map(|s| text.find(s.as_str())).min() {
                    text.truncate(cut);
                    if cut > streamed {
                        on_text(&text[streamed..]);
                    }
                    finish = FinishReason::Stop;
                    break;
                }
                let printable = decoder.emitted().len() - held_back(decoder.emitted(), &req.stop_strings);
                if printable > streamed {
                    let go_on = on_text(&decoder.emitted()[streamed..printable]);
                    streamed = printable;
                    if !go_on {
                        finish = FinishReason::Cancelled;
                        break;
                    }
                }
            }
            if out.len() == req.max_tokens || self.tokens.len() >= max_ctx {
                break;
            }
            logits = self.forward(&[next])?;
        }
        if finish == FinishReason::Length && tok.is_some() && text.len() > streamed {
            on_text(&text[streamed..]);
        }
        let decode_s = t_decode.elapsed().as_secs_f64();
        stats.generated_tokens = out.len();
        stats.decode_seconds = decode_s;
        stats.decode_tokens_per_s = if out.len() > 1 { (out.len() - 1) as f64 / decode_s.max(1e-9) } else { 0.0 };
        stats.peak_rss_bytes = peak_rss_bytes();
        stats.finish_reason = finish.as_str().to_string();
        if let Some(trace) = self.trace.as_mut() {
            trace.flush()?;
            trace.segment += 1;
        }
        Ok(GenerationOutput { tokens: out, text, finish_reason: finish, stats })
    }

    /// Logits for `ids` from a fresh cache: every position, or the last.
    pub fn logits(&mut self, ids: &[u32], all_positions: bool) -> Result<Vec<Vec<f32>>> {
        self.session.truncate(0);
        self.tokens.clear();
        let l = self.session.forward(ids, all_positions)?;
        self.tokens.extend_from_slice(ids);
        Ok(l.to_vec2::<f32>()?)
    }
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
