//! CUDA graphs: held launches replayed as graphs give the same bits as kernels launched
//! one by one, and a decode step does become a graph replay.

use super::models::repo_root;
use super::*;
use strata_backend::cuda::{launch_totals, set_dependent_launch_default, set_graphs_default, LaunchStats};

/// A chain of ops like a decode step's (norms, projections of several encodings, a
/// residual add, routing, experts by id, the combine), run `steps` times on new inputs,
/// each step bounded by an upload and a read: its outputs, and the backend's launch counts
/// after it, one each a step.
fn run_chain(b: &CudaBackend, steps: usize) -> Vec<(Vec<f32>, LaunchStats)> {
    let (hidden, inter, experts, top_k) = (256, 128, 8, 2);
    let mut rng = Rand::seed_from_u64(7);
    let mat = |rng: &mut Rand, kind: QuantKind, rows: usize, cols: usize| {
        b.matrix(hostmat(rng, kind, rows, cols, 0.5).0).unwrap()
    };
    let wq = mat(&mut rng, QuantKind::Bf16, hidden, hidden);
    let wk = mat(&mut rng, QuantKind::int4(32), hidden, hidden);
    let gate = mat(&mut rng, QuantKind::F32, experts, hidden);
    let table: Vec<[_; 3]> = (0..experts)
        .map(|_| {
            let kind = QuantKind::Int8Row;
            [mat(&mut rng, kind, inter, hidden), mat(&mut rng, kind, inter, hidden), mat(&mut rng, kind, hidden, inter)]
        })
        .collect();
    let table_dev = b.expert_table(&table).unwrap().unwrap();
    let norm = b.upload(&rvec(&mut rng, hidden, 1.0)).unwrap();
    let bias = b.upload(&rvec(&mut rng, experts, 0.1)).unwrap();
    let (mut x, mut xn, mut q) = (b.alloc(hidden).unwrap(), b.alloc(hidden).unwrap(), b.alloc(hidden).unwrap());
    let mut logits = b.alloc(experts).unwrap();
    let (mut ids, mut weights) = (b.alloc_idx(top_k).unwrap(), b.alloc(top_k).unwrap());
    let mut order = b.alloc_idx(top_k).unwrap();
    b.write_idx(&mut order, 0, &[0, 1]);
    let mut y = b.alloc((top_k + 1) * hidden).unwrap();
    let p = RouterParams { top_k, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 1.5 };
    let mut outs = Vec::new();
    for _ in 0..steps {
        b.write(&mut x, 0, &rvec(&mut rng, hidden, 1.0));
        b.rms_norm(1, hidden, &x, Some(&norm), 1e-6, &mut xn);
        b.linears(&xn, 1, &mut [LinearOut::new(b, &wq, &mut q)]);
        b.linears(&q, 1, &mut [LinearOut::add(b, &wk, &mut x)]);
        b.rms_norm(1, hidden, &x, Some(&norm), 1e-6, &mut xn);
        b.route_noaux(&xn, 1, &gate, &bias, p, &mut logits, &mut ids, &mut weights);
        b.experts_by_id(&xn, top_k, &ids, &table_dev, None, &mut y);
        b.moe_combine(1, hidden, top_k, &ids, &weights, &order, &y, None, &mut x);
        let mut out = vec![0f32; hidden];
        b.read(&x, 0, &mut out);
        outs.push((out, b.launch_stats()));
    }
    outs
}

#[test]
fn cuda_graph_replay_equals_kernels_one_by_one() {
    if gpu().is_none() {
        return;
    }
    let (eager, graphs) = (CudaBackend::new(0).unwrap(), CudaBackend::new(0).unwrap());
    eager.set_graphs(false);
    graphs.set_graphs(true);
    let steps = 6;
    let (a, b) = (run_chain(&eager, steps), run_chain(&graphs, steps));
    let per_step = |r: &[(Vec<f32>, LaunchStats)], i: usize| {
        let (x, y) = (r[i - 1].1, r[i].1);
        (y.kernels - x.kernels, y.graphs - x.graphs, y.graph_kernels - x.graph_kernels)
    };
    for (i, ((a, _), (b, _))) in a.iter().zip(&b).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "step {i}: the graph's outputs differ from the kernels launched one by one");
        assert!(a.iter().all(|v| v.is_finite()), "step {i}: non-finite outputs");
    }
    assert!(a[0].0 != a[1].0, "the steps' inputs differ, so their outputs must");
    let (se, sg) = (eager.launch_stats(), graphs.launch_stats());
    assert_eq!((se.graphs, se.built), (0, 0), "graphs off: {se:?}");
    // Step 1 grows the scratch buffers (an allocation ends a run), step 2 is seen, step 3
    // builds the step's graphs (a step is sent in pieces of 4, then 8 launches), and the
    // later steps only replay them: every kernel in a graph, none built.
    let kernels = per_step(&a, steps - 1).0;
    assert!(kernels >= 8, "the eager backend's step launches its kernels: {kernels}");
    for i in 3..steps {
        let (alone, launches, in_graphs) = per_step(&b, i);
        assert_eq!((alone, in_graphs), (0, kernels), "step {}: {launches} graph launches", i + 1);
    }
    assert!((1..=4).contains(&sg.built), "graphs built: {sg:?}");
    eprintln!("graph replay equals one by one over {steps} steps: {sg:?}");
}

/// Decode on CUDA with graphs and without, and with kernels launched before the one before
/// them has finished (programmatic dependent launch) and without: every step's logits
/// equal bit for bit, and with graphs the steps are graph launches. DSA selection is
/// engaged (`dsa-sparse`: top-8 of a longer context), and Gemma's sliding-window and
/// shared-KV layers too.
#[test]
fn cuda_decode_with_graphs_equals_without() {
    if gpu().is_none() {
        return;
    }
    let root = repo_root();
    for fixture in [
        "glm5/dsa-sparse",
        "glm4_moe/gqa-bias",
        "qwen3_moe/sparse-step",
        "minimax_m2/gqa-full",
        "deepseek_v3/yarn-groups",
        "gemma4/moe",
    ] {
        let dir = root.join("fixtures").join(fixture);
        let r = SafetensorsFile::open(&dir.join("reference.safetensors")).unwrap();
        let prompt: Vec<u32> = {
            let t = &r.tensors()["prompt_ids"];
            r.bytes(t).unwrap().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
        };
        let decode = |graphs: bool, pdl: bool| -> (Vec<Vec<f32>>, LaunchStats) {
            set_graphs_default(graphs);
            set_dependent_launch_default(pdl);
            let m = LoadedModel::open_with(&dir, &LoadOptions { device: Device::Cuda(0), ..Default::default() });
            set_graphs_default(true);
            set_dependent_launch_default(true);
            let m = m.unwrap_or_else(|e| panic!("{fixture}: {e:#}"));
            let mut gen = m.scorer().unwrap();
            gen.prefill(&prompt).unwrap();
            let before = launch_totals();
            let mut steps = Vec::new();
            for _ in 0..24 {
                let l = gen.last_logits().to_vec();
                let next = (0..l.len()).max_by(|&i, &j| l[i].total_cmp(&l[j]).then(j.cmp(&i))).unwrap() as u32;
                steps.push(l);
                gen.step(next).unwrap();
            }
            let after = launch_totals();
            let delta = LaunchStats {
                kernels: after.kernels - before.kernels,
                graphs: after.graphs - before.graphs,
                graph_kernels: after.graph_kernels - before.graph_kernels,
                built: after.built - before.built,
            };
            (steps, delta)
        };
        let (off, _) = decode(false, false);
        let (on, stats) = decode(true, true);
        let (pdl_alone, _) = decode(false, true);
        let (graphs_alone, _) = decode(true, false);
        for (what, other) in
            [("graphs and dependent launch", &on), ("dependent launch", &pdl_alone), ("graphs", &graphs_alone)]
        {
            for (i, (a, b)) in off.iter().zip(other).enumerate() {
                let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{fixture}: decode step {i}'s logits differ with {what}");
            }
        }
        // (Totals are process-wide: other tests' kernels may add to them, never take away.)
        assert!(stats.graphs >= 20, "{fixture}: 24 decode steps made {} graph launches", stats.graphs);
        eprintln!("{fixture}: 24 decode steps equal with and without graphs; with graphs: {stats:?}");
    }
}

/// Decoding fed on the device (the default on CUDA: each pick feeds the next forward
/// before the host reads it) gives the tokens of steps one at a time, on its
/// token limit and on an EOS id met mid-way (a forward queued past it is dropped).
#[test]
fn cuda_fed_decoding_equals_plain() {
    if gpu().is_none() {
        return;
    }
    let root = repo_root();
    for fixture in
        ["glm5/dsa-sparse", "glm5/fp8", "glm4_moe/gqa-bias", "qwen3_moe/gqa-renorm", "gemma4/moe", "gemma4/dense-ple"]
    {
        let dir = root.join("fixtures").join(fixture);
        let m = LoadedModel::open_with(&dir, &LoadOptions { device: Device::Cuda(0), ..Default::default() })
            .unwrap_or_else(|e| panic!("{fixture}: {e:#}"));
        let vocab = m.model.info().vocab_size as u32;
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % vocab).collect();
        let run = |req: &GenerateRequest, fed: Option<bool>| {
            let mut engine = m.engine(Some(0)).unwrap();
            engine.set_device_picks(fed);
            let out = crate::common::generate_on(&mut engine, req).unwrap();
            assert_eq!(out.stats.decode_fed, fed != Some(false), "{fixture}: decode_fed with {fed:?}");
            (out.tokens, out.finish_reason)
        };
        let req = GenerateRequest::new(prompt, 20, SamplingParams::default());
        let plain = run(&req, Some(false));
        assert_eq!(run(&req, None), plain, "{fixture}: fed (the CUDA default) against plain");
        let k = (4..plain.0.len()).find(|&k| !plain.0[..k].contains(&plain.0[k])).expect("a fresh token");
        let eos = GenerateRequest { eos_token_ids: vec![plain.0[k]], ..req.clone() };
        let stopped = run(&eos, Some(false));
        assert_eq!(stopped.0, plain.0[..k], "{fixture}: the EOS ends it");
        assert_eq!(run(&eos, None), stopped, "{fixture}: fed against plain, stopped by an EOS id");
        // Sampled: the device draws each token as the host would (the same keyed draw over
        // the same logits, read back in the plain loop): the same tokens, within the
        // logits' CUDA-vs-CPU rounding, which can move a draw only where two candidates'
        // scores or a cut's mass tie that closely.
        let sampling = SamplingParams { temperature: 0.8, top_p: 0.95, min_p: 0.01, seed: 5, ..Default::default() };
        let sampled = GenerateRequest { sampling, ..req.clone() };
        let plain_s = run(&sampled, Some(false));
        assert_eq!(run(&sampled, None), plain_s, "{fixture}: sampled, fed against plain");
        assert_ne!(plain_s.0, plain.0, "{fixture}: a sample differs from the greedy output");
        eprintln!("{fixture}: fed decoding equals plain (20 tokens; EOS after {k}; sampled)");
    }
}

/// The serving engine on CUDA: samples are picked on the device (one id a request read
/// back, not its logits), and every request answers as with the logits read: all greedy
/// (prompts of different lengths, chunked prefill); with a sampled request beside them
/// (drawn on the device as the host draws); with a penalised one (a repetition penalty
/// needs the context: its logits rows alone come back in the same steps).
#[test]
fn cuda_serving_device_picks_answer_as_the_logits_do() {
    use std::collections::HashMap;
    use strata_engine::serving::{BatchEngine, EngineOptions, Finished, ServeRequest, Update};
    if gpu().is_none() {
        return;
    }
    let root = repo_root();
    for fixture in ["glm5/dsa-sparse", "gemma4/moe"] {
        let dir = root.join("fixtures").join(fixture);
        let m = LoadedModel::open_with(&dir, &LoadOptions { device: Device::Cuda(0), ..Default::default() })
            .unwrap_or_else(|e| panic!("{fixture}: {e:#}"));
        let vocab = m.model.info().vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [5usize, 23, 40]
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 37 + 5 + n as u32) % vocab).collect())
            .collect();
        // The batch of a variant: 0 all greedy, 1 one sampled, 2 one sampled with a penalty.
        let batch = |variant: usize| -> Vec<ServeRequest> {
            prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let drawn = SamplingParams { temperature: 1.0, top_p: 0.9, seed: 7, ..Default::default() };
                    let sampling = match (variant, i) {
                        (1, 1) => drawn,
                        (2, 1) => SamplingParams { repetition_penalty: 1.2, ..drawn },
                        _ => SamplingParams::default(),
                    };
                    let mut r = ServeRequest::new(GenerateRequest::new(p.clone(), 16, sampling));
                    r.ignore_eos = true;
                    r
                })
                .collect()
        };
        let run = |variant: usize, picks: bool| -> (Vec<Vec<u32>>, u64, u64) {
            let opts = EngineOptions {
                max_batch: 4,
                kv_tokens: 512,
                context: 128,
                step_tokens: 16,
                prompt_cache_bytes: 0,
                kv_bytes_per_token: m.arch.kv_bytes_per_token(),
                draft_tokens: 0,
            };
            let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts).unwrap();
            engine.set_device_picks(Some(picks));
            let ids: Vec<u64> = batch(variant).into_iter().map(|r| engine.submit(r).unwrap()).collect();
            let mut done: HashMap<u64, Finished> = HashMap::new();
            let mut out = Vec::new();
            while !engine.is_idle() {
                engine.step(&mut out).unwrap();
                for (id, u) in out.drain(..) {
                    if let Update::Done(r) = u {
                        done.insert(id, *r.unwrap_or_else(|e| panic!("{fixture}: request {id}: {e}")));
                    }
                }
            }
            let c = engine.counters();
            (ids.iter().map(|id| done.remove(id).unwrap().output.tokens).collect(), c.picked_samples, c.steps)
        };
        // (ignore_eos: every request samples 16 tokens; beside the penalised one, its 16
        // are not picked.)
        for (variant, want_picked) in [(0, 48), (1, 48), (2, 32)] {
            let (plain, none, _) = run(variant, false);
            let (picked, n, steps) = run(variant, true);
            assert_eq!(none, 0, "{fixture}: picks off");
            assert_eq!(n, want_picked, "{fixture} (variant {variant}): samples picked on the device");
            assert_eq!(picked, plain, "{fixture} (variant {variant}): device picks against logits");
            eprintln!(
                "{fixture}: {n} samples picked on the device in {steps} steps answer as the logits do (variant {variant})"
            );
        }
    }
}
