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
        QuantKind::int4(64),
        QuantKind::int4_bf16(64),
        QuantKind::int4_e4m3(64),
        QuantKind::int4(128),
        QuantKind::int4_bf16(128),
        QuantKind::Fp8 { block_rows: 128, block_cols: 128 },
        QuantKind::Mxfp4,
    ] {
        // `experts` experts in distinct device memory (bigger than L2 together). One random
        // expert, quantized once, uploaded `experts` times.
        let mut w = |rows, cols| {
            let v: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.05f32..0.05)).collect();
            let (payload, scales) = quantize(kind, &v, rows, cols);
            HostMatrix { kind, rows, cols, payload, scales }
        };
        let host = [w(inter, hidden), w(inter, hidden), w(hidden, inter)];
        let mats: Vec<[<CudaBackend as Backend>::Mat; 3]> =
            (0..experts).map(|_| host.clone().map(|m| g.matrix(m).unwrap())).collect();
        let bytes: u64 = mats.iter().map(|m| m.iter().map(|x| x.bytes_held()).sum::<u64>()).sum();
        // Decode: one row, `batch` experts on it (top-k); prompts: `batch` experts of `per`
        // rows each in a forward of `batch * per` rows (the many-row kernels: tiles or not).
        for (batch, per) in [(8usize, 0usize), (24, 0), (24, 1), (24, 2), (24, 4), (24, 16)] {
            let xrows = (batch * per).max(1);
            let x = up(g, &rvec(&mut rng, xrows * hidden, 1.0));
            let mut y = g.alloc(batch * per.max(1) * hidden).unwrap();
            let rows: Vec<Vec<u32>> = (0..batch)
                .map(|i| if per == 0 { vec![0] } else { (i * per..(i + 1) * per).map(|r| r as u32).collect() })
                .collect();
            let task = |i: usize| ExpertTask {
                weights: g.expert_ref(&mats[i][0], &mats[i][1], &mats[i][2]),
                rows: Some(&rows[i][..]),
                out_row: i * per.max(1),
                bias: None,
            };
            for _ in 0..3 {
                g.experts(&x, xrows, batch, &task, &mut y);
            }
            g.synchronize();
            let reps = 20;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                g.experts(&x, xrows, batch, &task, &mut y);
            }
            g.synchronize();
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let read = bytes as f64 * batch as f64 / experts as f64;
            let gbs = read / s / 1e9;
            let what = if per == 0 { "decode".to_string() } else { format!("prompt, {per} rows each") };
            eprintln!("experts {} x{batch} ({what}): {:.1} us, {gbs:.0} GB/s", kind.name(), s * 1e6);
            report.insert(format!("{}_x{batch}_rows{per}_gb_per_s", kind.name()), gbs.into());
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
