//! What verifying expert checksums costs (docs/reliability.md): random O_DIRECT reads of
//! GLM-5-sized int4 expert regions (default 19 MiB) from a scratch file, with and without
//! verification, at the runtime's pool shape (2 workers) and a queue depth of 4.
//!
//! `cargo run --release -p strata-storage --example checksum_cost -- [DIR] [FILE_MIB] [READS]`

use std::io::Write;
use std::time::{Duration, Instant};
use strata_storage::{region_checksum, AlignedBuf, IoPool, ReadCheck, ReadSegment};

const REGION: usize = 19 << 20;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).map_or_else(std::env::temp_dir, Into::into);
    let file_mib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let reads: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(96);
    let path = dir.join(format!("strata-checksum-cost-{}.bin", std::process::id()));
    let regions = (file_mib << 20) / REGION;
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut block = vec![0u8; 1 << 20];
        for _ in 0..regions * REGION / block.len() + 1 {
            for c in block.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes());
            }
            f.write_all(&block).unwrap();
        }
        f.into_inner().unwrap().sync_all().unwrap();
    }
    // Expected sums, from one buffered pass.
    let pool = IoPool::open(&[&path], 2, true).unwrap();
    let mut buf = AlignedBuf::new(REGION).unwrap();
    let seg = |r: usize| ReadSegment { file: 0, offset: (r * REGION) as u64, len: REGION, dest_offset: 0 };
    let sums: Vec<u64> = (0..regions)
        .map(|r| {
            pool.read(vec![seg(r)], buf.as_mut_slice()).unwrap();
            region_checksum(buf.as_slice())
        })
        .collect();
    // Hashing alone, on a buffer that was just read.
    let t = Instant::now();
    for _ in 0..8 {
        std::hint::black_box(region_checksum(buf.as_slice()));
    }
    let hash_gbs = 8.0 * REGION as f64 / t.elapsed().as_secs_f64() / 1e9;
    let bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::new(REGION).unwrap()).collect();
    let mut order: Vec<usize> = (0..reads).map(|i| (i * 7919 + 13) % regions).collect();
    let mut run = |checked: bool| -> (f64, Duration, Duration) {
        order.rotate_left(1);
        let t = Instant::now();
        let (mut service, mut hashing) = (Duration::ZERO, Duration::ZERO);
        for wave in order.chunks(4) {
            let tickets: Vec<_> = wave
                .iter()
                .zip(&bufs)
                .map(|(&r, b)| {
                    let check = checked.then(|| ReadCheck::new(sums[r], format!("region {r}")));
                    // SAFETY: each buffer is used by one ticket at a time and outlives it.
                    unsafe { pool.submit_checked(vec![seg(r)], b.as_ptr() as *mut u8, REGION, check) }
                })
                .collect();
            for tk in tickets {
                let s = tk.wait().unwrap();
                service += s.service;
                hashing += s.checksum;
            }
        }
        let gbs = (reads * REGION) as f64 / t.elapsed().as_secs_f64() / 1e9;
        (gbs, service / reads as u32, hashing / reads as u32)
    };
    println!(
        "regions of {} MiB, {reads} random O_DIRECT reads, 2 workers, depth 4; xxh3 alone {hash_gbs:.1} GB/s",
        REGION >> 20
    );
    for round in 0..3 {
        let (plain, ps, _) = run(false);
        let (checked, cs, ch) = run(true);
        println!(
            "round {round}: unchecked {plain:.2} GB/s (service {:.1} ms/read); checked {checked:.2} GB/s (service {:.1} ms/read, of which hashing {:.2} ms = {:.1}% of the read)",
            ps.as_secs_f64() * 1e3,
            cs.as_secs_f64() * 1e3,
            ch.as_secs_f64() * 1e3,
            100.0 * ch.as_secs_f64() / cs.as_secs_f64()
        );
    }
    let _ = std::fs::remove_file(&path);
}
