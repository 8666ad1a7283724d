//! `strata-bench decode` counts the routed experts a decode token reads (`expert_bytes_used_per_token`,
//! the floor's expert part) whether the checkpoint stores them per expert or fused
//! (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`: transformers' layout, as Gemma 4 ships).

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(path)
}

fn expert_bytes(model: &Path) -> u64 {
    let out = Command::new(env!("CARGO_BIN_EXE_strata-bench"))
        .args(["decode", "--model", model.to_str().unwrap()])
        .args(["--prompt-tokens", "4", "--decode-tokens", "2", "--context", "64", "--usage", "off", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["expert_bytes_used_per_token"].as_u64().unwrap()
}

#[test]
fn fused_experts_count_in_the_decode_floor() {
    // 5 MoE layers x top-2 x (gate + up + down of 16 x 64), f32, stored fused.
    assert_eq!(expert_bytes(&fixture("gemma4/moe")), 5 * 2 * 3 * 16 * 64 * 4);
}

#[test]
fn per_expert_tensors_count_in_the_decode_floor() {
    // 2 MoE layers (the first is dense) x top-2 x (gate + up + down of 32 x 64), f32.
    assert_eq!(expert_bytes(&fixture("glm4_moe/gqa-bias")), 2 * 2 * 3 * 32 * 64 * 4);
}
