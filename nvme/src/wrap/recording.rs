//! The recording wrapper: every write, write-zeroes, deallocate and flush that completes
//! successfully is appended to a shared [`WriteLog`] in completion order, with the written bytes
//! as they were submitted. Crash testing replays a prefix of the log onto the starting image and
//! drops or tears what no flush covered ([`super::crash`]).
//!
//! Invariant: a `Flush` record carries `covers`, the number of records completed when the flush
//! was *submitted*; exactly those are made durable by it. Writes completing while the flush was
//! in flight are not covered, as on real hardware.
//!
//! Beside the completion-ordered records the log keeps every write's *submission*
//! ([`Submission`]): when it was submitted (the record count then) and which record its
//! completion became. A power cut between the two leaves the write in flight: any of its LBAs
//! may have landed, FUA or not, which is how a crash tears a FUA record or keeps a batch's
//! record and loses its in-place data ([`super::crash`]).

use super::TokenTable;
use crate::{
    BlockDevice, DevError, DeviceInfo, DmaPool, IoCompletion, IoOp, Rejected, Request, SimAccess,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Write {
        lba: u64,
        data: Arc<[u8]>,
        fua: bool,
    },
    WriteZeroes {
        lba: u64,
        lbas: u32,
    },
    Deallocate {
        lba: u64,
        lbas: u32,
    },
    /// A completed flush; records `0..covers` are durable.
    Flush {
        covers: usize,
    },
}

/// A write (or write-zeroes, or deallocate) as it was submitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    /// Records completed when it was submitted: in flight at every cut from here...
    pub submitted_at: usize,
    /// ...up to its own completion record (None: it never completed, or failed).
    pub completed_at: Option<usize>,
    /// The write (a `Record::Write`, `WriteZeroes` or `Deallocate`).
    pub record: Record,
}

impl Submission {
    /// True when a power cut after the first `cut` records finds it in flight.
    pub fn in_flight_at(&self, cut: usize) -> bool {
        self.submitted_at <= cut && self.completed_at.is_none_or(|done| done >= cut)
    }
}

/// The shared, append-only log. Tests keep a handle while the device is owned elsewhere.
#[derive(Debug, Default)]
pub struct WriteLog {
    records: Mutex<Vec<Record>>,
    submissions: Mutex<Vec<Submission>>,
}

impl WriteLog {
    pub fn snapshot(&self) -> Vec<Record> {
        self.records.lock().expect("write log lock").clone()
    }
    /// Every write submitted so far, in submission order (the completed ones name their
    /// record).
    pub fn submissions(&self) -> Vec<Submission> {
        self.submissions.lock().expect("write log lock").clone()
    }
    pub fn len(&self) -> usize {
        self.records.lock().expect("write log lock").len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Takes every record and submission logged so far, leaving the log empty (a tester that
    /// reuses one device for many runs).
    pub fn take(&self) -> (Vec<Record>, Vec<Submission>) {
        let mut records = self.records.lock().expect("write log lock");
        let mut submissions = self.submissions.lock().expect("write log lock");
        (
            std::mem::take(&mut *records),
            std::mem::take(&mut *submissions),
        )
    }
    /// Appends a completed op; returns its index.
    fn push(&self, record: Record) -> usize {
        let mut records = self.records.lock().expect("write log lock");
        records.push(record);
        records.len() - 1
    }
    /// Notes a write being submitted; returns its submission index.
    fn submit(&self, record: Record) -> usize {
        let submitted_at = self.len();
        let mut submissions = self.submissions.lock().expect("write log lock");
        submissions.push(Submission {
            submitted_at,
            completed_at: None,
            record,
        });
        submissions.len() - 1
    }
    fn completed(&self, submission: usize, record: usize) {
        self.submissions.lock().expect("write log lock")[submission].completed_at = Some(record);
    }
    /// A failed write is taken as never having reached the device.
    fn failed(&self, submission: usize) {
        let mut submissions = self.submissions.lock().expect("write log lock");
        submissions[submission].submitted_at = usize::MAX;
    }
}

struct Pending {
    caller_token: u64,
    /// What to log if the op succeeds; a flush's `covers` is fixed at submission.
    record: Option<Record>,
    /// The write's submission entry, for a write.
    submission: Option<usize>,
}

/// [`BlockDevice::any_thread_io`] of a recording device: the inner device's, with its writes
/// and flushes logged as the queue's are. A synchronous write is in flight from its
/// submission to its completion, like a queued one.
struct RecordingSideIo {
    inner: Box<dyn crate::AnyThreadIo>,
    log: Arc<WriteLog>,
}

impl crate::AnyThreadIo for RecordingSideIo {
    fn read_at(&mut self, lba: u64, out: &mut [u8]) -> Result<(), DevError> {
        self.inner.read_at(lba, out)
    }

    fn writes(&self) -> bool {
        self.inner.writes()
    }

    fn write_at(&mut self, lba: u64, data: &[u8], fua: bool) -> Result<(), DevError> {
        let submission = self.log.submit(Record::Write {
            lba,
            data: Arc::from(data),
            fua,
        });
        match self.inner.write_at(lba, data, fua) {
            Ok(()) => {
                let index = self.log.push(Record::Write {
                    lba,
                    data: Arc::from(data),
                    fua,
                });
                self.log.completed(submission, index);
                Ok(())
            }
            Err(e) => {
                self.log.failed(submission);
                Err(e)
            }
        }
    }

    fn flush(&mut self) -> Result<(), DevError> {
        let covers = self.log.len();
        self.inner.flush()?;
        self.log.push(Record::Flush { covers });
        Ok(())
    }
}

pub struct RecordingDevice<D: BlockDevice> {
    inner: D,
    log: Arc<WriteLog>,
    pending: TokenTable<Pending>,
}

impl<D: BlockDevice> RecordingDevice<D> {
    pub fn new(inner: D) -> Self {
        let depth = inner.info().queue_depth;
        RecordingDevice {
            inner,
            log: Arc::new(WriteLog::default()),
            pending: TokenTable::new(depth),
        }
    }

    pub fn log(&self) -> Arc<WriteLog> {
        Arc::clone(&self.log)
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    pub fn into_inner(self) -> D {
        self.inner
    }

    fn translate(&mut self, completions: &mut [IoCompletion], from: usize) {
        for completion in &mut completions[from..] {
            let pending = self.pending.remove(completion.token);
            completion.token = pending.caller_token;
            if completion.result.is_ok() {
                if let Some(record) = pending.record {
                    let index = self.log.push(record);
                    if let Some(submission) = pending.submission {
                        self.log.completed(submission, index);
                    }
                }
            } else if let Some(submission) = pending.submission {
                self.log.failed(submission);
            }
        }
    }
}

impl<D: BlockDevice> BlockDevice for RecordingDevice<D> {
    /// Another queue recording into the same log: a flush covers what every queue had
    /// completed when it was submitted, as an NVMe flush covers the whole namespace.
    fn new_queue(&self) -> Option<Result<Box<dyn BlockDevice>, DevError>> {
        let inner = self.inner.new_queue()?;
        Some(inner.map(|q| {
            let depth = q.info().queue_depth;
            Box::new(RecordingDevice {
                inner: q,
                log: Arc::clone(&self.log),
                pending: TokenTable::new(depth),
            }) as Box<dyn BlockDevice>
        }))
    }
    fn any_thread_io(&self) -> Option<Box<dyn crate::AnyThreadIo>> {
        // Reads need no recording: they pass to the device as the queue's own do. Writes and
        // flushes beside the queue go into the same log as the queue's, in the order they
        // complete, so a crash state may cut between them as between queued ones.
        Some(Box::new(RecordingSideIo {
            inner: self.inner.any_thread_io()?,
            log: Arc::clone(&self.log),
        }))
    }
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        let record = match &request.op {
            op @ (IoOp::Write { .. } | IoOp::WriteShared { .. }) => {
                let (lba, data, fua) = op.as_write().expect("a write");
                Some(Record::Write {
                    lba,
                    data: Arc::from(&*data),
                    fua,
                })
            }
            IoOp::WriteZeroes { lba, lbas } => Some(Record::WriteZeroes {
                lba: *lba,
                lbas: *lbas,
            }),
            IoOp::Deallocate { lba, lbas } => Some(Record::Deallocate {
                lba: *lba,
                lbas: *lbas,
            }),
            IoOp::Flush => Some(Record::Flush {
                covers: self.log.len(),
            }),
            IoOp::Read { .. } => None,
        };
        let caller_token = request.token;
        let submission = match &record {
            Some(Record::Flush { .. }) | None => None,
            Some(write) => Some(self.log.submit(write.clone())),
        };
        let Some(token) = self.pending.insert(Pending {
            caller_token,
            record,
            submission,
        }) else {
            if let Some(submission) = submission {
                self.log.failed(submission);
            }
            return Err(Rejected {
                request,
                reason: DevError::QueueFull,
            });
        };
        self.inner
            .submit(Request {
                token,
                op: request.op,
            })
            .map_err(|mut rejected| {
                if let Some(submission) = self.pending.remove(token).submission {
                    self.log.failed(submission);
                }
                rejected.request.token = caller_token;
                rejected
            })
    }

    fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, DevError> {
        let from = out.len();
        let count = self.inner.poll(out)?;
        self.translate(out, from);
        Ok(count)
    }

    fn wait(&mut self, out: &mut Vec<IoCompletion>, timeout: Duration) -> Result<usize, DevError> {
        let from = out.len();
        let count = self.inner.wait(out, timeout)?;
        self.translate(out, from);
        Ok(count)
    }

    fn in_flight(&self) -> u32 {
        self.inner.in_flight()
    }

    fn signal_completions_to(&mut self, eventfd: std::os::fd::RawFd) -> bool {
        self.inner.signal_completions_to(eventfd)
    }

    fn run_blocking_work_on(&mut self, cores: &[usize]) -> Result<bool, DevError> {
        self.inner.run_blocking_work_on(cores)
    }

    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        self.inner.sim_access()
    }
}
