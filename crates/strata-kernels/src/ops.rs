//! Row-wise numeric building blocks of a forward pass: norms, rotary embeddings,
//! softmax, dot products and axpy, top-k selection. Single-threaded functions on slices;
//! a backend splits rows or heads over its threads. `dot` and `axpy` (the attention
//! inner loops) have an AVX-512 path chosen at run time and a portable one; the others
//! are O(width) per row and plain Rust.

use std::sync::OnceLock;

fn avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Sum of squares in a fixed order (8 lanes, then a fixed tree).
fn sum_sq(x: &[f32]) -> f32 {
    let n8 = x.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for c in x[..n8].chunks_exact(8) {
        for j in 0..8 {
            acc[j] += c[j] * c[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for v in &x[n8..] {
        s += v * v;
    }
    s
}

/// RMSNorm of one row: `out = x / sqrt(mean(x^2) + eps) * w` (`w = None`: no scale).
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt();
    match w {
        Some(w) => out.iter_mut().zip(x).zip(w).for_each(|((o, v), w)| *o = v * inv * w),
        None => out.iter_mut().zip(x).for_each(|(o, v)| *o = v * inv),
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: Option<&[f32]>, eps: f32) {
    let inv = 1.0 / (sum_sq(x) / x.len() as f32 + eps).sqrt();
    match w {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * inv * w),
        None => x.iter_mut().for_each(|v| *v *= inv),
    }
}

/// LayerNorm of one row in place (population variance), with scale and bias.
pub fn layer_norm_inplace(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * w + b;
    }
}

/// The inverse frequencies of a rotary embedding over `dim` dimensions.
pub fn rope_inv_freq(dim: usize, theta: f64) -> Vec<f32> {
    (0..dim / 2).map(|i| (1.0 / theta.powf((2 * i) as f64 / dim as f64)) as f32).collect()
}

/// cos and sin of `pos * inv_freq` (f32 product then cos/sin, as torch computes it).
pub fn rope_angles(pos: usize, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let a = pos as f32 * f;
        *c = a.cos();
        *s = a.sin();
    }
}

/// Interleaved RoPE (DeepSeek/GLM-5 layout) on `x[..2*cos.len()]`: pairs `(x0,x1),
/// (x2,x3)..` rotate by one frequency each and come out de-interleaved as
/// `cat(even', odd')`, as transformers emits them for queries and keys alike.
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let mut tmp = [0f32; 512];
    assert!(2 * half <= tmp.len(), "rope over {} dims is wider than supported", 2 * half);
    for i in 0..half {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        tmp[i] = a * cos[i] - b * sin[i];
        tmp[half + i] = b * cos[i] + a * sin[i];
    }
    x[..2 * half].copy_from_slice(&tmp[..2 * half]);
}

/// Half-split RoPE (Llama/GLM-4/Gemma `rotate_half`) on `x[..2*cos.len()]`.
pub fn rope_halves(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[half + i]);
        x[i] = a * cos[i] - b * sin[i];
        x[half + i] = b * cos[i] + a * sin[i];
    }
}

/// Softmax in place; entries of -inf get probability 0. Returns the sum of exponentials.
pub fn softmax_inplace(x: &mut [f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
    sum
}

/// Softmax of `x` with one more logit, `sink`, in the denominator (gpt-oss's attention
/// sinks: the weight the sink takes goes nowhere).
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - max).exp();
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// GELU with the tanh approximation (PyTorch's `gelu(x, approximate="tanh")`, Gemma's
/// `gelu_pytorch_tanh`): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (K * (x + 0.044715 * x * x * x)).tanh())
}

/// `c * tanh(x / c)`: a soft cap at `c` (Gemma's final logit soft-capping).
#[inline]
pub fn soft_cap(x: f32, c: f32) -> f32 {
    (x / c).tanh() * c
}

#[inline]
pub fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// `sum a[i] * b[i]`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F detected.
        return unsafe { x86::dot(a, b) };
    }
    dot_plain(a, b)
}

fn dot_plain(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (x, y) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in a[n8..].iter().zip(&b[n8..]) {
        s += x * y;
    }
    s
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F detected.
        return unsafe { x86::axpy(alpha, x, y) };
    }
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// Index of the largest value (the first on ties; NaN never wins).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best
}

/// The `k` best of `0..n` by `better(a, b)` (a strict order: true when a ranks above
/// b), kept sorted best first in `out` (cleared first). O(n k) with no allocation beyond
/// `out`'s capacity: for the small k of routers and samplers.
pub fn top_k_by(n: usize, k: usize, out: &mut Vec<u32>, better: impl Fn(u32, u32) -> bool) {
    out.clear();
    if k == 0 {
        return;
    }
    for i in 0..n as u32 {
        if out.len() == k && !better(i, out[k - 1]) {
            continue;
        }
        let mut at = out.len();
        while at > 0 && better(i, out[at - 1]) {
            at -= 1;
        }
        if out.len() == k {
            out.pop();
        }
        out.insert(at, i);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (j, v) in acc.iter_mut().enumerate() {
                *v = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * j)), _mm512_loadu_ps(pb.add(i + 16 * j)), *v);
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
            i += 16;
        }
        if i < n {
            let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
            acc[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, pa.add(i)), _mm512_maskz_loadu_ps(m, pb.add(i)), acc[1]);
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(v)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let a = _mm512_set1_ps(alpha);
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(py.add(i), _mm512_fmadd_ps(a, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i))));
            i += 16;
        }
        if i < n {
            let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
            let v = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, px.add(i)), _mm512_maskz_loadu_ps(m, py.add(i)));
            _mm512_mask_storeu_ps(py.add(i), m, v);
        }
    }
}

/// Deterministic values in [-1, 1), none near zero (a plain xorshift, no dependency): the
/// random inputs of the kernel tests, here and in the crates above.
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if v.abs() < 0.01 {
                0.37
            } else {
                v
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sink is one more logit whose weight is dropped: the rest sum to 1 - p(sink).
    #[test]
    fn softmax_with_sink_matches_a_plain_reference() {
        let x = [0.3f32, -1.2, 2.5, 0.0, 1.1];
        for sink in [-3.0f32, 0.7, 4.0] {
            let mut got = x;
            softmax_with_sink(&mut got, sink);
            let z: f64 = x.iter().map(|v| (*v as f64).exp()).sum::<f64>() + (sink as f64).exp();
            for (g, v) in got.iter().zip(x) {
                assert!((*g as f64 - (v as f64).exp() / z).abs() < 1e-6, "sink {sink}");
            }
        }
    }

    #[test]
    fn norms_match_f64_references() {
        for n in [1usize, 7, 64, 259] {
            let x = rand_vec(n, n as u64);
            let w = rand_vec(n, 3);
            let b = rand_vec(n, 4);
            let mut out = vec![0f32; n];
            rms_norm(&x, Some(&w), 1e-5, &mut out);
            let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n as f64;
            for i in 0..n {
                let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
                assert!((out[i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "rms n={n} [{i}]");
            }
            let mut y = x.clone();
            rms_norm_inplace(&mut y, Some(&w), 1e-5);
            assert_eq!(y, out);
            let mut y = x.clone();
            layer_norm_inplace(&mut y, &w, &b, 1e-6);
            let mean = x.iter().map(|v| *v as f64).sum::<f64>() / n as f64;
            let var = x.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
            for i in 0..n {
                let want = (x[i] as f64 - mean) / (var + 1e-6).sqrt() * w[i] as f64 + b[i] as f64;
                assert!((y[i] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "ln n={n} [{i}]");
            }
        }
    }

    #[test]
    fn rope_layouts_rotate_pairs() {
        let dim = 8;
        let inv = rope_inv_freq(dim, 10000.0);
        let (mut c, mut s) = (vec![0f32; dim / 2], vec![0f32; dim / 2]);
        rope_angles(7, &inv, &mut c, &mut s);
        let x = rand_vec(dim, 9);
        let mut y = x.clone();
        rope_interleaved(&mut y, &c, &s);
        let mut z = x.clone();
        rope_halves(&mut z, &c, &s);
        for i in 0..dim / 2 {
            let ang = 7.0 * (1.0 / 10000f64.powf((2 * i) as f64 / dim as f64));
            let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
            assert!((y[i] as f64 - (a * ang.cos() - b * ang.sin())).abs() < 1e-5);
            assert!((y[dim / 2 + i] as f64 - (b * ang.cos() + a * ang.sin())).abs() < 1e-5);
            let (a, b) = (x[i] as f64, x[dim / 2 + i] as f64);
            assert!((z[i] as f64 - (a * ang.cos() - b * ang.sin())).abs() < 1e-5);
            assert!((z[dim / 2 + i] as f64 - (b * ang.cos() + a * ang.sin())).abs() < 1e-5);
        }
    }

    #[test]
    fn dot_axpy_softmax_argmax() {
        for n in [0usize, 1, 15, 16, 17, 63, 64, 65, 576] {
            let a = rand_vec(n, 1 + n as u64);
            let b = rand_vec(n, 2 + n as u64);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let bound: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
            assert!((dot(&a, &b) as f64 - want).abs() <= 1e-5 * bound + 1e-7, "dot n={n}");
            assert!((dot_plain(&a, &b) as f64 - want).abs() <= 1e-5 * bound + 1e-7, "dot_plain n={n}");
            let mut y = b.clone();
            axpy(0.75, &a, &mut y);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.75 * a[i])).abs() < 1e-6, "axpy n={n} [{i}]");
            }
        }
        let mut p = vec![1.0f32, f32::NEG_INFINITY, 3.0];
        softmax_inplace(&mut p);
        let e = (1.0f64 - 3.0).exp();
        assert!((p[0] as f64 - e / (1.0 + e)).abs() < 1e-7);
        assert_eq!(p[1], 0.0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 2.0, 1.0]), 1);
    }

    #[test]
    fn gelu_tanh_and_soft_cap_match_f64_references() {
        let x: Vec<f32> = rand_vec(513, 21).iter().map(|v| v * 6.0).collect();
        for &v in &x {
            let d = v as f64;
            let want = 0.5 * d * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (d + 0.044715 * d * d * d)).tanh());
            assert!((gelu_tanh(v) as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "gelu({v})");
            let want = 30.0 * (d * 7.0 / 30.0).tanh();
            assert!((soft_cap(v * 7.0, 30.0) as f64 - want).abs() <= 2e-6 * (1.0 + want.abs()), "cap({v})");
        }
        assert!((soft_cap(1e6, 30.0) - 30.0).abs() < 1e-5 && gelu_tanh(-30.0).abs() < 1e-6);
    }

    #[test]
    fn top_k_keeps_order_and_ties_to_lower_index() {
        let v = [0.5f32, 2.0, 2.0, -1.0, 7.0, 0.5];
        let mut out = Vec::with_capacity(8);
        top_k_by(v.len(), 3, &mut out, |a, b| v[a as usize] > v[b as usize]);
        assert_eq!(out, vec![4, 1, 2]);
        top_k_by(v.len(), 10, &mut out, |a, b| v[a as usize] > v[b as usize]);
        assert_eq!(out, vec![4, 1, 2, 0, 5, 3]);
        top_k_by(v.len(), 0, &mut out, |a, b| v[a as usize] > v[b as usize]);
        assert!(out.is_empty());
    }
}
