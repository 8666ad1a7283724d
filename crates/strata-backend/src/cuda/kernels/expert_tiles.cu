// Part of strata's CUDA kernels (see common.cu; module.rs joins the parts in order).

// ---------------------------------------------------------------------------------------
// A prompt's routed experts (tasks of up to 32 rows, TILE_ROWS; the host splits a
// quantized expert's many rows into such tasks) on the tensor cores. On the CUDA cores
// (experts_up<R>) a warp decoded each weight into f32 and spent R fmas on it: bound by
// issue at ~0.6 TB/s, 60% of a 64-token prompt of the GLM-5 slice.
// Here a warp multiplies 16-row tiles of two matrices (gate and up, or two of down's) by
// all of its task's rows with mma.m16n8k16, bf16 in and f32 accumulate:
// - weights of every encoding become bf16 exactly (int4's n - 8, int8, e4m3; bf16 as it
//   is); scales multiply the f32 sums of each 32-column run (int4 groups, FP8 blocks) or
//   the total (int8 rows);
// - x enters as XT_PARTS bf16 parts (three: hi + mid + lo is x but for denormal-range
//   residues, as the cuBLAS path's), staged 64 columns at a time in shared memory by the
//   whole block, the next chunk's weights and x loading meanwhile;
// - a lane reads 8 consecutive columns of its rows g and g + 8 in each 32-column run, so the
//   mma's k order is a permutation of the columns; the staged x follows it.
// A row's sums depend only on its own x, never on the other rows of its task, and whether
// a task takes the tiles only on its matrices: streamed equals resident bit for bit.

#define XT_PARTS 3
#define XT_KC 64  // columns a chunk
#define XT_LD 12  // uint4s a staged row: 8 + 4 (rows 192 bytes apart: a quarter warp's reads
                  // of two rows fall on distinct banks)
#define XT_NT 4   // n-tiles of 8 rows: up to 32 rows a task (TILE_ROWS in cuda/experts.rs)

// The host sends tasks here on sm_80 and later (CudaBackend::mma).
#if __CUDA_ARCH__ >= 800
#define XT_MMA 1
#else
#define XT_MMA 0
#endif

// Outputs a block: 8 warps of 16 (up: gate and up) or 32 (down).
#define XT_UP_OUTS 128
#define XT_DOWN_OUTS 256

#if XT_MMA
struct XtBuf {
    uint4 v[2][XT_PARTS][XT_NT * 8][XT_LD];
};

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 bfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// (lo, hi) -> bf16x2 of their high halves (exact for values of <= 8 significant bits).
__device__ __forceinline__ u32 hi_halves(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

// One lane's 8 columns of a row from column col, as stored.
template <int KIND> __device__ __forceinline__ uint4 xt_load(const u8* row, int col) {
    if (KIND == 1) return __ldg((const uint4*)(row + 2 * col));
    if (KIND == 3) return make_uint4(__ldg((const u32*)(row + col / 2)), 0u, 0u, 0u);
    uint2 v = __ldg((const uint2*)(row + col));
    return make_uint4(v.x, v.y, 0u, 0u);
}

// Those 8 columns as four bf16x2 words, exactly: columns (0, 1) (2, 3) (4, 5) (6, 7), but
// for int4 (0, 2) (4, 6) (1, 3) (5, 7).
template <int KIND> __device__ __forceinline__ void xt_words(uint4 q, u32* w) {
    if (KIND == 1) {
        w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
    } else if (KIND == 3) {
        // 0x43 above a nibble n is the bf16 128 + n; times 1 minus 136 leaves n - 8.
        u32 lo = q.x & 0x0F0F0F0Fu, hi = (q.x >> 4) & 0x0F0F0F0Fu;
        const u32 one = 0x3F803F80u, m136 = 0xC308C308u, magic = 0x43434343u;
        w[0] = bfma2(__byte_perm(lo, magic, 0x4140), one, m136);
        w[1] = bfma2(__byte_perm(lo, magic, 0x4342), one, m136);
        w[2] = bfma2(__byte_perm(hi, magic, 0x4140), one, m136);
        w[3] = bfma2(__byte_perm(hi, magic, 0x4342), one, m136);
    } else {
        // int8 and e4m3 through their exact f32 values (unpack; q's upper half is zeros),
        // whose high halves are the bf16s.
        float v[16];
        unpack<KIND>(q, v);
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = hi_halves(v[2 * i], v[2 * i + 1]);
    }
}

// (lo, hi) rounded to the nearest bf16s, lo in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 8 columns of x (a, b) as XT_PARTS bf16 parts (part p: the bf16s nearest what the parts
// before it left), each a uint4 in xt_words' column order.
template <int KIND> __device__ __forceinline__ void xt_split(float4 a, float4 b, uint4* part) {
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    if (KIND == 3) {
        float p[8] = {v[0], v[2], v[4], v[6], v[1], v[3], v[5], v[7]};
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = p[i];
    }
    u32 w[XT_PARTS][4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float r0 = v[2 * i], r1 = v[2 * i + 1];
#pragma unroll
        for (int p = 0; p < XT_PARTS; p++) {
            u32 h = pack_bf16(r0, r1);
            w[p][i] = h;
            r0 = r0 - __uint_as_float(h << 16);
            r1 = r1 - __uint_as_float(h & 0xffff0000u);
        }
    }
#pragma unroll
    for (int p = 0; p < XT_PARTS; p++) part[p] = make_uint4(w[p][0], w[p][1], w[p][2], w[p][3]);
}

// Where the scales of row r's 32-column runs start (int4 groups and FP8 blocks hold whole
// runs), and the shift from a column to its scale (-1: a division by `div`).
template <int KIND> __device__ __forceinline__ const u8* xt_scales(const Mat& m, int r, int& shift, int& div) {
    div = KIND == 3 ? m.group : m.bcol;
    shift = (div & (div - 1)) == 0 ? __ffs(div) - 1 : -1;
    return KIND == 3 ? sat(m, (size_t)r * m.spr) : sat(m, (size_t)(r / m.brow) * m.spr);
}

// The block's loop over K: this warp's tiles, rows ra.. of ma and rb.. of mb (16 each; past
// a matrix's end its last row again), times the task's first 8 nt rows of x, whose values
// this thread stages from xrow (row threadIdx.x / 8; null: zeros). On return acc[s][n]
// holds the C fragment of matrix s and n-tile n: (row g, x row 8n + 2t), (g, 8n + 2t + 1),
// (g + 8, 8n + 2t), (g + 8, 8n + 2t + 1). Every warp of the block takes part in the
// staging and its barriers; an inactive one computes nothing.
// ST: how int4 scales are stored (a parameter, as in i4_tile).
template <int KIND, int ST = 0>
__device__ __forceinline__ void xt_tiles(const Mat& ma, int ra, const Mat& mb, int rb, bool active, const float* xrow,
                                         int K, int nt, XtBuf& xs, float (*acc)[XT_NT][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const Mat* m[2] = {&ma, &mb};
    int row[2][2], shift[2], div[2];
    float fac[2] = {1.f, 1.f};  // e4m3's matrix factors
    const u8* wr[2][2];
    const u8* sr[2][2];
#pragma unroll
    for (int s = 0; s < 2; s++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            row[s][h] = min((s ? rb : ra) + g + 8 * h, m[s]->rows - 1);
            wr[s][h] = m[s]->w + (size_t)row[s][h] * m[s]->ld;
            if (KIND >= 3) sr[s][h] = xt_scales<KIND>(*m[s], row[s][h], shift[s], div[s]);
        }
    if (ST == 2)
#pragma unroll
        for (int s = 0; s < 2; s++) fac[s] = sfac(*m[s]);
#pragma unroll
    for (int s = 0; s < 2; s++)
#pragma unroll
        for (int n = 0; n < XT_NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[s][n][i] = 0.f;
    int srow = threadIdx.x >> 3, q8 = 8 * (threadIdx.x & 7);
    bool stager = srow < 8 * nt;
    // This chunk's ([0]) and the next's ([1]) weights [s][h][run], their scales, and x.
    // (Loading quantized weights more chunks ahead gained nothing once the registers
    // allowed it: seventh session, call 3.)
    uint4 w[2][2][2][2];
    u32 sc[2][2][2][2];  // raw (sraw)
    float4 xa[2], xb[2];
    auto load = [&](int c, int d) {
        int c0 = c * XT_KC;
        xa[d] = xb[d] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (xrow && c0 + q8 < K) {
            xa[d] = *(const float4*)(xrow + c0 + q8);
            xb[d] = *(const float4*)(xrow + c0 + q8 + 4);
        }
        if (!active) return;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int col = c0 + 32 * r + 8 * t;
            if (col >= K) break;
#pragma unroll
            for (int s = 0; s < 2; s++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    w[d][s][h][r] = xt_load<KIND>(wr[s][h], col);
                    if (KIND >= 3)
                        sc[d][s][h][r] = sraw(sr[s][h], shift[s] >= 0 ? col >> shift[s] : col / div[s], ST);
                }
        }
    };
    int nch = (K + XT_KC - 1) / XT_KC;
    load(0, 0);
    for (int c = 0; c < nch; c++) {
        uint4(*buf)[XT_NT * 8][XT_LD] = xs.v[c & 1];
        if (stager) {
            uint4 part[XT_PARTS];
            xt_split<KIND>(xa[0], xb[0], part);
#pragma unroll
            for (int p = 0; p < XT_PARTS; p++) buf[p][srow][threadIdx.x & 7] = part[p];
        }
        // Buffer c & 1 was last read in step c - 2, before every warp passed step c - 1's barrier.
        __syncthreads();
        if (c + 1 < nch) load(c + 1, 1);
        if (active) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if (c * XT_KC + 32 * r >= K) break;
                u32 wa[2][4], wb[2][4];
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    xt_words<KIND>(w[0][s][0][r], wa[s]);
                    xt_words<KIND>(w[0][s][1][r], wb[s]);
                }
#pragma unroll
                for (int n = 0; n < XT_NT; n++) {
                    if (n >= nt) break;
                    float run[2][4] = {};
#pragma unroll
                    for (int p = 0; p < XT_PARTS; p++) {
                        uint4 xv = buf[p][8 * n + g][4 * r + t];
#pragma unroll
                        for (int s = 0; s < 2; s++) {
                            float* cc = KIND >= 3 ? run[s] : acc[s][n];
                            mma_bf16(cc, wa[s][0], wb[s][0], wa[s][1], wb[s][1], xv.x, xv.y);
                            mma_bf16(cc, wa[s][2], wb[s][2], wa[s][3], wb[s][3], xv.z, xv.w);
                        }
                    }
                    if (KIND >= 3) {
#pragma unroll
                        for (int s = 0; s < 2; s++) {
                            acc[s][n][0] = fmaf(run[s][0], sval(sc[0][s][0][r], ST, fac[s]), acc[s][n][0]);
                            acc[s][n][1] = fmaf(run[s][1], sval(sc[0][s][0][r], ST, fac[s]), acc[s][n][1]);
                            acc[s][n][2] = fmaf(run[s][2], sval(sc[0][s][1][r], ST, fac[s]), acc[s][n][2]);
                            acc[s][n][3] = fmaf(run[s][3], sval(sc[0][s][1][r], ST, fac[s]), acc[s][n][3]);
                        }
                    }
                }
            }
        }
        xa[0] = xa[1];
        xb[0] = xb[1];
#pragma unroll
        for (int s = 0; s < 2; s++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    w[0][s][h][r] = w[1][s][h][r];
                    sc[0][s][h][r] = sc[1][s][h][r];
                }
    }
    if (KIND == 2 && active) {
#pragma unroll
        for (int s = 0; s < 2; s++) {
            float s0 = __ldg(m[s]->s + row[s][0]), s1 = __ldg(m[s]->s + row[s][1]);
#pragma unroll
            for (int n = 0; n < XT_NT; n++) {
                acc[s][n][0] *= s0;
                acc[s][n][1] *= s0;
                acc[s][n][2] *= s1;
                acc[s][n][3] *= s1;
            }
        }
    }
}

// Where the result acc[s][n][i] of xt_tiles of lane (g = lane / 4, t = lane % 4) belongs:
// its output within the warp's tiles (16 a tile) and its x row (the C fragment's layout,
// in one place).
__device__ __forceinline__ int xt_out(int s, int i, int g) { return 16 * s + g + 8 * (i >> 1); }
__device__ __forceinline__ int xt_xrow(int n, int i, int t) { return 8 * n + 2 * t + (i & 1); }

// xt_tiles for the matrices' encoding (the host sends only bf16, int8, int4 and FP8 here;
// gate and up share theirs, scale type included).
__device__ __forceinline__ void xt_any(const Mat& ma, int ra, const Mat& mb, int rb, bool active, const float* xrow,
                                       int K, int nt, XtBuf& xs, float (*acc)[XT_NT][4]) {
    switch (ma.kind) {
    case 1: xt_tiles<1>(ma, ra, mb, rb, active, xrow, K, nt, xs, acc); break;
    case 2: xt_tiles<2>(ma, ra, mb, rb, active, xrow, K, nt, xs, acc); break;
    case 3:
        if (ma.st == 1) xt_tiles<3, 1>(ma, ra, mb, rb, active, xrow, K, nt, xs, acc);
        else if (ma.st == 2) xt_tiles<3, 2>(ma, ra, mb, rb, active, xrow, K, nt, xs, acc);
        else xt_tiles<3, 0>(ma, ra, mb, rb, active, xrow, K, nt, xs, acc);
        break;
    default: xt_tiles<4>(ma, ra, mb, rb, active, xrow, K, nt, xs, acc); break;
    }
}

// Each of a warp's tile results (acc from xt_any: matrix s, n-tile n, element i) with its
// output (o0 + its row) and x row, for `put(o, r, v)`.
template <int S, typename F> __device__ __forceinline__ void xt_each(float (*acc)[XT_NT][4], int o0, F put) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < S; s++)
#pragma unroll
        for (int n = 0; n < XT_NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) put(o0 + xt_out(s, i, g), xt_xrow(n, i, t), acc[s][n][i]);
}

// Pass 1 of a tiled task: h = act(gate x) * up x for XT_UP_OUTS outputs, all its rows.
__device__ __forceinline__ void xt_up(const Task& T, const u32* rowidx, const float* x, int hidden, float* h) {
    __shared__ XtBuf xs;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int inter = T.g.rows;
    int o0 = (blockIdx.x - T.blk1) * XT_UP_OUTS + 16 * warp;
    int nt = (T.nrows + 7) >> 3, srow = threadIdx.x >> 3;
    const float* xrow = srow < T.nrows ? x + (i64)rowidx[T.rows_off + srow] * hidden : nullptr;
    float acc[2][XT_NT][4];
    xt_any(T.g, o0, T.u, o0, o0 < inter, xrow, hidden, nt, xs, acc);
#pragma unroll
    for (int n = 0; n < XT_NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int o = o0 + xt_out(0, i, g), r = xt_xrow(n, i, t);
            if (o < inter && r < T.nrows) {
                float g = acc[0][n][i], u = acc[1][n][i];
                if (T.bg) {
                    g += T.bg[o];
                    u += T.bu[o];
                }
                h[T.h_off + (i64)r * inter + o] = act_mul(g, u, T.act, T.alpha, T.limit);
            }
        }
}

// Pass 2 of a tiled task: y = down h for XT_DOWN_OUTS outputs, all its rows.
__device__ __forceinline__ void xt_down(const Task& T, const float* h, int hidden, float* y) {
    __shared__ XtBuf xs;
    int warp = threadIdx.x >> 5;
    int inter = T.d.cols;
    int o0 = (blockIdx.x - T.blk2) * XT_DOWN_OUTS + 32 * warp;
    int nt = (T.nrows + 7) >> 3, srow = threadIdx.x >> 3;
    const float* xrow = srow < T.nrows ? h + T.h_off + (i64)srow * inter : nullptr;
    float acc[2][XT_NT][4];
    xt_any(T.d, o0, T.d, o0 + 16, o0 < hidden, xrow, inter, nt, xs, acc);
    xt_each<2>(acc, o0, [&](int o, int r, float v) {
        if (o < hidden && r < T.nrows) y[(i64)(T.out_row + r) * hidden + o] = T.bd ? v + T.bd[o] : v;
    });
}
#endif

// Blocks an SM the many-row kernels are compiled for (registers capped to fit): bf16
// (XT_MINB) and the quantized encodings (XT_QMINB), whose tiles need more registers than
// half an SM's: capped at 128 they spilled inside the chunk loop, and one block an SM read
// int4 at 1.8x and e4m3 at 1.2x the rate, bf16 at 0.9x (H200, 2026-12-02). The
// host sends a task with a quantized matrix to the `_q` kernels.
#define XT_MINB 2
#define XT_QMINB 1

// The many-row expert kernels: a task with `tiles` set (the host's choice, by its matrices)
// takes the tensor-core tiles above, the rest one output a warp, rows 8 at a time.
__device__ __forceinline__ void many_up(const Task* tasks, int ntasks, const u32* rowidx, const float* x, int hidden,
                                        float* h) {
    pdl_enter();
#if XT_MMA
    const Task& T = tasks[find_task(tasks, ntasks, blockIdx.x, false)];
    if (T.tiles1) {
        xt_up(T, rowidx, x, hidden, h);
        return;
    }
#endif
    experts_up<8>(tasks, ntasks, rowidx, x, hidden, h);
}

__device__ __forceinline__ void many_down(const Task* tasks, int ntasks, const float* h, int hidden, float* y) {
    pdl_enter();
#if XT_MMA
    const Task& T = tasks[find_task(tasks, ntasks, blockIdx.x, true)];
    if (T.tiles2) {
        xt_down(T, h, hidden, y);
        return;
    }
#endif
    experts_down<8>(tasks, ntasks, h, hidden, y);
}

#define EXPERTS_MANY(SUFFIX, MINB)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                      \
        k_experts_up##SUFFIX(const Task* tasks, int ntasks, const u32* rowidx, const float* x, int hidden, float* h) { \
        many_up(tasks, ntasks, rowidx, x, hidden, h);                                                            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                      \
        k_experts_down##SUFFIX(const Task* tasks, int ntasks, const float* h, int hidden, float* y) {            \
        many_down(tasks, ntasks, h, hidden, y);                                                                  \
    }
EXPERTS_MANY(, XT_MINB)
EXPERTS_MANY(_q, XT_QMINB)

// A projection of many rows (a prompt's) by a matrix the tiles take, for linear_tiled's
// arguments: XT_DOWN_OUTS outputs x 32 rows a block, blockIdx.z the batch. Used where
// cuBLAS is not (quantized weights, batched or gathered bf16 products).
__device__ __forceinline__ void tiled_mma(const Mat& m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld,
                                          const u32* xrows, int rows, int nout, float* out, int ostride, int col,
                                          int col_bs, int add, const float* bias) {
    pdl_enter();
#if XT_MMA
    __shared__ XtBuf xs;
    int b = blockIdx.z, warp = threadIdx.x >> 5;
    int o0 = blockIdx.x * XT_DOWN_OUTS + 32 * warp, r0 = blockIdx.y * 8 * XT_NT;
    int nr = min(8 * XT_NT, rows - r0), nt = (nr + 7) >> 3, srow = threadIdx.x >> 3;
    const float* xrow = nullptr;
    if (srow < nr) xrow = x + b * x_bs + (i64)(xrows ? (int)xrows[r0 + srow] : r0 + srow) * xld;
    int mrow = mrow0 + b * mrow_bs;
    float acc[2][XT_NT][4];
    xt_any(m, mrow + o0, m, mrow + o0 + 16, o0 < nout, xrow, m.cols, nt, xs, acc);
    xt_each<2>(acc, o0, [&](int o, int r, float v) {
        if (o >= nout || r >= nr) return;
        v += bias ? bias[o] : 0.f;
        float* p = out + (i64)(r0 + r) * ostride + col + b * col_bs + o;
        *p = add ? *p + v : v;
    });
#endif
}

#define TILED_MMA(SUFFIX, MINB)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                      \
        k_tiled_mma##SUFFIX(Mat m, int mrow0, int mrow_bs, const float* x, i64 x_bs, int xld, const u32* xrows,  \
                            int rows, int nout, float* out, int ostride, int col, int col_bs, int add,           \
                            const float* bias) {                                                                 \
        tiled_mma(m, mrow0, mrow_bs, x, x_bs, xld, xrows, rows, nout, out, ostride, col, col_bs, add, bias);    \
    }
TILED_MMA(, XT_MINB)
TILED_MMA(_q, XT_QMINB)
