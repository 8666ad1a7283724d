//! For chat templates with no tool section: the tool schemas (and the assistant's
//! earlier calls) written into the messages in a documented text format, GLM's native
//! call syntax, so that tools are never silently dropped.

use super::pyfmt::{json_dumps, JsonOptions};
use serde_json::{Map, Value};

/// The text that describes `tools` (OpenAI-style schemas) to the model.
pub fn tools_system_text(tools: &Value) -> String {
    let mut s = String::from("# Tools\n<tools>\n");
    for t in tools.as_array().into_iter().flatten() {
        let line = json_dumps(&minijinja::Value::from(minijinja::value::Serde(t)), &JsonOptions::default())
            .unwrap_or_else(|_| t.to_string());
        s.push_str(&line);
        s.push('\n');
    }
    s.push_str(
        "</tools>\nTo call one: <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>",
    );
    s
}

/// One call in the same syntax: string values as they are, others as JSON.
fn call_text(call: &Value) -> String {
    let f = call.get("function").unwrap_or(call);
    let mut s = format!("<tool_call>{}", f.get("name").and_then(Value::as_str).unwrap_or(""));
    if let Some(Value::Object(args)) = f.get("arguments") {
        for (k, v) in args {
            let v = match v {
                Value::String(s) => s.clone(),
                v => json_dumps(&minijinja::Value::from(minijinja::value::Serde(v)), &JsonOptions::default())
                    .unwrap_or_else(|_| v.to_string()),
            };
            s.push_str(&format!("\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>"));
        }
    }
    s.push_str("\n</tool_call>");
    s
}

fn append_text(msg: &mut Map<String, Value>, text: &str, sep: &str) {
    match msg.get_mut("content") {
        Some(Value::String(s)) if !s.is_empty() => {
            s.push_str(sep);
            s.push_str(text);
        }
        Some(Value::Array(parts)) => parts.push(serde_json::json!({"type": "text", "text": format!("{sep}{text}")})),
        _ => {
            msg.insert("content".into(), Value::String(text.to_string()));
        }
    }
}

/// Writes `tools` into the system message: appended after a blank line, or as a new
/// system message first.
pub fn inject_tools(messages: &mut Vec<Value>, tools: &Value) {
    let text = tools_system_text(tools);
    match messages.first_mut().and_then(Value::as_object_mut) {
        Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => append_text(first, &text, "\n\n"),
        _ => messages.insert(0, serde_json::json!({"role": "system", "content": text})),
    }
}

/// Writes each assistant message's `tool_calls` into its content (after a newline);
/// answers whether there were any.
pub fn inject_tool_calls(messages: &mut [Value]) -> bool {
    let mut any = false;
    for m in messages.iter_mut().filter_map(Value::as_object_mut) {
        let calls: Vec<String> = match m.get("tool_calls") {
            Some(Value::Array(calls)) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
                calls.iter().map(call_text).collect()
            }
            _ => continue,
        };
        if !calls.is_empty() {
            append_text(m, &calls.join("\n"), "\n");
            any = true;
        }
    }
    any
}
