//! A set of gated experts (a layer's routed experts, the shared expert, a dense MLP) in
//! one pool region: gather each expert's rows, then gate/up of every expert in one
//! parallel pass (`h = act(g) * u`: SwiGLU's silu, Gemma's tanh-approximated GELU, or
//! gpt-oss's clamped SwiGLU), then down of every expert, work items split by cost into
//! one contiguous run per thread. All scratch lives in the runner and is reused, so after the first
//! calls a step allocates nothing.

use super::{block_size, silu, KernelPath, Out, Product, QMatrix, Staging};
use crate::ops::gelu_tanh;
use crate::pool::ThreadPool;
use crate::quant::QuantKind;

/// Weight bytes (times rows, up to a tile) worth a thread of their own.
const BYTES_PER_THREAD: usize = 32 << 10;

/// How the gate and up products combine into `h` (`h = act(gate x) * up x`, but for
/// the clamped form).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum GateAct {
    /// `silu(g) * u`, `silu(g) = g / (1 + e^-g)` (SwiGLU: DeepSeek, GLM, Qwen).
    #[default]
    Silu,
    /// `gelu(g) * u`, `gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`
    /// (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: `g' = min(g, limit)`, `u' = clamp(u, -limit, limit)`,
    /// `h = (u' + 1) * g' * sigmoid(alpha g')`.
    SwigluClamped { alpha: f32, limit: f32 },
}

impl GateAct {
    /// `h` from one gate value `g` and up value `u`.
    #[inline]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Self::Silu => silu(g) * u,
            Self::GeluTanh => gelu_tanh(g) * u,
            Self::SwigluClamped { alpha, limit } => {
                let g = g.min(limit);
                let u = u.clamp(-limit, limit);
                (u + 1.0) * g / (1.0 + (-alpha * g).exp())
            }
        }
    }
}

/// One expert's biases (gpt-oss): added to its gate and up products before the
/// activation (`inter` values each) and to its down product (`hidden` values).
#[derive(Clone, Copy)]
pub struct ExpertBias<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
}

/// One expert's work: `y = down(act(gate x + bg) * (up x + bu)) + bd` over some rows of x
/// (the biases where it has them).
#[derive(Clone, Copy)]
pub struct ExpertJob<'a> {
    pub gate: QMatrix<'a>,
    pub up: QMatrix<'a>,
    pub down: QMatrix<'a>,
    /// The rows of x this expert runs on, or `None` for all rows in order.
    pub rows: Option<&'a [u32]>,
    /// Row `i` of this job's output goes to row `out_row + i` of y.
    pub out_row: usize,
    pub bias: Option<ExpertBias<'a>>,
}

#[derive(Default)]
pub struct ExpertRunner {
    gx: Vec<f32>,
    g: Vec<f32>,
    h: Vec<f32>,
    st_in: Vec<Staging>,
    st_h: Vec<Staging>,
    /// Per job: (rows, gathered-x offset, h offset).
    offs: Vec<(usize, usize, usize)>,
    /// (job, o0, o1) over the intermediate (pass 1) and hidden (pass 2) outputs, and
    /// the running cost (weight bytes times rows) before each item.
    items1: Vec<(u32, u32, u32)>,
    items2: Vec<(u32, u32, u32)>,
    cost1: Vec<u64>,
    cost2: Vec<u64>,
}

/// Thread `id` of `n`'s items: those whose running cost starts in its equal share, so
/// each thread streams a contiguous run of weights (the prefetchers' best case) and the
/// shares balance by cost, not by count.
fn share(cost: &[u64], n: usize, id: usize) -> std::ops::Range<usize> {
    let total = *cost.last().unwrap_or(&0);
    let at = |t: usize| {
        cost[..cost.len() - 1].partition_point(|&c| (c as u128) * (n as u128) < (t as u128) * (total as u128))
    };
    at(id)..at(id + 1)
}

/// A pointer shared by the threads of a region, each touching disjoint elements.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}
impl<T> Shared<T> {
    /// (A method, so closures capture the wrapper, not the bare pointer.)
    #[inline(always)]
    fn ptr(&self) -> *mut T {
        self.0
    }
}

impl ExpertRunner {
    /// Runs `jobs` over `x` (`x_rows x hidden`); job j's output rows are written to
    /// `y[(out_row + i) * hidden ..]`. Panics on mismatched shapes.
    pub fn run(
        &mut self,
        pool: &ThreadPool,
        path: KernelPath,
        x: &[f32],
        x_rows: usize,
        jobs: &[ExpertJob],
        y: &mut [f32],
    ) {
        self.run_with(pool, path, x, x_rows, jobs.len(), &|j| jobs[j], y)
    }

    /// [`ExpertRunner::run`] with the jobs given by index (no slice of jobs to build).
    #[allow(clippy::too_many_arguments)]
    pub fn run_with<'a>(
        &mut self,
        pool: &ThreadPool,
        path: KernelPath,
        x: &[f32],
        x_rows: usize,
        n_jobs: usize,
        job_at: &(dyn Fn(usize) -> ExpertJob<'a> + Sync),
        y: &mut [f32],
    ) {
        self.run_act(pool, path, GateAct::Silu, x, x_rows, n_jobs, job_at, y)
    }

    /// [`ExpertRunner::run_with`] with the gate activation `act` (the activation is
    /// chosen once per item, outside the inner loops: SwiGLU's loop is unchanged).
    #[allow(clippy::too_many_arguments)]
    pub fn run_act<'a>(
        &mut self,
        pool: &ThreadPool,
        path: KernelPath,
        act: GateAct,
        x: &[f32],
        x_rows: usize,
        n_jobs: usize,
        job_at: &(dyn Fn(usize) -> ExpertJob<'a> + Sync),
        y: &mut [f32],
    ) {
        if n_jobs == 0 {
            return;
        }
        let hidden = job_at(0).gate.cols;
        assert_eq!(x.len(), x_rows * hidden, "experts: x has {} values, expected {x_rows} rows x {hidden}", x.len());
        self.offs.clear();
        self.items1.clear();
        self.items2.clear();
        self.cost1.clear();
        self.cost2.clear();
        self.cost1.push(0);
        self.cost2.push(0);
        let (mut gx_len, mut h_len) = (0usize, 0usize);
        let mut work = 0usize;
        let mut down_staged = false;
        let threads = pool.threads();
        for j in 0..n_jobs {
            let job = job_at(j);
            let (gate, up, down) = (&job.gate, &job.up, &job.down);
            for m in [gate, up, down] {
                m.validate();
            }
            let inter = gate.rows;
            assert!(
                gate.cols == hidden
                    && up.rows == inter
                    && up.cols == hidden
                    && down.rows == hidden
                    && down.cols == inter,
                "swiglu_expert: shapes gate {}x{}, up {}x{}, down {}x{}; expected gate = up = [inter, hidden], down = [hidden, inter] with hidden {hidden}",
                gate.rows,
                gate.cols,
                up.rows,
                up.cols,
                down.rows,
                down.cols
            );
            assert_eq!(gate.kind, up.kind, "swiglu_expert: gate and up must share an encoding");
            let rows = match job.rows {
                Some(r) => {
                    assert!(r.iter().all(|&i| (i as usize) < x_rows), "experts: a job row is beyond x's {x_rows} rows");
                    r.len()
                }
                None => x_rows,
            };
            assert!(
                (job.out_row + rows) * hidden <= y.len(),
                "experts: job {j} writes rows {}..{} of a y with {} rows",
                job.out_row,
                job.out_row + rows,
                y.len() / hidden.max(1)
            );
            self.offs.push((rows, gx_len, h_len));
            work += (gate.weight_bytes() + up.weight_bytes() + down.weight_bytes()) * rows.clamp(1, 8);
            if job.rows.is_some() {
                gx_len += rows * hidden;
            }
            h_len += rows * inter;
            down_staged |= matches!(down.kind, QuantKind::Int4Group { .. });
            if rows == 0 || inter == 0 || hidden == 0 {
                continue;
            }
            let bs = block_size(gate, rows, threads);
            let per_out = (2 * gate.weight_bytes() / inter.max(1) * rows) as u64;
            for b in 0..inter.div_ceil(bs) {
                let (o0, o1) = (b * bs, ((b + 1) * bs).min(inter));
                self.items1.push((j as u32, o0 as u32, o1 as u32));
                self.cost1.push(self.cost1.last().unwrap() + per_out * (o1 - o0) as u64);
            }
            let bs = block_size(down, rows, threads);
            let per_out = (down.weight_bytes() / hidden.max(1) * rows) as u64;
            for b in 0..hidden.div_ceil(bs) {
                let (o0, o1) = (b * bs, ((b + 1) * bs).min(hidden));
                self.items2.push((j as u32, o0 as u32, o1 as u32));
                self.cost2.push(self.cost2.last().unwrap() + per_out * (o1 - o0) as u64);
            }
        }
        grow(&mut self.gx, gx_len);
        grow(&mut self.g, h_len);
        grow(&mut self.h, h_len);
        while self.st_in.len() < n_jobs {
            self.st_in.push(Staging::default());
        }
        while self.st_h.len() < n_jobs {
            self.st_h.push(Staging::default());
        }

        let gx = Shared(self.gx.as_mut_ptr());
        let (gp, hp) = (Shared(self.g.as_mut_ptr()), Shared(self.h.as_mut_ptr()));
        let (st_in, st_h) = (Shared(self.st_in.as_mut_ptr()), Shared(self.st_h.as_mut_ptr()));
        let yp = Shared(y.as_mut_ptr());
        let y_len = y.len();
        let (offs, items1, items2) = (&self.offs, &self.items1, &self.items2);
        let (cost1, cost2) = (&self.cost1, &self.cost2);
        // Job j's input rows (gathered, or x itself).
        let input = |j: usize| -> &[f32] {
            let (rows, gx_off, _) = offs[j];
            match job_at(j).rows {
                // SAFETY: written in phase 0, read-only afterwards.
                Some(_) => unsafe { std::slice::from_raw_parts(gx.ptr().add(gx_off), rows * hidden) },
                None => x,
            }
        };
        pool.run_on(work.div_ceil(BYTES_PER_THREAD), &|c| {
            // Phase 0: gather rows and stage x for encodings that need it.
            for j in c.split(n_jobs) {
                let (rows, gx_off, _) = offs[j];
                if let Some(idx) = job_at(j).rows {
                    for (i, &r) in idx.iter().enumerate() {
                        let r = r as usize;
                        // SAFETY: job j's gathered rows are written by this thread only.
                        let dst = unsafe { std::slice::from_raw_parts_mut(gx.ptr().add(gx_off + i * hidden), hidden) };
                        dst.copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
                    }
                }
                let g = job_at(j).gate;
                // SAFETY: staging j is touched by this thread only in this phase.
                unsafe { (*st_in.ptr().add(j)).prepare(path, input(j), rows, g.kind, g.cols) };
            }
            c.barrier();
            // Pass 1: gate and up, h = act(g) * u.
            for i in share(cost1, c.n, c.id) {
                let (j, o0, o1) = items1[i];
                let (j, o0, o1) = (j as usize, o0 as usize, o1 as usize);
                let (rows, _, h_off) = offs[j];
                let job = job_at(j);
                let inter = job.gate.rows;
                // SAFETY: read-only after phase 0.
                let st = unsafe { &*st_in.ptr().add(j) };
                let xin = input(j);
                // SAFETY: this item owns outputs o0..o1 of job j's g and h rows; they are
                // written through raw pointers (other items write other columns).
                unsafe {
                    let (g_ptr, h_ptr) = (gp.ptr().add(h_off), hp.ptr().add(h_off));
                    let len = rows * inter;
                    Product::new(path, xin, rows, job.gate, st).run(o0, o1, &Out::raw(g_ptr, len, inter, false));
                    Product::new(path, xin, rows, job.up, st).run(o0, o1, &Out::raw(h_ptr, len, inter, false));
                    match job.bias {
                        None => {
                            for r in 0..rows {
                                for o in o0..o1 {
                                    let k = r * inter + o;
                                    *h_ptr.add(k) = act.apply(*g_ptr.add(k), *h_ptr.add(k));
                                }
                            }
                        }
                        Some(bias) => {
                            for r in 0..rows {
                                for o in o0..o1 {
                                    let k = r * inter + o;
                                    *h_ptr.add(k) = act.apply(*g_ptr.add(k) + bias.gate[o], *h_ptr.add(k) + bias.up[o]);
                                }
                            }
                        }
                    }
                }
            }
            c.barrier();
            if down_staged {
                for j in c.split(n_jobs) {
                    let (rows, _, h_off) = offs[j];
                    let d = job_at(j).down;
                    // SAFETY: h is complete (barrier); staging j is this thread's.
                    unsafe {
                        let h = std::slice::from_raw_parts(hp.ptr().add(h_off), rows * d.cols);
                        (*st_h.ptr().add(j)).prepare(path, h, rows, d.kind, d.cols);
                    }
                }
                c.barrier();
            }
            // Pass 2: down, into y.
            for i in share(cost2, c.n, c.id) {
                let (j, o0, o1) = items2[i];
                let (j, o0, o1) = (j as usize, o0 as usize, o1 as usize);
                let (rows, _, h_off) = offs[j];
                let job = job_at(j);
                // SAFETY: h and the staging are read-only now; this item owns outputs
                // o0..o1 of job j's y rows.
                unsafe {
                    let h = std::slice::from_raw_parts(hp.ptr().add(h_off), rows * job.down.cols);
                    let st = &*st_h.ptr().add(j);
                    let base = job.out_row * hidden;
                    let out = Out::raw(yp.ptr().add(base), y_len - base, hidden, false);
                    Product::new(path, h, rows, job.down, st).run(o0, o1, &out);
                    if let Some(bias) = job.bias {
                        for r in 0..rows {
                            for o in o0..o1 {
                                *yp.ptr().add(base + r * hidden + o) += bias.down[o];
                            }
                        }
                    }
                }
            }
        });
    }
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}
