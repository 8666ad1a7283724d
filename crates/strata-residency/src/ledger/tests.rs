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
    // Only the ledger is left in the directory: the temp file was renamed.
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from(".coli_usage")]);
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
    let ledger = open_at(&path, false).unwrap().0;
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
fn other_engines_are_refused_unless_named_explicitly_then_warned_once() {
    let text = format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 1 {}\n3 2 4\n", fnv1a32("inkling"));
    let (_dir, path) = dir_with(&text);
    let msg = open_at(&path, false).unwrap_err().to_string();
    assert!(msg.contains("written by inkling, this engine is glm_moe_dsa"), "{msg}");
    let (ledger, warnings) = open_at(&path, true).unwrap();
    assert_eq!(ledger.count(3, 2), 4);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("named it explicitly"));
    let (_, warnings) = open_at(&path, true).unwrap();
    assert!(warnings.is_empty(), "the override warning is printed once");
    // An unknown writer is reported by id.
    let (_dir2, path2) = dir_with(&format!("-1 {N_LAYERS} {N_EXPERTS}\n-2 1 12345\n"));
    let msg = open_at(&path2, false).unwrap_err().to_string();
    assert!(msg.contains("an unknown engine (id 12345)"), "{msg}");
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
fn damaged_files_warn_and_start_fresh() {
    let damaged = ["3 2\n", "3 2 4 5\n", "3 x 4\n", "3 2 -4\n", "1 1 1\ngarbage\n", "-1 4\n"];
    for text in damaged {
        let (_dir, path) = dir_with(text);
        let (mut ledger, warnings) = open_at(&path, false).unwrap();
        assert_eq!(ledger.total_selections(), 0, "{text:?}: partial history kept");
        assert_eq!(warnings.len(), 1, "{text:?}");
        assert!(warnings[0].contains("damaged usage ledger") && warnings[0].contains("line"), "{warnings:?}");
        // The next flush replaces the damaged file.
        ledger.record(1, &[1]);
        ledger.flush().unwrap();
        assert_eq!(open_at(&path, false).unwrap().0.count(1, 1), 1);
    }
    let (_dir, path) = dir_with("");
    fs::write(&path, [0xff, 0xfe, 0x00]).unwrap();
    let (_, warnings) = open_at(&path, false).unwrap();
    assert!(warnings[0].contains("not text"), "{warnings:?}");
    // A directory where the file should be: unreadable, warning, fresh.
    let dir = tempfile::tempdir().unwrap();
    let (_, warnings) = open_at(dir.path(), false).unwrap();
    assert!(warnings[0].contains("cannot read usage ledger"), "{warnings:?}");
}

#[test]
fn counts_saturate_at_u32_max() {
    let max = u32::MAX;
    let (_dir, path) = dir_with(&format!("3 2 {max}\n3 2 5\n3 4 99999999999\n"));
    let (mut ledger, warnings) = open_at(&path, false).unwrap();
    assert!(warnings.is_empty());
    assert_eq!(ledger.count(3, 2), max);
    assert_eq!(ledger.count(3, 4), max);
    ledger.record(3, &[2, 2]);
    assert_eq!(ledger.count(3, 2), max);
    assert_eq!(ledger.total_selections(), 2 * max as u64);
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
