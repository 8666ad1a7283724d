//! HF chat templates rendered with minijinja, configured like transformers' jinja
//! environment (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, Python
//! string methods through pycompat).

use anyhow::{anyhow, Result};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// A chat message; fields beyond role/content (tool calls, names, ...) pass through to
/// the template unchanged.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: Value,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: Value::String(content.into()), extra: Default::default() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    pub bos_token: String,
    pub eos_token: String,
}

fn special_token(cfg: &Value, key: &str) -> String {
    match cfg.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or("").to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Finds the template in `chat_template.jinja`, else `tokenizer_config.json`
    /// (`chat_template` as a string, or the entry named `default` of a list).
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let tok_cfg_path = dir.join("tokenizer_config.json");
        let tok_cfg: Value = match std::fs::read_to_string(&tok_cfg_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", tok_cfg_path.display()))?
            }
            Err(_) => Value::Null,
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            std::fs::read_to_string(&jinja).map_err(|e| anyhow!("{}: {e}", jinja.display()))?
        } else {
            match tok_cfg.get("chat_template") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .ok_or_else(|| anyhow!("{}: `chat_template` list has no `default` entry", tok_cfg_path.display()))?
                    .to_string(),
                _ => return Ok(None),
            }
        };
        let tpl = Self::new(&source, special_token(&tok_cfg, "bos_token"), special_token(&tok_cfg, "eos_token"))
            .map_err(|e| anyhow!("{}: chat template: {e}", dir.display()))?;
        Ok(Some(tpl))
    }

    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow!("{e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it to print today's date; a fixed answer keeps prompts reproducible.
            "2026-01-01".to_string()
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| anyhow!("{e}"))?;
        Ok(Self { env, bos_token, eos_token })
    }

    /// Renders `messages` (and optional tool schemas) as transformers'
    /// `apply_chat_template(..., tokenize=False)` does.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, tools: Option<&Value>) -> Result<String> {
        if messages.is_empty() {
            anyhow::bail!("chat needs at least one message");
        }
        let tpl = self.env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
        let ctx = minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            tools => minijinja::Value::from(minijinja::value::Serde(tools)),
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        tpl.render(ctx).map_err(|e| anyhow!("chat template: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", String::new(), String::new()).unwrap();
        let err = t.render(&[Message::new("user", "x")], true, None).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
        assert!(t.render(&[], true, None).is_err());
    }
}
