//! Every tensor of a Qwen3-Next or Qwen3.5-MoE checkpoint, named as on the Hub: the only
//! place these names are spelled.

use super::{Qwen3NextConfig, Variant};
use crate::weights::{ExpertMatrix, Role, TensorGroup, WeightMap, WeightSpec};

/// The draft (MTP) layer's tensors: described by prefix (`inspect`, `convert`), not run.
pub const MTP_PREFIX: &str = "mtp.";
/// A Qwen3.5-MoE vision-language checkpoint's vision tower: described by prefix, not run.
pub const VISION_PREFIX: &str = "model.visual.";

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
    // Gated full attention (q_proj holds each head's query then its output gate).
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    // Gated DeltaNet: Qwen3-Next's fused input projections, or Qwen3.5's four.
    InProjQkvz,
    InProjBa,
    InProjQkv,
    InProjZ,
    InProjB,
    InProjA,
    Conv,
    DtBias,
    ALog,
    GatedNorm,
    OutProj,
    // Feed-forward.
    MlpGate,
    MlpUp,
    MlpDown,
    Router,
    SharedGate,
    SharedUp,
    SharedDown,
    SharedExpertGate,
    Expert(usize, ExpertMatrix),
}

/// Where the text model's tensors live: `model.`, or `model.language_model.` in a
/// vision-language checkpoint.
fn text_prefix(cfg: &Qwen3NextConfig) -> &'static str {
    match cfg.variant {
        Variant::Qwen35 { wrapped: true } => "model.language_model.",
        _ => "model.",
    }
}

pub fn name(cfg: &Qwen3NextConfig, k: Key) -> String {
    use LayerKey::*;
    let m = text_prefix(cfg);
    let (i, lk) = match k {
        Key::Embed => return format!("{m}embed_tokens.weight"),
        Key::Norm => return format!("{m}norm.weight"),
        Key::LmHead => return "lm_head.weight".into(),
        Key::Layer(i, lk) => (i, lk),
    };
    let p = format!("{m}layers.{i}");
    let (a, l) = (format!("{p}.self_attn"), format!("{p}.linear_attn"));
    match lk {
        InputNorm => format!("{p}.input_layernorm.weight"),
        PostNorm => format!("{p}.post_attention_layernorm.weight"),
        Q => format!("{a}.q_proj.weight"),
        K => format!("{a}.k_proj.weight"),
        V => format!("{a}.v_proj.weight"),
        O => format!("{a}.o_proj.weight"),
        QNorm => format!("{a}.q_norm.weight"),
        KNorm => format!("{a}.k_norm.weight"),
        InProjQkvz => format!("{l}.in_proj_qkvz.weight"),
        InProjBa => format!("{l}.in_proj_ba.weight"),
        InProjQkv => format!("{l}.in_proj_qkv.weight"),
        InProjZ => format!("{l}.in_proj_z.weight"),
        InProjB => format!("{l}.in_proj_b.weight"),
        InProjA => format!("{l}.in_proj_a.weight"),
        Conv => format!("{l}.conv1d.weight"),
        DtBias => format!("{l}.dt_bias"),
        ALog => format!("{l}.A_log"),
        GatedNorm => format!("{l}.norm.weight"),
        OutProj => format!("{l}.out_proj.weight"),
        MlpGate => format!("{p}.mlp.gate_proj.weight"),
        MlpUp => format!("{p}.mlp.up_proj.weight"),
        MlpDown => format!("{p}.mlp.down_proj.weight"),
        Router => format!("{p}.mlp.gate.weight"),
        SharedGate => format!("{p}.mlp.shared_expert.gate_proj.weight"),
        SharedUp => format!("{p}.mlp.shared_expert.up_proj.weight"),
        SharedDown => format!("{p}.mlp.shared_expert.down_proj.weight"),
        SharedExpertGate => format!("{p}.mlp.shared_expert_gate.weight"),
        Expert(e, m) => format!(
            "{p}.mlp.experts.{e}.{}_proj.weight",
            match m {
                ExpertMatrix::Gate => "gate",
                ExpertMatrix::Up => "up",
                ExpertMatrix::Down => "down",
            }
        ),
    }
}

pub fn spec(cfg: &Qwen3NextConfig, k: Key) -> (Vec<usize>, Role, TensorGroup) {
    use LayerKey::*;
    use Role::*;
    use TensorGroup::*;
    let h = cfg.hidden_size;
    let d = &cfg.delta;
    let (q, kv) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
    let (moe, shared, inter) = (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.intermediate_size);
    let lk = match k {
        Key::Embed => return (vec![cfg.vocab_size, h], Embedding, Embeddings),
        Key::Norm => return (vec![h], NormScale, Norms),
        Key::LmHead => return (vec![cfg.vocab_size, h], Linear, Embeddings),
        Key::Layer(_, lk) => lk,
    };
    match lk {
        InputNorm | PostNorm => (vec![h], NormScale, Norms),
        Q => (vec![2 * q, h], Linear, Attention),
        K | V => (vec![kv, h], Linear, Attention),
        O => (vec![h, q], Linear, Attention),
        QNorm | KNorm => (vec![cfg.head_dim], NormScale, Norms),
        InProjQkvz => (vec![d.qkvz_width(), h], Linear, Attention),
        InProjBa => (vec![2 * d.v_heads, h], Linear, Attention),
        InProjQkv => (vec![d.conv_dim(), h], Linear, Attention),
        InProjZ => (vec![d.value_dim(), h], Linear, Attention),
        InProjB | InProjA => (vec![d.v_heads, h], Linear, Attention),
        Conv => (vec![d.conv_dim(), 1, d.kernel], NormScale, Attention),
        DtBias | ALog => (vec![d.v_heads], NormBias, Attention),
        GatedNorm => (vec![d.v_dim], NormScale, Norms),
        OutProj => (vec![h, d.value_dim()], Linear, Attention),
        MlpGate | MlpUp => (vec![inter, h], Linear, DenseMlp),
        MlpDown => (vec![h, inter], Linear, DenseMlp),
        LayerKey::Router => (vec![cfg.num_experts, h], Linear, TensorGroup::Router),
        SharedGate | SharedUp => (vec![shared, h], Linear, SharedExperts),
        SharedDown => (vec![h, shared], Linear, SharedExperts),
        SharedExpertGate => (vec![1, h], Linear, SharedExperts),
        Expert(_, ExpertMatrix::Down) => (vec![h, moe], Linear, RoutedExperts),
        Expert(_, _) => (vec![moe, h], Linear, RoutedExperts),
    }
}

fn layer_keys(cfg: &Qwen3NextConfig, i: usize) -> Vec<LayerKey> {
    use LayerKey::*;
    let mut keys = vec![InputNorm, PostNorm];
    match cfg.linear[i] {
        true => {
            match cfg.variant {
                Variant::Next => keys.extend([InProjQkvz, InProjBa]),
                Variant::Qwen35 { .. } => keys.extend([InProjQkv, InProjZ, InProjB, InProjA]),
            }
            keys.extend([Conv, DtBias, ALog, GatedNorm, OutProj]);
        }
        false => keys.extend([Q, K, V, O, QNorm, KNorm]),
    }
    match cfg.is_sparse(i) {
        true => {
            keys.extend([Router, SharedGate, SharedUp, SharedDown, SharedExpertGate]);
            for e in 0..cfg.num_experts {
                keys.extend([ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down].map(|m| Expert(e, m)));
            }
        }
        false => keys.extend([MlpGate, MlpUp, MlpDown]),
    }
    keys
}

/// A layer's fused expert tensors (`gate_up_proj`, `down_proj`), where a checkpoint
/// stores them so.
pub fn fused_names(cfg: &Qwen3NextConfig, layer: usize) -> (String, String) {
    crate::weights::fused_expert_names_at(&format!("{}layers.{layer}.mlp.experts", text_prefix(cfg)))
}

pub fn weight_map(cfg: &Qwen3NextConfig) -> WeightMap {
    let mut extra_prefixes = vec![(MTP_PREFIX.into(), TensorGroup::Mtp)];
    if cfg.variant == (Variant::Qwen35 { wrapped: true }) {
        extra_prefixes.push((VISION_PREFIX.into(), TensorGroup::Vision));
    }
    let mut map = WeightMap { extra_prefixes, ..Default::default() };
    let mut add = |k: Key| {
        let (shape, role, group) = spec(cfg, k);
        let expert = match k {
            Key::Layer(l, LayerKey::Expert(e, m)) => Some((l, e, m)),
            _ => None,
        };
        map.specs.push(WeightSpec { name: name(cfg, k), shape, role, group, expert, optional: false });
    };
    add(Key::Embed);
    for i in 0..cfg.num_hidden_layers {
        for lk in layer_keys(cfg, i) {
            add(Key::Layer(i, lk));
        }
    }
    add(Key::Norm);
    if !cfg.tie_word_embeddings {
        add(Key::LmHead);
    }
    map.fused = (0..cfg.num_hidden_layers).filter(|&l| cfg.is_sparse(l)).map(|l| (l, fused_names(cfg, l))).collect();
    map
}
