//! A forward's rows on the device: the step's tokens, positions, sequences, block tables
//! and visibility packed into one buffer, uploaded only when they changed, and the
//! descriptor the kernels read (`struct StepDev` in `kernels/common.cu`).

use super::{CudaBackend, DevBuf, State};
use crate::Step;

/// A forward's rows as the kernels read them (`struct StepDev`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StepDesc {
    tokens: u64,
    pos: u64,
    seq: u64,
    blocks: u64,
    /// Per row, one past the last position it sees (0: each row its own position).
    vis: u64,
    bs: i32,
    max_blocks: i32,
}

/// The step last uploaded: its host copy and its device image.
#[derive(Default)]
pub(super) struct StepCache {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    seq: Vec<u32>,
    blocks: Vec<u32>,
    visible: Vec<u32>,
    draws: Vec<u32>,
    bs: usize,
    max_blocks: usize,
    valid: bool,
    packed: Vec<u32>,
    dev: Option<DevBuf<u32>>,
    desc: StepDesc,
    /// Where the step's draws start on the device (0: none).
    pub(super) draws_at: u64,
}

impl CudaBackend {
    /// The step's rows on the device (uploaded when they changed).
    pub(super) fn step_desc(&self, st: &mut State, step: &Step) -> StepDesc {
        let c = &mut st.step;
        let same = c.valid
            && c.tokens == step.tokens
            && c.positions == step.positions
            && c.seq == step.seq
            && c.blocks == step.blocks
            && c.visible == step.visible_to
            && c.draws == step.draws
            && c.bs == step.block_size
            && c.max_blocks == step.max_blocks;
        if same {
            return c.desc;
        }
        let rows = step.rows();
        assert_eq!(step.seq.len(), rows, "step: {} sequence ids for {rows} rows", step.seq.len());
        assert!(
            step.visible_to.is_empty() || step.visible_to.len() == rows,
            "step: {} visibility entries for {rows} rows",
            step.visible_to.len()
        );
        c.tokens.clone_from(&step.tokens);
        c.positions.clone_from(&step.positions);
        c.seq.clone_from(&step.seq);
        c.blocks.clone_from(&step.blocks);
        c.visible.clone_from(&step.visible_to);
        c.draws.clone_from(&step.draws);
        c.bs = step.block_size;
        c.max_blocks = step.max_blocks;
        c.packed.clear();
        let mut tokens = step.tokens.clone();
        tokens.resize(rows, u32::MAX);
        c.packed.extend_from_slice(&tokens);
        c.packed.extend_from_slice(&step.positions);
        c.packed.extend_from_slice(&step.seq);
        c.packed.extend_from_slice(&step.blocks);
        c.packed.extend_from_slice(&step.visible_to);
        let draws_off = c.packed.len();
        c.packed.extend_from_slice(&step.draws);
        c.packed.push(0);
        let need = c.packed.len();
        if c.dev.as_ref().is_none_or(|d| d.len < need) {
            c.dev = Some(self.alloc_t(need.max(256) * 2).unwrap_or_else(|e| panic!("CUDA: {e}")));
        }
        let dev = c.dev.as_ref().unwrap();
        let base = dev.ptr;
        self.upload_t(&mut st.ring, base, &st.step.packed);
        let c = &mut st.step;
        c.desc = StepDesc {
            tokens: base,
            pos: base + 4 * rows as u64,
            seq: base + 8 * rows as u64,
            blocks: base + 12 * rows as u64,
            vis: match step.visible_to.is_empty() {
                true => 0,
                false => base + 4 * (3 * rows + step.blocks.len()) as u64,
            },
            bs: step.block_size.max(1) as i32,
            max_blocks: step.max_blocks as i32,
        };
        c.draws_at = if step.draws.is_empty() { 0 } else { base + 4 * draws_off as u64 };
        c.valid = true;
        c.desc
    }
}
