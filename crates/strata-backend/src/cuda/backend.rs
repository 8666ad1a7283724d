//! The `Backend` trait on the CUDA backend: buffers, matrices, and each op's launch (the
//! larger ops' launch code is in `ops.rs`, the experts' in `experts.rs`).

use super::ops::NO_NORM;
use super::{args, experts, ops, CudaBackend, CudaExpert, CudaMat, DevBuf, MatDesc};
use crate::profile::{Op, Timer};
use crate::{Backend, ExpertTask, GateAct, HostMatrix, LinearOut, Step};
use anyhow::Result;

impl Backend for CudaBackend {
    type Buf = DevBuf<f32>;
    type Idx = DevBuf<u32>;
    type Mat = CudaMat;
    type ExpertRef<'a> = CudaExpert<'a>;
    type ExpertTable = super::CudaExpertTable;
    type IdxRead = super::IdxRead;

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn prefill_chunk(&self) -> usize {
        crate::CUDA_PREFILL_CHUNK
    }

    fn parallelism(&self) -> usize {
        self.sms
    }

    fn reserve_workspace(&self, _heads: usize, _attended: usize, _context: usize) {
        // Attention keeps its softmax state in registers; the expert scratch grows to
        // the largest call and is reused.
    }

    fn alloc(&self, len: usize) -> Result<DevBuf<f32>> {
        let _g = self.lock();
        self.alloc_t(len)
    }

    fn alloc_idx(&self, len: usize) -> Result<DevBuf<u32>> {
        let _g = self.lock();
        self.alloc_t(len)
    }

    fn upload(&self, data: &[f32]) -> Result<DevBuf<f32>> {
        let mut st = self.lock();
        let b = self.alloc_t(data.len())?;
        self.upload_t(&mut st.ring, b.ptr, data);
        Ok(b)
    }

    fn matrix(&self, m: HostMatrix) -> Result<CudaMat> {
        // Scales go up as `kind` stores them (bf16 where it says so).
        let scale_bytes = m.stored_scales()?;
        let mut st = self.lock();
        let payload = self.alloc_t::<u8>(m.payload.len())?;
        self.upload_bytes(&mut st.ring, payload.ptr, &m.payload);
        let scales = self.alloc_t::<u8>(scale_bytes.len())?;
        self.upload_bytes(&mut st.ring, scales.ptr, &scale_bytes);
        let desc = MatDesc::new(m.kind, m.rows, m.cols, payload.ptr, scales.ptr)?;
        Ok(CudaMat { desc, kind: m.kind, rows: m.rows, cols: m.cols, _payload: payload, _scales: scales })
    }

    fn mat_shape(&self, m: &CudaMat) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn expert_ref<'a>(&self, gate: &'a CudaMat, up: &'a CudaMat, down: &'a CudaMat) -> CudaExpert<'a> {
        CudaExpert { gate, up, down }
    }

    fn read(&self, src: &DevBuf<f32>, offset: usize, dst: &mut [f32]) {
        assert!(offset + dst.len() <= src.len, "read: {}..{} of {}", offset, offset + dst.len(), src.len);
        let mut st = self.lock();
        self.download(&mut st, src.at(offset), dst);
    }

    fn read_idx(&self, src: &DevBuf<u32>, offset: usize, dst: &mut [u32]) {
        assert!(offset + dst.len() <= src.len, "read_idx: {}..{} of {}", offset, offset + dst.len(), src.len);
        let mut st = self.lock();
        self.download(&mut st, src.at(offset), dst);
    }

    fn write(&self, dst: &mut DevBuf<f32>, offset: usize, src: &[f32]) {
        assert!(offset + src.len() <= dst.len, "write: {}..{} of {}", offset, offset + src.len(), dst.len);
        let mut st = self.lock();
        self.upload_t(&mut st.ring, dst.at(offset), src);
    }

    fn write_idx(&self, dst: &mut DevBuf<u32>, offset: usize, src: &[u32]) {
        assert!(offset + src.len() <= dst.len, "write_idx: {}..{} of {}", offset, offset + src.len(), dst.len);
        let mut st = self.lock();
        self.upload_t(&mut st.ring, dst.at(offset), src);
    }

    fn host<'a>(&self, _b: &'a DevBuf<f32>) -> Option<&'a [f32]> {
        None
    }

    fn embed(&self, step: &Step, picks: Option<&DevBuf<u32>>, table: &CudaMat, out: &mut DevBuf<f32>) -> Result<()> {
        let _t = Timer::start(Op::Embed);
        step.check_tokens(table.rows, picks.map_or(0, |p| p.len))?;
        let rows = step.rows();
        assert!(out.len >= rows * table.cols, "embed: output too small");
        let mut st = self.lock();
        let sd = self.step_desc(&mut st, step);
        let (t, p, o) = (table.desc, picks.map_or(0, |p| p.ptr), out.ptr);
        self.launch(&self.f.embed, (rows as u32, table.cols.div_ceil(256) as u32, 1), 256, 0, &mut args![t, sd, p, o]);
        self.profiled();
        Ok(())
    }

    fn pick_rows(&self, step: &Step, rows: usize, width: usize, x: &DevBuf<f32>, picks: &mut DevBuf<u32>) {
        assert!(x.len >= rows * width && picks.len >= rows, "pick_rows: {rows} rows of {width}");
        let (xp, w, pp) = (x.ptr, width as i32, picks.ptr);
        if step.draws.is_empty() {
            let _g = self.lock();
            self.launch(&self.f.argmax_rows, (rows as u32, 1, 1), super::row_threads(width), 0, &mut args![xp, w, pp]);
        } else {
            assert!(
                step.draws.len() >= rows * crate::Draw::WORDS,
                "pick_rows: {} draw words for {rows} rows",
                step.draws.len()
            );
            let mut st = self.lock();
            // The draws went up with the step's rows (uploaded once, at its embedding).
            self.step_desc(&mut st, step);
            let dp = st.step.draws_at;
            self.launch(&self.f.pick_rows, (rows as u32, 1, 1), 1024, 0, &mut args![xp, w, dp, pp]);
        }
        self.profiled();
    }

    fn start_read_idx(&self, src: &DevBuf<u32>, len: usize) -> super::IdxRead {
        assert!(len <= src.len, "start_read_idx: {len} of {}", src.len);
        let mut st = self.lock();
        self.start_download(&mut st, src.ptr, len)
    }

    fn finish_read_idx(&self, read: super::IdxRead, dst: &mut Vec<u32>) {
        self.finish_download(read, dst)
    }

    fn rms_norm(
        &self,
        rows: usize,
        width: usize,
        x: &DevBuf<f32>,
        w: Option<&DevBuf<f32>>,
        eps: f32,
        out: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Norm);
        assert!(x.len >= rows * width && out.len >= rows * width, "rms_norm: buffers too small");
        let _g = self.lock();
        let (xp, wp, op, wd) = (x.ptr, w.map_or(0, |w| w.ptr), out.ptr, width as i32);
        let block = super::row_threads(width);
        self.launch(&self.f.rms_norm, (rows as u32, 1, 1), block, 0, &mut args![xp, wp, eps, op, wd]);
        self.profiled();
    }

    fn linears(&self, x: &DevBuf<f32>, rows: usize, outs: &mut [LinearOut<'_, Self>]) {
        let _t = Timer::start(Op::Projections);
        if rows == 0 || outs.is_empty() {
            return;
        }
        let mut st = self.lock();
        let jobs = self.lin_jobs(&mut st, x, rows, outs);
        match rows {
            1 => self.linears_one_row(&mut st, &jobs, NO_NORM),
            _ => jobs.iter().for_each(|l| self.linear(&mut st, l)),
        }
        st.work.jobs = jobs;
        self.profiled();
    }

    fn norm_linears(
        &self,
        rows: usize,
        width: usize,
        x: &DevBuf<f32>,
        w: &DevBuf<f32>,
        eps: f32,
        scratch: &mut DevBuf<f32>,
        outs: &mut [LinearOut<'_, Self>],
    ) {
        if rows == 1 && !outs.is_empty() {
            let _t = Timer::start(Op::Projections);
            assert!(w.len >= width && x.len >= width, "norm_linears: x or the norm scale shorter than {width}");
            let mut st = self.lock();
            let jobs = self.lin_jobs(&mut st, x, rows, outs);
            let fused = self.fuses_norm(&jobs, width);
            if fused {
                self.linears_one_row(&mut st, &jobs, (w.ptr, eps));
            }
            st.work.jobs = jobs;
            drop(st);
            self.profiled();
            if fused {
                return;
            }
        }
        self.rms_norm(rows, width, x, Some(w), eps, scratch);
        self.linears(scratch, rows, outs);
    }

    fn rope_tables(&self, step: &Step, inv_freq: &[f32], cos: &mut DevBuf<f32>, sin: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Rope);
        let half = inv_freq.len();
        let rows = step.rows();
        assert!(cos.len >= rows * half && sin.len >= rows * half, "rope_tables: tables too small");
        let mut st = self.lock();
        let st = &mut *st;
        let (c, s) = (&mut st.work.cos, &mut st.work.sin);
        c.resize(rows * half, 0.0);
        s.resize(rows * half, 0.0);
        for r in 0..rows {
            strata_kernels::ops::rope_angles(
                step.positions[r] as usize,
                inv_freq,
                &mut c[r * half..(r + 1) * half],
                &mut s[r * half..(r + 1) * half],
            );
        }
        self.upload_t(&mut st.ring, cos.ptr, &st.work.cos);
        self.upload_t(&mut st.ring, sin.ptr, &st.work.sin);
        self.profiled();
    }

    fn mla_prepare(&self, step: &Step, a: crate::MlaPrepare<'_, Self>) {
        let _t = Timer::start(Op::MlaPrepare);
        ops::mla_prepare(self, step, a);
        self.profiled();
    }

    fn gqa_prepare(&self, step: &Step, a: crate::GqaPrepare<'_, Self>) {
        let _t = Timer::start(Op::MlaPrepare);
        ops::gqa_prepare(self, step, a);
        self.profiled();
    }

    fn gqa_attend(&self, step: &Step, a: crate::GqaAttend<'_, Self>) {
        let _t = Timer::start(Op::MlaAttend);
        ops::gqa_attend(self, step, a);
        self.profiled();
    }

    fn mla_absorb(&self, step: &Step, a: crate::MlaAbsorb<'_, Self>) {
        let _t = Timer::start(Op::MlaAbsorb);
        ops::mla_absorb(self, step, a);
        self.profiled();
    }

    fn dsa_select(&self, step: &Step, a: crate::DsaSelect<'_, Self>) {
        let _t = Timer::start(Op::DsaSelect);
        ops::dsa_select(self, step, a);
        self.profiled();
    }

    fn mla_attend(&self, step: &Step, a: crate::MlaAttend<'_, Self>) {
        let _t = Timer::start(Op::MlaAttend);
        ops::mla_attend(self, step, a);
        self.profiled();
    }

    fn route_noaux(
        &self,
        x: &DevBuf<f32>,
        rows: usize,
        gate: &CudaMat,
        bias: &DevBuf<f32>,
        p: crate::RouterParams,
        logits: &mut DevBuf<f32>,
        ids: &mut DevBuf<u32>,
        weights: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Route);
        ops::route_noaux(self, x, rows, gate, bias, p, logits, ids, weights);
        self.profiled();
    }

    fn experts<'a>(
        &self,
        x: &DevBuf<f32>,
        rows: usize,
        n: usize,
        task: &(dyn Fn(usize) -> ExpertTask<'a, Self> + Sync),
        y: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Experts);
        if n == 0 {
            return;
        }
        experts::experts(self, x, rows, n, task, GateAct::Silu, y);
        self.profiled();
    }

    fn expert_table(&self, experts: &[[CudaMat; 3]]) -> Result<Option<super::CudaExpertTable>> {
        super::dispatch::expert_table(self, experts).map(Some)
    }

    fn experts_by_id(
        &self,
        x: &DevBuf<f32>,
        top_k: usize,
        ids: &DevBuf<u32>,
        table: &super::CudaExpertTable,
        shared: Option<CudaExpert<'_>>,
        y: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Experts);
        super::dispatch::experts_by_id(self, x, top_k, ids, table, shared, y);
        self.profiled();
    }

    fn gated_experts<'a>(
        &self,
        act: GateAct,
        x: &DevBuf<f32>,
        rows: usize,
        n: usize,
        task: &(dyn Fn(usize) -> ExpertTask<'a, Self> + Sync),
        y: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Experts);
        if n == 0 {
            return;
        }
        experts::experts(self, x, rows, n, task, act, y);
        self.profiled();
    }

    fn route_softmax(
        &self,
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
        let _t = Timer::start(Op::Route);
        ops::route_softmax(self, x, rows, gate, gate_bias, expert_scale, routing, logits, ids, weights);
        self.profiled();
    }

    fn gqa_query(&self, step: &Step, a: crate::GqaQuery<'_, Self>) {
        let _t = Timer::start(Op::MlaPrepare);
        ops::gqa_query(self, step, a);
        self.profiled();
    }

    fn gated_delta_net(&self, step: &Step, a: crate::DeltaNet<'_, Self>) {
        let _t = Timer::start(Op::Other);
        self.gated_delta_net_op(step, a);
        self.profiled();
    }

    fn sigmoid_mul(&self, len: usize, gate: &DevBuf<f32>, x: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Other);
        self.sigmoid_mul_op(len, gate, x);
        self.profiled();
    }

    fn scale(&self, len: usize, factor: f32, x: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Other);
        self.scale_op(len, factor, x);
        self.profiled();
    }

    fn fill(&self, len: usize, value: f32, x: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Other);
        self.fill_op(len, value, x);
        self.profiled();
    }

    fn soft_cap(&self, len: usize, cap: f32, x: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Other);
        self.soft_cap_op(len, cap, x);
        self.profiled();
    }

    fn add_rms_norm(
        &self,
        rows: usize,
        width: usize,
        a: &DevBuf<f32>,
        w: Option<&DevBuf<f32>>,
        eps: f32,
        x: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Norm);
        self.add_rms_norm_op(rows, width, a, w, eps, x);
        self.profiled();
    }

    fn gelu_tanh_mul(
        &self,
        rows: usize,
        width: usize,
        a: &mut DevBuf<f32>,
        b: &DevBuf<f32>,
        b_stride: usize,
        b_col: usize,
    ) {
        let _t = Timer::start(Op::Other);
        self.gelu_tanh_mul_op(rows, width, a, b, b_stride, b_col);
        self.profiled();
    }

    fn moe_combine(
        &self,
        rows: usize,
        hidden: usize,
        top_k: usize,
        ids: &DevBuf<u32>,
        weights: &DevBuf<f32>,
        src: &DevBuf<u32>,
        y: &DevBuf<f32>,
        shared: Option<crate::SharedRows<'_, Self>>,
        out: &mut DevBuf<f32>,
    ) {
        let _t = Timer::start(Op::Combine);
        assert!(top_k <= 64, "moe_combine: top_k {top_k} above 64");
        assert!(ids.len >= rows * top_k && src.len >= rows * top_k && weights.len >= rows * top_k);
        assert!(out.len >= rows * hidden, "moe_combine: output too small");
        let _g = self.lock();
        let (h, k) = (hidden as i32, top_k as i32);
        let sh = shared.map_or(-1, |s| s.row as i32);
        let gate = shared.and_then(|s| s.gate);
        if let Some(g) = gate {
            assert!(g.len >= rows, "moe_combine: {} shared gate values for {rows} rows", g.len);
        }
        let gp = gate.map_or(0, |g| g.ptr);
        let (ip, wp, sp, yp, op) = (ids.ptr, weights.ptr, src.ptr, y.ptr, out.ptr);
        let grid = (rows as u32, hidden.div_ceil(256) as u32, 1);
        self.launch(&self.f.combine, grid, 256, 0, &mut args![h, k, ip, wp, sp, yp, sh, gp, op]);
        self.profiled();
    }

    fn add(&self, len: usize, src: &DevBuf<f32>, dst: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Combine);
        assert!(src.len >= len && dst.len >= len, "add: {len} values of buffers of {} and {}", src.len, dst.len);
        let _g = self.lock();
        let (n, s, d) = (len as i64, src.ptr, dst.ptr);
        let blocks = len.div_ceil(256).clamp(1, 4 * self.sms) as u32;
        self.launch(&self.f.add, (blocks, 1, 1), 256, 0, &mut args![n, s, d]);
        self.profiled();
    }

    fn gather_rows(&self, src: &DevBuf<f32>, width: usize, rows: &[u32], dst: &mut DevBuf<f32>) {
        let _t = Timer::start(Op::Other);
        assert!(dst.len >= rows.len() * width, "gather_rows: destination too small");
        let _g = self.lock();
        // A copy kernel per row, not a memcpy: it stays in a decode step's graph.
        let (n, blocks) = (width as i64, width.div_ceil(256).clamp(1, self.sms) as u32);
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            assert!((r + 1) * width <= src.len, "gather_rows: row {r} beyond the source");
            let (s, d) = (src.at(r * width), dst.at(i * width));
            self.launch(&self.f.copy, (blocks, 1, 1), 256, 0, &mut args![n, s, d]);
        }
        self.profiled();
    }
}
