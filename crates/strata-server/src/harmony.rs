//! gpt-oss's harmony output: a run of messages, each a header then a body,
//!
//! ```text
//! <|channel|>analysis<|message|>REASONING<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
//! <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
//! ```
//!
//! (the first header's `<|start|>assistant` is the prompt's). The `analysis` channel is
//! reasoning; a message addressed `to=functions.NAME` (on `commentary`, or with the
//! recipient before the channel) is a tool call whose body is its JSON arguments; any
//! other message (`final`, a `commentary` preamble) is answer text. A body ends at
//! `<|end|>`, `<|call|>` or `<|return|>` (the last two stop generation, so the text
//! usually just ends). Text that does not open with a header (a grammar that forced plain
//! JSON, say) is answer text.

use crate::syntax::json_arguments;
use crate::tools::{partial_suffix, Piece, ToolCall};
use serde_json::Value;

pub const START: &str = "<|start|>";
pub const CHANNEL: &str = "<|channel|>";
pub const MESSAGE: &str = "<|message|>";
pub const END: &str = "<|end|>";
pub const CALL: &str = "<|call|>";
pub const RETURN: &str = "<|return|>";
pub const CONSTRAIN: &str = "<|constrain|>";
/// A body's possible ends.
const ENDS: [&str; 4] = [END, CALL, RETURN, START];

#[derive(Clone, Debug, PartialEq)]
enum Body {
    Reasoning,
    Text,
    /// A call to this function: its arguments are gathered whole.
    Call(String),
}

enum State {
    /// Reading a header up to `<|message|>`.
    Header,
    Body(Body),
}

/// Splits a stream of harmony text into [`Piece`]s.
pub struct HarmonyStream {
    /// The request's tools: calls are parsed only where some were sent (else a call's
    /// message stays text, as other syntaxes leave their markup).
    tools: Option<Value>,
    state: State,
    buf: String,
    calls: usize,
}

impl HarmonyStream {
    /// `inside`: the prompt opened an analysis message, so the text starts as reasoning.
    pub fn new(tools: Option<Value>, inside: bool) -> Self {
        let state = if inside { State::Body(Body::Reasoning) } else { State::Header };
        Self { tools, state, buf: String::new(), calls: 0 }
    }

    pub fn calls(&self) -> usize {
        self.calls
    }

    /// What the header `h` (the text before `<|message|>`) makes of its body.
    fn body_of(&self, h: &str) -> Body {
        let recipient = h
            .split(|c: char| c.is_whitespace() || c == '<' || c == '>')
            .find_map(|w| w.strip_prefix("to="))
            .map(|r| r.split(CHANNEL).next().unwrap_or(r).to_string());
        let channel = h.split(CHANNEL).nth(1).and_then(|c| c.split_whitespace().next()).unwrap_or("");
        match recipient {
            Some(r) if self.tools.is_some() => Body::Call(r.strip_prefix("functions.").unwrap_or(&r).to_string()),
            _ if channel.starts_with("analysis") => Body::Reasoning,
            _ => Body::Text,
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.buf.push_str(delta);
        let mut out = Vec::new();
        loop {
            match &self.state {
                State::Header => {
                    let t = self.buf.trim_start();
                    let opens = [START, CHANNEL, "to="].iter().any(|m| t.starts_with(m) || m.starts_with(t));
                    if !opens {
                        // No header: plain answer text.
                        self.state = State::Body(Body::Text);
                        continue;
                    }
                    let Some(i) = self.buf.find(MESSAGE) else { return out };
                    let body = self.body_of(&self.buf[..i]);
                    self.buf.drain(..i + MESSAGE.len());
                    self.state = State::Body(body);
                }
                State::Body(body) => {
                    let end = ENDS.iter().filter_map(|m| self.buf.find(m).map(|i| (i, *m))).min();
                    match end {
                        Some((i, marker)) => {
                            let text: String = self.buf.drain(..i).collect();
                            // `<|start|>` opens the next header; the other ends are dropped.
                            if marker != START {
                                self.buf.drain(..marker.len());
                            }
                            self.emit(&body.clone(), text, &mut out);
                            self.state = State::Header;
                        }
                        None => {
                            if matches!(body, Body::Call(_)) {
                                return out; // arguments are gathered whole
                            }
                            let hold = ENDS.iter().map(|m| partial_suffix(&self.buf, m)).max().unwrap_or(0);
                            let text: String = self.buf.drain(..self.buf.len() - hold).collect();
                            self.emit(&body.clone(), text, &mut out);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// A body's text: reasoning and answer text stream; a call's arguments come whole (its
    /// body ended), and are answer text where they are not JSON arguments.
    fn emit(&mut self, body: &Body, text: String, out: &mut Vec<Piece>) {
        match body {
            Body::Call(name) => match json_arguments(&text) {
                Some(arguments) => {
                    self.calls += 1;
                    out.push(Piece::Call(ToolCall { name: name.clone(), arguments }));
                }
                None => push_text(out, Piece::Text(text)),
            },
            Body::Reasoning => push_text(out, Piece::Reasoning(text)),
            Body::Text => push_text(out, Piece::Text(text)),
        }
    }

    /// What is left at the end: an unfinished body as its kind; an unfinished header is
    /// dropped (it carries no text).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let State::Body(body) = std::mem::replace(&mut self.state, State::Header) {
            let text = std::mem::take(&mut self.buf);
            self.emit(&body, text, &mut out);
        }
        self.buf.clear();
        out
    }
}

fn push_text(out: &mut Vec<Piece>, p: Piece) {
    match &p {
        Piece::Text(t) | Piece::Reasoning(t) if t.is_empty() => {}
        _ => out.push(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::OutputParser;
    use crate::syntax::Syntax;
    use serde_json::json;

    fn run(text: &str, step: usize, tools: Option<Value>) -> (String, String, Vec<ToolCall>) {
        let mut p = OutputParser::with_syntax(Syntax::Harmony, Some(false), tools);
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        for chunk in chars.chunks(step) {
            pieces.extend(p.push(&chunk.iter().collect::<String>()));
        }
        pieces.extend(p.finish());
        let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
        for piece in pieces {
            match piece {
                Piece::Reasoning(x) => r += &x,
                Piece::Text(x) => c += &x,
                Piece::Call(x) => calls.push(x),
            }
        }
        (r, c, calls)
    }

    #[test]
    fn reasoning_then_the_final_answer_at_any_chunking() {
        let text = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.";
        for step in [1, 2, 3, 5, 8, 1000] {
            assert_eq!(run(text, step, None), ("User asks 2+2. Easy.".into(), "2 + 2 = 4.".into(), vec![]), "{step}");
            // The stop token, where a client's stop handling leaves it in.
            let (r, c, _) = run(&format!("{text}<|return|>"), step, None);
            assert_eq!((r.as_str(), c.as_str()), ("User asks 2+2. Easy.", "2 + 2 = 4."));
        }
    }

    #[test]
    fn calls_in_either_header_order_with_a_preamble() {
        let tools = Some(json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]));
        let a = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>";
        let b = "<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\":\"Paris\",\"days\":2}";
        for step in [1, 3, 7, 1000] {
            let (r, c, calls) = run(a, step, tools.clone());
            assert_eq!((r.as_str(), c.as_str(), calls.len()), ("Need weather.", "", 1), "{step}");
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(Value::Object(calls[0].arguments.clone()), json!({"city": "Paris", "days": 2}));
            let (r, c, calls) = run(b, step, tools.clone());
            assert_eq!((r.as_str(), c.as_str(), calls.len()), ("", "Checking now.", 1), "{step}");
            assert_eq!(calls[0].arguments["days"], 2);
        }
        // Without tools in the request the call stays text; arguments that are not an
        // object are text too.
        let (_, c, calls) = run(a, 4, None);
        assert!(calls.is_empty() && c.contains("Paris"), "{c}");
        let (_, c, calls) = run("<|channel|>commentary to=functions.f<|message|>[1, 2]<|call|>", 4, tools);
        assert!(calls.is_empty() && c == "[1, 2]", "{c}");
    }

    #[test]
    fn text_without_a_header_is_the_answer() {
        assert_eq!(run("{\"a\": 1}", 2, None), (String::new(), "{\"a\": 1}".into(), vec![]));
        // Cut off inside the reasoning: it stays reasoning; inside a header: nothing.
        assert_eq!(run("<|channel|>analysis<|message|>Hmm", 3, None), ("Hmm".into(), String::new(), vec![]));
        assert_eq!(run("<|channel|>fin", 3, None), (String::new(), String::new(), vec![]));
    }
}
