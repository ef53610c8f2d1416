//! Requests suspended for metadata: a request whose lookups miss the node cache waits for
//! its tree nodes without holding the reactor.
//!
//! Before a request runs, the reactor runs its lookups deferred ([`probe`], through
//! [`Filesystem::without_waiting`]). A read-only request's probe *is* the request: when
//! nothing was missing, its result is the answer. A request that changes the filesystem is
//! probed with the lookups it starts with (the name in its directory, its inode, the
//! extents it covers) and runs for real only when they were all in memory. When a node was
//! missing, its read is in flight and the request parks until it is answered; the reactor
//! serves other clients meanwhile and runs the request again from its start. A data read
//! is not probed: its lookups run deferred once, as it is planned
//! ([`Filesystem::read_start_deferred`]), and a read that missed parks the same way.
//!
//! # Invariants
//! - One client's requests keep their order: once a request of a client parks, every later
//!   request of that client waits behind it (`blocked`), and they all run again in order.
//!   So an fsync never overtakes the write before it, whatever the cache held. The one
//!   exception is harmless: reads of one client started together run as one set, so a read
//!   whose nodes were in memory may be answered before an earlier read of the same set that
//!   parked (neither changes anything; whatever follows them waits for the parked one).
//! - A parked request is still owed ([`crate::owed`]): a reactor that fails answers it.
//! - Progress: a request parked [`ROUNDS_MAX`] times runs every later stage (routing,
//!   probe, read) without deferring until it has run (it may then wait for the device,
//!   which the device-wait statistics count), so a cache too small for one operation's
//!   lookups never starves it.
//! - Writes wait for staging room the same way ([`MetaWaits::park_for_room`]): a client
//!   whose write would stage data past the engine's bound parks, in order, until write-back
//!   has made room; the reactor serves everyone else meanwhile. Fsyncs and writes wait so
//!   for a due commit's start while it waits for the device pipeline to empty
//!   ([`MetaWaits::park_for_commit`]).
//! - Bounded by the requests owed (each client's capacity).

use crate::op::{Op, Reply};
use crate::queue::Request;
use crate::reply::ReplyQueue;
use engine::{Deferred, EngineError, Filesystem};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Parks of one request before it runs without deferring.
pub(crate) const ROUNDS_MAX: u8 = 4;

/// Commits a request refused for space waits for before its ENOSPC is final: groups a
/// commit gives back reach the pool when the partition that gave them unpins, which may come
/// a round after this reactor's.
pub(crate) const SPACE_ROUNDS_MAX: u8 = 3;

/// A client, by its reply queue's address.
type ClientKey = usize;

fn client_of(reply: &Arc<ReplyQueue>) -> ClientKey {
    Arc::as_ptr(reply) as usize
}

/// What the probe of a request found.
pub(crate) enum Probed {
    /// The request may run now (everything its lookups need is in memory).
    Run(Request),
    /// A read-only request ran deferred and found everything: its answer.
    Answered(Request, Result<Reply, EngineError>),
    /// The request parked; it comes back through [`MetaWaits::resumed`].
    Parked,
}

/// The reactor's suspended requests.
#[derive(Default)]
pub(crate) struct MetaWaits {
    /// Clients with a parked request, and their requests in order (the parked one first).
    blocked: HashMap<ClientKey, VecDeque<Request>>,
    /// The clients waiting for each node read set.
    waiting: HashMap<u64, Vec<ClientKey>>,
    /// Requests whose nodes arrived, in order per client: the next batch runs them first.
    resumed: Vec<Request>,
    /// Times each parked request (client, token) has parked.
    rounds: HashMap<(ClientKey, u64), u8>,
    /// Clients whose write waits for staging room ([`MetaWaits::park_for_room`]).
    room: Vec<ClientKey>,
    /// Clients whose fsync or write waits for a due commit to start
    /// ([`MetaWaits::park_for_commit`]).
    barrier: Vec<ClientKey>,
    /// Clients whose request waits for space a commit gives back, with the generation that
    /// commit must complete ([`MetaWaits::park_for_space`]), and each request's waits.
    space: Vec<(ClientKey, u64)>,
    space_rounds: HashMap<(ClientKey, u64), u8>,
    /// Requests parked so far, for nodes, for staging room and for a commit's start.
    pub parks: u64,
    pub room_parks: u64,
    pub barrier_parks: u64,
    pub space_parks: u64,
}

impl MetaWaits {
    /// True when nothing is parked or waiting to run again.
    pub fn is_empty(&self) -> bool {
        self.blocked.is_empty() && self.resumed.is_empty()
    }

    /// True when `request`'s client has a parked request: it must wait behind it.
    pub fn holds_back(&mut self, request: Request) -> Option<Request> {
        match self.blocked.get_mut(&client_of(&request.reply)) {
            Some(queue) => {
                queue.push_back(request);
                None
            }
            None => Some(request),
        }
    }

    /// Runs `request`'s lookups deferred: it runs now, is answered now, or parks.
    pub fn probe(&mut self, fs: &mut Filesystem, request: Request) -> Probed {
        assert!(
            !self.blocked.contains_key(&client_of(&request.reply)),
            "a blocked client's requests wait behind (holds_back)"
        );
        if !self.may_defer(&request) {
            self.ran(&request);
            return Probed::Run(request);
        }
        match probe(fs, &request.op) {
            Deferred::Ready(None) => {
                self.ran(&request);
                Probed::Run(request)
            }
            Deferred::Ready(Some(result)) => {
                self.ran(&request);
                Probed::Answered(request, result)
            }
            Deferred::Fetching(set) => {
                self.park(request, set);
                Probed::Parked
            }
        }
    }

    /// True when `request` may run deferred: it has parked fewer than [`ROUNDS_MAX`] times.
    /// A read asks this before [`Filesystem::read_start_deferred`] maps it, a request with
    /// several reactors before its routing lookups and again before its probe. The answer
    /// stays false, stage after stage, until the request has run ([`MetaWaits::ran`]
    /// forgets its rounds): were a false answer to forget them, a request that parks in
    /// one stage and runs another without deferring would start counting again at every
    /// round, and could park forever.
    pub fn may_defer(&self, request: &Request) -> bool {
        self.rounds.is_empty()
            || self
                .rounds
                .get(&(client_of(&request.reply), request.token))
                .is_none_or(|&r| r < ROUNDS_MAX)
    }

    /// `request` ran (it did not park): forgets its rounds.
    pub fn ran(&mut self, request: &Request) {
        if !self.rounds.is_empty() {
            self.rounds
                .remove(&(client_of(&request.reply), request.token));
        }
    }

    /// Parks `request` until node read set `set` is answered. Its client's later requests
    /// wait behind it; a client parked already (an earlier read of the same set of reads
    /// parked) keeps its order: this one queues behind that one, and runs again with it.
    pub fn park(&mut self, request: Request, set: u64) {
        let client = client_of(&request.reply);
        *self.rounds.entry((client, request.token)).or_default() += 1;
        self.parks += 1;
        let queue = self.blocked.entry(client).or_default();
        let first = queue.is_empty();
        queue.push_back(request);
        if first {
            self.waiting.entry(set).or_default().push(client);
        }
    }

    /// Parks `request`, a write that would stage data while staging is full
    /// ([`Filesystem::staging_has_room`]), until write-back makes room. Its client's later
    /// requests wait behind it. Not counted in rounds: room comes as the device completes
    /// write-backs, whatever the cache holds, so waiting for it always ends.
    pub fn park_for_room(&mut self, request: Request) {
        self.room_parks += 1;
        let client = self.block(request);
        self.room.push(client);
    }

    /// Parks `request`, an fsync or a write that would add to the device pipeline, while a
    /// due commit waits for that pipeline to empty; it runs again once the commit started
    /// ([`MetaWaits::commit_started`]). Not counted in rounds either.
    pub fn park_for_commit(&mut self, request: Request) {
        self.barrier_parks += 1;
        let client = self.block(request);
        self.barrier.push(client);
    }

    /// True when `request`, refused for space, may wait for a commit again
    /// ([`SPACE_ROUNDS_MAX`]).
    pub fn may_wait_for_space(&self, request: &Request) -> bool {
        self.space_rounds
            .get(&(client_of(&request.reply), request.token))
            .is_none_or(|&r| r < SPACE_ROUNDS_MAX)
    }

    /// Parks `request`, refused for space that a commit would give back, until generation
    /// `generation` is committed and its frees and groups are back ([`MetaWaits::space_made`]).
    /// Its client's later requests wait behind it.
    pub fn park_for_space(&mut self, request: Request, generation: u64) {
        self.space_parks += 1;
        *self
            .space_rounds
            .entry((client_of(&request.reply), request.token))
            .or_default() += 1;
        let client = self.block(request);
        self.space.push((client, generation));
    }

    /// `request` ran to its answer: forgets its waits for space.
    pub fn done_with_space(&mut self, request: &Request) {
        if !self.space_rounds.is_empty() {
            self.space_rounds
                .remove(&(client_of(&request.reply), request.token));
        }
    }

    /// The newest generation a request waits to see completed, if any waits for space.
    pub fn space_wanted(&self) -> Option<u64> {
        self.space.iter().map(|&(_, g)| g).max()
    }

    /// Generations up to `completed` are committed and unpinned: the requests that waited
    /// for them run again, in order.
    pub fn space_made(&mut self, completed: u64) {
        if self.space.is_empty() {
            return;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.space)
            .into_iter()
            .partition(|&(_, g)| g <= completed);
        self.space = waiting;
        self.resume(ready.into_iter().map(|(c, _)| c).collect());
    }

    /// The due commit started: the requests parked for it run again, in order.
    pub fn commit_started(&mut self) {
        let clients = std::mem::take(&mut self.barrier);
        self.resume(clients);
    }

    /// `clients`' parked requests, and those behind them, run again in order.
    fn resume(&mut self, clients: Vec<ClientKey>) {
        for client in clients {
            if let Some(queue) = self.blocked.remove(&client) {
                self.resumed.extend(queue);
            }
        }
    }

    /// Blocks `request`'s client behind it (the client has nothing parked yet).
    fn block(&mut self, request: Request) -> ClientKey {
        let client = client_of(&request.reply);
        let queue = self.blocked.entry(client).or_default();
        assert!(
            queue.is_empty(),
            "a blocked client's requests wait behind (holds_back)"
        );
        queue.push_back(request);
        client
    }

    /// True when a write waits for staging room.
    pub fn waits_for_room(&self) -> bool {
        !self.room.is_empty()
    }

    /// Staging has room: the writes that waited for it, and their clients' later requests,
    /// run again in order.
    pub fn room_made(&mut self) {
        let clients = std::mem::take(&mut self.room);
        self.resume(clients);
    }

    /// Node read set `set` was answered: its clients' requests run again, in order. False
    /// when no parked request waited for it.
    pub fn answered(&mut self, set: u64) -> bool {
        let Some(clients) = self.waiting.remove(&set) else {
            return false;
        };
        self.resume(clients);
        true
    }

    /// The requests to run again (already owed), in order per client.
    pub fn take_resumed(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.resumed)
    }

    pub fn has_resumed(&self) -> bool {
        !self.resumed.is_empty()
    }
}

/// `op`'s lookups, run deferred. `Ready(Some(..))` is a read-only request's own answer;
/// `Ready(None)`: a request that changes the filesystem found what it looks up in memory
/// (whatever the lookups answered: the request itself reports its errors).
fn probe(fs: &mut Filesystem, op: &Op) -> Deferred<Option<Result<Reply, EngineError>>> {
    match op {
        // Read-only: the probe is the request.
        Op::Lookup { .. }
        | Op::Readlink { .. }
        | Op::Readdir { .. }
        | Op::Stat { .. }
        | Op::GetXattr { .. }
        | Op::ListXattr { .. } => fs.without_waiting(|fs| Some(crate::execute::execute_on(fs, op))),
        // A read maps its extents once, deferred, in `Filesystem::read_start_deferred`.
        Op::Read { .. } => unreachable!("reads are mapped deferred by read_start_deferred"),
        Op::Statfs | Op::Sync | Op::Stats => Deferred::Ready(None),
        op => looked_up(fs, |fs| crate::execute::lookups(fs, op)),
    }
}

fn looked_up(
    fs: &mut Filesystem,
    lookups: impl FnOnce(&mut Filesystem),
) -> Deferred<Option<Result<Reply, EngineError>>> {
    match fs.without_waiting(lookups) {
        Deferred::Ready(()) => Deferred::Ready(None),
        Deferred::Fetching(set) => Deferred::Fetching(set),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn request(reply: &Arc<ReplyQueue>, token: u64) -> Request {
        Request {
            op: Op::Stat { ino: 256 },
            token,
            reply: reply.clone(),
            submitted: Instant::now(),
        }
    }

    /// A request goes through several deferred stages (routing with several reactors, then
    /// its probe). Once it has parked [`ROUNDS_MAX`] times, no stage may defer it until it
    /// has run: were one stage's "no" to reset the count, the stages could park it in turn
    /// forever (seen: a reactor cycling a dozen unlinks for seconds until a commit).
    #[test]
    fn a_request_out_of_rounds_runs_every_stage_without_deferring_until_it_ran() {
        let mut meta = MetaWaits::default();
        let reply = Arc::new(ReplyQueue::new(4));
        for set in 0..ROUNDS_MAX as u64 {
            let r = request(&reply, 7);
            assert!(meta.may_defer(&r), "round {set} may still defer");
            meta.park(r, set);
            assert!(meta.answered(set));
            let resumed = meta.take_resumed();
            assert_eq!(resumed.len(), 1);
        }
        let r = request(&reply, 7);
        // The routing stage asks, then the probe stage asks: both must say no.
        assert!(
            !meta.may_defer(&r),
            "out of rounds: routing runs without deferring"
        );
        assert!(!meta.may_defer(&r), "and so does the probe after it");
        // Another request of the same client is not affected.
        assert!(meta.may_defer(&request(&reply, 8)));
        // Once it ran, its count is forgotten (a new request with its token starts afresh).
        meta.ran(&r);
        assert!(meta.may_defer(&r));
        assert!(meta.rounds.is_empty(), "nothing kept for requests that ran");
    }
}
