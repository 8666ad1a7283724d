// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// A sampled token where the logits are (Backend::pick_rows; the definition and its host
// reference: src/draw.rs). A block per row. The top-k and top-p cuts are selects: a first
// histogram bins the candidates by their distance below the row's top value (1/8 apart:
// bin 0 holds the top), then a radix select over 64-bit order keys (value, then lower id)
// in 8-bit digits runs inside the bin the cut falls in. Counts and fixed-point masses are
// summed as integers (the same in any order), in replicated histograms so that a flat row
// does not queue on a few shared words. The draw is the kept candidate with the largest
// value + Gumbel noise (f64, as the host). Greedy rows take the argmax.

typedef unsigned long long u64;

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 noise_bits(u64 key, u32 token) {
    return mix64(key + ((u64)token + 1ull) * 0x9E3779B97F4A7C15ull) >> 11;
}

// -ln(-ln(u)), u = (n + 0.5) / 2^53: the definition.
__device__ __forceinline__ double gumbel(u64 key, u32 token) {
    double u = ((double)noise_bits(key, token) + 0.5) * (1.0 / 9007199254740992.0);
    return -log(-log(u));
}

__device__ __forceinline__ u64 order_key(float v, u32 id) {
    u32 b = __float_as_uint(v);
    u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)o << 32) | (u64)(~id);
}

#define MASS_ONE 1099511627776.0  // 2^40
// exp(-28) * 2^40 < 1: a candidate this far below the top has no mass.
#define MASSLESS 28.f

// The mass of a candidate `u` = vmax - v below the top. u is -(v - vmax) exactly (rounding
// is symmetric), so this is the host's exp(v - vmax) in 2^-40 units.
__device__ __forceinline__ u64 mass_below(float u) {
    return (u64)(exp(-(double)u) * MASS_ONE);
}

// The select's first histogram bins a candidate `u` below the top 1/8 apart (the last bin
// holds the rest); its second splits the chosen bin 256 ways. Both rise as the key falls.
__device__ __forceinline__ int bin_of(float u) {
    return (int)fminf(u * 8.f, 255.f);
}

__device__ __forceinline__ int sub_of(float u, int bin) {
    return (int)fminf(u * 2048.f - (float)(bin * 256), 255.f);
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

#define DRAW_REPS 8

// A chosen bucket of at most this many candidates is ranked in shared memory.
#define DRAW_LIST 1024

struct DrawShared {
    u64 mass[DRAW_REPS][256];
    u32 count[DRAW_REPS][256];
    u64 list_key[DRAW_LIST], list_w[DRAW_LIST];
    double reds[32];
    int redi[32];
    u64 prefix, need;
    int bin, sub, chosen, listed;
    int state;  // 0 selecting, 1 rank the chosen bucket, 2 found
};

__device__ __forceinline__ void hist_clear(DrawShared& s) {
    for (int i = threadIdx.x; i < DRAW_REPS * 256; i += blockDim.x) (&s.mass[0][0])[i] = 0, (&s.count[0][0])[i] = 0;
}

__device__ __forceinline__ void hist_add(DrawShared& s, int b, bool by_mass, u64 m) {
    int r = (threadIdx.x >> 5) & (DRAW_REPS - 1);
    atomicAdd(&s.count[r][b], 1u);
    if (by_mass) atomicAdd(&s.mass[r][b], m);
}

// The replicas summed into the first (between two barriers).
__device__ __forceinline__ void hist_merge(DrawShared& s) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        u64 m = 0;
        u32 n = 0;
        for (int r = 0; r < DRAW_REPS; r++) m += s.mass[r][b], n += s.count[r][b];
        s.mass[0][b] = m, s.count[0][b] = n;
    }
}

// (Thread 0.) The bucket where the weight summed from the top first reaches s.need, which
// becomes what is left to reach inside it; -1 where the whole does not reach it.
__device__ int hist_pick(DrawShared& s, bool by_mass) {
    u64 acc = 0, want = s.need;
    for (int b = 0; b < 256; b++) {
        u64 w = by_mass ? s.mass[0][b] : (u64)s.count[0][b];
        if (acc + w >= want) {
            s.need = want - acc;
            return b;
        }
        acc += w;
    }
    return -1;
}

// A candidate's bucket (0 holds the top) at a level of the select, -1 where it is outside
// the buckets chosen before: level 0 its bin, 1 its sub-bin in the chosen bin, then the
// key's 8-bit digits from the top (level 2: bits 56..63) in the chosen sub-bin.
__device__ __forceinline__ int bucket_at(int level, float u, u64 k, int bin, int sub, u64 prefix) {
    int b = bin_of(u);
    if (level == 0) return b;
    if (b != bin) return -1;
    int sb = sub_of(u, bin);
    if (level == 1) return sb;
    if (sb != sub) return -1;
    int shift = 72 - 8 * level;
    if (shift < 56 && (k >> (shift + 8)) != (prefix >> (shift + 8))) return -1;
    return 255 - (int)((k >> shift) & 255ull);
}

// The order key of the candidate where the weight (by_mass: masses, else counts) summed
// from the top, over candidates with key >= lo, first reaches `need` (>= 1); with top_p <
// 1, need is top-p's target of the total mass. `lo` where the whole falls short. Levels of
// histograms narrow it down until the chosen bucket is small enough to rank.
__device__ u64 draw_select(const float* xr, int width, float t, float vmax, u64 lo, bool by_mass, float top_p,
                           u64 need, DrawShared& s) {
    // A candidate of the select (massless ones weigh nothing in a select by mass).
    auto in = [&](int c, float& u, u64& k) {
        float v = xr[c] / t;
        u = vmax - v, k = order_key(v, (u32)c);
        return k >= lo && !(by_mass && u >= MASSLESS);
    };
    auto weight = [&](float u) { return by_mass ? mass_below(u) : 1ull; };
    __syncthreads();  // every thread has read the select before's result
    if (threadIdx.x == 0) s.bin = 0, s.sub = 0, s.prefix = 0, s.state = 0, s.need = need;
    int level = 0;
    for (;; level++) {
        hist_clear(s);
        __syncthreads();
        const int bin = s.bin, sub = s.sub;
        const u64 prefix = s.prefix;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            float u;
            u64 k;
            if (!in(c, u, k)) continue;
            int b = bucket_at(level, u, k, bin, sub, prefix);
            if (b >= 0) hist_add(s, b, by_mass, weight(u));
        }
        __syncthreads();
        hist_merge(s);
        __syncthreads();
        if (threadIdx.x == 0) {
            if (level == 0 && top_p < 1.f) {
                u64 z = 0;
                for (int b = 0; b < 256; b++) z += s.mass[0][b];
                u64 target = (u64)ceil((double)top_p * (double)z);
                s.need = target > 0 ? target : 1;
            }
            int b = hist_pick(s, by_mass);
            if (b < 0) {
                s.prefix = lo, s.state = 2;  // only where level 0 falls short
            } else {
                if (level == 0) s.bin = b;
                else if (level == 1) s.sub = b;
                else s.prefix = prefix | ((u64)(255 - b) << (72 - 8 * level));
                s.chosen = b, s.listed = 0;
                s.state = level == 9 ? 2 : s.count[0][b] <= DRAW_LIST ? 1 : 0;
            }
        }
        __syncthreads();
        if (s.state != 0) break;
    }
    if (s.state == 1) {
        // The chosen bucket's candidates into shared memory; the one whose own weight
        // takes the weight of those above it to what is left is the cut.
        const int bin = s.bin, sub = s.sub, chosen = s.chosen;
        const u64 prefix = s.prefix;
        for (int c = threadIdx.x; c < width; c += blockDim.x) {
            float u;
            u64 k;
            if (!in(c, u, k) || bucket_at(level, u, k, bin, sub, prefix) != chosen) continue;
            int i = atomicAdd(&s.listed, 1);
            s.list_key[i] = k, s.list_w[i] = weight(u);
        }
        __syncthreads();
        const int n = s.listed;
        const u64 want = s.need;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            u64 k = s.list_key[i], above = 0;
            for (int j = 0; j < n; j++) above += s.list_key[j] > k ? s.list_w[j] : 0;
            if (above < want && want <= above + s.list_w[i]) s.prefix = k;
        }
        __syncthreads();
    }
    return s.prefix;
}

// The draw from a row whose argmax is `top` (its value / t: vmax); where nothing is kept
// (a min-p above 1), the argmax, as the host.
__device__ u32 draw_row(const float* xr, int width, u32 top, float vmax, DrawDev d, DrawShared& s) {
    u64 cut = 0;
    if (d.top_k > 0 && (int)d.top_k < width) cut = draw_select(xr, width, d.t, vmax, 0, false, 1.f, d.top_k, s);
    if (d.top_p < 1.f) cut = draw_select(xr, width, d.t, vmax, cut, true, d.top_p, 1, s);
    u64 floor_m = (u64)ceil((double)d.min_p * MASS_ONE);
    if (floor_m < 1) floor_m = 1;
    // mass >= floor_m, decided by the exact mass only near the boundary.
    double edge = log((double)floor_m / MASS_ONE);
    float below = (float)(edge - 1e-3), above = (float)(edge + 1e-3);
    auto kept = [&](int c, float& v) {
        v = xr[c] / d.t;
        if (order_key(v, (u32)c) < cut) return false;
        float dv = v - vmax;
        return dv > above || (dv >= below && mass_below(-dv) >= floor_m);
    };
    double best = -1.0 / 0.0;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float v;
        if (!kept(c, v)) continue;
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
    return bi == 0x7fffffff ? top : (u32)bi;
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
    // Dividing by t > 0 keeps the order: the top scaled value is the argmax's.
    u32 pick = d.t == 0.f || (g & 0x80000000u) ? g : draw_row(xr, width, g, xr[g] / d.t, d, s);
    if (threadIdx.x == 0) picks[blockIdx.x] = pick;
}
