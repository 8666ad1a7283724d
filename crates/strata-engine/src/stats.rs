//! Generation telemetry, written by `--stats-json`.

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually computed (the rest came from the session's cache).
    pub prefill_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub prefill_tokens_per_s: f64,
    /// Tokens after the first, over the time spent producing them.
    pub decode_tokens_per_s: f64,
    pub time_to_first_token_s: f64,
    pub peak_rss_bytes: u64,
    pub finish_reason: String,
    /// Oldest prompt tokens dropped to fit the context (`--truncate left`).
    pub truncated_prompt_tokens: usize,
    /// Decoding picked each token on the device and fed it to the next forward
    /// there (see `serving::BatchEngine::set_device_picks`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub decode_fed: bool,
    /// Speculative decoding with the draft (MTP) layer, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtp: Option<crate::speculative::MtpStats>,
}

pub use strata_experts::rss::{current_rss_bytes, peak_rss_bytes};
