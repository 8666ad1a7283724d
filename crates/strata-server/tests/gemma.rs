//! A Gemma 4 model behind the server (fixtures/gemma4/*, random weights): the batching
//! engine runs it (sliding-window rings, so no prompt cache), a Gemma-4-format chat
//! template renders tool schemas, earlier calls and their results in Gemma's syntax,
//! forced tool calls and images are refused by name.

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use std::path::PathBuf;
use strata_engine::{ChatTemplate, LoadedModel};
use strata_server::syntax::Syntax;
use tower::ServiceExt;

/// A template in Gemma 4's turn format (written for this test after the format of the
/// official one): `<|turn>ROLE ... <turn|>`, tools as `<|tool>declaration:...<tool|>`,
/// calls as `<|tool_call>call:NAME{k:v}<tool_call|>` (`format_argument`, bare keys),
/// results as `<|tool_response>response:NAME{value:...}<tool_response|>`.
const GEMMA_TEMPLATE: &str = r#"
{%- macro format_argument(argument, escape_keys=True) -%}
    {%- if argument is string -%}{{- '<|"|>' + argument + '<|"|>' -}}
    {%- elif argument is boolean -%}{{- 'true' if argument else 'false' -}}
    {%- elif argument is mapping -%}{{- '{' -}}
        {%- for key, value in argument | dictsort -%}
            {%- if escape_keys -%}{{- '<|"|>' + key + '<|"|>' -}}{%- else -%}{{- key -}}{%- endif -%}
            :{{- format_argument(value, escape_keys=escape_keys) -}}{%- if not loop.last %},{% endif -%}
        {%- endfor -%}{{- '}' -}}
    {%- elif argument is sequence -%}{{- '[' -}}
        {%- for item in argument -%}{{- format_argument(item, escape_keys=escape_keys) -}}{%- if not loop.last %},{% endif -%}{%- endfor -%}
        {{- ']' -}}
    {%- else -%}{{- argument -}}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(name='') -%}
{{- bos_token -}}
{%- if tools or messages[0]['role'] == 'system' -%}
    {{- '<|turn>system\n' -}}
    {%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}
    {%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] | trim -}}{%- endif -%}
    {%- for tool in tools or [] -%}
        {{- '<|tool>declaration:' + tool['function']['name'] + '{description:<|"|>' + tool['function']['description'] + '<|"|>}<tool|>' -}}
    {%- endfor -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'tool' -%}
        {{- '<|tool_response>response:' + ns.name + '{value:' + format_argument(message['content'], escape_keys=False) + '}<tool_response|>' -}}
    {%- elif message['role'] != 'system' -%}
        {{- '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}
        {%- for call in message['tool_calls'] or [] -%}
            {%- set ns.name = call['function']['name'] -%}
            {{- '<|tool_call>call:' + call['function']['name'] + format_argument(call['function']['arguments'], escape_keys=False) + '<tool_call|>' -}}
        {%- endfor -%}
        {%- if message['content'] is string -%}{{- message['content'] | trim -}}{%- endif -%}
        {%- if not message['tool_calls'] -%}{{- '<turn|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\n' -}}
    {%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"#;

fn app(fixture: &str) -> Router {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma4").join(fixture);
    let mut model = LoadedModel::open(&dir).expect("open the fixture model");
    model.chat_template = Some(ChatTemplate::new(GEMMA_TEMPLATE, "<bos>".into(), String::new()).unwrap());
    let st = strata_server::state(model, None, 4);
    assert_eq!(st.syntax, Syntax::Gemma);
    strata_server::router(st)
}

fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value, String) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let req = Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = to_bytes(resp.into_body(), usize::MAX).await.unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null), text)
    })
}

#[test]
fn gemma_models_serve_with_their_own_tool_syntax() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]);
    for fixture in ["dense-ple", "moe"] {
        let app = app(fixture);
        let (status, t, body) = post(&app, "/tokenize", json!({"messages": messages, "tools": tools}));
        assert_eq!(status, 200, "{body}");
        let p = t["prompt"].as_str().unwrap();
        assert!(
            p.starts_with("<bos><|turn>system\n<|tool>declaration:get_weather{description:<|\"|>Weather now"),
            "{p}"
        );
        assert!(
            p.contains("<|turn>model\n<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|>"),
            "{p}"
        );
        assert!(p.contains("<|tool_response>response:get_weather{value:<|\"|>sunny<|\"|>}<tool_response|>"), "{p}");
        assert!(p.ends_with("<|turn>model\n<|channel>thought\n<channel|>"), "{p}");

        // Whole and streamed answers (greedy) through the batching engine agree.
        let req = json!({"messages": [{"role": "user", "content": "Hello there, how are you today?"}],
                         "max_tokens": 24, "temperature": 0, "tools": tools});
        let (status, r, body) = post(&app, "/v1/chat/completions", req.clone());
        assert_eq!(status, 200, "{body}");
        assert_eq!(r["usage"]["completion_tokens"], 24, "{r}");
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let (status, _, body) = post(&app, "/v1/chat/completions", sreq);
        assert_eq!(status, 200, "{body}");
        let streamed: String = body
            .split("\n\n")
            .filter_map(|b| b.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(String::from))
            .collect();
        assert_eq!(streamed, r["choices"][0]["message"]["content"].as_str().unwrap_or(""), "{fixture}");

        // Forced calls would need a grammar of Gemma's call syntax: refused by name.
        let mut forced = req.clone();
        forced["tool_choice"] = json!("required");
        let (status, r, _) = post(&app, "/v1/chat/completions", forced);
        assert_eq!(status, 400);
        assert!(r["error"]["message"].as_str().unwrap().contains("Gemma"), "{r}");

        // Images: the vision tower is not run, so an image part is a 400, never ignored.
        let img = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 4});
        let (status, r, _) = post(&app, "/v1/chat/completions", img);
        assert_eq!(status, 400);
        assert!(r["error"]["message"].as_str().unwrap().contains("image_url"), "{r}");
    }
}
