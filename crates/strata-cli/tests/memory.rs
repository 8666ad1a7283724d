//! A model whose routed experts are over 4x the memory budget runs with its peak RSS
//! (VmHWM of a fresh process) inside the budget, streaming experts through the slab.

use std::process::Command;

fn strata(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
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
    let out = strata(&[
        "bench",
        "synth",
        "--preset",
        "small",
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
        "--out",
        m,
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

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
