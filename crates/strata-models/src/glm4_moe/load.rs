//! Loading a `glm4_moe` checkpoint onto a backend: every tensor by its [`Key`] in its
//! stored precision; routed experts per expert or from the fused 3-D layout, or left to
//! a provider (streamed).

use super::config::Glm4MoeConfig;
use super::model::{Glm4, Layer};
use super::weights::{name, spec, weight_map, Key, LayerKey};
use crate::blocks::{ExpertSource, Ffn, GqaWeights, Moe, SwiGlu};
use crate::weights::{fused_expert_names, load_expert, load_matrix, load_vector, ExpertMatrix, ExpertShape};
use anyhow::Result;
use std::sync::Arc;
use strata_backend::{Backend, GqaDims, RouterParams};
use strata_experts::{ExpertProvider, ResidentExperts};
use strata_storage::WeightStore;

struct Loader<'a, B: Backend> {
    b: &'a B,
    store: &'a WeightStore,
    cfg: &'a Glm4MoeConfig,
}

impl<B: Backend> Loader<'_, B> {
    fn mat(&self, k: Key) -> Result<B::Mat> {
        let (shape, role, _) = spec(self.cfg, k);
        self.b.matrix(load_matrix(self.store, &name(k), [shape[0], shape[1]], role, self.cfg.fp8_block)?)
    }
    fn vec(&self, k: Key) -> Result<B::Buf> {
        let (shape, _, _) = spec(self.cfg, k);
        self.b.upload(&load_vector(self.store, &name(k), shape[0])?)
    }
    fn opt_vec(&self, k: Key, present: bool) -> Result<Option<B::Buf>> {
        present.then(|| self.vec(k)).transpose()
    }
    fn swiglu(&self, layer: usize, keys: [LayerKey; 3]) -> Result<SwiGlu<B>> {
        let [g, u, d] = keys.map(|k| Key::Layer(layer, k));
        Ok(SwiGlu { gate: self.mat(g)?, up: self.mat(u)?, down: self.mat(d)? })
    }

    fn expert(&self, layer: usize, e: usize) -> Result<[B::Mat; 3]> {
        let per = |m| name(Key::Layer(layer, LayerKey::Expert(e, m)));
        let names = [per(ExpertMatrix::Gate), per(ExpertMatrix::Up), per(ExpertMatrix::Down)];
        let cfg = self.cfg;
        let shape =
            ExpertShape { experts: cfg.n_routed_experts, hidden: cfg.hidden_size, inter: cfg.moe_intermediate_size };
        let [g, u, d] = load_expert(self.store, &names, &fused_expert_names(layer), shape, e, cfg.fp8_block)?;
        Ok([self.b.matrix(g)?, self.b.matrix(u)?, self.b.matrix(d)?])
    }

    fn attention(&self, i: usize) -> Result<GqaWeights<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        let (bias, qk_norm) = (self.cfg.attention_bias, self.cfg.use_qk_norm);
        Ok(GqaWeights {
            q: self.mat(k(Q))?,
            k: self.mat(k(K))?,
            v: self.mat(k(V))?,
            q_bias: self.opt_vec(k(QBias), bias)?,
            k_bias: self.opt_vec(k(KBias), bias)?,
            v_bias: self.opt_vec(k(VBias), bias)?,
            q_norm: self.opt_vec(k(QNorm), qk_norm)?,
            k_norm: self.opt_vec(k(KNorm), qk_norm)?,
            o: self.mat(k(O))?,
        })
    }

    fn moe(&self, i: usize) -> Result<Moe<B>> {
        use LayerKey::*;
        let cfg = self.cfg;
        Ok(Moe {
            layer: i,
            router: crate::blocks::Router::Noaux {
                gate: self.mat(Key::Layer(i, Router))?,
                bias: self.vec(Key::Layer(i, RouterBias))?,
                params: RouterParams {
                    top_k: cfg.num_experts_per_tok,
                    n_group: cfg.n_group,
                    topk_group: cfg.topk_group,
                    norm_topk_prob: cfg.norm_topk_prob,
                    scaling: cfg.routed_scaling_factor,
                },
            },
            experts: cfg.n_routed_experts,
            act: strata_backend::GateAct::Silu,
            biases: None,
            shared: Some(crate::blocks::SharedExpert {
                mlp: self.swiglu(i, [SharedGate, SharedUp, SharedDown])?,
                gate: None,
            }),
        })
    }
}

pub(super) fn gqa_dims(cfg: &Glm4MoeConfig) -> GqaDims {
    GqaDims {
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        rotary: cfg.rotary_dim(),
        scale: (cfg.head_dim as f32).powf(-0.5),
        window: None,
    }
}

impl<B: Backend> Glm4<B> {
    /// Loads the model from `store`; routed experts from the checkpoint, or from
    /// `provider` when given.
    pub fn load(
        b: B,
        cfg: Glm4MoeConfig,
        store: &WeightStore,
        provider: Option<Arc<dyn ExpertProvider<B>>>,
    ) -> Result<Self> {
        weight_map(&cfg).check(store, provider.is_some())?;
        let ld = Loader { b: &b, store, cfg: &cfg };
        let embed = ld.mat(Key::Embed)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.mat(Key::LmHead)?) };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut resident: Vec<Option<Vec<[B::Mat; 3]>>> = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            use LayerKey::*;
            let ffn = match cfg.is_sparse(i) {
                false => Ffn::Dense(ld.swiglu(i, [MlpGate, MlpUp, MlpDown])?),
                true => {
                    if provider.is_none() {
                        resident.resize_with(i + 1, || None);
                        resident[i] = Some((0..cfg.n_routed_experts).map(|e| ld.expert(i, e)).collect::<Result<_>>()?);
                    }
                    Ffn::Moe(ld.moe(i)?)
                }
            };
            layers.push(Layer {
                input_norm: ld.vec(Key::Layer(i, InputNorm))?,
                post_norm: ld.vec(Key::Layer(i, PostNorm))?,
                attn: ld.attention(i)?,
                ffn,
            });
        }
        let norm = ld.vec(Key::Norm)?;
        let experts = match provider {
            Some(p) => ExpertSource::Provider(p),
            None => ExpertSource::Resident(ResidentExperts::new(ld.b, resident)?),
        };
        Ok(Self {
            info: super::info(&cfg),
            dims: gqa_dims(&cfg),
            rope_inv: strata_kernels::ops::rope_inv_freq(cfg.rotary_dim(), cfg.rope_theta),
            b,
            embed,
            lm_head,
            norm,
            layers,
            experts,
            cfg,
        })
    }
}
