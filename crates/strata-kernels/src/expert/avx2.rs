//! AVX2 + FMA path (x86-64, runtime-detected).

//! Register tiles of OT outputs x RT rows. Columns go in chunks of 16: a chunk's weights
//! decode to two 8-lane vectors `a`, `b`, and each (output, row) pair does
//! `g = fma(a, xa, g); g = fma(b, xb, g)`, chunks in order. For int4 (group a multiple
//! of 16) `a`, `b` are the raw nibbles `n` (0..15) and at the end of each group the pair
//! folds `acc = fma(g, scale, acc)`, then resets `g` (the `- 8` is subtracted once per
//! output, see `I4Dec`); int8
//! accumulates `q` and multiplies by the row scale at the end. Then a fixed horizontal
//! sum and the `cols % 16` tail in scalar.
//!
//! The pair's arithmetic is the same whatever the tile shape, the column blocking (the
//! pair's vectors are stored and reloaded exactly between column blocks) or the output
//! block, which is what makes results independent of the batch and of the threads.
//! For int4, `a` holds a chunk's even columns and `b` its odd columns (x is
//! pre-permuted to match, see `I4Dec`); otherwise `a` = columns 0..8 and `b` = 8..16.

use super::{with_scale_read, Out, Product, QuantKind, ScaleRead};
use std::arch::x86_64::*;

pub(super) trait Decode {
    /// Outputs per tile for a one-row tile (fewer where a pair needs more registers).
    const WIDE: usize = 8;
    /// Whether the pair folds `g` into `acc` at segment ends (see `seg_end`).
    const SEGMENTED: bool = false;
    /// Chunks per segment (the int4 group / 16) when SEGMENTED.
    fn seg_chunks(&self) -> usize {
        usize::MAX
    }
    /// The two weight vectors of chunk `k` of output `o`.
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256);
    /// Payload bytes of one chunk of one output.
    const CHUNK_BYTES: usize;
    /// Address of chunk `k` of output `o` (for prefetching).
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8;
    /// Folds a finished segment `s` of output `o`, row `r`.
    #[inline(always)]
    unsafe fn seg_end(&self, _o: usize, _s: usize, _r: usize, _g: __m256, acc: __m256) -> __m256 {
        acc
    }
    /// SEGMENTED: what to subtract from output `o`, row `r` after the horizontal sum.
    #[inline(always)]
    unsafe fn corr(&self, _o: usize, _r: usize) -> f32 {
        0.0
    }
    /// Adds the scalar tail (columns `16 * nfull ..`) and any per-row scale to `simd`.
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32;
}

struct F32Dec<'a> {
    p: &'a [u8],
    cols: usize,
    nfull: usize,
}
impl Decode for F32Dec<'_> {
    const CHUNK_BYTES: usize = 64;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add((o * self.cols + k * 16) * 4)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let p = self.p.as_ptr().add((o * self.cols + k * 16) * 4) as *const f32;
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
            let b = &self.p[(o * self.cols + c) * 4..][..4];
            s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * xv;
        }
        s
    }
}

struct Bf16Dec<'a> {
    p: &'a [u8],
    cols: usize,
    nfull: usize,
}
impl Decode for Bf16Dec<'_> {
    const CHUNK_BYTES: usize = 32;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add((o * self.cols + k * 16) * 2)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let p = self.p.as_ptr().add((o * self.cols + k * 16) * 2);
        let a = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        let b = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
        (_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
            let b = &self.p[(o * self.cols + c) * 2..][..2];
            s += f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) * xv;
        }
        s
    }
}

/// int8-row: accumulates q * x and applies the row scale once at the end.
struct I8Dec<'a> {
    p: &'a [u8],
    scales: &'a [f32],
    cols: usize,
    nfull: usize,
}
impl Decode for I8Dec<'_> {
    const CHUNK_BYTES: usize = 16;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.cols + k * 16)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let p = self.p.as_ptr().add(o * self.cols + k * 16);
        let a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
        (_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
            s += self.p[o * self.cols + c] as i8 as f32 * xv;
        }
        s * self.scales[o]
    }
}

/// FP8 e4m3 with block scales (see `avx512::Fp8Dec`), 16 columns a chunk.
struct Fp8Dec<'a> {
    p: &'a [u8],
    scales: &'a [f32],
    cols: usize,
    nfull: usize,
    block_rows: usize,
    block_cols: usize,
    ncb: usize,
}
impl Decode for Fp8Dec<'_> {
    const CHUNK_BYTES: usize = 16;
    const WIDE: usize = 4;
    const SEGMENTED: bool = true;
    fn seg_chunks(&self) -> usize {
        self.block_cols / 16
    }
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.cols + k * 16)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let p = self.p.as_ptr().add(o * self.cols + k * 16);
        (fp8x8(p), fp8x8(p.add(8)))
    }
    #[inline(always)]
    unsafe fn seg_end(&self, o: usize, s: usize, _r: usize, g: __m256, acc: __m256) -> __m256 {
        let sc = self.scales.get_unchecked((o / self.block_rows) * self.ncb + s);
        _mm256_fmadd_ps(g, _mm256_broadcast_ss(sc), acc)
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        let row = (o / self.block_rows) * self.ncb;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
            s += crate::fp8::fp8_e4m3_to_f32(self.p[o * self.cols + c]) * self.scales[row + c / self.block_cols] * xv;
        }
        s
    }
}

/// 8 e4m3 bytes as floats (exact: magnitude bits into f32 position, times 2^120, sign).
#[inline(always)]
unsafe fn fp8x8(p: *const u8) -> __m256 {
    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20);
    let f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(f32::from_bits(0x7B80_0000)));
    let sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign))
}

/// int4 with `group % 16 == 0`. A chunk is 8 bytes `v = lo + 16 hi` (lo = even column,
/// hi = odd column); it decodes to `a = lo`, `b = v` (no shift, one convert each), and
/// x is staged as `xa' = xa - xb/16`, `xb' = xb/16`, so that
/// `a xa' + b xb' = lo xa + hi xb` (the raw nibbles, 0..15). A segment (group) ends
/// with `acc = fma(g, scale[o, s], acc)`; after the horizontal sum the output subtracts
/// `sum_s scale[o, s] * xg[r, s]` (`xg` = 8 times the group sums of x, see `int4_xg`),
/// so the `- 8` offset and the scale cost nothing per weight.
struct I4Dec<'a, S> {
    p: &'a [u8],
    scales: S,
    xg: &'a [f32],
    cols: usize,
    half: usize,
    group: usize,
    groups: usize,
    nfull: usize,
}
impl<S: ScaleRead> Decode for I4Dec<'_, S> {
    const CHUNK_BYTES: usize = 8;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.half + k * 8)
    }
    const WIDE: usize = 4;
    const SEGMENTED: bool = true;
    fn seg_chunks(&self) -> usize {
        self.group / 16
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let p = self.p.as_ptr().add(o * self.half + k * 8);
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let lo = _mm256_and_si256(v, _mm256_set1_epi32(0x0f));
        (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(v))
    }
    #[inline(always)]
    unsafe fn seg_end(&self, o: usize, s: usize, r: usize, g: __m256, acc: __m256) -> __m256 {
        let _ = r;
        _mm256_fmadd_ps(g, _mm256_set1_ps(self.scales.at(o * self.groups + s)), acc)
    }
    #[inline(always)]
    unsafe fn corr(&self, o: usize, r: usize) -> f32 {
        let (s0, xp) = (o * self.groups, self.xg.as_ptr().add(r * self.groups));
        let n8 = self.groups / 8 * 8;
        let mut v = _mm256_setzero_ps();
        for i in (0..n8).step_by(8) {
            v = _mm256_fmadd_ps(self.scales.load8(s0 + i), _mm256_loadu_ps(xp.add(i)), v);
        }
        let mut c = hsum(v);
        for i in n8..self.groups {
            c += self.scales.at(s0 + i) * *xp.add(i);
        }
        c
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        i4_tail(self.p, self.scales, self.half, self.group, self.groups, self.nfull, self.cols, o, simd, x)
    }
}

/// int4 with any even group: per-lane scales gathered in scalar (slow, uncommon).
struct I4AnyDec<'a, S> {
    p: &'a [u8],
    scales: S,
    cols: usize,
    half: usize,
    group: usize,
    groups: usize,
    nfull: usize,
}
impl<S: ScaleRead> Decode for I4AnyDec<'_, S> {
    const CHUNK_BYTES: usize = 8;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.half + k * 8)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
        let row = &self.p[o * self.half..];
        let s0 = o * self.groups;
        for j in 0..8 {
            let c = k * 16 + 2 * j;
            let byte = row[c / 2];
            a[j] = ((byte & 0x0f) as i32 - 8) as f32 * self.scales.at(s0 + c / self.group);
            b[j] = ((byte >> 4) as i32 - 8) as f32 * self.scales.at(s0 + (c + 1) / self.group);
        }
        (_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr()))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        i4_tail(self.p, self.scales, self.half, self.group, self.groups, self.nfull, self.cols, o, simd, x)
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
fn i4_tail<S: ScaleRead>(
    p: &[u8],
    scales: S,
    half: usize,
    group: usize,
    groups: usize,
    nfull: usize,
    cols: usize,
    o: usize,
    simd: f32,
    x: &[f32],
) -> f32 {
    let mut s = simd;
    for c in nfull * 16..cols {
        let byte = p[o * half + c / 2];
        let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        // SAFETY: the matrix was validated, so every group of row o has its scale.
        s += (nib as i32 - 8) as f32 * unsafe { scales.at(o * groups + c / group) } * x[c];
    }
    s
}

/// x as the kernels read it: row `r`, chunk `k` at `ptr + r * stride + 16 k`.
struct XRows {
    ptr: *const f32,
    stride: usize,
}

struct Ctx<'a, D> {
    d: D,
    xs: XRows,
    x: &'a [f32],
    cols: usize,
    nfull: usize,
}

/// # Safety
/// AVX2 and FMA available; `job` validated; `o0..o1` owned by the caller.
pub(super) unsafe fn block(job: &Product, o0: usize, o1: usize, out: &Out) {
    let w = &job.w;
    let (cols, nfull) = (w.cols, w.cols / 16);
    let plain = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
    match w.kind {
        QuantKind::F32 => {
            let d = F32Dec { p: w.payload, cols, nfull };
            rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
        }
        QuantKind::Bf16 => {
            let d = Bf16Dec { p: w.payload, cols, nfull };
            rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
        }
        QuantKind::Fp8 { block_rows, block_cols } => {
            let ncb = cols.div_ceil(block_cols);
            let d = Fp8Dec { p: w.payload, scales: w.scales.f32(), cols, nfull, block_rows, block_cols, ncb };
            rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
        }
        QuantKind::Int8Row => {
            let d = I8Dec { p: w.payload, scales: w.scales.f32(), cols, nfull };
            rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
        }
        QuantKind::Int4Group { group, .. } => with_scale_read!(w.scales, s => int4_block(job, s, group, o0, o1, out)),
        QuantKind::Mxfp4 => {
            let crate::expert::Scales::E8m0(codes) = w.scales else {
                unreachable!("mxfp4 scales are e8m0 (validated)")
            };
            let d = Mxfp4Dec { p: w.payload, codes, half: cols / 2, groups: cols / 32 };
            rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
        }
    }
}

/// MXFP4: a chunk's 16 nibbles (8 bytes) in column order, each looked up as twice its
/// FP4 value (an int8: 0, 1, 2, 3, 4, 6, 8, 12 and negatives), summed a group (two
/// chunks) at a time and folded with half the group's power-of-two scale. Columns are a
/// multiple of 32 (validated), so there is no tail.
struct Mxfp4Dec<'a> {
    p: &'a [u8],
    codes: &'a [u8],
    half: usize,
    groups: usize,
}
impl Decode for Mxfp4Dec<'_> {
    const CHUNK_BYTES: usize = 8;
    const WIDE: usize = 4;
    const SEGMENTED: bool = true;
    fn seg_chunks(&self) -> usize {
        2
    }
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.half + k * 8)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
        let bytes = _mm_loadl_epi64(self.p.as_ptr().add(o * self.half + k * 8) as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(bytes, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        // Column order: byte j's low nibble, then its high one.
        let nibs = _mm_unpacklo_epi8(lo, hi);
        let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        let v = _mm_shuffle_epi8(lut, nibs);
        let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        let b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
        (a, b)
    }
    #[inline(always)]
    unsafe fn seg_end(&self, o: usize, s: usize, _r: usize, g: __m256, acc: __m256) -> __m256 {
        let scale = crate::quant::e8m0_scale(*self.codes.get_unchecked(o * self.groups + s)) * 0.5;
        _mm256_fmadd_ps(g, _mm256_set1_ps(scale), acc)
    }
    fn finish(&self, _o: usize, simd: f32, _x: &[f32]) -> f32 {
        simd
    }
}

/// # Safety
/// As [`block`], for an int4 matrix whose scales `scales` reads.
unsafe fn int4_block<S: ScaleRead>(job: &Product, scales: S, group: usize, o0: usize, o1: usize, out: &Out) {
    let (p, cols, nfull) = (job.w.payload, job.w.cols, job.w.cols / 16);
    let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
    let xs = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
    if group.is_multiple_of(16) {
        let d = I4Dec { p, scales, xg: job.xg, cols, half, group, groups, nfull };
        rows_block(&Ctx { d, xs, x: job.x, cols, nfull }, job.rows, o0, o1, out)
    } else {
        let d = I4AnyDec { p, scales, cols, half, group, groups, nfull };
        rows_block(&Ctx { d, xs, x: job.x, cols, nfull }, job.rows, o0, o1, out)
    }
}

/// Row tiles of up to 8 rows; within a tile, output groups of OT and column blocks
/// that keep the tile's x in L1.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_block<D: Decode>(c: &Ctx<D>, rows: usize, o0: usize, o1: usize, out: &Out) {
    // Per output: 2 * RT vectors (g then acc) carried between column blocks, for
    // STATE_OUTS outputs at a time, on the stack (a step allocates nothing). Only
    // multi-row tiles split columns, so one-row products never touch it.
    let mut state = None;
    let mut r0 = 0;
    while r0 < rows {
        let rt = (rows - r0).min(8);
        // Column blocks keep a multi-row tile's x (16 KiB) in L1; one row is not split.
        let mut kb = if rt == 1 { c.nfull.max(1) } else { ((16 << 10) / (rt * 64)).max(1) };
        if D::SEGMENTED {
            kb = kb.next_multiple_of(c.d.seg_chunks());
        }
        let step = if kb < c.nfull { STATE_OUTS } else { o1 - o0 };
        let mut a = o0;
        while a < o1 {
            let b = (a + step).min(o1);
            let st = if kb < c.nfull {
                &mut state.get_or_insert([_mm256_setzero_ps(); STATE_OUTS * 2 * 8])[..]
            } else {
                &mut [][..]
            };
            match (rt, D::WIDE) {
                (1, 8) => outs::<D, 8, 1>(c, r0, a, b, kb, st, out),
                (1, 4) => outs::<D, 4, 1>(c, r0, a, b, kb, st, out),
                (1, _) => outs::<D, 2, 1>(c, r0, a, b, kb, st, out),
                (2, 8) => outs::<D, 4, 2>(c, r0, a, b, kb, st, out),
                (2, _) => outs::<D, 2, 2>(c, r0, a, b, kb, st, out),
                (3, 8) => outs::<D, 2, 3>(c, r0, a, b, kb, st, out),
                (4, 8) => outs::<D, 2, 4>(c, r0, a, b, kb, st, out),
                (3, _) => outs::<D, 1, 3>(c, r0, a, b, kb, st, out),
                (4, _) => outs::<D, 1, 4>(c, r0, a, b, kb, st, out),
                (5, _) => outs::<D, 1, 5>(c, r0, a, b, kb, st, out),
                (6, _) => outs::<D, 1, 6>(c, r0, a, b, kb, st, out),
                (7, _) => outs::<D, 1, 7>(c, r0, a, b, kb, st, out),
                _ => outs::<D, 1, 8>(c, r0, a, b, kb, st, out),
            }
            a = b;
        }
        r0 += rt;
    }
}

/// Outputs whose column-block state a multi-row tile keeps at once.
const STATE_OUTS: usize = 32;

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn outs<D: Decode, const OT: usize, const RT: usize>(
    c: &Ctx<D>,
    r0: usize,
    o0: usize,
    o1: usize,
    kb: usize,
    state: &mut [__m256],
    out: &Out,
) {
    let mut k0 = 0;
    loop {
        let k1 = (k0 + kb).min(c.nfull);
        let last = k1 == c.nfull;
        let mut o = o0;
        while o + OT <= o1 {
            // (Empty with a single column block: `tile` then never touches it.)
            let st = state.get_mut((o - o0) * 2 * RT..(o - o0 + OT) * 2 * RT).unwrap_or_default();
            tile::<D, OT, RT>(c, r0, o, k0, k1, st, last, out);
            o += OT;
        }
        while o < o1 {
            let st = state.get_mut((o - o0) * 2 * RT..(o - o0 + 1) * 2 * RT).unwrap_or_default();
            tile::<D, 1, RT>(c, r0, o, k0, k1, st, last, out);
            o += 1;
        }
        if last {
            break;
        }
        k0 = k1;
    }
}

/// Chunks `k0..k1` of a tile; resumes from `state` unless `k0 == 0`, and writes the
/// results if `last`, else saves `state` (per output: RT `g` vectors, then RT `acc`).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<D: Decode, const OT: usize, const RT: usize>(
    c: &Ctx<D>,
    r0: usize,
    o0: usize,
    k0: usize,
    k1: usize,
    state: &mut [__m256],
    last: bool,
    out: &Out,
) {
    let mut g = [[_mm256_setzero_ps(); RT]; OT];
    let mut acc = [[_mm256_setzero_ps(); RT]; OT];
    if k0 > 0 {
        for oi in 0..OT {
            for ri in 0..RT {
                g[oi][ri] = state[oi * 2 * RT + ri];
                acc[oi][ri] = state[oi * 2 * RT + RT + ri];
            }
        }
    }
    let spc = c.d.seg_chunks();
    let mut k = k0;
    // Segment of chunk k and where it ends.
    let (mut s, mut seg_end) = if D::SEGMENTED { (k0 / spc, (k0 / spc + 1) * spc) } else { (0, usize::MAX) };
    while k < k1 {
        let kend = k1.min(seg_end);
        while k < kend {
            // The next tile's weights (same chunks, next outputs), a line at a time:
            // rows of W are read in short pieces (a tile's rows in parallel, column
            // blocks) that the hardware prefetcher does not run ahead of.
            if k & ((64 / D::CHUNK_BYTES).max(1) - 1) == 0 {
                for oi in 0..OT {
                    _mm_prefetch::<PF_HINT>(c.d.chunk_ptr(o0 + OT + oi, k) as *const i8);
                }
            }
            for (oi, g_o) in g.iter_mut().enumerate() {
                let (wa, wb) = c.d.chunk(o0 + oi, k);
                for (ri, gv) in g_o.iter_mut().enumerate() {
                    let xp = c.xs.ptr.add((r0 + ri) * c.xs.stride + k * 16);
                    *gv = _mm256_fmadd_ps(wa, _mm256_loadu_ps(xp), *gv);
                    *gv = _mm256_fmadd_ps(wb, _mm256_loadu_ps(xp.add(8)), *gv);
                }
            }
            k += 1;
        }
        if D::SEGMENTED && (k == seg_end || k == c.nfull) {
            for oi in 0..OT {
                for ri in 0..RT {
                    acc[oi][ri] = c.d.seg_end(o0 + oi, s, r0 + ri, g[oi][ri], acc[oi][ri]);
                    g[oi][ri] = _mm256_setzero_ps();
                }
            }
            s += 1;
            seg_end += spc;
        }
    }
    if last {
        for oi in 0..OT {
            for ri in 0..RT {
                let r = r0 + ri;
                let v = if D::SEGMENTED { acc[oi][ri] } else { g[oi][ri] };
                let mut v = hsum(v);
                if D::SEGMENTED {
                    v -= c.d.corr(o0 + oi, r);
                }
                let v = c.d.finish(o0 + oi, v, &c.x[r * c.cols..(r + 1) * c.cols]);
                out.put(r, o0 + oi, v);
            }
        }
    } else {
        for oi in 0..OT {
            for ri in 0..RT {
                state[oi * 2 * RT + ri] = g[oi][ri];
                state[oi * 2 * RT + RT + ri] = acc[oi][ri];
            }
        }
    }
}

const PF_HINT: i32 = _MM_HINT_T0;

/// Horizontal sum in a fixed order: (lo128 + hi128), then pairs, then the last two.
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}
