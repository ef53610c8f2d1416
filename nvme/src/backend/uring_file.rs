//! io_uring on a regular file or a block device, with `O_DIRECT`: the default backend for a
//! file-backed image, and the way to run corefs on any block device the kernel drives.
//!
//! Mapping: read/write → `READ_FIXED`/`WRITE_FIXED` on the registered DMA pool (plain
//! `READ`/`WRITE` if registration failed); a shared write → `WRITE` from its one memory range
//! or `WRITEV` over several, the pieces and the `iovec` list held in the in-flight slot; every
//! request names the file by its registered index (the descriptor itself if that registration
//! failed); FUA → `RWF_DSYNC` on the write (a real FUA on a block device, data+allocation sync
//! on a file); flush → `fdatasync` through the ring; write-zeroes →
//! `fallocate(ZERO_RANGE|KEEP_SIZE)`; deallocate → `fallocate(PUNCH_HOLE|KEEP_SIZE)`. SQPOLL is
//! optional.
//!
//! Access ([`crate::lock`]): an exclusive open takes an OFD write lock on the file (and opens a
//! block device with `O_EXCL` too), so a second writer fails at open; a read-shared open is
//! `O_RDONLY`, takes no lock, and refuses writes at submit (`EROFS`).
//!
//! Fault model: every CQE is checked. A negative result is an errno named in the error; a read
//! or write moving fewer bytes than asked is a `ShortTransfer` error, never silently accepted;
//! a failing `io_uring_enter` makes the queue fail-stop. Every size in the config is checked
//! at open (it may come from a device string or a C caller): a bad one is an error.

use super::ring::{drain_before_drop, FailStop, Ring, RingSetup};
use super::slots::{Held, InFlight, Slots};
use super::{admit, Gate};
use crate::dma::HugepagePolicy;
use crate::lock::{self, Access, DeviceLock};
use crate::{
    BlockDevice, CompletionMode, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, OpKind,
    Rejected, Request,
};
use io_uring::{cqueue, opcode, squeue, types};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The error for a block device that refused `O_EXCL`: held by a corefs process (its OFD lock
/// names the pid) or mounted or opened exclusively by something else.
fn busy_block_device(path: &Path, path_text: &str) -> DevError {
    let holder = File::open(path)
        .ok()
        .and_then(|f| lock::holder(&f, path_text).ok().flatten());
    DevError::Busy {
        device: format!("file:{path_text}"),
        holder: match holder {
            Some(holder) => holder.to_string(),
            None => "mounted, or opened exclusively by another program".into(),
        },
    }
}

/// The largest shared write ([`DeviceInfo::shared_write_bytes_max`]) on a file or block
/// device, when the DMA buffers are smaller.
pub const SHARED_WRITE_BYTES_MAX: u32 = 1 << 20;

/// How to open a file or block device.
#[derive(Debug, Clone)]
pub struct FileConfig {
    /// Create the file (or grow it) to this size; `None` uses the existing size.
    pub create_bytes: Option<u64>,
    /// LBA size for a regular file; a block device reports its own logical block size.
    pub lba_size_bytes: u32,
    pub queue_depth: u32,
    pub buf_bytes: usize,
    pub buf_count: u32,
    /// Kernel-side submission polling, with the idle time before the poller sleeps.
    pub sqpoll_idle_ms: Option<u32>,
    pub hugepages: HugepagePolicy,
    /// Exclusive (locked, read-write), read-only shared, or another queue of a device this
    /// process holds ([`crate::lock`]).
    pub access: Access,
}

impl Default for FileConfig {
    fn default() -> Self {
        FileConfig {
            create_bytes: None,
            lba_size_bytes: 4096,
            queue_depth: 128,
            buf_bytes: 128 << 10,
            buf_count: 256,
            sqpoll_idle_ms: None,
            hugepages: HugepagePolicy::Prefer,
            access: Access::Exclusive,
        }
    }
}

pub struct FileDevice {
    // Field order matters: the ring is dropped before the pool its buffers are registered from.
    ring: Ring<squeue::Entry, cqueue::Entry>,
    slots: Slots,
    info: DeviceInfo,
    pool: DmaPool,
    file: File,
    failed: FailStop,
    /// Opened [`Access::ReadShared`]: writes are refused at submit.
    read_only: bool,
    /// The device's exclusive lock, shared with the process's other queues on it; `None` when
    /// read-shared. Dropped after `file`, the descriptor it may have been taken through.
    _lock: Option<Arc<DeviceLock>>,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

impl FileDevice {
    pub fn open(path: &Path, config: &FileConfig) -> Result<FileDevice, DevError> {
        let path_text = path.display().to_string();
        let bad = |why: String| DevError::BadSpec {
            spec: format!("file:{path_text}"),
            why,
        };
        // The sizes are checked before anything is opened or created: each may come from a
        // device string or a C caller, and a wrapped one would size a pool or a ring wrongly.
        crate::limits::check_queue_depth(config.queue_depth as u64).map_err(bad)?;
        crate::dma::check_geometry(config.buf_bytes, config.buf_count).map_err(bad)?;
        if let Some(ms) = config.sqpoll_idle_ms {
            crate::limits::check_sqpoll_idle_ms(ms as u64).map_err(bad)?;
        }
        if let Some(bytes) = config.create_bytes {
            if bytes > crate::limits::SIZE_BYTES_MAX {
                return Err(bad(format!(
                    "size={bytes} is more than {}",
                    crate::limits::format_size(crate::limits::SIZE_BYTES_MAX)
                )));
            }
        }
        let read_only = config.access == Access::ReadShared;
        // A block device is opened O_EXCL for exclusive use (the kernel then refuses a mount
        // or another O_EXCL open of it); never with O_CREAT, since O_CREAT|O_EXCL fails on
        // any existing path.
        let is_block_device = std::fs::metadata(path)
            .map(|m| m.file_type().is_block_device())
            .unwrap_or(false);
        let mut flags = libc::O_DIRECT | libc::O_CLOEXEC;
        if is_block_device && config.access == Access::Exclusive {
            flags |= libc::O_EXCL;
        }
        let mut options = OpenOptions::new();
        options.read(true).write(!read_only).custom_flags(flags);
        if config.create_bytes.is_some() && !read_only && !is_block_device {
            options.create(true);
        }
        let file = options.open(path).map_err(|e| {
            if e.raw_os_error() == Some(libc::EBUSY) && is_block_device {
                return busy_block_device(path, &path_text);
            }
            let hint = match e.raw_os_error() {
                Some(libc::EINVAL) => {
                    "the filesystem holding it does not support O_DIRECT (tmpfs?): put the image \
                     on ext4, xfs or btrfs"
                }
                Some(libc::ENOENT) if !read_only => {
                    "give a size to create it (file:PATH,size=1GiB)"
                }
                _ => "",
            };
            DevError::setup(format!("opening {path_text}"), &e, hint)
        })?;
        // The lock is taken before the file is sized or read, so a second writer learns at
        // once that the image is in use and changes nothing.
        let lock = lock::for_access(&file, config.access, &format!("file:{path_text}"))?;
        let meta = file
            .metadata()
            .map_err(|e| DevError::setup(format!("stat {path_text}"), &e, ""))?;

        let (size_bytes, lba_size_bytes) = if meta.file_type().is_block_device() {
            let mut size: u64 = 0;
            let mut ssz: libc::c_int = 0;
            // SAFETY: both ioctls write one integer of the given type through the pointer.
            let ok = unsafe {
                libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) == 0
                    && libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut ssz) == 0
            };
            if !ok {
                let e = std::io::Error::last_os_error();
                return Err(DevError::setup(
                    format!("querying block device {path_text}"),
                    &e,
                    "",
                ));
            }
            (size, ssz as u32)
        } else if meta.file_type().is_file() {
            let mut size = meta.len();
            if let Some(want) = config.create_bytes.filter(|_| !read_only) {
                if size < want {
                    file.set_len(want)
                        .map_err(|e| DevError::setup(format!("sizing {path_text}"), &e, ""))?;
                    size = want;
                }
            }
            (size, config.lba_size_bytes)
        } else {
            return Err(DevError::BadSpec {
                spec: format!("file:{path_text}"),
                why: "not a regular file or block device".into(),
            });
        };
        if !lba_size_bytes.is_power_of_two() || !(512..=4096).contains(&lba_size_bytes) {
            return Err(DevError::BadSpec {
                spec: format!("file:{path_text}"),
                why: format!("LBA size {lba_size_bytes} is not a power of two from 512 to 4096"),
            });
        }
        let capacity_lbas = size_bytes / lba_size_bytes as u64;
        if capacity_lbas == 0 {
            return Err(DevError::BadSpec {
                spec: format!("file:{path_text}"),
                why: "empty: give a size to create it (file:PATH,size=1GiB)".into(),
            });
        }

        let pool = DmaPool::new(config.buf_bytes, config.buf_count, config.hugepages)?;
        // At most 4096 (checked above), so neither this nor the u32 below can overflow.
        let queue_depth = config.queue_depth.next_power_of_two();
        let mut ring = Ring::new(
            RingSetup {
                entries: queue_depth,
                iopoll: false,
                sqpoll_idle_ms: config.sqpoll_idle_ms,
            },
            &path_text,
        )?;
        ring.register_pool(&pool, &path_text);
        // The ring gets an open file description of its own to register, never `file`'s: the
        // kernel drops a ring's registered files only when it finishes tearing the ring down,
        // asynchronously after the ring is closed, and the exclusive lock lives on `file`'s
        // description, which must be gone when the device is (a tool run right after would
        // find the image still "in use"). Reopening through /proc/self/fd names the same
        // inode whatever became of the path meanwhile; it is closed here once the ring holds
        // its own reference.
        match reopen_for_ring(&file, read_only) {
            Ok(for_ring) => ring.register_file(for_ring.as_raw_fd(), &path_text),
            Err(e) => {
                tracing::debug!(path = %path_text, error = %e, "not reopened for the ring; requests name the descriptor")
            }
        }
        tracing::debug!(
            path = %path_text, lba_size_bytes, capacity_lbas, queue_depth,
            fixed_buffers = ring.fixed_buffers, fixed_file = ring.fixed_file, sqpoll = config.sqpoll_idle_ms.is_some(),
            "opened io_uring file device"
        );
        Ok(FileDevice {
            ring,
            slots: Slots::new(queue_depth),
            info: DeviceInfo {
                name: format!("file:{path_text}"),
                lba_size_bytes,
                capacity_lbas,
                queue_depth,
                max_io_bytes: u32::try_from(config.buf_bytes)
                    .expect("buf_bytes is at most BUF_BYTES_MAX, checked above"),
                fua_native: false,
                completion_mode: CompletionMode::Interrupt,
                // WRITEV's limit (UIO_MAXIOV); a run has at most a piece per block.
                shared_write_ranges_max: 1024,
                // 1 MiB writes from a fio job ran 3-43% faster than the same cut into
                // 128 KiB (3 alternating pairs), at less CPU: what a loop device under
                // ext4 sends its file too.
                shared_write_bytes_max: SHARED_WRITE_BYTES_MAX.max(config.buf_bytes as u32),
            },
            pool,
            file,
            failed: FailStop::default(),
            read_only,
            _lock: lock,
        })
    }

    /// True when I/O uses the registered pool (fixed buffers).
    pub fn fixed_buffers(&self) -> bool {
        self.ring.fixed_buffers
    }

    /// With a sparse buffer table (Linux 5.19+): how many pool buffers are registered so
    /// far, from index 0 (a chunk at a time, as they are first used). `None` when the whole
    /// pool was registered at open, or none of it is.
    pub fn registered_bufs(&self) -> Option<u32> {
        self.ring.registered_bufs()
    }

    /// True when requests name the file by its registered index (fixed file).
    pub fn fixed_file(&self) -> bool {
        self.ring.fixed_file
    }

    /// The SQE for `op`; a shared write's memory is named by `held`'s iovecs.
    fn build_sqe(&self, op: &IoOp, held: Option<&Held>, user_data: u64) -> squeue::Entry {
        let lba_size = self.info.lba_size_bytes as u64;
        let fixed = self.ring.fixed_buffers;
        // The file by its registered index when it has one, else by descriptor. The opcode
        // builders take either type but the trait they take it through is private to the
        // io-uring crate, hence a macro instead of a generic function.
        macro_rules! sqe_on {
            ($fd:expr) => {{
                let fd = $fd;
                match op {
                    IoOp::Read { lba, buf } => {
                        let ptr = buf.as_ptr().cast_mut();
                        let len = buf.len() as u32;
                        if fixed {
                            opcode::ReadFixed::new(fd, ptr, len, buf.index())
                                .offset(lba * lba_size)
                                .build()
                        } else {
                            opcode::Read::new(fd, ptr, len)
                                .offset(lba * lba_size)
                                .build()
                        }
                    }
                    IoOp::Write { lba, buf, fua } => {
                        let flags = if *fua { libc::RWF_DSYNC } else { 0 };
                        let len = buf.len() as u32;
                        if fixed {
                            opcode::WriteFixed::new(fd, buf.as_ptr(), len, buf.index())
                                .offset(lba * lba_size)
                                .rw_flags(flags)
                                .build()
                        } else {
                            opcode::Write::new(fd, buf.as_ptr(), len)
                                .offset(lba * lba_size)
                                .rw_flags(flags)
                                .build()
                        }
                    }
                    IoOp::WriteShared { lba, fua, .. } => {
                        let flags = if *fua { libc::RWF_DSYNC } else { 0 };
                        let iovecs = &held.expect("a shared write is held").iovecs;
                        // One range (a write staged as one allocation) is a plain write;
                        // more, a vectored one.
                        match &iovecs[..] {
                            [one] => {
                                opcode::Write::new(fd, one.iov_base.cast(), one.iov_len as u32)
                                    .offset(lba * lba_size)
                                    .rw_flags(flags)
                                    .build()
                            }
                            many => opcode::Writev::new(fd, many.as_ptr(), many.len() as u32)
                                .offset(lba * lba_size)
                                .rw_flags(flags)
                                .build(),
                        }
                    }
                    IoOp::Flush => opcode::Fsync::new(fd)
                        .flags(types::FsyncFlags::DATASYNC)
                        .build(),
                    IoOp::WriteZeroes { lba, lbas } => {
                        opcode::Fallocate::new(fd, *lbas as u64 * lba_size)
                            .offset(lba * lba_size)
                            .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                            .build()
                    }
                    IoOp::Deallocate { lba, lbas } => {
                        opcode::Fallocate::new(fd, *lbas as u64 * lba_size)
                            .offset(lba * lba_size)
                            .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                            .build()
                    }
                }
            }};
        }
        let sqe = if self.ring.fixed_file {
            sqe_on!(types::Fixed(0))
        } else {
            sqe_on!(types::Fd(self.file.as_raw_fd()))
        };
        sqe.user_data(user_data)
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        let mut count = 0;
        let mut cq = self.ring.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            let slot = self.slots.release(cqe.user_data());
            out.push(finish(slot, cqe.result()));
            count += 1;
        }
        count
    }
}

/// Turns a reaped slot and its CQE result into a completion, checking the transfer length.
fn finish(slot: InFlight, res: i32) -> IoCompletion {
    let result = if res < 0 {
        Err(DevError::Io {
            op: slot.kind,
            errno: -res,
        })
    } else if matches!(slot.kind, OpKind::Read | OpKind::Write) && res as u32 != slot.expect_bytes {
        Err(DevError::ShortTransfer {
            op: slot.kind,
            expected_bytes: slot.expect_bytes,
            got_bytes: res as u32,
        })
    } else {
        Ok(())
    };
    IoCompletion {
        token: slot.token,
        kind: slot.kind,
        result,
        buf: slot.buf,
    }
}

impl BlockDevice for FileDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn any_thread_io(&self) -> Option<Box<dyn crate::AnyThreadIo>> {
        // Its own open file description (O_DIRECT, the device's access) and a page-aligned
        // bounce buffer: O_DIRECT reads the device as this queue's completed writes left it.
        let file = reopen_for_ring(&self.file, self.read_only).ok()?;
        let bounce = memmap2::MmapMut::map_anon(self.info.max_io_bytes as usize).ok()?;
        Some(Box::new(FileSideIo {
            file,
            bounce,
            info: self.info.clone(),
            read_only: self.read_only,
        }))
    }

    fn pool(&self) -> &DmaPool {
        &self.pool
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        let gate = Gate {
            failed: self.failed.error(),
            full: self.slots.is_full(),
            read_only: self.read_only,
            ranges_unchecked: false,
        };
        if let Err(reason) = admit(&gate, &self.info, &self.pool, &request.op) {
            return Err(Rejected { request, reason });
        }
        let kind = request.op.kind();
        let expect_bytes = request.op.transfer_bytes() as u32;
        let held = match &request.op {
            IoOp::WriteShared { data, .. } => Some(Held::new(data.clone())),
            _ => None,
        };
        // The SQE is built while the request still owns the buffer; the pointers stay valid
        // because the buffer (or a shared write's pieces and iovecs) then moves into the
        // slot, and moving a DmaBuf, a Bytes or a Box does not move the memory they own.
        if let IoOp::Read { buf, .. } | IoOp::Write { buf, .. } = &request.op {
            self.ring.ensure_registered(buf.index(), &self.info.name);
        }
        let user_data = self.slots.next_index();
        let sqe = self.build_sqe(&request.op, held.as_ref(), user_data);
        if let Err(reason) = self.failed.on(self.ring.push(&sqe)) {
            return Err(Rejected { request, reason });
        }
        let entry = InFlight {
            token: request.token,
            kind,
            buf: request.op.into_buf(),
            expect_bytes,
            internal_buf: false,
            held,
        };
        self.slots.take(user_data, entry);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        self.failed.check()?;
        if self.ring.needs_enter(self.slots.in_flight()) {
            self.failed.on(self.ring.enter(0, None))?;
        }
        Ok(self.reap(out))
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        self.failed.check()?;
        // Completions already posted need no syscall; otherwise submit and wait in one enter,
        // which is what keeps queue-depth-1 latency at one syscall per I/O.
        let found = self.reap(out);
        if found > 0 || self.slots.in_flight() == 0 {
            return Ok(found);
        }
        self.failed.on(self.ring.enter(1, Some(timeout)))?;
        Ok(self.reap(out))
    }

    fn in_flight(&self) -> u32 {
        self.slots.in_flight()
    }

    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        let name = self.info.name.clone();
        self.ring.register_eventfd(eventfd, &name)
    }

    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        self.failed.check()?;
        self.ring.run_workers_on(cores)
    }
}

/// [`BlockDevice::any_thread_io`] of a file device: its own `O_DIRECT` open file description
/// and a bounce buffer (the caller's bytes are not aligned for `O_DIRECT`): pread(2),
/// pwritev2(2) (`RWF_DSYNC` for FUA, as the ring's writes) and fdatasync(2), the ring's
/// flush. A short transfer is an error, as on the ring.
struct FileSideIo {
    file: File,
    bounce: memmap2::MmapMut,
    info: DeviceInfo,
    read_only: bool,
}

fn side_error(op: crate::OpKind, e: std::io::Error) -> DevError {
    DevError::Io {
        op,
        errno: e.raw_os_error().unwrap_or(libc::EIO),
    }
}

impl crate::AnyThreadIo for FileSideIo {
    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<(), DevError> {
        use std::os::unix::fs::FileExt;
        crate::check_any_thread_io(&self.info, lba, out.len())?;
        let lba_size = self.info.lba_size_bytes as u64;
        let buf = &mut self.bounce[..out.len()];
        let mut done = 0;
        while done < buf.len() {
            match self
                .file
                .read_at(&mut buf[done..], lba * lba_size + done as u64)
            {
                Ok(0) => {
                    return Err(DevError::ShortTransfer {
                        op: crate::OpKind::Read,
                        expected_bytes: buf.len() as u32,
                        got_bytes: done as u32,
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(side_error(crate::OpKind::Read, e)),
            }
        }
        out.copy_from_slice(buf);
        Ok(())
    }

    fn writes(&self) -> bool {
        !self.read_only
    }

    fn write_at(&mut self, lba: u64, data: &[u8], fua: bool) -> Result<(), DevError> {
        crate::check_any_thread_write(&self.info, self.read_only, lba, data.len())?;
        let buf = &mut self.bounce[..data.len()];
        buf.copy_from_slice(data);
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let offset = (lba * self.info.lba_size_bytes as u64) as libc::off_t;
        let flags = if fua { libc::RWF_DSYNC } else { 0 };
        loop {
            // SAFETY: one iovec over the bounce buffer, which lives across the call.
            let rc = unsafe { libc::pwritev2(self.file.as_raw_fd(), &iov, 1, offset, flags) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(side_error(crate::OpKind::Write, e));
            }
            if rc as usize != data.len() {
                return Err(DevError::ShortTransfer {
                    op: crate::OpKind::Write,
                    expected_bytes: data.len() as u32,
                    got_bytes: rc as u32,
                });
            }
            return Ok(());
        }
    }

    fn flush(&mut self) -> Result<(), DevError> {
        loop {
            // SAFETY: a descriptor this handle owns.
            if unsafe { libc::fdatasync(self.file.as_raw_fd()) } == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(side_error(crate::OpKind::Flush, e));
            }
        }
    }
}

/// A second open file description of `file`'s inode, with the same access and O_DIRECT, no
/// lock and no O_EXCL claim.
fn reopen_for_ring(file: &File, read_only: bool) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

impl Drop for FileDevice {
    fn drop(&mut self) {
        if self.slots.in_flight() > 0 && self.failed.error().is_none() {
            drain_before_drop(self);
        }
        // The kernel may still write into what is left in flight: never back to the pool.
        self.slots.leak_in_flight();
    }
}
