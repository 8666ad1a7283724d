//! Host side of the CUDA ops: argument checks, launch shapes, the product dispatch (few
//! rows: a warp per output; many rows: cuBLAS for f32/bf16, else the tensor-core tiles or
//! a tiled kernel); the experts are in `experts.rs`.

use super::experts::{mma_tiles, TILE_DOWN_OUTS, TILE_ROWS};
use super::{args, kind_code, CudaBackend, CudaMat, DevBuf, Lin, LinJob, LinJobs, State, MAX_JOBS, SMALL_ROWS};
use crate::{Backend, GqaQuery, LinearOut, Step};
use crate::{DsaSelect, GqaAttend, GqaPrepare, MlaAbsorb, MlaAttend, MlaPrepare, RouterParams, Selection};
use cudarc::cublas::sys as blas;
use std::ffi::c_void;
use strata_kernels::QuantKind;

/// An RMSNorm fused into one-row products: (scale pointer, eps); a null pointer for none.
pub(crate) type RowNorm = (u64, f32);
pub(crate) const NO_NORM: RowNorm = (0, 0.0);

/// Blocks an SM that `linear_quad`'s split aims for (three an SM, which would give the
/// per-head value projections half as many blocks of twice the columns, decoded the bf16
/// slice 1% slower: 1500 against 1513 tok/s, H200, 2026-12-02).
const QUAD_BLOCKS: usize = 4;

/// Rows from which a step's MLA attention takes `k_mla_attend_tiles` (a block per row and
/// 16 heads, each tile of 32 keys staged once for them): prompts and large batches. A
/// decode row keeps `k_mla_attend_J` (a block per row and head, positions over 4 warps),
/// which spreads one row over the device.
const ATTEND_TILE_ROWS: usize = 16;
/// Heads and positions a `k_mla_attend_tiles` block takes (`ATT_HB`, `ATT_TP`), and the
/// widest latent its threads sum values for (64 threads x 2 float4s).
const ATT_HB: usize = 16;
const ATT_TP: usize = 32;
const ATT_LATENT: usize = 512;

/// The smallest instantiated register-array width that covers `n` values per lane.
fn pick(list: &[(usize, cudarc::driver::CudaFunction)], n: usize) -> &cudarc::driver::CudaFunction {
    let need = n.div_ceil(32).max(1);
    &list
        .iter()
        .find(|(j, _)| *j >= need)
        .unwrap_or_else(|| panic!("CUDA: {n} values per head is wider than the kernels support"))
        .1
}

impl CudaBackend {
    /// One projection (see [`Lin`]).
    pub(crate) fn linear(&self, st: &mut State, l: &Lin) {
        if l.rows == 0 || l.nout == 0 || l.batches == 0 {
            return;
        }
        let (mrow0, mrow_bs, xld, rows, nout) =
            (l.mrow0 as i32, l.mrow_bs as i32, l.xld as i32, l.rows as i32, l.nout as i32);
        let (ostride, col, col_bs, add) = (l.ostride as i32, l.col as i32, l.col_bs as i32, l.add as i32);
        let (m, x, x_bs, xrows, out, bias) = (l.m, l.x, l.x_bs as i64, l.xrows, l.out, l.bias);
        // One row against a matrix with enough outputs to fill the device at four (or two)
        // a warp.
        if self.row_kernel_eligible(l) {
            self.linear_row(l, NO_NORM);
            return;
        }
        if l.rows <= SMALL_ROWS && l.xrows == 0 {
            let (fi, _) = [1usize, 2, 4, 8].iter().enumerate().find(|(_, &r)| r >= l.rows).unwrap();
            let (split, grid) = self.small_launch(l);
            let split_i = split as i32;
            self.launch(
                &self.f.linear[fi],
                grid,
                256,
                0,
                &mut args![m, mrow0, mrow_bs, x, x_bs, xld, rows, nout, out, ostride, col, col_bs, add, bias, split_i],
            );
            return;
        }
        if l.batches == 1 && l.xrows == 0 && matches!(l.kind, QuantKind::F32 | QuantKind::Bf16) {
            if let Some(b) = &self.blas {
                self.gemm(st, *b.handle(), l);
                if l.bias != 0 {
                    let grid = (l.nout.div_ceil(256) as u32, l.rows as u32, 1);
                    self.launch(&self.f.add_bias, grid, 256, 0, &mut args![rows, nout, out, ostride, col, bias]);
                }
                return;
            }
        }
        // The tensor-core tiles stage x in float4s: rows 16-byte aligned.
        if mma_tiles(self, &l.m) && l.xld.is_multiple_of(4) && l.x_bs.is_multiple_of(4) && l.x.is_multiple_of(16) {
            let grid = (l.nout.div_ceil(TILE_DOWN_OUTS) as u32, l.rows.div_ceil(TILE_ROWS) as u32, l.batches as u32);
            self.launch(
                if l.m.quantized() { &self.f.tiled_mma_q } else { &self.f.tiled_mma },
                grid,
                256,
                0,
                &mut args![m, mrow0, mrow_bs, x, x_bs, xld, xrows, rows, nout, out, ostride, col, col_bs, add, bias],
            );
            return;
        }
        let grid = (l.nout.div_ceil(64) as u32, l.rows.div_ceil(64) as u32, l.batches as u32);
        assert!(l.kind != QuantKind::Mxfp4, "linear: MXFP4 is an expert encoding; many-row products do not take it");
        self.launch(
            &self.f.tiled[kind_code(l.kind) as usize],
            grid,
            256,
            0,
            &mut args![m, mrow0, mrow_bs, x, x_bs, xld, xrows, rows, nout, out, ostride, col, col_bs, add, bias],
        );
    }

    /// `l` (one row) through `k_linear_quad` (four outputs a group of warps splitting the
    /// columns), x RMS-normalised on the way in when `norm` has a scale.
    fn linear_row(&self, l: &Lin, norm: RowNorm) {
        let (mrow0, mrow_bs, nout) = (l.mrow0 as i32, l.mrow_bs as i32, l.nout as i32);
        let (col, col_bs, add) = (l.col as i32, l.col_bs as i32, l.add as i32);
        let (m, x, x_bs, out, bias, (nw, eps)) = (l.m, l.x, l.x_bs as i64, l.out, l.bias, norm);
        let split = self.quad_split(l.nout.div_ceil(4), l.batches);
        let grid = ((l.nout.div_ceil(4) * split).div_ceil(8) as u32, l.batches as u32, 1);
        let split = split as i32;
        self.launch(
            &self.f.linear_quad,
            grid,
            256,
            0,
            &mut args![m, mrow0, mrow_bs, x, x_bs, nout, out, col, col_bs, add, bias, nw, eps, split],
        );
    }

    /// Whether `l` is one vector row with enough outputs to take [`Self::linear_row`]: at
    /// two outputs a warp, its blocks of 8 warps still cover the SMs (else
    /// `linear_small`, which spreads each output over more warps).
    fn row_kernel_eligible(&self, l: &Lin) -> bool {
        l.one_row() && l.m.vec != 0 && l.nout.div_ceil(16) * l.batches >= self.sms
    }

    /// Warps of a block's 8 that share one unit of work (1, 2, 4 or 8), for `units` units a
    /// batch: the fewest that make `per_sm` blocks an SM, at most 8.
    fn split_for(&self, units: usize, batches: usize, per_sm: usize) -> usize {
        let target = per_sm * self.sms;
        [1usize, 2, 4, 8].into_iter().find(|&s| (units * s).div_ceil(8) * batches >= target).unwrap_or(8)
    }

    /// Warps per group of four outputs of `linear_quad` for `groups` groups a batch: four
    /// blocks an SM (two waves of two), so that no SM is left with one block's loads in
    /// flight. (Three an SM, which would give the per-head value projections half as many
    /// blocks of twice the columns, decoded the bf16 slice 1% slower: 1500 against 1513
    /// tok/s, H200, 2026-12-02; three for the value projections alone, or for the grouped
    /// small projections of `k_linears_1` alone, level: 2026-12-03.)
    fn quad_split(&self, groups: usize, batches: usize) -> usize {
        self.split_for(groups, batches, QUAD_BLOCKS)
    }

    /// Warps per output of `linear_small`: enough blocks to fill the device twice over.
    fn small_split(&self, nout: usize, batches: usize) -> usize {
        self.split_for(nout, batches, 2)
    }

    /// `linear_small`'s split and grid for `l` (`k_linear_R`, and `k_route_one`, which must
    /// sum its logits the same way).
    fn small_launch(&self, l: &Lin) -> (usize, (u32, u32, u32)) {
        let split = self.small_split(l.nout, l.batches);
        (split, ((l.nout * split).div_ceil(8) as u32, l.batches as u32, 1))
    }

    /// Projections of one row of x: those small enough for `linear_small` go out together,
    /// up to four a launch (`k_linears_1`: vector rows four outputs a group of warps,
    /// others each as `k_linear_1` would compute it); the rest one by one, unless two to
    /// four vector-row projections share the launch whatever their size (the same
    /// products as `linear_quad`'s, the same splits, so the same bits; a small one's tail
    /// hides behind a large one's reads, as q_b's beside the indexer's wq_b). (The
    /// outputs are distinct buffers, so the order does not matter.) With a
    /// `norm` scale, x is RMS-normalised on the way into every product: the caller checks
    /// [`CudaBackend::fuses_norm`].
    pub(crate) fn linears_one_row(&self, st: &mut State, jobs: &[Lin], norm: RowNorm) {
        let mut small = std::mem::take(&mut st.work.small);
        small.clear();
        // Vector rows go in one launch when there are several (up to MAX_JOBS), large or not.
        let together = (2..=MAX_JOBS).contains(&jobs.len()) && jobs.iter().all(|l| l.one_vector_row() && l.nout > 0);
        for (i, l) in jobs.iter().enumerate() {
            if self.row_kernel_eligible(l) && l.batches == 1 && !together {
                self.linear_row(l, norm);
                continue;
            }
            if l.nout == 0 {
                continue;
            }
            if !l.one_row() || l.batches != 1 {
                assert!(norm.0 == 0, "linears_one_row: a norm fused into an ineligible projection");
                self.linear(st, l);
                continue;
            }
            // Four outputs a group of warps for vector rows (see `linear_quad`).
            let quad = l.m.vec != 0;
            let split = match quad {
                true => self.quad_split(l.nout.div_ceil(4), 1),
                false => self.small_split(l.nout, 1),
            } as i32;
            let (out, bias, add) = (l.out + 4 * l.col as u64, l.bias, l.add as i32);
            small.push((i, LinJob { m: l.m, out, bias, add, split, blk0: 0, quad: i32::from(quad) }));
        }
        if let ([(i, LinJob { quad: 0, .. })], 0) = (&small[..], norm.0) {
            self.linear(st, &jobs[*i]);
        } else {
            for chunk in small.chunks(MAX_JOBS) {
                let mut all = LinJobs::default();
                let mut blocks = 0usize;
                for (slot, (_, j)) in all.j.iter_mut().zip(chunk) {
                    *slot = LinJob { blk0: blocks as i32, ..*j };
                    let groups = if j.quad != 0 { (j.m.rows as usize).div_ceil(4) } else { j.m.rows as usize };
                    blocks += (groups * j.split as usize).div_ceil(8);
                }
                let (x, n, (nw, eps)) = (jobs[0].x, chunk.len() as i32, norm);
                self.launch(&self.f.linears_1, (blocks as u32, 1, 1), 256, 0, &mut args![x, n, all, nw, eps]);
            }
        }
        st.work.small = small;
    }

    /// The jobs of [`crate::Backend::linears`] (shapes checked), in the state's reused list:
    /// hand it back through `st.work.jobs`.
    pub(crate) fn lin_jobs(
        &self,
        st: &mut State,
        x: &DevBuf<f32>,
        rows: usize,
        outs: &[LinearOut<'_, Self>],
    ) -> Vec<Lin> {
        let mut jobs = std::mem::take(&mut st.work.jobs);
        jobs.clear();
        for lo in outs {
            let w = lo.w;
            assert!(x.len >= rows * w.cols, "linears: x has {} values, needs {rows} x {}", x.len, w.cols);
            assert!(
                lo.out.len >= (rows - 1) * lo.stride + lo.col + w.rows,
                "linears: output of {} values too small for {rows} rows (stride {}, col {}, {} outputs)",
                lo.out.len,
                lo.stride,
                lo.col,
                w.rows
            );
            if let Some(b) = lo.bias {
                assert_eq!(b.len, w.rows, "linears: bias of {} values for {} outputs", b.len, w.rows);
            }
            jobs.push(Lin {
                m: w.desc,
                kind: w.kind,
                mrow0: 0,
                mrow_bs: 0,
                x: x.ptr,
                x_bs: 0,
                xld: w.cols,
                xrows: 0,
                rows,
                nout: w.rows,
                out: lo.out.ptr,
                ostride: lo.stride,
                col: lo.col,
                col_bs: 0,
                add: lo.add,
                bias: lo.bias.map_or(0, |b| b.ptr),
                batches: 1,
            });
        }
        jobs
    }

    /// Whether [`CudaBackend::linears_one_row`] can fuse an RMSNorm of width `width` into
    /// the projections `jobs`: one unbatched row, every matrix read in vectors over that width.
    pub(crate) fn fuses_norm(&self, jobs: &[Lin], width: usize) -> bool {
        jobs.iter().all(|l| l.one_vector_row() && l.m.cols as usize == width)
    }

    /// `out = x W^T` (+= with add) through cuBLAS: f32 in f32; bf16 weights against x split
    /// into three bf16 parts (x = hi + mid + lo, exact), three GEMMs accumulating in f32.
    fn gemm(&self, st: &mut State, h: blas::cublasHandle_t, l: &Lin) {
        let (m, n, k) = (l.nout as i32, l.rows as i32, l.m.cols);
        let (lda, ldb, ldc) = (l.m.cols, l.xld as i32, l.ostride as i32);
        let a = l.m.w + (l.mrow0 as u64) * l.m.ld as u64;
        let c = l.out + 4 * l.col as u64;
        let one = 1f32;
        let beta = if l.add { 1f32 } else { 0f32 };
        let (t, nn) = (blas::cublasOperation_t::CUBLAS_OP_T, blas::cublasOperation_t::CUBLAS_OP_N);
        let status = match l.kind {
            QuantKind::F32 => unsafe {
                // cuBLAS launches on the stream itself: what is held goes first.
                self.queue.flush();
                // SAFETY: the pointers address device memory of the stated shapes.
                blas::cublasSgemm_v2(
                    h,
                    t,
                    nn,
                    m,
                    n,
                    k,
                    &one,
                    a as *const f32,
                    lda,
                    l.x as *const f32,
                    ldb,
                    &beta,
                    c as *mut f32,
                    ldc,
                )
            },
            _ => {
                let len = l.rows * l.xld;
                let hi = self.ensure(&mut st.work.xhi, len).ptr;
                let mid = self.ensure(&mut st.work.xmid, len).ptr;
                let lo = self.ensure(&mut st.work.xlo, len).ptr;
                let (nl, xp) = (len as i64, l.x);
                let blocks = len.div_ceil(256).clamp(1, 8 * self.sms) as u32;
                self.launch(&self.f.split_bf16, (blocks, 1, 1), 256, 0, &mut args![nl, xp, hi, mid, lo]);
                let bf = blas::cudaDataType::CUDA_R_16BF;
                let f32t = blas::cudaDataType::CUDA_R_32F;
                let ct = blas::cublasComputeType_t::CUBLAS_COMPUTE_32F;
                let algo = blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
                // cuBLAS launches on the stream itself: the split goes first.
                self.queue.flush();
                let run = |xb: u64, beta: &f32| unsafe {
                    // SAFETY: as above; `xb` holds rows x xld bf16 values.
                    blas::cublasGemmEx(
                        h,
                        t,
                        nn,
                        m,
                        n,
                        k,
                        &one as *const f32 as *const c_void,
                        a as *const c_void,
                        bf,
                        lda,
                        xb as *const c_void,
                        bf,
                        ldb,
                        beta as *const f32 as *const c_void,
                        c as *mut c_void,
                        f32t,
                        ldc,
                        ct,
                        algo,
                    )
                };
                let mut s = run(hi, &beta);
                for &part in [mid, lo].iter() {
                    if s == blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                        s = run(part, &one);
                    }
                }
                s
            }
        };
        status.result().unwrap_or_else(|e| panic!("cuBLAS: {e:?}"));
    }
}

pub(crate) fn mla_prepare(b: &CudaBackend, step: &Step, a: MlaPrepare<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    let kw = d.key_width();
    assert!(d.rope.is_multiple_of(2) && d.rope <= 512, "mla_prepare: rope width {} unsupported", d.rope);
    assert!(a.q_a.len() >= rows * a.q_lora && a.kv_a.len() >= rows * kw, "mla_prepare: inputs too small");
    assert!(a.cos.len() >= rows * d.rope / 2 && a.sin.len() >= rows * d.rope / 2, "mla_prepare: rotary tables");
    let mut st = b.lock();
    let sd = b.step_desc(&mut st, step);
    let (qa, qn, kva, kvn, cs, sn, cache) =
        (a.q_a.ptr(), a.q_norm.ptr(), a.kv_a.ptr(), a.kv_norm.ptr(), a.cos.ptr(), a.sin.ptr(), a.cache.ptr());
    let (q_lora, kv_lora, rope, eps) = (a.q_lora as i32, d.kv_lora as i32, d.rope as i32, a.eps);
    b.launch(
        &b.f.mla_prepare,
        (rows as u32, 2, 1),
        256,
        0,
        &mut args![sd, qa, q_lora, qn, kva, kvn, eps, cs, sn, cache, kv_lora, rope],
    );
}

/// The one-row absorb's row groups and latent columns a block (`ABS_G`, `ABS_KC` in
/// kernels/attention.cu).
const ABS_G: usize = 32;
const ABS_KC: usize = 128;

pub(crate) fn mla_absorb(b: &CudaBackend, step: &Step, a: MlaAbsorb<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    assert!(a.q.len() >= rows * d.heads * (d.nope + d.rope), "mla_absorb: q too small");
    assert!(a.q_full.len() >= rows * d.heads * d.key_width(), "mla_absorb: q_full too small");
    assert_eq!(b.mat_shape(a.kv_b), (d.heads * (d.nope + d.v), d.kv_lora), "mla_absorb: kv_b shape");
    let _g = b.lock();
    let (q, kvb, cs, sn, qf) = (a.q.ptr(), a.kv_b.desc, a.cos.ptr(), a.sin.ptr(), a.q_full.ptr());
    let (r, h, nope, rope, v, kvl) =
        (rows as i32, d.heads as i32, d.nope as i32, d.rope as i32, d.v as i32, d.kv_lora as i32);
    if rows == 1 && kvb.vec != 0 {
        // ABS_G row groups x (ABS_KC columns / the vector width) threads (`absorb_row`).
        let width = super::VEC_WIDTH[kind_code(a.kv_b.kind) as usize];
        let threads = (ABS_G * ABS_KC / width) as u32;
        let grid = (d.heads as u32, d.kv_lora.div_ceil(ABS_KC) as u32, 1);
        let f = &b.f.mla_absorb_row[kind_code(a.kv_b.kind) as usize];
        b.launch(f, grid, threads, 0, &mut args![q, kvb, h, nope, rope, v, kvl, cs, sn, qf]);
        return;
    }
    // Tiles of AB_T = 64 columns and rows (see `k_mla_absorb`).
    b.launch(
        &b.f.mla_absorb,
        (d.heads as u32, d.kv_lora.div_ceil(64) as u32, rows.div_ceil(64) as u32),
        256,
        0,
        &mut args![q, kvb, r, h, nope, rope, v, kvl, cs, sn, qf],
    );
}

pub(crate) fn dsa_select(b: &CudaBackend, step: &Step, a: DsaSelect<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    assert!(
        d.rope.is_multiple_of(2) && d.rope <= d.dim && d.rope <= 512,
        "dsa_select: rope {} of dim {}",
        d.rope,
        d.dim
    );
    assert!(a.q.len() >= rows * d.heads * d.dim && a.k.len() >= rows * d.dim, "dsa_select: inputs too small");
    let mut st = b.lock();
    let sd = b.step_desc(&mut st, step);
    let (q, k, knw, knb, cs, sn, cache) =
        (a.q.ptr(), a.k.ptr(), a.k_norm_w.ptr(), a.k_norm_b.ptr(), a.cos.ptr(), a.sin.ptr(), a.cache.ptr());
    let (heads, dim, rope, eps) = (d.heads as i32, d.dim as i32, d.rope as i32, a.eps);
    b.launch(
        &b.f.dsa_prepare,
        (rows as u32, 1 + d.heads as u32, 1),
        256,
        0,
        &mut args![sd, q, heads, dim, rope, k, knw, knb, eps, cs, sn, cache],
    );
    if !a.select {
        return;
    }
    let visible = step.max_visible();
    assert!(a.work.len() >= rows * visible, "dsa_select: scores scratch too small");
    // The scores' row stride and grid, rounded up to a power of two (the kernels stop at
    // each row's own length, read on the device): a decode step's launches stay the same
    // for many tokens, so they replay as one graph.
    let positions = visible.next_power_of_two().max(256).min(a.work.len() / rows).max(visible);
    assert!(d.topk >= 1, "dsa_select: index_topk must be at least 1");
    assert!(a.selected.len() >= rows * d.topk && a.counts.len() >= rows, "dsa_select: selection buffers too small");
    let smem = (d.heads * (d.dim + 1) + d.heads) * 4;
    assert!(smem <= 48 << 10, "dsa_select: {} heads x {} dims exceed shared memory", d.heads, d.dim);
    let (w, work, sel, cnt) = (a.w.ptr(), a.work.ptr(), a.selected.ptr(), a.counts.ptr());
    let wscale = (d.heads as f32).powf(-0.5);
    let dscale = (d.dim as f32).powf(-0.5);
    let (pos_i, topk) = (positions as i32, d.topk as i32);
    b.launch(
        &b.f.dsa_scores,
        (rows as u32, positions.div_ceil(256) as u32, 1),
        256,
        smem as u32,
        &mut args![sd, q, w, heads, dim, wscale, dscale, cache, work, pos_i],
    );
    b.launch(&b.f.dsa_topk, (rows as u32, 1, 1), 1024, 0, &mut args![sd, work, pos_i, topk, sel, cnt]);
}

pub(crate) fn mla_attend(b: &CudaBackend, step: &Step, a: MlaAttend<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    let kw = d.key_width();
    assert!(a.q_full.len() >= rows * d.heads * kw, "mla_attend: q_full too small");
    assert!(a.latent_out.len() >= d.heads * rows * d.kv_lora, "mla_attend: latent scratch too small");
    assert!(a.out.len() >= rows * d.heads * d.v, "mla_attend: output too small");
    let mut st = b.lock();
    let sd = b.step_desc(&mut st, step);
    let sparse = (a.selection == Selection::Sparse) as i32;
    let (qf, cache, sel, cnt, lat) =
        (a.q_full.ptr(), a.cache.ptr(), a.selected.ptr(), a.counts.ptr(), a.latent_out.ptr());
    let (topk, heads, kvl, kwi, scale, rows_i) =
        (a.topk as i32, d.heads as i32, d.kv_lora as i32, kw as i32, d.scale, rows as i32);
    // Shared memory of the tiled kernel: Q of its heads and a tile of keys, rows of kw
    // rounded to an odd count of float4s; the tile's weights, corrections and sums.
    let kwp = ((kw / 4) | 1) * 4;
    let smem = ((ATT_HB + ATT_TP) * kwp + ATT_HB * ATT_TP + 2 * ATT_HB) * 4;
    let tiles = rows >= ATTEND_TILE_ROWS
        && kw.is_multiple_of(4)
        && d.kv_lora.is_multiple_of(4)
        && d.kv_lora <= ATT_LATENT
        && smem <= b.attend_smem;
    let (f, grid, smem) = match tiles {
        true => (&b.f.mla_attend_tiles, (rows as u32, d.heads.div_ceil(ATT_HB) as u32, 1), smem as u32),
        false => (pick(&b.f.mla_attend, kw), (rows as u32, d.heads as u32, 1), 0),
    };
    b.launch(
        f,
        grid,
        128,
        smem,
        &mut args![sd, qf, cache, sparse, sel, cnt, topk, heads, kvl, kwi, scale, lat, rows_i],
    );
    // Each head's value projection: out[r, h*v + o] = W_uv(h)[o] . lat[h, r].
    let l = Lin {
        m: a.kv_b.desc,
        kind: a.kv_b.kind,
        mrow0: d.nope,
        mrow_bs: d.nope + d.v,
        x: lat,
        x_bs: rows * d.kv_lora,
        xld: d.kv_lora,
        xrows: 0,
        rows,
        nout: d.v,
        out: a.out.ptr(),
        ostride: d.heads * d.v,
        col: 0,
        col_bs: d.v,
        add: false,
        bias: 0,
        batches: d.heads,
    };
    b.linear(&mut st, &l);
}

pub(crate) fn gqa_prepare(b: &CudaBackend, step: &Step, a: GqaPrepare<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    assert!(d.rotary.is_multiple_of(2) && d.rotary <= d.head_dim, "gqa_prepare: rotary {} of {}", d.rotary, d.head_dim);
    assert!(
        d.kv_heads > 0 && d.heads.is_multiple_of(d.kv_heads),
        "gqa_prepare: {} heads over {} KV heads",
        d.heads,
        d.kv_heads
    );
    assert!(a.q.len() >= rows * d.heads * d.head_dim, "gqa_prepare: q too small");
    assert!(a.k.len() >= rows * d.kv_heads * d.head_dim && a.v.len() >= rows * d.kv_heads * d.head_dim);
    let mut st = b.lock();
    let sd = b.step_desc(&mut st, step);
    let (q, k, v, cs, sn, cache) = (a.q.ptr(), a.k.ptr(), a.v.ptr(), a.cos.ptr(), a.sin.ptr(), a.cache.ptr());
    let (qn, kn) = (a.q_norm.map_or(0, |w| w.ptr()), a.k_norm.map_or(0, |w| w.ptr()));
    let (eps, heads, kvh, hd, rot) = (a.eps, d.heads as i32, d.kv_heads as i32, d.head_dim as i32, d.rotary as i32);
    b.launch(
        &b.f.gqa_prepare,
        (rows as u32, 1, 1),
        256,
        0,
        &mut args![sd, q, k, v, qn, kn, eps, heads, kvh, hd, rot, cs, sn, cache],
    );
}

/// The queries of [`gqa_prepare`] alone (`k_gqa_prepare` without a cache).
pub(crate) fn gqa_query(b: &CudaBackend, step: &Step, a: GqaQuery<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    assert!(d.rotary.is_multiple_of(2) && d.rotary <= d.head_dim, "gqa_query: rotary {} of {}", d.rotary, d.head_dim);
    assert!(a.q.len() >= rows * d.heads * d.head_dim, "gqa_query: q too small");
    let mut st = b.lock();
    let sd = b.step_desc(&mut st, step);
    let (q, cs, sn, qn, none) = (a.q.ptr(), a.cos.ptr(), a.sin.ptr(), a.q_norm.map_or(0, |w| w.ptr()), 0u64);
    let (eps, heads, kvh, hd, rot) = (a.eps, d.heads as i32, d.kv_heads as i32, d.head_dim as i32, d.rotary as i32);
    b.launch(
        &b.f.gqa_prepare,
        (rows as u32, 1, 1),
        256,
        0,
        &mut args![sd, q, none, none, qn, none, eps, heads, kvh, hd, rot, cs, sn, none],
    );
}

pub(crate) fn gqa_attend(b: &CudaBackend, step: &Step, a: GqaAttend<'_, CudaBackend>) {
    let d = a.dims;
    let rows = step.rows();
    assert!(a.out.len() >= rows * d.heads * d.head_dim, "gqa_attend: output too small");
    let window = match d.window {
        None => 0i32,
        Some(w) => {
            assert!(w > 0, "gqa_attend: a window of 0 positions");
            w as i32
        }
    };
    let mut st = b.lock();
    let sd = b.step_desc(&mut st, step);
    if let Some(s) = a.sinks {
        assert_eq!(s.len(), d.heads, "gqa_attend: {} sinks for {} heads", s.len(), d.heads);
    }
    let (q, cache, out, sinks) = (a.q.ptr(), a.cache.ptr(), a.out.ptr(), a.sinks.map_or(0, |s| s.ptr()));
    let (heads, kvh, hd, scale) = (d.heads as i32, d.kv_heads as i32, d.head_dim as i32, d.scale);
    b.launch(
        pick(&b.f.gqa_attend, d.head_dim),
        (rows as u32, d.heads as u32, 1),
        128,
        0,
        &mut args![sd, q, cache, heads, kvh, hd, scale, window, sinks, out],
    );
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn route_noaux(
    b: &CudaBackend,
    x: &DevBuf<f32>,
    rows: usize,
    gate: &CudaMat,
    bias: &DevBuf<f32>,
    p: RouterParams,
    logits: &mut DevBuf<f32>,
    ids: &mut DevBuf<u32>,
    weights: &mut DevBuf<f32>,
) {
    let (n, hidden, k) = (gate.rows, gate.cols, p.top_k);
    assert!((1..=64).contains(&k) && k <= n, "route_noaux: top_k {k} of {n} experts");
    assert!(p.n_group >= 1 && p.n_group <= 64, "route_noaux: {} groups", p.n_group);
    assert!(p.n_group == 1 || n % p.n_group == 0, "route_noaux: {n} experts in {} groups", p.n_group);
    assert!(x.len() >= rows * hidden && logits.len() >= rows * n && bias.len() >= n, "route_noaux: buffers");
    assert!(ids.len() >= rows * k && weights.len() >= rows * k, "route_noaux: outputs too small");
    let smem = (2 * n + p.n_group) * 4;
    assert!(smem <= 48 << 10, "route_noaux: {n} experts exceed shared memory");
    let mut st = b.lock();
    let lin = Lin::plain(gate, x.ptr(), hidden, rows, logits.ptr());
    let (lp, bp, ip, wp) = (logits.ptr(), bias.ptr(), ids.ptr(), weights.ptr());
    let (ki, ng, tg, norm, sc) = (k as i32, p.n_group as i32, p.topk_group as i32, p.norm_topk_prob as i32, p.scaling);
    if rows == 1 && !b.row_kernel_eligible(&lin) {
        // One launch: the logits as `linear` computes them (k_linear_1, the same split),
        // routed by the grid's last block.
        let (split, grid) = b.small_launch(&lin);
        let done = b.ensure(&mut st.work.route_done, 1).ptr();
        let (m, xp, si) = (gate.desc, x.ptr(), split as i32);
        b.launch(
            &b.f.route_one,
            grid,
            256,
            smem as u32,
            &mut args![m, xp, lp, si, done, bp, ki, ng, tg, norm, sc, ip, wp],
        );
        return;
    }
    b.linear(&mut st, &lin);
    let ni = n as i32;
    b.launch(&b.f.route, (rows as u32, 1, 1), 256, smem as u32, &mut args![lp, ni, bp, ki, ng, tg, norm, sc, ip, wp]);
}

/// Softmax routing: the router logits as one product, then per row the softmax, top-k
/// and (renormalised where asked) scaled weights (`k_route_softmax`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_softmax(
    b: &CudaBackend,
    x: &DevBuf<f32>,
    rows: usize,
    gate: &CudaMat,
    gate_bias: Option<&DevBuf<f32>>,
    expert_scale: &DevBuf<f32>,
    routing: crate::SoftmaxRouting,
    logits: &mut DevBuf<f32>,
    ids: &mut DevBuf<u32>,
    weights: &mut DevBuf<f32>,
) {
    let (n, hidden, k) = (gate.rows, gate.cols, routing.top_k);
    assert!((1..=64).contains(&k) && k <= n, "route_softmax: top_k {k} of {n} experts");
    assert_eq!(expert_scale.len(), n, "route_softmax: {} expert scales for {n} experts", expert_scale.len());
    assert!(x.len() >= rows * hidden && logits.len() >= rows * n, "route_softmax: buffers");
    assert!(ids.len() >= rows * k && weights.len() >= rows * k, "route_softmax: outputs too small");
    let smem = n * 4;
    assert!(smem <= 48 << 10, "route_softmax: {n} experts exceed shared memory");
    assert!(gate_bias.is_none_or(|v| v.len() == n), "route_softmax: a router bias of another length than {n}");
    let mut st = b.lock();
    let lin = Lin { bias: gate_bias.map_or(0, |v| v.ptr()), ..Lin::plain(gate, x.ptr(), hidden, rows, logits.ptr()) };
    b.linear(&mut st, &lin);
    let (lp, sp, ip, wp, ni, ki) = (logits.ptr(), expert_scale.ptr(), ids.ptr(), weights.ptr(), n as i32, k as i32);
    let renorm = i32::from(routing.renormalize);
    b.launch(&b.f.route_softmax, (rows as u32, 1, 1), 256, smem as u32, &mut args![lp, ni, sp, ki, renorm, ip, wp]);
}
