//! Crash safety of the usage ledger's atomic flush: a child process (this test binary,
//! re-executed to run the ignored `crash_child` test) flushes a GLM-5-sized ledger in a
//! loop; the parent SIGKILLs it at random moments, 100 times, and after every kill the
//! ledger must parse cleanly and be exactly one of the versions the child wrote.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use strata_residency::UsageLedger;

const CHILD_ENV: &str = "STRATA_LEDGER_CRASH_CHILD";
/// GLM-5 shape: rows 0..=78 (78 = MTP), dense layers 0..=2.
const N_LAYERS: usize = 78;
const N_EXPERTS: usize = 256;

fn sparse_layers() -> Vec<usize> {
    (3..=N_LAYERS).collect()
}

fn open(path: &Path) -> UsageLedger {
    let (ledger, warnings) = UsageLedger::open(path, N_LAYERS, N_EXPERTS, &sparse_layers(), false)
        .unwrap_or_else(|e| panic!("ledger refused: {e}"));
    assert!(warnings.is_empty(), "ledger damaged: {warnings:?}");
    ledger
}

/// Version v of the file: every tracked expert has count v.
fn bump_all(ledger: &mut UsageLedger) {
    let experts: Vec<usize> = (0..N_EXPERTS).collect();
    for layer in sparse_layers() {
        ledger.record(layer, &experts);
    }
}

/// Asserts the file is one whole version and returns it.
fn version_of(path: &Path) -> u32 {
    let ledger = open(path);
    let v = ledger.count(3, 0);
    for layer in sparse_layers() {
        for e in 0..N_EXPERTS {
            assert_eq!(ledger.count(layer, e), v, "mixed versions at {layer}:{e}");
        }
    }
    v
}

/// The child: flush successive versions until killed (or 20 s pass).
#[test]
#[ignore = "run by ledger_survives_random_kills_during_flush"]
fn crash_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else { return };
    let mut ledger = open(Path::new(&path));
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        bump_all(&mut ledger);
        ledger.flush().expect("flush");
    }
}

#[test]
fn ledger_survives_random_kills_during_flush() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(".coli_usage");
    let mut ledger = open(&path);
    bump_all(&mut ledger);
    ledger.flush().unwrap();
    assert_eq!(version_of(&path), 1);

    let exe = std::env::current_exe().unwrap();
    let mut seed = 0x2545_F491_4F6C_DD1Du64 ^ std::process::id() as u64;
    let mut last = 1;
    let started = Instant::now();
    for round in 0..100 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = Duration::from_micros(2_000 + seed % 60_000);
        let mut child = Command::new(&exe)
            .args(["crash_child", "--exact", "--ignored", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        let v = version_of(&path);
        assert!(v >= last, "round {round}: version went back from {last} to {v}");
        last = v;
    }
    // The kills must have landed among real flushes, not only before the first one.
    assert!(last > 20, "only {last} versions written in 100 rounds");
    assert!(started.elapsed() < Duration::from_secs(60));
    eprintln!("100 kills, {last} versions, {:.1} s", started.elapsed().as_secs_f64());
}
