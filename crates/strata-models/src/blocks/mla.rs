//! Multi-head latent attention (DeepSeek-V3 / GLM-5) with DeepSeek Sparse Attention.
//!
//! `q = q_b(norm(q_a(x)))` per head (`nope | rope`), `kv = kv_a(x)` = latent (normalised,
//! cached) and one shared rotated key (cached). `kv_b` is absorbed into the query and the
//! output, so attention runs over the cached latent. On "full" layers the lightning
//! indexer scores every visible position and keeps the top `index_topk`; "shared" layers
//! reuse that selection. When no row sees more than `index_topk` positions, attention is
//! dense (the indexer only caches its keys).

use anyhow::Result;
use strata_backend::{
    Backend, DsaSelect, IndexDims, LinearOut, MlaAbsorb, MlaAttend, MlaDims, MlaPrepare, Selection, Step,
};

pub struct IndexerWeights<B: Backend> {
    pub wq_b: B::Mat,
    pub wk: B::Mat,
    pub k_norm_w: B::Buf,
    pub k_norm_b: B::Buf,
    pub weights_proj: B::Mat,
}

pub struct MlaWeights<B: Backend> {
    pub q_a: B::Mat,
    pub q_a_norm: B::Buf,
    pub q_b: B::Mat,
    pub kv_a: B::Mat,
    pub kv_a_norm: B::Buf,
    /// `[heads * (nope + v), kv_lora]`; FP8 with per-row scales.
    pub kv_b: B::Mat,
    pub o: B::Mat,
    /// Present on layers that run their own indexer.
    pub indexer: Option<IndexerWeights<B>>,
}

/// Dimensions and constants of a model's MLA layers.
#[derive(Clone, Copy, Debug)]
pub struct MlaConfig {
    pub dims: MlaDims,
    pub index: IndexDims,
    pub q_lora: usize,
    /// `q_a_layernorm`, `kv_a_layernorm`: transformers builds them with eps 1e-6.
    pub lora_eps: f32,
    /// The indexer's key LayerNorm eps.
    pub index_eps: f32,
}

/// A layer's caches: latent + shared key per position, and the indexer's keys.
pub struct MlaCache<B: Backend> {
    pub kv: B::Buf,
    pub index: Option<B::Buf>,
}

impl<B: Backend> MlaCache<B> {
    pub fn new(b: &B, cfg: &MlaConfig, slots: usize, indexer: bool) -> Result<Self> {
        Ok(Self {
            kv: b.alloc(slots * cfg.dims.key_width())?,
            index: if indexer { Some(b.alloc(slots * cfg.index.dim)?) } else { None },
        })
    }
}

/// Activations of MLA layers for forwards of up to `rows` rows (shared by all layers).
pub struct MlaScratch<B: Backend> {
    qa: B::Buf,
    kva: B::Buf,
    ik: B::Buf,
    iw: B::Buf,
    q: B::Buf,
    iq: B::Buf,
    q_full: B::Buf,
    latent: B::Buf,
    attn: B::Buf,
    selected: B::Idx,
    counts: B::Idx,
    scores: B::Buf,
    /// The current step's selection (set by the last full layer).
    selection: Selection,
}

impl<B: Backend> MlaScratch<B> {
    /// `max_len`: the longest context a row may see (sizes the indexer's scores).
    pub fn new(b: &B, cfg: &MlaConfig, rows: usize, max_len: usize) -> Result<Self> {
        let (d, ix) = (cfg.dims, cfg.index);
        let scores = if ix.topk < max_len { rows * max_len } else { 0 };
        Ok(Self {
            qa: b.alloc(rows * cfg.q_lora)?,
            kva: b.alloc(rows * d.key_width())?,
            ik: b.alloc(rows * ix.dim)?,
            iw: b.alloc(rows * ix.heads)?,
            q: b.alloc(rows * d.heads * (d.nope + d.rope))?,
            iq: b.alloc(rows * ix.heads * ix.dim)?,
            q_full: b.alloc(rows * d.heads * d.key_width())?,
            latent: b.alloc(rows * d.heads * d.kv_lora)?,
            attn: b.alloc(rows * d.heads * d.v)?,
            selected: b.alloc_idx(rows * ix.topk)?,
            counts: b.alloc_idx(rows)?,
            scores: b.alloc(scores)?,
            selection: Selection::Dense,
        })
    }

    /// Forgets the last full layer's selection (a forward whose first layer has no
    /// indexer of its own attends densely).
    pub fn reset_selection(&mut self) {
        self.selection = Selection::Dense;
    }

    /// Bytes these buffers take, for the memory plan.
    pub fn bytes(cfg: &MlaConfig, rows: usize, max_len: usize) -> u64 {
        let (d, ix) = (cfg.dims, cfg.index);
        let scores = if ix.topk < max_len { rows * max_len } else { 0 };
        4 * (rows
            * (cfg.q_lora
                + d.key_width()
                + ix.dim
                + ix.heads
                + d.heads * (d.nope + d.rope)
                + ix.heads * ix.dim
                + d.heads * (d.key_width() + d.kv_lora + d.v)
                + ix.topk
                + 1)
            + scores) as u64
    }
}

impl<B: Backend> MlaWeights<B> {
    /// `x += attention(rms_norm(x) * norm.0)` for the step's rows (`norm.1`: eps; `xn`:
    /// scratch for the normed rows); `cos`/`sin` are the step's rotary tables.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        step: &Step,
        cfg: &MlaConfig,
        norm: (&B::Buf, f32),
        xn: &mut B::Buf,
        cos: &B::Buf,
        sin: &B::Buf,
        cache: &mut MlaCache<B>,
        s: &mut MlaScratch<B>,
        x: &mut B::Buf,
    ) {
        let rows = step.rows();
        let d = cfg.dims;
        let hidden = b.mat_shape(&self.q_a).1;
        // Every projection of the normed input in one region, the norm fused into them.
        let (nw, eps) = norm;
        match &self.indexer {
            Some(ix) => b.norm_linears(
                rows,
                hidden,
                x,
                nw,
                eps,
                xn,
                &mut [
                    LinearOut::new(b, &self.q_a, &mut s.qa),
                    LinearOut::new(b, &self.kv_a, &mut s.kva),
                    LinearOut::new(b, &ix.wk, &mut s.ik),
                    LinearOut::new(b, &ix.weights_proj, &mut s.iw),
                ],
            ),
            None => b.norm_linears(
                rows,
                hidden,
                x,
                nw,
                eps,
                xn,
                &mut [LinearOut::new(b, &self.q_a, &mut s.qa), LinearOut::new(b, &self.kv_a, &mut s.kva)],
            ),
        }
        b.mla_prepare(
            step,
            MlaPrepare {
                dims: d,
                q_a: &mut s.qa,
                q_lora: cfg.q_lora,
                q_norm: &self.q_a_norm,
                kv_a: &s.kva,
                kv_norm: &self.kv_a_norm,
                eps: cfg.lora_eps,
                cos,
                sin,
                cache: &mut cache.kv,
            },
        );
        match &self.indexer {
            Some(ix) => b.linears(
                &s.qa,
                rows,
                &mut [LinearOut::new(b, &self.q_b, &mut s.q), LinearOut::new(b, &ix.wq_b, &mut s.iq)],
            ),
            None => b.linears(&s.qa, rows, &mut [LinearOut::new(b, &self.q_b, &mut s.q)]),
        }
        if let Some(ix) = &self.indexer {
            let select = step.max_visible() > cfg.index.topk;
            b.dsa_select(
                step,
                DsaSelect {
                    dims: cfg.index,
                    q: &mut s.iq,
                    w: &s.iw,
                    k: &mut s.ik,
                    k_norm_w: &ix.k_norm_w,
                    k_norm_b: &ix.k_norm_b,
                    eps: cfg.index_eps,
                    cos,
                    sin,
                    cache: cache.index.as_mut().expect("an indexer layer has an index cache"),
                    select,
                    selected: &mut s.selected,
                    counts: &mut s.counts,
                    work: &mut s.scores,
                },
            );
            s.selection = if select { Selection::Sparse } else { Selection::Dense };
        }
        b.mla_absorb(step, MlaAbsorb { dims: d, q: &s.q, kv_b: &self.kv_b, cos, sin, q_full: &mut s.q_full });
        b.mla_attend(
            step,
            MlaAttend {
                dims: d,
                q_full: &s.q_full,
                cache: &cache.kv,
                selection: s.selection,
                selected: &s.selected,
                counts: &s.counts,
                topk: cfg.index.topk,
                kv_b: &self.kv_b,
                latent_out: &mut s.latent,
                out: &mut s.attn,
            },
        );
        b.linears(&s.attn, rows, &mut [LinearOut::add(b, &self.o, x)]);
    }
}
