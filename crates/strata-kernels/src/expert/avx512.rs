//! AVX-512F path (x86-64, runtime-detected).

//! The AVX2 scheme (see `avx2`) at twice the width: chunks of 32 columns decode to two
//! 16-lane vectors `a`, `b` (int4: 16 even and 16 odd columns), 32 vector registers
//! allow more accumulators per tile. Int4 with a group that is not a multiple of 32
//! runs the AVX2 code instead (see `MatJob::new`). Same determinism argument: a pair's
//! arithmetic does not depend on the tile shape, the column blocks or the other rows.

use super::{with_scale_read, Out, Product, QuantKind, ScaleRead};
use std::arch::x86_64::*;

pub(super) trait Decode {
    /// Accumulator registers per pair (int4: 2).
    const REGS: usize = 1;
    /// Whether the pair folds `g` into `acc` at segment ends (see `seg_end`).
    const SEGMENTED: bool = false;
    /// Chunks per segment (the int4 group / 32) when SEGMENTED.
    fn seg_chunks(&self) -> usize {
        usize::MAX
    }
    /// The two weight vectors of chunk `k` of output `o`.
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512);
    /// Payload bytes of one chunk of one output.
    const CHUNK_BYTES: usize;
    /// Address of chunk `k` of output `o` (for prefetching).
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8;
    /// Folds a finished segment `s` of output `o`, row `r`.
    #[inline(always)]
    unsafe fn seg_end(&self, _o: usize, _s: usize, _r: usize, _g: __m512, acc: __m512) -> __m512 {
        acc
    }
    /// SEGMENTED: what to subtract from output `o`, row `r` after the horizontal sum.
    #[inline(always)]
    unsafe fn corr(&self, _o: usize, _r: usize) -> f32 {
        0.0
    }
    /// Adds the scalar tail (columns `32 * nfull ..`) and any per-row scale to `simd`.
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32;
}

struct F32Dec<'a> {
    p: &'a [u8],
    cols: usize,
    nfull: usize,
}
impl Decode for F32Dec<'_> {
    const CHUNK_BYTES: usize = 128;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add((o * self.cols + k * 32) * 4)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
        let p = self.p.as_ptr().add((o * self.cols + k * 32) * 4) as *const f32;
        (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
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
    const CHUNK_BYTES: usize = 64;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add((o * self.cols + k * 32) * 2)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
        let p = self.p.as_ptr().add((o * self.cols + k * 32) * 2);
        let a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        let b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(32) as *const __m256i));
        (_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
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
    const CHUNK_BYTES: usize = 32;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.cols + k * 32)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
        let p = self.p.as_ptr().add(o * self.cols + k * 32);
        let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
        let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
        (_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b))
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
            s += self.p[o * self.cols + c] as i8 as f32 * xv;
        }
        s * self.scales[o]
    }
}

/// FP8 e4m3 with block scales: a chunk's 32 bytes decode exactly (the 7-bit magnitude
/// shifted into f32 position and multiplied by 2^120, then the sign), so products are
/// exact before rounding; each block of columns (a segment) folds with its block scale.
struct Fp8Dec<'a> {
    p: &'a [u8],
    scales: &'a [f32],
    cols: usize,
    nfull: usize,
    block_rows: usize,
    block_cols: usize,
    /// Scale blocks per row of blocks.
    ncb: usize,
}
impl Decode for Fp8Dec<'_> {
    const CHUNK_BYTES: usize = 32;
    const REGS: usize = 2;
    const SEGMENTED: bool = true;
    fn seg_chunks(&self) -> usize {
        self.block_cols / 32
    }
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.cols + k * 32)
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
        let p = self.p.as_ptr().add(o * self.cols + k * 32);
        (fp8x16(p), fp8x16(p.add(16)))
    }
    #[inline(always)]
    unsafe fn seg_end(&self, o: usize, s: usize, _r: usize, g: __m512, acc: __m512) -> __m512 {
        let sc = *self.scales.get_unchecked((o / self.block_rows) * self.ncb + s);
        _mm512_fmadd_ps(g, _mm512_set1_ps(sc), acc)
    }
    fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
        let mut s = simd;
        let row = (o / self.block_rows) * self.ncb;
        for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
            s += crate::fp8::fp8_e4m3_to_f32(self.p[o * self.cols + c]) * self.scales[row + c / self.block_cols] * xv;
        }
        s
    }
}

/// 16 e4m3 bytes as floats.
#[inline(always)]
unsafe fn fp8x16(p: *const u8) -> __m512 {
    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
    let mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7f)), 20);
    let f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(f32::from_bits(0x7B80_0000)));
    let sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign))
}

/// int4 with `group % 32 == 0`: 16 bytes a chunk, otherwise as `avx2::I4Dec`.
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
    const CHUNK_BYTES: usize = 16;
    #[inline(always)]
    fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
        self.p.as_ptr().wrapping_add(o * self.half + k * 16)
    }
    const REGS: usize = 2;
    const SEGMENTED: bool = true;
    fn seg_chunks(&self) -> usize {
        self.group / 32
    }
    #[inline(always)]
    unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
        let p = self.p.as_ptr().add(o * self.half + k * 16);
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        // The low nibble as a float straight from a 16-entry table (the permute reads
        // only the index's low 4 bits): the same value as converting `v & 15`.
        let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        (_mm512_permutexvar_ps(v, table), _mm512_cvtepi32_ps(v))
    }
    #[inline(always)]
    unsafe fn seg_end(&self, o: usize, s: usize, r: usize, g: __m512, acc: __m512) -> __m512 {
        let _ = r;
        _mm512_fmadd_ps(g, _mm512_set1_ps(self.scales.at(o * self.groups + s)), acc)
    }
    #[inline(always)]
    unsafe fn corr(&self, o: usize, r: usize) -> f32 {
        let (s0, xp) = (o * self.groups, self.xg.as_ptr().add(r * self.groups));
        let n16 = self.groups / 16 * 16;
        let mut v = _mm512_setzero_ps();
        for i in (0..n16).step_by(16) {
            v = _mm512_fmadd_ps(self.scales.load16(s0 + i), _mm512_loadu_ps(xp.add(i)), v);
        }
        let mut c = hsum(v);
        for i in n16..self.groups {
            c += self.scales.at(s0 + i) * *xp.add(i);
        }
        c
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
    for c in nfull * 32..cols {
        let byte = p[o * half + c / 2];
        let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        // SAFETY: the matrix was validated, so every group of row o has its scale.
        s += (nib as i32 - 8) as f32 * unsafe { scales.at(o * groups + c / group) } * x[c];
    }
    s
}

/// x as the kernels read it: row `r`, chunk `k` at `ptr + r * stride + 32 k`.
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
    let (cols, nfull) = (w.cols, w.cols / 32);
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
        QuantKind::Mxfp4 => unreachable!("mxfp4 runs the AVX2 code (chunk width 16)"),
    }
}

/// # Safety
/// As [`block`], for an int4 matrix whose scales `scales` reads.
unsafe fn int4_block<S: ScaleRead>(job: &Product, scales: S, group: usize, o0: usize, o1: usize, out: &Out) {
    let (p, cols, nfull) = (job.w.payload, job.w.cols, job.w.cols / 32);
    let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
    let xs = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
    debug_assert_eq!(group % 32, 0, "int4 groups not a multiple of 32 run on the AVX2 code");
    let d = I4Dec { p, scales, xg: job.xg, cols, half, group, groups, nfull };
    rows_block(&Ctx { d, xs, x: job.x, cols, nfull }, job.rows, o0, o1, out)
}

/// Row tiles of up to 8 rows; within a tile, output groups of OT and column blocks
/// that keep the tile's x in L1.
#[target_feature(enable = "avx512f")]
unsafe fn rows_block<D: Decode>(c: &Ctx<D>, rows: usize, o0: usize, o1: usize, out: &Out) {
    // Per output: 2 * RT vectors (g then acc) carried between column blocks, for
    // STATE_OUTS outputs at a time, on the stack (a step allocates nothing). Only
    // multi-row tiles split columns, so one-row products never touch it.
    let mut state = None;
    let mut r0 = 0;
    while r0 < rows {
        let rt = (rows - r0).min(8);
        // Column blocks keep a multi-row tile's x (16 KiB) in L1; one row is not split.
        let mut kb = if rt == 1 { c.nfull.max(1) } else { ((16 << 10) / (rt * 128)).max(1) };
        if D::SEGMENTED {
            kb = kb.next_multiple_of(c.d.seg_chunks());
        }
        let step = if kb < c.nfull { STATE_OUTS } else { o1 - o0 };
        let mut a = o0;
        while a < o1 {
            let b = (a + step).min(o1);
            let st = if kb < c.nfull {
                &mut state.get_or_insert([_mm512_setzero_ps(); STATE_OUTS * 2 * 8])[..]
            } else {
                &mut [][..]
            };
            match (rt, D::REGS) {
                (1, _) => outs::<D, 8, 1>(c, r0, a, b, kb, st, out),
                (2, 1) => outs::<D, 8, 2>(c, r0, a, b, kb, st, out),
                (2, _) => outs::<D, 4, 2>(c, r0, a, b, kb, st, out),
                (3, 1) => outs::<D, 4, 3>(c, r0, a, b, kb, st, out),
                (4, 1) => outs::<D, 4, 4>(c, r0, a, b, kb, st, out),
                (3, _) => outs::<D, 2, 3>(c, r0, a, b, kb, st, out),
                (4, _) => outs::<D, 2, 4>(c, r0, a, b, kb, st, out),
                (5, 1) => outs::<D, 2, 5>(c, r0, a, b, kb, st, out),
                (6, 1) => outs::<D, 2, 6>(c, r0, a, b, kb, st, out),
                (7, 1) => outs::<D, 2, 7>(c, r0, a, b, kb, st, out),
                (_, 1) => outs::<D, 2, 8>(c, r0, a, b, kb, st, out),
                (5, _) => outs::<D, 2, 5>(c, r0, a, b, kb, st, out),
                (6, _) => outs::<D, 2, 6>(c, r0, a, b, kb, st, out),
                (7, _) => outs::<D, 2, 7>(c, r0, a, b, kb, st, out),
                _ => outs::<D, 2, 8>(c, r0, a, b, kb, st, out),
            }
            a = b;
        }
        r0 += rt;
    }
}

/// Outputs whose column-block state a multi-row tile keeps at once.
const STATE_OUTS: usize = 32;

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn outs<D: Decode, const OT: usize, const RT: usize>(
    c: &Ctx<D>,
    r0: usize,
    o0: usize,
    o1: usize,
    kb: usize,
    state: &mut [__m512],
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
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f")]
unsafe fn tile<D: Decode, const OT: usize, const RT: usize>(
    c: &Ctx<D>,
    r0: usize,
    o0: usize,
    k0: usize,
    k1: usize,
    state: &mut [__m512],
    last: bool,
    out: &Out,
) {
    let mut g = [[_mm512_setzero_ps(); RT]; OT];
    let mut acc = [[_mm512_setzero_ps(); RT]; OT];
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
                    let p = c.d.chunk_ptr(o0 + OT + oi, k) as *const i8;
                    _mm_prefetch::<PF_HINT>(p);
                    if D::CHUNK_BYTES > 64 {
                        _mm_prefetch::<PF_HINT>(p.wrapping_add(64));
                    }
                }
            }
            // Decode the tile's weights once, then each row's x once (32 registers
            // hold them); the pair's arithmetic is unchanged.
            let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); OT];
            for (oi, wo) in w.iter_mut().enumerate() {
                *wo = c.d.chunk(o0 + oi, k);
            }
            for ri in 0..RT {
                let xp = c.xs.ptr.add((r0 + ri) * c.xs.stride + k * 32);
                let (xa, xb) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
                for (oi, &(wa, wb)) in w.iter().enumerate() {
                    g[oi][ri] = _mm512_fmadd_ps(wa, xa, g[oi][ri]);
                    g[oi][ri] = _mm512_fmadd_ps(wb, xb, g[oi][ri]);
                }
            }
            k += 1;
        }
        if D::SEGMENTED && (k == seg_end || k == c.nfull) {
            for oi in 0..OT {
                for ri in 0..RT {
                    acc[oi][ri] = c.d.seg_end(o0 + oi, s, r0 + ri, g[oi][ri], acc[oi][ri]);
                    g[oi][ri] = _mm512_setzero_ps();
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

/// Horizontal sum in a fixed order: (lo256 + hi256), then as `avx2::hsum`.
#[target_feature(enable = "avx512f")]
unsafe fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    let v8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}
