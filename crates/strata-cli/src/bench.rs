//! `strata bench`: synthetic GLM-5-shaped checkpoints, decode throughput against the
//! memory-bandwidth floor, and the memory bandwidth itself.

use anyhow::{bail, Result};
use candle_core::Device;
use clap::{Args, Subcommand};
use half::bf16;
use std::path::PathBuf;
use std::time::Instant;
use strata_engine::{LoadedModel, SamplingParams};
use strata_models::glm_moe_dsa::{expected_tensors, GlmMoeDsaConfig, TensorRole};
use strata_storage::{ElementType, SafetensorsWriter, TensorSpec};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Write a random-weight bf16 checkpoint with GLM-5's real shapes (2 layers: one
    /// dense, one MoE with `--experts` routed experts of width 6144 x 2048).
    Synth(SynthArgs),
    /// Prefill and decode throughput on a model directory (no tokenizer needed).
    Decode(DecodeArgs),
    /// Main-memory read bandwidth (the decode floor's denominator).
    Mem(MemArgs),
}

#[derive(Args)]
pub struct SynthArgs {
    #[arg(long)]
    out: PathBuf,
    /// Routed experts in the MoE layer (at least 8, the top-k).
    #[arg(long, default_value_t = 32)]
    experts: usize,
    /// Vocabulary size (GLM-5 has 154880; smaller keeps the slice about experts).
    #[arg(long, default_value_t = 16384)]
    vocab: usize,
}

#[derive(Args)]
pub struct DecodeArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
    /// Also measure memory bandwidth and report measured / floor.
    #[arg(long)]
    floor: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct MemArgs {
    /// Buffer size in MiB (well above the caches).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(c: BenchCommand) -> Result<()> {
    match c {
        BenchCommand::Synth(a) => synth(a),
        BenchCommand::Decode(a) => decode(a),
        BenchCommand::Mem(a) => {
            let gbs = memory_bandwidth(a.mib)?;
            if a.json {
                println!("{}", serde_json::json!({ "read_gb_per_s": gbs, "buffer_mib": a.mib }));
            } else {
                println!("memory read bandwidth: {gbs:.2} GB/s ({} MiB buffer, all cores)", a.mib);
            }
            Ok(())
        }
    }
}

fn glm5_slice_config(experts: usize, vocab: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": vocab, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": experts,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": true, "routed_scaling_factor": 2.5, "q_lora_rank": 2048,
        "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "hidden_act": "silu",
        "tie_word_embeddings": false, "eos_token_id": [0], "torch_dtype": "bfloat16"
    })
}

/// xorshift64*: fast, seeded, good enough for random weights.
struct Rng(u64);
impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 // uniform [-1, 1)
    }
}

fn synth(a: SynthArgs) -> Result<()> {
    if a.experts < 8 {
        bail!("--experts must be at least 8 (GLM-5 routes each token to 8), got {}", a.experts);
    }
    std::fs::create_dir_all(&a.out)?;
    let json = glm5_slice_config(a.experts, a.vocab);
    let cfg = GlmMoeDsaConfig::from_json(&json)?;
    let tensors = expected_tensors(&cfg);
    let specs = tensors
        .iter()
        .map(|(n, s, _)| TensorSpec { name: n.clone(), dtype: ElementType::BF16, shape: s.clone() })
        .collect::<Vec<_>>();
    let total: usize = specs.iter().map(TensorSpec::byte_len).sum();
    eprintln!("writing {} tensors, {:.2} GB of bf16, to {}", specs.len(), total as f64 / 1e9, a.out.display());
    let mut w = SafetensorsWriter::create(&a.out.join("model.safetensors"), specs)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (i, (_, shape, role)) in tensors.iter().enumerate() {
        let n: usize = shape.iter().product();
        // Uniform with std ~ 1/sqrt(fan_in) keeps activations O(1) through the layers.
        let fan_in = *shape.last().unwrap() as f32;
        let (scale, offset) = match role {
            TensorRole::Weight => ((3.0 / fan_in).sqrt(), 0.0),
            TensorRole::NormScale => (0.1, 1.0),
            TensorRole::NormBias => (0.1, 0.0),
            TensorRole::RouterBias => (0.01, 0.0),
        };
        let mut bytes = Vec::with_capacity(n * 2);
        for _ in 0..n {
            bytes.extend_from_slice(&bf16::from_f32(rng.next_f32() * scale + offset).to_bits().to_le_bytes());
        }
        w.write_next(&bytes)?;
        if i % 64 == 0 {
            eprint!("\r{}/{} tensors", i + 1, tensors.len());
        }
    }
    w.finish()?;
    eprintln!("\r{} tensors written", tensors.len());
    std::fs::write(a.out.join("config.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(())
}

/// Reads a buffer of `mib` MiB with every core, best of 5; returns GB/s.
pub fn memory_bandwidth(mib: usize) -> Result<f64> {
    let n = mib * (1 << 20) / 8;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let buf: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let chunk = n.div_ceil(threads);
            let handles: Vec<_> =
                buf.chunks(chunk).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::hint::black_box(sums);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

fn decode(a: DecodeArgs) -> Result<()> {
    if a.prompt_tokens == 0 || a.decode_tokens < 2 {
        bail!("--prompt-tokens must be >= 1 and --decode-tokens >= 2");
    }
    let t_load = Instant::now();
    let m = LoadedModel::open(&a.model, &Device::Cpu)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let vocab = m.model.vocab_size() as u32;
    let mut rng = Rng(42);
    let prompt: Vec<u32> =
        (0..a.prompt_tokens).map(|_| ((rng.next_f32() + 1.0) * 0.5 * (vocab - 1) as f32) as u32).collect();
    // No EOS ids: run the full length.
    let req = strata_engine::GenerateRequest::new(prompt, a.decode_tokens, SamplingParams::default());
    let mut gen = strata_engine::Generator::new(m.model.as_ref())?;
    let out = gen.generate(None, &req, &mut |_| true)?;
    let s = &out.stats;
    // Bytes a decode token must read, as weights are held (f32): the dense part, the
    // top-k experts of each sparse layer, one embedding row.
    let (json, _) = strata_engine::model_dir::read_config(&a.model)?;
    let cfg = GlmMoeDsaConfig::from_json(&json)?;
    let store = strata_storage::WeightStore::open_dir(&a.model)?;
    let summary = strata_models::glm_moe_dsa::inspect(&cfg, &store);
    let embed = (cfg.vocab_size * cfg.hidden_size) as u64;
    let token_params = summary.active_parameters - embed + cfg.hidden_size as u64;
    let token_bytes = token_params * 4;
    let mut report = serde_json::json!({
        "model": a.model.display().to_string(),
        "load_seconds": load_s,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "peak_rss_bytes": s.peak_rss_bytes,
        "decode_params_read_per_token": token_params,
        "decode_bytes_read_per_token_f32": token_bytes,
    });
    if a.floor {
        let gbs = memory_bandwidth(1024)?;
        let floor_tps = gbs * 1e9 / token_bytes as f64;
        report["memory_read_gb_per_s"] = gbs.into();
        report["decode_floor_tokens_per_s"] = floor_tps.into();
        report["decode_fraction_of_floor"] = (s.decode_tokens_per_s / floor_tps).into();
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for (k, v) in report.as_object().unwrap() {
            println!("{k:<34} {v}");
        }
    }
    Ok(())
}
