//! The tables behind the C handles, per-thread clients and the per-thread error message.
//!
//! # Invariants
//! - A filesystem id is never reused within a process (ids only grow), so a closed handle stays
//!   invalid forever; file handles likewise, per filesystem.
//! - Every file handle in a table holds its inode ([`reactor::Op::Hold`]), taken before the
//!   handle is entered and released after it is removed, so an inode stays while a handle to
//!   it exists, with or without a name.
//! - No call on an open handle takes a lock another thread can hold, or writes memory another
//!   thread reads, before it reaches the reactor: `corefs_pread`, `_pwrite` and `_fsync` scale
//!   with threads. Locks ([`Fs::files`], the registry of filesystems, the registry of pin
//!   records) are taken only by open, release, close, mount, and a thread's first call on a
//!   filesystem or first use of a handle, and never across an engine call.
//!
//! # How a handle is resolved without a shared lock
//! - Filesystems: each thread keeps its own list of the filesystems it used ([`Local`]: the
//!   `Arc<Fs>`, its reactor client, its cache of file handles). A call finds its filesystem
//!   there and checks [`Fs::closed`] (read by every thread, written once, at close); only a
//!   thread's first call on a filesystem reads the process-wide registry.
//! - Files: the table of record is [`Fs::files`] (a mutex). Each thread caches the entries it
//!   looked up, tagged with [`Fs::files_epoch`], which every removal bumps; a cached entry is
//!   used only while the epoch is the one it was cached under (fd numbers are never reused,
//!   and an entry never changes while in the table, so only a removal can make one wrong).
//! - A removal must not give back the inode's hold while another thread still uses the entry
//!   it read (a close racing a pread would otherwise let the pread read, or write, an inode
//!   the release deleted). So a call on a file handle *pins* its filesystem for its whole
//!   length ([`FileRef`]): it publishes, in its thread's own cache line ([`PinRecord`]), the
//!   filesystem id, the handle and an odd sequence number, *then* reads the epoch. A removal
//!   bumps the epoch, *then* waits until every pin on that handle (on any handle of the
//!   filesystem, for close) it sees has moved on (its sequence changed), and only then
//!   releases the inode. All four accesses are `SeqCst`, so
//!   either the pin comes before the bump in their single total order (the remover sees it
//!   and waits for the call to end), or the bump comes before the pin's read of the epoch
//!   (the call sees a new epoch, goes to the table, finds the handle gone: EBADF). A waiting
//!   remover watches a sequence number, not the pinned flag, so threads that pin again and
//!   again cannot starve it; it skips its own thread's record (it cannot be inside a handle
//!   call of its own). This is a grace period as in RCU: a release waits for the calls on its
//!   handle already running (close: on any handle of its filesystem), typically
//!   microseconds; an fsync through the handle, as long as that takes.
//! - A pin record belongs to one thread while it lives and is reused after it exits, so the
//!   records number at most the threads alive at once. Without thread-locals (an `atexit`
//!   handler) a call borrows a free record for its length.

use crate::atomic::BatchSlot;
use crate::dispatch::Conn;
pub(crate) use crate::error::Error;
use crate::service::client::{Connection, RemoteClient};
use reactor::{Owner, Runtime};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::CString;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// An open file or directory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenFile {
    pub ino: u64,
    pub dir: bool,
    pub readable: bool,
    pub writable: bool,
    pub append: bool,
}

/// A file handle in its filesystem's table: what it opened, its atomic batch's slot (boxed,
/// so the address cached entries point to stays put while the handle exists), and its
/// asynchronous operations in flight.
struct Handle {
    file: OpenFile,
    batch: Box<BatchSlot>,
    in_flight: Arc<InFlight>,
}

/// A handle's entry as a call sees it: copied into threads' caches with pointers to the
/// handle's batch slot and in-flight count, which [`FileRef`] reads while the call pins the
/// handle.
#[derive(Debug, Clone, Copy)]
struct Entry {
    file: OpenFile,
    batch: NonNull<BatchSlot>,
    in_flight: NonNull<InFlight>,
}

/// A handle's asynchronous operations submitted and not yet polled, and whether the handle
/// was released meanwhile. A pin lasts one call; an asynchronous operation outlives its
/// call, so its hold on the file is this count instead: the inode is released (which deletes
/// it if it has no name left) when the handle is released with nothing in flight, or else
/// when the last operation in flight is polled (its completion runs after the release then).
/// Exactly one of the two sees both conditions, so the inode is released once.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    /// Operations in flight, with [`InFlight::RELEASED`] set once the handle is released.
    state: AtomicU64,
}

impl InFlight {
    const RELEASED: u64 = 1 << 63;

    /// An operation is being submitted (under the handle's pin, so before any release).
    pub fn begin(&self) {
        let before = self.state.fetch_add(1, Ordering::AcqRel);
        assert!(
            before & Self::RELEASED == 0,
            "an asynchronous operation submitted through a released handle"
        );
    }

    /// An operation's completion was polled (or its submission failed); true when it was the
    /// last one of a released handle: the caller releases the inode.
    pub fn end(&self) -> bool {
        let before = self.state.fetch_sub(1, Ordering::AcqRel);
        assert!(before & !Self::RELEASED > 0, "more ends than begins");
        before == Self::RELEASED | 1
    }

    /// The handle is released; true when nothing is in flight: the caller releases the
    /// inode now (else the last [`InFlight::end`] does).
    pub fn release(&self) -> bool {
        let before = self.state.fetch_or(Self::RELEASED, Ordering::AcqRel);
        assert!(before & Self::RELEASED == 0, "a handle released twice");
        before == 0
    }
}

/// A file handle taken out of its table ([`remove_file`]).
pub(crate) struct Removed {
    pub file: OpenFile,
    pub in_flight: Arc<InFlight>,
}

// SAFETY: `batch` and `in_flight` point into the `Box<BatchSlot>` and the `Arc<InFlight>` of
// the handle's table entry, which is dropped only after the handle left the table and every
// call pinning it ended (the pin protocol in the module doc); they are dereferenced only
// through a pinned `FileRef` whose entry was valid under the epoch it read after pinning.
// BatchSlot and InFlight are Sync.
unsafe impl Send for Entry {}
// SAFETY: as above.
unsafe impl Sync for Entry {}

impl Handle {
    fn entry(&self) -> Entry {
        Entry {
            file: self.file,
            batch: NonNull::from(&*self.batch),
            in_flight: NonNull::from(&*self.in_flight),
        }
    }
}

pub(crate) struct Fs {
    pub id: i64,
    pub runtime: Mutex<Option<Runtime>>,
    /// The storage service this filesystem is reached through (`corefs_connect`), instead
    /// of a runtime of its own.
    pub remote: Option<Arc<Connection>>,
    /// The byte-range locks of an in-process mount (a server keeps its clients'), owned by
    /// this filesystem handle: one owner per process, as POSIX locks are.
    pub locks: Mutex<crate::locks::LockTable>,
    /// The file handles (the table of record; threads cache entries, see the module doc).
    files: Mutex<HashMap<i64, Handle>>,
    /// Bumped after every removal from `files`: a cached entry is valid while it is unchanged.
    files_epoch: AtomicU64,
    /// Set once, when `corefs_close` takes the filesystem out of the registry.
    closed: AtomicBool,
    next_fd: AtomicI64,
    /// Who creates inodes unless the calling thread said otherwise ([`set_thread_owner`]):
    /// the mount's owner, or (`None`) the process's effective ids at each call.
    pub owner: Option<Owner>,
    /// Every thread's client slot, for the close to empty ([`take_thread_clients`]); dead
    /// entries (threads gone) are pruned as new ones come.
    clients: Mutex<Vec<std::sync::Weak<ClientSlot>>>,
}

/// One thread's view of one filesystem: the filesystem, the thread's client of it (created at
/// its first engine call), and the file handles it looked up.
pub(crate) struct Local {
    fs: Arc<Fs>,
    client: Arc<ClientSlot>,
    files: RefCell<FileCache>,
}

/// A thread's client of one filesystem, where [`take_thread_clients`] can reach it from
/// the closing thread: a client holds the runtime's request queues, which an idle thread
/// would otherwise keep until it next calls in. Locked by its thread for each call
/// (uncontended but at close).
#[derive(Default)]
pub(crate) struct ClientSlot {
    client: Mutex<Option<Conn>>,
}

/// Thread clients alive, in every filesystem (a test hook reads it).
static THREAD_CLIENTS: AtomicI64 = AtomicI64::new(0);

impl ClientSlot {
    /// Puts `client` in `slot` (this slot's contents, locked), counting it.
    fn fill(slot: &mut Option<Conn>, client: Conn) {
        if slot.replace(client).is_none() {
            THREAD_CLIENTS.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drops the client, if there is one.
    fn take(&self) {
        let taken = self.client.lock().unwrap_or_else(|p| p.into_inner()).take();
        if taken.is_some() {
            THREAD_CLIENTS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let client = self.client.get_mut().unwrap_or_else(|p| p.into_inner());
        if client.take().is_some() {
            THREAD_CLIENTS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The thread clients alive now, over every filesystem (test hook).
#[cfg(feature = "sim")]
pub(crate) fn thread_clients() -> i64 {
    THREAD_CLIENTS.load(Ordering::Relaxed)
}

/// A thread's cached file handles of one filesystem, valid while the filesystem's
/// `files_epoch` is `epoch`.
struct FileCache {
    epoch: u64,
    entries: HashMap<i64, Entry>,
}

/// Entries one thread caches per filesystem; past it the cache starts over (bounded memory).
const FILE_CACHE_ENTRIES_MAX: usize = 4096;

impl FileCache {
    fn get(&mut self, epoch: u64, fd: i64) -> Option<Entry> {
        if self.epoch != epoch {
            self.entries.clear();
            self.epoch = epoch;
            return None;
        }
        self.entries.get(&fd).copied()
    }

    /// Caches `f`, read from the table after `epoch` was read (so valid under it).
    fn put(&mut self, epoch: u64, fd: i64, f: Entry) {
        if self.epoch != epoch {
            self.entries.clear();
            self.epoch = epoch;
        }
        if self.entries.len() >= FILE_CACHE_ENTRIES_MAX {
            self.entries.clear();
        }
        self.entries.insert(fd, f);
    }
}

/// A filesystem as a call sees it: through the calling thread's [`Local`] (no shared
/// counter is touched), or, without thread-locals, through its own `Arc`.
pub(crate) enum FsRef {
    Local(Rc<Local>),
    Shared(Arc<Fs>),
}

impl std::ops::Deref for FsRef {
    type Target = Fs;
    fn deref(&self) -> &Fs {
        match self {
            FsRef::Local(l) => &l.fs,
            FsRef::Shared(fs) => fs,
        }
    }
}

/// A thread's published pin (see the module doc). Aligned to its own pair of cache lines, so
/// pinning writes no line another thread's pin writes.
#[repr(align(128))]
struct PinRecord {
    /// Odd while the owner is inside a call on a file handle; bumped at each pin and unpin,
    /// by the owner only.
    sequence: AtomicU64,
    /// The filesystem pinned (-1: more than one, nested).
    fs: AtomicI64,
    /// The file handle pinned (-1: more than one, nested).
    fd: AtomicI64,
    /// Owned by a thread (or borrowed by a call without thread-locals).
    taken: AtomicBool,
}

/// Every pin record ever made (leaked: each is reused, so they number at most the threads
/// alive at once).
static PIN_RECORDS: Mutex<Vec<&'static PinRecord>> = Mutex::new(Vec::new());

/// A free pin record, taken (a new one when none is free).
fn take_pin_record() -> &'static PinRecord {
    let mut all = PIN_RECORDS.lock().unwrap_or_else(|p| p.into_inner());
    for r in all.iter() {
        if r.taken
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return r;
        }
    }
    let r: &'static PinRecord = Box::leak(Box::new(PinRecord {
        sequence: AtomicU64::new(0),
        fs: AtomicI64::new(0),
        fd: AtomicI64::new(0),
        taken: AtomicBool::new(true),
    }));
    all.push(r);
    r
}

/// A thread's pin record and how deeply its calls nest; the record is freed at thread exit.
struct ThreadPin {
    record: &'static PinRecord,
    depth: Cell<u32>,
}

impl Drop for ThreadPin {
    fn drop(&mut self) {
        // A thread exits between calls, so never pinned here; were it, a pinned record
        // would stall every remover: unpin (no panic in a thread-local destructor).
        if self.record.sequence.load(Ordering::Relaxed) & 1 == 1 {
            clear_pin(self.record);
        }
        self.record.taken.store(false, Ordering::Release);
    }
}

/// A pin on a filesystem, held for the length of a call on one of its file handles.
enum Pin {
    Thread(&'static PinRecord),
    Borrowed(&'static PinRecord),
}

fn publish_pin(record: &PinRecord, fs_id: i64, fd: i64) {
    let sequence = record.sequence.load(Ordering::Relaxed);
    debug_assert_eq!(sequence & 1, 0);
    record.fs.store(fs_id, Ordering::Relaxed);
    record.fd.store(fd, Ordering::Relaxed);
    // SeqCst: ordered before the epoch read that follows (see the module doc).
    record.sequence.store(sequence + 1, Ordering::SeqCst);
}

fn clear_pin(record: &PinRecord) {
    let sequence = record.sequence.load(Ordering::Relaxed);
    debug_assert_eq!(sequence & 1, 1);
    // Release: everything the call did with the handle comes before a remover sees this.
    record.sequence.store(sequence + 1, Ordering::Release);
}

fn pin(fs_id: i64, fd: i64) -> Pin {
    let pinned = THREAD_PIN.try_with(|p| {
        let depth = p.depth.get();
        if depth == 0 {
            publish_pin(p.record, fs_id, fd);
        } else {
            // A nested call on another handle: the pin now stands for every handle (a
            // remover of either waits). SeqCst as the pin's own publication.
            if p.record.fd.load(Ordering::Relaxed) != fd {
                p.record.fd.store(-1, Ordering::SeqCst);
            }
            if p.record.fs.load(Ordering::Relaxed) != fs_id {
                p.record.fs.store(-1, Ordering::SeqCst);
            }
        }
        p.depth.set(depth + 1);
        p.record
    });
    match pinned {
        Ok(record) => Pin::Thread(record),
        Err(_) => {
            let record = take_pin_record();
            publish_pin(record, fs_id, fd);
            Pin::Borrowed(record)
        }
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        match *self {
            Pin::Thread(record) => {
                let outermost = THREAD_PIN
                    .try_with(|p| {
                        let depth = p.depth.get() - 1;
                        p.depth.set(depth);
                        depth == 0
                    })
                    // Thread-locals gone mid-call cannot happen; unpin rather than leave the
                    // record pinned (which would stall every remover).
                    .unwrap_or(true);
                if outermost {
                    clear_pin(record);
                }
            }
            Pin::Borrowed(record) => {
                clear_pin(record);
                record.taken.store(false, Ordering::Release);
            }
        }
    }
}

/// Waits until every call pinned on handle `fd` (`None`: any handle) of filesystem `fs_id`
/// when this was called (other than the caller's own) has ended. Called after a removal's
/// epoch bump (see the module doc).
fn wait_for_pinned_calls(fs_id: i64, fd: Option<i64>) {
    let records: Vec<&'static PinRecord> = PIN_RECORDS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let own = THREAD_PIN.try_with(|p| p.record as *const PinRecord).ok();
    for record in records {
        if own == Some(record as *const PinRecord) {
            continue;
        }
        let sequence = record.sequence.load(Ordering::SeqCst);
        if sequence & 1 == 0 {
            continue;
        }
        let pinned_fs = record.fs.load(Ordering::SeqCst);
        let pinned_fd = record.fd.load(Ordering::SeqCst);
        let same_fs = pinned_fs == fs_id || pinned_fs == -1;
        let same_fd = fd.is_none_or(|fd| pinned_fd == fd || pinned_fd == -1);
        if !(same_fs && same_fd) {
            continue;
        }
        let mut spins = 0u32;
        while record.sequence.load(Ordering::Acquire) == sequence {
            // A cached read takes microseconds; one waiting for the device, more: spin
            // briefly, then give the core away (2 cores are shared with the reactors).
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else if spins < 1024 {
                std::thread::yield_now();
                spins += 1;
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

/// A file handle resolved for one call: the entry, and the pin that keeps its inode held
/// until the call drops this (hold it across the engine call, not only the lookup).
pub(crate) struct FileRef {
    entry: Entry,
    _pin: Pin,
}

impl std::ops::Deref for FileRef {
    type Target = OpenFile;
    fn deref(&self) -> &OpenFile {
        &self.entry.file
    }
}

impl FileRef {
    /// The handle's atomic batch slot.
    pub fn batch(&self) -> &BatchSlot {
        // SAFETY: the slot is owned by the handle's table entry, which outlives this pinned
        // call (see `Entry`).
        unsafe { self.entry.batch.as_ref() }
    }

    /// The handle's in-flight count, for an asynchronous operation to hold past this call.
    pub fn in_flight(&self) -> Arc<InFlight> {
        let ptr = self.entry.in_flight.as_ptr().cast_const();
        // SAFETY: `ptr` is `Arc::as_ptr` of the `Arc` the handle's table entry owns, which
        // outlives this pinned call (see `Entry`): the count is at least one while this
        // takes another.
        unsafe {
            Arc::increment_strong_count(ptr);
            Arc::from_raw(ptr)
        }
    }
}

fn ebadf_file(fd: i64) -> Error {
    Error::new(libc::EBADF, format!("{fd} is not an open file"))
}

fn ebadf_fs(id: i64) -> Error {
    Error::new(
        libc::EBADF,
        format!("{id} is not an open corefs filesystem"),
    )
}

/// Resolves file handle `fd` of `fs` for one call (EBADF if it is not open), pinned.
pub(crate) fn file(fs: &Fs, fd: i64) -> Result<FileRef, Error> {
    let pin = pin(fs.id, fd);
    let epoch = fs.files_epoch.load(Ordering::SeqCst);
    let local = local_of(fs.id);
    let cached = local
        .as_ref()
        .and_then(|l| l.files.try_borrow_mut().ok()?.get(epoch, fd));
    let entry = match cached {
        Some(f) => f,
        None => {
            let found = fs
                .files
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&fd)
                .map(Handle::entry)
                .ok_or_else(|| ebadf_file(fd))?;
            if let Some(Ok(mut cache)) = local.as_ref().map(|l| l.files.try_borrow_mut()) {
                cache.put(epoch, fd, found);
            }
            found
        }
    };
    #[cfg(feature = "sim")]
    {
        let pause_us = PAUSE_AFTER_RESOLVE_US.load(Ordering::Relaxed);
        if pause_us > 0 {
            std::thread::sleep(std::time::Duration::from_micros(pause_us));
        }
    }
    Ok(FileRef { entry, _pin: pin })
}

/// See [`test_hook_pause_after_resolve`] (test machinery: only with `sim`).
#[cfg(feature = "sim")]
static PAUSE_AFTER_RESOLVE_US: AtomicU64 = AtomicU64::new(0);

/// Test hook (Rust only, not in the header): every call on a file handle pauses `us`
/// microseconds between resolving the handle and using it, which widens the window a
/// release racing it must get right (0: no pause).
#[doc(hidden)]
#[cfg(feature = "sim")]
pub fn test_hook_pause_after_resolve(us: u64) {
    PAUSE_AFTER_RESOLVE_US.store(us, Ordering::Relaxed);
}

/// Enters a new file handle (its inode already held) and returns it.
pub(crate) fn enter_file(fs: &Fs, f: OpenFile) -> i64 {
    let fd = fs.next_fd.fetch_add(1, Ordering::Relaxed);
    assert!(fd > 0, "file handles of a filesystem ran out");
    fs.files.lock().unwrap_or_else(|p| p.into_inner()).insert(
        fd,
        Handle {
            file: f,
            batch: Box::default(),
            in_flight: Arc::default(),
        },
    );
    fd
}

/// Removes file handle `fd` and returns its entry once no call can still be using it (its
/// atomic batch, if one is open, goes with it then): the caller then releases the inode.
pub(crate) fn remove_file(fs: &Fs, fd: i64) -> Result<Removed, Error> {
    let removed = {
        let mut files = fs.files.lock().unwrap_or_else(|p| p.into_inner());
        let removed = files.remove(&fd);
        if removed.is_some() {
            fs.files_epoch.fetch_add(1, Ordering::SeqCst);
        }
        removed
    };
    let removed = removed.ok_or_else(|| ebadf_file(fd))?;
    wait_for_pinned_calls(fs.id, Some(fd));
    Ok(Removed {
        file: removed.file,
        in_flight: removed.in_flight,
    })
}

/// Removes every file handle of a closing filesystem and returns them once no call can
/// still be using one.
pub(crate) fn drain_files(fs: &Fs) -> Vec<OpenFile> {
    let open: Vec<Handle> = {
        let mut files = fs.files.lock().unwrap_or_else(|p| p.into_inner());
        let open = files.drain().map(|(_, f)| f).collect();
        fs.files_epoch.fetch_add(1, Ordering::SeqCst);
        open
    };
    wait_for_pinned_calls(fs.id, None);
    open.into_iter().map(|handle| handle.file).collect()
}

/// One of a thread's owner ids on one filesystem: its own, or the mount's default.
pub(crate) type OwnerIds = (Option<u32>, Option<u32>);

static NEXT_FS: AtomicI64 = AtomicI64::new(1);
static FILESYSTEMS: Mutex<Vec<(i64, Arc<Fs>)>> = Mutex::new(Vec::new());

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The filesystems this thread used, each with its client and cached file handles (a
    /// short list: a linear search beats hashing for the few a process mounts).
    static LOCALS: RefCell<Vec<(i64, Rc<Local>)>> = const { RefCell::new(Vec::new()) };
    /// This thread's pin record (see the module doc), taken at its first call on a handle.
    static THREAD_PIN: ThreadPin = ThreadPin {
        record: take_pin_record(),
        depth: Cell::new(0),
    };
    /// The owner this thread creates inodes as, per filesystem (`corefs_set_owner`).
    static OWNERS: RefCell<HashMap<i64, OwnerIds>> = RefCell::new(HashMap::new());
}

/// This thread's view of filesystem `id`, if it has one (and thread-locals still exist).
fn local_of(id: i64) -> Option<Rc<Local>> {
    LOCALS
        .try_with(|l| {
            l.borrow()
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, local)| local.clone())
        })
        .ok()
        .flatten()
}

/// Sets the calling thread's owner ids on filesystem `id` (`None`: the mount's default).
/// Without thread-locals (an `atexit` handler) the setting is refused.
pub(crate) fn set_thread_owner(id: i64, ids: OwnerIds) -> Result<(), Error> {
    OWNERS
        .try_with(|o| {
            let mut owners = o.borrow_mut();
            if ids == (None, None) {
                owners.remove(&id);
            } else {
                owners.insert(id, ids);
            }
        })
        .map_err(|_| Error::new(libc::EINVAL, "thread-local storage is gone".into()))
}

/// Who the calling thread creates inodes as on `fs`: its own ids (`corefs_set_owner`), else
/// the mount's, else the process's effective user and group, read at each call as the
/// kernel reads a process's credentials at each system call.
pub(crate) fn owner(fs: &Fs) -> Owner {
    let (uid, gid) = OWNERS
        .try_with(|o| o.borrow().get(&fs.id).copied())
        .ok()
        .flatten()
        .unwrap_or((None, None));
    let default = fs.owner.unwrap_or_else(|| {
        // SAFETY: geteuid and getegid cannot fail and touch no memory.
        unsafe {
            Owner {
                uid: libc::geteuid(),
                gid: libc::getegid(),
            }
        }
    });
    Owner {
        uid: uid.unwrap_or(default.uid),
        gid: gid.unwrap_or(default.gid),
    }
}

/// Thread-locals may already be gone (a call from an `atexit` handler or a thread-local
/// destructor): then the message is dropped rather than panicking.
pub(crate) fn set_error(message: &str) {
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = text);
}

pub(crate) fn last_error_ptr() -> *const libc::c_char {
    static GONE: &std::ffi::CStr = c"(no message: thread-local storage is gone)";
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(GONE.as_ptr())
}

pub(crate) fn register(runtime: Runtime, owner: Option<Owner>) -> i64 {
    register_fs(Some(runtime), None, owner)
}

/// Registers a filesystem reached through a storage service's connection.
pub(crate) fn register_remote(conn: Arc<Connection>, owner: Option<Owner>) -> i64 {
    register_fs(None, Some(conn), owner)
}

fn register_fs(
    runtime: Option<Runtime>,
    remote: Option<Arc<Connection>>,
    owner: Option<Owner>,
) -> i64 {
    let id = NEXT_FS.fetch_add(1, Ordering::Relaxed);
    assert!(id > 0, "filesystem ids ran out");
    let fs = Arc::new(Fs {
        id,
        runtime: Mutex::new(runtime),
        remote,
        locks: Mutex::new(crate::locks::LockTable::default()),
        files: Mutex::new(HashMap::new()),
        files_epoch: AtomicU64::new(0),
        closed: AtomicBool::new(false),
        next_fd: AtomicI64::new(1),
        owner,
        clients: Mutex::new(Vec::new()),
    });
    FILESYSTEMS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((id, fs));
    id
}

/// The open filesystem `id` (EBADF if it is not one). From this thread's list when it used
/// the filesystem before (no lock, no shared counter); else from the registry, and then
/// entered in the list.
pub(crate) fn lookup(id: i64) -> Result<FsRef, Error> {
    if let Some(local) = local_of(id) {
        if !local.fs.closed.load(Ordering::Acquire) {
            return Ok(FsRef::Local(local));
        }
        forget_client(id);
        return Err(ebadf_fs(id));
    }
    let fs = FILESYSTEMS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, fs)| fs.clone())
        .ok_or_else(|| ebadf_fs(id))?;
    let slot = Arc::new(ClientSlot::default());
    {
        let mut clients = fs.clients.lock().unwrap_or_else(|p| p.into_inner());
        clients.retain(|c| c.strong_count() > 0);
        clients.push(Arc::downgrade(&slot));
    }
    let local = Rc::new(Local {
        fs: fs.clone(),
        client: slot,
        files: RefCell::new(FileCache {
            epoch: 0,
            entries: HashMap::new(),
        }),
    });
    let entered = LOCALS.try_with(|l| {
        let mut l = l.borrow_mut();
        // Closed filesystems go from the list when another is entered: it stays as long as
        // the filesystems open, not the ones ever used.
        l.retain(|(_, other)| !other.fs.closed.load(Ordering::Acquire));
        l.push((id, local.clone()));
    });
    Ok(match entered {
        Ok(()) => FsRef::Local(local),
        Err(_) => FsRef::Shared(fs),
    })
}

/// Takes filesystem `id` out of the registry and marks it closed: every later lookup of it,
/// in any thread, is EBADF. Its file handles are still to drain ([`drain_files`]).
pub(crate) fn unregister(id: i64) -> Result<Arc<Fs>, Error> {
    let mut all = FILESYSTEMS.lock().unwrap_or_else(|p| p.into_inner());
    let at = all
        .iter()
        .position(|(i, _)| *i == id)
        .ok_or_else(|| ebadf_fs(id))?;
    let fs = all.remove(at).1;
    fs.closed.store(true, Ordering::Release);
    Ok(fs)
}

/// Runs `f` with this thread's client of `fs` (created on first use). Without one (a
/// thread whose thread-locals are destroyed, an `atexit` handler; or a closing filesystem
/// this thread never used), a temporary client is used.
pub(crate) fn with_client<T>(fs: &Fs, f: impl FnOnce(&mut Conn) -> T) -> Result<T, Error> {
    let new_client = || {
        if let Some(remote) = &fs.remote {
            return Ok(Conn::Remote(RemoteClient::new(remote.clone())));
        }
        let runtime = fs.runtime.lock().unwrap_or_else(|p| p.into_inner());
        runtime
            .as_ref()
            .map(|r| Conn::Local(r.client(CLIENT_CAPACITY)))
            .ok_or_else(|| Error::new(libc::EBADF, "the filesystem is closing".into()))
    };
    if let Some(local) = local_of(fs.id) {
        // Not held unless a call nests in another's engine call, which none does, or the
        // filesystem is closing.
        let held = match local.client.client.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(mut client) = held {
            if client.is_none() {
                ClientSlot::fill(&mut client, new_client()?);
            }
            if let Some(client) = client.as_mut() {
                return Ok(f(client));
            }
        }
    }
    let mut client = new_client()?;
    Ok(f(&mut client))
}

/// Drops every thread's client of closing filesystem `fs`, whose runtime is taken (so no
/// thread makes a new one): idle threads do not keep the runtime's queues after the close.
/// A thread inside a call finishes it first (its slot is locked meanwhile).
pub(crate) fn take_thread_clients(fs: &Fs) {
    let slots: Vec<_> = std::mem::take(&mut *fs.clients.lock().unwrap_or_else(|p| p.into_inner()));
    for slot in slots.iter().filter_map(std::sync::Weak::upgrade) {
        slot.take();
    }
}

/// Drops this thread's view of a closed filesystem (its client and cached handles), and its
/// owner setting.
pub(crate) fn forget_client(id: i64) {
    let _ = LOCALS.try_with(|l| l.borrow_mut().retain(|(i, _)| *i != id));
    let _ = OWNERS.try_with(|o| o.borrow_mut().remove(&id));
}

/// Operations one thread may have in flight on one filesystem (asynchronous calls).
pub(crate) const CLIENT_CAPACITY: usize = 256;

#[cfg(test)]
mod tests {
    use super::InFlight;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    /// The inode is released exactly once: by the release when nothing is in flight, else by
    /// the last end after it; ends before the release release nothing.
    #[test]
    fn exactly_one_of_release_and_the_last_end_releases() {
        let idle = InFlight::default();
        assert!(idle.release());

        let busy = InFlight::default();
        busy.begin();
        busy.begin();
        assert!(!busy.end(), "an end before the release");
        assert!(!busy.release(), "one still in flight");
        assert!(busy.end(), "the last end after the release");

        // Racing: one thread releases while others end their operations; one release
        // whatever the interleaving.
        for round in 0..200 {
            let state = Arc::new(InFlight::default());
            let ops = 1 + round % 4;
            (0..ops).for_each(|_| state.begin());
            let releases = Arc::new(AtomicUsize::new(0));
            let start = Arc::new(Barrier::new(ops + 1));
            let mut threads = Vec::new();
            for _ in 0..ops {
                let (state, releases, start) = (state.clone(), releases.clone(), start.clone());
                threads.push(std::thread::spawn(move || {
                    start.wait();
                    if state.end() {
                        releases.fetch_add(1, Ordering::SeqCst);
                    }
                }));
            }
            start.wait();
            if state.release() {
                releases.fetch_add(1, Ordering::SeqCst);
            }
            threads.into_iter().for_each(|t| t.join().unwrap());
            assert_eq!(releases.load(Ordering::SeqCst), 1, "round {round}");
        }
    }
}
