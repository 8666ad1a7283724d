//! Generated text split into what each API reports separately: reasoning (GLM's
//! `<think>...</think>`, Gemma 4's `<|channel>thought ... <channel|>`), answer text, and tool calls ([`crate::tools`]), whole or as a
//! stream of deltas.

use crate::harmony::HarmonyStream;
use crate::syntax::Syntax;
use crate::tools::{partial_suffix, Piece, ToolCall, ToolStream};
use serde_json::Value;

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing seen yet: the answer may open with `<think>`.
    Start,
    Thinking,
    Answer,
}

/// Splits reasoning from the answer. The reasoning either follows a `<think>` at the
/// start of the output, or starts right away when the prompt ended with `<think>`.
pub struct ThinkSplit {
    /// The reasoning block's (start, end) markers.
    markers: (&'static str, &'static str),
    mode: Mode,
    buf: String,
    /// Whitespace right after a tag is layout, not text.
    trim: bool,
}

impl ThinkSplit {
    pub fn new(inside: bool) -> Self {
        Self::with_syntax(Syntax::Glm, inside)
    }

    pub fn with_syntax(syntax: Syntax, inside: bool) -> Self {
        let mode = if inside { Mode::Thinking } else { Mode::Start };
        Self { markers: syntax.think(), mode, buf: String::new(), trim: inside }
    }

    fn take_trimmed(&mut self, upto: usize) -> String {
        let mut s: String = self.buf.drain(..upto).collect();
        if self.trim {
            let t = s.trim_start();
            if t.is_empty() {
                return String::new();
            }
            s = t.to_string();
            self.trim = false;
        }
        s
    }

    /// The (reasoning, answer) text that `delta` completes.
    pub fn push(&mut self, delta: &str) -> (String, String) {
        self.buf.push_str(delta);
        let (start, end) = self.markers;
        let (mut reasoning, mut answer) = (String::new(), String::new());
        loop {
            match self.mode {
                Mode::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(start) {
                        self.buf = rest.to_string();
                        self.mode = Mode::Thinking;
                        self.trim = true;
                    } else if start.starts_with(t) {
                        return (reasoning, answer); // could still become `<think>`
                    } else {
                        self.mode = Mode::Answer;
                    }
                }
                Mode::Thinking => {
                    if let Some(i) = self.buf.find(end) {
                        reasoning.push_str(&self.take_trimmed(i));
                        self.buf.drain(..end.len());
                        self.mode = Mode::Answer;
                        self.trim = true;
                        continue;
                    }
                    let ready = self.buf.len() - partial_suffix(&self.buf, end);
                    reasoning.push_str(&self.take_trimmed(ready));
                    return (reasoning, answer);
                }
                Mode::Answer => {
                    let n = self.buf.len();
                    answer.push_str(&self.take_trimmed(n));
                    return (reasoning, answer);
                }
            }
        }
    }

    /// What is left at the end: unfinished reasoning stays reasoning.
    pub fn finish(&mut self) -> (String, String) {
        let n = self.buf.len();
        match self.mode {
            Mode::Thinking => (self.take_trimmed(n), String::new()),
            _ => (String::new(), self.take_trimmed(n)),
        }
    }
}

/// Reasoning split (optional), then tool calls (optional) on the answer text; or, for
/// harmony (gpt-oss), its channels parsed as a whole.
pub struct OutputParser {
    think: Option<ThinkSplit>,
    tools: Option<ToolStream>,
    harmony: Option<HarmonyStream>,
}

#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ToolCall>,
}

impl OutputParser {
    /// `think`: split reasoning, starting inside it when `Some(true)`; `tools`: the
    /// request's tool schemas, to parse tool calls.
    pub fn new(think: Option<bool>, tools: Option<Value>) -> Self {
        Self::with_syntax(Syntax::Glm, think, tools)
    }

    /// [`OutputParser::new`] for a model whose output follows `syntax`.
    pub fn with_syntax(syntax: Syntax, think: Option<bool>, tools: Option<Value>) -> Self {
        if syntax == Syntax::Harmony {
            // Harmony's channel markup never reaches the answer, reasoning asked for or not.
            let harmony = Some(HarmonyStream::new(tools, think == Some(true)));
            return Self { think: None, tools: None, harmony };
        }
        Self {
            think: think.map(|inside| ThinkSplit::with_syntax(syntax, inside)),
            tools: tools.map(|t| ToolStream::with_syntax(syntax, Some(t))),
            harmony: None,
        }
    }

    /// Whether the output is parsed at all (else it is plain text).
    pub fn active(&self) -> bool {
        self.think.is_some() || self.tools.is_some() || self.harmony.is_some()
    }

    pub fn calls(&self) -> usize {
        match &self.harmony {
            Some(h) => h.calls(),
            None => self.tools.as_ref().map_or(0, ToolStream::calls),
        }
    }

    fn answer(&mut self, out: &mut Vec<Piece>, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.tools.as_mut() {
            Some(ts) => out.extend(ts.push(text)),
            None => out.push(Piece::Text(text.to_string())),
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        if let Some(h) = self.harmony.as_mut() {
            return h.push(delta);
        }
        let (reasoning, answer) = match self.think.as_mut() {
            Some(t) => t.push(delta),
            None => (String::new(), delta.to_string()),
        };
        let mut out = Vec::new();
        if !reasoning.is_empty() {
            out.push(Piece::Reasoning(reasoning));
        }
        self.answer(&mut out, &answer);
        out
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        if let Some(h) = self.harmony.as_mut() {
            return h.finish();
        }
        let (reasoning, answer) = self.think.as_mut().map(ThinkSplit::finish).unwrap_or_default();
        let mut out = Vec::new();
        if !reasoning.is_empty() {
            out.push(Piece::Reasoning(reasoning));
        }
        self.answer(&mut out, &answer);
        if let Some(ts) = self.tools.as_mut() {
            out.extend(ts.finish());
        }
        out
    }

    /// Parses a whole text.
    pub fn parse(mut self, text: &str) -> Parsed {
        let mut pieces = self.push(text);
        pieces.extend(self.finish());
        let mut p = Parsed::default();
        for piece in pieces {
            match piece {
                Piece::Reasoning(r) => p.reasoning.push_str(&r),
                Piece::Text(t) => p.content.push_str(&t),
                Piece::Call(c) => p.calls.push(c),
            }
        }
        p.reasoning = p.reasoning.trim_end().to_string();
        if !p.calls.is_empty() {
            p.content = p.content.trim().to_string();
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(inside: bool, text: &str, step: usize) -> (String, String) {
        let mut s = ThinkSplit::new(inside);
        let (mut r, mut a) = (String::new(), String::new());
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step) {
            let (x, y) = s.push(&chunk.iter().collect::<String>());
            r += &x;
            a += &y;
        }
        let (x, y) = s.finish();
        (r + &x, a + &y)
    }

    #[test]
    fn splits_reasoning_from_the_answer_at_any_chunking() {
        for step in [1, 2, 3, 7, 100] {
            assert_eq!(
                split_all(false, "<think>\nLet me think.</think>\nThe answer.", step),
                ("Let me think.".into(), "The answer.".into()),
                "step {step}"
            );
            // The prompt opened the reasoning.
            assert_eq!(split_all(true, "Hmm.</think>Yes.", step), ("Hmm.".into(), "Yes.".into()));
            // No reasoning at all.
            assert_eq!(
                split_all(false, "Plain <thinking> text", step),
                (String::new(), "Plain <thinking> text".into())
            );
            assert_eq!(split_all(false, " <thin", step), (String::new(), " <thin".into()));
            // Cut off while thinking.
            assert_eq!(split_all(false, "<think>still going", step), ("still going".into(), String::new()));
            // Thinking turned off: an empty block.
            assert_eq!(split_all(false, "<think></think>Done.", step), (String::new(), "Done.".into()));
        }
    }

    #[test]
    fn answer_streams_as_it_comes() {
        let mut s = ThinkSplit::new(false);
        assert_eq!(s.push("<thi"), (String::new(), String::new()));
        assert_eq!(s.push("nk>a"), ("a".into(), String::new()));
        assert_eq!(s.push("b</th"), ("b".into(), String::new()));
        assert_eq!(s.push("ink> c"), (String::new(), "c".into()));
        assert_eq!(s.push(" d"), (String::new(), " d".into()));
    }

    #[test]
    fn reasoning_then_tool_calls() {
        let text = "<think>Need the weather.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>";
        let p = OutputParser::new(Some(false), Some(serde_json::json!([]))).parse(text);
        assert_eq!(p.reasoning, "Need the weather.");
        assert_eq!(p.content, "Checking.");
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].arguments["city"], "Paris");
        let plain = OutputParser::new(None, None);
        assert!(!plain.active());
        assert_eq!(plain.parse(text).content, text);
    }
}
