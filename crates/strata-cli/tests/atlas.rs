//! Expert Atlas, perplexity, coupling and the convert report through the `strata`
//! binary on the shipped model; the rendered page checked in headless Chromium (skipped,
//! with a message, when no Chromium is installed).

#[path = "common/png.rs"]
mod png;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tiny() -> String {
    root().join("models/strata-tiny").to_string_lossy().into_owned()
}

fn shipped(name: &str) -> String {
    root().join("models/strata-tiny/atlas").join(name).to_string_lossy().into_owned()
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_str(&ok(out)).unwrap()
}

fn assert_one_line_error(out: &Output, want: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    for w in want {
        assert!(lines[0].contains(w), "want `{w}` in `{}`", lines[0]);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn atlas_build_and_validate_on_strata_tiny() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("atlas.json");
    let text = ok(&strata(&[
        "atlas",
        "build",
        "--model",
        &tiny(),
        "--probes",
        &shipped("probes.json"),
        "--out",
        path(&out),
        "--max-tokens",
        "8",
        "--context",
        "512",
    ]));
    assert!(text.contains("54 prompts in 9 categories"), "{text}");
    let a: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(a["format"], "strata-atlas");
    assert_eq!(a["model"]["layers"], serde_json::json!([1, 2, 3, 4, 5]));
    assert_eq!(a["runs"].as_array().unwrap().len(), 54);
    assert_eq!(a["method"]["min_count"], 30);
    assert_eq!(a["summary"]["experts_seen"], 160);
    for e in a["experts"].as_array().unwrap() {
        let s = e["specialization"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&s), "{e}");
        let sum: f64 = e["affinity"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum();
        assert!((sum - 1.0).abs() < 1e-4, "{e}");
    }
    // Every run counts 5 layers x top-4 per routed position.
    for r in a["runs"].as_array().unwrap() {
        assert_eq!(r["total_selections"].as_u64().unwrap(), r["tokens"].as_u64().unwrap() * 20);
    }
    // The file alone validates; the routing tells the nine categories apart.
    let v = json(&strata(&["atlas", "validate", path(&out), "--json"]));
    assert_eq!((v["trials"].as_u64(), v["top_k"].as_u64()), (Some(54), Some(17)));
    let (acc, chance) = (v["accuracy"].as_f64().unwrap(), v["chance"].as_f64().unwrap());
    assert!((chance - 1.0 / 9.0).abs() < 1e-6);
    assert!(acc >= 0.7, "accuracy {acc}");
    assert_eq!(v["trials_by_prompt"].as_array().unwrap().len(), 54);
    assert_eq!(v, a["validation"]);
    let t = ok(&strata(&["atlas", "validate", path(&out), "--top-k", "8"]));
    assert!(t.starts_with("validation (global leave-one-prompt-out, top-8 specialists per category)"), "{t}");
}

#[test]
fn the_shipped_atlas_is_consistent() {
    let a: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(shipped("atlas.json")).unwrap()).unwrap();
    let v = json(&strata(&["atlas", "validate", &shipped("atlas.json"), "--json"]));
    assert_eq!(v, a["validation"]);
    let probes: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shipped("probes.json")).unwrap()).unwrap();
    assert_eq!(a["probes"], probes);
}

#[test]
fn atlas_bad_input_is_one_line_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let probes = dir.path().join("p.json");
    let write = |v: serde_json::Value| std::fs::write(&probes, v.to_string()).unwrap();
    let prov = serde_json::json!({"source": "s", "sourceCommit": "c", "method": "m"});
    write(
        serde_json::json!({"schemaVersion": 1, "provenance": prov, "categories": {"a": ["x", "y", "z"], "b": ["x", "y"]}}),
    );
    let run = |probes: &Path| {
        strata(&[
            "atlas",
            "build",
            "--model",
            &tiny(),
            "--probes",
            path(probes),
            "--out",
            path(&dir.path().join("o.json")),
        ])
    };
    assert_one_line_error(&run(&probes), &["p.json", "category b has 2 prompts: at least 3 are needed"]);
    write(
        serde_json::json!({"schemaVersion": 1, "provenance": prov, "categories": {"A": ["x", "y", "z"], "b": ["x", "y", "z"]}}),
    );
    assert_one_line_error(&run(&probes), &["category \"A\": names are [a-z0-9_]+"]);
    std::fs::write(&probes, "{not json").unwrap();
    assert_one_line_error(&run(&probes), &["p.json", "invalid JSON"]);
    assert_one_line_error(&run(&dir.path().join("missing.json")), &["missing.json", "cannot read probe set"]);
    write(
        serde_json::json!({"schemaVersion": 1, "provenance": prov, "categories": {"a": ["x", "y", "z"], "b": ["x", "y", "z"]}}),
    );
    let out = strata(&[
        "atlas",
        "build",
        "--model",
        &tiny(),
        "--probes",
        path(&probes),
        "--out",
        "/nonexistent/o.json",
        "--min-runs",
        "4",
    ]);
    assert_one_line_error(&out, &["--min-runs 4 exceeds the 3 prompts of category a"]);
    // validate / render on something that is not an atlas.
    assert_one_line_error(&strata(&["atlas", "validate", path(&probes)]), &["p.json", "not an atlas file"]);
    assert_one_line_error(
        &strata(&["atlas", "render", "/nonexistent/a.json", "--out", "x.html"]),
        &["/nonexistent/a.json", "cannot read atlas"],
    );
    assert_one_line_error(&strata(&["atlas", "validate", &shipped("atlas.json"), "--top-k", "0"]), &["--top-k"]);
}

fn find_chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("STRATA_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for name in ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"] {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

#[test]
fn atlas_page_renders_in_headless_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("atlas.html");
    let out = ok(&strata(&["atlas", "render", &shipped("atlas.json"), "--out", path(&html)]));
    assert!(out.contains("160 experts on a 5 x 32 grid"), "{out}");
    let page = std::fs::read_to_string(&html).unwrap();
    // Self-contained: no external resource.
    assert!(!page.contains("http://") && !page.contains("https://"));
    assert_eq!(page.matches("<td data-key=").count(), 160);
    assert!(page.contains("leave-one-prompt-out accuracy"));
    let Some(chromium) = find_chromium() else {
        eprintln!(
            "skipping the Chromium check: no chromium on PATH (apt-get install -y chromium, or set STRATA_CHROMIUM)"
        );
        return;
    };
    let png = dir.path().join("atlas.png");
    let mut child = Command::new(&chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .arg(format!("--user-data-dir={}", dir.path().join("profile").display()))
        .args(["--window-size=1400,820", "--enable-logging=stderr", "--v=0"])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", html.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(dir.path().join("chromium.log")).unwrap()))
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("chromium did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(dir.path().join("chromium.log")).unwrap();
    let console: Vec<&str> = log.lines().filter(|l| l.contains("CONSOLE")).collect();
    assert!(console.iter().any(|l| l.contains("atlas-ready 160 cells")), "the page's script did not run: {log}");
    for l in &console {
        assert!(!l.contains("Uncaught") && !l.contains("Error"), "console error: {l}");
    }
    let img = png::decode(&std::fs::read(&png).unwrap()).unwrap();
    assert_eq!((img.width, img.height), (1400, 820));
    let distinct: std::collections::HashSet<[u8; 3]> = img.rgb.iter().copied().collect();
    assert!(distinct.len() > 200, "only {} colours: blank page?", distinct.len());
    // The grid is colourful: many strongly saturated pixels.
    let saturated = img
        .rgb
        .iter()
        .filter(|p| {
            let (mx, mn) = (*p.iter().max().unwrap() as i32, *p.iter().min().unwrap() as i32);
            mx - mn > 60
        })
        .count();
    assert!(saturated > 20_000, "{saturated} saturated pixels");
}

#[test]
fn perplexity_and_convert_report() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    let probes: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shipped("heldout.json")).unwrap()).unwrap();
    let body: Vec<String> =
        probes["categories"]["bible"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    std::fs::write(&text, body.join("\n")).unwrap();
    let p = json(&strata(&["perplexity", "--model", &tiny(), "--text", path(&text), "--context", "64", "--json"]));
    assert_eq!((p["context"].as_u64(), p["stride"].as_u64()), (Some(64), Some(32)));
    assert_eq!(p["scored"].as_u64().unwrap() + 1, p["tokens"].as_u64().unwrap());
    let ppl = p["perplexity"].as_f64().unwrap();
    assert!(ppl > 2.0 && ppl < 100.0, "{p}");
    assert!((p["mean_nll"].as_f64().unwrap().exp() - ppl).abs() < 1e-9);
    let t =
        ok(&strata(&["perplexity", "--model", &tiny(), "--text", path(&text), "--context", "64", "--stride", "64"]));
    assert!(t.contains("perplexity ") && t.contains("windows of 64, stride 64"), "{t}");
    assert_one_line_error(
        &strata(&["perplexity", "--model", &tiny(), "--text", path(&text), "--context", "64", "--stride", "65"]),
        &["--stride must be in 1..=64"],
    );
    assert_one_line_error(
        &strata(&["perplexity", "--model", &tiny(), "--text", "/nonexistent.txt"]),
        &["/nonexistent.txt", "cannot read text"],
    );
    // A token a forward (as decode runs) scores the same text the same, to rounding.
    let one = json(&strata(&[
        "perplexity",
        "--model",
        &tiny(),
        "--text",
        path(&text),
        "--context",
        "64",
        "--forward-rows",
        "1",
        "--json",
    ]));
    assert!((one["perplexity"].as_f64().unwrap() - ppl).abs() < 1e-3 * ppl, "{one} vs {p}");
    assert_one_line_error(
        &strata(&["perplexity", "--model", &tiny(), "--text", path(&text), "--forward-rows", "0"]),
        &["--forward-rows must be at least 1"],
    );

    let report = dir.path().join("report.json");
    let conv = dir.path().join("int8");
    let r = strata(&[
        "convert",
        "--model",
        &tiny(),
        "--out",
        path(&conv),
        "--experts",
        "int8",
        "--report",
        path(&report),
        "--eval-text",
        path(&text),
        "--eval-context",
        "64",
    ]);
    ok(&r);
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["experts"], "int8");
    // The source through the report equals `strata perplexity` on the same windows.
    assert!((r["source_perplexity"].as_f64().unwrap() - ppl).abs() < 1e-6, "{r}");
    let (kl, agree) = (r["mean_kl"].as_f64().unwrap(), r["top1_agreement"].as_f64().unwrap());
    assert!(kl > 0.0 && kl < 0.01 && agree > 0.95, "{r}");
    assert!(r["max_abs_logit_diff"].as_f64().unwrap() > 0.0);
    let e = strata(&[
        "convert",
        "--model",
        &tiny(),
        "--out",
        path(&dir.path().join("x")),
        "--report",
        path(&report),
        "--eval-text",
        "/nonexistent.txt",
    ]);
    assert_one_line_error(&e, &["/nonexistent.txt", "cannot read --eval-text"]);
}

#[test]
fn coupling_and_atlas_pins_on_a_streamed_model() {
    let dir = tempfile::tempdir().unwrap();
    let conv = dir.path().join("bf16");
    ok(&strata(&["convert", "--model", &tiny(), "--out", path(&conv), "--experts", "bf16"]));
    let trace = dir.path().join("trace.txt");
    let stats = dir.path().join("stats.json");
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            path(&conv),
            "--prompt",
            "def read_config(path):\n    \"\"\"Read the configuration file.\"\"\"\n",
            "--max-tokens",
            "48",
            "--budget",
            "92MiB",
            "--context",
            "1024",
            "--usage",
            "off",
            "--stats-json",
            path(&stats),
        ];
        args.extend_from_slice(extra);
        strata(&args)
    };
    ok(&generate(&["--trace", path(&trace)]));
    let c = json(&strata(&["trace", "coupling", "--trace", path(&trace), "--json"]));
    assert_eq!(c["layers"], serde_json::json!([1, 2, 3, 4, 5]));
    assert_eq!(c["by_delta"].as_array().unwrap().len(), 2);
    let d1 = &c["by_delta"][0];
    assert_eq!(d1["delta"], 1);
    let recall = d1["recall"].as_f64().unwrap();
    assert!(recall > 0.125 && recall <= 1.0, "{c}"); // chance is 4 of 32
    assert!(ok(&strata(&["trace", "coupling", "--trace", path(&trace)])).contains("delta 2: recall"));
    assert_one_line_error(
        &strata(&["trace", "coupling", "--trace", path(&trace), "--train-fraction", "1.5"]),
        &["--train-fraction must be in (0, 1)"],
    );

    // Warm start from the shipped atlas: python's experts pinned before the first forward.
    let out = generate(&["--pin-from-atlas", &shipped("atlas.json"), "--topics", "python"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    ok(&out);
    assert!(err.contains("pin-from-atlas: ") && err.contains(" pins (") && err.contains("for python"), "{err}");
    let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let pinned = s["experts"]["slots"]["pinned"].as_u64().unwrap();
    assert!(pinned > 0, "{s}");
    assert!(err.contains(&format!("pin-from-atlas: {pinned} pins")), "{err}");
    assert_one_line_error(
        &generate(&["--pin-from-atlas", &shipped("atlas.json"), "--topics", "cooking"]),
        &["unknown topic \"cooking\"", "bible, dictionary"],
    );
    assert_one_line_error(&generate(&["--pin-from-atlas", "/nonexistent/atlas.json"]), &["cannot read atlas"]);
    let e = strata(&["generate", "--model", &tiny(), "--prompt", "x", "--pin-from-atlas", &shipped("atlas.json")]);
    assert_one_line_error(&e, &["--pin-from-atlas", "needs --budget"]);
}
