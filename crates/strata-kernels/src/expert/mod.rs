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

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
