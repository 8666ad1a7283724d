//! The device seam. A [`Backend`] owns weights in their stored precision ([`Backend::Mat`]),
//! activations, KV caches and workspaces ([`Backend::Buf`], [`Backend::Idx`]), and runs
//! the fused ops a forward pass is made of: embedding, norms, projections (several at
//! once, optionally added into the residual), rotary tables, MLA attention with DSA
//! selection, noaux_tc routing, batched SwiGLU experts and their combination.
//!
//! Model families ([`strata-models`]) compose these ops; they never touch device memory
//! themselves. A step's per-row metadata (positions, sequences, KV blocks) is a [`Step`],
//! built on the host once per forward. The only reads back to the host in a step are the
//! routed expert ids (streamed experts need them to plan reads) and what the caller
//! asks for (logits, hidden states).
//!
//! Backends: [`cpu::CpuBackend`] (strata-kernels on a persistent thread pool) and, with
//! the `cuda` feature, `cuda::CudaBackend` (NVRTC-compiled kernels and cuBLAS on one
//! stream).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod draw;
mod graph_cache;
pub mod profile;
mod step;

pub use draw::Draw;
pub use step::{is_fed, Step, FED, NON_FINITE};

use anyhow::Result;
pub use strata_kernels::GateAct;
use strata_kernels::{encode_scales, QMatrix, QuantKind, Scales};

/// A matrix in host memory as it comes from a checkpoint, in its stored precision
/// (bf16, f32, FP8 with block scales, int8-row, int4-group), `[rows = out, cols = in]`.
/// `scales` hold f32 values; where `kind` stores its scales as bf16 each must be a bf16
/// value ([`validate`](Self::validate)): the CPU computes with them as they are (the same
/// numbers), a device stores them as `kind` says.
#[derive(Clone, Debug)]
pub struct HostMatrix {
    pub kind: QuantKind,
    pub rows: usize,
    pub cols: usize,
    pub payload: Vec<u8>,
    pub scales: Vec<f32>,
}

impl HostMatrix {
    pub fn f32(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols, "HostMatrix::f32: {} values for {rows}x{cols}", values.len());
        Self {
            kind: QuantKind::F32,
            rows,
            cols,
            payload: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            scales: Vec::new(),
        }
    }

    /// The rows `keep` picks, in order (an encoding whose payload and scales are per row:
    /// every one but FP8's blocks).
    pub fn rows_where(&self, keep: impl Fn(usize) -> bool) -> Self {
        self.rows_in(&(0..self.rows).filter(|&r| keep(r)).collect::<Vec<_>>())
    }

    /// Rows `picked`, in that order (as [`rows_where`](Self::rows_where)).
    pub fn rows_in(&self, picked: &[usize]) -> Self {
        assert!(!matches!(self.kind, QuantKind::Fp8 { .. }), "rows_in: FP8 blocks span rows");
        assert!(picked.iter().all(|&r| r < self.rows), "rows_in: a row beyond {}", self.rows);
        let pb = self.kind.payload_bytes(1, self.cols);
        let sc = self.kind.scale_count(1, self.cols);
        Self {
            kind: self.kind,
            rows: picked.len(),
            cols: self.cols,
            payload: picked.iter().flat_map(|&r| &self.payload[r * pb..(r + 1) * pb]).copied().collect(),
            scales: picked.iter().flat_map(|&r| &self.scales[r * sc..(r + 1) * sc]).copied().collect(),
        }
    }

    /// `parts` one under another: matrices of one encoding and width (whose payload and
    /// scales are per row, as [`rows_in`](Self::rows_in)).
    pub fn stack_rows(parts: &[Self]) -> anyhow::Result<Self> {
        let first = parts.first().ok_or_else(|| anyhow::anyhow!("stack_rows: no matrices"))?;
        for p in parts {
            if p.kind != first.kind || p.cols != first.cols {
                anyhow::bail!(
                    "stack_rows: a {:?} matrix of {} columns under a {:?} one of {}",
                    p.kind,
                    p.cols,
                    first.kind,
                    first.cols
                );
            }
            if matches!(p.kind, QuantKind::Fp8 { .. }) {
                anyhow::bail!("stack_rows: FP8 blocks span rows");
            }
        }
        Ok(Self {
            kind: first.kind,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            payload: parts.iter().flat_map(|p| p.payload.iter().copied()).collect(),
            scales: parts.iter().flat_map(|p| p.scales.iter().copied()).collect(),
        })
    }

    /// (rows `..at`, rows `at..`).
    pub fn split_rows(&self, at: usize) -> (Self, Self) {
        (self.rows_where(|r| r < at), self.rows_where(|r| r >= at))
    }

    /// The transpose of a bf16 or f32 matrix.
    pub fn transposed(&self) -> Self {
        let w = match self.kind {
            QuantKind::Bf16 => 2,
            QuantKind::F32 => 4,
            other => panic!("transposed: {other:?} is not a plain float matrix"),
        };
        let (rows, cols) = (self.rows, self.cols);
        let mut payload = vec![0u8; self.payload.len()];
        for r in 0..rows {
            for c in 0..cols {
                let (src, dst) = ((r * cols + c) * w, (c * rows + r) * w);
                payload[dst..dst + w].copy_from_slice(&self.payload[src..src + w]);
            }
        }
        Self { kind: self.kind, rows: cols, cols: rows, payload, scales: Vec::new() }
    }

    /// Bytes held in `kind`'s encoding: payload and scales.
    pub fn bytes(&self) -> u64 {
        self.kind.stored_bytes(self.rows, self.cols) as u64
    }

    /// The matrix as the CPU kernels read it (bf16 scales as the f32 values they are;
    /// MXFP4's kernels want the e8m0 codes of [`stored_scales`](Self::stored_scales) instead).
    pub fn view(&self) -> QMatrix<'_> {
        QMatrix {
            kind: self.kind.with_f32_scales(),
            rows: self.rows,
            cols: self.cols,
            payload: &self.payload,
            scales: Scales::F32(&self.scales),
        }
    }

    /// Panics if the payload or scale count does not fit `kind` (a programming error);
    /// an error if a scale that `kind` stores as bf16 is not a bf16 value.
    pub fn validate(&self) -> Result<()> {
        self.stored_scales().map(|_| ())
    }

    /// The scales' bytes as `kind` stores them, after [`validate`](Self::validate)'s checks.
    pub fn stored_scales(&self) -> Result<Vec<u8>> {
        if self.kind != QuantKind::Mxfp4 {
            self.view().validate();
        }
        let bytes = encode_scales(self.kind, &self.scales).map_err(|e| anyhow::anyhow!("{e}"))?;
        if self.kind == QuantKind::Mxfp4 {
            // (MXFP4's kernels read the e8m0 codes, not f32 values.)
            QMatrix { scales: Scales::E8m0(&bytes), ..self.view() }.validate();
        }
        Ok(bytes)
    }

    /// Splits the columns at `at`: `(W[:, ..at], W[:, at..])` (a projection of a
    /// concatenated input, taken apart so each half multiplies its own input). Fails
    /// when a scale group or FP8 block straddles the cut.
    pub fn split_cols(self, at: usize) -> Result<(Self, Self)> {
        let (rows, cols) = (self.rows, self.cols);
        anyhow::ensure!(at > 0 && at < cols, "split_cols: cut {at} outside 1..{cols}");
        let unit = match self.kind {
            QuantKind::Int4Group { group, .. } => group,
            QuantKind::Mxfp4 => strata_kernels::MXFP4_GROUP,
            QuantKind::Fp8 { block_cols, .. } => block_cols,
            _ => 1,
        };
        let take = |kind: QuantKind, c0: usize, c1: usize| -> Self {
            let width = c1 - c0;
            let (payload, scales) = match kind {
                QuantKind::F32 | QuantKind::Bf16 => {
                    let e = if kind == QuantKind::F32 { 4 } else { 2 };
                    let p = (0..rows)
                        .flat_map(|r| self.payload[(r * cols + c0) * e..(r * cols + c1) * e].to_vec())
                        .collect();
                    (p, Vec::new())
                }
                QuantKind::Int8Row => {
                    let p = (0..rows).flat_map(|r| self.payload[r * cols + c0..r * cols + c1].to_vec()).collect();
                    (p, self.scales.clone())
                }
                QuantKind::Int4Group { .. } | QuantKind::Mxfp4 => {
                    let group = unit;
                    let half = cols.div_ceil(2);
                    let groups = cols.div_ceil(group);
                    let p = (0..rows)
                        .flat_map(|r| self.payload[r * half + c0 / 2..r * half + c1.div_ceil(2)].to_vec())
                        .collect();
                    let s = (0..rows)
                        .flat_map(|r| self.scales[r * groups + c0 / group..r * groups + c1.div_ceil(group)].to_vec())
                        .collect();
                    (p, s)
                }
                QuantKind::Fp8 { block_rows, block_cols } => {
                    let ncb = cols.div_ceil(block_cols);
                    let p = (0..rows).flat_map(|r| self.payload[r * cols + c0..r * cols + c1].to_vec()).collect();
                    let s = (0..rows.div_ceil(block_rows))
                        .flat_map(|b| {
                            self.scales[b * ncb + c0 / block_cols..b * ncb + c1.div_ceil(block_cols)].to_vec()
                        })
                        .collect();
                    (p, s)
                }
            };
            Self { kind, rows, cols: width, payload, scales }
        };
        anyhow::ensure!(
            at.is_multiple_of(unit),
            "split_cols: cut {at} straddles a scale block of {unit} columns ({})",
            self.kind.name()
        );
        Ok((take(self.kind, 0, at), take(self.kind, at, cols)))
    }

    /// FP8 with row blocks of more than one row re-expressed with one scale row per matrix
    /// row (same values), so any row range is again a valid block-scaled matrix (MLA's
    /// per-head slices of `kv_b_proj`).
    pub fn with_row_scales(self) -> Self {
        let QuantKind::Fp8 { block_rows, block_cols } = self.kind else { return self };
        if block_rows == 1 {
            return self;
        }
        let ncb = self.cols.div_ceil(block_cols);
        let scales = (0..self.rows).flat_map(|r| self.scales[(r / block_rows) * ncb..][..ncb].to_vec()).collect();
        Self { kind: QuantKind::Fp8 { block_rows: 1, block_cols }, scales, ..self }
    }
}

/// Where one projection of a [`Backend::linears`] call writes: `out[r * stride + col + o]`,
/// written or (with `add`) added to what is there (a residual add fused into the
/// projection), plus `bias[o]` when given.
pub struct LinearOut<'a, B: Backend> {
    pub w: &'a B::Mat,
    pub out: &'a mut B::Buf,
    pub stride: usize,
    pub col: usize,
    pub add: bool,
    pub bias: Option<&'a B::Buf>,
}

impl<'a, B: Backend> LinearOut<'a, B> {
    /// `out[r * w.rows + o] = (x W^T)[r, o]`.
    pub fn new(b: &B, w: &'a B::Mat, out: &'a mut B::Buf) -> Self {
        let stride = b.mat_shape(w).0;
        Self { w, out, stride, col: 0, add: false, bias: None }
    }
    /// `out[r * w.rows + o] = (x W^T)[r, o] + bias[o]`.
    pub fn biased(b: &B, w: &'a B::Mat, bias: Option<&'a B::Buf>, out: &'a mut B::Buf) -> Self {
        Self { bias, ..Self::new(b, w, out) }
    }
    /// `out[r * w.rows + o] += (x W^T)[r, o]`.
    pub fn add(b: &B, w: &'a B::Mat, out: &'a mut B::Buf) -> Self {
        Self { add: true, ..Self::new(b, w, out) }
    }
}

/// Dimensions of MLA attention (absorbed `kv_b_proj`).
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kv_lora: usize,
    /// Softmax scale, `qk_head_dim^-0.5`.
    pub scale: f32,
}

impl MlaDims {
    /// Width of a cached row (latent + rotated shared key) and of an absorbed query.
    pub fn key_width(&self) -> usize {
        self.kv_lora + self.rope
    }
}

/// Dimensions of grouped-query attention over a K/V cache.
#[derive(Clone, Copy, Debug)]
pub struct GqaDims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head rotated (half-split RoPE); the rest pass through.
    pub rotary: usize,
    pub scale: f32,
    /// Sliding window: a row sees only its last `window` positions.
    pub window: Option<usize>,
}

impl GqaDims {
    /// Width of a cached row: every KV head's key, then every KV head's value.
    pub fn cache_width(&self) -> usize {
        2 * self.kv_heads * self.head_dim
    }
}

/// The arguments of [`Backend::gqa_prepare`].
pub struct GqaPrepare<'a, B: Backend> {
    pub dims: GqaDims,
    /// `[rows, heads * head_dim]`: normalised per head (with `q_norm`) and rotated here.
    pub q: &'a mut B::Buf,
    /// `[rows, kv_heads * head_dim]` each.
    pub k: &'a B::Buf,
    pub v: &'a B::Buf,
    pub q_norm: Option<&'a B::Buf>,
    pub k_norm: Option<&'a B::Buf>,
    pub eps: f32,
    /// Rotary tables of the step's rows, `[rows, rotary / 2]`.
    pub cos: &'a B::Buf,
    pub sin: &'a B::Buf,
    /// This layer's cache, `[slots, cache_width]`.
    pub cache: &'a mut B::Buf,
}

/// The arguments of [`Backend::gqa_attend`].
pub struct GqaAttend<'a, B: Backend> {
    pub dims: GqaDims,
    pub q: &'a B::Buf,
    pub cache: &'a B::Buf,
    /// gpt-oss's attention sinks, one logit a head (`[heads]`): each joins its head's
    /// softmax denominator and attends to nothing.
    pub sinks: Option<&'a B::Buf>,
    /// Out: `[rows, heads * head_dim]`.
    pub out: &'a mut B::Buf,
}

/// The arguments of [`Backend::gqa_query`]: a layer that reads another layer's K/V
/// cache (Gemma's KV sharing) prepares its queries only.
pub struct GqaQuery<'a, B: Backend> {
    pub dims: GqaDims,
    /// `[rows, heads * head_dim]`: normalised per head (with `q_norm`) and rotated here.
    pub q: &'a mut B::Buf,
    pub q_norm: Option<&'a B::Buf>,
    pub eps: f32,
    /// Rotary tables of the step's rows, `[rows, rotary / 2]`.
    pub cos: &'a B::Buf,
    pub sin: &'a B::Buf,
}

/// The lightning indexer's dimensions.
#[derive(Clone, Copy, Debug)]
pub struct IndexDims {
    pub heads: usize,
    pub dim: usize,
    /// Leading dims of each query/key that are rotated.
    pub rope: usize,
    pub topk: usize,
}

/// Which positions each row attends to in an MLA layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Every visible position (causal): no row sees more than `index_topk`.
    Dense,
    /// The rows' DSA selections, in the step's selection buffer.
    Sparse,
}

/// DeepSeek-V3 `noaux_tc` routing parameters.
#[derive(Clone, Copy, Debug)]
pub struct RouterParams {
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
}

/// Softmax routing's choices: the experts a row takes, and whether their probabilities
/// are renormalised to sum to one (Gemma 4, Qwen3-MoE's `norm_topk_prob`; a softmax over
/// the top-k logits, as gpt-oss and Mixtral route, is the same thing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoftmaxRouting {
    pub top_k: usize,
    pub renormalize: bool,
}

/// The shared expert's rows in a [`Backend::moe_combine`]: row `r`'s is `y[row + r]`,
/// weighed by `sigmoid(gate[r])` where a gate is given (the shared expert's gate of
/// Qwen2-MoE and Qwen3-Next: `gate[r]` is `x_r . w`), else by one.
pub struct SharedRows<'a, B: Backend> {
    pub row: usize,
    pub gate: Option<&'a B::Buf>,
}

impl<B: Backend> Clone for SharedRows<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for SharedRows<'_, B> {}

impl<B: Backend> SharedRows<'_, B> {
    /// Rows from `row` on, ungated.
    pub fn at(row: usize) -> Self {
        Self { row, gate: None }
    }
}

/// A layer's expert biases (gpt-oss), held resident: `gate` and `up` are `[experts,
/// inter]`, `down` `[experts, hidden]`; a task takes row `expert` of each (added to its
/// gate and up products before the activation, and to its down product).
pub struct ExpertBias<'a, B: Backend> {
    pub gate: &'a B::Buf,
    pub up: &'a B::Buf,
    pub down: &'a B::Buf,
    pub expert: usize,
}

impl<B: Backend> Clone for ExpertBias<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for ExpertBias<'_, B> {}

/// One expert's share of a [`Backend::experts`] call.
pub struct ExpertTask<'a, B: Backend + 'a> {
    pub weights: B::ExpertRef<'a>,
    /// The rows of x it runs on (`None`: every row in order).
    pub rows: Option<&'a [u32]>,
    /// Its output rows start at this row of y.
    pub out_row: usize,
    pub bias: Option<ExpertBias<'a, B>>,
}

/// The arguments of [`Backend::mla_prepare`].
pub struct MlaPrepare<'a, B: Backend> {
    pub dims: MlaDims,
    /// `[rows, q_lora]`: normalised in place with `q_norm` (the query's low-rank state).
    pub q_a: &'a mut B::Buf,
    pub q_lora: usize,
    pub q_norm: &'a B::Buf,
    /// `[rows, kv_lora + rope]`: latent (normalised with `kv_norm`) and shared key.
    pub kv_a: &'a B::Buf,
    pub kv_norm: &'a B::Buf,
    pub eps: f32,
    /// Rotary tables of the step's rows, `[rows, rope / 2]`.
    pub cos: &'a B::Buf,
    pub sin: &'a B::Buf,
    /// This layer's cache, `[slots, kv_lora + rope]`.
    pub cache: &'a mut B::Buf,
}

/// The arguments of [`Backend::mla_absorb`]: the per-row, per-head query over the latent.
pub struct MlaAbsorb<'a, B: Backend> {
    pub dims: MlaDims,
    /// `[rows, heads * (nope + rope)]` from `q_b_proj`.
    pub q: &'a B::Buf,
    /// `kv_b_proj` `[heads * (nope + v), kv_lora]`, FP8 with per-row scales.
    pub kv_b: &'a B::Mat,
    pub cos: &'a B::Buf,
    pub sin: &'a B::Buf,
    /// Out: `[rows, heads, kv_lora + rope]`.
    pub q_full: &'a mut B::Buf,
}

/// The arguments of [`Backend::dsa_select`].
pub struct DsaSelect<'a, B: Backend> {
    pub dims: IndexDims,
    /// `[rows, heads * dim]` from `wq_b` (rotated here).
    pub q: &'a mut B::Buf,
    /// `[rows, heads]` from `weights_proj`.
    pub w: &'a B::Buf,
    /// `[rows, dim]` from `wk` (normalised and rotated here, then cached).
    pub k: &'a mut B::Buf,
    pub k_norm_w: &'a B::Buf,
    pub k_norm_b: &'a B::Buf,
    pub eps: f32,
    pub cos: &'a B::Buf,
    pub sin: &'a B::Buf,
    /// This layer's indexer key cache, `[slots, dim]`.
    pub cache: &'a mut B::Buf,
    /// Whether to score and select (some row sees more than `topk` positions) or only
    /// cache the keys.
    pub select: bool,
    /// Out: `[rows, topk]` selected positions (ascending) and `[rows]` counts.
    pub selected: &'a mut B::Idx,
    pub counts: &'a mut B::Idx,
    /// Scores scratch, `[rows, positions]` for the longest visible context.
    pub work: &'a mut B::Buf,
}

/// The arguments of [`Backend::mla_attend`].
pub struct MlaAttend<'a, B: Backend> {
    pub dims: MlaDims,
    pub q_full: &'a B::Buf,
    pub cache: &'a B::Buf,
    pub selection: Selection,
    pub selected: &'a B::Idx,
    pub counts: &'a B::Idx,
    pub topk: usize,
    pub kv_b: &'a B::Mat,
    /// Scratch: `[heads, rows, kv_lora]`.
    pub latent_out: &'a mut B::Buf,
    /// Out: `[rows, heads * v]`.
    pub out: &'a mut B::Buf,
}

/// Prompt rows a forward takes at most on the CPU (see [`Backend::prefill_chunk`]).
pub const PREFILL_CHUNK: usize = 256;
/// The same on CUDA: twice the CPU's. A chunk's routed experts are read once a chunk,
/// whatever their rows (up to a tile's 32), and a 256-row chunk puts ~8 rows on each of
/// GLM-5's 256 experts; 512 rows is also llama.cpp's default micro-batch.
pub const CUDA_PREFILL_CHUNK: usize = 512;

/// A compute device.
pub trait Backend: Send + Sync + Sized + 'static {
    /// f32 values in device memory.
    type Buf: Send + Sync;
    /// u32 values in device memory.
    type Idx: Send + Sync;
    /// A matrix in its stored precision.
    type Mat: Send + Sync;
    /// One expert's three matrices as the expert op reads them (resident matrices or a
    /// slot of the expert slab).
    type ExpertRef<'a>: Copy + Send + Sync;
    /// A layer's resident experts as the device indexes them by routed id
    /// ([`Backend::experts_by_id`]); `()` where the backend has no such path (the CPU
    /// reads routed ids at no cost).
    type ExpertTable: Send + Sync;
    /// A read back in flight ([`Backend::start_read_idx`]).
    type IdxRead: Send;

    /// "cpu (16 threads, avx512f)" and the like.
    fn describe(&self) -> String;
    /// Rows a prompt's forward takes at most: prompts are prefilled in chunks of this many
    /// (a bound on activation memory that the residency plan counts).
    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }
    /// Threads (CPU) or streaming multiprocessors working on one op: sizes workspaces.
    fn parallelism(&self) -> usize;
    /// Sizes the backend's own per-thread scratch for attention over up to `attended`
    /// positions with `heads` heads and selection among up to `context` positions
    /// (called when a session is made, so steps never grow it).
    fn reserve_workspace(&self, heads: usize, attended: usize, context: usize);

    /// `len` zeros (the MoE scratch's zero row relies on it).
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    fn alloc_idx(&self, len: usize) -> Result<Self::Idx>;
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    fn matrix(&self, m: HostMatrix) -> Result<Self::Mat>;
    /// `(rows, cols)` of a matrix.
    fn mat_shape(&self, m: &Self::Mat) -> (usize, usize);
    /// An expert of resident matrices.
    fn expert_ref<'a>(&self, gate: &'a Self::Mat, up: &'a Self::Mat, down: &'a Self::Mat) -> Self::ExpertRef<'a>;
    /// Device -> host.
    fn read(&self, src: &Self::Buf, offset: usize, dst: &mut [f32]);
    fn read_idx(&self, src: &Self::Idx, offset: usize, dst: &mut [u32]);
    /// Host -> device.
    fn write(&self, dst: &mut Self::Buf, offset: usize, src: &[f32]);
    fn write_idx(&self, dst: &mut Self::Idx, offset: usize, src: &[u32]);
    /// The buffer's values when they live in host memory (no copy), else None.
    fn host<'a>(&self, b: &'a Self::Buf) -> Option<&'a [f32]>;

    /// `out[r] = table[tokens[r]]` for the step's token rows (`[rows, cols]`); a fed row
    /// (`FED | i`) reads its id from `picks[i]` (the forward before's greedy picks), and
    /// one whose pick is flagged [`NON_FINITE`] is left as it was.
    fn embed(&self, step: &Step, picks: Option<&Self::Idx>, table: &Self::Mat, out: &mut Self::Buf) -> Result<()>;
    /// Each row's pick among `width` values of `x` (`[rows, width]`) into `picks[..rows]`:
    /// row `r` as `step.draws`' `r`-th [`Draw`] says (a sample, [`draw::pick`]), or where
    /// `step.draws` is empty or the draw greedy, the largest value, ties to the lowest id
    /// (as the host sampler); `NON_FINITE | j` for the lowest `j` whose value is not finite.
    fn pick_rows(&self, step: &Step, rows: usize, width: usize, x: &Self::Buf, picks: &mut Self::Idx);
    /// Starts copying `src[..len]` back (after everything queued so far) without waiting;
    /// [`Backend::finish_read_idx`] waits for it. A few may be in flight at once.
    fn start_read_idx(&self, src: &Self::Idx, len: usize) -> Self::IdxRead;
    /// The values of a read started by [`Backend::start_read_idx`], into `dst`.
    fn finish_read_idx(&self, read: Self::IdxRead, dst: &mut Vec<u32>);
    /// Row-wise RMSNorm of `x` (`[rows, width]`) into `out`, with an optional scale.
    fn rms_norm(&self, rows: usize, width: usize, x: &Self::Buf, w: Option<&Self::Buf>, eps: f32, out: &mut Self::Buf);
    /// Several projections of the same input in one parallel region.
    fn linears(&self, x: &Self::Buf, rows: usize, outs: &mut [LinearOut<'_, Self>]);
    /// [`Backend::linears`] of `rms_norm(x) * w` (`[rows, width]`): the norm fused into the
    /// projections where the backend can (CUDA, one row: each product runs on `x * w` and
    /// is scaled by the row's 1 / rms at the end, the same up to rounding). `scratch`
    /// (`[rows, width]`) may be overwritten; callers must not read it afterwards.
    #[allow(clippy::too_many_arguments)]
    fn norm_linears(
        &self,
        rows: usize,
        width: usize,
        x: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        scratch: &mut Self::Buf,
        outs: &mut [LinearOut<'_, Self>],
    ) {
        self.rms_norm(rows, width, x, Some(w), eps, scratch);
        self.linears(scratch, rows, outs);
    }
    /// The step's rotary tables for `inv_freq` (`[half]`): `[rows, half]` each.
    fn rope_tables(&self, step: &Step, inv_freq: &[f32], cos: &mut Self::Buf, sin: &mut Self::Buf);
    /// Normalises the query state and the latent, rotates the shared key, and writes the
    /// latent and key into the layer's cache at the rows' positions.
    fn mla_prepare(&self, step: &Step, a: MlaPrepare<'_, Self>);
    /// Normalises (optionally) and rotates queries and keys, and writes keys and values
    /// into the layer's cache at the rows' positions.
    fn gqa_prepare(&self, step: &Step, a: GqaPrepare<'_, Self>);
    /// Causal (optionally windowed) attention of each query head over its KV head's
    /// cached keys and values.
    fn gqa_attend(&self, step: &Step, a: GqaAttend<'_, Self>);
    /// Rotates each head's query and maps its non-rotated part onto the latent.
    fn mla_absorb(&self, step: &Step, a: MlaAbsorb<'_, Self>);
    /// The lightning indexer: caches the rows' keys and selects each row's top-k
    /// positions (ties to the earlier position).
    fn dsa_select(&self, step: &Step, a: DsaSelect<'_, Self>);
    /// Attention over the latent cache at the selected (or all visible) positions, then
    /// each head's value projection.
    fn mla_attend(&self, step: &Step, a: MlaAttend<'_, Self>);
    /// `noaux_tc` routing of `x` (`[rows, hidden]`) with the router `gate` (`[experts,
    /// hidden]`) and bias: ids and weights, `[rows, top_k]` each (ids best first).
    #[allow(clippy::too_many_arguments)]
    fn route_noaux(
        &self,
        x: &Self::Buf,
        rows: usize,
        gate: &Self::Mat,
        bias: &Self::Buf,
        p: RouterParams,
        logits: &mut Self::Buf,
        ids: &mut Self::Idx,
        weights: &mut Self::Buf,
    );
    /// SwiGLU experts over rows of `x` (`[rows, hidden]`) into rows of `y`; task `i` is
    /// `task(i)` for `i < n` (no slice of tasks to build per call).
    fn experts<'a>(
        &self,
        x: &Self::Buf,
        rows: usize,
        n: usize,
        task: &(dyn Fn(usize) -> ExpertTask<'a, Self> + Sync),
        y: &mut Self::Buf,
    );
    /// The table of a layer's resident `experts` (gate, up, down; one encoding and shape
    /// for all), or `None` where the backend dispatches experts from the host only (its
    /// `ExpertTable` may then be uninhabited: no table, so no call of `experts_by_id`).
    fn expert_table(&self, experts: &[[Self::Mat; 3]]) -> Result<Option<Self::ExpertTable>>;
    /// One row's routed experts dispatched on the device, the ids never visiting the host:
    /// task `j < top_k` is expert `ids[j]` of `table` into y row `j`, then `shared` into
    /// row `top_k` when given. Each task's products are [`Backend::experts`]' for the same
    /// expert and row, bit for bit.
    fn experts_by_id(
        &self,
        x: &Self::Buf,
        top_k: usize,
        ids: &Self::Idx,
        table: &Self::ExpertTable,
        shared: Option<Self::ExpertRef<'_>>,
        y: &mut Self::Buf,
    );
    /// `out[r] += sum over r's experts in ascending id of w * y[src[r, rank]]`, plus the
    /// shared expert's row when given ([`SharedRows`]): the fixed accumulation order every
    /// expert path shares.
    #[allow(clippy::too_many_arguments)]
    fn moe_combine(
        &self,
        rows: usize,
        hidden: usize,
        top_k: usize,
        ids: &Self::Idx,
        weights: &Self::Buf,
        src: &Self::Idx,
        y: &Self::Buf,
        shared: Option<SharedRows<'_, Self>>,
        out: &mut Self::Buf,
    );
    /// `dst[..len] += src[..len]`.
    fn add(&self, len: usize, src: &Self::Buf, dst: &mut Self::Buf);
    /// `dst[i] = src[rows[i]]`, rows of `width` (the rows whose logits or hidden states
    /// are asked for).
    fn gather_rows(&self, src: &Self::Buf, width: usize, rows: &[u32], dst: &mut Self::Buf);

    // Gemma 4's ops.

    /// `x[..len] *= factor`.
    fn scale(&self, len: usize, factor: f32, x: &mut Self::Buf);
    /// `x[..len] = value`.
    fn fill(&self, len: usize, value: f32, x: &mut Self::Buf);
    /// `x[..len] = cap * tanh(x / cap)` (final logit soft-capping).
    fn soft_cap(&self, len: usize, cap: f32, x: &mut Self::Buf);
    /// `x[r] += rms_norm(a[r]) * w` for `rows` rows of `width` (`w = None`: no scale): a
    /// sublayer's output normalised and added into the residual (Gemma's sandwich norms).
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        rows: usize,
        width: usize,
        a: &Self::Buf,
        w: Option<&Self::Buf>,
        eps: f32,
        x: &mut Self::Buf,
    );
    /// `a[r, i] = gelu_tanh(a[r, i]) * b[r * b_stride + b_col + i]` for `rows` rows of
    /// `width` (a gate applied to a slice of per-row inputs: Gemma's per-layer inputs).
    #[allow(clippy::too_many_arguments)]
    fn gelu_tanh_mul(&self, rows: usize, width: usize, a: &mut Self::Buf, b: &Self::Buf, b_stride: usize, b_col: usize);
    /// [`Backend::experts`] with the gate activation `act` (`down(act(gate x) * up x)`);
    /// SwiGLU is [`Backend::experts`] itself.
    fn gated_experts<'a>(
        &self,
        act: GateAct,
        x: &Self::Buf,
        rows: usize,
        n: usize,
        task: &(dyn Fn(usize) -> ExpertTask<'a, Self> + Sync),
        y: &mut Self::Buf,
    );
    /// Softmax routing: `logits = x gate^T` (f32), per row the softmax, the `top_k`
    /// largest probabilities (ids best first, exact ties to the lower id), renormalised to
    /// sum to one where `routing` says, each times `expert_scale[id]`.
    #[allow(clippy::too_many_arguments)]
    fn route_softmax(
        &self,
        x: &Self::Buf,
        rows: usize,
        gate: &Self::Mat,
        gate_bias: Option<&Self::Buf>,
        expert_scale: &Self::Buf,
        routing: SoftmaxRouting,
        logits: &mut Self::Buf,
        ids: &mut Self::Idx,
        weights: &mut Self::Buf,
    );
    /// The query half of [`Backend::gqa_prepare`]: normalises (optionally) and rotates
    /// queries; no cache is written (a layer attending to another layer's cache).
    fn gqa_query(&self, step: &Step, a: GqaQuery<'_, Self>);

    // Qwen3-Next's ops.

    /// The gated DeltaNet (linear attention, `strata_kernels::deltanet`) over the step's
    /// rows, each continuing its sequence's convolution and recurrent state (`step.seq`).
    fn gated_delta_net(&self, step: &Step, a: DeltaNet<'_, Self>);
    /// `x[i] *= sigmoid(gate[i])` for `i < len` (gated attention output).
    fn sigmoid_mul(&self, len: usize, gate: &Self::Buf, x: &mut Self::Buf);
}

/// The arguments of [`Backend::gated_delta_net`].
pub struct DeltaNet<'a, B: Backend> {
    pub dims: strata_kernels::deltanet::DeltaNetDims,
    /// `[rows, qkvz_width]`: q, k, v then z, each head-major.
    pub qkvz: &'a B::Buf,
    /// `[rows, 2 * v_heads]`: b, then a.
    pub ba: &'a B::Buf,
    /// The depthwise convolution, `[conv_dim, kernel]`.
    pub conv: &'a B::Buf,
    pub a_log: &'a B::Buf,
    pub dt_bias: &'a B::Buf,
    /// The gated norm's weight, `[v_dim]`.
    pub norm: &'a B::Buf,
    pub eps: f32,
    /// Per sequence: `[seqs, conv_state_len]` and `[seqs, state_len]`.
    pub conv_state: &'a mut B::Buf,
    pub state: &'a mut B::Buf,
    /// Out: `[rows, value_dim]`.
    pub out: &'a mut B::Buf,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stacked rows read as the parts' rows in order; parts of another encoding or width,
    /// and FP8 (whose scale blocks span rows), are refused by name.
    #[test]
    fn stack_rows_joins_parts_and_refuses_mismatches() {
        let a = HostMatrix::f32(2, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = HostMatrix::f32(1, 3, &[7.0, 8.0, 9.0]);
        let s = HostMatrix::stack_rows(&[a.clone(), b.clone()]).unwrap();
        assert_eq!((s.rows, s.cols), (3, 3));
        assert_eq!(s.payload, HostMatrix::f32(3, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]).payload);
        assert_eq!(s.rows_in(&[2]).payload, b.payload);
        let narrow = HostMatrix::f32(1, 2, &[1.0, 2.0]);
        let err = HostMatrix::stack_rows(&[a.clone(), narrow]).unwrap_err().to_string();
        assert!(err.contains("2 columns") && err.contains("3"), "{err}");
        let mut bf16 = b.clone();
        bf16.kind = QuantKind::Bf16;
        let err = HostMatrix::stack_rows(&[a.clone(), bf16]).unwrap_err().to_string();
        assert!(err.contains("Bf16") && err.contains("F32"), "{err}");
        let mut fp8 = a;
        fp8.kind = QuantKind::Fp8 { block_rows: 128, block_cols: 128 };
        let err = HostMatrix::stack_rows(&[fp8.clone(), fp8]).unwrap_err().to_string();
        assert!(err.contains("FP8"), "{err}");
        assert!(HostMatrix::stack_rows(&[]).unwrap_err().to_string().contains("no matrices"));
    }
}
