//! Tool calls parsed from generated text, in the model's own syntax ([`crate::syntax`]);
//! GLM's:
//!
//! ```text
//! <tool_call>NAME
//! <arg_key>K</arg_key>
//! <arg_value>V</arg_value>
//! ...
//! </tool_call>
//! ```
//!
//! Values are trimmed; a value becomes JSON when it parses as JSON, else a string; an
//! argument whose schema says `"type": "string"` stays a string. [`ToolStream`] splits a stream of text deltas
//! into plain text and whole tool calls, holding back what could still begin a call.

use crate::syntax::Syntax;

use serde_json::{Map, Value};

pub const CALL_START: &str = "<tool_call>";
pub const CALL_END: &str = "</tool_call>";
const KEY_START: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE_START: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";

#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// Arguments as a JSON object in a string, as OpenAI sends them.
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    /// Reasoning, from [`crate::output`] (never from [`ToolStream`]).
    Reasoning(String),
    Call(ToolCall),
}

/// The declared JSON type of `tool.arg` in OpenAI-style tool schemas
/// (`[{"type": "function", "function": {"name", "parameters": {...}}}]`).
pub(crate) fn declared_type<'a>(tools: Option<&'a Value>, tool: &str, arg: &str) -> Option<&'a str> {
    tools?
        .as_array()?
        .iter()
        .map(|t| t.get("function").unwrap_or(t))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(tool))?
        .get("parameters")?
        .get("properties")?
        .get(arg)?
        .get("type")?
        .as_str()
}

/// Parses the inside of one `<tool_call>...</tool_call>`; `None` when it has no name or
/// its argument tags do not pair up.
pub fn parse_call(body: &str, tools: Option<&Value>) -> Option<ToolCall> {
    let name_end = body.find(KEY_START).unwrap_or(body.len());
    let name = body[..name_end].trim();
    if name.is_empty() || name.contains(['<', '>', '\n']) {
        return None;
    }
    let mut arguments = Map::new();
    let mut rest = &body[name_end..];
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after_key = rest.strip_prefix(KEY_START)?;
        let key_end = after_key.find(KEY_END)?;
        let key = after_key[..key_end].trim();
        let after = after_key[key_end + KEY_END.len()..].trim_start();
        let after_value = after.strip_prefix(VALUE_START)?;
        let value_end = after_value.find(VALUE_END)?;
        // Values are trimmed, as GLM's own parser does.
        let raw = after_value[..value_end].trim();
        rest = &after_value[value_end + VALUE_END.len()..];
        let value = if declared_type(tools, name, key) == Some("string") {
            Value::String(raw.to_string())
        } else {
            serde_json::from_str::<Value>(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
        };
        arguments.insert(key.to_string(), value);
    }
    Some(ToolCall { name: name.to_string(), arguments })
}

/// The length of the longest suffix of `text` that is a proper prefix of `marker` (in
/// whole characters: DeepSeek's markers are not ASCII).
pub(crate) fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| {
            k <= text.len()
                && marker.is_char_boundary(k)
                && text.is_char_boundary(text.len() - k)
                && text.ends_with(&marker[..k])
        })
        .unwrap_or(0)
}

/// Splits streamed text into [`Piece`]s. Whitespace between or after tool calls is
/// dropped (it is only layout around the calls).
#[derive(Default)]
pub struct ToolStream {
    syntax: Syntax,
    tools: Option<Value>,
    buf: String,
    inside: bool,
    gap: String,
    calls: usize,
}

impl ToolStream {
    pub fn new(tools: Option<Value>) -> Self {
        Self { tools, ..Default::default() }
    }

    /// A stream of calls in `syntax`.
    pub fn with_syntax(syntax: Syntax, tools: Option<Value>) -> Self {
        Self { syntax, tools, ..Default::default() }
    }

    /// Tool calls seen so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn text(&self, out: &mut Vec<Piece>, t: &str) {
        if t.is_empty() || (self.calls > 0 && t.trim().is_empty()) {
            return;
        }
        if let Some(Piece::Text(prev)) = out.last_mut() {
            prev.push_str(t);
        } else {
            out.push(Piece::Text(t.to_string()));
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        let (call_start, call_end) = self.syntax.call();
        self.buf.push_str(delta);
        let mut out = Vec::new();
        loop {
            if !self.inside {
                if let Some(i) = self.buf.find(call_start) {
                    let before = self.buf[..i].trim_end().to_string();
                    self.text(&mut out, &before);
                    // The gap before the call is kept in case the call is not one.
                    self.gap = self.buf[before.len()..i].to_string();
                    self.buf.drain(..i + call_start.len());
                    self.inside = true;
                    continue;
                }
                let keep = partial_suffix(&self.buf, call_start);
                // Trailing whitespace waits too: it is dropped if a call follows.
                let emit = self.buf[..self.buf.len() - keep].trim_end().to_string();
                self.text(&mut out, &emit);
                self.buf.drain(..emit.len());
                return out;
            }
            let Some(j) = self.buf.find(call_end) else {
                return out;
            };
            let body = self.buf[..j].to_string();
            self.buf.drain(..j + call_end.len());
            self.inside = false;
            match self.syntax.parse_calls(&body, self.tools.as_ref()) {
                Some(calls) => {
                    self.calls += calls.len();
                    out.extend(calls.into_iter().map(Piece::Call));
                }
                None => {
                    let raw = format!("{}{call_start}{body}{call_end}", self.gap);
                    self.text(&mut out, &raw);
                }
            }
        }
    }

    /// What is left at the end: held-back text, or an unfinished call as text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            self.inside = false;
            self.text(&mut out, &format!("{}{}{rest}", self.gap, self.syntax.call().0));
        } else {
            // Trailing whitespace was only held in case a call followed.
            let rest = if self.calls > 0 { rest.trim_end() } else { &rest };
            self.text(&mut out, rest);
        }
        out
    }
}

/// Parses a whole generated text: the text outside the calls (trimmed) and the calls.
pub fn parse_text(text: &str, tools: Option<&Value>) -> (String, Vec<ToolCall>) {
    let mut s = ToolStream::new(tools.cloned());
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
            Piece::Reasoning(_) => {}
        }
    }
    let content = if calls.is_empty() { content } else { content.trim().to_string() };
    (content, calls)
}

/// OpenAI-style tool schemas from Anthropic's `{name, description, input_schema}`.
pub fn from_anthropic_tools(tools: &[Value]) -> Vec<Value> {
    tools
        .iter()
        .map(|t| {
            serde_json::json!({
                "type": "function",
                "function": {
                    "name": t.get("name").cloned().unwrap_or(Value::Null),
                    "description": t.get("description").cloned().unwrap_or(Value::Null),
                    "parameters": t.get("input_schema").cloned().unwrap_or(Value::Null),
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CALL: &str = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"unit\": \"C\"}</arg_value>\n</tool_call>";

    #[test]
    fn parses_glm_calls_with_json_and_string_values() {
        let (content, calls) = parse_text(&format!("Let me check.\n{CALL}"), None);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            Value::Object(calls[0].arguments.clone()),
            json!({"city": "Paris", "days": 3, "opts": {"unit": "C"}})
        );
        assert_eq!(serde_json::from_str::<Value>(&calls[0].arguments_json()).unwrap()["days"], 3);
    }

    #[test]
    fn string_schema_keeps_numbers_as_strings() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"days": {"type": "string"}}}}}]);
        let (_, calls) = parse_text(CALL, Some(&tools));
        assert_eq!(calls[0].arguments["days"], json!("3"));
        assert_eq!(calls[0].arguments["opts"], json!({"unit": "C"}));
        let spaced = "<tool_call>get_weather\n<arg_key> days </arg_key>\n<arg_value>\n 4 \n</arg_value></tool_call>";
        assert_eq!(parse_text(spaced, Some(&tools)).1[0].arguments["days"], json!("4"));
        assert_eq!(parse_text(spaced, None).1[0].arguments["days"], json!(4));
    }

    #[test]
    fn several_calls_no_args_and_plain_text() {
        let text = format!("{CALL}\n<tool_call>now</tool_call>\n");
        let (content, calls) = parse_text(&text, None);
        assert_eq!(content, "");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].name, "now");
        assert!(calls[1].arguments.is_empty());
        let (content, calls) = parse_text("no calls here <tool", None);
        assert_eq!(content, "no calls here <tool");
        assert!(calls.is_empty());
    }

    #[test]
    fn malformed_calls_stay_text() {
        let bad = "<tool_call>\n<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>";
        let (content, calls) = parse_text(bad, None);
        assert!(calls.is_empty());
        assert_eq!(content, bad);
        let unpaired = "<tool_call>f\n<arg_key>x</arg_key>oops</tool_call>";
        assert_eq!(parse_text(unpaired, None), (unpaired.to_string(), vec![]));
        let unfinished = "hi <tool_call>f\n<arg_key>x";
        assert_eq!(parse_text(unfinished, None).0, unfinished);
    }

    #[test]
    fn streaming_matches_whole_text_for_every_split() {
        let text = format!("Sure. {CALL}\n<tool_call>now</tool_call>");
        let whole = parse_text(&text, None);
        for step in [1, 2, 3, 5, 7, 11] {
            let mut s = ToolStream::new(None);
            let mut pieces = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for chunk in chars.chunks(step) {
                pieces.extend(s.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(s.finish());
            let mut content = String::new();
            let mut calls = Vec::new();
            for p in pieces {
                match p {
                    Piece::Text(t) => {
                        assert!(!t.contains('<'), "marker leaked as text: {t:?}");
                        content.push_str(&t)
                    }
                    Piece::Call(c) => calls.push(c),
                    Piece::Reasoning(_) => unreachable!(),
                }
            }
            assert_eq!(content.trim(), whole.0, "step {step}");
            assert_eq!(calls, whole.1, "step {step}");
        }
    }

    #[test]
    fn text_streams_without_waiting_for_the_end() {
        let mut s = ToolStream::new(None);
        assert_eq!(s.push("Hello wor"), vec![Piece::Text("Hello wor".into())]);
        assert_eq!(s.push("ld <tool"), vec![Piece::Text("ld".into())]);
        assert_eq!(s.push("box>"), vec![Piece::Text(" <toolbox>".into())]);
    }

    #[test]
    fn anthropic_tools_become_function_schemas() {
        let t = from_anthropic_tools(&[json!({"name": "f", "description": "d",
            "input_schema": {"type": "object"}})]);
        assert_eq!(t[0]["function"]["parameters"]["type"], "object");
        assert_eq!(t[0]["type"], "function");
    }
}
