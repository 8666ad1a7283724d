//! Every tensor a `glm_moe_dsa` checkpoint holds for the main model, named as on the Hub
//! (experts stored one by one), with its shape. Used to write synthetic checkpoints.

use super::config::{GlmMoeDsaConfig, IndexerKind, MlpKind};

/// What a tensor is, for choosing initial values in synthetic checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    Weight,
    NormScale,
    NormBias,
    RouterBias,
}

pub fn expected_tensors(cfg: &GlmMoeDsaConfig) -> Vec<(String, Vec<usize>, TensorRole)> {
    use TensorRole::*;
    let h = cfg.hidden_size;
    let (heads, nope, rope, v) = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h], Weight)];
    let mut push = |name: String, shape: Vec<usize>, role| out.push((name, shape, role));
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        push(format!("{p}.input_layernorm.weight"), vec![h], NormScale);
        push(format!("{p}.post_attention_layernorm.weight"), vec![h], NormScale);
        push(format!("{a}.q_a_proj.weight"), vec![cfg.q_lora_rank, h], Weight);
        push(format!("{a}.q_a_layernorm.weight"), vec![cfg.q_lora_rank], NormScale);
        push(format!("{a}.q_b_proj.weight"), vec![heads * (nope + rope), cfg.q_lora_rank], Weight);
        push(format!("{a}.kv_a_proj_with_mqa.weight"), vec![cfg.kv_lora_rank + rope, h], Weight);
        push(format!("{a}.kv_a_layernorm.weight"), vec![cfg.kv_lora_rank], NormScale);
        push(format!("{a}.kv_b_proj.weight"), vec![heads * (nope + v), cfg.kv_lora_rank], Weight);
        push(format!("{a}.o_proj.weight"), vec![h, heads * v], Weight);
        if cfg.indexer_types[i] == IndexerKind::Full {
            let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
            push(format!("{a}.indexer.wq_b.weight"), vec![ih * id, cfg.q_lora_rank], Weight);
            push(format!("{a}.indexer.wk.weight"), vec![id, h], Weight);
            push(format!("{a}.indexer.k_norm.weight"), vec![id], NormScale);
            push(format!("{a}.indexer.k_norm.bias"), vec![id], NormBias);
            push(format!("{a}.indexer.weights_proj.weight"), vec![ih, h], Weight);
        }
        let mlp = |prefix: String, inter: usize, push: &mut dyn FnMut(String, Vec<usize>, TensorRole)| {
            push(format!("{prefix}.gate_proj.weight"), vec![inter, h], Weight);
            push(format!("{prefix}.up_proj.weight"), vec![inter, h], Weight);
            push(format!("{prefix}.down_proj.weight"), vec![h, inter], Weight);
        };
        match cfg.mlp_layer_types[i] {
            MlpKind::Dense => mlp(format!("{p}.mlp"), cfg.intermediate_size, &mut push),
            MlpKind::Sparse => {
                let inter = cfg.moe_intermediate_size;
                push(format!("{p}.mlp.gate.weight"), vec![cfg.n_routed_experts, h], Weight);
                push(format!("{p}.mlp.gate.e_score_correction_bias"), vec![cfg.n_routed_experts], RouterBias);
                mlp(format!("{p}.mlp.shared_experts"), inter * cfg.n_shared_experts, &mut push);
                for e in 0..cfg.n_routed_experts {
                    mlp(format!("{p}.mlp.experts.{e}"), inter, &mut push);
                }
            }
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h], NormScale));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h], Weight));
    }
    out
}
