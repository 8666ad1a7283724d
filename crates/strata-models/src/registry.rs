//! The family registry: `model_type` -> a family, which parses `config.json` once into an
//! [`Arch`] that answers everything the engine asks before and while loading: the weight
//! map, the routed-expert layout, KV and activation sizes, the chat format, the ledger's
//! engine id, and how to build the model on a device. Engine, CLI and server reach
//! families only through here.

use crate::weights::WeightMap;
use crate::{Model, ModelInfo};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use strata_backend::cpu::CpuBackend;
use strata_experts::ExpertProvider;
use strata_storage::WeightStore;

/// A compute device for a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl Device {
    /// `cpu`, `cuda`, `cuda:N`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => bail!("--device `{s}`: expected cpu, cuda or cuda:N"),
            },
        }
    }

    /// Fails, naming the device, when this build cannot run on it (with the `cuda`
    /// feature: when the machine has no CUDA driver or no such GPU).
    pub fn check(&self) -> Result<()> {
        match self {
            Self::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda(n) => {
                let count = strata_backend::cuda::device_count().map_err(|e| anyhow!("--device cuda:{n}: {e}"))?;
                if *n >= count {
                    bail!(
                        "--device cuda:{n}: this machine has {count} CUDA device{}",
                        if count == 1 { "" } else { "s" }
                    );
                }
                Ok(())
            }
            #[cfg(not(feature = "cuda"))]
            Self::Cuda(n) => bail!("{}", no_cuda(*n)),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Self::Cpu => "cpu".into(),
            Self::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

/// The refusal of a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn no_cuda(n: usize) -> String {
    format!("--device cuda:{n}: this build of strata has no CUDA backend (the CPU backend is `--device cpu`)")
}

/// A CPU model's expert provider: none (resident) or the engine's slab runtime.
pub(crate) fn cpu_provider(c: ExpertsChoice) -> Result<Option<Arc<dyn ExpertProvider<CpuBackend>>>> {
    match c {
        ExpertsChoice::Resident => Ok(None),
        ExpertsChoice::Cpu(p) => Ok(Some(p)),
        #[cfg(feature = "cuda")]
        ExpertsChoice::Cuda(_) => bail!("a GPU expert tier cannot feed a model on the CPU"),
    }
}

/// The CUDA backend on device `n`.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_backend(n: usize) -> Result<strata_backend::cuda::CudaBackend> {
    strata_backend::cuda::CudaBackend::new(n)
}

/// A CUDA model's expert provider: none (resident in GPU memory) or the engine's GPU
/// tier; a CPU runtime cannot feed a CUDA model.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_provider(
    c: ExpertsChoice,
) -> Result<Option<Arc<dyn ExpertProvider<strata_backend::cuda::CudaBackend>>>> {
    match c {
        ExpertsChoice::Resident => Ok(None),
        ExpertsChoice::Cuda(p) => Ok(Some(p)),
        ExpertsChoice::Cpu(_) => {
            bail!("a CPU expert runtime cannot feed a model on CUDA (the engine builds a GPU tier)")
        }
    }
}

/// How a family's chat output marks tool calls and reasoning (for the server's parsers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatFormat {
    /// GLM: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`,
    /// reasoning in `<think>...</think>`.
    Glm,
    /// Gemma 4: `<|tool_call>call:name{key:<|"|>value<|"|>,...}<tool_call|>`, reasoning in a
    /// `<|channel>thought ... <channel|>` block (see the engine's `chat::gemma4`).
    Gemma,
    /// Qwen3: reasoning in `<think>...</think>`; calls as `<tool_call>` followed by a JSON
    /// object `{"name": ..., "arguments": {...}}` (Qwen3) or, from Qwen3-Coder, by
    /// `<function=NAME><parameter=KEY>VALUE</parameter>...</function>`, then `</tool_call>`.
    Qwen,
    /// MiniMax-M2: reasoning in `<think>...</think>`; calls as `<minimax:tool_call>` holding
    /// one or more `<invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>`,
    /// then `</minimax:tool_call>`.
    MiniMax,
    /// DeepSeek-V3 / R1 / V3.1: reasoning in `<think>...</think>`; calls inside
    /// `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`, each
    /// `<｜tool▁call▁begin｜>[function<｜tool▁sep｜>]NAME` then its JSON arguments (V3 fences
    /// them in a json code block after a newline, V3.1 follows `<｜tool▁sep｜>`), then
    /// `<｜tool▁call▁end｜>`.
    DeepSeek,
    /// Kimi K2: reasoning in `<think>...</think>`; calls inside
    /// `<|tool_calls_section_begin|>...<|tool_calls_section_end|>`, each
    /// `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>JSON<|tool_call_end|>`.
    Kimi,
    /// gpt-oss's harmony: messages `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`;
    /// reasoning on the `analysis` channel, the answer on `final`, tool calls on
    /// `commentary` addressed `to=functions.NAME`, their JSON arguments ending in `<|call|>`.
    Harmony,
}

pub use strata_experts::MoeLayout;

/// Where a model's routed experts run from.
pub enum ExpertsChoice {
    /// Read from the checkpoint and held by the model.
    Resident,
    /// Through the engine's slab runtime (CPU device).
    Cpu(Arc<dyn ExpertProvider<CpuBackend>>),
    /// Through the engine's GPU tier (an HBM slab fed from the host slab).
    #[cfg(feature = "cuda")]
    Cuda(Arc<dyn ExpertProvider<strata_backend::cuda::CudaBackend>>),
}

/// How to build a model.
pub struct LoadSpec {
    pub device: Device,
    /// The main layers' routed experts.
    pub experts: ExpertsChoice,
    /// The draft (MTP) layer and where its experts come from; None leaves it out.
    pub draft: Option<ExpertsChoice>,
}

/// A parsed, validated `config.json` of one family.
pub trait Arch: Send + Sync + std::fmt::Debug {
    fn family(&self) -> &'static Family;
    fn model_type(&self) -> &str;
    fn info(&self) -> ModelInfo;
    /// Every tensor of the checkpoint (main model and, optional, the MTP layer).
    fn weight_map(&self) -> WeightMap;
    fn moe(&self) -> Option<MoeLayout>;
    /// KV cache bytes per token of context (all layers, as the backend holds them).
    fn kv_bytes_per_token(&self) -> u64;
    /// KV cache bytes of a session of `context` positions whose forwards carry up to
    /// `rows` rows (a family whose sliding layers keep only a window overrides this).
    fn kv_bytes(&self, context: usize, rows: usize) -> u64 {
        let _ = rows;
        self.kv_bytes_per_token() * context as u64
    }
    /// Whether the checkpoint declares a vision tower (see [`crate::Model::vision`] for
    /// the one a loaded model runs).
    fn vision_tower(&self) -> bool {
        false
    }
    /// Activation bytes of a forward of `rows` rows with up to `context` positions
    /// visible (scratch a session allocates once).
    fn activation_bytes(&self, rows: usize, context: usize) -> u64;
    /// FP8 block size declared by the config, if any.
    fn fp8_block(&self) -> Option<(usize, usize)> {
        None
    }
    /// Architecture fields for `inspect`.
    fn describe(&self) -> Value;
    /// Whether the checkpoint in `store` carries a draft (MTP) layer this family runs.
    fn has_draft(&self, _store: &WeightStore) -> bool {
        false
    }
    /// Builds the model from `store` as `spec` says.
    fn load(&self, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>>;
}

/// A model family.
pub struct Family {
    /// Also the engine name whose FNV-1a hash identifies the usage ledger's engine.
    pub name: &'static str,
    pub model_types: &'static [&'static str],
    pub chat: ChatFormat,
    pub parse: fn(&Value) -> Result<Arc<dyn Arch>>,
}

/// Every family strata runs.
pub fn families() -> &'static [&'static Family] {
    static FAMILIES: [&Family; 10] = [
        &crate::glm_moe_dsa::FAMILY,
        &crate::deepseek_v3::FAMILY,
        &crate::deepseek_v3::KIMI_FAMILY,
        &crate::glm4_moe::FAMILY,
        &crate::qwen3_moe::FAMILY,
        &crate::minimax_m2::FAMILY,
        &crate::gpt_oss::FAMILY,
        &crate::qwen3_next::FAMILY,
        &crate::qwen3_next::QWEN35_FAMILY,
        &crate::gemma4::FAMILY,
    ];
    &FAMILIES
}

/// The family of a `model_type`.
pub fn family_of(model_type: &str) -> Option<&'static Family> {
    families().iter().copied().find(|f| f.model_types.contains(&model_type))
}

/// Every `model_type` strata accepts.
pub fn supported_model_types() -> Vec<&'static str> {
    families().iter().flat_map(|f| f.model_types.iter().copied()).collect()
}

/// Parses a config value through its family.
pub fn parse_config(json: &Value) -> Result<Arc<dyn Arch>> {
    let model_type =
        json.get("model_type").and_then(Value::as_str).ok_or_else(|| anyhow!("missing field `model_type`"))?;
    let Some(family) = family_of(model_type) else {
        bail!("unsupported model_type `{model_type}` (strata supports: {})", supported_model_types().join(", "))
    };
    (family.parse)(json)
}

/// Reads and parses `dir/config.json`; errors name the file.
pub fn read_arch(dir: &Path) -> Result<Arc<dyn Arch>> {
    if !dir.is_dir() {
        bail!("{}: model directory not found", dir.display());
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display()))?;
    parse_config(&json).map_err(|e| anyhow!("{}: {e}", path.display()))
}
