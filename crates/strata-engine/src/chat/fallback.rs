//! For chat templates with no tool section: the tool schemas (and the assistant's
//! earlier calls) written into the messages in a documented text format, the model
//! family's native call syntax (GLM's, Gemma 4's, Qwen3's, MiniMax's, DeepSeek's or Kimi's),
//! so that tools are never silently dropped.

use super::python_json as dumps;
use serde_json::{Map, Value};
use strata_models::ChatFormat;

/// The text that describes `tools` (OpenAI-style schemas) to the model.
pub fn tools_system_text(tools: &Value, format: ChatFormat) -> String {
    if format == ChatFormat::Gemma {
        let mut s = String::from("# Tools\n");
        for t in tools.as_array().into_iter().flatten() {
            s.push_str(&format!("<|tool>{}<tool|>\n", dumps(t)));
        }
        s.push_str("To call one: <|tool_call>call:NAME{KEY:VALUE,...}<tool_call|> (strings between <|\"|> quotes)");
        return s;
    }
    if format == ChatFormat::DeepSeek {
        return deepseek_tools_text(tools);
    }
    let mut s = String::from("# Tools\n<tools>\n");
    for t in tools.as_array().into_iter().flatten() {
        s.push_str(&dumps(t));
        s.push('\n');
    }
    s.push_str(match format {
        ChatFormat::MiniMax => "</tools>\nTo call one: <minimax:tool_call>\n<invoke name=\"NAME\">\n<parameter name=\"KEY\">VALUE</parameter>\n</invoke>\n</minimax:tool_call>",
        ChatFormat::Qwen => {
            "</tools>\nTo call one: <tool_call>\n{\"name\": NAME, \"arguments\": {ARGUMENTS}}\n</tool_call>"
        }
        ChatFormat::Kimi => {
            "</tools>\nTo call: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{ARGUMENTS}<|tool_call_end|><|tool_calls_section_end|>"
        }
        _ => {
            "</tools>\nTo call one: <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>"
        }
    });
    s
}

/// DeepSeek-V3.1's tool section, as its model card lays it out (its template has none).
fn deepseek_tools_text(tools: &Value) -> String {
    let mut s = String::from("## Tools\nYou have access to the following tools:\n");
    for t in tools.as_array().into_iter().flatten() {
        let f = t.get("function").unwrap_or(t);
        let text = |k: &str| f.get(k).and_then(Value::as_str).unwrap_or("");
        let params = f.get("parameters").map(dumps).unwrap_or_else(|| "{}".into());
        s.push_str(&format!("\n### {}\nDescription: {}\n\nParameters: {params}\n", text("name"), text("description")));
    }
    s.push_str(
        "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n\
         <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>\
         {{additional_tool_calls}}<｜tool▁calls▁end｜>\n\nWhere:\n\n\
         - `tool_call_name` must be an exact match to one of the available tools\n\
         - `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n\
         - For multiple tool calls, chain them directly without separators or spaces\n",
    );
    s
}

/// A value as Gemma 4's template writes an argument: strings quoted with `<|"|>`, object
/// keys bare.
fn gemma_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("<|\"|>{s}<|\"|>"),
        Value::Array(a) => format!("[{}]", a.iter().map(gemma_value).collect::<Vec<_>>().join(",")),
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            format!("{{{}}}", keys.iter().map(|k| format!("{k}:{}", gemma_value(&o[*k]))).collect::<Vec<_>>().join(","))
        }
        v => v.to_string(),
    }
}

/// One call in the family's syntax: GLM's string values as they are, others as JSON;
/// Qwen3's call as one JSON object.
fn call_text(call: &Value, format: ChatFormat) -> String {
    let f = call.get("function").unwrap_or(call);
    if format == ChatFormat::Gemma {
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        let args = match f.get("arguments") {
            Some(v @ Value::Object(_)) => gemma_value(v),
            _ => "{}".into(),
        };
        return format!("<|tool_call>call:{name}{args}<tool_call|>");
    }
    if format == ChatFormat::MiniMax {
        let mut s =
            format!("<minimax:tool_call>\n<invoke name=\"{}\">", f.get("name").and_then(Value::as_str).unwrap_or(""));
        if let Some(Value::Object(args)) = f.get("arguments") {
            for (k, v) in args {
                let v = match v {
                    Value::String(s) => s.clone(),
                    v => dumps(v),
                };
                s.push_str(&format!("\n<parameter name=\"{k}\">{v}</parameter>"));
            }
        }
        s.push_str("\n</invoke>\n</minimax:tool_call>");
        return s;
    }
    if matches!(format, ChatFormat::DeepSeek | ChatFormat::Kimi) {
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        let args = match f.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => dumps(v),
            None => "{}".into(),
        };
        return match format {
            ChatFormat::Kimi => format!(
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
            ),
            _ => format!(
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
            ),
        };
    }
    if format == ChatFormat::Qwen {
        let name = f.get("name").cloned().unwrap_or(Value::String(String::new()));
        let args = match f.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => dumps(v),
            None => "{}".into(),
        };
        return format!("<tool_call>\n{{\"name\": {}, \"arguments\": {args}}}\n</tool_call>", dumps(&name));
    }
    let mut s = format!("<tool_call>{}", f.get("name").and_then(Value::as_str).unwrap_or(""));
    if let Some(Value::Object(args)) = f.get("arguments") {
        for (k, v) in args {
            let v = match v {
                Value::String(s) => s.clone(),
                v => dumps(v),
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
pub fn inject_tools(messages: &mut Vec<Value>, tools: &Value, format: ChatFormat) {
    let text = tools_system_text(tools, format);
    match messages.first_mut().and_then(Value::as_object_mut) {
        Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => append_text(first, &text, "\n\n"),
        _ => messages.insert(0, serde_json::json!({"role": "system", "content": text})),
    }
}

/// Writes each assistant message's `tool_calls` into its content (after a newline);
/// answers whether there were any.
pub fn inject_tool_calls(messages: &mut [Value], format: ChatFormat) -> bool {
    let mut any = false;
    for m in messages.iter_mut().filter_map(Value::as_object_mut) {
        let calls: Vec<String> = match m.get("tool_calls") {
            Some(Value::Array(calls)) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
                calls.iter().map(|c| call_text(c, format)).collect()
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
