//! Per-Layer Embeddings (Gemma 4 E2B/E4B): every layer gets its own small input per row.
//!
//! Once per forward: the token's row of a packed table `[vocab, layers * d]` times
//! `sqrt(d)`, plus a projection of the (scaled) input embedding `hidden -> layers * d`
//! times `hidden^-0.5`, RMSNorm'd per layer slice; the two summed and times `2^-0.5`.
//! Rows fed by an embedding (media) take the pad token's row of the table, as the
//! reference does. In each layer, after the feed-forward half:
//! `x += post_norm(proj(gelu_tanh(gate x) * input[layer]))`.

use anyhow::Result;
use strata_backend::{Backend, LinearOut, Step};

pub struct Ple<B: Backend> {
    /// `[vocab, layers * dim]`.
    pub table: B::Mat,
    /// `per_layer_model_projection`: `[layers * dim, hidden]`.
    pub proj: B::Mat,
    /// `per_layer_projection_norm`: `[dim]`.
    pub norm: B::Buf,
    pub dim: usize,
    pub layers: usize,
}

/// A layer's gate into the residual.
pub struct LayerPle<B: Backend> {
    pub gate: B::Mat,
    pub proj: B::Mat,
    pub post_norm: B::Buf,
}

pub struct PleScratch<B: Backend> {
    /// The forward's per-layer inputs, `[rows, layers * dim]`.
    inputs: B::Buf,
    tmp: B::Buf,
    gated: B::Buf,
    out: B::Buf,
}

impl<B: Backend> PleScratch<B> {
    pub fn new(b: &B, rows: usize, hidden: usize, layers: usize, dim: usize) -> Result<Self> {
        Ok(Self {
            inputs: b.alloc(rows * layers * dim)?,
            tmp: b.alloc(rows * layers * dim)?,
            gated: b.alloc(rows * dim)?,
            out: b.alloc(rows * hidden)?,
        })
    }

    pub fn bytes(rows: usize, hidden: usize, layers: usize, dim: usize) -> u64 {
        4 * (rows * (2 * layers * dim + dim + hidden)) as u64
    }
}

impl<B: Backend> Ple<B> {
    /// The per-layer inputs of the step's rows: `step` carries the ids the table is read
    /// with (media rows already replaced by the pad id; fed rows read `picks`), `x` the
    /// scaled input embeddings.
    pub fn inputs(
        &self,
        b: &B,
        step: &Step,
        picks: &B::Idx,
        x: &B::Buf,
        eps: f32,
        s: &mut PleScratch<B>,
    ) -> Result<()> {
        let rows = step.rows();
        let width = self.layers * self.dim;
        b.embed(step, Some(picks), &self.table, &mut s.inputs)?;
        b.scale(rows * width, (self.dim as f32).sqrt(), &mut s.inputs);
        let hidden = b.mat_shape(&self.proj).1;
        b.linears(x, rows, &mut [LinearOut::new(b, &self.proj, &mut s.tmp)]);
        b.scale(rows * width, (hidden as f32).powf(-0.5), &mut s.tmp);
        // RMSNorm of each layer's slice, then (projection + token) * 2^-0.5.
        b.add_rms_norm(rows * self.layers, self.dim, &s.tmp, Some(&self.norm), eps, &mut s.inputs);
        b.scale(rows * width, std::f32::consts::FRAC_1_SQRT_2, &mut s.inputs);
        Ok(())
    }

    /// `x += post_norm(proj(gelu_tanh(gate x) * input[layer]))`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_add(
        &self,
        b: &B,
        l: &LayerPle<B>,
        layer: usize,
        rows: usize,
        hidden: usize,
        eps: f32,
        s: &mut PleScratch<B>,
        x: &mut B::Buf,
    ) {
        b.linears(x, rows, &mut [LinearOut::new(b, &l.gate, &mut s.gated)]);
        b.gelu_tanh_mul(rows, self.dim, &mut s.gated, &s.inputs, self.layers * self.dim, layer * self.dim);
        b.linears(&s.gated, rows, &mut [LinearOut::new(b, &l.proj, &mut s.out)]);
        b.add_rms_norm(rows, hidden, &s.out, Some(&l.post_norm), eps, x);
    }
}
