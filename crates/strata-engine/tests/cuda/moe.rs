//! The router, the grouped expert products and the combination.

use super::*;

/// gpt-oss's clamped SwiGLU, its limit low enough that random products cross it.
const CLAMPED: GateAct = GateAct::SwigluClamped { alpha: 1.702, limit: 0.1 };

pub(crate) fn cuda_route_noaux_matches_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(7);
    for (experts, hidden, rows, p) in [
        (64, 96, 1, RouterParams { top_k: 8, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 2.5 }),
        (64, 96, 9, RouterParams { top_k: 6, n_group: 8, topk_group: 3, norm_topk_prob: true, scaling: 1.0 }),
        (256, 128, 3, RouterParams { top_k: 8, n_group: 4, topk_group: 2, norm_topk_prob: false, scaling: 1.5 }),
        (256, 160, 1, RouterParams { top_k: 8, n_group: 8, topk_group: 4, norm_topk_prob: true, scaling: 2.5 }),
        (16, 64, 40, RouterParams { top_k: 4, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 2.5 }),
        // Exact ties: experts 2i and 2i + 1 have the same row and bias (the lower id first).
        (32, 64, 4, RouterParams { top_k: 8, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 1.0 }),
    ] {
        let tied = experts == 32;
        let (mut gate, _) = hostmat(&mut rng, QuantKind::F32, experts, hidden, 0.3);
        let mut bias = rvec(&mut rng, experts, 0.2);
        if tied {
            let row = 4 * hidden;
            for e in (0..experts).step_by(2) {
                let (a, b) = gate.payload.split_at_mut((e + 1) * row);
                b[..row].copy_from_slice(&a[e * row..]);
                bias[e + 1] = bias[e];
            }
        }
        let x = rvec(&mut rng, rows * hidden, 1.0);
        fn run<B: Backend>(
            b: &B,
            gate: &HostMatrix,
            x: &[f32],
            bias: &[f32],
            rows: usize,
            p: RouterParams,
        ) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
            let w = b.matrix(gate.clone()).unwrap();
            let (xb, bb) = (up(b, x), up(b, bias));
            let mut logits = up(b, &vec![f32::NAN; rows * gate.rows]);
            let mut ids = b.alloc_idx(rows * p.top_k).unwrap();
            let mut wts = up(b, &vec![f32::NAN; rows * p.top_k]);
            b.route_noaux(&xb, rows, &w, &bb, p, &mut logits, &mut ids, &mut wts);
            (down(b, &logits, rows * gate.rows), down_idx(b, &ids, rows * p.top_k), down(b, &wts, rows * p.top_k))
        }
        let (gl, gi, gw) = run(g, &gate, &x, &bias, rows, p);
        let (cl, ci, cw) = run(c, &gate, &x, &bias, rows, p);
        close("router logits", &gl, &cl, 1e-6, 1e-5);
        assert_eq!(gi, ci, "router ids ({experts} experts, {p:?})");
        close("router weights", &gw, &cw, 1e-6, 1e-5);
    }
}

/// The softmax router: logits, ids (best first) and (renormalised or not) scaled weights.
pub(crate) fn cuda_route_softmax_matches_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(17);
    for (experts, hidden, rows, top_k, kind) in
        [(128, 96, 1, 8, QuantKind::F32), (128, 64, 37, 8, QuantKind::Bf16), (12, 40, 5, 3, QuantKind::F32)]
    {
        let (gate, _) = hostmat(&mut rng, kind, experts, hidden, 0.5);
        let x = rvec(&mut rng, rows * hidden, 1.0);
        let scale = pvec(&mut rng, experts, 0.5, 1.5);
        fn run<B: Backend>(
            b: &B,
            gate: &HostMatrix,
            x: &[f32],
            scale: &[f32],
            bias: Option<&[f32]>,
            rows: usize,
            routing: SoftmaxRouting,
        ) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
            let k = routing.top_k;
            let w = b.matrix(gate.clone()).unwrap();
            let (xb, sb) = (up(b, x), up(b, scale));
            let mut logits = up(b, &vec![f32::NAN; rows * gate.rows]);
            let mut ids = b.alloc_idx(rows * k).unwrap();
            let mut wts = up(b, &vec![f32::NAN; rows * k]);
            let bias = bias.map(|v| up(b, v));
            b.route_softmax(&xb, rows, &w, bias.as_ref(), &sb, routing, &mut logits, &mut ids, &mut wts);
            (down(b, &logits, rows * gate.rows), down_idx(b, &ids, rows * k), down(b, &wts, rows * k))
        }
        // gpt-oss's router has a bias.
        let bias = rvec(&mut rng, experts, 1.0);
        for (renormalize, bias) in [(true, None), (false, None), (true, Some(&bias[..]))] {
            let routing = SoftmaxRouting { top_k, renormalize };
            let (gl, gi, gw) = run(g, &gate, &x, &scale, bias, rows, routing);
            let (cl, ci, cw) = run(c, &gate, &x, &scale, bias, rows, routing);
            close("softmax router logits", &gl, &cl, 1e-6, 1e-5);
            assert_eq!(gi, ci, "softmax router ids ({experts} experts, top {top_k}, {kind:?})");
            close(&format!("softmax router weights ({routing:?})"), &gw, &cw, 1e-6, 1e-5);
        }
    }
}

#[test]
fn cuda_route_softmax_matches_cpu() {
    if let Some(g) = gpu() {
        cuda_route_softmax_matches_cpu_on(g)
    }
}

/// An expert's (gate/up, down) encodings and its rows (None: every row).
type ExpertSpec = (QuantKind, QuantKind, Option<Vec<u32>>);

/// Runs `specs` (matrices `mats`) as one grouped launch over x of `rows` rows, their outputs
/// one after another in their order ([`out_rows_of`]); returns y.
fn run_experts<B: Backend>(
    b: &B,
    mats: &[[HostMatrix; 3]],
    specs: &[ExpertSpec],
    x: &[f32],
    rows: usize,
    hidden: usize,
    act: GateAct,
) -> Vec<f32> {
    run_biased_experts(b, mats, specs, x, rows, hidden, act, None)
}

/// [`run_experts`] with the experts' biases (gate, up: a row of `inter` per spec; down: a
/// row of `hidden`), where given.
#[allow(clippy::too_many_arguments)]
fn run_biased_experts<B: Backend>(
    b: &B,
    mats: &[[HostMatrix; 3]],
    specs: &[ExpertSpec],
    x: &[f32],
    rows: usize,
    hidden: usize,
    act: GateAct,
    biases: Option<&[Vec<f32>; 3]>,
) -> Vec<f32> {
    let biases = biases.map(|[g, u, d]| [up(b, g), up(b, u), up(b, d)]);
    let (out_rows, total) = out_rows_of(specs, rows);
    let dev: Vec<[B::Mat; 3]> = mats
        .iter()
        .map(|m| [b.matrix(m[0].clone()).unwrap(), b.matrix(m[1].clone()).unwrap(), b.matrix(m[2].clone()).unwrap()])
        .collect();
    let xb = up(b, x);
    let mut y = up(b, &vec![f32::NAN; total * hidden]);
    let task = |i: usize| ExpertTask {
        weights: b.expert_ref(&dev[i][0], &dev[i][1], &dev[i][2]),
        rows: specs[i].2.as_deref(),
        out_row: out_rows[i],
        bias: biases.as_ref().map(|[gate, up, down]| ExpertBias { gate, up, down, expert: i }),
    };
    b.gated_experts(act, &xb, rows, specs.len(), &task, &mut y);
    down(b, &y, total * hidden)
}

/// Each spec's first output row (its rows in order) and the rows in all.
fn out_rows_of(specs: &[ExpertSpec], rows: usize) -> (Vec<usize>, usize) {
    let mut out = Vec::new();
    let mut at = 0;
    for (_, _, r) in specs {
        out.push(at);
        at += r.as_ref().map_or(rows, |r| r.len());
    }
    (out, at)
}

/// `n` distinct rows of `0..rows`, ascending.
fn some_rows(rng: &mut Rand, rows: usize, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..rows as u32).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.random_range(0..=i));
    }
    let mut s = all[..n].to_vec();
    s.sort_unstable();
    s
}

fn expert_mats(rng: &mut Rand, specs: &[ExpertSpec], hidden: usize, inter: usize) -> Vec<[HostMatrix; 3]> {
    specs
        .iter()
        .map(|(gu, dk, _)| {
            [
                hostmat(rng, *gu, inter, hidden, 0.2).0,
                hostmat(rng, *gu, inter, hidden, 0.2).0,
                hostmat(rng, *dk, hidden, inter, 0.2).0,
            ]
        })
        .collect()
}

/// A prompt's experts (1-31 rows a task, and quantized ones of any rows 32 at a time: the
/// CUDA backend's tensor-core tiles) at widths
/// that reach the tiles' edges: 416 columns (six 64-column chunks and a half), 224 (three
/// and a half), outputs past a tile's and a block's end, every count of 8-row n-tiles,
/// each encoding the tiles take (int4 groups of 32, 64 and 128 with a partial last group,
/// FP8 blocks of 8 and 16 rows, int8, bf16) and one they leave (f32), against the CPU.
pub(crate) fn cuda_prompt_experts_match_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(31);
    let (hidden, inter, rows) = (416, 224, 48);
    let int4 = QuantKind::int4;
    let fp8 = |block_rows, block_cols| QuantKind::Fp8 { block_rows, block_cols };
    let specs: Vec<ExpertSpec> = vec![
        (QuantKind::Bf16, QuantKind::Bf16, Some(some_rows(&mut rng, rows, 31))),
        (QuantKind::Int8Row, QuantKind::Int8Row, Some(some_rows(&mut rng, rows, 17))),
        (int4(32), int4(128), Some(some_rows(&mut rng, rows, 24))),
        (fp8(8, 64), fp8(16, 32), Some(some_rows(&mut rng, rows, 9))),
        (QuantKind::Bf16, QuantKind::F32, Some(some_rows(&mut rng, rows, 2))),
        (int4(64), QuantKind::Bf16, Some(some_rows(&mut rng, rows, 1))),
        (QuantKind::Int8Row, int4(32), Some(some_rows(&mut rng, rows, 8))),
        // Every row (48): quantized, so 32 and 16 rows through the tiles.
        (int4(32), QuantKind::Int8Row, None),
        // MXFP4 (gpt-oss): the grouped kernels at any row count.
        (QuantKind::Mxfp4, QuantKind::Mxfp4, Some(some_rows(&mut rng, rows, 5))),
        (QuantKind::Mxfp4, QuantKind::Mxfp4, None),
    ];
    let mats = expert_mats(&mut rng, &specs, hidden, inter);
    let x = rvec(&mut rng, rows * hidden, 1.0);
    for act in [GateAct::Silu, GateAct::GeluTanh, CLAMPED] {
        let gy = run_experts(g, &mats, &specs, &x, rows, hidden, act);
        let cy = run_experts(c, &mats, &specs, &x, rows, hidden, act);
        close(&format!("prompt experts y ({act:?})"), &gy, &cy, 1e-5, 1e-4);
    }
    // gpt-oss: the clamped gate with expert biases, on every path above.
    let biases = [
        rvec(&mut rng, specs.len() * inter, 0.5),
        rvec(&mut rng, specs.len() * inter, 0.5),
        rvec(&mut rng, specs.len() * hidden, 0.5),
    ];
    let gy = run_biased_experts(g, &mats, &specs, &x, rows, hidden, CLAMPED, Some(&biases));
    let cy = run_biased_experts(c, &mats, &specs, &x, rows, hidden, CLAMPED, Some(&biases));
    close("prompt experts y (clamped, biased)", &gy, &cy, 1e-5, 1e-4);
    assert!(cy != run_experts(c, &mats, &specs, &x, rows, hidden, CLAMPED), "the biases count");
}

#[test]
fn cuda_prompt_experts_match_cpu() {
    if let Some(g) = gpu() {
        cuda_prompt_experts_match_cpu_on(g)
    }
}

/// A row's expert output does not depend on the other rows of its task: the same expert
/// over 29 rows at once, and over 73 (cut into tasks of 32, 32 and 9; bf16 too, which goes
/// to cuBLAS only from 256 rows), and over a few of them split into tasks of 1, 2 and 8
/// rows (as a streamed layer's batches may come), gives those rows bit for bit, for each
/// encoding.
#[test]
fn cuda_prompt_expert_rows_sum_alone() {
    let Some(g) = gpu() else { return };
    let mut rng = Rand::seed_from_u64(32);
    let (hidden, inter, rows) = (256, 192, 80);
    for (kind, all) in [
        QuantKind::Bf16,
        QuantKind::Int8Row,
        QuantKind::int4(64),
        QuantKind::Fp8 { block_rows: 128, block_cols: 128 },
        QuantKind::Mxfp4,
    ]
    .into_iter()
    .flat_map(|k| [(k, (4..33).collect::<Vec<u32>>()), (k, (4..77).collect())])
    {
        let parts = [vec![7u32], vec![12, 30], (20..28).collect::<Vec<u32>>()];
        let whole: Vec<ExpertSpec> = vec![(kind, kind, Some(all.clone()))];
        let split: Vec<ExpertSpec> = parts.iter().map(|p| (kind, kind, Some(p.clone()))).collect();
        let one = expert_mats(&mut rng, &whole, hidden, inter);
        let mats: Vec<[HostMatrix; 3]> = split.iter().map(|_| one[0].clone()).collect();
        let x = rvec(&mut rng, rows * hidden, 1.0);
        let wy = run_experts(g, &one, &whole, &x, rows, hidden, GateAct::Silu);
        let sy = run_experts(g, &mats, &split, &x, rows, hidden, GateAct::Silu);
        for (at, r) in parts.iter().flatten().enumerate() {
            let i = all.iter().position(|a| a == r).unwrap();
            let (a, b) = (&wy[i * hidden..(i + 1) * hidden], &sy[at * hidden..(at + 1) * hidden]);
            assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()), "{kind:?}: row {r} differs split");
        }
    }
}

pub(crate) fn cuda_experts_and_combine_match_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(8);
    let (hidden, inter, rows) = (128, 64, 40);
    // Per expert: encodings of (gate/up, down), its rows (None: every row).
    let rows_of = |rng: &mut Rand, n: usize| some_rows(rng, rows, n);
    let specs: Vec<ExpertSpec> = vec![
        (QuantKind::Bf16, QuantKind::Bf16, Some(rows_of(&mut rng, 1))),
        (QuantKind::int4(32), QuantKind::int4(64), Some(rows_of(&mut rng, 3))),
        (QuantKind::Int8Row, QuantKind::Int8Row, Some(rows_of(&mut rng, 8))),
        (QuantKind::Fp8 { block_rows: 128, block_cols: 128 }, QuantKind::F32, Some(rows_of(&mut rng, 9))),
        (QuantKind::F32, QuantKind::Bf16, Some(rows_of(&mut rng, 35))),
        (QuantKind::int4(6), QuantKind::Fp8 { block_rows: 16, block_cols: 24 }, Some(rows_of(&mut rng, 2))),
        (QuantKind::Bf16, QuantKind::int4(64), None),
        (QuantKind::Mxfp4, QuantKind::Mxfp4, Some(rows_of(&mut rng, 4))),
    ];
    let mats = expert_mats(&mut rng, &specs, hidden, inter);
    let x = rvec(&mut rng, rows * hidden, 1.0);
    let (_, total) = out_rows_of(&specs, rows);
    // SwiGLU (GLM), GELU-tanh (Gemma 4) and clamped SwiGLU (gpt-oss) gates, on the
    // grouped and the many-rows paths.
    let mut cy = Vec::new();
    for act in [GateAct::GeluTanh, CLAMPED, GateAct::Silu] {
        let gy = run_experts(g, &mats, &specs, &x, rows, hidden, act);
        cy = run_experts(c, &mats, &specs, &x, rows, hidden, act);
        close(&format!("experts y ({act:?})"), &gy, &cy, 1e-5, 1e-4);
    }
    let biases = [
        rvec(&mut rng, specs.len() * inter, 0.5),
        rvec(&mut rng, specs.len() * inter, 0.5),
        rvec(&mut rng, specs.len() * hidden, 0.5),
    ];
    let gy = run_biased_experts(g, &mats, &specs, &x, rows, hidden, CLAMPED, Some(&biases));
    let by = run_biased_experts(c, &mats, &specs, &x, rows, hidden, CLAMPED, Some(&biases));
    close("experts y (clamped, biased)", &gy, &by, 1e-5, 1e-4);

    // The combination: each row takes top_k of the outputs above (ids ascending order
    // differs from rank order), plus a shared row.
    let top_k = 3;
    let crow = 10;
    let mut ids = Vec::new();
    let mut src = Vec::new();
    for _ in 0..crow {
        let mut pick: Vec<u32> = (0..40).collect();
        for i in (1..pick.len()).rev() {
            pick.swap(i, rng.random_range(0..=i));
        }
        ids.extend_from_slice(&pick[..top_k]);
        src.extend((0..top_k).map(|_| rng.random_range(0..(total - crow) as u32)));
    }
    let w = pvec(&mut rng, crow * top_k, 0.1, 1.0);
    let out0 = rvec(&mut rng, crow * hidden, 1.0);
    fn comb<B: Backend>(
        b: &B,
        ids: &[u32],
        w: &[f32],
        src: &[u32],
        y: &[f32],
        out0: &[f32],
        rows: usize,
        hidden: usize,
        top_k: usize,
        shared: usize,
        gate: Option<&[f32]>,
    ) -> Vec<f32> {
        let mut ib = b.alloc_idx(ids.len()).unwrap();
        b.write_idx(&mut ib, 0, ids);
        let mut sb = b.alloc_idx(src.len()).unwrap();
        b.write_idx(&mut sb, 0, src);
        let (wb, yb) = (up(b, w), up(b, y));
        let mut o = up(b, out0);
        let gate = gate.map(|g| up(b, g));
        let shared = SharedRows { row: shared, gate: gate.as_ref() };
        b.moe_combine(rows, hidden, top_k, &ib, &wb, &sb, &yb, Some(shared), &mut o);
        down(b, &o, out0.len())
    }
    let shared = total - crow;
    let gcomb = comb(g, &ids, &w, &src, &cy, &out0, crow, hidden, top_k, shared, None);
    let ccomb = comb(c, &ids, &w, &src, &cy, &out0, crow, hidden, top_k, shared, None);
    // Same inputs, same order, fused multiply-adds on both: equal.
    close("moe_combine", &gcomb, &ccomb, 1e-7, 1e-7);
    // A gated shared expert (Qwen2-MoE, Qwen3-Next): the gate's sigmoid differs by an ulp
    // or so between the two exps.
    let gate = rvec(&mut rng, crow, 2.0);
    let gcomb = comb(g, &ids, &w, &src, &cy, &out0, crow, hidden, top_k, shared, Some(&gate));
    let ccomb = comb(c, &ids, &w, &src, &cy, &out0, crow, hidden, top_k, shared, Some(&gate));
    close("moe_combine, gated shared rows", &gcomb, &ccomb, 1e-6, 1e-6);
    let ungated = comb(c, &ids, &w, &src, &cy, &out0, crow, hidden, top_k, shared, None);
    assert!(ccomb != ungated, "the gate weighs the shared rows");
}

#[test]
fn cuda_route_noaux_matches_cpu() {
    if let Some(g) = gpu() {
        cuda_route_noaux_matches_cpu_on(g)
    }
}

/// A decode row's router (one launch, `k_route_one`: logits, then the last block routes)
/// gives what the same row gets routed beside others (two launches), bit for bit, and
/// stays right when called again and again (its count of finished blocks starts at zero
/// each time).
#[test]
fn cuda_one_row_route_equals_batched_rows() {
    let Some(g) = gpu() else { return };
    let mut rng = Rand::seed_from_u64(11);
    for (experts, hidden, p) in [
        (48, 256, RouterParams { top_k: 8, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 2.5 }),
        (256, 192, RouterParams { top_k: 8, n_group: 8, topk_group: 4, norm_topk_prob: true, scaling: 2.5 }),
        (64, 96, RouterParams { top_k: 6, n_group: 1, topk_group: 1, norm_topk_prob: false, scaling: 1.0 }),
    ] {
        let rows = 3;
        let (gate, _) = hostmat(&mut rng, QuantKind::F32, experts, hidden, 0.3);
        let bias = rvec(&mut rng, experts, 0.2);
        let x = rvec(&mut rng, rows * hidden, 1.0);
        let w = g.matrix(gate.clone()).unwrap();
        let bb = up(g, &bias);
        let route = |x: &[f32], n: usize| {
            let xb = up(g, x);
            let mut logits = up(g, &vec![f32::NAN; n * experts]);
            let mut ids = g.alloc_idx(n * p.top_k).unwrap();
            let mut wts = up(g, &vec![f32::NAN; n * p.top_k]);
            g.route_noaux(&xb, n, &w, &bb, p, &mut logits, &mut ids, &mut wts);
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            (bits(down(g, &logits, n * experts)), down_idx(g, &ids, n * p.top_k), bits(down(g, &wts, n * p.top_k)))
        };
        let (bl, bi, bw) = route(&x, rows);
        for _ in 0..3 {
            for r in 0..rows {
                let (l, i, w) = route(&x[r * hidden..(r + 1) * hidden], 1);
                let (k, what) = (p.top_k, format!("row {r} of {experts} experts, {p:?}"));
                assert_eq!(l, bl[r * experts..(r + 1) * experts], "logits, {what}");
                assert_eq!(i, bi[r * k..(r + 1) * k], "ids, {what}");
                assert_eq!(w, bw[r * k..(r + 1) * k], "weights, {what}");
            }
        }
    }
}

#[test]
fn cuda_experts_and_combine_match_cpu() {
    if let Some(g) = gpu() {
        cuda_experts_and_combine_match_cpu_on(g)
    }
}

/// One row's routed experts dispatched on the device by id equal the host-dispatched path
/// (tasks in ascending id, `src` from the ranks) bit for bit, y and the combined output,
/// for mixed encodings and an odd intermediate width; both match the CPU.
#[test]
fn cuda_experts_by_id_equal_the_host_path() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rand::seed_from_u64(21);
    let fp8 = QuantKind::Fp8 { block_rows: 16, block_cols: 32 };
    let int4 = QuantKind::int4(32);
    // (bf16 and e4m3 scales too: the same kernels, read as stored.)
    let tiled =
        vec![QuantKind::int4(64), int4, QuantKind::int4(128), QuantKind::int4_bf16(64), QuantKind::int4_e4m3(64)];
    // x scale: the tiles carry x in f16 scaled per 128 columns, so x far beyond f16's range
    // (1e5: the down input reaches ~1e11) or below it must come out as on the CPU.
    for (hidden, inter, kinds, top_k, x_scale) in [
        (128, 64, vec![QuantKind::Bf16, int4, QuantKind::Int8Row, fp8, QuantKind::F32, QuantKind::Bf16], 4, 1.0),
        (96, 42, vec![QuantKind::Bf16, QuantKind::F32, QuantKind::Bf16, QuantKind::Int8Row, QuantKind::F32], 3, 1.0),
        // int4 through the tensor-core tiles: whole 128-column chunks (5 and 3 of them, so
        // some warps of a block have none), rows not a multiple of 16 and groups of 32,
        // 64, 128 and 96 (not a power of two).
        (640, 376, tiled.clone(), 3, 1.0),
        (
            384,
            384,
            vec![QuantKind::int4(96), int4, QuantKind::Bf16, QuantKind::int4_bf16(96), QuantKind::int4_e4m3(96)],
            2,
            1e5,
        ),
        (640, 384, tiled, 3, 1e-4),
    ] {
        let n = kinds.len() * 2;
        let mats: Vec<[HostMatrix; 3]> = (0..n)
            .map(|e| {
                let k = kinds[e % kinds.len()];
                let down_kind = kinds[(e + 1) % kinds.len()];
                [
                    hostmat(&mut rng, k, inter, hidden, 0.2).0,
                    hostmat(&mut rng, k, inter, hidden, 0.2).0,
                    hostmat(&mut rng, down_kind, hidden, inter, 0.2).0,
                ]
            })
            .collect();
        let shared_inter = inter * 2;
        let shared = [
            hostmat(&mut rng, QuantKind::Bf16, shared_inter, hidden, 0.2).0,
            hostmat(&mut rng, QuantKind::Bf16, shared_inter, hidden, 0.2).0,
            hostmat(&mut rng, QuantKind::Bf16, hidden, shared_inter, 0.2).0,
        ];
        let x = rvec(&mut rng, hidden, x_scale);
        let mut pick: Vec<u32> = (0..n as u32).collect();
        for i in (1..pick.len()).rev() {
            pick.swap(i, rng.random_range(0..=i));
        }
        let ids = pick[..top_k].to_vec();
        let w = pvec(&mut rng, top_k, 0.1, 1.0);
        let out0 = rvec(&mut rng, hidden, 1.0);

        // The host path, as the MoE block runs it: tasks in ascending id, then the shared
        // expert; src[j] = the output row of ids[j].
        #[allow(clippy::too_many_arguments)]
        fn host_path<B: Backend>(
            b: &B,
            mats: &[[B::Mat; 3]],
            shared: &[B::Mat; 3],
            ids: &[u32],
            w: &[f32],
            x: &[f32],
            out0: &[f32],
            hidden: usize,
        ) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
            let k = ids.len();
            let mut sorted = ids.to_vec();
            sorted.sort_unstable();
            let src: Vec<u32> = ids.iter().map(|e| sorted.iter().position(|s| s == e).unwrap() as u32).collect();
            let xb = up(b, x);
            let mut y = up(b, &vec![f32::NAN; (k + 1) * hidden]);
            let task = |i: usize| {
                if i == k {
                    return ExpertTask {
                        weights: b.expert_ref(&shared[0], &shared[1], &shared[2]),
                        rows: None,
                        out_row: k,
                        bias: None,
                    };
                }
                let m = &mats[sorted[i] as usize];
                ExpertTask { weights: b.expert_ref(&m[0], &m[1], &m[2]), rows: None, out_row: i, bias: None }
            };
            b.experts(&xb, 1, k + 1, &task, &mut y);
            let mut ib = b.alloc_idx(k).unwrap();
            b.write_idx(&mut ib, 0, ids);
            let mut sb = b.alloc_idx(k).unwrap();
            b.write_idx(&mut sb, 0, &src);
            let wb = up(b, w);
            let mut o = up(b, out0);
            b.moe_combine(1, hidden, k, &ib, &wb, &sb, &y, Some(SharedRows::at(k)), &mut o);
            (down(b, &y, (k + 1) * hidden), down(b, &o, hidden), src)
        }
        let dev = |b: &CudaBackend, m: &[HostMatrix; 3]| {
            [b.matrix(m[0].clone()).unwrap(), b.matrix(m[1].clone()).unwrap(), b.matrix(m[2].clone()).unwrap()]
        };
        let gm: Vec<_> = mats.iter().map(|m| dev(g, m)).collect();
        let gs = dev(g, &shared);
        let (ya, oa, src) = host_path(g, &gm, &gs, &ids, &w, &x, &out0, hidden);

        let table = g.expert_table(&gm).unwrap().expect("CUDA builds expert tables");
        let k = top_k;
        let xb = up(g, &x);
        let mut ib = g.alloc_idx(k).unwrap();
        g.write_idx(&mut ib, 0, &ids);
        let mut y = up(g, &vec![f32::NAN; (k + 1) * hidden]);
        g.experts_by_id(&xb, k, &ib, &table, Some(g.expert_ref(&gs[0], &gs[1], &gs[2])), &mut y);
        let yb = down(g, &y, (k + 1) * hidden);
        for j in 0..k {
            let a = &ya[src[j] as usize * hidden..][..hidden];
            let b = &yb[j * hidden..][..hidden];
            assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()), "expert {} (rank {j}) differs", ids[j]);
        }
        assert!(
            ya[k * hidden..].iter().zip(&yb[k * hidden..]).all(|(p, q)| p.to_bits() == q.to_bits()),
            "shared expert differs"
        );
        let mut order = g.alloc_idx(k).unwrap();
        g.write_idx(&mut order, 0, &(0..k as u32).collect::<Vec<_>>());
        let wb = up(g, &w);
        let mut o = up(g, &out0);
        g.moe_combine(1, hidden, k, &ib, &wb, &order, &y, Some(SharedRows::at(k)), &mut o);
        let ob = down(g, &o, hidden);
        assert!(oa.iter().zip(&ob).all(|(p, q)| p.to_bits() == q.to_bits()), "combined output differs");

        let cm: Vec<[_; 3]> = mats
            .iter()
            .map(|m| {
                [c.matrix(m[0].clone()).unwrap(), c.matrix(m[1].clone()).unwrap(), c.matrix(m[2].clone()).unwrap()]
            })
            .collect();
        let cs = [
            c.matrix(shared[0].clone()).unwrap(),
            c.matrix(shared[1].clone()).unwrap(),
            c.matrix(shared[2].clone()).unwrap(),
        ];
        let (yc, oc, _) = host_path(c, &cm, &cs, &ids, &w, &x, &out0, hidden);
        close("experts by id vs CPU", &ob, &oc, 1e-5, 1e-4);
        // The experts' outputs themselves, relative to their largest (at x scale 1e-4 the
        // combined output is mostly out0).
        let big = yc.iter().fold(f32::MIN_POSITIVE, |a, v| a.max(v.abs()));
        close("expert outputs vs CPU", &ya, &yc, 1e-5 * big, 1e-4);
    }
    // A table needs one shape for every expert.
    let mut rng = Rand::seed_from_u64(22);
    let m = |rng: &mut Rand, r, c| g.matrix(hostmat(rng, QuantKind::Bf16, r, c, 0.2).0).unwrap();
    let bad = vec![
        [m(&mut rng, 8, 16), m(&mut rng, 8, 16), m(&mut rng, 16, 8)],
        [m(&mut rng, 4, 16), m(&mut rng, 4, 16), m(&mut rng, 16, 4)],
    ];
    let err = g.expert_table(&bad).err().expect("mixed shapes refused").to_string();
    assert!(err.contains("expert 1"), "{err}");
}
