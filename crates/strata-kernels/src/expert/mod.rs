//! Matrix products computed directly on stored weights (encodings in [`crate::quant`]:
//! f32, bf16, FP8 e4m3 with block scales, int8-row, int4-group, MXFP4), for one row (decode: a
//! memory-bound matvec) or many (prefill chunks, verify rows: each weight chunk is decoded
//! once per tile of up to 8 rows and applied to all of them).
//!
//! A [`Product`] is prepared once (x staged where the encoding needs it, into a reusable
//! [`Staging`]) and evaluated by output ranges, so the threads of a
//! [`crate::pool::ThreadPool`] region each take a range; [`Out`] says where results go
//! (written, or added to what is there: the residual add fused into a projection).
//! [`ExpertRunner`] runs a set of SwiGLU experts (a layer's routed + shared experts) in
//! two parallel passes with scratch that is reused from call to call.
//!
//! Three code paths, chosen by [`KernelPath::best`] at run time: AVX-512F, AVX2 + FMA
//! (`std::arch::x86_64`, behind `is_x86_feature_detected!`) and a portable scalar path.
//!
//! Determinism: every output element `y[r, o]` is accumulated by one thread, in a fixed
//! order that depends only on `o`, `x[r, ..]`, `W[o, ..]`, the matrix shape and the code
//! path — never on the thread count, on how outputs are split, or on the other rows in
//! the batch. A token's result is therefore identical computed alone or inside a batch,
//! and between runs. The paths sum in different orders and agree within rounding (about
//! 1e-6 relative), not bit for bit.
//!
//! Errors: shapes are checked up front and a mismatch panics with a message naming the
//! sizes (these are programming errors, not data errors).
//!
//! Speed (`examples/expert_bench.rs`, one GLM-5 expert = gate/up [2048, 6144] + down
//! [6144, 2048] streamed from DRAM, 16-core Xeon, 117 GB/s read bandwidth, AVX-512):
//! one row int4-g64 0.41 ms (52 GB/s), int8 0.43 ms, bf16 0.74 ms; 8 rows int4 1.9 ms,
//! int8 1.2 ms, bf16 1.6 ms (FMA-bound). Numbers vary by about 20% from run to run.

mod runner;
mod scales;
mod transposed;

pub use runner::{ExpertBias, ExpertJob, ExpertRunner, GateAct};
pub use scales::Scales;
pub(crate) use scales::{with_scale_read, ScaleRead};
pub use transposed::matmul_t;

use crate::pool::{global, split_range};
use crate::quant::QuantKind;

/// A matrix `W[rows = out, cols = in]` in a stored encoding, borrowed.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub kind: QuantKind,
    pub rows: usize,
    pub cols: usize,
    pub payload: &'a [u8],
    pub scales: Scales<'a>,
}

impl<'a> QMatrix<'a> {
    /// Builds and [validates](Self::validate) a matrix view.
    pub fn new(kind: QuantKind, rows: usize, cols: usize, payload: &'a [u8], scales: impl Into<Scales<'a>>) -> Self {
        let m = Self { kind, rows, cols, payload, scales: scales.into() };
        m.validate();
        m
    }

    /// Panics unless the payload and scale lengths match `kind` at `rows x cols`, the
    /// scales are stored as `kind` says, an int4 group is even and non-zero, and FP8
    /// blocks are non-empty.
    pub fn validate(&self) {
        assert_eq!(
            self.scales.scale_type(),
            self.kind.scale_type(),
            "QMatrix {}: scales stored as {:?}",
            self.kind.name(),
            self.scales.scale_type()
        );
        match self.kind {
            QuantKind::Int4Group { group, .. } => {
                assert!(group >= 2 && group % 2 == 0, "QMatrix: int4 group must be even and >= 2, got {group}")
            }
            QuantKind::Fp8 { block_rows, block_cols } => {
                assert!(block_rows > 0 && block_cols > 0, "QMatrix: FP8 blocks must be non-empty")
            }
            QuantKind::Mxfp4 => assert!(
                self.cols.is_multiple_of(crate::quant::MXFP4_GROUP),
                "QMatrix mxfp4: {} columns, not a multiple of 32",
                self.cols
            ),
            _ => {}
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
        self.payload.len() + self.kind.scale_type().region_bytes(self.scales.len())
    }
}

/// Which implementation computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 AVX2 + FMA intrinsics.
    Avx2Fma,
    /// x86-64 AVX-512F intrinsics (32-column chunks; int4 groups and FP8 blocks that are
    /// not a multiple of 32 columns run the AVX2 code).
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

    /// Columns per SIMD chunk for `kind` on this path (0: the scalar code).
    fn chunk_width(self, kind: QuantKind) -> usize {
        match (self, kind) {
            (Self::Scalar, _) => 0,
            (Self::Avx512, QuantKind::Int4Group { group, .. }) if group % 32 != 0 => 16,
            // MXFP4 runs the AVX2 code on AVX-512 machines too.
            (Self::Avx512, QuantKind::Mxfp4) => 16,
            (_, QuantKind::Fp8 { block_cols, .. }) if block_cols % 16 != 0 => 0,
            (Self::Avx512, QuantKind::Fp8 { block_cols, .. }) if block_cols % 32 != 0 => 16,
            (Self::Avx512, _) => 32,
            (Self::Avx2Fma, _) => 16,
        }
    }
}

fn check_path(path: KernelPath) {
    assert!(path.is_available(), "kernel path {} is not available on this CPU", path.name());
}

/// x staged for encodings that read it in another order (int4: each chunk's even then odd
/// columns, pre-scaled, plus group sums; see `avx2::I4Dec`). Reusable: it grows to the
/// largest product and then never allocates again.
#[derive(Default)]
pub struct Staging {
    xs: Vec<f32>,
    xstride: usize,
    xg: Vec<f32>,
    /// What the staged data was made for: (kind, chunk width, rows, cols).
    key: Option<(QuantKind, usize, usize, usize)>,
}

impl Staging {
    /// Stages `x` (`rows x w.cols`) for products with `w`'s encoding on `path`; a no-op
    /// for encodings that read x as it is.
    pub fn prepare(&mut self, path: KernelPath, x: &[f32], rows: usize, kind: QuantKind, cols: usize) {
        let cw = path.chunk_width(kind);
        self.key = Some((kind, cw, rows, cols));
        let QuantKind::Int4Group { group, .. } = kind else { return };
        let Some(nfull) = cols.checked_div(cw) else { return };
        self.xstride = nfull * cw + cw;
        let need = rows * self.xstride;
        if self.xs.len() < need {
            self.xs.resize(need, 0.0);
        }
        let half = cw / 2;
        for r in 0..rows {
            let src = &x[r * cols..r * cols + nfull * cw];
            let dst = &mut self.xs[r * self.xstride..r * self.xstride + nfull * cw];
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
        }
        if group % cw == 0 {
            // `8 * sum` of x over each group's columns in full chunks: the `- 8` part of
            // the int4 weights, subtracted once per output.
            let groups = cols.div_ceil(group);
            if self.xg.len() < rows * groups {
                self.xg.resize(rows * groups, 0.0);
            }
            let xg = &mut self.xg[..rows * groups];
            xg.fill(0.0);
            for r in 0..rows {
                for (c, v) in x[r * cols..r * cols + nfull * cw].iter().enumerate() {
                    xg[r * groups + c / group] += v;
                }
            }
            xg.iter_mut().for_each(|v| *v *= 8.0);
        }
    }
}

/// Where a product's results go: `y[r * stride + o]`, written or added. Threads of a
/// region share one `Out` and write disjoint outputs.
pub struct Out {
    ptr: *mut f32,
    stride: usize,
    len: usize,
    add: bool,
}
// SAFETY: every user writes a disjoint set of elements (distinct outputs per thread).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// Results are written to `y[r * stride + o]`.
    pub fn write(y: &mut [f32], stride: usize) -> Self {
        Self { ptr: y.as_mut_ptr(), stride, len: y.len(), add: false }
    }
    /// Results are added to `y[r * stride + o]` (a residual add fused into the product).
    pub fn add(y: &mut [f32], stride: usize) -> Self {
        Self { ptr: y.as_mut_ptr(), stride, len: y.len(), add: true }
    }
    /// Results go to `ptr[r * stride + o]` (`len` elements from `ptr`), added if `add`.
    ///
    /// # Safety
    /// `ptr..ptr+len` stays valid while the `Out` is used, and concurrent users write
    /// disjoint elements.
    pub unsafe fn raw(ptr: *mut f32, len: usize, stride: usize, add: bool) -> Self {
        Self { ptr, stride, len, add }
    }
    /// Adds `bias[o]` to outputs `o0..o1` of rows `0..rows`.
    ///
    /// # Safety
    /// Those outputs are in bounds and owned by the calling thread.
    pub unsafe fn add_bias(&self, rows: usize, o0: usize, o1: usize, bias: &[f32]) {
        for r in 0..rows {
            for (o, b) in bias.iter().enumerate().take(o1).skip(o0) {
                let i = r * self.stride + o;
                debug_assert!(i < self.len);
                *self.ptr.add(i) += b;
            }
        }
    }

    /// # Safety
    /// `r, o` in bounds and owned by the calling thread.
    #[inline(always)]
    pub(crate) unsafe fn put(&self, r: usize, o: usize, v: f32) {
        let i = r * self.stride + o;
        debug_assert!(i < self.len, "Out: element {i} beyond {}", self.len);
        let p = self.ptr.add(i);
        if self.add {
            *p += v;
        } else {
            *p = v;
        }
    }
}

/// `y = x W^T` prepared for evaluation by output ranges ([`Product::run`]).
pub struct Product<'a> {
    x: &'a [f32],
    rows: usize,
    w: QMatrix<'a>,
    /// Chunk width in columns: 16 (AVX2 code), 32 (AVX-512), 0 (scalar).
    cw: usize,
    /// x as the SIMD code reads it: full chunks of row `r` at `r * xstride`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xs: &'a [f32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xstride: usize,
    /// Int4 group sums (see [`Staging`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xg: &'a [f32],
}

impl<'a> Product<'a> {
    /// `x`: `rows x w.cols`. `staging` must have been [prepared](Staging::prepare) for
    /// this x and encoding (it is only read for int4). Panics on mismatched shapes.
    pub fn new(path: KernelPath, x: &'a [f32], rows: usize, w: QMatrix<'a>, staging: &'a Staging) -> Self {
        check_path(path);
        assert_eq!(x.len(), rows * w.cols, "qmatmul: x has {} values, expected {rows} rows x {} cols", x.len(), w.cols);
        let cw = path.chunk_width(w.kind);
        let (xs, xstride, xg): (&[f32], usize, &[f32]) = match w.kind {
            QuantKind::Int4Group { .. } if cw > 0 => {
                assert_eq!(
                    staging.key,
                    Some((w.kind, cw, rows, w.cols)),
                    "Product: staging was prepared for another x or encoding"
                );
                (&staging.xs, staging.xstride, &staging.xg)
            }
            _ => (x, w.cols, &[]),
        };
        Self { x, rows, w, cw, xs, xstride, xg }
    }

    pub fn outputs(&self) -> usize {
        self.w.rows
    }

    /// Computes outputs `o0..o1` of every row into `out`.
    pub fn run(&self, o0: usize, o1: usize, out: &Out) {
        if o0 >= o1 || self.rows == 0 {
            return;
        }
        debug_assert!(o1 <= self.w.rows);
        match self.cw {
            0 => scalar_block(&self.w, self.x, self.rows, o0, o1, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path was checked available; shapes were validated.
            16 => unsafe { avx2::block(self, o0, o1, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (AVX-512 availability implies AVX2 + FMA).
            _ => unsafe { avx512::block(self, o0, o1, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!(),
        }
    }
}

/// `y[r, o] = sum_i x[r, i] * W[o, i]` (x: `rows x w.cols`, y: `rows x w.rows`, row-major),
/// on [`KernelPath::best`] and the global pool. Panics on mismatched shapes.
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
    let mut staging = Staging::default();
    staging.prepare(path, x, rows, w.kind, w.cols);
    let product = Product::new(path, x, rows, *w, &staging);
    let out = Out::write(y, w.rows);
    global().run(&|c| {
        let r = c.split_aligned(w.rows, 8);
        product.run(r.start, r.end, &out);
    });
}

/// One SwiGLU expert over `rows` rows: `y = down(silu(gate x) * up x)` with
/// `silu(g) = g / (1 + e^-g)`; x and y are `rows x hidden`, gate/up are
/// `[inter, hidden]`, down is `[hidden, inter]`. Panics on mismatched shapes.
pub fn swiglu_expert(x: &[f32], rows: usize, gate: &QMatrix, up: &QMatrix, down: &QMatrix, y: &mut [f32]) {
    swiglu_expert_with(KernelPath::best(), x, rows, gate, up, down, y)
}

/// [`swiglu_expert`] on an explicit path.
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

/// Several experts at once, each on its own x, through an [`ExpertRunner`] on the
/// global pool (two parallel passes in all). Each `y` is bit-identical to
/// [`swiglu_expert`] on the same call. Panics on mismatched shapes.
pub fn swiglu_experts(calls: &mut [ExpertCall]) {
    swiglu_experts_with(KernelPath::best(), calls)
}

/// [`swiglu_experts`] on an explicit path.
pub fn swiglu_experts_with(path: KernelPath, calls: &mut [ExpertCall]) {
    let Some(first) = calls.first() else { return };
    let hidden = first.gate.cols;
    // Stack the calls' x as one batch; each job takes its own rows.
    let total: usize = calls.iter().map(|c| c.rows).sum();
    let mut x = Vec::with_capacity(total * hidden);
    let mut rows: Vec<Vec<u32>> = Vec::with_capacity(calls.len());
    for c in calls.iter() {
        assert_eq!(c.gate.cols, hidden, "swiglu_experts: every call must have the same hidden size");
        assert_eq!(
            c.x.len(),
            c.rows * hidden,
            "swiglu_expert: x has {} values, expected {} rows x {hidden}",
            c.x.len(),
            c.rows
        );
        let base = (x.len() / hidden.max(1)) as u32;
        rows.push((base..base + c.rows as u32).collect());
        x.extend_from_slice(c.x);
    }
    let mut out_row = 0;
    let jobs: Vec<ExpertJob> = calls
        .iter()
        .zip(&rows)
        .map(|(c, r)| {
            let j = ExpertJob { gate: c.gate, up: c.up, down: c.down, rows: Some(r), out_row, bias: None };
            out_row += c.rows;
            j
        })
        .collect();
    let mut y = vec![0f32; total * hidden];
    ExpertRunner::default().run(global(), path, &x, total, &jobs, &mut y);
    let mut at = 0;
    for c in calls.iter_mut() {
        assert_eq!(
            c.y.len(),
            c.rows * hidden,
            "swiglu_expert: y has {} values, expected {} rows x {hidden}",
            c.y.len(),
            c.rows
        );
        c.y.copy_from_slice(&y[at * hidden..(at + c.rows) * hidden]);
        at += c.rows;
    }
}

#[inline]
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// Outputs per work item: a multiple of 8, about 256 KiB of weights (up to 4 MiB for
/// many rows, since each item reads all of x), at least 4 items a thread. (Results do not
/// depend on this split.)
pub(crate) fn block_size(w: &QMatrix, rows: usize, threads: usize) -> usize {
    let row_bytes = w.kind.payload_bytes(1, w.cols).max(1);
    let by_bytes = (256 * 1024 * (rows / 8).clamp(1, 16)) / row_bytes;
    let by_threads = w.rows.div_ceil(threads.max(1) * 4);
    by_bytes.min(by_threads).max(8).next_multiple_of(8)
}

/// Static share of `outputs` for thread `id` of `n`, in tiles of 8.
pub fn output_share(outputs: usize, n: usize, id: usize) -> std::ops::Range<usize> {
    split_range(outputs, n, id, 8)
}

// ---------------------------------------------------------------- scalar path

/// Decodes row `o` of `w` into `dst[..w.cols]` (same values as [`crate::dequantize`]).
pub fn dequant_row(w: &QMatrix, o: usize, dst: &mut [f32]) {
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
        QuantKind::Fp8 { block_rows, block_cols } => {
            let ncb = cols.div_ceil(block_cols);
            let sc = &w.scales.f32()[(o / block_rows) * ncb..(o / block_rows + 1) * ncb];
            for (c, (d, &q)) in dst.iter_mut().zip(&w.payload[o * cols..(o + 1) * cols]).enumerate() {
                *d = crate::fp8::fp8_e4m3_to_f32(q) * sc[c / block_cols];
            }
        }
        QuantKind::Int8Row => {
            let s = w.scales.get(o);
            for (d, &q) in dst.iter_mut().zip(&w.payload[o * cols..(o + 1) * cols]) {
                *d = q as i8 as f32 * s;
            }
        }
        QuantKind::Int4Group { group, .. } => {
            let (half, groups) = (cols.div_ceil(2), cols.div_ceil(group));
            let src = &w.payload[o * half..(o + 1) * half];
            for (g, dchunk) in dst.chunks_mut(group).enumerate() {
                let s = w.scales.get(o * groups + g);
                let c0 = g * group; // even, so each group starts on a byte
                for (j, d) in dchunk.iter_mut().enumerate() {
                    let byte = src[(c0 + j) / 2];
                    let nib = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    *d = (nib as i32 - 8) as f32 * s;
                }
            }
        }
        QuantKind::Mxfp4 => {
            let (half, group) = (cols / 2, crate::quant::MXFP4_GROUP);
            let src = &w.payload[o * half..(o + 1) * half];
            for (g, dchunk) in dst.chunks_mut(group).enumerate() {
                let s = w.scales.get(o * (cols / group) + g);
                for (j, d) in dchunk.iter_mut().enumerate() {
                    let byte = src[(g * group + j) / 2];
                    let nib = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    *d = crate::quant::FP4_VALUES[nib as usize] * s;
                }
            }
        }
    }
}

/// One decoded element `W[r, c]` (tails of SIMD loops).
pub(crate) fn weight_at(w: &QMatrix, r: usize, c: usize) -> f32 {
    let cols = w.cols;
    match w.kind {
        QuantKind::F32 => {
            let b = &w.payload[(r * cols + c) * 4..][..4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
        QuantKind::Bf16 => {
            let b = &w.payload[(r * cols + c) * 2..][..2];
            f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
        }
        QuantKind::Fp8 { block_rows, block_cols } => {
            let s = w.scales.get((r / block_rows) * cols.div_ceil(block_cols) + c / block_cols);
            crate::fp8::fp8_e4m3_to_f32(w.payload[r * cols + c]) * s
        }
        QuantKind::Int8Row => w.payload[r * cols + c] as i8 as f32 * w.scales.get(r),
        QuantKind::Int4Group { group, .. } => {
            let byte = w.payload[r * cols.div_ceil(2) + c / 2];
            let nib = if c.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
            (nib as i32 - 8) as f32 * w.scales.get(r * cols.div_ceil(group) + c / group)
        }
        QuantKind::Mxfp4 => {
            let byte = w.payload[r * cols / 2 + c / 2];
            let nib = if c.is_multiple_of(2) { byte & 0x0f } else { byte >> 4 };
            let group = crate::quant::MXFP4_GROUP;
            crate::quant::FP4_VALUES[nib as usize] * w.scales.get(r * (cols / group) + c / group)
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

fn scalar_block(w: &QMatrix, x: &[f32], rows: usize, o0: usize, o1: usize, out: &Out) {
    let cols = w.cols;
    // A row of decoded weights on the stack for common widths (no allocation on the
    // scalar path either).
    let mut stack = [0f32; 4096];
    let mut heap = Vec::new();
    let wrow: &mut [f32] = if cols <= stack.len() {
        &mut stack[..cols]
    } else {
        heap.resize(cols, 0.0);
        &mut heap
    };
    for o in o0..o1 {
        dequant_row(w, o, wrow);
        for r in 0..rows {
            let v = dot_scalar(wrow, &x[r * cols..(r + 1) * cols]);
            // SAFETY: o in this task's block, r < rows.
            unsafe { out.put(r, o, v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
