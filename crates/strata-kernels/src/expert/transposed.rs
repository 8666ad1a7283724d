//! `y = x W` for a matrix stored `W[K = rows, N = cols]` (contracting over W's rows): the
//! product with the transpose, for weights whose stored orientation is the other way
//! round (MLA's key half of `kv_b_proj`, absorbed into the query). Single-threaded; the
//! caller splits the work (per head). Each output accumulates over k in order, so a row
//! alone equals the row in a batch.

use super::{dequant_row, QMatrix};
use crate::quant::QuantKind;

/// `y[r, c] = sum_k x[r, k] * W[k, c]`; x is `rows x w.rows`, y is `rows x w.cols`.
/// Panics on mismatched shapes.
pub fn matmul_t(x: &[f32], rows: usize, w: &QMatrix, y: &mut [f32]) {
    let (k_dim, n) = (w.rows, w.cols);
    assert_eq!(x.len(), rows * k_dim, "matmul_t: x has {} values, expected {rows} x {k_dim}", x.len());
    assert_eq!(y.len(), rows * n, "matmul_t: y has {} values, expected {rows} x {n}", y.len());
    #[cfg(target_arch = "x86_64")]
    if super::KernelPath::Avx512.is_available() && simd_kind(w.kind) {
        // SAFETY: AVX-512F available; shapes checked.
        unsafe { x86::matmul_t(x, rows, w, y) };
        return;
    }
    y.fill(0.0);
    let mut stack = [0f32; 4096];
    let mut heap = Vec::new();
    let wrow: &mut [f32] = if n <= stack.len() {
        &mut stack[..n]
    } else {
        heap.resize(n, 0.0);
        &mut heap
    };
    for k in 0..k_dim {
        dequant_row(w, k, wrow);
        for r in 0..rows {
            let a = x[r * k_dim + k];
            for (yv, wv) in y[r * n..(r + 1) * n].iter_mut().zip(wrow.iter()) {
                *yv += a * wv;
            }
        }
    }
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn simd_kind(kind: QuantKind) -> bool {
    match kind {
        QuantKind::F32 | QuantKind::Bf16 => true,
        QuantKind::Fp8 { block_cols, .. } => block_cols % 16 == 0,
        _ => false,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::QMatrix;
    use crate::quant::QuantKind;
    use std::arch::x86_64::*;

    /// 16 decoded values of row k from column c.
    #[inline(always)]
    unsafe fn load16(w: &QMatrix, k: usize, c: usize) -> __m512 {
        let n = w.cols;
        match w.kind {
            QuantKind::F32 => _mm512_loadu_ps(w.payload.as_ptr().add((k * n + c) * 4) as *const f32),
            QuantKind::Bf16 => {
                let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    w.payload.as_ptr().add((k * n + c) * 2) as *const __m256i
                ));
                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
            }
            QuantKind::Fp8 { block_rows, block_cols } => {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(w.payload.as_ptr().add(k * n + c) as *const __m128i));
                let mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20);
                let f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(f32::from_bits(0x7B80_0000)));
                let sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
                let q = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
                let s = *w.scales.f32().get_unchecked((k / block_rows) * n.div_ceil(block_cols) + c / block_cols);
                _mm512_mul_ps(q, _mm512_set1_ps(s))
            }
            _ => unreachable!("matmul_t: no SIMD decode for {:?}", w.kind),
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn matmul_t(x: &[f32], rows: usize, w: &QMatrix, y: &mut [f32]) {
        let (kd, n) = (w.rows, w.cols);
        let n16 = n / 16 * 16;
        let mut r0 = 0;
        while r0 < rows {
            let rt = (rows - r0).min(4);
            // Chunks of 64 columns (4 vectors) while they last, then single vectors.
            let mut c = 0;
            while c < n16 {
                let width = if c + 64 <= n16 { 4 } else { 1 };
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for k in 0..kd {
                    let mut wv = [_mm512_setzero_ps(); 4];
                    for (j, v) in wv.iter_mut().enumerate().take(width) {
                        *v = load16(w, k, c + 16 * j);
                    }
                    for (ri, a) in acc.iter_mut().enumerate().take(rt) {
                        let xv = _mm512_set1_ps(*x.get_unchecked((r0 + ri) * kd + k));
                        for j in 0..width {
                            a[j] = _mm512_fmadd_ps(wv[j], xv, a[j]);
                        }
                    }
                }
                for (ri, a) in acc.iter().enumerate().take(rt) {
                    for (j, v) in a.iter().enumerate().take(width) {
                        _mm512_storeu_ps(y.as_mut_ptr().add((r0 + ri) * n + c + 16 * j), *v);
                    }
                }
                c += 16 * width;
            }
            // Scalar tail columns, accumulated over k in the same order.
            for ri in 0..rt {
                for c in n16..n {
                    let mut s = 0f32;
                    for k in 0..kd {
                        s = super::super::weight_at(w, k, c).mul_add(x[(r0 + ri) * kd + k], s);
                    }
                    y[(r0 + ri) * n + c] = s;
                }
            }
            r0 += rt;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, quantize};

    #[test]
    fn matches_f64_reference_for_every_kind() {
        let (k_dim, n) = (37usize, 150usize);
        let mut s = 7u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if v.abs() < 0.02 {
                0.5
            } else {
                v
            }
        };
        let wf: Vec<f32> = (0..k_dim * n).map(|_| next()).collect();
        for kind in [
            QuantKind::F32,
            QuantKind::Bf16,
            QuantKind::Fp8 { block_rows: 1, block_cols: 16 },
            QuantKind::Fp8 { block_rows: 8, block_cols: 32 },
            QuantKind::Fp8 { block_rows: 3, block_cols: 5 },
            QuantKind::Int8Row,
            QuantKind::int4(10),
        ] {
            let (p, sc) = quantize(kind, &wf, k_dim, n);
            let dense = dequantize(kind, &p, &sc, k_dim, n);
            let w = QMatrix::new(kind, k_dim, n, &p, &sc);
            for rows in [1usize, 3, 6] {
                let x: Vec<f32> = (0..rows * k_dim).map(|_| next()).collect();
                let mut y = vec![f32::NAN; rows * n];
                matmul_t(&x, rows, &w, &mut y);
                for r in 0..rows {
                    for c in 0..n {
                        let (mut want, mut bound) = (0f64, 0f64);
                        for k in 0..k_dim {
                            let p = x[r * k_dim + k] as f64 * dense[k * n + c] as f64;
                            want += p;
                            bound += p.abs();
                        }
                        let got = y[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * bound,
                            "{} rows={rows} ({r},{c}): {got} vs {want}",
                            kind.name()
                        );
                    }
                }
                // A row alone equals the row in the batch.
                let r = rows / 2;
                let mut alone = vec![0f32; n];
                matmul_t(&x[r * k_dim..(r + 1) * k_dim], 1, &w, &mut alone);
                assert_eq!(alone, y[r * n..(r + 1) * n], "{} rows={rows}", kind.name());
            }
        }
    }
}
