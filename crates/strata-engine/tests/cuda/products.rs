//! Projections in every encoding against an f64 reference; embed, norm, add, gather.

use super::*;

pub(crate) fn kinds() -> Vec<QuantKind> {
    vec![
        QuantKind::F32,
        QuantKind::Bf16,
        QuantKind::Int8Row,
        QuantKind::int4(32),
        QuantKind::int4(64),
        QuantKind::int4_bf16(64),
        QuantKind::int4_e4m3(64),
        QuantKind::Fp8 { block_rows: 128, block_cols: 128 },
        QuantKind::Fp8 { block_rows: 1, block_cols: 32 },
    ]
}

#[allow(clippy::too_many_arguments)]
fn run_linear<B: Backend>(
    b: &B,
    m: &HostMatrix,
    x: &[f32],
    rows: usize,
    stride: usize,
    col: usize,
    add: bool,
    bias: Option<&[f32]>,
    init: &[f32],
) -> Vec<f32> {
    let w = b.matrix(m.clone()).unwrap();
    let xb = up(b, x);
    let mut out = up(b, init);
    let bias = bias.map(|v| up(b, v));
    b.linears(&xb, rows, &mut [LinearOut { w: &w, out: &mut out, stride, col, add, bias: bias.as_ref() }]);
    down(b, &out, init.len())
}

fn check_linear<G: Backend>(rng: &mut Rand, g: &G, kind: QuantKind, nout: usize, cols: usize, rows: usize, mode: u32) {
    let (m, deq) = hostmat(rng, kind, nout, cols, 1.0);
    let x = rvec(rng, rows * cols, 1.0);
    let (col, stride) = if mode == 0 { (0, nout) } else { (3, nout + 7) };
    let add = mode == 2;
    let bias = (mode >= 1).then(|| rvec(rng, nout, 1.0));
    let len = (rows - 1) * stride + col + nout;
    let init = if add { rvec(rng, len, 1.0) } else { vec![f32::NAN; len] };
    let got = run_linear(g, &m, &x, rows, stride, col, add, bias.as_deref(), &init);
    let cpu_out = run_linear(cpu(), &m, &x, rows, stride, col, add, bias.as_deref(), &init);
    // f64 reference over the dequantized weights; tolerance from the sum of |terms|.
    let (mut want, mut bound) = (init.clone(), vec![0f32; len]);
    for r in 0..rows {
        for o in 0..nout {
            let (mut acc, mut mag) = (0f64, 0f64);
            for c in 0..cols {
                let t = deq[o * cols + c] as f64 * x[r * cols + c] as f64;
                acc += t;
                mag += t.abs();
            }
            if let Some(bv) = &bias {
                acc += bv[o] as f64;
                mag += (bv[o] as f64).abs();
            }
            let i = r * stride + col + o;
            if add {
                acc += init[i] as f64;
                mag += (init[i] as f64).abs();
            }
            want[i] = acc as f32;
            bound[i] = mag as f32;
        }
    }
    let what = format!("linear {} {nout}x{cols} rows {rows} mode {mode}", kind.name());
    for (i, (&gv, &wv)) in got.iter().zip(&want).enumerate() {
        if wv.is_nan() {
            assert!(gv.is_nan(), "{what}: wrote outside its outputs at {i}");
            continue;
        }
        let tol = 3e-5 * bound[i] + 1e-6;
        assert!((gv - wv).abs() <= tol, "{what}: [{i}] cuda {gv} reference {wv} (tolerance {tol})");
        assert!((cpu_out[i] - wv).abs() <= tol, "{what}: [{i}] cpu {} reference {wv}", cpu_out[i]);
    }
}

pub(crate) fn cuda_linears_match_reference_for_every_encoding_on<G: Backend>(g: &G) {
    let mut rng = Rand::seed_from_u64(1);
    for kind in kinds() {
        for rows in [1, 2, 5, 8, 9, 40, 70] {
            check_linear(&mut rng, g, kind, 70, 256, rows, rows as u32 % 3);
        }
        // Many outputs (a warp each), and one output (eight warps share it).
        check_linear(&mut rng, g, kind, 2200, 128, 1, 1);
        // One row against enough outputs for the one-row kernel (four a warp, a ragged end).
        for mode in 0..3 {
            check_linear(&mut rng, g, kind, 4501, 256, 1, mode);
        }
        check_linear(&mut rng, g, kind, 1, 512, 3, 2);
    }
    // Shapes the vector loads cannot take: odd widths, int4 groups and FP8 blocks that are
    // not whole vectors.
    for (kind, cols) in [
        (QuantKind::F32, 37),
        (QuantKind::Bf16, 61),
        (QuantKind::Int8Row, 45),
        (QuantKind::int4(6), 96),
        (QuantKind::int4(2), 33),
        (QuantKind::Fp8 { block_rows: 16, block_cols: 24 }, 100),
    ] {
        for rows in [1, 4, 12, 33] {
            check_linear(&mut rng, g, kind, 29, cols, rows, rows as u32 % 3);
        }
    }
}

pub(crate) fn cuda_embed_norm_add_gather_match_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(2);
    for kind in kinds() {
        let (m, _) = hostmat(&mut rng, kind, 64, 256, 1.0);
        let (mut step, _) = make_step(&mut rng, &[(0, 3), (1, 9), (0, 4)], 64);
        step.tokens[1] = u32::MAX;
        let e_g = {
            let t = g.matrix(m.clone()).unwrap();
            let mut o = up(g, &vec![7.0; 3 * 256]);
            g.embed(&step, None, &t, &mut o).unwrap();
            down(g, &o, 3 * 256)
        };
        let e_c = {
            let t = c.matrix(m.clone()).unwrap();
            let mut o = up(c, &vec![7.0; 3 * 256]);
            c.embed(&step, None, &t, &mut o).unwrap();
            down(c, &o, 3 * 256)
        };
        assert_eq!(e_g, e_c, "embed {}: decoded rows differ", kind.name());
        step.tokens[0] = 64;
        let t = g.matrix(m).unwrap();
        let mut o = g.alloc(3 * 256).unwrap();
        assert!(g.embed(&step, None, &t, &mut o).is_err(), "embed: a token beyond the vocabulary must fail");
    }
    for (rows, width) in [(1, 256), (5, 64), (3, 1000), (2, 7)] {
        let x = rvec(&mut rng, rows * width, 3.0);
        let w = rvec(&mut rng, width, 1.0);
        for with_w in [false, true] {
            let norm = |b: &dyn Fn(&[f32], Option<&[f32]>) -> Vec<f32>| b(&x, with_w.then_some(&w[..]));
            let gv = norm(&|x, w| {
                let (xb, wb) = (up(g, x), w.map(|w| up(g, w)));
                let mut o = up(g, &vec![f32::NAN; x.len()]);
                g.rms_norm(rows, width, &xb, wb.as_ref(), 1e-5, &mut o);
                down(g, &o, x.len())
            });
            let cv = norm(&|x, w| {
                let (xb, wb) = (up(c, x), w.map(|w| up(c, w)));
                let mut o = up(c, &vec![f32::NAN; x.len()]);
                c.rms_norm(rows, width, &xb, wb.as_ref(), 1e-5, &mut o);
                down(c, &o, x.len())
            });
            close(&format!("rms_norm {rows}x{width}"), &gv, &cv, 1e-6, 2e-6);
        }
    }
    // add, gather_rows, write/read (with offsets).
    let a = rvec(&mut rng, 1000, 1.0);
    let bv = rvec(&mut rng, 1000, 1.0);
    let (ab, mut bb) = (up(g, &a), up(g, &bv));
    g.add(900, &ab, &mut bb);
    let got = down(g, &bb, 1000);
    for i in 0..1000 {
        let want = if i < 900 { bv[i] + a[i] } else { bv[i] };
        assert_eq!(got[i], want, "add [{i}]");
    }
    let mut dst = up(g, &vec![f32::NAN; 3 * 100]);
    g.gather_rows(&ab, 100, &[7, 2, 9], &mut dst);
    let got = down(g, &dst, 300);
    for (i, r) in [7usize, 2, 9].iter().enumerate() {
        assert_eq!(&got[i * 100..(i + 1) * 100], &a[r * 100..(r + 1) * 100], "gather_rows row {i}");
    }
    g.write(&mut bb, 17, &a[..50]);
    let mut part = vec![0f32; 50];
    g.read(&bb, 17, &mut part);
    assert_eq!(part, &a[..50]);
    let ids: Vec<u32> = (0..300).map(|_| rng.random_range(0..1u32 << 30)).collect();
    let mut ib = g.alloc_idx(400).unwrap();
    g.write_idx(&mut ib, 40, &ids);
    let mut back = vec![0u32; 300];
    g.read_idx(&ib, 40, &mut back);
    assert_eq!(back, ids);
}

#[test]
fn cuda_linears_match_reference_for_every_encoding() {
    if let Some(g) = gpu() {
        cuda_linears_match_reference_for_every_encoding_on(g)
    }
}

#[test]
fn cuda_embed_norm_add_gather_match_cpu() {
    if let Some(g) = gpu() {
        cuda_embed_norm_add_gather_match_cpu_on(g)
    }
}

/// `norm_linears` (RMSNorm fused into the projections of one row on CUDA: four and two
/// outputs a warp, several small ones in one launch, with bias and add) against an f64
/// reference of the norm then the products, in every encoding; several rows (not fused)
/// and a width the vector loads cannot take go through the plain norm and products.
pub(crate) fn cuda_norm_linears_match_reference_on<G: Backend>(g: &G) {
    let mut rng = Rand::seed_from_u64(31);
    let eps = 1e-5f32;
    for kind in kinds().into_iter().chain([QuantKind::int4(6)]) {
        let cols = if matches!(kind, QuantKind::Int4Group { group: 6, .. }) { 96 } else { 256 };
        for rows in [1, 3] {
            // (outputs, add, bias)
            let shapes = [(4300, false, true), (2200, true, false), (70, false, false), (3, true, true)];
            let mats: Vec<(HostMatrix, Vec<f32>)> =
                shapes.iter().map(|&(n, _, _)| hostmat(&mut rng, kind, n, cols, 1.0)).collect();
            // A residual far from unit scale: the norm, not x, sets the products' size.
            let x = rvec(&mut rng, rows * cols, 40.0);
            let nw = rvec(&mut rng, cols, 1.5);
            let biases: Vec<Option<Vec<f32>>> =
                shapes.iter().map(|&(n, _, b)| b.then(|| rvec(&mut rng, n, 1.0))).collect();
            let inits: Vec<Vec<f32>> = shapes
                .iter()
                .map(|&(n, add, _)| if add { rvec(&mut rng, rows * n, 1.0) } else { vec![f32::NAN; rows * n] })
                .collect();
            #[allow(clippy::too_many_arguments)]
            fn go<B: Backend>(
                b: &B,
                mats: &[(HostMatrix, Vec<f32>)],
                shapes: &[(usize, bool, bool)],
                biases: &[Option<Vec<f32>>],
                inits: &[Vec<f32>],
                x: &[f32],
                nw: &[f32],
                rows: usize,
                cols: usize,
                eps: f32,
            ) -> Vec<Vec<f32>> {
                let ws: Vec<B::Mat> = mats.iter().map(|(m, _)| b.matrix(m.clone()).unwrap()).collect();
                let mut outs: Vec<B::Buf> = inits.iter().map(|v| up(b, v)).collect();
                let bs: Vec<Option<B::Buf>> = biases.iter().map(|v| v.as_ref().map(|v| up(b, v))).collect();
                let (xb, wb) = (up(b, x), up(b, nw));
                let mut scratch = up(b, &vec![0.0; rows * cols]);
                let mut los: Vec<LinearOut<'_, B>> = ws
                    .iter()
                    .zip(outs.iter_mut())
                    .zip(shapes.iter().zip(&bs))
                    .map(|((w, out), (&(n, add, _), bias))| LinearOut {
                        w,
                        out,
                        stride: n,
                        col: 0,
                        add,
                        bias: bias.as_ref(),
                    })
                    .collect();
                b.norm_linears(rows, cols, &xb, &wb, eps, &mut scratch, &mut los);
                drop(los);
                outs.iter().zip(inits).map(|(o, i)| down(b, o, i.len())).collect()
            }
            let got = go(g, &mats, &shapes, &biases, &inits, &x, &nw, rows, cols, eps);
            let on_cpu = go(cpu(), &mats, &shapes, &biases, &inits, &x, &nw, rows, cols, eps);
            for (j, (&(n, add, _), (_, deq))) in shapes.iter().zip(&mats).enumerate() {
                for r in 0..rows {
                    let xr = &x[r * cols..][..cols];
                    let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    for o in 0..n {
                        let (mut acc, mut mag) = (0f64, 0f64);
                        for c in 0..cols {
                            let t = deq[o * cols + c] as f64 * (xr[c] as f64 * inv * nw[c] as f64);
                            acc += t;
                            mag += t.abs();
                        }
                        if let Some(bv) = &biases[j] {
                            acc += bv[o] as f64;
                            mag += (bv[o] as f64).abs();
                        }
                        let i = r * n + o;
                        if add {
                            acc += inits[j][i] as f64;
                            mag += (inits[j][i] as f64).abs();
                        }
                        let tol = (3e-5 * mag + 1e-6) as f32;
                        let what = format!("norm_linears {} {n}x{cols} rows {rows} [{i}]", kind.name());
                        assert!((got[j][i] - acc as f32).abs() <= tol, "{what}: cuda {} reference {acc}", got[j][i]);
                        assert!(
                            (on_cpu[j][i] - acc as f32).abs() <= tol,
                            "{what}: cpu {} reference {acc}",
                            on_cpu[j][i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn cuda_norm_linears_match_reference() {
    if let Some(g) = gpu() {
        cuda_norm_linears_match_reference_on(g)
    }
}
