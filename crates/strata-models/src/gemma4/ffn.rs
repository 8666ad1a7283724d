//! Gemma 4's feed-forward half: a GELU-tanh gated MLP between `pre_feedforward_layernorm`
//! and `post_feedforward_layernorm`, and on MoE models (26B-A4B) routed experts in
//! parallel with it:
//!
//! `x += post(post_1(MLP(pre(x))) + post_2(Experts(pre_2(x))))`
//!
//! The router reads the residual: RMSNorm without scale, times a learned scale and
//! `hidden^-0.5`, a linear to the experts, softmax (f32), top-k, renormalised, times a
//! per-expert scale. Experts run through the shared MoE block (`blocks::Moe`: the
//! provider, resident or streamed; the union of the rows' experts; outputs combined per
//! row in ascending expert id), so streamed output equals resident output bit for bit.

use crate::blocks::{ExpertSource, Moe, MoeScratch};
use anyhow::Result;
use strata_backend::{Backend, ExpertTask, GateAct};
use strata_experts::{ExpertProvider, Routes};

/// `down(gelu_tanh(gate x) * up x)`.
pub struct Mlp<B: Backend> {
    pub gate: B::Mat,
    pub up: B::Mat,
    pub down: B::Mat,
}

impl<B: Backend> Mlp<B> {
    /// `y = mlp(xn)` over `rows` rows.
    pub fn forward(&self, b: &B, xn: &B::Buf, rows: usize, y: &mut B::Buf) {
        let weights = b.expert_ref(&self.gate, &self.up, &self.down);
        b.gated_experts(
            GateAct::GeluTanh,
            xn,
            rows,
            1,
            &|_| ExpertTask { weights, rows: None, out_row: 0, bias: None },
            y,
        );
    }
}

/// The routed half of an MoE layer: the shared MoE block with a softmax router over the
/// normalised residual and GELU-tanh experts, between Gemma's extra norms.
pub struct Routed<B: Backend> {
    /// Softmax router, GELU-tanh experts, no shared expert.
    pub block: Moe<B>,
    /// `router.scale * hidden^-0.5`: the router's input norm weight.
    pub router_norm: B::Buf,
    pub pre_norm_2: B::Buf,
    pub post_norm_1: B::Buf,
    pub post_norm_2: B::Buf,
}

pub struct Ffn<B: Backend> {
    pub pre_norm: B::Buf,
    pub post_norm: B::Buf,
    pub mlp: Mlp<B>,
    pub moe: Option<Routed<B>>,
}

/// Activations of the feed-forward half for forwards of up to `rows` rows.
pub struct FfnScratch<B: Backend> {
    xn: B::Buf,
    m: B::Buf,
    e: B::Buf,
    /// The router's input, and the MoE block's scratch.
    moe: Option<(B::Buf, MoeScratch<B>)>,
}

impl<B: Backend> FfnScratch<B> {
    /// `moe`: (experts, top_k) of an MoE model.
    pub fn new(b: &B, rows: usize, hidden: usize, moe: Option<(usize, usize)>) -> Result<Self> {
        let moe = match moe {
            None => None,
            Some((experts, k)) => Some((b.alloc(rows * hidden)?, MoeScratch::new(b, rows, hidden, experts, k, false)?)),
        };
        Ok(Self { xn: b.alloc(rows * hidden)?, m: b.alloc(rows * hidden)?, e: b.alloc(rows * hidden)?, moe })
    }

    pub fn bytes(rows: usize, hidden: usize, moe: Option<(usize, usize)>) -> u64 {
        let routed = moe.map_or(0, |(experts, k)| {
            8 * (rows * hidden) as u64 + MoeScratch::<B>::bytes(rows, hidden, experts, k, false)
        });
        4 * (3 * rows * hidden) as u64 + routed
    }
}

impl<B: Backend> Ffn<B> {
    /// `x += ffn(x)`; MoE layers record their routing in `routes`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        experts: &ExpertSource<B>,
        rows: usize,
        hidden: usize,
        eps: f32,
        s: &mut FfnScratch<B>,
        routes: &mut Routes,
        x: &mut B::Buf,
    ) -> Result<()> {
        b.rms_norm(rows, hidden, x, Some(&self.pre_norm), eps, &mut s.xn);
        self.mlp.forward(b, &s.xn, rows, &mut s.m);
        let Some(moe) = &self.moe else {
            b.add_rms_norm(rows, hidden, &s.m, Some(&self.post_norm), eps, x);
            return Ok(());
        };
        let (xr, ms) = s.moe.as_mut().expect("an MoE layer runs with routing scratch");
        // m <- post_1(mlp); the experts' input reuses xn, their sum e.
        b.rms_norm(rows, hidden, &s.m, Some(&moe.post_norm_1), eps, &mut s.e);
        std::mem::swap(&mut s.m, &mut s.e);
        b.rms_norm(rows, hidden, x, Some(&moe.router_norm), eps, xr);
        b.rms_norm(rows, hidden, x, Some(&moe.pre_norm_2), eps, &mut s.xn);
        b.fill(rows * hidden, 0.0, &mut s.e);
        moe.block.forward_add(b, experts, xr, &s.xn, rows, hidden, ms, routes, &mut s.e)?;
        // m = post_1(mlp) + post_2(experts); x += post(m).
        b.add_rms_norm(rows, hidden, &s.e, Some(&moe.post_norm_2), eps, &mut s.m);
        b.add_rms_norm(rows, hidden, &s.m, Some(&self.post_norm), eps, x);
        Ok(())
    }

    /// PILOT: routes `x` (a residual one layer early) with this layer's router and tells
    /// the provider.
    #[allow(clippy::too_many_arguments)]
    pub fn predict(
        &self,
        b: &B,
        p: &dyn ExpertProvider<B>,
        x: &B::Buf,
        rows: usize,
        hidden: usize,
        eps: f32,
        s: &mut FfnScratch<B>,
    ) {
        if let (Some(moe), Some((xr, ms))) = (&self.moe, s.moe.as_mut()) {
            b.rms_norm(rows, hidden, x, Some(&moe.router_norm), eps, xr);
            moe.block.predict(b, xr, rows, ms, p);
        }
    }
}
