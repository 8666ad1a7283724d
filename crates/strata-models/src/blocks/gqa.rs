//! Grouped-query attention (Llama / GLM-4 / Gemma shape): q/k/v projections (optionally
//! biased), optional per-head q/k RMSNorm, half-split RoPE on the leading rotary dims,
//! K/V cached per position, softmax attention, output projection added to the residual.

use anyhow::Result;
use strata_backend::{Backend, GqaAttend, GqaDims, GqaPrepare, LinearOut, Step};

pub struct GqaWeights<B: Backend> {
    pub q: B::Mat,
    pub k: B::Mat,
    pub v: B::Mat,
    pub q_bias: Option<B::Buf>,
    pub k_bias: Option<B::Buf>,
    pub v_bias: Option<B::Buf>,
    pub q_norm: Option<B::Buf>,
    pub k_norm: Option<B::Buf>,
    pub o: B::Mat,
}

/// Activations of GQA layers for forwards of up to `rows` rows.
pub struct GqaScratch<B: Backend> {
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
}

impl<B: Backend> GqaScratch<B> {
    pub fn new(b: &B, d: &GqaDims, rows: usize) -> Result<Self> {
        let (q, kv) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        Ok(Self { q: b.alloc(rows * q)?, k: b.alloc(rows * kv)?, v: b.alloc(rows * kv)?, attn: b.alloc(rows * q)? })
    }

    pub fn bytes(d: &GqaDims, rows: usize) -> u64 {
        4 * (rows * (2 * d.heads * d.head_dim + 2 * d.kv_heads * d.head_dim)) as u64
    }
}

impl<B: Backend> GqaWeights<B> {
    /// `x += attention(xn)` for the step's rows; `cache` is this layer's K/V cache.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        step: &Step,
        d: GqaDims,
        eps: f32,
        xn: &B::Buf,
        cos: &B::Buf,
        sin: &B::Buf,
        cache: &mut B::Buf,
        s: &mut GqaScratch<B>,
        x: &mut B::Buf,
    ) {
        let rows = step.rows();
        b.linears(
            xn,
            rows,
            &mut [
                LinearOut::biased(b, &self.q, self.q_bias.as_ref(), &mut s.q),
                LinearOut::biased(b, &self.k, self.k_bias.as_ref(), &mut s.k),
                LinearOut::biased(b, &self.v, self.v_bias.as_ref(), &mut s.v),
            ],
        );
        b.gqa_prepare(
            step,
            GqaPrepare {
                dims: d,
                q: &mut s.q,
                k: &s.k,
                v: &s.v,
                q_norm: self.q_norm.as_ref(),
                k_norm: self.k_norm.as_ref(),
                eps,
                cos,
                sin,
                cache,
            },
        );
        b.gqa_attend(step, GqaAttend { dims: d, q: &s.q, cache, out: &mut s.attn });
        b.linears(&s.attn, rows, &mut [LinearOut::add(b, &self.o, x)]);
    }
}
