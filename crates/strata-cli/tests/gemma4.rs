//! `strata` on the Gemma 4 fixtures: inspect, logits, generate (resident and streamed
//! from a converted container), fit; `--image` refused by name, for a checkpoint with a
//! vision tower and for a text-only one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma4").join(name)
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn one_line_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

#[test]
fn gemma4_commands_work_on_the_fixtures() {
    let dense = fixture("dense-ple");
    let moe = fixture("moe");
    let (d, m) = (dense.to_str().unwrap(), moe.to_str().unwrap());
    let s = ok(&strata(&["inspect", "--model", d, "--json"]));
    assert!(s.contains("per_layer_inputs") && s.contains("kv_shared_layers"), "{s}");
    let s = ok(&strata(&["inspect", "--model", m]));
    assert!(s.contains("routed_experts") && s.contains("router"), "{s}");

    let s = ok(&strata(&["logits", "--model", d, "--ids", "5,6,7,8,9,10,11,12,13,14", "--all-positions"]));
    let v: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(v["logits"].as_array().unwrap().len(), 10);
    assert_eq!(v["logits"][0].as_array().unwrap().len(), 512);

    let greedy = |model: &str, budget: Option<&str>| {
        let mut args = vec!["generate", "--model", model, "--prompt", "You may convey verbatim copies of it"];
        args.extend(["--max-tokens", "20", "--temperature", "0"]);
        if let Some(b) = budget {
            args.extend(["--budget", b]);
        }
        ok(&strata(&args))
    };
    assert!(!greedy(d, None).trim().is_empty());
    // Streamed from an f32 container: the resident model's greedy text exactly.
    let out = tempfile::tempdir().unwrap();
    let o = out.path().join("c");
    ok(&strata(&["convert", "--model", m, "--out", o.to_str().unwrap(), "--experts", "f32"]));
    assert_eq!(greedy(o.to_str().unwrap(), Some("40MiB")), greedy(m, None));
    let s = ok(&strata(&["fit", "--model", o.to_str().unwrap(), "--budget", "64MiB"]));
    assert!(s.contains("fits: yes"), "{s}");
}

#[test]
fn images_are_refused_by_name() {
    let d = fixture("dense-ple");
    let err =
        one_line_error(&strata(&["generate", "--model", d.to_str().unwrap(), "--prompt", "hi", "--image", "cat.png"]));
    assert!(err.contains("--image cat.png") && err.contains("no vision tower"), "{err}");
    // A `gemma4` checkpoint that declares a vision tower: refused, saying so.
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("moe")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let cfg = dir.path().join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["vision_config"] = serde_json::json!({"model_type": "gemma4_vision", "hidden_size": 32});
    std::fs::write(&cfg, c.to_string()).unwrap();
    let p = dir.path().to_str().unwrap();
    let err = one_line_error(&strata(&["logits", "--model", p, "--ids", "1,2", "--image", "x.jpg"]));
    assert!(err.contains("has a vision tower") && err.contains("refused"), "{err}");
    let s = ok(&strata(&["inspect", "--model", p]));
    assert!(s.contains("present, not run"), "{s}");
}
