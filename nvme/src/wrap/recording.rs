//! The recording wrapper: every write, write-zeroes, deallocate and flush that completes
//! successfully is appended to a shared [`WriteLog`] in completion order, with the written bytes
//! as they were submitted. Crash testing replays a prefix of the log onto the starting image and
//! drops or tears what no flush covered ([`super::crash`]).
//!
//! Invariant: a `Flush` record carries `covers`, the number of records completed when the flush
//! was *submitted*; exactly those are made durable by it. Writes completing while the flush was
//! in flight are not covered, as on real hardware.

use super::TokenTable;
use crate::{
    BlockDevice, Completion, DevError, DeviceInfo, DmaPool, Op, Rejected, Request, SimAccess,
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

/// The shared, append-only log. Tests keep a handle while the device is owned elsewhere.
#[derive(Debug, Default)]
pub struct WriteLog {
    records: Mutex<Vec<Record>>,
}

impl WriteLog {
    pub fn snapshot(&self) -> Vec<Record> {
        self.records.lock().expect("write log lock").clone()
    }
    pub fn len(&self) -> usize {
        self.records.lock().expect("write log lock").len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn push(&self, record: Record) {
        self.records.lock().expect("write log lock").push(record);
    }
}

struct Pending {
    caller_token: u64,
    /// What to log if the op succeeds; a flush's `covers` is fixed at submission.
    record: Option<Record>,
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

    fn translate(&mut self, completions: &mut [Completion], from: usize) {
        for completion in &mut completions[from..] {
            let pending = self.pending.remove(completion.token);
            completion.token = pending.caller_token;
            if completion.result.is_ok() {
                if let Some(record) = pending.record {
                    self.log.push(record);
                }
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
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn pool(&self) -> &DmaPool {
        self.inner.pool()
    }

    fn submit(&mut self, request: Request) -> Result<(), Rejected> {
        let record = match &request.op {
            Op::Write { lba, buf, fua } => Some(Record::Write {
                lba: *lba,
                data: Arc::from(buf.as_slice()),
                fua: *fua,
            }),
            Op::WriteZeroes { lba, lbas } => Some(Record::WriteZeroes {
                lba: *lba,
                lbas: *lbas,
            }),
            Op::Deallocate { lba, lbas } => Some(Record::Deallocate {
                lba: *lba,
                lbas: *lbas,
            }),
            Op::Flush => Some(Record::Flush {
                covers: self.log.len(),
            }),
            Op::Read { .. } => None,
        };
        let caller_token = request.token;
        let Some(token) = self.pending.insert(Pending {
            caller_token,
            record,
        }) else {
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
                self.pending.remove(token);
                rejected.request.token = caller_token;
                rejected
            })
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, DevError> {
        let from = out.len();
        let count = self.inner.poll(out)?;
        self.translate(out, from);
        Ok(count)
    }

    fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<usize, DevError> {
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

    fn sim_access(&mut self) -> Option<&mut dyn SimAccess> {
        self.inner.sim_access()
    }
}
