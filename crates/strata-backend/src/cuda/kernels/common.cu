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
    const u32* vis;  // per row, one past the last position it sees; null: its own position
    int bs, max_blocks;
};

// First in every kernel. Kernels may be launched before the one before them has finished
// (programmatic dependent launch, sm_90 on; see cuda/queue.rs): wait until the grids this
// one depends on have finished and their writes show, then let the next grid start
// launching, so its launch overlaps this grid's run. Without that launch mode both are
// no-ops.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The one-row expert kernels find their task (for a routed expert a chain of dependent
// loads: id, descriptor, weights) before they wait on the kernel before, where none of it
// depends on that kernel; the int4 tiles also issue their first chunk's loads (i4_tile's
// `pre`). H200, GLM-5 slice: +1.4% bf16 decode (2026-12-03). PRE_LOAD=0: they wait at
// their start instead, for comparison.
#ifndef PRE_LOAD
#define PRE_LOAD 1
#endif

// Whether the caller defers its wait on the kernel before (it asks to, and PRE_LOAD); if
// not, the wait is now.
__device__ __forceinline__ bool defer_wait(bool want) {
    if (want && PRE_LOAD) return true;
    pdl_enter();
    return false;
}

__device__ __forceinline__ int kv_slot(const StepDev& s, int r, int p) {
    int t = (int)s.seq[r] * s.max_blocks;
    return (int)s.blocks[t + p / s.bs] * s.bs + p % s.bs;
}

// One past the last position row r may attend (an image row may see its whole image).
__device__ __forceinline__ int visible(const StepDev& s, int r) { return s.vis ? (int)s.vis[r] : (int)s.pos[r] + 1; }

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

// Whether n floats at each of the (non-null) pointers can be read as float4s.
__device__ __forceinline__ bool f4_ok(const void* a, const void* b, const void* c, int n) {
    return ((((size_t)a | (size_t)b | (size_t)c) & 15) == 0) && (n & 3) == 0;
}

// Float4 c / float c of p: through L2 when L2 (values other blocks of this grid wrote,
// which this SM's L1 may hold stale), else a plain load.
template <bool L2>
__device__ __forceinline__ float4 ld4(const float* p, int c) {
    return L2 ? __ldcg((const float4*)p + c) : ((const float4*)p)[c];
}
template <bool L2>
__device__ __forceinline__ float ld1(const float* p, int c) {
    return L2 ? __ldcg(p + c) : p[c];
}

// This thread's share of sum(x[..n]^2), over float4s when v4.
template <bool L2 = false>
__device__ __forceinline__ float part_ss(const float* x, int n, bool v4) {
    float ss = 0.f;
    if (v4) {
        for (int c = threadIdx.x; c < n / 4; c += blockDim.x) {
            float4 a = ld4<L2>(x, c);
            ss = fmaf(a.x, a.x, ss);
            ss = fmaf(a.y, a.y, ss);
            ss = fmaf(a.z, a.z, ss);
            ss = fmaf(a.w, a.w, ss);
        }
    } else {
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            float a = ld1<L2>(x, c);
            ss = fmaf(a, a, ss);
        }
    }
    return ss;
}

// a * inv * w[4c..4c+4] (w null: a * inv): a float4 of a normalised row.
__device__ __forceinline__ float4 scaled4(float4 a, float inv, const float* w, int c) {
    if (!w) return make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
    float4 b = ((const float4*)w)[c];
    return make_float4(a.x * inv * b.x, a.y * inv * b.y, a.z * inv * b.z, a.w * inv * b.w);
}

// out = x / sqrt(mean(x^2) + eps) * w over a block (in place allowed; L2: x read through
// L2). Rows are read as float4s where aligned: each thread's loads are then few and in
// flight together (a block walking a 6144-wide row one float a thread is bound by load
// latency, ~20 us).
template <bool L2 = false>
__device__ void rms_seg(const float* x, const float* w, float eps, float* out, int n, float* sh) {
    bool v4 = f4_ok(x, out, w, n);
    float ss = bsum(part_ss<L2>(x, n, v4), sh);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    if (v4) {
        for (int c = threadIdx.x; c < n / 4; c += blockDim.x) ((float4*)out)[c] = scaled4(ld4<L2>(x, c), inv, w, c);
    } else {
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            float a = ld1<L2>(x, c);
            out[c] = w ? a * inv * w[c] : a * inv;
        }
    }
    __syncthreads();
}

// Whether this block is the last of its grid to get here (every thread calls it, after
// its writes; `done` counts the blocks and is zero between launches: the last resets it).
// One thread fences the block's writes (after the barrier, as a grid barrier does) so that
// the last block sees them through L2 (ld4<true>, __ldcg). A grid's last block can then
// finish what needs all of its outputs (a router's top-k, the norm of a residual) where a
// launch of its own would cost its start and its wait.
__device__ __forceinline__ bool last_block(u32* done) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
        if (last) {
            *done = 0;
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

// rms_seg<true> for a row of at most 4 x RMS_REGS x blockDim.x floats, float4-aligned: the
// row's loads all issued at once and held in registers for the scaling (a last block
// alone on its SM is bound by load latency: rms_seg's loop issues one float4 at a time).
#define RMS_REGS 8
__device__ void rms_row_regs(const float* x, const float* w, float eps, float* out, int n, float* sh) {
    float4 v[RMS_REGS];
    int n4 = n / 4;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < RMS_REGS; k++) {
        int c = threadIdx.x + k * blockDim.x;
        v[k] = c < n4 ? ld4<true>(x, c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < RMS_REGS; k++) {
        ss = fmaf(v[k].x, v[k].x, ss);
        ss = fmaf(v[k].y, v[k].y, ss);
        ss = fmaf(v[k].z, v[k].z, ss);
        ss = fmaf(v[k].w, v[k].w, ss);
    }
    ss = bsum(ss, sh);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int k = 0; k < RMS_REGS; k++) {
        int c = threadIdx.x + k * blockDim.x;
        if (c < n4) ((float4*)out)[c] = scaled4(v[k], inv, w, c);
    }
}

// The norm of a row other blocks of this grid wrote (through L2): in registers where it fits.
__device__ void rms_row_l2(const float* x, const float* w, float eps, float* out, int n, float* sh) {
    if (f4_ok(x, out, w, n) && n / 4 <= RMS_REGS * (int)blockDim.x) rms_row_regs(x, w, eps, out, n, sh);
    else rms_seg<true>(x, w, eps, out, n, sh);
}

// A greedy pick in the making: the largest value seen (ties to the lower id) and the
// lowest id of a non-finite one. Merged across a warp, then a block (`block`: every
// warp's lane 0 ends with the block's); `code` is the pick as Backend::argmax_rows gives
// it (NON_FINITE | j for the lowest non-finite j).
struct Pick {
    float best = NEG_INF;
    int id = 0x7fffffff, bad = 0x7fffffff;
    __device__ __forceinline__ void see(float v, int c) {
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) bad = min(bad, c);
        else if (v > best || (v == best && c < id)) best = v, id = c;
    }
    __device__ __forceinline__ void merge(float ov, int oi, int ob) {
        if (ov > best || (ov == best && oi < id)) best = ov, id = oi;
        bad = min(bad, ob);
    }
    __device__ __forceinline__ void warp() {
        for (int o = 16; o > 0; o >>= 1)
            merge(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, id, o),
                  __shfl_xor_sync(0xffffffffu, bad, o));
    }
    __device__ void block() {
        __shared__ float sv[32];
        __shared__ int si[32], sb[32];
        warp();
        int w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
        __syncthreads();
        if ((threadIdx.x & 31) == 0) sv[w] = best, si[w] = id, sb[w] = bad;
        __syncthreads();
        if ((threadIdx.x & 31) == 0)
            for (int k = 0; k < nw; k++) merge(sv[k], si[k], sb[k]);
    }
    __device__ __forceinline__ u32 code() const { return bad != 0x7fffffff ? (0x80000000u | (u32)bad) : (u32)id; }
};

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// GELU, tanh approximation (Gemma's gelu_pytorch_tanh), as strata_kernels::ops::gelu_tanh.
__device__ __forceinline__ float gelu_tanh(float x) {
    const float K = 0.7978846f;
    return 0.5f * x * (1.0f + tanhf(K * (x + 0.044715f * x * x * x)));
}

// An expert's gate activation: 0 SiLU (SwiGLU), 1 GELU-tanh (Gemma 4).
__device__ __forceinline__ float gate_act(float g, int act) { return act ? gelu_tanh(g) : silu(g); }

// Max over the block (every thread gets it). `sh`: 32 floats of shared memory.
__device__ float bmax(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = wmax(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : NEG_INF;
    return wmax(v);
}

// An f16x2 word as two f32s (low half first), exactly.
__device__ __forceinline__ float2 unpack_f16(u32 v) {
    unsigned short l, h;
    float a, b;
    asm("mov.b32 {%0, %1}, %2;" : "=h"(l), "=h"(h) : "r"(v));
    asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(l));
    asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(h));
    return make_float2(a, b);
}
