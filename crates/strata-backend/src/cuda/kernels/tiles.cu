// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// int4 experts in decode on the tensor cores. Decoded one weight at a time into f32
// (products.cu) a 16-byte load of int4 is 32 weights and ~100 instructions, and the expert
// kernels are bound by issue at ~1.2 TB/s. Here a warp computes a tile of 16 matrix rows
// with mma.m16n8k16 (f16 in, f32 accumulate):
// - a nibble n becomes the exact f16 value n - 8 with a mask-or and an f16x2 fma for two
//   weights;
// - x enters as two f16 parts (hi + lo, ~22 significant bits of it), scaled by a power of
//   two per 128 columns so that it stays in f16's range; the sums keep f32-like accuracy;
// - the order of k in a dot product is free: lane t takes its own 32 columns of each
//   128, and B's column 2t (hi) / 2t + 1 (lo) carries lane t's x alone, so C[row][2t] +
//   C[row][2t + 1] is lane t's partial sum, which its group's scale then multiplies.
// Used where every chunk of 128 columns is whole and a group holds whole 32-column runs.

// Chunks of loads in flight a lane (the one being computed and those ahead of it). Three
// spill in gate/up; down, with its four chunks a warp all in flight, was no faster.
#define I4_DEPTH 2
#if __CUDA_ARCH__ >= 800
#define TILE_MMA 1
#else
#define TILE_MMA 0
#endif

// Whether the one-row expert kernels take m through tiles.
__device__ __forceinline__ bool i4_tiles(const Mat& m) {
    return TILE_MMA && m.kind == 3 && m.vec && (m.cols & 127) == 0 && m.group >= 32 && (m.group & 31) == 0;
}

#if TILE_MMA
// u32s of one warp's staged chunk of x: hi then lo, each 4 lanes x 20 (16 used: a pad of 4
// keeps the four lanes' 16-byte reads on distinct banks).
#define XS_WORDS 160

__device__ __forceinline__ void mma_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (lo, hi) rounded to f16x2, lo in the low half.
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// (a & b) | c in one instruction (with two constants, the compiler splits it in two).
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// A word of 8 nibbles (column 2i in byte i's low nibble) as four f16x2 of n - 8, exactly:
// columns (0, 4), (1, 5), (2, 6), (3, 7). Or-ing 0x6400 (1024) makes 1024 + n of a low
// nibble and 1024 + 16 n of a high one; x 1 - 1032 and x 1/16 - 72 leave n - 8.
__device__ __forceinline__ void i4_f16(u32 w, u32* h) {
    const u32 magic = 0x64006400u, one = 0x3C003C00u, m1032 = 0xE408E408u, sixteenth = 0x2C002C00u,
              m72 = 0xD480D480u;
    u32 w8 = w >> 8;
    h[0] = hfma2(and_or(w, 0x000F000Fu, magic), one, m1032);
    h[1] = hfma2(and_or(w, 0x00F000F0u, magic), sixteenth, m72);
    h[2] = hfma2(and_or(w8, 0x000F000Fu, magic), one, m1032);
    h[3] = hfma2(and_or(w8, 0x00F000F0u, magic), sixteenth, m72);
}

// Stages 128 columns of x for the warp's B fragments (v: this lane's 4 of them, columns
// 4 lane .. 4 lane + 3): x * 2^k as f16 hi + lo pairs in i4_f16's column order, k chosen
// from the chunk's largest magnitude. Returns 2^-k.
__device__ __forceinline__ float stage_x(float4 v, u32* xs, int lane) {
    float m = wmax(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    // m * 2^k in [2^14, 2^15): f16's largest is ~2^16. Zero, inf and NaN keep their way.
    int e = (int)((__float_as_uint(m) >> 23) & 0xffu);
    int se = m > 0.f && e < 255 ? min(max(268 - e, 1), 253) : 127;
    float sx = __uint_as_float((u32)se << 23), isx = __uint_as_float((u32)(254 - se) << 23);
    // Lane pairs share a word: the even lane builds pairs (0, 4), (1, 5), the odd (2, 6), (3, 7).
    bool odd = lane & 1;
    float r0 = __shfl_xor_sync(0xffffffffu, odd ? v.x : v.z, 1);
    float r1 = __shfl_xor_sync(0xffffffffu, odd ? v.y : v.w, 1);
    float a0 = (odd ? r0 : v.x) * sx, b0 = (odd ? v.z : r0) * sx;
    float a1 = (odd ? r1 : v.y) * sx, b1 = (odd ? v.w : r1) * sx;
    u32 h0 = pack_f16(a0, b0), h1 = pack_f16(a1, b1);
    float2 f0 = unpack_f16(h0), f1 = unpack_f16(h1);
    u32 l0 = pack_f16(a0 - f0.x, b0 - f0.y), l1 = pack_f16(a1 - f1.x, b1 - f1.y);
    int w = lane >> 1;
    int at = (w >> 2) * 20 + (w & 3) * 4 + (odd ? 2 : 0);
    *(uint2*)(xs + at) = make_uint2(h0, h1);
    *(uint2*)(xs + 80 + at) = make_uint2(l0, l1);
    return isx;
}

// Chunks of x a warp stages for its B fragments before its chunk loop (all of its chunks
// up to this many; more go in batches): the staging's shuffles, stores and barrier then
// run once with every chunk's x load in flight, not as a dependent chain inside each
// chunk's step (ncu: the tile warps waited mostly on that chain).
#define I4_STAGE 8
// x loads in flight together while staging (4: no faster, and a few spills).
#define I4_SGROUP 2

// Rows o0[n] + g and o0[n] + g + 8 (g = lane / 4; past nout the last row again) of NM int4
// matrices of one shape (or one matrix at NM row offsets), over the 128-column chunks
// cb .. ce of x: on return lane 4g holds their dot products, acc[n][0] (row o0[n] + g) and
// acc[n][1] (row o0[n] + g + 8), in f32.
// xs: the warp's I4_STAGE x XS_WORDS words of shared memory, xsc its I4_STAGE floats.
// pre: the caller has not waited on the kernel before; i4_tile does, after its first
// chunk's weight loads (weights never depend on that kernel).
// staged: xs and xsc already hold chunks cb .. ce of this x (an earlier call of the same
// warp over the same columns staged them, and they fit one batch): not staged again.
// ST: how the scales are stored (Mat::st), a parameter so that no type of scale pays for a
// choice per load. An e4m3 matrix's factor is left to the caller: a power of two, it
// scales the sums exactly, and held here it cost the tiles a register each.
template <int NM, int ST>
__device__ __forceinline__ void i4_tile(const Mat* const* m, const int* o0, int nout, const float* x, int cb, int ce,
                                        u32* xs, float* xsc, int lane, float (*acc)[2], bool pre,
                                        bool staged = false) {
    int g = lane >> 2, t = lane & 3;
    const uint4* wa[NM];
    const uint4* wb[NM];
    const u8* sa_row[NM];
    const u8* sb_row[NM];
    int gshift[NM];
#pragma unroll
    for (int n = 0; n < NM; n++) {
        int ra = min(o0[n] + g, nout - 1), rb = min(o0[n] + g + 8, nout - 1);
        wa[n] = (const uint4*)(m[n]->w + (size_t)ra * m[n]->ld) + t;
        wb[n] = (const uint4*)(m[n]->w + (size_t)rb * m[n]->ld) + t;
        sa_row[n] = sat(*m[n], (size_t)ra * m[n]->spr);
        sb_row[n] = sat(*m[n], (size_t)rb * m[n]->spr);
        // A group of a power-of-two runs of 32 columns: its index is a shift of the run's.
        int runs = m[n]->group >> 5;
        gshift[n] = (runs & (runs - 1)) == 0 ? __ffs(runs) - 1 : -1;
        acc[n][0] = acc[n][1] = 0.f;
    }
    // Lanes 2t (hi) and 2t + 1 (lo) of the B operand's n carry lane t's x; the rest zeros.
    bool hi = g == 2 * t, lo = g == 2 * t + 1;
    const u32* xb = xs + (lo ? 80 : 0) + t * 20;
    // The next I4_DEPTH - 1 chunks' weights and scales are loaded before this chunk is
    // multiplied, so that many chunks of loads are in flight a lane. The ring shifts by
    // register moves.
    uint4 qa[I4_DEPTH][NM], qb[I4_DEPTH][NM];
    u32 sa[I4_DEPTH][NM], sb[I4_DEPTH][NM];  // raw (sraw)
    auto load = [&](int c, int d, int end) {
        if (c >= end) return;
#pragma unroll
        for (int n = 0; n < NM; n++) {
            // uint4s from a chunk to the next: 4 of a row
            qa[d][n] = __ldg(wa[n] + 4 * c);
            qb[d][n] = __ldg(wb[n] + 4 * c);
            int run = 4 * c + t;
            int grp = gshift[n] >= 0 ? run >> gshift[n] : run / (m[n]->group >> 5);
            sa[d][n] = sraw(sa_row[n], grp, ST);
            sb[d][n] = sraw(sb_row[n], grp, ST);
        }
    };
    // One chunk: its staged x (words xc, scale isx) against the ring's first entry.
    auto chunk = [&](const u32* xc, float isx) {
        uint4 bw[4];
#pragma unroll
        for (int i = 0; i < 4; i++) bw[i] = hi || lo ? *(const uint4*)(xc + 4 * i) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int n = 0; n < NM; n++) {
            float cc[4] = {0.f, 0.f, 0.f, 0.f};
            u32 ua[4] = {qa[0][n].x, qa[0][n].y, qa[0][n].z, qa[0][n].w};
            u32 ub[4] = {qb[0][n].x, qb[0][n].y, qb[0][n].z, qb[0][n].w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u32 ha[4], hb[4];
                i4_f16(ua[i], ha);
                i4_f16(ub[i], hb);
                mma_16816(cc, ha[0], hb[0], ha[1], hb[1], bw[i].x, bw[i].y);
                mma_16816(cc, ha[2], hb[2], ha[3], hb[3], bw[i].z, bw[i].w);
            }
            acc[n][0] = fmaf(cc[0] + cc[1], sval(sa[0][n], ST, 1.f) * isx, acc[n][0]);
            acc[n][1] = fmaf(cc[2] + cc[3], sval(sb[0][n], ST, 1.f) * isx, acc[n][1]);
        }
#pragma unroll
        for (int d = 0; d + 1 < I4_DEPTH; d++) {
#pragma unroll
            for (int n = 0; n < NM; n++) {
                qa[d][n] = qa[d + 1][n];
                qb[d][n] = qb[d + 1][n];
                sa[d][n] = sa[d + 1][n];
                sb[d][n] = sb[d + 1][n];
            }
        }
    };
    for (int c0 = cb; c0 < ce; c0 += I4_STAGE) {
        int c1 = min(ce, c0 + I4_STAGE);
#pragma unroll
        for (int d = 0; d < I4_DEPTH - 1; d++) load(c0 + d, d, c1);
        if (pre && c0 == cb) pdl_enter();
        __syncwarp();  // the previous batch's chunks have been read
        // x in groups of I4_SGROUP chunks, their loads in flight together.
#pragma unroll
        for (int j0 = 0; j0 < I4_STAGE && !(staged && ce - cb <= I4_STAGE); j0 += I4_SGROUP) {
            float4 xg[I4_SGROUP];
#pragma unroll
            for (int j = 0; j < I4_SGROUP; j++)
                if (c0 + j0 + j < c1) xg[j] = __ldg((const float4*)(x + 128 * (c0 + j0 + j)) + lane);
#pragma unroll
            for (int j = 0; j < I4_SGROUP; j++) {
                if (c0 + j0 + j < c1) {
                    float isx = stage_x(xg[j], xs + (j0 + j) * XS_WORDS, lane);
                    if (lane == 0) xsc[j0 + j] = isx;
                }
            }
        }
        __syncwarp();
        for (int c = c0; c < c1; c++) {
            load(c + I4_DEPTH - 1, I4_DEPTH - 1, c1);
            chunk(xb + (c - c0) * XS_WORDS, xsc[c - c0]);
        }
    }
    if (pre && cb >= ce) pdl_enter();
#pragma unroll
    for (int n = 0; n < NM; n++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            acc[n][j] += __shfl_xor_sync(0xffffffffu, acc[n][j], 1);
            acc[n][j] += __shfl_xor_sync(0xffffffffu, acc[n][j], 2);
        }
}

// Shared memory of an up or down block (down: one for both round counts): each warp's
// staged x and its scales, and the warps' sums. 16-byte aligned: the B fragments are read
// as uint4 (a u32 array alone may land on any 4-byte boundary; after a shared Task of 216
// bytes it did).
struct __align__(16) I4Shared {
    u32 xs[8][I4_STAGE * XS_WORDS];
    float xsc[8][I4_STAGE];
    float red[8][2][16];
    float fac[2];  // e4m3: the matrices' factors, applied to the block's sums
};

// Thread n < count stores matrix n's e4m3 factor in sm.fac (read after a barrier).
template <int ST>
__device__ __forceinline__ void i4_factors(I4Shared& sm, const Mat* const* m, int count) {
    if (ST == 2 && (int)threadIdx.x < count) sm.fac[threadIdx.x] = sfac(*m[threadIdx.x]);
}

// The block's 8 warps on one task of k_experts_up_row: 16 outputs (UP_OUTS x 8) of gate
// and up, each warp an eighth of the columns, summed over the warps in order.
// staged: a later round of the same block (its warps' x is staged already). A later round
// reuses the x its warps staged in the first (their columns are the same), but for e4m3
// scales, which stage it again (reusing it was slower there, cause not found).
// sm: the kernel's one I4Shared. (Declared here, each instantiation of the template had
// its own: three scale types made the kernel's shared memory 127 KB, one block an SM.)
template <int ST>
__device__ __forceinline__ void i4_up_block(const Mat& gm, const Mat& um, int o0, const float* x, int act, float alpha, float limit, const float* bg, const float* bu, float* h,
                                            bool pre, bool staged, I4Shared& sm) {
    auto& xs = sm.xs;
    auto& xsc = sm.xsc;
    auto& red = sm.red;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nout = gm.rows, nch = gm.cols / 128;
    const Mat* m[2] = {&gm, &um};
    const int rows0[2] = {o0, o0};
    i4_factors<ST>(sm, m, 2);
    float acc[2][2];
    i4_tile<2, ST>(m, rows0, nout, x, warp * nch / 8, (warp + 1) * nch / 8, xs[warp], xsc[warp], lane, acc, pre,
                   staged && ST != 2);
    if ((lane & 3) == 0) {
        int g = lane >> 2;
#pragma unroll
        for (int n = 0; n < 2; n++) {
            red[warp][n][g] = acc[n][0];
            red[warp][n][g + 8] = acc[n][1];
        }
    }
    __syncthreads();
    int r = threadIdx.x;
    if (r < 16 && o0 + r < nout) {
        float gs = 0.f, us = 0.f;
        for (int w = 0; w < 8; w++) {
            gs += red[w][0][r];
            us += red[w][1][r];
        }
        if (ST == 2) {
            gs *= sm.fac[0];
            us *= sm.fac[1];
        }
        if (bg) {
            gs += bg[o0 + r];
            us += bu[o0 + r];
        }
        h[o0 + r] = act_mul(gs, us, act, alpha, limit);
    }
}

// The block's 8 warps on one task of k_experts_down_row: R rounds of 32 outputs (DOWN_OUTS x
// 8), each two tiles of 16, four warps a tile, each a quarter of the columns; a warp's
// rounds share its loop (one ring of loads), so a block's start-up (its task, the first
// loads' latency) is spread over R x 32 outputs.
template <int R, int ST>
__device__ __forceinline__ void i4_down_block(const Mat& dm, int o0, const float* h, float* y, const float* bd,
                                              I4Shared& sm, bool pre) {
    auto& xs = sm.xs;
    auto& xsc = sm.xsc;
    auto& red = sm.red;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int tile = warp >> 2, kw = warp & 3;
    int nout = dm.rows, nch = dm.cols / 128;
    const Mat* m[R];
    int rows0[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = &dm;
        rows0[r] = o0 + 32 * r + 16 * tile;
    }
    i4_factors<ST>(sm, m, 1);
    float acc[R][2];
    i4_tile<R, ST>(m, rows0, nout, h, kw * nch / 4, (kw + 1) * nch / 4, xs[warp], xsc[warp], lane, acc, pre);
    if ((lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            red[warp][r][lane >> 2] = acc[r][0];
            red[warp][r][(lane >> 2) + 8] = acc[r][1];
        }
    }
    __syncthreads();
    int i = threadIdx.x & 15, tl = (threadIdx.x >> 4) & 1, r = threadIdx.x >> 5;
    int o = o0 + 32 * r + 16 * tl + i;
    if (r < R && o < nout) {
        float s = 0.f;
        for (int w = 0; w < 4; w++) s += red[4 * tl + w][r][i];
        s = ST == 2 ? s * sm.fac[0] : s;
        y[o] = bd ? s + bd[o] : s;
    }
}
#endif
