//! The CUDA backend: weights in their stored precision in device memory, activations and
//! KV caches in device memory, every op a kernel (compiled by NVRTC at run time, see
//! `kernels/`) on one stream; f32 and bf16 products of many rows through cuBLAS. Launches
//! are held and sent in runs, a repeated run as one CUDA graph (`queue.rs`).
//!
//! Same semantics as the CPU backend (`cpu/`): the same layouts, the same routing and
//! selection rules and tie breaks, the same accumulation order where the CPU fixes one
//! (the MoE combination); products and reductions sum in another order and agree within
//! f32 rounding.
//!
//! Host <-> device traffic of a step: the step's rows (positions, block tables) and rotary
//! tables, the expert task lists (small, through a ring of pinned staging buffers, so the
//! copies are asynchronous), the routed expert ids the host needs (read back, by design),
//! and the logits asked for (read back through page-locked memory; hidden states only when
//! a draft model reads them). Ops that cannot return an error panic on a CUDA error (as the
//! CPU backend panics on a shape mismatch); making the backend fails with a one-line
//! error when there is no driver, no device or no NVRTC.

mod backend;
mod deltanet;
mod desc;
mod dispatch;
mod elementwise;
mod experts;
mod module;
mod ops;
mod queue;
mod step;
mod transfer;

use step::StepCache;

pub use desc::MatDesc;
use desc::{kind_code, ById, LinJob, LinJobs, TaskDesc, MAX_JOBS, VEC_WIDTH};

pub use dispatch::CudaExpertTable;
pub use queue::{launch_totals, set_dependent_launch_default, set_graphs_default, LaunchStats};
pub use transfer::{CopyFence, HostRegistration, IdxRead};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use strata_kernels::QuantKind;

/// Threads of a block that normalises a row of `width` (`rms_seg`, `k_add_rms_norm`): one
/// per float4, up to 1024.
fn row_threads(width: usize) -> u32 {
    width.div_ceil(4).next_multiple_of(32).clamp(32, 1024) as u32
}

/// Values in device memory.
pub struct DevBuf<T> {
    ptr: u64,
    len: usize,
    _mem: Option<Owned<T>>,
}

/// Device memory a buffer owns. Freeing is queued on the stream, so the launches held
/// for a graph (which may use it) are sent first.
struct Owned<T> {
    _mem: CudaSlice<T>,
    queue: Arc<queue::LaunchQueue>,
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        self.queue.flush();
    }
}

impl<T> DevBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
}

/// A matrix in its stored precision in device memory.
pub struct CudaMat {
    desc: MatDesc,
    kind: QuantKind,
    rows: usize,
    cols: usize,
    _payload: DevBuf<u8>,
    _scales: DevBuf<u8>,
}

impl CudaMat {
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Device bytes held: payload and scales.
    pub fn bytes_held(&self) -> u64 {
        (self._payload.len + self._scales.len) as u64
    }
}

/// One expert's matrices as the expert kernels read them.
#[derive(Clone, Copy)]
pub struct CudaExpert<'a> {
    pub gate: &'a CudaMat,
    pub up: &'a CudaMat,
    pub down: &'a CudaMat,
}

/// Pinned host memory cut into chunks, each reused only once the copy that last read it
/// has completed (an event per chunk): host -> device copies that do not wait for the
/// stream.
struct Ring {
    base: *mut u8,
    chunk: usize,
    events: Vec<CudaEvent>,
    next: usize,
}

// SAFETY: the pinned buffer is only touched under the backend's state lock.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        for e in &self.events {
            let _ = e.synchronize();
        }
        // SAFETY: allocated by cuMemHostAlloc; no copy reads it any more.
        unsafe {
            let _ = result::free_host(self.base as *mut c_void);
        }
    }
}

/// Scratch that grows to the largest call and is then reused.
#[derive(Default)]
struct Work {
    /// Grouped experts: intermediate rows; task table and row lists (bytes).
    h: Option<DevBuf<f32>>,
    table: Option<DevBuf<u8>>,
    /// Many-rows experts: gathered x, gate, up, h.
    gx: Option<DevBuf<f32>>,
    g: Option<DevBuf<f32>>,
    u: Option<DevBuf<f32>>,
    hb: Option<DevBuf<f32>>,
    /// bf16 thirds of x for cuBLAS.
    xhi: Option<DevBuf<u16>>,
    xmid: Option<DevBuf<u16>>,
    xlo: Option<DevBuf<u16>>,
    /// One-row projections: the call's jobs, and those that go out together.
    jobs: Vec<Lin>,
    small: Vec<(usize, LinJob)>,
    /// `k_route_one`'s count of finished blocks (zero between launches).
    route_done: Option<DevBuf<u32>>,
    /// The DeltaNet's convolved q|k|v rows.
    delta_mixed: Option<DevBuf<f32>>,
    /// Host staging.
    bytes: Vec<u8>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Page-locked host memory for reads back (`READBACK` bytes).
struct Pinned(*mut u8);

// SAFETY: only touched under the backend's state lock.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; reads complete before `download` returns.
        unsafe {
            let _ = result::free_host(self.0 as *mut c_void);
        }
    }
}

/// Reads back up to this many bytes go through page-locked memory (a decode step's logits).
const READBACK: usize = 4 << 20;

pub(crate) struct State {
    readback: Option<Pinned>,
    /// Reads back in flight (`start_read_idx`).
    reads: transfer::Reads,
    ring: Ring,
    step: StepCache,
    work: Work,
}

struct Funcs {
    linear: [CudaFunction; 4],
    /// One row against a large matrix, several outputs a warp.
    linear_quad: CudaFunction,
    /// Up to four small projections of one row in one launch.
    linears_1: CudaFunction,
    tiled: [CudaFunction; 5],
    /// The tensor-core tiles for bf16 (`k_tiled_mma`) and for quantized weights
    /// (`k_tiled_mma_q`: one block an SM, registers for their decode).
    tiled_mma: CudaFunction,
    tiled_mma_q: CudaFunction,
    /// A prompt's expert tasks (tiles, or one output a warp): tasks of bf16 or f32 experts,
    /// and (`_q`) tasks with a quantized matrix.
    experts_up: CudaFunction,
    experts_down: CudaFunction,
    experts_up_q: CudaFunction,
    experts_down_q: CudaFunction,
    /// One row a task (decode): several outputs a warp (`k_experts_*_row`).
    experts_up_row: CudaFunction,
    experts_down_row: CudaFunction,
    act_mul: CudaFunction,
    gather: CudaFunction,
    add_bias: CudaFunction,
    split_bf16: CudaFunction,
    embed: CudaFunction,
    argmax_rows: CudaFunction,
    pick_rows: CudaFunction,
    rms_norm: CudaFunction,
    add: CudaFunction,
    copy: CudaFunction,
    mla_prepare: CudaFunction,
    mla_absorb: CudaFunction,
    /// One row, 16-byte weight loads, by encoding (`k_mla_absorb_row_<kind>`).
    mla_absorb_row: [CudaFunction; 5],
    mla_attend: Vec<(usize, CudaFunction)>,
    mla_attend_tiles: CudaFunction,
    dsa_prepare: CudaFunction,
    dsa_scores: CudaFunction,
    dsa_topk: CudaFunction,
    gqa_prepare: CudaFunction,
    gqa_attend: Vec<(usize, CudaFunction)>,
    route: CudaFunction,
    route_one: CudaFunction,
    route_softmax: CudaFunction,
    combine: CudaFunction,
    scale: CudaFunction,
    fill: CudaFunction,
    soft_cap: CudaFunction,
    add_rms_norm: CudaFunction,
    gelu_mul: CudaFunction,
    /// Qwen3-Next: the DeltaNet's convolution and rule, and the gated attention output.
    delta_conv: CudaFunction,
    delta_rule: CudaFunction,
    sigmoid_mul: CudaFunction,
}

impl Funcs {
    fn load(m: &Arc<CudaModule>) -> Result<Self> {
        let f = |name: &str| m.load_function(name).map_err(|e| anyhow!("kernel {name}: {e}"));
        let js = |prefix: &str, list: &[usize]| -> Result<Vec<(usize, CudaFunction)>> {
            list.iter().map(|&j| Ok((j, f(&format!("{prefix}{j}"))?))).collect()
        };
        Ok(Self {
            linear: [f("k_linear_1")?, f("k_linear_2")?, f("k_linear_4")?, f("k_linear_8")?],
            linear_quad: f("k_linear_quad")?,
            linears_1: f("k_linears_1")?,
            tiled: [f("k_tiled_0")?, f("k_tiled_1")?, f("k_tiled_2")?, f("k_tiled_3")?, f("k_tiled_4")?],
            tiled_mma: f("k_tiled_mma")?,
            tiled_mma_q: f("k_tiled_mma_q")?,
            experts_up: f("k_experts_up")?,
            experts_down: f("k_experts_down")?,
            experts_up_q: f("k_experts_up_q")?,
            experts_down_q: f("k_experts_down_q")?,
            experts_up_row: f("k_experts_up_row")?,
            experts_down_row: f("k_experts_down_row")?,
            act_mul: f("k_act_mul")?,
            gather: f("k_gather")?,
            add_bias: f("k_add_bias")?,
            split_bf16: f("k_split_bf16")?,
            embed: f("k_embed")?,
            argmax_rows: f("k_argmax_rows")?,
            pick_rows: f("k_pick_rows")?,
            rms_norm: f("k_rms_norm")?,
            add: f("k_add")?,
            copy: f("k_copy")?,
            mla_prepare: f("k_mla_prepare")?,
            mla_absorb: f("k_mla_absorb")?,
            mla_absorb_row: [
                f("k_mla_absorb_row_0")?,
                f("k_mla_absorb_row_1")?,
                f("k_mla_absorb_row_2")?,
                f("k_mla_absorb_row_3")?,
                f("k_mla_absorb_row_4")?,
            ],
            mla_attend: js("k_mla_attend_", &[1, 2, 4, 8, 12, 18, 24, 32])?,
            mla_attend_tiles: f("k_mla_attend_tiles")?,
            dsa_prepare: f("k_dsa_prepare")?,
            dsa_scores: f("k_dsa_scores")?,
            dsa_topk: f("k_dsa_topk")?,
            gqa_prepare: f("k_gqa_prepare")?,
            gqa_attend: js("k_gqa_attend_", &[1, 2, 4, 8, 16])?,
            route: f("k_route")?,
            route_one: f("k_route_one")?,
            route_softmax: f("k_route_softmax")?,
            combine: f("k_combine")?,
            scale: f("k_scale")?,
            fill: f("k_fill")?,
            soft_cap: f("k_soft_cap")?,
            add_rms_norm: f("k_add_rms_norm")?,
            gelu_mul: f("k_gelu_mul")?,
            delta_conv: f("k_delta_conv")?,
            delta_rule: f("k_delta_rule")?,
            sigmoid_mul: f("k_sigmoid_mul")?,
        })
    }
}

/// Products of more rows than this use the tiled kernel or cuBLAS.
const SMALL_ROWS: usize = 8;
/// An expert with at least this many rows runs on its own through the many-rows products.
const EXPERT_BIG_ROWS: usize = 32;
/// Pinned staging: chunks x bytes.
const RING_CHUNKS: usize = 32;
const RING_CHUNK: usize = 256 << 10;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Device -> host copies of expert slots (transfer.rs), beside the compute stream:
    /// made on the first such copy.
    download: std::sync::OnceLock<Arc<CudaStream>>,
    f: Funcs,
    _module: Arc<CudaModule>,
    blas: Option<cudarc::cublas::CudaBlas>,
    name: String,
    sms: usize,
    /// Tensor-core mma (sm_80 on): the expert tiles.
    mma: bool,
    /// Dynamic shared memory `k_mla_attend_tiles` may take (bytes; opted in at load).
    attend_smem: usize,
    state: Mutex<State>,
    queue: Arc<queue::LaunchQueue>,
}

/// The kernel arguments: each value's address and size, in order.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$($crate::cuda::queue::Arg::of(&$a)),*]
    };
}
pub(crate) use args;

/// Debugging (tests): wait for every kernel and panic when one runs longer than this.
static WATCHDOG: Mutex<Option<std::time::Duration>> = Mutex::new(None);

/// Makes backends created from now on wait for each kernel as it is launched and panic,
/// naming it, when one runs longer than `limit` (None: off, the default). A test harness's
/// way to say where a run stalled; it costs the overlap of every launch.
pub fn set_watchdog(limit: Option<std::time::Duration>) {
    *WATCHDOG.lock().unwrap_or_else(|e| e.into_inner()) = limit;
}

fn watchdog() -> Option<std::time::Duration> {
    *WATCHDOG.lock().unwrap_or_else(|e| e.into_inner())
}

static LAST_KERNEL: Mutex<String> = Mutex::new(String::new());

/// Under [`set_watchdog`]: the last kernel launched (and finished, unless the
/// watchdog is about to fire), for a test that reports where a run stalled.
pub fn last_kernel() -> String {
    LAST_KERNEL.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Whether a CUDA device can be used here: `Ok(count)` or why not (one line).
pub fn device_count() -> Result<usize> {
    // SAFETY: only probes for the library.
    if !unsafe { sys::is_culib_present() } {
        bail!("no CUDA driver on this machine (libcuda.so.1 not found)");
    }
    let n = CudaContext::device_count().map_err(|e| anyhow!("the CUDA driver found no usable GPU ({e})"))?;
    Ok(n as usize)
}

impl CudaBackend {
    /// The backend on device `ordinal`: its context and stream, the kernels (compiled by
    /// NVRTC or from the PTX cache), cuBLAS where its library is present.
    pub fn new(ordinal: usize) -> Result<Self> {
        let n = device_count()?;
        if ordinal >= n {
            bail!("cuda:{ordinal}: this machine has {n} CUDA device{}", if n == 1 { "" } else { "s" });
        }
        // SAFETY: only probes for the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            bail!(
                "cuda:{ordinal}: NVRTC (libnvrtc.so) not found: strata compiles its kernels at run time; put the CUDA toolkit's lib64 on LD_LIBRARY_PATH"
            );
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow!("cuda:{ordinal}: cannot create a context: {e}"))?;
        // One stream, ordered: no per-buffer events.
        // SAFETY: every buffer is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| anyhow!("cuda:{ordinal}: {e}"))?;
        let cc = ctx.compute_capability().map_err(|e| anyhow!("cuda:{ordinal}: {e}"))?;
        let module = module::load(&ctx, cc)?;
        let f = Funcs::load(&module)?;
        // SAFETY: only probes for the library.
        let blas = match unsafe { cudarc::cublas::sys::is_culib_present() } {
            true => Some(cudarc::cublas::CudaBlas::new(stream.clone()).map_err(|e| anyhow!("cuBLAS: {e:?}"))?),
            false => None,
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow!("{e}"))? as usize;
        let mem = ctx.total_mem().map_err(|e| anyhow!("{e}"))?;
        // Beyond 48 KB a kernel's dynamic shared memory must be opted into; the tiled
        // attention's static part (a tile's slots) stays under 1 KB.
        let optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| anyhow!("{e}"))? as usize;
        let attend_smem = optin.saturating_sub(1024);
        f.mla_attend_tiles
            .set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                attend_smem as i32,
            )
            .map_err(|e| anyhow!("cuda:{ordinal}: k_mla_attend_tiles shared memory: {e}"))?;
        let dev_name = ctx.name().unwrap_or_else(|_| "GPU".into());
        let name = format!(
            "cuda:{ordinal} ({dev_name}, {sms} SMs, sm_{}{}, {:.0} GiB{})",
            cc.0,
            cc.1,
            mem as f64 / (1u64 << 30) as f64,
            if blas.is_some() { ", cuBLAS" } else { "" }
        );
        // SAFETY: plain allocation; freed by the ring.
        let base = unsafe { result::malloc_host(RING_CHUNKS * RING_CHUNK, 0) }
            .map_err(|e| anyhow!("cuda:{ordinal}: pinned staging: {e}"))? as *mut u8;
        let events = (0..RING_CHUNKS)
            .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow!("{e}"))?;
        let ring = Ring { base, chunk: RING_CHUNK, events, next: 0 };
        // The watchdog waits for each kernel as it is launched: no holding.
        let pdl = queue::dependent_launch_default() && cc.0 >= 9;
        let queue =
            Arc::new(queue::LaunchQueue::new(stream.clone(), queue::graphs_default() && watchdog().is_none(), pdl));
        Ok(Self {
            ctx,
            stream,
            download: std::sync::OnceLock::new(),
            f,
            _module: module,
            blas,
            name,
            sms,
            mma: cc.0 >= 8,
            attend_smem,
            state: Mutex::new(State {
                readback: None,
                reads: Default::default(),
                ring,
                step: StepCache::default(),
                work: Work::default(),
            }),
            queue,
        })
    }

    /// How this backend's kernels went to the device so far.
    pub fn launch_stats(&self) -> LaunchStats {
        self.queue.stats()
    }

    /// Replays repeated runs of launches as CUDA graphs (`on`, the default unless
    /// `--cuda-graphs off`) or launches every kernel at once (`off`). Results are the same.
    pub fn set_graphs(&self, on: bool) {
        let _g = self.lock();
        self.queue.set_on(on && watchdog().is_none());
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.ctx.bind_to_thread().unwrap_or_else(|e| panic!("CUDA: cannot bind the context: {e}"));
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stream, for anything other than a kernel launch: the launches held so far are
    /// sent first, so whatever comes next is ordered after them.
    fn stream(&self) -> &Arc<CudaStream> {
        self.queue.flush();
        &self.stream
    }

    fn cu_stream(&self) -> sys::CUstream {
        self.stream().cu_stream()
    }

    /// Launches `f` on the stream (held for a graph, see `queue.rs`); panics on an error.
    /// The arguments must match the kernel's parameters in type (each call site passes
    /// the types the kernel declares).
    fn launch(&self, f: &CudaFunction, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut [queue::Arg]) {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        self.queue.launch(f.cu_function(), grid, block, smem, args);
        if let Some(limit) = watchdog() {
            self.watch(f, grid, block, limit);
        }
    }

    /// Debugging ([`set_watchdog`]): waits for the kernel just launched and
    /// panics, naming it, when it fails or runs past `limit`.
    fn watch(&self, f: &CudaFunction, grid: (u32, u32, u32), block: u32, limit: std::time::Duration) {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: a loaded function; the name is a static string of the module.
        let name = match unsafe { sys::cuFuncGetName(&mut name, f.cu_function()) } {
            sys::CUresult::CUDA_SUCCESS if !name.is_null() => {
                unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
            }
            _ => "?".into(),
        };
        let what = format!("{name} (grid {grid:?}, block {block})");
        *LAST_KERNEL.lock().unwrap_or_else(|e| e.into_inner()) = what.clone();
        let t0 = std::time::Instant::now();
        loop {
            // SAFETY: a live stream.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => return,
                sys::CUresult::CUDA_ERROR_NOT_READY if t0.elapsed() < limit => {
                    std::thread::sleep(std::time::Duration::from_micros(50))
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => {
                    panic!("CUDA watchdog: kernel {what} still running after {:.1} s", limit.as_secs_f64())
                }
                e => panic!("CUDA: kernel {what} failed: {e:?}"),
            }
        }
    }

    /// Waits for the stream (and surfaces an asynchronous error).
    pub fn synchronize(&self) {
        self.stream().synchronize().unwrap_or_else(|e| panic!("CUDA: {e}"));
    }

    fn alloc_t<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DevBuf<T>> {
        if len == 0 {
            return Ok(DevBuf { ptr: 0, len: 0, _mem: None });
        }
        let mem = self
            .stream()
            .alloc_zeros::<T>(len)
            .map_err(|e| anyhow!("cannot allocate {} bytes of device memory: {e}", len * std::mem::size_of::<T>()))?;
        let ptr = {
            let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&mem, &self.stream);
            ptr
        };
        Ok(DevBuf { ptr, len, _mem: Some(Owned { _mem: mem, queue: self.queue.clone() }) })
    }

    /// `buf` with room for at least `len` values (reallocated, contents lost, if smaller).
    fn ensure<'b, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &'b mut Option<DevBuf<T>>,
        len: usize,
    ) -> &'b DevBuf<T> {
        if buf.as_ref().is_none_or(|b| b.len < len) {
            let grown = len.max(buf.as_ref().map_or(0, |b| b.len * 2)).max(1);
            *buf = Some(self.alloc_t(grown).unwrap_or_else(|e| panic!("CUDA: {e}")));
        }
        buf.as_ref().unwrap()
    }

    /// Host bytes to device address `dst`, through the pinned ring (asynchronous).
    fn upload_bytes(&self, ring: &mut Ring, dst: u64, bytes: &[u8]) {
        for (i, piece) in bytes.chunks(ring.chunk).enumerate() {
            let c = ring.next;
            ring.next = (c + 1) % ring.events.len();
            ring.events[c].synchronize().unwrap_or_else(|e| panic!("CUDA: {e}"));
            // SAFETY: chunk c is not read by any pending copy (its event completed) and
            // holds `ring.chunk` bytes.
            let staged = unsafe {
                let p = ring.base.add(c * ring.chunk);
                std::ptr::copy_nonoverlapping(piece.as_ptr(), p, piece.len());
                std::slice::from_raw_parts(p, piece.len())
            };
            // SAFETY: `dst` is device memory of at least `bytes.len()` bytes (callers check).
            unsafe { result::memcpy_htod_async(dst + (i * ring.chunk) as u64, staged, self.cu_stream()) }
                .unwrap_or_else(|e| panic!("CUDA: host to device copy: {e}"));
            ring.events[c].record(self.stream()).unwrap_or_else(|e| panic!("CUDA: {e}"));
        }
    }

    fn upload_t<T: Copy>(&self, ring: &mut Ring, dst: u64, src: &[T]) {
        // SAFETY: plain values viewed as bytes.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src)) };
        self.upload_bytes(ring, dst, bytes);
    }

    /// Device values to `dst`: through page-locked memory up to READBACK bytes (a copy
    /// into pageable memory is staged by the driver and slower), directly above that.
    fn download<T: Copy>(&self, st: &mut State, src: u64, dst: &mut [T]) {
        let bytes = std::mem::size_of_val(dst);
        if bytes == 0 {
            return;
        }
        let pinned = (bytes <= READBACK).then(|| {
            st.readback.get_or_insert_with(|| {
                // SAFETY: plain allocation; freed by `Pinned`.
                let p = unsafe { result::malloc_host(READBACK, 0) }
                    .unwrap_or_else(|e| panic!("CUDA: pinned readback: {e}"));
                Pinned(p as *mut u8)
            })
        });
        // SAFETY: the landing bytes are `dst`'s own or the first `bytes` of the pinned
        // buffer (READBACK >= bytes); `src` holds them on the device; the copy has completed
        // (synchronize) before they are read.
        unsafe {
            let landing = match &pinned {
                Some(p) => std::slice::from_raw_parts_mut(p.0, bytes),
                None => std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, bytes),
            };
            result::memcpy_dtoh_async(landing, src, self.cu_stream())
                .unwrap_or_else(|e| panic!("CUDA: device to host copy: {e}"));
            self.synchronize();
            if let Some(p) = pinned {
                std::ptr::copy_nonoverlapping(p.0, dst.as_mut_ptr() as *mut u8, bytes);
            }
        }
    }

    /// Syncs the stream at the end of a profiled op, so its timer holds device time.
    fn profiled(&self) {
        if crate::profile::enabled() {
            self.synchronize();
        }
    }
}

/// Argument block of a projection (see `linear_small` / `linear_tiled` in `kernels/products.cu`).
#[derive(Clone, Copy)]
pub(crate) struct Lin {
    pub m: MatDesc,
    pub kind: QuantKind,
    pub mrow0: usize,
    pub mrow_bs: usize,
    pub x: u64,
    pub x_bs: usize,
    pub xld: usize,
    pub xrows: u64,
    pub rows: usize,
    pub nout: usize,
    pub out: u64,
    pub ostride: usize,
    pub col: usize,
    pub col_bs: usize,
    pub add: bool,
    pub bias: u64,
    pub batches: usize,
}

impl Lin {
    /// `out[r, ..] = x[r, ..] m^T` for `rows` rows of `x` (row stride `xld`), whole and
    /// unbatched; `out` rows of `m.rows` values.
    pub fn plain(m: &CudaMat, x: u64, xld: usize, rows: usize, out: u64) -> Self {
        Lin {
            m: m.desc,
            kind: m.kind,
            mrow0: 0,
            mrow_bs: 0,
            x,
            x_bs: 0,
            xld,
            xrows: 0,
            rows,
            nout: m.rows,
            out,
            ostride: m.rows,
            col: 0,
            col_bs: 0,
            add: false,
            bias: 0,
            batches: 1,
        }
    }

    /// One row of x, whole, against a matrix the one-row kernels (`k_linear_quad`,
    /// `k_linears_1`) can read: not int4 with e4m3 scales
    /// (`MatDesc::e4m3_scales`), which they do not decode; `k_linear_R` takes those.
    pub fn one_row(&self) -> bool {
        self.rows == 1 && self.xrows == 0 && !self.m.e4m3_scales()
    }

    /// [`Self::one_row`], unbatched, against a matrix read in 16-byte vectors: what the
    /// grouped and norm-fused one-row products take.
    pub fn one_vector_row(&self) -> bool {
        self.one_row() && self.batches == 1 && self.m.vec != 0
    }
}
