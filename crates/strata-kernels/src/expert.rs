//! Matrix products and SwiGLU experts computed directly on quantized weights (encodings in
//! [`crate::quant`]), for one row (decode: a memory-bound matvec) or a few rows (prefill
//! chunks, MTP verify: each weight block is read once and applied to every row).
//!
//! Three code paths, chosen by [`KernelPath::best`] at run time: AVX-512F, AVX2 + FMA
//! (`std::arch::x86_64`, behind `is_x86_feature_detected!`) and a portable scalar path
//! (also used on other architectures). All split the output rows of `W` over rayon's
//! threads (the current pool: wrap a call in `ThreadPool::install` to choose one; calling
//! from inside the pool also saves the injection and wake-up of the calling thread).
//!
//! Determinism: every output element `y[r, o]` is accumulated by one thread, in a fixed
//! order that depends only on `o`, `x[r, ..]`, `W[o, ..]`, the matrix shape and the code
//! path — never on the thread count, on how outputs are split into blocks, or on the other
//! rows in the batch. A token's result is therefore identical computed alone or inside a
//! batch, and between runs. The three paths sum in different orders and agree within
//! rounding (about 1e-6 relative), not bit for bit: bit-equality between two computations
//! (e.g. streamed vs resident experts) needs the same path, i.e. the same machine and
//! these kernels on both sides.
//!
//! Errors: shapes are checked up front and a mismatch panics with a message naming the
//! sizes (these are programming errors, not data errors).
//!
//! Layout: `payload` may have any alignment (unaligned loads); `scales` is a `&[f32]`.
//! Each call allocates small buffers (x staged per row, for SwiGLU the `rows x inter`
//! intermediate). Calls nest inside rayon tasks (work stealing), so an engine may also
//! run several experts in parallel, each calling these; [`swiglu_experts`] runs a set of
//! experts (a layer's routed experts) in two parallel passes instead of two per expert.
//!
//! Speed (`examples/expert_bench.rs`, one GLM-5 expert = gate/up [2048, 6144] + down
//! [6144, 2048] streamed from DRAM, 16-core Xeon, 117 GB/s read bandwidth, AVX-512):
//! one row int4-g64 0.41 ms (52 GB/s, 2.3x the bandwidth floor: compute- and
//! scaling-bound), int8 0.43 ms (1.3x), bf16 0.74 ms (1.15x); 8 rows int4 1.9 ms,
//! int8 1.2 ms, bf16 1.6 ms (FMA-bound). Numbers vary by about 20% from run to run.

use crate::quant::QuantKind;
use rayon::prelude::*;

/// A quantized matrix `W[rows = out, cols = in]` borrowed from a slot, laid out as
/// [`crate::quantize`] writes it.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub kind: QuantKind,
    pub rows: usize,
    pub cols: usize,
    pub payload: &'a [u8],
    pub scales: &'a [f32],
}

impl<'a> QMatrix<'a> {
    /// Builds and [validates](Self::validate) a matrix view.
    pub fn new(kind: QuantKind, rows: usize, cols: usize, payload: &'a [u8], scales: &'a [f32]) -> Self {
        let m = Self { kind, rows, cols, payload, scales };
        m.validate();
        m
    }

    /// Panics unless the payload and scale lengths match `kind` at `rows x cols` and an
    /// int4 group is even and non-zero.
    pub fn validate(&self) {
        if let QuantKind::Int4Group { group } = self.kind {
            assert!(group >= 2 && group % 2 == 0, "QMatrix: int4 group must be even and >= 2, got {group}");
        }
        let want = self.kind.payload_bytes(self.rows, self.cols);
        assert_eq!(
            self.payload.len(),
            want,
            "QMatrix {} {}x{}: payload is {} bytes, expected {want}",
            self.kind.name(),
            self.rows,
            self.cols,
            self.payload.len()
        );
        let want = self.kind.scale_count(self.rows, self.cols);
        assert_eq!(
            self.scales.len(),
            want,
            "QMatrix {} {}x{}: {} scales, expected {want}",
            self.kind.name(),
            self.rows,
            self.cols,
            self.scales.len()
        );
    }

    /// Bytes a product reads from this matrix: payload plus scales.
    pub fn weight_bytes(&self) -> usize {
        self.payload.len() + 4 * self.scales.len()
    }
}

/// Which implementation computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 AVX2 + FMA intrinsics.
    Avx2Fma,
    /// x86-64 AVX-512F intrinsics (32-column chunks; int4 groups that are not a multiple
    /// of 32 run the AVX2 code).
    Avx512,
}

impl KernelPath {
    /// The fastest path this CPU supports.
    pub fn best() -> Self {
        [Self::Avx512, Self::Avx2Fma].into_iter().find(|p| p.is_available()).unwrap_or(Self::Scalar)
    }

    pub fn is_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Fma => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => Self::Avx2Fma.is_available() && is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2Fma | Self::Avx512 => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2Fma => "avx2+fma",
            Self::Avx512 => "avx512f",
        }
    }
}

/// `y[r, o] = sum_i x[r, i] * W[o, i]` (x: `rows x w.cols`, y: `rows x w.rows`, row-major),
/// on [`KernelPath::best`]. Panics on mismatched shapes.
pub fn qmatmul(x: &[f32], rows: usize, w: &QMatrix, y: &mut [f32]) {
    qmatmul_with(KernelPath::best(), x, rows, w, y)
}

/// [`qmatmul`] on an explicit path (panics if `path` is not available on this CPU).
pub fn qmatmul_with(path: KernelPath, x: &[f32], rows: usize, w: &QMatrix, y: &mut [f32]) {
    check_path(path);
    w.validate();
    assert_eq!(x.len(), rows * w.cols, "qmatmul: x has {} values, expected {rows} rows x {} cols", x.len(), w.cols);
    assert_eq!(y.len(), rows * w.rows, "qmatmul: y has {} values, expected {rows} rows x {} outputs", y.len(), w.rows);
    if rows == 0 || w.rows == 0 {
        return;
    }
    let job = MatJob::new(path, x, rows, w);
    let out = OutPtr { ptr: y.as_mut_ptr(), stride: w.rows };
    for_blocks(w.rows, block_size(w, rows), |o0, o1| job.run(o0, o1, &out));
}

/// One SwiGLU expert over `rows` rows: `y = down(silu(gate x) * up x)` with
/// `silu(g) = g / (1 + e^-g)`; x and y are `rows x hidden`, gate/up are
/// `[inter, hidden]`, down is `[hidden, inter]`. Panics on mismatched shapes.
pub fn swiglu_expert(x: &[f32], rows: usize, gate: &QMatrix, up: &QMatrix, down: &QMatrix, y: &mut [f32]) {
    swiglu_expert_with(KernelPath::best(), x, rows, gate, up, down, y)
}

/// [`swiglu_expert`] on an explicit path. Gate and up are computed in one parallel pass
/// (each block of intermediate outputs by one task, silu-product applied there), then down.
pub fn swiglu_expert_with(
    path: KernelPath,
    x: &[f32],
    rows: usize,
    gate: &QMatrix,
    up: &QMatrix,
    down: &QMatrix,
    y: &mut [f32],
) {
    swiglu_experts_with(path, &mut [ExpertCall { x, rows, gate: *gate, up: *up, down: *down, y }]);
}

/// One expert's work for [`swiglu_experts`]: `y = down(silu(gate x) * up x)` over `rows`
/// rows (shapes as in [`swiglu_expert`]).
pub struct ExpertCall<'a> {
    pub x: &'a [f32],
    pub rows: usize,
    pub gate: QMatrix<'a>,
    pub up: QMatrix<'a>,
    pub down: QMatrix<'a>,
    pub y: &'a mut [f32],
}

/// Several experts at once (e.g. the routed experts of one layer): two parallel passes in
/// all (gate/up of every expert, then down of every expert) instead of two per expert,
/// which saves the fork-join cost per expert (tens of microseconds on many cores). Each
/// `y` is bit-identical to [`swiglu_expert`] on the same call. Panics on mismatched
/// shapes.
pub fn swiglu_experts(calls: &mut [ExpertCall]) {
    swiglu_experts_with(KernelPath::best(), calls)
}

/// [`swiglu_experts`] on an explicit path.
pub fn swiglu_experts_with(path: KernelPath, calls: &mut [ExpertCall]) {
    check_path(path);
    for c in calls.iter() {
        let (gate, up, down) = (&c.gate, &c.up, &c.down);
        for m in [gate, up, down] {
            m.validate();
        }
        let (inter, hidden) = (gate.rows, gate.cols);
        assert!(
            up.rows == inter && up.cols == hidden && down.rows == hidden && down.cols == inter,
            "swiglu_expert: shapes gate {}x{}, up {}x{}, down {}x{}; expected gate = up = [inter, hidden], down = [hidden, inter]",
            gate.rows,
            gate.cols,
            up.rows,
            up.cols,
            down.rows,
            down.cols
        );
        let rows = c.rows;
        assert_eq!(
            c.x.len(),
            rows * hidden,
            "swiglu_expert: x has {} values, expected {rows} rows x {hidden}",
            c.x.len()
        );
        assert_eq!(
            c.y.len(),
            rows * hidden,
            "swiglu_expert: y has {} values, expected {rows} rows x {hidden}",
            c.y.len()
        );
    }
    let live: Vec<usize> = (0..calls.len()).filter(|&i| calls[i].rows > 0 && calls[i].gate.cols > 0).collect();
    // Pass 1: gate and up, h = silu(g) * u.
    let mut gh: Vec<(Vec<f32>, Vec<f32>)> = live
        .iter()
        .map(|&i| (vec![0f32; calls[i].rows * calls[i].gate.rows], vec![0f32; calls[i].rows * calls[i].gate.rows]))
        .collect();
    {
        let jobs: Vec<(MatJob, MatJob)> = live
            .iter()
            .map(|&i| {
                let c = &calls[i];
                (MatJob::new(path, c.x, c.rows, &c.gate), MatJob::new(path, c.x, c.rows, &c.up))
            })
            .collect();
        let outs: Vec<(OutPtr, OutPtr)> = gh
            .iter_mut()
            .zip(&live)
            .map(|((g, h), &i)| {
                let inter = calls[i].gate.rows;
                (OutPtr { ptr: g.as_mut_ptr(), stride: inter }, OutPtr { ptr: h.as_mut_ptr(), stride: inter })
            })
            .collect();
        let mut blocks = Vec::new();
        for (j, &i) in live.iter().enumerate() {
            let (inter, bs) = (calls[i].gate.rows, block_size(&calls[i].gate, calls[i].rows));
            blocks.extend((0..inter.div_ceil(bs)).map(|b| (j, b * bs, ((b + 1) * bs).min(inter))));
        }
        for_items(&blocks, |&(j, o0, o1)| {
            let ((gj, uj), (g_out, h_out)) = (&jobs[j], &outs[j]);
            gj.run(o0, o1, g_out);
            uj.run(o0, o1, h_out);
            let inter = g_out.stride;
            for r in 0..gj.rows {
                for o in o0..o1 {
                    // SAFETY: this task owns outputs o0..o1 of every row in both buffers.
                    unsafe {
                        let gv = *g_out.ptr.add(r * inter + o);
                        let hp = h_out.ptr.add(r * inter + o);
                        *hp *= silu(gv);
                    }
                }
            }
        });
    }
    // Pass 2: down.
    let jobs: Vec<MatJob> =
        live.iter().zip(&gh).map(|(&i, (_, h))| MatJob::new(path, h, calls[i].rows, &calls[i].down)).collect();
    let mut outs: Vec<Option<OutPtr>> = (0..calls.len()).map(|_| None).collect();
    for (i, c) in calls.iter_mut().enumerate() {
        outs[i] = Some(OutPtr { ptr: c.y.as_mut_ptr(), stride: c.down.rows });
    }
    let mut blocks = Vec::new();
    for (j, &i) in live.iter().enumerate() {
        let (hidden, bs) = (calls[i].down.rows, block_size(&calls[i].down, calls[i].rows));
        blocks.extend((0..hidden.div_ceil(bs)).map(|b| (j, b * bs, ((b + 1) * bs).min(hidden))));
    }
    for_items(&blocks, |&(j, o0, o1)| jobs[j].run(o0, o1, outs[live[j]].as_ref().unwrap()));
}

#[inline]
fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

fn check_path(path: KernelPath) {
    assert!(path.is_available(), "kernel path {} is not available on this CPU", path.name());
}

/// Raw output pointer shared by the tasks; each task writes a disjoint set of columns.
struct OutPtr {
    ptr: *mut f32,
    stride: usize,
}
// SAFETY: tasks write disjoint elements (distinct output columns), see `for_blocks`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `r, o` in bounds of the buffer and owned by the calling task.
    #[inline(always)]
    unsafe fn write(&self, r: usize, o: usize, v: f32) {
        *self.ptr.add(r * self.stride + o) = v;
    }
}

/// Outputs per task: a multiple of 8, about 64 KiB of weights (up to 1 MiB for many rows,
/// since each task reads all of x), at least 4 tasks a thread. (Results do not depend on
/// this split.)
fn block_size(w: &QMatrix, rows: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let row_bytes = w.kind.payload_bytes(1, w.cols).max(1);
    let by_bytes = (64 * 1024 * (rows / 8).clamp(1, 16)) / row_bytes;
    let by_threads = w.rows.div_ceil(threads * 4);
    by_bytes.min(by_threads).max(8).next_multiple_of(8)
}

/// Runs `f` on every item, in parallel when there are several.
fn for_items<T: Sync>(items: &[T], f: impl Fn(&T) + Sync) {
    if items.len() <= 1 {
        items.iter().for_each(f);
    } else {
        items.par_iter().for_each(&f);
    }
}

fn for_blocks(out: usize, block: usize, f: impl Fn(usize, usize) + Sync) {
    let n = out.div_ceil(block);
    if n <= 1 {
        f(0, out);
    } else {
        (0..n).into_par_iter().for_each(|b| f(b * block, ((b + 1) * block).min(out)));
    }
}

/// One product prepared for block-wise evaluation.
struct MatJob<'a> {
    path: KernelPath,
    x: &'a [f32],
    rows: usize,
    w: QMatrix<'a>,
    /// SIMD paths: chunk width in columns (16 for the AVX2 code, 32 for AVX-512, 0 for the
    /// scalar path); decides which code runs.
    cw: usize,
    /// SIMD paths: the full chunks of x, row `r` at `r * xstride`, the stride padded so
    /// rows do not alias in L1 (4 KiB apart); for int4 each chunk is reordered as its even
    /// then its odd columns (the order nibbles unpack in), see `stage_int4`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xs: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xstride: usize,
    /// Int4 with a group multiple of `cw` on a SIMD path: see `int4_xg`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xg: Vec<f32>,
}

impl<'a> MatJob<'a> {
    fn new(path: KernelPath, x: &'a [f32], rows: usize, w: &QMatrix<'a>) -> Self {
        let cw = match (path, w.kind) {
            (KernelPath::Scalar, _) => 0,
            (KernelPath::Avx512, QuantKind::Int4Group { group }) if group % 32 != 0 => 16,
            (KernelPath::Avx512, _) => 32,
            (KernelPath::Avx2Fma, _) => 16,
        };
        let (mut xs, mut xstride, mut xg) = (Vec::new(), 0, Vec::new());
        if let Some(nfull) = w.cols.checked_div(cw) {
            let cols = w.cols;
            xstride = nfull * cw + cw;
            xs = vec![0f32; rows * xstride];
            let half = cw / 2;
            for r in 0..rows {
                let src = &x[r * cols..r * cols + nfull * cw];
                let dst = &mut xs[r * xstride..r * xstride + nfull * cw];
                if let QuantKind::Int4Group { group } = w.kind {
                    for (d, c) in dst.chunks_exact_mut(cw).zip(src.chunks_exact(cw)) {
                        for j in 0..half {
                            let (xa, xb) = (c[2 * j], c[2 * j + 1]);
                            if group % cw == 0 {
                                // See `avx2::I4Dec`: lo * (xa - xb/16) + byte * (xb/16).
                                d[j] = xa - xb / 16.0;
                                d[half + j] = xb / 16.0;
                            } else {
                                d[j] = xa;
                                d[half + j] = xb;
                            }
                        }
                    }
                } else {
                    dst.copy_from_slice(src);
                }
            }
            if let QuantKind::Int4Group { group } = w.kind {
                if group % cw == 0 {
                    xg = int4_xg(x, rows, w.cols, group, cw);
                }
            }
        }
        Self { path, x, rows, w: *w, cw, xs, xstride, xg }
    }

    /// Computes outputs `o0..o1` of every row into `out`.
    fn run(&self, o0: usize, o1: usize, out: &OutPtr) {
        match self.path {
            KernelPath::Scalar => scalar_block(&self.w, self.x, self.rows, o0, o1, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path was checked available; shapes were validated.
            KernelPath::Avx2Fma => unsafe { avx2::block(self, o0, o1, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (AVX-512 availability implies AVX2 + FMA).
            KernelPath::Avx512 => unsafe {
                if self.cw == 32 {
                    avx512::block(self, o0, o1, out)
                } else {
                    avx2::block(self, o0, o1, out)
                }
            },
            #[cfg(not(target_arch = "x86_64"))]
            KernelPath::Avx2Fma | KernelPath::Avx512 => unreachable!(),
        }
    }
}

/// `8 * sum` of x over each group's columns that lie in full chunks of `cw` columns
/// (`rows x groups`, summed in column order; 0 for a group with none): the `- 8` part of
/// the int4 weights, subtracted once per output (see `avx2::I4Dec`).
fn int4_xg(x: &[f32], rows: usize, cols: usize, group: usize, cw: usize) -> Vec<f32> {
    let (nfull, groups) = (cols / cw, cols.div_ceil(group));
    let mut xg = vec![0f32; rows * groups];
    for r in 0..rows {
        for (c, v) in x[r * cols..r * cols + nfull * cw].iter().enumerate() {
            xg[r * groups + c / group] += v;
        }
    }
    xg.iter_mut().for_each(|v| *v *= 8.0);
    xg
}

// ---------------------------------------------------------------- scalar path

/// Decodes row `o` of `w` into `dst[..w.cols]` (same values as [`crate::dequantize`]).
fn dequant_row(w: &QMatrix, o: usize, dst: &mut [f32]) {
    let cols = w.cols;
    let dst = &mut dst[..cols];
    match w.kind {
        QuantKind::F32 => {
            let src = &w.payload[o * cols * 4..(o + 1) * cols * 4];
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QuantKind::Bf16 => {
            let src = &w.payload[o * cols * 2..(o + 1) * cols * 2];
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        QuantKind::Int8Row => {
            let s = w.scales[o];
            for (d, &q) in dst.iter_mut().zip(&w.payload[o * cols..(o + 1) * cols]) {
                *d = q as i8 as f32 * s;
            }
        }
        QuantKind::Int4Group { group } => {
            let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
            let src = &w.payload[o * half..(o + 1) * half];
            let sc = &w.scales[o * groups..(o + 1) * groups];
            for (g, (dchunk, s)) in dst.chunks_mut(group).zip(sc).enumerate() {
                let c0 = g * group; // even, so each group starts on a byte
                for (j, d) in dchunk.iter_mut().enumerate() {
                    let byte = src[(c0 + j) / 2];
                    let nib = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    *d = (nib as i32 - 8) as f32 * s;
                }
            }
        }
    }
}

/// Dot product in a fixed order: 8 interleaved partial sums, a fixed tree, then the tail.
#[inline]
fn dot_scalar(w: &[f32], x: &[f32]) -> f32 {
    let n8 = w.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (wc, xc) in w[..n8].chunks_exact(8).zip(x[..n8].chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += wc[j] * xc[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (a, b) in w[n8..].iter().zip(&x[n8..]) {
        s += a * b;
    }
    s
}

fn scalar_block(w: &QMatrix, x: &[f32], rows: usize, o0: usize, o1: usize, out: &OutPtr) {
    let cols = w.cols;
    let mut wrow = vec![0f32; cols];
    for o in o0..o1 {
        dequant_row(w, o, &mut wrow);
        for r in 0..rows {
            let v = dot_scalar(&wrow, &x[r * cols..(r + 1) * cols]);
            // SAFETY: o in this task's block, r < rows.
            unsafe { out.write(r, o, v) };
        }
    }
}

// ---------------------------------------------------------------- AVX2 path

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Register tiles of OT outputs x RT rows. Columns go in chunks of 16: a chunk's weights
    //! decode to two 8-lane vectors `a`, `b`, and each (output, row) pair does
    //! `g = fma(a, xa, g); g = fma(b, xb, g)`, chunks in order. For int4 (group a multiple
    //! of 16) `a`, `b` are the raw nibbles `n` (0..15) and at the end of each group the pair
    //! folds `acc = fma(g, scale, acc)`, then resets `g` (the `- 8` is subtracted once per
    //! output, see `I4Dec`); int8
    //! accumulates `q` and multiplies by the row scale at the end. Then a fixed horizontal
    //! sum and the `cols % 16` tail in scalar.
    //!
    //! The pair's arithmetic is the same whatever the tile shape, the column blocking (the
    //! pair's vectors are stored and reloaded exactly between column blocks) or the output
    //! block, which is what makes results independent of the batch and of the threads.
    //! For int4, `a` holds a chunk's even columns and `b` its odd columns (x is
    //! pre-permuted to match, see `I4Dec`); otherwise `a` = columns 0..8 and `b` = 8..16.

    use super::{MatJob, OutPtr, QuantKind};
    use std::arch::x86_64::*;

    pub(super) trait Decode {
        /// Outputs per tile for a one-row tile (fewer where a pair needs more registers).
        const WIDE: usize = 8;
        /// Whether the pair folds `g` into `acc` at segment ends (see `seg_end`).
        const SEGMENTED: bool = false;
        /// Chunks per segment (the int4 group / 16) when SEGMENTED.
        fn seg_chunks(&self) -> usize {
            usize::MAX
        }
        /// The two weight vectors of chunk `k` of output `o`.
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256);
        /// Payload bytes of one chunk of one output.
        const CHUNK_BYTES: usize;
        /// Address of chunk `k` of output `o` (for prefetching).
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8;
        /// Folds a finished segment `s` of output `o`, row `r`.
        #[inline(always)]
        unsafe fn seg_end(&self, _o: usize, _s: usize, _r: usize, _g: __m256, acc: __m256) -> __m256 {
            acc
        }
        /// SEGMENTED: what to subtract from output `o`, row `r` after the horizontal sum.
        #[inline(always)]
        unsafe fn corr(&self, _o: usize, _r: usize) -> f32 {
            0.0
        }
        /// Adds the scalar tail (columns `16 * nfull ..`) and any per-row scale to `simd`.
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32;
    }

    struct F32Dec<'a> {
        p: &'a [u8],
        cols: usize,
        nfull: usize,
    }
    impl Decode for F32Dec<'_> {
        const CHUNK_BYTES: usize = 64;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add((o * self.cols + k * 16) * 4)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
            let p = self.p.as_ptr().add((o * self.cols + k * 16) * 4) as *const f32;
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            let mut s = simd;
            for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
                let b = &self.p[(o * self.cols + c) * 4..][..4];
                s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * xv;
            }
            s
        }
    }

    struct Bf16Dec<'a> {
        p: &'a [u8],
        cols: usize,
        nfull: usize,
    }
    impl Decode for Bf16Dec<'_> {
        const CHUNK_BYTES: usize = 32;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add((o * self.cols + k * 16) * 2)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
            let p = self.p.as_ptr().add((o * self.cols + k * 16) * 2);
            let a = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            let b = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
            (_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            let mut s = simd;
            for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
                let b = &self.p[(o * self.cols + c) * 2..][..2];
                s += f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) * xv;
            }
            s
        }
    }

    /// int8-row: accumulates q * x and applies the row scale once at the end.
    struct I8Dec<'a> {
        p: &'a [u8],
        scales: &'a [f32],
        cols: usize,
        nfull: usize,
    }
    impl Decode for I8Dec<'_> {
        const CHUNK_BYTES: usize = 16;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add(o * self.cols + k * 16)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
            let p = self.p.as_ptr().add(o * self.cols + k * 16);
            let a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
            (_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            let mut s = simd;
            for (c, xv) in x.iter().enumerate().skip(self.nfull * 16) {
                s += self.p[o * self.cols + c] as i8 as f32 * xv;
            }
            s * self.scales[o]
        }
    }

    /// int4 with `group % 16 == 0`. A chunk is 8 bytes `v = lo + 16 hi` (lo = even column,
    /// hi = odd column); it decodes to `a = lo`, `b = v` (no shift, one convert each), and
    /// x is staged as `xa' = xa - xb/16`, `xb' = xb/16`, so that
    /// `a xa' + b xb' = lo xa + hi xb` (the raw nibbles, 0..15). A segment (group) ends
    /// with `acc = fma(g, scale[o, s], acc)`; after the horizontal sum the output subtracts
    /// `sum_s scale[o, s] * xg[r, s]` (`xg` = 8 times the group sums of x, see `int4_xg`),
    /// so the `- 8` offset and the scale cost nothing per weight.
    struct I4Dec<'a> {
        p: &'a [u8],
        scales: &'a [f32],
        xg: &'a [f32],
        cols: usize,
        half: usize,
        group: usize,
        groups: usize,
        nfull: usize,
    }
    impl Decode for I4Dec<'_> {
        const CHUNK_BYTES: usize = 8;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add(o * self.half + k * 8)
        }
        const WIDE: usize = 4;
        const SEGMENTED: bool = true;
        fn seg_chunks(&self) -> usize {
            self.group / 16
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
            let p = self.p.as_ptr().add(o * self.half + k * 8);
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let lo = _mm256_and_si256(v, _mm256_set1_epi32(0x0f));
            (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(v))
        }
        #[inline(always)]
        unsafe fn seg_end(&self, o: usize, s: usize, r: usize, g: __m256, acc: __m256) -> __m256 {
            let _ = r;
            _mm256_fmadd_ps(g, _mm256_broadcast_ss(self.scales.get_unchecked(o * self.groups + s)), acc)
        }
        #[inline(always)]
        unsafe fn corr(&self, o: usize, r: usize) -> f32 {
            let (sp, xp) = (self.scales.as_ptr().add(o * self.groups), self.xg.as_ptr().add(r * self.groups));
            let n8 = self.groups / 8 * 8;
            let mut v = _mm256_setzero_ps();
            for i in (0..n8).step_by(8) {
                v = _mm256_fmadd_ps(_mm256_loadu_ps(sp.add(i)), _mm256_loadu_ps(xp.add(i)), v);
            }
            let mut c = hsum(v);
            for i in n8..self.groups {
                c += *sp.add(i) * *xp.add(i);
            }
            c
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            i4_tail(self.p, self.scales, self.half, self.group, self.groups, self.nfull, self.cols, o, simd, x)
        }
    }

    /// int4 with any even group: per-lane scales gathered in scalar (slow, uncommon).
    struct I4AnyDec<'a> {
        p: &'a [u8],
        scales: &'a [f32],
        cols: usize,
        half: usize,
        group: usize,
        groups: usize,
        nfull: usize,
    }
    impl Decode for I4AnyDec<'_> {
        const CHUNK_BYTES: usize = 8;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add(o * self.half + k * 8)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m256, __m256) {
            let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
            let row = &self.p[o * self.half..];
            let sc = &self.scales[o * self.groups..];
            for j in 0..8 {
                let c = k * 16 + 2 * j;
                let byte = row[c / 2];
                a[j] = ((byte & 0x0f) as i32 - 8) as f32 * sc[c / self.group];
                b[j] = ((byte >> 4) as i32 - 8) as f32 * sc[(c + 1) / self.group];
            }
            (_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr()))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            i4_tail(self.p, self.scales, self.half, self.group, self.groups, self.nfull, self.cols, o, simd, x)
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn i4_tail(
        p: &[u8],
        scales: &[f32],
        half: usize,
        group: usize,
        groups: usize,
        nfull: usize,
        cols: usize,
        o: usize,
        simd: f32,
        x: &[f32],
    ) -> f32 {
        let mut s = simd;
        for c in nfull * 16..cols {
            let byte = p[o * half + c / 2];
            let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            s += (nib as i32 - 8) as f32 * scales[o * groups + c / group] * x[c];
        }
        s
    }

    /// x as the kernels read it: row `r`, chunk `k` at `ptr + r * stride + 16 k`.
    struct XRows {
        ptr: *const f32,
        stride: usize,
    }

    struct Ctx<'a, D> {
        d: D,
        xs: XRows,
        x: &'a [f32],
        cols: usize,
        nfull: usize,
    }

    /// # Safety
    /// AVX2 and FMA available; `job` validated; `o0..o1` owned by the caller.
    pub(super) unsafe fn block(job: &MatJob, o0: usize, o1: usize, out: &OutPtr) {
        let w = &job.w;
        let (cols, nfull) = (w.cols, w.cols / 16);
        let plain = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
        match w.kind {
            QuantKind::F32 => {
                let d = F32Dec { p: w.payload, cols, nfull };
                rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
            QuantKind::Bf16 => {
                let d = Bf16Dec { p: w.payload, cols, nfull };
                rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
            QuantKind::Int8Row => {
                let d = I8Dec { p: w.payload, scales: w.scales, cols, nfull };
                rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
            QuantKind::Int4Group { group } => {
                let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
                let xs = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
                if group % 16 == 0 {
                    let (p, scales, xg) = (w.payload, w.scales, &job.xg[..]);
                    let d = I4Dec { p, scales, xg, cols, half, group, groups, nfull };
                    rows_block(&Ctx { d, xs, x: job.x, cols, nfull }, job.rows, o0, o1, out)
                } else {
                    let d = I4AnyDec { p: w.payload, scales: w.scales, cols, half, group, groups, nfull };
                    rows_block(&Ctx { d, xs, x: job.x, cols, nfull }, job.rows, o0, o1, out)
                }
            }
        }
    }

    /// Row tiles of up to 8 rows; within a tile, output groups of OT and column blocks
    /// that keep the tile's x in L1.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_block<D: Decode>(c: &Ctx<D>, rows: usize, o0: usize, o1: usize, out: &OutPtr) {
        // Per output: 2 * RT vectors (g then acc) carried between column blocks.
        let mut state = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let rt = (rows - r0).min(8);
            // Column blocks keep a multi-row tile's x (16 KiB) in L1; one row is not split.
            let mut kb = if rt == 1 { c.nfull.max(1) } else { ((16 << 10) / (rt * 64)).max(1) };
            if D::SEGMENTED {
                kb = kb.next_multiple_of(c.d.seg_chunks());
            }
            if kb < c.nfull && state.is_empty() {
                state = vec![_mm256_setzero_ps(); (o1 - o0) * 2 * 8];
            }
            let st = &mut state[..];
            match (rt, D::WIDE) {
                (1, 8) => outs::<D, 8, 1>(c, r0, o0, o1, kb, st, out),
                (1, 4) => outs::<D, 4, 1>(c, r0, o0, o1, kb, st, out),
                (1, _) => outs::<D, 2, 1>(c, r0, o0, o1, kb, st, out),
                (2, 8) => outs::<D, 4, 2>(c, r0, o0, o1, kb, st, out),
                (2, _) => outs::<D, 2, 2>(c, r0, o0, o1, kb, st, out),
                (3, 8) => outs::<D, 2, 3>(c, r0, o0, o1, kb, st, out),
                (4, 8) => outs::<D, 2, 4>(c, r0, o0, o1, kb, st, out),
                (3, _) => outs::<D, 1, 3>(c, r0, o0, o1, kb, st, out),
                (4, _) => outs::<D, 1, 4>(c, r0, o0, o1, kb, st, out),
                (5, _) => outs::<D, 1, 5>(c, r0, o0, o1, kb, st, out),
                (6, _) => outs::<D, 1, 6>(c, r0, o0, o1, kb, st, out),
                (7, _) => outs::<D, 1, 7>(c, r0, o0, o1, kb, st, out),
                _ => outs::<D, 1, 8>(c, r0, o0, o1, kb, st, out),
            }
            r0 += rt;
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn outs<D: Decode, const OT: usize, const RT: usize>(
        c: &Ctx<D>,
        r0: usize,
        o0: usize,
        o1: usize,
        kb: usize,
        state: &mut [__m256],
        out: &OutPtr,
    ) {
        let mut k0 = 0;
        loop {
            let k1 = (k0 + kb).min(c.nfull);
            let last = k1 == c.nfull;
            let mut o = o0;
            while o + OT <= o1 {
                // (Empty with a single column block: `tile` then never touches it.)
                let st = state.get_mut((o - o0) * 2 * RT..(o - o0 + OT) * 2 * RT).unwrap_or_default();
                tile::<D, OT, RT>(c, r0, o, k0, k1, st, last, out);
                o += OT;
            }
            while o < o1 {
                let st = state.get_mut((o - o0) * 2 * RT..(o - o0 + 1) * 2 * RT).unwrap_or_default();
                tile::<D, 1, RT>(c, r0, o, k0, k1, st, last, out);
                o += 1;
            }
            if last {
                break;
            }
            k0 = k1;
        }
    }

    /// Chunks `k0..k1` of a tile; resumes from `state` unless `k0 == 0`, and writes the
    /// results if `last`, else saves `state` (per output: RT `g` vectors, then RT `acc`).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<D: Decode, const OT: usize, const RT: usize>(
        c: &Ctx<D>,
        r0: usize,
        o0: usize,
        k0: usize,
        k1: usize,
        state: &mut [__m256],
        last: bool,
        out: &OutPtr,
    ) {
        let mut g = [[_mm256_setzero_ps(); RT]; OT];
        let mut acc = [[_mm256_setzero_ps(); RT]; OT];
        if k0 > 0 {
            for oi in 0..OT {
                for ri in 0..RT {
                    g[oi][ri] = state[oi * 2 * RT + ri];
                    acc[oi][ri] = state[oi * 2 * RT + RT + ri];
                }
            }
        }
        let spc = c.d.seg_chunks();
        let mut k = k0;
        // Segment of chunk k and where it ends.
        let (mut s, mut seg_end) = if D::SEGMENTED { (k0 / spc, (k0 / spc + 1) * spc) } else { (0, usize::MAX) };
        while k < k1 {
            let kend = k1.min(seg_end);
            while k < kend {
                // The next tile's weights (same chunks, next outputs), a line at a time:
                // rows of W are read in short pieces (a tile's rows in parallel, column
                // blocks) that the hardware prefetcher does not run ahead of.
                if k & ((64 / D::CHUNK_BYTES).max(1) - 1) == 0 {
                    for oi in 0..OT {
                        _mm_prefetch::<PF_HINT>(c.d.chunk_ptr(o0 + OT + oi, k) as *const i8);
                    }
                }
                for (oi, g_o) in g.iter_mut().enumerate() {
                    let (wa, wb) = c.d.chunk(o0 + oi, k);
                    for (ri, gv) in g_o.iter_mut().enumerate() {
                        let xp = c.xs.ptr.add((r0 + ri) * c.xs.stride + k * 16);
                        *gv = _mm256_fmadd_ps(wa, _mm256_loadu_ps(xp), *gv);
                        *gv = _mm256_fmadd_ps(wb, _mm256_loadu_ps(xp.add(8)), *gv);
                    }
                }
                k += 1;
            }
            if D::SEGMENTED && (k == seg_end || k == c.nfull) {
                for oi in 0..OT {
                    for ri in 0..RT {
                        acc[oi][ri] = c.d.seg_end(o0 + oi, s, r0 + ri, g[oi][ri], acc[oi][ri]);
                        g[oi][ri] = _mm256_setzero_ps();
                    }
                }
                s += 1;
                seg_end += spc;
            }
        }
        if last {
            for oi in 0..OT {
                for ri in 0..RT {
                    let r = r0 + ri;
                    let v = if D::SEGMENTED { acc[oi][ri] } else { g[oi][ri] };
                    let mut v = hsum(v);
                    if D::SEGMENTED {
                        v -= c.d.corr(o0 + oi, r);
                    }
                    let v = c.d.finish(o0 + oi, v, &c.x[r * c.cols..(r + 1) * c.cols]);
                    out.write(r, o0 + oi, v);
                }
            }
        } else {
            for oi in 0..OT {
                for ri in 0..RT {
                    state[oi * 2 * RT + ri] = g[oi][ri];
                    state[oi * 2 * RT + RT + ri] = acc[oi][ri];
                }
            }
        }
    }

    const PF_HINT: i32 = _MM_HINT_T0;

    /// Horizontal sum in a fixed order: (lo128 + hi128), then pairs, then the last two.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX2 scheme (see `avx2`) at twice the width: chunks of 32 columns decode to two
    //! 16-lane vectors `a`, `b` (int4: 16 even and 16 odd columns), 32 vector registers
    //! allow more accumulators per tile. Int4 with a group that is not a multiple of 32
    //! runs the AVX2 code instead (see `MatJob::new`). Same determinism argument: a pair's
    //! arithmetic does not depend on the tile shape, the column blocks or the other rows.

    use super::{MatJob, OutPtr, QuantKind};
    use std::arch::x86_64::*;

    pub(super) trait Decode {
        /// Accumulator registers per pair (int4: 2).
        const REGS: usize = 1;
        /// Whether the pair folds `g` into `acc` at segment ends (see `seg_end`).
        const SEGMENTED: bool = false;
        /// Chunks per segment (the int4 group / 32) when SEGMENTED.
        fn seg_chunks(&self) -> usize {
            usize::MAX
        }
        /// The two weight vectors of chunk `k` of output `o`.
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512);
        /// Payload bytes of one chunk of one output.
        const CHUNK_BYTES: usize;
        /// Address of chunk `k` of output `o` (for prefetching).
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8;
        /// Folds a finished segment `s` of output `o`, row `r`.
        #[inline(always)]
        unsafe fn seg_end(&self, _o: usize, _s: usize, _r: usize, _g: __m512, acc: __m512) -> __m512 {
            acc
        }
        /// SEGMENTED: what to subtract from output `o`, row `r` after the horizontal sum.
        #[inline(always)]
        unsafe fn corr(&self, _o: usize, _r: usize) -> f32 {
            0.0
        }
        /// Adds the scalar tail (columns `32 * nfull ..`) and any per-row scale to `simd`.
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32;
    }

    struct F32Dec<'a> {
        p: &'a [u8],
        cols: usize,
        nfull: usize,
    }
    impl Decode for F32Dec<'_> {
        const CHUNK_BYTES: usize = 128;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add((o * self.cols + k * 32) * 4)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
            let p = self.p.as_ptr().add((o * self.cols + k * 32) * 4) as *const f32;
            (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            let mut s = simd;
            for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
                let b = &self.p[(o * self.cols + c) * 4..][..4];
                s += f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * xv;
            }
            s
        }
    }

    struct Bf16Dec<'a> {
        p: &'a [u8],
        cols: usize,
        nfull: usize,
    }
    impl Decode for Bf16Dec<'_> {
        const CHUNK_BYTES: usize = 64;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add((o * self.cols + k * 32) * 2)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
            let p = self.p.as_ptr().add((o * self.cols + k * 32) * 2);
            let a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            let b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(32) as *const __m256i));
            (_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            let mut s = simd;
            for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
                let b = &self.p[(o * self.cols + c) * 2..][..2];
                s += f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16) * xv;
            }
            s
        }
    }

    /// int8-row: accumulates q * x and applies the row scale once at the end.
    struct I8Dec<'a> {
        p: &'a [u8],
        scales: &'a [f32],
        cols: usize,
        nfull: usize,
    }
    impl Decode for I8Dec<'_> {
        const CHUNK_BYTES: usize = 32;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add(o * self.cols + k * 32)
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
            let p = self.p.as_ptr().add(o * self.cols + k * 32);
            let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
            let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
            (_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b))
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            let mut s = simd;
            for (c, xv) in x.iter().enumerate().skip(self.nfull * 32) {
                s += self.p[o * self.cols + c] as i8 as f32 * xv;
            }
            s * self.scales[o]
        }
    }

    /// int4 with `group % 32 == 0`: 16 bytes a chunk, otherwise as `avx2::I4Dec`.
    struct I4Dec<'a> {
        p: &'a [u8],
        scales: &'a [f32],
        xg: &'a [f32],
        cols: usize,
        half: usize,
        group: usize,
        groups: usize,
        nfull: usize,
    }
    impl Decode for I4Dec<'_> {
        const CHUNK_BYTES: usize = 16;
        #[inline(always)]
        fn chunk_ptr(&self, o: usize, k: usize) -> *const u8 {
            self.p.as_ptr().wrapping_add(o * self.half + k * 16)
        }
        const REGS: usize = 2;
        const SEGMENTED: bool = true;
        fn seg_chunks(&self) -> usize {
            self.group / 32
        }
        #[inline(always)]
        unsafe fn chunk(&self, o: usize, k: usize) -> (__m512, __m512) {
            let p = self.p.as_ptr().add(o * self.half + k * 16);
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            // The low nibble as a float straight from a 16-entry table (the permute reads
            // only the index's low 4 bits): the same value as converting `v & 15`.
            let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
            (_mm512_permutexvar_ps(v, table), _mm512_cvtepi32_ps(v))
        }
        #[inline(always)]
        unsafe fn seg_end(&self, o: usize, s: usize, r: usize, g: __m512, acc: __m512) -> __m512 {
            let _ = r;
            _mm512_fmadd_ps(g, _mm512_set1_ps(*self.scales.get_unchecked(o * self.groups + s)), acc)
        }
        #[inline(always)]
        unsafe fn corr(&self, o: usize, r: usize) -> f32 {
            let (sp, xp) = (self.scales.as_ptr().add(o * self.groups), self.xg.as_ptr().add(r * self.groups));
            let n16 = self.groups / 16 * 16;
            let mut v = _mm512_setzero_ps();
            for i in (0..n16).step_by(16) {
                v = _mm512_fmadd_ps(_mm512_loadu_ps(sp.add(i)), _mm512_loadu_ps(xp.add(i)), v);
            }
            let mut c = hsum(v);
            for i in n16..self.groups {
                c += *sp.add(i) * *xp.add(i);
            }
            c
        }
        fn finish(&self, o: usize, simd: f32, x: &[f32]) -> f32 {
            i4_tail(self.p, self.scales, self.half, self.group, self.groups, self.nfull, self.cols, o, simd, x)
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn i4_tail(
        p: &[u8],
        scales: &[f32],
        half: usize,
        group: usize,
        groups: usize,
        nfull: usize,
        cols: usize,
        o: usize,
        simd: f32,
        x: &[f32],
    ) -> f32 {
        let mut s = simd;
        for c in nfull * 32..cols {
            let byte = p[o * half + c / 2];
            let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            s += (nib as i32 - 8) as f32 * scales[o * groups + c / group] * x[c];
        }
        s
    }

    /// x as the kernels read it: row `r`, chunk `k` at `ptr + r * stride + 32 k`.
    struct XRows {
        ptr: *const f32,
        stride: usize,
    }

    struct Ctx<'a, D> {
        d: D,
        xs: XRows,
        x: &'a [f32],
        cols: usize,
        nfull: usize,
    }

    /// # Safety
    /// AVX2 and FMA available; `job` validated; `o0..o1` owned by the caller.
    pub(super) unsafe fn block(job: &MatJob, o0: usize, o1: usize, out: &OutPtr) {
        let w = &job.w;
        let (cols, nfull) = (w.cols, w.cols / 32);
        let plain = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
        match w.kind {
            QuantKind::F32 => {
                let d = F32Dec { p: w.payload, cols, nfull };
                rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
            QuantKind::Bf16 => {
                let d = Bf16Dec { p: w.payload, cols, nfull };
                rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
            QuantKind::Int8Row => {
                let d = I8Dec { p: w.payload, scales: w.scales, cols, nfull };
                rows_block(&Ctx { d, xs: plain, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
            QuantKind::Int4Group { group } => {
                let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
                let xs = XRows { ptr: job.xs.as_ptr(), stride: job.xstride };
                debug_assert_eq!(group % 32, 0, "int4 groups not a multiple of 32 run on the AVX2 code");
                let (p, scales, xg) = (w.payload, w.scales, &job.xg[..]);
                let d = I4Dec { p, scales, xg, cols, half, group, groups, nfull };
                rows_block(&Ctx { d, xs, x: job.x, cols, nfull }, job.rows, o0, o1, out)
            }
        }
    }

    /// Row tiles of up to 8 rows; within a tile, output groups of OT and column blocks
    /// that keep the tile's x in L1.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_block<D: Decode>(c: &Ctx<D>, rows: usize, o0: usize, o1: usize, out: &OutPtr) {
        // Per output: 2 * RT vectors (g then acc) carried between column blocks.
        let mut state = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let rt = (rows - r0).min(8);
            // Column blocks keep a multi-row tile's x (16 KiB) in L1; one row is not split.
            let mut kb = if rt == 1 { c.nfull.max(1) } else { ((16 << 10) / (rt * 128)).max(1) };
            if D::SEGMENTED {
                kb = kb.next_multiple_of(c.d.seg_chunks());
            }
            if kb < c.nfull && state.is_empty() {
                state = vec![_mm512_setzero_ps(); (o1 - o0) * 2 * 8];
            }
            let st = &mut state[..];
            // Up to 16 accumulators (8 pairs for int4, which carry two; 16 pairs from 5 rows,
            // their `acc` vectors spill, touched once a group).
            match (rt, D::REGS) {
                (1, _) => outs::<D, 8, 1>(c, r0, o0, o1, kb, st, out),
                (2, 1) => outs::<D, 8, 2>(c, r0, o0, o1, kb, st, out),
                (2, _) => outs::<D, 4, 2>(c, r0, o0, o1, kb, st, out),
                (3, 1) => outs::<D, 4, 3>(c, r0, o0, o1, kb, st, out),
                (4, 1) => outs::<D, 4, 4>(c, r0, o0, o1, kb, st, out),
                (3, _) => outs::<D, 2, 3>(c, r0, o0, o1, kb, st, out),
                (4, _) => outs::<D, 2, 4>(c, r0, o0, o1, kb, st, out),
                (5, 1) => outs::<D, 2, 5>(c, r0, o0, o1, kb, st, out),
                (6, 1) => outs::<D, 2, 6>(c, r0, o0, o1, kb, st, out),
                (7, 1) => outs::<D, 2, 7>(c, r0, o0, o1, kb, st, out),
                (_, 1) => outs::<D, 2, 8>(c, r0, o0, o1, kb, st, out),
                (5, _) => outs::<D, 2, 5>(c, r0, o0, o1, kb, st, out),
                (6, _) => outs::<D, 2, 6>(c, r0, o0, o1, kb, st, out),
                (7, _) => outs::<D, 2, 7>(c, r0, o0, o1, kb, st, out),
                _ => outs::<D, 2, 8>(c, r0, o0, o1, kb, st, out),
            }
            r0 += rt;
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn outs<D: Decode, const OT: usize, const RT: usize>(
        c: &Ctx<D>,
        r0: usize,
        o0: usize,
        o1: usize,
        kb: usize,
        state: &mut [__m512],
        out: &OutPtr,
    ) {
        let mut k0 = 0;
        loop {
            let k1 = (k0 + kb).min(c.nfull);
            let last = k1 == c.nfull;
            let mut o = o0;
            while o + OT <= o1 {
                // (Empty with a single column block: `tile` then never touches it.)
                let st = state.get_mut((o - o0) * 2 * RT..(o - o0 + OT) * 2 * RT).unwrap_or_default();
                tile::<D, OT, RT>(c, r0, o, k0, k1, st, last, out);
                o += OT;
            }
            while o < o1 {
                let st = state.get_mut((o - o0) * 2 * RT..(o - o0 + 1) * 2 * RT).unwrap_or_default();
                tile::<D, 1, RT>(c, r0, o, k0, k1, st, last, out);
                o += 1;
            }
            if last {
                break;
            }
            k0 = k1;
        }
    }

    /// Chunks `k0..k1` of a tile; resumes from `state` unless `k0 == 0`, and writes the
    /// results if `last`, else saves `state` (per output: RT `g` vectors, then RT `acc`).
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<D: Decode, const OT: usize, const RT: usize>(
        c: &Ctx<D>,
        r0: usize,
        o0: usize,
        k0: usize,
        k1: usize,
        state: &mut [__m512],
        last: bool,
        out: &OutPtr,
    ) {
        let mut g = [[_mm512_setzero_ps(); RT]; OT];
        let mut acc = [[_mm512_setzero_ps(); RT]; OT];
        if k0 > 0 {
            for oi in 0..OT {
                for ri in 0..RT {
                    g[oi][ri] = state[oi * 2 * RT + ri];
                    acc[oi][ri] = state[oi * 2 * RT + RT + ri];
                }
            }
        }
        let spc = c.d.seg_chunks();
        let mut k = k0;
        // Segment of chunk k and where it ends.
        let (mut s, mut seg_end) = if D::SEGMENTED { (k0 / spc, (k0 / spc + 1) * spc) } else { (0, usize::MAX) };
        while k < k1 {
            let kend = k1.min(seg_end);
            while k < kend {
                // The next tile's weights (same chunks, next outputs), a line at a time:
                // rows of W are read in short pieces (a tile's rows in parallel, column
                // blocks) that the hardware prefetcher does not run ahead of.
                if k & ((64 / D::CHUNK_BYTES).max(1) - 1) == 0 {
                    for oi in 0..OT {
                        let p = c.d.chunk_ptr(o0 + OT + oi, k) as *const i8;
                        _mm_prefetch::<PF_HINT>(p);
                        if D::CHUNK_BYTES > 64 {
                            _mm_prefetch::<PF_HINT>(p.wrapping_add(64));
                        }
                    }
                }
                // Decode the tile's weights once, then each row's x once (32 registers
                // hold them); the pair's arithmetic is unchanged.
                let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); OT];
                for (oi, wo) in w.iter_mut().enumerate() {
                    *wo = c.d.chunk(o0 + oi, k);
                }
                for ri in 0..RT {
                    let xp = c.xs.ptr.add((r0 + ri) * c.xs.stride + k * 32);
                    let (xa, xb) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
                    for (oi, &(wa, wb)) in w.iter().enumerate() {
                        g[oi][ri] = _mm512_fmadd_ps(wa, xa, g[oi][ri]);
                        g[oi][ri] = _mm512_fmadd_ps(wb, xb, g[oi][ri]);
                    }
                }
                k += 1;
            }
            if D::SEGMENTED && (k == seg_end || k == c.nfull) {
                for oi in 0..OT {
                    for ri in 0..RT {
                        acc[oi][ri] = c.d.seg_end(o0 + oi, s, r0 + ri, g[oi][ri], acc[oi][ri]);
                        g[oi][ri] = _mm512_setzero_ps();
                    }
                }
                s += 1;
                seg_end += spc;
            }
        }
        if last {
            for oi in 0..OT {
                for ri in 0..RT {
                    let r = r0 + ri;
                    let v = if D::SEGMENTED { acc[oi][ri] } else { g[oi][ri] };
                    let mut v = hsum(v);
                    if D::SEGMENTED {
                        v -= c.d.corr(o0 + oi, r);
                    }
                    let v = c.d.finish(o0 + oi, v, &c.x[r * c.cols..(r + 1) * c.cols]);
                    out.write(r, o0 + oi, v);
                }
            }
        } else {
            for oi in 0..OT {
                for ri in 0..RT {
                    state[oi * 2 * RT + ri] = g[oi][ri];
                    state[oi * 2 * RT + RT + ri] = acc[oi][ri];
                }
            }
        }
    }

    const PF_HINT: i32 = _MM_HINT_T0;

    /// Horizontal sum in a fixed order: (lo256 + hi256), then as `avx2::hsum`.
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        let v8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, quantize};
    use rand::{Rng, SeedableRng};

    fn paths() -> Vec<KernelPath> {
        [KernelPath::Scalar, KernelPath::Avx2Fma, KernelPath::Avx512].into_iter().filter(|p| p.is_available()).collect()
    }

    /// Random values in ±[0.05, 1.5] (never zero).
    fn nonzero(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let m = rng.random_range(0.05f32..1.5);
                if rng.random_bool(0.5) {
                    m
                } else {
                    -m
                }
            })
            .collect()
    }

    struct Owned {
        kind: QuantKind,
        rows: usize,
        cols: usize,
        payload: Vec<u8>,
        scales: Vec<f32>,
    }
    impl Owned {
        fn new(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> Self {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let w = nonzero(&mut rng, rows * cols);
            let (payload, scales) = quantize(kind, &w, rows, cols);
            Self { kind, rows, cols, payload, scales }
        }
        fn q(&self) -> QMatrix<'_> {
            QMatrix::new(self.kind, self.rows, self.cols, &self.payload, &self.scales)
        }
        fn dense(&self) -> Vec<f32> {
            dequantize(self.kind, &self.payload, &self.scales, self.rows, self.cols)
        }
    }

    /// f64 reference and the bound sum |w x| for each output.
    fn reference(w: &[f32], out: usize, cols: usize, x: &[f32], rows: usize) -> (Vec<f64>, Vec<f64>) {
        let (mut y, mut b) = (vec![0f64; rows * out], vec![0f64; rows * out]);
        for r in 0..rows {
            for o in 0..out {
                for i in 0..cols {
                    let p = w[o * cols + i] as f64 * x[r * cols + i] as f64;
                    y[r * out + o] += p;
                    b[r * out + o] += p.abs();
                }
            }
        }
        (y, b)
    }

    fn kinds(cols: usize) -> Vec<QuantKind> {
        let mut k = vec![QuantKind::F32, QuantKind::Bf16, QuantKind::Int8Row];
        for g in [16, 32, 64, 128, 2, 6, 10, cols + cols % 2] {
            k.push(QuantKind::Int4Group { group: g });
        }
        k
    }

    const SHAPES: [(usize, usize); 5] = [(37, 150), (19, 200), (9, 7), (16, 64), (24, 1)];

    #[test]
    fn qmatmul_matches_f64_reference() {
        for (si, &(out, cols)) in SHAPES.iter().enumerate() {
            for kind in kinds(cols) {
                let m = Owned::new(kind, out, cols, 100 + si as u64);
                let dense = m.dense();
                for rows in [1usize, 3, 8, 11, 16] {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(7 + rows as u64);
                    let x = nonzero(&mut rng, rows * cols);
                    let (want, bound) = reference(&dense, out, cols, &x, rows);
                    for path in paths() {
                        let mut y = vec![f32::NAN; rows * out];
                        qmatmul_with(path, &x, rows, &m.q(), &mut y);
                        for i in 0..rows * out {
                            let err = (y[i] as f64 - want[i]).abs();
                            assert!(
                                err <= 1e-5 * bound[i],
                                "{} {path:?} {out}x{cols} rows={rows} [{i}]: got {} want {} (bound {})",
                                kind.name(),
                                y[i],
                                want[i],
                                bound[i]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Wide rows: several column blocks per tile (blocks are 1024 columns at 8 rows, 8192
    /// at one row), groups larger than a block, and a tail.
    #[test]
    fn long_rows_with_column_blocks() {
        for &(out, cols) in &[(10usize, 2100usize), (5, 8300)] {
            for kind in [
                QuantKind::F32,
                QuantKind::Bf16,
                QuantKind::Int8Row,
                QuantKind::Int4Group { group: 16 },
                QuantKind::Int4Group { group: 64 },
                QuantKind::Int4Group { group: 2048 },
                QuantKind::Int4Group { group: cols },
            ] {
                let m = Owned::new(kind, out, cols, 17);
                let dense = m.dense();
                let rows = 16;
                let mut rng = rand::rngs::StdRng::seed_from_u64(23);
                let x = nonzero(&mut rng, rows * cols);
                let (want, bound) = reference(&dense, out, cols, &x, rows);
                for path in paths() {
                    let mut y = vec![f32::NAN; rows * out];
                    qmatmul_with(path, &x, rows, &m.q(), &mut y);
                    for i in 0..rows * out {
                        let err = (y[i] as f64 - want[i]).abs();
                        assert!(err <= 1e-5 * bound[i], "{} {path:?} {out}x{cols} [{i}]", kind.name());
                    }
                    for (a, b) in [(0usize, 1usize), (5, 6), (3, 6), (1, 9)] {
                        let mut sub = vec![0f32; (b - a) * out];
                        qmatmul_with(path, &x[a * cols..b * cols], b - a, &m.q(), &mut sub);
                        assert_eq!(sub, y[a * out..b * out], "{} {path:?} {out}x{cols} rows {a}..{b}", kind.name());
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_alone_equals_the_row_in_a_batch_bit_for_bit() {
        for (si, &(out, cols)) in SHAPES.iter().enumerate() {
            for kind in kinds(cols) {
                let m = Owned::new(kind, out, cols, 200 + si as u64);
                let rows = 13;
                let mut rng = rand::rngs::StdRng::seed_from_u64(9);
                let x = nonzero(&mut rng, rows * cols);
                for path in paths() {
                    let mut batch = vec![0f32; rows * out];
                    qmatmul_with(path, &x, rows, &m.q(), &mut batch);
                    for r in 0..rows {
                        let mut alone = vec![0f32; out];
                        qmatmul_with(path, &x[r * cols..(r + 1) * cols], 1, &m.q(), &mut alone);
                        assert_eq!(
                            alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            batch[r * out..(r + 1) * out].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{} {path:?} {out}x{cols} row {r}",
                            kind.name()
                        );
                    }
                    // Any sub-batch too (different tile shapes).
                    for (a, b) in [(2usize, 5usize), (4, 7), (0, 9)] {
                        let mut sub = vec![0f32; (b - a) * out];
                        qmatmul_with(path, &x[a * cols..b * cols], b - a, &m.q(), &mut sub);
                        assert_eq!(sub, batch[a * out..b * out], "{} {path:?} rows {a}..{b}", kind.name());
                    }
                }
            }
        }
    }

    #[test]
    fn thread_count_and_repetition_do_not_change_results() {
        let (out, cols) = (300, 200);
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let many = rayon::ThreadPoolBuilder::new().num_threads(5).build().unwrap();
        for kind in [QuantKind::F32, QuantKind::Bf16, QuantKind::Int8Row, QuantKind::Int4Group { group: 64 }] {
            let m = Owned::new(kind, out, cols, 5);
            for rows in [1usize, 3, 8] {
                let mut rng = rand::rngs::StdRng::seed_from_u64(rows as u64);
                let x = nonzero(&mut rng, rows * cols);
                for path in paths() {
                    let run = |pool: &rayon::ThreadPool| {
                        let mut y = vec![0f32; rows * out];
                        pool.install(|| qmatmul_with(path, &x, rows, &m.q(), &mut y));
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    let a = run(&one);
                    assert_eq!(a, run(&many), "{} {path:?} rows={rows}", kind.name());
                    assert_eq!(a, run(&many), "{} {path:?} rows={rows} (repeat)", kind.name());
                }
            }
        }
    }

    #[test]
    fn scalar_and_simd_paths_agree() {
        let simd: Vec<KernelPath> = paths().into_iter().filter(|p| *p != KernelPath::Scalar).collect();
        if simd.is_empty() {
            eprintln!("no SIMD path available: only the scalar path is tested");
        }
        for (si, &(out, cols)) in SHAPES.iter().chain(&[(12, 2100), (40, 96)]).enumerate() {
            for kind in kinds(cols) {
                let m = Owned::new(kind, out, cols, 300 + si as u64);
                let rows = 5;
                let mut rng = rand::rngs::StdRng::seed_from_u64(3);
                let x = nonzero(&mut rng, rows * cols);
                let (_, bound) = reference(&m.dense(), out, cols, &x, rows);
                let mut a = vec![0f32; rows * out];
                qmatmul_with(KernelPath::Scalar, &x, rows, &m.q(), &mut a);
                for &path in &simd {
                    let mut b = vec![0f32; rows * out];
                    qmatmul_with(path, &x, rows, &m.q(), &mut b);
                    for i in 0..rows * out {
                        assert!(
                            (a[i] as f64 - b[i] as f64).abs() <= 2e-5 * bound[i],
                            "{} {path:?} {out}x{cols} [{i}]: {} vs {}",
                            kind.name(),
                            a[i],
                            b[i]
                        );
                    }
                }
            }
        }
    }

    fn silu64(g: f64) -> f64 {
        g / (1.0 + (-g).exp())
    }

    #[test]
    fn swiglu_matches_reference_and_composition() {
        let (hidden, inter) = (150usize, 72usize);
        for kind in [
            QuantKind::F32,
            QuantKind::Bf16,
            QuantKind::Int8Row,
            QuantKind::Int4Group { group: 32 },
            QuantKind::Int4Group { group: 6 },
            QuantKind::Int4Group { group: 150 },
        ] {
            let down_kind = match kind {
                QuantKind::Int4Group { group: 150 } => QuantKind::Int4Group { group: 72 },
                k => k,
            };
            let g = Owned::new(kind, inter, hidden, 1);
            let u = Owned::new(kind, inter, hidden, 2);
            let d = Owned::new(down_kind, hidden, inter, 3);
            let (gd, ud, dd) = (g.dense(), u.dense(), d.dense());
            for rows in [1usize, 3, 8] {
                let mut rng = rand::rngs::StdRng::seed_from_u64(40 + rows as u64);
                let x = nonzero(&mut rng, rows * hidden);
                // f64 reference.
                let (gr, _) = reference(&gd, inter, hidden, &x, rows);
                let (ur, _) = reference(&ud, inter, hidden, &x, rows);
                let h: Vec<f64> = gr.iter().zip(&ur).map(|(g, u)| silu64(*g) * u).collect();
                for path in paths() {
                    let mut y = vec![0f32; rows * hidden];
                    swiglu_expert_with(path, &x, rows, &g.q(), &u.q(), &d.q(), &mut y);
                    for r in 0..rows {
                        for o in 0..hidden {
                            let (mut want, mut bound) = (0f64, 0f64);
                            for i in 0..inter {
                                let p = dd[o * inter + i] as f64 * h[r * inter + i];
                                want += p;
                                bound += p.abs();
                            }
                            let got = y[r * hidden + o] as f64;
                            assert!(
                                (got - want).abs() <= 1e-4 * bound,
                                "{} {path:?} rows={rows} ({r},{o}): {got} vs {want}",
                                kind.name()
                            );
                        }
                    }
                    // Same bits as the unfused composition.
                    let (mut gy, mut uy, mut y2) =
                        (vec![0f32; rows * inter], vec![0f32; rows * inter], vec![0f32; rows * hidden]);
                    qmatmul_with(path, &x, rows, &g.q(), &mut gy);
                    qmatmul_with(path, &x, rows, &u.q(), &mut uy);
                    let hh: Vec<f32> = gy.iter().zip(&uy).map(|(g, u)| u * silu(*g)).collect();
                    qmatmul_with(path, &hh, rows, &d.q(), &mut y2);
                    assert_eq!(y, y2, "{} {path:?} rows={rows}", kind.name());
                    // And a row alone equals the row in the batch.
                    let mut alone = vec![0f32; hidden];
                    swiglu_expert_with(path, &x[..hidden], 1, &g.q(), &u.q(), &d.q(), &mut alone);
                    assert_eq!(alone, y[..hidden], "{} {path:?}", kind.name());
                }
            }
        }
    }

    #[test]
    fn batched_experts_equal_single_calls_bit_for_bit() {
        let (hidden, inter) = (150usize, 72usize);
        let kinds = [
            QuantKind::Int4Group { group: 32 },
            QuantKind::Int8Row,
            QuantKind::Bf16,
            QuantKind::Int4Group { group: 6 },
        ];
        let experts: Vec<(Owned, Owned, Owned)> = kinds
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                let dk = if matches!(k, QuantKind::Int4Group { .. }) { QuantKind::Int4Group { group: 24 } } else { k };
                let s = 10 * i as u64;
                (
                    Owned::new(k, inter, hidden, s),
                    Owned::new(k, inter, hidden, s + 1),
                    Owned::new(dk, hidden, inter, s + 2),
                )
            })
            .collect();
        let rows = [1usize, 3, 0, 8];
        let mut rng = rand::rngs::StdRng::seed_from_u64(77);
        let xs: Vec<Vec<f32>> = rows.iter().map(|&r| nonzero(&mut rng, r * hidden)).collect();
        let pools = [1usize, 4].map(|n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap());
        for path in paths() {
            let single: Vec<Vec<f32>> = (0..4)
                .map(|i| {
                    let (g, u, d) = &experts[i];
                    let mut y = vec![0f32; rows[i] * hidden];
                    swiglu_expert_with(path, &xs[i], rows[i], &g.q(), &u.q(), &d.q(), &mut y);
                    y
                })
                .collect();
            for pool in &pools {
                let mut ys: Vec<Vec<f32>> = rows.iter().map(|&r| vec![f32::NAN; r * hidden]).collect();
                let mut calls: Vec<ExpertCall> = ys
                    .iter_mut()
                    .enumerate()
                    .map(|(i, y)| {
                        let (g, u, d) = &experts[i];
                        ExpertCall { x: &xs[i], rows: rows[i], gate: g.q(), up: u.q(), down: d.q(), y }
                    })
                    .collect();
                pool.install(|| swiglu_experts_with(path, &mut calls));
                assert_eq!(ys, single, "{path:?}");
            }
        }
    }

    #[test]
    fn empty_shapes_are_fine() {
        let m = Owned::new(QuantKind::Int8Row, 4, 10, 1);
        let mut y = vec![];
        qmatmul(&[], 0, &m.q(), &mut y);
        let z = QMatrix::new(QuantKind::F32, 0, 10, &[], &[]);
        qmatmul(&[1.0; 10], 1, &z, &mut y);
        let e = QMatrix::new(QuantKind::Int4Group { group: 8 }, 3, 0, &[], &[]);
        let mut y = vec![f32::NAN; 6];
        qmatmul(&[], 2, &e, &mut y);
        assert_eq!(y, vec![0.0; 6]);
    }

    #[test]
    #[should_panic(expected = "payload is 39 bytes, expected 40")]
    fn wrong_payload_size_panics() {
        let m = Owned::new(QuantKind::Int8Row, 4, 10, 1);
        QMatrix::new(m.kind, 4, 10, &m.payload[..39], &m.scales);
    }

    #[test]
    #[should_panic(expected = "3 scales, expected 4")]
    fn wrong_scale_count_panics() {
        let m = Owned::new(QuantKind::Int8Row, 4, 10, 1);
        QMatrix::new(m.kind, 4, 10, &m.payload, &m.scales[..3]);
    }

    #[test]
    #[should_panic(expected = "x has 9 values, expected 1 rows x 10 cols")]
    fn wrong_x_len_panics() {
        let m = Owned::new(QuantKind::Bf16, 4, 10, 1);
        let mut y = vec![0f32; 4];
        qmatmul(&[1.0; 9], 1, &m.q(), &mut y);
    }

    #[test]
    #[should_panic(expected = "y has 5 values, expected 1 rows x 4 outputs")]
    fn wrong_y_len_panics() {
        let m = Owned::new(QuantKind::Bf16, 4, 10, 1);
        let mut y = vec![0f32; 5];
        qmatmul(&[1.0; 10], 1, &m.q(), &mut y);
    }

    #[test]
    #[should_panic(expected = "expected gate = up = [inter, hidden]")]
    fn swiglu_shape_mismatch_panics() {
        let g = Owned::new(QuantKind::F32, 4, 10, 1);
        let d = Owned::new(QuantKind::F32, 10, 5, 1);
        let mut y = vec![0f32; 10];
        swiglu_expert(&[1.0; 10], 1, &g.q(), &g.q(), &d.q(), &mut y);
    }
}
