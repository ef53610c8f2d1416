//! Delayed index items on the whole filesystem: inserting each directory's pending items into
//! its shard's tree in batches of consecutive keys, when a commit prepares, when the bound is
//! reached, or when one directory must be complete in its tree (a log record that needs it).
//!
//! Layering: the pending items and their bounds live in [`super::DelayedIndex`], which never
//! names [`Filesystem`]; this file inserts them with the tree layer. [`super`] states the
//! invariants (one index entry per name, the space each batch may take is reserved).

use super::{DelayedStats, DIR_BATCH_MAX, MAX_PENDING, PREPARE_STEP_ITEMS};
use crate::error::Result;
use crate::format::items::encode_names;
use crate::format::{ItemKind, Key};
use crate::fs::Filesystem;

impl Filesystem {
    /// Inserts every pending index item into its directory's tree, one batch of consecutive
    /// keys per directory. Called at the start of every commit and when too many are pending.
    pub(crate) fn flush_delayed_index(&mut self) -> Result<()> {
        while let Some(&dir) = self.namespace.delayed.pending.keys().next() {
            self.flush_delayed_dir(dir)?;
        }
        Ok(())
    }

    /// A step of a commit's preparation, run between requests before the commit starts:
    /// inserts pending index items, whole directories at a time, until about
    /// [`PREPARE_STEP_ITEMS`] went in, so the commit's pause has few left to insert. Returns
    /// true when none is pending. A failure makes the filesystem fail-stop.
    pub fn commit_prepare(&mut self) -> Result<bool> {
        self.check_writable()?;
        let was_in_commit = std::mem::replace(&mut self.commit.in_commit, true);
        let mut inserted = 0;
        let mut result = Ok(());
        while inserted < PREPARE_STEP_ITEMS {
            let Some(&dir) = self.namespace.delayed.pending.keys().next() else {
                break;
            };
            inserted += self.namespace.delayed.pending_in(dir);
            result = self.flush_delayed_dir(dir);
            if result.is_err() {
                break;
            }
        }
        self.commit.in_commit = was_in_commit;
        self.fail_stop_on_error(result)?;
        Ok(self.namespace.delayed.len() == 0)
    }

    /// After an operation: inserts the batches that reached [`DIR_BATCH_MAX`], or every
    /// pending item past [`MAX_PENDING`], without waiting for the commit. Their blocks come
    /// out of the commit floor that was reserved for them; a failure (a device error) makes
    /// the filesystem fail-stop.
    pub(crate) fn flush_due_delayed(&mut self) -> Result<()> {
        if self.namespace.delayed.due.is_empty() && self.namespace.delayed.len() <= MAX_PENDING {
            return Ok(());
        }
        let was_in_commit = std::mem::replace(&mut self.commit.in_commit, true);
        let mut result = Ok(());
        while let Some(dir) = self.namespace.delayed.due.pop() {
            if self.namespace.delayed.pending_in(dir) >= DIR_BATCH_MAX {
                result = result.and_then(|()| self.flush_delayed_dir(dir));
            }
        }
        if self.namespace.delayed.len() > MAX_PENDING {
            result = result.and_then(|()| self.flush_delayed_index());
        }
        self.commit.in_commit = was_in_commit;
        self.fail_stop_on_error(result)
    }

    /// Inserts the pending index items of `dir` into its tree as one batch. Its blocks were
    /// reserved in the commit floor when the names were added.
    pub(crate) fn flush_delayed_dir(&mut self, dir: u64) -> Result<()> {
        if let Some(items) = self.namespace.delayed.take_dir(dir) {
            let shard = self.shard_of(dir);
            let batch = items.len() as u64;
            let mut released = Vec::with_capacity(items.len());
            self.with_tree(shard, true, |tree, io| {
                for (seq, entry) in items {
                    tree.insert(
                        io,
                        Key::new(dir, ItemKind::DirIndex, seq),
                        encode_names(std::slice::from_ref(&entry)),
                    )?;
                    released.push(seq);
                }
                Ok(())
            })?;
            for seq in released {
                self.namespace.delayed.tracker.release((dir, seq));
            }
            let stats = &mut self.namespace.delayed.stats;
            stats.batches += 1;
            stats.items += batch;
            stats.max_batch = stats.max_batch.max(batch);
        }
        Ok(())
    }

    pub fn delayed_stats(&self) -> DelayedStats {
        self.namespace.delayed.stats
    }
}
