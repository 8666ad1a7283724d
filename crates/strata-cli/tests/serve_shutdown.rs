//! `strata serve` on SIGTERM: stops accepting, ends the running stream properly (final
//! events and `[DONE]`), flushes the usage ledger, exits 0.

#[path = "common/serve.rs"]
mod serve;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

#[test]
fn sigterm_finishes_the_stream_flushes_the_ledger_and_exits_0() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse");
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let args = ["--model", dir.path().to_str().unwrap(), "--port", "0", "--budget", "200MiB", "--context", "256"];
    let (mut child, mut stderr, addr) = serve::start(&args);
    let mut log = String::new();
    let body = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":200,"stream":true,"temperature":0}"#;
    let mut conn = TcpStream::connect(&addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        conn,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Wait for the first generated token (the second event: the first, the role, goes out
    // before the engine admits the request, and a request still waiting for admission is
    // refused at shutdown, not finished), then SIGTERM.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("data: ").count() < 2 {
        let n = conn.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed before any data: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    // SAFETY: plain signal to our own child.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("reading the stream: {e}"),
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("\"finish_reason\":\"stop\"") || text.contains("\"finish_reason\":\"length\""), "{text}");
    // The last event is `[DONE]` (the chunked framing's terminator follows it).
    assert!(text.rsplit("data: ").next().unwrap().starts_with("[DONE]"), "{text}");
    assert!(text.ends_with("0\r\n\r\n"), "the response ended properly: {text}");
    // New connections are refused once the server is stopping or gone.
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "serve did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    stderr.read_to_string(&mut log).unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("SIGTERM: shutting down") && log.contains("stopped"), "{log}");
    assert!(TcpStream::connect(&addr).is_err(), "still accepting after exit");
    let ledger = dir.path().join(".coli_usage");
    let counts = std::fs::read_to_string(&ledger).unwrap_or_else(|e| panic!("{}: {e}\n{log}", ledger.display()));
    assert!(counts.lines().count() > 2, "ledger flushed with counts: {counts}");
}
