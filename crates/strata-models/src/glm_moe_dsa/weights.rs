//! Every tensor of a `glm_moe_dsa` checkpoint, named as on the Hub (experts stored one by
//! one): the only place these names are spelled. Loading asks for tensors by [`Key`].

use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
use crate::weights::{ExpertMatrix, Role, TensorGroup, WeightMap, WeightSpec};

/// One tensor of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    Embed,
    Norm,
    LmHead,
    Layer(usize, LayerKey),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKey {
    InputNorm,
    PostNorm,
    QA,
    QANorm,
    QB,
    KvA,
    KvANorm,
    KvB,
    O,
    IndexWqB,
    IndexWk,
    IndexKNormW,
    IndexKNormB,
    IndexWeights,
    MlpGate,
    MlpUp,
    MlpDown,
    Router,
    RouterBias,
    SharedGate,
    SharedUp,
    SharedDown,
    Expert(usize, ExpertMatrix),
    // The MTP layer's own tensors.
    MtpEnorm,
    MtpHnorm,
    MtpEhProj,
    MtpHeadNorm,
    MtpEmbed,
    MtpHead,
}

pub fn name(k: Key) -> String {
    use LayerKey::*;
    let (i, lk) = match k {
        Key::Embed => return "model.embed_tokens.weight".into(),
        Key::Norm => return "model.norm.weight".into(),
        Key::LmHead => return "lm_head.weight".into(),
        Key::Layer(i, lk) => (i, lk),
    };
    let p = format!("model.layers.{i}");
    let a = format!("{p}.self_attn");
    match lk {
        InputNorm => format!("{p}.input_layernorm.weight"),
        PostNorm => format!("{p}.post_attention_layernorm.weight"),
        QA => format!("{a}.q_a_proj.weight"),
        QANorm => format!("{a}.q_a_layernorm.weight"),
        QB => format!("{a}.q_b_proj.weight"),
        KvA => format!("{a}.kv_a_proj_with_mqa.weight"),
        KvANorm => format!("{a}.kv_a_layernorm.weight"),
        KvB => format!("{a}.kv_b_proj.weight"),
        O => format!("{a}.o_proj.weight"),
        IndexWqB => format!("{a}.indexer.wq_b.weight"),
        IndexWk => format!("{a}.indexer.wk.weight"),
        IndexKNormW => format!("{a}.indexer.k_norm.weight"),
        IndexKNormB => format!("{a}.indexer.k_norm.bias"),
        IndexWeights => format!("{a}.indexer.weights_proj.weight"),
        MlpGate => format!("{p}.mlp.gate_proj.weight"),
        MlpUp => format!("{p}.mlp.up_proj.weight"),
        MlpDown => format!("{p}.mlp.down_proj.weight"),
        Router => format!("{p}.mlp.gate.weight"),
        RouterBias => format!("{p}.mlp.gate.e_score_correction_bias"),
        SharedGate => format!("{p}.mlp.shared_experts.gate_proj.weight"),
        SharedUp => format!("{p}.mlp.shared_experts.up_proj.weight"),
        SharedDown => format!("{p}.mlp.shared_experts.down_proj.weight"),
        Expert(e, m) => format!("{p}.mlp.experts.{e}.{}_proj.weight", expert_part(m)),
        MtpEnorm => format!("{p}.enorm.weight"),
        MtpHnorm => format!("{p}.hnorm.weight"),
        MtpEhProj => format!("{p}.eh_proj.weight"),
        MtpHeadNorm => format!("{p}.shared_head.norm.weight"),
        MtpEmbed => format!("{p}.embed_tokens.weight"),
        MtpHead => format!("{p}.shared_head.head.weight"),
    }
}

fn expert_part(m: ExpertMatrix) -> &'static str {
    match m {
        ExpertMatrix::Gate => "gate",
        ExpertMatrix::Up => "up",
        ExpertMatrix::Down => "down",
    }
}

/// The shape and role of every tensor.
pub fn spec(cfg: &GlmMoeDsaConfig, k: Key) -> (Vec<usize>, Role, TensorGroup) {
    use LayerKey::*;
    use Role::*;
    use TensorGroup::*;
    let h = cfg.hidden_size;
    let (heads, nope, rope, v) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
    let (inter, moe, n) = (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.n_routed_experts);
    let (layer, lk) = match k {
        Key::Embed => return (vec![cfg.vocab_size, h], Embedding, Embeddings),
        Key::Norm => return (vec![h], NormScale, Norms),
        Key::LmHead => return (vec![cfg.vocab_size, h], Linear, Embeddings),
        Key::Layer(i, lk) => (i, lk),
    };
    let mtp = layer >= cfg.num_hidden_layers;
    let g = |group| if mtp { Mtp } else { group };
    let (shape, role, group) = match lk {
        InputNorm | PostNorm => (vec![h], NormScale, Norms),
        QA => (vec![cfg.q_lora_rank, h], Linear, Attention),
        QANorm => (vec![cfg.q_lora_rank], NormScale, Norms),
        QB => (vec![heads * (nope + rope), cfg.q_lora_rank], Linear, Attention),
        KvA => (vec![cfg.kv_lora_rank + rope, h], Linear, Attention),
        KvANorm => (vec![cfg.kv_lora_rank], NormScale, Norms),
        KvB => (vec![heads * (nope + v), cfg.kv_lora_rank], Linear, Attention),
        O => (vec![h, heads * v], Linear, Attention),
        IndexWqB => (vec![ih * id, cfg.q_lora_rank], Linear, Indexer),
        IndexWk => (vec![id, h], Linear, Indexer),
        IndexKNormW => (vec![id], NormScale, Indexer),
        IndexKNormB => (vec![id], NormBias, Indexer),
        IndexWeights => (vec![ih, h], Linear, Indexer),
        MlpGate | MlpUp => (vec![inter, h], Linear, DenseMlp),
        MlpDown => (vec![h, inter], Linear, DenseMlp),
        LayerKey::Router => (vec![n, h], Linear, TensorGroup::Router),
        LayerKey::RouterBias => (vec![n], Role::RouterBias, TensorGroup::Router),
        SharedGate | SharedUp => (vec![moe * cfg.n_shared_experts, h], Linear, SharedExperts),
        SharedDown => (vec![h, moe * cfg.n_shared_experts], Linear, SharedExperts),
        Expert(_, ExpertMatrix::Down) => (vec![h, moe], Linear, RoutedExperts),
        Expert(_, _) => (vec![moe, h], Linear, RoutedExperts),
        MtpEnorm | MtpHnorm | MtpHeadNorm => (vec![h], NormScale, Norms),
        MtpEhProj => (vec![h, 2 * h], Linear, Attention),
        MtpEmbed => (vec![cfg.vocab_size, h], Embedding, Embeddings),
        MtpHead => (vec![cfg.vocab_size, h], Linear, Embeddings),
    };
    (shape, role, g(group))
}

/// The keys of one decoder layer (main or MTP).
fn layer_keys(cfg: &GlmMoeDsaConfig, i: usize, indexer: bool, sparse: bool) -> Vec<LayerKey> {
    use LayerKey::*;
    let mut keys = vec![InputNorm, PostNorm, QA, QANorm, QB, KvA, KvANorm, KvB, O];
    if indexer {
        keys.extend([IndexWqB, IndexWk, IndexKNormW, IndexKNormB, IndexWeights]);
    }
    if sparse {
        keys.extend([Router, RouterBias, SharedGate, SharedUp, SharedDown]);
        for e in 0..cfg.n_routed_experts {
            keys.extend([ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down].map(|m| Expert(e, m)));
        }
    } else {
        keys.extend([MlpGate, MlpUp, MlpDown]);
    }
    let _ = i;
    keys
}

/// Every tensor: the main model, then the (optional) MTP layers.
pub fn weight_map(cfg: &GlmMoeDsaConfig) -> WeightMap {
    let mut map = WeightMap::default();
    let mut add = |k: Key, optional: bool| {
        let (shape, role, group) = spec(cfg, k);
        let expert = match k {
            Key::Layer(l, LayerKey::Expert(e, m)) => Some((l, e, m)),
            _ => None,
        };
        map.specs.push(WeightSpec { name: name(k), shape, role, group, expert, optional });
    };
    add(Key::Embed, false);
    for i in 0..cfg.num_hidden_layers {
        let indexer = cfg.indexer_types[i] == IndexerKind::Full;
        for lk in layer_keys(cfg, i, indexer, cfg.mlp_layer_types[i] == MlpKind::Sparse) {
            add(Key::Layer(i, lk), false);
        }
    }
    add(Key::Norm, false);
    if !cfg.tie_word_embeddings {
        add(Key::LmHead, false);
    }
    for i in cfg.num_hidden_layers..cfg.num_hidden_layers + cfg.num_nextn_predict_layers {
        use LayerKey::*;
        for lk in [MtpEnorm, MtpHnorm, MtpEhProj, MtpHeadNorm, MtpEmbed, MtpHead] {
            add(Key::Layer(i, lk), true);
        }
        // GLM-5's MTP layer may run its own indexer; DeepSeek's has none.
        for lk in layer_keys(cfg, i, cfg.variant == super::Variant::Glm5, true) {
            add(Key::Layer(i, lk), true);
        }
    }
    map
}
