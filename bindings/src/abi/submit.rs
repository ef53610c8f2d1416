//! Asynchronous I/O: reads, writes and fsyncs submitted on this thread's queue, and their
//! completions polled.
//! (Part of the C ABI: [`super`] states its conventions.)

use super::files::{no_batch, sync_op, writable};
use super::*;

/// An asynchronous operation in flight on this thread.
struct Pending {
    user_token: u64,
    /// Reads: where the data goes (the caller keeps the buffer alive until the completion).
    read_into: Option<(*mut u8, usize)>,
    /// Its hold on the handle's file, and the file.
    holds: (std::sync::Arc<handles::InFlight>, u64),
}

thread_local! {
    static PENDING: RefCell<HashMap<(i64, u64), Pending>> = RefCell::new(HashMap::new());
    static NEXT_TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(1) };
}

/// What a submit sends: an operation, or a write of the caller's bytes, which are copied
/// during the call (staged in process; through a service straight into the ring,
/// [`crate::dispatch::Conn::submit_write`]).
enum Submission<'a> {
    Op(Op),
    Write {
        ino: u64,
        offset: u64,
        append: bool,
        data: &'a [u8],
    },
}

/// Submits `what` on file handle `f` (pinned for this call); the operation holds the file
/// until its completion is polled, so a release meanwhile does not delete it under the
/// operation ([`handles::InFlight`]).
fn submit(
    fs: &FsRef,
    f: &handles::FileRef,
    what: Submission<'_>,
    user_token: u64,
    read_into: Option<(*mut u8, usize)>,
) -> Result<(), Error> {
    let token = NEXT_TOKEN.with(|t| {
        let v = t.get();
        t.set(v + 1);
        v
    });
    let in_flight = f.in_flight();
    in_flight.begin();
    let submitted = with_client(fs, |c| match (what, read_into) {
        (
            Submission::Write {
                ino,
                offset,
                append,
                data,
            },
            _,
        ) => c.submit_write(ino, offset, append, data, token),
        (Submission::Op(op), Some((buf, len))) if len > 0 => {
            // SAFETY: the submitter promised `buf` valid for `len` bytes until this read's
            // completion is polled.
            let into = unsafe { crate::service::client::ReadDest::new(buf, len) };
            c.submit_read(op, token, into)
        }
        (Submission::Op(op), _) => c.submit(op, token),
    })
    .and_then(|r| {
        r.map_err(|e| match e {
            reactor::SubmitError::Full(_) => Error::new(
                libc::EAGAIN,
                "queue full: poll completions and submit again".into(),
            ),
            reactor::SubmitError::Stopped(_) => {
                Error::new(libc::EBADF, "the filesystem is closing".into())
            }
        })
    });
    if let Err(e) = submitted {
        // The pin keeps the handle from being released during this call.
        assert!(!in_flight.end(), "a handle released under a pinned call");
        return Err(e);
    }
    PENDING.with(|p| {
        p.borrow_mut().insert(
            (fs.id, token),
            Pending {
                user_token,
                read_into,
                holds: (in_flight, f.ino),
            },
        )
    });
    Ok(())
}

/// Submits a read of up to `len` bytes at `offset` into `buf` (bounded as `corefs_pread`);
/// its completion (on this thread's queue, see `corefs_poll`) carries `token` and the bytes
/// read. -EAGAIN when this thread has 256 operations in flight: poll, then submit again.
///
/// # Safety
/// `buf` stays valid for writing `len` bytes until the completion is polled, on this thread.
#[no_mangle]
pub unsafe extern "C" fn corefs_submit_pread(
    fs: corefs_fs,
    fd: corefs_fd,
    buf: *mut u8,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    status("corefs_submit_pread", || {
        if buf.is_null() && len > 0 {
            return Err(efault("buf"));
        }
        let len = io_len(offset, len)?;
        let fs = fs_of(fs)?;
        let f = regular(&fs, fd)?;
        no_batch(&f, fd)?;
        need_readable(&f, fd)?;
        submit(
            &fs,
            &f,
            Submission::Op(Op::Read {
                ino: f.ino,
                offset,
                len,
            }),
            token,
            Some((buf, len)),
        )
    })
}

/// Submits a write of `len` bytes at `offset` (bounded as `corefs_pwrite`, and an atomic
/// append through a COREFS_O_APPEND handle). The data is copied during the call, so `buf`
/// may be reused at once, except a buffer from `corefs_buf_alloc` through a server: the
/// server reads it in place later, so it stays as it is until the completion is polled (as
/// with io_uring). Completion as `corefs_submit_pread`.
///
/// # Safety
/// `buf` is valid for reading `len` bytes during the call (a buffer from `corefs_buf_alloc`,
/// through a server: until the completion is polled).
#[no_mangle]
pub unsafe extern "C" fn corefs_submit_pwrite(
    fs: corefs_fs,
    fd: corefs_fd,
    buf: *const u8,
    len: usize,
    offset: u64,
    token: u64,
) -> c_int {
    status("corefs_submit_pwrite", || {
        let fs = fs_of(fs)?;
        let f = writable(&fs, fd)?;
        no_batch(&f, fd)?;
        // Bounded before the copy: a huge `len` never sizes an allocation.
        let len = io_len(if f.append { 0 } else { offset }, len)?;
        // SAFETY: forwarded from this function's contract (`len` only shrank).
        let data = unsafe { bytes(buf, len, "buf") }?;
        let write = Submission::Write {
            ino: f.ino,
            offset,
            append: f.append,
            data,
        };
        submit(&fs, &f, write, token, None)
    })
}

/// Submits an fsync (`datasync` non-zero: fdatasync). fsyncs submitted together, from any
/// threads, share one log record and one flush. Operations of one thread run in the order
/// submitted, so an fsync covers the writes submitted before it.
#[no_mangle]
pub extern "C" fn corefs_submit_fsync(
    fs: corefs_fs,
    fd: corefs_fd,
    datasync: c_int,
    token: u64,
) -> c_int {
    status("corefs_submit_fsync", || {
        let fs = fs_of(fs)?;
        let f = file(&fs, fd)?;
        submit(
            &fs,
            &f,
            Submission::Op(sync_op(f.ino, datasync != 0)),
            token,
            None,
        )
    })
}

/// Moves up to `max` completions of this thread's asynchronous operations into `out`, waiting
/// up to `timeout_us` microseconds for the first (0: do not wait). Returns how many. A poll
/// that finds completions left from an earlier poll (past its `max`) returns them without
/// waiting.
///
/// # Safety
/// `out` is valid for writing `max` completions.
#[no_mangle]
pub unsafe extern "C" fn corefs_poll(
    fs: corefs_fs,
    out: *mut corefs_completion,
    max: usize,
    timeout_us: u64,
) -> i64 {
    guard("corefs_poll", || {
        if max == 0 {
            return Ok(0);
        }
        if out.is_null() {
            return Err(efault("out"));
        }
        let fs = fs_of(fs)?;
        let mut done = Vec::new();
        // A completion left over from an earlier poll is an answer in hand: waiting for a new
        // one then held it back for a whole device round trip. fio reaps one completion per
        // call at queue depth 32, so each of its polls waited for the next read to finish
        // while the others sat here: 20k IOPS with under one read on the device, where the
        // same image reads 95k.
        let in_hand = OVERFLOW.with(|o| {
            o.borrow().get(&fs.id).is_some_and(|list| {
                PENDING.with(|p| {
                    let pending = p.borrow();
                    list.iter()
                        .any(|(token, _)| pending.contains_key(&(fs.id, *token)))
                })
            })
        });
        with_client(&fs, |c| {
            if timeout_us == 0 || in_hand {
                c.poll(&mut done);
            } else {
                c.wait(&mut done, Duration::from_micros(timeout_us));
            }
        })?;
        // Completions past `max` wait in this thread's overflow list for the next poll.
        let mut written = 0usize;
        let mut released_after = Vec::new();
        OVERFLOW.with(|o| {
            let mut overflow = o.borrow_mut();
            let list = overflow.entry(fs.id).or_default();
            list.extend(done.into_iter().map(|c| (c.token, c.result)));
            while written < max {
                let Some((token, result)) = list.pop_front() else {
                    break;
                };
                let Some(pending) = PENDING.with(|p| p.borrow_mut().remove(&(fs.id, token))) else {
                    continue; // a synchronous call's completion never lands here
                };
                let (in_flight, ino) = &pending.holds;
                if in_flight.end() {
                    released_after.push(*ino);
                }
                let value = match result {
                    Ok(Reply::Data(data)) => {
                        let (buf, len) = pending.read_into.unwrap_or((std::ptr::null_mut(), 0));
                        let n = data.len().min(len);
                        if n > 0 {
                            // SAFETY: the submitter promised `buf` valid for `len` bytes until
                            // this completion is polled.
                            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, n) };
                        }
                        n as i64
                    }
                    // A service client put the data in place already.
                    Ok(Reply::Placed(n)) => {
                        n.min(pending.read_into.map_or(0, |(_, len)| len)) as i64
                    }
                    Ok(Reply::Written(n) | Reply::Appended { written: n, .. }) => n as i64,
                    Ok(_) => 0,
                    Err(e) => -(e.errno() as i64),
                };
                // SAFETY: written < max, and `out` holds `max` entries by contract.
                unsafe {
                    out.add(written).write(corefs_completion {
                        token: pending.user_token,
                        result: value,
                    })
                };
                written += 1;
            }
        });
        // Files whose handle was released while these were in flight: released now that
        // their last operation is answered (outside the thread-local borrows above).
        for ino in released_after {
            if let Err(e) = call(&fs, Op::Release { ino }) {
                tracing::warn!(
                    ino,
                    "releasing a file after its last asynchronous operation: {}",
                    e.message
                );
            }
        }
        Ok(written as i64)
    })
}

/// Completions polled from the client but not yet handed to C (more than `max` arrived).
type Overflow = HashMap<i64, std::collections::VecDeque<(u64, Result<Reply, engine::EngineError>)>>;

thread_local! {
    static OVERFLOW: RefCell<Overflow> = RefCell::new(HashMap::new());
}
