//! DeepSeek-V3 MoE: `noaux_tc` router, routed SwiGLU experts and a shared expert.
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
use strata_backend::{Backend, ExpertTask, RouterParams};
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

pub struct MoeWeights<B: Backend> {
    pub layer: usize,
    /// Router `[experts, hidden]`, computed in f32 as the reference does.
    pub gate: B::Mat,
    pub bias: B::Buf,
    pub params: RouterParams,
    pub experts: usize,
    pub shared: SwiGlu<B>,
}

/// Activations of MoE layers for forwards of up to `rows` rows.
pub struct MoeScratch<B: Backend> {
    logits: B::Buf,
    ids: B::Idx,
    weights: B::Buf,
    src: B::Idx,
    /// `0..top_k`: one row's y rows in routed order (the by-id path).
    in_order: B::Idx,
    /// Routed outputs (`rows * top_k` rows), then the shared expert's (`rows`), then
    /// `zero_row`, which no expert writes: left-out experts read it (approximate decode).
    y: B::Buf,
    zero_row: u32,
    host_ids: Vec<u32>,
    union: Union,
    /// The experts a provider handed over this forward (checked against the union).
    handed: Vec<u32>,
}

impl<B: Backend> MoeScratch<B> {
    pub fn new(b: &B, rows: usize, hidden: usize, experts: usize, top_k: usize) -> Result<Self> {
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
            y: b.alloc((rows * (top_k + 1) + 1) * hidden)?,
            zero_row: (rows * (top_k + 1)) as u32,
            host_ids: vec![0; rows * top_k],
            union: Union::default(),
            handed: Vec::with_capacity(rows * top_k),
        })
    }

    pub fn bytes(rows: usize, hidden: usize, experts: usize, top_k: usize) -> u64 {
        4 * (rows * experts + 3 * rows * top_k + (rows * (top_k + 1) + 1) * hidden) as u64 * 2
    }
}

impl<B: Backend> MoeWeights<B> {
    /// Routes `xn` on the backend; with `to_host`, reads the ids back (`rows x top_k` in
    /// the scratch's `host_ids`).
    fn route(&self, b: &B, xn: &B::Buf, rows: usize, s: &mut MoeScratch<B>, to_host: bool) {
        b.route_noaux(xn, rows, &self.gate, &self.bias, self.params, &mut s.logits, &mut s.ids, &mut s.weights);
        if to_host {
            let n = rows * self.params.top_k;
            b.read_idx(&s.ids, 0, &mut s.host_ids[..n]);
        }
    }

    fn shared_ref<'a>(&'a self, b: &B) -> B::ExpertRef<'a> {
        b.expert_ref(&self.shared.gate, &self.shared.up, &self.shared.down)
    }

    /// Predicts this layer's routing from `xn` (the previous layer's residual, normed with
    /// this layer's norm) and tells the provider (PILOT).
    pub fn predict(&self, b: &B, xn: &B::Buf, rows: usize, s: &mut MoeScratch<B>, provider: &dyn ExpertProvider<B>) {
        self.route(b, xn, rows, s, true);
        provider.predicted(self.layer, &s.host_ids[..rows * self.params.top_k], self.params.top_k);
    }

    /// `x += moe(xn)`; records the routing in `routes`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        b: &B,
        experts: &ExpertSource<B>,
        xn: &B::Buf,
        rows: usize,
        hidden: usize,
        s: &mut MoeScratch<B>,
        routes: &mut Routes,
        x: &mut B::Buf,
    ) -> Result<()> {
        let k = self.params.top_k;
        if rows == 1 {
            let table = match experts {
                ExpertSource::Resident(r) => r.table(self.layer),
                ExpertSource::Provider(p) => p.device_table(b, self.layer, k)?,
            };
            if let Some(table) = table {
                return self.forward_by_id(b, table, experts.provider(), xn, hidden, s, routes, x);
            }
        }
        self.route(b, xn, rows, s, true);
        let n = rows * k;
        routes.push(self.layer, &s.host_ids[..n]);
        if let Some(p) = experts.provider() {
            p.record(self.layer, &s.host_ids[..n], k);
        }
        s.union.build(&s.host_ids[..n], rows, k, self.experts);
        let shared_row = s.union.total();
        let union = &s.union;
        let y = &mut s.y;
        let handed = &mut s.handed;
        handed.clear();
        let mut first = true;
        experts.run(b, self.layer, &union.experts, &mut |ready| {
            let count = ready.len();
            handed.extend((0..count).map(|i| ready.get(i).0));
            let with_shared = std::mem::take(&mut first);
            let task = |i: usize| {
                if i == count {
                    return ExpertTask { weights: self.shared_ref(b), rows: None, out_row: shared_row };
                }
                let (e, weights) = ready.get(i);
                let (rows_of, out_row) = union.rows_of(e).expect("a ready expert was routed");
                ExpertTask { weights, rows: Some(rows_of), out_row }
            };
            b.experts(xn, rows, count + usize::from(with_shared), &task, y);
            Ok(())
        })?;
        if first {
            // (No routed expert was handed over: the shared expert still runs.)
            let weights = self.shared_ref(b);
            b.experts(xn, rows, 1, &|_| ExpertTask { weights, rows: None, out_row: shared_row }, &mut s.y);
        }
        if s.handed.len() < s.union.experts.len() {
            let ids = &s.host_ids[..n];
            s.union.drop_left_out(experts.provider(), self.layer, ids, &s.handed, s.zero_row)?;
        }
        b.write_idx(&mut s.src, 0, &s.union.src);
        b.moe_combine(rows, hidden, k, &s.ids, &s.weights, &s.src, &s.y, Some(shared_row), x);
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
        xn: &B::Buf,
        hidden: usize,
        s: &mut MoeScratch<B>,
        routes: &mut Routes,
        x: &mut B::Buf,
    ) -> Result<()> {
        let k = self.params.top_k;
        self.route(b, xn, 1, s, routes.recording());
        if routes.recording() {
            routes.push(self.layer, &s.host_ids[..k]);
            if let Some(p) = provider {
                p.record(self.layer, &s.host_ids[..k], k);
            }
        }
        b.experts_by_id(xn, k, &s.ids, table, Some(self.shared_ref(b)), &mut s.y);
        b.moe_combine(1, hidden, k, &s.ids, &s.weights, &s.in_order, &s.y, Some(k), x);
        Ok(())
    }
}
