//! The CPU backend: strata-kernels on the process's persistent thread pool. Each op is one
//! pool region (its stages separated by barriers); work is split statically where the
//! same thread should read the same weights every step (projections: each thread keeps
//! its share of the weights in its own cache), dynamically where the work changes from
//! step to step (experts). Steady-state steps allocate nothing: scratch is per thread and
//! reserved when a session is made.

mod elementwise;
mod gqa;
mod gqa_query;
mod mla;
mod moe;
mod softmax_route;

#[cfg(test)]
mod tests_support {
    pub use strata_kernels::ops::rand_vec;
}

use crate::profile::{Op, Timer};
use crate::{Backend, Draw, ExpertTask, GateAct, HostMatrix, LinearOut, Step};
use anyhow::{bail, Result};
use std::sync::Mutex;
use strata_kernels::pool::{self, Ctx, ThreadPool};
use strata_kernels::{dequant_row, ExpertRunner, KernelPath, Out, Product, QMatrix, QuantKind, Staging};

/// A matrix held in host memory in its stored precision (MXFP4's scales as their e8m0
/// codes, which its kernels read).
pub struct CpuMat {
    m: HostMatrix,
    e8m0: Vec<u8>,
}

impl CpuMat {
    pub fn q(&self) -> QMatrix<'_> {
        match self.m.kind {
            QuantKind::Mxfp4 => QMatrix { scales: strata_kernels::Scales::E8m0(&self.e8m0), ..self.m.view() },
            _ => self.m.view(),
        }
    }
}

/// Rows `r0..r1` of a matrix (FP8 must carry per-row scales, see
/// [`HostMatrix::with_row_scales`]).
pub fn row_view<'a>(m: &QMatrix<'a>, r0: usize, r1: usize) -> QMatrix<'a> {
    let pb = m.kind.payload_bytes(1, m.cols);
    let per_row_scales = match m.kind {
        QuantKind::F32 | QuantKind::Bf16 => 0,
        QuantKind::Int8Row => 1,
        QuantKind::Int4Group { group, .. } => m.cols.div_ceil(group),
        QuantKind::Mxfp4 => m.cols.div_ceil(strata_kernels::MXFP4_GROUP),
        QuantKind::Fp8 { block_rows, block_cols } => {
            assert_eq!(block_rows, 1, "row views of FP8 need per-row scales");
            m.cols.div_ceil(block_cols)
        }
    };
    QMatrix {
        kind: m.kind,
        rows: r1 - r0,
        cols: m.cols,
        payload: &m.payload[r0 * pb..r1 * pb],
        scales: m.scales.slice(r0 * per_row_scales..r1 * per_row_scales),
    }
}

/// One expert's matrices as the CPU reads them.
#[derive(Clone, Copy)]
pub struct CpuExpert<'a> {
    pub gate: QMatrix<'a>,
    pub up: QMatrix<'a>,
    pub down: QMatrix<'a>,
}

/// A pointer shared by a region's threads, each touching disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}
impl<T> Shared<T> {
    pub(crate) fn new(p: *mut T) -> Self {
        Self(p)
    }
    /// (A method, so closures capture the wrapper, not the bare pointer.)
    #[inline(always)]
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
    /// # Safety
    /// `off..off+len` in bounds and not written by anyone else meanwhile.
    #[inline(always)]
    pub(crate) unsafe fn slice_mut<'a>(&self, off: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(off), len)
    }
}

/// Work (bytes read) worth a thread of its own in one region.
pub(crate) const BYTES_PER_THREAD: usize = 32 << 10;

pub struct CpuBackend {
    pool: &'static ThreadPool,
    path: KernelPath,
    /// Per-thread scratch (f32 and u32), reserved by `reserve_workspace`.
    scratch: Vec<Mutex<Vec<f32>>>,
    iscratch: Vec<Mutex<Vec<u32>>>,
    /// Staged inputs of a `linears` call, per output (int4 weights only).
    staging: Mutex<Vec<Staging>>,
    runner: Mutex<ExpertRunner>,
    /// Buffers of index reads in flight and taken, reused (a read allocates nothing).
    idx_reads: Mutex<Vec<Vec<u32>>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// On the global pool and the fastest kernel path of this CPU.
    pub fn new() -> Self {
        Self::with(pool::global(), KernelPath::best())
    }

    pub fn with(pool: &'static ThreadPool, path: KernelPath) -> Self {
        let n = pool.threads();
        Self {
            pool,
            path,
            scratch: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
            iscratch: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
            staging: Mutex::new(Vec::new()),
            runner: Mutex::new(ExpertRunner::default()),
            idx_reads: Mutex::new(Vec::new()),
        }
    }

    pub fn path(&self) -> KernelPath {
        self.path
    }

    /// Thread `id`'s f32 scratch of at least `len` values (grows only if a session did
    /// not reserve enough).
    pub(crate) fn scratch(&self, id: usize, len: usize) -> std::sync::MutexGuard<'_, Vec<f32>> {
        let mut g = self.scratch[id].lock().unwrap_or_else(|e| e.into_inner());
        if g.len() < len {
            g.resize(len, 0.0);
        }
        g
    }

    pub(crate) fn iscratch(&self, id: usize, len: usize) -> std::sync::MutexGuard<'_, Vec<u32>> {
        let mut g = self.iscratch[id].lock().unwrap_or_else(|e| e.into_inner());
        if g.len() < len {
            g.resize(len, 0);
        }
        g
    }

    /// Runs `f` on as many threads as `work` (bytes an op reads, roughly) is worth:
    /// about [`BYTES_PER_THREAD`] each, so a small op does not pay a barrier across
    /// every core and decode speed does not fall as threads are added.
    pub(crate) fn run(&self, work: usize, f: &(dyn Fn(&Ctx) + Sync)) {
        self.pool.run_on(work.div_ceil(BYTES_PER_THREAD), f)
    }
}

/// Where thread `t` of `n` cuts a list of matrices whose per-output costs are `cost`:
/// the output index in matrix `j` (multiples of 8) at cumulative cost `t * total / n`.
fn cut(costs: &[(usize, usize)], total: usize, n: usize, t: usize, j: usize) -> usize {
    let at = (t as u128 * total as u128 / n as u128) as usize;
    let base: usize = costs[..j].iter().map(|(outs, c)| outs * c).sum();
    let (outs, c) = costs[j];
    if at <= base {
        return 0;
    }
    ((at - base).div_ceil(c.max(1))).next_multiple_of(8).min(outs)
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Idx = Vec<u32>;
    type Mat = CpuMat;
    type ExpertRef<'a> = CpuExpert<'a>;
    /// None: the CPU dispatches experts from the host (the ids are there already).
    type ExpertTable = std::convert::Infallible;
    type IdxRead = Vec<u32>;

    fn describe(&self) -> String {
        format!("cpu ({} threads, {})", self.pool.threads(), self.path.name())
    }

    fn parallelism(&self) -> usize {
        self.pool.threads()
    }

    fn reserve_workspace(&self, heads: usize, attended: usize, context: usize) {
        for id in 0..self.scratch.len() {
            drop(self.scratch(id, mla::attend_scratch(heads, attended)));
            drop(self.iscratch(id, context.max(1)));
        }
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        let mut v = Vec::new();
        if v.try_reserve_exact(len).is_err() {
            bail!("cannot allocate {} bytes of activations", len * 4);
        }
        v.resize(len, 0.0);
        Ok(v)
    }

    fn alloc_idx(&self, len: usize) -> Result<Vec<u32>> {
        let mut v = Vec::new();
        if v.try_reserve_exact(len).is_err() {
            bail!("cannot allocate {} bytes of indices", len * 4);
        }
        v.resize(len, 0);
        Ok(v)
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn matrix(&self, m: HostMatrix) -> Result<CpuMat> {
        let e8m0 = match m.kind {
            QuantKind::Mxfp4 => m.stored_scales()?,
            _ => {
                m.validate()?;
                Vec::new()
            }
        };
        Ok(CpuMat { m, e8m0 })
    }

    fn mat_shape(&self, m: &CpuMat) -> (usize, usize) {
        (m.m.rows, m.m.cols)
    }

    fn expert_ref<'a>(&self, gate: &'a CpuMat, up: &'a CpuMat, down: &'a CpuMat) -> CpuExpert<'a> {
        CpuExpert { gate: gate.q(), up: up.q(), down: down.q() }
    }

    fn read(&self, src: &Vec<f32>, offset: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&src[offset..offset + dst.len()]);
    }

    fn read_idx(&self, src: &Vec<u32>, offset: usize, dst: &mut [u32]) {
        dst.copy_from_slice(&src[offset..offset + dst.len()]);
    }

    fn write(&self, dst: &mut Vec<f32>, offset: usize, src: &[f32]) {
        dst[offset..offset + src.len()].copy_from_slice(src);
    }

    fn write_idx(&self, dst: &mut Vec<u32>, offset: usize, src: &[u32]) {
        dst[offset..offset + src.len()].copy_from_slice(src);
    }

    fn host<'a>(&self, b: &'a Vec<f32>) -> Option<&'a [f32]> {
        Some(b)
    }

    fn embed(&self, step: &Step, picks: Option<&Vec<u32>>, table: &CpuMat, out: &mut Vec<f32>) -> Result<()> {
        let _t = Timer::start(Op::Embed);
        let t = table.q();
        let (rows, cols) = (step.rows(), t.cols);
        step.check_tokens(t.rows, picks.map_or(0, |p| p.len()))?;
        let o = Shared::new(out.as_mut_ptr());
        let body = |c: &Ctx| {
            for r in c.split(rows) {
                let mut tok = step.tokens[r];
                if crate::is_fed(tok) {
                    // (Checked above: a fed row has its pick.)
                    tok = picks.map_or(u32::MAX, |p| p[(tok & !crate::FED) as usize]);
                }
                if (tok as usize) < t.rows {
                    // SAFETY: row r is this thread's.
                    dequant_row(&t, tok as usize, unsafe { o.slice_mut(r * cols, cols) });
                }
            }
        };
        self.run(rows * cols * 4, &body);
        Ok(())
    }

    fn pick_rows(&self, step: &Step, rows: usize, width: usize, x: &Vec<f32>, picks: &mut Vec<u32>) {
        if step.draws.is_empty() {
            return elementwise::argmax_rows(rows, width, x, picks);
        }
        assert!(step.draws.len() >= rows * Draw::WORDS, "pick_rows: {} draw words for {rows} rows", step.draws.len());
        thread_local! {
            static SCRATCH: std::cell::RefCell<crate::draw::DrawScratch> = Default::default();
        }
        SCRATCH.with_borrow_mut(|s| {
            for (r, row) in x[..rows * width].chunks_exact(width).enumerate() {
                let d = Draw::from_words(&step.draws[r * Draw::WORDS..]);
                picks[r] = crate::draw::pick(row, &d, s);
            }
        });
    }

    fn start_read_idx(&self, src: &Vec<u32>, len: usize) -> Vec<u32> {
        let mut read = self.idx_reads.lock().unwrap().pop().unwrap_or_default();
        read.clear();
        read.extend_from_slice(&src[..len]);
        read
    }

    fn finish_read_idx(&self, read: Vec<u32>, dst: &mut Vec<u32>) {
        let taken = std::mem::replace(dst, read);
        self.idx_reads.lock().unwrap().push(taken);
    }

    fn rms_norm(&self, rows: usize, width: usize, x: &Vec<f32>, w: Option<&Vec<f32>>, eps: f32, out: &mut Vec<f32>) {
        let _t = Timer::start(Op::Norm);
        let o = Shared::new(out.as_mut_ptr());
        let body = |c: &Ctx| {
            for r in c.split(rows) {
                // SAFETY: row r is this thread's.
                let dst = unsafe { o.slice_mut(r * width, width) };
                strata_kernels::ops::rms_norm(&x[r * width..(r + 1) * width], w.map(|w| &w[..]), eps, dst);
            }
        };
        self.run(rows * width * 8, &body);
    }

    fn linears(&self, x: &Vec<f32>, rows: usize, outs: &mut [LinearOut<'_, Self>]) {
        let _t = Timer::start(Op::Projections);
        if rows == 0 || outs.is_empty() {
            return;
        }
        let path = self.path;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        while staging.len() < outs.len() {
            staging.push(Staging::default());
        }
        // Costs per output (bytes of weights a row of outputs reads), for a static split
        // that gives each thread the same share every step.
        let mut costs = [(0usize, 0usize); 8];
        assert!(outs.len() <= costs.len(), "linears: at most {} projections at once", costs.len());
        let mut dests = [const { None::<Out> }; 8];
        for (j, lo) in outs.iter_mut().enumerate() {
            let w = lo.w.q();
            assert!(x.len() >= rows * w.cols, "linears: x has {} values, needs {rows} x {}", x.len(), w.cols);
            assert!(
                lo.out.len() >= (rows - 1) * lo.stride + lo.col + w.rows,
                "linears: output of {} values too small for {rows} rows (stride {}, col {}, {} outputs)",
                lo.out.len(),
                lo.stride,
                lo.col,
                w.rows
            );
            costs[j] = (w.rows, w.weight_bytes() / w.rows.max(1) + 1);
            staging[j].prepare(path, &x[..rows * w.cols], rows, w.kind, w.cols);
            let len = lo.out.len() - lo.col;
            // SAFETY: the region below writes disjoint outputs of each destination.
            dests[j] = Some(unsafe { Out::raw(lo.out.as_mut_ptr().add(lo.col), len, lo.stride, lo.add) });
            if let Some(bias) = lo.bias {
                assert_eq!(bias.len(), w.rows, "linears: bias of {} values for {} outputs", bias.len(), w.rows);
            }
        }
        let biases: [Option<&[f32]>; 8] = std::array::from_fn(|j| outs.get(j).and_then(|lo| lo.bias.map(|b| &b[..])));
        let n_out = outs.len();
        let costs = &costs[..n_out];
        let total: usize = costs.iter().map(|(o, c)| o * c).sum();
        let mats: [Option<QMatrix>; 8] = std::array::from_fn(|j| outs.get(j).map(|lo| lo.w.q()));
        let staging = &*staging;
        let dests = &dests;
        let body = |c: &Ctx| {
            for j in 0..n_out {
                let (o0, o1) = (cut(costs, total, c.n, c.id, j), cut(costs, total, c.n, c.id + 1, j));
                if o0 < o1 {
                    let w = mats[j].unwrap();
                    let p = Product::new(path, &x[..rows * w.cols], rows, w, &staging[j]);
                    let dest = dests[j].as_ref().unwrap();
                    p.run(o0, o1, dest);
                    if let Some(bias) = biases[j] {
                        // SAFETY: outputs o0..o1 of every row are this thread's.
                        unsafe { dest.add_bias(rows, o0, o1, bias) };
                    }
                }
            }
        };
        self.run(total * rows.min(8), &body);
    }

    fn rope_tables(&self, step: &Step, inv_freq: &[f32], cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        let _t = Timer::start(Op::Rope);
        let half = inv_freq.len();
        for r in 0..step.rows() {
            let (c, s) = (&mut cos[r * half..(r + 1) * half], &mut sin[r * half..(r + 1) * half]);
            strata_kernels::ops::rope_angles(step.positions[r] as usize, inv_freq, c, s);
        }
    }

    fn gqa_prepare(&self, step: &Step, a: crate::GqaPrepare<'_, Self>) {
        let _t = Timer::start(Op::MlaPrepare);
        gqa::prepare(self, step, a)
    }

    fn gqa_attend(&self, step: &Step, a: crate::GqaAttend<'_, Self>) {
        let _t = Timer::start(Op::MlaAttend);
        gqa::attend(self, step, a)
    }

    fn mla_prepare(&self, step: &Step, a: crate::MlaPrepare<'_, Self>) {
        let _t = Timer::start(Op::MlaPrepare);
        mla::prepare(self, step, a)
    }

    fn mla_absorb(&self, step: &Step, a: crate::MlaAbsorb<'_, Self>) {
        let _t = Timer::start(Op::MlaAbsorb);
        mla::absorb(self, step, a)
    }

    fn dsa_select(&self, step: &Step, a: crate::DsaSelect<'_, Self>) {
        let _t = Timer::start(Op::DsaSelect);
        mla::dsa_select(self, step, a)
    }

    fn mla_attend(&self, step: &Step, a: crate::MlaAttend<'_, Self>) {
        let _t = Timer::start(Op::MlaAttend);
        mla::attend(self, step, a)
    }

    fn route_noaux(
        &self,
        x: &Vec<f32>,
        rows: usize,
        gate: &CpuMat,
        bias: &Vec<f32>,
        p: crate::RouterParams,
        logits: &mut Vec<f32>,
        ids: &mut Vec<u32>,
        weights: &mut Vec<f32>,
    ) {
        let _t = Timer::start(Op::Route);
        moe::route_noaux(self, x, rows, gate, bias, p, logits, ids, weights)
    }

    fn experts<'a>(
        &self,
        x: &Vec<f32>,
        rows: usize,
        n: usize,
        task: &(dyn Fn(usize) -> ExpertTask<'a, Self> + Sync),
        y: &mut Vec<f32>,
    ) {
        self.gated_experts(GateAct::Silu, x, rows, n, task, y)
    }

    fn expert_table(&self, _experts: &[[CpuMat; 3]]) -> Result<Option<Self::ExpertTable>> {
        Ok(None)
    }

    fn experts_by_id(
        &self,
        _x: &Vec<f32>,
        _top_k: usize,
        _ids: &Vec<u32>,
        table: &Self::ExpertTable,
        _shared: Option<CpuExpert<'_>>,
        _y: &mut Vec<f32>,
    ) {
        // No table exists on the CPU (expert_table answers None), so this is never called.
        match *table {}
    }

    fn gated_experts<'a>(
        &self,
        act: GateAct,
        x: &Vec<f32>,
        rows: usize,
        n: usize,
        task: &(dyn Fn(usize) -> ExpertTask<'a, Self> + Sync),
        y: &mut Vec<f32>,
    ) {
        let _t = Timer::start(Op::Experts);
        if n == 0 {
            return;
        }
        let mut runner = self.runner.lock().unwrap_or_else(|e| e.into_inner());
        let job = |i: usize| {
            let t = task(i);
            let (inter, hidden) = (t.weights.gate.rows, t.weights.down.rows);
            let bias = t.bias.map(|b| strata_kernels::ExpertBias {
                gate: &b.gate[b.expert * inter..][..inter],
                up: &b.up[b.expert * inter..][..inter],
                down: &b.down[b.expert * hidden..][..hidden],
            });
            strata_kernels::ExpertJob {
                gate: t.weights.gate,
                up: t.weights.up,
                down: t.weights.down,
                rows: t.rows,
                out_row: t.out_row,
                bias,
            }
        };
        let hidden = task(0).weights.gate.cols;
        runner.run_act(self.pool, self.path, act, &x[..rows * hidden], rows, n, &job, y);
    }

    fn moe_combine(
        &self,
        rows: usize,
        hidden: usize,
        top_k: usize,
        ids: &Vec<u32>,
        weights: &Vec<f32>,
        src: &Vec<u32>,
        y: &Vec<f32>,
        shared: Option<crate::SharedRows<'_, Self>>,
        out: &mut Vec<f32>,
    ) {
        let _t = Timer::start(Op::Combine);
        moe::combine(self, rows, hidden, top_k, ids, weights, src, y, shared, out)
    }

    fn add(&self, len: usize, src: &Vec<f32>, dst: &mut Vec<f32>) {
        let _t = Timer::start(Op::Combine);
        for (d, s) in dst[..len].iter_mut().zip(&src[..len]) {
            *d += s;
        }
    }

    fn gather_rows(&self, src: &Vec<f32>, width: usize, rows: &[u32], dst: &mut Vec<f32>) {
        let _t = Timer::start(Op::Other);
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            dst[i * width..(i + 1) * width].copy_from_slice(&src[r * width..(r + 1) * width]);
        }
    }

    fn scale(&self, len: usize, factor: f32, x: &mut Vec<f32>) {
        let _t = Timer::start(Op::Other);
        elementwise::scale(self, len, factor, x)
    }

    fn fill(&self, len: usize, value: f32, x: &mut Vec<f32>) {
        let _t = Timer::start(Op::Other);
        elementwise::fill(self, len, value, x)
    }

    fn soft_cap(&self, len: usize, cap: f32, x: &mut Vec<f32>) {
        let _t = Timer::start(Op::Other);
        elementwise::soft_cap_all(self, len, cap, x)
    }

    fn add_rms_norm(&self, rows: usize, width: usize, a: &Vec<f32>, w: Option<&Vec<f32>>, eps: f32, x: &mut Vec<f32>) {
        let _t = Timer::start(Op::Norm);
        elementwise::add_rms_norm(self, rows, width, a, w.map(|w| &w[..]), eps, x)
    }

    fn gelu_tanh_mul(&self, rows: usize, width: usize, a: &mut Vec<f32>, b: &Vec<f32>, b_stride: usize, b_col: usize) {
        let _t = Timer::start(Op::Other);
        elementwise::gelu_tanh_mul(self, rows, width, a, b, b_stride, b_col)
    }

    fn route_softmax(
        &self,
        x: &Vec<f32>,
        rows: usize,
        gate: &CpuMat,
        gate_bias: Option<&Vec<f32>>,
        expert_scale: &Vec<f32>,
        routing: crate::SoftmaxRouting,
        logits: &mut Vec<f32>,
        ids: &mut Vec<u32>,
        weights: &mut Vec<f32>,
    ) {
        let _t = Timer::start(Op::Route);
        softmax_route::route_softmax(
            self,
            x,
            rows,
            gate,
            gate_bias.map(|v| &v[..]),
            expert_scale,
            routing,
            logits,
            ids,
            weights,
        )
    }

    fn gqa_query(&self, step: &Step, a: crate::GqaQuery<'_, Self>) {
        let _t = Timer::start(Op::MlaPrepare);
        gqa_query::query(self, step, a)
    }

    fn gated_delta_net(&self, step: &Step, a: crate::DeltaNet<'_, Self>) {
        let _t = Timer::start(Op::Other);
        let d = a.dims;
        let p = strata_kernels::deltanet::DeltaNetParams {
            conv: &a.conv[..],
            a_log: &a.a_log[..],
            dt_bias: &a.dt_bias[..],
            norm: &a.norm[..],
            eps: a.eps,
        };
        let (w, bw, vd, cl, sl) = (d.qkvz_width(), 2 * d.v_heads, d.value_dim(), d.conv_state_len(), d.state_len());
        // (Thread 0's scratch: this op runs on the calling thread, outside any region.)
        let mut mixed = self.scratch(0, d.conv_dim());
        // Rows in order: a sequence's rows follow each other, each on the state the one
        // before left.
        for r in 0..step.rows() {
            let s = step.seq[r] as usize;
            strata_kernels::deltanet::delta_row(
                &d,
                &p,
                &a.qkvz[r * w..(r + 1) * w],
                &a.ba[r * bw..(r + 1) * bw],
                &mut a.conv_state[s * cl..(s + 1) * cl],
                &mut a.state[s * sl..(s + 1) * sl],
                &mut mixed[..d.conv_dim()],
                &mut a.out[r * vd..(r + 1) * vd],
            );
        }
    }

    fn sigmoid_mul(&self, len: usize, gate: &Vec<f32>, x: &mut Vec<f32>) {
        let _t = Timer::start(Op::Other);
        for (v, g) in x[..len].iter_mut().zip(&gate[..len]) {
            *v *= strata_kernels::ops::sigmoid(*g);
        }
    }
}
