//! Gemma 4 attention: grouped-query attention with per-head q/k RMSNorm (with scale), a
//! v RMSNorm without scale, half-split RoPE over the whole head (proportional RoPE on
//! full layers rotates a fraction and leaves the rest at frequency zero), attention
//! scaling 1. Full layers may take their values from the key projection
//! (`attention_k_eq_v`: V = v_norm(raw K)); the last layers may read an earlier layer's
//! K/V cache instead of computing their own (KV sharing). The output is normalised
//! (`post_attention_layernorm`) before it joins the residual.

use strata_backend::{Backend, GqaAttend, GqaDims, GqaPrepare, GqaQuery, LinearOut, Step};

/// The K/V projections of a layer that computes its own cache.
pub struct OwnKv<B: Backend> {
    pub k: B::Mat,
    /// None: the values are the keys (`attention_k_eq_v`).
    pub v: Option<B::Mat>,
    pub k_norm: B::Buf,
}

pub struct Attention<B: Backend> {
    pub dims: GqaDims,
    pub q: B::Mat,
    pub q_norm: B::Buf,
    /// None: the layer reads another layer's cache (KV sharing).
    pub kv: Option<OwnKv<B>>,
    pub o: B::Mat,
    pub post_norm: B::Buf,
}

/// Activations of attention layers for forwards of up to `rows` rows (sized for the
/// widest layer kind; every layer uses a prefix).
pub struct AttnScratch<B: Backend> {
    q: B::Buf,
    k: B::Buf,
    v_raw: B::Buf,
    v: B::Buf,
    attn: B::Buf,
    out: B::Buf,
}

impl<B: Backend> AttnScratch<B> {
    /// `q_width`: the widest `heads * head_dim`; `kv_width`: the widest
    /// `kv_heads * head_dim`.
    pub fn new(b: &B, rows: usize, hidden: usize, q_width: usize, kv_width: usize) -> anyhow::Result<Self> {
        Ok(Self {
            q: b.alloc(rows * q_width)?,
            k: b.alloc(rows * kv_width)?,
            v_raw: b.alloc(rows * kv_width)?,
            v: b.alloc(rows * kv_width)?,
            attn: b.alloc(rows * q_width)?,
            out: b.alloc(rows * hidden)?,
        })
    }

    pub fn bytes(rows: usize, hidden: usize, q_width: usize, kv_width: usize) -> u64 {
        4 * (rows * (2 * q_width + 3 * kv_width + hidden)) as u64
    }
}

/// Where a layer's keys and values are.
pub enum Cache<'a, B: Backend> {
    /// Its own: the step's rows are written, then attended.
    Own(&'a mut B::Buf),
    /// An earlier layer's, already holding the step's rows.
    Shared(&'a B::Buf),
}

impl<B: Backend> Attention<B> {
    /// `x += post_norm(attention(xn))` for the step's rows.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        step: &Step,
        hidden: usize,
        eps: f32,
        xn: &B::Buf,
        (cos, sin): (&B::Buf, &B::Buf),
        cache: Cache<'_, B>,
        s: &mut AttnScratch<B>,
        x: &mut B::Buf,
    ) {
        let (rows, d) = (step.rows(), self.dims);
        let cache: &B::Buf = match (cache, &self.kv) {
            (Cache::Own(cache), Some(kv)) => {
                match &kv.v {
                    Some(v) => b.linears(
                        xn,
                        rows,
                        &mut [
                            LinearOut::new(b, &self.q, &mut s.q),
                            LinearOut::new(b, &kv.k, &mut s.k),
                            LinearOut::new(b, v, &mut s.v_raw),
                        ],
                    ),
                    None => b.linears(
                        xn,
                        rows,
                        &mut [LinearOut::new(b, &self.q, &mut s.q), LinearOut::new(b, &kv.k, &mut s.k)],
                    ),
                }
                // v_norm: RMSNorm of each value head, no scale (of the raw keys with k_eq_v).
                let raw = if kv.v.is_some() { &s.v_raw } else { &s.k };
                b.rms_norm(rows * d.kv_heads, d.head_dim, raw, None, eps, &mut s.v);
                b.gqa_prepare(
                    step,
                    GqaPrepare {
                        dims: d,
                        q: &mut s.q,
                        k: &s.k,
                        v: &s.v,
                        q_norm: Some(&self.q_norm),
                        k_norm: Some(&kv.k_norm),
                        eps,
                        cos,
                        sin,
                        cache,
                    },
                );
                cache
            }
            (Cache::Shared(cache), None) => {
                b.linears(xn, rows, &mut [LinearOut::new(b, &self.q, &mut s.q)]);
                b.gqa_query(step, GqaQuery { dims: d, q: &mut s.q, q_norm: Some(&self.q_norm), eps, cos, sin });
                cache
            }
            _ => unreachable!("a layer's cache matches whether it computes its own K/V"),
        };
        b.gqa_attend(step, GqaAttend { dims: d, q: &s.q, cache, sinks: None, out: &mut s.attn });
        b.linears(&s.attn, rows, &mut [LinearOut::new(b, &self.o, &mut s.out)]);
        b.add_rms_norm(rows, hidden, &s.out, Some(&self.post_norm), eps, x);
    }
}
