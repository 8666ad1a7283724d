//! Loading a Gemma 4 checkpoint onto a backend: every tensor by its [`Key`] in its stored
//! precision; routed experts sliced out of the fused 3-D tensors (or per expert), or left
//! to a provider (streamed).

use super::attention::{Attention, OwnKv};
use super::config::{Gemma4Config, LayerKind};
use super::ffn::{Ffn, Mlp, Routed};
use super::model::{Gemma4, Layer};
use super::ple::{LayerPle, Ple};
use super::weights::{fused_names, name, spec, weight_map, Key, LayerKey};
use crate::blocks::ExpertSource;
use crate::weights::{load_expert, load_matrix, load_vector, ExpertMatrix, ExpertShape, FusedForm};
use anyhow::Result;
use std::sync::Arc;
use strata_backend::{Backend, GqaDims};
use strata_experts::{ExpertProvider, ResidentExperts};
use strata_storage::WeightStore;

struct Loader<'a, B: Backend> {
    b: &'a B,
    store: &'a WeightStore,
    cfg: &'a Gemma4Config,
}

impl<B: Backend> Loader<'_, B> {
    fn mat(&self, k: Key) -> Result<B::Mat> {
        let (shape, role, _) = spec(self.cfg, k);
        let m = load_matrix(self.store, &name(self.cfg, k), [shape[0], shape[1]], role, self.cfg.fp8_block)?;
        self.b.matrix(m)
    }
    fn host_vec(&self, k: Key) -> Result<Vec<f32>> {
        let (shape, _, _) = spec(self.cfg, k);
        load_vector(self.store, &name(self.cfg, k), shape[0])
    }
    fn vec(&self, k: Key) -> Result<B::Buf> {
        self.b.upload(&self.host_vec(k)?)
    }
    fn layer(&self, i: usize) -> impl Fn(LayerKey) -> Key {
        move |lk| Key::Layer(i, lk)
    }

    fn expert(&self, layer: usize, e: usize) -> Result<[B::Mat; 3]> {
        let per = |m| name(self.cfg, Key::Layer(layer, LayerKey::Expert(e, m)));
        let names = [per(ExpertMatrix::Gate), per(ExpertMatrix::Up), per(ExpertMatrix::Down)];
        let t = &self.cfg.text;
        let moe = t.moe.expect("experts of an MoE model");
        let shape = ExpertShape { experts: moe.experts, hidden: t.hidden_size, inter: moe.inter };
        let [g, u, d] = load_expert(
            self.store,
            &names,
            &fused_names(self.cfg, layer),
            FusedForm::Stacked,
            shape,
            e,
            self.cfg.fp8_block,
        )?;
        Ok([self.b.matrix(g)?, self.b.matrix(u)?, self.b.matrix(d)?])
    }

    fn attention(&self, i: usize) -> Result<Attention<B>> {
        use LayerKey::*;
        let (t, k) = (&self.cfg.text, self.layer(i));
        let l = &t.layers[i];
        let kv = match l.kv_from {
            Some(_) => None,
            None => Some(OwnKv {
                k: self.mat(k(K))?,
                v: if l.k_eq_v { None } else { Some(self.mat(k(V))?) },
                k_norm: self.vec(k(KNorm))?,
            }),
        };
        Ok(Attention {
            dims: gqa_dims(self.cfg, i),
            q: self.mat(k(Q))?,
            q_norm: self.vec(k(QNorm))?,
            kv,
            o: self.mat(k(O))?,
            post_norm: self.vec(k(PostAttnNorm))?,
        })
    }

    fn ffn(&self, i: usize) -> Result<Ffn<B>> {
        use LayerKey::*;
        let (t, k) = (&self.cfg.text, self.layer(i));
        let moe = match t.moe {
            None => None,
            Some(spec) => {
                // The router's input norm weight: `scale * hidden^-0.5`.
                let root = (t.hidden_size as f32).powf(-0.5);
                let norm: Vec<f32> = self.host_vec(k(RouterScale))?.iter().map(|s| s * root).collect();
                Some(Routed {
                    block: crate::blocks::Moe {
                        layer: i,
                        router: crate::blocks::Router::Softmax {
                            gate: self.mat(k(RouterProj))?,
                            gate_bias: None,
                            expert_scale: self.vec(k(RouterExpertScale))?,
                            routing: strata_backend::SoftmaxRouting { top_k: spec.top_k, renormalize: true },
                        },
                        experts: spec.experts,
                        act: strata_backend::GateAct::GeluTanh,
                        biases: None,
                        shared: None,
                    },
                    router_norm: self.b.upload(&norm)?,
                    pre_norm_2: self.vec(k(PreFfnNorm2))?,
                    post_norm_1: self.vec(k(PostFfnNorm1))?,
                    post_norm_2: self.vec(k(PostFfnNorm2))?,
                })
            }
        };
        Ok(Ffn {
            pre_norm: self.vec(k(PreFfnNorm))?,
            post_norm: self.vec(k(PostFfnNorm))?,
            mlp: Mlp { gate: self.mat(k(MlpGate))?, up: self.mat(k(MlpUp))?, down: self.mat(k(MlpDown))? },
            moe,
        })
    }
}

/// The attention dimensions of layer `i`: RoPE over the whole head (proportional RoPE's
/// unrotated pairs have frequency zero), attention scaling 1, the window on sliding layers.
pub(super) fn gqa_dims(cfg: &Gemma4Config, i: usize) -> GqaDims {
    let t = &cfg.text;
    let l = &t.layers[i];
    GqaDims {
        heads: t.num_attention_heads,
        kv_heads: l.kv_heads,
        head_dim: l.head_dim,
        rotary: l.head_dim,
        scale: 1.0,
        window: (l.kind == LayerKind::Sliding).then_some(t.sliding_window),
    }
}

impl<B: Backend> Gemma4<B> {
    /// Loads the text model from `store`; routed experts from the checkpoint, or from
    /// `provider` when given.
    pub fn load(
        b: B,
        cfg: Gemma4Config,
        store: &WeightStore,
        provider: Option<Arc<dyn ExpertProvider<B>>>,
    ) -> Result<Self> {
        weight_map(&cfg).check(store, provider.is_some())?;
        let ld = Loader { b: &b, store, cfg: &cfg };
        let t = &cfg.text;
        let embed = ld.mat(Key::Embed)?;
        let lm_head = if t.tie_word_embeddings { None } else { Some(ld.mat(Key::LmHead)?) };
        let ple = match t.ple {
            None => None,
            Some(p) => Some(Ple {
                table: ld.mat(Key::EmbedPerLayer)?,
                proj: ld.mat(Key::PleProjection)?,
                norm: ld.vec(Key::PleNorm)?,
                dim: p.dim,
                layers: t.num_layers(),
            }),
        };
        let mut layers = Vec::with_capacity(t.num_layers());
        let mut resident: Vec<Option<Vec<[B::Mat; 3]>>> = Vec::new();
        for (i, l) in t.layers.iter().enumerate() {
            use LayerKey::*;
            let k = ld.layer(i);
            if let (Some(m), None) = (t.moe, &provider) {
                resident.resize_with(i + 1, || None);
                resident[i] = Some((0..m.experts).map(|e| ld.expert(i, e)).collect::<Result<_>>()?);
            }
            let scalar = ld.host_vec(k(LayerScalar))?[0];
            let layer_ple = match t.ple {
                None => None,
                Some(_) => Some(LayerPle {
                    gate: ld.mat(k(PleGate))?,
                    proj: ld.mat(k(PleProj))?,
                    post_norm: ld.vec(k(PlePostNorm))?,
                }),
            };
            layers.push(Layer {
                kind: l.kind,
                input_norm: ld.vec(k(InputNorm))?,
                attn: ld.attention(i)?,
                kv_from: l.kv_from,
                ffn: ld.ffn(i)?,
                ple: layer_ple,
                scalar,
            });
        }
        let norm = ld.vec(Key::Norm)?;
        let experts = match provider {
            Some(p) => ExpertSource::Provider(p),
            None => ExpertSource::Resident(ResidentExperts::new(ld.b, resident)?),
        };
        let rope = |kind: LayerKind| {
            let hd = t.kind_shape(kind).map_or(0, |(hd, _)| hd);
            t.rope(kind).inv_freq(hd)
        };
        Ok(Self {
            info: super::info(&cfg),
            rope_sliding: rope(LayerKind::Sliding),
            rope_full: rope(LayerKind::Full),
            embed,
            lm_head,
            norm,
            ple,
            layers,
            experts,
            vision: match &cfg.vision {
                Some(v) => Some(super::vision::VisionTower::load(&b, &cfg, v, store)?),
                None => None,
            },
            cfg,
            b,
        })
    }
}
