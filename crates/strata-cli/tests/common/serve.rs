//! `strata serve` started for a test: the child, its log and the address it listens on.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStderr, Command, Stdio};

/// Starts `strata serve ARGS` (give `--port 0`) and waits for its "listening on" line;
/// returns the child, the rest of its log and the address. Panics, with the log so far,
/// if it exits first.
pub fn start(args: &[&str]) -> (Child, BufReader<ChildStderr>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("serve")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut log = String::new();
    let addr = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "serve exited early: {log}");
        log.push_str(&line);
        if let Some(at) = line.find("listening on http://") {
            break line[at + "listening on http://".len()..].trim().to_string();
        }
    };
    (child, stderr, addr)
}
