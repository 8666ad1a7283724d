use super::*;
use crate::quant::{dequantize, quantize, ScaleType};
use rand::{Rng, SeedableRng};

fn paths() -> Vec<KernelPath> {
    [KernelPath::Scalar, KernelPath::Avx2Fma, KernelPath::Avx512].into_iter().filter(|p| p.is_available()).collect()
}

/// Random values in ±[0.05, 1.5] (never zero).
fn nonzero(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(0.05f32..1.5);
            if rng.random_bool(0.5) {
                m
            } else {
                -m
            }
        })
        .collect()
}

struct Owned {
    kind: QuantKind,
    rows: usize,
    cols: usize,
    payload: Vec<u8>,
    scales: Vec<f32>,
    /// The scales' bf16 bit patterns where `kind` stores them so.
    bf16: Vec<u16>,
    /// The stored region (factor, codes) where `kind` stores e4m3 scales.
    e4m3: Vec<u8>,
    /// The codes where `kind` stores e8m0 scales (MXFP4).
    e8m0: Vec<u8>,
}
impl Owned {
    fn new(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let w = nonzero(&mut rng, rows * cols);
        let (payload, scales) = quantize(kind, &w, rows, cols);
        let stored = crate::quant::encode_scales(kind, &scales).unwrap();
        let (mut bf16, mut e4m3, mut e8m0) = (Vec::new(), Vec::new(), Vec::new());
        match kind.scale_type() {
            ScaleType::Bf16 => bf16 = stored.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
            ScaleType::E4m3 => e4m3 = stored,
            ScaleType::E8m0 => e8m0 = stored,
            ScaleType::F32 => {}
        }
        Self { kind, rows, cols, payload, scales, bf16, e4m3, e8m0 }
    }
    fn q(&self) -> QMatrix<'_> {
        let scales = match self.kind.scale_type() {
            ScaleType::F32 => Scales::F32(&self.scales),
            ScaleType::Bf16 => Scales::Bf16(&self.bf16),
            ScaleType::E4m3 => Scales::e4m3(&self.e4m3).unwrap(),
            ScaleType::E8m0 => Scales::E8m0(&self.e8m0),
        };
        QMatrix::new(self.kind, self.rows, self.cols, &self.payload, scales)
    }
    /// The same values with the scales stored as f32.
    fn f32_twin(&self) -> QMatrix<'_> {
        QMatrix::new(self.kind.with_f32_scales(), self.rows, self.cols, &self.payload, &self.scales)
    }
    fn dense(&self) -> Vec<f32> {
        dequantize(self.kind, &self.payload, &self.scales, self.rows, self.cols)
    }
}

/// f64 reference and the bound sum |w x| for each output.
fn reference(w: &[f32], out: usize, cols: usize, x: &[f32], rows: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut y, mut b) = (vec![0f64; rows * out], vec![0f64; rows * out]);
    for r in 0..rows {
        for o in 0..out {
            for i in 0..cols {
                let p = w[o * cols + i] as f64 * x[r * cols + i] as f64;
                y[r * out + o] += p;
                b[r * out + o] += p.abs();
            }
        }
    }
    (y, b)
}

fn kinds(cols: usize) -> Vec<QuantKind> {
    let mut k = vec![QuantKind::F32, QuantKind::Bf16, QuantKind::Int8Row];
    for g in [16, 32, 64, 128, 2, 6, 10, cols + cols % 2] {
        k.push(QuantKind::int4(g));
    }
    for g in [32, 128, 6] {
        k.push(QuantKind::int4_bf16(g));
        k.push(QuantKind::int4_e4m3(g));
    }
    for (br, bc) in [(128, 128), (1, 16), (3, 32), (2, 5), (4, 48)] {
        k.push(QuantKind::Fp8 { block_rows: br, block_cols: bc });
    }
    if cols.is_multiple_of(32) {
        k.push(QuantKind::Mxfp4);
    }
    k
}

/// MXFP4 (gpt-oss's experts) on every path, for one row and many, against the f64
/// product of the plain decoder's values; every FP4 code and scales far from 1 occur.
#[test]
fn mxfp4_matches_the_plain_decoder() {
    for (si, &(out, cols)) in [(37usize, 64usize), (9, 32), (16, 2880), (24, 96), (5, 608)].iter().enumerate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(500 + si as u64);
        // Groups of very different magnitudes, so the scales span many powers of two.
        let w: Vec<f32> = nonzero(&mut rng, out * cols)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi(((i / 32) % 13) as i32 - 6))
            .collect();
        let kind = QuantKind::Mxfp4;
        let (payload, scales) = quantize(kind, &w, out, cols);
        let codes = crate::quant::encode_scales(kind, &scales).unwrap();
        assert_eq!(crate::quant::decode_scales(kind, &codes), scales);
        let mut seen = [false; 16];
        for b in &payload {
            seen[(b & 15) as usize] = true;
            seen[(b >> 4) as usize] = true;
        }
        assert!(seen.iter().skip(1).filter(|s| **s).count() >= 14, "most FP4 codes occur: {seen:?}");
        let dense = dequantize(kind, &payload, &scales, out, cols);
        // Quantized within half FP4's coarsest step (1 at the top of the range) of each group.
        for (o, (d, v)) in dense.iter().zip(&w).enumerate() {
            let s = scales[(o / cols) * (cols / 32) + (o % cols) / 32];
            assert!((d - v).abs() <= s, "[{o}] {v} became {d} at scale {s}");
        }
        let q = QMatrix::new(kind, out, cols, &payload, Scales::E8m0(&codes));
        for rows in [1usize, 2, 5, 8, 13] {
            let x = nonzero(&mut rng, rows * cols);
            let (want, bound) = reference(&dense, out, cols, &x, rows);
            for path in paths() {
                let mut y = vec![f32::NAN; rows * out];
                qmatmul_with(path, &x, rows, &q, &mut y);
                for i in 0..rows * out {
                    let err = (y[i] as f64 - want[i]).abs();
                    assert!(
                        err <= 1e-5 * bound[i],
                        "mxfp4 {path:?} {out}x{cols} rows={rows} [{i}]: {} vs {}",
                        y[i],
                        want[i]
                    );
                }
            }
        }
    }
}

const SHAPES: [(usize, usize); 5] = [(37, 150), (19, 200), (9, 7), (16, 64), (24, 1)];

#[test]
fn qmatmul_matches_f64_reference() {
    for (si, &(out, cols)) in SHAPES.iter().enumerate() {
        for kind in kinds(cols) {
            let m = Owned::new(kind, out, cols, 100 + si as u64);
            let dense = m.dense();
            for rows in [1usize, 3, 8, 11, 16] {
                let mut rng = rand::rngs::StdRng::seed_from_u64(7 + rows as u64);
                let x = nonzero(&mut rng, rows * cols);
                let (want, bound) = reference(&dense, out, cols, &x, rows);
                for path in paths() {
                    let mut y = vec![f32::NAN; rows * out];
                    qmatmul_with(path, &x, rows, &m.q(), &mut y);
                    for i in 0..rows * out {
                        let err = (y[i] as f64 - want[i]).abs();
                        assert!(
                            err <= 1e-5 * bound[i],
                            "{} {path:?} {out}x{cols} rows={rows} [{i}]: got {} want {} (bound {})",
                            kind.name(),
                            y[i],
                            want[i],
                            bound[i]
                        );
                    }
                }
            }
        }
    }
}

/// int4 with bf16 or e4m3 scales computes exactly what the same values with f32 scales
/// do, on every path, for one row and many, groups that fill SIMD chunks and groups that
/// do not.
#[test]
fn bf16_and_e4m3_scales_equal_their_f32_twin_bit_for_bit() {
    for (si, &(out, cols)) in [(37usize, 150usize), (16, 64), (24, 2100), (9, 384)].iter().enumerate() {
        for g in [16, 32, 64, 128, 6, cols + cols % 2] {
            for kind in [QuantKind::int4_bf16(g), QuantKind::int4_e4m3(g)] {
                let m = Owned::new(kind, out, cols, 300 + si as u64);
                let mut rounded = m.scales.clone();
                crate::quant::round_scales(kind, &mut rounded);
                assert_eq!(rounded, m.scales, "{}: the scales are values of their type", kind.name());
                for rows in [1usize, 3, 8, 11] {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(9 + rows as u64);
                    let x = nonzero(&mut rng, rows * cols);
                    for path in paths() {
                        let (mut a, mut b) = (vec![f32::NAN; rows * out], vec![f32::NAN; rows * out]);
                        qmatmul_with(path, &x, rows, &m.q(), &mut a);
                        qmatmul_with(path, &x, rows, &m.f32_twin(), &mut b);
                        assert!(
                            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{} {path:?} {out}x{cols} rows={rows}",
                            kind.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "scales stored as F32")]
fn bf16_kind_with_f32_scales_panics() {
    let m = Owned::new(QuantKind::int4_bf16(32), 4, 64, 1);
    QMatrix::new(m.kind, 4, 64, &m.payload, &m.scales);
}

/// Wide rows: several column blocks per tile (blocks are 1024 columns at 8 rows, 8192
/// at one row), groups larger than a block, and a tail.
#[test]
fn long_rows_with_column_blocks() {
    for &(out, cols) in &[(10usize, 2100usize), (5, 8300)] {
        for kind in [
            QuantKind::F32,
            QuantKind::Bf16,
            QuantKind::Int8Row,
            QuantKind::int4(16),
            QuantKind::int4(64),
            QuantKind::int4(2048),
            QuantKind::int4(cols),
        ] {
            let m = Owned::new(kind, out, cols, 17);
            let dense = m.dense();
            let rows = 16;
            let mut rng = rand::rngs::StdRng::seed_from_u64(23);
            let x = nonzero(&mut rng, rows * cols);
            let (want, bound) = reference(&dense, out, cols, &x, rows);
            for path in paths() {
                let mut y = vec![f32::NAN; rows * out];
                qmatmul_with(path, &x, rows, &m.q(), &mut y);
                for i in 0..rows * out {
                    let err = (y[i] as f64 - want[i]).abs();
                    assert!(err <= 1e-5 * bound[i], "{} {path:?} {out}x{cols} [{i}]", kind.name());
                }
                for (a, b) in [(0usize, 1usize), (5, 6), (3, 6), (1, 9)] {
                    let mut sub = vec![0f32; (b - a) * out];
                    qmatmul_with(path, &x[a * cols..b * cols], b - a, &m.q(), &mut sub);
                    assert_eq!(sub, y[a * out..b * out], "{} {path:?} {out}x{cols} rows {a}..{b}", kind.name());
                }
            }
        }
    }
}

#[test]
fn a_row_alone_equals_the_row_in_a_batch_bit_for_bit() {
    for (si, &(out, cols)) in SHAPES.iter().enumerate() {
        for kind in kinds(cols) {
            let m = Owned::new(kind, out, cols, 200 + si as u64);
            let rows = 13;
            let mut rng = rand::rngs::StdRng::seed_from_u64(9);
            let x = nonzero(&mut rng, rows * cols);
            for path in paths() {
                let mut batch = vec![0f32; rows * out];
                qmatmul_with(path, &x, rows, &m.q(), &mut batch);
                for r in 0..rows {
                    let mut alone = vec![0f32; out];
                    qmatmul_with(path, &x[r * cols..(r + 1) * cols], 1, &m.q(), &mut alone);
                    assert_eq!(
                        alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        batch[r * out..(r + 1) * out].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{} {path:?} {out}x{cols} row {r}",
                        kind.name()
                    );
                }
                // Any sub-batch too (different tile shapes).
                for (a, b) in [(2usize, 5usize), (4, 7), (0, 9)] {
                    let mut sub = vec![0f32; (b - a) * out];
                    qmatmul_with(path, &x[a * cols..b * cols], b - a, &m.q(), &mut sub);
                    assert_eq!(sub, batch[a * out..b * out], "{} {path:?} rows {a}..{b}", kind.name());
                }
            }
        }
    }
}

/// Runs `w x` on a pool of `threads`, each thread taking its static share of outputs.
fn pooled(pool: &crate::pool::ThreadPool, path: KernelPath, x: &[f32], rows: usize, w: &QMatrix) -> Vec<u32> {
    let mut y = vec![0f32; rows * w.rows];
    let mut st = Staging::default();
    st.prepare(path, x, rows, w.kind, w.cols);
    let p = Product::new(path, x, rows, *w, &st);
    let out = Out::write(&mut y, w.rows);
    pool.run(&|c| {
        let r = output_share(w.rows, c.n, c.id);
        p.run(r.start, r.end, &out);
    });
    y.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn thread_count_and_repetition_do_not_change_results() {
    let (out, cols) = (300, 200);
    let one = crate::pool::ThreadPool::new(1);
    let many = crate::pool::ThreadPool::new(5);
    for kind in [
        QuantKind::F32,
        QuantKind::Bf16,
        QuantKind::Int8Row,
        QuantKind::int4(64),
        QuantKind::Fp8 { block_rows: 128, block_cols: 128 },
    ] {
        let m = Owned::new(kind, out, cols, 5);
        for rows in [1usize, 3, 8] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(rows as u64);
            let x = nonzero(&mut rng, rows * cols);
            for path in paths() {
                let a = pooled(&one, path, &x, rows, &m.q());
                assert_eq!(a, pooled(&many, path, &x, rows, &m.q()), "{} {path:?} rows={rows}", kind.name());
                assert_eq!(a, pooled(&many, path, &x, rows, &m.q()), "{} {path:?} rows={rows} (repeat)", kind.name());
            }
        }
    }
}

#[test]
fn accumulating_output_adds_to_what_is_there() {
    let (out, cols, rows) = (40, 96, 3);
    let m = Owned::new(QuantKind::Bf16, out, cols, 8);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let x = nonzero(&mut rng, rows * cols);
    let base = nonzero(&mut rng, rows * out);
    for path in paths() {
        let mut y = vec![0f32; rows * out];
        qmatmul_with(path, &x, rows, &m.q(), &mut y);
        let mut acc = base.clone();
        let st = Staging::default();
        let p = Product::new(path, &x, rows, m.q(), &st);
        p.run(0, out, &Out::add(&mut acc, out));
        for i in 0..rows * out {
            assert_eq!(acc[i], base[i] + y[i], "{path:?} [{i}]");
        }
    }
}

#[test]
fn scalar_and_simd_paths_agree() {
    let simd: Vec<KernelPath> = paths().into_iter().filter(|p| *p != KernelPath::Scalar).collect();
    if simd.is_empty() {
        eprintln!("no SIMD path available: only the scalar path is tested");
    }
    for (si, &(out, cols)) in SHAPES.iter().chain(&[(12, 2100), (40, 96)]).enumerate() {
        for kind in kinds(cols) {
            let m = Owned::new(kind, out, cols, 300 + si as u64);
            let rows = 5;
            let mut rng = rand::rngs::StdRng::seed_from_u64(3);
            let x = nonzero(&mut rng, rows * cols);
            let (_, bound) = reference(&m.dense(), out, cols, &x, rows);
            let mut a = vec![0f32; rows * out];
            qmatmul_with(KernelPath::Scalar, &x, rows, &m.q(), &mut a);
            for &path in &simd {
                let mut b = vec![0f32; rows * out];
                qmatmul_with(path, &x, rows, &m.q(), &mut b);
                for i in 0..rows * out {
                    assert!(
                        (a[i] as f64 - b[i] as f64).abs() <= 2e-5 * bound[i],
                        "{} {path:?} {out}x{cols} [{i}]: {} vs {}",
                        kind.name(),
                        a[i],
                        b[i]
                    );
                }
            }
        }
    }
}

fn silu64(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

#[test]
fn swiglu_matches_reference_and_composition() {
    let (hidden, inter) = (150usize, 72usize);
    for kind in [
        QuantKind::F32,
        QuantKind::Bf16,
        QuantKind::Int8Row,
        QuantKind::int4(32),
        QuantKind::int4(6),
        QuantKind::int4(150),
    ] {
        let down_kind = match kind {
            QuantKind::Int4Group { group: 150, .. } => QuantKind::int4(72),
            k => k,
        };
        let g = Owned::new(kind, inter, hidden, 1);
        let u = Owned::new(kind, inter, hidden, 2);
        let d = Owned::new(down_kind, hidden, inter, 3);
        let (gd, ud, dd) = (g.dense(), u.dense(), d.dense());
        for rows in [1usize, 3, 8] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(40 + rows as u64);
            let x = nonzero(&mut rng, rows * hidden);
            // f64 reference.
            let (gr, _) = reference(&gd, inter, hidden, &x, rows);
            let (ur, _) = reference(&ud, inter, hidden, &x, rows);
            let h: Vec<f64> = gr.iter().zip(&ur).map(|(g, u)| silu64(*g) * u).collect();
            for path in paths() {
                let mut y = vec![0f32; rows * hidden];
                swiglu_expert_with(path, &x, rows, &g.q(), &u.q(), &d.q(), &mut y);
                for r in 0..rows {
                    for o in 0..hidden {
                        let (mut want, mut bound) = (0f64, 0f64);
                        for i in 0..inter {
                            let p = dd[o * inter + i] as f64 * h[r * inter + i];
                            want += p;
                            bound += p.abs();
                        }
                        let got = y[r * hidden + o] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * bound,
                            "{} {path:?} rows={rows} ({r},{o}): {got} vs {want}",
                            kind.name()
                        );
                    }
                }
                // Same bits as the unfused composition.
                let (mut gy, mut uy, mut y2) =
                    (vec![0f32; rows * inter], vec![0f32; rows * inter], vec![0f32; rows * hidden]);
                qmatmul_with(path, &x, rows, &g.q(), &mut gy);
                qmatmul_with(path, &x, rows, &u.q(), &mut uy);
                let hh: Vec<f32> = gy.iter().zip(&uy).map(|(g, u)| u * silu(*g)).collect();
                qmatmul_with(path, &hh, rows, &d.q(), &mut y2);
                assert_eq!(y, y2, "{} {path:?} rows={rows}", kind.name());
                // And a row alone equals the row in the batch.
                let mut alone = vec![0f32; hidden];
                swiglu_expert_with(path, &x[..hidden], 1, &g.q(), &u.q(), &d.q(), &mut alone);
                assert_eq!(alone, y[..hidden], "{} {path:?}", kind.name());
            }
        }
    }
}

#[test]
fn batched_experts_equal_single_calls_bit_for_bit() {
    let (hidden, inter) = (150usize, 72usize);
    let kinds = [QuantKind::int4(32), QuantKind::Int8Row, QuantKind::Bf16, QuantKind::int4(6)];
    let experts: Vec<(Owned, Owned, Owned)> = kinds
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let dk = if matches!(k, QuantKind::Int4Group { .. }) { QuantKind::int4(24) } else { k };
            let s = 10 * i as u64;
            (Owned::new(k, inter, hidden, s), Owned::new(k, inter, hidden, s + 1), Owned::new(dk, hidden, inter, s + 2))
        })
        .collect();
    let rows = [1usize, 3, 0, 8];
    let mut rng = rand::rngs::StdRng::seed_from_u64(77);
    let xs: Vec<Vec<f32>> = rows.iter().map(|&r| nonzero(&mut rng, r * hidden)).collect();
    let pools = [1usize, 4].map(crate::pool::ThreadPool::new);
    for path in paths() {
        let single: Vec<Vec<f32>> = (0..4)
            .map(|i| {
                let (g, u, d) = &experts[i];
                let mut y = vec![0f32; rows[i] * hidden];
                swiglu_expert_with(path, &xs[i], rows[i], &g.q(), &u.q(), &d.q(), &mut y);
                y
            })
            .collect();
        for pool in &pools {
            // All experts over one stacked x, each on its own rows, outputs stacked.
            let x: Vec<f32> = xs.concat();
            let idx: Vec<Vec<u32>> = {
                let mut at = 0u32;
                rows.iter()
                    .map(|&r| {
                        let v = (at..at + r as u32).collect();
                        at += r as u32;
                        v
                    })
                    .collect()
            };
            let total: usize = rows.iter().sum();
            let mut out_row = 0;
            let jobs: Vec<ExpertJob> = (0..4)
                .map(|i| {
                    let (g, u, d) = &experts[i];
                    let j = ExpertJob { gate: g.q(), up: u.q(), down: d.q(), rows: Some(&idx[i]), out_row, bias: None };
                    out_row += rows[i];
                    j
                })
                .collect();
            let mut y = vec![f32::NAN; total * hidden];
            let mut runner = ExpertRunner::default();
            for _ in 0..2 {
                runner.run(pool, path, &x, total, &jobs, &mut y);
                assert_eq!(y, single.concat(), "{path:?} {} threads", pool.threads());
            }
        }
    }
}

#[test]
fn empty_shapes_are_fine() {
    let m = Owned::new(QuantKind::Int8Row, 4, 10, 1);
    let mut y = vec![];
    qmatmul(&[], 0, &m.q(), &mut y);
    let z = QMatrix::new(QuantKind::F32, 0, 10, &[], &[]);
    qmatmul(&[1.0; 10], 1, &z, &mut y);
    let e = QMatrix::new(QuantKind::int4(8), 3, 0, &[], &[]);
    let mut y = vec![f32::NAN; 6];
    qmatmul(&[], 2, &e, &mut y);
    assert_eq!(y, vec![0.0; 6]);
}

#[test]
#[should_panic(expected = "payload is 39 bytes, expected 40")]
fn wrong_payload_size_panics() {
    let m = Owned::new(QuantKind::Int8Row, 4, 10, 1);
    QMatrix::new(m.kind, 4, 10, &m.payload[..39], &m.scales);
}

#[test]
#[should_panic(expected = "3 scales, expected 4")]
fn wrong_scale_count_panics() {
    let m = Owned::new(QuantKind::Int8Row, 4, 10, 1);
    QMatrix::new(m.kind, 4, 10, &m.payload, &m.scales[..3]);
}

#[test]
#[should_panic(expected = "x has 9 values, expected 1 rows x 10 cols")]
fn wrong_x_len_panics() {
    let m = Owned::new(QuantKind::Bf16, 4, 10, 1);
    let mut y = vec![0f32; 4];
    qmatmul(&[1.0; 9], 1, &m.q(), &mut y);
}

#[test]
#[should_panic(expected = "y has 5 values, expected 1 rows x 4 outputs")]
fn wrong_y_len_panics() {
    let m = Owned::new(QuantKind::Bf16, 4, 10, 1);
    let mut y = vec![0f32; 5];
    qmatmul(&[1.0; 10], 1, &m.q(), &mut y);
}

#[test]
#[should_panic(expected = "expected gate = up = [inter, hidden]")]
fn swiglu_shape_mismatch_panics() {
    let g = Owned::new(QuantKind::F32, 4, 10, 1);
    let d = Owned::new(QuantKind::F32, 10, 5, 1);
    let mut y = vec![0f32; 10];
    swiglu_expert(&[1.0; 10], 1, &g.q(), &g.q(), &d.q(), &mut y);
}

fn gelu64(g: f64) -> f64 {
    0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
}

/// `GateAct::apply` in f64.
fn act64(act: GateAct, g: f64, u: f64) -> f64 {
    match act {
        GateAct::Silu => g / (1.0 + (-g).exp()) * u,
        GateAct::GeluTanh => gelu64(g) * u,
        GateAct::SwigluClamped { alpha, limit } => {
            let (alpha, limit) = (alpha as f64, limit as f64);
            let g = g.min(limit);
            (u.clamp(-limit, limit) + 1.0) * g / (1.0 + (-alpha * g).exp())
        }
    }
}

/// The GELU-tanh gate (Gemma's experts and MLP) and gpt-oss's clamped SwiGLU (a limit
/// the random products cross both ways) against an f64 reference, and equal to their
/// unfused composition bit for bit, on every path and a gathered-rows job.
#[test]
fn gelu_and_clamped_gated_experts_match_reference_and_composition() {
    for act in [GateAct::GeluTanh, GateAct::SwigluClamped { alpha: 1.702, limit: 0.6 }] {
        gated_experts_match(act, false);
    }
    // gpt-oss: the clamped gate with expert biases.
    gated_experts_match(GateAct::SwigluClamped { alpha: 1.702, limit: 0.6 }, true);
}

fn gated_experts_match(act: GateAct, biased: bool) {
    let (hidden, inter) = (96usize, 40usize);
    for kind in [QuantKind::F32, QuantKind::Bf16, QuantKind::Int8Row, QuantKind::int4(32)] {
        let g = Owned::new(kind, inter, hidden, 11);
        let u = Owned::new(kind, inter, hidden, 12);
        let d = Owned::new(kind, hidden, inter, 13);
        let (gd, ud, dd) = (g.dense(), u.dense(), d.dense());
        let rows = 5usize;
        let mut rng = rand::rngs::StdRng::seed_from_u64(77);
        let x: Vec<f32> = nonzero(&mut rng, rows * hidden).iter().map(|v| v * 3.0).collect();
        let (gr, _) = reference(&gd, inter, hidden, &x, rows);
        let (ur, _) = reference(&ud, inter, hidden, &x, rows);
        let bias_of = |seed| -> Vec<f32> { nonzero(&mut rand::rngs::StdRng::seed_from_u64(seed), inter.max(hidden)) };
        let (bg, bu, bd) = (bias_of(5), bias_of(6), bias_of(7));
        let bias = biased.then(|| ExpertBias { gate: &bg[..inter], up: &bu[..inter], down: &bd[..hidden] });
        let b = |v: &[f32], i: usize| if biased { v[i] as f64 } else { 0.0 };
        let h: Vec<f64> =
            (0..rows * inter).map(|k| act64(act, gr[k] + b(&bg, k % inter), ur[k] + b(&bu, k % inter))).collect();
        if let GateAct::SwigluClamped { limit, .. } = act {
            let l = limit as f64;
            assert!(gr.iter().any(|&g| g > l) && ur.iter().any(|&u| u > l) && ur.iter().any(|&u| u < -l), "clamped");
        }
        let picked = [4u32, 1, 3];
        for path in paths() {
            let mut y = vec![0f32; (rows + picked.len()) * hidden];
            let all = ExpertJob { gate: g.q(), up: u.q(), down: d.q(), rows: None, out_row: 0, bias };
            let jobs = [all, ExpertJob { rows: Some(&picked[..]), out_row: rows, ..all }];
            let mut runner = ExpertRunner::default();
            runner.run_act(global(), path, act, &x, rows, 2, &|j| jobs[j], &mut y);
            for r in 0..rows {
                for o in 0..hidden {
                    let (mut want, mut bound) = (b(&bd, o), b(&bd, o).abs());
                    for i in 0..inter {
                        let p = dd[o * inter + i] as f64 * h[r * inter + i];
                        want += p;
                        bound += p.abs();
                    }
                    let got = y[r * hidden + o] as f64;
                    assert!((got - want).abs() <= 1e-4 * bound, "{} {path:?} ({r},{o}): {got} vs {want}", kind.name());
                }
            }
            for (i, &r) in picked.iter().enumerate() {
                let r = r as usize;
                assert_eq!(y[(rows + i) * hidden..][..hidden], y[r * hidden..][..hidden], "{} {path:?}", kind.name());
            }
            if biased {
                continue;
            }
            let (mut gy, mut uy, mut y2) =
                (vec![0f32; rows * inter], vec![0f32; rows * inter], vec![0f32; rows * hidden]);
            qmatmul_with(path, &x, rows, &g.q(), &mut gy);
            qmatmul_with(path, &x, rows, &u.q(), &mut uy);
            let hh: Vec<f32> = gy.iter().zip(&uy).map(|(g, u)| act.apply(*g, *u)).collect();
            qmatmul_with(path, &hh, rows, &d.q(), &mut y2);
            assert_eq!(y[..rows * hidden], y2[..], "{} {path:?}", kind.name());
        }
    }
}
