//! The Atlas runner and the perplexity scorer on the shipped model (`models/strata-tiny`),
//! checked against the generator's own logits and routes.

use std::path::{Path, PathBuf};
use strata_engine::atlas::{run_prompt, ProbeOptions};
use strata_engine::perplexity::{compare, perplexity, windows};
use strata_engine::{LoadOptions, LoadedModel};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny")
}

const TEXT: &str = "And it came to pass in those days, that the people went up into the mountain to pray; \
and the elders of the city sat in the gate, and they gave thanks unto the LORD for the rain.";

/// Mean NLL of `ids[from..]` from one all-positions forward over `ids`.
fn nll_direct(m: &LoadedModel, ids: &[u32], from: usize) -> (f64, usize) {
    let logits = m.scorer().unwrap().logits(ids, true).unwrap();
    let mut sum = 0f64;
    for t in from..ids.len() {
        let row = &logits[t - 1];
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        sum += lse - row[ids[t] as usize] as f64;
    }
    (sum, ids.len() - from)
}

#[test]
fn perplexity_matches_the_generators_logits() {
    let m = LoadedModel::open(&tiny()).unwrap();
    let ids = m.tokenizer().unwrap().encode(TEXT, true).unwrap();
    let n = ids.len();
    assert!(n > 30, "{n}");
    // One window covering the text: every token from one forward.
    let r = perplexity(m.model.as_ref(), &ids, n, n, &mut |_, _| {}).unwrap();
    let (sum, count) = nll_direct(&m, &ids, 1);
    assert_eq!((r.scored, r.windows), (count, 1));
    assert!((r.mean_nll - sum / count as f64).abs() < 1e-6, "{} vs {}", r.mean_nll, sum / count as f64);
    assert!((r.perplexity - r.mean_nll.exp()).abs() < 1e-9);
    // Sliding windows (context 16, stride 5): each window recomputed from a fresh cache.
    let (context, stride) = (16, 5);
    let r = perplexity(m.model.as_ref(), &ids, context, stride, &mut |_, _| {}).unwrap();
    let mut total = 0f64;
    for w in windows(n, context, stride).unwrap() {
        let logits = m.scorer().unwrap().logits(&ids[w.begin..w.end], true).unwrap();
        for t in w.score_from..w.end {
            let row = &logits[t - 1 - w.begin];
            let lse = row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
            total += lse - row[ids[t] as usize] as f64;
        }
    }
    assert_eq!(r.scored, n - 1);
    assert!((r.mean_nll - total / (n - 1) as f64).abs() < 1e-6);
    // Less context scores worse on this text.
    let full = perplexity(m.model.as_ref(), &ids, n, n, &mut |_, _| {}).unwrap();
    assert!(r.mean_nll > full.mean_nll, "{} vs {}", r.mean_nll, full.mean_nll);
    // A model against itself: no divergence.
    let c = compare(m.model.as_ref(), m.model.as_ref(), &ids, 16, 8, &mut |_, _| {}).unwrap();
    assert_eq!((c.mean_kl, c.max_abs_logit_diff, c.top1_agreement), (0.0, 0.0, 1.0));
    assert_eq!(c.reference, c.candidate);
    // Bad input.
    let e = perplexity(m.model.as_ref(), &[1, 999_999], 4, 2, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
}

#[test]
fn probe_runs_count_every_row_of_every_forward() {
    let opts = LoadOptions { context: 600, ..Default::default() };
    let m = LoadedModel::open_with(&tiny(), &opts).unwrap();
    // Longer than one prefill chunk (256), so the prompt takes two forwards.
    let long = TEXT.repeat(8);
    let n = m.tokenizer().unwrap().encode(&long, true).unwrap().len();
    assert!(n > 256 && n + 8 <= 600, "{n}");
    let run = run_prompt(&m, "bible", 2, &long, &ProbeOptions { max_tokens: 8, chat: false }).unwrap();
    assert_eq!((run.category.as_str(), run.prompt), ("bible", 2));
    assert_eq!(run.tokens, n + 8);
    // 5 routed layers x top-4 per position.
    assert_eq!(run.total_selections, (run.tokens * 5 * 4) as u64);
    assert!(run.counts.iter().all(|&(l, e, c)| (1..=5).contains(&l) && e < 32 && c > 0));
    // The same prompt alone gives the same prompt counts (fresh cache each run).
    let again = run_prompt(&m, "bible", 2, &long, &ProbeOptions { max_tokens: 8, chat: false }).unwrap();
    assert_eq!(again, run);
    let e = run_prompt(&m, "bible", 0, &TEXT.repeat(20), &ProbeOptions::default()).unwrap_err();
    assert!(e.to_string().contains("prompt bible:0 has"), "{e}");
}
