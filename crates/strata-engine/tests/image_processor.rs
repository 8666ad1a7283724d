//! strata's Gemma 4 image processor against transformers' (`fixtures/gemma4/processor`,
//! made by `scripts/make_gemma4_vision_fixtures.py`): images of several sizes, aspect
//! ratios and modes (RGB, RGBA, grey), down- and upscaled, at two soft-token budgets.
//! Patch counts, positions, soft-token counts and every pixel (the resized 8-bit values)
//! are equal.

use std::path::PathBuf;
use strata_engine::image::{ImageProcessor, Rgb8};
use strata_storage::{ElementType, SafetensorsFile};

#[test]
fn processor_matches_transformers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma4/processor");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let file = SafetensorsFile::open(&dir.join("reference.safetensors")).unwrap();
    let cases = meta["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for c in cases {
        let name = c["image"].as_str().unwrap().trim_end_matches(".png");
        let budget = c["max_soft_tokens"].as_u64().unwrap() as usize;
        let img = Rgb8::open(&dir.join(c["image"].as_str().unwrap())).unwrap();
        let p = ImageProcessor::new(16, 3, budget).unwrap();
        let got = p.process(&img).unwrap();
        let key = format!("{name}.{budget}");
        let t = &file.tensors()[&format!("{key}.patches")];
        assert_eq!(t.dtype, ElementType::U8);
        let want: Vec<u8> = file.bytes(t).unwrap().to_vec();
        let pos_t = &file.tensors()[&format!("{key}.positions")];
        let pos: Vec<u32> = file
            .bytes(pos_t)
            .unwrap()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect();
        let patches = c["patches"].as_u64().unwrap() as usize;
        assert_eq!(got.positions.len(), patches, "{key}: patch count");
        assert_eq!(p.soft_tokens(patches), c["soft_tokens"].as_u64().unwrap() as usize, "{key}: soft tokens");
        let got_pos: Vec<u32> = got.positions.iter().flat_map(|&(x, y)| [x, y]).collect();
        assert_eq!(got_pos, pos, "{key}: positions");
        assert_eq!(got.pixels.len(), want.len(), "{key}: pixels");
        let diffs: Vec<i32> =
            got.pixels.iter().zip(&want).map(|(g, &w)| ((g * 255.0).round() as i32 - w as i32).abs()).collect();
        let max = *diffs.iter().max().unwrap();
        let off = diffs.iter().filter(|&&d| d > 0).count() as f64 / diffs.len() as f64;
        eprintln!(
            "{key}: {}x{} -> {patches} patches, max diff {max}/255, {:.2}% of values off",
            c["size"][1],
            c["size"][0],
            100.0 * off
        );
        assert!(max == 0, "{key}: pixels differ by up to {max}/255 ({:.2}% of values)", 100.0 * off);
    }
}
