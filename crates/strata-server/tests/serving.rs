//! Serving many users on the fixture model (random weights): concurrent requests answer
//! as they would alone, the prompt cache is reported, structured output and forced tool
//! calls hold, and every request field is honoured or refused by name.

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use std::path::PathBuf;
use strata_engine::LoadedModel;
use tower::ServiceExt;

fn fixture() -> LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse");
    LoadedModel::open(&dir).expect("open the fixture model")
}

fn app(opts: strata_server::ServeOptions) -> Router {
    strata_server::router(strata_server::state_opts(fixture(), &opts))
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(f)
}

async fn send(
    app: &Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, axum::http::HeaderMap, String) {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = app.clone().oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (status, headers, String::from_utf8_lossy(&bytes).into_owned())
}

async fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    let (s, _, b) = send(app, "POST", path, &[("content-type", "application/json")], &body.to_string()).await;
    (s, serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}")))
}

fn chat(text: &str, extra: Value) -> Value {
    let mut b =
        json!({"messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 1.0, "seed": 3});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[test]
fn concurrent_requests_answer_as_they_would_alone_and_share_the_prompt_cache() {
    let opts = strata_server::ServeOptions {
        max_batch: 8,
        step_tokens: Some(32),
        kv_tokens: Some(4096),
        ..Default::default()
    };
    let app = app(opts);
    block_on(async {
        let texts: Vec<String> =
            (0..6).map(|i| format!("request number {i} asks something {}", "long ".repeat(i * 8))).collect();
        let mut alone = Vec::new();
        for t in &texts {
            let (s, r) = post(&app, "/v1/chat/completions", chat(t, json!({}))).await;
            assert_eq!(s, 200, "{r}");
            alone.push(r["choices"][0]["message"]["content"].clone());
        }
        let together = futures_util::future::join_all(
            texts.iter().map(|t| post(&app, "/v1/chat/completions", chat(t, json!({})))),
        )
        .await;
        for ((s, r), a) in together.iter().zip(&alone) {
            assert_eq!(*s, 200);
            assert_eq!(&r["choices"][0]["message"]["content"], a, "batched output differs from running alone");
            // The prompts were seen before: their full blocks came from the prompt cache.
            let p = r["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(
                r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
                (p - 1) / 16 * 16,
                "{r}"
            );
        }
        // Anthropic reports cache reads apart from the computed input.
        let m = json!({"max_tokens": 4, "messages": [{"role": "user", "content": texts[5]}]});
        let (_, first) = post(&app, "/v1/messages", m.clone()).await;
        let (_, again) = post(&app, "/v1/messages", m).await;
        let u = &again["usage"];
        assert!(u["cache_read_input_tokens"].as_u64().unwrap() > 0, "{again}");
        let total = first["usage"]["input_tokens"].as_u64().unwrap()
            + first["usage"]["cache_read_input_tokens"].as_u64().unwrap();
        assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), total);
        // n choices: rows of one batch, choice i seeded seed + i.
        let (s, r) = post(&app, "/v1/chat/completions", chat(&texts[0], json!({"n": 2, "seed": 3}))).await;
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["choices"].as_array().unwrap().len(), 2);
        assert_eq!(r["choices"][0]["message"]["content"], alone[0]);
        assert_eq!(r["choices"][1]["index"], 1);
    });
}

fn is_json_object(text: &str) -> Value {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    assert!(v.is_object(), "{text}");
    v
}

/// A template that reads `tools` but shows only their names (the fixture's context of
/// 256 positions cannot hold whole schemas).
const NAMES_TEMPLATE: &str = "[gMASK]<sop>{% if tools %}<|system|>\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>";

#[test]
fn structured_output_and_forced_tool_calls_hold() {
    let mut model = fixture();
    model.chat_template = Some(strata_engine::ChatTemplate::new(NAMES_TEMPLATE, String::new(), String::new()).unwrap());
    let app = strata_server::router(strata_server::state_opts(model, &strata_server::ServeOptions::default()));
    block_on(async {
        let schema = json!({"type": "object", "additionalProperties": false, "required": ["name", "age", "ok"],
            "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "ok": {"type": "boolean"}}});
        for seed in 0..4 {
            let rf =
                json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}});
            let (s, r) = post(
                &app,
                "/v1/chat/completions",
                chat("Who?", json!({"response_format": rf, "max_tokens": 60, "seed": seed})),
            )
            .await;
            assert_eq!(s, 200, "{r}");
            assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
            let v = is_json_object(r["choices"][0]["message"]["content"].as_str().unwrap());
            assert!(
                v["name"].as_str().unwrap().chars().count() <= 6
                    && v["age"].as_i64().unwrap() <= 120
                    && v["ok"].is_boolean(),
                "{v}"
            );
        }
        // A regular expression and a Lark grammar (extensions).
        let (_, r) = post(
            &app,
            "/v1/chat/completions",
            chat("Code?", json!({"response_format": {"type": "regex", "regex": "[A-Z]{3}-[0-9]{2}"}})),
        )
        .await;
        let code = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        assert!(code.len() == 6 && code.as_bytes()[3] == b'-', "{r}");
        let lark = "start: \"yes\" | \"no\"";
        let (_, r) = post(
            &app,
            "/v1/completions",
            json!({"prompt": "Answer:", "max_tokens": 5, "response_format": {"type": "grammar", "grammar": lark}}),
        )
        .await;
        assert!(["yes", "no"].contains(&r["choices"][0]["text"].as_str().unwrap()), "{r}");
        // Responses: text.format.
        let (s, r) = post(
            &app,
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 60,
            "text": {"format": {"type": "json_schema", "name": "p", "schema": schema}}}),
        )
        .await;
        assert_eq!(s, 200, "{r}");
        is_json_object(r["output"][0]["content"][0]["text"].as_str().unwrap());
        // A bad schema or grammar is a 400 naming the field.
        let (s, r) = post(
            &app,
            "/v1/chat/completions",
            chat("x", json!({"response_format": {"type": "grammar", "grammar": "start: nope"}})),
        )
        .await;
        assert_eq!((s.as_u16(), r["error"]["param"].as_str()), (400, Some("response_format")), "{r}");

        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "required": ["city", "days"],
                "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
        ]);
        for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
            let body = chat(
                "Weather?",
                json!({"tools": tools, "tool_choice": choice, "max_tokens": 200, "parallel_tool_calls": false}),
            );
            let (s, r) = post(&app, "/v1/chat/completions", body).await;
            assert_eq!(s, 200, "{r}");
            assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
            let call = &r["choices"][0]["message"]["tool_calls"][0]["function"];
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
            if call["name"] == "get_weather" {
                assert!(args["city"].is_string() && (1..=9).contains(&args["days"].as_i64().unwrap()), "{args}");
            } else {
                assert_eq!(call["name"], "get_time");
                assert!(choice == "required");
            }
        }
        let anthropic_tools = json!([{"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}]);
        let (s, r) = post(
            &app,
            "/v1/messages",
            json!({"max_tokens": 150, "tools": anthropic_tools, "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Time?"}]}),
        )
        .await;
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["stop_reason"], "tool_use", "{r}");
        let call = r["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").unwrap().clone();
        assert!(["UTC", "CET"].contains(&call["input"]["zone"].as_str().unwrap()), "{call}");
        let (s, r) = post(
            &app,
            "/v1/chat/completions",
            chat("x", json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}})),
        )
        .await;
        assert_eq!((s.as_u16(), r["error"]["param"].as_str()), (400, Some("tool_choice")));
    });
}

#[test]
fn logprobs_penalties_and_limits_are_honoured() {
    let app = app(strata_server::ServeOptions::default());
    block_on(async {
        let (s, r) = post(
            &app,
            "/v1/chat/completions",
            chat("Hi", json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 5, "ignore_eos": true})),
        )
        .await;
        assert_eq!(s, 200, "{r}");
        let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len() as u64, r["usage"]["completion_tokens"].as_u64().unwrap());
        for c in content {
            let top = c["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            assert!(c["logprob"].as_f64().unwrap() <= 0.0 && top[0]["logprob"].as_f64() >= top[2]["logprob"].as_f64());
            assert!(c["token"].is_string() && c["bytes"].is_array());
        }
        let (_, r) = post(
            &app,
            "/v1/completions",
            json!({"prompt": "a b", "max_tokens": 4, "logprobs": 2, "ignore_eos": true, "min_tokens": 4}),
        )
        .await;
        let lp = &r["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"].as_array().unwrap().len(), 4, "{r}");
        assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
        assert_eq!(r["usage"]["completion_tokens"], 4);
        // logit_bias forces a token; penalties are accepted and change nothing here.
        let (_, r) = post(
            &app,
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 3, "logit_bias": {"65": 100}, "temperature": 0,
            "frequency_penalty": 0.5, "presence_penalty": 0.5}),
        )
        .await;
        assert_eq!(r["usage"]["completion_tokens"], 3, "{r}");
        let (_, t) =
            post(&app, "/tokenize", json!({"prompt": r["choices"][0]["text"], "add_special_tokens": false})).await;
        assert!(t["tokens"].as_array().unwrap().iter().all(|x| x == 65), "{t}");
        // Responses: cut by max_output_tokens means incomplete, items too.
        let (_, r) =
            post(&app, "/v1/responses", json!({"input": "Hi", "max_output_tokens": 2, "ignore_eos": true})).await;
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["output"][0]["status"], "incomplete", "{r}");
        // Anthropic: a final assistant message is continued, not answered anew.
        let (_, t1) = post(
            &app,
            "/v1/messages/count_tokens",
            json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]}),
        )
        .await;
        let (_, t0) =
            post(&app, "/v1/messages/count_tokens", json!({"messages": [{"role": "user", "content": "Hi"}]})).await;
        assert!(t1["input_tokens"].as_u64() > t0["input_tokens"].as_u64());
        let (s, _) = post(&app, "/v1/messages", json!({"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]})).await;
        assert_eq!(s, 200);
    });
}

#[test]
fn fields_are_honoured_or_refused_by_name() {
    let app = app(strata_server::ServeOptions {
        api_key: Some("k".into()),
        cors: vec!["https://a.example".into()],
        ..Default::default()
    });
    block_on(async {
        let auth = [("content-type", "application/json"), ("authorization", "bearer k")];
        let cases = [
            ("/v1/chat/completions", chat("x", json!({"frequency_penalty": 3})), "frequency_penalty"),
            ("/v1/chat/completions", chat("x", json!({"temperature": 2.5})), "temperature"),
            ("/v1/chat/completions", chat("x", json!({"top_logprobs": 30, "logprobs": true})), "top_logprobs"),
            ("/v1/chat/completions", chat("x", json!({"top_logprobs": 2})), "top_logprobs"),
            ("/v1/chat/completions", chat("x", json!({"n": 0})), "n"),
            ("/v1/chat/completions", chat("x", json!({"store": true})), "store"),
            ("/v1/chat/completions", chat("x", json!({"audio": {"voice": "x"}})), "audio"),
            ("/v1/chat/completions", chat("x", json!({"wat": 1})), "wat"),
            ("/v1/chat/completions", chat("x", json!({"max_tokens": "ten"})), "max_tokens"),
            ("/v1/chat/completions", chat("x", json!({"min_tokens": 40})), "min_tokens"),
            ("/v1/chat/completions", chat("x", json!({"logit_bias": {"1": 200}})), "logit_bias.1"),
            ("/v1/completions", json!({"prompt": "x", "suffix": "y"}), "suffix"),
            ("/v1/completions", json!({"prompt": "x", "best_of": 3}), "best_of"),
            ("/v1/responses", json!({"input": "x", "truncation": "auto"}), "truncation"),
            ("/v1/responses", json!({"input": "x", "text": {"verbosity": "low"}}), "text.verbosity"),
        ];
        for (path, body, field) in cases {
            let (s, _, b) = send(&app, "POST", path, &auth, &body.to_string()).await;
            let r: Value = serde_json::from_str(&b).unwrap();
            assert_eq!(s, 400, "{path} {body}: {b}");
            assert_eq!(r["error"]["param"].as_str(), Some(field), "{path} {body}: {b}");
            assert!(r["error"]["message"].as_str().unwrap().contains(field), "{b}");
        }
        let anthropic = [
            (json!({"messages": [{"role": "user", "content": "x"}]}), "max_tokens"),
            (
                json!({"max_tokens": 2, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}),
                "temperature",
            ),
            (
                json!({"max_tokens": 2, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]}),
                "tool_choice",
            ),
        ];
        for (body, field) in anthropic {
            let (s, _, b) = send(
                &app,
                "POST",
                "/v1/messages",
                &[("content-type", "application/json"), ("x-api-key", "k")],
                &body.to_string(),
            )
            .await;
            assert_eq!(s, 400, "{body}: {b}");
            assert!(b.contains(field) && b.contains("invalid_request_error"), "{b}");
        }
        // CORS: a preflight is answered before auth; answers carry the origin.
        let (s, h, _) = send(
            &app,
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("origin", "https://a.example"),
                ("access-control-request-method", "POST"),
                ("access-control-request-headers", "authorization,content-type"),
            ],
            "",
        )
        .await;
        assert!(s.is_success(), "{s}");
        assert_eq!(h["access-control-allow-origin"], "https://a.example");
        let (s, h, _) =
            send(&app, "GET", "/v1/models", &[("origin", "https://a.example"), ("authorization", "BEARER k")], "")
                .await;
        assert_eq!(s, 200);
        assert_eq!(h["access-control-allow-origin"], "https://a.example");
        let (_, h, _) = send(&app, "GET", "/health", &[("origin", "https://b.example")], "").await;
        assert!(h.get("access-control-allow-origin").is_none());
    });
}

/// strata-tiny carries a draft (MTP) layer: the server drafts by default, answers
/// concurrent greedy requests with the text of a server that does not, reports the
/// speculation in each usage (OpenAI and Anthropic), `/metrics` and `/stats`, and runs
/// a grammar-constrained request (which decodes one token a step) beside them.
#[test]
fn the_server_speculates_with_the_draft_layer_and_reports_it() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    let opts = strata_server::ServeOptions {
        max_batch: 4,
        step_tokens: Some(32),
        draft_policy: strata_engine::DraftPolicy::Fixed,
        ..Default::default()
    };
    let spec = strata_server::state_opts(LoadedModel::open(&dir).unwrap(), &opts);
    assert_eq!(spec.draft_tokens, 3, "on by default where the layer is loaded");
    let off = strata_server::ServeOptions { draft_tokens: Some(0), ..opts.clone() };
    let plain = strata_server::router(strata_server::state_opts(LoadedModel::open(&dir).unwrap(), &off));
    let app = strata_server::router(spec);
    block_on(async {
        let texts = ["In the beginning God created", "The quick brown fox", "def main():"];
        let body = |t: &str| json!({"prompt": t, "max_tokens": 24, "temperature": 0});
        let runs = texts.iter().map(|t| post(&app, "/v1/completions", body(t)));
        let got = futures_util::future::join_all(runs).await;
        let (mut drafted, mut accepted) = (0, 0);
        for (t, (status, r)) in texts.iter().zip(&got) {
            assert_eq!(*status, 200, "{r}");
            let (_, want) = post(&plain, "/v1/completions", body(t)).await;
            assert_eq!(r["choices"][0]["text"], want["choices"][0]["text"], "{t}");
            assert!(want["usage"].get("mtp").is_none(), "{want}");
            let mtp = &r["usage"]["mtp"];
            assert_eq!((mtp["draft_tokens"].as_u64(), mtp["policy"].as_str()), (Some(3), Some("fixed")), "{r}");
            drafted += mtp["drafted"].as_u64().unwrap();
            accepted += mtp["accepted"].as_u64().unwrap();
        }
        assert!(accepted as f64 > 0.3 * drafted as f64, "{accepted} of {drafted} drafts accepted");
        let (status, r) = post(
            &app,
            "/v1/messages",
            json!({"max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "Tell me a story"}]}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        assert!(r["usage"]["mtp"]["rounds"].as_u64().unwrap() > 0, "{r}");
        // A grammar follows one token at a time: no drafts, the same JSON rules.
        let (status, r) = post(
            &app,
            "/v1/chat/completions",
            chat("Say hi", json!({"response_format": {"type": "json_object"}, "max_tokens": 40})),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        assert!(r["usage"].get("mtp").is_none(), "{r}");
        let (_, _, metrics) = send(&app, "GET", "/metrics", &[], "").await;
        let value = |name: &str| -> u64 {
            let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}: {metrics}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert!(
            value("strata_mtp_drafted_total ") >= value("strata_mtp_accepted_total ")
                && value("strata_mtp_accepted_total ") > 0
        );
        assert!(value("strata_mtp_draft_forwards_total ") > 0);
        let (_, _, stats) = send(&app, "GET", "/stats", &[], "").await;
        let stats: Value = serde_json::from_str(&stats).unwrap();
        assert_eq!(stats["engine"]["draft_tokens"], 3, "{stats}");
        assert!(stats["engine"]["mtp_rounds"].as_u64().unwrap() > 0, "{stats}");
    });
}
