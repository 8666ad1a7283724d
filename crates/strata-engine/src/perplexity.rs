//! Perplexity with the usual sliding-window method, and a comparison of two models
//! (e.g. a converted checkpoint against its source) on the same windows.
//!
//! Windows of `context` tokens start every `stride` tokens; each window scores only the
//! tokens the previous one did not, so every token but the first is scored exactly once,
//! with at least `context - stride` tokens of left context once the first window is
//! past. Each window runs from a fresh cache, in forwards of at most one prefill chunk,
//! and only the forwards holding scored positions return logits.

use crate::scorer::Scorer;
use anyhow::{bail, Result};
use serde::Serialize;
use std::time::Instant;
use strata_models::Model;

/// One window: positions `begin..end` run; tokens `score_from..end` are scored (each from
/// the logits of the position before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub begin: usize,
    pub end: usize,
    pub score_from: usize,
}

/// The windows over `n` tokens; refuses `context < 2`, `stride` outside `1..=context`
/// and fewer than 2 tokens.
pub fn windows(n: usize, context: usize, stride: usize) -> Result<Vec<Window>> {
    if context < 2 {
        bail!("--context must be at least 2, got {context}");
    }
    if stride == 0 || stride > context {
        bail!("--stride must be in 1..={context} (the context), got {stride}");
    }
    if n < 2 {
        bail!("the text has {n} token{}: at least 2 are needed to score one", if n == 1 { "" } else { "s" });
    }
    let mut out = Vec::new();
    let (mut begin, mut scored_to) = (0, 1);
    loop {
        let end = (begin + context).min(n);
        out.push(Window { begin, end, score_from: scored_to });
        scored_to = end;
        if end == n {
            return Ok(out);
        }
        begin += stride;
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PerplexityReport {
    /// Tokens in the text.
    pub tokens: usize,
    /// Tokens scored (all but the first).
    pub scored: usize,
    pub windows: usize,
    pub context: usize,
    pub stride: usize,
    /// Mean negative log-likelihood (nats per token).
    pub mean_nll: f64,
    pub perplexity: f64,
    pub seconds: f64,
}

/// Two models on the same windows; the reference's distribution is `p`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CompareReport {
    pub reference: PerplexityReport,
    pub candidate: PerplexityReport,
    /// Mean over scored positions of KL(p_reference || p_candidate), nats.
    pub mean_kl: f64,
    pub max_kl: f64,
    /// Largest |logit difference| over every scored position and vocabulary entry.
    pub max_abs_logit_diff: f64,
    /// Share of positions where the two argmaxes agree.
    pub top1_agreement: f64,
}

/// A scorer for windows of `context` positions in forwards of at most `rows` tokens
/// (default: the model's prefill chunk). (A scorer records no routes unless asked.)
fn scorer(model: &dyn Model, context: usize, rows: Option<usize>) -> Result<Scorer<'_>> {
    if context > model.info().max_context {
        bail!("--context {context} exceeds the model's {} positions", model.info().max_context);
    }
    if rows == Some(0) {
        bail!("forwards of 0 rows score nothing: give at least 1");
    }
    Scorer::with_rows(model, context, rows.unwrap_or(model.prefill_chunk()))
}

/// `ln(sum(exp(row)))`, in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln()
}

fn arg_max(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Drives every window chunk by chunk through `runners`; `f(target_position, rows)` gets
/// each scored position's logits from every runner.
fn drive(
    runners: &mut [Scorer<'_>],
    ids: &[u32],
    windows: &[Window],
    progress: &mut dyn FnMut(usize, usize),
    f: &mut dyn FnMut(usize, &[&[f32]]),
) -> Result<()> {
    let step = runners.iter().map(Scorer::rows).min().unwrap_or(1).max(1);
    let vocab = runners[0].vocab();
    let (total, mut done) = (ids.len() - 1, 0);
    for w in windows {
        runners.iter_mut().for_each(Scorer::reset);
        let mut c = w.begin;
        while c < w.end {
            let e = (c + step).min(w.end);
            // Row at position p predicts p + 1: wanted when p + 1 is in score_from..end.
            let want = e > w.score_from.saturating_sub(1);
            let mut outs: Vec<&[f32]> = Vec::with_capacity(runners.len());
            for r in runners.iter_mut() {
                let l = r.chunk(&ids[c..e], want)?;
                debug_assert!(!want || l.len() == (e - c) * vocab);
                outs.push(l);
            }
            if want {
                for p in c..e {
                    let target = p + 1;
                    if target >= w.score_from && target < w.end {
                        let rows: Vec<&[f32]> = outs.iter().map(|l| &l[(p - c) * vocab..(p - c + 1) * vocab]).collect();
                        f(target, &rows);
                        done += 1;
                    }
                }
                progress(done, total);
            }
            c = e;
        }
    }
    Ok(())
}

fn report(ids: &[u32], windows: usize, context: usize, stride: usize, nll: f64, seconds: f64) -> PerplexityReport {
    let scored = ids.len() - 1;
    let mean = nll / scored as f64;
    PerplexityReport {
        tokens: ids.len(),
        scored,
        windows,
        context,
        stride,
        mean_nll: mean,
        perplexity: mean.exp(),
        seconds,
    }
}

/// Perplexity of `model` on `ids`; `progress(scored, total)`.
pub fn perplexity(
    model: &dyn Model,
    ids: &[u32],
    context: usize,
    stride: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PerplexityReport> {
    perplexity_in_forwards_of(model, ids, context, stride, None, progress)
}

/// [`perplexity`] in forwards of at most `rows` tokens (1: a token a forward, as decode
/// runs: what approximate decode, `--skip-misses-from-rank`, acts on).
pub fn perplexity_in_forwards_of(
    model: &dyn Model,
    ids: &[u32],
    context: usize,
    stride: usize,
    rows: Option<usize>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PerplexityReport> {
    let ws = windows(ids.len(), context, stride)?;
    check_ids(model, ids)?;
    let t0 = Instant::now();
    let mut runners = [scorer(model, context, rows)?];
    let mut nll = 0f64;
    drive(&mut runners, ids, &ws, progress, &mut |t, rows| {
        nll += log_sum_exp(rows[0]) - rows[0][ids[t] as usize] as f64;
    })?;
    Ok(report(ids, ws.len(), context, stride, nll, t0.elapsed().as_secs_f64()))
}

fn check_ids(model: &dyn Model, ids: &[u32]) -> Result<()> {
    let vocab = model.info().vocab_size;
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {t} is outside the vocabulary ({vocab})");
    }
    Ok(())
}

/// `reference` and `candidate` on the same windows: both perplexities, the KL divergence
/// from the reference and the largest logit difference.
pub fn compare(
    reference: &dyn Model,
    candidate: &dyn Model,
    ids: &[u32],
    context: usize,
    stride: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CompareReport> {
    if reference.info().vocab_size != candidate.info().vocab_size {
        bail!(
            "the models' vocabularies differ ({} and {} entries)",
            reference.info().vocab_size,
            candidate.info().vocab_size
        );
    }
    let ws = windows(ids.len(), context, stride)?;
    check_ids(reference, ids)?;
    let t0 = Instant::now();
    let mut runners = [scorer(reference, context, None)?, scorer(candidate, context, None)?];
    let (mut nll_r, mut nll_c, mut kl_sum, mut kl_max, mut diff_max, mut agree) =
        (0f64, 0f64, 0f64, 0f64, 0f64, 0usize);
    drive(&mut runners, ids, &ws, progress, &mut |t, rows| {
        let (r, c) = (rows[0], rows[1]);
        let (lr, lc) = (log_sum_exp(r), log_sum_exp(c));
        let target = ids[t] as usize;
        nll_r += lr - r[target] as f64;
        nll_c += lc - c[target] as f64;
        let mut kl = 0f64;
        for (&a, &b) in r.iter().zip(c) {
            let lp = a as f64 - lr;
            kl += lp.exp() * (lp - (b as f64 - lc));
            diff_max = diff_max.max((a - b).abs() as f64);
        }
        kl_sum += kl;
        kl_max = kl_max.max(kl);
        agree += usize::from(arg_max(r) == arg_max(c));
    })?;
    let seconds = t0.elapsed().as_secs_f64();
    let n = (ids.len() - 1) as f64;
    Ok(CompareReport {
        reference: report(ids, ws.len(), context, stride, nll_r, seconds),
        candidate: report(ids, ws.len(), context, stride, nll_c, seconds),
        mean_kl: kl_sum / n,
        max_kl: kl_max,
        max_abs_logit_diff: diff_max,
        top1_agreement: agree as f64 / n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_score_every_token_once_with_enough_context() {
        for (n, context, stride) in [(10, 4, 2), (10, 4, 4), (11, 4, 3), (3, 8, 8), (1000, 256, 128), (7, 2, 1)] {
            let ws = windows(n, context, stride).unwrap();
            let mut scored = vec![0; n];
            for w in &ws {
                assert!(w.end - w.begin <= context && w.begin <= w.score_from && w.score_from <= w.end);
                for (t, s) in scored.iter_mut().enumerate().take(w.end).skip(w.score_from) {
                    *s += 1;
                    if w.begin > 0 {
                        assert!(t - w.begin >= context - stride, "{n} {context} {stride}: {w:?} token {t}");
                    }
                }
            }
            assert_eq!(scored[0], 0);
            assert!(scored[1..].iter().all(|&s| s == 1), "{n} {context} {stride}: {scored:?}");
            assert_eq!(ws.last().unwrap().end, n);
        }
        assert_eq!(
            windows(10, 4, 2).unwrap(),
            [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
                .map(|(b, e, s)| Window { begin: b, end: e, score_from: s })
                .to_vec()
        );
        assert!(windows(10, 1, 1).unwrap_err().to_string().contains("--context must be at least 2"));
        assert!(windows(10, 4, 5).unwrap_err().to_string().contains("--stride must be in 1..=4"));
        assert!(windows(10, 4, 0).is_err());
        assert!(windows(1, 4, 2).unwrap_err().to_string().contains("1 token: at least 2"));
    }

    #[test]
    fn log_sum_exp_is_stable() {
        assert!((log_sum_exp(&[0.0, 0.0]) - 2f64.ln()).abs() < 1e-12);
        assert!((log_sum_exp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-9);
        assert_eq!(arg_max(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
