//! The kernel's references to inodes (FUSE's lookup counts) and the engine holds they take:
//! see the module doc of [`super`].

use super::convert::call;
use engine::inode::ROOT_INO;
use reactor::{Client, Op};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// Stripes of [`KernelRefs`]: an inode's first reference holds its stripe's lock across a
/// reactor call, which then delays only the inodes of that stripe.
pub(super) const REF_STRIPES: usize = 64;

/// The kernel's references to inodes: its lookup count of each inode it was handed (FUSE's
/// `nlookup`), the first of which holds the inode in the engine (module doc). The root is
/// never counted: the kernel holds it for the whole mount, and the engine never deletes it.
pub(super) struct KernelRefs {
    stripes: [Mutex<HashMap<u64, u64>>; REF_STRIPES],
}

impl Default for KernelRefs {
    fn default() -> KernelRefs {
        KernelRefs {
            stripes: std::array::from_fn(|_| Mutex::default()),
        }
    }
}

impl KernelRefs {
    pub(super) fn lock(&self, ino: u64) -> MutexGuard<'_, HashMap<u64, u64>> {
        self.stripes[(ino % REF_STRIPES as u64) as usize]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one reference to `ino` that is about to be handed to the kernel. The first one
    /// takes the engine hold, with the stripe's lock held so that no forget can release it
    /// before it exists.
    pub(super) fn add(&self, client: &mut Client, ino: u64) -> Result<(), i32> {
        if ino == ROOT_INO {
            return Ok(());
        }
        let mut counts = self.lock(ino);
        match counts.get_mut(&ino) {
            Some(count) => *count = count.saturating_add(1),
            None => {
                call(client, Op::Hold { ino })?;
                counts.insert(ino, 1);
            }
        }
        Ok(())
    }

    /// Counts one reference to `ino`, which the engine already holds for it (an
    /// [`Op::Open`]'s hold): the first reference keeps that hold; a later one gives it back,
    /// the first's being enough.
    pub(super) fn adopt(&self, client: &mut Client, ino: u64) {
        let mut counts = self.lock(ino);
        match counts.get_mut(&ino) {
            Some(count) => {
                *count = count.saturating_add(1);
                drop(counts);
                if let Err(e) = call(client, Op::Release { ino }) {
                    tracing::warn!("releasing a second hold of inode {ino}: errno {e}");
                }
            }
            None => {
                counts.insert(ino, 1);
            }
        }
    }

    /// The kernel forgot `nlookup` references to `ino`; the last one releases the hold (which
    /// deletes an orphan). An inode never counted (the root) is ignored.
    pub(super) fn forget(&self, client: &mut Client, ino: u64, nlookup: u64) {
        let mut counts = self.lock(ino);
        let Some(count) = counts.get_mut(&ino) else {
            return;
        };
        *count = count.saturating_sub(nlookup);
        if *count > 0 {
            return;
        }
        counts.remove(&ino);
        if let Err(e) = call(client, Op::Release { ino }) {
            tracing::warn!("releasing inode {ino} after the kernel forgot it: errno {e}");
        }
    }

    /// Releases every hold left (at unmount, when the kernel forgets nothing more): orphans
    /// are deleted now rather than by the next mount. Returns the holds released.
    pub(super) fn release_all(&self, client: &mut Client) -> usize {
        let mut released = 0;
        for stripe in &self.stripes {
            let mut counts = stripe.lock().unwrap_or_else(|p| p.into_inner());
            for (ino, _) in counts.drain() {
                released += 1;
                if let Err(e) = call(client, Op::Release { ino }) {
                    tracing::warn!("releasing inode {ino} at unmount: errno {e}");
                }
            }
        }
        released
    }
}
