//! Element types found in safetensors files, and their decoding to f32.

use half::{bf16, f16};

/// A safetensors element type (the names are those of the safetensors header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    F64,
    F32,
    F16,
    BF16,
    F8E4M3,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl ElementType {
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "F64" => Self::F64,
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "F8_E4M3" => Self::F8E4M3,
            "I64" => Self::I64,
            "I32" => Self::I32,
            "I16" => Self::I16,
            "I8" => Self::I8,
            "U8" => Self::U8,
            "BOOL" => Self::Bool,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F64 => "F64",
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::F8E4M3 => "F8_E4M3",
            Self::I64 => "I64",
            Self::I32 => "I32",
            Self::I16 => "I16",
            Self::I8 => "I8",
            Self::U8 => "U8",
            Self::Bool => "BOOL",
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            Self::F64 | Self::I64 => 8,
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 | Self::I16 => 2,
            Self::F8E4M3 | Self::I8 | Self::U8 | Self::Bool => 1,
        }
    }
}

/// Decodes little-endian elements of `ty` into f32. FP8 is decoded without its block
/// scales (see [`crate::fp8::dequantize_fp8_blocks`] for scaled weights).
pub fn decode_to_f32(ty: ElementType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let n = bytes.len() / ty.size_bytes();
    if !bytes.len().is_multiple_of(ty.size_bytes()) || n != out.len() {
        return Err(format!("{} buffer of {} bytes does not hold {} elements", ty.name(), bytes.len(), out.len()));
    }
    macro_rules! each {
        ($w:expr, $f:expr) => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact($w)) {
                *o = $f(c.try_into().unwrap());
            }
        };
    }
    match ty {
        ElementType::F32 => each!(4, |c: [u8; 4]| f32::from_le_bytes(c)),
        ElementType::F64 => each!(8, |c: [u8; 8]| f64::from_le_bytes(c) as f32),
        ElementType::BF16 => each!(2, |c: [u8; 2]| bf16::from_bits(u16::from_le_bytes(c)).to_f32()),
        ElementType::F16 => each!(2, |c: [u8; 2]| f16::from_bits(u16::from_le_bytes(c)).to_f32()),
        ElementType::F8E4M3 => each!(1, |c: [u8; 1]| crate::fp8::fp8_e4m3_to_f32(c[0])),
        ElementType::I64 => each!(8, |c: [u8; 8]| i64::from_le_bytes(c) as f32),
        ElementType::I32 => each!(4, |c: [u8; 4]| i32::from_le_bytes(c) as f32),
        ElementType::I16 => each!(2, |c: [u8; 2]| i16::from_le_bytes(c) as f32),
        ElementType::I8 => each!(1, |c: [u8; 1]| c[0] as i8 as f32),
        ElementType::U8 | ElementType::Bool => each!(1, |c: [u8; 1]| c[0] as f32),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn bf16_and_f16_decode_match_reference_on_random_values() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let vals: Vec<f32> = (0..1000).map(|_| rng.random_range(-1e3f32..1e3)).collect();
        for (ty, enc) in [
            (ElementType::BF16, (|v: f32| bf16::from_f32(v).to_bits()) as fn(f32) -> u16),
            (ElementType::F16, |v: f32| f16::from_f32(v).to_bits()),
        ] {
            let bytes: Vec<u8> = vals.iter().flat_map(|&v| enc(v).to_le_bytes()).collect();
            let mut out = vec![f32::NAN; vals.len()];
            decode_to_f32(ty, &bytes, &mut out).unwrap();
            for (i, &v) in vals.iter().enumerate() {
                // Plain reference: bf16 keeps the top 16 bits of f32 (round to nearest even).
                let want = match ty {
                    ElementType::BF16 => {
                        let bits = v.to_bits();
                        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
                        f32::from_bits(rounded)
                    }
                    _ => f16::from_f32(v).to_f32(),
                };
                assert_eq!(out[i], want, "{ty:?} {v}");
            }
        }
    }

    #[test]
    fn f32_roundtrip_and_length_check() {
        let vals = [1.5f32, -2.25, 3.0e-8];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = [0f32; 3];
        decode_to_f32(ElementType::F32, &bytes, &mut out).unwrap();
        assert_eq!(out, vals);
        assert!(decode_to_f32(ElementType::F32, &bytes[..11], &mut out).is_err());
    }
}
