//! The engine's view of the streamed experts (strata-experts), and the draft (MTP)
//! layer's own expert tier, which depends on the model's load options.

#[cfg(feature = "cuda")]
pub use strata_experts::gpu;
pub use strata_experts::telemetry;
pub use strata_experts::{
    is_container, open_source, open_tier, ColibriSource, ContainerSource, ExpertSource, PilotMode, RuntimeOptions,
    RuntimeReport, SharedLedger, StreamedExperts, UsageSetting,
};

use crate::model_dir::LoadOptions;
use anyhow::Result;
use std::path::Path;
use std::sync::Arc;
use strata_models::Arch;
use strata_residency::{plan, PlanInput};

/// Draft rows a round carries (at most): the draft tier's working bank holds the top-k of
/// this many rows, so a round's misses load in one wave.
pub const DRAFT_WORKING_ROWS: usize = 4;

/// The slab bytes of the draft (MTP) tier of the container in `dir`, if it has one; for an
/// HF checkpoint with a draft layer, of the tier its container will have (the int8 tier
/// autoconversion writes), so that a plan is the same before the conversion and after.
pub fn draft_slab_bytes(dir: &Path, arch: &dyn Arch, store: &strata_storage::WeightStore) -> Result<Option<u64>> {
    let Some(moe) = arch.moe() else { return Ok(None) };
    let slot = match open_tier(dir, &moe, "mtp")? {
        Some(source) => source.slot_bytes() as u64,
        None if !is_container(dir) && arch.has_draft(store) && !moe.mtp_layers.is_empty() => {
            let kind = crate::autoconvert::MTP_EXPERTS;
            strata_storage::ExpertLayout::new(kind, kind, moe.hidden, moe.inter).slot_bytes as u64
        }
        None => return Ok(None),
    };
    Ok(Some(slot * (moe.top_k * DRAFT_WORKING_ROWS + 1) as u64))
}

/// The draft (MTP) layer's experts of the container in `dir`: the int8 tier streamed
/// through its own small slab (top-k times [`DRAFT_WORKING_ROWS`] working slots and one
/// layer slot), counting into the main tier's ledger; when the budget's headroom (what
/// the main plan leaves unused, `headroom` bytes) holds the whole tier, every draft
/// expert gets a slot. None when the container has no draft tier (the model then runs
/// without speculation).
pub fn draft_experts(
    dir: &Path,
    arch: &dyn Arch,
    opts: &LoadOptions,
    main: &Arc<StreamedExperts>,
    headroom: u64,
) -> Result<Option<Arc<StreamedExperts>>> {
    let Some(moe) = arch.moe() else { return Ok(None) };
    let Some(source) = open_tier(dir, &moe, "mtp")? else {
        eprintln!("strata: {}: no MTP expert tier in the container; decoding without the draft layer", dir.display());
        return Ok(None);
    };
    let slot = source.slot_bytes() as u64;
    let working = moe.top_k * DRAFT_WORKING_ROWS;
    let layers = source.layers().len();
    // The small slab is counted in the plan; the rest of the tier must fit the headroom.
    let whole_tier = (layers * source.experts_per_layer()).saturating_sub(layers) as u64 * slot;
    let per_layer = if whole_tier <= headroom { source.experts_per_layer() } else { 1 };
    let p = plan(PlanInput {
        budget_bytes: (working + layers * per_layer) as u64 * slot,
        fixed_bytes: 0,
        slot_bytes: slot,
        sparse_layers: layers,
        working_slots: working,
        pinned_experts: 0,
        max_slots_per_layer: Some(per_layer),
    })
    .map_err(|e| anyhow::anyhow!("{}: draft tier: {e}", dir.display()))?;
    let rt = RuntimeOptions {
        pins: Vec::new(),
        auto_pin: false,
        live_repin: false,
        pilot: PilotMode::Off,
        ..opts.runtime.clone()
    };
    let draft = StreamedExperts::new(source, p, &[], main.ledger().cloned(), &rt, None)?.share_ledger();
    if opts.budget.is_none() {
        draft.preload_all()?;
    }
    Ok(Some(Arc::new(draft)))
}
