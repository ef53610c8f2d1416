//! The memory a client and the server share: one memfd per connection, made by the server and
//! handed to the client at connect, holding a header and a fixed number of message slots.
//!
//! # Layout (all integers little-endian, as the CPU's: both ends run on one machine)
//! - Page 0, the header ([`Header`]): magic, version, slot count, payload bytes per slot, the
//!   doorbell (bumped by the client after each submit) and how many server workers sleep on it.
//! - Slot `i` at `HEADER_BYTES + i * SLOT_BYTES`: a 64-byte slot header ([`SlotHeader`]:
//!   state, message length) on its own page, then the payload, page-aligned, where the
//!   request is written and the reply replaces it. A write's bytes go beside its message,
//!   at [`DATA_AT`] in the payload ([`super::wire::Request::Write`]), where the server copies
//!   them once, straight into the write's staging copy.
//!
//! # A slot's life
//! `FREE` → (a client thread claims it) `CLAIMED` → (request written) `SUBMITTED` → (a
//! server worker, or the reactor itself, takes it) `TAKEN` → (reply written) `DONE` → (the
//! client read it) `FREE`. A reactor may hand a request it took to the workers: `HANDOFF`
//! (then a worker takes it to `TAKEN`).
//! Each side moves the state only from the states that are its to leave, by compare-and-swap
//! where another party could move it too, and publishes the payload before the state (Release)
//! and reads it after (Acquire).
//!
//! # Fault model
//! The client is not trusted: it can write anything anywhere in this memory at any time.
//! So the server never decodes a payload in place: it copies the request out (bounded by the
//! payload size, whatever the length word says) and decodes the copy. A write's bytes beside
//! it are opaque: they are read once, by the copy that stages them (bounded by the data
//! area, whatever the message says), and the checksums are taken of that copy; a client
//! changing them meanwhile changes only what its own write writes. It reads the state word
//! only to take a `SUBMITTED` slot and writes nothing the client could make it misread. A
//! client scribbling over its own memory gets wrong answers for its own requests, nothing
//! else. The server can die at any moment: a client never waits on a slot without a timeout
//! after which it checks that the server is still there ([`super::client`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// "corefs\0" and the ring's version: a client refuses memory that does not start with them.
pub const MAGIC: u64 = u64::from_le_bytes(*b"corefsS1");
pub const VERSION: u32 = 5;

/// Slots per connection: the requests a client process may have in flight at once.
pub const SLOTS: usize = 64;
/// The largest message (request or reply) a slot holds: a 1 MiB read or write and its
/// header. Larger reads and writes go as several requests.
pub const PAYLOAD_BYTES: usize = (1 << 20) + 4096;
/// The most data one request moves; the rest of the payload is the message's header.
pub const DATA_BYTES_MAX: usize = 1 << 20;
/// Where a write's bytes start in the payload when they go beside its message
/// ([`super::wire::Request::Write`]): after a page for the message, so the data area is
/// page-aligned and runs to the payload's end.
pub const DATA_AT: usize = PAGE_BYTES;
const PAGE_BYTES: usize = 4096;
const HEADER_BYTES: usize = PAGE_BYTES;
/// A slot: its header page and its payload.
const SLOT_BYTES: usize = PAGE_BYTES + PAYLOAD_BYTES;
/// The shared memory's size: 64 MiB and change of address space, touched only as used.
pub const REGION_BYTES: usize = HEADER_BYTES + SLOTS * SLOT_BYTES;

pub const FREE: u32 = 0;
pub const CLAIMED: u32 = 1;
pub const SUBMITTED: u32 = 2;
pub const TAKEN: u32 = 3;
pub const DONE: u32 = 4;
/// Taken by the reactor, handed to the connection's workers (a request that needs a
/// reactor client: the server's statistics).
pub const HANDOFF: u32 = 5;

/// The region's first bytes.
#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub slots: AtomicU32,
    pub payload_bytes: AtomicU32,
    /// 1 while the reactor that polls this ring sleeps ([`Header::served_by_reactor`]): a
    /// client that submits then writes 1 to the reactor's eventfd (handed over at connect).
    pub reactor_parked: AtomicU32,
    /// Bumped by a client after each submit (after the slot's state): the word server
    /// workers sleep on, and the one a reactor reads to know whether to look at the slots at
    /// all (a slot submitted without a ring of the doorbell waits for the next one).
    pub doorbell: AtomicU32,
    /// Server workers asleep on the doorbell (a client wakes one only when some sleep).
    pub sleepers: AtomicU32,
    /// 1 when the server's reactor takes this ring's requests itself (its workers only take
    /// what it hands them, `HANDOFF`): a client then wakes the reactor, not a worker.
    pub served_by_reactor: AtomicU32,
    _reserved: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Header>() == 40);
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// A slot's first bytes.
#[repr(C)]
pub struct SlotHeader {
    /// `FREE`, `CLAIMED`, `SUBMITTED`, `TAKEN` or `DONE`: the word a client sleeps on while its
    /// request is served.
    pub state: AtomicU32,
    /// Bytes of the message in the payload.
    pub len: AtomicU32,
    /// 1 while the client sleeps (or is about to) on `state`: only then does the server
    /// make the wake-up system call after it answers. The client stores it, then looks at
    /// `state`, then sleeps; the server stores `state`, then reads it (SeqCst both).
    pub waiting: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<SlotHeader>() == 12);
const _: () = assert!(PAYLOAD_BYTES <= u32::MAX as usize);
const _: () = assert!(DATA_BYTES_MAX + 4096 <= PAYLOAD_BYTES);
const _: () = assert!(DATA_AT + DATA_BYTES_MAX == PAYLOAD_BYTES);

/// One connection's shared memory, mapped.
pub struct Region {
    map: memmap2::MmapRaw,
}

// SAFETY: the region is only ever accessed through atomics and raw-pointer copies, which
// every thread may do (the mapping itself is fixed while the `Region` lives).
unsafe impl Sync for Region {}
// SAFETY: as above.
unsafe impl Send for Region {}

impl Region {
    /// Maps `fd` (a memfd of [`REGION_BYTES`]) shared.
    pub fn map(fd: &std::fs::File) -> std::io::Result<Region> {
        let len = fd.metadata()?.len();
        if len != REGION_BYTES as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("shared memory of {len} bytes, expected {REGION_BYTES}"),
            ));
        }
        let map = memmap2::MmapOptions::new().len(REGION_BYTES).map_raw(fd)?;
        assert_eq!(map.len(), REGION_BYTES);
        Ok(Region { map })
    }

    /// A new region (the server's): a memfd of [`REGION_BYTES`], its header written.
    pub fn create() -> std::io::Result<(std::fs::File, Region)> {
        // SAFETY: a NUL-terminated name and plain flags.
        let fd = unsafe { libc::memfd_create(c"corefs-service".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just gave us, owned by nothing else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(REGION_BYTES as u64)?;
        let region = Region::map(&file)?;
        let h = region.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.slots.store(SLOTS as u32, Ordering::Relaxed);
        h.payload_bytes
            .store(PAYLOAD_BYTES as u32, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok((file, region))
    }

    /// Whether the header says this is a ring this code speaks.
    pub fn check(&self) -> Result<(), String> {
        let h = self.header();
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Relaxed);
        let slots = h.slots.load(Ordering::Relaxed);
        let payload = h.payload_bytes.load(Ordering::Relaxed);
        if magic != MAGIC || version != VERSION {
            return Err(format!(
                "the server speaks another protocol (magic {magic:#x}, version {version}; \
                 this library speaks version {VERSION})"
            ));
        }
        if slots as usize != SLOTS || payload as usize != PAYLOAD_BYTES {
            return Err(format!(
                "the server's ring has {slots} slots of {payload} bytes, this library \
                 expects {SLOTS} of {PAYLOAD_BYTES}"
            ));
        }
        Ok(())
    }

    pub fn header(&self) -> &Header {
        // SAFETY: the map is REGION_BYTES long, page-aligned, and Header is atomics only.
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    pub fn slot(&self, i: usize) -> &SlotHeader {
        assert!(i < SLOTS);
        // SAFETY: in bounds (checked), page-aligned, atomics only.
        unsafe { &*(self.map.as_ptr().add(HEADER_BYTES + i * SLOT_BYTES) as *const SlotHeader) }
    }

    fn payload(&self, i: usize) -> *mut u8 {
        assert!(i < SLOTS);
        // SAFETY: in bounds: the payload ends at the slot's end, within the map.
        unsafe {
            self.map
                .as_mut_ptr()
                .add(HEADER_BYTES + i * SLOT_BYTES + PAGE_BYTES)
        }
    }

    /// Writes `message` into slot `i`'s payload and its length word (the state is the
    /// caller's to publish after).
    pub fn put(&self, i: usize, message: &[u8]) {
        self.put_parts(i, &[message]);
    }

    /// Writes `parts` one after another into slot `i`'s payload, and their total length (an
    /// answer's head and its data: [`super::wire::Encoded`]).
    pub fn put_parts(&self, i: usize, parts: &[&[u8]]) {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        assert!(total <= PAYLOAD_BYTES, "a message larger than a slot");
        let mut at = 0;
        for part in parts {
            // SAFETY: within the payload (the total is checked above); the other side may
            // write it too (only a misbehaving one), which makes its own answer wrong and
            // nothing else.
            unsafe {
                std::ptr::copy_nonoverlapping(part.as_ptr(), self.payload(i).add(at), part.len())
            };
            at += part.len();
        }
        self.slot(i).len.store(total as u32, Ordering::Relaxed);
    }

    /// Slot `i`'s payload to write a message into in place (the client's own slot, which it
    /// claimed: the server reads it only once it is submitted). The caller sets the length.
    ///
    /// # Safety
    /// The caller has claimed slot `i` and holds no other view of its payload.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn payload_mut(&self, i: usize) -> &mut [u8] {
        // SAFETY: in bounds; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.payload(i), PAYLOAD_BYTES) }
    }

    /// Slot `i`'s message in place, or None when its length word is past the payload: for the
    /// client reading an answer (the server wrote it before publishing `DONE`, and touches
    /// the slot no more until the client frees it). The server never reads in place.
    ///
    /// # Safety
    /// The caller owns slot `i` in state `DONE` and frees it only after the borrow ends.
    pub unsafe fn message(&self, i: usize) -> Option<&[u8]> {
        let len = self.slot(i).len.load(Ordering::Relaxed) as usize;
        if len > PAYLOAD_BYTES {
            return None;
        }
        // SAFETY: in bounds; nobody writes it while the caller owns it (contract).
        Some(unsafe { std::slice::from_raw_parts(self.payload(i), len) })
    }

    /// The first `len` bytes of slot `i`'s data area ([`DATA_AT`]) copied once, into a
    /// write's staging copy, each block's crc32c taken of the copy as it is made; None when
    /// `len` is past the data area (the server's side of [`super::wire::Request::Write`]).
    pub fn stage_data(&self, i: usize, len: usize) -> Option<engine::Staged> {
        if len > DATA_BYTES_MAX {
            return None;
        }
        // SAFETY: within the payload (DATA_AT + DATA_BYTES_MAX is its end). The client may
        // write these bytes while they are copied (only a misbehaving one): they are read
        // once, by this copy, and what it sees is what its own write writes.
        let data = unsafe { std::slice::from_raw_parts(self.payload(i).add(DATA_AT), len) };
        Some(engine::Staged::copy_of(data))
    }

    /// Writes `data` into slot `i`'s data area (the client's side of
    /// [`super::wire::Request::Write`]; the message goes in front with its length word).
    pub fn put_data(&self, i: usize, data: &[u8]) {
        assert!(
            data.len() <= DATA_BYTES_MAX,
            "data larger than a slot's area"
        );
        // SAFETY: within the payload (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.payload(i).add(DATA_AT), data.len())
        };
    }

    /// A copy of slot `i`'s message, or None when its length word is past the payload.
    pub fn take(&self, i: usize) -> Option<Vec<u8>> {
        let len = self.slot(i).len.load(Ordering::Relaxed) as usize;
        if len > PAYLOAD_BYTES {
            return None;
        }
        // Not zeroed first: every byte is copied over (a 1 MiB read's answer is copied once).
        let mut out = Vec::with_capacity(len);
        // SAFETY: `len` is within the payload and `out` has room for it; the bytes are
        // initialised by the copy before `set_len` says so.
        unsafe {
            std::ptr::copy_nonoverlapping(self.payload(i), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        Some(out)
    }
}

/// Sleeps while `word` holds `expected`, for at most `timeout` (a shared futex: the word may
/// be in another process's mapping of the same memory).
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a valid, aligned word in a shared mapping and a valid timespec; FUTEX_WAIT
    // only reads the word. EAGAIN (changed), EINTR and ETIMEDOUT all mean: look again.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes up to `n` sleepers on `word`.
pub fn futex_wake(word: &AtomicU32, n: u32) {
    // SAFETY: a valid, aligned word; FUTEX_WAKE touches no memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_is_seen_alike_through_two_mappings_and_refuses_a_long_length() {
        let (file, server) = Region::create().unwrap();
        let client = Region::map(&file).unwrap();
        client.check().unwrap();
        client.put(3, b"hello");
        client.slot(3).state.store(SUBMITTED, Ordering::Release);
        assert_eq!(server.slot(3).state.load(Ordering::Acquire), SUBMITTED);
        assert_eq!(server.take(3).unwrap(), b"hello");
        client.slot(3).len.store(u32::MAX, Ordering::Relaxed);
        assert!(
            server.take(3).is_none(),
            "a length past the payload is refused"
        );
        client.header().magic.store(0, Ordering::Relaxed);
        assert!(client.check().is_err());
    }
}
