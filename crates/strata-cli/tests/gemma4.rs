//! `strata` on the Gemma 4 fixtures: inspect, logits, generate (resident and streamed
//! from a converted container), fit; `--image` through the vision tower (logits with the
//! placeholder run checked against the processor, generate, the bidirectional-vision
//! model), refused by name for a text-only model.

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
fn images_run_through_the_vision_tower_or_are_refused_by_name() {
    let d = fixture("dense-ple");
    let err =
        one_line_error(&strata(&["generate", "--model", d.to_str().unwrap(), "--prompt", "hi", "--image", "cat.png"]));
    assert!(err.contains("--image") && err.contains("no vision tower"), "{err}");

    let v = fixture("vision");
    let (vs, img) = (v.to_str().unwrap(), v.join("image.png"));
    let img = img.to_str().unwrap();
    // The fixture's prompt: text, <boi> (501), 60 image tokens (500), <eoi> (502), text.
    let mut ids: Vec<String> = (10..20).map(|i| i.to_string()).collect();
    ids.push("501".into());
    ids.extend(std::iter::repeat_n("500".to_string(), 60));
    ids.extend(["502".into(), "30".into(), "31".into()]);
    let s = ok(&strata(&["logits", "--model", vs, "--ids", &ids.join(","), "--image", img, "--all-positions"]));
    let j: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(j["logits"].as_array().unwrap().len(), ids.len());
    // A run of the wrong length fails, saying what the processor gives.
    let short = ids.iter().filter(|t| *t != "500").cloned().collect::<Vec<_>>().join(",");
    let err = one_line_error(&strata(&["logits", "--model", vs, "--ids", &short, "--image", img]));
    assert!(err.contains("60 soft tokens"), "{err}");
    let out = ok(&strata(&["generate", "--model", vs, "--prompt", "Look:", "--image", img, "--max-tokens", "8"]));
    assert!(!out.trim().is_empty());
    let err = one_line_error(&strata(&["generate", "--model", vs, "--prompt", "x", "--image", "/nonexistent.png"]));
    assert!(err.contains("nonexistent.png"), "{err}");

    // `use_bidirectional_attention: "vision"`: the image sees itself on sliding layers, so
    // the same ids give other logits.
    let b = fixture("vision-bidir");
    let s2 = ok(&strata(&["logits", "--model", b.to_str().unwrap(), "--ids", &ids.join(","), "--image", img]));
    let j2: serde_json::Value = serde_json::from_str(&s2).unwrap();
    assert_eq!(j2["logits"].as_array().unwrap().len(), 1);
    let s = ok(&strata(&["inspect", "--model", b.to_str().unwrap()]));
    assert!(s.contains("bidirectional within an image"), "{s}");
}
