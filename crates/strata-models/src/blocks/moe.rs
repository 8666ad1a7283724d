//! The routed-expert block every family uses: a router (as data), routed gated experts
//! (the activation as data), an optional shared expert; and a decoder layer's
//! feed-forward half, dense or this block ([`Ffn`]), with PILOT's look-ahead (the next MoE
//! layer's router run one layer early, so its experts can be fetched during this layer's
//! compute).
//!
//! Routing runs on the backend; the ids come back to the host (the provider plans reads
//! and counts selections), the rows' experts are deduplicated ([`Union`]), and the
//! provider hands ready experts to one batched expert op (the shared expert rides in the
//! first batch). The outputs are combined per row in ascending expert id, so the result
//! does not depend on which experts were resident. One row over experts held in place
//! (resident, or a provider whose device tier holds them all) on a backend with an expert
//! table (CUDA) skips the round trip: the device indexes the table by the routed ids
//! ([`Backend::experts_by_id`]), with the same products and the same combine, so the
//! output is the same bit for bit.

use super::mlp::SwiGlu;
use anyhow::Result;
use std::sync::Arc;
use strata_backend::{Backend, ExpertTask, GateAct, RouterParams};
use strata_experts::{ExpertProvider, ReadyExperts, ResidentExperts, Routes, Union};

/// Where a model's routed experts come from.
pub enum ExpertSource<B: Backend> {
    Resident(ResidentExperts<B>),
    Provider(Arc<dyn ExpertProvider<B>>),
}

impl<B: Backend> ExpertSource<B> {
    /// Makes `experts` (unique, ascending) of `layer` available and hands them to
    /// `compute` in batches as they are ready (see [`ExpertProvider::run`]).
    pub fn run(
        &self,
        b: &B,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<B>) -> Result<()>,
    ) -> Result<()> {
        match self {
            Self::Resident(r) => r.run(b, layer, experts, compute),
            Self::Provider(p) => p.run(b, layer, experts, compute),
        }
    }

    pub fn provider(&self) -> Option<&Arc<dyn ExpertProvider<B>>> {
        match self {
            Self::Provider(p) => Some(p),
            Self::Resident(_) => None,
        }
    }
}

/// How a token's experts are chosen from `gate`'s logits (`x gate^T`, in f32).
pub enum Router<B: Backend> {
    /// DeepSeek-V3 / GLM (`noaux_tc`): sigmoid scores plus a correction bias choose
    /// (grouped top-k), the unbiased scores of the chosen weigh (renormalised where
    /// `params` says), times the routed scaling factor.
    Noaux { gate: B::Mat, bias: B::Buf, params: RouterParams },
    /// Softmax over the experts, the `top_k` largest, renormalised to sum to one, each
    /// times `expert_scale[id]` (Gemma 4; ones where a family has no such scale).
    Softmax { gate: B::Mat, expert_scale: B::Buf, top_k: usize },
}

impl<B: Backend> Router<B> {
    pub fn top_k(&self) -> usize {
        match self {
            Self::Noaux { params, .. } => params.top_k,
            Self::Softmax { top_k, .. } => *top_k,
        }
    }
}

/// A layer's routed experts: `x += sum over the chosen e of w_e * down(act(gate_e x) *
/// up_e x)` (+ the shared expert's output, where there is one).
pub struct Moe<B: Backend> {
    pub layer: usize,
    pub router: Router<B>,
    pub experts: usize,
    /// The experts' gate activation (the shared expert's too).
    pub act: GateAct,
    pub shared: Option<SwiGlu<B>>,
}

/// Activations of MoE layers for forwards of up to `rows` rows.
pub struct MoeScratch<B: Backend> {
    logits: B::Buf,
    ids: B::Idx,
    weights: B::Buf,
    src: B::Idx,
    /// `0..top_k`: one row's y rows in routed order (the by-id path).
    in_order: B::Idx,
    /// Routed outputs (`rows * top_k` rows), then the shared expert's (`rows`, where there
    /// is one), then `zero_row`, which no expert writes: left-out experts read it
    /// (approximate decode).
    y: B::Buf,
    zero_row: u32,
    host_ids: Vec<u32>,
    union: Union,
    /// The experts a provider handed over this forward (checked against the union).
    handed: Vec<u32>,
}

impl<B: Backend> MoeScratch<B> {
    pub fn new(b: &B, rows: usize, hidden: usize, experts: usize, top_k: usize, shared: bool) -> Result<Self> {
        let y_rows = rows * (top_k + usize::from(shared));
        Ok(Self {
            logits: b.alloc(rows * experts)?,
            ids: b.alloc_idx(rows * top_k)?,
            weights: b.alloc(rows * top_k)?,
            src: b.alloc_idx(rows * top_k)?,
            in_order: {
                let mut i = b.alloc_idx(top_k)?;
                b.write_idx(&mut i, 0, &(0..top_k as u32).collect::<Vec<_>>());
                i
            },
            y: b.alloc((y_rows + 1) * hidden)?,
            zero_row: y_rows as u32,
            host_ids: vec![0; rows * top_k],
            union: Union::default(),
            handed: Vec::with_capacity(rows * top_k),
        })
    }

    /// What [`MoeScratch::new`] allocates, twice over (the plan's margin).
    pub fn bytes(rows: usize, hidden: usize, experts: usize, top_k: usize, shared: bool) -> u64 {
        let y_rows = rows * (top_k + usize::from(shared));
        4 * (rows * experts + 3 * rows * top_k + (y_rows + 1) * hidden) as u64 * 2
    }
}

impl<B: Backend> Moe<B> {
    pub fn top_k(&self) -> usize {
        self.router.top_k()
    }

    /// Routes `xr` (the router's input) on the backend; with `to_host`, reads the ids back
    /// (`rows x top_k` in the scratch's `host_ids`).
    fn route(&self, b: &B, xr: &B::Buf, rows: usize, s: &mut MoeScratch<B>, to_host: bool) {
        match &self.router {
            Router::Noaux { gate, bias, params } => {
                b.route_noaux(xr, rows, gate, bias, *params, &mut s.logits, &mut s.ids, &mut s.weights)
            }
            Router::Softmax { gate, expert_scale, top_k } => {
                b.route_softmax(xr, rows, gate, expert_scale, *top_k, &mut s.logits, &mut s.ids, &mut s.weights)
            }
        }
        if to_host {
            let n = rows * self.top_k();
            b.read_idx(&s.ids, 0, &mut s.host_ids[..n]);
        }
    }

    fn shared_ref<'a>(&'a self, b: &B) -> Option<B::ExpertRef<'a>> {
        self.shared.as_ref().map(|s| b.expert_ref(&s.gate, &s.up, &s.down))
    }

    /// Predicts this layer's routing from `xr` (its router's input, computed one layer
    /// early) and tells the provider (PILOT).
    pub fn predict(&self, b: &B, xr: &B::Buf, rows: usize, s: &mut MoeScratch<B>, provider: &dyn ExpertProvider<B>) {
        self.route(b, xr, rows, s, true);
        provider.predicted(self.layer, &s.host_ids[..rows * self.top_k()], self.top_k());
    }

    /// `out += moe(xn)`, the router reading `xr` (the same buffer as `xn` where a family
    /// routes on the experts' input); records the routing in `routes`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        experts: &ExpertSource<B>,
        xr: &B::Buf,
        xn: &B::Buf,
        rows: usize,
        hidden: usize,
        s: &mut MoeScratch<B>,
        routes: &mut Routes,
        out: &mut B::Buf,
    ) -> Result<()> {
        let k = self.top_k();
        // (The device's expert tables dispatch SwiGLU experts.)
        if rows == 1 && self.act == GateAct::Silu {
            let table = match experts {
                ExpertSource::Resident(r) => r.table(self.layer),
                ExpertSource::Provider(p) => p.device_table(b, self.layer, k)?,
            };
            if let Some(table) = table {
                return self.forward_by_id(b, table, experts.provider(), xr, xn, hidden, s, routes, out);
            }
        }
        self.route(b, xr, rows, s, true);
        let n = rows * k;
        routes.push(self.layer, &s.host_ids[..n]);
        if let Some(p) = experts.provider() {
            p.record(self.layer, &s.host_ids[..n], k);
        }
        s.union.build(&s.host_ids[..n], rows, k, self.experts);
        let shared_row = s.union.total();
        let has_shared = self.shared.is_some();
        let (union, y, handed, act) = (&s.union, &mut s.y, &mut s.handed, self.act);
        handed.clear();
        let mut first = true;
        experts.run(b, self.layer, &union.experts, &mut |ready| {
            let count = ready.len();
            handed.extend((0..count).map(|i| ready.get(i).0));
            let with_shared = std::mem::take(&mut first) && has_shared;
            let task = |i: usize| match (i == count, self.shared_ref(b)) {
                (true, Some(weights)) => ExpertTask { weights, rows: None, out_row: shared_row },
                _ => {
                    let (e, weights) = ready.get(i);
                    let (rows_of, out_row) = union.rows_of(e).expect("a ready expert was routed");
                    ExpertTask { weights, rows: Some(rows_of), out_row }
                }
            };
            b.gated_experts(act, xn, rows, count + usize::from(with_shared), &task, y);
            Ok(())
        })?;
        if let (true, Some(weights)) = (first, self.shared_ref(b)) {
            // (No routed expert was handed over: the shared expert still runs.)
            b.gated_experts(act, xn, rows, 1, &|_| ExpertTask { weights, rows: None, out_row: shared_row }, &mut s.y);
        }
        if s.handed.len() < s.union.experts.len() {
            let ids = &s.host_ids[..n];
            s.union.drop_left_out(experts.provider(), self.layer, ids, &s.handed, s.zero_row)?;
        }
        b.write_idx(&mut s.src, 0, &s.union.src);
        let shared_row = self.shared.as_ref().map(|_| shared_row);
        b.moe_combine(rows, hidden, k, &s.ids, &s.weights, &s.src, &s.y, shared_row, out);
        Ok(())
    }

    /// One row over experts held in place, dispatched on the device by id (see the module
    /// comment); the ids come to the host only while `routes` is recording (and then go
    /// to the provider's record too).
    #[allow(clippy::too_many_arguments)]
    fn forward_by_id(
        &self,
        b: &B,
        table: &B::ExpertTable,
        provider: Option<&Arc<dyn ExpertProvider<B>>>,
        xr: &B::Buf,
        xn: &B::Buf,
        hidden: usize,
        s: &mut MoeScratch<B>,
        routes: &mut Routes,
        out: &mut B::Buf,
    ) -> Result<()> {
        let k = self.top_k();
        self.route(b, xr, 1, s, routes.recording());
        if routes.recording() {
            routes.push(self.layer, &s.host_ids[..k]);
            if let Some(p) = provider {
                p.record(self.layer, &s.host_ids[..k], k);
            }
        }
        let shared = self.shared_ref(b);
        let shared_row = shared.is_some().then_some(k);
        b.experts_by_id(xn, k, &s.ids, table, shared, &mut s.y);
        b.moe_combine(1, hidden, k, &s.ids, &s.weights, &s.in_order, &s.y, shared_row, out);
        Ok(())
    }
}

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
