//! The serving engine against the fixture model: a request's output is the same whatever
//! runs beside it (batched, chunked, preempted, or from the prompt cache), and each
//! serving option does what it says.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use strata_engine::sampling::{TokenConstraint, TokenMask};
use strata_engine::serving::{BatchEngine, EngineOptions, Finished, ServeRequest, Update};
use strata_engine::{FinishReason, GenerateRequest, LoadedModel, SamplingParams};

fn model() -> LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/glm5/dsa-sparse");
    LoadedModel::open(&dir).unwrap()
}

fn prompts(m: &LoadedModel) -> Vec<Vec<u32>> {
    let tok = m.tokenizer().unwrap();
    let long = "the quick brown fox jumps over the lazy dog ".repeat(6);
    ["Hello", "Once upon a time there was", &long, "a b c d e f g h i j k l m n o p q r s t u v w"]
        .iter()
        .map(|t| tok.encode(t, true).unwrap())
        .collect()
}

fn request(m: &LoadedModel, ids: Vec<u32>, seed: u64, max_tokens: usize) -> GenerateRequest {
    let sampling = SamplingParams { temperature: 1.0, top_p: 0.95, seed, ..Default::default() };
    GenerateRequest {
        eos_token_ids: m.eos_token_ids.clone(),
        stop_strings: vec!["zz".into()],
        ..GenerateRequest::new(ids, max_tokens, sampling)
    }
}

fn opts(m: &LoadedModel, max_batch: usize, kv_tokens: usize, context: usize, step_tokens: usize) -> EngineOptions {
    EngineOptions {
        max_batch,
        kv_tokens,
        context,
        step_tokens,
        prompt_cache_bytes: 1 << 30,
        kv_bytes_per_token: m.arch.kv_bytes_per_token(),
        draft_tokens: 0,
    }
}

/// Runs `reqs` through the engine, all submitted at once; outputs by submission order.
fn run_all(engine: &mut BatchEngine, reqs: Vec<ServeRequest>) -> Vec<(Finished, String)> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| engine.submit(r).unwrap()).collect();
    let mut done: HashMap<u64, Finished> = HashMap::new();
    let mut text: HashMap<u64, String> = HashMap::new();
    let mut out = Vec::new();
    let mut steps = 0;
    while !engine.is_idle() {
        engine.step(&mut out).unwrap();
        for (id, u) in out.drain(..) {
            match u {
                Update::Delta { text: t, .. } => text.entry(id).or_default().push_str(&t),
                Update::Done(r) => {
                    done.insert(id, *r.unwrap_or_else(|e| panic!("request {id}: {e}")));
                }
            }
        }
        steps += 1;
        assert!(steps < 10_000, "the engine does not finish");
    }
    ids.iter().map(|id| (done.remove(id).unwrap(), text.remove(id).unwrap_or_default())).collect()
}

/// What `req` gives on the plain reference loop.
fn alone(m: &LoadedModel, req: &GenerateRequest, context: usize) -> strata_engine::GenerationOutput {
    common::reference(m, req, context)
}

#[test]
fn batched_chunked_and_cached_outputs_equal_running_alone() {
    let m = model();
    let ps = prompts(&m);
    let reqs: Vec<GenerateRequest> =
        ps.iter().enumerate().map(|(i, p)| request(&m, p.clone(), 7 + i as u64, 24)).collect();
    let want: Vec<_> = reqs.iter().map(|r| alone(&m, r, 256)).collect();
    // Prompt chunks of at most 16 rows interleaved with decode rows.
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 256, 16)).unwrap();
    let got = run_all(&mut engine, reqs.iter().cloned().map(ServeRequest::new).collect());
    for ((f, streamed), w) in got.iter().zip(&want) {
        assert_eq!(f.output.tokens, w.tokens);
        assert_eq!(f.output.text, w.text);
        assert_eq!(*streamed, w.text, "the deltas add up to the text");
        assert_eq!(f.output.finish_reason, w.finish_reason);
    }
    let c = engine.counters();
    assert!(c.decode_rows > 0 && c.prefill_rows > 0 && c.steps < c.rows, "{c:?}");
    // The same requests again: the prompts' full blocks come from the cache.
    let again = run_all(&mut engine, reqs.iter().cloned().map(ServeRequest::new).collect());
    for ((f, _), (w, p)) in again.iter().zip(want.iter().zip(&ps)) {
        assert_eq!(f.output.tokens, w.tokens);
        let cached = f.output.stats.prompt_tokens - f.output.stats.prefill_tokens;
        assert_eq!(cached, (p.len() - 1) / 16 * 16, "prompt of {}", p.len());
    }
    assert!(engine.counters().cache_hit_tokens > 0);
}

#[test]
fn requests_with_a_common_prompt_compute_it_once() {
    let m = model();
    let p = prompts(&m)[2][..50].to_vec();
    let reqs: Vec<GenerateRequest> = (0..3).map(|i| request(&m, p.clone(), 40 + i, 12)).collect();
    let want: Vec<_> = reqs.iter().map(|r| alone(&m, r, 256)).collect();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 256, 16)).unwrap();
    let got = run_all(&mut engine, reqs.into_iter().map(ServeRequest::new).collect());
    let cached: Vec<usize> =
        got.iter().map(|(f, _)| f.output.stats.prompt_tokens - f.output.stats.prefill_tokens).collect();
    assert_eq!(cached, vec![0, 48, 48]);
    for ((f, _), w) in got.iter().zip(&want) {
        assert_eq!(f.output.tokens, w.tokens);
    }
}

#[test]
fn preempted_requests_still_answer_the_same() {
    let m = model();
    let ps = prompts(&m);
    let reqs: Vec<GenerateRequest> =
        ps.iter().enumerate().map(|(i, p)| request(&m, p[..p.len().min(40)].to_vec(), 100 + i as u64, 40)).collect();
    let want: Vec<_> = reqs.iter().map(|r| alone(&m, r, 96)).collect();
    // Eight blocks for four sequences that want up to six each, no cache to fall back on.
    let mut o = opts(&m, 4, 128, 96, 32);
    o.prompt_cache_bytes = 0;
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), o).unwrap();
    let got = run_all(&mut engine, reqs.into_iter().map(ServeRequest::new).collect());
    for ((f, _), w) in got.iter().zip(&want) {
        assert_eq!(f.output.tokens, w.tokens);
        assert_eq!(f.output.finish_reason, w.finish_reason);
    }
    assert!(engine.counters().preemptions > 0, "{:?}", engine.counters());
    assert_eq!(engine.counters().kv_free_blocks, 8);
}

/// Allows only `allowed` tokens, and is done after `len` of them.
struct Only {
    allowed: Vec<u32>,
    len: usize,
    seen: usize,
}

impl TokenConstraint for Only {
    fn fill_mask(&mut self, mask: &mut TokenMask) -> anyhow::Result<()> {
        self.allowed.iter().for_each(|&t| mask.allow(t));
        Ok(())
    }
    fn commit(&mut self, token: u32) -> anyhow::Result<()> {
        anyhow::ensure!(self.allowed.contains(&token), "token {token} was not allowed");
        self.seen += 1;
        Ok(())
    }
    fn is_done(&self) -> bool {
        self.seen >= self.len
    }
}

#[test]
fn serving_options_shape_the_output() {
    let m = model();
    let ps = prompts(&m);
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 256, 64)).unwrap();
    let greedy = |max| {
        let mut r = request(&m, ps[1].clone(), 1, max);
        r.sampling.temperature = 0.0;
        r.stop_strings.clear();
        r
    };
    let base = run_all(&mut engine, vec![ServeRequest::new(greedy(8))]).remove(0).0.output.tokens;
    // A grammar, a bias that forces a token, stop ids and logprobs, in one batch.
    let mut constrained = ServeRequest::new(greedy(20));
    constrained.constraint = Some(Box::new(Only { allowed: vec![5, 9], len: 3, seen: 0 }));
    let mut biased = ServeRequest::new(greedy(4));
    biased.logit_bias = vec![(17, 1000.0)];
    biased.logprobs = Some(2);
    let mut stopped = ServeRequest::new(greedy(8));
    stopped.stop_token_ids = vec![base[2]];
    let mut at_least = ServeRequest::new(greedy(8));
    at_least.ignore_eos = true;
    at_least.min_tokens = 8;
    let got = run_all(&mut engine, vec![constrained, biased, stopped, at_least]);
    let c = &got[0].0.output;
    assert_eq!(c.tokens.len(), 3, "{c:?}");
    assert!(c.tokens.iter().all(|t| [5, 9].contains(t)));
    assert_eq!(c.finish_reason, FinishReason::Stop);
    let b = &got[1].0;
    assert_eq!(b.output.tokens, vec![17; 4]);
    assert_eq!(b.logprobs.len(), 4);
    assert_eq!(b.logprobs[0].top.len(), 2);
    assert!(b.logprobs[0].logprob <= b.logprobs[0].top[0].1);
    let s = &got[2].0.output;
    assert_eq!((s.tokens.as_slice(), s.finish_reason), (&base[..2], FinishReason::Stop));
    assert_eq!(got[3].0.output.tokens.len(), 8);
    // Cancelling a running request frees its sequence.
    let id = engine.submit(ServeRequest::new(greedy(200))).unwrap();
    let mut out = Vec::new();
    engine.step(&mut out).unwrap();
    let f = engine.cancel(id).unwrap();
    assert_eq!(f.output.finish_reason, FinishReason::Cancelled);
    assert!(engine.is_idle());
    let c = engine.counters();
    assert_eq!(c.kv_free_blocks + c.cache_blocks, c.kv_total_blocks);
}

/// Samples picked on the device (forced here, on the CPU) answer exactly as samples from
/// logits read back: a batch of greedy requests with chunked prompts; then with a sampled
/// request beside them (drawn on the device too, with the same keyed draws); then with a
/// repetition penalty, and with a `min_tokens` ban in force for a while (the steps those
/// sample in read the logits back).
#[test]
fn device_picks_answer_as_the_logits_do() {
    let m = model();
    let ps = prompts(&m);
    let greedy = |ids: Vec<u32>| GenerateRequest {
        eos_token_ids: m.eos_token_ids.clone(),
        stop_strings: vec!["zz".into()],
        ..GenerateRequest::new(ids, 20, SamplingParams::default())
    };
    // The batch of a variant: 0 all greedy, 1 one sampled, 2 one with a `min_tokens` ban,
    // 3 one sampled with a repetition penalty.
    let batch = |variant: usize| -> Vec<ServeRequest> {
        let mut reqs: Vec<ServeRequest> = ps.iter().map(|p| ServeRequest::new(greedy(p.clone()))).collect();
        match variant {
            1 => reqs[1] = ServeRequest::new(request(&m, ps[1].clone(), 3, 20)),
            2 => reqs[0].min_tokens = 6,
            3 => {
                let mut r = request(&m, ps[1].clone(), 3, 20);
                r.sampling.repetition_penalty = 1.3;
                reqs[1] = ServeRequest::new(r);
            }
            _ => {}
        }
        reqs
    };
    let run = |variant: usize, picks: bool| {
        let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 256, 16)).unwrap();
        engine.set_device_picks(Some(picks));
        let out = run_all(&mut engine, batch(variant));
        let c = engine.counters();
        (out, c.picked_steps, c.picked_samples)
    };
    let mut all_greedy_samples = 0;
    for (variant, what) in ["all greedy", "one sampled", "one banned", "one penalised"].into_iter().enumerate() {
        let (plain, none, none_samples) = run(variant, false);
        let (picked, n, samples) = run(variant, true);
        assert_eq!((none, none_samples), (0, 0), "{what}: picks off");
        assert!(n > 0 && samples > 0, "{what}: nothing picked on the device");
        // Beside a penalised (or banned) request the device picks the other samples of the
        // same steps and the others' logits come back: equal outputs say they were valid.
        match variant {
            0 => all_greedy_samples = samples,
            3 => assert!(samples < all_greedy_samples, "{what}: {samples} picked, {all_greedy_samples} all greedy"),
            _ => {}
        }
        for (i, ((p, pt), (q, qt))) in plain.iter().zip(&picked).enumerate() {
            assert_eq!(p.output.tokens, q.output.tokens, "{what}, request {i}: tokens");
            assert_eq!((&p.output.text, pt), (&q.output.text, qt), "{what}, request {i}: text");
            assert_eq!(p.output.finish_reason, q.output.finish_reason, "{what}, request {i}: finish");
        }
    }
}

/// Fed steps (each step queued before the picks of the one before are read, every pick
/// fed to the next forward on the device) answer as one step at a time does: requests
/// that end at different steps (token limit, end-of-sequence ids, a stop string, the
/// context) beside ones that go on, greedy and sampled; a request arriving while steps are
/// fed; a request cancelled while its pick is in flight.
#[test]
fn fed_steps_answer_as_one_step_at_a_time() {
    let m = model();
    let ps = prompts(&m);
    let context = 240;
    // Request 1 ends on an end-of-sequence id it meets mid-way: one its output holds.
    let ends_on = std::cell::Cell::new(None::<u32>);
    let reqs = |sampled: bool| -> Vec<GenerateRequest> {
        ps.iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = request(&m, p.clone(), 7 + i as u64, [5, 23, 40, 200][i]);
                if !sampled {
                    r.sampling = SamplingParams::default();
                }
                if let (1, Some(t)) = (i, ends_on.get()) {
                    r.eos_token_ids = vec![t];
                }
                r
            })
            .collect()
    };
    let run = |picks: bool, reqs: Vec<GenerateRequest>, late: Option<GenerateRequest>, cancel: bool| {
        let mut engine =
            BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, context, 64)).unwrap();
        engine.set_device_picks(Some(picks));
        let ids: Vec<u64> = reqs.into_iter().map(|r| engine.submit(ServeRequest::new(r)).unwrap()).collect();
        let mut done: HashMap<u64, Finished> = HashMap::new();
        let mut out = Vec::new();
        let mut late_id = None;
        let mut steps = 0;
        while !engine.is_idle() {
            engine.step(&mut out).unwrap();
            steps += 1;
            if steps == 6 {
                if let Some(r) = late.clone() {
                    late_id = Some(engine.submit(ServeRequest::new(r)).unwrap());
                }
                if cancel {
                    engine.cancel(ids[3]);
                }
            }
            for (id, u) in out.drain(..) {
                if let Update::Done(r) = u {
                    done.insert(id, *r.unwrap_or_else(|e| panic!("request {id}: {e}")));
                }
            }
            assert!(steps < 10_000);
        }
        let mut all: Vec<Option<Finished>> = ids.iter().map(|id| done.remove(id)).collect();
        all.push(late_id.and_then(|id| done.remove(&id)));
        (all, engine.counters())
    };
    for sampled in [false, true] {
        ends_on.set(None);
        let probe = run(false, reqs(sampled), None, false).0;
        ends_on.set(Some(probe[1].as_ref().unwrap().output.tokens[8]));
        let (plain, c0) = run(false, reqs(sampled), None, false);
        let (fed, c1) = run(true, reqs(sampled), None, false);
        assert_eq!(c0.fed_steps, 0);
        assert!(c1.fed_steps > 10, "{c1:?}");
        for (i, (p, f)) in plain.iter().zip(&fed).enumerate().take(4) {
            let (p, f) = (p.as_ref().unwrap(), f.as_ref().unwrap());
            assert_eq!(p.output.tokens, f.output.tokens, "sampled {sampled}, request {i}: tokens");
            assert_eq!(p.output.text, f.output.text, "sampled {sampled}, request {i}: text");
            assert_eq!(p.output.finish_reason, f.output.finish_reason, "sampled {sampled}, request {i}: finish");
            assert!(f.output.stats.decode_fed || f.output.tokens.len() < 3, "request {i} was fed");
        }
        let reasons: Vec<FinishReason> =
            plain.iter().take(4).map(|p| p.as_ref().unwrap().output.finish_reason).collect();
        assert!(reasons.contains(&FinishReason::Length) && reasons.contains(&FinishReason::Stop), "{reasons:?}");
        // A request arriving mid-way, and one cancelled with its pick in flight.
        let late = request(&m, ps[2][..10].to_vec(), 99, 30);
        let (plain, _) = run(false, reqs(sampled), Some(late.clone()), true);
        let (fed, _) = run(true, reqs(sampled), Some(late), true);
        let (p, f) = (plain[4].as_ref().unwrap(), fed[4].as_ref().unwrap());
        assert_eq!(p.output.tokens, f.output.tokens, "sampled {sampled}: the late request");
        for i in 0..3 {
            let (p, f) = (plain[i].as_ref().unwrap(), fed[i].as_ref().unwrap());
            assert_eq!(p.output.tokens, f.output.tokens, "sampled {sampled}, request {i} beside the late one");
        }
    }
}
