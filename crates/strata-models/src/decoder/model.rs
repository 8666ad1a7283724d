//! The whole model: embedding -> decoder layers (grouped-query attention; dense SwiGLU or
//! routed MoE) -> final norm -> LM head, and its session.

use super::DecoderSpec;
use crate::batch::{Batch, SeqId};
use crate::blocks::{
    pilot_predict, ExpertSource, Ffn, FfnBufs, FfnLayer, GqaScratch, GqaWeights, MoeScratch, PILOT_MAX_ROWS,
};
use crate::kv::KvBlocks;
use crate::session::{session_parts, Outputs, Rows};
use crate::{Model, ModelInfo, Session, SessionOptions};
use anyhow::{ensure, Result};
use strata_backend::{Backend, GqaDims};
use strata_experts::Routes;

pub(super) struct Layer<B: Backend> {
    pub input_norm: B::Buf,
    pub post_norm: B::Buf,
    pub attn: GqaWeights<B>,
    pub ffn: Ffn<B>,
}

pub struct Decoder<B: Backend> {
    pub(super) b: B,
    pub(super) cfg: DecoderSpec,
    pub(super) info: ModelInfo,
    /// Per layer (windows differ by layer).
    pub(super) dims: Vec<GqaDims>,
    pub(super) embed: B::Mat,
    pub(super) lm_head: Option<B::Mat>,
    pub(super) norm: B::Buf,
    pub(super) layers: Vec<Layer<B>>,
    pub(super) experts: ExpertSource<B>,
    pub(super) rope_inv: Vec<f32>,
}

impl<B: Backend> Model for Decoder<B> {
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
        Ok(Box::new(DecoderSession::new(self, opts)?))
    }
}

/// Activations of one forward, shared by every layer.
struct Scratch<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    y: B::Buf,
    cos: B::Buf,
    sin: B::Buf,
    gqa: GqaScratch<B>,
    moe: Option<MoeScratch<B>>,
}

/// The model with K/V caches for a set of sequences.
pub struct DecoderSession<'m, B: Backend> {
    m: &'m Decoder<B>,
    kv: KvBlocks,
    /// Per layer: `[slots, 2 * kv_heads * head_dim]` (keys, then values).
    caches: Vec<B::Buf>,
    rows: Rows,
    s: Scratch<B>,
    out: Outputs<B>,
    routes: Routes,
}

impl<'m, B: Backend> DecoderSession<'m, B> {
    fn new(m: &'m Decoder<B>, opts: SessionOptions) -> Result<Self> {
        let (b, cfg) = (&m.b, &m.cfg);
        ensure!(opts.max_rows > 0 && opts.max_seqs > 0, "a session needs room for at least one row and one sequence");
        let max_len = opts.max_len.min(cfg.max_position_embeddings).max(1);
        let kv = KvBlocks::new(opts.kv_tokens.max(1), opts.max_seqs, max_len);
        let caches =
            (0..cfg.num_layers).map(|_| b.alloc(kv.slots() * m.dims[0].cache_width())).collect::<Result<Vec<_>>>()?;
        let (rows, h) = (opts.max_rows, cfg.hidden_size);
        let moe = match cfg.sparse_layers() > 0 {
            true => Some(MoeScratch::new(b, rows, h, cfg.experts, cfg.top_k, cfg.has_shared_expert())?),
            false => None,
        };
        // Attention scores: one row per head of a KV group over the visible context.
        b.reserve_workspace(cfg.heads / cfg.kv_heads, max_len, max_len);
        let s = Scratch {
            x: b.alloc(rows * h)?,
            xn: b.alloc(rows * h)?,
            y: b.alloc(rows * h)?,
            cos: b.alloc(rows * m.dims[0].rotary / 2)?,
            sin: b.alloc(rows * m.dims[0].rotary / 2)?,
            gqa: GqaScratch::new(b, &m.dims[0], rows, cfg.qk_norm == super::QkNorm::Full, false)?,
            moe,
        };
        Ok(Self {
            m,
            caches,
            rows: Rows::new(&opts, kv.max_blocks()),
            s,
            out: Outputs::new(b, opts.max_seqs.min(rows).max(1), h, cfg.vocab_size)?,
            routes: Routes::default(),
            kv,
        })
    }
}

impl<B: Backend> Session for DecoderSession<'_, B> {
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
        let s = &mut self.s;
        self.routes.clear(rows, cfg.top_k);
        let predict = m.experts.provider().filter(|p| p.wants_prediction() && rows <= PILOT_MAX_ROWS);
        for (i, layer) in m.layers.iter().enumerate() {
            b.rms_norm(rows, h, &s.x, Some(&layer.input_norm), eps, &mut s.xn);
            let cache = &mut self.caches[i];
            layer.attn.forward_add(b, step, m.dims[i], eps, &s.xn, &s.cos, &s.sin, cache, &mut s.gqa, &mut s.x);
            if let (Some(p), Some(next), Some(ms)) = (predict, m.layers.get(i + 1), s.moe.as_mut()) {
                let cur = FfnLayer { ffn: &layer.ffn, norm: &layer.post_norm };
                let next = FfnLayer { ffn: &next.ffn, norm: &next.post_norm };
                pilot_predict(b, p.as_ref(), cur, next, rows, h, eps, &s.x, &mut s.xn, &mut s.y, ms);
            }
            b.rms_norm(rows, h, &s.x, Some(&layer.post_norm), eps, &mut s.xn);
            let bufs = FfnBufs { y: &mut s.y, moe: s.moe.as_mut() };
            layer.ffn.forward_add(b, &m.experts, &s.xn, rows, h, bufs, &mut self.routes, &mut s.x)?;
        }
        self.rows.commit(&mut self.kv);
        self.out.compute(b, &self.rows, &self.s.x, &m.norm, eps, m.lm_head.as_ref().unwrap_or(&m.embed))
    }

    session_parts!();
}
