//! Element- and row-wise ops on the CPU (added for Gemma 4): scaling, filling, the final
//! logit soft cap, a normalised sublayer output added into the residual, and a GELU gate
//! over a slice of per-row inputs. Each is one pool region split by elements or rows;
//! every element is computed by one thread in a fixed order, so results do not depend on
//! the thread count.

use super::{CpuBackend, Shared};
use strata_kernels::ops::{gelu_tanh, rms_norm, soft_cap};
use strata_kernels::pool::Ctx;

/// Elements per work unit of the element-wise ops.
const CHUNK: usize = 4096;

/// Applies `f` to `x[..len]` in chunks over the pool.
fn map(b: &CpuBackend, len: usize, x: &mut [f32], f: &(dyn Fn(&mut [f32]) + Sync)) {
    assert!(x.len() >= len, "element-wise op over {len} values of a buffer of {}", x.len());
    let p = Shared::new(x.as_mut_ptr());
    b.run(len * 8, &|c: &Ctx| {
        for k in c.split(len.div_ceil(CHUNK)) {
            let (a, e) = (k * CHUNK, ((k + 1) * CHUNK).min(len));
            // SAFETY: chunk k is this thread's.
            f(unsafe { p.slice_mut(a, e - a) });
        }
    });
}

pub(crate) fn scale(b: &CpuBackend, len: usize, factor: f32, x: &mut [f32]) {
    map(b, len, x, &|s| s.iter_mut().for_each(|v| *v *= factor));
}

pub(crate) fn fill(b: &CpuBackend, len: usize, value: f32, x: &mut [f32]) {
    map(b, len, x, &|s| s.fill(value));
}

pub(crate) fn soft_cap_all(b: &CpuBackend, len: usize, cap: f32, x: &mut [f32]) {
    map(b, len, x, &|s| s.iter_mut().for_each(|v| *v = soft_cap(*v, cap)));
}

/// `x[r] += rms_norm(a[r]) * w`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_rms_norm(
    b: &CpuBackend,
    rows: usize,
    width: usize,
    a: &[f32],
    w: Option<&[f32]>,
    eps: f32,
    x: &mut [f32],
) {
    assert!(a.len() >= rows * width && x.len() >= rows * width, "add_rms_norm: buffers smaller than {rows} x {width}");
    let p = Shared::new(x.as_mut_ptr());
    b.run(rows * width * 12, &|c: &Ctx| {
        let mut tmp = b.scratch(c.id, width);
        for r in c.split(rows) {
            let t = &mut tmp[..width];
            rms_norm(&a[r * width..(r + 1) * width], w, eps, t);
            // SAFETY: row r is this thread's.
            let dst = unsafe { p.slice_mut(r * width, width) };
            dst.iter_mut().zip(t.iter()).for_each(|(d, v)| *d += v);
        }
    });
}

/// `a[r, i] = gelu_tanh(a[r, i]) * b[r * b_stride + b_col + i]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gelu_tanh_mul(
    be: &CpuBackend,
    rows: usize,
    width: usize,
    a: &mut [f32],
    b: &[f32],
    b_stride: usize,
    b_col: usize,
) {
    assert!(a.len() >= rows * width, "gelu_tanh_mul: a smaller than {rows} x {width}");
    assert!(
        rows == 0 || b.len() >= (rows - 1) * b_stride + b_col + width,
        "gelu_tanh_mul: b of {} values too small for {rows} rows (stride {b_stride}, col {b_col}, width {width})",
        b.len()
    );
    let p = Shared::new(a.as_mut_ptr());
    be.run(rows * width * 16, &|c: &Ctx| {
        for r in c.split(rows) {
            // SAFETY: row r is this thread's.
            let dst = unsafe { p.slice_mut(r * width, width) };
            let src = &b[r * b_stride + b_col..][..width];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = gelu_tanh(*d) * s);
        }
    });
}

/// Each row's greedy pick: the largest value, ties to the lowest id (as the host
/// sampler), or `NON_FINITE | j` for the lowest non-finite `j`.
pub(crate) fn argmax_rows(rows: usize, width: usize, x: &[f32], picks: &mut [u32]) {
    for (r, row) in x[..rows * width].chunks_exact(width).enumerate() {
        picks[r] = match row.iter().position(|v| !v.is_finite()) {
            Some(j) => crate::NON_FINITE | j as u32,
            None => strata_kernels::ops::argmax(row) as u32,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::rand_vec;
    use super::*;

    fn f64_rms(x: &[f32], w: Option<&[f32]>, eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        x.iter().enumerate().map(|(i, v)| *v as f64 * inv * w.map_or(1.0, |w| w[i] as f64)).collect()
    }

    #[test]
    fn elementwise_ops_match_plain_references() {
        let b = CpuBackend::new();
        for len in [1usize, 100, 4096, 9000] {
            let x = rand_vec(len, len as u64);
            let mut y = x.clone();
            scale(&b, len, 0.37, &mut y);
            assert!(y.iter().zip(&x).all(|(a, v)| *a == v * 0.37));
            let mut y: Vec<f32> = x.iter().map(|v| v * 80.0).collect();
            soft_cap_all(&b, len, 30.0, &mut y);
            for (a, v) in y.iter().zip(&x) {
                let want = 30.0 * (*v as f64 * 80.0 / 30.0).tanh();
                assert!((*a as f64 - want).abs() < 1e-5 * 30.0, "{a} vs {want}");
            }
            let mut y = x.clone();
            fill(&b, len - len / 2, 2.5, &mut y);
            assert!(y[..len - len / 2].iter().all(|v| *v == 2.5) && y[len - len / 2..] == x[len - len / 2..]);
        }
    }

    #[test]
    fn add_rms_norm_and_gelu_mul_match_plain_references() {
        let b = CpuBackend::new();
        let (rows, width) = (7usize, 48usize);
        let a = rand_vec(rows * width, 1);
        let w = rand_vec(width, 2);
        let x0 = rand_vec(rows * width, 3);
        for weight in [Some(&w[..]), None] {
            let mut x = x0.clone();
            add_rms_norm(&b, rows, width, &a, weight, 1e-6, &mut x);
            for r in 0..rows {
                let n = f64_rms(&a[r * width..(r + 1) * width], weight, 1e-6);
                for i in 0..width {
                    let want = x0[r * width + i] as f64 + n[i];
                    assert!((x[r * width + i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
                }
            }
        }
        // The gate over a slice of wider per-row inputs (stride 5 * width, column 2 * width).
        let stride = 5 * width;
        let inputs = rand_vec(rows * stride, 4);
        let g0: Vec<f32> = rand_vec(rows * width, 5).iter().map(|v| v * 4.0).collect();
        let mut g = g0.clone();
        gelu_tanh_mul(&b, rows, width, &mut g, &inputs, stride, 2 * width);
        for r in 0..rows {
            for i in 0..width {
                let v = g0[r * width + i] as f64;
                let gelu = 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh());
                let want = gelu * inputs[r * stride + 2 * width + i] as f64;
                assert!((g[r * width + i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn argmax_rows_ties_to_the_lowest_and_flags_non_finite() {
        let width = 37;
        let mut x = rand_vec(4 * width, 9);
        x[3] = 5.0;
        x[30] = 5.0; // row 0: a tie, the lower id
        x[width + 20] = f32::INFINITY;
        x[width + 7] = f32::NAN; // row 1: the lowest non-finite
        x[2 * width + 11] = 2.0; // row 2: a plain maximum
        x[3 * width..].fill(-1.5); // row 3: all equal
        let mut picks = vec![0u32; 4];
        argmax_rows(4, width, &x, &mut picks);
        assert_eq!(picks, [3, crate::NON_FINITE | 7, 11, 0]);
    }
}
