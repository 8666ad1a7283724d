//! The whole model: embedding -> decoder layers -> final norm -> LM head, and its
//! session (model + latent KV cache). Loading does the one-time weight surgery
//! (splitting `kv_b_proj` per head for the absorbed attention).

use super::attention::{Attention, Indexer, LayerCache, Selection};
use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
use super::moe::{Experts, MoeBlock, RouterParams};
use super::rope::Rope;
use crate::experts::{ExpertBackend, Routing};
use crate::nn::{linear, load, LayerNorm, RmsNorm, SwiGlu, Weight};
use crate::{CausalLm, Session};
use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Tensor};
use std::path::Path;
use std::sync::Arc;
use strata_storage::WeightStore;

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` with their default eps, not
/// `rms_norm_eps`; so do we.
const LORA_NORM_EPS: f64 = 1e-6;
const INDEX_NORM_EPS: f64 = 1e-6;
/// Next-layer prediction runs on forwards of at most this many rows.
const PILOT_MAX_ROWS: usize = 8;

enum Mlp {
    Dense(SwiGlu),
    Moe(MoeBlock),
}

struct DecoderLayer {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

pub struct GlmMoeDsa {
    pub cfg: GlmMoeDsaConfig,
    embed: Arc<Weight>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Arc<Weight>,
    rope: Rope,
    device: Device,
}

struct Loader<'a> {
    store: &'a WeightStore,
    fp8: Option<(usize, usize)>,
    device: &'a Device,
}

impl Loader<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        load(self.store, name, shape, self.fp8, self.device)
    }
    fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        Weight::load(self.store, name, shape, self.fp8, self.device)
    }
    fn rms(&self, name: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: self.get(name, &[dim])?, eps })
    }
    fn swiglu(&self, prefix: &str, hidden: usize, inter: usize) -> Result<SwiGlu> {
        Ok(SwiGlu {
            gate: self.weight(&format!("{prefix}.gate_proj.weight"), &[inter, hidden])?,
            up: self.weight(&format!("{prefix}.up_proj.weight"), &[inter, hidden])?,
            down: self.weight(&format!("{prefix}.down_proj.weight"), &[hidden, inter])?,
        })
    }
}

impl GlmMoeDsa {
    /// Loads `config.json` and the weights of a model directory onto `device`.
    pub fn load_dir(dir: &Path, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&cfg_path).with_context(|| format!("{}: cannot read", cfg_path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", cfg_path.display()))?;
        let cfg = GlmMoeDsaConfig::from_json(&json).map_err(|e| anyhow!("{}: {e}", cfg_path.display()))?;
        let store = WeightStore::open_dir(dir)?;
        Self::load(cfg, &store, device)
    }

    pub fn load(cfg: GlmMoeDsaConfig, store: &WeightStore, device: &Device) -> Result<Self> {
        Self::load_with_experts(cfg, store, device, None)
    }

    /// Loads the model; with `experts`, routed experts run on that backend and are not
    /// read from `store` (container checkpoints hold them elsewhere).
    pub fn load_with_experts(
        cfg: GlmMoeDsaConfig,
        store: &WeightStore,
        device: &Device,
        experts: Option<Arc<dyn ExpertBackend>>,
    ) -> Result<Self> {
        let ld = Loader { store, fp8: cfg.fp8_block, device };
        let h = cfg.hidden_size;
        let embed = Arc::new(ld.weight("model.embed_tokens.weight", &[cfg.vocab_size, h])?);
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            Arc::new(ld.weight("lm_head.weight", &[cfg.vocab_size, h])?)
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mlp = match cfg.mlp_layer_types[i] {
                MlpKind::Dense => Mlp::Dense(ld.swiglu(&format!("{p}.mlp"), h, cfg.intermediate_size)?),
                MlpKind::Sparse => Mlp::Moe(load_moe(&ld, &cfg, i, experts.clone())?),
            };
            layers.push(DecoderLayer {
                input_norm: ld.rms(&format!("{p}.input_layernorm.weight"), h, cfg.rms_norm_eps)?,
                attn: load_attention(&ld, &cfg, i)?,
                post_norm: ld.rms(&format!("{p}.post_attention_layernorm.weight"), h, cfg.rms_norm_eps)?,
                mlp,
            });
        }
        Ok(Self {
            norm: ld.rms("model.norm.weight", h, cfg.rms_norm_eps)?,
            rope: Rope::new(cfg.qk_rope_head_dim, cfg.rope_theta, device),
            embed,
            lm_head,
            layers,
            device: device.clone(),
            cfg,
        })
    }

    pub fn session(&self) -> Result<GlmSession<'_>> {
        let caches =
            self.layers.iter().map(|l| l.attn.new_cache(&self.cfg, &self.device)).collect::<Result<Vec<_>>>()?;
        Ok(GlmSession { model: self, caches, len: 0, routes: Vec::new() })
    }
}

fn load_attention(ld: &Loader, cfg: &GlmMoeDsaConfig, i: usize) -> Result<Attention> {
    let p = format!("model.layers.{i}.self_attn");
    let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let (nope, rope, v) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    let kv_lora = cfg.kv_lora_rank;
    let kv_b = ld.get(&format!("{p}.kv_b_proj.weight"), &[heads * (nope + v), kv_lora])?;
    let kv_b = kv_b.reshape((heads, nope + v, kv_lora))?;
    let w_uk = kv_b.narrow(1, 0, nope)?.contiguous()?;
    let w_uv_t = kv_b.narrow(1, nope, v)?.transpose(1, 2)?.contiguous()?;
    let indexer = match cfg.indexer_types[i] {
        IndexerKind::Shared => None,
        IndexerKind::Full => {
            let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
            Some(Indexer {
                wq_b: ld.weight(&format!("{p}.indexer.wq_b.weight"), &[ih * id, cfg.q_lora_rank])?,
                wk: ld.weight(&format!("{p}.indexer.wk.weight"), &[id, h])?,
                k_norm: LayerNorm {
                    weight: ld.get(&format!("{p}.indexer.k_norm.weight"), &[id])?,
                    bias: ld.get(&format!("{p}.indexer.k_norm.bias"), &[id])?,
                    eps: INDEX_NORM_EPS,
                },
                weights_proj: ld.weight(&format!("{p}.indexer.weights_proj.weight"), &[ih, h])?,
                n_heads: ih,
                head_dim: id,
            })
        }
    };
    Ok(Attention {
        q_a: ld.weight(&format!("{p}.q_a_proj.weight"), &[cfg.q_lora_rank, h])?,
        q_a_norm: ld.rms(&format!("{p}.q_a_layernorm.weight"), cfg.q_lora_rank, LORA_NORM_EPS)?,
        q_b: ld.weight(&format!("{p}.q_b_proj.weight"), &[heads * (nope + rope), cfg.q_lora_rank])?,
        kv_a: ld.weight(&format!("{p}.kv_a_proj_with_mqa.weight"), &[kv_lora + rope, h])?,
        kv_a_norm: ld.rms(&format!("{p}.kv_a_layernorm.weight"), kv_lora, LORA_NORM_EPS)?,
        w_uk,
        w_uv_t,
        o: ld.weight(&format!("{p}.o_proj.weight"), &[h, heads * v])?,
        indexer,
        heads,
        nope,
        rope,
        kv_lora,
        v_dim: v,
        index_topk: cfg.index_topk,
        scale: (cfg.qk_head_dim() as f64).powf(-0.5),
    })
}

fn load_moe(
    ld: &Loader,
    cfg: &GlmMoeDsaConfig,
    layer: usize,
    backend: Option<Arc<dyn ExpertBackend>>,
) -> Result<MoeBlock> {
    let p = &format!("model.layers.{layer}");
    let (h, inter, n) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts);
    let bias_name = format!("{p}.mlp.gate.e_score_correction_bias");
    let bias = ld.store.load_f32(&bias_name, &[n], None)?;
    // Checkpoints store experts one by one (GLM-5 on the Hub) or fused as 3-D tensors
    // (transformers' runtime layout); accept both.
    let fused = format!("{p}.mlp.experts.gate_up_proj");
    let experts = if let Some(b) = backend {
        Experts::Backend(b)
    } else if ld.store.contains(&fused) {
        let gate_up = ld.get(&fused, &[n, 2 * inter, h])?;
        let down = ld.get(&format!("{p}.mlp.experts.down_proj"), &[n, h, inter])?;
        (0..n)
            .map(|e| {
                let gu = gate_up.get(e)?;
                Ok(SwiGlu {
                    gate: Weight::Dense(gu.narrow(0, 0, inter)?.contiguous()?),
                    up: Weight::Dense(gu.narrow(0, inter, inter)?.contiguous()?),
                    down: Weight::Dense(down.get(e)?.contiguous()?),
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Experts::Tensors)?
    } else {
        Experts::Tensors(
            (0..n).map(|e| ld.swiglu(&format!("{p}.mlp.experts.{e}"), h, inter)).collect::<Result<Vec<_>>>()?,
        )
    };
    Ok(MoeBlock {
        layer,
        gate: ld.get(&format!("{p}.mlp.gate.weight"), &[n, h])?,
        bias,
        params: RouterParams {
            top_k: cfg.num_experts_per_tok,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm_topk_prob: cfg.norm_topk_prob,
            scaling: cfg.routed_scaling_factor,
        },
        experts,
        shared: ld.swiglu(&format!("{p}.mlp.shared_experts"), h, inter * cfg.n_shared_experts)?,
    })
}

/// A model plus its latent KV cache.
pub struct GlmSession<'m> {
    model: &'m GlmMoeDsa,
    caches: Vec<LayerCache>,
    len: usize,
    /// Routing of the last forward, `(layer, per-row routing)`, for observers and tests.
    pub routes: Vec<(usize, Vec<Routing>)>,
}

impl Session for GlmSession<'_> {
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> Result<Tensor> {
        let m = self.model;
        anyhow::ensure!(!ids.is_empty(), "forward needs at least one token");
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= m.cfg.vocab_size) {
            anyhow::bail!("token id {bad} is outside the vocabulary ({})", m.cfg.vocab_size);
        }
        let t = ids.len();
        let start = self.len;
        let mut x = m.embed.rows(ids, &m.device)?;
        let tables = m.rope.tables(start, t)?;
        let mut selection: Option<Selection> = None;
        self.routes.clear();
        for (i, (layer, cache)) in m.layers.iter().zip(self.caches.iter_mut()).enumerate() {
            let normed = layer.input_norm.forward(&x)?;
            let (attn, sel) = layer.attn.forward(&normed, start, &tables, cache, selection.as_ref())?;
            selection = Some(sel);
            x = (x + attn)?;
            // PILOT: the next layer's router on this residual predicts its experts one
            // layer ahead (narrow calls only: wide prefill batches touch most experts anyway).
            if let Some(Mlp::Moe(next)) = m.layers.get(i + 1).map(|l| &l.mlp) {
                if let Some(b) = next.backend().filter(|b| b.wants_prediction() && t <= PILOT_MAX_ROWS) {
                    let normed_next = m.layers[i + 1].post_norm.forward(&x)?;
                    b.predicted(i + 1, &next.route_rows(&normed_next)?);
                }
            }
            let normed = layer.post_norm.forward(&x)?;
            let mlp = match &layer.mlp {
                Mlp::Dense(d) => d.forward(&normed)?,
                Mlp::Moe(moe) => {
                    let (y, routes) = moe.forward(&normed)?;
                    self.routes.push((i, routes));
                    y
                }
            };
            x = (x + mlp)?;
        }
        self.len += t;
        let x = if all_logits { x } else { x.narrow(0, t - 1, 1)? };
        linear(&m.norm.forward(&x)?, &m.lm_head)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn last_routes(&self) -> &[(usize, Vec<Routing>)] {
        &self.routes
    }

    fn truncate(&mut self, len: usize) {
        for c in &mut self.caches {
            c.latent.truncate(len);
            c.k_rot.truncate(len);
            if let Some(k) = c.index_k.as_mut() {
                k.truncate(len);
            }
        }
        self.len = self.len.min(len);
    }
}

impl CausalLm for GlmMoeDsa {
    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }
    fn max_context(&self) -> usize {
        self.cfg.max_position_embeddings
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        self.cfg.eos_token_ids.clone()
    }
    fn new_session(&self) -> Result<Box<dyn Session + '_>> {
        Ok(Box::new(self.session()?))
    }
}
