//! The pre-norm decoder most MoE families share: per layer, RMSNorm -> grouped-query
//! attention (optional q/k/v/o biases, per-head q/k RMSNorm, half-split RoPE (plain or
//! YaRN) over the leading `rotary` dims of each head, a sliding window on some or all
//! layers, optional per-head sinks) -> residual, then RMSNorm -> a dense SwiGLU or a
//! routed MoE (with or without a shared expert, a router bias, expert biases, a clamped
//! SwiGLU) -> residual; final RMSNorm and LM head. Tensors are named as Llama-style Hub checkpoints
//! name them (`model.layers.N.self_attn.q_proj.weight`, `mlp.experts.E.gate_proj.weight`).
//!
//! A family whose model is this decoder (GLM-4.5 `glm4_moe`, Qwen3-MoE `qwen3_moe`,
//! MiniMax-M2 `minimax_m2`, gpt-oss `gpt_oss`)
//! parses its config into a [`DecoderSpec`] and delegates its weight map, plan figures
//! and loading here; its folder keeps only what is its own (the config, the routing).
//!
//! Files: `weights.rs` (every tensor's name, shape and role), `load.rs` (tensors onto a
//! backend), `model.rs` (the forward pass over the shared blocks).

mod load;
mod model;
pub mod weights;

pub use model::{Decoder, DecoderSession};

use crate::blocks::{GqaScratch, MoeScratch};
use crate::registry::{Arch, Device, Family, LoadSpec, MoeLayout};
use crate::rope::Rope;
use crate::weights::WeightMap;
use crate::{Model, ModelInfo};
use anyhow::{bail, Result};
use serde_json::Value;
use strata_backend::cpu::CpuBackend;
use strata_backend::{GateAct, GqaDims};
use strata_storage::WeightStore;

/// How a MoE layer chooses its experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// DeepSeek-V3's `noaux_tc`: sigmoid scores plus a correction bias
    /// (`mlp.gate.e_score_correction_bias`), grouped top-k, times `scaling`.
    Noaux { n_group: usize, topk_group: usize, norm_topk_prob: bool, scaling: f32 },
    /// Softmax over every expert, the top-k, renormalised to sum to one where asked.
    Softmax { renormalize: bool },
}

/// The q/k RMSNorm of the attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One `head_dim` weight for every head (GLM-4.5, Qwen3).
    PerHead,
    /// One weight over the whole q projection and one over the whole k (MiniMax-M2).
    Full,
}

/// How a checkpoint names its MoE tensors (everything else is named alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// `mlp.gate`, `mlp.gate.e_score_correction_bias`, `mlp.experts.E.{gate,up,down}_proj`.
    Llama,
    /// Mixtral's: `block_sparse_moe.gate`, `block_sparse_moe.e_score_correction_bias`,
    /// `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down).
    Mixtral,
    /// gpt-oss's: `mlp.router.{weight,bias}`, the experts fused with gate and up rows
    /// interleaved (`mlp.experts.gate_up_proj[_blocks|_scales|_bias]`,
    /// `mlp.experts.down_proj[...]`), `self_attn.sinks`.
    GptOss,
}

/// Everything about a checkpoint's decoder that shapes its tensors and its forward.
#[derive(Clone, Debug)]
pub struct DecoderSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates.
    pub rotary_dim: usize,
    pub rope: Rope,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    /// Per layer: its sliding window, where it has one.
    pub windows: Vec<Option<usize>>,
    /// Biases on the q, k and v projections.
    pub attention_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// Per-head attention sinks (`self_attn.sinks`).
    pub sinks: bool,
    pub qk_norm: QkNorm,
    pub naming: Naming,
    pub tie_word_embeddings: bool,
    /// The dense layers' SwiGLU width.
    pub intermediate_size: usize,
    /// Per layer: whether its FFN is the routed MoE (else dense).
    pub sparse: Vec<bool>,
    pub experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    pub routing: Routing,
    /// A bias on the router's logits (gpt-oss; softmax routing).
    pub router_bias: bool,
    /// The routed experts' activation.
    pub expert_act: GateAct,
    /// Biases on the routed experts' products (gpt-oss).
    pub expert_biases: bool,
    /// The shared expert's width (`n_shared_experts * moe_intermediate_size`); 0: none.
    pub shared_intermediate_size: usize,
    /// MTP layers after the main ones: described (inspect, convert), not run.
    pub mtp_layers: usize,
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<(usize, usize)>,
}

impl DecoderSpec {
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse.get(layer).copied().unwrap_or(true)
    }

    pub fn sparse_layers(&self) -> usize {
        self.sparse.iter().filter(|&&s| s).count()
    }

    pub fn has_shared_expert(&self) -> bool {
        self.shared_intermediate_size > 0
    }

    /// Layer `layer`'s attention. YaRN multiplies cos and sin by its attention factor, so
    /// q.k by its square: over a fully rotated head that is the softmax scale's factor.
    pub fn gqa_dims(&self, layer: usize) -> GqaDims {
        let factor = self.rope.attention_factor().powi(2) as f32;
        GqaDims {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            rotary: self.rotary_dim,
            scale: (self.head_dim as f32).powf(-0.5) * factor,
            window: self.windows.get(layer).copied().flatten(),
        }
    }

    /// The routed experts as the plan sees them.
    pub fn moe_layout(&self) -> Option<MoeLayout> {
        let layers: Vec<usize> = (0..self.num_layers).filter(|&l| self.is_sparse(l)).collect();
        if layers.is_empty() {
            return None;
        }
        Some(MoeLayout {
            layers,
            experts_per_layer: self.experts,
            top_k: self.top_k,
            hidden: self.hidden_size,
            inter: self.moe_intermediate_size,
            // MTP layers are not run (see the module docs), so their experts are not planned.
            mtp_layers: Vec::new(),
        })
    }

    pub fn kv_bytes_per_token(&self) -> u64 {
        4 * (self.num_layers * 2 * self.kv_heads * self.head_dim) as u64
    }

    pub fn activation_bytes(&self, rows: usize, context: usize) -> u64 {
        let (h, r) = (self.hidden_size as u64, rows as u64);
        let k = self.top_k as u64;
        let shared = self.has_shared_expert();
        let moe = match self.sparse_layers() > 0 {
            true => MoeScratch::<CpuBackend>::bytes(rows, self.hidden_size, self.experts, self.top_k, shared),
            false => 0,
        };
        let inter =
            self.intermediate_size.max(self.moe_intermediate_size * self.top_k + self.shared_intermediate_size) as u64;
        let threads = strata_kernels::pool::default_threads() as u64;
        let group = (self.heads / self.kv_heads) as u64;
        // Residual, normed input, MLP output, rotary tables; attention and MoE scratch;
        // one row of logits; the expert runner's gathered inputs and intermediates;
        // per-thread attention scores.
        4 * (3 * r * h + r * self.rotary_dim as u64)
            + GqaScratch::<CpuBackend>::bytes(&self.gqa_dims(0), rows, self.qk_norm == QkNorm::Full, false)
            + moe
            + 4 * (2 * h + self.vocab_size as u64)
            + 4 * r * (h * (k + 1) + 2 * inter)
            + 4 * threads * group * context.max(1) as u64
    }

    /// Builds the model on `spec.device`; `family` names it in refusals.
    pub fn load(&self, info: ModelInfo, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>> {
        if self.rope.yarn.is_some() && self.rotary_dim != self.head_dim {
            bail!(
                "{}: YaRN over part of a head ({} of {} dims) is not supported",
                info.family,
                self.rotary_dim,
                self.head_dim
            );
        }
        if spec.draft.is_some() {
            bail!("--mtp on: speculative decoding is not implemented for {} (use --mtp off)", info.family);
        }
        match spec.device {
            Device::Cpu => {
                let provider = crate::registry::cpu_provider(spec.experts)?;
                Ok(Box::new(Decoder::load(CpuBackend::new(), self.clone(), info, store, provider)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let provider = crate::registry::cuda_provider(spec.experts)?;
                let b = crate::registry::cuda_backend(n)?;
                Ok(Box::new(Decoder::load(b, self.clone(), info, store, provider)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => bail!("{}", crate::registry::no_cuda(n)),
        }
    }
}

/// A family whose model is this decoder: its config answers these, and the family's
/// [`Arch`] follows from them.
pub trait DecoderConfig: Clone + std::fmt::Debug + Send + Sync + 'static {
    const MODEL_TYPE: &'static str;
    fn family() -> &'static Family;
    fn decoder(&self) -> DecoderSpec;
    /// The config's end-of-sequence ids and beginning-of-sequence id.
    fn special_ids(&self) -> (Vec<u32>, Option<u32>);
    /// Architecture fields for `inspect`.
    fn describe(&self) -> Value;
}

impl<T: DecoderConfig> Arch for T {
    fn family(&self) -> &'static Family {
        T::family()
    }

    fn model_type(&self) -> &str {
        T::MODEL_TYPE
    }

    fn info(&self) -> ModelInfo {
        let d = self.decoder();
        let (eos_token_ids, bos_token_id) = self.special_ids();
        ModelInfo {
            family: T::family().name,
            model_type: T::MODEL_TYPE.into(),
            vocab_size: d.vocab_size,
            hidden_size: d.hidden_size,
            max_context: d.max_position_embeddings,
            eos_token_ids,
            bos_token_id,
            num_layers: d.num_layers,
        }
    }

    fn weight_map(&self) -> WeightMap {
        weights::weight_map(&self.decoder())
    }

    fn moe(&self) -> Option<MoeLayout> {
        self.decoder().moe_layout()
    }

    fn kv_bytes_per_token(&self) -> u64 {
        self.decoder().kv_bytes_per_token()
    }

    fn activation_bytes(&self, rows: usize, context: usize) -> u64 {
        self.decoder().activation_bytes(rows, context)
    }

    fn fp8_block(&self) -> Option<(usize, usize)> {
        self.decoder().fp8_block
    }

    fn describe(&self) -> Value {
        DecoderConfig::describe(self)
    }

    fn load(&self, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>> {
        self.decoder().load(Arch::info(self), store, spec)
    }
}
