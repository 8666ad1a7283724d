//! What the API front ends share: the server's state, body parsing, sampling options,
//! prompts (chat template + tokenizer, checked against the context), and driving a
//! queued generation to a whole answer or to an SSE stream.

use crate::error::{ApiError, ApiResult};
use crate::grammar::{Format, Grammars};
use crate::metrics::Metrics;
use crate::output::OutputParser;
use crate::params::Api;
pub use crate::params::SamplingOptions;
use crate::syntax::Syntax;
use crate::worker::{Event, Finished, Worker};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{stream, StreamExt};
use rand::Rng;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use strata_engine::chat::{inject_tool_calls, inject_tools, RenderOptions, RESERVED_VARIABLES};
use strata_engine::sampling::TokenLogprobs;
use strata_engine::serving::ServeRequest;
use strata_engine::{GenerateRequest, LoadedModel, Message, SamplingParams};
use tokio::sync::mpsc::UnboundedReceiver;

pub struct AppState {
    pub model: Arc<LoadedModel>,
    /// The name clients use in `model` (the model directory's name).
    pub model_id: String,
    pub api_key: Option<String>,
    pub worker: Worker,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    pub created: u64,
    /// Whether `<tool_call>`, `<think>` and friends are special tokens, which a decode
    /// that skips special tokens would drop: parsed outputs then keep special tokens.
    pub markers_special: bool,
    /// Whether the model reasons in `<think>...</think>` (its tokenizer has the tags).
    pub reasoning: bool,
    /// Fetch image URLs from private, loopback and link-local addresses too.
    pub allow_private_media: bool,
    /// The model family's reasoning and tool-call syntax.
    pub syntax: Syntax,
    /// Longest prompt plus answer served: the model's context, or less under a memory
    /// budget (the KV cache its plan reserved).
    pub context: usize,
    /// Structured output for this model, or why there is none (no tokenizer.json, say).
    pub grammars: Result<Grammars, String>,
    /// CORS origins (empty: none).
    pub cors: Vec<String>,
    /// Largest request body accepted, in bytes.
    pub max_body: usize,
    /// Prompt text longer than this cannot fit the context whatever it says: refused
    /// before tokenizing (`context` tokens of the tokenizer's longest token, twice).
    pub max_prompt_bytes: usize,
    /// Speculative decoding: drafts a decoding request's step verifies (0: none), and
    /// how many each step drafts.
    pub draft_tokens: usize,
    pub draft_policy: strata_engine::DraftPolicy,
}

pub type Shared = Arc<AppState>;

pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `prefix` followed by 24 random hex digits.
pub fn new_id(prefix: &str) -> String {
    let mut rng = rand::rng();
    let mut s = String::from(prefix);
    for _ in 0..24 {
        s.push(char::from_digit(rng.random_range(0..16), 16).unwrap());
    }
    s
}

/// A request body, or why it could not be read (too large, say).
pub type Body = Result<Bytes, BytesRejection>;

/// Parses a JSON request body into `T`; any failure is a 4xx that says what is wrong.
pub fn parse_body<T: DeserializeOwned>(body: &Body) -> ApiResult<T> {
    let body = body.as_ref().map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("the request body is empty; expected a JSON object")
            .with_code("invalid_request_body"));
    }
    serde_json::from_slice(body).map_err(ApiError::invalid_body)
}

/// Text from a message's content: a string, null, or a list of text parts. Other parts
/// (images, audio, files) are refused: the model reads text only.
pub fn content_text(content: &Value, param: &str) -> ApiResult<String> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text" | "output_text", Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "{param}: content parts of type `{kind}` are not supported (text only)"
                        ))
                        .with_param(param))
                    }
                }
            }
            Ok(text)
        }
        _ => {
            Err(ApiError::bad_request(format!("{param}: content must be a string or a list of parts"))
                .with_param(param))
        }
    }
}

/// A message's content as the template gets it: a string, null, or the list of parts as
/// sent (`input_text` / `output_text` parts become `text` parts; `image_url` /
/// `input_image` parts and Anthropic `image` blocks become `{"type": "image", "url"}`
/// parts, which [`AppState::chat_prompt`] loads, or refuses for a model without a vision
/// tower). Other parts (audio, files) are refused.
pub fn content_value(content: &Value, param: &str) -> ApiResult<Value> {
    match content {
        Value::Null | Value::String(_) => Ok(content.clone()),
        Value::Array(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                if let Some(url) = crate::media::image_url(p) {
                    out.push(json!({"type": "image", "url": url}));
                    continue;
                }
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text", Some(_)) => out.push(p.clone()),
                    ("input_text" | "output_text", Some(t)) => out.push(json!({"type": "text", "text": t})),
                    _ => {
                        return Err(ApiError::bad_request(format!(
                            "{param}: content parts of type `{kind}` are not supported (text only)"
                        ))
                        .with_param(param))
                    }
                }
            }
            Ok(Value::Array(out))
        }
        _ => {
            Err(ApiError::bad_request(format!("{param}: content must be a string or a list of parts"))
                .with_param(param))
        }
    }
}

/// A chat message for the template, with extra fields (tool calls, ids, names).
pub fn message(role: &str, content: Value, extra: Map<String, Value>) -> Message {
    Message { role: role.to_string(), content, extra }
}

/// An OpenAI-style tool call for the template, with its arguments as an object (chat
/// templates iterate over them; clients send them as a JSON string).
pub fn template_tool_call(id: &str, name: &str, arguments: &Value) -> Value {
    json!({
        "id": id,
        "type": "function",
        "function": { "name": name, "arguments": parse_arguments(arguments) },
    })
}

/// Messages with tool calls in the shape the template renders: arguments as JSON text
/// (Python's `json.dumps` layout, as clients write them) and a null content as `""` where
/// the template concatenates them.
fn shape_call_messages(messages: &mut [Value], shape: strata_engine::chat::CallShape) {
    for m in messages.iter_mut().filter(|m| m.get("tool_calls").is_some_and(|c| !c.is_null())) {
        if shape.content_text && m.get("content").is_none_or(Value::is_null) {
            m["content"] = Value::String(String::new());
        }
        for c in m.get_mut("tool_calls").and_then(Value::as_array_mut).into_iter().flatten() {
            if let Some(a) = c.pointer_mut("/function/arguments").filter(|a| shape.arguments_text && !a.is_string()) {
                *a = Value::String(strata_engine::chat::python_json(a));
            }
        }
    }
}

/// Tool-call arguments sent as a JSON string, parsed (key order kept); anything else as
/// it came.
pub fn parse_arguments(arguments: &Value) -> Value {
    match arguments {
        Value::String(s) => serde_json::from_str::<Value>(s).unwrap_or(Value::String(s.clone())),
        v => v.clone(),
    }
}

/// What a chat prompt is rendered from.
#[derive(Debug, Default)]
pub struct ChatInput {
    /// Messages as JSON objects, keys in the order the client sent them.
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    pub documents: Option<Value>,
    /// Template variables from the request (`chat_template_kwargs` and the fields that
    /// map onto template variables), each with the request field that set it.
    pub kwargs: Vec<(String, Value, String)>,
    /// `None`: true (a new assistant turn).
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: bool,
}

impl ChatInput {
    pub fn new(messages: Vec<Value>, tools: Option<Value>) -> Self {
        Self { messages, tools, ..Default::default() }
    }

    /// Adds `chat_template_kwargs` (an object) from the request.
    pub fn template_kwargs(&mut self, kwargs: Option<&Value>) -> ApiResult<()> {
        match kwargs {
            None | Some(Value::Null) => Ok(()),
            Some(Value::Object(m)) => {
                for (k, v) in m {
                    self.kwargs.push((k.clone(), v.clone(), format!("chat_template_kwargs.{k}")));
                }
                Ok(())
            }
            Some(_) => {
                Err(ApiError::bad_request("`chat_template_kwargs` must be an object")
                    .with_param("chat_template_kwargs"))
            }
        }
    }
}

/// A rendered and tokenized chat prompt.
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
    /// The images whose soft tokens fill the prompt's image runs.
    pub media: Option<strata_engine::serving::MediaInput>,
    /// What went through the fallback, when the template has no place for it (see
    /// docs/server.md): `system-message` (the tools, and the calls with them) or
    /// `tool-calls` (earlier calls only). Responses say so in `x-strata-tools-fallback`.
    pub tools_fallback: Option<&'static str>,
}

/// The response header that says tools went through the fallback.
pub const TOOLS_FALLBACK_HEADER: &str = "x-strata-tools-fallback";

impl Prompt {
    /// `resp` with the fallback header when the tools went through it.
    pub fn mark(&self, mut resp: Response) -> Response {
        if let Some(what) = self.tools_fallback {
            resp.headers_mut().insert(TOOLS_FALLBACK_HEADER, axum::http::HeaderValue::from_static(what));
        }
        resp
    }
}

/// Joins text parts into one string, for templates that read content as a string.
fn flatten_parts(messages: &mut [Value]) {
    for m in messages.iter_mut() {
        if let Some(Value::Array(parts)) = m.get("content") {
            let texts: Vec<&str> = parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
            let joined = texts.join("\n");
            m["content"] = Value::String(joined);
        }
    }
}

/// `stop`: a string or a list of strings.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }
}

impl AppState {
    pub fn check_model(&self, model: Option<&str>) -> ApiResult<()> {
        match model {
            Some(m) if m != self.model_id => Err(ApiError::bad_request(format!(
                "model `{m}` is not served here; this server serves `{}`",
                self.model_id
            ))
            .with_param("model")
            .with_code("model_not_found")),
            _ => Ok(()),
        }
    }

    /// Renders a chat through the chat template and tokenizes it. Template variables
    /// the template does not read are refused (400 naming the field), never dropped;
    /// tools go through the fallback when the template has no tool section.
    pub fn chat_prompt(&self, input: ChatInput) -> ApiResult<Prompt> {
        let ChatInput { mut messages, tools, documents, kwargs, add_generation_prompt, continue_final_message } = input;
        if messages.is_empty() {
            return Err(ApiError::bad_request("`messages` must not be empty").with_param("messages"));
        }
        // Message texts (or their JSON) before rendering: refuse hopeless prompts early
        // (images count by their soft tokens, later).
        let content: usize = messages
            .iter()
            .map(|m| match m.get("content") {
                Some(Value::String(s)) => s.len(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match p.get("type").and_then(Value::as_str) {
                        Some("image") => 0,
                        _ => p.to_string().len(),
                    })
                    .sum(),
                Some(other) => other.to_string().len(),
                None => 0,
            })
            .sum();
        self.check_prompt_bytes(content)?;
        let template = self.model.chat_template().map_err(ApiError::from)?;
        let with_tools = tools.is_some();
        let mut opts = RenderOptions {
            add_generation_prompt: add_generation_prompt.unwrap_or(!continue_final_message),
            continue_final_message,
            documents,
            ..Default::default()
        };
        for (name, value, field) in kwargs {
            if RESERVED_VARIABLES.contains(&name.as_str()) {
                return Err(ApiError::bad_request(format!(
                    "{field}: `{name}` is set by the server, not by template keyword arguments"
                ))
                .with_param(field));
            }
            if !template.uses(&name, with_tools) {
                return Err(ApiError::bad_request(format!(
                    "{field}: this model's chat template does not use `{name}`, so it would have no effect"
                ))
                .with_param(field));
            }
            opts.kwargs.insert(name, value);
        }
        if opts.documents.is_some() && !template.uses("documents", with_tools) {
            return Err(ApiError::bad_request("documents: this model's chat template does not use `documents`")
                .with_param("documents"));
        }
        let images = crate::media::load_images(self, &mut messages)?;
        if images.is_some() && !template.reads_content_parts() {
            return Err(ApiError::bad_request("messages: this model's chat template does not read image parts")
                .with_param("messages"));
        }
        if !template.reads_content_parts() {
            flatten_parts(&mut messages);
        }
        shape_call_messages(&mut messages, template.call_message_shape());
        let mut tools_fallback = None;
        let calls =
            !template.reads_tool_calls(with_tools) && inject_tool_calls(&mut messages, self.model.arch.family().chat);
        if calls {
            tools_fallback = Some("tool-calls");
        }
        if let Some(t) = &tools {
            if template.uses("tools", true) {
                opts.tools = Some(t.clone());
            } else {
                inject_tools(&mut messages, t, self.model.arch.family().chat);
                tools_fallback = Some("system-message");
            }
        }
        let text = template
            .render_json(&messages, &opts)
            .map_err(|e| ApiError::bad_request(format!("{e:#}")).with_param("messages"))?;
        let mut ids = self.tokenize(&text, false)?;
        let media = match images {
            None => None,
            Some((images, processor, counts)) => {
                let spec = self.model.model.vision().expect("load_images checked").spec();
                let bos = self.model.model.info().bos_token_id;
                ids = strata_engine::media::expand_runs(&spec, &ids, &counts, bos)
                    .map_err(|e| ApiError::bad_request(format!("messages: {e:#}")).with_param("messages"))?;
                Some(strata_engine::serving::MediaInput { images, processor })
            }
        };
        Ok(Prompt { text, ids, media, tools_fallback })
    }

    /// Refuses, without tokenizing, prompt text too long for the context in any case.
    pub fn check_prompt_bytes(&self, bytes: usize) -> ApiResult<()> {
        if bytes > self.max_prompt_bytes {
            return Err(ApiError::bad_request(format!(
                "the prompt is {bytes} bytes: more than this model's context of {} tokens can hold (at most {} bytes); \
                 shorten the prompt",
                self.context, self.max_prompt_bytes
            ))
            .with_code("context_length_exceeded"));
        }
        Ok(())
    }

    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> ApiResult<Vec<u32>> {
        self.check_prompt_bytes(text.len())?;
        let tok = self.model.tokenizer().map_err(ApiError::from)?;
        Ok(tok.encode(text, add_special_tokens)?)
    }

    /// Whether the answer to `prompt` starts inside reasoning (the prompt opened
    /// `<think>`).
    pub fn starts_in_reasoning(&self, prompt: &str) -> bool {
        self.reasoning && prompt.trim_end().ends_with(self.syntax.think().0)
    }

    /// A token's text as it decodes alone (special tokens kept), and its bytes.
    pub fn token_piece(&self, id: u32) -> (String, Vec<u8>) {
        let text = self.model.tokenizer.as_ref().and_then(|t| t.decode(&[id], false).ok()).unwrap_or_default();
        let bytes = text.as_bytes().to_vec();
        (text, bytes)
    }

    /// Longest prompt plus answer served.
    pub fn max_context(&self) -> usize {
        self.context
    }

    /// How to parse the answer to a chat prompt: reasoning (for reasoning models; inside
    /// it from the start when the prompt opened it) and tool calls (when tools were sent).
    pub fn output_parser(&self, prompt: &str, tools: Option<&Value>) -> OutputParser {
        let think = self.reasoning.then(|| prompt.trim_end().ends_with(self.syntax.think().0));
        OutputParser::with_syntax(self.syntax, think, tools.cloned())
    }

    /// The generation requests for one API request (`spec.n` choices, the i-th seeded
    /// `seed + i`), refused with 400 when the prompt cannot fit the context or a field
    /// is out of range; `max_tokens` is clamped to the room left (default: all of it).
    pub fn serve_requests(&self, spec: GenSpec<'_>) -> ApiResult<Vec<ServeRequest>> {
        let ctx = self.max_context();
        let vocab = self.model.model.info().vocab_size;
        let prompt_ids = spec.prompt_ids;
        if prompt_ids.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if prompt_ids.len() >= ctx {
            return Err(ApiError::bad_request(format!(
                "this model's maximum context length is {ctx} tokens, but the prompt has {} tokens; shorten the prompt",
                prompt_ids.len()
            ))
            .with_code("context_length_exceeded"));
        }
        if spec.max_tokens == Some(0) {
            return Err(ApiError::bad_request(format!("{} must be at least 1", spec.max_tokens_field))
                .with_param(spec.max_tokens_field));
        }
        let o = spec.sampling;
        o.validate(spec.api, vocab)?;
        let room = ctx - prompt_ids.len();
        let max_tokens = spec.max_tokens.map_or(room, |m| (m.min(room as u64)) as usize);
        let min_tokens = o.min_tokens.unwrap_or(0) as usize;
        if min_tokens > max_tokens {
            return Err(ApiError::bad_request(format!(
                "min_tokens ({min_tokens}) exceeds the tokens this request may generate ({max_tokens})"
            ))
            .with_param("min_tokens"));
        }
        let d = &self.model.generation.sampling;
        let seed = o.seed();
        let bias = o.bias(vocab)?;
        let mut out = Vec::with_capacity(spec.n);
        for i in 0..spec.n {
            let sampling = SamplingParams {
                temperature: o.temperature.unwrap_or(d.temperature),
                top_p: o.top_p.unwrap_or(d.top_p),
                top_k: o.top_k.map_or(d.top_k, |k| k.max(0) as usize),
                min_p: o.min_p.unwrap_or(d.min_p),
                repetition_penalty: o.repetition_penalty.unwrap_or(d.repetition_penalty),
                // Without a seed every request samples differently, as the hosted APIs do.
                seed: seed.map_or_else(|| rand::rng().random(), |s| s.wrapping_add(i as u64)),
            };
            sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;
            let gen = GenerateRequest {
                stop_strings: spec.stop.clone(),
                eos_token_ids: self.model.eos_token_ids.clone(),
                skip_special_tokens: !(spec.parsed && self.markers_special),
                draft_tokens: self.draft_tokens,
                draft_policy: self.draft_policy,
                ..GenerateRequest::new(prompt_ids.clone(), max_tokens, sampling)
            };
            let mut r = ServeRequest::new(gen);
            r.min_tokens = min_tokens;
            r.ignore_eos = o.ignore_eos.unwrap_or(false);
            r.stop_token_ids = o.stop_token_ids.iter().flatten().map(|&t| t as u32).collect();
            r.logit_bias = bias.clone();
            r.presence_penalty = o.presence_penalty.unwrap_or(0.0);
            r.frequency_penalty = o.frequency_penalty.unwrap_or(0.0);
            r.logprobs = spec.logprobs;
            r.media = spec.media.clone();
            if let Some((format, param)) = &spec.format {
                let g = self.grammars.as_ref().map_err(|e| {
                    ApiError::bad_request(format!("{param}: structured output is unavailable: {e}")).with_param(*param)
                })?;
                r.constraint = Some(g.constraint(format, spec.think, param)?);
            }
            out.push(r);
        }
        Ok(out)
    }
}

/// What [`AppState::serve_requests`] builds from.
pub struct GenSpec<'a> {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: Option<u64>,
    /// The request's name for `max_tokens`, for errors.
    pub max_tokens_field: &'static str,
    pub sampling: &'a SamplingOptions,
    pub api: Api,
    pub stop: Vec<String>,
    /// The output goes through an [`OutputParser`] (special markers kept).
    pub parsed: bool,
    pub logprobs: Option<usize>,
    /// A grammar the output must follow, with the field that asked for it.
    pub format: Option<(Format, &'static str)>,
    /// The prompt's images.
    pub media: Option<strata_engine::serving::MediaInput>,
    /// The output starts inside reasoning (the grammar lets it run to `</think>`).
    pub think: bool,
    pub n: usize,
}

impl<'a> GenSpec<'a> {
    pub fn new(prompt_ids: Vec<u32>, api: Api, sampling: &'a SamplingOptions) -> Self {
        Self {
            prompt_ids,
            max_tokens: None,
            max_tokens_field: "max_tokens",
            sampling,
            api,
            stop: Vec::new(),
            parsed: false,
            logprobs: None,
            format: None,
            media: None,
            think: false,
            n: 1,
        }
    }
}

/// Runs `f` on tokio's blocking pool: rendering and tokenizing a long prompt would
/// otherwise hold up an async worker (and every stream it serves).
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> ApiResult<T> + Send + 'static) -> ApiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}

/// [`AppState::chat_prompt`] on the blocking pool.
pub async fn render_prompt(st: &Shared, input: ChatInput) -> ApiResult<Prompt> {
    let st = st.clone();
    blocking(move || st.chat_prompt(input)).await
}

/// Waits for the whole generation.
pub async fn collect(mut rx: UnboundedReceiver<Event>) -> ApiResult<Finished> {
    while let Some(ev) = rx.recv().await {
        if let Event::Done(r) = ev {
            return r.map(|f| *f).map_err(ApiError::internal);
        }
    }
    Err(ApiError::internal("the generation worker went away"))
}

/// Waits for every choice, in order.
pub async fn collect_all(rxs: Vec<UnboundedReceiver<Event>>) -> ApiResult<Vec<Finished>> {
    let mut out = Vec::with_capacity(rxs.len());
    for rx in rxs {
        out.push(collect(rx).await?);
    }
    Ok(out)
}

/// Turns engine events into one API's SSE events; `choice` tells the choices of one
/// request (`n`) apart.
pub trait StreamFormat: Send + 'static {
    fn start(&mut self) -> Vec<SseEvent>;
    fn delta(&mut self, choice: usize, text: &str, logprobs: &[TokenLogprobs]) -> Vec<SseEvent>;
    fn finish(&mut self, choice: usize, done: &Finished) -> Vec<SseEvent>;
    /// After every choice finished.
    fn end(&mut self) -> Vec<SseEvent> {
        vec![]
    }
    fn error(&mut self, message: &str) -> Vec<SseEvent>;
}

type Choices = stream::SelectAll<stream::BoxStream<'static, (usize, Event)>>;

struct Driver<F> {
    rx: Choices,
    fmt: F,
    pending: VecDeque<SseEvent>,
    streamed: Vec<String>,
    open: usize,
    done: bool,
}

/// An SSE response fed by queued generations (one per choice). Dropping it (the client
/// disconnected) drops their channels, which cancels them.
pub fn sse<F: StreamFormat>(rxs: Vec<UnboundedReceiver<Event>>, mut fmt: F) -> Response {
    let pending = fmt.start().into();
    let n = rxs.len();
    let rx =
        stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
            stream::unfold(rx, move |mut rx| async move { rx.recv().await.map(|e| ((i, e), rx)) }).boxed()
        }));
    let driver = Driver { rx, fmt, pending, streamed: vec![String::new(); n], open: n, done: false };
    let events = stream::unfold(driver, |mut d| async move {
        loop {
            if let Some(e) = d.pending.pop_front() {
                return Some((Ok::<_, Infallible>(e), d));
            }
            if d.done {
                return None;
            }
            let evs = match d.rx.next().await {
                Some((i, Event::Delta { text, logprobs })) => {
                    d.streamed[i].push_str(&text);
                    d.fmt.delta(i, &text, &logprobs)
                }
                Some((i, Event::Done(Ok(f)))) => {
                    // Text the engine held back (a partial stop string at EOS, say).
                    let mut evs = match f.output.text.strip_prefix(d.streamed[i].as_str()) {
                        Some(rest) if !rest.is_empty() => d.fmt.delta(i, rest, &[]),
                        _ => vec![],
                    };
                    evs.extend(d.fmt.finish(i, &f));
                    d.open -= 1;
                    if d.open == 0 {
                        d.done = true;
                        evs.extend(d.fmt.end());
                    }
                    evs
                }
                Some((_, Event::Done(Err(e)))) => {
                    d.done = true;
                    d.fmt.error(&e)
                }
                None => {
                    d.done = true;
                    d.fmt.error("the generation worker went away")
                }
            };
            d.pending.extend(evs);
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// An SSE event with JSON data and, for APIs that name their events, an event name.
pub fn json_event(name: Option<&str>, data: &Value) -> SseEvent {
    let e = SseEvent::default().data(data.to_string());
    match name {
        Some(n) => e.event(n),
        None => e,
    }
}

/// The `mtp` object of a usage report: speculative decoding over the choices (counts
/// summed, rates over the sums), or None where no choice speculated.
pub fn mtp_usage(fs: &[Finished]) -> Option<Value> {
    let mut all = fs.iter().filter_map(|f| f.output.stats.mtp.as_ref());
    let mut sum = all.next()?.clone();
    for m in all {
        sum.rounds += m.rounds;
        sum.plain_rounds += m.plain_rounds;
        sum.drafted += m.drafted;
        sum.accepted += m.accepted;
        sum.draft_forwards += m.draft_forwards;
        sum.tokens += m.tokens;
    }
    sum.close();
    serde_json::to_value(sum).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::Api;
    use serde_json::json;

    #[test]
    fn content_text_accepts_strings_and_text_parts_only() {
        assert_eq!(content_text(&json!("hi"), "m").unwrap(), "hi");
        assert_eq!(content_text(&Value::Null, "m").unwrap(), "");
        let parts = json!([{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]);
        assert_eq!(content_text(&parts, "m").unwrap(), "ab");
        let img = json!([{"type": "image_url", "image_url": {"url": "x"}}]);
        assert!(content_text(&img, "m").unwrap_err().message.contains("image_url"));
        assert!(content_text(&json!(3), "m").is_err());
    }

    #[test]
    fn sampling_options_validate_each_range_by_name() {
        let ok: SamplingOptions = serde_json::from_value(json!({"top_k": -1, "seed": -5, "temperature": 1.5})).unwrap();
        ok.validate(Api::Chat, 100).unwrap();
        assert_eq!(ok.seed(), Some(-5i64 as u64));
        for (api, body, field) in [
            (Api::Chat, json!({"temperature": -1.0}), "temperature"),
            (Api::Chat, json!({"temperature": 2.5}), "temperature"),
            (Api::Messages, json!({"temperature": 1.5}), "temperature"),
            (Api::Chat, json!({"top_p": 0.0}), "top_p"),
            (Api::Chat, json!({"top_k": -2}), "top_k"),
            (Api::Chat, json!({"presence_penalty": 3.0}), "presence_penalty"),
            (Api::Chat, json!({"frequency_penalty": -2.5}), "frequency_penalty"),
            (Api::Chat, json!({"logit_bias": {"5": 101}}), "logit_bias.5"),
            (Api::Chat, json!({"logit_bias": {"500": 1}}), "logit_bias.500"),
            (Api::Chat, json!({"logit_bias": {"x": 1}}), "logit_bias.x"),
            (Api::Chat, json!({"stop_token_ids": [100]}), "stop_token_ids"),
            (Api::Chat, json!({"service_tier": "flex"}), "service_tier"),
        ] {
            let o: SamplingOptions = serde_json::from_value(body.clone()).unwrap();
            let e = o.validate(api, 100).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
            assert!(e.message.contains(field), "{}", e.message);
        }
        let stop: StopField = serde_json::from_value(json!(["a", ""])).unwrap();
        assert_eq!(stop.into_vec(), vec!["a"]);
    }

    #[test]
    fn content_parts_stay_a_list_of_text_parts() {
        let parts = json!([{"type": "text", "text": "a", "cache_control": {}}, {"type": "input_text", "text": "b"}]);
        assert_eq!(
            content_value(&parts, "m").unwrap(),
            json!([{"type": "text", "text": "a", "cache_control": {}}, {"type": "text", "text": "b"}])
        );
        // Image parts become `image` parts holding their URL (loaded, or refused, later).
        let img = json!([{"type": "image_url", "image_url": {"url": "x"}}, {"type": "input_image", "image_url": "y"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}}]);
        assert_eq!(
            content_value(&img, "m").unwrap(),
            json!([{"type": "image", "url": "x"}, {"type": "image", "url": "y"},
                   {"type": "image", "url": "data:image/jpeg;base64,QUJD"}])
        );
        let audio = json!([{"type": "input_audio", "input_audio": {}}]);
        assert!(content_value(&audio, "m").unwrap_err().message.contains("input_audio"));
        let mut msgs = vec![json!({"role": "user", "content": parts})];
        flatten_parts(&mut msgs);
        assert_eq!(msgs[0]["content"], "a\nb");
    }

    #[test]
    fn tool_call_arguments_become_objects_for_the_template() {
        let c = template_tool_call("c1", "f", &json!("{\"z\": 1, \"a\": {\"y\": 2, \"b\": 3}}"));
        assert_eq!(c["function"]["arguments"].to_string(), r#"{"z":1,"a":{"y":2,"b":3}}"#);
        let c = template_tool_call("c1", "f", &json!("not json"));
        assert_eq!(c["function"]["arguments"], json!("not json"));
    }

    #[test]
    fn ids_have_the_prefix() {
        let id = new_id("chatcmpl-");
        assert!(id.starts_with("chatcmpl-") && id.len() == 9 + 24);
    }
}
