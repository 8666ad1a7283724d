//! A model whose routed experts are over 4x the memory budget runs with its peak RSS
//! (VmHWM of a fresh process) inside the budget, streaming experts through the slab.

use std::process::Command;

fn strata(args: &[&str]) -> std::process::Output {
    // `bench ...` is the strata-bench binary's (kept out of strata).
    let (bin, args) = match args.split_first() {
        Some((&"bench", rest)) => (env!("CARGO_BIN_EXE_strata-bench"), rest),
        _ => (env!("CARGO_BIN_EXE_strata"), args),
    };
    Command::new(bin).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

/// `strata-bench synth --preset small --out m` with `args`, which must succeed.
fn synth_small(m: &str, args: &[&str]) {
    let mut all = vec!["bench", "synth", "--preset", "small", "--out", m];
    all.extend_from_slice(args);
    let out = strata(&all);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn peak_rss_stays_within_a_budget_four_times_smaller_than_the_experts() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let m = model.to_str().unwrap();
    synth_small(
        m,
        &[
            "--layers",
            "2",
            "--dense-layers",
            "0",
            "--experts",
            "112",
            "--top-k",
            "8",
            "--vocab",
            "1024",
            "--container",
            "int8",
        ],
    );

    // The smallest useful plan: 4 working slots and 3 slots per layer.
    let common = ["--context", "256", "--working-slots", "4", "--usage", "off"];
    let mut args = vec!["fit", "--model", m, "--budget", "1GiB", "--json"];
    args.extend(common);
    let fit = json(&strata(&args));
    let plan = &fit["plan"]["input"];
    let (fixed, slot) = (plan["fixed_bytes"].as_u64().unwrap(), plan["slot_bytes"].as_u64().unwrap());
    let budget = fixed + (4 + 2 * 3) * slot;
    let experts = fit["expert_bytes_total"].as_u64().unwrap();
    assert!(experts >= 4 * budget, "experts {experts} bytes must be >= 4x the budget {budget}");

    let budget_s = budget.to_string();
    let mut args = vec!["bench", "decode", "--model", m, "--prompt-tokens", "24", "--decode-tokens", "8", "--json"];
    args.extend(["--budget", budget_s.as_str()]);
    args.extend(common);
    let r = json(&strata(&args));
    let peak = r["peak_rss_bytes"].as_u64().unwrap();
    assert!(peak > 0 && peak <= budget, "peak RSS {peak} exceeds the budget {budget}");
    // Experts really streamed: misses were read, and the hit rate is below 1.
    assert!(r["expert_read_bytes"].as_u64().unwrap() > 0);
    assert!(r["expert_hit_rate"].as_f64().unwrap() < 1.0);
    eprintln!(
        "budget {budget}, experts {experts} ({:.1}x), peak RSS {peak}, hit rate {:.3}",
        experts as f64 / budget as f64,
        r["expert_hit_rate"]
    );
}

/// `bench synth --fp8` writes the decoder's projections as FP8 e4m3 with block scales (the
/// router, norms, embedding and head in bf16), and the model it writes loads and decodes.
#[test]
fn synth_fp8_writes_block_scaled_projections_that_decode() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    let m = model.to_str().unwrap();
    synth_small(
        m,
        &["--layers", "2", "--dense-layers", "1", "--experts", "8", "--top-k", "2", "--vocab", "512", "--fp8"],
    );
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let dtype = |name: &str| header[name]["dtype"].as_str().unwrap_or("missing").to_string();
    for name in [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
    ] {
        assert_eq!(dtype(name), "F8_E4M3", "{name}");
        assert_eq!(dtype(&format!("{name}_scale_inv")), "F32", "{name}_scale_inv");
    }
    for name in ["model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight"] {
        assert_eq!(dtype(name), "BF16", "{name}");
    }
    let args = ["bench", "decode", "--model", m, "--prompt-tokens", "6", "--decode-tokens", "3", "--usage", "off"];
    let r = json(&strata(&[&args[..], &["--mtp", "off", "--json"]].concat()));
    assert!(r["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
}
