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
