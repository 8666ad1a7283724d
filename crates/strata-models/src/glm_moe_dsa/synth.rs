//! Random-weight checkpoints with real shapes, for benchmarks and memory tests: an HF
//! directory (bf16 safetensors) or a model with an expert container, written streaming
//! (never more than one tensor in memory).

use super::config::GlmMoeDsaConfig;
use crate::weights::Role;
use anyhow::{bail, Result};
use half::bf16;
use std::path::Path;
use strata_kernels::{quantize, ElementType, QuantKind};
use strata_storage::{ContainerWriter, ExpertLayout, SafetensorsWriter, TensorSpec, TierSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// GLM-5's real widths: hidden 6144, MLA 64 heads, experts 6144 x 2048.
    Glm5,
    /// Same architecture, narrow: hidden 1024, experts 1024 x 1024 (tests).
    Small,
    /// DeepSeek-V3's real widths (`deepseek_v3`: no indexer, YaRN): hidden 7168, MLA 128
    /// heads, experts 7168 x 2048 in groups of the routed experts / 8.
    DeepseekV3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthFormat {
    /// An HF checkpoint in bf16.
    HfBf16,
    /// Resident tensors in bf16, routed experts in an expert container.
    Container(QuantKind),
}

#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub preset: Preset,
    pub layers: usize,
    pub dense_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub vocab: usize,
    /// Add GLM-5's MTP (draft) layer; in a container its experts are the int8 "mtp" tier.
    pub mtp: bool,
    /// The decoder layers' projections in FP8 e4m3 with 128 x 128 block scales
    /// (`weight_scale_inv`), as GLM-5's FP8 checkpoints hold them ([`FP8_PROJECTIONS`]).
    pub fp8: bool,
    pub format: SynthFormat,
    pub seed: u64,
}

pub fn synth_config(s: &SynthSpec) -> serde_json::Value {
    let (h, inter, moe, heads, q_lora, kv_lora, nope, rope, v, ih, id) = match s.preset {
        Preset::Glm5 => (6144, 12288, 2048, 64, 2048, 512, 192, 64, 256, 32, 128),
        Preset::Small => (1024, 2048, 1024, 8, 256, 128, 64, 32, 64, 4, 64),
        Preset::DeepseekV3 => (7168, 18432, 2048, 128, 1536, 512, 128, 64, 128, 0, 0),
    };
    let mut cfg = serde_json::json!({
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": s.vocab, "hidden_size": h, "intermediate_size": inter, "moe_intermediate_size": moe,
        "num_hidden_layers": s.layers, "first_k_dense_replace": s.dense_layers,
        "num_nextn_predict_layers": usize::from(s.mtp),
        "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": true, "routed_scaling_factor": 2.5, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
        "index_topk": 2048, "index_head_dim": id, "index_n_heads": ih,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rms_norm_eps": 1e-5, "max_position_embeddings": 202752, "hidden_act": "silu",
        "tie_word_embeddings": false, "eos_token_id": [0], "torch_dtype": "bfloat16"
    });
    if s.preset == Preset::DeepseekV3 {
        let o = cfg.as_object_mut().expect("an object");
        for k in ["index_topk", "index_head_dim", "index_n_heads", "rope_parameters"] {
            o.remove(k);
        }
        // Groups as DeepSeek-V3's (8, keep 4) where the experts divide into them.
        let groups = if s.experts.is_multiple_of(8) && s.experts / 8 >= 2 { (8, 4) } else { (1, 1) };
        cfg["architectures"] = serde_json::json!(["DeepseekV3ForCausalLM"]);
        cfg["model_type"] = serde_json::json!("deepseek_v3");
        cfg["n_group"] = serde_json::json!(groups.0);
        cfg["topk_group"] = serde_json::json!(groups.1);
        cfg["rms_norm_eps"] = serde_json::json!(1e-6);
        cfg["max_position_embeddings"] = serde_json::json!(163840);
        cfg["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0});
        cfg["rope_theta"] = serde_json::json!(10000);
    }
    if s.fp8 {
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_EDGE, FP8_EDGE]
        });
    }
    cfg
}

/// The projections an FP8 checkpoint stores in FP8 (the rest, norms, router, embedding and
/// head, stay bf16), by name suffix within a decoder layer.
pub const FP8_PROJECTIONS: [&str; 10] = [
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
];

/// The FP8 blocks' edge (`weight_block_size`, and the scale grid's step).
const FP8_EDGE: usize = 128;
const FP8_BLOCK: QuantKind = QuantKind::Fp8 { block_rows: FP8_EDGE, block_cols: FP8_EDGE };

fn is_fp8(spec: &SynthSpec, name: &str, shape: &[usize]) -> bool {
    spec.fp8
        && shape.len() == 2
        && name.starts_with("model.layers.")
        && FP8_PROJECTIONS.iter().any(|p| name.ends_with(p))
}

/// xorshift64*: fast, seeded; uniform in [-1, 1). For synthetic weights and inputs.
pub struct SynthRng(pub u64);
impl SynthRng {
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Values per chunk of a tensor: each chunk has its own generator, seeded from the
/// tensor's and its own index, so the values do not depend on how many threads fill them.
const FILL_CHUNK: usize = 1 << 20;

/// Values with std ~ 1/sqrt(fan_in), so activations stay O(1) through the layers; the
/// `index`-th tensor of a checkpoint seeded with `seed`, filled by every core.
fn fill(seed: u64, index: usize, shape: &[usize], role: Role) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let fan_in = *shape.last().unwrap() as f32;
    let (scale, offset) = match role {
        Role::Linear | Role::Embedding => ((3.0 / fan_in).sqrt(), 0.0),
        Role::NormScale => (0.1, 1.0),
        Role::NormBias => (0.1, 0.0),
        Role::RouterBias => (0.01, 0.0),
    };
    let mut v = vec![0f32; n];
    on_every_core(&mut v, FILL_CHUNK, |c, out| {
        // splitmix-style mixing so neighbouring chunks start far apart.
        let mut h = seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (c as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let mut rng = SynthRng(h | 1);
        out.iter_mut().for_each(|x| *x = rng.next_f32() * scale + offset);
    });
    v
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; v.len() * 2];
    on_every_core(&mut out, 2 * FILL_CHUNK, |i, dst| {
        for (x, d) in v[i * FILL_CHUNK..].iter().zip(dst.chunks_exact_mut(2)) {
            d.copy_from_slice(&bf16::from_f32(*x).to_bits().to_le_bytes());
        }
    });
    out
}

/// Calls `f(i, piece)` for each `unit`-long piece `i` of `v` (the last may be shorter), the
/// pieces spread over the pool's number of cores in contiguous runs (scoped threads: this
/// is offline work, not a kernel on the compute pool).
fn on_every_core<T: Send>(v: &mut [T], unit: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let units = v.len().div_ceil(unit);
    let threads = strata_kernels::pool::default_threads().clamp(1, units.max(1));
    let per = units.div_ceil(threads).max(1) * unit;
    let f = &f;
    std::thread::scope(|s| {
        for (t, run) in v.chunks_mut(per).enumerate() {
            s.spawn(move || {
                for (j, piece) in run.chunks_mut(unit).enumerate() {
                    f(t * per / unit + j, piece);
                }
            });
        }
    });
}

/// Writes the checkpoint; `progress(done, total)` counts tensors.
pub fn synthesize(out: &Path, spec: &SynthSpec, progress: &mut dyn FnMut(usize, usize)) -> Result<()> {
    if spec.top_k == 0 || spec.experts < spec.top_k {
        bail!("synth: need at least top_k ({}) experts, got {}", spec.top_k, spec.experts);
    }
    if spec.dense_layers >= spec.layers {
        bail!("synth: {} dense layers leave no MoE layer of {}", spec.dense_layers, spec.layers);
    }
    std::fs::create_dir_all(out)?;
    let json = synth_config(spec);
    let cfg = match spec.preset {
        Preset::DeepseekV3 => GlmMoeDsaConfig::from_deepseek_json(&json)?,
        _ => GlmMoeDsaConfig::from_json(&json)?,
    };
    let map = super::weights::weight_map(&cfg);
    // The only optional tensors are the MTP layer's.
    let tensors: Vec<_> = map.specs.iter().filter(|s| !s.optional || spec.mtp).collect();
    let resident: Vec<_> = match spec.format {
        SynthFormat::HfBf16 => tensors.clone(),
        SynthFormat::Container(_) => tensors.iter().copied().filter(|t| t.expert.is_none()).collect(),
    };
    let mut specs = Vec::new();
    for s in &resident {
        if is_fp8(spec, &s.name, &s.shape) {
            specs.push(TensorSpec { name: s.name.clone(), dtype: ElementType::F8E4M3, shape: s.shape.clone() });
            let scales = vec![s.shape[0].div_ceil(FP8_EDGE), s.shape[1].div_ceil(FP8_EDGE)];
            specs.push(TensorSpec { name: format!("{}_scale_inv", s.name), dtype: ElementType::F32, shape: scales });
        } else {
            specs.push(TensorSpec { name: s.name.clone(), dtype: ElementType::BF16, shape: s.shape.clone() });
        }
    }
    let mut index = 0usize;
    let mut next = |shape: &[usize], role: Role| {
        index += 1;
        fill(spec.seed, index, shape, role)
    };
    let total = tensors.len();
    let mut done = 0;
    let mut w = SafetensorsWriter::create(&out.join("model.safetensors"), specs)?;
    for s in &resident {
        let v = next(&s.shape, s.role);
        if is_fp8(spec, &s.name, &s.shape) {
            let (q, scales) = quantize(FP8_BLOCK, &v, s.shape[0], s.shape[1]);
            w.write_next(&q)?;
            w.write_next(&scales.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?;
        } else {
            w.write_next(&bf16_bytes(&v))?;
        }
        done += 1;
        progress(done, total);
    }
    w.finish()?;
    if let SynthFormat::Container(kind) = spec.format {
        let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
        let main: Vec<usize> = (spec.dense_layers..spec.layers).collect();
        let mut tiers = vec![TierSpec {
            name: "main".into(),
            layout: ExpertLayout::new(kind, kind, h, inter),
            layers: main.clone(),
            experts_per_layer: spec.experts,
        }];
        if spec.mtp {
            // As `strata convert` writes it: the draft layer's experts in int8.
            tiers.push(TierSpec {
                name: "mtp".into(),
                layout: ExpertLayout::new(QuantKind::Int8Row, QuantKind::Int8Row, h, inter),
                layers: vec![spec.layers],
                experts_per_layer: spec.experts,
            });
        }
        let mut cw = ContainerWriter::create(out, tiers.clone())?;
        for tier in &tiers {
            let kind = tier.layout.gate.kind;
            for &l in &tier.layers {
                for e in 0..spec.experts {
                    let g = next(&[inter, h], Role::Linear);
                    let u = next(&[inter, h], Role::Linear);
                    let d = next(&[h, inter], Role::Linear);
                    let (gq, gs) = quantize(kind, &g, inter, h);
                    let (uq, us) = quantize(kind, &u, inter, h);
                    let (dq, ds) = quantize(kind, &d, h, inter);
                    cw.add_expert(&tier.name, l, e, [(&gq, &gs), (&uq, &us), (&dq, &ds)])?;
                    done += 3;
                    progress(done, total);
                }
            }
        }
        cw.finish()?;
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(())
}
