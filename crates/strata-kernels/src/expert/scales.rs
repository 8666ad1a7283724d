//! A matrix's scales as stored (f32; bf16 for `int4-gN-bf16`; e4m3 codes and a factor for
//! `int4-gN-e4m3`), and how the SIMD int4 decoders read them.

use crate::quant::{e4m3_scale, e8m0_scale, ScaleType, E4M3_HEADER, E4M3_WIDEN};

/// A matrix's scales as stored, borrowed (see [`ScaleType`]).
#[derive(Clone, Copy, Debug)]
pub enum Scales<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// e4m3 codes and the matrix factor they multiply (see [`ScaleType::E4m3`]).
    E4m3 {
        factor: f32,
        codes: &'a [u8],
    },
    /// Power-of-two codes (MXFP4's).
    E8m0(&'a [u8]),
}

impl<'a> Scales<'a> {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::Bf16(s) => s.len(),
            Self::E4m3 { codes, .. } => codes.len(),
            Self::E8m0(codes) => codes.len(),
        }
    }

    /// An e4m3 matrix's stored region (factor, then codes); `None` if shorter than the
    /// factor.
    pub fn e4m3(region: &'a [u8]) -> Option<Self> {
        let (f, codes) = region.split_first_chunk::<E4M3_HEADER>()?;
        Some(Self::E4m3 { factor: f32::from_le_bytes(*f), codes })
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn scale_type(&self) -> ScaleType {
        match self {
            Self::F32(_) => ScaleType::F32,
            Self::Bf16(_) => ScaleType::Bf16,
            Self::E4m3 { .. } => ScaleType::E4m3,
            Self::E8m0(_) => ScaleType::E8m0,
        }
    }

    /// Scale `i` as f32 (panics out of bounds).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Self::F32(s) => s[i],
            Self::Bf16(s) => bf16_to_f32(s[i]),
            Self::E4m3 { factor, codes } => e4m3_scale(codes[i], *factor),
            Self::E8m0(codes) => e8m0_scale(codes[i]),
        }
    }

    /// The f32 scales of an encoding that has no other kind (int8, FP8).
    pub(crate) fn f32(&self) -> &'a [f32] {
        match *self {
            Self::F32(s) => s,
            Self::Bf16(_) | Self::E4m3 { .. } | Self::E8m0(_) => {
                unreachable!("only int4 and mxfp4 scales are stored as bf16, e4m3 or e8m0 (validated)")
            }
        }
    }

    /// Scales `range` (for row views).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Scales<'a> {
        match *self {
            Self::F32(s) => Self::F32(&s[range]),
            Self::Bf16(s) => Self::Bf16(&s[range]),
            Self::E4m3 { factor, codes } => Self::E4m3 { factor, codes: &codes[range] },
            Self::E8m0(codes) => Self::E8m0(&codes[range]),
        }
    }

    /// All scales widened to f32.
    pub fn to_vec(&self) -> Vec<f32> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
}

impl<'a> From<&'a [f32]> for Scales<'a> {
    fn from(s: &'a [f32]) -> Self {
        Self::F32(s)
    }
}
impl<'a> From<&'a Vec<f32>> for Scales<'a> {
    fn from(s: &'a Vec<f32>) -> Self {
        Self::F32(s)
    }
}
impl<'a, const N: usize> From<&'a [f32; N]> for Scales<'a> {
    fn from(s: &'a [f32; N]) -> Self {
        Self::F32(s)
    }
}

#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Scales as the int4 SIMD decoders read them: one implementation per [`ScaleType`], so
/// the f32, bf16 and e4m3 paths are separate monomorphised loops that do the same
/// arithmetic on the same f32 values (a bf16 or e4m3 matrix computes bit for bit what its
/// f32 twin does).
pub(crate) trait ScaleRead: Copy {
    /// # Safety
    /// `i` in bounds.
    unsafe fn at(self, i: usize) -> f32;
    /// Scales `i..i + 8`.
    /// # Safety
    /// In bounds; AVX2 available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256;
    /// Scales `i..i + 16`.
    /// # Safety
    /// In bounds; AVX-512F available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512;
}

impl ScaleRead for &[f32] {
    #[inline(always)]
    unsafe fn at(self, i: usize) -> f32 {
        *self.get_unchecked(i)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(self.as_ptr().add(i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(self.as_ptr().add(i))
    }
}

/// bf16 scales (bit patterns) for [`ScaleRead`].
#[derive(Clone, Copy)]
pub(crate) struct Bf16Scales<'a>(pub(crate) &'a [u16]);

impl ScaleRead for Bf16Scales<'_> {
    #[inline(always)]
    unsafe fn at(self, i: usize) -> f32 {
        bf16_to_f32(*self.0.get_unchecked(i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(self.0.as_ptr().add(i) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(self.0.as_ptr().add(i) as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
    }
}

/// e4m3 scales (codes and the matrix factor) for [`ScaleRead`]: widened as
/// [`e4m3_scale`] does, code bits into an f32 and two exact products.
/// MXFP4's power-of-two scales.
#[derive(Clone, Copy)]
pub(crate) struct E8m0Scales<'a>(pub(crate) &'a [u8]);

impl ScaleRead for E8m0Scales<'_> {
    #[inline(always)]
    unsafe fn at(self, i: usize) -> f32 {
        e8m0_scale(*self.0.get_unchecked(i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        let v: [f32; 8] = std::array::from_fn(|j| self.at(i + j));
        std::arch::x86_64::_mm256_loadu_ps(v.as_ptr())
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        let v: [f32; 16] = std::array::from_fn(|j| self.at(i + j));
        std::arch::x86_64::_mm512_loadu_ps(v.as_ptr())
    }
}

#[derive(Clone, Copy)]
pub(crate) struct E4m3Scales<'a> {
    pub(crate) factor: f32,
    pub(crate) codes: &'a [u8],
}

impl ScaleRead for E4m3Scales<'_> {
    #[inline(always)]
    unsafe fn at(self, i: usize) -> f32 {
        e4m3_scale(*self.codes.get_unchecked(i), self.factor)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(self, i: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(self.codes.as_ptr().add(i) as *const __m128i));
        let v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 20)), _mm256_set1_ps(E4M3_WIDEN));
        _mm256_mul_ps(v, _mm256_set1_ps(self.factor))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(self, i: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(self.codes.as_ptr().add(i) as *const __m128i));
        let v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 20)), _mm512_set1_ps(E4M3_WIDEN));
        _mm512_mul_ps(v, _mm512_set1_ps(self.factor))
    }
}

/// `$body` with `$s` bound to the [`ScaleRead`] of the int4 scales `$scales` (a
/// [`Scales`]): the one place a stored scale type picks its reader, for each SIMD path's
/// int4 dispatch (a generic closure cannot be passed on, so a macro expands the match).
macro_rules! with_scale_read {
    ($scales:expr, $s:ident => $body:expr) => {
        match $scales {
            $crate::expert::Scales::F32(x) => {
                let $s = x;
                $body
            }
            $crate::expert::Scales::Bf16(x) => {
                let $s = $crate::expert::scales::Bf16Scales(x);
                $body
            }
            $crate::expert::Scales::E4m3 { factor, codes } => {
                let $s = $crate::expert::scales::E4m3Scales { factor, codes };
                $body
            }
            $crate::expert::Scales::E8m0(codes) => {
                let $s = $crate::expert::scales::E8m0Scales(codes);
                $body
            }
        }
    };
}
pub(crate) use with_scale_read;
