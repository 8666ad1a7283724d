//! Rotary position embeddings as `config.json` describes them: plain RoPE, or YaRN
//! (DeepSeek-V3, Kimi K2, gpt-oss), which blends interpolated and extrapolated frequencies
//! across a ramp and scales attention. transformers' `modeling_rope_utils` is the reference.

use crate::fields::Fields;
use anyhow::{bail, Result};
use serde_json::Value;

/// A model's rotary embedding: the base and, for YaRN, the context extension.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub yarn: Option<Yarn>,
}

/// YaRN's parameters, as transformers resolves them.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Whether the correction range is rounded outwards to whole dimensions.
    pub truncate: bool,
    /// What cos and sin are multiplied by.
    pub attention_factor: f64,
    /// DeepSeek's `mscale_all_dim`: its attention multiplies the softmax scale by
    /// `mscale(factor, mscale_all_dim)^2` (0: not at all).
    pub mscale_all_dim: f64,
}

/// YaRN's magnitude correction for a context `scale` times longer.
fn mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Rope {
    pub fn plain(theta: f64) -> Self {
        Self { theta, yarn: None }
    }

    /// The inverse frequencies over `dim` rotated dimensions (`dim / 2` of them).
    pub fn inv_freq(&self, dim: usize) -> Vec<f32> {
        let plain = strata_kernels::ops::rope_inv_freq(dim, self.theta);
        let Some(y) = &self.yarn else { return plain };
        // The dimension whose wavelength fits `rotations` turns into the original context.
        let correction = |rotations: f64| {
            dim as f64 * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * self.theta.ln())
        };
        let (mut low, mut high) = (correction(y.beta_fast), correction(y.beta_slow));
        if y.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        plain
            .iter()
            .enumerate()
            .map(|(i, &extrapolated)| {
                // f32 like torch: the ramp and the blend.
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                let interpolated = extrapolated / y.factor as f32;
                interpolated * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }

    /// What cos and sin are multiplied by (1 without YaRN).
    pub fn attention_factor(&self) -> f64 {
        self.yarn.as_ref().map_or(1.0, |y| y.attention_factor)
    }

    /// The factor DeepSeek's MLA multiplies its softmax scale by (1 without YaRN).
    pub fn deepseek_softmax_factor(&self) -> f64 {
        match &self.yarn {
            Some(y) if y.mscale_all_dim != 0.0 => mscale(y.factor, y.mscale_all_dim).powi(2),
            _ => 1.0,
        }
    }
}

impl Fields<'_> {
    /// The rotary embedding from `rope_parameters` (or the legacy `rope_scaling` and
    /// top-level fields): `default` or `yarn`; any other type is refused by name.
    pub(crate) fn rope_kind(&self, theta_default: f64) -> Result<Rope> {
        let num = |k: &str| self.rope_number(k);
        let theta = self.rope_param("rope_theta", theta_default)?;
        if !(theta > 1.0 && theta.is_finite()) {
            bail!("field `rope_theta` must be a finite number above 1, got {theta}");
        }
        let kind = self.rope_type()?;
        match kind {
            "default" => Ok(Rope::plain(theta)),
            "yarn" => {
                let original = match self.get("original_max_position_embeddings") {
                    Some(_) => self.usize_req("original_max_position_embeddings")? as f64,
                    None => match num("original_max_position_embeddings")? {
                        Some(v) => v,
                        None => self.usize_req("max_position_embeddings")? as f64,
                    },
                };
                let factor = match num("factor")? {
                    Some(f) => f,
                    None => self.usize_req("max_position_embeddings")? as f64 / original,
                };
                if factor < 1.0 || !factor.is_finite() {
                    bail!("field `rope_parameters.factor` must be at least 1, got {factor}");
                }
                if original < 1.0 || !original.is_finite() {
                    bail!("field `rope_parameters.original_max_position_embeddings` must be positive");
                }
                let (m, m_all) = (num("mscale")?.unwrap_or(0.0), num("mscale_all_dim")?.unwrap_or(0.0));
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None if m != 0.0 && m_all != 0.0 => mscale(factor, m) / mscale(factor, m_all),
                    None => mscale(factor, 1.0),
                };
                let truncate = match self.rope_params()?.and_then(|p| p.get("truncate")) {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => bail!("field `rope_parameters.truncate` must be a boolean, got {v}"),
                };
                // transformers treats 0 as absent here (`or 32`).
                let beta = |k: &str, d: f64| -> Result<f64> { Ok(num(k)?.filter(|v| *v != 0.0).unwrap_or(d)) };
                Ok(Rope {
                    theta,
                    yarn: Some(Yarn {
                        factor,
                        original_max_position_embeddings: original,
                        beta_fast: beta("beta_fast", 32.0)?,
                        beta_slow: beta("beta_slow", 1.0)?,
                        truncate,
                        attention_factor,
                        mscale_all_dim: m_all,
                    }),
                })
            }
            other => bail!("field `rope_parameters.rope_type` is `{other}`; strata runs `default` and `yarn` RoPE"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rope(j: Value) -> Result<Rope> {
        Fields(j.as_object().unwrap()).rope_kind(10000.0)
    }

    #[test]
    fn default_rope_keeps_the_plain_frequencies() {
        let r = rope(json!({"rope_theta": 500.0})).unwrap();
        assert_eq!(r, Rope::plain(500.0));
        assert_eq!(r.inv_freq(8), strata_kernels::ops::rope_inv_freq(8, 500.0));
        assert_eq!((r.attention_factor(), r.deepseek_softmax_factor()), (1.0, 1.0));
    }

    /// Values from transformers 5.17's `_compute_yarn_parameters` (DeepSeek-V3's
    /// parameters over 64 rotated dimensions, and gpt-oss's without truncation).
    #[test]
    fn yarn_matches_transformers() {
        let ds = rope(json!({"max_position_embeddings": 163840, "rope_scaling": {"type": "yarn", "factor": 40,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0}, "rope_theta": 10000}))
        .unwrap();
        let f = ds.inv_freq(64);
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[31], strata_kernels::ops::rope_inv_freq(64, 10000.0)[31] / 40.0);
        assert_eq!(ds.attention_factor(), 1.0);
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((ds.deepseek_softmax_factor() - m * m).abs() < 1e-12);
        let oss = rope(json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096}}))
        .unwrap();
        assert!((oss.attention_factor() - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(oss.deepseek_softmax_factor(), 1.0);
        // The ramp's ends, unrounded: low = 8.0927..., high = 17.3980... over 32 pairs.
        let f = oss.inv_freq(64);
        let plain = strata_kernels::ops::rope_inv_freq(64, 150000.0);
        assert_eq!(f[8], plain[8]);
        assert_eq!(f[18], plain[18] / 32.0);
        assert!(f[12] < plain[12] && f[12] > plain[12] / 32.0);
    }

    #[test]
    fn other_kinds_and_bad_values_are_refused_by_name() {
        let err = |j| rope(j).unwrap_err().to_string();
        assert!(err(json!({"rope_scaling": {"type": "longrope"}})).contains("`longrope`"));
        assert!(err(json!({"rope_scaling": {"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8}}))
            .contains("factor"));
        assert!(err(
            json!({"rope_parameters": {"rope_type": "yarn", "factor": "x", "original_max_position_embeddings": 8}})
        )
        .contains("factor"));
        assert!(err(json!({"rope_parameters": {"rope_type": "yarn", "factor": 2, "truncate": 1,
            "original_max_position_embeddings": 8}}))
        .contains("truncate"));
        assert!(err(json!({"rope_theta": -1.0})).contains("rope_theta"));
    }
}
