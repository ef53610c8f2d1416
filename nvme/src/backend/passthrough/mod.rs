//! NVMe passthrough: NVMe I/O commands sent straight to the controller through io_uring
//! `IORING_OP_URING_CMD` (`NVME_URING_CMD_IO`) on the generic char device `/dev/ngXnY`, with
//! 128-byte SQEs and 32-byte CQEs. No block layer, no page cache, no filesystem.
//!
//! - Geometry comes from Identify Namespace (admin passthrough ioctl): LBA size is
//!   `1 << lbaf[flbas].ds`; capacity is NSZE. Identify Controller gives MDTS and whether Write
//!   Zeroes and Dataset Management exist.
//! - Data commands use the registered DMA pool (`IORING_URING_CMD_FIXED`; buffer `i` of the pool
//!   is registered buffer `i`, see [`crate::DmaPool::iovecs`] for why not one big buffer).
//! - Completions are polled (`IORING_SETUP_IOPOLL`) when the namespace's queue has poll queues
//!   (`nvme poll_queues=N`), interrupt-driven otherwise; a log line says which.
//! - Data-less commands (Flush, Write Zeroes) go on a second ring without IOPOLL: on Linux 6.1 a
//!   Flush on an IOPOLL ring with poll queues can oops the kernel.
//!
//! - Access ([`crate::lock`]): an exclusive open takes an OFD write lock on the char device, so
//!   a second writer of the namespace (another corefs process, or a second open in this one)
//!   fails at open; a read-shared open is `O_RDONLY`, takes no lock and refuses writes.
//!
//! Fault model: `cqe.res` < 0 is an errno, > 0 an NVMe status (named in the error, with the DNR
//! bit), 0 success. A command the host cancelled (a controller reset: `-EINTR`, Host Pathing
//! Error, Command Aborted By Host) is sent again as it was, with backoff, for up to
//! [`retry::RETRY_BUDGET`] ([`retry`] says why that is safe); nothing else is retried. A failed
//! `io_uring_enter` makes the queue fail-stop.
//! The config's sizes are checked at open, and the controller's reported sizes are used with
//! checked or saturating arithmetic: neither can wrap a size.

pub mod abi;
mod retry;

use super::ring::{drain_before_drop, FailStop, Ring, RingSetup};
use super::slots::{Held, InFlight, Slots};
use super::{admit, Gate};
use crate::dma::HugepagePolicy;
use crate::lock::{self, Access, DeviceLock};
use crate::{
    BlockDevice, CompletionMode, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, NvmeStatus,
    OpKind, Rejected, Request,
};
use abi::*;
use io_uring::{cqueue, opcode, squeue, types};
use retry::Resubmits;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether to poll for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoPoll {
    /// Poll when the device has poll queues.
    #[default]
    Auto,
    On,
    Off,
}

#[derive(Debug, Clone)]
pub struct PassthroughConfig {
    pub queue_depth: u32,
    pub buf_bytes: usize,
    pub buf_count: u32,
    pub iopoll: IoPoll,
    pub hugepages: HugepagePolicy,
    /// Reject out-of-range LBAs before they reach the controller (the default). Off only to
    /// test the controller's own range check and its status mapping.
    pub check_ranges: bool,
    /// Register the DMA pool with the ring (fixed buffers). Off only to compare.
    pub register_buffers: bool,
    /// Exclusive (locked, read-write), read-only shared, or another queue of a namespace this
    /// process holds ([`crate::lock`]).
    pub access: Access,
}

impl Default for PassthroughConfig {
    fn default() -> Self {
        PassthroughConfig {
            queue_depth: 128,
            buf_bytes: 128 << 10,
            buf_count: 256,
            iopoll: IoPoll::Auto,
            hugepages: HugepagePolicy::Prefer,
            check_ranges: true,
            register_buffers: true,
            access: Access::Exclusive,
        }
    }
}

type Ring128 = Ring<squeue::Entry128, cqueue::Entry32>;

pub struct PassthroughDevice {
    // Field order matters: the rings drop before the pool their buffers are registered from.
    data_ring: Ring128,
    /// Flush and Write Zeroes, never polled (see the module docs).
    dataless_ring: Ring128,
    slots: Slots,
    /// What each slot was sent as, to send it again after a controller reset.
    resubmits: Resubmits<squeue::Entry128>,
    info: DeviceInfo,
    pool: DmaPool,
    file: File,
    nsid: u32,
    namespace: NamespaceId,
    controller: ControllerId,
    failed: FailStop,
    check_ranges: bool,
    /// Opened [`Access::ReadShared`]: writes are refused at submit.
    read_only: bool,
    /// The namespace's exclusive lock, shared with this process's other queues on it; `None`
    /// when read-shared. Dropped after `file`.
    _lock: Option<Arc<DeviceLock>>,
}

impl PassthroughDevice {
    pub fn open(path: &Path, config: &PassthroughConfig) -> Result<PassthroughDevice, DevError> {
        let path_text = path.display().to_string();
        let bad = |why: String| DevError::BadSpec {
            spec: format!("nvme:{path_text}"),
            why,
        };
        crate::limits::check_queue_depth(config.queue_depth as u64).map_err(bad)?;
        crate::dma::check_geometry(config.buf_bytes, config.buf_count).map_err(bad)?;
        let read_only = config.access == Access::ReadShared;
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags_cloexec()
            .open(path)
            .map_err(|e| {
                let hint = match e.raw_os_error() {
                    Some(libc::ENOENT) => {
                        "no such NVMe generic device: list them with `ls /dev/ng*` (Linux 5.19+ \
                         creates /dev/ngXnY for every namespace)"
                    }
                    Some(libc::EACCES | libc::EPERM) => {
                        "passthrough needs read-write access to the char device (root, or a udev \
                         rule granting it)"
                    }
                    _ => "",
                };
                DevError::setup(format!("opening {path_text}"), &e, hint)
            })?;
        // Locked before the first command: a second writer learns at once that the namespace
        // is in use, before it identifies or touches anything.
        let device_name = format!("nvme:{path_text}");
        let lock = lock::for_access(&file, config.access, &device_name)?;
        let fd = file.as_raw_fd();

        // SAFETY: NVME_IOCTL_ID takes no argument and returns the namespace id or -1.
        let nsid = unsafe { libc::ioctl(fd, NVME_IOCTL_ID) };
        if nsid <= 0 {
            let e = std::io::Error::last_os_error();
            return Err(DevError::setup(
                format!("NVME_IOCTL_ID on {path_text}"),
                &e,
                "is this an NVMe generic char device (/dev/ngXnY)?",
            ));
        }
        let nsid = nsid as u32;
        let namespace = NamespaceId::parse(&identify(fd, nsid, 0, &path_text)?).map_err(|why| {
            DevError::BadSpec {
                spec: format!("nvme:{path_text}"),
                why,
            }
        })?;
        let controller = ControllerId::parse(&identify(fd, 0, 1, &path_text)?).map_err(|why| {
            DevError::BadSpec {
                spec: format!("nvme:{path_text}"),
                why,
            }
        })?;
        if namespace.metadata_bytes != 0 {
            return Err(DevError::BadSpec {
                spec: format!("nvme:{path_text}"),
                why: format!(
                    "the namespace is formatted with {} metadata bytes per LBA; corefs needs a \
                     format without metadata (nvme format --lbaf=N)",
                    namespace.metadata_bytes
                ),
            });
        }

        let max_io_bytes = max_transfer_bytes(&path_text, &controller, config.buf_bytes);
        let poll_queues = device_has_poll_queues(path);
        let iopoll = match config.iopoll {
            IoPoll::Auto => poll_queues,
            IoPoll::On => true,
            IoPoll::Off => false,
        };
        if iopoll {
            tracing::info!("nvme:{path_text}: IOPOLL on the device's poll queues");
        } else {
            tracing::info!(
                "nvme:{path_text}: interrupt completions{}",
                if poll_queues {
                    ""
                } else {
                    " (no poll queues; load the nvme module with poll_queues=N to poll)"
                }
            );
        }

        let pool = DmaPool::new(config.buf_bytes, config.buf_count, config.hugepages)?;
        let queue_depth = config.queue_depth.next_power_of_two();
        let setup = RingSetup {
            entries: queue_depth,
            iopoll,
            sqpoll_idle_ms: None,
        };
        let mut data_ring = Ring128::new(setup, &path_text)?;
        if config.register_buffers {
            data_ring.register_pool(&pool, &path_text);
        }
        let dataless_ring = Ring128::new(
            RingSetup {
                iopoll: false,
                ..setup
            },
            &path_text,
        )?;

        Ok(PassthroughDevice {
            data_ring,
            dataless_ring,
            slots: Slots::new(queue_depth),
            resubmits: Resubmits::new(queue_depth),
            info: DeviceInfo {
                name: format!("nvme:{path_text}"),
                lba_size_bytes: namespace.lba_size_bytes,
                capacity_lbas: namespace.size_lbas,
                queue_depth,
                max_io_bytes,
                fua_native: true,
                completion_mode: if iopoll {
                    CompletionMode::Polled
                } else {
                    CompletionMode::Interrupt
                },
                // A command names one buffer (a vectored list needs a newer kernel than
                // 6.1): one range, mapped by the kernel for the command (not a fixed
                // buffer); anything else comes in a DMA buffer.
                shared_write_ranges_max: 1,
                shared_write_bytes_max: max_io_bytes,
            },
            pool,
            file,
            nsid,
            namespace,
            controller,
            failed: FailStop::default(),
            check_ranges: config.check_ranges,
            read_only,
            _lock: lock,
        })
    }

    pub fn namespace(&self) -> NamespaceId {
        self.namespace
    }
    pub fn controller(&self) -> ControllerId {
        self.controller
    }
    pub fn fixed_buffers(&self) -> bool {
        self.data_ring.fixed_buffers
    }

    /// With a sparse buffer table: pool buffers registered so far ([`crate::backend::uring_file::FileDevice::registered_bufs`]).
    pub fn registered_bufs(&self) -> Option<u32> {
        self.data_ring.registered_bufs()
    }

    /// Commands sent again after the host cancelled them (controller resets), since open.
    pub fn commands_sent_again(&self) -> u64 {
        self.resubmits.sent_again_total()
    }

    /// Sends again the cancelled commands whose backoff has passed.
    fn send_due(&mut self) -> Result<(), DevError> {
        if self.resubmits.parked() == 0 {
            return Ok(());
        }
        let mut due = Vec::new();
        self.resubmits.take_due(Instant::now(), &mut due);
        for (_slot, sqe, dataless) in due {
            let ring = if dataless {
                &mut self.dataless_ring
            } else {
                &mut self.data_ring
            };
            self.failed.on(ring.push(&sqe))?;
        }
        Ok(())
    }

    /// Builds the NVMe command for `op`. Returns the command, the data buffer address and
    /// length, and whether it goes on the data-less ring.
    fn command(&self, op: &IoOp, dsm: Option<&crate::DmaBuf>) -> (NvmeUringCmd, bool) {
        let mut cmd = NvmeUringCmd {
            nsid: self.nsid,
            ..Default::default()
        };
        let lba_size = self.info.lba_size_bytes as u64;
        let set_range = |cmd: &mut NvmeUringCmd, lba: u64, lbas: u64| {
            cmd.cdw10 = lba as u32;
            cmd.cdw11 = (lba >> 32) as u32;
            cmd.cdw12 = (lbas - 1) as u32;
        };
        match op {
            IoOp::Read { lba, buf } => {
                cmd.opcode = NVME_CMD_READ;
                cmd.addr = buf.as_ptr() as u64;
                cmd.data_len = buf.len() as u32;
                set_range(&mut cmd, *lba, buf.len() as u64 / lba_size);
                (cmd, false)
            }
            IoOp::Write { lba, buf, fua } => {
                cmd.opcode = NVME_CMD_WRITE;
                cmd.addr = buf.as_ptr() as u64;
                cmd.data_len = buf.len() as u32;
                set_range(&mut cmd, *lba, buf.len() as u64 / lba_size);
                if *fua {
                    cmd.cdw12 |= CDW12_FUA;
                }
                (cmd, false)
            }
            IoOp::WriteShared { lba, data, fua } => {
                // One memory range (more are refused at admit), which the kernel maps for
                // the command: not one of the registered buffers.
                let [(at, len)] = data.ranges()[..] else {
                    unreachable!("refused at admit: a shared write here is one range")
                };
                cmd.opcode = NVME_CMD_WRITE;
                cmd.addr = at as u64;
                cmd.data_len = len as u32;
                set_range(&mut cmd, *lba, len as u64 / lba_size);
                if *fua {
                    cmd.cdw12 |= CDW12_FUA;
                }
                (cmd, false)
            }
            IoOp::Flush => {
                cmd.opcode = NVME_CMD_FLUSH;
                (cmd, true)
            }
            IoOp::WriteZeroes { lba, lbas } => {
                cmd.opcode = NVME_CMD_WRITE_ZEROES;
                set_range(&mut cmd, *lba, *lbas as u64);
                (cmd, true)
            }
            IoOp::Deallocate { .. } => {
                let ranges = dsm.expect("a deallocate carries its range list");
                cmd.opcode = NVME_CMD_DSM;
                cmd.addr = ranges.as_ptr() as u64;
                cmd.data_len = std::mem::size_of::<DsmRange>() as u32;
                cmd.cdw10 = 0; // one range (0-based count)
                cmd.cdw11 = DSM_ATTR_DEALLOCATE;
                (cmd, false)
            }
        }
    }

    fn check_supported(&self, op: &IoOp) -> Result<(), DevError> {
        match op {
            IoOp::WriteZeroes { lbas, .. } | IoOp::Deallocate { lbas, .. } => {
                let supported = match op.kind() {
                    OpKind::WriteZeroes => self.controller.supports_write_zeroes,
                    _ => self.controller.supports_dsm,
                };
                if !supported {
                    return Err(DevError::Unsupported {
                        what: if op.kind() == OpKind::WriteZeroes {
                            "NVMe Write Zeroes"
                        } else {
                            "NVMe Dataset Management"
                        },
                    });
                }
                if *lbas as u64 > MAX_LBAS_PER_CMD {
                    return Err(DevError::BadLength {
                        len_bytes: *lbas as u64 * self.info.lba_size_bytes as u64,
                        lba_size_bytes: self.info.lba_size_bytes,
                        max_io_bytes: (MAX_LBAS_PER_CMD * self.info.lba_size_bytes as u64) as u32,
                    });
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>) -> usize {
        let mut count = 0;
        for ring in [&mut self.data_ring, &mut self.dataless_ring] {
            let mut cq = ring.ring.completion();
            cq.sync();
            for cqe in &mut cq {
                let res = cqe.result();
                // The clock is read only for a cancellation: this runs for every completion.
                if retry::cancelled_by_host(res)
                    && self
                        .resubmits
                        .park(cqe.user_data(), res, Instant::now(), &self.info.name)
                {
                    continue;
                }
                self.resubmits.forget(cqe.user_data());
                let mut slot = self.slots.release(cqe.user_data());
                let result = match res {
                    0 => Ok(()),
                    r if r < 0 => Err(DevError::Io {
                        op: slot.kind,
                        errno: -r,
                    }),
                    status => Err(DevError::Nvme {
                        op: slot.kind,
                        status: NvmeStatus(status as u16),
                    }),
                };
                if slot.internal_buf {
                    // The DSM range list goes back to the pool; the caller gave no buffer.
                    slot.buf = None;
                }
                out.push(IoCompletion {
                    token: slot.token,
                    kind: slot.kind,
                    result,
                    buf: slot.buf,
                });
                count += 1;
            }
        }
        count
    }

    fn enter_all(&mut self, want: usize, timeout: Option<Duration>) -> Result<(), DevError> {
        let in_flight = self.slots.in_flight();
        for ring in [&mut self.data_ring, &mut self.dataless_ring] {
            if ring.needs_enter(in_flight) {
                ring.enter(want, timeout)?;
            }
        }
        Ok(())
    }
}

impl BlockDevice for PassthroughDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn any_thread_io(&self) -> Option<Box<dyn crate::AnyThreadIo>> {
        // Its own open file description of the namespace (no lock: this queue holds it) and a
        // page-aligned bounce buffer the kernel maps for each command.
        let file = OpenOptions::new()
            .read(true)
            .write(!self.read_only)
            .open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
            .ok()?;
        let bounce = memmap2::MmapMut::map_anon(self.info.max_io_bytes as usize).ok()?;
        Some(Box::new(SideIo {
            file,
            nsid: self.nsid,
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
            ranges_unchecked: !self.check_ranges,
        };
        let admitted = admit(&gate, &self.info, &self.pool, &request.op)
            .and_then(|()| self.check_supported(&request.op));
        if let Err(reason) = admitted {
            return Err(Rejected { request, reason });
        }
        let dsm = match request.op {
            IoOp::Deallocate { lba, lbas } => {
                let Some(mut list) = self.pool.alloc(self.pool.buf_bytes().min(4096)) else {
                    return Err(Rejected {
                        request,
                        reason: DevError::PoolExhausted,
                    });
                };
                let range = DsmRange {
                    context_attributes: 0,
                    lbas,
                    start_lba: lba,
                };
                list.as_mut_slice()[0..4].copy_from_slice(&range.context_attributes.to_le_bytes());
                list.as_mut_slice()[4..8].copy_from_slice(&range.lbas.to_le_bytes());
                list.as_mut_slice()[8..16].copy_from_slice(&range.start_lba.to_le_bytes());
                Some(list)
            }
            _ => None,
        };
        let (cmd, dataless) = self.command(&request.op, dsm.as_ref());
        let user_data = self.slots.next_index();
        let mut uring_cmd =
            opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), NVME_URING_CMD_IO)
                .cmd(cmd.to_sqe_cmd());
        // Fixed buffers: the command's addr points into registered buffer `index`.
        let buf_index = match (&request.op, &dsm) {
            (_, Some(list)) => Some(list.index()),
            (IoOp::Read { buf, .. } | IoOp::Write { buf, .. }, None) => Some(buf.index()),
            _ => None,
        };
        if let (Some(index), false) = (buf_index, dataless) {
            self.data_ring.ensure_registered(index, &self.info.name);
        }
        if self.data_ring.fixed_buffers && !dataless {
            uring_cmd = uring_cmd.buf_index(buf_index);
        }
        let sqe = uring_cmd.build().user_data(user_data);
        let ring = if dataless {
            &mut self.dataless_ring
        } else {
            &mut self.data_ring
        };
        if let Err(reason) = self.failed.on(ring.push(&sqe)) {
            return Err(Rejected { request, reason });
        }
        self.resubmits.remember(user_data, sqe, dataless);
        let kind = request.op.kind();
        let expect_bytes = cmd.data_len;
        let internal_buf = dsm.is_some();
        // A shared write's pieces stay alive until its completion (and any resubmission).
        let held = match &request.op {
            IoOp::WriteShared { data, .. } => Some(Held::new(data.clone())),
            _ => None,
        };
        let buf = dsm.or_else(|| request.op.into_buf());
        let entry = InFlight {
            token: request.token,
            kind,
            buf,
            expect_bytes,
            internal_buf,
            held,
        };
        self.slots.take(user_data, entry);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        self.failed.check()?;
        self.send_due()?;
        let entered = self.enter_all(0, None);
        self.failed.on(entered)?;
        Ok(self.reap(out))
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        let deadline = Instant::now() + timeout;
        loop {
            let found = self.poll(out)?;
            if found > 0 || self.slots.in_flight() == 0 || Instant::now() >= deadline {
                return Ok(found);
            }
            if self.info.completion_mode == CompletionMode::Interrupt
                || self.dataless_ring.needs_enter(self.slots.in_flight())
            {
                // Interrupt-driven: sleep in the kernel on whichever ring has work. A polled
                // data ring spins in `poll` instead (polling is the point of IOPOLL).
                // A command waiting to be sent again bounds the sleep: nothing in the kernel
                // would end it.
                let until = match self.resubmits.next_due() {
                    Some(due) => deadline.min(due),
                    None => deadline,
                };
                let left = until.saturating_duration_since(Instant::now());
                let ring = if self.info.completion_mode == CompletionMode::Interrupt {
                    &mut self.data_ring
                } else {
                    &mut self.dataless_ring
                };
                let wait_here = if self.info.completion_mode == CompletionMode::Polled {
                    left.min(Duration::from_micros(50))
                } else {
                    left
                };
                self.failed.on(ring.enter(1, Some(wait_here)))?;
            }
        }
    }

    fn in_flight(&self) -> u32 {
        self.slots.in_flight()
    }

    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        // Both rings, or neither: a completion the eventfd never hears of would be found
        // only when the owner next looks for another reason.
        let name = self.info.name.clone();
        if self.data_ring.ring.params().is_setup_iopoll() {
            return false;
        }
        self.data_ring.register_eventfd(eventfd, &name)
            && self.dataless_ring.register_eventfd(eventfd, &name)
    }

    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        // The workers belong to the submitting thread, shared by both its rings: one
        // registration places them for both. Passthrough commands reach io-wq only when the
        // controller's tags run out, but then they are placed as a file's flushes are.
        self.failed.check()?;
        self.data_ring.run_workers_on(cores)
    }
}

impl Drop for PassthroughDevice {
    fn drop(&mut self) {
        if self.slots.in_flight() > 0 && self.failed.error().is_none() {
            drain_before_drop(self);
        }
        // The controller may still DMA into what is left in flight: never back to the pool.
        self.slots.leak_in_flight();
    }
}

/// Identify (admin opcode 0x06) through the admin passthrough ioctl; 4096 bytes of data.
fn identify(fd: i32, nsid: u32, cns: u32, path_text: &str) -> Result<Vec<u8>, DevError> {
    let mut data = vec![0u8; 4096];
    let mut cmd = NvmePassthruCmd {
        opcode: NVME_ADMIN_IDENTIFY,
        nsid,
        addr: data.as_mut_ptr() as u64,
        data_len: data.len() as u32,
        cdw10: cns,
        ..Default::default()
    };
    // SAFETY: the ioctl reads the 72-byte command and writes at most data_len bytes to addr,
    // which points at `data`, alive for the call.
    let rc = unsafe { libc::ioctl(fd, NVME_IOCTL_ADMIN_CMD, &mut cmd) };
    match rc {
        0 => Ok(data),
        rc if rc < 0 => Err(DevError::setup(
            format!("Identify (CNS {cns}) on {path_text}"),
            &std::io::Error::last_os_error(),
            "admin passthrough needs CAP_SYS_ADMIN",
        )),
        status => Err(DevError::BadSpec {
            spec: format!("nvme:{path_text}"),
            why: format!(
                "Identify (CNS {cns}) failed with {}",
                NvmeStatus(status as u16)
            ),
        }),
    }
}

/// The largest transfer: the DMA buffer size, capped by the controller's MDTS (in units of the
/// 4 KiB minimum page size) and by the block layer's limit, which passthrough also obeys.
fn max_transfer_bytes(path_text: &str, controller: &ControllerId, buf_bytes: usize) -> u32 {
    let mut max = buf_bytes as u64;
    if controller.mdts != 0 && controller.mdts < 32 {
        max = max.min(4096u64 << controller.mdts);
    }
    if let Some(kb) = sysfs_block_attr(Path::new(path_text), "max_hw_sectors_kb")
        .and_then(|s| s.parse::<u64>().ok())
    {
        // Saturating: the value is the kernel's, but a size from outside is never trusted to
        // fit.
        max = max.min(kb.saturating_mul(1024));
    }
    // At most buf_bytes, which open checked against BUF_BYTES_MAX.
    u32::try_from(max).unwrap_or(u32::MAX)
}

/// Reads `/sys/block/nvmeXnY/queue/ATTR` for the namespace behind `/dev/ngXnY`.
fn sysfs_block_attr(path: &Path, attr: &str) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let block = name.strip_prefix("ng").map(|rest| format!("nvme{rest}"))?;
    std::fs::read_to_string(format!("/sys/block/{block}/queue/{attr}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether the namespace's queue polls (the driver has poll queues).
fn device_has_poll_queues(path: &Path) -> bool {
    sysfs_block_attr(path, "io_poll").as_deref() == Some("1")
}

trait CloexecExt {
    fn custom_flags_cloexec(&mut self) -> &mut Self;
}
impl CloexecExt for OpenOptions {
    fn custom_flags_cloexec(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_CLOEXEC)
    }
}

/// [`BlockDevice::any_thread_io`] of a passthrough namespace: each read, write and flush one
/// synchronous I/O command (`NVME_IOCTL_IO_CMD`) on its own descriptor, through a bounce
/// buffer. FUA is the command's own bit, as on the rings. An NVMe error status is reported
/// by name, as the rings report it.
struct SideIo {
    file: File,
    nsid: u32,
    bounce: memmap2::MmapMut,
    info: DeviceInfo,
    read_only: bool,
}

impl SideIo {
    /// One command of `len` bytes at `lba` through the bounce buffer (none for a flush).
    fn command(
        &mut self,
        op: OpKind,
        opcode: u8,
        lba: u64,
        len: usize,
        cdw12_flags: u32,
    ) -> Result<(), DevError> {
        let lbas = (len / self.info.lba_size_bytes as usize) as u32;
        let mut cmd = NvmePassthruCmd {
            opcode,
            nsid: self.nsid,
            ..Default::default()
        };
        if len > 0 {
            cmd.addr = self.bounce.as_mut_ptr() as u64;
            cmd.data_len = len as u32;
            cmd.cdw10 = lba as u32;
            cmd.cdw11 = (lba >> 32) as u32;
            cmd.cdw12 = (lbas - 1) | cdw12_flags;
        }
        // A command the host cancelled (a controller reset) is sent again as the queue's are
        // ([`retry`]). The ioctl's wait is uninterruptible: its EINTR is the driver's.
        let mut attempts = retry::Attempts::default();
        loop {
            // SAFETY: the ioctl reads the 72-byte command and transfers at most `data_len`
            // bytes at `addr`, the bounce buffer, alive and unaliased for the call.
            let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), NVME_IOCTL_IO_CMD, &mut cmd) };
            let res = match rc {
                rc if rc < 0 => -std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO),
                status => status,
            };
            if let Some(wait) = attempts.again_after(res, Instant::now()) {
                if attempts.count() == 1 {
                    tracing::warn!(
                        "{}: the host cancelled a command beside the queue (status {res}); \
                         sending it again",
                        self.info.name
                    );
                }
                std::thread::sleep(wait);
                continue;
            }
            return match res {
                0 => Ok(()),
                res if res < 0 => Err(DevError::Io { op, errno: -res }),
                status => Err(DevError::Nvme {
                    op,
                    status: NvmeStatus(status as u16),
                }),
            };
        }
    }
}

impl crate::AnyThreadIo for SideIo {
    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<(), DevError> {
        crate::check_any_thread_io(&self.info, lba, out.len())?;
        self.command(OpKind::Read, NVME_CMD_READ, lba, out.len(), 0)?;
        out.copy_from_slice(&self.bounce[..out.len()]);
        Ok(())
    }

    fn writes(&self) -> bool {
        !self.read_only
    }

    fn write_at(&mut self, lba: u64, data: &[u8], fua: bool) -> Result<(), DevError> {
        crate::check_any_thread_write(&self.info, self.read_only, lba, data.len())?;
        self.bounce[..data.len()].copy_from_slice(data);
        let flags = if fua { CDW12_FUA } else { 0 };
        self.command(OpKind::Write, NVME_CMD_WRITE, lba, data.len(), flags)
    }

    fn flush(&mut self) -> Result<(), DevError> {
        self.command(OpKind::Flush, NVME_CMD_FLUSH, 0, 0, 0)
    }
}
