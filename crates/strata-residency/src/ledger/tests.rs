use super::*;

/// GLM-5-like shape in miniature: layers 0..=4, dense 0, sparse 1..=3, MTP row 4.
const N_LAYERS: usize = 4;
const N_EXPERTS: usize = 8;
const SPARSE: [usize; 4] = [1, 2, 3, 4];

fn open_at(path: &Path, explicit: bool) -> Result<(UsageLedger, Vec<String>), LedgerError> {
    UsageLedger::open(path, N_LAYERS, N_EXPERTS, &SPARSE, explicit)
}

fn dir_with(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(".coli_usage");
    fs::write(&path, text).unwrap();
    (dir, path)
}

fn glm_header() -> String {
    format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 1 {}\n", fnv1a32(GLM_ENGINE))
}

#[test]
fn fnv1a32_matches_the_reference_vectors() {
    assert_eq!(fnv1a32(""), 0x811c_9dc5);
    assert_eq!(fnv1a32("a"), 0xe40c_292c);
    assert_eq!(fnv1a32("foobar"), 0xbf9c_f968);
    assert_ne!(fnv1a32(GLM_ENGINE), fnv1a32("inkling"));
}

#[test]
fn round_trip_writes_the_c_engine_format() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(".coli_usage");
    let (mut ledger, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty());
    ledger.record(3, &[5, 1, 5]);
    ledger.record(1, &[0]);
    assert!(ledger.flush().unwrap());
    assert!(!ledger.flush().unwrap(), "clean ledger is not rewritten");
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(text, format!("{}1 0 1\n3 1 1\n3 5 2\n", glm_header()));
    let (reopened, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(reopened.count(3, 5), 2);
    assert_eq!(reopened.count(3, 1), 1);
    assert_eq!(reopened.count(1, 0), 1);
    assert_eq!(reopened.total_selections(), 4);
    assert_eq!(reopened.heat(3, 5), 0, "heat is session state, not persisted");
    // Only the ledger and its lock file are left: the temp file was renamed.
    let mut names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert_eq!(names, vec![std::ffi::OsString::from(".coli_usage"), std::ffi::OsString::from(".coli_usage.lock")]);
}

#[test]
fn every_selection_is_counted_before_dedup() {
    let (_dir, path) = dir_with("");
    let (mut ledger, _) = open_at(&path, false).unwrap();
    // Two rows of one forward both chose expert 2.
    ledger.record(2, &[2, 7, 2, 3]);
    assert_eq!(ledger.count(2, 2), 2);
    assert_eq!(ledger.snapshot().session_selections, 4);
    assert_eq!(ledger.clock(), 4);
}

#[test]
fn an_empty_history_is_a_zero_byte_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("u");
    let mut ledger = open_at(&path, false).unwrap().0;
    ledger.write_atomically().unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"");
    let (again, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty());
    assert_eq!(again.total_selections(), 0);
}

#[test]
fn legacy_headerless_files_are_accepted() {
    let (_dir, path) = dir_with("3 2 4\n4 1 9\r\n\n  2 7 1  \n");
    let (ledger, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!((ledger.count(3, 2), ledger.count(4, 1), ledger.count(2, 7)), (4, 9, 1));
    assert_eq!(ledger.ranked_counts(), vec![((4, 1), 9), ((3, 2), 4), ((2, 7), 1)]);
}

#[test]
fn dimension_mismatch_is_refused_naming_both_sides() {
    let (_dir, path) = dir_with("-1 78 256\n3 2 4\n");
    let err = open_at(&path, false).unwrap_err();
    let LedgerError::Refused(msg) = &err else { panic!("{err:?}") };
    assert!(msg.contains("78 layers x 256 experts"), "{msg}");
    assert!(msg.contains(&format!("{N_LAYERS} x {N_EXPERTS}")), "{msg}");
    // Explicit naming does not bypass the dimension check.
    assert!(open_at(&path, true).is_err());
}

#[test]
fn newer_format_versions_are_refused() {
    let (_dir, path) = dir_with(&format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 2 {}\n", fnv1a32(GLM_ENGINE)));
    let msg = open_at(&path, true).unwrap_err().to_string();
    assert!(msg.contains("format version 2, this build reads 1"), "{msg}");
}

#[test]
fn other_engines_are_refused_even_when_named_unless_imported() {
    let text = format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 1 {}\n3 2 4\n", fnv1a32("inkling"));
    let (_dir, path) = dir_with(&text);
    for explicit in [false, true] {
        let msg = open_at(&path, explicit).unwrap_err().to_string();
        assert!(msg.contains("written by inkling, this engine is glm_moe_dsa"), "{msg}");
        assert!(msg.contains("--usage-import"), "{msg}");
    }
    assert_eq!(fs::read_to_string(&path).unwrap(), text, "a refused file is left alone");
    let import = LedgerOpen { explicit: true, allow_foreign: true };
    let (mut ledger, warnings) =
        UsageLedger::open_with(GLM_ENGINE, &path, N_LAYERS, N_EXPERTS, &SPARSE, import).unwrap();
    assert_eq!(ledger.count(3, 2), 4);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("importing its counts"), "{warnings:?}");
    // The next save writes it as ours, counts kept.
    ledger.record(3, &[2]);
    assert!(ledger.flush().unwrap());
    assert_eq!(fs::read_to_string(&path).unwrap(), format!("{}3 2 5\n", glm_header()));
    assert_eq!(open_at(&path, false).unwrap().0.count(3, 2), 5);
    // An unknown writer is reported by id.
    let (_dir2, path2) = dir_with(&format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 1 12345\n"));
    let msg = open_at(&path2, false).unwrap_err().to_string();
    assert!(msg.contains("an unknown engine (id 12345)"), "{msg}");
}

#[test]
fn a_foreign_file_appearing_before_a_flush_is_not_overwritten() {
    let (_dir, path) = dir_with("");
    let (mut ledger, _) = open_at(&path, false).unwrap();
    ledger.record(3, &[1]);
    let foreign = format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 1 {}\n3 2 4\n", fnv1a32("kimi_k3"));
    fs::write(&path, &foreign).unwrap();
    let err = ledger.flush().unwrap_err().to_string();
    assert!(err.contains("written by kimi_k3"), "{err}");
    assert_eq!(fs::read_to_string(&path).unwrap(), foreign);
}

#[test]
fn reserved_headers_are_skipped_and_untracked_records_dropped() {
    let text = format!("{}-3 9 9\n-7 0 1\n0 1 5\n3 8 2\n9 0 1\n3 -1 4\n3 3 6\n", glm_header());
    let (_dir, path) = dir_with(&text);
    let (mut ledger, warnings) = open_at(&path, false).unwrap();
    assert_eq!(ledger.count(3, 3), 6);
    assert_eq!(ledger.count(0, 1), 0, "dense layer 0 has no row");
    assert_eq!(ledger.total_selections(), 6);
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("dropped 4 records"), "{warnings:?}");
    // Dropped records are not written back.
    ledger.record(3, &[3]);
    ledger.flush().unwrap();
    assert_eq!(fs::read_to_string(&path).unwrap(), format!("{}3 3 7\n", glm_header()));
}

#[test]
fn damaged_lines_are_reported_by_number_and_readable_records_kept() {
    let cases: [(&str, &str); 7] = [
        ("3 2\n1 1 1\n", "line 1: expected `<layer> <expert> <count>`, found 2 fields"),
        ("1 1 1\n3 2 4 5\n", "line 2: expected"),
        ("1 1 1\n3 x 4\n", "line 2: invalid second field \"x\""),
        ("1 1 1\n3 2 -4\n", "line 2: negative count \"-4\""),
        ("1 1 1\ngarbage\n", "line 2: expected"),
        ("-1 4\n1 1 1\n", "line 1: expected"),
        ("1 1 1\n\u{1}\u{2}\u{3} 4 4\n", "line 2: invalid layer"),
    ];
    for (text, needle) in cases {
        let (dir, path) = dir_with(text);
        let (mut ledger, warnings) = open_at(&path, false).unwrap();
        assert_eq!(ledger.count(1, 1), 1, "{text:?}: readable record lost");
        assert_eq!(ledger.total_selections(), 1, "{text:?}");
        assert_eq!(warnings.len(), 2, "{text:?}: {warnings:?}");
        assert!(warnings[0].contains("damaged usage ledger") && warnings[0].contains(needle), "{warnings:?}");
        assert!(warnings[0].contains("kept the 1 readable records"), "{warnings:?}");
        assert!(warnings[1].contains("kept as") && warnings[1].contains(".coli_usage.damaged-"), "{warnings:?}");
        // The damaged file is kept byte for byte; the ledger holds the readable records.
        let aside: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(".coli_usage.damaged-"))
            .collect();
        assert_eq!(aside.len(), 1, "{text:?}");
        assert_eq!(fs::read_to_string(&aside[0]).unwrap(), text);
        assert_eq!(fs::read_to_string(&path).unwrap(), format!("{}1 1 1\n", glm_header()));
        // Later flushes keep the history and the aside copy.
        ledger.record(1, &[1]);
        ledger.flush().unwrap();
        let (again, warnings) = open_at(&path, false).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(again.count(1, 1), 2);
        assert!(aside[0].exists());
    }
    // Not text at all: every line is damage, nothing is lost but the file is kept.
    let (dir, path) = dir_with("");
    fs::write(&path, [0xff, 0xfe, 0x00]).unwrap();
    let (_, warnings) = open_at(&path, false).unwrap();
    assert!(warnings[0].contains("line 1: not text"), "{warnings:?}");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 3, "ledger, lock file, damaged copy");
    // A directory where the file should be: unreadable, warning, left alone.
    let dir = tempfile::tempdir().unwrap();
    let (mut ledger, warnings) = open_at(dir.path(), false).unwrap();
    assert!(warnings[0].contains("cannot read usage ledger"), "{warnings:?}");
    ledger.record(1, &[1]);
    assert!(!ledger.flush().unwrap());
    assert!(dir.path().is_dir());
}

#[test]
fn damage_appearing_on_disk_is_set_aside_at_the_next_flush() {
    let (dir, path) = dir_with(&format!("{}2 2 2\n", glm_header()));
    let (mut ledger, _) = open_at(&path, false).unwrap();
    fs::write(&path, format!("{}2 2 3\n## torn\n", glm_header())).unwrap();
    ledger.record(2, &[2]);
    assert!(ledger.flush().unwrap());
    let warnings = ledger.take_warnings();
    assert!(warnings.len() == 1 && warnings[0].contains("line 4: expected"), "{warnings:?}");
    assert_eq!(ledger.count(2, 2), 4, "disk's readable 3 + this session's 1");
    let names: Vec<String> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().any(|n| n.starts_with(".coli_usage.damaged-")), "{names:?}");
}

#[test]
fn read_only_ledgers_are_left_alone_with_one_warning() {
    use std::os::unix::fs::PermissionsExt;
    let text = format!("{}3 3 3\n", glm_header());
    let (_dir, path) = dir_with(&text);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o444)).unwrap();
    let (mut ledger, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(ledger.is_read_only());
    assert_eq!(ledger.count(3, 3), 3);
    ledger.record(3, &[3]);
    let err = ledger.flush().unwrap_err().to_string();
    assert!(err.contains("read-only") && err.contains(".coli_usage"), "{err}");
    ledger.record(3, &[3]);
    assert!(!ledger.flush().unwrap(), "one warning, then no-ops");
    assert_eq!(fs::read_to_string(&path).unwrap(), text);
    assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o444, "mode unchanged");
    // A damaged read-only file is not set aside either.
    let (dir, path) = dir_with(&format!("{text}junk\n"));
    fs::set_permissions(&path, fs::Permissions::from_mode(0o400)).unwrap();
    let (ledger, warnings) = open_at(&path, false).unwrap();
    assert_eq!(ledger.count(3, 3), 3);
    assert!(warnings[1].contains("read-only"), "{warnings:?}");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_writable_ledger_keeps_its_mode() {
    use std::os::unix::fs::PermissionsExt;
    let (_dir, path) = dir_with(&format!("{}3 3 3\n", glm_header()));
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    let (mut ledger, _) = open_at(&path, false).unwrap();
    ledger.record(3, &[3]);
    assert!(ledger.flush().unwrap());
    assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
}

#[test]
fn concurrent_ledgers_lose_no_count() {
    // Separate ledger instances (separate lock descriptors) flushing concurrently, as
    // separate processes would; tests/ledger_concurrent.rs does it with processes.
    const WRITERS: usize = 4;
    const ROUNDS: usize = 17;
    let (_dir, path) = dir_with(&format!("{}3 0 100\n", glm_header()));
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let path = path.clone();
            s.spawn(move || {
                let (mut ledger, _) = open_at(&path, false).unwrap();
                for round in 0..ROUNDS {
                    ledger.record(3, &[0, 1 + w % 3]);
                    ledger.record(1, &[round % N_EXPERTS]);
                    ledger.flush().unwrap();
                }
            });
        }
    });
    let (ledger, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(ledger.count(3, 0), 100 + (WRITERS * ROUNDS) as u32);
    assert_eq!(ledger.total_selections(), 100 + (3 * WRITERS * ROUNDS) as u64);
}

#[test]
fn stale_temp_files_are_removed_by_the_next_flush() {
    let (dir, path) = dir_with("");
    // A dead owner (pid far above pid_max), our own leftover, and an unrelated file.
    let dead = dir.path().join(".coli_usage.tmp.2147483646.0");
    let ours = dir.path().join(format!(".coli_usage.tmp.{}.99", std::process::id()));
    let unrelated = dir.path().join(".coli_usage.tmp.notes");
    for p in [&dead, &ours, &unrelated] {
        fs::write(p, "x").unwrap();
    }
    // A live owner's fresh temp (pid 1 exists) is left alone.
    let live = dir.path().join(".coli_usage.tmp.1.0");
    fs::write(&live, "x").unwrap();
    let (mut ledger, _) = open_at(&path, false).unwrap();
    ledger.record(1, &[1]);
    ledger.flush().unwrap();
    assert!(!dead.exists() && !ours.exists());
    assert!(unrelated.exists() && live.exists());
    assert!(ledger.take_warnings()[0].contains("removed 2 temp files"));
}

#[test]
fn counts_saturate_at_u32_max() {
    let max = u32::MAX;
    let text = format!(
        "3 2 {max}\n3 2 5\n3 4 99999999999\n3 5 9223372036854775809\n3 6 18446744073709551617\n\
         3 7 +123456789012345678901234567890\n"
    );
    let (_dir, path) = dir_with(&text);
    let (mut ledger, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(ledger.count(3, 2), max);
    assert_eq!(ledger.count(3, 4), max);
    assert_eq!(ledger.count(3, 5), max, "2^63 + 1");
    assert_eq!(ledger.count(3, 6), max, "above 2^64: saturates like the rest, not damage");
    assert_eq!(ledger.count(3, 7), max);
    ledger.record(3, &[2, 2]);
    assert_eq!(ledger.count(3, 2), max);
    assert_eq!(ledger.total_selections(), 5 * max as u64);
}

#[test]
fn heat_decays_and_lfru_scores_heat_then_recency() {
    let (_dir, path) = dir_with("");
    let (mut ledger, _) = open_at(&path, false).unwrap();
    ledger.record(2, &[1, 1, 1, 1]); // clock 1..=4, heat 4, last 4
    ledger.record(2, &[2]); // clock 5, heat 1, last 5
    assert_eq!(ledger.lfru_score((2, 1)), 4 * 256 + (255 - 1));
    assert_eq!(ledger.lfru_score((2, 2)), 256 + 255);
    assert_eq!(ledger.lfru_score((2, 3)), 255 - 5, "never used: age = clock");
    ledger.decay_heat();
    assert_eq!((ledger.heat(2, 1), ledger.heat(2, 2)), (2, 0));
    assert_eq!(ledger.count(2, 1), 4, "decay leaves counts alone");
    for _ in 0..300 {
        ledger.record(3, &[0]);
    }
    assert_eq!(ledger.lfru_score((2, 1)), 2 * 256, "recency term floors at 0");
    assert_eq!(ledger.lfru_score((0, 0)), 0, "untracked layer");
}

#[test]
fn untracked_selections_are_ignored_and_counted() {
    let (_dir, path) = dir_with("");
    let (mut ledger, _) = open_at(&path, false).unwrap();
    ledger.record(0, &[1, 2]); // dense
    ledger.record(9, &[1]); // beyond n_layers
    ledger.record(3, &[N_EXPERTS]); // bad expert
    let snap = ledger.snapshot();
    assert_eq!((snap.ignored_selections, snap.session_selections, snap.dirty), (4, 0, false));
    assert_eq!(ledger.layers(), SPARSE.to_vec());
}

#[test]
fn invalid_configurations_are_rejected() {
    assert!(UsageLedger::new(GLM_ENGINE, "x", 4, 0, &[1]).is_err());
    let err = UsageLedger::new(GLM_ENGINE, "x", 4, 8, &[5]).unwrap_err();
    assert!(err.to_string().contains("beyond n_layers 4"), "{err}");
}
