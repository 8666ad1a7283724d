//! Autoconvert staleness: touching or editing files that do not shape the experts
//! (generation_config.json, config.json's other fields, mtimes) reconverts nothing;
//! changing the weights' contents (same size) does; the usage ledger survives.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::SystemTime;
use strata_engine::autoconvert::{container_for, STAMP_FILE};

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn touch(path: &Path) {
    std::fs::File::options().write(true).open(path).unwrap().set_modified(SystemTime::now()).unwrap();
}

#[test]
fn only_weight_changes_reconvert_and_the_ledger_survives() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&root.join("fixtures/glm5/dsa-sparse"), dir.path());
    let arch = strata_models::read_arch(dir.path()).unwrap();
    let target = container_for(dir.path(), arch.as_ref()).unwrap();
    let stamp = std::fs::read_to_string(target.join(STAMP_FILE)).unwrap();
    // A ledger where an older strata kept it, and a marker that would vanish with a
    // reconversion.
    std::fs::write(target.join(".coli_usage"), "3 1 7\n").unwrap();
    std::fs::write(target.join("marker"), "x").unwrap();

    // Touch everything; edit generation_config.json and an unrelated config field.
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        touch(&dir.path().join(name));
    }
    std::fs::write(dir.path().join("generation_config.json"), r#"{"temperature": 0.5}"#).unwrap();
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(12345);
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    assert_eq!(container_for(dir.path(), arch.as_ref()).unwrap(), target);
    assert!(target.join("marker").exists(), "nothing was reconverted");
    assert_eq!(std::fs::read_to_string(target.join(STAMP_FILE)).unwrap(), stamp);

    // Same size, different bytes in the weights' data: reconverted, ledger kept.
    let weights = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    let mut f = std::fs::File::options().write(true).open(&weights).unwrap();
    f.seek(SeekFrom::Start(len - 4096)).unwrap();
    f.write_all(&[0x5a; 4096]).unwrap();
    drop(f);
    assert_eq!(container_for(dir.path(), arch.as_ref()).unwrap(), target);
    assert!(!target.join("marker").exists(), "reconverted");
    assert_ne!(std::fs::read_to_string(target.join(STAMP_FILE)).unwrap(), stamp);
    let kept = dir.path().join(".coli_usage");
    assert_eq!(std::fs::read_to_string(kept).unwrap(), "3 1 7\n", "ledger moved to the model directory");
}
