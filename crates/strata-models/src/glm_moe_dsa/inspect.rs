//! Parameter and byte accounting by kind, from the checkpoint headers alone.

use super::config::GlmMoeDsaConfig;
use serde::Serialize;
use std::collections::BTreeMap;
use strata_storage::{ExpertManifest, WeightStore};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorGroup {
    Embeddings,
    Attention,
    Indexer,
    Norms,
    DenseMlp,
    Router,
    SharedExperts,
    RoutedExperts,
    Mtp,
    Other,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct GroupSize {
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct WeightSummary {
    pub groups: BTreeMap<TensorGroup, GroupSize>,
    pub total_parameters: u64,
    pub total_bytes: u64,
    /// Parameters a decode token touches in the main model (dense part + top-k experts).
    pub active_parameters: u64,
    /// Bytes of one routed expert (gate + up + down, with scales) as stored.
    pub bytes_per_expert: u64,
}

fn classify(name: &str, cfg: &GlmMoeDsaConfig) -> TensorGroup {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        let layer: usize = rest.split('.').next().and_then(|s| s.parse().ok()).unwrap_or(0);
        if layer >= cfg.num_hidden_layers {
            return TensorGroup::Mtp;
        }
        return if name.contains(".self_attn.indexer.") {
            TensorGroup::Indexer
        } else if name.contains(".self_attn.") && !name.contains("layernorm") {
            TensorGroup::Attention
        } else if name.contains("layernorm") || name.ends_with("norm.weight") {
            TensorGroup::Norms
        } else if name.contains(".mlp.experts.") {
            TensorGroup::RoutedExperts
        } else if name.contains(".mlp.shared_experts.") {
            TensorGroup::SharedExperts
        } else if name.contains(".mlp.gate.") {
            TensorGroup::Router
        } else if name.contains(".mlp.") {
            TensorGroup::DenseMlp
        } else {
            TensorGroup::Other
        };
    }
    match name {
        "model.embed_tokens.weight" | "lm_head.weight" => TensorGroup::Embeddings,
        "model.norm.weight" => TensorGroup::Norms,
        _ => TensorGroup::Other,
    }
}

/// Sums parameters and stored bytes per group, from the headers (and, for an expert
/// container, its manifest). Scale tensors (`_scale_inv`, `.qs`) count as bytes, not
/// parameters; a quantized payload counts the parameters of the shape it encodes.
pub fn inspect(cfg: &GlmMoeDsaConfig, store: &WeightStore) -> WeightSummary {
    let shapes: std::collections::HashMap<String, u64> = super::layout::expected_tensors(cfg)
        .into_iter()
        .map(|(n, s, _)| (n, s.iter().product::<usize>() as u64))
        .collect();
    let mut groups: BTreeMap<TensorGroup, GroupSize> = BTreeMap::new();
    for name in store.names() {
        let Some((_, t)) = store.get(name) else {
            continue;
        };
        let g = groups.entry(classify(name.trim_end_matches(".qs"), cfg)).or_default();
        g.tensors += 1;
        g.bytes += t.byte_len() as u64;
        if name.ends_with("_scale_inv") || name.ends_with(".qs") {
            continue;
        }
        let quantized = store.contains(&format!("{name}.qs"));
        g.parameters += match (quantized, shapes.get(name)) {
            (true, Some(&n)) => n,
            _ => t.numel() as u64,
        };
    }
    summarize(cfg, groups)
}

/// [`inspect`] plus the routed experts of an expert container, from its manifest.
pub fn inspect_with_container(cfg: &GlmMoeDsaConfig, store: &WeightStore, manifest: &ExpertManifest) -> WeightSummary {
    let mut summary = inspect(cfg, store);
    let per_expert = 3 * (cfg.hidden_size * cfg.moe_intermediate_size) as u64;
    for tier in &manifest.tiers {
        let group = if tier.name == "mtp" { TensorGroup::Mtp } else { TensorGroup::RoutedExperts };
        let g = summary.groups.entry(group).or_default();
        let n = tier.expert_count() as u64;
        g.tensors += 3 * n as usize;
        g.parameters += n * per_expert;
        g.bytes += n * tier.slot_bytes() as u64;
    }
    summarize(cfg, summary.groups)
}

fn summarize(cfg: &GlmMoeDsaConfig, groups: BTreeMap<TensorGroup, GroupSize>) -> WeightSummary {
    let total_parameters = groups.values().map(|g| g.parameters).sum();
    let total_bytes = groups.values().map(|g| g.bytes).sum();
    let routed = groups.get(&TensorGroup::RoutedExperts).cloned().unwrap_or_default();
    let expert_count = (cfg.sparse_layers() * cfg.n_routed_experts).max(1) as u64;
    let params_per_expert = routed.parameters / expert_count;
    let main_non_expert: u64 = groups
        .iter()
        .filter(|(k, _)| !matches!(k, TensorGroup::RoutedExperts | TensorGroup::Mtp))
        .map(|(_, g)| g.parameters)
        .sum();
    WeightSummary {
        active_parameters: main_non_expert + params_per_expert * (cfg.sparse_layers() * cfg.num_experts_per_tok) as u64,
        bytes_per_expert: routed.bytes / expert_count,
        groups,
        total_parameters,
        total_bytes,
    }
}

/// Memory the model itself needs at run time, for the residency plan.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryNeeds {
    /// Non-routed weights as held (bf16 linear weights stay bf16, the rest f32).
    pub resident_weight_bytes: u64,
    /// Non-routed weights as stored.
    pub resident_stored_bytes: u64,
    /// The largest non-routed tensor as stored: the load transient (a tensor's mapped
    /// pages are released once it is decoded).
    pub largest_tensor_stored_bytes: u64,
    /// Latent KV cache for the reserved context (capacity grows by doubling).
    pub kv_cache_bytes: u64,
    /// Activations of one prefill chunk at the full context.
    pub activation_bytes: u64,
}

/// `prefill_chunk`: the most tokens one forward carries (bounds activation memory).
pub fn memory_needs(cfg: &GlmMoeDsaConfig, store: &WeightStore, context: usize, prefill_chunk: usize) -> MemoryNeeds {
    // Held bytes: linear weights stored bf16 stay bf16 (nn::Weight); the rest is f32.
    // kv_b_proj is split into w_uk / w_uv: the same number of f32 values.
    let mut resident_held = 0u64;
    let mut resident_stored = 0u64;
    let mut largest = 0u64;
    for name in store.names() {
        let Some((_, t)) = store.get(name) else { continue };
        let group = classify(name, cfg);
        if matches!(group, TensorGroup::RoutedExperts | TensorGroup::Mtp) {
            continue;
        }
        resident_stored += t.byte_len() as u64;
        largest = largest.max(t.byte_len() as u64);
        if name.ends_with("_scale_inv") || name.ends_with(".qs") {
            continue;
        }
        let packed = t.dtype == strata_storage::ElementType::BF16
            && t.shape.len() == 2
            && !name.contains("kv_b_proj")
            && !name.ends_with("mlp.gate.weight");
        resident_held += t.numel() as u64 * if packed { 2 } else { 4 };
    }
    let full_layers = cfg.indexer_types.iter().filter(|k| **k == super::IndexerKind::Full).count();
    let per_token = (cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + full_layers * cfg.index_head_dim) as u64
        * 4;
    let positions = context.max(1).next_power_of_two().max(16) as u64;
    let chunk = prefill_chunk.min(context.max(1)) as u64;
    let l = context.max(1) as u64;
    let h = cfg.hidden_size as u64;
    let heads = cfg.num_attention_heads as u64;
    // Attention scores + probabilities over the latent, per-head latent queries and
    // outputs, MoE/MLP hidden activations, the indexer's scores, logits.
    let activation = 4
        * (2 * heads * chunk * l
            + 2 * heads * chunk * cfg.kv_lora_rank as u64
            + chunk * h * 16
            + chunk * (cfg.intermediate_size.max(cfg.moe_intermediate_size * cfg.num_experts_per_tok) as u64) * 3
            + cfg.index_n_heads as u64 * chunk * l * 2
            + cfg.vocab_size as u64);
    MemoryNeeds {
        resident_weight_bytes: resident_held,
        resident_stored_bytes: resident_stored,
        largest_tensor_stored_bytes: largest,
        kv_cache_bytes: per_token * positions,
        activation_bytes: activation,
    }
}
