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

/// Images larger than one CPU forward's 256 rows (`vision-large`: the processor's default
/// budget of 280, 272 soft tokens an image, attended bidirectionally), two in a prompt,
/// through `logits --image`, `generate --chat --image` and `chat --image` over two turns;
/// the chat's first answer is what generate gives for the same conversation.
#[test]
fn images_larger_than_a_forward_run_in_every_command() {
    use std::io::Write;
    let src = fixture("vision-large");
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::os::unix::fs::symlink(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}\
         {% for i in m['content'] %}{% if i['type'] == 'text' %}{{ i['text'] }}{% endif %}{% endfor %}{% endif %}\n\
         {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    )
    .unwrap();
    let (m, img) = (dir.path().to_str().unwrap(), src.join("image.png"));
    let img = img.to_str().unwrap();
    // Two runs of 272 placeholders (500) between <boi> (501) and <eoi> (502).
    let mut ids: Vec<String> = (10..14).map(|i| i.to_string()).collect();
    for _ in 0..2 {
        ids.push("501".into());
        ids.extend(std::iter::repeat_n("500".to_string(), 272));
        ids.push("502".into());
    }
    ids.extend(["30".into(), "31".into()]);
    let s = ok(&strata(&["logits", "--model", m, "--ids", &ids.join(","), "--image", img, "--image", img]));
    let j: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert_eq!(j["logits"].as_array().unwrap().len(), 1);

    let gen = ok(&strata(&[
        "generate",
        "--model",
        m,
        "--chat",
        "--prompt",
        "What is it?",
        "--image",
        img,
        "--image",
        img,
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    ]));
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["chat", "--model", m, "--image", img, "--image", img, "--max-tokens", "6", "--temperature", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"What is it?\nAnd now?\n\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("> ").count(), 3, "two turns then the empty line: {text}");
    let first = text.split("> ").nth(1).unwrap().trim();
    assert_eq!(first, gen.trim(), "chat's first answer vs generate --chat");
}
