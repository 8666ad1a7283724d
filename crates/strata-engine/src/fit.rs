//! The memory plan of a model directory, from headers alone: resident weights, KV cache,
//! transients, reserve, and (for streamed experts) the slab the rest of the budget buys.
//! One plan for every command: `strata fit`, `generate`, `chat`, `serve` and `bench`
//! call this with the same inputs, and an HF checkpoint is planned as the expert
//! container a budget would convert it into.

use crate::experts::{open_source, RuntimeOptions};
use anyhow::{anyhow, Result};
use serde::Serialize;
use std::path::Path;
use strata_models::{Arch, MoeLayout};
use strata_residency::{plan, FitItem, FitReport, PlanError, PlanInput, ResidencyPlan};
use strata_storage::{ExpertLayout, WeightStore};

/// The process's own baseline (binary, libraries, tokenizer, thread stacks: 13-16 MiB
/// measured with the fixtures and strata-tiny) plus allocator margin. A constant, so
/// plans are reproducible; the peak-RSS test holds runs to it.
pub const RUNTIME_RESERVE: u64 = 32 << 20;

/// Host memory of a process on CUDA beyond its own baseline and the expert tier: the
/// driver's and the CUDA libraries' (cuBLAS, NVRTC) mappings and allocations. On the H200
/// (driver 580, CUDA 13.0) processes held 0.77-0.93 GB beside their expert tier, the
/// largest weight in transit included (counted separately here).
pub const CUDA_HOST_RUNTIME: u64 = 768 << 20;

/// GPU memory beside the plan's items on CUDA: cuBLAS's workspace, the kernels' scratch
/// (grown to the largest forward), the pinned staging ring's device side, the step tables.
pub const CUDA_RESERVE: u64 = 256 << 20;

#[derive(Clone, Debug)]
pub struct FitOptions {
    pub budget: Option<u64>,
    pub context: usize,
    pub working_slots: usize,
    pub pinned: usize,
    pub max_slots_per_layer: Option<usize>,
    /// Count the draft (MTP) layer: its weights, KV and expert slab.
    pub draft: bool,
    /// The host side of a model on a GPU (`--device cuda`): its weights, KV and
    /// activations are in GPU memory (see [`fit_gpu`]); the host holds the expert tier.
    pub host_tier_only: bool,
    /// Rows a forward must hold for one image ([`crate::media::image_rows`]): prompts
    /// are prefilled in chunks of at least this many.
    pub image_rows: usize,
}

impl FitOptions {
    pub fn new(budget: Option<u64>, context: usize, rt: &RuntimeOptions) -> Self {
        Self {
            budget,
            context,
            working_slots: rt.working_slots,
            pinned: rt.pins.len(),
            max_slots_per_layer: rt.max_slots_per_layer,
            draft: false,
            host_tier_only: false,
            image_rows: 0,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Fit {
    pub report: FitReport,
    /// None when the budget cannot hold the plan (`report.fits` is then false), or when
    /// nothing streams.
    pub plan: Option<ResidencyPlan>,
    #[serde(skip)]
    pub error: Option<String>,
    pub slot_bytes: u64,
    pub expert_bytes_total: u64,
    pub streamed: bool,
}

/// The fixed line items: resident weights as held, KV for `context`, transients (a prompt
/// chunk of `chunk` rows), reserve; with `draft`, the draft (MTP) layer's weights, KV and
/// expert slab.
pub fn fixed_items(
    dir: &Path,
    arch: &dyn Arch,
    store: &WeightStore,
    context: usize,
    chunk: usize,
    draft: bool,
) -> Result<Vec<FitItem>> {
    let map = arch.weight_map();
    let chunk = chunk.min(context.max(1));
    let mut items = vec![
        FitItem::new("resident weights (as held: stored precision)", map.resident_held_bytes(store, false)),
        FitItem::new(format!("KV cache ({context} positions)"), arch.kv_bytes(context, chunk)),
        FitItem::new(
            "transients (prefill chunk activations, or one tensor's pages while loading)",
            arch.activation_bytes(chunk, context).max(map.largest_stored(store)),
        ),
        FitItem::new("runtime reserve (process baseline + allocator margin)", RUNTIME_RESERVE),
    ];
    if draft && arch.has_draft(store) {
        let weights = map.resident_held_bytes(store, true) - map.resident_held_bytes(store, false);
        let layers = arch.info().num_layers.max(1) as u64;
        items.push(FitItem::new("draft (MTP) layer weights, as held", weights));
        items.push(FitItem::new("draft (MTP) KV cache", arch.kv_bytes_per_token() / layers * context as u64));
        if let Some(slab) = crate::experts::draft_slab_bytes(dir, arch, store)? {
            items.push(FitItem::new("draft (MTP) expert slab (int8 tier)", slab));
        }
    }
    Ok(items)
}

/// Whether the draft (MTP) layer is loaded, for every command alike: `--mtp off` never,
/// `--mtp on` always (where the checkpoint has one), `--mtp auto` where it costs the main
/// expert tier nothing: no budget, or a plan whose slots per layer are the same with the
/// draft layer's weights, KV and slab as without (they fit in the headroom). Under a budget
/// that streams experts the draft layer's bytes would be main-tier slots (30 of 160
/// experts on strata-tiny at 72 MiB), which costs more than drafting wins.
/// `plan(draft)` plans with or without it (the CPU plan, or the GPU's on CUDA).
pub fn draft_loaded(
    mtp: bool,
    require_mtp: bool,
    has_draft: bool,
    budgeted: bool,
    plan: impl Fn(bool) -> Result<Fit>,
) -> Result<DraftDecision> {
    let no = DraftDecision { load: false, slots_taken: None };
    if !mtp || !has_draft {
        return Ok(no);
    }
    if require_mtp || !budgeted {
        return Ok(DraftDecision { load: true, slots_taken: None });
    }
    let slots = |f: &Fit| f.plan.as_ref().map(|p| p.total_slots);
    let (without, with) = (slots(&plan(false)?), slots(&plan(true)?));
    Ok(match (without, with) {
        (Some(a), Some(b)) if b >= a => DraftDecision { load: true, slots_taken: None },
        (Some(a), Some(b)) => DraftDecision { load: false, slots_taken: Some(a - b) },
        (Some(_), None) => DraftDecision { load: false, slots_taken: Some(0) },
        // Not even the main tier fits: the error comes from planning it.
        (None, _) => no,
    })
}

/// What [`draft_loaded`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftDecision {
    pub load: bool,
    /// Main-tier slots the draft layer would have taken, where `--mtp auto` left it out
    /// (0: it does not fit beside the smallest main plan at all).
    pub slots_taken: Option<usize>,
}

impl DraftDecision {
    /// The note a command prints where auto left the layer out.
    pub fn note(&self) -> Option<String> {
        let why = match self.slots_taken? {
            0 => "would not fit beside the main tier's smallest plan under this budget".to_string(),
            n => format!("would take {n} of the main tier's expert slots under this budget"),
        };
        Some(format!("--mtp auto: the draft (MTP) layer {why}; decoding without it (--mtp on loads it)"))
    }
}

/// Slot size and count of the experts `dir` streams: its container's, or for an HF
/// checkpoint the container a budget converts it into (lossless encoding).
fn expert_slots(dir: &Path, moe: &MoeLayout, store: &WeightStore) -> Result<(u64, Vec<usize>, usize)> {
    if let Some(source) = open_source(dir, Some(moe))? {
        return Ok((source.slot_bytes() as u64, source.layers().to_vec(), source.experts_per_layer()));
    }
    let kind = crate::autoconvert::lossless_kind(store);
    let layout = ExpertLayout::new(kind, kind, moe.hidden, moe.inter);
    Ok((layout.slot_bytes as u64, moe.layers.clone(), moe.experts_per_layer))
}

/// Plans a model directory. With routed experts and a budget: the slab the budget buys
/// (refused with every number when one slot per layer does not fit). Without a budget:
/// everything resident.
pub fn fit_dir(dir: &Path, arch: &dyn Arch, store: &WeightStore, opts: &FitOptions) -> Result<Fit> {
    let items = match opts.host_tier_only {
        true => host_tier_items(arch, store),
        false => {
            fixed_items(dir, arch, store, opts.context, strata_backend::PREFILL_CHUNK.max(opts.image_rows), opts.draft)?
        }
    };
    plan_items(dir, arch, store, opts, items, false)
}

/// The host side of a model on CUDA beside its tier of expert slots: the process
/// baseline, the CUDA runtime's host memory, and the largest weight on its way to the GPU
/// (mapped, and decoded into a buffer of up to twice its stored size), so that the
/// process's RSS stays within `--budget`.
fn host_tier_items(arch: &dyn Arch, store: &WeightStore) -> Vec<FitItem> {
    let transit = arch
        .weight_map()
        .specs
        .iter()
        .filter(|s| s.expert.is_none())
        .filter_map(|s| store.get(&s.name).map(|(_, t)| t.byte_len() as u64))
        .max()
        .unwrap_or(0);
    vec![
        FitItem::new("runtime reserve (process baseline + allocator margin)", RUNTIME_RESERVE),
        FitItem::new("CUDA driver and libraries in host memory", CUDA_HOST_RUNTIME),
        FitItem::new("largest weight on its way to the GPU (mapped + decoded)", 3 * transit),
    ]
}

/// The GPU memory plan of a model on CUDA whose experts stream: its weights as held, KV,
/// transients and [`CUDA_RESERVE`] beside a slab of expert slots, in `gpu_budget` (None:
/// a slot for every expert). `dir` holds the expert container.
pub fn fit_gpu(
    dir: &Path,
    arch: &dyn Arch,
    store: &WeightStore,
    opts: &FitOptions,
    gpu_budget: Option<u64>,
) -> Result<Fit> {
    let chunk = strata_backend::CUDA_PREFILL_CHUNK.max(opts.image_rows);
    let mut items = fixed_items(dir, arch, store, opts.context, chunk, opts.draft)?;
    for item in &mut items {
        if item.bytes == RUNTIME_RESERVE && item.name.starts_with("runtime reserve") {
            *item = FitItem::new("CUDA reserve (cuBLAS workspace, kernel scratch, step tables)", CUDA_RESERVE);
        }
    }
    let opts = FitOptions { budget: gpu_budget, pinned: 0, ..opts.clone() };
    plan_items(dir, arch, store, &opts, items, true)
}

/// The plan of `items` beside the expert slab the budget buys; `slots_always`: plan slots
/// even for an HF checkpoint without a budget (the GPU tier).
fn plan_items(
    dir: &Path,
    arch: &dyn Arch,
    store: &WeightStore,
    opts: &FitOptions,
    items: Vec<FitItem>,
    slots_always: bool,
) -> Result<Fit> {
    let Some(moe) = arch.moe() else {
        let total: u64 = items.iter().map(|i| i.bytes).sum();
        let report = FitReport::new(opts.budget.unwrap_or(total), items);
        let error =
            (!report.fits).then(|| format!("the model needs {} but the budget is {}", report.total, report.budget));
        return Ok(Fit { report, plan: None, error, slot_bytes: 0, expert_bytes_total: 0, streamed: false });
    };
    let fixed: u64 = items.iter().map(|i| i.bytes).sum();
    let (slot, layer_ids, per_layer) = expert_slots(dir, &moe, store)?;
    let layers = layer_ids.len();
    let total = slot * (layers * per_layer) as u64;
    let container = open_source(dir, Some(&moe))?.is_some();
    if opts.budget.is_none() && !container && !slots_always {
        // An HF checkpoint without a budget: experts resident, as stored.
        let mut all = items;
        let held = arch.weight_map().specs.iter().filter(|s| s.expert.is_some()).count() as u64;
        let _ = held;
        all.push(FitItem::new("routed experts (resident, as stored)", total));
        let sum: u64 = all.iter().map(|i| i.bytes).sum();
        let report = FitReport::new(sum, all);
        return Ok(Fit {
            report,
            plan: None,
            error: None,
            slot_bytes: slot,
            expert_bytes_total: total,
            streamed: false,
        });
    }
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
