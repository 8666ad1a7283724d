//! DeepSeek-V3 `noaux_tc` routing and the MoE block (routed experts + shared expert).

use crate::experts::{ExpertBackend, Routing};
use crate::nn::SwiGlu;
use anyhow::Result;
use candle_core::Tensor;
use std::sync::Arc;

pub struct RouterParams {
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
}

/// Routes one row from its router logits: `s = sigmoid(logits)`; choose the top-k of
/// `s + bias` within the best `topk_group` groups (group score = sum of its two best);
/// weights are `s` at the chosen ids, normalised (+1e-20) if asked, times the scaling.
/// Exact ties go to the lower expert (or group) id.
pub fn route(logits: &[f32], bias: &[f32], p: &RouterParams) -> Routing {
    let n = logits.len();
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let per_group = n / p.n_group;
    let mut allowed = vec![true; n];
    if p.n_group > 1 {
        let mut groups: Vec<(usize, f32)> = (0..p.n_group)
            .map(|g| {
                let mut v: Vec<f32> = choice[g * per_group..(g + 1) * per_group].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                (g, v[0] + v[1])
            })
            .collect();
        groups.sort_by(|a, b| b.1.total_cmp(&a.1)); // stable: ties keep the lower group
        allowed.iter_mut().for_each(|a| *a = false);
        for &(g, _) in &groups[..p.topk_group] {
            allowed[g * per_group..(g + 1) * per_group].iter_mut().for_each(|a| *a = true);
        }
    }
    let mut ids: Vec<usize> = (0..n).filter(|&e| allowed[e]).collect();
    ids.sort_by(|&a, &b| choice[b].total_cmp(&choice[a])); // stable: ties keep the lower id
    ids.truncate(p.top_k);
    let mut weights: Vec<f32> = ids.iter().map(|&e| scores[e]).collect();
    if p.norm_topk_prob {
        let denom = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= denom);
    }
    weights.iter_mut().for_each(|w| *w *= p.scaling);
    Routing { experts: ids, weights }
}

/// Where a layer's routed experts run.
pub enum Experts {
    /// f32 candle tensors held by the model (HF checkpoints).
    Tensors(Vec<SwiGlu>),
    /// A backend (slab + streaming) for container checkpoints.
    Backend(Arc<dyn ExpertBackend>),
}

pub struct MoeBlock {
    pub layer: usize,
    /// Router weight `[experts, hidden]`, kept in f32 as the reference does.
    pub gate: Tensor,
    pub bias: Vec<f32>,
    pub params: RouterParams,
    pub experts: Experts,
    pub shared: SwiGlu,
}

impl MoeBlock {
    /// Routes `x` (`[T, hidden]`, already normed) without running any expert.
    pub fn route_rows(&self, x: &Tensor) -> Result<Vec<Routing>> {
        let logits = x.matmul(&self.gate.t()?)?.to_vec2::<f32>()?;
        Ok(logits.iter().map(|l| route(l, &self.bias, &self.params)).collect())
    }

    /// The backend, when this layer's experts run on one.
    pub fn backend(&self) -> Option<&Arc<dyn ExpertBackend>> {
        match &self.experts {
            Experts::Backend(b) => Some(b),
            Experts::Tensors(_) => None,
        }
    }

    /// `x`: `[T, hidden]`. Each routed expert runs once over all rows that chose it
    /// (batch union), in ascending expert order; then the shared expert is added.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Vec<Routing>)> {
        let routes = self.route_rows(x)?;
        let experts = match &self.experts {
            Experts::Tensors(e) => e,
            Experts::Backend(b) => {
                let (rows, hidden) = x.dims2()?;
                let y = b.forward(self.layer, &x.flatten_all()?.to_vec1::<f32>()?, rows, &routes)?;
                let y = Tensor::from_vec(y, (rows, hidden), x.device())?;
                return Ok(((y + self.shared.forward(x)?)?, routes));
            }
        };
        let mut by_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); experts.len()];
        for (row, r) in routes.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                by_expert[e].push((row as u32, w));
            }
        }
        let mut out = x.zeros_like()?;
        for (e, rows) in by_expert.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let idx: Vec<u32> = rows.iter().map(|r| r.0).collect();
            let w: Vec<f32> = rows.iter().map(|r| r.1).collect();
            let idx = Tensor::from_vec(idx, rows.len(), x.device())?;
            let w = Tensor::from_vec(w, (rows.len(), 1), x.device())?;
            let y = experts[e].forward(&x.index_select(&idx, 0)?)?.broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        Ok(((out + self.shared.forward(x)?)?, routes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(top_k: usize, n_group: usize, topk_group: usize) -> RouterParams {
        RouterParams { top_k, n_group, topk_group, norm_topk_prob: true, scaling: 2.5 }
    }

    #[test]
    fn picks_by_biased_score_weights_by_unbiased() {
        let logits = [0.0f32, 2.0, -1.0, 1.0];
        let bias = [0.0f32, 0.0, 5.0, 0.0];
        let r = route(&logits, &bias, &params(2, 1, 1));
        assert_eq!(r.experts, vec![2, 1]);
        let s = |l: f32| 1.0 / (1.0 + (-l).exp());
        let denom = s(-1.0) + s(2.0) + 1e-20;
        assert!((r.weights[0] - s(-1.0) / denom * 2.5).abs() < 1e-6);
        assert!((r.weights[1] - s(2.0) / denom * 2.5).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_lower_id_and_groups_limit_choice() {
        let r = route(&[1.0, 1.0, 1.0, 1.0], &[0.0; 4], &params(2, 1, 1));
        assert_eq!(r.experts, vec![0, 1]);
        // Group 1 (experts 2,3) has the best pair sum even though expert 0 is the best single.
        let r = route(&[3.0, -5.0, 2.0, 2.0], &[0.0; 4], &params(2, 2, 1));
        assert_eq!(r.experts, vec![2, 3]);
    }
}
