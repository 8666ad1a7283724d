//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): `system`,
//! text / `tool_use` / `tool_result` blocks, and the SSE event grammar (message_start,
//! content_block_start/delta/stop, message_delta, message_stop).

use crate::common::{
    collect, content_text, content_value, json_event, message, new_id, render_prompt, sse, template_tool_call, Body,
    ChatInput, GenSpec, Prompt, SamplingOptions, Shared, StreamFormat,
};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::output::OutputParser;
use crate::params::{parse_request, Api};
use crate::structured::{anthropic_tool_choice, combine};
use crate::tools::{from_anthropic_tools, Piece};
use crate::worker::Finished;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use strata_engine::sampling::TokenLogprobs;
use strata_engine::{FinishReason, Message};

#[derive(Deserialize, Debug)]
pub struct AnthropicMessage {
    pub role: String,
    pub content: Value,
}

#[derive(Deserialize, Debug)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<AnthropicMessage>,
    #[serde(default)]
    pub system: Option<Value>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled" | "disabled"}`: the template's `enable_thinking`.
    #[serde(default)]
    pub thinking: Option<Value>,
    /// Extra template variables (an extension, as on the OpenAI routes).
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    #[serde(flatten)]
    pub sampling: SamplingOptions,
}

fn block_type(b: &Value) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("")
}

/// Anthropic's `system` and messages as template messages: `tool_use` blocks become
/// the assistant's `tool_calls`, `tool_result` blocks become `tool` messages.
pub fn template_messages(system: Option<&Value>, msgs: &[AnthropicMessage]) -> ApiResult<Vec<Message>> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let content = content_value(s, "system")?;
        let empty = match &content {
            Value::String(t) => t.is_empty(),
            Value::Array(parts) => parts.is_empty(),
            _ => true,
        };
        if !empty {
            out.push(message("system", content, Map::new()));
        }
    }
    for (i, m) in msgs.iter().enumerate() {
        let param = format!("messages[{i}]");
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::bad_request(format!(
                "{param}: role must be `user` or `assistant`, got `{}`",
                m.role
            ))
            .with_param(param));
        }
        let blocks = match &m.content {
            Value::String(s) => {
                out.push(message(&m.role, Value::String(s.clone()), Map::new()));
                continue;
            }
            Value::Array(b) => b,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "{param}: content must be a string or a list of content blocks"
                ))
                .with_param(param))
            }
        };
        if m.role == "assistant" {
            let mut text = String::new();
            let mut thinking = String::new();
            let mut calls = Vec::new();
            for b in blocks {
                match block_type(b) {
                    "text" => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                    "thinking" => thinking.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or("")),
                    "tool_use" => {
                        let id = b.get("id").and_then(Value::as_str).unwrap_or("");
                        let name = b.get("name").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::bad_request(format!("{param}: a tool_use block needs a `name`"))
                                .with_param(param.clone())
                        })?;
                        let input = b.get("input").cloned().unwrap_or(json!({}));
                        calls.push(template_tool_call(id, name, &input));
                    }
                    "redacted_thinking" => {}
                    t => {
                        return Err(ApiError::bad_request(format!(
                            "{param}: content blocks of type `{t}` are not supported in assistant messages"
                        ))
                        .with_param(param))
                    }
                }
            }
            let mut extra = Map::new();
            if !thinking.is_empty() {
                extra.insert("reasoning_content".into(), Value::String(thinking));
            }
            // No text: no content, as an OpenAI client sends `content: null`.
            let content = if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text) };
            if !calls.is_empty() {
                extra.insert("tool_calls".into(), Value::Array(calls));
            }
            out.push(message("assistant", content, extra));
            continue;
        }
        // A user turn: runs of text blocks become user messages (their blocks kept as a
        // list of text parts), each tool_result a tool message.
        let mut text: Option<Vec<Value>> = None;
        for b in blocks {
            match block_type(b) {
                "text" | "image" => text.get_or_insert_with(Vec::new).push(b.clone()),
                "tool_result" => {
                    if let Some(t) = text.take() {
                        out.push(message("user", content_value(&Value::Array(t), &param)?, Map::new()));
                    }
                    let content =
                        content_text(b.get("content").unwrap_or(&Value::Null), &format!("{param}.tool_result"))?;
                    let mut extra = Map::new();
                    if let Some(id) = b.get("tool_use_id").and_then(Value::as_str) {
                        extra.insert("tool_call_id".into(), Value::String(id.into()));
                    }
                    out.push(message("tool", Value::String(content), extra));
                }
                t => {
                    return Err(ApiError::bad_request(format!(
                        "{param}: content blocks of type `{t}` are not supported (text, image, tool_result)"
                    ))
                    .with_param(param))
                }
            }
        }
        if let Some(t) = text {
            out.push(message("user", content_value(&Value::Array(t), &param)?, Map::new()));
        }
    }
    Ok(out)
}

fn tools_of(req: &MessagesRequest) -> Option<Value> {
    let none = req.tool_choice.as_ref().and_then(|c| c.get("type")).and_then(Value::as_str) == Some("none");
    match &req.tools {
        Some(t) if !t.is_empty() && !none => Some(Value::Array(from_anthropic_tools(t))),
        _ => None,
    }
}

async fn prompt(st: &Shared, req: &MessagesRequest) -> ApiResult<(Prompt, Option<Value>)> {
    st.check_model(req.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty").with_param("messages"));
    }
    if let Some(Value::Array(tools)) = tools_of(req) {
        for (i, t) in tools.iter().enumerate() {
            if !t["function"]["name"].is_string() {
                return Err(ApiError::bad_request(format!("tools[{i}]: a tool needs a `name`")));
            }
        }
    }
    let tools = tools_of(req);
    let messages = template_messages(req.system.as_ref(), &req.messages)?;
    let mut input = ChatInput::new(messages.iter().map(Message::to_json).collect(), tools.clone());
    match req.thinking.as_ref().filter(|t| !t.is_null()) {
        None => {}
        Some(t) => {
            let on = match t.get("type").and_then(Value::as_str) {
                Some("enabled") => true,
                Some("disabled") => false,
                _ => {
                    return Err(
                        ApiError::bad_request("thinking.type must be `enabled` or `disabled`").with_param("thinking")
                    )
                }
            };
            input.kwargs.push(("enable_thinking".into(), Value::Bool(on), "thinking".into()));
        }
    }
    input.template_kwargs(req.chat_template_kwargs.as_ref())?;
    // A final assistant message is a prefill: the answer continues it.
    if req.messages.last().is_some_and(|m| m.role == "assistant") {
        input.continue_final_message = true;
        input.add_generation_prompt = Some(false);
    }
    let p = render_prompt(st, input).await?;
    Ok((p, tools))
}

fn stop_reason(f: &Finished, tool_use: bool) -> &'static str {
    match f.output.finish_reason {
        _ if tool_use => "tool_use",
        FinishReason::Length => "max_tokens",
        _ if f.stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

pub async fn messages(State(st): State<Shared>, body: Body) -> Response {
    match run(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Flavor::Anthropic),
    }
}

pub async fn count_tokens(State(st): State<Shared>, body: Body) -> Response {
    let r = match parse_request::<MessagesRequest>(&body, Api::Messages) {
        Ok(req) => prompt(&st, &req).await,
        Err(e) => Err(e),
    };
    match r {
        Ok((p, _)) => p.mark(Json(json!({"input_tokens": p.ids.len()})).into_response()),
        Err(e) => e.into_response(Flavor::Anthropic),
    }
}

/// Anthropic's usage: input tokens read from the prompt cache apart from the others.
fn usage(f: &Finished) -> Value {
    let s = &f.output.stats;
    let mut u = json!({"input_tokens": s.prefill_tokens, "cache_read_input_tokens": s.prompt_tokens - s.prefill_tokens,
           "cache_creation_input_tokens": 0, "output_tokens": s.generated_tokens});
    if let Some(m) = crate::common::mtp_usage(std::slice::from_ref(f)) {
        u["mtp"] = m;
    }
    u
}

async fn run(st: Shared, body: Body) -> ApiResult<Response> {
    let req: MessagesRequest = parse_request(&body, Api::Messages)?;
    let Some(max_tokens) = req.max_tokens else {
        return Err(ApiError::bad_request("max_tokens: field required").with_param("max_tokens"));
    };
    let (forced, parallel) = anthropic_tool_choice(
        req.tool_choice.as_ref(),
        req.tools.as_ref().map(|t| Value::Array(from_anthropic_tools(t))).as_ref(),
    )?;
    let format = combine(None, forced, parallel)?;
    let (prompt, tools) = prompt(&st, &req).await?;
    let parser = st.output_parser(&prompt.text, tools.as_ref());
    let prompt_tokens = prompt.ids.len();
    let mut spec = GenSpec::new(prompt.ids.clone(), Api::Messages, &req.sampling);
    spec.media = prompt.media.clone();
    spec.max_tokens = Some(max_tokens);
    spec.stop = req.stop_sequences.clone().unwrap_or_default();
    spec.parsed = parser.active();
    spec.format = format;
    spec.think = st.starts_in_reasoning(&prompt.text);
    let rx = st.worker.submit_many(st.serve_requests(spec)?)?;
    let id = new_id("msg_");
    if req.stream.unwrap_or(false) {
        let fmt = MessagesStream {
            id,
            model: st.model_id.clone(),
            prompt_tokens,
            parser,
            blocks: 0,
            open: None,
            calls: 0,
            parallel,
        };
        return Ok(prompt.mark(sse(rx, fmt)));
    }
    let f = collect(rx.into_iter().next().expect("one generation")).await?;
    let mut p = parser.parse(&f.output.text);
    if !parallel {
        p.calls.truncate(1);
    }
    let mut content = Vec::new();
    if !p.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": p.reasoning, "signature": ""}));
    }
    if !p.content.is_empty() || p.calls.is_empty() {
        content.push(json!({"type": "text", "text": p.content}));
    }
    for c in &p.calls {
        content.push(json!({"type": "tool_use", "id": new_id("toolu_"), "name": c.name,
                            "input": Value::Object(c.arguments.clone())}));
    }
    let calls = p.calls;
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": st.model_id,
        "content": content,
        "stop_reason": stop_reason(&f, !calls.is_empty()),
        "stop_sequence": f.stop_sequence,
        "usage": usage(&f),
    }))
    .into_response())
    .map(|r| prompt.mark(r))
}

struct MessagesStream {
    id: String,
    model: String,
    prompt_tokens: usize,
    parser: OutputParser,
    /// Content blocks started so far (the next block's index).
    blocks: usize,
    /// The kind of the open block (`text` or `thinking`), if one is open.
    open: Option<&'static str>,
    calls: usize,
    parallel: bool,
}

fn ev(name: &str, data: Value) -> SseEvent {
    json_event(Some(name), &data)
}

impl MessagesStream {
    fn close(&mut self, evs: &mut Vec<SseEvent>) {
        if self.open.take().is_some() {
            evs.push(ev("content_block_stop", json!({"type": "content_block_stop", "index": self.blocks - 1})));
        }
    }

    /// Text or thinking, into a block of that kind (opened as needed).
    fn text(&mut self, evs: &mut Vec<SseEvent>, kind: &'static str, t: &str) {
        if t.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(evs);
            self.open = Some(kind);
            self.blocks += 1;
            let block = if kind == "thinking" {
                json!({"type": "thinking", "thinking": "", "signature": ""})
            } else {
                json!({"type": "text", "text": ""})
            };
            evs.push(ev(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.blocks - 1, "content_block": block}),
            ));
        }
        let delta = if kind == "thinking" {
            json!({"type": "thinking_delta", "thinking": t})
        } else {
            json!({"type": "text_delta", "text": t})
        };
        evs.push(ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}),
        ));
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<SseEvent> {
        let mut evs = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => self.text(&mut evs, "text", &t),
                Piece::Reasoning(r) => self.text(&mut evs, "thinking", &r),
                Piece::Call(c) => {
                    if !self.parallel && self.calls > 0 {
                        continue;
                    }
                    self.close(&mut evs);
                    let index = self.blocks;
                    self.blocks += 1;
                    self.calls += 1;
                    evs.push(ev(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index,
                               "content_block": {"type": "tool_use", "id": new_id("toolu_"),
                                                 "name": c.name, "input": {}}}),
                    ));
                    evs.push(ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": c.arguments_json()}}),
                    ));
                    evs.push(ev("content_block_stop", json!({"type": "content_block_stop", "index": index})));
                }
            }
        }
        evs
    }
}

impl StreamFormat for MessagesStream {
    fn start(&mut self) -> Vec<SseEvent> {
        vec![
            ev(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "content": [],
                    "model": self.model, "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}),
            ),
            ev("ping", json!({"type": "ping"})),
        ]
    }

    fn delta(&mut self, _: usize, text: &str, _: &[TokenLogprobs]) -> Vec<SseEvent> {
        let pieces = self.parser.push(text);
        self.pieces(pieces)
    }

    fn finish(&mut self, _: usize, f: &Finished) -> Vec<SseEvent> {
        let rest = self.parser.finish();
        let mut evs = self.pieces(rest);
        if self.blocks == 0 {
            // Every message has at least one content block.
            self.open = Some("text");
            self.blocks = 1;
            evs.push(ev(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}),
            ));
        }
        self.close(&mut evs);
        evs.push(ev(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason(f, self.calls > 0),
                             "stop_sequence": f.stop_sequence},
                   "usage": usage(f)}),
        ));
        evs.push(ev("message_stop", json!({"type": "message_stop"})));
        evs
    }

    fn error(&mut self, message: &str) -> Vec<SseEvent> {
        vec![ev("error", ApiError::internal(message).body(Flavor::Anthropic))]
    }
}
