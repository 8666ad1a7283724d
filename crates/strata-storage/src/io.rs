//! Positioned reads of expert bytes into caller-owned, page-aligned memory.
//!
//! [`IoPool`] owns the open files of an expert container and a few worker threads
//! (default [`DEFAULT_WORKERS`]). A request is at most [`MAX_SEGMENTS`] segments
//! `(file, offset, len) -> dest[dest_offset..]`; one worker serves it with positioned reads
//! (`pread`), so requests run in parallel across workers and never share a file cursor.
//!
//! Direct I/O (`O_DIRECT`, the default) bypasses the page cache so that the slab, not the
//! OS, is the cache. It needs the file offset, the length and the destination address to
//! be multiples of [`ALIGN`]; a segment that is not aligned is read through a second,
//! buffered descriptor instead (counted in [`ReadStats::buffered_ops`]). Where the
//! filesystem refuses `O_DIRECT` (`EINVAL`, e.g. tmpfs) the pool falls back to buffered
//! reads with a one-time warning ([`IoPool::warnings`]).
//!
//! Errors fail only their own ticket and name the file, offset and length; the pool stays
//! usable. A request submitted with a [`ReadCheck`] ([`IoPool::submit_checked`]) is
//! hashed by its worker once its bytes land; a mismatch fails the ticket, naming the file
//! and the label (layer and expert), so the caller never publishes the slot. A segment may run past the end of the file (as measured when the pool opened)
//! by less than [`ALIGN`] bytes — the tail of a page-aligned covering read — and that
//! overhang reads as zeros; any other short read (a file truncated under the reader) is an
//! error.

use crate::checksum::{parts_checksum, ReadCheck};
use crate::container::ALIGN as ALIGN_U64;
use anyhow::{anyhow, bail, Context, Result};
use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Alignment of direct-I/O offsets, lengths and buffers (bytes).
pub const ALIGN: usize = ALIGN_U64 as usize;
/// Most segments one request may carry.
pub const MAX_SEGMENTS: usize = 8;
/// Worker threads when the caller has no preference.
pub const DEFAULT_WORKERS: usize = 2;

/// Zero-initialised heap memory whose address is a multiple of [`ALIGN`] (the allocation
/// is rounded up to a whole number of pages; [`len`](Self::len) is what was asked for).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    locked: bool,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes; fails (rather than aborting) when memory is short.
    pub fn new(len: usize) -> Result<Self> {
        let cap = len.div_ceil(ALIGN) * ALIGN;
        if cap == 0 {
            // A dangling but aligned pointer: valid for zero-length slices.
            let ptr = NonNull::new(ALIGN as *mut u8).expect("non-null");
            return Ok(Self { ptr, len, cap, locked: false });
        }
        let layout = Layout::from_size_align(cap, ALIGN).map_err(|e| anyhow!("aligned buffer of {len} bytes: {e}"))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| anyhow!("cannot allocate an aligned buffer of {len} bytes"))?;
        Ok(Self { ptr, len, cap, locked: false })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len <= cap` bytes are allocated and initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Whether [`mlock`](Self::mlock) succeeded.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Wires the buffer in RAM (`mlock`) so the OS cannot page it out. Fails, with the
    /// memlock limit in the message, where `RLIMIT_MEMLOCK` forbids: callers should turn
    /// that into a warning and run unlocked.
    pub fn mlock(&mut self) -> Result<()> {
        if self.locked || self.cap == 0 {
            return Ok(());
        }
        // SAFETY: the range is our own allocation.
        let rc = unsafe { libc::mlock(self.ptr.as_ptr() as *const libc::c_void, self.cap) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            bail!(
                "cannot lock {} bytes in memory: {err} (RLIMIT_MEMLOCK soft limit: {})",
                self.cap,
                memlock_limit_text()
            );
        }
        self.locked = true;
        Ok(())
    }
}

fn memlock_limit_text() -> String {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return "unknown".into();
    }
    if lim.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} bytes", lim.rlim_cur)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap == 0 {
            return;
        }
        if self.locked {
            // SAFETY: the range was locked by us.
            unsafe { libc::munlock(self.ptr.as_ptr() as *const libc::c_void, self.cap) };
        }
        // SAFETY: allocated in `new` with this exact layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.cap, ALIGN)) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).field("locked", &self.locked).finish()
    }
}

/// One positioned read: `len` bytes of file `file` (an index into the pool's files) at
/// `offset`, into `dest[dest_offset..dest_offset + len]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadSegment {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    pub dest_offset: usize,
}

/// What one request cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes requested by the segments (overhang past the end of file included).
    pub bytes: u64,
    /// Positioned read system calls issued.
    pub ops: u64,
    /// Of `ops`, those served by the buffered descriptor in a direct pool (unaligned
    /// segments or the O_DIRECT fallback).
    pub buffered_ops: u64,
    /// Time a worker spent reading (disk service time).
    pub service: Duration,
    /// Time the request waited in the queue before a worker took it.
    pub queued: Duration,
    /// Of `service`, time spent verifying the checksum.
    pub checksum: Duration,
}

impl ReadStats {
    /// Adds another request's numbers to these.
    pub fn add(&mut self, other: &ReadStats) {
        self.bytes += other.bytes;
        self.ops += other.ops;
        self.buffered_ops += other.buffered_ops;
        self.service += other.service;
        self.queued += other.queued;
        self.checksum += other.checksum;
    }
}

struct PoolFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    len_at_open: u64,
}

struct Shared {
    files: Vec<PoolFile>,
    direct_requested: bool,
    /// Cleared when a direct read is refused (EINVAL): every later read is buffered.
    direct_ok: AtomicBool,
    warnings: Mutex<Vec<String>>,
    warned_fallback: AtomicBool,
}

impl Shared {
    fn fallback(&self, what: &str) {
        self.direct_ok.store(false, Ordering::SeqCst);
        if !self.warned_fallback.swap(true, Ordering::SeqCst) {
            let msg = format!("{what}: the filesystem refuses O_DIRECT; expert reads go through the page cache");
            eprintln!("strata: warning: {msg}");
            self.warnings.lock().unwrap().push(msg);
        }
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the submitter promises the destination stays valid and untouched until the
// ticket completes; only the serving worker writes through it.
unsafe impl Send for SendPtr {}

struct Job {
    segments: Vec<ReadSegment>,
    check: Option<ReadCheck>,
    dest: SendPtr,
    submitted: Instant,
    reply: mpsc::SyncSender<Result<ReadStats>>,
}

/// Worker threads doing positioned reads over a fixed set of files.
pub struct IoPool {
    shared: Arc<Shared>,
    tx: Option<mpsc::Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

/// The pending result of [`IoPool::submit`]. Dropping a ticket that has not completed
/// blocks until its reads are done, so the destination is never written after the ticket
/// is gone.
pub struct ReadTicket {
    rx: Option<mpsc::Receiver<Result<ReadStats>>>,
    done: Option<Result<ReadStats>>,
}

impl ReadTicket {
    fn ready(result: Result<ReadStats>) -> Self {
        Self { rx: None, done: Some(result) }
    }

    /// Blocks until the reads are done.
    pub fn wait(mut self) -> Result<ReadStats> {
        self.take()
    }

    /// Whether the reads are done (never blocks).
    pub fn is_done(&mut self) -> bool {
        if self.done.is_none() {
            if let Some(rx) = &self.rx {
                match rx.try_recv() {
                    Ok(r) => {
                        self.done = Some(r);
                        self.rx = None;
                    }
                    Err(mpsc::TryRecvError::Empty) => return false,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        self.done = Some(Err(anyhow!("I/O worker exited before finishing the read")));
                        self.rx = None;
                    }
                }
            }
        }
        true
    }

    fn take(&mut self) -> Result<ReadStats> {
        if let Some(r) = self.done.take() {
            return r;
        }
        match self.rx.take() {
            Some(rx) => rx.recv().unwrap_or_else(|_| Err(anyhow!("I/O worker exited before finishing the read"))),
            None => Err(anyhow!("read ticket already consumed")),
        }
    }
}

impl Drop for ReadTicket {
    fn drop(&mut self) {
        if let Some(rx) = self.rx.take() {
            let _ = rx.recv();
        }
    }
}

impl IoPool {
    /// Opens `files` for reading (their order gives [`ReadSegment::file`]) and starts
    /// `workers` threads (at least one). With `direct`, reads bypass the page cache.
    pub fn open<P: AsRef<Path>>(files: &[P], workers: usize, direct: bool) -> Result<Self> {
        let mut shared = Shared {
            files: Vec::with_capacity(files.len()),
            direct_requested: direct,
            direct_ok: AtomicBool::new(direct),
            warnings: Mutex::new(Vec::new()),
            warned_fallback: AtomicBool::new(false),
        };
        for p in files {
            let path = p.as_ref().to_path_buf();
            let buffered = File::open(&path).with_context(|| format!("{}: cannot open for reading", path.display()))?;
            let len_at_open = buffered.metadata().with_context(|| format!("{}: cannot stat", path.display()))?.len();
            let direct_file = if direct && shared.direct_ok.load(Ordering::SeqCst) {
                let opened = if simulate_einval() {
                    Err(std::io::Error::from_raw_os_error(libc::EINVAL))
                } else {
                    OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path)
                };
                match opened {
                    Ok(f) => Some(f),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        shared.fallback(&path.display().to_string());
                        None
                    }
                    Err(e) => {
                        return Err(anyhow!(e))
                            .with_context(|| format!("{}: cannot open with O_DIRECT", path.display()))
                    }
                }
            } else {
                None
            };
            shared.files.push(PoolFile { path, buffered, direct: direct_file, len_at_open });
        }
        let shared = Arc::new(shared);
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..workers.max(1))
            .map(|i| {
                let rx = Arc::clone(&rx);
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("strata-io-{i}"))
                    .spawn(move || worker(&shared, &rx))
                    .context("cannot start an I/O worker thread")
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { shared, tx: Some(tx), workers })
    }

    /// The files, in [`ReadSegment::file`] order.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shared.files.iter().map(|f| f.path.as_path())
    }

    /// File sizes as measured when the pool opened.
    pub fn file_len(&self, file: usize) -> Option<u64> {
        self.shared.files.get(file).map(|f| f.len_at_open)
    }

    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Whether aligned reads currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.shared.direct_requested
            && self.shared.direct_ok.load(Ordering::SeqCst)
            && self.shared.files.iter().all(|f| f.direct.is_some())
    }

    /// Warnings raised so far (the O_DIRECT fallback), each once.
    pub fn warnings(&self) -> Vec<String> {
        self.shared.warnings.lock().unwrap().clone()
    }

    /// Queues a read of `segments` into `dest` (`dest_len` bytes) and returns at once.
    /// A request that is invalid (too many segments, a segment outside `dest` or naming
    /// no file) yields a ticket that fails with the reason.
    ///
    /// # Safety
    /// `dest` must be valid for writes of `dest_len` bytes, and neither read nor written
    /// by anyone else, until the ticket completes (is waited for or dropped).
    pub unsafe fn submit(&self, segments: Vec<ReadSegment>, dest: *mut u8, dest_len: usize) -> ReadTicket {
        self.submit_checked(segments, dest, dest_len, None)
    }

    /// [`submit`](Self::submit) with an expected checksum: once the bytes land, the worker
    /// hashes the segments' destination bytes in segment order
    /// ([`parts_checksum`](crate::checksum::parts_checksum)); a mismatch fails the ticket
    /// with an error naming the file and `check.label`. The destination then holds the
    /// bad bytes: do not publish it.
    ///
    /// # Safety
    /// As for [`submit`](Self::submit).
    pub unsafe fn submit_checked(
        &self,
        segments: Vec<ReadSegment>,
        dest: *mut u8,
        dest_len: usize,
        check: Option<ReadCheck>,
    ) -> ReadTicket {
        if let Err(e) = self.validate(&segments, dest, dest_len) {
            return ReadTicket::ready(Err(e));
        }
        if let Some(c) = &check {
            if let Some(&(at, len)) =
                c.ranges.iter().find(|&&(at, len)| at.checked_add(len).is_none_or(|e| e > dest_len))
            {
                return ReadTicket::ready(Err(anyhow!(
                    "{}: checksum range {at}..{} lies outside the {dest_len}-byte destination",
                    c.label,
                    at.saturating_add(len)
                )));
            }
        }
        let (reply, rx) = mpsc::sync_channel(1);
        let job = Job { segments, check, dest: SendPtr(dest), submitted: Instant::now(), reply };
        match self.tx.as_ref().map(|tx| tx.send(job)) {
            Some(Ok(())) => ReadTicket { rx: Some(rx), done: None },
            _ => ReadTicket::ready(Err(anyhow!("I/O pool is shut down"))),
        }
    }

    /// Submits and waits: a safe wrapper for callers that own `dest` outright.
    pub fn read(&self, segments: Vec<ReadSegment>, dest: &mut [u8]) -> Result<ReadStats> {
        self.read_checked(segments, dest, None)
    }

    /// [`read`](Self::read) verified against `check` (see [`submit_checked`](Self::submit_checked)).
    pub fn read_checked(
        &self,
        segments: Vec<ReadSegment>,
        dest: &mut [u8],
        check: Option<ReadCheck>,
    ) -> Result<ReadStats> {
        // SAFETY: `dest` is exclusively borrowed until `wait` returns.
        unsafe { self.submit_checked(segments, dest.as_mut_ptr(), dest.len(), check) }.wait()
    }

    fn validate(&self, segments: &[ReadSegment], dest: *mut u8, dest_len: usize) -> Result<()> {
        if segments.len() > MAX_SEGMENTS {
            bail!("a read may have at most {MAX_SEGMENTS} segments, this one has {}", segments.len());
        }
        if dest.is_null() && segments.iter().any(|s| s.len > 0) {
            bail!("read into a null destination");
        }
        for s in segments {
            let Some(f) = self.shared.files.get(s.file) else {
                bail!("read segment names file #{} but the pool has {} files", s.file, self.shared.files.len());
            };
            let end = s.dest_offset.checked_add(s.len);
            if end.is_none_or(|e| e > dest_len) {
                bail!(
                    "{}: read of {} bytes at offset {} into destination bytes {}..{} overflows the {dest_len}-byte buffer",
                    f.path.display(),
                    s.len,
                    s.offset,
                    s.dest_offset,
                    s.dest_offset.saturating_add(s.len)
                );
            }
        }
        Ok(())
    }

    /// Advises the kernel that these ranges will be read soon (`POSIX_FADV_WILLNEED`).
    /// Purely advisory: no memory of ours is allocated and errors are ignored. Note that
    /// on Linux direct reads do not use the page cache, so hints pay off for buffered
    /// reads (a page-cache pool, or unaligned segments). Returns the hints issued.
    pub fn hint_willneed(&self, segments: &[ReadSegment]) -> usize {
        let mut issued = 0;
        for s in segments {
            let Some(f) = self.shared.files.get(s.file) else { continue };
            if s.len == 0 || s.offset >= f.len_at_open {
                continue;
            }
            // SAFETY: plain syscall on our own descriptor.
            let rc = unsafe {
                libc::posix_fadvise(
                    f.buffered.as_raw_fd(),
                    s.offset as libc::off_t,
                    s.len as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                )
            };
            if rc == 0 {
                issued += 1;
            }
        }
        issued
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        // Closing the queue lets workers finish what is queued, then exit.
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: make O_DIRECT opens fail as a filesystem without O_DIRECT would.
    static SIMULATE_EINVAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn simulate_einval() -> bool {
    SIMULATE_EINVAL.with(|c| c.get())
}

#[cfg(not(test))]
fn simulate_einval() -> bool {
    false
}

fn worker(shared: &Shared, rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = {
            let guard = match rx.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            match guard.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        let start = Instant::now();
        let queued = start - job.submitted;
        let mut stats = ReadStats { queued, ..Default::default() };
        let mut result = Ok(());
        for s in &job.segments {
            // SAFETY: validated against `dest_len` at submit; the submitter keeps `dest`
            // valid and exclusive until the ticket completes.
            let dest = unsafe { std::slice::from_raw_parts_mut(job.dest.0.add(s.dest_offset), s.len) };
            if let Err(e) = read_segment(shared, s, dest, &mut stats) {
                result = Err(e);
                break;
            }
        }
        if let (Ok(()), Some(check)) = (&result, &job.check) {
            let t = Instant::now();
            result = verify(shared, &job, check);
            stats.checksum = t.elapsed();
        }
        stats.service = start.elapsed();
        let _ = job.reply.send(result.map(|()| stats));
    }
}

/// Hashes a finished job's destination bytes against `check`.
fn verify(shared: &Shared, job: &Job, check: &ReadCheck) -> Result<()> {
    let ranges: Vec<(usize, usize)> = if check.ranges.is_empty() {
        job.segments.iter().map(|s| (s.dest_offset, s.len)).collect()
    } else {
        check.ranges.clone()
    };
    // SAFETY: as in `worker`: ranges validated against `dest_len` at submit, in the
    // submitter's exclusive buffer.
    let got =
        parts_checksum(ranges.iter().map(|&(at, len)| unsafe { std::slice::from_raw_parts(job.dest.0.add(at), len) }));
    if got == check.expected {
        return Ok(());
    }
    let files: Vec<String> = job
        .segments
        .iter()
        .map(|s| format!("{} at offset {} ({} bytes)", shared.files[s.file].path.display(), s.offset, s.len))
        .collect();
    bail!(
        "{}: {}: checksum mismatch (expected {:016x}, read {got:016x}): the expert's bytes changed since they were \
         recorded (file modified or damaged, or a bad disk read); not using them",
        files.join(", "),
        check.label,
        check.expected
    )
}

fn read_segment(shared: &Shared, s: &ReadSegment, dest: &mut [u8], stats: &mut ReadStats) -> Result<()> {
    let f = &shared.files[s.file];
    let name = || f.path.display();
    let end = s.offset + s.len as u64;
    // The tail of a page-aligned covering read may pass the end of file by less than a page.
    if s.len > 0 && (s.offset >= f.len_at_open || end > f.len_at_open.div_ceil(ALIGN_U64) * ALIGN_U64) {
        bail!(
            "{}: read of {} bytes at offset {} lies past the end of the file ({} bytes)",
            name(),
            s.len,
            s.offset,
            f.len_at_open
        );
    }
    let expected = s.len.min(f.len_at_open.saturating_sub(s.offset) as usize);
    stats.bytes += s.len as u64;
    let aligned = s.offset.is_multiple_of(ALIGN_U64)
        && s.len.is_multiple_of(ALIGN)
        && (dest.as_ptr() as usize).is_multiple_of(ALIGN);
    let mut done = 0usize;
    if aligned && shared.direct_ok.load(Ordering::SeqCst) {
        if let Some(df) = &f.direct {
            // Direct reads: whole pages; a short count means end of file.
            while done < s.len {
                stats.ops += 1;
                match df.read_at(&mut dest[done..], s.offset + done as u64) {
                    Ok(0) => break,
                    Ok(n) => {
                        done += n;
                        if !done.is_multiple_of(ALIGN) {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        shared.fallback(&name().to_string());
                        break;
                    }
                    Err(e) => bail!("{}: read of {} bytes at offset {} failed: {e}", name(), s.len, s.offset),
                }
            }
        }
    }
    if done < expected {
        // Buffered path: the whole segment in a non-direct pool, or what is left.
        let mut short = false;
        while done < expected {
            stats.ops += 1;
            if shared.direct_requested {
                stats.buffered_ops += 1;
            }
            match f.buffered.read_at(&mut dest[done..expected], s.offset + done as u64) {
                Ok(0) => {
                    short = true;
                    break;
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => bail!(
                    "{}: read of {} bytes at offset {} failed at byte {}: {e}",
                    name(),
                    s.len,
                    s.offset,
                    s.offset + done as u64
                ),
            }
        }
        if short || done < expected {
            bail!(
                "{}: short read of {} bytes at offset {}: got {done} bytes, the file ended early (it had {} bytes when opened; truncated?)",
                name(),
                s.len,
                s.offset,
                f.len_at_open
            );
        }
    }
    if done < s.len {
        dest[done..].fill(0);
    }
    Ok(())
}

#[cfg(test)]
#[path = "io_tests.rs"]
mod tests;
