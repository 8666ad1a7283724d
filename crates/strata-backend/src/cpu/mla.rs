//! MLA attention with DeepSeek Sparse Attention on the CPU.
//!
//! The cache holds, per position, the normalised latent (`kv_lora`) followed by the
//! rotated shared key (`rope`). `kv_b_proj` is absorbed: each head's query is mapped onto
//! the latent (`q_nope W_uk`, a product with the transposed key half), so a score is one
//! dot product of width `kv_lora + rope` per position; the head's output over the latent
//! goes through the value half (`W_uv`) afterwards. Same function as transformers'
//! expand-then-attend (the parity tests prove it).

use super::{row_view, CpuBackend, Shared};
use crate::{Backend, DsaSelect, MlaAbsorb, MlaAttend, MlaPrepare, Selection, Step};
use strata_kernels::ops::{
    axpy, dot, layer_norm_inplace, rms_norm, rms_norm_inplace, rope_interleaved, softmax_inplace,
};
use strata_kernels::pool::Ctx;
use strata_kernels::{matmul_t, Out, Product, Staging};

/// Per-thread f32 scratch attention needs: one score per (head, position).
pub(crate) fn attend_scratch(heads: usize, positions: usize) -> usize {
    heads * positions.max(1)
}

/// Rows absorbed together per head (the key half of `kv_b` is decoded once per chunk).
const ABSORB_ROWS: usize = 16;

pub(crate) fn prepare(b: &CpuBackend, step: &Step, a: MlaPrepare<'_, CpuBackend>) {
    let d = a.dims;
    let (rows, kw, half) = (step.rows(), d.key_width(), d.rope / 2);
    let (q_lora, kv_lora, eps) = (a.q_lora, d.kv_lora, a.eps);
    let (q_norm, kv_a, kv_norm, cos, sin) = (&a.q_norm[..], &a.kv_a[..], &a.kv_norm[..], &a.cos[..], &a.sin[..]);
    let qa = Shared::new(a.q_a.as_mut_ptr());
    let cache = Shared::new(a.cache.as_mut_ptr());
    let body = |c: &Ctx| {
        for r in c.split(rows) {
            // SAFETY: row r's query state and its cache slot are this thread's (rows of a
            // step have distinct (sequence, position)).
            let q = unsafe { qa.slice_mut(r * q_lora, q_lora) };
            rms_norm_inplace(q, Some(q_norm), eps);
            let slot = step.slot(r, step.positions[r] as usize);
            let dst = unsafe { cache.slice_mut(slot * kw, kw) };
            let src = &kv_a[r * kw..(r + 1) * kw];
            rms_norm(&src[..kv_lora], Some(kv_norm), eps, &mut dst[..kv_lora]);
            dst[kv_lora..].copy_from_slice(&src[kv_lora..]);
            rope_interleaved(&mut dst[kv_lora..], &cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
        }
    };
    b.run(rows * (q_lora + 2 * kw) * 4, &body);
}

pub(crate) fn absorb(b: &CpuBackend, step: &Step, a: MlaAbsorb<'_, CpuBackend>) {
    let d = a.dims;
    let rows = step.rows();
    let (kw, half, qw) = (d.key_width(), d.rope / 2, d.nope + d.rope);
    let (q, cos, sin) = (&a.q[..], &a.cos[..], &a.sin[..]);
    let kv_b = a.kv_b.q();
    let qf = Shared::new(a.q_full.as_mut_ptr());
    let chunks = rows.div_ceil(ABSORB_ROWS);
    let items = d.heads * chunks;
    let work = d.heads * d.nope * d.kv_lora * 2 * rows.min(ABSORB_ROWS);
    b.run(work, &|c: &Ctx| {
        let mut scratch = b.scratch(c.id, ABSORB_ROWS * (d.nope + d.kv_lora));
        let (xs, ys) = scratch.split_at_mut(ABSORB_ROWS * d.nope);
        for item in c.split(items) {
            let (h, chunk) = (item / chunks, item % chunks);
            let r0 = chunk * ABSORB_ROWS;
            let n = (rows - r0).min(ABSORB_ROWS);
            let uk = row_view(&kv_b, h * (d.nope + d.v), h * (d.nope + d.v) + d.nope);
            for i in 0..n {
                let src = &q[(r0 + i) * d.heads * qw + h * qw..][..qw];
                xs[i * d.nope..(i + 1) * d.nope].copy_from_slice(&src[..d.nope]);
                // SAFETY: (row, head) pairs are this thread's.
                let dst = unsafe { qf.slice_mut(((r0 + i) * d.heads + h) * kw, kw) };
                dst[d.kv_lora..].copy_from_slice(&src[d.nope..]);
                let r = r0 + i;
                rope_interleaved(&mut dst[d.kv_lora..], &cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
            }
            matmul_t(&xs[..n * d.nope], n, &uk, &mut ys[..n * d.kv_lora]);
            for i in 0..n {
                let dst = unsafe { qf.slice_mut(((r0 + i) * d.heads + h) * kw, d.kv_lora) };
                dst.copy_from_slice(&ys[i * d.kv_lora..(i + 1) * d.kv_lora]);
            }
        }
    });
}

pub(crate) fn dsa_select(b: &CpuBackend, step: &Step, a: DsaSelect<'_, CpuBackend>) {
    let d = a.dims;
    let rows = step.rows();
    let (dim, half, eps) = (d.dim, d.rope / 2, a.eps);
    let (kw_, kb_, wts, cos, sin) = (&a.k_norm_w[..], &a.k_norm_b[..], &a.w[..], &a.cos[..], &a.sin[..]);
    let cache_len = a.cache.len();
    let (qp, kp, cache) =
        (Shared::new(a.q.as_mut_ptr()), Shared::new(a.k.as_mut_ptr()), Shared::new(a.cache.as_mut_ptr()));
    let select = a.select;
    let positions = if select { step.max_visible() } else { 0 };
    assert!(a.work.len() >= rows * positions, "dsa_select: scores scratch too small");
    let (work, sel, cnt) =
        (Shared::new(a.work.as_mut_ptr()), Shared::new(a.selected.as_mut_ptr()), Shared::new(a.counts.as_mut_ptr()));
    let (wscale, dscale) = ((d.heads as f32).powf(-0.5), (dim as f32).powf(-0.5));
    let topk = d.topk;
    let by_rows = rows >= b.parallelism();
    let cost = rows * (d.heads * dim * 4 + positions * (dim * 4 + d.heads * 8));
    b.run(cost, &|c: &Ctx| {
        // Keys into the cache, queries rotated.
        for r in c.split(rows) {
            let (cr, sr) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
            // SAFETY: row r is this thread's; its cache slot too.
            let k = unsafe { kp.slice_mut(r * dim, dim) };
            layer_norm_inplace(k, kw_, kb_, eps);
            rope_interleaved(&mut k[..d.rope], cr, sr);
            let slot = step.slot(r, step.positions[r] as usize);
            unsafe { cache.slice_mut(slot * dim, dim) }.copy_from_slice(k);
            let q = unsafe { qp.slice_mut(r * d.heads * dim, d.heads * dim) };
            for h in 0..d.heads {
                rope_interleaved(&mut q[h * dim..h * dim + d.rope], cr, sr);
            }
        }
        if !select {
            return;
        }
        c.barrier();
        // Scores: whole rows per thread when there are enough rows, else each row's
        // positions split over the threads.
        // SAFETY: the keys were written in the first stage; read-only now.
        let cache_r = unsafe { std::slice::from_raw_parts(cache.ptr(), cache_len) };
        let q_all = unsafe { std::slice::from_raw_parts(qp.ptr(), rows * d.heads * dim) };
        let score_rows = |r: usize, t0: usize, t1: usize| {
            let q = &q_all[r * d.heads * dim..(r + 1) * d.heads * dim];
            let w = &wts[r * d.heads..(r + 1) * d.heads];
            for t in t0..t1 {
                let key = &cache_r[step.slot(r, t) * dim..][..dim];
                let mut acc = 0f32;
                for h in 0..d.heads {
                    acc += (w[h] * wscale) * (dot(&q[h * dim..(h + 1) * dim], key).max(0.0) * dscale);
                }
                // SAFETY: (row, position) scores are this thread's.
                unsafe { *work.ptr().add(r * positions + t) = acc };
            }
        };
        for r in 0..rows {
            let v = step.visible(r);
            if v <= topk {
                continue;
            }
            if by_rows {
                if c.split(rows).contains(&r) {
                    score_rows(r, 0, v);
                }
            } else {
                let part = c.split(v);
                score_rows(r, part.start, part.end);
            }
        }
        c.barrier();
        // Selection: the top-k positions of each row (ties to the earlier position), in
        // ascending order.
        for r in c.split(rows) {
            let v = step.visible(r);
            let out = unsafe { sel.slice_mut(r * topk, topk) };
            if v <= topk {
                for (i, o) in out.iter_mut().enumerate().take(v) {
                    *o = i as u32;
                }
                unsafe { *cnt.ptr().add(r) = v as u32 };
                continue;
            }
            let scores = unsafe { std::slice::from_raw_parts(work.ptr().add(r * positions), v) };
            let mut idx = b.iscratch(c.id, v);
            let idx = &mut idx[..v];
            for (i, x) in idx.iter_mut().enumerate() {
                *x = i as u32;
            }
            idx.select_nth_unstable_by(topk - 1, |&x, &y| {
                scores[y as usize].total_cmp(&scores[x as usize]).then(x.cmp(&y))
            });
            let chosen = &mut idx[..topk];
            chosen.sort_unstable();
            out.copy_from_slice(chosen);
            unsafe { *cnt.ptr().add(r) = topk as u32 };
        }
    });
}

pub(crate) fn attend(b: &CpuBackend, step: &Step, a: MlaAttend<'_, CpuBackend>) {
    let d = a.dims;
    let rows = step.rows();
    let kw = d.key_width();
    let (q_full, cache, selected, counts) = (&a.q_full[..], &a.cache[..], &a.selected[..], &a.counts[..]);
    let (selection, topk, scale) = (a.selection, a.topk, d.scale);
    let lat = Shared::new(a.latent_out.as_mut_ptr());
    let out = Shared::new(a.out.as_mut_ptr());
    let out_len = a.out.len();
    let kv_b = a.kv_b.q();
    let path = b.path();
    let attended = match selection {
        Selection::Dense => step.max_visible(),
        Selection::Sparse => topk,
    };
    let work = rows * d.heads * attended * kw * 4 / 4 + d.heads * d.v * d.kv_lora * 2;
    b.run(work, &|c: &Ctx| {
        // Scores, softmax and the weighted latent for this thread's (row, head) pairs;
        // each key is loaded once for all of a row's heads here.
        let items = c.split(rows * d.heads);
        let mut r = items.start / d.heads.max(1);
        while r * d.heads < items.end {
            let h0 = (r * d.heads).max(items.start) - r * d.heads;
            let h1 = ((r + 1) * d.heads).min(items.end) - r * d.heads;
            let nh = h1 - h0;
            let positions: &[u32] = match selection {
                Selection::Sparse => &selected[r * topk..r * topk + counts[r] as usize],
                Selection::Dense => &[],
            };
            let n = if selection == Selection::Dense { step.visible(r) } else { positions.len() };
            let pos_at = |i: usize| if selection == Selection::Dense { i } else { positions[i] as usize };
            let mut scores = b.scratch(c.id, nh * n);
            for i in 0..n {
                let key = &cache[step.slot(r, pos_at(i)) * kw..][..kw];
                for h in h0..h1 {
                    let q = &q_full[(r * d.heads + h) * kw..][..kw];
                    scores[(h - h0) * n + i] = dot(q, key) * scale;
                }
            }
            for h in 0..nh {
                softmax_inplace(&mut scores[h * n..(h + 1) * n]);
            }
            for h in h0..h1 {
                // SAFETY: (head, row) latent outputs are this thread's.
                unsafe { lat.slice_mut((h * rows + r) * d.kv_lora, d.kv_lora) }.fill(0.0);
            }
            for i in 0..n {
                let key = &cache[step.slot(r, pos_at(i)) * kw..][..d.kv_lora];
                for h in h0..h1 {
                    let dst = unsafe { lat.slice_mut((h * rows + r) * d.kv_lora, d.kv_lora) };
                    axpy(scores[(h - h0) * n + i], key, dst);
                }
            }
            r += 1;
        }
        c.barrier();
        // Each head's value projection over all rows: out[r, h*v + o].
        let total = d.heads * d.v;
        let mine = c.split_aligned(total, 8);
        let mut staging = Staging::default();
        let mut h = mine.start / d.v.max(1);
        while h * d.v < mine.end {
            let (o0, o1) = (mine.start.max(h * d.v) - h * d.v, mine.end.min((h + 1) * d.v) - h * d.v);
            let uv = row_view(&kv_b, h * (d.nope + d.v) + d.nope, (h + 1) * (d.nope + d.v));
            // SAFETY: written in the first stage, read-only now.
            let x = unsafe { std::slice::from_raw_parts(lat.ptr().add(h * rows * d.kv_lora), rows * d.kv_lora) };
            staging.prepare(path, x, rows, uv.kind, uv.cols);
            let dst = unsafe { Out::raw(out.ptr().add(h * d.v), out_len - h * d.v, d.heads * d.v, false) };
            Product::new(path, x, rows, uv, &staging).run(o0, o1, &dst);
            h += 1;
        }
    });
}
