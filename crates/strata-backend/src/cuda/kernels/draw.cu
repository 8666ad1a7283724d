// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// A sampled token where the logits are (Backend::pick_rows; the definition and its host
// reference: src/draw.rs). A block per row: the row's largest scaled value, a radix select
// of the top-k and top-p cuts over 64-bit order keys (value, then lower id) in 8-bit digits,
// counts and fixed-point masses summed as integers (the same in any order), then the
// kept candidate with the largest value + Gumbel noise. Greedy rows take the argmax.

typedef unsigned long long u64;

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ double gumbel(u64 key, u32 token) {
    u64 h = mix64(key + ((u64)token + 1ull) * 0x9E3779B97F4A7C15ull);
    double u = ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    return -log(-log(u));
}

__device__ __forceinline__ u64 order_key(float v, u32 id) {
    u32 b = __float_as_uint(v);
    u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(~id);
}

#define MASS_ONE 1099511627776.0  // 2^40

__device__ __forceinline__ u64 mass_of(float v, float vmax) {
    return (u64)(exp((double)(v - vmax)) * MASS_ONE);
}

struct DrawDev {
    float t, top_p, min_p;
    u32 top_k;
    u64 key;
};

__device__ __forceinline__ DrawDev load_draw(const u32* w) {
    DrawDev d;
    d.t = __uint_as_float(w[0]);
    d.top_k = w[1];
    d.top_p = __uint_as_float(w[2]);
    d.min_p = __uint_as_float(w[3]);
    d.key = (u64)w[4] | ((u64)w[5] << 32);
    return d;
}

// Block reductions of 1024 threads through 32 words of shared memory (`sh`), the result
// in every thread.
__device__ __forceinline__ float block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
    for (int k = 1; k < (int)(blockDim.x >> 5); k++) v = fmaxf(v, sh[k]);
    return v;
}

__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = 0;
    for (int k = 0; k < (int)(blockDim.x >> 5); k++) v += sh[k];
    return v;
}

struct DrawShared {
    u64 mass[256];
    u64 maxkey[256];
    u32 count[256];
    u64 red[32];
    float redf[32];
    double reds[32];
    int redi[32];
    u64 prefix, need;
    int done;
};

// The order key of the candidate where the weight (by_mass: masses, else counts) summed
// from the top, over candidates with key >= lo, first reaches `need` (>= 1).
__device__ u64 draw_select(const float* xr, int width, float t, float vmax, u64 lo, bool by_mass, u64 need,
                           DrawShared& s) {
    __syncthreads();  // every thread has read the select before's result
    if (threadIdx.x == 0) s.prefix = 0, s.need = need, s.done = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s.mass[b] = 0, s.maxkey[b] = 0, s.count[b] = 0;
        __syncthreads();
        u64 prefix = s.prefix;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            float v = xr[c] / t;
            u64 k = order_key(v, (u32)c);
            if (k < lo || (shift < 56 && (k >> (shift + 8)) != (prefix >> (shift + 8)))) continue;
            int dg = (int)((k >> shift) & 255ull);
            atomicAdd(&s.count[dg], 1u);
            atomicMax(&s.maxkey[dg], k);
            if (by_mass) atomicAdd(&s.mass[dg], mass_of(v, vmax));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 acc = 0, want = s.need;
            for (int b = 255; b >= 0; b--) {
                u64 w = by_mass ? s.mass[b] : (u64)s.count[b];
                if (acc + w >= want) {
                    s.need = want - acc;
                    // A bucket of one candidate is that candidate.
                    if (s.count[b] == 1) s.prefix = s.maxkey[b], s.done = 1;
                    else s.prefix = prefix | ((u64)b << shift);
                    break;
                }
                acc += w;
            }
        }
        __syncthreads();
        if (s.done) break;
    }
    return s.prefix;
}

__device__ u32 draw_row(const float* xr, int width, DrawDev d, DrawShared& s) {
    // The largest scaled value (the values are finite: checked by the caller).
    float vmax = NEG_INF;
    for (int c = threadIdx.x; c < width; c += blockDim.x) vmax = fmaxf(vmax, xr[c] / d.t);
    vmax = block_max(vmax, s.redf);
    u64 cut = 0;
    if (d.top_k > 0 && (int)d.top_k < width) cut = draw_select(xr, width, d.t, vmax, 0, false, d.top_k, s);
    if (d.top_p < 1.f) {
        u64 z = 0;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            float v = xr[c] / d.t;
            if (order_key(v, (u32)c) >= cut) z += mass_of(v, vmax);
        }
        z = block_sum_u64(z, s.red);
        u64 target = (u64)ceil((double)d.top_p * (double)z);
        cut = draw_select(xr, width, d.t, vmax, cut, true, target > 0 ? target : 1, s);
    }
    u64 floor_m = (u64)ceil((double)d.min_p * MASS_ONE);
    if (floor_m < 1) floor_m = 1;
    double best = -1.0 / 0.0;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float v = xr[c] / d.t;
        if (order_key(v, (u32)c) < cut || mass_of(v, vmax) < floor_m) continue;
        double sc = (double)v + gumbel(d.key, (u32)c);
        if (sc > best) best = sc, bi = c;  // a thread's columns rise: ties keep the lower
    }
    for (int o = 16; o > 0; o >>= 1) {
        double ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) s.reds[threadIdx.x >> 5] = best, s.redi[threadIdx.x >> 5] = bi;
    __syncthreads();
    best = s.reds[0], bi = s.redi[0];
    for (int k = 1; k < (int)(blockDim.x >> 5); k++)
        if (s.reds[k] > best || (s.reds[k] == best && s.redi[k] < bi)) best = s.reds[k], bi = s.redi[k];
    return (u32)bi;
}

// Each row's pick (Backend::pick_rows with draws: 6 words a row, src/draw.rs): a draw of
// temperature > 0 samples, else the greedy pick; NON_FINITE | j for the lowest non-finite
// j either way. A block of 1024 per row.
extern "C" __global__ void __launch_bounds__(1024) k_pick_rows(const float* x, int width, const u32* draws, u32* picks) {
    pdl_enter();
    __shared__ DrawShared s;
    __shared__ u32 first;
    const float* xr = x + (i64)blockIdx.x * width;
    DrawDev d = load_draw(draws + 6 * blockIdx.x);
    // The greedy pick also finds a non-finite value.
    u32 g = greedy_pick(xr, width);
    if (threadIdx.x == 0) first = g;
    __syncthreads();
    g = first;
    u32 pick = d.t == 0.f || (g & 0x80000000u) ? g : draw_row(xr, width, d, s);
    if (threadIdx.x == 0) picks[blockIdx.x] = pick;
}
