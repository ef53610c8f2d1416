//! Write-back on the whole filesystem: staging written data, choosing what goes to the
//! device and when (fsync, commit, reads, the thresholds), submitting it in chunks, and the
//! block cache's reads and fills.
//!
//! Layering: [`super::Staged`] and [`super::BlockCache`] hold the data and its bounds and
//! never name [`Filesystem`]; this file drives them with the device multiplexer. [`super`]
//! states the thresholds and why.

use super::{
    move_pieces, Run, PRECOMMIT_STAGED_BYTES, STAGED_HEADROOM_BYTES, STAGE_PIECE_BYTES,
    WRITEBACK_CHUNK_BYTES, WRITEBACK_IN_FLIGHT_MAX_BYTES,
};
use crate::error::Result;
use crate::format::BLOCK_BYTES;
use crate::fs::Filesystem;

impl Filesystem {
    /// Stages whole blocks of `ino`'s data for disk block `disk`. A small write's blocks are
    /// cached too (a database page, a file written and read back); a `streaming` one's
    /// (a write of [`STREAM_WRITE_BYTES`] or more) are not: reads find them staged until they
    /// are on the device, and copying them into the cache would cost a pass over every byte
    /// to keep blocks nobody reads again. `data` is kept as it is, sliced into runs: staging
    /// copies nothing (a streaming writer's bytes were copied twice on the reactor, here and
    /// into the DMA buffer).
    pub(crate) fn stage_data(
        &mut self,
        ino: u64,
        disk: u64,
        data: bytes::Bytes,
        streaming: bool,
    ) -> Result<()> {
        let blocks = (data.len() / BLOCK_BYTES) as u64;
        if !streaming {
            for (i, block) in data.chunks(BLOCK_BYTES).enumerate() {
                self.block_cache.insert(disk + i as u64, block);
            }
        } else {
            // What an earlier use of these blocks left in the cache is stale now.
            self.block_cache.forget(disk..disk + blocks);
        }
        self.staged.bytes += data.len();
        let runs = self.staged.by_ino.entry(ino).or_default();
        for at in (0..data.len()).step_by(STAGE_PIECE_BYTES) {
            let first = disk + (at / BLOCK_BYTES) as u64;
            runs.push(Run {
                disk: first,
                data: data.slice(at..(at + STAGE_PIECE_BYTES).min(data.len())),
                logged: false,
            });
        }
        if self.op.lent {
            // A lent engine never reaches the device's queue ([`Filesystem::write_lent`]
            // keeps staging below every threshold; this holds even if it did not): the
            // owner's next write or room check starts the write-back.
            return Ok(());
        }
        if self.staged.bytes > self.options.staged_park_bytes + STAGED_HEADROOM_BYTES {
            let blocks = self.take_all_staged();
            // Durable only at the next flush: no FUA-only record until then.
            self.log.unflushed_writes = true;
            let written = crate::blocks::write_blocks(&mut *self.dev, blocks);
            self.fail_stop_on_error(written)?;
        } else if self.staged.bytes > PRECOMMIT_STAGED_BYTES.min(self.options.writeback_start_bytes)
            && self.staged.bytes > self.writeback_threshold_bytes()
        {
            self.start_writeback()?;
        }
        Ok(())
    }

    /// Staged bytes past which write-back starts: the mount's threshold, or
    /// [`PRECOMMIT_STAGED_BYTES`] once a commit is near.
    pub(crate) fn writeback_threshold_bytes(&self) -> usize {
        if self.commit_near() {
            PRECOMMIT_STAGED_BYTES.min(self.options.writeback_start_bytes)
        } else {
            // Below the park bound whatever the mount asked: parked writers need write-back
            // to run until there is room for them.
            let park = self.options.staged_park_bytes;
            self.options
                .writeback_start_bytes
                .min(park - WRITEBACK_CHUNK_BYTES.min(park / 2))
        }
    }

    /// True when staging has room for another write: fewer than
    /// [`crate::MountOptions::staged_park_bytes`] staged. Without room, starts the next
    /// write-back chunks the in-flight bound allows and answers again; a reactor parks the
    /// writes that would stage more until the answer turns, and asks again after each poll
    /// of the device (which takes the write-backs' completions). A failed filesystem has
    /// room: the write itself reports the failure.
    pub fn staging_has_room(&mut self) -> bool {
        let park = self.options.staged_park_bytes;
        if self.staged.bytes < park || self.failed.is_some() {
            return true;
        }
        if self.submit_writeback_chunks().is_err() {
            return true;
        }
        self.staged.bytes < park
    }

    /// Hands the data of the lowest-numbered staged inodes to the device in the background
    /// until staging is back under the threshold or the write-backs in flight reach their
    /// bound.
    fn start_writeback(&mut self) -> Result<()> {
        // Completions first, so finished write-backs no longer count against the bound.
        self.log_progress(None)?;
        self.submit_writeback_chunks()
    }

    /// [`Filesystem::start_writeback`] without taking completions first (the caller took
    /// them, or leaves them for its next poll).
    fn submit_writeback_chunks(&mut self) -> Result<()> {
        let threshold_bytes = self.writeback_threshold_bytes();
        while self.staged.bytes > threshold_bytes
            && self.writeback_bytes_in_flight()
                < WRITEBACK_IN_FLIGHT_MAX_BYTES.min(self.options.staged_park_bytes / 2)
        {
            let blocks = self.take_staged_oldest(WRITEBACK_CHUNK_BYTES);
            assert!(
                !blocks.is_empty(),
                "staged bytes are counted with their runs"
            );
            self.log.stats.writeback_bytes += crate::blocks::pieces_bytes(&blocks) as u64;
            self.submit_writeback(blocks)?;
        }
        Ok(())
    }

    /// Takes about `max_bytes` of staged runs (whole runs, so it may take a little more),
    /// the lowest-numbered inodes' oldest runs first, in pieces of whole blocks. Part of an
    /// inode's data may stay staged: a chunk of one large file's data is a chunk too (taking
    /// whole inodes made one 9 MiB chunk of a file written 1 MiB at a time, and that write
    /// held the reactor for 4–8 ms copying it). An fsync or a read of the inode takes the
    /// rest; the next flush covers what went now.
    fn take_staged_oldest(&mut self, max_bytes: usize) -> Vec<(u64, bytes::Bytes)> {
        let mut taken = Vec::new();
        let mut bytes = 0usize;
        while bytes < max_bytes {
            let Some(mut entry) = self.staged.by_ino.first_entry() else {
                break;
            };
            let runs = entry.get_mut();
            let mut n = 0;
            while n < runs.len() && bytes < max_bytes {
                bytes += runs[n].data.len();
                n += 1;
            }
            taken.extend(runs.drain(..n));
            if runs.is_empty() {
                entry.remove();
            }
        }
        self.staged.bytes -= bytes;
        let mut out = Vec::new();
        move_pieces(taken, &mut out);
        out
    }

    /// Takes the staged blocks of `inos`, in pieces of whole blocks (for `write_blocks`).
    pub(crate) fn take_staged<'a>(
        &mut self,
        inos: impl Iterator<Item = &'a u64>,
    ) -> Vec<(u64, bytes::Bytes)> {
        let mut out = Vec::new();
        for ino in inos {
            if let Some(runs) = self.staged.by_ino.remove(ino) {
                self.staged.bytes -= runs.iter().map(|r| r.data.len()).sum::<usize>();
                move_pieces(runs, &mut out);
            }
        }
        out
    }

    /// Bytes of file `ino`'s data staged and not yet written back.
    pub(crate) fn staged_bytes_of(&self, ino: u64) -> usize {
        self.staged
            .by_ino
            .get(&ino)
            .map_or(0, |runs| runs.iter().map(|r| r.data.len()).sum())
    }

    /// True when file `ino` has data staged and not yet written back.
    pub(crate) fn has_staged(&self, ino: u64) -> bool {
        self.staged.by_ino.contains_key(&ino)
    }

    /// The staged (not yet written) content of `ino`'s disk block `disk`, if it is staged.
    pub(crate) fn staged_block(&self, ino: u64, disk: u64) -> Option<&[u8]> {
        let runs = self.staged.by_ino.get(&ino)?;
        // The newest run covering the block wins (a block is staged once per allocation).
        runs.iter().rev().find_map(|run| {
            (run.disk..run.disk + run.blocks())
                .contains(&disk)
                .then(|| {
                    let at = ((disk - run.disk) as usize) * BLOCK_BYTES;
                    &run.data[at..at + BLOCK_BYTES]
                })
        })
    }

    /// The staged blocks of `ino` among disk blocks `first..first + count` that no fsync
    /// record of this generation carries yet, each with its bytes, into `out`; the runs all
    /// of whose blocks are among them into `whole` (as indices for
    /// [`Filesystem::mark_logged`], valid until staging changes).
    pub(crate) fn unlogged_staged<'a>(
        &'a self,
        ino: u64,
        first: u64,
        count: u64,
        out: &mut Vec<(u64, &'a [u8])>,
        whole: &mut Vec<(u64, usize)>,
    ) {
        let Some(runs) = self.staged.by_ino.get(&ino) else {
            return;
        };
        let end = first + count;
        for (index, run) in runs.iter().enumerate() {
            let (from, to) = (run.disk.max(first), (run.disk + run.blocks()).min(end));
            if run.logged || from >= to {
                continue;
            }
            for block in from..to {
                let at = ((block - run.disk) as usize) * BLOCK_BYTES;
                out.push((block, &run.data[at..at + BLOCK_BYTES]));
            }
            if from == run.disk && to == run.disk + run.blocks() {
                whole.push((ino, index));
            }
        }
    }

    /// Marks staged runs (from [`Filesystem::unlogged_staged`]) as carried by a record.
    pub(crate) fn mark_logged(&mut self, runs: &[(u64, usize)]) {
        for &(ino, index) in runs {
            if let Some(run) = self
                .staged
                .by_ino
                .get_mut(&ino)
                .and_then(|runs| runs.get_mut(index))
            {
                run.logged = true;
            }
        }
    }

    /// Takes every staged block.
    pub(crate) fn take_all_staged(&mut self) -> Vec<(u64, bytes::Bytes)> {
        let mut out = Vec::new();
        for (_, runs) in std::mem::take(&mut self.staged.by_ino) {
            move_pieces(runs, &mut out);
        }
        self.staged.bytes = 0;
        out
    }

    /// Hands `ino`'s staged data to the device in the background (before its blocks are
    /// read): the device pipeline answers a read of those blocks from their bytes, or starts
    /// it once their write completes, so neither the read nor the reactor waits here.
    pub(crate) fn write_back(&mut self, ino: u64) -> Result<()> {
        if !self.staged.by_ino.contains_key(&ino) {
            return Ok(());
        }
        self.check_writable()?;
        let blocks = self.take_staged(std::iter::once(&ino));
        self.log.stats.writeback_bytes += crate::blocks::pieces_bytes(&blocks) as u64;
        self.submit_writeback(blocks).map(drop)
    }

    /// Drops `ino`'s staged data (the inode is gone; its blocks were freed).
    pub(crate) fn drop_staged(&mut self, ino: u64) {
        if let Some(runs) = self.staged.by_ino.remove(&ino) {
            self.staged.bytes -= runs.iter().map(|r| r.data.len()).sum::<usize>();
        }
    }

    /// Copies bytes `src` of the `crcs.len()` blocks at `disk` into `out` (as long as `src`)
    /// from the cache, if every one of those blocks is there and matches its crc; false, with
    /// `out` untouched, otherwise.
    pub(crate) fn copy_cached(
        &mut self,
        disk: u64,
        crcs: &[u32],
        src: std::ops::Range<usize>,
        out: &mut [u8],
    ) -> bool {
        assert_eq!(src.len(), out.len(), "a cached copy fills its destination");
        assert!(
            src.end <= crcs.len() * BLOCK_BYTES,
            "the blocks cover the range"
        );
        let first = src.start / BLOCK_BYTES;
        let last = src.end.div_ceil(BLOCK_BYTES);
        for (i, &crc) in crcs.iter().enumerate().take(last).skip(first) {
            if self.block_cache.get_checked(disk + i as u64, crc).is_none() {
                return false;
            }
        }
        for i in first..last {
            let block = self
                .block_cache
                .get(disk + i as u64)
                .expect("checked above");
            let from = src.start.max(i * BLOCK_BYTES);
            let to = src.end.min((i + 1) * BLOCK_BYTES);
            out[from - src.start..to - src.start]
                .copy_from_slice(&block[from - i * BLOCK_BYTES..to - i * BLOCK_BYTES]);
        }
        self.block_cache.hits += (last - first) as u64;
        true
    }

    /// Data blocks the block cache holds now.
    pub fn data_cache_held(&self) -> usize {
        self.block_cache.blocks.len()
    }

    /// Data blocks reads took from the block cache, and from the device, since mount.
    pub fn data_cache_hits(&self) -> (u64, u64) {
        (self.block_cache.hits, self.block_cache.device_blocks)
    }

    /// Bytes of file data staged and not yet written.
    pub fn staged_bytes(&self) -> usize {
        self.staged.bytes()
    }
}

#[cfg(test)]
mod tests {
    use crate::{Filesystem, MkfsOptions, MountOptions};
    use bytes::Bytes;
    use nvme::backend::mem::{MemConfig, MemDevice};

    fn mounted() -> Filesystem {
        mounted_with(128 << 10, MountOptions::default())
    }

    /// A fresh filesystem on a memory device whose largest I/O is `buf_bytes`.
    fn mounted_with(buf_bytes: usize, options: MountOptions) -> Filesystem {
        let dev = MemDevice::new(MemConfig {
            capacity_bytes: 64 << 20,
            lba_size_bytes: 4096,
            queue_depth: 32,
            buf_bytes,
            buf_count: 64,
        })
        .unwrap();
        let dev = Filesystem::mkfs(Box::new(dev), &MkfsOptions::default()).unwrap();
        Filesystem::mount(dev, options).unwrap()
    }

    /// Where each staged run of `ino` lies: true for a run inside `within`.
    fn runs_inside(fs: &Filesystem, ino: u64, within: &[u8]) -> Vec<bool> {
        let span = within.as_ptr_range();
        fs.staged.by_ino[&ino]
            .iter()
            .map(|run| span.contains(&run.data.as_ptr()))
            .collect()
    }

    /// A write whose bytes are handed over (a reactor's request) is staged as those very
    /// bytes, sliced, never copied; a borrowed one is copied, as its caller keeps its
    /// buffer. Both read back, staged and once written.
    #[test]
    fn a_handed_over_write_is_staged_without_a_copy() {
        let mut fs = mounted();
        let root = fs.root();
        let shared = fs.create(root, b"shared", 0o644, 0, 0).unwrap().ino;
        let borrowed = fs.create(root, b"borrowed", 0o644, 0, 0).unwrap().ino;
        let data: Vec<u8> = (0..1usize << 20).map(|i| (i % 253) as u8).collect();
        let data = Bytes::from(data);

        assert_eq!(
            fs.write_shared(shared, 0, data.clone().into()).unwrap(),
            data.len()
        );
        let inside = runs_inside(&fs, shared, &data);
        assert!(inside.len() > 1, "a 1 MiB write is staged in pieces");
        assert!(
            inside.iter().all(|&i| i),
            "a handed-over write was copied: {inside:?}"
        );

        assert_eq!(fs.write(borrowed, 0, &data).unwrap(), data.len());
        let inside = runs_inside(&fs, borrowed, &data);
        assert!(
            inside.iter().all(|&i| !i),
            "a borrowed write shares its caller's buffer"
        );

        for ino in [shared, borrowed] {
            assert_eq!(fs.read(ino, 0, data.len()).unwrap(), &data[..]);
        }
        fs.sync().unwrap();
        for ino in [shared, borrowed] {
            assert_eq!(fs.read(ino, 0, data.len()).unwrap(), &data[..]);
        }
    }

    /// Staged data goes to the device from the staged bytes themselves when they are aligned
    /// (a large borrowed write at a block offset is copied into aligned memory: the one copy
    /// it needs), in runs longer than the largest I/O (the device's largest shared write),
    /// and through a DMA buffer when not aligned (a write at an offset that is not a
    /// multiple of the block size leaves its blocks misaligned in its copy), in runs no
    /// longer than the largest I/O. Either way the device ends up holding the data: a
    /// remount reads it back.
    #[test]
    fn aligned_staged_writes_go_to_the_device_without_a_copy() {
        let mut fs = mounted();
        let root = fs.root();
        let aligned = fs.create(root, b"aligned", 0o644, 0, 0).unwrap().ino;
        let shifted = fs.create(root, b"shifted", 0o644, 0, 0).unwrap().ino;
        let data: Vec<u8> = (0..1usize << 20).map(|i| (i % 251) as u8).collect();
        fs.sync().unwrap();
        let runs_min = (data.len() / (128 << 10)) as u64;

        let before = fs.device_wait_stats();
        fs.write(aligned, 0, &data).unwrap();
        fs.sync().unwrap();
        let after = fs.device_wait_stats();
        let shared_bytes = after.shared_write_bytes - before.shared_write_bytes;
        let shared = after.shared_writes - before.shared_writes;
        assert!(
            shared_bytes >= data.len() as u64,
            "an aligned 1 MiB write went out copied: {before:?} -> {after:?}"
        );
        assert!(
            shared < runs_min,
            "{shared} shared writes: none longer than the largest I/O"
        );

        let before = after;
        fs.write(shifted, 512, &data).unwrap();
        fs.sync().unwrap();
        let after = fs.device_wait_stats();
        assert!(
            after.copied_write_bytes - before.copied_write_bytes >= data.len() as u64,
            "a misaligned write's runs were not copied: {before:?} -> {after:?}"
        );
        assert!(after.copied_writes - before.copied_writes >= runs_min);

        let dev = fs.unmount().unwrap();
        let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
        assert_eq!(fs.read(aligned, 0, data.len()).unwrap(), &data[..]);
        let mut expect = vec![0u8; 512];
        expect.extend_from_slice(&data);
        assert_eq!(fs.read(shifted, 0, expect.len()).unwrap(), expect);
    }

    /// The blocks written back are kept for reuse as tree nodes only when each is a block's
    /// allocation alone. On a device whose largest I/O (16 KiB) is smaller than a staged run,
    /// write-back cuts runs into single blocks, slices of the handed-over write: the last of
    /// them to go is the only holder of the whole write's memory.
    #[test]
    fn spare_blocks_never_pin_a_whole_writes_memory() {
        // Write-back starts at once: staging lets go of the runs it hands the device.
        let mut fs = mounted_with(
            16 << 10,
            MountOptions {
                writeback_start_bytes: 16 << 10,
                ..MountOptions::default()
            },
        );
        let root = fs.root();
        for i in 0..8u8 {
            let ino = fs
                .create(root, format!("f{i}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino;
            let data = Bytes::from(vec![i; 68 << 10]);
            fs.write_shared(ino, 0, data.into()).unwrap();
        }
        fs.sync().unwrap();
        let spare = &fs.dev.spare_blocks;
        assert!(
            !spare.is_empty(),
            "a commit's node blocks are kept for reuse"
        );
        for block in spare {
            assert_eq!(
                block.capacity(),
                crate::format::BLOCK_BYTES,
                "a spare pins more"
            );
        }
    }
}
