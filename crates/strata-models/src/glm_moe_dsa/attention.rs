//! MLA attention with DeepSeek Sparse Attention.
//!
//! The cache holds only the normalised latent (`kv_lora_rank`) and the rotated shared key
//! (`qk_rope_head_dim`) per token, plus the indexer key on layers that run an indexer.
//! `kv_b_proj` is absorbed into the query and output sides (`w_uk`, `w_uv`), so attention
//! runs directly over the latent: `q_nope . (W_uk c) = (q_nope W_uk) . c` and
//! `P (c W_uv^T) = (P c) W_uv^T`. Same function as transformers' expand-then-attend.

use super::config::GlmMoeDsaConfig;
use super::rope::{apply_interleaved, RopeTables};
use crate::nn::{linear, softmax_last, LayerNorm, RmsNorm, Weight};
use anyhow::Result;
use candle_core::{Device, Tensor, D};

/// Growable per-layer cache rows; `len` rows of `buf` are valid.
pub struct CacheRows {
    buf: Tensor,
    len: usize,
}

impl CacheRows {
    pub fn new(width: usize, device: &Device) -> Result<Self> {
        Ok(Self { buf: Tensor::zeros((16, width), candle_core::DType::F32, device)?, len: 0 })
    }

    /// Appends `rows` (`[n, width]`) and returns the valid prefix `[len, width]`.
    pub fn append(&mut self, rows: &Tensor) -> Result<Tensor> {
        let (n, width) = rows.dims2()?;
        let cap = self.buf.dim(0)?;
        if self.len + n > cap {
            let new_cap = (self.len + n).next_power_of_two();
            let grown = Tensor::zeros((new_cap, width), candle_core::DType::F32, rows.device())?;
            grown.slice_set(&self.buf.narrow(0, 0, self.len)?.contiguous()?, 0, 0)?;
            self.buf = grown;
        }
        self.buf.slice_set(&rows.contiguous()?, 0, self.len)?;
        self.len += n;
        Ok(self.buf.narrow(0, 0, self.len)?)
    }

    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

pub struct LayerCache {
    pub latent: CacheRows,
    pub k_rot: CacheRows,
    pub index_k: Option<CacheRows>,
}

/// The lightning indexer of one "full" layer.
pub struct Indexer {
    pub wq_b: Weight,
    pub wk: Weight,
    pub k_norm: LayerNorm,
    pub weights_proj: Weight,
    pub n_heads: usize,
    pub head_dim: usize,
}

pub struct Attention {
    pub q_a: Weight,
    pub q_a_norm: RmsNorm,
    pub q_b: Weight,
    pub kv_a: Weight,
    pub kv_a_norm: RmsNorm,
    /// `[heads, nope, kv_lora]`: the key half of `kv_b_proj`, per head.
    pub w_uk: Tensor,
    /// `[heads, kv_lora, v]`: the value half of `kv_b_proj`, transposed, per head.
    pub w_uv_t: Tensor,
    pub o: Weight,
    pub indexer: Option<Indexer>,
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub kv_lora: usize,
    pub v_dim: usize,
    pub index_topk: usize,
    pub scale: f64,
}

/// Which cached positions each new row may attend to, as an additive `[T, L]` mask
/// (`None` = plain causal over everything, which equals dense attention).
pub type Selection = Option<Tensor>;

impl Attention {
    pub fn new_cache(&self, cfg: &GlmMoeDsaConfig, device: &Device) -> Result<LayerCache> {
        Ok(LayerCache {
            latent: CacheRows::new(cfg.kv_lora_rank, device)?,
            k_rot: CacheRows::new(cfg.qk_rope_head_dim, device)?,
            index_k: match self.indexer {
                Some(_) => Some(CacheRows::new(cfg.index_head_dim, device)?),
                None => None,
            },
        })
    }

    /// `x`: `[T, hidden]` (already normed) at positions `start..start+T`. `shared` is the
    /// previous full layer's selection on a shared layer. Returns the output and this
    /// layer's selection (for the layers that share it).
    pub fn forward(
        &self,
        x: &Tensor,
        start: usize,
        tables: &RopeTables,
        cache: &mut LayerCache,
        shared: Option<&Selection>,
    ) -> Result<(Tensor, Selection)> {
        let t = x.dim(0)?;
        let q_resid = self.q_a_norm.forward(&linear(x, &self.q_a)?)?;
        let q = linear(&q_resid, &self.q_b)?.reshape((t, self.heads, self.nope + self.rope))?;
        let q_nope = q.narrow(2, 0, self.nope)?;
        let q_rot = apply_interleaved(&q.narrow(2, self.nope, self.rope)?.contiguous()?, tables)?;

        let ckv = linear(x, &self.kv_a)?;
        let latent = self.kv_a_norm.forward(&ckv.narrow(1, 0, self.kv_lora)?.contiguous()?)?;
        let k_rot = ckv.narrow(1, self.kv_lora, self.rope)?.contiguous()?.reshape((t, 1, self.rope))?;
        let k_rot = apply_interleaved(&k_rot, tables)?.reshape((t, self.rope))?;
        let latent_all = cache.latent.append(&latent)?;
        let k_rot_all = cache.k_rot.append(&k_rot)?;
        let l = latent_all.dim(0)?;

        let selection = match (&self.indexer, shared) {
            (Some(ix), _) => ix.select(x, &q_resid, start, tables, cache, self.index_topk)?,
            (None, Some(sel)) => sel.clone(),
            (None, None) => {
                anyhow::bail!("a shared DSA layer needs the selection of an earlier full layer")
            }
        };

        // Scores over the latent: [heads, T, L].
        let q_lat = q_nope.transpose(0, 1)?.contiguous()?.matmul(&self.w_uk)?; // [h, T, kv_lora]
        let s_lat = q_lat.reshape((self.heads * t, self.kv_lora))?.matmul(&latent_all.t()?)?;
        let q_rot_h = q_rot.transpose(0, 1)?.contiguous()?.reshape((self.heads * t, self.rope))?;
        let s_rot = q_rot_h.matmul(&k_rot_all.t()?)?;
        let mut scores = ((s_lat + s_rot)? * self.scale)?.reshape((self.heads, t, l))?;
        let mask = match &selection {
            Some(m) => Some(m.clone()),
            None if t > 1 => Some(causal_mask(t, start, x.device())?),
            None => None,
        };
        if let Some(m) = mask {
            scores = scores.broadcast_add(&m)?;
        }
        let probs = softmax_last(&scores)?;
        let out_lat = probs.reshape((self.heads * t, l))?.matmul(&latent_all)?;
        let out = out_lat.reshape((self.heads, t, self.kv_lora))?.matmul(&self.w_uv_t)?; // [h, T, v]
        let out = out.transpose(0, 1)?.contiguous()?.reshape((t, self.heads * self.v_dim))?;
        Ok((linear(&out, &self.o)?, selection))
    }
}

/// Additive causal mask `[T, start+T]`.
fn causal_mask(t: usize, start: usize, device: &Device) -> Result<Tensor> {
    let l = start + t;
    let mut m = vec![0f32; t * l];
    for r in 0..t {
        for c in start + r + 1..l {
            m[r * l + c] = f32::NEG_INFINITY;
        }
    }
    Ok(Tensor::from_vec(m, (t, l), device)?)
}

impl Indexer {
    /// Caches this step's indexer keys and, where some row sees more than `topk` positions,
    /// returns the top-k selection as an additive mask. Ties go to the earlier position.
    fn select(
        &self,
        x: &Tensor,
        q_resid: &Tensor,
        start: usize,
        tables: &RopeTables,
        cache: &mut LayerCache,
        topk: usize,
    ) -> Result<Selection> {
        let t = x.dim(0)?;
        let rope = tables.cos.dim(1)? * 2;
        let k = self.k_norm.forward(&linear(x, &self.wk)?)?.reshape((t, 1, self.head_dim))?;
        let k = rotate_prefix(&k, rope, tables)?.reshape((t, self.head_dim))?;
        let k_all = cache.index_k.as_mut().expect("indexer layer has an index cache").append(&k)?;
        let l = k_all.dim(0)?;
        if l <= topk {
            return Ok(None); // Every row sees at most `topk` positions: dense attention.
        }
        let q = linear(q_resid, &self.wq_b)?.reshape((t, self.n_heads, self.head_dim))?;
        let q = rotate_prefix(&q, rope, tables)?;
        // relu(q . k) * d^-0.5 per head: [T, heads, L].
        let s = q
            .reshape((t * self.n_heads, self.head_dim))?
            .matmul(&k_all.t()?)?
            .relu()?
            .affine((self.head_dim as f64).powf(-0.5), 0.0)?
            .reshape((t, self.n_heads, l))?;
        let w = (linear(x, &self.weights_proj)? * (self.n_heads as f64).powf(-0.5))?; // [T, heads]
        let scores = w.unsqueeze(1)?.matmul(&s)?.squeeze(1)?.to_vec2::<f32>()?; // [T, L]
        let mut mask = vec![f32::NEG_INFINITY; t * l];
        let mut order: Vec<usize> = Vec::with_capacity(l);
        for (r, row) in scores.iter().enumerate() {
            let visible = start + r + 1;
            let dst = &mut mask[r * l..(r + 1) * l];
            order.clear();
            order.extend(0..visible);
            if visible > topk {
                // Stable sort by descending score: equal scores keep the earlier position.
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                order.truncate(topk);
            }
            for &c in &order {
                dst[c] = 0.0;
            }
        }
        Ok(Some(Tensor::from_vec(mask, (t, l), x.device())?))
    }
}

/// Applies interleaved RoPE to the first `rope` dims of `[T, heads, dim]`, passing the rest.
fn rotate_prefix(x: &Tensor, rope: usize, tables: &RopeTables) -> Result<Tensor> {
    let dim = x.dim(D::Minus1)?;
    let rotated = apply_interleaved(&x.narrow(D::Minus1, 0, rope)?.contiguous()?, tables)?;
    if dim == rope {
        return Ok(rotated);
    }
    Ok(Tensor::cat(&[rotated, x.narrow(D::Minus1, rope, dim - rope)?], D::Minus1)?)
}
