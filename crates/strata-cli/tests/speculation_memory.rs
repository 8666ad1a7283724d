//! `strata generate` keeps what it measured about speculating in the model directory
//! (`.strata/speculation.json`) and a later run starts from it: plain from the first
//! token where plain was faster, speculating at once where drafting was; the tokens are
//! the same either way, and a damaged file is replaced.

use std::path::Path;
use std::process::Command;

fn tiny_copy() -> tempfile::TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    let dir = tempfile::tempdir().unwrap();
    for name in
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    {
        std::os::unix::fs::symlink(src.join(name), dir.path().join(name)).unwrap();
    }
    dir
}

/// Generates 96 tokens greedily; (token ids' text, the stats' `mtp` object).
fn generate(model: &Path) -> (String, serde_json::Value) {
    let stats = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", "The history of the river town"])
        .args(["--max-tokens", "96", "--temperature", "0", "--usage", "off", "--stats-json"])
        .arg(stats.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(stats.path()).unwrap()).unwrap();
    (String::from_utf8(out.stdout).unwrap(), s["mtp"].clone())
}

fn kept(model: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(model.join(".strata/speculation.json")).expect("rates kept");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rates = v["rates"].as_object().unwrap();
    assert_eq!(rates.len(), 1, "{v}");
    rates.values().next().unwrap().clone()
}

fn write_rates(model: &Path, plain: f64, speculating: f64) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join(".strata/speculation.json")).unwrap()).unwrap();
    let key = v["rates"].as_object().unwrap().keys().next().unwrap().clone();
    v["rates"][key] =
        serde_json::json!({"plain_tokens_per_s": plain, "speculating_tokens_per_s": speculating, "runs": 0});
    std::fs::write(model.join(".strata/speculation.json"), v.to_string()).unwrap();
}

#[test]
fn generate_starts_from_the_rates_an_earlier_run_kept() {
    let dir = tiny_copy();
    let m = dir.path();
    // First run: nothing kept, so it tries speculating, then not, and keeps both rates.
    let (text, mtp) = generate(m);
    assert!(mtp["rounds"].as_u64().unwrap() > 0, "the first run tried drafting: {mtp}");
    let r = kept(m);
    assert!(r["plain_tokens_per_s"].as_f64().unwrap() > 0.0 && r["speculating_tokens_per_s"].as_f64().unwrap() > 0.0);
    // Plain was faster: the next run never drafts, and says so.
    write_rates(m, 2000.0, 1000.0);
    let (plain_text, mtp) = generate(m);
    assert_eq!((mtp["rounds"].as_u64(), mtp["dormant_after_tokens"].as_u64()), (Some(0), Some(0)), "{mtp}");
    assert_eq!(plain_text, text);
    assert_eq!(kept(m)["runs"], 1, "the start is counted");
    // Drafting was faster: the next run speculates from the start (how many it drafts a
    // round is the batch's cost model's choice).
    write_rates(m, 1000.0, 2000.0);
    let (spec_text, mtp) = generate(m);
    assert!(mtp["drafted"].as_u64().unwrap() > 0, "{mtp}");
    assert!(mtp["dormant_after_tokens"].as_u64().is_none_or(|t| t >= 64), "kept speculating for a while: {mtp}");
    assert_eq!(spec_text, text);
    // A damaged file is as good as none, and is replaced.
    std::fs::write(m.join(".strata/speculation.json"), "{not json").unwrap();
    let (again, _) = generate(m);
    assert_eq!(again, text);
    assert!(kept(m)["plain_tokens_per_s"].as_f64().unwrap() > 0.0);
}
