// strata's CUDA kernels. Header-free (NVRTC compiles this string at run time; bf16, FP8
// e4m3 and int4 are decoded with bit operations), compiled with --fmad=false so that
// element-wise arithmetic rounds as the CPU backend's does; the dot products use fmaf
// explicitly.
//
// Layouts and semantics follow the CPU backend (crates/strata-backend/src/cpu): every
// matrix is [rows = out, cols = in] in its stored precision, activations are f32, a row's
// KV slot is blocks[seq * max_blocks + pos / bs] * bs + pos % bs.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define NEG_INF __int_as_float(0xff800000)

// A matrix in its stored precision. kind: 0 f32, 1 bf16, 2 int8 (row scales), 3 int4
// (group scales, column 2i in the low nibble), 4 FP8 e4m3 (block scales).
struct Mat {
    const u8* w;
    const float* s;
    int kind, rows, cols, group, brow, bcol;
    int ld;   // payload bytes per row
    int spr;  // scales per row (int4: groups; FP8: column blocks)
    int vec;  // 16-byte vector loads allowed (aligned rows, whole vectors, one scale per vector)
    int pad;
};

// One forward's rows on the device.
struct StepDev {
    const u32* tokens;
    const u32* pos;
    const u32* seq;
    const u32* blocks;
    int bs, max_blocks;
};

__device__ __forceinline__ int kv_slot(const StepDev& s, int r, int p) {
    int t = (int)s.seq[r] * s.max_blocks;
    return (int)s.blocks[t + p / s.bs] * s.bs + p % s.bs;
}

__device__ __forceinline__ float bf16f(u32 h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ float e4m3f(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    if (e == 15u && m == 7u) v = __int_as_float(0x7fc00000);
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float melem(const Mat& m, int r, int c) {
    const u8* row = m.w + (size_t)r * m.ld;
    switch (m.kind) {
    case 0: return ((const float*)row)[c];
    case 1: return bf16f(((const u16*)row)[c]);
    case 2: return (float)(signed char)row[c] * m.s[r];
    case 3: {
        u32 b = row[c >> 1];
        u32 nib = (c & 1) ? (b >> 4) : (b & 15u);
        return (float)((int)nib - 8) * m.s[(size_t)r * m.spr + c / m.group];
    }
    default: return e4m3f(row[c]) * m.s[(size_t)(r / m.brow) * m.spr + c / m.bcol];
    }
}

__device__ __forceinline__ float wsum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float wmax(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (every thread gets it). `sh`: 32 floats of shared memory.
__device__ float bsum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = wsum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.f;
    return wsum(v);
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// ---------------------------------------------------------------------------------------
// Dot products of one matrix row with up to R rows of x (row pointers `xr`), the columns
// split over the 32 lanes of a warp (and over `nsub` cooperating warps, this one `sub`).
// Each lane's partial sums land in acc; the caller reduces over the warp.

template <int KIND> struct Vw;
template <> struct Vw<0> { enum { n = 4 }; };
template <> struct Vw<1> { enum { n = 8 }; };
template <> struct Vw<2> { enum { n = 16 }; };
template <> struct Vw<3> { enum { n = 32 }; };
template <> struct Vw<4> { enum { n = 16 }; };

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
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * i + j] = (float)((int)(word[i] << (24 - 8 * j)) >> 24);
    } else if (KIND == 3) {
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) w[8 * i + j] = (float)((int)((word[i] >> (4 * j)) & 15u) - 8);
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * i + j] = e4m3f((word[i] >> (8 * j)) & 255u);
    }
}

template <int KIND, int R>
__device__ __forceinline__ void dot_vec(const Mat& m, int row, const float* const* xr, int nr, float* acc, int lane,
                                        int sub, int nsub) {
    const int V = Vw<KIND>::n;
    const uint4* wv = (const uint4*)(m.w + (size_t)row * m.ld);
    int nvec = m.cols / V;
#pragma unroll 2
    for (int v = lane + 32 * sub; v < nvec; v += 32 * nsub) {
        uint4 q = __ldg(wv + v);
        int c = v * V;
        float sc = 1.f;
        if (KIND == 2) sc = m.s[row];
        if (KIND == 3) sc = m.s[(size_t)row * m.spr + c / m.group];
        if (KIND == 4) sc = m.s[(size_t)(row / m.brow) * m.spr + c / m.bcol];
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
                        float4 x4 = xp[t];
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
                        float4 x4 = xp[t];
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

template <int R>
__device__ __forceinline__ void dot_gen(const Mat& m, int row, const float* const* xr, int nr, float* acc, int lane,
                                        int sub, int nsub) {
    for (int c = lane + 32 * sub; c < m.cols; c += 32 * nsub) {
        float w = melem(m, row, c);
#pragma unroll
        for (int j = 0; j < R; j++)
            if (j < nr) acc[j] = fmaf(w, xr[j][c], acc[j]);
    }
}

template <int R>
__device__ __forceinline__ void dot_any(const Mat& m, int row, const float* const* xr, int nr, float* acc, int lane,
                                        int sub, int nsub) {
    if (!m.vec) {
        dot_gen<R>(m, row, xr, nr, acc, lane, sub, nsub);
        return;
    }
    switch (m.kind) {
    case 0: dot_vec<0, R>(m, row, xr, nr, acc, lane, sub, nsub); break;
    case 1: dot_vec<1, R>(m, row, xr, nr, acc, lane, sub, nsub); break;
    case 2: dot_vec<2, R>(m, row, xr, nr, acc, lane, sub, nsub); break;
    case 3: dot_vec<3, R>(m, row, xr, nr, acc, lane, sub, nsub); break;
    default: dot_vec<4, R>(m, row, xr, nr, acc, lane, sub, nsub); break;
    }
}

// ---------------------------------------------------------------------------------------
// Projections of up to R rows: out[j * ostride + col + b * col_bs + o] (=, or += with add)
// (x W^T)[j, o] + bias[o], for outputs o < nout of matrix rows mrow0 + b * mrow_bs + o.
// 256 threads; `split` warps (1, 2, 4 or 8) share an output, so few outputs still fill
// the device. blockIdx.y is the batch b (MLA's per-head value projections).

template <int R>
__device__ __forceinline__ void linear_small(Mat m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld,
                                             int rows, int nout, float* out, int ostride, int col, int col_bs,
                                             int add, const float* bias, int split) {
    __shared__ float red[8][R];
    int b = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int per_block = 8 / split;
    int og = warp / split, sub = warp % split;
    int o = blockIdx.x * per_block + og;
    bool live = o < nout;
    float acc[R];
    const float* xr[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
        acc[j] = 0.f;
        xr[j] = x + b * x_bs + (i64)j * xld;
    }
    if (live) dot_any<R>(m, mrow0 + b * mrow_bs + o, xr, rows, acc, lane, sub, split);
#pragma unroll
    for (int j = 0; j < R; j++) acc[j] = wsum(acc[j]);
    if (split > 1) {
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < R; j++) red[warp][j] = acc[j];
        __syncthreads();
        if (sub == 0 && lane == 0)
#pragma unroll
            for (int j = 0; j < R; j++) {
                float a = red[warp][j];
                for (int s = 1; s < split; s++) a += red[warp + s][j];
                acc[j] = a;
            }
    }
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
        linear_small<R>(m, mrow0, mrow_bs, x, x_bs, xld, rows, nout, out, ostride, col, col_bs, add, bias,  \
                        split);                                                                              \
    }
LINEAR_SMALL(1)
LINEAR_SMALL(2)
LINEAR_SMALL(4)
LINEAR_SMALL(8)

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
        return (float)((int)nib - 8) * m.s[(size_t)r * m.spr + c / m.group];
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
        linear_tiled<K>(m, mrow0, mrow_bs, x, x_bs, xld, xrows, rows, nout, out, ostride, col, col_bs, add,   \
                        bias);                                                                                \
    }
LINEAR_TILED(0)
LINEAR_TILED(1)
LINEAR_TILED(2)
LINEAR_TILED(3)
LINEAR_TILED(4)

// ---------------------------------------------------------------------------------------
// SwiGLU experts, grouped: one launch computes h = silu(gate x) * up x for every task's
// rows, a second y = down h. A task's blocks start at blk1 (pass 1) / blk2 (pass 2); each
// warp one output, its rows in chunks of R.

struct Task {
    Mat g, u, d;
    i64 h_off;  // first f32 of this task's h rows
    int nrows, rows_off, out_row, blk1, blk2, pad;
};

__device__ __forceinline__ int find_task(const Task* t, int n, int blk, bool second) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        int start = second ? t[mid].blk2 : t[mid].blk1;
        if (start <= blk) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <int R>
__device__ __forceinline__ void experts_up(const Task* tasks, int ntasks, const u32* rowidx, const float* x,
                                           int hidden, float* h) {
    int ti = find_task(tasks, ntasks, blockIdx.x, false);
    const Task& T = tasks[ti];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = (blockIdx.x - T.blk1) * 8 + warp;
    int inter = T.g.rows;
    if (o >= inter) return;
    for (int r0 = 0; r0 < T.nrows; r0 += R) {
        int nr = min(R, T.nrows - r0);
        const float* xr[R];
        float ag[R], au[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            ag[j] = 0.f;
            au[j] = 0.f;
            xr[j] = x + (i64)rowidx[T.rows_off + r0 + (j < nr ? j : 0)] * hidden;
        }
        dot_any<R>(T.g, o, xr, nr, ag, lane, 0, 1);
        dot_any<R>(T.u, o, xr, nr, au, lane, 0, 1);
#pragma unroll
        for (int j = 0; j < R; j++) {
            float g = wsum(ag[j]), u = wsum(au[j]);
            if (lane == 0 && j < nr) h[T.h_off + (i64)(r0 + j) * inter + o] = silu(g) * u;
        }
    }
}

template <int R>
__device__ __forceinline__ void experts_down(const Task* tasks, int ntasks, const float* h, int hidden, float* y) {
    int ti = find_task(tasks, ntasks, blockIdx.x, true);
    const Task& T = tasks[ti];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = (blockIdx.x - T.blk2) * 8 + warp;
    if (o >= hidden) return;
    int inter = T.d.cols;
    for (int r0 = 0; r0 < T.nrows; r0 += R) {
        int nr = min(R, T.nrows - r0);
        const float* xr[R];
        float acc[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            acc[j] = 0.f;
            xr[j] = h + T.h_off + (i64)(r0 + (j < nr ? j : 0)) * inter;
        }
        dot_any<R>(T.d, o, xr, nr, acc, lane, 0, 1);
#pragma unroll
        for (int j = 0; j < R; j++) {
            float v = wsum(acc[j]);
            if (lane == 0 && j < nr) y[(i64)(T.out_row + r0 + j) * hidden + o] = v;
        }
    }
}

#define EXPERTS(R)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) k_experts_up_##R(const Task* tasks, int ntasks,         \
                                                                       const u32* rowidx, const float* x,     \
                                                                       int hidden, float* h) {                \
        experts_up<R>(tasks, ntasks, rowidx, x, hidden, h);                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) k_experts_down_##R(const Task* tasks, int ntasks,       \
                                                                         const float* h, int hidden,          \
                                                                         float* y) {                          \
        experts_down<R>(tasks, ntasks, h, hidden, y);                                                         \
    }
EXPERTS(1)
EXPERTS(8)

// h = silu(g) * u over n values (the many-rows expert path).
extern "C" __global__ void k_silu_mul(i64 n, const float* g, const float* u, float* h) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        h[i] = silu(g[i]) * u[i];
}

// dst[i] = x[rows[i]] (rows of `width`).
extern "C" __global__ void k_gather(const float* x, const u32* rows, int width, float* dst) {
    int i = blockIdx.x;
    const float* src = x + (i64)rows[i] * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[(i64)i * width + c] = src[c];
}

extern "C" __global__ void k_add_bias(int rows, int nout, float* out, int ostride, int col, const float* bias) {
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

extern "C" __global__ void k_split_bf16(i64 n, const float* x, u16* hi, u16* lo) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = x[i];
        u32 h = to_bf16(v);
        hi[i] = (u16)h;
        lo[i] = (u16)to_bf16(v - bf16f(h));
    }
}

// ---------------------------------------------------------------------------------------
// Embedding, norms, residual adds.

extern "C" __global__ void k_embed(Mat t, StepDev st, float* out) {
    int r = blockIdx.x;
    u32 tok = st.tokens[r];
    if (tok == 0xffffffffu) return;
    for (int c = threadIdx.x; c < t.cols; c += blockDim.x) out[(i64)r * t.cols + c] = melem(t, (int)tok, c);
}

// out = x / sqrt(mean(x^2) + eps) * w over a block (in place allowed).
__device__ void rms_seg(const float* x, const float* w, float eps, float* out, int n, float* sh) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) ss = fmaf(x[c], x[c], ss);
    ss = bsum(ss, sh);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[c] = w ? x[c] * inv * w[c] : x[c] * inv;
    __syncthreads();
}

extern "C" __global__ void k_rms_norm(const float* x, const float* w, float eps, float* out, int width) {
    __shared__ float sh[32];
    int r = blockIdx.x;
    rms_seg(x + (i64)r * width, w, eps, out + (i64)r * width, width, sh);
}

extern "C" __global__ void k_add(i64 n, const float* src, float* dst) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

// Interleaved RoPE (pairs (x0,x1),(x2,x3).. out as cat(even', odd')) of x[..2*half], by a
// whole block (tmp: 2*half floats of shared memory).
__device__ void rope_il(float* x, const float* cs, const float* sn, int half, float* tmp) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = x[2 * i], b = x[2 * i + 1];
        tmp[i] = a * cs[i] - b * sn[i];
        tmp[half + i] = b * cs[i] + a * sn[i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * half; i += blockDim.x) x[i] = tmp[i];
    __syncthreads();
}

// ---------------------------------------------------------------------------------------
// MLA.

// Per row: q_a normalised in place; latent normalised into the cache; shared key copied
// and rotated there.
extern "C" __global__ void k_mla_prepare(StepDev st, float* qa, int q_lora, const float* q_norm, const float* kva,
                                         const float* kv_norm, float eps, const float* cs, const float* sn,
                                         float* cache, int kv_lora, int rope) {
    __shared__ float sh[32];
    __shared__ float tmp[512];
    int r = blockIdx.x, kw = kv_lora + rope, half = rope / 2;
    rms_seg(qa + (i64)r * q_lora, q_norm, eps, qa + (i64)r * q_lora, q_lora, sh);
    int slot = kv_slot(st, r, (int)st.pos[r]);
    float* dst = cache + (i64)slot * kw;
    const float* src = kva + (i64)r * kw;
    rms_seg(src, kv_norm, eps, dst, kv_lora, sh);
    for (int i = threadIdx.x; i < rope; i += blockDim.x) dst[kv_lora + i] = src[kv_lora + i];
    __syncthreads();
    rope_il(dst + kv_lora, cs + (i64)r * half, sn + (i64)r * half, half, tmp);
}

// q_full[r, h, :kv_lora] = q_nope[r, h] . W_uk(h) (rows h*(nope+v) .. +nope of kv_b), and
// q_full[r, h, kv_lora:] = rope(q_rot[r, h]). Grid (heads, column blocks of 128).
extern "C" __global__ void __launch_bounds__(128) k_mla_absorb(const float* q, Mat kvb, int rows, int heads, int nope,
                                                               int rope, int vdim, int kv_lora, const float* cs,
                                                               const float* sn, float* qf) {
    int h = blockIdx.x, k = blockIdx.y * 128 + threadIdx.x;
    int qw = nope + rope, kw = kv_lora + rope, half = rope / 2;
    if (blockIdx.y == 0) {
        for (int idx = threadIdx.x; idx < rows * half; idx += blockDim.x) {
            int r = idx / half, i = idx % half;
            const float* src = q + ((i64)r * heads + h) * qw + nope;
            float* dst = qf + ((i64)r * heads + h) * kw + kv_lora;
            float a = src[2 * i], b = src[2 * i + 1], c = cs[(i64)r * half + i], s = sn[(i64)r * half + i];
            dst[i] = a * c - b * s;
            dst[half + i] = b * c + a * s;
        }
    }
    if (k >= kv_lora) return;
    int wrow = h * (nope + vdim);
    for (int r0 = 0; r0 < rows; r0 += 8) {
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.f;
        int nr = min(8, rows - r0);
        for (int n = 0; n < nope; n++) {
            float w = melem(kvb, wrow + n, k);
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < nr) acc[j] = fmaf(q[((i64)(r0 + j) * heads + h) * qw + n], w, acc[j]);
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < nr) qf[((i64)(r0 + j) * heads + h) * kw + k] = acc[j];
    }
}

// Attention of row blockIdx.x, head blockIdx.y over the latent cache at its selected (or
// all visible) positions; online softmax per warp, then the warps combined. Writes the
// head's weighted latent to lat[(h * rows + r) * kv_lora ..]. J >= ceil(kw / 32).
template <int J>
__device__ __forceinline__ void mla_attend(StepDev st, const float* qf, const float* cache, int sparse,
                                           const u32* sel, const u32* cnt, int topk, int heads, int kv_lora, int kw,
                                           float scale, float* lat, int rows) {
    __shared__ float sm[4], sl[4];
    __shared__ float sacc[4][J * 32];
    int r = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* q = qf + ((i64)r * heads + h) * kw;
    float qv[J], acc[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        int d = lane + 32 * j;
        qv[j] = d < kw ? q[d] : 0.f;
        acc[j] = 0.f;
    }
    int n = sparse ? (int)cnt[r] : (int)st.pos[r] + 1;
    float m = NEG_INF, l = 0.f;
    for (int i = warp; i < n; i += 4) {
        int p = sparse ? (int)sel[(i64)r * topk + i] : i;
        const float* key = cache + (i64)kv_slot(st, r, p) * kw;
        float kv[J];
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            int d = lane + 32 * j;
            kv[j] = d < kw ? key[d] : 0.f;
            s = fmaf(qv[j], kv[j], s);
        }
        s = wsum(s) * scale;
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), e = expf(s - mn);
        l = l * corr + e;
#pragma unroll
        for (int j = 0; j < J; j++) acc[j] = fmaf(e, kv[j], acc[j] * corr);
        m = mn;
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < J; j++) sacc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3]));
    float f[4], L = 0.f;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        f[w] = sm[w] == NEG_INF ? 0.f : expf(sm[w] - M);
        L += sl[w] * f[w];
    }
    float inv = 1.0f / L;
    for (int d = threadIdx.x; d < kv_lora; d += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) a += sacc[w][d] * f[w];
        lat[((i64)h * rows + r) * kv_lora + d] = a * inv;
    }
}

#define MLA_ATTEND(J)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) k_mla_attend_##J(                                       \
        StepDev st, const float* qf, const float* cache, int sparse, const u32* sel, const u32* cnt, int topk,\
        int heads, int kv_lora, int kw, float scale, float* lat, int rows) {                                  \
        mla_attend<J>(st, qf, cache, sparse, sel, cnt, topk, heads, kv_lora, kw, scale, lat, rows);           \
    }
MLA_ATTEND(1)
MLA_ATTEND(2)
MLA_ATTEND(4)
MLA_ATTEND(8)
MLA_ATTEND(12)
MLA_ATTEND(18)
MLA_ATTEND(24)
MLA_ATTEND(32)

// ---------------------------------------------------------------------------------------
// The lightning indexer.

// Per row: the key LayerNorm'd and rotated (in k and in the cache), each head's query
// rotated.
extern "C" __global__ void k_dsa_prepare(StepDev st, float* q, int heads, int dim, int rope, float* k,
                                         const float* knw, const float* knb, float eps, const float* cs,
                                         const float* sn, float* cache) {
    __shared__ float sh[32];
    __shared__ float tmp[512];
    int r = blockIdx.x, half = rope / 2;
    float* kr = k + (i64)r * dim;
    float s = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) s += kr[c];
    float mean = bsum(s, sh) / (float)dim;
    float v = 0.f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float d = kr[c] - mean;
        v = fmaf(d, d, v);
    }
    float var = bsum(v, sh) / (float)dim;
    float inv = 1.0f / sqrtf(var + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) kr[c] = (kr[c] - mean) * inv * knw[c] + knb[c];
    __syncthreads();
    const float* c0 = cs + (i64)r * half;
    const float* s0 = sn + (i64)r * half;
    rope_il(kr, c0, s0, half, tmp);
    float* dst = cache + (i64)kv_slot(st, r, (int)st.pos[r]) * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = kr[c];
    for (int hh = 0; hh < heads; hh++) rope_il(q + ((i64)r * heads + hh) * dim, c0, s0, half, tmp);
}

// score[r, t] = sum_h (w[r, h] * heads^-0.5) * relu(q[r, h] . key[t]) * dim^-0.5 for
// t < visible(r); a warp per position, a lane per head. Grid (rows, position blocks of
// 256); dynamic shared memory: heads * (dim + 1) + heads floats.
extern "C" __global__ void __launch_bounds__(256) k_dsa_scores(StepDev st, const float* q, const float* w, int heads,
                                                               int dim, float wscale, float dscale,
                                                               const float* cache, float* work, int positions) {
    extern __shared__ float smem[];
    float* qs = smem;
    float* ws = smem + heads * (dim + 1);
    int r = blockIdx.x;
    int v = (int)st.pos[r] + 1;
    int t0 = blockIdx.y * 256;
    if (t0 >= v) return;
    for (int i = threadIdx.x; i < heads * dim; i += blockDim.x) {
        int hh = i / dim, d = i % dim;
        qs[hh * (dim + 1) + d] = q[((i64)r * heads + hh) * dim + d];
    }
    for (int i = threadIdx.x; i < heads; i += blockDim.x) ws[i] = w[(i64)r * heads + i] * wscale;
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t1 = min(v, t0 + 256);
    for (int t = t0 + warp; t < t1; t += 8) {
        const float* key = cache + (i64)kv_slot(st, r, t) * dim;
        float acc = 0.f;
        for (int hh = lane; hh < heads; hh += 32) {
            const float* qh = qs + hh * (dim + 1);
            float d0 = 0.f;
            for (int d = 0; d < dim; d++) d0 = fmaf(qh[d], key[d], d0);
            acc += ws[hh] * (fmaxf(d0, 0.f) * dscale);
        }
        acc = wsum(acc);
        if (lane == 0) work[(i64)r * positions + t] = acc;
    }
}

// Total order of f32 (as Rust's total_cmp) as an unsigned key.
__device__ __forceinline__ u32 fkey(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix count of `f` over the block, and the block's total.
__device__ __forceinline__ u32 bscan(bool f, u32* wt, u32* total) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 bal = __ballot_sync(0xffffffffu, f);
    u32 pre = __popc(bal & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) wt[w] = __popc(bal);
    __syncthreads();
    u32 off = 0, tot = 0;
    for (int i = 0; i < nw; i++) {
        u32 c = wt[i];
        if (i < w) off += c;
        tot += c;
    }
    *total = tot;
    return off + pre;
}

// Per row: the top-k positions by score (ties to the earlier position), ascending, and
// their count; rows that see no more than topk positions keep them all. Radix select of
// the k-th key (4 passes of 8 bits), then an ordered compaction. 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) k_dsa_topk(StepDev st, const float* work, int positions, int topk,
                                                              u32* sel, u32* cnt) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_remaining;
    __shared__ u32 wt[32];
    int r = blockIdx.x;
    int v = (int)st.pos[r] + 1;
    u32* out = sel + (i64)r * topk;
    if (v <= topk) {
        for (int i = threadIdx.x; i < v; i += blockDim.x) out[i] = (u32)i;
        if (threadIdx.x == 0) cnt[r] = (u32)v;
        return;
    }
    const float* sc = work + (i64)r * positions;
    u32 prefix = 0, mask = 0, remaining = (u32)topk;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int t = threadIdx.x; t < v; t += blockDim.x) {
            u32 k = fkey(sc[t]);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 cum = 0;
            int b = 255;
            for (; b > 0; b--) {
                if (cum + hist[b] >= remaining) break;
                cum += hist[b];
            }
            s_prefix = prefix | ((u32)b << shift);
            s_remaining = remaining - cum;
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix: the k-th largest key; remaining: how many keys equal to it are taken.
    u32 base_sel = 0, base_eq = 0;
    for (int t0 = 0; t0 < v; t0 += blockDim.x) {
        int t = t0 + threadIdx.x;
        u32 k = t < v ? fkey(sc[t]) : 0u;
        bool gt = t < v && k > prefix;
        bool eq = t < v && k == prefix;
        u32 eq_total, sel_total;
        u32 eq_rank = base_eq + bscan(eq, wt, &eq_total);
        bool take = gt || (eq && eq_rank < remaining);
        u32 idx = base_sel + bscan(take, wt, &sel_total);
        if (take) out[idx] = (u32)t;
        base_eq += eq_total;
        base_sel += sel_total;
    }
    if (threadIdx.x == 0) cnt[r] = (u32)topk;
}

// ---------------------------------------------------------------------------------------
// Grouped-query attention.

// Per row: each query head normalised (optional) and rotated (half-split RoPE on the
// leading `rotary` dims); keys likewise into the cache, values copied. A warp per head.
extern "C" __global__ void k_gqa_prepare(StepDev st, float* q, const float* k, const float* v, const float* qn,
                                         const float* kn, float eps, int heads, int kv_heads, int hd, int rotary,
                                         const float* cs, const float* sn, float* cache) {
    int r = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int kvw = kv_heads * hd, width = 2 * kvw, half = rotary / 2;
    float* dst = cache + (i64)kv_slot(st, r, (int)st.pos[r]) * width;
    const float* c0 = cs + (i64)r * half;
    const float* s0 = sn + (i64)r * half;
    for (int i = threadIdx.x; i < kvw; i += blockDim.x) {
        dst[i] = k[(i64)r * kvw + i];
        dst[kvw + i] = v[(i64)r * kvw + i];
    }
    __syncthreads();
    for (int hh = warp; hh < heads + kv_heads; hh += nw) {
        bool isq = hh < heads;
        float* x = isq ? q + ((i64)r * heads + hh) * hd : dst + (hh - heads) * hd;
        const float* nw_ = isq ? qn : kn;
        if (nw_) {
            float ss = 0.f;
            for (int d = lane; d < hd; d += 32) ss = fmaf(x[d], x[d], ss);
            ss = wsum(ss);
            float inv = 1.0f / sqrtf(ss / (float)hd + eps);
            for (int d = lane; d < hd; d += 32) x[d] = x[d] * inv * nw_[d];
            __syncwarp();
        }
        for (int i = lane; i < half; i += 32) {
            float a = x[i], b = x[half + i];
            x[i] = a * c0[i] - b * s0[i];
            x[half + i] = b * c0[i] + a * s0[i];
        }
        __syncwarp();
    }
}

// Causal (optionally windowed) attention of row blockIdx.x, head blockIdx.y over its KV
// head's cache; online softmax per warp. J >= ceil(hd / 32).
template <int J>
__device__ __forceinline__ void gqa_attend(StepDev st, const float* q, const float* cache, int heads, int kv_heads,
                                           int hd, float scale, int window, float* out) {
    __shared__ float sm[4], sl[4];
    __shared__ float sacc[4][J * 32];
    int r = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int group = heads / kv_heads, g = h / group;
    int kvw = kv_heads * hd, width = 2 * kvw;
    const float* qr = q + ((i64)r * heads + h) * hd;
    float qv[J], acc[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        int d = lane + 32 * j;
        qv[j] = d < hd ? qr[d] : 0.f;
        acc[j] = 0.f;
    }
    int v = (int)st.pos[r] + 1;
    int start = window > 0 ? max(0, v - window) : 0;
    float m = NEG_INF, l = 0.f;
    for (int t = start + warp; t < v; t += 4) {
        const float* base = cache + (i64)kv_slot(st, r, t) * width;
        const float* key = base + g * hd;
        const float* val = base + kvw + g * hd;
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            int d = lane + 32 * j;
            if (d < hd) s = fmaf(qv[j], key[d], s);
        }
        s = wsum(s) * scale;
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), e = expf(s - mn);
        l = l * corr + e;
#pragma unroll
        for (int j = 0; j < J; j++) {
            int d = lane + 32 * j;
            float vv = d < hd ? val[d] : 0.f;
            acc[j] = fmaf(e, vv, acc[j] * corr);
        }
        m = mn;
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < J; j++) sacc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3]));
    float f[4], L = 0.f;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        f[w] = sm[w] == NEG_INF ? 0.f : expf(sm[w] - M);
        L += sl[w] * f[w];
    }
    float inv = 1.0f / L;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) a += sacc[w][d] * f[w];
        out[((i64)r * heads + h) * hd + d] = a * inv;
    }
}

#define GQA_ATTEND(J)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) k_gqa_attend_##J(StepDev st, const float* q,             \
                                                                       const float* cache, int heads,          \
                                                                       int kv_heads, int hd, float scale,      \
                                                                       int window, float* out) {               \
        gqa_attend<J>(st, q, cache, heads, kv_heads, hd, scale, window, out);                                 \
    }
GQA_ATTEND(1)
GQA_ATTEND(2)
GQA_ATTEND(4)
GQA_ATTEND(8)

// ---------------------------------------------------------------------------------------
// MoE: noaux_tc routing and the combination of expert outputs.

// (value, id) with a validity flag: valid first, then the larger value, then the lower id.
__device__ __forceinline__ bool better(float av, int ai, float bv, int bi) {
    if (ai < 0) return false;
    if (bi < 0) return true;
    return av > bv || (av == bv && ai < bi);
}

// Per row (256 threads): s = sigmoid(logits); choice = s + bias, masked to the best
// topk_group groups (a group's score: the sum of its two best); the top k of choice (ties
// to the lower id), best first; weights s at those ids, normalised (+1e-20) if asked,
// times the scaling. Dynamic shared memory: 2n floats + n_group ints.
extern "C" __global__ void __launch_bounds__(256) k_route(const float* logits, int n, const float* bias, int k,
                                                          int n_group, int topk_group, int norm, float scaling,
                                                          u32* ids, float* wts) {
    extern __shared__ float smem[];
    float* s = smem;
    float* ch = smem + n;
    int* keep = (int*)(ch + n);
    __shared__ float bv[8];
    __shared__ int bi[8];
    __shared__ int chosen[64];
    int r = blockIdx.x;
    const float* l = logits + (i64)r * n;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        float sv = 1.0f / (1.0f + expf(-l[e]));
        s[e] = sv;
        ch[e] = sv + bias[e];
    }
    __syncthreads();
    if (n_group > 1) {
        int per = n / n_group;
        if (threadIdx.x == 0) {
            // Group scores, then the best topk_group groups (insertion, ties to the lower index).
            float gsc[64];
            int order[64];
            int len = 0;
            for (int gi = 0; gi < n_group; gi++) {
                float a = NEG_INF, b2 = NEG_INF;
                for (int e = gi * per; e < (gi + 1) * per; e++) {
                    float x = ch[e];
                    if (x > a) {
                        b2 = a;
                        a = x;
                    } else if (x > b2) {
                        b2 = x;
                    }
                }
                gsc[gi] = a + b2;
                keep[gi] = 0;
            }
            for (int gi = 0; gi < n_group; gi++) {
                if (len == topk_group && !(gsc[gi] > gsc[order[len - 1]])) continue;
                int at = len;
                while (at > 0 && gsc[gi] > gsc[order[at - 1]]) at--;
                if (len == topk_group) len--;
                for (int j = len; j > at; j--) order[j] = order[j - 1];
                order[at] = gi;
                len++;
            }
            for (int j = 0; j < len; j++) keep[order[j]] = 1;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < n; e += blockDim.x)
            if (!keep[e / per]) ch[e] = NEG_INF;
        __syncthreads();
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int it = 0; it < k; it++) {
        float v = 0.f;
        int id = -1;
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            bool taken = false;
            for (int j = 0; j < it; j++) taken |= chosen[j] == e;
            if (!taken && better(ch[e], e, v, id)) {
                v = ch[e];
                id = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, id, o);
            if (better(ov, oi, v, id)) {
                v = ov;
                id = oi;
            }
        }
        if (lane == 0) {
            bv[warp] = v;
            bi[warp] = id;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float b0 = bv[0];
            int i0 = bi[0];
            for (int w = 1; w < (int)(blockDim.x >> 5); w++)
                if (better(bv[w], bi[w], b0, i0)) {
                    b0 = bv[w];
                    i0 = bi[w];
                }
            chosen[it] = i0;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        u32* oi = ids + (i64)r * k;
        float* ow = wts + (i64)r * k;
        for (int i = 0; i < k; i++) {
            oi[i] = (u32)chosen[i];
            ow[i] = s[chosen[i]];
        }
        if (norm) {
            float denom = 0.f;
            for (int i = 0; i < k; i++) denom += ow[i];
            denom += 1e-20f;
            for (int i = 0; i < k; i++) ow[i] /= denom;
        }
        for (int i = 0; i < k; i++) ow[i] *= scaling;
    }
}

// out[r] += sum over r's experts in ascending id of w * y[src[r, rank]] (+ y[shared + r]).
extern "C" __global__ void k_combine(int hidden, int k, const u32* ids, const float* w, const u32* src, const float* y,
                                     int shared, float* out) {
    __shared__ int order[64];
    int r = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int i = 0; i < k; i++) {
            int j = i;
            while (j > 0 && ids[(i64)r * k + order[j - 1]] > ids[(i64)r * k + i]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = i;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = 0.f;
        for (int i = 0; i < k; i++) {
            int rank = order[i];
            i64 at = src[(i64)r * k + rank];
            acc = fmaf(w[(i64)r * k + rank], y[at * hidden + c], acc);
        }
        if (shared >= 0) acc += y[((i64)shared + r) * hidden + c];
        out[(i64)r * hidden + c] += acc;
    }
}
