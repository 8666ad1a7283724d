//! OpenAI's Chat Completions (`/v1/chat/completions`), legacy Completions
//! (`/v1/completions`) and Models (`/v1/models`).

use crate::common::{
    blocking, collect_all, content_value, json_event, new_id, now_unix, parse_arguments, render_prompt, sse, Body,
    ChatInput, GenSpec, SamplingOptions, Shared, StopField, StreamFormat,
};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::output::OutputParser;
use crate::params::{check_n, check_store, check_top_logprobs, parse_request, Api};
use crate::structured::{combine, openai_tool_choice, response_format};
use crate::tools::{Piece, ToolCall};
use crate::worker::Finished;
use axum::extract::{Path, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use strata_engine::sampling::TokenLogprobs;
use strata_engine::FinishReason;

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A chat message as the client sent it (every key, in order).
#[derive(Deserialize, Debug)]
#[serde(transparent)]
pub struct ChatMessage(pub Map<String, Value>);

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub modalities: Option<Vec<String>>,
    #[serde(flatten)]
    pub template: TemplateFields,
    #[serde(flatten)]
    pub sampling: SamplingOptions,
}

/// Request fields that reach the chat template (as vLLM and transformers' serving
/// take them).
#[derive(Deserialize, Debug, Default)]
pub struct TemplateFields {
    /// Extra template variables, e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    /// Passed to the template as `reasoning_effort`.
    #[serde(default)]
    pub reasoning_effort: Option<Value>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    #[serde(default)]
    pub documents: Option<Value>,
    /// A template sent with the request: refused (the model's own template is used).
    #[serde(default)]
    pub chat_template: Option<Value>,
}

impl TemplateFields {
    /// A chat input for `messages` and `tools` with these fields applied.
    pub fn input(self, messages: Vec<Value>, tools: Option<Value>) -> ApiResult<ChatInput> {
        if self.chat_template.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(ApiError::bad_request(
                "chat_template: requests cannot bring their own chat template; the model's is used",
            )
            .with_param("chat_template"));
        }
        let mut input = ChatInput::new(messages, tools);
        if let Some(e) = self.reasoning_effort.filter(|e| !e.is_null()) {
            input.kwargs.push(("reasoning_effort".into(), e, "reasoning_effort".into()));
        }
        input.template_kwargs(self.chat_template_kwargs.as_ref())?;
        input.add_generation_prompt = self.add_generation_prompt;
        input.continue_final_message = self.continue_final_message.unwrap_or(false);
        if input.continue_final_message && input.add_generation_prompt == Some(true) {
            return Err(ApiError::bad_request("continue_final_message and add_generation_prompt cannot both be true")
                .with_param("continue_final_message"));
        }
        if input.continue_final_message
            && input.messages.last().and_then(|m| m.get("role")).and_then(Value::as_str) != Some("assistant")
        {
            return Err(ApiError::bad_request("continue_final_message: the last message must be the assistant's")
                .with_param("continue_final_message"));
        }
        input.documents = self.documents.filter(|d| !d.is_null());
        Ok(input)
    }
}

/// Checks OpenAI-style tool schemas; `None` when there are none or `tool_choice` is
/// `"none"`.
pub fn tool_schemas(tools: Option<Vec<Value>>, choice: Option<&Value>) -> ApiResult<Option<Value>> {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    for (i, t) in tools.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        if f.get("name").and_then(Value::as_str).is_none() {
            return Err(ApiError::bad_request(format!("tools[{i}]: a function tool needs a `name`"))
                .with_param(format!("tools[{i}]")));
        }
    }
    if choice.and_then(Value::as_str) == Some("none") {
        return Ok(None);
    }
    Ok(Some(Value::Array(tools)))
}

/// OpenAI chat messages as the template gets them, every key in the order sent: roles
/// checked (`developer` becomes `system`), content kept (a string, or text parts as a
/// list), tool-call arguments sent as JSON strings parsed to objects; `name`,
/// `tool_call_id`, `reasoning_content` and any other field as they came.
pub fn chat_messages(msgs: Vec<ChatMessage>) -> ApiResult<Vec<Value>> {
    let mut out = Vec::with_capacity(msgs.len());
    for (i, ChatMessage(mut m)) in msgs.into_iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system" | "developer") => "system",
            Some(r @ ("user" | "assistant" | "tool")) => r,
            r => {
                return Err(ApiError::bad_request(format!(
                    "{param}: unknown role {} (expected system, developer, user, assistant or tool)",
                    r.map_or("(none)".to_string(), |r| format!("`{r}`"))
                ))
                .with_param(param))
            }
        };
        m["role"] = Value::String(role.into());
        if let Some(c) = m.get("content") {
            let c = content_value(c, &param)?;
            m["content"] = c;
        }
        if let Some(calls) = m.get_mut("tool_calls") {
            match calls {
                Value::Null => {}
                Value::Array(calls) => {
                    for (j, c) in calls.iter_mut().enumerate() {
                        let f = c.get_mut("function").filter(|f| f.get("name").is_some_and(Value::is_string));
                        let Some(f) = f else {
                            return Err(ApiError::bad_request(format!(
                                "{param}.tool_calls[{j}]: a tool call needs `function.name`"
                            ))
                            .with_param(param));
                        };
                        if let Some(a) = f.get("arguments") {
                            let parsed = parse_arguments(a);
                            f["arguments"] = parsed;
                        }
                    }
                }
                _ => {
                    return Err(ApiError::bad_request(format!("{param}: `tool_calls` must be a list")).with_param(param))
                }
            }
        }
        out.push(Value::Object(m));
    }
    Ok(out)
}

fn finish_reason(f: &Finished, tool_calls: bool) -> &'static str {
    match f.output.finish_reason {
        _ if tool_calls => "tool_calls",
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// Usage over every choice: the prompt once, the completions summed; cached tokens are
/// the prompt tokens the prompt cache supplied (none recomputed).
fn usage(fs: &[Finished]) -> Value {
    let p = fs.first().map_or(0, |f| f.output.stats.prompt_tokens);
    let cached = fs.first().map_or(0, |f| f.output.stats.prompt_tokens - f.output.stats.prefill_tokens);
    let c: usize = fs.iter().map(|f| f.output.stats.generated_tokens).sum();
    let mut u = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": cached}});
    if let Some(m) = crate::common::mtp_usage(fs) {
        u["mtp"] = m;
    }
    u
}

fn openai_tool_call(index: usize, c: &ToolCall) -> Value {
    json!({"index": index, "id": new_id("call_"), "type": "function",
           "function": {"name": c.name, "arguments": c.arguments_json()}})
}

/// Chat Completions' `logprobs.content` entries.
fn chat_logprobs(st: &Shared, lps: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (text, bytes) = st.token_piece(id);
        json!({"token": text, "logprob": lp, "bytes": bytes})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

pub async fn chat_completions(State(st): State<Shared>, body: Body) -> Response {
    match chat(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Flavor::OpenAi),
    }
}

/// `logprobs` and `top_logprobs` as the engine's option.
fn chat_logprob_option(logprobs: Option<bool>, top: Option<u64>) -> ApiResult<Option<usize>> {
    let top = check_top_logprobs("top_logprobs", top)?;
    match (logprobs.unwrap_or(false), top) {
        (true, t) => Ok(Some(t.unwrap_or(0))),
        (false, Some(_)) => Err(ApiError::bad_request("top_logprobs needs logprobs: true").with_param("top_logprobs")),
        (false, None) => Ok(None),
    }
}

async fn chat(st: Shared, body: Body) -> ApiResult<Response> {
    let req: ChatRequest = parse_request(&body, Api::Chat)?;
    st.check_model(req.model.as_deref())?;
    check_store(req.store)?;
    if let Some(m) = req.modalities.as_ref().and_then(|m| m.iter().find(|m| *m != "text")) {
        return Err(ApiError::bad_request(format!("modalities: `{m}` output is not supported (text only)"))
            .with_param("modalities"));
    }
    let n = check_n(req.n, st.worker.max_batch())?;
    let logprobs = chat_logprob_option(req.logprobs, req.top_logprobs)?;
    let declared = req.tools.clone().map(Value::Array);
    let forced = openai_tool_choice(req.tool_choice.as_ref(), declared.as_ref())?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let format = combine(response_format(req.response_format.as_ref(), "response_format")?, forced, parallel)?;
    let tools = tool_schemas(req.tools, req.tool_choice.as_ref())?;
    let messages = chat_messages(req.messages)?;
    let input = req.template.input(messages, tools.clone())?;
    let prompt = render_prompt(&st, input).await?;
    let parsers: Vec<OutputParser> = (0..n).map(|_| st.output_parser(&prompt.text, tools.as_ref())).collect();
    let mut spec = GenSpec::new(prompt.ids.clone(), Api::Chat, &req.sampling);
    spec.media = prompt.media.clone();
    spec.max_tokens = req.max_completion_tokens.or(req.max_tokens);
    if req.max_completion_tokens.is_some() {
        spec.max_tokens_field = "max_completion_tokens";
    }
    spec.stop = req.stop.map(StopField::into_vec).unwrap_or_default();
    spec.parsed = parsers[0].active();
    spec.logprobs = logprobs;
    spec.format = format;
    spec.think = st.starts_in_reasoning(&prompt.text);
    spec.n = n;
    let rxs = st.worker.submit_many(st.serve_requests(spec)?)?;
    let id = new_id("chatcmpl-");
    let created = now_unix();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let fmt = ChatStream {
            st: st.clone(),
            id,
            created,
            include_usage,
            parsers,
            calls: vec![0; n],
            parallel,
            done: Vec::new(),
        };
        return Ok(prompt.mark(sse(rxs, fmt)));
    }
    let fs = collect_all(rxs).await?;
    let choices: Vec<Value> = fs
        .iter()
        .zip(parsers)
        .enumerate()
        .map(|(i, (f, parser))| {
            let mut p = parser.parse(&f.output.text);
            if !parallel {
                p.calls.truncate(1);
            }
            let mut msg = json!({"role": "assistant", "content": p.content});
            if !p.reasoning.is_empty() {
                msg["reasoning_content"] = json!(p.reasoning);
            }
            if !p.calls.is_empty() {
                if p.content.is_empty() {
                    msg["content"] = Value::Null;
                }
                msg["tool_calls"] = p
                    .calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let mut v = openai_tool_call(i, c);
                        v.as_object_mut().unwrap().remove("index");
                        v
                    })
                    .collect();
            }
            let lp = if logprobs.is_some() { chat_logprobs(&st, &f.logprobs) } else { Value::Null };
            json!({"index": i, "message": msg, "logprobs": lp,
                   "finish_reason": finish_reason(f, !p.calls.is_empty())})
        })
        .collect();
    let resp = Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": st.model_id,
        "choices": choices,
        "usage": usage(&fs),
        "system_fingerprint": null,
    }))
    .into_response();
    Ok(prompt.mark(resp))
}

struct ChatStream {
    st: Shared,
    id: String,
    created: u64,
    include_usage: bool,
    parsers: Vec<OutputParser>,
    /// Tool calls sent so far, per choice.
    calls: Vec<usize>,
    parallel: bool,
    done: Vec<Finished>,
}

impl ChatStream {
    fn chunk(&self, i: usize, delta: Value, finish: Option<&str>, logprobs: Value) -> SseEvent {
        let mut c = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.st.model_id, "system_fingerprint": null,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        json_event(None, &c)
    }

    fn pieces(&mut self, i: usize, pieces: Vec<Piece>, logprobs: &[TokenLogprobs]) -> Vec<SseEvent> {
        let mut evs = Vec::new();
        let mut lp = if logprobs.is_empty() { Value::Null } else { chat_logprobs(&self.st, logprobs) };
        for p in pieces {
            let delta = match p {
                Piece::Text(t) => json!({"content": t}),
                Piece::Reasoning(r) => json!({"reasoning_content": r}),
                Piece::Call(c) => {
                    if !self.parallel && self.calls[i] > 0 {
                        continue;
                    }
                    let call = openai_tool_call(self.calls[i], &c);
                    self.calls[i] += 1;
                    json!({"tool_calls": [call]})
                }
            };
            evs.push(self.chunk(i, delta, None, std::mem::take(&mut lp)));
        }
        if !lp.is_null() {
            // Tokens whose text is held back (or is markup) still report their logprobs.
            evs.push(self.chunk(i, json!({}), None, lp));
        }
        evs
    }
}

impl StreamFormat for ChatStream {
    fn start(&mut self) -> Vec<SseEvent> {
        (0..self.parsers.len())
            .map(|i| self.chunk(i, json!({"role": "assistant", "content": ""}), None, Value::Null))
            .collect()
    }

    fn delta(&mut self, i: usize, text: &str, logprobs: &[TokenLogprobs]) -> Vec<SseEvent> {
        let p = self.parsers[i].push(text);
        self.pieces(i, p, logprobs)
    }

    fn finish(&mut self, i: usize, f: &Finished) -> Vec<SseEvent> {
        let p = self.parsers[i].finish();
        let mut evs = self.pieces(i, p, &[]);
        evs.push(self.chunk(i, json!({}), Some(finish_reason(f, self.calls[i] > 0)), Value::Null));
        self.done.push(f.clone());
        evs
    }

    fn end(&mut self) -> Vec<SseEvent> {
        let mut evs = Vec::new();
        if self.include_usage {
            evs.push(json_event(
                None,
                &json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.st.model_id, "system_fingerprint": null, "choices": [],
                        "usage": usage(&self.done)}),
            ));
        }
        evs.push(SseEvent::default().data("[DONE]"));
        evs
    }

    fn error(&mut self, message: &str) -> Vec<SseEvent> {
        openai_stream_error(message)
    }
}

pub fn openai_stream_error(message: &str) -> Vec<SseEvent> {
    vec![json_event(None, &ApiError::internal(message).body(Flavor::OpenAi)), SseEvent::default().data("[DONE]")]
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Value,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub best_of: Option<u64>,
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(flatten)]
    pub sampling: SamplingOptions,
}

/// A completion prompt: a string or token ids, alone or as the only item of a list.
fn completion_prompt(st: &Shared, prompt: &Value) -> ApiResult<(String, Vec<u32>)> {
    let bad = || {
        ApiError::bad_request("`prompt` must be a string, a list of token ids, or a list holding one of these")
            .with_param("prompt")
    };
    let ids_of = |v: &[Value]| -> ApiResult<Vec<u32>> {
        v.iter()
            .map(|x| x.as_u64().filter(|&i| i < u32::MAX as u64).map(|i| i as u32))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(bad)
    };
    match prompt {
        Value::String(s) => Ok((s.clone(), st.tokenize(s, true)?)),
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => completion_prompt(st, &items[0]),
        Value::Array(items) if items.len() > 1 && !items[0].is_number() => {
            Err(ApiError::bad_request("only one prompt per request is supported").with_param("prompt"))
        }
        Value::Array(items) => {
            let ids = ids_of(items)?;
            let vocab = st.model.model.info().vocab_size;
            if let Some(bad_id) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ApiError::bad_request(format!("token id {bad_id} is outside the vocabulary ({vocab})"))
                    .with_param("prompt"));
            }
            let text = st.model.tokenizer().map_err(ApiError::from)?.decode(&ids, false)?;
            Ok((text, ids))
        }
        _ => Err(bad()),
    }
}

pub async fn completions(State(st): State<Shared>, body: Body) -> Response {
    match completion(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Flavor::OpenAi),
    }
}

/// The legacy Completions `logprobs` object for `lps`, text offsets from `offset`.
fn completion_logprobs(st: &Shared, lps: &[TokenLogprobs], mut offset: usize) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for l in lps {
        let text = st.token_piece(l.token).0;
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
        values.push(l.logprob);
        let top: Map<String, Value> = l.top.iter().map(|&(id, lp)| (st.token_piece(id).0, json!(lp))).collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
}

async fn completion(st: Shared, body: Body) -> ApiResult<Response> {
    let mut req: CompletionRequest = parse_request(&body, Api::Completions)?;
    st.check_model(req.model.as_deref())?;
    let n = check_n(req.n, st.worker.max_batch())?;
    if req.best_of.is_some_and(|b| b != n as u64) {
        return Err(
            ApiError::bad_request("best_of: only best_of equal to n (or unset) is supported").with_param("best_of")
        );
    }
    let logprobs = check_top_logprobs("logprobs", req.logprobs)?;
    let format = response_format(req.response_format.as_ref(), "response_format")?.map(|f| (f, "response_format"));
    let prompt = std::mem::take(&mut req.prompt);
    let (prompt_text, ids) = {
        let st = st.clone();
        blocking(move || completion_prompt(&st, &prompt)).await?
    };
    let mut spec = GenSpec::new(ids, Api::Completions, &req.sampling);
    spec.max_tokens = Some(req.max_tokens.unwrap_or(16));
    spec.stop = req.stop.map(StopField::into_vec).unwrap_or_default();
    spec.logprobs = logprobs;
    spec.format = format;
    spec.n = n;
    let rxs = st.worker.submit_many(st.serve_requests(spec)?)?;
    let echo = if req.echo.unwrap_or(false) { prompt_text } else { String::new() };
    let id = new_id("cmpl-");
    let created = now_unix();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let fmt = CompletionStream {
            st: st.clone(),
            id,
            created,
            include_usage,
            echo,
            n,
            offsets: vec![0; n],
            logprobs: logprobs.is_some(),
            done: Vec::new(),
        };
        return Ok(sse(rxs, fmt));
    }
    let fs = collect_all(rxs).await?;
    let choices: Vec<Value> = fs
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let lp = if logprobs.is_some() { completion_logprobs(&st, &f.logprobs, echo.len()) } else { Value::Null };
            json!({"index": i, "text": echo.clone() + &f.output.text, "logprobs": lp,
                   "finish_reason": finish_reason(f, false)})
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": st.model_id,
        "choices": choices,
        "usage": usage(&fs),
        "system_fingerprint": null,
    }))
    .into_response())
}

struct CompletionStream {
    st: Shared,
    id: String,
    created: u64,
    include_usage: bool,
    echo: String,
    n: usize,
    /// Text sent so far per choice (for logprobs' text offsets).
    offsets: Vec<usize>,
    logprobs: bool,
    done: Vec<Finished>,
}

impl CompletionStream {
    fn chunk(&self, i: usize, text: &str, finish: Option<&str>, logprobs: Value) -> SseEvent {
        json_event(
            None,
            &json!({"id": self.id, "object": "text_completion", "created": self.created,
                    "model": self.st.model_id, "system_fingerprint": null,
                    "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}),
        )
    }
}

impl StreamFormat for CompletionStream {
    fn start(&mut self) -> Vec<SseEvent> {
        if self.echo.is_empty() {
            return vec![];
        }
        let echo = self.echo.clone();
        (0..self.n)
            .map(|i| {
                self.offsets[i] = echo.len();
                self.chunk(i, &echo, None, Value::Null)
            })
            .collect()
    }

    fn delta(&mut self, i: usize, text: &str, logprobs: &[TokenLogprobs]) -> Vec<SseEvent> {
        let lp = if self.logprobs { completion_logprobs(&self.st, logprobs, self.offsets[i]) } else { Value::Null };
        self.offsets[i] += text.len();
        vec![self.chunk(i, text, None, lp)]
    }

    fn finish(&mut self, i: usize, f: &Finished) -> Vec<SseEvent> {
        self.done.push(f.clone());
        vec![self.chunk(i, "", Some(finish_reason(f, false)), Value::Null)]
    }

    fn end(&mut self) -> Vec<SseEvent> {
        let mut evs = Vec::new();
        if self.include_usage {
            evs.push(json_event(
                None,
                &json!({"id": self.id, "object": "text_completion", "created": self.created,
                        "model": self.st.model_id, "choices": [], "usage": usage(&self.done)}),
            ));
        }
        evs.push(SseEvent::default().data("[DONE]"));
        evs
    }

    fn error(&mut self, message: &str) -> Vec<SseEvent> {
        openai_stream_error(message)
    }
}

/// Unix seconds as RFC 3339 UTC (`2026-01-01T00:00:00Z`).
pub fn rfc3339(unix: u64) -> String {
    let (days, rem) = (unix / 86_400, unix % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// The served model, in a shape both SDKs read: OpenAI's (`object`, `created`,
/// `owned_by`) and Anthropic's (`type`, `display_name`, `created_at`).
fn model_object(st: &Shared) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "strata",
           "type": "model", "display_name": st.model_id, "created_at": rfc3339(st.created),
           "max_model_len": st.max_context(), "vision": st.model.model.vision().is_some()})
}

pub async fn list_models(State(st): State<Shared>) -> Response {
    Json(json!({"object": "list", "data": [model_object(&st)], "has_more": false,
                "first_id": st.model_id, "last_id": st.model_id}))
    .into_response()
}

pub async fn get_model(State(st): State<Shared>, Path(id): Path<String>) -> Response {
    if id == st.model_id {
        Json(model_object(&st)).into_response()
    } else {
        ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            format!("model `{id}` is not served here; this server serves `{}`", st.model_id),
        )
        .with_code("model_not_found")
        .into_response(Flavor::OpenAi)
    }
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_031_708), "2026-11-30T09:41:48Z");
    }
}
