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
use strata_backend::{Backend, ExpertBias, ExpertTask, GateAct, LinearOut, RouterParams, SharedRows, SoftmaxRouting};
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
    /// Softmax over the experts, the `top_k` largest, renormalised to sum to one where
    /// `routing` says (a softmax after top-k is the renormalised form), each times
    /// `expert_scale[id]` (Gemma 4's scale; the routed scaling factor, or ones, where a
    /// family has no such scale).
    /// `gate_bias`: added to the logits (gpt-oss's router).
    Softmax { gate: B::Mat, gate_bias: Option<B::Buf>, expert_scale: B::Buf, routing: SoftmaxRouting },
}

impl<B: Backend> Router<B> {
    pub fn top_k(&self) -> usize {
        match self {
            Self::Noaux { params, .. } => params.top_k,
            Self::Softmax { routing, .. } => routing.top_k,
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
    /// The routed experts' biases, where the family has them (gpt-oss).
    pub biases: Option<ExpertBiases<B>>,
    pub shared: Option<SharedExpert<B>>,
}

/// A layer's routed-expert biases, resident (small beside the experts): `gate` and `up`
/// `[experts, inter]`, added before the activation; `down` `[experts, hidden]`.
pub struct ExpertBiases<B: Backend> {
    pub gate: B::Buf,
    pub up: B::Buf,
    pub down: B::Buf,
}

/// The expert every token takes, and where a family has one (Qwen2-MoE, Qwen3-Next) its
/// gate: a `1 x hidden` matrix whose sigmoid of `x . w` weighs the expert's output.
pub struct SharedExpert<B: Backend> {
    pub mlp: SwiGlu<B>,
    pub gate: Option<B::Mat>,
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
    /// The shared expert's gate logits, a row each (where it has a gate).
    shared_gate: B::Buf,
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
            shared_gate: b.alloc(rows)?,
            union: Union::default(),
            handed: Vec::with_capacity(rows * top_k),
        })
    }

    /// What [`MoeScratch::new`] allocates, twice over (the plan's margin).
    pub fn bytes(rows: usize, hidden: usize, experts: usize, top_k: usize, shared: bool) -> u64 {
        let y_rows = rows * (top_k + usize::from(shared));
        4 * (rows * experts + 3 * rows * top_k + (y_rows + 1) * hidden + rows) as u64 * 2
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
            Router::Softmax { gate, gate_bias, expert_scale, routing } => b.route_softmax(
                xr,
                rows,
                gate,
                gate_bias.as_ref(),
                expert_scale,
                *routing,
                &mut s.logits,
                &mut s.ids,
                &mut s.weights,
            ),
        }
        if to_host {
            let n = rows * self.top_k();
            b.read_idx(&s.ids, 0, &mut s.host_ids[..n]);
        }
    }

    fn shared_ref<'a>(&'a self, b: &B) -> Option<B::ExpertRef<'a>> {
        self.shared.as_ref().map(|s| b.expert_ref(&s.mlp.gate, &s.mlp.up, &s.mlp.down))
    }

    /// The shared expert's rows from `row` on, their gate's logits computed from `xn`
    /// into the scratch where the expert has a gate.
    fn shared_rows<'a>(
        &self,
        b: &B,
        xn: &B::Buf,
        rows: usize,
        row: usize,
        gate_logits: &'a mut B::Buf,
    ) -> Option<SharedRows<'a, B>> {
        let shared = self.shared.as_ref()?;
        let gate = shared.gate.as_ref().map(|w| {
            b.linears(xn, rows, &mut [LinearOut::new(b, w, gate_logits)]);
            &*gate_logits
        });
        Some(SharedRows { row, gate })
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
        // (The device's expert tables dispatch SwiGLU experts without biases.)
        if rows == 1 && self.act == GateAct::Silu && self.biases.is_none() {
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
                (true, Some(weights)) => ExpertTask { weights, rows: None, out_row: shared_row, bias: None },
                _ => {
                    let (e, weights) = ready.get(i);
                    let (rows_of, out_row) = union.rows_of(e).expect("a ready expert was routed");
                    let bias = self.biases.as_ref().map(|x| ExpertBias {
                        gate: &x.gate,
                        up: &x.up,
                        down: &x.down,
                        expert: e as usize,
                    });
                    ExpertTask { weights, rows: Some(rows_of), out_row, bias }
                }
            };
            b.gated_experts(act, xn, rows, count + usize::from(with_shared), &task, y);
            Ok(())
        })?;
        if let (true, Some(weights)) = (first, self.shared_ref(b)) {
            // (No routed expert was handed over: the shared expert still runs.)
            b.gated_experts(
                act,
                xn,
                rows,
                1,
                &|_| ExpertTask { weights, rows: None, out_row: shared_row, bias: None },
                &mut s.y,
            );
        }
        if s.handed.len() < s.union.experts.len() {
            let ids = &s.host_ids[..n];
            s.union.drop_left_out(experts.provider(), self.layer, ids, &s.handed, s.zero_row)?;
        }
        b.write_idx(&mut s.src, 0, &s.union.src);
        let shared = self.shared_rows(b, xn, rows, shared_row, &mut s.shared_gate);
        b.moe_combine(rows, hidden, k, &s.ids, &s.weights, &s.src, &s.y, shared, out);
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
        b.experts_by_id(xn, k, &s.ids, table, self.shared_ref(b), &mut s.y);
        let shared = self.shared_rows(b, xn, 1, k, &mut s.shared_gate);
        b.moe_combine(1, hidden, k, &s.ids, &s.weights, &s.in_order, &s.y, shared, out);
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
            shared.mlp.forward_add_into(b, xn, rows, hidden, x, y);
            &*y
        }
        _ => x,
    };
    b.rms_norm(rows, hidden, from, Some(next.norm), eps, xn);
    moe.predict(b, xn, rows, ms, p);
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_backend::cpu::CpuBackend;
    use strata_backend::HostMatrix;

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        strata_kernels::ops::rand_vec(n, seed).iter().map(|v| v * scale).collect()
    }

    fn dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    fn sigmoid(v: f64) -> f64 {
        1.0 / (1.0 + (-v).exp())
    }

    /// The block with the parts a family like gpt-oss or Qwen3-Next takes (softmax routing
    /// without renormalisation and a routed scale, clamped SwiGLU, expert biases, a gated
    /// shared expert) against a plain f64 evaluation of the same formula.
    #[test]
    fn the_block_as_data_matches_a_plain_reference() {
        let b = CpuBackend::new();
        let (hidden, inter, experts, top_k, rows) = (16usize, 8usize, 6usize, 2usize, 3usize);
        let (alpha, limit) = (1.702f32, 0.4f32);
        let mat = |r: usize, c: usize, seed| (values(r * c, seed, 0.5), r, c);
        let up = |(v, r, c): &(Vec<f32>, usize, usize)| b.matrix(HostMatrix::f32(*r, *c, v)).unwrap();
        let router = mat(experts, hidden, 1);
        let ex: Vec<[(Vec<f32>, usize, usize); 3]> = (0..experts as u64)
            .map(|e| [mat(inter, hidden, 10 + e), mat(inter, hidden, 20 + e), mat(hidden, inter, 30 + e)])
            .collect();
        let shared = [mat(inter, hidden, 40), mat(inter, hidden, 41), mat(hidden, inter, 42)];
        let shared_gate = mat(1, hidden, 43);
        let (bg, bu, bd) =
            (values(experts * inter, 50, 0.3), values(experts * inter, 51, 0.3), values(experts * hidden, 52, 0.3));
        let scale = 1.5f32;
        let moe = Moe {
            layer: 0,
            router: Router::Softmax {
                gate: up(&router),
                gate_bias: None,
                expert_scale: b.upload(&vec![scale; experts]).unwrap(),
                routing: SoftmaxRouting { top_k, renormalize: false },
            },
            experts,
            act: GateAct::SwigluClamped { alpha, limit },
            biases: Some(ExpertBiases {
                gate: b.upload(&bg).unwrap(),
                up: b.upload(&bu).unwrap(),
                down: b.upload(&bd).unwrap(),
            }),
            shared: Some(SharedExpert {
                mlp: SwiGlu { gate: up(&shared[0]), up: up(&shared[1]), down: up(&shared[2]) },
                gate: Some(up(&shared_gate)),
            }),
        };
        let mats: Vec<[_; 3]> = ex.iter().map(|m| [up(&m[0]), up(&m[1]), up(&m[2])]).collect();
        let source = ExpertSource::Resident(ResidentExperts::new(&b, vec![Some(mats)]).unwrap());
        let x = values(rows * hidden, 60, 1.5);
        let out0 = values(rows * hidden, 61, 1.0);
        let mut s = MoeScratch::new(&b, rows, hidden, experts, top_k, true).unwrap();
        let (xb, mut out) = (b.upload(&x).unwrap(), b.upload(&out0).unwrap());
        let mut routes = Routes::default();
        routes.clear(rows, top_k);
        moe.forward_add(&b, &source, &xb, &xb, rows, hidden, &mut s, &mut routes, &mut out).unwrap();
        let mut got = vec![0f32; rows * hidden];
        b.read(&out, 0, &mut got);

        let row = |m: &(Vec<f32>, usize, usize), i: usize| m.0[i * m.2..(i + 1) * m.2].to_vec();
        let mut clamped = false;
        for r in 0..rows {
            let xr = &x[r * hidden..(r + 1) * hidden];
            let logits: Vec<f64> = (0..experts).map(|e| dot(&row(&router, e), xr)).collect();
            let m = logits.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
            let mut want: Vec<f64> = out0[r * hidden..(r + 1) * hidden].iter().map(|v| *v as f64).collect();
            for &e in &order[..top_k] {
                let w = (logits[e] - m).exp() / z * scale as f64;
                let h: Vec<f32> = (0..inter)
                    .map(|i| {
                        let g = dot(&row(&ex[e][0], i), xr) + bg[e * inter + i] as f64;
                        let u = dot(&row(&ex[e][1], i), xr) + bu[e * inter + i] as f64;
                        clamped |= g > limit as f64 || u.abs() > limit as f64;
                        clamp_act(g, u, alpha, limit) as f32
                    })
                    .collect();
                for (o, v) in want.iter_mut().enumerate() {
                    *v += w * (dot(&row(&ex[e][2], o), &h) + bd[e * hidden + o] as f64);
                }
            }
            let gate = sigmoid(dot(&shared_gate.0, xr));
            let h: Vec<f32> = (0..inter)
                .map(|i| {
                    let g = dot(&row(&shared[0], i), xr);
                    let u = dot(&row(&shared[1], i), xr);
                    clamp_act(g, u, alpha, limit) as f32
                })
                .collect();
            for (o, v) in want.iter_mut().enumerate() {
                *v += gate * dot(&row(&shared[2], o), &h);
            }
            for (o, w) in want.iter().enumerate() {
                let g = got[r * hidden + o] as f64;
                assert!((g - w).abs() < 1e-4 * (1.0 + w.abs()), "row {r} out {o}: {g} vs {w}");
            }
        }
        assert!(clamped, "the limit is crossed");
        assert_eq!(routes.len(), 1, "the routing is recorded");
    }

    /// The shared expert runs the layer's activation too.
    fn clamp_act(g: f64, u: f64, alpha: f32, limit: f32) -> f64 {
        let g = g.min(limit as f64);
        (u.clamp(-limit as f64, limit as f64) + 1.0) * g * sigmoid(alpha as f64 * g)
    }
}
