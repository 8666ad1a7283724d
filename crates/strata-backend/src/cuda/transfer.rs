//! What a device tier of expert slots needs from the backend: device bytes, matrix views
//! onto them, host-to-device copies on the compute stream (so a kernel queued after a
//! copy sees its bytes, and a copy queued after a kernel waits for it: a slot can be
//! refilled as soon as its last use is queued), a fence that says when the copies queued
//! so far have read their host bytes, device-to-host copies of slots on a stream of their
//! own (the link carries both directions at once), page-locked host memory, and the
//! device's memory in use. Also reads back that do not wait (a decode step's greedy picks).

use super::{CudaBackend, CudaMat, DevBuf, MatDesc, Pinned, State};
use anyhow::{anyhow, Result};
use cudarc::driver::{result, sys, CudaEvent};
use std::ffi::c_void;
use strata_kernels::QuantKind;

/// Reads back in flight: page-locked slots taken in turn, each with the event that says
/// its copy is done and the ticket of the read it holds.
#[derive(Default)]
pub(super) struct Reads {
    slots: Vec<ReadSlot>,
    next: u64,
}

struct ReadSlot {
    host: Pinned,
    event: CudaEvent,
    ticket: u64,
}

/// Reads in flight at once; a read finished after READ_SLOTS later ones started has lost
/// its slot (and panics rather than return another read's values).
const READ_SLOTS: usize = 4;
/// Bytes a slot holds; a longer read is done at once.
const READ_SLOT_BYTES: usize = 16 << 10;

/// A read back started by `start_read_idx`.
pub struct IdxRead(ReadState);

enum ReadState {
    Done(Vec<u32>),
    InFlight { slot: usize, ticket: u64, len: usize },
}

/// Completion of the work queued on the stream before it (see [`CudaBackend::fence`]).
pub struct CopyFence(CudaEvent);

impl CopyFence {
    /// Waits until the stream has passed the fence.
    pub fn wait(&self) -> Result<()> {
        self.0.synchronize().map_err(|e| anyhow!("CUDA: {e}"))
    }
}

/// Host memory page-locked for the copy engine; unlocked on drop.
pub struct HostRegistration {
    ptr: *mut u8,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

// SAFETY: only the address is held; unregistering may happen from any thread (the
// context is bound first).
unsafe impl Send for HostRegistration {}
unsafe impl Sync for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered by `register_host` and not yet unregistered.
        unsafe {
            let _ = sys::cuMemHostUnregister(self.ptr as *mut c_void);
        }
    }
}

impl CudaBackend {
    /// `len` bytes of device memory (zeroed).
    pub fn alloc_bytes(&self, len: usize) -> Result<DevBuf<u8>> {
        let _g = self.lock();
        self.alloc_t::<u8>(len)
    }

    /// A matrix whose payload (at device address `payload`) and f32 scales (at `scales`)
    /// live in memory the caller owns (a slot of a device slab); the view must not
    /// outlive it.
    pub fn view_matrix(&self, kind: QuantKind, rows: usize, cols: usize, payload: u64, scales: u64) -> Result<CudaMat> {
        let desc = MatDesc::new(kind, rows, cols, payload, scales)?;
        let payload = DevBuf { ptr: payload, len: 0, _mem: None };
        let scales = DevBuf { ptr: scales, len: 0, _mem: None };
        Ok(CudaMat { desc, kind, rows, cols, _payload: payload, _scales: scales })
    }

    /// Queues a copy of `src` to device address `dst` on the compute stream. `src` must
    /// stay unchanged until a [`CopyFence`] recorded after this call has passed
    /// (page-locked memory, see [`CudaBackend::register_host`], copies asynchronously;
    /// other memory is staged by the driver).
    pub fn copy_to_device(&self, dst: u64, src: &[u8]) {
        if src.is_empty() {
            return;
        }
        let _g = self.lock();
        // SAFETY: `dst` is device memory of at least `src.len()` bytes (the caller's slot);
        // `src` outlives the copy (the caller waits on a fence before changing it).
        unsafe { result::memcpy_htod_async(dst, src, self.cu_stream()) }
            .unwrap_or_else(|e| panic!("CUDA: host to device copy: {e}"));
    }

    /// Starts a copy of `dst.len()` bytes at device address `src` into `dst` on the
    /// download stream, beside the compute stream; returns the fence that passes when it
    /// is done. It waits for nothing: the bytes at `src` must be complete (their copy's
    /// fence passed) and nothing may write them until the fence has passed (queue writes
    /// behind [`CudaBackend::queue_after`]); `dst` (page-locked, see
    /// [`CudaBackend::register_host`]) must stay untouched until then.
    pub fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<CopyFence> {
        let _g = self.lock();
        let stream = match self.download.get() {
            Some(s) => s,
            None => {
                let s = self.ctx.new_stream().map_err(|e| anyhow!("CUDA: download stream: {e}"))?;
                self.download.get_or_init(|| s)
            }
        };
        // SAFETY: `src` is device memory of at least `dst.len()` bytes (the caller's slot),
        // unchanged until the fence passes; `dst` outlives the copy (the caller waits).
        unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
            .map_err(|e| anyhow!("CUDA: device to host copy: {e}"))?;
        let e =
            self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(|e| anyhow!("CUDA: {e}"))?;
        e.record(stream).map_err(|e| anyhow!("CUDA: {e}"))?;
        Ok(CopyFence(e))
    }

    /// Makes the work queued on the compute stream after this call wait for `fence` (a
    /// copy into a slot that a device -> host copy is still reading).
    pub fn queue_after(&self, fence: &CopyFence) -> Result<()> {
        let _g = self.lock();
        self.stream().wait(&fence.0).map_err(|e| anyhow!("CUDA: {e}"))
    }

    /// A fence after everything queued so far.
    pub fn fence(&self) -> Result<CopyFence> {
        let _g = self.lock();
        let e =
            self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(|e| anyhow!("CUDA: {e}"))?;
        e.record(self.stream()).map_err(|e| anyhow!("CUDA: {e}"))?;
        Ok(CopyFence(e))
    }

    /// Page-locks `len` bytes at `ptr` (a host slab) so copies from it run on the copy
    /// engine at the link's rate without staging.
    ///
    /// # Safety
    /// `ptr..ptr + len` is host memory that outlives the returned registration.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<HostRegistration> {
        let _g = self.lock();
        let r = sys::cuMemHostRegister_v2(ptr as *mut c_void, len, 0);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(anyhow!("cannot page-lock the host expert slab ({len} bytes) for the GPU: {r:?}"));
        }
        Ok(HostRegistration { ptr, ctx: self.ctx.clone() })
    }

    /// Device memory (free, total) bytes, as the driver reports them.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        let _g = self.lock();
        let (free, total) = result::mem_get_info().map_err(|e| anyhow!("CUDA: {e}"))?;
        Ok((free as u64, total as u64))
    }
}

impl CudaBackend {
    /// Queues a copy of `len` u32s at device address `src` into the next read slot.
    pub(super) fn start_download(&self, st: &mut State, src: u64, len: usize) -> IdxRead {
        if len * 4 > READ_SLOT_BYTES {
            let mut v = vec![0u32; len];
            self.download(st, src, &mut v);
            return IdxRead(ReadState::Done(v));
        }
        let reads = &mut st.reads;
        if reads.slots.is_empty() {
            for _ in 0..READ_SLOTS {
                // SAFETY: plain allocation; freed by `Pinned`.
                let p = unsafe { result::malloc_host(READ_SLOT_BYTES, 0) }
                    .unwrap_or_else(|e| panic!("CUDA: pinned read slot: {e}"));
                let event = self
                    .ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .unwrap_or_else(|e| panic!("CUDA: {e}"));
                reads.slots.push(ReadSlot { host: Pinned(p as *mut u8), event, ticket: u64::MAX });
            }
        }
        let ticket = reads.next;
        reads.next += 1;
        let slot = (ticket % READ_SLOTS as u64) as usize;
        let s = &mut reads.slots[slot];
        s.ticket = ticket;
        // SAFETY: the slot holds READ_SLOT_BYTES >= len * 4 bytes and is read only after
        // its event has passed; `src` holds `len` values on the device.
        unsafe {
            let landing = std::slice::from_raw_parts_mut(s.host.0, len * 4);
            result::memcpy_dtoh_async(landing, src, self.cu_stream())
                .unwrap_or_else(|e| panic!("CUDA: device to host copy: {e}"));
        }
        s.event.record(self.stream()).unwrap_or_else(|e| panic!("CUDA: {e}"));
        IdxRead(ReadState::InFlight { slot, ticket, len })
    }

    /// Waits for a read (without holding the backend's lock) and copies its values out.
    pub(super) fn finish_download(&self, read: IdxRead, dst: &mut Vec<u32>) {
        let (slot, ticket, len) = match read.0 {
            ReadState::Done(v) => {
                *dst = v;
                return;
            }
            ReadState::InFlight { slot, ticket, len } => (slot, ticket, len),
        };
        let owned = |st: &State| {
            let s = &st.reads.slots[slot];
            assert_eq!(
                s.ticket, ticket,
                "a read back finished after {READ_SLOTS} later ones started (its slot was reused)"
            );
            s.event.cu_event()
        };
        let event = owned(&self.lock());
        // SAFETY: a live event (slots are never freed while the backend lives).
        let r = unsafe { sys::cuEventSynchronize(event) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "CUDA: waiting for a read back: {r:?}");
        let st = self.lock();
        owned(&st);
        dst.clear();
        // SAFETY: the copy into the slot has completed (its event passed) and the slot
        // is still this read's (ticket checked under the lock).
        dst.extend_from_slice(unsafe { std::slice::from_raw_parts(st.reads.slots[slot].host.0 as *const u32, len) });
    }
}
