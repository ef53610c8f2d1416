//! The server: owns a mounted filesystem ([`reactor::Runtime`]), accepts clients on a Unix
//! socket, and serves each connection's ring with a few worker threads.
//!
//! # Invariants
//! - Every connection has its own shared memory, workers and table of the inodes it holds
//!   open ([`Holds`]); nothing one client sends reaches another's.
//! - A read, write, truncate, fallocate, fsync or release names an inode the connection holds
//!   open for it (opened readable for a read, writable for a change). A release gives back
//!   one of the connection's own holds, taken from its table before the engine sees it, so
//!   two racing releases cannot give back a hold another connection owns.
//! - When a client goes (its socket closes: exit, kill -9), its workers finish the requests
//!   they took, and every hold it still has is released: its open-unlinked files go.
//! - Stopping ([`serve`]'s `stop`): no new connection is taken, workers finish what they
//!   took and answer what was still waiting with ESHUTDOWN, every connection's holds are
//!   released, and the filesystem is committed and unmounted.
//!
//! # Fault model
//! Clients are not trusted ([`super::ring`] says how their memory is read; [`super::access`]
//! how their requests are checked). Sizes are capped before the engine sees them: a read
//! moves at most one message's data, a directory listing at most [`READDIR_ENTRIES_MAX`]
//! entries, a connection holds at most [`HOLDS_MAX`] inodes.

use super::access::{self, Caller};
use super::arena::ClientArena;
use super::ring::{self, Region, DONE, HANDOFF, SLOTS, SUBMITTED, TAKEN};
use super::stats::{ClientStats, Counters, ServerStats, Work};
use super::{socket, wire};
use crate::locks::{Kind, LockTable, Refused, RANGES_MAX};
use engine::EngineError;
use reactor::{Client, Op, Opened, Reply, Runtime};
use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Weak;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Worker threads per connection: the requests of one client process served at once (its
/// fsyncs grouped by the reactor, its reads overlapped).
const WORKERS: usize = 8;
/// The most inodes one connection may hold open (counting each open).
pub const HOLDS_MAX: u32 = 65536;
/// The most entries one directory listing returns (the reply must fit a message).
pub const READDIR_ENTRIES_MAX: usize = 1024;
/// How long an idle worker spins on its doorbell before it sleeps.
const SPIN: Duration = Duration::from_micros(30);
/// A sleeping worker's longest nap: it looks at the connection's and the server's state at
/// least this often.
const NAP: Duration = Duration::from_millis(100);
/// Requests in flight per worker's reactor client.
const CLIENT_CAPACITY: usize = 64;

/// How the server runs besides its runtime.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// The reactors' cores, when they are pinned: the storage cores. The connections'
    /// workers run there too, beside a reactor that spins and then parks (a worker then
    /// often runs a request itself while the reactor sleeps), or on the other cores when the
    /// reactors busy-poll (a worker preempted by a busy-polling reactor waits a whole
    /// scheduler tick). Empty: workers unpinned.
    pub reactor_cores: Vec<usize>,
    pub busy_poll: bool,
}

/// What a serve did, for the operator.
#[derive(Debug, Default, Clone)]
pub struct Served {
    pub connections: u64,
    pub requests: u64,
    /// Holds released for clients that went without releasing them.
    pub holds_released_for_gone_clients: u64,
    pub stats: Option<reactor::ReactorStats>,
}

/// The inodes one connection holds open, and for what.
#[derive(Default)]
struct Holds {
    by_ino: HashMap<u64, Held>,
    total: u32,
}

#[derive(Clone, Copy, Default)]
struct Held {
    count: u32,
    /// Some open of it was for reading / writing (the kernel checks access at open, and a
    /// handle keeps what it was granted: so does the union of a connection's opens).
    readable: bool,
    writable: bool,
}

/// What a handle operation needs of the connection's holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    Read,
    Write,
    Any,
}

struct Conn {
    id: u64,
    region: Region,
    /// The client's buffer arena, once mapped (the handshake's second half, read by the
    /// connection's watcher): requests naming places in it fail until then.
    arena: std::sync::OnceLock<ClientArena>,
    caller: Caller,
    pid: i32,
    /// The client's CPU time is this server's own work when judging contention (see
    /// `reactor::contention`): held as long as the connection lives.
    _partner: reactor::contention::Partner,
    holds: Mutex<Holds>,
    /// The client's socket closed.
    gone: AtomicBool,
    stopping: Arc<AtomicBool>,
    counters: Counters,
    registry: Arc<Registry>,
    /// Every connection's byte-range locks (one table for the server); this connection's
    /// are owned by its id and released when it goes.
    locks: Arc<Mutex<LockTable>>,
    /// The reactor takes this ring's requests itself ([`ReactorSide`]); the workers take only
    /// what it hands them.
    reactor_served: AtomicBool,
    /// Requests the reactor took and has not answered yet.
    reactor_in_flight: AtomicU64,
    /// Per slot, what a request the reactor took does once answered.
    pending: Vec<Mutex<Option<Pending>>>,
    /// Per slot, the request the reactor read and handed to the workers: they serve what it
    /// read (a request sent in pieces is in no slot whole, and its kept pieces are gone).
    handed: Vec<Mutex<Option<wire::Request>>>,
    /// Where the reactor's next look at the ring starts (no slot waits behind the others).
    next_take: std::sync::atomic::AtomicUsize,
    /// The doorbell's value when the reactor last looked at every slot (`u64::MAX`: never):
    /// it looks again only once the doorbell moved.
    looked_at_bell: AtomicU64,
    /// One idle worker spins on the doorbell for the next request; the others sleep (a
    /// spinning worker per request in flight would take the cores the client and the
    /// reactor need).
    spinner: AtomicBool,
    /// Pieces of requests too large for one message, until their last piece.
    pieces: Mutex<Pieces>,
}

/// The most bytes of request pieces one connection may have kept at once, and the most
/// requests in pieces: what a client sends before its last piece is held in the server's
/// memory.
pub const PIECES_BYTES_MAX: usize = 256 << 20;
const _: () = assert!(wire::SHARED_APPEND_BYTES_MAX == PIECES_BYTES_MAX);
pub const PIECES_REQUESTS_MAX: usize = 64;

/// A connection's requests sent in pieces ([`wire::Request::Piece`]): id → bytes so far.
#[derive(Default)]
struct Pieces {
    by_id: HashMap<u64, Vec<u8>>,
    bytes: usize,
}

impl Pieces {
    fn take(&mut self, id: u64) -> Option<Vec<u8>> {
        let taken = self.by_id.remove(&id)?;
        self.bytes -= taken.len();
        Some(taken)
    }
}

impl Conn {
    fn holds(&self) -> std::sync::MutexGuard<'_, Holds> {
        self.holds.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn need(&self, ino: u64, need: Need) -> Result<(), EngineError> {
        let holds = self.holds();
        let ok = holds.by_ino.get(&ino).is_some_and(|h| match need {
            Need::Read => h.readable,
            Need::Write => h.writable,
            Need::Any => true,
        });
        if ok {
            return Ok(());
        }
        Err(EngineError::Refused {
            errno: libc::EBADF,
            message: format!(
                "inode {ino} is not open {}on this connection",
                match need {
                    Need::Read => "for reading ",
                    Need::Write => "for writing ",
                    Need::Any => "",
                }
            ),
        })
    }

    fn room_for_hold(&self) -> Result<(), EngineError> {
        if self.holds().total >= HOLDS_MAX {
            return Err(EngineError::Refused {
                errno: libc::EMFILE,
                message: format!("this connection holds {HOLDS_MAX} files open"),
            });
        }
        Ok(())
    }

    fn add_hold(&self, ino: u64, readable: bool, writable: bool) {
        let mut holds = self.holds();
        holds.total += 1;
        let h = holds.by_ino.entry(ino).or_default();
        h.count += 1;
        h.readable |= readable;
        h.writable |= writable;
    }

    /// Takes one of the connection's holds on `ino` out of its table (EBADF if it has none).
    fn take_hold(&self, ino: u64) -> Result<Held, EngineError> {
        let mut holds = self.holds();
        let Some(h) = holds.by_ino.get_mut(&ino) else {
            return Err(EngineError::Refused {
                errno: libc::EBADF,
                message: format!("inode {ino} is not open on this connection"),
            });
        };
        let taken = *h;
        h.count -= 1;
        if h.count == 0 {
            holds.by_ino.remove(&ino);
        }
        holds.total -= 1;
        Ok(taken)
    }

    fn put_back(&self, ino: u64, held: Held) {
        self.add_hold(ino, held.readable, held.writable);
    }
}

/// The connections open now, for the statistics any of them may ask for.
struct Registry {
    started: Instant,
    connections_total: AtomicU64,
    conns: Mutex<Vec<Weak<Conn>>>,
}

/// A connection as the accept loop keeps it: the socket (to unblock its watcher at stop) and
/// the watcher, which ends after the connection is cleaned up.
struct Live {
    sock: UnixStream,
    watcher: JoinHandle<u64>,
}

/// Serves `runtime` on a Unix socket at `socket_path` until `stop` is set, then stops as the
/// module doc says. The socket's file mode decides who may connect (set `umask`, or chmod
/// it after start); it is removed at the end. Errors: the socket cannot be made (an existing
/// file there is refused, not replaced, unless it is a socket nobody listens on).
pub fn serve(
    runtime: Runtime,
    socket_path: &Path,
    stop: &AtomicBool,
    options: &ServeOptions,
) -> std::io::Result<Served> {
    let worker_cores: Vec<usize> = match reactor::affinity::allowed_cores() {
        Ok(all) if options.busy_poll && !options.reactor_cores.is_empty() => all
            .into_iter()
            .filter(|c| !options.reactor_cores.contains(c))
            .collect(),
        _ => options.reactor_cores.clone(),
    };
    let runtime = Arc::new(runtime);
    let listener = bind(socket_path)?;
    listener.set_nonblocking(true)?;
    tracing::info!(socket = %socket_path.display(), "corefs serving");
    let stopping = Arc::new(AtomicBool::new(false));
    let locks = Arc::new(Mutex::new(LockTable::default()));
    let registry = Arc::new(Registry {
        started: Instant::now(),
        connections_total: AtomicU64::new(0),
        conns: Mutex::new(Vec::new()),
    });
    let mut live: Vec<Live> = Vec::new();
    let mut served = Served::default();
    let mut next_id = 1u64;
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((sock, _)) => {
                match accept(
                    &runtime,
                    sock,
                    next_id,
                    &stopping,
                    &worker_cores,
                    &locks,
                    &registry,
                ) {
                    Ok(l) => {
                        next_id += 1;
                        served.connections += 1;
                        live.push(l);
                    }
                    // A client gone before its memory was handed over (a health check
                    // that only connects) is nobody's loss.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                        tracing::debug!("a client went before its connection was made")
                    }
                    Err(e) => tracing::warn!("a client could not connect: {e}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_readable(&listener, Duration::from_millis(100));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!("accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // Connections that ended are joined as they go (bounded table).
        let (done, running): (Vec<Live>, Vec<Live>) =
            live.into_iter().partition(|l| l.watcher.is_finished());
        live = running;
        for l in done {
            served.holds_released_for_gone_clients += l.watcher.join().unwrap_or(0);
        }
    }
    tracing::info!(
        connections = live.len(),
        "corefs server stopping: finishing what is in flight"
    );
    drop(listener);
    let _ = std::fs::remove_file(socket_path);
    stopping.store(true, Ordering::Release);
    for l in &live {
        let _ = l.sock.shutdown(std::net::Shutdown::Both);
    }
    for l in live {
        served.holds_released_for_gone_clients += l.watcher.join().unwrap_or(0);
    }
    // Every watcher, the only other holder, has ended.
    let runtime = Arc::try_unwrap(runtime)
        .map_err(|_| std::io::Error::other("the runtime is still in use at the stop"))?;
    let stats = runtime
        .shutdown()
        .map_err(|e| std::io::Error::other(format!("unmount: {e}")))?;
    served.stats = Some(stats);
    Ok(served)
}

/// A listening socket at `path`. A socket file nobody listens on (a server killed earlier)
/// is replaced; anything else there is refused.
fn bind(path: &Path) -> std::io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            use std::os::unix::fs::FileTypeExt;
            let is_socket = std::fs::symlink_metadata(path)?.file_type().is_socket();
            if is_socket && UnixStream::connect(path).is_err() {
                std::fs::remove_file(path)?;
                return UnixListener::bind(path);
            }
            Err(std::io::Error::new(
                e.kind(),
                format!(
                    "{} exists{}",
                    path.display(),
                    if is_socket {
                        " and a server answers there"
                    } else {
                        " and is not a socket"
                    }
                ),
            ))
        }
        Err(e) => Err(e),
    }
}

fn wait_readable(listener: &UnixListener, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, timeout.as_millis() as libc::c_int) };
}

fn accept(
    runtime: &Arc<Runtime>,
    sock: UnixStream,
    id: u64,
    stopping: &Arc<AtomicBool>,
    worker_cores: &[usize],
    locks: &Arc<Mutex<LockTable>>,
    registry: &Arc<Registry>,
) -> std::io::Result<Live> {
    sock.set_nonblocking(false)?;
    let peer = socket::peer(&sock)?;
    let (memory, region) = Region::create()?;
    // The reactor takes the ring's requests itself (one reactor, an eventfd doorbell to hand
    // over): root's all, anyone else's that need no permission check (reads, writes, fsyncs
    // through a handle); the rest it hands to the workers.
    let doorbell = runtime
        .doorbell_fd()
        .filter(|_| runtime.reactors() == 1 && reactor_serves());
    if doorbell.is_some() {
        region
            .header()
            .served_by_reactor
            .store(1, Ordering::Release);
    }
    {
        use std::os::fd::AsRawFd;
        let mut fds = vec![memory.as_raw_fd()];
        fds.extend(doorbell);
        socket::send_fds(&sock, &fds)?;
    }
    drop(memory);
    tracing::info!(
        connection = id,
        pid = peer.pid,
        uid = peer.uid,
        gid = peer.gid,
        "client connected"
    );
    let conn = Arc::new(Conn {
        id,
        region,
        arena: std::sync::OnceLock::new(),
        caller: Caller {
            uid: peer.uid,
            gid: peer.gid,
            groups: peer.groups,
        },
        pid: peer.pid,
        _partner: reactor::contention::Partner::new(peer.pid),
        holds: Mutex::new(Holds::default()),
        gone: AtomicBool::new(false),
        stopping: stopping.clone(),
        counters: Counters::default(),
        registry: registry.clone(),
        spinner: AtomicBool::new(false),
        pieces: Mutex::new(Pieces::default()),
        locks: locks.clone(),
        reactor_served: AtomicBool::new(false),
        reactor_in_flight: AtomicU64::new(0),
        pending: (0..SLOTS).map(|_| Mutex::new(None)).collect(),
        handed: (0..SLOTS).map(|_| Mutex::new(None)).collect(),
        next_take: std::sync::atomic::AtomicUsize::new(0),
        looked_at_bell: AtomicU64::new(u64::MAX),
    });
    {
        let mut conns = registry.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.retain(|c| c.strong_count() > 0);
        conns.push(Arc::downgrade(&conn));
        registry.connections_total.fetch_add(1, Ordering::Relaxed);
    }
    if doorbell.is_some() {
        let side = Arc::new(ReactorSide(conn.clone()));
        match runtime.add_source(id, side.clone(), side) {
            Ok(()) => conn.reactor_served.store(true, Ordering::Release),
            Err(e) => {
                tracing::warn!(connection = id, "workers serve this connection: {e}");
                conn.region
                    .header()
                    .served_by_reactor
                    .store(0, Ordering::Release);
            }
        }
    }
    let mut workers = Vec::with_capacity(WORKERS);
    for k in 0..WORKERS {
        let conn = conn.clone();
        let mut client = runtime.client(CLIENT_CAPACITY);
        let cores = worker_cores.to_vec();
        workers.push(
            std::thread::Builder::new()
                .name(format!("corefs-conn{id}.{k}"))
                .spawn(move || {
                    if !cores.is_empty() {
                        if let Err(e) = reactor::affinity::set_current_thread_cores(&cores) {
                            tracing::warn!("a worker stays unpinned: {e}");
                        }
                    }
                    work(&conn, &mut client)
                })?,
        );
    }
    let mut release_client = runtime.client(CLIENT_CAPACITY);
    let mut watch_sock = sock.try_clone()?;
    let runtime = runtime.clone();
    let watcher = std::thread::Builder::new()
        .name(format!("corefs-conn{id}"))
        .spawn(move || {
            // The client sends one message, its buffer arena (or none), then nothing: a read
            // returns when it closes.
            if take_arena(&conn, &mut watch_sock) {
                let mut byte = [0u8; 1];
                while matches!(watch_sock.read(&mut byte), Ok(n) if n > 0) {}
            }
            conn.gone.store(true, Ordering::Release);
            if conn.reactor_served.load(Ordering::Acquire) {
                // The reactor stops looking at the ring; what it took still completes (an
                // open among it would add a hold), so the holds are released after that.
                runtime.remove_source(conn.id);
                drop(runtime);
                let started = Instant::now();
                while conn.reactor_in_flight.load(Ordering::Acquire) > 0
                    && started.elapsed() < Duration::from_secs(60)
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            ring::futex_wake(&conn.region.header().doorbell, WORKERS as u32);
            for w in workers {
                let _ = w.join();
            }
            let unlocked = conn
                .locks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .release_owner(conn.id);
            let released = release_all(&conn, &mut release_client);
            tracing::info!(
                connection = conn.id,
                pid = conn.pid,
                requests = conn.counters.requests.load(Ordering::Relaxed),
                holds_released = released,
                locks_released = unlocked,
                "client gone"
            );
            released
        })?;
    Ok(Live { sock, watcher })
}

/// The handshake's second half: the client's buffer arena, mapped if it comes and is one
/// ([`ClientArena::map`]), and the answer (1 mapped, 0 not). False when the client went
/// before it said anything.
fn take_arena(conn: &Conn, sock: &mut UnixStream) -> bool {
    let fds = match socket::recv_fds(sock) {
        Ok(fds) => fds,
        Err(_) => return false,
    };
    let mapped = match fds.into_iter().next().map(ClientArena::map) {
        Some(Ok(arena)) => conn.arena.set(arena).is_ok(),
        Some(Err(why)) => {
            tracing::warn!(
                connection = conn.id,
                pid = conn.pid,
                "the client's buffer arena is refused ({why}): its buffers are copied"
            );
            false
        }
        None => false,
    };
    sock.write_all(&[mapped as u8]).is_ok()
}

/// The client's arena, or the error for a request that names a place in it.
fn arena(conn: &Conn) -> Result<&ClientArena, EngineError> {
    conn.arena.get().ok_or_else(|| {
        EngineError::Invalid("a request names the buffer arena of a connection without one".into())
    })
}

/// A range outside the client's arena.
fn outside_arena(at: u64, len: usize) -> EngineError {
    EngineError::Invalid(format!(
        "{len} bytes at {at} of the buffer arena: past its end"
    ))
}

/// The answer to read `r` ([`wire::Request::Read`]): its data put in the client's arena
/// where `r` says, answered with how much; an error stays the error. Never more than `r`
/// asked for: the bytes past it in the arena are another buffer's.
fn place_read(
    conn: &Conn,
    r: &wire::ReadShared,
    result: Result<Reply, EngineError>,
) -> Result<Reply, EngineError> {
    match result? {
        Reply::Data(data) => {
            if data.len() > r.len as usize {
                return Err(EngineError::Internal(format!(
                    "a read of {} bytes answered {}",
                    r.len,
                    data.len()
                )));
            }
            if !arena(conn)?.place(r.at, &data) {
                return Err(outside_arena(r.at, data.len()));
            }
            conn.counters
                .bytes_shared
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok(Reply::Placed(data.len()))
        }
        other => Err(EngineError::Internal(format!("a read answered {other:?}"))),
    }
}

/// Checks a [`wire::Request::Read`]'s place before its read runs (the read is bounded to a
/// reply's size, so its data fits where the client said).
fn check_read(conn: &Conn, r: &wire::ReadShared) -> Result<(), EngineError> {
    let len = r.len as usize;
    if len > ring::DATA_BYTES_MAX {
        return Err(EngineError::Invalid(format!(
            "a read of {len} bytes into shared memory: at most {} per request",
            ring::DATA_BYTES_MAX
        )));
    }
    if !arena(conn)?.holds(r.at, len) {
        return Err(outside_arena(r.at, len));
    }
    Ok(())
}

/// Releases every hold a connection still has; returns how many.
fn release_all(conn: &Conn, client: &mut Client) -> u64 {
    let holds = std::mem::take(&mut *conn.holds());
    let mut released = 0;
    for (ino, held) in holds.by_ino {
        for _ in 0..held.count {
            match client.call(Op::Release { ino }) {
                Ok(_) => released += 1,
                Err(e) => tracing::warn!(ino, "releasing a gone client's hold: {e}"),
            }
        }
    }
    released
}

/// A worker: takes submitted slots and answers them until the client or the server goes.
fn work(conn: &Conn, client: &mut Client) {
    let h = conn.region.header();
    loop {
        let seen = h.doorbell.load(Ordering::SeqCst);
        if take_and_serve(conn, client) {
            continue;
        }
        if conn.gone.load(Ordering::Acquire) {
            return;
        }
        if conn.stopping.load(Ordering::Acquire) {
            refuse_waiting(conn);
            return;
        }
        if !conn.reactor_served.load(Ordering::Acquire)
            && conn
                .spinner
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            let spin_until = Instant::now() + SPIN;
            while h.doorbell.load(Ordering::SeqCst) == seen && Instant::now() < spin_until {
                std::hint::spin_loop();
            }
            conn.spinner.store(false, Ordering::Release);
            if h.doorbell.load(Ordering::SeqCst) != seen {
                continue;
            }
        }
        h.sleepers.fetch_add(1, Ordering::SeqCst);
        ring::futex_wait(&h.doorbell, seen, NAP);
        h.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves every slot this worker can take; false if there was none.
fn take_and_serve(conn: &Conn, client: &mut Client) -> bool {
    let mut any = false;
    // A ring the reactor serves gives its workers only what the reactor hands them.
    let wanted = if conn.reactor_served.load(Ordering::Acquire) {
        HANDOFF
    } else {
        SUBMITTED
    };
    for i in 0..SLOTS {
        let state = &conn.region.slot(i).state;
        if state
            .compare_exchange(wanted, TAKEN, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            any = true;
            let started = Instant::now();
            let handed = conn.handed[i]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            let request = match handed {
                Some(request) => Ok(request),
                None => read_request(conn, i),
            };
            let (bytes, work) = serve_one(conn, client, request);
            answer_counted(conn, i, work, started, bytes);
        }
    }
    any
}

/// Slot `i`'s request, copied out of shared memory and decoded; a write whose bytes are
/// beside it ([`wire::Request::Write`]) as its operation, the bytes staged straight from the
/// slot.
fn read_request(conn: &Conn, i: usize) -> Result<wire::Request, EngineError> {
    let request = match conn.region.take(i) {
        Some(bytes) => wire::decode_request(&bytes)?,
        None => {
            return Err(EngineError::Invalid(
                "a request longer than its slot".into(),
            ))
        }
    };
    match request {
        wire::Request::Write(head) => {
            let len = head.len as usize;
            let staged = match head.shared_at {
                None => conn.region.stage_data(i, len).ok_or_else(|| {
                    EngineError::Invalid(format!(
                        "a write of {len} bytes beside its message: more than a slot holds"
                    ))
                })?,
                // The same bound as in a slot for a write, a request's staging copy being at
                // most 1 MiB; an append (atomic, so whole) as much as a request in pieces.
                Some(at)
                    if len
                        > if head.append {
                            wire::SHARED_APPEND_BYTES_MAX
                        } else {
                            ring::DATA_BYTES_MAX
                        } =>
                {
                    return Err(EngineError::Invalid(format!(
                        "a {} of {len} bytes from shared memory at {at}: more than one request \
                         may carry",
                        if head.append { "append" } else { "write" }
                    )))
                }
                Some(at) => {
                    let staged = arena(conn)?
                        .stage(at, len)
                        .ok_or_else(|| outside_arena(at, len))?;
                    conn.counters
                        .bytes_shared
                        .fetch_add(len as u64, Ordering::Relaxed);
                    staged
                }
            };
            Ok(wire::Request::Op(head.op(staged)))
        }
        // The last piece: the request is every kept piece's bytes, then its own.
        wire::Request::Piece(last) if last.last => {
            let kept = conn
                .pieces
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(last.id);
            let bytes = match kept {
                Some(mut bytes) => {
                    bytes.extend_from_slice(&last.bytes);
                    bytes
                }
                None => last.bytes,
            };
            match wire::decode_request(&bytes)? {
                wire::Request::Piece(_) => Err(EngineError::Invalid(
                    "a request's piece inside a piece".into(),
                )),
                // Its bytes would be the last piece's slot's, which holds a piece.
                wire::Request::Write(_) => Err(EngineError::Invalid(
                    "a write beside its message inside a piece".into(),
                )),
                request => Ok(request),
            }
        }
        request => Ok(request),
    }
}

/// Keeps `piece` of a request until its last ([`wire::Request::Piece`]), within
/// [`PIECES_BYTES_MAX`] and [`PIECES_REQUESTS_MAX`]. On a refusal the request's pieces go:
/// its last piece then fails to decode, and nothing of it runs.
fn keep_piece(conn: &Conn, piece: wire::Piece) -> Result<Reply, EngineError> {
    let mut pieces = conn.pieces.lock().unwrap_or_else(|p| p.into_inner());
    let refused = if pieces.bytes + piece.bytes.len() > PIECES_BYTES_MAX {
        Some(EngineError::Refused {
            errno: libc::EFBIG,
            message: format!(
                "requests in pieces of more than {} MiB kept for one connection",
                PIECES_BYTES_MAX >> 20
            ),
        })
    } else if !pieces.by_id.contains_key(&piece.id) && pieces.by_id.len() >= PIECES_REQUESTS_MAX {
        Some(EngineError::Refused {
            errno: libc::EAGAIN,
            message: format!("more than {PIECES_REQUESTS_MAX} requests in pieces at once"),
        })
    } else {
        None
    };
    if let Some(e) = refused {
        pieces.take(piece.id);
        return Err(e);
    }
    pieces.bytes += piece.bytes.len();
    pieces
        .by_id
        .entry(piece.id)
        .or_default()
        .extend_from_slice(&piece.bytes);
    Ok(Reply::Done)
}

/// Answers slot `i` with `bytes`, counting it as `work` taken at `started`.
fn answer_counted(conn: &Conn, i: usize, work: Work, started: Instant, bytes: wire::Encoded) {
    conn.counters
        .count(work, started.elapsed().as_nanos() as u64);
    answer_slot(conn, i, bytes);
}

/// Hands slot `i`, taken by the reactor, to the connection's workers (they sleep on the
/// doorbell, which this moves once).
fn hand_off(conn: &Conn, i: usize, request: wire::Request) {
    *conn.handed[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(request);
    conn.region.slot(i).state.store(HANDOFF, Ordering::SeqCst);
    let h = conn.region.header();
    h.doorbell.fetch_add(1, Ordering::SeqCst);
    ring::futex_wake(&h.doorbell, 1);
}

/// The answer to one request, and what kind of request it was.
fn serve_one(
    conn: &Conn,
    client: &mut Client,
    request: Result<wire::Request, EngineError>,
) -> (wire::Encoded, Work) {
    match request {
        Ok(wire::Request::Op(op)) => {
            let mut work = work_of(&op);
            let result = execute(conn, client, op);
            count_read_bytes(&mut work, &result);
            (wire::encode_answer(result), work)
        }
        Ok(wire::Request::Lock(l)) => (wire::encode_answer(lock(conn, &l)), Work::Lock),
        // read_request serves a last piece as its request: a piece here is kept.
        Ok(wire::Request::Piece(piece)) => {
            let work = Work::Write(piece.bytes.len() as u64);
            (wire::encode_answer(keep_piece(conn, piece)), work)
        }
        Ok(wire::Request::ServerStats) => (
            wire::encode_server_stats(server_stats(conn, client)),
            Work::Metadata,
        ),
        Ok(wire::Request::Write(_)) => (wire::encode_answer(Err(beside_unread())), Work::Metadata),
        Ok(wire::Request::Read(r)) => {
            let mut work = Work::Read(0);
            let result = check_read(conn, &r)
                .and_then(|()| execute(conn, client, r.op()))
                .and_then(|reply| place_read(conn, &r, Ok(reply)));
            count_read_bytes(&mut work, &result);
            (wire::encode_answer(result), work)
        }
        Err(e) => (wire::encode_answer(Err(e)), Work::Metadata),
    }
}

/// The error for a [`wire::Request::Write`] that reached a server without its bytes: none
/// does ([`read_request`] reads them with it), but the answer is an error, not a panic.
fn beside_unread() -> EngineError {
    EngineError::Invalid("a write beside its message, apart from its slot".into())
}

/// A read counts the bytes its answer carries (or put in the client's arena).
fn count_read_bytes(work: &mut Work, result: &Result<Reply, EngineError>) {
    match (work, result) {
        (Work::Read(n), Ok(Reply::Data(d))) => *n = d.len() as u64,
        (Work::Read(n), Ok(Reply::Placed(m))) => *n = *m as u64,
        _ => {}
    }
}

/// What `op` counts as in the connection's figures (a read's bytes are its answer's).
fn work_of(op: &Op) -> Work {
    match op {
        Op::Read { .. } => Work::Read(0),
        Op::Write { data, .. } | Op::Append { data, .. } => Work::Write(data.len() as u64),
        Op::WriteAtomic { writes, .. } => {
            Work::Write(writes.iter().map(|(_, d)| d.len() as u64).sum())
        }
        Op::Fsync { .. } | Op::Fdatasync { .. } | Op::Sync => Work::Fsync,
        _ => Work::Metadata,
    }
}

/// The server's statistics as `conn`'s user may see them: every connection for root, its own
/// user's otherwise.
fn server_stats(conn: &Conn, client: &mut Client) -> Result<ServerStats, EngineError> {
    let reactors = match client.call(Op::Stats)? {
        Reply::Stats(s) => *s,
        other => return Err(EngineError::Internal(format!("stats answered {other:?}"))),
    };
    let registry = &conn.registry;
    let conns: Vec<Arc<Conn>> = registry
        .conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let clients = conns
        .iter()
        .filter(|c| !c.gone.load(Ordering::Acquire))
        .filter(|c| conn.caller.is_root() || c.caller.uid == conn.caller.uid)
        .map(|c| {
            let mut s = ClientStats {
                connection: c.id,
                pid: c.pid,
                uid: c.caller.uid,
                holds: c.holds().total,
                ..Default::default()
            };
            c.counters.sample(&mut s);
            s
        })
        .collect();
    Ok(ServerStats {
        uptime_ns: registry.started.elapsed().as_nanos() as u64,
        connections_total: registry.connections_total.load(Ordering::Relaxed),
        reactors,
        clients,
    })
}

fn answer_slot(conn: &Conn, i: usize, bytes: wire::Encoded) {
    conn.region.put_parts(i, &[&bytes.head, &bytes.data]);
    let slot = conn.region.slot(i);
    slot.state.store(DONE, Ordering::SeqCst);
    // A spinning client needs no system call (`SlotHeader::waiting`).
    if slot.waiting.load(Ordering::SeqCst) != 0 {
        ring::futex_wake(&slot.state, 1);
    }
}

/// At stop: what was submitted and not taken is answered ESHUTDOWN.
fn refuse_waiting(conn: &Conn) {
    for i in 0..SLOTS {
        let state = &conn.region.slot(i).state;
        if state
            .compare_exchange(SUBMITTED, TAKEN, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let refused = Err(EngineError::Refused {
                errno: libc::ESHUTDOWN,
                message: "the corefs server is stopping".into(),
            });
            answer_slot(conn, i, wire::encode_answer(refused));
        }
    }
}

/// A byte-range lock for the connection (its owner), on an inode it holds open for what the
/// lock needs (reading for a read lock, writing for a write lock, as fcntl(2) asks of a
/// descriptor; only open to ask whether one could be taken).
fn lock(conn: &Conn, l: &wire::LockRequest) -> Result<Reply, EngineError> {
    let wire::LockRequest {
        ino,
        kind,
        start,
        len,
        test,
    } = *l;
    conn.need(
        ino,
        match kind {
            _ if test => Need::Any,
            Kind::Read => Need::Read,
            Kind::Write => Need::Write,
            Kind::Unlock => Need::Any,
        },
    )?;
    let mut locks = conn.locks.lock().unwrap_or_else(|p| p.into_inner());
    let refused = if test {
        locks.test(ino, conn.id, kind, start, len)
    } else {
        locks.set(ino, conn.id, kind, start, len).err()
    };
    match refused {
        None => Ok(Reply::Done),
        Some(Refused::Conflict { .. }) => Err(EngineError::Refused {
            errno: libc::EAGAIN,
            message: format!("inode {ino}: another process holds a conflicting lock"),
        }),
        Some(Refused::Full) => Err(EngineError::Refused {
            errno: libc::ENOLCK,
            message: format!("the server holds {RANGES_MAX} lock ranges"),
        }),
    }
}

/// Whether the reactor may take clients' requests itself (`COREFS_SERVE_WORKERS=1`:
/// never, every request through the connection's workers, for comparison).
fn reactor_serves() -> bool {
    std::env::var_os("COREFS_SERVE_WORKERS").is_none()
}

/// A request the reactor took: what its answer does, what it counts as, since when.
struct Pending {
    after: After,
    work: Work,
    taken: Instant,
    /// A read whose data goes to the client's arena ([`wire::Request::Read`]).
    place: Option<wire::ReadShared>,
}

/// A connection's ring as the reactor sees it ([`reactor::source`]): it takes the submitted
/// requests that need no permission check (all of root's; anyone's through a handle) itself
/// in its loop and answers them in their slots after its batch; it hands the others to the
/// connection's workers (`HANDOFF`).
struct ReactorSide(Arc<Conn>);

impl reactor::source::Source for ReactorSide {
    /// Whether the doorbell moved since the last full look: the reactor asks at every turn
    /// and before every sleep, for every ring, so it reads one word rather than 64 states.
    fn ready(&self) -> bool {
        let conn = &self.0;
        let bell = conn.region.header().doorbell.load(Ordering::SeqCst) as u64;
        bell != conn.looked_at_bell.load(Ordering::Acquire)
    }

    fn take(&self, max: usize, take: &mut dyn FnMut(Op, u64)) -> usize {
        let conn = &self.0;
        // Read before the look: a submit after it moves the doorbell past this value, and
        // the next turn looks again (a client publishes the slot, then rings).
        let bell = conn.region.header().doorbell.load(Ordering::SeqCst);
        if bell as u64 == conn.looked_at_bell.load(Ordering::Acquire) {
            return 0;
        }
        let start = conn.next_take.fetch_add(1, Ordering::Relaxed);
        let mut taken = 0;
        let mut whole = true;
        // Each hand-off moves the doorbell too; not a client's submit, so no reason to look
        // again.
        let mut handed_off = 0u32;
        for k in 0..SLOTS {
            if taken == max {
                // The batch is full: the rest waits for the next turn's look.
                whole = false;
                break;
            }
            let i = (start + k) % SLOTS;
            let state = &conn.region.slot(i).state;
            if state.load(Ordering::Acquire) != SUBMITTED
                || state
                    .compare_exchange(SUBMITTED, TAKEN, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            let started = Instant::now();
            let (op, place) = match read_request(conn, i) {
                Ok(wire::Request::Op(op)) => (op, None),
                Ok(wire::Request::Read(r)) => match check_read(conn, &r) {
                    Ok(()) => (r.op(), Some(r)),
                    Err(e) => {
                        let answer = wire::encode_answer(Err(e));
                        answer_counted(conn, i, Work::Read(0), started, answer);
                        continue;
                    }
                },
                Ok(wire::Request::ServerStats) => {
                    // Needs a reactor client: a worker's.
                    hand_off(conn, i, wire::Request::ServerStats);
                    handed_off += 1;
                    continue;
                }
                Ok(wire::Request::Lock(l)) => {
                    let answer = wire::encode_answer(lock(conn, &l));
                    answer_counted(conn, i, Work::Lock, started, answer);
                    continue;
                }
                // read_request serves a last piece as its request: a piece here is kept.
                Ok(wire::Request::Piece(piece)) => {
                    let work = Work::Write(piece.bytes.len() as u64);
                    let answer = wire::encode_answer(keep_piece(conn, piece));
                    answer_counted(conn, i, work, started, answer);
                    continue;
                }
                Ok(wire::Request::Write(_)) => {
                    let answer = wire::encode_answer(Err(beside_unread()));
                    answer_counted(conn, i, Work::Metadata, started, answer);
                    continue;
                }
                Err(e) => {
                    answer_counted(
                        conn,
                        i,
                        Work::Metadata,
                        started,
                        wire::encode_answer(Err(e)),
                    );
                    continue;
                }
            };
            if !conn.caller.is_root() && !access::needs_no_check(&op) {
                // A permission check needs lookups the reactor cannot make from here: a
                // worker takes it as read here (and checks it).
                let request = match place {
                    Some(r) => wire::Request::Read(r),
                    None => wire::Request::Op(op),
                };
                hand_off(conn, i, request);
                handed_off += 1;
                continue;
            }
            let work = work_of(&op);
            // Root's requests, and anyone's through a handle: no permission check to make.
            match prepare(conn, op, Ok) {
                Ok(Prepared { op, after }) => {
                    *conn.pending[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(Pending {
                        after,
                        work,
                        taken: started,
                        place,
                    });
                    conn.reactor_in_flight.fetch_add(1, Ordering::AcqRel);
                    take(op, i as u64);
                    taken += 1;
                }
                Err(e) => answer_counted(conn, i, work, started, wire::encode_answer(Err(e))),
            }
        }
        if whole {
            let looked = bell.wrapping_add(handed_off);
            conn.looked_at_bell.store(looked as u64, Ordering::Release);
        }
        taken
    }

    fn parked(&self, parked: bool) {
        self.0
            .region
            .header()
            .reactor_parked
            .store(parked as u32, Ordering::SeqCst);
    }
}

impl reactor::source::CompletionSink for ReactorSide {
    fn complete(&self, completion: reactor::Completion) {
        let conn = &self.0;
        let i = completion.token as usize;
        let pending = conn
            .pending
            .get(i)
            .and_then(|p| p.lock().unwrap_or_else(|p| p.into_inner()).take());
        let Some(Pending {
            after,
            mut work,
            taken,
            place,
        }) = pending
        else {
            tracing::error!(slot = i, "an answer for a slot the reactor did not take");
            return;
        };
        let result = completion.result;
        finish(conn, after, &result);
        let result = match place {
            Some(r) => place_read(conn, &r, result),
            None => result,
        };
        count_read_bytes(&mut work, &result);
        answer_counted(conn, i, work, taken, wire::encode_answer(result));
        conn.reactor_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a request does to the connection's holds once it is answered.
enum After {
    Nothing,
    Opened {
        readable: bool,
        writable: bool,
    },
    Held(u64),
    /// The hold a release gave back, taken from the table before the engine saw the
    /// release: put back if the release fails.
    Released(u64, Held),
}

/// A request checked and ready for the engine: the operation to run and what its answer
/// does to the connection's holds ([`finish`]).
struct Prepared {
    op: Op,
    after: After,
}

/// Checks one request for the connection: bounded, admitted by `admit` ([`access`] for a
/// non-root user), its handle checked; a release takes its hold out of the table now.
fn prepare(
    conn: &Conn,
    op: Op,
    admit: impl FnOnce(Op) -> Result<Op, EngineError>,
) -> Result<Prepared, EngineError> {
    let op = admit(bound(op)?)?;
    let inner = match &op {
        Op::Walk { then, .. } => then.as_ref(),
        op => op,
    };
    let after = match inner {
        Op::Read { ino, .. } => {
            conn.need(*ino, Need::Read)?;
            After::Nothing
        }
        Op::Write { ino, .. }
        | Op::Append { ino, .. }
        | Op::Truncate { ino, .. }
        | Op::Fallocate { ino, .. }
        | Op::WriteAtomic { ino, .. } => {
            conn.need(*ino, Need::Write)?;
            After::Nothing
        }
        Op::Fsync { ino } | Op::Fdatasync { ino } => {
            conn.need(*ino, Need::Any)?;
            After::Nothing
        }
        Op::Open { how, .. } => {
            conn.room_for_hold()?;
            After::Opened {
                readable: how.readable,
                writable: how.writable,
            }
        }
        Op::Hold { ino } => {
            conn.room_for_hold()?;
            After::Held(*ino)
        }
        Op::Release { ino } => After::Released(*ino, conn.take_hold(*ino)?),
        _ => After::Nothing,
    };
    Ok(Prepared { op, after })
}

/// What an answered request does to the connection's holds.
fn finish(conn: &Conn, after: After, result: &Result<Reply, EngineError>) {
    match (after, result) {
        (
            After::Opened { readable, writable },
            Ok(Reply::Opened(Opened::Found(s) | Opened::Created(s))),
        ) => conn.add_hold(s.ino, readable, writable),
        (After::Held(ino), Ok(Reply::Done)) => conn.add_hold(ino, false, false),
        (After::Released(ino, held), Err(_)) => conn.put_back(ino, held),
        _ => {}
    }
}

/// Runs one request for the connection through a worker's reactor client.
fn execute(conn: &Conn, client: &mut Client, op: Op) -> Result<Reply, EngineError> {
    let caller = &conn.caller;
    let Prepared { op, after } = prepare(conn, op, |op| access::admit(caller, client, op))?;
    let result = client.call(op);
    finish(conn, after, &result);
    result
}

/// Caps what a request asks for to what a reply can carry, and refuses what no client of
/// this library sends (a walk to an operation that goes through a handle).
fn bound(mut op: Op) -> Result<Op, EngineError> {
    if let Op::Walk { then, .. } = &mut op {
        if !then.walkable() {
            return Err(EngineError::Invalid(
                "a walk to an operation that takes no path".into(),
            ));
        }
    }
    let inner = match &mut op {
        Op::Walk { then, .. } => then.as_mut(),
        op => op,
    };
    match inner {
        Op::Read { len, .. } => *len = (*len).min(ring::DATA_BYTES_MAX),
        Op::Readdir { max, .. } => *max = (*max).clamp(1, READDIR_ENTRIES_MAX),
        _ => {}
    }
    Ok(op)
}
