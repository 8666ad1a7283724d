// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// Embedding, norms, residual adds.

// Grid (rows, column blocks of 256): a decode row's embedding is spread over the device.
// A fed row (FED | i) embeds picks[i]; an embedding row (u32 max) and a flagged pick
// (NON_FINITE | j) are out of the table and left alone.
extern "C" __global__ void k_embed(Mat t, StepDev st, const u32* picks, float* out) {
    pdl_enter();
    int r = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    u32 tok = st.tokens[r];
    if (tok != 0xffffffffu && (tok & 0x80000000u)) tok = picks[tok & 0x7fffffffu];
    if (tok >= (u32)t.rows || c >= t.cols) return;
    out[(i64)r * t.cols + c] = melem(t, (int)tok, c);
}

// Whether n floats at each of the (non-null) pointers can be read as float4s.
__device__ __forceinline__ bool f4_ok(const void* a, const void* b, const void* c, int n) {
    return ((((size_t)a | (size_t)b | (size_t)c) & 15) == 0) && (n & 3) == 0;
}

// This thread's share of sum(x[..n]^2), over float4s when v4.
__device__ __forceinline__ float part_ss(const float* x, int n, bool v4) {
    float ss = 0.f;
    if (v4) {
        for (int c = threadIdx.x; c < n / 4; c += blockDim.x) {
            float4 a = ((const float4*)x)[c];
            ss = fmaf(a.x, a.x, ss);
            ss = fmaf(a.y, a.y, ss);
            ss = fmaf(a.z, a.z, ss);
            ss = fmaf(a.w, a.w, ss);
        }
    } else {
        for (int c = threadIdx.x; c < n; c += blockDim.x) ss = fmaf(x[c], x[c], ss);
    }
    return ss;
}

// a * inv * w[4c..4c+4] (w null: a * inv): a float4 of a normalised row.
__device__ __forceinline__ float4 scaled4(float4 a, float inv, const float* w, int c) {
    if (!w) return make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
    float4 b = ((const float4*)w)[c];
    return make_float4(a.x * inv * b.x, a.y * inv * b.y, a.z * inv * b.z, a.w * inv * b.w);
}

// out = x / sqrt(mean(x^2) + eps) * w over a block (in place allowed). Rows are read as
// float4s where aligned: each thread's loads are then few and in flight together (a
// block walking a 6144-wide row one float a thread is bound by load latency, ~20 us).
__device__ void rms_seg(const float* x, const float* w, float eps, float* out, int n, float* sh) {
    bool v4 = f4_ok(x, out, w, n);
    float ss = bsum(part_ss(x, n, v4), sh);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    if (v4) {
        for (int c = threadIdx.x; c < n / 4; c += blockDim.x)
            ((float4*)out)[c] = scaled4(((const float4*)x)[c], inv, w, c);
    } else {
        for (int c = threadIdx.x; c < n; c += blockDim.x) out[c] = w ? x[c] * inv * w[c] : x[c] * inv;
    }
    __syncthreads();
}

extern "C" __global__ void k_rms_norm(const float* x, const float* w, float eps, float* out, int width) {
    pdl_enter();
    __shared__ float sh[32];
    int r = blockIdx.x;
    rms_seg(x + (i64)r * width, w, eps, out + (i64)r * width, width, sh);
}

extern "C" __global__ void k_add(i64 n, const float* src, float* dst) {
    pdl_enter();
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

// Per row (blockIdx.x), two blocks working at once: y = 0 normalises q_a in place, y = 1
// normalises the latent into the cache and copies and rotates the shared key there.
extern "C" __global__ void k_mla_prepare(StepDev st, float* qa, int q_lora, const float* q_norm, const float* kva,
                                         const float* kv_norm, float eps, const float* cs, const float* sn,
                                         float* cache, int kv_lora, int rope) {
    pdl_enter();
    __shared__ float sh[32];
    __shared__ float tmp[512];
    int r = blockIdx.x, kw = kv_lora + rope, half = rope / 2;
    if (blockIdx.y == 0) {
        rms_seg(qa + (i64)r * q_lora, q_norm, eps, qa + (i64)r * q_lora, q_lora, sh);
        return;
    }
    int slot = kv_slot(st, r, (int)st.pos[r]);
    float* dst = cache + (i64)slot * kw;
    const float* src = kva + (i64)r * kw;
    rms_seg(src, kv_norm, eps, dst, kv_lora, sh);
    for (int i = threadIdx.x; i < rope; i += blockDim.x) dst[kv_lora + i] = src[kv_lora + i];
    __syncthreads();
    rope_il(dst + kv_lora, cs + (i64)r * half, sn + (i64)r * half, half, tmp);
}

// q_full[r, h, :kv_lora] = q_nope[r, h] . W_uk(h) (rows h*(nope+v) .. +nope of kv_b), and
// q_full[r, h, kv_lora:] = rope(q_rot[r, h]), for many rows (a prefill): per head a small
// GEMM, [rows x nope] x [nope x kv_lora]. Grid (heads, column tiles of AB_T, row tiles of
// AB_T); 256 threads, each 4 x 4 outputs (rows ty + 16 i, columns tx + 16 j). The head's
// weights are decoded once a tile of AB_T x AB_T into shared memory and serve AB_T rows;
// each output sums n in ascending order. (A column a thread reading its 2-byte elements
// for 8 rows at a time took ~1 ms a layer for a 64-token prompt of GLM-5's shapes.)
#define AB_T 64
extern "C" __global__ void __launch_bounds__(256) k_mla_absorb(const float* q, Mat kvb, int rows, int heads, int nope,
                                                               int rope, int vdim, int kv_lora, const float* cs,
                                                               const float* sn, float* qf) {
    pdl_enter();
    __shared__ float ws[AB_T][AB_T + 1];  // [n][column]
    __shared__ float qs[AB_T][AB_T + 1];  // [row][n]
    int h = blockIdx.x, k0 = blockIdx.y * AB_T, r0 = blockIdx.z * AB_T;
    int qw = nope + rope, kw = kv_lora + rope, half = rope / 2;
    int nr = min(AB_T, rows - r0);
    if (blockIdx.y == 0) {
        for (int idx = threadIdx.x; idx < nr * half; idx += blockDim.x) {
            int r = r0 + idx / half, i = idx % half;
            const float* src = q + ((i64)r * heads + h) * qw + nope;
            float* dst = qf + ((i64)r * heads + h) * kw + kv_lora;
            float a = src[2 * i], b = src[2 * i + 1], c = cs[(i64)r * half + i], s = sn[(i64)r * half + i];
            dst[i] = a * c - b * s;
            dst[half + i] = b * c + a * s;
        }
    }
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int wrow = h * (nope + vdim);
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    for (int n0 = 0; n0 < nope; n0 += AB_T) {
        int nn = min(AB_T, nope - n0);
        for (int i = threadIdx.x; i < AB_T * AB_T; i += blockDim.x) {
            int a = i / AB_T, c = i % AB_T;
            ws[a][c] = a < nn && k0 + c < kv_lora ? melem(kvb, wrow + n0 + a, k0 + c) : 0.f;
            qs[a][c] = a < nr && c < nn ? q[((i64)(r0 + a) * heads + h) * qw + n0 + c] : 0.f;
        }
        __syncthreads();
        for (int n = 0; n < nn; n++) {
            float wv[4], qv[4];
#pragma unroll
            for (int j = 0; j < 4; j++) wv[j] = ws[n][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++) qv[i] = qs[ty + 16 * i][n];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(qv[i], wv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int k = k0 + tx + 16 * j;
            if (r < nr && k < kv_lora) qf[((i64)(r0 + r) * heads + h) * kw + k] = acc[i][j];
        }
    }
}

// k_mla_absorb for one row (decode) with 16-byte weight loads: block (head h, ABS_KC
// latent columns); thread (g, v) sums nope rows g, g + ABS_G, .. of the V columns of its
// vector, so each thread has several loads in flight; the ABS_G groups are then summed in
// shared memory in a fixed order. (The one-column-a-thread kernel above reads its 2-byte
// elements at ~0.3 TB/s; 16 groups of 256 columns, 128 blocks for GLM-5's 64 heads, read
// at 1.6 TB/s in bf16 and 0.66 in FP8: too few loads in flight.)
#define ABS_KC 128
#define ABS_G 32
template <int KIND>
__device__ __forceinline__ void absorb_row(const float* q, const Mat& kvb, int heads, int nope, int rope, int vdim,
                                           int kv_lora, const float* cs, const float* sn, float* qf) {
    const int V = Vw<KIND>::n, TPR = ABS_KC / V;
    __shared__ float part[ABS_G][ABS_KC];
    int h = blockIdx.x, k0 = blockIdx.y * ABS_KC;
    int qw = nope + rope, kw = kv_lora + rope, half = rope / 2;
    const float* qh = q + (i64)h * qw;
    float* out = qf + (i64)h * kw;
    if (blockIdx.y == 0) {
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float a = qh[nope + 2 * i], b = qh[nope + 2 * i + 1], c = cs[i], s = sn[i];
            out[kv_lora + i] = a * c - b * s;
            out[kv_lora + half + i] = b * c + a * s;
        }
    }
    int v = threadIdx.x % TPR, g = threadIdx.x / TPR, c = k0 + v * V;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0.f;
    if (c < kv_lora) {
        int wrow = h * (nope + vdim);
#pragma unroll 4
        for (int n = g; n < nope; n += ABS_G) {
            int row = wrow + n;
            uint4 raw = __ldg((const uint4*)(kvb.w + (size_t)row * kvb.ld) + c / V);
            float w[V];
            unpack<KIND>(raw, w);
            float sc = vec_scale<KIND>(kvb, row, c), qn = qh[n];
#pragma unroll
            for (int i = 0; i < V; i++) acc[i] = fmaf(qn, KIND <= 1 ? w[i] : w[i] * sc, acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < V; i++) part[g][v * V + i] = acc[i];
    __syncthreads();
    for (int t = threadIdx.x; t < ABS_KC && k0 + t < kv_lora; t += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < ABS_G; i++) a += part[i][t];
        out[k0 + t] = a;
    }
}

// Blocks an SM: as many as 64 registers a thread allow (int4's 32 weights a vector spill
// there: one).
#define ABS_MINB(K) (K == 3 ? 1 : 1024 / (ABS_G * ABS_KC / Vw<K>::n))
#define MLA_ABSORB_ROW(K)                                                                                     \
    extern "C" __global__ void __launch_bounds__(ABS_G * ABS_KC / Vw<K>::n, ABS_MINB(K)) k_mla_absorb_row_##K( \
        const float* q, Mat kvb, int heads, int nope, int rope, int vdim, int kv_lora, const float* cs,        \
        const float* sn, float* qf) {                                                                         \
        pdl_enter();                                                                                          \
        absorb_row<K>(q, kvb, heads, nope, rope, vdim, kv_lora, cs, sn, qf);                                  \
    }
MLA_ABSORB_ROW(0)
MLA_ABSORB_ROW(1)
MLA_ABSORB_ROW(2)
MLA_ABSORB_ROW(3)
MLA_ABSORB_ROW(4)

// The end of a 4-warp online softmax: each warp's running max m, sum l and weighted values
// acc (J a lane) merged through shared memory (sm, sl, sacc), then put(d, value) for each of
// the `width` outputs, normalised.
template <int J, typename F>
__device__ __forceinline__ void merge_warps(float m, float l, const float* acc, float* sm, float* sl,
                                            float (*sacc)[J * 32], int width, F put) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
    for (int d = threadIdx.x; d < width; d += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) a += sacc[w][d] * f[w];
        put(d, a * inv);
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
    int n = sparse ? (int)cnt[r] : visible(st, r);
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
    merge_warps<J>(m, l, acc, sm, sl, sacc, kv_lora, [&](int d, float v) { lat[((i64)h * rows + r) * kv_lora + d] = v; });
}

#define MLA_ATTEND(J)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) k_mla_attend_##J(                                       \
        StepDev st, const float* qf, const float* cache, int sparse, const u32* sel, const u32* cnt, int topk,\
        int heads, int kv_lora, int kw, float scale, float* lat, int rows) {                                  \
        pdl_enter();                                                                                          \
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

// Attention of many rows (a prompt): MLA's heads share one latent key and value, so a
// block takes row blockIdx.x's heads ATT_HB * blockIdx.y .. + ATT_HB together and stages
// each tile of ATT_TP positions (selected or visible) once in shared memory for all of
// them, where the one-row kernel above has every (row, head) read every key from L2 (a
// 512-token prompt of GLM-5's shapes: ~19 GB of L2 reads a layer, 2.2 ms). 128 threads:
// warp w scores heads 4w .. 4w + 3 against position `lane` (four sums over the columns
// of each residue mod 4, ascending, then added pairwise); softmax online
// per tile; thread t sums values for heads 8 (t / 64) .. + 8 over latent columns
// 4 (t % 64) .. + 4 and 256 + 4 (t % 64) .. + 4, positions ascending. Needs kw and kv_lora
// multiples of 4, kv_lora <= 512; dynamic shared memory (ATT_HB + ATT_TP) * kwp +
// ATT_HB * ATT_TP + 2 * ATT_HB floats, kwp = kw rounded to an odd count of float4s (rows
// of K then fall in distinct banks).
#define ATT_HB 16
#define ATT_TP 32

__device__ __forceinline__ float4 fma4(float a, float4 b, float4 c) {
    return make_float4(fmaf(a, b.x, c.x), fmaf(a, b.y, c.y), fmaf(a, b.z, c.z), fmaf(a, b.w, c.w));
}

__device__ __forceinline__ float4 mul4(float4 a, float b) { return make_float4(a.x * b, a.y * b, a.z * b, a.w * b); }

__device__ __forceinline__ float lane4(float4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// 16 bytes from global to shared memory (zeros where !ok; src must still be a valid
// address): asynchronous on sm_80 on, so a thread's copies of a whole tile are in flight
// together (a load and a store each took one L2 round trip at a time); cp_wait() then
// waits for this thread's.
__device__ __forceinline__ void cp16(void* dst, const void* src, bool ok) {
#if __CUDA_ARCH__ >= 800
    unsigned long long g;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(g) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)g), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
#else
    *(float4*)dst = ok ? *(const float4*)src : make_float4(0.f, 0.f, 0.f, 0.f);
#endif
}

__device__ __forceinline__ void cp_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

extern "C" __global__ void __launch_bounds__(128, 2)
    k_mla_attend_tiles(StepDev st, const float* qf, const float* cache, int sparse, const u32* sel, const u32* cnt,
                       int topk, int heads, int kv_lora, int kw, float scale, float* lat, int rows) {
    extern __shared__ float4 att_smem[];
    __shared__ int slots[ATT_TP];
    const int kw4 = kw >> 2, kwp = (kw4 | 1) << 2;
    float* Qs = (float*)att_smem;
    float* Ks = Qs + ATT_HB * kwp;
    float* Ps = Ks + ATT_TP * kwp;
    float* Cs = Ps + ATT_HB * ATT_TP;
    float* Ls = Cs + ATT_HB;
    const int r = blockIdx.x, h0 = blockIdx.y * ATT_HB, t = threadIdx.x, warp = t >> 5, lane = t & 31;
    pdl_enter();
    for (int i = t; i < ATT_HB * kw4; i += 128) {
        int h = i / kw4, c = i - h * kw4;
        bool ok = h0 + h < heads;
        cp16((float4*)(Qs + h * kwp) + c, ok ? (const float4*)(qf + ((i64)r * heads + h0 + h) * kw) + c : (const float4*)qf, ok);
    }
    const int n = sparse ? (int)cnt[r] : visible(st, r);
    float m[4], l[4];
#pragma unroll
    for (int a = 0; a < 4; a++) m[a] = NEG_INF, l[a] = 0.f;
    const int hg = t >> 6, dg = t & 63;
    const bool lo = 4 * dg < kv_lora, hi = 256 + 4 * dg < kv_lora;
    float4 o[8][2];
#pragma unroll
    for (int a = 0; a < 8; a++) o[a][0] = o[a][1] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int base = 0; base < n; base += ATT_TP) {
        const int tn = min(ATT_TP, n - base);
        __syncthreads();  // the tile before is read
        if (t < tn) {
            int i = base + t;
            slots[t] = kv_slot(st, r, sparse ? (int)sel[(i64)r * topk + i] : i);
        }
        __syncthreads();
        for (int i = t; i < ATT_TP * kw4; i += 128) {
            int j = i / kw4, c = i - j * kw4;
            bool ok = j < tn;
            cp16((float4*)(Ks + j * kwp) + c, ok ? (const float4*)(cache + (i64)slots[j] * kw) + c : (const float4*)cache, ok);
        }
        cp_wait();
        __syncthreads();
        // Four sums a score (columns 4c + i), for independent chains of fmas.
        float4 s4[4];
#pragma unroll
        for (int a = 0; a < 4; a++) s4[a] = make_float4(0.f, 0.f, 0.f, 0.f);
        const float4* kr = (const float4*)(Ks + lane * kwp);
        const float* qw = Qs + 4 * warp * kwp;
#pragma unroll 2
        for (int c = 0; c < kw4; c++) {
            float4 k = kr[c];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                float4 q = ((const float4*)(qw + a * kwp))[c];
                s4[a].x = fmaf(q.x, k.x, s4[a].x);
                s4[a].y = fmaf(q.y, k.y, s4[a].y);
                s4[a].z = fmaf(q.z, k.z, s4[a].z);
                s4[a].w = fmaf(q.w, k.w, s4[a].w);
            }
        }
        const bool valid = lane < tn;
#pragma unroll
        for (int a = 0; a < 4; a++) {
            float x = valid ? ((s4[a].x + s4[a].y) + (s4[a].z + s4[a].w)) * scale : NEG_INF;
            float mn = fmaxf(m[a], wmax(x));
            float corr = expf(m[a] - mn), e = valid ? expf(x - mn) : 0.f;
            l[a] = l[a] * corr + wsum(e);
            m[a] = mn;
            Ps[(4 * warp + a) * ATT_TP + lane] = e;
            if (lane == 0) Cs[4 * warp + a] = corr;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < 8; a++) {
            float c = Cs[8 * hg + a];
            o[a][0] = mul4(o[a][0], c);
            o[a][1] = mul4(o[a][1], c);
        }
        for (int j = 0; j < tn; j += 4) {
            float4 p[8];
#pragma unroll
            for (int a = 0; a < 8; a++) p[a] = ((const float4*)(Ps + (8 * hg + a) * ATT_TP))[j >> 2];
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const float4* vr = (const float4*)(Ks + (j + jj) * kwp);
                float4 v0 = lo ? vr[dg] : make_float4(0.f, 0.f, 0.f, 0.f);
                float4 v1 = hi ? vr[64 + dg] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int a = 0; a < 8; a++) {
                    float w = lane4(p[a], jj);
                    o[a][0] = fma4(w, v0, o[a][0]);
                    o[a][1] = fma4(w, v1, o[a][1]);
                }
            }
        }
    }
    cp_wait();  // (a row with no positions never waited for its queries)
    if (lane == 0) {
#pragma unroll
        for (int a = 0; a < 4; a++) Ls[4 * warp + a] = l[a];
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 8; a++) {
        int h = h0 + 8 * hg + a;
        if (h >= heads) continue;
        float inv = 1.0f / Ls[8 * hg + a];
        float* out = lat + ((i64)h * rows + r) * kv_lora;
        if (lo) ((float4*)out)[dg] = mul4(o[a][0], inv);
        if (hi) ((float4*)out)[64 + dg] = mul4(o[a][1], inv);
    }
}

// ---------------------------------------------------------------------------------------
// The lightning indexer.

// Per row (blockIdx.x): block y = 0 LayerNorms and rotates the key (in k and in the
// cache); block y = 1 + h rotates head h's query. (One block rotating every head in turn
// was bound by latency, ~19 us a layer.)
extern "C" __global__ void k_dsa_prepare(StepDev st, float* q, int heads, int dim, int rope, float* k,
                                         const float* knw, const float* knb, float eps, const float* cs,
                                         const float* sn, float* cache) {
    pdl_enter();
    __shared__ float sh[32];
    __shared__ float tmp[512];
    int r = blockIdx.x, half = rope / 2;
    const float* c0 = cs + (i64)r * half;
    const float* s0 = sn + (i64)r * half;
    if (blockIdx.y > 0) {
        rope_il(q + ((i64)r * heads + blockIdx.y - 1) * dim, c0, s0, half, tmp);
        return;
    }
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
    rope_il(kr, c0, s0, half, tmp);
    float* dst = cache + (i64)kv_slot(st, r, (int)st.pos[r]) * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = kr[c];
}

// score[r, t] = sum_h (w[r, h] * heads^-0.5) * relu(q[r, h] . key[t]) * dim^-0.5 for
// t < visible(r); a warp per position, a lane per head. Grid (rows, position blocks of
// 256); dynamic shared memory: heads * (dim + 1) + heads floats.
extern "C" __global__ void __launch_bounds__(256) k_dsa_scores(StepDev st, const float* q, const float* w, int heads,
                                                               int dim, float wscale, float dscale,
                                                               const float* cache, float* work, int positions) {
    pdl_enter();
    extern __shared__ float smem[];
    float* qs = smem;
    float* ws = smem + heads * (dim + 1);
    int r = blockIdx.x;
    int v = visible(st, r);
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
    pdl_enter();
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_remaining;
    __shared__ u32 wt[32];
    int r = blockIdx.x;
    int v = visible(st, r);
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
// leading `rotary` dims); keys likewise into the cache, values copied (cache null: the
// queries only). A warp per head.
extern "C" __global__ void k_gqa_prepare(StepDev st, float* q, const float* k, const float* v, const float* qn,
                                         const float* kn, float eps, int heads, int kv_heads, int hd, int rotary,
                                         const float* cs, const float* sn, float* cache) {
    pdl_enter();
    int r = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int kvw = kv_heads * hd, width = 2 * kvw, half = rotary / 2;
    float* dst = cache ? cache + (i64)kv_slot(st, r, (int)st.pos[r]) * width : nullptr;
    const float* c0 = cs + (i64)r * half;
    const float* s0 = sn + (i64)r * half;
    for (int i = threadIdx.x; dst && i < kvw; i += blockDim.x) {
        dst[i] = k[(i64)r * kvw + i];
        dst[kvw + i] = v[(i64)r * kvw + i];
    }
    __syncthreads();
    // Without a cache (a layer reading another layer's K/V) only the queries.
    int nh = dst ? heads + kv_heads : heads;
    for (int hh = warp; hh < nh; hh += nw) {
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
                                           int hd, float scale, int window, const float* sinks, float* out) {
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
    // A window bounds what a row sees from below, by its own position.
    int v = visible(st, r), own = (int)st.pos[r] + 1;
    int start = window > 0 ? max(0, own - window) : 0;
    float m = NEG_INF, l = 0.f;
    // A sink is one more logit in the softmax with a zero value: warp 0 starts from it.
    if (sinks && warp == 0) {
        m = sinks[h];
        l = 1.f;
    }
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
    merge_warps<J>(m, l, acc, sm, sl, sacc, hd, [&](int d, float v) { out[((i64)r * heads + h) * hd + d] = v; });
}

#define GQA_ATTEND(J)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) k_gqa_attend_##J(StepDev st, const float* q,             \
                                                                       const float* cache, int heads,          \
                                                                       int kv_heads, int hd, float scale,      \
                                                                       int window, const float* sinks,         \
                                                                       float* out) {                           \
        pdl_enter();                                                                                           \
        gqa_attend<J>(st, q, cache, heads, kv_heads, hd, scale, window, sinks, out);                          \
    }
GQA_ATTEND(1)
GQA_ATTEND(2)
GQA_ATTEND(4)
GQA_ATTEND(8)
GQA_ATTEND(16)

