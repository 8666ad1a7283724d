//! A decoder layer's feed-forward half (dense SwiGLU or MoE) and PILOT's look-ahead: the
//! next MoE layer's router run one layer early, so its experts can be fetched during this
//! layer's compute.

use super::{ExpertSource, Moe, MoeScratch, SwiGlu};
use anyhow::Result;
use strata_backend::Backend;
use strata_experts::{ExpertProvider, Routes};

/// Next-layer prediction runs on forwards of at most this many rows (decode and small
/// batches; a long prefill reads most experts anyway).
pub const PILOT_MAX_ROWS: usize = 8;

pub enum Ffn<B: Backend> {
    Dense(SwiGlu<B>),
    Moe(Moe<B>),
}

/// Buffers the feed-forward half writes: the dense output and the MoE scratch.
pub struct FfnBufs<'a, B: Backend> {
    pub y: &'a mut B::Buf,
    pub moe: Option<&'a mut MoeScratch<B>>,
}

impl<B: Backend> Ffn<B> {
    /// `x += ffn(xn)`; MoE layers record their routing in `routes`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        experts: &ExpertSource<B>,
        xn: &B::Buf,
        rows: usize,
        hidden: usize,
        bufs: FfnBufs<'_, B>,
        routes: &mut Routes,
        x: &mut B::Buf,
    ) -> Result<()> {
        match self {
            Self::Dense(mlp) => mlp.forward_add(b, xn, rows, hidden, bufs.y, x),
            Self::Moe(moe) => {
                let ms = bufs.moe.expect("an MoE layer runs with MoE scratch");
                moe.forward_add(b, experts, xn, xn, rows, hidden, ms, routes, x)?;
            }
        }
        Ok(())
    }
}

/// One layer's view for PILOT: its feed-forward and the norm in front of it.
pub struct FfnLayer<'a, B: Backend> {
    pub ffn: &'a Ffn<B>,
    pub norm: &'a B::Buf,
}

/// PILOT: when `next` is an MoE layer, routes `x` (the residual after this layer's
/// attention) with `next`'s router and tells the provider. The two-step predictor first
/// adds this layer's shared expert, a cheap estimate of this layer's MoE output.
#[allow(clippy::too_many_arguments)]
pub fn pilot_predict<B: Backend>(
    b: &B,
    p: &dyn ExpertProvider<B>,
    cur: FfnLayer<'_, B>,
    next: FfnLayer<'_, B>,
    rows: usize,
    hidden: usize,
    eps: f32,
    x: &B::Buf,
    xn: &mut B::Buf,
    y: &mut B::Buf,
    ms: &mut MoeScratch<B>,
) {
    let Ffn::Moe(moe) = next.ffn else { return };
    let from = match (cur.ffn, p.two_step_prediction()) {
        (Ffn::Moe(Moe { shared: Some(shared), .. }), true) => {
            b.rms_norm(rows, hidden, x, Some(cur.norm), eps, xn);
            shared.forward_add_into(b, xn, rows, hidden, x, y);
            &*y
        }
        _ => x,
    };
    b.rms_norm(rows, hidden, from, Some(next.norm), eps, xn);
    moe.predict(b, xn, rows, ms, p);
}
