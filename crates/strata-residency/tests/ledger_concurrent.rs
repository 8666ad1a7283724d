//! Concurrent processes on one model: each process (this test binary re-executed to run
//! the ignored `concurrent_child` test) opens the ledger, records its share of counts and
//! flushes after every batch; afterwards the file must hold every count of every process
//! (flushes merge under the sidecar lock; last-writer-wins would keep one share).

use std::path::Path;
use std::process::{Command, Stdio};

use strata_residency::UsageLedger;

const CHILD_ENV: &str = "STRATA_LEDGER_CONCURRENT_CHILD";
const PROCESSES: usize = 4;
/// Per process: 34 flushes of 20 selections = 680 counts.
const BATCHES: usize = 34;
const PER_BATCH: usize = 20;
const N_LAYERS: usize = 78;
const N_EXPERTS: usize = 256;

fn open(path: &Path) -> UsageLedger {
    let sparse: Vec<usize> = (3..=N_LAYERS).collect();
    let (ledger, warnings) =
        UsageLedger::open(path, N_LAYERS, N_EXPERTS, &sparse, false).unwrap_or_else(|e| panic!("refused: {e}"));
    assert!(warnings.is_empty(), "{warnings:?}");
    ledger
}

#[test]
#[ignore = "run by concurrent_processes_lose_no_count"]
fn concurrent_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let (index, path) = spec.split_once(':').unwrap();
    let index: usize = index.parse().unwrap();
    let mut ledger = open(Path::new(path));
    for batch in 0..BATCHES {
        let experts: Vec<usize> = (0..PER_BATCH).map(|i| (index * 31 + batch * 7 + i) % N_EXPERTS).collect();
        ledger.record(3 + (batch + index) % 10, &experts);
        ledger.flush().expect("flush");
    }
}

#[test]
fn concurrent_processes_lose_no_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(".coli_usage");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|i| {
            Command::new(&exe)
                .args(["concurrent_child", "--exact", "--ignored", "--test-threads=1"])
                .env(CHILD_ENV, format!("{i}:{}", path.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    let ledger = open(&path);
    assert_eq!(ledger.total_selections(), (PROCESSES * BATCHES * PER_BATCH) as u64, "2,720 counts expected");
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp."))
        .collect();
    assert!(left.is_empty(), "temp files left: {left:?}");
}
