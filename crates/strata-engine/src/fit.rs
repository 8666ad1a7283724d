//! The memory plan of a model directory, from headers alone: resident weights, KV cache,
//! transients, reserve, and (for expert containers) the slab the rest of the budget buys.

use crate::experts::open_source;
use anyhow::{anyhow, Result};
use serde::Serialize;
use std::path::Path;
use strata_models::glm_moe_dsa::{memory_needs, GlmMoeDsaConfig};
use strata_residency::{plan, FitItem, FitReport, PlanError, PlanInput, ResidencyPlan};
use strata_storage::WeightStore;

/// The process's own baseline (binary, libraries, tokenizer, thread stacks: 13-16 MiB
/// measured with the fixtures and strata-tiny) plus allocator margin. A constant, so
/// plans are reproducible; the peak-RSS test holds runs to it.
pub const RUNTIME_RESERVE: u64 = 32 << 20;

#[derive(Clone, Debug)]
pub struct FitOptions {
    pub budget: Option<u64>,
    pub context: usize,
    pub working_slots: usize,
    pub pinned: usize,
    pub max_slots_per_layer: Option<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Fit {
    pub report: FitReport,
    /// None when the budget cannot hold the plan (`report.fits` is then false).
    pub plan: Option<ResidencyPlan>,
    #[serde(skip)]
    pub error: Option<String>,
    pub slot_bytes: u64,
    pub expert_bytes_total: u64,
    pub streamed: bool,
}

pub fn fixed_items(cfg: &GlmMoeDsaConfig, store: &WeightStore, context: usize) -> Vec<FitItem> {
    let needs = memory_needs(cfg, store, context, crate::generate::PREFILL_CHUNK);
    vec![
        FitItem::new("resident weights (as held: bf16 or f32)", needs.resident_weight_bytes),
        FitItem::new(format!("KV cache ({context} positions)"), needs.kv_cache_bytes),
        FitItem::new(
            "transients (prefill chunk activations, or one tensor's pages while loading)",
            needs.activation_bytes.max(needs.largest_tensor_stored_bytes),
        ),
        FitItem::new("runtime reserve (process baseline + allocator margin)", RUNTIME_RESERVE),
    ]
}

/// Plans a model directory. With an expert container and a budget: the slab the budget
/// buys (refused with every number when one slot per layer does not fit). Without a
/// budget: everything resident.
pub fn fit_dir(dir: &Path, cfg: &GlmMoeDsaConfig, store: &WeightStore, opts: &FitOptions) -> Result<Fit> {
    let items = fixed_items(cfg, store, opts.context);
    let fixed: u64 = items.iter().map(|i| i.bytes).sum();
    let Some(source) = open_source(dir)? else {
        // An HF checkpoint: everything is resident, experts included (as f32).
        let experts = strata_models::glm_moe_dsa::inspect(cfg, store);
        let routed =
            experts.groups.get(&strata_models::glm_moe_dsa::TensorGroup::RoutedExperts).map_or(0, |g| g.parameters * 4);
        let mut all = items;
        all.push(FitItem::new("routed experts (f32, resident)", routed));
        let total: u64 = all.iter().map(|i| i.bytes).sum();
        let report = FitReport::new(opts.budget.unwrap_or(total), all);
        return Ok(Fit { report, plan: None, error: None, slot_bytes: 0, expert_bytes_total: routed, streamed: false });
    };
    let slot = source.slot_bytes() as u64;
    let per_layer = source.experts_per_layer();
    let layers = source.layers().len();
    let max_per_layer = Some(opts.max_slots_per_layer.unwrap_or(per_layer).min(per_layer));
    let input = PlanInput {
        budget_bytes: opts.budget.unwrap_or(u64::MAX / 4),
        fixed_bytes: fixed,
        slot_bytes: slot,
        sparse_layers: layers,
        working_slots: opts.working_slots.min(per_layer).max(1),
        pinned_experts: opts.pinned,
        max_slots_per_layer: max_per_layer,
    };
    let total = slot * (layers * per_layer) as u64;
    match plan(input) {
        Ok(p) => {
            let mut report = p.fit_report(items);
            if opts.budget.is_none() {
                report = FitReport::new(report.total, report.items);
            }
            Ok(Fit { report, plan: Some(p), error: None, slot_bytes: slot, expert_bytes_total: total, streamed: true })
        }
        Err(e @ PlanError::DoesNotFit { .. }) => {
            let mut all = items;
            all.push(FitItem::new(
                format!(
                    "expert slab minimum: ({} working + {} pinned + {layers} layers) x {slot}",
                    input.working_slots, input.pinned_experts
                ),
                (input.working_slots + input.pinned_experts + layers) as u64 * slot,
            ));
            let report = FitReport::new(input.budget_bytes, all);
            Ok(Fit {
                report,
                plan: None,
                error: Some(e.to_string()),
                slot_bytes: slot,
                expert_bytes_total: total,
                streamed: true,
            })
        }
        Err(e) => Err(anyhow!("{}: {e}", dir.display())),
    }
}
