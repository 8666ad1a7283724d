use super::*;
use std::io::Write;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed as u32) as u8 ^ (i >> 12) as u8).collect()
}

fn temp_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
    p
}

#[test]
fn pool_and_tickets_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<IoPool>();
    send_sync::<AlignedBuf>();
    send::<ReadTicket>();
}

#[test]
fn aligned_buf_is_aligned_and_zeroed() {
    for len in [0usize, 1, 4095, 4096, 10_000] {
        let mut b = AlignedBuf::new(len).unwrap();
        assert_eq!(b.len(), len);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice().fill(7);
        assert_eq!(b.as_mut_ptr() as usize % ALIGN, 0);
    }
    // Locking works or fails with the limit named (a large buffer usually exceeds
    // an unprivileged RLIMIT_MEMLOCK).
    for len in [4096usize, 256 << 20] {
        let mut b = AlignedBuf::new(len).unwrap();
        match b.mlock() {
            Ok(()) => assert!(b.is_locked()),
            Err(e) => {
                assert!(!b.is_locked());
                assert!(e.to_string().contains("RLIMIT_MEMLOCK soft limit"), "{e}");
            }
        }
    }
}

fn reads_back(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let a = pattern(64 * 1024, 1);
    let b = pattern(3 * 4096 + 100, 2); // last page partial
    let pa = temp_file(dir.path(), "a.bin", &a);
    let pb = temp_file(dir.path(), "b.bin", &b);
    let pool = IoPool::open(&[pa, pb], 2, direct).unwrap();
    assert_eq!(pool.workers(), 2);
    let mut buf = AlignedBuf::new(5 * 4096).unwrap();
    let segs = vec![
        ReadSegment { file: 0, offset: 8192, len: 8192, dest_offset: 0 },
        // Covering read of the partial last page: overhang reads as zeros.
        ReadSegment { file: 1, offset: 8192, len: 8192, dest_offset: 8192 },
        // Unaligned segment: served buffered in a direct pool.
        ReadSegment { file: 0, offset: 5, len: 77, dest_offset: 16384 + 3 },
    ];
    buf.as_mut_slice().fill(0xee);
    let stats = pool.read(segs, buf.as_mut_slice()).unwrap();
    let s = buf.as_slice();
    assert_eq!(&s[..8192], &a[8192..16384]);
    assert_eq!(&s[8192..8192 + 4196], &b[8192..]);
    assert!(s[8192 + 4196..16384].iter().all(|&x| x == 0));
    assert_eq!(&s[16387..16387 + 77], &a[5..82]);
    assert_eq!(stats.bytes, 8192 + 8192 + 77);
    assert!(stats.ops >= 3);
    if direct && pool.is_direct() {
        assert_eq!(stats.buffered_ops, 1, "{stats:?}");
    } else {
        assert_eq!(stats.buffered_ops, 0);
    }
    // Many concurrent tickets.
    let mut bufs: Vec<AlignedBuf> = (0..16).map(|_| AlignedBuf::new(4096).unwrap()).collect();
    let tickets: Vec<ReadTicket> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| unsafe {
            pool.submit(
                vec![ReadSegment { file: 0, offset: (i * 4096) as u64, len: 4096, dest_offset: 0 }],
                b.as_mut_ptr(),
                b.len(),
            )
        })
        .collect();
    for t in tickets {
        t.wait().unwrap();
    }
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(b.as_slice(), &a[i * 4096..(i + 1) * 4096]);
    }
    assert_eq!(pool.hint_willneed(&[ReadSegment { file: 1, offset: 0, len: 4096, dest_offset: 0 }]), 1);
}

#[test]
fn direct_reads() {
    reads_back(true);
}

#[test]
fn buffered_reads() {
    reads_back(false);
}

#[test]
fn invalid_requests_fail_their_ticket_only() {
    let dir = tempfile::tempdir().unwrap();
    let p = temp_file(dir.path(), "a.bin", &pattern(16384, 3));
    let pool = IoPool::open(&[p], 1, true).unwrap();
    let mut buf = AlignedBuf::new(8192).unwrap();
    let nine = vec![ReadSegment { file: 0, offset: 0, len: 16, dest_offset: 0 }; 9];
    let err = pool.read(nine, buf.as_mut_slice()).unwrap_err().to_string();
    assert!(err.contains("at most 8 segments"), "{err}");
    let err = pool
        .read(vec![ReadSegment { file: 3, offset: 0, len: 16, dest_offset: 0 }], buf.as_mut_slice())
        .unwrap_err()
        .to_string();
    assert!(err.contains("file #3"), "{err}");
    let err = pool
        .read(vec![ReadSegment { file: 0, offset: 0, len: 4096, dest_offset: 8000 }], buf.as_mut_slice())
        .unwrap_err()
        .to_string();
    assert!(err.contains("overflows the 8192-byte buffer"), "{err}");
    let err = pool
        .read(vec![ReadSegment { file: 0, offset: 16384, len: 4096, dest_offset: 0 }], buf.as_mut_slice())
        .unwrap_err()
        .to_string();
    assert!(err.contains("a.bin: read of 4096 bytes at offset 16384 lies past the end"), "{err}");
    pool.read(vec![ReadSegment { file: 0, offset: 4096, len: 4096, dest_offset: 0 }], buf.as_mut_slice()).unwrap();
}

fn truncated_under_reader(direct: bool) {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(64 * 1024, 4);
    let p = temp_file(dir.path(), "experts.bin", &data);
    let pool = IoPool::open(std::slice::from_ref(&p), 2, direct).unwrap();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(16 * 1024).unwrap();
    let mut buf = AlignedBuf::new(8192).unwrap();
    let err = pool
        .read(vec![ReadSegment { file: 0, offset: 32768, len: 8192, dest_offset: 0 }], buf.as_mut_slice())
        .unwrap_err()
        .to_string();
    assert!(err.contains("experts.bin"), "{err}");
    assert!(err.contains("short read of 8192 bytes at offset 32768"), "{err}");
    // Straddling the new end: partial data, still an error.
    let err = pool
        .read(vec![ReadSegment { file: 0, offset: 12288, len: 8192, dest_offset: 0 }], buf.as_mut_slice())
        .unwrap_err()
        .to_string();
    assert!(err.contains("got 4096 bytes"), "{err}");
    // The pool keeps working.
    pool.read(vec![ReadSegment { file: 0, offset: 4096, len: 8192, dest_offset: 0 }], buf.as_mut_slice()).unwrap();
    assert_eq!(buf.as_slice(), &data[4096..12288]);
}

#[test]
fn truncated_file_fails_the_ticket_and_the_pool_recovers_direct() {
    truncated_under_reader(true);
}

#[test]
fn truncated_file_fails_the_ticket_and_the_pool_recovers_buffered() {
    truncated_under_reader(false);
}

#[test]
fn refused_o_direct_falls_back_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(8192, 5);
    let p1 = temp_file(dir.path(), "a.bin", &data);
    let p2 = temp_file(dir.path(), "b.bin", &data);
    SIMULATE_EINVAL.with(|c| c.set(true));
    let pool = IoPool::open(&[p1, p2], 1, true);
    SIMULATE_EINVAL.with(|c| c.set(false));
    let pool = pool.unwrap();
    assert!(!pool.is_direct());
    let mut buf = AlignedBuf::new(8192).unwrap();
    let stats =
        pool.read(vec![ReadSegment { file: 1, offset: 0, len: 8192, dest_offset: 0 }], buf.as_mut_slice()).unwrap();
    assert_eq!(buf.as_slice(), &data[..]);
    assert_eq!(stats.buffered_ops, stats.ops);
    let w = pool.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("a.bin: the filesystem refuses O_DIRECT"), "{w:?}");
}

#[test]
fn dropping_a_ticket_waits_for_the_read() {
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(1 << 20, 6);
    let p = temp_file(dir.path(), "a.bin", &data);
    let pool = IoPool::open(&[p], 2, false).unwrap();
    let mut buf = AlignedBuf::new(1 << 20).unwrap();
    let t = unsafe {
        pool.submit(vec![ReadSegment { file: 0, offset: 0, len: 1 << 20, dest_offset: 0 }], buf.as_mut_ptr(), buf.len())
    };
    drop(t);
    assert_eq!(buf.as_slice(), &data[..]);
}
