//! Fuzz entry points: one function per target, each taking arbitrary bytes and calling
//! the real parser. Bad input must come back as an `Err` (or be handled); a panic,
//! abort, hang or unbounded allocation is a finding.
//!
//! The AFL harnesses in `fuzz/` (a separate workspace: CI never builds AFL) call these,
//! and `tests/corpus.rs` replays every file of `fuzz/corpus/<target>/` and
//! `fuzz/regressions/<target>/` through them in the normal test suite. Each target is a
//! few lines so that it is easy to follow when an API moves.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A fuzz entry point.
pub type Entry = fn(&[u8]);

/// Every target: (name, entry point). The name is the corpus folder.
pub const TARGETS: &[(&str, Entry)] = &[
    ("safetensors_header", safetensors_header),
    ("container_manifest", container_manifest),
    ("colibri", colibri),
    ("ledger", ledger),
    ("config", config),
    ("chat_template", chat_template),
    ("http_body", http_body),
    ("tiktoken", tiktoken),
];

/// The entry point called `name`.
pub fn target(name: &str) -> Option<Entry> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// The safetensors header parser (`SafetensorsFile::parse_header`).
pub fn safetensors_header(data: &[u8]) {
    if let Ok(tensors) = strata_storage::SafetensorsFile::parse_header(data) {
        for t in tensors.values() {
            let _ = (t.numel(), t.byte_len());
        }
    }
}

/// The expert-container manifest (`ExpertManifest::parse`), then every expert's read.
pub fn container_manifest(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(m) = strata_storage::ExpertManifest::parse(text) {
        for t in &m.tiers {
            for (i, &layer) in t.layers.iter().enumerate().take(4) {
                let _ = t.locate(layer, i);
                let _ = t.read_check(layer, i);
            }
        }
        let _ = m.total_expert_bytes();
    }
}

/// A per-process scratch directory on tmpfs when there is one.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = base.join(format!("strata-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    })
}

/// The Colibri reader: the input is `out-00000.safetensors` of a container for a small
/// GLM shape (2 sparse layers x 2 experts, hidden 8, moe_inter 4, MTP layer 3); open,
/// then compute its checksums (reads every expert).
pub fn colibri(data: &[u8]) {
    let dir = scratch().join("colibri");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::remove_file(dir.join(strata_storage::COLIBRI_SUMS_FILE));
    if std::fs::write(dir.join("out-00000.safetensors"), data).is_err() {
        return;
    }
    let dims = strata_storage::GlmDims {
        hidden: 8,
        moe_inter: 4,
        n_experts: 2,
        sparse_layers: vec![1, 2],
        mtp_layers: vec![3],
    };
    if let Ok(mut c) = strata_storage::ColibriContainer::open(&dir, &dims) {
        let _ = c.ensure_checksums();
        for t in c.tiers() {
            let _ = t.locate(1, 1);
            let _ = t.uniform_kinds();
        }
    }
}

/// The usage ledger parser (`UsageLedger::from_bytes`, GLM-5-like shape in miniature),
/// then what the runtime does with it.
pub fn ledger(data: &[u8]) {
    use strata_residency::{LedgerOpen, UsageLedger, GLM_ENGINE};
    for allow_foreign in [false, true] {
        let opts = LedgerOpen { explicit: false, allow_foreign };
        if let Ok((mut l, _)) = UsageLedger::from_bytes(GLM_ENGINE, "fuzz", 4, 8, &[1, 2, 4], opts, data) {
            l.record(2, &[1, 7, 7]);
            let _ = (l.ranked_counts(), l.to_text(), l.snapshot(), l.lfru_score((2, 7)));
        }
    }
}

/// `config.json` parsing through the family registry (every family's parser, by
/// `model_type`; RoPE variants included), then what inspect and the plan ask of it.
pub fn config(data: &[u8]) {
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) {
        if let Ok(arch) = strata_models::registry::parse_config(&json) {
            let _ = (arch.describe(), arch.moe(), arch.kv_bytes_per_token());
        }
    }
}

/// A `tiktoken.model` file (Kimi K2's tokenizer) turned into a BPE tokenizer, which then
/// encodes a text with every kind of character.
pub fn tiktoken(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("tiktoken.model");
    if let Ok(json) = strata_engine::tiktoken::tokenizer_json_from(text, &serde_json::Value::Null, path) {
        if let Ok(tok) = strata_engine::tokenizer::TextTokenizer::from_json(&json) {
            let _ = tok.encode("Hi 你好 it's 123\n  x", false);
        }
    }
}

/// Chat-template rendering: the input is a JSON `{"messages": [...], "tools": [...]}`
/// rendered through the shipped model's template (`models/strata-tiny`, else a GLM-like
/// fallback).
pub fn chat_template(data: &[u8]) {
    static TEMPLATE: OnceLock<strata_engine::ChatTemplate> = OnceLock::new();
    let template = TEMPLATE.get_or_init(|| {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
        strata_engine::ChatTemplate::from_model_dir(&shipped).ok().flatten().unwrap_or_else(|| {
            let source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\
                          {% if add_generation_prompt %}<|assistant|>{% endif %}";
            strata_engine::ChatTemplate::new(source, String::new(), String::new()).expect("fallback template")
        })
    });
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let Some(msgs) = v.get("messages").and_then(|m| m.as_array()) else { return };
    let messages: Vec<strata_engine::Message> =
        msgs.iter().filter_map(|m| serde_json::from_value(m.clone()).ok()).collect();
    let _ = template.render(&messages, true, v.get("tools"));
}

/// HTTP request bodies: the server's request parser (`params::parse_request`: known
/// fields, typed) into every request type, then the conversions and checks that need
/// no model (messages, tools, sampling ranges, logit bias).
pub fn http_body(data: &[u8]) {
    use strata_server::common::Body;
    use strata_server::params::{parse_request, Api};
    use strata_server::{anthropic, openai, responses};
    let body: Body = Ok(axum::body::Bytes::copy_from_slice(data));
    const VOCAB: usize = 512;
    if let Ok(r) = parse_request::<openai::ChatRequest>(&body, Api::Chat) {
        let _ = openai::tool_schemas(r.tools.clone(), r.tool_choice.as_ref());
        let _ = r.sampling.validate(Api::Chat, VOCAB).and_then(|_| r.sampling.bias(VOCAB));
        let _ = openai::chat_messages(r.messages);
    }
    if let Ok(r) = parse_request::<openai::CompletionRequest>(&body, Api::Completions) {
        let _ = r.sampling.validate(Api::Completions, VOCAB).and_then(|_| r.sampling.bias(VOCAB));
    }
    if let Ok(r) = parse_request::<anthropic::MessagesRequest>(&body, Api::Messages) {
        let _ = anthropic::template_messages(r.system.as_ref(), &r.messages);
        let _ = r.sampling.validate(Api::Messages, VOCAB).and_then(|_| r.sampling.bias(VOCAB));
    }
    if let Ok(r) = parse_request::<responses::ResponsesRequest>(&body, Api::Responses) {
        let _ = responses::input_messages(r.instructions.as_deref(), &r.input);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = strata_server::tools::parse_text(text, None);
    }
}
