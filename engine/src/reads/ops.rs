//! Asynchronous data reads on the whole filesystem: planning a set of reads (extents,
//! staged data, the block cache), submitting what is left as device reads of the read class,
//! reaping and verifying them, and read-ahead for sequential streams.
//!
//! Layering: the read sets, streams and their bounds live in [`super`] and never name
//! [`Filesystem`]; this file plans reads with the file layer and submits them through the
//! device multiplexer. [`super`] states the invariants and the fault model.

use super::{
    check_blocks, copy_piece, give_joined, take_blocks, ReadIo, ReadOut, ReadResult, ReadSet,
    ReadStart, ReadStats, ReadsStarted, RunSource, SetKind, Stream, LENT_READ_BYTES_MAX, STREAMS,
};
use crate::blocks::block_lba;
use crate::error::{EngineError, Result};
use crate::fetch::Deferred;
use crate::file::ReadPiece;
use crate::format::BLOCK_BYTES;
use crate::fs::Filesystem;
use nvme::{BlockDevice, IoOp, Request};
use std::time::Duration;

impl Filesystem {
    /// Starts a set of reads `(ino, offset, len)`, each as [`Filesystem::read`] would return
    /// it. Metadata comes from the node cache or a synchronous read; data blocks not in
    /// memory are read from the device in the background. The whole set is answered at
    /// once (tools, tests and [`Filesystem::read_many`] want every result together).
    pub fn read_start(&mut self, requests: &[(u64, u64, usize)]) -> ReadStart {
        let started = self.start_reads(requests, &vec![false; requests.len()], false);
        assert!(
            started.parked.is_empty(),
            "no request deferred, none parked"
        );
        match started.pending[..] {
            [] => ReadStart::Done(started.done.into_iter().map(|(_, r)| r).collect()),
            [(set, _)] => {
                assert!(
                    started.done.is_empty(),
                    "an unsplit set keeps every request"
                );
                ReadStart::Pending(set)
            }
            _ => unreachable!("an unsplit start makes one set"),
        }
    }

    /// As [`Filesystem::read_start`], for a reactor: each request is answered as early as
    /// it can be. A request served from memory is answered now (in
    /// [`ReadsStarted::done`]), never held behind another request's device read; only the
    /// requests that need the device form the pending set. The lookups (inode and extents)
    /// of each request with `may_defer` set run deferred ([`Filesystem::without_waiting`]):
    /// a request whose tree nodes are not in memory is left out, its nodes are read in the
    /// background, and it is returned in [`ReadsStarted::parked`] to run again once that
    /// node set is answered. Mapping once, deferred, is what lets a reactor read without a
    /// separate probe.
    pub fn read_start_deferred(
        &mut self,
        requests: &[(u64, u64, usize)],
        may_defer: &[bool],
    ) -> ReadsStarted {
        self.start_reads(requests, may_defer, true)
    }

    /// Plans `requests` and submits their device reads; with `split`, requests that need no
    /// device read are answered at once instead of joining the set.
    fn start_reads(
        &mut self,
        requests: &[(u64, u64, usize)],
        may_defer: &[bool],
        split: bool,
    ) -> ReadsStarted {
        assert_eq!(requests.len(), may_defer.len(), "one flag per request");
        let mut started = ReadsStarted::default();
        let mut pieces: Vec<ReadPiece> = Vec::new();
        // The set's results, and which request (index in `requests`) each answers; pieces
        // number their request by its place in the set.
        let mut outs: Vec<ReadResult> = Vec::with_capacity(requests.len());
        let mut answers: Vec<usize> = Vec::with_capacity(requests.len());
        let mut followed = Vec::with_capacity(requests.len());
        for (index, &(ino, offset, len)) in requests.iter().enumerate() {
            let map = if may_defer[index] {
                match self.without_waiting(|fs| fs.map_read(ino, offset, len)) {
                    Deferred::Ready(map) => map,
                    Deferred::Fetching(set) => {
                        started.parked.push((index, set));
                        continue;
                    }
                }
            } else {
                self.map_read(ino, offset, len)
            };
            let mut mine = Vec::new();
            // Split, each request needing the device is a set of its own (its result is
            // the set's first); unsplit, the request's place in the one set.
            let place = if split { 0 } else { outs.len() };
            let moves_atime = map.as_ref().is_ok_and(|m| m.moves_atime);
            let planned = map.and_then(|map| self.plan_read(place, map, &mut mine));
            if planned.is_ok() {
                followed.push((ino, offset, len as u64, moves_atime));
            }
            if split {
                match (&planned, &self.failed) {
                    (Ok(_), Some(e)) if !mine.is_empty() => {
                        // A failed filesystem reads no more from the device.
                        started.done.push((index, Err(e.clone())));
                    }
                    (Ok(_), _) if !mine.is_empty() => {
                        let set = self.queue_set(vec![planned], mine, SetKind::Data);
                        self.reads.stats.sets_async += 1;
                        started.pending.push((set, index));
                    }
                    _ => started.done.push((index, planned)),
                }
                continue;
            }
            if planned.is_ok() {
                pieces.append(&mut mine);
            }
            outs.push(planned);
            answers.push(index);
        }
        for (ino, offset, len, moves_atime) in followed {
            self.follow_stream(ino, offset, len);
            // Not for a read a lookup makes on the way (deferred).
            if moves_atime && !self.fetch.deferring {
                self.touch_atime(ino);
            }
        }
        if pieces.is_empty() || self.failed.is_some() {
            // Nothing for the device, or a failed filesystem, which reads no more from it.
            if let Some(e) = &self.failed {
                for piece in &pieces {
                    outs[piece.request] = Err(e.clone());
                }
            }
            started.done.extend(answers.into_iter().zip(outs));
            started.done.sort_by_key(|&(index, _)| index);
            return started;
        }
        let id = self.queue_set(outs, pieces, SetKind::Data);
        self.reads.stats.sets_async += 1;
        // Unsplit ([`Filesystem::read_start`]): the one set answers every request, in order.
        started.pending.push((id, 0));
        started
    }

    /// Starts reading the tree-node blocks `addrs` in the background, as one set whose
    /// blocks go to the fetched map ([`crate::fetch`]); returns the set's number.
    pub(crate) fn start_node_reads(&mut self, addrs: &[u64]) -> u64 {
        assert!(!addrs.is_empty(), "a node set reads something");
        let pieces = addrs
            .iter()
            .enumerate()
            .map(|(index, &addr)| ReadPiece {
                request: index,
                ino: 0,
                disk: addr,
                count: 1,
                crcs: Vec::new(),
                src: 0..0,
                dst: 0..0,
                joins: None,
            })
            .collect();
        self.reads.stats.node_sets += 1;
        self.queue_set(Vec::new(), pieces, SetKind::Nodes)
    }

    /// A read of `len` bytes at `offset` of file `ino` answered from memory alone, for a
    /// thread that is not the device's owner ([`Filesystem::from_memory`]): `None` when it
    /// needs the device (blocks or nodes not in memory), when it moves the access time, or
    /// when it continues a sequential stream whose read-ahead is due — the owner then runs
    /// it and reads ahead. Otherwise it is what [`Filesystem::read`] returns, and the stream
    /// is followed as the owner would.
    pub fn read_from_memory(
        &mut self,
        ino: u64,
        offset: u64,
        len: usize,
    ) -> Option<Result<Vec<u8>>> {
        self.read_out(ino, offset, ReadOut::Alloc(len), false)
            .map(|r| r.map(ReadOut::into_vec))
    }

    /// [`Filesystem::read_from_memory`] (`beside_queue`: [`Filesystem::read_lent`]) into the
    /// caller's `out`: how many bytes it read there (fewer at the end of the file). Each byte
    /// is copied once, from the block cache, staging or the block read beside the queue into
    /// `out`; nothing is allocated for the data.
    pub fn read_memory_into(
        &mut self,
        ino: u64,
        offset: u64,
        out: &mut [u8],
        beside_queue: bool,
    ) -> Option<Result<usize>> {
        self.read_out(ino, offset, ReadOut::Into(out), beside_queue)
            .map(|r| r.map(|out| out.len()))
    }

    /// A read from memory into `out`; `beside`: data blocks memory misses are read beside
    /// the queue ([`Filesystem::read_lent`]).
    fn read_out<'a>(
        &mut self,
        ino: u64,
        offset: u64,
        out: ReadOut<'a>,
        beside: bool,
    ) -> Option<Result<ReadOut<'a>>> {
        let len = out.len();
        if !beside || !self.dev.reads_beside_queue() || len > LENT_READ_BYTES_MAX {
            return self.memory_read_out(ino, offset, out);
        }
        if self.stream_fetch_due(ino, offset, len as u64) {
            return None;
        }
        let (out, pieces) =
            self.run_from_memory(|fs| fs.plan_from_memory(ino, offset, out), true)?;
        let mut out = match out {
            Ok(out) if pieces.is_empty() => {
                self.follow_stream_lent(ino, offset, len);
                return Some(Ok(out));
            }
            Ok(out) => out,
            Err(e) => return Some(Err(e)),
        };
        // Staged data goes to the device first, and blocks a read-ahead is fetching come
        // from that read: both are the owner's to handle (here, the second would be read
        // twice).
        if self.has_staged(ino) || pieces.iter().any(|p| p.joins.is_some()) {
            self.fetch.stats.from_memory_misses += 1;
            return None;
        }
        self.dev.lend(crate::mux::Lent::Reads);
        let mut result = Ok(());
        for piece in &pieces {
            match self.read_piece_beside(piece) {
                Ok(bytes) => {
                    self.reads.stats.lent_read_blocks += piece.count;
                    copy_piece(piece, 0, &bytes, out.bytes_mut());
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.dev.lend(crate::mux::Lent::No);
        self.reads.stats.lent_reads += 1;
        if result.is_ok() {
            self.follow_stream_lent(ino, offset, len);
        }
        Some(result.map(|()| out))
    }

    fn memory_read_out<'a>(
        &mut self,
        ino: u64,
        offset: u64,
        out: ReadOut<'a>,
    ) -> Option<Result<ReadOut<'a>>> {
        let len = out.len();
        if self.stream_fetch_due(ino, offset, len as u64) {
            return None;
        }
        let (out, _) = self.run_from_memory(|fs| fs.plan_from_memory(ino, offset, out), false)?;
        if out.is_ok() {
            self.follow_stream_lent(ino, offset, len);
        }
        Some(out)
    }

    /// As [`Filesystem::read_from_memory`], and when what misses is data blocks alone (the
    /// file's inode and extents are in memory), reads them synchronously beside the device's
    /// queue ([`nvme::AnyThreadIo`]) in the calling thread: for a client whose reactor
    /// sleeps, one system call on its own core instead of two wake-ups (docs/reactors.md).
    /// Blocks a background write holds come from it. Each block is checked against its
    /// extent's crc as the reactor's reads check it, and cached. `None`, untouched, as
    /// [`Filesystem::read_from_memory`], and also when the file has data staged (the owner
    /// writes it back before reading the device), or when the read is longer than
    /// [`LENT_READ_BYTES_MAX`]. A device error fails the filesystem, as on the owner's path.
    pub fn read_lent(&mut self, ino: u64, offset: u64, len: usize) -> Option<Result<Vec<u8>>> {
        self.read_out(ino, offset, ReadOut::Alloc(len), true)
            .map(|r| r.map(ReadOut::into_vec))
    }

    /// Reads `pieces` (single edge blocks of a lent write, [`Filesystem::write_lent_reading_edges`])
    /// beside the queue into the block cache, each checked against its crc. A device error
    /// fails the filesystem; a block that fails its crc is an error (nothing was changed).
    pub(crate) fn read_edges_beside(&mut self, pieces: &[ReadPiece]) -> Result<()> {
        for piece in pieces {
            self.read_piece_beside(piece)?;
        }
        Ok(())
    }

    /// Reads `piece`'s blocks synchronously beside the device's queue, checks each against
    /// its crc and caches those that match: the bytes, or the device error (which fails
    /// the filesystem) or the first mismatch.
    fn read_piece_beside(&mut self, piece: &ReadPiece) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; piece.count as usize * BLOCK_BYTES];
        if let Err(e) = self.dev.read_blocks_beside(piece.disk, &mut bytes) {
            let e = EngineError::Device(e);
            self.failed.get_or_insert(e.clone());
            return Err(e);
        }
        self.block_cache.device_blocks += piece.count;
        let mut computed = Vec::new();
        match check_blocks(
            piece,
            0,
            &bytes,
            &mut self.block_cache,
            false,
            &mut computed,
        ) {
            Some(bad) => Err(bad),
            None => Ok(bytes),
        }
    }

    /// The plan of a read from memory alone (run by [`Filesystem::run_from_memory`]):
    /// what memory holds, copied; the data blocks it misses noted; declined when the read
    /// would move the access time (a change for the owner).
    fn plan_from_memory<'a>(
        &mut self,
        ino: u64,
        offset: u64,
        out: ReadOut<'a>,
    ) -> Result<ReadOut<'a>> {
        let map = self.map_read(ino, offset, out.len())?;
        if map.moves_atime {
            self.fetch.declined = true;
            return Err(crate::EngineError::WouldBlock);
        }
        let mut pieces = Vec::new();
        let out = match out {
            ReadOut::Alloc(_) => self.plan_read(0, map, &mut pieces).map(ReadOut::Vec)?,
            ReadOut::Into(out) => {
                let out = &mut out[..map.len()];
                self.plan_read_into(0, map, &mut pieces, out, false)?;
                ReadOut::Into(out)
            }
            ReadOut::Vec(_) => unreachable!("asked as a length or a buffer"),
        };
        assert!(pieces.is_empty(), "a run from memory plans no device read");
        Ok(out)
    }

    /// [`Filesystem::follow_stream`] for a read a lent engine answered: a read-ahead it
    /// started by mistake trips the device's assertion before it reaches the queue.
    fn follow_stream_lent(&mut self, ino: u64, offset: u64, len: usize) {
        let fetches = self.reads.stats.ahead_sets;
        self.dev.lend(crate::mux::Lent::Nothing);
        self.follow_stream(ino, offset, len as u64);
        self.dev.lend(crate::mux::Lent::No);
        assert_eq!(
            fetches, self.reads.stats.ahead_sets,
            "a read from memory started no read-ahead"
        );
    }

    /// Whether [`Filesystem::follow_stream`] would read ahead for this read (changing
    /// nothing).
    fn stream_fetch_due(&self, ino: u64, offset: u64, len: u64) -> bool {
        if self.block_cache.capacity_blocks() == 0 || len == 0 || self.failed.is_some() {
            return false;
        }
        let end = offset.saturating_add(len);
        let cache_bytes = self.block_cache.capacity_blocks() as u64 * BLOCK_BYTES as u64;
        self.reads
            .streams
            .iter()
            .any(|s| s.ino == ino && s.last_used > 0 && s.fetch_due(offset, end, cache_bytes))
    }

    /// Notes a read of `len` bytes at `offset` of file `ino`; when it continues the file's
    /// last read and less than half its window is read ahead, fetches up to a window past
    /// it into the block cache in the background (what is not cached or on its way
    /// already), and grows the window for the next time ([`super::READAHEAD_BYTES`]).
    fn follow_stream(&mut self, ino: u64, offset: u64, len: u64) {
        // Not inside a deferred run (a read made by a lookup): read-ahead defers itself.
        if self.block_cache.capacity_blocks() == 0
            || len == 0
            || self.failed.is_some()
            || self.fetch.deferring
        {
            return;
        }
        self.reads.stream_clock += 1;
        let clock = self.reads.stream_clock;
        let end = offset.saturating_add(len);
        let cache_bytes = self.block_cache.capacity_blocks() as u64 * BLOCK_BYTES as u64;
        let streams = &mut self.reads.streams;
        let at = match streams.iter().position(|s| s.ino == ino && s.last_used > 0) {
            Some(at) => at,
            None => {
                let oldest = (0..STREAMS)
                    .min_by_key(|&i| streams[i].last_used)
                    .expect("STREAMS > 0");
                streams[oldest] = Stream {
                    ino,
                    next: end,
                    ahead_to: end,
                    window: 0,
                    last_used: clock,
                };
                return;
            }
        };
        let stream = &mut streams[at];
        stream.last_used = clock;
        let sequential = stream.next == offset;
        let due = stream.fetch_due(offset, end, cache_bytes);
        stream.next = end;
        if !sequential {
            // A jump starts the stream again, with the smallest window.
            stream.ahead_to = end;
            stream.window = 0;
            return;
        }
        if !due {
            return;
        }
        let window = stream.window_for(len, cache_bytes);
        let from = stream.ahead_to.max(end);
        let to = end + window;
        let before = (stream.ahead_to, stream.window);
        stream.ahead_to = to;
        stream.window = window
            .saturating_mul(2)
            .min(super::window_max(len, cache_bytes));
        match self.without_waiting(|fs| fs.plan_readahead(ino, from, to)) {
            Deferred::Ready(pieces) => {
                if !pieces.is_empty() {
                    self.start_ahead(pieces);
                }
            }
            // The extents are not in memory: their nodes are fetched in the background, and
            // the next sequential read plans this window again.
            Deferred::Fetching(_) => {
                let stream = &mut self.reads.streams[at];
                (stream.ahead_to, stream.window) = before;
            }
        }
    }

    /// The longest run of blocks from `disk` on (at most `crcs.len()`, the crc each must
    /// have) that come from one place: the block cache, one read-ahead's device read on its
    /// way, or the device.
    pub(crate) fn read_run(&mut self, disk: u64, crcs: &[u32]) -> (u64, RunSource) {
        assert!(!crcs.is_empty(), "a run of at least one block");
        let source = |fs: &mut Self, i: usize| {
            let block = disk + i as u64;
            if fs.block_cache.holds(block, crcs[i]) {
                RunSource::Cache
            } else if let Some((first, _)) = fs.reads.ahead_covering(block) {
                RunSource::Ahead(first)
            } else {
                RunSource::Device
            }
        };
        let kind = source(self, 0);
        let mut run = 1;
        while run < crcs.len() && source(self, run) == kind {
            run += 1;
        }
        (run as u64, kind)
    }

    /// Starts a read-ahead set: its blocks go to the block cache when they arrive.
    fn start_ahead(&mut self, pieces: Vec<ReadPiece>) {
        self.reads.stats.ahead_sets += 1;
        self.reads.stats.ahead_blocks += pieces.iter().map(|p| p.count).sum::<u64>();
        self.queue_set(Vec::new(), pieces, SetKind::Ahead);
    }

    /// Starts reading `pieces` into the block cache for a deferred run that waits for them;
    /// returns the set's number, answered (with no results) when they are in.
    pub(crate) fn start_fill(&mut self, pieces: Vec<ReadPiece>) -> u64 {
        self.queue_set(Vec::new(), pieces, SetKind::Fill)
    }

    /// Queues a set's device reads (each piece cut at the device's largest I/O), records
    /// the set, submits what has room, and returns its number.
    fn queue_set(&mut self, outs: Vec<ReadResult>, pieces: Vec<ReadPiece>, kind: SetKind) -> u64 {
        let max_blocks = (self.dev.info().max_io_bytes as usize / BLOCK_BYTES).max(1) as u64;
        let id = self.reads.next_set;
        self.reads.next_set += 1;
        let mut ios = 0;
        for (index, piece) in pieces.iter().enumerate() {
            // A piece joining a read-ahead's device read counts it as one of the set's, and
            // is handed its blocks when it completes (planned just now, it is still on its
            // way; if not, the piece reads them itself).
            if let Some(first) = piece.joins {
                if let Some(ahead) = self.reads.ahead.get_mut(&first) {
                    assert!(
                        piece.disk >= first && piece.disk + piece.count <= first + ahead.blocks,
                        "a joining piece lies inside the read-ahead's device read"
                    );
                    ahead.joiners.push((id, index));
                    self.reads.stats.ahead_joined_blocks += piece.count;
                    ios += 1;
                    continue;
                }
            }
            let mut at = 0;
            while at < piece.count {
                let blocks = (piece.count - at).min(max_blocks);
                let io = ReadIo {
                    set: id,
                    piece: index,
                    at: at as usize * BLOCK_BYTES,
                    block: piece.disk + at,
                    blocks,
                };
                if kind == SetKind::Ahead {
                    assert!(
                        self.reads.ahead_free(io.block, blocks),
                        "read-ahead plans no block already on its way"
                    );
                    self.reads.ahead.insert(
                        io.block,
                        super::AheadIo {
                            blocks,
                            joiners: Vec::new(),
                        },
                    );
                }
                self.reads.queued.push_back(io);
                ios += 1;
                at += blocks;
            }
        }
        let data = if kind == SetKind::Nodes {
            pieces
                .iter()
                .map(|p| vec![0u8; p.count as usize * BLOCK_BYTES])
                .collect()
        } else {
            Vec::new()
        };
        self.reads.sets.insert(
            id,
            ReadSet {
                outs,
                pieces,
                data,
                ios_left: ios,
                generation: self.commit.generation,
                failed: None,
                kind,
            },
        );
        let stats = &mut self.reads.stats;
        stats.device_reads += ios as u64;
        stats.sets_in_flight_max = stats.sets_in_flight_max.max(self.reads.sets.len() as u64);
        self.submit_reads();
        // To the device now, not at the reactor's next poll: a read planned early in a batch
        // is on the device while the rest are planned. Handing a batch's reads over together
        // held each one for the planning of all (at queue depth 32 on a file image, 0.84x
        // the reads per second of handing each set over as it is planned).
        if let Err(e) = self.dev.submit_now() {
            self.reads_queue_failed(e);
        }
        id
    }

    /// Sets of reads started and not handed out yet.
    pub fn reads_in_flight(&self) -> usize {
        self.reads.sets.len() + self.reads.ready.len()
    }

    /// The sets of reads finished since the last call, each with its results in order;
    /// with `wait`, sleeps up to that long for the device when none is.
    pub fn read_progress(&mut self, wait: Option<Duration>) -> Vec<(u64, Vec<ReadResult>)> {
        self.reap_reads(wait);
        self.reads.ready.drain(..).collect()
    }

    /// Asynchronous read counters.
    pub fn read_stats(&self) -> ReadStats {
        self.reads.stats
    }

    /// Synchronous waits for the device so far ([`crate::mux::DeviceWaitStats`]).
    pub fn device_wait_stats(&self) -> crate::mux::DeviceWaitStats {
        self.dev.waits
    }

    /// Reads the device for `requests` and waits: [`Filesystem::read_start`], then
    /// [`Filesystem::read_progress`] until this set is back (others finishing meanwhile stay
    /// for their caller).
    pub fn read_many(&mut self, requests: &[(u64, u64, usize)]) -> Vec<ReadResult> {
        let id = match self.read_start(requests) {
            ReadStart::Done(outs) => return outs,
            ReadStart::Pending(id) => id,
        };
        loop {
            if let Some(at) = self.reads.ready.iter().position(|(set, _)| *set == id) {
                return self.reads.ready.remove(at).expect("found").1;
            }
            self.reap_reads(Some(Duration::from_millis(100)));
        }
    }

    /// True while a read planned in generation `generation` or before is in flight: blocks
    /// that generation freed must stay pinned until it finishes.
    pub fn unpin_waits_for_reads(&self) -> bool {
        self.commit
            .unpin_pending
            .is_some_and(|g| self.reads.sets.values().any(|s| s.generation <= g))
    }

    /// Waits for every read planned in generation `generation` or before (their results
    /// stay for their caller): what a forced unpin of that generation does first.
    pub(crate) fn finish_reads_through(&mut self, generation: u64) {
        while self.reads.sets.values().any(|s| s.generation <= generation) {
            self.reap_reads(Some(Duration::from_millis(100)));
        }
    }

    /// Submits queued device reads while there is room: at most half the queue in
    /// asynchronous reads, and half the DMA buffers left for synchronous I/O and write-back.
    fn submit_reads(&mut self) {
        let depth = self.dev.info().queue_depth / 2;
        let keep = (self.dev.pool().buf_count() as usize / 2).max(1);
        while let Some(io) = self.reads.queued.front().copied() {
            if self.dev.reads_in_flight() >= depth.max(1) || self.dev.pool().free_count() <= keep {
                self.reads.stats.device_reads_queued += 1;
                return;
            }
            let Some(buf) = self.dev.pool().alloc(io.blocks as usize * BLOCK_BYTES) else {
                return;
            };
            self.reads.queued.pop_front();
            let number = self.reads.next_io;
            self.reads.next_io = (self.reads.next_io + 1) & !crate::mux::TAG_MASK;
            let lba = block_lba(&*self.dev, io.block);
            let request = Request {
                token: crate::mux::READ | number,
                op: IoOp::Read { lba, buf },
            };
            match self.dev.submit_read(request) {
                Ok(()) => {
                    self.reads
                        .in_flight
                        .insert(number, (io, std::time::Instant::now()));
                }
                Err(rejected) if rejected.reason == nvme::DevError::QueueFull => {
                    self.reads.queued.push_front(io);
                    self.reads.stats.device_reads_queued += 1;
                    return;
                }
                Err(rejected) => self.read_io_done(io, Err(rejected.reason), None),
            }
        }
    }

    /// Takes the device's completed reads, finishes the sets they complete, and submits
    /// what waited for room.
    fn reap_reads(&mut self, wait: Option<Duration>) {
        let completions = match self.dev.poll_reads(wait) {
            Ok(c) => c,
            Err(e) => return self.reads_queue_failed(e),
        };
        let reaped_at = std::time::Instant::now();
        for c in completions {
            let number = c.token & !crate::mux::TAG_MASK;
            let (io, submitted_at) = self
                .reads
                .in_flight
                .remove(&number)
                .expect("a read completion belongs to a read in flight");
            self.reads.stats.device_reads_done += 1;
            self.reads.stats.device_read_ns_sum +=
                reaped_at.saturating_duration_since(submitted_at).as_nanos() as u64;
            self.read_io_done(io, c.result, c.buf);
        }
        self.submit_reads();
    }

    /// The queue itself failed: every read in flight is lost with it, and the filesystem
    /// fails.
    fn reads_queue_failed(&mut self, e: nvme::DevError) {
        self.failed.get_or_insert(EngineError::Device(e.clone()));
        let ios: Vec<ReadIo> = self
            .reads
            .in_flight
            .drain()
            .map(|(_, (io, _))| io)
            .chain(self.reads.queued.drain(..))
            .collect();
        for io in ios {
            self.read_io_done(io, Err(e.clone()), None);
        }
    }

    /// One device read completed (or failed to submit).
    fn read_io_done(
        &mut self,
        io: ReadIo,
        result: std::result::Result<(), nvme::DevError>,
        buf: Option<nvme::DmaBuf>,
    ) {
        let set = self
            .reads
            .sets
            .get_mut(&io.set)
            .expect("a device read belongs to a set in flight");
        let mut computed = Vec::new();
        match &result {
            Ok(()) => {
                let buf = buf.as_ref().expect("a read completion returns its buffer");
                let len = io.blocks as usize * BLOCK_BYTES;
                assert_eq!(buf.as_slice().len(), len, "device read length");
                match set.kind {
                    SetKind::Nodes => {
                        set.data[io.piece][io.at..io.at + len].copy_from_slice(buf.as_slice())
                    }
                    SetKind::Data | SetKind::Ahead | SetKind::Fill => take_blocks(
                        set,
                        &io,
                        buf.as_slice(),
                        &mut self.block_cache,
                        &mut computed,
                    ),
                }
            }
            Err(e) => {
                set.failed.get_or_insert(EngineError::Device(e.clone()));
                self.failed.get_or_insert(EngineError::Device(e.clone()));
            }
        }
        let ahead = set.kind == SetKind::Ahead;
        self.io_counted(io.set);
        if !ahead {
            return;
        }
        // The reads that joined this one take their blocks from it.
        let joined = self
            .reads
            .ahead
            .remove(&io.block)
            .expect("a read-ahead's device read is indexed until it completes");
        for (set_id, piece) in joined.joiners {
            let set = self
                .reads
                .sets
                .get_mut(&set_id)
                .expect("a joining set waits for the read it joined");
            match (&result, &buf) {
                (Ok(()), Some(buf)) => give_joined(
                    set,
                    piece,
                    io.block,
                    buf.as_slice(),
                    &computed,
                    &mut self.block_cache,
                ),
                (Err(e), _) => {
                    set.failed.get_or_insert(EngineError::Device(e.clone()));
                }
                (Ok(()), None) => unreachable!("a read completion returns its buffer"),
            }
            self.io_counted(set_id);
        }
    }

    /// One of set `id`'s device reads (its own or one it joined) is done: the set finishes
    /// with its last.
    fn io_counted(&mut self, id: u64) {
        let set = self.reads.sets.get_mut(&id).expect("a set in flight");
        set.ios_left -= 1;
        if set.ios_left == 0 {
            let set = self.reads.sets.remove(&id).expect("looked up above");
            let ahead = set.kind == SetKind::Ahead;
            let outs = self.finish_set(set);
            // A read-ahead is nobody's to collect.
            if !ahead {
                self.reads.ready.push_back((id, outs));
            }
        }
    }

    /// A set whose device reads all completed: a node set's blocks go to the fetched map; a
    /// data set's outputs are filled already ([`take_blocks`]) unless the device failed.
    fn finish_set(&mut self, set: ReadSet) -> Vec<ReadResult> {
        match set.kind {
            SetKind::Nodes => {
                // Checked when the tree takes a block, against the pointer it holds then.
                for (piece, data) in set.pieces.iter().zip(set.data) {
                    match set.failed {
                        Some(_) => self.fetch.lost(piece.disk),
                        None => self.fetch.arrived(piece.disk, data),
                    }
                }
                Vec::new()
            }
            SetKind::Ahead | SetKind::Fill => Vec::new(),
            SetKind::Data => {
                let ReadSet {
                    mut outs,
                    pieces,
                    failed,
                    ..
                } = set;
                if let Some(e) = failed {
                    for piece in &pieces {
                        outs[piece.request] = Err(e.clone());
                    }
                }
                outs
            }
        }
    }
}
