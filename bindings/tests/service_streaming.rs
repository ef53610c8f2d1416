//! A thread of a storage-service client that keeps two or more large transfers in flight
//! (1 MiB writes at queue depth 8: fio, a compaction) streams: its waits sleep for the next
//! answer instead of spinning, as an in-process client's do. Checked through the C ABI
//! against a server running in this process: streaming while only large transfers are in
//! flight, not with a small one beside them or a large one alone, and not once their
//! completions are collected; every byte written reads back, through reads longer than one
//! message and short at the end of the file too, and through submitted reads whose data is
//! decoded straight into their buffers. Submitted reads and writes longer than one message
//! go as several and complete whole (they came back short, or failed, before); an atomic
//! batch or an append larger than one message, called or submitted, goes whole, as one
//! request in pieces (they failed with EINVAL before). Submitted writes take their slots
//! all or none: in a ring with two slots free a three-message write is refused with EAGAIN
//! and holds none of them.

#[path = "support/server.rs"]
mod server;

use corefs::abi::*;
use server::{last_error, InProcessServer};

fn streaming(fs: corefs_fs) -> bool {
    test_hook_streaming(fs).expect("the filesystem is open")
}

fn submit_write(fs: corefs_fs, fd: corefs_fd, data: &[u8], offset: u64, token: u64) {
    // SAFETY: `data` is live for `data.len()` bytes; the library copies it before returning.
    let rc = unsafe { corefs_submit_pwrite(fs, fd, data.as_ptr(), data.len(), offset, token) };
    assert_eq!(rc, 0, "submit: {}", last_error());
}

/// Collects `n` completions, each a whole write.
fn collect(fs: corefs_fs, n: usize, lens: &[usize]) {
    let mut got = 0;
    let mut out = vec![corefs_completion::default(); 8];
    while got < n {
        // SAFETY: `out` has room for `out.len()` completions.
        let k = unsafe { corefs_poll(fs, out.as_mut_ptr(), out.len(), 1_000_000) };
        assert!(k >= 0, "poll: {}", last_error());
        for c in &out[..k as usize] {
            assert_eq!(c.result, lens[c.token as usize] as i64, "write {}", c.token);
        }
        got += k as usize;
    }
}

#[test]
fn a_service_client_streams_while_only_large_transfers_are_in_flight() {
    let server = InProcessServer::start();
    let fs = server.connect();
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, c"big".as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o644) };
    assert!(fd >= 0, "open: {}", last_error());

    let large = 512 << 10;
    let lens = [large, large, 4096, large, large];
    let data: Vec<Vec<u8>> = (0..lens.len())
        .map(|k| vec![b'a' + k as u8; lens[k]])
        .collect();
    let offsets = [0u64, 512 << 10, 1 << 20, 2 << 20, 3 << 20];

    assert!(!streaming(fs), "nothing in flight");
    submit_write(fs, fd, &data[0], offsets[0], 0);
    assert!(!streaming(fs), "one large transfer alone");
    submit_write(fs, fd, &data[1], offsets[1], 1);
    assert!(streaming(fs), "two large transfers");
    submit_write(fs, fd, &data[2], offsets[2], 2);
    assert!(!streaming(fs), "a small write beside them");
    collect(fs, 3, &lens);
    assert!(!streaming(fs), "every completion collected");
    submit_write(fs, fd, &data[3], offsets[3], 3);
    submit_write(fs, fd, &data[4], offsets[4], 4);
    assert!(streaming(fs), "two large transfers again");
    collect(fs, 2, &lens);
    assert!(!streaming(fs), "collected again");

    for k in 0..lens.len() {
        let mut back = vec![0u8; lens[k]];
        // SAFETY: `back` has room for `back.len()` bytes.
        let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), offsets[k]) };
        assert_eq!(n, lens[k] as i64, "read {k}: {}", last_error());
        assert!(back == data[k], "write {k} read back different bytes");
    }
    // Reads longer than one message go as several, each answer's data straight into its
    // place in the caller's buffer; the last is short at the end of the file (3.5 MiB).
    let mut model = vec![0u8; 7 << 19];
    for k in 0..lens.len() {
        let at = offsets[k] as usize;
        model[at..at + lens[k]].copy_from_slice(&data[k]);
    }
    for (offset, len) in [(0usize, 4 << 20), (300 << 10, 3 << 19), (3 << 20, 1 << 20)] {
        let mut back = vec![0xEEu8; len];
        // SAFETY: `back` has room for `back.len()` bytes.
        let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), len, offset as u64) };
        let want = len.min(model.len() - offset);
        assert_eq!(n, want as i64, "read {len} at {offset}: {}", last_error());
        assert!(
            back[..want] == model[offset..offset + want],
            "read {len} at {offset}"
        );
        assert!(
            back[want..].iter().all(|&b| b == 0xEE),
            "past the end of {len} at {offset}"
        );
    }
    // Submitted reads: each answer's data is decoded straight into its buffer; every
    // completion says how much, short at the end of the file, and nothing past it is touched.
    let reads = [
        (0usize, 1 << 20),
        (512 << 10, 2 << 20),
        (3 << 20, 1 << 20),
        (100, 4096),
    ];
    let mut bufs: Vec<Vec<u8>> = reads.iter().map(|&(_, len)| vec![0xEEu8; len]).collect();
    for (k, (&(offset, len), buf)) in reads.iter().zip(bufs.iter_mut()).enumerate() {
        // SAFETY: `buf` outlives the read's completion, collected below, and is not touched
        // meanwhile.
        let rc = unsafe {
            corefs_submit_pread(fs, fd, buf.as_mut_ptr(), len, offset as u64, 100 + k as u64)
        };
        assert_eq!(rc, 0, "submit read {k}: {}", last_error());
    }
    let mut done = 0;
    let mut out = vec![corefs_completion::default(); 8];
    while done < reads.len() {
        // SAFETY: `out` has room for `out.len()` completions.
        let k = unsafe { corefs_poll(fs, out.as_mut_ptr(), out.len(), 1_000_000) };
        assert!(k >= 0, "poll: {}", last_error());
        for c in &out[..k as usize] {
            let r = (c.token - 100) as usize;
            let (offset, len) = reads[r];
            let want = len.min(model.len() - offset);
            assert_eq!(c.result, want as i64, "read {r}");
            assert!(
                bufs[r][..want] == model[offset..offset + want],
                "read {r}'s bytes"
            );
            assert!(
                bufs[r][want..].iter().all(|&b| b == 0xEE),
                "past read {r}'s end"
            );
        }
        done += k as usize;
    }
    // A submitted write of more than one message goes as several; its completion counts
    // them all, and the bytes read back.
    let big: Vec<u8> = (0..5 << 19).map(|i: usize| (i % 251) as u8).collect();
    submit_write(fs, fd, &big, 4 << 20, 0);
    collect(fs, 1, &[big.len()]);
    let mut back = vec![0u8; big.len()];
    // SAFETY: `back` has room for `back.len()` bytes.
    let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 4 << 20) };
    assert_eq!(n, big.len() as i64, "{}", last_error());
    assert!(
        back == big,
        "a 2.5 MiB submitted write read back different bytes"
    );
    // A called write of more than one message, at an offset inside a block: its parts go
    // from the caller's buffer straight into their slots, in order.
    let called: Vec<u8> = (0..(5 << 19) + 333)
        .map(|i: usize| (i % 241) as u8)
        .collect();
    let at = (4 << 20) + 1000;
    // SAFETY: a live buffer of the length given.
    let n = unsafe { corefs_pwrite(fs, fd, called.as_ptr(), called.len(), at) };
    assert_eq!(n, called.len() as i64, "{}", last_error());
    let mut back = vec![0u8; called.len() + 1000];
    // SAFETY: `back` has room for `back.len()` bytes.
    let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 4 << 20) };
    assert_eq!(n, back.len() as i64, "{}", last_error());
    assert_eq!(
        back[..1000],
        big[..1000],
        "the bytes before the called write"
    );
    assert!(
        back[1000..1000 + called.len()] == called[..],
        "a 2.5 MiB called write read back different bytes"
    );
    // An atomic batch larger than one message (a 2.5 MiB write, small ones before and after
    // it, one overlapping it) goes as one request in pieces the server keeps until the last;
    // it applies whole, in order.
    assert_eq!(corefs_atomic_begin(fs, fd), 0, "{}", last_error());
    let mut expect = vec![0u8; 12 << 20];
    // SAFETY: `back` has room for its length.
    let n = unsafe { corefs_pread(fs, fd, expect.as_mut_ptr(), expect.len(), 0) };
    assert!(n > 0, "{}", last_error());
    let batch: [(usize, Vec<u8>); 4] = [
        (9 << 20, vec![1; 4096]),
        (
            6 << 20,
            (0..5 << 19).map(|i: usize| (i % 241) as u8).collect(),
        ),
        (7 << 20, vec![2; 100]),
        (11 << 20, vec![3; 300 << 10]),
    ];
    for (offset, data) in &batch {
        // SAFETY: `data` is live for its length.
        let n = unsafe { corefs_pwrite(fs, fd, data.as_ptr(), data.len(), *offset as u64) };
        assert_eq!(n, data.len() as i64, "{}", last_error());
        expect[*offset..*offset + data.len()].copy_from_slice(data);
    }
    assert_eq!(corefs_atomic_commit(fs, fd), 0, "{}", last_error());
    let end = (11 << 20) + (300 << 10);
    let mut back = vec![0u8; end];
    // SAFETY: `back` has room for its length.
    let n = unsafe { corefs_pread(fs, fd, back.as_mut_ptr(), back.len(), 0) };
    assert_eq!(n, end as i64, "{}", last_error());
    assert!(
        back == expect[..end],
        "the batch in parts applied differently"
    );
    // An append of more than one message (it must not be cut: another appender could land
    // between its parts) goes as one request in pieces the server puts back together.
    // SAFETY: a NUL-terminated path.
    let afd = unsafe {
        corefs_open(
            fs,
            c"log".as_ptr(),
            libc::O_CREAT | libc::O_WRONLY | COREFS_O_APPEND,
            0o644,
        )
    };
    assert!(afd >= 0, "open: {}", last_error());
    let record: Vec<u8> = (0..(5 << 19) + 7).map(|i: usize| (i % 239) as u8).collect();
    for _ in 0..2 {
        // SAFETY: `record` is live for its length.
        let n = unsafe { corefs_pwrite(fs, afd, record.as_ptr(), record.len(), 0) };
        assert_eq!(n, record.len() as i64, "append: {}", last_error());
    }
    // A submitted one too: its pieces go at the submit, its last as the operation.
    submit_write(fs, afd, &record, 0, 0);
    collect(fs, 1, &[record.len()]);
    // SAFETY: a NUL-terminated path.
    let rfd = unsafe { corefs_open(fs, c"log".as_ptr(), libc::O_RDONLY, 0) };
    assert!(rfd >= 0, "open: {}", last_error());
    let mut back = vec![0u8; 3 * record.len() + 1];
    // SAFETY: `back` has room for its length.
    let n = unsafe { corefs_pread(fs, rfd, back.as_mut_ptr(), back.len(), 0) };
    assert_eq!(n, 3 * record.len() as i64, "{}", last_error());
    assert!(back[..n as usize].chunks(record.len()).all(|r| r == record));
    assert_eq!(corefs_release(fs, afd), 0, "{}", last_error());
    assert_eq!(corefs_release(fs, rfd), 0, "{}", last_error());
    assert_eq!(corefs_release(fs, fd), 0, "{}", last_error());
    assert_eq!(corefs_close(fs), 0, "{}", last_error());

    // A ring with two slots free: submitted 1 MiB writes (one message each, copied from the
    // caller's buffer into their slots) fill all but two of a fresh connection's 64; a
    // 2.5 MiB write needs three and goes whole or not at all: refused with EAGAIN, it holds
    // none of the two (two more 1 MiB writes go), and writes nothing. Every accepted write
    // completes whole and reads back.
    let fs = server.connect();
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, c"ring".as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o644) };
    assert!(fd >= 0, "open: {}", last_error());
    let mib = 1usize << 20;
    let chunk = |k: usize| vec![(k % 200) as u8 + 1; mib];
    let submit_chunk = |k: usize| {
        let data = chunk(k);
        // SAFETY: `data` is live for its length; the library copies it during the call.
        unsafe { corefs_submit_pwrite(fs, fd, data.as_ptr(), mib, (k * mib) as u64, k as u64) }
    };
    for k in 0..62 {
        assert_eq!(submit_chunk(k), 0, "submit {k}: {}", last_error());
    }
    let three = vec![0xABu8; (5 << 19) + 1];
    let at = (64 * mib) as u64;
    // SAFETY: `three` is live for its length.
    let rc = unsafe { corefs_submit_pwrite(fs, fd, three.as_ptr(), three.len(), at, 999) };
    assert_eq!(
        rc,
        -libc::EAGAIN,
        "a write of three messages with two slots free"
    );
    for k in 62..64 {
        assert_eq!(submit_chunk(k), 0, "submit {k}: {}", last_error());
    }
    assert_eq!(
        submit_chunk(64),
        -libc::EAGAIN,
        "a 65th message in a ring of 64"
    );
    collect(fs, 64, &[mib; 64]);
    let mut one = vec![0u8; mib];
    for k in 0..64 {
        // SAFETY: `one` has room for its length.
        let n = unsafe { corefs_pread(fs, fd, one.as_mut_ptr(), one.len(), (k * mib) as u64) };
        assert_eq!(n, mib as i64, "write {k}: {}", last_error());
        assert!(
            one == chunk(k),
            "submitted write {k} read back different bytes"
        );
    }
    // Nothing past the 64th: the refused write wrote nothing.
    // SAFETY: `one` has room for its length.
    let n = unsafe { corefs_pread(fs, fd, one.as_mut_ptr(), one.len(), (64 * mib) as u64) };
    assert_eq!(n, 0, "bytes past the accepted writes: {}", last_error());
    assert_eq!(corefs_release(fs, fd), 0, "{}", last_error());
    assert_eq!(corefs_close(fs), 0, "{}", last_error());
    server.stop();
}
