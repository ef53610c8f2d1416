//! Advisory byte-range locks (`corefs_setlk`, `corefs_testlk`), as fcntl(2)'s F_SETLK and
//! F_GETLK take them, for programs that share files across processes (SQLite's locking is
//! built on them). One table per filesystem: in process, in the filesystem's handle; through
//! a storage service, in the server, for every connection.
//!
//! # Invariants
//! - An owner's ranges on one inode never overlap each other: setting a range first takes
//!   the owner's own coverage of it away (splitting ranges that reach past it), as POSIX
//!   does, so a read lock can become a write lock and back, and an unlock of part of a range
//!   leaves the rest.
//! - A lock is granted only if no *other* owner holds an overlapping range where either is a
//!   write lock; otherwise nothing changes (EAGAIN: the caller decides whether to retry).
//! - Owners: a process (in process: the filesystem handle; through a service: the
//!   connection). Locks are released by their owner's unlock, and all at once when the owner
//!   goes (`corefs_close`, a client's connection closing): a killed process leaves none.
//! - Bounded: at most [`RANGES_MAX`] ranges per table (ENOLCK past it, as the kernel answers
//!   when it runs out).

use std::collections::HashMap;

/// Ranges one table holds at most, over every inode and owner.
pub const RANGES_MAX: usize = 1 << 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Kind {
    Read,
    Write,
    Unlock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    owner: u64,
    start: u64,
    /// Exclusive end; `u64::MAX` stands for "to the end of the file, however it grows".
    end: u64,
    write: bool,
}

impl Range {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start < end && start < self.end
    }
}

/// Why a lock was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Another owner holds a conflicting range (EAGAIN).
    Conflict { owner: u64, write: bool },
    /// The table is full (ENOLCK).
    Full,
}

#[derive(Default)]
pub struct LockTable {
    by_ino: HashMap<u64, Vec<Range>>,
    ranges: usize,
}

/// `[start, start + len)`, with `len` 0 meaning to the end of the file (as fcntl).
fn span(start: u64, len: u64) -> (u64, u64) {
    if len == 0 {
        (start, u64::MAX)
    } else {
        (start, start.saturating_add(len))
    }
}

impl LockTable {
    /// The first range of another owner that a lock of `kind` over the span would conflict
    /// with.
    fn conflict(&self, ino: u64, owner: u64, kind: Kind, start: u64, end: u64) -> Option<Range> {
        let write = kind == Kind::Write;
        self.by_ino
            .get(&ino)?
            .iter()
            .copied()
            .find(|r| r.owner != owner && r.overlaps(start, end) && (write || r.write))
    }

    /// F_GETLK: whether `owner` could take `kind` over `len` bytes at `start` now (None),
    /// or the range in the way.
    pub fn test(&self, ino: u64, owner: u64, kind: Kind, start: u64, len: u64) -> Option<Refused> {
        if kind == Kind::Unlock {
            return None;
        }
        let (start, end) = span(start, len);
        self.conflict(ino, owner, kind, start, end)
            .map(|r| Refused::Conflict {
                owner: r.owner,
                write: r.write,
            })
    }

    /// F_SETLK: takes (or with `Unlock` gives back) `owner`'s lock over `len` bytes at
    /// `start`, never waiting.
    pub fn set(
        &mut self,
        ino: u64,
        owner: u64,
        kind: Kind,
        start: u64,
        len: u64,
    ) -> Result<(), Refused> {
        let (start, end) = span(start, len);
        if kind != Kind::Unlock {
            if let Some(r) = self.conflict(ino, owner, kind, start, end) {
                return Err(Refused::Conflict {
                    owner: r.owner,
                    write: r.write,
                });
            }
            // At most two pieces of a split range are added besides the new one.
            if self.ranges + 2 >= RANGES_MAX {
                return Err(Refused::Full);
            }
        }
        let list = self.by_ino.entry(ino).or_default();
        let before = list.len();
        let mut kept = Vec::with_capacity(list.len() + 2);
        for r in list.drain(..) {
            if r.owner != owner || !r.overlaps(start, end) {
                kept.push(r);
                continue;
            }
            if r.start < start {
                kept.push(Range { end: start, ..r });
            }
            if r.end > end {
                kept.push(Range { start: end, ..r });
            }
        }
        if kind != Kind::Unlock {
            kept.push(Range {
                owner,
                start,
                end,
                write: kind == Kind::Write,
            });
        }
        self.ranges = self.ranges + kept.len() - before;
        if kept.is_empty() {
            self.by_ino.remove(&ino);
        } else {
            *list = kept;
        }
        Ok(())
    }

    /// Gives back every lock `owner` holds (its process went, or closed the filesystem).
    pub fn release_owner(&mut self, owner: u64) -> usize {
        let mut released = 0;
        self.by_ino.retain(|_, list| {
            let before = list.len();
            list.retain(|r| r.owner != owner);
            released += before - list.len();
            !list.is_empty()
        });
        self.ranges -= released;
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_splits_upgrades_and_release() {
        let mut t = LockTable::default();
        // Two readers share; a writer is refused until both leave its range.
        t.set(1, 10, Kind::Read, 0, 100).unwrap();
        t.set(1, 20, Kind::Read, 50, 100).unwrap();
        assert!(matches!(
            t.set(1, 30, Kind::Write, 90, 1),
            Err(Refused::Conflict { .. })
        ));
        // Owner 10 unlocks the middle of its range: [0,40) and [60,100) stay.
        t.set(1, 10, Kind::Unlock, 40, 20).unwrap();
        assert_eq!(t.test(1, 30, Kind::Write, 45, 5), None, "the hole is free");
        assert!(
            t.test(1, 30, Kind::Write, 30, 5).is_some(),
            "[0,40) is still read-locked"
        );
        // Owner 20 upgrades its own range (its read lock does not conflict with itself),
        // refused while owner 10's read lock overlaps it.
        assert!(t.set(1, 20, Kind::Write, 50, 100).is_err());
        t.set(1, 10, Kind::Unlock, 0, 0).unwrap();
        t.set(1, 20, Kind::Write, 50, 100).unwrap();
        assert!(t.test(1, 10, Kind::Read, 149, 1).is_some());
        assert_eq!(t.test(1, 10, Kind::Read, 150, 1), None);
        // Another inode is another file.
        t.set(2, 10, Kind::Write, 0, 0).unwrap();
        assert_eq!(t.release_owner(20), 1);
        assert_eq!(t.release_owner(10), 1);
        assert_eq!(t.ranges, 0);
        assert!(t.by_ino.is_empty());
    }

    #[test]
    fn a_table_stops_at_its_bound() {
        let mut t = LockTable::default();
        let mut refused = None;
        for k in 0..RANGES_MAX as u64 {
            if let Err(e) = t.set(1, 1, Kind::Read, k * 2, 1) {
                refused = Some(e);
                break;
            }
        }
        assert_eq!(refused, Some(Refused::Full));
    }
}
