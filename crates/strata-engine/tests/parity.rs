//! Parity with transformers on the committed fixtures (`fixtures/glm5/*`,
//! `fixtures/glm4_moe/*`, `fixtures/qwen3_moe/*`, `fixtures/minimax_m2/*`, `fixtures/deepseek_v3/*`,
//! `fixtures/gpt_oss/*`, `fixtures/qwen3_next/*` and `fixtures/gemma4/*`, made by
//! `scripts/make_<family>_fixtures.py`): logits at
//! every prompt position within 1e-4, the 32 greedy tokens identical, and each decode
//! step's logits within 1e-4.

mod common;

use std::path::{Path, PathBuf};
use strata_engine::{GenerateRequest, LoadedModel, SamplingParams};
use strata_storage::{ElementType, SafetensorsFile};

const TOL: f32 = 1e-4;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

struct Reference {
    file: SafetensorsFile,
}

impl Reference {
    fn open(path: &Path) -> Self {
        Self { file: SafetensorsFile::open(path).unwrap() }
    }
    fn has(&self, name: &str) -> bool {
        self.file.tensors().contains_key(name)
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let t = &self.file.tensors()[name];
        assert_eq!(t.dtype, ElementType::I64, "{name}");
        self.file.bytes(t).unwrap().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
    }
    fn matrix(&self, name: &str) -> Vec<Vec<f32>> {
        let t = &self.file.tensors()[name];
        assert_eq!(t.dtype, ElementType::F32, "{name}");
        let cols = t.shape[1];
        let flat: Vec<f32> =
            self.file.bytes(t).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        flat.chunks(cols).map(|r| r.to_vec()).collect()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn fixture_dirs(family: &str) -> Vec<PathBuf> {
    let root = repo_root().join("fixtures").join(family);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists() && p.join("config.json").exists())
        .collect();
    dirs.sort();
    dirs
}

fn check_fixture(dir: &Path) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let m = LoadedModel::open(dir).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let r = Reference::open(&dir.join("reference.safetensors"));
    let prompt = r.ids("prompt_ids");

    // Tokenization of the recorded prompt text.
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    if let Some(text) = meta.get("prompt_text").or_else(|| meta.get("prompt")).and_then(|v| v.as_str()) {
        assert_eq!(m.tokenizer().unwrap().encode(text, true).unwrap(), prompt, "{name}: tokenization");
    }

    // Prefill: logits at every prompt position.
    let mut gen = m.scorer().unwrap();
    let got = gen.logits(&prompt, true).unwrap();
    let want = r.matrix("prompt_logits");
    assert_eq!(got.len(), want.len());
    let worst = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
    assert!(worst < TOL, "{name}: prompt logits differ by {worst}");

    // Greedy decode against the cache: identical tokens, logits within tolerance.
    let gen_ids = r.ids("generated_ids");
    let req = GenerateRequest::new(prompt.clone(), gen_ids.len(), SamplingParams::default());
    let out = common::generate(&m, &req);
    assert_eq!(out.tokens, gen_ids, "{name}: greedy tokens");

    if r.has("generated_logits") {
        let want = r.matrix("generated_logits");
        let mut gen = m.scorer().unwrap();
        gen.prefill(&prompt).unwrap();
        for (i, &t) in gen_ids.iter().enumerate() {
            let d = max_abs_diff(gen.last_logits(), &want[i]);
            assert!(d < TOL, "{name}: decode step {i} logits differ by {d}");
            if i + 1 < gen_ids.len() {
                gen.step(t).unwrap();
            }
        }
    }
    eprintln!("{name}: parity ok (prompt {} tokens, worst prefill diff {worst:.2e})", prompt.len());
}

/// Every fixture of `family` (at least `at_least` of them) against its reference.
fn check_family(family: &str, at_least: usize) {
    let dirs = fixture_dirs(family);
    assert!(dirs.len() >= at_least, "{family}: expected at least {at_least} fixtures, found {dirs:?}");
    for d in dirs {
        check_fixture(&d);
    }
}

#[test]
fn glm5_fixtures_match_transformers() {
    check_family("glm5", 3);
}

#[test]
fn glm4_moe_fixtures_match_transformers() {
    check_family("glm4_moe", 2);
}

/// Qwen3-MoE: softmax routing with and without renormalisation, dense layers by
/// `mlp_only_layers` and `decoder_sparse_step`, a head_dim wider than hidden / heads, and a
/// sliding window shorter than the prompt.
#[test]
fn qwen3_moe_fixtures_match_transformers() {
    check_family("qwen3_moe", 2);
}

/// MiniMax-M2: q/k norms over the whole projections, partial rotary, sigmoid routing with
/// a correction bias, Mixtral's expert names.
#[test]
fn minimax_m2_fixtures_match_transformers() {
    check_family("minimax_m2", 2);
}

/// DeepSeek-V3 and Kimi K2: MLA without the DSA indexer, YaRN RoPE (interpolated low
/// frequencies, the softmax scale grown by mscale^2), grouped noaux_tc routing, and an FP8
/// block-scaled checkpoint with `model_type` kimi_k2.
#[test]
fn deepseek_v3_fixtures_match_transformers() {
    check_family("deepseek_v3", 2);
}

/// gpt-oss: attention sinks, q/k/v/o biases, YaRN without truncation, sliding and full
/// layers by `layer_types`, a biased router with a softmax over the top-k, experts with
/// biases and the clamped SwiGLU, gate and up interleaved; the experts read in place from
/// MXFP4 blocks (`mxfp4-yarn`, the reference computed from the same nibbles) and from
/// transformers' own `[E, H, 2I]` layout in bf16 (`bf16-plain`).
#[test]
fn gpt_oss_fixtures_match_transformers() {
    check_family("gpt_oss", 2);
}

/// Qwen3-Next: gated DeltaNet layers (convolution, the gated delta rule on a recurrent
/// state, the gated norm) beside gated full attention with partial RoPE, `1 + w` norms, a
/// sigmoid-gated shared expert; with a dense layer, one value head per key head and tied
/// embeddings in `bf16-dense`.
#[test]
fn qwen3_next_fixtures_match_transformers() {
    check_family("qwen3_next", 2);
}

/// Qwen3.5-MoE: Qwen3-Next's network with the DeltaNet's projections apart and the
/// multimodal rotary embedding driven by text; `text-f32` is the text model's checkpoint
/// (`Qwen3_5MoeForCausalLM`), `vl-bf16` the vision-language one (`model.language_model.`
/// weights beside a vision tower that is described, not run).
#[test]
fn qwen3_5_moe_fixtures_match_transformers() {
    check_family("qwen3_5_moe", 2);
}

/// Gemma 4 dense (PLE, KV sharing, double-wide MLP, soft cap) and MoE (dense MLP beside
/// GELU experts, k_eq_v, the `gemma4` wrapper's weight names); every prompt is longer than
/// the sliding window, and decoding runs past it through the sliding layers' rings.
#[test]
fn gemma4_fixtures_match_transformers() {
    // (The image fixtures have their own test.)
    let dirs: Vec<PathBuf> = fixture_dirs("gemma4")
        .into_iter()
        .filter(|d| !d.file_name().unwrap().to_string_lossy().starts_with("vision"))
        .collect();
    assert!(dirs.len() >= 2, "expected at least two fixtures, found {dirs:?}");
    for d in dirs {
        check_fixture(&d);
    }
}

/// transformers' runtime layout (fused `gate_up_proj` / `down_proj` per layer) loads to the
/// same model as the per-expert layout of the Hub checkpoints.
#[test]
fn fused_expert_layout_matches_per_expert() {
    use strata_storage::{SafetensorsWriter, TensorSpec, WeightStore};
    let src = repo_root().join("fixtures/glm5/dsa-sparse");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let (n, inter, h) = (
        cfg["n_routed_experts"].as_u64().unwrap() as usize,
        cfg["moe_intermediate_size"].as_u64().unwrap() as usize,
        cfg["hidden_size"].as_u64().unwrap() as usize,
    );
    let store = WeightStore::open_dir(&src).unwrap();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut fused_layers = std::collections::BTreeSet::new();
    for name in store.names() {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            if let Some((layer, _)) = rest.split_once(".mlp.experts.") {
                fused_layers.insert(layer.parse::<usize>().unwrap());
                continue;
            }
        }
        let shape = store.shape(name).unwrap();
        tensors.push((name.to_string(), shape.clone(), f32_bytes(&store.load_f32(name, &shape, None).unwrap())));
    }
    for l in fused_layers {
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..n {
            let p = format!("model.layers.{l}.mlp.experts.{e}");
            gate_up.extend(store.load_f32(&format!("{p}.gate_proj.weight"), &[inter, h], None).unwrap());
            gate_up.extend(store.load_f32(&format!("{p}.up_proj.weight"), &[inter, h], None).unwrap());
            down.extend(store.load_f32(&format!("{p}.down_proj.weight"), &[h, inter], None).unwrap());
        }
        tensors.push((
            format!("model.layers.{l}.mlp.experts.gate_up_proj"),
            vec![n, 2 * inter, h],
            f32_bytes(&gate_up),
        ));
        tensors.push((format!("model.layers.{l}.mlp.experts.down_proj"), vec![n, h, inter], f32_bytes(&down)));
    }
    let specs = tensors
        .iter()
        .map(|(name, shape, _)| TensorSpec {
            name: name.clone(),
            dtype: strata_storage::ElementType::F32,
            shape: shape.clone(),
        })
        .collect();
    let mut w = SafetensorsWriter::create(&dir.path().join("model.safetensors"), specs).unwrap();
    for (_, _, bytes) in &tensors {
        w.write_next(bytes).unwrap();
    }
    w.finish().unwrap();

    let ids: Vec<u32> = (0..20).map(|i| (i * 37 % 400) as u32).collect();
    let logits = |d: &Path| {
        let m = LoadedModel::open(d).unwrap();
        let mut g = m.scorer().unwrap();
        g.logits(&ids, true).unwrap()
    };
    assert_eq!(logits(&src), logits(dir.path()));
}

/// The sliding layers' rings wrap: forwards of 3 rows (rings of 16 positions for a window
/// of 8) give the reference's prompt and decode logits; two sequences in one batch each
/// keep their own ring; a rollback inside the ring continues exactly, one past it starts
/// the sequence over.
#[test]
fn gemma4_sliding_rings_wrap_roll_back_and_batch() {
    use strata_models::{Batch, Logits, SessionOptions};
    let dir = repo_root().join("fixtures/gemma4/dense-ple");
    let m = LoadedModel::open(&dir).unwrap();
    let r = Reference::open(&dir.join("reference.safetensors"));
    let (prompt, want) = (r.ids("prompt_ids"), r.matrix("prompt_logits"));
    let (gen_ids, gen_logits) = (r.ids("generated_ids"), r.matrix("generated_logits"));
    let vocab = m.model.info().vocab_size;
    let opts = SessionOptions { max_seqs: 2, kv_tokens: 512, max_len: 256, max_rows: 6 };
    let mut s = m.model.new_session(opts).unwrap();
    let (a, b) = (s.add_sequence().unwrap(), s.add_sequence().unwrap());
    let mut batch = Batch::new();
    // Sequence a in chunks of 3 rows, sequence b in chunks of 3 beside it (6 rows a forward).
    for (i, chunk) in prompt.chunks(3).enumerate() {
        batch.clear();
        batch.push(a, chunk, Logits::All);
        batch.push(b, chunk, Logits::All);
        s.forward(&batch).unwrap();
        let l = s.logits();
        for (j, row) in l.chunks(vocab).enumerate() {
            let pos = i * 3 + j % chunk.len();
            let d = max_abs_diff(row, &want[pos]);
            assert!(d < TOL, "chunked prefill, row {j} (position {pos}) differs by {d}");
        }
    }
    // Decode both; then roll a back 2 positions (inside its ring) and redo them.
    let steps = 12;
    let mut seen = Vec::new();
    for i in 0..steps {
        batch.clear();
        let t = if i == 0 { None } else { Some(gen_ids[i - 1]) };
        if let Some(t) = t {
            batch.push(a, &[t], Logits::Last);
            batch.push(b, &[t], Logits::Last);
            s.forward(&batch).unwrap();
            for row in s.logits().chunks(vocab) {
                let d = max_abs_diff(row, &gen_logits[i]);
                assert!(d < TOL, "decode step {i} differs by {d}");
            }
            seen.push(s.logits()[..vocab].to_vec());
        }
    }
    let len = s.len(a);
    s.truncate(a, len - 2);
    assert_eq!(s.len(a), len - 2, "a rollback inside the ring keeps the positions");
    for k in 0..2 {
        batch.clear();
        batch.push(a, &[gen_ids[steps - 3 + k]], Logits::Last);
        s.forward(&batch).unwrap();
        let d = max_abs_diff(&s.logits()[..vocab], &seen[seen.len() - 2 + k]);
        assert!(d == 0.0, "redone step {k} differs by {d}");
    }
    // Past the ring (16 positions held, window 8): the sequence starts over.
    s.truncate(b, 20);
    assert_eq!(s.len(b), 0, "a rollback past the ring starts the sequence over");
}

/// Qwen3-Next's sequences carry recurrent state: two sequences in chunks of 3 rows beside
/// each other give the reference's prompt and decode logits; a truncation starts the
/// sequence over (its state holds the whole prefix), and feeding the prefix again gives
/// the same logits (up to the summation order of other row counts); a session shares no
/// prefixes.
#[test]
fn qwen3_next_sequences_carry_their_state() {
    use strata_models::{Batch, Logits, SessionOptions};
    let dir = repo_root().join("fixtures/qwen3_next/hybrid-f32");
    let m = LoadedModel::open(&dir).unwrap();
    let r = Reference::open(&dir.join("reference.safetensors"));
    let (prompt, want) = (r.ids("prompt_ids"), r.matrix("prompt_logits"));
    let (gen_ids, gen_logits) = (r.ids("generated_ids"), r.matrix("generated_logits"));
    let vocab = m.model.info().vocab_size;
    let opts = SessionOptions { max_seqs: 2, kv_tokens: 512, max_len: 256, max_rows: 6 };
    let mut s = m.model.new_session(opts).unwrap();
    assert!(!s.shares_prefixes());
    let (a, b) = (s.add_sequence().unwrap(), s.add_sequence().unwrap());
    let mut batch = Batch::new();
    for (i, chunk) in prompt.chunks(3).enumerate() {
        batch.clear();
        batch.push(a, chunk, Logits::All);
        batch.push(b, chunk, Logits::All);
        s.forward(&batch).unwrap();
        for (j, row) in s.logits().chunks(vocab).enumerate() {
            let pos = i * 3 + j % chunk.len();
            let d = max_abs_diff(row, &want[pos]);
            assert!(d < TOL, "chunked prefill, row {j} (position {pos}) differs by {d}");
        }
    }
    let mut last = Vec::new();
    for (i, &t) in gen_ids.iter().take(6).enumerate() {
        batch.clear();
        batch.push(a, &[t], Logits::Last);
        batch.push(b, &[t], Logits::Last);
        s.forward(&batch).unwrap();
        for row in s.logits().chunks(vocab) {
            let d = max_abs_diff(row, &gen_logits[i + 1]);
            assert!(d < TOL, "decode step {} differs by {d}", i + 1);
        }
        last = s.logits()[..vocab].to_vec();
    }
    // A rollback cannot keep part of the state: the sequence starts over, and the same
    // tokens fed again give the same logits.
    let len = s.len(a);
    s.truncate(a, len - 2);
    assert_eq!(s.len(a), 0, "a truncation starts the sequence over");
    let fed: Vec<u32> = prompt.iter().chain(&gen_ids[..6]).copied().collect();
    for chunk in fed.chunks(5) {
        batch.clear();
        batch.push(a, chunk, Logits::Last);
        s.forward(&batch).unwrap();
    }
    let d = max_abs_diff(&s.logits()[..vocab], &last);
    assert!(d < 1e-5, "the re-fed sequence differs by {d}");
    // A row that does not continue its sequence's state is refused.
    s.truncate(b, 0);
    batch.clear();
    batch.push(b, &prompt[..2], Logits::Last);
    s.forward(&batch).unwrap();
    s.kv_mut().unwrap().truncate(b, 1);
    batch.clear();
    batch.push(b, &prompt[1..2], Logits::Last);
    let err = format!("{:#}", s.forward(&batch).unwrap_err());
    assert!(err.contains("recurrent state"), "{err}");
}

/// Gemma 4 with an image (`fixtures/gemma4/vision*`, made by
/// `scripts/make_gemma4_vision_fixtures.py`): the image file through strata's processor
/// and vision tower gives transformers' soft tokens; the prompt (text, `<boi>`, the image
/// tokens, `<eoi>`, text: longer than the sliding window) gives its logits at every
/// position, and greedy decoding its tokens and logits; with causal attention everywhere
/// (`vision`) and with `use_bidirectional_attention: "vision"` (`vision-bidir`: image
/// tokens see their whole image on sliding layers; `vision-large`: the processor's
/// default budget of 280 and an image of 272 soft tokens, more than a CPU forward's 256
/// rows, which a forward must hold whole).
#[test]
fn gemma4_image_fixtures_match_transformers() {
    for name in ["vision", "vision-bidir", "vision-large"] {
        check_image_fixture(name);
    }
}

fn check_image_fixture(name: &str) {
    use strata_engine::image::Rgb8;
    use strata_engine::media;
    let dir = repo_root().join("fixtures/gemma4").join(name);
    let m = LoadedModel::open(&dir).unwrap();
    let r = Reference::open(&dir.join("reference.safetensors"));
    let img = Rgb8::open(&dir.join("image.png")).unwrap();
    let spec = media::vision_spec(&m).unwrap();
    let patches = media::processor(&m, &spec).unwrap().process(&img).unwrap();
    let want_px: Vec<f32> = match r.has("pixel_values") {
        true => r.matrix("pixel_values").concat(),
        // A noiseless image's patches, stored as its bytes.
        false => r.file.bytes(&r.file.tensors()["pixel_bytes"]).unwrap().iter().map(|&b| b as f32 / 255.0).collect(),
    };
    assert_eq!(patches.pixels.len(), want_px.len());
    assert!(max_abs_diff(&patches.pixels, &want_px) < 1e-6, "processor pixels differ");
    let media = media::encode_images(&m, &[img]).unwrap();
    let feats = r.matrix("image_features").concat();
    let d = max_abs_diff(&media.rows, &feats);
    assert!(d < TOL, "image features differ by {d}");

    let prompt = r.ids("prompt_ids");
    let want = r.matrix("prompt_logits");
    assert!(prompt.len() > 8, "the prompt is longer than the sliding window");
    let mut gen = m.scorer().unwrap();
    let got = gen.logits_with_media(&prompt, &media, true).unwrap();
    let worst = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
    assert!(worst < TOL, "prompt logits differ by {worst}");
    if !spec.bidirectional {
        // Attended causally, an image splits across forwards like text.
        let mut small = strata_engine::Scorer::with_rows(m.model.as_ref(), m.context, 16).unwrap();
        let got = small.logits_with_media(&prompt, &media, true).unwrap();
        let split = got.iter().zip(&want).map(|(g, w)| max_abs_diff(g, w)).fold(0.0, f32::max);
        assert!(split < TOL, "{name}: an image split over forwards of 16 rows: logits differ by {split}");
    }

    let (gen_ids, gen_logits) = (r.ids("generated_ids"), r.matrix("generated_logits"));
    let mut gen = m.scorer().unwrap();
    gen.prefill_with_media(&prompt, &media).unwrap();
    for (i, &t) in gen_ids.iter().enumerate() {
        let l = gen.last_logits();
        let d = max_abs_diff(l, &gen_logits[i]);
        assert!(d < TOL, "decode step {i} logits differ by {d}");
        let argmax = l.iter().enumerate().fold((0, f32::MIN), |a, (j, &v)| if v > a.1 { (j, v) } else { a }).0;
        assert_eq!(argmax as u32, t, "greedy token {i}");
        if i + 1 < gen_ids.len() {
            gen.step(t).unwrap();
        }
    }
    // The placeholder run must match the processor's soft-token count.
    let mut short = prompt.clone();
    short.retain(|&t| t != spec.image_token_id);
    let err = m.scorer().unwrap().logits_with_media(&short, &media, false).unwrap_err();
    assert!(format!("{err:#}").contains(&format!("{} soft tokens", media.len())), "{err:#}");
    assert_eq!(spec.bidirectional, name != "vision");
    eprintln!("{name}: parity ok (prompt {} tokens, worst prefill diff {worst:.2e}, features {d:.2e})", prompt.len());
}

/// A checkpoint holding a tensor its config does not predict is refused, naming the
/// tensor (every decoder family); its scales and quantized parts beside a mapped tensor
/// are not strangers.
#[test]
fn tensors_the_config_does_not_predict_are_refused_by_name() {
    use strata_storage::{SafetensorsWriter, TensorSpec};
    for family in ["glm4_moe", "qwen3_moe", "minimax_m2", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe"] {
        // (One whose weights are not FP8: the test adds a scale of its own.)
        let src = &fixture_dirs(family)
            .into_iter()
            .find(|d| !std::fs::read_to_string(d.join("config.json")).unwrap().contains("quantization_config"))
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() && p.file_name().unwrap() != "model.safetensors" {
                std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
            }
        }
        let file = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
        let mut names: Vec<&String> = file.tensors().keys().collect();
        names.sort();
        let write = |extra: &str| {
            let mut specs: Vec<TensorSpec> = names
                .iter()
                .map(|n| {
                    let t = &file.tensors()[*n];
                    TensorSpec { name: n.to_string(), dtype: t.dtype, shape: t.shape.clone() }
                })
                .collect();
            specs.push(TensorSpec { name: extra.into(), dtype: ElementType::F32, shape: vec![3] });
            let mut w = SafetensorsWriter::create(&dir.path().join("model.safetensors"), specs).unwrap();
            for n in &names {
                w.write_next(file.bytes(&file.tensors()[*n]).unwrap()).unwrap();
            }
            w.write_next(&[0u8; 12]).unwrap();
            w.finish().unwrap();
        };
        write("model.layers.0.mlp.surprise.weight");
        let err = format!("{:#}", LoadedModel::open(dir.path()).err().expect("refused"));
        assert!(err.contains("`model.layers.0.mlp.surprise.weight` is not one the config predicts"), "{family}: {err}");
        // (Qwen3-Next's layer 0 is linear attention.)
        match family {
            "qwen3_next" | "qwen3_5_moe" => write("model.layers.0.linear_attn.out_proj.weight_scale_inv"),
            _ => write("model.layers.0.self_attn.o_proj.weight_scale_inv"),
        }
        assert!(LoadedModel::open(dir.path()).is_ok(), "{family}: a scale beside a mapped tensor");
    }
}
