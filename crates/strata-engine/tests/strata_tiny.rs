//! The shipped default model (`models/strata-tiny`, trained by `training/train_tiny.py`)
//! against transformers' logits (`fixtures/strata-tiny/reference.safetensors`).

use std::path::Path;
use strata_engine::LoadedModel;
use strata_storage::{ElementType, SafetensorsFile};

#[test]
fn strata_tiny_matches_transformers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = LoadedModel::open(&root.join("models/strata-tiny")).unwrap();
    let reference = SafetensorsFile::open(&root.join("fixtures/strata-tiny/reference.safetensors")).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("fixtures/strata-tiny/reference.json")).unwrap())
            .unwrap();
    let prompts = meta["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 3);
    for p in prompts {
        let i = p["index"].as_u64().unwrap();
        let ids_t = &reference.tensors()[&format!("prompt_ids_{i}")];
        assert_eq!(ids_t.dtype, ElementType::I64);
        let ids: Vec<u32> = reference
            .bytes(ids_t)
            .unwrap()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        // The tokenizer reproduces the ids from the recorded text.
        let text = p["text"].as_str().unwrap();
        assert_eq!(m.tokenizer().unwrap().encode(text, true).unwrap(), ids, "prompt {i}: tokenization");
        let want_t = &reference.tensors()[&format!("prompt_logits_{i}")];
        let want: Vec<f32> = reference
            .bytes(want_t)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let got: Vec<f32> = m.generator().unwrap().logits(&ids, true).unwrap().concat();
        assert_eq!(got.len(), want.len());
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "prompt {i} ({}): logits differ by {worst}", p["category"]);
        eprintln!("strata-tiny prompt {i} ({} tokens): worst diff {worst:.2e}", ids.len());
    }
}

/// The MTP (draft) layer against training/train_tiny.py's MTP module: row j combines the
/// target's hidden state at position j with token j+1 and predicts token j+2; logits
/// within 1e-4 at every row.
#[test]
fn strata_tiny_mtp_layer_matches_its_training_code() {
    use strata_models::{Batch, Logits, SessionOptions};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = LoadedModel::open(&root.join("models/strata-tiny")).unwrap();
    let reference = SafetensorsFile::open(&root.join("fixtures/strata-tiny/reference.safetensors")).unwrap();
    let floats = |name: &str| -> Vec<f32> {
        let t = &reference.tensors()[name];
        reference.bytes(t).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let (vocab, h) = (m.model.info().vocab_size, m.model.info().hidden_size);
    for i in 0..3 {
        let ids_t = &reference.tensors()[&format!("prompt_ids_{i}")];
        let ids: Vec<u32> = reference
            .bytes(ids_t)
            .unwrap()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        let mut s = m.model.new_session(SessionOptions::single(256, 256)).unwrap();
        assert!(s.has_draft(), "strata-tiny ships an MTP layer");
        let seq = s.add_sequence().unwrap();
        let mut batch = Batch::new();
        batch.push(seq, &ids, Logits::HiddenAll);
        s.forward(&batch).unwrap();
        let hidden = s.hidden()[..(ids.len() - 1) * h].to_vec();
        batch.clear();
        batch.push(seq, &ids[1..], Logits::All);
        s.draft_forward(&batch, &hidden).unwrap();
        let got = s.logits();
        let want = floats(&format!("prompt_mtp_logits_{i}"));
        assert_eq!(got.len(), want.len(), "prompt {i}: {} rows", got.len() / vocab);
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "prompt {i}: MTP logits differ by {worst}");
        eprintln!("strata-tiny MTP prompt {i}: worst diff {worst:.2e}");
    }
}

/// Greedy decoding with speculation (the MTP layer drafting 1-4 tokens a round, or as
/// many as the adaptive policy chooses, plain rounds and draft-cache catch-up included)
/// gives exactly the tokens of decoding one token a forward; drafts are mostly accepted.
#[test]
fn speculative_greedy_equals_plain_greedy() {
    use strata_engine::{DraftPolicy, GenerateRequest, SamplingParams};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = LoadedModel::open(&root.join("models/strata-tiny")).unwrap();
    let tok = m.tokenizer().unwrap();
    for text in ["In the beginning God created the heaven", "The quick brown fox", "def main():\n    x ="] {
        let prompt = tok.encode(text, true).unwrap();
        let run = |draft, draft_policy| {
            let mut g = m.generator().unwrap();
            let req = GenerateRequest {
                draft_tokens: draft,
                draft_policy,
                ..GenerateRequest::new(prompt.clone(), 80, SamplingParams::default())
            };
            g.generate(None, &req, &mut |_| true).unwrap()
        };
        let plain = run(0, DraftPolicy::Fixed);
        assert!(plain.stats.mtp.is_none());
        for draft in [1, 3, 4] {
            let spec = run(draft, DraftPolicy::Fixed);
            assert_eq!(spec.tokens, plain.tokens, "{text:?}: draft {draft}");
            let mtp = spec.stats.mtp.expect("speculation ran");
            assert!(mtp.acceptance_rate > 0.3, "{text:?}: acceptance {}", mtp.acceptance_rate);
            assert_eq!(mtp.tokens as usize, spec.tokens.len());
            // (Only a last round with one token left to emit has no room for drafts.)
            assert!(mtp.plain_rounds <= 1, "{mtp:?}");
        }
        // Auto is adaptive under greedy decoding: at least the one measuring plain round.
        let spec = run(3, DraftPolicy::Auto);
        assert_eq!(spec.tokens, plain.tokens, "{text:?}: adaptive");
        let mtp = spec.stats.mtp.expect("speculation ran");
        assert_eq!((mtp.policy, mtp.tokens as usize), ("adaptive", spec.tokens.len()));
        assert!(mtp.plain_rounds >= 1 && mtp.drafted >= 6, "{mtp:?}");
    }
}
