//! Where every routed expert is right now, for dashboards: per MoE layer, each expert's
//! tier (the GPU slab, the host slab, disk, or resident with the model's weights), whether
//! it is pinned, and its selections in the usage ledger.

use crate::LoadedModel;
use serde::Serialize;
use strata_residency::{ResidencyEntry, SlotPhase, SlotRole};

#[derive(Clone, Debug, Serialize)]
pub struct ExpertResidency {
    /// The model's MoE layers (model layer ids), in order.
    pub layers: Vec<usize>,
    pub experts_per_layer: usize,
    /// Per layer, one letter an expert: `g` GPU slab, `h` host slab, `d` disk only, `r`
    /// resident (the weights loaded whole, nothing streamed); upper case where pinned.
    pub tiers: Vec<String>,
    /// Per layer, each expert's selections in the usage ledger, where one is kept.
    pub counts: Option<Vec<Vec<u32>>>,
    /// Whether the experts stream (a slab in front of the container).
    pub streamed: bool,
    /// Whether a GPU slab sits in front of the host one.
    pub gpu_tier: bool,
}

impl LoadedModel {
    /// The live residency of every routed expert; `None` for a model without MoE layers.
    pub fn expert_residency(&self) -> Option<ExpertResidency> {
        let moe = self.arch.moe()?;
        let n = moe.experts_per_layer;
        let streamed = self.experts.is_some();
        let row = |layer: usize| moe.layers.iter().position(|&l| l == layer);
        let mut cells = vec![vec![if streamed { b'd' } else { b'r' }; n]; moe.layers.len()];
        let mut place = |entries: Vec<ResidencyEntry>, tier: u8| {
            for e in entries {
                let ready = matches!(e.phase, SlotPhase::Ready | SlotPhase::Leased);
                if let (true, Some(r)) = (ready, row(e.layer)) {
                    if let Some(c) = cells[r].get_mut(e.expert) {
                        *c = if e.role == SlotRole::Pinned { tier.to_ascii_uppercase() } else { tier };
                    }
                }
            }
        };
        let mut counts = None;
        if let Some(rt) = &self.experts {
            place(rt.residency_map(), b'h');
            if let Some(ledger) = rt.ledger() {
                let l = ledger.lock().unwrap_or_else(|e| e.into_inner());
                counts = Some(moe.layers.iter().map(|&layer| (0..n).map(|e| l.count(layer, e)).collect()).collect());
            }
        }
        #[cfg(feature = "cuda")]
        let gpu_tier = match self.gpu_tiers.first() {
            Some(g) => {
                place(g.residency_map(), b'g');
                true
            }
            None => false,
        };
        #[cfg(not(feature = "cuda"))]
        let gpu_tier = false;
        Some(ExpertResidency {
            layers: moe.layers.clone(),
            experts_per_layer: n,
            tiers: cells.into_iter().map(|c| String::from_utf8(c).expect("ASCII")).collect(),
            counts,
            streamed,
            gpu_tier,
        })
    }
}
