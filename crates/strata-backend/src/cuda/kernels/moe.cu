// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// MoE: noaux_tc routing and the combination of expert outputs.

// The k largest of vals[..n] (shared memory; ties to the lower id, NaN as -inf), best
// first, into chosen[..k] (shared; -1 past n), by a whole block: each element's rank is
// the count of elements ahead of it, so one pass replaces k rounds of block-wide argmax
// (which cost two barriers each: ~11 us for a top-8 router).
__device__ void block_topk(const float* vals, int n, int k, int* chosen) {
    for (int i = threadIdx.x; i < k; i += blockDim.x) chosen[i] = -1;
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        float v = vals[e];
        if (v != v) v = NEG_INF;
        int rank = 0;
        for (int j = 0; j < n && rank < k; j++) {
            float u = vals[j];
            if (u != u) u = NEG_INF;
            rank += (u > v || (u == v && j < e)) ? 1 : 0;
        }
        if (rank < k) chosen[rank] = e;
    }
    __syncthreads();
}

// One row by a block of 256 threads: s = sigmoid(logits l); choice = s + bias, masked to
// the best topk_group groups (a group's score: the sum of its two best); the top k of
// choice (ties to the lower id), best first, into ids; weights s at those ids, normalised
// (+1e-20) if asked, times the scaling, into wts. l is read through L2 (k_route_one reads
// what other blocks of its grid wrote). Dynamic shared memory: 2n floats + n_group ints.
__device__ __forceinline__ void route_row(const float* l, int n, const float* bias, int k, int n_group,
                                          int topk_group, int norm, float scaling, u32* ids, float* wts) {
    extern __shared__ float route_smem[];
    float* s = route_smem;
    float* ch = route_smem + n;
    int* keep = (int*)(ch + n);
    __shared__ int chosen[64];
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        float sv = 1.0f / (1.0f + expf(-__ldcg(l + e)));
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
    block_topk(ch, n, k, chosen);
    // The weights' sum by one thread in rank order, from shared memory (read back from the
    // outputs in global memory, each step waited on the last: ~3 us of a decode token).
    __shared__ float denom;
    if (threadIdx.x == 0) {
        float d = 0.f;
        if (norm) {
            for (int i = 0; i < k; i++) d += s[chosen[i]];
            d += 1e-20f;
        }
        denom = d;
    }
    __syncthreads();
    if (threadIdx.x < k) {
        int i = threadIdx.x;
        float w = s[chosen[i]];
        if (norm) w /= denom;
        ids[i] = (u32)chosen[i];
        wts[i] = w * scaling;
    }
}

// Per row r (a block each): route_row.
extern "C" __global__ void __launch_bounds__(256) k_route(const float* logits, int n, const float* bias, int k,
                                                          int n_group, int topk_group, int norm, float scaling,
                                                          u32* ids, float* wts) {
    pdl_enter();
    i64 r = blockIdx.x;
    route_row(logits + r * n, n, bias, k, n_group, topk_group, norm, scaling, ids + r * k, wts + r * k);
}

// One row (decode) in one launch where there were two: the router's logits computed as
// k_linear_1 computes them (the same blocks, the same sums), then the grid's last block
// to finish routes them as k_route does, so ids and weights are the same bit for bit.
// `done` counts finished blocks (zero between launches: the last block resets it).
extern "C" __global__ void __launch_bounds__(256) k_route_one(Mat m, const float* x, float* logits, int split,
                                                              u32* done, const float* bias, int k, int n_group,
                                                              int topk_group, int norm, float scaling, u32* ids,
                                                              float* wts) {
    pdl_enter();
    linear_small<1>(m, 0, 0, x, 0, m.cols, 1, m.rows, logits, m.rows, 0, 0, 0, nullptr, split, blockIdx.x);
    __shared__ int last;
    __threadfence();  // this block's logits visible to the block that routes
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *done = 0;
    route_row(logits, m.rows, bias, k, n_group, topk_group, norm, scaling, ids, wts);
}

// out[r] += sum over r's experts in ascending id of w * y[src[r, rank]] (+ y[shared + r],
// times sigmoid(sgate[r]) where sgate is given).
// Grid (rows, column blocks): each thread one column of a row, its experts summed in
// ascending id (the order every expert path shares).
extern "C" __global__ void k_combine(int hidden, int k, const u32* ids, const float* w, const u32* src, const float* y,
                                     int shared, const float* sgate, float* out) {
    pdl_enter();
    __shared__ int order[64];
    __shared__ u32 rid[64];
    int r = blockIdx.x;
    // Each rank's place in ascending id order (equal ids keep their rank order), found by
    // its own thread in one pass over the row's ids (one thread sorting them read the ids
    // from memory ~k^2/2 times in a chain: ~4 us of a decode token's combine).
    if (threadIdx.x < k) rid[threadIdx.x] = ids[(i64)r * k + threadIdx.x];
    __syncthreads();
    if (threadIdx.x < k) {
        u32 v = rid[threadIdx.x];
        int at = 0;
        for (int j = 0; j < k; j++) at += rid[j] < v || (rid[j] == v && j < (int)threadIdx.x);
        order[at] = threadIdx.x;
    }
    __syncthreads();
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float acc = 0.f;
    for (int i = 0; i < k; i++) {
        int rank = order[i];
        i64 at = src[(i64)r * k + rank];
        acc = fmaf(w[(i64)r * k + rank], y[at * hidden + c], acc);
    }
    if (shared >= 0) {
        float s = y[((i64)shared + r) * hidden + c];
        acc += sgate ? 1.0f / (1.0f + expf(-sgate[r])) * s : s;
    }
    out[(i64)r * hidden + c] += acc;
}

// Softmax routing, per row (256 threads): p = softmax(logits); the top k of p (ties to
// the lower id), best first; weights p at those ids (over their sum where renorm), times
// scale[id]. Dynamic shared memory: n floats.
extern "C" __global__ void __launch_bounds__(256) k_route_softmax(const float* logits, int n, const float* scale,
                                                                  int k, int renorm, u32* ids, float* wts) {
    pdl_enter();
    extern __shared__ float p[];
    __shared__ float sh[32];
    __shared__ int chosen[64];
    int r = blockIdx.x;
    const float* l = logits + (i64)r * n;
    float m = NEG_INF;
    for (int e = threadIdx.x; e < n; e += blockDim.x) m = fmaxf(m, l[e]);
    m = bmax(m, sh);
    float sum = 0.f;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        p[e] = expf(l[e] - m);
        sum += p[e];
    }
    sum = bsum(sum, sh);
    float inv = 1.0f / sum;
    for (int e = threadIdx.x; e < n; e += blockDim.x) p[e] *= inv;
    __syncthreads();
    block_topk(p, n, k, chosen);
    if (threadIdx.x == 0) {
        u32* oi = ids + (i64)r * k;
        float* ow = wts + (i64)r * k;
        float total = 0.f;
        for (int i = 0; i < k; i++) total += p[chosen[i]];
        for (int i = 0; i < k; i++) {
            oi[i] = (u32)chosen[i];
            ow[i] = (renorm ? p[chosen[i]] / total : p[chosen[i]]) * scale[chosen[i]];
        }
    }
}
