//! HF chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)`
//! renders them: the same template environment (see [`pyenv`]), the same inputs
//! (messages with `None` fields dropped and reasoning aliased, `tools` and `documents`
//! as `None` when absent, the tokenizer's special tokens, extra template variables),
//! `continue_final_message`, and every mapping in the order it was given.

mod fallback;
mod pyenv;
mod pyfmt;
mod pymethods;

pub use fallback::{inject_tool_calls, inject_tools, tools_system_text};
pub use pyenv::Clock;
pub use pyfmt::{json_dumps, JsonOptions};

/// How an assistant message with tool calls is given to a template
/// ([`ChatTemplate::call_message_shape`]); the default is transformers' own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallShape {
    /// Arguments as JSON text (else an object).
    pub arguments_text: bool,
    /// A missing or null content as an empty string (else left out).
    pub content_text: bool,
}

/// `v` as Python's `json.dumps` writes it by default (`", "` and `": "` separators, ASCII
/// escapes): how transformers' templates and most clients lay JSON out.
pub fn python_json(v: &Value) -> String {
    json_dumps(&minijinja::Value::from(minijinja::value::Serde(v)), &JsonOptions::default())
        .unwrap_or_else(|_| v.to_string())
}

use anyhow::{anyhow, bail, Result};
use minijinja::Environment;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::path::Path;

/// A chat message; fields beyond role/content (tool calls, names, ...) pass through to
/// the template unchanged.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: Value,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: Value::String(content.into()), extra: Default::default() }
    }

    /// The message as the JSON object a template sees: `role`, `content`, then the rest.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), Value::String(self.role.clone()));
        m.insert("content".into(), self.content.clone());
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Value::Object(m)
    }
}

/// What a render is asked for, besides the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    /// Leave the final message open for the model to continue (transformers'
    /// `continue_final_message=True`); not with `add_generation_prompt`.
    pub continue_final_message: bool,
    /// Tool schemas (`tools`); `None` reaches the template as `None`, as in transformers.
    pub tools: Option<Value>,
    /// RAG documents (`documents`).
    pub documents: Option<Value>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub kwargs: Map<String, Value>,
}

/// Variables `render` sets itself; template kwargs may not name them.
pub const RESERVED_VARIABLES: [&str; 6] =
    ["messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"];

/// The special tokens transformers passes to templates (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

struct Compiled {
    env: Environment<'static>,
    source: String,
    variables: HashSet<String>,
}

impl Compiled {
    fn new(source: &str, clock: Clock) -> Result<Self> {
        let mut env = Environment::new();
        pyenv::configure(&mut env, clock).map_err(|e| anyhow!("{e}"))?;
        env.add_template_owned("chat", pyenv::rewrite_generation_blocks(source)).map_err(|e| anyhow!("{e}"))?;
        let variables = env.get_template("chat").map_err(|e| anyhow!("{e}"))?.undeclared_variables(false);
        Ok(Self { env, source: source.to_string(), variables })
    }
}

pub struct ChatTemplate {
    main: Compiled,
    /// The template named `tool_use`, which transformers picks when tools are given.
    tool_use: Option<Compiled>,
    pub bos_token: String,
    pub eos_token: String,
    /// `unk_token`, `pad_token`, ... as the tokenizer config sets them.
    special_tokens: Map<String, Value>,
    clock: Clock,
    /// What [`Self::call_message_shape`] found (its sources never change).
    call_shape: std::sync::OnceLock<CallShape>,
}

fn special_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl ChatTemplate {
    /// Finds the template in `chat_template.jinja`, else `tokenizer_config.json`
    /// (`chat_template` as a string, or a list of named templates: `default`, and
    /// `tool_use` for requests with tools).
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let tok_cfg_path = dir.join("tokenizer_config.json");
        let tok_cfg: Value = match std::fs::read_to_string(&tok_cfg_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", tok_cfg_path.display()))?
            }
            Err(_) => Value::Null,
        };
        let jinja = dir.join("chat_template.jinja");
        let named = |list: &[Value], name: &str| -> Option<String> {
            list.iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(String::from)
        };
        let (source, tool_use) = if jinja.exists() {
            (std::fs::read_to_string(&jinja).map_err(|e| anyhow!("{}: {e}", jinja.display()))?, None)
        } else {
            match tok_cfg.get("chat_template") {
                Some(Value::String(s)) => (s.clone(), None),
                Some(Value::Array(list)) => (
                    named(list, "default").ok_or_else(|| {
                        anyhow!("{}: `chat_template` list has no `default` entry", tok_cfg_path.display())
                    })?,
                    named(list, "tool_use"),
                ),
                _ => return Ok(None),
            }
        };
        let mut specials = Map::new();
        for key in SPECIAL_TOKENS {
            if let Some(t) = special_token(&tok_cfg, key) {
                specials.insert(key.into(), Value::String(t));
            }
        }
        let bos = special_token(&tok_cfg, "bos_token").unwrap_or_default();
        let eos = special_token(&tok_cfg, "eos_token").unwrap_or_default();
        let mut tpl = Self::new(&source, bos, eos).map_err(|e| anyhow!("{}: chat template: {e}", dir.display()))?;
        tpl.special_tokens = specials;
        if let Some(t) = tool_use {
            tpl.tool_use = Some(
                Compiled::new(&t, tpl.clock)
                    .map_err(|e| anyhow!("{}: chat template `tool_use`: {e}", dir.display()))?,
            );
        }
        Ok(Some(tpl))
    }

    /// A template from its source; an empty `bos_token` / `eos_token` is left unset.
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut special_tokens = Map::new();
        for (k, v) in [("bos_token", &bos_token), ("eos_token", &eos_token)] {
            if !v.is_empty() {
                special_tokens.insert(k.into(), Value::String(v.clone()));
            }
        }
        Ok(Self {
            main: Compiled::new(source, Clock::Local)?,
            tool_use: None,
            bos_token,
            eos_token,
            special_tokens,
            clock: Clock::Local,
            call_shape: std::sync::OnceLock::new(),
        })
    }

    /// Sets where `strftime_now` reads the time (a fixed instant makes prompts
    /// reproducible in tests).
    pub fn set_clock(&mut self, clock: Clock) -> Result<()> {
        self.clock = clock;
        self.main = Compiled::new(&self.main.source, clock)?;
        if let Some(t) = &self.tool_use {
            self.tool_use = Some(Compiled::new(&t.source, clock)?);
        }
        Ok(())
    }

    /// The template's source (the default one).
    pub fn source(&self) -> &str {
        &self.main.source
    }

    fn pick(&self, tools: bool) -> &Compiled {
        match &self.tool_use {
            Some(t) if tools => t,
            _ => &self.main,
        }
    }

    /// Whether the template (the one picked with or without tools) reads the top-level
    /// variable `name` (`tools`, `enable_thinking`, ...).
    pub fn uses(&self, name: &str, with_tools: bool) -> bool {
        self.pick(with_tools).variables.contains(name)
    }

    /// Whether the template reads content given as a list of parts (`{"type": "text",
    /// "text": ...}`); when not, callers join text parts into one string (as vLLM does).
    pub fn reads_content_parts(&self) -> bool {
        const MARKS: [&str; 8] = [
            ".text",
            "['text']",
            "[\"text\"]",
            "is string",
            "is not string",
            "is iterable",
            "is sequence",
            "is mapping",
        ];
        let s = &self.main.source;
        MARKS.iter().any(|m| s.contains(m))
    }

    /// Whether the template renders the assistant's `tool_calls`.
    pub fn reads_tool_calls(&self, with_tools: bool) -> bool {
        self.pick(with_tools).source.contains("tool_calls")
    }

    /// How an assistant message with tool calls must reach this template. Most templates
    /// iterate over a call's arguments or `tojson` them, and want an object; DeepSeek-V3.1's
    /// concatenates them and its content to strings, which needs the arguments as JSON text
    /// and the content (which clients send as null, and transformers drops) as a string.
    /// Told by rendering such a message each way, transformers' own first, once.
    pub fn call_message_shape(&self) -> CallShape {
        *self.call_shape.get_or_init(|| self.probe_call_shape())
    }

    fn probe_call_shape(&self) -> CallShape {
        let renders = |shape: CallShape| {
            let arguments = match shape.arguments_text {
                true => Value::String("{\"a\": 1}".into()),
                false => serde_json::json!({"a": 1}),
            };
            let mut call = serde_json::json!({"role": "assistant", "tool_calls": [{"id": "c0", "type": "function",
                "function": {"name": "f", "arguments": arguments}}]});
            if shape.content_text {
                call["content"] = Value::String(String::new());
            }
            let msgs = [
                serde_json::json!({"role": "user", "content": "x"}),
                call,
                serde_json::json!({"role": "tool", "tool_call_id": "c0", "content": "y"}),
            ];
            let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]);
            let opts = RenderOptions { tools: Some(tools), ..Default::default() };
            self.render_json(&msgs, &opts).is_ok()
        };
        let shapes = [(false, false), (true, false), (false, true), (true, true)]
            .map(|(arguments_text, content_text)| CallShape { arguments_text, content_text });
        shapes.into_iter().find(|s| renders(*s)).unwrap_or_default()
    }

    /// Renders `messages` (and optional tool schemas) as transformers'
    /// `apply_chat_template(..., tokenize=False)` does.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, tools: Option<&Value>) -> Result<String> {
        let msgs: Vec<Value> = messages.iter().map(Message::to_json).collect();
        let opts = RenderOptions { add_generation_prompt, tools: tools.cloned(), ..Default::default() };
        self.render_json(&msgs, &opts)
    }

    /// Renders messages given as JSON objects, each key in the order given.
    pub fn render_json(&self, messages: &[Value], opts: &RenderOptions) -> Result<String> {
        if messages.is_empty() {
            bail!("chat needs at least one message");
        }
        if opts.continue_final_message && opts.add_generation_prompt {
            bail!("continue_final_message and add_generation_prompt cannot be used together");
        }
        let mut chat = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let Value::Object(m) = m else {
                bail!("messages[{i}] must be an object");
            };
            chat.push(normalize_message(m));
        }
        let mut cont = None;
        if opts.continue_final_message {
            cont = Some(tag_final_message(chat.last_mut().expect("not empty"), &self.main.source)?);
        }
        let mut ctx = self.special_tokens.clone();
        for (k, v) in &opts.kwargs {
            if RESERVED_VARIABLES.contains(&k.as_str()) {
                bail!("template variable `{k}` cannot be set as a template keyword argument");
            }
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Value::Array(chat.into_iter().map(Value::Object).collect()));
        ctx.insert("tools".into(), opts.tools.clone().unwrap_or(Value::Null));
        ctx.insert("documents".into(), opts.documents.clone().unwrap_or(Value::Null));
        ctx.insert("add_generation_prompt".into(), Value::Bool(opts.add_generation_prompt));
        let compiled = self.pick(opts.tools.is_some());
        let tpl = compiled.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        let text = tpl.render(minijinja::Value::from(minijinja::value::Serde(&ctx))).map_err(template_error)?;
        match cont {
            Some(final_text) => cut_at_continue_tag(text, &final_text),
            None => Ok(text),
        }
    }
}

/// A render error as `chat template line N: what went wrong`.
fn template_error(e: minijinja::Error) -> anyhow::Error {
    let what = match e.detail() {
        Some(d) if e.kind() == minijinja::ErrorKind::InvalidOperation => d.to_string(),
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    match e.line() {
        Some(n) => anyhow!("chat template line {n}: {what}"),
        None => anyhow!("chat template: {what}"),
    }
}

/// transformers' message preparation: keys whose value is `None` are dropped, and the
/// reasoning (`reasoning_content`, `thinking` or `reasoning`) is offered both as
/// `thinking` (first) and `reasoning_content`.
fn normalize_message(m: &Map<String, Value>) -> Map<String, Value> {
    let m: Map<String, Value> = m.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
    let Some(reasoning) = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| m.get(*k)).cloned() else {
        return m;
    };
    let mut out = Map::new();
    out.insert("thinking".into(), m.get("thinking").cloned().unwrap_or_else(|| reasoning.clone()));
    for (k, v) in m {
        if k != "thinking" {
            out.insert(k, v);
        }
    }
    out.insert("reasoning_content".into(), reasoning);
    out
}

const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Marks the end of the final message's text (its content, or the last text part) so
/// the rendered prompt can be cut right after it; answers the text that was marked.
fn tag_final_message(last: &mut Map<String, Value>, source: &str) -> Result<String> {
    if !source.contains("content") {
        bail!("continue_final_message: the chat template does not read message `content`");
    }
    match last.get_mut("content") {
        Some(Value::String(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(text)
        }
        Some(Value::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Value::String(t)) = part.get_mut("text") {
                    let text = t.clone();
                    t.push_str(CONTINUE_TAG);
                    return Ok(text);
                }
            }
            bail!("continue_final_message: the final message has no text to continue")
        }
        _ => bail!("continue_final_message: the final message has no `content` to continue"),
    }
}

fn cut_at_continue_tag(text: String, final_text: &str) -> Result<String> {
    let tag = CONTINUE_TAG.trim();
    if !text.contains(final_text.trim()) || !text.contains(tag) {
        bail!("continue_final_message: the chat template drops part of the final message, so it cannot be continued");
    }
    let at = text.rfind(tag).expect("checked above");
    if text[at..].starts_with(CONTINUE_TAG) {
        Ok(text[..at].to_string())
    } else {
        Ok(text[..at].trim_end().to_string())
    }
}

#[cfg(test)]
mod tests;
