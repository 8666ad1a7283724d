//! Grouped-query attention on the CPU: queries and keys normalised per head (where the
//! family has q/k norms) and rotated (half-split RoPE on the leading `rotary` dims), keys
//! and values cached per position, then causal (optionally windowed) softmax attention
//! of each query head over its KV head's cache (with a per-head sink logit in the
//! softmax where the family has one: gpt-oss).

use super::{CpuBackend, Shared};
use crate::{GqaAttend, GqaPrepare, Step};
use strata_kernels::ops::{axpy, dot, rms_norm_inplace, rope_halves, softmax_inplace, softmax_with_sink};
use strata_kernels::pool::Ctx;

pub(crate) fn prepare(b: &CpuBackend, step: &Step, a: GqaPrepare<'_, CpuBackend>) {
    let d = a.dims;
    let (rows, hd, half) = (step.rows(), d.head_dim, d.rotary / 2);
    let (kvw, width) = (d.kv_heads * hd, d.cache_width());
    let (k, v, cos, sin, eps) = (&a.k[..], &a.v[..], &a.cos[..], &a.sin[..], a.eps);
    let (q_norm, k_norm) = (a.q_norm.map(|w| &w[..]), a.k_norm.map(|w| &w[..]));
    let qp = Shared::new(a.q.as_mut_ptr());
    let cache = Shared::new(a.cache.as_mut_ptr());
    b.run(rows * (d.heads + 2 * d.kv_heads) * hd * 4, &|c: &Ctx| {
        for r in c.split(rows) {
            let (cr, sr) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
            // SAFETY: row r's queries and its cache slot are this thread's.
            let q = unsafe { qp.slice_mut(r * d.heads * hd, d.heads * hd) };
            for head in q.chunks_exact_mut(hd) {
                if let Some(w) = q_norm {
                    rms_norm_inplace(head, Some(w), eps);
                }
                rope_halves(&mut head[..d.rotary], cr, sr);
            }
            let slot = step.slot(r, step.positions[r] as usize);
            let dst = unsafe { cache.slice_mut(slot * width, width) };
            dst[..kvw].copy_from_slice(&k[r * kvw..(r + 1) * kvw]);
            dst[kvw..].copy_from_slice(&v[r * kvw..(r + 1) * kvw]);
            for head in dst[..kvw].chunks_exact_mut(hd) {
                if let Some(w) = k_norm {
                    rms_norm_inplace(head, Some(w), eps);
                }
                rope_halves(&mut head[..d.rotary], cr, sr);
            }
        }
    });
}

pub(crate) fn attend(b: &CpuBackend, step: &Step, a: GqaAttend<'_, CpuBackend>) {
    let d = a.dims;
    let rows = step.rows();
    let (hd, group) = (d.head_dim, d.heads / d.kv_heads.max(1));
    let (kvw, width) = (d.kv_heads * hd, d.cache_width());
    let (q, cache, sinks) = (&a.q[..], &a.cache[..], a.sinks.map(|s| &s[..]));
    if let Some(s) = sinks {
        assert_eq!(s.len(), d.heads, "gqa_attend: {} sinks for {} heads", s.len(), d.heads);
    }
    let out = Shared::new(a.out.as_mut_ptr());
    // A window bounds what a row sees from below, by its own position (rows that also see
    // later rows of their image block keep that bound).
    let seen = |r: usize| {
        let own = step.positions[r] as usize + 1;
        d.window.map_or(0, |w| own.saturating_sub(w))..step.visible(r)
    };
    let work = rows * d.heads * hd * 4 * seen(rows.saturating_sub(1)).len().max(1) / group.max(1);
    b.run(work, &|c: &Ctx| {
        // (row, KV head) pairs: each key and value is loaded once for the group's heads.
        for item in c.split(rows * d.kv_heads) {
            let (r, g) = (item / d.kv_heads, item % d.kv_heads);
            let span = seen(r);
            let n = span.len();
            let mut scores = b.scratch(c.id, group * n);
            for (i, t) in span.clone().enumerate() {
                let key = &cache[step.slot(r, t) * width + g * hd..][..hd];
                for j in 0..group {
                    let h = g * group + j;
                    scores[j * n + i] = dot(&q[(r * d.heads + h) * hd..][..hd], key) * d.scale;
                }
            }
            for j in 0..group {
                let head = &mut scores[j * n..(j + 1) * n];
                match sinks {
                    Some(s) => softmax_with_sink(head, s[g * group + j]),
                    None => _ = softmax_inplace(head),
                }
                // SAFETY: (row, head) outputs of this KV head are this thread's.
                unsafe { out.slice_mut((r * d.heads + g * group + j) * hd, hd) }.fill(0.0);
            }
            for (i, t) in span.enumerate() {
                let value = &cache[step.slot(r, t) * width + kvw + g * hd..][..hd];
                for j in 0..group {
                    let dst = unsafe { out.slice_mut((r * d.heads + g * group + j) * hd, hd) };
                    axpy(scores[j * n + i], value, dst);
                }
            }
        }
    });
}
