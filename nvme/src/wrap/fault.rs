//! The fault wrapper: seeded, replayable fault injection over any device.
//!
//! Faults (each a probability per operation, all from one seeded generator):
//! - EIO on read, write or flush (the op never reaches the device);
//! - bit rot: a read LBA gets one flipped bit, persistently — a retry returns the same wrong
//!   data, until the LBA is rewritten;
//! - misdirected writes: the data lands at another LBA, the target keeps its old data, and the
//!   write reports success;
//! - lost writes: acknowledged, never stored;
//! - ignored flushes: acknowledged, nothing made durable (visible at the next simulated crash);
//! - latency spikes: a completion is held back for a while, without error.
//!
//! A simulated power cut ([`FaultDevice::crash`]) needs a device with [`SimAccess`] (memory):
//! writes since the last honoured flush are each kept, dropped, torn at LBA granularity, or
//! (one of them) left with a garbage LBA. The seed is logged at creation and kept in
//! [`FaultDevice::seed`], so a failing run replays.

use super::TokenTable;
use crate::{
    BlockDevice, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, OpKind, Rejected, Request,
    SimAccess,
};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Fault probabilities, each per operation of the kind named. All zero by default.
#[derive(Debug, Clone, Default)]
pub struct FaultConfig {
    pub seed: u64,
    pub read_eio: f64,
    pub write_eio: f64,
    pub flush_eio: f64,
    pub read_bitrot: f64,
    pub misdirected_write: f64,
    pub lost_write: f64,
    pub ignored_flush: f64,
    pub latency_spike: f64,
    pub latency_spike_duration: Duration,
    /// Track unflushed writes so [`FaultDevice::crash`] can undo them (needs a memory device).
    pub crash_model: bool,
}

/// What was injected so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultStats {
    pub eio: u64,
    pub bitrot: u64,
    pub misdirected: u64,
    pub lost: u64,
    pub ignored_flushes: u64,
    pub delayed: u64,
    pub crashes: u64,
    pub dropped_at_crash: u64,
    pub torn_at_crash: u64,
    pub corrupted_at_crash: u64,
}

struct Pending {
    caller_token: u64,
    kind: OpKind,
    lba: u64,
    /// For a flush: how many unflushed writes it covers (those completed before it was sent).
    covers: usize,
    ignored: bool,
}

/// A write the device acknowledged but no flush has made durable yet, with what it replaced.
struct Unflushed {
    lba: u64,
    before: Vec<u8>,
}

pub struct FaultDevice<D: BlockDevice> {
    inner: D,
    config: FaultConfig,
    rng: Xoshiro256PlusPlus,
    pending: TokenTable<Pending>,
    /// Completions synthesized here (EIO, lost writes) or held back (latency).
    ready: VecDeque<(Instant, IoCompletion)>,
    rotten: HashMap<u64, u32>,
    unflushed: Vec<Unflushed>,
    stats: FaultStats,
    /// One-shot failures requested by a test, by op kind: the next N ops of that kind fail.
    /// Shared with [`FaultHandle`]s so a test can arm them while the device is owned elsewhere.
    fail_next: Arc<Mutex<HashMap<OpKind, u32>>>,
    /// One-shot latency spikes requested by a test, by op kind: (count, how long).
    delay_next: DelayNext,
    /// Set by a test to end every latency spike held now ([`FaultHandle::end_delays`]).
    end_delays: Arc<std::sync::atomic::AtomicBool>,
}

type DelayNext = Arc<Mutex<HashMap<OpKind, (u32, Duration)>>>;

/// Arms one-shot faults on a [`FaultDevice`] that something else owns (a mounted filesystem).
#[derive(Clone)]
pub struct FaultHandle {
    fail_next: Arc<Mutex<HashMap<OpKind, u32>>>,
    /// One-shot latency spikes requested by a test, by op kind: (count, how long).
    delay_next: DelayNext,
    /// Set by a test to end every latency spike held now ([`FaultHandle::end_delays`]).
    end_delays: Arc<std::sync::atomic::AtomicBool>,
}

impl FaultHandle {
    /// Makes the next `count` operations of `kind` fail with EIO.
    pub fn fail_next(&self, kind: OpKind, count: u32) {
        *self
            .fail_next
            .lock()
            .expect("fault handle lock")
            .entry(kind)
            .or_default() += count;
    }

    /// Ends every latency spike now: held completions are handed out at the next poll, and
    /// spikes armed for later operations ([`FaultHandle::delay_next`]) are disarmed. A test
    /// holds requests with a long spike and ends it when it has seen what it wanted, so no
    /// assertion depends on how fast a loaded machine runs.
    pub fn end_delays(&self) {
        self.delay_next.lock().expect("fault handle lock").clear();
        self.end_delays
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Holds back the completions of the next `count` operations of `kind` by `delay` each
    /// (a latency spike on demand; the operation itself succeeds).
    pub fn delay_next(&self, kind: OpKind, count: u32, delay: Duration) {
        self.delay_next
            .lock()
            .expect("fault handle lock")
            .insert(kind, (count, delay));
    }
}

impl<D: BlockDevice> FaultDevice<D> {
    pub fn new(inner: D, config: FaultConfig) -> Self {
        tracing::info!(
            seed = config.seed,
            "fault injection seeded with {}",
            config.seed
        );
        let depth = inner.info().queue_depth;
        FaultDevice {
            rng: Xoshiro256PlusPlus::seed_from_u64(config.seed),
            inner,
            config,
            pending: TokenTable::new(depth),
            ready: VecDeque::with_capacity(depth as usize),
            rotten: HashMap::new(),
            unflushed: Vec::new(),
            stats: FaultStats::default(),
            fail_next: Arc::new(Mutex::new(HashMap::new())),
            delay_next: Arc::new(Mutex::new(HashMap::new())),
            end_delays: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// A handle that arms one-shot faults from outside.
    pub fn handle(&self) -> FaultHandle {
        FaultHandle {
            fail_next: Arc::clone(&self.fail_next),
            delay_next: Arc::clone(&self.delay_next),
            end_delays: Arc::clone(&self.end_delays),
        }
    }

    pub fn seed(&self) -> u64 {
        self.config.seed
    }
    pub fn stats(&self) -> &FaultStats {
        &self.stats
    }
    pub fn inner(&self) -> &D {
        &self.inner
    }
    pub fn inner_mut(&mut self) -> &mut D {
        &mut self.inner
    }
    pub fn set_config(&mut self, config: FaultConfig) {
        self.config.read_eio = config.read_eio;
        self.config.write_eio = config.write_eio;
        self.config.flush_eio = config.flush_eio;
        self.config.read_bitrot = config.read_bitrot;
        self.config.misdirected_write = config.misdirected_write;
        self.config.lost_write = config.lost_write;
        self.config.ignored_flush = config.ignored_flush;
        self.config.latency_spike = config.latency_spike;
        self.config.latency_spike_duration = config.latency_spike_duration;
    }

    /// Makes the next `count` operations of `kind` fail with EIO.
    pub fn fail_next(&mut self, kind: OpKind, count: u32) {
        self.handle().fail_next(kind, count);
    }

    /// Marks one bit of `lba` as rotten: every read of it returns the bit flipped until it is
    /// rewritten.
    pub fn rot(&mut self, lba: u64, bit: u32) {
        self.rotten
            .insert(lba, bit % (self.inner.info().lba_size_bytes * 8));
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.random_bool(p.min(1.0))
    }

    fn take_one_shot(&mut self, kind: OpKind) -> bool {
        match self
            .fail_next
            .lock()
            .expect("fault handle lock")
            .get_mut(&kind)
        {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    /// Captures what a write or zeroing is about to replace, for the crash model.
    fn remember_before(&mut self, lba: u64, lbas: u64) {
        if !self.config.crash_model {
            return;
        }
        let lba_size = self.inner.info().lba_size_bytes as usize;
        let sim = self
            .inner
            .sim_access()
            .expect("FaultConfig::crash_model needs a device with SimAccess (memory)");
        let mut before = vec![0u8; lbas as usize * lba_size];
        sim.sim_read(lba, &mut before);
        self.unflushed.push(Unflushed { lba, before });
    }

    /// A simulated power cut: each write since the last honoured flush is kept, dropped or torn
    /// (LBA granularity), and one may be left with a garbage LBA. Requests in flight are
    /// completed with an error first. Returns how many unflushed writes there were.
    pub fn crash(&mut self) -> usize {
        assert!(
            self.config.crash_model,
            "crash() needs FaultConfig::crash_model"
        );
        let lba_size = self.inner.info().lba_size_bytes as usize;
        let mut sink = Vec::new();
        while self.inner.in_flight() > 0 {
            let _ = self.inner.wait(&mut sink, Duration::from_millis(10));
        }
        for c in sink.drain(..) {
            self.pending.remove(c.token);
        }
        self.ready.clear();
        let unflushed = std::mem::take(&mut self.unflushed);
        let count = unflushed.len();
        let corrupt_index =
            (count > 0 && self.rng.random_bool(0.25)).then(|| self.rng.random_range(0..count));
        // Undo newest first; an LBA a kept later write owns is never rolled back under it.
        let mut owned_by_later: HashSet<u64> = HashSet::new();
        for (index, write) in unflushed.iter().enumerate().rev() {
            let lbas = (write.before.len() / lba_size) as u64;
            let fate = self.rng.random_range(0..3u32); // 0 keep, 1 drop, 2 tear
            let mut torn = false;
            for block in 0..lbas {
                let lba = write.lba + block;
                let undo = match fate {
                    0 => false,
                    1 => true,
                    _ => self.rng.random_bool(0.5),
                };
                if undo && !owned_by_later.contains(&lba) {
                    let at = block as usize * lba_size;
                    let sim = self.inner.sim_access().expect("crash model has SimAccess");
                    sim.sim_write(lba, &write.before[at..at + lba_size]);
                    torn |= fate == 2;
                } else {
                    owned_by_later.insert(lba);
                }
            }
            match fate {
                1 => self.stats.dropped_at_crash += 1,
                2 if torn => self.stats.torn_at_crash += 1,
                _ => {}
            }
            if corrupt_index == Some(index) {
                let lba = write.lba + self.rng.random_range(0..lbas);
                let mut garbage = vec![0u8; lba_size];
                self.rng.fill(&mut garbage[..]);
                self.inner
                    .sim_access()
                    .expect("crash model has SimAccess")
                    .sim_write(lba, &garbage);
                self.stats.corrupted_at_crash += 1;
            }
        }
        self.stats.crashes += 1;
        count
    }

    fn synthesize(
        &mut self,
        token: u64,
        kind: OpKind,
        result: Result<(), DevError>,
        buf: Option<crate::DmaBuf>,
    ) {
        self.ready.push_back((
            Instant::now(),
            IoCompletion {
                token,
                kind,
                result,
                buf,
            },
        ));
    }

    /// Applies read-side faults and bookkeeping to completions from the inner device.
    fn finish(&mut self, mut completion: IoCompletion, now: Instant) {
        let pending = self.pending.remove(completion.token);
        completion.token = pending.caller_token;
        let lba_size = self.inner.info().lba_size_bytes as u64;
        if completion.result.is_ok() {
            match pending.kind {
                OpKind::Read => {
                    if let Some(buf) = completion.buf.as_mut() {
                        let lbas = buf.len() as u64 / lba_size;
                        if self.chance(self.config.read_bitrot) {
                            let lba = pending.lba + self.rng.random_range(0..lbas);
                            let bit = self.rng.random_range(0..lba_size as u32 * 8);
                            self.rotten.insert(lba, bit);
                            self.stats.bitrot += 1;
                        }
                        for block in 0..lbas {
                            if let Some(&bit) = self.rotten.get(&(pending.lba + block)) {
                                let at = (block * lba_size) as usize + (bit / 8) as usize;
                                buf.as_mut_slice()[at] ^= 1 << (bit % 8);
                            }
                        }
                    }
                }
                OpKind::Flush if !pending.ignored => {
                    let covers = pending.covers.min(self.unflushed.len());
                    self.unflushed.drain(..covers);
                }
                _ => {}
            }
        }
        let armed = match self
            .delay_next
            .lock()
            .expect("fault handle lock")
            .get_mut(&pending.kind)
        {
            Some((n, delay)) if *n > 0 => {
                *n -= 1;
                Some(*delay)
            }
            _ => None,
        };
        let at = if let Some(delay) = armed {
            self.stats.delayed += 1;
            now + delay
        } else if self.chance(self.config.latency_spike) {
            self.stats.delayed += 1;
            now + self.config.latency_spike_duration
        } else {
            now
        };
        self.ready.push_back((at, completion));
    }

    fn release_ready(&mut self, out: &mut Vec<IoCompletion>, now: Instant) -> usize {
        if self
            .end_delays
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            for (at, _) in self.ready.iter_mut() {
                *at = now;
            }
        }
        let mut count = 0;
        let mut held = 0;
        while held < self.ready.len() {
            if self.ready[held].0 <= now {
                let (_, completion) = self.ready.remove(held).expect("index checked");
                out.push(completion);
                count += 1;
            } else {
                held += 1;
            }
        }
        count
    }

    fn collect(&mut self, from_inner: Vec<IoCompletion>, out: &mut Vec<IoCompletion>) -> usize {
        let now = Instant::now();
        for completion in from_inner {
            self.finish(completion, now);
        }
        self.release_ready(out, now)
    }
}

impl<D: BlockDevice> BlockDevice for FaultDevice<D> {
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        if self.in_flight() >= self.info().queue_depth {
            return Err(Rejected {
                request,
                reason: DevError::QueueFull,
            });
        }
        if let Err(reason) = crate::validate(self.inner.info(), self.inner.pool(), &request.op) {
            return Err(Rejected { request, reason });
        }
        let kind = request.op.kind();
        let caller_token = request.token;
        let eio_chance = match kind {
            OpKind::Read => self.config.read_eio,
            OpKind::Flush => self.config.flush_eio,
            _ => self.config.write_eio,
        };
        if self.take_one_shot(kind) || self.chance(eio_chance) {
            self.stats.eio += 1;
            let buf = request.op.into_buf();
            self.synthesize(
                caller_token,
                kind,
                Err(DevError::Io {
                    op: kind,
                    errno: libc::EIO,
                }),
                buf,
            );
            return Ok(());
        }

        let mut op = request.op;
        let mut lba = 0;
        let mut covers = 0;
        let mut ignored = false;
        let capacity = self.inner.info().capacity_lbas;
        let lba_size = self.inner.info().lba_size_bytes;
        let transfer_bytes = op.transfer_bytes();
        match &mut op {
            IoOp::Write {
                lba: target, fua, ..
            }
            | IoOp::WriteShared {
                lba: target, fua, ..
            } => {
                if self.chance(self.config.lost_write) {
                    self.stats.lost += 1;
                    let buf = op.into_buf();
                    self.synthesize(caller_token, kind, Ok(()), buf);
                    return Ok(());
                }
                let lbas = transfer_bytes as u64 / lba_size as u64;
                if self.chance(self.config.misdirected_write) && capacity > lbas {
                    self.stats.misdirected += 1;
                    *target = self.rng.random_range(0..capacity - lbas + 1);
                }
                for block in 0..lbas {
                    self.rotten.remove(&(*target + block));
                }
                lba = *target;
                if !*fua {
                    self.remember_before(lba, lbas);
                }
            }
            IoOp::WriteZeroes { lba: target, lbas } | IoOp::Deallocate { lba: target, lbas } => {
                lba = *target;
                for block in 0..*lbas as u64 {
                    self.rotten.remove(&(*target + block));
                }
                self.remember_before(*target, *lbas as u64);
            }
            IoOp::Read { lba: target, .. } => lba = *target,
            IoOp::Flush => {
                covers = self.unflushed.len();
                if self.chance(self.config.ignored_flush) {
                    self.stats.ignored_flushes += 1;
                    ignored = true;
                }
            }
        }
        let token = self
            .pending
            .insert(Pending {
                caller_token,
                kind,
                lba,
                covers,
                ignored,
            })
            .expect("in-flight bounded by queue depth above");
        self.inner
            .submit(Request { token, op })
            .map_err(|mut rejected| {
                self.pending.remove(token);
                rejected.request.token = caller_token;
                rejected
            })
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        let mut from_inner = Vec::new();
        self.inner.poll(&mut from_inner)?;
        Ok(self.collect(from_inner, out))
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut from_inner = Vec::new();
            if self.inner.in_flight() > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                self.inner.wait(&mut from_inner, left)?;
            }
            let found = self.collect(from_inner, out);
            if found > 0 || self.in_flight() == 0 || Instant::now() >= deadline {
                return Ok(found);
            }
            if self.inner.in_flight() == 0 {
                // Only held-back completions remain: sleep until the first is due.
                let next = self
                    .ready
                    .iter()
                    .map(|(at, _)| *at)
                    .min()
                    .unwrap_or(deadline);
                std::thread::sleep(next.min(deadline).saturating_duration_since(Instant::now()));
            }
        }
    }

    fn in_flight(&self) -> u32 {
        self.inner.in_flight() + self.ready.len() as u32
    }

    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        self.inner.signal_completions_to(eventfd)
    }

    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        self.inner.run_blocking_work_on(cores)
    }

    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        self.inner.sim_access()
    }
}
