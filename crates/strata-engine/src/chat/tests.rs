use super::*;
use serde_json::json;
use std::path::PathBuf;

const TEMPLATE: &str = "[gMASK]<sop>\n{%- for m in messages %}\n<|{{ m.role }}|>\n{{ m.content.strip() }}\n{%- endfor %}\n{% if add_generation_prompt %}<|assistant|>{% endif %}";

#[test]
fn renders_like_hf_with_trim_and_pycompat() {
    let t = ChatTemplate::new(TEMPLATE, String::new(), "<eos>".into()).unwrap();
    let msgs = [Message::new("system", " be brief "), Message::new("user", "hi")];
    assert_eq!(t.render(&msgs, true, None).unwrap(), "[gMASK]<sop><|system|>\nbe brief<|user|>\nhi<|assistant|>");
    assert_eq!(t.render(&msgs, false, None).unwrap(), "[gMASK]<sop><|system|>\nbe brief<|user|>\nhi");
}

#[test]
fn raise_exception_and_empty_messages_are_errors() {
    let t = ChatTemplate::new("\n{{ raise_exception('no system role') }}", String::new(), String::new()).unwrap();
    let err = t.render(&[Message::new("user", "x")], true, None).unwrap_err().to_string();
    assert!(err.contains("no system role") && err.contains("line 2"), "{err}");
    assert!(t.render(&[], true, None).is_err());
}

#[test]
fn template_errors_name_the_line() {
    let t = ChatTemplate::new("a\nb\n{{ messages[0].content.nope() }}", String::new(), String::new()).unwrap();
    let err = t.render(&[Message::new("user", "x")], true, None).unwrap_err().to_string();
    assert!(err.contains("line 3") && err.contains("str has no method named nope"), "{err}");
    assert!(ChatTemplate::new("{% if %}", String::new(), String::new()).is_err());
}

#[test]
fn order_none_and_reasoning_reach_the_template_as_in_transformers() {
    let t = ChatTemplate::new("{% for m in messages %}{{ m }}\n{% endfor %}{{ tools }}", String::new(), String::new())
        .unwrap();
    let msgs = [json!({"role": "assistant", "content": null, "z": 1, "reasoning": "r", "a": 2})];
    let out = t.render_json(&msgs, &RenderOptions::default()).unwrap();
    assert_eq!(
        out,
        "{'thinking': 'r', 'role': 'assistant', 'z': 1, 'reasoning': 'r', 'a': 2, 'reasoning_content': 'r'}\nNone"
    );
}

#[test]
fn kwargs_reach_the_template_and_reserved_names_are_refused() {
    let t = ChatTemplate::new("{{ enable_thinking }}{{ eos_token }}", String::new(), "<e>".into()).unwrap();
    let mut opts = RenderOptions::default();
    opts.kwargs.insert("enable_thinking".into(), json!(false));
    assert_eq!(t.render_json(&[json!({"role": "user"})], &opts).unwrap(), "False<e>");
    assert!(t.uses("enable_thinking", false) && !t.uses("tools", false));
    opts.kwargs.insert("messages".into(), json!([]));
    assert!(t.render_json(&[json!({"role": "user"})], &opts).unwrap_err().to_string().contains("messages"));
}

#[test]
fn tools_fallback_writes_schemas_and_calls_into_messages() {
    let tools = json!([{"type": "function", "function": {"name": "f", "description": "é"}}]);
    let mut msgs = vec![
        json!({"role": "user", "content": "hi"}),
        json!({"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1], "s": "v"}}}]}),
    ];
    inject_tools(&mut msgs, &tools, strata_models::ChatFormat::Glm);
    assert!(inject_tool_calls(&mut msgs, strata_models::ChatFormat::Glm));
    let sys = msgs[0]["content"].as_str().unwrap();
    assert!(
        sys.starts_with("# Tools")
            && sys.contains(
                "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"é\"}}\n</tools>"
            ),
        "{sys}"
    );
    assert_eq!(
        msgs[2]["content"],
        "ok\n<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>[1]</arg_value>\n<arg_key>s</arg_key>\n<arg_value>v</arg_value>\n</tool_call>"
    );
    let mut with_system = vec![json!({"role": "system", "content": "S"})];
    inject_tools(&mut with_system, &tools, strata_models::ChatFormat::Glm);
    assert!(!inject_tool_calls(&mut with_system, strata_models::ChatFormat::Glm));
    assert!(with_system.len() == 1 && with_system[0]["content"].as_str().unwrap().starts_with("S\n\n# Tools"));
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/chat_templates")
}

/// Every case of fixtures/chat_templates/expected.json (official templates on a set
/// of conversations, and feature templates) renders byte for byte as transformers
/// rendered it (scripts/make_chat_template_fixtures.py).
#[test]
fn renders_byte_for_byte_like_transformers() {
    let dir = fixtures();
    let data: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let clock = Clock::Fixed(data["fixed_clock"][0].as_i64().unwrap(), data["fixed_clock"][1].as_u64().unwrap() as u32);
    let specials = data["special_tokens"].as_object().unwrap();
    let cases = data["cases"].as_array().unwrap();
    assert!(cases.len() > 100, "too few cases: {}", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let source = match case.get("template").and_then(Value::as_str) {
            Some(file) => std::fs::read_to_string(dir.join(file)).unwrap(),
            None => case["source"].as_str().unwrap().to_string(),
        };
        let mut t = ChatTemplate::new(&source, String::new(), String::new()).unwrap();
        t.set_clock(clock).unwrap();
        let mut opts = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(false),
            continue_final_message: case["continue_final_message"].as_bool().unwrap_or(false),
            tools: case.get("tools").cloned(),
            documents: case.get("documents").cloned(),
            kwargs: specials.clone(),
        };
        if let Some(Value::Object(kw)) = case.get("kwargs") {
            opts.kwargs.extend(kw.clone());
        }
        let got = t.render_json(case["messages"].as_array().unwrap(), &opts);
        match (&case["expected"]["ok"], got) {
            (Value::String(want), Ok(got)) if *want == got => {}
            (Value::String(want), got) => failures.push(format!("{name}:\n  want {want:?}\n  got  {got:?}")),
            (_, Ok(got)) => failures.push(format!("{name}: transformers refused it, strata rendered {got:?}")),
            (_, Err(_)) => {}
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
