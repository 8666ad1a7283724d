//! Decoding fed on the device (each token picked by the backend, greedy or drawn, and fed
//! to the next forward there, which is queued before the host reads the pick) gives what
//! steps one at a time give: the same tokens, text and finish reason when the request ends on
//! its token limit, on an EOS id met mid-way, on a stop string and on a full context; and
//! the same cache afterwards (a second turn that reuses it continues identically). The
//! one-step-at-a-time engine is checked against the plain reference loop as well.

mod common;

use std::path::{Path, PathBuf};
use strata_engine::experts::{RuntimeOptions, UsageSetting};
use strata_engine::{GenerateRequest, GenerationOutput, LoadOptions, LoadedModel, SamplingParams};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn open(dir: &Path, context: usize) -> LoadedModel {
    let opts = LoadOptions {
        device: strata_engine::Device::Cpu,
        mtp: false,
        require_mtp: false,
        budget: None,
        gpu_budget: None,
        context,
        runtime: RuntimeOptions { usage: UsageSetting::Off, ..Default::default() },
    };
    LoadedModel::open_with(dir, &opts).unwrap()
}

/// Two turns of `req` on one engine (the second extends the first's prompt and output,
/// its prefix from the prompt cache), one step at a time and fed.
fn two_turns(m: &LoadedModel, req: &GenerateRequest, fed: bool) -> [GenerationOutput; 2] {
    let mut engine = m.engine(Some(0)).unwrap();
    engine.set_device_picks(Some(fed));
    let first = common::generate_on(&mut engine, req).unwrap();
    assert_eq!(first.stats.decode_fed, fed, "decode_fed");
    assert_eq!(engine.counters().fed_steps > 0, fed, "fed steps");
    let mut next = req.clone();
    next.prompt_ids.extend_from_slice(&first.tokens);
    next.prompt_ids.push(7);
    next.truncate_left = true;
    let second = common::generate_on(&mut engine, &next).unwrap();
    [first, second]
}

fn same(name: &str, what: &str, m: &LoadedModel, req: &GenerateRequest) -> Vec<u32> {
    let plain = two_turns(m, req, false);
    let fed = two_turns(m, req, true);
    for (turn, (p, f)) in plain.iter().zip(&fed).enumerate() {
        assert_eq!(p.tokens, f.tokens, "{name}, {what}, turn {turn}: tokens");
        assert_eq!(p.text, f.text, "{name}, {what}, turn {turn}: text");
        assert_eq!(p.finish_reason, f.finish_reason, "{name}, {what}, turn {turn}: finish");
        assert_eq!(p.stats.prefill_tokens, f.stats.prefill_tokens, "{name}, {what}, turn {turn}: cached prefix");
    }
    let reference = common::reference(m, req, m.context);
    assert_eq!(
        (&plain[0].tokens, &plain[0].text, plain[0].finish_reason),
        (&reference.tokens, &reference.text, reference.finish_reason),
        "{name}, {what}: the engine against the reference loop"
    );
    plain[0].tokens.clone()
}

fn cases(name: &str, m: &LoadedModel, prompt: Vec<u32>) {
    let vocab = m.model.info().vocab_size as u32;
    let prompt: Vec<u32> = prompt.into_iter().map(|t| t % vocab).collect();
    let req = GenerateRequest::new(prompt.clone(), 12, SamplingParams::default());
    let out = same(name, "token limit", m, &req);
    assert_eq!(out.len(), 12, "{name}: 12 tokens");
    // An EOS id first met mid-way: the fed loop has queued a forward past it.
    let k = (4..out.len()).find(|&k| !out[..k].contains(&out[k])).expect("a fresh token mid-way");
    let eos = GenerateRequest { eos_token_ids: vec![out[k]], ..req.clone() };
    let stopped = same(name, "eos", m, &eos);
    assert_eq!(stopped, out[..k], "{name}: the EOS ends the output");
    // The context fills before the token limit.
    let full = GenerateRequest { max_tokens: 100, ..req.clone() };
    let filled = same(name, "full context", m, &full);
    assert!(filled.len() < 100, "{name}: the context ends it");
    // Sampled decoding is fed too (each draw keyed as the host's), with the same tokens:
    // top-p and min-p; top-k with a higher temperature.
    for (what, sampling) in [
        ("sampled, top-p", SamplingParams { temperature: 0.7, top_p: 0.9, min_p: 0.02, seed: 1, ..Default::default() }),
        ("sampled, top-k", SamplingParams { temperature: 1.3, top_k: 5, seed: 2, ..Default::default() }),
    ] {
        let sampled = GenerateRequest { sampling, ..req.clone() };
        let toks = same(name, what, m, &sampled);
        assert_ne!(toks, out, "{name}, {what}: a sample differs from the greedy output");
    }
    // A repetition penalty needs the context: not fed (the flag is honoured where it can be).
    let mut engine = m.engine(Some(0)).unwrap();
    engine.set_device_picks(Some(true));
    let penalised = SamplingParams { temperature: 0.7, repetition_penalty: 1.2, seed: 1, ..Default::default() };
    let penalised = GenerateRequest { sampling: penalised, ..req };
    assert!(!common::generate_on(&mut engine, &penalised).unwrap().stats.decode_fed, "{name}: penalised");
}

#[test]
fn fed_equals_plain_on_every_family() {
    for name in [
        "glm5/dsa-sparse",
        "glm5/fp8",
        "glm4_moe/gqa-bias",
        "qwen3_moe/gqa-renorm",
        "minimax_m2/gqa-full",
        "deepseek_v3/yarn-groups",
        "deepseek_v3/kimi-fp8",
        "gemma4/moe",
        "gemma4/dense-ple",
    ] {
        let m = open(&root().join("fixtures").join(name), 40);
        cases(name, &m, (0..20).map(|i| i * 37 + 5).collect());
    }
}

#[test]
fn fed_equals_plain_on_strata_tiny_with_stop_strings() {
    let m = open(&root().join("models/strata-tiny"), 64);
    let tok = m.tokenizer().expect("strata-tiny has a tokenizer");
    let prompt = tok.encode("The history of the river town begins with", true).unwrap();
    cases("strata-tiny", &m, prompt.clone());
    // A stop string cut from the middle of the plain output.
    let req = GenerateRequest::new(prompt, 24, SamplingParams::default());
    let text = common::reference(&m, &req, 64).text;
    let stop: String = text.chars().skip(text.chars().count() / 2).take(3).collect();
    assert!(!stop.trim().is_empty(), "a stop string from {text:?}");
    let req = GenerateRequest { stop_strings: vec![stop.clone()], ..req };
    let plain = two_turns(&m, &req, false);
    let fed = two_turns(&m, &req, true);
    assert_eq!(plain[0].finish_reason, strata_engine::FinishReason::Stop, "stop string {stop:?}");
    for (p, f) in plain.iter().zip(&fed) {
        assert_eq!((&p.tokens, &p.text, p.finish_reason), (&f.tokens, &f.text, f.finish_reason));
    }
}

/// A row fed a pick the session never made is refused, naming it, and the sequence is
/// left as it was.
#[test]
fn a_row_fed_a_missing_pick_is_refused() {
    use strata_models::{fed, Batch, Logits, SessionOptions};
    let m = open(&root().join("fixtures/glm5/dsa-sparse"), 40);
    let mut s = m.model.new_session(SessionOptions::single(40, 8)).unwrap();
    let seq = s.add_sequence().unwrap();
    let mut b = Batch::new();
    b.push(seq, &[fed(0)], Logits::Last);
    let e = s.forward(&b).unwrap_err().to_string();
    assert!(e.contains("greedy pick 0") && e.contains("picked 0 tokens"), "{e}");
    assert_eq!(s.len(seq), 0);
    // After a forward that picked one token, pick 0 feeds and pick 1 is refused.
    b.clear();
    b.push(seq, &[5, 6], Logits::Last);
    b.pick_greedy();
    s.forward(&b).unwrap();
    let mut picks = Vec::new();
    s.take_picks(&mut picks).unwrap();
    assert_eq!(picks.len(), 1);
    b.clear();
    b.push(seq, &[fed(1)], Logits::Last);
    let e = s.forward(&b).unwrap_err().to_string();
    assert!(e.contains("greedy pick 1") && e.contains("picked 1 token"), "{e}");
    assert_eq!(s.len(seq), 2);
    b.clear();
    b.push(seq, &[fed(0)], Logits::Last);
    s.forward(&b).unwrap();
    assert_eq!(s.len(seq), 3);
    assert!(s.take_picks(&mut picks).is_err(), "no picks were asked for");
}

/// Logits rows read beside the picks: the rows asked for come back (equal to the logits of
/// the same forward without picks), and rows out of range or out of order are refused by
/// name with the sequences left as they were.
#[test]
fn logits_rows_read_beside_the_picks() {
    use strata_models::{Batch, Logits, SessionOptions};
    let m = open(&root().join("fixtures/glm5/dsa-sparse"), 40);
    let vocab = m.model.info().vocab_size;
    let run = |pick: Option<&[u32]>| {
        let opts = SessionOptions { max_seqs: 3, kv_tokens: 120, max_len: 40, max_rows: 16 };
        let mut s = m.model.new_session(opts).unwrap();
        let seqs: Vec<_> = (0..3).map(|_| s.add_sequence().unwrap()).collect();
        let mut b = Batch::new();
        for (i, &q) in seqs.iter().enumerate() {
            b.push(q, &[5 + i as u32, 9, 11], Logits::Last);
        }
        if let Some(read) = pick {
            b.pick_greedy();
            b.read_logits_rows(read.iter().copied());
        }
        let r = s.forward(&b).map(|()| s.logits().to_vec());
        let lens: Vec<usize> = seqs.iter().map(|&q| s.len(q)).collect();
        (r, lens)
    };
    let (all, _) = run(None);
    let all = all.unwrap();
    let (got, _) = run(Some(&[0, 2]));
    let got = got.unwrap();
    assert_eq!(got.len(), 3 * vocab, "every logits row keeps its place");
    for r in [0, 2] {
        assert_eq!(got[r * vocab..(r + 1) * vocab], all[r * vocab..(r + 1) * vocab], "row {r}");
    }
    for bad in [&[3u32][..], &[1, 1], &[2, 0]] {
        let (r, lens) = run(Some(bad));
        let e = r.unwrap_err().to_string();
        assert!(e.contains("read beside the picks"), "{bad:?}: {e}");
        assert_eq!(lens, vec![0, 0, 0], "{bad:?}: the sequences are as they were");
    }
}

/// Samples count once taken, and fed decoding queues no row past a request's token limit:
/// requests that end at different steps count their own samples and forwards only.
#[test]
fn fed_picks_count_the_samples_taken() {
    use strata_engine::serving::{ServeRequest, Update};
    let m = open(&root().join("fixtures/glm5/dsa-sparse"), 128);
    let vocab = m.model.info().vocab_size as u32;
    let mut engine = m.engine(Some(0)).unwrap();
    engine.set_device_picks(Some(true));
    let mut ids = Vec::new();
    for (n, max_tokens) in [(5u32, 16usize), (23, 11), (40, 7)] {
        let prompt: Vec<u32> = (0..n).map(|i| (i * 37 + 5 + n) % vocab).collect();
        let mut r = ServeRequest::new(GenerateRequest::new(prompt, max_tokens, SamplingParams::default()));
        r.ignore_eos = true;
        ids.push(engine.submit(r).unwrap());
    }
    let (mut out, mut tokens) = (Vec::new(), 0);
    while !engine.is_idle() {
        engine.step(&mut out).unwrap();
        for (_, u) in out.drain(..) {
            if let Update::Done(r) = u {
                tokens += r.unwrap().output.tokens.len();
            }
        }
    }
    let c = engine.counters();
    assert_eq!(tokens, 16 + 11 + 7);
    assert!(c.fed_steps > 0, "{c:?}");
    assert_eq!(c.picked_samples, tokens as u64, "{c:?}");
    // A forward a token after each request's first, none past its end (the last pick of a
    // request at its token limit feeds no row).
    assert_eq!(c.decode_rows, 15 + 10 + 6, "{c:?}");
}
