//! Rotary tables, MLA (prepare, absorb, attend), the DSA indexer, GQA.

use super::*;

pub(crate) fn cuda_rope_and_mla_prepare_match_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(3);
    let d = MlaDims { heads: 3, nope: 16, rope: 8, v: 12, kv_lora: 40, scale: 0.2 };
    let (q_lora, kw) = (24, d.key_width());
    for (step, slots) in steps(&mut rng) {
        let rows = step.rows();
        let inv = rope_inv(d.rope);
        let qa = rvec(&mut rng, rows * q_lora, 2.0);
        let qn = rvec(&mut rng, q_lora, 1.0);
        let kva = rvec(&mut rng, rows * kw, 2.0);
        let kvn = rvec(&mut rng, d.kv_lora, 1.0);
        let cache0 = rvec(&mut rng, slots * kw, 1.0);
        fn run<B: Backend>(
            b: &B,
            step: &Step,
            d: MlaDims,
            inv: &[f32],
            v: [&[f32]; 5],
            q_lora: usize,
        ) -> [Vec<f32>; 4] {
            let rows = step.rows();
            let mut cos = b.alloc(rows * d.rope / 2).unwrap();
            let mut sin = b.alloc(rows * d.rope / 2).unwrap();
            b.rope_tables(step, inv, &mut cos, &mut sin);
            let (mut qa, qn, kva, kvn, mut cache) = (up(b, v[0]), up(b, v[1]), up(b, v[2]), up(b, v[3]), up(b, v[4]));
            b.mla_prepare(
                step,
                MlaPrepare {
                    dims: d,
                    q_a: &mut qa,
                    q_lora,
                    q_norm: &qn,
                    kv_a: &kva,
                    kv_norm: &kvn,
                    eps: 1e-6,
                    cos: &cos,
                    sin: &sin,
                    cache: &mut cache,
                },
            );
            let n = rows * d.rope / 2;
            [down(b, &cos, n), down(b, &sin, n), down(b, &qa, rows * q_lora), down(b, &cache, v[4].len())]
        }
        let v = [&qa[..], &qn[..], &kva[..], &kvn[..], &cache0[..]];
        let gv = run(g, &step, d, &inv, v, q_lora);
        let cv = run(c, &step, d, &inv, v, q_lora);
        assert_eq!(gv[0], cv[0], "rope cos tables");
        assert_eq!(gv[1], cv[1], "rope sin tables");
        close("mla_prepare q_a", &gv[2], &cv[2], 1e-6, 2e-6);
        close("mla_prepare cache", &gv[3], &cv[3], 1e-6, 2e-6);
        assert_ne!(gv[3], cache0, "mla_prepare wrote nothing");
    }
}

pub(crate) fn cuda_mla_absorb_and_attend_match_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(4);
    let small = MlaDims { heads: 3, nope: 16, rope: 8, v: 12, kv_lora: 40, scale: 0.3 };
    // Decode-sized: one row takes the vector-load absorb, and the per-head value
    // projections are enough outputs for the one-row projection kernel.
    let large = MlaDims { heads: 8, nope: 32, rope: 8, v: 600, kv_lora: 512, scale: 0.05 };
    let fp8 = |block_cols| QuantKind::Fp8 { block_rows: 4, block_cols };
    // (dims, encodings, absolute tolerance: the value projections sum kv_lora terms, and
    // with many rows cuBLAS's bf16 products accumulate in another order, so a small output
    // that cancels is off by ~eps times the sum of |terms|)
    // Two groups of 16 heads (the second partial) for the tiled many-row kernel.
    let wide = MlaDims { heads: 20, nope: 16, rope: 8, v: 24, kv_lora: 64, scale: 0.1 };
    let cases = [
        (small, vec![QuantKind::F32, QuantKind::Bf16, fp8(8), QuantKind::Int8Row], 2e-6),
        (large, vec![QuantKind::Bf16, fp8(16), QuantKind::Int8Row, QuantKind::int4(32)], 2e-5),
        (wide, vec![QuantKind::Bf16], 2e-6),
    ];
    for (d, kind, atol) in cases.iter().flat_map(|(d, kinds, atol)| kinds.iter().map(move |k| (*d, *k, *atol))) {
        let kw = d.key_width();
        // Beside the decode-like and short prefill steps, a long one: 48 rows of two
        // sequences seeing up to 100 positions (tiles of 32 keys, the last partial), its
        // sparse rows selecting up to 40.
        let long: Vec<(u32, u32)> = (60..100).map(|p| (0, p)).chain((0..8).map(|p| (1, p))).collect();
        let mut all = steps(&mut rng);
        all.push(make_step(&mut rng, &long, 64));
        for (step, slots) in all {
            let rows = step.rows();
            let topk = if rows >= 40 { 40 } else { 6 };
            let (kvb, _) = hostmat(&mut rng, kind, d.heads * (d.nope + d.v), d.kv_lora, 0.5);
            let kvb = kvb.with_row_scales();
            let q = rvec(&mut rng, rows * d.heads * (d.nope + d.rope), 1.0);
            let qf = rvec(&mut rng, rows * d.heads * kw, 1.0);
            let cache = rvec(&mut rng, slots * kw, 1.0);
            // A sorted selection of distinct visible positions per row.
            let mut sel = vec![0u32; rows * topk];
            let mut cnt = vec![0u32; rows];
            for r in 0..rows {
                let v = step.visible(r);
                let mut all: Vec<u32> = (0..v as u32).collect();
                for i in (1..all.len()).rev() {
                    all.swap(i, rng.random_range(0..=i));
                }
                let n = v.min(topk);
                let mut s = all[..n].to_vec();
                s.sort_unstable();
                sel[r * topk..r * topk + n].copy_from_slice(&s);
                cnt[r] = n as u32;
            }
            fn run<B: Backend>(
                b: &B,
                step: &Step,
                d: MlaDims,
                kvb: &HostMatrix,
                q: &[f32],
                qf_in: &[f32],
                cache: &[f32],
                sel: &[u32],
                cnt: &[u32],
                topk: usize,
            ) -> Vec<Vec<f32>> {
                let rows = step.rows();
                let kw = d.key_width();
                let mut cos = b.alloc(rows * d.rope / 2).unwrap();
                let mut sin = b.alloc(rows * d.rope / 2).unwrap();
                b.rope_tables(step, &rope_inv(d.rope), &mut cos, &mut sin);
                let w = b.matrix(kvb.clone()).unwrap();
                let qb = up(b, q);
                let mut qf = up(b, &vec![f32::NAN; rows * d.heads * kw]);
                b.mla_absorb(step, MlaAbsorb { dims: d, q: &qb, kv_b: &w, cos: &cos, sin: &sin, q_full: &mut qf });
                let mut out = vec![down(b, &qf, rows * d.heads * kw)];
                let (qf2, cb) = (up(b, qf_in), up(b, cache));
                let mut sb = b.alloc_idx(sel.len()).unwrap();
                b.write_idx(&mut sb, 0, sel);
                let mut nb = b.alloc_idx(cnt.len()).unwrap();
                b.write_idx(&mut nb, 0, cnt);
                for selection in [Selection::Dense, Selection::Sparse] {
                    let mut lat = up(b, &vec![f32::NAN; d.heads * rows * d.kv_lora]);
                    let mut o = up(b, &vec![f32::NAN; rows * d.heads * d.v]);
                    b.mla_attend(
                        step,
                        MlaAttend {
                            dims: d,
                            q_full: &qf2,
                            cache: &cb,
                            selection,
                            selected: &sb,
                            counts: &nb,
                            topk,
                            kv_b: &w,
                            latent_out: &mut lat,
                            out: &mut o,
                        },
                    );
                    out.push(down(b, &lat, d.heads * rows * d.kv_lora));
                    out.push(down(b, &o, rows * d.heads * d.v));
                }
                out
            }
            let gv = run(g, &step, d, &kvb, &q, &qf, &cache, &sel, &cnt, topk);
            let cv = run(c, &step, d, &kvb, &q, &qf, &cache, &sel, &cnt, topk);
            let names = ["absorb q_full", "dense latent", "dense out", "sparse latent", "sparse out"];
            for (i, name) in names.iter().enumerate() {
                close(&format!("mla {name} ({}, {rows} rows)", kind.name()), &gv[i], &cv[i], atol, 2e-5);
            }
        }
    }
}

pub(crate) fn cuda_dsa_select_matches_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(5);
    let ix = IndexDims { heads: 5, dim: 24, rope: 8, topk: 8 };
    for (step, slots) in steps(&mut rng) {
        let rows = step.rows();
        let q = rvec(&mut rng, rows * ix.heads * ix.dim, 1.0);
        let w = rvec(&mut rng, rows * ix.heads, 1.0);
        let k = rvec(&mut rng, rows * ix.dim, 2.0);
        let (knw, knb) = (rvec(&mut rng, ix.dim, 1.0), rvec(&mut rng, ix.dim, 0.5));
        let cache = rvec(&mut rng, slots * ix.dim, 1.0);
        let positions = step.max_visible();
        for select in [false, true] {
            fn run<B: Backend>(
                b: &B,
                step: &Step,
                ix: IndexDims,
                v: [&[f32]; 6],
                select: bool,
            ) -> (Vec<Vec<f32>>, Vec<u32>, Vec<u32>) {
                let rows = step.rows();
                let positions = step.max_visible();
                let mut cos = b.alloc(rows * ix.rope / 2).unwrap();
                let mut sin = b.alloc(rows * ix.rope / 2).unwrap();
                b.rope_tables(step, &rope_inv(ix.rope), &mut cos, &mut sin);
                let (mut q, wb, mut k, knw, knb, mut cache) =
                    (up(b, v[0]), up(b, v[1]), up(b, v[2]), up(b, v[3]), up(b, v[4]), up(b, v[5]));
                let mut sel = b.alloc_idx(rows * ix.topk).unwrap();
                let mut cnt = b.alloc_idx(rows).unwrap();
                let mut work = up(b, &vec![-7.0; rows * positions]);
                b.dsa_select(
                    step,
                    DsaSelect {
                        dims: ix,
                        q: &mut q,
                        w: &wb,
                        k: &mut k,
                        k_norm_w: &knw,
                        k_norm_b: &knb,
                        eps: 1e-6,
                        cos: &cos,
                        sin: &sin,
                        cache: &mut cache,
                        select,
                        selected: &mut sel,
                        counts: &mut cnt,
                        work: &mut work,
                    },
                );
                let f = vec![
                    down(b, &q, v[0].len()),
                    down(b, &k, v[2].len()),
                    down(b, &cache, v[5].len()),
                    down(b, &work, rows * positions),
                ];
                (f, down_idx(b, &sel, rows * ix.topk), down_idx(b, &cnt, rows))
            }
            let v = [&q[..], &w[..], &k[..], &knw[..], &knb[..], &cache[..]];
            let (gf, gs, gc) = run(g, &step, ix, v, select);
            let (cf, cs, cc) = run(c, &step, ix, v, select);
            close("dsa q (rotated)", &gf[0], &cf[0], 1e-6, 2e-6);
            close("dsa k (normed, rotated)", &gf[1], &cf[1], 2e-6, 1e-5);
            close("dsa key cache", &gf[2], &cf[2], 2e-6, 1e-5);
            if !select {
                continue;
            }
            assert_eq!(gc, cc, "dsa counts");
            for r in 0..rows {
                let v = step.visible(r);
                if v <= ix.topk {
                    // Every visible position is selected; the CPU backend does not score
                    // such a row (its scratch row is left as it was), so only the
                    // selection is compared.
                    let n = cc[r] as usize;
                    assert_eq!(&gs[r * ix.topk..r * ix.topk + n], &cs[r * ix.topk..r * ix.topk + n], "dsa row {r}");
                    continue;
                }
                // Scores of the visible positions (the rest of the row is scratch).
                let (gsr, csr) = (&gf[3][r * positions..r * positions + v], &cf[3][r * positions..r * positions + v]);
                close(&format!("dsa scores row {r}"), gsr, csr, 1e-5, 1e-5);
                let n = cc[r] as usize;
                let (a, b) = (&gs[r * ix.topk..r * ix.topk + n], &cs[r * ix.topk..r * ix.topk + n]);
                assert!(a.windows(2).all(|p| p[0] < p[1]), "dsa row {r}: selection not ascending: {a:?}");
                if a != b {
                    // Only a near-tie at the boundary may differ.
                    let mut sorted: Vec<f32> = csr.to_vec();
                    sorted.sort_by(|x, y| y.total_cmp(x));
                    let kth = sorted[ix.topk - 1];
                    for p in a.iter().filter(|p| !b.contains(p)).chain(b.iter().filter(|p| !a.contains(p))) {
                        let s = csr[*p as usize];
                        assert!((s - kth).abs() <= 1e-5 * (1.0 + kth.abs()), "dsa row {r}: {a:?} vs cpu {b:?}");
                    }
                }
            }
        }
    }
}

pub(crate) fn cuda_gqa_matches_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(6);
    // Gemma 4's shapes too: sliding heads of 256, full heads of 512 with a quarter rotated.
    for (heads, kv_heads, hd, rotary, window, norms) in [
        (4, 2, 16, 8, None, true),
        (6, 3, 40, 40, Some(5), false),
        (2, 1, 128, 64, None, true),
        (4, 2, 256, 256, Some(7), true),
        (4, 1, 512, 128, None, true),
    ] {
        let d = GqaDims { heads, kv_heads, head_dim: hd, rotary, scale: (hd as f32).powf(-0.5), window };
        let mut all = steps(&mut rng);
        // Rows that see later rows of their forward (an image block attended both ways):
        // rows 3..8 of the prefill-like step see up to its eighth row's position.
        let (mut bidir, slots) = all[2].clone();
        bidir.visible_to = bidir.positions.iter().map(|p| p + 1).collect();
        for r in 3..8 {
            bidir.visible_to[r] = bidir.positions[7] + 1;
        }
        all.push((bidir, slots));
        for (step, slots) in all {
            let rows = step.rows();
            let q = rvec(&mut rng, rows * heads * hd, 1.0);
            let k = rvec(&mut rng, rows * kv_heads * hd, 1.0);
            let v = rvec(&mut rng, rows * kv_heads * hd, 1.0);
            let (qn, kn) = (rvec(&mut rng, hd, 1.0), rvec(&mut rng, hd, 1.0));
            let cache = rvec(&mut rng, slots * d.cache_width(), 1.0);
            fn run<B: Backend>(b: &B, step: &Step, d: GqaDims, v: [&[f32]; 7], norms: bool) -> [Vec<f32>; 5] {
                let rows = step.rows();
                let mut cos = b.alloc(rows * d.rotary / 2).unwrap();
                let mut sin = b.alloc(rows * d.rotary / 2).unwrap();
                b.rope_tables(step, &rope_inv(d.rotary), &mut cos, &mut sin);
                let (mut q, k, vb, qn, kn, mut cache) =
                    (up(b, v[0]), up(b, v[1]), up(b, v[2]), up(b, v[3]), up(b, v[4]), up(b, v[5]));
                b.gqa_prepare(
                    step,
                    GqaPrepare {
                        dims: d,
                        q: &mut q,
                        k: &k,
                        v: &vb,
                        q_norm: norms.then_some(&qn),
                        k_norm: norms.then_some(&kn),
                        eps: 1e-5,
                        cos: &cos,
                        sin: &sin,
                        cache: &mut cache,
                    },
                );
                let mut out = up(b, &vec![f32::NAN; v[0].len()]);
                b.gqa_attend(step, GqaAttend { dims: d, q: &q, cache: &cache, sinks: None, out: &mut out });
                // gpt-oss's sinks: one more logit a head in the softmax.
                let sinks = up(b, v[6]);
                let mut sunk = up(b, &vec![f32::NAN; v[0].len()]);
                b.gqa_attend(step, GqaAttend { dims: d, q: &q, cache: &cache, sinks: Some(&sinks), out: &mut sunk });
                // The queries alone (a layer reading another layer's cache).
                let mut q2 = up(b, v[0]);
                let q_norm = norms.then_some(&qn);
                b.gqa_query(step, GqaQuery { dims: d, q: &mut q2, q_norm, eps: 1e-5, cos: &cos, sin: &sin });
                let n = v[0].len();
                [down(b, &q, n), down(b, &cache, v[5].len()), down(b, &out, n), down(b, &q2, n), down(b, &sunk, n)]
            }
            let sinks = rvec(&mut rng, heads, 2.0);
            let vv = [&q[..], &k[..], &v[..], &qn[..], &kn[..], &cache[..], &sinks[..]];
            let gv = run(g, &step, d, vv, norms);
            let cv = run(c, &step, d, vv, norms);
            let what = format!("hd {hd} window {window:?} visible {}", !step.visible_to.is_empty());
            close(&format!("gqa q, {what}"), &gv[0], &cv[0], 1e-6, 2e-6);
            close(&format!("gqa cache, {what}"), &gv[1], &cv[1], 1e-6, 2e-6);
            close(&format!("gqa attend, {what}"), &gv[2], &cv[2], 2e-6, 2e-5);
            close(&format!("gqa query, {what}"), &gv[3], &cv[3], 1e-6, 2e-6);
            close(&format!("gqa attend with sinks, {what}"), &gv[4], &cv[4], 2e-6, 2e-5);
            assert_ne!(gv[4], gv[2], "the sinks take weight ({what})");
            assert_eq!(gv[3], gv[0], "gqa_query's queries equal gqa_prepare's ({what})");
        }
    }
}

#[test]
fn cuda_rope_and_mla_prepare_match_cpu() {
    if let Some(g) = gpu() {
        cuda_rope_and_mla_prepare_match_cpu_on(g)
    }
}

#[test]
fn cuda_mla_absorb_and_attend_match_cpu() {
    if let Some(g) = gpu() {
        cuda_mla_absorb_and_attend_match_cpu_on(g)
    }
}

#[test]
fn cuda_dsa_select_matches_cpu() {
    if let Some(g) = gpu() {
        cuda_dsa_select_matches_cpu_on(g)
    }
}

#[test]
fn cuda_gqa_matches_cpu() {
    if let Some(g) = gpu() {
        cuda_gqa_matches_cpu_on(g)
    }
}
