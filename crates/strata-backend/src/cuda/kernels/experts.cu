// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// Gated experts, grouped: one launch computes h = act(gate x) * up x for every task's
// rows, a second y = down h. A task's blocks start at blk1 (pass 1) / blk2 (pass 2); each
// warp one output, its rows in chunks of R.

struct Task {
    Mat g, u, d;
    i64 h_off;  // first f32 of this task's h rows
    int nrows, rows_off, out_row, blk1, blk2, act;  // act: see gate_act
};

__device__ __forceinline__ int find_task(const Task* t, int n, int blk, bool second) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        int start = second ? t[mid].blk2 : t[mid].blk1;
        if (start <= blk) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <int R>
__device__ __forceinline__ void experts_up(const Task* tasks, int ntasks, const u32* rowidx, const float* x,
                                           int hidden, float* h) {
    int ti = find_task(tasks, ntasks, blockIdx.x, false);
    const Task& T = tasks[ti];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = (blockIdx.x - T.blk1) * 8 + warp;
    int inter = T.g.rows;
    if (o >= inter) return;
    for (int r0 = 0; r0 < T.nrows; r0 += R) {
        int nr = min(R, T.nrows - r0);
        const float* xr[R];
        float ag[R], au[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            ag[j] = 0.f;
            au[j] = 0.f;
            xr[j] = x + (i64)rowidx[T.rows_off + r0 + (j < nr ? j : 0)] * hidden;
        }
        dot_any<R>(T.g, o, xr, nr, ag, lane, 0, 1);
        dot_any<R>(T.u, o, xr, nr, au, lane, 0, 1);
#pragma unroll
        for (int j = 0; j < R; j++) {
            float g = wsum(ag[j]), u = wsum(au[j]);
            if (lane == 0 && j < nr) h[T.h_off + (i64)(r0 + j) * inter + o] = gate_act(g, T.act) * u;
        }
    }
}

template <int R>
__device__ __forceinline__ void experts_down(const Task* tasks, int ntasks, const float* h, int hidden, float* y) {
    int ti = find_task(tasks, ntasks, blockIdx.x, true);
    const Task& T = tasks[ti];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = (blockIdx.x - T.blk2) * 8 + warp;
    if (o >= hidden) return;
    int inter = T.d.cols;
    for (int r0 = 0; r0 < T.nrows; r0 += R) {
        int nr = min(R, T.nrows - r0);
        const float* xr[R];
        float acc[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            acc[j] = 0.f;
            xr[j] = h + T.h_off + (i64)(r0 + (j < nr ? j : 0)) * inter;
        }
        dot_any<R>(T.d, o, xr, nr, acc, lane, 0, 1);
#pragma unroll
        for (int j = 0; j < R; j++) {
            float v = wsum(acc[j]);
            if (lane == 0 && j < nr) y[(i64)(T.out_row + r0 + j) * hidden + o] = v;
        }
    }
}

// The same as tiles (STRATA_CUDA_EXPERT_TILES=1, a comparison): a block computes a tile of
// XT_O outputs of one task for all its rows (up to XT_R), the weights decoded a chunk of
// XT_K columns at a time into shared memory and shared by the rows. Thread (to, tr) sums
// outputs o0 + to + 16 j (j < 4) of rows tr and tr + 16 over the columns in ascending
// order. Measured on a 64-token prompt of the GLM-5 slice (H200): int4 experts 12.6 ->
// 7.2 ms, bf16 4.4 -> 6.4 ms (bound by shared-memory loads).
#define XT_O 64
#define XT_K 64
#define XT_R 32

// acc[n][i][j] = (m[n] . x)[output o0 + to + 16 j] for row tr + 16 i (x row xrow[r], r <
// nrows) of NM matrices of one shape [nout, cols].
template <int NM>
__device__ __forceinline__ void expert_tile(const Mat* const* m, int o0, const float* const* xrow, int nrows,
                                            float (*acc)[2][4]) {
    __shared__ float ws[NM][XT_O][XT_K + 1];
    __shared__ float xs[XT_R][XT_K + 1];
    int to = threadIdx.x & 15, tr = threadIdx.x >> 4;
    int nout = m[0]->rows, cols = m[0]->cols;
    bool two = nrows > 16;  // (block-uniform)
#pragma unroll
    for (int n = 0; n < NM; n++)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[n][i][j] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += XT_K) {
        int kn = min(XT_K, cols - k0);
        for (int i = threadIdx.x; i < XT_O * XT_K; i += blockDim.x) {
            int a = i / XT_K, c = i % XT_K;
            bool ok = o0 + a < nout && c < kn;
#pragma unroll
            for (int n = 0; n < NM; n++) ws[n][a][c] = ok ? melem(*m[n], o0 + a, k0 + c) : 0.f;
        }
        for (int i = threadIdx.x; i < XT_R * XT_K; i += blockDim.x) {
            int a = i / XT_K, c = i % XT_K;
            xs[a][c] = a < nrows && c < kn ? xrow[a][k0 + c] : 0.f;
        }
        __syncthreads();
        for (int c = 0; c < kn; c++) {
            float x0 = xs[tr][c], x1 = two ? xs[tr + 16][c] : 0.f;
#pragma unroll
            for (int n = 0; n < NM; n++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float w = ws[n][to + 16 * j][c];
                    acc[n][0][j] = fmaf(w, x0, acc[n][0][j]);
                    if (two) acc[n][1][j] = fmaf(w, x1, acc[n][1][j]);
                }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(256) k_experts_up_tile(const Task* tasks, int ntasks, const u32* rowidx,
                                                                    const float* x, int hidden, float* h) {
    pdl_enter();
    __shared__ const float* xrow[XT_R];
    const Task& T = tasks[find_task(tasks, ntasks, blockIdx.x, false)];
    int o0 = (blockIdx.x - T.blk1) * XT_O, inter = T.g.rows;
    if (threadIdx.x < XT_R)
        xrow[threadIdx.x] = x + (i64)rowidx[T.rows_off + min((int)threadIdx.x, T.nrows - 1)] * hidden;
    __syncthreads();
    const Mat* m[2] = {&T.g, &T.u};
    float acc[2][2][4];
    expert_tile<2>(m, o0, xrow, T.nrows, acc);
    int to = threadIdx.x & 15, tr = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = tr + 16 * i, o = o0 + to + 16 * j;
            if (r < T.nrows && o < inter) h[T.h_off + (i64)r * inter + o] = gate_act(acc[0][i][j], T.act) * acc[1][i][j];
        }
}

extern "C" __global__ void __launch_bounds__(256) k_experts_down_tile(const Task* tasks, int ntasks, const float* h,
                                                                      int hidden, float* y) {
    pdl_enter();
    __shared__ const float* xrow[XT_R];
    const Task& T = tasks[find_task(tasks, ntasks, blockIdx.x, true)];
    int o0 = (blockIdx.x - T.blk2) * XT_O, inter = T.d.cols;
    if (threadIdx.x < XT_R) xrow[threadIdx.x] = h + T.h_off + (i64)min((int)threadIdx.x, T.nrows - 1) * inter;
    __syncthreads();
    const Mat* m[1] = {&T.d};
    float acc[1][2][4];
    expert_tile<1>(m, o0, xrow, T.nrows, acc);
    int to = threadIdx.x & 15, tr = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = tr + 16 * i, o = o0 + to + 16 * j;
            if (r < T.nrows && o < hidden) y[(i64)(T.out_row + r) * hidden + o] = acc[0][i][j];
        }
}

// One row per task (decode): a warp computes UP_OUTS outputs of gate and up (2 x UP_OUTS
// matrix rows sharing x), or DOWN_OUTS outputs of down; blocks of 8 warps. int4 matrices
// of whole 128-column chunks go through tensor-core tiles instead (tiles.cu), the block's
// outputs the same.
#define UP_OUTS 2
#define DOWN_OUTS 4
// Blocks an SM the one-row expert kernels are compiled for (registers capped to fit):
// left to itself the compiler gives them ~170 registers, one block (8 warps) an SM, too
// few loads in flight; two blocks read 1.15-1.35x faster (bf16, int8, int4 and FP8).
#ifndef EXPERT_MINB
#define EXPERT_MINB 2
#endif

extern "C" __global__ void __launch_bounds__(256, EXPERT_MINB) k_experts_up_row(const Task* tasks, int ntasks, const u32* rowidx,
                                                                   const float* x, int hidden, float* h) {
    pdl_enter();
    int ti = find_task(tasks, ntasks, blockIdx.x, false);
    const Task& T = tasks[ti];
#if TILE_MMA
    if (i4_tiles(T.g) && i4_tiles(T.u)) {
        i4_up_block(T.g, T.u, (blockIdx.x - T.blk1) * 8 * UP_OUTS, x + (i64)rowidx[T.rows_off] * hidden, T.act,
                    h + T.h_off);
        return;
    }
#endif
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o0 = ((blockIdx.x - T.blk1) * 8 + warp) * UP_OUTS;
    int inter = T.g.rows;
    if (o0 >= inter) return;
    const Mat* m[2 * UP_OUTS];
    int row[2 * UP_OUTS];
    float acc[2 * UP_OUTS];
#pragma unroll
    for (int k = 0; k < UP_OUTS; k++) {
        int o = min(o0 + k, inter - 1);
        m[k] = &T.g;
        m[UP_OUTS + k] = &T.u;
        row[k] = row[UP_OUTS + k] = o;
        acc[k] = acc[UP_OUTS + k] = 0.f;
    }
    dot_rows<2 * UP_OUTS>(m, row, x + (i64)rowidx[T.rows_off] * hidden, acc, lane);
#pragma unroll
    for (int k = 0; k < UP_OUTS; k++) {
        float g = wsum(acc[k]), u = wsum(acc[UP_OUTS + k]);
        if (lane == 0 && o0 + k < inter) h[T.h_off + o0 + k] = gate_act(g, T.act) * u;
    }
}

extern "C" __global__ void __launch_bounds__(256, EXPERT_MINB) k_experts_down_row(const Task* tasks, int ntasks, const float* h,
                                                                     int hidden, float* y) {
    pdl_enter();
    int ti = find_task(tasks, ntasks, blockIdx.x, true);
    const Task& T = tasks[ti];
#if TILE_MMA
    if (i4_tiles(T.d)) {
        i4_down_block(T.d, (blockIdx.x - T.blk2) * 8 * DOWN_OUTS, h + T.h_off, y + (i64)T.out_row * hidden);
        return;
    }
#endif
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o0 = ((blockIdx.x - T.blk2) * 8 + warp) * DOWN_OUTS;
    if (o0 >= hidden) return;
    float acc[DOWN_OUTS];
    warp_outputs<DOWN_OUTS>(T.d, 0, o0, hidden, h + T.h_off, acc, lane);
#pragma unroll
    for (int k = 0; k < DOWN_OUTS; k++)
        if (lane == 0 && o0 + k < hidden) y[(i64)T.out_row * hidden + o0 + k] = acc[k];
}

#define EXPERTS(R)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) k_experts_up_##R(const Task* tasks, int ntasks,         \
                                                                       const u32* rowidx, const float* x,     \
                                                                       int hidden, float* h) {                \
        pdl_enter();                                                                                          \
        experts_up<R>(tasks, ntasks, rowidx, x, hidden, h);                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) k_experts_down_##R(const Task* tasks, int ntasks,       \
                                                                         const float* h, int hidden,          \
                                                                         float* y) {                          \
        pdl_enter();                                                                                          \
        experts_down<R>(tasks, ntasks, h, hidden, y);                                                         \
    }
EXPERTS(8)
