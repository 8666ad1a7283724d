//! The whole model: embedding -> decoder layers (MLA + DSA attention; dense SwiGLU or
//! noaux_tc MoE) -> final norm -> LM head, and its batch-first session.

use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
use super::weights::{fused_expert_names, name, spec, Key, LayerKey};
use crate::batch::{Batch, SeqId};
use crate::blocks::mla::IndexerWeights;
use crate::blocks::{ExpertSource, MlaCache, MlaConfig, MlaScratch, MlaWeights, MoeScratch, MoeWeights, SwiGlu};
use crate::experts::{ExpertProvider, ResidentExperts, Routes};
use crate::kv::{KvBlocks, BLOCK_SIZE};
use crate::weights::{load_matrix, load_vector, ExpertMatrix};
use crate::{Model, ModelInfo, Session, SessionOptions};
use anyhow::{anyhow, bail, ensure, Result};
use std::sync::Arc;
use strata_backend::{Backend, HostMatrix, IndexDims, LinearOut, MlaDims, RouterParams, Step};
use strata_kernels::{ElementType, QuantKind};
use strata_storage::WeightStore;

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` and the indexer's key norm
/// with their default eps (1e-6), not `rms_norm_eps`.
const LORA_NORM_EPS: f32 = 1e-6;
const INDEX_NORM_EPS: f32 = 1e-6;
/// Next-layer prediction runs on forwards of at most this many rows.
const PILOT_MAX_ROWS: usize = 8;

enum Mlp<B: Backend> {
    Dense(SwiGlu<B>),
    Moe(MoeWeights<B>),
}

struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_norm: B::Buf,
    attn: MlaWeights<B>,
    mlp: Mlp<B>,
}

pub struct Glm<B: Backend> {
    b: B,
    cfg: GlmMoeDsaConfig,
    info: ModelInfo,
    mla: MlaConfig,
    embed: B::Mat,
    lm_head: Option<B::Mat>,
    norm: B::Buf,
    layers: Vec<Layer<B>>,
    experts: ExpertSource<B>,
    rope_inv: Vec<f32>,
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
        let per = |m| Key::Layer(layer, LayerKey::Expert(e, m));
        if self.store.contains(&name(per(ExpertMatrix::Gate))) {
            return Ok([
                self.mat(per(ExpertMatrix::Gate))?,
                self.mat(per(ExpertMatrix::Up))?,
                self.mat(per(ExpertMatrix::Down))?,
            ]);
        }
        let (h, inter, n) = (self.cfg.hidden_size, self.cfg.moe_intermediate_size, self.cfg.n_routed_experts);
        let (gu_name, down_name) = fused_expert_names(layer);
        let slice = |tname: &str, shape: [usize; 3], row0: usize, rows: usize| -> Result<HostMatrix> {
            let (file, t) = self.store.get(tname).ok_or_else(|| {
                anyhow!("missing tensor `{}` (and no fused `{tname}`)", name(per(ExpertMatrix::Gate)))
            })?;
            if t.shape != shape {
                bail!(
                    "{}: tensor `{tname}` has shape {:?} but the config implies {shape:?}",
                    file.path().display(),
                    t.shape
                );
            }
            let kind = match t.dtype {
                ElementType::BF16 => QuantKind::Bf16,
                ElementType::F32 => QuantKind::F32,
                other => bail!("{}: fused experts stored as {other:?} are not supported", file.path().display()),
            };
            let width = t.dtype.size_bytes();
            let per_expert = shape[1] * shape[2] * width;
            let bytes = file.bytes(t)?;
            let start = e * per_expert + row0 * shape[2] * width;
            let payload = bytes[start..start + rows * shape[2] * width].to_vec();
            Ok(HostMatrix { kind, rows, cols: shape[2], payload, scales: Vec::new() })
        };
        let gate = slice(&gu_name, [n, 2 * inter, h], 0, inter)?;
        let up = slice(&gu_name, [n, 2 * inter, h], inter, inter)?;
        let down = slice(&down_name, [n, h, inter], 0, h)?;
        Ok([self.b.matrix(gate)?, self.b.matrix(up)?, self.b.matrix(down)?])
    }

    fn attention(&self, i: usize) -> Result<MlaWeights<B>> {
        use LayerKey::*;
        let k = |lk| Key::Layer(i, lk);
        let indexer = match self.cfg.indexer_types[i] {
            IndexerKind::Shared => None,
            IndexerKind::Full => Some(IndexerWeights {
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
}

impl<B: Backend> Glm<B> {
    /// Loads the main model from `store`; routed experts come from `provider` when given,
    /// else from the checkpoint (held by the model).
    pub fn load(
        b: B,
        cfg: GlmMoeDsaConfig,
        store: &WeightStore,
        provider: Option<Arc<dyn ExpertProvider<B>>>,
    ) -> Result<Self> {
        super::weights::weight_map(&cfg).check(store, provider.is_some())?;
        let ld = Loader { b: &b, store, cfg: &cfg };
        let h = cfg.hidden_size;
        let embed = ld.mat(Key::Embed)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.mat(Key::LmHead)?) };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut resident: Vec<Option<Vec<[B::Mat; 3]>>> = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            use LayerKey::*;
            let mlp = match cfg.mlp_layer_types[i] {
                MlpKind::Dense => Mlp::Dense(ld.swiglu(i, [MlpGate, MlpUp, MlpDown])?),
                MlpKind::Sparse => {
                    if provider.is_none() {
                        resident.resize_with(i + 1, || None);
                        resident[i] = Some((0..cfg.n_routed_experts).map(|e| ld.expert(i, e)).collect::<Result<_>>()?);
                    }
                    Mlp::Moe(MoeWeights {
                        layer: i,
                        gate: ld.mat(Key::Layer(i, Router))?,
                        bias: ld.vec(Key::Layer(i, RouterBias))?,
                        params: RouterParams {
                            top_k: cfg.num_experts_per_tok,
                            n_group: cfg.n_group,
                            topk_group: cfg.topk_group,
                            norm_topk_prob: cfg.norm_topk_prob,
                            scaling: cfg.routed_scaling_factor,
                        },
                        experts: cfg.n_routed_experts,
                        shared: ld.swiglu(i, [SharedGate, SharedUp, SharedDown])?,
                    })
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
        let experts = match provider {
            Some(p) => ExpertSource::Provider(p),
            None => ExpertSource::Resident(ResidentExperts::new(resident)),
        };
        let mla = MlaConfig {
            dims: MlaDims {
                heads: cfg.num_attention_heads,
                nope: cfg.qk_nope_head_dim,
                rope: cfg.qk_rope_head_dim,
                v: cfg.v_head_dim,
                kv_lora: cfg.kv_lora_rank,
                scale: (cfg.qk_head_dim() as f32).powf(-0.5),
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
        };
        let _ = h;
        Ok(Self {
            info: super::info(&cfg),
            rope_inv: strata_kernels::ops::rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta),
            b,
            mla,
            embed,
            lm_head,
            norm,
            layers,
            experts,
            cfg,
        })
    }
}

impl<B: Backend> Model for Glm<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> String {
        self.b.describe()
    }

    fn new_session(&self, opts: SessionOptions) -> Result<Box<dyn Session + '_>> {
        Ok(Box::new(GlmSession::new(self, opts)?))
    }
}

/// The model with KV caches for a set of sequences and the scratch of one forward.
pub struct GlmSession<'m, B: Backend> {
    m: &'m Glm<B>,
    max_rows: usize,
    kv: KvBlocks,
    caches: Vec<MlaCache<B>>,
    step: Step,
    x: B::Buf,
    xn: B::Buf,
    y: B::Buf,
    cos: B::Buf,
    sin: B::Buf,
    mla: MlaScratch<B>,
    moe: Option<MoeScratch<B>>,
    /// Rows per sequence in the current forward.
    pending: Vec<(SeqId, usize)>,
    want: Vec<u32>,
    want_cap: usize,
    hidden: B::Buf,
    xsn: B::Buf,
    logits: B::Buf,
    host_logits: Vec<f32>,
    host_hidden: Vec<f32>,
    last_rows: usize,
    routes: Routes,
}

impl<'m, B: Backend> GlmSession<'m, B> {
    fn new(m: &'m Glm<B>, opts: SessionOptions) -> Result<Self> {
        let (b, cfg) = (&m.b, &m.cfg);
        ensure!(opts.max_rows > 0 && opts.max_seqs > 0, "a session needs room for at least one row and one sequence");
        let max_len = opts.max_len.min(cfg.max_position_embeddings).max(1);
        let kv = KvBlocks::new(opts.kv_tokens.max(1), opts.max_seqs, max_len);
        let slots = kv.slots();
        let caches = (0..cfg.num_hidden_layers)
            .map(|i| MlaCache::new(b, &m.mla, slots, cfg.indexer_types[i] == IndexerKind::Full))
            .collect::<Result<Vec<_>>>()?;
        let (rows, h) = (opts.max_rows, cfg.hidden_size);
        let moe = match cfg.mlp_layer_types.contains(&MlpKind::Sparse) {
            true => Some(MoeScratch::new(b, rows, h, cfg.n_routed_experts, cfg.num_experts_per_tok)?),
            false => None,
        };
        b.reserve_workspace(cfg.num_attention_heads.max(cfg.index_n_heads), cfg.index_topk.min(max_len));
        let want_cap = opts.max_seqs.min(rows).max(1);
        let mut step = Step { block_size: BLOCK_SIZE, ..Default::default() };
        step.tokens.reserve(rows);
        step.positions.reserve(rows);
        step.seq.reserve(rows);
        step.blocks.reserve(opts.max_seqs * kv.max_blocks());
        Ok(Self {
            m,
            max_rows: rows,
            caches,
            step,
            x: b.alloc(rows * h)?,
            xn: b.alloc(rows * h)?,
            y: b.alloc(rows * h)?,
            cos: b.alloc(rows * cfg.qk_rope_head_dim / 2)?,
            sin: b.alloc(rows * cfg.qk_rope_head_dim / 2)?,
            mla: MlaScratch::new(b, &m.mla, rows, max_len)?,
            moe,
            pending: Vec::with_capacity(opts.max_seqs),
            want: Vec::with_capacity(rows),
            want_cap,
            hidden: b.alloc(want_cap * h)?,
            xsn: b.alloc(want_cap * h)?,
            logits: b.alloc(want_cap * cfg.vocab_size)?,
            host_logits: Vec::new(),
            host_hidden: Vec::new(),
            last_rows: 0,
            routes: Routes::default(),
            kv,
        })
    }

    /// Fills the step's rows from `batch` and reserves their KV blocks.
    fn plan_step(&mut self, batch: &Batch) -> Result<()> {
        let rows = batch.len();
        ensure!(rows > 0, "forward needs at least one row");
        ensure!(rows <= self.max_rows, "a forward of {rows} rows exceeds the session's {} rows", self.max_rows);
        self.step.clear();
        self.pending.clear();
        self.want.clear();
        let vocab = self.m.cfg.vocab_size;
        for (r, row) in batch.rows.iter().enumerate() {
            ensure!(self.kv.contains(row.seq), "sequence {} is not in this session", row.seq.0);
            if row.token != u32::MAX && row.token as usize >= vocab {
                bail!("token id {} is outside the vocabulary ({vocab})", row.token);
            }
            let i = match self.pending.iter().position(|(s, _)| *s == row.seq) {
                Some(i) => i,
                None => {
                    self.pending.push((row.seq, 0));
                    self.pending.len() - 1
                }
            };
            let pos = self.kv.len(row.seq) + self.pending[i].1;
            self.pending[i].1 += 1;
            self.step.tokens.push(row.token);
            self.step.positions.push(pos as u32);
            self.step.seq.push(row.seq.0);
            if row.logits {
                self.want.push(r as u32);
            }
        }
        for &(s, n) in &self.pending {
            self.kv.reserve(s, n)?;
        }
        self.kv.write_tables(&mut self.step.blocks);
        self.step.max_blocks = self.kv.max_blocks();
        self.step.block_size = BLOCK_SIZE;
        Ok(())
    }

    fn ensure_logit_rows(&mut self, n: usize) -> Result<()> {
        if n > self.want_cap {
            let (b, h, v) = (&self.m.b, self.m.cfg.hidden_size, self.m.cfg.vocab_size);
            self.hidden = b.alloc(n * h)?;
            self.xsn = b.alloc(n * h)?;
            self.logits = b.alloc(n * v)?;
            self.want_cap = n;
        }
        Ok(())
    }
}

impl<B: Backend> Session for GlmSession<'_, B> {
    fn add_sequence(&mut self) -> Result<SeqId> {
        self.kv.add()
    }

    fn remove_sequence(&mut self, seq: SeqId) {
        self.kv.remove(seq)
    }

    fn len(&self, seq: SeqId) -> usize {
        self.kv.len(seq)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) {
        self.kv.truncate(seq, len)
    }

    fn max_len(&self) -> usize {
        self.kv.max_len()
    }

    fn max_rows(&self) -> usize {
        self.max_rows
    }

    fn forward(&mut self, batch: &Batch) -> Result<()> {
        self.plan_step(batch)?;
        let m = self.m;
        let (b, cfg) = (&m.b, &m.cfg);
        let (rows, h, eps) = (batch.len(), cfg.hidden_size, cfg.rms_norm_eps as f32);
        b.embed(&self.step, &m.embed, &mut self.x)?;
        for (r, row) in batch.rows.iter().enumerate() {
            if row.token == u32::MAX {
                ensure!(
                    batch.embedding_width == h,
                    "embedding rows of width {} for a model of width {h}",
                    batch.embedding_width
                );
                let e = row.embedding as usize;
                b.write(&mut self.x, r * h, &batch.embeddings[e * h..(e + 1) * h]);
            }
        }
        b.rope_tables(&self.step, &m.rope_inv, &mut self.cos, &mut self.sin);
        self.routes.clear(rows, cfg.num_experts_per_tok);
        let predict = m.experts.provider().filter(|p| p.wants_prediction() && rows <= PILOT_MAX_ROWS);
        for (i, layer) in m.layers.iter().enumerate() {
            b.rms_norm(rows, h, &self.x, Some(&layer.input_norm), eps, &mut self.xn);
            layer.attn.forward_add(
                b,
                &self.step,
                &m.mla,
                &self.xn,
                &self.cos,
                &self.sin,
                &mut self.caches[i],
                &mut self.mla,
                &mut self.x,
            );
            // PILOT: the next MoE layer's router on this residual, one layer early.
            if let (Some(p), Some(next)) = (predict, m.layers.get(i + 1)) {
                if let (Mlp::Moe(moe), Some(s)) = (&next.mlp, self.moe.as_mut()) {
                    b.rms_norm(rows, h, &self.x, Some(&next.post_norm), eps, &mut self.xn);
                    moe.predict(b, &self.xn, rows, s, p.as_ref());
                }
            }
            b.rms_norm(rows, h, &self.x, Some(&layer.post_norm), eps, &mut self.xn);
            match &layer.mlp {
                Mlp::Dense(mlp) => mlp.forward_add(b, &self.xn, rows, h, &mut self.y, &mut self.x),
                Mlp::Moe(moe) => {
                    let s = self.moe.as_mut().expect("MoE scratch");
                    moe.forward_add(b, &m.experts, &self.xn, rows, h, s, &mut self.routes, &mut self.x)?;
                }
            }
        }
        for &(s, n) in &self.pending {
            let len = self.kv.len(s) + n;
            self.kv.set_len(s, len);
        }
        // Logits (and hidden states) of the rows that want them.
        let n = self.want.len();
        self.last_rows = n;
        if n > 0 {
            self.ensure_logit_rows(n)?;
            b.gather_rows(&self.x, h, &self.want, &mut self.hidden);
            b.rms_norm(n, h, &self.hidden, Some(&m.norm), eps, &mut self.xsn);
            let head = m.lm_head.as_ref().unwrap_or(&m.embed);
            b.linears(&self.xsn, n, &mut [LinearOut::new(b, head, &mut self.logits)]);
            if b.host(&self.logits).is_none() {
                self.host_logits.resize(n * cfg.vocab_size, 0.0);
                b.read(&self.logits, 0, &mut self.host_logits);
                self.host_hidden.resize(n * h, 0.0);
                b.read(&self.hidden, 0, &mut self.host_hidden);
            }
        }
        Ok(())
    }

    fn logits(&self) -> &[f32] {
        let n = self.last_rows * self.m.cfg.vocab_size;
        match self.m.b.host(&self.logits) {
            Some(l) => &l[..n],
            None => &self.host_logits[..n],
        }
    }

    fn hidden(&self) -> &[f32] {
        let n = self.last_rows * self.m.cfg.hidden_size;
        match self.m.b.host(&self.hidden) {
            Some(l) => &l[..n],
            None => &self.host_hidden[..n],
        }
    }

    fn routes(&self) -> &Routes {
        &self.routes
    }

    fn kv(&self) -> Option<&KvBlocks> {
        Some(&self.kv)
    }

    fn kv_mut(&mut self) -> Option<&mut KvBlocks> {
        Some(&mut self.kv)
    }
}
