//! Request fields: every field a route knows is honoured or refused with a 400 naming
//! it; a field it does not know is refused too (docs/server.md has the table). Numbers
//! are checked against their ranges here, with the field in the message.

use crate::error::{ApiError, ApiResult};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Number, Value};

/// Which API a request speaks (their ranges differ: Anthropic's temperature is 0..=1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    Messages,
    Responses,
}

/// Fields every generating route takes, beyond its own (vLLM's extensions included).
const COMMON: &[&str] = &[
    "model",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "user",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
];

/// Fields each route takes besides [`COMMON`].
fn own_fields(api: Api) -> &'static [&'static str] {
    match api {
        Api::Chat => &[
            "messages",
            "stream_options",
            "max_tokens",
            "max_completion_tokens",
            "stop",
            "n",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "store",
            "modalities",
            "reasoning_effort",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
            "documents",
            "chat_template",
        ],
        Api::Completions => {
            &["prompt", "stream_options", "max_tokens", "stop", "n", "logprobs", "echo", "best_of", "response_format"]
        }
        Api::Messages => &[
            "messages",
            "system",
            "max_tokens",
            "stop_sequences",
            "tools",
            "tool_choice",
            "thinking",
            "chat_template_kwargs",
        ],
        Api::Responses => &[
            "input",
            "instructions",
            "max_output_tokens",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "previous_response_id",
            "reasoning",
            "text",
            "store",
            "truncation",
            "chat_template_kwargs",
            "include",
        ],
    }
}

/// Fields refused whatever their value (when not null), with the reason.
const REFUSED: &[(&str, &str)] = &[
    ("functions", "the deprecated `functions` are not supported; send `tools`"),
    ("function_call", "the deprecated `function_call` is not supported; send `tool_choice`"),
    ("audio", "audio output is not supported (text only)"),
    ("prediction", "predicted outputs are not supported"),
    ("web_search_options", "web search is not supported"),
    ("verbosity", "verbosity is not supported"),
    ("suffix", "`suffix` (insertion) is not supported"),
    ("background", "background responses are not supported"),
    ("max_tool_calls", "max_tool_calls is not supported"),
    ("prompt", "stored prompts are not supported"),
    ("container", "containers are not supported"),
    ("mcp_servers", "MCP servers are not supported"),
    ("context_management", "context management is not supported"),
    ("conversation", "stored conversations are not supported; send the whole conversation"),
];

/// Parses a request body for `api`: a JSON object whose every field the route knows,
/// then the typed request, a type error naming its field.
pub fn parse_request<T: DeserializeOwned>(body: &crate::common::Body, api: Api) -> ApiResult<T> {
    let v: Value = crate::common::parse_body(body)?;
    let Value::Object(map) = &v else {
        return Err(ApiError::bad_request("the request body must be a JSON object").with_code("invalid_request_body"));
    };
    for (k, val) in map {
        if own_fields(api).contains(&k.as_str()) || COMMON.contains(&k.as_str()) {
            continue;
        }
        if let Some((_, why)) = REFUSED.iter().find(|(f, _)| f == k) {
            if val.is_null() {
                continue;
            }
            return Err(ApiError::bad_request(format!("{k}: {why}")).with_param(k.clone()));
        }
        return Err(ApiError::bad_request(format!("{k}: unknown field for this route (see docs/server.md)"))
            .with_param(k.clone()));
    }
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        ApiError::bad_request(format!("{path}: {}", e.inner())).with_param(path).with_code("invalid_request_body")
    })
}

/// Sampling and generation options common to every API; unset ones take the model's
/// defaults.
#[derive(Deserialize, Default, Debug, Clone)]
pub struct SamplingOptions {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<Number>,
    pub logit_bias: Option<Map<String, Value>>,
    pub min_tokens: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u64>>,
    pub user: Option<String>,
    pub metadata: Option<Value>,
    pub service_tier: Option<String>,
    pub safety_identifier: Option<String>,
    pub prompt_cache_key: Option<String>,
}

fn range(name: &str, v: Option<f32>, lo: f32, hi: f32) -> ApiResult<()> {
    match v {
        Some(x) if !(x.is_finite() && (lo..=hi).contains(&x)) => {
            Err(ApiError::bad_request(format!("{name} must be in [{lo}, {hi}], got {x}")).with_param(name))
        }
        _ => Ok(()),
    }
}

/// `n` in 1..=`max`.
pub fn check_n(n: Option<u64>, max: usize) -> ApiResult<usize> {
    match n {
        None => Ok(1),
        Some(n) if n >= 1 && n <= max as u64 => Ok(n as usize),
        Some(n) => Err(ApiError::bad_request(format!("n must be in 1..={max} (the server's --max-batch), got {n}"))
            .with_param("n")),
    }
}

/// Logprob alternatives in 0..=20.
pub fn check_top_logprobs(name: &str, n: Option<u64>) -> ApiResult<Option<usize>> {
    match n {
        Some(n) if n > 20 => Err(ApiError::bad_request(format!("{name} must be in [0, 20], got {n}")).with_param(name)),
        n => Ok(n.map(|n| n as usize)),
    }
}

impl SamplingOptions {
    /// Checks every numeric range (400 naming the field) and the no-effect fields'
    /// values.
    pub fn validate(&self, api: Api, vocab: usize) -> ApiResult<()> {
        let max_t = if api == Api::Messages { 1.0 } else { 2.0 };
        range("temperature", self.temperature, 0.0, max_t)?;
        if let Some(p) = self.top_p {
            if !(p.is_finite() && p > 0.0 && p <= 1.0) {
                return Err(ApiError::bad_request(format!("top_p must be in (0, 1], got {p}")).with_param("top_p"));
            }
        }
        if let Some(k) = self.top_k {
            if k < -1 {
                return Err(ApiError::bad_request(format!("top_k must be -1 (off), 0 (off) or more, got {k}"))
                    .with_param("top_k"));
            }
        }
        range("min_p", self.min_p, 0.0, 1.0)?;
        range("repetition_penalty", self.repetition_penalty, 0.01, 10.0)?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if let Some(s) = &self.seed {
            if s.as_u64().is_none() && s.as_i64().is_none() {
                return Err(ApiError::bad_request(format!("seed must be an integer, got {s}")).with_param("seed"));
            }
        }
        self.bias(vocab)?;
        for &id in self.stop_token_ids.iter().flatten() {
            if id as usize >= vocab {
                return Err(ApiError::bad_request(format!(
                    "stop_token_ids: token {id} is outside the vocabulary ({vocab})"
                ))
                .with_param("stop_token_ids"));
            }
        }
        if let Some(t) = self.service_tier.as_deref() {
            if !["auto", "default", "standard_only"].contains(&t) {
                return Err(ApiError::bad_request(format!("service_tier `{t}` is not offered here (auto, default)"))
                    .with_param("service_tier"));
            }
        }
        if let Some(m) = &self.metadata {
            if !m.is_object() && !m.is_null() {
                return Err(ApiError::bad_request("metadata must be an object").with_param("metadata"));
            }
        }
        Ok(())
    }

    /// `logit_bias` as (token, bias): keys are token ids, values in [-100, 100].
    pub fn bias(&self, vocab: usize) -> ApiResult<Vec<(u32, f32)>> {
        let mut out = Vec::new();
        for (k, v) in self.logit_bias.iter().flatten() {
            let param = format!("logit_bias.{k}");
            let id: u32 = k.trim().parse().map_err(|_| {
                ApiError::bad_request(format!("{param}: keys must be token ids")).with_param(param.clone())
            })?;
            if id as usize >= vocab {
                return Err(ApiError::bad_request(format!("{param}: token {id} is outside the vocabulary ({vocab})"))
                    .with_param(param));
            }
            let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                ApiError::bad_request(format!("{param}: the bias must be a number in [-100, 100], got {v}"))
                    .with_param(param.clone())
            })?;
            out.push((id, b as f32));
        }
        Ok(out)
    }

    pub fn seed(&self) -> Option<u64> {
        self.seed.as_ref().and_then(|s| s.as_u64().or_else(|| s.as_i64().map(|i| i as u64)))
    }
}

/// `store`: this server stores nothing, so only `false` (or no value) is honoured.
pub fn check_store(store: Option<bool>) -> ApiResult<()> {
    if store == Some(true) {
        return Err(ApiError::bad_request("store: this server stores no completions or responses; send store=false")
            .with_param("store"));
    }
    Ok(())
}
