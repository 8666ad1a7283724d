//! Every tensor of a Gemma 4 checkpoint's text model, named as on the Hub: the only place
//! these names are spelled. `gemma4` checkpoints hold them under `model.language_model.`,
//! `gemma4_text` ones under `model.`. Routed experts are stored fused
//! (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`); the map also names
//! each expert's matrices (`experts.{e}.gate_proj.weight`, ...) so conversion, the plan
//! and the ledger see one expert at a time, as for the other families.

use super::config::{Gemma4Config, LayerSpec};
use crate::weights::{ExpertMatrix, Role, TensorGroup, WeightMap, WeightSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    Embed,
    /// The packed per-layer embedding table `[ple_vocab, layers * ple]`.
    EmbedPerLayer,
    /// `per_layer_model_projection`: hidden -> layers * ple.
    PleProjection,
    PleNorm,
    Norm,
    LmHead,
    Layer(usize, LayerKey),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKey {
    InputNorm,
    PostAttnNorm,
    PreFfnNorm,
    PostFfnNorm,
    LayerScalar,
    Q,
    K,
    V,
    QNorm,
    KNorm,
    O,
    MlpGate,
    MlpUp,
    MlpDown,
    PleGate,
    PleProj,
    PlePostNorm,
    RouterProj,
    RouterScale,
    RouterExpertScale,
    PreFfnNorm2,
    PostFfnNorm1,
    PostFfnNorm2,
    Expert(usize, ExpertMatrix),
}

pub fn name(cfg: &Gemma4Config, k: Key) -> String {
    use LayerKey::*;
    let p = cfg.prefix();
    let (i, lk) = match k {
        Key::Embed => return format!("{p}embed_tokens.weight"),
        Key::EmbedPerLayer => return format!("{p}embed_tokens_per_layer.weight"),
        Key::PleProjection => return format!("{p}per_layer_model_projection.weight"),
        Key::PleNorm => return format!("{p}per_layer_projection_norm.weight"),
        Key::Norm => return format!("{p}norm.weight"),
        Key::LmHead => return "lm_head.weight".into(),
        Key::Layer(i, lk) => (i, lk),
    };
    let l = format!("{p}layers.{i}");
    let a = format!("{l}.self_attn");
    match lk {
        InputNorm => format!("{l}.input_layernorm.weight"),
        PostAttnNorm => format!("{l}.post_attention_layernorm.weight"),
        PreFfnNorm => format!("{l}.pre_feedforward_layernorm.weight"),
        PostFfnNorm => format!("{l}.post_feedforward_layernorm.weight"),
        LayerScalar => format!("{l}.layer_scalar"),
        Q => format!("{a}.q_proj.weight"),
        K => format!("{a}.k_proj.weight"),
        V => format!("{a}.v_proj.weight"),
        QNorm => format!("{a}.q_norm.weight"),
        KNorm => format!("{a}.k_norm.weight"),
        O => format!("{a}.o_proj.weight"),
        MlpGate => format!("{l}.mlp.gate_proj.weight"),
        MlpUp => format!("{l}.mlp.up_proj.weight"),
        MlpDown => format!("{l}.mlp.down_proj.weight"),
        PleGate => format!("{l}.per_layer_input_gate.weight"),
        PleProj => format!("{l}.per_layer_projection.weight"),
        PlePostNorm => format!("{l}.post_per_layer_input_norm.weight"),
        RouterProj => format!("{l}.router.proj.weight"),
        RouterScale => format!("{l}.router.scale"),
        RouterExpertScale => format!("{l}.router.per_expert_scale"),
        PreFfnNorm2 => format!("{l}.pre_feedforward_layernorm_2.weight"),
        PostFfnNorm1 => format!("{l}.post_feedforward_layernorm_1.weight"),
        PostFfnNorm2 => format!("{l}.post_feedforward_layernorm_2.weight"),
        Expert(e, m) => format!(
            "{l}.experts.{e}.{}_proj.weight",
            match m {
                ExpertMatrix::Gate => "gate",
                ExpertMatrix::Up => "up",
                ExpertMatrix::Down => "down",
            }
        ),
    }
}

/// The fused expert tensors of a layer: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.
pub fn fused_names(cfg: &Gemma4Config, layer: usize) -> (String, String) {
    crate::weights::fused_expert_names_at(&format!("{}layers.{layer}.experts", cfg.prefix()))
}

pub fn spec(cfg: &Gemma4Config, k: Key) -> (Vec<usize>, Role, TensorGroup) {
    use LayerKey::*;
    use Role::*;
    use TensorGroup::*;
    let t = &cfg.text;
    let (h, n) = (t.hidden_size, t.num_layers());
    let ple = t.ple.map_or(0, |p| p.dim);
    let (layer, lk) = match k {
        Key::Embed => return (vec![t.vocab_size, h], Embedding, Embeddings),
        Key::EmbedPerLayer => return (vec![t.ple.map_or(0, |p| p.vocab), n * ple], Embedding, PerLayerInputs),
        Key::PleProjection => return (vec![n * ple, h], Linear, PerLayerInputs),
        Key::PleNorm => return (vec![ple], NormScale, Norms),
        Key::Norm => return (vec![h], NormScale, Norms),
        Key::LmHead => return (vec![t.vocab_size, h], Linear, Embeddings),
        Key::Layer(i, lk) => (i, lk),
    };
    let l: &LayerSpec = &t.layers[layer];
    let (q, kv) = (t.num_attention_heads * l.head_dim, l.kv_heads * l.head_dim);
    let (experts, inter) = t.moe.map_or((0, 0), |m| (m.experts, m.inter));
    match lk {
        InputNorm | PostAttnNorm | PreFfnNorm | PostFfnNorm | PlePostNorm | PreFfnNorm2 | PostFfnNorm1
        | PostFfnNorm2 => (vec![h], NormScale, Norms),
        LayerScalar => (vec![1], NormScale, Norms),
        Q => (vec![q, h], Linear, Attention),
        K | V => (vec![kv, h], Linear, Attention),
        QNorm | KNorm => (vec![l.head_dim], NormScale, Norms),
        O => (vec![h, q], Linear, Attention),
        MlpGate | MlpUp => (vec![l.mlp_width, h], Linear, DenseMlp),
        MlpDown => (vec![h, l.mlp_width], Linear, DenseMlp),
        PleGate => (vec![ple, h], Linear, PerLayerInputs),
        PleProj => (vec![h, ple], Linear, PerLayerInputs),
        RouterProj => (vec![experts, h], Linear, Router),
        RouterScale => (vec![h], NormScale, Router),
        RouterExpertScale => (vec![experts], NormScale, Router),
        Expert(_, ExpertMatrix::Down) => (vec![h, inter], Linear, RoutedExperts),
        Expert(_, _) => (vec![inter, h], Linear, RoutedExperts),
    }
}

/// A layer's tensors: attention (K/V projections and the K norm only where the layer
/// computes its own K/V; no `v_proj` where keys are the values), the dense MLP, the
/// per-layer input gate (PLE), the router and experts (MoE).
fn layer_keys(cfg: &Gemma4Config, i: usize) -> Vec<LayerKey> {
    use LayerKey::*;
    let t = &cfg.text;
    let l = &t.layers[i];
    let mut keys = vec![InputNorm, PostAttnNorm, PreFfnNorm, PostFfnNorm, LayerScalar, Q, QNorm, O];
    if l.kv_from.is_none() {
        keys.extend([K, KNorm]);
        if !l.k_eq_v {
            keys.push(V);
        }
    }
    keys.extend([MlpGate, MlpUp, MlpDown]);
    if t.ple.is_some() {
        keys.extend([PleGate, PleProj, PlePostNorm]);
    }
    if let Some(m) = t.moe {
        keys.extend([RouterProj, RouterScale, RouterExpertScale, PreFfnNorm2, PostFfnNorm1, PostFfnNorm2]);
        for e in 0..m.experts {
            keys.extend([ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down].map(|m| Expert(e, m)));
        }
    }
    keys
}

/// Every tensor of the text model.
pub fn weight_map(cfg: &Gemma4Config) -> WeightMap {
    let mut map = WeightMap::default();
    let mut add = |k: Key| {
        let (shape, role, group) = spec(cfg, k);
        let expert = match k {
            Key::Layer(l, LayerKey::Expert(e, m)) => Some((l, e, m)),
            _ => None,
        };
        map.specs.push(WeightSpec { name: name(cfg, k), shape, role, group, expert, optional: false });
    };
    add(Key::Embed);
    if cfg.text.ple.is_some() {
        add(Key::EmbedPerLayer);
        add(Key::PleProjection);
        add(Key::PleNorm);
    }
    for i in 0..cfg.text.num_layers() {
        for lk in layer_keys(cfg, i) {
            add(Key::Layer(i, lk));
        }
    }
    add(Key::Norm);
    if !cfg.text.tie_word_embeddings {
        add(Key::LmHead);
    }
    if cfg.text.moe.is_some() {
        map.fused = (0..cfg.text.num_layers()).map(|i| (i, fused_names(cfg, i))).collect();
    }
    if let Some(v) = &cfg.vision {
        super::vision::add_weights(cfg, v, &mut map);
    }
    map
}
