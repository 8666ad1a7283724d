// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// Gated experts, grouped: one launch computes h = act(gate x) * up x for every task's
// rows, a second y = down h. A task's blocks start at blk1 (pass 1) / blk2 (pass 2); each
// warp one output, its rows in chunks of R.

struct Task {
    Mat g, u, d;
    i64 h_off;  // first f32 of this task's h rows
    const float *bg, *bu, *bd;  // the expert's biases (gate, up, down), or null
    int nrows, rows_off, out_row, blk1, blk2, act;  // act: see act_mul
    int tiles1, tiles2;  // the many-row passes take the tensor-core tiles (expert_tiles.cu)
    int rounds1, rounds2;  // one-row kernels: rounds of 16 (up) / 32 (down) outputs a block (cuda/experts.rs)
    float alpha, limit;  // act 2's parameters (act_mul)
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
            if (T.bg) {
                g += T.bg[o];
                u += T.bu[o];
            }
            if (lane == 0 && j < nr) h[T.h_off + (i64)(r0 + j) * inter + o] = act_mul(g, u, T.act, T.alpha, T.limit);
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
            if (T.bd) v += T.bd[o];
            if (lane == 0 && j < nr) y[(i64)(T.out_row + r0 + j) * hidden + o] = v;
        }
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
#define EXPERT_MINB 2

// A decode row's tasks straight from its routed ids (cuda/dispatch.rs), with no task table:
// task t < k is expert ids[t] of descs ((gate, up, down) each), its h at t * hstride, its
// output row t, blocks1 / blocks2 blocks a task (rounds1 / rounds2 rounds of outputs a block);
// the blocks after those take `shared` (k = 0: a lone task, such as a dense MLP's, with
// no table to upload). Every task reads row 0. Used where the kernels get no table (tasks
// null); all zeros otherwise.
struct ById {
    const Mat* descs;
    const u32* ids;
    int n, k, hstride, blocks1, blocks2, rounds1, rounds2;
    Task shared;
};

// The block's task: the table's (a binary search over it) or, by id (tasks null), built
// by one thread into shared memory (`sh`).
__device__ __forceinline__ const Task& block_task(const Task* tasks, int ntasks, const ById& by, bool second, Task* sh) {
    if (tasks) return tasks[find_task(tasks, ntasks, blockIdx.x, second)];
    if (threadIdx.x == 0) {
        int t = min((int)blockIdx.x / (second ? by.blocks2 : by.blocks1), by.k);
        if (t == by.k) {
            *sh = by.shared;
        } else {
            u32 e = by.ids[t];
            if (e >= (u32)by.n) __trap();  // the router never gives one: fail loudly, not read wild memory
            Task T;
            T.g = by.descs[3 * e];
            T.u = by.descs[3 * e + 1];
            T.d = by.descs[3 * e + 2];
            T.h_off = (i64)t * by.hstride;
            T.nrows = 1;
            T.rows_off = 0;
            T.out_row = t;
            T.blk1 = t * by.blocks1;
            T.blk2 = t * by.blocks2;
            T.bg = T.bu = T.bd = nullptr;  // the by-id path runs experts without biases
            T.act = 0;
            T.alpha = T.limit = 0.f;
            T.tiles1 = T.tiles2 = 0;
            T.rounds1 = by.rounds1;
            T.rounds2 = by.rounds2;
            *sh = T;
        }
    }
    __syncthreads();
    return *sh;
}

// A warp's UP_OUTS outputs of gate and up in the round of 8 x UP_OUTS at b0. pre: the
// warp has not waited on the kernel before (dot_rows_vec).
__device__ __forceinline__ void up_row_outputs(const Task& T, int b0, const float* x, float* h, bool pre) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o0 = b0 + warp * UP_OUTS;
    int inter = T.g.rows;
    if (o0 >= inter) {
        if (pre) pdl_enter();
        return;
    }
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
    dot_rows<2 * UP_OUTS>(m, row, x, acc, lane, RowNorm{nullptr, 0.f}, nullptr, 0, 1, pre);
#pragma unroll
    for (int k = 0; k < UP_OUTS; k++) {
        float g = wsum(acc[k]), u = wsum(acc[UP_OUTS + k]);
        if (T.bg && o0 + k < inter) {
            g += T.bg[o0 + k];
            u += T.bu[o0 + k];
        }
        if (lane == 0 && o0 + k < inter) h[T.h_off + o0 + k] = act_mul(g, u, T.act, T.alpha, T.limit);
    }
}

extern "C" __global__ void __launch_bounds__(256, EXPERT_MINB) k_experts_up_row(const Task* tasks, int ntasks, const u32* rowidx,
                                                                   const float* x, int hidden, float* h, ById by) {
    // The by-id launch's `shared` task (a dense MLP, a shared expert) is known before the
    // kernel before ends: built before the wait (defer_wait). Routed ids and task tables
    // come from the kernel or copy just before: wait first.
    bool pre = defer_wait(!tasks && (int)blockIdx.x >= by.k * by.blocks1);
    __shared__ Task sh;
    const Task& T = block_task(tasks, ntasks, by, false, &sh);
    x += tasks ? (i64)rowidx[T.rows_off] * hidden : 0;
    // A block's outputs: T.rounds1 rounds of 16, one after the other (a round's start-up,
    // its first loads' latency, remains; the block's, its task and launch, is shared).
    int rounds = T.rounds1, b0 = (blockIdx.x - T.blk1) * rounds * 8 * UP_OUTS;
#if TILE_MMA
    if (i4_tiles(T.g) && i4_tiles(T.u) && T.g.st == T.u.st) {
        __shared__ I4Shared sm;
        for (int r = 0; r < rounds; r++) {
            if (r) __syncthreads();  // the last round's sums have been read
            int o0 = b0 + r * 8 * UP_OUTS;
            bool p = pre && r == 0;
            if (T.g.st == 1) i4_up_block<1>(T.g, T.u, o0, x, T.act, T.alpha, T.limit, T.bg, T.bu, h + T.h_off, p, r > 0, sm);
            else if (T.g.st == 2) i4_up_block<2>(T.g, T.u, o0, x, T.act, T.alpha, T.limit, T.bg, T.bu, h + T.h_off, p, r > 0, sm);
            else i4_up_block<0>(T.g, T.u, o0, x, T.act, T.alpha, T.limit, T.bg, T.bu, h + T.h_off, p, r > 0, sm);
        }
        return;
    }
#endif
    for (int r = 0; r < rounds; r++) up_row_outputs(T, b0 + r * 8 * UP_OUTS, x, h, pre && r == 0);
}

// A block's outputs: T.rounds2 rounds of 32 (cuda/experts.rs, row_blocks).
extern "C" __global__ void __launch_bounds__(256, EXPERT_MINB) k_experts_down_row(const Task* tasks, int ntasks, const float* h,
                                                                     int hidden, float* y, ById by) {
    // The block's task before the wait on the kernel before (up, whose h it reads): the
    // routed ids or the task table were written before up began, and this kernel starts
    // only once up's blocks have all waited for that (pdl_enter).
    __shared__ Task sh;
    const Task& T = block_task(tasks, ntasks, by, true, &sh);
    bool pre = defer_wait(true);
    int rounds = T.rounds2;
    int b0 = (blockIdx.x - T.blk2) * rounds * 8 * DOWN_OUTS;
#if TILE_MMA
    if (i4_tiles(T.d)) {
        __shared__ I4Shared sm;
        float* yo = y + (i64)T.out_row * hidden;
        const float* hh = h + T.h_off;
        if (T.d.st == 1) {
            if (rounds == 2) i4_down_block<2, 1>(T.d, b0, hh, yo, T.bd, sm, pre);
            else i4_down_block<1, 1>(T.d, b0, hh, yo, T.bd, sm, pre);
        } else if (T.d.st == 2) {
            if (rounds == 2) i4_down_block<2, 2>(T.d, b0, hh, yo, T.bd, sm, pre);
            else i4_down_block<1, 2>(T.d, b0, hh, yo, T.bd, sm, pre);
        } else {
            if (rounds == 2) i4_down_block<2, 0>(T.d, b0, hh, yo, T.bd, sm, pre);
            else i4_down_block<1, 0>(T.d, b0, hh, yo, T.bd, sm, pre);
        }
        return;
    }
#endif
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = 0; r < rounds; r++) {
        int o0 = b0 + (8 * r + warp) * DOWN_OUTS;
        if (o0 >= hidden) {
            if (r == 0 && pre) pdl_enter();
            return;
        }
        float acc[DOWN_OUTS];
        warp_outputs<DOWN_OUTS>(T.d, 0, o0, hidden, h + T.h_off, acc, lane, RowNorm{nullptr, 0.f}, pre && r == 0);
#pragma unroll
        for (int k = 0; k < DOWN_OUTS; k++)
            if (lane == 0 && o0 + k < hidden) y[(i64)T.out_row * hidden + o0 + k] = T.bd ? acc[k] + T.bd[o0 + k] : acc[k];
    }
}
