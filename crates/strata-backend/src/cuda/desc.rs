//! The structs the kernels read, mirrored field for field (`#[repr(C)]`): a matrix
//! (`struct Mat`), a grouped projection launch's jobs, an expert task and a decode row's
//! tasks by id. A field added on one side must be added on the other in the same place.

use anyhow::Result;
use strata_kernels::{QuantKind, ScaleType, MXFP4_GROUP};

/// Elements in a 16-byte vector, by encoding code (`Vw` in `kernels/products.cu`).
pub(super) const VEC_WIDTH: [usize; 6] = [4, 8, 16, 32, 16, 32];

/// A matrix as the kernels read it (`struct Mat` in `kernels/common.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MatDesc {
    pub(super) w: u64,
    pub(super) s: u64,
    pub(super) kind: i32,
    pub(super) rows: i32,
    pub(super) cols: i32,
    pub(super) group: i32,
    pub(super) brow: i32,
    pub(super) bcol: i32,
    pub(super) ld: i32,
    pub(super) spr: i32,
    pub(super) vec: i32,
    /// How the scales are stored: 0 f32, 1 bf16 (`int4-gN-bf16`), 2 e4m3 (`int4-gN-e4m3`:
    /// the f32 factor, then a byte a scale), 3 e8m0 (MXFP4: a byte a scale).
    pub(super) st: i32,
}

impl MatDesc {
    /// Whether the one-row expert kernels take this matrix through the int4 tensor-core
    /// tiles (`i4_tiles` in `kernels/tiles.cu`).
    pub(super) fn i4_tiles(&self) -> bool {
        self.kind == 3 && self.vec != 0 && self.cols % 128 == 0 && self.group >= 32 && self.group % 32 == 0
    }

    /// Whether this is int4 with e4m3 scales: never sent to the one-row projection kernels
    /// (`k_linear_quad`, `k_linears_1`), which read f32 and bf16 scales
    /// only (`mscale_t` in `kernels/common.cu`); `k_linear_R` takes them.
    pub(super) fn e4m3_scales(&self) -> bool {
        self.kind == 3 && self.st == 2
    }

    /// Whether the weights are int8, int4, e4m3 or MXFP4 (decoded on the way in; `kind_code`
    /// 2-5).
    pub(super) fn quantized(&self) -> bool {
        (2..=5).contains(&self.kind)
    }

    /// The descriptor of a `rows x cols` matrix of `kind` whose payload is at device
    /// address `w` and its scales (stored as `kind` says) at `s`.
    pub(super) fn new(kind: QuantKind, rows: usize, cols: usize, w: u64, s: u64) -> Result<Self> {
        let ld = kind.payload_bytes(1, cols);
        let (group, brow, bcol, spr, width) = match kind {
            QuantKind::F32 => (1, 1, 1, 0, VEC_WIDTH[0]),
            QuantKind::Bf16 => (1, 1, 1, 0, VEC_WIDTH[1]),
            QuantKind::Int8Row => (1, 1, 1, 1, VEC_WIDTH[2]),
            QuantKind::Int4Group { group, .. } => (group, 1, 1, cols.div_ceil(group), VEC_WIDTH[3]),
            QuantKind::Fp8 { block_rows, block_cols } => {
                (1, block_rows, block_cols, cols.div_ceil(block_cols), VEC_WIDTH[4])
            }
            QuantKind::Mxfp4 => (MXFP4_GROUP, 1, 1, cols.div_ceil(MXFP4_GROUP), VEC_WIDTH[5]),
        };
        let one_scale_per_vector = match kind {
            QuantKind::Int4Group { group, .. } => group % 32 == 0,
            QuantKind::Fp8 { block_cols, .. } => block_cols % 16 == 0,
            _ => true,
        };
        let vec = w.is_multiple_of(16) && ld.is_multiple_of(16) && cols.is_multiple_of(width) && one_scale_per_vector;
        anyhow::ensure!(rows <= i32::MAX as usize && cols <= i32::MAX as usize, "matrix {rows}x{cols} too large");
        let st = match kind.scale_type() {
            ScaleType::F32 => 0,
            ScaleType::Bf16 => 1,
            ScaleType::E4m3 => 2,
            ScaleType::E8m0 => 3,
        };
        // e4m3's region starts with its f32 factor.
        let align = match st {
            1 => 2,
            3 => 1,
            _ => 4,
        };
        anyhow::ensure!(s.is_multiple_of(align), "matrix scales at a misaligned address");
        Ok(MatDesc {
            w,
            s,
            kind: kind_code(kind),
            rows: rows as i32,
            cols: cols as i32,
            group: group as i32,
            brow: brow as i32,
            bcol: bcol as i32,
            ld: ld as i32,
            spr: spr as i32,
            vec: vec as i32,
            st,
        })
    }
}

/// One projection of a `k_linears_1` launch (`struct LinJob` in `kernels/products.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LinJob {
    pub(super) m: MatDesc,
    pub(super) out: u64,
    pub(super) bias: u64,
    pub(super) add: i32,
    pub(super) split: i32,
    pub(super) blk0: i32,
    /// 1: four outputs a group of `split` warps (`linear_quad`); 0: one (`k_linear_1`).
    pub(super) quad: i32,
}

/// Projections one `k_linears_1` launch computes (`struct LinJobs`).
pub(super) const MAX_JOBS: usize = 4;
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LinJobs {
    pub(super) j: [LinJob; MAX_JOBS],
}

/// One expert's share of a grouped expert launch (`struct Task` in `kernels/experts.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TaskDesc {
    pub(super) g: MatDesc,
    pub(super) u: MatDesc,
    pub(super) d: MatDesc,
    pub(super) h_off: i64,
    /// The expert's biases (device addresses of its gate, up and down rows; 0: none).
    pub(super) bg: u64,
    pub(super) bu: u64,
    pub(super) bd: u64,
    pub(super) nrows: i32,
    pub(super) rows_off: i32,
    pub(super) out_row: i32,
    pub(super) blk1: i32,
    pub(super) blk2: i32,
    /// The gate activation (`act_mul` in `kernels/common.cu`).
    pub(super) act: i32,
    /// Whether the many-row kernels' pass 1 (gate and up) / pass 2 (down) take the
    /// tensor-core tiles (`kernels/expert_tiles.cu`; see `experts::mma_tiles`).
    pub(super) tiles1: i32,
    pub(super) tiles2: i32,
    /// Rounds of 16 (gate/up) and 32 (down) outputs a block of the one-row kernels
    /// computes (1 or 2; see `experts::rounds`).
    pub(super) rounds1: i32,
    pub(super) rounds2: i32,
    /// The clamped SwiGLU's parameters (act 2; `act_mul` in `kernels/common.cu`).
    pub(super) alpha: f32,
    pub(super) limit: f32,
}

/// A decode row's expert tasks from its routed ids (`struct ById` in `kernels/experts.cu`,
/// see `dispatch.rs`), or with `k` 0 a lone task in `shared` (`experts::experts`); read
/// where the one-row expert kernels get no table, all zeros where they do.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ById {
    pub(super) descs: u64,
    pub(super) ids: u64,
    pub(super) n: i32,
    pub(super) k: i32,
    pub(super) hstride: i32,
    pub(super) blocks1: i32,
    pub(super) blocks2: i32,
    pub(super) rounds1: i32,
    pub(super) rounds2: i32,
    pub(super) shared: TaskDesc,
}

pub(super) fn kind_code(k: QuantKind) -> i32 {
    match k {
        QuantKind::F32 => 0,
        QuantKind::Bf16 => 1,
        QuantKind::Int8Row => 2,
        QuantKind::Int4Group { .. } => 3,
        QuantKind::Fp8 { .. } => 4,
        QuantKind::Mxfp4 => 5,
    }
}
