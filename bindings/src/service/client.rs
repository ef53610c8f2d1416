//! The client's end of a connection: [`Connection`] (the socket and the shared ring, one per
//! `corefs_connect`) and [`RemoteClient`] (one per calling thread, as a reactor client is),
//! which sends operations through the ring and takes their answers.
//!
//! # Invariants
//! - A thread owns the slots it claimed until it has read their answers; claiming is a
//!   compare-and-swap from `FREE`, so threads never share a slot.
//! - No wait is unbounded: a thread waiting on a slot looks at the socket every
//!   [`LIVENESS_CHECK`], and a server gone makes this call and every later one ENOTCONN.
//! - A read or write larger than one message goes as several, in order, each waiting for the
//!   one before (a write's parts are not atomic together, as pwrite(2) on a kernel
//!   filesystem promises no atomicity either).

use super::arena::Arena;
use super::ring::{self, Region, CLAIMED, DONE, FREE, SLOTS, SUBMITTED};
use super::{socket, wire};
use crate::error::Error;
use engine::EngineError;
use reactor::{Completion, Op, Reply, SubmitError};
use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a waiting thread makes sure the server is still there.
pub const LIVENESS_CHECK: Duration = Duration::from_millis(20);
/// How long a connection's waiters wait as beside a neighbour once a look found another
/// process using the CPUs ([`Connection::look_for_neighbours`]); renewed while it does.
pub const YIELDS_OFF: Duration = Duration::from_secs(1);
/// How often a connection samples the machine's CPU use ([`Connection::look_for_neighbours`]):
/// at most, and at most after a waiter's slow yield.
const CPU_SAMPLE_EVERY: Duration = Duration::from_millis(200);
const CPU_SAMPLE_SOON: Duration = Duration::from_millis(10);
/// Beside a CPU-bound neighbour, how long a waiting thread may spin before it sleeps, at
/// most and at first. The budget adapts ([`Connection::spin_ns`]): a sleeping client pays the
/// server's futex wake and its own wake-up (tens of microseconds on a virtual machine), so a
/// client spins while spinning is what ends its waits; when it is not (the answer never comes
/// while it spins: a fsync, or the server kept off its core), the budget halves down to the
/// minimum. The spin never yields: beside a neighbour a yield hands it the core for a whole
/// slice.
const SPIN_NS_MAX: u64 = 500_000;
const SPIN_NS_MIN: u64 = 2_000;
const SPIN_NS_FIRST: u64 = 50_000;

/// Where a submitted read's data goes: a C caller's buffer, which `corefs_submit_pread`'s
/// contract keeps valid (and untouched by the caller) until the read's completion is polled.
#[derive(Clone, Copy, Debug)]
pub struct ReadDest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer belongs to the read in flight alone until its completion is polled
// (the submitter's contract), and only the client that submitted it writes it.
unsafe impl Send for ReadDest {}

impl ReadDest {
    /// # Safety
    /// `ptr` is valid for writing `len` bytes, and nothing else uses them, until the read's
    /// completion is polled.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> ReadDest {
        ReadDest { ptr, len }
    }
}

/// How a thread waits for its slot's answer.
#[derive(Clone, Copy)]
enum Waiting {
    /// Spin, yield or sleep as [`Connection::wait_done`] decides; `quick`: the request may be
    /// waited for awake ([`Op::waits_awake`]).
    Policy { quick: bool },
    /// Sleep at once (a streaming or deep-queued thread's wait, [`RemoteClient::waits_asleep`]).
    Asleep,
}

/// One connection to a server.
pub struct Connection {
    sock: UnixStream,
    region: Region,
    /// This process's buffer arena, when the server mapped it: a read or write from a buffer
    /// inside it names its place there instead of carrying its bytes.
    arena: Option<&'static Arena>,
    /// Set once the server is known gone: every call fails at once from then on.
    dead: AtomicBool,
    /// The server's reactor's eventfd, when the reactor takes this ring's requests itself:
    /// written after a submit while the reactor sleeps.
    reactor_doorbell: Option<std::os::fd::OwnedFd>,
    /// Where the next claim starts looking (spreads threads over the slots).
    next_slot: AtomicUsize,
    /// The next request sent in pieces gets this number ([`wire::Piece`]).
    next_piece_id: AtomicU64,
    /// Threads waiting for answers now, and how many may spin: the cores but one (the
    /// server's), as in-process clients leave the reactor its core. A waiter waits as an
    /// in-process client does ([`reactor::wait_policy`], [`reactor::wait_awake`]) unless
    /// another process uses the CPUs ([`Connection::wait_done`]).
    waiters: AtomicUsize,
    spinners_max: usize,
    /// Beside a neighbour: threads spinning now, and the spin budget in ns ([`SPIN_NS_MAX`]).
    spinners: AtomicUsize,
    spin_ns: AtomicU64,
    /// Until when (ns since `epoch`) waiters wait as beside a neighbour (they do not yield).
    yields_off_until_ns: AtomicU64,
    epoch: Instant,
    /// This connection's last sample of the machine's CPU use
    /// ([`Connection::look_for_neighbours`]).
    cpu_sample: std::sync::Mutex<Option<reactor::contention::CpuSample>>,
    /// When the next look may be taken (ns since `epoch`).
    next_look_ns: AtomicU64,
    /// The server's CPU time is this process's own work when judging contention (a polling
    /// server is a whole core that is not a neighbour's).
    _partner: reactor::contention::Partner,
    pub socket_path: String,
}

fn gone(path: &str) -> EngineError {
    EngineError::Refused {
        errno: libc::ENOTCONN,
        message: format!("the corefs server at {path} is gone: connect again"),
    }
}

impl Connection {
    pub fn connect(path: &str) -> Result<Arc<Connection>, Error> {
        let io = |what: &str, e: std::io::Error| {
            Error::new(
                e.raw_os_error().unwrap_or(libc::EIO),
                format!("{what} {path}: {e}"),
            )
        };
        let sock = UnixStream::connect(path).map_err(|e| io("connect to", e))?;
        // The server's pid as the kernel recorded it at its listen (0 if unknown: then its
        // time counts as others', which only makes this client sleep more readily).
        let server_pid = socket::peer(&sock).map_or(0, |p| p.pid);
        // The handshake is the server's first act; a server that takes longer is stuck.
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| io("connect to", e))?;
        let mut fds = socket::recv_fds(&sock)
            .map_err(|e| io("connect to", e))?
            .into_iter();
        let memory = fds.next().ok_or_else(|| {
            Error::new(libc::EPROTO, format!("connect to {path}: no shared memory"))
        })?;
        let reactor_doorbell = fds.next();
        let region =
            Region::map(&std::fs::File::from(memory)).map_err(|e| io("map the ring of", e))?;
        region
            .check()
            .map_err(|why| Error::new(libc::EPROTO, format!("connect to {path}: {why}")))?;
        let arena = share_arena(&sock, super::arena::process()).map_err(|e| io("connect to", e))?;
        sock.set_read_timeout(None)
            .map_err(|e| io("connect to", e))?;
        Ok(Arc::new(Connection {
            sock,
            region,
            arena,
            dead: AtomicBool::new(false),
            reactor_doorbell,
            next_slot: AtomicUsize::new(0),
            next_piece_id: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            spinners: AtomicUsize::new(0),
            spin_ns: AtomicU64::new(SPIN_NS_FIRST),
            yields_off_until_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            // The first judgement covers the time since connecting.
            cpu_sample: std::sync::Mutex::new(reactor::contention::CpuSample::take(Instant::now())),
            next_look_ns: AtomicU64::new(0),
            spinners_max: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .saturating_sub(1)
                .max(1),
            _partner: reactor::contention::Partner::new(server_pid),
            socket_path: path.to_string(),
        }))
    }

    /// Where `ptr..ptr + len` lies in the buffer arena the server shares, if it does.
    fn shared_at(&self, ptr: *const u8, len: usize) -> Option<u64> {
        self.arena?.offset_of(ptr, len)
    }

    /// Ends the connection (`corefs_close`): the server releases whatever it still holds
    /// for it, and every later call here is ENOTCONN.
    pub fn close(&self) {
        self.dead.store(true, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// True once the server is known gone (a flag: no system call, so every request may ask).
    fn known_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// False once the server closed its end (checked without waiting: a system call, made
    /// only when a wait runs long).
    fn alive(&self) -> bool {
        if self.dead.load(Ordering::Acquire) {
            return false;
        }
        if socket::hung_up(&self.sock) {
            self.dead.store(true, Ordering::Release);
            return false;
        }
        true
    }

    fn claim(&self) -> Option<usize> {
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed);
        (0..SLOTS).map(|k| (start + k) % SLOTS).find(|&i| {
            self.region
                .slot(i)
                .state
                .compare_exchange(FREE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// `n` slots, or none (the ones claimed are freed again): an operation in several
    /// messages is sent whole or not at all.
    fn claim_all(&self, n: usize) -> Option<Vec<usize>> {
        let mut slots = Vec::with_capacity(n);
        while slots.len() < n {
            match self.claim() {
                Some(i) => slots.push(i),
                None => {
                    for i in slots {
                        self.region.slot(i).state.store(FREE, Ordering::Release);
                    }
                    return None;
                }
            }
        }
        Some(slots)
    }

    /// A slot, waiting (bounded by the server's life) while all are in use.
    fn claim_waiting(&self) -> Result<usize, EngineError> {
        let mut checked = Instant::now();
        loop {
            if let Some(i) = self.claim() {
                return Ok(i);
            }
            std::thread::sleep(Duration::from_micros(50));
            if checked.elapsed() >= LIVENESS_CHECK {
                if !self.alive() {
                    return Err(gone(&self.socket_path));
                }
                checked = Instant::now();
            }
        }
    }

    /// Writes `request` into claimed slot `i` in place (no copy of the message) and submits
    /// it; on an error (a request that does not fit) the slot is free again. `beside` are the
    /// bytes of a [`wire::Request::Write`], written into the slot's data area from wherever
    /// they are (the caller's buffer, [`RemoteClient::write_from`]); a write operation sent
    /// without them goes that way too, its bytes from the operation
    /// ([`wire::write_beside`]).
    fn send(
        &self,
        i: usize,
        request: &wire::Request,
        beside: Option<&[u8]>,
    ) -> Result<(), wire::Unsent> {
        if let (wire::Request::Op(op), None) = (request, beside) {
            if let Some((head, data)) = wire::write_beside(op) {
                return self.send(i, &head, Some(data));
            }
        }
        // SAFETY: slot `i` is this thread's (claimed), and no other view of its payload is
        // live while the encoder writes (the data goes in after, by `put_data`).
        let payload = unsafe { self.region.payload_mut(i) };
        let written = match beside {
            Some(_) => wire::encode_request_into(request, &mut payload[..ring::DATA_AT]),
            None => wire::encode_request_into(request, payload),
        };
        let len = match written {
            Ok(len) => len,
            Err(e) => {
                self.region.slot(i).state.store(FREE, Ordering::Release);
                return Err(e);
            }
        };
        if let Some(data) = beside {
            self.region.put_data(i, data);
        }
        let slot = self.region.slot(i);
        slot.len.store(len as u32, Ordering::Relaxed);
        slot.state.store(SUBMITTED, Ordering::SeqCst);
        let h = self.region.header();
        h.doorbell.fetch_add(1, Ordering::SeqCst);
        if let (Some(fd), 1) = (
            &self.reactor_doorbell,
            h.served_by_reactor.load(Ordering::Relaxed),
        ) {
            // Published, then the parked flag read (SeqCst both): a reactor about to sleep
            // stores the flag, then looks at the ring again (see `reactor::source`).
            if h.reactor_parked.load(Ordering::SeqCst) == 1 {
                reactor::ring_eventfd(std::os::fd::AsRawFd::as_raw_fd(fd));
            }
        } else if h.sleepers.load(Ordering::SeqCst) > 0 {
            ring::futex_wake(&h.doorbell, 1);
        }
        Ok(())
    }

    fn is_done(&self, i: usize) -> bool {
        self.region.slot(i).state.load(Ordering::Acquire) == DONE
    }

    /// Waits until slot `i` is answered, or until `deadline`: false at the deadline.
    /// `quick`: the request may be waited for awake ([`Op::waits_awake`]).
    ///
    /// Two ways to wait before sleeping (docs/service.md has the measurements). While no
    /// other process uses the CPUs, as an in-process client: one spinner per spare core
    /// (handing its core on now and then), the other waiters yielding their core to each other
    /// for a quick request rather than each costing the server a futex wake
    /// ([`reactor::wait_policy`], [`reactor::wait_awake`]). Beside a neighbour
    /// ([`Connection::look_for_neighbours`]): one adaptive spinner that never yields, the other
    /// waiters asleep (a yield hands the neighbour a core for a slice, and yielding waiters
    /// make their core look busy, so the scheduler moves the neighbour onto the server's;
    /// a sleeper is woken ahead of it). While the process is contended, nobody spins.
    fn wait_done(
        &self,
        i: usize,
        deadline: Option<Instant>,
        quick: bool,
    ) -> Result<bool, EngineError> {
        self.wait_slot(i, deadline, Waiting::Policy { quick })
    }

    /// As [`Connection::wait_done`], `how` saying whether to sleep at once.
    fn wait_slot(
        &self,
        i: usize,
        deadline: Option<Instant>,
        how: Waiting,
    ) -> Result<bool, EngineError> {
        let started = Instant::now();
        let Waiting::Policy { quick } = how else {
            return self.sleep_until_done(i, deadline, started, false);
        };
        self.look_for_neighbours(started, false);
        let contended = reactor::contention::contended();
        let since_ns = |at: Instant| at.saturating_duration_since(self.epoch).as_nanos() as u64;
        let neighbours =
            contended || since_ns(started) < self.yields_off_until_ns.load(Ordering::Relaxed);
        let answered = if neighbours {
            self.spin_beside_neighbours(i, started, contended)
        } else {
            let waiting = self.waiters.fetch_add(1, Ordering::AcqRel) + 1;
            let wait = reactor::wait_policy(waiting, self.spinners_max, quick, false);
            let far = started + LIVENESS_CHECK;
            let answered = reactor::wait_awake(
                wait,
                deadline.map_or(far, |d| d.min(far)),
                || self.is_done(i),
                || false,
                // A slow yield: look at once; stop yielding if a neighbour is about.
                || {
                    let now = Instant::now();
                    self.look_for_neighbours(now, true);
                    since_ns(now) < self.yields_off_until_ns.load(Ordering::Relaxed)
                },
            );
            self.waiters.fetch_sub(1, Ordering::AcqRel);
            answered
        };
        if answered {
            return Ok(true);
        }
        self.sleep_until_done(i, deadline, started, neighbours)
    }

    /// Sleeps on slot `i`'s futex until it is answered, `deadline` passes (false) or the
    /// server is found gone; `adapt`: the wait began beside a neighbour, and its length
    /// adapts the spin budget.
    fn sleep_until_done(
        &self,
        i: usize,
        deadline: Option<Instant>,
        started: Instant,
        adapt: bool,
    ) -> Result<bool, EngineError> {
        let state = &self.region.slot(i).state;
        loop {
            let seen = state.load(Ordering::Acquire);
            if seen == DONE {
                if adapt {
                    self.adapt_spin(started.elapsed());
                }
                return Ok(true);
            }
            let mut nap = LIVENESS_CHECK;
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                nap = nap.min(left);
            }
            let waiting = &self.region.slot(i).waiting;
            waiting.store(1, Ordering::SeqCst);
            if state.load(Ordering::SeqCst) == seen {
                ring::futex_wait(state, seen, nap);
            }
            waiting.store(0, Ordering::Relaxed);
            if self.is_done(i) {
                if adapt {
                    self.adapt_spin(started.elapsed());
                }
                return Ok(true);
            }
            if !self.alive() {
                return Err(gone(&self.socket_path));
            }
        }
    }

    /// Looks whether another process uses the CPUs, at most once per [`CPU_SAMPLE_EVERY`]
    /// from any waiter, or once per [`CPU_SAMPLE_SOON`] after a waiter's yield was slow (a
    /// look is two reads of /proc): if one does, waiters stop yielding for [`YIELDS_OFF`].
    /// The connection's own samples ([`reactor::contention::CpuSample`]), not the process's
    /// contention state: refreshing that one more often made the process contended more of
    /// the time beside a neighbour, and its clients slept. Both triggers are needed: yielding
    /// waiters make their core look loaded and the scheduler moves the neighbour to the
    /// server's core, after which their yields are quick again (and the neighbour stays
    /// there, halving the reactor), so the first slow yield must stop them at once; the
    /// periodic look finds a neighbour that started elsewhere.
    fn look_for_neighbours(&self, now: Instant, soon: bool) {
        let now_ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        if !soon && now_ns < self.next_look_ns.load(Ordering::Relaxed) {
            return;
        }
        let Ok(mut last) = self.cpu_sample.try_lock() else {
            return;
        };
        let gap_min = if soon {
            CPU_SAMPLE_SOON
        } else {
            CPU_SAMPLE_EVERY
        };
        if last.is_some_and(|l| now.saturating_duration_since(l.at()) < gap_min) {
            return;
        }
        self.next_look_ns.store(
            now_ns + CPU_SAMPLE_EVERY.as_nanos() as u64,
            Ordering::Relaxed,
        );
        let Some(sample) = reactor::contention::CpuSample::take(now) else {
            return;
        };
        let others_cores = match *last {
            Some(earlier) => sample.others_cores_since(&earlier),
            None => 0.0,
        };
        *last = Some(sample);
        if others_cores >= reactor::contention::OTHERS_MIN {
            let until = (now + YIELDS_OFF)
                .saturating_duration_since(self.epoch)
                .as_nanos() as u64;
            self.yields_off_until_ns.fetch_max(until, Ordering::Relaxed);
        }
    }

    /// Beside a neighbour: one thread per spare core spins for the current budget (none
    /// while the process is contended: its threads are kept off their cores, and a sleeper
    /// is woken ahead of a CPU hog; spinning there made append+fdatasync 10x slower); true
    /// once slot `i` is answered.
    fn spin_beside_neighbours(&self, i: usize, started: Instant, contended: bool) -> bool {
        if !contended && self.spinners.fetch_add(1, Ordering::AcqRel) < self.spinners_max {
            let budget = Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed));
            // The clock every 64 passes, not at each: a clock read costs a dozen passes, and
            // reading it at every pass was a tenth of a dbench client process's time.
            let mut pass = 0u32;
            while !self.is_done(i) {
                pass = pass.wrapping_add(1);
                if pass % 64 == 0 && started.elapsed() >= budget {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        if !contended {
            self.spinners.fetch_sub(1, Ordering::AcqRel);
        }
        if self.is_done(i) {
            // Spinning ended this wait: allow twice what it took (bounded).
            let took = started.elapsed().as_nanos() as u64;
            let grown = (took * 2).clamp(SPIN_NS_MIN, SPIN_NS_MAX);
            self.spin_ns.fetch_max(grown, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// A wait that slept took `waited` in all: had the spin lasted that long it would have
    /// ended the wait without a wake-up, so the budget grows to cover it; a wait longer than
    /// the most a spin may last gains nothing from spinning, so the budget halves.
    fn adapt_spin(&self, waited: Duration) {
        let waited_ns = waited.as_nanos() as u64;
        if waited_ns <= SPIN_NS_MAX {
            self.spin_ns
                .fetch_max((waited_ns * 2).min(SPIN_NS_MAX), Ordering::Relaxed);
        } else {
            let budget = self.spin_ns.load(Ordering::Relaxed);
            self.spin_ns
                .store((budget / 2).max(SPIN_NS_MIN), Ordering::Relaxed);
        }
    }

    /// Slot `i`'s answer; the slot is free again.
    fn finish(&self, i: usize) -> Result<Reply, EngineError> {
        self.finish_with(i, wire::decode_answer)
    }

    /// Slot `i`'s answer decoded by `decode` where it lies (a read's data is copied once,
    /// out of the slot); the slot is free again.
    fn finish_with<T>(
        &self,
        i: usize,
        decode: impl FnOnce(&[u8]) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        // SAFETY: slot `i` is this thread's and answered (DONE): the server wrote it before
        // publishing that and touches it no more; it is freed only after the decode.
        let result = match unsafe { self.region.message(i) } {
            Some(bytes) => decode(bytes),
            None => Err(EngineError::Refused {
                errno: libc::EIO,
                message: "an answer longer than its slot".into(),
            }),
        };
        self.region.slot(i).state.store(FREE, Ordering::Release);
        result
    }
}

/// The handshake's second half: sends `arena`'s descriptor (or a byte alone, for none) and
/// reads the server's answer, one byte: 1 when it mapped the arena. A refusal is said once
/// in the log; buffers are then copied through this connection as any memory is.
fn share_arena(
    sock: &UnixStream,
    arena: Option<&'static Arena>,
) -> std::io::Result<Option<&'static Arena>> {
    use std::io::Read;
    let fds: Vec<std::os::fd::RawFd> = arena.iter().map(|a| a.fd()).collect();
    socket::send_fds(sock, &fds)?;
    let mut answer = [0u8];
    (&*sock).read_exact(&mut answer)?;
    match (arena, answer[0]) {
        (Some(arena), 1) => Ok(Some(arena)),
        (Some(_), _) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    "the corefs server did not map this process's buffer arena: reads and \
                     writes from corefs_buf_alloc buffers are copied (see the server's log)"
                )
            });
            Ok(None)
        }
        (None, _) => Ok(None),
    }
}

/// A raw connection ([`connect_raw`]).
#[doc(hidden)]
pub struct RawConnection {
    pub sock: UnixStream,
    pub region: Region,
    /// The reactor's doorbell, when the server's reactor takes the ring's requests itself.
    pub reactor_doorbell: Option<std::os::fd::OwnedFd>,
    /// This process's buffer arena, when the server mapped it.
    pub arena: Option<&'static Arena>,
}

/// A connection's socket, ring, the reactor's doorbell and the shared buffer arena, with
/// nothing of the client library around them: for tests and tools that speak the ring
/// themselves (the protocol fuzz test plays a hostile client with it).
#[doc(hidden)]
pub fn connect_raw(path: &std::path::Path) -> std::io::Result<RawConnection> {
    let sock = UnixStream::connect(path)?;
    let mut fds = socket::recv_fds(&sock)?.into_iter();
    let memory = fds
        .next()
        .ok_or_else(|| std::io::Error::other("no shared memory"))?;
    let region = Region::map(&std::fs::File::from(memory))?;
    region
        .check()
        .map_err(|why| std::io::Error::new(std::io::ErrorKind::InvalidData, why))?;
    let arena = share_arena(&sock, super::arena::process())?;
    Ok(RawConnection {
        sock,
        region,
        reactor_doorbell: fds.next(),
        arena,
    })
}

/// A connection that watches a server (`corefs top`): its statistics on demand.
pub struct Observer {
    client: RemoteClient,
}

impl Observer {
    pub fn connect(socket: &std::path::Path) -> Result<Observer, String> {
        let path = socket
            .to_str()
            .ok_or_else(|| format!("{}: not UTF-8", socket.display()))?;
        let conn = Connection::connect(path).map_err(|e| e.message)?;
        Ok(Observer {
            client: RemoteClient::new(conn),
        })
    }

    pub fn sample(&mut self) -> Result<super::stats::ServerStats, String> {
        self.client.server_stats().map_err(|e| e.to_string())
    }
}

/// Releases a thread may have posted and not yet seen answered ([`RemoteClient::post_release`]);
/// one more waits for the oldest.
pub const POSTED_MAX: usize = 8;

/// One message of a submitted operation: its request, and the bytes that go beside it in the
/// slot's data area when they come from the caller's buffer ([`RemoteClient::submit_write`]).
struct Outgoing<'a> {
    request: wire::Request,
    beside: Option<&'a [u8]>,
}

impl Outgoing<'_> {
    fn alone(request: wire::Request) -> Outgoing<'static> {
        Outgoing {
            request,
            beside: None,
        }
    }
}

/// What a submitted operation's completion needs to know ([`InFlight`]'s own fields).
struct Sent {
    token: u64,
    large: bool,
    read: bool,
    into: Option<ReadDest>,
    placed: bool,
}

/// An operation a thread submitted and has not collected.
struct InFlight {
    /// Its requests' slots in order, with the bytes each reads or writes: one, unless a
    /// read or write larger than one message went as several ([`RemoteClient::submit_into`]).
    parts: Vec<(usize, usize)>,
    token: u64,
    large: bool,
    /// A read (else a write, or an operation of one part).
    read: bool,
    into: Option<ReadDest>,
    /// `into` lies in the shared buffer arena: the server put the data there itself
    /// ([`wire::Request::Read`]).
    placed: bool,
    /// Why the parts after the last one sent were not sent.
    cut: Option<EngineError>,
}

impl InFlight {
    fn done(&self, conn: &Connection) -> bool {
        self.parts.iter().all(|&(i, _)| conn.is_done(i))
    }

    /// The slot to wait on: the first part not answered yet.
    fn waiting_slot(&self, conn: &Connection) -> usize {
        let unanswered = self.parts.iter().find(|&&(i, _)| !conn.is_done(i));
        unanswered.unwrap_or(&self.parts[0]).0
    }

    /// The operation's outcome from its answered parts, every slot freed. One part answers as
    /// itself (a read into `into` as [`Reply::Placed`]); several add up, as pread(2) and
    /// pwrite(2) count: the bytes moved up to the first short part or error, the error only
    /// when nothing moved.
    fn collect(self, conn: &Connection) -> Result<Reply, EngineError> {
        let one = |i: usize, at: usize, len: usize| match self.into {
            // A buffer shorter than the read was submitted with: nothing is written to it.
            Some(dest) if at + len > dest.len => conn.finish(i).and(Err(EngineError::Refused {
                errno: libc::EIO,
                message: format!("a read of {} bytes into a buffer of {}", at + len, dest.len),
            })),
            Some(_) if self.placed => conn
                .finish_with(i, |bytes| wire::decode_placed(bytes, len))
                .map(Reply::Placed),
            Some(dest) => conn
                .finish_with(i, |bytes| {
                    // SAFETY: `dest` is this read's buffer until its completion is polled
                    // ([`ReadDest::new`]), which is now; this part's range lies inside it.
                    let out = unsafe { std::slice::from_raw_parts_mut(dest.ptr.add(at), len) };
                    wire::decode_read_into(bytes, out)
                })
                .map(Reply::Placed),
            None => conn.finish(i),
        };
        if let ([(i, len)], None) = (self.parts.as_slice(), &self.cut) {
            return one(*i, 0, *len);
        }
        let mut moved = 0usize;
        let mut data = Vec::new();
        let mut error = None;
        let mut ended = false;
        let mut at = 0usize;
        for &(i, len) in &self.parts {
            let result = one(i, at, len);
            at += len;
            if ended {
                continue; // freed; past a short part or an error nothing counts
            }
            let n = match result {
                Ok(Reply::Placed(n) | Reply::Written(n)) => n,
                Ok(Reply::Data(d)) => {
                    data.extend_from_slice(&d);
                    d.len()
                }
                Ok(other) => Err(EngineError::Refused {
                    errno: libc::EIO,
                    message: format!("unexpected reply to a part of a read or write {other:?}"),
                })?,
                Err(e) => {
                    error = Some(e);
                    ended = true;
                    continue;
                }
            };
            moved += n;
            ended = n < len;
        }
        if !ended {
            error = self.cut;
        }
        match error {
            Some(e) if moved == 0 => Err(e),
            _ if self.into.is_some() => Ok(Reply::Placed(moved)),
            _ if self.read => Ok(Reply::Data(data)),
            _ => Ok(Reply::Written(moved)),
        }
    }
}

/// A read or write of more than one message's data as parts of at most one message each, in
/// order; `None` for any other operation (it goes whole).
fn parts_of(op: &Op) -> Option<Vec<Op>> {
    let parts = match op {
        Op::Read { ino, offset, len } if *len > ring::DATA_BYTES_MAX => (0..*len)
            .step_by(ring::DATA_BYTES_MAX)
            .map(|at| Op::Read {
                ino: *ino,
                offset: offset + at as u64,
                len: (len - at).min(ring::DATA_BYTES_MAX),
            })
            .collect(),
        Op::Write { ino, offset, data } if data.len() > ring::DATA_BYTES_MAX => (0..data.len())
            .step_by(ring::DATA_BYTES_MAX)
            .map(|at| Op::Write {
                ino: *ino,
                offset: offset + at as u64,
                // A slice of the operation's bytes, not a copy.
                data: data.slice(at..(at + ring::DATA_BYTES_MAX).min(data.len())),
            })
            .collect(),
        _ => return None,
    };
    Some(parts)
}

/// A thread's client of a connection: what [`reactor::Client`] is for an in-process mount.
pub struct RemoteClient {
    conn: Arc<Connection>,
    /// Submitted operations: slot, token, whether a large transfer
    /// ([`Op::is_large_transfer`]), and where a read's data goes when its caller said.
    in_flight: Vec<InFlight>,
    /// Slots of posted releases, oldest first: nobody waits for their answers, which are
    /// read (and the slots freed) before this thread's next request.
    posted: VecDeque<usize>,
    /// Completions known before any answer came (an operation refused at submit).
    ready: VecDeque<Completion>,
    sent: u64,
}

impl RemoteClient {
    pub fn new(conn: Arc<Connection>) -> RemoteClient {
        RemoteClient {
            conn,
            in_flight: Vec::new(),
            posted: VecDeque::new(),
            ready: VecDeque::new(),
            sent: 0,
        }
    }

    #[cfg(feature = "sim")]
    pub fn requests_sent(&self) -> u64 {
        self.sent
    }

    /// One operation, answered: a read or write of more than one message's data goes as
    /// several.
    pub fn call(&mut self, op: Op) -> Result<Reply, EngineError> {
        match op {
            Op::Read { ino, offset, len } if len > ring::DATA_BYTES_MAX => {
                let mut data = vec![0u8; len];
                let n = self.read_into(ino, offset, &mut data)?;
                data.truncate(n);
                Ok(Reply::Data(data))
            }
            Op::Write { ino, offset, data } if data.len() > ring::DATA_BYTES_MAX => {
                // Slices of the operation's bytes, each copied once, into its slot.
                self.write_from(ino, offset, false, &data)
            }
            op => self.one(op),
        }
    }

    /// Reads `out.len()` bytes of `ino` at `offset` (fewer at the end of the file) straight
    /// into `out`: each answer's data is copied once, from its slot into its place, or not at
    /// all here when `out` lies in the shared buffer arena (the server puts it there). A read
    /// longer than one message goes as several, in order, stopping at a short one. Returns
    /// the bytes read.
    pub fn read_into(
        &mut self,
        ino: u64,
        offset: u64,
        out: &mut [u8],
    ) -> Result<usize, EngineError> {
        // A buffer in the shared arena gets its data from the server itself.
        let shared_at = self.conn.shared_at(out.as_ptr(), out.len());
        let mut done = 0;
        loop {
            let part = (out.len() - done).min(ring::DATA_BYTES_MAX);
            let n = match shared_at {
                Some(at) => {
                    let request = wire::Request::Read(wire::ReadShared {
                        ino,
                        offset: offset + done as u64,
                        len: part as u32,
                        at: at + done as u64,
                    });
                    self.exchange(&request, |bytes| wire::decode_placed(bytes, part))?
                }
                None => {
                    let request = wire::Request::Op(Op::Read {
                        ino,
                        offset: offset + done as u64,
                        len: part,
                    });
                    let into = &mut out[done..done + part];
                    self.exchange(&request, |bytes| wire::decode_read_into(bytes, into))?
                }
            };
            done += n;
            if n < part || done == out.len() {
                return Ok(done);
            }
        }
    }

    fn one(&mut self, op: Op) -> Result<Reply, EngineError> {
        self.request(&wire::Request::Op(op))
    }

    /// Writes `data` at `offset` of `ino` (with `append`, at its end, atomically) from the
    /// caller's buffer straight into the slot's data area, this side's only copy of the bytes
    /// ([`wire::Request::Write`]), or with no copy here when `data` lies in the shared buffer
    /// arena (the server copies it from there). More than a slot's data goes as several
    /// writes, in order, counted as pwrite(2) counts (up to a short part or an error; the
    /// error only when nothing was written); an append of more goes whole, in pieces of its
    /// encoding (cut, another appender could land between its parts).
    pub fn write_from(
        &mut self,
        ino: u64,
        offset: u64,
        append: bool,
        data: &[u8],
    ) -> Result<Reply, EngineError> {
        if data.len() <= ring::DATA_BYTES_MAX {
            let shared_at = self.conn.shared_at(data.as_ptr(), data.len());
            let head = wire::Request::Write(wire::WriteBeside {
                ino,
                offset,
                append,
                len: data.len() as u32,
                shared_at,
            });
            let beside = shared_at.is_none().then_some(data);
            return self.exchange_with(&head, beside, wire::decode_answer);
        }
        if append {
            // Whole, as one request: from the arena, named by its place (the server copies it
            // once); otherwise encoded, in pieces.
            if let Some(shared_at) = self.conn.shared_at(data.as_ptr(), data.len()) {
                if data.len() <= wire::SHARED_APPEND_BYTES_MAX {
                    let head = wire::Request::Write(wire::WriteBeside {
                        ino,
                        offset,
                        append,
                        len: data.len() as u32,
                        shared_at: Some(shared_at),
                    });
                    return self.exchange_with(&head, None, wire::decode_answer);
                }
            }
            let data = engine::Bytes::copy_from_slice(data).into();
            return self.one(Op::Append { ino, data });
        }
        let mut written = 0usize;
        for part in data.chunks(ring::DATA_BYTES_MAX) {
            match self.write_from(ino, offset + written as u64, false, part) {
                Ok(Reply::Written(n)) => {
                    written += n;
                    if n < part.len() {
                        break;
                    }
                }
                // As pwrite(2): what was written counts; the error comes next call.
                Err(_) if written > 0 => break,
                other => return other,
            }
        }
        Ok(Reply::Written(written))
    }

    /// A byte-range lock kept by the server ([`wire::Request::Lock`]).
    pub fn lock(
        &mut self,
        ino: u64,
        kind: crate::locks::Kind,
        start: u64,
        len: u64,
        test: bool,
    ) -> Result<Reply, EngineError> {
        self.request(&wire::Request::Lock(wire::LockRequest {
            ino,
            kind,
            start,
            len,
            test,
        }))
    }

    fn request(&mut self, request: &wire::Request) -> Result<Reply, EngineError> {
        self.exchange(request, wire::decode_answer)
    }

    /// The server's statistics ([`wire::Request::ServerStats`]).
    pub fn server_stats(&mut self) -> Result<super::stats::ServerStats, EngineError> {
        self.exchange(&wire::Request::ServerStats, wire::decode_server_stats)
    }

    /// Releases a hold without waiting for the answer (`corefs_release`): a close has
    /// nothing to return that its caller could act on (the handle is gone whatever it says,
    /// as after close(2)), and a create through the C ABI is an open and a release, so
    /// waiting for both made every create two round trips. The release reaches the server
    /// before anything this thread sends next, but the server may run it after that (the
    /// reactor takes a ring's waiting slots together): nothing a later call sees depends on
    /// it, except that an unlinked file's space comes back a moment later. Its answer is
    /// read before the next request; a failure (only a failed server's or a broken
    /// protocol's) is logged.
    pub fn post_release(&mut self, ino: u64) -> Result<(), EngineError> {
        if self.conn.known_dead() {
            return Err(gone(&self.conn.socket_path));
        }
        self.reap_posted(POSTED_MAX - 1)?;
        let i = self.conn.claim_waiting()?;
        self.conn
            .send(i, &wire::Request::Op(Op::Release { ino }), None)
            .map_err(EngineError::from)?;
        self.sent += 1;
        self.posted.push_back(i);
        Ok(())
    }

    /// Reads the answers of posted releases that are in, and waits for the oldest until at
    /// most `keep` remain.
    fn reap_posted(&mut self, keep: usize) -> Result<(), EngineError> {
        while let Some(&i) = self.posted.front() {
            if self.posted.len() <= keep && !self.conn.is_done(i) {
                break;
            }
            self.conn.wait_done(i, None, true)?;
            self.posted.pop_front();
            if let Err(e) = self.conn.finish(i) {
                tracing::warn!("a posted release failed on the server: {e}");
            }
        }
        Ok(())
    }

    /// Sends `request`, waits for its answer and decodes it with `decode`.
    fn exchange<T>(
        &mut self,
        request: &wire::Request,
        decode: impl FnOnce(&[u8]) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        self.exchange_with(request, None, decode)
    }

    /// [`RemoteClient::exchange`] of `request` and, for a [`wire::Request::Write`], the
    /// bytes that go `beside` it ([`Connection::send`]).
    fn exchange_with<T>(
        &mut self,
        request: &wire::Request,
        beside: Option<&[u8]>,
        decode: impl FnOnce(&[u8]) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        // A server that went since the last look is found by the wait (every
        // `LIVENESS_CHECK`), not by a poll of the socket before every request.
        if self.conn.known_dead() {
            return Err(gone(&self.conn.socket_path));
        }
        self.reap_posted(POSTED_MAX - 1)?;
        let i = self.conn.claim_waiting()?;
        let started = Instant::now();
        match self.conn.send(i, request, beside) {
            Ok(()) => {}
            // A write beside its message always fits (its message is a few bytes).
            Err(wire::Unsent::TooLarge) if beside.is_none() => {
                return self.exchange_in_pieces(request, decode)
            }
            Err(e) => return Err(e.into()),
        }
        self.sent += 1;
        let quick = match request {
            wire::Request::Op(op) => op.waits_awake(),
            wire::Request::Read(r) => r.op().waits_awake(),
            // A write is quick (`Op::is_quick`).
            wire::Request::Lock(_) | wire::Request::Write(_) => true,
            wire::Request::ServerStats | wire::Request::Piece(_) => false,
        };
        self.conn.wait_done(i, None, quick)?;
        // A slow call looks at this thread's run delay and the machine's other work, as an
        // in-process client's does (no reactor samples the machine in a client process).
        let took = started.elapsed();
        if took >= reactor::contention::SLOW_CALL {
            reactor::contention::sample_machine(Instant::now());
            reactor::contention::after_call(took);
        }
        self.conn.finish_with(i, decode)
    }

    /// A request too large for one message (an append or atomic batch of more than 1 MiB;
    /// a write is cut into writes instead): its encoding goes in [`wire::Piece`]s of at most
    /// one message's data, each answered once the server kept it, and the last is answered
    /// as the request. A refused piece ends it: the server drops what it kept.
    fn exchange_in_pieces<T>(
        &mut self,
        request: &wire::Request,
        decode: impl FnOnce(&[u8]) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let last = self.send_leading_pieces(request)?;
        self.exchange(&last, decode)
    }

    /// Sends `request`'s encoding as [`wire::Piece`]s of at most one message's data, each
    /// answered once the server kept it (in order: it keeps them by arrival), but the last,
    /// which it returns for the caller to send as the request. A refused piece is the error
    /// (the server dropped what it kept).
    fn send_leading_pieces(
        &mut self,
        request: &wire::Request,
    ) -> Result<wire::Request, EngineError> {
        let bytes = postcard::to_allocvec(request)
            .map_err(|e| EngineError::Invalid(format!("the request cannot be encoded: {e}")))?;
        let id = self.conn.next_piece_id.fetch_add(1, Ordering::Relaxed);
        let mut pieces = bytes.chunks(ring::DATA_BYTES_MAX).peekable();
        while let Some(bytes) = pieces.next() {
            let piece = wire::Request::Piece(wire::Piece {
                id,
                last: pieces.peek().is_none(),
                bytes: bytes.to_vec(),
            });
            if pieces.peek().is_none() {
                return Ok(piece);
            }
            match self.request(&piece)? {
                Reply::Done => {}
                other => {
                    return Err(EngineError::Refused {
                        errno: libc::EIO,
                        message: format!("unexpected reply to a request's piece {other:?}"),
                    })
                }
            }
        }
        Err(EngineError::Internal("a request of no bytes".into()))
    }

    /// Submits `op`; its completion comes from [`RemoteClient::poll`].
    pub fn submit(&mut self, op: Op, token: u64) -> Result<(), SubmitError> {
        self.submit_into(op, token, None)
    }

    /// Submits `op`, a read whose data `into` receives when given: its answer is decoded
    /// from the slot straight there and completes as [`Reply::Placed`].
    pub fn submit_into(
        &mut self,
        op: Op,
        token: u64,
        into: Option<ReadDest>,
    ) -> Result<(), SubmitError> {
        if self.refused_dead(token) {
            return Ok(());
        }
        let large = op.is_large_transfer();
        let read = matches!(op, Op::Read { .. });
        let (parts, lens): (Vec<Op>, Vec<usize>) = match parts_of(&op) {
            Some(parts) => {
                let lens = parts
                    .iter()
                    .map(|p| match p {
                        Op::Read { len, .. } => *len,
                        Op::Write { data, .. } => data.len(),
                        _ => 0,
                    })
                    .collect();
                (parts, lens)
            }
            None => {
                let len = match &op {
                    Op::Read { len, .. } => *len,
                    _ => 0,
                };
                (Vec::new(), vec![len])
            }
        };
        if self.refused_too_many(lens.len(), token) {
            return Ok(());
        }
        // A read into the shared buffer arena (all of it inside the caller's buffer): the
        // server puts each part's data in its place there.
        let placed_at = match (&op, into) {
            (&Op::Read { offset, len, .. }, Some(dest)) if len <= dest.len => {
                self.conn.shared_at(dest.ptr, len).map(|at| (at, offset))
            }
            _ => None,
        };
        let request = |op: Op| match (placed_at, op) {
            (Some((at, first)), Op::Read { ino, offset, len }) => {
                Outgoing::alone(wire::Request::Read(wire::ReadShared {
                    ino,
                    offset,
                    len: len as u32,
                    at: at + (offset - first),
                }))
            }
            (_, op) => Outgoing::alone(wire::Request::Op(op)),
        };
        // Every slot first, so an operation is sent whole or not at all.
        let Some(slots) = self.conn.claim_all(lens.len()) else {
            return Err(SubmitError::Full(op));
        };
        let requests: Vec<Outgoing> = if parts.is_empty() {
            vec![request(op)]
        } else {
            parts.into_iter().map(request).collect()
        };
        let sent = Sent {
            token,
            large,
            read,
            into,
            placed: placed_at.is_some(),
        };
        self.send_claimed(slots, requests, &lens, sent)
    }

    /// Submits a write of `data` at `offset` of `ino` (with `append`, at its end,
    /// atomically), its bytes copied during the call from `data` straight into the slots'
    /// data areas ([`wire::Request::Write`]), or not at all when `data` lies in the shared
    /// buffer arena: the server copies each part from there, so the caller keeps `data` as it
    /// is until the completion. As [`RemoteClient::submit_into`] of the operation otherwise:
    /// more than a slot's data goes as several writes (an append of more goes whole, in
    /// pieces), all sent or none (`Full`).
    pub fn submit_write(
        &mut self,
        ino: u64,
        offset: u64,
        append: bool,
        data: &[u8],
        token: u64,
    ) -> Result<(), SubmitError> {
        let owned = || {
            let data = engine::Bytes::copy_from_slice(data).into();
            Op::write_or_append(ino, offset, append, data)
        };
        // A buffer in the shared arena is not copied here: the server copies each part from
        // there (the caller keeps it as it is until the completion, by contract).
        let shared_at = self.conn.shared_at(data.as_ptr(), data.len());
        // An append goes whole: as one request naming its place in the arena, or else in
        // pieces of its encoding.
        let whole_from_arena =
            append && shared_at.is_some() && data.len() <= wire::SHARED_APPEND_BYTES_MAX;
        if append && data.len() > ring::DATA_BYTES_MAX && !whole_from_arena {
            return self.submit_into(owned(), token, None);
        }
        if self.refused_dead(token) {
            return Ok(());
        }
        // One part at least: an empty write is a message too.
        let parts: Vec<&[u8]> = if data.is_empty() || whole_from_arena {
            vec![data]
        } else {
            data.chunks(ring::DATA_BYTES_MAX).collect()
        };
        // One part completes with its own reply, as a whole operation does (its length
        // counts only in a sum of parts).
        let lens: Vec<usize> = match parts.len() {
            1 => vec![0],
            _ => parts.iter().map(|p| p.len()).collect(),
        };
        if self.refused_too_many(lens.len(), token) {
            return Ok(());
        }
        let Some(slots) = self.conn.claim_all(lens.len()) else {
            return Err(SubmitError::Full(owned()));
        };
        let requests = parts
            .iter()
            .enumerate()
            .map(|(k, part)| {
                let at = k * ring::DATA_BYTES_MAX;
                let head = wire::WriteBeside {
                    ino,
                    offset: offset + at as u64,
                    append,
                    len: part.len() as u32,
                    shared_at: shared_at.map(|s| s + at as u64),
                };
                Outgoing {
                    request: wire::Request::Write(head),
                    beside: shared_at.is_none().then_some(*part),
                }
            })
            .collect();
        let sent = Sent {
            token,
            // As `Op::is_large_transfer` says of the operation.
            large: !append && data.len() >= reactor::op::LARGE_TRANSFER_BYTES,
            read: false,
            into: None,
            placed: false,
        };
        self.send_claimed(slots, requests, &lens, sent)
    }

    /// Whether the server is known gone: then `token` completes with that error at once.
    fn refused_dead(&mut self, token: u64) -> bool {
        if !self.conn.known_dead() {
            return false;
        }
        self.ready.push_back(Completion {
            token,
            result: Err(gone(&self.conn.socket_path)),
        });
        true
    }

    /// Whether an operation of `parts` messages needs more slots than the ring has: then
    /// `token` completes with EINVAL at once.
    fn refused_too_many(&mut self, parts: usize, token: u64) -> bool {
        if parts <= SLOTS {
            return false;
        }
        self.ready.push_back(Completion {
            token,
            result: Err(EngineError::Invalid(format!(
                "an asynchronous read or write of more than {} MiB through the service \
                 (its ring's {SLOTS} messages of 1 MiB): submit it in smaller parts",
                (SLOTS * ring::DATA_BYTES_MAX) >> 20
            ))),
        });
        true
    }

    /// Sends `requests`, the messages of one submitted operation, in `slots` (claimed, one
    /// each, in order) and keeps the operation in flight; `lens` are the bytes each moves.
    /// A part that cannot be sent frees its slot and those after it, and the operation
    /// completes with the parts sent (or, with none, that error).
    fn send_claimed(
        &mut self,
        slots: Vec<usize>,
        requests: Vec<Outgoing<'_>>,
        lens: &[usize],
        sent_as: Sent,
    ) -> Result<(), SubmitError> {
        assert_eq!(slots.len(), requests.len(), "a slot for every message");
        let Sent {
            token,
            large,
            read,
            into,
            placed,
        } = sent_as;
        let whole = requests.len() == 1;
        let mut sent = Vec::with_capacity(slots.len());
        let mut cut = None;
        for ((i, request), len) in slots.iter().zip(requests).zip(lens) {
            if cut.is_some() {
                self.conn
                    .region
                    .slot(*i)
                    .state
                    .store(FREE, Ordering::Release);
                continue;
            }
            let Outgoing { request, beside } = request;
            match self.conn.send(*i, &request, beside) {
                Ok(()) => {
                    self.sent += 1;
                    sent.push((*i, *len));
                }
                // An operation that must go whole (an append, an atomic batch) and does not
                // fit a message: its pieces go now, its last as this operation.
                Err(wire::Unsent::TooLarge) if whole && beside.is_none() => {
                    return self.submit_in_pieces(&request, token, large, read);
                }
                // The slot is free again; the parts sent still complete.
                Err(e) => cut = Some(EngineError::from(e)),
            }
        }
        if sent.is_empty() {
            // Nothing went: the error is this operation's completion.
            self.ready.push_back(Completion {
                token,
                result: Err(cut.expect("an unsent operation has its error")),
            });
            return Ok(());
        }
        self.in_flight.push(InFlight {
            parts: sent,
            token,
            large,
            read,
            into,
            placed,
            cut,
        });
        Ok(())
    }

    /// Submits `request`, too large for one message, as [`wire::Piece`]s: every piece but
    /// the last is sent and answered now (in order: the server keeps them by arrival), the
    /// last goes as the operation in flight, in a slot claimed before anything is sent (none
    /// free: `Full`, as for any submit). Completions already in are set aside first (their
    /// slots freed), so the pieces find slots. A refused piece is the operation's completion.
    fn submit_in_pieces(
        &mut self,
        request: &wire::Request,
        token: u64,
        large: bool,
        read: bool,
    ) -> Result<(), SubmitError> {
        let mut done = Vec::new();
        self.poll(&mut done);
        self.ready.extend(done);
        let last_slot = match (self.conn.claim(), request) {
            (Some(i), _) => i,
            (None, wire::Request::Op(op)) => return Err(SubmitError::Full(op.clone())),
            (None, _) => {
                let e = EngineError::Internal("a submitted request that is no operation".into());
                self.ready.push_back(Completion {
                    token,
                    result: Err(e),
                });
                return Ok(());
            }
        };
        let sent = match self.send_leading_pieces(request) {
            // A failed send frees its slot.
            Ok(last) => self
                .conn
                .send(last_slot, &last, None)
                .map_err(EngineError::from),
            Err(e) => {
                self.conn
                    .region
                    .slot(last_slot)
                    .state
                    .store(FREE, Ordering::Release);
                Err(e)
            }
        };
        match sent {
            Ok(()) => {
                self.sent += 1;
                self.in_flight.push(InFlight {
                    parts: vec![(last_slot, 0)],
                    token,
                    large,
                    read,
                    into: None,
                    placed: false,
                    cut: None,
                });
            }
            Err(e) => {
                self.ready.push_back(Completion {
                    token,
                    result: Err(e),
                });
            }
        }
        Ok(())
    }

    /// Whether this thread streams: two or more operations in flight, every one a large
    /// transfer. [`RemoteClient::wait`] then sleeps for the next answer at once, as an
    /// in-process client does ([`reactor::Client::streaming`]): answers come hundreds of
    /// microseconds apart and the server's device stays busy with the others meanwhile.
    pub fn streaming(&self) -> bool {
        self.in_flight.len() >= 2 && self.in_flight.iter().all(|f| f.large)
    }

    /// Whether [`RemoteClient::wait`] sleeps at once: while this thread streams, or keeps a
    /// deep queue ([`reactor::DEEP_QUEUE_REQUESTS`] in flight), as an in-process client does
    /// ([`reactor::Client::waits_asleep`]).
    pub fn waits_asleep(&self) -> bool {
        self.streaming() || self.in_flight.len() >= reactor::DEEP_QUEUE_REQUESTS
    }

    /// Completions ready now.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        let before = out.len();
        out.extend(self.ready.drain(..));
        let conn = self.conn.clone();
        let dead = !self.in_flight.is_empty()
            && !self.in_flight.iter().any(|f| f.done(&conn))
            && conn.dead.load(Ordering::Acquire);
        for f in std::mem::take(&mut self.in_flight) {
            if f.done(&conn) {
                let token = f.token;
                out.push(Completion {
                    token,
                    result: f.collect(&conn),
                });
            } else if dead {
                out.push(Completion {
                    token: f.token,
                    result: Err(gone(&conn.socket_path)),
                });
            } else {
                self.in_flight.push(f);
            }
        }
        out.len() - before
    }

    /// As [`RemoteClient::poll`], waiting up to `timeout` for at least one completion.
    pub fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.poll(out);
            if n > 0 || self.in_flight.is_empty() {
                return n;
            }
            let i = self.in_flight[0].waiting_slot(&self.conn);
            let how = if self.waits_asleep() {
                Waiting::Asleep
            } else {
                Waiting::Policy { quick: false }
            };
            match self.conn.wait_slot(i, Some(deadline), how) {
                Ok(true) => continue,
                Ok(false) => return self.poll(out),
                Err(_) => {
                    // The server is gone: every operation in flight completes with that.
                    self.conn.dead.store(true, Ordering::Release);
                    return self.poll(out);
                }
            }
        }
    }
}

impl Drop for RemoteClient {
    /// A thread that goes with operations in flight (its submissions never polled) gives
    /// their slots back once they are answered, so a connection does not run out of slots.
    fn drop(&mut self) {
        let _ = self.reap_posted(0);
        // Answers nobody collects are read out of their slots and dropped, never into a
        // caller's buffer (its read was never completed to it).
        for f in std::mem::take(&mut self.in_flight) {
            for (i, _) in f.parts {
                if self.conn.wait_done(i, None, false).is_ok() {
                    let _ = self.conn.finish(i);
                }
            }
        }
    }
}
