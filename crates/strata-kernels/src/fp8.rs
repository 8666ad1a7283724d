//! FP8 e4m3 ("fn" variant: no infinities, 0x7f/0xff are NaN, max 448) and block-scaled
//! dequantization as used by DeepSeek-V3 / GLM-5 FP8 checkpoints, where a weight
//! `W[O, I]` comes with `weight_scale_inv[ceil(O/bo), ceil(I/bi)]` and
//! `w = fp8(W[o, i]) * scale_inv[o / bo, i / bi]`.

use std::sync::LazyLock;

/// All 256 e4m3 values, decoded once.
static E4M3_TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| {
    let mut table = [0f32; 256];
    for (byte, slot) in table.iter_mut().enumerate() {
        *slot = decode_e4m3(byte as u8);
    }
    table
});

fn decode_e4m3(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0f) as i32;
    let mantissa = (byte & 0x07) as f32;
    if exp == 0x0f && (byte & 0x07) == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: 0.mmm * 2^(1 - bias).
        mantissa / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// The e4m3 byte nearest to `v` (saturating at +-448; ties to the even code).
pub fn f32_to_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    sign | crate::quant::e4m3_code(v.abs().min(448.0), 1.0)
}

/// Decodes one FP8 e4m3 byte.
#[inline]
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    E4M3_TABLE[byte as usize]
}

/// Dequantizes a row-major `[rows, cols]` FP8 e4m3 matrix with block scales
/// `scale_inv[ceil(rows/block.0), ceil(cols/block.1)]` into `out` (length rows*cols).
pub fn dequantize_fp8_blocks(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    scale_inv: &[f32],
    block: (usize, usize),
    out: &mut [f32],
) -> Result<(), String> {
    let (bo, bi) = block;
    if bo == 0 || bi == 0 {
        return Err(format!("FP8 block size must be positive, got {bo}x{bi}"));
    }
    let (so, si) = (rows.div_ceil(bo), cols.div_ceil(bi));
    if bytes.len() != rows * cols || out.len() != rows * cols {
        return Err(format!(
            "FP8 matrix {rows}x{cols} needs {} bytes, got {} (output {})",
            rows * cols,
            bytes.len(),
            out.len()
        ));
    }
    if scale_inv.len() != so * si {
        return Err(format!(
            "FP8 scale_inv for {rows}x{cols} with {bo}x{bi} blocks needs {so}x{si} = {} values, got {}",
            so * si,
            scale_inv.len()
        ));
    }
    let table = &*E4M3_TABLE;
    for r in 0..rows {
        let scale_row = &scale_inv[(r / bo) * si..(r / bo + 1) * si];
        let src = &bytes[r * cols..(r + 1) * cols];
        let dst = &mut out[r * cols..(r + 1) * cols];
        for (c, (d, &b)) in dst.iter_mut().zip(src).enumerate() {
            *d = table[b as usize] * scale_row[c / bi];
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Reference: decode by searching the value the bits denote with f64 arithmetic.
    fn reference(byte: u8) -> f64 {
        let s = if byte >> 7 == 1 { -1.0 } else { 1.0 };
        let e = ((byte >> 3) & 15) as i32;
        let m = (byte & 7) as f64;
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        if e == 0 {
            s * m * 2f64.powi(-9)
        } else {
            s * (8.0 + m) * 2f64.powi(e - 10)
        }
    }

    #[test]
    fn every_byte_matches_reference() {
        for b in 0..=255u8 {
            let (got, want) = (fp8_e4m3_to_f32(b) as f64, reference(b));
            if want.is_nan() {
                assert!(got.is_nan(), "byte {b:#x}");
            } else {
                assert_eq!(got, want, "byte {b:#x}");
            }
        }
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn block_dequant_matches_plain_loop_on_random_input() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (rows, cols, block) = (37usize, 300usize, (16usize, 128usize));
        let bytes: Vec<u8> = (0..rows * cols)
            .map(|_| loop {
                let b: u8 = rng.random();
                if b & 0x7f != 0x7f {
                    break b;
                }
            })
            .collect();
        let (so, si) = (rows.div_ceil(block.0), cols.div_ceil(block.1));
        let scales: Vec<f32> = (0..so * si).map(|_| rng.random_range(0.01..2.0)).collect();
        let mut out = vec![f32::NAN; rows * cols];
        dequantize_fp8_blocks(&bytes, rows, cols, &scales, block, &mut out).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let want = reference(bytes[r * cols + c]) * scales[(r / block.0) * si + c / block.1] as f64;
                assert_eq!(out[r * cols + c] as f64, (want as f32) as f64, "({r},{c})");
            }
        }
    }

    #[test]
    fn block_dequant_rejects_wrong_scale_count() {
        let mut out = vec![0.0; 4];
        let err = dequantize_fp8_blocks(&[0; 4], 2, 2, &[1.0, 1.0], (128, 128), &mut out).unwrap_err();
        assert!(err.contains("needs 1x1"), "{err}");
    }
}
