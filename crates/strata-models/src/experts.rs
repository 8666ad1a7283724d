//! The seam between a model's MoE layers and where routed experts live.
//!
//! A model routes; an [`ExpertBackend`] runs the chosen experts. Resident candle tensors
//! (HF checkpoints) run inside the model; container checkpoints run through a backend
//! that keeps experts in a slab and streams misses from disk (strata-engine).

use anyhow::Result;

/// One row's routing: expert ids (in selection order) and their gate weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

pub trait ExpertBackend: Send + Sync {
    /// For MoE layer `layer` (model layer id) and `x` (`rows x hidden`, row-major),
    /// returns `rows x hidden`: each row's `sum_e w_e * Expert_e(x_row)` over its routing,
    /// accumulated in ascending expert id, so any backend gives the same bits for the
    /// same expert bytes.
    fn forward(&self, layer: usize, x: &[f32], rows: usize, routes: &[Routing]) -> Result<Vec<f32>>;

    /// Whether the model should predict the next layer's routing (PILOT) for
    /// [`ExpertBackend::predicted`]; computing it costs one router product per layer.
    fn wants_prediction(&self) -> bool {
        false
    }

    /// The predicted routing of `layer`, made one layer ahead (after the previous layer's
    /// attention, from its residual). Advisory: it must not change what `forward` returns.
    fn predicted(&self, _layer: usize, _routes: &[Routing]) {}
}

/// Adds `w * y` into `out` for each (row, weight), experts in ascending id: the one
/// accumulation order every backend uses.
pub fn accumulate_ascending<'a>(
    out: &mut [f32],
    hidden: usize,
    routes: &[Routing],
    mut expert_rows: impl FnMut(usize, usize) -> Option<&'a [f32]>,
) {
    for (r, route) in routes.iter().enumerate() {
        let mut order: Vec<(usize, f32)> = route.experts.iter().copied().zip(route.weights.iter().copied()).collect();
        order.sort_by_key(|&(e, _)| e);
        let dst = &mut out[r * hidden..(r + 1) * hidden];
        for (e, w) in order {
            if let Some(y) = expert_rows(e, r) {
                for (d, v) in dst.iter_mut().zip(y) {
                    *d += w * v;
                }
            }
        }
    }
}
