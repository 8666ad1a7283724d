//! The `strata` binary as a user runs it: commands on a fixture model, and bad input
//! giving a one-line error that names the file and the problem (exit 1, no panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse")
}

fn strata(args: &[&str]) -> Output {
    // `bench ...` is the strata-bench binary's (kept out of strata).
    let (bin, args) = match args.split_first() {
        Some((&"bench", rest)) => (env!("CARGO_BIN_EXE_strata-bench"), rest),
        _ => (env!("CARGO_BIN_EXE_strata"), args),
    };
    Command::new(bin).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

/// A writable copy of the fixture model.
fn copy_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    dir
}

fn assert_one_line_error(out: &Output, want: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for w in want {
        assert!(lines[0].contains(w), "want `{w}` in `{}`", lines[0]);
    }
}

#[test]
fn generate_streams_text_and_writes_stats() {
    let stats = tempfile::NamedTempFile::new().unwrap();
    let m = fixture();
    let out = strata(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "The river",
        "--max-tokens",
        "12",
        "--stats-json",
        stats.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(stats.path()).unwrap()).unwrap();
    for k in ["prompt_tokens", "generated_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_bytes"] {
        assert!(s.get(k).is_some_and(|v| v.is_number()), "stats lack {k}: {s}");
    }
    assert_eq!(s["generated_tokens"], 12);
    // Seeded sampling reproduces; chat mode renders the template.
    let args = |seed: &'static str| {
        vec![
            "generate",
            "--chat",
            "--prompt",
            "hi",
            "--max-tokens",
            "8",
            "--temperature",
            "0.9",
            "--top-k",
            "50",
            "--seed",
            seed,
        ]
    };
    let run = |seed| {
        let mut a = args(seed);
        a.extend(["--model", m.to_str().unwrap()]);
        strata(&a).stdout
    };
    assert_eq!(run("7"), run("7"));
}

#[test]
fn logits_json_all_positions() {
    let m = fixture();
    let out = strata(&["logits", "--model", m.to_str().unwrap(), "--ids", "5,6,7", "--all-positions"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["logits"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].as_array().unwrap().len(), 512);
    let last = strata(&["logits", "--model", m.to_str().unwrap(), "--ids", "5,6,7"]);
    let v2: serde_json::Value = serde_json::from_slice(&last.stdout).unwrap();
    assert_eq!(v2["logits"].as_array().unwrap().len(), 1);
    // The same function computed with a different matmul shape: equal up to rounding.
    let (a, b) = (v2["logits"][0].as_array().unwrap(), rows[2].as_array().unwrap());
    let worst = a.iter().zip(b).map(|(x, y)| (x.as_f64().unwrap() - y.as_f64().unwrap()).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-5, "last-position logits differ by {worst}");
    assert_one_line_error(
        &strata(&["logits", "--model", m.to_str().unwrap(), "--ids", "5,x"]),
        &["`x` is not a token id"],
    );
    assert_one_line_error(
        &strata(&["logits", "--model", m.to_str().unwrap(), "--ids", "99999"]),
        &["outside the vocabulary"],
    );
}

#[test]
fn inspect_reports_groups() {
    let m = fixture();
    let out = strata(&["inspect", "--model", m.to_str().unwrap(), "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let groups = &v["weights"]["groups"];
    for g in ["embeddings", "attention", "dense_mlp", "shared_experts", "routed_experts"] {
        assert!(groups[g]["parameters"].as_u64().unwrap() > 0, "{g}: {v}");
    }
    let total: u64 = groups.as_object().unwrap().values().map(|g| g["bytes"].as_u64().unwrap()).sum();
    assert_eq!(v["weights"]["total_bytes"].as_u64().unwrap(), total);
}

#[test]
fn missing_config() {
    let d = copy_fixture();
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let out = strata(&["generate", "--model", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&out, &["config.json", "cannot read"]);
}

#[test]
fn missing_weights() {
    let d = copy_fixture();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let out = strata(&["generate", "--model", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&out, &["no weights"]);
}

#[test]
fn unknown_model_type() {
    let d = copy_fixture();
    let p = d.path().join("config.json");
    let text = std::fs::read_to_string(&p).unwrap().replace("\"glm_moe_dsa\"", "\"llama\"");
    std::fs::write(&p, text).unwrap();
    let out = strata(&["inspect", "--model", d.path().to_str().unwrap()]);
    assert_one_line_error(&out, &["config.json", "unsupported model_type `llama`"]);
}

#[test]
fn config_missing_field_and_shape_mismatch() {
    let d = copy_fixture();
    let p = d.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let saved = cfg.clone();
    cfg.as_object_mut().unwrap().remove("kv_lora_rank");
    std::fs::write(&p, cfg.to_string()).unwrap();
    let out = strata(&["generate", "--model", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&out, &["config.json", "missing field `kv_lora_rank`"]);

    let mut cfg = saved;
    let h = cfg["hidden_size"].as_u64().unwrap();
    cfg["hidden_size"] = (h * 2).into();
    std::fs::write(&p, cfg.to_string()).unwrap();
    let out = strata(&["generate", "--model", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&out, &["model.safetensors", "model.embed_tokens.weight", "has shape", "config implies"]);
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let d = copy_fixture();
    let p = d.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len / 2).unwrap();
    let out = strata(&["generate", "--model", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&out, &["model.safetensors", "corrupt safetensors header"]);

    let mut bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    bytes[8..16].copy_from_slice(b"{garbage");
    std::fs::write(&p, bytes).unwrap();
    let out = strata(&["inspect", "--model", d.path().to_str().unwrap()]);
    assert_one_line_error(&out, &["model.safetensors", "corrupt safetensors header", "invalid JSON"]);
}

#[test]
fn missing_tokenizer() {
    let d = copy_fixture();
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    let out = strata(&["generate", "--model", d.path().to_str().unwrap(), "--prompt", "x"]);
    assert_one_line_error(&out, &["tokenizer.json", "tokenizer not found"]);
    // Id-level commands still work without it.
    let out = strata(&["logits", "--model", d.path().to_str().unwrap(), "--ids", "1,2"]);
    assert!(out.status.success());
}

#[test]
fn missing_model_dir_and_bad_sampling() {
    let out = strata(&["generate", "--model", "/nonexistent/model", "--prompt", "x"]);
    assert_one_line_error(&out, &["/nonexistent/model", "model directory not found"]);
    let m = fixture();
    let out = strata(&["generate", "--model", m.to_str().unwrap(), "--prompt", "x", "--top-p", "0"]);
    assert_one_line_error(&out, &["top_p must be in (0, 1]"]);
}

#[test]
fn chat_runs_two_turns_from_stdin() {
    use std::io::Write;
    let m = fixture();
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["chat", "--model", m.to_str().unwrap(), "--max-tokens", "6", "--stats-json"])
        .arg(std::env::temp_dir().join(format!("strata-chat-{}.json", std::process::id())))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\nand again\n\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("> ").count(), 3, "two turns then the empty line that ends the chat: {text}");
}

#[test]
fn streaming_flags_and_their_errors() {
    let d = copy_fixture();
    let m = d.path().to_str().unwrap();
    // --budget on an HF checkpoint converts its experts once (f32 here: lossless).
    let out = strata(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "The river",
        "--max-tokens",
        "6",
        "--budget",
        "200MiB",
        "--context",
        "256",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(d.path().join(".strata/experts-f32/strata-experts.json").exists());
    let common = ["--prompt", "x", "--max-tokens", "2", "--context", "256"];
    let run = |extra: &[&str]| {
        let mut a = vec!["generate", "--model", m];
        a.extend(common);
        a.extend(extra);
        strata(&a)
    };
    assert_one_line_error(&run(&["--budget", "lots"]), &["--budget"]);
    assert_one_line_error(&run(&["--budget", "1MiB"]), &["does not fit the smallest expert plan", "short by"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--pin", "1:99"]), &["--pin 1:99", "no such routed expert"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--pin", "one"]), &["--pin `one`", "LAYER:EXPERT"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--auto-pin", "--usage", "off"]), &["--usage off"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--usage-import", "--usage", "off"]), &["--usage-import"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--pilot-ranks", "4"]), &["--pilot-ranks", "hint or prefetch"]);
    assert_one_line_error(
        &run(&["--budget", "200MiB", "--pilot", "prefetch", "--pilot-ranks", "0"]),
        &["--pilot-ranks must be at least 1"],
    );
    let out = run(&["--budget", "200MiB", "--pilot", "prefetch", "--pilot-ranks", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // --eviction: lfru by default, lru or lfru:HALF_LIFE on request, reported in the stats.
    assert_one_line_error(
        &run(&["--budget", "200MiB", "--eviction", "lfu"]),
        &["--eviction", "\"lfu\"", "lfru:HALF_LIFE"],
    );
    assert_one_line_error(&run(&["--budget", "200MiB", "--eviction", "lfru:0"]), &["--eviction", "\"lfru:0\""]);
    assert_one_line_error(&run(&["--eviction", "lru"]), &["--eviction needs --budget"]);
    // --eviction-scope: layer by default, global on request, reported in the stats.
    assert_one_line_error(
        &run(&["--budget", "200MiB", "--eviction-scope", "model"]),
        &["--eviction-scope", "\"model\"", "layer or global"],
    );
    assert_one_line_error(&run(&["--eviction-scope", "global"]), &["--eviction-scope needs --budget"]);
    // --skip-misses-from-rank: approximate decode, refused where it could not act.
    assert_one_line_error(&run(&["--skip-misses-from-rank", "2"]), &["--skip-misses-from-rank needs --budget"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--skip-misses-from-rank", "1"]), &["at least 2"]);
    assert_one_line_error(&run(&["--budget", "200MiB", "--skip-misses-from-rank", "99"]), &["99", "routes"]);
    let out = run(&["--budget", "200MiB", "--skip-misses-from-rank", "2", "--stats"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats = d.path().join("stats.json");
    for (flag, policy) in [(None, "lfru"), (Some("lru"), "lru"), (Some("lfru:8"), "lfru")] {
        let mut a = vec!["--budget", "200MiB", "--stats-json", stats.to_str().unwrap()];
        a.extend(flag.map(|f| ["--eviction", f]).iter().flatten());
        let out = run(&a);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        assert_eq!(j["experts"]["eviction"]["policy"], policy, "{flag:?}: {}", j["experts"]);
        if flag == Some("lfru:8") {
            assert_eq!(j["experts"]["eviction"]["half_life"], 8.0);
        }
        assert_eq!(j["experts"]["eviction_scope"], "layer", "{}", j["experts"]);
    }
    let a = ["--budget", "200MiB", "--stats-json", stats.to_str().unwrap(), "--eviction-scope", "global"];
    let out = run(&a);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(j["experts"]["eviction_scope"], "global", "{}", j["experts"]);
    // A ledger another engine wrote is refused unless imported.
    let ledger = d.path().join(".coli_usage");
    let text = std::fs::read_to_string(&ledger).unwrap();
    let foreign: String =
        text.lines().map(|l| if l.starts_with("-2 ") { "-2 1 12345".into() } else { l.to_string() } + "\n").collect();
    std::fs::write(&ledger, foreign).unwrap();
    assert_one_line_error(&run(&["--budget", "200MiB"]), &["usage ledger", "--usage-import"]);
    let out = run(&["--budget", "200MiB", "--usage-import"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(run(&["--budget", "200MiB"]).status.success(), "an imported ledger is rewritten under strata's id");
    // --mtp on needs a draft layer; the fixture has none.
    assert_one_line_error(&run(&["--mtp", "on"]), &["--mtp on", "no draft (MTP) layer"]);
    assert_one_line_error(&run(&["--mtp", "maybe"]), &["--mtp `maybe`"]);
    assert_one_line_error(&run(&["--draft-policy", "sometimes"]), &["--draft-policy", "`sometimes`"]);
    // Nothing drafts without a draft layer: the draft flags are refused, not ignored.
    assert_one_line_error(&run(&["--draft-tokens", "2"]), &["--draft-tokens 2", "draft (MTP) layer is not loaded"]);
    assert_one_line_error(&run(&["--draft-policy", "fixed"]), &["--draft-policy fixed", "nothing is drafted"]);
    assert_one_line_error(
        &run(&["--draft-policy", "adaptive", "--draft-tokens", "0"]),
        &["--draft-policy adaptive", "--draft-tokens 0"],
    );
    // Pin flags without a budget would do nothing: refused.
    assert_one_line_error(&run(&["--pin", "1:2"]), &["--pin needs --budget", "every expert is resident"]);
    assert_one_line_error(&run(&["--auto-pin"]), &["--auto-pin needs --budget"]);
    assert_one_line_error(
        &run(&["--pin", "1:2", "--auto-pin", "--live-repin"]),
        &["--pin and --auto-pin and --live-repin need --budget"],
    );

    let out_dir = tempfile::tempdir().unwrap();
    let o = out_dir.path().join("c");
    let bad = strata(&["convert", "--model", m, "--out", o.to_str().unwrap(), "--experts", "int3"]);
    assert_one_line_error(&bad, &["--experts", "unknown expert encoding `int3`"]);
    let bad = strata(&["convert", "--model", m, "--out", o.to_str().unwrap(), "--experts", "int4", "--group", "3"]);
    assert_one_line_error(&bad, &["--group must be an even number"]);
    // int4 at group 16 into `out`, with `scales` (none: the default), succeeding.
    let int4_g16 = |out: &std::path::Path, scales: Option<&str>| {
        let mut args = vec!["convert", "--model", m, "--out", out.to_str().unwrap()];
        args.extend(["--experts", "int4", "--group", "16", "--json"]);
        args.extend(scales.map(|s| ["--scales", s]).into_iter().flatten());
        let done = strata(&args);
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    };
    int4_g16(&o, None);
    // int4 scales are e4m3 unless `--scales`; `--scales` is refused where no encoding is
    // int4; f32 scales take four times the bytes (and the factor), bf16 twice.
    let o16 = out_dir.path().join("c16");
    let bad =
        strata(&["convert", "--model", m, "--out", o16.to_str().unwrap(), "--experts", "int8", "--scales", "f32"]);
    assert_one_line_error(&bad, &["--scales f32 applies to int4 experts", "--experts is int8"]);
    int4_g16(&o16, Some("f32"));
    // (This fixture's experts fit one 4 KiB region either way: compare the scales.)
    let gate = |dir: &std::path::Path| -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("strata-experts.json")).unwrap()).unwrap();
        v["tiers"][0]["layout"]["gate"].clone()
    };
    let (e, f) = (gate(&o), gate(&o16));
    assert_eq!((e["kind"].as_str(), f["kind"].as_str()), (Some("int4-g16-e4m3"), Some("int4-g16")), "{e} {f}");
    assert_eq!(4 * (e["scales_len"].as_u64().unwrap() - 4), f["scales_len"].as_u64().unwrap(), "{e} {f}");
    // bf16 scales: half of f32's bytes. Each of the three is a model that generates.
    let o8 = out_dir.path().join("c8");
    int4_g16(&o8, Some("bf16"));
    let bf = gate(&o8);
    assert_eq!(bf["kind"].as_str(), Some("int4-g16-bf16"), "{bf}");
    assert_eq!(2 * bf["scales_len"].as_u64().unwrap(), f["scales_len"].as_u64().unwrap(), "{bf} {f}");
    for dir in [&o, &o16, &o8] {
        let gen = strata(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "a b", "--max-tokens", "3"]);
        assert!(gen.status.success(), "{}", String::from_utf8_lossy(&gen.stderr));
    }
    let bad = strata(&["convert", "--model", m, "--out", o8.to_str().unwrap(), "--scales", "e5m2"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("e5m2"));
    // The container holds the same parameters as the checkpoint it came from.
    let total = |dir: &str| -> u64 {
        let v: serde_json::Value =
            serde_json::from_slice(&strata(&["inspect", "--model", dir, "--json"]).stdout).unwrap();
        v["weights"]["total_parameters"].as_u64().unwrap()
    };
    assert_eq!(total(o.to_str().unwrap()), total(m));
    // inspect names each expert tier's encoding.
    let v: serde_json::Value =
        serde_json::from_slice(&strata(&["inspect", "--model", o.to_str().unwrap(), "--json"]).stdout).unwrap();
    let main = &v["expert_tiers"][0];
    assert_eq!((main["format"].as_str(), main["tier"].as_str()), (Some("strata"), Some("main")), "{v}");
    assert_eq!(main["encodings"][2].as_str(), Some("int4-g16-e4m3"), "{v}");
    assert!(main["slot_bytes"].as_u64().unwrap() > 0, "{v}");
    let text = String::from_utf8_lossy(&strata(&["inspect", "--model", o16.to_str().unwrap()]).stdout).to_string();
    assert!(text.contains("expert tier `main` (strata):") && text.contains(", int4-g16, "), "{text}");
    let colibri = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/colibri/dsa-sparse-int4");
    let v: serde_json::Value =
        serde_json::from_slice(&strata(&["inspect", "--model", colibri.to_str().unwrap(), "--json"]).stdout).unwrap();
    assert_eq!(v["expert_tiers"][0]["format"].as_str(), Some("colibri"), "{v}");
    assert_eq!(v["expert_tiers"][0]["encodings"][0].as_str(), Some("int4-g16"), "{v}");
    // From int4 at the asked group the default keeps the nibbles with bf16 scales, and says
    // so; at another group the experts are quantized anew, with e4m3 scales.
    for (group, want, note) in [("16", "int4-g16-bf16", true), ("32", "int4-g32-e4m3", false)] {
        let oc = out_dir.path().join(format!("colibri-g{group}"));
        let c = colibri.to_str().unwrap();
        let done = strata(&["convert", "--model", c, "--out", oc.to_str().unwrap(), "--group", group, "--json"]);
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
        assert_eq!(gate(&oc)["kind"].as_str(), Some(want));
        let said = String::from_utf8_lossy(&done.stderr).contains("their nibbles are kept with bf16 scales");
        assert_eq!(said, note, "{}", String::from_utf8_lossy(&done.stderr));
    }
    let fit: serde_json::Value = serde_json::from_slice(
        &strata(&["fit", "--model", o.to_str().unwrap(), "--budget", "200MiB", "--context", "256", "--json"]).stdout,
    )
    .unwrap();
    assert!(fit["plan"]["slots_per_layer"].as_u64().unwrap() >= 1, "{fit}");
    let refused = strata(&["fit", "--model", o.to_str().unwrap(), "--budget", "10MiB", "--context", "256"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stdout).contains("fits: NO"));
    assert_one_line_error(
        &strata(&["replay", "--trace", "/nonexistent/t", "--slots-per-layer", "2"]),
        &["/nonexistent/t"],
    );
    assert_one_line_error(
        &strata(&["replay", "--trace", "/nonexistent/t", "--slots-per-layer", "2", "--lfru-half-life", "0"]),
        &["--lfru-half-life", "got 0"],
    );
}

#[test]
fn serve_refuses_bad_batching_options_before_loading() {
    let model = fixture();
    let m = model.to_str().unwrap();
    for (args, want) in [
        (vec!["--max-batch", "0"], "--max-batch"),
        (vec!["--max-batch", "8", "--step-tokens", "4"], "--step-tokens"),
        (vec!["--kv-tokens", "100", "--context", "200"], "--kv-tokens"),
        (vec!["--prompt-cache", "lots"], "--prompt-cache"),
        (vec!["--cors", "example.com"], "--cors"),
        (vec!["--mtp", "on"], "--mtp"),
        (vec!["--mtp", "off", "--draft-tokens", "2"], "--draft-tokens 2: --mtp off"),
        (
            vec!["--max-batch", "8", "--step-tokens", "16", "--draft-tokens", "3"],
            "at least --max-batch x (1 + --draft-tokens) = 32",
        ),
        (vec!["--draft-tokens", "0", "--draft-policy", "fixed"], "--draft-policy fixed"),
        (vec!["--draft-policy", "sometimes"], "--draft-policy"),
    ] {
        let mut all = vec!["serve", "--model", m, "--port", "0"];
        all.extend(args);
        let out = strata(&all);
        assert!(!out.status.success(), "{all:?}");
        assert_one_line_error(&out, &[want]);
    }
}

#[test]
fn cuda_graphs_flag_is_refused_off_cuda_and_checked() {
    let model = fixture();
    let m = model.to_str().unwrap();
    for (args, want) in [
        (vec!["--cuda-graphs", "off"], "--cuda-graphs applies to --device cuda"),
        (vec!["--device", "cuda", "--cuda-graphs", "sometimes"], "--cuda-graphs `sometimes`: expected on or off"),
    ] {
        let mut all = vec!["generate", "--model", m, "--prompt", "hi", "--max-tokens", "1"];
        all.extend(args);
        let out = strata(&all);
        assert!(!out.status.success(), "{all:?}");
        assert_one_line_error(&out, &[want]);
    }
}

#[test]
fn replay_two_tiers_from_a_generated_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.trace");
    let (m, t) = (fixture(), trace.to_str().unwrap().to_string());
    let out = strata(&[
        "generate",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "The river town",
        "--max-tokens",
        "24",
        "--trace",
        &t,
        "--usage",
        "off",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let replay = |extra: &[&str]| {
        let mut args = vec!["replay", "--trace", &t, "--slots-per-layer", "1", "--working", "2"];
        args.extend(extra);
        strata(&args)
    };
    let out = replay(&["--host-slots-per-layer", "2", "--host-working", "2", "--pinned", "1", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Exclusive tiers (the engine's default) and inclusive ones, each with and without pins.
    for policy in ["lru", "pinned_lru", "inclusive_lru", "inclusive_pinned_lru"] {
        let r = &v["tiers"][policy];
        let n = r["accesses"].as_u64().unwrap();
        assert!(n > 0, "{v}");
        // Every access is served by exactly one tier.
        let served: u64 = ["gpu_hits", "host_hits", "disk_reads"].iter().map(|k| r[*k].as_u64().unwrap()).sum();
        assert_eq!(served, n, "{r}");
        assert!(r["disk_reads"].as_u64().unwrap() > 0, "{r}");
        let demoted = r["demotions_kept"].as_u64().unwrap() + r["demotions_copied"].as_u64().unwrap();
        assert_eq!(demoted > 0, !policy.starts_with("inclusive"), "{policy}: evictions kept by the host: {r}");
    }
    // Without the host tier the report has no `tiers`; the text report names both tiers.
    let single: serde_json::Value = serde_json::from_slice(&replay(&["--json"]).stdout).unwrap();
    assert!(single.get("tiers").is_none(), "{single}");
    let text = String::from_utf8_lossy(&replay(&["--host-slots-per-layer", "2"]).stdout).to_string();
    assert!(text.contains("tiers: GPU") && text.contains("LRU, inclusive"), "{text}");
    assert_one_line_error(&replay(&["--host-slots-per-layer", "0"]), &["--host-slots-per-layer"]);
    // --eviction-scope: the runtime rows' tables, named in the report; refused by name.
    let v: serde_json::Value =
        serde_json::from_slice(&replay(&["--eviction-scope", "global", "--json"]).stdout).unwrap();
    assert_eq!(v["config"]["scope"], "global", "{v}");
    assert_eq!(single["config"]["scope"], "layer", "{single}");
    assert_one_line_error(&replay(&["--eviction-scope", "all"]), &["--eviction-scope", "\"all\""]);
}

/// `scripts/replay_tiers.py` on the committed 256-expert trace: the tiers table and its
/// pricing at full GLM-5.2's scale (docs/performance.md quotes these rows); bad pricing
/// inputs are refused by name.
#[test]
fn replay_tiers_script_prices_the_committed_trace() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = |extra: &[&str]| {
        Command::new("python3")
            .current_dir(&root)
            .args(["scripts/replay_tiers.py", "--strata", env!("CARGO_BIN_EXE_strata")])
            .args(["--trace", "docs/traces/routing-256-experts-top8.trace.xz"])
            .args(extra)
            .output()
    };
    let Ok(out) = script(&["--prefetch-share", "0.38", "--prefetch-waste", "0.10"]) else {
        eprintln!("skipped: no python3");
        return;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("| LRU in both tiers, exclusive | 342 | 346 | 60.0% | 23.4% | 16.6% | 39.3% |"), "{text}");
    assert!(
        text.contains("| LRU in both tiers, exclusive | 263.2 (3.80) | 231.7 (4.32) | 153.9 (6.50) | 162.5 (6.15) |"),
        "{text}"
    );
    // LFRU on the GPU (the default eviction): docs/performance.md, "LFRU eviction".
    assert!(
        text.contains(
            "| LFRU (half-life 32) on the GPU, LRU host, exclusive | 342 | 346 | 64.6% | 19.4% | 15.9% | 16.2% |"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "| LFRU (half-life 32) on the GPU, LRU host, exclusive | 246.1 (4.06) | 217.1 (4.61) | 147.5 (6.78) | 153.1 (6.53) |"
        ),
        "{text}"
    );
    // Approximate decode (docs/performance.md, "Approximate decode"): ranks 6-8 of one-row
    // forwards' disk misses left out.
    let out =
        script(&["--prefetch-share", "0.38", "--prefetch-waste", "0.10", "--skip-misses-from-rank", "6"]).unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let row = "| LFRU (half-life 32) on the GPU, LRU host, exclusive |";
    assert!(text.contains(&format!("{row} 342 | 346 | 64.3% | 18.6% | 9.2% | 14.8% | 7.9% |")), "{text}");
    assert!(text.contains(&format!("{row} 166.5 (6.01) | 145.7 (6.86) | 85.5 (11.69) | 107.6 (9.30) |")), "{text}");
    // One slab for all layers (docs/performance.md): victims from any layer, both tiers.
    let out = script(&["--prefetch-share", "0.38", "--prefetch-waste", "0.10", "--eviction-scope", "global"]).unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("{row} 342 | 346 | 64.3% | 20.5% | 15.2% | 17.4% |")), "{text}");
    assert!(text.contains(&format!("{row} 239.6 (4.17) | 209.4 (4.78) | 140.3 (7.13) | 145.7 (6.86) |")), "{text}");
    // MTP rounds (docs/performance.md, "MTP does not buy disk bytes"): K 1, P 0.9.
    let mtp = ["--prefetch-share", "0.38", "--prefetch-waste", "0.10", "--gpu-frac", "0.296"];
    let out = script(&[&mtp[..], &["--mtp-drafts", "1", "--mtp-acceptance", "0.9"]].concat()).unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2503 tokens in 1317 verify forwards (1.90 a round)"), "{text}");
    assert!(text.contains(&format!("{row} 240.6 (4.16) | 204.9 (4.88) | 147.3 (6.79) | 152.9 (6.54) |")), "{text}");
    // Every draft accepted: two tokens a round, but where a run ends.
    let out = script(&["--mtp-drafts", "1", "--mtp-acceptance", "1", "--json"]).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (rounds, tokens) = (v["mtp"]["rounds"].as_u64().unwrap(), v["mtp"]["tokens"].as_u64().unwrap());
    assert!(tokens == 2503 && rounds <= 1252 + 6, "{tokens} tokens in {rounds} rounds");
    for bad in [
        &["--prefetch-share", "1.5"][..],
        &["--moe-layers", "80"],
        &["--skip-misses-from-rank", "1"],
        &["--mtp-drafts", "1"],
        &["--mtp-acceptance", "1.5", "--mtp-drafts", "2"],
        &["--draft-ms", "1"],
        &["--eviction-scope", "all"],
    ] {
        let out = script(bad).unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(bad[0]), "{bad:?}: {err}");
    }
}

/// On CUDA `--budget` is the process's host memory: the host plan counts the CUDA runtime
/// and the largest weight in transit beside the tier of expert slots (no GPU needed).
#[test]
fn fit_on_cuda_counts_the_host_runtime_in_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let o = dir.path().join("c");
    let m = fixture();
    let conv = strata(&["convert", "--model", m.to_str().unwrap(), "--out", o.to_str().unwrap(), "--experts", "int8"]);
    assert!(conv.status.success(), "{}", String::from_utf8_lossy(&conv.stderr));
    let fit = |budget: &str| {
        strata(&["fit", "--model", o.to_str().unwrap(), "--device", "cuda", "--budget", budget, "--json"])
    };
    let out = fit("2GiB");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let items = v["host"]["report"]["items"].as_array().unwrap_or_else(|| panic!("no host items: {v}"));
    let bytes = |needle: &str| {
        items
            .iter()
            .find(|i| i["name"].as_str().unwrap().contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` item: {items:?}"))["bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(bytes("CUDA driver"), strata_engine::fit::CUDA_HOST_RUNTIME);
    // Three times the largest non-expert tensor of the fixture (mapped + decoded).
    let store = strata_storage::WeightStore::open_dir(&o).unwrap();
    let largest = store.names().map(|n| store.get(n).unwrap().1.byte_len() as u64).max().unwrap();
    assert_eq!(bytes("largest weight"), 3 * largest);
    // The GPU plan counts a CUDA prompt chunk's activations (512 rows; the CPU's 256).
    let transients = |items: &serde_json::Value| {
        items.as_array().unwrap().iter().find(|i| i["name"].as_str().unwrap().starts_with("transients")).unwrap()
            ["bytes"]
            .as_u64()
            .unwrap()
    };
    let cpu = strata(&["fit", "--model", o.to_str().unwrap(), "--budget", "2GiB", "--json"]);
    let cpu: serde_json::Value = serde_json::from_slice(&cpu.stdout).unwrap();
    let (g, c) = (transients(&v["gpu"]["report"]["items"]), transients(&cpu["report"]["items"]));
    assert!(g > c + c / 2, "GPU transients {g} against the CPU's {c}");
    // A budget below the CUDA runtime is refused with the numbers.
    let small = fit("300MiB");
    assert_eq!(small.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&small.stderr).contains("host tier"), "{}", String::from_utf8_lossy(&small.stderr));
}

/// `strata ARGS FLAG VALUE --json`'s report (the run must succeed).
fn json_with(base: &[&str], flag: &str, value: &str) -> serde_json::Value {
    let mut args = base.to_vec();
    args.extend([flag, value]);
    let out = strata(&args);
    assert!(out.status.success(), "{flag} {value}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `strata ARGS FLAG sometimes` fails, naming the flag and the value.
fn refuses_sometimes(base: &[&str], flag: &str) {
    let mut args = base.to_vec();
    args.extend([flag, "sometimes"]);
    let out = strata(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(flag) && err.contains("sometimes"), "{err}");
}

#[test]
fn bench_decode_fed_decoding_is_honoured_and_checked() {
    let model = fixture();
    let m = model.to_str().unwrap();
    let base = ["bench", "decode", "--model", m, "--prompt-tokens", "4", "--decode-tokens", "4", "--json"];
    for (value, fed) in [("on", true), ("off", false), ("auto", false)] {
        let r = json_with(&base, "--fed-decoding", value);
        // (auto: the CPU's logits live on the host, so the picks are read from them.)
        assert_eq!(r["decode_fed"], fed, "--fed-decoding {value}");
    }
    refuses_sometimes(&base, "--fed-decoding");
}

#[test]
fn bench_decode_profile_times_the_prompt_and_the_decode_op_by_op() {
    let model = fixture();
    let m = model.to_str().unwrap();
    let base = ["bench", "decode", "--model", m, "--prompt-tokens", "12", "--decode-tokens", "4", "--json"];
    let r = json_with(&base, "--profile", "--usage=off");
    for (key, calls) in [("profile_ms_per_token", 1.0), ("profile_prefill_ms", 1.0)] {
        let ops = r[key].as_object().unwrap_or_else(|| panic!("{key} missing: {r}"));
        // Every layer's attention and the MoE layers' experts ran, and took time.
        for op in ["mla attend (scores, softmax, values, W_uv)", "experts (routed + shared, dense mlp)"] {
            let o = &ops[op];
            assert!(o["calls"].as_f64().unwrap() >= calls, "{key}: {op}: {o}");
            assert!(o["ms"].as_f64().unwrap() > 0.0, "{key}: {op}: {o}");
        }
    }
    for key in ["profile_unaccounted_ms_per_token", "profile_prefill_unaccounted_ms"] {
        assert!(r[key].as_f64().is_some(), "{key} missing: {r}");
    }
    // Without --profile, no breakdown.
    let plain = json_with(&base, "--usage", "off");
    assert!(plain.get("profile_prefill_ms").is_none() && plain.get("profile_ms_per_token").is_none());
}

/// `--floor` on a streamed model: the disk bound is the decode's own reads per token at the
/// measured disk rate (under a GPU tier those are the misses of both tiers, not of every
/// expert use).
#[test]
fn bench_decode_floor_prices_the_decodes_own_reads() {
    let dir = copy_fixture();
    let m = dir.path().to_str().unwrap();
    let args = ["bench", "decode", "--model", m, "--budget", "120MiB", "--working-slots", "2", "--mtp", "off"];
    let more = ["--usage", "off", "--prompt-tokens", "8", "--decode-tokens", "8", "--floor", "--json"];
    let out = strata(&[&args[..], &more[..]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let read = r["decode_expert_read_bytes_per_token"].as_f64().unwrap();
    let rate = r["disk_random_read_gb_per_s"].as_f64().unwrap();
    let disk = r["decode_floor_tokens_per_s_disk_at_this_hit_rate"].as_f64().unwrap();
    assert!(read > 0.0 && rate > 0.0, "the decode read nothing from disk: {r}");
    let want = rate * 1e9 / read;
    assert!((disk - want).abs() <= 1e-9 * want, "disk floor {disk} tok/s, reads say {want}: {r}");
    let floor = r["decode_floor_tokens_per_s"].as_f64().unwrap();
    let memory = r["decode_floor_tokens_per_s_memory"].as_f64().unwrap();
    assert!(floor <= disk * (1.0 + 1e-12) && floor <= memory, "floor {floor}, disk {disk}, memory {memory}");
    assert!(floor == memory || floor >= disk * (1.0 - 1e-12), "the floor is the smaller bound: {r}");
}

/// `bench decode --pilot` reports the prediction in its JSON; without it there is none.
#[test]
fn bench_decode_reports_pilot() {
    let dir = copy_fixture();
    let m = dir.path().to_str().unwrap();
    let args = ["bench", "decode", "--model", m, "--budget", "120MiB", "--working-slots", "4", "--mtp", "off"];
    let more = ["--usage", "off", "--prompt-tokens", "4", "--decode-tokens", "6", "--json"];
    let run = |extra: &[&str]| {
        let out = strata(&[&args[..], &more[..], extra].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    assert!(run(&[]).get("pilot").is_none());
    let r = run(&["--pilot", "prefetch", "--pilot-ranks", "2"]);
    let p = &r["pilot"];
    assert!(p["rows"].as_u64().unwrap() > 0 && p["recall"].as_f64().is_some(), "{r}");
    assert!(p["prefetch_hits"].as_u64().unwrap() <= p["prefetches"].as_u64().unwrap(), "{r}");
}

#[test]
fn bench_serve_device_picks_is_honoured_and_checked() {
    let model = fixture();
    let m = model.to_str().unwrap();
    let base =
        ["bench", "serve", "--model", m, "--requests", "2", "--prompt-tokens", "4", "--decode-tokens", "3", "--json"];
    let mut tokens = Vec::new();
    for (value, picked) in [("on", true), ("off", false), ("auto", false)] {
        let r = json_with(&base, "--device-picks", value);
        // (auto: the CPU's logits live on the host, so no step is picked apart from them.)
        assert_eq!(r["picked_steps"].as_u64().unwrap() > 0, picked, "--device-picks {value}: {r}");
        tokens.push(r["generated_tokens"].clone());
    }
    assert!(tokens.iter().all(|t| *t == tokens[0]), "{tokens:?}");
    refuses_sometimes(&base, "--device-picks");
}
