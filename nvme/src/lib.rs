//! The corefs device layer: one queue interface over every block device corefs runs on.
//!
//! A [`BlockDevice`] is one submission/completion queue pair on one device. The caller's loop
//! drives it: [`BlockDevice::submit`] queues a [`Request`] carrying a caller token,
//! [`BlockDevice::poll`] pushes queued requests to the device and drains finished ones into a
//! caller-owned vector, and [`BlockDevice::wait`] parks until something finishes. No backend
//! starts a thread of its own.
//!
//! Backends ([`backend`]): NVMe passthrough (`nvme:/dev/ngXnY`), io_uring on a file or block
//! device (`file:PATH`), and memory (`mem:SIZE`). Wrappers (`wrap`, with the `sim` feature)
//! record every write for crash testing, inject seeded faults, simulate a volatile write cache,
//! and keep a read-only check's writes in memory. An open for writing holds the device
//! exclusively ([`lock`]); read-only tools open it shared.
//!
//! The `sim` feature carries the test machinery: the wrappers and [`SimAccess`] (direct block
//! access to simulated devices). A build without it (libcorefs) has neither, and refuses the
//! device-string options that need them ([`spec`]).
//!
//! # Invariants
//! - At most [`DeviceInfo::queue_depth`] requests are in flight on one queue; a full queue rejects
//!   with [`DevError::QueueFull`] and hands the request back (backpressure, never growth).
//! - Every request submitted completes exactly once, with the caller's token and, for reads and
//!   writes, the caller's buffer handed back.
//! - Data buffers come from the queue's [`DmaPool`], are aligned to the LBA size, and their length
//!   is a whole number of LBAs. A buffer in flight is owned by the device, so it cannot be touched
//!   while the hardware reads or writes it. A shared write ([`IoOp::WriteShared`], [`shared`])
//!   writes from immutable bytes instead, held by the queue until it completes and aligned as
//!   a DMA buffer is.
//!
//! # Fault model
//! A completion's result is the device's word: `Ok` means the operation is done as the device
//! defines done (a write without FUA may still sit in a volatile cache until a flush). Errors are
//! reported, never retried here: the caller decides, and corefs's engine fails the shard stop.

pub mod backend;
pub mod dma;
pub mod error;
pub mod limits;
pub mod lock;
pub mod probe;
pub mod shared;
pub mod spec;
#[cfg(feature = "sim")]
pub mod wrap;

pub use dma::{DmaBuf, DmaPool, PoolBacking};
pub use error::{DevError, NvmeStatus};
pub use lock::Access;
pub use shared::{
    aligned_copy, aligned_copy_visiting, staging_copy, staging_copy_visiting, SharedFit,
    SharedWrite,
};
pub use spec::{open_device, DeviceSpec, OpenOptions};

use std::time::Duration;

/// What a request asks the device to do. Reads and writes carry their buffer, whose length sets
/// the transfer size. A device command, named apart from the filesystem requests clients send
/// a reactor (`reactor::Op`).
#[derive(Debug)]
pub enum IoOp {
    /// Reads `buf.len()` bytes starting at `lba`.
    Read { lba: u64, buf: DmaBuf },
    /// Writes `buf` at `lba`; with `fua` the data is durable when the write completes.
    Write { lba: u64, buf: DmaBuf, fua: bool },
    /// Writes `data`'s pieces, in order, at `lba` straight from the memory they share, on a
    /// queue whose [`DeviceInfo::shared_write_ranges_max`] says it can ([`shared`]); otherwise as
    /// [`IoOp::Write`]. Its completion hands back no buffer.
    WriteShared {
        lba: u64,
        data: SharedWrite,
        fua: bool,
    },
    /// Makes every write completed before this flush was submitted durable.
    Flush,
    /// Sets `lbas` blocks from `lba` to zero without transferring data.
    WriteZeroes { lba: u64, lbas: u32 },
    /// Tells the device `lbas` blocks from `lba` hold nothing worth keeping. Reads of them
    /// afterwards return zeroes on every backend corefs ships (NVMe with DLFEAT read-zeroes,
    /// punched file holes, memory), but callers must not rely on the content.
    Deallocate { lba: u64, lbas: u32 },
}

/// The kind of an [`IoOp`], without its payload; used in errors, statistics and records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Read,
    Write,
    Flush,
    WriteZeroes,
    Deallocate,
}

impl IoOp {
    pub fn kind(&self) -> OpKind {
        match self {
            IoOp::Read { .. } => OpKind::Read,
            IoOp::Write { .. } | IoOp::WriteShared { .. } => OpKind::Write,
            IoOp::Flush => OpKind::Flush,
            IoOp::WriteZeroes { .. } => OpKind::WriteZeroes,
            IoOp::Deallocate { .. } => OpKind::Deallocate,
        }
    }

    /// The block range the op touches, if it touches one: (first lba, count of lbas).
    pub fn lba_range(&self, lba_size_bytes: u32) -> Option<(u64, u64)> {
        match self {
            IoOp::Read { lba, buf } | IoOp::Write { lba, buf, .. } => {
                Some((*lba, buf.len() as u64 / lba_size_bytes as u64))
            }
            IoOp::WriteShared { lba, data, .. } => {
                Some((*lba, data.len() as u64 / lba_size_bytes as u64))
            }
            IoOp::WriteZeroes { lba, lbas } | IoOp::Deallocate { lba, lbas } => {
                Some((*lba, *lbas as u64))
            }
            IoOp::Flush => None,
        }
    }

    /// A read of `buf.len()` bytes at `lba`, or (with `write`) a plain write of `buf` there.
    pub fn transfer(write: bool, lba: u64, buf: DmaBuf) -> IoOp {
        if write {
            IoOp::Write {
                lba,
                buf,
                fua: false,
            }
        } else {
            IoOp::Read { lba, buf }
        }
    }

    /// A write's first LBA, bytes and FUA flag, whichever memory they are in: for queues that
    /// model a device and keep the bytes (a shared write's pieces are joined in a copy).
    pub fn as_write(&self) -> Option<(u64, std::borrow::Cow<'_, [u8]>, bool)> {
        match self {
            IoOp::Write { lba, buf, fua } => Some((*lba, buf.as_slice().into(), *fua)),
            IoOp::WriteShared { lba, data, fua } => Some((*lba, data.to_vec().into(), *fua)),
            _ => None,
        }
    }

    /// Bytes a read or write moves; 0 for the rest.
    pub fn transfer_bytes(&self) -> usize {
        match self {
            IoOp::Read { buf, .. } | IoOp::Write { buf, .. } => buf.len(),
            IoOp::WriteShared { data, .. } => data.len(),
            IoOp::Flush | IoOp::WriteZeroes { .. } | IoOp::Deallocate { .. } => 0,
        }
    }

    /// Takes the data buffer out of a read or write (a shared write has none).
    pub fn into_buf(self) -> Option<DmaBuf> {
        match self {
            IoOp::Read { buf, .. } | IoOp::Write { buf, .. } => Some(buf),
            _ => None,
        }
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::WriteZeroes => "write-zeroes",
            OpKind::Deallocate => "deallocate",
        })
    }
}

/// One operation and the caller's token that comes back with its completion.
#[derive(Debug)]
pub struct Request {
    pub token: u64,
    pub op: IoOp,
}

/// A finished device request (the reactor's `Completion` answers a filesystem request). `buf` returns the read or write buffer to the caller; `result` is the
/// device's word on the operation.
#[derive(Debug)]
pub struct IoCompletion {
    pub token: u64,
    pub kind: OpKind,
    pub result: Result<(), DevError>,
    pub buf: Option<DmaBuf>,
}

/// A request the queue would not take, handed back with the reason.
#[derive(Debug)]
pub struct Rejected {
    pub request: Request,
    pub reason: DevError,
}

/// The static facts of one device queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device string this queue was opened from (`nvme:/dev/ng0n1`, `file:...`, `mem:...`).
    pub name: String,
    pub lba_size_bytes: u32,
    pub capacity_lbas: u64,
    /// Most requests in flight at once on this queue.
    pub queue_depth: u32,
    /// Largest single read or write, in bytes (the DMA buffer size).
    pub max_io_bytes: u32,
    /// True when a FUA write is cheaper than write + flush on this device (NVMe does FUA
    /// natively; a file emulates it with RWF_DSYNC).
    pub fua_native: bool,
    /// How completions are found: interrupt-driven, polled, or immediate (memory).
    pub completion_mode: CompletionMode,
    /// How many memory ranges one [`IoOp::WriteShared`] may span (pieces that follow each
    /// other in memory count as one, [`SharedFit::ranges`]); 0 when the queue takes
    /// no shared writes and writes only from DMA buffers ([`shared`]).
    pub shared_write_ranges_max: u32,
    /// Largest [`IoOp::WriteShared`], in bytes: at least `max_io_bytes`, and more where the
    /// queue is not bound by its DMA buffers' size (a file: fewer, larger writes cost the
    /// kernel and the host less per byte).
    pub shared_write_bytes_max: u32,
}

impl DeviceInfo {
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_lbas * self.lba_size_bytes as u64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionMode {
    /// Completions are posted by the kernel on interrupt; polling only reads the ring.
    Interrupt,
    /// Completions are found by polling the device's poll queues (IOPOLL).
    Polled,
    /// Operations complete at submission (memory backend).
    Immediate,
}

/// One submission/completion queue on a block device. See the module docs for the contract.
pub trait BlockDevice: Send {
    fn info(&self) -> &DeviceInfo;

    /// The DMA buffer pool registered with this queue. Buffers for reads and writes must come
    /// from it (backends using registered buffers reject foreign ones).
    fn pool(&self) -> &DmaPool;

    /// Queues one request. It reaches the device at the next [`poll`](Self::poll) or
    /// [`wait`](Self::wait) at the latest. On rejection the request comes back untouched.
    fn submit(&mut self, request: Request) -> Result<(), Rejected>;

    /// Pushes queued requests to the device and appends every finished one to `out`, without
    /// blocking. Returns how many were appended. An `Err` means the queue itself broke (the ring
    /// failed); every later call fails too.
    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError>;

    /// Like [`poll`](Self::poll) but blocks until at least one completion is appended or
    /// `timeout` passes. Returns immediately when nothing is in flight.
    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError>;

    /// Requests submitted and not yet handed back by `poll`/`wait`.
    fn in_flight(&self) -> u32;

    /// Has this queue signal `eventfd` (add to its counter) whenever a completion is ready,
    /// so the owner can sleep on that one descriptor for its completions and for any other
    /// wake-up at once (a reactor's clients ring the same eventfd). Call it from the thread
    /// that owns the queue. False when this queue cannot (a polled queue, memory): then only
    /// [`wait`](Self::wait) sleeps until a completion.
    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        let _ = eventfd;
        false
    }

    /// Has the kernel run this queue's blocking work (io_uring's io-wq workers: a flush of a
    /// file image is an `fdatasync` such a worker makes) on `cores`, those running now and
    /// those to come. The workers are born with the affinity of the thread that submits: a
    /// worker held to the core where a reactor busy-polls waited for the reactor's time
    /// slice (fsync p99 5.5 ms against 0.5 ms on this VM's file image). Call it from the
    /// thread that owns the queue; the first call before its first I/O. `Ok(false)` where the
    /// queue has no such workers (memory, wrappers that model a device) or the kernel refused.
    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        let _ = cores;
        Ok(false)
    }

    /// A handle that any thread may use for synchronous reads (and, where
    /// [`AnyThreadIo::writes`] says so, writes and flushes) beside this queue, seeing every
    /// write this queue has completed (a client running a change on an engine its reactor
    /// lent reads the tree nodes it misses through it, and writes an fsync's record through
    /// it: the queue itself is the reactor's). `None` where the device has none (wrappers
    /// that model a cache or inject faults: I/O beside them would see or skip what they
    /// hide).
    fn any_thread_io(&self) -> Option<Box<dyn AnyThreadIo>> {
        None
    }

    /// Another queue on the same storage that any thread may take, if the device can make
    /// one here (the memory device). An io_uring device cannot (its rings belong to the thread
    /// that made them): each reactor opens its own from the device string.
    fn new_queue(&self) -> Option<Result<Box<dyn BlockDevice>, DevError>> {
        None
    }

    /// Direct synchronous access to the stored blocks, for simulation only (the fault wrapper's
    /// crash model, crash-state tools). Real devices return `None`. Only with `sim`: a
    /// production build has no way around the queue.
    #[cfg(feature = "sim")]
    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        None
    }
}

/// Synchronous block access that bypasses the queue; offered by simulated devices only.
#[cfg(feature = "sim")]
pub trait SimAccess {
    fn sim_read(&self, lba: u64, out: &mut [u8]);
    fn sim_write(&mut self, lba: u64, data: &[u8]);
}

impl<D: BlockDevice + ?Sized> BlockDevice for Box<D> {
    fn info(&self) -> &DeviceInfo {
        (**self).info()
    }
    fn pool(&self) -> &DmaPool {
        (**self).pool()
    }
    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        (**self).submit(request)
    }
    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        (**self).poll(out)
    }
    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        (**self).wait(out, timeout)
    }
    fn in_flight(&self) -> u32 {
        (**self).in_flight()
    }
    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        (**self).signal_completions_to(eventfd)
    }
    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        (**self).run_blocking_work_on(cores)
    }
    #[cfg(feature = "sim")]
    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        (**self).sim_access()
    }
    fn new_queue(&self) -> Option<Result<Box<dyn BlockDevice>, DevError>> {
        (**self).new_queue()
    }
    fn any_thread_io(&self) -> Option<Box<dyn AnyThreadIo>> {
        (**self).any_thread_io()
    }
}

/// Checks a synchronous read or write of `len_bytes` at `lba` beside the queue
/// ([`AnyThreadIo::read_at`], [`AnyThreadIo::write_at`]): as [`validate`] checks a queued
/// one.
pub(crate) fn check_any_thread_io(
    info: &DeviceInfo,
    lba: u64,
    len_bytes: usize,
) -> Result<(), DevError> {
    check_len(info, len_bytes as u64, info.max_io_bytes)?;
    check_lbas(info, lba, len_bytes as u64 / info.lba_size_bytes as u64)
}

/// Checks a synchronous write beside the queue ([`AnyThreadIo::write_at`]): as a read, and
/// refused with `EROFS` on a device opened read-only, as [`refuse_writes`] refuses a queued
/// one.
pub(crate) fn check_any_thread_write(
    info: &DeviceInfo,
    read_only: bool,
    lba: u64,
    len_bytes: usize,
) -> Result<(), DevError> {
    check_any_thread_io(info, lba, len_bytes)?;
    if read_only {
        return Err(DevError::Io {
            op: OpKind::Write,
            errno: libc::EROFS,
        });
    }
    Ok(())
}

/// A transfer's length: whole LBAs, at least one, at most `max_bytes` (the largest I/O, or
/// the largest shared write).
fn check_len(info: &DeviceInfo, len_bytes: u64, max_bytes: u32) -> Result<(), DevError> {
    let lba_size = info.lba_size_bytes as u64;
    if len_bytes == 0 || len_bytes % lba_size != 0 || len_bytes > max_bytes as u64 {
        return Err(DevError::BadLength {
            len_bytes,
            lba_size_bytes: info.lba_size_bytes,
            max_io_bytes: max_bytes,
        });
    }
    Ok(())
}

/// An LBA range: at least one LBA, all inside the device.
fn check_lbas(info: &DeviceInfo, lba: u64, lbas: u64) -> Result<(), DevError> {
    if lbas == 0
        || lba
            .checked_add(lbas)
            .is_none_or(|end| end > info.capacity_lbas)
    {
        return Err(DevError::OutOfRange {
            lba,
            lbas,
            capacity_lbas: info.capacity_lbas,
        });
    }
    Ok(())
}

/// Synchronous I/O beside a device's queue, from any thread ([`BlockDevice::any_thread_io`]):
/// a system call or a lock per request, with no queue depth. For a lent engine in a
/// client's thread while the queue's owner sleeps: the node it misses, the data blocks of a
/// short read, an fsync's record and its flush.
///
/// Ordering: a read sees every write the queue or this handle completed. A write here and a
/// write in flight on the queue are not ordered; the engine writes here only while its
/// queue has nothing in flight. A flush here covers every write completed, on the queue or
/// here, before it was called, as a flush on the queue does (an NVMe flush covers the
/// namespace; `fdatasync` covers the file).
pub trait AnyThreadIo: Send {
    /// Reads `out.len()` bytes (whole LBAs, at most the device's largest transfer) at `lba`.
    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<(), DevError>;

    /// True when [`AnyThreadIo::write_at`] and [`AnyThreadIo::flush`] work here.
    fn writes(&self) -> bool {
        false
    }

    /// Writes `data` (whole LBAs, at most the device's largest transfer) at `lba`; with
    /// `fua`, durable when this returns. Fails on a device opened read-only.
    fn write_at(&mut self, lba: u64, data: &[u8], fua: bool) -> Result<(), DevError> {
        let _ = (lba, data, fua);
        Err(DevError::Unsupported {
            what: "writes beside the queue",
        })
    }

    /// Makes every write completed before this call durable.
    fn flush(&mut self) -> Result<(), DevError> {
        Err(DevError::Unsupported {
            what: "flushes beside the queue",
        })
    }
}

/// Checks a request against the queue's geometry before it reaches a device: alignment,
/// length, range. Cheap, so it runs on every submit of every backend; a device never sees a
/// request that could scribble outside the namespace.
pub fn validate(info: &DeviceInfo, pool: &DmaPool, op: &IoOp) -> Result<(), DevError> {
    if let IoOp::Read { buf, .. } | IoOp::Write { buf, .. } = op {
        if !buf.belongs_to(pool) {
            return Err(DevError::ForeignBuffer);
        }
        check_len(info, buf.len() as u64, info.max_io_bytes)?;
    }
    if let IoOp::WriteShared { data, .. } = op {
        data.check(info)?;
    }
    if let Some((lba, lbas)) = op.lba_range(info.lba_size_bytes) {
        check_lbas(info, lba, lbas)?;
    }
    Ok(())
}

/// Refuses what would change a device opened read-only ([`Access::ReadShared`]): writes,
/// write-zeroes and deallocate fail with `EROFS` before they reach it. Reads and flushes
/// pass (a flush changes nothing a reader could see).
pub fn refuse_writes(op: &IoOp) -> Result<(), DevError> {
    match op.kind() {
        OpKind::Write | OpKind::WriteZeroes | OpKind::Deallocate => Err(DevError::Io {
            op: op.kind(),
            errno: libc::EROFS,
        }),
        OpKind::Read | OpKind::Flush => Ok(()),
    }
}

/// Submits one request and spins on `poll` until it completes; for tools, tests and mkfs, never
/// for the hot path. Other completions found meanwhile are returned in `others`.
pub fn run_sync(
    dev: &mut dyn BlockDevice,
    op: IoOp,
    others: &mut Vec<IoCompletion>,
) -> Result<IoCompletion, DevError> {
    const SYNC_TOKEN: u64 = u64::MAX;
    let mut request = Request {
        token: SYNC_TOKEN,
        op,
    };
    loop {
        match dev.submit(request) {
            Ok(()) => break,
            Err(Rejected {
                request: back,
                reason: DevError::QueueFull,
            }) => {
                request = back;
                dev.wait(others, Duration::from_millis(10))?;
            }
            Err(rejected) => return Err(rejected.reason),
        }
    }
    let mut done = Vec::new();
    loop {
        dev.wait(&mut done, Duration::from_millis(100))?;
        let mut found = None;
        for completion in done.drain(..) {
            if completion.token == SYNC_TOKEN && found.is_none() {
                found = Some(completion);
            } else {
                others.push(completion);
            }
        }
        if let Some(completion) = found {
            return Ok(completion);
        }
    }
}

/// Reads `out.len()` bytes at `lba` synchronously through the pool, in chunks of at most
/// `max_io_bytes`. For tools and tests.
pub fn read_sync(dev: &mut dyn BlockDevice, lba: u64, out: &mut [u8]) -> Result<(), DevError> {
    let lba_size = dev.info().lba_size_bytes as usize;
    let chunk_bytes = dev.info().max_io_bytes as usize;
    assert_eq!(
        out.len() % lba_size,
        0,
        "read_sync length must be whole LBAs"
    );
    let mut others = Vec::new();
    for (index, piece) in out.chunks_mut(chunk_bytes).enumerate() {
        let buf = dev
            .pool()
            .alloc(piece.len())
            .ok_or(DevError::PoolExhausted)?;
        let at = lba + (index * chunk_bytes / lba_size) as u64;
        let done = run_sync(dev, IoOp::Read { lba: at, buf }, &mut others)?;
        done.result?;
        let buf = done.buf.expect("a read completion returns its buffer");
        piece.copy_from_slice(buf.as_slice());
    }
    assert!(others.is_empty(), "read_sync must run on an idle queue");
    Ok(())
}

/// Writes `data` at `lba` synchronously through the pool, in chunks. For tools and tests.
pub fn write_sync(
    dev: &mut dyn BlockDevice,
    lba: u64,
    data: &[u8],
    fua: bool,
) -> Result<(), DevError> {
    let lba_size = dev.info().lba_size_bytes as usize;
    let chunk_bytes = dev.info().max_io_bytes as usize;
    assert_eq!(
        data.len() % lba_size,
        0,
        "write_sync length must be whole LBAs"
    );
    let mut others = Vec::new();
    for (index, piece) in data.chunks(chunk_bytes).enumerate() {
        let mut buf = dev
            .pool()
            .alloc(piece.len())
            .ok_or(DevError::PoolExhausted)?;
        buf.as_mut_slice().copy_from_slice(piece);
        let at = lba + (index * chunk_bytes / lba_size) as u64;
        run_sync(dev, IoOp::Write { lba: at, buf, fua }, &mut others)?.result?;
    }
    assert!(others.is_empty(), "write_sync must run on an idle queue");
    Ok(())
}

/// Flushes synchronously. For tools and tests.
pub fn flush_sync(dev: &mut dyn BlockDevice) -> Result<(), DevError> {
    let mut others = Vec::new();
    let result = run_sync(dev, IoOp::Flush, &mut others)?.result;
    assert!(others.is_empty(), "flush_sync must run on an idle queue");
    result
}
