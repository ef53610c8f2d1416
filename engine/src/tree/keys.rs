//! Small helpers of the tree's walks: a key's successor and prefetching the next node.

use super::*;

impl Key {
    /// The smallest key greater than this one, if any.
    pub fn successor(&self) -> Option<Key> {
        if let Some(offset) = self.offset.checked_add(1) {
            return Some(Key { offset, ..*self });
        }
        let next_kind = (self.kind as u8..=u8::MAX)
            .skip(1)
            .find_map(crate::format::ItemKind::from_u8);
        match next_kind {
            Some(kind) => Some(Key {
                kind,
                offset: 0,
                ..*self
            }),
            None => self.objectid.checked_add(1).map(|objectid| Key {
                objectid,
                ..Key::MIN
            }),
        }
    }
}

/// Asks the CPU to start loading every cache line of `slice`. A binary search over a node
/// otherwise takes one dependent cache miss per probe (the profile of creates showed them
/// dominating lookups of random directory items); issued together, the misses overlap.
#[inline]
pub(super) fn prefetch<T>(slice: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = slice.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(slice);
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: prefetch is a hint; it never faults, and the address is inside `slice`.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    start.add(offset),
                );
            }
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slice;
}

pub(super) trait Prefetched {
    fn prefetched(&self) -> &Self;
}

impl<T> Prefetched for Vec<T> {
    fn prefetched(&self) -> &Self {
        prefetch(self);
        self
    }
}
