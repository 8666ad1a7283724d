// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// Element- and row-wise ops added for Gemma 4 (as the CPU backend's cpu/elementwise.rs).

#define GRID_STRIDE(i, n) for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void k_scale(i64 n, float f, float* x) {
    GRID_STRIDE(i, n) x[i] *= f;
}

// dst[..n] = src[..n] (a row of gather_rows).
extern "C" __global__ void k_copy(i64 n, const float* src, float* dst) {
    GRID_STRIDE(i, n) dst[i] = src[i];
}

extern "C" __global__ void k_fill(i64 n, float v, float* x) {
    GRID_STRIDE(i, n) x[i] = v;
}

// x = cap * tanh(x / cap): the final logit soft cap.
extern "C" __global__ void k_soft_cap(i64 n, float cap, float* x) {
    GRID_STRIDE(i, n) x[i] = tanhf(x[i] / cap) * cap;
}

// x[r] += rms_norm(a[r]) * w (w null: no scale), a block per row, over float4s where
// aligned (as rms_seg).
extern "C" __global__ void k_add_rms_norm(const float* a, const float* w, float eps, float* x, int width) {
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
    float* ar = a + (i64)blockIdx.x * width;
    const float* br = b + (i64)blockIdx.x * stride + col;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ar[c] = gelu_tanh(ar[c]) * br[c];
}
