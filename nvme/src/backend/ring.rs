//! What the two io_uring backends share: building a ring with the best flags the kernel takes,
//! registering the DMA pool, entering the kernel only when there is something to do, and
//! draining in-flight requests before the memory they point at can be reused.
//!
//! Fault model: `io_uring_enter` failing with anything but EINTR/EAGAIN/EBUSY/ETIME means the
//! ring is unusable; the caller makes the error sticky ([`FailStop`], `DevError::QueueFailed`).

use crate::DevError;
use io_uring::{cqueue, squeue, IoUring};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A queue's fail-stop state: once a push or an `io_uring_enter` fails, the queue refuses
/// every later submit, poll and wait with that error, since what the kernel did with the
/// requests in flight is unknown.
#[derive(Debug, Default)]
pub(crate) struct FailStop(Option<DevError>);

impl FailStop {
    /// The error the queue failed with, if it has.
    pub fn error(&self) -> Option<&DevError> {
        self.0.as_ref()
    }

    /// Err with the error the queue failed with, if it has.
    pub fn check(&self) -> Result<(), DevError> {
        match &self.0 {
            Some(failed) => Err(failed.clone()),
            None => Ok(()),
        }
    }

    /// Passes `result` on; an error fails the queue for good.
    pub fn on<T>(&mut self, result: Result<T, DevError>) -> Result<T, DevError> {
        if let Err(e) = &result {
            self.0 = Some(e.clone());
        }
        result
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RingSetup {
    pub entries: u32,
    pub iopoll: bool,
    /// Kernel submission-queue polling thread, with its idle time before it sleeps.
    pub sqpoll_idle_ms: Option<u32>,
}

pub(crate) struct Ring<S: squeue::EntryMarker, C: cqueue::EntryMarker> {
    pub ring: IoUring<S, C>,
    /// SQEs pushed but not yet handed to the kernel.
    unsubmitted: u32,
    /// The kernel raises IORING_SQ_TASKRUN when completions wait for us to enter; without the
    /// flag we must enter whenever something is in flight.
    taskrun_flag: bool,
    /// False until the owning thread enables a ring created disabled (deferred task run).
    enabled: bool,
    pub fixed_buffers: bool,
    /// With a sparse table ([`Ring::register_pool`]): the pool whose buffers are registered
    /// as they are first used, and how many (from index 0) are so far.
    sparse_pool: Option<crate::DmaPool>,
    registered_bufs: u32,
    /// The device's descriptor is registered as fixed file 0 ([`Ring::register_file`]).
    pub fixed_file: bool,
    /// The submitting thread has an io_uring context (it has submitted): io-wq can be placed
    /// without a no-op first ([`Ring::run_workers_on`]).
    io_context: bool,
}

/// How the kernel runs completion work for a ring, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskRun {
    /// IORING_SETUP_DEFER_TASKRUN + SINGLE_ISSUER (Linux 6.1).
    Deferred,
    /// IORING_SETUP_COOP_TASKRUN (Linux 5.19).
    Cooperative,
    Plain,
}

static WARNED_REGISTER: AtomicBool = AtomicBool::new(false);

impl<S: squeue::EntryMarker, C: cqueue::EntryMarker> Ring<S, C> {
    pub fn new(setup: RingSetup, what: &str) -> Result<Self, DevError> {
        let entries = setup.entries.next_power_of_two().max(2);
        let build = |mode: TaskRun| {
            let mut builder = IoUring::<S, C>::builder();
            builder.setup_cqsize(entries * 2);
            if setup.iopoll {
                builder.setup_iopoll();
            }
            if let Some(idle_ms) = setup.sqpoll_idle_ms {
                builder.setup_sqpoll(idle_ms);
            }
            match mode {
                // Completions are queued to this ring's own thread and run only when it enters
                // with GETEVENTS: no IPIs and no wake-ups of a polling reactor, which is what a
                // queue owned by one thread wants. The ring starts disabled so that the thread
                // that first submits, not the one that opened the device, becomes its issuer.
                TaskRun::Deferred => {
                    builder
                        .setup_single_issuer()
                        .setup_defer_taskrun()
                        .setup_taskrun_flag()
                        .setup_r_disabled();
                }
                // Completions run as task work only when we enter the kernel; the TASKRUN flag
                // tells us when an enter is worth it.
                TaskRun::Cooperative => {
                    builder.setup_coop_taskrun().setup_taskrun_flag();
                }
                TaskRun::Plain => {}
            }
            builder.build(entries).map(|ring| (ring, mode))
        };
        let deferred_ok = setup.sqpoll_idle_ms.is_none() && !setup.iopoll;
        let first = if deferred_ok {
            TaskRun::Deferred
        } else {
            TaskRun::Cooperative
        };
        let mut result = build(first);
        for fallback in [TaskRun::Cooperative, TaskRun::Plain] {
            match &result {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && fallback != first => {
                    tracing::debug!("{what}: kernel refused io_uring task-run mode {first:?}; trying {fallback:?}");
                    result = build(fallback);
                }
                _ => {}
            }
        }
        let (ring, mode) = result.map_err(|e| ring_error(what, &e))?;
        if mode == TaskRun::Plain {
            tracing::info!(
                "{what}: kernel lacks IORING_SETUP_COOP_TASKRUN (5.19+); entering on every poll"
            );
        }
        Ok(Ring {
            ring,
            unsubmitted: 0,
            taskrun_flag: mode != TaskRun::Plain,
            enabled: mode != TaskRun::Deferred,
            fixed_buffers: false,
            sparse_pool: None,
            registered_bufs: 0,
            fixed_file: false,
            io_context: false,
        })
    }

    /// A deferred-task-run ring is bound to the first thread that submits: enable it there.
    fn enable_here(&mut self) -> Result<(), DevError> {
        if !self.enabled {
            self.ring
                .submitter()
                .register_enable_rings()
                .map_err(|e| DevError::QueueFailed {
                    errno: e.raw_os_error().unwrap_or(libc::EIO),
                })?;
            self.enabled = true;
        }
        Ok(())
    }

    /// Makes each pool buffer the fixed buffer of the same index. The table is registered
    /// sparse (Linux 5.19+), empty, and filled a 2 MiB chunk at a time as buffers are first
    /// used ([`Ring::ensure_registered`]): registering pins the memory, which faults it in,
    /// so a whole pool registered at open cost its every page whether the queue ever used
    /// it or not. A kernel without sparse tables gets the whole pool at once. Failure
    /// (RLIMIT_MEMLOCK, an old kernel) is not fatal: I/O then goes through unregistered
    /// buffers, and we say so once.
    pub fn register_pool(&mut self, pool: &crate::DmaPool, what: &str) {
        if self
            .ring
            .submitter()
            .register_buffers_sparse(pool.buf_count())
            .is_ok()
        {
            self.fixed_buffers = true;
            self.sparse_pool = Some(pool.clone());
            self.registered_bufs = 0;
            return;
        }
        let iovecs = pool.iovecs();
        // SAFETY: the slab stays mapped for as long as the pool lives, and every device holding
        // this ring also holds a clone of the pool, dropped after the ring (field order) and
        // after all in-flight I/O has drained (`drain_before_drop`).
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => self.fixed_buffers = true,
            Err(e) => {
                if !WARNED_REGISTER.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{what}: registering the {} MiB DMA pool failed ({}); using unregistered \
                         buffers (one page-pinning per I/O). Raise the locked-memory limit \
                         (ulimit -l unlimited, or LimitMEMLOCK=infinity) or run with CAP_IPC_LOCK",
                        (pool.buf_bytes() * pool.buf_count() as usize) >> 20,
                        crate::error::errno_name(e.raw_os_error().unwrap_or(0))
                    );
                }
            }
        }
    }

    /// Registers buffer `index` (and every one before it not registered yet, to the end of
    /// its 2 MiB chunk) before a request names it as a fixed buffer. A registration the
    /// kernel refuses (the locked-memory limit reached) turns fixed buffers off for the
    /// requests to come: they name their memory plainly, which works for every buffer.
    pub fn ensure_registered(&mut self, index: u16, what: &str) {
        let Some(pool) = &self.sparse_pool else {
            return;
        };
        let index = u32::from(index);
        if index < self.registered_bufs {
            return;
        }
        let chunk = pool.bufs_per_chunk();
        let end = ((index / chunk + 1) * chunk).min(pool.buf_count());
        let iovecs = pool.iovecs_of(self.registered_bufs..end);
        // SAFETY: as in `register_pool`: the slab outlives the ring and the requests in
        // flight, and slots at and past `registered_bufs` are named by no request yet.
        match unsafe {
            self.ring
                .submitter()
                .register_buffers_update(self.registered_bufs, &iovecs, None)
        } {
            Ok(()) => self.registered_bufs = end,
            Err(e) => {
                if !WARNED_REGISTER.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{what}: registering DMA buffers {}..{end} failed ({}); using \
                         unregistered buffers from now on (one page-pinning per I/O). Raise \
                         the locked-memory limit (ulimit -l unlimited, or \
                         LimitMEMLOCK=infinity) or run with CAP_IPC_LOCK",
                        self.registered_bufs,
                        crate::error::errno_name(e.raw_os_error().unwrap_or(0))
                    );
                }
                self.fixed_buffers = false;
                self.sparse_pool = None;
            }
        }
    }

    /// With a sparse table, the pool buffers registered so far; `None` when the whole pool
    /// was registered at open, or none of it is.
    pub fn registered_bufs(&self) -> Option<u32> {
        self.sparse_pool.as_ref().map(|_| self.registered_bufs)
    }

    /// Registers `fd` as fixed file 0, so each request names it by index and the kernel
    /// skips looking the descriptor up and counting a reference per I/O (`fget`/`fput`, about
    /// 1% of a reactor's time at 100k reads per second). Failure (an old kernel, a file
    /// table limit) is not fatal: requests then name the descriptor itself.
    pub fn register_file(&mut self, fd: std::os::fd::RawFd, what: &str) {
        match self.ring.submitter().register_files(&[fd]) {
            Ok(()) => self.fixed_file = true,
            Err(e) => {
                tracing::debug!(device = what, error = %e, "descriptor not registered with the ring; requests name it directly");
            }
        }
    }

    /// Has io-wq, the kernel's workers for the blocking requests of the calling thread's
    /// rings, run on `cores` (`IORING_REGISTER_IOWQ_AFF` for the workers to come, and
    /// `sched_setaffinity` for those already running). The registration needs the thread's
    /// io_uring context, which its first submission creates: before any, a no-op is submitted
    /// and reaped here (the completion queue must then hold nothing else). A worker is born
    /// with the cores the registration names *and* the submitting thread's own affinity where
    /// they meet (Linux 6.2+ keeps a thread's requested affinity through later changes), so a
    /// thread pinned to one core gets workers elsewhere only by naming cores it is not pinned
    /// to. `Ok(false)`: no core below the 1024 a `cpu_set_t` holds, or the kernel refused (an
    /// older one, or cores outside the thread's cpuset) — said in the log once, not fatal,
    /// since the workers then run where they would have anyway.
    pub fn run_workers_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        const NOP_USER_DATA: u64 = u64::MAX;
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let set_bytes = std::mem::size_of::<libc::cpu_set_t>();
        let mut any = false;
        {
            // SAFETY: `set` is `set_bytes` long and nothing else refers to it meanwhile.
            let bits = unsafe {
                std::slice::from_raw_parts_mut(
                    (&mut set as *mut libc::cpu_set_t).cast::<u8>(),
                    set_bytes,
                )
            };
            // Bits by hand: libc's CPU_SET indexes its array unchecked.
            for &core in cores.iter().filter(|&&core| core < set_bytes * 8) {
                bits[core / 8] |= 1 << (core % 8);
                any = true;
            }
        }
        if !any {
            return Ok(false);
        }
        if !self.io_context {
            assert_eq!(
                self.unsubmitted, 0,
                "io-wq placed before the first submission"
            );
            assert!(
                self.ring.completion().is_empty(),
                "io-wq placed before the first completion"
            );
            let nop = io_uring::opcode::Nop::new()
                .build()
                .user_data(NOP_USER_DATA);
            self.push(&S::from(nop))?;
            while self.ring.completion().is_empty() {
                self.enter(1, None)?;
            }
            let cqe = self
                .ring
                .completion()
                .next()
                .expect("a completion is there");
            assert_eq!(
                cqe.user_data(),
                NOP_USER_DATA,
                "only the no-op was in flight"
            );
        }
        if let Err(e) = self.ring.submitter().register_iowq_aff(&set) {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    "the kernel's io_uring workers stay where they were born ({e}): a blocking \
                     request (a file image's flush) may wait for a pinned reactor's time slice"
                );
            }
            return Ok(false);
        }
        // Workers already running keep the cores they were born with: move them too. They
        // are this thread's (`iou-wrk-<its thread id>`, as io-wq names them); one that ends
        // meanwhile is simply not found.
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        let name = format!("iou-wrk-{me}");
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                let is_ours = std::fs::read_to_string(task.path().join("comm"))
                    .is_ok_and(|comm| comm.trim_end() == name);
                let tid = task
                    .file_name()
                    .to_str()
                    .and_then(|t| t.parse::<libc::pid_t>().ok());
                if let (true, Some(tid)) = (is_ours, tid) {
                    // SAFETY: `set` is a valid cpu_set_t of the size passed. A refusal leaves
                    // that worker where it was, which is only slower.
                    unsafe { libc::sched_setaffinity(tid, set_bytes, &set) };
                }
            }
        }
        Ok(true)
    }

    /// Queues one SQE; the ring's SQ has as many entries as the queue depth, and the caller never
    /// has more than that in flight, so a full SQ only means we must hand entries to the kernel.
    pub fn push(&mut self, sqe: &S) -> Result<(), DevError> {
        self.enable_here()?;
        // SAFETY: every pointer in the SQE refers to a buffer (or command block) that the in-flight
        // slot owns until the CQE is reaped.
        if unsafe { self.ring.submission().push(sqe) }.is_err() {
            self.enter(0, None)?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(sqe) }.map_err(|_| DevError::QueueFull)?;
        }
        self.unsubmitted += 1;
        Ok(())
    }

    /// True when entering the kernel would do something: submit, run completion task work, or
    /// poll an IOPOLL ring.
    pub fn needs_enter(&mut self, in_flight: u32) -> bool {
        if self.unsubmitted > 0 {
            return true;
        }
        if in_flight == 0 {
            return false;
        }
        if self.ring.params().is_setup_iopoll() || !self.taskrun_flag {
            return true;
        }
        self.ring.submission().taskrun()
    }

    /// Has the kernel signal `eventfd` for every completion this ring posts (with deferred
    /// task running too: the kernel signals when the completion is queued for this thread).
    /// False when the ring is polled (nothing posts a completion until we poll) or the kernel
    /// refused.
    pub fn register_eventfd(&mut self, eventfd: std::os::fd::RawFd, what: &str) -> bool {
        if self.ring.params().is_setup_iopoll() {
            return false;
        }
        match self.ring.submitter().register_eventfd(eventfd) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(device = what, error = %e, "completion eventfd not registered: the owner polls in slices instead");
                false
            }
        }
    }

    /// Submits what is queued and, with `want` > 0, waits for that many completions or the
    /// timeout. EINTR, EAGAIN, EBUSY and ETIME are transient: the caller polls again.
    pub fn enter(&mut self, want: usize, timeout: Option<Duration>) -> Result<(), DevError> {
        self.enable_here()?;
        let result = match timeout {
            Some(timeout) if want > 0 && !self.ring.params().is_setup_iopoll() => {
                let ts = io_uring::types::Timespec::from(timeout);
                let args = io_uring::types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(want, &args)
            }
            _ => self.ring.submit_and_wait(want),
        };
        match result {
            Ok(_) => {
                self.io_context = true;
                self.unsubmitted = self.ring.submission().len() as u32;
                Ok(())
            }
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY | libc::ETIME) => {
                    self.unsubmitted = self.ring.submission().len() as u32;
                    Ok(())
                }
                Some(libc::EEXIST) => {
                    tracing::error!("an io_uring queue was used from a second thread; a queue belongs to the thread that first submitted to it");
                    Err(DevError::QueueFailed {
                        errno: libc::EEXIST,
                    })
                }
                Some(errno) => Err(DevError::QueueFailed { errno }),
                None => Err(DevError::QueueFailed { errno: libc::EIO }),
            },
        }
    }
}

fn ring_error(what: &str, e: &std::io::Error) -> DevError {
    let hint = match e.raw_os_error() {
        Some(libc::ENOSYS) => "this kernel has no io_uring (5.19+ needed)",
        Some(libc::EPERM) => {
            "io_uring is disabled: set sysctl kernel.io_uring_disabled=0 (or add this user to \
             kernel.io_uring_group)"
        }
        Some(libc::ENOMEM) => {
            "raise the locked-memory limit (ulimit -l) or use a smaller queue depth"
        }
        Some(libc::EINVAL) => {
            "this kernel lacks a ring feature corefs needs (5.19+ for NVMe passthrough)"
        }
        _ => "",
    };
    DevError::setup(format!("creating the io_uring for {what}"), e, hint)
}

/// Waits until nothing is in flight, so no buffer is reused while the kernel may still DMA
/// into it. If the device will not finish (a hung controller), this gives up after 30 s and
/// says so; the caller then leaks what is still in flight
/// ([`super::slots::Slots::leak_in_flight`]).
pub(crate) fn drain_before_drop(dev: &mut dyn crate::BlockDevice) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut sink = Vec::new();
    while dev.in_flight() > 0 && std::time::Instant::now() < deadline {
        if dev.wait(&mut sink, Duration::from_millis(100)).is_err() {
            break;
        }
        sink.clear();
    }
    if dev.in_flight() > 0 {
        tracing::error!(
            "{}: {} requests still in flight at close; leaking their buffers",
            dev.info().name,
            dev.in_flight()
        );
    }
}
