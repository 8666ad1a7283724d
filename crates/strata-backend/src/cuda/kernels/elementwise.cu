// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// Element- and row-wise ops added for Gemma 4 (as the CPU backend's cpu/elementwise.rs).

#define GRID_STRIDE(i, n) for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void k_scale(i64 n, float f, float* x) {
    pdl_enter();
    GRID_STRIDE(i, n) x[i] *= f;
}

// dst[..n] = src[..n] (a row of gather_rows).
extern "C" __global__ void k_copy(i64 n, const float* src, float* dst) {
    pdl_enter();
    GRID_STRIDE(i, n) dst[i] = src[i];
}

extern "C" __global__ void k_fill(i64 n, float v, float* x) {
    pdl_enter();
    GRID_STRIDE(i, n) x[i] = v;
}

// x = cap * tanh(x / cap): the final logit soft cap.
extern "C" __global__ void k_soft_cap(i64 n, float cap, float* x) {
    pdl_enter();
    GRID_STRIDE(i, n) x[i] = tanhf(x[i] / cap) * cap;
}

// x[r] += rms_norm(a[r]) * w (w null: no scale), a block per row, over float4s where
// aligned (as rms_seg).
extern "C" __global__ void k_add_rms_norm(const float* a, const float* w, float eps, float* x, int width) {
    pdl_enter();
    __shared__ float sh[32];
    const float* ar = a + (i64)blockIdx.x * width;
    float* xr = x + (i64)blockIdx.x * width;
    bool v4 = f4_ok(ar, xr, w, width);
    float ss = bsum(part_ss(ar, width, v4), sh);
    float inv = 1.0f / sqrtf(ss / (float)width + eps);
    if (v4) {
        for (int c = threadIdx.x; c < width / 4; c += blockDim.x) {
            float4 s = scaled4(((const float4*)ar)[c], inv, w, c), o = ((float4*)xr)[c];
            ((float4*)xr)[c] = make_float4(o.x + s.x, o.y + s.y, o.z + s.z, o.w + s.w);
        }
    } else {
        for (int c = threadIdx.x; c < width; c += blockDim.x) xr[c] += w ? ar[c] * inv * w[c] : ar[c] * inv;
    }
}

// a[r, i] = gelu_tanh(a[r, i]) * b[r * stride + col + i], a block per row.
extern "C" __global__ void k_gelu_mul(int width, float* a, const float* b, int stride, int col) {
    pdl_enter();
    float* ar = a + (i64)blockIdx.x * width;
    const float* br = b + (i64)blockIdx.x * stride + col;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ar[c] = gelu_tanh(ar[c]) * br[c];
}

// (value, id) of a greedy pick: the larger value wins, equal values go to the lower id.
__device__ __forceinline__ void pick_max(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// A row's greedy pick, in thread 0 (a block of up to 1024): a thread's columns rise, so its
// first maximum is its lowest. NON_FINITE | j for the lowest non-finite j.
__device__ __forceinline__ u32 greedy_pick(const float* xr, int width) {
    __shared__ float sv[32];
    __shared__ int si[32], sb[32];
    float best = NEG_INF;
    int bi = 0x7fffffff, bad = 0x7fffffff;
    auto see = [&](float v, int c) {
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) bad = min(bad, c);
        else if (v > best) best = v, bi = c;
    };
    if (f4_ok(xr, xr, xr, width)) {
        // Four loads in flight a thread (the block is alone on the device: latency-bound).
#pragma unroll 4
        for (int c = threadIdx.x; c < width / 4; c += blockDim.x) {
            float4 a = ((const float4*)xr)[c];
            see(a.x, 4 * c), see(a.y, 4 * c + 1), see(a.z, 4 * c + 2), see(a.w, 4 * c + 3);
        }
    } else {
        for (int c = threadIdx.x; c < width; c += blockDim.x) see(xr[c], c);
    }
    for (int o = 16; o > 0; o >>= 1) {
        pick_max(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
        bad = min(bad, __shfl_xor_sync(0xffffffffu, bad, o));
    }
    int w = threadIdx.x / 32, nw = blockDim.x / 32;
    if ((threadIdx.x & 31) == 0) sv[w] = best, si[w] = bi, sb[w] = bad;
    __syncthreads();
    if (threadIdx.x != 0) return 0;
    for (int k = 1; k < nw; k++) pick_max(best, bi, sv[k], si[k]), bad = min(bad, sb[k]);
    return bad != 0x7fffffff ? (0x80000000u | (u32)bad) : (u32)bi;
}

// Each row's greedy pick (Backend::pick_rows with no draws): a block per row.
extern "C" __global__ void __launch_bounds__(1024) k_argmax_rows(const float* x, int width, u32* picks) {
    pdl_enter();
    u32 p = greedy_pick(x + (i64)blockIdx.x * width, width);
    if (threadIdx.x == 0) picks[blockIdx.x] = p;
}
