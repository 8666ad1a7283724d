//! OpenAI's Responses API (`/v1/responses`): a string or a list of input items
//! (messages, `function_call`, `function_call_output`), `instructions`, function tools,
//! the response object, and its streaming events. Responses are not stored, so
//! `previous_response_id` is refused.

use crate::common::{
    collect, content_text, content_value, json_event, message, new_id, now_unix, render_prompt, sse,
    template_tool_call, Body, ChatInput, GenSpec, SamplingOptions, Shared, StreamFormat,
};
use crate::error::{ApiError, ApiResult, Flavor};
use crate::output::OutputParser;
use crate::params::{check_store, parse_request, Api};
use crate::structured::{combine, openai_tool_choice, response_format};
use crate::tools::{Piece, ToolCall};
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
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: Value,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// `{"effort": ...}`: the template's `reasoning_effort`.
    #[serde(default)]
    pub reasoning: Option<Value>,
    /// Extra template variables (an extension, as on Chat Completions).
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    /// `{"format": {...}}`: text, json_object, json_schema (and the regex and grammar
    /// extensions).
    #[serde(default)]
    pub text: Option<Value>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub truncation: Option<String>,
    #[serde(default)]
    pub include: Option<Vec<String>>,
    #[serde(flatten)]
    pub sampling: SamplingOptions,
}

/// Responses-style function tools (`{type, name, description, parameters}`) as chat
/// template tools.
fn tools_of(req: &ResponsesRequest) -> ApiResult<Option<Value>> {
    let Some(tools) = req.tools.as_ref().filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let kind = t.get("type").and_then(Value::as_str).unwrap_or("");
        let name = t.get("name").and_then(Value::as_str);
        match (kind, name) {
            ("function", Some(name)) => out.push(json!({"type": "function", "function": {
                "name": name,
                "description": t.get("description").cloned().unwrap_or(Value::Null),
                "parameters": t.get("parameters").cloned().unwrap_or(Value::Null),
            }})),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "tools[{i}]: only function tools with a `name` are supported"
                ))
                .with_param(format!("tools[{i}]")))
            }
        }
    }
    if req.tool_choice.as_ref().and_then(Value::as_str) == Some("none") {
        return Ok(None);
    }
    Ok(Some(Value::Array(out)))
}

/// `instructions` and `input` as template messages.
pub fn input_messages(instructions: Option<&str>, input: &Value) -> ApiResult<Vec<Message>> {
    let mut out: Vec<Message> = Vec::new();
    if let Some(s) = instructions.filter(|s| !s.is_empty()) {
        out.push(message("system", Value::String(s.to_string()), Map::new()));
    }
    let items = match input {
        Value::String(s) => {
            out.push(message("user", Value::String(s.clone()), Map::new()));
            return Ok(out);
        }
        Value::Array(items) => items,
        _ => return Err(ApiError::bad_request("`input` must be a string or a list of items").with_param("input")),
    };
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        let field = |k: &str| item.get(k).and_then(Value::as_str);
        match kind {
            "message" => {
                let role = match field("role") {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    r => {
                        return Err(ApiError::bad_request(format!(
                            "{param}: unknown role {r:?} (expected user, assistant, system or developer)"
                        ))
                        .with_param(param))
                    }
                };
                let content = content_value(item.get("content").unwrap_or(&Value::Null), &param)?;
                out.push(message(role, content, Map::new()));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (field("call_id"), field("name")) else {
                    return Err(ApiError::bad_request(format!("{param}: a function_call needs `call_id` and `name`"))
                        .with_param(param));
                };
                let call = template_tool_call(call_id, name, item.get("arguments").unwrap_or(&Value::Null));
                // Consecutive calls belong to one assistant turn.
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => {
                        m.extra
                            .entry("tool_calls")
                            .or_insert_with(|| Value::Array(vec![]))
                            .as_array_mut()
                            .expect("tool_calls is a list")
                            .push(call);
                    }
                    _ => {
                        let mut extra = Map::new();
                        extra.insert("tool_calls".into(), Value::Array(vec![call]));
                        out.push(message("assistant", Value::Null, extra));
                    }
                }
            }
            "function_call_output" => {
                let output = content_text(item.get("output").unwrap_or(&Value::Null), &param)?;
                let mut extra = Map::new();
                if let Some(id) = field("call_id") {
                    extra.insert("tool_call_id".into(), Value::String(id.into()));
                }
                out.push(message("tool", Value::String(output), extra));
            }
            "reasoning" => {}
            t => {
                return Err(ApiError::bad_request(format!("{param}: input items of type `{t}` are not supported"))
                    .with_param(param))
            }
        }
    }
    Ok(out)
}

/// What a response object repeats from its request.
#[derive(Clone)]
struct Echo {
    id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    temperature: f32,
    top_p: f32,
    tools: Vec<Value>,
}

impl Echo {
    fn response(&self, status: &str, output: Vec<Value>, f: Option<&Finished>) -> Value {
        let incomplete = f.is_some_and(|f| f.output.finish_reason == FinishReason::Length);
        let status = if incomplete { "incomplete" } else { status };
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": null,
            "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": true,
            "previous_response_id": null, "reasoning": {"effort": null, "summary": null},
            "store": false, "temperature": self.temperature, "top_p": self.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": self.tools,
            "truncation": "disabled", "metadata": {},
            "usage": f.map(|f| {
                let (i, o) = (f.output.stats.prompt_tokens, f.output.stats.generated_tokens);
                json!({"input_tokens": i, "output_tokens": o, "total_tokens": i + o,
                       "input_tokens_details": {"cached_tokens": i - f.output.stats.prefill_tokens},
                       "output_tokens_details": {"reasoning_tokens": 0}})
            }),
        })
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status != "in_progress" {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    } else {
        json!([])
    };
    json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status != "in_progress" { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) };
    json!({"id": id, "type": "reasoning", "status": status, "summary": [], "content": content})
}

fn call_item(id: &str, call_id: &str, c: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id,
           "name": c.name, "arguments": arguments})
}

pub async fn responses(State(st): State<Shared>, body: Body) -> Response {
    match run(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Flavor::OpenAi),
    }
}

/// The status of the items of an answer: `incomplete` when `max_output_tokens` cut it.
fn item_status(f: &Finished) -> &'static str {
    if f.output.finish_reason == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

async fn run(st: Shared, body: Body) -> ApiResult<Response> {
    let req: ResponsesRequest = parse_request(&body, Api::Responses)?;
    st.check_model(req.model.as_deref())?;
    if req.previous_response_id.is_some() {
        return Err(ApiError::bad_request(
            "previous_response_id is not supported: this server stores no responses; send the whole conversation in `input`",
        )
        .with_param("previous_response_id"));
    }
    check_store(req.store)?;
    if req.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(ApiError::bad_request(
            "truncation: only `disabled` is supported (a prompt that does not fit is refused)",
        )
        .with_param("truncation"));
    }
    if let Some(i) = req.include.as_ref().and_then(|i| i.first()) {
        return Err(ApiError::bad_request(format!("include: `{i}` is not supported")).with_param("include"));
    }
    let text_format = match &req.text {
        None | Some(Value::Null) => None,
        Some(Value::Object(t)) => {
            if let Some(k) = t.keys().find(|k| *k != "format") {
                return Err(ApiError::bad_request(format!("text.{k} is not supported")).with_param(format!("text.{k}")));
            }
            response_format(t.get("format"), "text.format")?
        }
        Some(_) => return Err(ApiError::bad_request("text must be an object").with_param("text")),
    };
    let tools = tools_of(&req)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let forced = openai_tool_choice(req.tool_choice.as_ref(), tools.as_ref())?;
    let format = combine(text_format, forced, parallel)?
        .map(|(f, p)| (f, if p == "response_format" { "text.format" } else { p }));
    let messages = input_messages(req.instructions.as_deref(), &req.input)?;
    if messages.iter().all(|m| m.role == "system") {
        return Err(ApiError::bad_request("`input` must not be empty").with_param("input"));
    }
    let mut input = ChatInput::new(messages.iter().map(Message::to_json).collect(), tools.clone());
    if let Some(effort) = req.reasoning.as_ref().and_then(|r| r.get("effort")).filter(|e| !e.is_null()) {
        input.kwargs.push(("reasoning_effort".into(), effort.clone(), "reasoning.effort".into()));
    }
    input.template_kwargs(req.chat_template_kwargs.as_ref())?;
    let prompt = render_prompt(&st, input).await?;
    let parser = st.output_parser(&prompt.text, tools.as_ref());
    let mut spec = GenSpec::new(prompt.ids.clone(), Api::Responses, &req.sampling);
    spec.media = prompt.media.clone();
    spec.max_tokens = req.max_output_tokens;
    spec.max_tokens_field = "max_output_tokens";
    spec.parsed = parser.active();
    spec.format = format;
    spec.think = st.starts_in_reasoning(&prompt.text);
    let gen = st.serve_requests(spec)?;
    let echo = Echo {
        id: new_id("resp_"),
        created_at: now_unix(),
        model: st.model_id.clone(),
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: gen[0].gen.sampling.temperature,
        top_p: gen[0].gen.sampling.top_p,
        tools: req.tools.clone().unwrap_or_default(),
    };
    let rx = st.worker.submit_many(gen)?;
    if req.stream.unwrap_or(false) {
        let fmt = ResponsesStream {
            echo,
            seq: 0,
            parser,
            output: Vec::new(),
            open: None,
            status: "completed",
            parallel,
            calls: 0,
        };
        return Ok(prompt.mark(sse(rx, fmt)));
    }
    let f = collect(rx.into_iter().next().expect("one generation")).await?;
    let p = parser.parse(&f.output.text);
    let status = item_status(&f);
    let mut output = Vec::new();
    if !p.reasoning.is_empty() {
        output.push(reasoning_item(&new_id("rs_"), &p.reasoning, status));
    }
    if !p.content.is_empty() || p.calls.is_empty() {
        output.push(message_item(&new_id("msg_"), &p.content, status));
    }
    for c in p.calls.iter().take(if parallel { usize::MAX } else { 1 }) {
        output.push(call_item(&new_id("fc_"), &new_id("call_"), c, &c.arguments_json(), "completed"));
    }
    Ok(prompt.mark(Json(echo.response("completed", output, Some(&f))).into_response()))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Message,
    Reasoning,
}

struct ResponsesStream {
    echo: Echo,
    seq: u64,
    parser: OutputParser,
    /// Finished output items.
    output: Vec<Value>,
    /// The item being streamed: its kind, id and text so far.
    open: Option<(Open, String, String)>,
    /// Status of the items closed from now on.
    status: &'static str,
    /// `parallel_tool_calls`: false keeps the first call only.
    parallel: bool,
    calls: usize,
}

impl ResponsesStream {
    fn ev(&mut self, kind: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        json_event(Some(kind), &data)
    }

    fn text(&mut self, evs: &mut Vec<SseEvent>, kind: Open, t: &str) {
        if self.open.as_ref().is_some_and(|o| o.0 != kind) {
            self.close(evs);
        }
        let index = self.output.len();
        if self.open.is_none() {
            let (id, item) = match kind {
                Open::Message => {
                    let id = new_id("msg_");
                    let item = message_item(&id, "", "in_progress");
                    (id, item)
                }
                Open::Reasoning => {
                    let id = new_id("rs_");
                    let item = reasoning_item(&id, "", "in_progress");
                    (id, item)
                }
            };
            let added = self.ev("response.output_item.added", json!({"output_index": index, "item": item}));
            evs.push(added);
            if kind == Open::Message {
                let part = self.ev(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}}),
                );
                evs.push(part);
            }
            self.open = Some((kind, id, String::new()));
        }
        let (_, id, text) = self.open.as_mut().unwrap();
        text.push_str(t);
        let id = id.clone();
        let name = match kind {
            Open::Message => "response.output_text.delta",
            Open::Reasoning => "response.reasoning_text.delta",
        };
        let mut data = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t});
        if kind == Open::Message {
            data["logprobs"] = json!([]);
        }
        let d = self.ev(name, data);
        evs.push(d);
    }

    fn close(&mut self, evs: &mut Vec<SseEvent>) {
        let Some((kind, id, text)) = self.open.take() else { return };
        let index = self.output.len();
        let item = match kind {
            Open::Message => {
                let item = message_item(&id, &text, self.status);
                let done = [
                    self.ev(
                        "response.output_text.done",
                        json!({"item_id": id, "output_index": index,
                        "content_index": 0, "text": text, "logprobs": []}),
                    ),
                    self.ev(
                        "response.content_part.done",
                        json!({"item_id": id, "output_index": index,
                        "content_index": 0, "part": item["content"][0].clone()}),
                    ),
                ];
                evs.extend(done);
                item
            }
            Open::Reasoning => {
                let done = self.ev(
                    "response.reasoning_text.done",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "text": text}),
                );
                evs.push(done);
                reasoning_item(&id, &text, self.status)
            }
        };
        let done = self.ev("response.output_item.done", json!({"output_index": index, "item": item.clone()}));
        evs.push(done);
        self.output.push(item);
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<SseEvent> {
        let mut evs = Vec::new();
        for p in pieces {
            match p {
                Piece::Text(t) => self.text(&mut evs, Open::Message, &t),
                Piece::Reasoning(r) => self.text(&mut evs, Open::Reasoning, &r),
                Piece::Call(c) => {
                    if !self.parallel && self.calls > 0 {
                        continue;
                    }
                    self.calls += 1;
                    self.close(&mut evs);
                    let index = self.output.len();
                    let (id, call_id, args) = (new_id("fc_"), new_id("call_"), c.arguments_json());
                    let item = call_item(&id, &call_id, &c, &args, "completed");
                    let e = [
                        self.ev(
                            "response.output_item.added",
                            json!({"output_index": index,
                            "item": call_item(&id, &call_id, &c, "", "in_progress")}),
                        ),
                        self.ev(
                            "response.function_call_arguments.delta",
                            json!({"item_id": id,
                            "output_index": index, "delta": args}),
                        ),
                        self.ev(
                            "response.function_call_arguments.done",
                            json!({"item_id": id,
                            "output_index": index, "arguments": args}),
                        ),
                        self.ev(
                            "response.output_item.done",
                            json!({"output_index": index,
                            "item": item.clone()}),
                        ),
                    ];
                    evs.extend(e);
                    self.output.push(item);
                }
            }
        }
        evs
    }
}

impl StreamFormat for ResponsesStream {
    fn start(&mut self) -> Vec<SseEvent> {
        let r = self.echo.response("in_progress", vec![], None);
        vec![
            self.ev("response.created", json!({"response": r})),
            self.ev("response.in_progress", json!({"response": r})),
        ]
    }

    fn delta(&mut self, _: usize, text: &str, _: &[TokenLogprobs]) -> Vec<SseEvent> {
        let pieces = self.parser.push(text);
        self.pieces(pieces)
    }

    fn finish(&mut self, _: usize, f: &Finished) -> Vec<SseEvent> {
        self.status = item_status(f);
        let rest = self.parser.finish();
        let mut evs = self.pieces(rest);
        let answered = self.output.iter().any(|i| i["type"] != "reasoning")
            || self.open.as_ref().is_some_and(|o| o.0 == Open::Message);
        if !answered {
            // Always answer with a message item, if an empty one.
            self.text(&mut evs, Open::Message, "");
        }
        self.close(&mut evs);
        let r = self.echo.response("completed", self.output.clone(), Some(f));
        let kind = if r["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
        evs.push(self.ev(kind, json!({"response": r})));
        evs
    }

    fn error(&mut self, message: &str) -> Vec<SseEvent> {
        vec![self.ev("error", json!({"code": "server_error", "message": message, "param": null}))]
    }
}
