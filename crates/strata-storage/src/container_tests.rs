use super::*;
use crate::io::{AlignedBuf, IoPool};
use strata_kernels::{dequantize, quantize};

fn weights(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0).collect()
}

type Mats = [(Vec<u8>, Vec<f32>); 3];
type Written = Vec<((String, usize, usize), Mats)>;

fn expert_mats(layout: &ExpertLayout, seed: u32) -> Mats {
    layout.matrices().map(|m| quantize(m.kind, &weights(m.rows * m.cols, seed + m.rows as u32), m.rows, m.cols))
}

fn as_refs(m: &Mats) -> [(&[u8], &[f32]); 3] {
    [(&m[0].0, &m[0].1), (&m[1].0, &m[1].1), (&m[2].0, &m[2].1)]
}

fn build(dir: &Path) -> (ExpertManifest, Written) {
    // down with bf16 scales: both scale types in one region; e4m3 scales in the other tier.
    let main = ExpertLayout::new(QuantKind::int4(32), QuantKind::int4_bf16(8), 96, 40);
    let mtp = ExpertLayout::new(QuantKind::int4_e4m3(16), QuantKind::Int8Row, 96, 40);
    let mut w = ContainerWriter::create(
        dir,
        vec![
            TierSpec { name: "main".into(), layout: main, layers: vec![1, 2, 3], experts_per_layer: 5 },
            TierSpec { name: "mtp".into(), layout: mtp, layers: vec![4], experts_per_layer: 5 },
        ],
    )
    .unwrap();
    w.set_max_file_bytes(4 * main.slot_bytes as u64);
    let mut written = Vec::new();
    // Out of order on purpose.
    for e in (0..5).rev() {
        for l in [3, 1, 2] {
            let m = expert_mats(&main, (l * 10 + e) as u32);
            w.add_expert("main", l, e, as_refs(&m)).unwrap();
            written.push((("main".to_string(), l, e), m));
        }
        let m = expert_mats(&mtp, (100 + e) as u32);
        w.add_expert("mtp", 4, e, as_refs(&m)).unwrap();
        written.push((("mtp".to_string(), 4, e), m));
    }
    (w.finish().unwrap(), written)
}

#[test]
fn layout_is_packed_and_aligned() {
    let l = ExpertLayout::new(QuantKind::int4(64), QuantKind::int4(64), 6144, 2048);
    l.check_packed().unwrap();
    assert_eq!(l.gate.payload_len, 2048 * 3072);
    assert_eq!(l.gate.scales_len, 2048 * 96 * 4);
    assert_eq!(l.down.payload_len, 6144 * 1024);
    assert_eq!(l.down.scales_len, 6144 * 32 * 4);
    assert_eq!(l.slot_bytes % 4096, 0);
    assert!(l.slot_bytes - l.used_bytes() < 4096 + 6 * 64);
    for m in l.matrices() {
        assert_eq!(m.payload_offset % 64, 0);
        assert_eq!(m.scales_offset % 64, 0);
    }
}

#[test]
fn bf16_scales_halve_the_scale_bytes() {
    let f = ExpertLayout::new(QuantKind::int4(128), QuantKind::int4(128), 6144, 2048);
    let b = ExpertLayout::new(QuantKind::int4_bf16(128), QuantKind::int4_bf16(128), 6144, 2048);
    b.check_packed().unwrap();
    assert_eq!(b.gate.scales_len, 2048 * 48 * 2);
    assert_eq!(b.gate.scale_count(), 2048 * 48);
    assert_eq!(b.down.scales_len, 6144 * 16 * 2);
    assert_eq!(f.used_bytes() - b.used_bytes(), (2 * 2048 * 48 + 6144 * 16) * 2);
    // GLM-5's expert: 19.46 MB a slot against 21.23 MB for int4-g64 with f32 scales.
    assert_eq!(b.slot_bytes, 19_464_192);
    let g64 = ExpertLayout::new(QuantKind::int4(64), QuantKind::int4(64), 6144, 2048);
    assert_eq!(g64.slot_bytes, 21_233_664);
}

#[test]
fn e4m3_scales_quarter_the_scale_bytes() {
    let e = ExpertLayout::new(QuantKind::int4_e4m3(64), QuantKind::int4_e4m3(64), 6144, 2048);
    e.check_packed().unwrap();
    // The factor, then a byte a scale.
    assert_eq!(e.gate.scales_len, 4 + 2048 * 96);
    assert_eq!(e.gate.scale_count(), 2048 * 96);
    assert_eq!(e.down.scales_len, 4 + 6144 * 32);
    // GLM-5's expert at g64: int4-g128-bf16's 19,464,192 bytes and one 4 KiB page (the
    // factors take the scales past a page boundary).
    assert_eq!(e.slot_bytes, 19_464_192 + 4096);
}

#[test]
fn a_scale_that_is_not_bf16_is_refused_by_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let l = ExpertLayout::new(QuantKind::int4_bf16(8), QuantKind::int4_bf16(8), 16, 8);
    let mut w = ContainerWriter::create(
        dir.path(),
        vec![TierSpec { name: "main".into(), layout: l, layers: vec![1], experts_per_layer: 1 }],
    )
    .unwrap();
    let mut m = expert_mats(&l, 1);
    m[2].1[3] = 1.0 + 1.0 / 1024.0;
    let err = w.add_expert("main", 1, 0, as_refs(&m)).unwrap_err().to_string();
    assert!(err.contains("layer 1 expert 0 down: int4-g8-bf16: scale 3") && err.contains("not a bf16 value"), "{err}");

    let l = ExpertLayout::new(QuantKind::int4_e4m3(8), QuantKind::int4_e4m3(8), 16, 8);
    let mut w = ContainerWriter::create(
        dir.path().join("e4m3").as_path(),
        vec![TierSpec { name: "main".into(), layout: l, layers: vec![1], experts_per_layer: 1 }],
    )
    .unwrap();
    let mut m = expert_mats(&l, 1);
    m[0].1[2] *= 1.01;
    let err = w.add_expert("main", 1, 0, as_refs(&m)).unwrap_err().to_string();
    assert!(err.contains("layer 1 expert 0 gate: int4-g8-e4m3: scale 2") && err.contains("not an e4m3 value"), "{err}");
}

#[test]
fn round_trip_through_files_and_io_pool() {
    let dir = tempfile::tempdir().unwrap();
    let (m, written) = build(dir.path());
    let back = ExpertManifest::read(dir.path()).unwrap();
    assert_eq!(back, m);
    assert!(m.files.len() > 2, "{:?}", m.files); // split by max_file_bytes
    assert!(m.files.iter().any(|f| f.starts_with("experts/experts-mtp-")));
    let main = m.tier("main").unwrap();
    assert_eq!(main.expert_count(), 15);
    for direct in [true, false] {
        let pool = IoPool::open(&m.file_paths(dir.path()), 2, direct).unwrap();
        for ((tier, l, e), mats) in &written {
            let read = m.expert_read(tier, *l, *e).unwrap();
            assert_eq!(read.segments.len(), 1);
            let mut slot = AlignedBuf::new(read.layout.slot_bytes).unwrap();
            let stats = pool.read(read.segments.clone(), slot.as_mut_slice()).unwrap();
            assert_eq!(stats.bytes as usize, read.layout.slot_bytes);
            for (ml, (payload, scales)) in read.layout.matrices().iter().zip(mats) {
                assert_eq!(ml.payload(slot.as_slice()).unwrap(), &payload[..]);
                let stored = ml.scales(slot.as_slice()).unwrap();
                assert_eq!(stored.scale_type(), ml.kind.scale_type());
                assert_eq!(stored.to_vec(), *scales);
                assert_eq!(ml.scales_vec(slot.as_slice()).unwrap(), *scales);
                assert_eq!(
                    ml.dequantize(slot.as_slice()).unwrap(),
                    dequantize(ml.kind, payload, scales, ml.rows, ml.cols)
                );
            }
        }
    }
    assert!(m.expert_read("main", 4, 0).is_err());
    assert!(m.expert_read("none", 1, 0).is_err());
}

#[test]
fn manifest_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("strata-experts.json: missing"), "{err}");
    let (m, _) = build(dir.path());
    let path = dir.path().join(MANIFEST_FILE);
    let good = std::fs::read_to_string(&path).unwrap();

    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("corrupt manifest"), "{err}");

    std::fs::write(&path, good.replace("\"version\":1", "\"version\":7")).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("manifest version 7 is newer") && err.contains("up to 1"), "{err}");

    let mut bad = m.clone();
    bad.tiers[0].locations[1].offset += 512;
    bad.write(dir.path()).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tier `main` layer 1 expert 1: offset") && err.contains("not 4096-aligned"), "{err}");
    let mut bad = m.clone();
    bad.tiers[0].locations[1] = bad.tiers[0].locations[0];
    bad.write(dir.path()).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("regions of experts #0 and #1 overlap"), "{err}");
    let mut bad = m.clone();
    bad.tiers[1].layout.down.scales_len -= 4;
    bad.write(dir.path()).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tier `mtp`: layout: down: int8 [96, 40] needs"), "{err}");

    std::fs::write(&path, &good).unwrap();
    ExpertManifest::read(dir.path()).unwrap();
    let f0 = dir.path().join(&m.files[0]);
    let len = std::fs::metadata(&f0).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f0).unwrap().set_len(len - 100).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("experts-00000.bin is too short"), "{err}");
    assert!(err.contains(&format!("{} bytes, but its regions extend to byte {len}", len - 100)), "{err}");

    std::fs::remove_file(&f0).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("experts-00000.bin is missing"), "{err}");
}

#[test]
fn writer_rejects_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let layout = ExpertLayout::new(QuantKind::Int8Row, QuantKind::Int8Row, 8, 4);
    let mut w = ContainerWriter::create(
        dir.path(),
        vec![TierSpec { name: "main".into(), layout, layers: vec![1], experts_per_layer: 2 }],
    )
    .unwrap();
    let m = expert_mats(&layout, 1);
    let err = w
        .add_expert("main", 1, 0, [(&m[0].0, &m[0].1), (&m[1].0, &m[1].1), (&m[2].0[1..], &m[2].1)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("down: 31 payload bytes"), "{err}");
    assert!(w.add_expert("main", 2, 0, as_refs(&m)).is_err());
    assert!(w.add_expert("main", 1, 2, as_refs(&m)).is_err());
    w.add_expert("main", 1, 0, as_refs(&m)).unwrap();
    assert!(w.add_expert("main", 1, 0, as_refs(&m)).unwrap_err().to_string().contains("written twice"));
    let err = w.finish().err().unwrap().to_string();
    assert!(err.contains("1 of 2 experts never written (first: layer 1 expert 1)"), "{err}");
    assert!(!ExpertManifest::exists(dir.path()));
}

#[test]
fn regions_carry_checksums_that_catch_in_place_damage() {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().unwrap();
    let (m, _) = build(dir.path());
    let main = m.tier("main").unwrap();
    assert_eq!(main.checksums.len(), main.locations.len());
    let pool = IoPool::open(&m.file_paths(dir.path()), 2, true).unwrap();
    let read = |l: usize, e: usize| {
        let seg = main.read_segment(l, e, 0).unwrap();
        let mut slot = AlignedBuf::new(main.slot_bytes()).unwrap();
        pool.read_checked(vec![seg], slot.as_mut_slice(), main.read_check(l, e))
    };
    for l in [1, 2, 3] {
        for e in 0..5 {
            read(l, e).unwrap();
        }
    }
    // NaNs over expert 3:2's gate payload, same size, in place.
    let loc = main.location(3, 2).unwrap();
    let path = dir.path().join(&m.files[loc.file]);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(loc.offset + main.layout.gate.payload_offset as u64)).unwrap();
    f.write_all(&f32::NAN.to_le_bytes().repeat(64)).unwrap();
    drop(f);
    let err = read(3, 2).unwrap_err().to_string();
    assert!(err.contains(&m.files[loc.file]), "{err}");
    assert!(err.contains("layer 3 expert 2") && err.contains("checksum mismatch"), "{err}");
    // Every other expert still reads; the pool is fine.
    read(3, 1).unwrap();
    read(1, 2).unwrap();
}

#[test]
fn manifests_without_checksums_still_open_unverified() {
    let dir = tempfile::tempdir().unwrap();
    let (m, _) = build(dir.path());
    let path = dir.path().join(MANIFEST_FILE);
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for t in json["tiers"].as_array_mut().unwrap() {
        assert!(t.as_object_mut().unwrap().remove("checksums").is_some());
    }
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    let old = ExpertManifest::read(dir.path()).unwrap();
    assert!(old.tier("main").unwrap().checksums.is_empty());
    assert!(old.tier("main").unwrap().read_check(1, 0).is_none());
    assert_eq!(old.tier("main").unwrap().locations, m.tier("main").unwrap().locations);
    // A checksum list of the wrong length is refused.
    json["tiers"][0]["checksums"] = serde_json::json!([1, 2]);
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    let err = ExpertManifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains("2 checksums for 15 experts"), "{err}");
}

/// Found by review while fuzzing (the fuzzer's text mutations rarely reach 20-digit
/// numbers): sizes and offsets near 2^64 overflowed (a panic with overflow checks, a
/// wrong bound without). Each is now refused with a message. The same files are in
/// fuzz/regressions/container_manifest.
#[test]
fn manifests_with_huge_numbers_are_refused_not_overflowed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/container_manifest");
    for (file, needle) in [
        ("offset-overflow.json", "ends past 2^64"),
        ("shape-overflow.json", "more than 1099511627776 elements"),
        ("payload-offset-overflow.json", "ends at byte 18446744073709551615"),
        ("slot-overflow.json", "ends past 2^64"),
        ("count-overflow.json", "locations for 2 layers x 18446744073709551615 experts"),
    ] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let err = ExpertManifest::parse(&text).unwrap_err().to_string();
        assert!(err.contains(needle), "{file}: {err}");
    }
}
