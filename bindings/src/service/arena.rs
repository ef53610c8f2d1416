//! The buffer arena: the memory `corefs_buf_alloc` hands out, shared with every server the
//! process connects to, so a read or write from such a buffer through a service is copied
//! once, by the server, between the buffer and the engine (zero copies on the client's side).
//!
//! # The client's half ([`Arena`])
//! One per process, made at its first `corefs_buf_alloc` or `corefs_connect`: a memfd of
//! [`arena_bytes`] (1 GiB of address space by default, `COREFS_BUF_ARENA_MIB`; 0 turns it off),
//! sealed against shrinking and growing, mapped shared, and handed to each server at connect
//! (SCM_RIGHTS). Buffers are whole pages of it, first fit; a freed buffer's pages are given
//! back to the kernel (a hole punched), so a later buffer there reads zeros as a new one must,
//! and the arena costs memory only for the buffers alive. A process forked after making its
//! arena shares its pages with its parent: the child makes its own for new buffers and leaves
//! its parent's alone (a buffer of it freed in the child is forgotten, not reused).
//!
//! # The server's half ([`ClientArena`])
//! A client's arena, mapped by the server at connect: refused unless it is a memfd sealed
//! against shrinking (a file that could shrink under the mapping would make the server's
//! copies fault: SIGBUS) and at most [`CLIENT_ARENA_BYTES_MAX`] (the pages the server itself
//! touches, a read placed where the client never wrote, are charged to the server).
//!
//! # Fault model
//! The client is not trusted: it may name any range, change the bytes while the server copies
//! them, or punch holes under them. Every range is checked against the mapping's length
//! before it is touched; a write's bytes are read once, by the copy that stages them (what
//! the copy saw is what the write writes); a read's bytes land in the client's own memory
//! only. A hole reads as zeros and fills on write: nothing a client does to its arena makes a
//! server copy fault or reach another client's memory.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

/// The arena's default size: address space reserved, not memory (pages are used only while a
/// buffer there holds them).
pub const ARENA_BYTES_DEFAULT: usize = 1 << 30;
/// The largest client arena a server maps: the per-client limit on the data area it shares.
pub const CLIENT_ARENA_BYTES_MAX: u64 = 4 << 30;
const PAGE_BYTES: usize = 4096;

/// The arena's size for this process: `COREFS_BUF_ARENA_MIB` if set (0: no arena, buffers
/// from the heap and every transfer copied), else [`ARENA_BYTES_DEFAULT`].
pub fn arena_bytes() -> usize {
    match std::env::var("COREFS_BUF_ARENA_MIB") {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(mib) => mib.saturating_mul(1 << 20),
            Err(_) => {
                tracing::warn!("COREFS_BUF_ARENA_MIB={v:?} is not a number of MiB: ignored");
                ARENA_BYTES_DEFAULT
            }
        },
        Err(_) => ARENA_BYTES_DEFAULT,
    }
}

/// A process's buffer arena (the client's half).
pub struct Arena {
    file: std::fs::File,
    map: memmap2::MmapRaw,
    /// Free page runs (offset → bytes) and buffers handed out (offset → bytes), both whole
    /// pages. Allocation is rare (buffers are made once and reused), so a lock is fine.
    books: Mutex<Books>,
}

#[derive(Default)]
struct Books {
    free: BTreeMap<usize, usize>,
    used: BTreeMap<usize, usize>,
}

impl Arena {
    /// A new arena of `bytes` (rounded down to pages), sealed and mapped.
    pub fn create(bytes: usize) -> std::io::Result<Arena> {
        let bytes = bytes / PAGE_BYTES * PAGE_BYTES;
        if bytes == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "an arena of no pages",
            ));
        }
        // SAFETY: a NUL-terminated name and plain flags.
        let fd = unsafe {
            libc::memfd_create(
                c"corefs-buffers".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just gave us, owned by nothing else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(bytes as u64)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a valid descriptor and an integer argument.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let map = memmap2::MmapOptions::new().len(bytes).map_raw(&file)?;
        assert_eq!(map.len(), bytes);
        let mut books = Books::default();
        books.free.insert(0, bytes);
        Ok(Arena {
            file,
            map,
            books: Mutex::new(books),
        })
    }

    pub fn size_bytes(&self) -> usize {
        self.map.len()
    }

    /// The descriptor a server maps ([`ClientArena::map`]).
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A zeroed, page-aligned buffer of at least `len` bytes, or None when no free run is
    /// long enough.
    pub fn alloc(&self, len: usize) -> Option<*mut u8> {
        let bytes = len.max(1).checked_next_multiple_of(PAGE_BYTES)?;
        let mut books = self.books();
        let (&at, &run) = books.free.iter().find(|(_, &run)| run >= bytes)?;
        books.free.remove(&at);
        if run > bytes {
            books.free.insert(at + bytes, run - bytes);
        }
        books.used.insert(at, bytes);
        assert!(at + bytes <= self.size_bytes());
        // SAFETY: `at + bytes` lies within the map (asserted).
        Some(unsafe { self.map.as_mut_ptr().add(at) })
    }

    /// Gives back the buffer at `ptr`, if it is one of this arena's: true then (its pages go
    /// back to the kernel and read as zeros when handed out again), false for memory that is
    /// not (a heap buffer, or one of a parent process's arena).
    pub fn free(&self, ptr: *const u8) -> bool {
        let Some(at) = self.offset_of(ptr, 0) else {
            return false;
        };
        let at = at as usize;
        let mut books = self.books();
        let Some(bytes) = books.used.remove(&at) else {
            // Inside the arena but not a buffer's start: a caller's mistake, kept harmless.
            tracing::warn!(
                offset = at,
                "corefs_buf_free of no buffer from corefs_buf_alloc"
            );
            return true;
        };
        self.release(at, bytes);
        let mut start = at;
        let mut run = bytes;
        if let Some((&before, &len)) = books.free.range(..at).next_back() {
            if before + len == at {
                books.free.remove(&before);
                start = before;
                run += len;
            }
        }
        if let Some(len) = books.free.remove(&(at + bytes)) {
            run += len;
        }
        books.free.insert(start, run);
        true
    }

    /// Returns a freed buffer's pages to the kernel; what cannot be is zeroed instead, so a
    /// buffer is zeroed when handed out again either way.
    fn release(&self, at: usize, bytes: usize) {
        // SAFETY: a valid descriptor; the range lies within the file (a buffer's).
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                at as libc::off_t,
                bytes as libc::off_t,
            )
        };
        if rc != 0 {
            // SAFETY: within the map; the buffer is no longer the caller's.
            unsafe { std::ptr::write_bytes(self.map.as_mut_ptr().add(at), 0, bytes) };
        }
    }

    /// `ptr..ptr + len`'s offset in the arena, if it lies wholly inside it: what a request
    /// names instead of copying the bytes.
    pub fn offset_of(&self, ptr: *const u8, len: usize) -> Option<u64> {
        let start = (ptr as usize).checked_sub(self.map.as_ptr() as usize)?;
        (start.checked_add(len)? <= self.size_bytes()).then_some(start as u64)
    }
}

// SAFETY: the map is fixed while the arena lives; the books are behind a lock; the bytes are
// the callers' (each buffer is one caller's, by the C ABI's contract).
unsafe impl Sync for Arena {}
// SAFETY: as above.
unsafe impl Send for Arena {}

/// The arenas this process made, the live one (this process's) last: a forked child makes
/// its own and still knows its parent's, to tell its buffers from the heap's.
struct Arenas {
    pid: u32,
    live: Option<&'static Arena>,
    all: Vec<&'static Arena>,
    /// Made once and failed, or turned off: buffers come from the heap.
    off: bool,
}

static ARENAS: Mutex<Arenas> = Mutex::new(Arenas {
    pid: 0,
    live: None,
    all: Vec::new(),
    off: false,
});

fn arenas() -> std::sync::MutexGuard<'static, Arenas> {
    ARENAS.lock().unwrap_or_else(|p| p.into_inner())
}

/// This process's arena, made now if it has none (None when turned off or not possible:
/// said once in the log).
pub fn process() -> Option<&'static Arena> {
    let pid = std::process::id();
    let mut arenas = arenas();
    if arenas.pid != pid {
        // The first call, or the first in a forked child: the parent's arena is not ours.
        arenas.pid = pid;
        arenas.live = None;
        arenas.off = false;
    }
    if arenas.live.is_none() && !arenas.off {
        let bytes = arena_bytes();
        if bytes == 0 {
            arenas.off = true;
            return None;
        }
        match Arena::create(bytes) {
            Ok(arena) => {
                let arena: &'static Arena = Box::leak(Box::new(arena));
                arenas.live = Some(arena);
                arenas.all.push(arena);
            }
            Err(e) => {
                tracing::warn!(
                    "no shared buffer arena ({e}): buffers from corefs_buf_alloc come from \
                     the heap and are copied through a service"
                );
                arenas.off = true;
            }
        }
    }
    arenas.live
}

/// Frees `ptr` if it is a buffer of an arena of this process: true then (a buffer of a
/// parent's arena is left to the parent), false for heap memory.
pub fn free(ptr: *const u8) -> bool {
    let arenas = arenas();
    match arenas.live {
        Some(live) if live.free(ptr) => true,
        _ => arenas.all.iter().any(|a| a.offset_of(ptr, 0).is_some()),
    }
}

/// A client's arena as its server maps it (the server's half).
pub struct ClientArena {
    map: memmap2::MmapRaw,
}

// SAFETY: the mapping is fixed while it lives and accessed only by raw copies.
unsafe impl Sync for ClientArena {}
// SAFETY: as above.
unsafe impl Send for ClientArena {}

impl ClientArena {
    /// Maps a client's arena, refusing one that could shrink, is not whole pages, or is
    /// larger than [`CLIENT_ARENA_BYTES_MAX`].
    pub fn map(fd: OwnedFd) -> Result<ClientArena, String> {
        // SAFETY: a valid descriptor; F_GET_SEALS reads no memory.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(format!(
                "not a memfd that can be sealed: {}",
                std::io::Error::last_os_error()
            ));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err("not sealed against shrinking".into());
        }
        let file = std::fs::File::from(fd);
        let len = file.metadata().map_err(|e| e.to_string())?.len();
        if len == 0 || len % PAGE_BYTES as u64 != 0 || len > CLIENT_ARENA_BYTES_MAX {
            return Err(format!(
                "{len} bytes: an arena is whole pages, at most {CLIENT_ARENA_BYTES_MAX}"
            ));
        }
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(&file)
            .map_err(|e| format!("cannot be mapped: {e}"))?;
        Ok(ClientArena { map })
    }

    /// `at..at + len` as a pointer into the mapping, if it lies inside it.
    fn range(&self, at: u64, len: usize) -> Option<*mut u8> {
        let end = at.checked_add(len as u64)?;
        (end <= self.map.len() as u64).then(|| {
            // SAFETY: `at + len` is within the map (checked).
            unsafe { self.map.as_mut_ptr().add(at as usize) }
        })
    }

    /// Whether `at..at + len` lies inside the arena.
    pub fn holds(&self, at: u64, len: usize) -> bool {
        self.range(at, len).is_some()
    }

    /// The `len` bytes at `at` copied once into a write's staging copy, with their block
    /// sums; None when the range is not inside the arena.
    pub fn stage(&self, at: u64, len: usize) -> Option<engine::Staged> {
        let ptr = self.range(at, len)?;
        // SAFETY: inside the mapping, which no seal lets shrink. The client may change the
        // bytes meanwhile: they are read once, and what this copy saw is what its write writes.
        let data = unsafe { std::slice::from_raw_parts(ptr, len) };
        Some(engine::Staged::copy_of(data))
    }

    /// Copies `data` to `at` (a read's answer); false, touching nothing, when the range is
    /// not inside the arena.
    pub fn place(&self, at: u64, data: &[u8]) -> bool {
        let Some(ptr) = self.range(at, data.len()) else {
            return false;
        };
        // SAFETY: inside the mapping (checked); the client's own memory, which only its
        // request's answer may make wrong.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn dup(fd: std::os::fd::RawFd) -> OwnedFd {
        // SAFETY: duplicating a valid descriptor gives a new one that is ours.
        unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) }
    }

    /// Buffers are whole pages inside the arena, never overlap, come back zeroed after a
    /// free, and freed neighbours join again into one run (a buffer as large as the arena
    /// fits once all are freed); a full arena says so.
    #[test]
    fn buffers_are_disjoint_pages_zeroed_on_reuse_and_runs_join_again() {
        let arena = Arena::create(64 * PAGE_BYTES).unwrap();
        let a = arena.alloc(1).unwrap();
        let b = arena.alloc(PAGE_BYTES + 1).unwrap();
        let c = arena.alloc(3 * PAGE_BYTES).unwrap();
        let off = |p: *mut u8| arena.offset_of(p, 0).unwrap() as usize;
        assert_eq!(off(a) % PAGE_BYTES, 0);
        assert_eq!(off(b), off(a) + PAGE_BYTES);
        assert_eq!(off(c), off(b) + 2 * PAGE_BYTES);
        // SAFETY: b is 2 pages of the arena.
        unsafe { std::ptr::write_bytes(b, 0xAB, 2 * PAGE_BYTES) };
        assert!(arena.free(b));
        let again = arena.alloc(2 * PAGE_BYTES).unwrap();
        assert_eq!(again, b, "first fit takes the freed run");
        // SAFETY: 2 pages of the arena.
        let bytes = unsafe { std::slice::from_raw_parts(again, 2 * PAGE_BYTES) };
        assert!(bytes.iter().all(|&x| x == 0), "a reused buffer is zeroed");
        assert!(arena.alloc(61 * PAGE_BYTES).is_none(), "58 pages are free");
        for p in [a, again, c] {
            assert!(arena.free(p));
        }
        let whole = arena.alloc(64 * PAGE_BYTES).unwrap();
        assert_eq!(off(whole), 0, "freed runs joined into the whole arena");
        assert!(arena.offset_of(whole, 64 * PAGE_BYTES).is_some());
        assert!(arena.offset_of(whole, 64 * PAGE_BYTES + 1).is_none());
        let heap = [0u8; 16];
        assert!(!arena.free(heap.as_ptr()), "heap memory is not the arena's");
    }

    /// The server maps a sealed arena and sees the client's bytes; it refuses a memfd that
    /// may shrink, a file that is no memfd, and ranges outside the mapping.
    #[test]
    fn a_server_maps_only_a_sealed_arena_and_only_touches_inside_it() {
        let arena = Arena::create(16 * PAGE_BYTES).unwrap();
        let buf = arena.alloc(2 * PAGE_BYTES).unwrap();
        // SAFETY: 2 pages of the arena.
        unsafe { std::ptr::write_bytes(buf, 7, 2 * PAGE_BYTES) };
        let at = arena.offset_of(buf, 0).unwrap();
        let server = ClientArena::map(dup(arena.fd())).unwrap();
        let staged = server.stage(at, 5000).unwrap();
        assert_eq!(&staged[..], &[7u8; 5000][..]);
        assert!(server.place(at + 1, b"abc"));
        // SAFETY: inside the buffer.
        let head = unsafe { std::slice::from_raw_parts(buf, 5) };
        assert_eq!(head, &[7, b'a', b'b', b'c', 7]);
        let end = (16 * PAGE_BYTES) as u64;
        assert!(server.stage(end - 10, 11).is_none());
        assert!(server.stage(u64::MAX - 2, 5).is_none(), "no overflow");
        assert!(!server.place(end, b"x"));
        assert!(server.holds(end, 0) && !server.holds(end + 1, 0));

        // SAFETY: plain flags; a new descriptor that is ours.
        let unsealed =
            unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC)) };
        std::fs::File::from(unsealed.try_clone().unwrap())
            .set_len(PAGE_BYTES as u64)
            .unwrap();
        let why = ClientArena::map(unsealed).err().unwrap();
        assert!(why.contains("sealed"), "{why}");
        let plain = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(ClientArena::map(plain.into()).is_err());
    }
}
