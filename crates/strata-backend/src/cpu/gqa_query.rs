//! The query half of grouped-query attention's preparation on the CPU: each head
//! normalised (with `q_norm`) and rotated, for a layer that attends to another layer's
//! K/V cache (Gemma 4's KV sharing). Same arithmetic as the query part of
//! [`super::gqa::prepare`].

use super::{CpuBackend, Shared};
use crate::{GqaQuery, Step};
use strata_kernels::ops::{rms_norm_inplace, rope_halves};
use strata_kernels::pool::Ctx;

pub(crate) fn query(b: &CpuBackend, step: &Step, a: GqaQuery<'_, CpuBackend>) {
    let d = a.dims;
    let (rows, hd, half) = (step.rows(), d.head_dim, d.rotary / 2);
    let (cos, sin, eps) = (&a.cos[..], &a.sin[..], a.eps);
    let q_norm = a.q_norm.map(|w| &w[..]);
    let qp = Shared::new(a.q.as_mut_ptr());
    b.run(rows * d.heads * hd * 4, &|c: &Ctx| {
        for r in c.split(rows) {
            let (cr, sr) = (&cos[r * half..(r + 1) * half], &sin[r * half..(r + 1) * half]);
            // SAFETY: row r's queries are this thread's.
            let q = unsafe { qp.slice_mut(r * d.heads * hd, d.heads * hd) };
            for head in q.chunks_exact_mut(hd) {
                if let Some(w) = q_norm {
                    rms_norm_inplace(head, Some(w), eps);
                }
                rope_halves(&mut head[..d.rotary], cr, sr);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::tests_support::rand_vec;
    use super::*;
    use crate::{Backend, GqaDims, GqaPrepare};

    /// The queries come out as `gqa_prepare` leaves them, bit for bit.
    #[test]
    fn queries_equal_the_prepare_path() {
        let b = CpuBackend::new();
        let d = GqaDims { heads: 4, kv_heads: 2, head_dim: 16, rotary: 16, scale: 1.0, window: None };
        let rows = 3;
        let mut step = Step { block_size: 16, max_blocks: 1, ..Default::default() };
        for r in 0..rows {
            step.tokens.push(r as u32);
            step.positions.push(5 + r as u32);
            step.seq.push(0);
        }
        step.blocks.push(0);
        let inv = strata_kernels::ops::rope_inv_freq(16, 10000.0);
        let (mut cos, mut sin) = (vec![0f32; rows * 8], vec![0f32; rows * 8]);
        b.rope_tables(&step, &inv, &mut cos, &mut sin);
        let q0 = rand_vec(rows * 64, 7);
        let norm = rand_vec(16, 8);
        let (k, v) = (rand_vec(rows * 32, 9), rand_vec(rows * 32, 10));
        let mut cache = vec![0f32; 16 * d.cache_width()];
        let mut q1 = q0.clone();
        let p = GqaPrepare {
            dims: d,
            q: &mut q1,
            k: &k,
            v: &v,
            q_norm: Some(&norm),
            k_norm: None,
            eps: 1e-6,
            cos: &cos,
            sin: &sin,
            cache: &mut cache,
        };
        b.gqa_prepare(&step, p);
        let mut q2 = q0.clone();
        b.gqa_query(&step, GqaQuery { dims: d, q: &mut q2, q_norm: Some(&norm), eps: 1e-6, cos: &cos, sin: &sin });
        assert_eq!(q1, q2);
        assert_ne!(q2, q0);
    }
}
