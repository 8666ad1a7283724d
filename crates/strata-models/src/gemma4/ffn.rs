//! Gemma 4's feed-forward half: a GELU-tanh gated MLP between `pre_feedforward_layernorm`
//! and `post_feedforward_layernorm`, and on MoE models (26B-A4B) routed experts in
//! parallel with it:
//!
//! `x += post(post_1(MLP(pre(x))) + post_2(Experts(pre_2(x))))`
//!
//! The router reads the residual: RMSNorm without scale, times a learned scale and
//! `hidden^-0.5`, a linear to the experts, softmax (f32), top-k, renormalised, times a
//! per-expert scale. Experts run through the family-independent expert path (the
//! provider: resident or streamed; the union of the rows' experts; outputs combined per
//! row in ascending expert id), so streamed output equals resident output bit for bit.

use crate::blocks::ExpertSource;
use anyhow::Result;
use strata_backend::{Backend, ExpertTask, GateAct};
use strata_experts::{ExpertProvider, Routes, Union};

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
        b.gated_experts(GateAct::GeluTanh, xn, rows, 1, &|_| ExpertTask { weights, rows: None, out_row: 0 }, y);
    }
}

/// The routed half of an MoE layer.
pub struct Moe<B: Backend> {
    pub layer: usize,
    /// `router.scale * hidden^-0.5`: the router's input norm weight.
    pub router_norm: B::Buf,
    pub router: B::Mat,
    pub expert_scale: B::Buf,
    pub experts: usize,
    pub top_k: usize,
    pub pre_norm_2: B::Buf,
    pub post_norm_1: B::Buf,
    pub post_norm_2: B::Buf,
}

pub struct Ffn<B: Backend> {
    pub pre_norm: B::Buf,
    pub post_norm: B::Buf,
    pub mlp: Mlp<B>,
    pub moe: Option<Moe<B>>,
}

/// Activations of the feed-forward half for forwards of up to `rows` rows.
pub struct FfnScratch<B: Backend> {
    xn: B::Buf,
    m: B::Buf,
    e: B::Buf,
    moe: Option<RouteScratch<B>>,
}

struct RouteScratch<B: Backend> {
    xr: B::Buf,
    logits: B::Buf,
    ids: B::Idx,
    weights: B::Buf,
    src: B::Idx,
    /// Routed outputs, `rows * top_k` rows, then `zero_row`, which no expert writes:
    /// left-out experts read it (approximate decode).
    y: B::Buf,
    zero_row: u32,
    host_ids: Vec<u32>,
    union: Union,
    /// The experts the provider handed over this forward.
    handed: Vec<u32>,
}

impl<B: Backend> FfnScratch<B> {
    /// `moe`: (experts, top_k) of an MoE model.
    pub fn new(b: &B, rows: usize, hidden: usize, moe: Option<(usize, usize)>) -> Result<Self> {
        let moe = match moe {
            None => None,
            Some((experts, k)) => Some(RouteScratch {
                xr: b.alloc(rows * hidden)?,
                logits: b.alloc(rows * experts)?,
                ids: b.alloc_idx(rows * k)?,
                weights: b.alloc(rows * k)?,
                src: b.alloc_idx(rows * k)?,
                y: b.alloc((rows * k + 1) * hidden)?,
                zero_row: (rows * k) as u32,
                host_ids: vec![0; rows * k],
                union: Union::default(),
                handed: Vec::with_capacity(rows * k),
            }),
        };
        Ok(Self { xn: b.alloc(rows * hidden)?, m: b.alloc(rows * hidden)?, e: b.alloc(rows * hidden)?, moe })
    }

    pub fn bytes(rows: usize, hidden: usize, moe: Option<(usize, usize)>) -> u64 {
        let routed = moe.map_or(0, |(experts, k)| (rows * (hidden + experts + 3 * k + k * hidden) + hidden) * 2);
        4 * (3 * rows * hidden + routed) as u64
    }
}

impl<B: Backend> Moe<B> {
    /// Routes `x` (the residual) and reads the ids back to the host.
    fn route(&self, b: &B, x: &B::Buf, rows: usize, hidden: usize, eps: f32, s: &mut RouteScratch<B>) {
        b.rms_norm(rows, hidden, x, Some(&self.router_norm), eps, &mut s.xr);
        let k = self.top_k;
        b.route_softmax(&s.xr, rows, &self.router, &self.expert_scale, k, &mut s.logits, &mut s.ids, &mut s.weights);
        b.read_idx(&s.ids, 0, &mut s.host_ids[..rows * k]);
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
        let rs = s.moe.as_mut().expect("an MoE layer runs with routing scratch");
        // m <- post_1(mlp); the experts' input reuses xn.
        b.rms_norm(rows, hidden, &s.m, Some(&moe.post_norm_1), eps, &mut s.e);
        std::mem::swap(&mut s.m, &mut s.e);
        moe.route(b, x, rows, hidden, eps, rs);
        let k = moe.top_k;
        let n = rows * k;
        routes.push(moe.layer, &rs.host_ids[..n]);
        if let Some(p) = experts.provider() {
            p.record(moe.layer, &rs.host_ids[..n], k);
        }
        rs.union.build(&rs.host_ids[..n], rows, k, moe.experts);
        b.rms_norm(rows, hidden, x, Some(&moe.pre_norm_2), eps, &mut s.xn);
        let (union, y, xn) = (&rs.union, &mut rs.y, &s.xn);
        let handed = &mut rs.handed;
        handed.clear();
        experts.run(b, moe.layer, &union.experts, &mut |ready| {
            handed.extend((0..ready.len()).map(|i| ready.get(i).0));
            let task = |i: usize| {
                let (e, weights) = ready.get(i);
                let (rows_of, out_row) = union.rows_of(e).expect("a ready expert was routed");
                ExpertTask { weights, rows: Some(rows_of), out_row }
            };
            b.gated_experts(GateAct::GeluTanh, xn, rows, ready.len(), &task, y);
            Ok(())
        })?;
        if rs.handed.len() < rs.union.experts.len() {
            let ids = &rs.host_ids[..n];
            rs.union.drop_left_out(experts.provider(), moe.layer, ids, &rs.handed, rs.zero_row)?;
        }
        b.write_idx(&mut rs.src, 0, &rs.union.src);
        b.fill(rows * hidden, 0.0, &mut s.e);
        b.moe_combine(rows, hidden, k, &rs.ids, &rs.weights, &rs.src, &rs.y, None, &mut s.e);
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
        if let (Some(moe), Some(rs)) = (&self.moe, s.moe.as_mut()) {
            moe.route(b, x, rows, hidden, eps, rs);
            p.predicted(moe.layer, &rs.host_ids[..rows * moe.top_k], moe.top_k);
        }
    }
}
