//! Tokenizers shipped as a tiktoken BPE file instead of `tokenizer.json` (Kimi K2's
//! `tiktoken.model`: a base64 token and its rank a line), rebuilt as the `tokenizers`
//! crate's byte-level BPE so that one code path encodes, decodes and constrains output.
//!
//! tiktoken merges, within each pre-tokenized piece, the adjacent pair whose joined bytes
//! rank lowest, and takes a piece that is itself a token whole. The equivalent BPE has every
//! token as a vocabulary entry (bytes spelled with GPT-2's byte-to-character table), one
//! merge per multi-byte token (the two parts tiktoken itself reaches when it encodes the
//! token's bytes using only lower ranks), ordered by rank, and `ignore_merges` for whole
//! pieces. Special tokens follow the ranks: `tokenizer_config.json`'s
//! `added_tokens_decoder`, and Kimi's reserved fillers up to 256 past the base vocabulary.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::path::Path;

/// The file a tiktoken tokenizer ships as.
pub const TIKTOKEN_FILE: &str = "tiktoken.model";

/// Kimi K2's pre-tokenizer (`pat_str` of its `tokenization_kimi.py`): Han runs, words
/// with their case and contractions, up to three digits, punctuation runs, newlines, spaces.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// The longest token accepted: real vocabularies stay far below it, and deriving a token's
/// merge costs the square of its length.
const MAX_TOKEN_BYTES: usize = 1024;

/// Special-token ids reserved past the base vocabulary (Kimi's `num_reserved_special_tokens`).
const RESERVED_SPECIAL: u32 = 256;

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the rest map
/// to code points from 256 up, in byte order.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        out[b as usize] = if printable {
            b as char
        } else {
            next += 1;
            char::from_u32(next - 1).expect("a valid code point")
        };
    }
    out
}

/// Parses a `tiktoken.model` (`path` names it in errors): every line `BASE64 RANK`, the
/// ranks exactly 0..n.
fn read_ranks(text: &str, path: &Path) -> Result<Vec<Vec<u8>>> {
    // Dense ranks: each is below the number of tokens (which bounds what is allocated).
    let n = text.lines().filter(|l| !l.trim().is_empty()).count();
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; n];
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: &str| anyhow!("{}: line {}: {why}", path.display(), i + 1);
        let mut it = line.split_whitespace();
        let (Some(b64), Some(rank), None) = (it.next(), it.next(), it.next()) else {
            return Err(bad("expected `BASE64 RANK`"));
        };
        let bytes = base64::decode(b64).map_err(|e| bad(&format!("bad base64: {e}")))?;
        let rank: usize = rank.parse().map_err(|_| bad(&format!("bad rank `{rank}`")))?;
        if bytes.is_empty() || bytes.len() > MAX_TOKEN_BYTES {
            return Err(bad(&format!("a token of {} bytes (1..={MAX_TOKEN_BYTES})", bytes.len())));
        }
        if rank >= n {
            return Err(bad(&format!("rank {rank} but {n} tokens (ranks must be 0..{n})")));
        }
        if by_rank[rank].replace(bytes).is_some() {
            return Err(bad(&format!("rank {rank} given twice")));
        }
    }
    // n lines, each a distinct rank below n: every rank is there.
    let ranks: Vec<Vec<u8>> = by_rank.into_iter().map(|b| b.expect("n distinct ranks below n")).collect();
    if ranks.is_empty() {
        bail!("{}: no tokens", path.display());
    }
    Ok(ranks)
}

/// The parts tiktoken reaches on `piece` merging only pairs ranked below `below`.
fn bpe_parts<'a>(rank_of: &HashMap<&[u8], u32>, piece: &'a [u8], below: u32) -> Vec<&'a [u8]> {
    let mut bounds: Vec<usize> = (0..=piece.len()).collect();
    loop {
        let best = (0..bounds.len().saturating_sub(2))
            .filter_map(|i| {
                let r = *rank_of.get(&piece[bounds[i]..bounds[i + 2]])?;
                (r < below).then_some((r, i))
            })
            .min();
        match best {
            Some((_, i)) => {
                bounds.remove(i + 1);
            }
            None => return bounds.windows(2).map(|w| &piece[w[0]..w[1]]).collect(),
        }
    }
}

/// `tokenizer.json` for the tiktoken tokenizer in `dir`.
pub fn tokenizer_json(dir: &Path) -> Result<String> {
    let path = dir.join(TIKTOKEN_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    tokenizer_json_from(&text, &read_config(dir)?, &path)
}

/// `tokenizer.json` for a `tiktoken.model`'s `text` and a `tokenizer_config.json` value
/// (`Null` where there is none); `path` names the file in errors.
pub fn tokenizer_json_from(text: &str, cfg: &Value, path: &Path) -> Result<String> {
    let ranks = read_ranks(text, path)?;
    let rank_of: HashMap<&[u8], u32> = ranks.iter().enumerate().map(|(r, b)| (b.as_slice(), r as u32)).collect();
    if rank_of.len() != ranks.len() {
        bail!("{}: a token appears under two ranks", path.display());
    }
    let chars = byte_chars();
    let spell = |b: &[u8]| b.iter().map(|&x| chars[x as usize]).collect::<String>();
    if let Some(b) = (0..=255u8).find(|b| !rank_of.contains_key(&[*b][..])) {
        bail!("{}: byte 0x{b:02x} has no rank (every byte must be a token)", path.display());
    }
    let mut vocab = Map::new();
    let mut merges = Vec::new();
    for (r, bytes) in ranks.iter().enumerate() {
        vocab.insert(spell(bytes), json!(r));
        if bytes.len() > 1 {
            match bpe_parts(&rank_of, bytes, r as u32)[..] {
                [a, b] => merges.push(json!([spell(a), spell(b)])),
                _ => bail!("{}: token of rank {r} is not a merge of two lower-ranked tokens", path.display()),
            }
        }
    }
    let base = ranks.len() as u32;
    let mut named: HashMap<u32, (String, bool)> = HashMap::new();
    if let Some(Value::Object(decoder)) = cfg.get("added_tokens_decoder") {
        for (id, t) in decoder {
            let id: u32 = id.parse().map_err(|_| anyhow!("tokenizer_config.json: added token id `{id}`"))?;
            let content = t
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("tokenizer_config.json: added token {id} has no `content`"))?;
            if id < base {
                bail!("tokenizer_config.json: added token {id} (`{content}`) collides with the BPE ranks (0..{base})");
            }
            named.insert(id, (content.to_string(), t.get("special").and_then(Value::as_bool).unwrap_or(true)));
        }
    }
    let top = named.keys().map(|id| id + 1).max().unwrap_or(0).max(base + RESERVED_SPECIAL);
    let added: Vec<Value> = (base..top)
        .map(|id| {
            let (content, special) = named.remove(&id).unwrap_or((format!("<|reserved_token_{id}|>"), true));
            json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": special})
        })
        .collect();
    let bos = cfg.get("bos_token").and_then(|b| b.as_str().or_else(|| b.get("content")?.as_str()));
    let post = match (cfg.get("add_bos_token").and_then(Value::as_bool), bos) {
        (Some(true), Some(bos)) => {
            let id = added
                .iter()
                .find(|t| t["content"] == bos)
                .map(|t| t["id"].clone())
                .ok_or_else(|| anyhow!("tokenizer_config.json: `bos_token` `{bos}` is not an added token"))?;
            json!({"type": "TemplateProcessing",
                   "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                   "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                            {"Sequence": {"id": "B", "type_id": 1}}],
                   "special_tokens": {bos: {"id": bos, "ids": [id], "tokens": [bos]}}})
        }
        _ => Value::Null,
    };
    let doc = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": KIMI_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
                  "vocab": vocab, "merges": merges},
    });
    Ok(doc.to_string())
}

fn read_config(dir: &Path) -> Result<Value> {
    let path = dir.join("tokenizer_config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display())),
        Err(_) => Ok(Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!((t[b'a' as usize], t[b' ' as usize], t[b'\n' as usize], t[0]), ('a', 'Ġ', 'Ċ', 'Ā'));
        let mut all: Vec<char> = t.to_vec();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn merges_follow_the_ranks() {
        let toks: Vec<&[u8]> = vec![b"a", b"b", b"c", b"bc", b"abc"];
        let rank_of: HashMap<&[u8], u32> = toks.iter().enumerate().map(|(r, b)| (*b, r as u32)).collect();
        assert_eq!(bpe_parts(&rank_of, b"abc", 4), vec![&b"a"[..], &b"bc"[..]]);
        assert_eq!(bpe_parts(&rank_of, b"abc", 3), vec![&b"a"[..], &b"b"[..], &b"c"[..]]);
    }

    /// Kimi K2's tokenizer files (tiktoken.model with trained ranks, the special tokens in
    /// tokenizer_config.json) encode as the `tiktoken` library does, and decode back.
    #[test]
    fn encodes_like_tiktoken() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepseek_v3/kimi-tiktoken");
        let tok = crate::tokenizer::TextTokenizer::from_model_dir(&dir).unwrap().expect("a tokenizer");
        let want: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("encodings.json")).unwrap()).unwrap();
        assert_eq!(tok.vocab_size(), want["ranks"].as_u64().unwrap() as usize + RESERVED_SPECIAL as usize);
        assert_eq!(tok.token_id("<|im_end|>"), Some(602));
        let cases = want["cases"].as_array().unwrap();
        assert!(cases.len() >= 7);
        for c in cases {
            let text = c["text"].as_str().unwrap();
            let ids: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(tok.encode(text, false).unwrap(), ids, "{text:?}");
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        // The grammar engine reads the same tokenizer as JSON.
        assert_eq!(tok.to_json().unwrap()["model"]["type"], "BPE");
    }

    #[test]
    fn bad_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(TIKTOKEN_FILE);
        let err = |text: &str| {
            std::fs::write(&p, text).unwrap();
            format!("{:#}", tokenizer_json(dir.path()).unwrap_err())
        };
        assert!(err("YQ== 0\nYg== 2\n").contains("rank 2 but 2 tokens"));
        assert!(err("YQ== 0\nYg== 16777216\n").contains("rank 16777216 but 2 tokens"));
        assert!(err("YQ== x\n").contains("bad rank"));
        assert!(err("!!! 0\n").contains("bad base64"));
        assert!(err(&format!("{} 0\n", "QUFB".repeat(400))).contains("a token of 1200 bytes"));
        assert!(err("YQ== 0\nYQ== 1\n").contains("two ranks"));
        assert!(err("YQ== 0\n").contains("byte 0x00 has no rank"));
    }
}
