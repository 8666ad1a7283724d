//! The Gemma 4 text model and its session:
//!
//! embed * sqrt(hidden) (PLE inputs beside it) -> per layer: attention (sandwiched by
//! norms, added), feed-forward (dense, or dense + experts; sandwiched, added), the
//! per-layer input gate (PLE), times the layer scalar -> final norm -> tied head ->
//! soft cap.
//!
//! Caches: full layers in the session's KV blocks, sliding layers in per-sequence rings
//! ([`super::ring`]), KV-shared layers none (they read their producer's).

use super::attention::{Attention, AttnScratch, Cache};
use super::config::{Gemma4Config, LayerKind};
use super::ffn::{Ffn, FfnScratch};
use super::ple::{LayerPle, Ple, PleScratch};
use super::ring::Ring;
use crate::batch::{Batch, SeqId};
use crate::blocks::{ExpertSource, PILOT_MAX_ROWS};
use crate::kv::KvBlocks;
use crate::media::{ImagePatches, Vision, VisionSpec};
use crate::session::{session_parts, Outputs, Rows};
use crate::{Model, ModelInfo, Session, SessionOptions};
use anyhow::{ensure, Result};
use strata_backend::{Backend, Step};
use strata_experts::Routes;

pub(super) struct Layer<B: Backend> {
    pub kind: LayerKind,
    pub input_norm: B::Buf,
    pub attn: Attention<B>,
    /// The layer whose cache this one reads (KV sharing).
    pub kv_from: Option<usize>,
    pub ffn: Ffn<B>,
    pub ple: Option<LayerPle<B>>,
    pub scalar: f32,
}

pub struct Gemma4<B: Backend> {
    pub(super) b: B,
    pub(super) cfg: Gemma4Config,
    pub(super) info: ModelInfo,
    pub(super) embed: B::Mat,
    pub(super) lm_head: Option<B::Mat>,
    pub(super) norm: B::Buf,
    pub(super) ple: Option<Ple<B>>,
    pub(super) layers: Vec<Layer<B>>,
    pub(super) experts: ExpertSource<B>,
    /// Inverse frequencies of the sliding and full layers' RoPE.
    pub(super) rope_sliding: Vec<f32>,
    pub(super) rope_full: Vec<f32>,
    pub(super) vision: Option<super::vision::VisionTower<B>>,
}

impl<B: Backend> Model for Gemma4<B> {
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
        Ok(Box::new(Gemma4Session::new(self, opts)?))
    }

    fn vision(&self) -> Option<&dyn Vision> {
        self.vision.as_ref().map(|_| self as &dyn Vision)
    }
}

impl<B: Backend> Vision for Gemma4<B> {
    fn spec(&self) -> VisionSpec {
        let v = self.cfg.vision.as_ref().expect("a model with a vision tower has its config");
        VisionSpec {
            patch_size: v.patch_size,
            pooling: v.pooling,
            image_token_id: self.cfg.image_token_id,
            boi_token_id: self.cfg.boi_token_id,
            eoi_token_id: self.cfg.eoi_token_id,
            bidirectional: self.cfg.text.bidirectional_vision,
        }
    }

    fn encode(&self, image: &ImagePatches) -> Result<Vec<f32>> {
        let tower = self.vision.as_ref().expect("vision() answers only with a tower");
        tower.encode(&self.b, image)
    }
}

impl<B: Backend> Gemma4<B> {
    /// The widest `heads * head_dim` and `kv_heads * head_dim` over the layer kinds.
    fn widths(&self) -> (usize, usize) {
        let t = &self.cfg.text;
        let q = t.layers.iter().map(|l| t.num_attention_heads * l.head_dim).max().unwrap_or(0);
        let kv = t.layers.iter().map(|l| l.kv_heads * l.head_dim).max().unwrap_or(0);
        (q, kv)
    }
}

/// Activations of one forward, shared by every layer.
struct Scratch<B: Backend> {
    x: B::Buf,
    xn: B::Buf,
    /// Rotary tables of the sliding and full layers.
    rope: [(B::Buf, B::Buf); 2],
    attn: AttnScratch<B>,
    ffn: FfnScratch<B>,
    ple: Option<PleScratch<B>>,
    /// The step the per-layer table is read with (media rows take the pad id).
    ple_step: Step,
}

/// The model with K/V caches for a set of sequences.
pub struct Gemma4Session<'m, B: Backend> {
    m: &'m Gemma4<B>,
    kv: KvBlocks,
    ring: Ring,
    /// Per layer: its own cache (`[slots, 2 * kv_heads * head_dim]`), or None (shared).
    caches: Vec<Option<B::Buf>>,
    rows: Rows,
    s: Scratch<B>,
    out: Outputs<B>,
    routes: Routes,
}

impl<'m, B: Backend> Gemma4Session<'m, B> {
    fn new(m: &'m Gemma4<B>, opts: SessionOptions) -> Result<Self> {
        let (b, t) = (&m.b, &m.cfg.text);
        ensure!(opts.max_rows > 0 && opts.max_seqs > 0, "a session needs room for at least one row and one sequence");
        let max_len = opts.max_len.min(t.max_position_embeddings).max(1);
        let kv = KvBlocks::new(opts.kv_tokens.max(1), opts.max_seqs, max_len);
        let ring = Ring::new(t.sliding_window, opts.max_rows, kv.max_len(), opts.max_seqs, kv.max_blocks());
        let caches = t
            .layers
            .iter()
            .map(|l| {
                let width = 2 * l.kv_heads * l.head_dim;
                match (l.kv_from, l.kind) {
                    (Some(_), _) => Ok(None),
                    (None, LayerKind::Full) => b.alloc(kv.slots() * width).map(Some),
                    (None, LayerKind::Sliding) => b.alloc(ring.slots() * width).map(Some),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let (rows, h) = (opts.max_rows, t.hidden_size);
        let (qw, kvw) = m.widths();
        // Attention scores: one row per head of a KV group over the visible context (and
        // room for a row of hidden or router values per thread).
        let group = t.layers.iter().map(|l| t.num_attention_heads / l.kv_heads).max().unwrap_or(1);
        let experts = t.moe.map_or(0, |m| m.experts);
        b.reserve_workspace(group, max_len.max(h.div_ceil(group)).max(experts), max_len.max(experts));
        let ple = match &m.ple {
            Some(p) => Some(PleScratch::new(b, rows, h, p.layers, p.dim)?),
            None => None,
        };
        let mut ple_step = Step::default();
        ple_step.tokens.reserve(rows);
        ple_step.positions.reserve(rows);
        ple_step.seq.reserve(rows);
        let s = Scratch {
            x: b.alloc(rows * h)?,
            xn: b.alloc(rows * h)?,
            rope: [
                (b.alloc(rows * m.rope_sliding.len())?, b.alloc(rows * m.rope_sliding.len())?),
                (b.alloc(rows * m.rope_full.len())?, b.alloc(rows * m.rope_full.len())?),
            ],
            attn: AttnScratch::new(b, rows, h, qw, kvw)?,
            ffn: FfnScratch::new(b, rows, h, t.moe.map(|m| (m.experts, m.top_k)))?,
            ple,
            ple_step,
        };
        let out =
            Outputs::new(b, opts.max_seqs.min(rows).max(1), h, t.vocab_size)?.with_softcap(t.final_logit_softcapping);
        Ok(Self { m, caches, rows: Rows::new(&opts, kv.max_blocks()), s, out, routes: Routes::default(), kv, ring })
    }

    /// Embeds the step's rows into `x`: token rows from the table times sqrt(hidden),
    /// embedding rows (media features) as given.
    fn embed(&mut self, batch: &Batch) -> Result<()> {
        let (m, s) = (self.m, &mut self.s);
        let (b, h) = (&m.b, m.cfg.text.hidden_size);
        let step = &self.rows.step;
        let rows = step.rows();
        b.embed(step, Some(self.out.picks()), &m.embed, &mut s.x)?;
        b.scale(rows * h, (h as f32).sqrt(), &mut s.x);
        self.rows.embed_rows(b, batch, h, &mut s.x)?;
        Ok(())
    }
}

impl<B: Backend> Session for Gemma4Session<'_, B> {
    fn add_sequence(&mut self) -> Result<SeqId> {
        let seq = self.kv.add()?;
        self.ring.reset(seq.0 as usize);
        Ok(seq)
    }

    fn remove_sequence(&mut self, seq: SeqId) {
        self.kv.remove(seq)
    }

    fn len(&self, seq: SeqId) -> usize {
        self.kv.len(seq)
    }

    /// Rolls back to `len` positions, or to none when the sliding layers' rings no longer
    /// hold the window position `len` needs ([`Session::len`] tells which).
    fn truncate(&mut self, seq: SeqId, len: usize) {
        let keep = if len >= self.kv.len(seq) || self.ring.can_keep(seq.0 as usize, len) { len } else { 0 };
        self.kv.truncate(seq, keep);
        if keep == 0 {
            self.ring.reset(seq.0 as usize);
        }
    }

    fn max_len(&self) -> usize {
        self.kv.max_len()
    }

    fn max_rows(&self) -> usize {
        self.rows.max_rows
    }

    fn forward(&mut self, batch: &Batch) -> Result<()> {
        let m = self.m;
        let (b, t) = (&m.b, &m.cfg.text);
        self.rows.plan(&mut self.kv, batch, t.vocab_size, self.out.picked())?;
        let (rows, h, eps) = (batch.len(), t.hidden_size, t.rms_norm_eps as f32);
        self.ring.refresh(&self.rows.step, t.bidirectional_vision);
        // The rotary tables (uploads) before the first kernel: a decode step's kernels
        // then run back to back (one CUDA graph).
        let [(cs, ss), (cf, sf)] = &mut self.s.rope;
        b.rope_tables(&self.rows.step, &m.rope_sliding, cs, ss);
        b.rope_tables(&self.rows.step, &m.rope_full, cf, sf);
        self.embed(batch)?;
        let s = &mut self.s;
        let step = &self.rows.step;
        if let (Some(ple), Some(ps)) = (&m.ple, s.ple.as_mut()) {
            let ps_step = &mut s.ple_step;
            ps_step.tokens.clear();
            ps_step.tokens.extend(step.tokens.iter().map(|&tok| if tok == u32::MAX { t.pad_token_id } else { tok }));
            ps_step.positions.clear();
            ps_step.positions.extend_from_slice(&step.positions);
            // (Backends may check a step whole, not just the ids the table is read with.)
            ps_step.seq.clear();
            ps_step.seq.extend_from_slice(&step.seq);
            ple.inputs(b, &s.ple_step, self.out.picks(), &s.x, eps, ps)?;
        }
        let moe_rows = t.moe.map_or(1, |m| m.top_k);
        self.routes.clear(rows, moe_rows);
        let predict = m.experts.provider().filter(|p| p.wants_prediction() && rows <= PILOT_MAX_ROWS);
        for (i, layer) in m.layers.iter().enumerate() {
            let (lstep, rope) = match layer.kind {
                LayerKind::Sliding => (&self.ring.step, (&s.rope[0].0, &s.rope[0].1)),
                LayerKind::Full => (step, (&s.rope[1].0, &s.rope[1].1)),
            };
            b.rms_norm(rows, h, &s.x, Some(&layer.input_norm), eps, &mut s.xn);
            let cache = match layer.kv_from {
                None => Cache::Own(self.caches[i].as_mut().expect("a layer with its own K/V has a cache")),
                Some(j) => Cache::Shared(self.caches[j].as_ref().expect("a KV producer has a cache")),
            };
            layer.attn.forward_add(b, lstep, h, eps, &s.xn, rope, cache, &mut s.attn, &mut s.x);
            if let (Some(p), Some(next)) = (predict, m.layers.get(i + 1)) {
                next.ffn.predict(b, p.as_ref(), &s.x, rows, h, eps, &mut s.ffn);
            }
            layer.ffn.forward_add(b, &m.experts, rows, h, eps, &mut s.ffn, &mut self.routes, &mut s.x)?;
            if let (Some(ple), Some(lp), Some(ps)) = (&m.ple, &layer.ple, s.ple.as_mut()) {
                ple.layer_add(b, lp, i, rows, h, eps, ps, &mut s.x);
            }
            if layer.scalar != 1.0 {
                b.scale(rows * h, layer.scalar, &mut s.x);
            }
        }
        self.rows.commit(&mut self.kv);
        for &(seq, _) in &self.rows.pending {
            self.ring.commit(seq.0 as usize, self.kv.len(seq));
        }
        self.out.compute(b, &self.rows, &self.s.x, &m.norm, eps, m.lm_head.as_ref().unwrap_or(&m.embed))
    }

    session_parts!();

    /// The pool holds the full layers' blocks only: the sliding layers' rings are per
    /// sequence, so no prefix is shared.
    fn shares_prefixes(&self) -> bool {
        false
    }
}
