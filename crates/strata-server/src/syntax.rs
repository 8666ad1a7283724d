//! The model family's output syntax ([`ChatFormat`]): where reasoning and tool calls begin
//! and end, and how a call's body reads.
//!
//! - GLM: reasoning in `<think>...</think>`; calls as
//!   `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
//!   ([`crate::tools::parse_call`]).
//! - Gemma 4: reasoning in `<|channel>thought\n...<channel|>`; calls as
//!   `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, the chat template's
//!   `format_argument` shape: strings between `<|"|>` quotes (taken literally, no
//!   escapes), `true`/`false`, `{k:v,...}` objects with bare keys, `[v,...]` arrays, other
//!   scalars bare (numbers, `null`).
//! - Qwen3: reasoning in `<think>...</think>`; a call is `<tool_call>` then a JSON object
//!   `{"name": NAME, "arguments": {...}}` (arguments may also be a JSON string), then
//!   `</tool_call>`; Qwen3-Coder writes the body as
//!   `<function=NAME><parameter=KEY>\nVALUE\n</parameter>...</function>` instead, its
//!   values raw text (one newline either side is layout), JSON where the schema says the
//!   argument is not a string and the text parses.
//! - MiniMax-M2: reasoning in `<think>...</think>`; one `<minimax:tool_call>` block holds
//!   one or more `<invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>`,
//!   values raw text (JSON where the schema says the argument is not a string and the
//!   text parses), as the official template writes them.
//! - DeepSeek-V3 / R1 / V3.1: reasoning in `<think>...</think>`; one
//!   `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` block holds one or more
//!   `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` (V3.1, ARGS JSON), or
//!   V3 / R1's `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a newline + ARGS in a
//!   json code fence.
//! - Kimi K2: reasoning in `<think>...</think>`; one
//!   `<|tool_calls_section_begin|>...<|tool_calls_section_end|>` block holds one or more
//!   `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>`,
//!   ARGS JSON.
//! - gpt-oss (harmony): messages on channels, parsed by [`crate::harmony`] as a whole
//!   (reasoning, answer text and calls), not by the marker pairs below.

use crate::tools::{declared_type, ToolCall};
use serde_json::{Map, Value};
use strata_models::ChatFormat;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Syntax {
    #[default]
    Glm,
    Gemma,
    Qwen,
    MiniMax,
    DeepSeek,
    Kimi,
    Harmony,
}

/// DeepSeek's markers inside a call block.
pub const DEEPSEEK_CALL: (&str, &str) = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>");
pub const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";
/// Kimi K2's markers inside a call block.
pub const KIMI_CALL: (&str, &str) = ("<|tool_call_begin|>", "<|tool_call_end|>");
pub const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";

/// Gemma 4's string quote (one special token, opening and closing).
pub const GEMMA_QUOTE: &str = "<|\"|>";

impl Syntax {
    pub fn of(format: ChatFormat) -> Self {
        match format {
            ChatFormat::Glm => Self::Glm,
            ChatFormat::Gemma => Self::Gemma,
            ChatFormat::Qwen => Self::Qwen,
            ChatFormat::MiniMax => Self::MiniMax,
            ChatFormat::DeepSeek => Self::DeepSeek,
            ChatFormat::Kimi => Self::Kimi,
            ChatFormat::Harmony => Self::Harmony,
        }
    }

    /// (start, end) of a reasoning block.
    pub fn think(self) -> (&'static str, &'static str) {
        match self {
            Self::Glm | Self::Qwen | Self::MiniMax | Self::DeepSeek | Self::Kimi => ("<think>", "</think>"),
            Self::Gemma => ("<|channel>thought", "<channel|>"),
            Self::Harmony => ("<|channel|>analysis<|message|>", crate::harmony::END),
        }
    }

    /// (start, end) of one tool call.
    pub fn call(self) -> (&'static str, &'static str) {
        match self {
            Self::Glm | Self::Qwen => ("<tool_call>", "</tool_call>"),
            Self::MiniMax => ("<minimax:tool_call>", "</minimax:tool_call>"),
            Self::Gemma => ("<|tool_call>", "<tool_call|>"),
            Self::DeepSeek => ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
            Self::Kimi => ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
            Self::Harmony => (crate::harmony::CHANNEL, crate::harmony::CALL),
        }
    }

    /// (start, end) of one call inside a block, for the syntaxes whose blocks hold several
    /// marked calls (DeepSeek, Kimi); the block's own markers otherwise.
    pub fn call_parts(self) -> (&'static str, &'static str) {
        match self {
            Self::DeepSeek => DEEPSEEK_CALL,
            Self::Kimi => KIMI_CALL,
            _ => self.call(),
        }
    }

    /// Every marker of the syntax (for special-token checks).
    pub fn markers(self) -> Vec<&'static str> {
        let (t0, t1) = self.think();
        let (c0, c1) = self.call();
        let mut m = vec![c0, c1, t0, t1];
        match self {
            Self::Gemma => m.push(GEMMA_QUOTE),
            Self::DeepSeek => m.extend([DEEPSEEK_CALL.0, DEEPSEEK_CALL.1, DEEPSEEK_SEP]),
            Self::Kimi => m.extend([KIMI_CALL.0, KIMI_CALL.1, KIMI_ARGS]),
            Self::Harmony => {
                use crate::harmony::*;
                m = vec![START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];
            }
            _ => {}
        }
        m
    }

    /// Parses the text between a call block's markers into its calls (one, except
    /// MiniMax's, DeepSeek's and Kimi's blocks, which may hold several); `None` when it is
    /// not well formed.
    pub fn parse_calls(self, body: &str, tools: Option<&Value>) -> Option<Vec<ToolCall>> {
        match self {
            Self::Glm => crate::tools::parse_call(body, tools).map(|c| vec![c]),
            Self::Gemma => parse_gemma_call(body, tools).map(|c| vec![c]),
            Self::Qwen => parse_qwen_call(body, tools).map(|c| vec![c]),
            Self::MiniMax => parse_minimax_calls(body, tools),
            Self::DeepSeek => parse_marked_calls(body, DEEPSEEK_CALL, deepseek_call),
            Self::Kimi => parse_marked_calls(body, KIMI_CALL, kimi_call),
            // (Harmony's calls are whole messages: crate::harmony.)
            Self::Harmony => None,
        }
    }
}

/// A block of `open BODY close` calls (whitespace between them), each body parsed by `one`.
fn parse_marked_calls(
    body: &str,
    (open, close): (&str, &str),
    one: fn(&str) -> Option<ToolCall>,
) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let after = rest.strip_prefix(open)?;
        let end = after.find(close)?;
        calls.push(one(&after[..end])?);
        rest = after[end + close.len()..].trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// A call's arguments: an object, or a JSON string holding one.
fn object_arguments(v: Value) -> Option<Map<String, Value>> {
    match v {
        Value::Object(m) => Some(m),
        Value::String(s) => match serde_json::from_str::<Value>(&s).ok()? {
            Value::Object(m) => Some(m),
            _ => None,
        },
        _ => None,
    }
}

/// Arguments written as JSON text (see [`object_arguments`]).
pub(crate) fn json_arguments(text: &str) -> Option<Map<String, Value>> {
    object_arguments(serde_json::from_str::<Value>(text.trim()).ok()?)
}

/// `NAME<｜tool▁sep｜>JSON` (V3.1), or `function<｜tool▁sep｜>NAME\n```json\nJSON\n```` (V3, R1).
fn deepseek_call(body: &str) -> Option<ToolCall> {
    let (head, rest) = body.split_once(DEEPSEEK_SEP)?;
    let (name, args) = match rest.split_once("\n```json") {
        Some((name, fenced)) if head.trim() == "function" => (name, fenced.trim_end().strip_suffix("```")?),
        _ => (head, rest),
    };
    let name = name.trim();
    valid_name(name).then_some(())?;
    Some(ToolCall { name: name.to_string(), arguments: json_arguments(args)? })
}

/// `functions.NAME:INDEX<|tool_call_argument_begin|>JSON`.
fn kimi_call(body: &str) -> Option<ToolCall> {
    let (id, args) = body.split_once(KIMI_ARGS)?;
    let id = id.trim();
    let id = id.strip_prefix("functions.").unwrap_or(id);
    let name = match id.rsplit_once(':') {
        Some((name, index)) if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => id,
    };
    valid_name(name).then_some(())?;
    Some(ToolCall { name: name.to_string(), arguments: json_arguments(args)? })
}

/// A value written raw: text where the schema says string, else JSON where it parses.
fn raw_value(tools: Option<&Value>, tool: &str, key: &str, raw: &str) -> Value {
    match declared_type(tools, tool, key) {
        Some("string") => Value::String(raw.to_string()),
        _ => serde_json::from_str::<Value>(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string())),
    }
}

/// The text of `s` after `prefix` up to the next `"`, and what follows the `"`.
fn quoted_attr<'a>(s: &'a str, prefix: &str) -> Option<(&'a str, &'a str)> {
    let rest = s.strip_prefix(prefix)?;
    let end = rest.find('"')?;
    Some((&rest[..end], &rest[end + 1..]))
}

/// `<invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>...`.
pub fn parse_minimax_calls(body: &str, tools: Option<&Value>) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (name, after) = quoted_attr(rest, "<invoke name=\"")?;
        if !valid_name(name) {
            return None;
        }
        rest = after.strip_prefix('>')?;
        let mut arguments = Map::new();
        loop {
            rest = rest.trim_start();
            if let Some(after) = rest.strip_prefix("</invoke>") {
                rest = after.trim_start();
                break;
            }
            let (key, after) = quoted_attr(rest, "<parameter name=\"")?;
            let after = after.strip_prefix('>')?;
            let end = after.find("</parameter>")?;
            if key.is_empty() {
                return None;
            }
            arguments.insert(key.to_string(), raw_value(tools, name, key, &after[..end]));
            rest = &after[end + "</parameter>".len()..];
        }
        calls.push(ToolCall { name: name.to_string(), arguments });
    }
    (!calls.is_empty()).then_some(calls)
}

/// Qwen3's JSON call body, or Qwen3-Coder's `<function=...>` one.
pub fn parse_qwen_call(body: &str, tools: Option<&Value>) -> Option<ToolCall> {
    let body = body.trim();
    if body.starts_with("<function=") {
        return parse_qwen_coder_call(body, tools);
    }
    let Value::Object(mut call) = serde_json::from_str::<Value>(body).ok()? else { return None };
    let name = match call.remove("name") {
        Some(Value::String(n)) if valid_name(&n) => n,
        _ => return None,
    };
    let arguments = match call.remove("arguments") {
        None | Some(Value::Null) => Map::new(),
        Some(v) => object_arguments(v)?,
    };
    Some(ToolCall { name, arguments })
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(['<', '>', '\n'])
}

/// `<function=NAME><parameter=KEY>VALUE</parameter>...</function>`.
fn parse_qwen_coder_call(body: &str, tools: Option<&Value>) -> Option<ToolCall> {
    let rest = body.strip_prefix("<function=")?;
    let close = rest.find('>')?;
    let name = rest[..close].trim();
    if !valid_name(name) {
        return None;
    }
    let mut rest = &rest[close + 1..];
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after.trim().is_empty().then(|| ToolCall { name: name.to_string(), arguments });
        }
        let after = rest.strip_prefix("<parameter=")?;
        let close = after.find('>')?;
        let key = after[..close].trim();
        let after = &after[close + 1..];
        let end = after.find("</parameter>")?;
        let raw = &after[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if key.is_empty() {
            return None;
        }
        arguments.insert(key.to_string(), raw_value(tools, name, key, raw));
        rest = &after[end + "</parameter>".len()..];
    }
}

/// `call:NAME{key:VALUE,...}`. A bare value an argument's schema declares a string stays
/// a string.
pub fn parse_gemma_call(body: &str, tools: Option<&Value>) -> Option<ToolCall> {
    let rest = body.trim().strip_prefix("call:")?;
    let open = rest.find('{')?;
    let name = rest[..open].trim();
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)) {
        return None;
    }
    let mut p = Parser { s: &rest[open..], tools, tool: name };
    let Value::Object(arguments) = p.object(true)? else { return None };
    if !p.s.trim().is_empty() {
        return None;
    }
    Some(ToolCall { name: name.to_string(), arguments })
}

struct Parser<'a> {
    s: &'a str,
    tools: Option<&'a Value>,
    tool: &'a str,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        self.s = self.s.trim_start();
    }

    fn eat(&mut self, t: &str) -> bool {
        self.skip_ws();
        match self.s.strip_prefix(t) {
            Some(rest) => {
                self.s = rest;
                true
            }
            None => false,
        }
    }

    /// `{k:v,...}`; `top`: the call's arguments (their schema types apply).
    fn object(&mut self, top: bool) -> Option<Value> {
        if !self.eat("{") {
            return None;
        }
        let mut out = Map::new();
        if self.eat("}") {
            return Some(Value::Object(out));
        }
        loop {
            self.skip_ws();
            let key = if self.s.starts_with(GEMMA_QUOTE) {
                self.quoted()?
            } else {
                let end = self.s.find(':')?;
                let k = self.s[..end].trim();
                if k.is_empty() || k.contains(['{', '}', ',', '[', ']']) {
                    return None;
                }
                self.s = &self.s[end..];
                k.to_string()
            };
            if !self.eat(":") {
                return None;
            }
            let string = top && declared_string(self.tools, self.tool, &key);
            let v = self.value(string)?;
            out.insert(key, v);
            if self.eat(",") {
                continue;
            }
            return self.eat("}").then_some(Value::Object(out));
        }
    }

    fn array(&mut self) -> Option<Value> {
        if !self.eat("[") {
            return None;
        }
        let mut out = Vec::new();
        if self.eat("]") {
            return Some(Value::Array(out));
        }
        loop {
            out.push(self.value(false)?);
            if self.eat(",") {
                continue;
            }
            return self.eat("]").then_some(Value::Array(out));
        }
    }

    fn quoted(&mut self) -> Option<String> {
        let rest = self.s.strip_prefix(GEMMA_QUOTE)?;
        let end = rest.find(GEMMA_QUOTE)?;
        self.s = &rest[end + GEMMA_QUOTE.len()..];
        Some(rest[..end].to_string())
    }

    /// One value; `string`: a bare value is kept as text.
    fn value(&mut self, string: bool) -> Option<Value> {
        self.skip_ws();
        if self.s.starts_with(GEMMA_QUOTE) {
            return self.quoted().map(Value::String);
        }
        if self.s.starts_with('{') {
            return self.object(false);
        }
        if self.s.starts_with('[') {
            return self.array();
        }
        let end = self.s.find([',', '}', ']']).unwrap_or(self.s.len());
        let raw = self.s[..end].trim();
        if raw.is_empty() {
            return None;
        }
        self.s = &self.s[end..];
        if string {
            return Some(Value::String(raw.to_string()));
        }
        Some(serde_json::from_str::<Value>(raw).unwrap_or_else(|_| Value::String(raw.to_string())))
    }
}

fn declared_string(tools: Option<&Value>, tool: &str, arg: &str) -> bool {
    let Some(list) = tools.and_then(Value::as_array) else { return false };
    list.iter()
        .map(|t| t.get("function").unwrap_or(t))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(tool))
        .and_then(|f| f.pointer(&format!("/parameters/properties/{}/type", arg.replace('~', "~0").replace('/', "~1"))))
        .and_then(Value::as_str)
        == Some("string")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(s: &str) -> Option<(String, Value)> {
        parse_gemma_call(s, None).map(|c| (c.name, Value::Object(c.arguments)))
    }

    #[test]
    fn gemma_calls_parse_every_value_kind() {
        let (name, args) =
            call(r#"call:get_weather{city:<|"|>Paris, {FR}<|"|>,days:3,ok:true,none:null,unit:celsius,xs:[1,<|"|>a<|"|>,[]],o:{k:<|"|>v<|"|>,n:-1.5}}"#)
                .unwrap();
        assert_eq!(name, "get_weather");
        assert_eq!(
            args,
            json!({"city": "Paris, {FR}", "days": 3, "ok": true, "none": null, "unit": "celsius",
                   "xs": [1, "a", []], "o": {"k": "v", "n": -1.5}})
        );
        assert_eq!(call("call:now{}").unwrap(), ("now".into(), json!({})));
        assert_eq!(call(r#"call:tools.shell-exec{<|"|>cmd<|"|>:<|"|>ls<|"|>}"#).unwrap().1, json!({"cmd": "ls"}));
    }

    #[test]
    fn a_string_schema_keeps_bare_values_text() {
        let tools = json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"zip": {"type": "string"}}}}}]);
        let c = parse_gemma_call("call:f{zip:02139,n:7}", Some(&tools)).unwrap();
        assert_eq!(Value::Object(c.arguments), json!({"zip": "02139", "n": 7}));
    }

    #[test]
    fn malformed_gemma_calls_are_refused() {
        for bad in [
            "get_weather{a:1}",
            "call:{a:1}",
            "call:bad name{a:1}",
            "call:f{a:1",
            "call:f{a:1} trailing",
            "call:f{a}",
            r#"call:f{a:<|"|>open}"#,
            "call:f{a:[1,2}",
        ] {
            assert_eq!(call(bad), None, "{bad}");
        }
    }

    #[test]
    fn gemma_output_splits_reasoning_text_and_calls_at_any_chunking() {
        use crate::output::OutputParser;
        use crate::tools::Piece;
        let text = "<|channel>thought\nNeed weather.<channel|>Checking.<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|><|tool_call>call:now{}<tool_call|>";
        let whole = OutputParser::with_syntax(Syntax::Gemma, Some(false), Some(json!([]))).parse(text);
        assert_eq!(whole.reasoning, "Need weather.");
        assert_eq!(whole.content, "Checking.");
        assert_eq!(whole.calls.len(), 2);
        assert_eq!(Value::Object(whole.calls[0].arguments.clone()), json!({"city": "Paris", "days": 2}));
        assert_eq!(whole.calls[1].name, "now");
        let chars: Vec<char> = text.chars().collect();
        for step in [1, 2, 3, 5, 7, 13] {
            let mut p = OutputParser::with_syntax(Syntax::Gemma, Some(false), Some(json!([])));
            let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
            let mut pieces = Vec::new();
            for c in chars.chunks(step) {
                pieces.extend(p.push(&c.iter().collect::<String>()));
            }
            pieces.extend(p.finish());
            for piece in pieces {
                match piece {
                    Piece::Reasoning(r) => reasoning.push_str(&r),
                    Piece::Text(t) => {
                        assert!(!t.contains("<|"), "a marker leaked as text: {t:?}");
                        content.push_str(&t)
                    }
                    Piece::Call(c) => calls.push(c),
                }
            }
            assert_eq!((reasoning.trim_end(), content.trim()), ("Need weather.", "Checking."), "step {step}");
            assert_eq!(calls, whole.calls, "step {step}");
        }
        // GLM markers mean nothing to a Gemma model, and a malformed call stays text.
        let p = OutputParser::with_syntax(Syntax::Gemma, None, Some(json!([])))
            .parse("<tool_call>f</tool_call> <|tool_call>call:f{a:<tool_call|>");
        assert!(p.calls.is_empty());
        assert_eq!(p.content, "<tool_call>f</tool_call> <|tool_call>call:f{a:<tool_call|>");
    }

    fn qwen(s: &str, tools: Option<&Value>) -> Option<(String, Value)> {
        parse_qwen_call(s, tools).map(|c| (c.name, Value::Object(c.arguments)))
    }

    #[test]
    fn qwen_json_calls_parse() {
        let (name, args) = qwen(
            "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2, \"o\": {\"k\": [1]}}}\n",
            None,
        )
        .unwrap();
        assert_eq!((name.as_str(), args), ("get_weather", json!({"city": "Zürich", "days": 2, "o": {"k": [1]}})));
        // Arguments as a JSON string, or absent.
        assert_eq!(qwen(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#, None).unwrap().1, json!({"a": 1}));
        assert_eq!(qwen(r#"{"name": "now"}"#, None).unwrap(), ("now".into(), json!({})));
        for bad in [
            r#"{"arguments": {}}"#,
            r#"{"name": "", "arguments": {}}"#,
            r#"{"name": "f", "arguments": [1]}"#,
            r#"{"name": "f", "arguments": "nope"}"#,
            r#"{"name": "f", "arguments": {}"#,
            "f(1)",
        ] {
            assert_eq!(qwen(bad, None), None, "{bad}");
        }
    }

    #[test]
    fn qwen_coder_calls_parse_by_schema() {
        let tools = json!([{"type": "function", "function": {"name": "run",
            "parameters": {"type": "object", "properties": {"zip": {"type": "string"}, "n": {"type": "integer"},
                "flags": {"type": "array"}}}}}]);
        let body = "\n<function=run>\n<parameter=zip>\n02139\n</parameter>\n<parameter=n>\n7\n</parameter>\n\
                    <parameter=flags>\n[\"-v\", 2]\n</parameter>\n<parameter=code>\nprint(1)\n  x = 2\n\n</parameter>\n</function>\n";
        let (name, args) = qwen(body, Some(&tools)).unwrap();
        assert_eq!(name, "run");
        // A string keeps its inner whitespace: only one newline either side is layout.
        assert_eq!(args, json!({"zip": "02139", "n": 7, "flags": ["-v", 2], "code": "print(1)\n  x = 2\n"}));
        assert_eq!(qwen("<function=now>\n</function>", None).unwrap(), ("now".into(), json!({})));
        for bad in [
            "<function=f><parameter=a>1</function>",
            "<function=f>",
            "<function=>x</function>",
            "<function=f><parameter=a>1</parameter></function> tail",
        ] {
            assert_eq!(qwen(bad, None), None, "{bad}");
        }
    }

    #[test]
    fn qwen_output_splits_reasoning_text_and_calls_at_any_chunking() {
        use crate::output::OutputParser;
        use crate::tools::Piece;
        let text = "<think>\nNeed weather.\n</think>\n\nChecking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>";
        let whole = OutputParser::with_syntax(Syntax::Qwen, Some(false), Some(json!([]))).parse(text);
        assert_eq!((whole.reasoning.trim(), whole.content.trim()), ("Need weather.", "Checking."));
        assert_eq!(whole.calls.len(), 2);
        assert_eq!(Value::Object(whole.calls[0].arguments.clone()), json!({"city": "Paris"}));
        assert_eq!(whole.calls[1].name, "now");
        let chars: Vec<char> = text.chars().collect();
        for step in [1, 2, 3, 5, 7, 13] {
            let mut p = OutputParser::with_syntax(Syntax::Qwen, Some(false), Some(json!([])));
            let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
            let mut pieces = Vec::new();
            for c in chars.chunks(step) {
                pieces.extend(p.push(&c.iter().collect::<String>()));
            }
            pieces.extend(p.finish());
            for piece in pieces {
                match piece {
                    Piece::Reasoning(r) => reasoning.push_str(&r),
                    Piece::Text(t) => content.push_str(&t),
                    Piece::Call(c) => calls.push(c),
                }
            }
            assert_eq!((reasoning.trim(), content.trim()), ("Need weather.", "Checking."), "step {step}");
            assert_eq!(calls, whole.calls, "step {step}");
        }
    }

    #[test]
    fn minimax_blocks_parse_every_call_by_schema() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
        let body = "\n<invoke name=\"get_weather\">\n<parameter name=\"city\">02139</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n<invoke name=\"now\">\n</invoke>\n";
        let calls = parse_minimax_calls(body, Some(&tools)).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), Value::Object(calls[0].arguments.clone())),
            ("get_weather", json!({"city": "02139", "days": 3}))
        );
        assert_eq!((calls[1].name.as_str(), calls[1].arguments.len()), ("now", 0));
        // Without a schema a value is JSON where it parses.
        let c = parse_minimax_calls("<invoke name=\"f\"><parameter name=\"o\">{\"a\": [1]}</parameter><parameter name=\"s\">hi there</parameter></invoke>", None).unwrap();
        assert_eq!(Value::Object(c[0].arguments.clone()), json!({"o": {"a": [1]}, "s": "hi there"}));
        for bad in [
            "",
            "<invoke name=\"f\">",
            "<invoke name=f></invoke>",
            "<invoke name=\"f\"><parameter name=\"a\">1</invoke>",
            "<invoke name=\"f\"></invoke> tail",
            "<invoke name=\"\"></invoke>",
        ] {
            assert_eq!(parse_minimax_calls(bad, None), None, "{bad}");
        }
        // Streamed at any chunking, beside reasoning and text.
        use crate::output::OutputParser;
        let text = format!("<think>\nplan\n</think>\n\nOK.\n<minimax:tool_call>{body}</minimax:tool_call>");
        let whole = OutputParser::with_syntax(Syntax::MiniMax, Some(false), Some(tools.clone())).parse(&text);
        assert_eq!((whole.reasoning.trim(), whole.content.trim(), whole.calls.len()), ("plan", "OK.", 2));
        let chars: Vec<char> = text.chars().collect();
        for step in [1, 3, 7] {
            let mut p = OutputParser::with_syntax(Syntax::MiniMax, Some(false), Some(tools.clone()));
            let mut calls = Vec::new();
            for c in chars.chunks(step) {
                calls.extend(p.push(&c.iter().collect::<String>()).into_iter().filter_map(|x| match x {
                    crate::tools::Piece::Call(c) => Some(c),
                    _ => None,
                }));
            }
            assert_eq!(calls, whole.calls, "step {step}");
        }
    }

    /// DeepSeek's two call forms and Kimi K2's, several to a block, streamed at any chunking.
    #[test]
    fn deepseek_and_kimi_calls_parse() {
        use crate::output::OutputParser;
        use crate::tools::Piece;
        let v31 = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}<｜tool▁call▁end｜>\
                   <｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>";
        let r1 = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>\n\
                  <｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜>";
        let kimi = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\":\"Paris\",\"days\":2}<|tool_call_end|>\
                    <|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>\"{}\"<|tool_call_end|>";
        for (syntax, body) in [(Syntax::DeepSeek, v31), (Syntax::DeepSeek, r1), (Syntax::Kimi, kimi)] {
            let calls = syntax.parse_calls(body, None).unwrap_or_else(|| panic!("{body}"));
            assert_eq!(calls.len(), 2, "{body}");
            assert_eq!((calls[0].name.as_str(), calls[1].name.as_str()), ("get_weather", "now"));
            assert_eq!(Value::Object(calls[0].arguments.clone()), json!({"city": "Paris", "days": 2}));
            assert!(calls[1].arguments.is_empty());
            let (open, close) = syntax.call();
            let text = format!("<think>plan</think>Checking.{open}{body}{close}");
            let whole = OutputParser::with_syntax(syntax, Some(false), Some(json!([]))).parse(&text);
            assert_eq!((whole.reasoning.trim(), whole.content.trim()), ("plan", "Checking."));
            assert_eq!(whole.calls, calls);
            let chars: Vec<char> = text.chars().collect();
            for step in [1, 2, 5, 11] {
                let mut p = OutputParser::with_syntax(syntax, Some(false), Some(json!([])));
                let mut got = Vec::new();
                for c in chars.chunks(step) {
                    got.extend(p.push(&c.iter().collect::<String>()));
                }
                got.extend(p.finish());
                let got: Vec<_> = got
                    .into_iter()
                    .filter_map(|x| match x {
                        Piece::Call(c) => Some(c),
                        Piece::Text(t) => {
                            assert!(!t.contains("tool"), "a marker leaked as text: {t:?}");
                            None
                        }
                        Piece::Reasoning(_) => None,
                    })
                    .collect();
                assert_eq!(got, calls, "{syntax:?} step {step}");
            }
        }
        for (syntax, bad) in [
            (Syntax::DeepSeek, ""),
            (Syntax::DeepSeek, "<｜tool▁call▁begin｜>f{}<｜tool▁call▁end｜>"),
            (Syntax::DeepSeek, "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"),
            (Syntax::DeepSeek, "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}"),
            (Syntax::DeepSeek, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}<｜tool▁call▁end｜>"),
            (Syntax::Kimi, "<|tool_call_begin|>functions.f:0{}<|tool_call_end|>"),
            (Syntax::Kimi, "<|tool_call_begin|><|tool_call_argument_begin|>{}<|tool_call_end|>"),
            (Syntax::Kimi, "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|> x"),
        ] {
            assert_eq!(syntax.parse_calls(bad, None), None, "{bad}");
        }
    }
}
