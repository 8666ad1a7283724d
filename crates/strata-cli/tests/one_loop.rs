//! One decode loop: `strata generate` and `strata serve` give the same tokens for the
//! same prompt and seed, with their defaults (MTP `auto` on a model with a draft layer),
//! greedy and sampled.

#[path = "common/serve.rs"]
mod serve;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny")
}

const PROMPT: &str = "The history of the river town begins with";

/// `strata generate`'s text (stdout) for `PROMPT`.
fn generate(extra: &[&str]) -> String {
    let m = tiny();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["generate", "--model", m.to_str().unwrap(), "--prompt", PROMPT, "--max-tokens", "40"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Server {
    let m = tiny();
    let (child, mut stderr, addr) = serve::start(&["--model", m.to_str().unwrap(), "--port", "0"]);
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    Server { child, addr }
}

/// The completion's text for `PROMPT` with `sampling` (JSON fields).
fn complete(s: &Server, sampling: &str) -> String {
    let body = format!(r#"{{"prompt":{},"max_tokens":40,{sampling}}}"#, serde_json::json!(PROMPT));
    let mut conn = TcpStream::connect(&s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        s.addr,
        body.len()
    )
    .unwrap();
    let mut got = String::new();
    conn.read_to_string(&mut got).unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let json = &got[got.find('{').unwrap()..=got.rfind('}').unwrap()];
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {got}"));
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn generate_and_serve_give_the_same_tokens_for_a_seed() {
    let server = serve();
    for (cli, http) in [
        (vec!["--temperature", "0"], r#""temperature":0"#),
        (vec!["--temperature", "0.8", "--seed", "7"], r#""temperature":0.8,"seed":7"#),
        (
            vec!["--temperature", "1.1", "--top-p", "0.9", "--seed", "123"],
            r#""temperature":1.1,"top_p":0.9,"seed":123"#,
        ),
    ] {
        let want = generate(&cli);
        assert!(want.trim().len() > 20, "{cli:?}: {want:?}");
        let got = complete(&server, http);
        assert_eq!(want.trim_end_matches('\n'), got, "{cli:?}: generate against serve");
    }
    // A different seed gives different text (the seed is honoured, not ignored).
    assert_ne!(generate(&["--temperature", "0.8", "--seed", "8"]), generate(&["--temperature", "0.8", "--seed", "7"]));
}
