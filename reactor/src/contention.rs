//! Knowing when the cores are not ours alone.
//!
//! Polling is how corefs answers in microseconds: a reactor spins on its queue and its
//! device, a client spins (yielding now and then) for its reply. That only pays while the
//! spinner has its core. When another runnable thread shares it (a compaction thread, a
//! query executor, a co-tenant's process), a spinner is preempted for whole time slices
//! (4 ms at this kernel's HZ=250) and, having used its slice, gets no wake-up preference:
//! every hop between a client and its reactor then waits for the scheduler's tick (an fsync
//! went from 60 µs to 8 ms beside one CPU-bound process). A thread that blocks in the kernel
//! instead (futex, eventfd) is woken by the scheduler ahead of a CPU hog, as a kernel
//! filesystem's fsync waiter is.
//!
//! Two signals together say so, since either alone misleads:
//! - **Our threads wait for a core.** Every reactor and every slow client call measures the
//!   time its own thread spent runnable but not running (the run delay in
//!   `/proc/thread-self/schedstat`, kept by the scheduler; one `pread` of an open
//!   descriptor, about a microsecond): past [`DELAY_PER_WINDOW`] of it within [`WINDOW`].
//!   Alone, this also fires when our own threads crowd each other (eight dbench clients on
//!   one core, a client yielding to the reactor), where polling is still right.
//! - **Someone else uses the CPUs.** The machine's user time (`/proc/stat`) less the
//!   process's own (`getrusage`) and its partners' ([`Partner`]), over [`MACHINE_WINDOW`]:
//!   at least [`OTHERS_MIN`] of a core. User time only: the kernel's threads and interrupts
//!   mostly work for our own I/O (a quiet run counted 0.3 cores of them once). Alone, it
//!   also fires for a neighbour on cores we do not use.
//!
//! A storage service and its clients are one piece of work split over processes: a server's
//! busy-polling reactor is a whole core of "others" to each client, and the clients' threads
//! are "others" to the server. Counted so, four client threads sharing a core with each other
//! (the same crowding as eight dbench clients in one process) made both sides sleep between
//! requests, and creates through the service idled both cores half the time. So each side
//! registers the other as a partner while connected, and a partner's user time
//! (`/proc/PID/stat`) counts as the process's own.
//!
//! With both, the process is *contended* for [`HOLD`]: reactors and clients stop spinning and
//! yielding, and sleep in the kernel between a request and its reply. The hold is renewed
//! while both go on; once it passes they poll again.
//!
//! # Invariants
//! - The state is the process's (one set of cores): a client that sees delay makes the
//!   reactors sleep too, and the other way round.
//! - Checks are bounded: a reactor reads its run delay at most once per [`CHECK_EVERY`]; a
//!   client only after a call slower than [`SLOW_CALL`].
//! - Nothing here blocks or allocates after a thread's first check; a kernel without
//!   schedstat (no `/proc/thread-self/schedstat`) only means the process is never contended
//!   (polling as before), which the first check says once in the log.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often a polling reactor reads its run delay.
pub const CHECK_EVERY: Duration = Duration::from_millis(1);
/// The window over which run delay adds up, and how much of it makes the process contended:
/// a tenth of the window spent waiting for a core. A reactor alone on its core waits a few
/// microseconds per wake-up; a neighbour takes whole slices (milliseconds).
pub const WINDOW: Duration = Duration::from_millis(20);
pub const DELAY_PER_WINDOW: Duration = Duration::from_millis(2);
/// How long the process stays contended after the last delay seen; renewed while others
/// still use the CPUs, up to [`HOLD_MAX`] since the last delay seen (then polling is tried
/// again: a neighbour gone quiet, or one on cores we do not use, no longer costs us).
pub const HOLD: Duration = Duration::from_secs(1);
pub const HOLD_MAX: Duration = Duration::from_secs(10);
/// How often the machine's CPU use is sampled, and how much of a core others must use.
/// (/proc/stat counts user time in 10 ms ticks given to whatever runs at the tick, while
/// `getrusage` splits our precise run time by its own tick samples: over 200 ms windows a
/// quiet suite run still showed 0.4 cores of "others" once. A CPU-bound neighbour shows as a
/// whole core.)
pub const MACHINE_WINDOW: Duration = Duration::from_millis(500);
pub const OTHERS_MIN: f64 = 0.6;
/// A client call slower than this makes its thread look at its own run delay.
pub const SLOW_CALL: Duration = Duration::from_millis(1);

struct State {
    /// Nanoseconds since [`epoch`] until which the process is contended (0: not yet).
    until_ns: AtomicU64,
    /// When a thread last saw its run delay while others used the CPUs (ns since [`epoch`]).
    seen_ns: AtomicU64,
    /// Times contention began (it was not contended before).
    episodes: AtomicU64,
    said: AtomicBool,
}

static STATE: State = State {
    until_ns: AtomicU64::new(0),
    seen_ns: AtomicU64::new(0),
    episodes: AtomicU64::new(0),
    said: AtomicBool::new(false),
};

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn ns_at(at: Instant) -> u64 {
    at.saturating_duration_since(epoch()).as_nanos() as u64
}

/// True while the process is contended: poll nothing, sleep in the kernel.
pub fn contended() -> bool {
    let until = STATE.until_ns.load(Ordering::Relaxed);
    until != 0 && ns_at(Instant::now()) < until
}

/// Times the process became contended since it started.
pub fn episodes() -> u64 {
    STATE.episodes.load(Ordering::Relaxed)
}

/// CPUs' worth of user time other processes used over the last [`MACHINE_WINDOW`] (in
/// thousandths of a core), sampled by whoever calls [`sample_machine`].
static OTHERS_MILLICORES: AtomicU64 = AtomicU64::new(0);

/// Samples the machine's CPU use against the process's when [`MACHINE_WINDOW`] has passed
/// since the last sample (a reactor calls this as it turns; cheap otherwise).
pub fn sample_machine(now: Instant) {
    static LAST: std::sync::Mutex<Option<CpuSample>> = std::sync::Mutex::new(None);
    // When the last sample was taken (ns since `epoch`): most calls end here, with one load.
    static LAST_NS: AtomicU64 = AtomicU64::new(0);
    let now_ns = ns_at(now);
    let last_ns = LAST_NS.load(Ordering::Relaxed);
    if last_ns != 0 && now_ns.saturating_sub(last_ns) < MACHINE_WINDOW.as_nanos() as u64 {
        return;
    }
    let Ok(mut last) = LAST.try_lock() else {
        return;
    };
    if last.is_some_and(|l| now.saturating_duration_since(l.at) < MACHINE_WINDOW) {
        return;
    }
    let Some(sample) = CpuSample::take(now) else {
        return;
    };
    if let Some(earlier) = *last {
        let millicores = (sample.others_cores_since(&earlier) * 1000.0) as u64;
        OTHERS_MILLICORES.store(millicores, Ordering::Relaxed);
        // Sleeping between requests, our threads hardly wait for a core any more, so the
        // delay alone would end the state within a hold and polling would lose slices to
        // the neighbour again: while it still runs, the state goes on (up to HOLD_MAX since
        // a delay was last seen).
        let seen = STATE.seen_ns.load(Ordering::Relaxed);
        if contended()
            && millicores as f64 >= OTHERS_MIN * 1000.0
            && ns_at(now) < seen.saturating_add(HOLD_MAX.as_nanos() as u64)
        {
            STATE
                .until_ns
                .store(ns_at(now + HOLD).max(1), Ordering::Relaxed);
        }
    }
    *last = Some(sample);
    LAST_NS.store(now_ns.max(1), Ordering::Relaxed);
}

/// The machine's user time and this process's own (its partners' included) at one moment:
/// two samples tell how much of the CPUs other processes used between them. Taking one reads
/// `/proc/stat` and each partner's `/proc/PID/stat` (tens of microseconds).
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    at: Instant,
    machine_ns: u64,
    own_ns: u64,
}

impl CpuSample {
    pub fn take(now: Instant) -> Option<CpuSample> {
        let machine_ns = machine_busy_ns()?;
        // Partners' time counts as our own (a new partner's from when it was registered).
        let own_ns = process_cpu_ns()? + partners_cpu_ns_total();
        Some(CpuSample {
            at: now,
            machine_ns,
            own_ns,
        })
    }

    pub fn at(&self) -> Instant {
        self.at
    }

    /// Cores' worth of user time other processes used from `earlier` to this sample.
    pub fn others_cores_since(&self, earlier: &CpuSample) -> f64 {
        let wall = self
            .at
            .saturating_duration_since(earlier.at)
            .as_nanos()
            .max(1) as f64;
        let others = self.machine_ns.saturating_sub(earlier.machine_ns) as f64
            - self.own_ns.saturating_sub(earlier.own_ns) as f64;
        others.max(0.0) / wall
    }
}

/// Partners tracked at most: beyond it, a further partner's time counts as others' (a server
/// with more clients than this is busy, and only loses some of its polling).
pub const PARTNERS_MAX: usize = 1024;

struct PartnerEntry {
    pid: u32,
    /// Registrations of this pid (two connections between the same processes count once).
    refs: u32,
    /// The partner's user time when last read, in ns.
    seen_ns: u64,
    /// What it used since registration, summed over samples (ns).
    used_ns: u64,
}

static PARTNERS: std::sync::Mutex<Vec<PartnerEntry>> = std::sync::Mutex::new(Vec::new());
/// What partners that went used before they went (ns), so the sum never goes back.
static PARTNERS_GONE_NS: AtomicU64 = AtomicU64::new(0);

/// A process that works with this one (a storage server and its client, each for the
/// other), registered while the value lives: its CPU time counts as ours when judging
/// whether others use the CPUs.
pub struct Partner {
    pid: Option<u32>,
}

impl Partner {
    /// Registers `pid` (not this process itself, and at most [`PARTNERS_MAX`] of them).
    pub fn new(pid: i32) -> Partner {
        let Ok(pid) = u32::try_from(pid) else {
            return Partner { pid: None };
        };
        if pid == 0 || pid == std::process::id() {
            return Partner { pid: None };
        }
        let mut partners = PARTNERS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = partners.iter_mut().find(|p| p.pid == pid) {
            p.refs += 1;
            return Partner { pid: Some(pid) };
        }
        if partners.len() >= PARTNERS_MAX {
            return Partner { pid: None };
        }
        let Some(seen_ns) = user_cpu_ns_of(pid) else {
            return Partner { pid: None };
        };
        partners.push(PartnerEntry {
            pid,
            refs: 1,
            seen_ns,
            used_ns: 0,
        });
        Partner { pid: Some(pid) }
    }
}

impl Drop for Partner {
    fn drop(&mut self) {
        let Some(pid) = self.pid else { return };
        let mut partners = PARTNERS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = partners.iter().position(|p| p.pid == pid) {
            partners[k].refs -= 1;
            if partners[k].refs == 0 {
                let gone = partners.swap_remove(k);
                PARTNERS_GONE_NS.fetch_add(gone.used_ns, Ordering::Relaxed);
            }
        }
    }
}

/// The user time partners used since they were registered, all together (ns): reads each
/// one's `/proc/PID/stat` (one read per partner per [`MACHINE_WINDOW`]).
fn partners_cpu_ns_total() -> u64 {
    let mut partners = PARTNERS.lock().unwrap_or_else(|p| p.into_inner());
    let mut total = PARTNERS_GONE_NS.load(Ordering::Relaxed);
    for p in partners.iter_mut() {
        if let Some(now) = user_cpu_ns_of(p.pid) {
            p.used_ns += now.saturating_sub(p.seen_ns);
            p.seen_ns = now;
        }
        total += p.used_ns;
    }
    total
}

/// A process's user CPU time (`utime` in `/proc/PID/stat`), in ns; None once it is gone.
fn user_cpu_ns_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_utime_ticks(&stat).map(|ticks| ticks * ns_per_tick())
}

/// Field 14 of a `/proc/PID/stat` line; the command name (field 2) may hold spaces and
/// parentheses, so fields are counted after its last ')'.
fn parse_utime_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(11)?.parse().ok()
}

fn ns_per_tick() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    1_000_000_000 / ticks
}

/// The CPUs' worth of busy time other processes used lately.
pub fn others_cores() -> f64 {
    OTHERS_MILLICORES.load(Ordering::Relaxed) as f64 / 1000.0
}

/// User time of every CPU together (user and nice), from /proc/stat.
fn machine_busy_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy = fields.first()? + fields.get(1)?;
    Some(busy * ns_per_tick())
}

/// The process's user CPU time (all its threads), in ns.
fn process_cpu_ns() -> Option<u64> {
    // SAFETY: getrusage writes one rusage through the pointer.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return None;
    }
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    Some(tv(usage.ru_utime))
}

/// One of the process's threads waited for a core: when other processes use the CPUs too,
/// the process is contended for [`HOLD`] from `now`. `who` says which thread saw it (the
/// log's first line says so once).
pub fn report(now: Instant, who: &str, delay: Duration, window: Duration) {
    if others_cores() < OTHERS_MIN {
        // Our own threads crowd each other: the quiet policy is right for that.
        return;
    }
    let was = contended();
    STATE.seen_ns.store(ns_at(now), Ordering::Relaxed);
    STATE
        .until_ns
        .store(ns_at(now + HOLD).max(1), Ordering::Relaxed);
    if !was {
        STATE.episodes.fetch_add(1, Ordering::Relaxed);
        if !STATE.said.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "the cores are shared with other work ({who} waited {} µs for a core in {} ms, \
                 other processes use {:.1} cores): reactors and clients sleep in the kernel \
                 between requests instead of polling while that lasts",
                delay.as_micros(),
                window.as_millis(),
                others_cores()
            );
        } else {
            tracing::debug!(who, delay_us = delay.as_micros() as u64, "contended again");
        }
    }
}

/// The calling thread's run delay: the time it spent runnable and not running, from the
/// scheduler's own count. Open it on the thread it measures.
pub struct RunDelay {
    file: Option<File>,
    buf: [u8; 96],
}

impl RunDelay {
    /// Opens `/proc/thread-self/schedstat` for the calling thread (None inside when the
    /// kernel has no schedstat: then nothing is ever contended).
    pub fn open() -> RunDelay {
        let file = File::open("/proc/thread-self/schedstat").ok();
        if file.is_none() {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    "no /proc/thread-self/schedstat (kernel without CONFIG_SCHED_INFO): \
                     corefs cannot tell when its cores are shared, and keeps polling"
                );
            }
        }
        RunDelay { file, buf: [0; 96] }
    }

    /// The thread's total run delay so far (None: unreadable).
    pub fn read(&mut self) -> Option<Duration> {
        let file = self.file.as_ref()?;
        let n = file.read_at(&mut self.buf, 0).ok()?;
        parse_run_delay(&self.buf[..n])
    }
}

/// The second field of a schedstat line ("runtime_ns run_delay_ns timeslices").
fn parse_run_delay(line: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(line).ok()?;
    let ns: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// A reactor's watch over its own run delay, checked as its loop turns.
pub struct Meter {
    delay: RunDelay,
    who: &'static str,
    last_check: Option<Instant>,
    window_start: Instant,
    window_start_delay: Duration,
    /// Until when this thread itself counts as kept off its core (it saw the delay itself,
    /// not another thread of the process).
    own_until: Option<Instant>,
}

impl Meter {
    /// Opens the meter for the calling thread.
    pub fn new(who: &'static str) -> Meter {
        let mut delay = RunDelay::open();
        let start = delay.read().unwrap_or_default();
        Meter {
            delay,
            who,
            last_check: None,
            window_start: Instant::now(),
            window_start_delay: start,
            own_until: None,
        }
    }

    /// True while this thread itself waited for its core, and the process has been
    /// contended since ([`contended`], renewed while others use the CPUs; at most
    /// [`HOLD_MAX`] after this thread last waited).
    pub fn own_contended(&self, now: Instant) -> bool {
        self.own_until.is_some_and(|until| now < until) && contended()
    }

    /// Looks at the run delay when [`CHECK_EVERY`] has passed since the last look; reports
    /// contention when a window gathered more than [`DELAY_PER_WINDOW`].
    pub fn check(&mut self, now: Instant) {
        if self
            .last_check
            .is_some_and(|at| now.saturating_duration_since(at) < CHECK_EVERY)
        {
            return;
        }
        self.last_check = Some(now);
        let Some(total) = self.delay.read() else {
            return;
        };
        let delay = total.saturating_sub(self.window_start_delay);
        let window = now.saturating_duration_since(self.window_start);
        sample_machine(now);
        if delay >= DELAY_PER_WINDOW && others_cores() >= OTHERS_MIN {
            report(now, self.who, delay, window);
            self.own_until = Some(now + HOLD_MAX);
        }
        if window >= WINDOW || delay >= DELAY_PER_WINDOW {
            self.window_start = now;
            self.window_start_delay = total;
        }
    }
}

/// A client call took `took`: if it was slow, the calling thread looks at the run delay it
/// gathered since its last look, and reports contention when that was a large part of the
/// time (its own core is shared even if the reactors' are not).
pub fn after_call(took: Duration) {
    if took < SLOW_CALL {
        return;
    }
    thread_local! {
        static LAST: std::cell::RefCell<Option<(RunDelay, Instant, Duration)>> =
            const { std::cell::RefCell::new(None) };
    }
    let now = Instant::now();
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        let (delay, at, before) = last.get_or_insert_with(|| {
            let mut d = RunDelay::open();
            let v = d.read().unwrap_or_default();
            (d, now, v)
        });
        let Some(total) = delay.read() else {
            return;
        };
        let gathered = total.saturating_sub(*before);
        let window = now.saturating_duration_since(*at).max(took);
        // At least a tenth of the time since the last look waiting for a core, and some of
        // it in this call.
        if gathered >= DELAY_PER_WINDOW.min(took / 2) && gathered * 10 >= window {
            report(now, "a client", gathered, window);
        }
        *at = now;
        *before = total;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that watch the machine's CPU use run one at a time (each spawns a spinner
    /// the other would count).
    static MACHINE_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A CPU-bound process (`while :; do :; done`), killed when dropped.
    struct SpinningProcess(std::process::Child);

    impl SpinningProcess {
        fn start() -> SpinningProcess {
            SpinningProcess(
                std::process::Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .unwrap(),
            )
        }
    }

    impl Drop for SpinningProcess {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A process spinning beside this one shows as others' CPU use.
    #[test]
    fn a_spinning_process_shows_as_others_cpu_use() {
        let _one = MACHINE_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let hog = SpinningProcess::start();
        let start = Instant::now();
        let mut seen = 0.0f64;
        while start.elapsed() < Duration::from_secs(2) {
            sample_machine(Instant::now());
            seen = seen.max(others_cores());
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(hog);
        assert!(
            seen >= 0.5,
            "others used {seen} cores beside a spinning process"
        );
    }

    /// A spinning process registered as a partner is not others' CPU use; once its
    /// registration goes, it is again.
    #[test]
    fn a_partners_cpu_time_is_ours() {
        let _one = MACHINE_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let hog = SpinningProcess::start();
        let window = |secs: u64| {
            let start = Instant::now();
            let mut seen: Vec<f64> = Vec::new();
            while start.elapsed() < Duration::from_secs(secs) {
                std::thread::sleep(MACHINE_WINDOW + Duration::from_millis(20));
                sample_machine(Instant::now());
                seen.push(others_cores());
            }
            seen
        };
        let partner = Partner::new(hog.0.id() as i32);
        // The first sample after registering may still straddle it.
        let with = window(3);
        drop(partner);
        let without = window(2);
        drop(hog);
        let with_min = with[1..].iter().cloned().fold(f64::MAX, f64::min);
        let without_max = without[1..].iter().cloned().fold(0.0, f64::max);
        assert!(
            with_min < 0.5,
            "a partner's spinning counted as others: {with:?}"
        );
        assert!(
            without_max >= 0.5,
            "the spinner unregistered did not count as others: {without:?}"
        );
    }

    #[test]
    fn utime_is_field_fourteen_after_the_name() {
        let line = "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 1234 99 0 0 20";
        assert_eq!(parse_utime_ticks(line), Some(1234));
        assert_eq!(parse_utime_ticks("no parenthesis"), None);
    }

    #[test]
    fn the_run_delay_is_the_second_field() {
        assert_eq!(
            parse_run_delay(b"721565 4096 1\n"),
            Some(Duration::from_nanos(4096))
        );
        assert_eq!(parse_run_delay(b"12\n"), None);
        assert_eq!(parse_run_delay(b""), None);
    }

    /// This thread's run delay is readable here (the kernel keeps schedstat), and grows while
    /// another thread holds the only core both may run on.
    #[test]
    fn a_thread_sharing_its_core_sees_its_run_delay_grow() {
        let hog = crate::affinity::CoreHog::beside_me();
        let mut delay = RunDelay::open();
        let before = delay.read().expect("schedstat readable on this kernel");
        // Spin beside it for 200 ms: the scheduler splits the core, so this thread waits
        // for it a good part of the time.
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(200) {
            std::hint::spin_loop();
        }
        drop(hog);
        let after = delay.read().unwrap();
        assert!(
            after - before >= Duration::from_millis(20),
            "run delay grew by {:?} only",
            after - before
        );
    }
}
