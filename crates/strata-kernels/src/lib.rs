//! Numeric kernels with no tensor-library dependency.
//!
//! Decoding the on-disk element types of HF checkpoints (bf16, f16, f32, FP8 e4m3
//! with DeepSeek-style 128x128 block scales) into f32. Each kernel has a plain reference
//! in its tests, checked on random inputs. Quantized expert encodings (`quant`) and the
//! CPU kernels that compute on them (`expert`: matmul and SwiGLU, AVX-512/AVX2 + threads).

pub mod deltanet;
pub mod dtype;
pub mod expert;
pub mod fp8;
pub mod ops;
pub mod pool;
pub mod quant;

pub use dtype::{decode_to_f32, ElementType};
pub use expert::{
    dequant_row, matmul_t, output_share, qmatmul, qmatmul_with, swiglu_expert, swiglu_expert_with, swiglu_experts,
    swiglu_experts_with, ExpertBias, ExpertCall, ExpertJob, ExpertRunner, GateAct, KernelPath, Out, Product, QMatrix,
    Scales, Staging,
};
pub use fp8::{dequantize_fp8_blocks, fp8_e4m3_to_f32};
pub use pool::{Ctx, ThreadPool};
pub use quant::{
    decode_scales, dequantize, e8m0_scale, encode_scales, quantize, round_scales, QuantKind, ScaleType, MXFP4_GROUP,
};
