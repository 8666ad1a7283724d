//! Numeric kernels with no tensor-library dependency.
//!
//! Today: decoding the on-disk element types of HF checkpoints (bf16, f16, f32, FP8 e4m3
//! with DeepSeek-style 128x128 block scales) into f32. Each kernel has a plain reference
//! in its tests, checked on random inputs.

pub mod dtype;
pub mod fp8;
pub mod quant;

pub use dtype::{decode_to_f32, ElementType};
pub use fp8::{dequantize_fp8_blocks, fp8_e4m3_to_f32};
pub use quant::{dequantize, quantize, QuantKind};
