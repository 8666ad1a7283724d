//! The element- and row-wise ops added for Gemma 4.

use super::*;

pub(crate) fn cuda_elementwise_ops_match_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(19);
    // Lengths around the launch shapes (one block, several, a partial last one).
    for len in [1usize, 255, 4096, 70_001] {
        let x = rvec(&mut rng, len, 3.0);
        let part = len - len / 3;
        fn run<B: Backend>(b: &B, x: &[f32], part: usize) -> [Vec<f32>; 3] {
            let mut s = up(b, x);
            b.scale(part, 0.37, &mut s);
            let mut f = up(b, x);
            b.fill(part, -2.5, &mut f);
            let big: Vec<f32> = x.iter().map(|v| v * 25.0).collect();
            let mut cap = up(b, &big);
            b.soft_cap(part, 30.0, &mut cap);
            [down(b, &s, x.len()), down(b, &f, x.len()), down(b, &cap, x.len())]
        }
        let (gv, cv) = (run(g, &x, part), run(c, &x, part));
        assert_eq!(gv[0], cv[0], "scale over {part} of {len}");
        assert_eq!(gv[1], cv[1], "fill over {part} of {len}");
        close(&format!("soft_cap over {part} of {len}"), &gv[2], &cv[2], 1e-5, 1e-6);
    }
    // Row-wise: Gemma's hidden width and a small odd one.
    for (rows, width) in [(3usize, 2816usize), (1, 5376), (17, 48), (2, 6), (1, 1)] {
        let a = rvec(&mut rng, rows * width, 2.0);
        let w = rvec(&mut rng, width, 1.5);
        let x0 = rvec(&mut rng, rows * width, 1.0);
        // The gate over a slice of wider per-row inputs (PLE: stride 5 * width, column 2 * width).
        let stride = 5 * width;
        let inputs = rvec(&mut rng, rows * stride, 1.0);
        let g0 = rvec(&mut rng, rows * width, 4.0);
        fn run<B: Backend>(b: &B, v: [&[f32]; 5], rows: usize, width: usize, stride: usize) -> [Vec<f32>; 3] {
            let (a, w, inputs) = (up(b, v[0]), up(b, v[1]), up(b, v[3]));
            let (mut x1, mut x2, mut gate) = (up(b, v[2]), up(b, v[2]), up(b, v[4]));
            b.add_rms_norm(rows, width, &a, Some(&w), 1e-6, &mut x1);
            b.add_rms_norm(rows, width, &a, None, 1e-6, &mut x2);
            b.gelu_tanh_mul(rows, width, &mut gate, &inputs, stride, 2 * width);
            let n = rows * width;
            [down(b, &x1, n), down(b, &x2, n), down(b, &gate, n)]
        }
        let v = [&a[..], &w[..], &x0[..], &inputs[..], &g0[..]];
        let (gv, cv) = (run(g, v, rows, width, stride), run(c, v, rows, width, stride));
        close(&format!("add_rms_norm {rows} x {width}"), &gv[0], &cv[0], 1e-6, 1e-5);
        close(&format!("add_rms_norm without a weight {rows} x {width}"), &gv[1], &cv[1], 1e-6, 1e-5);
        close(&format!("gelu_tanh_mul {rows} x {width}"), &gv[2], &cv[2], 1e-6, 1e-5);
    }
}

#[test]
fn cuda_elementwise_ops_match_cpu() {
    if let Some(g) = gpu() {
        cuda_elementwise_ops_match_cpu_on(g)
    }
}

/// Greedy picks (`pick_rows` with no draws): the largest value, ties to the lowest id, the lowest
/// non-finite id flagged; two reads back in flight at once; and rows fed a pick embed it.
pub(crate) fn cuda_greedy_picks_and_fed_rows_match_cpu_on<G: Backend>(g: &G) {
    use strata_backend::{FED, NON_FINITE};
    let c = cpu();
    let mut rng = Rand::seed_from_u64(23);
    // Vocabularies of strata-tiny, the slice and GLM-5, and widths the float4 loads skip.
    for (rows, width) in [(1usize, 16384usize), (3, 154_880), (4, 1001), (2, 7), (1, 1)] {
        let mut x = rvec(&mut rng, rows * width, 8.0);
        let mut want = Vec::new();
        for r in 0..rows {
            let row = &mut x[r * width..(r + 1) * width];
            let top = row.iter().cloned().fold(f32::MIN, f32::max);
            let (a, b) = (rng.random_range(0..width), rng.random_range(0..width));
            let p = match r % 4 {
                // An exact tie of the largest value: the lower id.
                0 => {
                    row[a] = top + 1.0;
                    row[b] = top + 1.0;
                    a.min(b) as u32
                }
                // A NaN and an infinity: the lower id, flagged.
                1 => {
                    row[a] = f32::NAN;
                    row[b] = f32::INFINITY;
                    NON_FINITE | a.min(b) as u32
                }
                2 => {
                    row[a] = f32::NEG_INFINITY;
                    NON_FINITE | a as u32
                }
                _ => {
                    // Every value equal: id 0.
                    row.fill(-3.25);
                    0
                }
            };
            want.push(p);
        }
        let picks = |b: &G| {
            let xb = up(b, &x);
            let mut p = b.alloc_idx(rows).unwrap();
            b.pick_rows(&Step::default(), rows, width, &xb, &mut p);
            let first = b.start_read_idx(&p, rows);
            // A second read in flight before the first is taken, of another buffer.
            let mut q = b.alloc_idx(rows).unwrap();
            b.write_idx(&mut q, 0, &vec![9u32; rows]);
            let second = b.start_read_idx(&q, rows);
            let (mut v1, mut v2) = (Vec::new(), Vec::new());
            b.finish_read_idx(first, &mut v1);
            b.finish_read_idx(second, &mut v2);
            assert_eq!(v2, vec![9u32; rows], "the second read back");
            v1
        };
        assert_eq!(picks(g), want, "argmax_rows {rows} x {width}");
        let cx = up(c, &x);
        let mut cp = c.alloc_idx(rows).unwrap();
        c.pick_rows(&Step::default(), rows, width, &cx, &mut cp);
        assert_eq!(cp, want, "the CPU backend's argmax_rows {rows} x {width}");
    }
    // Fed rows: FED | i embeds picks[i]; a flagged pick and an embedding row stay as they were.
    for kind in super::products::kinds() {
        let (m, _) = hostmat(&mut rng, kind, 64, 256, 1.0);
        let (mut step, _) = make_step(&mut rng, &[(0, 3), (1, 9), (0, 4), (1, 10), (0, 5)], 64);
        let picks = [5u32, 63, NON_FINITE | 3];
        step.tokens = vec![FED | 1, 7, FED, u32::MAX, FED | 2];
        let mut literal = step.clone();
        literal.tokens = vec![63, 7, 5, u32::MAX, u32::MAX];
        fn run<B: Backend>(b: &B, m: &HostMatrix, step: &Step, picks: Option<&[u32]>) -> Vec<f32> {
            let t = b.matrix(m.clone()).unwrap();
            let p = picks.map(|v| {
                let mut p = b.alloc_idx(v.len()).unwrap();
                b.write_idx(&mut p, 0, v);
                p
            });
            let mut o = up(b, &vec![7.0; 5 * 256]);
            b.embed(step, p.as_ref(), &t, &mut o).unwrap();
            down(b, &o, 5 * 256)
        }
        let want = run(c, &m, &literal, None);
        assert_eq!(run(g, &m, &step, Some(&picks)), want, "fed embed {}", kind.name());
        assert_eq!(run(c, &m, &step, Some(&picks)), want, "the CPU backend's fed embed {}", kind.name());
        // A fed row past the picks there are fails.
        step.tokens[0] = FED | 3;
        let t = g.matrix(m).unwrap();
        let mut p = g.alloc_idx(3).unwrap();
        g.write_idx(&mut p, 0, &picks);
        let mut o = g.alloc(5 * 256).unwrap();
        assert!(g.embed(&step, Some(&p), &t, &mut o).is_err(), "a fed row past the picks must fail");
        assert!(g.embed(&step, None, &t, &mut o).is_err(), "a fed row without picks must fail");
    }
}

#[test]
fn cuda_greedy_picks_and_fed_rows_match_cpu() {
    if let Some(g) = gpu() {
        cuda_greedy_picks_and_fed_rows_match_cpu_on(g)
    }
}

/// Sampled picks (`pick_rows` with draws): the device draws what `strata_backend::draw::pick`
/// draws on the host for every row (mixed with greedy rows and a non-finite one), over the
/// vocabularies of the slice and GLM-5, flat, peaked and tied rows, each cut alone and
/// together (a top-k past the first histogram's bins), with many keys.
pub(crate) fn cuda_sampled_picks_match_the_host_draw_on<G: Backend>(g: &G) {
    use strata_backend::draw::{draw_key, pick, DrawScratch};
    use strata_backend::{Draw, NON_FINITE};
    let mut rng = Rand::seed_from_u64(29);
    let mut s = DrawScratch::default();
    let cuts: [(u32, f32, f32); 9] = [
        (0, 1.0, 0.0),
        (40, 1.0, 0.0),
        (0, 0.9, 0.0),
        (0, 1.0, 0.05),
        (50, 0.95, 0.02),
        (1, 1.0, 0.0),
        (5000, 0.5, 0.0),
        (0, 0.3, 0.1),
        (16_000, 1.0, 0.0),
    ];
    let mut n_rows = 0;
    for (rows, width, spread) in [(8usize, 16384usize, 12.0f32), (4, 154_880, 20.0), (8, 1001, 2.0), (3, 7, 1.0)] {
        for (ci, &(top_k, top_p, min_p)) in cuts.iter().enumerate() {
            let mut x = rvec(&mut rng, rows * width, spread);
            let mut draws = Vec::new();
            let mut want = Vec::new();
            for r in 0..rows {
                let row = &mut x[r * width..(r + 1) * width];
                // A few rows peaked (one token far ahead), some tied (values on a grid),
                // one greedy, one with a NaN.
                if r % 4 == 0 {
                    row.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0);
                }
                if r % 4 == 1 {
                    let j = rng.random_range(0..width);
                    row[j] += 15.0;
                }
                let t = [0.7f32, 1.0, 1.6][r % 3];
                let d = match r {
                    2 => Draw::GREEDY,
                    _ => Draw { temperature: t, top_k, top_p, min_p, key: draw_key(ci as u64, r as u64) },
                };
                if r == 3 && width > 7 {
                    row[width / 2] = f32::NAN;
                }
                want.push(pick(row, &d, &mut s));
                draws.extend(d.words());
            }
            if rows > 3 && width > 7 {
                assert_eq!(want[3], NON_FINITE | (width / 2) as u32);
            }
            let step = Step { draws, ..Default::default() };
            let xb = up(g, &x);
            let mut p = g.alloc_idx(rows).unwrap();
            g.pick_rows(&step, rows, width, &xb, &mut p);
            let mut got = vec![0u32; rows];
            g.read_idx(&p, 0, &mut got);
            assert_eq!(got, want, "{rows} x {width}, top_k {top_k} top_p {top_p} min_p {min_p}");
            n_rows += rows;
        }
    }
    // Many keys on one row: every draw the same as the host's.
    let width = 50_000;
    let x = rvec(&mut rng, width, 6.0);
    let xs: Vec<f32> = (0..64).flat_map(|_| x.iter().copied()).collect();
    let d = |k: u64| Draw { temperature: 0.8, top_k: 0, top_p: 0.95, min_p: 0.0, key: draw_key(77, k) };
    let step = Step { draws: (0..64).flat_map(|k| d(k).words()).collect(), ..Default::default() };
    let xb = up(g, &xs);
    let mut p = g.alloc_idx(64).unwrap();
    g.pick_rows(&step, 64, width, &xb, &mut p);
    let mut got = vec![0u32; 64];
    g.read_idx(&p, 0, &mut got);
    let want: Vec<u32> = (0..64).map(|k| pick(&x, &d(k), &mut s)).collect();
    assert_eq!(got, want, "64 keys over one row");
    let distinct: std::collections::BTreeSet<u32> = want.iter().copied().collect();
    assert!(distinct.len() > 8, "the keys draw different tokens: {distinct:?}");
    // Nothing kept (a min-p above 1, which the sampler refuses): the argmax, as the host.
    let x = rvec(&mut rng, 3000, 4.0);
    let d = Draw { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 1.5, key: 5 };
    let top = strata_kernels::ops::argmax(&x) as u32;
    assert_eq!(pick(&x, &d, &mut s), top);
    let step = Step { draws: d.words().to_vec(), ..Default::default() };
    let xb = up(g, &x);
    let mut p = g.alloc_idx(1).unwrap();
    g.pick_rows(&step, 1, x.len(), &xb, &mut p);
    let mut got = [0u32];
    g.read_idx(&p, 0, &mut got);
    assert_eq!(got[0], top, "nothing kept");
    eprintln!("sampled picks: {} rows equal to the host's draws", n_rows + 65);
}

#[test]
fn cuda_sampled_picks_match_the_host_draw() {
    if let Some(g) = gpu() {
        cuda_sampled_picks_match_the_host_draw_on(g)
    }
}
