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

/// `out[r] += (sum over r's experts in ascending id of w * y[src[r, rank]]) + shared[r]`.
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
    shared: Option<usize>,
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
                for (a, s) in acc.iter_mut().zip(&y[(sh + r) * hidden..(sh + r + 1) * hidden]) {
                    *a += s;
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
