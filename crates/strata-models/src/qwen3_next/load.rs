//! Loading a Qwen3-Next checkpoint onto a backend: tensors in their stored precision, the
//! norms that transformers applies as `1 + w` stored so, q_proj split into the query and
//! the output gate, and the DeltaNet's input projections reordered head-major.

use super::model::{DeltaWeights, Layer, Mixer, Qwen3Next};
use super::weights::{fused_names, name, spec, weight_map, Key, LayerKey};
use super::{Qwen3NextConfig, Variant};
use crate::blocks::{ExpertSource, Ffn, GqaWeights, Moe, SharedExpert, SwiGlu};
use crate::weights::{load_expert, load_matrix, load_vector, ExpertMatrix, ExpertShape, FusedForm};
use crate::ModelInfo;
use anyhow::Result;
use std::sync::Arc;
use strata_backend::{Backend, GateAct, HostMatrix, SoftmaxRouting};
use strata_experts::{ExpertProvider, ResidentExperts};
use strata_storage::WeightStore;

struct Loader<'a, B: Backend> {
    b: &'a B,
    store: &'a WeightStore,
    cfg: &'a Qwen3NextConfig,
}

impl<B: Backend> Loader<'_, B> {
    fn host(&self, k: Key) -> Result<HostMatrix> {
        let (shape, role, _) = spec(self.cfg, k);
        load_matrix(self.store, &name(self.cfg, k), [shape[0], shape[1]], role, None)
    }
    fn mat(&self, k: Key) -> Result<B::Mat> {
        self.b.matrix(self.host(k)?)
    }
    fn vec(&self, k: Key) -> Result<B::Buf> {
        let (shape, _, _) = spec(self.cfg, k);
        self.b.upload(&self.store.load_f32(&name(self.cfg, k), &shape, None)?)
    }
    /// A norm transformers applies as `x * (1 + w)`.
    fn norm(&self, k: Key) -> Result<B::Buf> {
        let (shape, _, _) = spec(self.cfg, k);
        let w: Vec<f32> = load_vector(self.store, &name(self.cfg, k), shape[0])?.iter().map(|v| 1.0 + v).collect();
        self.b.upload(&w)
    }
    fn swiglu(&self, i: usize, keys: [LayerKey; 3]) -> Result<SwiGlu<B>> {
        let [g, u, d] = keys.map(|k| Key::Layer(i, k));
        Ok(SwiGlu { gate: self.mat(g)?, up: self.mat(u)?, down: self.mat(d)? })
    }

    /// q_proj holds, head by head, the query then its output gate: split into the two.
    fn attention(&self, i: usize) -> Result<GqaWeights<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        let hd = self.cfg.head_dim;
        let q = self.host(k(Q))?;
        let query = q.rows_where(|r| r % (2 * hd) < hd);
        let gate = q.rows_where(|r| r % (2 * hd) >= hd);
        Ok(GqaWeights {
            q: self.b.matrix(query)?,
            k: self.mat(k(K))?,
            v: self.mat(k(V))?,
            q_bias: None,
            k_bias: None,
            v_bias: None,
            q_norm: Some(self.norm(k(QNorm))?),
            k_norm: Some(self.norm(k(KNorm))?),
            full_norm: false,
            o: self.mat(k(O))?,
            o_bias: None,
            sinks: None,
            out_gate: Some(self.b.matrix(gate)?),
        })
    }

    /// The DeltaNet's input projections as two matrices, rows in the kernel's order (all
    /// q, all k, all v, all z; all b, all a). Qwen3-Next groups its fused projections' rows
    /// by key head (q, k, v, z of each; b, a of each): reordered. Qwen3.5's four are in
    /// that order already: stacked.
    fn delta_inputs(&self, i: usize) -> Result<(HostMatrix, HostMatrix)> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        if let Variant::Qwen35 { .. } = self.cfg.variant {
            let qkvz = HostMatrix::stack_rows(&[self.host(k(InProjQkv))?, self.host(k(InProjZ))?])?;
            let ba = HostMatrix::stack_rows(&[self.host(k(InProjB))?, self.host(k(InProjA))?])?;
            return Ok((qkvz, ba));
        }
        let d = &self.cfg.delta;
        let r = d.v_heads / d.k_heads;
        let (kd, vd) = (d.k_dim, r * d.v_dim);
        let group = 2 * kd + 2 * vd;
        let parts = [(0, kd), (kd, kd), (2 * kd, vd), (2 * kd + vd, vd)];
        let order: Vec<usize> = parts
            .iter()
            .flat_map(|&(at, n)| (0..d.k_heads).flat_map(move |g| g * group + at..g * group + at + n))
            .collect();
        let qkvz = self.host(k(InProjQkvz))?.rows_in(&order);
        let ba_order: Vec<usize> = [0, r]
            .iter()
            .flat_map(|&at| (0..d.k_heads).flat_map(move |g| g * 2 * r + at..g * 2 * r + at + r))
            .collect();
        Ok((qkvz, self.host(k(InProjBa))?.rows_in(&ba_order)))
    }

    fn delta(&self, i: usize, slot: usize) -> Result<DeltaWeights<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        let (qkvz, ba) = self.delta_inputs(i)?;
        Ok(DeltaWeights {
            qkvz: self.b.matrix(qkvz)?,
            ba: self.b.matrix(ba)?,
            conv: self.vec(k(Conv))?,
            dt_bias: self.vec(k(DtBias))?,
            a_log: self.vec(k(ALog))?,
            norm: self.vec(k(GatedNorm))?,
            out: self.mat(k(OutProj))?,
            slot,
        })
    }

    fn expert(&self, layer: usize, e: usize) -> Result<[B::Mat; 3]> {
        let c = self.cfg;
        let per = |m| name(c, Key::Layer(layer, LayerKey::Expert(e, m)));
        let names = [per(ExpertMatrix::Gate), per(ExpertMatrix::Up), per(ExpertMatrix::Down)];
        let shape = ExpertShape { experts: c.num_experts, hidden: c.hidden_size, inter: c.moe_intermediate_size };
        let fused = fused_names(c, layer);
        let [g, u, d] = load_expert(self.store, &names, &fused, FusedForm::Stacked, shape, e, None)?;
        Ok([self.b.matrix(g)?, self.b.matrix(u)?, self.b.matrix(d)?])
    }

    fn moe(&self, i: usize) -> Result<Moe<B>> {
        use LayerKey::*;
        let c = self.cfg;
        Ok(Moe {
            layer: i,
            router: crate::blocks::Router::Softmax {
                gate: self.mat(Key::Layer(i, LayerKey::Router))?,
                gate_bias: None,
                expert_scale: self.b.upload(&vec![1.0; c.num_experts])?,
                routing: SoftmaxRouting { top_k: c.num_experts_per_tok, renormalize: c.norm_topk_prob },
            },
            experts: c.num_experts,
            act: GateAct::Silu,
            biases: None,
            shared: Some(SharedExpert {
                mlp: self.swiglu(i, [SharedGate, SharedUp, SharedDown])?,
                gate: Some(self.mat(Key::Layer(i, SharedExpertGate))?),
            }),
        })
    }
}

impl<B: Backend> Qwen3Next<B> {
    pub fn load(
        b: B,
        cfg: Qwen3NextConfig,
        info: ModelInfo,
        store: &WeightStore,
        provider: Option<Arc<dyn ExpertProvider<B>>>,
    ) -> Result<Self> {
        let map = weight_map(&cfg);
        map.check(store, provider.is_some())?;
        map.check_no_strangers(store)?;
        let ld = Loader { b: &b, store, cfg: &cfg };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut resident: Vec<Option<Vec<[B::Mat; 3]>>> = Vec::new();
        let (mut attn_slots, mut delta_slots) = (0, 0);
        for i in 0..cfg.num_hidden_layers {
            use LayerKey::*;
            let mixer = match cfg.linear[i] {
                true => {
                    delta_slots += 1;
                    Mixer::Delta(ld.delta(i, delta_slots - 1)?)
                }
                false => {
                    attn_slots += 1;
                    Mixer::Attention { attn: ld.attention(i)?, cache: attn_slots - 1 }
                }
            };
            let ffn = match cfg.is_sparse(i) {
                false => Ffn::Dense(ld.swiglu(i, [MlpGate, MlpUp, MlpDown])?),
                true => {
                    if provider.is_none() {
                        resident.resize_with(i + 1, || None);
                        resident[i] = Some((0..cfg.num_experts).map(|e| ld.expert(i, e)).collect::<Result<_>>()?);
                    }
                    Ffn::Moe(ld.moe(i)?)
                }
            };
            layers.push(Layer {
                input_norm: ld.norm(Key::Layer(i, InputNorm))?,
                post_norm: ld.norm(Key::Layer(i, PostNorm))?,
                mixer,
                ffn,
            });
        }
        let experts = match provider {
            Some(p) => ExpertSource::Provider(p),
            None => ExpertSource::Resident(ResidentExperts::new(&b, resident)?),
        };
        Ok(Self {
            embed: ld.mat(Key::Embed)?,
            lm_head: if cfg.tie_word_embeddings { None } else { Some(ld.mat(Key::LmHead)?) },
            norm: ld.norm(Key::Norm)?,
            rope_inv: strata_kernels::ops::rope_inv_freq(cfg.rotary_dim, cfg.rope_theta),
            dims: cfg.gqa_dims(),
            attn_layers: attn_slots,
            delta_layers: delta_slots,
            info,
            layers,
            experts,
            cfg,
            b,
        })
    }
}
