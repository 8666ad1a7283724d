//! Grouped-query attention (Llama / GLM-4 / Gemma / gpt-oss shape): q/k/v/o projections
//! (optionally biased), optional q/k RMSNorm (per head, or over the whole projection as MiniMax-M2
//! does), half-split RoPE on the leading rotary dims, K/V cached per position, softmax
//! attention (optionally with per-head sinks), output projection added to the residual.

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
    /// Whether `q_norm` / `k_norm` span the whole projection (`heads * head_dim`, and
    /// `kv_heads * head_dim`) instead of one head.
    pub full_norm: bool,
    pub o: B::Mat,
    pub o_bias: Option<B::Buf>,
    /// One sink logit a head (gpt-oss).
    pub sinks: Option<B::Buf>,
    /// An output gate `[heads * head_dim, hidden]` (Qwen3-Next): the attention's output is
    /// multiplied by `sigmoid(xn G^T)` before the output projection.
    pub out_gate: Option<B::Mat>,
}

/// Activations of GQA layers for forwards of up to `rows` rows.
pub struct GqaScratch<B: Backend> {
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
    /// q and k after a whole-projection norm (`full_norm` weights only).
    normed: Option<(B::Buf, B::Buf)>,
    /// The output gate's logits (gated attention only).
    gate: Option<B::Buf>,
}

impl<B: Backend> GqaScratch<B> {
    /// `full_norm`: room for q and k normed over the whole projection; `gated`: for the
    /// output gate's logits.
    pub fn new(b: &B, d: &GqaDims, rows: usize, full_norm: bool, gated: bool) -> Result<Self> {
        let (q, kv) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let normed = match full_norm {
            true => Some((b.alloc(rows * q)?, b.alloc(rows * kv)?)),
            false => None,
        };
        Ok(Self {
            q: b.alloc(rows * q)?,
            k: b.alloc(rows * kv)?,
            v: b.alloc(rows * kv)?,
            attn: b.alloc(rows * q)?,
            normed,
            gate: gated.then(|| b.alloc(rows * q)).transpose()?,
        })
    }

    pub fn bytes(d: &GqaDims, rows: usize, full_norm: bool, gated: bool) -> u64 {
        let (q, kv) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let (norm, gate) = (if full_norm { q + kv } else { 0 }, if gated { q } else { 0 });
        4 * (rows * (2 * q + 2 * kv + norm + gate)) as u64
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
        let q = LinearOut::biased(b, &self.q, self.q_bias.as_ref(), &mut s.q);
        let k = LinearOut::biased(b, &self.k, self.k_bias.as_ref(), &mut s.k);
        let v = LinearOut::biased(b, &self.v, self.v_bias.as_ref(), &mut s.v);
        match (&self.out_gate, s.gate.as_mut()) {
            (Some(g), Some(buf)) => b.linears(xn, rows, &mut [q, k, v, LinearOut::new(b, g, buf)]),
            _ => b.linears(xn, rows, &mut [q, k, v]),
        }
        let (q, k, q_norm, k_norm) = match (self.full_norm, s.normed.as_mut()) {
            (true, Some((nq, nk))) => {
                let (qw, kw) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
                b.rms_norm(rows, qw, &s.q, self.q_norm.as_ref(), eps, nq);
                b.rms_norm(rows, kw, &s.k, self.k_norm.as_ref(), eps, nk);
                (nq, &*nk, None, None)
            }
            _ => (&mut s.q, &s.k, self.q_norm.as_ref(), self.k_norm.as_ref()),
        };
        b.gqa_prepare(step, GqaPrepare { dims: d, q: &mut *q, k, v: &s.v, q_norm, k_norm, eps, cos, sin, cache });
        b.gqa_attend(step, GqaAttend { dims: d, q: &*q, cache, sinks: self.sinks.as_ref(), out: &mut s.attn });
        if let (Some(_), Some(gate)) = (&self.out_gate, s.gate.as_ref()) {
            b.sigmoid_mul(rows * d.heads * d.head_dim, gate, &mut s.attn);
        }
        b.linears(&s.attn, rows, &mut [LinearOut { bias: self.o_bias.as_ref(), ..LinearOut::add(b, &self.o, x) }]);
    }
}
