//! Gated experts (`down(act(gate x) * up x)`) over the host's task table: the grouped
//! launches of a forward's experts (one-row kernels in decode, the tensor-core tiles or
//! one output a warp in a prompt) and the many-row products for an expert with many rows.

use super::{args, ById, CudaBackend, CudaExpert, DevBuf, Lin, MatDesc, TaskDesc, EXPERT_BIG_ROWS};
use crate::{ExpertTask, GateAct};
use strata_kernels::QuantKind;

/// bf16 experts of this many rows or more go to cuBLAS (one expert at a time, the weights
/// read about once); fewer go through the tiles, 32 rows a task, as quantized experts of any
/// rows do. A prompt's routed experts rarely reach it (a 512-token prompt puts ~85 rows on
/// each of 48 experts, 16 on each of GLM-5's 256: there the tiles were 1.25x cuBLAS), a
/// dense MLP or shared expert of a long prompt does (cuBLAS was 1.08x the tiles at 512
/// rows).
const BF16_CUBLAS_ROWS: usize = 256;

/// Outputs a warp computes in the one-row expert kernels (`UP_OUTS`, `DOWN_OUTS` in
/// kernels/experts.cu); block counts follow from them.
const UP_OUTS: usize = 2;
const DOWN_OUTS: usize = 4;

/// Rounds of outputs a block of the one-row kernels computes for an expert (gate/up: of
/// 8 x UP_OUTS, down: of 8 x DOWN_OUTS): two where the matrices take the int4 tiles, which
/// read a round's weights (36 KB for GLM-5's down) in little more than a block's start-up
/// (its task, the first loads' latency), so two rounds share it (H200: int4 expert decode
/// 1.84 -> 2.13 TB/s with two rounds of down); one for the others (bf16 decoded 2% slower
/// at two), and one for gate/up with e4m3 scales, whose later rounds stage x again
/// (`i4_up_block` in kernels/tiles.cu): the slice with int4-g64-e4m3 experts decoded 0.5%
/// faster at one (H200, 2026-12-04).
pub(super) fn rounds(g: &MatDesc, u: &MatDesc, d: &MatDesc) -> (usize, usize) {
    let keeps_x = g.st != 2;
    (1 + usize::from(g.i4_tiles() && u.i4_tiles() && keeps_x), 1 + usize::from(d.i4_tiles()))
}

/// Blocks of 8 warps a one-row task takes in the gate/up and the down launch, at `rounds`
/// rounds of outputs a block.
pub(super) fn row_blocks(inter: usize, hidden: usize, rounds: (usize, usize)) -> (usize, usize) {
    (inter.div_ceil(8 * UP_OUTS * rounds.0), hidden.div_ceil(8 * DOWN_OUTS * rounds.1))
}

/// Rows a tile takes at most (`XT_NT` n-tiles of 8 in `kernels/expert_tiles.cu`): tasks and
/// `k_tiled_mma`'s blocks hold no more.
pub(super) const TILE_ROWS: usize = 32;

/// Outputs a block of the many-row kernels computes: tiles (`XT_UP_OUTS`, `XT_DOWN_OUTS` in
/// `kernels/expert_tiles.cu`), else one a warp.
const TILE_UP_OUTS: usize = 128;
pub(super) const TILE_DOWN_OUTS: usize = 256;

/// Whether the tensor-core tiles (`kernels/expert_tiles.cu`: a prompt's experts and its
/// quantized or batched products) take matrix `m`: an encoding they turn into bf16 exactly
/// (not f32, which keeps its exact path), rows of whole 32-column runs in aligned vectors,
/// one scale a run. It depends on the matrix alone (never on the batch), so a task sums the
/// same way wherever its weights live.
pub(super) fn mma_tiles(b: &CudaBackend, m: &MatDesc) -> bool {
    let runs = match m.kind {
        1 | 2 => true,
        3 => m.group % 32 == 0,
        4 => m.bcol % 32 == 0,
        _ => false,
    };
    b.mma && runs && m.vec != 0 && m.cols % 32 == 0
}

/// Panics unless `e` is a gated expert over `hidden`: gate = up = [inter, hidden], down =
/// [hidden, inter], gate and up in one encoding (the grouped kernels read them together).
pub(super) fn check_expert(e: &CudaExpert<'_>, hidden: usize) {
    let (g, u, d) = (e.gate, e.up, e.down);
    let inter = g.rows;
    assert!(
        g.cols == hidden && u.rows == inter && u.cols == hidden && d.rows == hidden && d.cols == inter,
        "swiglu_expert: shapes gate {}x{}, up {}x{}, down {}x{}; expected gate = up = [inter, hidden], down = [hidden, inter] with hidden {hidden}",
        g.rows,
        g.cols,
        u.rows,
        u.cols,
        d.rows,
        d.cols
    );
    assert_eq!(g.kind, u.kind, "swiglu_expert: gate and up must share an encoding");
}

/// Gated experts (`down(act(gate x) * up x)`): experts with few rows, and quantized ones of
/// any rows 32 at a time, in two grouped launches (gate/up, down) over a task table built
/// here; a bf16 or f32 expert with many rows (a dense MLP or the shared expert in a
/// prefill) through the many-rows products.
pub(crate) fn experts<'a>(
    b: &CudaBackend,
    x: &DevBuf<f32>,
    rows: usize,
    n: usize,
    task: &(dyn Fn(usize) -> ExpertTask<'a, CudaBackend> + Sync),
    act: GateAct,
    y: &mut DevBuf<f32>,
) {
    let (act, alpha, limit): (i32, f32, f32) = match act {
        GateAct::Silu => (0, 0.0, 0.0),
        GateAct::GeluTanh => (1, 0.0, 0.0),
        GateAct::SwigluClamped { alpha, limit } => (2, alpha, limit),
    };
    let hidden = task(0).weights.gate.cols;
    assert!(x.len() >= rows * hidden, "experts: x has {} values, expected {rows} rows x {hidden}", x.len());
    let mut tasks: Vec<TaskDesc> = Vec::with_capacity(n);
    let mut rowidx: Vec<u32> = Vec::new();
    // (weights, rows offset, rows, out row, x as it is)
    let mut big = Vec::new();
    let mut h_off = 0usize;
    for i in 0..n {
        let t = task(i);
        check_expert(&t.weights, hidden);
        let (g, u, d) = (t.weights.gate, t.weights.up, t.weights.down);
        let inter = g.rows;
        let (bg, bu, bd) = t.bias.map_or((0, 0, 0), |b| bias_rows(&b, inter, hidden));
        let nrows = match t.rows {
            Some(r) => {
                assert!(r.iter().all(|&i| (i as usize) < rows), "experts: a job row is beyond x's {rows} rows");
                r.len()
            }
            None => rows,
        };
        assert!((t.out_row + nrows) * hidden <= y.len(), "experts: output rows beyond y");
        if nrows == 0 {
            continue;
        }
        let rows_off = rowidx.len();
        match t.rows {
            Some(r) => rowidx.extend_from_slice(r),
            None => rowidx.extend(0..rows as u32),
        }
        // By the matrices only (for quantized ones never by the task's rows, so a row sums
        // the same whatever task it comes in).
        let tiles1 =
            mma_tiles(b, &g.desc) && mma_tiles(b, &u.desc) && (g.desc.kind, g.desc.st) == (u.desc.kind, u.desc.st);
        let tiles2 = mma_tiles(b, &d.desc);
        // Many rows of quantized weights go through the tiles too, TILE_ROWS at a
        // time (the many-rows products decode them on the CUDA cores); bf16 up to
        // bf16_cublas_rows() too, beyond it to cuBLAS; f32 to the f32 products.
        let quantized = [g, u, d].iter().any(|m| m.desc.quantized());
        let tiled = tiles1 && tiles2 && (quantized || nrows < BF16_CUBLAS_ROWS);
        // (MXFP4 has no many-rows product kernel: it stays in the grouped kernels.)
        let mxfp4 = [g, u, d].iter().any(|m| m.kind == QuantKind::Mxfp4);
        if nrows >= EXPERT_BIG_ROWS && !tiled && !mxfp4 {
            big.push((t.weights, rows_off, nrows, t.out_row, t.rows.is_none(), (bg, bu, bd)));
            continue;
        }
        let (r1, r2) = rounds(&g.desc, &u.desc, &d.desc);
        for at in (0..nrows).step_by(TILE_ROWS) {
            let part = (nrows - at).min(TILE_ROWS);
            tasks.push(TaskDesc {
                g: g.desc,
                u: u.desc,
                d: d.desc,
                h_off: h_off as i64,
                bg,
                bu,
                bd,
                nrows: part as i32,
                rows_off: (rows_off + at) as i32,
                out_row: (t.out_row + at) as i32,
                blk1: 0,
                blk2: 0,
                act,
                tiles1: i32::from(tiles1),
                tiles2: i32::from(tiles2),
                rounds1: r1 as i32,
                rounds2: r2 as i32,
                alpha,
                limit,
            });
            h_off += (part * inter).next_multiple_of(4);
        }
    }
    // Block ranges: 8 warps a block, each one output or a share of a tile's, or in a
    // one-row forward (decode) the row kernels' several. Chosen by the forward's rows, not
    // by the tasks' at hand:
    // a prompt's experts come in batches that depend on what was resident (all at once,
    // or hits then misses a few at a time), and a batch of one-row tasks must sum as the
    // same tasks do beside a many-row one, so that streamed equals resident bit for bit
    // (the row kernels add in another order for bf16, and int4 there takes the tiles).
    let one_row = rows == 1;
    // A prompt's tasks with a quantized matrix go to the `_q` kernels (one block an SM,
    // registers for the decode), the rest to the bf16 ones: two tables, the quantized
    // after the others. By the matrices only, so a task sums the same way wherever it goes.
    let split = if one_row {
        tasks.len()
    } else {
        let quantized = |t: &TaskDesc| [t.g, t.u, t.d].iter().any(MatDesc::quantized);
        tasks.sort_by_key(quantized);
        tasks.partition_point(|t| !quantized(t))
    };
    let mut blocks = [(0usize, 0usize); 2];
    for (i, t) in tasks.iter_mut().enumerate() {
        let (blk1, blk2) = &mut blocks[usize::from(i >= split)];
        t.blk1 = *blk1 as i32;
        t.blk2 = *blk2 as i32;
        let inter = t.g.rows as usize;
        let (up, down) = if one_row {
            row_blocks(inter, hidden, (t.rounds1 as usize, t.rounds2 as usize))
        } else {
            let up_outs = if t.tiles1 != 0 { TILE_UP_OUTS } else { 8 };
            let down_outs = if t.tiles2 != 0 { TILE_DOWN_OUTS } else { 8 };
            (inter.div_ceil(up_outs), hidden.div_ceil(down_outs))
        };
        *blk1 += up;
        *blk2 += down;
    }
    let mut st = b.lock();
    let st = &mut *st;
    let (xp, yp, hid) = (x.ptr(), y.ptr(), hidden as i32);
    if let ([lone], true) = (&tasks[..], one_row && big.is_empty()) {
        // A lone one-row task (a dense MLP's) rides in the launch's arguments as the
        // by-id kernels' shared task with no routed ones: no table to upload, a copy in the
        // stream that would stall the device between two kernels and end a graph. (Blocks
        // a routed task of 1: every block's task index is then min(block, 0) = the lone one.)
        let hp = b.ensure(&mut st.work.h, h_off.max(4)).ptr();
        let by = ById { k: 0, blocks1: 1, blocks2: 1, shared: *lone, ..ById::default() };
        launch_by_id(b, blocks[0], 1, (xp, hp, yp), hidden, &by);
        return;
    }
    // Table: the tasks, then the row lists (16-byte aligned).
    let tbytes = std::mem::size_of_val(&tasks[..]);
    let roff = tbytes.next_multiple_of(16);
    let total = roff + 4 * rowidx.len();
    let bytes = &mut st.work.bytes;
    bytes.clear();
    // SAFETY: plain #[repr(C)] values viewed as bytes.
    bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(tasks.as_ptr() as *const u8, tbytes) });
    bytes.resize(roff, 0);
    bytes.extend(rowidx.iter().flat_map(|r| r.to_le_bytes()));
    let table = b.ensure(&mut st.work.table, total.max(16)).ptr();
    b.upload_bytes(&mut st.ring, table, &st.work.bytes);
    let ridx = table + roff as u64;
    if !tasks.is_empty() {
        let hp = b.ensure(&mut st.work.h, h_off.max(4)).ptr();
        let groups = [
            (table, split, &b.f.experts_up, &b.f.experts_down),
            (
                table + std::mem::size_of_val(&tasks[..split]) as u64,
                tasks.len() - split,
                &b.f.experts_up_q,
                &b.f.experts_down_q,
            ),
        ];
        for ((tp, nt, up, down), (blk1, blk2)) in groups.into_iter().zip(blocks) {
            if nt == 0 {
                continue;
            }
            let nt = nt as i32;
            if one_row {
                let by = ById::default();
                b.launch(&b.f.experts_up_row, (blk1 as u32, 1, 1), 256, 0, &mut args![tp, nt, ridx, xp, hid, hp, by]);
                b.launch(&b.f.experts_down_row, (blk2 as u32, 1, 1), 256, 0, &mut args![tp, nt, hp, hid, yp, by]);
            } else {
                b.launch(up, (blk1 as u32, 1, 1), 256, 0, &mut args![tp, nt, ridx, xp, hid, hp]);
                b.launch(down, (blk2 as u32, 1, 1), 256, 0, &mut args![tp, nt, hp, hid, yp]);
            }
        }
    }
    for (w, rows_off, nrows, out_row, whole, (bg, bu, bd)) in big {
        let inter = w.gate.rows;
        let xin = if whole && nrows == rows {
            xp
        } else {
            let gx = b.ensure(&mut st.work.gx, nrows * hidden).ptr();
            let rp = ridx + 4 * rows_off as u64;
            b.launch(&b.f.gather, (nrows as u32, 1, 1), 256, 0, &mut args![xp, rp, hid, gx]);
            gx
        };
        let gp = b.ensure(&mut st.work.g, nrows * inter).ptr();
        let up = b.ensure(&mut st.work.u, nrows * inter).ptr();
        let hp = b.ensure(&mut st.work.hb, nrows * inter).ptr();
        b.linear(st, &Lin { bias: bg, ..Lin::plain(w.gate, xin, hidden, nrows, gp) });
        b.linear(st, &Lin { bias: bu, ..Lin::plain(w.up, xin, hidden, nrows, up) });
        let len = (nrows * inter) as i64;
        let blocks = (nrows * inter).div_ceil(256).clamp(1, 8 * b.sms) as u32;
        b.launch(&b.f.act_mul, (blocks, 1, 1), 256, 0, &mut args![len, gp, up, act, alpha, limit, hp]);
        b.linear(st, &Lin { bias: bd, ..Lin::plain(w.down, hp, inter, nrows, yp + (4 * out_row * hidden) as u64) });
    }
}

/// The device addresses of an expert's bias rows (gate, up, down), checked against the
/// buffers' lengths.
fn bias_rows(b: &crate::ExpertBias<'_, CudaBackend>, inter: usize, hidden: usize) -> (u64, u64, u64) {
    let e = b.expert;
    assert!(b.gate.len() >= (e + 1) * inter && b.up.len() >= (e + 1) * inter, "experts: no gate/up bias row {e}");
    assert!(b.down.len() >= (e + 1) * hidden, "experts: no down bias row {e}");
    (b.gate.ptr() + (4 * e * inter) as u64, b.up.ptr() + (4 * e * inter) as u64, b.down.ptr() + (4 * e * hidden) as u64)
}

/// The one-row expert kernels (gate/up, then down) over `blocks` blocks, their tasks from
/// `by` with no table; (x, h, y) device addresses.
pub(super) fn launch_by_id(
    b: &CudaBackend,
    blocks: (usize, usize),
    ntasks: usize,
    (xp, hp, yp): (u64, u64, u64),
    hidden: usize,
    by: &ById,
) {
    let (hid, nt, none, by) = (hidden as i32, ntasks as i32, 0u64, *by);
    b.launch(&b.f.experts_up_row, (blocks.0 as u32, 1, 1), 256, 0, &mut args![none, nt, none, xp, hid, hp, by]);
    b.launch(&b.f.experts_down_row, (blocks.1 as u32, 1, 1), 256, 0, &mut args![none, nt, hp, hid, yp, by]);
}
