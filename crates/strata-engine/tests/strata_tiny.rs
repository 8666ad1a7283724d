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
