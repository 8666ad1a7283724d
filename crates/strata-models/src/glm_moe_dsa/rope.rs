//! Interleaved rotary embedding (DeepSeek layout): pairs `(x0,x1), (x2,x3), ...` rotate by
//! one frequency each, and the result is emitted de-interleaved as `cat(even', odd')`,
//! exactly as transformers does for both queries and keys (so dot products agree).

use anyhow::Result;
use candle_core::{Device, Tensor, D};

pub struct Rope {
    inv_freq: Vec<f32>,
    device: Device,
}

/// cos/sin tables for a run of positions, each `[T, dim/2]`.
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl Rope {
    pub fn new(dim: usize, theta: f64, device: &Device) -> Self {
        let inv_freq = (0..dim / 2).map(|i| (1.0 / theta.powf((2 * i) as f64 / dim as f64)) as f32).collect();
        Self { inv_freq, device: device.clone() }
    }

    pub fn tables(&self, start: usize, len: usize) -> Result<RopeTables> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(len * half);
        let mut sin = Vec::with_capacity(len * half);
        for p in start..start + len {
            for &f in &self.inv_freq {
                // f32 product then cos/sin, as torch computes `position.float() * inv_freq`.
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (len, half), &self.device)?,
            sin: Tensor::from_vec(sin, (len, half), &self.device)?,
        })
    }
}

/// Rotates `x` of shape `[T, heads, dim]` (dim = 2 * half) with tables `[T, half]`.
pub fn apply_interleaved(x: &Tensor, t: &RopeTables) -> Result<Tensor> {
    let (n, heads, dim) = x.dims3()?;
    let pairs = x.reshape((n, heads, dim / 2, 2))?;
    let even = pairs.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
    let odd = pairs.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
    let cos = t.cos.unsqueeze(1)?;
    let sin = t.sin.unsqueeze(1)?;
    let a = (even.broadcast_mul(&cos)? - odd.broadcast_mul(&sin)?)?;
    let b = (odd.broadcast_mul(&cos)? + even.broadcast_mul(&sin)?)?;
    Ok(Tensor::cat(&[a, b], D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_plain_rotation() {
        let dev = Device::Cpu;
        let (n, heads, dim) = (3usize, 2usize, 6usize);
        let x: Vec<f32> = (0..n * heads * dim).map(|i| ((i * 7919) % 13) as f32 / 5.0 - 1.1).collect();
        let rope = Rope::new(dim, 10000.0, &dev);
        let t = rope.tables(5, n).unwrap();
        let got = apply_interleaved(&Tensor::from_vec(x.clone(), (n, heads, dim), &dev).unwrap(), &t)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for p in 0..n {
            for h in 0..heads {
                for i in 0..dim / 2 {
                    let f = 1.0 / 10000f64.powf((2 * i) as f64 / dim as f64);
                    let ang = (5 + p) as f64 * f;
                    let base = (p * heads + h) * dim;
                    let (x0, x1) = (x[base + 2 * i] as f64, x[base + 2 * i + 1] as f64);
                    let want_a = x0 * ang.cos() - x1 * ang.sin();
                    let want_b = x1 * ang.cos() + x0 * ang.sin();
                    assert!((got[base + i] as f64 - want_a).abs() < 1e-5);
                    assert!((got[base + dim / 2 + i] as f64 - want_b).abs() < 1e-5);
                }
            }
        }
    }
}
