// Qwen3-Next's gated DeltaNet (strata_kernels::deltanet is the reference and says the
// rule), in two grids. The causal convolution: one thread a channel, walking the step's
// rows in order, so a sequence's rows each continue the convolution state the row before
// left. Then the delta rule: one block a value head, one thread a column j of the head's
// [k_dim, v_dim] state; the columns are independent (S[:, j] needs only k, q, v[j] and
// beta), so only the q/k L2 norms and the gated norm reduce over the block. A block walks
// the rows in order too, each on its own sequence's state.

extern "C" __global__ void k_delta_conv(StepDev sd, int rows, const float* qkvz, int width, const float* w,
                                        int channels, int kernel, float* conv_state, float* mixed) {
    pdl_enter();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    int km1 = kernel - 1;
    const float* wc = w + (i64)c * kernel;
    for (int r = 0; r < rows; r++) {
        float* past = conv_state + ((i64)sd.seq[r] * channels + c) * km1;
        float x = qkvz[(i64)r * width + c];
        float acc = wc[km1] * x;
        for (int j = 0; j < km1; j++) acc += wc[j] * past[j];
        mixed[(i64)r * channels + c] = acc * (1.0f / (1.0f + expf(-acc)));
        for (int j = 0; j + 1 < km1; j++) past[j] = past[j + 1];
        if (km1 > 0) past[km1 - 1] = x;
    }
}

// PyTorch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Dynamic shared memory: 2 * k_dim floats (the row's normalised q and k of the block's key
// head). Block: v_dim threads rounded up to a warp.
extern "C" __global__ void k_delta_rule(StepDev sd, int rows, const float* mixed, const float* qkvz, int width,
                                        const float* ba, int k_heads, int v_heads, int k_dim, int v_dim,
                                        const float* a_log, const float* dt_bias, const float* norm, float eps,
                                        float* state, float* out) {
    pdl_enter();
    extern __shared__ float qk[];
    __shared__ float sh[32];
    float *qs = qk, *ks = qk + k_dim;
    int h = blockIdx.x, kh = h / (v_heads / k_heads), j = threadIdx.x;
    int kd = k_heads * k_dim, vd = v_heads * v_dim, cd = 2 * kd + vd;
    float scale = 1.0f / sqrtf((float)k_dim);
    float a = -expf(a_log[h]), bias = dt_bias[h];
    i64 head_state = (i64)k_dim * v_dim;
    for (int r = 0; r < rows; r++) {
        const float* m = mixed + (i64)r * cd;
        float qq = 0.f, kk = 0.f;
        for (int i = j; i < k_dim; i += blockDim.x) {
            float q = m[kh * k_dim + i], k = m[kd + kh * k_dim + i];
            qs[i] = q;
            ks[i] = k;
            qq += q * q;
            kk += k * k;
        }
        float qinv = 1.0f / sqrtf(bsum(qq, sh) + 1e-6f);
        float kinv = 1.0f / sqrtf(bsum(kk, sh) + 1e-6f);
        for (int i = j; i < k_dim; i += blockDim.x) {
            qs[i] = (qs[i] * qinv) * scale;
            ks[i] = ks[i] * kinv;
        }
        __syncthreads();
        const float* bar = ba + (i64)r * 2 * v_heads;
        float beta = 1.0f / (1.0f + expf(-bar[h]));
        float decay = expf(a * softplus(bar[v_heads + h] + bias));
        float o = 0.f;
        if (j < v_dim) {
            float* s = state + (i64)sd.seq[r] * v_heads * head_state + h * head_state + j;
            // S^T k over the decayed state; the decay is recomputed (bit for bit) in the
            // update pass rather than written twice.
            float mem = 0.f;
            for (int i = 0; i < k_dim; i++) mem += (s[(i64)i * v_dim] * decay) * ks[i];
            float delta = (m[2 * kd + h * v_dim + j] - mem) * beta;
            for (int i = 0; i < k_dim; i++) {
                float v = s[(i64)i * v_dim] * decay + ks[i] * delta;
                s[(i64)i * v_dim] = v;
                o += v * qs[i];
            }
        }
        // The gated norm over the head.
        float inv = 1.0f / sqrtf(bsum(o * o, sh) / (float)v_dim + eps);
        if (j < v_dim) {
            float z = qkvz[(i64)r * width + 2 * kd + vd + h * v_dim + j];
            out[(i64)r * vd + h * v_dim + j] = ((o * inv) * norm[j]) * (z * (1.0f / (1.0f + expf(-z))));
        }
        __syncthreads();  // qs/ks are rewritten by the next row
    }
}

// x[i] *= sigmoid(gate[i]) (Qwen3-Next's gated attention output).
extern "C" __global__ void k_sigmoid_mul(i64 n, const float* gate, float* x) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
