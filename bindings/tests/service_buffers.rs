//! Buffers from `corefs_buf_alloc` through a storage service: they live in memory the process
//! shares with the server (`service::arena`), so a read or write from or into one names its
//! place there and the server copies the bytes itself; nothing is copied on the client's
//! side. Checked through the C ABI against a server running in this process: called and
//! submitted reads and writes, of one message and of several, at offsets inside blocks,
//! read back through arena buffers and through ordinary memory alike; the server's count of
//! bytes moved in place is exactly what went through arena buffers (ordinary memory adds
//! nothing to it); a read never writes past its own buffer in the arena.

#[path = "support/server.rs"]
mod server;

use corefs::abi::*;
use server::{last_error, InProcessServer};

/// A buffer of `corefs_buf_alloc`, freed on drop.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Buf {
        let ptr = corefs_buf_alloc(len);
        assert!(!ptr.is_null(), "buf_alloc: {}", last_error());
        Buf { ptr, len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes from corefs_buf_alloc, this value's alone.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: from corefs_buf_alloc(len), not used after.
        unsafe { corefs_buf_free(self.ptr, self.len) };
    }
}

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + seed * 7) % 251) as u8)
        .collect()
}

/// Bytes the server moved in place in its clients' arenas, over every connection.
fn bytes_shared(observer: &mut corefs::service::Observer) -> u64 {
    let stats = observer.sample().expect("server statistics");
    stats.clients.iter().map(|c| c.bytes_shared).sum()
}

fn poll_one(fs: corefs_fs) -> corefs_completion {
    let mut out = [corefs_completion::default()];
    // SAFETY: `out` has room for one completion.
    let k = unsafe { corefs_poll(fs, out.as_mut_ptr(), 1, 5_000_000) };
    assert_eq!(k, 1, "poll: {}", last_error());
    out[0]
}

#[test]
fn buffers_from_buf_alloc_cross_a_service_without_a_client_copy() {
    let server = InProcessServer::start();
    let fs = server.connect();
    let mut observer = corefs::service::Observer::connect(&server.socket).unwrap();
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, c"f".as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o644) };
    assert!(fd >= 0, "open: {}", last_error());

    // A called write of several messages (2.5 MiB + 333) from an arena buffer, at an
    // offset inside a block.
    let len = (5 << 19) + 333;
    let first = pattern(1, len);
    let mut src = Buf::new(len);
    src.bytes().copy_from_slice(&first);
    let at = 1000u64;
    let shared_before = bytes_shared(&mut observer);
    // SAFETY: `src` holds `len` bytes.
    let n = unsafe { corefs_pwrite(fs, fd, src.ptr, len, at) };
    assert_eq!(n, len as i64, "pwrite: {}", last_error());
    let mut moved = len as u64;
    assert_eq!(
        bytes_shared(&mut observer) - shared_before,
        moved,
        "every byte of the write was read by the server from the arena"
    );

    // Read back into an arena buffer larger than the file's rest: each part placed by the
    // server, short at the end, nothing past it touched.
    let mut dst = Buf::new(len + 8192);
    dst.bytes().fill(0xEE);
    // SAFETY: `dst` holds `len + 8192` bytes.
    let n = unsafe { corefs_pread(fs, fd, dst.ptr, len + 8192, at) };
    assert_eq!(n, len as i64, "pread: {}", last_error());
    moved += len as u64;
    assert!(
        dst.bytes()[..len] == first[..],
        "read back through the arena"
    );
    assert!(
        dst.bytes()[len..].iter().all(|&b| b == 0xEE),
        "past the end"
    );
    // Into ordinary memory: the same bytes, and nothing counted in place.
    let mut heap = vec![0u8; len];
    // SAFETY: `heap` holds `len` bytes.
    let n = unsafe { corefs_pread(fs, fd, heap.as_mut_ptr(), len, at) };
    assert_eq!(n, len as i64, "pread: {}", last_error());
    assert!(heap == first, "read back through ordinary memory");
    assert_eq!(bytes_shared(&mut observer) - shared_before, moved);

    // A part of an arena buffer (its middle) is as good as the whole.
    // SAFETY: 100 bytes inside `dst`.
    let n = unsafe { corefs_pwrite(fs, fd, dst.ptr.add(5), 100, 7) };
    assert_eq!(n, 100, "pwrite: {}", last_error());
    moved += 100;
    let mut model = vec![0u8; at as usize];
    model.extend_from_slice(&first);
    model[7..107].copy_from_slice(&first[5..105]);

    // Submitted: a write of several messages from an arena buffer (kept as it is until its
    // completion), then a read of several into another, completing as the bytes placed.
    let second = pattern(2, 3 << 20);
    let mut wbuf = Buf::new(second.len());
    wbuf.bytes().copy_from_slice(&second);
    let wat = 2 << 20;
    // SAFETY: `wbuf` holds the bytes and outlives the completion polled below.
    let rc = unsafe { corefs_submit_pwrite(fs, fd, wbuf.ptr, second.len(), wat, 7) };
    assert_eq!(rc, 0, "submit write: {}", last_error());
    let c = poll_one(fs);
    assert_eq!((c.token, c.result), (7, second.len() as i64));
    moved += second.len() as u64;
    let end = wat as usize + second.len();
    model.resize(end, 0);
    model[wat as usize..end].copy_from_slice(&second);

    let mut rbuf = Buf::new(model.len() + 4096);
    rbuf.bytes().fill(0xEE);
    // SAFETY: `rbuf` outlives the completion polled below and is not touched meanwhile.
    let rc = unsafe { corefs_submit_pread(fs, fd, rbuf.ptr, model.len() + 4096, 0, 8) };
    assert_eq!(rc, 0, "submit read: {}", last_error());
    let c = poll_one(fs);
    assert_eq!((c.token, c.result), (8, model.len() as i64));
    moved += model.len() as u64;
    assert!(rbuf.bytes()[..model.len()] == model[..], "submitted read");
    assert!(rbuf.bytes()[model.len()..].iter().all(|&b| b == 0xEE));
    assert_eq!(
        bytes_shared(&mut observer) - shared_before,
        moved,
        "every arena transfer, and only those, moved in place"
    );

    // Ordinary memory still goes through the ring, and reads back the same.
    let mut back = vec![0u8; model.len()];
    // SAFETY: `back` holds that many bytes.
    let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 0) };
    assert_eq!(n, model.len() as i64);
    assert!(back == model, "the file as written");
    assert_eq!(bytes_shared(&mut observer) - shared_before, moved);

    assert_eq!(corefs_release(fs, fd), 0);
    assert_eq!(corefs_close(fs), 0);
    drop(observer);
    server.stop();
}

/// An append larger than a message from an arena buffer goes whole, as one request naming
/// its place in the arena: the server copies it once from there (before, it was copied into
/// an encoded request and sent in pieces, and moved nothing in place). Called and
/// submitted, each lands whole at the end of the file.
#[test]
fn a_large_append_from_buf_alloc_crosses_whole_and_in_place() {
    let server = InProcessServer::start();
    let fs = server.connect();
    let mut observer = corefs::service::Observer::connect(&server.socket).unwrap();
    let flags = libc::O_CREAT | libc::O_RDWR | COREFS_O_APPEND;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, c"log".as_ptr(), flags, 0o644) };
    assert!(fd >= 0, "open: {}", last_error());
    let shared_before = bytes_shared(&mut observer);

    let head = pattern(3, 100);
    // SAFETY: `head` holds its bytes; an ordinary buffer, through the ring.
    let n = unsafe { corefs_pwrite(fs, fd, head.as_ptr(), head.len(), 0) };
    assert_eq!(n, head.len() as i64, "append: {}", last_error());
    assert_eq!(
        bytes_shared(&mut observer),
        shared_before,
        "ordinary memory"
    );

    let first = pattern(4, (3 << 20) + 77);
    let mut a = Buf::new(first.len());
    a.bytes().copy_from_slice(&first);
    // SAFETY: `a` holds the bytes. The offset is ignored by an append handle.
    let n = unsafe { corefs_pwrite(fs, fd, a.ptr, first.len(), 0) };
    assert_eq!(n, first.len() as i64, "append: {}", last_error());
    let mut moved = first.len() as u64;
    assert_eq!(bytes_shared(&mut observer) - shared_before, moved);

    let second = pattern(5, (2 << 20) + 5);
    let mut b = Buf::new(second.len());
    b.bytes().copy_from_slice(&second);
    // SAFETY: `b` holds the bytes and outlives the completion polled below.
    let rc = unsafe { corefs_submit_pwrite(fs, fd, b.ptr, second.len(), 0, 9) };
    assert_eq!(rc, 0, "submit append: {}", last_error());
    let c = poll_one(fs);
    assert_eq!((c.token, c.result), (9, second.len() as i64));
    moved += second.len() as u64;
    assert_eq!(bytes_shared(&mut observer) - shared_before, moved);

    let mut model = head.clone();
    model.extend_from_slice(&first);
    model.extend_from_slice(&second);
    let mut back = vec![0u8; model.len() + 10];
    // SAFETY: `back` holds that many bytes.
    let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 0) };
    assert_eq!(n, model.len() as i64, "pread: {}", last_error());
    assert!(
        back[..model.len()] == model[..],
        "the appends, whole and in order"
    );

    assert_eq!(corefs_release(fs, fd), 0);
    assert_eq!(corefs_close(fs), 0);
    drop(observer);
    server.stop();
}
