//! The shipped default model (`models/strata-tiny`, trained by `training/train_tiny.py`)
//! against transformers' logits (`fixtures/strata-tiny/reference.safetensors`).

mod common;

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
        let got: Vec<f32> = m.scorer().unwrap().logits(&ids, true).unwrap().concat();
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

/// Speculative decoding with the draft (MTP) layer, greedy or sampled, fixed or
/// adaptive (plain rounds, draft-cache catch-up and going dormant included), gives exactly
/// the tokens of decoding one token a forward with the same seed: every emitted token is
/// the target's own keyed sample at its position. Greedy drafts are mostly accepted.
#[test]
fn speculative_decoding_equals_plain_decoding_greedy_and_sampled() {
    use strata_engine::{DraftPolicy, GenerateRequest, SamplingParams};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = LoadedModel::open(&root.join("models/strata-tiny")).unwrap();
    let tok = m.tokenizer().unwrap();
    let sampled =
        SamplingParams { temperature: 0.8, top_p: 0.95, repetition_penalty: 1.1, seed: 5, ..Default::default() };
    for sampling in [SamplingParams::default(), sampled] {
        for text in ["In the beginning God created the heaven", "The quick brown fox", "def main():\n    x ="] {
            let prompt = tok.encode(text, true).unwrap();
            let run = |draft, draft_policy| {
                let req = GenerateRequest {
                    draft_tokens: draft,
                    draft_policy,
                    ..GenerateRequest::new(prompt.clone(), 80, sampling.clone())
                };
                common::generate_on(&mut m.engine(Some(draft)).unwrap(), &req).unwrap()
            };
            let greedy = sampling.temperature == 0.0;
            let plain = run(0, DraftPolicy::Fixed);
            assert!(plain.stats.mtp.is_none());
            for draft in [1, 3, 4] {
                let spec = run(draft, DraftPolicy::Fixed);
                assert_eq!(spec.tokens, plain.tokens, "{text:?}: draft {draft}, {sampling:?}");
                let mtp = spec.stats.mtp.expect("speculation ran");
                assert!(!greedy || mtp.acceptance_rate > 0.3, "{text:?}: acceptance {}", mtp.acceptance_rate);
                assert!(mtp.accepted > 0, "{text:?}: {mtp:?}");
                assert_eq!(mtp.tokens as usize, spec.tokens.len());
                // (Only a last round with one token left to emit has no room for drafts.)
                assert!(mtp.plain_rounds <= 1, "{mtp:?}");
            }
            // Adaptive: measuring rounds of both kinds, then whatever pays on this machine.
            let spec = run(3, DraftPolicy::Adaptive);
            assert_eq!(spec.tokens, plain.tokens, "{text:?}: adaptive, {sampling:?}");
            let mtp = spec.stats.mtp.expect("speculation ran");
            assert_eq!(mtp.policy, "adaptive");
            assert!(mtp.plain_rounds >= 1 && mtp.drafted >= 3, "{mtp:?}");
            let counted = mtp.dormant_after_tokens.map_or(spec.tokens.len() as u64, |t| t);
            assert_eq!(mtp.tokens, counted, "{mtp:?}");
        }
    }
}
