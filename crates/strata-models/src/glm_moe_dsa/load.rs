//! Loading a `glm_moe_dsa` checkpoint onto a backend: every tensor by its [`Key`], in
//! its stored precision, the one-time surgery (`kv_b` with per-row scales, `eh_proj`
//! split by input), routed experts per expert or from the fused 3-D layout.

use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
use super::model::{Glm, Layer, Mtp};
use super::weights::{name, spec, Key, LayerKey};
use crate::blocks::mla::IndexerWeights;
use crate::blocks::{ExpertSource, Ffn, MlaConfig, MlaWeights, Moe, SwiGlu};
use crate::weights::{fused_expert_names, load_expert, load_matrix, load_vector, ExpertMatrix, ExpertShape, FusedForm};
use anyhow::Result;
use std::sync::Arc;
use strata_backend::{Backend, HostMatrix, IndexDims, MlaDims, RouterParams};
use strata_experts::{ExpertProvider, ResidentExperts};
use strata_storage::WeightStore;

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` and the indexer's key norm
/// with their default eps (1e-6), not `rms_norm_eps`.
const LORA_NORM_EPS: f32 = 1e-6;
const INDEX_NORM_EPS: f32 = 1e-6;

/// Where a layer's routed experts come from while loading.
pub enum ExpertsFrom<B: Backend> {
    Checkpoint,
    Provider(Arc<dyn ExpertProvider<B>>),
}

struct Loader<'a, B: Backend> {
    b: &'a B,
    store: &'a WeightStore,
    cfg: &'a GlmMoeDsaConfig,
}

impl<B: Backend> Loader<'_, B> {
    fn host(&self, k: Key) -> Result<HostMatrix> {
        let (shape, role, _) = spec(self.cfg, k);
        load_matrix(self.store, &name(k), [shape[0], shape[1]], role, self.cfg.fp8_block)
    }
    fn mat(&self, k: Key) -> Result<B::Mat> {
        self.b.matrix(self.host(k)?)
    }
    fn vec(&self, k: Key) -> Result<B::Buf> {
        let (shape, _, _) = spec(self.cfg, k);
        self.b.upload(&load_vector(self.store, &name(k), shape[0])?)
    }
    fn swiglu(&self, layer: usize, keys: [LayerKey; 3]) -> Result<SwiGlu<B>> {
        let [g, u, d] = keys.map(|k| Key::Layer(layer, k));
        Ok(SwiGlu { gate: self.mat(g)?, up: self.mat(u)?, down: self.mat(d)? })
    }

    /// One routed expert from per-expert tensors or a slice of the fused 3-D ones.
    fn expert(&self, layer: usize, e: usize) -> Result<[B::Mat; 3]> {
        let per = |m| name(Key::Layer(layer, LayerKey::Expert(e, m)));
        let names = [per(ExpertMatrix::Gate), per(ExpertMatrix::Up), per(ExpertMatrix::Down)];
        let cfg = self.cfg;
        let shape =
            ExpertShape { experts: cfg.n_routed_experts, hidden: cfg.hidden_size, inter: cfg.moe_intermediate_size };
        let [g, u, d] =
            load_expert(self.store, &names, &fused_expert_names(layer), FusedForm::Stacked, shape, e, cfg.fp8_block)?;
        Ok([self.b.matrix(g)?, self.b.matrix(u)?, self.b.matrix(d)?])
    }

    fn attention(&self, i: usize) -> Result<MlaWeights<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        // Main layers follow the config's schedule; the MTP layer runs its own indexer
        // when the checkpoint has one.
        let full = match self.cfg.indexer_types.get(i) {
            Some(kind) => *kind == IndexerKind::Full,
            None => self.store.contains(&name(k(IndexWk))),
        };
        let indexer = match full {
            false => None,
            true => Some(IndexerWeights {
                wq_b: self.mat(k(IndexWqB))?,
                wk: self.mat(k(IndexWk))?,
                k_norm_w: self.vec(k(IndexKNormW))?,
                k_norm_b: self.vec(k(IndexKNormB))?,
                weights_proj: self.mat(k(IndexWeights))?,
            }),
        };
        Ok(MlaWeights {
            q_a: self.mat(k(QA))?,
            q_a_norm: self.vec(k(QANorm))?,
            q_b: self.mat(k(QB))?,
            kv_a: self.mat(k(KvA))?,
            kv_a_norm: self.vec(k(KvANorm))?,
            // Per-head slices of kv_b must be valid matrices on their own.
            kv_b: self.b.matrix(self.host(k(KvB))?.with_row_scales())?,
            o: self.mat(k(O))?,
            indexer,
        })
    }

    fn router(&self, i: usize) -> RouterParams {
        let cfg = self.cfg;
        let _ = i;
        RouterParams {
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm_topk_prob: cfg.norm_topk_prob,
            scaling: cfg.routed_scaling_factor,
        }
    }

    fn moe(&self, i: usize) -> Result<Moe<B>> {
        use LayerKey::*;
        Ok(Moe {
            layer: i,
            router: crate::blocks::Router::Noaux {
                gate: self.mat(Key::Layer(i, Router))?,
                bias: self.vec(Key::Layer(i, RouterBias))?,
                params: self.router(i),
            },
            experts: self.cfg.n_routed_experts,
            act: strata_backend::GateAct::Silu,
            biases: None,
            shared: Some(crate::blocks::SharedExpert {
                mlp: self.swiglu(i, [SharedGate, SharedUp, SharedDown])?,
                gate: None,
            }),
        })
    }

    fn resident_experts(&self, i: usize) -> Result<Vec<[B::Mat; 3]>> {
        (0..self.cfg.n_routed_experts).map(|e| self.expert(i, e)).collect()
    }

    /// The MTP layer `i` (= `num_hidden_layers`).
    fn mtp(&self, i: usize, experts: ExpertsFrom<B>) -> Result<Mtp<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        let h = self.cfg.hidden_size;
        let (eh_e, eh_h) = self.host(k(MtpEhProj))?.split_cols(h)?;
        let experts = match experts {
            ExpertsFrom::Provider(p) => ExpertSource::Provider(p),
            ExpertsFrom::Checkpoint => {
                let mut layers: Vec<Option<Vec<[B::Mat; 3]>>> = (0..=i).map(|_| None).collect();
                layers[i] = Some(self.resident_experts(i)?);
                ExpertSource::Resident(ResidentExperts::new(self.b, layers)?)
            }
        };
        let own = |lk| self.store.contains(&name(k(lk)));
        Ok(Mtp {
            enorm: self.vec(k(MtpEnorm))?,
            hnorm: self.vec(k(MtpHnorm))?,
            eh_e: self.b.matrix(eh_e)?,
            eh_h: self.b.matrix(eh_h)?,
            head_norm: self.vec(k(MtpHeadNorm))?,
            embed: if own(MtpEmbed) { Some(self.mat(k(MtpEmbed))?) } else { None },
            head: if own(MtpHead) { Some(self.mat(k(MtpHead))?) } else { None },
            block: Layer {
                input_norm: self.vec(k(InputNorm))?,
                post_norm: self.vec(k(PostNorm))?,
                attn: self.attention(i)?,
                mlp: Ffn::Moe(self.moe(i)?),
            },
            experts,
        })
    }
}

pub fn mla_config(cfg: &GlmMoeDsaConfig) -> MlaConfig {
    MlaConfig {
        dims: MlaDims {
            heads: cfg.num_attention_heads,
            nope: cfg.qk_nope_head_dim,
            rope: cfg.qk_rope_head_dim,
            v: cfg.v_head_dim,
            kv_lora: cfg.kv_lora_rank,
            scale: ((cfg.qk_head_dim() as f64).powf(-0.5) * cfg.rope.deepseek_softmax_factor()) as f32,
        },
        index: IndexDims {
            heads: cfg.index_n_heads,
            dim: cfg.index_head_dim,
            rope: cfg.qk_rope_head_dim,
            topk: cfg.index_topk,
        },
        q_lora: cfg.q_lora_rank,
        lora_eps: LORA_NORM_EPS,
        index_eps: INDEX_NORM_EPS,
    }
}

/// Whether the checkpoint holds the MTP layer.
pub fn has_mtp(cfg: &GlmMoeDsaConfig, store: &WeightStore) -> bool {
    cfg.num_nextn_predict_layers > 0 && store.contains(&name(Key::Layer(cfg.num_hidden_layers, LayerKey::MtpEhProj)))
}

impl<B: Backend> Glm<B> {
    /// Loads the model from `store`: routed experts from the checkpoint or a provider;
    /// the MTP layer (draft) when `draft` is given and the checkpoint has it.
    pub fn load(
        b: B,
        cfg: GlmMoeDsaConfig,
        store: &WeightStore,
        experts: ExpertsFrom<B>,
        draft: Option<ExpertsFrom<B>>,
    ) -> Result<Self> {
        let provider = match &experts {
            ExpertsFrom::Provider(p) => Some(p.clone()),
            ExpertsFrom::Checkpoint => None,
        };
        let map = super::weights::weight_map(&cfg);
        map.check(store, provider.is_some())?;
        map.check_no_strangers(store)?;
        let ld = Loader { b: &b, store, cfg: &cfg };
        let embed = ld.mat(Key::Embed)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.mat(Key::LmHead)?) };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut resident: Vec<Option<Vec<[B::Mat; 3]>>> = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            use LayerKey::*;
            let mlp = match cfg.mlp_layer_types[i] {
                MlpKind::Dense => Ffn::Dense(ld.swiglu(i, [MlpGate, MlpUp, MlpDown])?),
                MlpKind::Sparse => {
                    if provider.is_none() {
                        resident.resize_with(i + 1, || None);
                        resident[i] = Some(ld.resident_experts(i)?);
                    }
                    Ffn::Moe(ld.moe(i)?)
                }
            };
            layers.push(Layer {
                input_norm: ld.vec(Key::Layer(i, InputNorm))?,
                post_norm: ld.vec(Key::Layer(i, PostNorm))?,
                attn: ld.attention(i)?,
                mlp,
            });
        }
        let norm = ld.vec(Key::Norm)?;
        let mtp = match draft {
            Some(from) if has_mtp(&cfg, store) => Some(ld.mtp(cfg.num_hidden_layers, from)?),
            _ => None,
        };
        let experts = match provider {
            Some(p) => ExpertSource::Provider(p),
            None => ExpertSource::Resident(ResidentExperts::new(ld.b, resident)?),
        };
        Ok(Self {
            info: super::info(&cfg),
            rope_inv: cfg.rope.inv_freq(cfg.qk_rope_head_dim),
            mla: mla_config(&cfg),
            b,
            embed,
            lm_head,
            norm,
            layers,
            experts,
            mtp,
            cfg,
        })
    }
}
