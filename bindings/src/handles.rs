//! The tables behind the C handles, per-thread clients and the per-thread error message.
//!
//! # Invariants
//! - A filesystem id is never reused within a process (ids only grow), so a closed handle stays
//!   invalid forever; file handles likewise, per filesystem.
//! - The tables are behind mutexes held only to look up or change an entry, never across an
//!   engine call.
//! - Every file handle in a table holds its inode ([`reactor::Op::Hold`]), taken before the
//!   handle is entered and released after it is removed, so an inode stays while a handle to
//!   it exists, with or without a name.

use engine::EngineError;
use reactor::{Client, Owner, Runtime};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicI64, Ordering};
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

pub(crate) struct Fs {
    pub id: i64,
    pub runtime: Mutex<Option<Runtime>>,
    pub files: Mutex<HashMap<i64, OpenFile>>,
    pub next_fd: AtomicI64,
    /// Who creates inodes unless the calling thread said otherwise ([`set_thread_owner`]):
    /// the mount's owner, or (`None`) the process's effective ids at each call.
    pub owner: Option<Owner>,
}

/// One of a thread's owner ids on one filesystem: its own, or the mount's default.
pub(crate) type OwnerIds = (Option<u32>, Option<u32>);

static NEXT_FS: AtomicI64 = AtomicI64::new(1);
static FILESYSTEMS: Mutex<Vec<(i64, Arc<Fs>)>> = Mutex::new(Vec::new());

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// This thread's client of each filesystem it used.
    static CLIENTS: RefCell<HashMap<i64, Client>> = RefCell::new(HashMap::new());
    /// The owner this thread creates inodes as, per filesystem (`corefs_set_owner`).
    static OWNERS: RefCell<HashMap<i64, OwnerIds>> = RefCell::new(HashMap::new());
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
    let id = NEXT_FS.fetch_add(1, Ordering::Relaxed);
    let fs = Arc::new(Fs {
        id,
        runtime: Mutex::new(Some(runtime)),
        files: Mutex::new(HashMap::new()),
        next_fd: AtomicI64::new(1),
        owner,
    });
    FILESYSTEMS.lock().expect("registry").push((id, fs));
    id
}

pub(crate) fn lookup(id: i64) -> Result<Arc<Fs>, Error> {
    FILESYSTEMS
        .lock()
        .expect("registry")
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, fs)| fs.clone())
        .ok_or_else(|| {
            Error::new(
                libc::EBADF,
                format!("{id} is not an open corefs filesystem"),
            )
        })
}

pub(crate) fn unregister(id: i64) -> Result<Arc<Fs>, Error> {
    let mut all = FILESYSTEMS.lock().expect("registry");
    let at = all.iter().position(|(i, _)| *i == id).ok_or_else(|| {
        Error::new(
            libc::EBADF,
            format!("{id} is not an open corefs filesystem"),
        )
    })?;
    Ok(all.remove(at).1)
}

/// Runs `f` with this thread's client of `fs` (created on first use). From a thread whose
/// thread-locals are already destroyed (an `atexit` handler), a temporary client is used.
pub(crate) fn with_client<T>(fs: &Fs, f: impl FnOnce(&mut Client) -> T) -> Result<T, Error> {
    let mut f = Some(f);
    let result = CLIENTS.try_with(|clients| {
        let f = f.take().expect("called once");
        let mut clients = clients.borrow_mut();
        let client = match clients.entry(fs.id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let runtime = fs.runtime.lock().expect("runtime");
                let runtime = runtime
                    .as_ref()
                    .ok_or_else(|| Error::new(libc::EBADF, "the filesystem is closing".into()))?;
                e.insert(runtime.client(CLIENT_CAPACITY))
            }
        };
        Ok(f(client))
    });
    match result {
        Ok(r) => r,
        Err(_) => {
            let runtime = fs.runtime.lock().expect("runtime");
            let runtime = runtime
                .as_ref()
                .ok_or_else(|| Error::new(libc::EBADF, "the filesystem is closing".into()))?;
            let mut client = runtime.client(CLIENT_CAPACITY);
            Ok((f.take().expect("not called yet"))(&mut client))
        }
    }
}

/// Drops this thread's client of a closed filesystem, and its owner setting.
pub(crate) fn forget_client(id: i64) {
    let _ = CLIENTS.try_with(|c| c.borrow_mut().remove(&id));
    let _ = OWNERS.try_with(|o| o.borrow_mut().remove(&id));
}

/// Operations one thread may have in flight on one filesystem (asynchronous calls).
pub(crate) const CLIENT_CAPACITY: usize = 256;

/// An error on its way to C: the errno and a message.
#[derive(Debug)]
pub(crate) struct Error {
    pub errno: i32,
    pub message: String,
}

impl Error {
    pub fn new(errno: i32, message: String) -> Error {
        Error { errno, message }
    }
}

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Error {
        Error::new(e.errno(), e.to_string())
    }
}
