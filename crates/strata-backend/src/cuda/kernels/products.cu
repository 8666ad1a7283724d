// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// Dot products of one matrix row with up to R rows of x (row pointers `xr`), the columns
// split over the 32 lanes of a warp (and over `nsub` cooperating warps, this one `sub`).
// Each lane's partial sums land in acc; the caller reduces over the warp.

// CALL with KIND_ bound to a matrix's encoding (Mat::kind) as a constant: one switch for
// the code that is a template per encoding. A macro, not a generic lambda: NVRTC takes a
// lambda without an execution-space annotation for a host function and refuses it.
#define BY_KIND(kind, CALL)                                                                  \
    switch (kind) {                                                                          \
    case 0: { constexpr int KIND_ = 0; CALL; } break;                                        \
    case 1: { constexpr int KIND_ = 1; CALL; } break;                                        \
    case 2: { constexpr int KIND_ = 2; CALL; } break;                                        \
    case 3: { constexpr int KIND_ = 3; CALL; } break;                                        \
    case 5: { constexpr int KIND_ = 5; CALL; } break;                                        \
    default: { constexpr int KIND_ = 4; CALL; } break;                                       \
    }

template <int KIND> struct Vw;
template <> struct Vw<0> { enum { n = 4 }; };
template <> struct Vw<1> { enum { n = 8 }; };
template <> struct Vw<2> { enum { n = 16 }; };
template <> struct Vw<3> { enum { n = 32 }; };
template <> struct Vw<4> { enum { n = 16 }; };
template <> struct Vw<5> { enum { n = 32 }; };

template <int KIND> __device__ __forceinline__ void unpack(uint4 q, float* w) {
    u32 word[4] = {q.x, q.y, q.z, q.w};
    if (KIND == 0) {
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = __uint_as_float(word[i]);
    } else if (KIND == 1) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[2 * i] = __uint_as_float(word[i] << 16);
            w[2 * i + 1] = __uint_as_float(word[i] & 0xffff0000u);
        }
    } else if (KIND == 2) {
        // Integers to floats without the (slow) conversion unit, exactly: 2^23 + n has n in
        // its low mantissa bits. A signed byte b becomes 2^23 + (b + 128) - (2^23 + 128).
        // One byte permute a weight builds 2^23 + (b + 128).
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 flipped = word[i] ^ 0x80808080u;
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * i + j] = __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7440u + j)) - 8388736.f;
        }
    } else if (KIND == 3) {
        // A nibble n stores n - 8: 2^23 + n - (2^23 + 8), exact as above. The even and
        // odd nibbles are first split into bytes, and one byte permute a weight then
        // builds 2^23 + n (a shift and a mask a weight cost a quarter of the issue slots).
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo = word[i] & 0x0F0F0F0Fu, hi = (word[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                w[8 * i + 2 * b] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7440u + b)) - 8388616.f;
                w[8 * i + 2 * b + 1] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7440u + b)) - 8388616.f;
            }
        }
    } else if (KIND == 5) {
        // FP4 e2m1, low nibble first (fp4f).
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int b = 0; b < 4; b++) {
                u32 byte = (word[i] >> (8 * b)) & 0xFFu;
                w[8 * i + 2 * b] = fp4f(byte & 15u);
                w[8 * i + 2 * b + 1] = fp4f(byte >> 4);
            }
        }
    } else {
#if __CUDA_ARCH__ >= 890
        // e4m3 exactly through the FP8 conversion unit: two bytes to an f16x2 in one
        // instruction (every e4m3 is an f16; the byte in bits 8-15 lands in the high half;
        // 0x7F / 0xFF become NaN), each half then to f32: 1.5 instructions a weight, where
        // the bit arithmetic below takes ~6 and kept FP8 rows issue-bound at ~1.7 TB/s.
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                u32 h;
                asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)(word[i] >> (16 * j))));
                float2 f = unpack_f16(h);
                w[4 * i + 2 * j] = f.x;
                w[4 * i + 2 * j + 1] = f.y;
            }
        }
#else
        // e4m3 exactly, with no conversion: its 7 magnitude bits placed at bit 20 read as an
        // f32 of exponent e - 127 (a denormal when e = 0), which times 2^120 is the value;
        // magnitude 0x7F is NaN. (e4m3f's branches and int->float conversion cost ~17
        // instructions a weight.)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 mag = word[i] & 0x7F7F7F7Fu, sgn = word[i] & 0x80808080u;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                u32 t = __byte_perm(mag, sgn, ((u32)j << 8) | ((4u + j) << 12));
                w[4 * i + j] = __uint_as_float(((t << 4) & 0x07F00000u) | (t & 0x80000000u)) * 0x1p120f;
            }
            u32 nan = __vcmpeq4(mag, 0x7F7F7F7Fu);
            if (nan) {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if ((nan >> (8 * j)) & 1u) w[4 * i + j] = __int_as_float(0x7fc00000);
            }
        }
#endif
    }
}

// The scale of the 16-byte vector at column c of a row (1 for f32 and bf16): a vector
// never straddles a scale group (Mat::vec). E4: as mscale_t's.
template <int KIND, bool E4 = true> __device__ __forceinline__ float vec_scale(const Mat& m, int row, int c) {
    if (KIND == 2) return m.s[row];
    if (KIND == 3) return mscale_t<E4>(m, (size_t)row * m.spr + c / m.group);
    if (KIND == 4) return m.s[(size_t)(row / m.brow) * m.spr + c / m.bcol];
    if (KIND == 5) return e8m0f(sraw((const u8*)m.s, (size_t)row * m.spr + c / 32, 3));
    return 1.f;
}

// Steps of the vector loops unrolled, so more weight loads are in flight a lane (a block
// alone on its SM must keep ~4.3 TB/s / SMs in flight; the order of the sums is the same):
// ROW_UNROLL in the one-row loops, VEC_UNROLL in the general one.
#define ROW_UNROLL 2
#define VEC_UNROLL 2
#define PRAGMA(x) _Pragma(#x)
#define UNROLL(n) PRAGMA(unroll n)

// RMSNorm fused into a product of one row (decode): the product runs on x * w and each lane
// also sums x^2 over the columns it reads; the result is scaled by 1 / sqrt(mean + eps) at
// the end (the same value up to rounding as normalising x first, without a launch of its
// own between the residual and the projection). `w` null: no norm.
struct RowNorm {
    const float* w;
    float eps;
};

// x4 (columns 4 c4 .. 4 c4 + 3) times the norm's scale, its squares added to ss.
template <bool NORM>
__device__ __forceinline__ float4 norm4(float4 x4, const RowNorm& nm, int c4, float& ss) {
    if (!NORM) return x4;
    ss = fmaf(x4.x, x4.x, ss);
    ss = fmaf(x4.y, x4.y, ss);
    ss = fmaf(x4.z, x4.z, ss);
    ss = fmaf(x4.w, x4.w, ss);
    float4 w = ((const float4*)nm.w)[c4];
    return make_float4(x4.x * w.x, x4.y * w.y, x4.z * w.z, x4.w * w.w);
}

__device__ __forceinline__ float norm_inv(float ss, int width, float eps) { return 1.0f / sqrtf(ss / (float)width + eps); }

template <int KIND, int R, bool NORM = false, bool E4 = true>
__device__ __forceinline__ void dot_vec(const Mat& m, int row, const float* const* xr, int nr, float* acc, int lane,
                                        int sub, int nsub, const RowNorm& nm = RowNorm{nullptr, 0.f},
                                        float* ss = nullptr) {
    const int V = Vw<KIND>::n;
    const uint4* wv = (const uint4*)(m.w + (size_t)row * m.ld);
    int nvec = m.cols / V;
    UNROLL(VEC_UNROLL)
    for (int v = lane + 32 * sub; v < nvec; v += 32 * nsub) {
        uint4 q = __ldg(wv + v);
        int c = v * V;
        float sc = vec_scale<KIND, E4>(m, row, c);
        float w[V];
        unpack<KIND>(q, w);
#pragma unroll
        for (int j = 0; j < R; j++) {
            if (j < nr) {
                const float4* xp = (const float4*)(xr[j] + c);
                if (KIND <= 1) {
                    float a = acc[j];
#pragma unroll
                    for (int t = 0; t < V / 4; t++) {
                        float4 x4 = norm4<NORM>(xp[t], nm, c / 4 + t, *ss);
                        a = fmaf(w[4 * t], x4.x, a);
                        a = fmaf(w[4 * t + 1], x4.y, a);
                        a = fmaf(w[4 * t + 2], x4.z, a);
                        a = fmaf(w[4 * t + 3], x4.w, a);
                    }
                    acc[j] = a;
                } else {
                    float p = 0.f;
#pragma unroll
                    for (int t = 0; t < V / 4; t++) {
                        float4 x4 = norm4<NORM>(xp[t], nm, c / 4 + t, *ss);
                        p = fmaf(w[4 * t], x4.x, p);
                        p = fmaf(w[4 * t + 1], x4.y, p);
                        p = fmaf(w[4 * t + 2], x4.z, p);
                        p = fmaf(w[4 * t + 3], x4.w, p);
                    }
                    acc[j] = fmaf(p, sc, acc[j]);
                }
            }
        }
    }
}

template <int R, bool E4 = true>
__device__ __forceinline__ void dot_gen(const Mat& m, int row, const float* const* xr, int nr, float* acc, int lane,
                                        int sub, int nsub) {
    for (int c = lane + 32 * sub; c < m.cols; c += 32 * nsub) {
        float w = melem<E4>(m, row, c);
#pragma unroll
        for (int j = 0; j < R; j++)
            if (j < nr) acc[j] = fmaf(w, xr[j][c], acc[j]);
    }
}

// One x row against NM matrix rows of one encoding and width: each step loads x once and
// uses it NM times, with NM weight loads in flight together. Quantized rows are bound by
// issue and latency, not bytes, when a warp holds only one row (x is 2-8x their bytes).
//
// pre: the caller has not yet waited on the kernel before (pdl_enter); dot_rows_vec waits
// just before its loop. (Weights never depend on that kernel, but loading the first steps
// before the wait lost: issued through a ring of steps, the ring's code cost 3.5% on the
// GLM-5 slice; the loop's first two steps peeled off, 2%; asked of L2, the lines were
// evicted by a large kernel before. docs/performance.md, 2026-12-03.)
template <int KIND, int NM, bool NORM, bool E4>
__device__ __forceinline__ void dot_rows_vec(const Mat* const* m, const int* row, const float* x, float* acc,
                                             int lane, const RowNorm& nm, float& ss, int sub, int nsub, bool pre) {
    const int V = Vw<KIND>::n;
    const uint4* wv[NM];
#pragma unroll
    for (int n = 0; n < NM; n++) wv[n] = (const uint4*)(m[n]->w + (size_t)row[n] * m[n]->ld);
    int nvec = m[0]->cols / V;
    // One step: the weights q of vector v against x.
    auto step = [&](int v, const uint4* q) {
        int c = v * V;
        float xv[V];
        const float4* xp = (const float4*)(x + c);
#pragma unroll
        for (int t = 0; t < V / 4; t++) {
            float4 x4 = norm4<NORM>(xp[t], nm, c / 4 + t, ss);
            xv[4 * t] = x4.x;
            xv[4 * t + 1] = x4.y;
            xv[4 * t + 2] = x4.z;
            xv[4 * t + 3] = x4.w;
        }
#pragma unroll
        for (int n = 0; n < NM; n++) {
            const Mat& mn = *m[n];
            float w[V];
            unpack<KIND>(q[n], w);
            float p = 0.f;
#pragma unroll
            for (int i = 0; i < V; i++) p = fmaf(w[i], xv[i], p);
            float sc = vec_scale<KIND, E4>(mn, row[n], c);
            acc[n] = KIND <= 1 ? acc[n] + p : fmaf(p, sc, acc[n]);
        }
    };
    auto load = [&](int v, uint4* q) {
#pragma unroll
        for (int n = 0; n < NM; n++) q[n] = __ldg(wv[n] + v);
    };
    int stride = 32 * nsub, v = lane + 32 * sub;
    if (pre) pdl_enter();
    UNROLL(ROW_UNROLL)
    for (; v < nvec; v += stride) {
        uint4 q[NM];
        load(v, q);
        step(v, q);
    }
}

// sub / nsub: the warp takes the columns' 16-byte vectors sub, sub + nsub, ... of each 32
// (warps splitting a row's columns; 0 / 1 for all of them). pre: as dot_rows_vec's. E4: as
// mscale_t's.
template <int NM, bool NORM = false, bool E4 = true>
__device__ __forceinline__ void dot_rows(const Mat* const* m, const int* row, const float* x, float* acc, int lane,
                                         const RowNorm& nm = RowNorm{nullptr, 0.f}, float* ss = nullptr,
                                         int sub = 0, int nsub = 1, bool pre = false) {
    float unused = 0.f;
    float& sq = ss ? *ss : unused;
    // NORM runs on vector rows only (the host checks).
    if (!NORM && !m[0]->vec) {
        if (pre) pdl_enter();
        const float* xr[1] = {x};
#pragma unroll
        for (int n = 0; n < NM; n++) dot_gen<1, E4>(*m[n], row[n], xr, 1, &acc[n], lane, sub, nsub);
        return;
    }
    BY_KIND(m[0]->kind, (dot_rows_vec<KIND_, NM, NORM, E4>(m, row, x, acc, lane, nm, sq, sub, nsub, pre)));
}

template <int R, bool NORM = false, bool E4 = true>
__device__ __forceinline__ void dot_any(const Mat& m, int row, const float* const* xr, int nr, float* acc, int lane,
                                        int sub, int nsub, const RowNorm& nm = RowNorm{nullptr, 0.f},
                                        float* ss = nullptr) {
    if (!NORM && !m.vec) {
        dot_gen<R, E4>(m, row, xr, nr, acc, lane, sub, nsub);
        return;
    }
    BY_KIND(m.kind, (dot_vec<KIND_, R, NORM, E4>(m, row, xr, nr, acc, lane, sub, nsub, nm, ss)));
}

// ---------------------------------------------------------------------------------------
// Projections of up to R rows: out[j * ostride + col + b * col_bs + o] (=, or += with add)
// (x W^T)[j, o] + bias[o], for outputs o < nout of matrix rows mrow0 + b * mrow_bs + o.
// 256 threads; `split` warps (1, 2, 4 or 8) share an output, so few outputs still fill
// the device. blockIdx.y is the batch b (MLA's per-head value projections).

// With NORM (one row): x is normalised on the way in (RowNorm), its squares summed over the
// output's warps as the products are.
template <int R, bool NORM = false, bool E4 = true>
__device__ __forceinline__ void linear_small(const Mat& m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld,
                                             int rows, int nout, float* out, int ostride, int col, int col_bs,
                                             int add, const float* bias, int split, int bx,
                                             const RowNorm& nm = RowNorm{nullptr, 0.f}) {
    __shared__ float red[8][R + 1];
    int b = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int per_block = 8 / split;
    int og = warp / split, sub = warp % split;
    int o = bx * per_block + og;
    bool live = o < nout;
    float acc[R];
    const float* xr[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
        acc[j] = 0.f;
        xr[j] = x + b * x_bs + (i64)j * xld;
    }
    float ss = 0.f;
    if (live) dot_any<R, NORM, E4>(m, mrow0 + b * mrow_bs + o, xr, rows, acc, lane, sub, split, nm, &ss);
#pragma unroll
    for (int j = 0; j < R; j++) acc[j] = wsum(acc[j]);
    if (NORM) ss = wsum(ss);
    if (split > 1) {
        if (lane == 0) {
#pragma unroll
            for (int j = 0; j < R; j++) red[warp][j] = acc[j];
            red[warp][R] = ss;
        }
        __syncthreads();
        if (sub == 0 && lane == 0) {
#pragma unroll
            for (int j = 0; j < R; j++) {
                float a = red[warp][j];
                for (int s = 1; s < split; s++) a += red[warp + s][j];
                acc[j] = a;
            }
            if (NORM) {
                float a = red[warp][R];
                for (int s = 1; s < split; s++) a += red[warp + s][R];
                ss = a;
            }
        }
    }
    if (NORM) acc[0] *= norm_inv(ss, m.cols, nm.eps);
    if (live && sub == 0 && lane == 0) {
        float bv = bias ? bias[o] : 0.f;
#pragma unroll
        for (int j = 0; j < R; j++) {
            if (j < rows) {
                float* p = out + (i64)j * ostride + col + b * col_bs + o;
                float v = acc[j] + bv;
                *p = add ? *p + v : v;
            }
        }
    }
}

#define LINEAR_SMALL(R)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) k_linear_##R(                                          \
        Mat m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld, int rows, int nout, float* out,   \
        int ostride, int col, int col_bs, int add, const float* bias, int split) {                           \
        pdl_enter();                                                                                         \
        linear_small<R>(m, mrow0, mrow_bs, x, x_bs, xld, rows, nout, out, ostride, col, col_bs, add, bias,  \
                        split, blockIdx.x);                                                                  \
    }
LINEAR_SMALL(1)
LINEAR_SMALL(2)
LINEAR_SMALL(4)
LINEAR_SMALL(8)

// One row against a matrix, four outputs a group of `split` warps that share the four
// weight rows' columns (each x load serves four rows; one output a warp loads x twice per
// 16 bytes of bf16 weights, and the norm's scale as often), summed over the warps in a
// fixed order. Blocks of 8 warps: 8 / split groups. The split lets the host make enough
// blocks: a block alone on an SM keeps too few loads in flight (~20 GB/s an SM, where
// 4.3 TB/s needs ~33), so a grid that leaves some SMs one block reads slowly (the 6144
// outputs of o_proj at four a warp are 192 blocks for 132 SMs). Rows mrow0 + o of m; out
// and bias indexed by o.
// pre: the caller has not waited on the kernel before: linear_quad does (pdl_enter; see
// dot_rows_vec).
template <bool NORM>
__device__ __forceinline__ void linear_quad(const Mat& m, int mrow0, const float* x, int nout, float* out, int add,
                                            const float* bias, int split, int bx, const RowNorm& nm, bool pre) {
    __shared__ float red[8][5];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int og = warp / split, sub = warp % split;
    int o0 = (bx * (8 / split) + og) * 4;
    bool live = o0 < nout;
    const Mat* mp[4];
    int row[4];
    float acc[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        mp[k] = &m;
        row[k] = mrow0 + min(o0 + k, nout - 1);
        acc[k] = 0.f;
    }
    float ss = 0.f;
    if (live) dot_rows<4, NORM, false>(mp, row, x, acc, lane, nm, &ss, sub, split, pre);
    else if (pre) pdl_enter();
#pragma unroll
    for (int k = 0; k < 4; k++) acc[k] = wsum(acc[k]);
    if (NORM) ss = wsum(ss);
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < 4; k++) red[warp][k] = acc[k];
        red[warp][4] = ss;
    }
    __syncthreads();
    // Lanes 0..3 of a group's first warp: output o0 + lane.
    if (!live || sub != 0 || lane >= 4 || o0 + lane >= nout) return;
    float a = 0.f, q = 0.f;
    for (int s = 0; s < split; s++) {
        a += red[warp + s][lane];
        q += red[warp + s][4];
    }
    if (NORM) a *= norm_inv(q, m.cols, nm.eps);
    float* p = out + o0 + lane;
    float v = a + (bias ? bias[o0 + lane] : 0.f);
    *p = add ? *p + v : v;
}

// Blocks an SM k_linear_quad is compiled for: left to itself the compiler takes ~155
// registers, one block an SM. Three (80 registers, a few spilled) decoded the GLM-5 slice
// ~1% faster than two (128) on the H200.
#define QUAD_MINB 3

// linear_quad as a launch of its own; blockIdx.y is the batch (as in linear_small); nw
// non-null: x RMS-normalised with scale nw on the way in (one unbatched row).
extern "C" __global__ void __launch_bounds__(256, QUAD_MINB)
    k_linear_quad(Mat m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int nout, float* out, int col, int col_bs,
                  int add, const float* bias, const float* nw, float eps, int split) {
    bool pre = defer_wait(true);
    int b = blockIdx.y;
    const float* xb = x + b * x_bs;
    float* ob = out + col + b * col_bs;
    if (nw)
        linear_quad<true>(m, mrow0 + b * mrow_bs, xb, nout, ob, add, bias, split, blockIdx.x, RowNorm{nw, eps}, pre);
    else
        linear_quad<false>(m, mrow0 + b * mrow_bs, xb, nout, ob, add, bias, split, blockIdx.x, RowNorm{nullptr, 0.f},
                           pre);
}

// Several projections of the same row in one launch (a layer's small input projections,
// each latency-bound on its own): job j owns blocks blk0[j] .. blk0[j + 1] and runs as
// k_linear_1 would (quad 0), bit for bit, or as linear_quad (quad 1: vector rows).
#define MAX_JOBS 4
struct LinJob {
    Mat m;
    float* out;
    const float* bias;
    int add, split, blk0, quad;
};
struct LinJobs {
    LinJob j[MAX_JOBS];
};
// Blocks an SM k_linears_1 is compiled for (as QUAD_MINB): left to itself the compiler
// takes 128 registers, two blocks an SM; three decoded the GLM-5 slices ~5% faster on the
// H200 (1373 -> 1441 tok/s bf16, 1484 -> 1565 int4 experts, within one call).
#define LINEARS_MINB 3
// With a norm (nw non-null), x is RMS-normalised with scale nw on the way in (RowNorm).
// No int4 matrix with e4m3 scales comes here, nor to linear_quad (the host's
// Lin::one_vector_row and row_kernel_outputs): their products read f32 or bf16 scales only
// (E4 false, mscale_t).
extern "C" __global__ void __launch_bounds__(256, LINEARS_MINB)
    k_linears_1(const float* x, int njobs, LinJobs jobs, const float* nw, float eps) {
    int i = 0;
    while (i + 1 < njobs && (int)blockIdx.x >= jobs.j[i + 1].blk0) i++;
    const LinJob& J = jobs.j[i];
    int bx = blockIdx.x - J.blk0;
    bool pre = defer_wait(J.quad != 0);
    if (J.quad) {
        if (nw)
            linear_quad<true>(J.m, 0, x, J.m.rows, J.out, J.add, J.bias, J.split, bx, RowNorm{nw, eps}, pre);
        else
            linear_quad<false>(J.m, 0, x, J.m.rows, J.out, J.add, J.bias, J.split, bx, RowNorm{nullptr, 0.f}, pre);
        return;
    }
    if (nw)
        linear_small<1, true, false>(J.m, 0, 0, x, 0, J.m.cols, 1, J.m.rows, J.out, J.m.rows, 0, 0, J.add, J.bias,
                                     J.split, bx, RowNorm{nw, eps});
    else
        linear_small<1, false, false>(J.m, 0, 0, x, 0, J.m.cols, 1, J.m.rows, J.out, J.m.rows, 0, 0, J.add, J.bias,
                                      J.split, bx);
}

// Outputs o0 .. o0 + N - 1 of one row x against rows row0 + o of m (o < nout; past the
// end the last row is computed again and not stored): a warp's N dot products, summed
// over the warp, in v.
template <int N, bool NORM = false, bool E4 = true>
__device__ __forceinline__ void warp_outputs(const Mat& m, int row0, int o0, int nout, const float* x, float* v,
                                             int lane, const RowNorm& nm = RowNorm{nullptr, 0.f}, bool pre = false) {
    const Mat* mp[N];
    int row[N];
#pragma unroll
    for (int k = 0; k < N; k++) {
        mp[k] = &m;
        row[k] = row0 + min(o0 + k, nout - 1);
        v[k] = 0.f;
    }
    float ss = 0.f;
    dot_rows<N, NORM, E4>(mp, row, x, v, lane, nm, &ss, 0, 1, pre);
    float inv = NORM ? norm_inv(wsum(ss), m.cols, nm.eps) : 1.f;
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = NORM ? wsum(v[k]) * inv : wsum(v[k]);
}

// Many rows: 64 outputs x 64 rows a block, 32 columns a step, each thread 4 x 4; weights
// decoded into shared memory as f32. `xrows` (optional) gathers x's rows.
template <int KIND> __device__ __forceinline__ float melem_k(const Mat& m, int r, int c) {
    const u8* row = m.w + (size_t)r * m.ld;
    if (KIND == 0) return ((const float*)row)[c];
    if (KIND == 1) return bf16f(((const u16*)row)[c]);
    if (KIND == 2) return (float)(signed char)row[c] * m.s[r];
    if (KIND == 3) {
        u32 b = row[c >> 1];
        u32 nib = (c & 1) ? (b >> 4) : (b & 15u);
        return (float)((int)nib - 8) * mscale(m, (size_t)r * m.spr + c / m.group);
    }
    return e4m3f(row[c]) * m.s[(size_t)(r / m.brow) * m.spr + c / m.bcol];
}

template <int KIND>
__device__ __forceinline__ void linear_tiled(Mat m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld,
                                             const u32* xrows, int rows, int nout, float* out, int ostride, int col,
                                             int col_bs, int add, const float* bias) {
    __shared__ float Ws[32][68];
    __shared__ float Xs[32][68];
    int b = blockIdx.z;
    int o0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
    int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    const float* xb = x + b * x_bs;
    int mrow = mrow0 + b * mrow_bs;
    for (int k0 = 0; k0 < m.cols; k0 += 32) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = tid + 256 * i;
            int oo = e >> 5, kk = e & 31;
            float w = 0.f;
            if (o0 + oo < nout && k0 + kk < m.cols) w = melem_k<KIND>(m, mrow + o0 + oo, k0 + kk);
            Ws[kk][oo] = w;
            float xv = 0.f;
            if (r0 + oo < rows && k0 + kk < m.cols) {
                int rr = xrows ? (int)xrows[r0 + oo] : r0 + oo;
                xv = xb[(i64)rr * xld + k0 + kk];
            }
            Xs[kk][oo] = xv;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < 32; kk++) {
            float a[4], c[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                a[i] = Ws[kk][tx * 4 + i];
                c[i] = Xs[kk][ty * 4 + i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], c[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int r = r0 + ty * 4 + j;
        if (r >= rows) continue;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int o = o0 + tx * 4 + i;
            if (o >= nout) continue;
            float v = acc[i][j] + (bias ? bias[o] : 0.f);
            float* p = out + (i64)r * ostride + col + b * col_bs + o;
            *p = add ? *p + v : v;
        }
    }
}

#define LINEAR_TILED(K)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) k_tiled_##K(                                            \
        Mat m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld, const u32* xrows, int rows, int nout,\
        float* out, int ostride, int col, int col_bs, int add, const float* bias) {                           \
        pdl_enter();                                                                                          \
        linear_tiled<K>(m, mrow0, mrow_bs, x, x_bs, xld, xrows, rows, nout, out, ostride, col, col_bs, add,   \
                        bias);                                                                                \
    }
LINEAR_TILED(0)
LINEAR_TILED(1)
LINEAR_TILED(2)
LINEAR_TILED(3)
LINEAR_TILED(4)

// h = act(g) * u over n values (the many-rows expert path).
extern "C" __global__ void k_act_mul(i64 n, const float* g, const float* u, int act, float alpha, float limit, float* h) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        h[i] = act_mul(g[i], u[i], act, alpha, limit);
}

// dst[i] = x[rows[i]] (rows of `width`).
extern "C" __global__ void k_gather(const float* x, const u32* rows, int width, float* dst) {
    pdl_enter();
    int i = blockIdx.x;
    const float* src = x + (i64)rows[i] * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[(i64)i * width + c] = src[c];
}

extern "C" __global__ void k_add_bias(int rows, int nout, float* out, int ostride, int col, const float* bias) {
    pdl_enter();
    int r = blockIdx.y;
    for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < nout; o += gridDim.x * blockDim.x)
        out[(i64)r * ostride + col + o] += bias[o];
}

// x -> (hi, lo), both bf16 (round to nearest even), x ~ hi + lo within 2^-17 |x|: a
// product with bf16 weights as two bf16 GEMMs keeps f32 accuracy.
__device__ __forceinline__ u32 to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x = hi + mid + lo in bf16 (8 + 8 + 8 significant bits: f32's 24, so the three bf16
// GEMMs see x exactly but for denormal-range residues).
extern "C" __global__ void k_split_bf16(i64 n, const float* x, u16* hi, u16* mid, u16* lo) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = x[i];
        u32 h = to_bf16(v);
        float r = v - bf16f(h);
        u32 m = to_bf16(r);
        hi[i] = (u16)h;
        mid[i] = (u16)m;
        lo[i] = (u16)to_bf16(r - bf16f(m));
    }
}

