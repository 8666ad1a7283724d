//! Structured output through llguidance: JSON (any object, or a JSON Schema), a regular
//! expression, a Lark grammar, and forced tool calls in the model's own call syntax
//! (GLM: `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs),
//! their arguments held to each tool's schema. A grammar becomes a token mask before
//! every sample ([`strata_engine::sampling::TokenConstraint`]); the serving engine
//! computes it while the forward runs.

use crate::error::{ApiError, ApiResult};
use crate::output::{THINK_END, THINK_START};
use crate::syntax::{Syntax, DEEPSEEK_SEP, GEMMA_QUOTE, KIMI_ARGS};
use crate::tools::{CALL_END, CALL_START};
use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use strata_engine::sampling::{TokenConstraint, TokenMask};
use strata_engine::LoadedModel;

pub const ARG_KEY: (&str, &str) = ("<arg_key>", "</arg_key>");
pub const ARG_VALUE: (&str, &str) = ("<arg_value>", "</arg_value>");

/// The model's tokenizer as llguidance sees it: every token's bytes (special tokens
/// marked), and our own tokenizer for the text a grammar forces.
struct ModelTokEnv {
    trie: TokTrie,
    model: Arc<LoadedModel>,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        self.model.tokenizer.as_ref().and_then(|t| t.encode(&text, false).ok()).unwrap_or_default()
    }
}

/// What a response must follow.
#[derive(Clone, Debug)]
pub enum Format {
    /// Any JSON object (`json_object`).
    JsonObject,
    /// A JSON Schema (`json_schema`).
    JsonSchema(Value),
    /// A regular expression over the whole text (extension).
    Regex(String),
    /// A Lark grammar (llguidance's dialect; extension).
    Lark(String),
    /// One or more calls of the given tools (`tool_choice` "required", a named tool,
    /// Anthropic's "any" / "tool"): OpenAI-style function schemas.
    ToolCalls { tools: Vec<Value>, parallel: bool },
}

/// Compiles formats for one model.
pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
    /// The call markers, as special tokens where the tokenizer has them.
    special: Vec<(&'static str, Option<u32>)>,
    syntax: Syntax,
}

fn quote(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

impl Grammars {
    pub fn new(model: Arc<LoadedModel>) -> Result<Self> {
        let tok = model.tokenizer()?;
        let json = tok.to_json()?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        let vocab = model.model.info().vocab_size;
        words.resize(vocab.max(words.len()), Vec::new());
        let eos = model.eos_token_ids.clone();
        let first = *eos.first().ok_or_else(|| anyhow!("the model declares no end-of-sequence id"))?;
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, first), &words);
        let syntax = Syntax::of(model.arch.family().chat);
        let special = [CALL_START, CALL_END, ARG_KEY.0, ARG_KEY.1, ARG_VALUE.0, ARG_VALUE.1, THINK_START, THINK_END]
            .into_iter()
            .chain(syntax.markers())
            .map(|m| (m, tok.token_id(m).filter(|&id| tok.encode(m, false).ok().as_deref() == Some(&[id]))))
            .collect();
        let env: TokEnv = Arc::new(ModelTokEnv { trie, model: model.clone() });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.set_stderr_log_level(0);
        Ok(Self { factory, eos, special, syntax })
    }

    /// A marker in a Lark rule: its special token, or the literal text.
    fn marker(&self, m: &str) -> String {
        match self.special.iter().find(|(s, _)| *s == m).and_then(|(_, id)| *id) {
            Some(id) => format!("<[{id}]>"),
            None => quote(m),
        }
    }

    /// The Lark grammar of `format`; `think`: the output starts inside reasoning (the
    /// prompt opened `<think>`), which runs free up to `</think>`.
    pub fn lark(&self, format: &Format, think: bool) -> Result<String> {
        let mut g = String::new();
        let body = match format {
            Format::JsonObject => format!("%json {}", json_options(json!({"type": "object"}))),
            Format::JsonSchema(s) => format!("%json {}", json_options(s.clone())),
            Format::Regex(r) => format!("/{}/", r.replace('/', "\\/")),
            Format::Lark(l) if !think && self.syntax != Syntax::Harmony => return Ok(l.clone()),
            Format::Lark(l) => {
                // The user's grammar, its start rule renamed to go after the reasoning.
                for line in l.lines() {
                    match line.trim_start().strip_prefix("start:") {
                        Some(rest) => g.push_str(&format!("user_start:{rest}\n")),
                        None => g.push_str(&format!("{line}\n")),
                    }
                }
                "user_start".to_string()
            }
            Format::ToolCalls { tools, .. } if self.syntax == Syntax::Harmony => {
                // A call as the template writes one after `<|start|>assistant`:
                // ` to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`.
                // A harmony call ends the turn, so there is one a turn.
                use crate::harmony::{CALL, CHANNEL, MESSAGE};
                let names: Vec<String> = tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let (name, params, _) = tool_parts(t.get("function").unwrap_or(t));
                        g.push_str(&format!(
                            "call{i}: {} {} {} call{i}_args {}\ncall{i}_args: %json {}\n",
                            quote(&format!(" to=functions.{name}")),
                            self.marker(CHANNEL),
                            format_args!("{} {}", quote("commentary json"), self.marker(MESSAGE)),
                            self.marker(CALL),
                            call_arguments(params)
                        ));
                        format!("call{i}")
                    })
                    .collect();
                names.join(" | ")
            }
            Format::ToolCalls { tools, parallel } if self.syntax == Syntax::Gemma => {
                let names: Vec<String> = tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        g.push_str(&self.gemma_call_rule(i, t.get("function").unwrap_or(t)));
                        format!("call{i}")
                    })
                    .collect();
                g.push_str(&format!("call: {}\n", names.join(" | ")));
                g.push_str(&self.gemma_value_rules());
                // Gemma writes consecutive calls back to back.
                if *parallel {
                    "call (call)*".to_string()
                } else {
                    "call".to_string()
                }
            }
            Format::ToolCalls { tools, parallel } if self.syntax == Syntax::Qwen => {
                // `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`, as the
                // template writes a call; ARGS is JSON to the tool's schema.
                let names: Vec<String> = tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let (name, params, _) = tool_parts(t.get("function").unwrap_or(t));
                        let head = format!("\n{{\"name\": {}, \"arguments\": ", quote(name));
                        g.push_str(&format!(
                            "call{i}: {} {} call{i}_args \"}}\\n\" {}\ncall{i}_args: %json {}\n",
                            self.marker(CALL_START),
                            quote(&head),
                            self.marker(CALL_END),
                            call_arguments(params)
                        ));
                        format!("call{i}")
                    })
                    .collect();
                g.push_str(&format!("call: {}\n", names.join(" | ")));
                if *parallel {
                    "call (\"\\n\" call)*".to_string()
                } else {
                    "call".to_string()
                }
            }
            Format::ToolCalls { tools, parallel } if matches!(self.syntax, Syntax::DeepSeek | Syntax::Kimi) => {
                // One block of calls, each its name then JSON arguments to the tool's
                // schema, as the official templates write them: DeepSeek V3.1's
                // `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`, Kimi's
                // `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>ARGS<|tool_call_end|>`.
                let ((open, close), (begin, end)) = (self.syntax.call(), self.syntax.call_parts());
                let names: Vec<String> = tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let (name, params, _) = tool_parts(t.get("function").unwrap_or(t));
                        let head = match self.syntax {
                            Syntax::Kimi => format!(
                                "{} {} INDEX {}",
                                self.marker(begin),
                                quote(&format!("functions.{name}:")),
                                self.marker(KIMI_ARGS)
                            ),
                            _ => format!("{} {} {}", self.marker(begin), quote(name), self.marker(DEEPSEEK_SEP)),
                        };
                        g.push_str(&format!(
                            "call{i}: {head} call{i}_args {}\ncall{i}_args: %json {}\n",
                            self.marker(end),
                            call_arguments(params)
                        ));
                        format!("call{i}")
                    })
                    .collect();
                // Kimi numbers a block's calls from 0.
                let index = if *parallel { "/[0-9]{1,2}/" } else { "\"0\"" };
                g.push_str(&format!("call: {}\nINDEX: {index}\n", names.join(" | ")));
                let calls = if *parallel { "call (call)*" } else { "call" };
                format!("{} {calls} {}", self.marker(open), self.marker(close))
            }
            Format::ToolCalls { tools, parallel } => {
                let names: Vec<String> = tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let f = t.get("function").unwrap_or(t);
                        g.push_str(&self.call_rule(i, f));
                        format!("call{i}")
                    })
                    .collect();
                g.push_str(&format!("call: {}\nARGTEXT: /[^<]*/\n", names.join(" | ")));
                if *parallel {
                    "call (\"\\n\" call)*".to_string()
                } else {
                    "call".to_string()
                }
            }
        };
        if self.syntax == Syntax::Harmony {
            return Ok(g + &self.harmony_start(&body, think, matches!(format, Format::ToolCalls { .. })));
        }
        let prefix = if think { format!("REASONING {} ", self.marker(self.syntax.think().1)) } else { String::new() };
        g.push_str(&format!("start: {prefix}body\nbody: {body}\n"));
        if think {
            g.push_str("REASONING: /[^<]*/\n");
        }
        Ok(g)
    }

    /// Harmony's start rule: an analysis message (optional; its rest only, where the prompt
    /// opened it), then `body` as a call (`call`) or on the final channel.
    fn harmony_start(&self, body: &str, think: bool, call: bool) -> String {
        use crate::harmony::{CHANNEL, END, MESSAGE, START};
        let next = format!("{} {} \"assistant\"", self.marker(END), self.marker(START));
        let prefix = match think {
            true => format!("REASONING {next} "),
            false => "analysis? ".to_string(),
        };
        let head = match call {
            true => String::new(),
            false => format!("{} \"final\" {} ", self.marker(CHANNEL), self.marker(MESSAGE)),
        };
        format!(
            "start: {prefix}{head}body\nbody: {body}\nanalysis: {} \"analysis\" {} REASONING {next}\nREASONING: /[^<]*/\n",
            self.marker(CHANNEL),
            self.marker(MESSAGE)
        )
    }

    /// One tool's call: its name, then its arguments (required ones always, in the
    /// schema's order; others optional). String values are raw text: one of an `enum`,
    /// a `pattern`, or text without `<` within `minLength`/`maxLength`; other values
    /// are JSON per their schema.
    fn call_rule(&self, i: usize, f: &Value) -> String {
        let (name, params, required) = tool_parts(f);
        let (start, end) = self.syntax.call();
        let minimax = self.syntax == Syntax::MiniMax;
        let mut rule = match minimax {
            true => format!("call{i}: {} {}", self.marker(start), quote(&format!("\n<invoke name=\"{name}\">\n"))),
            false => format!("call{i}: {} {} \"\\n\"", self.marker(CALL_START), quote(name)),
        };
        let mut extra = String::new();
        if let Some(props) = params.get("properties").and_then(Value::as_object) {
            for (j, (key, schema)) in props.iter().enumerate() {
                let string = schema.get("type").and_then(Value::as_str) == Some("string");
                let v = format!("call{i}_v{j}");
                // String values are written raw (GLM's and MiniMax's convention; the parser
                // keeps them strings), everything else as JSON.
                let value = match (string, string_text(schema)) {
                    (true, Some(text)) => {
                        extra.push_str(&format!("{v}: {text}\n"));
                        v
                    }
                    (true, None) => "ARGTEXT".to_string(),
                    _ => {
                        extra.push_str(&format!("{v}: %json {}\n", json_options(schema.clone())));
                        v
                    }
                };
                let pair = match minimax {
                    true => format!("{} {value} \"</parameter>\\n\"", quote(&format!("<parameter name=\"{key}\">"))),
                    false => format!(
                        "{} {} {} {} {} {} \"\\n\"",
                        self.marker(ARG_KEY.0),
                        quote(key),
                        self.marker(ARG_KEY.1),
                        self.marker(ARG_VALUE.0),
                        value,
                        self.marker(ARG_VALUE.1)
                    ),
                };
                if required.contains(key) {
                    rule.push_str(&format!(" {pair}"));
                } else {
                    rule.push_str(&format!(" ({pair})?"));
                }
            }
        }
        match minimax {
            true => rule.push_str(&format!(" \"</invoke>\\n\" {}\n", self.marker(end))),
            false => rule.push_str(&format!(" {}\n", self.marker(CALL_END))),
        }
        format!("{rule}{extra}")
    }

    /// Gemma 4's call: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between
    /// `<|"|>` quotes, other values bare (numbers, booleans, null, `{k:v}`, `[v]`). The
    /// required arguments come first in the schema's order, then any optional ones.
    fn gemma_call_rule(&self, i: usize, f: &Value) -> String {
        let (name, params, required) = tool_parts(f);
        let q = self.marker(GEMMA_QUOTE);
        let mut extra = String::new();
        let (mut req, mut opt) = (Vec::new(), Vec::new());
        if let Some(props) = params.get("properties").and_then(Value::as_object) {
            for (j, (key, schema)) in props.iter().enumerate() {
                let v = format!("call{i}_v{j}");
                extra.push_str(&format!("{v}: {}\n", self.gemma_value(schema, &q)));
                let bare = key.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                let k = if bare { quote(key) } else { format!("{q} {} {q}", quote(key)) };
                let pair = format!("{k} \":\" {v}");
                match required.contains(key) {
                    true => req.push(pair),
                    false => opt.push(pair),
                }
            }
        }
        // Optional arguments at most once each, in order: t_k = ("," o_k)? t_k+1 after
        // a first argument; h_k = o_k t_k+1 | h_k+1 when none came before.
        let m = opt.len();
        for (k, o) in opt.iter().enumerate() {
            let next_t = if k + 1 < m { format!(" call{i}_t{}", k + 1) } else { String::new() };
            extra.push_str(&format!("call{i}_o{k}: {o}\n"));
            extra.push_str(&format!("call{i}_t{k}: (\",\" call{i}_o{k})?{next_t}\n"));
            let h = match k + 1 < m {
                true => format!("call{i}_h{k}: call{i}_o{k}{next_t} | call{i}_h{}\n", k + 1),
                false => format!("call{i}_h{k}: (call{i}_o{k})?\n"),
            };
            extra.push_str(&h);
        }
        let args = match (req.is_empty(), m == 0) {
            (true, true) => String::new(),
            (false, true) => req.join(" \",\" "),
            (false, false) => format!("{} call{i}_t0", req.join(" \",\" ")),
            (true, false) => format!("call{i}_h0"),
        };
        format!(
            "call{i}: {} \"call:\" {} \"{{\" {args} \"}}\" {}\n{extra}",
            self.marker(self.syntax.call().0),
            quote(name),
            self.marker(self.syntax.call().1)
        )
    }

    /// A Gemma value of `schema` (its type; anything else is any Gemma value).
    fn gemma_value(&self, schema: &Value, q: &str) -> String {
        match schema.get("type").and_then(Value::as_str) {
            Some("string") => format!("{q} {} {q}", string_text(schema).unwrap_or_else(|| "/[^<]*/".into())),
            // At most as many digits as `maximum` has (18 without one: an i64), a bound on
            // what a model may write; the exact range is the caller's to check.
            Some("integer") => {
                let max = schema.get("maximum").and_then(Value::as_i64);
                let digits = max.map_or(18, |m| m.unsigned_abs().max(1).ilog10() as usize + 1);
                let sign =
                    if schema.get("minimum").and_then(Value::as_i64).is_some_and(|m| m >= 0) { "" } else { "-?" };
                format!("/{sign}(0|[1-9][0-9]{{0,{}}})/", digits - 1)
            }
            Some("number") => "GNUM".into(),
            Some("boolean") => "\"true\" | \"false\"".into(),
            Some("null") => "\"null\"".into(),
            Some("array") => "garray".into(),
            Some("object") => "gobject".into(),
            _ => "gvalue".into(),
        }
    }

    /// Any Gemma value (nested arguments without a narrower schema).
    fn gemma_value_rules(&self) -> String {
        let q = self.marker(GEMMA_QUOTE);
        format!(
            "gvalue: gstring | GNUM | \"true\" | \"false\" | \"null\" | gobject | garray\n\
             gstring: {q} /[^<]*/ {q}\n\
             gobject: \"{{\" (gkey \":\" gvalue (\",\" gkey \":\" gvalue)*)? \"}}\"\n\
             gkey: /[A-Za-z_][A-Za-z0-9_]*/ | gstring\n\
             garray: \"[\" (gvalue (\",\" gvalue)*)? \"]\"\n\
             GNUM: /-?(0|[1-9][0-9]{{0,17}})(\\.[0-9]{{1,17}})?([eE][+-]?[0-9]{{1,3}})?/\n"
        )
    }

    /// A constraint for `format`, or a 400 naming `param` when it does not compile.
    pub fn constraint(&self, format: &Format, think: bool, param: &str) -> ApiResult<Box<dyn TokenConstraint>> {
        let bad = |e: anyhow::Error| ApiError::bad_request(format!("{param}: {e:#}")).with_param(param);
        let lark = self.lark(format, think).map_err(bad)?;
        let parser = self.factory.create_parser(TopLevelGrammar::from_lark(lark)).map_err(bad)?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(bad(anyhow!(e)));
        }
        Ok(Box::new(Guided { m, eos: self.eos.clone() }))
    }
}

/// A tool's name, parameter schema and required argument names.
fn tool_parts(f: &Value) -> (&str, Value, Vec<String>) {
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    let params = f.get("parameters").cloned().unwrap_or(json!({}));
    let required = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).map(String::from).collect())
        .unwrap_or_default();
    (name, params, required)
}

/// The text of a raw string value under a string `schema`: one of its `enum`, its
/// `pattern`, or text without `<` within `minLength` / `maxLength`; `None` when the
/// schema bounds nothing (any text without `<`).
fn string_text(schema: &Value) -> Option<String> {
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        let alts: Vec<String> = options.iter().filter_map(Value::as_str).map(quote).collect();
        return Some(format!("({})", alts.join(" | ")));
    }
    if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
        return Some(format!("/{}/", p.trim_start_matches('^').trim_end_matches('$').replace('/', "\\/")));
    }
    let lo = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let hi = schema.get("maxLength").and_then(Value::as_u64);
    if lo == 0 && hi.is_none() {
        return None;
    }
    Some(format!("/[^<]{{{lo},{}}}/", hi.map_or(String::new(), |h| h.to_string())))
}

/// A tool's arguments as JSON: only the keys its schema declares, unless the schema
/// says otherwise (as GLM's and MiniMax's call rules write only declared keys).
fn call_arguments(mut params: Value) -> Value {
    if let Some(o) = params.as_object_mut().filter(|o| o.contains_key("properties")) {
        o.entry("additionalProperties").or_insert(Value::Bool(false));
    }
    json_options(params)
}

/// JSON as `json.dumps` writes it (`, ` and `: `, no other whitespace): a model cannot
/// wander off in whitespace. A schema's own `x-guidance` options win.
fn json_options(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert(json!({
            "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "
        }));
    }
    schema
}

struct Guided {
    m: Matcher,
    eos: Vec<u32>,
}

impl TokenConstraint for Guided {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<()> {
        let v = self.m.compute_mask()?;
        let words = mask.words_mut();
        let src = v.as_slice();
        let n = words.len().min(src.len());
        words[..n].copy_from_slice(&src[..n]);
        // The grammar's end is the trie's EOS; every EOS id of the model ends it.
        if v.is_allowed(self.eos[0]) {
            for &e in &self.eos {
                mask.allow(e);
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        self.m.consume_token(token)
    }

    fn is_done(&self) -> bool {
        self.m.is_stopped()
    }

    fn forced(&mut self) -> Result<Vec<u32>> {
        Ok(self.m.consume_ff_tokens())
    }
}
