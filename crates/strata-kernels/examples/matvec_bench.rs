//! One-row products on small and large bf16/f32 matrices (hot in cache): GB/s of weights.
//! cargo run --release -p strata-kernels --example matvec_bench
use std::time::Instant;
use strata_kernels::{KernelPath, Out, Product, QMatrix, QuantKind, Staging};

fn main() {
    let path = KernelPath::best();
    for &(rows, cols) in &[(8192usize, 256usize), (256, 256), (192, 256), (768, 256), (256, 768), (2048, 6144)] {
        for kind in [QuantKind::Bf16, QuantKind::F32] {
            let payload: Vec<u8> =
                (0..kind.payload_bytes(rows, cols)).map(|i| ((i * 7919) % 251) as u8 & 0x3f).collect();
            let w = QMatrix::new(kind, rows, cols, &payload, &[]);
            let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.01).collect();
            let mut y = vec![0f32; rows];
            let st = Staging::default();
            let p = Product::new(path, &x, 1, w, &st);
            let iters = (200_000_000 / (rows * cols)).max(10);
            let out = Out::write(&mut y, rows);
            for _ in 0..10 {
                p.run(0, rows, &out);
            }
            let t = Instant::now();
            for _ in 0..iters {
                p.run(0, rows, &out);
            }
            let s = t.elapsed().as_secs_f64() / iters as f64;
            println!("{} {rows}x{cols}: {:.2} us, {:.1} GB/s", kind.name(), s * 1e6, w.weight_bytes() as f64 / s / 1e9);
        }
    }
}
