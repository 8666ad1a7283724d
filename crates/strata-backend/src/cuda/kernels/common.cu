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
// (group scales, column 2i in the low nibble), 4 FP8 e4m3 (block scales), 5 MXFP4 (FP4 e2m1
// nibbles in int4's layout, an e8m0 scale byte for each 32 columns).
struct Mat {
    const u8* w;
    const float* s;  // f32 scales; bf16 or e4m3 ones as st says (read them through sat / sraw / sval / mscale)
    int kind, rows, cols, group, brow, bcol;
    int ld;   // payload bytes per row
    int spr;  // scales per row (int4: groups; FP8: column blocks)
    int vec;  // 16-byte vector loads allowed (aligned rows, whole vectors, one scale per vector)
    int st;   // int4 scales stored as 0 f32, 1 bf16 (int4-gN-bf16), 2 e4m3 (int4-gN-e4m3: an f32
              // factor, then a byte a scale); 3 e8m0 (MXFP4: a byte a scale, 2^(byte - 127))
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

// The weight-streaming kernels find their task (a chain of dependent loads for a routed
// expert: id, descriptor, weights) and weight pointers before they wait on the kernel
// before, which none of that depends on; the int4 tiles also issue their first chunk's
// loads (i4_tile's `pre`). H200, GLM-5 slice: +1.4% bf16 decode (2026-12-03).

// Whether the caller defers its wait on the kernel before (it asks to); if not, the wait
// is now.
__device__ __forceinline__ bool defer_wait(bool want) {
    if (want) return true;
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

// FP4 e2m1 (MXFP4's nibbles): sign in bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, whose f32
// bits' top two bytes two byte permutes pick.
__device__ __forceinline__ float fp4f(u32 nib) {
    u32 mag = nib & 7u;
    u32 hi = __byte_perm(0x3F3F3F00u, 0x40404040u, mag), lo = __byte_perm(0xC0800000u, 0xC0804000u, mag);
    return __uint_as_float(((hi & 0xFFu) << 24) | ((lo & 0xFFu) << 16) | ((nib & 8u) << 28));
}

__device__ __forceinline__ float e4m3f(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    if (e == 15u && m == 7u) v = __int_as_float(0x7fc00000);
    return (b & 0x80u) ? -v : v;
}

// Scale i from p as raw bits (a bf16 or e4m3 byte zero-extended, or an f32's), and those
// bits as the scale (bf16 and e4m3 widen to f32 exactly; e4m3 is its bits placed in an f32's
// exponent and mantissa times 2^120, then times the matrix factor `fac`). Rings of loads in
// flight hold the raw bits, so that widening waits for its load only where the scale is
// used; a bf16 or byte is loaded straight into a 32-bit register (PTX zero-extends), since
// `__ldg` of a u16 fills a 16-bit one whose widening waited on the load at once (Nsight
// Compute: the prompt tiles stalled on loads 4x as often as with f32 scales, 35% slower).
__device__ __forceinline__ u32 sraw(const u8* p, size_t i, int st) {
    u32 v;
    if (st == 0) return __float_as_uint(__ldg((const float*)p + i));
    if (st == 1) asm("ld.global.nc.u16 %0, [%1];" : "=r"(v) : "l"((const u16*)p + i));
    else asm("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p + i));
    return v;
}
// An e8m0 byte's power of two (0 is 2^-127, an f32 denormal).
__device__ __forceinline__ float e8m0f(u32 b) { return b ? __uint_as_float(b << 23) : __uint_as_float(0x400000u); }
__device__ __forceinline__ float sval(u32 raw, int st, float fac) {
    if (st == 3) return e8m0f(raw);
    if (st == 2) return __uint_as_float(raw << 20) * 0x1p120f * fac;
    return __uint_as_float(st ? raw << 16 : raw);
}
// Where scale i of m lies (for rows of scales read by sraw).
__device__ __forceinline__ const u8* sat(const Mat& m, size_t i) {
    const u8* s = (const u8*)m.s;
    return m.st == 2 ? s + 4 + i : m.st == 3 ? s + i : s + (i << (m.st ? 1 : 2));
}
// The factor m's e4m3 scales multiply (1 for the other types).
__device__ __forceinline__ float sfac(const Mat& m) { return m.st == 2 ? __ldg(m.s) : 1.f; }
// Scale i of m.
__device__ __forceinline__ float mscale(const Mat& m, size_t i) { return sval(sraw(sat(m, 0), i, m.st), m.st, sfac(m)); }
// mscale where E4 is false: m's scales are f32 or bf16, never e4m3. The one-row projection
// kernels read scales so (the host sends e4m3 int4 matrices to k_linear_R instead,
// cuda/ops.rs): a third scale type in their int4 path took registers from every path of
// those kernels (k_linear_quad 136 -> 284 bytes of spill loads), and the bf16 slice
// decoded 2% slower (H200, 2026-12-04).
template <bool E4> __device__ __forceinline__ float mscale_t(const Mat& m, size_t i) {
    if (E4) return mscale(m, i);
    int st = m.st ? 1 : 0;
    return sval(sraw((const u8*)m.s, i, st), st, 1.f);
}

template <bool E4 = true> __device__ __forceinline__ float melem(const Mat& m, int r, int c) {
    const u8* row = m.w + (size_t)r * m.ld;
    switch (m.kind) {
    case 0: return ((const float*)row)[c];
    case 1: return bf16f(((const u16*)row)[c]);
    case 2: return (float)(signed char)row[c] * m.s[r];
    case 3: {
        u32 b = row[c >> 1];
        u32 nib = (c & 1) ? (b >> 4) : (b & 15u);
        return (float)((int)nib - 8) * mscale_t<E4>(m, (size_t)r * m.spr + c / m.group);
    }
    case 5: {
        u32 b = row[c >> 1];
        u32 nib = (c & 1) ? (b >> 4) : (b & 15u);
        return fp4f(nib) * e8m0f(((const u8*)m.s)[(size_t)r * m.spr + c / 32]);
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

// GELU, tanh approximation (Gemma's gelu_pytorch_tanh), as strata_kernels::ops::gelu_tanh.
__device__ __forceinline__ float gelu_tanh(float x) {
    const float K = 0.7978846f;
    return 0.5f * x * (1.0f + tanhf(K * (x + 0.044715f * x * x * x)));
}

// h from an expert's gate value g and up value u, as strata_kernels' GateAct::apply: act 0
// SiLU (SwiGLU), 1 GELU-tanh (Gemma 4), 2 gpt-oss's clamped SwiGLU (alpha, limit).
__device__ __forceinline__ float act_mul(float g, float u, int act, float alpha, float limit) {
    if (act == 2) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.0f) * g / (1.0f + expf(-alpha * g));
    }
    return (act ? gelu_tanh(g) : silu(g)) * u;
}

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
