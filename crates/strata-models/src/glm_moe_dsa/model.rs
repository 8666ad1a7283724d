//! The whole model: embedding -> decoder layers (MLA + DSA attention; dense SwiGLU or
//! noaux_tc MoE) -> final norm -> LM head, and its batch-first session.

use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};
use crate::batch::{Batch, SeqId};
use crate::blocks::{ExpertSource, MlaCache, MlaConfig, MlaScratch, MlaWeights, MoeScratch, MoeWeights, SwiGlu};
use crate::experts::Routes;
use crate::kv::{KvBlocks, BLOCK_SIZE};
use crate::{Model, ModelInfo, Session, SessionOptions};
use anyhow::{bail, ensure, Result};
use strata_backend::{Backend, LinearOut, Step};

/// Next-layer prediction runs on forwards of at most this many rows.
const PILOT_MAX_ROWS: usize = 8;

pub(super) enum Mlp<B: Backend> {
    Dense(SwiGlu<B>),
    Moe(MoeWeights<B>),
}

pub(super) struct Layer<B: Backend> {
    pub input_norm: B::Buf,
    pub post_norm: B::Buf,
    pub attn: MlaWeights<B>,
    pub mlp: Mlp<B>,
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
    max_rows: usize,
    kv: KvBlocks,
    caches: Vec<MlaCache<B>>,
    draft: Option<Draft<B>>,
    step: Step,
    s: Scratch<B>,
    /// Rows per sequence in the current forward.
    pending: Vec<(SeqId, usize)>,
    /// Rows whose hidden states, and rows whose logits, are wanted.
    want: Wants,
    /// Logit rows the output buffers hold, and hidden-state rows.
    want_cap: usize,
    hidden_cap: usize,
    hidden: B::Buf,
    xsn: B::Buf,
    logits: B::Buf,
    host_logits: Vec<f32>,
    host_hidden: Vec<f32>,
    last_logits: usize,
    last_hidden: usize,
    routes: Routes,
}

#[derive(Default)]
struct Wants {
    hidden: Vec<u32>,
    logits: Vec<u32>,
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
            true => Some(MoeScratch::new(b, rows, h, cfg.n_routed_experts, cfg.num_experts_per_tok)?),
            false => None,
        };
        b.reserve_workspace(cfg.num_attention_heads.max(cfg.index_n_heads), cfg.index_topk.min(max_len), max_len);
        let want_cap = opts.max_seqs.min(rows).max(1);
        let mut step = Step { block_size: BLOCK_SIZE, ..Default::default() };
        step.tokens.reserve(rows);
        step.positions.reserve(rows);
        step.seq.reserve(rows);
        step.blocks.reserve(opts.max_seqs * kv.max_blocks());
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
            max_rows: rows,
            caches,
            draft,
            step,
            s,
            pending: Vec::with_capacity(opts.max_seqs),
            want: Wants { hidden: Vec::with_capacity(rows), logits: Vec::with_capacity(rows) },
            want_cap,
            hidden_cap: want_cap,
            hidden: b.alloc(want_cap * h)?,
            xsn: b.alloc(want_cap * h)?,
            logits: b.alloc(want_cap * cfg.vocab_size)?,
            host_logits: Vec::new(),
            host_hidden: Vec::new(),
            last_logits: 0,
            last_hidden: 0,
            routes: Routes::default(),
            kv,
        })
    }

    /// Fills the step's rows from `batch` against `kv` and reserves their blocks.
    fn plan_step(
        kv: &mut KvBlocks,
        step: &mut Step,
        pending: &mut Vec<(SeqId, usize)>,
        want: &mut Wants,
        batch: &Batch,
        max_rows: usize,
        vocab: usize,
    ) -> Result<()> {
        let rows = batch.len();
        ensure!(rows > 0, "forward needs at least one row");
        ensure!(rows <= max_rows, "a forward of {rows} rows exceeds the session's {max_rows} rows");
        step.clear();
        pending.clear();
        want.hidden.clear();
        want.logits.clear();
        for (r, row) in batch.rows.iter().enumerate() {
            ensure!(kv.contains(row.seq), "sequence {} is not in this session", row.seq.0);
            if row.token != u32::MAX && row.token as usize >= vocab {
                bail!("token id {} is outside the vocabulary ({vocab})", row.token);
            }
            let i = match pending.iter().position(|(s, _)| *s == row.seq) {
                Some(i) => i,
                None => {
                    pending.push((row.seq, 0));
                    pending.len() - 1
                }
            };
            let pos = kv.len(row.seq) + pending[i].1;
            pending[i].1 += 1;
            step.tokens.push(row.token);
            step.positions.push(pos as u32);
            step.seq.push(row.seq.0);
            if row.hidden || row.logits {
                want.hidden.push(r as u32);
            }
            if row.logits {
                want.logits.push(r as u32);
            }
        }
        for &(s, n) in pending.iter() {
            kv.reserve(s, n)?;
        }
        kv.write_tables(&mut step.blocks);
        step.max_blocks = kv.max_blocks();
        step.block_size = BLOCK_SIZE;
        Ok(())
    }

    /// Grows the output buffers for `hidden` hidden-state rows and `logits` logit rows
    /// (beyond the one row per sequence a session starts with).
    fn ensure_output_rows(&mut self, hidden: usize, logits: usize) -> Result<()> {
        let (b, h, v) = (&self.m.b, self.m.cfg.hidden_size, self.m.cfg.vocab_size);
        if hidden > self.hidden_cap {
            self.hidden = b.alloc(hidden * h)?;
            self.hidden_cap = hidden;
        }
        if logits > self.want_cap {
            self.xsn = b.alloc(logits * h)?;
            self.logits = b.alloc(logits * v)?;
            self.want_cap = logits;
        }
        Ok(())
    }

    /// Embeds the step's rows into `x` (token rows from `table`, embedding rows as given).
    fn embed_rows(&mut self, batch: &Batch, table: &B::Mat) -> Result<()> {
        let (b, h) = (&self.m.b, self.m.cfg.hidden_size);
        b.embed(&self.step, table, &mut self.s.x)?;
        for (r, row) in batch.rows.iter().enumerate() {
            if row.token == u32::MAX {
                ensure!(
                    batch.embedding_width == h,
                    "embedding rows of width {} for a model of width {h}",
                    batch.embedding_width
                );
                let e = row.embedding as usize;
                b.write(&mut self.s.x, r * h, &batch.embeddings[e * h..(e + 1) * h]);
            }
        }
        Ok(())
    }

    /// Hidden states of the wanted rows of `x`, and logits (through `norm` and `head`)
    /// of the rows that want them.
    fn outputs(&mut self, norm: &B::Buf, head: &B::Mat) -> Result<()> {
        let cfg = &self.m.cfg;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps as f32);
        let (nh, nl) = (self.want.hidden.len(), self.want.logits.len());
        self.last_hidden = nh;
        self.last_logits = nl;
        self.ensure_output_rows(nh, nl)?;
        let b = &self.m.b;
        if nh > 0 {
            b.gather_rows(&self.s.x, h, &self.want.hidden, &mut self.hidden);
        }
        if nl > 0 {
            b.gather_rows(&self.s.x, h, &self.want.logits, &mut self.s.y);
            b.rms_norm(nl, h, &self.s.y, Some(norm), eps, &mut self.xsn);
            b.linears(&self.xsn, nl, &mut [LinearOut::new(b, head, &mut self.logits)]);
        }
        if b.host(&self.logits).is_none() {
            self.host_logits.resize(nl * cfg.vocab_size, 0.0);
            b.read(&self.logits, 0, &mut self.host_logits);
            self.host_hidden.resize(nh * h, 0.0);
            b.read(&self.hidden, 0, &mut self.host_hidden);
        }
        Ok(())
    }
}

/// The MLP half of a layer: `x += mlp(norm(x))`.
fn mlp_forward<B: Backend>(
    m: &Glm<B>,
    layer: &Layer<B>,
    experts: &ExpertSource<B>,
    rows: usize,
    s: &mut Scratch<B>,
    routes: &mut Routes,
) -> Result<()> {
    let (b, h, eps) = (&m.b, m.cfg.hidden_size, m.cfg.rms_norm_eps as f32);
    b.rms_norm(rows, h, &s.x, Some(&layer.post_norm), eps, &mut s.xn);
    match &layer.mlp {
        Mlp::Dense(mlp) => mlp.forward_add(b, &s.xn, rows, h, &mut s.y, &mut s.x),
        Mlp::Moe(moe) => {
            let ms = s.moe.as_mut().expect("MoE scratch");
            moe.forward_add(b, experts, &s.xn, rows, h, ms, routes, &mut s.x)?;
        }
    }
    Ok(())
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
        self.max_rows
    }

    fn forward(&mut self, batch: &Batch) -> Result<()> {
        let m = self.m;
        let (b, cfg) = (&m.b, &m.cfg);
        Self::plan_step(
            &mut self.kv,
            &mut self.step,
            &mut self.pending,
            &mut self.want,
            batch,
            self.max_rows,
            cfg.vocab_size,
        )?;
        let (rows, h, eps) = (batch.len(), cfg.hidden_size, cfg.rms_norm_eps as f32);
        self.embed_rows(batch, &m.embed)?;
        b.rope_tables(&self.step, &m.rope_inv, &mut self.s.cos, &mut self.s.sin);
        self.routes.clear(rows, cfg.num_experts_per_tok);
        let predict = m.experts.provider().filter(|p| p.wants_prediction() && rows <= PILOT_MAX_ROWS);
        let s = &mut self.s;
        for (i, layer) in m.layers.iter().enumerate() {
            b.rms_norm(rows, h, &s.x, Some(&layer.input_norm), eps, &mut s.xn);
            layer.attn.forward_add(
                b,
                &self.step,
                &m.mla,
                &s.xn,
                &s.cos,
                &s.sin,
                &mut self.caches[i],
                &mut s.mla,
                &mut s.x,
            );
            // PILOT: the next MoE layer's router on this residual, one layer early (the
            // two-step predictor first adds this layer's shared expert).
            if let (Some(p), Some(next)) = (predict, m.layers.get(i + 1)) {
                if let (Mlp::Moe(moe), Some(ms)) = (&next.mlp, s.moe.as_mut()) {
                    let from = match (&layer.mlp, p.two_step_prediction()) {
                        (Mlp::Moe(cur), true) => {
                            b.rms_norm(rows, h, &s.x, Some(&layer.post_norm), eps, &mut s.xn);
                            cur.shared.forward_add_into(b, &s.xn, rows, h, &s.x, &mut s.y);
                            &s.y
                        }
                        _ => &s.x,
                    };
                    b.rms_norm(rows, h, from, Some(&next.post_norm), eps, &mut s.xn);
                    moe.predict(b, &s.xn, rows, ms, p.as_ref());
                }
            }
            mlp_forward(m, layer, &m.experts, rows, s, &mut self.routes)?;
        }
        for &(seq, n) in &self.pending {
            let len = self.kv.len(seq) + n;
            self.kv.set_len(seq, len);
        }
        self.outputs(&m.norm, m.lm_head.as_ref().unwrap_or(&m.embed))
    }

    fn logits(&self) -> &[f32] {
        let n = self.last_logits * self.m.cfg.vocab_size;
        match self.m.b.host(&self.logits) {
            Some(l) => &l[..n],
            None => &self.host_logits[..n],
        }
    }

    fn hidden(&self) -> &[f32] {
        let n = self.last_hidden * self.m.cfg.hidden_size;
        match self.m.b.host(&self.hidden) {
            Some(l) => &l[..n],
            None => &self.host_hidden[..n],
        }
    }

    fn routes(&self) -> &Routes {
        &self.routes
    }

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
        Self::plan_step(
            &mut draft.kv,
            &mut self.step,
            &mut self.pending,
            &mut self.want,
            batch,
            self.max_rows,
            cfg.vocab_size,
        )?;
        // z = W_e enorm(embed(t)) + W_h hnorm(h).
        let s = &mut self.s;
        b.write(&mut s.x, 0, hidden);
        b.rms_norm(rows, h, &s.x, Some(&mtp.hnorm), eps, &mut s.xn);
        b.embed(&self.step, mtp.embed.as_ref().unwrap_or(&m.embed), &mut s.x)?;
        b.rms_norm(rows, h, &s.x, Some(&mtp.enorm), eps, &mut s.y);
        b.linears(&s.y, rows, &mut [LinearOut::new(b, &mtp.eh_e, &mut s.x)]);
        b.linears(&s.xn, rows, &mut [LinearOut::add(b, &mtp.eh_h, &mut s.x)]);
        b.rope_tables(&self.step, &m.rope_inv, &mut s.cos, &mut s.sin);
        self.routes.clear(rows, cfg.num_experts_per_tok);
        let layer = &mtp.block;
        if layer.attn.indexer.is_none() {
            s.mla.reset_selection();
        }
        b.rms_norm(rows, h, &s.x, Some(&layer.input_norm), eps, &mut s.xn);
        layer.attn.forward_add(b, &self.step, &m.mla, &s.xn, &s.cos, &s.sin, &mut draft.cache, &mut s.mla, &mut s.x);
        mlp_forward(m, layer, &mtp.experts, rows, s, &mut self.routes)?;
        for &(seq, n) in &self.pending {
            let len = draft.kv.len(seq) + n;
            draft.kv.set_len(seq, len);
        }
        let head = mtp.head.as_ref().or(m.lm_head.as_ref()).unwrap_or(&m.embed);
        self.outputs(&mtp.head_norm, head)
    }

    fn draft_len(&self, seq: SeqId) -> usize {
        self.draft.as_ref().map_or(0, |d| d.kv.len(seq))
    }

    fn draft_truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(d) = self.draft.as_mut() {
            d.kv.truncate(seq, len);
        }
    }
}
