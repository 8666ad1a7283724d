//! The MoE router (DeepSeek-V3 `noaux_tc`) and the combination of expert outputs.

use super::{CpuBackend, CpuMat, Shared};
use crate::RouterParams;
use strata_kernels::ops::{axpy, sigmoid, top_k_by};
use strata_kernels::pool::Ctx;
use strata_kernels::{Out, Product, Staging};

/// Router logits `x gate^T` (f32, as the reference computes them), then per row: `s =
/// sigmoid(logits)`; the top-k of `s + bias` within the best `topk_group` groups (a
/// group's score is the sum of its two best); weights `s` at the chosen ids, normalised
/// (+1e-20) if asked, times the scaling. Exact ties go to the lower id.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_noaux(
    b: &CpuBackend,
    x: &[f32],
    rows: usize,
    gate: &CpuMat,
    bias: &[f32],
    p: RouterParams,
    logits: &mut [f32],
    ids: &mut [u32],
    weights: &mut [f32],
) {
    let g = gate.q();
    let (n, hidden, k) = (g.rows, g.cols, p.top_k);
    let path = b.path();
    let mut staging = Staging::default();
    staging.prepare(path, &x[..rows * hidden], rows, g.kind, hidden);
    let product = Product::new(path, &x[..rows * hidden], rows, g, &staging);
    let lp = Shared::new(logits.as_mut_ptr());
    let lout = unsafe { Out::raw(lp.ptr(), rows * n, n, false) };
    let (ip, wp) = (Shared::new(ids.as_mut_ptr()), Shared::new(weights.as_mut_ptr()));
    let per_group = n / p.n_group.max(1);
    let body = |c: &Ctx| {
        let r = strata_kernels::output_share(n, c.n, c.id);
        product.run(r.start, r.end, &lout);
        c.barrier();
        for r in c.split(rows) {
            // SAFETY: the logits are complete (barrier); row r's outputs are this thread's.
            let l = unsafe { std::slice::from_raw_parts(lp.ptr().add(r * n), n) };
            let mut scratch = b.scratch(c.id, 2 * n + p.n_group);
            let (s, rest) = scratch.split_at_mut(n);
            let (choice, group_score) = rest.split_at_mut(n);
            for e in 0..n {
                s[e] = sigmoid(l[e]);
                choice[e] = s[e] + bias[e];
            }
            let mut chosen = b.iscratch(c.id, k.max(p.n_group) + 1);
            if p.n_group > 1 {
                // Group scores, then mask every expert outside the best groups.
                for (gi, gs) in group_score.iter_mut().enumerate().take(p.n_group) {
                    let grp = &choice[gi * per_group..(gi + 1) * per_group];
                    let (mut a, mut bb) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                    for &v in grp {
                        if v > a {
                            bb = a;
                            a = v;
                        } else if v > bb {
                            bb = v;
                        }
                    }
                    *gs = a + bb;
                }
                let gsc = &group_score[..p.n_group];
                top_k_by(p.n_group, p.topk_group, &mut chosen, |a, b| gsc[a as usize] > gsc[b as usize]);
                for gi in 0..p.n_group {
                    if !chosen.contains(&(gi as u32)) {
                        choice[gi * per_group..(gi + 1) * per_group].fill(f32::NEG_INFINITY);
                    }
                }
            }
            let choice = &*choice;
            top_k_by(n, k, &mut chosen, |a, b| choice[a as usize] > choice[b as usize]);
            let out_ids = unsafe { ip.slice_mut(r * k, k) };
            let out_w = unsafe { wp.slice_mut(r * k, k) };
            for (i, &e) in chosen.iter().enumerate() {
                out_ids[i] = e;
                out_w[i] = s[e as usize];
            }
            if p.norm_topk_prob {
                let denom = out_w.iter().sum::<f32>() + 1e-20;
                out_w.iter_mut().for_each(|w| *w /= denom);
            }
            out_w.iter_mut().for_each(|w| *w *= p.scaling);
        }
    };
    b.run(rows.min(8) * g.weight_bytes(), &body);
}

/// `out[r] += (sum over r's experts in ascending id of w * y[src[r, rank]]) + shared[r]`
/// (weighed by `sigmoid(gate[r])` where the shared rows have a gate).
#[allow(clippy::too_many_arguments)]
pub(crate) fn combine(
    b: &CpuBackend,
    rows: usize,
    hidden: usize,
    top_k: usize,
    ids: &[u32],
    weights: &[f32],
    src: &[u32],
    y: &[f32],
    shared: Option<crate::SharedRows<'_, CpuBackend>>,
    out: &mut [f32],
) {
    let o = Shared::new(out.as_mut_ptr());
    let body = |c: &Ctx| {
        let mut acc = b.scratch(c.id, hidden);
        let acc = &mut acc[..hidden];
        for r in c.split(rows) {
            // Ranks in ascending expert id (insertion sort: k is small).
            let mut order = [0usize; 64];
            assert!(top_k <= order.len(), "moe_combine: top_k {top_k} above {}", order.len());
            for i in 0..top_k {
                let mut j = i;
                while j > 0 && ids[r * top_k + order[j - 1]] > ids[r * top_k + i] {
                    order[j] = order[j - 1];
                    j -= 1;
                }
                order[j] = i;
            }
            acc.fill(0.0);
            for &rank in &order[..top_k] {
                let at = src[r * top_k + rank] as usize;
                axpy(weights[r * top_k + rank], &y[at * hidden..(at + 1) * hidden], acc);
            }
            if let Some(sh) = shared {
                let row = &y[(sh.row + r) * hidden..(sh.row + r + 1) * hidden];
                match sh.gate {
                    None => acc.iter_mut().zip(row).for_each(|(a, s)| *a += s),
                    Some(g) => {
                        let g = 1.0 / (1.0 + (-g[r]).exp());
                        acc.iter_mut().zip(row).for_each(|(a, s)| *a += g * s);
                    }
                }
            }
            // SAFETY: row r is this thread's.
            let dst = unsafe { o.slice_mut(r * hidden, hidden) };
            for (d, a) in dst.iter_mut().zip(acc.iter()) {
                *d += a;
            }
        }
    };
    b.run(rows * hidden * (top_k + 2) * 4, &body);
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::rand_vec;
    use super::*;
    use crate::SharedRows;

    /// The combine against a plain f64 sum in ascending expert id: routed rows weighed,
    /// the shared row added, or weighed by its gate's sigmoid.
    #[test]
    fn combine_matches_a_plain_reference() {
        let b = CpuBackend::new();
        let (rows, hidden, k) = (4usize, 24usize, 3usize);
        let ids: Vec<u32> = vec![7, 2, 5, 1, 9, 4, 3, 8, 0, 6, 2, 11];
        let src: Vec<u32> = (0..(rows * k) as u32).rev().collect();
        let weights: Vec<f32> = rand_vec(rows * k, 1).iter().map(|v| v.abs() + 0.1).collect();
        let shared = rows * k;
        let y = rand_vec((shared + rows) * hidden, 2);
        let out0 = rand_vec(rows * hidden, 3);
        let gate = rand_vec(rows, 4).iter().map(|v| v * 3.0).collect::<Vec<f32>>();
        for gated in [false, true] {
            let mut out = out0.clone();
            let sh = SharedRows { row: shared, gate: gated.then_some(&gate) };
            combine(&b, rows, hidden, k, &ids, &weights, &src, &y, Some(sh), &mut out);
            for r in 0..rows {
                let g = if gated { 1.0 / (1.0 + (-gate[r] as f64).exp()) } else { 1.0 };
                for c in 0..hidden {
                    let mut want = 0f64;
                    let mut ranks: Vec<usize> = (0..k).collect();
                    ranks.sort_by_key(|&i| ids[r * k + i]);
                    for i in ranks {
                        want += weights[r * k + i] as f64 * y[src[r * k + i] as usize * hidden + c] as f64;
                    }
                    want += g * y[(shared + r) * hidden + c] as f64;
                    let got = (out[r * hidden + c] - out0[r * hidden + c]) as f64;
                    assert!((got - want).abs() < 1e-5, "row {r} col {c} (gated {gated}): {got} vs {want}");
                }
            }
        }
    }
}
