//! Whole models on CUDA against transformers' references and the CPU backend.

use super::*;

/// The checkout holding `fixtures/` and `models/`: `$STRATA_REPO_ROOT` (a test binary
/// taken to another machine), else the one this test was built from.
pub(crate) fn repo_root() -> PathBuf {
    match std::env::var_os("STRATA_REPO_ROOT") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap(),
    }
}

fn open(dir: &Path, device: Device) -> LoadedModel {
    LoadedModel::open_with(dir, &LoadOptions { device, ..Default::default() })
        .unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()))
}

fn tensor_f32(f: &SafetensorsFile, name: &str) -> Vec<f32> {
    let t = &f.tensors()[name];
    assert_eq!(t.dtype, ElementType::F32, "{name}");
    f.bytes(t).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn tensor_ids(f: &SafetensorsFile, name: &str) -> Vec<u32> {
    let t = &f.tensors()[name];
    assert_eq!(t.dtype, ElementType::I64, "{name}");
    f.bytes(t).unwrap().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Logits (max |difference|) of f32 checkpoints, and of every decode step.
const TOL: f32 = 1e-4;
/// Prompt logits of bf16 checkpoints: prefill products of many rows run on cuBLAS's
/// tensor cores (bf16 weights x the activations split exactly into three bf16 parts),
/// whose f32 accumulation is not IEEE round-to-nearest, so they drift a little further
/// from the f32 reference than the CPU's; the fixtures' logits reach |6.5|.
const TOL_BF16_PREFILL: f32 = 2.5e-4;

fn check_fixture(dir: &Path, phase: &dyn Fn(&str)) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    phase("load on CUDA");
    let gm = open(dir, Device::Cuda(0));
    assert!(gm.model.device().starts_with("cuda:0"), "{name}: runs on {}", gm.model.device());
    phase("load on CPU");
    let cm = open(dir, Device::Cpu);
    let r = SafetensorsFile::open(&dir.join("reference.safetensors")).unwrap();
    let prompt = tensor_ids(&r, "prompt_ids");
    let want: Vec<f32> = tensor_f32(&r, "prompt_logits");
    phase("prompt logits on CUDA");
    let got: Vec<f32> = gm.scorer().unwrap().logits(&prompt, true).unwrap().concat();
    phase("prompt logits on CPU");
    let on_cpu: Vec<f32> = cm.scorer().unwrap().logits(&prompt, true).unwrap().concat();
    let (vs_ref, vs_cpu) = (max_diff(&got, &want), max_diff(&got, &on_cpu));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let bf16 = ["torch_dtype", "dtype"].iter().any(|k| config[*k] == "bfloat16");
    let tol = if bf16 { TOL_BF16_PREFILL } else { TOL };
    eprintln!("{name}: prompt logits, CUDA vs transformers {vs_ref:.2e}, vs CPU {vs_cpu:.2e} (bound {tol:.1e})");
    assert!(vs_ref < tol, "{name}: CUDA prompt logits differ from transformers by {vs_ref}");
    assert!(vs_cpu < tol, "{name}: CUDA prompt logits differ from the CPU backend by {vs_cpu}");
    let gen_ids = tensor_ids(&r, "generated_ids");
    let req = GenerateRequest::new(prompt.clone(), gen_ids.len(), SamplingParams::default());
    phase("greedy generation on CUDA");
    let out = crate::common::generate(&gm, &req);
    assert_eq!(out.tokens, gen_ids, "{name}: CUDA greedy tokens");
    phase("decode steps on CUDA");
    let mut worst_step = 0f32;
    if r.tensors().contains_key("generated_logits") {
        let vocab = gm.model.info().vocab_size;
        let steps = tensor_f32(&r, "generated_logits");
        let mut gen = gm.scorer().unwrap();
        gen.prefill(&prompt).unwrap();
        for (i, &t) in gen_ids.iter().enumerate() {
            let d = max_diff(gen.last_logits(), &steps[i * vocab..(i + 1) * vocab]);
            assert!(d < TOL, "{name}: CUDA decode step {i} logits differ by {d}");
            worst_step = worst_step.max(d);
            if i + 1 < gen_ids.len() {
                gen.step(t).unwrap();
            }
        }
    }
    eprintln!(
        "{name}: CUDA parity ok (prompt {} tokens; prefill vs transformers {vs_ref:.2e}, vs CPU {vs_cpu:.2e}; decode steps {worst_step:.2e})",
        prompt.len()
    );
}

fn fixture_dirs(family: &str) -> Vec<PathBuf> {
    let root = repo_root().join("fixtures").join(family);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        // Model fixtures (not the image processor's, which has no config).
        .filter(|p| p.join("reference.safetensors").exists() && p.join("config.json").exists())
        .collect();
    dirs.sort();
    dirs
}

/// The fixtures with a test below: one test each, so that one stalled or failed fixture
/// leaves the others' results.
const FIXTURES: [(&str, &str); 23] = [
    ("glm5", "dense-attn"),
    ("glm5", "dsa-shared"),
    ("glm5", "dsa-sparse"),
    ("glm5", "fp8"),
    ("glm4_moe", "bf16-mha"),
    ("glm4_moe", "gqa-bias"),
    ("qwen3_moe", "gqa-renorm"),
    ("qwen3_moe", "sparse-step"),
    ("minimax_m2", "bf16-rot"),
    ("minimax_m2", "gqa-full"),
    ("deepseek_v3", "kimi-fp8"),
    ("deepseek_v3", "yarn-groups"),
    ("gpt_oss", "bf16-plain"),
    ("gpt_oss", "mxfp4-yarn"),
    ("qwen3_next", "bf16-dense"),
    ("qwen3_next", "hybrid-f32"),
    ("qwen3_5_moe", "text-f32"),
    ("qwen3_5_moe", "vl-bf16"),
    ("gemma4", "dense-ple"),
    ("gemma4", "moe"),
    ("gemma4", "vision"),
    ("gemma4", "vision-bidir"),
    ("gemma4", "vision-large"),
];

#[test]
fn every_parity_fixture_has_a_cuda_test() {
    let mut all: Vec<(String, String)> = [
        "glm5",
        "glm4_moe",
        "qwen3_moe",
        "minimax_m2",
        "deepseek_v3",
        "gpt_oss",
        "qwen3_next",
        "qwen3_5_moe",
        "gemma4",
    ]
    .iter()
    .flat_map(|f| {
        fixture_dirs(f).into_iter().map(move |d| (f.to_string(), d.file_name().unwrap().to_string_lossy().to_string()))
    })
    .collect();
    all.sort();
    let mut listed: Vec<(String, String)> = FIXTURES.iter().map(|(f, d)| (f.to_string(), d.to_string())).collect();
    listed.sort();
    assert_eq!(all, listed, "fixtures/ and the CUDA fixture tests disagree");
}

/// `STRATA_TEST_STALL_S`: abort the process, naming the last CUDA kernel (with
/// `STRATA_TEST_WATCHDOG_S`) and the phase, when `f` has not finished in time.
fn stall_guard<F: FnOnce(&dyn Fn(&str))>(what: &str, f: F) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let phase = Arc::new(Mutex::new(String::from("start")));
    let done = Arc::new(AtomicBool::new(false));
    if let Some(secs) = std::env::var("STRATA_TEST_STALL_S").ok().and_then(|s| s.parse::<u64>().ok()) {
        let (phase, done, what) = (phase.clone(), done.clone(), what.to_string());
        std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while t0.elapsed().as_secs() < secs {
                if done.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let phase = phase.lock().unwrap_or_else(|e| e.into_inner()).clone();
            eprintln!(
                "STALL {what}: not done after {secs} s, in phase `{phase}`; last CUDA kernel: {}",
                strata_backend::cuda::last_kernel()
            );
            std::process::abort();
        });
    }
    f(&|p: &str| *phase.lock().unwrap_or_else(|e| e.into_inner()) = p.to_string());
    done.store(true, Ordering::Relaxed);
}

fn fixture_test(family: &str, dir: &str) {
    if gpu().is_none() {
        return;
    }
    let d = repo_root().join("fixtures").join(family).join(dir);
    stall_guard(&format!("{family}/{dir}"), |phase| check_fixture(&d, phase));
}

#[test]
fn cuda_glm5_dense_attn() {
    fixture_test("glm5", "dense-attn")
}

#[test]
fn cuda_glm5_dsa_shared() {
    fixture_test("glm5", "dsa-shared")
}

#[test]
fn cuda_glm5_dsa_sparse() {
    fixture_test("glm5", "dsa-sparse")
}

#[test]
fn cuda_glm5_fp8() {
    fixture_test("glm5", "fp8")
}

#[test]
fn cuda_glm4_moe_bf16_mha() {
    fixture_test("glm4_moe", "bf16-mha")
}

#[test]
fn cuda_glm4_moe_gqa_bias() {
    fixture_test("glm4_moe", "gqa-bias")
}

#[test]
fn cuda_qwen3_moe_gqa_renorm() {
    fixture_test("qwen3_moe", "gqa-renorm")
}

#[test]
fn cuda_qwen3_moe_sparse_step() {
    fixture_test("qwen3_moe", "sparse-step")
}

#[test]
fn cuda_minimax_m2_bf16_rot() {
    fixture_test("minimax_m2", "bf16-rot")
}

#[test]
fn cuda_minimax_m2_gqa_full() {
    fixture_test("minimax_m2", "gqa-full")
}

#[test]
fn cuda_deepseek_v3_kimi_fp8() {
    fixture_test("deepseek_v3", "kimi-fp8")
}

#[test]
fn cuda_deepseek_v3_yarn_groups() {
    fixture_test("deepseek_v3", "yarn-groups")
}

#[test]
fn cuda_gpt_oss_bf16_plain() {
    fixture_test("gpt_oss", "bf16-plain")
}

/// gpt-oss's MXFP4 experts read in place by the CUDA kernels (kind 5), sinks, the router's
/// bias.
#[test]
fn cuda_gpt_oss_mxfp4_yarn() {
    fixture_test("gpt_oss", "mxfp4-yarn")
}

/// The gated DeltaNet's kernels, the gated attention output and the gated shared expert.
#[test]
fn cuda_qwen3_next_hybrid_f32() {
    fixture_test("qwen3_next", "hybrid-f32")
}

#[test]
fn cuda_qwen3_next_bf16_dense() {
    fixture_test("qwen3_next", "bf16-dense")
}

#[test]
fn cuda_qwen3_5_moe_text_f32() {
    fixture_test("qwen3_5_moe", "text-f32")
}

#[test]
fn cuda_qwen3_5_moe_vl_bf16() {
    fixture_test("qwen3_5_moe", "vl-bf16")
}

#[test]
fn cuda_gemma4_dense_ple() {
    fixture_test("gemma4", "dense-ple")
}

#[test]
fn cuda_gemma4_moe() {
    fixture_test("gemma4", "moe")
}

#[test]
fn cuda_gemma4_vision() {
    image_fixture_test("vision")
}

#[test]
fn cuda_gemma4_vision_bidir() {
    image_fixture_test("vision-bidir")
}

/// Images of 272 soft tokens (the processor's default budget): the fixture, then a prompt
/// of two of them in forwards of up to 1,024 rows (more than CUDA's usual 512), CUDA
/// against the CPU backend.
#[test]
fn cuda_gemma4_vision_large() {
    image_fixture_test("vision-large");
    if gpu().is_none() {
        return;
    }
    use strata_engine::image::Rgb8;
    use strata_engine::media;
    let dir = repo_root().join("fixtures/gemma4/vision-large");
    stall_guard("gemma4/vision-large, two images", |phase| {
        phase("load");
        let (gm, cm) = (open(&dir, Device::Cuda(0)), open(&dir, Device::Cpu));
        let img = Rgb8::open(&dir.join("image.png")).unwrap();
        let imgs = [img.clone(), img];
        let (gmedia, cmedia) = (media::encode_images(&gm, &imgs).unwrap(), media::encode_images(&cm, &imgs).unwrap());
        let spec = media::vision_spec(&gm).unwrap();
        let ids = media::expand_runs(&spec, &[10, 11, 12, 30, 31], &gmedia.counts, None).unwrap();
        phase("prompt logits, one forward");
        fn rows(m: &strata_engine::LoadedModel) -> strata_engine::Scorer<'_> {
            strata_engine::Scorer::with_rows(m.model.as_ref(), 1024, 1024).unwrap()
        }
        let got = rows(&gm).logits_with_media(&ids, &gmedia, true).unwrap().concat();
        let want = rows(&cm).logits_with_media(&ids, &cmedia, true).unwrap().concat();
        let d = max_diff(&got, &want);
        assert!(d < TOL, "two large images in one forward of {} rows: CUDA vs CPU {d}", ids.len());
        eprintln!("vision-large: two images, {} rows in one forward, CUDA vs CPU {d:.2e}", ids.len());
    });
}

/// Gemma 4 with an image on CUDA: the vision tower's soft tokens, the prompt's logits at
/// every position (image rows attended both ways on sliding layers in `vision-bidir`)
/// against transformers and the CPU backend, then each decode step's logits and greedy
/// token.
fn image_fixture_test(name: &str) {
    use strata_engine::image::Rgb8;
    use strata_engine::media;
    if gpu().is_none() {
        return;
    }
    let dir = repo_root().join("fixtures/gemma4").join(name);
    stall_guard(&format!("gemma4/{name}"), |phase| {
        phase("load");
        let (gm, cm) = (open(&dir, Device::Cuda(0)), open(&dir, Device::Cpu));
        let r = SafetensorsFile::open(&dir.join("reference.safetensors")).unwrap();
        let img = Rgb8::open(&dir.join("image.png")).unwrap();
        phase("vision tower on CUDA");
        let media = media::encode_images(&gm, std::slice::from_ref(&img)).unwrap();
        let feats = max_diff(&media.rows, &tensor_f32(&r, "image_features"));
        assert!(feats < TOL, "{name}: CUDA image features differ from transformers by {feats}");
        let cpu_media = media::encode_images(&cm, &[img]).unwrap();
        let prompt = tensor_ids(&r, "prompt_ids");
        phase("prompt logits");
        let got = gm.scorer().unwrap().logits_with_media(&prompt, &media, true).unwrap().concat();
        let on_cpu = cm.scorer().unwrap().logits_with_media(&prompt, &cpu_media, true).unwrap().concat();
        let (vs_ref, vs_cpu) = (max_diff(&got, &tensor_f32(&r, "prompt_logits")), max_diff(&got, &on_cpu));
        assert!(vs_ref < TOL, "{name}: CUDA prompt logits differ from transformers by {vs_ref}");
        assert!(vs_cpu < TOL, "{name}: CUDA prompt logits differ from the CPU backend by {vs_cpu}");
        phase("decode steps");
        let (gen_ids, steps) = (tensor_ids(&r, "generated_ids"), tensor_f32(&r, "generated_logits"));
        let vocab = gm.model.info().vocab_size;
        let mut gen = gm.scorer().unwrap();
        gen.prefill_with_media(&prompt, &media).unwrap();
        let mut worst = 0f32;
        for (i, &t) in gen_ids.iter().enumerate() {
            let l = gen.last_logits();
            let d = max_diff(l, &steps[i * vocab..(i + 1) * vocab]);
            assert!(d < TOL, "{name}: CUDA decode step {i} logits differ by {d}");
            worst = worst.max(d);
            let argmax = l.iter().enumerate().fold((0, f32::MIN), |a, (j, &v)| if v > a.1 { (j, v) } else { a }).0;
            assert_eq!(argmax as u32, t, "{name}: CUDA greedy token {i}");
            if i + 1 < gen_ids.len() {
                gen.step(t).unwrap();
            }
        }
        eprintln!(
            "{name}: CUDA parity ok (prompt {} tokens with an image; features {feats:.2e}, prefill vs transformers {vs_ref:.2e}, vs CPU {vs_cpu:.2e}; decode steps {worst:.2e})",
            prompt.len()
        );
    });
}

#[test]
fn cuda_strata_tiny_matches_transformers_and_cpu() {
    if gpu().is_none() {
        return;
    }
    let root = repo_root();
    let dir = root.join("models/strata-tiny");
    let (gm, cm) = (open(&dir, Device::Cuda(0)), open(&dir, Device::Cpu));
    let r = SafetensorsFile::open(&root.join("fixtures/strata-tiny/reference.safetensors")).unwrap();
    for i in 0..3 {
        let ids = tensor_ids(&r, &format!("prompt_ids_{i}"));
        let want = tensor_f32(&r, &format!("prompt_logits_{i}"));
        let got: Vec<f32> = gm.scorer().unwrap().logits(&ids, true).unwrap().concat();
        let on_cpu: Vec<f32> = cm.scorer().unwrap().logits(&ids, true).unwrap().concat();
        let (vs_ref, vs_cpu) = (max_diff(&got, &want), max_diff(&got, &on_cpu));
        assert!(vs_ref < TOL, "strata-tiny prompt {i}: CUDA vs transformers {vs_ref}");
        assert!(vs_cpu < TOL, "strata-tiny prompt {i}: CUDA vs CPU {vs_cpu}");
        // Greedy continuations (the MTP draft on where the model has one) agree.
        let req = GenerateRequest::new(ids.clone(), 32, SamplingParams::default());
        let a = crate::common::generate(&gm, &req);
        let b = crate::common::generate(&cm, &req);
        assert_eq!(a.tokens, b.tokens, "strata-tiny prompt {i}: greedy tokens CUDA vs CPU");
        eprintln!(
            "strata-tiny prompt {i} ({} tokens): CUDA vs transformers {vs_ref:.2e}, vs CPU {vs_cpu:.2e}; 32 greedy tokens equal",
            ids.len()
        );
    }
}
