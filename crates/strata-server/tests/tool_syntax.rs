//! Qwen3-MoE and MiniMax-M2 models behind the server (fixtures/qwen3_moe/* and
//! fixtures/minimax_m2/*, random weights, each family's official chat template): tool
//! schemas, earlier calls and their results render in the family's syntax, forced tool
//! calls come out as well-formed calls of the schema's types and go back into the next
//! turn's history, and Anthropic's route carries them as `tool_use` blocks.

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use std::path::PathBuf;
use strata_engine::{ChatTemplate, LoadedModel};
use strata_server::syntax::Syntax;
use tower::ServiceExt;

fn app(family: &str, fixture: &str, syntax: Syntax) -> Router {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(family).join(fixture);
    let model = LoadedModel::open(&dir).expect("open the fixture model");
    let st = strata_server::state(model, None, 4);
    assert_eq!(st.syntax, syntax);
    strata_server::router(st)
}

fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value, String) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let req = Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/json")
            .header("anthropic-version", "2023-06-01")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null), text)
    })
}

/// A tool, and a conversation that called it and got its result.
fn round_trip() -> (Value, Value) {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]);
    (tools, messages)
}

fn strict_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "W", "parameters": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 4}, "days": {"type": "integer", "minimum": 0, "maximum": 9},
                       "unit": {"type": "string", "enum": ["c", "f"]}}}}},
        {"type": "function", "function": {"name": "now", "description": "T",
            "parameters": {"type": "object", "properties": {}}}}])
}

#[test]
fn qwen_models_serve_with_their_own_tool_syntax() {
    let (tools, messages) = round_trip();
    for fixture in ["gqa-renorm", "sparse-step"] {
        let app = app("qwen3_moe", fixture, Syntax::Qwen);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        assert!(p.starts_with("<|im_start|>system\n# Tools\n\nYou may call one or more functions"), "{p}");
        assert!(
            p.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call><|im_end|>"),
            "{p}"
        );
        assert!(p.contains("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"), "{p}");
        assert!(p.ends_with("<|im_start|>assistant\n"), "{p}");

        forced_calls(&app, fixture, qwen_history_call);
    }
}

/// Forced calls (`required`, a named tool; Anthropic's `any`) on `app`: each a well-formed
/// call of the schema's types, which `history_call` finds again (name, arguments) in the
/// next turn's rendered prompt.
fn forced_calls(app: &Router, fixture: &str, history_call: fn(&str) -> Option<(String, Value)>) {
    let app = app.clone();
    // Forced calls: a grammar of the family's call syntax makes even a random model write a
    // well-formed call of a named tool, its arguments of the schema's types.
    for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        let forced = json!({"messages": [{"role": "user", "content": "Hi"}], "tools": strict_tools(),
            "tool_choice": choice, "max_tokens": 300, "parallel_tool_calls": false, "temperature": 0});
        let (status, r, body) = post(&app, "/v1/chat/completions", forced);
        assert_eq!(status, 200, "{choice}: {body}");
        let msg = &r["choices"][0]["message"];
        let calls = msg["tool_calls"].as_array().cloned().unwrap_or_default();
        assert_eq!(calls.len(), 1, "{fixture} {choice}: {r}");
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
        let f = &calls[0]["function"];
        let name = f["name"].as_str().unwrap();
        assert!(name == "get_weather" || (name == "now" && choice == json!("required")), "{f}");
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
        if name == "get_weather" {
            assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 4), "{args}");
            assert!(args["days"].as_i64().is_some_and(|d| (0..10).contains(&d)), "{args}");
        }
        // The call goes back as the next turn's history and renders as the model wrote it.
        let history = json!([{"role": "user", "content": "Hi"}, msg, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "ok"}]);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": history, "tools": strict_tools()}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        let call = history_call(p).unwrap_or_else(|| panic!("no call in {p}"));
        assert_eq!((call.0.as_str(), &call.1), (name, &args), "{p}");
    }

    // Anthropic: `tool_choice` any gives a `tool_use` block with an object input.
    let anthropic_tools = json!([{"name": "get_weather", "description": "W", "input_schema":
        strict_tools()[0]["function"]["parameters"].clone()}]);
    let (status, r, body) = post(
        &app,
        "/v1/messages",
        json!({"model": fixture, "max_tokens": 300,
        "tools": anthropic_tools, "tool_choice": {"type": "any", "disable_parallel_tool_use": true}, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(status, 200, "{body}");
    let uses: Vec<&Value> = r["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{r}");
    assert_eq!(uses[0]["name"], "get_weather");
    assert!(uses[0]["input"]["city"].is_string(), "{r}");
    assert_eq!(r["stop_reason"], "tool_use", "{r}");
}

/// The first call in the history of a rendered Qwen3 prompt.
fn qwen_history_call(p: &str) -> Option<(String, Value)> {
    let body = p.split("<|im_start|>assistant\n<tool_call>\n").nth(1)?.split("\n</tool_call>").next()?;
    let v: Value = serde_json::from_str(body).ok()?;
    Some((v["name"].as_str()?.to_string(), v["arguments"].clone()))
}

/// The first call in the history of a rendered MiniMax-M2 prompt.
fn minimax_history_call(p: &str) -> Option<(String, Value)> {
    let block = p.split("<minimax:tool_call>\n").nth(2)?.split("</minimax:tool_call>").next()?;
    let calls = strata_server::syntax::parse_minimax_calls(block, Some(&strict_tools()))?;
    Some((calls[0].name.clone(), Value::Object(calls[0].arguments.clone())))
}

#[test]
fn minimax_models_serve_with_their_own_tool_syntax() {
    let (tools, messages) = round_trip();
    for fixture in ["gqa-full", "bf16-rot"] {
        let app = app("minimax_m2", fixture, Syntax::MiniMax);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        assert!(p.starts_with("]~!b[]~b]system\nYou are a helpful assistant.\n\n# Tools\n"), "{p}");
        assert!(p.contains("<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>"), "{p}");
        assert!(p.contains("]~b]tool\n<response>sunny</response>"), "{p}");
        assert!(p.ends_with("]~b]ai\n<think>\n"), "{p}");
        // The official generation prompt opens reasoning, which a random model never
        // closes: the forced calls run on the same template without that opening.
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/minimax_m2").join(fixture);
        let mut model = LoadedModel::open(&dir).unwrap();
        let official = std::fs::read_to_string(dir.join("../../chat_templates/templates/minimax-m2.jinja")).unwrap();
        let open = "{{- ']~b]ai' ~ '\\n' ~ '<think>' ~ '\\n' }}";
        assert!(official.contains(open));
        let src = official.replace(open, "{{- ']~b]ai' ~ '\\n' }}");
        model.chat_template = Some(ChatTemplate::new(&src, "]~!b[".into(), "[e~[".into()).unwrap());
        let app = strata_server::router(strata_server::state(model, None, 4));
        forced_calls(&app, fixture, minimax_history_call);
    }
}

/// The first call in the history of a rendered DeepSeek or Kimi prompt.
fn marked_history_call(syntax: Syntax, p: &str) -> Option<(String, Value)> {
    let (open, close) = syntax.call();
    // (The tool section may show the syntax with placeholders first.)
    let calls =
        p.split(open).skip(1).find_map(|b| syntax.parse_calls(b.split(close).next()?, Some(&strict_tools())))?;
    Some((calls[0].name.clone(), Value::Object(calls[0].arguments.clone())))
}

#[test]
fn deepseek_and_kimi_models_serve_with_their_own_tool_syntax() {
    let (tools, messages) = round_trip();
    for (fixture, syntax) in [("yarn-groups", Syntax::DeepSeek), ("kimi-fp8", Syntax::Kimi)] {
        let app = app("deepseek_v3", fixture, syntax);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        eprintln!("{fixture}: {p}");
        assert_eq!(
            marked_history_call(syntax, p),
            Some(("get_weather".to_string(), json!({"city": "Paris", "days": 2}))),
            "{p}"
        );
        match syntax {
            Syntax::Kimi => {
                assert!(p.starts_with("<|im_system|>tool_declare<|im_middle|>[{"), "{p}");
                assert!(p.contains("<|im_system|>tool<|im_middle|>## Return of c1\\nsunny<|im_end|>"), "{p}");
                assert!(p.ends_with("<|im_assistant|>assistant<|im_middle|>"), "{p}");
            }
            _ => {
                assert!(p.starts_with("<｜begin▁of▁sentence｜>## Tools\nYou have access to the following tools:\n\n### get_weather\nDescription: Weather now\n\nParameters: {\"type\": \"object\""), "{p}");
                assert!(p.contains("<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"), "{p}");
            }
        }
        forced_calls(
            &app,
            fixture,
            match syntax {
                Syntax::Kimi => |p| marked_history_call(Syntax::Kimi, p),
                _ => |p| marked_history_call(Syntax::DeepSeek, p),
            },
        );
    }
}

/// The first call in the history of a rendered gpt-oss (harmony) prompt.
fn harmony_history_call(p: &str) -> Option<(String, Value)> {
    let rest = p.split("<|start|>assistant to=functions.").nth(1)?;
    let (name, rest) = rest.split_once("<|channel|>")?;
    let args = rest.split_once("<|message|>")?.1.split("<|call|>").next()?;
    Some((name.to_string(), serde_json::from_str(args).ok()?))
}

#[test]
fn gpt_oss_models_serve_with_harmony() {
    let (tools, messages) = round_trip();
    for fixture in ["mxfp4-yarn", "bf16-plain"] {
        let app = app("gpt_oss", fixture, Syntax::Harmony);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        assert!(p.starts_with("<|start|>system<|message|>You are ChatGPT"), "{p}");
        assert!(p.contains("namespace functions {\n\n// Weather now\ntype get_weather = (_: {"), "{p}");
        assert_eq!(harmony_history_call(p), Some(("get_weather".into(), json!({"city": "Paris", "days": 2}))), "{p}");
        assert!(
            p.contains("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"sunny\"<|end|>"),
            "{p}"
        );
        assert!(p.ends_with("<|start|>assistant"), "{p}");
        // Reasoning sent back with a call renders on the analysis channel.
        let mut with_reasoning = messages.clone();
        with_reasoning[1]["reasoning_content"] = json!("Need the weather tool.");
        with_reasoning[1].as_object_mut().unwrap().remove("content");
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": with_reasoning, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        assert!(p.contains("<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"), "{p}");
        forced_calls(&app, fixture, harmony_history_call);
    }
}

/// Qwen3-Next and Qwen3.5-MoE behind the server: Qwen3's template and call syntax; the
/// serving engine runs their recurrent sequences with the prompt cache off (forced calls
/// over several requests).
#[test]
fn qwen3_next_models_serve_with_qwen_syntax() {
    let (tools, messages) = round_trip();
    for (family, fixture) in [
        ("qwen3_next", "hybrid-f32"),
        ("qwen3_next", "bf16-dense"),
        ("qwen3_5_moe", "text-f32"),
        ("qwen3_5_moe", "vl-bf16"),
    ] {
        let app = app(family, fixture, Syntax::Qwen);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        assert_eq!(qwen_history_call(p), Some(("get_weather".into(), json!({"city": "Paris", "days": 2}))), "{p}");
        forced_calls(&app, fixture, qwen_history_call);
    }
}
