//! Kernel launches held on the host until something else touches the stream (a copy, a
//! read, an event, cuBLAS, a free, a wait), then sent together: as one CUDA graph when
//! the same run of launches (the same kernels, grids and argument bytes) was sent before,
//! else one by one.
//!
//! Why: a decode step is about a hundred small kernels, and launching each costs host
//! time and leaves a gap on the device. The kernels read everything that changes from one
//! token to the next (positions, block tables, routed ids, lengths) from device memory,
//! so from the second token on, a step's run is the same bytes and replays as one graph.
//! A graph runs exactly the launches the step asked for, in order: results are the same
//! bit for bit, whether or not a run became a graph (`--cuda-graphs off` sends every
//! kernel on its own, at once).
//!
//! On sm_90 and later each kernel may also start launching before the one before it has
//! finished (programmatic dependent launch: a programmatic edge in a graph, the stream
//! attribute otherwise). Every kernel first waits for its predecessors to finish and
//! their writes to show (`pdl_enter` in `kernels/common.cu`), so only the launch overlaps:
//! the gap between two dependent kernels shrinks, and results stay the same bit for bit.

use crate::graph_cache::{GraphCache, Plan};
use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaStream};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Graphs kept. A resident decode step is one run; where routed ids come to the host
/// (streamed experts, batches) each MoE layer ends a run, so a step of a deep model is a
/// few hundred runs, and a cache smaller than that would miss every time.
const GRAPHS: usize = 1024;
/// Runs remembered as candidates (by hash): a run becomes a graph the second time it is
/// seen.
const SEEN: usize = 4096;
/// Shorter runs are launched one by one (a graph would save little).
const MIN_GRAPH_KERNELS: usize = 4;
/// A run is sent once it holds this many launches, the next at twice as many, and so on
/// (back to this after anything else touches the stream), if the device is idle at the
/// first cut: it starts on a step's first kernels while the host is still preparing the
/// rest. If the device is still busy with earlier work then (greedy decode queues a step
/// before it reads the last one's pick), the run goes on instead: a step is one graph, every kernel in it
/// chained by dependent launch, where graph boundaries cost the device a gap each (H200,
/// 2026-12-03: the GLM-5 slice decoded 1528 tok/s as one graph a step, 1510 in three).
/// Either way the cut points repeat from step to step, so the pieces replay as graphs.
const FIRST_RUN: usize = 4;
/// The most parameters a kernel takes.
const MAX_PARAMS: usize = 24;

static GRAPHS_DEFAULT: AtomicBool = AtomicBool::new(true);
/// Programmatic dependent launch for backends made from now on (where the device has it):
/// on unless a test turns it off.
static PDL_DEFAULT: AtomicBool = AtomicBool::new(true);

fn pdl_flag() -> &'static AtomicBool {
    &PDL_DEFAULT
}

/// Whether CUDA backends made from now on let each kernel start launching before the one
/// before it has finished (on sm_90 and later; on by default). Results are the same.
pub fn set_dependent_launch_default(on: bool) {
    pdl_flag().store(on, Ordering::Relaxed);
}

pub(crate) fn dependent_launch_default() -> bool {
    pdl_flag().load(Ordering::Relaxed)
}

/// Every backend's counts together (`launch_totals`): the bench's per-token figures.
static TOTALS: Mutex<LaunchStats> = Mutex::new(LaunchStats { kernels: 0, graphs: 0, graph_kernels: 0, built: 0 });

/// How the kernels of every CUDA backend in this process went to the device so far.
pub fn launch_totals() -> LaunchStats {
    *TOTALS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether CUDA backends made from now on replay repeated runs of launches as graphs
/// (`--cuda-graphs`; on by default).
pub fn set_graphs_default(on: bool) {
    GRAPHS_DEFAULT.store(on, Ordering::Relaxed);
}

pub(crate) fn graphs_default() -> bool {
    GRAPHS_DEFAULT.load(Ordering::Relaxed)
}

/// One kernel argument: where its value is and its size (see `args!`).
#[derive(Clone, Copy)]
pub struct Arg(pub *const u8, pub usize);

impl Arg {
    pub fn of<T>(v: &T) -> Self {
        Arg(v as *const T as *const u8, std::mem::size_of::<T>())
    }
}

/// How a backend's kernels went to the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// Kernels launched one at a time.
    pub kernels: u64,
    /// Graph launches and the kernels they ran.
    pub graphs: u64,
    pub graph_kernels: u64,
    /// Graphs built (instantiated).
    pub built: u64,
}

struct Node {
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    /// Its parameters' first words in `Run::words`: `Run::params[first..first + count]`.
    first: usize,
    count: usize,
}

/// The launches held since the last flush.
#[derive(Default)]
struct Run {
    /// Every launch's function, grid, block, shared memory, parameter sizes and argument
    /// bytes as words: two runs with equal words are the same launches.
    words: Vec<u64>,
    nodes: Vec<Node>,
    /// Per parameter, the index of its first word in `words`.
    params: Vec<usize>,
}

impl Run {
    fn clear(&mut self) {
        self.words.clear();
        self.nodes.clear();
        self.params.clear();
    }

    /// The parameter pointers of node `n` (into `words`, which must not change while
    /// they are used).
    fn pointers(&self, n: &Node, out: &mut [*mut c_void; MAX_PARAMS]) {
        for (j, &w) in self.params[n.first..n.first + n.count].iter().enumerate() {
            out[j] = self.words[w..].as_ptr() as *mut c_void;
        }
    }
}

struct Inner {
    on: bool,
    /// Programmatic dependent launch (see the module's comment).
    pdl: bool,
    run: Run,
    /// Launches at which the run is sent (see first_run).
    limit: usize,
    /// The device was busy at the first cut: the run goes on until something else
    /// touches the stream.
    hold: bool,
    /// Recorded after each sent run, for the first cut's question: is the device still on
    /// earlier kernels? (Asked of the stream, a step's own small upload, maybe still in
    /// flight, answered it, so a step's pieces varied from step to step.)
    sent: Option<sys::CUevent>,
    graphs: GraphCache<sys::CUgraphExec>,
    stats: LaunchStats,
}

impl Inner {
    /// Counts `kernels` sent one by one, or one graph launch of `kernels` (`built`: new).
    fn count(&mut self, kernels: usize, graph: bool, built: bool) {
        let add = |s: &mut LaunchStats| {
            match graph {
                true => {
                    s.graphs += 1;
                    s.graph_kernels += kernels as u64;
                }
                false => s.kernels += kernels as u64,
            }
            s.built += u64::from(built);
        };
        add(&mut self.stats);
        add(&mut TOTALS.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

// SAFETY: the graph handles are only used under the queue's lock, with the context bound.
unsafe impl Send for Inner {}

/// A stream's held launches and its graphs (shared with the buffers that free memory on
/// the stream, which must flush first).
pub(crate) struct LaunchQueue {
    stream: Arc<CudaStream>,
    inner: Mutex<Inner>,
}

impl LaunchQueue {
    pub fn new(stream: Arc<CudaStream>, on: bool, pdl: bool) -> Self {
        let inner = Inner {
            on,
            pdl,
            run: Run::default(),
            limit: FIRST_RUN,
            hold: false,
            sent: None,
            graphs: GraphCache::new(GRAPHS, SEEN, MIN_GRAPH_KERNELS),
            stats: LaunchStats::default(),
        };
        Self { stream, inner: Mutex::new(inner) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> LaunchStats {
        self.lock().stats
    }

    /// Turns holding launches (and graphs) on or off; what is held is sent first.
    pub fn set_on(&self, on: bool) {
        self.flush();
        self.lock().on = on;
    }

    /// Queues a launch (or, when off, launches it now).
    pub fn launch(&self, func: sys::CUfunction, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) {
        assert!(args.len() <= MAX_PARAMS, "a kernel with {} parameters (at most {MAX_PARAMS})", args.len());
        let mut g = self.lock();
        if !g.on {
            let mut ptrs = [std::ptr::null_mut(); MAX_PARAMS];
            for (p, a) in ptrs.iter_mut().zip(args) {
                *p = a.0 as *mut c_void;
            }
            g.count(1, false, false);
            let pdl = g.pdl;
            drop(g);
            self.launch_now(func, grid, block, smem, &mut ptrs, pdl);
            return;
        }
        let run = &mut g.run;
        let first = run.params.len();
        run.words.extend([
            func as u64,
            grid.0 as u64 | (grid.1 as u64) << 32,
            grid.2 as u64 | (block as u64) << 32,
            smem as u64 | (args.len() as u64) << 32,
        ]);
        for a in args {
            run.words.push(a.1 as u64);
            run.params.push(run.words.len());
            // SAFETY: `a.0` points at a live value of `a.1` bytes (the `args!` macro).
            let bytes = unsafe { std::slice::from_raw_parts(a.0, a.1) };
            for chunk in bytes.chunks(8) {
                let mut w = [0u8; 8];
                w[..chunk.len()].copy_from_slice(chunk);
                run.words.push(u64::from_le_bytes(w));
            }
        }
        run.nodes.push(Node { func, grid, block, smem, first, count: args.len() });
        if run.nodes.len() >= g.limit && !g.hold {
            // Decided at a run's first cut only, so a step's pieces do not depend on how
            // far the device got meanwhile.
            if g.limit == FIRST_RUN && Self::busy(&g) {
                g.hold = true;
                return;
            }
            self.send(&mut g);
            g.limit *= 2;
        }
    }

    /// Whether the device has not finished the last run sent (the context is bound: the
    /// caller holds the lock and has just queued a launch).
    fn busy(inner: &Inner) -> bool {
        // SAFETY: an event of this context, recorded on its stream.
        inner.sent.is_some_and(|ev| unsafe { sys::cuEventQuery(ev) } == sys::CUresult::CUDA_ERROR_NOT_READY)
    }

    /// Records `inner.sent` after what was just sent (made on first use).
    fn mark_sent(&self, inner: &mut Inner) {
        let ev = match inner.sent {
            Some(ev) => ev,
            None => {
                let mut ev: sys::CUevent = std::ptr::null_mut();
                // SAFETY: a plain driver call; the context is bound (send).
                let r = unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) };
                assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "CUDA: cuEventCreate");
                inner.sent = Some(ev);
                ev
            }
        };
        // SAFETY: a live event and stream of this context.
        let r = unsafe { sys::cuEventRecord(ev, self.stream.cu_stream()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "CUDA: cuEventRecord");
    }

    fn launch_now(
        &self,
        func: sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        ptrs: &mut [*mut c_void; MAX_PARAMS],
        pdl: bool,
    ) {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: a plain C union of integers; zero is a valid value of each member.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: the pointers point at the kernel's arguments, in order (the `args!`
        // macro, or a run's words), alive for the call; the config and its attribute
        // outlive it.
        let r = unsafe { sys::cuLaunchKernelEx(&config, func, ptrs.as_mut_ptr(), std::ptr::null_mut()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            panic!("CUDA: kernel launch failed: {r:?}");
        }
    }

    /// Sends what is held: a graph's replay when this run was sent as a graph before, a
    /// new graph when it was seen once before, else each launch.
    pub fn flush(&self) {
        let mut g = self.lock();
        g.limit = FIRST_RUN;
        g.hold = false;
        self.send(&mut g);
    }

    fn send(&self, inner: &mut Inner) {
        if inner.run.nodes.is_empty() {
            return;
        }
        self.stream.context().bind_to_thread().unwrap_or_else(|e| panic!("CUDA: cannot bind the context: {e}"));
        let n = inner.run.nodes.len();
        match inner.graphs.plan(&inner.run.words, n) {
            Plan::Replay(exec, kernels) => {
                self.launch_graph(exec);
                inner.count(kernels, true, false);
            }
            Plan::Build => match self.build(&inner.run, inner.pdl) {
                Ok(exec) => {
                    self.launch_graph(exec);
                    inner.count(n, true, true);
                    if let Some(old) = inner.graphs.insert(std::mem::take(&mut inner.run.words), exec, n) {
                        // SAFETY: a launched graph may be destroyed; the driver finishes
                        // its launches first.
                        unsafe { sys::cuGraphExecDestroy(old) };
                    }
                }
                Err(e) => {
                    // A driver that cannot build graphs: send this run and every later one
                    // kernel by kernel.
                    eprintln!("strata: CUDA graphs off ({e:#}); kernels are launched one by one");
                    self.launch_each(&inner.run, inner.pdl);
                    inner.count(n, false, false);
                    inner.on = false;
                }
            },
            Plan::Each => {
                self.launch_each(&inner.run, inner.pdl);
                inner.count(n, false, false);
            }
        }
        inner.run.clear();
        self.mark_sent(inner);
    }

    fn launch_each(&self, run: &Run, pdl: bool) {
        let mut ptrs = [std::ptr::null_mut(); MAX_PARAMS];
        for node in &run.nodes {
            run.pointers(node, &mut ptrs);
            self.launch_now(node.func, node.grid, node.block, node.smem, &mut ptrs, pdl);
        }
    }

    fn launch_graph(&self, exec: sys::CUgraphExec) {
        // SAFETY: an instantiated graph of this context.
        let r = unsafe { sys::cuGraphLaunch(exec, self.stream.cu_stream()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            panic!("CUDA: graph launch failed: {r:?}");
        }
    }

    /// The run as a graph: its kernels in a chain, in order (programmatic edges when
    /// `pdl`).
    fn build(&self, run: &Run, pdl: bool) -> Result<sys::CUgraphExec> {
        let check = |r: sys::CUresult, what: &str| match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(anyhow!("{what}: {e:?}")),
        };
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: plain driver calls on handles made here; each node's parameters are
        // copied into the graph when it is added.
        unsafe {
            check(sys::cuGraphCreate(&mut graph, 0), "cuGraphCreate")?;
            let built = (|| {
                let mut prev: Option<sys::CUgraphNode> = None;
                let mut ptrs = [std::ptr::null_mut(); MAX_PARAMS];
                for node in &run.nodes {
                    run.pointers(node, &mut ptrs);
                    let p = sys::CUDA_KERNEL_NODE_PARAMS {
                        func: node.func,
                        gridDimX: node.grid.0,
                        gridDimY: node.grid.1,
                        gridDimZ: node.grid.2,
                        blockDimX: node.block,
                        blockDimY: 1,
                        blockDimZ: 1,
                        sharedMemBytes: node.smem,
                        kernelParams: ptrs.as_mut_ptr(),
                        extra: std::ptr::null_mut(),
                        kern: std::ptr::null_mut(),
                        ctx: std::ptr::null_mut(),
                    };
                    let mut added: sys::CUgraphNode = std::ptr::null_mut();
                    check(
                        sys::cuGraphAddKernelNode_v2(&mut added, graph, std::ptr::null(), 0, &p),
                        "cuGraphAddKernelNode",
                    )?;
                    if let Some(prev) = prev {
                        // A programmatic edge lets this kernel launch while the one before
                        // runs (it waits in `pdl_enter`); a plain edge waits for the end.
                        let edge = sys::CUgraphEdgeData {
                            from_port: match pdl {
                                true => sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                                false => 0,
                            },
                            to_port: 0,
                            type_: match pdl {
                                true => sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
                                false => 0,
                            },
                            reserved: [0; 5],
                        };
                        check(
                            sys::cuGraphAddDependencies_v2(graph, &prev, &added, &edge, 1),
                            "cuGraphAddDependencies",
                        )?;
                    }
                    prev = Some(added);
                }
                let mut exec: sys::CUgraphExec = std::ptr::null_mut();
                check(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiate")?;
                Ok(exec)
            })();
            sys::cuGraphDestroy(graph);
            built
        }
    }
}

impl Drop for LaunchQueue {
    fn drop(&mut self) {
        self.flush();
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        let mut g = self.lock();
        for exec in g.graphs.drain() {
            // SAFETY: the stream is idle; nothing uses the graph any more.
            unsafe { sys::cuGraphExecDestroy(exec) };
        }
        if let Some(ev) = g.sent.take() {
            // SAFETY: the stream is idle; the event is no longer recorded or queried.
            unsafe { sys::cuEventDestroy_v2(ev) };
        }
    }
}
