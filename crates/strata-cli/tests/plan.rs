//! One memory plan for every command: on strata-tiny (experts streamed from its
//! autoconverted container, a draft layer), `strata fit` accepts exactly the budgets
//! `generate` and `serve` run with, and loads the draft layer exactly where they do, with
//! `--mtp` on, off and auto, at budgets walked across each boundary a few KiB at a time.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn strata(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

/// strata-tiny's files linked into a temporary directory (the container and ledger that
/// running writes land there, not in the checkout).
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

struct Case<'a> {
    model: &'a Path,
    mtp: &'a str,
}

impl Case<'_> {
    fn args(&self, budget: u64) -> Vec<String> {
        let m = self.model.to_str().unwrap();
        ["--model", m, "--budget", &budget.to_string(), "--context", "1024", "--mtp", self.mtp, "--usage", "off"]
            .map(String::from)
            .to_vec()
    }

    /// `strata fit --json`: (fits, draft layer loaded).
    fn fit(&self, budget: u64) -> (bool, bool) {
        let mut a = vec!["fit".to_string()];
        a.extend(self.args(budget));
        a.push("--json".into());
        let out = strata(&a.iter().map(String::as_str).collect::<Vec<_>>());
        // A plan that does not fit is printed, then refused (exit 1).
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("fit {budget}: {e}: {}", String::from_utf8_lossy(&out.stderr)));
        let fits = v["report"]["fits"].as_bool().unwrap();
        assert_eq!(out.status.success(), fits, "fit {budget}: {}", String::from_utf8_lossy(&out.stderr));
        (fits, v["draft_layer"]["loaded"].as_bool().unwrap())
    }

    /// `strata generate` of one token: (ran, draft layer loaded), with the error when not.
    fn generate(&self, budget: u64) -> (bool, bool, String) {
        let stats = tempfile::NamedTempFile::new().unwrap();
        let mut a: Vec<String> =
            ["generate", "--prompt", "The old house", "--max-tokens", "2", "--stats-json"].map(String::from).to_vec();
        a.push(stats.path().to_str().unwrap().into());
        a.extend(self.args(budget));
        let out = strata(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        if !out.status.success() {
            return (false, false, err);
        }
        let s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(stats.path()).unwrap()).unwrap();
        (true, !s["mtp"].is_null(), err)
    }

    /// `strata serve`: whether it starts (says it is listening) or exits refusing.
    fn serve_starts(&self, budget: u64) -> bool {
        use std::io::BufRead;
        let mut a = vec!["serve".to_string(), "--port".into(), "0".into()];
        a.extend(self.args(budget));
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(&a)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let listening = lines.any(|l| l.is_ok_and(|l| l.contains("listening on")));
        let _ = child.kill();
        let status = child.wait().unwrap();
        listening || status.success()
    }

    /// The least budget at which `pred` holds (it holds from there on).
    fn boundary(&self, pred: impl Fn(u64) -> bool) -> u64 {
        let (mut lo, mut hi) = (1u64 << 20, 1u64 << 30);
        assert!(pred(hi) && !pred(lo));
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if pred(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi
    }
}

#[test]
fn fit_generate_and_serve_agree_across_budgets() {
    let dir = tiny_copy();
    let model: PathBuf = dir.path().to_path_buf();
    for mtp in ["off", "on", "auto"] {
        let case = Case { model: &model, mtp };
        let fits = case.boundary(|b| case.fit(b).0);
        let mut edges = vec![fits];
        if mtp == "auto" {
            edges.push(case.boundary(|b| case.fit(b).1));
        }
        for edge in edges {
            for delta in [-65536i64, -4096, -1, 0, 1, 4096, 65536] {
                let budget = (edge as i64 + delta) as u64;
                let (fit_ok, fit_draft) = case.fit(budget);
                let (ran, draft, err) = case.generate(budget);
                assert_eq!(ran, fit_ok, "--mtp {mtp} --budget {budget}: fit says {fit_ok}, generate ran {ran}: {err}");
                if ran {
                    assert_eq!(draft, fit_draft, "--mtp {mtp} --budget {budget}: draft layer, fit vs generate");
                } else {
                    assert!(err.contains("strata fit"), "a refusal names the plan: {err}");
                }
                if delta.abs() <= 1 {
                    assert_eq!(case.serve_starts(budget), fit_ok, "--mtp {mtp} --budget {budget}: serve vs fit");
                }
            }
        }
    }
    // The draft layer costs slots: with it, the smallest plan needs more bytes.
    let on = Case { model: &model, mtp: "on" };
    let off = Case { model: &model, mtp: "off" };
    assert!(on.boundary(|b| on.fit(b).0) > off.boundary(|b| off.fit(b).0));
}
