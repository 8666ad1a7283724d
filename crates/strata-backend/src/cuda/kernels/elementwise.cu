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

// x[r] += rms_norm(a[r]) * w (w null: no scale), a block per row.
extern "C" __global__ void k_add_rms_norm(const float* a, const float* w, float eps, float* x, int width) {
    __shared__ float sh[32];
    const float* ar = a + (i64)blockIdx.x * width;
    float* xr = x + (i64)blockIdx.x * width;
    float ss = 0.f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss = fmaf(ar[c], ar[c], ss);
    ss = bsum(ss, sh);
    float inv = 1.0f / sqrtf(ss / (float)width + eps);
    for (int c = threadIdx.x; c < width; c += blockDim.x) xr[c] += w ? ar[c] * inv * w[c] : ar[c] * inv;
}

// a[r, i] = gelu_tanh(a[r, i]) * b[r * stride + col + i], a block per row.
extern "C" __global__ void k_gelu_mul(int width, float* a, const float* b, int stride, int col) {
    float* ar = a + (i64)blockIdx.x * width;
    const float* br = b + (i64)blockIdx.x * stride + col;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ar[c] = gelu_tanh(ar[c]) * br[c];
}
