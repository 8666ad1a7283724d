//! Small building blocks shared by model families (norms, SwiGLU, softmax, loading).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use strata_kernels::{qmatmul, ElementType, QMatrix, QuantKind};
use strata_storage::WeightStore;

/// Loads a tensor as f32 on `device`, checking its shape against the config.
pub fn load(
    store: &WeightStore,
    name: &str,
    shape: &[usize],
    fp8_block: Option<(usize, usize)>,
    device: &Device,
) -> Result<Tensor> {
    let data = store.load_f32(name, shape, fp8_block)?;
    Ok(Tensor::from_vec(data, shape, device)?)
}

/// A linear layer's weight `[out, in]`: f32 in a tensor, or bf16 kept as stored (half
/// the memory and the bytes a decode step reads; exact, since bf16 -> f32 is) and
/// multiplied by strata-kernels.
pub enum Weight {
    Dense(Tensor),
    Bf16 { rows: usize, cols: usize, payload: Vec<u8> },
}

impl Weight {
    /// bf16 checkpoints stay bf16; everything else (f32, f16, FP8, quantized) decodes
    /// to f32.
    pub fn load(
        store: &WeightStore,
        name: &str,
        shape: &[usize],
        fp8: Option<(usize, usize)>,
        device: &Device,
    ) -> Result<Self> {
        if let (Some((file, t)), [rows, cols]) = (store.get(name), shape) {
            if t.dtype == ElementType::BF16 && t.shape == shape {
                let payload = file.bytes(t)?.to_vec();
                file.release(t);
                return Ok(Self::Bf16 { rows: *rows, cols: *cols, payload });
            }
        }
        Ok(Self::Dense(load(store, name, shape, fp8, device)?))
    }

    pub fn out_dim(&self) -> usize {
        match self {
            Self::Dense(t) => t.dims()[0],
            Self::Bf16 { rows, .. } => *rows,
        }
    }

    /// Rows `ids` of the matrix as an f32 tensor `[ids.len(), cols]` (embedding lookup).
    pub fn rows(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            Self::Dense(t) => Ok(t.index_select(&Tensor::from_vec(ids.to_vec(), ids.len(), device)?, 0)?),
            Self::Bf16 { rows, cols, payload } => {
                let mut out = vec![0f32; ids.len() * cols];
                for (dst, &id) in out.chunks_exact_mut(*cols).zip(ids) {
                    anyhow::ensure!((id as usize) < *rows, "row {id} out of range ({rows} rows)");
                    let src = &payload[id as usize * cols * 2..(id as usize + 1) * cols * 2];
                    strata_kernels::decode_to_f32(ElementType::BF16, src, dst).map_err(anyhow::Error::msg)?;
                }
                Ok(Tensor::from_vec(out, (ids.len(), *cols), device)?)
            }
        }
    }
}

/// `x @ w^T` for a weight `[out, in]`; `x` is `[.., in]`.
pub fn linear(x: &Tensor, w: &Weight) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inner = *dims.last().unwrap();
    let rows = x.elem_count() / inner.max(1);
    let y = match w {
        Weight::Dense(t) => x.reshape((rows, inner))?.matmul(&t.t()?)?,
        Weight::Bf16 { rows: out, cols, payload } => {
            anyhow::ensure!(*cols == inner, "linear: input width {inner}, weight expects {cols}");
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            let mut y = vec![0f32; rows * out];
            let m = QMatrix { kind: QuantKind::Bf16, rows: *out, cols: *cols, payload, scales: &[] };
            qmatmul(&xs, rows, &m, &mut y);
            Tensor::from_vec(y, (rows, *out), x.device())?
        }
    };
    let mut out_dims = dims;
    *out_dims.last_mut().unwrap() = w.out_dim();
    Ok(y.reshape(out_dims)?)
}

/// RMSNorm with a learned scale: `w * x / sqrt(mean(x^2) + eps)`.
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = x.broadcast_div(&(ms + self.eps)?.sqrt()?)?;
        Ok(normed.broadcast_mul(&self.weight)?)
    }
}

/// LayerNorm with scale and bias (population variance).
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(normed.broadcast_mul(&self.weight)?.broadcast_add(&self.bias)?)
    }
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, weights `[out, in]`.
pub struct SwiGlu {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

impl SwiGlu {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (linear(x, &self.gate)?.silu()? * linear(x, &self.up)?)?;
        linear(&h, &self.down)
    }
}

/// Softmax over the last dimension in f32 (masked entries may be -inf).
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&sum)?)
}

pub fn zeros(shape: &[usize], device: &Device) -> Result<Tensor> {
    Ok(Tensor::zeros(shape, DType::F32, device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        // Small LCG: deterministic, non-zero, both signs.
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn norms_and_swiglu_match_plain_loops() {
        let dev = Device::Cpu;
        let (rows, n, hid) = (3usize, 8usize, 5usize);
        let x = rand_vec(rows * n, 1);
        let w = rand_vec(n, 2);
        let b = rand_vec(n, 3);
        let xt = Tensor::from_vec(x.clone(), (rows, n), &dev).unwrap();
        let rms = RmsNorm { weight: Tensor::from_vec(w.clone(), n, &dev).unwrap(), eps: 1e-5 };
        let ln = LayerNorm {
            weight: Tensor::from_vec(w.clone(), n, &dev).unwrap(),
            bias: Tensor::from_vec(b.clone(), n, &dev).unwrap(),
            eps: 1e-6,
        };
        let got_rms = rms.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
        let got_ln = ln.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
        for r in 0..rows {
            let row = &x[r * n..(r + 1) * n];
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n as f64;
            let mean = row.iter().map(|v| *v as f64).sum::<f64>() / n as f64;
            let var = row.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
            for i in 0..n {
                let want = w[i] as f64 * row[i] as f64 / (ms + 1e-5).sqrt();
                assert!((got_rms[r][i] as f64 - want).abs() < 1e-5);
                let want = (row[i] as f64 - mean) / (var + 1e-6).sqrt() * w[i] as f64 + b[i] as f64;
                assert!((got_ln[r][i] as f64 - want).abs() < 1e-5);
            }
        }
        let (g, u, d) = (rand_vec(hid * n, 4), rand_vec(hid * n, 5), rand_vec(n * hid, 6));
        let mlp = SwiGlu {
            gate: Weight::Dense(Tensor::from_vec(g.clone(), (hid, n), &dev).unwrap()),
            up: Weight::Dense(Tensor::from_vec(u.clone(), (hid, n), &dev).unwrap()),
            down: Weight::Dense(Tensor::from_vec(d.clone(), (n, hid), &dev).unwrap()),
        };
        let got = mlp.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
        for r in 0..rows {
            let row = &x[r * n..(r + 1) * n];
            let h: Vec<f64> = (0..hid)
                .map(|j| {
                    let gv: f64 = (0..n).map(|i| g[j * n + i] as f64 * row[i] as f64).sum();
                    let uv: f64 = (0..n).map(|i| u[j * n + i] as f64 * row[i] as f64).sum();
                    gv / (1.0 + (-gv).exp()) * uv
                })
                .collect();
            for o in 0..n {
                let want: f64 = (0..hid).map(|j| d[o * hid + j] as f64 * h[j]).sum();
                assert!((got[r][o] as f64 - want).abs() < 1e-5, "{} vs {want}", got[r][o]);
            }
        }
    }

    #[test]
    fn softmax_handles_masked_entries() {
        let dev = Device::Cpu;
        let x = Tensor::from_vec(vec![1.0f32, f32::NEG_INFINITY, 3.0], (1, 3), &dev).unwrap();
        let p = softmax_last(&x).unwrap().to_vec2::<f32>().unwrap();
        let e = (1.0f64 - 3.0).exp();
        assert!((p[0][0] as f64 - e / (1.0 + e)).abs() < 1e-7);
        assert_eq!(p[0][1], 0.0);
    }
}
