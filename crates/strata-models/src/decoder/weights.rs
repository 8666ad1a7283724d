//! Every tensor of a Llama-style MoE checkpoint, named as on the Hub: the only place
//! these names are spelled.

use super::{DecoderSpec, Naming, QkNorm, Routing};
use crate::weights::{ExpertMatrix, Role, TensorGroup, WeightMap, WeightSpec};

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
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    O,
    OBias,
    Sinks,
    MlpGate,
    MlpUp,
    MlpDown,
    Router,
    RouterBias,
    SharedGate,
    SharedUp,
    SharedDown,
    Expert(usize, ExpertMatrix),
    /// gpt-oss's expert biases, a layer's in one tensor each: `[E, 2I]` (gate and up
    /// interleaved) and `[E, H]`.
    ExpertGateUpBias,
    ExpertDownBias,
    MtpEnorm,
    MtpHnorm,
    MtpEhProj,
    MtpHeadNorm,
}

pub fn name(naming: Naming, k: Key) -> String {
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
        Q => format!("{a}.q_proj.weight"),
        K => format!("{a}.k_proj.weight"),
        V => format!("{a}.v_proj.weight"),
        QBias => format!("{a}.q_proj.bias"),
        KBias => format!("{a}.k_proj.bias"),
        VBias => format!("{a}.v_proj.bias"),
        QNorm => format!("{a}.q_norm.weight"),
        KNorm => format!("{a}.k_norm.weight"),
        O => format!("{a}.o_proj.weight"),
        OBias => format!("{a}.o_proj.bias"),
        Sinks => format!("{a}.sinks"),
        MlpGate => format!("{p}.mlp.gate_proj.weight"),
        MlpUp => format!("{p}.mlp.up_proj.weight"),
        MlpDown => format!("{p}.mlp.down_proj.weight"),
        Router if naming == Naming::Mixtral => format!("{p}.block_sparse_moe.gate.weight"),
        RouterBias if naming == Naming::Mixtral => format!("{p}.block_sparse_moe.e_score_correction_bias"),
        Expert(e, m) if naming == Naming::Mixtral => format!(
            "{p}.block_sparse_moe.experts.{e}.{}.weight",
            match m {
                ExpertMatrix::Gate => "w1",
                ExpertMatrix::Up => "w3",
                ExpertMatrix::Down => "w2",
            }
        ),
        Router if naming == Naming::GptOss => format!("{p}.mlp.router.weight"),
        RouterBias if naming == Naming::GptOss => format!("{p}.mlp.router.bias"),
        ExpertGateUpBias => format!("{p}.mlp.experts.gate_up_proj_bias"),
        ExpertDownBias => format!("{p}.mlp.experts.down_proj_bias"),
        Router => format!("{p}.mlp.gate.weight"),
        RouterBias => format!("{p}.mlp.gate.e_score_correction_bias"),
        SharedGate => format!("{p}.mlp.shared_experts.gate_proj.weight"),
        SharedUp => format!("{p}.mlp.shared_experts.up_proj.weight"),
        SharedDown => format!("{p}.mlp.shared_experts.down_proj.weight"),
        Expert(e, m) => format!(
            "{p}.mlp.experts.{e}.{}_proj.weight",
            match m {
                ExpertMatrix::Gate => "gate",
                ExpertMatrix::Up => "up",
                ExpertMatrix::Down => "down",
            }
        ),
        MtpEnorm => format!("{p}.enorm.weight"),
        MtpHnorm => format!("{p}.hnorm.weight"),
        MtpEhProj => format!("{p}.eh_proj.weight"),
        MtpHeadNorm => format!("{p}.shared_head.norm.weight"),
    }
}

pub fn spec(cfg: &DecoderSpec, k: Key) -> (Vec<usize>, Role, TensorGroup) {
    use LayerKey::*;
    use Role::*;
    use TensorGroup::*;
    let h = cfg.hidden_size;
    let (q, kv) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
    let (inter, moe, n) = (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.experts);
    let shared = cfg.shared_intermediate_size;
    let (layer, lk) = match k {
        Key::Embed => return (vec![cfg.vocab_size, h], Embedding, Embeddings),
        Key::Norm => return (vec![h], NormScale, Norms),
        Key::LmHead => return (vec![cfg.vocab_size, h], Linear, Embeddings),
        Key::Layer(i, lk) => (i, lk),
    };
    let (shape, role, group) = match lk {
        InputNorm | PostNorm | MtpEnorm | MtpHnorm | MtpHeadNorm => (vec![h], NormScale, Norms),
        Q => (vec![q, h], Linear, Attention),
        K | V => (vec![kv, h], Linear, Attention),
        QBias => (vec![q], NormBias, Attention),
        KBias | VBias => (vec![kv], NormBias, Attention),
        QNorm if cfg.qk_norm == QkNorm::Full => (vec![q], NormScale, Norms),
        KNorm if cfg.qk_norm == QkNorm::Full => (vec![kv], NormScale, Norms),
        QNorm | KNorm => (vec![cfg.head_dim], NormScale, Norms),
        O => (vec![h, q], Linear, Attention),
        OBias => (vec![h], NormBias, Attention),
        Sinks => (vec![cfg.heads], NormBias, Attention),
        ExpertGateUpBias => (vec![n, 2 * moe], NormBias, RoutedExperts),
        ExpertDownBias => (vec![n, h], NormBias, RoutedExperts),
        MlpGate | MlpUp => (vec![inter, h], Linear, DenseMlp),
        MlpDown => (vec![h, inter], Linear, DenseMlp),
        LayerKey::Router => (vec![n, h], Linear, TensorGroup::Router),
        LayerKey::RouterBias => (vec![n], Role::RouterBias, TensorGroup::Router),
        SharedGate | SharedUp => (vec![shared, h], Linear, SharedExperts),
        SharedDown => (vec![h, shared], Linear, SharedExperts),
        Expert(_, ExpertMatrix::Down) => (vec![h, moe], Linear, RoutedExperts),
        Expert(_, _) => (vec![moe, h], Linear, RoutedExperts),
        MtpEhProj => (vec![h, 2 * h], Linear, Attention),
    };
    let group = if layer >= cfg.num_layers { Mtp } else { group };
    (shape, role, group)
}

fn layer_keys(cfg: &DecoderSpec, sparse: bool) -> Vec<LayerKey> {
    use LayerKey::*;
    let mut keys = vec![InputNorm, PostNorm, Q, K, V, O];
    if cfg.attention_bias {
        keys.extend([QBias, KBias, VBias]);
    }
    if cfg.o_bias {
        keys.push(OBias);
    }
    if cfg.sinks {
        keys.push(Sinks);
    }
    if cfg.qk_norm != QkNorm::None {
        keys.extend([QNorm, KNorm]);
    }
    if sparse {
        keys.push(Router);
        if matches!(cfg.routing, Routing::Noaux { .. }) || cfg.router_bias {
            keys.push(RouterBias);
        }
        if cfg.expert_biases {
            keys.extend([ExpertGateUpBias, ExpertDownBias]);
        }
        if cfg.has_shared_expert() {
            keys.extend([SharedGate, SharedUp, SharedDown]);
        }
        for e in 0..cfg.experts {
            keys.extend([ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down].map(|m| Expert(e, m)));
        }
    } else {
        keys.extend([MlpGate, MlpUp, MlpDown]);
    }
    keys
}

/// Every tensor: the main model, then the (optional) MTP layers.
pub fn weight_map(cfg: &DecoderSpec) -> WeightMap {
    let mut map = WeightMap::default();
    if cfg.naming == Naming::GptOss {
        map.fused_form = crate::weights::FusedForm::Interleaved;
    }
    let mut add = |k: Key, optional: bool| {
        let (shape, role, group) = spec(cfg, k);
        let expert = match k {
            Key::Layer(l, LayerKey::Expert(e, m)) => Some((l, e, m)),
            _ => None,
        };
        map.specs.push(WeightSpec { name: name(cfg.naming, k), shape, role, group, expert, optional });
    };
    add(Key::Embed, false);
    for i in 0..cfg.num_layers {
        for lk in layer_keys(cfg, cfg.is_sparse(i)) {
            add(Key::Layer(i, lk), false);
        }
    }
    add(Key::Norm, false);
    if !cfg.tie_word_embeddings {
        add(Key::LmHead, false);
    }
    for i in cfg.num_layers..cfg.num_layers + cfg.mtp_layers {
        use LayerKey::*;
        for lk in [MtpEnorm, MtpHnorm, MtpEhProj, MtpHeadNorm] {
            add(Key::Layer(i, lk), true);
        }
        for lk in layer_keys(cfg, true) {
            add(Key::Layer(i, lk), true);
        }
    }
    map
}
