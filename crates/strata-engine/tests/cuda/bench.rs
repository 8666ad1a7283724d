//! Throughput of the expert products on GLM-5 shapes (run with --ignored).

use super::*;

#[test]
#[ignore]
fn cuda_kernel_bandwidth() {
    let Some(g) = gpu() else { return };
    let mut rng = Rand::seed_from_u64(9);
    let (hidden, inter, experts) = (6144usize, 2048usize, 24usize);
    let mut report = serde_json::Map::new();
    for kind in [
        QuantKind::Bf16,
        QuantKind::Int8Row,
        QuantKind::Int4Group { group: 64 },
        QuantKind::Fp8 { block_rows: 128, block_cols: 128 },
    ] {
        // `experts` experts in distinct device memory (bigger than L2 together), one row
        // each: decode. One random expert, quantized once, uploaded `experts` times.
        let mut w = |rows, cols| {
            let v: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.05f32..0.05)).collect();
            let (payload, scales) = quantize(kind, &v, rows, cols);
            HostMatrix { kind, rows, cols, payload, scales }
        };
        let host = [w(inter, hidden), w(inter, hidden), w(hidden, inter)];
        let mats: Vec<[<CudaBackend as Backend>::Mat; 3]> =
            (0..experts).map(|_| host.clone().map(|m| g.matrix(m).unwrap())).collect();
        let bytes: u64 = mats.iter().map(|m| m.iter().map(|x| x.bytes_held()).sum::<u64>()).sum();
        for batch in [8usize, 24] {
            let x = up(g, &rvec(&mut rng, batch * hidden, 1.0));
            let mut y = g.alloc(batch * hidden).unwrap();
            let rows: Vec<Vec<u32>> = (0..batch).map(|i| vec![i as u32]).collect();
            let task = |i: usize| ExpertTask {
                weights: g.expert_ref(&mats[i][0], &mats[i][1], &mats[i][2]),
                rows: Some(&rows[i][..]),
                out_row: i,
            };
            for _ in 0..3 {
                g.experts(&x, batch, batch, &task, &mut y);
            }
            g.synchronize();
            let reps = 20;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                g.experts(&x, batch, batch, &task, &mut y);
            }
            g.synchronize();
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let read = bytes as f64 * batch as f64 / experts as f64;
            let gbs = read / s / 1e9;
            eprintln!("experts {} x{batch} (one row each): {:.1} us, {gbs:.0} GB/s", kind.name(), s * 1e6);
            report.insert(format!("{}_x{batch}_gb_per_s", kind.name()), gbs.into());
        }
    }
    // Device-to-device copy: the HBM ceiling (bytes read + written).
    let n = 1usize << 28;
    let a = g.alloc(n).unwrap();
    let mut b = g.alloc(n).unwrap();
    g.add(n, &a, &mut b);
    g.synchronize();
    let t = std::time::Instant::now();
    for _ in 0..10 {
        g.add(n, &a, &mut b);
    }
    g.synchronize();
    let s = t.elapsed().as_secs_f64() / 10.0;
    let gbs = (3 * 4 * n) as f64 / s / 1e9;
    eprintln!("add over 1 GiB buffers (read 2, write 1): {gbs:.0} GB/s");
    report.insert("add_stream_gb_per_s".into(), gbs.into());
    println!("KERNEL_BANDWIDTH {}", serde_json::Value::Object(report));
}
