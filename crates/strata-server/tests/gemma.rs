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
        {%- if message['content'] is string -%}{{- message['content'] | trim -}}
        {%- elif message['content'] is sequence -%}
            {%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}{%- endfor -%}
        {%- endif -%}
        {%- if not message['tool_calls'] -%}{{- '<turn|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\n' -}}
    {%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"#;

fn dir(fixture: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma4").join(fixture)
}

fn app(fixture: &str) -> Router {
    let mut model = LoadedModel::open(&dir(fixture)).expect("open the fixture model");
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

        // Forced calls: a grammar of Gemma's call syntax makes even a random model write a
        // well-formed call of a named tool, its arguments of the schema's types.
        // (Small schemas and a short prompt: the fixture's context is 256 positions and its
        // tokens are short.)
        let strict = json!([{"type": "function", "function": {"name": "get_weather", "description": "W", "parameters": {
            "type": "object", "required": ["city", "days"],
            "properties": {"city": {"type": "string", "maxLength": 4}, "days": {"type": "integer", "minimum": 0, "maximum": 9},
                           "unit": {"type": "string", "enum": ["c", "f"]}}}}},
            {"type": "function", "function": {"name": "now", "description": "T",
                "parameters": {"type": "object", "properties": {}}}}]);
        for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
            let mut forced = req.clone();
            forced["messages"] = json!([{"role": "user", "content": "Hi"}]);
            forced["tools"] = strict.clone();
            forced["tool_choice"] = choice.clone();
            forced["max_tokens"] = json!(200);
            forced["parallel_tool_calls"] = json!(false);
            let (status, r, body) = post(&app, "/v1/chat/completions", forced);
            assert_eq!(status, 200, "{choice}: {body}");
            let calls = r["choices"][0]["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
            assert_eq!(calls.len(), 1, "{fixture} {choice}: {r}");
            assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
            let f = &calls[0]["function"];
            let name = f["name"].as_str().unwrap();
            assert!(name == "get_weather" || (name == "now" && choice == json!("required")), "{f}");
            let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
            if name == "get_weather" {
                assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 4), "{args}");
                assert!(args["days"].as_i64().is_some_and(|d| (0..10).contains(&d)), "{args}");
                assert!(args.get("unit").is_none_or(|u| u == "c" || u == "f"), "{args}");
            }
        }

        // Images: a model without a vision tower answers 400, never a text-only reply.
        let img = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 4});
        let (status, r, _) = post(&app, "/v1/chat/completions", img);
        assert_eq!(status, 400);
        assert!(r["error"]["message"].as_str().unwrap().contains("no vision tower"), "{r}");
    }
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            s.push(if i <= c.len() { A[(n >> (18 - 6 * i)) as usize & 63] as char } else { '=' });
        }
    }
    s
}

/// `image_url` parts (data: URLs) through the batching engine give what the generator
/// gives for the same prompt and images (causal and bidirectional image attention; two
/// images of 272 soft tokens each with the processor's default budget, each more than a
/// CPU forward's 256 rows); private http URLs are refused without --allow-private-media.
#[test]
fn images_in_chat_requests_match_the_generator() {
    use strata_engine::image::Rgb8;
    use strata_engine::media;
    for fixture in ["vision", "vision-bidir", "vision-large"] {
        let app = app(fixture);
        let png = std::fs::read(dir(fixture).join("image.png")).unwrap();
        let url = format!("data:image/png;base64,{}", base64(&png));
        let images = if fixture == "vision-large" { 2 } else { 1 };
        let mut parts: Vec<Value> =
            (0..images).map(|_| json!({"type": "image_url", "image_url": {"url": url}})).collect();
        parts.push(json!({"type": "text", "text": "What is in it?"}));
        let messages = json!([{"role": "user", "content": parts}]);
        let req = json!({"messages": messages, "max_tokens": 12, "temperature": 0});
        let (status, r, body) = post(&app, "/v1/chat/completions", req.clone());
        assert_eq!(status, 200, "{body}");
        let content = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        let prompt_tokens = r["usage"]["prompt_tokens"].as_u64().unwrap() as usize;

        // The same through the generator.
        let mut m = LoadedModel::open(&dir(fixture)).unwrap();
        m.chat_template = Some(ChatTemplate::new(GEMMA_TEMPLATE, "<bos>".into(), String::new()).unwrap());
        let text = m
            .chat_template
            .as_ref()
            .unwrap()
            .render_json(
                &[json!({"role": "user", "content": (0..images)
                    .map(|_| json!({"type": "image"}))
                    .chain([json!({"type": "text", "text": "What is in it?"})])
                    .collect::<Vec<_>>()})],
                &strata_engine::chat::RenderOptions { add_generation_prompt: true, ..Default::default() },
            )
            .unwrap();
        let ids = m.tokenizer().unwrap().encode(&text, false).unwrap();
        let imgs: Vec<Rgb8> = (0..images).map(|_| Rgb8::decode(&png).unwrap()).collect();
        let enc = media::encode_images(&m, &imgs).unwrap();
        let spec = media::vision_spec(&m).unwrap();
        let ids = media::expand_runs(&spec, &ids, &enc.counts, m.model.info().bos_token_id).unwrap();
        assert_eq!(ids.len(), prompt_tokens, "{fixture}: prompt tokens");
        let mut gen = m.scorer().unwrap();
        gen.prefill_with_media(&ids, &enc).unwrap();
        let mut out = Vec::new();
        for _ in 0..12 {
            let l = gen.last_logits();
            let t = l.iter().enumerate().fold((0, f32::MIN), |a, (j, &v)| if v > a.1 { (j, v) } else { a }).0 as u32;
            out.push(t);
            gen.step(t).unwrap();
        }
        let want = m.tokenizer().unwrap().decode(&out, true).unwrap();
        assert_eq!(content, want, "{fixture}: served text differs from the generator's");

        let mut private = req.clone();
        private["messages"][0]["content"][0]["image_url"]["url"] = json!("http://127.0.0.1:9/cat.png");
        let (status, r, _) = post(&app, "/v1/chat/completions", private);
        assert_eq!(status, 400);
        assert!(r["error"]["message"].as_str().unwrap().contains("--allow-private-media"), "{r}");
    }
}
