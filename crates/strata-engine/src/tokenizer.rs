//! `tokenizer.json` (or a tiktoken file, [`crate::tiktoken`]) through the `tokenizers`
//! crate, and streaming detokenization.

use anyhow::{anyhow, Result};
use std::path::Path;
use tokenizers::Tokenizer;

pub struct TextTokenizer {
    inner: Tokenizer,
}

impl TextTokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            anyhow::bail!("{}: tokenizer not found", path.display());
        }
        let inner = Tokenizer::from_file(path).map_err(|e| anyhow!("{}: invalid tokenizer: {e}", path.display()))?;
        Ok(Self { inner })
    }

    /// The tokenizer of a model directory: `tokenizer.json`, else `tiktoken.model`;
    /// `None` when it has neither.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let json = dir.join("tokenizer.json");
        if json.exists() {
            return Self::from_file(&json).map(Some);
        }
        if !dir.join(crate::tiktoken::TIKTOKEN_FILE).exists() {
            return Ok(None);
        }
        let doc = crate::tiktoken::tokenizer_json(dir)?;
        Self::from_json(&doc)
            .map(Some)
            .map_err(|e| anyhow!("{}: {e:#}", dir.join(crate::tiktoken::TIKTOKEN_FILE).display()))
    }

    /// A tokenizer from the text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let inner = json.parse::<Tokenizer>().map_err(|e| anyhow!("cannot build a tokenizer: {e}"))?;
        Ok(Self { inner })
    }

    /// The tokenizer as `tokenizer.json` would hold it (for grammar engines that read one).
    pub fn to_json(&self) -> Result<serde_json::Value> {
        let text = self.inner.to_string(false).map_err(|e| anyhow!("tokenizer: {e}"))?;
        Ok(serde_json::from_str(&text)?)
    }

    /// Encodes as the tokenizer does, adding only what its post-processor adds when
    /// `add_special_tokens` (plain prompts); chat prompts pass `false`, as HF does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| anyhow!("tokenizer: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| anyhow!("tokenizer: {e}"))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The longest token's text in bytes (its vocabulary spelling, or its decoded text
    /// if longer): a text of `n` bytes is at least `n / max_token_bytes()` tokens for
    /// tokenizers without shrinking normalizers. At least 1.
    pub fn max_token_bytes(&self) -> usize {
        let n = self.vocab_size() as u32;
        (0..n)
            .map(|id| {
                let raw = self.inner.id_to_token(id).map_or(0, |t| t.len());
                let decoded = self.inner.decode(&[id], false).map_or(0, |t| t.len());
                raw.max(decoded)
            })
            .max()
            .unwrap_or(1)
            .max(1)
    }
}

/// Turns a growing list of generated ids into text deltas. Holds back an incomplete
/// UTF-8 sequence (decoded as U+FFFD) until the bytes that finish it arrive.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    emitted: String,
}

impl StreamDecoder {
    /// Adds a token; returns the full text so far and the new, printable part of it.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32, skip_special_tokens: bool) -> Result<(String, String)> {
        self.ids.push(id);
        let text = tok.decode(&self.ids, skip_special_tokens)?;
        if text.ends_with('\u{fffd}') || !text.starts_with(&self.emitted) {
            return Ok((text, String::new()));
        }
        let delta = text[self.emitted.len()..].to_string();
        self.emitted.push_str(&delta);
        Ok((text, delta))
    }

    /// Records that only `text[..len]` counts as emitted (used after a stop string cut).
    pub fn emitted(&self) -> &str {
        &self.emitted
    }
}
