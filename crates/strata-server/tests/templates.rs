//! Requests reach the chat template as transformers' serving passes them: the official
//! GLM-4.7 template on the fixture model renders, from OpenAI- and Anthropic-shaped
//! requests, the prompt transformers rendered (fixtures/chat_templates/expected.json);
//! template variables are honoured or refused; tools never vanish.

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use std::path::PathBuf;
use strata_engine::{ChatTemplate, LoadedModel};
use tower::ServiceExt;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The fixture model, with the official template `name` when given.
fn app(template: Option<&str>) -> Router {
    let mut model = LoadedModel::open(&root().join("fixtures/glm5/dsa-sparse")).expect("fixture model");
    if let Some(name) = template {
        let src = std::fs::read_to_string(root().join("fixtures/chat_templates/templates").join(name)).unwrap();
        model.chat_template = Some(ChatTemplate::new(&src, String::new(), "<|endoftext|>".into()).unwrap());
    }
    strata_server::router(strata_server::state(model, None, 4))
}

fn expected(case: &str) -> (Value, String) {
    let path = root().join("fixtures/chat_templates/expected.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let c = data["cases"].as_array().unwrap().iter().find(|c| c["name"] == case).unwrap().clone();
    let want = c["expected"]["ok"].as_str().unwrap().to_string();
    (c, want)
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
}

fn post(app: &Router, path: &str, body: Value) -> Reply {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let req = Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        let (status, headers) = (resp.status(), resp.headers().clone());
        let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply { status, headers, body }
    })
}

/// The fixture's messages as an OpenAI client sends them: arguments as JSON strings.
fn openai_messages(messages: &Value) -> Value {
    let mut msgs = messages.clone();
    for m in msgs.as_array_mut().unwrap() {
        for c in m.get_mut("tool_calls").and_then(Value::as_array_mut).into_iter().flatten() {
            let args = c["function"]["arguments"].to_string();
            c["function"]["arguments"] = Value::String(args);
        }
    }
    msgs
}

#[test]
fn openai_requests_render_as_transformers_renders_them() {
    let app = app(Some("glm-4.7.jinja"));
    for case in ["glm-4.7/tool_round_trip/tools", "glm-4.7/multipart/gen", "glm-4.7/reasoning/nothink"] {
        let (c, want) = expected(case);
        let mut req = json!({"messages": openai_messages(&c["messages"])});
        if let Some(tools) = c.get("tools") {
            req["tools"] = tools.clone();
        }
        if let Some(kw) = c.get("kwargs") {
            req["chat_template_kwargs"] = kw.clone();
        }
        let r = post(&app, "/tokenize", req);
        assert_eq!(r.status, 200, "{case}: {}", r.body);
        assert_eq!(r.body["prompt"].as_str().unwrap(), want, "{case}");
        assert_eq!(r.body["tools_fallback"], Value::Null);
    }
}

#[test]
fn anthropic_blocks_map_onto_the_same_shapes() {
    let app = app(Some("glm-4.7.jinja"));
    let (c, want) = expected("glm-4.7/tool_result_then_answer/tools");
    let openai = post(&app, "/tokenize", json!({"messages": openai_messages(&c["messages"]), "tools": c["tools"]}));
    assert_eq!(openai.body["prompt"].as_str().unwrap(), want);
    let tools: Vec<Value> = c["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({"name": f["name"], "description": f["description"], "input_schema": f["parameters"]})
        })
        .collect();
    let anthropic = json!({"max_tokens": 4, "tools": tools, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "c", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "rain"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "The tool said rain.", "signature": ""},
            {"type": "text", "text": "It rains."}]},
        {"role": "user", "content": "Thanks"},
    ]});
    let n = post(&app, "/v1/messages/count_tokens", anthropic);
    assert_eq!(n.status, 200, "{}", n.body);
    assert_eq!(n.body["input_tokens"], openai.body["count"]);
}

#[test]
fn template_variables_are_honoured_or_refused() {
    let app = app(Some("glm-4.7.jinja"));
    let user = json!([{"role": "user", "content": "Hi"}]);
    let on = post(&app, "/tokenize", json!({"messages": user}));
    assert!(on.body["prompt"].as_str().unwrap().ends_with("<|assistant|><think>"), "{}", on.body);
    let off = post(&app, "/tokenize", json!({"messages": user, "chat_template_kwargs": {"enable_thinking": false}}));
    assert!(off.body["prompt"].as_str().unwrap().ends_with("<|assistant|></think>"), "{}", off.body);
    // Anthropic's `thinking` is the template's enable_thinking.
    let a = post(
        &app,
        "/v1/messages/count_tokens",
        json!({"messages": user, "thinking": {"type": "disabled"}, "max_tokens": 1}),
    );
    assert_eq!(a.body["input_tokens"], off.body["count"]);
    // A variable the template never reads, a reserved one, or a request template: 400.
    for (body, field) in [
        (json!({"messages": user, "chat_template_kwargs": {"nope": 1}}), "chat_template_kwargs.nope"),
        (json!({"messages": user, "chat_template_kwargs": {"tools": []}}), "chat_template_kwargs.tools"),
        (json!({"messages": user, "reasoning_effort": "high"}), "reasoning_effort"),
        (json!({"messages": user, "chat_template": "{{ 1 }}"}), "chat_template"),
    ] {
        let r = post(&app, "/v1/chat/completions", body);
        assert_eq!(r.status, 400, "{field}: {}", r.body);
        assert_eq!(r.body["error"]["param"], field, "{}", r.body);
    }
    let r = post(&app, "/v1/responses", json!({"input": "Hi", "reasoning": {"effort": "low"}}));
    assert_eq!((r.status.as_u16(), r.body["error"]["param"].clone()), (400, json!("reasoning.effort")));
    // No generation prompt, or continuing the assistant's last message.
    let r = post(&app, "/tokenize", json!({"messages": user, "add_generation_prompt": false}));
    assert_eq!(r.body["prompt"], "[gMASK]<sop><|user|>Hi");
    let (c, want) = expected("glm-4.7/continue_final_message");
    let r = post(&app, "/tokenize", json!({"messages": c["messages"], "continue_final_message": true}));
    assert_eq!(r.body["prompt"].as_str().unwrap(), want);
}

#[test]
fn template_errors_are_400_naming_the_line() {
    let mut model = LoadedModel::open(&root().join("fixtures/glm5/dsa-sparse")).expect("fixture model");
    let src = "{% for m in messages %}\n{% if m.role == 'system' %}{{ raise_exception('no system messages') }}{% endif %}{% endfor %}";
    model.chat_template = Some(ChatTemplate::new(src, String::new(), String::new()).unwrap());
    let app = strata_server::router(strata_server::state(model, None, 4));
    let r = post(&app, "/v1/chat/completions", json!({"messages": [{"role": "system", "content": "x"}]}));
    assert_eq!(r.status, 400);
    let msg = r.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("chat template line 2") && msg.contains("no system messages"), "{msg}");
}

/// The fixture model's own template has no tool section: tools go into the system
/// message in the documented format, and responses say so.
#[test]
fn tools_without_a_tool_section_use_the_fallback() {
    let app = app(None);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"}]);
    let t = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
    assert_eq!(t.status, 200, "{}", t.body);
    assert_eq!(t.headers["x-strata-tools-fallback"], "system-message");
    let p = t.body["prompt"].as_str().unwrap();
    assert!(p.contains("Be brief.\n\n# Tools") && p.contains("\"name\": \"get_weather\""), "{p}");
    assert!(p.contains("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"), "{p}");
    assert_eq!(t.body["tools_fallback"], "system-message");
    // The fixture's 256-token context cannot hold the schemas: a clear 400, not a
    // prompt without them.
    let r = post(&app, "/v1/chat/completions", json!({"messages": messages, "tools": tools, "max_tokens": 2}));
    assert_eq!(r.body["error"]["code"], "context_length_exceeded", "{}", r.body);
    // Without tools (tool_choice "none"), the earlier call still reaches the model.
    let req = json!({"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 2});
    let r = post(&app, "/v1/chat/completions", req);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["x-strata-tools-fallback"], "tool-calls");
    let plain =
        post(&app, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}));
    assert!(plain.headers.get("x-strata-tools-fallback").is_none());
}
