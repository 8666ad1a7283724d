//! Parameter and byte accounting by kind, from the checkpoint headers alone.

use super::config::GlmMoeDsaConfig;
use serde::Serialize;
use std::collections::BTreeMap;
use strata_storage::WeightStore;

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

/// Sums parameters and stored bytes per group. Scale tensors count as bytes, not params.
pub fn inspect(cfg: &GlmMoeDsaConfig, store: &WeightStore) -> WeightSummary {
    let mut groups: BTreeMap<TensorGroup, GroupSize> = BTreeMap::new();
    for name in store.names() {
        let Some((_, t)) = store.get(name) else {
            continue;
        };
        let g = groups.entry(classify(name, cfg)).or_default();
        g.tensors += 1;
        g.bytes += t.byte_len() as u64;
        if !name.ends_with("_scale_inv") {
            g.parameters += t.numel() as u64;
        }
    }
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
