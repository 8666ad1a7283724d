use super::pins::{mix_ranking, plan_atlas_pins};
use super::*;
use serde_json::json;

fn probes(cats: &[(&str, usize)]) -> ProbeSet {
    ProbeSet {
        schema_version: 1,
        provenance: Provenance { source: "s".into(), source_commit: "c".into(), method: "m".into() },
        categories: cats
            .iter()
            .map(|&(c, n)| (c.to_string(), (0..n).map(|i| format!("{c} prompt {i}")).collect()))
            .collect(),
    }
}

/// A run whose rows select `rows[i]` at layer 1.
fn run(cat: &str, prompt: usize, rows: &[&[usize]]) -> AtlasRun {
    let mut c = RunCounter::new();
    for r in rows {
        c.record(1, r).unwrap();
    }
    c.finish(cat, prompt, rows.len())
}

fn model() -> AtlasModel {
    AtlasModel { name: "t".into(), model_type: "glm_moe_dsa".into(), layers: vec![1], experts_per_layer: 8, top_k: 2 }
}

fn parse_err(v: serde_json::Value) -> String {
    ProbeSet::from_value(&v).unwrap_err().to_string()
}

#[test]
fn probe_sets_are_validated_with_a_message_naming_the_problem() {
    let good = json!({
        "schemaVersion": 1,
        "provenance": {"source": "x", "sourceCommit": "y", "method": "z"},
        "categories": {"code": ["a", "b", "c"], "bible_2": ["d", "e", "f"]}
    });
    let set = ProbeSet::from_value(&good).unwrap();
    assert_eq!(set.categories.keys().collect::<Vec<_>>(), ["bible_2", "code"]);
    assert_eq!(set.prompt_count(), 6);
    // Round trip through the reference's field names.
    assert_eq!(ProbeSet::parse(&serde_json::to_string(&set).unwrap()).unwrap(), set);

    let with = |path: &str, value: serde_json::Value| {
        let mut v = good.clone();
        let mut cur = &mut v;
        let parts: Vec<&str> = path.split('.').collect();
        for p in &parts[..parts.len() - 1] {
            cur = cur.get_mut(*p).unwrap();
        }
        cur.as_object_mut().unwrap().insert(parts[parts.len() - 1].to_string(), value);
        v
    };
    let cases = [
        (json!([1, 2]), "must be a JSON object"),
        (with("schemaVersion", json!(2)), "unsupported schemaVersion 2"),
        (with("provenance.sourceCommit", json!(" ")), "provenance.sourceCommit must be a non-empty string"),
        (with("provenance", json!("x")), "missing provenance"),
        (with("categories", json!([])), "missing categories"),
        (with("categories", json!({"code": ["a", "b", "c"]})), "1 category: an atlas needs at least 2"),
        (with("categories.Code", json!(["a", "b", "c"])), "category \"Code\": names are [a-z0-9_]+"),
        (with("categories.a-b", json!(["a", "b", "c"])), "category \"a-b\""),
        (with("categories.code", json!(["a", "b"])), "category code has 2 prompts: at least 3"),
        (with("categories.code", json!(["a", "", "c"])), "category code: prompt 1 must be a non-empty string"),
        (with("categories.code", json!(["a", 5, "c"])), "prompt 1 must be a non-empty string"),
        (with("categories.code", json!("abc")), "prompts must be an array"),
    ];
    for (v, needle) in cases {
        let e = parse_err(v.clone());
        assert!(e.contains(needle), "{v}: {e}");
    }
    let mut v = good.clone();
    v.as_object_mut().unwrap().remove("schemaVersion");
    assert!(parse_err(v).contains("missing schemaVersion"));
    assert!(ProbeSet::parse("{").unwrap_err().to_string().starts_with("invalid JSON"));
}

#[test]
fn run_counter_refuses_bad_rows_and_sorts_counts() {
    let mut c = RunCounter::new();
    assert!(c.record(3, &[]).unwrap_err().0.contains("no experts"));
    assert!(c.record(3, &[1, 2, 1]).unwrap_err().0.contains("expert 1 appears twice"));
    c.record(3, &[5, 1]).unwrap();
    c.record(2, &[5]).unwrap();
    c.record(3, &[1, 9]).unwrap();
    let r = c.finish("x", 0, 3);
    assert_eq!(r.total_selections, 5);
    assert_eq!(r.counts, vec![(2, 5, 1), (3, 1, 2), (3, 5, 1), (3, 9, 1)]);
    assert_eq!(r.count((3, 1)), 2);
    assert_eq!(r.count((3, 2)), 0);
}

#[test]
fn runs_must_match_the_probe_set_exactly() {
    let prompts = probes(&[("a", 3), ("b", 3)]).prompt_counts();
    let full: Vec<AtlasRun> = ["a", "b"].iter().flat_map(|c| (0..3).map(move |i| run(c, i, &[&[0, 1]]))).collect();
    assert_eq!(checked_runs(&prompts, &full).unwrap().len(), 6);
    let msg = |runs: &[AtlasRun]| checked_runs(&prompts, runs).unwrap_err().0;
    assert!(msg(&full[1..]).contains("missing runs: a:0"));
    let mut dup = full.clone();
    dup.push(full[0].clone());
    assert!(msg(&dup).contains("duplicate run a:0"));
    let mut extra = full.clone();
    extra.push(run("c", 0, &[&[1]]));
    assert!(msg(&extra).contains("run c:0 matches no prompt"));
    extra[6] = run("a", 3, &[&[1]]);
    assert!(msg(&extra).contains("run a:3 matches no prompt"));
    let mut bad = full.clone();
    bad[2].total_selections += 1;
    assert!(msg(&bad).contains("counts sum to 2, not total_selections 3"));
    let mut bad = full.clone();
    bad[2].counts.swap(0, 1);
    assert!(msg(&bad).contains("ascending"));
}

/// Three topics; expert 0 is code's, 1 is bible's, 2 is used by everyone, 3 is rare,
/// 4 fires in only one bible prompt (unreplicated).
fn topic_runs() -> (ProbeSet, Vec<AtlasRun>) {
    let set = probes(&[("bible", 3), ("code", 3), ("news", 3)]);
    let mut runs = Vec::new();
    for p in 0..3 {
        // A long code prompt must not outweigh short ones: shares are per run.
        let n = if p == 0 { 40 } else { 10 };
        let code: Vec<&[usize]> = (0..n).map(|_| &[0usize, 2][..]).collect();
        runs.push(run("code", p, &code));
        let mut bible: Vec<&[usize]> = (0..10).map(|_| &[1usize, 2][..]).collect();
        if p == 1 {
            bible.extend((0..40).map(|_| &[4usize, 2][..]));
        }
        runs.push(run("bible", p, &bible));
        let mut news: Vec<&[usize]> = (0..10).map(|_| &[2usize, 5][..]).collect();
        news.push(&[3, 2]);
        runs.push(run("news", p, &news));
    }
    (set, runs)
}

#[test]
fn analysis_labels_specialists_with_replication_and_per_run_normalisation() {
    let (set, runs) = topic_runs();
    let a = analyse(&set.prompt_counts(), &runs, &AtlasOptions { min_count: 5, ..Default::default() }).unwrap();
    assert_eq!(a.categories, ["bible", "code", "news"]);
    assert_eq!(a.run_count, 9);
    let get = |e: usize| a.experts.iter().find(|x| x.expert == e);
    let code = get(0).unwrap();
    assert_eq!((code.top_topic.as_str(), code.specialization, code.top_lift), ("code", 1.0, 3.0));
    assert_eq!(code.total, 60);
    assert_eq!(code.reliability, Reliability { fired_runs: 3, total_runs: 3 });
    assert_eq!(code.affinity["code"], 1.0);
    assert_eq!(get(1).unwrap().top_topic, "bible");
    // Expert 2 takes half of every run's selections in every category: no preference.
    let shared = get(2).unwrap();
    assert!(shared.specialization.abs() < 1e-6, "{shared:?}");
    assert!((shared.top_lift - 1.0).abs() < 1e-6);
    assert_eq!(shared.top_topic, "bible"); // ties go to the first category
                                           // Expert 3: 3 selections < min_count; expert 4: one bible prompt only.
    assert!(get(3).is_none() && get(4).is_none());
    assert_eq!(a.summary.experts_seen, 6);
    assert_eq!(a.summary.dropped_sparse, 1);
    assert_eq!(a.summary.dropped_unreplicated, 1);
    // 0, 1 and 5 are strong; 2 is not.
    assert_eq!(a.summary.experts_kept, 4);
    assert_eq!(a.summary.strong_specialists, 3);
    assert_eq!(a.summary.strong_specialist_rate, 0.75);
    // Sorted by specialisation, then total.
    assert!(a.experts.windows(2).all(|w| w[0].specialization >= w[1].specialization));
    assert_eq!(a.experts.last().unwrap().expert, 2);
    // With min_runs 1, expert 4 is kept.
    let loose = analyse(&set.prompt_counts(), &runs, &AtlasOptions { min_count: 5, min_runs: 1, ..Default::default() });
    assert!(loose.unwrap().experts.iter().any(|x| x.expert == 4));
}

#[test]
fn analysis_options_are_checked() {
    let (set, runs) = topic_runs();
    let p = set.prompt_counts();
    let e = |o: AtlasOptions| analyse(&p, &runs, &o).unwrap_err().0;
    assert!(e(AtlasOptions { min_count: 0, ..Default::default() }).contains("--min-count"));
    assert!(e(AtlasOptions { min_runs: 0, ..Default::default() }).contains("--min-runs must be at least 1"));
    assert!(e(AtlasOptions { min_runs: 4, ..Default::default() }).contains("--min-runs 4 exceeds the 3 prompts"));
    assert!(e(AtlasOptions { strong_threshold: 1.5, ..Default::default() }).contains("--strong-threshold"));
}

#[test]
fn validation_recognises_separable_topics() {
    let (set, runs) = topic_runs();
    let v = validate(&set.prompt_counts(), &runs, 1).unwrap();
    assert_eq!((v.hits, v.trials, v.accuracy), (9, 9, 1.0));
    assert!((v.chance - 1.0 / 3.0).abs() < 1e-6);
    let t = &v.trials_by_prompt[3]; // code:0
    assert_eq!((t.category.as_str(), t.prompt, t.predicted.as_str()), ("code", 0, "code"));
    assert!(t.own_share > t.best_other_share);
    assert!(validate(&set.prompt_counts(), &runs, 0).unwrap_err().0.contains("--top-k"));
}

#[test]
fn validation_never_sees_the_held_out_prompt() {
    // Each prompt routes to shared experts 0-3 and to one expert of its own that no other
    // prompt uses. Only leakage of the held-out run could identify its category; without
    // it every score is 0 and the prediction falls to the first category.
    let set = probes(&[("a", 3), ("b", 3), ("c", 3)]);
    let mut runs = Vec::new();
    for (ci, c) in ["a", "b", "c"].iter().enumerate() {
        for p in 0..3 {
            let private = 10 + ci * 3 + p;
            runs.push(run(c, p, &[&[0, 1], &[2, 3], &[private, 0]]));
        }
    }
    let v = validate(&set.prompt_counts(), &runs, 2).unwrap();
    assert_eq!(v.hits, 3, "{v:?}");
    assert!(v.trials_by_prompt.iter().all(|t| t.predicted == "a" && t.own_share == 0.0));
}

#[test]
fn default_top_k_is_the_references_200_capped_by_the_model() {
    assert_eq!(default_top_k(19_200, 10), 200);
    assert_eq!(default_top_k(160, 9), 17);
    assert_eq!(default_top_k(3, 9), 1);
}

#[test]
fn atlas_files_round_trip_and_refuse_foreign_json() {
    let (set, runs) = topic_runs();
    let settings = RunSettings { max_tokens: 0, chat: false };
    let opts = AtlasOptions { min_count: 5, ..Default::default() };
    let file = AtlasFile::build(model(), settings, set, runs, &opts, None).unwrap();
    assert_eq!(file.validation.as_ref().unwrap().top_k, 2); // 6 experts seen / 3 topics
    let text = serde_json::to_string_pretty(&file).unwrap();
    let back = AtlasFile::parse(&text).unwrap();
    assert_eq!(back, file);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["summary"]["experts_kept"], 4);
    assert_eq!(v["runs"][0]["counts"][0], json!([1, 1, 10]));

    assert!(AtlasFile::parse("{}").unwrap_err().0.contains("not an atlas file"));
    assert!(AtlasFile::parse(r#"{"format":"x"}"#).unwrap_err().0.contains("is not an atlas"));
    let mut w = v.clone();
    w["schema_version"] = json!(7);
    assert!(AtlasFile::parse(&w.to_string()).unwrap_err().0.contains("schema_version 7"));
    let mut w = v.clone();
    w["runs"].as_array_mut().unwrap().pop();
    assert!(AtlasFile::parse(&w.to_string()).unwrap_err().0.contains("missing runs: news:2"));
    let mut w = v;
    w.as_object_mut().unwrap().remove("model");
    assert!(AtlasFile::parse(&w.to_string()).unwrap_err().0.contains("malformed atlas"));
}

#[test]
fn warm_start_ranks_by_the_topic_mix_and_fits_the_budget() {
    let (set, runs) = topic_runs();
    let opts = AtlasOptions { min_count: 5, ..Default::default() };
    let file = AtlasFile::build(model(), RunSettings { max_tokens: 0, chat: false }, set, runs, &opts, None).unwrap();
    let code = mix_ranking(&file, &["code".into()]).unwrap();
    assert_eq!(code.iter().map(|s| s.expert).collect::<Vec<_>>(), [0, 2]);
    assert!((code[0].share - 0.5).abs() < 1e-9);
    let both = mix_ranking(&file, &["code".into(), "bible".into(), "code".into()]).unwrap();
    assert_eq!(both.iter().map(|s| s.expert).take(3).collect::<Vec<_>>(), [2, 0, 1]);
    let all = mix_ranking(&file, &[]).unwrap();
    assert_eq!(all[0].expert, 2);
    let e = mix_ranking(&file, &["python".into()]).unwrap_err().0;
    assert_eq!(e, "unknown topic \"python\" (this atlas has: bible, code, news)");

    // Tier of 10 slots of 100 bytes, one mandatory: half the tier = 5 pins.
    let plan = plan_atlas_pins(&file, &[], 1000, 100, &[1], 100).unwrap();
    assert_eq!(plan.pins.len(), 5);
    assert_eq!(plan.planned_bytes, 500);
    assert_eq!(plan.keys()[0], (1, 2));
    // Only 1 slot beyond the mandatory ones: the request is limited.
    let tight = plan_atlas_pins(&file, &["code".into()], 300, 200, &[1], 100).unwrap();
    assert_eq!(tight.keys(), vec![(1, 0)]);
    assert!((tight.covered_share - 0.5).abs() < 1e-9);
    // Experts of layers the tier does not manage are skipped.
    assert!(plan_atlas_pins(&file, &[], 1000, 100, &[7], 100).unwrap().pins.is_empty());
}
