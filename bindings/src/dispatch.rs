//! The one way a call reaches the engine: a thread's [`Conn`] is a reactor client of an
//! in-process mount, or a client of a storage service's connection ([`crate::service`]).
//! Everything above it (paths, handles, atomic batches, the C ABI) is the same for both.

use crate::service::client::{ReadDest, RemoteClient};
use engine::EngineError;
use reactor::{Client, Completion, Op, Reply, SubmitError};
use std::time::Duration;

pub(crate) enum Conn {
    Local(Client),
    Remote(RemoteClient),
}

impl Conn {
    pub fn call(&mut self, op: Op) -> Result<Reply, EngineError> {
        match self {
            Conn::Local(c) => c.call(op),
            Conn::Remote(c) => c.call(op),
        }
    }

    /// Releases a hold on `ino` (a handle closed): through a service without waiting for
    /// the answer ([`RemoteClient::post_release`]), in process as any call.
    pub fn release(&mut self, ino: u64) -> Result<(), EngineError> {
        match self {
            Conn::Local(c) => c.call(Op::Release { ino }).map(drop),
            Conn::Remote(c) => c.post_release(ino),
        }
    }

    pub fn submit(&mut self, op: Op, token: u64) -> Result<(), SubmitError> {
        match self {
            Conn::Local(c) => c.submit(op, token),
            Conn::Remote(c) => c.submit(op, token),
        }
    }

    /// Submits a write of `data` at `offset` of `ino` (with `append`, at its end,
    /// atomically), copied during the call: in process into the staging copy
    /// ([`engine::Staged::copy_of`]), through a service straight into the ring
    /// ([`RemoteClient::submit_write`]).
    pub fn submit_write(
        &mut self,
        ino: u64,
        offset: u64,
        append: bool,
        data: &[u8],
        token: u64,
    ) -> Result<(), SubmitError> {
        match self {
            Conn::Local(c) => {
                let data = engine::Staged::copy_of(data);
                c.submit(Op::write_or_append(ino, offset, append, data), token)
            }
            Conn::Remote(c) => c.submit_write(ino, offset, append, data, token),
        }
    }

    /// As [`Conn::submit`], for a read whose data goes to `into`: through a service it is
    /// decoded straight there and completes as [`Reply::Placed`]; in process it completes
    /// with its data as any read.
    pub fn submit_read(&mut self, op: Op, token: u64, into: ReadDest) -> Result<(), SubmitError> {
        match self {
            Conn::Local(c) => c.submit(op, token),
            Conn::Remote(c) => c.submit_into(op, token, Some(into)),
        }
    }

    pub fn poll(&mut self, out: &mut Vec<Completion>) -> usize {
        match self {
            Conn::Local(c) => c.poll(out),
            Conn::Remote(c) => c.poll(out),
        }
    }

    pub fn wait(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> usize {
        match self {
            Conn::Local(c) => c.wait(out, timeout),
            Conn::Remote(c) => c.wait(out, timeout),
        }
    }

    /// Reads up to `out.len()` bytes of `ino` at `offset` into `out`; returns how many.
    /// In process a read memory answers is copied once, into `out`; through a service the
    /// answer's data goes from its slot straight into `out`.
    pub fn read_into(
        &mut self,
        ino: u64,
        offset: u64,
        out: &mut [u8],
    ) -> Result<usize, EngineError> {
        match self {
            Conn::Local(c) => c.read_into(ino, offset, out),
            Conn::Remote(c) => c.read_into(ino, offset, out),
        }
    }

    /// Writes `data` at `offset` of `ino` (with `append`, at its end, atomically); the
    /// reply is [`Reply::Written`] or [`Reply::Appended`]. In process the bytes are copied
    /// once, into the staging copy the engine keeps ([`engine::Staged::copy_of`]); through a
    /// service once, from `data` straight into the slot ([`RemoteClient::write_from`]).
    pub fn write_from(
        &mut self,
        ino: u64,
        offset: u64,
        append: bool,
        data: &[u8],
    ) -> Result<Reply, EngineError> {
        match self {
            Conn::Local(c) => {
                let data = engine::Staged::copy_of(data);
                c.call(Op::write_or_append(ino, offset, append, data))
            }
            Conn::Remote(c) => c.write_from(ino, offset, append, data),
        }
    }

    /// The service client, when this thread reaches the engine through a server.
    pub fn remote(&mut self) -> Option<&mut RemoteClient> {
        match self {
            Conn::Local(_) => None,
            Conn::Remote(c) => Some(c),
        }
    }

    /// Requests sent (each a round trip: to a reactor, or to the server).
    #[cfg(feature = "sim")]
    pub fn requests_sent(&self) -> u64 {
        match self {
            Conn::Local(c) => c.requests_sent(),
            Conn::Remote(c) => c.requests_sent(),
        }
    }

    /// Whether this thread streams large transfers and so sleeps for their answers
    /// ([`reactor::Client::streaming`], [`RemoteClient::streaming`]).
    #[cfg(feature = "sim")]
    pub fn streaming(&self) -> bool {
        match self {
            Conn::Local(c) => c.streaming(),
            Conn::Remote(c) => c.streaming(),
        }
    }

    /// Requests this thread ran itself on the reactor's engine (never through a service).
    #[cfg(feature = "sim")]
    pub fn requests_ran_here(&self) -> u64 {
        match self {
            Conn::Local(c) => c.requests_ran_here(),
            Conn::Remote(_) => 0,
        }
    }
}
