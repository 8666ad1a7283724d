//! What each API asks the output to follow: `response_format` (Chat, Completions),
//! `text.format` (Responses), and tool choices that force a call (`tool_choice`
//! "required" or a named function; Anthropic's "any" and "tool"), as a
//! [`crate::grammar::Format`].

use crate::error::{ApiError, ApiResult};
use crate::grammar::Format;
use serde_json::Value;

fn bad(param: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("{param}: {msg}")).with_param(param)
}

/// OpenAI's `response_format` (or the Responses API's `text.format`, whose schema sits
/// beside `type` instead of under `json_schema`). Extensions: `{"type": "regex",
/// "regex": "..."}` and `{"type": "grammar", "grammar": "..."}` (a Lark grammar in
/// llguidance's dialect).
pub fn response_format(v: Option<&Value>, param: &str) -> ApiResult<Option<Format>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| bad(param, "needs a `type`"))?;
    let text_field = |k: &str| -> ApiResult<String> {
        v.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .ok_or_else(|| bad(param, format!("type `{kind}` needs a non-empty string `{k}`")))
    };
    Ok(Some(match kind {
        "text" => return Ok(None),
        "json_object" => Format::JsonObject,
        "json_schema" => {
            // Chat Completions: {"json_schema": {"name", "schema", "strict"}}; Responses:
            // {"name", "schema", "strict"} beside `type`.
            let holder = v.get("json_schema").unwrap_or(v);
            let schema = holder.get("schema").cloned().unwrap_or(Value::Null);
            let strict = holder.get("strict").and_then(Value::as_bool).unwrap_or(false);
            match schema {
                Value::Object(_) if strict => Format::JsonSchema(strictify(schema)),
                Value::Object(_) => Format::JsonSchema(schema),
                Value::Bool(true) | Value::Null if holder.get("schema").is_none() => {
                    return Err(bad(param, "type `json_schema` needs a `schema` object"))
                }
                _ => return Err(bad(param, "the `schema` must be a JSON Schema object")),
            }
        }
        "regex" => Format::Regex(text_field("regex")?),
        "grammar" | "lark" => Format::Lark(text_field("grammar")?),
        other => {
            return Err(bad(
                param,
                format!("type `{other}` is not supported (text, json_object, json_schema, regex, grammar)"),
            ))
        }
    }))
}

/// OpenAI's strict mode: objects hold only their declared properties
/// (`additionalProperties` false where a schema does not say), at every depth.
pub fn strictify(mut schema: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(o) => {
                if o.contains_key("properties") && !o.contains_key("additionalProperties") {
                    o.insert("additionalProperties".into(), Value::Bool(false));
                }
                for (_, child) in o.iter_mut() {
                    walk(child);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut schema);
    schema
}

/// The tools a `tool_choice` forces a call to, if it forces one: "required" (any of
/// them), or a named function (that one). "auto", "none" and no choice force nothing.
/// `tools`: OpenAI-style function schemas.
pub fn openai_tool_choice(choice: Option<&Value>, tools: Option<&Value>) -> ApiResult<Option<Vec<Value>>> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else { return Ok(None) };
    let list = tools.and_then(Value::as_array).cloned().unwrap_or_default();
    let named = |name: &str| -> ApiResult<Option<Vec<Value>>> {
        let found: Vec<Value> = list
            .iter()
            .filter(|t| t.get("function").unwrap_or(t).get("name").and_then(Value::as_str) == Some(name))
            .cloned()
            .collect();
        if found.is_empty() {
            return Err(bad("tool_choice", format!("no tool named `{name}` is in `tools`")));
        }
        Ok(Some(found))
    };
    match choice {
        Value::String(s) => match s.as_str() {
            "auto" | "none" => Ok(None),
            "required" if list.is_empty() => Err(bad("tool_choice", "`required` needs `tools`")),
            "required" => Ok(Some(list)),
            other => Err(bad("tool_choice", format!("`{other}` is not one of none, auto, required"))),
        },
        Value::Object(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice", "a named choice needs `function.name`"))?;
            match o.get("type").and_then(Value::as_str) {
                Some("function") | None => named(name),
                Some(t) => Err(bad("tool_choice", format!("type `{t}` is not supported (function)"))),
            }
        }
        _ => Err(bad("tool_choice", "must be a string or an object")),
    }
}

/// Anthropic's `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name",
/// "disable_parallel_tool_use"}`; returns the forced tools and whether several calls
/// may come.
pub fn anthropic_tool_choice(choice: Option<&Value>, tools: Option<&Value>) -> ApiResult<(Option<Vec<Value>>, bool)> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else { return Ok((None, true)) };
    let parallel = !choice.get("disable_parallel_tool_use").and_then(Value::as_bool).unwrap_or(false);
    let kind = choice.get("type").and_then(Value::as_str).unwrap_or("");
    let forced = match kind {
        "auto" | "none" => None,
        "any" => openai_tool_choice(Some(&Value::String("required".into())), tools)?,
        "tool" => {
            let name = choice
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice", "type `tool` needs a `name`"))?;
            openai_tool_choice(Some(&serde_json::json!({"type": "function", "function": {"name": name}})), tools)?
        }
        other => return Err(bad("tool_choice", format!("type `{other}` is not one of auto, any, tool, none"))),
    };
    Ok((forced, parallel))
}

/// The one format a request follows: a forced tool call or a response format, not both.
pub fn combine(
    format: Option<Format>,
    forced: Option<Vec<Value>>,
    parallel: bool,
) -> ApiResult<Option<(Format, &'static str)>> {
    match (format, forced) {
        (Some(_), Some(_)) => Err(bad("tool_choice", "a forced tool call and a response format cannot both apply")),
        (Some(f), None) => Ok(Some((f, "response_format"))),
        (None, Some(tools)) => Ok(Some((Format::ToolCalls { tools, parallel }, "tool_choice"))),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_and_choices_are_read_or_refused_by_name() {
        assert!(response_format(Some(&json!({"type": "text"})), "response_format").unwrap().is_none());
        assert!(matches!(
            response_format(
                Some(&json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})),
                "response_format"
            )
            .unwrap(),
            Some(Format::JsonSchema(_))
        ));
        assert!(matches!(
            response_format(
                Some(&json!({"type": "json_schema", "name": "x", "schema": {"type": "object"}})),
                "text.format"
            )
            .unwrap(),
            Some(Format::JsonSchema(_))
        ));
        for bad_format in [json!({"type": "xml"}), json!({"type": "regex"}), json!({"type": "json_schema"}), json!({})]
        {
            let e = response_format(Some(&bad_format), "response_format").unwrap_err();
            assert_eq!(e.param.as_deref(), Some("response_format"), "{bad_format}");
        }
        let tools =
            json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]);
        assert_eq!(openai_tool_choice(Some(&json!("required")), Some(&tools)).unwrap().unwrap().len(), 2);
        let one =
            openai_tool_choice(Some(&json!({"type": "function", "function": {"name": "b"}})), Some(&tools)).unwrap();
        assert_eq!(one.unwrap()[0]["function"]["name"], "b");
        assert!(openai_tool_choice(Some(&json!("auto")), Some(&tools)).unwrap().is_none());
        assert!(
            openai_tool_choice(Some(&json!({"type": "function", "function": {"name": "c"}})), Some(&tools)).is_err()
        );
        assert!(openai_tool_choice(Some(&json!("required")), None).is_err());
        let (forced, parallel) = anthropic_tool_choice(
            Some(&json!({"type": "tool", "name": "a", "disable_parallel_tool_use": true})),
            Some(&tools),
        )
        .unwrap();
        assert_eq!((forced.unwrap().len(), parallel), (1, false));
        assert!(anthropic_tool_choice(Some(&json!({"type": "some"})), Some(&tools)).is_err());
        assert!(combine(Some(Format::JsonObject), Some(vec![]), true).is_err());
        let s = strictify(json!({"type": "object", "properties": {"a": {"type": "object", "properties": {}},
            "b": {"type": "object", "properties": {}, "additionalProperties": true}}}));
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["a"]["additionalProperties"], false);
        assert_eq!(s["properties"]["b"]["additionalProperties"], true);
    }
}
