//! The whole model: embedding -> decoder layers (MLA + DSA attention; dense SwiGLU or
//! noaux_tc MoE) -> final norm -> LM head, and its batch-first session.

use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
use crate::batch::{Batch, SeqId};
use crate::blocks::{
    pilot_predict, ExpertSource, Ffn, FfnBufs, FfnLayer, MlaCache, MlaConfig, MlaScratch, MlaWeights, MoeScratch,
    PILOT_MAX_ROWS,
};
use crate::kv::KvBlocks;
use crate::session::{session_parts, Outputs, Rows};
use crate::{Model, ModelInfo, Session, SessionOptions};
use anyhow::{bail, ensure, Result};
use strata_backend::{Backend, LinearOut};
use strata_experts::Routes;

pub(super) struct Layer<B: Backend> {
    pub input_norm: B::Buf,
    pub post_norm: B::Buf,
    pub attn: MlaWeights<B>,
    pub mlp: Ffn<B>,
}

/// The MTP layer: `z = eh_proj([enorm(embed(t)); hnorm(h)])`, a full decoder layer with
/// its own experts and cache, then `shared_head.norm` and the LM head. It drafts the
/// token after next from the previous position's final hidden state.
pub(super) struct Mtp<B: Backend> {
    pub enorm: B::Buf,
    pub hnorm: B::Buf,
    /// `eh_proj` split by input: the embedding half and the hidden half.
    pub eh_e: B::Mat,
    pub eh_h: B::Mat,
    pub head_norm: B::Buf,
    /// Own copies of the embedding and head when the checkpoint has them.
    pub embed: Option<B::Mat>,
    pub head: Option<B::Mat>,
    pub block: Layer<B>,
    pub experts: ExpertSource<B>,
}

pub struct Glm<B: Backend> {
    pub(super) b: B,
    pub(super) cfg: GlmMoeDsaConfig,
    pub(super) info: ModelInfo,
    pub(super) mla: MlaConfig,
    pub(super) embed: B::Mat,
    pub(super) lm_head: Option<B::Mat>,
    pub(super) norm: B::Buf,
    pub(super) layers: Vec<Layer<B>>,
    pub(super) experts: ExpertSource<B>,
    pub(super) mtp: Option<Mtp<B>>,
    pub(super) rope_inv: Vec<f32>,
}

impl<B: Backend> Model for Glm<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> String {
        self.b.describe()
    }

    fn prefill_chunk(&self) -> usize {
        self.b.prefill_chunk()
    }

    fn new_session(&self, opts: SessionOptions) -> Result<Box<dyn Session + '_>> {
        Ok(Box::new(GlmSession::new(self, opts)?))
    }
}

/// Activations of one forward (shared by every layer, main and draft).
struct Scratch<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    y: B::Buf,
    cos: B::Buf,
    sin: B::Buf,
    mla: MlaScratch<B>,
    moe: Option<MoeScratch<B>>,
}

/// The draft layer's caches.
struct Draft<B: Backend> {
    kv: KvBlocks,
    cache: MlaCache<B>,
}

/// The model with KV caches for a set of sequences and the scratch of one forward.
pub struct GlmSession<'m, B: Backend> {
    m: &'m Glm<B>,
    kv: KvBlocks,
    caches: Vec<MlaCache<B>>,
    draft: Option<Draft<B>>,
    rows: Rows,
    s: Scratch<B>,
    out: Outputs<B>,
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
        let draft = match &m.mtp {
            Some(mtp) => Some(Draft {
                kv: KvBlocks::new(opts.kv_tokens.max(1), opts.max_seqs, max_len),
                cache: MlaCache::new(b, &m.mla, slots, mtp.block.attn.indexer.is_some())?,
            }),
            None => None,
        };
        let (rows, h) = (opts.max_rows, cfg.hidden_size);
        let moe = match cfg.mlp_layer_types.contains(&MlpKind::Sparse) || m.mtp.is_some() {
            true => Some(MoeScratch::new(b, rows, h, cfg.n_routed_experts, cfg.num_experts_per_tok, true)?),
            false => None,
        };
        b.reserve_workspace(cfg.num_attention_heads.max(cfg.index_n_heads), cfg.index_topk.min(max_len), max_len);
        let s = Scratch {
            x: b.alloc(rows * h)?,
            xn: b.alloc(rows * h)?,
            y: b.alloc(rows * h)?,
            cos: b.alloc(rows * cfg.qk_rope_head_dim / 2)?,
            sin: b.alloc(rows * cfg.qk_rope_head_dim / 2)?,
            mla: MlaScratch::new(b, &m.mla, rows, max_len)?,
            moe,
        };
        Ok(Self {
            m,
            caches,
            draft,
            rows: Rows::new(&opts, kv.max_blocks()),
            s,
            out: Outputs::new(b, opts.max_seqs.min(rows).max(1), h, cfg.vocab_size)?,
            routes: Routes::default(),
            kv,
        })
    }
}

/// The feed-forward half of a layer: `x += ffn(norm(x))`.
fn ffn_forward<B: Backend>(
    m: &Glm<B>,
    layer: &Layer<B>,
    experts: &ExpertSource<B>,
    rows: usize,
    s: &mut Scratch<B>,
    routes: &mut Routes,
) -> Result<()> {
    let (b, h, eps) = (&m.b, m.cfg.hidden_size, m.cfg.rms_norm_eps as f32);
    b.rms_norm(rows, h, &s.x, Some(&layer.post_norm), eps, &mut s.xn);
    let bufs = FfnBufs { y: &mut s.y, moe: s.moe.as_mut() };
    layer.mlp.forward_add(b, experts, &s.xn, rows, h, bufs, routes, &mut s.x)
}

impl<B: Backend> Session for GlmSession<'_, B> {
    fn add_sequence(&mut self) -> Result<SeqId> {
        let s = self.kv.add()?;
        if let Some(d) = self.draft.as_mut() {
            let ds = d.kv.add()?;
            debug_assert_eq!(s, ds, "draft sequences mirror the main ones");
        }
        Ok(s)
    }

    fn remove_sequence(&mut self, seq: SeqId) {
        self.kv.remove(seq);
        if let Some(d) = self.draft.as_mut() {
            d.kv.remove(seq);
        }
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
        self.rows.max_rows
    }

    fn forward(&mut self, batch: &Batch) -> Result<()> {
        let m = self.m;
        let (b, cfg) = (&m.b, &m.cfg);
        self.rows.plan(&mut self.kv, batch, cfg.vocab_size, self.out.picked())?;
        let (rows, h, eps) = (batch.len(), cfg.hidden_size, cfg.rms_norm_eps as f32);
        // The rotary tables (an upload) before the first kernel: a decode step's kernels
        // then run back to back (one CUDA graph).
        b.rope_tables(&self.rows.step, &m.rope_inv, &mut self.s.cos, &mut self.s.sin);
        self.rows.embed(b, batch, &self.out, &m.embed, h, &mut self.s.x)?;
        let step = &self.rows.step;
        self.routes.clear(rows, cfg.num_experts_per_tok);
        let predict = m.experts.provider().filter(|p| p.wants_prediction() && rows <= PILOT_MAX_ROWS);
        let s = &mut self.s;
        for (i, layer) in m.layers.iter().enumerate() {
            let norm = (&layer.input_norm, eps);
            let cache = &mut self.caches[i];
            layer.attn.forward_add(b, step, &m.mla, norm, &mut s.xn, &s.cos, &s.sin, cache, &mut s.mla, &mut s.x);
            if let (Some(p), Some(next), Some(ms)) = (predict, m.layers.get(i + 1), s.moe.as_mut()) {
                let cur = FfnLayer { ffn: &layer.mlp, norm: &layer.post_norm };
                let next = FfnLayer { ffn: &next.mlp, norm: &next.post_norm };
                pilot_predict(b, p.as_ref(), cur, next, rows, h, eps, &s.x, &mut s.xn, &mut s.y, ms);
            }
            ffn_forward(m, layer, &m.experts, rows, s, &mut self.routes)?;
        }
        self.rows.commit(&mut self.kv);
        self.out.compute(b, &self.rows, &self.s.x, &m.norm, eps, m.lm_head.as_ref().unwrap_or(&m.embed))
    }

    session_parts!();

    fn has_draft(&self) -> bool {
        self.draft.is_some()
    }

    fn draft_forward(&mut self, batch: &Batch, hidden: &[f32]) -> Result<()> {
        let m = self.m;
        let (Some(mtp), Some(draft)) = (m.mtp.as_ref(), self.draft.as_mut()) else {
            bail!("this model has no draft (MTP) layer loaded")
        };
        let (b, cfg) = (&m.b, &m.cfg);
        let (rows, h, eps) = (batch.len(), cfg.hidden_size, cfg.rms_norm_eps as f32);
        ensure!(hidden.len() == rows * h, "draft forward: {} hidden values for {rows} rows of {h}", hidden.len());
        self.rows.plan(&mut draft.kv, batch, cfg.vocab_size, 0)?;
        // z = W_e enorm(embed(t)) + W_h hnorm(h).
        let s = &mut self.s;
        let step = &self.rows.step;
        b.write(&mut s.x, 0, hidden);
        b.rms_norm(rows, h, &s.x, Some(&mtp.hnorm), eps, &mut s.xn);
        b.embed(step, None, mtp.embed.as_ref().unwrap_or(&m.embed), &mut s.x)?;
        b.rms_norm(rows, h, &s.x, Some(&mtp.enorm), eps, &mut s.y);
        b.linears(&s.y, rows, &mut [LinearOut::new(b, &mtp.eh_e, &mut s.x)]);
        b.linears(&s.xn, rows, &mut [LinearOut::add(b, &mtp.eh_h, &mut s.x)]);
        b.rope_tables(step, &m.rope_inv, &mut s.cos, &mut s.sin);
        self.routes.clear(rows, cfg.num_experts_per_tok);
        let layer = &mtp.block;
        if layer.attn.indexer.is_none() {
            s.mla.reset_selection();
        }
        let norm = (&layer.input_norm, eps);
        layer.attn.forward_add(
            b,
            step,
            &m.mla,
            norm,
            &mut s.xn,
            &s.cos,
            &s.sin,
            &mut draft.cache,
            &mut s.mla,
            &mut s.x,
        );
        ffn_forward(m, layer, &mtp.experts, rows, s, &mut self.routes)?;
        self.rows.commit(&mut draft.kv);
        let head = mtp.head.as_ref().or(m.lm_head.as_ref()).unwrap_or(&m.embed);
        self.out.compute(b, &self.rows, &s.x, &mtp.head_norm, eps, head)
    }

    fn draft_len(&self, seq: SeqId) -> usize {
        self.draft.as_ref().map_or(0, |d| d.kv.len(seq))
    }

    fn draft_truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(d) = self.draft.as_mut() {
            d.kv.truncate(seq, len);
        }
    }

    fn draft_kv(&self) -> Option<&KvBlocks> {
        self.draft.as_ref().map(|d| &d.kv)
    }
}
