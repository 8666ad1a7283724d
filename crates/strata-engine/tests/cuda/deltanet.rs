//! Qwen3-Next's ops: the gated DeltaNet over chained steps (rows of two sequences, each
//! continuing its own convolution and recurrent state), and the gated attention output.

use super::*;
use strata_backend::DeltaNet;
use strata_kernels::deltanet::DeltaNetDims;

pub(crate) fn cuda_deltanet_matches_cpu_on<G: Backend>(g: &G) {
    let c = cpu();
    let mut rng = Rand::seed_from_u64(43);
    // Qwen3-Next-80B's widths, a small odd one (3 value heads a key head, heads narrower
    // than a warp and wider than one), and a convolution of one tap (no state).
    let shapes = [
        DeltaNetDims { k_heads: 16, v_heads: 32, k_dim: 128, v_dim: 128, kernel: 4 },
        DeltaNetDims { k_heads: 2, v_heads: 6, k_dim: 24, v_dim: 40, kernel: 3 },
        DeltaNetDims { k_heads: 1, v_heads: 2, k_dim: 8, v_dim: 5, kernel: 1 },
    ];
    for d in shapes {
        let seqs = 2;
        let conv = rvec(&mut rng, d.conv_dim() * d.kernel, 0.6);
        let (a_log, dt_bias) = (rvec(&mut rng, d.v_heads, 1.0), rvec(&mut rng, d.v_heads, 1.0));
        let norm: Vec<f32> = rvec(&mut rng, d.v_dim, 0.5).iter().map(|v| 1.0 + v).collect();
        let conv_state0 = rvec(&mut rng, seqs * d.conv_state_len(), 1.0);
        let state0 = rvec(&mut rng, seqs * d.state_len(), 0.3);
        // A decode row, two sequences' rows, a prompt of both (interleaved by sequence).
        let steps: Vec<Step> = steps(&mut rng).into_iter().map(|(s, _)| s).collect();
        let inputs: Vec<(Vec<f32>, Vec<f32>)> = steps
            .iter()
            .map(|s| (rvec(&mut rng, s.rows() * d.qkvz_width(), 1.5), rvec(&mut rng, s.rows() * 2 * d.v_heads, 2.0)))
            .collect();
        fn run<B: Backend>(
            b: &B,
            d: DeltaNetDims,
            steps: &[Step],
            inputs: &[(Vec<f32>, Vec<f32>)],
            weights: [&[f32]; 4],
            states: [&[f32]; 2],
        ) -> Vec<Vec<f32>> {
            let [conv, a_log, dt_bias, norm] = weights.map(|w| up(b, w));
            let (mut cs, mut st) = (up(b, states[0]), up(b, states[1]));
            let mut outs = Vec::new();
            for (step, (qkvz, ba)) in steps.iter().zip(inputs) {
                let n = step.rows() * d.value_dim();
                let mut out = up(b, &vec![f32::NAN; n]);
                let (qkvz, ba) = (up(b, qkvz), up(b, ba));
                b.gated_delta_net(
                    step,
                    DeltaNet {
                        dims: d,
                        qkvz: &qkvz,
                        ba: &ba,
                        conv: &conv,
                        a_log: &a_log,
                        dt_bias: &dt_bias,
                        norm: &norm,
                        eps: 1e-6,
                        conv_state: &mut cs,
                        state: &mut st,
                        out: &mut out,
                    },
                );
                outs.push(down(b, &out, n));
            }
            outs.push(down(b, &cs, states[0].len()));
            outs.push(down(b, &st, states[1].len()));
            outs
        }
        let weights = [&conv[..], &a_log[..], &dt_bias[..], &norm[..]];
        let states = [&conv_state0[..], &state0[..]];
        let (gv, cv) = (run(g, d, &steps, &inputs, weights, states), run(c, d, &steps, &inputs, weights, states));
        let what =
            format!("{} key x {} value heads of {} x {}, kernel {}", d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.kernel);
        for (i, (gs, cs)) in gv.iter().zip(&cv).enumerate() {
            let part = match i {
                i if i < steps.len() => format!("step {i}'s output"),
                i if i == steps.len() => "convolution states".to_string(),
                _ => "recurrent states".to_string(),
            };
            // Convolution states are copies; the rest is f32 arithmetic whose sums
            // associate differently (the block reductions) and whose exp/log may round 1
            // ulp apart.
            if i == steps.len() {
                assert_eq!(gs, cs, "gated_delta_net, {what}: {part}");
            } else {
                close(&format!("gated_delta_net, {what}: {part}"), gs, cs, 2e-5, 2e-4);
            }
        }
    }
    for len in [1usize, 255, 4096, 70_001] {
        let (x, gate) = (rvec(&mut rng, len, 2.0), rvec(&mut rng, len, 6.0));
        let part = len - len / 3;
        fn run<B: Backend>(b: &B, x: &[f32], gate: &[f32], part: usize) -> Vec<f32> {
            let (mut xb, gb) = (up(b, x), up(b, gate));
            b.sigmoid_mul(part, &gb, &mut xb);
            down(b, &xb, x.len())
        }
        close(
            &format!("sigmoid_mul over {part} of {len}"),
            &run(g, &x, &gate, part),
            &run(c, &x, &gate, part),
            1e-6,
            1e-6,
        );
    }
}

#[test]
fn cuda_deltanet_matches_cpu() {
    if let Some(g) = gpu() {
        cuda_deltanet_matches_cpu_on(g)
    }
}
