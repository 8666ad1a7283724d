//! Softmax routing on the CPU: the router logits as one product (plus the router's bias,
//! where it has one),
//! then per row the softmax, the top-k probabilities (exact ties to the lower id), their
//! renormalisation (where asked) and a per-expert scale.

use super::{CpuBackend, CpuMat, Shared};
use strata_kernels::ops::{softmax_inplace, top_k_by};
use strata_kernels::pool::Ctx;
use strata_kernels::{Out, Product, Staging};

#[allow(clippy::too_many_arguments)]
pub(crate) fn route_softmax(
    b: &CpuBackend,
    x: &[f32],
    rows: usize,
    gate: &CpuMat,
    gate_bias: Option<&[f32]>,
    expert_scale: &[f32],
    routing: crate::SoftmaxRouting,
    logits: &mut [f32],
    ids: &mut [u32],
    weights: &mut [f32],
) {
    let g = gate.q();
    let (n, hidden, k) = (g.rows, g.cols, routing.top_k);
    assert!(k > 0 && k <= n, "route_softmax: top_k {k} outside 1..={n}");
    assert_eq!(expert_scale.len(), n, "route_softmax: {} expert scales for {n} experts", expert_scale.len());
    assert!(gate_bias.is_none_or(|v| v.len() == n), "route_softmax: a router bias of another length than {n}");
    assert!(logits.len() >= rows * n && ids.len() >= rows * k && weights.len() >= rows * k);
    let path = b.path();
    let mut staging = Staging::default();
    staging.prepare(path, &x[..rows * hidden], rows, g.kind, hidden);
    let product = Product::new(path, &x[..rows * hidden], rows, g, &staging);
    let lp = Shared::new(logits.as_mut_ptr());
    // SAFETY: each thread writes its own output columns below.
    let lout = unsafe { Out::raw(lp.ptr(), rows * n, n, false) };
    let (ip, wp) = (Shared::new(ids.as_mut_ptr()), Shared::new(weights.as_mut_ptr()));
    let body = |c: &Ctx| {
        let r = strata_kernels::output_share(n, c.n, c.id);
        product.run(r.start, r.end, &lout);
        c.barrier();
        for r in c.split(rows) {
            let mut probs = b.scratch(c.id, n);
            let p = &mut probs[..n];
            // SAFETY: the logits are complete (barrier); row r's outputs are this thread's.
            let row = unsafe { lp.slice_mut(r * n, n) };
            if let Some(bias) = gate_bias {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
            p.copy_from_slice(row);
            softmax_inplace(p);
            let p = &*p;
            let mut chosen = b.iscratch(c.id, k + 1);
            top_k_by(n, k, &mut chosen, |a, b| p[a as usize] > p[b as usize]);
            let out_ids = unsafe { ip.slice_mut(r * k, k) };
            let out_w = unsafe { wp.slice_mut(r * k, k) };
            let mut sum = 0f32;
            for (i, &e) in chosen.iter().enumerate() {
                out_ids[i] = e;
                out_w[i] = p[e as usize];
                sum += out_w[i];
            }
            for (w, &e) in out_w.iter_mut().zip(out_ids.iter()) {
                let p = if routing.renormalize { *w / sum } else { *w };
                *w = p * expert_scale[e as usize];
            }
        }
    };
    b.run(rows.min(8) * g.weight_bytes(), &body);
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::rand_vec;
    use super::*;
    use crate::{Backend, HostMatrix};

    #[test]
    fn softmax_routing_matches_a_plain_reference() {
        let b = CpuBackend::new();
        let (rows, hidden, n, k) = (5usize, 40usize, 12usize, 3usize);
        let x = rand_vec(rows * hidden, 1);
        let w: Vec<f32> = rand_vec(n * hidden, 2).iter().map(|v| v * 2.0).collect();
        let scale: Vec<f32> = rand_vec(n, 3).iter().map(|v| 1.0 + v * 0.5).collect();
        let gate = b.matrix(HostMatrix::f32(n, hidden, &w)).unwrap();
        // gpt-oss's router adds a bias to the logits.
        let bias: Vec<f32> = rand_vec(n, 4).iter().map(|v| v * 3.0).collect();
        for (renormalize, with_bias) in [(true, false), (false, false), (true, true)] {
            let (mut logits, mut ids, mut weights) = (vec![0f32; rows * n], vec![0u32; rows * k], vec![0f32; rows * k]);
            let routing = crate::SoftmaxRouting { top_k: k, renormalize };
            let gb = with_bias.then_some(&bias[..]);
            route_softmax(&b, &x, rows, &gate, gb, &scale, routing, &mut logits, &mut ids, &mut weights);
            for r in 0..rows {
                let l: Vec<f64> = (0..n)
                    .map(|e| {
                        let dot: f64 = (0..hidden).map(|i| x[r * hidden + i] as f64 * w[e * hidden + i] as f64).sum();
                        dot + if with_bias { bias[e] as f64 } else { 0.0 }
                    })
                    .collect();
                for (e, want) in l.iter().enumerate() {
                    assert!((logits[r * n + e] as f64 - want).abs() < 1e-4, "row {r} logit {e}");
                }
                let m = l.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = l.iter().map(|v| (v - m).exp()).sum();
                let p: Vec<f64> = l.iter().map(|v| (v - m).exp() / z).collect();
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|a, b| p[*b].partial_cmp(&p[*a]).unwrap());
                let top = &order[..k];
                let s: f64 = if renormalize { top.iter().map(|&e| p[e]).sum() } else { 1.0 };
                assert!(s < 1.0 || !renormalize, "the top {k} of {n} do not hold all the mass");
                for (i, &e) in top.iter().enumerate() {
                    assert_eq!(ids[r * k + i] as usize, e, "row {r} rank {i}");
                    let want = p[e] / s * scale[e] as f64;
                    assert!((weights[r * k + i] as f64 - want).abs() < 1e-5, "row {r} rank {i} ({renormalize})");
                }
            }
        }
    }
}
