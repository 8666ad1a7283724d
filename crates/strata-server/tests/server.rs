//! The server's routes against a small real model (fixtures/glm5/dsa-sparse, random
//! weights: its text is gibberish, its protocol is not).

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use strata_engine::serving::ServeRequest;
use strata_engine::{ChatTemplate, GenerateRequest, LoadedModel, SamplingParams};
use strata_server::common::Shared;
use strata_server::worker::Event;
use tower::ServiceExt;

const KEY: &str = "sekrit";

fn fixture() -> LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse");
    LoadedModel::open(&dir).expect("open the fixture model")
}

fn server(key: Option<&str>, queue: usize) -> (Shared, Router) {
    let st = strata_server::state(fixture(), key.map(String::from), queue);
    (st.clone(), strata_server::router(st))
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// SSE events as (event name, data).
    fn events(&self) -> Vec<(Option<String>, String)> {
        self.body
            .split("\n\n")
            .filter(|b| !b.trim().is_empty() && !b.starts_with(':'))
            .map(|block| {
                let mut name = None;
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = Some(n.to_string());
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data.push_str(d);
                    }
                }
                (name, data)
            })
            .collect()
    }
}

async fn call(app: &Router, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = app.clone().oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    Reply { status, headers, body: String::from_utf8_lossy(&bytes).into_owned() }
}

async fn post(app: &Router, path: &str, body: Value) -> Reply {
    call(app, "POST", path, &[("content-type", "application/json")], &body.to_string()).await
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn auth_guards_everything_but_health() {
    let (_, app) = server(Some(KEY), 4);
    block_on(async {
        assert_eq!(call(&app, "GET", "/health", &[], "").await.status, 200);
        let r = call(&app, "GET", "/v1/models", &[], "").await;
        assert_eq!(r.status, 401);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        let wrong = call(&app, "GET", "/v1/models", &[("authorization", "Bearer nope")], "").await;
        assert_eq!(wrong.status, 401);
        let bearer = format!("Bearer {KEY}");
        assert_eq!(call(&app, "GET", "/v1/models", &[("authorization", &bearer)], "").await.status, 200);
        assert_eq!(call(&app, "GET", "/v1/models", &[("x-api-key", KEY)], "").await.status, 200);
        assert_eq!(call(&app, "GET", "/metrics", &[("x-api-key", "sekri")], "").await.status, 401);
        let r = call(&app, "POST", "/v1/messages", &[], "{}").await;
        assert_eq!(r.status, 401);
        assert_eq!(
            r.json(),
            json!({"type": "error", "error": {"type": "authentication_error",
            "message": r.json()["error"]["message"]}})
        );
    });
}

/// The chat page and its assets: served without the key (they hold nothing), with a
/// Content-Security-Policy that admits only the server's own scripts, styles and API; the
/// page's message box is a textbox labelled "Message" and sending a button named "Send";
/// every asset the page and its modules load is served; the API behind it keeps its key.
#[test]
fn the_chat_page_is_served_and_open() {
    let (_, app) = server(Some(KEY), 4);
    block_on(async {
        let page = call(&app, "GET", "/", &[], "").await;
        assert_eq!(page.status, 200);
        assert_eq!(page.headers["content-type"], "text/html; charset=utf-8");
        let csp = page.headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("script-src 'self'") && csp.contains("default-src 'none'"), "{csp}");
        let html = &page.body;
        assert!(html.contains(r#"<label for="message" class="visually-hidden">Message</label>"#));
        assert!(html.contains(r#"<textarea id="message""#));
        assert!(html.contains(r#"<button type="submit" id="send">Send</button>"#));
        // No inline script or style, nothing from another origin.
        assert!(!html.contains("<script>") && !html.contains("style=") && !html.contains("http"), "{html}");
        // Every local module and stylesheet the page and its modules name is served.
        let mut names: Vec<String> = Vec::new();
        let mut texts = vec![html.clone()];
        while let Some(t) = texts.pop() {
            for part in t.split(['"', '\'']).filter(|p| p.starts_with("/ui/") || p.starts_with("./")) {
                let path = format!("/ui/{}", part.trim_start_matches("/ui/").trim_start_matches("./"));
                if names.contains(&path) {
                    continue;
                }
                let r = call(&app, "GET", &path, &[], "").await;
                assert_eq!(r.status, 200, "{path}");
                assert_eq!(r.headers["x-content-type-options"], "nosniff");
                let kind = r.headers["content-type"].to_str().unwrap().to_string();
                assert!(
                    kind.starts_with(if path.ends_with(".css") { "text/css" } else { "text/javascript" }),
                    "{path}: {kind}"
                );
                texts.push(r.body);
                names.push(path);
            }
        }
        for asset in ["/ui/chat.js", "/ui/markdown.js", "/ui/sse.js", "/ui/ui.css"] {
            assert!(names.iter().any(|n| n == asset), "{asset} not reached from the page: {names:?}");
        }
        assert_eq!(call(&app, "GET", "/ui/nope.js", &[], "").await.status, 401, "an unknown asset is not open");
        assert_eq!(call(&app, "POST", "/", &[], "").await.status, 401);
        assert_eq!(call(&app, "GET", "/v1/models", &[], "").await.status, 401);
    });
    let (_, open) = server(None, 4);
    block_on(async {
        assert_eq!(call(&open, "GET", "/ui/nope.js", &[], "").await.status, 404);
        let m = call(&open, "GET", "/v1/models", &[], "").await.json();
        assert_eq!(m["data"][0]["vision"], false, "{m}");
    });
}

/// The dashboard: its page (open) holds the element named "Expert residency"; its stream
/// (behind the key) starts at once with `/stats`, the expert totals and every routed
/// expert's residency; a model without an atlas answers /atlas with 404 naming the file.
#[test]
fn the_dashboard_streams_the_experts_residency() {
    use futures_util::StreamExt;
    let (st, app) = server(Some(KEY), 4);
    block_on(async {
        let page = call(&app, "GET", "/dashboard", &[], "").await;
        assert_eq!(page.status, 200);
        assert!(page.body.contains(r#"<canvas id="map" role="img" aria-label="Expert residency">"#), "{}", page.body);
        assert!(page.headers["content-security-policy"].to_str().unwrap().contains("script-src 'self'"));
        for asset in ["/ui/dashboard.js", "/ui/api.js"] {
            assert_eq!(call(&app, "GET", asset, &[], "").await.status, 200, "{asset}");
        }
        assert_eq!(call(&app, "GET", "/stats/stream", &[], "").await.status, 401);
        let bearer = format!("Bearer {KEY}");
        let req = Request::builder().uri("/stats/stream").header("authorization", &bearer).body(Body::empty()).unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let first = resp.into_body().into_data_stream().next().await.unwrap().unwrap();
        let text = String::from_utf8_lossy(&first).to_string();
        let data: Value = serde_json::from_str(text.trim().strip_prefix("data: ").expect(&text)).unwrap();
        assert_eq!(data["stats"]["model"]["id"], st.model_id);
        let r = &data["residency"];
        let layers = r["layers"].as_array().unwrap().len();
        assert!(layers > 0 && r["tiers"].as_array().unwrap().len() == layers, "{r}");
        let n = r["experts_per_layer"].as_u64().unwrap() as usize;
        for row in r["tiers"].as_array().unwrap() {
            let row = row.as_str().unwrap();
            assert_eq!(row.len(), n);
            assert!(row.chars().all(|c| "ghdrGHDR".contains(c)), "{row}");
        }
        assert_eq!(data["atlas"], false);
        let atlas = call(&app, "GET", "/atlas", &[], "").await;
        assert_eq!(atlas.status, 404);
        assert!(atlas.body.contains("atlas.html"), "{}", atlas.body);
    });
}

/// A model directory with an atlas: its page and its topics are served; a corrupt
/// `atlas.json` is a 500 naming the file, not a crash or an empty answer.
#[test]
fn the_atlas_is_served_and_a_corrupt_one_named() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse");
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    std::fs::create_dir(dir.path().join("atlas")).unwrap();
    let atlas = dir.path().join("atlas/atlas.json");
    std::fs::write(&atlas, r#"{"categories": ["code"], "experts": [{"layer": 1, "expert": 3, "top_topic": "code", "specialization": 0.5}]}"#)
        .unwrap();
    std::fs::write(dir.path().join("atlas/atlas.html"), "<html>atlas</html>").unwrap();
    let st = strata_server::state(LoadedModel::open(dir.path()).unwrap(), None, 4);
    let app = strata_server::router(st.clone());
    block_on(async {
        assert_eq!(strata_server::dashboard::snapshot(&st)["atlas"], true);
        let page = call(&app, "GET", "/atlas", &[], "").await;
        assert_eq!((page.status, page.body.as_str()), (StatusCode::OK, "<html>atlas</html>"));
        let topics = call(&app, "GET", "/stats/atlas", &[], "").await;
        assert_eq!(topics.json()["experts"], json!([[1, 3, "code", 0.5]]));
        std::fs::write(&atlas, "{not json").unwrap();
        let bad = call(&app, "GET", "/stats/atlas", &[], "").await;
        assert_eq!(bad.status, 500);
        assert!(bad.json()["error"]["message"].as_str().unwrap().contains("atlas.json: not JSON"), "{}", bad.body);
    });
}

#[test]
fn bad_requests_are_400_in_each_api_shape() {
    let (st, app) = server(None, 4);
    block_on(async {
        let cases = [
            ("/v1/chat/completions", "{\"messages\": ["),
            ("/v1/chat/completions", "[]"),
            ("/v1/chat/completions", "{\"messages\": \"hi\"}"),
            ("/v1/chat/completions", "{\"messages\": []}"),
            (
                "/v1/chat/completions",
                "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"model\": \"other\"}",
            ),
            ("/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_p\": 0}"),
            ("/v1/completions", "{\"prompt\": {}}"),
            ("/v1/completions", "{\"prompt\": [1, 99999]}"),
            ("/v1/responses", "{\"input\": 5}"),
            ("/v1/responses", "{\"input\": \"x\", \"previous_response_id\": \"resp_1\"}"),
            ("/tokenize", "{}"),
        ];
        for (path, body) in cases {
            let r = call(&app, "POST", path, &[], body).await;
            assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
            let e = &r.json()["error"];
            assert_eq!(e["type"], "invalid_request_error", "{path} {body}");
            assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
        for body in [
            "{\"messages\": [",
            "{\"max_tokens\": 5, \"messages\": []}",
            "{\"messages\": [{\"role\": \"system\", \"content\": \"x\"}]}",
        ] {
            let r = call(&app, "POST", "/v1/messages", &[], body).await;
            assert_eq!(r.status, 400, "{body}: {}", r.body);
            assert_eq!(r.json()["type"], "error");
            assert_eq!(r.json()["error"]["type"], "invalid_request_error");
        }
        // A prompt the context cannot hold.
        let long = "hello ".repeat(st.max_context() + 10);
        let r = post(&app, "/v1/chat/completions", json!({"messages": user(&long)})).await;
        assert_eq!(r.status, 400);
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
        let r = post(&app, "/v1/messages", json!({"max_tokens": 5, "messages": user(&long)})).await;
        assert_eq!((r.status.as_u16(), r.json()["error"]["type"].clone()), (400, json!("invalid_request_error")));
        assert_eq!(call(&app, "GET", "/nope", &[], "").await.status, 404);
        let r = call(&app, "GET", "/v1/chat/completions", &[], "").await;
        assert_eq!((r.status.as_u16(), r.json()["error"]["type"].clone()), (405, json!("invalid_request_error")));
        let huge = "x".repeat(strata_server::MAX_BODY_BYTES + 1);
        let r = call(&app, "POST", "/v1/messages", &[], &huge).await;
        assert_eq!((r.status.as_u16(), r.json()["error"]["type"].clone()), (413, json!("request_too_large")));
        // Nothing above reached the worker.
        assert_eq!(st.metrics.generations.load(Ordering::SeqCst), 0);
    });
}

#[test]
fn chat_whole_and_streamed_agree() {
    let (_, app) = server(None, 4);
    block_on(async {
        let req = json!({"messages": user("Hello"), "max_tokens": 12, "temperature": 0});
        let whole = post(&app, "/v1/chat/completions", req.clone()).await;
        assert_eq!(whole.status, 200, "{}", whole.body);
        let w = whole.json();
        let text = w["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        assert!(w["usage"]["completion_tokens"].as_u64().unwrap() <= 12);

        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        sreq["stream_options"] = json!({"include_usage": true});
        let s = post(&app, "/v1/chat/completions", sreq).await;
        assert_eq!(s.headers["content-type"], "text/event-stream");
        let events = s.events();
        assert_eq!(events.last().unwrap().1, "[DONE]");
        let chunks: Vec<Value> =
            events[..events.len() - 1].iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(streamed, text);
        let usage_chunk = chunks.last().unwrap();
        assert_eq!(usage_chunk["choices"], json!([]));
        assert_eq!(usage_chunk["usage"]["completion_tokens"], w["usage"]["completion_tokens"]);
        let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
        assert_eq!(finish, &w["choices"][0]["finish_reason"]);
    });
}

#[test]
fn anthropic_stream_follows_the_event_grammar() {
    let (_, app) = server(None, 4);
    block_on(async {
        let req = json!({"system": "Be terse.", "messages": user("Hi"), "max_tokens": 8, "temperature": 0,
                         "stream": true});
        let r = post(&app, "/v1/messages", req).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let events = r.events();
        let names: Vec<&str> = events.iter().map(|e| e.0.as_deref().unwrap()).collect();
        assert_eq!(names[..2], ["message_start", "ping"]);
        assert_eq!(names[2], "content_block_start");
        assert!(names[3..names.len() - 3].iter().all(|n| *n == "content_block_delta"), "{names:?}");
        assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
        for (name, data) in &events {
            let v: Value = serde_json::from_str(data).unwrap();
            assert_eq!(v["type"], name.as_deref().unwrap(), "the event name repeats the data's type");
        }
        let delta: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
        assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
        assert_eq!(delta["usage"]["output_tokens"], 8);
    });
}

#[test]
fn responses_stream_numbers_its_events() {
    let (_, app) = server(None, 4);
    block_on(async {
        let req = json!({"input": "Hi", "instructions": "Be terse.", "max_output_tokens": 6, "stream": true,
                         "temperature": 0});
        let r = post(&app, "/v1/responses", req).await;
        let events = r.events();
        let datas: Vec<Value> = events.iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
        for (i, d) in datas.iter().enumerate() {
            assert_eq!(d["sequence_number"], i);
            assert_eq!(d["type"], events[i].0.as_deref().unwrap());
        }
        assert_eq!(datas[0]["type"], "response.created");
        let last = datas.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(last["response"]["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(last["response"]["usage"]["output_tokens"], 6);
        let deltas: String = datas.iter().filter_map(|d| d["delta"].as_str()).collect();
        assert_eq!(last["response"]["output"][0]["content"][0]["text"], deltas);
    });
}

/// A GLM-style template that renders tool schemas, the assistant's tool calls and the
/// tool results, to show that each reaches the template.
const TOOL_TEMPLATE: &str = "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}\n{{ m.content }}{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}{% for k, v in tc.function.arguments | items %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response>{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}<|assistant|>{% if think %}<think>{% endif %}";

#[test]
fn tools_calls_and_results_reach_the_template() {
    let mut model = fixture();
    model.chat_template = Some(ChatTemplate::new(TOOL_TEMPLATE, String::new(), String::new()).unwrap());
    let st = strata_server::state(model, None, 4);
    let app = strata_server::router(st);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "reasoning_content": "Use the tool.", "tool_calls": [{"id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
    ]);
    block_on(async {
        let t = post(&app, "/tokenize", json!({"messages": messages, "tools": tools})).await.json();
        let p = t["prompt"].as_str().unwrap();
        assert!(p.contains("\"name\": \"get_weather\"") && p.contains("Weather now"), "{p}");
        assert!(
            p.contains("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
            "{p}"
        );
        assert!(p.contains("<tool_response>call_7: sunny</tool_response>"), "{p}");
        assert!(p.contains("<|assistant|><think>Use the tool.</think>"), "{p}");
        let r =
            post(&app, "/v1/chat/completions", json!({"messages": messages, "tools": tools, "max_tokens": 4})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["usage"]["prompt_tokens"], t["count"]);
        // The same conversation through Anthropic's blocks renders to the same prompt.
        let anthropic = json!({"max_tokens": 4, "tools": [{"name": "get_weather", "description": "Weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                                              {"type": "tool_use", "id": "call_7", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_7", "content": "sunny"}]},
        ]});
        let n = post(&app, "/v1/messages/count_tokens", anthropic).await.json();
        assert_eq!(n["input_tokens"], t["count"]);
    });
}

fn long_request(st: &Shared) -> ServeRequest {
    let ids = st.tokenize("a", true).unwrap();
    let room = st.max_context() - ids.len();
    ServeRequest::new(GenerateRequest {
        eos_token_ids: vec![],
        ..GenerateRequest::new(ids, room, SamplingParams::default())
    })
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let opts = strata_server::ServeOptions { queue: 1, max_batch: 1, ..Default::default() };
    let st = strata_server::state_opts(fixture(), &opts);
    let app = strata_server::router(st.clone());
    block_on(async {
        // One running (its first delta has arrived), one waiting: the queue is full.
        let mut running = st.worker.submit(long_request(&st)).unwrap();
        assert!(matches!(running.recv().await, Some(Event::Delta { .. })));
        let _waiting = st.worker.submit(long_request(&st)).unwrap();
        let r = post(&app, "/v1/chat/completions", json!({"messages": user("x"), "max_tokens": 2})).await;
        assert_eq!(r.status, 429, "{}", r.body);
        assert_eq!(r.headers["retry-after"], "1");
        assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
        let r = post(&app, "/v1/messages", json!({"messages": user("x"), "max_tokens": 2})).await;
        assert_eq!((r.status.as_u16(), r.json()["error"]["type"].clone()), (429, json!("rate_limit_error")));
        assert_eq!(st.metrics.rejected.load(Ordering::SeqCst), 2);
        let metrics = call(&app, "GET", "/metrics", &[], "").await.body;
        assert!(metrics.contains("strata_requests_rejected_total 2"), "{metrics}");
        // One waits while the other runs (unless the running one has finished already).
        assert!(
            metrics.contains("strata_queue_depth 1") || !metrics.contains("strata_generations_total 0"),
            "{metrics}"
        );
    });
}

#[test]
fn a_client_that_goes_away_cancels_its_generation() {
    let (st, _) = server(None, 4);
    block_on(async {
        let mut rx = st.worker.submit(long_request(&st)).unwrap();
        assert!(matches!(rx.recv().await, Some(Event::Delta { .. })));
        drop(rx);
        let t0 = Instant::now();
        while st.metrics.cancelled.load(Ordering::SeqCst) == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the generation was not cancelled");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let last = st.metrics.last.lock().unwrap().clone().unwrap();
        assert_eq!(last.finish_reason, "cancelled");
        assert!(last.generated_tokens < st.max_context() - 2);
    });
}

/// A reasoning model whose prompt opens `<think>`: everything the (random) model says
/// before a `</think>` is reasoning, in each API's own form.
#[test]
fn reasoning_is_reported_apart_from_the_answer() {
    use std::sync::Arc;
    use strata_server::common::AppState;
    use strata_server::metrics::Metrics;
    use strata_server::worker::Worker;
    let mut model = fixture();
    let source = TOOL_TEMPLATE.replace("{% if think %}<think>{% endif %}", "<think>");
    model.chat_template = Some(ChatTemplate::new(&source, String::new(), String::new()).unwrap());
    let model = Arc::new(model);
    let metrics = Arc::new(Metrics::default());
    let engine = strata_engine::serving::EngineOptions {
        max_batch: 4,
        kv_tokens: 1024,
        context: 256,
        step_tokens: 64,
        prompt_cache_bytes: 1 << 20,
        kv_bytes_per_token: model.arch.kv_bytes_per_token(),
        draft_tokens: 0,
    };
    let st = Arc::new(AppState {
        model_id: "m".into(),
        worker: Worker::start(model.clone(), 4, engine, metrics.clone(), false),
        grammars: strata_server::grammar::Grammars::new(model.clone()).map_err(|e| e.to_string()),
        model,
        api_key: None,
        metrics,
        started: Instant::now(),
        created: 0,
        markers_special: false,
        reasoning: true,
        syntax: Default::default(),
        allow_private_media: false,
        context: 256,
        cors: vec![],
        max_body: strata_server::MAX_BODY_BYTES,
        max_prompt_bytes: usize::MAX,
        draft_tokens: 0,
        draft_policy: Default::default(),
    });
    let app = strata_server::router(st);
    block_on(async {
        let req = json!({"messages": user("Hi"), "max_tokens": 10, "temperature": 0});
        let r = post(&app, "/v1/chat/completions", req.clone()).await.json();
        let reasoning = r["choices"][0]["message"]["reasoning_content"].as_str().unwrap().to_string();
        assert!(!reasoning.is_empty() && !reasoning.contains("</think>"), "{r}");
        assert_eq!(r["choices"][0]["message"]["content"], "");
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let s = post(&app, "/v1/chat/completions", sreq).await;
        let streamed: String = s
            .events()
            .iter()
            .filter(|e| e.1 != "[DONE]")
            .filter_map(|e| {
                serde_json::from_str::<Value>(&e.1).unwrap()["choices"][0]["delta"]["reasoning_content"]
                    .as_str()
                    .map(String::from)
            })
            .collect();
        assert_eq!(streamed.trim_end(), reasoning);

        let m = post(&app, "/v1/messages", req.clone()).await.json();
        assert_eq!(m["content"][0]["type"], "thinking", "{m}");
        assert_eq!(m["content"][0]["thinking"], reasoning.as_str());
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let events = post(&app, "/v1/messages", sreq).await.events();
        let start: Value = serde_json::from_str(&events[2].1).unwrap();
        assert_eq!(start["content_block"]["type"], "thinking");
        let deltas: Vec<Value> = events
            .iter()
            .filter(|e| e.0.as_deref() == Some("content_block_delta"))
            .map(|e| serde_json::from_str(&e.1).unwrap())
            .collect();
        assert!(deltas.iter().all(|d| d["delta"]["type"] == "thinking_delta"));

        let resp =
            post(&app, "/v1/responses", json!({"input": "Hi", "max_output_tokens": 10, "temperature": 0})).await.json();
        assert_eq!(resp["output"][0]["type"], "reasoning", "{resp}");
        assert_eq!(resp["output"][0]["content"][0]["text"], reasoning.as_str());
        assert_eq!(resp["output"][1]["type"], "message");
        let events = post(
            &app,
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 10, "temperature": 0, "stream": true}),
        )
        .await
        .events();
        let names: Vec<&str> = events.iter().map(|e| e.0.as_deref().unwrap()).collect();
        assert!(
            names.contains(&"response.reasoning_text.delta") && names.contains(&"response.reasoning_text.done"),
            "{names:?}"
        );
        let last: Value = serde_json::from_str(&events.last().unwrap().1).unwrap();
        assert_eq!(last["response"]["output"][0]["type"], "reasoning");
        assert_eq!(last["response"]["output"][1]["type"], "message");
    });
}

/// Under a memory budget the experts stream: each generation ends an expert-runtime
/// turn, whose counters reach `/metrics` and whose plan and report reach `/stats`.
#[test]
fn streamed_experts_report_their_traffic() {
    use strata_engine::experts::{RuntimeOptions, UsageSetting};
    use strata_engine::LoadOptions;
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let opts = LoadOptions {
        device: strata_engine::Device::Cpu,
        mtp: false,
        require_mtp: false,
        budget: Some(u64::MAX / 4),
        gpu_budget: None,
        context: 128,
        runtime: RuntimeOptions { working_slots: 4, usage: UsageSetting::Off, ..Default::default() },
    };
    let model = LoadedModel::open_with(dir.path(), &opts).unwrap();
    assert!(model.experts.is_some());
    let st = strata_server::state_with(model, None, 4, Some(opts.context));
    let app = strata_server::router(st.clone());
    block_on(async {
        assert_eq!(st.max_context(), 128);
        let r = post(&app, "/v1/chat/completions", json!({"messages": user("Hi"), "max_tokens": 8})).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let t0 = Instant::now();
        while st.metrics.experts.lock().unwrap().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no expert turn recorded");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let metrics = call(&app, "GET", "/metrics", &[], "").await.body;
        let value = |name: &str| -> f64 {
            let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {metrics}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert_eq!(value("strata_expert_turns_total "), 1.0);
        assert!(value("strata_expert_hits_total ") + value("strata_expert_misses_total ") > 0.0, "{metrics}");
        assert!(value("strata_expert_read_bytes_total{cause=\"demand\"}") > 0.0, "{metrics}");
        let stats = call(&app, "GET", "/stats", &[], "").await.json();
        assert!(stats["plan"]["fit"]["report"]["fits"].as_bool().unwrap(), "{stats}");
        assert!(stats["experts"]["turn"]["demand"]["misses"].as_u64().is_some(), "{stats}");
        // The plan reserved KV cache for 128 positions: longer prompts are refused.
        let long = "hello ".repeat(200);
        let r = post(&app, "/v1/chat/completions", json!({"messages": user(&long)})).await;
        assert_eq!(r.status, 400);
        assert!(r.json()["error"]["message"].as_str().unwrap().contains("128"), "{}", r.body);
    });
}

#[test]
fn bodies_are_bounded_and_hopeless_prompts_refused_before_tokenizing() {
    let opts =
        strata_server::ServeOptions { queue: 4, context_limit: Some(64), max_body: 64 << 10, ..Default::default() };
    let st = strata_server::state_opts(fixture(), &opts);
    let app = strata_server::router(st.clone());
    block_on(async {
        // Over the limit: 413 naming it, declared length or not.
        let big = format!("{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}", "x".repeat(70 << 10));
        let r = call(&app, "POST", "/v1/chat/completions", &[("content-type", "application/json")], &big).await;
        assert_eq!(r.status, 413, "{}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("limit of 65536 bytes") && msg.contains("--max-body"), "{msg}");
        let r = call(&app, "POST", "/v1/messages", &[], &big).await;
        assert_eq!((r.status.as_u16(), r.json()["error"]["type"].clone()), (413, json!("request_too_large")));
        // Under the limit but far beyond what 64 tokens can say: 400 before tokenizing.
        let per_token = st.model.tokenizer.as_ref().unwrap().max_token_bytes();
        assert!(st.max_prompt_bytes == 64 * per_token * 2, "{} for {per_token}", st.max_prompt_bytes);
        let long = "y".repeat(st.max_prompt_bytes + 1);
        for (path, body) in [
            ("/v1/chat/completions", json!({"messages": user(&long)})),
            ("/v1/completions", json!({"prompt": long})),
            ("/v1/messages", json!({"max_tokens": 4, "messages": user(&long)})),
        ] {
            let r = post(&app, path, body).await;
            assert_eq!(r.status, 400, "{path}: {}", r.body);
            let err = &r.json()["error"];
            assert!(err["message"].as_str().unwrap().contains("more than this model's context of 64 tokens"), "{err}");
        }
        // A normal request still works.
        let r = post(&app, "/v1/chat/completions", json!({"messages": user("Hi"), "max_tokens": 2})).await;
        assert_eq!(r.status, 200, "{}", r.body);
    });
}

#[test]
fn shutdown_ends_running_streams_properly_and_refuses_queued_ones() {
    // No EOS: only the context or the shutdown can end this generation. The fixture
    // decodes its whole context in a few milliseconds, so a run where the context won
    // the race (a machine that descheduled the watcher) is retried on a fresh server;
    // every run must still end well-formed, and one must end by the shutdown.
    let mut ended_by_shutdown = false;
    for _ in 0..8 {
        let mut model = fixture();
        model.eos_token_ids.clear();
        let st = strata_server::state(model, None, 4);
        let app = strata_server::router(st.clone());
        let finish = block_on(async {
            let stopper = st.clone();
            let watcher = std::thread::spawn(move || {
                let t0 = Instant::now();
                while stopper.metrics.active.load(Ordering::SeqCst) == 0 {
                    assert!(t0.elapsed() < Duration::from_secs(20), "the generation never started");
                    std::thread::yield_now();
                }
                stopper.worker.shut_down();
            });
            let req = json!({"messages": user("Tell me everything"), "max_tokens": 100000, "stream": true,
                             "temperature": 0, "stream_options": {"include_usage": true}});
            let r = post(&app, "/v1/chat/completions", req.clone()).await;
            watcher.join().unwrap();
            assert_eq!(r.status, 200);
            let events = r.events();
            assert_eq!(events.last().unwrap().1, "[DONE]", "{}", r.body);
            let last = events.iter().rev().find(|(_, d)| d.contains("finish_reason\":\"")).expect(&r.body);
            let chunk: Value = serde_json::from_str(&last.1).unwrap();
            let finish = chunk["choices"][0]["finish_reason"].as_str().unwrap().to_string();
            let usage = events.iter().rev().find(|(_, d)| d.contains("\"usage\":{")).expect(&r.body);
            let usage: Value = serde_json::from_str(&usage.1).unwrap();
            let total = usage["usage"]["total_tokens"].as_u64().unwrap() as usize;
            match finish.as_str() {
                "stop" => assert!(total < st.max_context(), "a stop at the context: {usage}"),
                "length" => assert_eq!(total, st.max_context(), "a length finish short of the context: {usage}"),
                other => panic!("finish_reason {other}: {}", last.1),
            }
            // After shutdown, new work is refused with a message, not run.
            let r = post(&app, "/v1/chat/completions", json!({"messages": user("Hi"), "max_tokens": 2})).await;
            assert!(r.status.is_server_error(), "{}", r.body);
            assert!(r.body.contains("shutting down"), "{}", r.body);
            finish
        });
        if finish == "stop" {
            ended_by_shutdown = true;
            break;
        }
    }
    assert!(ended_by_shutdown, "in 8 runs the shutdown never ended a running stream before its context did");
}
