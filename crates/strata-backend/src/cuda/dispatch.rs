//! Routed experts dispatched on the device: a decode row's top-k ids index a table of the
//! layer's resident experts in device memory, from which each block of the one-row expert
//! kernels builds its own task (`ById`; no task table, no launch to write one). The ids
//! never visit the host, so a MoE layer costs no device-to-host sync and no task upload.

use super::experts::{check_expert, launch_by_id, rounds, row_blocks};
use super::{ById, CudaBackend, CudaExpert, CudaMat, DevBuf, MatDesc, TaskDesc};
use anyhow::{bail, Result};

/// A layer's resident experts as [`crate::Backend::experts_by_id`] indexes them:
/// (gate, up, down) descriptors per expert in device memory. The matrices themselves stay
/// owned by the caller and must outlive the table.
pub struct CudaExpertTable {
    descs: DevBuf<u8>,
    experts: usize,
    inter: usize,
    hidden: usize,
    /// Rounds of outputs a block (`experts::rounds`) for every routed task: the experts'
    /// own when they agree, else one.
    rounds: (usize, usize),
}

pub(super) fn expert_table(b: &CudaBackend, experts: &[[CudaMat; 3]]) -> Result<CudaExpertTable> {
    let Some([g0, ..]) = experts.first() else { bail!("expert table: a layer with no experts") };
    let (inter, hidden) = (g0.rows, g0.cols);
    let mut descs: Vec<MatDesc> = Vec::with_capacity(3 * experts.len());
    for (e, [g, u, d]) in experts.iter().enumerate() {
        let shapes = [(g.rows, g.cols), (u.rows, u.cols), (d.rows, d.cols)];
        if shapes != [(inter, hidden), (inter, hidden), (hidden, inter)] {
            bail!("expert table: expert {e} has shapes {shapes:?}, expert 0 gate/up {inter}x{hidden}, down {hidden}x{inter}");
        }
        if g.kind != u.kind {
            bail!("expert table: expert {e}'s gate ({:?}) and up ({:?}) differ in encoding", g.kind, u.kind);
        }
        descs.extend([g.desc, u.desc, d.desc]);
    }
    let of = |i: usize| rounds(&descs[3 * i], &descs[3 * i + 1], &descs[3 * i + 2]);
    let rounds = if (0..experts.len()).all(|i| of(i) == of(0)) { of(0) } else { (1, 1) };
    // SAFETY: plain #[repr(C)] values viewed as bytes.
    let bytes = unsafe { std::slice::from_raw_parts(descs.as_ptr() as *const u8, std::mem::size_of_val(&descs[..])) };
    let mut st = b.lock();
    let buf = b.alloc_t::<u8>(bytes.len())?;
    b.upload_bytes(&mut st.ring, buf.ptr, bytes);
    Ok(CudaExpertTable { descs: buf, experts: experts.len(), inter, hidden, rounds })
}

pub(super) fn experts_by_id(
    b: &CudaBackend,
    x: &DevBuf<f32>,
    top_k: usize,
    ids: &DevBuf<u32>,
    table: &CudaExpertTable,
    shared: Option<CudaExpert<'_>>,
    y: &mut DevBuf<f32>,
) {
    let (inter, hidden) = (table.inter, table.hidden);
    assert!(top_k >= 1 && ids.len() >= top_k, "experts_by_id: {} ids for top-{top_k}", ids.len());
    assert!(x.len() >= hidden, "experts_by_id: x has {} values, expected a row of {hidden}", x.len());
    let (up_b, down_b) = row_blocks(inter, hidden, table.rounds);
    // Each task's h starts 16-byte aligned (the down kernel loads it in vectors).
    let hstride = inter.next_multiple_of(4);
    let routed_h = top_k * hstride;
    let shared_task = shared.map(|s| {
        check_expert(&s, hidden);
        let (r1, r2) = rounds(&s.gate.desc, &s.up.desc, &s.down.desc);
        TaskDesc {
            g: s.gate.desc,
            u: s.up.desc,
            d: s.down.desc,
            h_off: routed_h as i64,
            bg: 0,
            bu: 0,
            bd: 0,
            nrows: 1,
            rows_off: 0,
            out_row: top_k as i32,
            blk1: (top_k * up_b) as i32,
            blk2: (top_k * down_b) as i32,
            act: 0,
            tiles1: 0,
            tiles2: 0,
            rounds1: r1 as i32,
            rounds2: r2 as i32,
            alpha: 0.0,
            limit: 0.0,
        }
    });
    let ntasks = top_k + usize::from(shared_task.is_some());
    assert!(ntasks * hidden <= y.len(), "experts_by_id: y holds {} values, need {ntasks} rows", y.len());
    let shared_inter = shared.map_or(0, |s| s.gate.rows);
    let (shared_up_b, shared_down_b) =
        shared_task.map_or((0, 0), |t| row_blocks(shared_inter, hidden, (t.rounds1 as usize, t.rounds2 as usize)));
    let blk1 = top_k * up_b + shared_up_b;
    let blk2 = top_k * down_b + shared_down_b;
    let mut st = b.lock();
    let st = &mut *st;
    let hp = b.ensure(&mut st.work.h, routed_h + shared_inter.next_multiple_of(4)).ptr();
    let by = ById {
        descs: table.descs.ptr(),
        ids: ids.ptr(),
        n: table.experts as i32,
        k: top_k as i32,
        hstride: hstride as i32,
        blocks1: up_b as i32,
        blocks2: down_b as i32,
        rounds1: table.rounds.0 as i32,
        rounds2: table.rounds.1 as i32,
        shared: shared_task.unwrap_or_default(),
    };
    launch_by_id(b, (blk1, blk2), ntasks, (x.ptr(), hp, y.ptr()), hidden, &by);
}
