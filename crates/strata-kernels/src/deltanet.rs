//! Gated DeltaNet (Qwen3-Next's linear attention), one token at a time: a depthwise causal
//! convolution over the token's q|k|v (with the sequence's last `kernel - 1` inputs), q and
//! k L2-normalised per head, then per value head the gated delta rule on a `[k_dim, v_dim]`
//! state `S`:
//!
//! ```text
//! S *= exp(g);  delta = (v - S^T k) * beta;  S += k delta^T;  o = S^T q
//! ```
//!
//! with `beta = sigmoid(b)` and `g = -exp(A_log) * softplus(a + dt_bias)`, and the output
//! RMS-normalised per head, times the norm's weight and `silu(z)`. transformers'
//! `torch_recurrent_gated_delta_rule` and `Qwen3NextGatedDeltaNet` are the reference.

use crate::ops::sigmoid;

/// A layer's linear-attention widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetDims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// The convolution's width.
    pub kernel: usize,
}

impl DeltaNetDims {
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }
    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// A row of the input projection: q, k, v, then the output gate z.
    pub fn qkvz_width(&self) -> usize {
        2 * self.key_dim() + 2 * self.value_dim()
    }
    /// A sequence's recurrent state: `[v_heads, k_dim, v_dim]`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
    /// A sequence's convolution state: the last `kernel - 1` inputs of each channel.
    pub fn conv_state_len(&self) -> usize {
        self.conv_dim() * (self.kernel - 1)
    }
}

/// A layer's parameters.
#[derive(Clone, Copy)]
pub struct DeltaNetParams<'a> {
    /// `[conv_dim, kernel]`.
    pub conv: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    /// The gated norm's weight, `[v_dim]`.
    pub norm: &'a [f32],
    pub eps: f32,
}

/// PyTorch's softplus (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(sum(x^2) + 1e-6)` (FLA's l2norm, as transformers writes it).
fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One token of one sequence: `qkvz` (`[qkvz_width]`, q/k/v/z each head-major) and `ba`
/// (`[2 * v_heads]`, b then a) in, `out` (`[value_dim]`) out; the sequence's `conv_state`
/// and `state` advance by the token. `mixed`: scratch of `conv_dim` values.
#[allow(clippy::too_many_arguments)]
pub fn delta_row(
    d: &DeltaNetDims,
    p: &DeltaNetParams<'_>,
    qkvz: &[f32],
    ba: &[f32],
    conv_state: &mut [f32],
    state: &mut [f32],
    mixed: &mut [f32],
    out: &mut [f32],
) {
    let (cd, km1) = (d.conv_dim(), d.kernel - 1);
    // The convolution over [the last kernel - 1 inputs, this one], then SiLU; the state
    // shifts by one.
    for c in 0..cd {
        let w = &p.conv[c * d.kernel..(c + 1) * d.kernel];
        let past = &mut conv_state[c * km1..(c + 1) * km1];
        let x = qkvz[c];
        let mut acc = w[km1] * x;
        for (j, v) in past.iter().enumerate() {
            acc += w[j] * v;
        }
        mixed[c] = acc * sigmoid(acc);
        if km1 > 0 {
            past.copy_within(1.., 0);
            past[km1 - 1] = x;
        }
    }
    let (kd, vd) = (d.key_dim(), d.value_dim());
    let (q, rest) = mixed.split_at_mut(kd);
    let (k, v) = rest.split_at_mut(kd);
    let scale = (d.k_dim as f32).powf(-0.5);
    for h in 0..d.k_heads {
        let qh = &mut q[h * d.k_dim..(h + 1) * d.k_dim];
        l2norm(qh);
        qh.iter_mut().for_each(|x| *x *= scale);
        l2norm(&mut k[h * d.k_dim..(h + 1) * d.k_dim]);
    }
    let z = &qkvz[2 * kd + vd..2 * kd + 2 * vd];
    let per = d.v_heads / d.k_heads;
    for h in 0..d.v_heads {
        let kh = h / per;
        let (qh, kv) = (&q[kh * d.k_dim..(kh + 1) * d.k_dim], &k[kh * d.k_dim..(kh + 1) * d.k_dim]);
        let vh = &v[h * d.v_dim..(h + 1) * d.v_dim];
        let beta = sigmoid(ba[h]);
        let g = -p.a_log[h].exp() * softplus(ba[d.v_heads + h] + p.dt_bias[h]);
        let decay = g.exp();
        let s = &mut state[h * d.k_dim * d.v_dim..(h + 1) * d.k_dim * d.v_dim];
        s.iter_mut().for_each(|x| *x *= decay);
        let o = &mut out[h * d.v_dim..(h + 1) * d.v_dim];
        // o holds S^T k, then delta.
        o.fill(0.0);
        for (i, &ki) in kv.iter().enumerate() {
            for (oj, sij) in o.iter_mut().zip(&s[i * d.v_dim..(i + 1) * d.v_dim]) {
                *oj += sij * ki;
            }
        }
        for (oj, vj) in o.iter_mut().zip(vh) {
            *oj = (vj - *oj) * beta;
        }
        for (i, &ki) in kv.iter().enumerate() {
            for (sij, dj) in s[i * d.v_dim..(i + 1) * d.v_dim].iter_mut().zip(o.iter()) {
                *sij += ki * dj;
            }
        }
        o.fill(0.0);
        for (i, &qi) in qh.iter().enumerate() {
            for (oj, sij) in o.iter_mut().zip(&s[i * d.v_dim..(i + 1) * d.v_dim]) {
                *oj += sij * qi;
            }
        }
        // The gated norm.
        let ms: f32 = o.iter().map(|x| x * x).sum::<f32>() / d.v_dim as f32;
        let inv = 1.0 / (ms + p.eps).sqrt();
        for (j, oj) in o.iter_mut().enumerate() {
            let zj = z[h * d.v_dim + j];
            *oj = (*oj * inv) * p.norm[j] * (zj * sigmoid(zj));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule against its definition in f64, over a few tokens: states, and outputs.
    #[test]
    fn delta_rows_match_a_plain_reference() {
        let d = DeltaNetDims { k_heads: 2, v_heads: 4, k_dim: 4, v_dim: 3, kernel: 3 };
        let mut seed = 7u64;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let conv = rnd(d.conv_dim() * d.kernel);
        let (a_log, dt_bias, norm) = (rnd(d.v_heads), rnd(d.v_heads), rnd(d.v_dim));
        let p = DeltaNetParams { conv: &conv, a_log: &a_log, dt_bias: &dt_bias, norm: &norm, eps: 1e-6 };
        let tokens: Vec<(Vec<f32>, Vec<f32>)> = (0..4).map(|_| (rnd(d.qkvz_width()), rnd(2 * d.v_heads))).collect();
        let (mut cs, mut st, mut mixed) =
            (vec![0f32; d.conv_state_len()], vec![0f32; d.state_len()], vec![0f32; d.conv_dim()]);
        let mut s64 = vec![0f64; d.state_len()];
        for (t, (qkvz, ba)) in tokens.iter().enumerate() {
            let mut out = vec![0f32; d.value_dim()];
            delta_row(&d, &p, qkvz, ba, &mut cs, &mut st, &mut mixed, &mut out);
            // f64: the convolution from the token history.
            let conv_out: Vec<f64> = (0..d.conv_dim())
                .map(|c| {
                    let mut a = 0f64;
                    for j in 0..d.kernel {
                        let back = d.kernel - 1 - j;
                        if t >= back {
                            a += conv[c * d.kernel + j] as f64 * tokens[t - back].0[c] as f64;
                        }
                    }
                    a / (1.0 + (-a).exp())
                })
                .collect();
            let kd = d.key_dim();
            let norm_head = |x: &[f64]| -> Vec<f64> {
                let n = (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
                x.iter().map(|v| v / n).collect()
            };
            for h in 0..d.v_heads {
                let kh = h / 2;
                let q: Vec<f64> = norm_head(&conv_out[kh * 4..kh * 4 + 4]).iter().map(|v| v / 2.0).collect();
                let k = norm_head(&conv_out[kd + kh * 4..kd + kh * 4 + 4]);
                let v = &conv_out[2 * kd + h * 3..2 * kd + h * 3 + 3];
                let beta = 1.0 / (1.0 + (-(ba[h] as f64)).exp());
                let x = ba[d.v_heads + h] as f64 + dt_bias[h] as f64;
                let g = -(a_log[h] as f64).exp() * (1.0 + x.exp()).ln();
                let s = &mut s64[h * 12..(h + 1) * 12];
                s.iter_mut().for_each(|x| *x *= g.exp());
                let mut delta = [0f64; 3];
                for j in 0..3 {
                    let mem: f64 = (0..4).map(|i| s[i * 3 + j] * k[i]).sum();
                    delta[j] = (v[j] - mem) * beta;
                }
                for i in 0..4 {
                    for j in 0..3 {
                        s[i * 3 + j] += k[i] * delta[j];
                    }
                }
                let o: Vec<f64> = (0..3).map(|j| (0..4).map(|i| s[i * 3 + j] * q[i]).sum()).collect();
                let inv = 1.0 / (o.iter().map(|x| x * x).sum::<f64>() / 3.0 + 1e-6).sqrt();
                for j in 0..3 {
                    let z = qkvz[2 * kd + 12 + h * 3 + j] as f64;
                    let want = o[j] * inv * norm[j] as f64 * z / (1.0 + (-z).exp());
                    let got = out[h * 3 + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * (1.0 + want.abs()),
                        "token {t} head {h} dim {j}: {got} vs {want}"
                    );
                }
            }
        }
        for (a, b) in st.iter().zip(&s64) {
            assert!((*a as f64 - b).abs() < 1e-5, "state {a} vs {b}");
        }
    }
}
