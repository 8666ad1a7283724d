//! Loading a decoder checkpoint onto a backend: every tensor by its [`Key`] in its
//! stored precision; routed experts per expert or from the fused 3-D layout, or left to
//! a provider (streamed).

use super::model::{Decoder, Layer};
use super::weights::{name, spec, weight_map, Key, LayerKey};
use super::{DecoderSpec, QkNorm, Routing};
use crate::blocks::moe::ExpertBiases;
use crate::blocks::{ExpertSource, Ffn, GqaWeights, Moe, SwiGlu};
use crate::weights::{fused_expert_names, load_expert, load_matrix, load_vector, ExpertMatrix, ExpertShape, FusedForm};
use crate::ModelInfo;
use anyhow::Result;
use std::sync::Arc;
use strata_backend::{Backend, RouterParams, SoftmaxRouting};
use strata_experts::{ExpertProvider, ResidentExperts};
use strata_storage::WeightStore;

struct Loader<'a, B: Backend> {
    b: &'a B,
    store: &'a WeightStore,
    cfg: &'a DecoderSpec,
    form: FusedForm,
}

impl<B: Backend> Loader<'_, B> {
    fn mat(&self, k: Key) -> Result<B::Mat> {
        let (shape, role, _) = spec(self.cfg, k);
        self.b.matrix(load_matrix(
            self.store,
            &name(self.cfg.naming, k),
            [shape[0], shape[1]],
            role,
            self.cfg.fp8_block,
        )?)
    }
    fn vec(&self, k: Key) -> Result<B::Buf> {
        let (shape, _, _) = spec(self.cfg, k);
        self.b.upload(&load_vector(self.store, &name(self.cfg.naming, k), shape[0])?)
    }
    fn opt_vec(&self, k: Key, present: bool) -> Result<Option<B::Buf>> {
        present.then(|| self.vec(k)).transpose()
    }
    fn swiglu(&self, layer: usize, keys: [LayerKey; 3]) -> Result<SwiGlu<B>> {
        let [g, u, d] = keys.map(|k| Key::Layer(layer, k));
        Ok(SwiGlu { gate: self.mat(g)?, up: self.mat(u)?, down: self.mat(d)? })
    }

    fn expert(&self, layer: usize, e: usize) -> Result<[B::Mat; 3]> {
        let per = |m| name(self.cfg.naming, Key::Layer(layer, LayerKey::Expert(e, m)));
        let names = [per(ExpertMatrix::Gate), per(ExpertMatrix::Up), per(ExpertMatrix::Down)];
        let cfg = self.cfg;
        let shape = ExpertShape { experts: cfg.experts, hidden: cfg.hidden_size, inter: cfg.moe_intermediate_size };
        let [g, u, d] =
            load_expert(self.store, &names, &fused_expert_names(layer), self.form, shape, e, cfg.fp8_block)?;
        Ok([self.b.matrix(g)?, self.b.matrix(u)?, self.b.matrix(d)?])
    }

    fn attention(&self, i: usize) -> Result<GqaWeights<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        let (bias, qk_norm) = (self.cfg.attention_bias, self.cfg.qk_norm != QkNorm::None);
        Ok(GqaWeights {
            q: self.mat(k(Q))?,
            k: self.mat(k(K))?,
            v: self.mat(k(V))?,
            q_bias: self.opt_vec(k(QBias), bias)?,
            k_bias: self.opt_vec(k(KBias), bias)?,
            v_bias: self.opt_vec(k(VBias), bias)?,
            q_norm: self.opt_vec(k(QNorm), qk_norm)?,
            k_norm: self.opt_vec(k(KNorm), qk_norm)?,
            full_norm: self.cfg.qk_norm == QkNorm::Full,
            o: self.mat(k(O))?,
            o_bias: self.opt_vec(k(OBias), self.cfg.o_bias)?,
            sinks: self.opt_vec(k(Sinks), self.cfg.sinks)?,
            out_gate: None,
        })
    }

    fn moe(&self, i: usize) -> Result<Moe<B>> {
        use LayerKey::*;
        let cfg = self.cfg;
        let gate = self.mat(Key::Layer(i, Router))?;
        let router = match cfg.routing {
            Routing::Noaux { n_group, topk_group, norm_topk_prob, scaling } => crate::blocks::Router::Noaux {
                gate,
                bias: self.vec(Key::Layer(i, RouterBias))?,
                params: RouterParams { top_k: cfg.top_k, n_group, topk_group, norm_topk_prob, scaling },
            },
            Routing::Softmax { renormalize } => crate::blocks::Router::Softmax {
                gate,
                gate_bias: self.opt_vec(Key::Layer(i, RouterBias), cfg.router_bias)?,
                expert_scale: self.b.upload(&vec![1.0; cfg.experts])?,
                routing: SoftmaxRouting { top_k: cfg.top_k, renormalize },
            },
        };
        let shared = match cfg.has_shared_expert() {
            true => Some(crate::blocks::SharedExpert {
                mlp: self.swiglu(i, [SharedGate, SharedUp, SharedDown])?,
                gate: None,
            }),
            false => None,
        };
        let biases = match cfg.expert_biases {
            true => Some(self.expert_biases(i)?),
            false => None,
        };
        Ok(Moe { layer: i, router, experts: cfg.experts, act: cfg.expert_act, biases, shared })
    }

    /// gpt-oss's expert biases: `gate_up_proj_bias [E, 2I]` (gate and up interleaved, as
    /// the fused experts are) split into gate and up `[E, I]`; `down_proj_bias [E, H]`.
    fn expert_biases(&self, i: usize) -> Result<ExpertBiases<B>> {
        let (n, inter, h) = (self.cfg.experts, self.cfg.moe_intermediate_size, self.cfg.hidden_size);
        let name = |k| name(self.cfg.naming, Key::Layer(i, k));
        let gate_up = self.store.load_f32(&name(LayerKey::ExpertGateUpBias), &[n, 2 * inter], None)?;
        let gate: Vec<f32> = gate_up.iter().step_by(2).copied().collect();
        let up: Vec<f32> = gate_up.iter().skip(1).step_by(2).copied().collect();
        let down = self.store.load_f32(&name(LayerKey::ExpertDownBias), &[n, h], None)?;
        Ok(ExpertBiases { gate: self.b.upload(&gate)?, up: self.b.upload(&up)?, down: self.b.upload(&down)? })
    }
}

impl<B: Backend> Decoder<B> {
    /// Loads the model from `store`; routed experts from the checkpoint, or from
    /// `provider` when given.
    pub fn load(
        b: B,
        cfg: DecoderSpec,
        info: ModelInfo,
        store: &WeightStore,
        provider: Option<Arc<dyn ExpertProvider<B>>>,
    ) -> Result<Self> {
        let map = weight_map(&cfg);
        map.check(store, provider.is_some())?;
        map.check_no_strangers(store)?;
        let ld = Loader { b: &b, store, cfg: &cfg, form: map.fused_form };
        let embed = ld.mat(Key::Embed)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.mat(Key::LmHead)?) };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mut resident: Vec<Option<Vec<[B::Mat; 3]>>> = Vec::new();
        for i in 0..cfg.num_layers {
            use LayerKey::*;
            let ffn = match cfg.is_sparse(i) {
                false => Ffn::Dense(ld.swiglu(i, [MlpGate, MlpUp, MlpDown])?),
                true => {
                    if provider.is_none() {
                        resident.resize_with(i + 1, || None);
                        resident[i] = Some((0..cfg.experts).map(|e| ld.expert(i, e)).collect::<Result<_>>()?);
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
            info,
            dims: (0..cfg.num_layers).map(|l| cfg.gqa_dims(l)).collect(),
            rope_inv: cfg.rope.inv_freq(cfg.rotary_dim),
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
