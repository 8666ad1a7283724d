//! Speculative decoding (MTP) in the serving engine, on strata-tiny (trained weights
//! with a draft layer): batched, chunked, cached and preempted requests give the tokens
//! plain one-token-a-forward loop gives, greedy and sampled, and their drafts are mostly
//! accepted.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use strata_engine::serving::{BatchEngine, EngineOptions, Finished, ServeRequest, Update};
use strata_engine::{DraftPolicy, GenerateRequest, GenerationOutput, LoadedModel, SamplingParams};

fn model() -> LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    LoadedModel::open(&dir).unwrap()
}

fn prompts(m: &LoadedModel) -> Vec<Vec<u32>> {
    let tok = m.tokenizer().unwrap();
    let long = "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness was upon the face of the deep.";
    [long, "The quick brown fox", "def main():\n    x =", "Once upon a time there was a little"]
        .iter()
        .map(|t| tok.encode(t, true).unwrap())
        .collect()
}

fn request(
    m: &LoadedModel,
    ids: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    draft: usize,
) -> GenerateRequest {
    GenerateRequest {
        eos_token_ids: m.eos_token_ids.clone(),
        draft_tokens: draft,
        draft_policy: DraftPolicy::Fixed,
        ..GenerateRequest::new(ids, max_tokens, sampling)
    }
}

fn opts(m: &LoadedModel, max_batch: usize, kv_tokens: usize, step_tokens: usize, draft: usize) -> EngineOptions {
    EngineOptions {
        max_batch,
        kv_tokens,
        context: 256,
        step_tokens,
        prompt_cache_bytes: 1 << 30,
        kv_bytes_per_token: m.arch.kv_bytes_per_token(),
        draft_tokens: draft,
    }
}

/// Runs `reqs` through the engine, all submitted at once; outputs by submission order.
fn run_all(engine: &mut BatchEngine, reqs: Vec<GenerateRequest>) -> Vec<(Finished, String)> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| engine.submit(ServeRequest::new(r)).unwrap()).collect();
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

/// What `req` gives on the plain reference loop (one token a forward, no drafts).
fn alone(m: &LoadedModel, req: &GenerateRequest) -> GenerationOutput {
    common::reference(m, req, 256)
}

fn check(got: &[(Finished, String)], want: &[GenerationOutput], what: &str) {
    for (i, ((f, streamed), w)) in got.iter().zip(want).enumerate() {
        assert_eq!(f.output.tokens, w.tokens, "{what}: request {i}");
        assert_eq!(f.output.text, w.text, "{what}: request {i}");
        assert_eq!(*streamed, w.text, "{what}: request {i}: the deltas add up to the text");
        assert_eq!(f.output.finish_reason, w.finish_reason, "{what}: request {i}");
    }
}

/// Greedy: the batch engine with drafts gives the tokens of plain one-token decoding,
/// with prompts in chunks beside other requests' verify rows, and again from the prompt
/// cache (whose blocks carry their hidden states to the draft layer); drafts are mostly
/// accepted.
#[test]
fn speculating_batches_decode_what_plain_decoding_does() {
    let m = model();
    let ps = prompts(&m);
    let greedy = SamplingParams::default();
    let want: Vec<_> = ps.iter().map(|p| alone(&m, &request(&m, p.clone(), greedy.clone(), 40, 0))).collect();
    let reqs: Vec<_> = ps.iter().map(|p| request(&m, p.clone(), greedy.clone(), 40, 3)).collect();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 24, 3)).unwrap();
    let got = run_all(&mut engine, reqs.clone());
    check(&got, &want, "first run");
    for (f, _) in &got {
        let mtp = f.output.stats.mtp.as_ref().expect("speculation ran");
        assert!(mtp.drafted > 0 && mtp.acceptance_rate > 0.3, "{mtp:?}");
        assert!(mtp.tokens as usize >= f.output.tokens.len(), "{mtp:?}");
    }
    let c = engine.counters();
    assert!(c.mtp_drafted > 0 && c.mtp_accepted > 0 && c.draft.forwards > 0, "{c:?}");
    assert_eq!(c.draft_tokens, 3);
    // Again: the prompts' blocks come from the cache, the drafts stay as good.
    let again = run_all(&mut engine, reqs);
    check(&again, &want, "from the prompt cache");
    assert!(engine.counters().cache_hit_tokens > 0);
    for ((f, _), (g, _)) in again.iter().zip(&got) {
        let (a, b) = (f.output.stats.mtp.as_ref().unwrap(), g.output.stats.mtp.as_ref().unwrap());
        assert_eq!((a.drafted, a.accepted), (b.drafted, b.accepted), "the draft cache was complete");
    }
}

/// Sampled: each request's text is exactly what decoding without drafts gives for its
/// seed (samples are keyed by position and drafts verified by coupling), and the single-
/// sequence speculative generator's, whatever runs beside it, whether its prompt came from
/// the cache, or it was preempted and computed again; the adaptive policy too.
#[test]
fn sampled_speculation_is_reproducible_beside_others() {
    let m = model();
    let ps = prompts(&m);
    let sampled = |seed| SamplingParams { temperature: 0.9, top_p: 0.95, seed, ..Default::default() };
    let reqs: Vec<_> =
        ps.iter().enumerate().map(|(i, p)| request(&m, p.clone(), sampled(11 + i as u64), 48, 2)).collect();
    let want: Vec<_> = reqs.iter().map(|r| alone(&m, r)).collect();
    // Alone (a batch of one, as `strata generate` runs it), drafting and not.
    for (r, w) in reqs.iter().zip(&want) {
        let solo = common::generate(&m, r);
        assert!(solo.stats.mtp.as_ref().is_some_and(|s| s.drafted > 0 && s.accepted > 0), "{:?}", solo.stats.mtp);
        assert_eq!(solo.tokens, w.tokens, "speculative sampling emits the plain samples");
        let plain = common::generate(&m, &GenerateRequest { draft_tokens: 0, ..r.clone() });
        assert_eq!(plain.tokens, w.tokens, "the engine without drafts emits the reference's samples");
    }
    let adaptive: Vec<_> =
        reqs.iter().map(|r| GenerateRequest { draft_policy: DraftPolicy::Adaptive, ..r.clone() }).collect();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 16, 2)).unwrap();
    check(&run_all(&mut engine, adaptive), &want, "adaptive");
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 16, 2)).unwrap();
    check(&run_all(&mut engine, reqs.clone()), &want, "batched");
    check(&run_all(&mut engine, reqs.clone()), &want, "cached");
    // Too little KV for all four at once: requests are preempted and computed again.
    assert!(ps.iter().all(|p| p.len() + 48 < 96), "the answers fit a context of 96");
    let mut o = opts(&m, 4, 128, 16, 2);
    (o.prompt_cache_bytes, o.context) = (0, 96);
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), o).unwrap();
    check(&run_all(&mut engine, reqs), &want, "preempted");
    assert!(engine.counters().preemptions > 0, "{:?}", engine.counters());
    assert_eq!(engine.counters().kv_free_blocks, 8);
}

/// Requests choose their own drafts (up to the engine's), a request asking for none
/// decodes plainly beside speculating ones, and an engine without drafts runs none.
#[test]
fn requests_draft_what_they_ask_within_the_engine() {
    let m = model();
    let ps = prompts(&m);
    let greedy = SamplingParams::default();
    let reqs = vec![
        request(&m, ps[1].clone(), greedy.clone(), 24, 0),
        request(&m, ps[2].clone(), greedy.clone(), 24, 1),
        request(&m, ps[3].clone(), greedy.clone(), 24, 8),
    ];
    let want: Vec<_> = reqs.iter().map(|r| alone(&m, &GenerateRequest { draft_tokens: 0, ..r.clone() })).collect();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 64, 3)).unwrap();
    let got = run_all(&mut engine, reqs.clone());
    check(&got, &want, "mixed drafts");
    assert!(got[0].0.output.stats.mtp.is_none());
    assert_eq!(got[1].0.output.stats.mtp.as_ref().unwrap().draft_tokens, 1);
    assert_eq!(got[2].0.output.stats.mtp.as_ref().unwrap().draft_tokens, 3, "capped by the engine");
    let mut plain = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 64, 0)).unwrap();
    let got = run_all(&mut plain, reqs);
    check(&got, &want, "no drafts");
    assert!(got.iter().all(|(f, _)| f.output.stats.mtp.is_none()));
    assert_eq!(plain.counters().draft.forwards, 0);
    // A step must hold every decoding request's token and drafts.
    let e = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 8, 1024, 16, 3)).err().unwrap();
    assert!(e.to_string().contains("cannot verify 3 drafts"), "{e}");
}

/// Requests sharing a cached prompt hold its KV blocks once, but each needs its own
/// draft rows: when the draft cache's pool runs out, the newest requests stop drafting
/// (counted) and still answer what plain decoding does.
#[test]
fn a_full_draft_pool_stops_drafting_not_requests() {
    let m = model();
    let ps = prompts(&m);
    let common = [ps[0].as_slice(), &ps[3][1..], &ps[1][1..]].concat();
    assert!(common.len() >= 33, "two whole blocks shared");
    let greedy = SamplingParams::default();
    let reqs: Vec<_> = (0..4)
        .map(|i| {
            let mut p = common.clone();
            p.push(100 + i);
            request(&m, p, greedy.clone(), 40, 3)
        })
        .collect();
    let want: Vec<_> = reqs.iter().map(|r| alone(&m, &GenerateRequest { draft_tokens: 0, ..r.clone() })).collect();
    let blocks = (common.len() + 1 + 40).div_ceil(16);
    // Room for the shared prompt once and each request's own blocks, not four copies.
    let kv = 16 * (blocks + 4 * 2 + 2);
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, kv, 32, 3)).unwrap();
    let got = run_all(&mut engine, reqs);
    check(&got, &want, "draft pool full");
    let c = engine.counters();
    assert!(c.draft.dropped > 0, "{c:?}");
    assert!(got.iter().all(|(f, _)| f.output.stats.mtp.is_some()), "dropped requests keep their statistics");
}

/// A request that does not speculate, on an engine that does, keeps its positions'
/// hidden states only for its prompt: it decodes in fed steps (device picks), and all its
/// full blocks still reach the prompt cache (the generated ones without hidden states).
/// A later speculating request over that text drafts exactly as on a fresh engine: the
/// draft layer never reads hidden states that are not its positions'.
#[test]
fn plain_requests_on_a_speculating_engine_cache_every_block() {
    let m = model();
    let p = prompts(&m)[0].clone();
    let greedy = SamplingParams::default();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 24, 3)).unwrap();
    engine.set_device_picks(Some(true));
    let first = run_all(&mut engine, vec![request(&m, p.clone(), greedy.clone(), 48, 0)]);
    let out = &first[0].0.output;
    assert!(out.stats.decode_fed, "the plain request decoded in fed steps");
    // The prompt and its answer again: every full block comes from the cache.
    let mut again = p.clone();
    again.extend(&out.tokens);
    let hits = engine.counters().cache_hit_tokens;
    run_all(&mut engine, vec![request(&m, again.clone(), greedy.clone(), 4, 0)]);
    let full = (again.len() - 1) / 16 * 16;
    assert_eq!(engine.counters().cache_hit_tokens - hits, full as u64, "every full block was cached");
    // Speculating over the same text drafts as it does with nothing cached.
    let spec = request(&m, again, greedy, 24, 3);
    let cached = run_all(&mut engine, vec![spec.clone()]);
    let mut fresh = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 24, 3)).unwrap();
    fresh.set_device_picks(Some(true));
    let fresh = run_all(&mut fresh, vec![spec]);
    let (a, b) = (cached[0].0.output.stats.mtp.as_ref().unwrap(), fresh[0].0.output.stats.mtp.as_ref().unwrap());
    assert_eq!(cached[0].0.output.tokens, fresh[0].0.output.tokens);
    assert_eq!((a.drafted, a.accepted), (b.drafted, b.accepted), "the draft layer saw the same hidden states");
}

/// The draft epochs measure fed steps too: an engine whose plain decoding runs fed (device
/// picks) still finishes its plain epoch, and keeps both rates where it remembers them.
#[test]
fn fed_plain_epochs_are_measured_and_kept() {
    let m = model();
    let p = prompts(&m)[0].clone();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 1, 1024, 24, 3)).unwrap();
    engine.set_device_picks(Some(true));
    let dir = tempfile::tempdir().unwrap();
    engine.remember_speculation(dir.path());
    let req =
        GenerateRequest { draft_policy: DraftPolicy::Adaptive, ..request(&m, p, SamplingParams::default(), 96, 3) };
    let out = run_all(&mut engine, vec![req]);
    assert!(out[0].0.output.stats.decode_fed, "plain decoding ran fed");
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(".strata/speculation.json")).unwrap()).unwrap();
    let rates = kept["rates"].as_object().unwrap().values().next().unwrap().clone();
    assert!(rates["plain_tokens_per_s"].as_f64().unwrap() > 0.0, "{kept}");
    assert!(rates["speculating_tokens_per_s"].as_f64().unwrap() > 0.0, "{kept}");
}

/// DeepSeek-V3's MTP layer (`model.layers.{n}.{enorm,hnorm,eh_proj,shared_head.*}` and a
/// full decoder layer, as its checkpoints ship it; random here, transformers runs none)
/// drafts through the GLM-5 draft path, and greedy decoding with drafts gives the tokens
/// plain decoding gives.
#[test]
fn deepseek_v3_mtp_layer_drafts_exactly() {
    use strata_storage::{ElementType, SafetensorsFile, SafetensorsWriter, TensorSpec};
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepseek_v3/yarn-groups");
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() && p.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let file = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
    let arch = strata_models::registry::read_arch(&src).unwrap();
    let layers = arch.info().num_layers;
    let mtp: Vec<_> = arch
        .weight_map()
        .specs
        .into_iter()
        .filter(|s| s.optional && s.name.starts_with(&format!("model.layers.{layers}.")))
        .collect();
    assert!(mtp.iter().any(|s| s.name.ends_with("eh_proj.weight")), "the map predicts the MTP layer");
    let mut names: Vec<&String> = file.tensors().keys().collect();
    names.sort();
    let mut specs: Vec<TensorSpec> = names
        .iter()
        .map(|n| TensorSpec {
            name: n.to_string(),
            dtype: file.tensors()[*n].dtype,
            shape: file.tensors()[*n].shape.clone(),
        })
        .collect();
    specs.extend(mtp.iter().map(|s| TensorSpec {
        name: s.name.clone(),
        dtype: ElementType::F32,
        shape: s.shape.clone(),
    }));
    let mut w = SafetensorsWriter::create(&dir.path().join("model.safetensors"), specs).unwrap();
    for n in &names {
        w.write_next(file.bytes(&file.tensors()[*n]).unwrap()).unwrap();
    }
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for s in &mtp {
        let n: usize = s.shape.iter().product();
        let std = if s.shape.len() == 2 { 1.0 / (s.shape[1] as f32).sqrt() } else { 0.1 };
        let bytes: Vec<u8> = (0..n)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                let norm = s.name.contains("norm") && s.shape.len() == 1;
                (if norm { 1.0 + 0.1 * u } else { std * u }).to_le_bytes()
            })
            .collect();
        w.write_next(&bytes).unwrap();
    }
    w.finish().unwrap();
    let m = LoadedModel::open(dir.path()).unwrap();
    let ps = prompts(&m);
    let greedy = SamplingParams::default();
    let want: Vec<_> = ps.iter().map(|p| alone(&m, &request(&m, p.clone(), greedy.clone(), 24, 0))).collect();
    let reqs: Vec<_> = ps.iter().map(|p| request(&m, p.clone(), greedy.clone(), 24, 2)).collect();
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts(&m, 4, 1024, 24, 2)).unwrap();
    let got = run_all(&mut engine, reqs);
    check(&got, &want, "deepseek_v3 with drafts");
    let c = engine.counters();
    assert!(c.mtp_drafted > 0 && c.draft.forwards > 0, "{c:?}");
}
